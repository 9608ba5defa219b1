"""Mixture of experts under context parallelism: each cp rank routes its own tokens.

Megatron-Core's router and token dispatcher see a flat list of the tokens a rank holds; context
parallelism only changes which tokens those are (docs/experts.md, "Under cp"). The zoo model
built for ``cp`` routes each sequence in ``cp`` chunks (``moe_chunks``; ``cp x tp`` on Megatron's
ETP = 1 token path), the chunk axis kept over cp on every MoE tensor: no token is gathered over
cp around a MoE layer, the all-to-alls over ep carry each rank's own tokens, and the experts'
gradients are reduced over dp x cp (Megatron's expert-data-parallel group). Tiny MoE (batch 4,
seq 8, hidden 16, 4 experts top-2, float32)."""

from __future__ import annotations

import collections
import json
from typing import Any

import numpy as np
import pytest

from conftest import run_json
from spmdkit.models.zoo_layers import cp_order
from spmdkit.planner.planning import plan_model
from spmdkit.sim.plan import simulate_plan
from spmdkit.sim.verify_plan import tiny_for_mesh

MOE = {"base": "tiny-llama", "experts": 4, "top_k": 2, "moe_ffn": 8, "batch": 4}


def _per_layer(plan: Any, prefix: str) -> collections.Counter[tuple[str, str, str, str, int]]:
    """(phase, kind, mesh dims, tensor after the layer prefix, bytes a rank sends) of the
    collectives of one layer (its forward and backward ops), outside the optimizer."""
    names = plan.mesh.dim_names
    got: collections.Counter[tuple[str, str, str, str, int]] = collections.Counter()
    for r in plan.reshards:
        op = plan.program.ops[r.op_index]
        if op.phase == "optimizer" or r.shared or prefix not in op.name:
            continue
        for s in r.plan.steps:
            if s.kind != "slice" and s.bytes_per_rank:
                got[(op.phase, s.kind, "x".join(names[d] for d in s.mesh_dims), r.tensor.removeprefix(prefix),
                     s.bytes_per_rank)] += 1
    return got


def etp1_moe(slots: int, counts: int) -> collections.Counter[tuple[str, str, str, str, int]]:
    """The collectives of a MoE layer on Megatron's ETP = 1 token path under cp x tp (bytes a
    rank sends): one all-to-all over the ep x tp group each way, forward and backward, of
    ``slots`` bytes, and the counts' all-reduce over cp x tp of ``counts``."""
    return collections.Counter({
        ("forward", "all_to_all", "epxtp", "dispatch", slots): 1,
        ("forward", "all_to_all", "tpxep", "experts.rows", slots): 1,
        ("forward", "all_reduce", "cpxtp", "aux.f3", counts): 1,
        ("backward", "all_to_all", "epxtp", "experts.rows.grad", slots): 1,
        ("backward", "all_to_all", "tpxep", "dispatch.grad.sum", slots): 1,
    })


@pytest.mark.parametrize(("mesh", "strategy", "chunks"), [
    ("dp=2,cp=2", "dp,cp", 2), ("cp=2,ep=2", "cp,ep", 2), ("cp=2,ep=2,tp=2", "cp,ep,megatron,sp", 2),
    ("cp=2,ep=2,tp=2", "cp,ep,megatron,etp=1", 2), ("cp=2,ep=2,tp=2", "cp,ep,megatron,sp,etp=1", 4),
    ("cp=4", "cp", 4), ("dp=2,ep=2", "dp,ep", 1),
])
def test_the_model_is_routed_in_one_chunk_a_cp_rank(mesh: str, strategy: str, chunks: int) -> None:
    """cp chunks (one a cp rank), cp x tp on Megatron's ETP = 1 token path (each rank of the
    (cp, tp) co-shard of the sequence its own), one without cp; the capacity is per chunk."""
    cfg = {**MOE, "seq": 16}
    model, plan, _ = plan_model(json.dumps(cfg), mesh, strategy)
    assert model.config.moe_chunks == chunks
    cap = 16 // chunks * 2 // 4  # the chunk's tokens x top_k / experts
    want = (4, chunks, 4, cap, 16) if chunks > 1 else (4, 4, cap, 16)
    assert plan.program.tensors["layers.0.dispatch"].shape == want


