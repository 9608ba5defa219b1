"""Simulator references and case generators: gather, index_select, gather_nd, scatter,
scatter_nd_add, where and their grads.

Index tensors come from the ``int`` domain and are folded into the valid range by
``prepare`` (duplicates included; scatter with ``overwrite=True`` gets distinct rows, since
which duplicate wins is unspecified). The references also fold an out-of-range index (the
case generator runs them on unprepared values, for shapes only); a rank whose local x lacks
rows the global index names then computes wrong values, which the verifier reports.
Conditions of ``where`` come from the ``bool`` domain.

Gradients: gather_grad / index_select_grad scatter-add out_grad along the axis;
gather_nd_grad scatter-adds out_grad at the coordinates; scatter_grad zeroes the scattered
rows of out_grad (x_grad) and gathers them (updates_grad); scatter_nd_add_grad passes
out_grad through (x_grad) and gathers it (updates_grad); where_grad routes out_grad by the
condition and sums it back to each input's shape.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np

from spmdkit.sim.cases import GENERATORS, Gen, TGen, rand_shape, rand_size
from spmdkit.sim.reference import Arrays, Ctx, Reference, register_reference, sum_to_shape

FAMILY = "indexing"
_INT = "int"


# -- index helpers ----------------------------------------------------------------------------------


def _ids(x: Any) -> np.ndarray:
    return np.asarray(x).astype(np.int64)


def _fold(idx: np.ndarray, size: int) -> np.ndarray:
    """Out-of-range entries folded into [0, size)."""
    if size <= 0:
        return np.zeros_like(idx)
    bad = (idx < 0) | (idx >= size)
    return np.where(bad, np.mod(idx, size), idx) if bad.any() else idx


def _axis(axis: Any, nd: int) -> int:
    a = int(axis)
    return a + nd if a < 0 else a


def _flat_index(index: Any) -> np.ndarray:
    """A gather / scatter index as 0-d or 1-D (an index [N, 1] becomes [N])."""
    i = _ids(index)
    return i.reshape(-1) if i.ndim == 2 else i


def _f(x: Any) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


# -- gather / index_select ------------------------------------------------------------------------------


def _gather(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    x = _f(a["x"])
    ax = _axis(a.get("axis", 0), x.ndim)
    idx = _fold(_flat_index(a["index"]), x.shape[ax])
    return (np.take(x, idx, axis=ax),)


def _gather_grad(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    x = _f(a["x"])
    ax = _axis(a.get("axis", 0), x.ndim)
    idx = _fold(_flat_index(a["index"]), x.shape[ax])
    g = _f(a["out_grad"])
    xg = np.zeros(x.shape)
    xm = np.moveaxis(xg, ax, 0)
    if idx.ndim == 0:
        xm[int(idx)] += g
    else:
        np.add.at(xm, idx, np.moveaxis(g, ax, 0))
    return (xg,)


def _prep_gather(a: Arrays) -> None:
    x = a["x"]
    ax = _axis(a.get("axis", 0), np.ndim(x))
    a["index"] = np.abs(_ids(a["index"])) % max(int(np.shape(x)[ax]), 1)


# -- gather_nd / scatter_nd_add ------------------------------------------------------------------------


def _coords(index: Any, shape: tuple[int, ...]) -> tuple[np.ndarray, int, tuple[int, ...]]:
    """(index as [n, k] with every coordinate folded into range, k, batch shape)."""
    i = _ids(index)
    k = i.shape[-1]
    batch = i.shape[:-1]
    flat = i.reshape(-1, k)
    cols = [_fold(flat[:, j], shape[j]) for j in range(k)]
    out = np.stack(cols, axis=1) if cols else flat
    return out, k, batch


def _gather_nd_of(x: np.ndarray, index: Any) -> np.ndarray:
    flat, k, batch = _coords(index, x.shape)
    n = flat.shape[0]
    tail = x.shape[k:]
    if k == 0:
        vals = np.broadcast_to(x, (n, *tail)).copy()
    else:
        vals = x[tuple(flat.T)]
    return vals.reshape((*batch, *tail))


def _scatter_nd_add_of(base: np.ndarray, index: Any, updates: Any) -> np.ndarray:
    out = base.copy()
    flat, k, _ = _coords(index, base.shape)
    n = flat.shape[0]
    u = _f(updates).reshape((n, *base.shape[k:]))
    if k == 0:
        out += u.sum(axis=0)
    else:
        np.add.at(out, tuple(flat.T), u)
    return out


def _gather_nd(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    return (_gather_nd_of(_f(a["x"]), a["index"]),)


def _gather_nd_grad(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    x = _f(a["x"])
    return (_scatter_nd_add_of(np.zeros(x.shape), a["index"], a["out_grad"]),)


def _scatter_nd_add(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    return (_scatter_nd_add_of(_f(a["x"]), a["index"], a["updates"]),)


def _scatter_nd_add_grad(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    g = _f(a["out_grad"])
    return (g.copy(), _gather_nd_of(g, a["index"]))


def _prep_nd(holder: str) -> Any:
    def prep(a: Arrays) -> None:
        shape = np.shape(a[holder])
        i = np.abs(_ids(a["index"]))
        k = i.shape[-1]
        for j in range(k):
            i[..., j] %= max(int(shape[j]), 1)
        a["index"] = i

    return prep


# -- scatter ----------------------------------------------------------------------------------------------


def _rows(index: Any, m: int) -> np.ndarray:
    return _fold(_flat_index(index), m)


def _scatter(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    x = _f(a["x"])
    idx = _rows(a["index"], x.shape[0])
    u = _f(a["updates"])
    out = x.copy()
    if idx.ndim == 0:
        out[int(idx)] = u
        return (out,)
    if bool(a.get("overwrite", True)):
        out[idx] = u  # distinct rows (prepare); numpy keeps the last of duplicates
    else:
        out[idx] = 0.0
        np.add.at(out, idx, u)
    return (out,)


def _scatter_grad(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    g = _f(a["out_grad"])
    idx = _rows(a["index"], g.shape[0])
    xg = g.copy()
    if idx.ndim == 0:
        xg[int(idx)] = 0.0
        return (xg, g[int(idx)].copy())
    xg[idx] = 0.0
    return (xg, g[idx])


def _prep_scatter(holder: str) -> Any:
    def prep(a: Arrays) -> None:
        m = max(int(np.shape(a[holder])[0]), 1)
        raw = _ids(a["index"])
        if raw.ndim == 0:
            a["index"] = np.abs(raw) % m
            return
        flat = raw.reshape(-1)
        if bool(a.get("overwrite", True)) and flat.size <= m:
            rng = np.random.default_rng(int(np.abs(flat).sum()) + flat.size)
            rows = rng.permutation(m)[: flat.size]
        else:
            rows = np.abs(flat) % m
        a["index"] = rows.reshape(raw.shape)

    return prep


# -- where -------------------------------------------------------------------------------------------------


def _where(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    return (np.where(np.asarray(a["condition"], dtype=bool), _f(a["x"]), _f(a["y"])),)


def _where_grad(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    cond = np.asarray(a["condition"], dtype=bool)
    g = _f(a["out_grad"])
    cb = np.broadcast_to(cond, g.shape)
    xg = sum_to_shape(np.where(cb, g, 0.0), np.shape(a["x"]))
    yg = sum_to_shape(np.where(cb, 0.0, g), np.shape(a["y"]))
    return (xg, yg)


# -- registration -----------------------------------------------------------------------------------------

_IDX = {"index": _INT}
register_reference(Reference("gather", _gather, ("x", "index"), ("out",), "gather", domains=_IDX,
                             prepare=_prep_gather))
register_reference(Reference("gather_grad", _gather_grad, ("x", "index", "out_grad"), ("x_grad",), "gather_grad",
                             domains=_IDX, prepare=_prep_gather))
register_reference(Reference("index_select", _gather, ("x", "index"), ("out",), "index_select", domains=_IDX,
                             prepare=_prep_gather))
register_reference(Reference("index_select_grad", _gather_grad, ("x", "index", "out_grad"), ("x_grad",),
                             "index_select_grad", domains=_IDX, prepare=_prep_gather))
register_reference(Reference("gather_nd", _gather_nd, ("x", "index"), ("out",), "gather_nd", domains=_IDX,
                             prepare=_prep_nd("x")))
register_reference(Reference("gather_nd_grad", _gather_nd_grad, ("x", "index", "out_grad"), ("x_grad",),
                             "gather_nd_grad", domains=_IDX, prepare=_prep_nd("x")))
register_reference(Reference("scatter", _scatter, ("x", "index", "updates"), ("out",), "scatter", domains=_IDX,
                             prepare=_prep_scatter("x")))
register_reference(Reference("scatter_grad", _scatter_grad, ("index", "updates", "out_grad"),
                             ("x_grad", "updates_grad"), "scatter_grad", domains=_IDX,
                             prepare=_prep_scatter("out_grad")))
register_reference(Reference("scatter_nd_add", _scatter_nd_add, ("x", "index", "updates"), ("out",),
                             "scatter_nd_add", domains=_IDX, prepare=_prep_nd("x")))
register_reference(Reference("scatter_nd_add_grad", _scatter_nd_add_grad, ("index", "updates", "out_grad"),
                             ("x_grad", "updates_grad"), "scatter_nd_add_grad", domains=_IDX,
                             prepare=_prep_nd("out_grad")))
register_reference(Reference("where", _where, ("condition", "x", "y"), ("out",), "where",
                             domains={"condition": "bool"}))
register_reference(Reference("where_grad", _where_grad, ("condition", "x", "y", "out_grad"), ("x_grad", "y_grad"),
                             "where_grad", domains={"condition": "bool"}))


# -- generators ---------------------------------------------------------------------------------------------


def _idx_shape(r: random.Random, m: list[int], one_d: bool, n: int | None = None) -> tuple[int, ...]:
    size = rand_size(r, m) if n is None else n
    if one_d:
        return (size,)
    u = r.random()
    if u < 0.1:
        return ()
    if u < 0.22:
        return (size, 1)
    return (size,)


def _gather_spec(r: random.Random, m: list[int], one_d: bool) -> dict[str, Any]:
    x = rand_shape(r, m, 1, 4)
    nd = len(x)
    axis = r.randrange(nd)
    if r.random() < 0.2:
        axis -= nd
    return {"x": TGen(x), "index": TGen(_idx_shape(r, m, one_d), _INT), "axis": axis}


def _gather_out(sp: dict[str, Any]) -> tuple[int, ...]:
    x = sp["x"].shape
    ax = _axis(sp["axis"], len(x))
    i = sp["index"].shape
    mid: tuple[int, ...] = () if len(i) == 0 else (i[0],)
    return (*x[:ax], *mid, *x[ax + 1 :])


def _gather_gen(one_d: bool, grad: bool) -> Gen:
    """gather (an index of 0, 1 or 2 dims) or index_select (1-D), with ``out_grad`` for the grad."""

    def gen(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
        sp = _gather_spec(r, m, one_d)
        if grad:
            sp["out_grad"] = TGen(_gather_out(sp), "real")
        return sp

    return gen


def _nd_spec(r: random.Random, m: list[int]) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(x, index, batch + trailing) shapes of gather_nd / scatter_nd_add."""
    x = rand_shape(r, m, 1, 4)
    k = r.randint(1, len(x))
    batch = rand_shape(r, m, 0, 2)
    return x, (*batch, k), (*batch, *x[k:])


