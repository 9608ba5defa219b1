"""Numpy references and case generators of the sorting family (spmdkit.ops.sorting): argsort,
cummax, cummin, roll and their grads.

Kernels run on a rank's local arrays with the global attributes: the rules keep the sorted /
scanned / rolled axes replicated, so no ``localize`` hook is needed. The indices a grad consumes
are computed from x by ``prepare``.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np

from spmdkit.sim.cases import GENERATORS, TGen, rand_axis, rand_shape
from spmdkit.sim.reference import Arrays, Ctx, Reference, as_f64, register_reference
from spmdkit.sim.reference import norm_axis as _ax
from spmdkit.sim.refs.along_axis import scatter_add


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


register_reference(Reference("argsort", _argsort, ("x",), ("out", "indices"), "sort"))
register_reference(Reference("argsort_grad", _argsort_grad, ("indices", "x", "out_grad"), ("x_grad",),
                             "sort_grad", domains={"indices": "int"}, prepare=_prep_argsort_grad))


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
    register_reference(Reference(_op, _cum(_lg), ("x",), ("out", "indices"), "sort"))
    register_reference(Reference(f"{_op}_grad", _cum_grad, ("x", "indices", "out_grad"), ("x_grad",),
                                 "sort_grad", domains={"indices": "int"}, prepare=_prep_cum(_lg)))


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
                             ("out",), "roll"))
register_reference(Reference("roll_grad", lambda a, c: (roll(a["out_grad"], a["shifts"], a.get("axis", ()), -1),),
                             ("x", "out_grad"), ("x_grad",), "roll_grad"))



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


GENERATORS.update({
    "sort": _g_sort,
    "sort_grad": _g_sort_grad,
    "roll": _g_roll,
    "roll_grad": _g_roll_grad,
})

__all__ = ["argsort", "cum_extreme", "roll"]
