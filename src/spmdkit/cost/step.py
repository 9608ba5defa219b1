"""The predicted training step of a plan on a device: each op's compute at the rates the GPU
reaches (:meth:`spmdkit.cost.devices.Device.op_time`, :mod:`spmdkit.cost.rates`), the plan's
communication timed as NCCL runs it (:mod:`spmdkit.cost.collectives`), the overlaps the
framework does (gradient buckets under the backward, Megatron's distributed optimizer: gradients
reduce-scattered and parameters gathered under the next forward, FSDP prefetch, TP
communication overlap), recomputation and gradient accumulation; the step time serial and
overlapped, tokens/s, MFU and HFU, and the error band of the published runs
(:mod:`spmdkit.cost.band`). The ops' compute is :mod:`spmdkit.cost.step_compute`'s, the
communication as the framework schedules it op by op :mod:`spmdkit.cost.step_comm`'s; this
module runs them in program order. Standard library only. docs/devices.md.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from spmdkit.core.reshard import Step
from spmdkit.cost.band import error_band
from spmdkit.cost.buckets import ROOT_LAYERS, Bucket, Reducer
from spmdkit.cost.compute import KernelCollective, kernel_collectives, model_flops
from spmdkit.cost.context import RingCost, causal_imbalance, cp_ops, ring_costs
from spmdkit.cost.context_shared import shared_gather_costs
from spmdkit.cost.context_torch import TorchCpCost
from spmdkit.cost.devices import Device
from spmdkit.cost.float8_tp import float8_gather_s
from spmdkit.cost.memory_saved import rerun_points, saved_activations
from spmdkit.cost.moe import load_summary, moe_layers
from spmdkit.cost.step_comm import (
    Pending,
    StepComm,
    communication,
    layer_groups,
    param_gather_time,
    torchtitan_units,
    ub_sm_tax,
)
from spmdkit.cost.step_compute import StepCompute, step_compute
from spmdkit.engine.facts import OpCost
from spmdkit.engine.memo import Recent, gc_paused
from spmdkit.program.plan import Plan
from spmdkit.program.runtime import FSDP2


@dataclass
class StepEstimate:
    """The predicted training step of a plan on a device (seconds, per device)."""

    device: Device
    ranks: int
    compute_s: dict[str, float]
    comm_s: dict[str, float]
    kernel_comm_s: float
    grad_sync_s: float
    buckets: list[Bucket]
    step_serial_s: float
    step_overlap_s: float
    flops_per_device: float
    model_flops_per_device: float
    bytes_per_device: float
    tokens: int | None
    model_flops: float
    n_params: int
    attention_flops: float
    uncovered: dict[str, int]
    matmul_s: float = 0.0
    memory_bound_ops: int = 0
    kernel: list[KernelCollective] = field(default_factory=list)
    #: the tensor-core peak MFU divides by (the program's parameter dtype)
    peak: float = 0.0
    #: activation recomputation (none, selective, full) and the FLOPs per device it re-runs
    recompute: str = "none"
    recompute_flops_per_device: float = 0.0
    #: model FLOPs plus the matmul / attention FLOPs recomputed on every rank (HFU's numerator)
    hardware_flops: float = 0.0
    #: all-gathers run again in the backward (a tensor kept as its producer's shard)
    regathers: int = 0
    #: one micro-step in program order, per op: (op index, start s, blocking communication s
    #: before it, recomputation and re-gathers s before it, its compute s); the gradient buckets
    #: run beside it on their own stream (:attr:`buckets`)
    timeline: list[tuple[int, float, float, float, float]] = field(default_factory=list, repr=False)
    #: context parallelism's ring attention ops (one micro-step): their block transfers and
    #: what the block computations leave exposed (:mod:`spmdkit.cost.context`)
    rings: list[RingCost] = field(default_factory=list)
    #: the ring's communication and its exposed part over the step (gradient accumulation's
    #: micro-steps included)
    ring_comm_s: float = 0.0
    ring_exposed_s: float = 0.0
    #: torch's context_parallel's allgather attention ops (``--framework torchtitan``; one
    #: micro-step): the gathers of K / V with the query heads, the dK / dV ring, what stays exposed
    #: (:mod:`spmdkit.cost.context_torch`)
    torch_cp: list[TorchCpCost] = field(default_factory=list)
    #: causal cp attention without the zig-zag balance: the busiest cp rank's attention over the
    #: mean (1: balanced, :func:`spmdkit.cost.context.causal_imbalance`)
    cp_imbalance: float = 1.0
    #: the context-parallel degree (the most ranks a cp attention op splits its sequence over; 1: none)
    cp: int = 1
    #: the plan has mixture-of-experts layers (its error band is the published MoE runs')
    moe: bool = False
    #: where :attr:`exposed_comm_s` goes (seconds over the step): ``blocking`` (collectives that
    #: hold the compute stream: tensor-parallel ones not overlapped, their overlap's exposed
    #: chunk, collectives inside kernels, a prefetched gather waited for, ring attention's
    #: exposed transfers; every micro-step), ``gradient_buckets`` (the data-parallel reductions
    #: still running after the last backward, and after each earlier one where the framework
    #: reduce-scatters every micro-step), ``param_gathers`` (Megatron's distributed
    #: optimizer all-gathers the first forward does not cover), ``regathers`` (the backward's
    #: all-gathers of kept shards, sequence parallelism's norm outputs, and the collectives of
    #: recomputed ops, less what their dgrad GEMM covers); they sum to :attr:`exposed_comm_s`
    exposed_s: dict[str, float] = field(default_factory=dict)
    #: the compute seconds the slowest of the step's GPUs adds to the median GPU's (its tensor-core
    #: kernels :attr:`spmdkit.cost.devices.Device.slowdown` times as long): part of
    #: :attr:`compute_s`
    slowest_gpu_s: float = 0.0
    #: --ep-comm-overlap without a pipeline: the merged steps (:func:`spmdkit.planner.ep_overlap.apply_flat_overlap`)
    ep_overlap: dict[str, Any] | None = None
    #: --moe-skew / --moe-histogram: the busiest ep rank's load (:func:`spmdkit.cost.moe.load_summary`)
    moe_load: dict[str, Any] | None = None

    @property
    def compute_total_s(self) -> float:
        return sum(self.compute_s.values())

    @property
    def comm_total_s(self) -> float:
        return sum(self.comm_s.values()) + self.kernel_comm_s + self.grad_sync_s + self.ring_comm_s

    def ring_json(self) -> dict[str, Any] | None:
        """The ring attention's communication and how much of it is exposed (None without one)."""
        if not self.rings:
            return None
        return {"ops": len(self.rings), "cp": max(r.cp for r in self.rings), "comm_s": self.ring_comm_s,
                "exposed_s": self.ring_exposed_s,
                "exposed_share": self.ring_exposed_s / self.ring_comm_s if self.ring_comm_s else 0.0,
                "imbalance": max(r.imbalance for r in self.rings),
                "forward": next((r.to_json() for r in self.rings if r.phase == "forward"), None),
                "backward": next((r.to_json() for r in self.rings if r.phase == "backward"), None)}

    def torch_cp_op(self, phase: str) -> TorchCpCost | None:
        """The first of :attr:`torch_cp` in ``phase`` (forward or backward; None: none)."""
        return next((u for u in self.torch_cp if u.phase == phase), None)

    @property
    def exposed_comm_s(self) -> float:
        return self.step_overlap_s - self.compute_total_s

    @property
    def tokens_per_s(self) -> float | None:
        return None if not self.tokens else self.tokens / self.step_overlap_s

    @property
    def mfu(self) -> float | None:
        """Model FLOPs per second over the peak of every device (bf16/fp16 tensor-core peak of
        the program's dtype)."""
        if not self.tokens or self.step_overlap_s <= 0:
            return None
        return self.model_flops / (self.step_overlap_s * self.ranks * self.peak)

    @property
    def hfu(self) -> float | None:
        """Hardware FLOPs utilisation: :attr:`hardware_flops` (the recomputed forward matmuls
        counted too, as Korthikanti et al. 2022 count them) over the same peak."""
        if not self.tokens or self.step_overlap_s <= 0:
            return None
        return self.hardware_flops / (self.step_overlap_s * self.ranks * self.peak)

    def to_json(self) -> dict[str, Any]:
        return {"device": self.device.to_json(), "ranks": self.ranks,
                "compute_s": dict(self.compute_s), "compute_total_s": self.compute_total_s,
                "matmul_s": self.matmul_s,
                "comm_s": {**self.comm_s, "inside_ops": self.kernel_comm_s, "gradient_buckets": self.grad_sync_s,
                           **({"ring_attention": self.ring_comm_s} if self.rings else {})},
                "ring_attention": self.ring_json(), "cp_imbalance": self.cp_imbalance,
                "torch_context_parallel": {"ops": len(self.torch_cp),
                                           **{p: u.to_json() if (u := self.torch_cp_op(p)) else None
                                              for p in ("forward", "backward")}}
                if self.torch_cp else None,
                "slowest_gpu": self.device.slowest_json(self.slowest_gpu_s),
                "comm_total_s": self.comm_total_s, "step_serial_s": self.step_serial_s,
                "step_overlap_s": self.step_overlap_s, "exposed_comm_s": self.exposed_comm_s,
                "exposed_s": dict(self.exposed_s),
                "flops_per_device": self.flops_per_device, "model_flops_per_device": self.model_flops_per_device,
                "bytes_per_device": self.bytes_per_device, "tokens": self.tokens,
                "tokens_per_s": self.tokens_per_s, "model_flops": self.model_flops, "parameters": self.n_params,
                "attention_flops": self.attention_flops, "peak_flops": self.peak, "mfu": self.mfu,
                "recompute": self.recompute, "recompute_flops_per_device": self.recompute_flops_per_device,
                "hardware_flops": self.hardware_flops, "hfu": self.hfu, "regathers": self.regathers,
                "memory_bound_ops": self.memory_bound_ops,
                "buckets": [b.to_json() for b in self.buckets], "uncovered_rules": dict(self.uncovered),
                "cp": self.cp, **({"ep_comm_overlap": self.ep_overlap} if self.ep_overlap is not None else {}),
                **({"moe_load": self.moe_load} if self.moe_load is not None else {}),
                "error_band": band.to_json() if (band := error_band(self.device.name, self.cp > 1, self.moe)) is not None
                else None}


