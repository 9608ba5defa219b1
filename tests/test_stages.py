"""Stage partitioning (planner/partition.py, ``--stages auto``), the ZB-H1 schedule
(planner/schedules.py, planner/zero_bubble.py) and ``--recompute full:K``."""

from __future__ import annotations

import importlib.util
import itertools
import json
import random
from pathlib import Path

import pytest

from spmdkit.cli import main
from spmdkit.core.errors import ProgramError
from spmdkit.cost.devices import preset_device
from spmdkit.cost.memory import check_recompute
from spmdkit.cost.step import op_communication
from spmdkit.planner.partition import UnitCosts, even_split, partition, simulate_split, stage_loads, unit_costs
from spmdkit.planner.pipeline import estimate_pipeline, plan_unit_costs, stage_costs
from spmdkit.planner.pipeline_plan import plan_pipeline
from spmdkit.planner.pipeline_split import op_stages, parse_spec
from spmdkit.planner.schedules import bubble_formula, held_counts, in_flight, run_schedule, schedule_order

# -- the partition ----------------------------------------------------------------------------------


def _brute(u: UnitCosts, p: int, m: int, cap: float | None) -> float:
    """The least slowest stage over every split of ``u`` into ``p`` stages whose ranks fit
    ``cap`` (inf: none fits)."""
    best = float("inf")
    for cuts in itertools.combinations(range(1, u.layers), p - 1):
        counts = [b - a for a, b in zip((0, *cuts), (*cuts, u.layers))]
        times, ranks = stage_loads(u, counts, p, 1, m)
        if cap is None or max(ranks) <= cap:
            best = min(best, max(times))
    return best


@pytest.mark.parametrize("seed", range(12))
def test_partition_is_the_exact_min_max_under_memory(seed: int) -> None:
    rng = random.Random(seed)
    L, p = rng.randint(5, 9), rng.choice([2, 3])
    m = rng.choice([1, 3, 8])
    time = [rng.uniform(0.1, 1.0)] + [rng.uniform(0.5, 3.0) for _ in range(L)] + [rng.uniform(0.1, 2.0)]
    held = [rng.uniform(0, 2)] + [rng.uniform(1, 3) for _ in range(L)] + [rng.uniform(0, 2)]
    stash = [0.0] + [rng.uniform(0.5, 2) for _ in range(L)] + [rng.uniform(0, 1)]
    u = unit_costs(time, held, stash, send_s=0.05)
    free = partition(u, p, m=m, refine=False)
    assert free.fits and free.bottleneck_s == pytest.approx(_brute(u, p, m, None), rel=1e-9)
    # a capacity between the tightest and the loosest split's fullest rank
    fullest = [max(stage_loads(u, [b - a for a, b in zip((0, *c), (*c, L))], p, 1, m)[1])
               for c in itertools.combinations(range(1, L), p - 1)]
    cap = (min(fullest) + max(fullest)) / 2
    got = partition(u, p, m=m, capacity=cap, refine=False)
    assert got.fits and max(got.rank_bytes) <= cap
    assert got.bottleneck_s == pytest.approx(_brute(u, p, m, cap), rel=1e-9)
    assert sum(got.counts) == L and min(got.counts) >= 1
    # refined by simulation: never slower than the min-max split nor the even split that fits
    ref = partition(u, p, m=m, capacity=cap)
    assert ref.fits and max(ref.rank_bytes) <= cap and ref.min_max == got.counts
    assert ref.pipeline_s == pytest.approx(simulate_split(u, ref.counts, p, 1, m), rel=1e-12)
    assert ref.pipeline_s <= simulate_split(u, got.counts, p, 1, m) * (1 + 1e-12)
    even = even_split(L, p)
    if max(stage_loads(u, even, p, 1, m)[1]) <= cap:
        assert ref.pipeline_s <= simulate_split(u, even, p, 1, m) * (1 + 1e-12)


