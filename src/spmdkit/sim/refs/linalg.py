"""Simulator references and case generators of the matmul variants: bmm, linear_v2,
fused_gemm_epilogue (no activation: ``reserve_space`` absent), fused_linear_param_grad_add
(an empty / 0-d dweight or dbias counts as absent, as Paddle passes "none"), einsum
(numpy.einsum; generated equations with 1-3 operands, contractions, batch letters, outer
products, diagonals, ``...`` with size-1 broadcast axes, implicit outputs) and their grads. ``bmm`` here replaces the matmul reference alias with one whose generator
makes the 3-D operands the op takes."""

from __future__ import annotations

import random
from typing import Any

import numpy as np

from spmdkit.sim.cases import GENERATORS, TGen, rand_size
from spmdkit.sim.reference import Arrays, Ctx, Reference, register_reference
from spmdkit.sim.refs.matmul import matmul

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


def _has_bias(a: Arrays) -> bool:
    b = a.get("bias")
    return b is not None and np.ndim(b) > 0


def _linear(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    x, w = _f(a["input"]), _f(a["weight"])
    if a.get("transpose_weight", False):
        w = _t(w)
    out = np.matmul(x, w)
    if _has_bias(a):  # bias is optional (absent: None or 0-D, as Paddle accepts)
        out = out + _f(a["bias"])
    return (out, None)


def _linear_grad(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    x, w, g = _f(a["input"]), _f(a["weight"]), _f(a["out_grad"])
    tw = bool(a.get("transpose_weight", False))
    ww = _t(w) if tw else w
    dx = np.matmul(g, _t(ww))
    x2, g2 = _rows(x), _rows(g)
    dw = x2.T @ g2
    return (dx, dw.T if tw else dw, g2.sum(axis=0) if _has_bias(a) else None)


def _g_linear(r: random.Random, m: list[int], ref: Reference) -> Spec:
    k, n = rand_size(r, m), rand_size(r, m)
    batch = [rand_size(r, m) for _ in range(r.choice((1, 1, 2)))]
    tw = r.random() < 0.3
    return {"input": TGen((*batch, k)), "weight": TGen((n, k) if tw else (k, n)),
            "bias": TGen((n,)) if r.random() < 0.75 else None, "transpose_weight": tw}


def _g_linear_grad(r: random.Random, m: list[int], ref: Reference) -> Spec:
    sp = _g_linear(r, m, ref)
    w = sp["weight"].shape
    n = w[0] if sp["transpose_weight"] else w[1]
    sp["out_grad"] = TGen((*sp["input"].shape[:-1], n))
    return sp


def _gemm(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    return (matmul(_f(a["x"]), _f(a["y"]), bool(a.get("trans_x", False)), bool(a.get("trans_y", False)))
            + _f(a["bias"]), None)


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


def _given(t: Any) -> bool:
    """An accumulator is used when present and not empty (Paddle passes a 0-d / empty tensor
    for "none", as its unit test does)."""
    return t is not None and np.ndim(t) > 0 and np.size(t) > 0


def _flpga(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    x, g = _f(a["x"]), _f(a["dout"])
    x2, g2 = _rows(x), _rows(g)
    dw = x2.T @ g2
    if _given(a.get("dweight")):
        dw = dw + _f(a["dweight"])
    db = None
    if a.get("has_bias", True):
        db = g2.sum(axis=0)
        if _given(a.get("dbias")):
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
register_reference(Reference("linear_v2", _linear, ("input", "weight"), ("out", "reserve_space"),
                             "linear_v2", optional=("bias",)))
register_reference(Reference("linear_v2_grad", _linear_grad, ("input", "weight", "out_grad"),
                             ("input_grad", "weight_grad", "bias_grad"), "linear_v2_grad", optional=("bias",)))
register_reference(Reference("fused_gemm_epilogue", _gemm, ("x", "y", "bias"), ("out", "reserve_space"), "gemm"))
register_reference(Reference("fused_gemm_epilogue_grad", _gemm_grad, ("x", "y", "out_grad"),
                             ("x_grad", "y_grad", "bias_grad"), "gemm_grad", optional=("reserve_space",)))
register_reference(Reference("fused_linear_param_grad_add", _flpga, ("x", "dout"), ("dweight_out", "dbias_out"),
                             "flpga", optional=("dweight", "dbias")))


# -- einsum -------------------------------------------------------------------------------------

_LETTERS = "abcdefgh"


def _einsum_labels(equation: str, ndims: list[int]) -> tuple[list[list[int]], list[int]]:
    """Integer labels of each operand and of the output (``...`` right-aligned, implicit
    output = the letters used once, sorted, after the ellipsis)."""
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    n_ell = max((nd - len(t.replace("...", "")) for t, nd in zip(terms, ndims) if "..." in t), default=0)
    ell = list(range(1000, 1000 + n_ell))  # never a letter's code

    def lab(term: str, nd: int | None) -> list[int]:
        if "..." in term:
            pre, _, post = term.partition("...")
            k = n_ell if nd is None else nd - len(pre) - len(post)
            return [ord(c) for c in pre] + ell[n_ell - k:] + [ord(c) for c in post]
        return [ord(c) for c in term]

    ops = [lab(t, nd) for t, nd in zip(terms, ndims)]
    if arrow:
        out = lab(rhs, None)
    else:
        flat = [c for t in terms for c in t.replace("...", "")]
        out = ell + [ord(c) for c in sorted(set(flat)) if flat.count(c) == 1]
    # numpy's sublist labels must be small ints
    ids = {v: i for i, v in enumerate(sorted({v for o in ops for v in o}))}
    return [[ids[v] for v in o] for o in ops], [ids[v] for v in out]


def _einsum(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    xs = [_f(t) for t in a["inputs"]]
    ops, out = _einsum_labels(a["equation"], [x.ndim for x in xs])
    args: list[Any] = []
    for x, lb in zip(xs, ops):
        args += [x, lb]
    return (np.einsum(*args, out),)


def _einsum_grad(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    """d out / d inputs[i], contracted with out_grad: einsum of out_grad and the other
    operands onto operand i's distinct letters (size-1 broadcast axes summed away), then
    placed on the diagonal where operand i repeats a letter."""
    xs = [_f(t) for t in a["inputs"]]
    g = _f(a["out_grad"])
    ops, out = _einsum_labels(a["equation"], [x.ndim for x in xs])
    size: dict[int, int] = {}
    for x, lb in zip([*xs, g], [*ops, out]):
        for v, s in zip(lb, x.shape):
            if s != 1 or v not in size:
                size[v] = s
    grads: list[np.ndarray] = []
    for i, (x, lb) in enumerate(zip(xs, ops)):
        keep: list[int] = []
        for v, s in zip(lb, x.shape):
            if v not in keep and not (s == 1 and size[v] != 1):
                keep.append(v)
        args: list[Any] = [g, out]
        for j, (y, lj) in enumerate(zip(xs, ops)):
            if j != i:
                args += [y, lj]
        # ones along operand i's letters: the derivative is 1 along a letter only operand i
        # has, and the result takes the letter's full size where the others broadcast it
        for v in keep:
            args += [np.ones(size[v]), [v]]
        t = np.einsum(*args, keep)
        # gather onto operand i's axes: t at the distinct letters, zero off the diagonal
        idx = np.indices(x.shape)
        gi = t[tuple(idx[lb.index(v)] for v in keep)] if keep else t
        for ax, v in enumerate(lb):
            first = lb.index(v)
            if first != ax:
                gi = np.where(idx[ax] == idx[first], gi, 0.0)
        grads.append(np.broadcast_to(gi, x.shape).copy())
    return tuple(grads)


def _g_einsum(r: random.Random, m: list[int], ref: Reference) -> Spec:
    nl = r.randint(1, 5)
    letters = r.sample(_LETTERS, nl)
    size = {ch: rand_size(r, m) for ch in letters}
    n_ops = r.choice((1, 2, 2, 2, 3))
    use_ell = r.random() < 0.25
    ell = [rand_size(r, m) for _ in range(r.randint(1, 2))] if use_ell else []
    terms: list[str] = []
    shapes: list[tuple[int, ...]] = []
    used: list[str] = []
    for i in range(n_ops):
        k = r.randint(0 if n_ops > 1 else 1, min(nl, 4))
        lb = r.sample(letters, k)
        if lb and r.random() < 0.06:
            lb.insert(r.randint(0, len(lb)), r.choice(lb))  # a diagonal
        shape = [size[ch] for ch in lb]
        term = "".join(lb)
        if use_ell and (i == 0 or r.random() < 0.6):
            ne = r.randint(1 if i == 0 else 0, len(ell))
            es = [1 if r.random() < 0.15 else s for s in ell[len(ell) - ne:]]
            p = r.randint(0, len(lb))
            term = "".join(lb[:p]) + "..." + "".join(lb[p:])
            shape = shape[:p] + es + shape[p:]
        terms.append(term)
        shapes.append(tuple(shape))
        used += lb
    if r.random() < 0.7 or not used:
        cand = sorted(set(used))
        out = r.sample(cand, r.randint(0, len(cand)))
        rhs = "".join(out)
        if use_ell:
            p = r.randint(0, len(out))
            rhs = rhs[:p] + "..." + rhs[p:]
        eq = ",".join(terms) + "->" + rhs
    else:
        eq = ",".join(terms)
    ts = [TGen(s) for s in shapes]
    outs = _einsum({"inputs": [np.zeros(s) for s in shapes], "equation": eq}, None)  # type: ignore[arg-type]
    return {"inputs": ts, "equation": eq, "inner_cache": [], "out_grad": TGen(np.shape(outs[0]), "real")}


GENERATORS["einsum"] = _g_einsum
register_reference(Reference("einsum", _einsum, ("inputs",), ("out",), "einsum"))
register_reference(Reference("einsum_grad", _einsum_grad, ("inputs", "out_grad"), ("inputs_grad",), "einsum",
                             optional=("inner_cache",)))
