"""``full:K`` in the search (spmdkit.planner.search_blocks): where a pipeline does not fit without
recomputation but does with full recomputation, the search prices the least K layers per stage
recomputed in full that fits (Megatron-LM's --recompute-method block --recompute-num-layers K);
folded as planned whole, under the step floor, and exported as Megatron-LM's three flags
(torchtitan: mode full, with a warning)."""

from __future__ import annotations

import io
import itertools
import math
import tomllib
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import replace
from pathlib import Path

import pytest

from spmdkit.cli import main
from spmdkit.core.errors import ProgramError
from spmdkit.cost.devices import load_device
from spmdkit.cost.memory import CUDA_CONTEXT_BYTES, NCCL_BYTES_PER_GROUP
from spmdkit.outputs.recipe import megatron_args, recipe, recipe_warning, torchtitan_toml
from spmdkit.planner.search import Config, _bounds, _floor, _model_sizes, _step_bound, config_candidates, search_meshes
from spmdkit.planner.search_blocks import blocks_floor, least_blocks, wants_blocks
from spmdkit.planner.search_bounds import Bounds
from spmdkit.planner.search_config import _Job, _only, _plan_preset_config
from spmdkit.program.runtime import Runtime

MODEL = "llama3-8b"
OVER = {"layers": 24, "batch": 8, "seq": 4096}
CFG = Config(4, 1, 2, "dp,zero1", microbatches=2)   # 12 layers a stage


def _cap(cfg: Config, over: dict[str, int], frac: float) -> int:
    """A cap ``frac`` of the way from no recomputation's bytes a device down to full's."""
    got = {c.config.recompute: c for c in config_candidates(MODEL, cfg, "h100", over, fold=False)}
    return int(got["full"].memory * frac + got["none"].memory * (1 - frac))


def test_least_blocks_finds_the_least_k_that_fits_in_few_pricings() -> None:
    # 12 layers a stage, 100 bytes without recomputation, 40 with full: each layer 5 bytes
    priced: list[int] = []

    def price(k: int) -> tuple[int, int]:
        priced.append(k)
        return k, 100 - 5 * k

    def least(cap: int, slope: int = 5) -> tuple[int, int] | None:
        priced.clear()
        return least_blocks(lambda k: (priced.append(k), (k, 100 - slope * k))[1], lambda c: c[1] <= cap,
                            lambda c: c[1], 12, 100, 40, cap)

    assert least(78) == (5, 75) and priced == [5, 4]     # interpolated: 22 of 60 bytes -> 4.4 -> 5; 4 over
    # the bytes fall slower than interpolated (3 a layer): the bracket closes from below
    assert least(78, 3) == (8, 76) and len(priced) <= 4
    assert least(10) is None                                # only full fits
    # a pruned search: a K over the cap already too slow to win (the K that fit are slower): none
    assert least_blocks(price, lambda c: c[1] <= 78, lambda c: c[1], 12, 100, 40, 78, lambda c: c[0] >= 4) is None
    assert least_blocks(price, lambda c: True, lambda c: c[1], 1, 100, 40, 78) is None  # full:K is full
    # each K from 1 to 11 the least for some cap, found with at most 4 pricings
    for k in range(1, 12):
        assert least(100 - 5 * k) == (k, 100 - 5 * k) and len(priced) <= 4, (k, priced)
    # wanted: a pipeline whose full fits and whose no recomputation does not (a pruned search may
    # not have priced none: selective over the cap already)
    assert wants_blocks(2, ["none", "full"], [("none", False, 100), ("full", True, 40)]) == (100, 40)
    assert wants_blocks(2, ["none", "selective", "full"], [("full", True, 40), ("selective", False, 90)]) == (None, 40)
    assert wants_blocks(1, ["none", "full"], [("none", False, 100), ("full", True, 40)]) is None
    assert wants_blocks(2, ["none", "full"], [("none", True, 100), ("full", True, 40)]) is None
    assert wants_blocks(2, ["full"], [("full", True, 40)]) is None    # --recompute full: as given


