"""The view algebra: how each output axis of a reshape-like op is made of input axes.

An output axis is one of

- ``InputDim(k)``: input axis ``k`` unchanged;
- ``Singleton()``: a new size-1 axis made of nothing;
- ``Flatten((k0, k1, ...))``: input axes ``k0, k1, ...`` (adjacent, major to minor) merged;
- ``Split(source, shape, piece)``: piece ``piece`` of ``source`` (an ``InputDim`` or a
  ``Flatten``) split into ``shape``.

``reshape_trans``, ``flatten_trans``, ``squeeze_trans`` and ``unsqueeze_trans`` build the list
for each op. The rules do not merge by hand: :func:`links` reduces a list to its structure
(which input axes each output axis carries, sizes abstracted) and :func:`view_plan` compiles
that structure once into an engine plan (a :class:`~spmdkit.engine.notation.Notation` with a
``flatten`` policy); :func:`reshape_links` finds reshape's structure from the shapes in one
pass. The propagation follows Paddle 3.3.1 (``dim_trans.cc``):

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
from functools import lru_cache
from typing import NamedTuple, Union

from spmdkit.core.errors import InvalidAttributeError, ShapeMismatchError
from spmdkit.engine.compiler import compile_plan
from spmdkit.engine.memo import memo
from spmdkit.engine.notation import ALPHABET, BROADCAST, Coshard, Notation
from spmdkit.engine.plans import RulePlan


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


def _check_counts(src: tuple[int, ...], tgt: tuple[int, ...]) -> None:
    if -1 not in src and -1 not in tgt:
        if math.prod(src) != math.prod(tgt):
            raise ShapeMismatchError(f"reshape: {list(src)} and {list(tgt)} hold different element counts")
        return
    if math.prod(v for v in src if v != -1) != math.prod(v for v in tgt if v != -1) or src.count(-1) != tgt.count(-1):
        raise ShapeMismatchError(f"reshape: {list(src)} and {list(tgt)} hold different element counts")


#: an output axis's link to the input: None (it carries no input axis's sharding), ``k`` (input
#: axis k unchanged) or ``(k0, k1, ...)`` (a Flatten, or piece 0 of a Split, of those axes)
Link = Union[None, int, tuple[int, ...]]


def reshape_links(src: tuple[int, ...], tgt: tuple[int, ...]) -> tuple[Link, ...]:
    """``links(reshape_trans(src, tgt))`` in one pass on ints (the reshape rule's hot path;
    counts not checked)."""
    ns, nt = len(src), len(tgt)
    out: list[Link] = [None] * nt
    si = ti = 0
    while si < ns or ti < nt:
        s0, t0 = si, ti
        if si < ns:
            s = src[si]
            si += 1
            if s == -1:  # a dynamic axis, copied: at its own index in both (resolve_target), the
                out[s0] = s0  # target axes before it not yet walked are size 1 (Singletons)
                ti = s0 + 1
                continue
        else:
            s = 1
        if ti < nt:
            t = tgt[ti]
            ti += 1
        else:
            t = 1
        if s == 1:
            if t != 1:
                ti -= 1  # a size-1 source axis feeds nothing
            elif si > s0 and ti > t0:
                out[t0] = s0  # 1 -> 1 keeps its sharding
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
        if si - s0 == 1:
            out[t0] = s0 if ti - t0 == 1 else (s0,)
            continue
        real = tuple([j for j in range(s0, si) if src[j] != 1])
        out[t0] = real[0] if len(real) == 1 and ti - t0 == 1 else real
    return tuple(out)


@memo()
def reshape_trans(src: tuple[int, ...], tgt: tuple[int, ...]) -> tuple[DimTrans, ...]:
    """The list for reshaping ``src`` into ``tgt`` (both resolved, same element count; a
    dynamic (-1) size is an axis of its own at the same index in both, see resolve_target)."""
    _check_counts(src, tgt)
    ln = reshape_links(src, tgt)
    ret: list[DimTrans] = []
    i = 0
    while i < len(tgt):
        link = ln[i]
        if not isinstance(link, tuple):
            ret.append(Singleton() if link is None else InputDim(link))
            i += 1
            continue
        source = InputDim(link[0]) if len(link) == 1 else Flatten(link)
        n, j, p = math.prod(src[d] for d in link), i, 1
        while p != n:  # the pieces: the target axes holding the source's elements
            p *= tgt[j]
            j += 1
        shp = tuple(tgt[i:j])
        ret.extend([source] if j - i == 1 else [Singleton() if v == 1 else Split(source, shp, k)
                                                 for k, v in enumerate(shp)])
        i = j
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


# -- the structure of a list, compiled --------------------------------------------------------


@memo()
def links(trans: tuple[DimTrans, ...]) -> tuple[Link, ...]:
    """The structure of ``trans``: each output axis's :data:`Link` (Split shapes dropped)."""
    out: list[Link] = []
    for t in trans:
        if type(t) is InputDim:
            out.append(t.dim)
        elif type(t) is Flatten:
            out.append(t.dims)
        elif type(t) is Split and t.piece == 0:
            src = t.source
            out.append((src.dim,) if type(src) is InputDim else src.dims)  # type: ignore[union-attr]
        else:
            out.append(None)
    return tuple(out)


def _letter(k: int) -> str:
    return ALPHABET[k] if k < len(ALPHABET) else chr(0x100 + k)  # a tensor may have more than 26 axes


@lru_cache(maxsize=4096)
def view_plan(n_in: int, ln: tuple[Link, ...], keep: bool = True, backward: bool = False) -> RulePlan:
    """The compiled plan of a view from ``n_in`` axes to ``len(ln)`` axes linked as ``ln``:
    each input axis a letter (``1`` where no output axis carries it); an output axis carries
    its link's (first) letter, ``1`` where it has none; a Flatten and a Split's piece 0 is a
    ``flatten`` string (the run of its axes, divisible by every size of the first axis: its own
    and the output axis's, the piece). ``keep``: co-shards read as they are (else as their
    largest mesh dim, as Paddle's squeeze / unsqueeze and reverse rules read them);
    ``backward``: the plan of the reverse rule, the view running from the op's out (the plan's
    output, merged) to its x (the plan's input)."""
    used: set[int] = set()
    chains = []
    for link in ln:
        if isinstance(link, tuple):
            used.update(link)
            chains.append("".join(map(_letter, link)))
        elif link is not None:
            used.add(link)
    src = "".join(_letter(k) if k in used else BROADCAST for k in range(n_in))
    tgt = "".join(BROADCAST if link is None else _letter(link if isinstance(link, int) else link[0]) for link in ln)
    coshard = Coshard.KEEP if keep else Coshard.LARGEST
    if backward:
        return compile_plan(Notation([tgt], [src], coshard=coshard, flatten=chains), "backward")
    return compile_plan(Notation([src], [tgt], coshard=coshard, flatten=chains))


__all__ = [
    "DimTrans",
    "Flatten",
    "InputDim",
    "Singleton",
    "Split",
    "flatten_reverse_trans",
    "flatten_trans",
    "invert_trans",
    "links",
    "norm_axis",
    "reshape_links",
    "reshape_trans",
    "resolve_target",
    "squeeze_trans",
    "unsqueeze_trans",
    "view_plan",
]
