"""The outer search of issue 16: N devices, every mesh factorisation and strategy, the best plans.

:func:`search_meshes` (``spmdkit plan --devices N``) walks every factorisation ``dp x tp x pp``
of N (pp, pipeline parallelism, for every model with numbered layers: a preset, a catalog or
custom model, an imported or a program file's, :mod:`spmdkit.planner.pipeline`; the
mesh is ``pp=P,dp=D,tp=T``, pp outermost and tp innermost as Megatron-LM lays ranks out, so
the innermost dims share a node's NVLink); for each it plans the hand strategies
(:mod:`spmdkit.strategies.strategy`: ``dp`` with ZeRO 0 to 3 where dp > 1, ``megatron`` and
``megatron,sp`` each with ZeRO 0 to 3 where dp > 1, tp > 1) and, with ``auto``, the exact
search :func:`spmdkit.planner.auto.auto_plan` on the mesh (its own shardings of everything,
optimizer states included, so no ZeRO variants); every plan is then costed under each
activation recomputation mode (none, selective, full; recomputation changes the step and the
memory, not the shardings; a mode that changes neither is not listed; a pipeline that fits with
full recomputation and not without also with its least ``full:K``, :mod:`spmdkit.planner.search_blocks`). Each configuration is priced with the same models as a single
plan: :func:`spmdkit.cost.step.estimate_step` (the step with the gradient reductions
overlapping the backward) or, with pp > 1, :func:`spmdkit.planner.pipeline.estimate_pipeline`
(1F1B, ``batch / dp`` microbatches of one sequence per dp rank: the smallest bubble the batch
allows); memory per device with :func:`spmdkit.cost.memory.memory_per_device` (the fullest
pipeline rank with pp), as the GPU must hold it (:attr:`spmdkit.cost.memory.Memory.device_total`:
the allocated peak, the caching allocator's reserve, the CUDA context and NCCL's buffers). A
configuration whose memory per device is over the cap (the device's memory by default) is
rejected; the others are ranked by predicted step time.

Context parallelism: for a preset (or an --hf model, traced again for each cp layout) whose
sequence is :data:`LONG_SEQ` tokens or more, each data-parallel degree (without ep) is also split into ``dp x cp`` (:func:`context_degrees`: cp
dividing it, the sequence into ``2 cp`` zig-zag chunks; the mesh ``dp=D,cp=C,tp=T``) with the hand
strategies plus ``,cp`` and, with ``auto``, the exact search on the model built with
``cp_attention`` (an --hf model: imported for cp, allgather; a pipeline's microbatch likewise);
a shorter sequence searches exactly the meshes it did before.

Which factorisations are tried: dp divides the global batch (each rank a whole number of
sequences), tp divides the attention heads (Megatron's requirement; a preset only), pp is at
most the layers (layers that do not divide into the stages are split balanced by predicted
time: :func:`spmdkit.planner.pipeline_split.auto_counts`). A configuration whose planning fails (a rule refusing a sharding, an uneven shard
a strategy cannot take, the search finding no solution in its time limit) is kept in
:attr:`SearchResult.refused` with the reason, never silently dropped.

``--annotate`` pins in a search index the mesh ``dp, tp`` (dims 0 and 1; a pipeline's pp dim
holds no tensor). The global batch is the preset's (``--batch``); with pp it is split into the
microbatches, so every configuration trains the same tokens per step. A program (imported or
from a file) is planned as it was traced; with ``reload`` (an HF model imported again at a batch,
a routing and a cp layout) its pipelines are in microbatches and ``etp=1`` routed in tp chunks as a preset's;
without it (a program file) a pipeline runs the program's step as one microbatch.

Layer folding (:mod:`spmdkit.planner.fold`, ``fold=True``): a preset's configuration is planned
and priced on two shallow copies of the model and its step, memory, communication and
collectives rebuilt at full depth (exactly, to rounding: ``scripts/check_fold.py``); one whose
copies do not reproduce their own figures that way is planned whole, and so is the best one
after the search. ``micro_batch``: a fixed micro-batch per data-parallel rank, the global batch
then trained as gradient accumulation (``Config.grad_accum``) or a pipeline's microbatches.

``progress`` (a :class:`SearchProgress`, e.g. :class:`spmdkit.outputs.progress.Progress`) hears
of each configuration planned; the search prints nothing (its table: :mod:`spmdkit.outputs.search`;
``--verify`` of the best configuration: :func:`spmdkit.sim.verify_plan.verify_config`).
"""

