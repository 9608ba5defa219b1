"""Pipeline parallelism over a ``pp`` mesh dim: stages, schedules, bubble, send/recv, memory.

A mesh with a ``pp`` dim (``--mesh pp=4,dp=8,tp=8``) splits the decoder layers into ``p``
stages (``p * v`` virtual stages with ``--virtual-stages v``): evenly by default, balanced by
cost where they do not divide (:func:`auto_counts`: Llama 3.1 405B's 126 layers on 16 stages
7, 8 x 14, 7), or as ``--stages 20,20,20,20``. The embedding goes with the first stage, the
final norm, LM head and loss with the last; a parameter's optimizer update with the stage of
the parameter. Every model source is cut the same way (:func:`plan_pipeline_source`): its
layers are the op labels that end in a number (a preset's ``layer 3``, an imported model's
``model.layers.3``, a program file's own), :func:`op_units`.

Planning. No tensor is ever sharded over ``pp`` (a stage holds its layers whole, and the
other stages hold none of them), so the sharding inside a stage is independent of the pp
dim: the training step of ONE microbatch (batch / m) is built and planned once, whole, on
the sub-mesh without ``pp`` (e.g. ``dp=8,tp=8``), with the same propagation as any plan.
Planning each stage alone would give the same layouts except at the cut, where the whole
program's plan simply fixes the layout the boundary activation is sent in. One propagation
keeps planning linear in the layers (llama-70b on pp=4,dp=8,tp=8: benchmarks/bench_plan.py).

Then every op gets its (virtual) stage from its ``layer`` tag, and per stage this module
sums, for one microbatch: the forward and backward time (each op's roofline time from
:func:`spmdkit.cost.compute.op_cost`, plus the blocking reshards and the collectives
inside its ops), the gradient reductions of its parameters (once per step: gradients are
accumulated over the microbatches and reduced after the last one), the optimizer time, the
activations sent to the next stage in the forward and their gradients sent back in the
backward (local bytes under the plan, timed on the ``pp`` link of the device's cost model),
and its memory. The schedule (GPipe, 1F1B, interleaved 1F1B) is then run as an event
simulation over these per-stage times: each device executes its forwards and backwards in
the schedule's order, a forward waiting for the previous stage's forward of the same
microbatch plus the send, a backward for the next stage's backward plus the send. The
bubble is what the simulated pipeline takes beyond the busiest device's own work; with
equal stages and free sends it is exactly ``(p-1)/m`` (GPipe, 1F1B) or ``(p-1)/(v m)``
(interleaved) of that work.

Memory per device: parameters, gradients and optimizer states of its stages, as the framework
allocates them (:func:`spmdkit.cost.memory.held_for_the_step`; torchtitan under a pipeline
also keeps its FSDP2 parameters gathered and their gradients unsharded in fp32 over the
microbatches), plus the activations of the microbatches it keeps in flight: one microbatch at
its working peak (the liveness peak over the stage's ops, with recomputation, on the same
activation curve as a flat step: :func:`spmdkit.cost.memory.activation_deltas`) and ``n - 1``
more holding what the backward reads (the forward tensors a backward op reads the values
of, at the size they are kept in, in each stage whose backward reads them). ``n``: GPipe ``m``; 1F1B ``min(p - r, m)``
on device ``r``; interleaved, Megatron-LM's warm-up count plus one, ``(p - r - 1) * 2 +
(v - 1) * p + 1`` model chunks (at most ``m v``) of ``1/v`` of the stage each: on the first
device ``p + (p - 1)/v`` stage-microbatches (Narayanan et al. 2021; Korthikanti et al.
2022).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from spmdkit.core.errors import ProgramError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.reshard import Step
from spmdkit.cost.band import error_band
from spmdkit.cost.collectives import Fabric, Group, collective_time
from spmdkit.cost.compute import guess_tokens, model_flops, op_cost
from spmdkit.cost.context import cp_ops
from spmdkit.cost.devices import Device
from spmdkit.cost.memory import (
    MICROBATCH,
    ActivationMemory,
    Memory,
    activation_deltas,
    held_for_the_step,
    local_numel,
    makes_no_copy,
    peak_of,
    per_microbatch_mode,
    saved_activations,
    value_inputs,
    with_overheads,
)
from spmdkit.cost.step import Bucket, OpComm, Reducer, op_communication, param_gather_time
from spmdkit.models.source import HFModel, Loaded, ModelSource, Preset, ProgramFile, load
from spmdkit.models.zoo import Model, preset
from spmdkit.planner.pipeline_moe import MoeMemory, moe_memory
from spmdkit.planner.planning import MAX_LAYERS, MAX_SIZE, parse_size, plan_preset, plan_program
from spmdkit.program.ir import Program
from spmdkit.program.layers import layer_tags
from spmdkit.program.plan import Plan
from spmdkit.strategies.strategy import parse_mesh, parse_strategy

SCHEDULES = ("gpipe", "1f1b", "interleaved")
_SCHEDULE_ALIASES = {"interleaved-1f1b": "interleaved", "interleaved1f1b": "interleaved", "1F1B": "1f1b",
                     "GPipe": "gpipe"}
MAX_MICROBATCHES = 1 << 16
#: The most (virtual stage, microbatch) pairs a schedule simulates (about a second of Python).
MAX_UNITS = 1 << 19


@dataclass(frozen=True)
class PipelineSpec:
    pp: int
    microbatches: int
    schedule: str
    virtual: int
    stages: tuple[int, ...] | None = None  # layers per virtual stage, when given


def _int(flag: str, text: Any, hi: int) -> int | None:
    return parse_size(flag, text, hi)


def parse_spec(pp: int, microbatches: Any = None, schedule: Any = None, virtual: Any = None,
               stages: Any = None) -> PipelineSpec:
    m = _int("--microbatches", microbatches, MAX_MICROBATCHES) or 1
    sched = str(schedule).strip() if schedule is not None else None
    if sched is not None:
        sched = _SCHEDULE_ALIASES.get(sched, sched.lower())
        if sched not in SCHEDULES:
            raise ProgramError(f"--schedule {sched[:40]!r}: unknown schedule (one of {', '.join(SCHEDULES)})")
    v = _int("--virtual-stages", virtual, 1024)
    if sched is None:
        sched = "interleaved" if v and v > 1 else "1f1b"
    if sched != "interleaved" and v not in (None, 1):
        raise ProgramError(f"--virtual-stages {v}: model chunks apply to --schedule interleaved, not {sched}")
    if sched == "interleaved":
        v = v or 2
        if m % pp:
            raise ProgramError(f"--schedule interleaved: --microbatches {m} is not a multiple of pp={pp} "
                               f"(Megatron-LM's interleaved schedule needs it)")
    if pp * (v or 1) * m > MAX_UNITS:
        raise ProgramError(f"--microbatches {m}: {m} microbatches x {pp * (v or 1)} stages is more than "
                           f"{MAX_UNITS:,} forward units to simulate")
    counts = None
    if stages is not None:
        parts = [s.strip() for s in str(stages).split(",") if s.strip()]
        if not parts or not all(s.isascii() and s.isdigit() and len(s) <= 6 for s in parts):
            raise ProgramError(f"--stages {str(stages)[:60]!r}: expected layers per stage as integers, e.g. 20,20,20,20")
        counts = tuple(int(s) for s in parts)
    return PipelineSpec(pp, m, sched, v or 1, counts)


def split_layers(n_layers: int, spec: PipelineSpec, balance: Callable[[int], tuple[int, ...]] | None = None
                 ) -> tuple[int, ...]:
    """Layers per virtual stage (``pp * virtual`` of them): ``--stages`` as given, else evenly;
    layers that do not divide evenly are split by ``balance(n)`` (:func:`balanced_split` over
    the planned costs, :func:`auto_counts`), or refused without one."""
    n = spec.pp * spec.virtual
    what = f"pp={spec.pp}" + (f" x {spec.virtual} virtual stages" if spec.virtual > 1 else "")
    if n_layers < n:
        raise ProgramError(f"--mesh {what}: {n_layers} layers cannot fill {n} stages (each needs at least one layer)")
    if spec.stages is not None:
        if len(spec.stages) != n:
            raise ProgramError(f"--stages: {len(spec.stages)} stage sizes given, {what} has {n} stages")
        if sum(spec.stages) != n_layers or min(spec.stages) < 1:
            raise ProgramError(f"--stages {','.join(map(str, spec.stages))}: must be {n} counts >= 1 summing to "
                               f"the model's {n_layers} layers")
        return spec.stages
    if n_layers % n:
        if balance is not None:
            return balance(n)
        raise ProgramError(f"--mesh {what}: {n_layers} layers do not divide evenly into {n} stages "
                           f"(give --stages, e.g. {','.join(map(str, even_split(n_layers, n)))})")
    return (n_layers // n,) * n


def even_split(total: int, n: int) -> list[int]:
    """``total`` layers in ``n`` stages as evenly as they go (the first stages one more)."""
    return [total // n + (1 if i < total % n else 0) for i in range(n)]


def balanced_split(layer_costs: list[float], n: int, first: float = 0.0, last: float = 0.0) -> tuple[int, ...]:
    """The layers (each of cost ``layer_costs[i]``) cut into ``n`` contiguous stages of at
    least one layer, the first stage also paying ``first`` (the embedding), the last ``last``
    (the final norm, the head and the loss), so that the costliest stage is as cheap as it can
    be (binary search on that bound, each bound checked by packing the stages greedily).
    Among the splits that reach it, the layers go to the middle stages first: the last stage
    packed from the back, then the middle ones, the first stage taking what is left (fewer
    layers on the first stage, which also keeps the most microbatches in flight), as Megatron
    users split Llama 3.1 405B's 126 layers on 16 stages: 7, 8 x 14, 7."""
    L = len(layer_costs)
    if not 1 <= n <= L:
        raise ProgramError(f"--stages: {L} layers cannot fill {n} stages (each needs at least one layer)")
    tol = 1e-9 * (sum(layer_costs) + first + last + 1e-300)

    def pack(bound: float) -> list[int] | None:
        """Counts, stage n-1 first, each stage as full as ``bound`` allows (None: does not fit)."""
        counts: list[int] = []
        hi = L  # layers [0, hi) not yet placed
        for k in range(n - 1, 0, -1):
            cost, c = (last if k == n - 1 else 0.0), 0
            while hi - c > k and (c == 0 or cost + layer_costs[hi - c - 1] <= bound + tol):
                cost += layer_costs[hi - c - 1]
                c += 1
            if cost > bound + tol:
                return None
            counts.append(c)
            hi -= c
        if first + sum(layer_costs[:hi]) + (last if n == 1 else 0.0) > bound + tol:
            return None
        counts.append(hi)
        return counts[::-1]

    lo_b = max(max(layer_costs), first + layer_costs[0], last + layer_costs[-1])
    hi_b = sum(layer_costs) + first + last
    best = pack(hi_b)
    for _ in range(100):
        if hi_b - lo_b <= tol:
            break
        mid = (lo_b + hi_b) / 2
        got = pack(mid)
        if got is None:
            lo_b = mid
        else:
            best, hi_b = got, mid
    got = pack(lo_b)
    out = got if got is not None else best
    assert out is not None and sum(out) == L
    return tuple(out)


