"""A configuration's step floor from its layers' own plan: the tight bound of the pruned search.

:mod:`spmdkit.planner.search_bounds` bounds a configuration's step by the FLOPs of the
unsharded model at the fastest rates spread over every device: it knows nothing of how small a
GEMM gets under ``tp = 128`` or what a tensor-parallel all-reduce over InfiniBand costs, so at
2,048 and 16,384 devices it prunes almost nothing. :class:`StepFloor` bounds it by what the
configuration's own layers cost one device, read off the same cost model as the plan:

- the shardings of a layer under a strategy depend on ``tp``, ``cp``, ``ep``, the strategy's
  tensor-parallel base (megatron, sp, the cp variant, ep) and the sequences one data-parallel
  rank computes at once (a microbatch), not on ``dp``, ``pp`` or the ZeRO level (those add
  gradient reductions, parameter gathers and stages, never a layer's GEMMs or its
  tensor-parallel collectives). So the model is planned once per such key
  (:meth:`StepFloor.per_micro`) on ``dp = 1`` with that rank's sequences and the strategy
  without ZeRO, as two shallow copies of 2 and 3 layers (:func:`spmdkit.planner.fold.fold_of`,
  the fold's affine extrapolation: the layers' sums are affine in the layers), and every
  configuration of the key reuses it;
- of that plan, one device's forward and backward work per microbatch: each GEMM's and
  attention pass's time at its local shapes (:func:`spmdkit.cost.step.op_communication`, the
  rates by shape), the other ops' that read no parameter (a parameter's elementwise op runs on
  ZeRO-3's shard in the real plan), and the communication every op waits on (tensor- and
  context-parallel collectives, MoE all-to-alls, the exposed part of an overlapped one);
  gradient reductions, parameter gathers, the optimizer and recomputation are left out (they
  only add);
- a ZeRO-3 configuration's parameter gathers (:meth:`StepFloor.gathered`, computed when its
  turn comes in the search): its layers planned on its own ``dp`` with ZeRO-3 (two shallow
  copies per dp and layer key); with a pipeline the part of each layer group's gather the group
  before leaves exposed (:func:`spmdkit.cost.step.op_communication`'s prefetch, in every stage's
  time per microbatch), without one the gathers' sum (one after the other on the communication
  stream; the last micro-step waits for the last);
- each rank's tail after its last backward (:meth:`StepFloor.tail`,
  :mod:`spmdkit.planner.search_floor_tail`, also when its turn comes): its optimizer and
  Megatron's one bucket of gradient reductions on the ranks after the first, from its layers
  planned on its own ``dp`` and strategy; added to each rank's figure in :func:`busiest_rank`
  (after its own last backward), the least of them to the even term, the optimizer to a run
  without a pipeline;
- a Megatron-FSDP pipeline's reduce-scatters in every microbatch (:meth:`StepFloor.stream`):
  a rank's ``m`` microbatches of them on its communication stream, none before its first
  backward (the first microbatch's forward through the model, under the search's even split
  the backward of the chunks above rank 0's highest);
- the step is at least that work times the micro-steps of gradient accumulation without a
  pipeline, and with ``p`` stages (``v`` model chunks a rank) and ``m`` microbatches at least
  ``(m + (p - 1) / v) / p`` of it (the pipeline bound of :meth:`Bounds.step`, on the busiest
  device's share of this work instead of the FLOPs) and at least the busiest rank's
  (:func:`busiest_rank`: its ``m`` microbatches of its own chunks and the chunks before it,
  the least over every split the search may pick, from the work by unit: the embedding, the
  head and the loss, the cheapest layer), which is more where the head's rank cannot shed it.

The search prunes with ``max`` of this floor and :meth:`Bounds.step`, costs configurations in
the order of that bound, and stops when the next bound is at least the best step found.
``tests/test_search_floor.py`` checks the floor is never above a configuration's planned step
and that the pruned search finds the unpruned one's best with the same figures;
``scripts/check_search.py`` does so on the searches of 8 to 256 devices.
"""

from __future__ import annotations

import functools
import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

