"""Numpy references and case generators of the along_axis family (spmdkit.ops.along_axis):
take_along_axis, put_along_axis, index_put and their grads.

Kernels run on a rank's local arrays with the global attributes: the rules keep the gathered axis
and index_put's indexed axes replicated, so no ``localize`` hook is needed. Index inputs are made
valid by ``prepare`` (taken modulo the axis size; made duplicate-free where a gradient would
otherwise be ill-defined). take_along_axis / put_along_axis follow the kernels: an index smaller
than x on a non-axis dim addresses x's leading rows.
"""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np

from spmdkit.sim.cases import GENERATORS, Shape, TGen, rand_axis, rand_shape, rand_size
from spmdkit.sim.reference import Arrays, Ctx, Reference, as_f64, register_reference, sum_to_shape
from spmdkit.sim.reference import norm_axis as _ax


def _i(x: Any) -> np.ndarray:
    return np.asarray(x).astype(np.int64)


def scatter_add(shape: Shape, idx: np.ndarray, src: np.ndarray, ax: int) -> np.ndarray:
    """zeros(shape) with src added at idx along ax (idx / src may be smaller than shape on the
    other axes: they address its leading rows)."""
    out = np.zeros(shape, dtype=np.float64)
    if idx.ndim == 0:
        return np.asarray(out + src)
    if idx.size == 0:
        return out
    sl = tuple(slice(None) if i == ax else slice(0, idx.shape[i]) for i in range(len(shape)))
    blk = np.moveaxis(out[sl].copy(), ax, -1)
    i2 = np.moveaxis(idx, ax, -1)
    s2 = np.moveaxis(as_f64(src), ax, -1)
    rows = int(np.prod(i2.shape[:-1]))
    b2 = blk.reshape(rows, blk.shape[-1])
    r = np.arange(rows)[:, None]
    np.add.at(b2, (r, i2.reshape(rows, -1)), s2.reshape(rows, -1))
    out[sl] = np.moveaxis(b2.reshape(blk.shape), -1, ax)
    return out


# -- take_along_axis / put_along_axis -------------------------------------------------------------


def _crop(x: np.ndarray, shape: Shape, ax: int) -> tuple[slice, ...]:
    if len(shape) != x.ndim:
        raise ValueError("index must have x's number of dims")
    for i, (s, t) in enumerate(zip(x.shape, shape)):
        if i != ax and t > s:
            raise ValueError("index larger than x on a non-axis dim")
    return tuple(slice(None) if i == ax else slice(0, shape[i]) for i in range(x.ndim))


def take_along_axis(x: Any, index: Any, axis: Any) -> np.ndarray:
    x = as_f64(x)
    idx = _i(index)
    ax = _ax(axis, x.ndim)
    return np.asarray(np.take_along_axis(x[_crop(x, idx.shape, ax)], idx, axis=ax))


def _prep_index_along(a: Arrays) -> None:
    x = np.asarray(a["x"])
    ax = _ax(a.get("axis", 0), x.ndim)
    n = x.shape[ax]
    idx = _i(a["index"])
    a["index"] = np.abs(idx) % n if n else np.zeros(idx.shape, dtype=np.int64)


