"""An HF config checked before its model is built (:func:`check_hf_config`, called by
:func:`spmdkit.models.hf.build`): every way a config can be bad is one ProgramError naming the
key, never a traceback from deep in transformers and never a silently different model.

- **The size keys are required**: the hidden size, the layers, the attention heads, the
  vocabulary and the MLP's hidden size, spelled as the class spells them (``hidden_size`` /
  ``n_embd`` / ``d_model``, ``num_hidden_layers`` / ``n_layer``, ``num_attention_heads`` /
  ``n_head``, ``vocab_size``, ``intermediate_size`` / ``ffn_dim`` / ``d_ff`` ...), where the
  class has one with a fixed default: a key left out would take HF's default (Llama's 4096
  hidden, 32 layers) without a word. A key whose default is derived (GPT-2's ``n_inner``:
  4 x hidden; ``num_key_value_heads``: the heads) may be left out. A published ``config.json``
  always has them.
- **Sizes are integers >= 1** (0 where the class's own default is 0; ``null`` where it is
  ``null``), not floats, strings or booleans, below :data:`MAX_SIZE`.
- **Heads divide the hidden size** (unless the class has an explicit head size, ``head_dim``
  or T5's ``d_kv``) and **kv heads divide the heads**; the padding token is in the vocabulary,
  the experts per token at most the experts, a rotary head size even.
- **A key the class does not know** (nor the model's modeling module reads: Qwen3-MoE's
  ``head_dim`` is no argument of its config class, but its attention reads it) that is close to
  one it knows (``num_attention_head``) is an error naming both; any other unknown key is a
  warning naming it (a UserWarning starting ``--hf-config``, printed by the CLI as one
  ``warning:`` line): it changes nothing in the model.
  Keys every published ``config.json`` carries (:data:`METADATA`) are neither.
- Whatever the config class still rejects is one line naming the class.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import re
import sys
import warnings
from collections.abc import Mapping
from typing import Any, TypeGuard

from spmdkit.core.errors import ProgramError

#: The largest size a key may have (2**31 - 1).
MAX_SIZE = (1 << 31) - 1

#: The most layers a stack may have (the largest published models have 61 to 126; each layer
#: is built and imported, so a million would run for hours instead of being refused).
MAX_LAYERS = 1024
LAYER_KEYS = ("num_hidden_layers", "encoder_layers", "decoder_layers", "num_decoder_layers")

#: The canonical size keys (the names ``attribute_map`` maps), required where the class has them
#: with a fixed default.
REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")

#: The MLP's hidden size, by the names classes give it: the first the class has is required.
FFN_KEYS = ("intermediate_size", "n_inner", "ffn_dim", "d_ff", "ffn_hidden_size", "hidden_dim", "encoder_ffn_dim")

#: Further keys required where the class has them with a fixed default (an encoder-decoder's
#: second stack).
REQUIRED_MORE = ("decoder_ffn_dim", "decoder_layers", "decoder_attention_heads")

#: Keys checked as sizes wherever they appear (integers >= 1, or 0 / null where the class's
#: default is): the required ones and the optional sizes.
SIZES = (*REQUIRED, *FFN_KEYS, *REQUIRED_MORE, "head_dim", "num_key_value_heads", "num_kv_heads",
         "max_position_embeddings", "num_decoder_layers", "encoder_layers", "encoder_attention_heads",
         "moe_intermediate_size", "num_local_experts", "num_experts", "n_routed_experts", "num_experts_per_tok",
         "n_shared_experts", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
         "first_k_dense_replace", "type_vocab_size")

#: Keys a published config.json carries that are no model size: never reported as unknown.
METADATA = frozenset((
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "_name_or_path", "auto_map",
    "quantization_config", "task_specific_params", "rope_theta", "rope_scaling", "rope_parameters", "use_cache",
    "_attn_implementation", "attn_implementation", "gradient_checkpointing", "tokenizer_class", "prefix",
    "finetuning_task", "decoder_start_token_id", "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id",
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "temperature", "top_k", "top_p",
    "repetition_penalty", "length_penalty", "no_repeat_ngram_size", "num_return_sequences", "output_past",
    "torchscript", "use_bfloat16", "pruned_heads", "tie_encoder_decoder", "is_decoder", "add_cross_attention",
    "cross_attention_hidden_size", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
    "begin_suppress_tokens", "bad_words_ids", "diversity_penalty", "num_beam_groups", "typical_p",
    "encoder_no_repeat_ngram_size", "chunk_size_feed_forward", "id2label", "label2id", "num_labels",
    "problem_type", "return_dict", "output_attentions", "output_hidden_states", "tf_legacy_loss",
    "use_return_dict", "initializer_range", "name_or_path", "n_ctx", "cache_implementation",
))

#: Older spellings a class still reads from its keyword arguments (BLOOM's published config.json
#: says ``n_embed``), by ``model_type``: legacy key -> the class's key.
LEGACY = {"bloom": {"n_embed": "hidden_size"}}

#: An unknown key this close to a known one (difflib's ratio) is taken for a typo of it.
TYPO_RATIO = 0.85


def _is_int(v: Any) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def _init_defaults(cls: type) -> dict[str, Any]:
    """The keyword parameters of ``cls.__init__`` and its bases' with their defaults (a config
    class takes its fields there; a default it derives at init, Llama's ``head_dim``, is
    ``None`` here), the most derived class's first."""
    out: dict[str, Any] = {}
    for c in cls.__mro__:
        init = c.__dict__.get("__init__")
        if init is None:
            continue
        try:
            params = inspect.signature(init).parameters.values()
        except (TypeError, ValueError):
            continue
        for p in params:
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self":
                out.setdefault(p.name, None if p.default is p.empty else p.default)
    return out


