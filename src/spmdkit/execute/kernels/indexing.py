"""torch kernels of the ``indexing`` family (:mod:`spmdkit.ops.indexing`): where, index_select / gather
and their gradients."""

from __future__ import annotations

from typing import Any

import torch

from spmdkit.execute.kernels._common import Args, axis_of, register, tensor
from spmdkit.sim.reference import Ctx, sum_to_shape


@register("where")
def _k_where(a: Args, c: Ctx) -> tuple[Any, ...]:
    return (torch.where(tensor(a["condition"]).to(torch.bool), tensor(a["x"]), tensor(a["y"])),)


@register("where_grad")
def _k_where_grad(a: Args, c: Ctx) -> tuple[Any, ...]:
    cond = tensor(a["condition"]).to(torch.bool)
    g = tensor(a["out_grad"])
    cb = torch.broadcast_to(cond, g.shape)
    z = torch.zeros((), dtype=g.dtype, device=g.device)
    return (sum_to_shape(torch.where(cb, g, z), tensor(a["x"]).shape), sum_to_shape(torch.where(cb, z, g), tensor(a["y"]).shape))


def _fold(idx: torch.Tensor, size: int) -> torch.Tensor:
    if size <= 0:
        return torch.zeros_like(idx)
    return torch.remainder(idx, size)


def _flat_index(index: Any) -> torch.Tensor:
    i = tensor(index).to(torch.int64)
    return i.reshape(-1) if i.ndim == 2 else i


@register("index_select", "gather")
def _k_index_select(a: Args, c: Ctx) -> tuple[Any, ...]:
    x = tensor(a["x"])
    ax = axis_of(a.get("axis", 0), x.ndim)
    idx = _fold(_flat_index(a["index"]), x.shape[ax])
    if idx.ndim == 0:
        return (torch.select(x, ax, int(idx)).clone(),)
    return (torch.index_select(x, ax, idx),)


@register("index_select_grad", "gather_grad")
def _k_index_select_grad(a: Args, c: Ctx) -> tuple[Any, ...]:
    x, g = tensor(a["x"]), tensor(a["out_grad"])
    ax = axis_of(a.get("axis", 0), x.ndim)
    idx = _fold(_flat_index(a["index"]), x.shape[ax])
    out = torch.zeros(x.shape, dtype=g.dtype, device=g.device)
    if idx.ndim == 0:
        out.select(ax, int(idx)).add_(g)
    else:
        out.index_add_(ax, idx, g)
    return (out,)
