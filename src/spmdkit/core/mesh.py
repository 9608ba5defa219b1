"""ProcessMesh: an n-D grid of ranks."""

from __future__ import annotations

from collections.abc import Sequence

from spmdkit.core.errors import InvalidMeshError


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class ProcessMesh:
    """An immutable n-D grid of process ids with optional dim names.

    ``ProcessMesh([2, 4])`` is ranks 0..7 laid out row-major; ``dim_names`` default
    to ``d0, d1, ...``.
    """

    __slots__ = ("_dim_names", "_hash", "_process_ids", "_shape")

    _shape: tuple[int, ...]
    _process_ids: tuple[int, ...]
    _dim_names: tuple[str, ...]
    _hash: int

    def __init__(
        self,
        shape: Sequence[int],
        process_ids: Sequence[int] | None = None,
        dim_names: Sequence[str] | None = None,
    ) -> None:
        if isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence):
            raise InvalidMeshError(f"mesh shape must be a list of positive ints, got {shape!r}")
        shp = tuple(shape)
        if not shp:
            raise InvalidMeshError("mesh shape must have at least one dim")
        for s in shp:
            if not _is_int(s) or s <= 0:
                raise InvalidMeshError(f"mesh shape must be positive ints, got {list(shp)!r}")
        n = 1
        for s in shp:
            n *= s
        if process_ids is None:
            ids = tuple(range(n))
        else:
            if isinstance(process_ids, (str, bytes)) or not isinstance(process_ids, Sequence):
                raise InvalidMeshError(f"process_ids must be a list of ints, got {process_ids!r}")
            ids = tuple(process_ids)
            if len(ids) != n:
                raise InvalidMeshError(
                    f"process_ids has {len(ids)} entries but mesh shape {list(shp)} holds {n} ranks"
                )
            for p in ids:
                if not _is_int(p) or p < 0:
                    raise InvalidMeshError(f"process_ids must be non-negative ints, got {p!r}")
            if len(set(ids)) != n:
                raise InvalidMeshError(f"process_ids has duplicates: {list(ids)!r}")
        if dim_names is None:
            names = tuple(f"d{i}" for i in range(len(shp)))
        else:
            if isinstance(dim_names, (str, bytes)) or not isinstance(dim_names, Sequence):
                raise InvalidMeshError(f"dim_names must be a list of strings, got {dim_names!r}")
            names = tuple(dim_names)
            if len(names) != len(shp):
                raise InvalidMeshError(
                    f"dim_names has {len(names)} entries but the mesh has {len(shp)} dims"
                )
            for nm in names:
                if not isinstance(nm, str) or not nm:
                    raise InvalidMeshError(f"dim_names must be non-empty strings, got {nm!r}")
            if len(set(names)) != len(names):
                raise InvalidMeshError(f"dim_names has duplicates: {list(names)!r}")
        self._shape = shp
        self._process_ids = ids
        self._dim_names = names
        self._hash = hash((shp, ids, names))

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def size(self) -> int:
        return len(self._process_ids)

    @property
    def process_ids(self) -> tuple[int, ...]:
        return self._process_ids

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
        if hasattr(self, "_hash"):
            raise AttributeError("ProcessMesh is immutable")
        object.__setattr__(self, name, value)

    def __reduce__(self) -> tuple[object, ...]:
        return (ProcessMesh, (self._shape, self._process_ids, self._dim_names))

    def __repr__(self) -> str:
        default_ids = self._process_ids == tuple(range(len(self._process_ids)))
        default_names = self._dim_names == tuple(f"d{i}" for i in range(len(self._shape)))
        parts = [repr(list(self._shape))]
        if not default_ids:
            parts.append(f"process_ids={list(self._process_ids)!r}")
        if not default_names:
            parts.append(f"dim_names={list(self._dim_names)!r}")
        return f"ProcessMesh({', '.join(parts)})"
