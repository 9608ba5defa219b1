"""Under ``--compile`` with the attention recomputed, an allgather cp attention grad's K / V
all-gather, ``contiguous()`` copies and first ``torch.cat`` are its recomputed forward's
(AOTAutograd's CSE of the joint graph: :func:`spmdkit.cost.memory_cp.shared_gathers`, whose
predicate the memory model uses too): the grad's time without them. Standard library only.
docs/devices.md, "Context parallelism" ("Compiled under full recomputation the backward gathers
once a layer").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from spmdkit.cost.context_torch import TorchCpCost, local_qkv, shared_copy_bytes
from spmdkit.cost.devices import Device
from spmdkit.cost.memory_cp import shared_gathers
from spmdkit.engine.facts import OpCost
from spmdkit.program.plan import Plan


def shared_gather_costs(plan: Plan, device: Device, costs: Sequence[OpCost], under: dict[int, TorchCpCost],
                        rerun: dict[int, list[int]]) -> dict[int, tuple[OpCost, float, TorchCpCost]]:
    """Allgather cp attention grad op -> (its cost, its time on ``device``, its
    :class:`TorchCpCost`) where its K / V all-gather is its recomputed forward's (``rerun``:
    :func:`spmdkit.cost.memory_saved.rerun_points`' first map; the ops
    :func:`spmdkit.cost.memory_cp.shared_gathers` names, under ``--compile`` with the attention
    recomputed: AOTAutograd's CSE of the joint graph merges the grad's gather, contiguous copies
    and cat into the recomputed forward's): without its own all-gather
    (:meth:`TorchCpCost.without_gather`) and those copies (:func:`shared_copy_bytes`). The
    recomputed forward still runs (and waits for) its gather; the memory model holds that buffer
    from the rerun to the grad (:func:`spmdkit.cost.memory.activation_deltas`): one mechanism."""
    out: dict[int, tuple[OpCost, float, TorchCpCost]] = {}
    if not under or plan.runtime.eager:
        return out
    for i in shared_gathers(plan, rerun):
        u = under.get(i)
        if u is None:
            continue
        c = replace(costs[i], cast_bytes=max(0.0, costs[i].cast_bytes - shared_copy_bytes(local_qkv(plan, i))))
        out[i] = (c, device.op_time(c), u.without_gather())
    return out


__all__ = ["shared_gather_costs"]
