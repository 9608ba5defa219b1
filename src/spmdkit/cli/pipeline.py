"""``spmdkit plan`` with a pipeline: a ``pp`` mesh dim or the pipeline flags.

The command that plans, estimates and prints a pipeline (its flags, ``--microbatches``,
``--schedule``, ``--virtual-stages``, ``--stages`` and ``--microbatch-group``, are :mod:`spmdkit.cli.request`'s); the model of the pipeline itself
(stages, schedules, bubble, sends, memory) is the library module :mod:`spmdkit.planner.pipeline`.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any, TextIO

from spmdkit.cli.checks import check_one_model, hf_source, parse_annotations, parse_tp_plan, program_source
from spmdkit.cli.common import (
    auto_items,
    auto_json,
    auto_time_limit,
    catalog_batch,
    export_plan_file,
    mesh_dp,
    mesh_tp,
    require_simulator,
    step_estimate,
    warn_idle_dims,
    write_html,
)
from spmdkit.cli.request import Links, PlanRequest
from spmdkit.core.errors import ProgramError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.reshard import CostModel
from spmdkit.cost.devices import Device, cost_model, load_device
from spmdkit.cost.memory import check_recompute, per_microbatch_mode
from spmdkit.models.source import HFModel, ModelSource, Preset, ProgramFile, pad_vocab, padding_note
from spmdkit.models.zoo import model_label
from spmdkit.outputs.pipeline import bubble_line, pipeline_plan_json, write_pipeline
from spmdkit.outputs.report import explain_table, write_report
from spmdkit.planner.auto.stage import StageSearch, auto_title
from spmdkit.planner.bubble import bubble_hint
from spmdkit.planner.pipeline import estimate_pipeline
from spmdkit.planner.pipeline_plan import PipelinePlan, plan_pipeline_source, pp_cost_text, sub_mesh_text
from spmdkit.planner.pipeline_split import PipelineSpec, auto_counts, parse_spec
from spmdkit.planner.planning import MAX_LAYERS, MAX_SIZE, parse_cost, parse_size
from spmdkit.planner.schedules import interleaved_p2p_problem
from spmdkit.strategies.strategy import parse_mesh


def wants_pipeline(req: PlanRequest) -> bool:
    """True when the mesh names a ``pp`` dim or a pipeline flag is given."""
    if req.pipeline.given():
        return True
    return "pp" in parse_mesh(req.mesh_text).dim_names


def run_pipeline_plan(req: PlanRequest, out: TextIO) -> int:
    """``spmdkit plan`` with a ``pp`` mesh dim: a preset, a catalog model, ``--model-config``,
    ``--hf`` or ``--program``, each cut into stages by its layers
    (:func:`spmdkit.planner.pipeline_plan.plan_pipeline_source`)."""
    m = req.model
    check_one_model(m)
    full = parse_mesh(req.mesh_text)
    user = _sub_mesh_annotations(parse_annotations(req.annotate), full)
    parse_cost(req.links.cost, full)  # a bad --cost is named before planning
    p = req.pipeline
    spec_args = {"microbatches": p.microbatches, "schedule": p.schedule, "virtual": p.virtual_stages,
                 "stages": p.stages, "group": p.microbatch_group}
    spec = parse_spec(sub_mesh_text(full)[0], **spec_args)
    runtime = req.links.runtime()
    if spec.schedule == "interleaved" and (why := interleaved_p2p_problem(spec.pp, runtime.p2p_overlap,
                                                                          runtime.framework)) is not None:
        raise ProgramError(f"{why}: give pp of 3 or more, --schedule 1f1b, or drop --no-p2p-overlap")
    recompute = check_recompute(req.recompute or "none", pipeline=True)
    source = _source(req, spec.microbatches)
    if req.verify and isinstance(source, ProgramFile):
        raise ProgramError("--verify: simulates a preset, catalog or --hf model; it does not apply to --program")
    device = None
    if req.links.device:
        device = load_device(str(req.links.device))
        if req.links.nodes_of:
            device = replace(device, ranks_per_node=int(req.links.nodes_of))
        device = device.lockstep(full.size)  # every stage's GPUs step together
    got = plan_pipeline_source(source, req.mesh_text, req.strategy, spec_args, user, req.links.cost,
                               parse_tp_plan(m.tp_plan), _stage_search(req, device))
    full_links = replace(req.links, cost=pp_cost_text(req.links.cost, full))
    plan, _est = step_estimate(full_links, got.plan, None, per_microbatch_mode(recompute), timed=bool(req.outputs.html),
                               pipelined=True)
    est = estimate_pipeline(plan, spec, got.counts, device, _pp_link(req.links, full, device), got.tokens, full.size,
                            recompute=recompute)
    worst = max(range(spec.pp), key=lambda r: est.memory[r].device_total)
    strategy = req.strategy or ("megatron" if not isinstance(source, ProgramFile) and not got.auto else None)
    if not got.auto:
        warn_idle_dims(got.plan, strategy)  # the stages' sub-mesh (pp itself is the pipeline)
    title = (_title(got, source, spec) + (f"; strategy {strategy}" if strategy and not got.auto else "")
             + (f"; --auto{auto_title(got.auto)}" if got.auto else "") + f"; pipeline pp={spec.pp}"
             + (f"; recompute {req.recompute}" if req.recompute not in (None, "none") else ""))
    if isinstance(source, HFModel):  # the import's warning and note lines, below the first
        title = "\n".join([title, *got.loaded.title.split("\n")[1:]])
    padded = padding_note(source) if isinstance(source, Preset) else None  # (an HF title has its own)
    title += f"\n{padded}" if padded else ""
    config = got.loaded.model.config if got.loaded.model is not None else None
    if req.outputs.export:  # --export torch (cli/plan.py refuses the others); before the page: a refused
        # export leaves none behind
        export_plan_file(req, plan, recompute, (full, spec, got.counts or auto_counts(got.plan, spec.pp * spec.virtual)))
    write_html(req, plan, title, est.memory[worst], _est, config, pipeline=est, auto=got.auto)
    verdict = None
    if req.verify:
        require_simulator()
        from spmdkit.sim.verify_plan import verify_pipeline, verify_pipeline_hf  # (needs numpy)

        if isinstance(source, HFModel):
            verdict = verify_pipeline_hf(source.class_name, source.config, req.mesh_text, spec, strategy,
                                         parse_tp_plan(m.tp_plan), source.fallback, counts=est.counts)
        else:
            verdict = verify_pipeline(m.model, req.mesh_text, spec, strategy or "megatron", est.counts)
    hint = bubble_hint(plan, est)
    if req.outputs.json:
        extra: dict[str, Any] = {"title": title, "plan_seconds": got.seconds, "pipeline": est.to_json(),
                                 "bubble_hint": hint.to_json() if hint is not None else None}
        if verdict is not None:
            extra["verify"] = verdict
        if got.auto is not None:
            extra["auto"] = auto_json(got.auto, None)
        out.write(json.dumps(pipeline_plan_json(plan, est, est.memory[worst], extra)) + "\n")
    else:
        if est.note:
            out.write(est.note + "\n")
        first, sep, notes = title.partition("\n")  # (said of the first line, above an HF title's notes)
        write_report(plan, out, first + " (the plan of one microbatch on the stages' sub-mesh)" + sep + notes,
                     est.memory[worst], got.seconds)
        write_pipeline(est, out)
        if hint is not None:
            out.write(bubble_line(hint))
        if got.auto is not None and got.auto.explain:
            out.write("\n" + explain_table(got.auto.explain) + "\n")
        if verdict is not None:
            out.write("\n" + verdict["text"] + "\n")
    return 0 if verdict is None or verdict["ok"] else 1


def _stage_search(req: PlanRequest, device: Device | None) -> StageSearch | None:
    """``--auto`` on a pipeline: the stages' shardings searched on the sub-mesh without pp
    (:func:`spmdkit.planner.auto.stage.auto_stage`, as ``--devices --auto`` plans its pipelines);
    None without ``--auto``. ProgramError naming the flags that do not apply to it."""
    if not req.search.auto:
        return None
    auto_items(req)  # its --strategy and --tp-plan refusals (cp's options are checked with the model)
    if req.search.memory is not None:
        raise ProgramError("--memory: --auto on a pipeline (--mesh with pp) takes no cap: the search plans one "
                           "microbatch of the whole model, and a stage holds its own layers and the microbatches "
                           "in flight (the pipeline's memory is reported per stage; plan without pp for a capped search)")
    if req.verify:
        raise ProgramError("--verify: checks a flat --auto plan (its tiny model simulated); the stages of a pipeline "
                           "(--mesh with pp) planned by --auto are not simulated (give --strategy, or plan without pp)")
    nodes = parse_size("--nodes-of", req.links.nodes_of, 1 << 20)
    return StageSearch(device, nodes, auto_time_limit(req.search.time_limit or "60"), req.search.explain)


def _source(req: PlanRequest, microbatches: int) -> ModelSource:
    """The model the pipeline plans: ``--hf`` (the step's batch, ``--batch`` or
    :data:`~spmdkit.cli.request.HF_PIPELINE_BATCH` sequences per microbatch), ``--program`` (its
    step as one microbatch), else a preset, catalog model or ``--model-config`` with its sizes
    (without ``--batch`` each microbatch is a preset's batch, a catalog model's one sequence a dp
    rank: :func:`~spmdkit.cli.common.catalog_batch`)."""
    m = req.model
    layers = parse_size("--layers", req.layers, MAX_LAYERS)
    batch = parse_size("--batch", req.batch, MAX_SIZE)
    seq = parse_size("--seq", req.seq, MAX_SIZE)
    tp = mesh_tp(req.mesh_text)  # --make-vocab-size-divisible-by: the vocabulary padded by N x tp (Megatron's)
    if m.hf is not None:
        src = hf_source(m, layers, batch, seq)
        return pad_vocab(src if batch else replace(src, batch=src.batch * microbatches), tp)
    if m.program:
        return program_source(m, layers, batch, seq)
    if batch is None and (one := catalog_batch(m.model, mesh_dp(req.mesh_text, req.strategy), None)) is not None:
        batch = one * microbatches  # a catalog model without --batch: each microbatch one sequence a dp rank
    return pad_vocab(Preset(m.model, layers, batch, seq, vocab_divisible_by=m.vocab_divisible_by), tp)


def _title(got: PipelinePlan, source: ModelSource, spec: PipelineSpec) -> str:
    m = spec.microbatches
    if got.loaded.model is not None and isinstance(source, Preset):
        c = got.loaded.model.config
        return (f"{model_label(source.name)}: {c.arch}, {c.layers} layers, hidden "
                f"{c.hidden}, {c.heads} heads{f' ({c.n_kv} kv)' if c.n_kv != c.heads else ''}, FFN {c.ffn}, vocab "
                f"{c.vocab}, seq {c.seq}, batch {c.batch * m} as {m} microbatches of {c.batch}, {c.dtype}")
    if isinstance(source, HFModel):
        return (f"{source.class_name} (HuggingFace), {got.layers} layers, batch {got.batch} as {m} microbatches of "
                f"{got.microbatch}, seq {source.seq}, {source.dtype}")
    return f"{got.loaded.title}, {got.layers} layers, {m} microbatches of its step"


def _sub_mesh_annotations(user: dict[str, Any], mesh: ProcessMesh) -> dict[str, Any]:
    """``--annotate`` dims_mappings name the dims of the full mesh; the plan is on the mesh
    without pp: the dims after pp move down by one, and pp itself cannot shard a tensor."""
    if "pp" not in mesh.dim_names:
        return user
    k = mesh.dim_index("pp")

    def one(name: str, e: int) -> int:
        if e == k:
            raise ProgramError(f"--annotate {name[:60]}: mesh dim {k} is pp; a tensor cannot be sharded over "
                               f"the pipeline dim (each stage holds its layers whole)")
        return e - 1 if e > k else e

    return {n: [[one(n, x) for x in e] if isinstance(e, list) else one(n, e) for e in dm] for n, dm in user.items()}


def _pp_link(links: Links, mesh: ProcessMesh, device: Device | None) -> tuple[float, float]:
    """The pp mesh dim's link: (latency, seconds per byte) of the pipeline's sends."""
    nodes = links.nodes_of
    cost = cost_model(mesh, device, int(nodes) if nodes else None)
    if links.cost:
        cost = CostModel.parse(links.cost, mesh, base=cost)
    if "pp" not in mesh.dim_names:
        return (0.0, 0.0)
    link = cost.links[mesh.dim_index("pp")]
    return link.alpha_s, link.beta_s_per_byte


__all__ = ["run_pipeline_plan", "wants_pipeline"]
