"""Sharding and assembly of numpy arrays on a simulated mesh.

Conventions (docs/simulator.md):

* Ranks are numbered row-major over the mesh shape: rank index ``r`` has the
  coordinates ``mesh.coords(r)``; ``shard`` returns one local array per rank index.
* An axis mapped to mesh dims ``(d0, d1, ...)`` (major to minor) is cut into
  ``n = size(d0) * size(d1) * ...`` pieces; the rank with coordinates ``c`` holds
  piece ``c[d0] * size(d1) * ... + c[d1] * ... + ...``.
* Uneven sizes split like ``torch.chunk`` / Paddle's balanced split: every piece
  has ``ceil(size / n)`` elements, the last ones smaller or empty.
* Partial mesh dims are split in increasing mesh-dim order and reduced back in
  decreasing order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from spmdkit.core.dist_attr import ReduceType, TensorDistAttr, entry_dims
from spmdkit.core.mesh import ProcessMesh


class AssembleError(Exception):
    """Local arrays that do not make up one global array under a dist attr."""

    def __init__(self, message: str, ranks: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)


def balanced_split(size: int, n: int) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` of ``n`` pieces of an axis of ``size`` (torch.chunk style)."""
    chunk = -(-size // n) if size > 0 else 0
    out = []
    for i in range(n):
        start = min(i * chunk, size)
        out.append((start, min(start + chunk, size)))
    return out


def piece_index(entry_mesh_dims: Sequence[int], coords: Sequence[int], mesh_shape: Sequence[int]) -> tuple[int, int]:
    """(piece index, number of pieces) of an axis sharded over ``entry_mesh_dims`` at ``coords``."""
    idx, n = 0, 1
    for d in entry_mesh_dims:
        idx = idx * mesh_shape[d] + coords[d]
        n *= mesh_shape[d]
    return idx, n


def local_slices(attr: TensorDistAttr, global_shape: Sequence[int], coords: Sequence[int]) -> tuple[slice, ...]:
    """The slice of the global array the rank at ``coords`` holds."""
    shape = attr.mesh.shape
    out = []
    for size, e in zip(global_shape, attr.dims_mapping):
        dims = entry_dims(e)
        if not dims:
            out.append(slice(0, size))
            continue
        i, n = piece_index(dims, coords, shape)
        a, b = balanced_split(size, n)[i]
        out.append(slice(a, b))
    return tuple(out)


def local_shape(attr: TensorDistAttr, global_shape: Sequence[int], coords: Sequence[int]) -> tuple[int, ...]:
    return tuple(s.stop - s.start for s in local_slices(attr, global_shape, coords))


def _check_attr(attr: TensorDistAttr, ndim: int) -> None:
    if len(attr.dims_mapping) != ndim:
        raise AssembleError(
            f"dims_mapping has {len(attr.dims_mapping)} entries for a {ndim}-D array"
        )


# -- splitting a true value into partial pieces --------------------------------------------


def _is_bool(a: np.ndarray) -> bool:
    return a.dtype == np.bool_


def _is_int(a: np.ndarray) -> bool:
    return np.issubdtype(a.dtype, np.integer)


def split_partial(value: np.ndarray, rtype: ReduceType, n: int, rng: np.random.Generator) -> list[np.ndarray]:
    """``n`` arrays that reduce with ``rtype`` to ``value``, chosen so that no other reduce
    type gives ``value`` back (asymmetric addends, scaled copies, masks, factors)."""
    v = np.asarray(value)
    if n == 1:
        return [v.copy()]
    shp = (n, *v.shape)
    pick = rng.integers(0, n, size=v.shape) if v.ndim else np.asarray(rng.integers(0, n))
    who = np.arange(n).reshape((n,) + (1,) * v.ndim) == pick  # one chosen rank per position
    if _is_bool(v):
        noise = rng.random(shp) < 0.5
        if rtype in (ReduceType.ALL, ReduceType.PROD, ReduceType.MIN):
            # false positions: one rank false, the others random; true: all true
            pieces = np.where(v, True, np.where(who, False, noise))
        else:
            pieces = np.where(v, np.where(who, True, noise), False)
        return list(pieces)
    if _is_int(v):
        if rtype == ReduceType.SUM:
            r = rng.integers(-5, 6, size=(n - 1, *v.shape)).astype(v.dtype)
            return [*list(r), (v - r.sum(axis=0)).astype(v.dtype)]
        if rtype == ReduceType.AVG:
            r = rng.integers(-5, 6, size=shp)
            e = r - np.roll(r, 1, axis=0)  # sums to zero
            return list((v + e).astype(v.dtype))
        if rtype in (ReduceType.MAX, ReduceType.MIN):
            d = rng.integers(1, 6, size=shp)
            other = v - d if rtype == ReduceType.MAX else v + d
            return list(np.where(who, v, other).astype(v.dtype))
        if rtype == ReduceType.PROD:
            return list(np.where(who, v, 1).astype(v.dtype))
        # any / all over ints: one rank holds the value, the others zero (any) / the value (all)
        other = np.zeros_like(v) if rtype == ReduceType.ANY else v
        return list(np.where(who, v, other))
    v = v.astype(np.float64) if not np.issubdtype(v.dtype, np.floating) else v
    scale = np.abs(v) + 1.0
    if rtype == ReduceType.SUM:
        r = rng.standard_normal((n - 1, *v.shape)) * scale
        return [*list(r), v - r.sum(axis=0)]
    if rtype == ReduceType.AVG:
        s = rng.uniform(0.2, 1.8, size=shp)
        s = s / s.mean(axis=0)
        r = rng.standard_normal(shp) * scale
        e = r - r.mean(axis=0)
        return list(v * s + e)
    if rtype in (ReduceType.MAX, ReduceType.MIN):
        d = rng.uniform(0.1, 1.0, size=shp) * scale
        other = v - d if rtype == ReduceType.MAX else v + d
        return list(np.where(who, v, other))
    if rtype == ReduceType.PROD:
        f = rng.uniform(0.5, 2.0, size=(n - 1, *v.shape)) * np.where(rng.random((n - 1, *v.shape)) < 0.5, -1.0, 1.0)
        return [*list(f), v / f.prod(axis=0)]
    # any / all over floats
    zero = np.zeros_like(v)
    if rtype == ReduceType.ANY:
        noise = np.where(rng.random(shp) < 0.5, v, zero)
        return list(np.where(who, v, noise))
    return list(np.where(who, v, np.where(v != 0, v, rng.uniform(0.5, 1.0, size=shp))))


def reduce_pieces(pieces: Sequence[np.ndarray], rtype: ReduceType) -> np.ndarray:
    """Combine the per-rank values of a partial tensor."""
    st = np.stack([np.asarray(p) for p in pieces])
    if _is_bool(st):
        if rtype in (ReduceType.ALL, ReduceType.PROD, ReduceType.MIN):
            return np.asarray(st.all(axis=0))
        if rtype == ReduceType.AVG:
            return np.asarray(st.mean(axis=0))
        return np.asarray(st.any(axis=0))
    if rtype == ReduceType.SUM:
        return np.asarray(st.sum(axis=0))
    if rtype == ReduceType.AVG:
        m = st.mean(axis=0)
        return np.asarray(m.astype(st.dtype) if _is_int(st) and np.all(m == np.round(m)) else m)
    if rtype == ReduceType.MAX:
        return np.asarray(st.max(axis=0))
    if rtype == ReduceType.MIN:
        return np.asarray(st.min(axis=0))
    if rtype == ReduceType.PROD:
        return np.asarray(st.prod(axis=0))
    if rtype == ReduceType.ANY:
        return np.asarray((st != 0).any(axis=0))
    return np.asarray((st != 0).all(axis=0))


# -- shard ------------------------------------------------------------------------------------


def shard(
    array: Any, dist_attr: TensorDistAttr, rng: np.random.Generator | int | None = None
) -> list[np.ndarray]:
    """The local array of every rank (index = row-major rank index on the mesh)."""
    a = np.asarray(array)
    _check_attr(dist_attr, a.ndim)
    if not isinstance(rng, np.random.Generator):
        rng = np.random.default_rng(rng)
    mesh = dist_attr.mesh
    mshape = mesh.shape
    pdims = dist_attr.partial  # sorted by mesh dim
    values: dict[tuple[int, ...], np.ndarray] = {(): a}
    for d, rt in pdims:
        nxt: dict[tuple[int, ...], np.ndarray] = {}
        for key, val in values.items():
            for i, piece in enumerate(split_partial(val, rt, mshape[d], rng)):
                nxt[(*key, i)] = piece
        values = nxt
    out = []
    for r in range(mesh.size):
        c = mesh.coords(r)
        val = values[tuple(c[d] for d, _ in pdims)]
        out.append(np.array(val[local_slices(dist_attr, a.shape, c)], copy=True))
    return out


# -- assemble ---------------------------------------------------------------------------------


def arrays_close(a: np.ndarray, b: np.ndarray, rtol: float, atol: float, *, equal_nan: bool = False) -> bool:
    """Equal shapes and values within ``rtol`` / ``atol``. A NaN equals nothing, itself included,
    unless ``equal_nan`` (only for checking that replicas agree bit for bit in where they are NaN:
    that is agreement, not a correct value; the value check against a reference stays strict).
    Infinities are compared exactly (same sign at the same position)."""
    if a.shape != b.shape:
        return False
    if a.dtype == np.bool_ or b.dtype == np.bool_ or (_is_int(a) and _is_int(b)):
        return bool(np.array_equal(a, b))
    try:
        return bool(np.allclose(a, b, rtol=rtol, atol=atol, equal_nan=equal_nan))
    except TypeError:
        return bool(np.array_equal(a, b, equal_nan=equal_nan))


def nonfinite_count(a: Any) -> int:
    """How many values of ``a`` are NaN or infinite (0 for integer, bool or non-numeric arrays)."""
    x = np.asarray(a)
    if x.dtype.kind not in "fc":
        return 0
    return int(x.size - np.count_nonzero(np.isfinite(x)))


def max_abs_error(got: Any, want: Any) -> float:
    """The largest ``|got - want|`` over the positions where both are finite (0.0 for none).
    Non-finite values are not hidden by this: callers count them with :func:`nonfinite_count`
    and fail on them; a NaN never makes a maximum look small."""
    g = np.asarray(got, dtype=np.float64)
    w = np.asarray(want, dtype=np.float64)
    if g.shape != w.shape or not g.size:
        return 0.0
    ok = np.isfinite(g) & np.isfinite(w)
    return float(np.max(np.abs(g[ok] - w[ok]))) if ok.any() else 0.0


def replica_groups(attr: TensorDistAttr) -> list[list[int]]:
    """Groups of rank indices that must hold equal values (they differ only on mesh dims
    that neither shard nor make the tensor partial)."""
    mesh = attr.mesh
    used = set(attr.sharded_mesh_dims()) | set(attr.partial_dims)
    groups: dict[tuple[int, ...], list[int]] = {}
    for r in range(mesh.size):
        c = mesh.coords(r)
        groups.setdefault(tuple(c[d] for d in range(mesh.ndim) if d in used), []).append(r)
    return list(groups.values())


def assemble(
    local_arrays: Sequence[Any],
    dist_attr: TensorDistAttr,
    global_shape: Sequence[int],
    *,
    rtol: float = 1e-7,
    atol: float = 1e-9,
) -> np.ndarray:
    """Rebuild the global array from every rank's local array.

    Checks each rank's local shape against the sharding, that ranks which should
    hold equal replicas do, then reduces partial mesh dims (with their reduce type)
    and concatenates the shards in mesh order. Raises :class:`AssembleError`
    naming the ranks where something is wrong.
    """
    mesh: ProcessMesh = dist_attr.mesh
    gshape = tuple(global_shape)
    _check_attr(dist_attr, len(gshape))
    if len(local_arrays) != mesh.size:
        raise AssembleError(f"{len(local_arrays)} local arrays for a mesh of {mesh.size} ranks")
    locs = [np.asarray(x) for x in local_arrays]
    for r, x in enumerate(locs):
        want = local_shape(dist_attr, gshape, mesh.coords(r))
        if x.shape != want:
            raise AssembleError(
                f"rank {r} (coords {list(mesh.coords(r))}) holds shape {list(x.shape)}, "
                f"the sharding gives {list(want)}",
                [r],
            )
    for group in replica_groups(dist_attr):
        first = locs[group[0]]
        # replicas that are NaN at the same places agree; whether the value is right is the caller's
        # comparison with its reference, which never counts a NaN as equal
        bad = [r for r in group[1:] if not arrays_close(first, locs[r], rtol, atol, equal_nan=True)]
        if bad:
            diff = ""
            try:
                d = np.abs(np.asarray(locs[bad[0]], dtype=np.float64) - np.asarray(first, dtype=np.float64))
                diff = f" (max abs difference {float(d.max()) if d.size else 0.0:.3g})"
            except (TypeError, ValueError):
                pass
            raise AssembleError(
                f"ranks {[group[0], *bad]} should hold equal replicas but rank(s) {bad} differ "
                f"from rank {group[0]}{diff}",
                [group[0], *bad],
            )
    pdims = [d for d, _ in dist_attr.partial]
    ptype = dict(dist_attr.partial)
    shard_dims = sorted(set(dist_attr.sharded_mesh_dims()))
    # one representative rank per (shard coords, partial coords): replica coords 0
    reps: dict[tuple[int, ...], dict[tuple[int, ...], np.ndarray]] = {}
    coords_of: dict[tuple[int, ...], tuple[int, ...]] = {}
    rep_dims = set(shard_dims) | set(pdims)
    for r in range(mesh.size):
        c = mesh.coords(r)
        if any(c[d] != 0 for d in range(mesh.ndim) if d not in rep_dims):
            continue
        skey = tuple(c[d] for d in shard_dims)
        reps.setdefault(skey, {})[tuple(c[d] for d in pdims)] = locs[r]
        coords_of[skey] = c
    pieces: dict[tuple[int, ...], np.ndarray] = {}
    for skey, vals in reps.items():
        cur = vals
        for k in range(len(pdims) - 1, -1, -1):
            grouped: dict[tuple[int, ...], list[np.ndarray]] = {}
            for key in sorted(cur):
                grouped.setdefault(key[:k], []).append(cur[key])
            cur = {key: reduce_pieces(v, ptype[pdims[k]]) for key, v in grouped.items()}
        pieces[skey] = cur[()]
    sample = next(iter(pieces.values()))
    out = np.zeros(gshape, dtype=sample.dtype)
    for skey, val in pieces.items():
        sl = local_slices(dist_attr, gshape, coords_of[skey])
        out[sl] = val
    return out


__all__ = [
    "AssembleError",
    "arrays_close",
    "assemble",
    "balanced_split",
    "local_shape",
    "local_slices",
    "max_abs_error",
    "nonfinite_count",
    "piece_index",
    "reduce_pieces",
    "replica_groups",
    "shard",
    "split_partial",
]
