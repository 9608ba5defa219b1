"""The predicted training step of a plan on a device: roofline compute per op, the plan's
communication, data-parallel gradient reductions in DDP buckets overlapped with the backward,
recomputation, the step time serial and overlapped, tokens/s, MFU and HFU. Standard library
only. docs/devices.md.

:func:`estimate_step` (plan, device): roofline time per op ``max(flops/peak, bytes/bw)``
(:mod:`spmdkit.cost.compute`, :mod:`spmdkit.cost.devices`), communication, data-parallel
gradient reductions in DDP buckets (first 1 MiB, then 25 MiB) overlapped with the backward, the
step time serial and overlapped, tokens/s and MFU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from spmdkit.core.reshard import Step
from spmdkit.cost.compute import KernelCollective, kernel_collectives, local_shape, model_flops, op_cost
from spmdkit.cost.devices import Device
from spmdkit.cost.memory import rerun_points, saved_activations
from spmdkit.engine.facts import OpCost
from spmdkit.ops._cost import numel
from spmdkit.program.plan import Plan, Reshard

#: DDP's bucket sizes (torch.nn.parallel.DistributedDataParallel: bucket_cap_mb=25, and the
#: first bucket dist._DEFAULT_FIRST_BUCKET_BYTES = 1 MiB)
BUCKET_BYTES = 25 * 1024 * 1024
FIRST_BUCKET_BYTES = 1024 * 1024


@dataclass(frozen=True)
class Bucket:
    """A bucket of gradient reductions: launched when full (or at the end of the backward)."""

    kind: str
    mesh_dims: tuple[int, ...]
    reduce_type: str
    tensors: int
    bytes: int
    ready_s: float
    start_s: float
    time_s: float

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "mesh_dims": list(self.mesh_dims), "reduce_type": self.reduce_type,
                "tensors": self.tensors, "bytes": self.bytes, "ready_s": self.ready_s, "start_s": self.start_s,
                "time_s": self.time_s}


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

    @property
    def compute_total_s(self) -> float:
        return sum(self.compute_s.values())

    @property
    def comm_total_s(self) -> float:
        return sum(self.comm_s.values()) + self.kernel_comm_s + self.grad_sync_s

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
                "comm_s": {**self.comm_s, "inside_ops": self.kernel_comm_s, "gradient_buckets": self.grad_sync_s},
                "comm_total_s": self.comm_total_s, "step_serial_s": self.step_serial_s,
                "step_overlap_s": self.step_overlap_s, "exposed_comm_s": self.exposed_comm_s,
                "flops_per_device": self.flops_per_device, "model_flops_per_device": self.model_flops_per_device,
                "bytes_per_device": self.bytes_per_device, "tokens": self.tokens,
                "tokens_per_s": self.tokens_per_s, "model_flops": self.model_flops, "parameters": self.n_params,
                "attention_flops": self.attention_flops, "peak_flops": self.peak, "mfu": self.mfu,
                "recompute": self.recompute, "recompute_flops_per_device": self.recompute_flops_per_device,
                "hardware_flops": self.hardware_flops, "hfu": self.hfu, "regathers": self.regathers,
                "memory_bound_ops": self.memory_bound_ops,
                "buckets": [b.to_json() for b in self.buckets], "uncovered_rules": dict(self.uncovered)}


def is_grad_sync(plan: Plan, r: Reshard, s: Step, param_grads: frozenset[str]) -> bool:
    """A parameter gradient's reduction: before its optimizer update, or (ZeRO-1/2/3, the
    gradient held reduced) right after the backward op that makes it."""
    prog = plan.program
    if s.kind not in ("all_reduce", "reduce_scatter") or prog.tensors[r.tensor].kind != "gradient":
        return False
    if not r.output:
        return bool(prog.ops[r.op_index].phase == "optimizer")
    return r.tensor in param_grads



# -- the steps of the estimate ------------------------------------------------------------------

#: a gradient reduction waiting for its bucket: (dtype, the reshard step, bytes per rank)
_Pending = tuple[str, Step, int]


@dataclass
class _Comm:
    """The plan's reshards by op: the blocking ones (seconds before op i), the gradient
    reductions by the op that makes the gradient, and the blocking seconds per phase."""

    blocking: dict[int, float]
    pending: dict[int, list[_Pending]]
    by_phase: dict[str, float]


def _communication(plan: Plan) -> _Comm:
    """Gradient reductions (:func:`is_grad_sync`) go to the op that makes the gradient (they
    wait for a bucket); every other collective blocks the op that needs it."""
    prog = plan.program
    blocking: dict[int, float] = {}
    pending: dict[int, list[_Pending]] = {}
    producer: dict[str, int] = {}
    for i, op in enumerate(prog.ops):
        for n in op.output_names():
            producer.setdefault(n, i)
    comm = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
    param_grads = plan.param_grads()
    for r in plan.reshards:
        if r.shared:
            continue
        phase = prog.ops[r.op_index].phase
        for s in r.plan.steps:
            if s.bytes_per_rank == 0:
                continue
            if is_grad_sync(plan, r, s, param_grads):
                t = prog.tensors[r.tensor]
                size = numel(local_shape(t.shape, s.src)) * t.itemsize
                at = producer.get(r.tensor, r.op_index)
                pending.setdefault(at, []).append((t.dtype, s, size))
            else:
                blocking[r.op_index] = blocking.get(r.op_index, 0.0) + s.time_s
                comm[phase] += s.time_s
    return _Comm(blocking, pending, comm)


@dataclass
class _Compute:
    """Every op's cost and roofline time, and their sums."""

    costs: list[OpCost]
    times: list[float]
    by_phase: dict[str, float]
    uncovered: dict[str, int]
    flops: float = 0.0
    model_flops: float = 0.0
    bytes: float = 0.0
    matmul_s: float = 0.0
    memory_bound: int = 0


