"""The size of a tensor's local shard under a dist attr, memoised: what the memory model, the
FSDP2 pools and the exact search's memory terms count. The core and the engine's memo tables only.
"""

from __future__ import annotations

import math

from spmdkit.core.dist_attr import TensorDistAttr, largest_shard
from spmdkit.engine.memo import memo_table

#: local_numel's memo (emptied with the engine's memo tables, as cost.compute's op costs are)
_NUMEL: dict[tuple[TensorDistAttr, tuple[int, ...]], int] = memo_table()


def local_numel(attr: TensorDistAttr, shape: tuple[int, ...]) -> int:
    """Elements of the largest local shard (uneven splits: the first, largest, piece); memoised
    (a model repeats few (dist attr, shape) pairs)."""
    got = _NUMEL.get((attr, shape))
    if got is None:
        if len(_NUMEL) > 100_000:
            _NUMEL.clear()
        got = _NUMEL[(attr, shape)] = math.prod(largest_shard(attr.dims_mapping, shape, attr.mesh.shape))
    return got


__all__ = ["local_numel"]
