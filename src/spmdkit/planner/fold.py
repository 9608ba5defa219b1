"""Layer folding for the outer search (:mod:`spmdkit.planner.search`): a configuration of a
model whose layers repeat is planned and priced on two shallow copies of the model and its
step, memory and collectives extrapolated exactly to the full depth.

A transformer's numbered layers are the same ops on the same shapes, so under one strategy
each is sharded the same way and every quantity the cost model sums over the ops (compute,
collectives, parameters, gradients, states, the activations a layer keeps) grows by the same
amount with each layer; the quantities that are not sums (the liveness peak, the bucket the
backward fills last, the pipeline's critical path) keep their place relative to the first and
the last layer. So with the layers per stage ``c_s`` of the full configuration (one stage
without a pipeline), the model built with ``c_s - d`` and ``c_s - d + 1`` layers per stage (the
same stages, the embedding with the first, the head with the last, a MoE model's dense layers
kept in the first) gives two values ``a`` and ``b`` of every figure and the full one is
``a + d (b - a)``: one layer's work per stage instead of ``c_s``. :data:`FOLD_LAYERS` layers per
stage is the shallower copy's depth (the first layers differ from the others in what they
read: the embedding's output; two keep one ordinary layer in each stage).

``scripts/check_fold.py`` and ``tests/test_fold.py`` check the extrapolation against the model
planned at full depth (step time, memory per device and per pipeline rank, communication, MFU,
collectives, to 1e-9 relative) for dense, pp (even and balanced splits), sp, ZeRO 1-3,
recomputation, cp and ep configurations.
"""

from __future__ import annotations

from dataclasses import dataclass

from spmdkit.core.reshard import Step
from spmdkit.cost.buckets import Reducer
from spmdkit.cost.devices import Device
from spmdkit.cost.memory import activation_deltas, per_microbatch_mode, with_overheads
from spmdkit.cost.memory_saved import saved_activations
from spmdkit.cost.step import OpComm, StepEstimate, op_communication
from spmdkit.cost.step_comm import param_gather_time
from spmdkit.planner.pipeline import (
    PipelineEstimate,
    ScheduleRun,
    StageCost,
    balanced_split,
    exchanger,
    reduce_gradients,
    run_schedule,
)
from spmdkit.planner.pipeline_split import op_stages, op_units, stage_layers
from spmdkit.planner.stage_costs import Grad, single_bucket_ranks
from spmdkit.program.layers import layer_tags
from spmdkit.program.plan import Plan

#: the layers per stage of the shallower of the two copies
FOLD_LAYERS = 2


@dataclass(frozen=True)
class Fold:
    """The two shallow copies of a configuration: layers per stage of each (``b`` = ``a`` + 1
    a stage) and ``d``, the layers each stage has beyond ``a``'s."""

    a: tuple[int, ...]
    b: tuple[int, ...]
    d: int

    @property
    def layers_a(self) -> int:
        return sum(self.a)

    @property
    def layers_b(self) -> int:
        return sum(self.b)

    def at(self, va: float, vb: float) -> float:
        """The full configuration's value of a figure whose copies give ``va`` and ``vb``."""
        return va + (vb - va) * self.d


def fold_of(counts: tuple[int, ...], dense: int = 0, per_stage: int = FOLD_LAYERS) -> Fold | None:
    """The :class:`Fold` of a configuration with ``counts`` layers per stage (``dense``: the
    first layers of another kind, a MoE model's dense ones, all in the first stage), or None
    where folding saves nothing (the copies would not be shallower than the model)."""
    if not counts or dense >= counts[0]:
        return None  # the dense layers reach past the first stage: not folded
    d = min(min(counts) - per_stage, counts[0] - dense - 1)
    if d < 2:
        return None
    return Fold(tuple(c - d for c in counts), tuple(c - d + 1 for c in counts), d)


def fold_counts(fold: Fold) -> tuple[int, ...]:
    """The full configuration's layers per stage (copy a's plus ``d``)."""
    return tuple(c + fold.d for c in fold.a)


