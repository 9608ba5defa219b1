"""Planning a whole model: a preset, a program or a HuggingFace model on a mesh under a strategy.

:func:`plan_model` (a preset of :mod:`spmdkit.models.zoo`), :func:`plan_program` (a
:class:`spmdkit.program.ir.Program`, e.g. an imported one, under the strategies of
:mod:`spmdkit.strategies.hf`) and :func:`plan_hf` (a HuggingFace model imported, then
planned) return the plan of :func:`spmdkit.planner.propagate.propagate`, complete (its
gradient accumulation included). The arguments are plain Python values (texts as ``spmdkit
plan`` takes them); a bad one is a ProgramError naming the flag it comes from. The command
itself (argument parsing, printing) is :mod:`spmdkit.cli.plan`; ``--verify`` (the same strategy
on a tiny model, simulated) is :mod:`spmdkit.sim.verify_plan`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from typing import Any

from spmdkit.core.errors import ProgramError, SpmdError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.reshard import CostModel
from spmdkit.engine.memo import Recent
from spmdkit.models.hf import dtype_name
from spmdkit.models.source import Loaded, Preset, import_hf_checked, load_preset
from spmdkit.models.zoo import Model, ModelConfig, preset
from spmdkit.planner.propagate import propagate
from spmdkit.program.ir import Program
from spmdkit.program.plan import Plan
from spmdkit.strategies.context import config_for as cp_config
from spmdkit.strategies.context import cp_groups, hf_cp
from spmdkit.strategies.experts import config_for as ep_config
from spmdkit.strategies.experts import tp_chunks
from spmdkit.strategies.hf import annotate_program
from spmdkit.strategies.hf_program import optimizer_of
from spmdkit.strategies.hf_rewrite import megatron_program, mirror_forward_layouts, regroup_partial_sums
from spmdkit.strategies.strategy import annotate, parse_mesh, parse_strategy, user_attrs, zero3_storage

#: The most layers ``--layers`` takes: planning is linear in the ops (~30 per layer with its
#: backward and optimizer), and 512 is over six times the largest preset (llama-70b, 80).
MAX_LAYERS = 512
#: The largest ``--batch`` / ``--seq`` (2**31 - 1, the int32 range frameworks index with).
MAX_SIZE = (1 << 31) - 1


def clip_repr(text: str, n: int = 60) -> str:
    """``repr(text)``, cut after ``n`` characters (saying how long it was): for error messages."""
    return repr(text) if len(text) <= n else repr(text[:n]) + f"... ({len(text)} characters)"


def parse_size(flag: str, text: str | int | None, hi: int) -> int | None:
    """An ASCII decimal int in [1, hi] for ``flag`` (None when not given)."""
    if text is None:
        return None
    t = str(text).strip()
    if not (t.isascii() and t.isdigit() and len(t) <= 12):
        raise ProgramError(f"{flag} {clip_repr(str(text), 40)}: expected an integer from 1 to {hi}")
    v = int(t)
    if not 1 <= v <= hi:
        raise ProgramError(f"{flag} {v}: out of range (1 to {hi})")
    return v


def parse_cost(text: str | None, mesh: ProcessMesh) -> CostModel:
    """``--cost`` text -> a :class:`spmdkit.core.reshard.CostModel` on ``mesh`` (the default one without
    text); ProgramError naming ``--cost`` for a bad one."""
    if not text:
        return CostModel.default(mesh)
    if len(text) > 4096:
        raise ProgramError(f"--cost: {len(text)} characters (at most 4096)")
    try:
        cost = CostModel.parse(text, mesh)
    except SpmdError as exc:
        msg = str(exc)
        raise ProgramError(msg if msg.startswith("--cost") else f"--cost {clip_repr(text)}: {msg[:300]}") from None
    except (ZeroDivisionError, ValueError, OverflowError):
        raise ProgramError(f"--cost {clip_repr(text)}: latency and bandwidth must be finite numbers, the "
                           f"bandwidth > 0 (e.g. tp=5us/150GB)") from None
    for link in cost.links:
        a, b = link.alpha_s, link.beta_s_per_byte
        if not (math.isfinite(a) and a >= 0 and math.isfinite(b) and b > 0):
            raise ProgramError(f"--cost {clip_repr(text)}: latency and bandwidth must be finite numbers, the "
                               f"bandwidth > 0 (e.g. tp=5us/150GB)")
    return cost


class BuiltModels:
    """Presets built once for many plans (a search plans the same shallow copy of a model on
    hundreds of meshes): :class:`spmdkit.models.source.Loaded` by (preset name, its sizes, a
    vocab-parallel loss), the ``limit`` most recently used kept. A built model is only read by
    the strategies (annotate) and the propagation, which make new objects and change none of
    its program's ops or tensors (``tests/test_search_floor.py`` plans twice on one and checks
    the plans equal those on a fresh build), so one object serves every plan of a search."""

    def __init__(self, limit: int = 128, plans: int = 32) -> None:
        self.built: Recent[Loaded] = Recent(limit)
        #: the searcher's plans by what they were planned from (:meth:`plan`), the last ``plans`` kept
        self.plans: Recent[Any] = Recent(plans)

    def plan(self, key: tuple[Any, ...], make: Callable[[], Any]) -> Any:
        """``make()``, or what it made for ``key`` before (a frozen plan: the same shallow copy
        on the same mesh under the same strategy, asked for by two configurations)."""
        return self.plans.get(key, make)

    def load(self, name: str, cfg: ModelConfig, vocab_parallel_loss: bool) -> Loaded:
        return self.built.get((name, cfg, vocab_parallel_loss), lambda: load_preset(
            Preset(name, cfg.layers, cfg.batch, cfg.seq), cfg, vocab_parallel_loss))


def plan_model(model_name: str, mesh_text: str, strategy_text: str,
               overrides: Mapping[str, int | str | None] | None = None,
               user: dict[str, Any] | None = None, cost_text: str | None = None,
               progress: Callable[[int, int], None] | None = None, grad_accum: int = 1,
               models: BuiltModels | None = None) -> tuple[Model, Plan, float]:
    """(model, plan, seconds) for a preset on a mesh under a strategy (:func:`plan_preset`)."""
    loaded, plan, secs = plan_preset(model_name, mesh_text, strategy_text, overrides, user, cost_text, progress,
                                     grad_accum, models)
    assert loaded.model is not None  # a preset's
    return loaded.model, plan, secs


def plan_preset(model_name: str, mesh_text: str, strategy_text: str,
                overrides: Mapping[str, int | str | None] | None = None,
                user: dict[str, Any] | None = None, cost_text: str | None = None,
                progress: Callable[[int, int], None] | None = None,
                grad_accum: int = 1, models: BuiltModels | None = None) -> tuple[Loaded, Plan, float]:
    """(the loaded preset, its plan, seconds) on a mesh under a strategy, the model built by
    :func:`spmdkit.models.source.load_preset` (its loss vocab-parallel under megatron);
    ``overrides``: sizes (``--layers`` / ``--batch`` / ``--seq``); ``grad_accum``: the plan's
    gradient accumulation (``--grad-accum``); ``models``: built models to take it from (and
    keep it in) where one of the same sizes was built before (:class:`BuiltModels`)."""
    cfg = preset(model_name)
    mesh = parse_mesh(mesh_text)
    st = parse_strategy(strategy_text, mesh)
    if overrides:
        limits = {"layers": MAX_LAYERS, "batch": MAX_SIZE, "seq": MAX_SIZE}
        checked = {k: parse_size(f"--{k}", v, limits.get(k, MAX_SIZE)) for k, v in overrides.items()}
        cfg = cfg.with_(**{k: v for k, v in checked.items() if v is not None})
    cfg = cp_config(cfg, mesh, st)  # context parallel: built with cp_attention at the tokens' positions
    cfg = ep_config(cfg, mesh, st)  # ETP = 1 under sp: each sequence routed in tp chunks (Megatron's token path)
    t0 = time.perf_counter()
    vpl = "megatron" in st
    loaded = load_preset(Preset(model_name, cfg.layers, cfg.batch, cfg.seq), cfg, vocab_parallel_loss=vpl) \
        if models is None else models.load(model_name, cfg, vpl)
    assert loaded.model is not None
    cost = parse_cost(cost_text, mesh)  # a bad --cost refused before the strategy's notes are made
    try:
        ann = annotate(loaded.model, mesh, st, user)
    except ProgramError as e:  # a batch the data-parallel ranks do not divide: say it was not given
        if (overrides or {}).get("batch") is None and str(e).startswith(f"--batch {cfg.batch}:"):
            raise ProgramError(f"{e}; --batch not given: the model's own batch is {cfg.batch}") from None
        raise
    plan = propagate(loaded.program, mesh, ann, cost, progress=progress,
                     storage=zero3_storage(loaded.model.optimizer, ann, st), grad_accum=grad_accum,
                     groups=cp_groups(mesh, st))
    return loaded, plan, time.perf_counter() - t0


def plan_program(prog: Program, mesh_text: str, strategy_text: str | None, user: dict[str, Any] | None = None,
                 patterns: Any = None, cost_text: str | None = None, grad_accum: int = 1) -> tuple[Program, Plan]:
    """(program, plan) for an imported program (or a program JSON from one) under a strategy
    (:mod:`spmdkit.strategies.hf`): with megatron the program is a copy whose loss is
    vocab-parallel, and the plan is over that copy."""
    mesh = parse_mesh(mesh_text)
    st = parse_strategy(strategy_text or "none", mesh)
    cost = parse_cost(cost_text, mesh)
    if not st:  # no strategy: the user's annotations alone, as a program file always was
        return prog, propagate(prog, mesh, user_attrs(prog, mesh, user), cost, grad_accum=grad_accum)
    if "megatron" in st:
        prog = megatron_program(prog, patterns)
    ann = annotate_program(prog, mesh, st, user, patterns)
    storage = zero3_storage(optimizer_of(prog), ann, st)
    groups = cp_groups(mesh, st)  # cp: a gradient reduced over dp x cp at once
    plan = propagate(prog, mesh, ann, cost, storage=storage, grad_accum=grad_accum, groups=groups)
    regrouped = regroup_partial_sums(prog, plan)  # partial gradients summed before one reduction
    # megatron: a partial gradient all-reduced as its forward tensor is held, not scattered
    # (sequence parallel scatters the residual's gradients over tp on purpose)
    mirrored = mirror_forward_layouts(plan, [mesh.dim_index("tp")]) if "megatron" in st and "sp" not in st else {}
    if regrouped is not prog or mirrored:
        ann = {**ann, **mirrored}
        prog, plan = regrouped, propagate(regrouped, mesh, ann, cost, storage=storage, grad_accum=grad_accum,
                                          groups=groups)
    return prog, plan


def plan_hf(class_name: str, config: Any, mesh_text: str, strategy_text: str | None, dtype: str = "float32",
            batch: int = 2, seq: int = 16, user: dict[str, Any] | None = None, patterns: Any = None,
            cost_text: str | None = None, grad_accum: int = 1, fallback: str = "error",
            cp_layout: tuple[str, str] | None = None) -> tuple[Program, Any, dict[str, Any], Plan]:
    """(program, model, keyword inputs, plan) for the HuggingFace model ``class_name`` built
    from ``config`` (a dict, a JSON object text or a config.json path; :func:`spmdkit.models.hf.build`),
    its training step imported at ``batch`` x ``seq`` and planned on ``mesh_text`` under
    ``strategy_text`` (default megatron). The program is the one planned (with megatron, its
    loss made vocab-parallel); run it with ``torch_values(prog, model, (), kw)``. ``fallback``:
    ``"replicate"`` imports an op with no lowering as a replicated op (``--fallback replicate``).
    ``cp_layout``: (mesh text, strategy text) whose context parallelism the step is traced for
    (:func:`spmdkit.strategies.context.hf_cp`: the cp ranks' token order, ``cp_attention`` at
    their positions) where that is not the mesh it is planned on: a pipeline ``--verify``'s
    whole-batch reference, planned on one rank in the order its stages hold the tokens."""
    dt = dtype_name(dtype)
    b = parse_size("--batch", batch, MAX_SIZE)
    sq = parse_size("--seq", seq, MAX_SIZE)
    assert b is not None and sq is not None
    mesh = parse_mesh(mesh_text)
    st = parse_strategy(strategy_text or "megatron", mesh)  # refuse a bad mesh / strategy before importing
    cp = hf_cp(mesh, st, sq) if cp_layout is None else \
        hf_cp(parse_mesh(cp_layout[0]), parse_strategy(cp_layout[1], parse_mesh(cp_layout[0])), sq)
    prog, model, kw = import_hf_checked(class_name, config, b, sq, dt, fallback=fallback, cp=cp,
                                        tp_chunks=tp_chunks(mesh, st))
    prog, plan = plan_program(prog, mesh_text, strategy_text or "megatron", user, patterns, cost_text, grad_accum)
    return prog, model, kw, plan


__all__ = ["MAX_LAYERS", "MAX_SIZE", "BuiltModels", "clip_repr", "parse_cost", "parse_size", "plan_hf",
           "plan_model", "plan_preset", "plan_program"]
