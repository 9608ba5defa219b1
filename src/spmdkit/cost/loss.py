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

flash-attn's ``CrossEntropyLoss`` (``--cross-entropy-kernel``; llm-foundry's MPT calls it as
``CrossEntropyLoss(ignore_index=-100)``, so ``inplace_backward=False``), over 16-bit logits
without an upcast, the per-token losses and log-sum-exp in fp32:

- ``flash-attn-xentropy`` (flash-attn v0.2.8 to v2.2.2, ``flash_attn/losses/cross_entropy.py``
  over ``csrc/xentropy/xentropy_kernel.cu``, the same file from v0.2.8 to v2.3.2; read at v1.0.9,
  6d48e14a): forward ``cunn_SoftMaxXEntropyForward``, one block a row, two ``ilpReduce`` walks of
  the row (max and sum; then the sum of exponentials): read 2 + 2; backward
  ``cunn_SoftMaxXEntropyBackward`` reads the saved logits and writes the gradient into
  ``at::empty_like(logits)`` (``inplace`` false): read 2, write 2. One kernel each way.
- ``flash-attn-triton`` (from v2.2.3, ``flash_attn/ops/triton/cross_entropy.py``; read at v2.4.2,
  1a2c3e8c): ``cross_entropy_fwd_kernel`` loads a row's block (``BLOCK_SIZE`` up to 64k
  columns, one block for a vocabulary up to 65536) once: read 2; ``cross_entropy_bwd_kernel``
  reads the logits and writes ``torch.empty_like(logits)``: read 2, write 2.

Per token both read the int64 label and write (forward) or read (backward) the fp32 loss and
log-sum-exp: 16 bytes a token each way (:data:`FLASH_CE_TOKEN`).

torchtitan's compiled loss (``--cross-entropy-kernel compiled``): from bbb1b616e (2025-04-02)
``build_cross_entropy_loss`` (``torchtitan/components/loss.py``, the same at 820504e and e7c0cae)
returns ``torch.compile(cross_entropy_loss)`` when ``training.compile`` is set (at 9dec370, 2024-12,
and 0da8901b1, 2025-03, the line is commented out: the eager loss). AOTAutograd traces
``cross_entropy(pred.flatten(0, 1).float(), labels)`` as one joint graph (``convert_element_type``,
``_log_softmax`` decomposed into ``amax``, ``sub``, ``exp``, ``sum``, ``log``, ``sub``; ``nll_loss``;
the backward ``_log_softmax_backward_data``: ``grad - exp(out) * sum(grad)``, and the nll gradient as
``full`` + ``scatter``) and the min-cut partitioner (``torch/_functorch/partitioners.py``,
``min_cut_rematerialization_partition`` / ``solve_min_cut``) picks what the forward saves: a primal
is saved at its own size (``get_node_weight``: ``_size_of``, a placeholder is materialized), a
fusible pointwise node (the upcast, ``sub``, ``exp``) is recomputable and weighs twice its size if
not materialized, and a reduction whose output is 4x smaller than its input is banned from
recomputation (``ban_if_reduction``: ``amax``, ``sum``). The cheapest cut between the forward and
the backward's need of the log-softmax is the bf16 logits (2 bytes an element) and the per-row
``amax`` and log-sum-exp, not the fp32 log-softmax (4 bytes, 8 as non-materialized). Inductor
then runs, over the local bf16 logits:

- forward: one looped reduction kernel a row, a loop for ``amax`` and one for the sum of
  exponentials, each reading the bf16 row (2 + 2), the label's log-probability gathered: no
  fp32 copy and no log-softmax written;
