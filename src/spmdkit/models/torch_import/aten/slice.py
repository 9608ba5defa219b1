"""Lowerings of ATen ops to the ``slice`` family's rules (:mod:`spmdkit.ops.slice`): expand, select /
slice -> ``slice`` (``strided_slice`` with a step), pad, copy and fill (a broadcast),
repeat_interleave (an expand between two reshapes), slice_scatter / select_scatter (a concat of
the kept pieces)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from spmdkit.models.torch_import import context
from spmdkit.models.torch_import.aten.view import to_out_shape
from spmdkit.models.torch_import.context import TORCH_DTYPES, Hook, ImportContext, Name, norm_dim

_expand = to_out_shape("expand")


def _select(c: ImportContext) -> Any:
    x, dim, i = c.args[0], int(c.args[1]), int(c.args[2])
    xs = c.shape(x)
    dim = norm_dim(dim, len(xs))
    i = i + xs[dim] if i < 0 else i
    return c.emit1("slice", {"input": x}, axes=(dim,), starts=(i,), ends=(i + 1,), decrease_axis=(dim,))


def _slice(c: ImportContext) -> Any:
    x = c.args[0]
    xs = c.shape(x)
    dim = norm_dim(int(c.arg(1, "dim", 0)), len(xs))
    start, end, step = c.arg(2, "start"), c.arg(3, "end"), c.arg(4, "step", 1)
    n = xs[dim]
    start = 0 if start is None else int(start)
    end = n if end is None else int(end)
    start = max(0, min(n, start + n if start < 0 else start))
    end = max(0, min(n, end + n if end < 0 else end))
    if int(step) != 1:
        return c.emit1("strided_slice", {"input": x}, axes=(dim,), starts=(start,), ends=(end,), strides=(int(step),))
    if start == 0 and end == n:
        return c.tensor(x)
    return c.emit1("slice", {"input": x}, axes=(dim,), starts=(start,), ends=(end,))


def _pad(c: ImportContext) -> Any:
    """``pad`` / ``constant_pad_nd`` (constant mode): torch's pairs run from the last dim back;
    Paddle's ``paddings`` are (before, after) per dim in order. Negative pads crop (a slice
    first); a fill that is not an integer (-inf, 0.5) pads zeros and adds a constant that holds
    the fill where the padding is."""
    x, pads = c.args[0], [int(p) for p in c.arg(1, "pad")]
    mode = c.arg(2, "mode", "constant") if c.target.startswith("aten.pad") else "constant"
    value = c.arg(3, "value") if c.target.startswith("aten.pad") else c.arg(2, "value", 0)
    if mode != "constant":
        raise c.unsupported(f"pad mode {mode!r} (constant only)")
    value = 0.0 if value is None else float(value)
    xs = c.shape(x)
    nd = len(xs)
    per = [(0, 0)] * nd
    for i in range(len(pads) // 2):
        per[nd - 1 - i] = (pads[2 * i], pads[2 * i + 1])
    if any(lo < 0 or hi < 0 for lo, hi in per):  # crop first
        for d, (lo, hi) in enumerate(per):
            if lo < 0 or hi < 0:
                cur = c.shape(x)
                start, end = max(0, -lo), cur[d] - max(0, -hi)
                shp = (*cur[:d], end - start, *cur[d + 1:])
                x = c.emit1("slice", {"input": x}, (c.fresh("crop"), shp, c.dtype(x)), axes=(d,), starts=(start,),
                            ends=(end,))
        per = [(max(lo, 0), max(hi, 0)) for lo, hi in per]
    if all(lo == 0 and hi == 0 for lo, hi in per):
        return c.tensor(x)
    flat = tuple(v for lohi in per for v in lohi)
    if value.is_integer():
        return c.emit1("pad", {"x": x}, paddings=flat, pad_value=int(value))
    padded = c.emit1("pad", {"x": x}, c.fresh("zero_padded"), paddings=flat, pad_value=0)
    fill = torch.full(c.out_shape(), value, dtype=TORCH_DTYPES[c.out_dtype()])
    fill[tuple(slice(lo, lo + s) for (lo, _), s in zip(per, c.shape(x)))] = 0
    return c.emit1("add", {"x": padded, "y": fill})


def broadcast_to(c: ImportContext, v: Any, shape: Sequence[int], dtype: str, name: str | None = None) -> Any:
    """``v`` (a tensor name, a torch constant or a Python scalar) as ``shape`` and ``dtype``:
    constants are made at import time; a program tensor is cast, reshaped and expanded."""
    if not isinstance(v, Name):
        t = v.to(TORCH_DTYPES[dtype]) if isinstance(v, torch.Tensor) else torch.tensor(v, dtype=TORCH_DTYPES[dtype])
        if math.prod(shape) <= context.FOLD_FILL_UP_TO or t.numel() == math.prod(shape):
            return c.tensor(t.expand(*shape).clone())
        v = c.tensor(t, dtype)  # a large fill: the small constant expanded by an op, nothing of its size recorded
    if c.dtype(v) != dtype:
        v = c.emit1("cast", {"x": v}, (c.fresh("cast"), c.shape(v), dtype), dtype=dtype)
    vs = c.shape(v)
    if tuple(vs) == tuple(shape):
        return c.tensor(v) if name is None else c.reshape(v, shape, name)
    if len(vs) < len(shape):
        v = c.reshape(v, [1] * (len(shape) - len(vs)) + list(vs), c.fresh("r"))
    return c.emit1("expand", {"x": v}, (name or c.fresh("bcast"), tuple(shape), dtype), shape=tuple(shape))


def _copy(c: ImportContext) -> Any:
    """Functional ``copy(self, src)``: src broadcast to self's shape in self's dtype."""
    return broadcast_to(c, c.args[1], c.out_shape(), c.out_dtype(), c.name)


def _fill(c: ImportContext) -> Any:
    """``fill(self, value)``: self's shape and dtype, every element value."""
    return broadcast_to(c, c.args[1], c.out_shape(), c.out_dtype(), c.name)


