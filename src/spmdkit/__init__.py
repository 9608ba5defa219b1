"""spmdkit: standalone, verified SPMD sharding-propagation rules (Paddle 3.3.1 semantics)."""

from spmdkit.core import (
    DistTensorSpec,
    ProcessMesh,
    ReduceType,
    SpmdError,
    SpmdResult,
    TensorDistAttr,
)
from spmdkit.engine.registry import get_rule, rule_names

__version__ = "0.1.0"

__all__ = [
    "DistTensorSpec",
    "ProcessMesh",
    "ReduceType",
    "SpmdError",
    "SpmdResult",
    "TensorDistAttr",
    "get_rule",
    "rule_names",
    "__version__",
]
