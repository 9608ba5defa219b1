"""spmdkit: standalone, verified SPMD sharding-propagation rules (Paddle 3.3.1 semantics)."""

from spmdkit.core import (
    DistTensorSpec,
    ProcessMesh,
    ReduceType,
    SpmdError,
    SpmdResult,
    TensorDistAttr,
)
from spmdkit.core.version import __version__
from spmdkit.engine.registry import get_rule, rule_names, set_catalogue


def _load_catalogue() -> None:
    """Import every op family, each registering its rules (run by the registry on its first
    lookup: the engine below the op families never imports them)."""
    import spmdkit.ops  # noqa: F401


set_catalogue(_load_catalogue)


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
