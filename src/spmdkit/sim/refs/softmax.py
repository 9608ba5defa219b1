"""Numpy references and case generators of the softmax family (spmdkit.ops.softmax): softmax,
log_softmax and their grads.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np

from spmdkit.sim.cases import GENERATORS, Spec, TGen, rand_axis, rand_shape
from spmdkit.sim.reference import Arrays, Ctx, Reference, as_f64, norm_axis, register_reference


def _softmax(x: np.ndarray, axis: int) -> np.ndarray:
    x = as_f64(x)
    if x.ndim == 0:
        return np.ones_like(x)
    m = x.max(axis=axis, keepdims=True) if x.size else x
    e = np.exp(x - m)
    return np.asarray(e / e.sum(axis=axis, keepdims=True))


def _log_softmax(x: np.ndarray, axis: int) -> np.ndarray:
    x = as_f64(x)
    if x.ndim == 0:
        return np.zeros_like(x)
    m = x.max(axis=axis, keepdims=True) if x.size else x
    return np.asarray(x - m - np.log(np.exp(x - m).sum(axis=axis, keepdims=True)))


def _axis1(axis: Any, ndim: int) -> int:
    """softmax's axis: any on a 0-d tensor (its softmax is 1 whatever the axis)."""
    return norm_axis(axis, ndim, any_0d=True)


def _softmax_grad(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    out, g = as_f64(a["out"]), as_f64(a["out_grad"])
    if out.ndim == 0:
        return (np.zeros_like(g),)
    ax = _axis1(a.get("axis", -1), out.ndim)
    return (out * (g - (g * out).sum(axis=ax, keepdims=True)),)


def _log_softmax_grad(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    out, g = as_f64(a["out"]), as_f64(a["out_grad"])
    if out.ndim == 0:
        return (np.zeros_like(g),)
    ax = _axis1(a.get("axis", -1), out.ndim)
    return (g - np.exp(out) * g.sum(axis=ax, keepdims=True),)


def _prep_softmax(a: Arrays) -> None:
    a["out"] = _softmax(a["out"], _axis1(a.get("axis", -1), np.ndim(a["out"])))


def _prep_log_softmax(a: Arrays) -> None:
    a["out"] = _log_softmax(a["out"], _axis1(a.get("axis", -1), np.ndim(a["out"])))


register_reference(Reference(
    "softmax", lambda a, c: (_softmax(a["x"], _axis1(a.get("axis", -1), np.ndim(a["x"]))),), ("x",), ("out",), "softmax"))
register_reference(Reference(
    "log_softmax", lambda a, c: (_log_softmax(a["x"], _axis1(a.get("axis", -1), np.ndim(a["x"]))),), ("x",), ("out",),
    "softmax"))
register_reference(Reference("softmax_grad", _softmax_grad, ("out", "out_grad"), ("x_grad",), "softmax_grad",
                             prepare=_prep_softmax))
register_reference(Reference("log_softmax_grad", _log_softmax_grad, ("out", "out_grad"), ("x_grad",), "softmax_grad",
                             prepare=_prep_log_softmax))


# -- case generators ----------------------------------------------------------------------------


def _g_softmax(r: random.Random, m: list[int], ref: Reference) -> Spec:
    s = rand_shape(r, m, 1, 4)
    return {"x": TGen(s), "axis": rand_axis(r, len(s))}


def _g_softmax_grad(r: random.Random, m: list[int], ref: Reference) -> Spec:
    s = rand_shape(r, m, 1, 4)
    return {"out": TGen(s), "out_grad": TGen(s), "axis": rand_axis(r, len(s))}


GENERATORS.update({
    "softmax": _g_softmax,
    "softmax_grad": _g_softmax_grad,
})