@pytest.mark.parametrize(("cfg", "over", "frac", "k", "folded"), [
    (CFG, OVER, 0.3, 3, 12),                                            # copies of 5 + 6 and 6 + 7 layers a stage
    (Config(1, 1, 8, "dp", microbatches=16), {**OVER, "batch": 16}, 0.5, 2, 9),   # folded by stage
    (Config(1, 1, 4, "dp", microbatches=8, virtual=2), {**OVER, "layers": 32, "batch": 16}, 0.5, 2, 12),
], ids=["two-copy fold", "deep pp=8", "interleaved"])
def test_full_k_is_the_least_k_that_fits_and_folds_exactly(cfg: Config, over: dict[str, int], frac: float, k: int,
                                                           folded: int) -> None:
    cap = _cap(cfg, over, frac)
    folds = config_candidates(MODEL, cfg, "h100", over, memory_cap=cap)
    whole = config_candidates(MODEL, cfg, "h100", over, memory_cap=cap, fold=False)
    assert [c.config.recompute for c in folds] == ["none", "selective", "full", f"full:{k}"]
    assert [c.config for c in folds] == [c.config for c in whole]
    blocks = folds[-1]
    assert blocks.folded == folded and whole[-1].folded == 0
    for f, w in zip(folds, whole):
        for name in ("step_s", "memory", "comm_s", "mfu", "collectives"):
            assert getattr(f, name) == pytest.approx(getattr(w, name), rel=1e-9, abs=0), (f.config.recompute, name)
    got = {c.config.recompute: c for c in folds}
    assert blocks.fits and not got["none"].fits and got["full"].fits
    assert got["none"].step_s < blocks.step_s < got["full"].step_s          # between: fewer layers run again
    # one layer fewer a stage does not fit: K is the least
    mc, sizes = _model_sizes(MODEL, over)
    dev = load_device("h100")
    job = _Job(dev, sizes.tokens, ["none", "selective", "full"], cap, None, None, None, 30.0, fold=False)
    less = _plan_preset_config(cfg, MODEL, mc, _only(job, f"full:{k - 1}"))
    assert [c.config.recompute for c in less] == [f"full:{k - 1}"] and not less[0].fits


def test_blocks_floor_by_hand() -> None:
    """24 layers of 20 bytes held (parameters and gradients) on pp=2 with 2 microbatches (ranks
    keep 2 and 1 in flight); a layer keeps 100 bytes of a microbatch without recomputation, 40
    with full, 110 and 44 with the allocator's reserve (GROW = 1.1); 1,500 bytes for them a
    rank. Rank 0 holds c layers, its first K recomputed, within c (20 + 2 x 110) - 2 K 66 <= 1500,
    rank 1 within c (20 + 110) - K 66 <= 1500: K = 5 holds 9 + 14.08 < 24 layers, K = 6 holds
    9.55 + 14.58 (the least K). The fewest layers recomputed: rank 1 filled (6 of its 14.58), rank 0
    the other 9.42 (6 of them): 12 of 24 of full's rerun."""
    bounds = Bounds(layers=((10, 0, 0, 0),) * 24, outside=(0, 0, 0, 0), flops=0.0, peak=1.0)
    cfg = Config(1, 1, 2, "dp", microbatches=2)
    room = 1500 + CUDA_CONTEXT_BYTES + NCCL_BYTES_PER_GROUP  # a pp group
    assert blocks_floor(bounds, cfg, room, 100, 40, 10.0, 14.0) == pytest.approx(10.0 + 4.0 * 12 / 24)
    # full holds 24 / (1500 / 108 + 1500 / 64) at most: 24 < 13.9 + 23.4; all but full (K = 11) does not
    assert blocks_floor(bounds, cfg, room - 1000, 100, 40, 10.0, 14.0) == math.inf
    assert blocks_floor(bounds, replace(cfg, pp=1), room, 100, 40, 10.0, 14.0) == 10.0  # no pipeline


