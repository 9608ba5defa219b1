"""``full:K`` in the search: the least K layers per pipeline stage recomputed in full that fits.

Megatron-LM's ``--recompute-granularity full --recompute-method block --recompute-num-layers K``
recomputes the first K layers of each pipeline stage (of each model chunk) in full and keeps every
activation of the others (:func:`spmdkit.planner.pipeline_split.block_layers`, ``--recompute full:K``
for one plan). It matters where a pipeline does not fit without recomputation but does with full
recomputation: every layer between is recomputed for nothing. Memory falls and the step grows
with K, so the configuration's best ``full:K`` is the least K that fits, the choice Megatron users
make. :func:`wants_blocks` says when a configuration's priced modes call for it, and
:func:`least_blocks` finds that K with few pricings: memory falls with K, so K is bracketed
between the most known over the cap (at first 0, no recomputation) and the least known to fit
(at first the stage's layers, full), each guess interpolated between the two ends' bytes of the
fullest rank (each rank holds its stages' layers' activations, ``K`` of the ``c`` layers of a
stage leave its stash: nearly linear in K), usually 2-3 pricings.

The search's step bound (:mod:`spmdkit.planner.search_floor`'s floor under the memory bound)
counts ``full:K`` by :func:`blocks_floor`: on the memory bound's relaxation (each rank's layers,
their bytes for the step and the microbatches it keeps in flight) a rank's first K layers a chunk
keep what full recomputation keeps and the others what none keeps, so the least K whose ranks can
hold the model is a lower bound of the K planned, and the fewest layers such a split recomputes
give the least rerun added to no recomputation's floor (a lower bound of every full:K whatever
its split, even or not).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TypeVar

from spmdkit.cost.memory import recompute_layers
from spmdkit.planner.search_bounds import GROW, Bounds
from spmdkit.planner.search_space import Config

C = TypeVar("C")


def blocks_mode(k: int) -> str:
    return f"full:{k}"


def blocks_k(mode: str) -> int:
    """K of ``full:K`` (0 for another mode)."""
    return recompute_layers(mode) or 0


def blocks_floor(bounds: Bounds, cfg: Config, cap: int, kept_none: float, kept_full: float, step_none: float,
                 step_full: float, peak: float = 0.0) -> float:
    """The least step any ``full:K`` of the pipeline ``cfg`` can take within ``cap`` bytes a
    device (inf: none can fit), from no recomputation's and full's floors (``step_*``, one
    device's share of the model's work) and the fewest bytes a layer keeps of a microbatch under
    each (``kept_*``), on :meth:`spmdkit.planner.search_bounds.Bounds.memory`'s relaxation: rank
    ``r`` holds ``c_r`` layers (fractional, ``sum c_r = L``) at ``s`` bytes each for the step
    (the least a layer holds) and ``f_r`` microbatches in flight (:meth:`Bounds.flights`), of which its
    first ``v K`` layers (K of each of its ``v`` chunks) keep ``kept_full`` and the rest
    ``kept_none``: ``c_r (s + f_r kept_none) - f_r min(v K, c_r) (kept_none - kept_full)`` within
    the cap. The least K whose ranks can hold the ``L`` layers is a lower bound of the K
    planned; of the splits they allow, the one recomputing the fewest layers fills the ranks
    that hold the most and leaves the others one layer a chunk (the cost is concave in each
    ``c_r``), and the floor adds that share of the layers of full recomputation's rerun to no
    recomputation's. A MoE model (its dense layers lighter) counts no rerun.

    The activations count with the allocator's reserve (:data:`spmdkit.planner.search_bounds.GROW`),
    ``f_r`` as the plan counts it (:meth:`Bounds.flights`); and where the plan counts one
    microbatch at its working peak (Megatron), ``peak``: the least working peak of one recomputed
    layer alone (:func:`spmdkit.planner.search_floor.layer_peak`): every chunk's first layer is
    recomputed, and while it runs its backward its whole activations are live, so a rank also
    needs ``c_r s + (f_r - 1 / v) kept + peak`` (the other microbatches' stash beside it)."""
    if cfg.pp <= 1 or cfg.strategy == "auto":
        return step_none
    p, v, m = cfg.pp, cfg.virtual, cfg.microbatches
    dp = cfg.dp * cfg.cp
    per, total = bounds.held(dp, cfg.ep, cfg.tp, cfg.strategy)
    layers = len(per)
    budget = cap - bounds.overhead(dp, cfg.ep, cfg.tp, p)
    if not layers or total / p > budget:
        return math.inf
    unit = bounds.layer_input(dp, cfg.ep, cfg.tp, p, cfg.strategy, m)  # what every mode keeps at least
    kn, kf = GROW * max(unit, kept_none), GROW * max(unit, kept_full)
    held = min(per)
    flight, working = bounds.flights(p, v, m)
    ways = [(budget, 0.0)] + ([(budget - GROW * peak, 1.0 / v)] if working and peak > 0 else [])

    def fill(left: float, f: float, k: int) -> float:
        """The most layers ``left`` bytes hold at ``f`` microbatches' kept bytes with full:k."""
        if left <= 0:
            return 0.0
        every = left / (held + f * kf) if held + f * kf > 0 else math.inf  # all its layers recomputed
        if every <= v * k:
            return every
        return (left + f * v * k * (kn - kf)) / (held + f * kn) if held + f * kn > 0 else math.inf

    def room(k: int) -> list[float]:
        """The most layers each rank can hold with full:k."""
        return [min(fill(left, f - less, k) for left, less in ways) for f in flight]

    most = -(-layers // (p * v))  # K at least a stage's layers is full
    ks = [k for k in range(1, most) if sum(room(k)) >= layers]
    if not ks:
        return math.inf
    k = ks[0]
    if bounds.moe or kn <= kf:
        return step_none
    left, rerun = float(layers - v * p), float(v * p)  # each rank one layer a chunk (recomputed), then fill the roomiest
    for c in sorted(room(k), reverse=True):
        if left <= 0:
            break
        extra = min(left, max(0.0, c - v))
        rerun += min(v * k, v + extra) - v
        left -= extra
    return step_none + (step_full - step_none) * min(1.0, rerun / layers)


def wants_blocks(pp: int, modes: Sequence[str], priced: Sequence[tuple[str, bool, int]]) -> tuple[int | None, int] | None:
    """Whether a configuration's best ``full:K`` is wanted: a pipeline (``pp`` > 1) searched with
    full recomputation, whose ``priced`` modes (mode, fits, bytes a device) have full fitting and
    no recomputation over the cap (or not priced: a pruned search stops at the first mode over the
    cap, recomputing less holds more). Then (the bytes without recomputation where priced, the
    bytes with full), else None."""
    if pp <= 1 or "full" not in modes or "none" not in modes:
        return None
    got = {m: (fits, mem) for m, fits, mem in priced}
    full, none = got.get("full"), got.get("none")
    if full is None or not full[0] or (none is not None and none[0]):
        return None
    if none is None and "selective" not in got:
        return None  # not priced for another reason than the cap
    return (none[1] if none is not None else None), full[1]


def least_blocks(price: Callable[[int], C | None], fits: Callable[[C], bool], bytes_of: Callable[[C], int],
                 stage_layers: int, none_bytes: int | None, full_bytes: int, cap: int,
                 hopeless: Callable[[C], bool] | None = None) -> C | None:
    """The priced ``full:K`` of the least K (1 .. ``stage_layers`` - 1, the most layers a virtual
    stage holds: K at least that is ``full``) that fits, or None where none does; ``price(k)``
    prices ``full:k`` (None: it cannot be priced). Memory falls with K, so the least K is
    bracketed between the most that does not fit (0: no recomputation) and the least that does
    (``stage_layers``: full), each guess interpolated between the bracket's bytes (regula falsi;
    after two guesses that moved the same end, the middle), one layer from a bracket's end at least.
    ``hopeless(c)``: a K over the cap whose step already cannot win (the K that fits are larger,
    so slower): None at once (a pruned search)."""
    hi = stage_layers - 1
    if hi < 1:
        return None
    lo_k, lo_b = 0, none_bytes              # the most K known over the cap (bytes, where known)
    hi_k, hi_b = stage_layers, full_bytes   # the least K known to fit
    best: C | None = None
    sides = ""  # which end each guess moved: twice the same, the next guess bisects (Illinois-like)
    while hi_k - lo_k > 1:
        if lo_b is not None and lo_b > hi_b and not sides.endswith(("ff", "oo")):
            k = lo_k + math.ceil((hi_k - lo_k) * (lo_b - cap) / (lo_b - hi_b))
        else:
            k, sides = (lo_k + hi_k) // 2, ""
        k = min(max(k, lo_k + 1), hi_k - 1)
        c = price(k)
        if c is None:
            return best
        if fits(c):
            hi_k, hi_b, best, sides = k, bytes_of(c), c, sides + "f"
        else:
            if hopeless is not None and hopeless(c):
                return None
            lo_k, lo_b, sides = k, bytes_of(c), sides + "o"
    return best


__all__ = ["blocks_floor", "blocks_k", "blocks_mode", "least_blocks", "wants_blocks"]
