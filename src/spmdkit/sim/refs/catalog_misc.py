"""Numpy references and case generators of the misc catalog family (spmdkit.ops.sorting, along_axis, data_dependent, and p_norm / label_smooth in reduction / loss):
argsort, cummax, cummin, roll, take_along_axis, put_along_axis, index_put, nonzero, unique,
p_norm, label_smooth and their grads.

Kernels run on a rank's local arrays with the global attributes: the rules keep every axis
whose global position matters (sorted / scanned / rolled / gathered axes, index_put's indexed
axes) replicated, so no ``localize`` hook is needed. Index inputs are made valid by
``prepare`` (taken modulo the axis size; made duplicate-free where a gradient would otherwise
be ill-defined), and the indices a grad consumes (argsort / cummax) are computed from x.
take_along_axis / put_along_axis follow the kernels: an index smaller than x on a non-axis
dim addresses x's leading rows. nonzero and unique have data-dependent output sizes; their
references compute them from the data (the rules only assume the ranks).
"""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np

from spmdkit.sim.cases import GENERATORS, TGen, rand_axis, rand_shape, rand_size
from spmdkit.sim.ops import Arrays, Ctx, Reference, as_f64, register_reference, sum_to_shape
from spmdkit.sim.ops import norm_axis as _ax

Shape = tuple[int, ...]
FAMILY = "catalog_misc"


def _i(x: Any) -> np.ndarray:
    return np.asarray(x).astype(np.int64)


# -- argsort ------------------------------------------------------------------------------------


def argsort(x: Any, axis: Any = -1, descending: bool = False) -> tuple[np.ndarray, np.ndarray]:
    x = as_f64(x)
    if x.ndim == 0:
        return x.copy(), np.zeros((), dtype=np.int64)
    ax = _ax(axis, x.ndim)
    idx = np.argsort(-x if descending else x, axis=ax, kind="stable")
    return np.take_along_axis(x, idx, axis=ax), idx.astype(np.int64)