# -- the steps of the estimate ------------------------------------------------------------------

@dataclass
class _Rerun:
    """Recomputation and re-gathers: seconds run again right before op i, the FLOPs recomputed
    (all, and the matmuls' model FLOPs), the all-gathers run again."""

    extra_at: dict[int, float] = field(default_factory=dict)
    #: the forward ops run again
    ops: set[int] = field(default_factory=set)
    flops: float = 0.0
    matmul_flops: float = 0.0
    regathers: int = 0


def _rerun(plan: Plan, recompute: str, comp: StepCompute, comm: StepComm, kern_by_op: dict[int, float],
           points: tuple[dict[int, list[int]], dict[int, list[int]]] | None = None) -> _Rerun:
    """The recomputed forward ops (with their forward collectives) run again before the first
    op that reads their outputs (``comp.by_phase["recompute"]``, ``comm.by_phase["recompute"]``);
    a tensor kept as its producer's shard is all-gathered again there (``comm.by_phase["backward"]``),
    under Megatron overlapped with that op's dgrad GEMM (:func:`dgrad_time`). ``points``:
    :func:`spmdkit.cost.memory_saved.rerun_points` of ``recompute``, where the caller has them."""
    rerun, regather = points or rerun_points(plan, saved_activations(plan, recompute))
    out = _Rerun()
    for at, idx in rerun.items():
        for j in idx:
            c = comp.costs[j]
            out.ops.add(j)
            out.flops += c.flops
            if c.matmul:
                out.matmul_flops += c.model_flops
            comp.by_phase["recompute"] = comp.by_phase.get("recompute", 0.0) + comp.times[j]
            if comp.slow[j]:
                comp.slow_by_phase["recompute"] = comp.slow_by_phase.get("recompute", 0.0) + comp.slow[j]
            cm = comm.exposed(j, comp.times) + kern_by_op.get(j, 0.0)
            comm.by_phase["recompute"] = comm.by_phase.get("recompute", 0.0) + cm
            out.extra_at[at] = out.extra_at.get(at, 0.0) + comp.times[j] + cm
    for at, ks in regather.items():
        secs = 0.0
        for ix in ks:
            t_ = float8_gather_s(plan, ix)
            out.regathers += 1
            comm.by_phase["backward"] += t_
            secs += t_
        exposed = max(0.0, secs - dgrad_time(comp.costs[at], comp.times[at])) \
            if plan.runtime.framework == "megatron" else secs
        out.extra_at[at] = out.extra_at.get(at, 0.0) + exposed
    return out


