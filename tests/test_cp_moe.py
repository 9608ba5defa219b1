"""The MoE load-balancing loss under context parallelism, as Megatron-Core computes it.

Megatron-Core (``router.py`` ``_apply_aux_loss`` / ``_apply_seq_aux_loss``,
``moe_utils.switch_load_balancing_loss_func``): the routed-token counts ``tokens_per_expert``
(no gradient) are all-reduced over the tp x cp group; the router probabilities are summed over
the tokens the rank holds only, so each rank's loss is its share and no activation moves for it.
spmdkit's cp model computes each token's share ``sum_i f_i p_si`` (zoo_moe): the counts are the
dispatch's (which holds the sequence's routing), the probabilities stay on the rank's tokens and
the shares sit beside the token losses on a new axis (before: ``P`` all-reduced over cp per layer
and the token losses all-gathered for the loss's concat). Since each cp rank routes its own chunk
(tests/test_moe_cp.py) the counts are the chunks' summed: one all-reduce of ``[B, E]`` over cp."""

from __future__ import annotations

import collections
import json
from typing import Any

import pytest

from conftest import run_json
from spmdkit.planner.planning import plan_model
from spmdkit.sim.plan import simulate_plan

MOE = json.dumps({"base": "tiny-llama", "experts": 4, "top_k": 2, "moe_ffn": 8, "batch": 4})


def _issued(plan: Any) -> collections.Counter[tuple[str, str, str]]:
    """(op, kind, mesh dims) of every collective issued outside the optimizer."""
    names = plan.mesh.dim_names
    out: collections.Counter[tuple[str, str, str]] = collections.Counter()
    for r in plan.reshards:
        op = plan.program.ops[r.op_index]
        if op.phase == "optimizer" or r.shared:
            continue
        for s in r.plan.steps:
            if s.kind != "slice" and s.bytes_per_rank:
                out[(op.name.split(".", 2)[-1] if op.name.startswith("layers.") else op.name, s.kind,
                     "x".join(names[d] for d in s.mesh_dims))] += 1
    return out


@pytest.mark.parametrize(("mesh", "strategy"), [("dp=2,cp=2", "dp,cp"), ("cp=2,tp=2", "megatron,sp,cp")])
def test_the_aux_loss_reduces_only_the_counts_under_cp(mesh: str, strategy: str) -> None:
    """Each cp rank routes its own chunk (tests/test_moe_cp.py): the sequence's counts are the
    chunks' summed, one all-reduce of [B, E] over cp a MoE layer (Megatron's all-reduce of
    tokens_per_expert); nothing else of the aux loss moves."""
    _, plan, _ = plan_model(MOE, mesh, strategy)
    prog = plan.program
    assert prog.tensors["layers.0.aux"].shape == (4, 8, 1) and prog.tensors["loss.terms"].shape == (4, 8, 3)
    assert prog.tensors["layers.0.aux.chunks"].shape == (4, 2, 4, 1)  # each token's share, on the cp chunks
    issued = _issued(plan)
    aux = {k: n for k, n in issued.items() if "aux" in k[0] or k[0] in ("loss.terms", "loss")}
    assert aux == {("aux.f3", "all_reduce", "cp"): 2}, issued
    # the token losses and each layer's shares stay on the sequence the rank holds
    assert plan.attrs["loss.terms"].dims_mapping[1] == plan.attrs["layers.0.aux"].dims_mapping[1] != -1
    rep = simulate_plan(plan)
    assert rep.ok and rep.checked > 300, rep.failures[:3]


def test_without_cp_the_aux_loss_is_per_sequence_as_before() -> None:
    _, plan, _ = plan_model(MOE, "dp=2,ep=2", "dp,ep")
    assert plan.program.tensors["layers.0.aux"].shape == (4, 1)
    assert plan.program.tensors["loss.terms"].shape == (4, 8 + 2)


def test_moe_with_cp_on_gloo_equals_the_single_process_step() -> None:
    rep = run_json("--model-config", MOE, "--mesh", "dp=2,cp=2", "--strategy", "dp,cp", "--kernels", "numpy")
    assert rep["world_size"] == 4 and rep["ok"] and rep["collectives_match"] and not rep["failures"]
    assert rep["loss"] == pytest.approx(rep["reference_loss"], rel=1e-12)
