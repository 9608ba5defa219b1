"""``spmdkit plan --devices N``: the outer search's command.

The flags checked, the search run (:func:`spmdkit.planner.search.search_meshes`, the
library), its table printed and the best configuration's plan reported (text or JSON), with
``--verify`` the best one checked at tiny sizes (:func:`spmdkit.sim.verify_plan.verify_config`).
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from typing import Any, TextIO

from spmdkit.cli.batch import global_batch
from spmdkit.cli.checks import check_one_model, hf_source, parse_annotations, parse_tp_plan, program_source
from spmdkit.cli.common import (
    auto_time_limit,
    catalog_batch,
    check_moe_flags,
    export_plan_file,
    require_simulator,
    write_html,
)
from spmdkit.cli.request import PlanRequest
from spmdkit.core.errors import ProgramError, SpmdError
from spmdkit.models.source import load
from spmdkit.models.zoo import model_label, preset
from spmdkit.outputs.pipeline import bubble_line, pipeline_plan_json, write_pipeline
from spmdkit.outputs.progress import Progress
from spmdkit.outputs.recipe import check_recipe_target, recipe, recipe_warning, write_recipe
from spmdkit.outputs.report import fmt_bytes, plan_json, write_report
from spmdkit.outputs.search import search_json, write_search
from spmdkit.planner.bubble import BubbleHint, bubble_hint
from spmdkit.planner.pipeline import PipelineEstimate
from spmdkit.planner.pipeline_plan import pp_cost_text
from spmdkit.planner.planning import MAX_SIZE, parse_cost, parse_size
from spmdkit.planner.search import SearchResult, search_meshes
from spmdkit.planner.search_config import Candidate
from spmdkit.planner.search_space import LONG_SEQ, VIRTUAL, CpTrace
from spmdkit.program.ir import Program
from spmdkit.program.layers import layer_tags
from spmdkit.strategies.experts import moe_layers
from spmdkit.strategies.hf import data_inputs
from spmdkit.strategies.strategy import MAX_RANKS, parse_mesh, strategy_items


def run_devices(req: PlanRequest, out: TextIO) -> int:
    """``spmdkit plan --devices N``: the search's table, then the best plan's report."""
    n = parse_size("--devices", req.devices, MAX_RANKS)
    assert n is not None
    m = req.model
    _check_flags(req)
    limit = auto_time_limit(req.search.time_limit or "60")
    user = parse_annotations(req.annotate)
    layers = parse_size("--layers", req.layers, 1 << 20)
    g, micro = global_batch(req)  # --global-batch: the sequences per step; --micro-batch: per rank a micro-step
    batch = g if g is not None else parse_size("--batch", req.batch, MAX_SIZE)
    if m.hf is None and not m.program:  # a catalog model: whole sequences for every dp up to N
        batch = catalog_batch(m.model, n, batch)
    seq = parse_size("--seq", req.seq, MAX_SIZE)
    nodes = parse_size("--nodes-of", req.links.nodes_of, 1 << 20)
    model: str | Program
    reload = None
    if m.hf is not None:
        source = hf_source(m, layers, batch, seq, name_cut=True)
        loaded = load(source)
        model, what = loaded.program, loaded.title

        def reload(b: int, chunks: int, cp: CpTrace) -> Program:
            # a pipeline's microbatch (b sequences); etp=1's tp chunks; a cp mesh's token order (as plan_source)
            return load(replace(source, batch=b, tp_chunks=chunks, cp=cp)).program

    elif m.program:
        loaded = load(program_source(m, layers, batch, seq))
        model, what = loaded.program, loaded.title
    else:
        model, what = m.model, model_label(m.model)
    check_moe_flags(req.links.runtime(), bool(moe_layers(model)) if isinstance(model, Program) else
                    bool(preset(model).experts))  # before the search
    items = strategy_items(req.strategy)
    opts = [i for i in items if i.startswith(("cp-attention=", "cp-balance="))]
    if opts and "cp" not in items:  # (the search kept no mesh for a strategy of cp's options alone, and blamed the batch)
        k, _, v = opts[0].partition("=")
        raise ProgramError(f"--{k} {v}: context parallelism is not asked for; with --devices give cp in --strategy "
                           f"(e.g. --strategy dp,cp --{k} {v}: the search tries it on its cp meshes) or drop --{k}")
    if "cp" in {s.split("=")[0] for s in items} and 0 < (s := _seq_of(model, seq)) < LONG_SEQ:
        # (the search found nothing to plan, and said only what it refused for other reasons)
        raise ProgramError(f"--strategy {req.strategy}: the --devices search tries context parallelism from "
                           f"{LONG_SEQ} tokens, and the sequence is {s}; plan cp at it on a given mesh (--mesh with "
                           f"a cp dim)")
    patterns = parse_tp_plan(m.tp_plan)
    with Progress(f"plan --devices {n}", lines=True) as bar:  # a line on a terminal's stderr, a line a phase on a pipe
        res = search_meshes(model, n, req.links.device or "h100", req.search.memory, auto=req.search.auto,
                            strategies=[req.strategy] if req.strategy else None,
                            recompute=[req.recompute] if req.recompute else None,
                            overrides={"layers": layers, "batch": batch, "seq": seq} if isinstance(model, str) else None,
                            pins=user, cost_text=req.links.cost, time_limit=limit, nodes_of=nodes, patterns=patterns,
                            progress=bar, runtime=req.links.runtime(), reload=reload,
                            micro_batch=micro if micro is not None else (0 if g is not None else None))
    best = res.best
    flag = "--global-batch" if g is not None else "--batch"  # (the flag a hint of why_none names)
    if (flagged := flag_error(res)) is not None:  # every configuration refused the same flag
        raise ProgramError(flagged)
    verdict = None
    if req.verify and best is not None:
        if m.hf is not None and best.config.strategy == "auto":
            raise ProgramError("--verify: simulates a preset, catalog or --hf model's strategy; it does not apply to "
                               "the --auto plan of an --hf model")
        require_simulator()
        from spmdkit.sim.verify_plan import verify_config, verify_config_hf  # (needs numpy)

        if m.hf is not None and m.hf_config is not None:  # its strategy (its pipeline's split) at a tiny config
            verdict = verify_config_hf(best, m.hf, m.hf_config, patterns, pp_cost_text(req.links.cost, None),
                                       m.fallback or "error")
        else:
            verdict = verify_config(best, str(model), req.links.cost)
    if best is not None and req.search.memory is not None:  # the card and the text judge the search's cap
        best = _capped(best, res.memory_cap)
    what, *notes = what.split("\n")  # an HF title's warning and note lines stay below its first (as plan's)
    title = "\n".join([f"{what}; best of {n} devices: {best.title}" if best is not None else what, *notes])
    if best is not None:
        _write_files(req, res, best, title)
        if req.outputs.recipe is not None:
            kind, path = req.outputs.recipe
            got = recipe(best, what, _global_batch(model, batch, best), _seq_of(model, seq), _layers_of(model, layers))
            write_recipe(kind, path, got)
            note = recipe_warning(kind, got)
            if note is not None:
                print(f"spmdkit plan: warning: {note}", file=sys.stderr, flush=True)
    hint = bubble_hint(best.plan, best.estimate) if best is not None and isinstance(best.estimate, PipelineEstimate) \
        else None
    if req.outputs.json:
        why = why_none(res, n, batch if batch is not None else _batch_of(model), flag) if best is None else None
        return _write_json(res, best, title, verdict, out, hint, why)
    out.write("\n".join([f"{what} on {n} devices ({res.device.name})", *notes]) + "\n")
    write_search(res, out)
    if best is None:
        out.write(why_none(res, n, batch if batch is not None else _batch_of(model), flag) + "\n")
        return 1
    _write_best(best, out)
    if hint is not None:
        out.write(bubble_line(hint, _global_batch(model, batch, best)))
    if verdict is not None:
        out.write("\n" + verdict["text"] + "\n")
    return 0 if verdict is None or verdict["ok"] else 1


def _global_batch(model: str | Program, batch: int | None, best: Candidate) -> int:
    """The sequences a step of the best configuration trains."""
    if batch is not None:
        return batch
    got = _batch_of(model)
    return got if got is not None else best.config.dp * best.config.ep


def _seq_of(model: str | Program, seq: int | None) -> int:
    """``--seq``, else the model's: an --hf or --program model's the second axis of its data
    inputs (it wrote 0 into the recipe's seq_len / --seq-length), 0 where it has none."""
    if seq is not None:
        return seq
    if isinstance(model, Program):
        shapes = [model.tensors[n].shape for n in data_inputs(model) if len(model.tensors[n].shape) > 1]
        return shapes[0][1] if shapes else 0
    return preset(model).seq


def _layers_of(model: str | Program, layers: int | None) -> int:
    """``--layers``, else the model's: an --hf or --program model's its layer tags (not 0)."""
    if layers is not None:
        return layers
    if isinstance(model, Program):
        return len(layer_tags(model))
    return preset(model).layers


def _batch_of(model: str | Program) -> int | None:
    if isinstance(model, Program):
        return None
    try:
        return preset(model).batch
    except SpmdError:
        return None


def _refusal_kind(why: str) -> str:
    """What refused a factorisation: its batch, its --micro-batch, its heads, its layers, or ""
    (another reason)."""
    return "micro" if why.startswith("--micro-batch") else "batch" if "divide the batch" in why \
        or "global batch" in why else "heads" if "heads" in why else "layers" if "stages" in why else ""


def flag_error(res: SearchResult) -> str | None:
    """The one message of a flag (``--annotate``, ``--cp-attention``, ...) that refused every
    configuration the factorisations left, where nothing was planned: plan --mesh's refusal of
    the same flag, to be raised as it (exit 2), not a search with nothing to show."""
    if res.candidates or res.pruned:
        return None
    whys = [why for _c, why in res.refused if not _refusal_kind(why)]
    flags = {why.split(":")[0].split()[0] for why in whys}  # (--tp-comm-overlap's message names each tp)
    return whys[0] if len(flags) == 1 and whys[0].startswith("--") else None


def why_none(res: SearchResult, n: int, batch: int | None, batch_flag: str = "--batch") -> str:
    """Why no configuration of the search fits, in terms the user can act on: what refused the
    factorisations of ``n`` devices (a dp that does not divide the batch, with the batches and
    device counts that would do; a tp the heads refuse; more stages than layers), or every planned
    one over the memory cap (the least it needs). ``batch_flag``: the flag that gave the batch
    (``--global-batch``, where ``--batch`` does not go with it)."""
    over = [c for c in res.candidates if not c.fits]
    if over:
        least = min(over, key=lambda c: c.memory)
        # the cap as the table's header gives it ('fit in 7.45 GiB', a --memory 80 as '80 B'), not to a tenth of a
        # GiB ('fits in 7.5 GiB', '0.0 GiB')
        return (f"no configuration fits in {fmt_bytes(res.memory_cap)} per device: the least needs "
                f"{fmt_bytes(least.memory)} ({least.config.label()}); raise --memory, add devices, or "
                "shorten the model")
    kinds = {"batch": 0, "micro": 0, "heads": 0, "layers": 0}
    for _c, why in res.refused:
        k = _refusal_kind(why)
        if k:
            kinds[k] += 1
    parts = []
    if kinds["batch"] and batch is not None:
        devs = [d for d in range(max(1, n - n // 2), 2 * n + 1) if d != n and batch % d == 0][:3]
        dps = sorted({c.dp * c.ep for c, w in res.refused if "batch" in w})
        sizes = sorted({-(-batch // d) * d for d in dps if d > 1})[:3]
        parts.append(f"{kinds['batch']} have a data-parallel degree that does not divide the batch {batch} (each "
                     f"rank takes whole sequences): give {batch_flag} {' or '.join(map(str, sizes))}"
                     + (f", or --devices {' or '.join(map(str, devs))} (dividing {batch})" if devs else ""))
    if kinds["micro"] and batch is not None:  # (a --batch to give would not help: --micro-batch does not divide)
        ranks = {c.batch_ranks for c, w in res.refused if _refusal_kind(w) == "micro" and batch % c.batch_ranks == 0}
        fits = sorted({m for r in ranks for m in range(1, batch // r + 1) if (batch // r) % m == 0})[:4]
        parts.append(f"{kinds['micro']} whose data-parallel ranks x --micro-batch do not divide the global batch "
                     f"{batch}" + (f": give --micro-batch {' or '.join(map(str, fits))}" if fits else ""))
    if kinds["heads"]:
        parts.append(f"{kinds['heads']} a tp the attention heads do not divide")
    if kinds["layers"]:
        parts.append(f"{kinds['layers']} more pipeline stages than layers")
    if not parts:
        return "no configuration could be planned (see why above)"
    return f"no configuration of {n} devices: of the factorisations dp x tp x pp, " + "; ".join(parts)


def _check_flags(req: PlanRequest) -> None:
    """The flags that do not go with ``--devices`` (the search chooses the mesh and the
    pipeline), then the model's, then ``--cost`` (named before planning: dims dp, tp and pp,
    whose entry times the pipeline's sends)."""
    if req.mesh is not None:
        raise ProgramError("--devices: give either --mesh or --devices (the search chooses the mesh)")
    if req.model.vocab_divisible_by is not None:  # Megatron pads by N x tp: a vocabulary for each tp searched
        raise ProgramError(f"--make-vocab-size-divisible-by {req.model.vocab_divisible_by}: pads the vocabulary by N x "
                           f"tp of one mesh (--mesh); the --devices search tries several tp, each its own padded "
                           f"model, which it does not build: give the padded vocabulary in the config, or plan "
                           f"each --mesh")
    if req.outputs.recipe is not None:
        check_recipe_target(*req.outputs.recipe)
    for flag in [*req.pipeline.given(), *(["--grad-accum"] if req.grad_accum is not None else [])][:1]:
        raise ProgramError(f"{flag}: does not apply with --devices (the search chooses the pipeline: 1F1B or "
                           f"interleaved 1F1B over {' / '.join(map(str, VIRTUAL))} model chunks a rank, one sequence "
                           "per dp rank per microbatch; give --global-batch and --micro-batch for gradient "
                           "accumulation)")
    if req.search.explain:  # (it was accepted with --auto and explained nothing)
        raise ProgramError("--explain: applies to the --auto search of a --mesh (its layers' choices and runner-ups); "
                           "the --devices search does not explain its meshes' solves: plan the best mesh with --mesh "
                           "... --auto --explain")
    check_one_model(req.model)
    if req.verify and req.model.program:
        raise ProgramError("--verify: simulates a preset, catalog or --hf model's strategy; it does not apply to "
                           "--program")
    if req.model.tp_plan is not None and req.model.hf is None and not req.model.program:
        raise ProgramError("--tp-plan: applies to --hf or --program models (a preset has its own roles)")
    if req.links.cost:
        parse_cost(req.links.cost, parse_mesh("pp=2,dp=1,tp=1"))


def _write_json(res: SearchResult, best: Candidate | None, title: str, verdict: dict[str, Any] | None,
                out: TextIO, hint: BubbleHint | None = None, why: str | None = None) -> int:
    extra: dict[str, Any] = {"search": search_json(res)}
    if best is None:  # with why, the line the table's output ends with
        out.write(json.dumps({**extra, "why": why}) + "\n")
        return 1
    extra["title"] = title
    if verdict is not None:
        extra["verify"] = verdict
    est = best.estimate
    if isinstance(est, PipelineEstimate):  # a pp configuration
        extra["pipeline"] = est.to_json()
        extra["bubble_hint"] = hint.to_json() if hint is not None else None
        out.write(json.dumps(pipeline_plan_json(best.plan, est, best.memory_detail, extra)) + "\n")
    else:
        out.write(json.dumps(plan_json(best.plan, best.memory_detail, extra, est)) + "\n")
    return 0 if verdict is None or verdict["ok"] else 1


def _capped(best: Candidate, cap: int) -> Candidate:
    """``best`` with its estimate's device memory the search's ``--memory`` cap: the report's
    'memory: fits ...' line, the JSON's ``fits`` and the --html card's 'fits?' then judge the plan
    against the cap the search table judged it by, not the GPU's own memory (no time changes)."""
    est = best.estimate
    if isinstance(est, PipelineEstimate):
        return replace(best, estimate=replace(est, device_memory=cap))
    if est is None:
        return best
    return replace(best, estimate=replace(est, device=replace(est.device, memory_bytes=cap)))


#: The most other configurations the --html page compares with the best one.
MAX_ALTERNATIVES = 5


def _write_files(req: PlanRequest, res: SearchResult, best: Candidate, title: str) -> None:
    """``--export`` (the best plan's shardings; a pipeline configuration's stages too with torch, the
    other formats refused for one, as for ``--mesh``), then ``--html`` (the best configuration's
    page; the next fitting configurations without a pipeline as the plans to compare): a refused
    export leaves no page behind."""
    est = best.estimate
    if req.outputs.export and isinstance(est, PipelineEstimate):
        kind = req.outputs.export[0]
        if kind != "torch":
            raise ProgramError(f"--export {kind}: the best configuration ({best.config.label()}) is a pipeline (pp) "
                               "plan, which --export torch writes (its stages), not this format")
        export_plan_file(req, best.plan, best.config.recompute, (parse_mesh(best.config.mesh_text), est.spec, est.counts))
    else:
        export_plan_file(req, best.plan, best.config.recompute)
    others = [(c.config.label(), c.plan, c.memory) for c in res.fitting[1:]  # planned whole (a folded: a copy's plan)
              if c.plan is not None and c.config.pp == 1 and not c.folded][:MAX_ALTERNATIVES]
    if isinstance(est, PipelineEstimate):  # a pp configuration: its one microbatch on the device (as plan --mesh pp)
        write_html(req, best.plan, title, best.memory_detail, best.micro, mesh_text=best.config.mesh_text,
                   recompute=best.config.recompute, pipeline=est, auto=best.auto, alternatives=others)
    else:
        write_html(req, best.plan, title, best.memory_detail, est, mesh_text=best.config.mesh_text,
                   recompute=best.config.recompute, auto=best.auto, alternatives=others)


def _write_best(best: Candidate, out: TextIO) -> None:
    title = f"\nThe best: {best.config.label()}. {best.title}"
    est = best.estimate
    if isinstance(est, PipelineEstimate):  # a pp configuration
        write_report(best.plan, out, title + " (the plan of one microbatch on the stages' sub-mesh)",
                     best.memory_detail, best.plan_s)
        write_pipeline(est, out)
    else:
        write_report(best.plan, out, title, best.memory_detail, best.plan_s, est)


__all__ = ["run_devices"]