def op_units(prog: Program) -> tuple[list[int], int]:
    """(each op's layer, the count of layers): the index in :func:`layer_tags` of its label; -1
    for the embedding (``embedding``, and an unnumbered op before the first layer's); the count
    for the head (``head``); an optimizer update its parameter's; any other op the unit of the
    op before it (the final norm, the head and the loss follow the last layer; in the backward,
    the embedding's gradient follows the first layer's)."""
    index = {t: k for k, t in enumerate(layer_tags(prog))}
    n = len(index)
    out: list[int] = []
    param_unit: dict[str, int] = {}
    prev = -1
    for op in prog.ops:
        tag = op.layer
        u = index.get(tag)
        if u is None:
            if tag == "embedding":
                u = -1
            elif tag == "head":
                u = n
            elif op.phase == "optimizer":
                u = next((param_unit[x] for x in op.input_names() if x in param_unit), prev)
            else:
                u = prev
        if op.phase == "forward":
            for x in op.input_names():
                if prog.tensors[x].kind == "parameter":
                    param_unit.setdefault(x, u)
        out.append(u)
        prev = u
    return out, n


def op_stages(prog: Program, counts: tuple[int, ...], units: tuple[list[int], int] | None = None) -> list[int]:
    """The virtual stage of every op (:func:`op_units`: the embedding with the first stage, the
    head and the loss with the last, an optimizer update with its parameter's stage)."""
    unit, n_layers = units if units is not None else op_units(prog)
    last = len(counts) - 1
    of_layer: list[int] = []
    for s, c in enumerate(counts):
        of_layer.extend([s] * c)
    of_layer.extend([last] * max(0, n_layers - len(of_layer)))
    return [0 if u < 0 else (of_layer[u] if u < n_layers else last) for u in unit]


