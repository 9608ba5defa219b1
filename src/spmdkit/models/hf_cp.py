"""A HuggingFace model imported for context parallelism (``--hf ... --strategy ...,cp``; docs/context.md).

The zoo builds ``cp_attention`` itself; an imported model is traced so that it holds the same:

- the call's tokens in the order the cp ranks hold them (:func:`cp_order`: zig-zag, rank ``i``
  chunks ``i`` and ``2cp-1-i``), with ``position_ids`` of the positions they hold: HF's rotary
  embedding computes cos / sin from the ids (elementwise along the sequence), so each rank's
  share rotates by its own tokens' positions;
- the labels given shifted (``shift_labels``: token ``i`` predicts ``labels[i+1]``, the last
  ignored) before the permutation: HF's loss shifts ``labels`` along the sequence, which the
  permuted layout breaks; with ``shift_labels`` it takes them as they are (the mean over the
  counted tokens is the same);
- every causal sdpa without a mask lowered to ``cp_attention`` at those positions
  (:func:`spmdkit.models.torch_import.aten.attention.cp_sdpa`), so the step equals HF's on the
  tokens in order: torch eager runs the natural call (``ImportedProgram.eager_kwargs``).

What cannot be split by position alone is refused in one line naming the feature (:func:`check`):
a padded batch, a mask HF keeps (a sliding window shorter than the sequence, overlays), a
relative position bias, attention that is not sdpa, a model without ``position_ids``.
"""

from __future__ import annotations

import inspect
from typing import Any

from spmdkit.core.errors import ProgramError

#: the ignored label of HF's loss
IGNORE = -100


def cp_order(seq: int, cp: int, balance: str) -> list[int]:
    """The sequence's positions in the order the cp ranks hold the tokens: under ``zigzag``
    chunk 0, 2cp-1, 1, 2cp-2, ... of ``2 x cp``; else 0, 1, ... (as the zoo's
    :func:`spmdkit.models.zoo_layers.cp_order`)."""
    if cp <= 1 or balance != "zigzag":
        return list(range(seq))
    c = seq // (2 * cp)
    return [p for i in range(cp) for j in (i, 2 * cp - 1 - i) for p in range(j * c, (j + 1) * c)]


def cp_call(model: Any, kw: dict[str, Any], cp: tuple[int, str, str], pad: int) -> tuple[dict[str, Any], Any, Any]:
    """(the call traced under cp, the query positions, the key positions: ``[seq]`` int64) for the
    natural call ``kw`` of ``model`` (:func:`spmdkit.models.hf.example_inputs`); ``cp``: (ranks,
    variant, balance). ProgramError naming the flag or the model's feature where the call cannot
    be laid out so."""
    n, _variant, balance = cp
    name = type(model).__name__
    if pad:
        raise ProgramError(f"--pad {pad} with --strategy cp: a padded batch needs its padding mask, which context "
                           f"parallelism does not split (cp_attention masks by position only)")
    ids = kw.get("input_ids")
    if ids is None or getattr(model.config, "is_encoder_decoder", False):
        raise ProgramError(f"--strategy cp: {name} is not a decoder reading input_ids (context parallelism splits "
                           f"a causal language model's sequence)")
    try:
        takes = set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        takes = set()
    if "position_ids" not in takes:
        raise ProgramError(f"--strategy cp: {name} takes no position_ids (its positions cannot follow the "
                           f"tokens' zig-zag layout)")
    seq = int(ids.shape[1])
    chunks = 2 * n if balance == "zigzag" else n
    if seq % chunks:
        how = f"2 x cp = {chunks} chunks (the zig-zag balance)" if balance == "zigzag" else f"cp = {n} chunks"
        raise ProgramError(f"--mesh cp={n}: the sequence of {seq} tokens does not split into {how}")
    order = cp_order(seq, n, balance)
    pos = ids.new_tensor(order)
    got: dict[str, Any] = {"input_ids": ids[:, order], "position_ids": pos.unsqueeze(0).expand(ids.shape[0], -1)}
    if "attention_mask" in kw:  # all ones (unpadded): without it HF reads position_ids for packed sequences
        got["attention_mask"] = kw["attention_mask"][:, order]
    labels = kw.get("labels")
    if labels is not None:
        shifted = labels.new_full(labels.shape, IGNORE)
        shifted[:, :-1] = labels[:, 1:]
        got["shift_labels"] = shifted[:, order].contiguous()
        got["labels"] = got["shift_labels"].clone()  # HF computes the loss where labels are given
    return got, pos.clone(), pos.clone()


def check(prog: Any, model: Any, record: Any, masked: list[str]) -> None:
    """ProgramError naming the model's feature where the import under cp is not every attention
    a ``cp_attention`` (``record``: the trace's :class:`spmdkit.models.hf_attention.MaskRecord`;
    ``masked``: the sdpa calls :func:`cp_sdpa` lowered without cp)."""
    name = type(model).__name__
    why = list(record.kept) if record is not None else []
    if masked or why:
        what = "; ".join(why or list(dict.fromkeys(masked)))
        raise ProgramError(f"--strategy cp: {name}'s attention has {what}: context parallelism splits causal "
                           f"attention with no mask or bias only")
    if not any(op.rule == "cp_attention" for op in prog.ops):
        raise ProgramError(f"--strategy cp: {name}'s attention is its own eager code, not causal sdpa (no attention "
                           f"to split over cp)")


__all__ = ["IGNORE", "check", "cp_call", "cp_order"]
