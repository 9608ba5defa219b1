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
memory, not the shardings; a mode that changes neither is not listed). Each configuration is priced with the same models as a single
plan: :func:`spmdkit.cost.step.estimate_step` (the step with the gradient reductions
overlapping the backward) or, with pp > 1, :func:`spmdkit.planner.pipeline.estimate_pipeline`
(1F1B, ``batch / dp`` microbatches of one sequence per dp rank: the smallest bubble the batch
allows); memory per device with :func:`spmdkit.cost.memory.memory_per_device` (the fullest
pipeline rank with pp), as the GPU must hold it (:attr:`spmdkit.cost.memory.Memory.device_total`:
the allocated peak, the caching allocator's reserve, the CUDA context and NCCL's buffers). A
configuration whose memory per device is over the cap (the device's memory by default) is
rejected; the others are ranked by predicted step time.

Context parallelism: for a preset whose sequence is :data:`LONG_SEQ` tokens or more, each
data-parallel degree (without ep) is also split into ``dp x cp`` (:func:`context_degrees`: cp
dividing it, the sequence into ``2 cp`` zig-zag chunks; the mesh ``dp=D,cp=C,tp=T``) with the hand
strategies plus ``,cp`` and, with ``auto``, the exact search on the model built with
``cp_attention``; a shorter sequence searches exactly the meshes it did before.

Which factorisations are tried: dp divides the global batch (each rank a whole number of
sequences), tp divides the attention heads (Megatron's requirement; a preset only), pp is at
most the layers (layers that do not divide into the stages are split balanced by predicted
time: :func:`spmdkit.planner.pipeline.auto_counts`). A configuration whose planning fails (a rule refusing a sharding, an uneven shard
a strategy cannot take, the search finding no solution in its time limit) is kept in
:attr:`SearchResult.refused` with the reason, never silently dropped.

``--annotate`` pins in a search index the mesh ``dp, tp`` (dims 0 and 1; a pipeline's pp dim
holds no tensor). The global batch is the preset's (``--batch``); with pp it is split into the
microbatches, so every configuration trains the same tokens per step. A program (imported or
from a file) is planned as it was traced; with ``reload`` (an HF model: the program imported
again at a batch) its pipelines are in microbatches as a preset's, without it (a program
file) a pipeline runs the program's step as one microbatch.

``progress`` (a :class:`SearchProgress`, e.g. :class:`spmdkit.outputs.progress.Progress`) hears
of each configuration planned; the search prints nothing (its table: :mod:`spmdkit.outputs.search`;
``--verify`` of the best configuration: :func:`spmdkit.sim.verify_plan.verify_config`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from spmdkit.core.errors import ProgramError, SpmdError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.reshard import CostModel
from spmdkit.cost.compute import guess_tokens
from spmdkit.cost.devices import Device, cost_model, load_device, recost
from spmdkit.cost.memory import Memory, memory_per_device, recompute_regions
from spmdkit.cost.step import StepEstimate, estimate_step
from spmdkit.models.hf import dtype_name
from spmdkit.models.source import import_hf_checked
from spmdkit.models.zoo import ModelConfig, build_model, preset
from spmdkit.planner.auto import AutoInfo, auto_plan
from spmdkit.planner.pipeline import (
    PipelineEstimate,
    estimate_pipeline,
    parse_spec,
    pp_cost_text,
    split_layers,
)
from spmdkit.planner.planning import MAX_LAYERS, MAX_SIZE, parse_size, plan_model, plan_program
from spmdkit.planner.search_bounds import Bounds, experts_of, model_bounds
from spmdkit.program.ir import Program
from spmdkit.program.layers import layer_tags
from spmdkit.program.plan import Plan
from spmdkit.program.runtime import Runtime
from spmdkit.strategies.hf import data_inputs
from spmdkit.strategies.strategy import MAX_RANKS, parse_mesh, parse_strategy, tp_problem

RECOMPUTE_MODES = ("none", "selective", "full")
#: the most configurations one search plans (each a propagation or an exact search)
MAX_PLANS = 2000
#: a MoE model's search plans every configuration up to this many, beyond prunes by bounds
EXHAUSTIVE_PLANS = 200
#: the sequence length from which a preset's search also splits the sequence over a ``cp`` dim
#: (context parallelism: Llama 3 trained from 8k with cp from 16k up; torchtitan and NeMo from 16k-32k)
LONG_SEQ = 16384


@dataclass(frozen=True)
class Config:
    """One point of the outer search. ``ep`` > 1: expert parallelism carved out of data
    parallelism as Megatron-Core folds it (the batch over ``dp x ep``, the experts over ``ep``)."""

    dp: int
    tp: int
    pp: int = 1
    strategy: str = "dp"      # a --strategy comma list, or "auto"
    recompute: str = "none"
    microbatches: int = 1
    ep: int = 1
    #: context parallelism: the sequence split over a cp dim between dp and tp (1: none)
    cp: int = 1

    @property
    def sub_mesh_text(self) -> str:
        """The mesh the shardings are planned on (without pp)."""
        return (f"dp={self.dp}," + (f"ep={self.ep}," if self.ep > 1 else "") + (f"cp={self.cp}," if self.cp > 1 else "")
                + f"tp={self.tp}")

    @property
    def mesh_text(self) -> str:
        return (f"pp={self.pp}," if self.pp > 1 else "") + self.sub_mesh_text

    @property
    def devices(self) -> int:
        return self.dp * self.ep * self.cp * self.tp * self.pp

    def label(self) -> str:
        return (f"dp={self.dp}" + (f" ep={self.ep}" if self.ep > 1 else "") + (f" cp={self.cp}" if self.cp > 1 else "")
                + f" tp={self.tp} pp={self.pp}"
                + (f" (m={self.microbatches})" if self.pp > 1 else "")
                + f" {self.strategy}" + (f" recompute={self.recompute}" if self.recompute != "none" else ""))

    def to_json(self) -> dict[str, Any]:
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp, **({"ep": self.ep} if self.ep > 1 else {}),
                **({"cp": self.cp} if self.cp > 1 else {}),
                "strategy": self.strategy, "recompute": self.recompute, "microbatches": self.microbatches,
                "mesh": self.mesh_text}


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


def factorizations(n: int, pipeline: bool = True) -> list[tuple[int, int, int]]:
    """Every (dp, tp, pp) with dp * tp * pp == n (pp == 1 unless ``pipeline``)."""
    out = []
    for pp in range(1, n + 1):
        if n % pp or (pp > 1 and not pipeline):
            continue
        rest = n // pp
        for tp in range(1, rest + 1):
            if rest % tp == 0:
                out.append((rest // tp, tp, pp))
    return sorted(out, key=lambda t: (t[2], t[1], t[0]))


def hand_strategies(dp: int, tp: int, ep: int = 1, cp: int = 1) -> list[str]:
    """The hand strategies a (dp, tp) sub-mesh can take (ZeRO only where dp > 1); with ``ep``
    > 1 (a ``dp x ep x tp`` sub-mesh) the same with expert parallelism (``,ep``; megatron's
    experts tensor-parallel over tp: ETP = TP), ZeRO where the data-parallel ranks ``dp x ep``
    are more than one; with ``cp`` > 1 (a ``dp x cp x tp`` sub-mesh) the same with context
    parallelism (``,cp``), ZeRO where ``dp x cp`` (the ranks that reduce the gradients) are more
    than one."""
    zeros = ["", ",zero1", ",zero2", ",zero3"] if dp * ep * cp > 1 else [""]
    bases = ["dp"] if tp == 1 else ["megatron", "megatron,sp"]
    if ep > 1:
        bases = [b + ",ep" for b in bases]
    if cp > 1:
        bases = [b + ",cp" for b in bases]
    return [b + z for b in bases for z in zeros]


def context_degrees(dp_total: int, seq: int | None) -> list[int]:
    """The cp degrees a data-parallel degree ``dp_total`` can give its sequence to: 1, and for a
    sequence of :data:`LONG_SEQ` tokens or more every divisor ``cp`` > 1 of ``dp_total`` whose
    zig-zag chunks divide the sequence (``2 cp`` divides it)."""
    out = [1]
    if seq is not None and seq >= LONG_SEQ:
        out += [c for c in range(2, dp_total + 1) if dp_total % c == 0 and seq % (2 * c) == 0]
    return out


def expert_degrees(dp_total: int, experts: int) -> list[int]:
    """The ep degrees a data-parallel degree ``dp_total`` can fold out (Megatron-Core: ``dp x ep``
    = the data-parallel ranks): the divisors of both it and the experts, 1 first."""
    return [e for e in range(1, dp_total + 1) if dp_total % e == 0 and (e == 1 or (experts and experts % e == 0))]


def parse_memory(text: Any) -> int:
    """``80GB`` / ``80GiB`` / ``512MB`` / ``8e10`` (bytes) / an int -> bytes. GB is 10**9,
    GiB 2**30."""
    if isinstance(text, bool):
        raise ProgramError("--memory: expected a size such as 80GB or 80GiB")
    if isinstance(text, (int, float)):
        v = float(text)
    else:
        t = str(text).strip().replace(" ", "")
        units = {"tib": 1 << 40, "gib": 1 << 30, "mib": 1 << 20, "kib": 1 << 10, "tb": 10**12, "gb": 10**9,
                 "mb": 10**6, "kb": 10**3, "b": 1}
        k = 1
        low = t.lower()
        for u, mult in units.items():
            if low.endswith(u):
                k, t = mult, t[:-len(u)]
                break
        try:
            v = float(t) * k
        except ValueError:
            raise ProgramError(f"--memory {str(text)[:40]!r}: expected a size such as 80GB or 80GiB") from None
    if not (v == v) or not 1 <= v <= 1 << 60:
        raise ProgramError(f"--memory {str(text)[:40]!r}: expected a size from 1 byte to 1 EiB")
    return int(v)


# -- one configuration ------------------------------------------------------------------------------


class SearchProgress(Protocol):
    """What the search tells of its progress (:class:`spmdkit.outputs.progress.Progress` is one):
    the count of configurations planned, their total, a note naming the one being planned."""

    def update(self, done: int | None = None, total: int | None = None, note: str | None = None) -> None: ...

    def advance(self, n: int = 1, note: str | None = None) -> None: ...


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

    def mode_order(self) -> Sequence[str]:
        return sorted(self.modes, key=lambda r: -RECOMPUTE_MODES.index(r)) if self.lean else self.modes


def _link_cost(mesh: ProcessMesh, job: _Job, cost_text: str | None) -> CostModel:
    """The device's links on ``mesh``, ``cost_text`` (``--cost``) on top."""
    cost = cost_model(mesh, job.device, job.nodes_of)
    if cost_text:
        cost = CostModel.parse(cost_text, mesh, base=cost)
    return cost


def _flat_candidates(cfg: Config, plan: Plan, job: _Job, title: str, info: AutoInfo | None = None) -> list[Candidate]:
    out: list[Candidate] = []
    plan = replace(plan, runtime=job.runtime)
    for rc in job.mode_order():
        est = estimate_step(plan, job.device, job.tokens, rc)
        mem = memory_per_device(plan, rc)
        if any(c.step_s == est.step_overlap_s and c.memory == mem.device_total for c in out):
            continue  # this recomputation changes nothing here (e.g. selective without an attention core)
        out.append(Candidate(replace(cfg, recompute=rc), est.step_overlap_s, est.mfu, mem.device_total,
                             est.comm_total_s, mem.device_total <= job.cap, plan, est, mem, title, info))
        if job.lean and not out[-1].fits:
            break
    return out


def _pipeline_candidates(cfg: Config, plan: Plan, counts: tuple[int, ...] | None, job: _Job, tokens: int, title: str,
                         cost_text: str | None, info: AutoInfo | None = None) -> list[Candidate]:
    full = parse_mesh(cfg.mesh_text)
    link = _link_cost(full, job, cost_text).links[full.dim_index("pp")]
    spec = parse_spec(cfg.pp, microbatches=cfg.microbatches)
    m = cfg.microbatches
    out: list[Candidate] = []
    plan = replace(plan, runtime=job.runtime)
    for rc in job.mode_order():
        est = estimate_pipeline(plan, spec, counts, job.device, (link.alpha_s, link.beta_s_per_byte), tokens,
                                full.size, recompute=rc)
        mem = max(est.memory, key=lambda x: x.device_total)
        if any(c.step_s == est.step_overlap_s and c.memory == mem.device_total for c in out):
            continue  # this recomputation changes nothing here
        one = estimate_step(plan, job.device, tokens // m, rc)  # one microbatch on the sub-mesh, every stage
        # per device: its stages' share of the collectives of m microbatches, the gradient
        # reductions once, and the sends of its busiest stage
        sends = max((f + b for f, b in zip(est.send_f_s, est.send_b_s)), default=0.0)
        comm = ((one.comm_total_s - one.grad_sync_s) * m + one.grad_sync_s) / cfg.pp + m * sends
        out.append(Candidate(replace(cfg, recompute=rc), est.step_overlap_s, est.mfu, mem.device_total, comm,
                             mem.device_total <= job.cap, plan, est, mem, title, info))
        if job.lean and not out[-1].fits:
            break
    return out


def _batch_of(prog: Program) -> int | None:
    ins = data_inputs(prog)
    shapes = [prog.tensors[n].shape for n in ins if prog.tensors[n].shape]
    return shapes[0][0] if shapes else None


@dataclass(frozen=True)
class _Sizes:
    """What limits the factorisations: the global batch, the attention heads, the layers
    (None where unknown: an imported program has no heads or layers to divide)."""

    batch: int | None
    tokens: int | None
    heads: int | None
    layers: int | None
    #: a pipeline's step in microbatches of one sequence per dp rank (else the step whole, m = 1)
    microbatches: bool = True
    #: the preset's config (tp must split its heads, kv heads, FFN and vocabulary: tp_problem)
    config: ModelConfig | None = None
    #: routed experts (0: a dense model, no ep dim tried)
    experts: int = 0


def _model_sizes(model: str, overrides: Mapping[str, int | None] | None) -> tuple[ModelConfig, _Sizes]:
    """The preset ``model`` with ``--layers`` / ``--batch`` / ``--seq`` applied, and its sizes."""
    cfg = preset(str(model))
    limits = {"layers": MAX_LAYERS, "batch": MAX_SIZE, "seq": MAX_SIZE}
    checked = {k: parse_size(f"--{k}", v, limits.get(k, MAX_SIZE)) for k, v in dict(overrides or {}).items()}
    cfg = cfg.with_(**{k: v for k, v in checked.items() if v is not None})
    return cfg, _Sizes(cfg.batch, cfg.batch * cfg.seq, cfg.heads, cfg.layers, config=cfg, experts=cfg.experts)


def _work(devices: int, pipeline: bool, sizes: _Sizes, given: list[str] | None,
          auto: bool) -> tuple[list[Config], list[tuple[Config, str]]]:
    """The configurations to plan (recomputation "none": the modes are priced on one plan) and
    those refused before planning, with the reason."""
    work: list[Config] = []
    refused: list[tuple[Config, str]] = []
    batch = sizes.batch
    seq = sizes.config.seq if sizes.config is not None else None
    for dpt, tp, pp in factorizations(devices, pipeline):
        why = None
        uneven = batch is not None and batch % dpt != 0
        if sizes.config is not None and (bad := tp_problem(sizes.config, tp)) is not None:
            why = bad
        elif sizes.heads is not None and sizes.heads % tp:
            why = f"tp={tp} does not divide the {sizes.heads} attention heads"
        elif sizes.layers is not None and sizes.layers < pp:
            why = f"pp={pp}: {sizes.layers} layers cannot fill {pp} stages"
        m = (batch // dpt) if (pp > 1 and batch and sizes.microbatches) else 1
        if uneven or why is not None:
            refused.append((Config(dpt, tp, pp, "*", "none", m),
                            f"dp={dpt} does not divide the batch {batch}" if uneven else str(why)))
        if why is not None:
            continue
        # ep = 1 and cp = 1 first: a dense model's meshes at a short sequence as they were; a batch dp
        # does not divide may still split over dp x cp (the cp ranks share their sequences)
        degrees = [(e, c) for e in expert_degrees(dpt, sizes.experts) for c in (context_degrees(dpt, seq) if e == 1 else [1])]
        for ep, cp in degrees:
            dp = dpt // ep // cp
            if batch is not None and batch % (dp * ep):
                continue
            m = (batch // (dp * ep)) if (pp > 1 and batch and sizes.microbatches) else 1
            names = list(given) if given is not None else hand_strategies(dp, tp, ep, cp)
            if auto:
                names.append("auto")
            for s in names:
                cfg = Config(dp, tp, pp, s, "none", m, ep, cp)
                if s != "auto":
                    parts = s.split(",")
                    if (tp == 1 and "megatron" in parts) or ((ep > 1) != ("ep" in parts)) \
                            or (ep > 1 and tp > 1 and "megatron" not in parts) or ((cp > 1) != ("cp" in parts)):
                        continue  # megatron over tp=1 is dp; ep over ep=1 is dp; an idle ep or tp dim repeats work;
                        # the strategies go to the meshes of their own cp
                    try:
                        parse_strategy(s, _sub_mesh(cfg))
                    except ProgramError as exc:
                        refused.append((cfg, str(exc)))
                        continue
                work.append(cfg)
    return work, refused


def _search_args(devices: int, device: Device | str, memory_cap: int | str | None, recompute: Iterable[str] | None,
                 strategies: Iterable[str] | None, auto: bool,
                 nodes_of: int | None) -> tuple[Device, int, list[str], list[str] | None]:
    """(device, memory cap, recomputation modes, strategies given) checked."""
    if isinstance(devices, bool) or not isinstance(devices, int) or not 1 <= devices <= MAX_RANKS:
        raise ProgramError(f"--devices {devices!r}: expected an integer from 1 to {MAX_RANKS}")
    dev = device if isinstance(device, Device) else load_device(str(device))
    if nodes_of:
        dev = replace(dev, ranks_per_node=nodes_of)
    cap = dev.memory_bytes if memory_cap is None else parse_memory(memory_cap)
    modes = list(dict.fromkeys(recompute or RECOMPUTE_MODES))
    for rc in modes:
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
                  runtime: Runtime | None = None, reload: Callable[[int], Program] | None = None,
                  prune: bool | None = None) -> SearchResult:
    """Search ``devices`` devices for the fastest configuration of ``model`` (a preset name or a
    :class:`spmdkit.program.ir.Program`, e.g. an imported HuggingFace model) that fits in
    ``memory_cap`` bytes per device (default: ``device``'s memory). ``device``: a
    :class:`spmdkit.cost.compute.Device` or a preset name / JSON path. ``strategies``: the
    hand strategies to try (default :func:`hand_strategies` of each mesh); ``auto``: also
    :func:`spmdkit.planner.auto.auto_plan` on each mesh (``time_limit`` seconds each).
    ``recompute``: the modes to try (default all three). ``progress``: told of each
    configuration planned (:class:`SearchProgress`; default none). ``runtime``: precision,
    framework and TP overlap every plan is priced with (:class:`spmdkit.program.runtime.Runtime`).
    ``reload``: a program ``model`` traced again at a batch (the pipelines' microbatches).
    ``prune``: leave unplanned the configurations whose lower bounds
    (:mod:`spmdkit.planner.search_bounds`) show they cannot fit or cannot beat the best step
    found, and price a planned one's recomputation modes from full to none, stopping at the
    first over the cap (default: for a MoE model whose search has more than
    :data:`EXHAUSTIVE_PLANS` configurations; a dense model's search plans and prices every one)."""
    t0 = time.perf_counter()
    dev, cap, modes, given = _search_args(devices, device, memory_cap, recompute, strategies, auto, nodes_of)
    cfg_model: ModelConfig | None = None
    if isinstance(model, Program):
        layers = len(layer_tags(model))
        pipeline = pipeline and layers > 1
        sizes = _Sizes(_batch_of(model), guess_tokens(model), None, layers or None, reload is not None,
                       experts=experts_of(model))
        modes = _applicable_modes(model, modes, recompute is not None)
        if reload is not None:
            reload = _cached(reload)
    else:
        cfg_model, sizes = _model_sizes(model, overrides)
    work, refused = _work(devices, pipeline, sizes, given, auto)
    job = _Job(dev, sizes.tokens, modes, cap, pins, cost_text, nodes_of, time_limit, patterns, runtime or Runtime())
    if prune is None:  # a MoE model's search, where ep multiplies the meshes, when it is large
        prune = sizes.experts > 0 and len(work) > EXHAUSTIVE_PLANS
    bounds = _bounds(model, cfg_model, job) if prune and work else None
    job = replace(job, lean=bounds is not None)
    if bounds is not None:  # the most promising first, so the best step found early prunes the most
        work.sort(key=lambda c: bounds.step(c.devices, c.pp, c.microbatches, c.ep, c.strategy))
    elif len(work) > MAX_PLANS:
        raise ProgramError(f"--devices {devices}: {len(work)} configurations to plan (at most {MAX_PLANS})")
    if progress is not None:
        progress.update(0, total=len(work))
    cands: list[Candidate] = []
    pruned: list[tuple[Config, str]] = []
    best = math.inf
    planned = 0
    for cfg in work:
        if progress is not None:
            progress.update(note=cfg.label())
        why = _pruned_why(cfg, bounds, cap, best) if bounds is not None else None
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
                cands += _plan_preset_config(cfg, str(model), cfg_model, job)
        except SpmdError as exc:
            refused.append((cfg, " ".join(str(exc).split())[:300]))
        for c in cands[k:]:
            c.plan_s = time.perf_counter() - t1
            if c.fits:
                best = min(best, c.step_s)
        if progress is not None:
            progress.advance()
    cands.sort(key=lambda c: (not c.fits, c.step_s if c.fits else c.memory, c.memory))
    return SearchResult(devices, dev, cap, cands, refused, time.perf_counter() - t0, len(work) - len(pruned), pruned)


def _bounds(model: str | Program, mc: ModelConfig | None, job: _Job) -> Bounds:
    """The search's :class:`spmdkit.planner.search_bounds.Bounds`: the step planned on one rank at
    full size (the global batch)."""
    if isinstance(model, Program):
        _p, plan = plan_program(model, "dp=1", None)
    else:
        assert mc is not None
        _m, plan, _ = plan_model(str(model), "dp=1,tp=1", "dp", {"layers": mc.layers, "batch": mc.batch,
                                                                   "seq": mc.seq})
    token = mc.hidden * plan.program.tensors["embed"].itemsize if mc is not None and "embed" in plan.program.tensors \
        else 0
    return model_bounds(replace(plan, runtime=job.runtime), job.device, job.runtime, token)


def _pruned_why(cfg: Config, bounds: Bounds, cap: int, best: float) -> str | None:
    """Why ``cfg`` need not be planned (its bounds), or None."""
    # cp: ZeRO shards over dp x cp and each rank holds 1/cp of the sequences' tokens, as dp x cp ranks would
    mem = bounds.memory(cfg.dp * cfg.cp, cfg.ep, cfg.tp, cfg.pp, cfg.strategy, cfg.microbatches) \
        if cfg.strategy != "auto" else 0
    if mem > cap:
        return (f"over the memory cap: its parameters, gradients, optimizer states and layer inputs kept for the "
                f"backward alone need at least {mem / 2**30:.1f} GiB a device")
    low = bounds.step(cfg.devices, cfg.pp, cfg.microbatches, cfg.ep, cfg.strategy)
    if low >= best:
        return f"its step is at least {low:.3g} s (FLOPs at the fastest rates, MoE all-to-alls, the pipeline's bubble), the best found {best:.3g} s"
    return None


def _sub_mesh(cfg: Config) -> ProcessMesh:
    return parse_mesh(cfg.sub_mesh_text)


def _pins_for(cfg: Config, pins: Mapping[str, Any] | None) -> dict[str, Any]:
    """``--annotate``'s pins (mesh dims 0 = dp, 1 = tp) on ``cfg``'s sub-mesh: with an ep or a cp
    dim (``dp, ep, tp`` / ``dp, cp, tp``) tp is dim 2."""
    if (cfg.ep == 1 and cfg.cp == 1) or not pins:
        return dict(pins or {})

    def dim(d: Any) -> Any:
        if isinstance(d, list):
            return [dim(x) for x in d]
        return 2 if d == 1 else d

    return {n: (dim(v) if isinstance(v, list) else v) for n, v in pins.items()}


def _auto(prog: Program, cfg: Config, job: _Job, cost_text: str | None) -> tuple[Plan, AutoInfo]:
    mesh = _sub_mesh(cfg)
    return auto_plan(prog, mesh, _pins_for(cfg, job.pins), cost=_link_cost(mesh, job, cost_text),
                     time_limit=job.time_limit,
                     device=job.device)


def _auto_title(info: AutoInfo) -> str:
    return f" (HiGHS {info.status}, gap {info.gap:.2%}, solve {info.solve_s:.2f} s, realised {info.realized})"


def _plan_preset_config(cfg: Config, name: str, mc: ModelConfig, job: _Job) -> list[Candidate]:
    full_cost, cost_text = job.cost_text, pp_cost_text(job.cost_text, None)  # pp= times the sends only
    over = {"layers": mc.layers, "batch": mc.batch // cfg.microbatches, "seq": mc.seq}
    title = (f"{name}: {mc.arch}, {mc.layers} layers, hidden {mc.hidden}, seq {mc.seq}, batch {mc.batch}"
             + (f" as {cfg.microbatches} microbatches of {mc.batch // cfg.microbatches}" if cfg.pp > 1 else "")
             + f"; mesh {cfg.mesh_text}; {cfg.strategy}")
    info = None
    if cfg.strategy == "auto":
        # on a cp mesh the model is built with cp_attention (its default variant, allgather): the
        # exact search then chooses where the sequence is split over cp
        built = mc.with_(**over, **({"cp": cfg.cp} if cfg.cp > 1 else {}))
        model = build_model(built, vocab_parallel_loss=cfg.tp > 1, check_rules=False)
        plan, info = _auto(model.program, cfg, job, cost_text)
        title += _auto_title(info)
    else:
        _model, plan, _ = plan_model(name, cfg.sub_mesh_text, cfg.strategy, over, _pins_for(cfg, job.pins), cost_text)
    plan = recost(plan, _link_cost(plan.mesh, job, cost_text))
    if cfg.pp == 1:
        return _flat_candidates(cfg, plan, job, title, info)
    assert job.tokens is not None
    return _pipeline_candidates(cfg, plan, _counts(mc.layers, cfg), job, job.tokens, title, full_cost, info)


def _counts(layers: int, cfg: Config) -> tuple[int, ...] | None:
    """Layers per stage, None where they do not divide (balanced by the estimate)."""
    return None if layers % cfg.pp else split_layers(layers, parse_spec(cfg.pp, microbatches=cfg.microbatches))


def _cached(reload: Callable[[int], Program]) -> Callable[[int], Program]:
    """``reload`` tracing the program once per batch."""
    done: dict[int, Program] = {}

    def get(batch: int) -> Program:
        if batch not in done:
            done[batch] = reload(batch)
        return done[batch]

    return get


def _applicable_modes(prog: Program, modes: list[str], given: bool) -> list[str]:
    """The recomputation modes that apply to ``prog`` (full and selective need numbered layers or
    an attention core): those given are checked (a ProgramError naming ``--recompute``), the
    default ones that do not apply are left out."""
    out = []
    for rc in modes:
        try:
            recompute_regions(prog, rc)
        except ProgramError:
            if given:
                raise
            continue
        out.append(rc)
    return out or ["none"]


def _plan_program_config(cfg: Config, prog: Program, job: _Job, sizes: _Sizes,
                         reload: Callable[[int], Program] | None) -> list[Candidate]:
    full_cost, cost_text = job.cost_text, pp_cost_text(job.cost_text, None)  # pp= times the sends only
    info = None
    title = f"mesh {cfg.mesh_text}; {cfg.strategy}"
    if cfg.pp > 1 and cfg.microbatches > 1 and reload is not None and sizes.batch:
        prog = reload(sizes.batch // cfg.microbatches)  # one microbatch's step
        title += f"; {cfg.microbatches} microbatches of {sizes.batch // cfg.microbatches}"
    if cfg.strategy == "auto":
        plan, info = _auto(prog, cfg, job, cost_text)
        title += _auto_title(info)
    else:
        _p, plan = plan_program(prog, cfg.sub_mesh_text, cfg.strategy, _pins_for(cfg, job.pins), job.patterns, cost_text)
    plan = recost(plan, _link_cost(plan.mesh, job, cost_text))
    if cfg.pp == 1:
        return _flat_candidates(cfg, plan, job, title, info)
    assert sizes.layers is not None and job.tokens is not None
    return _pipeline_candidates(cfg, plan, _counts(sizes.layers, cfg), job, job.tokens, title, full_cost, info)


def import_hf_program(class_name: str, config: Any, batch: int, seq: int, dtype: str = "float32") -> Program:
    """The training step of the HuggingFace model ``class_name`` (config: dict, JSON text or a
    config.json path) imported at ``batch`` x ``seq`` (no strategy: as the model computes)."""
    prog, _model, _kw = import_hf_checked(class_name, config, batch, seq, dtype_name(dtype))
    return prog


__all__ = ["MAX_PLANS", "RECOMPUTE_MODES", "Candidate", "Config", "SearchProgress", "SearchResult", "factorizations",
           "hand_strategies", "import_hf_program", "parse_memory", "search_meshes"]
