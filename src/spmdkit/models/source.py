"""Where a model comes from, and :func:`load`: one way from a preset, a program file or a
HuggingFace model to the program a command plans.

A :data:`ModelSource` is one of :class:`Preset` (a zoo preset of :mod:`spmdkit.models.zoo`,
its sizes optionally overridden), :class:`ProgramFile` (a program JSON file, docs/graph.md)
or :class:`HFModel` (a HuggingFace ``transformers`` class built from its config and imported
by :mod:`spmdkit.models.hf`). The command line checks its flags into one (each command names
its own flags in its messages); ``spmdkit plan`` and ``spmdkit run`` then load it here alike.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, replace
from typing import Any

from spmdkit.core.errors import ProgramError, SpmdError
from spmdkit.models.hf import dtype_name, import_hf, load_config, pad_vocab_config, padded_vocab_size
from spmdkit.models.zoo import Model, ModelConfig, build_model, model_label, preset
from spmdkit.program.ir import Program, load_program


@dataclass(frozen=True)
class Preset:
    """A zoo preset by name; ``layers`` / ``batch`` / ``seq`` override its sizes when given."""

    name: str
    layers: int | None = None
    batch: int | None = None
    seq: int | None = None
    #: ``--make-vocab-size-divisible-by N``: the vocabulary padded to a multiple of N x tp when planned
    #: (:func:`pad_vocab`); None: as the config says
    vocab_divisible_by: int | None = None
    #: (the config's vocabulary, the padded one, N, tp) once padded (:func:`pad_vocab`): the padded
    #: one overrides the config's
    vocab_padding: tuple[int, int, int, int] | None = None

    @property
    def vocab(self) -> int | None:
        """The padded vocabulary, None where not padded."""
        return self.vocab_padding[1] if self.vocab_padding is not None else None

    def overrides(self) -> dict[str, int | None]:
        got = {"layers": self.layers, "batch": self.batch, "seq": self.seq}
        return {**got, "vocab": self.vocab} if self.vocab is not None else got

    def config(self) -> ModelConfig:
        """The preset's config with the given sizes; ProgramError naming ``--model`` for an
        unknown name."""
        return preset(self.name).with_(**{k: v for k, v in self.overrides().items() if v is not None})


@dataclass(frozen=True)
class ProgramFile:
    """A program JSON file (docs/graph.md)."""

    path: str


@dataclass(frozen=True)
class HFModel:
    """A HuggingFace model: its class, its config (a config.json path or a JSON object text),
    its dtype (a name :func:`spmdkit.models.hf.dtype_name` gave) and the example batch it is
    traced at; ``weights``: build its weights (True: ``spmdkit run`` runs it), import it without
    them (False), or by its size (None: :data:`spmdkit.models.hf.WEIGHTS_UP_TO`)."""

    class_name: str
    config: str
    dtype: str = "float32"
    batch: int = 2
    seq: int = 16
    weights: bool | None = None
    #: ``"error"`` (an ATen op with no lowering refuses the import) or ``"replicate"`` (``--fallback
    #: replicate``: it becomes a replicated op, named in the title's warning line)
    fallback: str = "error"
    #: padded positions at the end of the example batch's last row (``spmdkit run --pad``): the
    #: step is then traced with HF's padding mask (unpadded, attention is one causal flash op)
    pad: int = 0
    #: context parallelism's (ranks, variant, balance): the step traced in the cp ranks' token
    #: order with cp_attention (:mod:`spmdkit.models.hf_cp`); None without cp
    cp: tuple[int, str, str] | None = None
    #: each sequence (each cp share) routed in this many chunks more, one a tp rank (``--strategy
    #: megatron,sp,ep,etp=1``: :func:`spmdkit.strategies.experts.tp_chunks`); 1: not
    tp_chunks: int = 1
    #: ``--make-vocab-size-divisible-by N``: the config's vocabulary padded to a multiple of N x tp
    #: when planned (:func:`pad_vocab`); None: as the config says
    vocab_divisible_by: int | None = None
    #: (the config's vocabulary, the padded one, N, tp) once padded: ``config`` then holds the padded
    #: vocab_size, and the example tokens and labels are drawn below the config's
    vocab_padding: tuple[int, int, int, int] | None = None


ModelSource = Preset | ProgramFile | HFModel


@dataclass(frozen=True)
class Loaded:
    """A loaded model: its program and a title naming it; for a preset the zoo model too (its
    config, the roles its strategies read, its optimizer), for a HuggingFace model the torch
    module and the keyword inputs of the call its program was traced from."""

    source: ModelSource
    program: Program
    title: str
    model: Model | None = None
    module: Any = None
    inputs: dict[str, Any] | None = None


_POSITIONS = {"rope": "rotary positions", "learned": "learned positions", "alibi": "ALiBi", "none": "no positions"}


def _moe(c: ModelConfig) -> list[str]:
    """A MoE config's experts: ``8 experts top-2``, each expert's FFN where it is not ``ffn``,
    the shared experts, the dense layers first and the capacity factor where given."""
    if not c.experts:
        return []
    got = [f"{c.experts} experts top-{c.top_k}"]
    got += [f"expert FFN {c.moe_ffn}"] if c.moe_ffn is not None and c.moe_ffn != c.ffn else []
    got += [f"{c.shared_experts} shared"] if c.shared_experts else []
    got += [f"{c.dense_layers} dense layer{'s' if c.dense_layers > 1 else ''} first"] if c.dense_layers else []
    return got + ([f"capacity factor {c.capacity_factor:g}"] if c.capacity_factor is not None else [])


def _mla(c: ModelConfig) -> list[str]:
    """MLA's ranks and head sizes: ``MLA kv rank 512, q rank 1536, qk head 128+64 rope, v head 128``."""
    if not c.mla:
        return []
    return [f"MLA kv rank {c.kv_lora_rank}"] + ([f"q rank {c.q_lora_rank}"] if c.q_lora_rank else []) \
        + [f"qk head {c.hdim}+{c.qk_rope_head_dim} rope", f"v head {c.vdim}"]


