"""Lowerings of ATen ops to the ``matmul`` family's rules (:mod:`spmdkit.ops.matmul`): mm / bmm /
matmul, linear (``matmul(trans_y=True)`` [+ ``add``]), addmm / baddbmm (BLOOM's ALiBi scores), and
the grouped matmul of HF's MoE."""

from __future__ import annotations

from typing import Any

import torch

from spmdkit.models.torch_import.context import Hook, ImportContext


def _matmul(c: ImportContext) -> Any:
    return c.emit1("matmul", {"x": c.args[0], "y": c.args[1]})


def _linear(c: ImportContext) -> Any:
    x, w = c.args[0], c.args[1]
    bias = c.arg(2, "bias")
    if bias is None:
        return c.emit1("matmul", {"x": x, "y": w}, trans_y=True)
    mm = c.emit1("matmul", {"x": x, "y": w}, c.fresh("mm"), trans_y=True)
    return c.emit1("add", {"x": mm, "y": bias})


def _addmm(c: ImportContext) -> Any:
    """``addmm`` / ``baddbmm``: ``beta * input + alpha * (m1 @ m2)``; a beta of 0 drops the input
    (torch ignores it then, NaN included)."""
    bias, m1, m2 = c.args[:3]
    beta, alpha = c.arg(3, "beta", 1), c.arg(4, "alpha", 1)
    mm = c.emit1("matmul", {"x": m1, "y": m2}, None if beta == 0 and alpha == 1 else c.fresh("mm"))
    if alpha != 1:
        mm = c.emit1("multiply", {"x": mm, "y": float(alpha)}, None if beta == 0 else c.fresh("alpha"))
    if beta == 0:
        return mm
    if beta != 1:
        bias = c.emit1("multiply", {"x": bias, "y": float(beta)}, (c.fresh("beta"), c.shape(bias), c.dtype(bias)))
    return c.emit1("add", {"x": mm, "y": bias})


def _grouped_mm(c: ImportContext) -> Any:
    """A grouped matmul over rows sorted by group: ``out[r] = x[r] @ w[g]`` for the rows r in
    ``[offs[g-1], offs[g])`` (zeros past ``offs[-1]``), HF's ``grouped_mm_fallback`` /
    ``aten._grouped_mm`` (2-D x, 3-D w). As registered rules: every group's matmul on every
    row (``[1, N, H] @ [E, H, O]``, the expert axis shardable), multiplied by the 0/1 mask of
    the rows each group owns (built from ``offs``) and summed over the groups: the same values
    (each row is its group's product plus exact zeros), and differentiable."""
    x, w, offs = c.args[0], c.args[1], c.arg(2, "offs")
    xs, ws = c.shape(x), c.shape(w)
    if len(xs) != 2 or len(ws) != 3 or offs is None:
        raise c.unsupported("a grouped matmul other than 2-D input, 3-D weight and offsets")
    if c.arg(3, "bias") is not None:
        raise c.unsupported("a grouped matmul bias")
    n, e, o = xs[0], ws[0], ws[2]
    dt = c.out_dtype()
    ends = c.tensor(offs)
    if c.dtype(ends) != "int64":
        ends = c.emit1("cast", {"x": ends}, (c.fresh("ends"), (e,), "int64"), dtype="int64")
    if e > 1:
        head = c.emit1("slice", {"input": ends}, (c.fresh("prev"), (e - 1,), "int64"), axes=(0,), starts=(0,),
                       ends=(e - 1,))
        starts: Any = c.emit1("concat", {"x": (c.tensor(torch.zeros(1, dtype=torch.int64)), head)},
                              (c.fresh("starts"), (e,), "int64"), axis=0)
    else:
        starts = c.tensor(torch.zeros(1, dtype=torch.int64))
    rows = c.tensor(torch.arange(n, dtype=torch.int64).view(1, n))
    s2 = c.reshape(starts, (e, 1), c.fresh("starts_col"))
    e2 = c.reshape(ends, (e, 1), c.fresh("ends_col"))
    before = c.emit1("less_than", {"x": rows, "y": s2}, (c.fresh("before"), (e, n), "bool"))
    after = c.emit1("logical_not", {"x": before}, (c.fresh("from_start"), (e, n), "bool"))
    upto = c.emit1("less_than", {"x": rows, "y": e2}, (c.fresh("to_end"), (e, n), "bool"))
    own = c.emit1("logical_and", {"x": after, "y": upto}, (c.fresh("owns"), (e, n), "bool"))
    maskf = c.emit1("cast", {"x": own}, (c.fresh("owns_f"), (e, n), dt), dtype=dt)
    mask3 = c.reshape(maskf, (e, n, 1), c.fresh("owns_col"))
    xb = c.emit1("unsqueeze", {"x": x}, (c.fresh("rows"), (1, n, xs[1]), c.dtype(x)), axis=(0,))
    if c.dtype(w) != c.dtype(x):
        w = c.emit1("cast", {"x": w}, (c.fresh("w"), ws, c.dtype(x)), dtype=c.dtype(x))
    allg = c.emit1("matmul", {"x": xb, "y": w}, (c.fresh("every_group"), (e, n, o), dt))
    mine = c.emit1("multiply", {"x": allg, "y": mask3}, (c.fresh("own_group"), (e, n, o), dt))
    return c.emit1("sum", {"x": mine}, axis=(0,), keep_dim=False)


def _table() -> dict[str, Hook]:
    t: dict[str, Hook] = {}
    for k in ("mm", "bmm", "matmul"):
        t["aten." + k] = _matmul
    t["aten.linear"] = _linear
    t["aten.addmm"] = t["aten.baddbmm"] = _addmm
    t["transformers.grouped_mm_fallback"] = t["aten._grouped_mm"] = _grouped_mm
    return t


#: ATen op (packet or overload) -> its lowering
ATEN = _table()