def shared_gather_savings(plan: Plan, device: Device, oc: OpComm, rerun: dict[int, list[int]]) -> dict[int, float]:
    """Op -> the seconds :func:`shared_gather_costs` takes off its time in ``oc`` (its compute
    and the communication it waits on), where the backward runs the forward again at ``rerun``."""
    cut = shared_gather_costs(plan, device.lockstep(plan.mesh.size), oc.costs, oc.under, rerun)
    return {i: oc.compute[i] - t + oc.under[i].exposed_s - u.exposed_s for i, (_c, t, u) in cut.items()}


def least_shared_gather_times(plan: Plan, device: Device, oc: OpComm, modes: Iterable[str]) -> dict[int, float]:
    """Op -> the most :func:`shared_gather_savings` of any of the recomputation ``modes``: a
    floor over the modes (``spmdkit.planner.search_floor``) takes it off the op's ``oc`` time,
    so it stays below each mode's."""
    out: dict[int, float] = {}
    if not oc.under or plan.runtime.eager:
        return out
    for mode in modes:
        for i, s in shared_gather_savings(plan, device, oc, rerun_points(plan, saved_activations(plan, mode))[0]).items():
            out[i] = max(out.get(i, 0.0), s)
    return out


def _share_gathers(plan: Plan, device: Device, comp: StepCompute, comm: StepComm, rerun: dict[int, list[int]]) -> None:
    """:func:`shared_gather_costs` into ``comp`` (its lists copied: :func:`step_compute` caches them)
    and ``comm``."""
    cut = shared_gather_costs(plan, device, comp.costs, comm.under, rerun)
    if not cut:
        return
    comp.costs, comp.times = list(comp.costs), list(comp.times)
    for i, (c, t, u) in cut.items():
        ph = plan.program.ops[i].phase
        comp.by_phase[ph] += t - comp.times[i]
        if c.matmul:
            comp.matmul_s += t - comp.times[i]
        comp.costs[i], comp.times[i] = c, t
        comm.by_phase[ph] -= comm.under[i].comm_s - u.comm_s
        comm.under[i] = u


