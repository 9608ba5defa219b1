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

import math
from dataclasses import dataclass, field

from spmdkit.core.errors import SpmdError
from spmdkit.cost.devices import Device
from spmdkit.cost.memory import saved_activations
from spmdkit.cost.step import op_communication
from spmdkit.planner.search_bounds import Bounds
from spmdkit.planner.search_floor import NO_FLOOR, RECOMPUTE, LayerFloor, StepFloor, _counted
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
    for i, op in enumerate(prog.ops):
        if op.phase in ("forward", "backward"):
            c = oc.costs[i]
            own[i] = (oc.compute[i] if _counted(plan, i, c.matmul, c.attention is not None) else 0.0) + oc.wait[i]
            if 0 <= where[i] < n:
                by_layer[where[i]] += own[i]
    missing = layers - n
    rerun: dict[str, float] = {}
    kept: dict[str, int] = {}
    layer_rerun: dict[str, float] = {}
    layer_kept: dict[str, int] = {}
    for mode in RECOMPUTE:
        saved = saved_activations(plan, mode)
        ops = {j for r in saved.recomputed for j in r}
        again = [0.0] * n
        for j in ops:
            if 0 <= where[j] < n:
                again[where[j]] += own[j]
        layer_rerun[mode] = min(again[dense:])
        rerun[mode] = sum(own[j] for j in ops) + missing * layer_rerun[mode]
        kept[mode] = min((b for lay, b in saved.per_layer.items() if lay in tags), default=0)
        layer_kept[mode] = min(saved.per_layer.get(t, 0) for t in lay.tags[dense:])
    return MoeLayerFloor(sum(own) + missing * min(by_layer[dense:]), rerun, kept, layer_work=min(by_layer[dense:]),
                         layer_rerun=layer_rerun, layer_kept=layer_kept)


def split_floor(cfg: Config, bounds: Bounds, f: MoeLayerFloor, mode: str, cap: int) -> float:
    """A pipeline's step at least under recomputation ``mode`` from how its MoE layers can be
    split under the memory cap (0: no pipeline or no MoE layer; inf: they cannot fit).

    Rank ``r`` of ``p`` holds ``c_r`` of the ``L`` MoE layers and, as :meth:`Bounds.memory`
    counts, ``min(p - r, m)`` microbatches of their kept activations: it needs at least
    ``c_r (s + f_r u)`` bytes (``s``: the least parameters, gradients and states a MoE layer
    holds on a device under the strategy, :attr:`Bounds.layers`; ``u``: the least a MoE layer
    keeps of one microbatch under ``mode``), so ``c_r <= M_r = room / (s + f_r u)``, and it
    works at least ``m c_r t`` seconds a step (``t``: a MoE layer's work and rerun for one
    microbatch). Some rank holds at least ``c*``, the least ``c`` with ``sum_r min(c, M_r) >= L``
    (the split that fills each rank to its cap, contiguity and whole layers relaxed): the step is
    at least ``m c* t``. A time-balanced split (what :meth:`StepFloor.step` assumes) puts on the
    first ranks, whose microbatches in flight are the most, more layers than their memory holds
    without recomputation; this bound makes the other ranks pay for it."""
    if cfg.pp == 1 or not f.layer_work or "auto" in cfg.strategy:
        return 0.0
    every, _total = bounds.held(cfg.dp * cfg.cp, cfg.ep, cfg.tp, cfg.strategy)
    per = [x for x, h in zip(every, bounds.layers) if h[1] > 0]
    if not per:
        return 0.0
    room = cap - bounds.overhead(cfg.dp, cfg.ep, cfg.tp, cfg.pp)
    m = max(1, cfg.microbatches)
    s, u = min(per), f.layer_kept.get(mode, 0)
    if room <= 0:
        return math.inf
    caps = sorted(room / (s + min(cfg.pp - r, m) * u) for r in range(cfg.pp)) if s + u > 0 else []
    if not caps or sum(caps) < len(per):
        return math.inf if caps else 0.0
    return m * fill_level(caps, len(per)) * (f.layer_work + f.layer_rerun.get(mode, 0.0))


def fill_level(caps: list[float], total: float) -> float:
    """The least ``c`` with ``sum(min(c, x) for x in caps) >= total`` (``caps`` ascending, their
    sum at least ``total``): ranks whose cap is under the level hold their cap, the others the
    level."""
    rest, k = total, len(caps)
    for i, x in enumerate(caps):
        level = rest / (k - i)
        if level <= x:
            return level
        rest -= x
    return caps[-1]


@dataclass
class LayerStepFloor(StepFloor):
    """:class:`spmdkit.planner.search_floor.StepFloor` whose layer keys are planned on ONE copy
    of ``dense + 2`` layers (:func:`one_copy_floor`), for a model with dense first layers deep
    enough to have more; with ``bounds`` and ``cap``, a pipeline's step is also at least its
    :func:`split_floor`."""

    bounds: Bounds | None = None
    cap: int = 0

    def step(self, cfg: Config, mode: str = "none", *args: bool, **kw: bool) -> float:
        low = super().step(cfg, mode, *args, **kw)
        f = self.of(cfg)
        if self.bounds is None or not self.cap or not isinstance(f, MoeLayerFloor):
            return low
        return max(low, split_floor(cfg, self.bounds, f, mode, self.cap))

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


__all__ = ["LayerStepFloor", "MoeLayerFloor", "copy_layers", "fill_level", "one_copy_floor", "split_floor"]