def auto_counts(plan: Plan, n: int, op_times: list[float] | None = None,
                units: tuple[list[int], int] | None = None) -> tuple[int, ...]:
    """Layers per stage for ``n`` stages, balanced by cost (:func:`balanced_split`): each
    layer's, the embedding's and the head's forward and backward time (``op_times``, one per
    op: :func:`spmdkit.cost.step.op_communication`'s compute and wait) or, without times, their
    FLOPs (:func:`spmdkit.cost.compute.op_cost`)."""
    unit, n_layers = units if units is not None else op_units(plan.program)
    costs = [0.0] * (n_layers + 2)  # the embedding, the layers, the head
    for i, op in enumerate(plan.program.ops):
        if op.phase == "optimizer":
            continue
        costs[unit[i] + 1] += op_times[i] if op_times is not None else op_cost(plan, i).flops
    return balanced_split(costs[1:-1], n, costs[0], costs[-1])


def split_note(counts: tuple[int, ...], n_layers: int, spec: PipelineSpec, timed: bool = True) -> str | None:
    """The one-line note of a split chosen for layers that do not divide into the stages
    (None when they do, or ``--stages`` gave it); ``timed``: balanced by predicted time, else
    by FLOPs."""
    n = len(counts)
    if spec.stages is not None or n_layers % n == 0:
        return None
    return (f"note: {n_layers} layers do not divide evenly into {n} stages: split {','.join(map(str, counts))} "
            f"(balanced by {'predicted time' if timed else 'FLOPs'}: the first stage also holds the embedding, the "
            f"last the head and the loss; --stages overrides)")


# -- schedules ----------------------------------------------------------------------------------


def schedule_order(schedule: str, p: int, v: int, m: int, r: int) -> list[tuple[str, int, int]]:
    """Device ``r``'s work in order: ("F" | "B", virtual stage, microbatch)."""
    if schedule == "gpipe":
        return [("F", r, i) for i in range(m)] + [("B", r, i) for i in range(m)]
    if schedule == "1f1b":
        warm = min(p - r - 1, m)
        order = [("F", r, i) for i in range(warm)]
        for i in range(m - warm):
            order += [("F", r, warm + i), ("B", r, i)]
        return order + [("B", r, i) for i in range(m - warm, m)]
    total = m * v

    def unit(k: int, forward: bool) -> tuple[int, int]:
        chunk = (k % (p * v)) // p
        if not forward:
            chunk = v - 1 - chunk
        return chunk * p + r, (k // (p * v)) * p + k % p

    warm = min((p - r - 1) * 2 + (v - 1) * p, total)
    order = [("F", *unit(k, True)) for k in range(warm)]
    for j in range(total - warm):
        order += [("F", *unit(warm + j, True)), ("B", *unit(j, False))]
    return order + [("B", *unit(k, False)) for k in range(total - warm, total)]


def in_flight(schedule: str, p: int, v: int, m: int, r: int) -> float:
    """Microbatches of a whole stage whose activations device ``r`` holds at its peak."""
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(p - r, m))
    return min((p - r - 1) * 2 + (v - 1) * p + 1, m * v) / v


@dataclass
class ScheduleRun:
    finish_s: list[float]   # per device: the end of its last backward
    busy_s: list[float]     # per device: its own forward + backward work
    last_backward_s: list[float]
    #: every unit run: (device, "F" | "B", virtual stage, microbatch, start s, end s)
    units: list[tuple[int, str, int, int, float, float]] = field(default_factory=list, repr=False)

    @property
    def pipeline_s(self) -> float:
        return max(self.finish_s)

    @property
    def bubble_s(self) -> float:
        return self.pipeline_s - max(self.busy_s)

    @property
    def bubble_fraction(self) -> float:
        w = max(self.busy_s)
        return self.bubble_s / w if w > 0 else 0.0


def run_schedule(schedule: str, p: int, v: int, m: int, fwd: list[float], bwd: list[float],
                 send_f: list[float] | None = None, send_b: list[float] | None = None,
                 blocking_sends: bool | None = None) -> ScheduleRun:
    """Simulate the schedule: ``fwd[k]`` / ``bwd[k]`` the time of virtual stage ``k`` for one
    microbatch, ``send_f[k]`` / ``send_b[k]`` the time to send its output activations to stage
    ``k+1`` / the gradients of its inputs to ``k-1`` (``send_b[k]`` is stage ``k+1``'s send back
    to ``k``). ``blocking_sends`` (default: every schedule but interleaved): the sender waits for
    its send to complete before its next unit, as Megatron-LM's 1F1B does (its p2p calls wait on
    the exchange); the interleaved schedule overlaps its sends with the next unit's compute
    (Megatron's ``overlap_p2p_comm``), so there only the receiver waits."""
    if blocking_sends is None:
        blocking_sends = schedule != "interleaved"
    n = p * v
    sf = send_f or [0.0] * n
    sb = send_b or [0.0] * n
    orders = [schedule_order(schedule, p, v, m, r) for r in range(p)]
    done: dict[tuple[str, int, int], float] = {}
    pos = [0] * p
    free = [0.0] * p
    last_b = [0.0] * p
    units: list[tuple[int, str, int, int, float, float]] = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(p):
            while pos[r] < len(orders[r]):
                kind, k, i = orders[r][pos[r]]
                if kind == "F":
                    dep = 0.0 if k == 0 else (None if ("F", k - 1, i) not in done else done[("F", k - 1, i)] + sf[k - 1])
                    dur = fwd[k]
                else:
                    if k == n - 1:
                        dep = done.get(("F", k, i))
                    else:
                        dep = None if ("B", k + 1, i) not in done else done[("B", k + 1, i)] + sb[k]
                    dur = bwd[k]
                if dep is None:
                    break
                start = max(free[r], dep)
                free[r] = start + dur
                units.append((r, kind, k, i, start, free[r]))
                done[(kind, k, i)] = free[r]
                if blocking_sends:
                    free[r] += (sf[k] if k < n - 1 else 0.0) if kind == "F" else (sb[k - 1] if k > 0 else 0.0)
                if kind == "B":
                    last_b[r] = dur
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # cannot happen for the three schedules; never loop forever
            raise ProgramError(f"--schedule {schedule}: the schedule deadlocks (p={p}, v={v}, m={m})")
    busy = [m * sum(fwd[c * p + r] + bwd[c * p + r] for c in range(v)) for r in range(p)]
    return ScheduleRun(free, busy, last_b, units)


