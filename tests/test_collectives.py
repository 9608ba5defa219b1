"""cost.collectives: collectives as NCCL runs them (hand-computed from NCCL's tuning constants
and the nccl-tests figures of docs/devices.md), the overlaps of the step and the pipeline, and
gradient accumulation with recomputation."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.reshard import CostModel
from spmdkit.cost.buckets import MEGATRON_BUCKET_PARAMS, Reducer
from spmdkit.cost.collectives import Fabric, Group, NcclCostModel, collective_time, group_of, time_of
from spmdkit.cost.devices import cost_model, device_from_json, preset_device, recost
from spmdkit.cost.step import estimate_step, op_communication
from spmdkit.cost.step_comm import param_gather_time, tp_overlap_exposed
from spmdkit.planner.pipeline import estimate_pipeline, run_schedule
from spmdkit.planner.pipeline_split import PipelineSpec, split_layers
from spmdkit.planner.planning import plan_model
from spmdkit.program.runtime import Runtime

A100 = Fabric.of(300e9, 25e9)
H100 = Fabric.of(450e9, 50e9)
GIB = 1 << 30


def busbw(op: str, nbytes: float, g: Group, f: Fabric) -> float:
    """nccl-tests' bus bandwidth of one call."""
    fac = 2 * (g.ranks - 1) / g.ranks if op == "all_reduce" else (g.ranks - 1) / g.ranks
    return fac * nbytes / collective_time(op, nbytes, g, f)


# -- groups ------------------------------------------------------------------------------------


def test_groups_sit_on_nodes_as_the_mesh_places_them() -> None:
    shape = (4, 2, 8)  # pp=4, dp=2, tp=8 on 8-GPU nodes
    assert group_of(shape, (2,), 8) == Group(8, 8)           # tp: one node
    assert group_of(shape, (1,), 8) == Group(2, 1)           # dp: one rank per node
    assert group_of(shape, (0,), 8) == Group(4, 1)           # pp
    assert group_of((32,), (0,), 8) == Group(32, 8)          # dp=32: 8 ranks in each of 4 nodes
    assert group_of((4, 2), (0,), 8) == Group(4, 4)          # dp=4 over tp=2: stride 2, 4 in a node
    assert group_of((4, 2, 8), (0, 1), 8) == Group(8, 1)     # a group over two dims that cross nodes
    assert Group(32, 8).nodes == 4 and Group(32, 8).scope == "inter_node" and Group(8, 8).scope == "intra_node"


# -- the model against NCCL's constants and the published busbw ---------------------------------


def test_large_all_reduce_in_a_dgx_a100_node_is_the_ring_at_230_gbs() -> None:
    g = Group(8, 8)
    # Simple ring: 8.4 us + 2(n-1) x 3.4 us, then 2(n-1)/n S over 0.77 x 300 GB/s
    want = (8.4 + 14 * 3.4) * 1e-6 + 2 * 7 / 8 * GIB / (0.77 * 300e9)
    assert collective_time("all_reduce", GIB, g, A100) == pytest.approx(want)
    assert 225e9 < busbw("all_reduce", GIB, g, A100) < 231e9  # nccl-tests: ~230 GB/s of 300


def test_small_messages_are_latency_bound_on_ll() -> None:
    g = Group(8, 8)
    # 8 bytes: LL ring, 6.6 us + 14 x 0.6 us (the bandwidth term is nothing)
    assert collective_time("all_reduce", 8, g, A100) == pytest.approx((6.6 + 14 * 0.6) * 1e-6, rel=1e-3)
    # the bus bandwidth grows with the size: latency-bound, then saturating
    bws = [busbw("all_reduce", s, g, A100) for s in (1 << 16, 1 << 20, 1 << 24, 1 << 28)]
    assert bws == sorted(bws) and bws[0] < 0.1 * bws[-1]


