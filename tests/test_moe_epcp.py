"""The expert group carved from context-parallel ranks (``--strategy ...,ep-from=cp``).

Megatron-Core folds its ETP = 1 expert group of EP ranks out of the next EP ranks in tp-cp-dp
order; where tp x dp < EP it takes cp ranks (Qwen3-235B at 128k: tp 4 x cp 8, dp 1, EP 8: the
group is tp 4 x 2 of the cp ranks, EDP = 4). ``ep-from=cp`` plans it: outside the experts ep is
one more cp dim (the sequence over ``(cp, ep)``, ``(cp, ep, tp)`` under sp; ring attention's and
the kv gathers' group cp x ep; the batch over dp alone), the experts over ep x tp (ETP = 1), the
dispatch and the combine one all-to-all over the ep x tp group each, an expert's gradient
reduced over the cp ranks left (EDP), a dense one over cp x ep (docs/experts.md, "The expert
group from cp ranks")."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest

from conftest import run_json
from spmd_helpers import T
from spmdkit.cli.common import mesh_dp
from spmdkit.core.errors import ProgramError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.cost.context import cp_ops, ring_costs
from spmdkit.cost.devices import DEVICES
from spmdkit.engine.registry import get_rule
from spmdkit.planner.fuse import infer_fused
from spmdkit.planner.pipeline import estimate_pipeline
from spmdkit.planner.pipeline_plan import plan_pipeline
from spmdkit.planner.planning import plan_model
from spmdkit.sim.plan import simulate_plan
from spmdkit.sim.verify_plan import tiny_for_mesh
from test_moe_cp import MOE, _grad_steps, _per_layer

ROOT = Path(__file__).resolve().parents[1]
#: a tiny Qwen3-MoE-shaped zoo model (8 experts top-4, no shared expert), one layer, float32:
#: seq 32 over cp x ep x tp = 16 ranks, 2 tokens a rank
QWEN = {"base": "tiny-llama", "experts": 8, "top_k": 4, "moe_ffn": 8, "kv_heads": 4, "seq": 32, "batch": 1,
        "layers": 1}
MESH16 = "cp=2,ep=2,tp=4"
ETP1 = "megatron,sp,ep,etp=1,cp,ep-from=cp,cp-attention=ring"


def test_a_three_dim_co_shard_is_fused_as_nested_pairs() -> None:
    """layer_norm on x [B, (cp, ep, tp), H]: Paddle's rule reads the co-shard as its largest dim;
    asked on the fused mesh (cp x ep, then (cp x ep) x tp) it keeps all three on x, the output,
    the mean and the variance. Before (one level of fusion) the (cp x ep, tp) pair was read as
    its largest dim and the sequence gathered over cp x ep."""
    m = ProcessMesh([2, 2, 4], dim_names=["cp", "ep", "tp"])
    x = T(m, [1, 32, 16], [-1, (0, 1, 2), -1])
    w = T(m, [16], [-1])
    rule = get_rule("layer_norm").infer_forward
    res = infer_fused(rule, [x, w, w, 1e-5, 2], m)
    assert res.inputs[0].dims_mapping == (-1, (0, 1, 2), -1)
    assert res.outputs[0].dims_mapping == (-1, (0, 1, 2), -1)
    assert all(o.dims_mapping == (-1, (0, 1, 2)) for o in res.outputs[1:])


#: the layer's collectives on cp=2 x ep=2 x tp=4 (bytes a rank sends): sp's around attention (a
#: rank's 2 tokens x 16 x 4 B = 128 B of the stream, gathered over tp to 512 B: 3/4 of it sent);
#: the slots [1, 1, 8, 1, 16] (capacity 2 tokens x top-4 / 8 experts = 1; 512 B) sent 7/8 by one
#: all-to-all over the ep x tp group each way, forward and backward; the counts [1, 1, 8] (32 B)
#: all-reduced over the 16 ranks (2 x 15/16 x 32 B). Nothing else: ring attention passes its kv
#: blocks inside the kernel.
QWEN_LAYER = collections.Counter([
    ("forward", "all_gather", "tp", "attn_norm.out", 384),
    ("forward", "reduce_scatter", "tp", "attn_out", 384),
    ("forward", "all_to_all", "tpxep", "dispatch", 448),
    ("forward", "all_to_all", "epxtp", "experts.rows", 448),
    ("forward", "all_reduce", "cpxepxtp", "aux.f3", 60),
    ("backward", "all_gather", "tp", "attn_out.grad", 384),
    ("backward", "all_to_all", "tpxep", "experts.rows.grad", 448),
    ("backward", "all_to_all", "epxtp", "dispatch.grad.sum", 448),
    ("backward", "reduce_scatter", "tp", "attn_norm.out.grad.sum", 384),
])


def test_the_plan_s_collectives_on_16_ranks_by_hand() -> None:
    """Tiny Qwen3-MoE on cp=2 x ep=2 x tp=4, ETP = 1, ring attention, batch 1 (no dp rank): the
    model built for cp x ep = 4 and routed in cp x ep x tp = 16 chunks; the stream [B, (cp, ep,
    tp), H]; the ring over the cp x ep ranks (4 blocks: k [1, 8, 1, 4] float32, 128 B, and its
    positions 64 B); the slots from the chunks (cp, ep, tp) to the experts (tp, ep), cp kept;
    wq's gradient all-reduced once over cp x ep (2 x 3/4 x its [16, 4] tp shard of 256 B), an
    expert stack's over cp alone (EDP = 2: 2 x 1/2 x one whole expert [1, 16, 8], 512 B)."""
    model, plan, _ = plan_model(json.dumps(QWEN), MESH16, ETP1)
    assert model.config.cp == 4 and model.config.moe_chunks == 16
    assert _per_layer(plan, "layers.0.") == QWEN_LAYER
    cp, ep, tp = (plan.mesh.dim_index(d) for d in ("cp", "ep", "tp"))
    assert plan.attrs["layers.0.resid1"].dims_mapping == (-1, (cp, ep, tp), -1)
    assert plan.attrs["layers.0.q"].dims_mapping == (-1, (cp, ep), tp)
    assert plan.attrs["layers.0.dispatch"].dims_mapping == (-1, cp, (tp, ep), -1, -1)
    assert plan.attrs["layers.0.experts.w_up"].dims_mapping == ((tp, ep), -1, -1)
    rings = [(c.dims, c.ranks) for c in cp_ops(plan) if c.ring is not None]
    assert rings == [((cp, ep), 4), ((cp, ep), 4)]  # the forward's and the backward's
    times = [1e-3] * len(plan.program.ops)
    assert sorted((r.phase, r.transfers, r.block_bytes) for r in ring_costs(plan, times)) == [
        ("backward", 4, 2 * 128 + 64 + 2 * 128), ("forward", 3, 2 * 128 + 64)]
    assert _grad_steps(plan, "layers.0.wq") == [("all_reduce", (cp, ep), 384)]
    for w in ("gate", "up", "down"):
        assert _grad_steps(plan, f"layers.0.experts.w_{w}") == [("all_reduce", (cp,), 512)], w


