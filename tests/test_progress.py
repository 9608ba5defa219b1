"""spmdkit.outputs.progress: a one-line display on a terminal, nothing at all on a pipe."""

from __future__ import annotations

import io
from typing import Any

from spmdkit.outputs.progress import Progress, is_terminal


class FakeTty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_nothing_written_when_not_a_terminal() -> None:
    s = io.StringIO()
    with Progress("searching", total=3, stream=s) as bar:
        for k in range(3):
            bar.advance(note=f"config {k}")
        bar(3, 3)
    assert s.getvalue() == ""
    assert not bar.enabled


def test_a_terminal_gets_the_bar_then_it_is_erased() -> None:
    s = FakeTty()
    bar = Progress("searching", total=4, stream=s, interval=0.0, width=200)
    bar.advance(note="dp=2,tp=4")
    first = s.getvalue()
    assert first.startswith("\rsearching [#####---------------] 1/4 (25%)")
    assert "dp=2,tp=4" in first
    bar.update(4)
    assert "4/4 (100%)" in s.getvalue()
    bar.close()
    out = s.getvalue()
    assert out.endswith("\r")
    tail = out[out.rindex("\r", 0, len(out) - 1):]  # the erasing write: blanks over the line
    assert tail.strip() == ""
    n = len(out)
    bar.advance()
    assert len(s.getvalue()) == n  # closed: nothing more


def test_throttled_redraws_but_the_first_and_last_always_shown() -> None:
    s = FakeTty()
    bar = Progress("x", total=1000, stream=s, interval=3600.0, width=200)
    for k in range(1000):
        bar.update(k + 1)
    draws = s.getvalue().count("\r")
    assert draws == 2  # 1/1000 and 1000/1000
    assert "1000/1000" in s.getvalue()


def test_unknown_total_is_a_counter_and_a_shorter_line_is_padded() -> None:
    s = FakeTty()
    bar = Progress("ops", stream=s, interval=0.0, width=200)
    bar.update(5, note="a long note here")
    bar.update(6, note="")
    lines = s.getvalue().split("\r")[1:]
    assert lines[0].startswith("ops: 5 ")
    assert lines[1].startswith("ops: 6 ")
    assert len(lines[1]) == len(lines[0])  # blanks cover the longer previous text


def test_line_fits_the_width() -> None:
    bar = Progress("label", total=2, stream=io.StringIO(), width=30)
    bar.update(1, note="n" * 100)
    assert len(bar.line()) <= 29


def test_is_terminal_without_or_with_a_failing_isatty() -> None:
    class Broken:
        def isatty(self) -> Any:
            raise ValueError("closed")

    assert not is_terminal(object())
    assert not is_terminal(Broken())
    assert is_terminal(FakeTty())


def _verify_ns(**kw: Any) -> Any:
    import argparse

    return argparse.Namespace(**{"rules": ["matmul"], "cases": 3, "seed": 0, "mode": "forward",
                                 "all_unsound": False, "json": False, **kw})


def test_spmdkit_verify_shows_progress_on_a_terminal_only(monkeypatch: Any) -> None:
    import pytest

    pytest.importorskip("numpy")
    import sys

    from spmdkit.cli.verify import run_verify

    tty = FakeTty()
    monkeypatch.setattr(sys, "stderr", tty)
    out = io.StringIO()
    assert run_verify(_verify_ns(), out) == 0
    assert "spmdkit verify [" in tty.getvalue() and "matmul" in tty.getvalue()
    assert "\r" not in out.getvalue()  # the table on stdout is untouched
    pipe = io.StringIO()
    monkeypatch.setattr(sys, "stderr", pipe)
    out2 = io.StringIO()
    assert run_verify(_verify_ns(), out2) == 0
    assert pipe.getvalue() == ""
    assert out2.getvalue().splitlines()[2].startswith("matmul")


def test_plan_auto_shows_its_phases_on_a_terminal(monkeypatch: Any) -> None:
    import sys

    import pytest

    pytest.importorskip("highspy")
    from spmdkit.cli import main

    tty = FakeTty()
    monkeypatch.setattr(sys, "stderr", tty)
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    assert main(["plan", "--model", "tiny-llama", "--mesh", "dp=2,tp=2", "--layers", "1", "--auto",
                 "--annotate", "tokens=[0,-1]"]) == 0
    shown = tty.getvalue()
    assert "plan --auto" in shown and "candidates" in shown and "solve" in shown


def test_phases_are_lines_on_a_pipe_with_lines_and_notes_on_a_terminal() -> None:
    s = io.StringIO()
    bar = Progress("plan --devices 8", total=3, stream=s, lines=True)
    bar.advance()
    bar.phase("3 configurations to plan")
    bar.phase("planned 3")
    got = s.getvalue().splitlines()
    assert [g.rsplit(" (", 1)[0] for g in got] == ["plan --devices 8: 3 configurations to plan",
                                                    "plan --devices 8: planned 3"]
    assert all(g.endswith(" s)") for g in got)
    quiet = io.StringIO()
    Progress("x", stream=quiet).phase("nothing on a pipe without lines")
    assert quiet.getvalue() == ""
    tty = FakeTty()
    live = Progress("x", total=2, stream=tty, interval=0.0, width=200, lines=True)
    live.phase("planning")
    assert tty.getvalue().startswith("\rx [") and "planning" in tty.getvalue() and "\n" not in tty.getvalue()
