"""Lowerings of ATen ops to the ``embedding`` family's rules (:mod:`spmdkit.ops.embedding`): embedding."""

from __future__ import annotations

from typing import Any

from spmdkit.models.torch_import.context import Hook, ImportContext


def _embedding(c: ImportContext) -> Any:
    w, idx = c.args[0], c.args[1]
    pad = c.arg(2, "padding_idx", -1)
    ids = c.tensor(idx, "int64")
    return c.emit1("embedding", {"x": ids, "weight": w}, padding_idx=int(pad) if pad is not None else -1)


def _table() -> dict[str, Hook]:
    t: dict[str, Hook] = {}
    t["aten.embedding"] = _embedding
    return t


#: ATen op (packet or overload) -> its lowering
ATEN = _table()
