"""Lowerings of ATen ops to the ``indexing`` family's rules (:mod:`spmdkit.ops.indexing`): where,
masked_fill, and advanced indexing (``index``: views, ``index_select`` or ``gather_nd``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from spmdkit.models.torch_import.context import Hook, ImportContext


def _where_op(c: ImportContext) -> Any:
    cond, x, y = c.args[:3]
    od = c.out_dtype()
    return c.emit1("where", {"condition": c.tensor(cond, "bool"), "x": c.tensor(x, od), "y": c.tensor(y, od)})


def _masked_fill(c: ImportContext) -> Any:
    x, mask, value = c.args[:3]
    od = c.out_dtype()
    if isinstance(value, torch.Tensor):
        value = value.item()
    return c.emit1("where", {"condition": c.tensor(mask, "bool"), "x": c.tensor(value, od), "y": x})


def _broadcast_shape(shapes: Sequence[Sequence[int]]) -> list[int]:
    n = max(len(s) for s in shapes)
    out = [1] * n
    for s in shapes:
        for i, d in enumerate(s):
            j = n - len(s) + i
            if d != 1:
                out[j] = d
    return out


def _arith_axis(t: torch.Tensor, bshape: Sequence[int]) -> tuple[int, int] | None:
    """Where a constant index tensor, broadcast to ``bshape``, is ``start + arange(n)`` along one
    axis (and constant along the others): (that axis, start); None otherwise. An axis the
    tensor itself spans is preferred (a size-1 axis matches any constant)."""
    tb = t.expand(*bshape)
    if tb.numel() == 0:
        return None
    start = int(tb.reshape(-1)[0])
    own = [a for a in range(len(bshape)) if a - (len(bshape) - t.ndim) >= 0
           and t.shape[a - (len(bshape) - t.ndim)] == bshape[a]]
    for a in sorted(range(len(bshape)), key=lambda a: (a not in own, bshape[a] == 1)):
        shp = [1] * len(bshape)
        shp[a] = bshape[a]
        want = torch.arange(start, start + bshape[a], dtype=tb.dtype).view(shp).expand(*bshape)
        if torch.equal(tb, want):
            return a, start
    return None


def _index(c: ImportContext) -> Any:
    """``x[i0, i1, ...]`` (advanced indexing; None = a full dim). Constant indices that are
    ranges along the broadcast axes (the HF mask builders) are views: a slice, a transpose and a
    reshape (expand where broadcast); one index tensor is ``index_select`` on its dim (reshaped);
    several are ``gather_nd`` over the indexed dims moved to the front."""
    x = c.args[0]
    idx = list(c.args[1])
    xs = c.shape(x)
    nd = len(xs)
    idx += [None] * (nd - len(idx))
    dims = [d for d, t in enumerate(idx) if t is not None]
    for d in dims:
        t = idx[d]
        dt = c.dtype(t)
        if dt == "bool":
            raise c.unsupported("a boolean mask index (a data-dependent shape)")
        if isinstance(t, torch.Tensor):
            idx[d] = torch.where(t < 0, t + xs[d], t)  # negative indices count from the end
    adjacent = dims == list(range(dims[0], dims[-1] + 1))
    bshape = _broadcast_shape([c.shape(idx[d]) for d in dims])
    out = c.out_shape()
    rest = [d for d in range(nd) if d not in dims]
    pre = [d for d in rest if d < dims[0]] if adjacent else []
    post = [d for d in rest if d not in pre]
    if all(isinstance(idx[d], torch.Tensor) for d in dims):
        found = [_arith_axis(idx[d], bshape) for d in dims]
        axes = [f[0] for f in found if f is not None]
        if all(f is not None for f in found) and len(set(axes)) == len(axes):
            cur: Any = x
            for d, f in zip(dims, found):  # the ranges as slices
                assert f is not None
                a, start = f
                if start != 0 or bshape[a] != xs[d]:
                    shp = list(c.shape(cur))
                    shp[d] = bshape[a]
                    cur = c.emit1("slice", {"input": cur}, (c.fresh("range"), shp, c.dtype(cur)), axes=(d,),
                                  starts=(start,), ends=(start + bshape[a],))
            by_axis = {f[0]: d for d, f in zip(dims, found) if f is not None}
            order = pre + [by_axis[a] for a in sorted(by_axis)] + post
            if order != list(range(nd)):
                cur = c.transpose(cur, order, c.fresh("t"))
            cs = c.shape(cur)
            mid = [cs[len(pre) + sorted(by_axis).index(a)] if a in by_axis else 1 for a in range(len(bshape))]
            shp = [cs[i] for i in range(len(pre))] + mid + [cs[i] for i in range(len(pre) + len(by_axis), nd)]
            cur = c.reshape(cur, shp, c.fresh("r")) if tuple(shp) != tuple(out) else c.reshape(cur, shp)
            if tuple(c.shape(cur)) != tuple(out):
                cur = c.emit1("expand", {"x": cur}, shape=tuple(out))
            return cur
    if len(dims) == 1:
        d = dims[0]
        t = idx[d]
        ts = c.shape(t)
        flat_i = c.reshape(c.tensor(t, "int64"), (math.prod(ts),), c.fresh("flat_index")) if len(ts) != 1 \
            else c.tensor(t, "int64")
        sel_shape = (*xs[:d], math.prod(ts), *xs[d + 1:])
        sel = c.emit1("index_select", {"x": x, "index": flat_i},
                      c.name if tuple(sel_shape) == tuple(out) else (c.fresh("selected"), sel_shape, c.dtype(x)),
                      axis=d)
        return c.reshape(sel, out) if tuple(sel_shape) != tuple(out) else sel
    # gather_nd: indexed dims first, the index [*bshape, k]
    cur = x if dims == list(range(len(dims))) else c.transpose(x, dims + rest, c.fresh("t"))
    parts = []
    for d in dims:
        t = c.tensor(idx[d], "int64")
        if c.dtype(t) != "int64":
            t = c.emit1("cast", {"x": t}, (c.fresh("i64"), c.shape(t), "int64"), dtype="int64")
        ts = c.shape(t)
        if tuple(ts) != tuple(bshape):
            if len(ts) < len(bshape):
                t = c.reshape(t, [1] * (len(bshape) - len(ts)) + list(ts), c.fresh("r"))
            t = c.emit1("expand", {"x": t}, (c.fresh("bcast"), tuple(bshape), "int64"), shape=tuple(bshape))
        parts.append(t)
    nd_index = c.emit1("stack", {"x": tuple(parts)}, (c.fresh("nd_index"), (*bshape, len(dims)), "int64"),
                       axis=len(bshape))
    got_shape = (*bshape, *[xs[d] for d in rest])
    g = c.emit1("gather_nd", {"x": cur, "index": nd_index},
                c.name if tuple(got_shape) == tuple(out) else (c.fresh("gathered"), got_shape, c.dtype(x)))
    if tuple(got_shape) == tuple(out):
        return g
    # adjacent indexed dims after leading dims: move the broadcast block back in place
    nb = len(bshape)
    perm = list(range(nb, nb + len(pre))) + list(range(nb)) + list(range(nb + len(pre), len(got_shape)))
    return c.transpose(g, perm, c.name)


def _table() -> dict[str, Hook]:
    t: dict[str, Hook] = {}
    t["aten.where"] = _where_op
    t["aten.masked_fill"] = _masked_fill
    t["aten.index"] = _index
    return t


#: ATen op (packet or overload) -> its lowering
ATEN = _table()
