"""The experts' grouped GEMM timed as ONE kernel over unequal per-expert rows
(spmdkit.cost.rates.grouped_tile_utilisation, spmdkit.cost.moe.ExpertRows): tile counts and
utilisations by hand, the multinomial (top-k) rows' expected tiles from the normal approximation
computed here independently, and the rows a plan's expert GEMMs carry under each routing."""

from __future__ import annotations

import math
from dataclasses import replace
from statistics import NormalDist

import pytest

from spmdkit.cost.compute import op_cost
from spmdkit.cost.devices import preset_device
from spmdkit.cost.moe import ExpertRows, busiest_experts, rank_load
from spmdkit.cost.rates import expected_tiles, grouped_tile_utilisation, tile_wave_utilisation
from spmdkit.planner.planning import plan_preset
from spmdkit.program.runtime import Runtime

# Qwen3-235B's zoo row (tp4 pp8 ep8): 16 local experts of 128, top-8, 512 rows an expert, the
# 1,536-wide expert projection, H100's 132 SMs
N, SMS = 1536, 132


def test_sixteen_experts_at_512_rows_balanced() -> None:
    """Every expert exactly 4 tiles of 128 rows: 16 x 4 x 12 = 768 tiles of 128 x 128, 6 waves of
    132; useful 16 x 512 x 1536 of 6 x 132 x 128 x 128: the GEMM model's own figure."""
    rows = ((512.0, 0.0, 16),)
    assert expected_tiles(512.0, 0.0, 128) == 4
    assert grouped_tile_utilisation(rows, N, SMS) == pytest.approx(16 * 512 * 1536 / (6 * 132 * 128 * 128), abs=1e-12)
    assert grouped_tile_utilisation(rows, N, SMS) == tile_wave_utilisation(16, 512, N, SMS)


def test_one_hot_expert_and_fifteen_at_510() -> None:
    """--moe-skew aux-loss's busiest rank as the rule defines it: one expert at 778 rows (7 tiles of
    128), fifteen at 510 (4 each): 67 x 12 = 804 tiles, 7 waves; 8,428 useful rows. Scaling every
    expert by rho to 527 rows (the old model) gives 5 tiles each: 960 tiles, 8 waves."""
    rows = ((778.0, 0.0, 1), (510.0, 0.0, 15))
    assert [expected_tiles(r, 0.0, 128) for r in (778.0, 510.0)] == [7, 4]
    assert [expected_tiles(r, 0.0, 64) for r in (778.0, 510.0)] == [13, 8]
    u = grouped_tile_utilisation(rows, N, SMS)
    assert u == pytest.approx(8428 * 1536 / (7 * 132 * 128 * 128), abs=1e-12)  # 0.8551
    assert tile_wave_utilisation(16, 527, N, SMS) == pytest.approx(16 * 527 * 1536 / (8 * 132 * 128 * 128), abs=1e-12)
    dev = preset_device("h100")  # the grouped GEMM's rate: the same ceiling and K, its own tiles
    even = dev.gemm_rate("bf16", 16, 512, N, 4096, ((512.0, 0.0, 16),))
    assert even == dev.gemm_rate("bf16", 16, 512, N, 4096)
    assert dev.gemm_rate("bf16", 16, 527, N, 4096, rows) / even == pytest.approx(u / (16 * 512 * 1536 / (6 * 132 * 128 * 128)))


def test_multinomial_rows_by_the_normal_approximation() -> None:
    """Top-8 of 128 over T = 8,192 tokens: an expert's count is Binomial(T, 1/16), mean 512, var
    512 x 15/16 = 480; as a normal with a continuity correction its expected tiles of 128 rows
    are sum_t t P(ceil(X / 128) = t) = 4.4909 (computed here from the distribution of the tile
    count, not the tail sum spmdkit takes); 16 experts: 862.3 tiles of 128 x 128, 7 waves."""
    sd = math.sqrt(8192 * (1 / 16) * (15 / 16))
    d = NormalDist(512, sd)
    want = sum(t * (d.cdf(128 * t + 0.5) - d.cdf(128 * (t - 1) + 0.5)) for t in range(1, 12))
    assert want == pytest.approx(4.4909, abs=1e-4)
    assert expected_tiles(512.0, sd, 128) == pytest.approx(want, abs=1e-9)
    u128 = 16 * 512 * 1536 / (math.ceil(16 * want * 12 / 132) * 132 * 128 * 128)
    assert grouped_tile_utilisation(((512.0, sd, 16),), N, SMS) == pytest.approx(u128, abs=1e-12)  # 0.8312
    rows = ExpertRows(None, 8 / 128).groups(512.0, 16)
    assert rows == ((512.0, pytest.approx(sd), 16),)


