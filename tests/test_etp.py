"""Expert tensor parallel 1 with tp > 1 (``--strategy megatron,sp,ep,etp=1``): Megatron-Core's
``--expert-tensor-parallel-size 1``, the experts whole and spread over the ep x tp ranks while
attention stays tensor-parallel over tp (docs/experts.md, "ETP = 1").

Counted on the plans' collectives (hand-computed bytes), the experts' layout and memory, the
busiest rank's load, the refusals, simulated (--verify); the gloo run is a case of
tests/test_ep.py's launch."""

from __future__ import annotations

import collections
import json
import re
import warnings
from typing import Any

import pytest

from spmdkit.core.dist_attr import TensorDistAttr, largest_shard
from spmdkit.core.errors import ProgramError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.reshard import CostModel, merge_groups, plan_reshard, single_dim_steps
from spmdkit.cost.memory import memory_per_device
from spmdkit.cost.moe import ep_degree, rank_load
from spmdkit.cost.moe import moe_layers as cost_layers
from spmdkit.planner.planning import plan_model
from spmdkit.planner.search import _model_sizes, _work, hand_strategies
from spmdkit.program.runtime import Runtime
from spmdkit.sim.verify_plan import tiny_for_mesh, verify_strategy
from spmdkit.strategies.experts import moe_layers
from spmdkit.strategies.strategy import parse_mesh, parse_strategy

MOE = {"base": "tiny-llama", "experts": 4, "top_k": 2, "moe_ffn": 8}
MLA = {"kv_heads": None, "kv_lora_rank": 8, "q_lora_rank": 6, "qk_rope_head_dim": 4, "head_dim": 4, "v_head_dim": 6}
DEEPSEEK = {**MOE, **MLA, "shared_experts": 1, "dense_layers": 1, "capacity_factor": 0.5}


def _per_layer(plan: Any, layer: str) -> collections.Counter[tuple[str, str, str, str, int]]:
    """(phase, kind, mesh dims, tensor, bytes per rank) -> count, for the tensors of ``layer``."""
    c: collections.Counter[tuple[str, str, str, str, int]] = collections.Counter()
    for r, s in plan.collectives():
        phase = plan.program.ops[r.op_index].phase
        if r.tensor.startswith(layer) and phase != "optimizer":
            c[(phase, s.kind, "x".join(plan.mesh.dim_names[d] for d in s.mesh_dims), r.tensor[len(layer):],
               s.bytes_per_rank)] += 1
    return c


# -- the strategy text ---------------------------------------------------------------------------------


def test_etp_items_parse_and_refuse() -> None:
    mesh = parse_mesh("dp=2,ep=2,tp=2")
    assert parse_strategy("megatron,sp,ep,etp=1", mesh) == ("dp", "megatron", "sp", "ep", "etp=1")
    assert parse_strategy("megatron,ep,etp=tp", mesh) == ("dp", "megatron", "ep")  # the default, nothing added
    # the tp size as a number is the default too (Megatron's --expert-tensor-parallel-size 2 beside
    # --tensor-model-parallel-size 2): it was refused as 'expert tensor parallel is 1 ... or tp'
    assert parse_strategy("megatron,ep,etp=2", mesh) == ("dp", "megatron", "ep")
    with pytest.raises(ProgramError, match=r"^--strategy etp=4: expert tensor parallel is 1 \(each expert whole, "
                                           r"experts over ep x tp\) or tp \(the tp dim's size, 2: each expert split "
                                           r"over tp: the default\)$"):
        parse_strategy("megatron,ep,etp=4", mesh)
    with pytest.raises(ProgramError, match=r"^--strategy etp=2: expert tensor parallel is 1 \(each expert whole, "
                                           r"experts over ep x tp\) or tp \(each expert split over tp: the default\)$"):
        parse_strategy("dp,ep,etp=2", parse_mesh("dp=2,ep=2"))  # no tp dim
    with pytest.raises(ProgramError, match=r"^--strategy etp=1: expert tensor parallel = 1 folds the experts over "
                                           r"ep x tp; it needs expert parallelism \(ep\) in --strategy$"):
        parse_strategy("megatron,sp,etp=1", mesh)
    with pytest.raises(ProgramError, match=r"^--strategy etp=1: .* it needs tensor parallelism \(megatron\) in "
                                           r"--strategy$"):
        parse_strategy("dp,ep,etp=1", mesh)


