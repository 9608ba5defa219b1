"""A MoE model's layer floor from ONE shallow copy, its work counted layer by layer (issue 30).

:class:`spmdkit.planner.search_floor.StepFloor` prices each layer key (tp, ep, cp, the
strategy's tensor-parallel base, a data-parallel rank's sequences) on two shallow copies of the
model and extrapolates the work affinely (:func:`spmdkit.planner.fold.fold_of`). A MoE model's
dense first layers make both copies deep: DeepSeek-V3's 3 dense layers give copies of 4 and 5
layers, 9 layers planned per key, and its search has 167 keys (the ep degrees multiply them).

Here the key is planned once, on the deeper copy only (``dense + 2`` layers: the dense ones and
two of the repeated kind), and each op's work (:func:`spmdkit.planner.search_floor._work`'s:
GEMMs and attention passes at their local shapes, the ops that read no parameter, the
communication each op waits on) is counted in the layer the op belongs to
(:func:`spmdkit.program.layers.program_layers`). The full model's work is the copy's plus, for
each of the ``L - dense - 2`` layers it lacks, the LEAST of its two repeated layers' work: the
first of them follows a dense layer and the second precedes the head, so whatever their
neighbours add to either (a reshard at the boundary) is not counted again, and the sum is never
above the two-copy extrapolation (whose repeated layer is the deeper copy's added one:
``tests/test_search_floor.py`` checks both that and that the floor stays under every planned
step). Each recomputation mode's rerun is counted the same way (the recomputed ops by layer).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from spmdkit.core.errors import SpmdError
from spmdkit.cost.devices import Device
from spmdkit.cost.memory_saved import saved_activations
from spmdkit.cost.step import least_shared_gather_times, op_communication
from spmdkit.planner.pipeline_split import op_units
from spmdkit.planner.search_bounds import GROW, Bounds
from spmdkit.planner.search_floor import (
    NO_FLOOR,
    RECOMPUTE,
    LayerFloor,
    StepFloor,
    Units,
    _counted,
    backward_by_unit,
    layer_peak,
)
from spmdkit.planner.search_floor_tail import Held
from spmdkit.planner.search_space import Config
from spmdkit.program.layers import program_layers
from spmdkit.program.plan import Plan


def copy_layers(dense: int) -> int:
    """The layers of the one copy a MoE model's layer key is planned on."""
    return dense + 2


@dataclass(frozen=True)
class MoeLayerFloor(LayerFloor):
    """:class:`spmdkit.planner.search_floor.LayerFloor` with one layer of the repeated kind's
    figures (the least of the copy's two, one microbatch on one device): its work (s), what each
    recomputation mode runs again of it (s), the bytes it keeps under each mode."""

    layer_work: float = 0.0
    layer_rerun: dict[str, float] = field(default_factory=dict)
    layer_kept: dict[str, int] = field(default_factory=dict)
    #: the least work of any of the copy's layers, dense or MoE (s, one microbatch)
    least_layer: float = 0.0
    #: the least full recomputation's rerun of any of the copy's layers, dense or MoE (s, one microbatch)
    least_rerun: float = 0.0


