"""ReduceType and TensorDistAttr: how one tensor lies on a mesh."""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from typing import Union

from spmdkit.core.errors import InvalidDimsMappingError, InvalidPartialError
from spmdkit.core.mesh import ProcessMesh

#: One dims_mapping entry: -1 (not sharded), a mesh dim, or a tuple of mesh dims
#: (co-sharded, major to minor).
Entry = Union[int, tuple[int, ...]]
DimsMapping = tuple[Entry, ...]


class ReduceType(enum.StrEnum):
    """How the per-rank values of a partial tensor combine into the true value."""

    SUM = "sum"
    AVG = "avg"
    MAX = "max"
    MIN = "min"
    PROD = "prod"
    ANY = "any"
    ALL = "all"

    @classmethod
    def parse(cls, value: object) -> ReduceType:
        if isinstance(value, ReduceType):
            return value
        if isinstance(value, str):
            v = value.lower()
            if v == "product":
                v = "prod"
            if v == "mean":
                v = "avg"
            for member in cls:
                if member.value == v:
                    return member
        raise InvalidPartialError(
            f"unknown reduce type {value!r}; expected one of "
            + ", ".join(m.value for m in cls)
        )

    def __str__(self) -> str:
        return self.value


Partial = tuple[tuple[int, ReduceType], ...]

_NO_PARTIAL: Partial = ()


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def normalize_entry(entry: object, mesh_ndim: int, where: str = "dims_mapping") -> Entry:
    """Validate one dims_mapping entry and return its canonical form."""
    if _is_int(entry):
        assert isinstance(entry, int)
        if entry == -1:
            return -1
        if not 0 <= entry < mesh_ndim:
            raise InvalidDimsMappingError(
                f"{where}: mesh dim {entry} out of range for a {mesh_ndim}-D mesh"
            )
        return entry
    if isinstance(entry, (list, tuple)):
        dims = [d for d in entry if not (_is_int(d) and d == -1)]
        for d in dims:
            if not _is_int(d) or not 0 <= d < mesh_ndim:
                raise InvalidDimsMappingError(
                    f"{where}: mesh dim {d!r} out of range for a {mesh_ndim}-D mesh"
                )
        if len(set(dims)) != len(dims):
            raise InvalidDimsMappingError(f"{where}: mesh dim used twice in co-shard {list(entry)!r}")
        if not dims:
            return -1
        if len(dims) == 1:
            return int(dims[0])
        return tuple(int(d) for d in dims)
    raise InvalidDimsMappingError(
        f"{where}: entry {entry!r} is not -1, a mesh dim or a list of mesh dims"
    )


def entry_dims(entry: Entry) -> tuple[int, ...]:
    """The mesh dims of one entry, major to minor (empty when not sharded)."""
    if isinstance(entry, tuple):
        return entry
    return () if entry < 0 else (entry,)