def test_ep_x_tp_must_divide_the_experts() -> None:
    with pytest.raises(ProgramError, match=r"^--mesh ep=4,tp=2: with etp=1 the experts are spread over ep x tp = 8 "
                                           r"ranks, which does not divide the model's 4 experts; an ep x tp of 2 or "
                                           r"4 does$"):
        plan_model(json.dumps({**MOE, "batch": 4}), "ep=4,tp=2", "ep,megatron,etp=1")
    # the same mesh with ETP = tp: ep=4 divides the 4 experts, each split over tp
    plan_model(json.dumps({**MOE, "batch": 4}), "ep=4,tp=2", "ep,megatron")


def test_the_expert_ffn_need_not_divide_by_tp() -> None:
    """Each expert is whole: an expert FFN of 7 on tp=2 plans (ETP = tp refuses it)."""
    cfg = json.dumps({**MOE, "moe_ffn": 7})
    with pytest.raises(ProgramError, match=r"^--mesh tp=2: megatron splits evenly or not at all: tp=2 does not "
                                           r"divide the model's expert FFN hidden size 7"):
        plan_model(cfg, "ep=2,tp=2", "ep,megatron")
    _, plan, _ = plan_model(cfg, "ep=2,tp=2", "ep,megatron,etp=1")
    assert plan.attrs["layers.0.experts.w_up"].dims_mapping == ((1, 0), -1, -1)


# -- the plan ------------------------------------------------------------------------------------------


def test_tiny_plan_collectives_per_moe_layer_by_hand() -> None:
    """tiny MoE (batch 4, seq 8, hidden 16, 4 experts top-2), float32 on dp=2 x ep=2 x tp=2,
    megatron + sp + ETP = 1: Megatron's token path. Each sequence is routed in tp = 2 chunks of
    4 tokens (capacity per chunk 4 x 2 / 4 = 2); a rank holds one sequence's tp half ([1, 4, 16]:
    256 B) and one expert (4 / (ep x tp)).

    forward: attention's sp collectives (the normalised tokens all-gathered over tp, its output
    reduce-scattered: 256 B each); the MoE layer's tokens are NOT gathered: each rank dispatches
    its own chunk into [1, 1, 4, 2, 16] slots (512 B) and sends them by one all-to-all over the
    ep x tp group ((4 - 1) / 4 x 512 = 384 B); the rows come back the same way (384 B); no tp
    collective around the experts. backward: the mirrors (384 B each). The load-balancing loss'
    statistics ([B, E] = 4 floats a rank, 16 B) are summed over the chunks: the counts and the
    mean gate values all-reduced over tp, the per-chunk means' gradient gathered back."""
    _, plan, _ = plan_model(json.dumps({**MOE, "layers": 1}), "dp=2,ep=2,tp=2", "dp,ep,megatron,sp,etp=1")
    assert plan.program.tensors["layers.0.dispatch"].shape == (4, 2, 4, 2, 16)
    got = _per_layer(plan, "layers.0.")
    assert got == collections.Counter({
        ("forward", "all_gather", "tp", "attn_norm.out", 256): 1,
        ("forward", "reduce_scatter", "tp", "attn_out", 256): 1,
        ("forward", "all_to_all", "epxtp", "dispatch", 384): 1,
        ("forward", "all_to_all", "tpxep", "experts.rows", 384): 1,
        ("forward", "all_reduce", "tp", "aux.fs", 16): 1,
        ("forward", "all_reduce", "tp", "aux.p", 16): 1,
        ("backward", "all_to_all", "epxtp", "experts.rows.grad", 384): 1,
        ("backward", "all_to_all", "tpxep", "dispatch.grad.sum", 384): 1,
        ("backward", "all_gather", "tp", "aux.pc", 16): 1,
        ("backward", "all_gather", "tp", "attn_out.grad", 256): 1,
        ("backward", "reduce_scatter", "tp", "attn_norm.out.grad.sum", 256): 1,
    })
    # ETP = tp on the same mesh: the tokens gathered over tp, the all-to-all over ep of 512 B,
    # and the experts' row-parallel output all-reduced over tp each way
    _, base, _ = plan_model(json.dumps({**MOE, "layers": 1}), "dp=2,ep=2,tp=2", "dp,ep,megatron,sp")
    old = _per_layer(base, "layers.0.")
    assert old[("forward", "all_to_all", "ep", "dispatch", 512)] == 1
    assert old[("forward", "all_reduce", "tp", "experts.rows", 1024)] == 1
    assert old[("forward", "all_gather", "tp", "mlp_norm.out", 256)] == 1