def _g_gather_nd(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    x, i, _ = _nd_spec(r, m)
    return {"x": TGen(x), "index": TGen(i, _INT)}


def _g_gather_nd_grad(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    x, i, o = _nd_spec(r, m)
    return {"x": TGen(x), "index": TGen(i, _INT), "out_grad": TGen(o, "real")}


def _g_scatter_nd_add(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    x, i, u = _nd_spec(r, m)
    return {"x": TGen(x), "index": TGen(i, _INT), "updates": TGen(u)}


def _g_scatter_nd_add_grad(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    x, i, u = _nd_spec(r, m)
    return {"index": TGen(i, _INT), "updates": TGen(u), "out_grad": TGen(x, "real")}


def _scatter_spec(r: random.Random, m: list[int]) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], bool]:
    x = rand_shape(r, m, 1, 4)
    overwrite = r.random() < 0.5
    n = r.randint(1, x[0]) if overwrite else rand_size(r, m)
    i = _idx_shape(r, m, False, n)
    u = x[1:] if len(i) == 0 else (n, *x[1:])
    return x, i, u, overwrite


def _g_scatter(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    x, i, u, ow = _scatter_spec(r, m)
    return {"x": TGen(x), "index": TGen(i, _INT), "updates": TGen(u), "overwrite": ow}


def _g_scatter_grad(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    x, i, u, ow = _scatter_spec(r, m)
    return {"index": TGen(i, _INT), "updates": TGen(u), "out_grad": TGen(x, "real"), "overwrite": ow}


def _where_shapes(r: random.Random, m: list[int]) -> tuple[tuple[int, ...], ...]:
    out = rand_shape(r, m, 0, 4)
    shapes = []
    for t in range(3):
        s = list(out)
        for i in range(len(s)):
            if r.random() < 0.15:
                s[i] = 1
        if (t > 0 or r.random() < 0.15) and r.random() < 0.3:
            s = s[r.randint(0, len(s)) :]
        shapes.append(tuple(s))
    return tuple(shapes)


def _g_where(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    c, x, y = _where_shapes(r, m)
    return {"condition": TGen(c, "bool"), "x": TGen(x), "y": TGen(y)}


def _g_where_grad(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    c, x, y = _where_shapes(r, m)
    o = tuple(np.broadcast_shapes(c, x, y))
    return {"condition": TGen(c, "bool"), "x": TGen(x), "y": TGen(y), "out_grad": TGen(o, "real")}


GENERATORS.update({
    "gather": _gather_gen(False, False),
    "gather_grad": _gather_gen(False, True),
    "index_select": _gather_gen(True, False),
    "index_select_grad": _gather_gen(True, True),
    "gather_nd": _g_gather_nd,
    "gather_nd_grad": _g_gather_nd_grad,
    "scatter": _g_scatter,
    "scatter_grad": _g_scatter_grad,
    "scatter_nd_add": _g_scatter_nd_add,
    "scatter_nd_add_grad": _g_scatter_nd_add_grad,
    "where": _g_where,
    "where_grad": _g_where_grad,
})
