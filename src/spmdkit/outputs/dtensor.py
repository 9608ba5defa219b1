"""Export a plan's dist attrs as ``torch.distributed.tensor`` placements (needs ``spmdkit[torch]``).

A dist attr on an N-D mesh becomes N placements, one per mesh dim, as DTensor reads them:

* mesh dim ``d`` partial with reduce type ``r`` -> ``Partial(r)`` (sum, avg, max, min, prod;
  DTensor has no any / all: they raise);
* mesh dim ``d`` sharding tensor axis ``i`` -> ``Shard(i)``;
* otherwise ``Replicate()``.

DTensor splits a tensor axis sharded by several mesh dims in mesh-dim order (the lower mesh dim
is the major split), which is spmdkit's co-shard ``(d0, d1)`` with ``d0 < d1``; a co-shard
listing a higher mesh dim first has no DTensor placement and raises. Both split the same way
(``torch.chunk``: equal chunks, the last ones smaller on an uneven axis; spmdkit's uneven
shards take the ceiling first, as DTensor does). The mapping itself is
``spmdkit.core.placements`` (torch-free placement classes and ``to_torch_placements``).

``device_mesh(plan)`` builds the matching ``DeviceMesh`` (the plan's mesh dim names), and
``distribute_parameters(module, plan, names)`` replaces a module's parameters by DTensors
sharded as the plan says (``distribute_tensor``): an expert-parallel plan's expert stacks too
(``Shard(0)`` over ``ep``). ``expert_parallel(plan)`` says what torch can and cannot express of
an ep plan (:mod:`spmdkit.outputs.dtensor_ep`), checked against the installed
``torch.distributed.tensor.parallel``: it has no expert-parallel style, so the experts modules
and their token all-to-alls need a custom ``ParallelStyle`` (torchtitan's ``ExpertParallel``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Partial, Placement, distribute_tensor

from spmdkit.core.dist_attr import TensorDistAttr
from spmdkit.core.errors import InvalidAttributeError
from spmdkit.core.placements import to_torch_placements
from spmdkit.outputs.dtensor_ep import expert_parallel_statement
from spmdkit.program.plan import Plan


def placements(attr: TensorDistAttr) -> tuple[Placement, ...]:
    """DTensor placements (one per mesh dim) of a dist attr (``core.placements.to_torch_placements``)."""
    return to_torch_placements(attr)


def plan_placements(plan: Plan) -> dict[str, tuple[Placement, ...]]:
    """Placements of every tensor in a plan (``spmdkit.program.plan.Plan``)."""
    return {name: placements(attr) for name, attr in plan.attrs.items()}


def device_mesh(plan: Plan, device_type: str = "cpu") -> DeviceMesh:
    """The DeviceMesh of the plan's mesh (its dim names), over ranks 0..n-1 in row-major order."""
    mesh = plan.mesh
    return init_device_mesh(device_type, tuple(mesh.shape), mesh_dim_names=tuple(mesh.dim_names))


def distribute_parameters(module: torch.nn.Module, plan: Plan, names: Mapping[str, str],
                          mesh: DeviceMesh | None = None) -> dict[str, tuple[Placement, ...]]:
    """Replace ``module``'s parameters by DTensors placed as ``plan`` shards them.

    ``names`` maps a module parameter name (``module.named_parameters()``) to the plan's tensor
    name. Returns the placements applied. Partial placements are not valid for a parameter's
    initial value and raise."""
    dm = mesh if mesh is not None else device_mesh(plan)
    params = dict(module.named_parameters())
    applied: dict[str, tuple[Placement, ...]] = {}
    for pname, tname in names.items():
        if pname not in params:
            raise InvalidAttributeError(f"dtensor: the module has no parameter {pname!r}")
        if tname not in plan.attrs:
            raise InvalidAttributeError(f"dtensor: the plan has no tensor {tname!r} (for parameter {pname!r})")
        pl = placements(plan.attrs[tname])
        if any(isinstance(p, Partial) for p in pl):
            raise InvalidAttributeError(f"dtensor: parameter {pname!r} is planned partial ({plan.attrs[tname]})")
        owner: Any = module
        *path, leaf = pname.split(".")
        for part in path:
            owner = getattr(owner, part)
        old = getattr(owner, leaf)
        new = torch.nn.Parameter(distribute_tensor(old.data, dm, list(pl)), requires_grad=old.requires_grad)
        setattr(owner, leaf, new)
        applied[pname] = pl
    return applied


def expert_parallel(plan: Plan) -> dict[str, Any] | None:
    """The plan's expert parallelism in torch's terms (:func:`spmdkit.outputs.dtensor_ep.expert_parallel_statement`),
    ``torch_style`` the installed ``torch.distributed.tensor.parallel``'s own expert style if it
    has one (None on torch 2.13: it has none); None for a plan without expert parallelism."""
    got = expert_parallel_statement(plan)
    if got is None:
        return None
    import torch.distributed.tensor.parallel as tp_api

    own = sorted(n for n in getattr(tp_api, "__all__", dir(tp_api)) if "expert" in n.lower())
    return {**got, "torch_style": own[0] if own else None,
            "torch_version": torch.__version__.split("+")[0]}


__all__ = ["device_mesh", "distribute_parameters", "expert_parallel", "placements", "plan_placements"]