def test_across_nodes_each_gpu_rings_over_its_own_nic() -> None:
    one_per_node = Group(16, 1)  # dp across 16 DGX A100 nodes, tp inside
    assert 22e9 < busbw("all_reduce", GIB, one_per_node, A100) < 23.1e9  # nccl-tests: 22-24 GB/s per GPU
    # 8 ranks in each node cross on 8 NICs: 8 x 23 GB/s = 184 GB/s, below NVLink's 231
    full_nodes = Group(64, 8)
    assert busbw("all_gather", 4 * GIB, full_nodes, A100) == pytest.approx(8 * 0.92 * 25e9, rel=0.02)


def test_tree_wins_small_all_reduces_across_many_nodes() -> None:
    g = Group(256, 1)
    s = 1 << 20
    fac = 2 * 255 / 256
    ring_ll = (6.6 + 2 * 255 * 2.7) * 1e-6 + fac * s / (0.5 * 0.92 * 50e9)
    tree_simple = (8.4 + 2 * 8 * 14.0) * 1e-6 + fac * s / (0.92 * 0.92 * 50e9)
    got = collective_time("all_reduce", s, g, H100)
    assert got < ring_ll and got <= tree_simple + 1e-12


def test_nvls_all_reduce_on_h100_in_a_node() -> None:
    g = Group(8, 8)
    t = collective_time("all_reduce", GIB, g, H100)
    assert t == pytest.approx((23 + 25) * 1e-6 + 2 * 7 / 8 * GIB / 480e9)
    assert 460e9 < busbw("all_reduce", GIB, g, H100) < 480e9  # nccl-tests with NVLS: ~480 GB/s
    # no NVLS on A100, nor for an all-gather: the ring
    assert busbw("all_gather", GIB, g, H100) == pytest.approx(0.80 * 450e9, rel=0.02)


def test_nic_sharing_divides_the_bandwidth() -> None:
    g = Group(4, 1)
    alone = collective_time("reduce_scatter", GIB, g, A100)
    shared = collective_time("reduce_scatter", GIB, g, A100, share=2)
    lat = (8.4 + 3 * 14.0) * 1e-6
    assert shared - lat == pytest.approx(2 * (alone - lat))
    # inside a node no NIC is shared
    assert collective_time("reduce_scatter", GIB, Group(4, 4), A100, share=2) == \
        collective_time("reduce_scatter", GIB, Group(4, 4), A100)


def test_send_recv_over_nvlink_and_over_the_nic() -> None:
    s = 256 << 20
    assert collective_time("send_recv", s, Group(2, 1), H100) == pytest.approx((8.4 + 14.0) * 1e-6 + s / 46e9)
    assert collective_time("send_recv", s, Group(2, 2), H100) == pytest.approx((8.4 + 3.4) * 1e-6 + s / 360e9)


def test_measured_points_are_interpolated_in_log_space() -> None:
    dev = device_from_json({"base": "h100", "measured": {"collectives": [
        {"op": "all_reduce", "ranks": 8, "scope": "intra_node", "bytes": 1 << 20, "time_us": 30.0},
        {"op": "all_reduce", "ranks": 8, "scope": "intra_node", "bytes": 4 << 20, "time_us": 60.0}]}})
    mesh = ProcessMesh([8], dim_names=["tp"])
    cm = cost_model(mesh, dev)
    assert isinstance(cm, NcclCostModel)

    def t(nbytes: int, ranks: int = 8) -> float:
        return time_of(cm, "all_reduce", (0,), nbytes, (ranks,))

    assert t(2 << 20) == pytest.approx(math.sqrt(30 * 60) * 1e-6)  # halfway in log bytes
    assert t(1 << 10) == pytest.approx(30e-6)                      # below: the latency
    assert t(8 << 20) == pytest.approx(120e-6)                     # above: the bandwidth
    four = cost_model(ProcessMesh([4], dim_names=["tp"]), dev)               # 4 ranks: 8's points, scaled
    assert four.collective_time("all_reduce", (0,), 8 << 20, (4,)) == pytest.approx(120e-6 * (6 / 4) / (14 / 8))
    # an op without points keeps the model
    assert cm.collective_time("all_gather", (0,), GIB, (8,)) == collective_time("all_gather", GIB, Group(8, 8), H100)


