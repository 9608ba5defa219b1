"""One configuration of the search (:mod:`spmdkit.planner.search`) planned and priced.

A configuration's shardings planned (a preset's, :func:`_preset_plan`, or a program's; the hand
strategy's propagation or, ``auto``, the exact search on its stage) and priced under each
recomputation mode as one :class:`Candidate` each (:func:`_flat_candidates`: the step;
:func:`_pipeline_candidates`: :func:`spmdkit.planner.pipeline.estimate_pipeline`), a pipeline's
least ``full:K`` that fits (:mod:`spmdkit.planner.search_blocks`); a preset's planned on two shallow
copies or one stage's copy and rebuilt at full depth (:mod:`spmdkit.planner.fold`,
:mod:`spmdkit.planner.fold_stages`), or planned whole (:func:`_in_full`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.reshard import CostModel
from spmdkit.cost.checkpoints import NO_LAYER_COUNT
from spmdkit.cost.compute import kernel_collectives, model_flops
from spmdkit.cost.devices import Device, recost
from spmdkit.cost.memory import Memory, memory_per_device, per_microbatch_mode
from spmdkit.cost.step import OpComm, StepEstimate, estimate_step, op_communication
from spmdkit.engine.memo import Recent
from spmdkit.models.zoo import ModelConfig, build_model
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
from spmdkit.planner.pipeline import PipelineEstimate, estimate_pipeline, plan_unit_costs
from spmdkit.planner.pipeline_plan import pp_cost_text
from spmdkit.planner.pipeline_split import PipelineSpec, parse_spec, split_layers
from spmdkit.planner.planning import BuiltModels, plan_model, plan_program
from spmdkit.planner.search_blocks import blocks_k, blocks_mode, least_blocks, wants_blocks
from spmdkit.planner.search_space import (
    Config,
    Reload,
    _Sizes,
    _sub_mesh,
    program_for,
)
from spmdkit.program.ir import Program
from spmdkit.program.plan import Plan
from spmdkit.program.runtime import Runtime
from spmdkit.strategies.strategy import parse_mesh

RECOMPUTE_MODES = ("none", "selective", "full")


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
_PRICED: Recent[tuple[Plan, Runtime, Device, Plan, dict[str, StepEstimate]]] = Recent(4, by_id=True)


def _pricing(plan_in: Plan, job: _Job) -> tuple[Plan, OpComm, dict[str, StepEstimate]]:
    """``plan_in`` under the search's runtime, its ops' times on the device, and the steps of one
    microbatch already priced, once per plan (the last few kept)."""
    got = _PRICED.get((id(plan_in), job.runtime, id(job.device)),
                      lambda: (plan_in, job.runtime, job.device, replace(plan_in, runtime=job.runtime), {}))
    return got[3], op_communication(got[3], job.device), got[4]


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
    balanced by predicted time as ``spmdkit plan`` splits them (:func:`spmdkit.planner.pipeline_split.
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


__all__ = ["RECOMPUTE_MODES", "Candidate", "collectives_of"]