def test_a_zigzag_chunk_is_the_rank_s_two_pieces() -> None:
    """Under the zig-zag balance the sequence is laid out so that cp rank i holds pieces i and
    2cp-1-i side by side: chunk i of the routing is exactly those tokens (the dispatch's
    capacity is per rank: its S / cp tokens, both pieces)."""
    model, _, _ = plan_model(json.dumps({**MOE, "seq": 16}), "cp=2", "cp")
    cfg = model.config
    assert cfg.moe_chunks == 2 and model.program.tensors["layers.0.chunks"].shape == (4, 2, 8, 16)
    pos = np.asarray(cp_order(cfg)).reshape(2, 8)  # the tokens' positions, chunk by chunk
    assert pos.tolist() == [[0, 1, 2, 3, 12, 13, 14, 15], [4, 5, 6, 7, 8, 9, 10, 11]]


def test_tiny_plan_collectives_per_moe_layer_by_hand() -> None:
    """cp=2 x ep=2: a rank holds 2 sequences' cp half (4 tokens each), routed on its own:
    capacity 4 x 2 / 4 = 2, the dispatched slots [2, 1, 4, 2, 16] (1,024 B) sent by one
    all-to-all over ep ((2 - 1) / 2: 512 B), the rows back the same way; the backward mirrors.
    Over cp only attention's (k, v gathered, dK, dV reduce-scattered) and the load-balancing
    loss' counts [2, 4] (32 B, Megatron's all-reduce of tokens_per_expert over cp). Before (each
    sequence routed whole): the tokens [2, 8, 16] and the gate values all-gathered over cp, the
    all-to-alls of 1,024 B (every cp rank dispatching the whole sequence) and the rows'
    gradient all-reduced over cp."""
    _, plan, _ = plan_model(json.dumps({**MOE, "layers": 1}), "cp=2,ep=2", "cp,ep")
    assert _per_layer(plan, "layers.0.") == collections.Counter({
        ("forward", "all_gather", "cp", "k_rope", 256): 1,
        ("forward", "all_gather", "cp", "v4", 256): 1,
        ("forward", "all_to_all", "ep", "dispatch", 512): 1,
        ("forward", "all_to_all", "ep", "experts.rows", 512): 1,
        ("forward", "all_reduce", "cp", "aux.f3", 32): 1,
        ("backward", "all_to_all", "ep", "experts.rows.grad", 512): 1,
        ("backward", "all_to_all", "ep", "dispatch.grad.sum", 512): 1,
        ("backward", "reduce_scatter", "cp", "k_rope.grad", 256): 1,
        ("backward", "reduce_scatter", "cp", "v4.grad", 256): 1,
    })
    cp = plan.mesh.dim_index("cp")
    assert plan.attrs["layers.0.dispatch"].dims_mapping == (-1, cp, plan.mesh.dim_index("ep"), -1, -1)


def test_etp1_under_cp_is_megatron_s_token_path_on_the_cp_x_tp_chunks() -> None:
    """cp=2 x ep=2 x tp=2, megatron + sp + ETP = 1: each sequence in cp x tp = 4 chunks of 2
    tokens (capacity 1), a rank's chunk its (cp, tp) share of the residual stream; one all-to-all
    over the ep x tp group each way (a rank's [2, 1, 4, 1, 16] slots: 3/4 of 512 B), nothing over
    cp but attention's and the counts (now over the cp x tp chunks), no tp collective around the
    experts; the load-balancing shares [B, S, 1] gathered over tp beside the token losses (16 B)."""
    _, plan, _ = plan_model(json.dumps({**MOE, "layers": 1}), "cp=2,ep=2,tp=2", "cp,ep,megatron,sp,etp=1")
    moe = {k: n for k, n in _per_layer(plan, "layers.0.").items() if not k[3].startswith(("attn", "k_rope", "v4"))}
    assert moe == etp1_moe(384, 48)
    cp, ep, tp = (plan.mesh.dim_index(d) for d in ("cp", "ep", "tp"))
    assert plan.attrs["layers.0.chunks"].dims_mapping == (ep, (cp, tp), -1, -1)
    assert plan.attrs["layers.0.dispatch"].dims_mapping == (-1, cp, (ep, tp), -1, -1)


