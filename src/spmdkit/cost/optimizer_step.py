"""The passes Megatron's mixed-precision optimizer step makes over the parameters, gradients
and states (``--framework megatron``): what an ``adam`` / ``adamw`` update of the program costs
there instead of its own tensors' bytes. Standard library only. docs/devices.md, "The optimizer
step under Megatron".

The program's update reads its parameter, gradient, moments and master copy and writes them
(30 bytes an element with bf16 parameters and gradients). Megatron-LM's
``Float16OptimizerWithFloat16Params.step`` (megatron/optimizer/optimizer at de7dc40f88, 2021,
and 35a3fa8b7c, 2022; Megatron-Core's ``MixedPrecisionOptimizer.step`` keeps the same passes)
runs, over the optimizer's shard of each 16-bit parameter with an fp32 main copy:

- ``_copy_model_grads_to_main_grads``: ``main_param.grad = model_param.main_grad.float()`` (or
  ``model_param.grad.float()``): a copy only where the gradient is held in 16 bits (2 bytes read,
  4 written); fp32 main gradients are taken as they are;
- ``_unscale_main_grads_and_check_for_nan`` (fp16 only: a grad scaler exists, constant or
  dynamic): ``torch._amp_foreach_non_finite_check_and_unscale_`` reads and writes each fp32 main
  gradient (8 bytes; then an all-reduce of one float and ``.item()``: a host sync);
- ``clip_grad_norm_fp32`` (megatron/optimizer/clip_grads; ``--clip-grad`` 1.0 by default):
  ``amp_C.multi_tensor_l2norm`` reads every fp32 main gradient (4 bytes); the rescale by
  ``multi_tensor_scale`` runs only when the norm exceeds the threshold, a value of the run, and
  is not charged;
- ``self.optimizer.step()``: Apex's ``FusedAdam`` (``multi_tensor_adam``) reads the fp32 main
  parameter, gradient and two moments and writes the parameter and moments (28 bytes);
- ``_copy_main_params_to_model_params``: ``multi_tensor_scale`` by 1.0 from the fp32 main
  parameter to the 16-bit one (4 read, 2 written);

and ``train_step`` zeroes the contiguous gradient buffer before the next step (local DDP's
``zero_grad_buffer``, contiguous by default from Megatron-LM of 2022 on; Megatron-Core's
``zero_grad_buffer``): one write of every element of the gradient as held, its whole local
size (the distributed optimizer's shard is of the states, not of the buffer).
"""

from __future__ import annotations

from dataclasses import replace

from spmdkit.cost.shards import local_numel
from spmdkit.engine.facts import LocalOp, OpCost
from spmdkit.ops._cost import numel
from spmdkit.program.plan import Plan

#: per element of the update's shard: (name, bytes read, bytes written) of each pass, the
#: fp32 main gradient and parameter 4 bytes, the model's parameter 2
ADAM = ("multi_tensor_adam", 16, 12)
NORM = ("multi_tensor_l2norm", 4, 0)
COPY_BACK = ("copy main params to model params", 4, 2)
UNSCALE = ("unscale and check for inf", 4, 4)
MAIN_GRAD = ("main grad .float()", 2, 4)

#: the update rules Megatron's optimizer runs as Adam
ADAM_RULES = frozenset({"adam", "adamw", "adam_", "adamw_"})


def megatron_passes(precision: str, grad_itemsize: int) -> tuple[tuple[str, int, int], ...]:
    """The passes of Megatron's optimizer step over each element of its shard (see the module
    docstring), for ``precision`` (fp16: the grad scaler's unscale) and the gradient held in
    ``grad_itemsize`` bytes (2: the copy to an fp32 main gradient)."""
    out = [MAIN_GRAD] if grad_itemsize == 2 else []
    if precision == "fp16":
        out.append(UNSCALE)
    return (*out, NORM, ADAM, COPY_BACK)


def megatron_update_cost(plan: Plan, i: int, lop: LocalOp, c: OpCost) -> OpCost:
    """An Adam update of ``plan``'s op ``i`` as Megatron's optimizer step runs it: the passes of
    :func:`megatron_passes` over the update's shard, and the zeroing of its gradient buffer;
    ``c`` (the program's own tensors) where the rule is not Adam, the parameter is fp32 (no
    main copy), or Adam's states are bf16 (``--optimizer-dtype bf16``: Apex's distributed Adam
    updating the bf16 parameter in place, which this does not model)."""
    rt = plan.runtime
    op = plan.program.ops[i]
    param = lop.one("param")
    g = op.inputs.get("grad")
    if op.rule not in ADAM_RULES or param is None or not isinstance(g, str) or rt.optimizer_dtype == "bf16":
        return c
    precision = rt.precision_of(param[2])
    if precision == "fp32":
        return c
    n = numel(param[0])  # the update's shard
    grad_itemsize = 2 if rt.grad_dtype == "bf16" else 4
    passes = megatron_passes(precision, grad_itemsize)
    held = local_numel(plan.attrs[g], plan.program.tensors[g].shape)  # the buffer as held, unsharded by ZeRO-1
    nbytes = n * sum(r + w for _name, r, w in passes) + held * grad_itemsize
    small = sum(b for args in lop.ins.values() for s, b, _dt in args if numel(s) == 1)  # lr, beta powers
    return replace(c, bytes=float(nbytes + small), kernels=len(passes) + 1)


__all__ = ["ADAM_RULES", "megatron_passes", "megatron_update_cost"]
