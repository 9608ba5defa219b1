"""Kernels that do the work of several program ops: which ops of a plan another op's kernel
runs, under the plan's framework. Standard library only. docs/devices.md, "Fused kernels".

A program spells a layer op by op (``scale``, ``add`` of the mask, ``softmax``; a ``dropout``
and the ``bernoulli`` that stands for its mask; a ``q``, ``k`` and ``v`` projection whose input
gradients are summed). The frameworks run some of these as one kernel; :func:`fused_ops` names
the ops whose work that kernel already does, and :func:`spmdkit.cost.compute.op_cost` costs them
as no kernel (a dropout's mask: written by the dropout's kernel):

- **dropout's mask** (every framework: torch's dropout): ``torch.nn.functional.dropout`` runs
  ``native_dropout``, ONE kernel that reads the input and writes both the output and the keep
  mask (``aten/src/ATen/native/cuda/Dropout.cu``, ``fused_dropout_kernel``: ``ret`` and
  ``mask`` written in the same loop). The program's ``bernoulli`` after a ``dropout`` stands for
  that mask (:func:`spmdkit.models.zoo_layers.dropout`): its write is counted, not a read of the
  dropout's output nor a launch of its own.
- **scale, mask and softmax** (``megatron``): Megatron-LM's ``FusedScaleMaskSoftmax``
  (``megatron/model/fused_softmax.py``; ``--masked-softmax-fusion`` on by default in
  ``megatron/arguments.py``) runs the scores' scaling, the causal mask and the softmax as one
  kernel (``scaled_upper_triang_masked_softmax``: the mask made in the kernel, not read; with a
  mask tensor ``scaled_masked_softmax``), and its backward as one
  (``scaled_upper_triang_masked_softmax_backward``: the output gradient and the softmax read,
  the scale applied, the input gradient written). The ``scale`` and the mask's ``add`` before a
  ``softmax`` are that kernel, and so is the ``scale_grad`` after its ``softmax_grad`` (the
  ``add_grad`` runs no kernel in torch anyway: :mod:`spmdkit.ops.elementwise`).
- **one projection of q, k, v** (``megatron``): Megatron's attention projects q, k and v with
  ONE column-parallel GEMM (Megatron-LM 2022 ``ParallelAttention.query_key_value``:
  ``ColumnParallelLinear(hidden, 3 * projection_size)``; Megatron-Core
  ``SelfAttention.linear_qkv``; likewise ``linear_fc1`` holds a gated MLP's gate and up), so its
  input gradient is ONE dgrad GEMM's output: the ``add_n`` summing the dgrads of GEMMs that read
  one input with their own weights is no kernel there. (A router's GEMM, read by an MoE dispatch,
  is Megatron's own module: a sum with it stays.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from spmdkit.engine.memo import Recent
from spmdkit.program.ir import Program

#: the forward GEMM rules whose ``y`` / ``weight`` is a linear layer's weight
_GEMMS = frozenset({"matmul", "linear_v2", "fused_gemm_epilogue"})
_FRAMEWORKS_FUSING = frozenset({"megatron"})


@dataclass(frozen=True)
class Fused:
    """The ops whose work another kernel does (:func:`fused_ops`): ``free`` run no kernel of
    their own; ``masks``: a dropout op -> the bytes per element of the mask its kernel also
    writes (the mask's ``bernoulli`` is free)."""

    free: frozenset[int]
    masks: dict[int, int]


#: fused_ops by (program id, framework); the program is kept in the value, so its id stays its own
_MEMO: Recent[tuple[Program, Fused]] = Recent(16)


def fused_ops(prog: Program, framework: str) -> Fused:
    """The ops of ``prog`` that a fused kernel runs under ``framework`` (module docstring).
    Memoised per program and framework."""
    return _MEMO.get((id(prog), framework), lambda: (prog, _fused(prog, framework)))[1]


def _fused(prog: Program, framework: str) -> Fused:
    producer: dict[str, int] = {}
    readers: dict[str, list[int]] = {}
    by_name: dict[str, int] = {}
    for i, op in enumerate(prog.ops):
        for n in op.output_names():
            producer.setdefault(n, i)
        for n in op.input_names():
            readers.setdefault(n, []).append(i)
        if op.name:
            by_name.setdefault(op.name, i)

    def made_by(name: object, rule: str) -> int:
        j = producer.get(name, -1) if isinstance(name, str) else -1
        return j if j >= 0 and prog.ops[j].rule == rule else -1

    def grad_op(j: int) -> int:
        """The backward op of forward op ``j`` (the autodiff names it ``grad of`` its first output)."""
        outs = prog.ops[j].output_names()
        return by_name.get("grad of " + outs[0], -1) if outs else -1

    free: set[int] = set()
    masks: dict[int, int] = {}
    fusing = framework in _FRAMEWORKS_FUSING
    for i, op in enumerate(prog.ops):
        if op.rule == "bernoulli" and (d := made_by(op.inputs.get("x"), "dropout")) >= 0:
            free.add(i)
            masks[d] = masks.get(d, 0) + sum(prog.tensors[n].itemsize for n in op.output_names())
        elif fusing and op.rule == "softmax" and op.phase == "forward":
            free.update(_scale_mask(prog, op.inputs.get("x"), made_by, grad_op))
        elif fusing and op.rule == "add_n" and op.phase == "backward" and _one_gemm(prog, op.input_names(), producer,
                                                                                      readers):
            free.add(i)
    return Fused(frozenset(free), masks)


def _scale_mask(prog: Program, x: object, made_by: Callable[[object, str], int],
                grad_op: Callable[[int], int]) -> list[int]:
    """The ``add`` of a mask (a program input) to ``scale``'s output that makes the softmax's
    input ``x``, the ``scale``, and their backward ops: Megatron's fused softmax runs them."""
    j = made_by(x, "add")
    if j < 0:
        return []
    add = prog.ops[j]
    y = add.inputs.get("y")
    k = made_by(add.inputs.get("x"), "scale")
    if k < 0 or not isinstance(y, str) or prog.tensors[y].kind != "input":
        return []
    return [j, k, *(g for g in (grad_op(j), grad_op(k)) if g >= 0)]


def _one_gemm(prog: Program, parts: list[str], producer: dict[str, int], readers: dict[str, list[int]]) -> bool:
    """Whether the gradients ``parts`` summed are the dgrads of two or more GEMMs that read one
    input with their own parameter weights, none of them a router read by an MoE op: one GEMM in
    Megatron (module docstring)."""
    if len(parts) < 2:
        return False
    xs: set[str] = set()
    for g in parts:
        j = producer.get(g, -1)
        if j < 0 or prog.ops[j].phase != "backward" or not prog.ops[j].rule.endswith("_grad"):
            return False
        fwd = prog.ops[j].name.removeprefix("grad of ")
        f = producer.get(fwd, -1)
        if f < 0 or prog.ops[f].rule not in _GEMMS:
            return False
        x, w = prog.ops[f].inputs.get("x"), prog.ops[f].inputs.get("y")
        if not isinstance(x, str) or not isinstance(w, str) or prog.tensors[w].kind != "parameter":
            return False
        if any(prog.ops[r].rule.startswith("moe_") for r in readers.get(fwd, ())):
            return False
        xs.add(x)
    return len(xs) == 1


__all__ = ["Fused", "fused_ops"]
