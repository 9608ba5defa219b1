"""torch kernels of the ``fused`` family (:mod:`spmdkit.ops.fused`): swiglu and its gradient
(autograd)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from spmdkit.execute.kernels._common import Args, register, tensor, vjp
from spmdkit.sim.reference import Ctx


def _halves(a: Args) -> tuple[torch.Tensor, torch.Tensor | None]:
    x = tensor(a["x"])
    y = a.get("y")
    if y is not None and tensor(y).ndim == 0 and x.ndim > 0:
        y = None
    return x, None if y is None else tensor(y)


def _swiglu_fn(x: torch.Tensor, y: torch.Tensor | None) -> torch.Tensor:
    if y is None:
        u, w = x.chunk(2, dim=-1)
        return F.silu(u) * w
    return F.silu(x) * y


@register("swiglu")
def _k_swiglu(a: Args, c: Ctx) -> tuple[Any, ...]:
    x, y = _halves(a)
    return (_swiglu_fn(x, y),)


@register("swiglu_grad")
def _k_swiglu_grad(a: Args, c: Ctx) -> tuple[Any, ...]:
    x, y = _halves(a)
    dx, dy = vjp(_swiglu_fn, [x, y], tensor(a["out_grad"]))
    return (dx, dy)