def variants(c: ModelConfig) -> list[str]:
    """A config's variants beside its arch's defaults, in words: ``["squared_relu", "flash
    attention", "tied embeddings"]``, ``["8 experts top-2", "1 shared", "3 dense layers first",
    "MLA kv rank 512", ...]``; empty for a config of the arch's defaults."""
    base = ModelConfig(c.arch)
    got = ([c.act] if c.act != base.act else []) + ([f"{c.attn} attention"] if c.attn != base.attn else [])
    if not c.mla and (c.head_dim is not None and c.head_dim * c.heads != c.hidden):
        got.append(f"head dim {c.head_dim}")
    got += [f"{'RMS' if c.nrm == 'rms' else 'layer'} norm"] if c.nrm != base.nrm else []
    got += [_POSITIONS.get(c.pos, f"{c.pos} positions")] if c.pos != base.pos else []
    got += [n for n, on in (("q/k/v biases", c.qkv_bias and not c.linear_bias), ("linear biases", c.linear_bias),
                            ("embedding norm", c.embed_norm), ("tied embeddings", c.tied_embeddings)) if on]
    got += [f"dropout {c.dropout:g}"] if c.dropout else []
    return got + _moe(c) + _mla(c)


def _variants(c: ModelConfig) -> str:
    got = variants(c)
    return f" ({', '.join(got)})" if got else ""


def preset_title(name: str, c: ModelConfig) -> str:
    """A preset's description: ``llama-7b: llama, 32 layers, hidden 4096, ...``."""
    return (f"{model_label(name)}: {c.arch}{_variants(c)}, {c.layers} layers, hidden {c.hidden}, {c.heads} heads"
            f"{f' ({c.n_kv} kv)' if c.n_kv != c.heads else ''}, FFN {c.ffn}, vocab {c.vocab}, "
            f"seq {c.seq}, batch {c.batch}, {c.dtype}")