from __future__ import annotations

import contextlib
import functools
import heapq
import math
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from spmdkit.core.errors import ProgramError, SpmdError
from spmdkit.cost.checkpoints import NO_LAYER_COUNT
from spmdkit.cost.compute import guess_tokens
from spmdkit.cost.devices import Device, load_device
from spmdkit.models.hf import dtype_name
from spmdkit.models.source import import_hf_checked
from spmdkit.models.zoo import ModelConfig, preset
from spmdkit.planner.fold import fold_of
from spmdkit.planner.planning import MAX_LAYERS, MAX_SIZE, parse_size, plan_model, plan_program
from spmdkit.planner.search_ahead import Refiner, least_refined
from spmdkit.planner.search_blocks import blocks_floor
from spmdkit.planner.search_bounds import Bounds, experts_of, memory_bound, memory_why, model_bounds, pruned_why
from spmdkit.planner.search_config import (
    RECOMPUTE_MODES,
    Candidate,
    _in_full,
    _Job,
    _plan_preset_config,
    _plan_program_config,
    _preset_plan,
)
from spmdkit.planner.search_floor import NO_FLOOR, StepFloor
from spmdkit.planner.search_floor_layers import LayerStepFloor
from spmdkit.planner.search_space import (
    LONG_SEQ,
    MICRO_BATCHES,
    Config,
    Reload,
    _applicable_modes,
    _cached,
    _Sizes,
    _work,
    context_degrees,
    expert_degrees,
    factorizations,
    hand_strategies,
    parse_memory,
    program_sizes,
)
from spmdkit.program.ir import Program
from spmdkit.program.layers import layer_tags
from spmdkit.program.plan import Plan
from spmdkit.program.runtime import Runtime
from spmdkit.strategies.strategy import MAX_RANKS

#: the most configurations one search plans (each a propagation or an exact search)
MAX_PLANS = 2000
#: a MoE model's search plans every configuration up to this many, beyond prunes by bounds
EXHAUSTIVE_PLANS = 200
#: a search of this many devices or more is pruned by bounds (search_bounds) by default
PRUNED_DEVICES = 512
#: the most distinct layer keys whose floors (search_floor) are computed before the search, to
#: order it; beyond, each configuration's floor is computed when it is its turn
EAGER_FLOORS = 64
#: a search with lazy floors plans first this many of its seed configurations (:func:`_seeds`)
SEEDS = 3


@dataclass
class SearchResult:
    devices: int
    device: Device
    memory_cap: int
    candidates: list[Candidate]          # every costed configuration, the fitting ones first, fastest first
    refused: list[tuple[Config, str]]    # configurations that could not be planned, and why
    seconds: float = 0.0
    plans: int = 0                       # shardings planned (propagations or searches)
    #: configurations left unplanned by a bound (search_bounds): over the memory cap by their
    #: parameters, states and kept layer inputs alone, or unable to beat the best step found; and why
    pruned: list[tuple[Config, str]] = field(default_factory=list)

    @property
    def fitting(self) -> list[Candidate]:
        return [c for c in self.candidates if c.fits]

    @property
    def best(self) -> Candidate | None:
        f = self.fitting
        return f[0] if f else None


class SearchProgress(Protocol):
    """What the search tells of its progress (:class:`spmdkit.outputs.progress.Progress` is one):
    the count of configurations planned, their total, a note naming the one being planned."""

    def update(self, done: int | None = None, total: int | None = None, note: str | None = None) -> None: ...

    def advance(self, n: int = 1, note: str | None = None) -> None: ...

    def phase(self, text: str) -> None: ...


def _model_sizes(model: str, overrides: Mapping[str, int | None] | None) -> tuple[ModelConfig, _Sizes]:
    """The preset ``model`` with ``--layers`` / ``--batch`` / ``--seq`` applied, and its sizes."""
    cfg = preset(str(model))
    limits = {"layers": MAX_LAYERS, "batch": MAX_SIZE, "seq": MAX_SIZE}
    checked = {k: parse_size(f"--{k}", v, limits.get(k, MAX_SIZE)) for k, v in dict(overrides or {}).items()}
    cfg = cfg.with_(**{k: v for k, v in checked.items() if v is not None})
    return cfg, _Sizes(cfg.batch, cfg.batch * cfg.seq, cfg.heads, cfg.layers, config=cfg, experts=cfg.experts)