def full_layer_costs(unit_costs: list[float], layers: int, dense: int = 0) -> list[float]:
    """A shallow copy's per-layer costs (``unit_costs``: each of its layers, in order) stretched
    to ``layers`` layers: the first ``dense + 1`` (the dense ones and the first of the repeated
    kind) and the last as they are, the layer after them repeated in between."""
    k = dense + 1
    if len(unit_costs) < k + 2:
        raise ValueError("full_layer_costs: the copy has too few layers to repeat one")
    return unit_costs[:k] + [unit_costs[k]] * (layers - len(unit_costs)) + unit_costs[k:]


def balanced_counts(unit_costs: list[float], first: float, last: float, layers: int, stages: int,
                    dense: int = 0) -> tuple[int, ...]:
    """The balanced split (:func:`spmdkit.planner.pipeline.balanced_split`) of the full model's
    ``layers`` into ``stages``, from a shallow copy's per-layer costs and its embedding's
    (``first``) and head's (``last``)."""
    return balanced_split(full_layer_costs(unit_costs, layers, dense), stages, first, last)


# -- the gradient buckets -------------------------------------------------------------------------
#
# The buckets the backward fills (Megatron-Core's 40M parameters, DDP's 25 MiB) do not end where
# a layer ends, so how many there are, and how long the last one runs past the backward, is not
# affine in the layers. They are replayed: the full model's gradients, in the order and at the
# times its backward makes them (the deeper copy's, the repeated layer's d more times), through
# the same buckets (:class:`spmdkit.cost.buckets.Reducer`).


@dataclass(frozen=True)
class _Adds:
    """A copy's gradient reductions as its step makes them: (layer unit: -1 the embedding,
    ``layers`` the head; dtype, reduction, bytes, op layer label, time), and the end of its backward;
    its device's HBM rate (FSDP2's copy-ins: :class:`spmdkit.cost.buckets.Reducer`)."""

    items: list[tuple[int, str, Step, int, str, float]]
    fb: float
    layers: int
    rate: float = 0.0


def _gathered(plan: Plan, oc: OpComm, ops: set[int] | None = None) -> dict[tuple[tuple[int, ...], int], float]:
    """Megatron's distributed optimizer's parameter all-gathers (of ``ops``; all): bytes by
    (mesh dims, itemsize), as :func:`spmdkit.cost.step_comm.param_gather_time` sums them."""
    by: dict[tuple[tuple[int, ...], int], float] = {}
    for i, items in oc.param_gathers.items():
        if ops is None or i in ops:
            for dims, b, itemsize in items:
                by[(dims, itemsize)] = by.get((dims, itemsize), 0.0) + b
    return by


def gather_exposed(fold: Fold, plan_b: Plan, by_a: dict[tuple[tuple[int, ...], int], float],
                   by_b: dict[tuple[tuple[int, ...], int], float], fwd_a: float, fwd_b: float) -> tuple[float, float, float]:
    """What the parameter all-gathers leave exposed past a forward (``max(0, gathers - forward)``:
    their buckets do not end where a layer ends), for copy a, copy b and the full model."""
    def exposed(by: dict[tuple[tuple[int, ...], int], float], fwd: float) -> float:
        items = [(dims, b, itemsize) for (dims, itemsize), b in by.items()]
        return max(0.0, param_gather_time(plan_b, items) - fwd) if items else 0.0

    full = {k: fold.at(by_a.get(k, 0.0), v) for k, v in by_b.items()}
    return exposed(by_a, fwd_a), exposed(by_b, fwd_b), exposed(full, fold.at(fwd_a, fwd_b))


def _adds(plan: Plan, est: StepEstimate) -> _Adds | None:
    """``est``'s gradient reductions (None: no timeline)."""
    if len(est.timeline) != len(plan.program.ops):
        return None
    oc = op_communication(plan, est.device)
    unit, n = op_units(plan.program)
    items: list[tuple[int, str, Step, int, str, float]] = []
    fb = None
    end = 0.0
    for (i, start, blocked, extra, comp), op in zip(est.timeline, plan.program.ops):
        if op.phase == "optimizer" and fb is None:
            fb = end
        end = start + blocked + comp + extra
        for dt, s, size in oc.pending.get(i, []):
            items.append((unit[i], dt, s, size, op.layer, end))
    return _Adds(items, end if fb is None else fb, n, est.device.hbm_rate)


