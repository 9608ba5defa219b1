"""``spmdkit plan``: plan a model's training step on a mesh and print the report.

:func:`run_plan` takes the command's request (:class:`spmdkit.cli.request.PlanRequest`) and
goes one of four ways: ``--devices`` (the outer search, :mod:`spmdkit.cli.devices`), a
pipeline (:mod:`spmdkit.cli.pipeline`), ``--auto`` (the searched shardings) or a strategy.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from typing import Any, TextIO

from spmdkit.cli.batch import resolve_mesh_batch
from spmdkit.cli.checks import check_one_model, hf_source, parse_annotations, parse_tp_plan, program_source
from spmdkit.cli.common import (
    auto_items,
    auto_json,
    auto_time_limit,
    block_recompute,
    catalog_batch,
    export_plan_file,
    mesh_dp,
    mesh_tp,
    plan_source,
    require_simulator,
    step_estimate,
    strategy_notes,
    warn_idle_dims,
    write_html,
)
from spmdkit.cli.devices import run_devices
from spmdkit.cli.pipeline import run_pipeline_plan, wants_pipeline
from spmdkit.cli.request import PlanRequest
from spmdkit.core.errors import ProgramError, SpmdError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.reshard import CostModel
from spmdkit.cost.devices import Device, cost_model, load_device
from spmdkit.cost.memory import check_recompute, memory_per_device
from spmdkit.engine.memo import gc_paused
from spmdkit.models.source import HFModel, ModelSource, Preset, ProgramFile, load, load_preset, pad_vocab, padding_note
from spmdkit.models.zoo import model_label
from spmdkit.outputs.export import check_target
from spmdkit.outputs.html import check_html_path
from spmdkit.outputs.progress import Progress
from spmdkit.outputs.report import explain_table, plan_json, write_report
from spmdkit.outputs.tables import fitted, terminal_width
from spmdkit.planner.auto import auto_plan
from spmdkit.planner.planning import MAX_LAYERS, MAX_SIZE, parse_cost, parse_size
from spmdkit.planner.search import parse_memory
from spmdkit.strategies.context import auto_config as auto_cp_config
from spmdkit.strategies.context import hf_cp
from spmdkit.strategies.strategy import parse_mesh, parse_strategy, tp_comm_overlap_problem


def run_plan(req: PlanRequest, out: TextIO) -> int:
    """Plan and print; a bad argument or program file is one line on stderr naming it and
    exit status 2 (no traceback); 1 when ``--verify`` finds a difference."""
    try:
        with strategy_notes("plan"):
            req.model.check_config()
            runtime = req.links.runtime()  # a bad --precision / --framework named before planning
            check_recompute(req.recompute or "none", True, runtime.framework)  # (full:K: megatron's; every:N: torchtitan's)
            if req.links.device:  # and fp8 on a GPU without fp8 tensor cores
                load_device(str(req.links.device)).check_precision(runtime.precision)
            devices = req.devices is not None
            for flag, given in (("--memory", req.search.memory is not None), ("--explain", req.search.explain),
                                ("--auto-time-limit", req.search.time_limit is not None)):
                if given and not req.search.auto and not (flag == "--memory" and devices):
                    where = {"--memory": " and --devices", "--explain": " of a --mesh"}.get(
                        flag, " (with or without --devices)")
                    raise ProgramError(f"{flag}: applies to the --auto search{where}; give --auto too")
            if req.outputs.html:
                check_html_path(req.outputs.html)  # before planning
            if req.outputs.export:  # a bad format or folder refused before planning
                check_target(*req.outputs.export)
            if runtime.ep_comm_overlap and devices:
                raise ProgramError("--ep-comm-overlap: applies to one plan (--mesh with ep, with or without pp); the "
                                   "--devices search does not choose it")
            if runtime.tp_comm_overlap and runtime.framework == "torchtitan" and not runtime.compile:
                # torchtitan 820504e parallelize_llama: 'Async TP requires --training.compile' (a RuntimeError)
                raise ProgramError("--tp-comm-overlap with --framework torchtitan: torch's async TP runs only "
                                   "compiled (torchtitan raises 'Async TP requires --training.compile'); give "
                                   "--compile too")
            if runtime.tp_comm_overlap and not devices and not req.search.auto:
                _check_tp_comm_overlap(req)
            for flag, given in (("--no-p2p-overlap", not runtime.p2p_overlap),
                                ("--pp-scatter-gather", runtime.pp_scatter_gather)):
                if given and not devices and not wants_pipeline(req):  # (accepted before, and changed nothing)
                    raise ProgramError(f"{flag}: applies to a pipeline's stage-to-stage sends; --mesh "
                                       f"{req.mesh_text} has no pp dim")
            if runtime.pp_scatter_gather and not devices and _tp_ranks(req.mesh_text) == 1:
                # (accepted before, and changed nothing: no tp rank to send a share; stage_costs.scattered)
                raise ProgramError(f"--pp-scatter-gather: each tp rank sends 1/tp of a pipeline tensor; --mesh "
                                   f"{req.mesh_text} has no tp dim of more than one rank")
            if req.outputs.recipe is not None and not devices:
                raise ProgramError("--export-recipe: applies to --devices (the search's best recipe); give --devices N")
            width = None if req.outputs.json else terminal_width(out, req.outputs.wide)
            with fitted(out, width) as fout:
                if devices:  # the outer search: cli/devices.py
                    return run_devices(req, fout)
                return _plan_one(resolve_mesh_batch(req), fout)  # --global-batch / --micro-batch resolved
    except SpmdError as exc:
        msg = " ".join(str(exc).split())
        if req.strategy is None and msg.startswith("--strategy megatron: the mesh has no 'tp' dim"):
            msg += "; --strategy not given: the default is megatron (give one for a mesh without tp, e.g. --strategy dp)"
        if len(msg) > 500:
            msg = msg[:500] + "..."
        print(f"spmdkit plan: {type(exc).__name__}: {msg}", file=sys.stderr)
        return 2


def _tp_ranks(mesh_text: str) -> int:
    """The ranks of the mesh's ``tp`` dim (1 without one)."""
    mesh = parse_mesh(mesh_text)
    return mesh.dim_size("tp") if "tp" in mesh.dim_names else 1