def dgrad_time(c: OpCost, t: float) -> float:
    """The seconds of a matmul grad's input-gradient GEMM (its first, ``dx``; its share of the
    op's time by FLOPs); 0 for another op. Megatron's sequence-parallel linear layers (its own
    ``LinearWithGradAccumulationAndAsyncCommunication`` and Transformer Engine's, "Overlap input
    AG with dgrad") launch the backward's all-gather of their input asynchronously and run the
    dgrad GEMM while it goes; the weight-gradient GEMM waits for it."""
    if not c.matmul or len(c.gemms) < 2:
        return 0.0
    f = [b * m * n * k for b, m, n, k in c.gemms]
    return t * f[0] / sum(f) if sum(f) > 0 else 0.0


@dataclass
class _Run:
    """One micro-step in program order: its end (the optimizer waits for the last bucket), the
    end of its forward and backward, the compute alone, the timeline, the buckets."""

    clock: float
    serial_compute: float
    timeline: list[tuple[int, float, float, float, float]]
    buckets: list[Bucket]
    fb_s: float = 0.0
    #: the buckets still running after the last backward (the optimizer waits for them)
    tail_s: float = 0.0
    #: FSDP2's copy-outs and copy-ins on the compute stream by phase (:func:`fsdp2_copy_out`,
    #: :class:`Reducer`), in ``serial_compute`` and the timeline's compute
    copies: dict[str, float] = field(default_factory=dict)


