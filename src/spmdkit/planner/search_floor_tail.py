"""The step floor's tail: what a rank does after its last backward (issue 30).

:class:`spmdkit.planner.search_floor.StepFloor` bounds a pipeline's step by each rank's work in
the schedule, ``done_r``'s schedule part. The pipeline's step (``pipeline._step_times``) is
``max_r (done_r + t_r + o_r)``: rank ``r``'s last backward ends at ``finish_r``; its gradient
reductions end at ``done_r >= finish_r``; ``t_r`` its tied parameters' all-reduce and ``o_r``
its optimizer (:func:`spmdkit.planner.stage_costs.stage_costs`: its optimizer ops' times, and
the part of the distributed optimizer's parameter gathers its next forward does not hide).
Two parts of that tail no schedule hides, and this module bounds them from below with the cost
model's own formulas:

- the optimizer: each optimizer op's compute (:func:`spmdkit.cost.step.op_communication`, the
  time ``stage_costs`` sums into ``optimizer_s``) on the parameters the rank holds, under the
  configuration's ZeRO level and degrees;
- Megatron-Core's pipeline ranks after the first (``framework`` megatron, ``r > 0``) reduce
  their gradients in ONE bucket launched at the end of their last backward
  (:func:`spmdkit.planner.stage_costs.reduce_gradients` with ``single``): ``done_r`` is
  ``finish_r`` plus the time of that bucket, :class:`spmdkit.cost.buckets.Reducer`'s time of each
  (reduction, mesh dims, dtype) group's bytes one after the other. The first rank's buckets run
  under its backward (counted as 0 here), as do a run without a pipeline's (the last bucket's
  part is not counted either: which gradients it holds depends on the bucket sizes). Not
  Megatron-FSDP's (ZeRO-2/3 under the megatron framework): its every rank reduce-scatters in
  every microbatch's backward, in buckets under it;
- Megatron-FSDP's per-microbatch reductions (:meth:`Tail.stream`): the rank holding the most
  layers (``ceil(layers / p)`` at least, and one rank ``ceil((layers - dense) / p)`` of the
  repeated kind) queues ``m`` microbatches' of them on its stream
  before its optimizer; each microbatch's counted as one bucket a group, no slower than the
  framework's buckets where the collective time is subadditive in the bytes (NCCL's model,
  the least over algorithms of affine times, and the alpha-beta ring are; a measured device's
  interpolated points need not be: none counted there); none of them starts before the rank's
  first backward, which waits for the first microbatch's forward through every chunk and its
  backward through the chunks above the rank's highest (:meth:`spmdkit.planner.search_floor.
  StepFloor.stream`).

The figures come from the configuration's layers planned on its OWN data-parallel degree and
strategy (ZeRO level included): one copy of ``dense + 2`` layers (:func:`spmdkit.planner.
search_floor_layers.copy_layers`), planned when the configuration's turn comes in the search
(like ZeRO-3's gathers), cached by (dp, tp, ep, cp, strategy): the figures are the
parameters', which do not depend on the batch. Per unit
(:func:`spmdkit.planner.pipeline_split.op_units`: the embedding, each layer, the head, as the
pipeline's stages are cut) the optimizer ops' compute and the gradient bytes of each reduction
(the ops' pending gradient reductions, attributed as ``stage_costs`` attributes them); a layer
of the repeated kind counts the least of the copy's two such layers (per reduction), a dense
first layer the least of any layer. A rank holding ``n`` layers, at most ``max(0, D - r)`` of
them dense (the ``D`` dense layers lie in chunks ``0 .. D - 1``, chunk ``c`` on rank
``c mod p`` and holding layers ``>= c``), the embedding with rank 0 and the head with the last:
:meth:`Tail.rank`. The collective time is nondecreasing in the bytes (NCCL's model: the least
over algorithms of increasing times; a measured device's, the interpolation of its points, where
their times grow with the bytes), so fewer bytes give a lower time.

:func:`spmdkit.planner.search_floor.busiest_rank` adds ``Tail.rank`` to each rank's figure
(after the rank's own last backward: ``m W_r + max(tail_r, chain before it + tail_0)``); the
even pipeline term adds the least rank's
tail; the MoE split floors (:mod:`spmdkit.planner.search_floor_layers`) add it to the rank
holding the level; without a pipeline the step is at least the micro-steps' work and then the
optimizer's ops (they run after the last backward's buckets, ``step._run``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from spmdkit.core.reshard import Step
from spmdkit.cost.buckets import Reducer
from spmdkit.cost.devices import Device
from spmdkit.cost.step import op_communication
from spmdkit.planner.pipeline_split import op_units
from spmdkit.planner.stage_costs import single_bucket_ranks
from spmdkit.program.plan import Plan

#: a gradient reduction group: (kind, mesh dims, reduce type, dtype)
GradKey = tuple[str, tuple[int, ...], str, str]
#: the tail's figures are sums taken in another order than the plan's (and extrapolated from a
#: copy): this much of them is left out, so that rounding never lifts a bound over its step
SLACK = 1e-9
#: :meth:`Tail.held`: (layers of the repeated kind, dense layers, the first rank, the last) -> seconds
Held = Callable[[int, int, bool, bool], float]


@dataclass(frozen=True)
class UnitTail:
    """One unit's tail figures (one layer, the embedding or the head): its optimizer ops'
    compute (s) and its gradients' bytes by reduction group (with a Step of that group)."""

    opt: float = 0.0
    grads: tuple[tuple[GradKey, Step, int], ...] = ()
    #: those of ``grads`` reduced in every microbatch's backward (Megatron-FSDP's: ``OpComm.each``)
    each: tuple[tuple[GradKey, Step, int], ...] = ()

    def bytes_of(self) -> dict[GradKey, tuple[Step, int]]:
        return {k: (s, b) for k, s, b in self.grads}


