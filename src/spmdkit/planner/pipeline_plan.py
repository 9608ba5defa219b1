"""A model planned for a pipeline (:mod:`spmdkit.planner.pipeline`): the plan of ONE microbatch's
step on the sub-mesh without ``pp``, whatever the model's source (:func:`plan_pipeline_source`: a
preset, an HF model, a program file), its layers and their split into stages
(:mod:`spmdkit.planner.pipeline_split`); its pipeline is then estimated by
:func:`spmdkit.planner.pipeline.estimate_pipeline`.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

from spmdkit.core.errors import ProgramError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.cost.compute import guess_tokens
from spmdkit.models.source import HFModel, Loaded, ModelSource, Preset, ProgramFile, load, load_preset
from spmdkit.models.zoo import Model, preset
from spmdkit.planner.auto import AutoInfo
from spmdkit.planner.auto.stage import StageSearch, auto_stage
from spmdkit.planner.pipeline_split import PipelineSpec, auto_counts, parse_spec, split_layers
from spmdkit.planner.planning import MAX_LAYERS, MAX_SIZE, parse_size, plan_preset, plan_program
from spmdkit.program.ir import Program
from spmdkit.program.layers import layer_tags
from spmdkit.program.plan import Plan
from spmdkit.strategies.context import auto_config as auto_cp_config
from spmdkit.strategies.context import hf_cp
from spmdkit.strategies.experts import tp_chunks
from spmdkit.strategies.strategy import parse_mesh, parse_strategy, strategy_items


def sub_mesh_text(mesh: ProcessMesh) -> tuple[int, str]:
    """(pp size, the mesh text without pp)."""
    names, sizes = list(mesh.dim_names), list(mesh.shape)
    pp = 1
    if "pp" in names:
        k = names.index("pp")
        pp = sizes[k]
        del names[k], sizes[k]
    if not names:
        names, sizes = ["dp"], [1]
    return pp, ",".join(f"{a}={b}" for a, b in zip(names, sizes))


@dataclass
class PipelinePlan:
    """A model planned for a pipeline: the plan of ONE microbatch's step on the sub-mesh
    without pp, the pipeline's spec, its layers and their split (None: layers that do not
    divide into the stages, balanced by :func:`spmdkit.planner.pipeline.estimate_pipeline` over the plan's costs)."""

    loaded: Loaded
    plan: Plan
    spec: PipelineSpec
    layers: int
    counts: tuple[int, ...] | None
    seconds: float
    #: tokens per step (every microbatch), None where the program has no token input
    tokens: int | None
    #: sequences per microbatch and per step
    microbatch: int | None = None
    batch: int | None = None
    #: the exact search's report where the stages' shardings are searched (``--auto``)
    auto: AutoInfo | None = None


def _no_layers(prog: Program, pp: int) -> ProgramError:
    labels = sorted({op.layer for op in prog.ops if op.phase == "forward"})
    return ProgramError(f"--mesh pp={pp}: the program has no numbered layers to cut into stages (a pipeline cuts "
                        f"between the groups of ops whose layer label ends in a number, e.g. 'layer 3' or "
                        f"'model.layers.3'; its labels: {', '.join(repr(x) for x in labels[:6]) or 'none'})")


