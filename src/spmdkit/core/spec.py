"""DistTensorSpec (global shape + dist attr) and SpmdResult."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Union

from spmdkit.core.dist_attr import TensorDistAttr, format_dims_mapping
from spmdkit.core.errors import InvalidDimsMappingError, ShapeMismatchError
from spmdkit.core.mesh import ProcessMesh


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class DistTensorSpec:
    """A tensor's global shape and its dist attr (Paddle's ``DistTensorSpec``).

    ``shape`` entries are non-negative ints (``-1`` is accepted as an unknown,
    dynamic size). ``DistTensorSpec(shape, dist_attr)``, or
    ``DistTensorSpec(shape, mesh=..., dims_mapping=..., partial=...)``.
    """

    __slots__ = ("_eq", "_hash", "_nbytes", "dist_attr", "shape")

    shape: tuple[int, ...]
    dist_attr: TensorDistAttr
    _hash: int
    #: the result cache's estimate of the bytes this spec holds (see :func:`spec_nbytes`)
    _nbytes: int
    #: what equality compares, as one tuple (shape, dims_mapping, partial, mesh): two specs are
    #: equal when these are, a comparison made in C (the result cache compares them on a hit)
    _eq: tuple[object, ...]

    def __init__(
        self,
        shape: Iterable[int],
        dist_attr: TensorDistAttr | None = None,
        *,
        mesh: ProcessMesh | None = None,
        dims_mapping: Iterable[object] | None = None,
        partial: object = None,
    ) -> None:
        if isinstance(shape, (str, bytes)) or not isinstance(shape, Iterable):
            raise ShapeMismatchError(f"shape must be a list of ints, got {shape!r}")
        shp = tuple(shape)
        for s in shp:
            if not _is_int(s) or s < -1:
                raise ShapeMismatchError(f"shape {list(shp)!r}: sizes must be ints >= 0 (or -1)")
        if dist_attr is None:
            if mesh is None:
                raise InvalidDimsMappingError("DistTensorSpec needs a dist_attr or a mesh")
            dist_attr = TensorDistAttr(
                mesh, dims_mapping if dims_mapping is not None else (-1,) * len(shp), partial
            )
        elif not isinstance(dist_attr, TensorDistAttr):
            raise InvalidDimsMappingError(
                f"dist_attr must be a TensorDistAttr, got {type(dist_attr).__name__}"
            )
        if len(dist_attr.dims_mapping) != len(shp):
            raise InvalidDimsMappingError(
                f"dims_mapping {format_dims_mapping(dist_attr.dims_mapping)} has "
                f"{len(dist_attr.dims_mapping)} entries but the tensor has {len(shp)} dims "
                f"(shape {list(shp)})"
            )
        object.__setattr__(self, "shape", shp)
        object.__setattr__(self, "dist_attr", dist_attr)
        object.__setattr__(self, "_hash", hash((shp, hash(dist_attr))))
        object.__setattr__(self, "_nbytes", spec_nbytes(shp, dist_attr))
        object.__setattr__(self, "_eq", (shp, dist_attr.dims_mapping, dist_attr.partial, dist_attr.mesh))

    @classmethod
    def _make(cls, shape: tuple[int, ...], dist_attr: TensorDistAttr) -> DistTensorSpec:
        obj = object.__new__(cls)
        object.__setattr__(obj, "shape", shape)
        object.__setattr__(obj, "dist_attr", dist_attr)
        object.__setattr__(obj, "_hash", hash((shape, hash(dist_attr))))
        object.__setattr__(obj, "_nbytes", spec_nbytes(shape, dist_attr))
        object.__setattr__(obj, "_eq", (shape, dist_attr.dims_mapping, dist_attr.partial, dist_attr.mesh))
        return obj

    @property
    def mesh(self) -> ProcessMesh:
        return self.dist_attr.mesh

    @property
    def dims_mapping(self) -> tuple[object, ...]:
        return self.dist_attr.dims_mapping

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, DistTensorSpec):
            return NotImplemented
        return self._hash == other._hash and self._eq == other._eq

    def __hash__(self) -> int:
        return self._hash

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("DistTensorSpec is immutable")

    def __reduce__(self) -> tuple[object, ...]:
        return (DistTensorSpec, (self.shape, self.dist_attr))

    def __repr__(self) -> str:
        return f"DistTensorSpec({list(self.shape)!r}, {self.dist_attr!r})"


#: Added to :func:`spec_nbytes` for a spec whose mesh lists its process ids explicitly: such a
#: mesh is counted by the result cache once per cache generation, not per spec (the flag sends
#: the cache to its exact, slower estimate).
EXPLICIT_MESH_FLAG = 1 << 50


def spec_nbytes(shape: tuple[int, ...], dist_attr: TensorDistAttr) -> int:
    """An estimate of the bytes a spec holds (its object, shape, dist attr and dims_mapping; not
    its mesh), computed once at construction so that the result cache never walks a spec; plus
    :data:`EXPLICIT_MESH_FLAG` when the mesh has explicit process ids."""
    n = 360 + 24 * len(shape)
    if dist_attr.mesh._process_ids is not None:
        n += EXPLICIT_MESH_FLAG
    return n


#: One argument's answer: a dist attr, ``None`` for an absent optional tensor,
#: or a tuple of them for a vector argument.
ArgDistAttr = Union[TensorDistAttr, None, tuple[Union[TensorDistAttr, None], ...]]


class SpmdResult:
    """A rule's answer: the dist attrs the inputs must have and those of the outputs."""

    __slots__ = ("_hash", "inputs", "outputs")

    inputs: tuple[ArgDistAttr, ...]
    outputs: tuple[ArgDistAttr, ...]
    _hash: int | None

    def __init__(self, inputs: Sequence[object], outputs: Sequence[object]) -> None:
        ins = tuple(inputs)
        for a in ins:
            if a is not None and a.__class__ is not TensorDistAttr:
                ins = tuple(_freeze(x) for x in ins)
                break
        outs = tuple(outputs)
        for a in outs:
            if a is not None and a.__class__ is not TensorDistAttr:
                outs = tuple(_freeze(x) for x in outs)
                break
        _set_inputs(self, ins)
        _set_outputs(self, outs)
        _set_result_hash(self, None)

    def __iter__(self):  # type: ignore[no-untyped-def]
        yield self.inputs
        yield self.outputs

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SpmdResult):
            return NotImplemented
        return self.inputs == other.inputs and self.outputs == other.outputs

    def __hash__(self) -> int:
        h = self._hash
        if h is None:
            h = hash((self.inputs, self.outputs))
            _set_result_hash(self, h)
        return h

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("SpmdResult is immutable")

    def __repr__(self) -> str:
        return f"SpmdResult(inputs={list(self.inputs)!r}, outputs={list(self.outputs)!r})"


_set_inputs = SpmdResult.__dict__["inputs"].__set__
_set_outputs = SpmdResult.__dict__["outputs"].__set__
_set_result_hash = SpmdResult.__dict__["_hash"].__set__


def _freeze(a: object) -> ArgDistAttr:
    if a is None or isinstance(a, TensorDistAttr):
        return a
    if isinstance(a, (list, tuple)):
        items = tuple(_freeze(x) for x in a)
        for x in items:
            if isinstance(x, tuple):
                raise TypeError("SpmdResult: nested vectors are not supported")
        return items  # type: ignore[return-value]
    raise TypeError(f"SpmdResult entries must be TensorDistAttr, None or a list of them, got {a!r}")