def one_copy_floor(plan: Plan, device: Device, layers: int, dense: int) -> MoeLayerFloor:
    """The layer floor of a model of ``layers`` layers (``dense`` of them dense, first) from
    ``plan``, its copy of :func:`copy_layers` layers (module docstring)."""
    oc = op_communication(plan, device)
    prog = plan.program
    lay = program_layers(prog)
    where, tags = lay.op_layer, set(lay.tags)
    n = copy_layers(dense)
    if len(lay.tags) != n:
        raise ValueError(f"one_copy_floor: the copy has {len(lay.tags)} layers, not {n}")
    own = [0.0] * len(prog.ops)
    by_layer = [0.0] * n
    forward, fwd_layer = 0.0, [0.0] * n  # the forward's part (the whole copy's, by layer)
    shared = least_shared_gather_times(plan, device, oc, RECOMPUTE)  # a compiled cp grad's gather, under a mode
    for i, op in enumerate(prog.ops):
        if op.phase in ("forward", "backward"):
            c = oc.costs[i]
            own[i] = (oc.compute[i] if _counted(plan, i, c.matmul, c.attention is not None) else 0.0) + oc.wait[i]
            own[i] = max(0.0, own[i] - shared.get(i, 0.0))
            if 0 <= where[i] < n:
                by_layer[where[i]] += own[i]
            if op.phase == "forward":
                forward += own[i]
                if 0 <= where[i] < n:
                    fwd_layer[where[i]] += own[i]
    missing = layers - n
    unit, _n = op_units(prog)
    by_unit = [0.0] * (n + 2)  # the pipeline's units (the embedding, the layers, the head), as stages are cut
    for i, t in enumerate(own):
        by_unit[unit[i] + 1] += t
    back = backward_by_unit(prog, own, unit, n)
    units: dict[str, Units] = {}
    rerun: dict[str, float] = {}
    kept: dict[str, int] = {}
    layer_rerun: dict[str, float] = {}
    layer_kept: dict[str, int] = {}
    peak, least_rerun = 0, 0.0
    for mode in RECOMPUTE:
        saved = saved_activations(plan, mode)
        ops = {j for r in saved.recomputed for j in r}
        again = [0.0] * n
        for j in ops:
            if 0 <= where[j] < n:
                again[where[j]] += own[j]
        if mode == "full":
            peak, least_rerun = layer_peak(plan, saved), min(again)
        layer_rerun[mode] = min(again[dense:])
        per = list(by_unit)
        for j in ops:
            per[unit[j] + 1] += own[j]
        units[mode] = Units(per[0], per[-1], min(per[1:-1]), min(per[1 + dense:-1]))
        rerun[mode] = sum(own[j] for j in ops) + missing * layer_rerun[mode]
        kept[mode] = min((b for lay, b in saved.per_layer.items() if lay in tags), default=0)
        layer_kept[mode] = min(saved.per_layer.get(t, 0) for t in lay.tags[dense:])
    return MoeLayerFloor(sum(own) + missing * min(by_layer[dense:]), rerun, kept, units=units, full_peak=peak,
                         forward=forward + missing * min(fwd_layer[dense:]),
                         backward=Units(back[0], back[-1], min(back[1:-1]), min(back[1 + dense:-1])),
                         layer_work=min(by_layer[dense:]), layer_rerun=layer_rerun, layer_kept=layer_kept,
                         least_layer=min(by_layer), least_rerun=least_rerun)


def _moe_room(f: MoeLayerFloor, cfg: Config, bounds: Bounds, cap: int
              ) -> float | tuple[list[float], list[float], float]:
    """What :func:`split_floor` and :func:`blocks_split_floor` read: (each MoE layer's held bytes,
    each dense layer's, the room a rank has for them under ``cap``); or their answer where that
    is all: 0.0 (no pipeline, no MoE layer, an --auto strategy) or inf (no room at all)."""
    if cfg.pp == 1 or not f.layer_work or "auto" in cfg.strategy:
        return 0.0
    every, _total = bounds.held(cfg.dp * cfg.cp, cfg.ep, cfg.tp, cfg.strategy)
    per = [x for x, h in zip(every, bounds.layers) if h[1] > 0]
    if not per:
        return 0.0
    dense = [x for x, h in zip(every, bounds.layers) if h[1] <= 0]
    room = cap - bounds.overhead(cfg.dp, cfg.ep, cfg.tp, cfg.pp)
    if room <= 0:
        return math.inf
    return per, dense, room


