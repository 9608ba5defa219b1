"""``spmdkit plan`` with a pipeline: a ``pp`` mesh dim or the pipeline flags.

The flags (``--microbatches``, ``--schedule``, ``--virtual-stages``, ``--stages``), the
command that plans, estimates and prints a pipeline; the model of the pipeline itself
(stages, schedules, bubble, sends, memory) is the library module :mod:`spmdkit.planner.pipeline`.
"""

from __future__ import annotations

import argparse
import json
from typing import Any, TextIO

from spmdkit.core.errors import ProgramError
from spmdkit.cost.devices import cost_model, load_device
from spmdkit.outputs.pipeline import write_pipeline
from spmdkit.planner.pipeline import estimate_pipeline, plan_pipeline, pp_cost_text


def add_pipeline_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--microbatches", metavar="M",
                   help="pipeline (a pp mesh dim): microbatches per step (batch / M each; gradients accumulated)")
    p.add_argument("--schedule", help="pipeline schedule: gpipe, 1f1b (default) or interleaved")
    p.add_argument("--virtual-stages", dest="virtual_stages", metavar="V",
                   help="interleaved 1F1B: model chunks per device (default 2 with --schedule interleaved)")
    p.add_argument("--stages", metavar="N,N,...",
                   help="layers per (virtual) stage, in order, e.g. 20,20,20,20 (default: an even split)")


def wants_pipeline(ns: argparse.Namespace) -> bool:
    """True when the mesh names a ``pp`` dim or a pipeline flag is given."""
    if any(getattr(ns, k, None) is not None for k in ("microbatches", "schedule", "virtual_stages", "stages")):
        return True
    from spmdkit.strategies.strategy import parse_mesh

    return "pp" in parse_mesh(ns.mesh).dim_names


def run_pipeline_plan(ns: argparse.Namespace, out: TextIO) -> int:
    """``spmdkit plan`` with a ``pp`` mesh dim (preset models)."""
    from spmdkit.cli.plan import parse_annotations, require_simulator, step_estimate, write_html
    from spmdkit.cost.memory import check_recompute
    from spmdkit.outputs.report import plan_json, write_report
    from spmdkit.planner.planning import parse_cost
    from spmdkit.strategies.strategy import parse_mesh

    if getattr(ns, "hf", None) is not None or ns.program:
        raise ProgramError("--mesh pp / --microbatches: pipeline planning applies to preset models (--model), "
                           "not --hf or --program")
    full = parse_mesh(ns.mesh)
    user = _sub_mesh_annotations(parse_annotations(ns.annotate), full)
    strategy = ns.strategy or "megatron"
    parse_cost(ns.cost, full)  # a bad --cost is named before planning
    spec_args = {"microbatches": ns.microbatches, "schedule": ns.schedule, "virtual": ns.virtual_stages,
                 "stages": ns.stages}
    model, plan, spec, counts, secs = plan_pipeline(ns.model, ns.mesh, strategy, spec_args,
                                                    {"layers": ns.layers, "batch": ns.batch, "seq": ns.seq},
                                                    user, ns.cost)
    full_ns = argparse.Namespace(**vars(ns))
    full_ns.cost = pp_cost_text(ns.cost, full)
    plan, _est = step_estimate(full_ns, plan, None)
    device = None
    if getattr(ns, "device", None):
        from dataclasses import replace

        device = load_device(str(ns.device))
        if getattr(ns, "nodes_of", None):
            device = replace(device, ranks_per_node=int(ns.nodes_of))
    c = model.config
    tokens = c.batch * c.seq * spec.microbatches
    est = estimate_pipeline(plan, spec, counts, device, _pp_link(ns, full, device), tokens, full.size,
                            recompute=check_recompute(getattr(ns, "recompute", "none") or "none"))
    worst = max(range(spec.pp), key=lambda r: est.memory[r].total)
    title = (f"{ns.model}: {c.arch}, {c.layers} layers, hidden {c.hidden}, {c.heads} heads"
             f"{f' ({c.n_kv} kv)' if c.n_kv != c.heads else ''}, FFN {c.ffn}, vocab {c.vocab}, seq {c.seq}, "
             f"batch {c.batch * spec.microbatches} as {spec.microbatches} microbatches of {c.batch}, {c.dtype}; "
             f"strategy {strategy}; pipeline pp={spec.pp}"
             + (f"; recompute {ns.recompute}" if getattr(ns, "recompute", "none") not in (None, "none") else ""))
    write_html(ns, plan, title, est.memory[worst], _est, c, pipeline=est)
    verdict = None
    if ns.verify:
        require_simulator()
        from spmdkit.sim.verify_plan import verify_pipeline

        verdict = verify_pipeline(ns.model, ns.mesh, spec, strategy)
    if ns.json:
        extra: dict[str, Any] = {"title": title, "plan_seconds": secs, "pipeline": est.to_json()}
        if verdict is not None:
            extra["verify"] = verdict
        out.write(json.dumps(plan_json(plan, est.memory[worst], extra)) + "\n")
    else:
        write_report(plan, out, title + " (the plan of one microbatch on the stages' sub-mesh)",
                     est.memory[worst], secs)
        write_pipeline(est, out)
        if verdict is not None:
            out.write("\n" + verdict["text"] + "\n")
    return 0 if verdict is None or verdict["ok"] else 1


def _sub_mesh_annotations(user: dict[str, Any], mesh: Any) -> dict[str, Any]:
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


def _pp_link(ns: argparse.Namespace, mesh: Any, device: Any) -> tuple[float, float]:
    from spmdkit.core.reshard import CostModel

    nodes = getattr(ns, "nodes_of", None)
    cost = cost_model(mesh, device, int(nodes) if nodes else None)
    if ns.cost:
        cost = CostModel.parse(ns.cost, mesh, base=cost)
    if "pp" not in mesh.dim_names:
        return (0.0, 0.0)
    link = cost.links[mesh.dim_index("pp")]
    return link.alpha_s, link.beta_s_per_byte


__all__ = ["add_pipeline_arguments", "run_pipeline_plan", "wants_pipeline"]