def _search_args(devices: int, device: Device | str, memory_cap: int | str | None, recompute: Iterable[str] | None,
                 strategies: Iterable[str] | None, auto: bool,
                 nodes_of: int | None) -> tuple[Device, int, list[str], list[str] | None]:
    """(device, memory cap, recomputation modes, strategies given) checked."""
    if isinstance(devices, bool) or not isinstance(devices, int) or not 1 <= devices <= MAX_RANKS:
        raise ProgramError(f"--devices {devices!r}: expected an integer from 1 to {MAX_RANKS}")
    dev = device if isinstance(device, Device) else load_device(str(device))
    if nodes_of:
        dev = replace(dev, ranks_per_node=nodes_of)
    dev = dev.lockstep(devices)  # every configuration steps all of them: the slowest sets the pace
    if memory_cap is None and not dev.memory_bytes:  # (a device file without memory_gb nor base)
        raise ProgramError(f"--devices: the device {dev.name[:60]!r} states no memory (its file has no memory_gb "
                           "and no base), so the search has nothing to fit the plans in: give --memory SIZE, or "
                           "memory_gb in the device file")
    cap = dev.memory_bytes if memory_cap is None else parse_memory(memory_cap)
    modes = list(dict.fromkeys(recompute or RECOMPUTE_MODES))
    for rc in modes:
        if isinstance(rc, str) and rc.startswith("every:"):  # (priced by plan --mesh, not searched: docs/devices.md)
            raise ProgramError(f"--recompute {rc[:40]}: the search tries {', '.join(RECOMPUTE_MODES)} (each "
                               f"configuration priced once a mode), not every N-th layer; price it for one "
                               f"configuration with spmdkit plan --mesh ... --recompute {rc[:40]}")
        if rc not in RECOMPUTE_MODES:  # (full:K, microbatch, selective:M: plan --mesh's modes, checked before)
            raise ProgramError(f"--recompute {str(rc)[:40]}: the search tries one of {', '.join(RECOMPUTE_MODES)} "
                               f"(and, for a pipeline that fits only with full recomputation, the least full:K that "
                               f"fits); price {str(rc)[:40]} for one configuration with spmdkit plan --mesh ...")
    given = None
    if strategies is not None:
        given = [s for s in strategies]
        if not given and not auto:
            raise ProgramError("search: no strategy to try (give strategies or auto=True)")
    return dev, cap, modes, given


