"""``spmdkit plan --devices N``: the outer search's command.

The flags checked, the search run (:func:`spmdkit.planner.search.search_meshes`, the
library), its table printed and the best configuration's plan reported (text or JSON), with
``--verify`` the best one checked at tiny sizes (:func:`spmdkit.sim.verify_plan.verify_config`).
"""

from __future__ import annotations

import argparse
import json
from typing import Any, TextIO

from spmdkit.core.errors import ProgramError
from spmdkit.cost.step import StepEstimate
from spmdkit.outputs.pipeline import write_pipeline
from spmdkit.outputs.progress import Progress
from spmdkit.outputs.search import search_json, write_search
from spmdkit.planner.pipeline import PipelineEstimate
from spmdkit.planner.search import Candidate, import_hf_program, search_meshes


def run_devices(ns: argparse.Namespace, out: TextIO) -> int:
    """``spmdkit plan --devices N``: the search's table, then the best plan's report."""
    from spmdkit.cli.plan import parse_annotations, parse_tp_plan, require_simulator
    from spmdkit.planner.planning import MAX_SIZE, parse_cost, parse_size
    from spmdkit.strategies.strategy import MAX_RANKS

    n = parse_size("--devices", ns.devices, MAX_RANKS)
    assert n is not None
    if ns.mesh is not None:
        raise ProgramError("--devices: give either --mesh or --devices (the search chooses the mesh)")
    for flag, key in (("--microbatches", "microbatches"), ("--schedule", "schedule"),
                      ("--virtual-stages", "virtual_stages"), ("--stages", "stages"), ("--grad-accum", "grad_accum")):
        if getattr(ns, key, None) is not None:
            raise ProgramError(f"{flag}: does not apply with --devices (the search chooses the pipeline: 1F1B, "
                               "one sequence per dp rank per microbatch)")
    hf = getattr(ns, "hf", None)
    if hf is not None and ns.program:
        raise ProgramError("--hf: give either --hf or --program, not both")
    if hf is None and getattr(ns, "hf_config", None) is not None:
        raise ProgramError("--hf-config: configures an --hf model; give --hf CLASS too")
    if getattr(ns, "tp_plan", None) is not None and hf is None and not ns.program:
        raise ProgramError("--tp-plan: applies to --hf or --program models (a preset has its own roles)")
    if ns.cost:  # named before planning: dims dp, tp and pp (its entry times the pipeline's sends)
        from spmdkit.strategies.strategy import parse_mesh

        parse_cost(ns.cost, parse_mesh("pp=2,dp=1,tp=1"))
    limit = auto_time_limit(ns)
    user = parse_annotations(ns.annotate)
    layers = parse_size("--layers", ns.layers, 1 << 20)
    batch = parse_size("--batch", ns.batch, MAX_SIZE)
    seq = parse_size("--seq", ns.seq, MAX_SIZE)
    nodes = parse_size("--nodes-of", getattr(ns, "nodes_of", None), 1 << 20)
    mem = getattr(ns, "memory", None)
    device = getattr(ns, "device", None) or "h100"
    model: Any
    if hf is not None:
        if ns.hf_config is None:
            raise ProgramError(f"--hf {hf[:40]!r}: needs --hf-config FILE|JSON (the model's config)")
        if layers is not None:
            raise ProgramError("--layers: does not apply to --hf (set num_hidden_layers in --hf-config)")
        model = import_hf_program(hf, ns.hf_config, batch or 2, seq or 16, getattr(ns, "dtype", "float32"))
        what = f"{hf} (HuggingFace), batch {batch or 2}, seq {seq or 16}"
    elif ns.program:
        given = [f for f, v in (("--layers", layers), ("--batch", batch), ("--seq", seq)) if v is not None]
        if given:
            raise ProgramError(f"{given[0]}: overrides a preset's size; it does not apply to --program")
        from spmdkit.program.ir import load_program

        model = load_program(ns.program)
        what = f"program {ns.program}"
    else:
        model = ns.model
        what = ns.model
    patterns = parse_tp_plan(getattr(ns, "tp_plan", None))
    with Progress(f"plan --devices {n}") as bar:  # a line on a terminal's stderr, nothing on a pipe
        res = search_meshes(model, n, device, mem, auto=bool(getattr(ns, "auto", False)),
                            strategies=[ns.strategy] if ns.strategy else None,
                            recompute=[ns.recompute] if getattr(ns, "recompute", None) else None,
                            overrides={"layers": layers, "batch": batch, "seq": seq} if isinstance(model, str) else None,
                            pins=user, cost_text=ns.cost, time_limit=limit, nodes_of=nodes, patterns=patterns,
                            progress=bar)
    best = res.best
    verdict = None
    if ns.verify and best is not None:
        if not isinstance(model, str):
            raise ProgramError("--verify: simulates a preset model; it does not apply to --hf or --program")
        require_simulator()
        from spmdkit.sim.verify_plan import verify_config

        verdict = verify_config(best, model, ns.cost)
    if best is not None:
        _write_files(ns, res, best, f"{what}; best of {n} devices: {best.title}")
    if ns.json:
        from spmdkit.outputs.report import plan_json

        extra: dict[str, Any] = {"search": search_json(res)}
        if best is None:
            out.write(json.dumps(extra) + "\n")
            return 1
        extra["title"] = f"{what}; best of {n} devices: {best.title}"
        if verdict is not None:
            extra["verify"] = verdict
        if best.config.pp > 1:
            extra["pipeline"] = best.estimate.to_json()
            out.write(json.dumps(plan_json(best.plan, best.memory_detail, extra)) + "\n")
        else:
            assert isinstance(best.estimate, StepEstimate)
            out.write(json.dumps(plan_json(best.plan, best.memory_detail, extra, best.estimate)) + "\n")
    else:
        out.write(f"{what} on {n} devices ({res.device.name})\n")
        write_search(res, out)
        if best is None:
            out.write("no configuration fits: raise --memory, add devices, or shorten the model\n")
            return 1
        _write_best(best, out)
        if verdict is not None:
            out.write("\n" + verdict["text"] + "\n")
    return 0 if verdict is None or verdict["ok"] else 1


