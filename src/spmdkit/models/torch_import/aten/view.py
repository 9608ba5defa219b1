"""Lowerings of ATen ops to the ``view`` family's rules (:mod:`spmdkit.ops.view`): the views (``view``
/ ``reshape`` / ``flatten`` / ... -> ``reshape``), unsqueeze, squeeze."""

from __future__ import annotations

from typing import Any

from spmdkit.models.torch_import.context import Hook, ImportContext, norm_dim, packet

#: the ATen views, each a ``reshape`` to the node's output shape
VIEWS = {"aten.view", "aten.reshape", "aten._unsafe_view", "aten.flatten", "aten.unflatten", "aten.view_as",
         "aten.reshape_as"}


def to_out_shape(rule: str) -> Hook:
    """A view (reshape) or expand to the node's output shape; the input itself where it has it."""

    def conv(c: ImportContext) -> Any:
        x = c.args[0]
        shp = c.out_shape()
        if tuple(c.shape(x)) == shp or (rule == "reshape" and _chunked_moe_only(c)):
            return c.tensor(x)
        return c.emit1(rule, {"x": x}, shape=shp)

    return conv


def _chunked_moe_only(c: ImportContext) -> bool:
    """Whether the view's only readers are a MoE block's router and experts routed in chunks
    (``spmdkit::moe_route`` with chunks > 1: context parallelism, :mod:`.moe`): they take the
    tokens as they are and view them into the chunks themselves (HF's flat ``[B x S, H]``
    would mix the rows of a batch shard and a cp shard, which no sharding holds as a block)."""
    users = list(c.node.users)
    kinds = {packet(u.target) for u in users}
    return bool(users) and kinds <= {"spmdkit.moe_route", "spmdkit.moe_experts"} and any(
        packet(u.target) == "spmdkit.moe_route" and len(u.args) > 12 and int(u.args[12]) > 1 for u in users)


_view = to_out_shape("reshape")


def _unsqueeze(c: ImportContext) -> Any:
    x, d = c.args[0], int(c.args[1])
    v = c.val()
    nd = v.dim() if hasattr(v, "dim") else len(c.shape(x)) + 1  # a complex tensor's parts axis not counted
    return c.emit1("unsqueeze", {"x": x}, axis=(norm_dim(d, nd),))


def _squeeze(c: ImportContext) -> Any:
    x = c.args[0]
    xs = c.shape(x)
    dims = c.arg(1, "dim")
    if dims is None:
        axes = [i for i, s in enumerate(xs) if s == 1]
    else:
        dl = [dims] if isinstance(dims, int) else list(dims)
        axes = sorted({norm_dim(int(d), len(xs)) for d in dl if xs[norm_dim(int(d), len(xs))] == 1})
    if not axes:
        return c.tensor(x)
    return c.emit1("squeeze", {"x": x}, axis=tuple(axes))


def _table() -> dict[str, Hook]:
    t: dict[str, Hook] = {}
    for k in VIEWS:
        t[k] = _view
    t["aten.unsqueeze"] = _unsqueeze
    t["aten.squeeze"] = _squeeze
    return t


#: ATen op (packet or overload) -> its lowering
ATEN = _table()