def _check_tp_comm_overlap(req: PlanRequest) -> None:
    """``--tp-comm-overlap`` with a strategy it cannot overlap
    (:func:`~spmdkit.strategies.strategy.tp_comm_overlap_problem`): a ProgramError (a --program
    file's strategy, none by default, is its own: not judged)."""
    if req.model.program and req.strategy is None:
        return
    mesh = parse_mesh(req.mesh_text)
    text = req.strategy or "megatron"
    why = tp_comm_overlap_problem(parse_strategy(text, mesh), text, dict(zip(mesh.dim_names, mesh.shape)).get("tp", 1))
    if why is not None:
        raise ProgramError(why)


@gc_paused
def _plan_one(req: PlanRequest, out: TextIO) -> int:
    """One plan, flat or a pipeline (a ``pp`` mesh dim: cli/pipeline.py, planner/pipeline.py), with
    the cyclic garbage collector paused from the model's build to the last line written
    (:func:`spmdkit.engine.memo.gc_paused`): the stages' costing, the memory model and the
    ``--json`` encoding allocate hundreds of thousands of containers that live on, and each burst
    otherwise walks the whole heap (with the memo tables of the plans before it in a long-lived
    process), about half of a 100-layer pipeline's planning time."""
    if wants_pipeline(req):
        if req.outputs.export and req.outputs.export[0] != "torch":
            raise ProgramError(f"--export {req.outputs.export[0]}: does not apply to a pipeline (pp) "
                               f"plan (--export torch does)")
        return run_pipeline_plan(req, out)
    return _run_plan(req, out)


# -- the model's flags -----------------------------------------------------------------------------


def _strategy_source(req: PlanRequest, layers: int | None, batch: int | None,
                     seq: int | None) -> tuple[ModelSource, dict[str, str] | None]:
    """The model planned under a strategy, and the ``--tp-plan`` patterns."""
    m = req.model
    check_one_model(m)
    patterns = parse_tp_plan(m.tp_plan)
    if patterns is not None and m.hf is None and not m.program:
        raise ProgramError("--tp-plan: applies to --hf or --program models (a preset has its own roles)")
    if m.hf is not None:
        return hf_source(m, layers, batch, seq), patterns
    if m.program:
        source = program_source(m, layers, batch, seq)
        if req.verify:
            raise ProgramError("--verify: simulates a preset model; it does not apply to --program")
        return source, patterns
    return Preset(m.model, layers, batch, seq, vocab_divisible_by=m.vocab_divisible_by), patterns


# -- under a strategy ------------------------------------------------------------------------------


