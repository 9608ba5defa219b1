"""Context parallelism's cost: the ring's steps overlapped with the block computations, the
exposed part, the causal imbalance without zig-zag (spmdkit.cost.context), hand-computed."""

from __future__ import annotations

import io
from dataclasses import replace

import pytest

from spmdkit.cost.band import error_band
from spmdkit.cost.collectives import time_of
from spmdkit.cost.compute import op_cost
from spmdkit.cost.context import (
    causal_imbalance,
    cp_ops,
    kv_block_bytes,
    rank_blocks,
    ring_buffers,
    ring_cost,
    ring_exposed,
)
from spmdkit.cost.devices import cost_model, load_device, recost
from spmdkit.cost.memory import memory_per_device
from spmdkit.cost.step import estimate_step
from spmdkit.outputs.report import write_estimate
from spmdkit.planner.planning import plan_model, plan_program
from spmdkit.program.ir import ProgramBuilder
from spmdkit.program.plan import Plan
from spmdkit.program.runtime import Runtime


def test_causal_imbalance_by_hand() -> None:
    # contiguous chunks: rank r computes r full blocks and half its diagonal one
    assert rank_blocks(4, balanced=False) == [0.5, 1.5, 2.5, 3.5]
    assert causal_imbalance(4, balanced=False) == pytest.approx(3.5 / 2.0)  # busiest / mean
    assert causal_imbalance(8, balanced=False) == pytest.approx(15 / 8)
    assert causal_imbalance(64, balanced=False) == pytest.approx(2.0, abs=0.02)  # ~2x for a large cp
    # zig-zag: every rank half a block per step; no mask: every rank cp blocks
    assert rank_blocks(4, balanced=True) == [2.0] * 4
    assert causal_imbalance(4, balanced=True) == 1.0
    assert causal_imbalance(4, balanced=False, causal=False) == 1.0
    assert causal_imbalance(1, balanced=False) == 1.0
    # the balanced and unbalanced ranks do the same total work: the causal half of cp^2 blocks
    assert sum(rank_blocks(8, True)) == sum(rank_blocks(8, False)) == 8 * 8 / 2


def test_kv_block_and_ring_exposed() -> None:
    # Llama-3-8B at 131072 tokens over cp=8: b=1, s/cp=16384, 8 kv heads of 128, bf16
    assert kv_block_bytes(1, 16384, 8, 128, 128, 2) == 2 * 16384 * 8 * 128 * 2 == 67_108_864
    # 7 transfers of 2 ms each under steps of 5 ms: hidden; under steps of 1.5 ms: 0.5 ms each
    assert ring_exposed(2e-3, 5e-3, 7) == 0.0
    assert ring_exposed(2e-3, 1.5e-3, 7) == pytest.approx(7 * 0.5e-3)
    assert ring_exposed(2e-3, 5e-3, 7, tail=1) == pytest.approx(2e-3)


def test_ring_cost_forward_and_backward() -> None:
    send = {100: 2e-3, 200: 4e-3}.__getitem__  # seconds of one send/recv by bytes
    fwd = ring_cost(7, False, 4, 100, 200, send, attention_s=4e-3, balanced=True)
    # 4 steps of 1 ms, 3 KV transfers of 2 ms: 1 ms exposed each
    assert (fwd.steps, fwd.transfers, fwd.step_compute_s) == (4, 3, 1e-3)
    assert fwd.comm_s == pytest.approx(6e-3)
    assert fwd.exposed_s == pytest.approx(3e-3)
    bwd = ring_cost(9, True, 4, 100, 200, send, attention_s=40e-3, balanced=True)
    # 3 steps move KV (2 ms) and dK/dV (4 ms) under 10 ms each; the 4th dK/dV returns under nothing
    assert bwd.comm_s == pytest.approx(3 * 6e-3 + 4e-3)
    assert bwd.exposed_s == pytest.approx(4e-3)
    assert bwd.transfers == 4 and bwd.phase == "backward"


