"""``spmdkit plan`` with a pipeline: a ``pp`` mesh dim or the pipeline flags.

The command that plans, estimates and prints a pipeline (its flags, ``--microbatches``,
``--schedule``, ``--virtual-stages`` and ``--stages``, are :mod:`spmdkit.cli.request`'s); the model of the pipeline itself
(stages, schedules, bubble, sends, memory) is the library module :mod:`spmdkit.planner.pipeline`.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any, TextIO

from spmdkit.cli.checks import parse_annotations
from spmdkit.cli.common import require_simulator, step_estimate, write_html
from spmdkit.cli.request import Links, PlanRequest
from spmdkit.core.errors import ProgramError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.reshard import CostModel
from spmdkit.cost.devices import Device, cost_model, load_device
from spmdkit.cost.memory import check_recompute
from spmdkit.models.zoo import model_label
from spmdkit.outputs.pipeline import write_pipeline
from spmdkit.outputs.report import plan_json, write_report
from spmdkit.planner.pipeline import estimate_pipeline, plan_pipeline, pp_cost_text
from spmdkit.planner.planning import parse_cost
from spmdkit.strategies.strategy import parse_mesh


def wants_pipeline(req: PlanRequest) -> bool:
    """True when the mesh names a ``pp`` dim or a pipeline flag is given."""
    if req.pipeline.given():
        return True
    return "pp" in parse_mesh(req.mesh_text).dim_names


def run_pipeline_plan(req: PlanRequest, out: TextIO) -> int:
    """``spmdkit plan`` with a ``pp`` mesh dim (preset models)."""
    m = req.model
    if m.hf is not None or m.program:
        raise ProgramError("--mesh pp / --microbatches: pipeline planning applies to preset models (--model), "
                           "not --hf or --program")
    full = parse_mesh(req.mesh_text)
    user = _sub_mesh_annotations(parse_annotations(req.annotate), full)
    strategy = req.strategy or "megatron"
    parse_cost(req.links.cost, full)  # a bad --cost is named before planning
    p = req.pipeline
    spec_args = {"microbatches": p.microbatches, "schedule": p.schedule, "virtual": p.virtual_stages,
                 "stages": p.stages}
    model, plan, spec, counts, secs = plan_pipeline(m.model, req.mesh_text, strategy, spec_args,
                                                    {"layers": req.layers, "batch": req.batch, "seq": req.seq},
                                                    user, req.links.cost)
    full_links = replace(req.links, cost=pp_cost_text(req.links.cost, full))
    plan, _est = step_estimate(full_links, plan, None, req.recompute or "none")
    device = None
    if req.links.device:
        device = load_device(str(req.links.device))
        if req.links.nodes_of:
            device = replace(device, ranks_per_node=int(req.links.nodes_of))
    c = model.config
    tokens = c.batch * c.seq * spec.microbatches
    est = estimate_pipeline(plan, spec, counts, device, _pp_link(req.links, full, device), tokens, full.size,
                            recompute=check_recompute(req.recompute or "none"))
    worst = max(range(spec.pp), key=lambda r: est.memory[r].total)
    title = (f"{model_label(m.model)}: {c.arch}, {c.layers} layers, hidden {c.hidden}, {c.heads} heads"
             f"{f' ({c.n_kv} kv)' if c.n_kv != c.heads else ''}, FFN {c.ffn}, vocab {c.vocab}, seq {c.seq}, "
             f"batch {c.batch * spec.microbatches} as {spec.microbatches} microbatches of {c.batch}, {c.dtype}; "
             f"strategy {strategy}; pipeline pp={spec.pp}"
             + (f"; recompute {req.recompute}" if req.recompute not in (None, "none") else ""))
    write_html(req, plan, title, est.memory[worst], _est, c, pipeline=est)
    verdict = None
    if req.verify:
        require_simulator()
        from spmdkit.sim.verify_plan import verify_pipeline  # (needs numpy)

        verdict = verify_pipeline(m.model, req.mesh_text, spec, strategy)
    if req.outputs.json:
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
