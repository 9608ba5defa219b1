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
``cp_attention`` (an --hf model: imported for cp, allgather; no pipeline with cp, refused by
name); a shorter sequence searches exactly the meshes it did before.

Which factorisations are tried: dp divides the global batch (each rank a whole number of
sequences), tp divides the attention heads (Megatron's requirement; a preset only), pp is at
most the layers (layers that do not divide into the stages are split balanced by predicted
time: :func:`spmdkit.planner.pipeline.auto_counts`). A configuration whose planning fails (a rule refusing a sharding, an uneven shard
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

import functools
import heapq
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from spmdkit.core.errors import ProgramError, SpmdError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.reshard import CostModel
from spmdkit.cost.checkpoints import NO_LAYER_COUNT
from spmdkit.cost.compute import guess_tokens, kernel_collectives, model_flops
from spmdkit.cost.devices import Device, load_device, recost
from spmdkit.cost.memory import Memory, memory_per_device, per_microbatch_mode
from spmdkit.cost.step import OpComm, StepEstimate, estimate_step, op_communication
from spmdkit.engine.memo import Recent
from spmdkit.models.hf import dtype_name
from spmdkit.models.source import import_hf_checked
from spmdkit.models.zoo import ModelConfig, build_model, preset
from spmdkit.planner.auto import AutoInfo
from spmdkit.planner.auto.stage import StageSearch, auto_stage, auto_title, link_cost
from spmdkit.planner.fold import (
    Fold,
    bucket_figures,
    bucket_sync,
    fold_counts,
    fold_of,
    pipeline_memory,
    pipeline_step,
)
from spmdkit.planner.fold_stages import copy_layers, deep_pipeline, stage_copy, stretch_units
from spmdkit.planner.partition import balanced_split, even_split
from spmdkit.planner.pipeline import (
    PipelineEstimate,
    PipelineSpec,
    estimate_pipeline,
    parse_spec,
    plan_unit_costs,
    pp_cost_text,
    split_layers,
)
from spmdkit.planner.planning import MAX_LAYERS, MAX_SIZE, BuiltModels, parse_size, plan_model, plan_program
from spmdkit.planner.search_ahead import Refiner, least_refined
from spmdkit.planner.search_blocks import blocks_floor, blocks_k, blocks_mode, least_blocks, wants_blocks
from spmdkit.planner.search_bounds import Bounds, experts_of, memory_bound, memory_why, model_bounds, pruned_why
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
    _sub_mesh,
    _work,
    context_degrees,
    expert_degrees,
    factorizations,
    hand_strategies,
    parse_memory,
    program_for,
    program_sizes,
)
from spmdkit.program.ir import Program
from spmdkit.program.layers import layer_tags
from spmdkit.program.plan import Plan
from spmdkit.program.runtime import Runtime
from spmdkit.strategies.strategy import MAX_RANKS, parse_mesh

RECOMPUTE_MODES = ("none", "selective", "full")
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
class Candidate:
    """A configuration and its prediction (times in s, bytes per device)."""

    config: Config
    step_s: float
    mfu: float | None
    memory: int
    comm_s: float
    fits: bool
    plan: Plan = field(repr=False)
    estimate: StepEstimate | PipelineEstimate = field(repr=False)
    memory_detail: Memory = field(repr=False)
    title: str = ""
    auto: AutoInfo | None = None                        # for strategy "auto"
    plan_s: float = 0.0                                 # seconds to plan its shardings
    #: the collectives of the step's plan (reshard steps and those inside kernels)
    collectives: int = 0
    #: a pipeline's one microbatch on the stages' sub-mesh, every stage (its communication)
    micro: StepEstimate | None = field(default=None, repr=False)
    #: folded (:mod:`spmdkit.planner.fold`): the layers of the deeper copy planned (its plan,
    #: estimate and memory are that copy's; the figures above the full model's); 0: planned whole
    folded: int = 0

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {**self.config.to_json(), "step_s": self.step_s, "mfu": self.mfu,
                             "memory_per_device": self.memory, "comm_s": self.comm_s, "fits": self.fits}
        if self.auto is not None:
            d["auto"] = {"status": self.auto.status, "gap": self.auto.gap, "solve_seconds": self.auto.solve_s}
        return d


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


# -- one configuration ------------------------------------------------------------------------------


class SearchProgress(Protocol):
    """What the search tells of its progress (:class:`spmdkit.outputs.progress.Progress` is one):
    the count of configurations planned, their total, a note naming the one being planned."""

    def update(self, done: int | None = None, total: int | None = None, note: str | None = None) -> None: ...

    def advance(self, n: int = 1, note: str | None = None) -> None: ...

    def phase(self, text: str) -> None: ...


@dataclass(frozen=True)
class _Job:
    """What every configuration of one search is planned and priced with."""

    device: Device
    tokens: int | None
    modes: Sequence[str]
    cap: int
    pins: Mapping[str, Any] | None
    cost_text: str | None
    nodes_of: int | None
    time_limit: float
    patterns: Any = None
    runtime: Runtime = field(default_factory=Runtime)
    #: a pruned search: the modes priced from the most recomputation to the least, stopping at the
    #: first over the cap (recomputing less holds more)
    lean: bool = False
    #: a preset's configurations planned on two shallow copies and extrapolated (planner.fold)
    fold: bool = True
    #: a pruned search: the best step found so far (a full:K that cannot beat it is not priced)
    best: float = math.inf
    #: the search's built models (a shallow copy is planned on many meshes; planning.BuiltModels)
    models: BuiltModels = field(default_factory=BuiltModels, compare=False, repr=False)

    def mode_order(self) -> Sequence[str]:
        return sorted(self.modes, key=lambda r: -RECOMPUTE_MODES.index(r)) if self.lean else self.modes


def _link_cost(mesh: ProcessMesh, job: _Job, cost_text: str | None) -> CostModel:
    """The device's links on ``mesh``, ``cost_text`` (``--cost``) on top."""
    return link_cost(mesh, job.device, job.nodes_of, cost_text)


def collectives_of(plan: Plan) -> int:
    """The collectives of a plan's step: its reshards' steps and those inside its kernels."""
    return sum(len(r.plan.steps) for r in plan.reshards) + len(kernel_collectives(plan))


def _kept(cands: list[Candidate], job: _Job) -> list[Candidate]:
    """The modes of one configuration as listed: a mode that changes neither the step nor the
    memory of one before it left out (e.g. selective without an attention core); a pruned
    search stops at the first over the cap (recomputing less holds more)."""
    out: list[Candidate] = []
    for c in cands:
        if any(o.step_s == c.step_s and o.memory == c.memory for o in out):
            continue
        out.append(c)
        if job.lean and not c.fits:
            break
    return out


def _flat_candidates(cfg: Config, plan: Plan, job: _Job, title: str, info: AutoInfo | None = None,
                     raw: bool = False) -> list[Candidate]:
    """Every mode priced (``raw``: each of ``job.mode_order()``, none left out)."""
    out: list[Candidate] = []
    plan = replace(plan, runtime=job.runtime)
    n = collectives_of(plan)
    tokens = job.tokens // plan.grad_accum if job.tokens else job.tokens  # estimate_step counts the micro-steps
    for rc in job.mode_order():
        est = estimate_step(plan, job.device, tokens, rc)
        mem = memory_per_device(plan, rc)
        out.append(Candidate(replace(cfg, recompute=rc), est.step_overlap_s, est.mfu, mem.device_total,
                             est.comm_total_s, mem.device_total <= job.cap, plan, est, mem, title, info, collectives=n))
        if not raw and job.lean and not out[-1].fits:
            break
    return out if raw else _kept(out, job)


def _pipeline_candidates(cfg: Config, plan: Plan, counts: tuple[int, ...] | None, job: _Job, tokens: int, title: str,
                         cost_text: str | None, info: AutoInfo | None = None, raw: bool = False) -> list[Candidate]:
    full = parse_mesh(cfg.mesh_text)
    link = _link_cost(full, job, cost_text).links[full.dim_index("pp")]
    spec = _spec(cfg)
    m = cfg.microbatches
    out: list[Candidate] = []
    plan, oc, ones = _pricing(plan, job)
    n = collectives_of(plan)
    for rc in job.mode_order():
        est = estimate_pipeline(plan, spec, counts, job.device, (link.alpha_s, link.beta_s_per_byte), tokens,
                                full.size, recompute=rc, oc=oc)
        mem = max(est.memory, key=lambda x: x.device_total)
        mode = per_microbatch_mode(rc)  # full:K: the microbatch's step (communication) under full
        if mode not in ones:  # one microbatch on the sub-mesh, every stage
            ones[mode] = estimate_step(plan, job.device, tokens // m, mode)
        one = ones[mode]
        # per device: its stages' share of the collectives of m microbatches, the gradient
        # reductions once, and the sends of its busiest stage
        sends = max((f + b for f, b in zip(est.send_f_s, est.send_b_s)), default=0.0)
        comm = ((one.comm_total_s - one.grad_sync_s) * m + one.grad_sync_s) / cfg.pp + m * sends
        out.append(Candidate(replace(cfg, recompute=rc), est.step_overlap_s, est.mfu, mem.device_total, comm,
                             mem.device_total <= job.cap, plan, est, mem, title, info, collectives=n, micro=one))
        if not raw and job.lean and not out[-1].fits:
            break
    return out if raw else _kept(out, job)


#: a plan's pricing inputs by the plan priced (its modes and its full:K share them): (the plan,
#: the runtime, the device, the plan under the runtime, one microbatch's step by mode)
_PRICED: Recent[tuple[Plan, Runtime, Device, Plan, dict[str, StepEstimate]]] = Recent(4)


def _pricing(plan_in: Plan, job: _Job) -> tuple[Plan, OpComm, dict[str, StepEstimate]]:
    """``plan_in`` under the search's runtime, its ops' times on the device, and the steps of one
    microbatch already priced, once per plan (the last few kept)."""
    got = _PRICED.get((id(plan_in), job.runtime, id(job.device)),
                      lambda: (plan_in, job.runtime, job.device, replace(plan_in, runtime=job.runtime), {}))
    return got[3], op_communication(got[3], job.device), got[4]


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
    cap = dev.memory_bytes if memory_cap is None else parse_memory(memory_cap)
    modes = list(dict.fromkeys(recompute or RECOMPUTE_MODES))
    for rc in modes:
        if isinstance(rc, str) and rc.startswith("every:"):  # (priced by plan --mesh, not searched: docs/devices.md)
            raise ProgramError(f"--recompute {rc[:40]}: the search tries {', '.join(RECOMPUTE_MODES)} (each "
                               f"configuration priced once a mode), not every N-th layer; price it for one "
                               f"configuration with spmdkit plan --mesh ... --recompute {rc[:40]}")
        if rc not in RECOMPUTE_MODES:
            raise ProgramError(f"--recompute {rc!r}: one of {', '.join(RECOMPUTE_MODES)}")
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
    work, refused = _work(devices, pipeline, sizes, given, auto)
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


def _step_bound(cfg: Config, bounds: Bounds, floor: StepFloor | None, job: _Job, gathers: bool = False) -> float:
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


def _pins_for(cfg: Config, pins: Mapping[str, Any] | None) -> dict[str, Any]:
    """``--annotate``'s pins (mesh dims 0 = dp, 1 = tp) on ``cfg``'s sub-mesh: with an ep or a cp
    dim (``dp, ep, tp`` / ``dp, cp, tp``) tp is dim 2, with both (ep-from=cp) dim 3."""
    if (cfg.ep == 1 and cfg.cp == 1) or not pins:
        return dict(pins or {})

    def dim(d: Any) -> Any:
        if isinstance(d, list):
            return [dim(x) for x in d]
        return 1 + (cfg.ep > 1) + (cfg.cp > 1) if d == 1 else d  # tp: the sub-mesh's last dim

    return {n: (dim(v) if isinstance(v, list) else v) for n, v in pins.items()}


def _auto(prog: Program, cfg: Config, job: _Job, cost_text: str | None) -> tuple[Plan, AutoInfo]:
    """The exact search on ``cfg``'s stage (planner/auto/stage.py, as ``plan --auto`` on a pp mesh)."""
    return auto_stage(prog, _sub_mesh(cfg), _pins_for(cfg, job.pins), StageSearch(job.device, job.nodes_of,
                                                                                  job.time_limit), cost_text)


@dataclass(frozen=True)
class _Planned:
    """One configuration's shardings planned: the plan (recosted on the device's links), its
    title, the exact search's report (auto) and the ``--cost`` text of the pipeline's sends."""

    plan: Plan
    title: str
    info: AutoInfo | None
    full_cost: str | None


def _preset_plan(cfg: Config, name: str, mc: ModelConfig, job: _Job, layers: int | None = None) -> _Planned:
    """``cfg`` planned on the preset (``layers``: a shallow copy of it, planner.fold)."""
    full_cost, cost_text = job.cost_text, pp_cost_text(job.cost_text, None)  # pp= times the sends only
    over = {"layers": layers or mc.layers, "batch": mc.batch // cfg.microbatches // cfg.grad_accum, "seq": mc.seq}
    title = (f"{name}: {mc.arch}, {mc.layers} layers, hidden {mc.hidden}, seq {mc.seq}, batch {mc.batch}"
             + (f" as {cfg.microbatches} microbatches of {mc.batch // cfg.microbatches}" if cfg.pp > 1 else "")
             + (f" as {cfg.grad_accum} micro-steps of {mc.batch // cfg.grad_accum}" if cfg.grad_accum > 1 else "")
             + f"; mesh {cfg.mesh_text}; {cfg.strategy}")
    info = None
    if cfg.strategy == "auto":
        # on a cp mesh the model is built with cp_attention (its default variant, allgather): the
        # exact search then chooses where the sequence is split over cp
        built = mc.with_(**over, **({"cp": cfg.cp} if cfg.cp > 1 else {}))
        # the vocab-parallel loss, as the flat --auto builds it: its rule also takes the class axis
        # whole, so the search may split the vocabulary over any dim or none
        model = build_model(built, vocab_parallel_loss=True, check_rules=False)
        plan, info = _auto(model.program, cfg, job, cost_text)
        title += auto_title(info)
        return _Planned(recost(plan, _link_cost(plan.mesh, job, cost_text)), title, info, full_cost)
    pins = _pins_for(cfg, job.pins)

    def make() -> Plan:
        _model, plan, _ = plan_model(name, cfg.sub_mesh_text, cfg.strategy, over, pins, cost_text,
                                     grad_accum=cfg.grad_accum, models=job.models)
        return recost(plan, _link_cost(plan.mesh, job, cost_text))

    key = (name, cfg.sub_mesh_text, cfg.strategy, tuple(over.items()), cfg.grad_accum, repr(pins), cost_text)
    return _Planned(job.models.plan(key, make), title, info, full_cost)


def _price(cfg: Config, p: _Planned, counts: tuple[int, ...] | None, job: _Job, raw: bool = False) -> list[Candidate]:
    """``cfg``'s plan priced under every recomputation mode (a pipeline's stages: ``counts``)."""
    if cfg.pp == 1:
        return _flat_candidates(cfg, p.plan, job, p.title, p.info, raw)
    assert job.tokens is not None
    return _pipeline_candidates(cfg, p.plan, counts, job, job.tokens, p.title, p.full_cost, p.info, raw)


def _plan_preset_config(cfg: Config, name: str, mc: ModelConfig, job: _Job) -> list[Candidate]:
    if job.fold and cfg.strategy != "auto":
        # folded by stage first where that plans fewer layers; else the two-copy fold, and where
        # that cannot (interleaved stages, FSDP's prefetch) by stage if its copy is shallower
        ways = [_deep_config, _folded_config] if _deep_first(cfg, mc) else [_folded_config] + (
            [_deep_config] if _deep_shallower(cfg, mc) else [])
        for way in ways:
            got = way(cfg, name, mc, job)
            if got is not None:
                return got
    p = _preset_plan(cfg, name, mc, job)
    counts = _split(cfg, p, job, mc.layers)
    got = _price(cfg, p, counts, job)
    return got + _blocks(cfg, got, counts, job, lambda m: _price(cfg, p, counts, _only(job, m), raw=True)[0])


def _only(job: _Job, mode: str) -> _Job:
    """``job`` pricing the one recomputation ``mode``."""
    return replace(job, modes=(mode,), lean=False)


def _blocks(cfg: Config, got: list[Candidate], counts: tuple[int, ...] | None, job: _Job,
            price: Callable[[str], Candidate | None]) -> list[Candidate]:
    """``cfg``'s least ``full:K`` that fits (:mod:`spmdkit.planner.search_blocks`), where its
    priced modes ``got`` have full fitting and no recomputation not; ``price(mode)`` prices one
    mode (a pruned search prices no recomputation first where it stopped before it: full:K only
    adds recomputation to its step, so none at least the best found rules every K out)."""
    want = wants_blocks(cfg.pp, job.modes, [(c.config.recompute, c.fits, c.memory) for c in got])
    if want is None or not counts or job.runtime.framework in NO_LAYER_COUNT:  # (no full:K there)
        return []
    none = next((c for c in got if c.config.recompute == "none"), None)
    if job.lean and none is None:
        none = price("none")
        want = (none.memory, want[1]) if none is not None else want
    if job.lean and none is not None and none.step_s >= job.best:
        return []
    c = least_blocks(lambda k: price(blocks_mode(k)), lambda x: x.fits, lambda x: x.memory, max(counts), want[0],
                     want[1], job.cap,
                     (lambda x: x.step_s >= job.best) if job.lean else None)
    return [] if c is None else [c]


def _split(cfg: Config, p: _Planned, job: _Job, layers: int, dense: int | None = None) -> tuple[int, ...] | None:
    """Layers per virtual stage of ``cfg`` (None without a pipeline): even where they divide, else
    balanced by predicted time as ``spmdkit plan`` splits them (:func:`spmdkit.planner.pipeline.
    auto_counts`: each layer's forward and backward, the embedding on the first stage, the head on
    the last; memory aside) from the per-layer costs of ``p``'s plan, the full model's or
    (``dense`` given) a shallow copy's stretched to ``layers``."""
    if cfg.pp == 1:
        return None
    even = _counts(layers, cfg)
    if even is not None:
        return even
    plan = replace(p.plan, runtime=job.runtime)
    u = plan_unit_costs(plan, cfg.pp, job.device, "none")
    if dense is not None:
        u = stretch_units(u, layers, dense)
    t = [f + b for f, b in zip(u.forward_s, u.backward_s)]
    return balanced_split(t[1:-1], cfg.pp * cfg.virtual, t[0], t[-1])


def _in_full(c: Candidate, name: str, mc: ModelConfig, job: _Job) -> Candidate:
    """A folded candidate planned again at the model's depth (the search's best: its report
    and files are the whole model's); its figures equal the folded ones to rounding."""
    cfg = replace(c.config, recompute="none")
    p = _preset_plan(cfg, name, mc, job)
    got = _price(cfg, p, _split(cfg, p, job, mc.layers), _only(job, c.config.recompute), raw=True)
    return got[0]


def _folded_config(cfg: Config, name: str, mc: ModelConfig, job: _Job) -> list[Candidate] | None:
    """``cfg`` priced on two shallow copies of the preset, extrapolated to its depth
    (:mod:`spmdkit.planner.fold`); None where folding saves nothing."""
    n, big = cfg.pp, mc.layers
    dense = mc.dense_layers if mc.experts else 0
    if cfg.virtual > 1:
        return None  # interleaved: folded by stage (_deep_config) or planned whole
    probe = fold = fold_of((big // n,) * n, dense)
    if fold is None or fold.layers_a + fold.layers_b >= big:
        return None  # two copies would plan as many layers as the model (a deep pipeline's stages)
    a = _preset_plan(cfg, name, mc, job, fold.layers_a)
    if big % n:  # the full model's split, from the copy's per-layer costs
        counts = _split(cfg, a, job, big, dense)
        assert counts is not None
        fold = fold_of(counts, dense)
        if fold is None or fold.layers_a + fold.layers_b >= big:
            return None
        if probe is not None and fold.layers_a != probe.layers_a:
            a = _preset_plan(cfg, name, mc, job, fold.layers_a)
    b = _preset_plan(cfg, name, mc, job, fold.layers_b)
    ca = _price(cfg, a, fold.a if n > 1 else None, job, raw=True)
    cb = _price(cfg, b, fold.b if n > 1 else None, job, raw=True)
    out = [_extrapolated(x, y, fold, job, big, dense) for x, y in zip(ca, cb)]
    if any(c is None for c in out):
        return None
    got = _kept([c for c in out if c is not None], job)
    counts = fold_counts(fold)
    pairs = [(fold, a, b)]
    whole: list[_Planned] = []

    def price(mode: str) -> Candidate | None:
        """full:k on two copies whose stages hold k + 1 layers at least (the repeated layer not
        recomputed), planned k + 2 a stage where those planned hold fewer; else on the model."""
        jk = _only(job, mode)
        k = blocks_k(mode)  # (no recomputation: any pair)
        pair = next((x for x in pairs if min(x[0].a) >= k + 1), None)
        deeper = fold_of(counts, dense, k + 2) if pair is None else None
        if deeper is not None and deeper.layers_a + deeper.layers_b < big:
            pair = (deeper, _preset_plan(cfg, name, mc, job, deeper.layers_a),
                    _preset_plan(cfg, name, mc, job, deeper.layers_b))
            pairs.append(pair)
        if pair is not None:
            f, pa, pb = pair
            ext = _extrapolated(_price(cfg, pa, f.a, jk, raw=True)[0], _price(cfg, pb, f.b, jk, raw=True)[0],
                                f, jk, big, dense)
            if ext is not None:
                return ext
        whole[:] = whole or [_preset_plan(cfg, name, mc, job)]
        return _price(cfg, whole[0], counts, jk, raw=True)[0]

    priced = [c for c in out if c is not None]  # every mode (a pruned search lists those to the first over the cap)
    return got + _blocks(cfg, priced, counts if n > 1 else None, job, price)


def _deep_first(cfg: Config, mc: ModelConfig) -> bool:
    """A pipeline folded by stage (planner.fold_stages) plans fewer layers than the two-copy
    fold (or that cannot fold it: interleaved stages, stages of 2-3 layers)."""
    if cfg.pp == 1:
        return False
    n, big = cfg.pp * cfg.virtual, mc.layers
    dense = mc.dense_layers if mc.experts else 0
    flat, std = fold_of((big,), dense), fold_of((big // cfg.pp,) * cfg.pp, dense)
    deep = copy_layers(tuple(even_split(big, n)), dense)
    if flat is None or deep is None:
        return False
    plain = std.layers_a + std.layers_b if std is not None and cfg.virtual == 1 else big
    return flat.layers_a + flat.layers_b + deep < min(plain, big)


def _deep_shallower(cfg: Config, mc: ModelConfig) -> bool:
    """A pipeline whose fold by stage plans fewer layers than the model (counting its two flat
    copies), on the even split's shape."""
    if cfg.pp == 1:
        return False
    dense = mc.dense_layers if mc.experts else 0
    flat = fold_of((mc.layers,), dense)
    deep = copy_layers(tuple(even_split(mc.layers, cfg.pp * cfg.virtual)), dense)
    return flat is not None and deep is not None and flat.layers_a + flat.layers_b + deep < mc.layers


def _deep_config(cfg: Config, name: str, mc: ModelConfig, job: _Job) -> list[Candidate] | None:
    """A deep pipeline priced on a shallow copy with the first stage, one middle stage of each
    distinct layer count and the last (:mod:`spmdkit.planner.fold_stages`), its communication,
    collectives and model FLOPs from two flat copies of 2 and 3 layers (:mod:`spmdkit.planner.fold`)."""
    big = mc.layers
    dense = mc.dense_layers if mc.experts else 0
    flat = fold_of((big,), dense)
    if flat is None or job.tokens is None:
        return None
    uneven = big % (cfg.pp * cfg.virtual) != 0
    if uneven and flat.layers_b < dense + 3:  # the split's copy (below) serves as the deeper flat one
        flat = fold_of((big,), dense, dense + 2) or flat
    copies: dict[int, _Planned] = {}

    def copy(layers: int) -> _Planned:
        if layers not in copies:
            copies[layers] = _preset_plan(cfg, name, mc, job, layers)
        return copies[layers]

    # the split from a copy's per-layer costs needs a repeated layer after the dense ones
    counts = _split(cfg, copy(max(flat.layers_b, dense + 3) if uneven else flat.layers_b), job, big, dense)
    assert counts is not None
    got = stage_copy(counts, dense)
    if got is None:
        return None
    a, b, s = copy(flat.layers_a), copy(flat.layers_b), copy(sum(got[0]))
    full = parse_mesh(cfg.mesh_text)
    link = _link_cost(full, job, s.full_cost).links[full.dim_index("pp")]
    m = cfg.microbatches
    pa, pb, ps = (replace(x.plan, runtime=job.runtime) for x in (a, b, s))
    mb = job.tokens // m
    flops = flat.at(model_flops(pa, mb)[0], model_flops(pb, mb)[0])
    coll = round(flat.at(collectives_of(pa), collectives_of(pb)))
    tokens = job.tokens
    flats: dict[str, tuple[StepEstimate, StepEstimate, float | None]] = {}

    def flat_steps(mode: str) -> tuple[StepEstimate, StepEstimate, float | None]:
        """The flat copies' microbatch steps under ``mode`` and the buckets' total time (only
        that is wanted here, the communication column: a ZeRO-3 prefetch that moves their
        starts, which bucket_figures refuses, does not change it); once per mode."""
        if mode not in flats:
            oa, ob = estimate_step(pa, job.device, mb, mode), estimate_step(pb, job.device, mb, mode)
            figs = bucket_figures(flat, pa, oa, pb, ob, big, dense)
            flats[mode] = oa, ob, figs[0] if figs is not None else bucket_sync(pa, oa, pb, ob, big, dense)
        return flats[mode]

    def one(rc: str) -> Candidate | None:
        # full:K: the flat copies' step (communication) under full
        oa, ob, sync = flat_steps(per_microbatch_mode(rc))
        est = deep_pipeline(ps, _spec(cfg), counts, job.device, (link.alpha_s, link.beta_s_per_byte), tokens,
                            full.size, rc, flops, dense)
        if sync is None or est is None:
            return None
        mem = max(est.memory, key=lambda x: x.device_total)
        sends = max((f + b for f, b in zip(est.send_f_s, est.send_b_s)), default=0.0)
        comm = (flat.at(oa.comm_total_s - oa.grad_sync_s, ob.comm_total_s - ob.grad_sync_s) * m + sync) / cfg.pp \
            + m * sends
        return Candidate(replace(cfg, recompute=rc), est.step_overlap_s, est.mfu, mem.device_total, comm,
                         mem.device_total <= job.cap, ps, est, mem, s.title, None, collectives=coll,
                         folded=sum(got[0]))

    out: list[Candidate] = []
    for rc in job.mode_order():
        c = one(rc)
        if c is None:
            return None
        out.append(c)
        if job.lean and not c.fits:
            break
    kept = _kept(out, job)
    return kept + _blocks(cfg, kept, counts, job, one)


def _extrapolated(x: Candidate, y: Candidate, fold: Fold, job: _Job, layers: int, dense: int) -> Candidate | None:
    """The full model's candidate from its two shallow copies' (``x``: ``fold.a``, ``y``: ``fold.b``):
    the affine figures extrapolated, the gradient buckets replayed and a pipeline's schedule and
    ranks' memory rebuilt at full depth (:mod:`spmdkit.planner.fold`); None where one of those
    does not reproduce a copy's own figures (the configuration is then planned whole)."""
    ex, ey = x.estimate, y.estimate
    flat = isinstance(ex, StepEstimate) and isinstance(ey, StepEstimate)
    mx, my = (ex, ey) if flat else (x.micro, y.micro)  # the step (a pipeline: one microbatch's)
    if not isinstance(mx, StepEstimate) or not isinstance(my, StepEstimate):
        return None
    got = bucket_figures(fold, x.plan, mx, y.plan, my, layers, dense)
    if got is None:
        return None
    gs, extra, extra_a, extra_b = got
    if flat:
        step = fold.at(x.step_s - extra_a, y.step_s - extra_b) + extra
        comm = fold.at(x.comm_s - mx.grad_sync_s, y.comm_s - my.grad_sync_s) + gs
        mem = round(fold.at(x.memory, y.memory))
    else:
        assert isinstance(ex, PipelineEstimate) and isinstance(ey, PipelineEstimate)
        pstep = pipeline_step(fold, x.plan, ex, y.plan, ey, job.device)
        ranks = pipeline_memory(fold, ex, y.plan, ey, y.config.recompute)
        if pstep is None or ranks is None:
            return None
        (step, sends), mem = pstep, max(ranks)
        p, m = x.config.pp, x.config.microbatches  # the microbatch's gradient reductions once over the stages

        def part(c: Candidate, one: StepEstimate, e: PipelineEstimate) -> float:
            return c.comm_s - one.grad_sync_s / p - m * max((f + b for f, b in zip(e.send_f_s, e.send_b_s)), default=0.0)

        comm = fold.at(part(x, mx, ex), part(y, my, ey)) + gs / p + m * sends
    mfu = fold.at(x.mfu * x.step_s, y.mfu * y.step_s) / step if x.mfu is not None and y.mfu is not None else None
    return replace(y, step_s=step, mfu=mfu, memory=mem, comm_s=comm, fits=mem <= job.cap,
                   collectives=round(fold.at(x.collectives, y.collectives)), folded=fold.layers_b)


def _spec(cfg: Config) -> PipelineSpec:
    """``cfg``'s pipeline: 1F1B, or interleaved 1F1B over ``cfg.virtual`` model chunks."""
    return parse_spec(cfg.pp, microbatches=cfg.microbatches, virtual=cfg.virtual if cfg.virtual > 1 else None)


def _counts(layers: int, cfg: Config) -> tuple[int, ...] | None:
    """Layers per virtual stage, None where they do not divide (balanced by the estimate)."""
    return None if layers % (cfg.pp * cfg.virtual) else split_layers(layers, _spec(cfg))


def _plan_program_config(cfg: Config, prog: Program, job: _Job, sizes: _Sizes,
                         reload: Reload | None) -> list[Candidate]:
    full_cost, cost_text = job.cost_text, pp_cost_text(job.cost_text, None)  # pp= times the sends only
    info = None
    prog, micro = program_for(cfg, prog, sizes, reload)  # a microbatch's step; etp=1 routed in tp chunks
    title = f"mesh {cfg.mesh_text}; {cfg.strategy}{micro}"
    if cfg.strategy == "auto":
        plan, info = _auto(prog, cfg, job, cost_text)
        title += auto_title(info)
    else:
        _p, plan = plan_program(prog, cfg.sub_mesh_text, cfg.strategy, _pins_for(cfg, job.pins), job.patterns, cost_text)
    plan = recost(plan, _link_cost(plan.mesh, job, cost_text))
    if cfg.pp == 1:
        return _flat_candidates(cfg, plan, job, title, info)
    assert sizes.layers is not None and job.tokens is not None
    return _pipeline_candidates(cfg, plan, _counts(sizes.layers, cfg), job, job.tokens, title, full_cost, info)


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


__all__ = ["LONG_SEQ", "MICRO_BATCHES", "MAX_PLANS", "RECOMPUTE_MODES", "Candidate", "Config", "SearchProgress", "SearchResult", "collectives_of",
           "config_candidates", "context_degrees", "expert_degrees", "factorizations",
           "hand_strategies", "import_hf_program", "parse_memory", "search_meshes"]
