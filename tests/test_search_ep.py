"""The outer search with expert parallelism (issue 28): ep meshes among the others for a MoE
model, a dense model's candidates as they were, the bounds that prune a large MoE search (lower
bounds of every planned configuration, the same best with and without them), DeepSeek-V3 on
2,048 H800 with its memory breakdown checked by hand, the DTensor export's statement."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from typing import Any

import pytest

from spmdkit.cost.devices import DEVICES, cost_model, recost
from spmdkit.cost.step import estimate_step
from spmdkit.outputs.dtensor_ep import expert_parallel_statement
from spmdkit.outputs.export import dtensor_document
from spmdkit.planner.pipeline import estimate_pipeline
from spmdkit.planner.pipeline_plan import plan_pipeline
from spmdkit.planner.planning import plan_model
from spmdkit.planner.search import Config, _bounds, _model_sizes, _work, hand_strategies, search_meshes
from spmdkit.planner.search_config import _Job
from spmdkit.program.runtime import Runtime

#: a small MoE whose experts dominate its parameters (4 experts of width 4096)
MOE = json.dumps({"base": "tiny-llama", "name": "moe", "layers": 2, "hidden": 256, "heads": 4, "kv_heads": 4,
                  "ffn": 512, "vocab": 512, "seq": 64, "batch": 8, "dtype": "bfloat16", "experts": 4, "top_k": 2,
                  "moe_ffn": 4096})
#: below what a device holds without splitting the experts (every plan needs at least 0.93 GB)
CAP = "0.95GB"

#: llama-7b on 16 devices at batch 16 before issue 28 (dp, tp, pp, microbatches, strategy)
DENSE_16 = (
    "16,1,1,1,dp;16,1,1,1,dp,zero1;16,1,1,1,dp,zero2;16,1,1,1,dp,zero3;8,2,1,1,megatron;8,2,1,1,megatron,zero1;"
    "8,2,1,1,megatron,zero2;8,2,1,1,megatron,zero3;8,2,1,1,megatron,sp;8,2,1,1,megatron,sp,zero1;"
    "8,2,1,1,megatron,sp,zero2;8,2,1,1,megatron,sp,zero3;4,4,1,1,megatron;4,4,1,1,megatron,zero1;"
    "4,4,1,1,megatron,zero2;4,4,1,1,megatron,zero3;4,4,1,1,megatron,sp;4,4,1,1,megatron,sp,zero1;"
    "4,4,1,1,megatron,sp,zero2;4,4,1,1,megatron,sp,zero3;2,8,1,1,megatron;2,8,1,1,megatron,zero1;"
    "2,8,1,1,megatron,zero2;2,8,1,1,megatron,zero3;2,8,1,1,megatron,sp;2,8,1,1,megatron,sp,zero1;"
    "2,8,1,1,megatron,sp,zero2;2,8,1,1,megatron,sp,zero3;1,16,1,1,megatron;1,16,1,1,megatron,sp;8,1,2,2,dp;"
    "8,1,2,2,dp,zero1;8,1,2,2,dp,zero2;8,1,2,2,dp,zero3;4,2,2,4,megatron;4,2,2,4,megatron,zero1;"
    "4,2,2,4,megatron,zero2;4,2,2,4,megatron,zero3;4,2,2,4,megatron,sp;4,2,2,4,megatron,sp,zero1;"
    "4,2,2,4,megatron,sp,zero2;4,2,2,4,megatron,sp,zero3;2,4,2,8,megatron;2,4,2,8,megatron,zero1;"
    "2,4,2,8,megatron,zero2;2,4,2,8,megatron,zero3;2,4,2,8,megatron,sp;2,4,2,8,megatron,sp,zero1;"
    "2,4,2,8,megatron,sp,zero2;2,4,2,8,megatron,sp,zero3;1,8,2,16,megatron;1,8,2,16,megatron,sp;4,1,4,4,dp;"
    "4,1,4,4,dp,zero1;4,1,4,4,dp,zero2;4,1,4,4,dp,zero3;2,2,4,8,megatron;2,2,4,8,megatron,zero1;"
    "2,2,4,8,megatron,zero2;2,2,4,8,megatron,zero3;2,2,4,8,megatron,sp;2,2,4,8,megatron,sp,zero1;"
    "2,2,4,8,megatron,sp,zero2;2,2,4,8,megatron,sp,zero3;1,4,4,16,megatron;1,4,4,16,megatron,sp;2,1,8,8,dp;"
    "2,1,8,8,dp,zero1;2,1,8,8,dp,zero2;2,1,8,8,dp,zero3;1,2,8,16,megatron;1,2,8,16,megatron,sp;1,1,16,16,dp")


def test_a_dense_models_candidates_are_what_they_were() -> None:
    _mc, sizes = _model_sizes("llama-7b", {"batch": 16})
    work, refused = _work(16, True, sizes, None, False)
    got = ";".join(f"{c.dp},{c.tp},{c.pp},{c.microbatches},{c.strategy}" for c in work if c.virtual == 1)
    assert got == DENSE_16 and not refused
    # and interleaved 1F1B over 2 model chunks beside each pipeline whose microbatches pp divides
    two = {replace(c, virtual=1) for c in work if c.virtual == 2}
    assert two == {c for c in work if c.pp > 1 and c.virtual == 1 and c.microbatches % c.pp == 0} and two
    assert all(c.ep == 1 and c.sub_mesh_text == f"dp={c.dp},tp={c.tp}" for c in work)


def test_interleaving_over_4_and_8_chunks_where_they_split_the_layers_evenly() -> None:
    """NeMo's Mixtral-8x7B recipe on 64 H100 (pp=4 x vp=8, ep=8, one layer a virtual stage) is
    among the search's configurations; vp=4 and 8 only where pp x vp divides the layers."""
    _mc, sizes = _model_sizes("mixtral-8x7b", {"batch": 256, "seq": 4096})
    work, _ = _work(64, True, sizes, None, False)
    assert replace(Config(2, 1, 4, "dp,ep,zero1", microbatches=16, ep=8), virtual=8) in work
    assert {c.virtual for c in work if c.pp == 4} == {1, 2, 4, 8}
    assert all(32 % (c.pp * c.virtual) == 0 for c in work if c.virtual > 2)
    assert {c.virtual for c in work if c.pp == 16} == {1, 2}  # 32 layers: 64 virtual stages would be fewer
    _mc, gpt = _model_sizes("gpt3-175b", {"batch": 1536, "seq": 2048})
    work, _ = _work(1024, True, gpt, ["megatron,sp,zero1"], False)
    assert {c.virtual for c in work if c.pp == 8 and c.tp == 8} == {1, 2, 4}  # 96 layers: 8 x 8 does not divide