def _replay(plan: Plan, items: list[tuple[int, str, Step, int, str, float]], fb: float, rate: float) -> Reducer:
    """``items`` through the plan's buckets, flushed at ``fb`` (the end of the backward), as the
    step's ops add them: FSDP2's copy-ins (at ``rate``) an op's launches start on the compute
    stream are in the next op's time, so the items of a later time start none of theirs."""
    red = Reducer(plan, hbm_rate=rate)
    last = None
    for _u, dt, s, size, layer, t in items:
        if t != last:
            red.take()
            last = t
        red.add(dt, s, size, t, layer)
    if fb != last:
        red.take()
    red.flush(fb)
    return red


def _same(red: Reducer, est: StepEstimate) -> bool:
    """The replay made the step's own buckets (none of its stream's time went to a prefetch)."""
    return len(red.buckets) == len(est.buckets) and all(
        (x.kind, x.mesh_dims, x.tensors, x.bytes) == (y.kind, y.mesh_dims, y.tensors, y.bytes)
        and _close(x.start_s, y.start_s) and _close(x.time_s, y.time_s) for x, y in zip(red.buckets, est.buckets))


def _end(red: Reducer, fb: float) -> float:
    """When the step's clock goes on after the flush at ``fb`` (FSDP2's copy-ins of the buckets it
    launched on the compute stream, the buckets' stream): :meth:`Reducer.flush`'s end."""
    return max(fb + red.blocked, red.free)


def bucket_figures(fold: Fold, plan_a: Plan, est_a: StepEstimate, plan_b: Plan, est_b: StepEstimate,
                   layers: int, dense: int = 0) -> tuple[float, float, float, float] | None:
    """The gradient buckets of the full model (``layers`` deep) from its two copies' steps:
    ``(its buckets' total time, what is not affine in the layers: how long they run past its
    backward plus the parameter gathers exposed past the next forward; the same for copy a, for
    copy b)``; None where a ZeRO-3 / FSDP prefetch shares their stream, or the replay does not
    reproduce a copy's own buckets. The prefetch is refused outright, not only where it moves a
    copy's buckets: the gathers and the reductions queue on one stream, and where they outrun a
    layer's backward the queue grows with the depth, which two shallow copies do not show
    (llama3-405b dp=2048 tp=8 megatron,sp,zero3 on 16,384 devices: 8.48 s folded, 11.72 s whole)."""
    if op_communication(plan_b, est_b.device).gathers_s > 0:
        return None
    a, b = _adds(plan_a, est_a), _adds(plan_b, est_b)
    if a is None or b is None:
        return None
    red_a, red_b = _replay(plan_a, a.items, a.fb, a.rate), _replay(plan_b, b.items, b.fb, b.rate)
    if not (_same(red_a, est_a) and _same(red_b, est_b)):
        return None
    k = dense + 1  # the repeated layer
    top_a = [x for x in a.items if x[0] == a.layers - 1]
    top_b = [x for x in b.items if x[0] == b.layers - 1]
    bot_a = [x for x in a.items if x[0] == 0]
    bot_b = [x for x in b.items if x[0] == 0]
    out: list[Item] | None = []
    if a.items or b.items:  # none: no data-parallel reduction (dp = 1), no buckets
        if not (top_a and top_b and bot_a and bot_b):
            return None
        f = top_b[0][5] - top_a[0][5]           # one more layer's forward
        bk = bot_b[0][5] - bot_a[0][5] - f      # and its backward
        out = _stretch(b.items, k, layers - b.layers, (layers - b.layers) * f, bk)
    if out is None:
        return None
    fb_full = fold.at(a.fb, b.fb)
    red = _replay(plan_b, out, fb_full, b.rate)
    fwd_a = est_a.compute_s.get("forward", 0.0) / plan_a.grad_accum
    fwd_b = est_b.compute_s.get("forward", 0.0) / plan_b.grad_accum
    ga, gb, gf = gather_exposed(fold, plan_b, _gathered(plan_a, op_communication(plan_a, est_a.device)),
                                _gathered(plan_b, op_communication(plan_b, est_b.device)), fwd_a, fwd_b)
    return (sum(x.time_s for x in red.buckets), _end(red, fb_full) - fb_full + gf, _end(red_a, a.fb) - a.fb + ga,
            _end(red_b, b.fb) - b.fb + gb)


