"""torchao's float8 tensor parallelism (``spmdkit.cost.float8_tp``): under torchtitan with float8
linears, ``PrepareFloat8ModuleInput`` casts a block's sequence-sharded input to float8 before its
TP all-gather, and ``Float8RowwiseParallel`` casts the output gradient to e5m2 on its shard before
the backward's all-gather (``torchao/float8/float8_tensor_parallel.py`` at eab345c / 6243040):
those all-gathers move 1 byte an element. Bytes by hand."""

from __future__ import annotations

from dataclasses import replace

import pytest

from spmdkit.cost.collectives import time_of
from spmdkit.cost.devices import DEVICES, cost_model, recost
from spmdkit.cost.float8_tp import AMAX_BYTES, amax_all_reduces, float8_gather_s, float8_step, float8_tp_gathers
from spmdkit.cost.step_comm import communication
from spmdkit.cost.step_compute import step_compute
from spmdkit.planner.planning import plan_model
from spmdkit.program.plan import Plan
from spmdkit.program.runtime import Runtime

H100 = DEVICES["h100"]
TP, SEQ, HIDDEN = 4, 2048, 4096  # llama-7b: hidden 4096


def _plan(rt: Runtime) -> Plan:
    _, plan, _ = plan_model("llama-7b", f"tp={TP}", "megatron,sp", {"layers": 1, "seq": SEQ, "batch": 1})
    return replace(recost(plan, cost_model(plan.mesh, H100)), runtime=rt)


FP8 = Runtime(framework="torchtitan", precision="fp8")


def test_which_all_gathers_move_float8() -> None:
    # forward: the two norms' outputs, gathered once for q / k / v and once for gate / up; backward:
    # the output gradients of o and down (the reduce-scatters' backward). Not the final norm's output,
    # gathered for the bf16 output head, nor any reduce-scatter's tensor
    assert float8_tp_gathers(_plan(FP8)) == {"layers.0.attn_norm.out", "layers.0.mlp_norm.out",
                                             "layers.0.attn_out.grad", "layers.0.mlp_out.grad"}
    # bf16, and Megatron / Transformer Engine's fp8 (TE all-gathers bf16 inputs): none
    assert float8_tp_gathers(_plan(Runtime(framework="torchtitan"))) == frozenset()
    assert float8_tp_gathers(_plan(Runtime(framework="megatron", precision="fp8"))) == frozenset()


def test_the_all_gather_bytes_by_hand() -> None:
    plan = _plan(FP8)
    r = next(r for r in plan.reshards if r.tensor == "layers.0.attn_norm.out")
    s = next(s for s in r.plan.steps if s.kind == "all_gather")
    full = SEQ * HIDDEN  # the gathered (1, 2048, 4096) tensor's elements
    assert s.bytes_per_rank == (TP - 1) * full * 2 // TP  # bf16 as planned: 12,582,912
    f = float8_step(plan, r.tensor, s)
    assert f.bytes_per_rank == (TP - 1) * full // TP == 6_291_456
    assert f.time_s == pytest.approx(time_of(plan.cost, "all_gather", (0,), full, plan.mesh.shape))
    assert f.time_s < s.time_s
    ix = plan.reshards.index(r)
    assert float8_gather_s(plan, ix) == pytest.approx(f.time_s)  # the backward's re-gather alike
    # a reduce-scatter (the matmul's bf16 output) is unchanged
    rs = next(r for r in plan.reshards if r.tensor == "layers.0.attn_out")
    assert all(float8_step(plan, rs.tensor, x) is x for x in rs.plan.steps)


def test_the_step_waits_on_the_float8_all_gathers() -> None:
    def blocking(rt: Runtime) -> dict[str, float]:
        plan = _plan(rt)
        comm = communication(plan, step_compute(plan, H100), H100)
        return {f"{plan.program.ops[i].phase}:{plan.program.ops[i].name}": t for i, t in comm.blocking.items()}

    te, ao = blocking(Runtime(framework="megatron", precision="fp8")), blocking(FP8)
    plan = _plan(FP8)
    bf16 = time_of(plan.cost, "all_gather", (0,), SEQ * HIDDEN * 2, plan.mesh.shape)
    f8 = time_of(plan.cost, "all_gather", (0,), SEQ * HIDDEN, plan.mesh.shape)
    amax = time_of(plan.cost, "all_reduce", (0,), 4, plan.mesh.shape)
    for k in ("forward:layers.0.attn_norm.out", "forward:layers.0.mlp_norm.out"):  # the cast's amax, then the gather
        assert te[k] == pytest.approx(bf16) and ao[k] == pytest.approx(f8 + amax)
    for k in ("backward:grad of layers.0.resid1", "backward:grad of layers.0.resid2"):  # cast at the GEMM's grad
        assert te[k] == pytest.approx(bf16) and ao[k] == pytest.approx(f8)
    # the final norm's gather for the bf16 head, and the backward's reduce-scatters: as under bf16
    for k in ("forward:final_norm.out", "backward:grad of layers.0.attn_norm.out"):
        assert ao[k] == pytest.approx(te[k]) and ao[k] > 0
    # each float8 GEMM's grad waits on its output gradient's amax all-reduce (no collective there before)
    for k in ("backward:grad of layers.0.q", "backward:grad of layers.0.mlp_out"):
        assert k not in te and ao[k] == pytest.approx(amax)


def test_one_amax_all_reduce_a_sharded_cast() -> None:
    plan = _plan(FP8)
    got = amax_all_reduces(plan)
    name = {i: f"{plan.program.ops[i].phase}:{plan.program.ops[i].name}" for i in got}
    # forward: the two block inputs cast before their gathers (once each, not once per q / k / v), wo's
    # and w2's inputs cast on their shards; backward: each of the 7 linears' output gradient
    assert sorted(name.values()) == sorted(
        ["forward:layers.0.attn_norm.out", "forward:layers.0.mlp_norm.out", "forward:layers.0.attn_out",
         "forward:layers.0.mlp_out"] + [f"backward:grad of layers.0.{n}" for n in ("q", "k", "v", "attn_out", "gate",
                                                                                    "up", "mlp_out")])
    one = time_of(plan.cost, "all_reduce", (0,), AMAX_BYTES, plan.mesh.shape)  # one fp32 scalar over tp = 4
    assert AMAX_BYTES == 4 and all(t == pytest.approx(one) for t in got.values())
    assert amax_all_reduces(_plan(Runtime(framework="torchtitan"))) == {}
    assert amax_all_reduces(_plan(Runtime(framework="megatron", precision="fp8"))) == {}