@pytest.mark.parametrize(("mesh", "strategy"), [
    ("cp=2,ep=2", "cp,ep"), ("dp=2,cp=2,ep=2", "dp,cp,ep,cp-attention=ring"),
    ("cp=2,ep=2,tp=2", "cp,ep,megatron,sp,etp=1"), ("cp=2,ep=2,tp=2", "cp,ep,megatron,etp=1"),
    ("cp=2,tp=2", "megatron,sp,cp"),
])
def test_verify_simulates_moe_plans_under_cp(mesh: str, strategy: str) -> None:
    """--verify's check: the tiny model built for the mesh, simulated against the unsharded step
    (loss, every gradient, every update)."""
    tiny = tiny_for_mesh(json.dumps({k: v for k, v in MOE.items() if k != "batch"}), mesh, strategy)
    _, plan, _ = plan_model(tiny, mesh, strategy)
    assert plan.program.tensors["layers.0.dispatch"].shape[1] > 1  # routed in chunks
    rep = simulate_plan(plan)
    assert rep.ok and rep.checked > 300, rep.failures[:3]


def test_run_with_cp_and_ep_on_gloo_equals_the_single_process_step() -> None:
    """4 gloo processes (cp=2 x ep=2), float32: loss and every gradient and update equal the
    single-process step; the rank's collectives are the plan's: 2 all-to-alls over ep forward and
    2 backward, nothing over cp but attention's, the counts' all-reduce and the gradients'; the
    experts' gradients reduced over cp alone (EDP = cp: Megatron's expert-data-parallel group is
    the dp x cp ranks outside ep), the dense ones over cp and ep."""
    rep = run_json("--model-config", json.dumps({**MOE, "layers": 1}), "--mesh", "cp=2,ep=2", "--strategy", "cp,ep")
    assert rep["world_size"] == 4 and rep["backend"] == "gloo"
    assert rep["ok"] and rep["collectives_match"] and not rep["failures"] and rep["nonfinite"] == 0, rep["failures"]
    assert rep["loss"] == pytest.approx(rep["reference_loss"], rel=1e-6)
    coll = rep["collectives"]
    assert [c["tensor"] for c in coll if c["kind"] == "all_to_all" and c["mesh_dim"] == 1] == [
        "layers.0.dispatch", "layers.0.experts.rows", "layers.0.experts.rows.grad", "layers.0.dispatch.grad.sum"]
    over_cp = {c["tensor"].removeprefix("layers.0.") for c in coll if c["mesh_dim"] == 0
               and not c["tensor"].endswith(".grad")}
    assert over_cp == {"k_rope", "v4", "aux.f3"}
    experts = {(c["tensor"], c["kind"], c["mesh_dim"]) for c in coll if ".experts.w_" in c["tensor"]}
    assert experts == {(f"layers.0.experts.w_{w}.grad", "all_reduce", 0) for w in ("gate", "up", "down")}


def test_zero_shards_expert_states_over_dp_x_cp() -> None:
    """ZeRO-2 on dp=2 x cp=2 x ep=2: an expert stack's gradient is partial over dp and cp (each
    cp rank's experts saw its own tokens), so its states are sharded over the dp x cp ranks (the
    expert-data-parallel group, Megatron's distributed optimizer shards over it) and its gradient
    reduce-scattered once over that group; the plan simulates equal to the unsharded step."""
    mesh, st = "dp=2,cp=2,ep=2", "dp,cp,ep,zero2"
    _, plan, _ = plan_model(tiny_for_mesh(json.dumps({k: v for k, v in MOE.items() if k != "batch"}), mesh, st),
                            mesh, st)
    dp, cp, ep = (plan.mesh.dim_index(d) for d in ("dp", "cp", "ep"))
    assert plan.attrs["layers.0.experts.w_up.moment1"].dims_mapping == (ep, (dp, cp), -1)
    steps = [(s.kind, s.mesh_dims) for r in plan.reshards if r.tensor == "layers.0.experts.w_up.grad"
             for s in r.plan.steps if s.kind != "slice"]
    assert steps == [("reduce_scatter", (dp, cp))]
    rep = simulate_plan(plan)
    assert rep.ok and rep.checked > 300, rep.failures[:3]


def _grad_steps(plan: Any, tensor: str) -> list[tuple[str, tuple[int, ...], int]]:
    """(kind, mesh dims, bytes a rank sends) of the collectives reducing ``tensor``'s gradient
    (slices left out), and of gathering its update back."""
    return [(s.kind, s.mesh_dims, s.bytes_per_rank) for r in plan.reshards if r.tensor in (tensor + ".grad",
            tensor + ".new") for s in r.plan.steps if s.kind != "slice"]


