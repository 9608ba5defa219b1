"""torch kernels of the ``slice`` family (:mod:`spmdkit.ops.slice`): slice, expand, expand_as, pad and
tile, and their gradients."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from spmdkit.execute.kernels._common import Args, register, tensor
from spmdkit.sim.reference import Ctx, sum_to_shape
from spmdkit.sim.refs.slice import expand_target
from spmdkit.sim.refs.slice import slice_index as ref_slice_index


def _slice_index(shape: Sequence[int], axes: Any, starts: Any, ends: Any, strides: Any = None) -> tuple[slice, ...]:
    return ref_slice_index(tuple(shape), axes, starts, ends, strides)


@register("slice")
def _k_slice(a: Args, c: Ctx) -> tuple[Any, ...]:
    x = tensor(a["input"])
    out = x[_slice_index(x.shape, a["axes"], a["starts"], a["ends"])]
    dec = [int(d) + x.ndim if int(d) < 0 else int(d) for d in (a.get("decrease_axis") or ())]
    if dec:
        out = out.reshape(tuple(s for i, s in enumerate(out.shape) if i not in dec))
    return (out.contiguous(),)


@register("strided_slice")
def _k_strided_slice(a: Args, c: Ctx) -> tuple[Any, ...]:
    x = tensor(a["input"])
    for ax, sl in enumerate(_slice_index(x.shape, a["axes"], a["starts"], a["ends"], a["strides"])):
        if sl != slice(None):  # a negative step too (torch's slicing takes positive steps only)
            idx = torch.tensor(list(range(*sl.indices(x.shape[ax]))), dtype=torch.int64, device=x.device)
            x = x.index_select(ax, idx)
    return (x.contiguous(),)


@register("slice_grad", "strided_slice_grad")
def _k_slice_grad(a: Args, c: Ctx) -> tuple[Any, ...]:
    x, g = tensor(a["input"]), tensor(a["out_grad"])
    idx = _slice_index(x.shape, a["axes"], a["starts"], a["ends"], a.get("strides"))
    out = torch.zeros(x.shape, dtype=g.dtype, device=g.device)
    if all(sl.step is None or sl.step > 0 for sl in idx):
        out[idx] = g.reshape(out[idx].shape)
        return (out,)
    ranges = [torch.tensor(list(range(*sl.indices(n))), dtype=torch.int64, device=g.device)  # a negative step
              for sl, n in zip(idx, x.shape)]
    grid = torch.meshgrid(*ranges, indexing="ij")
    out.index_put_(grid, g.reshape(grid[0].shape))
    return (out,)


@register("expand")
def _k_expand(a: Args, c: Ctx) -> tuple[Any, ...]:
    x = tensor(a["x"])
    return (torch.broadcast_to(x, expand_target(a["shape"], tuple(x.shape))).contiguous(),)


@register("expand_grad", "expand_as_grad", "expand_as_v2_grad")
def _k_expand_grad(a: Args, c: Ctx) -> tuple[Any, ...]:
    return (sum_to_shape(tensor(a["out_grad"]), tensor(a["x"]).shape),)


@register("pad")
def _k_pad(a: Args, c: Ctx) -> tuple[Any, ...]:
    x = tensor(a["x"])
    p = [int(v) for v in a["paddings"]]
    flat: list[int] = []
    for i in reversed(range(x.ndim)):  # F.pad: last dim first
        flat += [p[2 * i], p[2 * i + 1]]
    return (F.pad(x, flat, value=a.get("pad_value", 0)),)


@register("tile")
def _k_tile(a: Args, c: Ctx) -> tuple[Any, ...]:
    return (torch.tile(tensor(a["x"]), tuple(int(v) for v in a["repeat_times"])),)


@register("tile_grad")
def _k_tile_grad(a: Args, c: Ctx) -> tuple[Any, ...]:
    x, g = tensor(a["x"]), tensor(a["out_grad"])
    lead = g.ndim - x.ndim
    g = g.sum(dim=tuple(range(lead))) if lead else g
    if 0 in x.shape:
        return (torch.zeros(x.shape, dtype=g.dtype, device=g.device),)
    shp: list[int] = []
    for sx, sg in zip(x.shape, g.shape):  # the repeats this rank sees: local out_grad / local x
        shp += [sg // sx, sx]
    return (g.reshape(shp).sum(dim=tuple(range(0, 2 * x.ndim, 2))),)


@register("expand_as", "expand_as_v2")
def _k_expand_as(a: Args, c: Ctx) -> tuple[Any, ...]:
    x = tensor(a["x"])
    tgt = tuple(tensor(a["y"]).shape) if a.get("y") is not None else expand_target(a["target_shape"], tuple(x.shape))
    return (torch.broadcast_to(x, tgt).contiguous(),)