def _least_of(groups: list[tuple[tuple[GradKey, Step, int], ...]]) -> tuple[tuple[GradKey, Step, int], ...]:
    maps = [{k: (s, b) for k, s, b in g} for g in groups]
    keys = [k for k in maps[0] if all(k in m for m in maps[1:])]
    return tuple((k, maps[0][k][0], min(m[k][1] for m in maps)) for k in keys)


def _least(units: list[UnitTail]) -> UnitTail:
    """The least of ``units``, group by group (a group some unit lacks: 0 bytes, left out)."""
    if not units:
        return UnitTail()
    return UnitTail(min(u.opt for u in units), _least_of([u.grads for u in units]),
                    _least_of([u.each for u in units]))


@dataclass
class Tail:
    """A configuration's tail figures (module docstring); ``plan`` the copy they come from (its
    mesh, links and runtime time the buckets, :class:`spmdkit.cost.buckets.Reducer`)."""

    plan: Plan = field(repr=False)
    layer: UnitTail
    dense_layer: UnitTail
    first: UnitTail
    last: UnitTail
    dense: int = 0
    #: Megatron-Core DDP: the ranks after the first reduce in one bucket after their last backward
    #: (not Megatron-FSDP's ZeRO-2/3, whose every microbatch reduces under its backward:
    #: :func:`spmdkit.planner.stage_costs.single_bucket_ranks`)
    single: bool = True
    _memo: dict[tuple[int, int, bool, bool], float] = field(default_factory=dict, repr=False)

    def optimizer(self, layers: int, dense: int = 0) -> float:
        """The optimizer ops' seconds of a run without a pipeline (every unit on the device)."""
        return ((layers - dense) * self.layer.opt + dense * self.dense_layer.opt
                + self.first.opt + self.last.opt) * (1.0 - SLACK)

    def rank(self, r: int, p: int, n: int) -> float:
        """Seconds rank ``r`` of ``p`` spends at least after its last backward holding ``n``
        layers (module docstring)."""
        d = min(n, max(0, self.dense - r))
        return self.held(n - d, d, r == 0, r == p - 1)

    def held(self, moe: int, dense: int, first: bool, last: bool) -> float:
        """The tail of a rank holding ``moe`` layers of the repeated kind and ``dense`` others,
        the embedding (``first``: the first rank, whose buckets run under its backward) and
        the head (``last``)."""
        key = (moe, dense, first, last)
        got = self._memo.get(key)
        if got is None:
            got = moe * self.layer.opt + dense * self.dense_layer.opt
            got += (self.first.opt if first else 0.0) + (self.last.opt if last else 0.0)
            if self.single and not first:
                got += self._reduced(moe, dense, last)
            got *= 1.0 - SLACK
            self._memo[key] = got
        return got

    def stream(self, m: int, n: int, heavy: int = 0, last: bool = True) -> float:
        """Seconds a pipeline rank holding ``n`` layers (``heavy`` of them of the repeated kind, a
        MoE model's past its dense ones) takes at least from its first microbatch's
        backward to its optimizer's end under Megatron-FSDP (0 without per-microbatch reductions):
        its ``m`` microbatches' reductions of ``n`` layers of the least kind one after the other
        on its stream (each microbatch's in one bucket a group: no slower than in several where
        the collective time is subadditive in the bytes, as NCCL's model is, the least of
        affine times over algorithms, and the alpha-beta ring; not a measured device's
        interpolated points: 0 there), then the optimizer of those layers. The first rank's
        embedding and the last rank's head alike, whatever layers they hold: the most of the three
        (``last=False``: the first rank's, without the head's)."""
        fabric = getattr(self.plan.cost, "fabric", None)
        if fabric is not None and fabric.measured:
            return 0.0
        return max(self._stream(m, self.dense_layer, n), self._stream(m, self.layer, heavy),
                   self._stream(m, self.first, 1), self._stream(m, self.last, 1) if last else 0.0)

    def _stream(self, m: int, unit: UnitTail, n: int) -> float:
        if not unit.each or n <= 0:
            return 0.0
        red = Reducer(self.plan, single=True)
        for (_kind, _dims, _rt, dtype), s, b in unit.each:
            red.add(dtype, s, n * b, 0.0)
        return (m * red.flush(0.0) + n * unit.opt) * (1.0 - SLACK)

    def _reduced(self, moe: int, dense: int, last: bool) -> float:
        """The one bucket's time (:func:`spmdkit.planner.stage_costs.reduce_gradients`, ``single``)."""
        total: dict[GradKey, tuple[Step, int]] = {}
        for unit, times in ((self.layer, moe), (self.dense_layer, dense), (self.last, 1 if last else 0)):
            for k, s, b in unit.grads if times else ():
                total[k] = (s, total.get(k, (s, 0))[1] + times * b)
        red = Reducer(self.plan, single=True)
        for (_kind, _dims, _rt, dtype), (s, size) in total.items():
            red.add(dtype, s, size, 0.0)
        return red.flush(0.0)