from spmdkit.core.errors import SpmdError
from spmdkit.cost.devices import Device
from spmdkit.cost.memory import activation_deltas, peak_of
from spmdkit.cost.memory_saved import ActivationMemory, saved_activations
from spmdkit.cost.step import least_shared_gather_times, op_communication
from spmdkit.planner.fold import fold_of
from spmdkit.planner.pipeline_split import op_units
from spmdkit.planner.search_bounds import pipeline_fill
from spmdkit.planner.search_floor_tail import SLACK, Tail, plan_tail
from spmdkit.planner.search_space import Config
from spmdkit.program.ir import Program
from spmdkit.program.layers import layer_tags, program_layers
from spmdkit.program.plan import Plan

#: the recomputation modes (planner.search's RECOMPUTE_MODES: none the least)
RECOMPUTE = ("none", "selective", "full")

#: (tp, ep, cp, the strategy without ZeRO, sequences a data-parallel rank computes at once)
FloorKey = tuple[int, int, int, str, int]
#: a ZeRO-3 configuration's own layers: (dp, tp, ep, cp, its strategy, sequences a rank computes at once)
ZeroKey = tuple[int, int, int, int, str, int]


def base_strategy(strategy: str) -> str:
    """``strategy`` without its ZeRO level (``megatron,sp,zero1`` -> ``megatron,sp``)."""
    return ",".join(p for p in strategy.split(",") if p not in ("zero1", "zero2", "zero3")) or "dp"


def _counted(plan: Plan, i: int, matmul: bool, attention: bool) -> bool:
    """Whether op ``i``'s compute counts in the floor: a GEMM, an attention pass, or an op that
    reads no parameter (a parameter's elementwise op may run on ZeRO-3's shard in the real plan)."""
    prog = plan.program
    return matmul or attention or not any(
        prog.tensors[n].kind in ("parameter", "optimizer_state") for n in prog.ops[i].input_names())


def per_device_work(plan: Plan, device: Device) -> float:
    """One device's forward and backward seconds of ``plan`` that every configuration with its
    layers has (module docstring): GEMMs and attention passes, the ops that read no parameter,
    the communication each op waits on."""
    return _work(plan, device).work


def _work(plan: Plan, device: Device) -> LayerFloor:
    """:func:`per_device_work` (without the ZeRO-3 gathers' exposed part), per recomputation
    mode the same of the ops it runs again, per mode the fewest bytes a numbered layer keeps for
    the backward; and the ZeRO-3 / FSDP parameter gathers: the part the group before leaves
    exposed (:func:`spmdkit.cost.step.op_communication`'s prefetch, the pipeline's stage times)
    and their seconds together (one after the other on the communication stream)."""
    oc = op_communication(plan, device)
    prog = plan.program
    unit, n_layers = op_units(prog)
    own = [0.0] * len(prog.ops)
    exposed = forward = 0.0
    shared = least_shared_gather_times(plan, device, oc, RECOMPUTE)  # a compiled cp grad's gather, under a mode
    for i, op in enumerate(prog.ops):
        if op.phase in ("forward", "backward"):
            c = oc.costs[i]
            e = oc.prefetch_exposed.get(i, 0.0)
            exposed += e
            own[i] = (oc.compute[i] if _counted(plan, i, c.matmul, c.attention is not None) else 0.0) + oc.wait[i] - e
            own[i] = max(0.0, own[i] - shared.get(i, 0.0))
            forward += own[i] if op.phase == "forward" else 0.0
    rerun: dict[str, float] = {}
    kept: dict[str, int] = {}
    units: dict[str, Units] = {}
    numbered = set(layer_tags(prog))
    peak = 0
    for mode in RECOMPUTE:
        saved = saved_activations(plan, mode)
        if mode == "full":
            peak = layer_peak(plan, saved)
        again = {j for r in saved.recomputed for j in r}
        rerun[mode] = sum(own[i] for i in again)
        kept[mode] = min((b for lay, b in saved.per_layer.items() if lay in numbered), default=0)
        per = [0.0] * (n_layers + 2)  # the embedding, the layers, the head (op_units: -1 .. n_layers)
        for i, t in enumerate(own):
            per[unit[i] + 1] += t + (t if i in again else 0.0)
        units[mode] = Units(per[0], per[-1], min(per[1:-1], default=0.0))
    back = backward_by_unit(plan.program, own, unit, n_layers)
    return LayerFloor(sum(own), rerun, kept, exposed, oc.gathers_s, units, peak, forward,
                      Units(back[0], back[-1], min(back[1:-1], default=0.0)))