def _compute(plan: Plan, device: Device) -> _Compute:
    out = _Compute([], [], {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}, {})
    for i, op in enumerate(plan.program.ops):
        c = op_cost(plan, i)
        out.costs.append(c)
        if not c.covered:
            out.uncovered[op.rule] = out.uncovered.get(op.rule, 0) + 1
        t = device.op_time(c)
        out.times.append(t)
        out.by_phase[op.phase] = out.by_phase.get(op.phase, 0.0) + t
        out.flops += c.flops
        out.model_flops += c.model_flops
        out.bytes += c.bytes
        if c.matmul:
            out.matmul_s += t
        if c.bytes / device.hbm_bytes_per_s > c.flops / (device.matmul_peak(c.dtype) if c.matmul else
                                                          device.vector_peak) and t > 0:
            out.memory_bound += 1
    return out


@dataclass
class _Rerun:
    """Recomputation and re-gathers: seconds run again right before op i, the FLOPs recomputed
    (all, and the matmuls' model FLOPs), the all-gathers run again."""

    extra_at: dict[int, float] = field(default_factory=dict)
    flops: float = 0.0
    matmul_flops: float = 0.0
    regathers: int = 0


def _rerun(plan: Plan, recompute: str, comp: _Compute, comm: _Comm, kern_by_op: dict[int, float]) -> _Rerun:
    """The recomputed forward ops (with their forward collectives) run again before the first
    op that reads their outputs (``comp.by_phase["recompute"]``, ``comm.by_phase["recompute"]``);
    a tensor kept as its producer's shard is all-gathered again there (``comm.by_phase["backward"]``)."""
    rerun, regather = rerun_points(plan, saved_activations(plan, recompute))
    out = _Rerun()
    for at, idx in rerun.items():
        for j in idx:
            c = comp.costs[j]
            out.flops += c.flops
            if c.matmul:
                out.matmul_flops += c.model_flops
            comp.by_phase["recompute"] = comp.by_phase.get("recompute", 0.0) + comp.times[j]
            cm = comm.blocking.get(j, 0.0) + kern_by_op.get(j, 0.0)
            comm.by_phase["recompute"] = comm.by_phase.get("recompute", 0.0) + cm
            out.extra_at[at] = out.extra_at.get(at, 0.0) + comp.times[j] + cm
    for at, ks in regather.items():
        for ix in ks:
            t_ = plan.reshards[ix].plan.time_s
            out.regathers += 1
            comm.by_phase["backward"] += t_
            out.extra_at[at] = out.extra_at.get(at, 0.0) + t_
    return out


class _Reducer:
    """DDP's gradient buckets: one open bucket per (kind, mesh dims, reduce type, dtype), filled
    in the order the gradients are made and launched when full (the first at 1 MiB, the others
    at 25 MiB) on the communication stream, one bucket after the other."""

    def __init__(self, plan: Plan) -> None:
        self.mesh = plan.mesh
        self.cost = plan.cost
        self.buckets: list[Bucket] = []
        self.open: dict[tuple[Any, ...], list[Any]] = {}  # key -> [tensors, bytes, ready, cap]
        self.free = 0.0  # when the communication stream is free
        self.first_cap = FIRST_BUCKET_BYTES

    def _time(self, kind: str, dims: tuple[int, ...], size: int) -> float:
        n = 1
        for d in dims:
            n *= self.mesh.shape[d]
        a = sum(self.cost.links[d].alpha_s for d in dims) / len(dims)
        b = max(self.cost.links[d].beta_s_per_byte for d in dims)
        if kind == "all_reduce":
            return 2 * (n - 1) * a + round(2 * (n - 1) / n * size) * b
        return (n - 1) * a + round((n - 1) / n * size) * b

    def _launch(self, key: tuple[Any, ...], now: float) -> None:
        tensors, size, ready, _cap = self.open.pop(key)
        kind, dims, rt, _dt = key
        dur = self._time(kind, dims, size)
        start = max(now, self.free)
        self.free = start + dur
        self.buckets.append(Bucket(kind, dims, rt, tensors, size, ready, start, dur))

    def add(self, dtype: str, s: Step, size: int, now: float) -> None:
        key = (s.kind, s.mesh_dims, s.reduce_type or "sum", dtype)
        b = self.open.get(key)
        if b is None:
            b = self.open[key] = [0, 0, now, self.first_cap]
            self.first_cap = BUCKET_BYTES
        b[0] += 1
        b[1] += size
        b[2] = now
        if b[1] >= b[3]:
            self._launch(key, now)

    def flush(self, now: float) -> float:
        """Launch every open bucket (the end of the backward); the time the last one is done."""
        for key in list(self.open):
            self._launch(key, now)
        return max(now, self.free)