def plan_pipeline_source(source: ModelSource, mesh_text: str, strategy_text: str | None, spec_args: dict[str, Any],
                         user: dict[str, Any] | None = None, cost_text: str | None = None,
                         patterns: Any = None, auto: StageSearch | None = None) -> PipelinePlan:
    """A pipeline of ``source`` on ``mesh_text`` (its ``pp`` dim): a preset (its sizes
    overridden as ``source`` says; without a batch each microbatch is the preset's batch), an
    HF model (``source.batch`` the whole step's, cut into the microbatches) or a program file
    (the step of one microbatch as it is). Each is cut into stages by its ops' layer labels
    (:func:`spmdkit.planner.pipeline_split.op_stages`), the same way. ``auto``: the stages' shardings chosen by the exact search
    on the sub-mesh (:func:`spmdkit.planner.auto.stage.auto_stage`, as the ``--devices`` search's
    ``auto`` configurations), ``strategy_text`` then only cp's options (``--cp-attention`` ...)."""
    t0 = time.perf_counter()
    mesh = parse_mesh(mesh_text)
    pp, sub = sub_mesh_text(mesh)
    spec = parse_spec(pp, **spec_args)
    m = spec.microbatches
    cost = pp_cost_text(cost_text, mesh)
    strategy = strategy_text or ("megatron" if not isinstance(source, ProgramFile) and auto is None else None)
    sm = parse_mesh(sub)
    info = None
    if isinstance(source, Preset):
        cfg = preset(source.name)
        layers = parse_size("--layers", source.layers, MAX_LAYERS) or cfg.layers
        given = parse_size("--batch", source.batch, MAX_SIZE)
        batch = given or cfg.batch * m  # without --batch, each microbatch is the preset's batch
        split_layers(layers, spec, balance=lambda n: (1,) * n)  # a bad --stages refused before planning
        _check_batch(batch, m)
        over = {"layers": layers, "batch": batch // m, "seq": source.seq, "vocab": source.vocab}  # (vocab: padded)
        if auto is not None:  # built as the --devices search builds an auto stage (planner/search.py):
            # on a cp sub-mesh with cp_attention, the loss vocab-parallel (the search splits it or not)
            built = auto_cp_config(cfg.with_(**{k: v for k, v in over.items() if v is not None}), sm,
                                   strategy_items(strategy_text), None)
            assert built is not None
            loaded = load_preset(replace(source, layers=layers, batch=built.batch), built, vocab_parallel_loss=True)
            plan, info = auto_stage(loaded.program, sm, user, auto, cost)
        else:
            with _microbatch_named(batch, m, given is not None):
                loaded, plan, _ = plan_preset(source.name, sub, strategy or "megatron", over, user, cost)
        assert loaded.model is not None
        c = loaded.model.config
        tokens: int | None = c.batch * c.seq * m
        mb: int | None = c.batch
    else:
        if isinstance(source, HFModel):
            _check_batch(source.batch, m)
            # a bad mesh / strategy before importing; --auto splits the sequence on any cp dim of 2 ranks or more
            st = ["cp"] if auto is not None else parse_strategy(strategy or "megatron", sm)
            # each microbatch traced as the flat plan traces the step: on a cp sub-mesh in the cp ranks' token
            # order with cp_attention (strategies.context.hf_cp); megatron,sp,ep,etp=1: each sequence routed one
            # chunk a tp rank (Megatron's token path)
            source = replace(source, batch=source.batch // m, cp=hf_cp(sm, st, source.seq), tp_chunks=tp_chunks(sm, st))
        if auto is not None:  # the refusals of a strategy or a cp mesh as the flat --auto gives them
            auto_cp_config(None, sm, strategy_items(strategy_text), "--hf" if isinstance(source, HFModel) else "--program")
        loaded = load(source)
        layers = len(layer_tags(loaded.program))
        if layers == 0:
            raise _no_layers(loaded.program, pp)
        split_layers(layers, spec, balance=lambda n: (1,) * n)
        if auto is not None:
            plan, info = auto_stage(loaded.program, sm, user, auto, cost)
        else:
            _prog, plan = plan_program(loaded.program, sub, strategy, user, patterns, cost)
        one = guess_tokens(plan.program)
        tokens = one * m if one else None
        mb = _batch_of(plan.program)
    even = layers % (spec.pp * spec.virtual) == 0
    counts = split_layers(layers, spec) if (even or spec.stages) and not spec.auto else None
    return PipelinePlan(loaded, plan, spec, layers, counts, time.perf_counter() - t0, tokens, mb,
                        mb * m if mb else None, info)


@contextmanager
def _microbatch_named(batch: int, m: int, given: bool = True) -> Iterator[None]:
    """A refusal of the microbatch's ``--batch batch / m`` (the preset is built at one microbatch)
    says it is the microbatch of the ``--batch`` the user gave (or, not ``given``, of the model's
    own batch a microbatch), over ``--microbatches``."""
    try:
        yield
    except ProgramError as e:
        if (m > 1 or not given) and str(e).startswith(f"--batch {batch // m}:"):
            what = f"--batch {batch} over --microbatches {m}" if given else \
                f"--batch not given: each of the {m} microbatches the model's own batch"
            raise ProgramError(f"{e} (a microbatch: {what}{_whole(e, batch, m, given)})") from None
        raise


def _whole(e: ProgramError, batch: int, m: int, given: bool) -> str:
    """Where ``e`` is :func:`spmdkit.strategies.experts.check_batch`'s refusal of the microbatch
    over its data-parallel ranks: the ``--microbatches`` (the most up to ``m`` that divide a
    ``given`` ``batch`` with whole sequences per rank) or ``--batch`` (``m`` microbatches of the
    least such size) that would do; else nothing."""
    got = re.search(r"needs a batch that is a multiple of ([0-9]+) ", str(e))
    if got is None:
        return ""
    r = int(got[1])
    fewer = [k for k in range(m - 1, 0, -1) if given and batch % k == 0 and (batch // k) % r == 0]
    more = m * r * -(-(batch // m) // r)
    return f"; whole sequences per rank: {f'--microbatches {fewer[0]} or ' if fewer else ''}--batch {more}"


def _check_batch(batch: int, m: int) -> None:
    if batch % m:
        raise ProgramError(f"--microbatches {m}: does not divide the batch {batch} "
                           f"(each microbatch is batch / microbatches sequences)")


def _batch_of(prog: Program) -> int | None:
    """Sequences per step of a program: the leading size of its token input."""
    for t in prog.tensors.values():
        if t.kind == "input" and (t.name in ("tokens", "input_ids") or (t.dtype in ("int64", "int32")
                                                                        and len(t.shape) == 2)):
            return t.shape[0]
    return None


def plan_pipeline(model_name: str, mesh_text: str, strategy_text: str, spec_args: dict[str, Any],
                  overrides: dict[str, Any] | None = None, user: dict[str, Any] | None = None,
                  cost_text: str | None = None) -> tuple[Model, Plan, PipelineSpec, tuple[int, ...], float]:
    """(model, plan of one microbatch on the sub-mesh, spec, layers per virtual stage, seconds)
    of the preset ``model_name`` (:func:`plan_pipeline_source`; layers that do not divide into
    the stages balanced by FLOPs)."""
    ov = dict(overrides or {})
    got = plan_pipeline_source(Preset(model_name, ov.get("layers"), ov.get("batch"), ov.get("seq")), mesh_text,
                               strategy_text, spec_args, user, cost_text)
    assert got.loaded.model is not None
    counts = got.counts or auto_counts(got.plan, got.spec.pp * got.spec.virtual)
    return got.loaded.model, got.plan, got.spec, counts, got.seconds


def pp_cost_text(cost_text: str | None, mesh: ProcessMesh | None) -> str | None:
    """``--cost`` without its ``pp=`` entry (that one times the sends: the ``pp_link`` of
    :func:`spmdkit.planner.pipeline.estimate_pipeline`)."""
    if not cost_text:
        return cost_text
    parts = [s for s in cost_text.split(",") if not s.strip().startswith("pp=") and s.strip()]
    return ",".join(parts) or None


__all__ = ["PipelinePlan", "plan_pipeline", "plan_pipeline_source", "pp_cost_text", "sub_mesh_text"]
