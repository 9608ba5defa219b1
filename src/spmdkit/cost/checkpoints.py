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

from spmdkit.program.ir import Program

#: the frameworks whose activation checkpointing has no count of layers (``full:K`` refused):
#: torchtitan's ``[activation_checkpoint]`` (9dec370: ``mode`` none / selective / full, and
#: ``selective_ac_option = N`` wraps every N-th block, not the first K; HEAD b5bcd76: FullAC,
#: SelectiveAC, MemoryBudgetAC, no layer option) and NeMo AutoModel's
#: ``distributed.activation_checkpointing`` (a bool; later ``"selective"`` or ``"full"``)
NO_LAYER_COUNT = ("torchtitan", "automodel")


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


__all__ = ["NO_LAYER_COUNT", "layer_outputs_kept"]
