"""torch's context_parallel as torchtitan runs an allgather cp attention
(spmdkit.cost.context_torch): K / V after repeat_kv, all-gathered under the local block, the
backward's fp32 dK / dV ring, the fp32 merges; hand-computed from the shapes."""

from __future__ import annotations

import io
from dataclasses import replace

import pytest
from tests.test_cp_cost import CP, H100, HK, B, D, H, S, _plan

from spmdkit.cost import context_shared
from spmdkit.cost.collectives import time_of
from spmdkit.cost.compute import op_cost
from spmdkit.cost.context import ring_exposed
from spmdkit.cost.context_torch import local_qkv, torch_cp_costs, torch_cp_exposed
from spmdkit.cost.devices import cost_model, preset_device, recost
from spmdkit.cost.memory_cp import shared_gathers
from spmdkit.cost.memory_saved import rerun_points, saved_activations
from spmdkit.cost.step import estimate_step
from spmdkit.outputs.report import write_estimate
from spmdkit.planner.planning import plan_model
from spmdkit.planner.search_floor import per_device_work
from spmdkit.planner.stage_costs import stage_costs
from spmdkit.program.runtime import Runtime


def test_the_walk_of_the_two_streams_by_hand() -> None:
    # forward: the all-gather under step 0 only
    assert torch_cp_exposed(3e-3, 0.0, 1e-3, 4, backward=False) == pytest.approx(2e-3)
    assert torch_cp_exposed(0.5e-3, 0.0, 1e-3, 4, backward=False) == 0.0
    # backward, gather hidden: each dK / dV send (2 ms) under the next step (1 ms), the last under none
    assert torch_cp_exposed(0.5e-3, 2e-3, 1e-3, 4, backward=True) == pytest.approx(3 * 1e-3 + 2e-3)
    assert torch_cp_exposed(0.5e-3, 2e-3, 1e-3, 4, True) == pytest.approx(ring_exposed(2e-3, 1e-3, 3, tail=1))
    # a slow gather delays step 1 and queues the first send behind it on the one stream
    assert torch_cp_exposed(3e-3, 2e-3, 1e-3, 4, backward=True) == pytest.approx(2e-3 + 3 * 1e-3 + 2e-3)
    # sends shorter than a step: only the last one shows
    assert torch_cp_exposed(0.5e-3, 0.4e-3, 1e-3, 4, backward=True) == pytest.approx(0.4e-3)
    assert torch_cp_exposed(3e-3, 2e-3, 1e-3, 1, backward=True) == 0.0


def test_compiled_ring_waits_where_it_issues_by_hand() -> None:
    # --compile: traced, funcol's _maybe_wrap_tensor calls wait_tensor at once and Inductor leaves
    # it there (reorder_for_compute_comm_overlap is off): nothing of the ring overlaps a step
    assert torch_cp_exposed(0.5e-3, 0.0, 1e-3, 4, backward=False) == 0.0  # eager: under step 0
    assert torch_cp_exposed(0.5e-3, 0.0, 1e-3, 4, backward=False, traced=True) == pytest.approx(0.5e-3)
    assert torch_cp_exposed(0.5e-3, 0.4e-3, 1e-3, 4, backward=True) == pytest.approx(0.4e-3)  # eager
    assert torch_cp_exposed(0.5e-3, 0.4e-3, 1e-3, 4, backward=True, traced=True) == pytest.approx(2.1e-3)
    assert torch_cp_exposed(3e-3, 2e-3, 1e-3, 1, backward=True, traced=True) == 0.0  # no ring
    # on the step of a plan under --compile: each op waits on all of its communication
    tt = replace(_plan("allgather"), runtime=Runtime(framework="torchtitan", compile=True))
    est = estimate_step(tt, H100)
    local = S // CP
    g = time_of(tt.cost, "all_gather", (0,), CP * 2 * B * local * H * D * 2, tt.mesh.shape)
    d = time_of(tt.cost, "send_recv", (0,), 2 * B * local * H * D * 4, tt.mesh.shape)
    assert est.timeline[0][2] == pytest.approx(g)
    assert est.timeline[1][2] == pytest.approx(g + CP * d)
    j = est.to_json()["torch_context_parallel"]
    assert j["forward"]["exposed_s"] == pytest.approx(g) and j["backward"]["exposed_s"] == pytest.approx(g + CP * d)


