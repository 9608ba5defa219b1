"""Lowerings of ATen ops to the ``loss`` family's rules (:mod:`spmdkit.ops.loss`): cross_entropy_loss,
and nll_loss over log_softmax (through reshapes, fused before the walk: :func:`fuse_nll`) ->
``cross_entropy_with_softmax`` on the logits, then the reduction."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from spmdkit.models.torch_import.aten.view import VIEWS
from spmdkit.models.torch_import.context import Hook, ImportContext, Name, norm_dim, packet

LOG_SOFTMAX = {"aten.log_softmax", "aten._log_softmax"}
NLL = {"aten.nll_loss", "aten.nll_loss_nd", "aten.nll_loss_forward", "aten.nll_loss2d", "aten.nll_loss2d_forward"}


def _last(node: Any) -> int | None:
    v = node.meta.get("val")
    return int(v.shape[-1]) if isinstance(v, torch.Tensor) and v.ndim else None


def fuse_nll(graph: Any, skip: set[Any], fused: dict[Any, Any]) -> None:
    """Before the walk: an ``nll_loss`` over the ``log_softmax`` of the last dim (through views
    that keep it, each used once) is one ``cross_entropy_with_softmax`` on the logits: the
    log_softmax and the views join ``skip``, the nll node maps to the logits node in ``fused``."""
    for node in graph.nodes:
        if node.op != "call_function" or packet(node.target) not in NLL:
            continue
        src = node.args[0]
        chain = []
        while isinstance(src, torch.fx.Node) and src.op == "call_function" and packet(src.target) in VIEWS \
                and len(src.users) == 1 and isinstance(src.args[0], torch.fx.Node) \
                and _last(src) == _last(src.args[0]):
            chain.append(src)
            src = src.args[0]
        if not (isinstance(src, torch.fx.Node) and src.op == "call_function" and packet(src.target) in LOG_SOFTMAX
                and len(src.users) == 1):
            continue
        x = src.args[0]
        dim: Any = src.args[1] if len(src.args) > 1 else src.kwargs.get("dim", -1)
        nd = len(src.meta["val"].shape)
        if not isinstance(x, torch.fx.Node) or norm_dim(int(dim), nd) != nd - 1 \
                or len(node.args[0].meta["val"].shape) > 2:
            continue
        skip.update([src, *chain])
        fused[node] = x


def _ce_core(c: ImportContext, x: Any, target: Any, reduction: int, ignore_index: int, use_softmax: bool) -> Name:
    xs = c.shape(x)
    if len(xs) > 2:  # class dim 1 -> last
        perm = (0, *range(2, len(xs)), 1)
        x = c.transpose(x, perm, c.fresh("classes_last"))
        xs = c.shape(x)
    ts = c.shape(target)
    lab = c.emit1("unsqueeze", {"x": c.tensor(target, "int64")}, (c.fresh("label"), (*ts, 1), "int64"),
                  axis=(len(ts),))
    outs = [(c.fresh("softmax"), xs, c.dtype(x)), (c.fresh("token_loss"), (*ts, 1), c.dtype(x))]
    _, tok = c.emit("cross_entropy_with_softmax", {"x": x, "label": lab}, outs, ignore_index=int(ignore_index),
                    use_softmax=use_softmax)
    if reduction == 0:
        return c.reshape(tok, ts, c.name)
    dt = c.dtype(x)
    if reduction == 2:
        return c.emit1("sum", {"x": tok}, (c.name, (), dt), axis=(), keep_dim=False)
    # mean: over the counted tokens (torch divides by the number of labels != ignore_index;
    # ignored tokens have loss 0)
    total = c.emit1("sum", {"x": tok}, (c.fresh("loss_sum"), (), dt), axis=(), keep_dim=False)
    if isinstance(target, torch.Tensor):
        n = int((target != ignore_index).sum())
        return c.emit1("divide", {"x": total, "y": c.tensor(float(n), dt)}, (c.name, (), dt))
    keep = c.emit1("not_equal", {"x": lab, "y": c.tensor(int(ignore_index), "int64")},
                   (c.fresh("counted"), (*ts, 1), "bool"))
    keepf = c.emit1("cast", {"x": keep}, (c.fresh("counted_f"), (*ts, 1), dt), dtype=dt)
    count = c.emit1("sum", {"x": keepf}, (c.fresh("count"), (), dt), axis=(), keep_dim=False)
    return c.emit1("divide", {"x": total, "y": count}, (c.name, (), dt))


def _loss_args(c: ImportContext, first: int) -> tuple[int, int]:
    weight = c.arg(first, "weight")
    if weight is not None:
        raise c.unsupported("class weights")
    red = int(c.arg(first + 1, "reduction", 1))
    ii = int(c.arg(first + 2, "ignore_index", -100))
    return red, ii


def _cross_entropy(c: ImportContext) -> Any:
    x, target = c.args[0], c.args[1]
    red, ii = _loss_args(c, 2)
    if float(c.arg(5, "label_smoothing", 0.0)):
        raise c.unsupported("label smoothing")
    if c.is_tensor(target) and c.dtype(target).startswith(("float", "bfloat")):
        raise c.unsupported("soft (probability) targets")
    return _ce_core(c, x, target, red, ii, True)


def _nll(c: ImportContext) -> Any:
    x, target = c.args[0], c.args[1]
    red, ii = _loss_args(c, 2)
    logits = c.imp.fused.get(c.node)
    if logits is not None:
        lx = c.imp.env[logits]
        shp = tuple(int(d) for d in c.node.args[0].meta["val"].shape)
        x = c.reshape(lx, shp, c.fresh("logits")) if tuple(c.shape(lx)) != shp else lx
        out = _ce_core(c, x, target, red, ii, True)
    else:
        p = c.emit1("exp", {"x": x}, (c.fresh("probs"), c.shape(x), c.dtype(x)))
        out = _ce_core(c, p, target, red, ii, False)
    if c.target.startswith(("aten.nll_loss_forward", "aten.nll_loss2d_forward")):
        return (out, None)
    return out


def _table() -> dict[str, Hook]:
    t: dict[str, Hook] = {}
    t["aten.cross_entropy_loss"] = _cross_entropy
    for k in NLL:
        t[k] = _nll
    return t


#: ATen op (packet or overload) -> its lowering
ATEN = _table()
