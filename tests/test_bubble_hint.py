"""The bubble hint (spmdkit.planner.bubble): where a pipeline's bubble is over 25% of its step,
the plan says so in one line (text) and under ``bubble_hint`` (JSON), with the least number of
microbatches (a larger global batch) that brings it under, as the same schedule model prices
that batch: planned again at that count it is under 25%, at one fewer it is not."""

from __future__ import annotations

import json

import pytest

from spmdkit.cli import main
from spmdkit.planner.bubble import BUBBLE_SHARE

PIPE = ["plan", "--model", "llama-7b", "--mesh", "pp=4,dp=2,tp=2", "--layers", "8", "--device", "h100"]


def _json(m: int, capsys: pytest.CaptureFixture[str]) -> dict:
    assert main([*PIPE, "--microbatches", str(m), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _share(doc: dict) -> float:
    pp = doc["pipeline"]
    return pp["bubble_s"] / pp["step_overlap_s"]


def test_a_small_batch_gets_the_hint_and_its_batch_is_the_least_under_the_threshold(
        capsys: pytest.CaptureFixture[str]) -> None:
    doc = _json(4, capsys)
    hint = doc["bubble_hint"]
    assert hint is not None and hint["microbatches"] == 4 and hint["threshold"] == BUBBLE_SHARE == 0.25
    assert hint["bubble_share"] == pytest.approx(_share(doc), rel=1e-12) and hint["bubble_share"] > 0.25
    more = hint["hint_microbatches"]
    at, before = _json(more, capsys), _json(more - 1, capsys)
    # the plan at the hinted count: its own estimate's bubble share and step are the hint's
    assert _share(at) == pytest.approx(hint["hint_bubble_share"], rel=1e-9) and _share(at) <= 0.25
    assert at["pipeline"]["step_overlap_s"] == pytest.approx(hint["hint_step_s"], rel=1e-9)
    assert _share(before) > 0.25 and before["bubble_hint"] is not None
    assert at["bubble_hint"] is None
    assert hint["batch_times"] == more / 4
    # the text: one line with the numbers
    assert main([*PIPE, "--microbatches", "4"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("hint: ")]
    assert len(lines) == 1
    assert (f"is {100 * hint['bubble_share']:.1f}% of the" in lines[0] and "at 4 microbatches, over 25%" in lines[0]
            and f"{more} microbatches of the same size, brings it to {100 * hint['hint_bubble_share']:.1f}%"
            in lines[0])


def test_a_large_batch_gets_no_hint(capsys: pytest.CaptureFixture[str]) -> None:
    doc = _json(64, capsys)
    assert doc["bubble_hint"] is None and _share(doc) < 0.25
    assert main([*PIPE, "--microbatches", "64"]) == 0
    assert "hint: " not in capsys.readouterr().out


def test_the_search_names_the_global_batch(capsys: pytest.CaptureFixture[str]) -> None:
    """2 sequences on 4 devices under a 12 GiB cap: the best is pp=4 with 2 microbatches, its
    bubble near half the step; the hint names the global batch of the microbatches it asks for
    (one sequence each, dp = 1)."""
    argv = ["plan", "--model", "llama-7b", "--layers", "8", "--seq", "2048", "--strategy", "dp", "--micro-batch", "1",
            "--devices", "4", "--global-batch", "2", "--memory", "12GiB"]
    assert main([*argv, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    hint = doc["bubble_hint"]
    assert doc["pipeline"]["pp"] == 4 and hint is not None and hint["microbatches"] == 2
    assert hint["bubble_share"] == pytest.approx(_share(doc), rel=1e-12) and hint["hint_bubble_share"] <= 0.25
    more = hint["hint_microbatches"]  # sequences: microbatches x 1 x dp 1
    assert main(argv) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("hint: ")]
    assert len(lines) == 1 and f"(--global-batch {more})" in lines[0]