def plan_tail(plan: Plan, device: Device, dense: int) -> Tail:
    """The :class:`Tail` of ``plan``, a configuration's copy of ``dense + 2`` layers (or fewer:
    the whole model) planned on its own dp and strategy."""
    oc = op_communication(plan, device)
    prog = plan.program
    unit, n = op_units(prog)
    opt = [0.0] * (n + 2)
    grads: list[dict[GradKey, tuple[Step, int]]] = [{} for _ in range(n + 2)]
    each: list[dict[GradKey, tuple[Step, int]]] = [{} for _ in range(n + 2)]
    for i, op in enumerate(prog.ops):
        u = unit[i] + 1
        if op.phase == "optimizer":
            opt[u] += oc.compute[i]
        for q, (dt, st, size) in enumerate(oc.pending.get(i, ())):
            key = (st.kind, st.mesh_dims, st.reduce_type or "sum", dt)
            for into in (grads, each) if (i, q) in oc.each else (grads,):
                had = into[u].get(key)
                into[u][key] = (st, size + (had[1] if had else 0))
    units = [UnitTail(o, tuple((k, s, b) for k, (s, b) in g.items()), tuple((k, s, b) for k, (s, b) in e.items()))
             for o, g, e in zip(opt, grads, each)]
    layers = units[1:-1]
    rep = layers[dense:] if len(layers) > dense else layers
    return Tail(plan, _least(rep), _least(layers), units[0], units[-1], dense, single_bucket_ranks(plan, oc))


__all__ = ["GradKey", "Held", "Tail", "UnitTail", "plan_tail"]