def hf_title(source: HFModel, prog: Program | None = None) -> str:
    """``CLASS (HuggingFace), batch B, seq S``; with ``--fallback replicate`` and ops replicated
    for want of a lowering, a second line warning of them (the report's first lines)."""
    title = f"{source.class_name} (HuggingFace), batch {source.batch}, seq {source.seq}, {source.dtype}"
    own = config_dtype(source.config)
    if own is not None and own != source.dtype:
        title += (f"\nnote: the config's torch_dtype is {own}; the model is planned in {source.dtype} (--dtype "
                  f"{own} plans it as the config says)")
    note = moe_note(prog) if prog is not None else ""
    if note:
        title += "\n" + note
    if source.vocab_padding is not None:
        title += "\n" + vocab_note(*source.vocab_padding)
    fell = fallback_ops(prog) if prog is not None else []
    for note in getattr(prog, "notes", ()):
        title += "\n" + note
    if fell:
        title += (f"\nwarning: --fallback replicate: {len(fell)} op(s) with no lowering imported replicated (every "
                  f"input and output replicated on every rank): {'; '.join(fell)}")
    return title


def vocab_note(vocab: int, padded: int, divisible_by: int, tp: int) -> str:
    """The report's line on a padded vocabulary (``--make-vocab-size-divisible-by``)."""
    how = f"Megatron --make-vocab-size-divisible-by {divisible_by} x tp {tp}"
    if padded == vocab:
        return f"note: vocabulary {vocab}, a multiple of {divisible_by * tp} already ({how}): not padded"
    return (f"note: vocabulary {vocab} padded to {padded} ({how}): {padded - vocab} more rows in the embedding and "
            f"the output layer, their logits in the softmax, never a token or a target")


def pad_vocab(source: ModelSource, tp: int) -> ModelSource:
    """``source`` with its vocabulary padded as Megatron-LM pads it for ``tp`` tensor-parallel ranks
    (:func:`spmdkit.models.hf.padded_vocab_size`) where ``--make-vocab-size-divisible-by`` asked for it
    (its ``vocab_divisible_by``); unchanged otherwise, or once padded."""
    if isinstance(source, HFModel) and source.vocab_divisible_by and source.vocab_padding is None:
        n = source.vocab_divisible_by
        cfg, vocab, padded = pad_vocab_config(source.class_name, source.config, n, tp)
        return replace(source, config=json.dumps(cfg), vocab_padding=(vocab, padded, n, tp))
    if isinstance(source, Preset) and source.vocab_divisible_by and source.vocab_padding is None:
        n, vocab = source.vocab_divisible_by, source.config().vocab
        return replace(source, vocab_padding=(vocab, padded_vocab_size(vocab, n, tp), n, tp))
    return source


def padding_note(source: ModelSource) -> str | None:
    """:func:`vocab_note` of a source :func:`pad_vocab` padded, else None."""
    got = getattr(source, "vocab_padding", None)
    return vocab_note(*got) if got is not None else None


def config_dtype(config: Any) -> str | None:
    """The dtype a config.json says its weights are in (``torch_dtype``, or transformers 5's
    ``dtype``), as :func:`spmdkit.models.hf.dtype_name` names it; None where it says none or one
    spmdkit does not take."""
    try:
        cfg = load_config(config)
        said = cfg.get("torch_dtype", cfg.get("dtype"))
        return dtype_name(said) if isinstance(said, str) else None
    except ProgramError:
        return None


def moe_note(prog: Program) -> str:
    """A line on the MoE blocks of an imported program (:mod:`spmdkit.models.torch_import.moe`):
    how many were lowered to the moe ops, their routing, each expert's capacity, and what the
    plan writes down otherwise than HF computes it; empty without any."""
    blocks = list(getattr(prog, "moe_blocks", []) or [])
    if not blocks:
        return ""
    caps = sorted({int(op.attrs.get("capacity", 0)) for op in prog.ops if op.rule == "moe_gate_dispatch"})
    x = next((prog.tensors[op.input_names()[0]].shape for op in prog.ops if op.rule == "moe_gate_dispatch"), (0, 0))
    seq = x[-2]
    b = blocks[0]
    how = "dropless" if caps == [seq] else f"{seq} tokens x top {b.top_k} / {b.num_experts} experts"
    by = getattr(prog, "moe_chunks_by", "") or "cp"
    each = "a sequence" if len(x) < 4 else f"a chunk (each sequence routed in {x[1]} chunks, one a {by} rank)"
    line = (f"note: MoE: {len(blocks)} block(s) lowered to moe_gate_dispatch -> experts [E, in, out] -> "
            f"moe_combine ({b.num_experts} experts, top {b.top_k}; {b.routing.describe()}); capacity "
            f"{', '.join(map(str, caps))} tokens an expert {each} ({how})")
    r = b.routing
    if r.groups > 1 and r.topk_group < r.groups:
        line += ("; the group-limited top-k is planned as a top-k over every expert (the same shapes, FLOPs "
                 "and collectives; the experts chosen can differ)")
    return line


