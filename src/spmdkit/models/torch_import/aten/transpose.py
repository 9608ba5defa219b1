"""Lowerings of ATen ops to the ``transpose`` family's rules (:mod:`spmdkit.ops.transpose`): permute /
transpose / t -> ``transpose``."""

from __future__ import annotations

from typing import Any

from spmdkit.models.torch_import.context import Hook, ImportContext, norm_dim


def _permute(c: ImportContext) -> Any:
    x = c.args[0]
    nd = len(c.shape(x))
    perm = tuple(norm_dim(int(d), nd) for d in c.args[1])
    if perm == tuple(range(nd)):
        return c.tensor(x)
    return c.emit1("transpose", {"x": x}, perm=perm)


def _transpose(c: ImportContext) -> Any:
    x = c.args[0]
    nd = len(c.shape(x))
    if c.target.startswith("aten.t."):
        if nd < 2:
            return c.tensor(x)
        d0, d1 = 0, 1
    else:
        d0, d1 = norm_dim(int(c.args[1]), nd), norm_dim(int(c.args[2]), nd)
    if d0 == d1:
        return c.tensor(x)
    perm = list(range(nd))
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return c.emit1("transpose", {"x": x}, perm=tuple(perm))


def _table() -> dict[str, Hook]:
    t: dict[str, Hook] = {}
    t["aten.permute"] = _permute
    t["aten.transpose"] = t["aten.t"] = _transpose
    return t


#: ATen op (packet or overload) -> its lowering
ATEN = _table()