def backward_by_unit(prog: Program, own: list[float], unit: list[int], n_layers: int) -> list[float]:
    """``own`` (seconds by op) of the backward's ops summed by pipeline unit (:func:`spmdkit.
    planner.pipeline_split.op_units`: the embedding, the ``n_layers`` layers, the head), no
    recomputation: what :attr:`LayerFloor.backward` is read from."""
    back = [0.0] * (n_layers + 2)
    for i, t in enumerate(own):
        if prog.ops[i].phase == "backward":
            back[unit[i] + 1] += t
    return back


def layer_peak(plan: Plan, saved: ActivationMemory) -> int:
    """The least working peak of any numbered layer of ``plan`` alone, one microbatch: each
    layer's ops as their own pipeline stage on :func:`spmdkit.cost.memory.activation_deltas`'
    curve (the one the plan's stages peak on, ``saved``: a recomputation mode's activations).
    Every stage holding that layer peaks at least as high while the layer runs: a tensor the
    layer uses lives at least over its uses there (and the stage holds its earlier layers' stash
    beside it). The layer plans of the floor are made on dp = 1 without ZeRO at a data-parallel
    rank's sequences: a layer's activations are the same on every dp degree and ZeRO stage
    (ZeRO-3's gathered parameters only add to them)."""
    lay = program_layers(plan.program)
    n = len(lay.tags)
    group = [u if 0 <= u < n else n for u in lay.op_layer]
    deltas = activation_deltas(plan, saved, group, n + 1)
    return min((peak_of(d)[0] for d in deltas[:n]), default=0)


@dataclass(frozen=True)
class Units:
    """One microbatch's work (s) on one device by pipeline unit (:func:`spmdkit.planner.pipeline_split.op_units`):
    the embedding's, the final norm's, head's and loss's, and the least of any layer's."""

    first: float
    last: float
    layer: float
    #: the least work of a layer past the model's dense first layers (0: ``layer``'s; a MoE model)
    heavy: float = 0.0


@dataclass(frozen=True)
class LayerFloor:
    """One layer key's figures for the whole model, one microbatch on one device: the work
    (s), what each recomputation mode runs again (s), the fewest bytes a layer keeps under each;
    under ZeRO-3, its parameter gathers' exposed part (s) and their total (s)."""

    work: float
    rerun: dict[str, float]
    kept: dict[str, int]
    exposed: float = 0.0
    gathers: float = 0.0
    #: per recomputation mode, the work (and what it runs again) by pipeline unit
    units: dict[str, Units] = field(default_factory=dict)
    #: the least working peak of a numbered layer alone recomputed in full (bytes, one
    #: microbatch on one device: :func:`layer_peak`), 0 where not known
    full_peak: int = 0
    #: the part of ``work`` in the forward (s, one microbatch through the whole model on one
    #: device): what a pipeline's first backward waits for at least (:meth:`StepFloor.stream`)
    forward: float = 0.0
    #: the part of ``units["none"]`` in the backward (s, one microbatch on one device, by unit)
    backward: Units = Units(0.0, 0.0, 0.0)


NO_FLOOR = LayerFloor(0.0, {}, {})