def test_busiest_experts_of_the_rules() -> None:
    """The skew's busiest rank: the hot expert and the even rest (rank_load is their mean); the
    histogram's: the block of the largest sum, each expert as measured (exact rows)."""
    groups = busiest_experts(Runtime(moe_skew=1.52), 128, 8, 8)
    assert groups == (pytest.approx((1.52, 1)), pytest.approx(((128 - 1.52) / 127, 15)))
    rho = rank_load(Runtime(moe_skew=1.52), 128, 8, 8)
    rows = ExpertRows(groups, 0.0).groups(512.0 * rho, 16)
    assert [(round(m, 2), sd, n) for m, sd, n in rows] == [(778.24, 0.0, 1), (509.9, 0.0, 15)]
    h = (1.0, 1.0, 3.0, 1.0, 1.0, 1.0, 1.0, 1.0)
    assert busiest_experts(Runtime(moe_histogram=h), 8, 2, 4) == ((3 / 1.25, 1), (1 / 1.25, 1))
    assert busiest_experts(Runtime(), 8, 2, 4) is None


def _expert_gemm(rt: Runtime):  # type: ignore[no-untyped-def]
    plan = plan_preset("mixtral-8x7b", "dp=4,ep=4", "dp,ep", {"layers": 1, "seq": 512, "batch": 16})[1]
    p = replace(plan, runtime=rt)
    i = next(i for i, op in enumerate(p.program.ops)
             if op.phase == "forward" and op.rule == "matmul" and "layers.0.experts.w_gate" in op.input_names())
    return op_cost(p, i)


def test_a_plans_expert_gemm_carries_its_rows() -> None:
    """Mixtral (8 experts, top-2) on dp=4,ep=4 (16 ranks, a sequence of 512 each): 2 experts a rank of
    512 rows (4 ranks x 512 tokens x
    2 / 8). Balanced: exact; top-k: Binomial(2048, 1/4), sd sqrt(512 x 3/4); --moe-skew 2: the
    busiest rank's hot expert 1,024 rows and its neighbour 6/7 x 512, each scattered; a histogram:
    exact. The time follows the tiles: the skewed rank's GEMM against the balanced one's."""
    bal = _expert_gemm(Runtime(moe_routing="balanced"))
    assert bal.gemms == ((2, 512, 14336, 4096),) and bal.grouped_rows == (((512.0, 0.0, 2),),)
    top = _expert_gemm(Runtime())
    assert top.grouped_rows == (((512.0, pytest.approx(math.sqrt(384)), 2),),)
    skew = _expert_gemm(Runtime(moe_skew=2.0))
    hot, rest = skew.grouped_rows[0]
    # the busiest rank's loaded tokens are whole rows a sequence (its GEMM: 4 x round(128 x 10/7) =
    # 732 rows an expert on average, 731.4 unrounded), split 2 : 6/7 between its experts
    assert skew.gemms == ((2, 732, 14336, 4096),)
    assert hot == (pytest.approx(1464 * 0.7), pytest.approx(math.sqrt(1024 * 0.5), abs=0.02), 1)
    assert rest == (pytest.approx(1464 * 0.3), pytest.approx(math.sqrt(512 * 6 / 7 * (1 - 6 / 7 / 4)), abs=0.02), 1)
    hist = _expert_gemm(Runtime(moe_histogram=(2.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0)))
    assert hist.gemms == ((2, 684, 14336, 4096),)  # 4 x round(128 x 4/3)
    assert hist.grouped_rows == (((pytest.approx(1368 * 2 / 3), 0.0, 1), (pytest.approx(1368 / 3), 0.0, 1)),)
    dev = preset_device("h100")
    u_bal = grouped_tile_utilisation(bal.grouped_rows[0], 14336, 132)
    u_hist = grouped_tile_utilisation(hist.grouped_rows[0], 14336, 132)
    assert dev.op_time(hist) / dev.op_time(bal) == pytest.approx(hist.flops / bal.flops * u_bal / u_hist, rel=1e-9)


