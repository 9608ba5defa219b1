"""Simulator references and case generators of the matmul variants: bmm, linear_v2,
fused_gemm_epilogue (no activation: ``reserve_space`` absent), fused_linear_param_grad_add
and their grads. ``bmm`` here replaces the matmul reference alias with one whose generator
makes the 3-D operands the op takes."""

from __future__ import annotations

import random
from typing import Any

import numpy as np

from spmdkit.sim.cases import GENERATORS, TGen, rand_size
from spmdkit.sim.ops import Arrays, Ctx, Reference, register_reference

Spec = dict[str, Any]


def _f(v: Any) -> np.ndarray:
    return np.asarray(v, dtype=np.float64)


def _t(a: np.ndarray) -> np.ndarray:
    return np.swapaxes(a, -1, -2)


def _rows(a: np.ndarray) -> np.ndarray:
    """``a`` as a matrix of its last axis (empty local shards included)."""
    return a.reshape(int(np.prod(a.shape[:-1])), a.shape[-1])


# -- bmm ----------------------------------------------------------------------------------------


def _bmm(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    return (np.matmul(_f(a["x"]), _f(a["y"])),)


def _bmm_grad(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    x, y, g = _f(a["x"]), _f(a["y"]), _f(a["out_grad"])
    return (np.matmul(g, _t(y)), np.matmul(_t(x), g))


def _g_bmm(r: random.Random, m: list[int], ref: Reference) -> Spec:
    b, mm, k, n = (rand_size(r, m) for _ in range(4))
    return {"x": TGen((b, mm, k)), "y": TGen((b, k, n))}


def _g_bmm_grad(r: random.Random, m: list[int], ref: Reference) -> Spec:
    sp = _g_bmm(r, m, ref)
    b, mm, _ = sp["x"].shape
    sp["out_grad"] = TGen((b, mm, sp["y"].shape[2]))
    return sp


# -- linear_v2 / fused_gemm_epilogue ---------------------------------------------------------------


def _linear(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    x, w, bias = _f(a["input"]), _f(a["weight"]), _f(a["bias"])
    if a.get("transpose_weight", False):
        w = _t(w)
    return (np.matmul(x, w) + bias, None)


def _linear_grad(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    x, w, g = _f(a["input"]), _f(a["weight"]), _f(a["out_grad"])
    tw = bool(a.get("transpose_weight", False))
    ww = _t(w) if tw else w
    dx = np.matmul(g, _t(ww))
    x2, g2 = _rows(x), _rows(g)
    dw = x2.T @ g2
    return (dx, dw.T if tw else dw, g2.sum(axis=0))


def _g_linear(r: random.Random, m: list[int], ref: Reference) -> Spec:
    k, n = rand_size(r, m), rand_size(r, m)
    batch = [rand_size(r, m) for _ in range(r.choice((1, 1, 2)))]
    tw = r.random() < 0.3
    return {"input": TGen((*batch, k)), "weight": TGen((n, k) if tw else (k, n)), "bias": TGen((n,)),
            "transpose_weight": tw}


def _g_linear_grad(r: random.Random, m: list[int], ref: Reference) -> Spec:
    sp = _g_linear(r, m, ref)
    n = sp["bias"].shape[0]
    sp["out_grad"] = TGen((*sp["input"].shape[:-1], n))
    return sp


def _gemm(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    x, y = _f(a["x"]), _f(a["y"])
    if a.get("trans_x", False):
        x = _t(x)
    if a.get("trans_y", False):
        y = _t(y)
    return (np.matmul(x, y) + _f(a["bias"]), None)


def _gemm_grad(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    x, y, g = _f(a["x"]), _f(a["y"]), _f(a["out_grad"])
    tx, ty = bool(a.get("trans_x", False)), bool(a.get("trans_y", False))
    xa = _t(x) if tx else x
    ya = _t(y) if ty else y
    dxa, dya = g @ _t(ya), _t(xa) @ g
    return (_t(dxa) if tx else dxa, _t(dya) if ty else dya, g.sum(axis=0))


def _g_gemm(r: random.Random, m: list[int], ref: Reference) -> Spec:
    mm, k, n = rand_size(r, m), rand_size(r, m), rand_size(r, m)
    tx, ty = r.random() < 0.3, r.random() < 0.3
    return {"x": TGen((k, mm) if tx else (mm, k)), "y": TGen((n, k) if ty else (k, n)), "bias": TGen((n,)),
            "trans_x": tx, "trans_y": ty}


def _g_gemm_grad(r: random.Random, m: list[int], ref: Reference) -> Spec:
    sp = _g_gemm(r, m, ref)
    mm = sp["x"].shape[1] if sp["trans_x"] else sp["x"].shape[0]
    sp["out_grad"] = TGen((mm, sp["bias"].shape[0]))
    sp["reserve_space"] = None
    sp["activation_grad"] = "none"
    return sp


# -- fused_linear_param_grad_add -----------------------------------------------------------------


def _flpga(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    x, g = _f(a["x"]), _f(a["dout"])
    x2, g2 = _rows(x), _rows(g)
    dw = x2.T @ g2
    if a.get("dweight") is not None:
        dw = dw + _f(a["dweight"])
    db = None
    if a.get("has_bias", True):
        db = g2.sum(axis=0)
        if a.get("dbias") is not None:
            db = db + _f(a["dbias"])
    return (dw, db)


def _g_flpga(r: random.Random, m: list[int], ref: Reference) -> Spec:
    k, n = rand_size(r, m), rand_size(r, m)
    batch = [rand_size(r, m) for _ in range(r.choice((1, 2)))]
    sp: Spec = {"x": TGen((*batch, k)), "dout": TGen((*batch, n))}
    with_acc = r.random() < 0.5
    sp["dweight"] = TGen((k, n)) if with_acc else None
    sp["dbias"] = TGen((n,)) if with_acc else None
    return sp


GENERATORS.update({"bmm": _g_bmm, "bmm_grad": _g_bmm_grad, "linear_v2": _g_linear, "linear_v2_grad": _g_linear_grad,
                   "gemm": _g_gemm, "gemm_grad": _g_gemm_grad, "flpga": _g_flpga})

register_reference(Reference("bmm", _bmm, ("x", "y"), ("out",), "bmm"))
register_reference(Reference("bmm_grad", _bmm_grad, ("x", "y", "out_grad"), ("x_grad", "y_grad"), "bmm_grad"))
register_reference(Reference("linear_v2", _linear, ("input", "weight", "bias"), ("out", "reserve_space"),
                             "linear_v2"))
register_reference(Reference("linear_v2_grad", _linear_grad, ("input", "weight", "bias", "out_grad"),
                             ("input_grad", "weight_grad", "bias_grad"), "linear_v2_grad"))
register_reference(Reference("fused_gemm_epilogue", _gemm, ("x", "y", "bias"), ("out", "reserve_space"), "gemm"))
register_reference(Reference("fused_gemm_epilogue_grad", _gemm_grad, ("x", "y", "out_grad"),
                             ("x_grad", "y_grad", "bias_grad"), "gemm_grad", optional=("reserve_space",)))
register_reference(Reference("fused_linear_param_grad_add", _flpga, ("x", "dout"), ("dweight_out", "dbias_out"),
                             "flpga", optional=("dweight", "dbias")))
