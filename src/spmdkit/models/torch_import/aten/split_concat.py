"""Lowerings of ATen ops to the ``split_concat`` family's rules (:mod:`spmdkit.ops.split_concat`): cat
-> ``concat``; split / split_with_sizes / chunk -> ``split``; stack; unbind."""

from __future__ import annotations

from typing import Any

import torch

from spmdkit.models.torch_import.context import Hook, ImportContext, Name, dtype_name, norm_dim


def _cat(c: ImportContext) -> Any:
    xs = [t for t in c.args[0]]
    nd = len(c.out_shape())
    dim = norm_dim(int(c.arg(1, "dim", 0)), nd)
    xs = [t for t in xs if not (isinstance(t, torch.Tensor) and t.numel() == 0 and t.ndim == 1)]
    if len(xs) == 1:
        return c.tensor(xs[0])
    return c.emit1("concat", {"x": tuple(xs)}, axis=dim)


def _split(c: ImportContext) -> Any:
    """``split`` / ``split_with_sizes`` / ``chunk`` / ``tensor_split``: ``split`` with the sizes
    the node's outputs have; an empty piece (Mamba's chunked scan splits off an empty tail) is
    an empty constant, not an output of the op."""
    x = c.args[0]
    vals = c.val()
    xs = c.shape(x)
    dim = norm_dim(int(c.arg(2, "dim", 0)), len(xs))
    sizes = [int(v.shape[dim]) for v in vals]
    empty = {i: torch.zeros(tuple(int(s) for s in v.shape), dtype=v.dtype) for i, v in enumerate(vals) if not sizes[i]}
    full = [i for i in range(len(vals)) if sizes[i]]
    if len(full) <= 1:
        return tuple(empty[i] if i in empty else c.tensor(x) for i in range(len(vals)))
    outs = [[(c.fresh(str(i)), tuple(int(s) for s in vals[i].shape), dtype_name(vals[i].dtype)) for i in full]]
    (names,) = c.emit("split", {"x": x}, outs, sections=tuple(sizes[i] for i in full), axis=dim)
    got = iter(names)  # type: ignore[arg-type]
    return tuple(empty[i] if i in empty else Name(next(got)) for i in range(len(vals)))


def _stack(c: ImportContext) -> Any:
    xs = list(c.args[0])
    dim = norm_dim(int(c.arg(1, "dim", 0)), len(c.out_shape()))
    return c.emit1("stack", {"x": tuple(xs)}, axis=dim)


def _unbind(c: ImportContext) -> Any:
    x = c.args[0]
    xs = c.shape(x)
    dim = norm_dim(int(c.arg(1, "dim", 0)), len(xs))
    outs = [[(c.fresh(str(i)), tuple(int(s) for s in v.shape), dtype_name(v.dtype)) for i, v in enumerate(c.val())]]
    (names,) = c.emit("unbind", {"x": x}, outs, axis=dim)
    return tuple(Name(n) for n in names)  # type: ignore[union-attr]


def _table() -> dict[str, Hook]:
    t: dict[str, Hook] = {}
    t["aten.cat"] = t["aten.concat"] = _cat
    t["aten.split"] = t["aten.split_with_sizes"] = t["aten.chunk"] = t["aten.tensor_split"] = _split
    t["aten.stack"] = _stack
    t["aten.unbind"] = _unbind
    return t


#: ATen op (packet or overload) -> its lowering
ATEN = _table()