def test_repeated_kv_gather_and_dkv_ring_by_hand() -> None:
    te = _plan("allgather")
    tt = replace(te, runtime=Runtime(framework="torchtitan"))
    local = S // CP
    x = local_qkv(tt, 0)
    assert (x.q, x.kv, x.rep, x.itemsize) == (B * local * H * D, 2 * B * local * HK * D, H // HK, 2)
    est = estimate_step(tt, H100)
    costs = torch_cp_costs(tt, [est.timeline[0][4], est.timeline[1][4]])
    fwd, bwd = costs[0], costs[1]
    # torchtitan's repeat_kv: the gathered K and V carry the query heads (H = 8, not HK = 2)
    gathered = CP * 2 * B * local * H * D * 2
    assert fwd.gather_bytes == bwd.gather_bytes == gathered == 4 * sum(
        r.plan.steps[0].bytes_per_rank * CP // (CP - 1) for r in te.reshards
        if r.op_index == 0 and r.tensor in ("k", "v"))  # the plan's: the un-repeated heads
    g = time_of(tt.cost, "all_gather", (0,), gathered, tt.mesh.shape)
    assert fwd.gather_s == pytest.approx(g) and fwd.dkv_bytes == 0
    # the backward: cp sends of the fp32 dK and dV (torch.cat of both, convert_to_f32), not a reduce-scatter
    dkv = 2 * B * local * H * D * 4
    assert bwd.dkv_bytes == dkv
    d = time_of(tt.cost, "send_recv", (0,), dkv, tt.mesh.shape)
    assert bwd.dkv_s == pytest.approx(d) and bwd.comm_s == pytest.approx(g + CP * d)
    # on the step: the plan's un-repeated gathers and reduce-scatters replaced by these
    assert est.comm_s["forward"] == pytest.approx(g)
    assert est.comm_s["backward"] == pytest.approx(g + CP * d)
    assert est.timeline[0][2] == pytest.approx(torch_cp_exposed(g, 0.0, est.timeline[0][4] / CP, CP, False))
    assert 0 < est.timeline[1][2] == pytest.approx(torch_cp_exposed(g, d, est.timeline[1][4] / CP, CP, True))
    # reported: --json and the report's line
    j = est.to_json()["torch_context_parallel"]
    assert j["ops"] == 2 and j["backward"]["dkv_bytes"] == dkv and j["forward"]["gather_bytes"] == gathered
    text = io.StringIO()
    write_estimate(est, text)
    assert f"torch context_parallel over cp={CP}: K and V after repeat_kv (x4) all-gathered, 16.00 MiB" \
        in text.getvalue() and f"the backward's fp32 dK / dV ring: {CP} sends of 8.00 MiB" in text.getvalue()
    # Transformer Engine's: the plan's reshards, blocking
    est_te = estimate_step(te, H100)
    assert est_te.to_json()["torch_context_parallel"] is None
    assert est_te.comm_s["backward"] == pytest.approx(sum(r.plan.time_s for r in te.reshards if r.op_index == 1))


def test_merges_by_hand() -> None:
    # 2,048 tokens a rank: Q = 2048 x 8 x 64 elements, K + V = 2048 x 2 x 64 x 2, repeated 4 x; bf16
    # (2 bytes), the accumulators fp32 (4); the last rank: 3 full-query steps after the first
    te = _plan("allgather")
    tt = replace(te, runtime=Runtime(framework="torchtitan"))
    q, kv, kvr = 2048 * 8 * 64, 2048 * 2 * 64 * 2, 4 * 2048 * 2 * 64 * 2
    fwd = ((kv + kvr) * 2  # repeat_kv
           + 2 * kvr * 2  # key / value .contiguous()
           + 3 * 2 * kvr * 2  # torch.cat([key, value]) at steps 0..2
           + 2 * q * 6  # out.to(fp32) at step 0, the result .to(bf16)
           + 3 * (q * 6 + 8 * q * 4))  # each later step: the cast, 3 unfused fp32 passes (8 accesses)
    bwd = ((kvr + kv) * 2  # repeat_kv's backward
           + (q + kvr) * 4  # zeros_like(fp32) of dQ, dK, dV
           + 2 * kvr * 2 + 3 * 2 * kvr * 2  # contiguous, the kv rotater's cats
           + kvr * 10 + q * 10  # step 0: fp32 += bf16 for dK / dV and dQ
           + 3 * (kvr * 5 + 2 * kvr * 4 + q * 10)  # later: _partial_update (half added, the cat), dQ added
           + 4 * 2 * kvr * 4  # torch.cat of the fp32 dK / dV sent, every step
           + (q + kvr) * 6)  # the casts back
    assert (fwd, bwd) == (170_917_888, 282_066_944)
    for i, want in ((0, fwd), (1, bwd)):
        assert op_cost(tt, i).cast_bytes - op_cost(te, i).cast_bytes == pytest.approx(want)
        assert H100.op_time(op_cost(tt, i)) - H100.op_time(op_cost(te, i)) >= want / H100.hbm_rate * 0.999


def test_merges_compiled_by_hand() -> None:
    # --compile: torchtitan compiles each block with fullgraph=True, the ring traced into it;
    # Inductor fuses each pointwise chain (each tensor read and written once) and drops the
    # rotater's unused cats after the first
    te = _plan("allgather")
    tt = replace(te, runtime=Runtime(framework="torchtitan", compile=True))
    q, kv, kvr = 2048 * 8 * 64, 2048 * 2 * 64 * 2, 4 * 2048 * 2 * 64 * 2
    fwd = ((kv + 2 * kvr) * 2  # repeat_kv, contiguous and the first cat: one kernel
           + 3 * (4 + 4 + 2) * q)  # each later step: the fp32 output read and written, the step's read
    bwd = (3 * kvr * 2  # contiguous and the first cat
           + (2 + 4) * (kvr + q)  # step 0: the gradients into fp32
           + 3 * ((4 + 4 + 1) * kvr + (4 + 4 + 2) * q)  # later: dK / dV received, half added, sent; dQ
           + 4 * kvr + 2 * kv + 6 * q)  # the last dK / dV cast and summed over the repeats; dQ cast
    assert (fwd, bwd) == (40_894_464, 135_266_304)
    for i, want in ((0, fwd), (1, bwd)):
        assert op_cost(tt, i).cast_bytes - op_cost(te, i).cast_bytes == pytest.approx(want)


def test_step_kernels_sequence() -> None:
    # torch launches cp flash kernels per op: step 0 causal over the rank's 2 chunks of S / 2cp
    # tokens, the others non-causal over one chunk: each at the rate of a S / 2cp sequence
    te = _plan("allgather")
    tt = replace(te, runtime=Runtime(framework="torchtitan"))
    for i in (0, 1):
        assert op_cost(te, i).attention[1:] == (S, D, True)  # the gathered keys, one kernel
        assert op_cost(tt, i).attention[1:] == (S // CP, D, True)
        assert op_cost(tt, i).flops == op_cost(te, i).flops
        assert H100.attention_rate(op_cost(tt, i)) < H100.attention_rate(op_cost(te, i))


def test_cp_ranks_across_nodes_use_the_network() -> None:
    # tp filling a node (Llama 3.1 405B's tp = 8) puts the cp ranks on other nodes: the gather and
    # the dK / dV sends go over the network, by the plan's cost model (one rank a node here)
    tt = replace(_plan("allgather"), runtime=Runtime(framework="torchtitan"))
    apart = recost(tt, cost_model(tt.mesh, H100, 1))
    times = [1e-3, 3e-3]
    near, far = torch_cp_costs(tt, times), torch_cp_costs(apart, times)
    assert apart.cost.group((0,)).nodes == CP and tt.cost.group((0,)).nodes == 1
    for i in (0, 1):
        assert far[i].gather_bytes == near[i].gather_bytes and far[i].dkv_bytes == near[i].dkv_bytes
        want = time_of(apart.cost, "all_gather", (0,), far[i].gather_bytes, apart.mesh.shape)
        assert far[i].gather_s == pytest.approx(want) and want > 2 * near[i].gather_s
    assert far[1].dkv_s > 2 * near[1].dkv_s



def test_compiled_grad_shares_the_recomputed_gather_in_time_by_hand(monkeypatch: pytest.MonkeyPatch) -> None:
    # torchtitan --compile, full recomputation: AOTAutograd's CSE merges the grad's K / V gather,
    # contiguous copies and cat into the recomputed forward's (memory_cp.shared_gathers, which the
    # memory model holds from the rerun to the grad); the step prices them once, in the rerun
    small = {"layers": 2, "hidden": 512, "heads": 8, "kv_heads": 2, "ffn": 1024, "vocab": 4096, "seq": 16384,
             "batch": 1}
    plan = plan_model("llama-7b", "cp=2", "cp", small)[1]
    titan = replace(plan, runtime=Runtime(framework="torchtitan", compile=True))
    dev = preset_device("h100").lockstep(titan.mesh.size)  # as the step runs it: one of the mesh's GPUs
    ops = titan.program.ops
    shared = shared_gathers(titan, rerun_points(titan, saved_activations(titan, "full"))[0])
    assert len(shared) == 2 and all(ops[i].rule == "cp_attention_grad" for i in shared)
    # 8192 local tokens, K and V repeated to 8 heads of 64, bf16: 16 MiB; gathered over cp = 2: 32 MiB;
    # the fp32 dK / dV sent: 32 MiB; the grad's contiguous copies and cat (read, 2 written): 48 MiB
    kvr = 8192 * 8 * 64 * 2 * 2
    g = time_of(titan.cost, "all_gather", (0,), 2 * kvr, titan.mesh.shape)
    d = time_of(titan.cost, "send_recv", (0,), 2 * kvr, titan.mesh.shape)
    est = estimate_step(titan, dev, None, "full")
    by_op = {u.op_index: u for u in est.torch_cp}
    for i in shared:
        u = by_op[i]
        assert (u.gather_bytes, u.gather_s, u.dkv_bytes) == (0, 0.0, 2 * kvr)
        assert u.comm_s == pytest.approx(2 * d) and u.exposed_s == pytest.approx(2 * d)
        assert est.timeline[i][2] == pytest.approx(2 * d)  # the dK / dV sends alone, each waited for
        c = op_cost(titan, i)
        assert est.timeline[i][4] == dev.op_time(replace(c, cast_bytes=c.cast_bytes - 3 * kvr))
        assert dev.op_time(c) - est.timeline[i][4] == pytest.approx(3 * kvr / dev.hbm_rate)
    assert all(u.gather_bytes == 2 * kvr for u in est.torch_cp if u.phase == "forward")
    assert est.comm_s["recompute"] == pytest.approx(2 * g)  # the recomputed forwards' gathers stay, exposed
    assert est.comm_s["backward"] == pytest.approx(2 * 2 * d)
    # not recomputed, or eager: the grad gathers again itself
    none = estimate_step(titan, dev, None, "none")
    assert none.comm_s["backward"] == pytest.approx(2 * (g + 2 * d))
    eager = estimate_step(replace(plan, runtime=Runtime(framework="torchtitan")), dev, None, "full")
    assert all(u.gather_bytes == 2 * kvr for u in eager.torch_cp)
    # a pipeline's stage times the same way: its backward less a gather and the copies per layer
    stages = [0] * len(ops)
    got = stage_costs(titan, stages, (2,), dev, "full")[0].backward_s
    # and the search's floor over the modes: below the full mode's (the most it shares)
    work = per_device_work(titan, dev)
    monkeypatch.setattr(context_shared, "shared_gathers", lambda plan, rerun: {})
    base = stage_costs(titan, stages, (2,), dev, "full")[0].backward_s
    assert base - got == pytest.approx(2 * (g + 3 * kvr / dev.hbm_rate))
    assert per_device_work(titan, dev) - work == pytest.approx(2 * (g + 3 * kvr / dev.hbm_rate))
    assert estimate_step(titan, dev, None, "full").comm_s["backward"] == pytest.approx(2 * (g + 2 * d))
