"""HuggingFace attention imported as the zoo's causal ``flash_attention``: no ``[seq, seq]`` mask.

A transformers model with ``attn_implementation="sdpa"`` builds its attention mask in
``masking_utils`` and hands it to ``torch.nn.functional.scaled_dot_product_attention``. In eager
mode HF skips the mask when it is a plain causal (or, for an encoder, an all-ones) pattern and
calls sdpa with ``is_causal``; under ``torch.export`` it never skips (an exported program may be
called later with padded inputs), so the traced step carries a ``[batch, 1, seq, seq]`` boolean
mask, the importer spells attention out around it (scores, mask, softmax: ``seq x seq`` tensors
per head) and the plan's activations grow with seq^2 (the ``--hf`` Llama-3.1-405B at seq 8192:
836.8 GiB against the catalog's 178.0 GiB).

spmdkit imports one step on the example inputs it made itself, so it knows whether they are
padded. :func:`unmasked_attention` (used by :func:`spmdkit.models.hf.import_hf` while it traces
an unpadded step) replaces, for the duration of the trace only, the ``sdpa`` entry of
transformers' ``AttentionMaskInterface`` by :func:`_mask`: the test of HF's own eager skip
(``_ignore_causal_mask_sdpa`` / ``_ignore_bidirectional_mask_sdpa``) with the padding known to be
absent instead of read. Where HF would skip, no mask is built, sdpa runs with ``is_causal`` and the
importer lowers it to one ``flash_attention(causal=True)``, the op and rule the zoo emits
(:func:`spmdkit.models.zoo_layers.flash`). A model may ask for its mask to be built whatever
(``create_causal_mask(..., allow_is_causal_skip=False)``: Falcon, "so alibi can be added onto it",
and without ALiBi hands it unchanged to attention). Such a mask is built; where it is the pattern
HF's skip test accepts (made of ``masking_utils.causal_mask_function`` itself, no overlay, packing,
window or cache offset) and an ``sdpa`` call is handed that very tensor, unchanged since (its
version counter), the call runs with no mask and ``is_causal``: the same skip, taken at the call.
A mask the model changed (Falcon's ALiBi ``masked_fill`` makes a new tensor) is read as before.
Where the causal op cannot express the pattern, the mask is built as before and
:class:`MaskRecord` says why (a plan note):

- sliding-window attention with a window shorter than the sequence (Mistral with
  ``sliding_window < seq``, Gemma-2/3's local layers): the window is in the mask;
- a mask with overlays (image-token blocks, packed sequences, chunked attention);
- attention that is not sdpa: the model's own eager code (BLOOM's ALiBi through ``baddbmm``,
  Gemma-2's soft-capping, GPT-2's eager path) builds and reads its mask itself; it is untouched.

The ``sdpa`` entry of ``AttentionInterface`` is wrapped too, only to count its calls: a model that
was handed no mask but never called sdpa (its attention reads the mask in its own code) would
attend everywhere, so :attr:`MaskRecord.unsafe` tells ``import_hf`` to trace again with the mask.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass
class MaskRecord:
    """What the masks of one trace became."""

    #: masks not built (HF's sdpa skip, the padding known absent): attention is causal sdpa
    skipped: int = 0
    #: ``sdpa`` calls handed a plain causal mask of :attr:`built` that ran causal without it
    dropped: int = 0
    #: why a mask was built anyway, once each (``"sliding window 4096 < seq 8192"``)
    kept: list[str] = field(default_factory=list)
    #: calls of the ``sdpa`` attention function
    sdpa_calls: int = 0
    #: the masks built (mask, why, plain), and those an ``sdpa`` call was handed: a mask no attention
    #: reads (Qwen2-MoE builds a sliding-window mask of window 0 beside the causal one, and every
    #: layer is full attention) is no reason; :meth:`settle` keeps the reasons of the masks read.
    #: ``plain``: for a mask the model asked to have built (``allow_is_causal_skip=False``) that is
    #: the plain causal pattern HF would skip, its version counter when built (handed unchanged to
    #: an ``sdpa`` call, that call runs causal with no mask: :func:`_counted`), else None
    built: list[tuple[Any, str, int | None]] = field(default_factory=list)
    read: list[Any] = field(default_factory=list)

    @property
    def unsafe(self) -> bool:
        """A mask was skipped but no attention went through sdpa: the model reads the (absent)
        mask in code of its own, so the trace must keep it."""
        return self.skipped > 0 and self.sdpa_calls == 0

    def keep(self, why: str) -> None:
        if why not in self.kept:
            self.kept.append(why)

    def settle(self) -> None:
        """The built masks' reasons into :attr:`kept`: those of the masks an sdpa call read, or all
        of them where no call went through sdpa or one read a mask that is none of them (the model
        changed it: a bias added, a slice taken)."""
        mine = [why for m, why, _v in self.built if any(m is r for r in self.read)]
        if not self.sdpa_calls or any(not any(r is m for m, _why, _v in self.built) for r in self.read):
            mine = [why for _m, why, _v in self.built]
        for why in mine:
            self.keep(why)


def _skip_reason(kv_length: int, q_length: int, q_offset: Any, local_size: int | None, causal_skip: bool,
                 bidirectional_skip: bool) -> str | None:
    """None where HF's sdpa would skip the mask of an unpadded batch in eager mode, else why not."""
    if not isinstance(q_offset, int) or not isinstance(kv_length, int):
        return "a mask over a cache (an offset HF reads at run time)"
    if not (causal_skip or bidirectional_skip):
        return "a mask the model builds in full (HF builds it so for a bias such as ALiBi, overlays or packed sequences)"
    if local_size is not None and kv_length >= local_size:
        return f"sliding window {local_size} <= seq {kv_length}"
    if bidirectional_skip:
        return None
    if q_length == 1 or kv_length == q_length or (isinstance(q_offset, int) and q_offset == 0):
        return None
    return f"a causal mask of {q_length} queries over {kv_length} keys at offset {q_offset}"


