"""Imported (``--hf``) MoE models with the expert group carved from context-parallel ranks
(``--strategy ...,cp,ep,ep-from=cp``; docs/experts.md "The expert group from cp ranks").

The import is traced for the cp x ep ranks (:func:`spmdkit.strategies.context.hf_cp`): the call's
tokens in the zig-zag order of ``cp x ep`` ranks, each MoE block routed in ``cp x ep`` chunks
(``cp x ep x tp`` under ``megatron,sp,ep,etp=1``), one a rank. Outside the experts ep is one more
cp dim (the call's sequence over ``(cp, ep)``, the batch over dp alone, attention's kv gathered
over cp x ep), the dispatch moves ep (and tp) onto the experts with cp kept, an expert's gradient
reduces over dp x cp (EDP), a dense one over every rank. Tiny Mixtral / Qwen3-MoE (hidden 32, 4
experts top-2, float32); --verify's simulation of six ep-from=cp meshes is in
tests/test_hf_moe_cp.py."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from conftest import run_json
from hf_moe_helpers import MIXTRAL, collectives, cp_moe_rows, equals_eager
from spmdkit.core.errors import ProgramError
from spmdkit.planner.planning import plan_hf
from spmdkit.strategies.context import hf_cp
from spmdkit.strategies.strategy import parse_mesh

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def test_the_import_is_traced_for_the_cp_x_ep_ranks() -> None:
    """hf_cp: cp x ep ranks with ep-from=cp (cp alone without it); the dispatch [B, 4, E, C, H]
    of a cp=2 x ep=2 mesh at seq 16 (4 chunks of 4 tokens, capacity 2), 8 chunks under etp=1 on
    tp=2. Before: the import was traced for cp=2 and the plan refused by name."""
    mesh = parse_mesh("cp=2,ep=2,tp=2")
    assert hf_cp(mesh, ("cp", "ep", "ep-from=cp")) == (4, "allgather", "zigzag")
    assert hf_cp(mesh, ("cp", "ep")) == (2, "allgather", "zigzag")
    _p, _m, _kw, plan = plan_hf("MixtralForCausalLM", MIXTRAL, "cp=2,ep=2", "cp,ep,ep-from=cp", "float32", 2, 16)
    d = next(op for op in plan.program.ops if op.rule == "moe_gate_dispatch")
    assert plan.program.tensors[d.outputs[0]].shape == (2, 4, 4, 2, 32)
    _p, _m, _kw, plan = plan_hf("MixtralForCausalLM", MIXTRAL, "cp=2,ep=2,tp=2", "megatron,sp,cp,ep,etp=1,ep-from=cp",
                                "float32", 2, 16)
    d = next(op for op in plan.program.ops if op.rule == "moe_gate_dispatch")
    assert plan.program.tensors[d.outputs[0]].shape[:2] == (2, 8)


@pytest.mark.parametrize("mesh", ["cp=2,ep=2", "dp=2,cp=2,ep=2"])
def test_collectives_by_hand(mesh: str) -> None:
    """Batch 2 a dp rank (over dp alone, not dp x ep), seq 16, 1 layer: each rank holds 4 tokens
    of each sequence (cp x ep = 4), routed as its own chunk (capacity ceil(4 x 2 / 4) = 2): the
    dispatch and the rows one all-to-all each over ep ([2, 1, 4, 2, 32] float32 = 2 KiB, half
    sent); attention's k and v gathered over cp x ep (a rank's [2, 4, 2, 8] of 512 B, 3/4 of the
    gathered 2 KiB sent) and reduce-scattered back; the loss' two scalars over every rank. An
    expert's gradient all-reduced over dp x cp (EDP), a dense one over every rank."""
    dp = 2 if mesh.startswith("dp") else 1
    strategy = ",".join(d.split("=")[0] for d in mesh.split(",")) + ",ep-from=cp"
    _p, _m, _kw, plan = plan_hf("MixtralForCausalLM", MIXTRAL, mesh, strategy, "float32", 2 * dp, 16)
    names = plan.mesh.dim_names
    every = "x".join(names)
    n = plan.mesh.size
    a2a = 2 * 1 * 4 * 2 * 32 * 4 // 2
    kv = 2 * 16 * 2 * 8 * 4 * 3 // 4
    got = collectives(plan)
    assert {k: v for k, v in got.items() if k[0] != "optimizer"} == cp_moe_rows("cpxep", every, kv, a2a, n)
    grads = {k[3]: k[2] for k in got if k[0] == "optimizer"}
    assert {g: d for g, d in grads.items() if ".experts." in g} == {
        f"model.layers.0.mlp.experts.{w}.grad": "dpxcp" if dp == 2 else "cp"
        for w in ("gate_up_proj_gate", "gate_up_proj_up", "down_proj_t")}
    assert {d for g, d in grads.items() if ".experts." not in g} == {every}
    seq = (names.index("cp"), names.index("ep"))
    assert plan.attrs["input_ids"].dims_mapping == (0 if dp == 2 else -1, seq)


