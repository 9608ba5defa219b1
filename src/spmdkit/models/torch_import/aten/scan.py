"""Lowerings of ATen ops to the ``scan`` family's rules (:mod:`spmdkit.ops.scan`): tril / triu, argmax,
cumsum, topk."""

from __future__ import annotations

from typing import Any

from spmdkit.models.torch_import.context import Hook, ImportContext, Name, norm_dim


def _tril_triu(c: ImportContext) -> Any:
    x = c.args[0]
    diag = int(c.arg(1, "diagonal", 0))
    return c.emit1("tril_triu", {"x": x}, diagonal=diag, lower=c.target.startswith("aten.tril"))


def _argmax(c: ImportContext) -> Any:
    x = c.args[0]
    dim = c.arg(1, "dim")
    keep = bool(c.arg(2, "keepdim", False))
    if dim is None:
        return c.emit1("argmax", {"x": x}, axis=-1, keepdims=keep, flatten=True)
    return c.emit1("argmax", {"x": x}, axis=norm_dim(int(dim), len(c.shape(x))), keepdims=keep)


def _cumsum(c: ImportContext) -> Any:
    x = c.args[0]
    return c.emit1("cumsum", {"x": x}, axis=norm_dim(int(c.arg(1, "dim", -1)), len(c.shape(x))))


def _topk(c: ImportContext) -> Any:
    x = c.args[0]
    k = int(c.args[1])
    xs = c.shape(x)
    dim = norm_dim(int(c.arg(2, "dim", -1)), len(xs))
    largest, srt = bool(c.arg(3, "largest", True)), bool(c.arg(4, "sorted", True))
    vals, idx = c.val()
    outs = [(c.fresh("values"), tuple(vals.shape), c.dtype(x)), (c.fresh("indices"), tuple(idx.shape), "int64")]
    if c.imp.tape is None or x not in c.imp.tape.needs_grad:
        v, i = c.emit("topk", {"x": x}, outs, k=k, axis=dim, largest=largest, sorted=srt)
        return (Name(str(v)), Name(str(i)))
    # training: the indices from topk, the values gathered at them (the gradient flows to the
    # chosen entries, as torch's topk backward scatters it)
    _, i = c.emit_nograd("topk", {"x": x}, outs, k=k, axis=dim, largest=largest, sorted=srt)
    v = c.emit1("take_along_axis", {"x": x, "index": i}, (c.fresh("chosen"), tuple(vals.shape), c.dtype(x)), axis=dim)
    return (v, Name(str(i)))


def _table() -> dict[str, Hook]:
    t: dict[str, Hook] = {}
    t["aten.triu"] = t["aten.tril"] = _tril_triu
    t["aten.argmax"] = _argmax
    t["aten.cumsum"] = _cumsum
    t["aten.topk"] = _topk
    return t


#: ATen op (packet or overload) -> its lowering
ATEN = _table()