def bubble_formula(schedule: str, p: int, v: int, m: int) -> float:
    return (p - 1) / (v * m) if schedule == "interleaved" else (p - 1) / m


# -- per-stage costs ------------------------------------------------------------------------------


@dataclass
class StageCost:
    """One virtual stage, for one microbatch (times in s, bytes per device)."""

    layers: int
    ops: int = 0
    forward_s: float = 0.0
    backward_s: float = 0.0
    grad_sync_s: float = 0.0
    optimizer_s: float = 0.0
    send_bytes: int = 0       # activations sent to the next stage (its gradients come back alike)
    send_grad_bytes: int = 0  # gradients sent to the previous stage
    parameters: int = 0
    gradients: int = 0
    optimizer_states: int = 0
    stash_bytes: int = 0      # what one microbatch keeps for the backward
    recompute_s: float = 0.0  # the forward ops --recompute runs again in the backward
    working_peak: int = 0     # the liveness peak of one microbatch through the stage
    #: torchtitan's FSDP2 under a pipeline: the stage's parameters held gathered (16-bit) and
    #: their gradients accumulated unsharded (fp32) over the microbatches
    unsharded_parameters: int = 0
    unsharded_gradients: int = 0
    peak_op: int = 0
    flops: float = 0.0
    #: the parameter gradients' reductions: (share of the stage's backward done when the
    #: gradient is made, its dtype, the reduction, its bytes, its layer); timed in buckets
    grads: list[tuple[float, str, Step, int, str]] = field(default_factory=list, repr=False)

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "grads"}


def stage_costs(plan: Plan, stages: list[int], counts: tuple[int, ...], device: Device | None = None,
                recompute: str = "none", oc: OpComm | None = None) -> list[StageCost]:
    """Per stage: parameters, gradients and states, the stash and working peak of one
    microbatch, the bytes sent, and (``device``) the times. ``recompute`` (none, selective,
    full; :func:`spmdkit.cost.memory.saved_activations`): the activations a recomputed region makes are not
    stashed (they are made again), and its ops' times go to ``recompute_s``. ``oc``: the ops'
    times on ``device`` when already computed (:func:`spmdkit.cost.step.op_communication`)."""
    saved = saved_activations(plan, recompute)
    out = [StageCost(c) for c in counts]
    nbytes = _LocalBytes(plan)
    param_grads, producer = _held_for_the_step(plan, stages, out, nbytes)

    def transient(nm: str) -> bool:
        t = plan.program.tensors[nm]
        return not (nm in param_grads or t.inplace_of or t.kind in ("parameter", "optimizer_state"))

    _stash_and_sends(plan, stages, out, nbytes, producer, transient, saved)
    for s, d in enumerate(activation_deltas(plan, saved, stages, len(out))):
        out[s].working_peak, out[s].peak_op, _ = peak_of(d)
    if device is not None:
        _stage_times(plan, stages, out, oc or op_communication(plan, device), {j for r in saved.recomputed for j in r})
    return out


class _LocalBytes:
    """A tensor's local bytes under the plan (its largest shard), computed once."""

    def __init__(self, plan: Plan) -> None:
        self.tensors = plan.program.tensors
        self.attrs = plan.attrs
        self.sizes: dict[str, int] = {}

    def __call__(self, name: str) -> int:
        b = self.sizes.get(name)
        if b is None:
            t = self.tensors[name]
            b = self.sizes[name] = int(local_numel(self.attrs[name], t.shape) * t.itemsize)
        return b


def _held_for_the_step(plan: Plan, stages: list[int], out: list[StageCost],
                       nbytes: _LocalBytes) -> tuple[dict[str, int], dict[str, int]]:
    """Count each stage's ops, parameters, parameter gradients and optimizer states (as the
    framework holds them: :func:`spmdkit.cost.memory.held_for_the_step`); (parameter gradient
    -> its stage, tensor -> the op that makes it)."""
    prog = plan.program
    held = held_for_the_step(plan)
    # torchtitan under a pipeline keeps FSDP2's parameters gathered over the microbatches
    # (parallelize_llama.apply_fsdp: reshard_after_forward=False when pp is enabled) and
    # torch.distributed.pipelining accumulates their gradients unsharded until the last
    # microbatch (set_requires_gradient_sync(False)), in the fp32 reduce dtype
    gathered: dict[str, tuple[int, int]] = {}
    if plan.runtime.fsdp2:  # AutoModel too (reshard_after_forward=not pp_enabled)
        for r in plan.reshards:
            if r.tensor in plan.storage and r.tensor not in gathered and not makes_no_copy(plan, r):
                t = prog.tensors[r.tensor]
                n = local_numel(r.dst, t.shape)
                gathered[r.tensor] = (n * t.itemsize, n * 4)
    param_grads: dict[str, int] = {}
    counted_params: set[str] = set()
    for i, op in enumerate(prog.ops):
        out[stages[i]].ops += 1
        if op.phase == "optimizer":
            s = stages[i]
            for nm in op.input_names():
                t = prog.tensors[nm]
                if t.kind == "gradient" and nm not in param_grads:
                    param_grads[nm] = s
                elif t.kind == "parameter" and not t.inplace_of and nm not in counted_params:
                    counted_params.add(nm)
                    p, g, st = held.get(nm) or (nbytes(nm), 0, 0)
                    out[s].parameters += p
                    out[s].gradients += g
                    out[s].optimizer_states += st
                    out[s].unsharded_parameters += gathered.get(nm, (0, 0))[0]
                    out[s].unsharded_gradients += gathered.get(nm, (0, 0))[1]
    producer: dict[str, int] = {}
    for i, op in enumerate(prog.ops):
        for nm in op.output_names():
            producer.setdefault(nm, i)
        if op.phase == "forward":
            for nm in op.input_names():
                t = prog.tensors[nm]
                if t.kind == "parameter" and nm not in counted_params:  # a parameter without an update
                    counted_params.add(nm)
                    out[stages[i]].parameters += nbytes(nm)
    return param_grads, producer