- backward: the nll gradient's ``full`` + ``scatter`` rewritten to a pointwise ``where`` over the
  column index (``torch/_inductor/fx_passes/joint_graph.py``, ``scatter_upon_const_tensor``), its
  row sum computed in-kernel, ``exp(x - amax - lse)`` recomputed from the saved bf16 logits and
  the gradient written in bf16 (the cast to the logits' dtype fused): read 2, write 2.

That is flash-attn's xentropy kernel's traffic (4 and 4 an element, :data:`FLASH_CE_TOKEN` a
token) and memory (:data:`FLASH_CE_BYTES`). Under loss parallelism (vocab-sharded logits, tp > 1)
the loss runs DTensor's op-by-op ``loss_parallel`` handlers: there the compiled loss is not
modelled and the eager one is kept (:func:`vocab_sharded`).
Only the ``megatron`` framework's own loss and flash-attn's are modelled here (torchtitan's eager loss:
:mod:`spmdkit.cost.eager`; AutoModel's on bf16 logits keeps the op families' cost).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from spmdkit.core.dist_attr import entry_dims
from spmdkit.engine.facts import LocalOp, OpCost
from spmdkit.ops._cost import numel
from spmdkit.program.ir import flat_refs

if TYPE_CHECKING:
    from spmdkit.program.plan import Plan

#: the softmax cross-entropy rules, forward -> its grad
LOSS_FORWARD = frozenset({"cross_entropy_with_softmax", "c_softmax_with_cross_entropy", "softmax_with_cross_entropy"})
LOSS_BACKWARD = frozenset({"cross_entropy_with_softmax_grad", "c_softmax_with_cross_entropy_grad",
                           "softmax_with_cross_entropy_grad"})
#: bytes per logit element (forward, backward) and kernels (forward, backward) of Megatron-Core's
#: vocab-parallel cross-entropy, unfused and fused (module docstring)
MEGATRON_CE = {False: ((38.0, 14.0), (6, 3)), True: ((26.0, 10.0), (4, 1))}
#: bytes per 16-bit logit element (forward, backward) of flash-attn's fused cross-entropy kernels,
#: one kernel each way (module docstring)
FLASH_CE = {"flash-attn-xentropy": (4.0, 4.0), "flash-attn-triton": (2.0, 4.0), "compiled": (4.0, 4.0)}
#: ``--cross-entropy-kernel compiled``: torchtitan's ``torch.compile(cross_entropy_loss)`` (module docstring)
COMPILED = "compiled"
#: bytes per token of those kernels, each way: the int64 label, the fp32 loss and log-sum-exp
FLASH_CE_TOKEN = 16.0
#: bytes per logit element flash-attn's loss holds beyond the program's 16-bit softmax, as
#: :data:`spmdkit.cost.memory.LOSS_BYTES` (held, forward, backward): the kernel saves the 16-bit
#: logits themselves for the backward (what the program's softmax stands for: 0 held), writes no
#: softmax in the forward (-2: the program's softmax beside its logits) and its gradient into a
#: new tensor of the logits' dtype, as the program's (0)
FLASH_CE_BYTES = (0, -2, 0)


def _logits(lop: LocalOp, backward: bool) -> tuple[int, int] | None:
    """(local logit elements, their itemsize): the forward's ``x``, the grad's ``softmax``."""
    for p in (("softmax",) if backward else ("x", "input", "logits")):
        args = lop.ins.get(p)
        if args:
            shape, itemsize, _dtype = args[0]
            return numel(shape), itemsize
    return None


def vocab_sharded(plan: Plan, i: int) -> bool:
    """Whether the logits of the loss op ``i`` (a softmax cross-entropy: its softmax output; its grad:
    the softmax it reads) are sharded over the vocabulary (torchtitan's ``loss_parallel``)."""
    op = plan.program.ops[i]
    names = flat_refs(op.inputs["softmax"]) if "softmax" in op.inputs else op.output_names()[:1]
    name = next((n for n in names if n is not None), None)
    if name is None:
        return False
    attr = plan.attrs[name]
    return bool(attr.dims_mapping and entry_dims(attr.dims_mapping[-1]))


def fused_loss(plan: Plan, i: int) -> bool:
    """Whether ``--cross-entropy-kernel`` prices the loss op ``i``: flash-attn's kernels always, the
    compiled loss where its logits are not vocab-sharded (module docstring)."""
    kernel = plan.runtime.ce_kernel
    return kernel is not None and not (kernel == COMPILED and vocab_sharded(plan, i))


def flash_ce_cost(rule: str, lop: LocalOp, c: OpCost, kernel: str) -> OpCost:
    """``c`` (a softmax cross-entropy or its grad) as flash-attn's ``kernel`` (:data:`FLASH_CE`)
    runs it over the local 16-bit logits: its bytes, one kernel; ``c`` itself for another op or
    fp32 logits."""
    backward = rule in LOSS_BACKWARD
    if not (backward or rule in LOSS_FORWARD):
        return c
    args = next((lop.ins[p] for p in (("softmax",) if backward else ("x", "input", "logits")) if lop.ins.get(p)), None)
    if not args or args[0][1] != 2 or not args[0][0]:
        return c
    shape = args[0][0]
    elems = numel(shape)
    tokens = elems // max(1, shape[-1])
    per = FLASH_CE[kernel][1 if backward else 0]
    return replace(c, bytes=per * elems + FLASH_CE_TOKEN * tokens, kernels=1)


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


__all__ = ["COMPILED", "FLASH_CE", "FLASH_CE_BYTES", "FLASH_CE_TOKEN", "LOSS_BACKWARD", "LOSS_FORWARD", "MEGATRON_CE", "flash_ce_cost",
           "fused_loss", "loss_cost", "vocab_sharded"]
