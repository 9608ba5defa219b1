"""The machinery the torch kernel families share: the kernel table (:data:`KERNELS`, filled by
:func:`register` as each family module of this package is imported), the program dtypes as torch
dtypes, and the helpers every family uses (:func:`tensor`, :func:`floating`, :func:`axis_of`,
:func:`acc`, :func:`vjp`, and :data:`TORCH`: the formulas written once for numpy and torch, run on
torch)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from spmdkit.core.errors import ProgramError
from spmdkit.execute.kernel_names import KERNEL_NAMES, NoTorchKernelError
from spmdkit.sim.reference import ArrayLib, Ctx

Args = dict[str, Any]
Kernel = Callable[[Args, Ctx], Sequence[Any]]
UnaryT = Callable[[torch.Tensor], torch.Tensor]

#: program dtype name -> torch dtype
DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8,
    "bool": torch.bool,
}

KERNELS: dict[str, Kernel] = {}


def register(*names: str) -> Callable[[Kernel], Kernel]:
    """The decorator that enters a kernel in :data:`KERNELS` under ``names``, each listed in
    :data:`spmdkit.execute.kernel_names.KERNEL_NAMES` (what the launcher checks plans against)."""
    unlisted = [n for n in names if n not in KERNEL_NAMES]
    if unlisted:
        raise ProgramError(f"torch kernel {', '.join(unlisted)}: not in spmdkit.execute.kernel_names.KERNEL_NAMES; "
                           f"list it there (spmdkit run's launcher checks kernels against that list)")

    def deco(fn: Kernel) -> Kernel:
        for n in names:
            KERNELS[n] = fn
        return fn

    return deco


def tensor(x: Any) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.as_tensor(x)


def floating(x: Any) -> torch.Tensor:
    """A floating tensor (ints and bools become the default float dtype, as numpy's _f does)."""
    t = tensor(x)
    return t if t.is_floating_point() else t.to(torch.get_default_dtype())


def axis_of(axis: Any, ndim: int) -> int:
    a = int(axis)
    if ndim == 0:
        return 0
    return a + ndim if a < 0 else a


def acc(x: torch.Tensor) -> torch.Tensor:
    """``x`` in the dtype its statistics accumulate in (float32 for half inputs, as torch's kernels)."""
    return x.float() if x.dtype in (torch.bfloat16, torch.float16) else x


#: the formulas written once for numpy and torch (spmdkit.sim.reference.ArrayLib) on torch: the
#: program's dtype, computed rotary angles in float32 as torch's own kernels compute them
TORCH = ArrayLib(array=tensor, floats=lambda v, like: torch.as_tensor(v, dtype=torch.float32, device=like.device),
                 ints=lambda v: tensor(v).to(torch.int64), cast=lambda x, like: x.to(like.dtype), concat=torch.cat,
                 stack=torch.stack, repeat=torch.repeat_interleave, sin=torch.sin, cos=torch.cos, sqrt=torch.sqrt,
                 maximum=torch.maximum)


def vjp(fn: Callable[..., Any], primals: Sequence[Any], grads: Any, wrt: Sequence[bool] | None = None
        ) -> list[torch.Tensor | None]:
    """torch autograd's vector-Jacobian product of ``fn`` at ``primals`` (the gradient of
    ``sum(fn(*primals) * grads)`` with respect to each primal marked in ``wrt``; None for the
    others and for absent or non-floating primals)."""
    wrt = [True] * len(primals) if wrt is None else list(wrt)
    ins: list[Any] = []
    leaves: list[torch.Tensor] = []
    for p, w in zip(primals, wrt):
        if isinstance(p, torch.Tensor) and w and p.is_floating_point():
            q = p.detach().requires_grad_(True)
            leaves.append(q)
            ins.append(q)
        else:
            ins.append(p)
    if not leaves:
        return [None] * len(primals)
    with torch.enable_grad():
        out = fn(*ins)
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        gs = list(grads) if isinstance(grads, (tuple, list)) else [grads]
        pairs = [(o, g) for o, g in zip(outs, gs) if o is not None and g is not None and o.requires_grad]
        got: Sequence[torch.Tensor | None] = (
            torch.autograd.grad([o for o, _ in pairs], leaves, [g.to(o.dtype).expand_as(o) for o, g in pairs],
                                allow_unused=True) if pairs else [None] * len(leaves))
    res: list[torch.Tensor | None] = []
    it = iter(zip(leaves, got))
    for p, w in zip(primals, wrt):
        if isinstance(p, torch.Tensor) and w and p.is_floating_point():
            leaf, g = next(it)
            res.append(torch.zeros_like(leaf) if g is None else g)
        else:
            res.append(None)
    return res


__all__ = ["DTYPES", "KERNELS", "TORCH", "Args", "Kernel", "NoTorchKernelError", "UnaryT", "acc", "axis_of",
           "floating", "register", "tensor", "vjp"]