def _stash_and_sends(plan: Plan, stages: list[int], out: list[StageCost], nbytes: _LocalBytes,
                     producer: dict[str, int], transient: Callable[[str], bool], saved: ActivationMemory) -> None:
    """The activations crossing stages (sent forward, their gradients sent back) and the stash:
    what one microbatch keeps for the backward (``saved``: the forward tensors a backward op
    reads the values of, less those recomputation makes again, at the size they are kept in),
    held by each stage whose backward reads it (a stage keeps the input it received; Megatron-LM
    frees the output it sent). A tensor made from the data and constants alone, no parameter
    (an imported model's attention mask, its rotary cos and sin) is not sent: each stage makes
    its own, as each stage of Megatron-LM makes its masks and rotary tables."""
    prog = plan.program
    crossing: dict[str, tuple[int, int]] = {}
    readers: dict[str, set[int]] = {}
    local: set[str] = set()  # made without a parameter, from the data and constants
    for i, op in enumerate(prog.ops):
        b = stages[i]
        if op.phase == "backward":
            for nm in value_inputs(op):
                readers.setdefault(nm, set()).add(b)
        if op.phase != "forward":
            continue
        ins = op.input_names()
        if all(nm in local or (nm not in producer and prog.tensors[nm].kind != "parameter") for nm in ins):
            local.update(op.output_names())
        for nm in ins:
            j = producer.get(nm)
            if j is None or not transient(nm) or nm in local:
                continue
            a = stages[j]
            if prog.ops[j].phase == "forward" and b > a:
                _lo, hi = crossing.get(nm, (a, a))
                crossing[nm] = (a, max(hi, b))
    for lst in saved.tensors.values():
        for nm, size in lst:
            for s in readers.get(nm, ()):
                out[s].stash_bytes += size
    for nm, (a, b) in crossing.items():
        size = nbytes(nm)
        g = nm + ".grad"
        gsize = nbytes(g) if g in prog.tensors and g in plan.attrs else size
        for k in range(a, b):
            out[k].send_bytes += size
            out[k + 1].send_grad_bytes += gsize


def _stage_times(plan: Plan, stages: list[int], out: list[StageCost], oc: OpComm, rerun: set[int]) -> None:
    """Each stage's forward, backward, recomputation and optimizer times (each op's compute and
    the communication it waits on: :func:`spmdkit.cost.step.op_communication`, the step's own
    model), its gradient reductions (where in its backward each gradient is made) and their
    time in buckets (:class:`spmdkit.cost.step.Reducer`), on ``device``."""
    made: list[list[tuple[float, str, Step, int, str]]] = [[] for _ in out]
    gathers: list[list[tuple[tuple[int, ...], float, int]]] = [[] for _ in out]
    for i, op in enumerate(plan.program.ops):
        c = oc.costs[i]
        t = oc.compute[i] + oc.wait[i]
        sc = out[stages[i]]
        if i in rerun:
            sc.recompute_s += t
        sc.flops += c.flops
        if op.phase == "forward":
            sc.forward_s += t
        elif op.phase == "backward":
            sc.backward_s += t
        else:
            sc.optimizer_s += t
        for dt, st, size in oc.pending.get(i, ()):
            made[stages[i]].append((sc.backward_s, dt, st, size, op.layer))
        gathers[stages[i]] += oc.param_gathers.get(i, [])
    for sc, items in zip(out, gathers):
        # Megatron's overlap_param_gather: under the next step's first forward on the stage
        sc.optimizer_s += max(0.0, param_gather_time(plan, items) - sc.forward_s) if items else 0.0
    for sc, grads in zip(out, made):
        sc.grads = [(at / sc.backward_s if sc.backward_s > 0 else 1.0, dt, st, size, layer)
                    for at, dt, st, size, layer in grads]
        red = Reducer(plan)
        for _f, dt, st, size, layer in sc.grads:
            red.add(dt, st, size, 0.0, layer)
        sc.grad_sync_s = red.flush(0.0)


def reduce_gradients(plan: Plan, grads: list[tuple[float, str, Step, int, str]], end: float,
                     single: bool = False) -> tuple[float, list[Bucket]]:
    """One pipeline device's gradient reductions, ``grads`` as (time made, dtype, reduction,
    bytes, layer): in the framework's buckets from the time each is made, or (``single``) all
    in one bucket launched at ``end``, the end of the device's last backward; (when the last is
    done, the buckets)."""
    red = Reducer(plan, single=single)
    for at, dt, st, size, layer in sorted(grads, key=lambda g: g[0]):
        red.add(dt, st, size, end if single else at, layer)
    return red.flush(end), red.buckets


# -- the whole pipeline ---------------------------------------------------------------------------