def _piece(c: ImportContext, x: Any, d: int, start: int, end: int) -> Any:
    xs = c.shape(x)
    if isinstance(x, torch.Tensor):
        return c.tensor(x.narrow(d, start, end - start).clone())
    shp = (*xs[:d], end - start, *xs[d + 1:])
    return c.emit1("slice", {"input": x}, (c.fresh("keep"), shp, c.dtype(x)), axes=(d,), starts=(start,),
                   ends=(end,))


def _scatter_into(c: ImportContext, x: Any, src: Any, d: int, start: int, end: int) -> Any:
    """x with ``x[..., start:end, ...]`` (along d) replaced by src: a concat of the kept pieces."""
    xs = c.shape(x)
    dt = c.out_dtype()
    src = broadcast_to(c, src, (*xs[:d], end - start, *xs[d + 1:]), dt)
    if not isinstance(x, Name) and c.dtype(x) != dt:
        x = x.to(TORCH_DTYPES[dt])
    parts = []
    if start > 0:
        parts.append(_piece(c, x, d, 0, start))
    parts.append(src)
    if end < xs[d]:
        parts.append(_piece(c, x, d, end, xs[d]))
    if len(parts) == 1:
        return c.tensor(parts[0])
    return c.emit1("concat", {"x": tuple(parts)}, axis=d)


def _slice_scatter(c: ImportContext) -> Any:
    x, src = c.args[0], c.args[1]
    xs = c.shape(x)
    d = norm_dim(int(c.arg(2, "dim", 0)), len(xs))
    start, end, step = c.arg(3, "start"), c.arg(4, "end"), int(c.arg(5, "step", 1))
    n = xs[d]
    start = 0 if start is None else int(start)
    end = n if end is None else int(end)
    start = max(0, min(n, start + n if start < 0 else start))
    end = max(0, min(n, end + n if end < 0 else end))
    if step != 1:
        raise c.unsupported(f"slice_scatter with step {step} (step 1 only)")
    return _scatter_into(c, x, src, d, start, end)