def bucket_sync(plan_a: Plan, est_a: StepEstimate, plan_b: Plan, est_b: StepEstimate, layers: int,
                dense: int = 0) -> float | None:
    """The full model's gradient buckets' total time (``bucket_figures``' first figure) where only
    their times are wanted, not when they run: a bucket's contents and time do not depend on
    when it is launched, so a ZeRO-3 prefetch sharing their stream (which moves their starts and
    makes :func:`bucket_figures` refuse) changes neither; None where a replay does not make a
    copy's own buckets (their kinds, tensors, bytes and times)."""
    a, b = _adds(plan_a, est_a), _adds(plan_b, est_b)
    if a is None or b is None:
        return None
    for plan, adds, est in ((plan_a, a, est_a), (plan_b, b, est_b)):
        red = _replay(plan, adds.items, adds.fb, adds.rate)
        if len(red.buckets) != len(est.buckets) or not all(
                (x.kind, x.mesh_dims, x.tensors, x.bytes) == (y.kind, y.mesh_dims, y.tensors, y.bytes)
                and _close(x.time_s, y.time_s) for x, y in zip(red.buckets, est.buckets)):
            return None
    if not (a.items or b.items):
        return 0.0  # no data-parallel reduction
    out = _stretch(b.items, dense + 1, layers - b.layers, 0.0, 0.0)
    return None if out is None else sum(x.time_s for x in _replay(plan_b, out, 0.0, b.rate).buckets)


Item = tuple[int, str, Step, int, str, float]


def _stretch(items: list[Item], rep: int, r: int, shift: float, bk: float) -> list[Item] | None:
    """A copy's gradient reductions (in the order its backward makes them) as the full model
    makes them: those of layer ``rep`` ``r`` more times, each a layer's backward ``bk`` later,
    those after them ``r bk`` later, all ``shift`` later (the ``r`` layers' forward); None where
    the repeated layer's are not together."""
    block = [x for x in items if x[0] == rep]
    if not block:
        return None
    first = items.index(block[0])
    if items[first:first + len(block)] != block:
        return None
    out: list[Item] = [(u, dt, st, size, lay, t + shift) for u, dt, st, size, lay, t in items[:first]]
    for j in range(r + 1):  # the repeated layer r + 1 times (a layer label each: FSDP2's bucket per layer)
        out += [(u, dt, st, size, f"{lay}#{j}", t + shift + j * bk) for u, dt, st, size, lay, t in block]
    out += [(u, dt, st, size, lay, t + shift + r * bk) for u, dt, st, size, lay, t in items[first + len(block):]]
    return out


def pipeline_step(fold: Fold, plan_a: Plan, est_a: PipelineEstimate, plan_b: Plan,
                  est_b: PipelineEstimate, device: Device) -> tuple[float, float] | None:
    """The full pipeline's overlapped step from its two copies' (their stages ``fold.a`` and
    ``fold.b``): each stage's forward and backward of a microbatch affine in its layers, the
    schedule run again on them (:func:`spmdkit.planner.pipeline.run_schedule`: its critical path
    may pass through other stages at full depth), each rank's gradient reductions replayed
    through the framework's buckets from when its last backward makes them
    (:func:`spmdkit.planner.pipeline.reduce_gradients`); None where copy b's own step is not
    reproduced so (another schedule, microbatch-level recomputation). Also the busiest stage's
    sends of a microbatch (forward and back)."""
    if est_a.run is None or est_b.run is None or est_b.spec.virtual != 1:
        return None
    own = _pipeline_overlap(Fold(fold.b, fold.b, 0), plan_b, est_b, est_b, plan_b, device, est_b.run)
    if own is None or not _close(own, est_b.step_overlap_s):
        return None
    s = est_b.spec
    fwd = [fold.at(ca.forward_s, cb.forward_s) for ca, cb in zip(est_a.stages, est_b.stages)]
    bwd = [fold.at(ca.backward_s + ca.recompute_s, cb.backward_s + cb.recompute_s)
           for ca, cb in zip(est_a.stages, est_b.stages)]
    # what a stage sends grows with its layers where they add to it (a MoE layer's auxiliary loss)
    send = exchanger(plan_b, s.pp, est_b.pp_link, device)
    n = len(est_b.stages)
    pairs = list(zip(est_a.stages, est_b.stages))
    sent = [round(fold.at(ca.send_bytes, cb.send_bytes)) for ca, cb in pairs]
    back = [round(fold.at(ca.send_grad_bytes, cb.send_grad_bytes)) for ca, cb in pairs]
    split = [round(fold.at(ca.send_gathered, cb.send_gathered)) for ca, cb in pairs]
    bsplit = [round(fold.at(ca.send_grad_gathered, cb.send_grad_gathered)) for ca, cb in pairs]
    send_f = [send(sent[k], split[k]) if k < n - 1 else 0.0 for k in range(n)]
    send_b = [send(back[k + 1], bsplit[k + 1]) if k < n - 1 else 0.0 for k in range(n)]
    run = run_schedule(s.schedule, s.pp, s.virtual, s.microbatches, fwd, bwd, send_f, send_b)
    step = _pipeline_overlap(fold, plan_a, est_a, est_b, plan_b, device, run)
    return None if step is None else (step, max((f + b for f, b in zip(send_f, send_b)), default=0.0))