def search_meshes(model: str | Program, devices: int, device: Device | str = "h100",
                  memory_cap: int | str | None = None, *, auto: bool = False, strategies: Iterable[str] | None = None,
                  recompute: Iterable[str] | None = None, pipeline: bool = True,
                  overrides: Mapping[str, int | None] | None = None, pins: Mapping[str, Any] | None = None,
                  cost_text: str | None = None, time_limit: float = 30.0, nodes_of: int | None = None,
                  patterns: Any = None, progress: SearchProgress | None = None,
                  runtime: Runtime | None = None, reload: Reload | None = None,
                  prune: bool | None = None, fold: bool = True, micro_batch: int | None = None,
                  workers: int | None = None) -> SearchResult:
    """Search ``devices`` devices for the fastest configuration of ``model`` (a preset name or a
    :class:`spmdkit.program.ir.Program`, e.g. an imported HuggingFace model) that fits in
    ``memory_cap`` bytes per device (default: ``device``'s memory). ``device``: a
    :class:`spmdkit.cost.compute.Device` or a preset name / JSON path. ``strategies``: the
    hand strategies to try (default :func:`hand_strategies` of each mesh); ``auto``: also
    :func:`spmdkit.planner.auto.auto_plan` on each mesh (``time_limit`` seconds each).
    ``recompute``: the modes to try (default all three). ``progress``: told of each
    configuration planned (:class:`SearchProgress`; default none). ``runtime``: precision,
    framework and TP overlap every plan is priced with (:class:`spmdkit.program.runtime.Runtime`).
    ``reload``: ``model`` traced again at (a batch, tp chunks, cp) (:data:`search_space.Reload`).
    ``prune``: leave unplanned the configurations whose lower bounds
    (:mod:`spmdkit.planner.search_bounds`) show they cannot fit or cannot beat the best step
    found, and price a planned one's recomputation modes from full to none, stopping at the
    first over the cap (default: for a MoE model whose search has more than
    :data:`EXHAUSTIVE_PLANS` configurations; a dense model's search plans and prices every one).
    ``micro_batch``: sequences per data-parallel rank in one micro-step (a preset; the global
    batch is its batch): without a pipeline ``batch / (micro_batch x dp)`` micro-steps of gradient
    accumulation, with one that many microbatches; 0: each of :data:`MICRO_BATCHES` that divides
    a rank's share is tried (and the whole share without a pipeline).
    ``fold``: a preset's configurations planned on two shallow copies and extrapolated to its
    depth (:mod:`spmdkit.planner.fold`; exact to rounding), the best planned again whole.
    ``workers``: processes planning a lazy search's layer floors ahead of it (0 or 1; default 1
    where this process has two cores: :mod:`spmdkit.planner.search_ahead`; the same answer)."""
    t0 = time.perf_counter()
    dev, cap, modes, given = _search_args(devices, device, memory_cap, recompute, strategies, auto, nodes_of)
    cfg_model: ModelConfig | None = None
    if isinstance(model, Program):
        layers = len(layer_tags(model))
        pipeline = pipeline and layers > 1
        sizes = program_sizes(model, layers, guess_tokens(model), experts_of(model), reload is not None)
        modes = _applicable_modes(model, modes, recompute is not None)
        if reload is not None:
            reload = _cached(reload)
        if micro_batch is not None:
            raise ProgramError("--micro-batch: applies to a preset or catalog model's search (an imported or "
                               "program-file model is planned at the batch it was traced at)")
    else:
        cfg_model, sizes = _model_sizes(model, overrides)
        sizes = replace(sizes, micro=micro_batch)
    work, refused = _work(devices, pipeline, sizes, given, auto, runtime is not None and runtime.tp_comm_overlap,
                          runtime)
    job = _Job(dev, sizes.tokens, modes, cap, pins, cost_text, nodes_of, time_limit, patterns, runtime or Runtime(),
               fold=fold)
    if prune is None:  # a MoE model's search, where ep multiplies the meshes, when it is large; a large cluster's
        prune = (sizes.experts > 0 and len(work) > EXHAUSTIVE_PLANS) or devices >= PRUNED_DEVICES
    bounds = _bounds(model, cfg_model, job) if prune and work else None
    job = replace(job, lean=bounds is not None)
    lows: dict[Config, float] = {}
    floor, lazy, refiner = None, False, None
    seeds: set[Config] = set()
    if bounds is not None:  # the most promising first, so the best step found early prunes the most
        floor = _floor(model, cfg_model, job, bounds)
        lows, lazy = _step_bounds(work, bounds, floor, job, progress)
        work.sort(key=lambda c: lows.get(c, math.inf))
        refiner = Refiner(floor, lazy, functools.partial(_step_bound, bounds=bounds, floor=floor, job=job))
        if lazy:
            seeds = set(_seeds(work, lows, bounds, floor, job))
            refiner.start(sorted((c for c in work if c in lows), key=lambda c: (c not in seeds, lows[c])), workers, lows)
    elif len(work) > MAX_PLANS:
        raise ProgramError(f"--devices {devices}: {len(work)} configurations to plan (at most {MAX_PLANS})")
    if progress is not None:
        progress.update(0, total=len(work))
        progress.phase(f"{len(work)} configurations to plan" + (f", {len(refused)} refused before planning"
                       if refused else "") + (" (each on two shallow copies of the model where its layers "
                                                "repeat: planner/fold.py)" if fold and cfg_model is not None else ""))
    cands: list[Candidate] = []
    pruned: list[tuple[Config, str]] = []
    best = math.inf
    planned = 0
    # in the order of the bounds (the seeds first), each bound refined when its turn comes (a
    # lazy search's layer floors, a ZeRO-3 configuration's parameter gathers) and put back in
    # its place where that moves it: the order changes no result, only what the best step prunes
    queue = [(0 if cfg in seeds else 1, lows.get(cfg, math.inf), n, cfg, bounds is None)
             for n, cfg in enumerate(work)]
    heapq.heapify(queue)
    try:  # the worker stops however the loop ends (a refusal, Ctrl-C)
        while queue:
            tier, key, n, cfg, refined = heapq.heappop(queue)
            low = lows.get(cfg)
            if not refined and refiner is not None and low is not None and low < best and refiner.wants(cfg):
                low = lows[cfg] = refiner.refine(cfg, low, best)  # now it is its turn
                if low > key and tier:
                    heapq.heappush(queue, (tier, low, n, cfg, True))
                    continue
            if progress is not None:
                progress.update(note=cfg.label())
            why = pruned_why(cfg, bounds, cap, best, low) if bounds is not None else None
            if why is not None:
                pruned.append((cfg, why))
                if progress is not None:
                    progress.advance()
                continue
            planned += 1
            if planned > MAX_PLANS:
                raise ProgramError(f"--devices {devices}: more than {MAX_PLANS} configurations to plan after the "
                                   "bounds")
            t1 = time.perf_counter()
            k = len(cands)
            try:
                with configuration_notes(cfg):
                    if isinstance(model, Program):
                        cands += _plan_program_config(cfg, model, job, sizes, reload)
                    else:
                        assert cfg_model is not None
                        cands += _plan_preset_config(cfg, str(model), cfg_model, replace(job, best=best))
            except SpmdError as exc:
                refused.append((cfg, " ".join(str(exc).split())[:300]))
            for c in cands[k:]:
                c.plan_s = time.perf_counter() - t1
                if c.fits:
                    best = min(best, c.step_s)
            if progress is not None:
                progress.advance()
    finally:
        if refiner is not None:
            refiner.close()
    # equal steps (to 12 digits: a folded plan's and its whole twin's agree to 1e-9, not to the last bit)
    # rank by memory, so folding never reorders ties
    cands.sort(key=lambda c: (not c.fits, float(f"{c.step_s:.12g}") if c.fits else c.memory, c.memory))
    if progress is not None:
        folded = len({c.config for c in cands if c.folded})
        progress.phase(f"planned {planned} configurations ({folded} folded), {len(pruned)} pruned by bounds, "
                       f"{len(refused)} not planned; {sum(1 for c in cands if c.fits)} rows fit")
    if cands and cands[0].fits and cands[0].folded and cfg_model is not None:
        with configuration_notes(cands[0].config):
            cands[0] = _in_full(cands[0], str(model), cfg_model, job)
        if progress is not None:
            progress.phase(f"the best ({cands[0].config.label()}) planned whole")
    return SearchResult(devices, dev, cap, cands, refused, time.perf_counter() - t0, len(work) - len(pruned), pruned)