def _causal_mask_fn(record: MaskRecord, hf_mask: Any, causal_fn: Any) -> Any:
    """HF's ``sdpa`` mask function ``hf_mask`` skipping where HF's eager mode would. A mask the
    model asks to have built (``allow_is_causal_skip=False``: Falcon, to add ALiBi onto it) is
    built, and recorded in :attr:`MaskRecord.built` as plain where it is the causal pattern HF's
    eager sdpa skips (``_ignore_causal_mask_sdpa`` on an unpadded batch): made of
    ``masking_utils.causal_mask_function`` itself, ``causal_fn`` (``create_causal_mask`` wraps
    it for overlays, packed sequences or blocks; a window or chunks are other functions), no
    window, no cache offset."""

    def mask(batch_size: int, q_length: int, kv_length: int, q_offset: Any = 0, kv_offset: Any = 0,
             *args: Any, local_size: int | None = None, allow_is_causal_skip: bool = True,
             allow_is_bidirectional_skip: bool = False, **kwargs: Any) -> Any:
        why = _skip_reason(kv_length, q_length, q_offset, local_size, allow_is_causal_skip,
                           allow_is_bidirectional_skip)
        if why is None:
            record.skipped += 1
            return None
        made = hf_mask(batch_size, q_length, kv_length, q_offset, kv_offset, *args, local_size=local_size,
                       allow_is_causal_skip=allow_is_causal_skip,
                       allow_is_bidirectional_skip=allow_is_bidirectional_skip, **kwargs)
        fn = kwargs.get("mask_function", args[0] if args else None)
        plain = made is not None and fn is causal_fn and not allow_is_bidirectional_skip and _skip_reason(
            kv_length, q_length, q_offset, local_size, True, False) is None
        record.built.append((made, why, made._version if plain else None))
        return made

    return mask


def _counted(record: MaskRecord, fn: Any) -> Any:
    def attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, *args: Any, **kwargs: Any) -> Any:
        record.sdpa_calls += 1
        if attention_mask is not None and kwargs.get("position_bias") is None and any(
                attention_mask is m and v is not None and attention_mask._version == v
                for m, _why, v in record.built):
            # the plain causal mask, unchanged since built: HF's sdpa skip, taken at the call
            record.dropped += 1
            attention_mask, kwargs = None, {**kwargs, "is_causal": True}
        if attention_mask is not None:
            record.read.append(attention_mask)
        if kwargs.get("position_bias") is not None:
            record.keep("a relative position bias added to the scores")
        return fn(module, query, key, value, attention_mask, *args, **kwargs)

    return attention


