"""Automatic sharding (issue 16): an exact search over the rules' own candidates, solved by HiGHS.

Candidates. Per op, seeds are pushed through the op's forward rule: for every mesh dim (of size
> 1) independently one of: nothing, every floating input partial over it, one floating input
partial over it, or one axis of one input sharded over it (the same axis on two mesh dims is a
co-shard); the product over the mesh dims (at most :data:`MAX_SEEDS`). The distinct answers
(required input dist attrs, output dist attrs) are the op's candidates, all of them (no cap
unless ``max_candidates`` is given: then the cheapest by compute time). Ops that are the same
op on the same shapes (repeated layers) share one generation. A partial output read by several
ops may also be held reduced right after its op (replicated or reduce-scattered onto a free
axis: variants of the candidate paying the reduction once, as propagate reduces it once).

Merging (Alpa): an op whose only input is made by an earlier op (a reshape, a reduction, an
elementwise op of one tensor), with no pinned or in-place output, takes no choice of its own:
its candidate is its rule's answer on its input as the producer's candidate makes it, so it
shares the producer's variables.

Folding: ops are grouped by the number in their tensors' names (``layers.3.`` -> 3; optimizer
ops by their parameter's name). Groups whose ops are the same op by op (rules, shapes, names up
to the layer number relative to the group's, pins, merging) are tied to the first of them: one
set of variables and one copy of each edge (its cost times the number of layers) for all.
The boundary between two tied layers is an edge like any other, so the choice is exact among
plans that repeat one choice per identical layer.

The program. Exactly one candidate per (unmerged, untied) op; free sources (parameters, optimizer
states, inputs) choose among the non-partial dist attrs their readers ask for. Every read costs
the reshard (spmdkit.core.reshard, the plan's cost model) from how the tensor is held to how the
reader's candidate requires it; edges between two choices are linearised as in Alpa over the
tensor's distinct dist attrs on each side (edges between the same variables share one
linearisation). In-place outputs pay the reshard back to the tensor they overwrite, pinned
outputs the reshard to the pin. With a device each candidate also costs its op's compute time
(compute.op_cost) and the collectives inside its kernel (compute.kernel_collectives).
``memory_cap``: per-device memory is linear in the choices: parameters, parameter gradients
and optimizer states (as held), the activations the backward reads (memory_saved.value_reads)
and, per op position, the activations live there and the reshard copies the op reads (local
bytes). A choice whose realised plan (memory.memory_per_device) exceeds the cap is re-solved
with memory priced into the objective (Lagrangian relaxation of the memory rows: the kept
activations' row and the row of every position where a realised plan peaked), the price raised
until a plan fits and then bisected, at most :data:`MEMORY_ROUNDS` solves within the time limit;
the gap is then against the Lagrangian bound, so a capped plan is not proven optimal. A cap
below the least any choice holds is a ProgramError at once.

The choice is realised twice, as the chosen candidates exactly (no propagation) and as
annotations run through propagate; the cheaper plan is returned (``AutoInfo.realized``).
Costs are per reader: a reshard several readers share is counted once per reader.

The modules: :mod:`~spmdkit.planner.auto.candidates` (candidates, merging, folding),
:mod:`~spmdkit.planner.auto.ilp` (the integer program), :mod:`~spmdkit.planner.auto.solve`
(HiGHS, the memory-capped rounds), :mod:`~spmdkit.planner.auto.realise` (the two plans of a
choice) and :mod:`~spmdkit.planner.auto.explain` (``--explain``); :func:`auto_plan` here runs them.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from spmdkit.core.errors import ProgramError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.reshard import CostModel
from spmdkit.cost.devices import Device, cost_model
from spmdkit.cost.memory import memory_per_device
from spmdkit.planner.auto.candidates import MAX_SEEDS, Pricer, Progress, _Gen, make_space
from spmdkit.planner.auto.explain import LayerChoice
from spmdkit.planner.auto.explain import explain as explain_choice
from spmdkit.planner.auto.ilp import Problem
from spmdkit.planner.auto.realise import Realiser
from spmdkit.planner.auto.solve import SCALE, Solver, capped_solve, size_text
from spmdkit.program.ir import Program
from spmdkit.program.plan import Plan
from spmdkit.strategies.strategy import user_attrs


@dataclass
class AutoInfo:
    """How the search went."""

    objective_s: float
    gap: float
    solve_s: float
    status: str
    candidates: int
    variables: int
    #: which realisation of the choice the plan is: "direct" (the chosen candidates as they are)
    #: or "propagate" (propagate from the chosen dist attrs as annotations)
    realized: str = "direct"
    merged: bool = False
    folded: bool = False
    #: ops merged into their producer, layers tied to an identical one
    merged_ops: int = 0
    folded_layers: int = 0
    #: seconds spent making candidates (the rest of the wall time is solving and realising)
    candidates_s: float = 0.0
    memory_cap: int | None = None
    #: parameters + gradients + optimizer states + activations kept for the backward of the
    #: choice, as the integer program counts them (bytes per device)
    memory_bytes: int | None = None
    explain: list[LayerChoice] = field(default_factory=list)


#: The weight of the gradient reductions before the optimizer (data-parallel synchronisation) in
#: the objective when a device is given: its step (compute.estimate_step) runs them in DDP
#: buckets beside the backward, so most of their time is hidden; 0.3 is the exposed share
#: assumed. Measured on llama-7b and gpt2-small (2 layers, h100, dp=2 x tp=4 and dp=8 x tp=8),
#: the overlapped step of the plan found with 0.3 was at most that with 1 (the serial objective)
#: and with 0 everywhere, up to 42% shorter (docs/graph.md).
#: Under issue 26's step model the weight does not know that bf16 gradients are reduced in fp32,
#: nor the framework's buckets: on a bf16 gpt2-small (1 layer, dp=4 x tp=2, torch DDP buckets) its
#: plan's step is 5% over the serial objective's, on a float32 one it is shorter
#: (tests/test_auto.py); under Megatron's 40M-parameter buckets, which a 1-2 layer model fills
#: once, the serial objective does best.
GRAD_SYNC_WEIGHT = 0.3


def auto_plan(prog: Program, mesh: ProcessMesh, pins: Mapping[str, Any] | None = None,
              cost: CostModel | None = None, time_limit: float = 30.0,
              max_candidates: int | None = None, device: Device | None = None, memory_cap: int | None = None,
              merge: bool = True, fold: bool = True, explain: bool = False,
              progress: Progress | None = None, grad_sync_weight: float | None = None,
              grad_accum: int = 1) -> tuple[Plan, AutoInfo]:
    """A plan of ``prog`` on ``mesh`` whose shardings minimise the predicted communication
    time (plus each op's compute time from compute.op_cost on ``device``, a compute.Device,
    where one is given), ``pins`` (tensor -> dims_mapping or dist attr) held as hard
    constraints, per-device memory (parameters, gradients, optimizer states, activations kept
    for the backward) at most ``memory_cap`` bytes where given. ``cost``: the links (default
    the device's, else the planner's defaults). ``progress(phase, done, total)`` is called
    while candidates are made (phase "candidates") and the program is solved ("solve",
    "explain"). ``explain``: price, per layer, the best choice that differs there.
    ``grad_sync_weight``: the weight of a parameter gradient's reduction before its optimizer
    update in the objective (default :data:`GRAD_SYNC_WEIGHT` with a ``device``, whose step
    overlaps those reductions with the backward, else 1)."""
    if grad_sync_weight is None:
        grad_sync_weight = GRAD_SYNC_WEIGHT if device is not None else 1.0
    if device is not None:  # the mesh's GPUs step together, at the slowest one's pace
        device = device.lockstep(mesh.size)
    if not 0.0 <= grad_sync_weight <= 1.0:
        raise ProgramError(f"auto: grad_sync_weight {grad_sync_weight!r} is not between 0 and 1")
    try:
        import highspy
        import numpy as np
    except ImportError:
        raise ProgramError("auto: the search needs highspy (pip install 'spmdkit[auto]')") from None
    if memory_cap is not None and (not isinstance(memory_cap, int) or memory_cap <= 0):
        raise ProgramError(f"auto: memory_cap {memory_cap!r}: expected a positive number of bytes")
    if cost is None:
        cost = cost_model(mesh, device) if device is not None else CostModel.default(mesh)
    fixed = user_attrs(prog, mesh, pins)

    def tick(phase: str, done: int, total: int) -> None:
        if progress is not None:
            progress(phase, done, total)

    price = Pricer(prog, cost)
    space = make_space(prog, fixed, _Gen(prog, mesh, cost, device, max_candidates), price, merge, fold, tick)
    problem = Problem(prog, mesh, fixed, space, price, grad_sync_weight)
    solver = Solver(problem, highspy, np, time_limit)
    if memory_cap is not None:
        least = problem.least_memory()
        if least > memory_cap:
            raise ProgramError(f"auto: --memory {size_text(memory_cap)}: no plan fits in it per device: every "
                               f"choice holds at least {size_text(least)} (parameters, gradients, optimizer states "
                               "and the activations kept for the backward)")
    tick("solve", 0, 1)
    t0 = time.perf_counter()
    status, sol = solver.solve()
    if sol is None:
        raise ProgramError(f"auto: HiGHS found no solution ({status}) within {time_limit} s")
    info = solver.h.getInfo()
    objective = float(info.objective_function_value) / SCALE + problem.const
    gap = float(info.mip_gap)
    realise = Realiser(problem, cost, device, memory_cap)
    plan, realized = realise(sol)
    if memory_cap is not None and memory_per_device(plan).total > memory_cap:
        capped = capped_solve(solver, realise, memory_cap, objective, sol, plan)
        objective, sol, plan, realized = capped.objective, capped.sol, capped.plan, capped.realized
        status, gap = capped.status, capped.gap
    result = AutoInfo(objective_s=objective, gap=gap, solve_s=time.perf_counter() - t0, status=status,
                      candidates=sum(len(c) for i, c in enumerate(space.cands) if space.chooses(i)),
                      variables=solver.nvar, realized=realized, merged=bool(space.parent),
                      folded=bool(space.folded_layers), merged_ops=len(space.parent),
                      folded_layers=space.folded_layers, candidates_s=space.candidates_s,
                      memory_cap=memory_cap, memory_bytes=solver.memory_counted(sol))
    tick("solve", 1, 1)
    if explain:
        result.explain = explain_choice(solver, sol, objective, tick, float(time_limit))
    # the choice is priced for one micro-step; the plan carries the accumulation (``--grad-accum``)
    return (replace(plan, grad_accum=grad_accum) if grad_accum != 1 else plan), result


__all__ = ["GRAD_SYNC_WEIGHT", "MAX_SEEDS", "AutoInfo", "Progress", "auto_plan"]
