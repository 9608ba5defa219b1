"""A MoE model under ``dp,ep,megatron,sp,cp``: the residual stream holds two co-shards.

With data parallelism folded over ``dp x ep`` and the sequence over ``cp x tp`` (sp under cp),
the residual stream is ``[(dp, ep), (cp, tp), H]``. The planner asks a rule on the mesh with
each co-shard fused into one dim (:mod:`spmdkit.planner.fuse`); it used to fuse the first (the
batch) only, so the rules read the sequence's ``(cp, tp)`` as its largest dim and every norm, add
and MoE op around the experts gathered the sequence over cp x tp and sliced it again (Qwen3-235B
on dp=4 x cp=2 x ep=2 x tp=4: the forward's all_gather x19, 52 ms; docs/experts.md, "Under cp").
Now each co-shard is fused on its own, and the MoE layer's collectives with dp are those without
it. Tiny MoE (hidden 16, seq 8, 4 experts top-2, float32; batch 4 over dp x ep = 4: one sequence
a rank)."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

from conftest import run_json
from hf_moe_helpers import MIXTRAL, collectives
from spmd_helpers import T
from spmdkit.core.mesh import ProcessMesh
from spmdkit.engine.registry import get_rule
from spmdkit.planner.fuse import fused_pairs, infer_fused
from spmdkit.planner.planning import plan_hf, plan_model
from spmdkit.sim.plan import simulate_plan
from spmdkit.sim.verify_plan import tiny_for_mesh, verify_hf
from test_moe_cp import MOE, _per_layer, etp1_moe

ROOT = Path(__file__).resolve().parents[1]
MESH = "dp=2,cp=2,ep=2,tp=2"
ETP1 = "dp,ep,megatron,sp,cp,etp=1"
ETPTP = "dp,ep,megatron,sp,cp"


def test_each_co_shard_is_fused_on_its_own() -> None:
    """layer_norm on x [(dp, ep), (cp, tp), H] (dp=2 x cp=2 x ep=2 x tp=4): asked plainly the
    rule reads each co-shard as its largest dim; on the mesh with both pairs fused it keeps both,
    on x, the output, the mean and the variance."""
    m = ProcessMesh([2, 2, 2, 4], dim_names=["dp", "cp", "ep", "tp"])
    x = T(m, [4, 32, 16], [(0, 2), (1, 3), -1])
    w = T(m, [16], [-1])
    args = [x, w, w, 1e-5, 2]
    assert fused_pairs(args) == ((0, 2), (1, 3))
    rule = get_rule("layer_norm").infer_forward
    assert rule(*args).inputs[0].dims_mapping != ((0, 2), (1, 3), -1)  # Paddle's rule, unchanged
    res = infer_fused(rule, args, m)
    assert res.inputs[0].dims_mapping == ((0, 2), (1, 3), -1)
    assert res.outputs[0].dims_mapping == ((0, 2), (1, 3), -1)
    assert all(o.dims_mapping == ((0, 2), (1, 3)) for o in res.outputs[1:])


def test_a_tensor_on_the_major_dim_alone_whole_over_the_minor_is_not_fused() -> None:
    """The add of the residual stream [(dp, ep), (cp, tp), H] and a tensor on cp alone, whole
    over tp: the (cp, tp) pair is not fused (read as the co-shard, a co-shard a rule made in
    passing would spread over the plan, every such tensor sliced onto it: an imported
    DeepSeek-V3 under megatron had its batch over (dp, tp) everywhere); the batch's is. Where
    the strategy wants such a tensor on the co-shard it marks it (next test)."""
    m = ProcessMesh([2, 2, 2, 4], dim_names=["dp", "cp", "ep", "tp"])
    x = T(m, [4, 32, 16], [(0, 2), (1, 3), -1])
    y = T(m, [4, 32, 16], [(0, 2), 1, -1])
    assert fused_pairs([x, y]) == ((0, 2),)


def test_etp_tp_marks_the_routed_norm_output_s_gradient_on_the_co_shard() -> None:
    """ETP = tp under cp: the gradient of the norm output the chunks read comes back whole over
    tp; the strategy marks it on the stream's co-shard (a slice where it is), so the norm's
    backward runs on the rank's own tokens, and the MoE output's gradient on cp alone (gathered
    over tp before the chunks)."""
    _, plan, _ = plan_model(json.dumps({**MOE, "layers": 1}), MESH, ETPTP)
    dp, cp, ep, tp = (plan.mesh.dim_index(d) for d in ("dp", "cp", "ep", "tp"))
    assert plan.attrs["layers.0.mlp_norm.out.grad"].dims_mapping == ((dp, ep), (cp, tp), -1)
    assert plan.attrs["layers.0.moe_out.seq.grad"].dims_mapping == ((dp, ep), cp, -1)
    assert plan.attrs["layers.0.mlp_norm.out"].dims_mapping == ((dp, ep), cp, -1)


#: the layer's collectives around attention on dp=2 x cp=2 x ep=2 x tp=2 (a rank's [1, 2, 16]
#: float32 share of the stream: 128 B): sp's all-gather before the projections and reduce-scatter
#: after, cp's k and v gathered (64 B each), and their mirrors in the backward
SP_ATTENTION = collections.Counter({
    ("forward", "all_gather", "tp", "attn_norm.out", 128): 1,
    ("forward", "all_gather", "cp", "k_rope", 64): 1,
    ("forward", "all_gather", "cp", "v4", 64): 1,
    ("forward", "reduce_scatter", "tp", "attn_out", 128): 1,
    ("backward", "all_gather", "tp", "attn_out.grad", 128): 1,
    ("backward", "reduce_scatter", "cp", "k_rope.grad", 64): 1,
    ("backward", "reduce_scatter", "cp", "v4.grad", 64): 1,
    ("backward", "reduce_scatter", "tp", "attn_norm.out.grad.sum", 128): 1,
})


def test_etp1_with_dp_is_megatron_s_token_path_on_the_cp_x_tp_chunks() -> None:
    """dp=2 x cp=2 x ep=2 x tp=2, ETP = 1: a rank holds one sequence's (cp, tp) quarter of the
    residual stream (2 tokens), routes it on its own (capacity 2 x 2 / 4 = 1: the slots [1, 1, 4,
    1, 16], 256 B) and sends 3/4 of them by one all-to-all over the ep x tp group (192 B), the
    rows back the same way; the backward mirrors both. Nothing else around the experts: the norm
    before the router reads the sequence-sharded stream; over cp only attention's (k, v gathered
    and their gradients reduce-scattered, 64 B each) and the counts' all-reduce over cp x tp ([1,
    1, 1, 4] float32: 2 x 3/4 x 16 B = 24 B); over tp only sp's around attention (the normalised
    stream gathered, the projection's output reduce-scattered, 128 B each way). Before: the
    sequence gathered over cp x tp before each norm and the router, the dispatch sent from copies
    replicated over tp (256 B), the rows all-gathered over tp before the combine."""
    _, plan, _ = plan_model(json.dumps({**MOE, "layers": 1}), MESH, ETP1)
    assert _per_layer(plan, "layers.0.") == SP_ATTENTION + etp1_moe(192, 24)
    dp, cp, ep, tp = (plan.mesh.dim_index(d) for d in ("dp", "cp", "ep", "tp"))
    for t in ("resid1", "mlp_norm.out", "moe_out.seq", "resid2"):
        assert plan.attrs[f"layers.0.{t}"].dims_mapping == ((dp, ep), (cp, tp), -1), t
    assert plan.attrs["layers.0.chunks"].dims_mapping == ((dp, ep), (cp, tp), -1, -1)
    assert plan.attrs["layers.0.dispatch"].dims_mapping == (dp, cp, (ep, tp), -1, -1)


def test_etp_tp_with_dp_gathers_the_tokens_over_tp_alone() -> None:
    """dp=2 x cp=2 x ep=2 x tp=2, ETP = tp: every tp rank routes its cp rank's 4 tokens (the
    normalised stream gathered over tp, 128 B, as before attention), the slots [1, 2 / 2, 4, 2,
    16] (512 B) all-to-all over ep (256 B), the experts' rows all-reduced over tp (2 x 1/2 x 512
    B) and sent back over ep; the MoE output sliced onto the stream's co-shard. Backward: its
    gradient gathered over tp alone (128 B; before over cp x tp, 384 B, and sliced over cp), the
    mirrors of the two all-to-alls and the all-reduce, and the norm's backward on the sequence's
    co-shard (before: its input, inverse rms and the stream's gradient gathered over tp, five
    gathers). Nothing over cp but attention's and the counts'."""
    _, plan, _ = plan_model(json.dumps({**MOE, "layers": 1}), MESH, ETPTP)
    assert _per_layer(plan, "layers.0.") == SP_ATTENTION + collections.Counter({
        ("forward", "all_gather", "tp", "mlp_norm.out", 128): 1,
        ("forward", "all_to_all", "ep", "dispatch", 256): 1,
        ("forward", "all_reduce", "cp", "aux.f3", 16): 1,
        ("forward", "all_reduce", "tp", "experts.rows", 512): 1,
        ("forward", "all_to_all", "ep", "experts.rows", 256): 1,
        ("backward", "all_gather", "tp", "moe_out.seq.grad", 128): 1,
        ("backward", "all_to_all", "ep", "experts.rows.grad", 256): 1,
        ("backward", "all_reduce", "tp", "dispatch.grad.sum", 512): 1,
        ("backward", "all_to_all", "ep", "dispatch.grad.sum", 256): 1,
    })
    dp, cp, ep = (plan.mesh.dim_index(d) for d in ("dp", "cp", "ep"))
    assert plan.attrs["layers.0.chunks"].dims_mapping == ((dp, ep), cp, -1, -1)


@pytest.mark.parametrize("strategy", [ETP1, ETPTP])
def test_the_moe_layer_moves_with_dp_what_it_moves_without(strategy: str) -> None:
    """The same layer on cp=2 x ep=2 x tp=2 at batch 2 (one sequence a rank, as dp=2 at batch 4)
    sends the same collectives of the same bytes: dp only adds ranks holding other sequences."""
    _, with_dp, _ = plan_model(json.dumps({**MOE, "layers": 1}), MESH, strategy)
    _, without, _ = plan_model(json.dumps({**MOE, "layers": 1, "batch": 2}), "cp=2,ep=2,tp=2",
                               strategy.removeprefix("dp,"))
    assert _per_layer(with_dp, "layers.0.") == _per_layer(without, "layers.0.")


@pytest.mark.parametrize("strategy", [ETP1, ETPTP])
def test_verify_simulates_the_plans_with_dp(strategy: str) -> None:
    """--verify's check on 16 ranks: the tiny model built for the mesh, simulated against the
    unsharded step (loss, every gradient, every update)."""
    tiny = tiny_for_mesh(json.dumps({k: v for k, v in MOE.items() if k != "batch"}), MESH, strategy)
    _, plan, _ = plan_model(tiny, MESH, strategy)
    rep = simulate_plan(plan)
    assert rep.ok and rep.checked > 300, rep.failures[:3]


def test_the_reproducer_gathers_nothing_over_cp_around_the_experts() -> None:
    """Qwen3-235B-A22B, one layer, seq 32768, batch 16 on dp=4 x cp=2 x ep=2 x tp=4 (ETP = 1,
    ring attention, the megatron framework): the forward's collectives are sp's (the stream
    gathered over tp before attention and the head, 192 MiB each; the row-parallel outputs
    reduce-scattered), the MoE layer's all-to-alls over ep x tp of each rank's own tokens (448
    MiB each way: the rank's [1, 1, 128, 256, 4096] bf16 slots x 7/8), the counts' all-reduce
    and the load-balancing shares gathered over tp beside the token losses (96 KiB). Before:
    all_gather x19 (10.16 GiB a rank, 52.2 ms) and the dispatch of 896 MiB."""
    p = subprocess.run([sys.executable, "-m", "spmdkit", "plan", "--model", "qwen3-235b-a22b", "--layers", "1",
                        "--seq", "32768", "--batch", "16", "--mesh", "dp=4,cp=2,ep=2,tp=4", "--strategy",
                        "dp,ep,megatron,sp,cp,zero1,cp-attention=ring,etp=1", "--framework", "megatron",
                        "--device", "h100", "--json"], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))
    assert p.returncode == 0, p.stderr[-2000:]
    rep = json.loads(p.stdout)
    fwd = [r for r in rep["reshards"] if r["phase"] == "forward"]
    gathers = sorted((r["tensor"], s["mesh_dims"]) for r in fwd for s in r["steps"] if s["kind"] == "all_gather")
    tp = [3]  # the mesh dim
    assert gathers == [("final_norm.out", tp), ("layers.0.attn_norm.out", tp), ("layers.0.aux", tp)]
    a2a = {r["tensor"]: s["bytes_per_rank"] for r in fwd for s in r["steps"] if s["kind"] == "all_to_all"}
    assert a2a == {"layers.0.dispatch": 448 << 20, "layers.0.experts.rows": 448 << 20}


@pytest.mark.parametrize(("mesh", "strategy"), [("cp=2,ep=2,tp=2", "ep,megatron,sp,cp"),
                                                ("dp=2,cp=2,tp=2", "dp,megatron,sp,cp")])
def test_etp_tp_backward_gathers_the_moe_output_s_gradient_over_tp_alone(mesh: str, strategy: str) -> None:
    """ETP = tp with one co-shard (no dp, or no ep): the backward gathers the MoE output's
    gradient over tp alone before it goes back into the cp chunks (before: over cp x tp, then
    sliced over cp) and runs the norm's backward on the sequence's co-shard (before: its input,
    inverse rms and the stream's gradient gathered over tp, five gathers); nothing over cp but
    attention's and the counts'."""
    _, plan, _ = plan_model(json.dumps({**MOE, "layers": 1}), mesh, strategy)
    got = _per_layer(plan, "layers.0.")
    gathers = {(k[2], k[3]) for k in got if k[0] == "backward" and k[1] == "all_gather"}
    assert gathers == {("tp", "moe_out.seq.grad"), ("tp", "attn_out.grad")}
    over_cp = {k[3] for k in got if "cp" in k[2].split("x")}
    assert over_cp == {"k_rope", "v4", "k_rope.grad", "v4.grad", "aux.f3"}


def test_run_etp_tp_on_cp_x_ep_x_tp_on_gloo_equals_the_single_process_step() -> None:
    """8 gloo processes (cp=2 x ep=2 x tp=2, megatron + sp, ETP = tp), float32: loss and every
    gradient and update equal the single-process step and the ranks' collectives are the plan's:
    the MoE output's gradient gathered over tp alone, the norm output's gradient sliced onto the
    (cp, tp) co-shard where it is; over cp only attention's, the counts' and the gradients'."""
    rep = run_json("--model-config", json.dumps({**MOE, "layers": 1}), "--mesh", "cp=2,ep=2,tp=2",
                   "--strategy", "ep,megatron,sp,cp")
    assert rep["world_size"] == 8 and rep["backend"] == "gloo"
    assert rep["ok"] and rep["collectives_match"] and not rep["failures"] and rep["nonfinite"] == 0, rep["failures"]
    assert rep["loss"] == pytest.approx(rep["reference_loss"], rel=1e-6)
    coll = rep["collectives"]
    assert {(c["kind"], c["mesh_dim"]) for c in coll if c["tensor"] == "layers.0.moe_out.seq.grad"} == {
        ("all_gather", 2)}
    over_cp = {c["tensor"].removeprefix("layers.0.") for c in coll if c["mesh_dim"] == 0
               and not (c["kind"] == "all_reduce" and c["tensor"].endswith(".grad"))}
    assert over_cp == {"k_rope", "v4", "k_rope.grad", "v4.grad", "aux.f3"}


@pytest.mark.parametrize(("experts", "strategy", "want"), [
    (8, ETP1, {("forward", "all_gather", "tp"): 3, ("forward", "reduce_scatter", "tp"): 2,
               ("forward", "all_to_all", "epxtp"): 1, ("forward", "all_to_all", "tpxep"): 1,
               ("backward", "all_gather", "tp"): 3, ("backward", "all_reduce", "tp"): 1,
               ("backward", "reduce_scatter", "tp"): 1, ("backward", "all_to_all", "epxtp"): 1,
               ("backward", "all_to_all", "tpxep"): 1}),
    (4, ETPTP, {("forward", "all_gather", "tp"): 4, ("forward", "reduce_scatter", "tp"): 2,
                ("forward", "all_reduce", "tp"): 1, ("forward", "all_to_all", "ep"): 2,
                ("backward", "all_gather", "tp"): 4, ("backward", "all_reduce", "tp"): 2,
                ("backward", "reduce_scatter", "tp"): 1, ("backward", "all_to_all", "ep"): 2}),
])
def test_an_imported_moe_model_gathers_nothing_over_cp(experts: int, strategy: str, want: dict[Any, int]) -> None:
    """--hf Mixtral (hidden 32, seq 16, batch 8) on dp=2 x cp=2 x ep=2 x tp=4 (tp > cp: a co-shard
    read as its largest dim is read as tp): over cp only attention's (k, v gathered, their
    gradients reduce-scattered) beside the gradients' all-reduces; before, the imported program
    had the zoo's defect: 9 gathers over cp x tp forward and 13 over cp x tp or cp backward with
    ETP = 1 (8 experts), 6 and 9 with ETP = tp."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = plan_hf("MixtralForCausalLM", {**MIXTRAL, "num_local_experts": experts}, "dp=2,cp=2,ep=2,tp=4",
                       strategy, "float32", 8, 16)[3]
    got: collections.Counter[tuple[str, str, str]] = collections.Counter()
    for (phase, kind, dims, tensor, _), n in collectives(plan, False).items():
        if not (kind == "all_reduce" and tensor.endswith(".grad")):  # the gradients' reductions
            got[(phase, kind, dims)] += n
    assert got == {**want, ("forward", "all_gather", "cp"): 2, ("backward", "reduce_scatter", "cp"): 2}


def test_verify_simulates_an_imported_moe_model_with_dp_cp_ep_tp() -> None:
    """--verify's check of the imported Mixtral on the 32 ranks of dp=2 x cp=2 x ep=2 x tp=4 (ETP
    = tp): simulated rank by rank against the unsharded step."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        v = verify_hf("MixtralForCausalLM", MIXTRAL, "dp=2,cp=2,ep=2,tp=4", ETPTP)
    assert v["ok"] and v["checked"] > 200, v["text"]
