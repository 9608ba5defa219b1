"""Numpy references and case generators: swiglu, fused_dropout_add and their grads.

swiglu: ``silu(x) * y``; without y, x's last axis is split in halves ``a, b`` and the
result is ``silu(a) * b``; the grad is the real gradient. fused_dropout_add runs with
dropout p = 0 (``x + y``; the rules claim a layout, and the dropout mask is elementwise),
its grad is ``(out_grad, out_grad)``; seed_offset is a replicated constant [2].
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np

from spmdkit.sim.cases import GENERATORS, Spec, TGen, rand_shape
from spmdkit.sim.reference import Arrays, Ctx, Reference, register_reference


def _sig(x: np.ndarray) -> np.ndarray:
    return np.asarray(1.0 / (1.0 + np.exp(-x)))


def _halves(a: Arrays) -> tuple[np.ndarray, np.ndarray, bool]:
    x = np.asarray(a["x"], dtype=np.float64)
    y = a.get("y")
    if y is not None and np.ndim(y) == 0 and x.ndim > 0:
        y = None  # a 0-D y is how Paddle's callers pass an absent one
    if y is None:
        h = x.shape[-1] // 2
        return x[..., :h], x[..., h:], True
    return x, np.asarray(y, dtype=np.float64), False


def _swiglu(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    u, w, _ = _halves(a)
    return (u * _sig(u) * w,)


def _swiglu_grad(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    u, w, halved = _halves(a)
    g = np.asarray(a["out_grad"], dtype=np.float64)
    s = _sig(u)
    du = g * w * s * (1.0 + u * (1.0 - s))
    dw = g * u * s
    if halved:
        return (np.concatenate([du, dw], axis=-1), None)
    return (du, dw)


register_reference(Reference("swiglu", _swiglu, ("x",), ("out",), "swiglu", optional=("y",)))
register_reference(Reference("swiglu_grad", _swiglu_grad, ("x", "out_grad"), ("x_grad", "y_grad"), "swiglu_grad",
                             optional=("y",)))


def _g_swiglu(r: random.Random, m: list[int], ref: Reference) -> Spec:
    s = rand_shape(r, m, 1, 4)
    if r.random() < 0.35:
        s = (*s[:-1], 2 * max(s[-1], 1) if r.random() < 0.8 else 2 * s[-1])
        return {"x": TGen(s), "y": None}
    return {"x": TGen(s), "y": TGen(s)}


def _g_swiglu_grad(r: random.Random, m: list[int], ref: Reference) -> Spec:
    sp = _g_swiglu(r, m, ref)
    s = sp["x"].shape
    og = s if sp["y"] is not None else (*s[:-1], s[-1] // 2)
    return {**sp, "out_grad": TGen(og, "real")}


GENERATORS["swiglu"] = _g_swiglu
GENERATORS["swiglu_grad"] = _g_swiglu_grad


def _fused_dropout_add(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    x = np.asarray(a["x"], dtype=np.float64)
    y = np.asarray(a["y"], dtype=np.float64)
    return (x + y, np.zeros(2, dtype=np.int64))


def _fused_dropout_add_grad(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    g = np.asarray(a["out_grad"], dtype=np.float64)
    if float(a.get("p", 0.0)) != 0.0 and not a.get("is_test", False):
        raise ValueError("the reference runs dropout with p = 0 only")
    return (g.copy(), g.copy())


register_reference(Reference("fused_dropout_add", _fused_dropout_add, ("x", "y"), ("out", "seed_offset"),
                             "fused_dropout_add"))
register_reference(Reference("fused_dropout_add_grad", _fused_dropout_add_grad, ("out_grad",),
                             ("x_grad", "y_grad"), "fused_dropout_add_grad", optional=("seed_offset",),
                             domains={"seed_offset": "int"}))


def _g_fda(r: random.Random, m: list[int], ref: Reference) -> Spec:
    s = rand_shape(r, m, 1, 4)
    return {"x": TGen(s), "y": TGen(s)}


def _g_fda_grad(r: random.Random, m: list[int], ref: Reference) -> Spec:
    s = rand_shape(r, m, 1, 4)
    return {"seed_offset": TGen((2,), "int") if r.random() < 0.7 else None, "out_grad": TGen(s, "real"),
            "p": 0.0, "is_test": r.random() < 0.3, "mode": r.choice(("upscale_in_train", "downscale_in_infer")),
            "fix_seed": r.random() < 0.3}


GENERATORS["fused_dropout_add"] = _g_fda
GENERATORS["fused_dropout_add_grad"] = _g_fda_grad
