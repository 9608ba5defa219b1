"""The data-parallel gradient reduction after the backward of Megatron-LM 2021-2022's local DDP
(``--no-grad-overlap``, ``Runtime.grad_overlap``): one buffer reduced once the backward is done,
in the flat step and on every pipeline rank."""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import replace
from typing import Any

import pytest

from spmdkit.cli import main
from spmdkit.cost.devices import DEVICES, cost_model, recost
from spmdkit.cost.step import estimate_step
from spmdkit.planner.planning import plan_model
from spmdkit.program.runtime import Runtime

A100 = DEVICES["a100-80gb"]


def test_no_grad_overlap_reduces_every_gradient_after_the_backward() -> None:
    plan = plan_model("llama-7b", "dp=4", "dp", {"layers": 2, "seq": 512})[1]
    plan = recost(plan, cost_model(plan.mesh, A100))
    on = estimate_step(plan, A100, 512)
    off = estimate_step(replace(plan, runtime=Runtime(grad_overlap=False)), A100, 512)
    assert len(on.buckets) > 1 and len(off.buckets) == 1
    b = off.buckets[0]
    assert b.bytes == sum(x.bytes for x in on.buckets)
    last_backward = max(t[1] + t[2] + t[3] + t[4] for t, op in zip(off.timeline, plan.program.ops)
                        if op.phase == "backward")
    assert b.start_s == pytest.approx(last_backward)  # launched at the end of the backward
    assert off.step_overlap_s > on.step_overlap_s


def _pipeline(*extra: str) -> dict[str, Any]:
    argv = ["plan", "--model", "llama-7b", "--layers", "4", "--seq", "512", "--mesh", "pp=2,dp=2",
            "--strategy", "dp", "--device", "a100-80gb", "--batch", "8", "--microbatches", "4", "--json", *extra]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(argv) == 0
    return json.loads(buf.getvalue())  # type: ignore[no-any-return]


def test_no_grad_overlap_in_the_pipeline_and_its_flag() -> None:
    on, off = _pipeline(), _pipeline("--no-grad-overlap")
    assert Runtime(grad_overlap=False).to_json()["grad_overlap"] is False and "grad_overlap" not in Runtime().to_json()
    p_on, p_off = on["pipeline"], off["pipeline"]
    assert p_off["pipeline_s"] == pytest.approx(p_on["pipeline_s"])  # the schedule itself is the same
    assert p_off["step_overlap_s"] > p_on["step_overlap_s"]


def test_the_step_line_says_where_the_reductions_run(tmp_path: Any) -> None:
    # the second figure read 'with the gradient reductions overlapped with the backward' under
    # --no-grad-overlap too, the flag that puts them after it (report, pipeline report, --html page)
    def text(*argv: str) -> str:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            assert main(["plan", "--model", "llama-7b", "--layers", "2", "--seq", "512", "--strategy", "dp",
                         "--device", "a100-80gb", "--batch", "8", *argv]) == 0
        return next(x for x in out.getvalue().splitlines() if x.startswith("step time: "))

    assert "ms with the gradient reductions overlapped with the backward (" in text("--mesh", "dp=4")
    assert "ms with the framework's overlaps, the gradient reductions after the last backward (--no-grad-overlap) (" \
        in text("--mesh", "dp=4", "--no-grad-overlap")
    assert text("--mesh", "pp=2,dp=2", "--microbatches", "4").endswith(" overlapping the last backward")
    assert text("--mesh", "pp=2,dp=2", "--microbatches", "4", "--no-grad-overlap").endswith(
        "ms with the gradient reductions after the last backward (--no-grad-overlap)")
    page = tmp_path / "p.html"
    text("--mesh", "dp=4", "--no-grad-overlap", "--html", str(page))
    assert "with the gradient reductions after it (--no-grad-overlap)" in page.read_text()