def largest_shard(dims_mapping: Sequence[Entry], shape: Sequence[int], mesh_shape: Sequence[int]) -> tuple[int, ...]:
    """The shape of the largest local shard of a tensor of ``shape`` sharded by ``dims_mapping``
    on a mesh of ``mesh_shape`` (an uneven split: its first, largest, piece)."""
    out = []
    for size, e in zip(shape, dims_mapping):
        k = 1
        for d in entry_dims(e):
            k *= mesh_shape[d]
        out.append(-(-size // k) if k > 1 else size)
    return tuple(out)


def dims_entry(dims: Sequence[int]) -> Entry:
    """Inverse of :func:`entry_dims`."""
    if not dims:
        return -1
    if len(dims) == 1:
        return dims[0]
    return tuple(dims)


def normalize_partial(partial: object, mesh_ndim: int) -> Partial:
    """Partial status in canonical form: sorted ``((mesh_dim, ReduceType), ...)``."""
    if partial is None:
        return _NO_PARTIAL
    items: list[tuple[object, object]]
    if isinstance(partial, Mapping):
        items = list(partial.items())
    elif isinstance(partial, (list, tuple, set, frozenset)):
        items = []
        for p in partial:
            if isinstance(p, tuple) and len(p) == 2:
                items.append((p[0], p[1]))
            else:
                items.append((p, ReduceType.SUM))
    else:
        raise InvalidPartialError(
            f"partial must be a list of mesh dims or a mapping mesh dim -> reduce type, got {partial!r}"
        )
    out: dict[int, ReduceType] = {}
    for k, v in items:
        if isinstance(k, str):
            try:
                k = int(k)
            except ValueError:
                raise InvalidPartialError(f"partial: mesh dim {k!r} is not an int") from None
        if not _is_int(k) or not 0 <= int(str(k)) < mesh_ndim:
            raise InvalidPartialError(f"partial: mesh dim {k!r} out of range for a {mesh_ndim}-D mesh")
        kk = int(str(k))
        if kk in out:
            raise InvalidPartialError(f"partial: mesh dim {kk} given twice")
        out[kk] = ReduceType.parse(v)
    return tuple(sorted(out.items()))


class TensorDistAttr:
    """Mesh + dims_mapping + partial status of one tensor. Immutable and hashable.

    ``dims_mapping`` entries: ``-1``, a mesh dim, or a tuple of mesh dims (co-shard).
    ``partial``: a mapping mesh dim -> :class:`ReduceType` (or a list of mesh dims,
    meaning SUM). A mesh dim shards at most one axis and is never both sharding and
    partial.
    """

    __slots__ = ("_hash", "dims_mapping", "mesh", "partial")

    mesh: ProcessMesh
    dims_mapping: DimsMapping
    partial: Partial
    _hash: int | None

    def __init__(
        self,
        mesh: ProcessMesh,
        dims_mapping: Iterable[object],
        partial: object = None,
    ) -> None:
        if not isinstance(mesh, ProcessMesh):
            raise InvalidDimsMappingError(f"mesh must be a ProcessMesh, got {type(mesh).__name__}")
        if isinstance(dims_mapping, (str, bytes)) or not isinstance(dims_mapping, Iterable):
            raise InvalidDimsMappingError(f"dims_mapping must be a list, got {dims_mapping!r}")
        nd = mesh.ndim
        dm = tuple(normalize_entry(e, nd) for e in dims_mapping)
        used: set[int] = set()
        for e in dm:
            for d in entry_dims(e):
                if d in used:
                    raise InvalidDimsMappingError(
                        f"dims_mapping {_fmt_dm(dm)}: mesh dim {d} shards more than one axis"
                    )
                used.add(d)
        pt = normalize_partial(partial, nd)
        for d, _ in pt:
            if d in used:
                raise InvalidPartialError(
                    f"mesh dim {d} is both partial and sharding in dims_mapping {_fmt_dm(dm)}"
                )
        _init(self, mesh, dm, pt)

    @classmethod
    def _make(cls, mesh: ProcessMesh, dims_mapping: DimsMapping, partial: Partial = _NO_PARTIAL) -> TensorDistAttr:
        """Build without validation (engine-internal: the caller guarantees legality)."""
        obj = _new(cls)
        _set_mesh(obj, mesh)
        _set_dm(obj, dims_mapping)
        _set_partial(obj, partial)
        _set_hash(obj, None)
        return obj

    #: The public name of :meth:`_make` for rules and the engine: a dist attr built without
    #: validation, for answers that are legal by construction (each mesh dim shards at most one
    #: axis and is never also partial; ``partial`` sorted by mesh dim).
    unchecked = _make

    @classmethod
    def replicated(cls, mesh: ProcessMesh, ndim: int) -> TensorDistAttr:
        return cls._make(mesh, (-1,) * ndim)

    # -- queries ---------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.dims_mapping)

    @property
    def partial_dims(self) -> tuple[int, ...]:
        return tuple(d for d, _ in self.partial)

    @property
    def partial_status(self) -> dict[int, ReduceType]:
        return dict(self.partial)

    def is_partial(self) -> bool:
        return bool(self.partial)

    def is_replicated(self) -> bool:
        return not self.partial and all(e == -1 for e in self.dims_mapping)

    def sharded_mesh_dims(self) -> tuple[int, ...]:
        out: list[int] = []
        for e in self.dims_mapping:
            out.extend(entry_dims(e))
        return tuple(out)

    def replace(self, dims_mapping: Iterable[object] | None = None, partial: object = ...) -> TensorDistAttr:
        """A copy with some fields changed (validated)."""
        dm = self.dims_mapping if dims_mapping is None else dims_mapping
        pt: object = self.partial if partial is ... else partial
        return TensorDistAttr(self.mesh, dm, pt)

    # -- dunder ----------------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, TensorDistAttr):
            return NotImplemented
        return (
            self.dims_mapping == other.dims_mapping
            and self.partial == other.partial
            and self.mesh == other.mesh
        )

    def __hash__(self) -> int:
        h = self._hash
        if h is None:  # computed on first use: most dist attrs are never hashed
            h = hash((self.dims_mapping, self.partial, self.mesh._hash))
            _set_hash(self, h)
        return h

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("TensorDistAttr is immutable")

    def __reduce__(self) -> tuple[object, ...]:
        return (TensorDistAttr, (self.mesh, self.dims_mapping, dict(self.partial)))

    def __repr__(self) -> str:
        s = f"TensorDistAttr({self.mesh!r}, {_fmt_dm(self.dims_mapping)}"
        if self.partial:
            s += ", partial={" + ", ".join(f"{d}: {r.value!r}" for d, r in self.partial) + "}"
        return s + ")"


# the slots' own setters: faster than object.__setattr__, and they bypass the
# immutability guard of __setattr__ (construction only)
_set_mesh = TensorDistAttr.__dict__["mesh"].__set__
_set_dm = TensorDistAttr.__dict__["dims_mapping"].__set__
_set_partial = TensorDistAttr.__dict__["partial"].__set__
_set_hash = TensorDistAttr.__dict__["_hash"].__set__
_new = object.__new__


def _init(obj: TensorDistAttr, mesh: ProcessMesh, dm: DimsMapping, pt: Partial) -> None:
    _set_mesh(obj, mesh)
    _set_dm(obj, dm)
    _set_partial(obj, pt)
    _set_hash(obj, None)


def _fmt_dm(dm: DimsMapping) -> str:
    return "[" + ", ".join(str(list(e)) if isinstance(e, tuple) else str(e) for e in dm) + "]"


def format_dims_mapping(dm: DimsMapping) -> str:
    """``[0, -1, [1, 2]]`` style text of a dims_mapping."""
    return _fmt_dm(dm)