# -- a plan's cp attention on the step -------------------------------------------------------------

B, S, H, HK, D, CP = 1, 8192, 8, 2, 64, 4


def _plan(variant: str, balance: str = "zigzag", framework: str = "megatron") -> Plan:
    """cp_attention and its grad alone, q, k, v split on the sequence over cp=4, costed on an H100."""
    b = ProgramBuilder()
    q = b.tensor("q", [B, S, H, D], "bfloat16", "input")
    k = b.tensor("k", [B, S, HK, D], "bfloat16", "input")
    v = b.tensor("v", [B, S, HK, D], "bfloat16", "input")
    qp = b.tensor("qp", [S], "int64", "input")
    kp = b.tensor("kp", [S], "int64", "input")
    pos = {"q_positions": qp, "k_positions": kp}
    out, lse = b.op("cp_attention", {"q": q, "k": k, "v": v, **pos},
                    [("o", [B, S, H, D], "bfloat16"), ("lse", [B, H, S], "float32")], variant=variant, balance=balance)
    b.phase = "backward"
    og = b.tensor("og", [B, S, H, D], "bfloat16", "input")
    b.op("cp_attention_grad", {"q": q, "k": k, "v": v, "out": out, "softmax_lse": lse, **pos, "out_grad": og},
         [("qg", [B, S, H, D], "bfloat16"), ("kg", [B, S, HK, D], "bfloat16"), ("vg", [B, S, HK, D], "bfloat16")],
         variant=variant, balance=balance)
    seq = [-1, 0, -1, -1]
    ann = {"q": seq, "k": seq, "v": seq, "qp": [0], "kp": [0], "og": seq}
    _p, plan = plan_program(b.build(), f"cp={CP}", None, ann)
    plan = recost(plan, cost_model(plan.mesh, H100, None))
    return replace(plan, runtime=Runtime(framework=framework))


H100 = load_device("h100")


