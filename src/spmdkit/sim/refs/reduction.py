"""Numpy references and case generators of the reduction family (spmdkit.ops.reduction): sum,
mean, max, min, prod, any, all, squared_l2_norm, frobenius_norm (REDUCTIONS), reduce_base and
the grads, p_norm and its grad, numel.

The reductions run on a rank's local arrays with the global attributes: a rank reduces its own
elements (an empty local slice gives the reduction's identity), and the rule's partial answer says
how the pieces combine.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

import numpy as np

from spmdkit.sim.cases import GENERATORS, Spec, TGen, rand_axis, rand_shape, ref_global
from spmdkit.sim.reference import (
    Arrays,
    Ctx,
    Reference,
    RefFn,
    as_f64,
    get_reference,
    norm_axis,
    paddle_axes,
    reduce_axes,
    register_reference,
)


def _red(np_fn: Callable[..., np.ndarray]) -> Callable[[np.ndarray, tuple[int, ...], bool], np.ndarray]:
    def r(x: np.ndarray, ax: tuple[int, ...], keep: bool) -> np.ndarray:
        return np.asarray(np_fn(x, axis=ax, keepdims=keep))

    return r


def _sq_l2(x: np.ndarray, ax: tuple[int, ...], keep: bool) -> np.ndarray:
    x = as_f64(x)
    return np.asarray((x * x).sum(axis=ax, keepdims=keep))


def _frob(x: np.ndarray, ax: tuple[int, ...], keep: bool) -> np.ndarray:
    return np.asarray(np.sqrt(_sq_l2(x, ax, keep)))


ReduceFn = Callable[[np.ndarray, tuple[int, ...], bool], np.ndarray]
# name -> (fn, domain)
def _extreme(is_max: bool) -> ReduceFn:
    """max / min whose reduction over an empty (local) slice is the identity (-inf / +inf):
    what a rank holding no elements contributes to a partial MAX / MIN."""

    def r(x: np.ndarray, ax: tuple[int, ...], keep: bool) -> np.ndarray:
        x = np.asarray(x)
        if np.issubdtype(x.dtype, np.integer):
            info = np.iinfo(x.dtype)
            init: Any = info.min if is_max else info.max
        elif x.dtype == np.bool_:
            init = not is_max
        else:
            init = -np.inf if is_max else np.inf
        fn = np.max if is_max else np.min
        return np.asarray(fn(x, axis=ax, keepdims=keep, initial=init))

    return r


REDUCTIONS: dict[str, tuple[ReduceFn, str]] = {
    "sum": (_red(np.sum), "real"),
    "mean": (_red(np.mean), "real"),
    "max": (_extreme(True), "real"),
    "min": (_extreme(False), "real"),
    "prod": (_red(np.prod), "nonzero"),
    "any": (_red(np.any), "bool"),
    "all": (_red(np.all), "bool"),
    "squared_l2_norm": (_sq_l2, "real"),
    "frobenius_norm": (_frob, "real"),
}
REDUCTION_ALIASES = {"reduce_sum": "sum", "reduce_max": "max", "amax": "max", "amin": "min", "reduce_mean": "mean",
                     "reduce_min": "min", "reduce_prod": "prod", "reduce_any": "any", "reduce_all": "all"}
#: Paddle's ReduceType enum (reduce_base's reduce_type attribute)
REDUCE_BASE_TYPES = {0: "sum", 1: "max", 2: "min", 3: "prod", 4: "mean", 5: "any", 6: "all"}


def _reduction(fn: ReduceFn, name: str) -> RefFn:
    def run(a: Arrays, c: Ctx) -> tuple[Any, ...]:
        x = np.asarray(a["x"])
        ax = paddle_axes(a.get("axis", ()), x.ndim)
        keep = bool(a.get("keep_dim", False))
        if x.ndim == 0:
            out = np.asarray(fn(x, (), keep)) if name != "mean" else x.astype(np.float64)
        else:
            out = fn(x, ax, keep)
        nd = c.out_ndim(0)
        if nd == 1 and out.ndim == 0:  # squared_l2_norm: Paddle's output is [1]
            out = out.reshape(1)
        return (out,)

    return run


def _reduction_ref(name: str) -> Reference:
    fn, dom = REDUCTIONS[name]
    return Reference(name, _reduction(fn, name), ("x",), ("out",), "reduction", meta={"domain": dom, "op": name})


for _n in REDUCTIONS:
    register_reference(_reduction_ref(_n), *[k for k, v in REDUCTION_ALIASES.items() if v == _n])


def _reduce_base(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    name = REDUCE_BASE_TYPES.get(int(a.get("reduce_type", 0)), "sum")
    fn, _ = REDUCTIONS[name]
    return tuple(_reduction(fn, name)(a, c))


register_reference(Reference("reduce_base", _reduce_base, ("x",), ("out",), "reduce_base"))


def _expand_back(g: np.ndarray, xshape: tuple[int, ...], ax: tuple[int, ...], keep: bool) -> np.ndarray:
    if not keep:
        shp = tuple(1 if i in ax else s for i, s in enumerate(xshape))
        g = g.reshape(shp) if g.size == int(np.prod(shp)) else g
    return np.broadcast_to(g, xshape)


def _reduction_grad(name: str) -> RefFn:
    def run(a: Arrays, c: Ctx) -> tuple[Any, ...]:
        x, g = as_f64(a["x"]), as_f64(a["out_grad"])
        ax = reduce_axes(a, x.ndim)
        keep = bool(a.get("keep_dim", False))
        gb = _expand_back(g, x.shape, ax, keep)
        if name == "sum":
            return (np.array(gb),)
        if name == "mean":
            n = int(np.prod([x.shape[i] for i in ax])) if ax else 1
            return (gb / max(n, 1),)
        if name == "squared_l2_norm":
            return (2 * x * gb,)
        if name == "frobenius_norm":
            fro = _frob(x, ax, True)
            return (x / np.where(fro == 0, 1.0, fro) * gb,)
        if name in ("max", "min"):
            out: Any = a.get("out")
            if out is None:
                out = (np.max if name == "max" else np.min)(x, axis=ax, keepdims=True)
            ob = _expand_back(as_f64(out), x.shape, ax, keep)
            return ((x == ob) * gb,)
        if name == "prod":
            pout: Any = a.get("out")
            if pout is None:
                pout = np.prod(x, axis=ax, keepdims=True)
            return (_expand_back(as_f64(pout), x.shape, ax, keep) / x * gb,)
        raise ValueError(f"no gradient for {name}")

    return run


def _prep_reduction_grad(name: str) -> Callable[[Arrays], None]:
    fn, _ = REDUCTIONS[name]

    def prep(a: Arrays) -> None:
        if a.get("out") is not None:
            x = np.asarray(a["x"])
            a["out"] = np.asarray(fn(x, reduce_axes(a, x.ndim), bool(a.get("keep_dim", False)))).reshape(np.shape(a["out"]))

    return prep


for _n in ("sum", "mean", "max", "min", "prod", "squared_l2_norm", "frobenius_norm"):
    register_reference(
        Reference(f"{_n}_grad", _reduction_grad(_n), ("x", "out_grad"), ("x_grad",), "reduction_grad",
                  optional=("out",), domains={"x": REDUCTIONS[_n][1]}, prepare=_prep_reduction_grad(_n),
                  meta={"op": _n}),
        *[f"{k}_grad" for k, v in REDUCTION_ALIASES.items() if v == _n],
    )


# -- case generators ----------------------------------------------------------------------------


def _rand_axes(r: random.Random, nd: int) -> list[int]:
    if nd == 0 or r.random() < 0.12:
        return []
    k = r.randint(1, nd)
    ax = r.sample(range(nd), k)
    return [a - nd if r.random() < 0.3 else a for a in ax]


def _g_reduction(r: random.Random, m: list[int], ref: Reference) -> Spec:
    s = rand_shape(r, m, 0, 4)
    return {"x": TGen(s), "axis": _rand_axes(r, len(s)), "keep_dim": r.random() < 0.4}


def _g_reduce_base(r: random.Random, m: list[int], ref: Reference) -> Spec:
    sp = _g_reduction(r, m, ref)
    rt = r.choice(sorted(REDUCE_BASE_TYPES))
    sp["reduce_type"] = rt
    sp["x"] = TGen(sp["x"].shape, REDUCTIONS[REDUCE_BASE_TYPES[rt]][1])
    return sp


def _g_reduction_grad(r: random.Random, m: list[int], ref: Reference) -> Spec:
    sp = _g_reduction(r, m, ref)
    s = sp["x"].shape
    op = ref.meta.get("op", "sum")
    sp["x"] = TGen(s, REDUCTIONS[op][1])
    (o,) = ref_global(get_reference(op), {"x": np.ones(s), "axis": sp["axis"], "keep_dim": sp["keep_dim"]})
    sp.update({"out": TGen(np.shape(o), "real"), "out_grad": TGen(np.shape(o), "real"), "reduce_all": False})
    return sp


GENERATORS.update({
    "reduction": _g_reduction,
    "reduce_base": _g_reduce_base,
    "reduction_grad": _g_reduction_grad,
})


# -- p_norm -------------------------------------------------------------------------------------


def _pn_axes(a: Arrays, ndim: int) -> tuple[int, ...]:
    if ndim == 0:
        return ()
    if a.get("asvector", False):
        return tuple(range(ndim))
    return (norm_axis(a.get("axis", -1), ndim),)


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


register_reference(Reference("p_norm", _pnorm, ("x",), ("out",), "p_norm", domains={"x": "nonzero"}))
register_reference(Reference("p_norm_grad", _pnorm_grad, ("x", "out", "out_grad"), ("x_grad",), "p_norm_grad",
                             domains={"x": "nonzero", "out": "pos", "out_grad": "real"}, prepare=_prep_pnorm_grad))


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


GENERATORS.update({
    "p_norm": _g_pnorm,
    "p_norm_grad": _g_pnorm_grad,
})


# -- numel -----------------------------------------------------------------------------------------


def _numel(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    return (np.asarray(np.size(a["x"]), dtype=np.int64),)


register_reference(Reference("numel", _numel, ("x",), ("out",), "numel"))


def _g_numel(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    return {"x": TGen(rand_shape(r, m, 0, 4))}


GENERATORS["numel"] = _g_numel


__all__ = ["REDUCE_BASE_TYPES", "REDUCTIONS"]
