"""torch kernels of the ``scan`` family (:mod:`spmdkit.ops.scan`): add_n, the ``*_like`` fills, cumsum
and topk, and their gradients."""

from __future__ import annotations

from typing import Any

import torch

from spmdkit.execute.kernels._common import Args, Kernel, axis_of, register, tensor
from spmdkit.execute.kernels.sorting import put_along
from spmdkit.sim.reference import Ctx


@register("add_n")
def _k_add_n(a: Args, c: Ctx) -> tuple[Any, ...]:
    xs = [tensor(t) for t in a["input"]]
    return (sum(xs[1:], xs[0].clone()),)


@register("full_like")
def _k_full_like(a: Args, c: Ctx) -> tuple[Any, ...]:
    x = tensor(a["x"])
    return (torch.full(x.shape, float(a.get("y", 0.0)), dtype=torch.float64, device=x.device),)


@register("add_n_grad")
def _k_add_n_grad(a: Args, c: Ctx) -> tuple[Any, ...]:
    g = tensor(a["out_grad"])
    return tuple(g.clone() for _ in a["inputs"])


def _like_kernel(value: float | None) -> Kernel:
    def fn(a: Args, c: Ctx) -> tuple[Any, ...]:
        x = tensor(a["x"])
        v = float(a.get("y", 0.0)) if value is None else value
        return (torch.full(x.shape, v, dtype=torch.float64, device=x.device),)

    return fn


register("empty_like", "zeros_like")(_like_kernel(0.0))
register("ones_like")(_like_kernel(1.0))


@register("cumsum_grad")
def _k_cumsum_grad(a: Args, c: Ctx) -> tuple[Any, ...]:
    x = tensor(a["x"])
    flatten = bool(a.get("flatten", False))
    args = {"x": tensor(a["out_grad"]), "axis": 0 if flatten else a.get("axis", -1), "flatten": False,
            "exclusive": bool(a.get("exclusive", False)), "reverse": not bool(a.get("reverse", False))}
    return (_k_cumsum(args, c)[0].reshape(x.shape),)


@register("topk")
def _k_topk(a: Args, c: Ctx) -> tuple[Any, ...]:
    x = tensor(a["x"])
    ax = axis_of(a.get("axis", -1), x.ndim)
    largest = bool(a.get("largest", True))
    order = torch.sort(x, dim=ax, descending=largest, stable=True).indices
    idx = order.narrow(ax, 0, int(a.get("k", 1)))
    return (torch.take_along_dim(x, idx, dim=ax), idx)


@register("cumsum")
def _k_cumsum(a: Args, c: Ctx) -> tuple[Any, ...]:
    x = tensor(a["x"])
    if a.get("flatten", False):
        x, ax = x.reshape(-1), 0
    elif x.ndim == 0:
        return (x.clone(),)
    else:
        ax = axis_of(a.get("axis", -1), x.ndim)
    rev = bool(a.get("reverse", False))
    if rev:
        x = torch.flip(x, (ax,))
    out = torch.cumsum(x, dim=ax)
    if a.get("exclusive", False):
        out = out - x
    if rev:
        out = torch.flip(out, (ax,))
    return (out,)


register("topk_grad")(put_along)
