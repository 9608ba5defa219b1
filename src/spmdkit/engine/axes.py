"""Small helpers on axes, dims_mappings and mesh dims shared by the rule families.

Written once here so that every rule reads a co-shard, sizes a group of mesh dims and
normalises an axis the same way:

- :func:`mesh_size`: the product of the sizes of some mesh dims (how many ways they split);
- :func:`largest_mesh_dim` / :func:`one_mesh_dim` / :func:`one_mesh_dim_per_axis`: a co-sharded
  entry read as one mesh dim, its largest (the first of equal sizes), as Paddle 3.3.1's merges
  read ``dims_mapping()`` of a co-sharded tensor;
- :func:`normalize_axis`: an axis attribute checked against a rank and made non-negative;
- :func:`cleared`: a dims_mapping with some axes made unsharded;
- :func:`replicated` / :func:`replicated_like`: fully replicated dist attrs;
- :data:`make_attr`: core's unchecked dist-attr constructor, for answers legal by construction.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import overload

from spmdkit.core.dist_attr import DimsMapping, Entry, TensorDistAttr
from spmdkit.core.errors import InvalidAttributeError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.spec import DistTensorSpec

#: ``make_attr(mesh, dims_mapping, partial=())``: a dist attr without validation.
make_attr = TensorDistAttr.unchecked


def mesh_size(mesh_shape: Sequence[int], dims: Iterable[int]) -> int:
    """How many parts the mesh dims ``dims`` split an axis into: the product of their sizes."""
    p = 1
    for d in dims:
        p *= mesh_shape[d]
    return p


def numel(shape: Sequence[int]) -> int:
    """The element count of a shape; -1 where a size is unknown (negative)."""
    n = 1
    for s in shape:
        if s < 0:
            return -1
        n *= s
    return n


def largest_mesh_dim(entry: Entry, mesh_shape: Sequence[int]) -> int:
    """A dims_mapping entry read as one mesh dim, as Paddle 3.3.1's merges read a co-shard: its
    largest mesh dim (the first of equal sizes); -1 and single dims unchanged."""
    if entry.__class__ is int:
        return entry
    dims: tuple[int, ...] = entry  # type: ignore[assignment]
    best = dims[0]
    for d in dims[1:]:
        if mesh_shape[d] > mesh_shape[best]:
            best = d
    return best


def one_mesh_dim(dm: DimsMapping, mesh_shape: Sequence[int]) -> DimsMapping:
    """``dm`` with every co-sharded entry read as its largest mesh dim (see largest_mesh_dim)."""
    for e in dm:
        if e.__class__ is not int:
            return tuple(largest_mesh_dim(x, mesh_shape) for x in dm)
    return dm


def one_mesh_dim_per_axis(spec: DistTensorSpec) -> DistTensorSpec:
    """``spec`` with every co-sharded axis read as its largest mesh dim (partial kept)."""
    a = spec.dist_attr
    dm = a.dims_mapping
    one = one_mesh_dim(dm, a.mesh.shape)
    if one is dm:
        return spec
    return DistTensorSpec(spec.shape, make_attr(a.mesh, one, a.partial))


@overload
def one_mesh_dim_specs(*specs: DistTensorSpec) -> Sequence[DistTensorSpec]: ...
@overload
def one_mesh_dim_specs(*specs: DistTensorSpec | None) -> Sequence[DistTensorSpec | None]: ...
def one_mesh_dim_specs(*specs: DistTensorSpec | None) -> Sequence[DistTensorSpec | None]:
    """:func:`one_mesh_dim_per_axis` of each spec (None stays None)."""
    return [None if s is None else one_mesh_dim_per_axis(s) for s in specs]


def normalize_axis(op: str, axis: int, ndim: int, name: str = "axis", tensor: str = "tensor") -> int:
    """``axis`` in ``[0, ndim)`` (a negative one counts from the end); a 0-d tensor takes 0 or -1
    (as 0). InvalidAttributeError naming the op (unless ``op`` is ""), the attribute and the range otherwise;
    ``tensor`` names what the axis indexes in that message."""
    pre = f"{op}: " if op else ""  # "": the caller names the op (a declared rule's notation)
    if ndim == 0:
        if axis not in (0, -1):
            raise InvalidAttributeError(f"{pre}{name} {axis} is out of range for a 0-d {tensor} (0 or -1)")
        return 0
    if not -ndim <= axis < ndim:
        raise InvalidAttributeError(
            f"{pre}{name} {axis} is out of range for a {ndim}-D {tensor} [{-ndim}, {ndim})"
        )
    return axis + ndim if axis < 0 else axis


def reduced_axes(
    op: str, ndim: int, axis: Sequence[int], keep_dim: bool, reduce_all: bool = False
) -> tuple[tuple[bool, ...], tuple[int, ...]]:
    """A reduction's plan: (reduced flag per x axis, the x axis of each out axis, -1 for a
    reduced axis kept as size 1). An empty ``axis`` (or ``reduce_all``, or a 0-d x) reduces
    every axis; entries may be negative or repeat, each is checked against x's rank."""
    every = reduce_all or not axis or ndim == 0
    reduced = [every] * ndim
    for a in axis:
        if ndim:
            reduced[normalize_axis(op, a, ndim, "axis", "x")] = True
        else:
            normalize_axis(op, a, 0, "axis", "x")
    pos: list[int] = []
    for i, r in enumerate(reduced):
        if not r:
            pos.append(i)
        elif keep_dim:
            pos.append(-1)
    return tuple(reduced), tuple(pos)


def cleared(dm: DimsMapping, axes: Iterable[int]) -> DimsMapping:
    """``dm`` with the axes ``axes`` unsharded (-1)."""
    drop = set(axes)
    return tuple(-1 if i in drop else e for i, e in enumerate(dm))


def replicated(mesh: ProcessMesh, ndim: int) -> TensorDistAttr:
    """A replicated, non-partial dist attr of ``ndim`` axes."""
    return make_attr(mesh, (-1,) * ndim)


def replicated_like(mesh: ProcessMesh, t: DistTensorSpec | None) -> TensorDistAttr | None:
    """A replicated dist attr of ``t``'s rank on ``mesh`` (None for an absent tensor)."""
    return None if t is None else make_attr(mesh, (-1,) * len(t.shape))


def unpartial(a: TensorDistAttr) -> TensorDistAttr:
    """``a`` without partial status (``a`` itself where it has none)."""
    return make_attr(a.mesh, a.dims_mapping) if a.partial else a


__all__ = [
    "cleared",
    "largest_mesh_dim",
    "make_attr",
    "mesh_size",
    "normalize_axis",
    "numel",
    "one_mesh_dim",
    "one_mesh_dim_per_axis",
    "one_mesh_dim_specs",
    "reduced_axes",
    "replicated",
    "replicated_like",
    "unpartial",
]