def fsdp2_copy_out(plan: Plan, comm: StepComm, prefetch: dict[int, tuple[float, int]], hbm_rate: float) -> dict[int, float]:
    """FSDP2's all-gather copy-out (``foreach_all_gather_copy_out``: ``split_with_sizes_copy`` of
    the gathered buffer into the unsharded parameters, on the compute stream) of each unit
    ``prefetch`` gathers (group -> seconds): its gathered bytes read and written at ``hbm_rate``;
    torchtitan's root unit its forward groups' tensors once (:func:`torchtitan_units`)."""
    if hbm_rate <= 0 or plan.runtime.framework not in FSDP2:
        return {}
    groups = layer_groups(plan)
    tag = {groups[i]: (op.layer, op.phase) for i, op in reversed(list(enumerate(plan.program.ops)))}
    root = [g for g in comm.gathers if plan.runtime.framework == "torchtitan" and tag[g][0] in ROOT_LAYERS
            and tag[g][1] == "forward"]
    merged: dict[tuple[str, tuple[int, ...]], float] = {}
    for g in root:
        for key, b in comm.gathers[g].items():
            merged[key] = max(merged.get(key, 0.0), b)
    return {g: 2 * sum((merged if root and g == min(root) else comm.gathers.get(g, {})).values()) / hbm_rate
            for g in prefetch}


def _run(plan: Plan, comp: StepCompute, comm: StepComm, rerun: _Rerun, kern_by_op: dict[int, float],
         pending: dict[int, list[Pending]] | None = None, hbm_rate: float = 0.0) -> _Run:
    """The ops in program order; a stored parameters' group all-gather is issued on the
    communication stream when the group before its own starts (FSDP's prefetch of the next
    block, forward and backward; torchtitan's units: :func:`torchtitan_units`), and its first
    reader waits for it. ``pending``: the gradient reductions this micro-step runs (default every
    one, the last micro-step's); without ``Runtime.grad_overlap`` all of them in one buffer after
    the backward (Megatron-LM 2021-2022's local DDP). ``hbm_rate``: FSDP2's copy-out of each
    gathered unit before its first reader, and copy-in of each reduce-scatter after the op that
    shows its launch (in that op's successor's compute), on the compute stream."""
    pending = comm.pending if pending is None else pending
    prefetch = torchtitan_units(plan, comm)
    red = Reducer(plan, single=not plan.runtime.grad_overlap, hbm_rate=hbm_rate)
    copy_out = fsdp2_copy_out(plan, comm, prefetch, hbm_rate)
    copies: dict[str, float] = {}
    clock = 0.0
    serial_compute = 0.0
    timeline: list[tuple[int, float, float, float, float]] = []
    flushed = False
    fb = tail = 0.0
    times = comp.times
    groups = layer_groups(plan) if prefetch else []
    order = sorted(prefetch)
    first_of = {first: g for g, (_t, first) in prefetch.items()}
    done: dict[int, float] = {}

    def end_of_backward() -> None:
        """The buckets still open launched, and the copy-ins of those the backward's end launches."""
        nonlocal fb, clock, flushed, serial_compute, tail
        fb = clock
        clock = red.flush(clock)
        flushed = True
        pre = red.take()
        copies["backward"] = copies.get("backward", 0.0) + pre
        serial_compute += pre
        tail = clock - fb - pre

    for i, op in enumerate(plan.program.ops):
        if op.phase == "optimizer" and not flushed:
            end_of_backward()
        pre = red.take()  # the copy-ins the op before launched, before this op
        wait = 0.0
        if groups and (i == 0 or groups[i] != groups[i - 1]):
            # a group starts: its own gather if not yet issued, then the next group's (prefetch)
            h = groups[i]
            k = bisect.bisect_left(order, h)
            for nxt in order[k:k + 2] if k < len(order) and order[k] == h else order[k:k + 1]:
                if nxt not in done:
                    done[nxt] = max(clock, red.free) + prefetch[nxt][0]
                    red.free = done[nxt]
        mine = first_of.get(i)
        out = copy_out.get(mine, 0.0) if mine is not None else 0.0
        if mine is not None:
            wait = max(0.0, done.get(mine, clock + pre) - clock - pre)
        blocked = wait + comm.exposed(i, times) + kern_by_op.get(i, 0.0)
        timeline.append((i, clock, blocked, rerun.extra_at.get(i, 0.0), times[i] + pre + out))
        clock += blocked + times[i] + pre + out + rerun.extra_at.get(i, 0.0)
        serial_compute += times[i] + pre + out
        if pre or out:
            copies[op.phase] = copies.get(op.phase, 0.0) + out
            copies["backward"] = copies.get("backward", 0.0) + pre
        for dt, s, size in pending.get(i, []):
            red.add(dt, s, size, clock, op.layer)
    if not flushed:
        end_of_backward()
    return _Run(clock, serial_compute, timeline, red.buckets, fb, tail, copies)


