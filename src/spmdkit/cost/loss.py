"""The loss as the framework runs it: the memory traffic of a softmax cross-entropy over the
logits. The op families cost ``cross_entropy_with_softmax`` / ``c_softmax_with_cross_entropy``
as one fused pass (read the 16-bit logits, write the 16-bit softmax; its grad likewise); the
frameworks upcast the logits to fp32 and walk them several times, which at a vocabulary of
128k-256k and a small hidden size is a large share of the step. Standard library only.
docs/devices.md, "The loss".

Megatron-Core's ``vocab_parallel_cross_entropy`` (megatron/core/tensor_parallel/cross_entropy.py,
core_r0.8.0; the same passes since Megatron-LM 2021's ``vocab_parallel_cross_entropy(output.float())``),
bytes per local logit element (bf16 logits ``x``, fp32 copy ``f``):

- forward: ``x.float()`` (read 2, write 4), ``max`` (read 4), ``f -= max`` (read 4, write 4),
  ``exp`` in place (read 4, write 4), ``sum`` (read 4), ``f.div_(sum)`` (read 4, write 4): 38;
- backward: ``grad.mul_(grad_output)`` in place over the saved fp32 softmax (read 4, write 4),
  then autograd's cast of the fp32 gradient back to the bf16 logits' (read 4, write 2): 14.

With ``--cross-entropy-loss-fusion`` (megatron/core/fusions/fused_cross_entropy.py, its pieces
compiled by ``jit_fuser``: torch.compile from torch 2.2): the upcast and ``max`` in one kernel
(read 2, write 4), the subtraction and ``exp`` in one (read 4, write 4), the ``sum`` (read 4), the
division (read 4, write 4): 26 forward; the backward's scale and cast to bf16 in one kernel (read
4, write 4 in place, write 2): 10.

Only the ``megatron`` framework's loss is modelled here (torchtitan's eager loss: :mod:`spmdkit.cost.eager`;
AutoModel's on bf16 logits keeps the op families' cost).
"""

from __future__ import annotations

from dataclasses import replace

from spmdkit.engine.facts import LocalOp, OpCost
from spmdkit.ops._cost import numel

#: the softmax cross-entropy rules, forward -> its grad
LOSS_FORWARD = frozenset({"cross_entropy_with_softmax", "c_softmax_with_cross_entropy", "softmax_with_cross_entropy"})
LOSS_BACKWARD = frozenset({"cross_entropy_with_softmax_grad", "c_softmax_with_cross_entropy_grad",
                           "softmax_with_cross_entropy_grad"})
#: bytes per logit element (forward, backward) and kernels (forward, backward) of Megatron-Core's
#: vocab-parallel cross-entropy, unfused and fused (module docstring)
MEGATRON_CE = {False: ((38.0, 14.0), (6, 3)), True: ((26.0, 10.0), (4, 1))}


def _logits(lop: LocalOp, backward: bool) -> tuple[int, int] | None:
    """(local logit elements, their itemsize): the forward's ``x``, the grad's ``softmax``."""
    for p in (("softmax",) if backward else ("x", "input", "logits")):
        args = lop.ins.get(p)
        if args:
            shape, itemsize, _dtype = args[0]
            return numel(shape), itemsize
    return None


def loss_cost(rule: str, lop: LocalOp, c: OpCost, framework: str, fused: bool) -> OpCost:
    """``c`` (a softmax cross-entropy or its grad, ``rule`` its canonical name) with the bytes and
    kernels of the ``framework``'s loss over its local logits (``fused``: Megatron's
    ``--cross-entropy-loss-fusion``); ``c`` itself for another op, another framework, or fp32
    logits (the program's own loss then moves what the framework's does, but for the upcast)."""
    backward = rule in LOSS_BACKWARD
    if framework != "megatron" or not (backward or rule in LOSS_FORWARD):
        return c
    got = _logits(lop, backward)
    if got is None or got[1] != 2:
        return c
    elems = got[0]
    (fwd, bwd), (kf, kb) = MEGATRON_CE[fused]
    per = bwd if backward else fwd
    return replace(c, bytes=max(c.bytes, per * elems), kernels=max(c.kernels, kb if backward else kf))


__all__ = ["LOSS_BACKWARD", "LOSS_FORWARD", "MEGATRON_CE", "loss_cost"]
