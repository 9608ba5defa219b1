"""torch kernels of the ``softmax`` family (:mod:`spmdkit.ops.softmax`): softmax and log_softmax, and
their gradients from the output (torch's own backward kernels)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from spmdkit.execute.kernels._common import Args, Kernel, UnaryT, axis_of, register, tensor
from spmdkit.sim.reference import Ctx


def _softmax_kernel(fn: Callable[..., torch.Tensor], of_0d: UnaryT) -> Kernel:
    def k(a: Args, c: Ctx) -> tuple[Any, ...]:
        x = tensor(a["x"])
        return (of_0d(x) if x.ndim == 0 else fn(x, dim=axis_of(a.get("axis", -1), x.ndim)),)

    return k


def _softmax_grad_kernel(backward: Callable[..., torch.Tensor]) -> Kernel:
    def k(a: Args, c: Ctx) -> tuple[Any, ...]:
        out, g = tensor(a["out"]), tensor(a["out_grad"])
        if out.ndim == 0:
            return (torch.zeros_like(g),)
        return (backward(g, out, axis_of(a.get("axis", -1), out.ndim), g.dtype),)

    return k


# (rule, forward, its value on a 0-d tensor, torch's backward from the output)
for _n, _fwd, _of_0d, _bwd in (("softmax", torch.softmax, torch.ones_like, torch._softmax_backward_data),
                               ("log_softmax", torch.log_softmax, torch.zeros_like, torch._log_softmax_backward_data)):
    register(_n)(_softmax_kernel(_fwd, _of_0d))
    register(f"{_n}_grad")(_softmax_grad_kernel(_bwd))
