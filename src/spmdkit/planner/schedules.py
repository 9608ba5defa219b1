"""Pipeline schedules as event simulations: each device's order of work and its timeline.

:func:`schedule_order` gives device ``r``'s forwards and backwards in the order the schedule
runs them (GPipe: every forward, then every backward; 1F1B: ``p - r - 1`` warm-up forwards,
then one forward and one backward in turn, then the cool-down backwards; interleaved 1F1B:
Megatron-LM's order over ``v`` model chunks per device, the microbatches in groups of ``N``,
``--microbatch-group``, default ``p``: :func:`schedule_table`). :func:`run_schedule` runs those
orders against each other: a forward waits for the previous stage's forward of the same
microbatch plus the send, a backward for the next stage's backward plus the send. The bubble
is what the simulated pipeline takes beyond the busiest device's own work; with equal stages
and free sends it is exactly ``(p-1)/m`` (GPipe, 1F1B) or ``(p-1)/(v m)`` (interleaved) of
that work (:func:`bubble_formula`). :func:`in_flight` gives the microbatches of activations
a device holds at its peak under each schedule.

ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", section 3.1) splits each backward
into B, the input gradient the previous stage waits for, and W, the weight gradient nothing
waits for. Device ``r`` runs 1F1B's order of forwards and B's (``p - r - 1`` warm-up
forwards), and its W's ``r`` microbatches late: after its ``j``-th B the W of microbatch
``j - r``, the last ``r`` W's at the end, filling the cool-down's bubble (torch's
``ScheduleInterleavedZeroBubble`` with one stage per rank: ``num_1f1b_microbatches = rank``).
With equal stages, free sends and ``m >= p`` its bubble is ``(p-1)(T_F + T_B - T_W)`` against
1F1B's ``(p-1)(T_F + T_B + T_W)`` (where ``T_W <= T_F, T_B``; else ``(p-1) max(T_F, T_B)``),
a third of it where the three are equal; device ``r`` keeps 1F1B's
``p - r`` microbatches of activations in flight and the ``r`` deferred W's inputs, at most
``p`` microbatches on any device, 1F1B's peak (its first device).

Expert-parallel all-to-all overlap (``--ep-comm-overlap``: Megatron-Core's
``--overlap-moe-expert-parallel-comm`` with ``--delay-wgrad-compute``, interleaved schedule
only). Megatron-Core's interleaved schedule then runs one more warm-up forward on every device
(``get_pp_rank_microbatches``: the forward and backward of each steady-state step must belong to
different microbatches) and runs each steady-state forward and backward as ONE merged step
(``combined_1f1b_schedule_for_interleaved_pipelining``), layer by layer: the backward's combine
all-to-all runs while the forward computes attention, the two dispatches while the two expert
MLPs (and the backward's deferred weight gradients) compute, the forward's combine while the
backward computes attention (``TransformerLayerSchedulePlan.run``, module
``megatron.core.models.common.model_chunk_schedule_plan``); the all-to-alls run on their own
stream. Every step, the warm-up forwards and cool-down backwards too, runs through that plan:
:func:`run_schedule` times each by :func:`spmdkit.planner.chunk_plan.chunk_run`, the source's
nodes on its two streams with its event waits (a node waits for its chunk's node before it, the
weight gradients for nothing; under DeepEP the computation beside an all-to-all runs on the SMs
its kernels leave), from each stage's ops cut into those nodes
(:mod:`spmdkit.planner.chunk_ops`). A lone forward runs its nodes one after the other; a lone
backward hides its dispatch's all-to-all under its experts' weight gradients and its combine's
under the layer before's attention weight gradients. A device holds one more model chunk
of activations (the extra warm-up forward); the merged step's own forward builds its
activations while its partner's backward frees its own, layer by layer, so the peak count adds
nothing more (an upper bound: the merged forward is counted whole, at its working peak).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from spmdkit.core.errors import ProgramError
from spmdkit.planner.chunk_plan import ChunkOps, ChunkRun, chunk_run

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
SCHEDULE_ALIASES = {"interleaved-1f1b": "interleaved", "interleaved1f1b": "interleaved", "1F1B": "1f1b",
                    "GPipe": "gpipe", "zbh1": "zb-h1", "ZB-H1": "zb-h1", "zb1p": "zb-h1"}


def schedule_order(schedule: str, p: int, v: int, m: int, r: int, extra_warm: int = 0,
                   group: int | None = None) -> list[tuple[str, int, int]]:
    """Device ``r``'s work in order: ("F" | "B", virtual stage, microbatch). ``extra_warm``:
    the interleaved schedule's additional warm-up forwards (1 under the all-to-all overlap);
    ``group``: its microbatch group (:func:`schedule_table`; None: ``p``)."""
    if schedule == "gpipe":
        return [("F", r, i) for i in range(m)] + [("B", r, i) for i in range(m)]
    if schedule == "1f1b":
        warm = min(p - r - 1, m)
        order = [("F", r, i) for i in range(warm)]
        for i in range(m - warm):
            order += [("F", r, warm + i), ("B", r, i)]
        return order + [("B", r, i) for i in range(m - warm, m)]
    if schedule == "zb-h1":
        return _zb_h1_order(p, m, r)
    total = m * v
    table = schedule_table(m, v, group or p)

    def unit(k: int, forward: bool) -> tuple[int, int]:
        i, chunk = table[k]
        return (chunk if forward else v - 1 - chunk) * p + r, i

    warm = interleaved_warmup(p, v, m, r, extra_warm, group)
    order = [("F", *unit(k, True)) for k in range(warm)]
    for j in range(total - warm):
        order += [("F", *unit(warm + j, True)), ("B", *unit(j, False))]
    return order + [("B", *unit(k, False)) for k in range(total - warm, total)]


def schedule_table(m: int, v: int, group: int) -> list[tuple[int, int]]:
    """Megatron-Core's ``get_schedule_table``: the interleaved schedule's (microbatch, model chunk)
    of each of a device's ``m v`` forwards in order: microbatches in groups of ``group``
    (``--microbatch-group-size-per-virtual-pipeline-stage``), each group through chunk 0, then
    chunk 1, ..., the last group the ``m`` left. The ``j``-th backward is the ``j``-th entry's
    microbatch on chunk ``v - 1 - chunk`` (module docstring)."""
    out: list[tuple[int, int]] = []
    for lo in range(0, m, group):
        hi = m if lo + group >= m else lo + group
        out += [(i, c) for c in range(v) for i in range(lo, hi)]
    return out


def check_microbatch_group(p: int, m: int, group: int) -> None:
    """Refuse the microbatch groups Megatron-Core's interleaved schedule refuses
    (``forward_backward_pipelining_with_interleaving``): ``N`` outside ``[p, m]`` (a ValueError
    there), and a last group of fewer than ``p`` microbatches, ``0 < m mod N < p`` (a
    RuntimeError there: "it introduces dependency bubbles")."""
    flag = f"--microbatch-group {group}"
    if group < p or group > m:
        raise ProgramError(f"{flag}: Megatron-Core's interleaved schedule needs a group from pp={p} to --microbatches "
                           f"{m} (the microbatches a model chunk runs in a row)")
    if 0 < m % group < p:
        raise ProgramError(f"{flag}: --microbatches {m} leaves a last group of {m % group}, fewer than pp={p} "
                           f"(Megatron-Core refuses it: the last group's chunks would wait on each other); give "
                           f"--microbatches a multiple of {group} or one that leaves at least {p}")


def interleaved_p2p_problem(pp: int, p2p_overlap: bool, framework: str) -> str | None:
    """Why Megatron-LM refuses its interleaved schedule over ``pp`` ranks with blocking sends
    (``--no-p2p-overlap``, its ``--no-overlap-p2p-communication``), None where it runs it: its
    ``validate_args`` (d98e8a64dd ``megatron/training/arguments``) asserts pp > 2 there, the batched
    sends and receives of one exchange otherwise pairing the same 2 ranks twice (before 2023 it
    asserted pp > 2 for every interleaved run; torchtitan has no such option)."""
    if pp != 2 or p2p_overlap or framework != "megatron":
        return None
    return ("--no-p2p-overlap: Megatron-LM's interleaved schedule over pp=2 needs the stage-to-stage overlap (its "
            "default; under --no-overlap-p2p-communication validate_args asserts pp > 2)")


def interleaved_warmup(p: int, v: int, m: int, r: int, extra_warm: int = 0, group: int | None = None) -> int:
    """Device ``r``'s warm-up forwards under the interleaved schedule (Megatron-Core's
    ``get_pp_rank_microbatches``: ``(p - r - 1) 2 + (v - 1) N``, ``N`` the microbatch ``group``,
    None: ``p``; plus ``extra_warm``), at most its ``m v`` forwards."""
    return min((p - r - 1) * 2 + (v - 1) * (group or p) + extra_warm, m * v)


def _zb_h1_order(p: int, m: int, r: int) -> list[tuple[str, int, int]]:
    """ZB-H1 on device ``r`` (module docstring): 1F1B's forwards and B's, the W of microbatch
    ``j - r`` after the ``j``-th B, the rest at the end."""
    warm = min(p - r - 1, m)
    order = [("F", r, i) for i in range(warm)]
    w = 0
    for j in range(m):
        if warm + j < m:
            order.append(("F", r, warm + j))
        order.append(("B", r, j))
        if j >= r:
            order.append(("W", r, w))
            w += 1
    return order + [("W", r, i) for i in range(w, m)]


def held_counts(order: list[tuple[str, int, int]]) -> tuple[int, int]:
    """(microbatches whose forward is done and backward not, at most; and of the B-done,
    W-pending ones at the points where the first count is largest, the most)."""
    full = pend = 0
    best = (0, 0)
    for kind, _k, _i in order:
        if kind == "F":
            full += 1
        elif kind == "B":
            full -= 1
            pend += 1
        else:
            pend -= 1
        best = max(best, (full, pend))
    return best


def weight_pending(schedule: str, p: int, m: int, r: int) -> int:
    """Microbatches device ``r`` holds only the weight gradients' inputs of (ZB-H1's deferred
    W's) beside its :func:`in_flight` ones at its peak: 0 but for ZB-H1."""
    if schedule != "zb-h1":
        return 0
    return held_counts(_zb_h1_order(p, m, r))[1]