def _bounds(model: str | Program, mc: ModelConfig | None, job: _Job) -> Bounds:
    """The search's :class:`spmdkit.planner.search_bounds.Bounds`: the step planned on one rank at
    full size (the global batch); a preset's folded (two shallow copies, their repeated layer's
    parameters and states repeated, the FLOPs extrapolated: planner.fold) where ``job.fold``."""
    if isinstance(model, Program):
        _p, plan = plan_program(model, "dp=1", None)
        return model_bounds(replace(plan, runtime=job.runtime), job.device, job.runtime, 0)
    assert mc is not None
    dense = mc.dense_layers if mc.experts else 0
    fold = fold_of((mc.layers,), dense) if job.fold else None
    got = []
    for layers in ([fold.layers_a, fold.layers_b] if fold is not None else [mc.layers]):
        _m, plan, _ = plan_model(str(model), "dp=1,tp=1", "dp", {"layers": layers, "batch": mc.batch, "seq": mc.seq},
                                 models=job.models)
        token = mc.hidden * plan.program.tensors["embed"].itemsize if "embed" in plan.program.tensors else 0
        got.append(model_bounds(replace(plan, runtime=job.runtime), job.device, job.runtime, token))
    if fold is None:
        return got[0]
    a, b = got
    k = dense + 1
    return replace(b, layers=b.layers[:k] + (b.layers[k],) * (mc.layers - fold.layers_b) + b.layers[k:],
                   flops=fold.at(a.flops, b.flops))