def test_partition_refined_by_the_schedule_puts_heavy_stages_first_with_few_microbatches() -> None:
    # 12 equal layers on pp=8 with 8 microbatches: the min-max split 1,1,1,2,2,2,2,1 and the
    # even split 2 x 4, 1 x 4 have the same slowest stage, but 1F1B's warm-up fills sooner
    # with the heavier stages first (as the 405B runs of torchtitan split, benchmarks/stages.py)
    u = UnitCosts((0.6,) + (1.0,) * 12 + (0.6,), (0.4,) + (3.3,) * 12 + (1.2,))
    got = partition(u, 8, m=8)
    assert got.min_max == (1, 1, 1, 2, 2, 2, 2, 1)
    assert got.counts == (2, 2, 2, 2, 1, 1, 1, 1)
    assert got.pipeline_s == pytest.approx(108.2) and simulate_split(u, got.min_max, 8, 1, 8) == pytest.approx(112.6)
    # with many microbatches the slowest stage rules: the min-max split stays
    many = partition(unit_costs([0.05] + [1.0] * 126 + [0.9]), 16, m=128)
    assert many.counts == many.min_max == (7,) + (8,) * 14 + (7,)


def test_partition_of_126_equal_layers_on_16_stages_is_llama3_405b_layout() -> None:
    # the embedding light, the head and loss about a layer: 7, 8 x 14, 7 (Llama 3.1 405B on pp=16)
    u = unit_costs([0.05] + [1.0] * 126 + [0.9])
    got = partition(u, 16, m=16)
    assert got.counts == (7,) + (8,) * 14 + (7,)
    assert got.bottleneck_s == pytest.approx(8.0)
    assert got.fits and got.capacity is None


def test_partition_moves_layers_off_the_rank_with_the_most_in_flight() -> None:
    # 8 equal layers on pp=2 with 4 microbatches: rank 0 keeps 2 in flight, rank 1 one
    assert [in_flight("1f1b", 2, 1, 4, r) for r in range(2)] == [2.0, 1.0]
    u = unit_costs([0.0] + [1.0] * 8 + [0.0], held=[0.0] + [1.0] * 8 + [0.0], stash=[0.0] + [1.0] * 8 + [0.0])
    even = partition(u, 2, m=4)
    assert even.counts == (4, 4) and even.rank_bytes == (12.0, 8.0)
    got = partition(u, 2, m=4, capacity=10.0)  # 4 layers x (1 + 2) = 12 > 10 on rank 0
    assert got.counts == (3, 5) and got.rank_bytes == (9.0, 10.0) and got.fits
    assert got.bottleneck_s == 5.0
    none = partition(u, 2, m=4, capacity=5.0)  # no split fits: the fastest regardless, said so
    assert not none.fits and none.counts == (4, 4)


def test_partition_interleaved_and_zb_h1_weights() -> None:
    u = unit_costs([0.0] + [1.0] * 16 + [0.0])
    assert partition(u, 4, v=2, m=8, schedule="interleaved").counts == (2,) * 8
    # ZB-H1's steady state runs every F, B and W: the same pace as 1F1B; its rank r also holds
    # r microbatches' W inputs
    w = UnitCosts((0.0,) + (1.0,) * 4 + (0.0,), (0.0, 2.0, 2.0, 2.0, 4.0, 0.0),
                  stash=(0.0,) + (2.0,) * 4 + (0.0,), weight_s=(0.0, 1.0, 1.0, 1.0, 3.0, 0.0),
                  wstash=(0.0,) + (1.0,) * 4 + (0.0,))
    one, zb = partition(w, 2, m=4), partition(w, 2, m=4, schedule="zb-h1")
    assert one.counts == zb.counts == (2, 2) and one.stage_s == zb.stage_s == (6.0, 8.0)
    assert one.rank_bytes == (8.0, 4.0) and zb.rank_bytes == (8.0, 4.0 + 2.0)
    with pytest.raises(ProgramError, match=r"^--stages auto: 4 layers cannot fill 8 stages"):
        partition(w, 8)