def test_etp1_groups_on_dp_cp_ep_tp() -> None:
    """dp=2 x cp=2 x ep=2 x tp=2, megatron,sp,ep,etp=1: the stream [B, S, H] over (dp, (cp, ep,
    tp)), the chunks [B, 8, 2, H] over (cp, ep, tp), the dispatch [B, 8, E, C, H] to the experts
    (tp, ep) with cp kept, each expert stack whole over (tp, ep); the all-to-alls over the ep x tp
    group, an expert's gradient over dp x cp, a projection's over dp x cp x ep, a norm's over every
    rank (the zoo's layout, tests/test_moe_epcp.py)."""
    _p, _m, _kw, plan = plan_hf("MixtralForCausalLM", MIXTRAL, "dp=2,cp=2,ep=2,tp=2",
                                "dp,cp,ep,megatron,sp,etp=1,ep-from=cp", "float32", 4, 16)
    dp, cp, ep, tp = 0, 1, 2, 3
    a = plan.attrs
    assert a["moe_experts"].dims_mapping == (dp, (cp, ep, tp), -1)
    assert a["moe_route.tokens"].dims_mapping == (dp, (cp, ep, tp), -1, -1)
    assert a["moe_experts.dispatch"].dims_mapping == (dp, cp, (tp, ep), -1, -1)
    assert a["model.layers.0.mlp.experts.down_proj_t"].dims_mapping == ((tp, ep), -1, -1)
    got = collectives(plan)
    assert sorted({(k[1], k[2]) for k in got if k[3].startswith("moe_experts")}) == [
        ("all_to_all", "epxtp"), ("all_to_all", "tpxep")]

    def groups(g: str) -> set[str]:
        return {k[2] for k in got if k[0] == "optimizer" and k[3] == g}

    assert groups("model.layers.0.mlp.experts.down_proj_t.grad") == {"dpxcp"}
    assert groups("model.layers.0.self_attn.q_proj.weight.grad") == {"dpxcpxep"}
    # a replicated norm's over all four dims, as two all-reduces (as without ep-from=cp)
    assert groups("model.layers.0.input_layernorm.weight.grad") == {"dpxcpxep", "tp"}


def test_a_sequence_the_cp_x_ep_ranks_do_not_split_is_refused() -> None:
    """seq 8 on cp=2 x ep=4: 8 tokens cannot make 2 x 8 zig-zag chunks; the message names the
    mesh's cp and ep (before the fix of the message: ``--mesh cp=8``, a dim the mesh has not)."""
    with pytest.raises(ProgramError, match=r"^--mesh cp=2,ep=4 with --strategy ep-from=cp: the sequence of 8 tokens "
                                           r"does not split into 2 x cp x ep = 16 chunks"):
        plan_hf("MixtralForCausalLM", MIXTRAL, "cp=2,ep=4", "cp,ep,ep-from=cp", "float32", 2, 8)


def test_run_on_gloo_equals_torch_eager() -> None:
    """4 gloo processes (cp=2 x ep=2, ep carved from cp), 2 layers, batch 1, seq 8, dropless:
    every tensor equal to its op run unsharded, the loss and every parameter gradient equal to
    torch eager's step on the tokens in natural order; each all-to-all over ep, an expert's
    gradient all-reduced over cp alone, a dense one over cp and ep."""
    rep = run_json("--hf", "MixtralForCausalLM", "--hf-config", json.dumps({**MIXTRAL, "num_hidden_layers": 2}),
                   "--mesh", "cp=2,ep=2", "--strategy", "cp,ep,ep-from=cp", "--seq", "8", "--batch", "1")
    equals_eager(rep, 4)
    coll = rep["collectives"]
    assert {(c["kind"], c["mesh_dim"]) for c in coll if c["tensor"].startswith("moe_experts")} == {("all_to_all", 1)}
    assert {c["mesh_dim"] for c in coll if c["tensor"] == "model.layers.1.mlp.experts.down_proj_t.grad"} == {0}
    assert {c["mesh_dim"] for c in coll if c["tensor"] == "model.layers.1.self_attn.q_proj.weight.grad"} == {0, 1}
