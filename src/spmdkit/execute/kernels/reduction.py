"""torch kernels of the ``reduction`` family (:mod:`spmdkit.ops.reduction`): reductions (one table,
``REDUCTIONS``), reduce_base, numel, and their gradients (autograd of the reduction; every tied
extreme of max / min gets the whole gradient, as the reference)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from spmdkit.execute.kernels._common import Args, Kernel, floating, register, tensor, vjp
from spmdkit.sim.reference import Ctx, paddle_axes, reduce_axes

ReduceT = Callable[[torch.Tensor, tuple[int, ...], bool], torch.Tensor]


def _extreme(is_max: bool) -> ReduceT:
    def r(x: torch.Tensor, ax: tuple[int, ...], keep: bool) -> torch.Tensor:
        if x.numel() == 0:  # the identity of MAX / MIN over an empty local slice
            shape = [1 if i in ax else s for i, s in enumerate(x.shape)] if keep else \
                [s for i, s in enumerate(x.shape) if i not in ax]
            if x.dtype == torch.bool:
                return torch.full(shape, not is_max, dtype=x.dtype, device=x.device)
            info = torch.finfo(x.dtype) if x.is_floating_point() else torch.iinfo(x.dtype)
            fill = (-math.inf if is_max else math.inf) if x.is_floating_point() else (info.min if is_max else info.max)
            return torch.full(shape, fill, dtype=x.dtype, device=x.device)
        return torch.amax(x, dim=ax, keepdim=keep) if is_max else torch.amin(x, dim=ax, keepdim=keep)

    return r


def _prod(x: torch.Tensor, ax: tuple[int, ...], keep: bool) -> torch.Tensor:
    for d in sorted(ax, reverse=True):
        x = torch.prod(x, dim=d, keepdim=True)
    return x if keep else x.reshape([s for i, s in enumerate(x.shape) if i not in ax])


REDUCTIONS: dict[str, ReduceT] = {
    "sum": lambda x, ax, k: torch.sum(x, dim=ax, keepdim=k),
    "mean": lambda x, ax, k: torch.mean(floating(x), dim=ax, keepdim=k),
    "max": _extreme(True), "min": _extreme(False), "prod": _prod,
    "any": lambda x, ax, k: torch.any(x.to(torch.bool), dim=ax, keepdim=k) if ax else x.to(torch.bool),
    "all": lambda x, ax, k: torch.all(x.to(torch.bool), dim=ax, keepdim=k) if ax else x.to(torch.bool),
    "squared_l2_norm": lambda x, ax, k: torch.sum(x * x, dim=ax, keepdim=k),
    "frobenius_norm": lambda x, ax, k: torch.sqrt(torch.sum(x * x, dim=ax, keepdim=k)),
}
_REDUCTION_ALIASES = {"reduce_sum": "sum", "reduce_max": "max", "amax": "max", "amin": "min",
                      "reduce_mean": "mean", "reduce_min": "min", "reduce_prod": "prod", "reduce_any": "any",
                      "reduce_all": "all"}
_REDUCE_BASE_TYPES = {0: "sum", 1: "max", 2: "min", 3: "prod", 4: "mean", 5: "any", 6: "all"}


def _reduce(name: str, a: Args, c: Ctx) -> torch.Tensor:
    fn = REDUCTIONS[name]
    x = tensor(a["x"])
    keep = bool(a.get("keep_dim", False))
    if x.ndim == 0:
        out = x.clone() if name not in ("squared_l2_norm", "frobenius_norm") else fn(x.reshape(1), (0,), False)
    else:
        out = fn(x, paddle_axes(a.get("axis", ()), x.ndim), keep)
    if c.out_ndim(0) == 1 and out.ndim == 0:  # squared_l2_norm: Paddle's output is [1]
        out = out.reshape(1)
    return out


def _reduction_kernel(name: str) -> Kernel:
    return lambda a, c: (_reduce(name, a, c),)


for _n in REDUCTIONS:
    register(_n, *[k for k, v in _REDUCTION_ALIASES.items() if v == _n])(_reduction_kernel(_n))


@register("reduce_base")
def _k_reduce_base(a: Args, c: Ctx) -> tuple[Any, ...]:
    return (_reduce(_REDUCE_BASE_TYPES.get(int(a.get("reduce_type", 0)), "sum"), a, c),)


def _reduction_grad_kernel(name: str) -> Kernel:
    def grad(a: Args, c: Ctx) -> tuple[Any, ...]:
        x, g = floating(a["x"]), tensor(a["out_grad"])
        ax = reduce_axes(a, x.ndim)
        keep = bool(a.get("keep_dim", False))
        if name in ("max", "min"):  # every tied extreme gets the whole gradient, as the reference
            out = a.get("out")
            o = tensor(out) if out is not None else REDUCTIONS[name](x, ax, True)
            shp = [1 if i in ax else s for i, s in enumerate(x.shape)]
            gb = g.reshape(shp) if not keep else g
            return ((x == o.reshape(shp)).to(g.dtype) * gb,)
        if x.ndim == 0:
            gx = vjp(lambda v: REDUCTIONS[name](v.reshape(1), (0,), False).reshape(()), [x], g.reshape(()))[0]
            return (gx,)
        want = REDUCTIONS[name](x, ax, keep).shape
        return (vjp(lambda v: REDUCTIONS[name](v, ax, keep), [x], g.reshape(want))[0],)

    return grad


for _n in ("sum", "mean", "max", "min", "prod", "squared_l2_norm", "frobenius_norm"):
    register(f"{_n}_grad", *[f"{k}_grad" for k, v in _REDUCTION_ALIASES.items() if v == _n])(
        _reduction_grad_kernel(_n))


@register("numel")
def _k_numel(a: Args, c: Ctx) -> tuple[Any, ...]:
    x = tensor(a["x"])
    return (torch.tensor(x.numel(), dtype=torch.int64, device=x.device),)
