"""ProcessMesh: an n-D grid of ranks.

Meshes are interned: ``ProcessMesh([2, 4]) is ProcessMesh([2, 4])``, so a million cases on one
mesh hold one mesh object. Default process ids (``0..n-1``) are not stored as a tuple. A mesh
holds at most :data:`MAX_MESH_RANKS` ranks and :data:`MAX_MESH_DIMS` dims; a larger one is an
:class:`~spmdkit.core.errors.InvalidMeshError` before anything is allocated.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from typing import Any

from spmdkit.core.errors import InvalidMeshError

#: The most ranks a mesh may hold (2**20 = 1,048,576).
MAX_MESH_RANKS = 2**20
#: The most dims a mesh may have.
MAX_MESH_DIMS = 64
#: The intern table keeps at most this many meshes ...
_INTERN_LIMIT = 4096
#: ... and at most this many explicitly listed process ids over all of them (it is emptied when
#: either bound would be passed; a mesh dropped from it stays valid, it is only no longer shared).
_INTERN_ID_LIMIT = 2**20

_interned: dict[Any, ProcessMesh] = {}
_interned_ids = 0


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _short(v: Any) -> str:
    try:
        s = repr(v)
    except Exception:
        s = f"<{type(v).__name__}>"
    return s if len(s) <= 100 else s[:60] + " ... " + s[-30:]


def clear_mesh_cache() -> None:
    """Forget every interned mesh (existing meshes stay valid)."""
    global _interned_ids
    _interned.clear()
    _interned_ids = 0


class ProcessMesh:
    """An immutable n-D grid of process ids with optional dim names.

    ``ProcessMesh([2, 4])`` is ranks 0..7 laid out row-major; ``dim_names`` default
    to ``d0, d1, ...``. Equal meshes built while the intern table holds them are one object.
    """

    __slots__ = ("_dim_names", "_hash", "_process_ids", "_shape", "_size")

    _shape: tuple[int, ...]
    _process_ids: tuple[int, ...] | None  # None: the default 0..n-1
    _dim_names: tuple[str, ...]
    _hash: int
    _size: int

    def __new__(
        cls,
        shape: Sequence[int],
        process_ids: Sequence[int] | None = None,
        dim_names: Sequence[str] | None = None,
    ) -> ProcessMesh:
        global _interned_ids
        if process_ids is None and dim_names is None and shape.__class__ in (list, tuple):
            # the common call: look up before validating (only exact ints can match a stored key)
            key: Any = tuple(shape)
            for s in key:
                if s.__class__ is not int:
                    break
            else:
                hit = _interned.get((key, None, None))
                if hit is not None:
                    return hit
        if isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence):
            raise InvalidMeshError(f"mesh shape must be a list of positive ints, got {_short(shape)}")
        if len(shape) > MAX_MESH_DIMS:
            raise InvalidMeshError(f"mesh shape has {len(shape)} dims, at most {MAX_MESH_DIMS} are allowed")
        shp = tuple(shape)
        if not shp:
            raise InvalidMeshError("mesh shape must have at least one dim")
        for s in shp:
            if not _is_int(s) or s <= 0:
                raise InvalidMeshError(f"mesh shape must be positive ints, got {_short(list(shp))}")
        n = 1
        for s in shp:
            n *= s
            if n > MAX_MESH_RANKS:
                raise InvalidMeshError(
                    f"mesh shape {_short(list(shp))} holds more than {MAX_MESH_RANKS} ranks "
                    f"(MAX_MESH_RANKS)"
                )
        ids: tuple[int, ...] | None = None
        if process_ids is not None:
            if isinstance(process_ids, (str, bytes)) or not isinstance(process_ids, Sequence):
                raise InvalidMeshError(f"process_ids must be a list of ints, got {_short(process_ids)}")
            if len(process_ids) != n:
                raise InvalidMeshError(
                    f"process_ids has {len(process_ids)} entries but mesh shape {list(shp)} holds {n} ranks"
                )
            ids = tuple(process_ids)
            for p in ids:
                if not _is_int(p) or p < 0:
                    raise InvalidMeshError(f"process_ids must be non-negative ints, got {_short(p)}")
            # sorted, not a set: a mesh of 2**20 ids is checked without a second table of them
            srt = sorted(ids)
            for a, b in pairwise(srt):
                if a == b:
                    raise InvalidMeshError(f"process_ids has duplicates ({a} twice): {_short(list(ids))}")
            del srt
            for i, p in enumerate(ids):
                if i != p:
                    break
            else:
                ids = None  # the default 0..n-1: not stored
        default_names = tuple(f"d{i}" for i in range(len(shp)))
        if dim_names is None:
            names = default_names
        else:
            if isinstance(dim_names, (str, bytes)) or not isinstance(dim_names, Sequence):
                raise InvalidMeshError(f"dim_names must be a list of strings, got {_short(dim_names)}")
            names = tuple(dim_names)
            if len(names) != len(shp):
                raise InvalidMeshError(
                    f"dim_names has {len(names)} entries but the mesh has {len(shp)} dims"
                )
            for nm in names:
                if not isinstance(nm, str) or not nm:
                    raise InvalidMeshError(f"dim_names must be non-empty strings, got {_short(nm)}")
            if len(set(names)) != len(names):
                raise InvalidMeshError(f"dim_names has duplicates: {_short(list(names))}")
        ikey = (shp, ids, None if names == default_names else names)
        hit = _interned.get(ikey)
        if hit is not None:
            return hit
        self = object.__new__(cls)
        object.__setattr__(self, "_shape", shp)
        object.__setattr__(self, "_process_ids", ids)
        object.__setattr__(self, "_dim_names", names)
        object.__setattr__(self, "_size", n)
        object.__setattr__(self, "_hash", hash(ikey))
        n_ids = 0 if ids is None else n
        if len(_interned) >= _INTERN_LIMIT or _interned_ids + n_ids > _INTERN_ID_LIMIT:
            clear_mesh_cache()
        if n_ids <= _INTERN_ID_LIMIT:
            _interned[ikey] = self
            _interned_ids += n_ids
        return self

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def size(self) -> int:
        return self._size

    @property
    def process_ids(self) -> tuple[int, ...]:
        ids = self._process_ids
        return tuple(range(self._size)) if ids is None else ids

    @property
    def dim_names(self) -> tuple[str, ...]:
        return self._dim_names

    def dim_size(self, dim: int | str) -> int:
        """Size of a mesh dim given by index or by name."""
        return self._shape[self.dim_index(dim)]

    def dim_index(self, dim: int | str) -> int:
        if isinstance(dim, str):
            try:
                return self._dim_names.index(dim)
            except ValueError:
                raise InvalidMeshError(
                    f"mesh has no dim named {dim!r} (dims: {list(self._dim_names)})"
                ) from None
        if not _is_int(dim) or not 0 <= dim < len(self._shape):
            raise InvalidMeshError(f"mesh dim {dim!r} out of range for a {len(self._shape)}-D mesh")
        return dim

    def coords(self, rank_index: int) -> tuple[int, ...]:
        """Mesh coordinates of the rank at position ``rank_index`` (row-major)."""
        out = []
        for s in reversed(self._shape):
            out.append(rank_index % s)
            rank_index //= s
        return tuple(reversed(out))

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, ProcessMesh):
            return NotImplemented
        return (
            self._hash == other._hash
            and self._shape == other._shape
            and self._process_ids == other._process_ids
            and self._dim_names == other._dim_names
        )

    def __hash__(self) -> int:
        return self._hash

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("ProcessMesh is immutable")

    def __reduce__(self) -> tuple[object, ...]:
        return (ProcessMesh, (self._shape, self._process_ids, self._dim_names))

    def __repr__(self) -> str:
        default_ids = self._process_ids is None
        default_names = self._dim_names == tuple(f"d{i}" for i in range(len(self._shape)))
        parts = [repr(list(self._shape))]
        if not default_ids:
            parts.append(f"process_ids={_short(list(self.process_ids))}")
        if not default_names:
            parts.append(f"dim_names={list(self._dim_names)!r}")
        return f"ProcessMesh({', '.join(parts)})"