@dataclass
class PipelineEstimate:
    spec: PipelineSpec
    counts: tuple[int, ...]
    stages: list[StageCost]
    pp_link: tuple[float, float]          # (latency s, s per byte)
    send_f_s: list[float]
    send_b_s: list[float]
    in_flight: list[float]
    memory: list[Memory]
    run: ScheduleRun | None = None
    step_serial_s: float = 0.0
    step_overlap_s: float = 0.0
    tokens: int | None = None
    model_flops: float = 0.0
    ranks: int = 0
    peak: float = 0.0
    device_name: str = ""
    device_memory: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    #: the one-line note of a split chosen for layers that do not divide into the stages
    note: str | None = None
    #: a MoE plan's fullest rank split into experts and the rest (pipeline_moe.moe_memory)
    moe: MoeMemory | None = None
    #: the context-parallel degree of the stages' plan (its error band is the cp runs')
    cp: int = 1

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.step_overlap_s if self.tokens and self.step_overlap_s > 0 else None

    @property
    def mfu(self) -> float | None:
        if not self.tokens or self.step_overlap_s <= 0 or self.peak <= 0:
            return None
        return self.model_flops / (self.step_overlap_s * self.ranks * self.peak)

    @property
    def tflops_per_gpu(self) -> float | None:
        """Model FLOP/s per GPU (Narayanan et al.'s "achieved teraFLOP/s per GPU" counts the
        recomputation too; this counts the model FLOPs only)."""
        if not self.tokens or self.step_overlap_s <= 0:
            return None
        return self.model_flops / (self.step_overlap_s * self.ranks) / 1e12

    def to_json(self) -> dict[str, Any]:
        s = self.spec
        out: dict[str, Any] = {
            "pp": s.pp, "microbatches": s.microbatches, "schedule": s.schedule, "virtual_stages": s.virtual,
            "layers_per_stage": list(self.counts), "split_note": self.note, "bubble_formula": bubble_formula(s.schedule, s.pp, s.virtual,
                                                                                    s.microbatches),
            "pp_link": {"latency_s": self.pp_link[0], "s_per_byte": self.pp_link[1]},
            "stages": [{**st.to_json(), "send_s": self.send_f_s[k], "send_grad_s": self.send_b_s[k - 1] if k else 0.0}
                       for k, st in enumerate(self.stages)],
            "devices": [{"stage": r, "in_flight_microbatches": self.in_flight[r], "memory": self.memory[r].to_json()}
                        for r in range(s.pp)]}
        if self.moe is not None:
            out["moe_memory"] = self.moe.to_json()
        if "microbatch_recompute" in self.extra:
            out["microbatch_recompute"] = self.extra["microbatch_recompute"]
        if self.run is not None:
            out.update({"pipeline_s": self.run.pipeline_s, "bubble_s": self.run.bubble_s,
                        "bubble_fraction": self.run.bubble_fraction, "busy_s": self.run.busy_s,
                        "step_serial_s": self.step_serial_s, "step_overlap_s": self.step_overlap_s,
                        "tokens": self.tokens, "tokens_per_s": self.tokens_per_s, "model_flops": self.model_flops,
                        "ranks": self.ranks, "peak_flops": self.peak, "mfu": self.mfu,
                        "model_tflops_per_gpu": self.tflops_per_gpu,
                        "error_band": band.to_json() if (band := error_band(self.device_name, self.cp > 1)) is not None
                        else None})
        return out


def estimate_pipeline(plan: Plan, spec: PipelineSpec, counts: tuple[int, ...] | None, device: Device | None = None,
                      pp_link: tuple[float, float] = (20e-6, 1 / 25e9), tokens: int | None = None,
                      ranks: int | None = None, recompute_forward: bool = False,
                      recompute: str = "none") -> PipelineEstimate:
    """The pipeline of ``plan`` (ONE microbatch's step on the sub-mesh without pp).
    ``recompute_forward``: time only, each stage's forward run again before its backward (full
    activation recomputation, as Narayanan et al. 2021 train; benchmarks/megatron_table.py);
    the memory stays that of a step without recomputation. ``recompute`` (``--recompute``):
    the recomputed regions' activations leave each stage's stash and their ops' times are
    added to its backward (:func:`stage_costs`); ``microbatch`` (Korthikanti et al. 2022,
    App. C): each rank keeps every activation of as many of its in-flight microbatches as fit
    in ``device``'s memory and recomputes the attention core of the others, its backward
    paying the selective recomputation for that share of its microbatches. ``counts`` None:
    the layers split by :func:`auto_counts` (by time on ``device``, else by FLOPs), the split
    named in the estimate's ``note``."""
    p, v, m = spec.pp, spec.virtual, spec.microbatches
    units = op_units(plan.program)
    oc = op_communication(plan, device) if device is not None else None
    note = None
    if counts is None:
        times = [a + b for a, b in zip(oc.compute, oc.wait)] if oc is not None else None
        counts = split_layers(units[1], spec, balance=lambda n: auto_counts(plan, n, times, units))
        note = split_note(counts, units[1], spec, times is not None)
    stages = op_stages(plan.program, counts, units)
    costs = stage_costs(plan, stages, counts, device, per_microbatch_mode(recompute), oc)
    n = p * v
    send = _sender(p, pp_link, device)

    send_f = [send(costs[k].send_bytes) if k < n - 1 else 0.0 for k in range(n)]
    send_b = [send(costs[k + 1].send_grad_bytes) if k < n - 1 else 0.0 for k in range(n)]
    flight = [in_flight(spec.schedule, p, v, m, r) for r in range(p)]
    mems = [_rank_memory(plan, [costs[c * p + r] for c in range(v)], flight[r], p, v) for r in range(p)]
    recomputed = [1.0] * p  # the share of each rank's microbatches whose recomputed regions run again
    if recompute == MICROBATCH:
        whole = stage_costs(plan, stages, counts, None, "none")
        cap = device.memory_bytes if device is not None else 0
        for r in range(p):
            chunks = max(1, round(flight[r] * v))
            mine, full = [costs[c * p + r] for c in range(v)], [whole[c * p + r] for c in range(v)]
            for kept in range(chunks, 0, -1):  # the most microbatch-chunks kept whole that fit
                got = _rank_memory(plan, mine, flight[r], p, v, kept, full)
                if got.device_total <= cap:
                    mems[r], recomputed[r] = got, 1.0 - kept / chunks
                    break
    est = PipelineEstimate(spec, counts, costs, pp_link, send_f, send_b, flight, mems, note=note,
                           moe=moe_memory(plan, stages, counts, p, mems, flight, costs),
                           cp=max((c.ranks for c in cp_ops(plan)), default=1))
    if recompute == MICROBATCH:
        est.extra["microbatch_recompute"] = {"recomputed_share": recomputed}
    if device is None:
        return est
    bwd = [c.backward_s + c.recompute_s * recomputed[k % p] + (c.forward_s if recompute_forward else 0.0)
           for k, c in enumerate(costs)]
    run = run_schedule(spec.schedule, p, v, m, [c.forward_s for c in costs], bwd,
                       send_f, send_b, None if plan.runtime.p2p_overlap else True)
    est.run = run
    est.step_serial_s, est.step_overlap_s = _step_times(plan, spec, costs, run)
    mb_tokens = tokens // m if tokens else 0
    mf, _n, _att = model_flops(plan, mb_tokens)
    est.tokens, est.model_flops = tokens, mf * m if tokens else 0.0
    est.ranks = ranks or plan.mesh.size * p
    dtypes = [t.dtype for t in plan.program.tensors.values() if t.kind == "parameter"]
    est.peak = device.matmul_peak(max(set(dtypes), key=dtypes.count) if dtypes else "float32")
    est.device_name = device.name
    est.device_memory = device.memory_bytes
    return est