def in_flight(schedule: str, p: int, v: int, m: int, r: int, extra_warm: int = 0, group: int | None = None) -> float:
    """Microbatches of a whole stage whose activations device ``r`` holds at its peak
    (``extra_warm``: the interleaved schedule's additional warm-up forwards; ``group``: its
    microbatch group, None: ``p``): the interleaved schedule's warm-up forwards and the first
    steady-state forward, before its backward frees one."""
    if schedule == "gpipe":
        return float(m)
    if schedule in ("1f1b", "zb-h1"):
        return float(min(p - r, m))
    return min(interleaved_warmup(p, v, m, r, extra_warm, group) + 1, m * v) / v


@dataclass
class ScheduleRun:
    finish_s: list[float]   # per device: the end of its last backward
    busy_s: list[float]     # per device: its own forward + backward work
    last_backward_s: list[float]
    #: every unit run: (device, "F" | "B" | "W", virtual stage, microbatch, start s, end s); a
    #: merged forward and backward (the all-to-all overlap) as its two shares of the merged step
    units: list[tuple[int, str, int, int, float, float]] = field(default_factory=list, repr=False)
    #: per device: the all-to-all seconds its merged steps hid (the overlap; else empty)
    hidden_s: list[float] = field(default_factory=list)

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


@dataclass(frozen=True)
class ScheduleInputs:
    """What :func:`run_schedule` simulates a pipeline from, besides its shape and microbatch
    count: each virtual stage's forward, backward (and, split apart, weight-gradient) time and
    sends (:func:`spmdkit.planner.pipeline.estimate_pipeline` keeps them so the same stages can be
    run again at another microbatch count: :mod:`spmdkit.planner.bubble`)."""

    fwd: list[float]
    bwd: list[float]
    send_f: list[float]
    send_b: list[float]
    blocking_sends: bool | None = None
    weight: list[float] | None = None
    #: per virtual stage: its ops as Megatron-Core's merged schedule's nodes, where every step
    #: runs through it (``--ep-comm-overlap``: :func:`run_schedule`, :mod:`spmdkit.planner.chunk_plan`)
    a2a: list[ChunkOps] | None = None
    #: the share of the GPU's compute the partner's work runs at while an all-to-all of a merged
    #: step runs (DeepEP's or NCCL's kernels keep SMs of their own: :func:`spmdkit.cost.moe.a2a_compute_share`)
    a2a_share: float = 1.0
    #: per virtual stage: the seconds its first microbatch's forward and its last microbatch's
    #: backward take more, once a step (FSDP2's copy-out and copy-in: :func:`run_schedule`)
    once: list[tuple[float, float]] | None = None

    def run(self, schedule: str, p: int, v: int, m: int, group: int | None = None) -> ScheduleRun:
        return run_schedule(schedule, p, v, m, self.fwd, self.bwd, self.send_f, self.send_b,
                            self.blocking_sends, weight=self.weight, a2a=self.a2a, a2a_share=self.a2a_share,
                            once=self.once, group=group)