def fallback_ops(prog: Program) -> list[str]:
    """The ATen ops an imported program holds as replicated fallbacks (``aten.hardswish.default
    at model.py:12``), forward ones only, once each."""
    fb = getattr(prog, "fallbacks", {}) or {}
    origins = getattr(prog, "origins", {}) or {}
    got = [str(origins.get(i, f"op {i}")) for i in sorted(fb) if prog.ops[i].phase == "forward"]
    return list(dict.fromkeys(got))


def import_hf_checked(class_name: str, config: Any, batch: int, seq: int, dtype: str,
                      weights: bool | None = None, fallback: str = "error",
                      pad: int = 0, cp: tuple[int, str, str] | None = None,
                      tp_chunks: int = 1, vocab: int | None = None) -> tuple[Program, Any, dict[str, Any]]:
    """:func:`spmdkit.models.hf.import_hf` (``dtype`` a dtype name), its errors on a model that does not
    import given as one ProgramError naming ``--hf``. ``weights``: as ``import_hf``'s; by default
    a small model is built with its weights (``spmdkit run`` runs it) and a larger one is imported
    without them, its layers traced once per kind and repeated (any size plans)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.filterwarnings("ignore", message="torch import: no mapping")  # the title names them
        try:
            return import_hf(class_name, config, batch=batch, seq=seq, dtype=dtype, weights=weights,
                             fallback=fallback, pad=pad, cp=cp, tp_chunks=tp_chunks, vocab=vocab)
        except SpmdError:
            raise
        except (ValueError, TypeError, RuntimeError, IndexError, KeyError) as exc:
            msg = " ".join(str(exc).split())[:300]
            raise ProgramError(f"--hf {class_name}: the model does not import: {type(exc).__name__}: {msg}") from None


def load_preset(source: Preset, config: ModelConfig, vocab_parallel_loss: bool = False) -> Loaded:
    """A preset built from ``config`` (its sizes applied; the loss vocab-parallel when asked: the
    rule then also takes the class axis whole), with its title."""
    model = build_model(config, vocab_parallel_loss=vocab_parallel_loss, check_rules=False)
    return Loaded(source, model.program, preset_title(source.name, config), model=model)


def load(source: ModelSource, *, vocab_parallel_loss: bool = False) -> Loaded:
    """The program of ``source``: a preset built (its loss vocab-parallel when asked: the rule
    then also takes the class axis whole), a program file read and validated, a HuggingFace
    model built and its training step imported."""
    if isinstance(source, Preset):
        return load_preset(source, source.config(), vocab_parallel_loss)
    if isinstance(source, ProgramFile):
        return Loaded(source, load_program(source.path), f"program {source.path}")
    vocab = source.vocab_padding[0] if source.vocab_padding is not None else None
    prog, module, kw = import_hf_checked(source.class_name, source.config, source.batch, source.seq, source.dtype,
                                         source.weights, source.fallback, source.pad, source.cp, source.tp_chunks, vocab)
    prog.vocab_padding = source.vocab_padding  # the exports state it
    return Loaded(source, prog, hf_title(source, prog), module=module, inputs=kw)


__all__ = ["HFModel", "Loaded", "ModelSource", "Preset", "ProgramFile", "fallback_ops", "hf_title", "import_hf_checked",
           "moe_note",
           "load", "load_preset", "pad_vocab", "padding_note", "vocab_note", "preset_title", "variants"]