def _rank_memory(plan: Plan, mine: list[StageCost], flight: float, p: int, v: int, kept: int = 0,
                 whole: list[StageCost] | None = None) -> Memory:
    """One pipeline rank's memory (its stages ``mine``, ``flight`` stage-microbatches in flight,
    held in ``round(flight * v)`` model-chunk units): the working peak of one microbatch plus
    the stash of the others. ``kept`` > 0 (microbatch-level recomputation): that many units
    keep every activation (``whole``: the stages without recomputation), the working one
    among them; the others keep ``mine``'s stash."""
    stash = sum(c.stash_bytes for c in mine)
    units = max(1, round(flight * v))
    if kept and whole is not None:
        work = max(c.working_peak for c in whole)
        act = work + round((kept - 1) * sum(c.stash_bytes for c in whole) / v + (units - kept) * stash / v)
        peak_op = max(whole, key=lambda c: c.working_peak).peak_op
    else:
        work = max(c.working_peak for c in mine)
        act = work + round(max(0.0, flight - 1.0 / v) * stash) if v > 1 else work + round((flight - 1) * stash)
        peak_op = max(mine, key=lambda c: c.working_peak).peak_op
    up = sum(c.unsharded_parameters for c in mine) if p > 1 else 0
    ug = sum(c.unsharded_gradients for c in mine) if p > 1 else 0
    return with_overheads(sum(c.parameters for c in mine) + up, sum(c.gradients for c in mine) + ug,
                          sum(c.optimizer_states for c in mine), act, peak_op, plan, p)


def _sender(p: int, pp_link: tuple[float, float], device: Device | None) -> Callable[[int], float]:
    """The time of one pipeline send of ``b`` bytes: NCCL's send/recv
    (:func:`spmdkit.cost.collectives.collective_time`) over the device's link the pp dim
    takes (NVLink in a node, the GPU's NIC across nodes), or ``alpha + b beta`` of a link the
    device does not have (``--cost pp=...``)."""
    alpha, beta = pp_link
    scope = None
    if device is not None:
        for where, link in (("intra_node", device.intra), ("inter_node", device.inter)):
            c = link.cost()
            if abs(c.alpha_s - alpha) <= 1e-12 and abs(c.beta_s_per_byte - beta) <= 1e-6 * beta:
                scope = where
                break
    fabric = Fabric.of(device.intra.bytes_per_s, device.inter.bytes_per_s, device.ranks_per_node,
                       device.measured) if device is not None and scope else None
    group = Group(2, 2 if scope == "intra_node" else 1)

    def send(b: int) -> float:
        if p == 1 or b == 0:
            return 0.0
        if fabric is not None:
            return collective_time("send_recv", b, group, fabric)
        return alpha + b * beta

    return send


def _step_times(plan: Plan, spec: PipelineSpec, costs: list[StageCost], run: ScheduleRun) -> tuple[float, float]:
    """(serial, overlapped) step: each device's schedule, then its gradient reductions and its
    optimizer. Overlapped: the reductions in the framework's buckets from the time the last
    microbatch's backward makes each gradient (Megatron's ``overlap_grad_reduce``); Megatron-Core
    buckets only on the first pipeline rank and gives every other rank one bucket after its last
    backward (its reductions are off the critical path: those ranks finish first); the step
    ends when the slowest device is done (the optimizer's gradient norm spans every stage)."""
    p, v = spec.pp, spec.virtual
    last: dict[int, tuple[float, float]] = {}
    for _r, kind, k, i, start, end in run.units:
        if kind == "B" and i == spec.microbatches - 1:
            last[k] = (start, end)
    serial, overlap = [], []
    for r in range(p):
        grads: list[tuple[float, str, Step, int, str]] = []
        for c in range(v):
            k = c * p + r
            start, end = last.get(k, (run.finish_s[r], run.finish_s[r]))
            grads += [(start + f * (end - start), dt, st, size, layer)
                      for f, dt, st, size, layer in costs[k].grads]
        o = sum(costs[c * p + r].optimizer_s for c in range(v))
        g = sum(costs[c * p + r].grad_sync_s for c in range(v))
        single = plan.runtime.framework == "megatron" and r > 0
        done, _b = reduce_gradients(plan, grads, run.finish_s[r], single)
        serial.append(run.finish_s[r] + g + o)
        overlap.append(done + o)
    return max(serial), max(overlap)


# -- planning ----------------------------------------------------------


def sub_mesh_text(mesh: ProcessMesh) -> tuple[int, str]:
    """(pp size, the mesh text without pp)."""
    names, sizes = list(mesh.dim_names), list(mesh.shape)
    pp = 1
    if "pp" in names:
        k = names.index("pp")
        pp = sizes[k]
        del names[k], sizes[k]
    if not names:
        names, sizes = ["dp"], [1]
    return pp, ",".join(f"{a}={b}" for a, b in zip(names, sizes))