def run_schedule(schedule: str, p: int, v: int, m: int, fwd: list[float], bwd: list[float],
                 send_f: list[float] | None = None, send_b: list[float] | None = None,
                 blocking_sends: bool | None = None, weight: list[float] | None = None,
                 a2a: list[ChunkOps] | None = None, a2a_share: float = 1.0,
                 once: list[tuple[float, float]] | None = None, group: int | None = None) -> ScheduleRun:
    """Simulate the schedule: ``fwd[k]`` / ``bwd[k]`` the time of virtual stage ``k`` for one
    microbatch, ``send_f[k]`` / ``send_b[k]`` the time to send its output activations to stage
    ``k+1`` / the gradients of its inputs to ``k-1`` (``send_b[k]`` is stage ``k+1``'s send back
    to ``k``). ``blocking_sends`` (default: every schedule but interleaved): the sender waits for
    its send to complete before its next unit, as Megatron-LM's 1F1B does (its p2p calls wait on
    the exchange); the interleaved schedule overlaps its sends with the next unit's compute
    (Megatron's ``overlap_p2p_comm``), so there only the receiver waits. ZB-H1: ``bwd[k]`` is
    the input gradient (B) alone and ``weight[k]`` the weight gradient (W), run after it on
    the same device in the schedule's order. ``a2a`` (interleaved only): per virtual stage its
    ops as the merged schedule's nodes (their sums ``fwd[k]`` and ``bwd[k]``); one more warm-up
    forward per device, each steady-state forward and backward run as one merged step and every
    step timed as Megatron-Core's ``TransformerModelChunkSchedulePlan.run`` runs it
    (:func:`spmdkit.planner.chunk_plan.chunk_run`: a lone backward too hides its dispatch's
    all-to-all under its experts' weight gradients), the work beside an all-to-all at
    ``a2a_share`` of its speed; a merged step's forward output leaves when its forward's layers
    end, its backward's when its backward's do. ``once``: per
    virtual stage, seconds more in its first microbatch's forward and its last microbatch's backward
    (B), on the same device (FSDP2 under torch's pipelining gathers a stage's parameters before its
    first forward and reduce-scatters its gradients after its last backward, each with its copy).
    ``group``: the interleaved schedule's microbatch group (:func:`schedule_table`; None: ``p``)."""
    if a2a is not None and schedule != "interleaved":
        raise ProgramError(f"--ep-comm-overlap: merges the steady-state forward and backward of the interleaved "
                           f"schedule; --schedule {schedule} has none to merge (give --schedule interleaved)")
    if blocking_sends is None:
        blocking_sends = schedule != "interleaved"
    n = p * v
    first, final = ([f for f, _b in once], [b for _f, b in once]) if once else ([0.0] * n, [0.0] * n)
    sf = send_f or [0.0] * n
    sb = send_b or [0.0] * n
    wt = weight or [0.0] * n
    extra = 1 if a2a is not None else 0
    steps: dict[tuple[int, int], ChunkRun] = {}

    def step(kf: int, kb: int) -> ChunkRun:  # forward chunk kf (-1: none) with backward chunk kb
        assert a2a is not None
        if (kf, kb) not in steps:
            steps[kf, kb] = chunk_run(a2a[kf] if kf >= 0 else None, a2a[kb], a2a_share)
        return steps[kf, kb]

    orders = [schedule_order(schedule, p, v, m, r, extra, group) for r in range(p)]
    # the first position of each merged pair on each device (the steady state's F, B)
    pairs = [set(range(w, len(orders[r]) - w, 2)) if a2a is not None else set()
             for r, w in enumerate(interleaved_warmup(p, v, m, r, extra, group) for r in range(p))]
    # the end of each forward / backward unit done, at [virtual stage x m + microbatch]
    done_f: list[float | None] = [None] * (n * m)
    done_b: list[float | None] = [None] * (n * m)
    pos = [0] * p
    free = [0.0] * p
    last_b = [0.0] * p
    hidden = [0.0] * p
    units: list[tuple[int, str, int, int, float, float]] = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(p):
            order, merge = orders[r], pairs[r]
            while pos[r] < len(order):
                if merge and pos[r] in merge:  # a merged forward and backward (a2a is given)
                    (_f, kf, i_f), (_b, kb, i_b) = order[pos[r]], order[pos[r] + 1]
                    d_f = _dep("F", kf, kf * m + i_f, m, n, done_f, done_b, sf, sb)
                    d_b = _dep("B", kb, kb * m + i_b, m, n, done_f, done_b, sf, sb)
                    if d_f is None or d_b is None:
                        break
                    start = max(free[r], d_f, d_b)
                    got = step(kf, kb)
                    lead = first[kf] if i_f == 0 else 0.0
                    dur = got.seconds + lead + (final[kb] if i_b == m - 1 else 0.0)
                    hidden[r] += fwd[kf] + bwd[kb] - dur
                    cut = start + dur * fwd[kf] / (fwd[kf] + bwd[kb]) if fwd[kf] + bwd[kb] > 0 else start
                    free[r] = start + dur
                    units += [(r, "F", kf, i_f, start, cut), (r, "B", kb, i_b, cut, free[r])]
                    done_f[kf * m + i_f] = start + lead + got.forward_end
                    done_b[kb * m + i_b] = start + lead + got.backward_end
                    last_b[r] = dur
                    if blocking_sends:
                        free[r] += (sf[kf] if kf < n - 1 else 0.0) + (sb[kb - 1] if kb > 0 else 0.0)
                    pos[r] += 2
                    remaining -= 2
                    progressed = True
                    continue
                kind, k, i = order[pos[r]]
                at = k * m + i
                dep = _dep(kind, k, at, m, n, done_f, done_b, sf, sb)
                if dep is None:
                    break
                dur = fwd[k] if kind == "F" else bwd[k] if kind == "B" else wt[k]
                if a2a is not None and kind == "B":  # a lone backward through the merged schedule's nodes
                    dur = step(-1, k).seconds
                    hidden[r] += bwd[k] - dur
                dur += first[k] if kind == "F" and i == 0 else final[k] if kind == "B" and i == m - 1 else 0.0
                start = max(free[r], dep)
                free[r] = start + dur
                units.append((r, kind, k, i, start, free[r]))
                if kind == "F":
                    done_f[at] = free[r]
                elif kind == "B":
                    done_b[at] = free[r]
                if blocking_sends and kind != "W":
                    free[r] += (sf[k] if k < n - 1 else 0.0) if kind == "F" else (sb[k - 1] if k > 0 else 0.0)
                if kind == "B":
                    last_b[r] = dur
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # cannot happen for the three schedules; never loop forever
            raise ProgramError(f"--schedule {schedule}: the schedule deadlocks (p={p}, v={v}, m={m})")
    busy = [m * sum(fwd[c * p + r] + bwd[c * p + r] + wt[c * p + r] for c in range(v)) - hidden[r]
            + sum(first[c * p + r] + final[c * p + r] for c in range(v)) for r in range(p)]
    return ScheduleRun(free, busy, last_b, units, hidden if a2a is not None else [])