def split_floor(cfg: Config, bounds: Bounds, f: MoeLayerFloor, mode: str, cap: int, tail: Held | None = None) -> float:
    """A pipeline's step at least under recomputation ``mode`` from how its MoE layers can be
    split under the memory cap (0: no pipeline or no MoE layer; inf: they cannot fit).

    Rank ``r`` of ``p`` holds ``c_r`` of the ``L`` MoE layers and, as :meth:`Bounds.memory`
    counts, ``f_r`` microbatches of their kept activations (:meth:`Bounds.flights`, with the
    allocator's reserve; under full recomputation one of them at a layer's working peak): it needs at least
    ``c_r (s + f_r u)`` bytes (``s``: the least parameters, gradients and states a MoE layer
    holds on a device under the strategy, :attr:`Bounds.layers`; ``u``: the least a MoE layer
    keeps of one microbatch under ``mode``), so ``c_r <= M_r = room / (s + f_r u)``, and it
    works at least ``m c_r t`` seconds a step (``t``: a MoE layer's work and rerun for one
    microbatch). Layers are whole, so ``c_r <= floor(M_r)``; and the ``D`` dense first layers
    take their room too (:func:`whole_layers_level`: where they can lie). Some rank holds at
    least ``c*``, the least ``c`` with ``sum_r min(c, floor(M_r)) >= L`` over the dense layers'
    best placement: the step is at least ``m c* t``, plus the work of the chunks before the
    lowest rank ``r`` that can hold ``c*`` (:func:`split_levels`: at least ``r`` layers). A time-balanced split (what
    :meth:`StepFloor.step` assumes) puts on the first ranks, whose microbatches in flight are
    the most, more layers than their memory holds without recomputation; this bound makes the
    other ranks pay for it."""
    fits = _moe_room(f, cfg, bounds, cap)
    if isinstance(fits, float):
        return fits
    per, dense, room = fits
    m = max(1, cfg.microbatches)
    flights, working = bounds.flights(cfg.pp, cfg.virtual, m)
    peak = GROW * f.full_peak if working and mode == "full" else 0.0
    levels = split_levels(room, cfg.pp, cfg.virtual, m, len(per), min(per), GROW * f.layer_kept.get(mode, 0),
                          len(dense), min(dense, default=0.0), GROW * f.kept.get(mode, 0), 0, 0.0, flights, peak)
    t = f.layer_work + f.layer_rerun.get(mode, 0.0)
    return min((level_low(m * c * t, c, r, held, (m, cfg.pp, t, f.least_layer), tail) for c, r, held in levels),
               default=math.inf)


def _held_rerun(c: int, k: int, v: int, least: float, d: int) -> float:
    """What a rank holding the level's ``c`` MoE layers and ``d`` dense ones recomputes at least a
    microbatch under full:``k`` (:func:`_recomputed` of its layers, each the least rerun)."""
    return _recomputed(c + d, k, v) * least


def level_low(work: float, c: int, plain: int, held: tuple[tuple[int, int], ...],
              shape: tuple[int, float, float, float], tail: Held | None = None,
              rerun: Callable[[int], float] | None = None) -> float:
    """The least step of the ranks that may hold the level ``c`` (:func:`split_levels`): the
    lowest without a dense layer, ``plain`` (-1: none), working ``work`` a step on its layers,
    after the chunks before it (``plain`` layers at least); each of ``held`` (rank, its dense
    layers) ``m (c t + d lam)`` after its ``q`` chunks before. ``shape``: (m, p, t, lam).
    ``tail(moe, dense, first, last)``: what the rank does at least after its last backward
    (:meth:`spmdkit.planner.search_floor_tail.Tail.held`): the chain before it ends on rank 0
    after the rank's own last backward, its tail after that backward, so the larger of the two
    counts (:func:`spmdkit.planner.search_floor.busiest_rank`'s argument; rank 0's tail left
    out); a rank after ``plain`` holding the level has at least the tail of a middle rank, and
    where ``plain`` is the first rank one after it has at least one layer more before it.
    ``rerun(d)``: what a rank holding ``d`` dense layers recomputes at least a microbatch (full:K)."""
    m, p, t, lam = shape

    def after(q: int, moe: int, dense: int, first: bool, last: bool) -> float:
        return max(q * lam, tail(moe, dense, first, last)) if tail is not None else q * lam

    got = []
    if plain >= 0:
        got.append(work + after(plain, c, 0, plain == 0, p == 1))
        if plain == 0 and tail is not None and p > 1:
            got[-1] = min(got[-1], work + after(1, c, 0, False, False))
    got += [m * (c * t + d * lam + (rerun(d) if rerun is not None else 0.0)) + after(q, c, d, q == 0, q == p - 1)
            for q, d in held]
    return min(got, default=math.inf)


