"""spmdkit.core: the data model (meshes, dist attrs, specs, results, errors, interop)."""

from spmdkit.core import errors
from spmdkit.core.dist_attr import ReduceType, TensorDistAttr, format_dims_mapping
from spmdkit.core.errors import *  # noqa: F403  (every error class: errors.__all__, listed once there)
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.placements import (
    Partial,
    Placement,
    Replicate,
    Shard,
    from_partition_spec,
    from_placements,
    to_partition_spec,
    to_placements,
    to_torch_placements,
)
from spmdkit.core.spec import DistTensorSpec, SpmdResult

__all__ = [
    "ProcessMesh",
    "ReduceType",
    "TensorDistAttr",
    "DistTensorSpec",
    "SpmdResult",
    "format_dims_mapping",
    "Placement",
    "Shard",
    "Replicate",
    "Partial",
    "to_placements",
    "from_placements",
    "to_torch_placements",
    "to_partition_spec",
    "from_partition_spec",
]
__all__ += errors.__all__
