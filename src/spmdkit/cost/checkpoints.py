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
``checkpoint_wrapper`` as torchtitan wraps each block (9dec370, ``_apply_ac_to_transformer_block``),
or every N-th block under ``selective_ac_option = N`` (``every:N``, :func:`every_blocks`).
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
from collections.abc import Sequence

from spmdkit.core.errors import ProgramError
from spmdkit.cost.recompute_modules import MODULES, recompute_modules
from spmdkit.program.ir import Program

#: a number in a layer label (``layer 3``, ``model.layers.3``)
_LAYER_NUMBER = re.compile(r"\d+")


def layer_numbers(label: str) -> tuple[int, ...]:
    """The numbers of a layer label, in order (``layer 3`` -> (3,)); () for a label without one
    (the embedding, the head: no transformer layer)."""
    return tuple(int(n) for n in _LAYER_NUMBER.findall(label))


#: the recomputation modes besides ``full:K``, ``every:N``, ``selective:M1,M2`` and :data:`MICROBATCH`
RECOMPUTE = ("none", "selective", "full")

#: the frameworks whose activation checkpointing has no count of layers (``full:K`` refused):
#: torchtitan's ``[activation_checkpoint]`` (9dec370: ``mode`` none / selective / full, and
#: ``selective_ac_option = N`` wraps every N-th block, not the first K; HEAD b5bcd76: FullAC,
#: SelectiveAC, MemoryBudgetAC, no layer option) and NeMo AutoModel's
#: ``distributed.activation_checkpointing`` (a bool; later ``"selective"`` or ``"full"``)
NO_LAYER_COUNT = ("torchtitan", "automodel")

#: the frameworks that checkpoint every N-th block (``every:N``): torchtitan's layer-frequency
#: selective AC, ``mode = "selective"`` with ``selective_ac_option = "N"`` (torchtrain 0d415d7,
#: 2024-03-14, to its removal in 114151ad4, 2026-03-23). Megatron-Core's ``recompute_method`` is
#: ``uniform`` or ``block`` (transformer_config.py at d98e8a6), NeMo AutoModel's scope a set of
#: layer roles (``select_activation_checkpointing_layers``): neither has it
EVERY_FRAMEWORKS = ("torchtitan",)

#: what each other framework's whole-layer checkpointing has instead (the refusal's advice)
_WHOLE_LAYER_MODES = {"megatron": "full (--recompute-method uniform, 1 layer a unit) or full:K (--recompute-method "
                                  "block: the first K layers of each stage)",
                      "automodel": "full (every layer) or selective"}


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


def recompute_every(mode: str) -> int | None:
    """N of ``every:N`` (torchtitan's ``selective_ac_option = "N"``: every N-th transformer block
    of each pipeline rank checkpointed whole, :func:`every_blocks`), None for the other modes; a
    ProgramError naming ``--recompute`` where N is not an integer from 1."""
    if not (isinstance(mode, str) and mode.startswith("every:")):
        return None
    n = mode[6:]
    if not (n.isascii() and n.isdigit() and 1 <= len(n) <= 6):
        raise ProgramError(f"--recompute {mode[:40]!r}: expected every:N with N a whole number of blocks >= 1 "
                           f"(torchtitan's selective_ac_option = \"N\": every N-th block checkpointed)")
    if int(n) < 1:
        raise ProgramError(f"--recompute {mode[:40]!r}: N must be at least 1 (torchtitan's selective_ac_option = "
                           f"\"0\" checkpoints every block: give full)")
    return int(n)


def every_blocks(counts: Sequence[int], n: int) -> list[list[int]]:
    """The blocks ``every:N`` checkpoints on one process, by chunk: ``counts`` its model chunks'
    blocks in the order it builds them (one chunk without a pipeline; under torchtitan's looped
    pipeline schedules its stages ``r, r + p, ...``: ``stage_ids_this_rank(style="loop")``), the
    indices within each chunk. torchtitan 9dec370 ``_apply_ac_to_transformer_block`` counts every
    block it is given in one counter per process, never reset (``ptd_checkpoint_wrapper._count
    += 1``; from 0943771 the module global ``_layer_sac_count``), and wraps a block where
    ``count % N == 0``: the N-th, 2N-th ... block, 1-based, the count running on across chunks."""
    out: list[list[int]] = []
    count = 0
    for c in counts:
        out.append([i for i in range(c) if (count + i + 1) % n == 0])
        count += c
    return out


def whole_layers(mode: str) -> bool:
    """Whether ``mode`` checkpoints whole layers (``full``, ``full:K``, ``every:N``): what a
    checkpointed layer's output is read by outside it is kept (:func:`layer_outputs_kept`)."""
    return mode == "full" or recompute_layers(mode) is not None or recompute_every(mode) is not None


def check_recompute(mode: str, pipeline: bool = False, framework: str | None = None) -> str:
    """``mode`` if it is one of :data:`RECOMPUTE`, ``full:K`` (:func:`recompute_layers`; K is
    checked against the layers by :func:`recompute_regions`; refused under a ``framework`` of
    :data:`NO_LAYER_COUNT`), ``every:N`` (:func:`recompute_every`; refused under a ``framework``
    not of :data:`EVERY_FRAMEWORKS`) or, for a pipeline, :data:`MICROBATCH`, else a ProgramError
    naming ``--recompute``."""
    if recompute_every(mode) is not None:
        if framework is not None and framework not in EVERY_FRAMEWORKS:
            has = _WHOLE_LAYER_MODES.get(framework, "full")
            raise ProgramError(f"--recompute {mode} with --framework {framework}: {framework}'s activation "
                               f"checkpointing has no setting that checkpoints every N-th layer (torchtitan's "
                               f"selective_ac_option = N); it has {has}, or give --framework torchtitan")
        return mode
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
        raise ProgramError(f"--recompute {shown}: expected one of {', '.join((*RECOMPUTE, MICROBATCH))}, full:K, "
                           f"every:N or selective:M1,M2 (modules {', '.join(MODULES)})")
    return mode


def per_microbatch_mode(mode: str) -> str:
    """The recomputation of one microbatch's plan: ``selective`` for :data:`MICROBATCH` (its
    recomputed microbatches'), ``full`` for ``full:K`` and ``every:N`` (its recomputed layers'),
    else ``mode``."""
    if mode == MICROBATCH:
        return "selective"
    return "full" if recompute_layers(mode) is not None or recompute_every(mode) is not None else mode


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


__all__ = ["EVERY_FRAMEWORKS", "MICROBATCH", "NO_LAYER_COUNT", "RECOMPUTE", "check_recompute", "every_blocks", "layer_numbers",
           "layer_outputs_kept", "per_microbatch_mode", "recompute_every", "recompute_layers", "whole_layers"]