@pytest.mark.parametrize(("mesh", "strategy"), [("dp=2,cp=2,ep=2", "dp,cp,ep"), ("cp=2,ep=2", "cp,ep")])
def test_a_dense_gradient_is_one_all_reduce_over_dp_x_cp_x_ep(mesh: str, strategy: str) -> None:
    """A dense parameter's gradient, partial over dp, cp and ep, is one all-reduce over all of
    them (Megatron-Core carves ep out of the dp x cp ranks: its dense data-parallel group is
    every one of them), 2 x (n-1)/n of it a rank; an expert stack's one over dp x cp (its
    expert-data-parallel group), over cp alone without dp. The plan simulates equal to the
    unsharded step."""
    _, plan, _ = plan_model(tiny_for_mesh(json.dumps({k: v for k, v in MOE.items() if k != "batch"}), mesh,
                                          strategy), mesh, strategy)
    names = plan.mesh.dim_names
    every = tuple(range(len(names)))  # dp, cp, ep in the mesh's order
    n = plan.mesh.size
    wq = 16 * 16 * 4  # layers.0.wq [16, 16] float32
    assert _grad_steps(plan, "layers.0.wq") == [("all_reduce", every, 2 * (n - 1) * wq // n)]
    w_up = 2 * 16 * 8 * 4  # layers.0.experts.w_up: [4, 16, 8] over ep = 2
    edp = tuple(d for d in every if names[d] != "ep")
    m = n // 2
    assert _grad_steps(plan, "layers.0.experts.w_up") == [("all_reduce", edp, 2 * (m - 1) * w_up // m)]
    rep = simulate_plan(plan)
    assert rep.ok and rep.checked > 300, rep.failures[:3]


def test_zero_shards_dense_states_over_dp_x_cp_x_ep() -> None:
    """ZeRO-2 on dp=2 x cp=2 x ep=2: a dense parameter's states are sharded over the dp x cp x
    ep ranks (Megatron's distributed optimizer over its dense data-parallel group), its gradient
    reduce-scattered once over them and the updated parameter all-gathered once (before: over
    (dp, ep), the gradient reduce-scattered over dp and ep and all-reduced over cp, three
    collectives); the plan simulates equal to the unsharded step."""
    mesh, st = "dp=2,cp=2,ep=2", "dp,cp,ep,zero2"
    _, plan, _ = plan_model(tiny_for_mesh(json.dumps({k: v for k, v in MOE.items() if k != "batch"}), mesh, st),
                            mesh, st)
    dp, cp, ep = (plan.mesh.dim_index(d) for d in ("dp", "cp", "ep"))
    assert plan.attrs["layers.0.wq.moment1"].dims_mapping == ((dp, cp, ep), -1)
    wq = 16 * 16 * 4
    assert _grad_steps(plan, "layers.0.wq") == [("reduce_scatter", (dp, cp, ep), 7 * wq // 8),
                                                ("all_gather", (dp, cp, ep), 7 * wq // 8)]
    rep = simulate_plan(plan)
    assert rep.ok and rep.checked > 300, rep.failures[:3]


def test_run_with_zero2_under_cp_and_ep_on_gloo_equals_the_single_process_step() -> None:
    """4 gloo processes (cp=2 x ep=2, ZeRO-2), float32: the dense gradient is reduce-scattered
    over the cp x ep ranks and the update all-gathered back, one collective each in the plan
    (its (cp, ep) group), run as one per mesh dim (the scatter major dim first, the gather minor
    first); loss and every gradient and update equal the single-process step."""
    cfg = json.dumps({**MOE, "layers": 1})
    rep = run_json("--model-config", cfg, "--mesh", "cp=2,ep=2", "--strategy", "cp,ep,zero2")
    assert rep["world_size"] == 4 and rep["ok"] and rep["collectives_match"] and not rep["failures"], rep["failures"]
    assert rep["loss"] == pytest.approx(rep["reference_loss"], rel=1e-6)
    assert [(c["kind"], c["mesh_dim"]) for c in rep["collectives"] if c["tensor"].startswith("layers.0.wq.")] == [
        ("reduce_scatter", 0), ("reduce_scatter", 1), ("all_gather", 1), ("all_gather", 0)]
    _, plan, _ = plan_model(cfg, "cp=2,ep=2", "cp,ep,zero2")
    assert [(k, d) for k, d, _ in _grad_steps(plan, "layers.0.wq")] == [("reduce_scatter", (0, 1)),
                                                                      ("all_gather", (0, 1))]