def test_a_moe_models_candidates_fold_ep_out_of_dp() -> None:
    _mc, sizes = _model_sizes(MOE, None)
    work, _ = _work(8, True, sizes, None, False)
    meshes = {(c.dp, c.ep, c.tp, c.pp) for c in work}
    # ep divides the 4 experts and the data-parallel ranks dp x ep; the devices are dp x ep x tp x pp
    assert {(4, 2, 1, 1), (2, 4, 1, 1), (1, 4, 2, 1), (1, 4, 1, 2), (2, 2, 2, 1)} <= meshes
    assert all(4 % c.ep == 0 and c.devices == 8 for c in work)
    for c in work:
        parts = c.strategy.split(",")
        assert ("ep" in parts) == (c.ep > 1)  # ep over ep=1 is dp; an idle ep dim repeats dp
        if c.ep > 1:
            assert c.sub_mesh_text == f"dp={c.dp},ep={c.ep},tp={c.tp}"
            assert c.tp == 1 or "megatron" in parts  # ETP = tp
    assert hand_strategies(1, 2, 4) == ["megatron,ep", "megatron,ep,zero1", "megatron,ep,zero2", "megatron,ep,zero3",
                                        "megatron,sp,ep", "megatron,sp,ep,zero1", "megatron,sp,ep,zero2",
                                        "megatron,sp,ep,zero3"]
    given, _ = _work(8, True, sizes, ["dp,ep,zero1"], False)
    assert given and all(c.ep > 1 and c.tp == 1 for c in given)


