"""spmdkit run's launcher: on a terminal one progress line on its stderr (starting the ranks, then
the phases rank 0 reports), erased before rank 0's output is written, so the two never share a
line; on a pipe nothing (the CLI's subprocess tests, whose stderr is a pipe, see no progress)."""

from __future__ import annotations

import io
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install 'spmdkit[torch]')")

from spmdkit.execute.launch import PHASE_MARK, launch_local
from spmdkit.outputs.progress import Progress

ROOT = Path(__file__).resolve().parents[1]


class FakeTty(io.StringIO):
    def isatty(self) -> bool:
        return True


def _launch(monkeypatch: Any, term: io.StringIO, progress: Progress) -> int:
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "src"))
    monkeypatch.delenv("MASTER_PORT", raising=False)
    monkeypatch.setattr(sys, "stdout", term)  # rank 0's output and the progress line on one "terminal"
    phases = ["planning", "starting 2 ranks", "step", "checking"]
    return launch_local(["--model", "tiny-llama", "--layers", "1", "--mesh", "dp=1,tp=2", "--kernels", "numpy",
                         "--warmup", "0", "--timeout", "60"], 2, 60.0, progress=progress, phases=phases)


def test_a_terminal_shows_the_phases_and_rank_output_never_shares_their_line(monkeypatch: Any) -> None:
    term = FakeTty()
    bar = Progress("spmdkit run", total=4, stream=term, interval=0.0, width=200)
    assert _launch(monkeypatch, term, bar) == 0
    bar.close()
    out = term.getvalue()
    for phase in ("starting 2 ranks", "step", "checking"):  # rank 0 reported its phases
        assert re.search(rf"\rspmdkit run \[[#-]+\] \d/4 \(\d+%\) [\d.]+ s  {phase}", out), phase
    assert PHASE_MARK.strip() not in out and "\x1e" not in out  # the markers stay between the processes
    report = out.index("collectives per rank")
    line_start = out.rfind("\n", 0, report) + 1
    head = out[line_start:report]  # what is on the report's line before it: erased progress, nothing else
    assert "spmdkit run [" not in head.split("\r")[-1]
    for ln in out.split("\n"):  # every line of rank 0's output starts clean after the last carriage return
        if "tensors" in ln or "collectives" in ln:
            assert "[#" not in ln.split("\r")[-1] and "[-" not in ln.split("\r")[-1]
    assert "spmdkit run [" not in out[out.index("spmdkit run: tiny-llama"):]  # not drawn again once rank 0 wrote
    assert out[:out.index("spmdkit run: tiny-llama")].endswith("\r")  # the line erased right before


def test_a_pipe_gets_no_progress_and_rank_output_unchanged(monkeypatch: Any, capfd: Any) -> None:
    pipe = io.StringIO()
    bar = Progress("spmdkit run", total=4, stream=pipe, interval=0.0)
    assert not bar.enabled
    assert _launch(monkeypatch, io.StringIO(), bar) == 0
    assert pipe.getvalue() == ""
    out, err = capfd.readouterr()  # rank 0 wrote to the inherited stdout itself
    assert "collectives per rank" in out and "\r" not in out and "\x1e" not in out + err
    assert os.environ.get("SPMDKIT_PROGRESS") is None