#: the most dense first layers whose placements :func:`whole_layers_level` tries (beyond, their room is not counted)
DENSE_WAYS = 6


def whole_layers_level(room: float, p: int, v: int, m: int, moe: int, s: float, u: float, dense: int = 0,
                       sd: float = 0.0, ud: float = 0.0, k: int = 0, uf: float = 0.0) -> float:
    """The least ``c`` such that ``moe`` whole MoE layers fit on ``p`` pipeline ranks of
    ``room`` bytes with at most ``c`` on any (inf: none does), rank ``r`` holding
    ``min(p - r, m)`` microbatches in flight: a MoE layer needs ``s + f_r u`` bytes there, a
    dense one ``sd + f_r ud``.

    The ``dense`` dense layers come first, each chunk holds at least one layer and chunk
    ``k < p`` lies on rank ``k`` (``v`` chunks a rank, chunk ``k`` on rank ``k mod p``): so they
    lie in chunks ``0 .. j`` of ranks ``0 .. j`` for some ``j < dense``, chunks ``0 .. j - 1``
    holding only dense layers (at least one each) and chunk ``j`` at least one. With one chunk a
    rank (``v = 1``) ranks ``0 .. j - 1`` hold no MoE layer; with more their later chunks may.
    The level is the least over these placements (where there are more than
    :data:`DENSE_WAYS` dense layers or more than ``p``, their room is left out: a lower bound
    still).

    ``k`` > 0: Megatron's ``full:k`` (the first ``k`` layers of each chunk recomputed in full):
    at most ``v k`` of a rank's MoE layers keep ``uf`` bytes a microbatch (full's), the others
    ``u`` (:func:`blocks_split_floor` counts the rerun only on a rank without dense layers:
    another's recomputed layers may be dense ones)."""
    return float(min((c for c, _r, _d in split_levels(room, p, v, m, moe, s, u, dense, sd, ud, k, uf)), default=math.inf))