@dataclass
class StepFloor:
    """The floor of each configuration's step (module docstring), its layer plans cached by key.

    ``plan_copy(cfg, layers, batch)``: ``cfg`` (dp = 1, no pipeline, no ZeRO) planned on a copy
    of the model with ``layers`` layers and a global batch of ``batch`` sequences, as the
    search plans it (the device's links, the runtime)."""

    plan_copy: Callable[[Config, int, int], Plan]
    device: Device
    layers: int
    batch: int
    dense: int = 0
    cache: dict[FloorKey, LayerFloor] = field(default_factory=dict)
    zero3: dict[ZeroKey, LayerFloor] = field(default_factory=dict)
    tails: dict[tuple[int, int, int, int, str], Tail | None] = field(default_factory=dict)
    plans: int = 0

    def key(self, cfg: Config) -> FloorKey | None:
        if cfg.strategy == "auto":
            return None
        local = self.batch // (cfg.microbatches * cfg.grad_accum * cfg.dp)
        if local < 1 or (local % cfg.ep and not cfg.ep_from_cp):  # (ep-from=cp: the batch over dp alone)
            return None
        return (cfg.tp, cfg.ep, cfg.cp, base_strategy(cfg.strategy), local)

    def of(self, cfg: Config) -> LayerFloor:
        """``cfg``'s layer figures (:data:`NO_FLOOR` where its layers cannot be planned so)."""
        key = self.key(cfg)
        if key is None:
            return NO_FLOOR
        got = self.cache.get(key)
        if got is None:
            tp, ep, cp, strategy, local = key
            got = self._planned(Config(1, tp, 1, strategy, "none", 1, ep, cp), local)
            self.cache[key] = got
        return got

    def gathered_key(self, cfg: Config) -> ZeroKey | None:
        """The key of ``cfg``'s ZeRO-3 layer plan (None: not ZeRO-3)."""
        key = self.key(cfg)
        if key is None or "zero3" not in cfg.strategy.split(","):
            return None
        return (cfg.dp, key[0], key[1], key[2], cfg.strategy, key[4])

    def gathered(self, cfg: Config) -> LayerFloor:
        """A ZeRO-3 configuration's layer figures from its own layers' plan: on its data-parallel
        degree with ZeRO-3 (the parameters stored sharded and gathered by layer group), one
        microbatch; :data:`NO_FLOOR` for another configuration. Cached by (dp, the layer key)."""
        zkey = self.gathered_key(cfg)
        if zkey is None:
            return NO_FLOOR
        got = self.zero3.get(zkey)
        if got is None:
            dp, tp, ep, cp, strategy, local = zkey
            got = self._planned(Config(dp, tp, 1, strategy, "none", 1, ep, cp), local * dp)
            self.zero3[zkey] = got
        return got

    def own_key(self, cfg: Config) -> ZeroKey | None:
        """The key of ``cfg``'s layers planned on its own dp and strategy (:meth:`tail`)."""
        key = self.key(cfg)
        return None if key is None else (cfg.dp, key[0], key[1], key[2], cfg.strategy, key[4])

    def tail(self, cfg: Config) -> Tail | None:
        """What ``cfg``'s ranks do at least after their last backward
        (:mod:`spmdkit.planner.search_floor_tail`: its optimizer and Megatron's unhidden gradient
        reductions), from ``dense + 2`` of its layers planned on its own dp and strategy; None
        where they cannot be planned so. Cached by :meth:`own_key` without the sequences a rank
        computes at once: its figures are the parameters' (their gradients' reductions, their
        optimizer updates), whose shardings the strategy sets whatever the batch
        (``tests/test_search_floor_tail.py`` checks two batches give the same)."""
        okey = self.own_key(cfg)
        if okey is None:
            return None
        dp, tp, ep, cp, strategy, local = okey
        if okey[:5] not in self.tails:
            self.plans += 1
            try:
                plan = self.plan_copy(Config(dp, tp, 1, strategy, "none", 1, ep, cp),
                                      min(self.layers, self.dense + 2), local * dp)
                self.tails[okey[:5]] = plan_tail(plan, self.device, self.dense)
            except SpmdError:
                self.tails[okey[:5]] = None  # (the configuration says why when planned)
        return self.tails[okey[:5]]

    def _planned(self, one: Config, batch: int) -> LayerFloor:
        """``one`` planned on two shallow copies (or the model) with ``batch`` sequences,
        extrapolated to the model's depth (:data:`NO_FLOOR` where it cannot be planned)."""
        fold = fold_of((self.layers,), self.dense)
        try:
            if fold is None:
                self.plans += 1
                return _work(self.plan_copy(one, self.layers, batch), self.device)
            self.plans += 2
            a = _work(self.plan_copy(one, fold.layers_a, batch), self.device)
            b = _work(self.plan_copy(one, fold.layers_b, batch), self.device)
        except SpmdError:
            return NO_FLOOR  # its layers cannot be planned so (the configuration says why when planned)
        # a layer the copies repeat costs what the deeper one adds (the fold's affine figures)
        units = {m: Units(u.first, u.last, min(u.layer, (b.work + b.rerun[m]) - (a.work + a.rerun[m])))
                 for m, u in b.units.items()}
        return LayerFloor(fold.at(a.work, b.work), {m: fold.at(a.rerun[m], b.rerun[m]) for m in b.rerun}, b.kept,
                          fold.at(a.exposed, b.exposed), fold.at(a.gathers, b.gathers), units,
                          min(a.full_peak, b.full_peak), fold.at(a.forward, b.forward),
                          Units(b.backward.first, b.backward.last,
                                min(b.backward.layer, (b.work - b.forward) - (a.work - a.forward))))

    def blocks_step(self, cfg: Config, gathers: bool = False) -> float:
        """Seconds any ``full:K`` of ``cfg`` takes at least besides :func:`spmdkit.planner.search_blocks.blocks_floor`'s (0 here;
        a MoE pipeline's whole-layer split: :class:`spmdkit.planner.search_floor_layers.LayerStepFloor`)."""
        return 0.0

    def per_micro(self, cfg: Config) -> float:
        """One device's work (s) for one microbatch through the whole model (0: no floor)."""
        return self.of(cfg).work

    def step(self, cfg: Config, mode: str = "none", gathers: bool = False, busiest: bool = True) -> float:
        """Seconds the step of ``cfg`` takes at least under recomputation ``mode`` (and every
        mode that recomputes more: none is the least). ``gathers``: a ZeRO-3 configuration's
        also from its own layers' plan with the parameter gathers (:meth:`gathered`): with a
        pipeline the part of each group's gather the group before does not hide (a stage's
        time per microbatch), without one the gathers one after the other on the communication
        stream (the last micro-step waits for the last). ``gathers`` also counts the tail
        (:meth:`tail`: each rank's optimizer and unhidden gradient reductions after its last
        backward; without a pipeline the optimizer after the last micro-step). ``busiest=False``:
        a pipeline's even term alone, plus the least rank's tail (affine in the work: what
        ``full:K``'s floor interpolates between modes; :func:`busiest_rank` is convex in it, so
        it is not interpolated)."""
        f = self.of(cfg)
        t = self.tail(cfg) if gathers else None
        w = f.work + f.rerun.get(mode, 0.0)
        z = self.gathered(cfg) if gathers else NO_FLOOR
        if z is not NO_FLOOR and cfg.pp > 1:
            w = max(w, z.work + z.exposed + z.rerun.get(mode, 0.0))
        if cfg.pp == 1:  # the optimizer's ops run after the last micro-step's buckets (step._run)
            opt = t.optimizer(self.layers, self.dense) if t is not None else 0.0
            if z is NO_FLOOR:
                return w * cfg.grad_accum + opt
            w = max(w, z.work + z.rerun.get(mode, 0.0))
            return w * (cfg.grad_accum - 1) + max(w, z.gathers) + opt
        p, v, m = cfg.pp, cfg.virtual, max(1, cfg.microbatches)
        even = w / p * (m + pipeline_fill(p, v))
        if t is not None:  # every rank holds v layers at least: step >= max_r finish_r + min_r tail_r
            even += min(t.rank(r, p, v) for r in range(p))
        stream = self.stream(cfg, f, t) if t is not None and busiest else 0.0
        u = f.units.get(mode) if busiest else None
        if u is None:
            return max(even, stream)
        return max(even, stream, busiest_rank(u, self.layers, p, v, m,
                                              None if t is None else functools.partial(t.rank, p=p), self.dense))


    def stream(self, cfg: Config, f: LayerFloor, t: Tail) -> float:
        """Seconds a Megatron-FSDP pipeline (ZeRO-2/3 under the megatron framework: every
        microbatch's backward reduce-scatters its stage's gradients, :attr:`spmdkit.planner.
        stage_costs.StageCost.each`) takes at least for its per-microbatch reductions (0 for
        another configuration, or on a measured device's links: :meth:`Tail.stream`).

        Each rank queues its ``m`` microbatches' reduce-scatters on its one communication stream,
        each launched during that microbatch's backward on the rank
        (:func:`spmdkit.planner.stage_costs.reduce_gradients`'s ``early``; the last microbatch's
        in the framework's buckets during its backward), and the step waits for the last
        (``pipeline._step_times``, ``fold._pipeline_overlap``: ``done_r`` then the tied
        all-reduce and the optimizer). So the step is at least rank ``r``'s first backward's start
        plus its reductions' time (:meth:`Tail.stream`: at least ``m`` times its layers' gradients
        in one bucket a group, then its optimizer). That first backward is of the rank's highest
        chunk ``c = (v - 1) p + r`` for the first microbatch (1F1B and interleaved: the backwards
        of a chunk in microbatch order, a rank's highest chunk first), which starts after that
        microbatch's forward through every chunk (``f.forward``, its ops' own time: the schedule
        runs each forward for ``fwd[k]``, the stage's ops' times, plus the sends; the first
        microbatch's forwards all lie in the warm-up, never merged under --ep-comm-overlap) and
        its backward through the chunks above ``c``. Without knowing the split, the rank holding
        ``ceil(layers / p)`` layers may be the last (nothing above it): ``f.forward`` plus its
        stream. Where ``p v`` divides the layers the search prices the even split
        (``search._counts``): each chunk holds ``k = layers / (p v)`` layers, rank 0 (``v k``
        of them) waits for the backward of the ``p - 1`` chunks above its highest, each at least
        ``k`` of the least layer's backward (``f.backward``), the last also the head's; not
        under --ep-comm-overlap (a steady-state backward merged with a forward may take less
        than its ops' time: ``chunk_plan.chunk_run``)."""
        p, v, m = cfg.pp, cfg.virtual, max(1, cfg.microbatches)
        n = -(-self.layers // p)
        low = t.stream(m, n, -(-(self.layers - self.dense) // p))
        if low <= 0.0:
            return 0.0
        low += f.forward * (1.0 - SLACK)
        if self.layers % (p * v) or t.plan.runtime.ep_comm_overlap:
            return low
        k, b = self.layers // (p * v), f.backward
        # rank 0: chunks 0, p, .. (v - 1) p, the dense first layers among theirs
        dense = sum(max(0, min(self.dense, c * p * k + k) - c * p * k) for c in range(v))
        above = (p - 1) * k * b.layer + b.last
        return max(low, t.stream(m, n, n - dense, last=False) + (f.forward + above) * (1.0 - SLACK))


def busiest_rank(u: Units, layers: int, p: int, v: int, m: int,
                 tail: Callable[..., float] | None = None, dense: int = 0) -> float:
    """Seconds a 1F1B or interleaved pipeline step takes at least, whatever the split of the
    ``layers`` layers into ``p x v`` chunks (each of at least one layer, chunk ``c`` on rank
    ``c mod p``, the embedding with chunk 0, the head and the loss with the last), ``m``
    microbatches, ``u`` one microbatch's work by unit on one device.

    The argument. Rank ``r`` runs its ``m`` microbatches' forwards and backwards of its own
    chunks one after the other: ``m W_r`` seconds, ``W_r`` the work of its chunks for one
    microbatch. It can start none before some microbatch's forward has gone through chunks
    ``0 .. r-1`` (a chain, one chunk after the other); its last unit is the backward of its
    lowest chunk ``r`` (the backward of any higher chunk ``c`` of a microbatch is followed,
    through chunks ``c-1 .. c-p`` on the other ranks, by that microbatch's backward of chunk
    ``c - p`` on this rank), and after it that microbatch's backward still goes through chunks
    ``r-1 .. 0``. So the step is at least ``m W_r + sum_{c<r} W_c`` (chunk ``c < r`` lies on rank
    ``c``; sends and waits only add) for every ``r``: at least ``max_r`` of it. Every layer costs
    at least ``u.layer``, so with ``n_r >= v`` layers on rank ``r``: ``W_r >= n_r u.layer``
    plus ``u.first`` on rank 0 and ``u.last`` on rank ``p - 1``, and ``sum_{c<r} W_c >= u.first
    + r u.layer`` for ``r >= 1`` (each chunk at least one layer). The least over the counts
    ``n_r`` (``sum n_r = layers``; any counts ``>= v`` are some split's) of the largest of these
    is reached by giving the ``layers - p v`` layers beyond the first ``v`` of each rank one at a
    time to the rank whose figure is lowest (every layer adds the same ``m u.layer`` to its
    rank's figure, so this greedy filling is optimal): a bound for every split the search may
    pick, even (one more layer on some rank where ``p v`` does not divide the layers) or uneven
    (``--stages auto``, a memory cap). It exceeds the even-split bound where the head (or the
    embedding) weighs on its rank more than the layers a balanced split could take off it.

    ``tail(r, n=...)``: what rank ``r`` holding ``n`` layers does at least after its last
    backward (:meth:`spmdkit.planner.search_floor_tail.Tail.rank`, nondecreasing in ``n``). Rank
    ``r``'s own last backward ends ``m W_r`` after its start at the earliest, and its tail
    follows; the chain after it (chunks ``r-1 .. 0``) ends on rank 0, whose tail (``n >= v``
    layers) follows that: the step is at least ``m W_r + max(tail_r, sum_{c<r} W_c + tail_0)``
    for every ``r``, and the least of the largest over the counts is reached by giving each
    layer to the rank whose figure with it is lowest (the figures nondecreasing in the layers,
    this greedy choice is optimal).

    ``dense``: the model's first ``dense`` layers are lighter (a MoE model's), every other works
    at least ``u.heavy``: they lie in chunks ``0 .. dense - 1`` (chunk ``c`` holds layers ``>=
    c``), so rank ``r`` holds at most ``max(0, dense - r)`` of them and chunk ``c >= dense`` only
    heavy ones."""
    lam = u.layer
    spare = layers - p * v
    if spare < 0 or lam < 0:
        return 0.0
    if tail is not None:
        return _uneven(u, p, v, m, spare, dense, tail)
    if dense and u.heavy > lam:  # (many configurations of a layer key share it)
        return _uneven_plain(u, p, v, m, spare, dense)
    fig = [m * (v * lam + (u.first if r == 0 else 0.0) + (u.last if r == p - 1 else 0.0))
           + (u.first + r * lam if r else 0.0) for r in range(p)]
    if lam == 0 or spare == 0:
        return max(fig)
    step = m * lam
    heap = sorted(fig)
    for _ in range(spare):
        heapq.heapreplace(heap, heap[0] + step)
    return max(heap)


@functools.lru_cache(maxsize=65536)
def _uneven_plain(u: Units, p: int, v: int, m: int, spare: int, dense: int) -> float:
    """:func:`_uneven` without a tail."""
    return _uneven(u, p, v, m, spare, dense, lambda r, n: 0.0)


def _uneven(u: Units, p: int, v: int, m: int, spare: int, dense: int, tail: Callable[..., float]) -> float:
    """:func:`busiest_rank` with heavier layers past the ``dense`` first ones and each rank's
    tail: rank ``r`` holding ``n`` layers figures ``m`` times its layers' work (at most
    ``max(0, dense - r)`` of them light) and its end units', then the larger of ``tail(r, n=n)``
    and the chunks before it (one layer each, heavy past ``dense``) with rank 0's tail; the ``spare`` layers given one at a time
    to the rank whose figure with one more is the lowest."""
    lam, hv = u.layer, max(u.layer, u.heavy)
    ends = [m * ((u.first if r == 0 else 0.0) + (u.last if r == p - 1 else 0.0)) for r in range(p)]
    first = tail(0, n=v)  # rank 0's tail: at least its v layers'
    chain = [u.first + sum(lam if c < dense else hv for c in range(r)) + first if r else 0.0 for r in range(p)]

    def fig(r: int, n: int) -> float:
        light = min(n, max(0, dense - r))
        return ends[r] + m * (light * lam + (n - light) * hv) + max(tail(r, n=n), chain[r])

    n = [v] * p
    heap = [(fig(r, v + 1), r) for r in range(p)]
    heapq.heapify(heap)
    for _ in range(spare):
        _val, r = heapq.heappop(heap)
        n[r] += 1
        heapq.heappush(heap, (fig(r, n[r] + 1), r))
    return max(fig(r, k) for r, k in enumerate(n))


__all__ = ["NO_FLOOR", "FloorKey", "ZeroKey", "LayerFloor", "StepFloor", "Units", "backward_by_unit", "base_strategy", "busiest_rank",
           "per_device_work"]
