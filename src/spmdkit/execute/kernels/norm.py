"""torch kernels of the ``norm`` family (:mod:`spmdkit.ops.norm`): layer_norm and rms_norm (statistics
in float32 for half inputs, as torch's kernels keep them), and their gradients."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from spmdkit.execute.kernels._common import Args, acc, register, tensor
from spmdkit.sim.reference import Ctx


def _stat_shape(stat: torch.Tensor, c: Ctx, i: int) -> torch.Tensor:
    nd = c.out_ndim(i)
    if nd is not None and nd != stat.ndim:
        if nd == 1:
            return stat.reshape(-1)
        if nd == 0 and stat.numel() == 1:
            return stat.reshape(())
    return stat


def _bna(a: Args, ndim: int) -> int:
    b = int(a.get("begin_norm_axis", 1))
    return b + ndim if b < 0 else b


@register("layer_norm")
def _k_layer_norm(a: Args, c: Ctx) -> tuple[Any, ...]:
    x = tensor(a["x"])
    b = _bna(a, x.ndim)
    eps = float(a.get("epsilon", 1e-5))
    tail = tuple(x.shape[b:])
    w = None if a.get("scale") is None else tensor(a["scale"]).reshape(tail).to(x.dtype)
    bias = None if a.get("bias") is None else tensor(a["bias"]).reshape(tail).to(x.dtype)
    ax = tuple(range(b, x.ndim))
    if not tail:  # nothing to normalise over: (x - x) / sqrt(eps), then the affine part
        out = torch.zeros_like(x)
        out = out if w is None else out * w
        out = out if bias is None else out + bias
        return (out, _stat_shape(acc(x).clone(), c, 1), _stat_shape(torch.zeros(x.shape, device=x.device), c, 2))
    out = F.layer_norm(x, tail, w, bias, eps)
    var, mean = torch.var_mean(acc(x), dim=ax, unbiased=False) if ax else (torch.zeros(x.shape, device=x.device),
                                                                             acc(x).clone())
    return (out, _stat_shape(mean, c, 1), _stat_shape(var, c, 2))


_LN_STAT: dict[tuple[str, torch.dtype], torch.dtype] = {}


def _ln_stat_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype of the statistics torch's layer norm keeps for ``x`` on its device (a half
    input's are float32 on CUDA, its own dtype on the CPU): what its backward expects."""
    key = (x.device.type, x.dtype)
    if key not in _LN_STAT:
        probe = torch.zeros((1, 2), dtype=x.dtype, device=x.device)
        _LN_STAT[key] = torch.native_layer_norm(probe, [2], None, None, 1e-5)[1].dtype
    return _LN_STAT[key]


@register("layer_norm_grad")
def _k_layer_norm_grad(a: Args, c: Ctx) -> tuple[Any, ...]:
    x, g = tensor(a["x"]), tensor(a["out_grad"])
    b = _bna(a, x.ndim)
    eps = float(a.get("epsilon", 1e-5))
    bs, tail = tuple(x.shape[:b]), tuple(x.shape[b:])
    kshape = bs + (1,) * len(tail)
    mean = acc(tensor(a["mean"])).reshape(kshape)
    rstd = torch.rsqrt(acc(tensor(a["variance"])).reshape(kshape) + eps)
    w = None if a.get("scale") is None else tensor(a["scale"]).reshape(tail).to(x.dtype)
    bias = None if a.get("bias") is None else tensor(a["bias"]).reshape(tail).to(x.dtype)
    if not tail:  # x_hat is 0: no gradient to x or the scale, the bias gets the sum of out_grad
        return (torch.zeros_like(x), None if w is None else torch.zeros(1, dtype=g.dtype, device=g.device),
                None if bias is None else g.sum().reshape(1))
    mask = [True, w is not None, bias is not None]
    sd = _ln_stat_dtype(x)
    dx, dw, db = torch.ops.aten.native_layer_norm_backward(g.to(x.dtype), x, list(tail), mean.to(sd), rstd.to(sd), w,
                                                           bias, mask)
    n_tail = int(math.prod(tail)) if tail else 1
    return (dx, None if dw is None else dw.reshape(n_tail), None if db is None else db.reshape(n_tail))


@register("fused_rms_norm", "rms_norm")
def _k_rms_norm(a: Args, c: Ctx) -> tuple[Any, ...]:
    x = tensor(a["x"])
    eps = float(a.get("epsilon", 1e-5))
    if x.ndim == 0:
        raise ValueError("rms_norm needs at least 1-D x")
    xf = acc(x)
    inv = torch.rsqrt((xf * xf).mean(dim=-1, keepdim=True) + eps)
    out = (xf * inv).to(x.dtype)
    if a.get("scale") is not None:
        out = out * tensor(a["scale"]).reshape(x.shape[-1:])
    return (out, _stat_shape(inv.reshape(x.shape[:-1]), c, 1))


@register("rms_norm_grad", "fused_rms_norm_grad")
def _k_rms_norm_grad(a: Args, c: Ctx) -> tuple[Any, ...]:
    x, g = tensor(a["x"]), tensor(a["out_grad"])
    xf, gf = acc(x), acc(g)
    inv = acc(tensor(a["invvar"])).reshape((*x.shape[:-1], 1))
    has_scale = a.get("scale") is not None
    scale = acc(tensor(a["scale"])).reshape(x.shape[-1:]) if has_scale else torch.ones(x.shape[-1:], device=x.device)
    gs = gf * scale
    m = (gs * xf).mean(dim=-1, keepdim=True)
    dx = inv * gs - xf * inv ** 3 * m
    dscale = (gf * xf * inv).reshape(-1, x.shape[-1]).sum(dim=0) if has_scale else None
    return (dx.to(x.dtype), None if dscale is None else dscale.to(g.dtype))
