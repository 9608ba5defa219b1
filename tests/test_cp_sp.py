"""Context parallelism with Megatron's sequence parallelism (``--strategy megatron,sp,cp``): the
residual stream is co-sharded ``(cp, tp)`` on its sequence axis, and an op whose tensors hold the
co-shard is asked its rule on the mesh with cp and tp fused (planner/fuse.py), or with tp
gathered where a tensor-parallel weight holds tp (the vocab-parallel embedding's grad). Whatever
the sizes (tp > cp, tp = cp, tp < cp) the plan moves no sequence over cp outside attention: the
same collectives as Megatron's sequence parallelism, the simulator and gloo equal to the
unsharded step."""

from __future__ import annotations

import collections
import json
from typing import Any

import pytest

from conftest import run_json
from spmd_helpers import T
from spmdkit.core.dist_attr import ReduceType
from spmdkit.core.mesh import ProcessMesh
from spmdkit.engine.registry import get_rule
from spmdkit.planner.fuse import infer_fused
from spmdkit.planner.planning import plan_model
from spmdkit.sim.plan import simulate_plan

#: tiny Llama whose 8 heads and 8 kv heads split over tp = 4 and whose 16 tokens split into 2 x cp x tp
CFG = json.dumps({"base": "tiny-llama", "heads": 8, "kv_heads": 8, "hidden": 32, "seq": 16})


def _collectives(plan: Any) -> collections.Counter[tuple[str, str, str]]:
    """(kind, mesh dims, where) of every reshard step issued: where is attention (the
    cp_attention ops), the optimizer or the rest."""
    names = plan.mesh.dim_names
    out: collections.Counter[tuple[str, str, str]] = collections.Counter()
    for r in plan.reshards:
        op = plan.program.ops[r.op_index]
        where = "attention" if op.rule.startswith("cp_attention") else op.phase if op.phase == "optimizer" else "rest"
        for s in r.plan.steps:
            if s.kind != "slice" and not r.shared and s.bytes_per_rank:
                out[(s.kind, "x".join(names[d] for d in s.mesh_dims), where)] += 1
    return out


#: two layers: per layer attention's k and v gathered over cp and their grads reduce-scattered;
#: Megatron's sequence parallelism over tp (the embedding, each attention and MLP output
#: reduce-scattered, each norm's output all-gathered, and their backward twins: 5 + 5 each way);
#: the 16 replicated parameters' gradients all-reduced over cp, the 5 norms' (their input on the
#: (cp, tp) co-shard) over cp x tp
WANT = {("all_gather", "cp", "attention"): 4, ("reduce_scatter", "cp", "attention"): 4,
        ("reduce_scatter", "tp", "rest"): 10, ("all_gather", "tp", "rest"): 10,
        ("all_reduce", "cp", "optimizer"): 16, ("all_reduce", "cpxtp", "optimizer"): 5}


@pytest.mark.parametrize("mesh", ["dp=1,cp=2,tp=4", "dp=1,cp=2,tp=2", "dp=1,cp=4,tp=2"],
                         ids=["tp>cp", "tp=cp", "tp<cp"])
def test_sp_and_cp_move_no_sequence_over_cp_outside_attention(mesh: str) -> None:
    _, plan, _ = plan_model(CFG, mesh, "megatron,sp,cp")
    assert _collectives(plan) == WANT
    assert plan.attrs["layers.0.resid1"].dims_mapping == (0, (1, 2), -1)
    rep = simulate_plan(plan)
    assert rep.ok and rep.checked > 200, rep.failures[:3]


def test_an_add_of_the_co_shard_and_a_row_parallel_output_reduce_scatters_onto_the_co_shard() -> None:
    """The residual add: x on (cp, tp), y (the row-parallel projection) on cp and partial over
    tp. Asked on the real mesh the rule reads the co-shard as tp (the larger) and the sequence
    goes over tp alone (x gathered over cp); asked on the fused mesh, y is reduce-scattered onto
    (cp, tp) and nothing moves over cp."""
    m = ProcessMesh([2, 4], dim_names=["cp", "tp"])
    x = T(m, [2, 16, 8], [-1, (0, 1), -1])
    y = T(m, [2, 16, 8], [-1, 0, -1], partial={1: ReduceType.SUM})
    rule = get_rule("add").infer_forward
    assert rule(x, y).outputs[0].dims_mapping == (-1, 1, -1)  # Paddle's rule, unchanged
    res = infer_fused(rule, [x, y], m)
    assert [a.dims_mapping for a in res.inputs] == [(-1, (0, 1), -1)] * 2
    assert res.outputs[0].dims_mapping == (-1, (0, 1), -1) and not res.outputs[0].partial


def test_gloo_run_with_tp_over_cp_equals_the_single_process_step() -> None:
    """8 gloo processes (cp=2, tp=4): loss, every gradient and update equal the single-process
    step; the ranks issued the plan's collectives (no cp gather outside attention)."""
    rep = run_json("--model", "tiny-llama", "--mesh", "cp=2,tp=4", "--strategy", "megatron,sp,cp", "--kernels", "numpy")
    assert rep["world_size"] == 8 and rep["ok"] and rep["collectives_match"] and not rep["failures"]
    assert rep["loss"] == pytest.approx(rep["reference_loss"], rel=1e-12)
    cp_moves = collections.Counter(c["kind"] for c in rep["collectives"] if c["mesh_dim"] == 0 and c["kind"] != "all_reduce")
    assert cp_moves == {"all_gather": 4, "reduce_scatter": 4}  # attention's k and v, their grads
