"""The pruned search's step floor (planner/search_floor.py): never above a configuration's
planned step under any recomputation mode, and a search pruned by it finds the unpruned search's
best with the same figures; its progress line."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest

from spmdkit.cost.devices import load_device
from spmdkit.planner.search import Config, _floor, _model_sizes, config_candidates, search_meshes
from spmdkit.planner.search_config import _Job
from spmdkit.planner.search_floor import Units, base_strategy, busiest_rank
from spmdkit.planner.search_floor_layers import split_levels

MODEL = "llama3-8b"
OVER = {"layers": 4, "batch": 8, "seq": 512}


def _job(model: str, over: dict[str, int]) -> tuple[Any, Any]:
    mc, sizes = _model_sizes(model, over)
    dev = load_device("h100")
    return mc, _Job(dev, sizes.tokens, ["none", "selective", "full"], dev.memory_bytes, None, None, None, 30.0)


SAMPLE = [
    Config(8, 1, 1, "dp"), Config(8, 1, 1, "dp,zero3"), Config(2, 4, 1, "megatron"),
    Config(2, 4, 1, "megatron,sp,zero1"), Config(1, 8, 1, "megatron,sp"), Config(4, 2, 1, "megatron,sp,zero2", grad_accum=2),
    Config(4, 1, 2, "dp,zero1", microbatches=2), Config(2, 2, 2, "megatron,sp,zero3", microbatches=4),
    Config(1, 2, 4, "megatron,sp", microbatches=8), Config(2, 1, 2, "dp", microbatches=4, virtual=2),
]


#: ZeRO-3 configurations: their floor also counts the parameter gathers (StepFloor.gathered)
ZERO3 = [
    Config(8, 1, 1, "dp,zero3"), Config(4, 1, 1, "dp,zero3", grad_accum=2), Config(4, 2, 1, "megatron,zero3"),
    Config(2, 2, 2, "megatron,sp,zero3", microbatches=4), Config(4, 1, 2, "dp,zero3", microbatches=2),
    Config(2, 1, 2, "dp,zero3", microbatches=4, virtual=2), Config(2, 1, 4, "dp,zero3", microbatches=4), Config(2, 2, 2, "megatron,sp,zero3", microbatches=2, virtual=2),
]


@pytest.mark.parametrize("cfg", SAMPLE + ZERO3, ids=lambda c: c.label())
def test_the_floor_is_never_above_the_planned_step(cfg: Config) -> None:
    mc, job = _job(MODEL, OVER)
    floor = _floor(MODEL, mc, job)
    assert floor is not None
    low = floor.step(cfg)
    got = config_candidates(MODEL, cfg, "h100", OVER)
    assert got and low > 0
    assert all(low <= c.step_s for c in got), (low, [(c.config.recompute, c.step_s) for c in got])
    # with the ZeRO-3 gathers, under each mode (a mode's floor bounds it and every mode recomputing more)
    for c in got:
        rc = c.config.recompute
        assert floor.step(cfg, rc, gathers=True) <= c.step_s, (rc, floor.step(cfg, rc, gathers=True), c.step_s)
        assert floor.step(cfg, rc, gathers=True) >= floor.step(cfg, rc)


def test_the_zero3_floor_counts_the_gathers_the_plan_leaves_exposed() -> None:
    """A ZeRO-3 pipeline's floor counts the part of each layer group's parameter gather that the
    group before does not hide, and a flat one the gathers one after the other: both as the
    whole model's plan has them (the two shallow copies extrapolated), and both raise the floor."""
    from spmdkit.cost.step import op_communication
    from spmdkit.cost.step_comm import layer_groups
    from spmdkit.planner.search_config import _preset_plan

    mc, job = _job(MODEL, OVER)
    floor = _floor(MODEL, mc, job)
    assert floor is not None
    cfg = Config(2, 2, 2, "megatron,sp,zero3", microbatches=4)
    z = floor.gathered(cfg)
    # the whole model (4 layers) on the configuration's sub-mesh, one microbatch: its own figures
    whole = _preset_plan(Config(2, 2, 1, cfg.strategy), MODEL, mc.with_(batch=mc.batch // 4), job).plan
    oc = op_communication(whole, job.device)
    groups = layer_groups(whole)
    span: dict[int, float] = {}
    for i, g in enumerate(groups):
        span[g] = span.get(g, 0.0) + oc.compute[i] + oc.wait[i] - oc.prefetch_exposed.get(i, 0.0)
    assert oc.gathers_s > 0 and sum(oc.prefetch_exposed.values()) > 0
    assert z.gathers == pytest.approx(oc.gathers_s, rel=1e-9)
    assert z.exposed == pytest.approx(sum(oc.prefetch_exposed.values()), rel=1e-9)
    # each exposed part is the gather less the group before's span (FSDP's prefetch)
    first = {i: g for i, g in enumerate(groups) if i in oc.prefetch_exposed}
    assert all(oc.prefetch_exposed[i] <= oc.gathers_s for i in first)
    assert floor.step(cfg, gathers=True) > floor.step(cfg)
    flat = Config(8, 1, 1, "dp,zero3")
    assert floor.step(flat, gathers=True) >= floor.gathered(flat).gathers > 0


def test_the_floor_is_cached_per_layer_key() -> None:
    mc, job = _job(MODEL, OVER)
    floor = _floor(MODEL, mc, job)
    assert floor is not None
    a = floor.step(Config(4, 2, 1, "megatron,sp,zero1"))
    plans = floor.plans
    # the same layers (tp 2, sp, one rank's 2 sequences): dp, the ZeRO level and the stages do not
    # change them, only how the work adds up (2 stages, 2 microbatches: (2 + 1) / 2 of a microbatch's)
    assert floor.step(Config(4, 2, 1, "megatron,sp,zero3")) == a
    two = Config(2, 2, 2, "megatron,sp", microbatches=2)
    u = floor.of(two).units["none"]
    assert floor.step(two) == pytest.approx(max(a / 2 * (2 + 1), busiest_rank(u, 4, 2, 1, 2)))
    assert floor.plans == plans == 2  # two shallow copies (2 and 3 layers), once
    assert base_strategy("megatron,sp,zero2") == "megatron,sp" and base_strategy("zero1") == "dp"


class _Lines:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def update(self, done: int | None = None, total: int | None = None, note: str | None = None) -> None:
        pass

    def advance(self, n: int = 1, note: str | None = None) -> None:
        pass

    def phase(self, text: str) -> None:
        self.lines.append(text)


def test_the_pruned_search_finds_the_unpruned_best_with_its_figures() -> None:
    full = search_meshes(MODEL, 8, "h100", overrides=OVER, prune=False)
    seen = _Lines()
    pruned = search_meshes(MODEL, 8, "h100", overrides=OVER, prune=True, progress=seen)
    assert full.best is not None and pruned.best is not None
    a, b = full.best, pruned.best
    assert a.config == b.config
    assert (a.step_s, a.memory, a.comm_s, a.mfu, a.collectives) == (b.step_s, b.memory, b.comm_s, b.mfu, b.collectives)
    by_step = [cfg for cfg, why in pruned.pruned if why.startswith("its step is at least")]
    assert by_step and pruned.plans < full.plans
    # every configuration the floor pruned is no faster than the best in the unpruned search
    steps = {c.config.label().split(" recompute=")[0]: c.step_s for c in full.fitting}
    assert all(steps.get(cfg.label(), float("inf")) >= a.step_s for cfg in by_step)
    # among them ZeRO-3 configurations, their bounds refined with their gathers when their turn came
    assert any("zero3" in cfg.strategy for cfg in by_step)
    assert any(line.startswith("step bounds of ") and "layer plans" in line for line in seen.lines)


LONG = {"layers": 4, "batch": 8, "seq": 8192}  # activations that matter beside the states


@pytest.mark.parametrize("cfg", [SAMPLE[2], SAMPLE[6], SAMPLE[7]], ids=lambda c: c.label())
def test_the_bound_under_a_cap_that_forces_recomputation_is_below_the_fitting_step(cfg: Config) -> None:
    """Under a cap between full recomputation's memory and the others', the bound (the floor of
    the least recomputation whose kept activations can fit) stays under the step that fits."""

    from spmdkit.planner.search import _bounds, _step_bound

    got = {c.config.recompute: c for c in config_candidates(MODEL, cfg, "h100", LONG)}
    full, least = got["full"], min(got["none"].memory, got.get("selective", got["none"]).memory)
    assert full.memory < least
    cap = (full.memory + least) // 2
    mc, job = _job(MODEL, LONG)
    job = replace(job, cap=cap)
    floor = _floor(MODEL, mc, job)
    assert floor is not None
    low = _step_bound(cfg, _bounds(MODEL, mc, job), floor, job)
    fitting = [c for c in config_candidates(MODEL, cfg, "h100", LONG, memory_cap=cap) if c.fits]
    assert fitting and low <= min(c.step_s for c in fitting)


def test_the_busiest_rank_bound_by_hand() -> None:
    """The least over splits of max_r (m W_r + the chunks before rank r), by hand."""
    u = Units(first=1.0, last=5.0, layer=2.0)
    # 2 ranks, 1 chunk each, 4 layers, m = 3: rank 0 (e + n0 l), rank 1 (h + n1 l) and e + l before it;
    # n = (1, 3): 3 * 3 = 9, 3 * 11 + 3 = 36; (2, 2): 15, 3 * 9 + 3 = 30; (3, 1): 21, 3 * 7 + 3 = 24: the least
    assert busiest_rank(u, 4, 2, 1, 3) == 24.0
    # 3 ranks x 2 chunks, 7 layers (p v does not divide them), m = 4: the figures with two layers
    # each are 4 * 5 = 20, 4 * 4 + 3 = 19, 4 * 9 + 5 = 41; the seventh layer on rank 1: 27
    assert busiest_rank(u, 7, 3, 2, 4) == 41.0
    # a light head: the layers' count decides (6 layers on 2 ranks, one more where 5 would not divide)
    light = Units(first=0.0, last=0.0, layer=1.0)
    assert busiest_rank(light, 6, 2, 1, 4) == max(4 * 3, 4 * 3 + 1)
    assert busiest_rank(light, 5, 2, 1, 4) == 4 * 3 + 0  # 3 layers on rank 0 (12) or on rank 1 (13): 12
    assert busiest_rank(light, 3, 2, 2, 4) == 0.0  # fewer layers than chunks: no bound


UNEVEN = [  # layers, configuration: p v not dividing the layers, 4 and 8 chunks a rank, the head's rank busiest
    (5, Config(1, 2, 2, "megatron,sp", microbatches=4)),
    (4, Config(1, 1, 2, "dp", microbatches=8, virtual=2)),
    (7, Config(2, 1, 2, "dp", microbatches=4, virtual=2)),
    (7, Config(1, 1, 3, "dp", microbatches=6)),
    (8, Config(2, 1, 2, "dp,zero1", microbatches=4, virtual=4)),
    (16, Config(2, 1, 2, "dp", microbatches=4, virtual=8)),
]


@pytest.mark.parametrize("layers,cfg", UNEVEN, ids=lambda x: x.label() if isinstance(x, Config) else str(x))
def test_the_pipeline_floor_holds_for_uneven_layer_counts_and_chunks(layers: int, cfg: Config) -> None:
    """llama3-8b's head (128k vocabulary) weighs more than two of its layers at this size: the
    floor is the larger of the even split's and the busiest rank's terms, under every planned
    step; with one layer a chunk (4 layers, 2 x 2 chunks, 8 microbatches) the head's rank is
    busiest: 8 (2 l + h) + e + l, over the even (8 + 1/2) (e + 4 l + h) / 2."""
    over = dict(OVER, layers=layers)
    mc, job = _job(MODEL, over)
    floor = _floor(MODEL, mc, job)
    assert floor is not None
    f = floor.of(cfg)
    assert f.units["none"].last > 2 * f.units["none"].layer > 0
    got = config_candidates(MODEL, cfg, "h100", over)
    assert got
    for c in got:
        rc = c.config.recompute
        u = f.units[rc]
        even = (f.work + f.rerun[rc]) / cfg.pp * (cfg.microbatches + (cfg.pp - 1) / cfg.virtual)
        busy = busiest_rank(u, layers, cfg.pp, cfg.virtual, cfg.microbatches)
        assert floor.step(cfg, rc) == pytest.approx(max(even, busy))
        assert floor.step(cfg, rc) <= c.step_s, (rc, even, busy, c.step_s)
    if (layers, cfg.pp, cfg.virtual, cfg.microbatches) == (4, 2, 2, 8):
        u = f.units["none"]
        assert busiest_rank(u, layers, cfg.pp, cfg.virtual, cfg.microbatches) == pytest.approx(
            8 * (2 * u.layer + u.last) + u.first + u.layer)
        assert floor.step(cfg) > 1.2 * f.work / cfg.pp * (cfg.microbatches + (cfg.pp - 1) / cfg.virtual)


#: a DeepSeek-style MoE (3 dense layers first, then MoE layers, one shared expert) at 12 layers
MOE3 = ('{"base": "tiny-llama", "name": "moe3", "layers": 12, "hidden": 256, "heads": 4, "kv_heads": 4, "ffn": 512, '
        '"vocab": 512, "seq": 64, "batch": 16, "dtype": "bfloat16", "experts": 4, "top_k": 2, "moe_ffn": 256, '
        '"shared_experts": 1, "dense_layers": 3}')

MOE_SAMPLE = [
    Config(2, 1, 1, "dp,ep,zero1", ep=2), Config(1, 1, 1, "dp,ep", ep=4), Config(1, 2, 1, "megatron,sp,ep", ep=2),
    Config(2, 2, 1, "megatron,ep,zero2", ep=2), Config(1, 1, 2, "dp,ep,zero1", microbatches=4, ep=2),
    Config(1, 1, 4, "dp,ep", microbatches=8, ep=2), Config(1, 2, 2, "megatron,sp,ep,etp=1", microbatches=8, ep=2),
]


@pytest.mark.parametrize("cfg", MOE_SAMPLE, ids=lambda c: c.label())
def test_a_moe_floor_from_one_copy_is_under_the_two_copy_floor_and_the_planned_step(cfg: Config) -> None:
    """A MoE model's layer keys on one copy of dense + 2 layers, the work counted by layer
    (planner/search_floor_layers.py): at most the two-copy extrapolation (within 1%), never above
    a planned step under any recomputation mode."""

    from spmdkit.planner.search_floor import StepFloor
    from spmdkit.planner.search_floor_layers import LayerStepFloor

    mc, job = _job(MOE3, {})
    floor = _floor(MOE3, mc, job)
    assert isinstance(floor, LayerStepFloor) and floor.dense == 3
    two = StepFloor(floor.plan_copy, floor.device, floor.layers, floor.batch, floor.dense)
    got = config_candidates(MOE3, cfg, "h100")
    assert got
    for c in got:
        low, high = floor.step(cfg, c.config.recompute), two.step(cfg, c.config.recompute)
        assert 0.99 * high <= low <= high * (1 + 1e-12) and low <= c.step_s, (c.config.recompute, low, high, c.step_s)
    assert floor.plans == 1 and two.plans == 2  # one copy of 5 layers against copies of 4 and 5
    assert replace(floor, cache={}).of(replace(cfg, strategy="auto")).work == 0  # no key: no floor


def test_whole_layers_level_by_hand() -> None:
    """search_floor_layers.whole_layers_level: whole MoE layers under each rank's room, the
    dense first layers' room where they can lie, full:K's recomputed layers (worked by hand)."""
    from spmdkit.planner.search_floor_layers import whole_layers_level

    # 2 ranks of 10 bytes, m = 2: rank 0 keeps 2 microbatches (a layer 1 + 2 x 1 = 3 bytes: 3
    # layers), rank 1 one (2 bytes: 5 layers); 7 layers: 3 + 4, so some rank holds 4 (the
    # fractional fill would say 3.67)
    assert whole_layers_level(10.0, 2, 1, 2, 7, 1.0, 1.0) == 4.0
    # a dense first layer (3 bytes on rank 0) leaves rank 0 room for 2: 2 + 5
    assert whole_layers_level(10.0, 2, 1, 2, 7, 1.0, 1.0, 1, 1.0, 1.0) == 5.0
    # two dense layers, 6 MoE ones: both on rank 0 (room for 1 more: 1 + 5), or one a rank; with
    # one chunk a rank rank 0 then holds only its dense layer (rank 1: 8 bytes left, 4 layers:
    # 4 < 6), with two chunks a rank its second chunk may hold MoE layers (2 + 4)
    assert whole_layers_level(10.0, 2, 1, 2, 6, 1.0, 1.0, 2, 1.0, 1.0) == 5.0
    assert whole_layers_level(10.0, 2, 2, 2, 6, 1.0, 1.0, 2, 1.0, 1.0) == 4.0
    assert whole_layers_level(10.0, 2, 1, 2, 7, 1.0, 1.0, 2, 1.0, 1.0) == float("inf")  # 6 at most
    # full:1 with full keeping nothing: rank 0 holds (10 + 2 x 1) / 3 = 4, rank 1 (10 + 1) / 2 = 5
    assert whole_layers_level(10.0, 2, 1, 2, 7, 1.0, 1.0, 0, 0.0, 0.0, 1, 0.0) == 4.0


@pytest.mark.parametrize("cfg", [Config(1, 1, 4, "dp", microbatches=4), Config(1, 2, 4, "megatron,sp", microbatches=4)],
                         ids=lambda c: c.label())
def test_a_recomputed_layers_working_peak_is_the_one_layer_stages_peak(cfg: Config) -> None:
    """The floor's working peak of a layer recomputed in full (search_floor.layer_peak: each
    layer's ops alone on activation_deltas' curve) is, on dp = 1 without ZeRO (the floor's own
    layer plans), exactly the working peak of a middle stage holding that one layer in the planned
    pipeline under full recomputation (llama3-8b at 4 layers on pp=4: 208 MiB at tp=1, 112 MiB at
    tp=2 with sp); with ZeRO-2 on dp=2 the stages peak higher (168 MiB against 104 MiB), never lower."""
    mc, job = _job(MODEL, OVER)
    floor = _floor(MODEL, mc, job)
    assert floor is not None
    peak = floor.of(cfg).full_peak
    full = next(c for c in config_candidates(MODEL, cfg, "h100", OVER) if c.config.recompute == "full")
    stages = full.estimate.stages
    assert [s.working_peak for s in stages[1:3]] == [peak, peak]
    assert peak == (218243088 if cfg.tp == 1 else 117510160)
    assert all(peak <= s.working_peak for s in stages) and all(s.stash_bytes < peak for s in stages[:3])
    zero2 = Config(2, 1, 4, "dp,zero2", microbatches=4)
    low = floor.of(zero2).full_peak
    got = next(c for c in config_candidates(MODEL, zero2, "h100", OVER) if c.config.recompute == "full")
    assert 0 < low <= min(s.working_peak for s in got.estimate.stages)


def test_split_levels_count_the_working_peak_by_hand() -> None:
    """7 MoE layers of 1 byte held and 1 kept a microbatch on 2 ranks of 10 bytes (2 and 1
    microbatches in flight): ranks hold 3 and 5, the level 4. With a working peak of 5 bytes
    beside f - 1 microbatches' stash rank 0 holds (10 - 5) / 2 = 2, rank 1 5: the level 5; with
    6 bytes, 2 + 4 < 7: no split fits."""
    assert split_levels(10.0, 2, 1, 2, 7, 1.0, 1.0) == ((4, 1, ()),)
    assert split_levels(10.0, 2, 1, 2, 7, 1.0, 1.0, flights=(2.0, 1.0), peak=5.0) == ((5, 1, ()),)
    assert split_levels(10.0, 2, 1, 2, 7, 1.0, 1.0, flights=(2.0, 1.0), peak=6.0) == ()


V3_ETP1 = "megatron,sp,ep,etp=1,zero2"
#: DeepSeek-V3 without its multi-token-prediction module (the catalog's has it: models/zoo_mtp.py)
V3_MAIN = '{"base":"deepseek-v3","name":"deepseek-v3","mtp_layers":0}'


def _mtp_floor_under_its_steps(cfg: Config, job: Any) -> None:
    """The catalog's DeepSeek-V3 (with its MTP module on the last stage): each mode's floor under
    every step of ``cfg`` that fits."""
    from spmdkit.planner.search import _bounds

    mc, _sizes = _model_sizes("deepseek-v3", V3)
    floor = _floor("deepseek-v3", mc, job, _bounds("deepseek-v3", mc, job))
    assert floor is not None
    got = [c for c in config_candidates("deepseek-v3", cfg, "h800", V3) if c.fits]
    assert got and all(floor.step(cfg, c.config.recompute) <= c.step_s for c in got)


def test_deepseek_v3s_etp1_pipelines_floor_counts_whole_layers() -> None:
    """DeepSeek-V3 on 2,048 H800, Megatron's ETP=1 token path with tp=2, ``dp=32 ep=2 tp=2 pp=16``:
    the floor of every mode stays under the steps planned for it on the command's split (2, 4 x
    14, 3), where no recomputation does not fit and the fastest that does is full:1, 26.46 s
    (whole layers, test_whole_layers_level_by_hand, raised the floor of ``none`` from 21.5 s to
    26.5 s while Megatron's MoE layers stashed the experts' output rows, 128 MiB more a layer-
    microbatch, and full:2 at 27.80 s was the fastest fitting; without them 4 layers a rank fit the
    level and the floor is 21.48 s, under the 23.65 s ``none`` was planned at while Megatron-FSDP's
    ZeRO-2 reduce-scatters were timed once; each of its 240 microbatches reduce-scatters them now,
    docs/devices.md "Gradient accumulation under ZeRO": ``none`` 119.78 s, full:1 119.88 s, the
    floor, which does not count them, far under; the experts' grouped GEMM over top-k routing's
    scattered rows, tests/test_grouped_gemm.py, raised the floor to 22.10 s, ``none`` to 119.81 s
    and full:1 to 119.92 s; the Hopper GEMMs at their sustained share, Rates.sustained, the floor
    to 25.81 s, ``none`` to 120.02 s and full:1 to 120.14 s, the reductions unchanged; Megatron's
    grouped GEMM as Transformer Engine runs it, 64 local experts in rounds of 4 streams, and the
    alltoall dispatcher's sorts by local expert, spmdkit.cost.moe, the floor to 28.73 s, ``none``
    to 120.18 s and full:1 to 120.33 s; the weight gradients accumulated into the fp32 main_grad,
    spmdkit.cost.compute.fused_wgrad, which the floor leaves out as ZeRO-2/3 do (Runtime.lower_bound),
    and Megatron's optimizer-step passes, spmdkit.cost.optimizer_step: the floor 28.59 s, ``none``
    120.17 s and full:1 120.32 s, the step being the reductions' stream; the step at the pace of the
    slowest of its 2048 GPUs, Device.slowdown: the floor 29.60 s, ``none`` 120.23 s, full:1 120.38 s;
    the Hopper sustained share re-fitted with it, 0.79 -> 0.823: 28.77 s, 120.18 s, 120.33 s; each
    attention kernel's own shape, rates.attention_shape, and the share re-fitted, 0.843: 28.59 s,
    120.17 s, 120.32 s; the share re-fitted with NeMo 24.07's runs on flash-attn, 0.870: 27.98 s,
    120.14 s, 120.28 s; the share re-fitted after the merges, 0.864: 28.11 s, 120.15 s, 120.29 s;
    cuDNN's 9.1.0 level and the share re-fitted with torchao's float8 TP, 0.853: 28.20 s, 120.15 s, 120.30 s;
    re-fitted with torchao's float8 casts, 0.870: 27.82 s, 120.13 s, 120.27 s);
    and every
    full:K of the interleaved ``dp=16
    ep=4 tp=2 pp=16 vp=2`` stays above its block split floor. These figures are the main model's
    (``mtp_layers`` 0: they predate the catalog's MTP module); with the module, every mode's floor
    stays under each step that fits (the module rides in the head's unit of the last stage)."""
    from spmdkit.planner.search import _bounds

    mc, sizes = _model_sizes(V3_MAIN, V3)
    cfg = Config(32, 2, 16, V3_ETP1, microbatches=240, ep=2)
    dev = load_device("h800").lockstep(cfg.devices)  # the search's: one of its 2048 GPUs (Device.slowdown)
    job = _Job(dev, sizes.tokens, ["none", "selective", "full"], dev.memory_bytes, None, None, None, 30.0)
    floor = _floor(V3_MAIN, mc, job, _bounds(V3_MAIN, mc, job))
    assert floor is not None
    _mtp_floor_under_its_steps(cfg, job)
    assert floor.step(cfg, "none") == pytest.approx(27.816, abs=1e-3)
    got = config_candidates(V3_MAIN, cfg, "h800", V3)
    none = next(c for c in got if c.config.recompute == "none")
    assert not none.fits and none.estimate.counts == (2,) + (4,) * 14 + (3,)
    assert floor.step(cfg, "none") <= none.step_s == pytest.approx(120.131, abs=1e-3)
    best = min((c for c in got if c.fits), key=lambda c: c.step_s)
    assert best.config.recompute == "full:1" and best.step_s == pytest.approx(120.274, abs=1e-3)
    assert floor.step(cfg, "none") <= best.step_s
    assert all(floor.step(cfg, c.config.recompute) <= c.step_s for c in got if c.fits)
    # with its own layers' tail: the stream of 240 microbatches' reduce-scatters of the 4 MoE
    # layers the busiest rank holds at least (search_floor_tail.Tail.stream), under every step;
    # none before the first microbatch's forward through the model (StepFloor.stream): 117.161 s
    # without it, 117.743 s with it (117.670 before the sustained share: the forward grows by 1/0.79;
    # 117.841 with Megatron's 64 local experts in TE's rounds of 4 and the alltoall dispatcher's sorts;
    # 117.843 with the fused weight-gradient accumulation and the optimizer-step passes; 117.865 at the
    # slowest of 2048 GPUs' pace; 117.847 at the sustained share 0.823; 117.842 with each attention
    # kernel's own shape and the share 0.843; 117.829 at the share 0.870; 117.831 at the share 0.864;
    # 117.833 at cuDNN's 9.1.0 level and the share 0.853; 117.825 at the share 0.870)
    own = floor.step(cfg, "none", gathers=True)
    assert own == pytest.approx(117.825, abs=1e-3) and own <= min(c.step_s for c in got)
    inter = Config(16, 2, 16, V3_ETP1, microbatches=240, ep=4, virtual=2)
    low = floor.blocks_step(inter)
    assert 0 < low < math.inf
    blocks = [x for x in config_candidates(V3_MAIN, inter, "h800", V3) if x.config.recompute.startswith("full:")]
    assert [x.config.recompute for x in blocks] == ["full:1"] and blocks[0].fits
    assert 23.0 < low <= blocks[0].step_s, (low, blocks[0].step_s)


V3 = {"batch": 15360}


@pytest.mark.parametrize("cfg", [Config(32, 1, 32, "dp,ep,zero2", microbatches=240, ep=2),
                                 Config(16, 1, 16, "dp,ep,zero2", microbatches=120, ep=8)], ids=lambda c: c.label())
def test_deepseek_v3s_split_floor_is_under_its_fitting_steps_and_bites(cfg: Config) -> None:
    """DeepSeek-V3 on 2,048 H800: without recomputation a time-balanced split of its 58 MoE layers
    holds 140-180 GiB on the first stages (their microbatches in flight), so the split floor
    (search_floor_layers.split_floor: the ranks filled to what memory allows, the others
    holding more) is well above the plain floor; never above a step that fits."""
    from spmdkit.planner.search import _bounds
    from spmdkit.planner.search_floor import StepFloor

    mc, sizes = _model_sizes("deepseek-v3", V3)
    dev = load_device("h800")
    job = _Job(dev, sizes.tokens, ["none", "selective", "full"], dev.memory_bytes, None, None, None, 30.0)
    floor = _floor("deepseek-v3", mc, job, _bounds("deepseek-v3", mc, job))
    assert floor is not None
    plain = StepFloor(floor.plan_copy, floor.device, floor.layers, floor.batch, floor.dense)
    plain.cache = floor.cache  # the same layer figures, without the split
    assert floor.step(cfg, "none") > 1.2 * plain.step(cfg, "none")
    got = config_candidates("deepseek-v3", cfg, "h800", V3)
    fitting = [c for c in got if c.fits]
    assert fitting and not any(c.fits for c in got if c.config.recompute == "none")
    assert all(floor.step(cfg, c.config.recompute) <= c.step_s for c in fitting)


def test_deepseek_v3s_full_k_relaxation_needs_the_planned_k() -> None:
    """DeepSeek-V3 on 2,048 H800, ``dp=64 ep=2 tp=2 pp=8 vp=2 (m=120)`` with Megatron's ETP=1
    path and ZeRO-2: its plan fits full:3 (29.36 s) and not full:2. The memory relaxation that
    picks full:K's least K held each rank's layers and min(p - r, m) microbatches of their kept
    bytes, so K = 1 fitted it and the bound was 23.0 s (no recomputation's floor). With the
    allocator's reserve, interleaved 1F1B's in-flight count (9.5 microbatches on rank 2, not 6)
    and a recomputed layer's working peak (0.95 GiB) beside the others' stash, K = 1 and 2 do not
    fit it either (no level of MoE layers), and the bound counts full:3's reruns: 25.1 s, under
    the planned step."""
    from spmdkit.planner.search import _bounds
    from spmdkit.planner.search_bounds import GROW
    from spmdkit.planner.search_floor_layers import _moe_room

    mc, sizes = _model_sizes("deepseek-v3", V3)
    dev = load_device("h800")
    job = _Job(dev, sizes.tokens, ["none", "selective", "full"], dev.memory_bytes, None, None, None, 30.0)
    bounds = _bounds("deepseek-v3", mc, job)
    floor = _floor("deepseek-v3", mc, job, bounds)
    assert floor is not None
    cfg = Config(64, 2, 8, V3_ETP1, microbatches=120, ep=2, virtual=2)
    f = floor.of(cfg)
    assert 0.9 * 2**30 < f.full_peak < 1.0 * 2**30
    room = _moe_room(f, cfg, bounds, job.cap)
    assert isinstance(room, tuple)
    per, dense, left = room
    flights, working = bounds.flights(8, 2, 120)
    assert working and flights[2] == 9.5

    def levels(k: int) -> tuple[Any, ...]:
        return split_levels(left, 8, 2, 120, len(per), min(per), GROW * f.layer_kept["none"], len(dense), min(dense),
                            GROW * f.kept["none"], k, GROW * f.layer_kept["full"], flights, GROW * f.full_peak)

    # K = 2 passes the relaxation since a view is counted once (memory_saved.shared_storage: each
    # layer's attention output once, not twice), within its slack: the plan still needs K = 3 (below)
    assert levels(1) == () and levels(2) and levels(3)
    low = floor.blocks_step(cfg)
    got = {c.config.recompute: c for c in config_candidates("deepseek-v3", cfg, "h800", V3)}
    assert "full:3" in got and got["full:3"].fits
    assert 25.0 < low <= got["full:3"].step_s, (low, got["full:3"].step_s)


def _plan_facts(plan: Any) -> tuple[Any, ...]:
    return plan.attrs, plan.ops, plan.reshards, plan.annotations, plan.storage, plan.rounds


def test_a_built_model_serves_many_plans_unchanged() -> None:
    """The search's built models (planning.BuiltModels): one model planned on several meshes and
    strategies in turn gives each the plan a fresh build gives, and its program's ops and tensors
    are the same after (no plan changes the object the next one reads)."""
    from spmdkit.planner.planning import BuiltModels, plan_model

    cases = [("mixtral-8x7b", "dp=2,ep=2,tp=2", "megatron,sp,ep,zero3"), ("mixtral-8x7b", "dp=4,ep=2", "dp,ep,zero1"),
             ("mixtral-8x7b", "dp=2,ep=2,tp=2", "megatron,sp,ep,zero3"), ("llama3-8b", "dp=2,tp=4", "megatron,sp,zero2"),
             ("llama3-8b", "dp=8", "dp,zero3"), ("llama3-8b", "dp=2,tp=4", "megatron,sp,zero2")]
    over = {"layers": 2, "batch": 8, "seq": 64}
    models = BuiltModels(limit=2)
    first: dict[tuple[str, bool], Any] = {}
    served = 0
    for name, mesh, strategy in cases:
        _model, plan, _ = plan_model(name, mesh, strategy, over, models=models)
        _m, fresh, _ = plan_model(name, mesh, strategy, over)
        assert fresh.program is not plan.program and _plan_facts(plan) == _plan_facts(fresh)
        prog, key = plan.program, (name, "megatron" in strategy)  # megatron's loss is vocab-parallel
        if key in first and first[key][0] is prog:
            served += 1
            assert prog.tensors == first[key][1] and prog.ops == first[key][2]
        first[key] = (prog, dict(prog.tensors), list(prog.ops))
    # the third and the last are served again; the others built (two kept: the oldest dropped)
    assert served == models.built.hits == 2 and len(models.built) == 2