def _run_plan(req: PlanRequest, out: TextIO) -> int:
    recompute = check_recompute(req.recompute or "none")
    user = parse_annotations(req.annotate)
    layers = parse_size("--layers", req.layers, MAX_LAYERS)
    batch = parse_size("--batch", req.batch, MAX_SIZE)
    seq = parse_size("--seq", req.seq, MAX_SIZE)
    grad_accum = parse_size("--grad-accum", req.grad_accum, 1 << 20) or 1
    batch = catalog_batch(req.model.model, mesh_dp(req.mesh_text, req.strategy), batch)
    if req.search.auto:
        sizes = Preset(req.model.model, layers, batch, seq, vocab_divisible_by=req.model.vocab_divisible_by)
        return _run_auto(req, out, recompute, user, sizes, grad_accum)
    source, patterns = _strategy_source(req, layers, batch, seq)
    progress = _progress() if isinstance(source, Preset) else None
    loaded, plan, secs = plan_source(source, req.mesh_text, req.strategy, user, patterns, req.links.cost, progress,
                                     grad_accum)
    strategy = req.strategy or ("megatron" if not isinstance(source, ProgramFile) else None)
    warn_idle_dims(plan, strategy)
    first, *notes = loaded.title.split("\n")  # an HF title's warning and note lines stay below its first
    title = "\n".join([first + (f"; strategy {strategy}" if strategy else ""), *notes])
    config = loaded.model.config if loaded.model is not None else None
    recompute = block_recompute(plan.program, recompute)  # full:K / every:N: the model's first K / every N-th layers
    plan, est = step_estimate(req.links, plan, config, recompute)
    mem = memory_per_device(plan, recompute)
    export_plan_file(req, plan, recompute)
    verdict = None
    if req.verify:  # a preset's, or an HF model's at a tiny config (refused for --program above)
        require_simulator()
        from spmdkit.sim.verify_plan import verify_hf, verify_strategy  # (needs numpy)

        if isinstance(source, HFModel):
            verdict = verify_hf(source.class_name, source.config, req.mesh_text, strategy, patterns, req.links.cost,
                                fallback=source.fallback)
        else:
            verdict = verify_strategy(req.model.model, req.mesh_text, strategy or "megatron", req.links.cost)
    write_html(req, plan, title, mem, est, config, recompute=recompute)
    if req.outputs.json:
        extra: dict[str, Any] = {"title": title, "plan_seconds": secs}
        if verdict is not None:
            extra["verify"] = verdict
        out.write(json.dumps(plan_json(plan, mem, extra, est)) + "\n")
    else:
        write_report(plan, out, title, mem, secs, est)
        if verdict is not None:
            out.write("\n" + verdict["text"] + "\n")
    return 0 if verdict is None or verdict["ok"] else 1


def _progress() -> Any:
    """A rich progress bar on a terminal's stderr, else None."""
    if not sys.stderr.isatty():
        return None
    try:
        from rich.progress import Progress as RichProgress
    except ImportError:
        return None
    bar = RichProgress(transient=True)
    task = bar.add_task("propagating", total=1)
    bar.start()

    def cb(done: int, total: int) -> None:
        bar.update(task, completed=done, total=total)
        if done >= total:
            bar.stop()

    return cb


# -- --auto ----------------------------------------------------------------------------------------


def _auto_source(req: PlanRequest, sizes: Preset) -> ModelSource:
    """The model ``--auto`` searches: a preset, ``--program`` or ``--hf`` (no ``--tp-plan``)."""
    m = req.model
    tp = mesh_tp(req.mesh_text)  # --make-vocab-size-divisible-by: the vocabulary padded by N x tp (Megatron's)
    if m.hf is not None:
        return pad_vocab(hf_source(m, sizes.layers, sizes.batch, sizes.seq), tp)
    if m.program:
        return program_source(m, sizes.layers, sizes.batch, sizes.seq)
    return pad_vocab(sizes, tp)


def _auto_links(req: PlanRequest, mesh: ProcessMesh) -> tuple[Device | None, CostModel, int | None]:
    """``--device`` (its links, ``--cost`` on top, as :func:`step_estimate` times the plan),
    the cost model, and the memory cap (``--memory``, else the device's)."""
    links = req.links
    device = load_device(links.device) if links.device else None
    cost = parse_cost(links.cost, mesh)
    if device is not None:
        nodes = parse_size("--nodes-of", links.nodes_of, 1 << 20)
        device = replace(device, ranks_per_node=nodes) if nodes else device
        cost = cost_model(mesh, device, nodes)
        if links.cost:
            cost = CostModel.parse(links.cost, mesh, base=cost)
    cap = None if req.search.memory is None else parse_memory(req.search.memory)
    if cap is None and device is not None:
        cap = int(device.memory_bytes)
    return device, cost, cap