@pytest.fixture(scope="module")
def searches() -> tuple[Any, Any]:
    """The MoE's search on 4 H100 under the cap, every configuration planned and pruned by bounds."""
    full = search_meshes(MOE, 4, "h100", memory_cap=CAP, prune=False)
    pruned = search_meshes(MOE, 4, "h100", memory_cap=CAP, prune=True)
    return full, pruned


def test_the_search_finds_ep_no_slower_than_a_hand_ep_layout(searches: tuple[Any, Any]) -> None:
    full, _ = searches
    assert sum(1 for c in full.candidates if c.config.ep > 1) >= 20  # ep configurations were planned
    # the best ep layout the search planned (the overall best is tp=4 megatron, 1.167 ms against ep=4's
    # 1.196 ms, since Megatron's backward tp all-reduce runs beside the wgrad GEMM: Runtime.tp_allreduce_overlap;
    # the experts over ep beat tp and pp before it)
    best = min((c for c in full.candidates if c.fits and c.config.ep > 1), key=lambda c: c.step_s, default=None)
    assert best is not None and full.best is not None and full.best.step_s <= best.step_s
    dev = DEVICES["h100"]
    for mesh, strategy in (("dp=2,ep=2,tp=1", "dp,ep,zero1"), ("dp=1,ep=4,tp=1", "dp,ep")):
        _m, plan, _ = plan_model(MOE, mesh, strategy)
        plan = recost(plan, cost_model(plan.mesh, dev))
        hand = estimate_step(plan, dev, 8 * 64, "none").step_overlap_s
        assert best.step_s <= hand
    assert not any(c.fits for c in full.candidates if c.config.ep == 1 and c.config.tp == c.config.pp == 1)


def test_bounds_are_lower_bounds_of_every_planned_configuration(searches: tuple[Any, Any]) -> None:
    full, _ = searches
    mc, sizes = _model_sizes(MOE, None)
    job = _Job(DEVICES["h100"], sizes.tokens, ["none"], 0, None, None, None, 30.0, None, Runtime())
    b = _bounds(MOE, mc, job)
    assert b.layers and b.token_bytes == 256 * 2 and (b.batch, b.seq) == (8, 64)
    pipelines = 0
    for c in full.candidates:
        cf = c.config
        assert b.memory(cf.dp, cf.ep, cf.tp, cf.pp, cf.strategy, cf.microbatches) <= c.memory, cf.label()
        assert b.step(cf.devices, cf.pp, cf.microbatches, cf.ep, cf.strategy, cf.virtual) <= c.step_s, cf.label()
        pipelines += cf.pp > 1
    assert pipelines


def test_pruning_keeps_the_best_and_every_fitting_configuration_that_could_win(searches: tuple[Any, Any]) -> None:
    """A fitting configuration the pruned search leaves unplanned is one its step bound shows no
    faster than the best (since the floor's tail, search_floor_tail: ``dp=1 tp=4 megatron,sp``,
    bound 1.01 ms, planned 1.10 ms, the best 0.94 ms)."""
    full, pruned = searches
    assert pruned.pruned and pruned.plans + len(pruned.pruned) == full.plans
    kept = {c.config for c in pruned.fitting}
    assert kept <= {c.config for c in full.fitting}
    left = [c for c in full.fitting if c.config not in kept]
    assert len(left) <= 3 and all(c.step_s >= full.best.step_s for c in left), [c.config.label() for c in left]
    by_step = {cfg.label() for cfg, why in pruned.pruned if why.startswith("its step is at least")}
    assert all(c.config.label().split(" recompute=")[0] in by_step for c in left)
    assert pruned.best is not None and full.best is not None
    assert (pruned.best.config, pruned.best.step_s) == (full.best.config, full.best.step_s)
    over = {c.config.__class__(**{**c.config.__dict__, "recompute": "none"}) for c in full.candidates if not c.fits}
    assert all(cfg in over for cfg, why in pruned.pruned if why.startswith("over the memory cap"))


#: the MoE above with a dense first layer and 4 layers: its layer keys on one copy and its
#: pipelines' split floor (planner/search_floor_layers.py)
MOE_DENSE = json.dumps({**json.loads(MOE), "name": "moe-dense", "layers": 4, "dense_layers": 1})