def _read_by_model(model_cls: type | None) -> frozenset[str]:
    """The config keys the model's modeling module reads (``config.KEY``, ``getattr(config, "KEY"``):
    a key its config class does not declare still shapes the model there (Qwen3-MoE's ``head_dim``:
    ``getattr(config, "head_dim", hidden_size // num_attention_heads)`` in its attention)."""
    module = inspect.getmodule(model_cls) if model_cls is not None else None
    if module is None:
        return frozenset()
    return _keys_read_by(module.__name__, getattr(module, "__file__", None))


@functools.cache
def _keys_read_by(name: str, path: str | None) -> frozenset[str]:
    """:func:`_read_by_model` of the module ``name`` (its file ``path``), read and scanned once a
    process (a module's source does not change within one; ``--devices`` checks the config once a
    cp layout, each ``--hf`` import once a model)."""
    module = sys.modules.get(name)
    try:
        src = inspect.getsource(module) if module is not None else ""
    except (OSError, TypeError):
        return frozenset()
    return frozenset(re.findall(r"\bconfig\.(\w+)", src)) \
        | frozenset(re.findall(r"getattr\(\s*(?:self\.)?config,\s*[\"'](\w+)", src))


def _read_from_kwargs(cfg_cls: type) -> set[str]:
    """The keys a config class reads from its extra keyword arguments (``kwargs.get("KEY"`` /
    ``kwargs.pop("KEY"``): older spellings it still honours, Gemma 3's
    ``sliding_window_pattern`` (its published config.json has it; the class sets
    ``_sliding_window_pattern`` and the layer types from it)."""
    found: set[str] = set()
    for c in cfg_cls.__mro__:
        module = inspect.getmodule(c)
        if module is None or not module.__name__.startswith("transformers.models."):
            continue
        try:
            src = inspect.getsource(c)
        except (OSError, TypeError):
            continue
        found |= set(re.findall(r"\bkwargs\.(?:get|pop)\(\s*[\"'](\w+)[\"']", src))
    return found


def _nullable(cfg_cls: type, model_cls: type | None) -> set[str]:
    """The fields a config class annotates as taking ``None`` and that its own code or the
    model's modeling module tests against ``None`` (``q_lora_rank: int | None = 1536`` and
    ``if self.q_lora_rank is not None``: DeepSeek-V2's default is a size, but null is a model it
    builds, V2-Lite's query projection without a low-rank compression). An annotation alone is
    not enough: BART annotates ``d_model: int | None`` and builds nothing from a null one."""
    texts = []
    for obj in (cfg_cls, inspect.getmodule(model_cls) if model_cls is not None else None):
        try:
            texts.append(inspect.getsource(obj) if obj is not None else "")
        except (OSError, TypeError):
            continue
    out: set[str] = set()
    for c in cfg_cls.__mro__:
        for k, ann in inspect.get_annotations(c).items():
            text = ann if isinstance(ann, str) else repr(ann)
            if re.search(r"\bNone\b|Optional\[", text) and \
                    any(re.search(rf"\b{re.escape(k)}\s+is\s+(?:not\s+)?None\b", t) for t in texts):
                out.add(k)
    return out