@dataclass
class PipelinePlan:
    """A model planned for a pipeline: the plan of ONE microbatch's step on the sub-mesh
    without pp, the pipeline's spec, its layers and their split (None: layers that do not
    divide into the stages, balanced by :func:`estimate_pipeline` over the plan's costs)."""

    loaded: Loaded
    plan: Plan
    spec: PipelineSpec
    layers: int
    counts: tuple[int, ...] | None
    seconds: float
    #: tokens per step (every microbatch), None where the program has no token input
    tokens: int | None
    #: sequences per microbatch and per step
    microbatch: int | None = None
    batch: int | None = None


def _no_layers(prog: Program, pp: int) -> ProgramError:
    labels = sorted({op.layer for op in prog.ops if op.phase == "forward"})
    return ProgramError(f"--mesh pp={pp}: the program has no numbered layers to cut into stages (a pipeline cuts "
                        f"between the groups of ops whose layer label ends in a number, e.g. 'layer 3' or "
                        f"'model.layers.3'; its labels: {', '.join(repr(x) for x in labels[:6]) or 'none'})")


def plan_pipeline_source(source: ModelSource, mesh_text: str, strategy_text: str | None, spec_args: dict[str, Any],
                         user: dict[str, Any] | None = None, cost_text: str | None = None,
                         patterns: Any = None) -> PipelinePlan:
    """A pipeline of ``source`` on ``mesh_text`` (its ``pp`` dim): a preset (its sizes
    overridden as ``source`` says; without a batch each microbatch is the preset's batch), an
    HF model (``source.batch`` the whole step's, cut into the microbatches) or a program file
    (the step of one microbatch as it is). Each is cut into stages by its ops' layer labels
    (:func:`op_stages`), the same way."""
    t0 = time.perf_counter()
    mesh = parse_mesh(mesh_text)
    pp, sub = sub_mesh_text(mesh)
    spec = parse_spec(pp, **spec_args)
    m = spec.microbatches
    cost = pp_cost_text(cost_text, mesh)
    strategy = strategy_text or ("megatron" if not isinstance(source, ProgramFile) else None)
    if isinstance(source, Preset):
        cfg = preset(source.name)
        layers = parse_size("--layers", source.layers, MAX_LAYERS) or cfg.layers
        given = parse_size("--batch", source.batch, MAX_SIZE)
        batch = given or cfg.batch * m  # without --batch, each microbatch is the preset's batch
        split_layers(layers, spec, balance=lambda n: (1,) * n)  # a bad --stages refused before planning
        _check_batch(batch, m)
        over = {"layers": layers, "batch": batch // m, "seq": source.seq}
        loaded, plan, _ = plan_preset(source.name, sub, strategy or "megatron", over, user, cost)
        assert loaded.model is not None
        c = loaded.model.config
        tokens: int | None = c.batch * c.seq * m
        mb: int | None = c.batch
    else:
        if isinstance(source, HFModel):
            _check_batch(source.batch, m)
            parse_strategy(strategy or "megatron", parse_mesh(sub))  # a bad mesh / strategy before importing
            source = replace(source, batch=source.batch // m)
        loaded = load(source)
        layers = len(layer_tags(loaded.program))
        if layers == 0:
            raise _no_layers(loaded.program, pp)
        split_layers(layers, spec, balance=lambda n: (1,) * n)
        _prog, plan = plan_program(loaded.program, sub, strategy, user, patterns, cost)
        one = guess_tokens(plan.program)
        tokens = one * m if one else None
        mb = _batch_of(plan.program)
    counts = split_layers(layers, spec) if layers % (spec.pp * spec.virtual) == 0 or spec.stages else None
    return PipelinePlan(loaded, plan, spec, layers, counts, time.perf_counter() - t0, tokens, mb,
                        mb * m if mb else None)


def _check_batch(batch: int, m: int) -> None:
    if batch % m:
        raise ProgramError(f"--microbatches {m}: does not divide the batch {batch} "
                           f"(each microbatch is batch / microbatches sequences)")


def _batch_of(prog: Program) -> int | None:
    """Sequences per step of a program: the leading size of its token input."""
    for t in prog.tensors.values():
        if t.kind == "input" and (t.name in ("tokens", "input_ids") or (t.dtype in ("int64", "int32")
                                                                        and len(t.shape) == 2)):
            return t.shape[0]
    return None


def plan_pipeline(model_name: str, mesh_text: str, strategy_text: str, spec_args: dict[str, Any],
                  overrides: dict[str, Any] | None = None, user: dict[str, Any] | None = None,
                  cost_text: str | None = None) -> tuple[Model, Plan, PipelineSpec, tuple[int, ...], float]:
    """(model, plan of one microbatch on the sub-mesh, spec, layers per virtual stage, seconds)
    of the preset ``model_name`` (:func:`plan_pipeline_source`; layers that do not divide into
    the stages balanced by FLOPs)."""
    ov = dict(overrides or {})
    got = plan_pipeline_source(Preset(model_name, ov.get("layers"), ov.get("batch"), ov.get("seq")), mesh_text,
                               strategy_text, spec_args, user, cost_text)
    assert got.loaded.model is not None
    counts = got.counts or auto_counts(got.plan, got.spec.pp * got.spec.virtual)
    return got.loaded.model, got.plan, got.spec, counts, got.seconds


def pp_cost_text(cost_text: str | None, mesh: ProcessMesh | None) -> str | None:
    """``--cost`` without its ``pp=`` entry (that one times the sends: the ``pp_link`` of
    :func:`estimate_pipeline`)."""
    if not cost_text:
        return cost_text
    parts = [s for s in cost_text.split(",") if not s.strip().startswith("pp=") and s.strip()]
    return ",".join(parts) or None


__all__ = ["SCHEDULES", "PipelineEstimate", "PipelinePlan", "PipelineSpec", "ScheduleRun", "StageCost", "auto_counts",
           "balanced_split", "bubble_formula", "estimate_pipeline", "even_split", "in_flight", "op_stages",
           "op_units", "parse_spec", "plan_pipeline", "plan_pipeline_source", "pp_cost_text", "reduce_gradients",
           "run_schedule", "schedule_order", "split_layers", "split_note", "stage_costs", "sub_mesh_text"]