# -- ZB-H1 ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("p,m,tf,tb,tw", [(4, 8, 1.0, 1.0, 1.0), (4, 8, 1.0, 1.2, 0.8), (8, 16, 2.0, 2.0, 1.0),
                                          (2, 5, 1.0, 1.5, 0.5)])
def test_zb_h1_bubble_is_the_papers_formula(p: int, m: int, tf: float, tb: float, tw: float) -> None:
    zb = run_schedule("zb-h1", p, 1, m, [tf] * p, [tb] * p, weight=[tw] * p)
    one = run_schedule("1f1b", p, 1, m, [tf] * p, [tb + tw] * p)
    # Qi et al. 2023, section 3.1: (p-1)(T_F + T_B - T_W) against 1F1B's (p-1)(T_F + T_B + T_W)
    assert zb.bubble_s == pytest.approx((p - 1) * (tf + tb - tw), rel=1e-12)
    assert one.bubble_s == pytest.approx((p - 1) * (tf + tb + tw), rel=1e-12)
    assert zb.bubble_s < one.bubble_s
    assert zb.busy_s == pytest.approx(one.busy_s)
    assert zb.bubble_fraction == pytest.approx(bubble_formula("zb-h1", p, 1, m, (tf, tb, tw)), rel=1e-12)


def test_zb_h1_order_and_in_flight() -> None:
    p, m = 4, 8
    for r in range(p):
        order = schedule_order("zb-h1", p, 1, m, r)
        for kind in "FBW":
            assert sorted(i for k, _s, i in order if k == kind) == list(range(m))
        # each W after its B; the first W after the (r+1)-th B (r deferred)
        pos = {(k, i): j for j, (k, _s, i) in enumerate(order)}
        assert all(pos[("W", i)] > pos[("B", i)] for i in range(m))
        assert sum(1 for k, _s, _i in order[:pos[("W", 0)]] if k == "B") == r + 1
        # 1F1B's p - r microbatches in flight, and r more holding their W's inputs
        assert held_counts(order) == (p - r, r)
        assert held_counts(schedule_order("1f1b", p, 1, m, r))[0] == p - r


@pytest.fixture(scope="module")
def small() -> tuple:
    return plan_pipeline("llama-7b", "pp=4,dp=1,tp=2", "megatron", {"microbatches": 8}, {"layers": 8})


def test_zb_h1_weight_share_and_memory_on_a_plan(small: tuple) -> None:
    _model, plan, _spec, counts, _s = small
    dev = preset_device("h100")
    one = estimate_pipeline(plan, parse_spec(4, 8, "1f1b"), counts, dev)
    zb = estimate_pipeline(plan, parse_spec(4, 8, "zbh1"), counts, dev)
    assert zb.spec.schedule == "zb-h1"
    # W: half of each weight GEMM's backward (dW = X^T dY beside dX = dY W^T), on one of the pipeline's GPUs
    oc = op_communication(plan, dev.lockstep(plan.mesh.size * 4))
    stages = op_stages(plan.program, counts)
    prog = plan.program
    for k, st in enumerate(zb.stages):
        want = sum(0.5 * (oc.compute[i] + oc.wait[i]) for i, op in enumerate(prog.ops)
                   if stages[i] == k and op.rule == "matmul_grad"
                   and any(prog.tensors[n[:-5]].kind == "parameter" for n in op.output_names()
                           if n.endswith(".grad") and n[:-5] in prog.tensors))
        assert st.weight_s == pytest.approx(want, rel=1e-9) and 0 < st.weight_s < st.backward_s
    assert zb.run is not None and one.run is not None
    assert zb.run.bubble_s < one.run.bubble_s and zb.step_overlap_s < one.step_overlap_s
    # rank 0 holds what it holds under 1F1B (p in flight, no W deferred); rank r, r W's inputs more
    assert zb.memory[0] == one.memory[0]
    for r in range(1, 4):
        extra = zb.memory[r].activation_peak - one.memory[r].activation_peak
        assert extra == r * zb.stages[r].wstash_bytes > 0
        assert 0 < zb.stages[r].wstash_bytes < zb.stages[r].stash_bytes
    # so a stage keeps at most p microbatches' worth, 1F1B's first rank's (Qi et al.'s p M_B)
    js = zb.to_json()
    assert [d["weight_pending_microbatches"] for d in js["devices"]] == [0, 1, 2, 3]