def test_ring_on_the_step_by_hand() -> None:
    plan = _plan("ring")
    est = estimate_step(plan, H100)
    fwd, bwd = est.rings
    block = B * (S // CP) * HK * (D + D) * 2 + (S // CP) * 8  # K, V and the key positions of one rank
    assert (fwd.phase, fwd.transfers, fwd.block_bytes) == ("forward", CP - 1, block)
    assert bwd.block_bytes == block + B * (S // CP) * HK * 2 * D * 2  # with dK, dV in bf16 (Transformer Engine)
    send = plan.cost.collective_time("send_recv", (0,), block, plan.mesh.shape)
    assert fwd.step_comm_s == pytest.approx(send)
    # the op's compute is cp steps of one block: a step is a quarter of it
    assert fwd.step_compute_s == pytest.approx(est.timeline[0][4] / CP)
    assert fwd.exposed_s == pytest.approx((CP - 1) * max(0.0, fwd.step_comm_s - fwd.step_compute_s))
    assert est.ring_comm_s == pytest.approx(fwd.comm_s + bwd.comm_s)
    # nothing else communicates: the step is the compute plus the exposed ring
    assert est.step_overlap_s == pytest.approx(est.compute_total_s + est.ring_exposed_s)
    assert est.step_serial_s == pytest.approx(est.compute_total_s + est.ring_comm_s)
    j = est.to_json()
    assert j["ring_attention"]["exposed_s"] == pytest.approx(est.ring_exposed_s)
    assert j["ring_attention"]["comm_s"] == pytest.approx(est.ring_comm_s)
    text = io.StringIO()
    write_estimate(est, text)
    assert f"ring attention over cp={CP}:" in text.getvalue() and "exposed (" in text.getvalue()


def test_ring_flops_are_cp_blocks() -> None:
    # the local shapes are one block; the ring runs cp of them: the causal total over cp ranks
    plan = _plan("ring")
    c = op_cost(plan, 0)
    assert c.flops == pytest.approx(2.0 * B * H * S * S * (2 * D) / 2 / CP)
    assert op_cost(_plan("allgather"), 0).flops == pytest.approx(c.flops)  # local queries x all keys


def test_causal_imbalance_on_the_step() -> None:
    zig = estimate_step(_plan("ring"), H100)
    flat = estimate_step(_plan("ring", "none"), H100)
    assert flat.cp_imbalance == pytest.approx((2 * CP - 1) / CP) and zig.cp_imbalance == 1.0
    assert flat.compute_total_s == pytest.approx(zig.compute_total_s * (2 * CP - 1) / CP)
    assert flat.model_flops_per_device == pytest.approx(zig.model_flops_per_device)  # the model's work is the same
    text = io.StringIO()
    write_estimate(flat, text)
    assert "causal imbalance: without the zig-zag balance the last cp rank computes 1.75 x" in text.getvalue()
    ag = estimate_step(_plan("allgather", "none"), H100)
    assert ag.cp_imbalance == pytest.approx(1.75)


def test_allgather_overlap_by_framework() -> None:
    te = _plan("allgather")
    gathers = sum(r.time_s for r in te.reshards if r.op_index == 0)
    assert gathers > 0 and not estimate_step(te, H100).rings
    est_te = estimate_step(te, H100)
    assert est_te.timeline[0][2] == pytest.approx(gathers)  # Transformer Engine: the all-gather blocks
    est_tt = estimate_step(replace(te, runtime=Runtime(framework="torchtitan")), H100)
    att = est_tt.timeline[0][4]  # torch's flash kernel (its own rate)
    # torch: the K / V after repeat_kv (H / HK = 4 x the plan's) gathered under the local block
    rep = time_of(te.cost, "all_gather", (0,), 4 * 2 * B * S * HK * D * 2, te.mesh.shape)
    assert rep > gathers
    assert 0 < est_tt.timeline[0][2] == pytest.approx(max(0.0, rep - att / CP))


def test_ring_buffers_in_memory() -> None:
    plan = _plan("ring")
    bufs = ring_buffers(plan)
    kv = B * (S // CP) * HK * 2 * D * 2
    assert bufs == {0: 2 * (kv + (S // CP) * 8), 1: 2 * (kv + (S // CP) * 8) + 2 * kv}
    tt = ring_buffers(replace(plan, runtime=Runtime(framework="torchtitan")))
    assert tt[1] - tt[0] == 2 * 2 * kv  # torch accumulates dK / dV in fp32
    # the activations per rank: a 1/cp shard of the sequence (q, o, og), plus the buffers
    m = memory_per_device(plan)
    assert m.activation_peak >= bufs[1]


def test_ulysses_plan_is_a_cp_plan_of_its_degree() -> None:
    """--cp-attention alltoall (DeepSpeed-Ulysses) runs the attention on the heads, q read whole on
    its sequence; its cp degree is the ranks the sequence came split over (q before its all-to-all),
    so the step says cp 4 and takes the cp runs' error band as the ring and allgather plans do (it
    said cp 1 and gave the H100 band of the runs without cp). The costs do not move: alltoall has no
    ring and no causal imbalance."""
    dev = load_device("h100")
    _, plan, _ = plan_model("llama-7b", "dp=2,cp=4", "dp,cp,cp-attention=alltoall",
                            {"layers": 1, "seq": 1024, "batch": 2})
    ops = [c for c in cp_ops(plan) if c.variant == "alltoall"]
    assert len(ops) == 2 and {c.ranks for c in ops} == {4} and {c.dims for c in ops} == {(1,)}
    est = estimate_step(recost(plan, cost_model(plan.mesh, dev)), dev, 2 * 1024)
    assert est.cp == 4 and est.cp_imbalance == 1.0
    assert est.to_json()["error_band"] == error_band(dev.name, cp=True).to_json()  # type: ignore[union-attr]
    assert error_band(dev.name, cp=True) != error_band(dev.name)
