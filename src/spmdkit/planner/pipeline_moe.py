"""The memory of a MoE pipeline's fullest rank, split so a reader can check it by hand.

For a plan whose program has expert stacks ``[E, in, out]`` (:func:`spmdkit.strategies.experts.moe_layers`),
:func:`moe_memory` splits the fullest pipeline rank's memory (:func:`spmdkit.planner.pipeline.estimate_pipeline`)
into what its stages' experts hold and what the rest (attention, dense and shared MLPs, router,
norms, embedding / head) holds, as the framework allocates them
(:func:`spmdkit.cost.memory.held_for_the_step`), with the figures that divide them: the expert
elements of the rank's layers (global), ``ep`` (experts a rank holds: ``E / ep`` of each stack;
ep x tp under ETP = 1), the expert data-parallel ranks (EDP = ``dp``, dp x cp under cp, over
which ZeRO shards the expert states) and the dense data-parallel ranks (``dp x ep``, x cp under
cp, over which ZeRO shards the dense states), read from the parameters' layouts; and the
activations as one microbatch's working peak plus the stash of each other microbatch in flight.
DeepSeek-V3 on ``pp=16,dp=2,ep=64`` (docs/search.md): a rank of 4 MoE layers holds
``4 x 256 x 3 x 7168 x 2048 / 64`` expert elements, 2 bytes each.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from spmdkit.core.dist_attr import entry_dims
from spmdkit.cost.memory import Memory, held_for_the_step
from spmdkit.program.plan import Plan
from spmdkit.strategies.experts import moe_layers


@dataclass(frozen=True)
class MoeMemory:
    """The fullest pipeline rank's memory split into experts and the rest (bytes per device)."""

    rank: int
    layers: int                 # layers on the rank (its stages')
    moe_layers: int             # of them, layers with experts
    experts: int                # routed experts per layer (E)
    ep: int                     # ranks the experts are split over
    edp: int                    # expert data-parallel ranks (ZeRO shards expert states over them)
    dense_dp: int               # data-parallel ranks of the rest (dp x ep)
    expert_elements: int        # the rank's expert stack elements, whole (before ep)
    expert_parameters: int
    expert_gradients: int
    expert_states: int
    dense_parameters: int
    dense_gradients: int
    dense_states: int
    in_flight: float            # microbatches whose activations the rank holds
    working_peak: int           # one microbatch's working peak through the rank's stages
    stash: int                  # what each other microbatch in flight keeps for its backward
    activations: int            # the rank's activation peak (working peak + the others' stash)
    mtp_modules: int = 0        # multi-token-prediction modules on the rank (not among ``layers``)

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def moe_memory(plan: Plan, stages: Sequence[int], counts: Sequence[int], p: int, mems: Sequence[Memory],
               in_flight: Sequence[float], costs: Sequence[Any]) -> MoeMemory | None:
    """The :class:`MoeMemory` of the fullest of ``p`` pipeline ranks (``mems``: each rank's
    memory; ``stages``: each op's virtual stage, rank = stage mod p; ``costs``: the stages'
    :class:`spmdkit.planner.pipeline.StageCost`), None for a plan without expert stacks."""
    prog = plan.program
    layers = moe_layers(prog) if any(op.rule == "moe_gate_dispatch" for op in prog.ops) else []
    stacks = {s for lay in layers for s in lay.stacks}
    if not stacks:
        return None
    held = held_for_the_step(plan)
    stage_of: dict[str, int] = {}
    for i, op in enumerate(prog.ops):
        if op.phase == "optimizer":
            for n in op.input_names():
                if prog.tensors[n].kind == "parameter" and not prog.tensors[n].inplace_of:
                    stage_of.setdefault(n, stages[i])
    r = max(range(p), key=lambda k: mems[k].device_total)
    mine = [s for s in range(len(costs)) if s % p == r]
    ex = [0, 0, 0]
    de = [0, 0, 0]
    elements = 0
    for n, (pb, gb, sb) in held.items():
        if stage_of.get(n, -1) % p != r:
            continue
        acc = ex if n in stacks else de
        acc[0], acc[1], acc[2] = acc[0] + pb, acc[1] + gb, acc[2] + sb
        if n in stacks:
            elements += prog.tensors[n].numel
    ep, edp, dense = _divisors(plan, stacks)
    moe_ops = {i for i, op in enumerate(prog.ops) if op.rule == "moe_gate_dispatch" and op.phase == "forward"}
    n_moe = sum(1 for i in moe_ops if stages[i] % p == r)
    mtp = {op.layer for i, op in enumerate(prog.ops)  # zoo_mtp labels its modules' ops mtp[k]
           if op.phase == "forward" and op.layer.startswith("mtp[") and stages[i] % p == r}
    stash = sum(costs[s].stash_bytes for s in mine)
    work = max(costs[s].working_peak for s in mine)
    return MoeMemory(r, sum(counts[s] for s in mine), n_moe, layers[0].experts, ep, edp, dense, elements,
                     ex[0], ex[1], ex[2], de[0], de[1], de[2], in_flight[r], work, stash, mems[r].activation_peak,
                     len(mtp))


def _divisors(plan: Plan, stacks: set[str]) -> tuple[int, int, int]:
    """(the ranks an expert stack's experts are split over, the ranks holding the same experts,
    the ranks holding the same shard of a dense parameter), read from the plan's layouts of the
    parameters: ep (ep x tp under ETP = 1); EDP = dp (dp x cp under cp); dp x ep (x cp: with
    ``ep-from=cp`` the dense data-parallel group is every rank but tp's)."""
    mesh = plan.mesh

    def split(names: Sequence[str]) -> set[int]:
        return {d for n in names if n in plan.attrs for e in plan.attrs[n].dims_mapping for d in entry_dims(e)}

    stack = sorted(stacks)[0]
    ep = math.prod(mesh.shape[d] for d in entry_dims(plan.attrs[stack].dims_mapping[0]))
    edp = mesh.size // math.prod(mesh.shape[d] for d in split([stack]))
    dense = [n for n, t in plan.program.tensors.items() if t.kind == "parameter" and n not in stacks
             and not t.inplace_of]
    return ep, edp, mesh.size // math.prod(mesh.shape[d] for d in split(dense))


__all__ = ["MoeMemory", "moe_memory"]