# -- --recompute full:K ---------------------------------------------------------------------------


def test_recompute_full_k_layers_per_stage(small: tuple) -> None:
    _model, plan, _spec, counts, _s = small
    dev = preset_device("h100")
    spec = parse_spec(4, 8, "1f1b")
    assert counts == (2, 2, 2, 2)
    none = estimate_pipeline(plan, spec, counts, dev, recompute="none")
    one = estimate_pipeline(plan, spec, counts, dev, recompute="full:1")
    both = estimate_pipeline(plan, spec, counts, dev, recompute="full:2")
    full = estimate_pipeline(plan, spec, counts, dev, recompute="full")
    # K = the layers of a stage is full recomputation; K = 1 halfway, in memory and time
    assert both.memory == full.memory and both.step_overlap_s == pytest.approx(full.step_overlap_s)
    for r in range(4):
        assert full.memory[r].total < one.memory[r].total < none.memory[r].total
        assert none.stages[r].recompute_s == 0 < one.stages[r].recompute_s < full.stages[r].recompute_s
    assert none.step_overlap_s < one.step_overlap_s < full.step_overlap_s
    # one layer's recomputation is its forward (the middle stages hold two equal layers)
    assert one.stages[1].recompute_s == pytest.approx(none.stages[1].forward_s / 2, rel=0.02)
    assert check_recompute("full:3", pipeline=True) == "full:3"
    assert check_recompute("full:2") == "full:2"  # without a pipeline: the model's first K layers (test_recompute_blocks)
    with pytest.raises(ProgramError, match=r"^--recompute 'full:0': expected full:K with K >= 1 layers per stage$"):
        check_recompute("full:0", pipeline=True)


# -- --stages auto --------------------------------------------------------------------------------


def test_plan_unit_costs_add_up_to_the_stages(small: tuple) -> None:
    _model, plan, _spec, counts, _s = small
    dev = preset_device("h100").lockstep(plan.mesh.size * 4)  # one of the pipeline's GPUs, as plan_unit_costs
    u = plan_unit_costs(plan, 4, dev)
    assert u.layers == 8
    st = stage_costs(plan, op_stages(plan.program, counts), counts, dev)
    times, _ranks = stage_loads(u, counts, 4, 1, 8)
    for k in range(4):
        sends = u.send_s * ((k > 0) + (k < 3))
        assert times[k] == pytest.approx(st[k].forward_s + st[k].backward_s + sends, rel=1e-9)


def test_stages_auto_fits_where_the_even_split_does_not(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--model", "llama-7b", "--mesh", "pp=4,dp=2,tp=2", "--microbatches", "8", "--device", "h100",
            "--layers", "32", "--batch", "96", "--json"]
    assert main([*argv, "--stages", "auto"]) == 0
    got = json.loads(capsys.readouterr().out)["pipeline"]
    assert main(argv) == 0
    even = json.loads(capsys.readouterr().out)["pipeline"]
    cap = 80 * 2**30
    assert even["layers_per_stage"] == [8, 8, 8, 8]
    assert max(d["memory"]["device_total"] for d in even["devices"]) > cap
    counts = got["layers_per_stage"]
    assert sum(counts) == 32 and counts[0] < 8 and len(set(counts)) > 1
    assert max(d["memory"]["device_total"] for d in got["devices"]) <= cap
    why = got["stages_auto"]
    assert why["chosen"] == "partition" and why["partition"]["fits"] and why["counts"] == counts
    assert set(why["candidates"]) == {"partition", "default"}  # even is the default here
    assert why["candidates"]["default"]["layers_per_stage"] == [8, 8, 8, 8]
    assert not why["candidates"]["default"]["fits"] and why["candidates"]["partition"]["fits"]
    # the partition's own memory model is the estimate's, less the CUDA context and NCCL buffers
    for d, b in zip(got["devices"], why["partition"]["rank_bytes"]):
        assert b + d["memory"]["runtime_overhead"] == pytest.approx(d["memory"]["device_total"], rel=1e-6)