def test_the_batch_is_over_dp_alone() -> None:
    """With a dp dim (dp=2 x cp=2 x ep=2 x tp=2, batch 2: one sequence a dp rank) the batch is
    over dp only and the sequence over (cp, ep, tp); a dense gradient is one all-reduce over dp x
    cp x ep, an expert's over dp x cp (EDP = 4)."""
    _, plan, _ = plan_model(json.dumps({**QWEN, "batch": 2}), "dp=2,cp=2,ep=2,tp=2",
                            "dp,megatron,sp,ep,etp=1,cp,ep-from=cp")
    dp, cp, ep, tp = (plan.mesh.dim_index(d) for d in ("dp", "cp", "ep", "tp"))
    assert plan.attrs["layers.0.resid1"].dims_mapping == (dp, (cp, ep, tp), -1)
    assert plan.attrs["layers.0.dispatch"].dims_mapping == (dp, cp, (tp, ep), -1, -1)
    assert [k for k, _, _ in _grad_steps(plan, "layers.0.wq")] == ["all_reduce"]
    assert [d for _, d, _ in _grad_steps(plan, "layers.0.wq")] == [(dp, cp, ep)]
    assert [d for _, d, _ in _grad_steps(plan, "layers.0.experts.w_up")] == [(dp, cp)]