#: The most other configurations the --html page compares with the best one.
MAX_ALTERNATIVES = 5


def _write_files(ns: argparse.Namespace, res: Any, best: Candidate, title: str) -> None:
    """``--html`` (the best configuration's page; the next fitting configurations without a
    pipeline as the plans to compare) and ``--export`` (the best plan's shardings; a pipeline
    configuration is refused, as for ``--mesh``)."""
    from spmdkit.cli.plan import export_plan_file, write_html

    if getattr(ns, "export", None) and best.config.pp > 1:
        raise ProgramError(f"--export: the best configuration ({best.config.label()}) is a pipeline (pp) plan; "
                           "--export does not apply to one yet (give --mesh without pp)")
    others = [(c.config.label(), c.plan) for c in res.fitting[1:]
              if c.plan is not None and c.config.pp == 1][:MAX_ALTERNATIVES]
    if best.config.pp > 1:
        write_html(ns, best.plan, title, best.memory_detail, None, mesh_text=best.config.mesh_text,
                   recompute=best.config.recompute, pipeline=best.estimate, auto=best.auto, alternatives=others)
    else:
        write_html(ns, best.plan, title, best.memory_detail, best.estimate, mesh_text=best.config.mesh_text,
                   recompute=best.config.recompute, auto=best.auto, alternatives=others)
    export_plan_file(ns, best.plan)


def _write_best(best: Candidate, out: TextIO) -> None:
    from spmdkit.outputs.report import write_report

    title = f"\nThe best: {best.config.label()}. {best.title}"
    if isinstance(best.estimate, PipelineEstimate):
        write_report(best.plan, out, title + " (the plan of one microbatch on the stages' sub-mesh)",
                     best.memory_detail, best.plan_s)
        write_pipeline(best.estimate, out)
    else:
        write_report(best.plan, out, title, best.memory_detail, best.plan_s, best.estimate)


def auto_time_limit(ns: argparse.Namespace) -> float:
    from spmdkit.planner.planning import clip_repr

    text = getattr(ns, "auto_time_limit", None) or "60"
    try:
        limit = float(text)
    except ValueError:
        raise ProgramError(f"--auto-time-limit: {clip_repr(str(text))} is not a number of seconds") from None
    if not 0 < limit <= 86400:
        raise ProgramError(f"--auto-time-limit: {limit:g} is not between 0 and 86400 seconds")
    return limit


__all__ = ["auto_time_limit", "run_devices"]
