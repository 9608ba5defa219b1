"""The view algebra: how each output axis of a reshape-like op is made of input axes.

An output axis is one of

- ``InputDim(k)``: input axis ``k`` unchanged;
- ``Singleton()``: a new size-1 axis made of nothing;
- ``Flatten((k0, k1, ...))``: input axes ``k0, k1, ...`` (adjacent, major to minor) merged;
- ``Split(source, shape, piece)``: piece ``piece`` of ``source`` (an ``InputDim`` or a
  ``Flatten``) split into ``shape``.

``reshape_trans``, ``flatten_trans``, ``squeeze_trans`` and ``unsqueeze_trans`` build the list
for each op; ``infer_from_trans`` moves a dims_mapping through a list. The propagation
follows Paddle 3.3.1 (``dim_trans.cc``):

- ``InputDim``: the axis keeps its sharding (co-sharding included, even when uneven: the
  axis is not cut);
- ``Flatten``: only the leftmost input axis's sharding can pass; if it is sharded, the mesh
  dims of the following sharded axes are appended (co-shard), and the longest prefix of those
  mesh dims whose product divides the leftmost axis's size is kept; the other flattened axes
  are replicated;
- ``Split``: only piece 0 can keep the source's sharding, and only if its size is divisible
  by the mesh dims (all of an ``InputDim``'s mesh dims; a prefix of a ``Flatten``'s);
- input axes feeding nothing (size-1 axes dropped by a reshape or a squeeze) are replicated.

The returned input dims_mapping says what must be resharded. Every case is sound: each rank's
local block of the input is the local block of the output in the same (row-major) order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple, Union

from spmdkit.core.dist_attr import dims_entry, entry_dims
from spmdkit.core.errors import InvalidAttributeError, ShapeMismatchError
from spmdkit.engine.memo import memo

Entry = Union[int, tuple[int, ...]]  # a dims_mapping entry: -1, a mesh dim, or co-shard dims


class InputDim(NamedTuple):
    dim: int

    def __repr__(self) -> str:
        return f"InputDim({self.dim})"


class Singleton(NamedTuple):
    def __repr__(self) -> str:
        return "Singleton()"


class Flatten(NamedTuple):
    dims: tuple[int, ...]

    def __repr__(self) -> str:
        return f"Flatten({','.join(map(str, self.dims))})"


class Split(NamedTuple):
    source: InputDim | Flatten
    shape: tuple[int, ...]
    piece: int

    def __repr__(self) -> str:
        return f"Split({self.source!r},{self.shape},{self.piece})"


DimTrans = Union[InputDim, Singleton, Flatten, Split]



# -- building the lists -------------------------------------------------------------------------


def resolve_target(op: str, shape: Sequence[int], x_shape: Sequence[int], arg: str = "shape") -> tuple[int, ...]:
    """Paddle's reshape target: 0 copies x's size at that index, one -1 is inferred.

    x may have dynamic (-1) sizes: each must be copied by a 0 at its own index, with the same
    number of elements (of the known sizes) before it in x and in the target, so that it stays
    one axis of its own; the -1 of the target is then inferred from the known sizes."""
    if -1 not in x_shape:
        fast = True
        for t in shape:
            if t.__class__ is not int or t <= 0:
                fast = False
                break
        if fast:
            n = math.prod(x_shape)
            if math.prod(shape) == n:
                return shape if shape.__class__ is tuple else tuple(shape)
    out: list[int] = []
    infer = -1
    for i, t in enumerate(shape):
        t = int(t)
        if t == 0:
            if i >= len(x_shape):
                raise InvalidAttributeError(
                    f"{op}: {arg} {list(shape)} has 0 at index {i} but x has only {len(x_shape)} dims")
            t = int(x_shape[i])
            if t == -1:
                out.append(-1)
                continue
        elif t == -1:
            if infer >= 0:
                raise InvalidAttributeError(f"{op}: {arg} {list(shape)} has more than one -1")
            infer = i
        elif t < 0:
            raise InvalidAttributeError(f"{op}: {arg} {list(shape)} has a negative size {t}")
        out.append(t)
    dynamic = [i for i, v in enumerate(x_shape) if v == -1]
    for i in dynamic:
        if i >= len(shape) or int(shape[i]) != 0:
            raise ShapeMismatchError(
                f"{op}: x has a dynamic (-1) size at axis {i} (shape {list(x_shape)}); {arg} {list(shape)} must "
                f"copy it with 0 at index {i}")
    n = math.prod(v for v in x_shape if v != -1)
    if infer >= 0:
        rest = math.prod(v for j, v in enumerate(out) if j != infer and v != -1)
        if rest == 0 or n % rest:
            raise InvalidAttributeError(f"{op}: {arg} {list(shape)}: cannot infer -1 for x of shape {list(x_shape)}")
        out[infer] = n // rest
    got = math.prod(v for v in out if v != -1)
    if got != n:
        raise InvalidAttributeError(
            f"{op}: {arg} {list(shape)} holds {got} elements but x of shape {list(x_shape)} has {n}")
    for i in dynamic:
        if math.prod(v for v in x_shape[:i] if v != -1) != math.prod(v for v in out[:i] if v != -1):
            raise ShapeMismatchError(
                f"{op}: x of shape {list(x_shape)} and {arg} {list(shape)} do not hold the same elements before "
                f"the dynamic axis {i}")
    return tuple(out)


def _check_shape(op: str, shape: Sequence[int], what: str) -> None:
    for s in shape:
        if s <= 0:
            raise ShapeMismatchError(f"{op}: {what} has shape {list(shape)}; view rules need sizes >= 1")


def _check_counts(src: tuple[int, ...], tgt: tuple[int, ...]) -> None:
    if -1 not in src and -1 not in tgt:
        if math.prod(src) != math.prod(tgt):
            raise ShapeMismatchError(f"reshape: {list(src)} and {list(tgt)} hold different element counts")
        return
    if math.prod(v for v in src if v != -1) != math.prod(v for v in tgt if v != -1) or src.count(-1) != tgt.count(-1):
        raise ShapeMismatchError(f"reshape: {list(src)} and {list(tgt)} hold different element counts")


@memo()
def reshape_infer(
    src: tuple[int, ...], tgt: tuple[int, ...], dm: tuple[Entry, ...], mesh_shape: tuple[int, ...],
    checked: bool = False,
) -> tuple[tuple[Entry, ...], tuple[Entry, ...]]:
    """``infer_from_trans(reshape_trans(src, tgt), src, dm, mesh_shape)`` in one pass on ints,
    without building the list (the reshape rule's hot path; tests check both agree).
    ``checked``: the caller has already checked that src and tgt hold the same elements
    (``resolve_target`` does)."""
    if not checked:
        _check_counts(src, tgt)
    ns, nt = len(src), len(tgt)
    new_in: list[Entry] = [-1] * ns
    out: list[Entry] = [-1] * nt
    si = ti = 0
    while si < ns or ti < nt:
        s0, t0 = si, ti
        if si < ns:
            s = src[si]
            si += 1
            if s == -1:  # a dynamic axis, copied
                out[ti] = new_in[s0] = dm[s0]
                ti += 1
                continue
        else:
            s = 1
        if ti < nt:
            t = tgt[ti]
            ti += 1
        else:
            t = 1
        if s == 1:
            if t == 1:
                if si > s0 and ti > t0:  # 1 -> 1 keeps its sharding
                    out[t0] = new_in[s0] = dm[s0]
                continue
            ti -= 1  # a size-1 source axis feeds nothing
            continue
        if t == 1:
            si -= 1  # a new size-1 output axis (Singleton)
            continue
        while s != t:
            if s < t:
                s *= src[si]
                si += 1
            else:
                t *= tgt[ti]
                ti += 1
        k = s0
        while src[k] == 1:
            k += 1
        e = dm[k]
        if e == -1:
            continue
        one = ti - t0 == 1
        if one and (si - s0 == 1 or all(src[j] == 1 for j in range(k + 1, si))):
            out[t0] = new_in[k] = e  # InputDim: kept as it is
            continue
        size = tgt[t0]
        if size == 1:
            continue
        # the longest run of the sharded axes from k on (size-1 axes skipped) whose mesh product
        # divides src[k] and, for a Split, the leftmost piece: _prefix(_flatten_dims(...)) inline
        lead = src[k]
        p = 1
        keep: list[int] = []
        for j in range(k, si):
            if src[j] == 1:
                continue
            g = dm[j]
            if isinstance(g, int):
                if g < 0:
                    break
                p *= mesh_shape[g]
                if lead % p or (not one and size % p):
                    break
                keep.append(g)
            else:
                for d in g:
                    p *= mesh_shape[d]
                if lead % p or (not one and size % p):
                    break
                keep.extend(g)
        if keep:
            out[t0] = new_in[k] = keep[0] if len(keep) == 1 else tuple(keep)
    return tuple(new_in), tuple(out)


@memo()
def reshape_trans(src: tuple[int, ...], tgt: tuple[int, ...]) -> tuple[DimTrans, ...]:
    """The list for reshaping ``src`` into ``tgt`` (both resolved, same element count; a
    dynamic (-1) size is an axis of its own at the same index in both, see resolve_target)."""
    _check_counts(src, tgt)
    ret: list[DimTrans] = []
    si = ti = 0
    ns, nt = len(src), len(tgt)
    while si < ns or ti < nt:
        if si < ns and src[si] == -1:
            ret.append(InputDim(si))
            si += 1
            ti += 1
            continue
        dims: list[int] = []
        pieces: list[int] = []
        if si < ns:
            s = src[si]
            dims.append(si)
            si += 1
        else:
            s = 1
        if ti < nt:
            t = tgt[ti]
            pieces.append(t)
            ti += 1
        else:
            t = 1
        if s == 1 and t == 1 and dims and pieces:
            ret.append(InputDim(dims[0]))  # a 1 -> 1 axis keeps its sharding
            continue
        if s == 1 and t != 1:
            ti -= 1  # the size-1 source axis feeds nothing
            continue
        if s != 1 and t == 1:
            si -= 1
            if pieces:
                ret.append(Singleton())
            continue
        while s != t:
            if s < t:
                dims.append(si)
                s *= src[si]
                si += 1
            else:
                pieces.append(tgt[ti])
                t *= tgt[ti]
                ti += 1
        if not pieces:
            continue
        real = tuple(d for d in dims if src[d] > 1)
        source: DimTrans
        if not real:
            source = Singleton()
        elif len(real) == 1:
            source = InputDim(real[0])
        else:
            source = Flatten(real)
        if len(pieces) == 1:
            ret.append(source)
            continue
        shp = tuple(pieces)
        for i, p in enumerate(pieces):
            if p == 1 or isinstance(source, Singleton):
                ret.append(Singleton())
            else:
                ret.append(Split(source, shp, i))
    return tuple(ret)


def norm_axis(op: str, axis: int, ndim: int, arg: str, extra: int = 0) -> int:
    """``axis`` in ``[-ndim - extra, ndim + extra)`` made non-negative."""
    lo, hi = -ndim - extra, ndim + extra
    if not lo <= axis < hi:
        raise InvalidAttributeError(f"{op}: {arg} {axis} is out of range [{lo}, {hi - 1}] for a {ndim}-D x")
    return axis + hi if axis < 0 else axis


@memo()
def flatten_trans(shape: tuple[int, ...], start: int, stop: int) -> tuple[tuple[DimTrans, ...], tuple[int, ...]]:
    """(list, out shape) for flatten(start_axis, stop_axis); start_axis after stop_axis (once
    negative axes are counted from the end) is an error, as in the op (Paddle's rule answers
    the identity for it: deviation view-invalid-attr)."""
    nd = len(shape)
    if nd == 0:
        raise InvalidAttributeError("flatten: x is 0-D; start_axis and stop_axis must be less than its rank 0")
    a = norm_axis("flatten", start, nd, "start_axis")
    b = norm_axis("flatten", stop, nd, "stop_axis")
    if a > b:
        raise InvalidAttributeError(
            f"flatten: start_axis {start} comes after stop_axis {stop} for a {nd}-D x (the op rejects it)")
    if a == b:
        return tuple(InputDim(i) for i in range(nd)), shape
    real = tuple(i for i in range(a, b + 1) if shape[i] != 1)
    mid: DimTrans
    if not real:
        mid = InputDim(a)
    elif len(real) == 1:
        mid = InputDim(real[0])
    else:
        mid = Flatten(real)
    trans = (*(InputDim(i) for i in range(a)), mid, *(InputDim(i) for i in range(b + 1, nd)))
    return trans, (*shape[:a], math.prod(shape[a:b + 1]), *shape[b + 1:])


@memo()
def squeeze_trans(shape: tuple[int, ...], axis: tuple[int, ...]) -> tuple[tuple[DimTrans, ...], tuple[int, ...]]:
    """(list, out shape) for squeeze(axis): size-1 axes in ``axis`` (all of them when empty)
    go; a listed axis of another size stays; a kept size-1 axis becomes a Singleton."""
    nd = len(shape)
    drop = {norm_axis("squeeze", int(a), max(nd, 1), "axis") for a in axis} if axis else None
    trans: list[DimTrans] = []
    out: list[int] = []
    for i, s in enumerate(shape):
        if s == 1:
            if drop is None or i in drop:
                continue
            trans.append(Singleton())
        else:
            trans.append(InputDim(i))
        out.append(s)
    return tuple(trans), tuple(out)


@memo()
def unsqueeze_trans(shape: tuple[int, ...], axis: tuple[int, ...]) -> tuple[tuple[DimTrans, ...], tuple[int, ...]]:
    """(list, out shape) for unsqueeze(axis), inserting one axis after another as the op does
    (a negative axis counts from the end of the tensor built so far)."""
    nd = len(shape)
    new = [False] * (nd + len(axis))
    rank = nd
    for a in axis:
        a = int(a)
        cur = a + rank + 1 if a < 0 else a
        if not 0 <= cur <= rank:
            raise InvalidAttributeError(
                f"unsqueeze: axis {a} is out of range [{-rank - 1}, {rank}] for a {rank}-D tensor")
        for i in range(rank, cur, -1):
            if new[i - 1]:
                new[i], new[i - 1] = True, False
        new[cur] = True
        rank += 1
    trans: list[DimTrans] = []
    out: list[int] = []
    k = 0
    for is_new in new:
        if is_new:
            trans.append(Singleton())
            out.append(1)
        else:
            trans.append(InputDim(k) if shape[k] != 1 else Singleton())
            out.append(shape[k])
            k += 1
    return tuple(trans), tuple(out)


def invert_trans(trans: tuple[DimTrans, ...], in_ndim: int) -> tuple[DimTrans, ...]:
    """The list out -> x of a squeeze / unsqueeze list: x axis ``k`` is ``InputDim(j)`` where
    out axis ``j`` is ``InputDim(k)``; every other x axis (size 1) is a Singleton."""
    inv: list[DimTrans] = [Singleton()] * in_ndim
    for j, t in enumerate(trans):
        if type(t) is InputDim:
            inv[t.dim] = InputDim(j)
    return tuple(inv)


@memo()
def flatten_reverse_trans(shape: tuple[int, ...], start: int, stop: int) -> tuple[DimTrans, ...]:
    """The list out -> x of flatten: the merged out axis split back into x's sizes (a size-1
    piece is a Singleton)."""
    nd = len(shape)
    a = norm_axis("flatten", start, nd, "start_axis")
    b = norm_axis("flatten", stop, nd, "stop_axis")
    if a >= b:
        return tuple(InputDim(i) for i in range(nd))
    sizes = tuple(v for v in shape[a:b + 1] if v != 1)  # size-1 pieces are Singletons
    mid: list[DimTrans] = []
    j = 0
    for sz in shape[a:b + 1]:
        if sz == 1:
            mid.append(Singleton())
        else:
            mid.append(Split(InputDim(a), sizes, j))
            j += 1
    return (*(InputDim(i) for i in range(a)), *mid, *(InputDim(i - (b - a)) for i in range(b + 1, nd)))


# -- propagation --------------------------------------------------------------------------------


_dims = entry_dims
_entry = dims_entry


def _prefix(groups: Sequence[tuple[int, ...]], mesh_shape: Sequence[int], sizes: Sequence[int]) -> tuple[int, ...]:
    """The mesh dims of the longest run of whole ``groups`` (one per sharded axis) whose mesh
    product divides every size in ``sizes``."""
    p = 1
    keep: list[int] = []
    for g in groups:
        for d in g:
            p *= mesh_shape[d]
        if any(s % p for s in sizes):
            break
        keep.extend(g)
    return tuple(keep)


def _flatten_dims(dims: Sequence[int], dm: Sequence[Entry]) -> list[tuple[int, ...]]:
    """Mesh dims (one group per axis) a Flatten can carry: its leftmost axis's, then those of
    the following axes while they are sharded."""
    out: list[tuple[int, ...]] = []
    for k in dims:
        d = _dims(dm[k])
        if not d:
            break
        out.append(d)
    return out


@memo()
def infer_from_trans(
    trans: tuple[DimTrans, ...],
    in_shape: tuple[int, ...],
    in_dm: tuple[Entry, ...],
    mesh_shape: tuple[int, ...],
) -> tuple[tuple[Entry, ...], tuple[Entry, ...]]:
    """(the input dims_mapping to use, the output dims_mapping) for ``trans``."""
    new_in: list[Entry] = [-1] * len(in_shape)
    out: list[Entry] = [-1] * len(trans)
    for i, t in enumerate(trans):
        if type(t) is InputDim:
            e = in_dm[t.dim]
            out[i] = e
            new_in[t.dim] = e
        elif type(t) is Flatten:
            k = t.dims[0]
            keep = _prefix(_flatten_dims(t.dims, in_dm), mesh_shape, (in_shape[k],))
            if keep:
                out[i] = new_in[k] = _entry(keep)
        elif type(t) is Split and t.piece == 0:
            src = t.source
            size = t.shape[0]
            fdims = (src.dim,) if isinstance(src, InputDim) else src.dims
            k = fdims[0]
            keep = _prefix(_flatten_dims(fdims, in_dm), mesh_shape, (in_shape[k], size))
            if keep:
                out[i] = new_in[k] = _entry(keep)
    return tuple(new_in), tuple(out)


__all__ = [
    "DimTrans",
    "Flatten",
    "InputDim",
    "Singleton",
    "Split",
    "flatten_reverse_trans",
    "flatten_trans",
    "invert_trans",
    "infer_from_trans",
    "norm_axis",
    "reshape_trans",
    "resolve_target",
    "squeeze_trans",
    "unsqueeze_trans",
]
