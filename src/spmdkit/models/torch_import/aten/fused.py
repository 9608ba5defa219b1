"""Lowerings to the ``fused`` family's rules (:mod:`spmdkit.ops.fused`): the ``spmdkit::swiglu``
node a fused ``silu(a) * b`` becomes (:mod:`spmdkit.models.torch_import.fuse`) -> ``swiglu``."""

from __future__ import annotations

from typing import Any

from spmdkit.models.torch_import.context import Hook, ImportContext


def _swiglu(c: ImportContext) -> Any:
    return c.emit1("swiglu", {"x": c.args[0], "y": c.args[1]})


def _table() -> dict[str, Hook]:
    return {"spmdkit.swiglu": _swiglu}


#: op (packet or overload) -> its lowering
ATEN = _table()
