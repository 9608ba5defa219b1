"""torch kernels of the ops behind the rules: what a rank of ``spmdkit run --kernels torch`` runs
on its local shards, in the program's dtype (float32, bfloat16, float16), on CPU or GPU.

One module per op family, with the file names of :mod:`spmdkit.ops` (and of the numpy
references, :mod:`spmdkit.sim.refs`); :mod:`~spmdkit.execute.kernels._common` holds what they
share (the table, :func:`~spmdkit.execute.kernels._common.register`, the dtypes, autograd's
vector-Jacobian product). Importing this package imports every family, so the table is whole.
Each kernel mirrors the numpy reference of its op family by family, with torch's own ops
instead of numpy's:

- gradients: ``torch.autograd`` of the forward kernel where the grad op is given the forward's
  inputs (elementwise, matmul, reductions, views, gathers, convolutions, attention, rotary
  embedding): torch's own backward kernels, one vector-Jacobian product per op; where the grad op
  is given saved statistics or the output instead (softmax, layer / RMS norm, the losses, the
  output-based unary grads) the reference's formula, in torch;
- where the numpy reference's formula is the kernel, it is written once and runs here on
  :data:`~spmdkit.execute.kernels._common.TORCH` (:class:`spmdkit.sim.reference.ArrayLib`):
  ``sum_to_shape``, matmul and its grad, the rotary embedding and its grad, the Adam / AdamW update;
- the MoE routing ops (:mod:`~spmdkit.execute.kernels.moe`: moe_gate_dispatch, moe_combine and
  their grads, with the optional batch axis): the reference's token loops vectorised (stable
  sorts for the top-k and for each choice's expert slot), equal to it index for index.

The attributes a rank sees are made local by the numpy reference's own ``localize`` hook (a
reshape's target in local sizes, an embedding shard's first row), so a torch kernel computes
what its reference computes on the same pieces. A kernel that communicates
(``c_softmax_with_cross_entropy``) all-reduces through ``Ctx.comm`` on torch tensors.

A rule without a kernel here is refused by name (:func:`missing_kernels`,
:class:`NoTorchKernelError`; :mod:`spmdkit.execute.kernel_names`, which lists the names without
importing torch for ``spmdkit run``'s launcher): there is no silent fallback to numpy.
:func:`kernel_names` lists every rule (and alias) that has one.
"""

from __future__ import annotations

import pkgutil
from importlib import import_module
from typing import Any

from spmdkit.engine.registry import by_rule_name
from spmdkit.execute.kernel_names import NoTorchKernelError, check_kernels, missing_kernels
from spmdkit.execute.kernels._common import DTYPES, KERNELS, Args, Kernel
from spmdkit.sim.reference import Ctx, Reference

#: the family modules, each imported (its kernels registered) in name order
FAMILIES = tuple(import_module(f"{__name__}.{m.name}") for m in pkgutil.iter_modules(__path__)
                 if not m.name.startswith("_"))


def get_kernel(name: str) -> Kernel | None:
    """The torch kernel of a rule name (or any alias of that rule), None if there is none."""
    return by_rule_name(KERNELS, name)


def kernel_names() -> list[str]:
    """Every rule name with a torch kernel (aliases included)."""
    return sorted(KERNELS)


def run_kernel(ref: Reference, kernel: Kernel, args: Args, ctx: Ctx) -> tuple[Any, ...]:
    """Run ``kernel`` on ``args`` (torch tensors), after the numpy reference's ``localize`` hook
    on a rank (the same local attributes the reference would get)."""
    a = ref.localize(args, ctx) if ref.localize is not None and not ctx.is_global else args
    return tuple(kernel(a, ctx))


__all__ = ["DTYPES", "FAMILIES", "KERNELS", "NoTorchKernelError", "check_kernels", "get_kernel", "kernel_names",
           "missing_kernels", "run_kernel"]