def test_stages_auto_text_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--model", "llama-7b", "--mesh", "pp=4,dp=1,tp=2", "--microbatches", "8", "--layers", "10"]
    assert main([*argv, "--stages", "auto", "--device", "h100"]) == 0
    out = capsys.readouterr().out
    assert "note: --stages auto: " in out and "the default split (even, balanced by time where the layers" in out
    # the partition finds the even split here (heavier stages first), faster than the balanced one
    assert out.startswith("note: --stages auto: 3,3,2,2 (partition); partitioned (the least slowest stage, refined "
                          "by the schedule, within each rank's memory) 3,3,2,2: step ")
    assert "the default split (even, balanced by time where the layers do not divide) 2,3,3,2: step " in out
    assert main([*argv, "--stages", "auto"]) == 0  # without --device: FLOPs for times
    out = capsys.readouterr().out
    assert out.startswith("note: --stages auto: 3,3,2,2 (partition)") and " FLOP, the schedule " in out
    assert main([*argv, "--stages", "auto", "--layers", "3"]) == 2
    assert "--mesh pp=4: 3 layers cannot fill 4 stages" in capsys.readouterr().err
    assert main([*argv, "--stages", "8,x"]) == 2
    assert "expected layers per stage as integers, e.g. 20,20,20,20, or auto" in capsys.readouterr().err


def test_verify_checks_the_split_planned(capsys: pytest.CaptureFixture[str]) -> None:
    """--verify under --stages auto simulates the uneven split the plan chose (3,3,2,2 of 10
    layers), not one layer a stage."""
    argv = ["plan", "--model", "llama-7b", "--mesh", "pp=4,dp=1,tp=2", "--microbatches", "8", "--layers", "10",
            "--device", "h100", "--stages", "auto", "--verify"]
    assert main([*argv, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["pipeline"]["layers_per_stage"] == [3, 3, 2, 2]
    v = doc["verify"]
    assert v["ok"] and v["layers"] == 10 and v["layers_per_stage"] == [3, 3, 2, 2] and v["stages_in_order"]
    assert main(argv) == 0
    assert "verify: tiny-llama with 10 layers in 4 pipeline stages split 3, 3, 2, 2 (forward runs" \
        in capsys.readouterr().out


# -- the published runs with pipelines (benchmarks/stages.py), at reduced cost ----------------------

_BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "stages.py"


@pytest.mark.parametrize("run_id,layers", [("torchtitan_202412_t6_405b_512gpu_17", 12),
                                           ("megatronlm_h100_2024_177b", 12)])
def test_stages_auto_on_published_runs_is_never_slower(run_id: str, layers: int, tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("stages_bench", _BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = json.loads(bench.RUNS.read_text())
    row = next(r for r in rows if r["id"] == run_id)
    got = bench.compare(row, tmp_path, layers)
    pub, auto = got["published"], got["auto"]
    assert sum(pub["counts"]) == sum(auto["counts"]) == layers
    assert auto["step_s"] <= pub["step_s"] * (1 + 1e-12)
    if len(set(pub["counts"])) > 1:  # torchtitan's 12 layers on pp=8: auto's split is uneven too
        assert pub["counts"] == [1, 2, 2, 2, 2, 1, 1, 1] and len(set(auto["counts"])) > 1