@dataclass
class _Run:
    """One micro-step in program order: its end (the optimizer waits for the last bucket), the
    compute alone, the timeline, the buckets."""

    clock: float
    serial_compute: float
    timeline: list[tuple[int, float, float, float, float]]
    buckets: list[Bucket]


def _run(plan: Plan, comp: _Compute, comm: _Comm, rerun: _Rerun, kern_by_op: dict[int, float]) -> _Run:
    red = _Reducer(plan)
    clock = 0.0
    serial_compute = 0.0
    timeline: list[tuple[int, float, float, float, float]] = []
    flushed = False
    times = comp.times
    for i, op in enumerate(plan.program.ops):
        if op.phase == "optimizer" and not flushed:
            clock = red.flush(clock)
            flushed = True
        blocked = comm.blocking.get(i, 0.0) + kern_by_op.get(i, 0.0)
        timeline.append((i, clock, blocked, rerun.extra_at.get(i, 0.0), times[i]))
        clock += blocked + times[i] + rerun.extra_at.get(i, 0.0)
        serial_compute += times[i]
        for dt, s, size in comm.pending.get(i, []):
            red.add(dt, s, size, clock)
    if not flushed:
        clock = red.flush(clock)
    return _Run(clock, serial_compute, timeline, red.buckets)


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
    :attr:`StepEstimate.hfu` counts the recomputed matmuls too."""
    prog = plan.program
    kern = kernel_collectives(plan)
    kern_by_op: dict[int, float] = {}
    for k in kern:
        kern_by_op[k.op_index] = kern_by_op.get(k.op_index, 0.0) + k.time_s
    comm = _communication(plan)
    comp = _compute(plan, device)
    rerun = _rerun(plan, recompute, comp, comm, kern_by_op)
    compute, comm_s = comp.by_phase, comm.by_phase
    flops, mflops, nbytes, matmul_s = comp.flops + rerun.flops, comp.model_flops, comp.bytes, comp.matmul_s
    run = _run(plan, comp, comm, rerun, kern_by_op)
    clock = run.clock
    grad_sync = sum(b.time_s for b in run.buckets)
    kern_total = sum(k.time_s for k in kern)
    serial = run.serial_compute + compute.get("recompute", 0.0) + sum(comm_s.values()) + kern_total + grad_sync
    mf, n_params, att = model_flops(plan, tokens or 0)
    accum = plan.grad_accum
    if accum > 1:
        # gradient accumulation: accum - 1 more forward and backward passes before the one above,
        # whose backward overlaps the step's only gradient reductions
        extra = (accum - 1) * (compute["forward"] + compute["backward"] + comm_s["forward"] + comm_s["backward"]
                               + kern_total)
        serial += extra
        clock += extra
        for ph in ("forward", "backward"):
            compute[ph] *= accum
            comm_s[ph] *= accum
        kern_total *= accum
        opt = [c for c, op in zip(comp.costs, prog.ops) if op.phase == "optimizer"]
        of, om, ob = sum(c.flops for c in opt), sum(c.model_flops for c in opt), sum(c.bytes for c in opt)
        flops, mflops, nbytes = (accum * (flops - of) + of, accum * (mflops - om) + om, accum * (nbytes - ob) + ob)
        matmul_s *= accum
        tokens = tokens * accum if tokens else tokens
        mf = mf * accum
    est = StepEstimate(device, plan.mesh.size, compute, comm_s, kern_total, grad_sync, run.buckets, serial, clock,
                       flops, mflops, nbytes, tokens, mf if tokens else 0.0, n_params, att * accum, comp.uncovered,
                       matmul_s, comp.memory_bound, kern)
    dtypes = [t.dtype for t in prog.tensors.values() if t.kind == "parameter"]
    est.peak = device.matmul_peak(max(set(dtypes), key=dtypes.count) if dtypes else "float32")
    est.recompute = recompute
    est.recompute_flops_per_device = rerun.flops
    est.hardware_flops = (mf + plan.mesh.size * rerun.matmul_flops) if tokens else 0.0
    est.regathers = rerun.regathers
    est.timeline = run.timeline
    return est


__all__ = ["BUCKET_BYTES", "FIRST_BUCKET_BYTES", "Bucket", "StepEstimate", "estimate_step", "is_grad_sync"]