def _dep(kind: str, k: int, at: int, m: int, n: int, done_f: list[float | None], done_b: list[float | None],
         sf: list[float], sb: list[float]) -> float | None:
    """When unit ``kind`` of virtual stage ``k`` at slot ``at`` (``k m`` + its microbatch) may
    start as far as the other stages go (:func:`run_schedule`), None while its input is not made:
    a forward after the stage before's forward and its send, a backward after the stage after's
    backward and its send back (the last stage's after its own forward), a W after its B."""
    if kind == "F":
        if k == 0:
            return 0.0
        d = done_f[at - m]
        return None if d is None else d + sf[k - 1]
    if kind == "W":
        return done_b[at]
    if k == n - 1:
        return done_f[at]
    d = done_b[at + m]
    return None if d is None else d + sb[k]


def bubble_formula(schedule: str, p: int, v: int, m: int, times: tuple[float, float, float] | None = None) -> float:
    """The bubble as a share of a device's work with equal stages and free sends: ``(p-1)/m``
    (GPipe, 1F1B), ``(p-1)/(v m)`` (interleaved), ``(p-1) max(T_F + T_B - T_W, T_F, T_B) /
    (m (T_F + T_B + T_W))`` (ZB-H1, ``m >= p``; ``times`` = (T_F, T_B, T_W), equal where not
    given: ``(p-1)/(3m)``): Qi et al.'s ``(p-1)(T_F + T_B - T_W)`` where ``T_W`` is at most
    ``T_F`` and ``T_B``; a longer W cannot hide in the gap of a shorter F or B."""
    if schedule == "interleaved":
        return (p - 1) / (v * m)
    if schedule == "zb-h1":
        tf, tb, tw = times or (1.0, 1.0, 1.0)
        work = tf + tb + tw
        return (p - 1) * max(tf + tb - tw, tf, tb) / (m * work) if work > 0 else 0.0
    return (p - 1) / m


__all__ = ["SCHEDULES", "SCHEDULE_ALIASES", "ScheduleInputs", "ScheduleRun", "bubble_formula", "check_microbatch_group",
           "held_counts", "in_flight", "run_schedule", "schedule_order", "schedule_table", "weight_pending"]
