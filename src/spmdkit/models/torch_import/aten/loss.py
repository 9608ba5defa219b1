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


def _shape(node: Any) -> tuple[int, ...] | None:
    v = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return tuple(int(d) for d in v.shape) if isinstance(v, torch.Tensor) else None


def _used_once(node: Any) -> bool:
    """``node`` is read by one node (torch.export's metadata assertions not counted)."""
    return sum(1 for u in node.users if packet(u.target) != "aten._assert_tensor_metadata") == 1


def _flattened(node: Any) -> tuple[Any, list[Any]]:
    """(the source of ``node``, the nodes passed) where ``node`` is a view used once (a flatten of
    it), through a cast to its own dtype (HF's ``labels.to(device)``); (None, []) else."""
    passed = []
    if isinstance(node, torch.fx.Node) and node.op == "call_function" and packet(node.target) in ("aten.to",
                                                                                                  "aten._to_copy") \
            and _used_once(node) and isinstance(node.args[0], torch.fx.Node) \
            and getattr(node.meta.get("val"), "dtype", None) == getattr(node.args[0].meta.get("val"), "dtype", 0):
        passed.append(node)
        node = node.args[0]
    if isinstance(node, torch.fx.Node) and node.op == "call_function" and packet(node.target) in VIEWS \
            and _used_once(node) and isinstance(node.args[0], torch.fx.Node):
        return node.args[0], [*passed, node]
    return None, []


def fuse_ce_views(graph: Any, skip: set[Any], fused: dict[Any, Any]) -> None:
    """Before the walk (a ``prepare`` of :func:`cross_entropy_unflattened`): a ``cross_entropy_loss``
    (mean or sum) of logits flattened to ``[N, C]`` and labels to ``[N]``, views of ``[..., C]``
    logits and ``[...]`` labels of the same leading dims, reads the unflattened ones (HF's loss
    flattens ``[batch, seq]``, which a sequence split over cp cannot: Paddle's reshape splits a
    flattened axis by its leading dim only). The views join ``skip``; the loss node maps to
    (logits node, labels node) in ``fused``."""
    for node in graph.nodes:
        if node.op != "call_function" or packet(node.target) != "aten.cross_entropy_loss":
            continue
        red = node.args[3] if len(node.args) > 3 else node.kwargs.get("reduction", 1)
        (x, xp), (t, tp) = _flattened(node.args[0]), _flattened(node.args[1])
        if int(red) == 0 or x is None or t is None:
            continue
        fx_, ft, xs, ts = _shape(node.args[0]), _shape(node.args[1]), _shape(x), _shape(t)
        if fx_ is None or ft is None or xs is None or ts is None or len(fx_) != 2 or len(ts) < 2 \
                or xs[-1] != fx_[-1] or xs[:-1] != ts:
            continue
        skip.update([*xp, *tp])
        skip.update(u for n in (*xp, *tp) for u in n.users if packet(u.target) == "aten._assert_tensor_metadata")
        fused[node] = (x, t)


def _ce_core(c: ImportContext, x: Any, target: Any, reduction: int, ignore_index: int, use_softmax: bool,
             classes_last: bool = False) -> Name:
    xs = c.shape(x)
    if len(xs) > 2 and not classes_last:  # class dim 1 -> last
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
    pair = c.imp.fused.get(c.node)
    if pair is not None:  # through the flattening views (fuse_ce_views): classes last, leading dims kept
        return _ce_core(c, c.imp.env[pair[0]], c.imp.env[pair[1]], red, ii, True, classes_last=True)
    return _ce_core(c, x, target, red, ii, True)


def cross_entropy_unflattened() -> Hook:
    """The ``cross_entropy_loss`` lowering with a ``prepare`` (run by the importer before the walk)
    that reads the loss through the views flattening its logits and labels (:func:`fuse_ce_views`):
    ``cross_entropy_with_softmax`` on ``[batch, seq, C]``, as the zoo's loss (context parallelism)."""

    def hook(c: ImportContext) -> Any:
        return _cross_entropy(c)

    hook.prepare = fuse_ce_views  # type: ignore[attr-defined]
    return hook


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
