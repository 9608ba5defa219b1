"""Expert parallelism (``--strategy dp,ep``) as Megatron-Core folds it.

Outside the experts the batch is co-sharded over (dp, ep); the expert stacks [E, in, out] are
sharded on E over ep and replicated over dp; per MoE layer one all-to-all over ep dispatches the
tokens, one combines them, and the backward mirrors both; nothing else moves tokens. Counted here
on the plans' collectives per phase, kind and mesh dim (tiny and full-size zoo / catalog models),
simulated (--verify), and run on 4 gloo processes against the single-process step."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import run_json
from spmdkit.core.dist_attr import TensorDistAttr
from spmdkit.core.errors import ProgramError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.reshard import CostModel, merge_groups, plan_reshard, single_dim_steps
from spmdkit.core.spec import DistTensorSpec
from spmdkit.cost.compute import model_flops
from spmdkit.cost.devices import preset_device
from spmdkit.cost.step import estimate_step
from spmdkit.engine.registry import get_rule
from spmdkit.models.params import count_params, parameters
from spmdkit.models.zoo import preset
from spmdkit.planner.fuse import fused_pairs, infer_fused
from spmdkit.planner.planning import plan_model
from spmdkit.sim.verify_plan import verify_strategy
from spmdkit.strategies.experts import moe_layers
from spmdkit.strategies.strategy import parse_mesh, parse_strategy

ROOT = Path(__file__).resolve().parents[1]

MOE = {"base": "tiny-llama", "experts": 4, "top_k": 2, "moe_ffn": 8}
MLA = {"kv_heads": None, "kv_lora_rank": 8, "q_lora_rank": 6, "qk_rope_head_dim": 4, "head_dim": 4, "v_head_dim": 6}
#: DeepSeek-like: MLA, a dense first layer, routed experts and a shared one, tokens dropped
DEEPSEEK = {**MOE, **MLA, "shared_experts": 1, "dense_layers": 1, "capacity_factor": 0.5}
#: Qwen3-MoE-like: many small experts, top-4 of 8, an explicit head size, 2 kv heads
QWEN3 = {"base": "tiny-llama", "experts": 8, "top_k": 4, "moe_ffn": 6, "head_dim": 8, "kv_heads": 2}


def _counts(plan: Any) -> collections.Counter[tuple[str, str, str]]:
    """(phase, kind, mesh dims) -> collectives of one step."""
    c: collections.Counter[tuple[str, str, str]] = collections.Counter()
    for r, s in plan.collectives():
        c[(plan.program.ops[r.op_index].phase, s.kind, "x".join(plan.mesh.dim_names[d] for d in s.mesh_dims))] += 1
    return c


def _moe_layer_count(cfg: Any) -> int:
    return sum(1 for i in range(cfg.layers) if cfg.is_moe_layer(i))


# -- parsing and errors ------------------------------------------------------------------------------


def test_parse_ep_folds_into_dp_and_needs_its_mesh_dim() -> None:
    assert parse_strategy("ep", parse_mesh("dp=2,ep=4")) == ("dp", "ep")
    assert parse_strategy("ep,megatron", parse_mesh("ep=2,tp=2")) == ("ep", "megatron")
    assert parse_strategy("ep,zero1", parse_mesh("ep=4")) == ("ep", "zero1")  # ZeRO over the ep ranks
    with pytest.raises(ProgramError, match=r"^--strategy ep: the mesh has no 'ep' dim \(mesh dims: dp, tp\)$"):
        parse_strategy("dp,ep", parse_mesh("dp=2,tp=2"))


@pytest.mark.parametrize(("model", "mesh", "msg"), [
    (json.dumps({"base": "tiny-llama"}), "dp=2,ep=2",
     "--strategy ep: the model has no experts (no moe_gate_dispatch op): expert parallelism needs a "
     "mixture-of-experts model"),
    (json.dumps({**MOE, "experts": 6}), "dp=2,ep=4", "--mesh ep=4: ep does not divide the model's 6 experts; an ep "
     "of 2, 3 or 6 does"),
    (json.dumps({**MOE, "batch": 6}), "dp=2,ep=2", "--batch 6: data parallel over dp x ep = 2 x 2 ranks needs a batch "
     "that is a multiple of 4 (each rank whole sequences); --batch not given: the model's own batch is 6"),
    (json.dumps({**MOE, "batch": 6}), "ep=4", "--batch 6: data parallel over ep = 4 ranks needs a batch that is a "
     "multiple of 4 (each rank whole sequences); --batch not given: the model's own batch is 6"),
])
def test_ep_refuses_with_one_line(model: str, mesh: str, msg: str) -> None:
    with pytest.raises(ProgramError) as exc:
        plan_model(model, mesh, "ep")
    assert str(exc.value) == msg


def test_the_cli_names_the_problem_and_exits_2() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    p = subprocess.run([sys.executable, "-m", "spmdkit", "plan", "--model", "llama-7b", "--mesh", "dp=2,ep=2",
                        "--strategy", "dp,ep", "--layers", "1"], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "--strategy ep: the model has no experts" in p.stderr


# -- the fused mesh ----------------------------------------------------------------------------------


def test_a_rule_on_a_co_sharded_batch_answers_on_the_fused_mesh() -> None:
    """layer_norm reads a co-shard as its largest mesh dim (Paddle): asked plainly it drops ep;
    on the fused mesh it keeps (dp, ep) on the batch of x and out, mean and variance too."""
    mesh = ProcessMesh([2, 4], dim_names=["dp", "ep"])
    x = DistTensorSpec([8, 16, 32], TensorDistAttr(mesh, [(0, 1), -1, -1]))
    w = DistTensorSpec([32], TensorDistAttr(mesh, [-1]))
    args = [x, w, w, 1e-5, 2]
    fwd = get_rule("layer_norm").infer_forward
    assert fused_pairs(args) == ((0, 1),)
    plain = fwd(*args)
    assert plain.inputs[0].dims_mapping[0] != (0, 1)
    fused = infer_fused(fwd, args, mesh)
    assert fused.inputs[0].dims_mapping == ((0, 1), -1, -1)
    assert fused.outputs[0].dims_mapping == ((0, 1), -1, -1)
    assert all(o.dims_mapping[0] == (0, 1) for o in fused.outputs[1:])
    # a tensor holding ep alone (an expert stack) keeps the rule on the real mesh
    assert fused_pairs([x, DistTensorSpec([4, 32, 32], TensorDistAttr(mesh, [1, -1, -1]))]) == ()
    # partial over one of the two only: not fused
    assert fused_pairs([x, DistTensorSpec([32], TensorDistAttr(mesh, [-1], partial=[0]))]) == ()


def test_the_token_exchange_is_one_all_to_all_over_ep() -> None:
    mesh = ProcessMesh([2, 4], dim_names=["dp", "ep"])
    shape = [8, 4, 6, 16]
    there = plan_reshard(TensorDistAttr(mesh, [(0, 1), -1, -1, -1]), TensorDistAttr(mesh, [0, 1, -1, -1]), shape, 2)
    back = plan_reshard(TensorDistAttr(mesh, [0, 1, -1, -1]), TensorDistAttr(mesh, [(0, 1), -1, -1, -1]), shape, 2)
    for p, (src, dst) in ((there, (0, 1)), (back, (1, 0))):
        (s,) = p.steps
        assert (s.kind, s.mesh_dims, s.tensor_axis, s.dst_axis) == ("all_to_all", (1,), src, dst)
        # each rank holds 8 / 8 sequences of all 4 experts, sends 3 / 4 of them: 1 x 4 x 6 x 16 x 2 bytes x 3/4
        assert s.bytes_per_rank == 1 * 4 * 6 * 16 * 2 * 3 // 4


def test_a_group_of_two_mesh_dims_reduces_and_gathers_as_one_collective() -> None:
    """A gradient partial over dp and ep: one all-reduce over the 8 ranks (2 x 7/8 of it, not
    2 x 1/2 + 2 x 3/4), a reduce-scatter onto its (dp, ep) shard, the all-gather back; each runs
    as one collective per mesh dim on an executor (major first to scatter, minor first to
    gather), through the same dist attrs as without the group."""
    mesh = ProcessMesh([2, 4], dim_names=["dp", "ep"])
    shape, size = [16, 32], 16 * 32 * 4
    cost = CostModel.default(mesh)
    part = TensorDistAttr(mesh, [-1, -1], partial=[0, 1])
    shard = TensorDistAttr(mesh, [(0, 1), -1])
    rep = TensorDistAttr(mesh, [-1, -1])
    for src, dst, kind, nbytes in ((part, rep, "all_reduce", 2 * 7 * size // 8), (part, shard, "reduce_scatter",
                                   7 * size // 8), (shard, rep, "all_gather", 7 * size // 8)):
        single = plan_reshard(src, dst, shape, 4, cost)
        assert [s.mesh_dims for s in single.steps] == ([(1,), (0,)] if kind == "all_gather" else [(0,), (1,)])
        (one,) = merge_groups(single, [(0, 1)], shape, 4, cost).steps
        assert (one.kind, one.mesh_dims, one.bytes_per_rank) == (kind, (0, 1), nbytes)
        assert one.time_s == cost.collective_time(kind, (0, 1), size, mesh.shape)
        parts = single_dim_steps(one)
        assert [(s.kind, s.mesh_dims, s.src, s.dst) for s in parts] == [(s.kind, s.mesh_dims, s.src, s.dst)
                                                                        for s in single.steps]
        assert merge_groups(single, [], shape, 4, cost) == single


def test_a_group_of_three_mesh_dims_reduces_and_gathers_as_one_collective() -> None:
    """A dense gradient under dp, cp and ep (the group (dp, cp, ep): Megatron's dense
    data-parallel group) is one all-reduce over the 16 ranks, not one over dp x cp and one over
    ep; a reduce-scatter onto its (dp, cp, ep) shard and the all-gather back are one each; the
    longest group wins over a pair inside it; a reduce-scatter in another order than the
    group's is left alone; each runs as one collective per mesh dim on an executor."""
    mesh = ProcessMesh([2, 2, 4], dim_names=["dp", "cp", "ep"])
    shape, size = [32, 32], 32 * 32 * 4
    cost = CostModel.default(mesh)
    part = TensorDistAttr(mesh, [-1, -1], partial=[0, 1, 2])
    shard = TensorDistAttr(mesh, [(0, 1, 2), -1])
    rep = TensorDistAttr(mesh, [-1, -1])
    groups = [(0, 1), (0, 1, 2)]
    for src, dst, kind, nbytes in ((part, rep, "all_reduce", 2 * 15 * size // 16), (part, shard, "reduce_scatter",
                                   15 * size // 16), (shard, rep, "all_gather", 15 * size // 16)):
        single = plan_reshard(src, dst, shape, 4, cost)
        assert len(single.steps) == 3
        (one,) = merge_groups(single, groups, shape, 4, cost).steps
        assert (one.kind, one.mesh_dims, one.bytes_per_rank) == (kind, (0, 1, 2), nbytes)
        assert one.time_s == cost.collective_time(kind, (0, 1, 2), size, mesh.shape)
        assert [(s.kind, s.mesh_dims, s.src, s.dst) for s in single_dim_steps(one)] == [
            (s.kind, s.mesh_dims, s.src, s.dst) for s in single.steps]
        # a pair alone: the pair merged, the third dim its own collective (the gather minor first)
        pair = [(1, 2), (0,)] if kind == "all_gather" else [(0, 1), (2,)]
        assert [s.mesh_dims for s in merge_groups(single, [pair[0]], shape, 4, cost).steps] == pair
    # a group in another order: a reduce-scatter is not its co-shard; an all-reduce is (any order)
    scatter, reduce = (plan_reshard(part, dst, shape, 4, cost) for dst in (shard, rep))
    assert [s.mesh_dims for s in merge_groups(scatter, [(2, 1, 0)], shape, 4, cost).steps] == [(0,), (1,), (2,)]
    assert [s.mesh_dims for s in merge_groups(reduce, [(2, 1, 0)], shape, 4, cost).steps] == [(0, 1, 2)]


# -- tiny plans ------------------------------------------------------------------------------------


def test_tiny_plan_layouts_and_collectives() -> None:
    """dp=2, ep=2: the batch over (dp, ep), the experts over ep; 2 all-to-alls forward and 2
    backward and no other collective before the optimizer; the dense gradients reduced by one
    all-reduce over the 4 ranks of dp x ep (2 x 3/4 of the gradient a rank), the experts' over
    dp only (2 x 1/2)."""
    _, plan, _ = plan_model(json.dumps({**MOE, "layers": 1}), "dp=2,ep=2", "dp,ep")
    (lay,) = moe_layers(plan.program)
    assert set(lay.stacks) == {f"layers.0.experts.w_{w}" for w in ("gate", "up", "down")}
    a = plan.attrs
    assert a["tokens"].dims_mapping == ((0, 1), -1)
    assert a["layers.0.q"].dims_mapping[0] == (0, 1) and a["layers.0.resid2"].dims_mapping[0] == (0, 1)
    for w in lay.stacks:
        assert a[w].dims_mapping == (1, -1, -1)
    assert a[lay.dispatched].dims_mapping == (0, 1, -1, -1)
    assert a[lay.rows].dims_mapping == ((0, 1), -1, -1)
    assert _counts(plan) == {("forward", "all_to_all", "ep"): 2, ("backward", "all_to_all", "ep"): 2,
                             ("optimizer", "all_reduce", "dp"): 3, ("optimizer", "all_reduce", "dpxep"): 10}
    grads = {}
    for r, s in plan.collectives("optimizer"):
        grads[r.tensor] = s.mesh_dims
        expert = r.tensor.removesuffix(".grad") in lay.stacks
        local = 4 * plan.program.tensors[r.tensor].numel // (2 if expert else 1)  # float32, an expert's on ep
        n = 2 ** len(s.mesh_dims)
        assert s.bytes_per_rank == round(2 * (n - 1) / n * local)  # the ring's 2(n-1)/n
    for n, dims in grads.items():
        assert dims == ((0,) if n.removesuffix(".grad") in lay.stacks else (0, 1)), n
    assert len(grads) == 13


@pytest.mark.parametrize(("cfg", "mesh", "strategy"), [
    (MOE, "dp=2,ep=2,tp=2", "dp,ep,megatron"),
    (MOE, "dp=2,ep=2,tp=2", "dp,ep,megatron,sp"),
    (DEEPSEEK, "ep=2,tp=2", "ep,megatron"),
    (QWEN3, "ep=4", "ep"),
])
def test_tiny_plans_with_tp_and_without_dp_exchange_tokens_by_all_to_all_only(cfg: dict[str, Any], mesh: str,
                                                                              strategy: str) -> None:
    model, plan, _ = plan_model(json.dumps(cfg), mesh, strategy)
    n = _moe_layer_count(model.config)
    c = _counts(plan)
    assert c[("forward", "all_to_all", "ep")] == 2 * n and c[("backward", "all_to_all", "ep")] == 2 * n
    assert not [k for k in c if k[2] != "tp" and k[0] != "optimizer" and k[1] != "all_to_all"]
    for lay in moe_layers(plan.program):
        for w in lay.stacks:
            dm = plan.attrs[w].dims_mapping
            assert dm[0] == plan.mesh.dim_index("ep")
            if "tp" in mesh:  # ETP = tp: gate / up column-parallel, down row-parallel
                assert dm[2 if w.endswith(("w_gate", "w_up")) else 1] == plan.mesh.dim_index("tp")


def test_zero_shards_dense_states_over_dp_x_ep_and_expert_states_over_dp() -> None:
    _, plan, _ = plan_model(json.dumps(MOE), "dp=2,ep=2", "dp,ep,zero2")
    a = plan.attrs
    assert a["layers.0.wq.moment1"].dims_mapping == ((0, 1), -1)
    assert a["layers.1.experts.w_up.moment1"].dims_mapping == (1, 0, -1)
    assert a["layers.1.experts.w_up.grad"].dims_mapping == (1, 0, -1)  # reduce-scattered over dp
    _, plan, _ = plan_model(json.dumps(MOE), "ep=4", "ep,zero1")  # no dp: dense states over ep, experts' whole
    assert plan.attrs["layers.0.wq.moment1"].dims_mapping == (0, -1)
    assert plan.attrs["layers.1.experts.w_up.moment1"].dims_mapping == (0, -1, -1)


@pytest.mark.parametrize(("cfg", "mesh", "strategy"), [
    (MOE, "dp=2,ep=2", "dp,ep,zero3"),
    (DEEPSEEK, "dp=2,ep=2,tp=2", "dp,ep,megatron,sp"),
    (QWEN3, "ep=4", "ep,zero1"),
])
def test_verify_simulates_ep_plans(cfg: dict[str, Any], mesh: str, strategy: str) -> None:
    rep = verify_strategy(json.dumps(cfg), mesh, strategy)
    assert rep["ok"] and rep["checked"] > 200 and not rep["failures"], rep["text"]


def test_verify_of_a_catalog_model_grows_the_tiny_model_for_ep() -> None:
    rep = verify_strategy("mixtral-8x7b", "dp=2,ep=8", "dp,ep")
    assert rep["ok"] and rep["model"] == "tiny-llama variant sized for ep=8", rep["text"]


# -- full-size catalog models ------------------------------------------------------------------------


@pytest.mark.parametrize(("mesh", "strategy", "batch"), [
    ("dp=8,ep=8", "dp,ep", 64),
    ("dp=2,ep=4,tp=2", "dp,ep,megatron", 8),
    ("dp=2,ep=4,tp=2", "dp,ep,megatron,sp", 8),
])
def test_mixtral_8x7b_plan(mesh: str, strategy: str, batch: int) -> None:
    """Per MoE layer 2 all-to-alls over ep forward and 2 backward, no all-gather of tokens; the
    step's FLOPs: the plan's N is the catalog's active parameters less the embedding table (a
    lookup multiplies nothing), and the FLOPs the devices execute, summed, are 6 x N x tokens plus
    the causal attention (half the PaLM square) within 1%."""
    seq = 4096
    _, plan, _ = plan_model("mixtral-8x7b", mesh, strategy, {"batch": batch, "seq": seq})
    c = _counts(plan)
    assert c[("forward", "all_to_all", "ep")] == 64 and c[("backward", "all_to_all", "ep")] == 64
    assert not [k for k in c if k[0] != "optimizer" and k[2] != "tp" and k[1] != "all_to_all"]
    if "megatron" not in strategy:
        assert not [k for k in c if k[0] != "optimizer" and k[1] != "all_to_all"]
    tokens = batch * seq
    _, n, att = model_flops(plan, tokens)
    count = count_params(preset("mixtral-8x7b"))
    assert n == pytest.approx(count.active - count.token_embedding, rel=1e-3)
    assert count.active == pytest.approx(12.9e9, rel=0.01)  # published: 46.7B, active 12.9B
    executed = estimate_step(plan, preset_device("h100"), tokens).flops_per_device * plan.mesh.size
    assert executed == pytest.approx(6 * n * tokens + att / 2, rel=0.01)
    # each device holds 1 / 8 of the experts and all of the rest: 13.5 GiB of bf16 parameters
    held = sum(plan.program.tensors[p].numel / (8 if plan.attrs[p].dims_mapping[0] == plan.mesh.dim_index("ep")
                                                  and len(plan.program.tensors[p].shape) == 3 else 1)
               for p in parameters(plan.program))
    tp = dict(zip(plan.mesh.dim_names, plan.mesh.shape)).get("tp", 1)
    if tp == 1:
        assert held * 2 / 2**30 == pytest.approx(13.49, abs=0.01)


@pytest.mark.parametrize(("name", "mesh", "strategy", "batch"), [
    ("qwen3-30b-a3b", "dp=2,ep=8", "dp,ep", 16),
    ("deepseek-v3", "dp=2,ep=64", "dp,ep,zero1", 128),
])
def test_qwen3_moe_and_deepseek_v3_plans(name: str, mesh: str, strategy: str, batch: int) -> None:
    """Qwen3-30B-A3B (48 MoE layers) and DeepSeek-V3 (3 dense layers first, 58 MoE layers with a
    shared expert, MLA, and its MTP module's MoE layer: 59) at seq 4096: 2 + 2 all-to-alls per MoE
    layer, no other collective before
    the gradient reduction; every expert stack over ep; under zero1 the dense optimizer states
    over dp x ep and the experts' over dp."""
    model, plan, _ = plan_model(name, mesh, strategy, {"batch": batch, "seq": 4096})
    n = _moe_layer_count(model.config)
    assert n == {"qwen3-30b-a3b": 48, "deepseek-v3": 58}[name]
    n += model.config.mtp_layers  # the MTP module's layer is MoE as the last layer is (models/zoo_mtp.py)
    c = _counts(plan)
    assert c[("forward", "all_to_all", "ep")] == 2 * n and c[("backward", "all_to_all", "ep")] == 2 * n
    assert not [k for k in c if k[0] == "forward" and k[1] != "all_to_all"]
    assert not [k for k in c if k[0] == "backward" and k[1] not in ("all_to_all", "all_reduce")]
    layers = moe_layers(plan.program)
    assert len(layers) == n and all(len(lay.stacks) == 3 for lay in layers)
    ep = plan.mesh.dim_index("ep")
    assert all(plan.attrs[w].dims_mapping[0] == ep for lay in layers for w in lay.stacks)
    if "zero1" in strategy:
        assert plan.attrs["layers.0.wo.moment1"].dims_mapping[0] == (0, 1)
        w = layers[0].stacks[0]
        assert plan.attrs[w + ".moment1"].dims_mapping[:2] == (1, 0)


# -- on gloo -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("cfg", "layers", "mesh", "strategy"), [
    (MOE, 1, "dp=2,ep=2", "dp,ep"),
    (QWEN3, 1, "dp=2,ep=2", "dp,ep,zero1"),
    (DEEPSEEK, 2, "ep=2,tp=2", "ep,megatron"),
    (MOE, 1, "ep=2,tp=2", "ep,megatron,sp,etp=1"),
], ids=["mixtral-like", "qwen3-moe-like", "deepseek-like", "mixtral-like-etp1"])
def test_run_with_ep_on_gloo_equals_the_single_process_step(cfg: dict[str, Any], layers: int, mesh: str,
                                                             strategy: str) -> None:
    """4 gloo processes, float32: loss, every gradient, update and activation equal the
    single-process step; every rank issued the plan's collectives, among them 2 all-to-alls
    over ep forward and 2 backward per MoE layer. ETP = 1 (tests/test_etp.py): the experts
    whole over ep x tp, each rank routing its own sequence-parallel chunk, the all-to-alls over
    the ep x tp group; sp's all-gathers over tp only."""
    rep = run_json("--model-config", json.dumps({**cfg, "layers": layers}), "--mesh", mesh, "--strategy", strategy)
    assert rep["world_size"] == 4 and rep["backend"] == "gloo"
    assert rep["ok"] and rep["collectives_match"] and not rep["failures"] and rep["nonfinite"] == 0, rep["failures"]
    assert rep["loss"] == pytest.approx(rep["reference_loss"], rel=1e-6)
    ep = mesh.split(",").index(next(p for p in mesh.split(",") if p.startswith("ep=")))
    moe_layers_n = layers - cfg.get("dense_layers", 0)
    a2a = [c for c in rep["collectives"] if c["kind"] == "all_to_all"]
    tp = mesh.split(",").index("tp=2") if "sp" in strategy else None
    if "etp=1" in strategy:
        # Megatron's token path: each all-to-all over the ep x tp group, issued over ep then over
        # tp (one process group per mesh dim); no tp collective moves the MoE layer's tokens
        assert len(a2a) == 8 * moe_layers_n and {c["mesh_dim"] for c in a2a} == {ep, tp}
        assert not [c for c in rep["collectives"] if c["kind"] != "all_to_all" and any(
            w in c["tensor"] for w in ("experts.rows", "dispatch", "mlp_norm.out", "moe_out", "chunks"))]
    else:
        assert len(a2a) == 4 * moe_layers_n and {c["mesh_dim"] for c in a2a} == {ep}
    assert not [c for c in rep["collectives"] if c["kind"] == "all_gather" and "zero" not in strategy
                and c["mesh_dim"] != tp]


def test_the_docs_command_plans_as_the_page_says() -> None:
    """docs/experts.md's command: exit 0, 2 x 32 all-to-alls over ep forward and backward (the
    report's per-step table), the experts over ep and the tokens over dp x ep."""
    text = (ROOT / "docs" / "experts.md").read_text()
    cmd = next(line for line in text.splitlines() if line.startswith("spmdkit plan "))
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    p = subprocess.run([sys.executable, "-m", "spmdkit", *cmd.split()[1:]], capture_output=True, text=True, env=env,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "│ forward   │ all_to_all x64 " in p.stdout and "│ backward  │ all_to_all x64 " in p.stdout
    assert "layers.0.experts.w_gate   │ parameter  │ [8, 4096, 14336]     │ [dp:R, ep:S(0)]" in p.stdout
    assert "│ tokens                    │ input      │ [64, 4096]           │ [dp:S(0), ep:S(0)]" in p.stdout