@dataclass
class OpComm:
    """One micro-step's ops on a device, for the pipeline's stages: each op's compute seconds,
    the seconds it waits on communication (blocking collectives, the exposed part of a
    TP-overlapped one, the collectives inside its kernel, a prefetched parameter gather the
    group before did not hide), and the gradient reductions its outputs feed (their buckets)."""

    compute: list[float]
    wait: list[float]
    pending: dict[int, list[tuple[str, Step, int]]]
    costs: list[OpCost]
    #: the distributed optimizer's parameter all-gathers by op (:func:`param_gather_time`)
    param_gathers: dict[int, list[tuple[tuple[int, ...], float, int]]] = field(default_factory=dict)
    #: ZeRO-3 / FSDP: the part of ``wait`` that is a prefetched group gather the group before
    #: did not hide (op -> seconds), and the seconds of every group's gather together
    prefetch_exposed: dict[int, float] = field(default_factory=dict)
    gathers_s: float = 0.0
    #: the part of ``wait`` that is an expert-parallel all-to-all (op -> seconds; ``StepComm.ep_a2a``)
    ep_a2a: dict[int, float] = field(default_factory=dict)
    #: (op, index in ``pending[op]``) of the reductions a pipeline's stages run in every
    #: microbatch's backward, not only the last one's (Megatron-FSDP's ZeRO-2/3 reduce-scatters)
    each: frozenset[tuple[int, int]] = frozenset()
    #: torch's context_parallel's allgather attention ops (``StepComm.under``; their exposed part in ``wait``)
    under: dict[int, TorchCpCost] = field(default_factory=dict)


#: op_communication's values by what it reads of a plan (every field but ``rounds``: the
#: objects' ids, the gradient accumulation and the runtime by value) and the device's id; each
#: value holds its plan and device, so the ids in its key are not reused while it is kept. A copy
#: re-costed under another runtime (``replace(plan, runtime=...)``, the search's pricing) shares
#: its shardings with the plan it was made from, and is priced once with it
_OC: Recent[tuple[Plan, Device, OpComm]] = Recent(32, by_id=True)


def op_communication(plan: Plan, device: Device) -> OpComm:
    """:class:`OpComm` of ``plan`` on ``device``: the step's communication model
    (:func:`estimate_step`) per op, the FSDP prefetch as ``max(0, gather - the group before)``;
    computed once per plan's contents and device (the last 32 kept: the search's layer floor,
    its tail, a pipeline's unit costs and its folded stages read the same plan's). Callers only
    read the returned object. The device is one of at least the plan's mesh of GPUs
    (:meth:`~spmdkit.cost.devices.Device.lockstep`)."""
    key = (id(plan.program), id(plan.mesh), id(plan.attrs), id(plan.ops), id(plan.reshards), id(plan.annotations),
           id(plan.cost), id(plan.storage), plan.grad_accum, plan.runtime, id(device))
    return _OC.get(key, lambda: (plan, device, _op_communication(plan, device)))[2]


@gc_paused
def _op_communication(plan: Plan, device: Device) -> OpComm:
    device = device.lockstep(plan.mesh.size)
    comp = step_compute(plan, device)
    comm = communication(plan, comp, device)
    comm.rs_tax = ub_sm_tax(plan.runtime.framework, device.rates.sms)
    wait = [comm.exposed(i, comp.times) for i in range(len(comp.times))]
    for k in kernel_collectives(plan):
        wait[k.op_index] += k.time_s
    for r in ring_costs(plan, comp.times):
        wait[r.op_index] += r.exposed_s
    exposed: dict[int, float] = {}
    if comm.prefetch:
        groups = layer_groups(plan)
        span: dict[int, float] = {}
        for i, g in enumerate(groups):
            span[g] = span.get(g, 0.0) + comp.times[i] + wait[i]
        for g, (secs, first) in comm.prefetch.items():
            e = max(0.0, secs - span.get(g - 1, 0.0))
            wait[first] += e
            exposed[first] = exposed.get(first, 0.0) + e
    return OpComm(comp.times, wait, comm.pending, comp.costs, comm.param_gathers, exposed,
                  sum(secs for secs, _first in comm.prefetch.values()), comm.ep_a2a,
                  frozenset(comm.pipeline_each), comm.under)


