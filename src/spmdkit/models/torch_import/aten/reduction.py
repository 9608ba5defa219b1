"""Lowerings of ATen ops to the ``reduction`` family's rules (:mod:`spmdkit.ops.reduction`): sum / mean
/ amax / amin / any / all, and histc of integer values (a sum over one_hot)."""

from __future__ import annotations

import math
from typing import Any

import torch

from spmdkit.models.torch_import.context import Hook, ImportContext, norm_dim, packet


def _reduce(rule: str) -> Hook:
    def h(c: ImportContext) -> Any:
        x = c.args[0]
        nd = len(c.shape(x))
        dims = c.arg(1, "dim")
        keep = bool(c.arg(2, "keepdim", False))
        if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
            axis: tuple[int, ...] = ()
        else:
            dl = [dims] if isinstance(dims, int) else list(dims)
            axis = tuple(sorted({norm_dim(int(d), nd) for d in dl}))
        if axis and len(axis) == nd and not keep:
            axis = ()
        return c.emit1(rule, {"x": x}, axis=axis, keep_dim=keep)
    return h


def _histc(c: ImportContext) -> Any:
    """``histc`` of integer values (a cast of an integer tensor, as HF's MoE counts tokens per
    expert) with one bin per integer of [min, max]: the sum over ``one_hot(x - min, bins)``."""
    bins, lo, hi = int(c.arg(1, "bins", 100)), c.arg(2, "min", 0), c.arg(3, "max", 0)
    src = c.node.args[0]
    ints = None
    if getattr(src, "op", None) == "call_function" and packet(src.target) in ("aten.to", "aten._to_copy"):
        v = src.args[0].meta.get("val") if hasattr(src.args[0], "meta") else None
        if isinstance(v, torch.Tensor) and not v.is_floating_point() and v.dtype != torch.bool:
            ints = c.imp.env[src.args[0]]
    if ints is None or float(lo) != int(lo) or float(hi) != int(hi) or bins != int(hi) - int(lo) + 1:
        raise c.unsupported("histc other than one bin per integer value of an integer tensor cast to float")
    ids = c.tensor(ints)
    if c.dtype(ids) != "int64":
        ids = c.emit1("cast", {"x": ids}, (c.fresh("ids"), c.shape(ids), "int64"), dtype="int64")
    if int(lo):
        ids = c.emit1("subtract", {"x": ids, "y": c.tensor(int(lo), "int64")}, (c.fresh("shift"), c.shape(ids), "int64"))
    flat = c.reshape(ids, (math.prod(c.shape(ids)),), c.fresh("flat"))
    n = c.shape(flat)[0]
    oh = c.emit1("one_hot", {"x": flat}, (c.fresh("one_hot"), (n, bins), "float32"), num_classes=bins)
    counts = c.emit1("sum", {"x": oh}, (c.fresh("counts"), (bins,), "float32"), axis=(0,), keep_dim=False)
    if c.out_dtype() == "float32":
        return c.reshape(counts, (bins,), c.name)
    return c.emit1("cast", {"x": counts}, dtype=c.out_dtype())


def _table() -> dict[str, Hook]:
    t: dict[str, Hook] = {}
    t["aten.amax"] = _reduce("max")
    t["aten.amin"] = _reduce("min")
    t["aten.any"] = _reduce("any")
    t["aten.all"] = _reduce("all")
    t["aten.mean"] = _reduce("mean")
    t["aten.sum"] = _reduce("sum")
    t["aten.histc"] = _histc
    return t


#: ATen op (packet or overload) -> its lowering
ATEN = _table()