@contextlib.contextmanager
def _local(interface: Any, key: str, value: Any) -> Iterator[None]:
    """``interface[key] = value`` (a GeneralInterface's local override) for the block."""
    had = key in interface._local_mapping
    old = interface._local_mapping.get(key)
    interface[key] = value
    try:
        yield
    finally:
        if had:
            interface._local_mapping[key] = old
        else:
            del interface._local_mapping[key]


@contextlib.contextmanager
def unmasked_attention() -> Iterator[MaskRecord]:
    """While tracing a step whose inputs carry no padding: HF's sdpa masks skipped where HF's
    eager mode would skip them (module docstring); yields the :class:`MaskRecord`."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, causal_mask_function
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    record = MaskRecord()
    with _local(ALL_MASK_ATTENTION_FUNCTIONS, "sdpa", _causal_mask_fn(record, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"], causal_mask_function)), \
            _local(ALL_ATTENTION_FUNCTIONS, "sdpa", _counted(record, ALL_ATTENTION_FUNCTIONS["sdpa"])):
        try:
            yield record
        finally:
            record.settle()


def square_tensors(prog: Any, seq: int) -> list[str]:
    """The tensors of ``prog`` with two axes of size ``seq`` (an attention mask or its scores),
    forward ones, by name."""
    backward = {n for op in prog.ops if op.phase != "forward" for n in op.output_names()}
    return [n for n, t in prog.tensors.items() if sum(1 for d in t.shape if d == seq) >= 2 and n not in backward
            and t.kind in ("activation", "input")]


def spelt_out_attention(prog: Any, seq: int) -> list[str]:
    """The forward softmaxes of ``prog`` over ``[..., seq, seq]`` scores (attention spelt out with
    its mask, not one ``flash_attention``), by output name."""
    made = {n: op for op in prog.ops if op.phase == "forward" for n in op.output_names()}
    got = []
    for op in prog.ops:
        if op.phase == "forward" and op.rule == "softmax":
            x = prog.tensors[op.input_names()[0]]
            if len(x.shape) >= 3 and tuple(x.shape[-2:]) == (seq, seq) and not _of_a_weight(prog, made, op):
                got.extend(op.output_names()[:1])
    return got


def _of_a_weight(prog: Any, made: dict[str, Any], softmax: Any) -> bool:
    """The softmax's scores come from a matmul with a parameter (a MoE router's ``[batch, seq,
    experts]`` logits, whose last two axes are ``[seq, seq]`` where the experts equal seq), not
    from q and k; through the elementwise ops between (scale, mask, cast, soft-cap)."""
    name = softmax.input_names()[0]
    for _ in range(16):
        op = made.get(name)
        if op is None:
            return False
        if op.rule == "matmul":
            return any(prog.tensors[n].kind == "parameter" for n in op.input_names())
        names = [n for n in op.input_names() if tuple(prog.tensors[n].shape) == tuple(prog.tensors[name].shape)]
        if not names:
            return False
        name = names[0]
    return False


def attention_note(record: MaskRecord | None, prog: Any, seq: int, padded: bool) -> str:
    """The plan note of an import whose attention is spelt out with a ``[seq, seq]`` mask
    (empty when every attention is one ``flash_attention``)."""
    spelt = spelt_out_attention(prog, seq)
    if not spelt or seq < 2:
        return ""
    if padded:
        why = "the example inputs are padded"
    elif record is not None and record.kept:
        why = "; ".join(record.kept)
    elif record is not None and record.unsafe:
        why = "the model's attention reads its mask in code of its own, not through sdpa"
    else:
        why = "the model's attention is its own eager code, not sdpa (ALiBi, soft-capping, its own masking)"
    return (f"note: {len(spelt)} attention(s) spelt out with an explicit [{seq}, {seq}] mask and scores ({why}); "
            f"the causal flash_attention op cannot express them, and their memory grows with seq^2")


__all__ = ["MaskRecord", "attention_note", "spelt_out_attention", "square_tensors", "unmasked_attention"]
