"""Numpy references and case generators of the matmul family (spmdkit.ops.matmul): matmul
(matmul_v2) and its grad, in formulas written once for numpy and torch.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np

from spmdkit.sim.cases import GENERATORS, Shape, Spec, TGen, rand_size, ref_global
from spmdkit.sim.reference import Arrays, Ctx, Reference, as_f64, get_reference, register_reference, sum_to_shape

# -- formulas written once for numpy and torch (spmdkit.execute.kernels runs them on torch tensors)


def swap_last(a: Any) -> Any:
    """The last two axes swapped (a 0-D or 1-D array as it is)."""
    return a.swapaxes(-1, -2) if a.ndim >= 2 else a


def matmul(x: Any, y: Any, trans_x: bool = False, trans_y: bool = False) -> Any:
    """Paddle's matmul: ``x @ y`` after the optional transposes of the last two axes."""
    return (swap_last(x) if trans_x else x) @ (swap_last(y) if trans_y else y)


def matmul_grad(x: Any, y: Any, g: Any, trans_x: bool, trans_y: bool) -> tuple[Any, Any]:
    """The gradients of :func:`matmul` for ``out_grad`` ``g``: (x_grad, y_grad), summed over the
    broadcast batch axes, in the shapes of ``x`` and ``y``."""
    tx, ty = trans_x and x.ndim >= 2, trans_y and y.ndim >= 2  # a vector is not transposed
    x2 = x.reshape(1, -1) if x.ndim == 1 else x
    y2 = y.reshape(-1, 1) if y.ndim == 1 else y
    A = swap_last(x2) if tx else x2
    B = swap_last(y2) if ty else y2
    batch = np.broadcast_shapes(tuple(A.shape[:-2]), tuple(B.shape[:-2]))
    g2 = g.reshape((*batch, A.shape[-2], B.shape[-1]))
    dA = g2 @ swap_last(B)
    dB = swap_last(A) @ g2
    dx2 = swap_last(dA) if tx else dA
    dy2 = swap_last(dB) if ty else dB
    return sum_to_shape(dx2, x2.shape).reshape(x.shape), sum_to_shape(dy2, y2.shape).reshape(y.shape)


# -- references -------------------------------------------------------------------------------


def _matmul(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    return (matmul(as_f64(a["x"]), as_f64(a["y"]), bool(a.get("trans_x", False)), bool(a.get("trans_y", False))),)


def _matmul_grad(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    return matmul_grad(as_f64(a["x"]), as_f64(a["y"]), as_f64(a["out_grad"]), bool(a.get("trans_x", False)),
                       bool(a.get("trans_y", False)))


register_reference(Reference("matmul", _matmul, ("x", "y"), ("out",), "matmul"), "matmul_v2")
register_reference(Reference("matmul_grad", _matmul_grad, ("x", "y", "out_grad"), ("x_grad", "y_grad"),
                             "matmul_grad"), "matmul_v2_grad")


# -- case generators ----------------------------------------------------------------------------


def _matmul_shapes(r: random.Random, m: list[int]) -> tuple[Shape, Shape, bool, bool]:
    mm, k, n = rand_size(r, m), rand_size(r, m), rand_size(r, m)
    tx, ty = r.random() < 0.3, r.random() < 0.3
    x1, y1 = r.random() < 0.12, r.random() < 0.12
    tx, ty = tx and not x1, ty and not y1  # Paddle's rule rejects trans on a 1-D operand
    x: tuple[int, ...] = (k,) if x1 else ((k, mm) if tx else (mm, k))
    y: tuple[int, ...] = (k,) if y1 else ((n, k) if ty else (k, n))
    nb = r.choice((0, 0, 1, 1, 2))
    batch = [rand_size(r, m) for _ in range(nb)]
    bx, by = list(batch), list(batch)
    for i in range(nb):
        u = r.random()
        if u < 0.15:
            bx[i] = 1
        elif u < 0.3:
            by[i] = 1
    if r.random() < 0.3:
        bx = bx[r.randint(0, nb):]
    elif r.random() < 0.3:
        by = by[r.randint(0, nb):]
    if not x1:
        x = (*bx, *x)
    if not y1:
        y = (*by, *y)
    return x, y, tx, ty


def _g_matmul(r: random.Random, m: list[int], ref: Reference) -> Spec:
    x, y, tx, ty = _matmul_shapes(r, m)
    return {"x": TGen(x), "y": TGen(y), "trans_x": tx, "trans_y": ty}


def _g_matmul_grad(r: random.Random, m: list[int], ref: Reference) -> Spec:
    sp = _g_matmul(r, m, ref)
    xa = np.zeros(sp["x"].shape)
    ya = np.zeros(sp["y"].shape)
    (o,) = ref_global(get_reference("matmul"), {"x": xa, "y": ya, "trans_x": sp["trans_x"], "trans_y": sp["trans_y"]})
    sp["out_grad"] = TGen(np.shape(o), "real")
    return sp


GENERATORS.update({
    "matmul": _g_matmul,
    "matmul_grad": _g_matmul_grad,
})

__all__ = ["matmul", "matmul_grad", "swap_last"]