class _Schema:
    """What a config class knows: its keys with their defaults, its aliases (``attribute_map``),
    and the keys the model class's own module reads from its config."""

    def __init__(self, cfg_cls: type, model_cls: type | None = None) -> None:
        self.name = cfg_cls.__name__
        self.alias: dict[str, str] = dict(getattr(cfg_cls, "attribute_map", {}) or {})
        self.alias.update(LEGACY.get(str(getattr(cfg_cls, "model_type", "")), {}))
        try:
            made: dict[str, Any] = dict(cfg_cls().to_dict())
        except Exception:  # a class that has no default config: only its signature known
            made = {}
        init = _init_defaults(cfg_cls)
        #: key -> default, as the signature says where it says (a derived default is None there)
        self.defaults: dict[str, Any] = {**made, **{k: v for k, v in init.items() if k in made or not made}}
        self.known = set(made) | set(init) | set(self.alias) | METADATA | _read_by_model(model_cls) \
            | _read_from_kwargs(cfg_cls)
        #: keys whose value may be null: the class's default is null or its annotation admits None
        self.nullable = {k for k, v in self.defaults.items() if v is None} | _nullable(cfg_cls, model_cls)

    def key(self, name: str) -> str:
        """The class's own spelling of ``name`` (``hidden_size`` -> ``n_embd`` for GPT-2)."""
        return self.alias.get(name, name)

    def given(self, cfg: Mapping[str, Any], name: str) -> str | None:
        """The key of ``cfg`` that sets the class's ``name`` (either spelling), or None."""
        own = self.key(name)
        return next((k for k in cfg if self.key(k) == own), None)

    def fixed(self, name: str) -> bool:
        """The class has ``name`` with a fixed (non-null) default."""
        return self.defaults.get(self.key(name)) is not None


def _required(s: _Schema) -> list[str]:
    """The class's own spellings of the keys a config must give."""
    need = [s.key(k) for k in REQUIRED if s.key(k) in s.defaults and s.fixed(k)]
    ffn = next((k for k in FFN_KEYS if k in s.defaults), None)
    if ffn is not None and s.fixed(ffn):
        need.append(ffn)
    need += [k for k in REQUIRED_MORE if k in s.defaults and s.fixed(k)]
    return list(dict.fromkeys(need))


def _check_keys(s: _Schema, cfg: Mapping[str, Any]) -> None:
    """Typos refused, other unknown keys warned of."""
    unknown = []
    for k in cfg:
        if not isinstance(k, str):
            raise ProgramError(f"--hf-config: key {k!r} is not a string")
        if k in s.known:
            continue
        close = difflib.get_close_matches(k, sorted(s.known - METADATA), n=1, cutoff=TYPO_RATIO)
        if close:
            raise ProgramError(f"--hf-config: {k!r} is not a key of {s.name} (did you mean {close[0]!r}?)")
        unknown.append(k)
    if unknown:
        shown = ", ".join(repr(k[:40]) for k in unknown[:8]) + (f" and {len(unknown) - 8} more" if len(unknown) > 8 else "")
        warnings.warn(f"--hf-config: {s.name} does not know {shown}: ignored (check the spelling)",
                      UserWarning, stacklevel=3)


