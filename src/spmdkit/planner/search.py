"""The outer search of issue 16: N devices, every mesh factorisation and strategy, the best plans.

:func:`search_meshes` (``spmdkit plan --devices N``) walks every factorisation ``dp x tp x pp``
of N (pp, pipeline parallelism, only for preset models: :mod:`spmdkit.planner.pipeline`; the
mesh is ``pp=P,dp=D,tp=T``, pp outermost and tp innermost as Megatron-LM lays ranks out, so
the innermost dims share a node's NVLink); for each it plans the hand strategies
(:mod:`spmdkit.strategies.strategy`: ``dp`` with ZeRO 0 to 3 where dp > 1, ``megatron`` and
``megatron,sp`` each with ZeRO 0 to 3 where dp > 1, tp > 1) and, with ``auto``, the exact
search :func:`spmdkit.planner.auto.auto_plan` on the mesh (its own shardings of everything,
optimizer states included, so no ZeRO variants); every plan is then costed under each
activation recomputation mode (none, selective, full; recomputation changes the step and the
memory, not the shardings; a mode that changes neither is not listed). Each configuration is priced with the same models as a single
plan: :func:`spmdkit.cost.compute.estimate_step` (the step with the gradient reductions
overlapping the backward) or, with pp > 1, :func:`spmdkit.planner.pipeline.estimate_pipeline`
(1F1B, ``batch / dp`` microbatches of one sequence per dp rank: the smallest bubble the batch
allows); memory per device with :func:`spmdkit.cost.memory.memory_per_device` (the fullest
pipeline rank with pp). A configuration whose memory per device is over the cap (the device's
memory by default) is rejected; the others are ranked by predicted step time.

Which factorisations are tried: dp divides the global batch (each rank a whole number of
sequences), tp divides the attention heads (Megatron's requirement; a preset only), pp divides
the layers. A configuration whose planning fails (a rule refusing a sharding, an uneven shard
a strategy cannot take, the search finding no solution in its time limit) is kept in
:attr:`SearchResult.refused` with the reason, never silently dropped.

``--annotate`` pins in a search index the mesh ``dp, tp`` (dims 0 and 1; a pipeline's pp dim
holds no tensor). The global batch is the preset's (``--batch``); with pp it is split into the
microbatches, so every configuration trains the same tokens per step.

Also here: :func:`verify_auto` (``plan --auto --verify``): the chosen dist attrs of the tensors
the tiny model of the same architecture shares with the plan (same names: its two layers, the
embedding, the head, their gradients and optimizer states) held as annotations on that tiny
model, planned by propagate on the same mesh and simulated against the unsharded step.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TextIO

from spmdkit.core.errors import ProgramError, SpmdError

RECOMPUTE_MODES = ("none", "selective", "full")
#: the most configurations one search plans (each a propagation or an exact search)
MAX_PLANS = 2000


@dataclass(frozen=True)
class Config:
    """One point of the outer search."""

    dp: int
    tp: int
    pp: int = 1
    strategy: str = "dp"      # a --strategy comma list, or "auto"
    recompute: str = "none"
    microbatches: int = 1

    @property
    def sub_mesh_text(self) -> str:
        """The mesh the shardings are planned on (without pp)."""
        return f"dp={self.dp},tp={self.tp}"

    @property
    def mesh_text(self) -> str:
        return (f"pp={self.pp}," if self.pp > 1 else "") + self.sub_mesh_text

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.pp

    def label(self) -> str:
        return (f"dp={self.dp} tp={self.tp} pp={self.pp}" + (f" (m={self.microbatches})" if self.pp > 1 else "")
                + f" {self.strategy}" + (f" recompute={self.recompute}" if self.recompute != "none" else ""))

    def to_json(self) -> dict[str, Any]:
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp, "strategy": self.strategy, "recompute": self.recompute,
                "microbatches": self.microbatches, "mesh": self.mesh_text}


@dataclass
class Candidate:
    """A configuration and its prediction (times in s, bytes per device)."""

    config: Config
    step_s: float
    mfu: float | None
    memory: int
    comm_s: float
    fits: bool
    plan: Any = field(repr=False, default=None)
    estimate: Any = field(repr=False, default=None)   # compute.StepEstimate or pipeline.PipelineEstimate
    memory_detail: Any = field(repr=False, default=None)
    title: str = ""
    auto: Any = None                                    # auto.AutoInfo for strategy "auto"
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
    device: Any
    memory_cap: int
    candidates: list[Candidate]          # every costed configuration, the fitting ones first, fastest first
    refused: list[tuple[Config, str]]    # configurations that could not be planned, and why
    seconds: float = 0.0
    plans: int = 0                       # shardings planned (propagations or searches)

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


def hand_strategies(dp: int, tp: int) -> list[str]:
    """The hand strategies a (dp, tp) sub-mesh can take (ZeRO only where dp > 1)."""
    zeros = ["", ",zero1", ",zero2", ",zero3"] if dp > 1 else [""]
    bases = ["dp"] if tp == 1 else ["megatron", "megatron,sp"]
    return [b + z for b in bases for z in zeros]


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


def _recosted(plan: Any, device: Any, cost_text: str | None, nodes_of: int | None) -> Any:
    from spmdkit.core.reshard import CostModel
    from spmdkit.cost.compute import cost_model, recost

    cost = cost_model(plan.mesh, device, nodes_of)
    if cost_text:
        cost = CostModel.parse(cost_text, plan.mesh, base=cost)
    return recost(plan, cost)


def _flat_candidates(cfg: Config, plan: Any, device: Any, tokens: int | None, modes: Sequence[str], cap: int,
                     title: str, info: Any = None) -> list[Candidate]:
    from spmdkit.cost.compute import estimate_step
    from spmdkit.cost.memory import memory_per_device

    out: list[Candidate] = []
    for rc in modes:
        est = estimate_step(plan, device, tokens, rc)
        mem = memory_per_device(plan, rc)
        if any(c.step_s == est.step_overlap_s and c.memory == mem.total for c in out):
            continue  # this recomputation changes nothing here (e.g. selective without an attention core)
        out.append(Candidate(replace(cfg, recompute=rc), est.step_overlap_s, est.mfu, mem.total, est.comm_total_s,
                             mem.total <= cap, plan, est, mem, title, info))
    return out


def _pipeline_candidates(cfg: Config, plan: Any, counts: tuple[int, ...], device: Any, tokens: int,
                         modes: Sequence[str], cap: int, title: str, cost_text: str | None,
                         nodes_of: int | None, info: Any = None) -> list[Candidate]:
    from spmdkit.core.reshard import CostModel
    from spmdkit.cost.compute import cost_model, estimate_step
    from spmdkit.planner.pipeline import estimate_pipeline, parse_spec
    from spmdkit.strategies.strategy import parse_mesh

    full = parse_mesh(cfg.mesh_text)
    cost = cost_model(full, device, nodes_of)
    if cost_text:
        cost = CostModel.parse(cost_text, full, base=cost)
    link = cost.links[full.dim_index("pp")]
    spec = parse_spec(cfg.pp, microbatches=cfg.microbatches)
    m = cfg.microbatches
    out: list[Candidate] = []
    for rc in modes:
        est = estimate_pipeline(plan, spec, counts, device, (link.alpha_s, link.beta_s_per_byte), tokens,
                                full.size, recompute=rc)
        mem = max(est.memory, key=lambda x: x.total)
        if any(c.step_s == est.step_overlap_s and c.memory == mem.total for c in out):
            continue  # this recomputation changes nothing here
        one = estimate_step(plan, device, tokens // m, rc)  # one microbatch on the sub-mesh, every stage
        # per device: its stages' share of the collectives of m microbatches, the gradient
        # reductions once, and the sends of its busiest stage
        sends = max((f + b for f, b in zip(est.send_f_s, est.send_b_s)), default=0.0)
        comm = ((one.comm_total_s - one.grad_sync_s) * m + one.grad_sync_s) / cfg.pp + m * sends
        out.append(Candidate(replace(cfg, recompute=rc), est.step_overlap_s, est.mfu, mem.total, comm,
                             mem.total <= cap, plan, est, mem, title, info))
    return out


def _batch_of(prog: Any) -> int | None:
    from spmdkit.strategies.hf import data_inputs

    ins = data_inputs(prog)
    shapes = [prog.tensors[n].shape for n in ins if prog.tensors[n].shape]
    return shapes[0][0] if shapes else None


def search_meshes(model: Any, devices: int, device: Any = "h100", memory_cap: int | str | None = None, *,
                  auto: bool = False, strategies: Iterable[str] | None = None,
                  recompute: Iterable[str] | None = None, pipeline: bool = True,
                  overrides: Mapping[str, int | None] | None = None, pins: Mapping[str, Any] | None = None,
                  cost_text: str | None = None, time_limit: float = 30.0, nodes_of: int | None = None,
                  patterns: Any = None, progress: Any = None) -> SearchResult:
    """Search ``devices`` devices for the fastest configuration of ``model`` (a preset name or a
    :class:`spmdkit.program.ir.Program`, e.g. an imported HuggingFace model) that fits in
    ``memory_cap`` bytes per device (default: ``device``'s memory). ``device``: a
    :class:`spmdkit.cost.compute.Device` or a preset name / JSON path. ``strategies``: the
    hand strategies to try (default :func:`hand_strategies` of each mesh); ``auto``: also
    :func:`spmdkit.planner.auto.auto_plan` on each mesh (``time_limit`` seconds each).
    ``recompute``: the modes to try (default all three). ``progress``: a
    :class:`spmdkit.outputs.progress.Progress` (default: one on stderr, shown on a terminal only)."""
    from spmdkit.cost.compute import Device, guess_tokens, load_device
    from spmdkit.outputs.progress import Progress
    from spmdkit.program.ir import Program
    from spmdkit.strategies.strategy import MAX_RANKS, parse_strategy

    t0 = time.perf_counter()
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
    prog: Program | None = None
    cfg_model = None
    if isinstance(model, Program):
        prog = model
        pipeline = False
        batch = _batch_of(prog)
        tokens = guess_tokens(prog)
        heads = None
        layers = None
    else:
        from spmdkit.models.zoo import preset
        from spmdkit.planner.planning import MAX_LAYERS, MAX_SIZE, parse_size

        cfg_model = preset(str(model))
        ov = dict(overrides or {})
        limits = {"layers": MAX_LAYERS, "batch": MAX_SIZE, "seq": MAX_SIZE}
        checked = {k: parse_size(f"--{k}", v, limits.get(k, MAX_SIZE)) for k, v in ov.items()}
        cfg_model = cfg_model.with_(**{k: v for k, v in checked.items() if v is not None})
        batch, tokens, heads, layers = cfg_model.batch, cfg_model.batch * cfg_model.seq, cfg_model.heads, cfg_model.layers
    # the plans to make: (dp, tp, pp, strategy)
    work: list[tuple[int, int, int, str]] = []
    refused: list[tuple[Config, str]] = []
    for dp, tp, pp in factorizations(devices, pipeline):
        why = None
        if batch is not None and batch % dp:
            why = f"dp={dp} does not divide the batch {batch}"
        elif heads is not None and heads % tp:
            why = f"tp={tp} does not divide the {heads} attention heads"
        elif layers is not None and layers % pp:
            why = f"pp={pp} does not divide the {layers} layers"
        names = list(given) if given is not None else hand_strategies(dp, tp)
        if auto:
            names.append("auto")
        m = (batch // dp) if (pp > 1 and batch) else 1
        if why is not None:
            refused.append((Config(dp, tp, pp, "*", "none", m), why))
            continue
        for s in names:
            if s != "auto":
                try:
                    parse_strategy(s, _sub_mesh(dp, tp))
                except ProgramError as exc:
                    refused.append((Config(dp, tp, pp, s, "none", m), str(exc)))
                    continue
                if tp == 1 and "megatron" in s.split(","):
                    continue  # megatron over tp=1 is dp
            work.append((dp, tp, pp, s))
    if len(work) > MAX_PLANS:
        raise ProgramError(f"--devices {devices}: {len(work)} configurations to plan (at most {MAX_PLANS})")
    bar = progress if progress is not None else Progress(f"plan --devices {devices}", total=len(work))
    bar.update(0, total=len(work))
    cands: list[Candidate] = []
    try:
        for dp, tp, pp, s in work:
            m = (batch // dp) if (pp > 1 and batch) else 1
            cfg = Config(dp, tp, pp, s, "none", m)
            bar.update(note=cfg.label())
            t1 = time.perf_counter()
            k = len(cands)
            try:
                if prog is not None:
                    cands += _plan_program_config(cfg, prog, dev, tokens, modes, cap, pins, cost_text, nodes_of,
                                                  patterns, time_limit)
                else:
                    assert cfg_model is not None and tokens is not None
                    cands += _plan_preset_config(cfg, str(model), cfg_model, dev, tokens, modes, cap, pins,
                                                 cost_text, nodes_of, time_limit)
            except SpmdError as exc:
                refused.append((cfg, " ".join(str(exc).split())[:300]))
            for c in cands[k:]:
                c.plan_s = time.perf_counter() - t1
            bar.advance()
    finally:
        if progress is None:
            bar.close()
    cands.sort(key=lambda c: (not c.fits, c.step_s if c.fits else c.memory, c.memory))
    return SearchResult(devices, dev, cap, cands, refused, time.perf_counter() - t0, len(work))


def _sub_mesh(dp: int, tp: int) -> Any:
    from spmdkit.strategies.strategy import parse_mesh

    return parse_mesh(f"dp={dp},tp={tp}")


def _auto(prog: Any, mesh: Any, pins: Mapping[str, Any] | None, device: Any, cost_text: str | None,
          nodes_of: int | None, time_limit: float) -> tuple[Any, Any]:
    from spmdkit.core.reshard import CostModel
    from spmdkit.cost.compute import cost_model
    from spmdkit.planner.auto import auto_plan

    cost = cost_model(mesh, device, nodes_of)
    if cost_text:
        cost = CostModel.parse(cost_text, mesh, base=cost)
    return auto_plan(prog, mesh, pins, cost=cost, time_limit=time_limit, device=device)


def _plan_preset_config(cfg: Config, name: str, mc: Any, device: Any, tokens: int, modes: Sequence[str], cap: int,
                        pins: Mapping[str, Any] | None, cost_text: str | None, nodes_of: int | None,
                        time_limit: float) -> list[Candidate]:
    from spmdkit.models.zoo import build_model
    from spmdkit.planner.pipeline import pp_cost_text
    from spmdkit.planner.planning import plan_model

    full_cost, cost_text = cost_text, pp_cost_text(cost_text, None)  # pp= times the sends only
    over = {"layers": mc.layers, "batch": mc.batch // cfg.microbatches, "seq": mc.seq}
    title = (f"{name}: {mc.arch}, {mc.layers} layers, hidden {mc.hidden}, seq {mc.seq}, batch {mc.batch}"
             + (f" as {cfg.microbatches} microbatches of {mc.batch // cfg.microbatches}" if cfg.pp > 1 else "")
             + f"; mesh {cfg.mesh_text}; {cfg.strategy}")
    info = None
    if cfg.strategy == "auto":
        model = build_model(mc.with_(**over), vocab_parallel_loss=cfg.tp > 1, check_rules=False)
        plan, info = _auto(model.program, _sub_mesh(cfg.dp, cfg.tp), pins, device, cost_text, nodes_of, time_limit)
        title += f" (HiGHS {info.status}, gap {info.gap:.2%}, solve {info.solve_s:.2f} s, realised {info.realized})"
    else:
        _model, plan, _ = plan_model(name, cfg.sub_mesh_text, cfg.strategy, over, dict(pins or {}), cost_text)
    plan = _recosted(plan, device, cost_text, nodes_of)
    if cfg.pp == 1:
        return _flat_candidates(cfg, plan, device, tokens, modes, cap, title, info)
    from spmdkit.planner.pipeline import parse_spec, split_layers

    counts = split_layers(mc.layers, parse_spec(cfg.pp, microbatches=cfg.microbatches))
    return _pipeline_candidates(cfg, plan, counts, device, tokens, modes, cap, title, full_cost, nodes_of, info)


def _plan_program_config(cfg: Config, prog: Any, device: Any, tokens: int | None, modes: Sequence[str], cap: int,
                         pins: Mapping[str, Any] | None, cost_text: str | None, nodes_of: int | None,
                         patterns: Any, time_limit: float) -> list[Candidate]:
    from spmdkit.planner.pipeline import pp_cost_text
    from spmdkit.planner.planning import plan_program

    cost_text = pp_cost_text(cost_text, None)  # no pipeline for a program: a pp= entry has nothing to time
    info = None
    title = f"mesh {cfg.mesh_text}; {cfg.strategy}"
    if cfg.strategy == "auto":
        plan, info = _auto(prog, _sub_mesh(cfg.dp, cfg.tp), pins, device, cost_text, nodes_of, time_limit)
        title += f" (HiGHS {info.status}, gap {info.gap:.2%}, solve {info.solve_s:.2f} s, realised {info.realized})"
    else:
        _p, plan = plan_program(prog, cfg.sub_mesh_text, cfg.strategy, dict(pins or {}), patterns, cost_text)
    plan = _recosted(plan, device, cost_text, nodes_of)
    return _flat_candidates(cfg, plan, device, tokens, modes, cap, title, info)


# -- output -------------------------------------------------------------------------------------------


def write_search(res: SearchResult, out: TextIO, top: int = 10) -> None:
    """The top fitting configurations as a table, then what was rejected and refused."""
    from spmdkit.outputs.report import fmt_bytes, fmt_time
    from spmdkit.outputs.tables import print_table

    rows = []
    for k, c in enumerate(res.fitting[:top]):
        cf = c.config
        rows.append([str(k + 1), f"{cf.dp}x{cf.tp}x{cf.pp}" + (f" m={cf.microbatches}" if cf.pp > 1 else ""),
                     cf.strategy, cf.recompute, fmt_time(c.step_s), f"{100 * c.mfu:.1f}%" if c.mfu else "-",
                     fmt_bytes(c.memory), fmt_time(c.comm_s)])
    n_fit = len(res.fitting)
    over = [c for c in res.candidates if not c.fits]
    print_table(f"Top {min(top, n_fit)} of {n_fit} configurations that fit in {fmt_bytes(res.memory_cap)} per device "
           f"({res.devices} x {res.device.name}; {res.plans} plans in {res.seconds:.1f} s)",
           ["#", "dp x tp x pp", "strategy", "recompute", "step", "MFU", "memory/device", "comm"], rows, out)
    if over:
        least = min(over, key=lambda c: c.memory)
        out.write(f"rejected over the memory cap: {len(over)} configurations (the smallest needs "
                  f"{fmt_bytes(least.memory)}: {least.config.label()})\n")
    if res.refused:
        out.write(f"not planned: {len(res.refused)} configurations\n")
        for cfg, why in res.refused[:8]:
            what = cfg.mesh_text + ("" if cfg.strategy == "*" else f" {cfg.strategy}")
            out.write(f"  {what}: {why[:160]}\n")
        if len(res.refused) > 8:
            out.write(f"  ... and {len(res.refused) - 8} more\n")


def search_json(res: SearchResult, top: int = 10) -> dict[str, Any]:
    return {"devices": res.devices, "device": res.device.name, "memory_cap": res.memory_cap,
            "seconds": res.seconds, "plans": res.plans, "fitting": len(res.fitting),
            "over_memory_cap": sum(1 for c in res.candidates if not c.fits),
            "top": [c.to_json() for c in res.fitting[:top]],
            "refused": [{**cfg.to_json(), "reason": why} for cfg, why in res.refused]}


def import_hf_program(class_name: str, config: Any, batch: int, seq: int, dtype: str = "float32") -> Any:
    """The training step of the HuggingFace model ``class_name`` (config: dict, JSON text or a
    config.json path) imported at ``batch`` x ``seq`` (no strategy: as the model computes)."""
    from spmdkit.models.hf import dtype_name
    from spmdkit.models.source import import_hf_checked

    prog, _model, _kw = import_hf_checked(class_name, config, batch, seq, dtype_name(dtype))
    return prog


# -- verification ------------------------------------------------------------------------------------------


def _tiny_of(arch: str, dropout: float = 0.0) -> str:
    return "tiny-llama" if arch == "llama" else "tiny-gpt-dropout" if dropout else "tiny-gpt2"


def verify_auto(plan: Any, model_name: str, cost_text: str | None = None, layers: int | None = None) -> dict[str, Any]:
    """``--verify`` of a searched plan: the plan's dist attrs of every tensor the tiny model of
    the same architecture shares with it (by name; not partial ones, not in-place outputs,
    which are held as the tensor they overwrite) annotated on that tiny model, planned by
    propagate on the same mesh and simulated against the unsharded step."""
    try:
        from spmdkit.sim.plan import simulate_plan
    except ImportError as exc:  # numpy missing
        raise ProgramError(f"--verify needs numpy (pip install 'spmdkit[sim]'): {exc}") from None
    from spmdkit.models.zoo import build_model, preset
    from spmdkit.planner.planning import parse_cost
    from spmdkit.planner.propagate import propagate

    cfg = preset(model_name)
    tiny = _tiny_of(cfg.arch, cfg.dropout)
    tcfg = preset(tiny)
    if layers:
        tcfg = tcfg.with_(layers=layers)
    vocab_parallel = any(op.rule == "c_softmax_with_cross_entropy" for op in plan.program.ops)
    tmodel = build_model(tcfg, vocab_parallel_loss=vocab_parallel, check_rules=False)
    tp = tmodel.program
    ann = {}
    for n, a in plan.attrs.items():
        t = tp.tensors.get(n)
        if t is None or t.inplace_of or a.partial or len(t.shape) != len(a.dims_mapping):
            continue
        ann[n] = a
    tplan = propagate(tp, plan.mesh, ann, parse_cost(cost_text, plan.mesh))
    held = sum(1 for n, a in ann.items() if tplan.attrs.get(n) == a)
    try:
        rep = simulate_plan(tplan)
    except ProgramError as exc:  # a piece not distributed as the plan says: a failed check, not bad input
        from spmdkit.sim.plan import SimReport

        rep = SimReport(0, [("simulation", " ".join(str(exc).split())[:300])])
    ok = rep.ok and held == len(ann)
    lines = [f"verify: {tiny} holding the searched plan's dist attrs of the {len(ann)} tensors it shares with it "
             f"({held} held as chosen), simulated on {tplan.mesh.size} ranks: {rep.checked} tensors compared with the "
             f"unsharded step (loss, every gradient, every update): "
             + ("all equal" if rep.ok else f"{len(rep.failures)} differ")]
    for name, what in rep.failures[:10]:
        lines.append(f"  {name}: {what}")
    return {"ok": ok, "model": tiny, "annotated": len(ann), "held": held, "checked": rep.checked,
            "failures": [list(f) for f in rep.failures], "loss": rep.loss, "text": "\n".join(lines)}


def verify_config(best: Candidate, model_name: str, cost_text: str | None = None) -> dict[str, Any]:
    """``--verify`` of the search's best configuration at tiny sizes: its strategy (or its
    searched dist attrs) on the tiny model of the same architecture, on its mesh (with pp, the
    pipeline check of :mod:`spmdkit.planner.pipeline`)."""
    cfg = best.config
    if cfg.strategy == "auto":
        return verify_auto(best.plan, model_name, cost_text)
    if cfg.pp > 1:
        from spmdkit.planner.pipeline import parse_spec, verify_pipeline

        return verify_pipeline(model_name, cfg.mesh_text, parse_spec(cfg.pp, microbatches=1), cfg.strategy)
    from spmdkit.planner.planning import verify_strategy

    return verify_strategy(model_name, cfg.mesh_text, cfg.strategy, cost_text)


__all__ = ["RECOMPUTE_MODES", "Candidate", "Config", "SearchResult", "factorizations", "hand_strategies",
           "import_hf_program", "parse_memory", "search_meshes", "search_json", "verify_auto",
           "verify_config", "write_search"]
