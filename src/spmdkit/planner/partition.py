"""Layers into pipeline stages: the even split, the split balanced by cost, and
:func:`partition`, the split that minimises the slowest stage under each device's memory.

:func:`partition` works on per-unit arrays (:class:`UnitCosts`: unit 0 the embedding, units
1..L the layers, unit L+1 the final norm, the head and the loss; each unit's forward and
backward time of one microbatch, the bytes it holds for the whole step, the bytes one
microbatch keeps for its backward), so a search can call it for every (pp, virtual stages,
microbatches) of one plan without planning again. The schedule's step is paced by its slowest
(virtual) stage: with ``m`` microbatches 1F1B takes about ``sum_k t_k + (m - 1) max_k t_k``,
the sum the same for every split, so the split minimises ``max_k t_k`` (each stage's time
with its blocking sends) subject to each stage's memory: its units' held bytes plus the
microbatches the schedule keeps in flight on its device
(:func:`spmdkit.planner.schedules.in_flight`: 1F1B ``p - r`` on rank ``r``; interleaved,
Megatron-LM's warm-up count; ZB-H1 also the ``r`` deferred weight gradients) times its stash,
plus its largest working transient, within ``capacity``. With ``v`` virtual stages a model
chunk is held to ``capacity / v`` (a sufficient condition: the device's chunks together fit).

The optimum is exact: a binary search on the slowest stage's time, each bound checked by
packing the stages greedily from the last one (each as many layers as the bound and its
memory allow, leaving one layer for each stage before it). Since a stage's time and memory
only grow with its layers, the greedy packing fits whenever any split does (the exchange
argument of the linear partition problem), so the bound found is the dynamic program's
``min over splits of max_k t_k`` at ``O(L log)`` instead of ``O(p v L^2)``. Among the splits
that reach it, the greedy packing puts the layers on the later stages first and leaves the
first stage (the most microbatches in flight) the fewest.

The slowest stage is the whole story only with many microbatches: with few (torchtitan's
``m = p``) the pipeline's fill and drain weigh as much, and 1F1B's warm-up fills sooner with
the heavier stages first. So the min-max split is then refined against the schedule itself
(:func:`simulate_split`: the event simulation of :mod:`spmdkit.planner.schedules` over the
split's stage times): from it and from the even split, one layer at a time is moved across a
boundary while the simulated pipeline gets faster and every rank fits, within
:data:`SIM_UNITS` simulated units (``refine=False``: the min-max split alone).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from spmdkit.core.errors import ProgramError
from spmdkit.planner.schedules import in_flight, run_schedule, weight_pending

#: the most schedule units (forwards and backwards) one :func:`partition` simulates to refine its split
SIM_UNITS = 40_000


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


@dataclass(frozen=True)
class UnitCosts:
    """One microbatch's costs per unit: 0 the embedding, 1..L the layers, L+1 the final norm,
    the head and the loss. Times in s (each unit's forward and backward with the communication
    its ops wait on; ``weight_s`` the part of the backward that makes parameter gradients,
    which ZB-H1 defers); bytes per device: ``held`` for the whole step (parameters, gradients,
    optimizer states), ``stash`` what one microbatch keeps for the backward, ``wstash`` what
    it still keeps after its input gradients (the weight gradients' inputs), ``transient`` the
    working peak beyond the stash. ``send_s``: one boundary's send (each direction)."""

    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    held: tuple[float, ...] = ()
    stash: tuple[float, ...] = ()
    transient: tuple[float, ...] = ()
    weight_s: tuple[float, ...] = ()
    wstash: tuple[float, ...] = ()
    send_s: float = 0.0

    @property
    def layers(self) -> int:
        return len(self.forward_s) - 2

    def _arr(self, name: str) -> tuple[float, ...]:
        a: tuple[float, ...] = getattr(self, name)
        return a if a else (0.0,) * len(self.forward_s)

    def to_json(self) -> dict[str, Any]:
        return {k: list(getattr(self, k)) if k != "send_s" else self.send_s for k in self.__dataclass_fields__}


def unit_costs(time: Sequence[float], held: Sequence[float] = (), stash: Sequence[float] = (),
               send_s: float = 0.0) -> UnitCosts:
    """:class:`UnitCosts` from plain arrays (``time``: forward and backward together, length
    L + 2 with the embedding first and the head last)."""
    n = len(time)
    for name, a in (("held", held), ("stash", stash)):
        if a and len(a) != n:
            raise ProgramError(f"partition: {name} has {len(a)} units, time has {n}")
    return UnitCosts(tuple(float(t) for t in time), (0.0,) * n, tuple(map(float, held)), tuple(map(float, stash)),
                     send_s=float(send_s))


@dataclass(frozen=True)
class Partition:
    """Layers per virtual stage and why: each stage's time for one microbatch (forward and
    backward with its blocking sends), each pipeline rank's bytes (held + in flight), the
    slowest stage, the capacity it was held to and whether every rank fits."""

    counts: tuple[int, ...]
    stage_s: tuple[float, ...]
    rank_bytes: tuple[float, ...]
    bottleneck_s: float
    capacity: float | None
    fits: bool
    schedule: str
    #: the schedule simulated over the stages' times (:func:`simulate_split`), 0 where not simulated
    pipeline_s: float = 0.0
    #: the min-max split before the refinement by simulation
    min_max: tuple[int, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"layers_per_stage": list(self.counts), "stage_s": list(self.stage_s),
                "rank_bytes": list(self.rank_bytes), "bottleneck_s": self.bottleneck_s,
                "capacity_bytes": self.capacity, "fits": self.fits, "pipeline_s": self.pipeline_s or None,
                "min_max_split": list(self.min_max)}


class _Prefix:
    """Prefix sums of the per-unit arrays and a sparse table for the largest transient."""

    def __init__(self, u: UnitCosts) -> None:
        n = len(u.forward_s)
        # every schedule's steady state runs each microbatch's F, B and W on every device: the
        # slowest stage's whole backward sets the pace (ZB-H1's W fill the warm-up and
        # cool-down only)
        self.t = _cum([f + b for f, b in zip(u.forward_s, u.backward_s)])
        self.held = _cum(u._arr("held"))
        self.stash = _cum(u._arr("stash"))
        self.wstash = _cum(u._arr("wstash"))
        self.tr = [list(u._arr("transient"))]
        k = 1
        while 2 * k <= n:
            prev = self.tr[-1]
            self.tr.append([max(prev[i], prev[i + k]) for i in range(n - 2 * k + 1)])
            k *= 2

    def peak(self, a: int, b: int) -> float:
        """The largest transient of units [a, b)."""
        if b <= a:
            return 0.0
        j = (b - a).bit_length() - 1
        return max(self.tr[j][a], self.tr[j][b - (1 << j)])


def _cum(a: Sequence[float]) -> list[float]:
    out = [0.0]
    for x in a:
        out.append(out[-1] + x)
    return out


class _Stages:
    """Time and memory of virtual stage ``k`` over units [a, b) (the embedding, unit 0, with
    stage 0; the head, unit L+1, with the last)."""

    def __init__(self, u: UnitCosts, p: int, v: int, m: int, schedule: str, pre: _Prefix | None = None,
                 group: int | None = None) -> None:
        self.u, self.p, self.v, self.n = u, p, v, p * v
        self.pre = pre or _Prefix(u)
        self.flight = [in_flight(schedule, p, v, m, r, group=group) for r in range(p)]
        self.pending = [weight_pending(schedule, p, m, r) for r in range(p)]

    def span(self, k: int, a: int, b: int) -> tuple[int, int]:
        """Units of stage ``k`` holding layers [a, b) (layer i is unit i)."""
        return (0 if k == 0 else a), (b + 1 if k == self.n - 1 else b)

    def time(self, k: int, a: int, b: int) -> float:
        lo, hi = self.span(k, a, b)
        sends = (k > 0) + (k < self.n - 1) if self.n > 1 else 0
        return self.pre.t[hi] - self.pre.t[lo] + sends * self.u.send_s

    def memory(self, k: int, a: int, b: int) -> float:
        lo, hi = self.span(k, a, b)
        pr = self.pre
        r = k % self.p
        return (pr.held[hi] - pr.held[lo] + self.flight[r] * (pr.stash[hi] - pr.stash[lo])
                + self.pending[r] * (pr.wstash[hi] - pr.wstash[lo]) + pr.peak(lo, hi))


def _pack(st: _Stages, L: int, bound: float, cap: float | None, tol: float) -> list[int] | None:
    """Counts per stage, the last stage first and each as full as ``bound`` and ``cap`` allow
    (None: no split within them)."""
    n = st.n
    counts: list[int] = []
    hi = L + 1  # layers [1, hi) not yet placed
    for k in range(n - 1, 0, -1):
        c = 0
        while hi - c - 1 > k and st.time(k, hi - c - 1, hi) <= bound + tol and (
                cap is None or st.memory(k, hi - c - 1, hi) <= cap):
            c += 1
        if c == 0:
            return None
        counts.append(c)
        hi -= c
    if st.time(0, 1, hi) > bound + tol or (cap is not None and st.memory(0, 1, hi) > cap):
        return None
    counts.append(hi - 1)
    return counts[::-1]


def stage_loads(u: UnitCosts, counts: Sequence[int], p: int, v: int = 1, m: int = 1,
                schedule: str = "1f1b", group: int | None = None) -> tuple[list[float], list[float]]:
    """(each virtual stage's time, each pipeline rank's bytes) of the split ``counts`` (``group``:
    the interleaved schedule's microbatch group, None: ``p``)."""
    st = _Stages(u, p, v, m, schedule, group=group)
    times, ranks = [], [0.0] * p
    a = 1
    for k, c in enumerate(counts):
        times.append(st.time(k, a, a + c))
        ranks[k % p] += st.memory(k, a, a + c)
        a += c
    return times, ranks


def simulate_split(u: UnitCosts, counts: Sequence[int], p: int, v: int = 1, m: int = 1,
                   schedule: str = "1f1b", group: int | None = None) -> float:
    """The pipeline's time for ``m`` microbatches (:func:`spmdkit.planner.schedules.run_schedule`)
    over the stage times of the split ``counts`` (ZB-H1: its B and W apart), each boundary's
    send ``u.send_s``."""
    pre = _Prefix(u)
    fw, bw, wt = _cum(u.forward_s), _cum(u.backward_s), _cum(u._arr("weight_s"))
    st = _Stages(u, p, v, m, schedule, pre, group)
    f, b, w = [], [], []
    a = 1
    for k, c in enumerate(counts):
        lo, hi = st.span(k, a, a + c)
        f.append(fw[hi] - fw[lo])
        w.append(wt[hi] - wt[lo] if schedule == "zb-h1" else 0.0)
        b.append(bw[hi] - bw[lo] - w[-1])
        a += c
    n = len(counts)
    sends = [u.send_s if k < n - 1 else 0.0 for k in range(n)]
    return run_schedule(schedule, p, v, m, f, b, sends, sends, weight=w if schedule == "zb-h1" else None,
                        group=group).pipeline_s


def partition(u: UnitCosts, p: int, v: int = 1, m: int = 1, schedule: str = "1f1b",
              capacity: float | None = None, refine: bool = True, group: int | None = None) -> Partition:
    """The layers of ``u`` in ``p * v`` contiguous virtual stages of at least one layer each,
    the slowest stage as fast as it can be with every rank's bytes within ``capacity`` (None:
    no memory bound); where no split fits, the fastest split regardless, ``fits`` False.
    Exact (module docstring); about ``60 L`` stage evaluations. ``refine``: then, within
    :data:`SIM_UNITS` simulated units, the schedule simulated (:func:`simulate_split`) from
    that split and from the even split, each improved by moving one layer across a boundary
    while the simulated pipeline gets faster and the ranks fit: with few microbatches the
    pipeline's fill and drain weigh as much as its slowest stage (heavier stages first fill
    1F1B's warm-up sooner), with many the min-max split is already the fastest. ``group``: the
    interleaved schedule's microbatch group (None: ``p``)."""
    L, n = u.layers, p * v
    if not 1 <= n <= L:
        raise ProgramError(f"--stages auto: {L} layers cannot fill {n} stages (each needs at least one layer)")
    st = _Stages(u, p, v, m, schedule, group=group)
    cap = capacity / v if capacity is not None else None
    total = st.pre.t[-1] + 2 * n * u.send_s
    tol = 1e-9 * (total + 1e-300)
    lo_b, hi_b = 0.0, total
    best = _pack(st, L, hi_b, cap, tol)
    fits = best is not None
    if best is None:  # nothing fits: the fastest split, memory aside
        cap = None
        best = _pack(st, L, hi_b, None, tol)
    assert best is not None
    for _ in range(200):
        if hi_b - lo_b <= tol:
            break
        mid = (lo_b + hi_b) / 2
        got = _pack(st, L, mid, cap, tol)
        if got is None:
            lo_b = mid
        else:
            best, hi_b = got, mid
    min_max = tuple(best)
    sim = 0.0
    if refine and p * v > 1:
        best, sim = _refine(u, p, v, m, schedule, list(best), capacity if fits else None, group)
    times, ranks = stage_loads(u, best, p, v, m, schedule, group)
    ok = fits and (capacity is None or max(ranks) <= capacity * (1 + 1e-12))
    return Partition(tuple(best), tuple(times), tuple(ranks), max(times), capacity, ok, schedule, sim, min_max)


def _refine(u: UnitCosts, p: int, v: int, m: int, schedule: str, start: list[int],
            capacity: float | None, group: int | None = None) -> tuple[list[int], float]:
    """(the split, its simulated pipeline) found by moving one layer at a time across a
    boundary from ``start`` and from the even split (where it fits), while the simulated
    pipeline gets faster, within :data:`SIM_UNITS` simulated units (none: ``start``, 0)."""
    n = p * v
    budget = SIM_UNITS // (2 * n * m)
    if budget < 2:
        return start, 0.0

    def fits(c: list[int]) -> bool:
        return capacity is None or max(stage_loads(u, c, p, v, m, schedule, group)[1]) <= capacity * (1 + 1e-12)

    seen: dict[tuple[int, ...], float] = {}

    def cost(c: list[int]) -> float:
        key = tuple(c)
        if key not in seen:
            seen[key] = simulate_split(u, c, p, v, m, schedule, group)
        return seen[key]

    even = even_split(u.layers, n)
    starts = [start] + ([even] if even != start and fits(even) else [])
    best = min(starts, key=cost)
    while len(seen) < budget:
        here = cost(best)
        moves = []
        for i in range(n - 1):
            for d in (1, -1):
                c = list(best)
                c[i] += d
                c[i + 1] -= d
                if min(c[i], c[i + 1]) >= 1 and tuple(c) not in seen and fits(c):
                    moves.append(c)
        if not moves or len(seen) + len(moves) > budget:
            break
        nxt = min(moves, key=cost)
        if cost(nxt) >= here * (1 - 1e-12):
            break
        best = nxt
    return best, cost(best)


__all__ = ["SIM_UNITS", "Partition", "UnitCosts", "balanced_split", "even_split", "partition", "simulate_split",
           "stage_loads", "unit_costs"]