def test_plain_cost_model_keeps_the_alpha_beta_ring() -> None:
    mesh = ProcessMesh([4], dim_names=["dp"])
    cm = CostModel.default(mesh)
    link = cm.links[0]
    assert cm.collective_time("all_reduce", (0,), 1000, (4,)) == pytest.approx(
        6 * link.alpha_s + 1500 * link.beta_s_per_byte)
    assert cm.collective_time("send_recv", (0,), 1000, (4,)) == pytest.approx(link.alpha_s + 1000 * link.beta_s_per_byte)


def test_every_reshard_of_a_device_plan_is_timed_by_the_model() -> None:
    dev = preset_device("h100")
    _, plan, _ = plan_model("tiny-llama", "dp=2,tp=4", "megatron")
    plan = recost(plan, cost_model(plan.mesh, dev))
    fabric = Fabric.of(450e9, 50e9)
    seen = 0
    for r in plan.reshards:
        for s in r.plan.steps:
            if s.bytes_per_rank == 0:
                continue
            n = math.prod(plan.mesh.shape[d] for d in s.mesh_dims)
            k = 2 * (n - 1) / n if s.kind == "all_reduce" else (n - 1) / n
            g = group_of(plan.mesh.shape, s.mesh_dims, 8)
            assert s.time_s == pytest.approx(collective_time(s.kind, s.bytes_per_rank / k, g, fabric), rel=1e-3)
            seen += 1
    assert seen > 10


# -- the step: buckets, prefetch, TP overlap, accumulation --------------------------------------


def _timed(model: str, mesh: str, strategy: str, ov: dict[str, object], runtime: Runtime | None = None):  # type: ignore[no-untyped-def]
    dev = preset_device("h100")
    _, plan, _ = plan_model(model, mesh, strategy, ov)
    plan = recost(plan, cost_model(plan.mesh, dev))
    if runtime is not None:
        plan = replace(plan, runtime=runtime)
    return plan, dev


def test_megatron_buckets_hold_40m_parameters_in_fp32() -> None:
    plan, dev = _timed("llama-7b", "dp=8", "dp", {"layers": 4})
    est = estimate_step(plan, dev, 8 * 4096)
    cap = max(MEGATRON_BUCKET_PARAMS, 1_000_000 * 8) * 4  # bf16 gradients reduced in fp32
    grads = sum(t.numel for t in plan.program.tensors.values() if t.kind == "parameter" and not t.inplace_of)
    assert sum(b.bytes for b in est.buckets) == 4 * grads
    assert all(cap <= b.bytes for b in est.buckets[:-1])
    # each bucket is one all-reduce of its bytes over dp=8 in a node
    g = Group(8, 8)
    assert all(b.time_s == pytest.approx(collective_time("all_reduce", b.bytes, g, Fabric.of(450e9, 50e9)))
               for b in est.buckets)


def test_torchtitan_reduce_scatters_one_bucket_per_layer() -> None:
    plan, dev = _timed("llama-7b", "dp=8", "zero3", {"layers": 4}, Runtime(framework="torchtitan"))
    est = estimate_step(plan, dev, 8 * 4096)
    layers = {op.layer for op in plan.program.ops if op.phase == "backward"}
    rs = [b for b in est.buckets if b.kind == "reduce_scatter"]
    assert 4 <= len(rs) <= len(layers)  # the 4 layers, and the embedding / head / final norm
    assert sum(b.tensors for b in rs) == sum(1 for t in plan.program.tensors.values()
                                             if t.kind == "parameter" and not t.inplace_of)


def test_fsdp_prefetch_hides_the_gathers_under_the_layer_before() -> None:
    plan, dev = _timed("llama-7b", "dp=8", "zero3", {"layers": 4, "batch": 8})
    est = estimate_step(plan, dev, 8 * 4096)
    gathers = est.comm_s["forward"] + est.comm_s["backward"]
    assert gathers > 0
    blocking = est.compute_total_s + gathers  # every gather blocking, as before
    # what is left exposed is at most the first group's gather and the step's last buckets
    assert est.step_overlap_s < blocking - 0.5 * gathers
    assert est.step_overlap_s >= est.compute_total_s