@pytest.mark.parametrize(("mesh", "strategy"), [
    ("cp=2,ep=2,tp=2", "megatron,sp,ep,etp=1,cp,ep-from=cp"),
    ("cp=2,ep=2,tp=2", "megatron,sp,ep,etp=1,cp,ep-from=cp,cp-attention=ring,zero1"),
    ("dp=2,cp=2,ep=2,tp=2", "dp,megatron,sp,ep,etp=1,cp,ep-from=cp"),
    ("cp=2,ep=2,tp=2", "megatron,sp,ep,cp,ep-from=cp"),
    ("cp=2,ep=2", "ep,cp,ep-from=cp"),
    ("cp=2,ep=4,tp=2", "megatron,sp,ep,etp=1,cp,ep-from=cp,cp-attention=ring"),
])
def test_verify_simulates_the_plans(mesh: str, strategy: str) -> None:
    """--verify's check: the tiny model built for the mesh (ETP = 1 and ETP = tp, with and
    without tp or dp, ring attention and ZeRO-1; its sequence grown for the cp x ep ranks: on
    cp=2 x ep=4 x tp=2 to 32 tokens, 2 x 8 zig-zag pieces x tp), simulated against the unsharded
    step (loss, every gradient, every update)."""
    tiny = tiny_for_mesh(json.dumps({k: v for k, v in MOE.items() if k != "batch"}), mesh, strategy)
    model, plan, _ = plan_model(tiny, mesh, strategy)
    m = plan.mesh
    assert model.config.cp == m.shape[m.dim_index("cp")] * m.shape[m.dim_index("ep")]  # cp x ep
    rep = simulate_plan(plan)
    assert rep.ok and rep.checked > 300, rep.failures[:3]


@pytest.mark.parametrize(("mesh", "strategy", "match"), [
    ("cp=2,ep=2", "ep,ep-from=cp", r"--strategy ep-from=cp: .* needs context parallelism \(cp\)"),
    ("cp=2,ep=2", "cp,ep-from=cp", r"--strategy ep-from=cp: .* needs expert parallelism \(ep\)"),
    ("cp=2,ep=2", "cp,ep,ep-from=tp", r"--strategy ep-from=tp: the ep ranks are carved from dp .* or cp"),
    # the mesh's own dims named (before: "--mesh cp=4", a cp dim the mesh has not)
    ("cp=2,ep=2", "cp,ep,ep-from=cp,cp-attention=alltoall", r"^--mesh cp=2,ep=2 \(ep-from=cp: the sequence over cp x "
     r"ep = 4\): --cp-attention alltoall moves the sequence onto the heads: cp x tp = 4 does not divide the model's 2 "
     r"kv heads$"),
])
def test_refusals(mesh: str, strategy: str, match: str) -> None:
    with pytest.raises(ProgramError, match=match):
        plan_model(json.dumps({**MOE, "layers": 1}), mesh, strategy)


def test_the_model_config_s_cp_refusals_name_the_mesh_given() -> None:
    """The zoo config's own checks (the zig-zag chunks, Gated DeltaNet's refusal) saw cp = cp x ep
    under ep-from=cp and said '--mesh cp=4' of a mesh given as cp=2,ep=2; they now name it as the
    alltoall refusal above does."""
    with pytest.raises(ProgramError, match=r"^--mesh cp=2,ep=2 \(ep-from=cp: the sequence over cp x ep = 4\): the "
                                           r"sequence of 36 tokens does not split into 2 x cp = 8 chunks"):
        plan_model(json.dumps({**MOE, "layers": 1, "seq": 36}), "cp=2,ep=2", "cp,ep,ep-from=cp")
    with pytest.raises(ProgramError, match=r"^--mesh cp=2: the sequence of 34 tokens does not split into 2 x cp = 4 "):
        plan_model(json.dumps({**MOE, "layers": 1, "seq": 34}), "cp=2", "cp")  # cp alone: as before