def _pipeline_overlap(fold: Fold, plan_a: Plan, est_a: PipelineEstimate, est_b: PipelineEstimate,
                      plan_b: Plan, device: Device, run: ScheduleRun) -> float | None:
    """The overlapped step of the pipeline whose schedule ran as ``run``: each rank's end, its
    gradients' buckets and its optimizer (:func:`spmdkit.planner.pipeline._step_times`)."""
    m = est_b.spec.microbatches
    last = {k: (s0, s1) for _r, kind, k, i, s0, s1 in run.units if kind == "B" and i == m - 1}
    index = {t: n for n, t in enumerate(layer_tags(plan_b.program))}
    single_ranks = single_bucket_ranks(plan_b, est_b.stages)
    oc_a, oc_b = op_communication(plan_a, device), op_communication(plan_b, device)
    st_a, st_b = op_stages(plan_a.program, est_a.counts), op_stages(plan_b.program, est_b.counts)
    out = []
    lo = 0
    for r, (ca, cb) in enumerate(zip(est_a.stages, est_b.stages)):
        by_a = _gathered(plan_a, oc_a, {i for i, k in enumerate(st_a) if k == r})
        by_b = _gathered(plan_b, oc_b, {i for i, k in enumerate(st_b) if k == r})
        ga, gb, gf = gather_exposed(fold, plan_b, by_a, by_b, ca.forward_s, cb.forward_s)
        hi = lo + fold.b[r]
        bw = fold.at(ca.backward_s, cb.backward_s)
        full, each = (_stretched(fold, hi, ca, cb, index, g) for g in (cb.grads, cb.each))
        if full is None or each is None:
            return None
        fin = run.finish_s[r]
        start, end = last.get(r, (fin, fin))
        grads = [(start + (t / bw if bw > 0 else 1.0) * (end - start), dt, st, size, lay)
                 for _u, dt, st, size, lay, t in full]
        # the microbatches before the last reduce the stage's `each` under their own backward
        mine = [(t / bw if bw > 0 else 1.0, dt, st, size, lay) for _u, dt, st, size, lay, t in each]
        early = [(s0, s1, mine) for rr, kind, _k, i, s0, s1 in run.units
                 if rr == r and kind == "B" and i < m - 1] if mine else None
        done, _b = reduce_gradients(plan_b, grads, fin, single_ranks and r > 0, early)
        # a tied parameter's copies all-reduced among their stages after the reductions
        # (planner.pipeline._step_times): the embedding and the head, as many bytes in both copies
        tied = fold.at(est_a.tied_s[r], est_b.tied_s[r]) if est_a.tied_s and est_b.tied_s else 0.0
        out.append(done + tied + fold.at(ca.optimizer_s - ga, cb.optimizer_s - gb) + gf)
        lo = hi
    return max(out)


def _stretched(fold: Fold, hi: int, ca: StageCost, cb: StageCost, index: dict[str, int],
               grads: list[Grad]) -> list[Item] | None:
    """Copy b's stage's gradient reductions ``grads`` (:attr:`StageCost.grads` or ``each``) as
    the full model's stage makes them, at seconds into its backward (:func:`_stretch`)."""
    items: list[Item] = [(index.get(lay, hi if lay == "head" else -1), dt, st, size, lay, f * cb.backward_s)
                         for f, dt, st, size, lay in grads]
    if not fold.d or not items:
        return items
    return _stretch(items, hi - 2, fold.d - 1, 0.0, cb.backward_s - ca.backward_s)