def test_tp_overlap_exposes_one_chunk() -> None:
    assert tp_overlap_exposed(3.0, 5.0, 4) == pytest.approx(0.75)          # comm under the GEMM: 3/4 exposed
    assert tp_overlap_exposed(8.0, 2.0, 4) == pytest.approx(8 - 2 + 0.5)   # the GEMM under the comm
    assert tp_overlap_exposed(3.0, 5.0, 1) == pytest.approx(3.0)           # one chunk: nothing overlaps


def test_tp_comm_overlap_shortens_the_step_by_the_hidden_part() -> None:
    off, dev = _timed("llama-7b", "tp=8", "megatron,sp", {"layers": 2, "batch": 2})
    on = replace(off, runtime=Runtime(tp_comm_overlap=True))
    e_off, e_on = estimate_step(off, dev, 8192), estimate_step(on, dev, 8192)
    oc_off, oc_on = op_communication(off, dev), op_communication(on, dev)
    hidden = sum(oc_off.wait) - sum(oc_on.wait)
    assert hidden > 0
    assert e_off.step_overlap_s - e_on.step_overlap_s == pytest.approx(hidden, rel=1e-6)
    assert e_on.step_serial_s == pytest.approx(e_off.step_serial_s)  # the serial step counts all of it
    # no TP collective of an all-reduce (megatron without sp) is overlapped
    plain, _ = _timed("llama-7b", "tp=8", "megatron", {"layers": 2, "batch": 2})
    assert estimate_step(replace(plain, runtime=Runtime(tp_comm_overlap=True)), dev, 8192).step_overlap_s == \
        pytest.approx(estimate_step(plain, dev, 8192).step_overlap_s)


def test_grad_accumulation_recomputes_every_micro_step() -> None:
    plan, dev = _timed("llama-7b", "dp=8", "zero2", {"layers": 2})
    e1 = estimate_step(plan, dev, 32768, "full")
    e3 = estimate_step(replace(plan, grad_accum=3), dev, 32768, "full")
    assert e1.compute_s["recompute"] > 0
    micro = sum(e1.compute_s.get(ph, 0.0) + e1.comm_s.get(ph, 0.0) for ph in ("forward", "backward", "recompute"))
    micro += e1.kernel_comm_s
    # zero2 under Megatron-FSDP: each micro-step also reduce-scatters its gradients (tests/test_zero_accum.py)
    assert e3.step_overlap_s == pytest.approx(e1.step_overlap_s + 2 * (micro + e1.exposed_s["gradient_buckets"]))
    assert e3.step_serial_s == pytest.approx(e1.step_serial_s + 2 * (micro + e1.grad_sync_s))
    assert e3.compute_s["recompute"] == pytest.approx(3 * e1.compute_s["recompute"])
    assert e3.recompute_flops_per_device == pytest.approx(3 * e1.recompute_flops_per_device)


# -- the pipeline --------------------------------------------------------------------------------


def test_1f1b_sends_block_the_sender_interleaved_ones_do_not() -> None:
    # p=2, m=1: F0 0-1, send to 1.5 (blocks device 0); F1 1.5-2.5, B1 2.5-4.5, send back to 5.0
    # (blocks device 1); B0 5.0-7.0
    run = run_schedule("1f1b", 2, 1, 1, [1.0, 1.0], [2.0, 2.0], [0.5, 0.0], [0.5, 0.0])
    assert run.finish_s == pytest.approx([7.0, 5.0])
    free = run_schedule("1f1b", 2, 1, 1, [1.0, 1.0], [2.0, 2.0], [0.5, 0.0], [0.5, 0.0], blocking_sends=False)
    assert free.finish_s == pytest.approx([7.0, 4.5])