def _argsort(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    return argsort(a["x"], a.get("axis", -1), bool(a.get("descending", False)))


def _argsort_grad(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    x = as_f64(a["x"])
    if x.ndim == 0:
        return (as_f64(a["out_grad"]).copy(),)
    ax = _ax(a.get("axis", -1), x.ndim)
    gx = np.zeros_like(x)
    np.put_along_axis(gx, _i(a["indices"]), as_f64(a["out_grad"]), axis=ax)
    return (gx,)


def _prep_argsort_grad(a: Arrays) -> None:
    a["indices"] = argsort(a["x"], a.get("axis", -1), bool(a.get("descending", False)))[1]


register_reference(Reference("argsort", _argsort, ("x",), ("out", "indices"), "misc_sort"))
register_reference(Reference("argsort_grad", _argsort_grad, ("indices", "x", "out_grad"), ("x_grad",),
                             "misc_sort_grad", domains={"indices": "int"}, prepare=_prep_argsort_grad))


# -- cummax / cummin ----------------------------------------------------------------------------


def cum_extreme(x: Any, axis: Any, largest: bool) -> tuple[np.ndarray, np.ndarray]:
    """(running max / min along axis, index of the element that gives it; ties: the later one)."""
    x = as_f64(x)
    if x.ndim == 0:
        return x.copy(), np.zeros((), dtype=np.int64)
    ax = _ax(axis, x.ndim)
    m = np.moveaxis(x, ax, -1)
    out = np.empty_like(m)
    idx = np.zeros(m.shape, dtype=np.int64)
    if m.shape[-1]:
        cur = m[..., 0].copy()
        ci = np.zeros(cur.shape, dtype=np.int64)
        for j in range(m.shape[-1]):
            v = m[..., j]
            take = v >= cur if largest else v <= cur
            cur = np.where(take, v, cur)
            ci = np.where(take, j, ci)
            out[..., j] = cur
            idx[..., j] = ci
    return np.moveaxis(out, -1, ax), np.moveaxis(idx, -1, ax)


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


def _cum(largest: bool) -> Any:
    def run(a: Arrays, c: Ctx) -> tuple[Any, ...]:
        return cum_extreme(a["x"], a.get("axis", -1), largest)

    return run


def _cum_grad(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    x = as_f64(a["x"])
    g = as_f64(a["out_grad"])
    if x.ndim == 0:
        return (g.copy(),)
    ax = _ax(a.get("axis", -1), x.ndim)
    return (scatter_add(x.shape, _i(a["indices"]), g, ax),)


def _prep_cum(largest: bool) -> Any:
    def prep(a: Arrays) -> None:
        a["indices"] = cum_extreme(a["x"], a.get("axis", -1), largest)[1]

    return prep


for _op, _lg in (("cummax", True), ("cummin", False)):
    register_reference(Reference(_op, _cum(_lg), ("x",), ("out", "indices"), "misc_sort"))
    register_reference(Reference(f"{_op}_grad", _cum_grad, ("x", "indices", "out_grad"), ("x_grad",),
                                 "misc_sort_grad", domains={"indices": "int"}, prepare=_prep_cum(_lg)))


# -- roll ---------------------------------------------------------------------------------------


def roll(x: Any, shifts: Any, axis: Any, sign: int = 1) -> np.ndarray:
    x = as_f64(x)
    sh = [int(s) * sign for s in ((shifts,) if isinstance(shifts, int) else shifts)]
    ax = [] if axis is None else list((axis,) if isinstance(axis, int) else axis)
    if not ax:
        return np.asarray(np.roll(x.reshape(-1), sh[0]).reshape(x.shape))
    if x.ndim == 0:
        return np.asarray(x.copy())
    return np.asarray(np.roll(x, sh, [_ax(v, x.ndim) for v in ax]))


register_reference(Reference("roll", lambda a, c: (roll(a["x"], a["shifts"], a.get("axis", ())),), ("x",),
                             ("out",), "misc_roll"))
register_reference(Reference("roll_grad", lambda a, c: (roll(a["out_grad"], a["shifts"], a.get("axis", ()), -1),),
                             ("x", "out_grad"), ("x_grad",), "misc_roll_grad"))


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
                             ("x", "index"), ("out",), "misc_take", domains={"index": "int"},
                             prepare=_prep_index_along))
register_reference(Reference("take_along_axis_grad", _take_grad, ("x", "index", "out_grad"), ("x_grad",),
                             "misc_take_grad", domains={"index": "int"}, prepare=_prep_index_along))


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


register_reference(Reference("put_along_axis", _put, ("x", "index", "value"), ("out",), "misc_put",
                             domains={"index": "int"}, prepare=_prep_put))
register_reference(Reference("put_along_axis_grad", _put_grad, ("x", "index", "value", "out", "out_grad"),
                             ("x_grad", "value_grad"), "misc_put_grad", domains={"index": "int"},
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
                             ("x", "indices", "value"), ("out",), "misc_index_put", domains={"indices": "int"},
                             prepare=_prep_index_put))
register_reference(Reference("index_put_grad", _index_put_grad, ("x", "indices", "value", "out_grad"),
                             ("x_grad", "value_grad"), "misc_index_put_grad", domains={"indices": "int"},
                             prepare=_prep_index_put))


# -- nonzero / unique ---------------------------------------------------------------------------


def _nonzero(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    x = np.asarray(a["x"])
    if x.ndim == 0:
        raise ValueError("nonzero needs at least 1 dim")
    return (np.argwhere(x).astype(np.int64),)


def unique(x: Any, return_index: bool, return_inverse: bool, return_counts: bool, axis: Any) -> tuple[Any, ...]:
    x = np.asarray(x)
    ax = list(axis) if isinstance(axis, (list, tuple)) else ([] if axis is None else [axis])
    if len(ax) > 1:
        raise ValueError("unique takes at most one axis")
    a = None if not ax else _ax(ax[0], x.ndim)
    flat = x.reshape(-1) if a is None else x
    out, ind, inv, cnt = np.unique(flat, return_index=True, return_inverse=True, return_counts=True, axis=a)
    return (out.astype(np.float64), ind.astype(np.int64) if return_index else None,
            inv.reshape(-1).astype(np.int64) if return_inverse else None,
            cnt.astype(np.int64) if return_counts else None)


register_reference(Reference("nonzero", _nonzero, ("x",), ("out",), "misc_nonzero", domains={"x": "int"}))
register_reference(Reference("unique", lambda a, c: unique(a["x"], bool(a.get("return_index")),
                                                           bool(a.get("return_inverse")),
                                                           bool(a.get("return_counts")), a.get("axis", ())),
                             ("x",), ("out", "indices", "inverse", "counts"), "misc_unique", domains={"x": "int"}))


# -- p_norm -------------------------------------------------------------------------------------


def _pn_axes(a: Arrays, ndim: int) -> tuple[int, ...]:
    if ndim == 0:
        return ()
    if a.get("asvector", False):
        return tuple(range(ndim))
    return (_ax(a.get("axis", -1), ndim),)


def p_norm(x: Any, porder: float, axes: tuple[int, ...], keep: bool) -> np.ndarray:
    x = np.abs(as_f64(x))
    if not axes:
        return np.asarray(x.copy() if porder != 0 else (x != 0).astype(np.float64))
    p = float(porder)
    if p == 0:
        r = np.sum(x != 0, axis=axes, keepdims=keep).astype(np.float64)
    elif math.isinf(p):
        # an empty reduction gives the identity (the norm of an empty vector is 0)
        if p > 0:
            r = np.max(x, axis=axes, keepdims=keep, initial=0.0)
        else:
            r = np.min(x, axis=axes, keepdims=keep, initial=math.inf)
    else:
        r = np.sum(x**p, axis=axes, keepdims=keep) ** (1.0 / p)
    return np.asarray(r, dtype=np.float64)


def _pnorm(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    x = as_f64(a["x"])
    return (p_norm(x, a.get("porder", 2.0), _pn_axes(a, x.ndim), bool(a.get("keepdims", False))),)


def _pnorm_grad(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    x = as_f64(a["x"])
    axes = _pn_axes(a, x.ndim)
    p = float(a.get("porder", 2.0))
    keep = [1 if i in axes else s for i, s in enumerate(x.shape)]
    out = as_f64(a["out"]).reshape(keep)
    g = as_f64(a["out_grad"]).reshape(keep)
    if p == 0:
        return (np.zeros_like(x),)
    if math.isinf(p):
        return (g * np.sign(x) * (np.abs(x) == out),)
    return (g * np.sign(x) * np.abs(x) ** (p - 1) / out ** (p - 1),)


def _prep_pnorm_grad(a: Arrays) -> None:
    x = as_f64(a["x"])
    a["out"] = p_norm(x, a.get("porder", 2.0), _pn_axes(a, x.ndim), bool(a.get("keepdims", False)))


register_reference(Reference("p_norm", _pnorm, ("x",), ("out",), "misc_pnorm", domains={"x": "nonzero"}))
register_reference(Reference("p_norm_grad", _pnorm_grad, ("x", "out", "out_grad"), ("x_grad",), "misc_pnorm_grad",
                             domains={"x": "nonzero", "out": "pos", "out_grad": "real"}, prepare=_prep_pnorm_grad))


# -- label_smooth -------------------------------------------------------------------------------


def label_smooth(label: Any, prior: Any, eps: float) -> np.ndarray:
    lab = as_f64(label)
    if prior is None:
        return np.asarray((1 - eps) * lab + eps / lab.shape[-1])
    return np.asarray((1 - eps) * lab + eps * as_f64(prior))


register_reference(Reference("label_smooth",
                             lambda a, c: (label_smooth(a["label"], a.get("prior_dist"), float(a.get("epsilon", 0.0))),),
                             ("label",), ("out",), "misc_label", optional=("prior_dist",)))
register_reference(Reference("label_smooth_grad",
                             lambda a, c: ((1 - float(a.get("epsilon", 0.0))) * as_f64(a["out_grad"]),),
                             ("out_grad",), ("label_grad",), "misc_label_grad"))


# -- case generators ----------------------------------------------------------------------------


def _g_sort(r: random.Random, m: list[int], ref: Any) -> dict[str, Any]:
    s = rand_shape(r, m, 1, 4)
    return {"x": TGen(s), "axis": rand_axis(r, len(s)), "descending": r.random() < 0.5,
            "stable": r.random() < 0.5, "dtype": "int64"}


def _g_sort_grad(r: random.Random, m: list[int], ref: Any) -> dict[str, Any]:
    sp = _g_sort(r, m, ref)
    s = sp["x"].shape
    sp.update({"indices": TGen(s, "int"), "out_grad": TGen(s, "real")})
    return sp


def _g_roll(r: random.Random, m: list[int], ref: Any) -> dict[str, Any]:
    s = rand_shape(r, m, 1, 4)
    nd = len(s)
    if r.random() < 0.2:
        return {"x": TGen(s), "shifts": [r.randint(-6, 6)], "axis": []}
    k = r.randint(1, min(3, nd))
    axis = [rand_axis(r, nd) for _ in range(k)]
    return {"x": TGen(s), "shifts": [r.randint(-6, 6) for _ in range(k)], "axis": axis}


def _g_roll_grad(r: random.Random, m: list[int], ref: Any) -> dict[str, Any]:
    sp = _g_roll(r, m, ref)
    sp["out_grad"] = TGen(sp["x"].shape, "real")
    return sp


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


def _g_nonzero(r: random.Random, m: list[int], ref: Any) -> dict[str, Any]:
    return {"x": TGen(rand_shape(r, m, 1, 4), "int")}


def _g_unique(r: random.Random, m: list[int], ref: Any) -> dict[str, Any]:
    s = rand_shape(r, m, 1, 3)
    axis = [] if r.random() < 0.5 else [rand_axis(r, len(s))]
    return {"x": TGen(s, "int"), "return_index": r.random() < 0.5, "return_inverse": r.random() < 0.5,
            "return_counts": r.random() < 0.5, "axis": axis, "dtype": "int64"}


_PORDERS = (0.0, 1.0, 2.0, 3.0, 0.5, math.inf, -math.inf)


def _g_pnorm(r: random.Random, m: list[int], ref: Any) -> dict[str, Any]:
    s = rand_shape(r, m, 0, 4)
    return {"x": TGen(s), "porder": r.choice(_PORDERS), "axis": rand_axis(r, len(s)), "epsilon": 1e-12,
            "keepdims": r.random() < 0.4, "asvector": r.random() < 0.25}


def _g_pnorm_grad(r: random.Random, m: list[int], ref: Any) -> dict[str, Any]:
    sp = _g_pnorm(r, m, ref)
    s = sp["x"].shape
    o = p_norm(np.ones(s), 2.0, _pn_axes(sp, len(s)), sp["keepdims"]).shape
    sp.update({"out": TGen(o, "pos"), "out_grad": TGen(o, "real")})
    return sp


def _g_label(r: random.Random, m: list[int], ref: Any) -> dict[str, Any]:
    s = rand_shape(r, m, 1, 4)
    u = r.random()
    if u < 0.35:
        prior: TGen | None = None
    elif u < 0.6:
        prior = TGen((s[-1],), "prob")
    elif u < 0.8 and len(s) >= 2:
        prior = TGen((1, s[-1]), "prob")
    else:
        k = r.randint(1, len(s))
        prior = TGen(tuple(1 if r.random() < 0.4 else v for v in s[-k:]), "prob")
    return {"label": TGen(s, "prob"), "prior_dist": prior, "epsilon": r.choice((0.0, 0.1, 0.25))}


def _g_label_grad(r: random.Random, m: list[int], ref: Any) -> dict[str, Any]:
    return {"out_grad": TGen(rand_shape(r, m, 1, 4), "real"), "epsilon": r.choice((0.0, 0.1, 0.25))}


GENERATORS.update({
    "misc_sort": _g_sort,
    "misc_sort_grad": _g_sort_grad,
    "misc_roll": _g_roll,
    "misc_roll_grad": _g_roll_grad,
    "misc_take": _g_take,
    "misc_take_grad": _g_take,
    "misc_put": _g_put,
    "misc_put_grad": _g_put,
    "misc_index_put": _g_index_put,
    "misc_index_put_grad": _g_index_put,
    "misc_nonzero": _g_nonzero,
    "misc_unique": _g_unique,
    "misc_pnorm": _g_pnorm,
    "misc_pnorm_grad": _g_pnorm_grad,
    "misc_label": _g_label,
    "misc_label_grad": _g_label_grad,
})

__all__ = ["argsort", "cum_extreme", "index_put", "label_smooth", "p_norm", "put_along_axis", "roll",
           "scatter_add", "take_along_axis", "unique"]
