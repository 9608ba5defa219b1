"""Numpy references and case generators of the norm family (spmdkit.ops.norm): layer_norm,
fused_rms_norm (rms_norm) and their grads.

mean / variance / invvar come out shaped ``x.shape[:begin_norm_axis]``, or flattened to 1-D where
the rule says so (Paddle's kernels return 1-D [prod(batch dims)]); the grads take the saved
statistics as inputs, made consistent with x by ``prepare``.
"""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np

from spmdkit.sim.cases import GENERATORS, Spec, TGen, rand_shape
from spmdkit.sim.reference import Arrays, Ctx, Reference, as_f64, register_reference


def _begin_axis(a: Arrays, ndim: int) -> int:
    b = int(a.get("begin_norm_axis", 1))
    if b < 0:
        b += ndim
    if not 0 <= b <= ndim:
        raise ValueError(f"begin_norm_axis {b} out of range")
    return b


def _stat_shape(stat: np.ndarray, c: Ctx, i: int) -> np.ndarray:
    """mean / variance / invvar: shaped x.shape[:begin_norm_axis], or flattened to 1-D where
    the rule says so (Paddle's kernels return 1-D [prod(batch dims)])."""
    nd = c.out_ndim(i)
    if nd is not None and nd != stat.ndim:
        if nd == 1:
            return stat.reshape(-1)
        if nd == 0 and stat.size == 1:
            return stat.reshape(())
    return stat