def _select_scatter(c: ImportContext) -> Any:
    x, src = c.args[0], c.args[1]
    xs = c.shape(x)
    d = norm_dim(int(c.args[2]), len(xs))
    i = int(c.args[3])
    i = i + xs[d] if i < 0 else i
    if isinstance(src, Name):
        ss = c.shape(src)
        src = c.emit1("unsqueeze", {"x": src}, (c.fresh("u"), (*ss[:d], 1, *ss[d:]), c.dtype(src)), axis=(d,))
    elif isinstance(src, torch.Tensor):
        src = src.unsqueeze(d)
    return _scatter_into(c, x, src, d, i, i + 1)


def _repeat_interleave(c: ImportContext) -> Any:
    """``repeat_interleave(x, r, dim)`` (GPT-J's and Cohere's rotary tables): each element ``r``
    times in a row along ``dim`` (the flattened x where dim is None): x reshaped with a unit axis
    after ``dim``, expanded to ``r`` there, reshaped back. ``r`` an int, or a constant tensor of
    one repeat for all (a repeat per element is a data-dependent layout: unsupported)."""
    x, reps = c.args[0], c.arg(1, "repeats")
    if not c.is_tensor(x):  # repeat_interleave(repeats): the index form, folded where constant
        raise c.unsupported("repeat_interleave of a repeats tensor that depends on the program's inputs")
    if isinstance(reps, torch.Tensor):
        flat = reps.reshape(-1)
        if flat.numel() == 0 or not bool((flat == flat[0]).all()):
            raise c.unsupported("repeat_interleave with a different repeat per element")
        reps = int(flat[0])
    elif c.is_tensor(reps):
        raise c.unsupported("repeat_interleave with repeats computed by the program")
    r = int(reps)
    dim = c.arg(2, "dim")
    xs = c.shape(x)
    if dim is None:
        x, xs, d = c.reshape(x, (math.prod(xs),), c.fresh("flat")), (math.prod(xs),), 0
    else:
        d = norm_dim(int(dim), len(xs))
    dt = c.dtype(x)
    grown = (*xs[:d + 1], r, *xs[d + 1:])
    col = c.reshape(x, (*xs[:d + 1], 1, *xs[d + 1:]), c.fresh("col"))
    rep = c.emit1("expand", {"x": col}, (c.fresh("rep"), grown, dt), shape=grown)
    return c.reshape(rep, c.out_shape(), c.name)


def _repeat(c: ImportContext) -> Any:
    """``x.repeat(*sizes)`` (Llama 4's routed input): ``tile`` (new leading axes where ``sizes``
    is longer than x's shape)."""
    x, reps = c.args[0], [int(r) for r in c.args[1]]
    if all(r == 1 for r in reps) and len(reps) == len(c.shape(x)):
        return c.tensor(x)
    return c.emit1("tile", {"x": x}, repeat_times=tuple(reps))


def _table() -> dict[str, Hook]:
    t: dict[str, Hook] = {}
    t["aten.expand"] = t["aten.expand_as"] = _expand
    t["aten.select"] = _select
    t["aten.slice"] = _slice
    t["aten.pad"] = t["aten.constant_pad_nd"] = _pad
    t["aten.copy"] = _copy
    t["aten.fill"] = _fill
    t["aten.slice_scatter"] = _slice_scatter
    t["aten.select_scatter"] = _select_scatter
    t["aten.repeat_interleave"] = _repeat_interleave
    t["aten.repeat"] = _repeat
    return t


#: ATen op (packet or overload) -> its lowering
ATEN = _table()
