"""torch kernels of the ``sorting`` family (:mod:`spmdkit.ops.sorting`): argsort, and the gradient of
the ops that pick by indices (topk, argsort)."""

from __future__ import annotations

from typing import Any

import torch

from spmdkit.execute.kernels._common import Args, axis_of, floating, register, tensor
from spmdkit.sim.reference import Ctx


def put_along(a: Args, c: Ctx) -> tuple[Any, ...]:
    """topk_grad / argsort_grad: out_grad put back where the indices took it from."""
    x, g = floating(a["x"]), tensor(a["out_grad"])
    if x.ndim == 0:
        return (g.clone(),)
    ax = axis_of(a.get("axis", -1), x.ndim)
    out = torch.zeros(x.shape, dtype=g.dtype, device=g.device)
    return (out.scatter(ax, tensor(a["indices"]).to(torch.int64), g),)


register("argsort_grad")(put_along)


@register("argsort")
def _k_argsort(a: Args, c: Ctx) -> tuple[Any, ...]:
    x = tensor(a["x"])
    if x.ndim == 0:
        return (x.clone(), torch.zeros((), dtype=torch.int64, device=x.device))
    ax = axis_of(a.get("axis", -1), x.ndim)
    s = torch.sort(x, dim=ax, descending=bool(a.get("descending", False)), stable=True)
    return (s.values, s.indices)
