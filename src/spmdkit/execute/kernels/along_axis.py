"""torch kernels of the ``along_axis`` family (:mod:`spmdkit.ops.along_axis`): take_along_axis and
index_put, and their gradients."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from spmdkit.execute.kernels._common import Args, axis_of, register, tensor
from spmdkit.sim.reference import Ctx, sum_to_shape


@register("index_put_grad")
def _k_index_put_grad(a: Args, c: Ctx) -> tuple[Any, ...]:
    g = tensor(a["out_grad"])
    idx = tuple(tensor(t).to(torch.int64) for t in a["indices"])
    gx = g.clone()
    if not bool(a.get("accumulate", False)):
        gx[idx] = 0.0
    return gx, sum_to_shape(g[idx], tensor(a["value"]).shape)


def _crop(x: torch.Tensor, shape: Sequence[int], ax: int) -> tuple[slice, ...]:
    if len(shape) != x.ndim:
        raise ValueError("index must have x's number of dims")
    return tuple(slice(None) if i == ax else slice(0, shape[i]) for i in range(x.ndim))


@register("take_along_axis")
def _k_take_along_axis(a: Args, c: Ctx) -> tuple[Any, ...]:
    x, idx = tensor(a["x"]), tensor(a["index"]).to(torch.int64)
    ax = axis_of(a.get("axis", 0), x.ndim)
    return (torch.take_along_dim(x[_crop(x, idx.shape, ax)], idx, dim=ax),)


@register("take_along_axis_grad")
def _k_take_along_axis_grad(a: Args, c: Ctx) -> tuple[Any, ...]:
    x, idx, g = tensor(a["x"]), tensor(a["index"]).to(torch.int64), tensor(a["out_grad"])
    ax = axis_of(a.get("axis", 0), x.ndim)
    out = torch.zeros(x.shape, dtype=g.dtype, device=g.device)
    out[_crop(x, idx.shape, ax)].scatter_add_(ax, idx, g)
    return (out,)


@register("put_along_axis")
def _k_put_along_axis(a: Args, c: Ctx) -> tuple[Any, ...]:
    x, idx = tensor(a["x"]), tensor(a["index"]).to(torch.int64)
    ax = axis_of(a.get("axis", 0), x.ndim)
    v = torch.broadcast_to(tensor(a["value"]).to(x.dtype), idx.shape).contiguous()
    reduce = a.get("reduce", "assign")
    out = x.clone()
    if reduce == "assign":
        return (out.scatter_(ax, idx, v),)
    how = {"add": "sum", "mul": "prod", "multiply": "prod", "amax": "amax", "amin": "amin", "mean": "mean"}[reduce]
    return (out.scatter_reduce_(ax, idx, v, how, include_self=bool(a.get("include_self", True))),)


@register("put_along_axis_grad")
def _k_put_along_axis_grad(a: Args, c: Ctx) -> tuple[Any, ...]:
    x, idx, g = tensor(a["x"]), tensor(a["index"]).to(torch.int64), tensor(a["out_grad"])
    ax = axis_of(a.get("axis", 0), x.ndim)
    reduce = a.get("reduce", "assign")
    if reduce not in ("assign", "add"):
        raise ValueError(f"the put_along_axis_grad kernel covers assign and add, not {reduce!r}")
    gx = g.clone()
    if reduce == "assign" or not bool(a.get("include_self", True)):
        hit = torch.zeros(x.shape, dtype=g.dtype, device=g.device)
        hit[_crop(x, idx.shape, ax)].scatter_add_(ax, idx, torch.ones(idx.shape, dtype=g.dtype, device=g.device))
        gx = torch.where(hit > 0, torch.zeros_like(gx), gx)
    gv = torch.take_along_dim(g[_crop(x, idx.shape, ax)], idx, dim=ax)
    return gx, sum_to_shape(gv, tensor(a["value"]).shape)


@register("index_put")
def _k_index_put(a: Args, c: Ctx) -> tuple[Any, ...]:
    x = tensor(a["x"])
    idx = tuple(tensor(t).to(torch.int64) for t in a["indices"])
    v = tensor(a["value"]).to(x.dtype)
    return (torch.index_put(x, idx, torch.broadcast_to(v, x[idx].shape), accumulate=bool(a.get("accumulate", False))),)
