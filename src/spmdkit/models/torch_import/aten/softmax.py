"""Lowerings of ATen ops to the ``softmax`` family's rules (:mod:`spmdkit.ops.softmax`): softmax and
log_softmax."""

from __future__ import annotations

from typing import Any

from spmdkit.models.torch_import.context import Hook, ImportContext, norm_dim


def _softmax_like(rule: str) -> Hook:
    def h(c: ImportContext) -> Any:
        x = c.args[0]
        dim = c.arg(1, "dim", -1)
        return c.emit1(rule, {"x": x}, axis=norm_dim(int(dim), len(c.shape(x))))
    return h


def _table() -> dict[str, Hook]:
    t: dict[str, Hook] = {}
    t["aten.softmax"] = t["aten._softmax"] = _softmax_like("softmax")
    t["aten.log_softmax"] = t["aten._log_softmax"] = _softmax_like("log_softmax")
    return t


#: ATen op (packet or overload) -> its lowering
ATEN = _table()