def _lazy_floors_kept(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Floors computed as each configuration's turn comes (EAGER_FLOORS 0); the list returned
    gets every search's floor object (search._floor) as it is made."""
    from spmdkit.planner import search as search_mod

    monkeypatch.setattr(search_mod, "EAGER_FLOORS", 0)
    made: list[Any] = []
    real = search_mod._floor

    def kept(*a: Any) -> Any:
        made.append(real(*a))
        return made[-1]

    monkeypatch.setattr(search_mod, "_floor", kept)
    return made


def test_lazy_floors_plan_the_seeds_first_and_find_the_unpruned_best(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the floors computed as each configuration's turn comes (more layer keys than
    EAGER_FLOORS, forced here), the ``dp,ep,zero1`` / ``dp,ep,zero2`` pipelines are planned first
    (search._seeds: an incumbent early) and the result is the unpruned search's: its best with
    the same figures, every configuration the bounds pruned no faster than it. The MoE has a
    dense first layer, so its floors come from one copy with the pipelines' split floor."""
    from spmdkit.planner.search_floor_layers import LayerStepFloor

    full = search_meshes(MOE_DENSE, 4, "h100", prune=False)  # no cap: every configuration fits
    made = _lazy_floors_kept(monkeypatch)
    order: list[str] = []

    class _Notes:
        def update(self, done: int | None = None, total: int | None = None, note: str | None = None) -> None:
            if note:
                order.append(note)

        def advance(self, n: int = 1, note: str | None = None) -> None:
            pass

        def phase(self, text: str) -> None:
            pass

    lazy = search_meshes(MOE_DENSE, 4, "h100", prune=True, progress=_Notes())
    assert made and isinstance(made[0], LayerStepFloor) and made[0].bounds is not None
    # the seeds: ZeRO-1 or its twin ZeRO-2 (the same layers; of equal bounds the one holding less first)
    assert order[0].endswith(("dp,ep,zero1", "dp,ep,zero2")) and " pp=" in order[0] and " tp=1 " in order[0]
    a, b = full.best, lazy.best
    assert a is not None and b is not None
    assert (b.config, b.step_s, b.memory, b.comm_s) == (a.config, a.step_s, a.memory, a.comm_s)
    assert lazy.pruned and lazy.plans + len(lazy.pruned) == full.plans
    steps = {c.config.label().split(" recompute=")[0]: c.step_s for c in full.fitting}
    assert all(steps.get(cfg.label(), float("inf")) >= a.step_s for cfg, _why in lazy.pruned)


MOE_ETP = json.dumps({**json.loads(MOE), "name": "moe-etp", "layers": 6, "dense_layers": 1, "seq": 512, "batch": 16})


def test_a_pruned_etp1_pipeline_search_keeps_the_exhaustive_best(monkeypatch: pytest.MonkeyPatch) -> None:
    """Megatron's ETP=1 token path on 8 H100 under a cap that leaves the pipelines room only with
    recomputation: the lazy pruned search (its floors with whole layers per rank and full:K's
    block split floor) finds the exhaustive search's best, a full:K pipeline, with the same
    figures; every pipeline's floor under each mode is under its planned step."""

    strategies = ["megatron,sp,ep,etp=1", "megatron,sp,ep,etp=1,zero2"]
    full = search_meshes(MOE_ETP, 8, "h100", memory_cap="1.56GB", prune=False, strategies=strategies)
    made = _lazy_floors_kept(monkeypatch)
    lazy = search_meshes(MOE_ETP, 8, "h100", memory_cap="1.56GB", prune=True, strategies=strategies)
    a, b = full.best, lazy.best
    assert a is not None and b is not None
    assert (b.config, b.step_s, b.memory, b.comm_s) == (a.config, a.step_s, a.memory, a.comm_s)
    assert a.config.pp == 2 and "etp=1" in a.config.strategy and a.config.recompute.startswith("full:")
    assert lazy.pruned and lazy.plans + len(lazy.pruned) == full.plans
    floor = made[-1]
    piped = [c for c in full.candidates if c.config.pp > 1]
    assert any(c.config.recompute.startswith("full:") for c in piped) and any(not c.fits for c in piped)
    for c in piped:
        cfg, mode = replace(c.config, recompute="none"), c.config.recompute
        low = floor.blocks_step(cfg) if mode.startswith("full:") else floor.step(cfg, mode)
        # a mode over the cap may have no split that fits its relaxation (inf: the reserve, the
        # in-flight count, the working peak), never one that fits
        assert 0 < low <= c.step_s or (not c.fits and low == math.inf), (c.config.label(), low, c.step_s)


def test_deepseek_v3_on_2048_h800_fits_with_a_breakdown_checked_by_hand() -> None:
    """pp=16, dp=2, ep=64, ZeRO-1 (DeepSeek-V3 technical report, section 3.2), its batch of
    15,360 sequences as 120 microbatches of 128 (one sequence per data-parallel rank), layers
    recomputed: each category of the fullest rank from the catalog figures. With the model's
    multi-token-prediction module (mtp_layers 1, models/zoo_mtp.py) the fullest rank is the last
    one (before it: rank 1, 25.41 GiB; then 29.97 GiB; 28.03 GiB since the outputs of the last layer
    and of the MTP checkpoint are kept, read by the final norm and the head, and the two re-run after
    the head's backward, not under its [S, V] gradient): its 2 layers, the MTP module (a MoE layer,
    eh_proj and 3 norms, recomputed as Megatron-Core does under full granularity), the final norm,
    the head, and its copy of the embedding the MTP module reads (its gradient all-reduced with
    the first stage's, its update on the first stage)."""
    _model, plan, spec, _counts, _ = plan_pipeline("deepseek-v3", "pp=16,dp=2,ep=64", "dp,ep,zero1",
                                                  {"microbatches": 120}, {"batch": 15360})
    dev = DEVICES["h800"]
    est = estimate_pipeline(plan, spec, None, dev, (dev.inter.alpha_s, 1 / dev.inter.bytes_per_s), 15360 * 4096,
                            2048, recompute="full")
    mm = est.moe
    assert mm is not None and (mm.ep, mm.edp, mm.dense_dp, mm.experts) == (64, 2, 128, 256)
    assert max(m.device_total for m in est.memory) <= 80 * 2**30
    H, E, F, V, S = 7168, 256, 2048, 129280, 4096
    attention = (H * 1536 + 1536 * 128 * 192 + H * (512 + 64) + 512 * 128 * (128 + 128) + 128 * 128 * H
                 + 1536 + 512 + 2 * H)                     # MLA, its norms and the layer's two norms
    moe_layer = attention + H * E + 3 * H * F              # router, one shared expert
    mtp_own = 2 * H * H + 3 * H                            # eh_proj [2H, H], enorm, hnorm, its final norm
    assert (mm.rank, mm.layers, mm.moe_layers, mm.in_flight) == (15, 2, 3, 1.0)  # 2 layers + the MTP's MoE
    expert = mm.moe_layers * E * 3 * H * F                 # the routed experts of the rank's layers
    dense = mm.moe_layers * moe_layer + mtp_own + H + H * V  # + the final norm and the head
    assert mm.expert_elements == expert
    assert mm.expert_parameters == expert // 64 * 2        # bf16, E / ep experts a rank
    assert mm.expert_gradients == expert // 64 * 4         # Megatron's fp32 main gradients
    # fp32 master + 2 moments over edp = dp = 2, and each stack's 8-byte step count
    assert mm.expert_states == expert // 64 * 12 // 2 + 3 * mm.moe_layers * 8
    assert mm.dense_parameters == dense * 2 and mm.dense_gradients == dense * 4
    assert mm.dense_states == pytest.approx(dense * 12 / 128, rel=1e-3)  # over dp x ep, uneven axes rounded up
    # full recompute: each layer's input and the MTP module's (its embedding lookup; the final norm's output,
    # read by the head too, and its float32 statistics), each head's softmax [S, V] (the model's and the MTP's),
    # and the outputs of the two checkpoints that ops outside them save: the last layer's (the final norm's
    # input) and the MTP's (its final norm, inside _proj_and_transformer_layer at core_v0.15.0: the head's input)
    assert mm.stash == 2 * S * H * 2 + 2 * S * H * 2 + S * 4 + 2 * S * V * 2 + 2 * S * H * 2
    assert mm.activations == mm.working_peak + round((mm.in_flight - 1) * mm.stash)
    copy = V * H  # the embedding's copy on the last stage (tied: planner.stage_costs.shared_parameters)
    assert est.memory[mm.rank].parameters == mm.expert_parameters + mm.dense_parameters + copy * 2
    assert est.memory[mm.rank].gradients == mm.expert_gradients + mm.dense_gradients + copy * 4
    assert est.tied_s[0] == est.tied_s[15] > 0 and not any(est.tied_s[1:15])


def test_the_dtensor_export_states_what_torch_cannot_express() -> None:
    _m, plan, _ = plan_model(MOE, "dp=2,ep=2,tp=1", "dp,ep")
    st = expert_parallel_statement(plan)
    assert st is not None and st["mesh_dim"] == "ep" and st["torch_style"] is None
    assert st["modules"] == {"layers.0.experts": ["layers.0.experts.w_down", "layers.0.experts.w_gate",
                                                  "layers.0.experts.w_up"],
                             "layers.1.experts": ["layers.1.experts.w_down", "layers.1.experts.w_gate",
                                                  "layers.1.experts.w_up"]}
    assert "no expert-parallel ParallelStyle" in st["torch_cannot"] and "ExpertParallel" in st["torch_cannot"]
    doc = dtensor_document(plan)
    assert doc["expert_parallel"] == st
    assert doc["placements"]["layers.0.experts.w_up"] == ["Replicate()", "Shard(0)", "Replicate()"]
    assert any(n.startswith("expert parallel over ep (2 experts modules: layers.0.experts, layers.1.experts)")
               for n in doc["notes"])
    assert "layers.0.experts" not in doc["parallelize_plan"]
    _m, dense, _ = plan_model(MOE, "dp=2,tp=1", "dp")
    assert expert_parallel_statement(dense) is None and dtensor_document(dense)["expert_parallel"] is None


def test_the_installed_torch_has_no_expert_parallel_style() -> None:
    pytest.importorskip("torch")
    from spmdkit.outputs.dtensor import expert_parallel

    _m, plan, _ = plan_model(MOE, "dp=1,ep=2,tp=1", "dp,ep")
    got = expert_parallel(plan)
    assert got is not None and got["torch_style"] is None and got["torch_version"]


def test_auto_on_an_ep_mesh_is_no_slower_than_the_hand_ep_plan() -> None:
    pytest.importorskip("highspy")
    from spmdkit.models.zoo import build_model, preset
    from spmdkit.planner.auto import auto_plan
    from spmdkit.strategies.strategy import parse_mesh

    dev = DEVICES["h100"]
    mesh = parse_mesh("dp=1,ep=4,tp=1")
    plan, info = auto_plan(build_model(preset(MOE), check_rules=False).program, mesh, None,
                           cost=cost_model(mesh, dev), time_limit=60, device=dev)
    _m, hand, _ = plan_model(MOE, "dp=1,ep=4,tp=1", "dp,ep")
    hand = recost(hand, cost_model(hand.mesh, dev))
    assert info.status == "Optimal"
    assert estimate_step(plan, dev, 8 * 64, "none").step_overlap_s <= estimate_step(hand, dev, 8 * 64,
                                                                                   "none").step_overlap_s


def test_a_program_is_searched_with_ep_found_from_its_moe_ops() -> None:
    from spmdkit.models.zoo import build_model, preset
    from spmdkit.planner.search_bounds import experts_of

    prog = build_model(preset(MOE)).program
    assert experts_of(prog) == 4 and experts_of(build_model(preset("tiny-llama")).program) == 0
    res = search_meshes(prog, 2, "h100", pipeline=False, recompute=["none"])
    got = {(c.config.sub_mesh_text, c.config.strategy) for c in res.candidates}
    assert ("dp=1,ep=2,tp=1", "dp,ep") in got and ("dp=2,tp=1", "dp") in got

