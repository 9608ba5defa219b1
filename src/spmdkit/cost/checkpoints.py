"""What a whole-layer checkpoint leaves alive (``--recompute full`` / ``full:K``), and which
frameworks can recompute only some layers. Standard library only; docs/devices.md,
"Recomputation".

A layer checkpoint saves its input and not its output: Megatron-Core's
``tensor_parallel.checkpoint`` (``CheckpointFunction.forward`` runs the layers under ``no_grad``
and saves ``*args``; under fp8 ``te_checkpoint``, TE's ``_CheckpointFunction`` alike:
transformer_engine/pytorch/distributed.py at d0067d0), called by TransformerBlock
``_checkpointed_forward`` (megatron/core/transformer/transformer_block.py, the same from
core_v0.6.0 to core_v0.15.0, 0d7e02bd) on each chunk of ``recompute_num_layers`` layers
(method uniform) or on each of the first ``recompute_num_layers`` layers (method block); torch's
``checkpoint_wrapper`` as torchtitan wraps each block (9dec370, ``_apply_ac_to_transformer_block``).
The op after a checkpoint that is not itself checkpointed saves its input as any op does: the
final norm the last layer's output (TransformerBlock ``final_layernorm``; torchtitan's
``self.norm``), the first layer that block recomputation leaves out its input (its
``input_layernorm``), the shared head the MTP module's output (its final norm runs inside
``MultiTokenPredictionLayer._proj_and_transformer_layer``, which is checkpointed). That output is
kept for the backward, not made again; the checkpoint's backward, and the re-run with it, comes
after that op's backward. A pipeline stage's last output is not: Megatron-LM frees the output it
sent (``deallocate_output_tensor``) and the next stage's first layer keeps it as its input.
"""

from __future__ import annotations

import re

from spmdkit.core.errors import ProgramError
from spmdkit.cost.recompute_modules import MODULES, recompute_modules
from spmdkit.program.ir import Program

#: a number in a layer label (``layer 3``, ``model.layers.3``)
_LAYER_NUMBER = re.compile(r"\d+")


def layer_numbers(label: str) -> tuple[int, ...]:
    """The numbers of a layer label, in order (``layer 3`` -> (3,)); () for a label without one
    (the embedding, the head: no transformer layer)."""
    return tuple(int(n) for n in _LAYER_NUMBER.findall(label))


#: the recomputation modes besides ``full:K``, ``selective:M1,M2`` and :data:`MICROBATCH`
RECOMPUTE = ("none", "selective", "full")

#: the frameworks whose activation checkpointing has no count of layers (``full:K`` refused):
#: torchtitan's ``[activation_checkpoint]`` (9dec370: ``mode`` none / selective / full, and
#: ``selective_ac_option = N`` wraps every N-th block, not the first K; HEAD b5bcd76: FullAC,
#: SelectiveAC, MemoryBudgetAC, no layer option) and NeMo AutoModel's
#: ``distributed.activation_checkpointing`` (a bool; later ``"selective"`` or ``"full"``)
NO_LAYER_COUNT = ("torchtitan", "automodel")


#: microbatch-level recomputation (Korthikanti et al. 2022, App. C), a pipeline's mode: each
#: pipeline rank keeps every activation of as many of its in-flight microbatches as its memory
#: allows and recomputes the attention core (``selective``) of the others
MICROBATCH = "microbatch"


def recompute_layers(mode: str) -> int | None:
    """K of ``full:K`` (full recomputation of the first K layers of each pipeline stage, of the
    model without a pipeline, as Megatron-LM's ``--recompute-granularity full --recompute-method
    block --recompute-num-layers K``), None for the other modes."""
    if isinstance(mode, str) and mode.startswith("full:"):
        k = mode[5:]
        if not (k.isascii() and k.isdigit() and 1 <= len(k) <= 6 and int(k) >= 1):
            raise ProgramError(f"--recompute {mode[:40]!r}: expected full:K with K >= 1 layers per stage")
        return int(k)
    return None


def check_recompute(mode: str, pipeline: bool = False, framework: str | None = None) -> str:
    """``mode`` if it is one of :data:`RECOMPUTE`, ``full:K`` (:func:`recompute_layers`; K is
    checked against the layers by :func:`recompute_regions`; refused under a ``framework`` of
    :data:`NO_LAYER_COUNT`) or, for a pipeline, :data:`MICROBATCH`, else a ProgramError naming
    ``--recompute``."""
    if recompute_layers(mode) is not None:
        if framework in NO_LAYER_COUNT:
            raise ProgramError(f"--recompute {mode} with --framework {framework}: {framework}'s activation "
                               f"checkpointing has no setting that recomputes the first K layers (Megatron-LM's "
                               f"--recompute-method block); give full, selective or none, or --framework megatron")
        return mode
    if pipeline and mode == MICROBATCH:
        return mode
    if mode == MICROBATCH:
        raise ProgramError(f"--recompute {MICROBATCH}: microbatch-level recomputation applies to a pipeline "
                           f"(give --mesh with a pp dim)")
    if mode not in RECOMPUTE and recompute_modules(mode) is None:
        shown = repr(mode[:40]) if isinstance(mode, str) else type(mode).__name__
        raise ProgramError(f"--recompute {shown}: expected one of {', '.join((*RECOMPUTE, MICROBATCH))} or "
                           f"selective:M1,M2 (modules {', '.join(MODULES)})")
    return mode


def per_microbatch_mode(mode: str) -> str:
    """The recomputation of one microbatch's plan: ``selective`` for :data:`MICROBATCH` (its
    recomputed microbatches'), ``full`` for ``full:K`` (its recomputed layers'), else ``mode``."""
    return "selective" if mode == MICROBATCH else ("full" if recompute_layers(mode) is not None else mode)


def layer_outputs_kept(prog: Program, regions: list[list[int]], reads: dict[str, list[int]]) -> set[str]:
    """The outputs of the recomputed whole layers ``regions`` (forward op indices) that a backward
    op of a layer not recomputed reads (``reads``: forward tensor -> its backward readers; a
    backward op belongs to the layer of its label): saved by the op after the checkpoint."""
    labels = {prog.ops[r[0]].layer for r in regions}
    out: set[str] = set()
    for region in regions:
        for i in region:
            for n in prog.ops[i].output_names():
                if any(prog.ops[j].layer not in labels for j in reads.get(n, ())):
                    out.add(n)
    return out


__all__ = ["MICROBATCH", "NO_LAYER_COUNT", "RECOMPUTE", "check_recompute", "layer_numbers", "layer_outputs_kept", "per_microbatch_mode",
           "recompute_layers"]
