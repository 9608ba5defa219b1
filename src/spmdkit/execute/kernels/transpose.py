"""torch kernels of the ``transpose`` family (:mod:`spmdkit.ops.transpose`): transpose and its
gradient."""

from __future__ import annotations

from typing import Any

from spmdkit.execute.kernels._common import Args, register, tensor
from spmdkit.sim.reference import Ctx


def _perm(perm: Any, ndim: int) -> list[int]:
    return [int(p) + ndim if int(p) < 0 else int(p) for p in perm]


@register("transpose", "transpose2")
def _k_transpose(a: Args, c: Ctx) -> tuple[Any, ...]:
    x = tensor(a["x"])
    return (x.permute(_perm(a["perm"], x.ndim)).contiguous(),)


@register("transpose_grad")
def _k_transpose_grad(a: Args, c: Ctx) -> tuple[Any, ...]:
    g = tensor(a["out_grad"])
    p = _perm(a["perm"], g.ndim)
    inv = [0] * len(p)
    for i, v in enumerate(p):
        inv[v] = i
    return (g.permute(inv).contiguous(),)