@functools.lru_cache(maxsize=4096)
def split_levels(room: float, p: int, v: int, m: int, moe: int, s: float, u: float, dense: int = 0,
                 sd: float = 0.0, ud: float = 0.0, k: int = 0, uf: float = 0.0, flights: tuple[float, ...] = (),
                 peak: float = 0.0) -> tuple[tuple[int, int, tuple[tuple[int, int], ...]], ...]:
    """:func:`whole_layers_level`'s level of each placement of the dense layers that fits, with
    the ranks whose room holds that many MoE layers: the lowest holding no dense layer (-1:
    none) and each holding dense layers, with their count: ``(level, rank, ((rank, dense),
    ...))``. One of them holds the level, and its step is at least ``m W_r`` (its layers, dense
    ones too) plus the work of chunks ``0 .. r - 1`` (:func:`spmdkit.planner.search_floor.
    busiest_rank`'s argument), each at least one layer.

    ``flights``: rank ``r``'s microbatches in flight (:meth:`spmdkit.planner.search_bounds.Bounds.
    flights`; else ``min(p - r, m)``); ``peak`` > 0: one of them is at its working peak, at least
    ``peak`` bytes (a recomputed layer's: :func:`spmdkit.planner.search_floor.layer_peak`) beside
    ``f_r - 1 / v`` microbatches' kept bytes, so a rank's layers also fit ``room - peak`` at that
    count (the bytes of activations given with the allocator's reserve by the caller)."""
    if dense > min(DENSE_WAYS, p):
        dense = 0

    def caps(a: tuple[int, ...]) -> list[int] | None:
        out = []
        for r in range(p):
            f = flights[r] if flights else min(p - r, m)
            most = moe
            for rm, fr in ((room, f), (room - peak, f - 1.0 / v))[:2 if peak > 0 else 1]:
                left = rm - (a[r] * (sd + fr * ud) if r < len(a) else 0.0)
                if left < 0:
                    return None
                most = min(most, _most(left, fr, s, u, v * k, uf, moe))
            blocked = v == 1 and r < len(a) - 1
            out.append(0 if blocked else most)
        return out

    got_levels = []
    for a in _placements(dense) if dense else [()]:
        got = caps(a)
        if got is None or sum(got) < moe:
            continue
        c = max(1, -(-moe // p))
        while sum(min(c, x) for x in got) < moe:
            c += 1
        plain = next((i for i, x in enumerate(got) if x >= c and i >= len(a)), -1)
        got_levels.append((c, plain, tuple((r, a[r]) for r in range(len(a)) if got[r] >= c)))
    return tuple(got_levels)


def _most(left: float, f: float, s: float, u: float, full: int, uf: float, moe: int) -> int:
    """The most whole MoE layers ``left`` bytes hold on a rank with ``f`` microbatches in flight,
    ``full`` of them keeping ``uf`` bytes a microbatch and the others ``u`` (at most ``moe``)."""
    def most(room: float, per: float) -> int:
        return moe if per <= 0 else min(moe, math.floor(room / per * (1 + 1e-12)))

    if full <= 0 or uf >= u:
        return most(left, s + f * min(u, uf) if full > 0 else s + f * u)
    every = most(left, s + f * uf)  # all its layers recomputed
    return every if every <= full else max(full, most(left + f * full * (u - uf), s + f * u))


def blocks_split_floor(cfg: Config, bounds: Bounds, f: MoeLayerFloor, cap: int, tail: Held | None = None) -> float:
    """A MoE pipeline's step at least under any ``full:K`` (Megatron's block recomputation: the
    first K layers of each chunk recomputed in full, the others keeping what no recomputation
    keeps), from how its MoE layers can be split under the memory cap (:func:`split_floor`'s
    argument, whole layers, at most ``v K`` of a rank's MoE layers keeping full's bytes): for
    each K some rank holds at least ``c*`` MoE layers (:func:`split_levels` with ``k = K``, a
    recomputed layer's working peak counted where the plan counts it). Each of its ``v`` chunks
    holds a layer and recomputes its first K, so at least ``R = v - 1 + min(K, c* - v + 1)``
    layers: if it holds no dense layer it works at least ``m (c* t + R r)`` a step (``t``: a MoE
    layer's work, ``r``: its full rerun); one holding ``d`` dense layers at least ``m (c* t + d
    w + R' r')`` (``R'`` over its ``c* + d`` layers, ``w`` and ``r'``: any layer's least work and
    rerun: its recomputed layers may be dense ones); plus the chunks before it. The least over K
    and the ranks that can hold ``c*`` (0: no pipeline or MoE layer; inf: no K fits)."""
    fits = _moe_room(f, cfg, bounds, cap)
    if isinstance(fits, float):
        return fits
    per, dense, room = fits
    m, p, v = max(1, cfg.microbatches), cfg.pp, cfg.virtual
    s, un, uf = min(per), GROW * f.layer_kept.get("none", 0), GROW * f.layer_kept.get("full", 0)
    t, r = f.layer_work, f.layer_rerun.get("full", 0.0)
    flights, working = bounds.flights(p, v, m)
    peak = GROW * f.full_peak if working else 0.0  # every chunk's first layer is recomputed
    best = math.inf
    for k in range(1, len(per) + 1):
        for c, plain, held in split_levels(room, p, v, m, len(per), s, un, len(dense), min(dense, default=0.0),
                                           GROW * f.kept.get("none", 0), k, uf, flights, peak):
            # the rank holding the level: each of its v chunks holds a layer and recomputes its first
            # k, so at least v - 1 + min(k, c - v + 1) of its c layers (one chunk holding all but v - 1):
            # MoE layers on a rank without a dense layer, any layers on one with d dense layers
            best = min(best, level_low(m * (c * t + _recomputed(c, k, v) * r), c, plain, held, (m, p, t, f.least_layer),
                                       tail, functools.partial(_held_rerun, c, k, v, f.least_rerun)))
        if all(_most(room, min(p - q, m), s, uf, 0, uf, len(per)) <= v * k for q in range(p)):
            break  # every rank's layers all recomputed fit already: a larger K holds no more
    return best


def _recomputed(c: int, k: int, v: int) -> int:
    """The fewest layers ``full:k`` recomputes on a rank of ``v`` chunks holding ``c`` layers
    (each chunk at least one, its first ``k`` recomputed): ``v - 1`` chunks of one layer, the
    rest in one chunk."""
    return v - 1 + min(k, max(c, v) - v + 1)


def _placements(dense: int) -> list[tuple[int, ...]]:
    """The counts of ``dense`` first layers on ranks ``0 .. j`` (each at least one), every ``j``."""
    if dense == 0:
        return [()]
    out: list[tuple[int, ...]] = [(dense,)]
    for first in range(1, dense):
        out += [(first, *rest) for rest in _placements(dense - first)]
    return out


@dataclass
class LayerStepFloor(StepFloor):
    """:class:`spmdkit.planner.search_floor.StepFloor` whose layer keys are planned on ONE copy
    of ``dense + 2`` layers (:func:`one_copy_floor`), for a model with dense first layers deep
    enough to have more; with ``bounds`` and ``cap``, a pipeline's step is also at least its
    :func:`split_floor`, and under ``full:K`` its :func:`blocks_split_floor`."""

    bounds: Bounds | None = None
    cap: int = 0

    def step(self, cfg: Config, mode: str = "none", gathers: bool = False, busiest: bool = True) -> float:
        low = super().step(cfg, mode, gathers, busiest)
        f = self.of(cfg)
        if self.bounds is None or not self.cap or not isinstance(f, MoeLayerFloor):
            return low
        return max(low, split_floor(cfg, self.bounds, f, mode, self.cap, self._held(cfg, gathers)))

    def blocks_step(self, cfg: Config, gathers: bool = False) -> float:
        f = self.of(cfg)
        if self.bounds is None or not self.cap or not isinstance(f, MoeLayerFloor):
            return 0.0
        return blocks_split_floor(cfg, self.bounds, f, self.cap, self._held(cfg, gathers))

    def _held(self, cfg: Config, gathers: bool) -> Held | None:
        """The tail of a rank by what it holds, once ``cfg``'s turn has come (``gathers``)."""
        t = self.tail(cfg) if gathers and cfg.pp > 1 else None
        return None if t is None else t.held

    def of(self, cfg: Config) -> LayerFloor:
        n = copy_layers(self.dense)
        key = self.key(cfg)
        if key is None or not self.dense or self.layers <= n:
            return super().of(cfg)
        got = self.cache.get(key)
        if got is None:
            tp, ep, cp, strategy, local = key
            self.plans += 1
            try:
                plan = self.plan_copy(Config(1, tp, 1, strategy, "none", 1, ep, cp), n, local)
                got = one_copy_floor(plan, self.device, self.layers, self.dense)
            except SpmdError:
                got = NO_FLOOR  # its layers cannot be planned so (the configuration says why when planned)
            self.cache[key] = got
        return got


__all__ = ["LayerStepFloor", "MoeLayerFloor", "copy_layers", "level_low", "one_copy_floor", "split_floor",
           "blocks_split_floor", "split_levels", "whole_layers_level"]
