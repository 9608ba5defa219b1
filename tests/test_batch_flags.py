"""Batch semantics (spmdkit.cli.batch): --global-batch (sequences per optimizer step) and
--micro-batch (per data-parallel rank a micro-step) become the planner's batch, gradient
accumulation or microbatches; --batch with --grad-accum is warned of; --devices searches them;
a search with nothing to plan says why in terms the user can act on."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stderr, redirect_stdout

import pytest

from spmdkit.cli import main


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


BASE = ("plan", "--model", "llama3-8b", "--layers", "2", "--seq", "512", "--device", "h100")


def test_global_batch_derives_the_gradient_accumulation() -> None:
    rc, out, err = _cli(*BASE, "--mesh", "dp=8", "--strategy", "dp,zero1", "--global-batch", "64",
                        "--micro-batch", "2", "--json")
    assert rc == 0, err
    d = json.loads(out)
    assert d["grad_accum"] == 4                      # 64 / (2 x 8)
    assert d["step"]["tokens"] == 64 * 512           # a step trains the global batch, not 4 x 64
    rc, out, err = _cli(*BASE, "--mesh", "dp=8", "--strategy", "dp,zero1", "--global-batch", "64", "--json")
    assert rc == 0 and json.loads(out)["grad_accum"] == 1 and json.loads(out)["step"]["tokens"] == 64 * 512


def test_global_batch_on_a_pipeline_is_its_microbatches() -> None:
    rc, out, err = _cli(*BASE, "--mesh", "pp=2,dp=2", "--strategy", "dp", "--global-batch", "16", "--json")
    assert rc == 0, err
    assert json.loads(out)["pipeline"]["microbatches"] == 8  # one sequence per rank a microbatch


def test_grad_accum_on_a_pipeline_is_refused() -> None:
    """A pipeline accumulates over its microbatches: --grad-accum 4 there was warned of ('a step trains
    4 x 4 = 16 sequences') and then planned as one step of --batch 4 (the same step time, 4 sequences'
    tokens): refused in one line naming it and what to give, the warning not printed."""
    for pipe in (("--mesh", "pp=2,dp=2"), ("--mesh", "dp=2", "--microbatches", "2")):
        rc, out, err = _cli(*BASE, *pipe, "--strategy", "dp", "--batch", "4", "--grad-accum", "4")
        assert rc == 2 and out == "" and err.strip().splitlines() == [
            "spmdkit plan: ProgramError: --grad-accum 4: a pipeline accumulates the gradients over its --microbatches "
            "(give --microbatches M, or --global-batch and --micro-batch)"], err


@pytest.mark.parametrize(("extra", "message"), [
    (("--global-batch", "60", "--micro-batch", "2"),
     "--global-batch 60: not a multiple of --micro-batch 2 x the 8 data-parallel ranks (= 16) of --mesh dp=8"),
    (("--global-batch", "64", "--batch", "8"), "--batch: does not go with --global-batch 64"),
    (("--micro-batch", "2",), "--micro-batch 2: give --global-batch too"),
])
def test_batch_flags_refused_in_one_line(extra: tuple[str, ...], message: str) -> None:
    rc, _out, err = _cli(*BASE, "--mesh", "dp=8", "--strategy", "dp", *extra)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and message in err, err


def test_batch_times_grad_accum_is_said_not_silent() -> None:
    rc, out, err = _cli(*BASE, "--mesh", "dp=8", "--strategy", "dp", "--batch", "512", "--grad-accum", "128",
                        "--json")
    assert rc == 0
    assert "--batch 512 --grad-accum 128: --batch is the sequences of one micro-step, so a step trains " \
           "512 x 128 = 65,536 sequences" in err
    assert json.loads(out)["step"]["tokens"] == 65536 * 512


def test_devices_searches_the_micro_batch() -> None:
    rc, out, err = _cli(*BASE, "--devices", "4", "--strategy", "dp,zero1", "--recompute", "none",
                        "--global-batch", "32", "--micro-batch", "2", "--json")
    assert rc == 0, err
    top = json.loads(out)["search"]["top"]
    flat = [t for t in top if t["pp"] == 1 and t["tp"] == 1]
    assert flat and flat[0]["grad_accum"] == 4                      # 32 / (2 x 4)
    assert all(t["microbatches"] == 32 // (2 * t["dp"]) for t in top if t["pp"] > 1)


def test_a_search_with_nothing_to_plan_says_why() -> None:
    rc, out, _err = _cli("plan", "--model", "llama3-8b", "--layers", "2", "--devices", "6", "--batch", "8")
    assert rc == 1
    last = out.strip().splitlines()[-1]
    assert last.startswith("no configuration of 6 devices: of the factorisations dp x tp x pp, 3 have a "
                           "data-parallel degree that does not divide the batch 8")
    assert "--devices 4 or 8" in last and "3 more pipeline stages than layers" in last


def test_devices_without_a_micro_batch_searches_the_micro_batches() -> None:
    from spmdkit.planner.search import search_meshes

    res = search_meshes("llama3-8b", 4, "h100", overrides={"layers": 2, "seq": 512, "batch": 16}, micro_batch=0,
                        strategies=["dp,zero1"], recompute=["none"])
    got = {(c.config.dp, c.config.pp, c.config.microbatches, c.config.grad_accum) for c in res.candidates}
    # dp=4: a rank's 4 sequences whole, or in micro-steps of 1 and 2; pp=2 x dp=2: 8 a rank in 8, 4 or 2 microbatches
    assert {(4, 1, 1, 1), (4, 1, 1, 4), (4, 1, 1, 2)} <= got
    assert {(2, 2, 8, 1), (2, 2, 4, 1), (2, 2, 2, 1)} <= got
    one = min((c for c in res.candidates if c.config.dp == 4 and c.config.pp == 1), key=lambda c: c.config.grad_accum)
    more = max((c for c in res.candidates if c.config.dp == 4 and c.config.pp == 1), key=lambda c: c.config.grad_accum)
    assert more.memory < one.memory  # a smaller micro-batch holds fewer activations


def test_devices_with_cp_below_the_searched_sequence_says_so() -> None:
    """--devices 8 --strategy cp at seq 512 planned nothing (the search tries cp from 16,384 tokens)
    and said 'no configuration of 8 devices: ... 3 more pipeline stages than layers', as if the
    layers were why: refused before the search, saying where cp is tried and how to plan it."""
    rc, out, err = _cli(*BASE, "--devices", "8", "--strategy", "dp,cp")
    assert rc == 2 and out == "" and err.strip() == (
        "spmdkit plan: ProgramError: --strategy dp,cp: the --devices search tries context parallelism from 16384 "
        "tokens, and the sequence is 512; plan cp at it on a given mesh (--mesh with a cp dim)")


def test_global_batch_with_a_pipeline_flag_and_no_pp_dim_is_the_step() -> None:
    """A pipeline flag (--schedule, --virtual-stages, ...) without a pp dim plans a pipeline of one stage;
    --global-batch 16 --micro-batch 2 over dp=2 was made --batch 4 --grad-accum 4 as for a flat plan, and the
    pipeline path, which has no --grad-accum, planned one microbatch of 4: a step of 4 sequences, not 16."""
    rc, out, err = _cli(*BASE, "--mesh", "dp=2", "--strategy", "dp", "--global-batch", "16", "--micro-batch", "2",
                        "--schedule", "1f1b", "--json")
    assert rc == 0, err
    pipe = json.loads(out)["pipeline"]
    assert pipe["microbatches"] == 4 and pipe["tokens"] == 16 * 512  # 16 / (2 x 2) microbatches of 2 x 2