def _qwen_expert_gemm(framework: str):  # type: ignore[no-untyped-def]
    """Qwen3-30B-A3B (128 experts, top-8, expert width 768, hidden 2048) on ep=8, one sequence of
    512 a rank under the balanced gate: 16 local experts of exactly 8 x 512 x 8 / 128 = 256 rows."""
    plan = plan_preset("qwen3-30b-a3b", "ep=8", "ep", {"layers": 1, "seq": 512, "batch": 8})[1]
    p = replace(plan, runtime=Runtime(framework=framework, moe_routing="balanced"))
    i = next(i for i, op in enumerate(p.program.ops)
             if op.phase == "forward" and op.rule == "matmul" and any("experts" in n and "gate" in n for n in op.input_names()))
    return op_cost(p, i)


def test_megatron_runs_the_experts_in_rounds_of_four_streams() -> None:
    """Transformer Engine's GroupedLinear (Megatron-Core's TEGroupedMLP, TE 2.3-2.7) issues one
    cuBLAS GEMM an expert, expert i on compute stream i % 4: the 16 local experts run as 4 rounds
    of 4, each round's tiles one grid. By hand (128 x 64 tiles the best for a round): a round is
    4 x 2 x 12 = 96 tiles, one wave of 132, useful 4 x 256 x 768 / (132 x 128 x 64) x reuse 2/3 =
    0.4848; one grid over all 16 (torchtitan's torch._grouped_mm) 96 tiles of 256 x 128, one wave,
    0.7273. The four rounds take 0.7273 / 0.4848 = 1.5 x the one grid's time."""
    mg, tt = _qwen_expert_gemm("megatron"), _qwen_expert_gemm("torchtitan")
    assert tt.gemms == ((16, 256, 768, 2048),) and tt.grouped_rows == (((256.0, 0.0, 16),),)
    assert mg.gemms == ((4, 256, 768, 2048),) * 4 and mg.grouped_rows == (((256.0, 0.0, 4),),) * 4
    u4, u16 = tile_wave_utilisation(4, 256, 768, SMS), tile_wave_utilisation(16, 256, 768, SMS)
    assert u4 == pytest.approx(4 * 256 * 768 / (132 * 128 * 64) * (128 * 64 / 192) / 64, abs=1e-12)
    assert u16 == pytest.approx(16 * 256 * 768 / (132 * 256 * 128), abs=1e-12)
    dev = preset_device("h100")
    assert dev.op_time(mg) / dev.op_time(tt) == pytest.approx(u16 / u4, rel=1e-9)
    assert u16 / u4 == pytest.approx(1.5, abs=1e-12)


def test_rounds_keep_the_hot_expert_in_the_first() -> None:
    """--moe-skew's busiest rank (the hot expert first, then the even rest) over 16 local
    experts: the first round holds the hot expert and three of the rest, the others four of the
    rest each; a round's GEMM has its own experts' mean rows. The skew of 2 as exact counts: the
    histogram [254, 126 x 127] (mean 127: the hot expert 2 x, the rest 126 / 127 x; it was
    --moe-skew 2 with --moe-routing balanced, a pair now refused as contradictory)."""
    plan = plan_preset("qwen3-30b-a3b", "ep=8", "ep", {"layers": 1, "seq": 512, "batch": 8})[1]
    p = replace(plan, runtime=Runtime(moe_histogram=(254.0,) + (126.0,) * 127))
    i = next(i for i, op in enumerate(p.program.ops)
             if op.phase == "forward" and op.rule == "matmul" and any("experts" in n and "gate" in n for n in op.input_names()))
    c = op_cost(p, i)
    assert len(c.gemms) == 4 and [len(r) for r in c.grouped_rows] == [2, 1, 1, 1]
    (hot, _, one), (rest, _, three) = c.grouped_rows[0]
    assert (one, three) == (1, 3) and hot == pytest.approx(2 * rest * 127 / 126, rel=1e-9)
    assert all(r == ((rest, 0.0, 4),) for r in c.grouped_rows[1:])
    assert [g[1] for g in c.gemms] == [round((hot + 3 * rest) / 4)] + [round(rest)] * 3  # each round's mean rows