def _layer_norm(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    x = as_f64(a["x"])
    b = _begin_axis(a, x.ndim)
    eps = float(a.get("epsilon", 1e-5))
    ax = tuple(range(b, x.ndim))
    mean = x.mean(axis=ax, keepdims=True) if x.size else np.zeros(x.shape[:b] + (1,) * (x.ndim - b))
    var = ((x - mean) ** 2).mean(axis=ax, keepdims=True) if x.size else mean.copy()
    out = (x - mean) / np.sqrt(var + eps)
    tail = x.shape[b:]
    if a.get("scale") is not None:
        out = out * as_f64(a["scale"]).reshape(tail)
    if a.get("bias") is not None:
        out = out + as_f64(a["bias"]).reshape(tail)
    bs = x.shape[:b]
    return (out, _stat_shape(mean.reshape(bs), c, 1), _stat_shape(var.reshape(bs), c, 2))


def _layer_norm_grad(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    x, g = as_f64(a["x"]), as_f64(a["out_grad"])
    b = _begin_axis(a, x.ndim)
    eps = float(a.get("epsilon", 1e-5))
    bs, tail = x.shape[:b], x.shape[b:]
    ax = tuple(range(b, x.ndim))
    bax = tuple(range(b))
    kshape = bs + (1,) * len(tail)
    mean = as_f64(a["mean"]).reshape(kshape)
    var = as_f64(a["variance"]).reshape(kshape)
    inv = 1.0 / np.sqrt(var + eps)
    xh = (x - mean) * inv
    scale = as_f64(a["scale"]).reshape(tail) if a.get("scale") is not None else np.ones(tail)
    gs = g * scale
    if x.size:
        dx = inv * (gs - gs.mean(axis=ax, keepdims=True) - xh * (gs * xh).mean(axis=ax, keepdims=True))
    else:
        dx = np.zeros_like(x)
    n_tail = int(np.prod(tail)) if tail else 1
    dscale = (g * xh).sum(axis=bax).reshape(n_tail) if a.get("scale") is not None else None
    dbias = g.sum(axis=bax).reshape(n_tail) if a.get("bias") is not None else None
    return (dx, dscale, dbias)


def _prep_layer_norm_grad(a: Arrays) -> None:
    x = as_f64(a["x"])
    b = _begin_axis(a, x.ndim)
    ax = tuple(range(b, x.ndim))
    shp = np.shape(a["mean"])
    if x.size:
        m = x.mean(axis=ax)
        v = ((x - x.mean(axis=ax, keepdims=True)) ** 2).mean(axis=ax)
        a["mean"] = m.reshape(shp)
        a["variance"] = v.reshape(shp)


register_reference(Reference("layer_norm", _layer_norm, ("x",), ("out", "mean", "variance"), "layer_norm",
                             optional=("scale", "bias")))
register_reference(Reference("layer_norm_grad", _layer_norm_grad, ("x", "mean", "variance", "out_grad"),
                             ("x_grad", "scale_grad", "bias_grad"), "layer_norm_grad", optional=("scale", "bias"),
                             domains={"variance": "pos"}, prepare=_prep_layer_norm_grad))


def _rms_norm(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    x = as_f64(a["x"])
    eps = float(a.get("epsilon", 1e-5))
    if x.ndim == 0:
        raise ValueError("rms_norm needs at least 1-D x")
    ms = (x * x).mean(axis=-1, keepdims=True) if x.shape[-1] else np.zeros((*x.shape[:-1], 1))
    inv = 1.0 / np.sqrt(ms + eps)
    out = x * inv
    if a.get("scale") is not None:
        out = out * as_f64(a["scale"]).reshape(x.shape[-1:])
    return (out, _stat_shape(inv.reshape(x.shape[:-1]), c, 1))


def _rms_norm_grad(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    x, g = as_f64(a["x"]), as_f64(a["out_grad"])
    inv = as_f64(a["invvar"]).reshape((*x.shape[:-1], 1))
    scale = as_f64(a["scale"]).reshape(x.shape[-1:]) if a.get("scale") is not None else np.ones(x.shape[-1:])
    gs = g * scale
    m = (gs * x).mean(axis=-1, keepdims=True) if x.shape[-1] else np.zeros_like(inv)
    dx = inv * gs - x * inv**3 * m
    dscale = (g * x * inv).reshape(-1, x.shape[-1]).sum(axis=0) if a.get("scale") is not None else None
    return (dx, dscale)


def _prep_rms_norm_grad(a: Arrays) -> None:
    x = as_f64(a["x"])
    eps = float(a.get("epsilon", 1e-5))
    if x.ndim and x.shape[-1]:
        a["invvar"] = (1.0 / np.sqrt((x * x).mean(axis=-1) + eps)).reshape(np.shape(a["invvar"]))


register_reference(Reference("fused_rms_norm", _rms_norm, ("x",), ("out", "invvar"), "rms_norm",
                             optional=("scale",)), "rms_norm")
register_reference(Reference("rms_norm_grad", _rms_norm_grad, ("x", "invvar", "out_grad"), ("x_grad", "scale_grad"),
                             "rms_norm_grad", optional=("scale",), domains={"invvar": "pos"},
                             prepare=_prep_rms_norm_grad), "fused_rms_norm_grad")


# -- case generators ----------------------------------------------------------------------------


def _rand_begin_axis(r: random.Random, nd: int) -> int:
    if nd <= 1 or r.random() < 0.15:
        return r.randint(0, nd)
    return r.randint(1, nd - 1)


def _g_layer_norm(r: random.Random, m: list[int], ref: Reference) -> Spec:
    s = rand_shape(r, m, 1, 4)
    b = _rand_begin_axis(r, len(s))
    tail = (math.prod(s[b:]),)
    return {
        "x": TGen(s),
        "scale": TGen(tail) if r.random() < 0.8 else None,
        "bias": TGen(tail) if r.random() < 0.8 else None,
        "epsilon": 1e-5,
        "begin_norm_axis": b,
    }


def _g_layer_norm_grad(r: random.Random, m: list[int], ref: Reference) -> Spec:
    sp = _g_layer_norm(r, m, ref)
    s = sp["x"].shape
    bs = s[: sp["begin_norm_axis"]]
    sp.update({"mean": TGen(bs), "variance": TGen(bs, "pos"), "out_grad": TGen(s, "real")})
    return sp


def _g_rms_norm(r: random.Random, m: list[int], ref: Reference) -> Spec:
    s = rand_shape(r, m, 1, 4)
    return {"x": TGen(s), "scale": TGen(s[-1:]) if r.random() < 0.9 else None, "epsilon": 1e-6}


def _g_rms_norm_grad(r: random.Random, m: list[int], ref: Reference) -> Spec:
    sp = _g_rms_norm(r, m, ref)
    s = sp["x"].shape
    sp.update({"invvar": TGen(s[:-1], "pos"), "out_grad": TGen(s, "real")})
    return sp


GENERATORS.update({
    "layer_norm": _g_layer_norm,
    "layer_norm_grad": _g_layer_norm_grad,
    "rms_norm": _g_rms_norm,
    "rms_norm_grad": _g_rms_norm_grad,
})