def test_ep_from_dp_is_the_default() -> None:
    """``ep-from=dp`` adds nothing (the batch over (dp, ep), as without it); with ``ep-from=cp`` a
    catalog model's default batch is one sequence a dp rank (not a dp x ep one). (An imported
    --hf program is planned too: tests/test_hf_moe_epcp.py.)"""
    _, a, _ = plan_model(json.dumps({**MOE, "layers": 1}), "cp=2,ep=2", "cp,ep,ep-from=dp")
    _, b, _ = plan_model(json.dumps({**MOE, "layers": 1}), "cp=2,ep=2", "cp,ep")
    assert a.attrs["layers.0.resid1"].dims_mapping == b.attrs["layers.0.resid1"].dims_mapping == (1, 0, -1)
    assert mesh_dp("cp=4,ep=2,tp=4", "megatron,sp,ep,cp,ep-from=cp") == 1  # a catalog model's default batch
    assert mesh_dp("cp=4,ep=2,tp=4", "megatron,sp,ep,cp") == 2


def test_run_on_cp_x_ep_x_tp_on_gloo_equals_the_single_process_step() -> None:
    """8 gloo processes (cp=2 x ep=2 x tp=2, dp = 1, ETP = 1, ring attention, batch 1), float32:
    loss and every gradient and update equal the single-process step, the ranks' collectives the
    plan's: the ring's kv blocks passed round the cp x ep ranks inside the kernel (the executor
    rang over one mesh dim before: refused), each all-to-all over ep and tp, an expert's gradient
    all-reduced over cp alone, a dense one over cp and ep."""
    rep = run_json("--model-config", json.dumps({**MOE, "layers": 1, "batch": 1}), "--mesh", "cp=2,ep=2,tp=2",
                   "--strategy", "megatron,sp,ep,etp=1,cp,ep-from=cp,cp-attention=ring")
    assert rep["world_size"] == 8 and rep["backend"] == "gloo"
    assert rep["ok"] and rep["collectives_match"] and not rep["failures"] and rep["nonfinite"] == 0, rep["failures"]
    assert rep["loss"] == pytest.approx(rep["reference_loss"], rel=1e-6) and rep["max_rel_error"] < 1e-5
    coll = rep["collectives"]
    a2a = collections.Counter((c["tensor"].removeprefix("layers.0."), c["mesh_dim"]) for c in coll
                              if c["kind"] == "all_to_all")
    assert a2a == {(t, d): 1 for t in ("dispatch", "experts.rows", "experts.rows.grad", "dispatch.grad.sum")
                   for d in (1, 2)}
    assert not [c for c in coll if c["tensor"].startswith(("layers.0.k_rope", "layers.0.v4"))]  # the ring's own
    experts = {(c["tensor"], c["kind"], c["mesh_dim"]) for c in coll if ".experts.w_" in c["tensor"]}
    assert experts == {(f"layers.0.experts.w_{w}.grad", "all_reduce", 0) for w in ("gate", "up", "down")}
    assert {c["mesh_dim"] for c in coll if c["tensor"] == "layers.0.wq.grad"} == {0, 1}


@pytest.mark.parametrize(("mesh", "strategy", "batch", "want"), [
    ("pp=2,cp=2,ep=2,tp=2", "megatron,sp,ep,etp=1,cp,ep-from=cp", 2, (4, 2, 4)),
    ("pp=2,cp=2,ep=2,tp=2", "megatron,sp,ep,cp", 4, (2, 2, 4)),
    ("pp=2,dp=2,cp=2,ep=2,tp=2", "dp,ep,megatron,sp,cp,etp=1", 8, (4, 4, 8)),
])
def test_the_moe_memory_breakdown_reads_its_divisors_from_the_layouts(mesh: str, strategy: str, batch: int,
                                                                      want: tuple[int, int, int]) -> None:
    """The pipeline's MoE memory breakdown names (the ranks the experts are split over, EDP, the
    dense data-parallel ranks) as the plan lays the parameters out: ep x tp under ETP = 1, EDP
    times the cp ranks, the dense group cp x ep with ep-from=cp. Before it read the mesh's ep and
    dp dims alone (2, 1, 2 for the first: each expert stack's elements divided by 2, not 4)."""
    cfg = json.dumps({**QWEN, "layers": 2})
    _, plan, spec, _, _ = plan_pipeline(cfg, mesh, strategy, {"microbatches": 2}, {"batch": batch})
    dev = DEVICES["h100"]
    est = estimate_pipeline(plan, spec, None, dev, (dev.inter.alpha_s, 1 / dev.inter.bytes_per_s), batch * 32, 16)
    assert est.moe is not None and (est.moe.ep, est.moe.edp, est.moe.dense_dp) == want
