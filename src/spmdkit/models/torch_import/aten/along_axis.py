"""Lowerings of ATen ops to the ``along_axis`` family's rules (:mod:`spmdkit.ops.along_axis`): gather
-> ``take_along_axis``; scatter -> ``put_along_axis`` (DeepSeek-V3's group mask); index_put."""

from __future__ import annotations

from typing import Any

from spmdkit.models.torch_import.aten.slice import broadcast_to
from spmdkit.models.torch_import.context import Hook, ImportContext, norm_dim


def _gather(c: ImportContext) -> Any:
    x, dim, index = c.args[:3]
    nd = len(c.shape(x))
    return c.emit1("take_along_axis", {"x": x, "index": c.tensor(index, "int64")}, axis=norm_dim(int(dim), nd))


def _scatter(c: ImportContext) -> Any:
    """``scatter(x, dim, index, src | value[, reduce])``: ``put_along_axis`` (assign, or add /
    multiply with ``reduce``), a scalar value broadcast to the index's shape."""
    x, dim, index, src = c.args[:4]
    reduce = c.arg(4, "reduce") or "assign"
    names = {"add": "add", "multiply": "mul", "sum": "add", "prod": "mul", "assign": "assign", "amax": "amax",
             "amin": "amin", "mean": "mean"}
    if reduce not in names:
        raise c.unsupported(f"scatter reduce {reduce!r}")
    od = c.out_dtype()
    idx = c.tensor(index, "int64")
    if c.dtype(idx) != "int64":
        idx = c.emit1("cast", {"x": idx}, (c.fresh("i64"), c.shape(idx), "int64"), dtype="int64")
    if c.is_tensor(src) and tuple(c.shape(src)) != tuple(c.shape(idx)):
        raise c.unsupported("scatter of a src larger than its index (its leading part taken)")
    val = c.tensor(src) if c.is_tensor(src) else broadcast_to(c, src, c.shape(idx), od)
    nd = len(c.shape(x))
    return c.emit1("put_along_axis", {"x": c.tensor(x), "index": idx, "value": val}, axis=norm_dim(int(dim), nd),
                   reduce=names[reduce], include_self=True)


def _index_put(c: ImportContext) -> Any:
    x, indices, value = c.args[0], list(c.args[1]), c.args[2]
    acc = bool(c.arg(3, "accumulate", False))
    if any(i is None for i in indices):
        raise c.unsupported("index_put with a None (full-dim) index")
    idx = []
    for t in indices:
        t = c.tensor(t, "int64")
        if c.dtype(t) == "bool":
            raise c.unsupported("index_put with a boolean mask index")
        if c.dtype(t) != "int64":
            t = c.emit1("cast", {"x": t}, (c.fresh("i64"), c.shape(t), "int64"), dtype="int64")
        idx.append(t)
    return c.emit1("index_put", {"x": c.tensor(x), "indices": tuple(idx), "value": c.tensor(value, c.out_dtype())},
                   accumulate=acc)


def _table() -> dict[str, Hook]:
    t: dict[str, Hook] = {}
    t["aten.gather"] = _gather
    t["aten.index_put"] = _index_put
    t["aten.scatter"] = _scatter
    return t


#: ATen op (packet or overload) -> its lowering
ATEN = _table()
