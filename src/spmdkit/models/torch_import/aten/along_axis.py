"""Lowerings of ATen ops to the ``along_axis`` family's rules (:mod:`spmdkit.ops.along_axis`): gather
-> ``take_along_axis``; index_put."""

from __future__ import annotations

from typing import Any

from spmdkit.models.torch_import.context import Hook, ImportContext, norm_dim


def _gather(c: ImportContext) -> Any:
    x, dim, index = c.args[:3]
    nd = len(c.shape(x))
    return c.emit1("take_along_axis", {"x": x, "index": c.tensor(index, "int64")}, axis=norm_dim(int(dim), nd))


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
    return t


#: ATen op (packet or overload) -> its lowering
ATEN = _table()