def _stretched_peak(deltas: dict[int, int], unit: list[int], rep: int, r: int) -> int:
    """The liveness peak (:func:`spmdkit.cost.memory.peak_of`) of ops whose changes are ``deltas``
    with each run of layer ``rep``'s ops ``r`` more times: the same change repeats with each
    layer (a layer keeps its input and frees the one before's as every other layer does)."""
    peak, cur, i, n = 0, 0, 0, len(unit)
    while i < n:
        if unit[i] != rep:
            cur += deltas.get(i, 0)
            peak = max(peak, cur)
            i += 1
            continue
        top, net = 0, 0
        while i < n and unit[i] == rep:
            net += deltas.get(i, 0)
            top = max(top, net)
            i += 1
        peak = max(peak, cur + top + max(0, r * net))  # the highest of the r + 1 runs
        cur += (r + 1) * net
    return peak


def pipeline_memory(fold: Fold, est_a: PipelineEstimate, plan_b: Plan, est_b: PipelineEstimate,
                    recompute: str) -> list[int] | None:
    """Each pipeline rank's memory of the full model (bytes as the GPU holds them) from its two
    copies': what the stages hold for the step and stash per microbatch is affine in the layers;
    the working peak of a microbatch through a stage is the peak of its liveness curve with the
    repeated layer's ops run again (a stage without the head peaks early at few layers, in its
    layers' stash at many); None where copy b's own memory is not reproduced."""
    if est_b.spec.virtual != 1:
        return None
    # full:K: the first K layers of each stage (those of the copy's); every:N: every N-th of each
    saved = saved_activations(plan_b, per_microbatch_mode(recompute),
                              stage_layers(plan_b.program, est_b.counts, recompute, est_b.spec.pp))
    stages = op_stages(plan_b.program, est_b.counts)
    deltas = activation_deltas(plan_b, saved, stages, len(est_b.counts))
    unit, _n = op_units(plan_b.program)
    p = est_b.spec.pp
    out = []
    lo = 0
    for r, (ca, cb) in enumerate(zip(est_a.stages, est_b.stages)):
        hi = lo + est_b.counts[r]
        lo = hi
        if _stretched_peak(deltas[r], unit, hi - 2, 0) != cb.working_peak:
            return None
        work = _stretched_peak(deltas[r], unit, hi - 2, fold.d - 1)
        flight = est_b.in_flight[r]
        own = _rank_total(ca, cb, 1, cb.working_peak + round((flight - 1) * cb.stash_bytes), plan_b, p)
        if own != est_b.memory[r].device_total:
            return None  # copy b's own memory is not what the pipeline made of its stages
        act = work + round((flight - 1) * round(fold.at(ca.stash_bytes, cb.stash_bytes)))
        out.append(_rank_total(ca, cb, fold.d, act, plan_b, p))
    return out


def _rank_total(ca: StageCost, cb: StageCost, d: int, act: int, plan: Plan, p: int) -> int:
    """A rank's bytes (:func:`spmdkit.planner.pipeline._rank_memory`, one stage a rank) with
    what its stage holds for the step ``d`` layers past copy a's and ``act`` bytes of activations;
    FSDP2's copy-in pool is copy b's (two blocks, or the root group and a block, at any depth)."""
    def held(f: str) -> int:
        va: int = getattr(ca, f)
        vb: int = getattr(cb, f)
        return round(va + (vb - va) * d)

    up, ug = (held("unsharded_parameters"), held("unsharded_gradients")) if p > 1 else (0, 0)
    return with_overheads(held("parameters") + up, held("gradients") + ug, held("optimizer_states"), act,
                          cb.peak_op, plan, p, pools=cb.gather_pool).device_total


def _close(x: float, y: float) -> bool:
    return abs(x - y) <= 1e-12 * max(abs(x), abs(y), 1e-30)


__all__ = ["bucket_sync", "FOLD_LAYERS", "Fold", "balanced_counts", "bucket_figures", "fold_counts", "fold_of", "full_layer_costs", "pipeline_memory",
           "pipeline_step"]