def test_the_merged_all_to_all_runs_as_one_per_mesh_dim() -> None:
    """The dispatch's all-to-all over the ep x tp group, as an executor with one process group
    per mesh dim runs it: over ep (the batch's ep onto the expert axis), then over tp (the
    chunks' tp after it): the plan's source and destination layouts, the steps between legal."""
    _, plan, _ = plan_model(json.dumps({**MOE, "layers": 1}), "dp=2,ep=2,tp=2", "dp,ep,megatron,sp,etp=1")
    (step,) = [s for r, s in plan.collectives() if r.tensor == "layers.0.dispatch"]
    assert (step.kind, step.mesh_dims, step.src.dims_mapping, step.dst.dims_mapping) == (
        "all_to_all", (1, 2), ((0, 1), 2, -1, -1, -1), (0, -1, (1, 2), -1, -1))
    parts = single_dim_steps(step)
    assert [(s.mesh_dims, s.tensor_axis, s.dst_axis, s.dst.dims_mapping) for s in parts] == [
        ((1,), 0, 2, (0, 2, 1, -1, -1)), ((2,), 1, 2, (0, -1, (1, 2), -1, -1))]
    assert parts[0].src == step.src and parts[-1].dst == step.dst


def test_two_all_to_alls_over_a_group_merge_into_one() -> None:
    """The dispatch (batch's ep, then the chunks' tp, onto the expert axis) and the combine (the
    expert axis' tp onto the chunks, then its ep onto the batch): each two all-to-alls of (2 - 1) /
    2 x 1 KiB, merged into one over the 4 ranks of the (ep, tp) group, (4 - 1) / 4 x 1 KiB, at
    one all-to-all's time; single_dim_steps gives back the two steps, through the same layouts."""
    mesh = ProcessMesh([2, 2, 2], dim_names=["dp", "ep", "tp"])
    cost = CostModel.default(mesh)
    shape, size = [4, 2, 4, 2, 16], 4 * 2 * 4 * 2 * 16 * 4 // 8
    tokens = TensorDistAttr(mesh, [(0, 1), 2, -1, -1, -1])
    experts = TensorDistAttr(mesh, [0, -1, (1, 2), -1, -1])
    for src, dst, order in ((tokens, experts, (1, 2)), (experts, tokens, (2, 1))):
        single = plan_reshard(src, dst, shape, 4, cost)
        assert [(s.kind, s.mesh_dims, s.bytes_per_rank) for s in single.steps] == [
            ("all_to_all", (order[0],), size // 2), ("all_to_all", (order[1],), size // 2)]
        (one,) = merge_groups(single, [(1, 2)], shape, 4, cost).steps
        assert (one.kind, one.mesh_dims, one.bytes_per_rank, one.src, one.dst) == (
            "all_to_all", order, 3 * size // 4, src, dst)
        assert one.time_s == cost.collective_time("all_to_all", order, size, mesh.shape)
        assert [(s.mesh_dims, s.tensor_axis, s.dst_axis, s.src, s.dst) for s in single_dim_steps(one)] == [
            (s.mesh_dims, s.tensor_axis, s.dst_axis, s.src, s.dst) for s in single.steps]
        assert merge_groups(single, [(0, 1)], shape, 4, cost) == single  # not a group: two all-to-alls


def test_mixtral_8x7b_experts_whole_over_ep_x_tp() -> None:
    """Mixtral-8x7B, batch 8 x seq 4096, bf16, dp=2 x ep=4 x tp=2: each rank holds one whole
    expert ([1, 4096, 14336] of each stack, against ETP = tp's two halves [2, 4096, 7168]): the
    same bytes, so the parameters, gradients and optimizer states per device equal ETP = tp's.
    Megatron's token path: each rank routes its own half of a sequence (2,048 tokens, capacity
    2048 x 2 / 8 = 512 an expert) into 8 experts' slots (1 x 1 x 8 x 512 x 4096 x 2 B = 32 MiB)
    and sends them by one all-to-all over the ep x tp = 8 ranks: (8 - 1) / 8 x 32 = 28 MiB, each
    way and in the backward; no tp collective around the experts (ETP = tp: the tokens
    all-gathered over tp, 48 MiB all-to-alls and 64 MiB all-reduces of the rows); the experts'
    gradients all-reduced over dp only (EDP = dp: 3 x 4096 x 14336 x 2 B each, x 2 (dp - 1) / dp)."""
    _, plan, _ = plan_model("mixtral-8x7b", "dp=2,ep=4,tp=2", "dp,ep,megatron,sp,etp=1", {"batch": 8, "seq": 4096})
    _, base, _ = plan_model("mixtral-8x7b", "dp=2,ep=4,tp=2", "dp,ep,megatron,sp", {"batch": 8, "seq": 4096})
    lay = moe_layers(plan.program)
    assert len(lay) == 32
    for w in lay[0].stacks:
        a = plan.attrs[w]
        assert a.dims_mapping == ((1, 2), -1, -1)  # (ep, tp): the chunks' tp moves onto the experts after ep
        assert largest_shard(a.dims_mapping, plan.program.tensors[w].shape, plan.mesh.shape)[0] == 1
    assert largest_shard(plan.attrs["layers.0.experts.w_up"].dims_mapping, [8, 4096, 14336], plan.mesh.shape) \
        == (1, 4096, 14336)
    assert largest_shard(base.attrs["layers.0.experts.w_up"].dims_mapping, [8, 4096, 14336], base.mesh.shape) \
        == (2, 4096, 7168)
    mem, old = memory_per_device(plan), memory_per_device(base)
    assert (mem.parameters, mem.gradients, mem.optimizer_states) == (old.parameters, old.gradients,
                                                                      old.optimizer_states)
    got = _per_layer(plan, "layers.0.")
    slots = 1 * 1 * 8 * 512 * 4096 * 2
    a2a = {k: n for k, n in got.items() if k[1] == "all_to_all"}
    assert a2a == {(ph, "all_to_all", g, t, 7 * slots // 8): 1 for ph, g, t in [
        ("forward", "epxtp", "dispatch"), ("forward", "tpxep", "experts.rows"),
        ("backward", "epxtp", "experts.rows.grad"), ("backward", "tpxep", "dispatch.grad.sum")]}
    # over tp only attention's sp collectives (16 MiB each) and the aux loss' [B, E] statistics
    assert {(k[0], k[1], k[3]) for k in got if k[2] == "tp" and k[4] > 64} == {
        ("forward", "all_gather", "attn_norm.out"), ("forward", "reduce_scatter", "attn_out"),
        ("backward", "all_gather", "attn_out.grad"), ("backward", "reduce_scatter", "attn_norm.out.grad.sum")}
    old_a2a = {k[4] for k in _per_layer(base, "layers.0.") if k[1] == "all_to_all"}
    assert old_a2a == {48 << 20}
    grads = {r.tensor: (s.kind, s.mesh_dims, s.bytes_per_rank) for r, s in plan.collectives()
             if r.tensor.startswith("layers.0.experts.w_")}
    assert grads == {f"layers.0.experts.{w}.grad": ("all_reduce", (0,), 4096 * 14336 * 2)
                     for w in ("w_gate", "w_up", "w_down")}


def test_the_busiest_rank_holds_one_expert_of_eight() -> None:
    """--moe-skew 2 (the busiest expert twice the mean): over ep x tp = 8 ranks each holds one
    expert, so the busiest rank carries 2 x the mean; over ep = 4 (ETP = tp) two experts share
    a rank: (2 + (8 - 2) / 7) / 2 = 1.4286."""
    _, plan, _ = plan_model(json.dumps({**MOE, "experts": 8, "layers": 1}), "ep=4,tp=2", "ep,megatron,etp=1")
    _, base, _ = plan_model(json.dumps({**MOE, "experts": 8, "layers": 1}), "ep=4,tp=2", "ep,megatron")
    layer = cost_layers(plan.program)[0]
    assert ep_degree(plan, layer) == 8 and ep_degree(base, layer) == 4
    rt = Runtime(moe_skew=2.0)
    assert rank_load(rt, 8, 2, 8) == pytest.approx(2.0)
    assert rank_load(rt, 8, 2, 4) == pytest.approx((2 + 6 / 7) / 2)


def test_zero_shards_expert_states_over_edp_only() -> None:
    _, plan, _ = plan_model(json.dumps({**MOE, "layers": 1}), "dp=2,ep=2,tp=2", "dp,ep,megatron,sp,etp=1,zero2")
    a = plan.attrs
    assert a["layers.0.experts.w_up"].dims_mapping == ((1, 2), -1, -1)
    assert a["layers.0.experts.w_up.moment1"].dims_mapping == ((1, 2), 0, -1)  # over dp (EDP)
    assert a["layers.0.wq.moment1"].dims_mapping == ((0, 1), 2)  # dense: over dp x ep, tp as the weight


def test_the_dispatch_slices_over_tp_before_the_all_to_all() -> None:
    """Tokens replicated over tp, batch over (dp, ep), to experts over (tp, ep): the tp slice is
    taken first (free) and the all-to-all over ep carries only it, instead of the slots being
    all-gathered over ep and sliced."""
    mesh = ProcessMesh([2, 2, 2], dim_names=["dp", "ep", "tp"])
    src = TensorDistAttr(mesh, [(0, 1), -1, -1, -1])
    dst = TensorDistAttr(mesh, [0, (2, 1), -1, -1])
    steps = plan_reshard(src, dst, [4, 4, 4, 16], 4).steps
    assert [(s.kind, s.mesh_dims, s.bytes_per_rank) for s in steps] == [("slice", (2,), 0), ("all_to_all", (1,), 256)]


# -- soundness -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("cfg", "mesh", "strategy"), [
    (MOE, "dp=2,ep=2,tp=2", "dp,ep,megatron,sp,etp=1"),
    (DEEPSEEK, "dp=2,ep=2,tp=2", "dp,ep,megatron,sp,etp=1,zero2"),
])
def test_verify_simulates_etp1_plans(cfg: dict[str, Any], mesh: str, strategy: str) -> None:
    rep = verify_strategy(json.dumps(cfg), mesh, strategy)
    assert rep["ok"] and rep["checked"] > 300 and not rep["failures"], rep["text"]


def test_verify_grows_the_experts_to_ep_x_tp() -> None:
    got = json.loads(tiny_for_mesh(json.dumps(MOE), "ep=4,tp=2", "ep,megatron,etp=1"))
    assert got["experts"] == 8
    assert tiny_for_mesh(json.dumps(MOE), "ep=4,tp=2", "ep,megatron") == json.dumps(MOE)


# -- the search ----------------------------------------------------------------------------------------


def test_the_search_space_offers_etp1_where_ep_x_tp_divides_the_experts() -> None:
    """``plan --devices``: with tp > 1 and ep > 1, ``megatron,sp,ep,etp=1`` (and its ZeRO stages)
    beside ETP = tp, only where ep x tp divides the experts (4 experts: ep=2 x tp=2, not ep=4 x
    tp=2)."""
    assert hand_strategies(1, 2, 2, experts=4)[-4:] == ["megatron,sp,ep,etp=1", "megatron,sp,ep,etp=1,zero1",
                                                        "megatron,sp,ep,etp=1,zero2", "megatron,sp,ep,etp=1,zero3"]
    assert not [s for s in hand_strategies(1, 2, 4, experts=4) if "etp=1" in s]
    assert not [s for s in hand_strategies(2, 1, 2, experts=4) if "etp=1" in s]
    _mc, sizes = _model_sizes(json.dumps({**MOE, "batch": 8}), None)
    work, _ = _work(8, False, sizes, None, False)
    ep_meshes = {(c.dp, c.ep, c.tp) for c in work if c.ep > 1}
    assert {(2, 2, 2), (1, 4, 2), (1, 2, 4)} <= ep_meshes  # 8 devices, ep and tp > 1
    etp = {(c.dp, c.ep, c.tp, c.strategy) for c in work if "etp=1" in c.strategy.split(",")}
    assert etp == {(2, 2, 2, "megatron,sp,ep,etp=1" + z) for z in ("", ",zero1", ",zero2", ",zero3")}


def test_an_hf_mixtral_plans_etp1_as_the_catalog_model() -> None:
    """`plan --hf MixtralForCausalLM` (the published config, 1 layer, seq 64, batch 4) on ep=2 x
    tp=2 with etp=1: its expert stacks whole over (tp, ep), its layer's collectives (kind, mesh
    dims, bytes) those of `--model mixtral-8x7b`: the all-to-alls at half ETP = tp's bytes, the
    rows all-gathered over tp before the forward's moe_combine (top-2: the gather of 2 rows a
    token costs what the all-reduce of the output would, the planner keeps the gather) and the
    dispatched tokens' gradient gathered over tp; moe_combine_grad works on the rows each tp rank
    holds (local_rows), its combine weights' gradient [2, 64, 2] all-reduced over tp."""
    from pathlib import Path

    from spmdkit.planner.planning import plan_hf, plan_preset

    cfg = json.loads((Path(__file__).parent / "data/hf/mixtral-8x7b.json").read_text())
    cfg["num_hidden_layers"] = 1
    got = {}
    for st in ("ep,megatron", "ep,megatron,etp=1"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _, _, _, hp = plan_hf("MixtralForCausalLM", cfg, "ep=2,tp=2", st, dtype="bf16", batch=4, seq=64)
            _, cp, _ = plan_preset("mixtral-8x7b", "ep=2,tp=2", st, {"layers": 1, "batch": 4, "seq": 64})
        per = [collections.Counter((p.program.ops[r.op_index].phase, s.kind, s.mesh_dims, s.bytes_per_rank)
                                   for r, s in p.collectives() if re.search(r"layers?[. ]0\b", p.program.ops[r.op_index].layer or "")
                                   and p.program.ops[r.op_index].phase != "optimizer") for p in (hp, cp)]
        if "etp=1" in st:  # the combine weights' gradient, partial over tp (moe_combine_grad on the rows each
            # tp rank holds): HF's in float32 (its router's dtype), the catalog's in bf16
            assert per[0].pop(("backward", "all_reduce", (1,), 2 * 64 * 2 * 4)) == 1
            assert per[1].pop(("backward", "all_reduce", (1,), 2 * 64 * 2 * 2)) == 1
        assert per[0] == per[1], st
        got[st] = per[0]
        if "etp=1" in st:
            stacks = [n for n, t in hp.program.tensors.items() if t.kind == "parameter" and len(t.shape) == 3
                      and not n.endswith(".new")]
            assert len(stacks) == 3 and all(hp.attrs[n].dims_mapping == ((1, 0), -1, -1) for n in stacks)
    a2a = {k[3] for k in got["ep,megatron"] if k[1] == "all_to_all"}
    assert a2a == {1048576}  # 2 sequences a rank x 64 tokens x 2 (top-2) x 4096 x 2 B x (2 - 1) / 2
    assert {k[3] for k in got["ep,megatron,etp=1"] if k[1] == "all_to_all"} == {b // 2 for b in a2a}
    assert sum(n for k, n in got["ep,megatron,etp=1"].items() if k[1] == "all_gather" and k[2] == (1,)) == 2


# -- the ops routed in chunks ----------------------------------------------------------------------------


def test_a_dispatch_in_chunks_is_each_chunk_on_its_own() -> None:
    """moe_gate_dispatch / moe_combine with a batch and a chunk axis first (x [B, T, S/T, H]):
    the numpy reference and the torch kernel are the 2-D op per chunk, and the rules keep both
    the batch (over dp x ep) and the chunk axis (over tp) sharded, forward and grad, nothing
    gathered (Megatron's ETP = 1 token path: each tp rank routes its own tokens)."""
    import numpy as np
    import torch

    from spmd_helpers import T, dms, global_ctx
    from spmdkit.engine.registry import get_rule
    from spmdkit.execute.kernels import moe as kernels
    from spmdkit.models.zoo import preset
    from spmdkit.sim.reference import get_reference

    rng = np.random.default_rng(0)
    x, gl = rng.normal(size=(2, 3, 5, 4)), rng.uniform(size=(2, 3, 5, 4))
    ref = get_reference("moe_gate_dispatch")
    assert ref is not None
    args = {"x": x, "gate_logits": gl, "k": 2, "capacity": 2, "use_pad": True}
    outs = ref.fn(args, global_ctx())
    assert [np.shape(o) for o in outs] == [(2, 3, 4, 2, 4), (2, 3, 5, 2), (2, 3, 2, 5), (2, 3, 4), (2, 3, 5, 2)]
    for b in range(2):
        for c in range(3):
            one = ref.fn({**args, "x": x[b, c], "gate_logits": gl[b, c]}, global_ctx())
            assert all(np.array_equal(o[b, c], o1) for o, o1 in zip(outs, one))
    got = kernels.dispatch(torch.tensor(x.reshape(6, 5, 4)), torch.tensor(gl.reshape(6, 5, 4)), None, 2, 2)
    kern = kernels._batched(lambda a, g: kernels.dispatch(a, g, None, 2, 2), 2, torch.tensor(x), torch.tensor(gl))
    for o, k, g in zip(outs, kern, got):
        assert np.allclose(np.asarray(o), k.numpy()) and torch.equal(k.reshape(g.shape), g)
    m = ProcessMesh([2, 2])
    res = get_rule("moe_gate_dispatch").infer_forward(T(m, [4, 2, 8, 16], [0, 1, -1, -1]),
                                                      T(m, [4, 2, 8, 4], [0, 1, -1, -1]), None, 2, 4, True)
    assert dms(res.inputs[:2]) == [(0, 1, -1, -1), (0, 1, -1, -1)]
    assert dms(res.outputs) == [(0, 1, -1, -1, -1), (0, 1, -1, -1), (0, 1, -1, -1), (0, 1, -1), (0, 1, -1, -1)]
    res = get_rule("moe_combine").infer_forward(T(m, [4, 2, 16, 16], [0, 1, -1, -1]),
                                                T(m, [4, 2, 8, 2], [0, 1, -1, -1]), T(m, [4, 2, 8, 2], [0, 1, -1, -1]))
    assert dms(res.outputs) == [(0, 1, -1, -1)]
    res = get_rule("moe_gate_dispatch_grad").infer_forward(
        T(m, [4, 2, 8, 2], [0, 1, -1, -1]), T(m, [4, 2, 2, 8], [0, 1, -1, -1]), T(m, [4, 2, 8, 2], [0, 1, -1, -1]),
        T(m, [4, 2, 4, 4, 16], [0, 1, -1, -1, -1]), T(m, [4, 2, 8, 2], [0, 1, -1, -1]), 2, 4, True)
    assert dms(res.outputs) == [(0, 1, -1, -1), (0, 1, -1, -1)]
    with pytest.raises(ProgramError, match=r"^model: moe_chunks must be an integer >= 1 dividing seq 8, got 3$"):
        preset(json.dumps(MOE)).with_(moe_chunks=3).check()  # set by the strategy (not a --model-config field)


def test_chunks_only_under_sp_and_etp1() -> None:
    """The model is routed in tp chunks under megatron,sp,ep,etp=1 only: ETP = tp, or etp=1
    without sp (the tokens are whole over tp there), route each sequence as one."""
    for st, chunks in (("dp,ep,megatron,sp,etp=1", 2), ("dp,ep,megatron,sp", 1), ("dp,ep,megatron,etp=1", 1)):
        model, plan, _ = plan_model(json.dumps({**MOE, "layers": 1}), "dp=2,ep=2,tp=2", st)
        assert model.config.moe_chunks == chunks, st
        assert len(plan.program.tensors["layers.0.dispatch"].shape) == (5 if chunks > 1 else 4)


# -- without sp: moe_combine on the rows each tp rank holds (local_rows) where that is cheaper ------------


def _combines(plan: Any) -> list[tuple[str, Any]]:
    return [(o.op.rule, o.op.attrs.get("local_rows", False)) for o in plan.ops if o.op.rule.startswith("moe_combine")]


def test_without_sp_the_planner_combines_the_rows_where_they_are_when_cheaper() -> None:
    """ETP = 1 without sp, batch 16 x seq 4096, bf16, dp=2 x ep=4 x tp=2, one layer: the experts'
    rows come back over ep sharded over tp (each tp rank its own experts'). Qwen3-30B-A3B (top 8
    of 128, capacity 4096 x 8 / 128 = 256, rows [2, 128 x 256, 2048] a rank): gathering them over
    tp is half of 256 MiB = 128 MiB; moe_combine on each rank's rows (local_rows) leaves its
    output [2, 4096, 2048] partial, one all-reduce of 32 MiB, and the combine weights' gradient
    [2, 4096, 8] partial (an all-reduce of 128 KiB). The backward mirrors the dispatch the same
    way: the dispatched tokens' gradient [2, 128, 256, 2048] comes back over ep sharded over tp
    and moe_gate_dispatch_grad (local_experts) sums each rank's own experts' slots into a partial
    gradient of the tokens [2, 4096, 2048], all-reduced (32 MiB), instead of gathering the slots
    (128 MiB). Mixtral-8x7B (top 2): the gather (64 MiB)
    costs what the all-reduce of the output would (64 MiB) and takes one step less, so the
    forward keeps it; the backward, which the forward's gathered copy does not reach (the memory
    model does not hold a reshard's copy to the backward), works on the rows each rank holds: a
    32 KiB all-reduce of the weights' gradient instead of a 64 MiB gather; its dispatched tokens'
    gradient is gathered (64 MiB, one step less than the all-reduce of as many bytes)."""
    over = {"layers": 1, "batch": 16, "seq": 4096}
    _, q, _ = plan_model("qwen3-30b-a3b", "dp=2,ep=4,tp=2", "dp,ep,megatron,etp=1", over)
    assert _combines(q) == [("moe_combine", True), ("moe_combine_grad", True)]
    got = {k: n for k, n in _per_layer(q, "layers.0.").items() if k[2] == "tp" and "attn" not in k[3]}
    assert got == {("forward", "all_reduce", "tp", "moe_out", 2 * 4096 * 2048 * 2): 1,
                   ("backward", "all_reduce", "tp", "dispatch.weights.grad", 2 * 4096 * 8 * 2): 1,
                   ("backward", "all_reduce", "tp", "mlp_norm.out.grad", 2 * 4096 * 2048 * 2): 1}
    _, m, _ = plan_model("mixtral-8x7b", "dp=2,ep=4,tp=2", "dp,ep,megatron,etp=1", over)
    assert _combines(m) == [("moe_combine", False), ("moe_combine_grad", True)]
    rows = 2 * 8 * 1024 * 4096 * 2  # [2, 8 x 1024, 4096] bf16 a rank
    got = {k: n for k, n in _per_layer(m, "layers.0.").items() if k[2] == "tp" and "attn" not in k[3]}
    assert got == {("forward", "all_gather", "tp", "experts.rows", rows // 2): 1,
                   ("backward", "all_reduce", "tp", "dispatch.weights.grad", 2 * 4096 * 2 * 2): 1,
                   ("backward", "all_gather", "tp", "dispatch.grad.sum", rows // 2): 1}


def test_local_rows_is_the_planners_choice_not_the_programs() -> None:
    """The program's moe_combine ops keep local_rows unset; the plan records the call it chose
    (its OpPlan's op), and the rule under it answers y partial over tp."""
    _, q, _ = plan_model("qwen3-30b-a3b", "dp=2,ep=4,tp=2", "dp,ep,megatron,etp=1",
                         {"layers": 1, "batch": 16, "seq": 4096})
    i = next(o.index for o in q.ops if o.op.rule == "moe_combine")
    assert "local_rows" not in q.program.ops[i].attrs and q.ops[i].op.attrs["local_rows"] is True
    assert dict(q.ops[i].outputs[0].partial) == {2: "sum"}
