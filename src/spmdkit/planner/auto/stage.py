"""The exact search on a pipeline stage: :func:`auto_stage` plans the program of one microbatch
on the sub-mesh without pp with :func:`spmdkit.planner.auto.auto_plan`, its links the device's on
that sub-mesh with ``--cost`` (less its ``pp=`` entry, which times the sends) on top. This is
Alpa's intra-operator pass run on a stage (Zheng et al., "Alpa", OSDI 2022, section 4: the
intra-op ILP on each stage's sub-mesh); the inter-operator stages are the layer split of
:mod:`spmdkit.planner.pipeline`. Shared by the ``--devices`` search's ``auto`` configurations
(:mod:`spmdkit.planner.search`) and ``spmdkit plan --auto`` on a mesh with a ``pp`` dim
(:func:`spmdkit.planner.pipeline_plan.plan_pipeline_source`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.reshard import CostModel
from spmdkit.cost.devices import Device, cost_model
from spmdkit.planner.auto import AutoInfo, auto_plan
from spmdkit.program.ir import Program
from spmdkit.program.plan import Plan


@dataclass(frozen=True)
class StageSearch:
    """How a stage is searched: the device (its links and compute; None: the planner's default
    links, communication alone), ranks per node (``--nodes-of``), the solver's time limit in
    seconds and whether the per-layer explanation is kept (``--explain``)."""

    device: Device | None = None
    nodes_of: int | None = None
    time_limit: float = 30.0
    explain: bool = False


def link_cost(mesh: ProcessMesh, device: Device | None, nodes_of: int | None, cost_text: str | None) -> CostModel:
    """The device's links on ``mesh`` (:func:`spmdkit.cost.devices.cost_model`), ``cost_text``
    (``--cost``) on top."""
    cost = cost_model(mesh, device, nodes_of)
    if cost_text:
        cost = CostModel.parse(cost_text, mesh, base=cost)
    return cost


def auto_stage(prog: Program, mesh: ProcessMesh, pins: Mapping[str, Any] | None, search: StageSearch,
               cost_text: str | None) -> tuple[Plan, AutoInfo]:
    """``prog`` (a stage's microbatch) planned by the exact search on the sub-mesh ``mesh``,
    ``pins`` (dims_mappings of the sub-mesh) held, priced on :func:`link_cost`."""
    return auto_plan(prog, mesh, pins, cost=link_cost(mesh, search.device, search.nodes_of, cost_text),
                     time_limit=search.time_limit, device=search.device, explain=search.explain)


def auto_title(info: AutoInfo) -> str:
    """The search's report in a title: solver status, gap, solve seconds, realisation."""
    return f" (HiGHS {info.status}, gap {info.gap:.2%}, solve {info.solve_s:.2f} s, realised {info.realized})"


__all__ = ["StageSearch", "auto_stage", "auto_title", "link_cost"]