def _floor(model: str | Program, mc: ModelConfig | None, job: _Job, bounds: Bounds | None = None) -> StepFloor | None:
    """The :class:`spmdkit.planner.search_floor.StepFloor` of a preset's search (None for a
    program); a MoE model's with dense first layers (``bounds``: with its pipelines' split
    floor, :func:`spmdkit.planner.search_floor_layers.split_floor`)."""
    if isinstance(model, Program) or mc is None:
        return None

    def plan_copy(cfg: Config, layers: int, batch: int) -> Plan:
        # priced as a bound of every ZeRO level of the strategy (Runtime.lower_bound)
        return replace(_preset_plan(cfg, str(model), mc.with_(batch=batch), job, layers).plan,
                       runtime=replace(job.runtime, lower_bound=True))

    dense = mc.dense_layers if mc.experts else 0
    # a MoE model with dense first layers: each layer key on one copy, its work by layer
    if dense:
        return LayerStepFloor(plan_copy, job.device, mc.layers, mc.batch, dense, bounds=bounds, cap=job.cap)
    return StepFloor(plan_copy, job.device, mc.layers, mc.batch, dense)


@contextlib.contextmanager
def configuration_notes(cfg: Config) -> Iterator[None]:
    """The strategies' notes raised while ``cfg`` is planned, raised again naming the configuration
    (``configuration pp=2,dp=1,tp=16: ...``) where they name ``--mesh`` (which the search's user did
    not give: ``--devices``); other warnings as they were."""
    said: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            yield
    finally:  # (also where planning it failed: what it said before)
        for w in said:
            text = str(w.message)
            if issubclass(w.category, UserWarning) and text.startswith("--mesh ") and ": " in text:
                text = f"configuration {cfg.mesh_text}: {text.split(': ', 1)[1]}"
            warnings.warn(text, w.category, stacklevel=3)


def _step_bound(cfg: Config, bounds: Bounds, floor: StepFloor | None, job: _Job, gathers: bool = False) -> float:
    """The step bound of :func:`_step_bound_of`, with the notes its plans raise naming ``cfg``."""
    with configuration_notes(cfg):
        return _step_bound_of(cfg, bounds, floor, job, gathers)


def _step_bound_of(cfg: Config, bounds: Bounds, floor: StepFloor | None, job: _Job, gathers: bool = False) -> float:
    """``cfg``'s step bound: the larger of :meth:`Bounds.step` and ``floor``'s under the least
    recomputation its memory bound allows (a mode whose kept activations cannot fit is not
    counted; inf: none can). ``gathers`` (its turn has come): also from its layers' plans on its
    own dp and strategy, ZeRO-3's parameter gathers (:meth:`StepFloor.gathered`) and each rank's
    tail after its last backward (:meth:`StepFloor.tail`: optimizer, unhidden reductions)."""
    low = bounds.step(cfg.devices, cfg.pp, cfg.microbatches, cfg.ep, cfg.strategy, cfg.virtual)
    f = floor.of(cfg) if floor is not None else NO_FLOOR
    if floor is not None and f is not NO_FLOOR:
        z = floor.gathered(cfg) if gathers else NO_FLOOR
        kept = {rc: max(f.kept.get(rc, 0), z.kept.get(rc, 0)) for rc in job.modes}

        def fits(rc: str) -> bool:  # full recomputation: with a layer's working peak (Bounds.memory)
            return memory_bound(cfg, bounds, kept[rc], f.full_peak if rc == "full" else 0.0) <= job.cap

        least = min((floor.step(cfg, rc, gathers) for rc in job.modes if fits(rc)), default=math.inf)
        if cfg.pp > 1 and "full" in job.modes and "none" in job.modes and job.runtime.framework not in NO_LAYER_COUNT:
            # full:K (planner.search_blocks): on the layers' floor without the gathers (its even
            # pipeline term: affine in the rerun), and at least no recomputation's with them
            # (StepFloor.step: without a MoE pipeline's split floor, which holds no recomputation's bytes).
            # Counted even where the memory bound lets none fit: a MoE pipeline's split floor may put
            # none above a full:K that the plan prices where none does not fit
            # (search_floor_layers.blocks_split_floor)
            plain = StepFloor.step
            blocks = blocks_floor(bounds, cfg, job.cap, kept["none"], kept["full"], plain(floor, cfg, "none", gathers,
                                  False), plain(floor, cfg, "full", gathers, False),  # (the even terms, the least tail)
                                  f.full_peak)
            least = min(least, max(blocks, plain(floor, cfg, "none", gathers), floor.blocks_step(cfg, gathers)))
        low = max(low, least)
    return low


