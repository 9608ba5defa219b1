"""Interop: DTensor-style placements and JAX PartitionSpec-style tuples.

DTensor describes a tensor per *mesh dim* (``Shard(d)``, ``Replicate()``,
``Partial(op)``); spmdkit per *tensor axis* (a dims_mapping). Co-sharding one
axis over several mesh dims maps to several ``Shard(d)`` with the same ``d``;
DTensor orders such shards by mesh dim (the lower mesh dim is the major one), so
only co-shards listed in increasing mesh-dim order convert.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Union

from spmdkit.core.dist_attr import Entry, ReduceType, TensorDistAttr, dims_entry, entry_dims
from spmdkit.core.errors import InvalidDimsMappingError, InvalidPartialError
from spmdkit.core.mesh import ProcessMesh


class Placement:
    """Base of the small, torch-free placement classes."""

    __slots__ = ()

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def is_replicate(self) -> bool:
        return False

    def is_partial(self) -> bool:
        return False

    def _key(self) -> tuple[Any, ...]:
        """The fields an instance is equal on, hashed on and shown with."""
        return ()

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other._key() == self._key()

    def __hash__(self) -> int:
        return hash((type(self).__name__, *self._key()))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(repr(k) for k in self._key())})"


class Shard(Placement):
    __slots__ = ("dim",)

    def __init__(self, dim: int) -> None:
        object.__setattr__(self, "dim", dim)

    dim: int

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def _key(self) -> tuple[Any, ...]:
        return (self.dim,)


class Replicate(Placement):
    __slots__ = ()

    def is_replicate(self) -> bool:
        return True


class Partial(Placement):
    __slots__ = ("reduce_op",)

    reduce_op: ReduceType

    def __init__(self, reduce_op: str | ReduceType = "sum") -> None:
        object.__setattr__(self, "reduce_op", ReduceType.parse(reduce_op))

    def is_partial(self) -> bool:
        return True

    def _key(self) -> tuple[Any, ...]:
        return (self.reduce_op.value,)


def to_placements(attr: TensorDistAttr) -> tuple[Placement, ...]:
    """One placement per mesh dim."""
    out: list[Placement] = [Replicate() for _ in range(attr.mesh.ndim)]
    for axis, e in enumerate(attr.dims_mapping):
        dims = entry_dims(e)
        if list(dims) != sorted(dims):
            raise InvalidDimsMappingError(
                f"axis {axis} is co-sharded over mesh dims {list(dims)} in an order DTensor "
                "placements cannot express (DTensor shards one axis major-to-minor by mesh dim)"
            )
        for d in dims:
            out[d] = Shard(axis)
    for d, r in attr.partial:
        out[d] = Partial(r)
    return tuple(out)


def from_placements(mesh: ProcessMesh, placements: Sequence[Any], ndim: int) -> TensorDistAttr:
    """Build a dist attr from per-mesh-dim placements (own classes or torch's)."""
    if len(placements) != mesh.ndim:
        raise InvalidDimsMappingError(
            f"{len(placements)} placements given for a {mesh.ndim}-D mesh"
        )
    axes: list[list[int]] = [[] for _ in range(ndim)]
    partial: dict[int, ReduceType] = {}
    for md, p in enumerate(placements):
        kind = _kind(p)
        if kind == "shard":
            d = int(p.dim)
            if d < 0:
                d += ndim
            if not 0 <= d < ndim:
                raise InvalidDimsMappingError(f"Shard({p.dim}) on mesh dim {md}: axis out of range for a {ndim}-D tensor")
            axes[d].append(md)
        elif kind == "partial":
            op = getattr(p, "reduce_op", "sum")
            partial[md] = ReduceType.parse(str(getattr(op, "value", op)))
        elif kind != "replicate":
            raise InvalidDimsMappingError(f"unknown placement {p!r} on mesh dim {md}")
    return TensorDistAttr(mesh, [dims_entry(a) for a in axes], partial)


def _kind(p: Any) -> str:
    if isinstance(p, Shard):
        return "shard"
    if isinstance(p, Replicate):
        return "replicate"
    if isinstance(p, Partial):
        return "partial"
    # torch.distributed.tensor placements (duck-typed; torch stays optional)
    if hasattr(p, "is_shard") and p.is_shard():
        return "shard"
    if hasattr(p, "is_replicate") and p.is_replicate():
        return "replicate"
    if hasattr(p, "is_partial") and p.is_partial():
        return "partial"
    return "unknown"


def to_torch_placements(attr: TensorDistAttr) -> tuple[Any, ...]:
    """Real ``torch.distributed.tensor`` placements (needs torch)."""
    try:
        from torch.distributed.tensor import Partial as TPartial
        from torch.distributed.tensor import Replicate as TReplicate
        from torch.distributed.tensor import Shard as TShard
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("to_torch_placements needs torch (pip install spmdkit[torch])") from exc
    torch_ops = {ReduceType.SUM: "sum", ReduceType.AVG: "avg", ReduceType.MAX: "max", ReduceType.MIN: "min", ReduceType.PROD: "product"}
    out: list[Any] = []
    for p in to_placements(attr):
        if isinstance(p, Shard):
            out.append(TShard(p.dim))
        elif isinstance(p, Partial):
            if p.reduce_op not in torch_ops:
                raise InvalidPartialError(f"DTensor has no Partial reduce op for {p.reduce_op.value!r}")
            out.append(TPartial(torch_ops[p.reduce_op]))
        else:
            out.append(TReplicate())
    return tuple(out)


PSpecEntry = Union[None, str, tuple[str, ...]]


def to_partition_spec(attr: TensorDistAttr) -> tuple[PSpecEntry, ...]:
    """JAX ``PartitionSpec``-style tuple of mesh axis names (``None`` = replicated)."""
    if attr.partial:
        raise InvalidPartialError(
            f"a partial tensor (mesh dims {list(attr.partial_dims)}) has no PartitionSpec form"
        )
    names = attr.mesh.dim_names
    out: list[PSpecEntry] = []
    for e in attr.dims_mapping:
        dims = entry_dims(e)
        if not dims:
            out.append(None)
        elif len(dims) == 1:
            out.append(names[dims[0]])
        else:
            out.append(tuple(names[d] for d in dims))
    return tuple(out)


def from_partition_spec(mesh: ProcessMesh, spec: Sequence[PSpecEntry], ndim: int | None = None) -> TensorDistAttr:
    """Build a dist attr from a PartitionSpec-style tuple (shorter specs pad with ``None``)."""
    n = len(spec) if ndim is None else ndim
    if len(spec) > n:
        raise InvalidDimsMappingError(f"PartitionSpec {tuple(spec)!r} is longer than the tensor's {n} dims")
    dm: list[Entry] = []
    for e in list(spec) + [None] * (n - len(spec)):
        if e is None:
            dm.append(-1)
        elif isinstance(e, str):
            dm.append(mesh.dim_index(e))
        else:
            dm.append(dims_entry([mesh.dim_index(x) for x in e]))
    return TensorDistAttr(mesh, dm)