def test_blocks_floor_counts_a_recomputed_layers_working_peak() -> None:
    """The same pipeline with a recomputed layer's working peak of 700 bytes (770 with the
    reserve): a Megatron rank also holds c 20 + (f - 1) kept + 770 within 1,500 (the microbatch
    at its peak beside the others' stash). Rank 0 (f = 2): (730 + 66 K) / 130 layers, under
    K = 6 8.66 + 14.58 < 24; K = 7: 9.17 + 15.09 (rank 1, f - 1 = 0, holds 36.5 by it): rank 1
    filled (7 of its 15.09), rank 0 the other 8.91 (7): 14 of 24 recomputed. Under torchtitan
    (its ranks walked unit by unit) the peak is not counted: 12 of 24 as above."""
    bounds = Bounds(layers=((10, 0, 0, 0),) * 24, outside=(0, 0, 0, 0), flops=0.0, peak=1.0)
    cfg = Config(1, 1, 2, "dp", microbatches=2)
    room = 1500 + CUDA_CONTEXT_BYTES + NCCL_BYTES_PER_GROUP
    assert blocks_floor(bounds, cfg, room, 100, 40, 10.0, 14.0, 700) == pytest.approx(10.0 + 4.0 * 14 / 24)
    assert blocks_floor(bounds, cfg, room, 100, 40, 10.0, 14.0, 200) == pytest.approx(10.0 + 4.0 * 12 / 24)
    tt = replace(bounds, framework="torchtitan")
    assert blocks_floor(tt, cfg, room, 100, 40, 10.0, 14.0, 700) == pytest.approx(10.0 + 4.0 * 12 / 24)


def test_the_memory_bound_counts_the_reserve_the_flight_and_a_working_peak() -> None:
    """Bounds.memory on the pipeline above (a layer keeps 100 bytes, 110 with the reserve):
    24 / (1 / (20 + 2 x 110) + 1 / (20 + 110)) = 2,023 bytes at least on the fuller rank; with
    a layer's working peak of 2,000 bytes (2,200 with the reserve) beside f - 1 microbatches'
    stash, 2,200 + 24 / (1 / 130 + 1 / 20) = 2,616; interleaved over 2 chunks (m = 4) Megatron's
    ranks hold 2.5 and 1.5 microbatches (schedules.in_flight), not 2 and 1."""
    bounds = Bounds(layers=((10, 0, 0, 0),) * 24, outside=(0, 0, 0, 0), flops=0.0, peak=1.0)
    over = Bounds.overhead(1, 1, 1, 2)
    assert bounds.memory(1, 1, 1, 2, "dp", 2, 100) - over == int(24 / (1 / 240 + 1 / 130))
    assert bounds.memory(1, 1, 1, 2, "dp", 2, 100, 1, 2000) - over == int(2200 + 24 / (1 / 130 + 1 / 20))
    assert bounds.memory(1, 1, 1, 2, "dp", 2, 100, 1, 100) - over == int(24 / (1 / 240 + 1 / 130))
    assert bounds.flights(2, 2, 4) == ((2.5, 1.5), True)
    assert replace(bounds, framework="torchtitan").flights(2, 2, 4) == ((2.0, 1.0), False)