def _run_auto(req: PlanRequest, out: TextIO, recompute: str, user: dict[str, Any], sizes: Preset,
              grad_accum: int) -> int:
    """``--auto``: the searched plan of a preset, a --program file or an --hf model (planner/auto/);
    ``--verify``: a preset's plan checked on its tiny model (sim/verify_plan.verify_auto)."""
    m = req.model
    items = auto_items(req)
    check_one_model(m)
    if req.verify and (m.hf is not None or m.program):
        raise ProgramError(f"--verify: simulates a preset model; it does not apply to {'--hf' if m.hf else '--program'}")
    limit = auto_time_limit(req.search.time_limit or "60")
    mesh = parse_mesh(req.mesh_text)
    t0 = time.perf_counter()
    source = _auto_source(req, sizes)
    # on a cp mesh a preset is built with cp_attention, an --hf model imported for cp (the search then
    # splits the sequence over cp)
    cp_cfg = auto_cp_config(source.config() if isinstance(source, Preset) else None, mesh, items,
                            "--hf" if m.hf is not None else "--program" if m.program else None)
    if isinstance(source, HFModel):
        source = replace(source, cp=hf_cp(mesh, ["cp", *items], source.seq))
    # a preset with the vocab-parallel loss: its rule also takes the class axis whole (the plain loss)
    loaded = load_preset(source, cp_cfg, True) if isinstance(source, Preset) and cp_cfg is not None else \
        load(source, vocab_parallel_loss=True)
    config = loaded.model.config if loaded.model is not None else None
    title, *notes = loaded.title.split("\n")  # an HF title's note lines stay below its first
    if config is not None:
        title = (f"{model_label(m.model)}: {config.arch}, {config.layers} layers, hidden {config.hidden}, seq {config.seq}, "
                 f"batch {config.batch}")
    padded = padding_note(source) if isinstance(source, Preset) else None  # (an HF title has its own)
    notes += [padded] if padded else []
    device, cost, cap = _auto_links(req, mesh)
    with Progress("plan --auto") as bar:  # a line on a terminal's stderr, nothing on a pipe
        plan, info = auto_plan(loaded.program, mesh, user, cost, time_limit=limit, device=device, memory_cap=cap,
                               explain=req.search.explain,
                               progress=lambda phase, done, total: bar.update(done, total, phase), grad_accum=grad_accum)
    secs = time.perf_counter() - t0
    title += (f"; --auto: HiGHS {info.status}, gap {info.gap:.2%}, solve {info.solve_s:.2f} s, "
              f"{info.candidates} candidates, predicted {'compute + ' if device else ''}communication "
              f"{info.objective_s * 1e3:.3f} ms, realised {info.realized}, {info.merged_ops} ops merged, "
              f"{info.folded_layers} layers folded" + (f", memory cap {cap / 2**30:.2f} GiB" if cap else ""))
    title = "\n".join([title, *notes])
    recompute = block_recompute(plan.program, recompute)
    plan, est = step_estimate(req.links, plan, config, recompute)
    mem = memory_per_device(plan, recompute)
    export_plan_file(req, plan, recompute)  # before the page: a refused export leaves none behind
    write_html(req, plan, title, mem, est, config, recompute=recompute, auto=info)
    verdict = None
    if req.verify:
        require_simulator()
        from spmdkit.sim.verify_plan import verify_auto  # (needs numpy)

        verdict = verify_auto(plan, m.model, req.links.cost)
    if req.outputs.json:
        extra: dict[str, Any] = {"title": title, "plan_seconds": secs, "auto": auto_json(info, cap)}
        if verdict is not None:
            extra["verify"] = verdict
        out.write(json.dumps(plan_json(plan, mem, extra, est)) + "\n")
    else:
        write_report(plan, out, title, mem, secs, est)
        if info.explain:
            out.write("\n" + explain_table(info.explain) + "\n")
        if verdict is not None:
            out.write("\n" + verdict["text"] + "\n")
    return 0 if verdict is None or verdict["ok"] else 1


__all__ = ["run_plan"]
