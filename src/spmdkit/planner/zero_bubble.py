"""ZB-H1's split of each backward (Qi et al. 2023): B, the input gradients, and W, the weight
gradients (:mod:`spmdkit.planner.schedules` runs the schedule).

The W of a stage is the weight-gradient GEMMs of its linear layers, as the zero-bubble
implementations defer them (Qi et al.'s Megatron-LM fork stores each linear layer's ``dW``
computation; torch's ``stage_backward_weight``): a GEMM's backward (``matmul_grad`` and its
kin) whose outputs include a parameter's gradient (or a partial sum of one, added by
``add_n``) makes the input's gradient and the weight's with one GEMM each of the same FLOPs
(``dX = dY W^T``, ``dW = X^T dY``), so half of its time is W. Everything else (attention,
norms and their small weight gradients, the embedding's) stays in B. A deferred W keeps what
it reads: the forward activation ``X`` and the output gradient ``dY``, the ``wstash`` of a
stage.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from spmdkit.cost.memory_saved import ActivationMemory, kept_storage, value_inputs
from spmdkit.program.plan import Plan

#: the backward rules of GEMMs with a weight: one GEMM for the input's gradient, one for the weight's
GEMM_GRADS = frozenset({"matmul_grad", "bmm_grad", "linear_v2_grad", "fused_gemm_epilogue_grad"})


def weight_shares(plan: Plan, param_grads: Collection[str]) -> dict[int, float]:
    """Backward op index -> the share of its time that is the weight gradient (W)."""
    prog = plan.program
    wgrad = set(param_grads)
    for op in reversed(prog.ops):  # partial weight gradients summed into one by add_n
        if op.phase == "backward" and op.rule == "add_n" and any(n in wgrad for n in op.output_names()):
            wgrad.update(op.input_names())
    return {i: 0.5 for i, op in enumerate(prog.ops)
            if op.phase == "backward" and op.rule in GEMM_GRADS and any(n in wgrad for n in op.output_names())}


def weight_stash(plan: Plan, stages: list[int], n: int, saved: ActivationMemory, shares: dict[int, float],
                 nbytes: Callable[[str], int]) -> list[int]:
    """Per stage, the bytes one microbatch keeps from its B until its W: the saved activations
    a weight-gradient op reads the values of and the output gradients it reads."""
    prog = plan.program
    size = {nm: b for lst in saved.tensors.values() for nm, b in lst}
    size.update((v, size[f]) for v, f in saved.shared.items())  # a view's own bytes (its storage's)
    at = kept_storage(plan, saved, stages)
    out = [0] * n
    seen: set[tuple[str, int]] = set()
    for i in shares:
        s = stages[i]
        for nm in value_inputs(prog.ops[i]):
            t = prog.tensors[nm]
            if (nm, s) in seen or t.kind == "parameter":
                continue
            if nm in size:
                nm = at(nm, s)  # a view kept at 0 bytes: its storage's where one on the stage (memory_saved.kept_storage)
                if (nm, s) not in seen:
                    seen.add((nm, s))
                    out[s] += size[nm]
            elif t.kind == "gradient":
                seen.add((nm, s))
                out[s] += nbytes(nm)
    return out


__all__ = ["GEMM_GRADS", "weight_shares", "weight_stash"]