def test_the_step_floor_stays_under_full_k() -> None:
    """Full:K recomputes less than full: the bound of a configuration whose no-recomputation bytes
    are over the cap counts it (no recomputation's floor under full's memory bound)."""
    cap = _cap(CFG, OVER, 0.3)
    got = {c.config.recompute: c for c in config_candidates(MODEL, CFG, "h100", OVER, memory_cap=cap)}
    mc, sizes = _model_sizes(MODEL, OVER)
    dev = load_device("h100")
    job = _Job(dev, sizes.tokens, ["none", "selective", "full"], cap, None, None, None, 30.0)
    floor = _floor(MODEL, mc, job)
    assert floor is not None
    low = _step_bound(CFG, _bounds(MODEL, mc, job), floor, job)
    assert 0 < low <= got["full:3"].step_s < got["full"].step_s
    assert low < floor.step(CFG, "full")  # full's own floor would not do: full:K recomputes less


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def test_the_search_picks_full_k_over_full_and_exports_it(tmp_path: Path) -> None:
    """The search's best is a full:K that beats full on the same configuration; a pruned search
    (the step bound counts full:K: blocks_floor) finds it with the same figures; exported as
    Megatron-LM's three flags, and for torchtitan as mode full with one warning line."""
    over = {**OVER, "layers": 12}
    cap = _cap(CFG, over, 0.25)  # (0.3 left full:2 3 hidden states short: its layer 2 input, kept)
    res, pruned = (search_meshes(MODEL, 8, "h100", cap, strategies=["dp,zero1"], overrides=over, micro_batch=1,
                                 prune=prune) for prune in (False, True))
    best = res.best
    assert best is not None and best.config.recompute.startswith("full:")
    full = next(c for c in res.fitting if c.config == replace(best.config, recompute="full"))
    assert best.step_s < full.step_s
    b = pruned.best
    assert b is not None and b.config == best.config and (b.step_s, b.memory, b.comm_s) == (
        best.step_s, best.memory, best.comm_s)
    assert pruned.plans < res.plans and pruned.pruned
    r = recipe(best, MODEL, 8, 4096, 12)
    k = r["recompute_num_layers"]
    assert best.config.recompute == f"full:{k}"
    pairs = dict(itertools.pairwise(megatron_args(r).replace("\\\n", "").split()))
    assert (pairs["--recompute-granularity"], pairs["--recompute-method"], pairs["--recompute-num-layers"]) \
        == ("full", "block", str(k))
    assert tomllib.loads(torchtitan_toml(r))["activation_checkpoint"] == {"mode": "full"}
    assert recipe_warning("megatron", r) is None
    note = recipe_warning("torchtitan", r)
    assert note is not None and note.startswith(f"--export-recipe torchtitan: recompute full:{k} ")
    # the CLI: the warning on stderr in one line, the file written
    f = tmp_path / "job.toml"
    rc, out, err = _cli("plan", "--model", MODEL, "--layers", "12", "--seq", "4096",
                        "--devices", "8", "--strategy", "dp,zero1", "--micro-batch", "1", "--global-batch", "8",
                        "--memory", str(cap), "--export-recipe", "torchtitan", str(f))
    assert rc == 0, err
    assert "hint: " not in out  # interleaved over 2 stages: the bubble is under 25% of the step
    warned = [line for line in err.splitlines() if "warning: --export-recipe torchtitan" in line]
    assert len(warned) == 1 and f"full:{k}" in warned[0]
    assert tomllib.loads(f.read_text())["activation_checkpoint"] == {"mode": "full"}


def test_the_search_offers_no_full_k_under_a_framework_without_a_count_of_layers() -> None:
    """torchtitan's and NeMo AutoModel's activation checkpointing cannot recompute the first K layers
    (spmdkit.cost.checkpoints.NO_LAYER_COUNT): under a 30 GB cap torchtitan's search priced full:1 at
    pp = 4 before; now its pipelines are priced with none, selective and full only."""
    res = search_meshes(MODEL, 8, "h100", 30 * 10**9, strategies=["dp,zero1"], overrides={**OVER, "layers": 12},
                        micro_batch=1, prune=False, runtime=Runtime(framework="torchtitan"))
    modes = {c.config.recompute for c in res.fitting if c.config.pp > 1}
    assert {"none", "full"} <= modes and not any(m.startswith("full:") for m in modes)


def test_a_plan_mode_the_search_does_not_try_is_named_with_what_it_tries() -> None:
    """--devices --recompute full:1 (a valid plan --mesh mode) was refused as '--recompute 'full:1': one
    of none, selective, full', as if full:K were not a mode: the line says what the search tries (and
    that it picks full:K itself) and where the mode is priced."""
    for mode in ("full:1", "selective:mlp", "microbatch"):
        with pytest.raises(ProgramError) as e:
            search_meshes("tiny-llama", 2, "h100", recompute=[mode])
        assert str(e.value) == (f"--recompute {mode}: the search tries one of none, selective, full (and, for a "
                                f"pipeline that fits only with full recomputation, the least full:K that fits); "
                                f"price {mode} for one configuration with spmdkit plan --mesh ...")