@gc_paused
def estimate_step(plan: Plan, device: Device, tokens: int | None = None, recompute: str = "none") -> StepEstimate:
    """The training step of ``plan`` on ``device`` (every rank one such device). Roofline time
    per op; communication from the plan's reshards (timed by the plan's cost model: see
    :func:`spmdkit.cost.devices.recost`) and :func:`spmdkit.cost.compute.kernel_collectives`.
    Gradient reductions (a parameter gradient all-reduced or reduce-scattered before its
    optimizer update) go into DDP buckets in the order the backward makes the gradients; a
    bucket is launched when full and at the end of the backward. Serial: everything one after
    the other. Overlapped: the buckets run on their own stream while the backward computes;
    every other collective blocks (the optimizer waits for the last bucket). ``recompute``
    (none, selective, full; :mod:`spmdkit.cost.activations`): the recomputed forward ops (and
    their forward collectives) run again in the backward right before the first op that reads
    their outputs (``compute_s["recompute"]``, ``comm_s["recompute"]``); a tensor kept as its
    producer's shard (sequence parallel's norm outputs) is all-gathered again there
    (``comm_s["backward"]``). MFU counts model FLOPs only, so recomputation lowers it;
    :attr:`StepEstimate.hfu` counts the recomputed matmuls too. The step's GPUs are the plan's
    mesh (at least ``device.gpus``: :meth:`~spmdkit.cost.devices.Device.lockstep`); its
    tensor-core kernels run at the pace of the slowest (:attr:`StepEstimate.slowest_gpu_s`)."""
    device = device.lockstep(plan.mesh.size)
    prog = plan.program
    kern = kernel_collectives(plan)
    kern_by_op: dict[int, float] = {}
    for k in kern:
        kern_by_op[k.op_index] = kern_by_op.get(k.op_index, 0.0) + k.time_s
    comp = step_compute(plan, device)
    comm = communication(plan, comp, device)
    comm.rs_tax = ub_sm_tax(plan.runtime.framework, device.rates.sms)
    rings = ring_costs(plan, comp.times)
    for rg in rings:  # the ring's exposed transfers wait inside the op, as a kernel's collective
        kern_by_op[rg.op_index] = kern_by_op.get(rg.op_index, 0.0) + rg.exposed_s
    points = rerun_points(plan, saved_activations(plan, recompute))
    _share_gathers(plan, device, comp, comm, points[0])
    rerun = _rerun(plan, recompute, comp, comm, kern_by_op, points)
    compute, comm_s = comp.by_phase, comm.by_phase
    flops, mflops, nbytes, matmul_s = comp.flops + rerun.flops, comp.model_flops, comp.bytes, comp.matmul_s
    rate = device.hbm_rate
    run = _run(plan, comp, comm, rerun, kern_by_op, hbm_rate=rate)
    accum = plan.grad_accum
    # the micro-steps before the last, where the framework reduce-scatters gradients in every
    # micro-step's backward (ZeRO-2/3 under Megatron-FSDP, torchtitan): those reductions only;
    # where it reduces once but FSDP2 copies on the compute stream, none (no copy-in before the last)
    early = _run(plan, comp, comm, rerun, kern_by_op, comm.pending_each, rate) if accum > 1 and comm.pending_each \
        else None
    prior = early if early is not None else run if accum == 1 or not run.copies.get("backward") \
        else _run(plan, comp, comm, rerun, kern_by_op, {}, rate)
    clock = run.clock
    gathers_exposed = 0.0
    if comm.param_gathers:
        # Megatron's overlap_param_gather: the updated parameters' all-gathers run under the next
        # step's first forward, bucket by bucket; what the forward does not cover is exposed
        gathers = param_gather_time(plan, [x for v in comm.param_gathers.values() for x in v])
        gathers_exposed = max(0.0, gathers - compute["forward"])
        clock += gathers_exposed
    grad_sync = sum(b.time_s for b in run.buckets)
    if early is not None:
        grad_sync += (accum - 1) * sum(b.time_s for b in early.buckets)
    kern_total = sum(k.time_s for k in kern)
    # the rings of recomputed forward ops run again (their exposed part is in comm_s["recompute"])
    again = [rg for rg in rings if rg.op_index in rerun.ops]
    ring_comm = sum(rg.comm_s for rg in rings) + sum(rg.comm_s for rg in again)
    ring_exposed = sum(rg.exposed_s for rg in rings) + sum(rg.exposed_s for rg in again)
    serial = (run.serial_compute + compute.get("recompute", 0.0) + sum(comm_s.values()) + kern_total + grad_sync
              + ring_comm - sum(rg.exposed_s for rg in again))
    mf, n_params, att = model_flops(plan, tokens or 0)
    if accum > 1:
        # gradient accumulation: accum - 1 more forward and backward passes (each with its
        # recomputation) before the one above, whose backward overlaps the step's gradient
        # reductions; where the framework reduce-scatters every micro-step (``early``), each of
        # those passes overlaps its own, and what they leave past its backward delays the next
        # micro-step (its parameter gathers queue behind them on the communication stream)
        phases = ("forward", "backward", "recompute")
        serial += (accum - 1) * (sum(compute.get(ph, 0.0) + comm_s.get(ph, 0.0) for ph in phases) + kern_total
                                 + ring_comm - sum(rg.exposed_s for rg in again))
        clock += (accum - 1) * (prior.fb_s + (early.tail_s if early is not None else 0.0))
        ring_comm *= accum
        ring_exposed *= accum
        for ph in phases:
            comp.slow_by_phase[ph] = comp.slow_by_phase.get(ph, 0.0) * accum
            if ph in compute:
                compute[ph] *= accum
            if ph in comm_s:
                comm_s[ph] *= accum
        kern_total *= accum
        opt = [c for c, op in zip(comp.costs, prog.ops) if op.phase == "optimizer"]
        of, om, ob = sum(c.flops for c in opt), sum(c.model_flops for c in opt), sum(c.bytes for c in opt)
        flops, mflops, nbytes = (accum * (flops - of) + of, accum * (mflops - om) + om, accum * (nbytes - ob) + ob)
        matmul_s *= accum
        tokens = tokens * accum if tokens else tokens
        mf = mf * accum
        serial += (accum - 1) * sum(prior.copies.values())
    for ph in set(run.copies) | set(prior.copies):  # FSDP2's copies, as each micro-step runs them
        compute[ph] = compute.get(ph, 0.0) + run.copies.get(ph, 0.0) + (accum - 1) * prior.copies.get(ph, 0.0)
    est = StepEstimate(device, plan.mesh.size, compute, comm_s, kern_total, grad_sync, run.buckets, serial, clock,
                       flops, mflops, nbytes, tokens, mf if tokens else 0.0, n_params, att * accum, comp.uncovered,
                       matmul_s, comp.memory_bound, kern)
    est.peak = device.matmul_peak(prog.param_dtype() or "float32")
    est.recompute = recompute
    est.recompute_flops_per_device = rerun.flops * accum
    est.hardware_flops = (mf + plan.mesh.size * rerun.matmul_flops * accum) if tokens else 0.0
    est.regathers = rerun.regathers
    est.slowest_gpu_s = sum(comp.slow_by_phase.values())
    est.timeline = run.timeline
    est.rings, est.ring_comm_s, est.ring_exposed_s = rings, ring_comm, ring_exposed
    est.torch_cp = list(comm.under.values())
    cps = cp_ops(plan)
    est.cp_imbalance = max((causal_imbalance(c.ranks, c.balanced, c.causal) for c in cps if c.variant != "alltoall"),
                           default=1.0)
    est.cp = max((c.ranks for c in cps), default=1)
    est.moe = bool(moe_layers(plan.program))
    est.moe_load = load_summary(plan)
    blocking = sum(b for _i, _t, b, _r, _c in run.timeline) \
        + (accum - 1) * sum(b for _i, _t, b, _r, _c in prior.timeline)  # the micro-steps before the last
    tail = run.tail_s + (accum - 1) * (early.tail_s if early is not None else 0.0)
    est.exposed_s = {"blocking": blocking, "gradient_buckets": tail, "param_gathers": gathers_exposed,
                     "regathers": est.exposed_comm_s - blocking - tail - gathers_exposed}
    return est


__all__ = ["OpComm", "StepEstimate", "dgrad_time", "estimate_step", "fsdp2_copy_out", "least_shared_gather_times",
           "op_communication", "shared_gather_savings"]