def _step_bounds(work: list[Config], bounds: Bounds, floor: StepFloor | None, job: _Job,
                 progress: SearchProgress | None) -> tuple[dict[Config, float], bool]:
    """Each configuration's step bound (:func:`_step_bound`), for those the memory bound does not
    reject; and whether the floor was left out of them (``lazy``: its layer plans, one per
    distinct key, would be more than :data:`EAGER_FLOORS`; each configuration's floor is then
    computed when it is its turn, :meth:`Bounds.step` ordering them)."""
    t0 = time.perf_counter()
    fits = [c for c in work if memory_why(c, bounds, job.cap) is None]
    lazy = floor is not None and len({floor.key(c) for c in fits}) > EAGER_FLOORS
    out = {c: _step_bound(c, bounds, None if lazy else floor, job) for c in fits}
    if progress is not None and floor is not None:
        progress.phase(f"step bounds of {len(out)} configurations from {len(floor.cache)} layer plans "
                       f"({floor.plans} shallow copies planned, {time.perf_counter() - t0:.1f} s)" if not lazy else
                       f"step bounds of {len(out)} configurations (FLOPs; their layers' floors as they come)")
    return out, lazy


def _seeds(work: list[Config], lows: dict[Config, float], bounds: Bounds, floor: StepFloor | None,
           job: _Job) -> list[Config]:
    """The configurations a search with lazy floors plans first, so that a step is found early and
    the floors prune the rest: of a MoE model's expert-parallel pipelines without tensor or context
    parallelism and with ZeRO-1 or ZeRO-2 (``dp,ep,zero1``: the DeepSeek-V3 report's family, few
    layer keys, their optimizer states over dp and their memory low; ``dp,ep,zero2`` its twin of
    the same layers, which holds less), the :data:`SEEDS` of lowest bound, of two equal bounds the
    one whose memory bound is lower first (DeepSeek-V3's ZeRO-1 pp=32 ep=2 does not fit, its twin
    does), their floors computed now (``lows`` updated), the least refined with their own plans
    (search_ahead.least_refined: a ZeRO-2 twin's reduce-scatters sort it later); the order changes only what is pruned."""
    family = [c for c in work if c in lows and c.tp == 1 and c.cp == 1 and c.ep > 1 and c.pp > 1
              and c.strategy in ("dp,ep,zero1", "dp,ep,zero2")]
    lows.update({c: _step_bound(c, bounds, floor, job) for c in family})
    return least_refined(sorted(family, key=lambda c: (lows[c], memory_bound(c, bounds))), lows,
                         functools.partial(_step_bound, bounds=bounds, floor=floor, job=job, gathers=True), SEEDS)


def config_candidates(model: str, cfg: Config, device: Device | str = "h100",
                      overrides: Mapping[str, int | None] | None = None, *, fold: bool = True,
                      runtime: Runtime | None = None, memory_cap: int | str | None = None) -> list[Candidate]:
    """One configuration of the preset ``model`` planned and priced as the search prices it,
    every recomputation mode (``fold``: on two shallow copies, :mod:`spmdkit.planner.fold`,
    where that saves planning; else at the model's depth). ``scripts/check_fold.py`` compares the two."""
    dev, cap, modes, _given = _search_args(max(1, cfg.devices), device, memory_cap, None, None, False, None)
    mc, sizes = _model_sizes(model, overrides)
    job = _Job(dev, sizes.tokens, modes, cap, None, None, None, 30.0, runtime=runtime or Runtime(), fold=fold)
    return _plan_preset_config(cfg, model, mc, job)


def import_hf_program(class_name: str, config: Any, batch: int, seq: int, dtype: str = "float32") -> Program:
    """The training step of the HuggingFace model ``class_name`` (config: dict, JSON text or a
    config.json path) imported at ``batch`` x ``seq`` (no strategy: as the model computes)."""
    prog, _model, _kw = import_hf_checked(class_name, config, batch, seq, dtype_name(dtype))
    return prog


__all__ = ["LONG_SEQ", "MICRO_BATCHES", "MAX_PLANS", "Config", "SearchProgress", "SearchResult",
           "config_candidates", "context_degrees", "expert_degrees", "factorizations",
           "hand_strategies", "import_hf_program", "parse_memory", "search_meshes"]
