"""`spmdkit demo` (what `make demo` runs) shows the Megatron MLP block and proves it sound."""

from __future__ import annotations

import io

from spmdkit.cli.demo import run_demo


def test_demo_runs_and_is_sound() -> None:
    out = io.StringIO()
    assert run_demo(out) == 0
    text = out.getvalue()
    assert text.count(": sound") == 5
    assert "every answer sound" in text
    # the row-parallel matmul leaves its output partial over tp; the residual add all-reduces it
    assert "[dp:S(0), tp:P(sum)]" in text
    assert "reshards needed in this forward pass: 1" in text
    assert "h2 before add (all-reduce(sum) over tp)" in text
