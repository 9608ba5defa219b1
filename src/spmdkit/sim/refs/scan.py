"""Numpy references and case generators of the scan / arg-reduction / misc family:
triu, tril_triu, cumsum, argmax, argmin, topk, logsumexp, add_n, full_like, empty_like,
ones_like, zeros_like and their grads (spmdkit.ops.scan).

Every kernel here runs on a rank's local arrays with the global attributes: the rules keep
the axes whose global position matters (triu's matrix, the scanned / arg / topk / reduced
axis) replicated, so no ``localize`` hook is needed. ``*_like`` build their output from the
local x's shape, as Paddle's kernels do; ``empty_like`` uses zeros as a deterministic
stand-in.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np

from spmdkit.sim.cases import GENERATORS, TGen, rand_axis, rand_shape
from spmdkit.sim.reference import Arrays, Ctx, Reference, as_f64, register_reference
from spmdkit.sim.reference import norm_axis as _ax

Shape = tuple[int, ...]


# -- triu / tril_triu ---------------------------------------------------------------------------


def _tri(x: Any, diagonal: Any, lower: Any) -> np.ndarray:
    x = as_f64(x)
    if x.ndim < 2:
        raise ValueError("triu needs at least 2 dims")
    k = int(diagonal)
    return np.asarray(np.tril(x, k) if lower else np.triu(x, k))


register_reference(Reference("triu", lambda a, c: (_tri(a["x"], a.get("diagonal", 0), False),), ("x",), ("out",),
                             "triu"))
register_reference(Reference("tril_triu", lambda a, c: (_tri(a["x"], a.get("diagonal", 0), a.get("lower", False)),),
                             ("x",), ("out",), "triu"))
register_reference(Reference("triu_grad", lambda a, c: (_tri(a["out_grd"], a.get("diagonal", 0), False),),
                             ("out_grd",), ("x_grad",), "triu_grad"))
register_reference(Reference("tril_triu_grad",
                             lambda a, c: (_tri(a["out_grad"], a.get("diagonal", 0), a.get("lower", False)),),
                             ("out_grad",), ("x_grad",), "triu_grad"))


# -- cumsum -------------------------------------------------------------------------------------


def cumsum(x: Any, axis: Any = -1, flatten: bool = False, exclusive: bool = False, reverse: bool = False) -> np.ndarray:
    x = as_f64(x)
    if flatten:
        x = x.reshape(-1)
        ax = 0
    else:
        ax = _ax(axis, x.ndim)
        if x.ndim == 0:
            return np.array(x, copy=True)
    if reverse:
        x = np.flip(x, ax)
    out = np.cumsum(x, axis=ax)
    if exclusive:
        out = out - x
    if reverse:
        out = np.flip(out, ax)
    return np.asarray(out)


def _cumsum(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    return (cumsum(a["x"], a.get("axis", -1), a.get("flatten", False), a.get("exclusive", False),
                   a.get("reverse", False)),)


def _cumsum_grad(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    # d/dx of a (reversed, exclusive) scan: the scan of out_grad in the other direction
    x = as_f64(a["x"])
    g = as_f64(a["out_grad"])
    flatten = bool(a.get("flatten", False))
    axis = 0 if flatten else a.get("axis", -1)
    gx = cumsum(g, axis, False, bool(a.get("exclusive", False)), not bool(a.get("reverse", False)))
    return (gx.reshape(x.shape),)


register_reference(Reference("cumsum", _cumsum, ("x",), ("out",), "cumsum"))
register_reference(Reference("cumsum_grad", _cumsum_grad, ("x", "out_grad"), ("x_grad",), "cumsum_grad"))


# -- argmax / argmin ----------------------------------------------------------------------------


def _arg(fn: Any) -> Any:
    def run(a: Arrays, c: Ctx) -> tuple[Any, ...]:
        x = as_f64(a["x"])
        keep = bool(a.get("keepdims", False))
        ax = _ax(a.get("axis", -1), x.ndim)
        if a.get("flatten", False) or x.ndim == 0:
            r = np.asarray(fn(x), dtype=np.int64)
            return (r.reshape((1,) * x.ndim if keep else ()),)
        return (np.asarray(fn(x, axis=ax, keepdims=keep), dtype=np.int64),)

    return run


register_reference(Reference("argmax", _arg(np.argmax), ("x",), ("out",), "argminmax"))
register_reference(Reference("argmin", _arg(np.argmin), ("x",), ("out",), "argminmax"))


# -- topk ---------------------------------------------------------------------------------------


def topk(x: Any, k: int, axis: Any, largest: bool) -> tuple[np.ndarray, np.ndarray]:
    x = as_f64(x)
    ax = _ax(axis, x.ndim)
    order = np.argsort(-x if largest else x, axis=ax, kind="stable")
    idx = np.take(order, np.arange(int(k)), axis=ax)
    return np.take_along_axis(x, idx, axis=ax), idx.astype(np.int64)


def _topk(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    return topk(a["x"], a.get("k", 1), a.get("axis", -1), bool(a.get("largest", True)))


def _topk_grad(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    x = as_f64(a["x"])
    ax = _ax(a.get("axis", -1), x.ndim)
    gx = np.zeros_like(x)
    np.put_along_axis(gx, np.asarray(a["indices"], dtype=np.int64), as_f64(a["out_grad"]), axis=ax)
    return (gx,)


def _prep_topk_grad(a: Arrays) -> None:
    k = np.shape(a["indices"])[_ax(a.get("axis", -1), np.ndim(a["x"]))]
    a["indices"] = topk(a["x"], k, a.get("axis", -1), bool(a.get("largest", True)))[1]


register_reference(Reference("topk", _topk, ("x",), ("out", "indices"), "topk"))
register_reference(Reference("topk_grad", _topk_grad, ("x", "indices", "out_grad"), ("x_grad",), "topk_grad",
                             domains={"indices": "int"}, prepare=_prep_topk_grad))


# -- logsumexp ----------------------------------------------------------------------------------


def _lse_axes(a: Arrays, ndim: int) -> tuple[int, ...]:
    axis = a.get("axis", ())
    axis = (axis,) if isinstance(axis, int) else tuple(axis)
    if a.get("reduce_all", False) or not axis or ndim == 0:
        return tuple(range(ndim))
    return tuple(sorted({_ax(v, ndim) for v in axis}))


def logsumexp(x: Any, axes: tuple[int, ...], keep: bool) -> np.ndarray:
    x = as_f64(x)
    if x.ndim == 0 or not axes:
        return np.array(x, copy=True)
    m = np.max(x, axis=axes, keepdims=True) if x.size else np.zeros([1 if i in axes else s for i, s in
                                                                       enumerate(x.shape)])
    out = np.log(np.sum(np.exp(x - m), axis=axes, keepdims=True)) + m
    return np.asarray(out if keep else out.reshape([s for i, s in enumerate(out.shape) if i not in axes]))


def _lse(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    x = as_f64(a["x"])
    return (logsumexp(x, _lse_axes(a, x.ndim), bool(a.get("keepdims", False))),)


def _keep_shape(t: np.ndarray, x: np.ndarray, axes: tuple[int, ...], keep: bool) -> np.ndarray:
    if keep or x.ndim == 0:
        return t.reshape([1 if i in axes else s for i, s in enumerate(t.shape)]) if keep else t
    return np.expand_dims(t, axes) if axes else t


def _lse_grad(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    x = as_f64(a["x"])
    axes = _lse_axes(a, x.ndim)
    keep = bool(a.get("keepdims", False))
    out = _keep_shape(as_f64(a["out"]), x, axes, keep)
    g = _keep_shape(as_f64(a["out_grad"]), x, axes, keep)
    return (np.asarray(g * np.exp(x - out)),)


def _prep_lse_grad(a: Arrays) -> None:
    x = as_f64(a["x"])
    a["out"] = logsumexp(x, _lse_axes(a, x.ndim), bool(a.get("keepdims", False)))


register_reference(Reference("logsumexp", _lse, ("x",), ("out",), "logsumexp"))
register_reference(Reference("logsumexp_grad", _lse_grad, ("x", "out", "out_grad"), ("x_grad",), "logsumexp_grad",
                             prepare=_prep_lse_grad))


# -- add_n --------------------------------------------------------------------------------------


def _add_n(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    xs = [as_f64(t) for t in a["input"]]
    return (sum(xs[1:], xs[0].copy()),)


def _add_n_grad(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    g = as_f64(a["out_grad"])
    return tuple(g.copy() for _ in a["inputs"])


register_reference(Reference("add_n", _add_n, ("input",), ("out",), "add_n"))
register_reference(Reference("add_n_grad", _add_n_grad, ("inputs", "out_grad"), ("inputs_grad",), "add_n_grad"))


# -- full_like and friends ----------------------------------------------------------------------


def _like(value: float | None) -> Any:
    def run(a: Arrays, c: Ctx) -> tuple[Any, ...]:
        v = float(a.get("y", 0.0)) if value is None else value
        return (np.full(np.shape(a["x"]), v, dtype=np.float64),)

    return run


register_reference(Reference("full_like", _like(None), ("x",), ("out",), "like"))
register_reference(Reference("empty_like", _like(0.0), ("x",), ("out",), "like"))
register_reference(Reference("ones_like", _like(1.0), ("x",), ("out",), "like"))
register_reference(Reference("zeros_like", _like(0.0), ("x",), ("out",), "like"))


# -- case generators ----------------------------------------------------------------------------


def _g_triu(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    s = rand_shape(r, m, 2, 4)
    return {"x": TGen(s), "diagonal": r.randint(-2, 2), "lower": r.random() < 0.5}


def _g_triu_grad(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    s = rand_shape(r, m, 2, 4)
    return {"out_grd": TGen(s), "out_grad": TGen(s), "diagonal": r.randint(-2, 2), "lower": r.random() < 0.5}


def _g_cumsum(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    s = rand_shape(r, m, 0, 4)
    return {"x": TGen(s), "axis": rand_axis(r, len(s)), "flatten": r.random() < 0.2,
            "exclusive": r.random() < 0.3, "reverse": r.random() < 0.3}


def _g_cumsum_grad(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    sp = _g_cumsum(r, m, ref)
    s = sp["x"].shape
    n = 1
    for v in s:
        n *= v
    sp["out_grad"] = TGen((n,) if sp["flatten"] else s, "real")
    return sp


def _g_arg(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    s = rand_shape(r, m, 0, 4)
    return {"x": TGen(s), "axis": rand_axis(r, len(s)), "keepdims": r.random() < 0.4, "flatten": r.random() < 0.2}


def _g_topk(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    s = rand_shape(r, m, 1, 4)
    axis = rand_axis(r, len(s))
    k = r.randint(1, s[axis])
    return {"x": TGen(s), "k": k, "axis": axis, "largest": r.random() < 0.7, "sorted": r.random() < 0.8}


def _g_topk_grad(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    sp = _g_topk(r, m, ref)
    s = list(sp["x"].shape)
    s[sp["axis"]] = sp["k"]
    sp["indices"] = TGen(tuple(s), "int")
    sp["out_grad"] = TGen(tuple(s), "real")
    return sp


def _rand_axes(r: random.Random, nd: int) -> list[int]:
    if nd == 0 or r.random() < 0.12:
        return []
    ax = r.sample(range(nd), r.randint(1, nd))
    return [a - nd if r.random() < 0.3 else a for a in ax]


def _g_lse(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    s = rand_shape(r, m, 0, 4)
    return {"x": TGen(s), "axis": _rand_axes(r, len(s)), "keepdims": r.random() < 0.4,
            "reduce_all": r.random() < 0.15}


def _g_lse_grad(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    sp = _g_lse(r, m, ref)
    s = sp["x"].shape
    o = logsumexp(np.zeros(s), _lse_axes(sp, len(s)), sp["keepdims"]).shape
    sp.update({"out": TGen(o, "real"), "out_grad": TGen(o, "real")})
    return sp


def _g_add_n(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    s = rand_shape(r, m, 0, 3)
    ts = [TGen(s) for _ in range(r.randint(1, 4))]
    return {"input": ts, "inputs": ts, "out_grad": TGen(s, "real")}


def _g_like(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    return {"x": TGen(rand_shape(r, m, 0, 4)), "y": r.choice((0.0, 1.0, -2.5, 3)), "dtype": None}


GENERATORS.update({
    "triu": _g_triu,
    "triu_grad": _g_triu_grad,
    "cumsum": _g_cumsum,
    "cumsum_grad": _g_cumsum_grad,
    "argminmax": _g_arg,
    "topk": _g_topk,
    "topk_grad": _g_topk_grad,
    "logsumexp": _g_lse,
    "logsumexp_grad": _g_lse_grad,
    "add_n": _g_add_n,
    "add_n_grad": _g_add_n,
    "like": _g_like,
})

__all__ = ["cumsum", "logsumexp", "topk"]
