"""torch kernels of the ``loss`` family (:mod:`spmdkit.ops.loss`): mean_all, cross entropy with
softmax, and the class-sharded ``c_softmax_with_cross_entropy`` (which all-reduces through
``Ctx.comm`` on torch tensors), and their gradients."""

from __future__ import annotations

from typing import Any

import torch

from spmdkit.core.dist_attr import entry_dims
from spmdkit.execute.kernels._common import Args, axis_of, floating, register, tensor
from spmdkit.sim.reference import Ctx
from spmdkit.sim.refs.loss import class_start


@register("mean_all")
def _k_mean_all(a: Args, c: Ctx) -> tuple[Any, ...]:
    return (torch.mean(floating(a["x"])),)


@register("mean_all_grad")
def _k_mean_all_grad(a: Args, c: Ctx) -> tuple[Any, ...]:
    x, g = tensor(a["x"]), tensor(a["out_grad"])
    return (torch.full_like(floating(x), 0.0) + g.reshape(-1)[0] / max(x.numel(), 1),)


def _ce(x: torch.Tensor, label: torch.Tensor, ignore_index: int, ax: int, soft: bool, use_softmax: bool
        ) -> tuple[torch.Tensor, torch.Tensor]:
    if use_softmax:
        logsm = torch.log_softmax(x, dim=ax)
        sm = torch.exp(logsm)
    else:
        sm, logsm = x.clone(), torch.log(x)
    if soft:
        return sm, -(label.to(x.dtype) * logsm).sum(dim=ax, keepdim=True)
    lab = label.to(torch.int64)
    valid = lab != ignore_index
    idx = torch.clamp(lab, 0, max(x.shape[ax] - 1, 0))
    picked = torch.take_along_dim(logsm, idx, dim=ax)
    return sm, torch.where(valid, -picked, torch.zeros_like(picked))


def _ce_grad(label: torch.Tensor, sm: torch.Tensor, g: torch.Tensor, ignore_index: int, ax: int, soft: bool,
             use_softmax: bool, class_start: int = 0) -> torch.Tensor:
    if soft:
        lab_f = label.to(sm.dtype)
        return (sm - lab_f) * g if use_softmax else -lab_f / sm * g
    lab = label.to(torch.int64)
    valid = lab != ignore_index
    shape = [1] * sm.ndim
    shape[ax] = sm.shape[ax]
    classes = torch.arange(class_start, class_start + sm.shape[ax], device=sm.device).reshape(shape)
    onehot = (lab == classes).to(sm.dtype)
    out = (sm - onehot) * g if use_softmax else -onehot / sm * g
    return torch.where(valid, out, torch.zeros_like(out))


@register("cross_entropy_with_softmax", "softmax_with_cross_entropy")
def _k_ce(a: Args, c: Ctx) -> tuple[Any, ...]:
    x = tensor(a["x"])
    return _ce(x, tensor(a["label"]), int(a.get("ignore_index", -100)), axis_of(a.get("axis", -1), x.ndim),
               bool(a.get("soft_label", False)), bool(a.get("use_softmax", True)))


@register("cross_entropy_with_softmax_grad", "softmax_with_cross_entropy_grad")
def _k_ce_grad(a: Args, c: Ctx) -> tuple[Any, ...]:
    sm = tensor(a["softmax"])
    return (_ce_grad(tensor(a["label"]), sm, tensor(a["loss_grad"]), int(a.get("ignore_index", -100)),
                     axis_of(a.get("axis", -1), sm.ndim), bool(a.get("soft_label", False)),
                     bool(a.get("use_softmax", True))),)


@register("c_softmax_with_cross_entropy")
def _k_c_softmax(a: Args, c: Ctx) -> tuple[Any, ...]:
    """The class axis sharded: the max, the sum of exponentials and the label's logit
    all-reduced over the mesh dims that shard it (``Ctx.comm``), as Megatron's kernel does."""
    x = tensor(a["x"])
    ig = int(a.get("ignore_index", -100))
    if c.is_global:
        return _ce(x, tensor(a["label"]), ig, x.ndim - 1, False, True)
    if c.comm is None:
        raise ValueError("c_softmax_with_cross_entropy: a rank's torch kernel needs Ctx.comm (the class group)")
    dims = entry_dims(c.in_attrs["x"].dims_mapping[-1])
    start = class_start(c, "x")
    m = c.comm.all_reduce(torch.amax(x, dim=-1, keepdim=True), dims, "max")
    e = torch.exp(x - m)
    s = c.comm.all_reduce(e.sum(dim=-1, keepdim=True), dims, "sum")
    lab = tensor(a["label"]).to(torch.int64)
    valid = lab != ig
    loc = torch.clamp(lab, 0, max(int(c.shapes["x"][-1]) - 1, 0)) - start
    mine = (loc >= 0) & (loc < x.shape[-1])
    picked = torch.take_along_dim(x, torch.clamp(loc, 0, max(x.shape[-1] - 1, 0)), dim=-1)
    xl = c.comm.all_reduce(torch.where(mine, picked, torch.zeros_like(picked)), dims, "sum")
    loss = -(xl - m - torch.log(s))
    return e / s, torch.where(valid, loss, torch.zeros_like(loss))


@register("c_softmax_with_cross_entropy_grad")
def _k_c_softmax_grad(a: Args, c: Ctx) -> tuple[Any, ...]:
    sm = tensor(a["softmax"])
    return (_ce_grad(tensor(a["label"]), sm, tensor(a["loss_grad"]), int(a.get("ignore_index", -100)), sm.ndim - 1, False,
                     True, int(a.get("_class_start", 0))),)
