"""Numpy references and case generators of the transpose family (spmdkit.ops.transpose): transpose
(transpose2) and its grad.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np

from spmdkit.sim.cases import GENERATORS, Spec, TGen, rand_shape
from spmdkit.sim.reference import Arrays, Ctx, Reference, register_reference


def _perm(perm: Any, ndim: int) -> tuple[int, ...]:
    return tuple(int(p) + ndim if int(p) < 0 else int(p) for p in perm)


def _transpose(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    x = np.asarray(a["x"])
    return (np.transpose(x, _perm(a["perm"], x.ndim)),)


def _transpose_grad(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    g = np.asarray(a["out_grad"])
    p = _perm(a["perm"], g.ndim)
    return (np.transpose(g, np.argsort(p)),)


register_reference(Reference("transpose", _transpose, ("x",), ("out",), "transpose"), "transpose2")
register_reference(Reference("transpose_grad", _transpose_grad, ("out_grad",), ("x_grad",), "transpose_grad"))


# -- case generators ----------------------------------------------------------------------------


def _rand_perm(r: random.Random, nd: int) -> list[int]:
    p = list(range(nd))
    r.shuffle(p)
    return [v - nd if r.random() < 0.25 else v for v in p]


def _g_transpose(r: random.Random, m: list[int], ref: Reference) -> Spec:
    s = rand_shape(r, m, 1, 4)
    return {"x": TGen(s), "perm": _rand_perm(r, len(s))}


def _g_transpose_grad(r: random.Random, m: list[int], ref: Reference) -> Spec:
    s = rand_shape(r, m, 1, 4)
    return {"out_grad": TGen(s), "perm": _rand_perm(r, len(s))}


GENERATORS.update({
    "transpose": _g_transpose,
    "transpose_grad": _g_transpose_grad,
})
