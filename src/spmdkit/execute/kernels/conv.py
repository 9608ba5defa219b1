"""torch kernels of the ``conv`` family (:mod:`spmdkit.ops.conv`): convolutions (1-3 spatial dims) and
their gradients (autograd)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from spmdkit.execute.kernels._common import Args, register, tensor, vjp
from spmdkit.sim.reference import Ctx
from spmdkit.sim.refs.conv import channels_last, conv_geometry


def _conv_fn(a: Args) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    last = channels_last(a)
    groups = int(a.get("groups", 1))

    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xc = x.movedim(-1, 1) if last else x
        nsp = xc.ndim - 2
        st, pads, dil = conv_geometry(tuple(xc.shape[2:]), tuple(w.shape[2:]), a, nsp)
        flat: list[int] = []
        for lo, hi in reversed(pads):
            flat += [lo, hi]
        xp = F.pad(xc, flat) if any(flat) else xc
        conv = (F.conv1d, F.conv2d, F.conv3d)[nsp - 1]
        y = conv(xp, w.to(xc.dtype), None, st, 0, dil, groups)
        return y.movedim(1, -1) if last else y

    return fn


@register("conv1d", "conv2d", "conv3d")
def _k_conv(a: Args, c: Ctx) -> tuple[Any, ...]:
    return (_conv_fn(a)(tensor(a["input"]), tensor(a["filter"])),)


@register("conv1d_grad", "conv2d_grad", "conv3d_grad")
def _k_conv_grad(a: Args, c: Ctx) -> tuple[Any, ...]:
    gx, gw = vjp(_conv_fn(a), [tensor(a["input"]), tensor(a["filter"])], tensor(a["output_grad"]))
    return (gx, gw)