def test_pipeline_sends_are_nccl_send_recv_over_the_pp_link() -> None:
    plan, dev = _timed("tiny-llama", "dp=2", "dp", {})
    spec = PipelineSpec(2, 4, "1f1b", 1)
    link = dev.inter.cost()
    est = estimate_pipeline(plan, spec, split_layers(2, spec), dev, (link.alpha_s, link.beta_s_per_byte), 64, 4)
    b = est.stages[0].send_bytes
    assert b > 0
    assert est.send_f_s[0] == pytest.approx(collective_time("send_recv", b, Group(2, 1), Fabric.of(450e9, 50e9)))


def test_pipeline_gradients_go_into_the_same_buckets() -> None:
    plan, dev = _timed("llama-7b", "dp=2", "dp", {"layers": 4, "batch": 2})
    spec = PipelineSpec(2, 4, "1f1b", 1)
    link = dev.inter.cost()
    est = estimate_pipeline(plan, spec, split_layers(4, spec), dev, (link.alpha_s, link.beta_s_per_byte),
                            8 * 4096, 4)
    assert est.run is not None
    # per stage: its gradients in Megatron buckets, not one latency per tensor
    for sc in est.stages:
        red = Reducer(plan)
        for _f, dt, st, size, layer in sc.grads:
            red.add(dt, st, size, 0.0, layer)
        assert sc.grad_sync_s == pytest.approx(red.flush(0.0))
        per_tensor = sum(time_of(plan.cost, st.kind, st.mesh_dims, 2 * size, plan.mesh.shape)
                         for _f, _dt, st, size, _l in sc.grads)
        assert len(red.buckets) < len(sc.grads) and sc.grad_sync_s < per_tensor
    # device 1 (a later pipeline rank): one bucket after its last backward, as Megatron-Core does
    one = Reducer(plan, single=True)
    for _f, dt, st, size, layer in est.stages[1].grads:
        one.add(dt, st, size, 0.0, layer)
    dev1 = est.run.finish_s[1] + one.flush(0.0) + est.stages[1].optimizer_s
    assert est.step_overlap_s >= dev1 - 1e-12
    # device 0 overlaps its reductions with its last backward: less than all of them after it
    dev0_serial = est.run.finish_s[0] + est.stages[0].grad_sync_s + est.stages[0].optimizer_s
    assert est.step_overlap_s < max(dev0_serial, dev1) or est.step_overlap_s == pytest.approx(dev1)


def test_distributed_optimizer_gathers_parameters_under_the_next_forward() -> None:
    plan, dev = _timed("llama-7b", "dp=16", "zero1", {"layers": 4, "batch": 16})
    est = estimate_step(plan, dev, 16 * 4096)
    items = []
    for r in plan.reshards:
        for s in r.plan.steps:
            t = plan.program.tensors[r.tensor]
            if s.bytes_per_rank and s.kind == "all_gather" and t.kind == "parameter" \
                    and plan.program.ops[r.op_index].phase == "optimizer":
                items.append((s.mesh_dims, s.bytes_per_rank * 16 / 15, t.itemsize))
    assert items and est.comm_s["optimizer"] > 0  # the serial step counts them
    # Megatron buckets of max(40M, 16M) bf16 parameters: 80 MB all-gathers over dp=16 (two nodes)
    total = sum(b for _d, b, _i in items)
    full, rest = divmod(total, 80e6)
    g = Group(16, 8)
    want = full * collective_time("all_gather", 80e6, g, Fabric.of(450e9, 50e9)) + \
        collective_time("all_gather", rest, g, Fabric.of(450e9, 50e9))
    assert param_gather_time(plan, items) == pytest.approx(want)
    # they block no optimizer op; what the next forward does not cover is exposed
    opt = [x for x in est.timeline if plan.program.ops[x[0]].phase == "optimizer"]
    assert all(x[2] == 0 for x in opt)
    end = est.timeline[-1][1] + sum(est.timeline[-1][2:])
    assert est.step_overlap_s == pytest.approx(end + max(0.0, want - est.compute_s["forward"]))
