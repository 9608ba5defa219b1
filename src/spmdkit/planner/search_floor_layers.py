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

from dataclasses import dataclass

from spmdkit.core.errors import SpmdError
from spmdkit.cost.devices import Device
from spmdkit.cost.memory import saved_activations
from spmdkit.cost.step import op_communication
from spmdkit.planner.search_floor import NO_FLOOR, RECOMPUTE, LayerFloor, StepFloor, _counted
from spmdkit.planner.search_space import Config
from spmdkit.program.layers import program_layers
from spmdkit.program.plan import Plan


def copy_layers(dense: int) -> int:
    """The layers of the one copy a MoE model's layer key is planned on."""
    return dense + 2


def one_copy_floor(plan: Plan, device: Device, layers: int, dense: int) -> LayerFloor:
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
    for mode in RECOMPUTE:
        saved = saved_activations(plan, mode)
        ops = {j for r in saved.recomputed for j in r}
        again = [0.0] * n
        for j in ops:
            if 0 <= where[j] < n:
                again[where[j]] += own[j]
        rerun[mode] = sum(own[j] for j in ops) + missing * min(again[dense:])
        kept[mode] = min((b for lay, b in saved.per_layer.items() if lay in tags), default=0)
    return LayerFloor(sum(own) + missing * min(by_layer[dense:]), rerun, kept)


@dataclass
class LayerStepFloor(StepFloor):
    """:class:`spmdkit.planner.search_floor.StepFloor` whose layer keys are planned on ONE copy
    of ``dense + 2`` layers (:func:`one_copy_floor`), for a model with dense first layers deep
    enough to have more."""

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


__all__ = ["LayerStepFloor", "copy_layers", "one_copy_floor"]