def _check_sizes(s: _Schema, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The size keys' values checked; the class's spelling -> the value (given, else the default)."""
    for need in _required(s):
        if s.given(cfg, need) is None:
            raise ProgramError(f"--hf-config: {need} is missing ({s.name} would take its default "
                               f"{s.defaults[need]!r} silently): give the model's {need}")
    values: dict[str, Any] = {}
    for name in dict.fromkeys(s.key(k) for k in SIZES):
        key = s.given(cfg, name)
        default = s.defaults.get(name)
        if key is None:
            values[name] = default
            continue
        v = cfg[key]
        if v is None and name in s.nullable and name in s.defaults:
            values[name] = None
            continue
        low = 0 if default == 0 else 1
        high = MAX_LAYERS if name in {s.key(k) for k in LAYER_KEYS} else MAX_SIZE
        if not _is_int(v) or not low <= v <= high:
            what = "null" if v is None else f"{type(v).__name__} {str(v)[:40]!r}" if not _is_int(v) else str(v)
            raise ProgramError(f"--hf-config: {key} is {what}; {s.name} needs an integer "
                               f"{'>= 0' if low == 0 else '>= 1'}" + (" or null" if name in s.nullable else "")
                               + (f" and at most {high}" if _is_int(v) and v > high else ""))
        values[name] = v
    return values


def _check_shapes(s: _Schema, cfg: Mapping[str, Any], values: Mapping[str, Any]) -> None:
    """Heads divide the hidden size (without an explicit head size); kv heads divide the heads."""
    def shown(name: str) -> str:
        return s.given(cfg, name) or s.key(name)

    hidden, head_dim = values.get(s.key("hidden_size")), values.get(s.key("head_dim"))
    heads_keys = dict.fromkeys((s.key("num_attention_heads"), "encoder_attention_heads", "decoder_attention_heads"))
    for hk in heads_keys:
        heads = values.get(hk)
        if not _is_int(hidden) or not _is_int(heads) or head_dim is not None:
            continue
        if hidden % heads:
            raise ProgramError(f"--hf-config: {shown('hidden_size')} {hidden} is not divisible by {shown(hk)} {heads} "
                               f"({s.name} gives each head hidden / heads features; give head_dim where the class "
                               f"has one)")
    heads, kv = values.get(s.key("num_attention_heads")), cfg.get(s.given(cfg, "num_key_value_heads") or "")
    if _is_int(heads) and _is_int(kv) and heads % kv:
        raise ProgramError(f"--hf-config: {shown('num_attention_heads')} {heads} is not divisible by "
                           f"{shown('num_key_value_heads')} {kv} (each kv head serves a whole group of query heads)")


def _check_uses(s: _Schema, cfg: Mapping[str, Any], values: Mapping[str, Any]) -> None:
    """The values that index or pick from a size: the padding token inside the vocabulary, the
    experts per token at most the experts, an even rotary head size."""
    vocab, pad_key = values.get(s.key("vocab_size")), s.given(cfg, "pad_token_id")
    pad = cfg.get(pad_key) if pad_key else None
    if pad is not None and _is_int(vocab) and (not _is_int(pad) or not -vocab <= pad < vocab):
        raise ProgramError(f"--hf-config: pad_token_id {str(pad)[:40]} is not a token of the vocabulary of "
                           f"{vocab} (the embedding's padding row)")
    experts = next((values.get(k) for k in (s.key("num_local_experts"), "num_experts", "n_routed_experts")
                    if _is_int(values.get(k))), None)
    top_key = s.given(cfg, "num_experts_per_tok")
    top = cfg.get(top_key) if top_key else None
    if _is_int(experts) and _is_int(top) and top > experts:
        raise ProgramError(f"--hf-config: {top_key} {top} is more than the {experts} experts")
    rotary = any(k in s.known for k in ("rope_parameters", "rope_theta")) \
        and not any(k in s.known for k in ("partial_rotary_factor", "rotary_pct", "rotary_dim"))
    head_dim, hidden, heads = values.get(s.key("head_dim")), values.get(s.key("hidden_size")), \
        values.get(s.key("num_attention_heads"))
    size = head_dim if _is_int(head_dim) else hidden // heads if _is_int(hidden) and _is_int(heads) else None
    if rotary and size is not None and size % 2:
        key = s.given(cfg, "head_dim") or f"{s.key('hidden_size')} / {s.key('num_attention_heads')}"
        raise ProgramError(f"--hf-config: the head size {size} ({key}) is odd; {s.name}'s rotary embedding "
                           f"turns pairs of features")


#: The config keys of a multi-token-prediction depth (DeepSeek-V3, Qwen3-Next): transformers'
#: modeling code builds none of those layers (it drops their weights on load).
MTP_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")


def _check_mtp(s: _Schema, cfg: Mapping[str, Any]) -> None:
    """A warning for a positive MTP depth: the traced model has no such layers."""
    for k in MTP_KEYS:
        n = cfg.get(k)
        if _is_int(n) and n > 0:
            warnings.warn(f"--hf-config: {k} {n}: the HF model builds no multi-token-prediction layers, so the "
                          f"plan has none (a catalog model or --model-config with this config plans them)",
                          UserWarning, stacklevel=3)


def check_hf_config(cfg_cls: type, cfg: Mapping[str, Any], model_cls: type | None = None) -> None:
    """ProgramError (one line naming the key) for a config ``cfg`` (the keys given) that
    ``cfg_cls`` would reject, build into a traceback or silently complete with its defaults;
    a UserWarning for a key neither it nor ``model_cls``'s module knows (see the module docstring)."""
    s = _Schema(cfg_cls, model_cls)
    _check_keys(s, cfg)
    values = _check_sizes(s, cfg)
    _check_shapes(s, cfg, values)
    _check_uses(s, cfg, values)
    _check_mtp(s, cfg)
    try:
        conf = cfg_cls(**cfg)
    except Exception as exc:  # transformers' and huggingface_hub's own checks, whatever their class
        msg = " ".join(str(exc).split())[:300]
        raise ProgramError(f"--hf-config: {s.name} rejects the config: {type(exc).__name__}: {msg}") from None
    _check_rope(s, cfg, conf)
    _check_activation(s, cfg)


#: Config keys naming the MLP's activation by its ``transformers.activations.ACT2FN`` name.
ACTIVATION_KEYS = ("hidden_act", "activation_function", "hidden_activation", "activation")


def _check_activation(s: _Schema, cfg: Mapping[str, Any]) -> None:
    """An activation the class looks up in ``ACT2FN`` is one it has (``hidden_act: "swish2"`` failed
    at build: 'the model does not import: KeyError: 'swish2''). A key counts where the class's
    default for it is an ``ACT2FN`` name (T5's ``feed_forward_proj`` is not)."""
    try:
        from transformers.activations import ACT2FN
    except ImportError:
        return
    for key in ACTIVATION_KEYS:
        own, v = s.key(key), cfg.get(key)
        if not isinstance(v, str) or s.defaults.get(own) not in ACT2FN or v in ACT2FN:
            continue
        close = difflib.get_close_matches(v, sorted(ACT2FN), n=1)
        raise ProgramError(f"--hf-config: {key} {v[:40]!r} is not an activation transformers has"
                           + (f" (did you mean {close[0]!r}?)" if close else f" ({', '.join(sorted(ACT2FN)[:12])}, ...)"))


def _check_rope(s: _Schema, cfg: Mapping[str, Any], conf: Any) -> None:
    """The rotary scaling's type is one transformers has (``ROPE_INIT_FUNCTIONS``): its config
    validation only logs an unknown one, and the model then fails in its rotary embedding
    (``KeyError: 'bogus'``)."""
    try:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    except ImportError:
        return
    params = getattr(conf, "rope_parameters", None)
    if not isinstance(params, Mapping):
        return
    per_layer = params.values() if "rope_type" not in params and all(
        isinstance(v, Mapping) or v is None for v in params.values()) else [params]
    known = {"default", str(getattr(conf, "default_rope_type", "default")), *ROPE_INIT_FUNCTIONS}
    key = next((k for k in ("rope_scaling", "rope_parameters") if k in cfg), "rope_parameters")
    for p in per_layer:
        kind = p.get("rope_type", p.get("type", "default")) if isinstance(p, Mapping) else "default"
        if kind not in known:
            raise ProgramError(f"--hf-config: {key}'s rope_type {str(kind)[:40]!r} is not one transformers has "
                               f"({', '.join(sorted(known))})")


__all__ = ["FFN_KEYS", "MAX_LAYERS", "MAX_SIZE", "METADATA", "REQUIRED", "SIZES", "check_hf_config"]