def _take_grad(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    x = as_f64(a["x"])
    ax = _ax(a.get("axis", 0), x.ndim)
    return (scatter_add(x.shape, _i(a["index"]), as_f64(a["out_grad"]), ax),)


register_reference(Reference("take_along_axis", lambda a, c: (take_along_axis(a["x"], a["index"], a.get("axis", 0)),),
                             ("x", "index"), ("out",), "take_along_axis", domains={"index": "int"},
                             prepare=_prep_index_along))
register_reference(Reference("take_along_axis_grad", _take_grad, ("x", "index", "out_grad"), ("x_grad",),
                             "take_along_axis_grad", domains={"index": "int"}, prepare=_prep_index_along))


_IDENTITY = {"add": 0.0, "mul": 1.0, "multiply": 1.0, "amin": math.inf, "amax": -math.inf, "mean": 0.0}


def put_along_axis(x: Any, index: Any, value: Any, axis: Any, reduce: str = "assign",
                   include_self: bool = True) -> np.ndarray:
    x = as_f64(x)
    idx = _i(index)
    v = np.broadcast_to(as_f64(value), idx.shape)
    ax = _ax(axis, x.ndim)
    out = x.copy()
    sl = _crop(x, idx.shape, ax)
    if idx.size == 0:
        return np.asarray(out)
    blk = np.moveaxis(out[sl].copy(), ax, -1)
    n = blk.shape[-1]
    rows = int(np.prod(blk.shape[:-1]))
    b2 = blk.reshape(rows, n)
    i2 = np.moveaxis(idx, ax, -1).reshape(rows, -1)
    v2 = np.moveaxis(v, ax, -1).reshape(rows, -1)
    r = np.broadcast_to(np.arange(rows)[:, None], i2.shape)
    if reduce == "assign":
        for j in range(i2.shape[1]):  # in order: a later index wins
            b2[r[:, j], i2[:, j]] = v2[:, j]
    else:
        if not include_self:
            b2[r, i2] = _IDENTITY[reduce]
        if reduce in ("add", "mean"):
            np.add.at(b2, (r, i2), v2)
        elif reduce in ("mul", "multiply"):
            np.multiply.at(b2, (r, i2), v2)
        elif reduce == "amin":
            np.minimum.at(b2, (r, i2), v2)
        elif reduce == "amax":
            np.maximum.at(b2, (r, i2), v2)
        else:
            raise ValueError(f"unknown reduce {reduce!r}")
        if reduce == "mean":
            cnt = np.full(b2.shape, 1.0 if include_self else 0.0)
            touched = np.zeros(b2.shape, dtype=bool)
            touched[r, i2] = True
            np.add.at(cnt, (r, i2), 1.0)
            b2 = np.where(touched, b2 / np.where(cnt == 0, 1.0, cnt), b2)
    out[sl] = np.moveaxis(b2.reshape(blk.shape), -1, ax)
    return np.asarray(out)


def _put(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    return (put_along_axis(a["x"], a["index"], a["value"], a.get("axis", 0), a.get("reduce", "assign"),
                           bool(a.get("include_self", True))),)


def _prep_put_grad(a: Arrays) -> None:
    """Duplicate-free index rows (the gradient of an overwritten value is undefined) and out."""
    x = np.asarray(a["x"])
    ax = _ax(a.get("axis", 0), x.ndim)
    idx = np.asarray(a["index"])
    n, k = x.shape[ax], idx.shape[ax]
    if k > n:
        raise ValueError("put_along_axis_grad needs at most as many indices as the axis has entries")
    shape = list(idx.shape)
    shape[ax] = n
    keys = np.random.default_rng(1234).random(shape)
    a["index"] = np.take(np.argsort(keys, axis=ax), np.arange(k), axis=ax).astype(np.int64)
    reduce = a.get("reduce", "assign")
    if reduce not in ("assign", "add"):
        raise ValueError(f"the put_along_axis_grad reference covers assign and add, not {reduce!r}")
    a["out"] = put_along_axis(a["x"], a["index"], a["value"], ax, reduce, bool(a.get("include_self", True)))


def _put_grad(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    x = as_f64(a["x"])
    ax = _ax(a.get("axis", 0), x.ndim)
    idx = _i(a["index"])
    g = as_f64(a["out_grad"])
    reduce = a.get("reduce", "assign")
    if reduce not in ("assign", "add"):
        raise ValueError(f"the put_along_axis_grad reference covers assign and add, not {reduce!r}")
    gx = g.copy()
    if reduce == "assign" or not bool(a.get("include_self", True)):
        hit = scatter_add(x.shape, idx, np.ones(idx.shape), ax) > 0
        gx = np.where(hit, 0.0, gx)
    gv = np.take_along_axis(g[_crop(x, idx.shape, ax)], idx, axis=ax)
    return gx, sum_to_shape(gv, np.shape(a["value"]))


def _prep_put(a: Arrays) -> None:
    _prep_index_along(a)


register_reference(Reference("put_along_axis", _put, ("x", "index", "value"), ("out",), "put_along_axis",
                             domains={"index": "int"}, prepare=_prep_put))
register_reference(Reference("put_along_axis_grad", _put_grad, ("x", "index", "value", "out", "out_grad"),
                             ("x_grad", "value_grad"), "put_along_axis_grad", domains={"index": "int"},
                             prepare=_prep_put_grad))


# -- index_put ----------------------------------------------------------------------------------


def _prep_index_put(a: Arrays) -> None:
    """In-range, duplicate-free index tuples (where there are enough positions)."""
    x = np.asarray(a["x"])
    inds = a["indices"]
    k = len(inds)
    dims = x.shape[:k]
    total = int(np.prod(dims)) if dims else 1
    n = int(np.shape(inds[0])[0])
    rng = np.random.default_rng(4321)
    flat = rng.permutation(total)[:n] if n <= total else rng.integers(0, max(total, 1), size=n)
    a["indices"] = [np.asarray(t, dtype=np.int64) for t in np.unravel_index(flat, dims)]


def index_put(x: Any, indices: Any, value: Any, accumulate: bool) -> np.ndarray:
    out = as_f64(x).copy()
    idx = tuple(_i(t) for t in indices)
    v = as_f64(value)
    if accumulate:
        np.add.at(out, idx, np.broadcast_to(v, out[idx].shape))
    else:
        out[idx] = v
    return out


def _index_put_grad(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    g = as_f64(a["out_grad"])
    idx = tuple(_i(t) for t in a["indices"])
    gx = g.copy()
    if not bool(a.get("accumulate", False)):
        gx[idx] = 0.0
    return gx, sum_to_shape(g[idx], np.shape(a["value"]))


register_reference(Reference("index_put",
                             lambda a, c: (index_put(a["x"], a["indices"], a["value"], bool(a.get("accumulate"))),),
                             ("x", "indices", "value"), ("out",), "index_put", domains={"indices": "int"},
                             prepare=_prep_index_put))
register_reference(Reference("index_put_grad", _index_put_grad, ("x", "indices", "value", "out_grad"),
                             ("x_grad", "value_grad"), "index_put_grad", domains={"indices": "int"},
                             prepare=_prep_index_put))



# -- case generators ----------------------------------------------------------------------------


def _index_shape(r: random.Random, m: list[int], s: Shape, ax: int, at_most: bool) -> Shape:
    out = list(s)
    out[ax] = r.randint(1, s[ax]) if at_most else (s[ax] if r.random() < 0.4 else rand_size(r, m))
    for i in range(len(s)):
        if i != ax and r.random() < 0.2:
            out[i] = r.randint(1, s[i])
    return tuple(out)


def _g_take(r: random.Random, m: list[int], ref: Any) -> dict[str, Any]:
    s = rand_shape(r, m, 1, 4)
    ax = rand_axis(r, len(s))
    i = _index_shape(r, m, s, ax % len(s), False)
    return {"x": TGen(s), "index": TGen(i, "int"), "axis": ax, "out_grad": TGen(i, "real")}


def _g_put(r: random.Random, m: list[int], ref: Any) -> dict[str, Any]:
    grad = ref.name.endswith("_grad")
    s = rand_shape(r, m, 1, 4)
    ax = rand_axis(r, len(s))
    i = _index_shape(r, m, s, ax % len(s), grad)
    red = r.choice(("assign", "add")) if grad else r.choice(("assign", "add", "mul", "amin", "amax", "mean"))
    return {"x": TGen(s), "index": TGen(i, "int"), "value": TGen(i), "axis": ax, "reduce": red,
            "include_self": r.random() < 0.6, "out": TGen(s, "real"), "out_grad": TGen(s, "real")}


def _g_index_put(r: random.Random, m: list[int], ref: Any) -> dict[str, Any]:
    s = rand_shape(r, m, 1, 4)
    nd = len(s)
    k = r.randint(1, nd)
    total = 1
    for v in s[:k]:
        total *= v
    n = r.randint(1, max(1, min(total, 6)))
    target = (n, *s[k:])  # the indexed shape: value broadcasts onto it from the right
    if r.random() < 0.5:  # 1-D value
        vs: tuple[int, ...] = (1,) if r.random() < 0.4 or target[-1] == 1 else (target[-1],)
    else:  # a value of several dims, some axes broadcast (size 1)
        rank = r.randint(1, len(target))
        vs = tuple(1 if r.random() < 0.3 else t for t in target[len(target) - rank:])
    return {"x": TGen(s), "indices": [TGen((n,), "int") for _ in range(k)], "value": TGen(vs),
            "accumulate": r.random() < 0.5, "out_grad": TGen(s, "real")}


GENERATORS.update({
    "take_along_axis": _g_take,
    "take_along_axis_grad": _g_take,
    "put_along_axis": _g_put,
    "put_along_axis_grad": _g_put,
    "index_put": _g_index_put,
    "index_put_grad": _g_index_put,
})

__all__ = ["index_put", "put_along_axis", "scatter_add", "take_along_axis"]
