"""The communication of a rank on torch.distributed: the collectives a plan's reshards issue
(:class:`Collective`, :func:`expected_collectives`: what every rank's record is checked
against), one process group per mesh dim (:class:`Groups`), the reduce ops, and the default
process group from torchrun's environment (:func:`init_from_env`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from spmdkit.core.dist_attr import ReduceType
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.reshard import local_bytes, single_dim_steps
from spmdkit.program.plan import Plan

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")


# torch >= 2.13 names the tensor collectives *_single (the *_tensor names are deprecated)
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class Collective:
    """One collective a rank issued: element counts of its local buffer before and after."""
    tensor: str
    kind: str
    mesh_dim: int
    numel_in: int
    numel_out: int


def expected_collectives(plan: Plan) -> list[Collective]:
    """The collectives the plan's reshards issue on every rank, in program order (one over a
    group of several mesh dims as one per dim: :func:`spmdkit.core.reshard.single_dim_steps`)."""
    out: list[Collective] = []
    ms = plan.mesh.shape
    for rs in plan.reshards:
        if rs.shared:
            continue
        shape = plan.program.tensors[rs.tensor].shape
        for st in (x for step in rs.plan.steps for x in single_dim_steps(step)):
            if st.kind in COLLECTIVES:
                out.append(Collective(rs.tensor, st.kind, st.mesh_dims[0],
                                      local_bytes(st.src.dims_mapping, shape, ms, 1),
                                      local_bytes(st.dst.dims_mapping, shape, ms, 1)))
    return out


class Groups:
    """One process group per mesh dim and fixed coordinates of the other dims; a group's
    members are ordered by their coordinate along that dim."""
    def __init__(self, mesh: ProcessMesh, rank: int, timeout: float | None = None) -> None:

        self.mesh = mesh
        self.rank = rank
        self.coords = mesh.coords(rank)
        self.of_dim: dict[int, Any] = {}
        for d in range(mesh.ndim):
            keyed: dict[tuple[int, ...], list[int]] = {}
            for r in range(mesh.size):
                c = mesh.coords(r)
                keyed.setdefault(tuple(c[i] for i in range(mesh.ndim) if i != d), []).append(r)
            for key in sorted(keyed):
                members = sorted(keyed[key], key=lambda r: int(mesh.coords(r)[d]))
                # every rank calls new_group; a group's collectives wait at most ``timeout`` seconds
                g = dist.new_group(members, timeout=None if timeout is None else timedelta(seconds=timeout)) \
                    if mesh.shape[d] > 1 else None
                if self.rank in members:
                    self.of_dim[d] = g


REDUCE_OPS = {ReduceType.SUM: dist.ReduceOp.SUM, ReduceType.AVG: dist.ReduceOp.SUM, ReduceType.MAX: dist.ReduceOp.MAX,
        ReduceType.MIN: dist.ReduceOp.MIN, ReduceType.PROD: dist.ReduceOp.PRODUCT,
        ReduceType.ANY: dist.ReduceOp.MAX, ReduceType.ALL: dist.ReduceOp.MIN}


def init_from_env(backend: str = "auto", timeout: float = 120.0) -> str:
    """Initialise the default process group from torchrun's environment variables; every
    collective and group of the run waits at most ``timeout`` seconds."""
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, init_method="env://", timeout=timedelta(seconds=timeout))
    return backend


__all__ = ["COLLECTIVES", "REDUCE_OPS", "Collective", "Groups", "all_gather", "expected_collectives", "init_from_env",
           "reduce_scatter"]
