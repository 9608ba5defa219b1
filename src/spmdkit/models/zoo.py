"""Built-in models (no torch needed): GPT-2 and LLaMA style decoders as whole training steps.

``build_model(config)`` gives a :class:`Model`: a validated :class:`Program` of the forward
ops, the backward (grad) ops made by reverse-mode differentiation over the registered grad
rules (:mod:`spmdkit.program.autodiff`), and one optimizer update (AdamW) per parameter, plus the
roles the strategies read (which weights are column- or row-parallel, which tensors form the
residual stream).

LLaMA: token embedding; per layer RMSNorm, q/k/v projections, rotary embedding
(``fused_rotary_position_embedding``), causal ``flash_attention`` (grouped kv heads), output
projection, residual add, RMSNorm, SwiGLU MLP (gate, up, ``swiglu``, down), residual add;
final RMSNorm, LM head, ``cross_entropy_with_softmax`` (``c_softmax_with_cross_entropy`` when
the head is vocab-parallel) and the mean loss. GPT-2: token + learned position embeddings,
LayerNorm, q/k/v projections, matmul + softmax attention with a causal mask, GELU MLP.

Variants (:class:`ModelConfig`, ``--model-config``): ``activation`` (``swiglu``: gate and up
projections; ``gelu``, ``squared_relu`` (Nemotron, Primer) or ``relu``: one up projection),
``attention`` (``flash``: one fused ``flash_attention`` kernel, no ``s x s`` tensor, as
Megatron-Core, NeMo and torchtitan run it; ``eager``: the scores materialised, as GPT-2 and the
Megatron-LM of 2021-2022 ran it; gpt2 only), ``tied_embeddings`` (the LM head is the token
embedding, transposed). :func:`preset` takes a preset name or a config as a JSON object or a
``.json`` file (:func:`config_from_json`).

Gradients of a tensor read by several ops are summed with ``add_n`` (which keeps a common
partial status, as Megatron sums the partial input gradients of its column-parallel
projections before one all-reduce).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from spmdkit.core.errors import ProgramError
from spmdkit.models import catalog
from spmdkit.models.hf_config import hf_fields, is_hf_config
from spmdkit.program.autodiff import Tape
from spmdkit.program.ir import Program, ProgramBuilder


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of a decoder. ``arch``: llama or gpt2."""

    arch: str = "llama"
    layers: int = 2
    hidden: int = 16
    heads: int = 4
    kv_heads: int | None = None
    ffn: int = 32
    vocab: int = 64
    seq: int = 8
    batch: int = 4
    dtype: str = "float32"
    #: dropout probability (gpt2 only): > 0 adds Megatron GPT's three dropouts per layer, on
    #: the attention probabilities, after the attention output projection and after the MLP,
    #: each keeping a 1-byte mask for the backward (Korthikanti et al. 2022, section 4.1)
    dropout: float = 0.0
    #: the LM head is the token embedding (transposed): one [vocab, hidden] parameter
    tied_embeddings: bool = False
    #: the MLP's activation: swiglu, gelu, squared_relu or relu (None: the arch's, swiglu for
    #: llama, gelu for gpt2)
    activation: str | None = None
    #: the attention kernel: flash or eager (None: the arch's, flash for llama, eager for gpt2)
    attention: str | None = None
    #: a name for a custom config (``--model-config``'s ``name``)
    name: str = ""
    #: the attention head size (None: hidden // heads); q/k/v are heads x head_dim wide, the
    #: output projection [heads x head_dim, hidden] (Gemma: 256 with hidden 3584 / 16 heads);
    #: with MLA (kv_lora_rank > 0) the non-rotary part of each q/k head (qk_nope_head_dim)
    head_dim: int | None = None
    #: the normalisation: rms or layer (None: the arch's, rms for llama, layer for gpt2)
    norm: str | None = None
    #: positions: rope, learned, alibi or none (None: the arch's, rope for llama, learned for gpt2)
    positions: str | None = None
    #: biases on the q, k and v projections (Qwen2)
    qkv_bias: bool = False
    #: biases on every linear layer but the LM head (GPT-3, BLOOM)
    linear_bias: bool = False
    #: a LayerNorm right after the token embedding (BLOOM)
    embed_norm: bool = False
    #: routed experts per MoE layer (0: a dense MLP)
    experts: int = 0
    #: experts each token is routed to
    top_k: int = 2
    #: each expert's hidden size (None: ffn)
    moe_ffn: int | None = None
    #: always-active experts (DeepSeek, Qwen2-MoE), each moe_ffn wide
    shared_experts: int = 0
    #: the first dense_layers layers have the dense MLP of width ffn (DeepSeek-V3: 3)
    dense_layers: int = 0
    #: expert capacity = ceil(tokens x top_k / experts x capacity_factor) (None: dropless,
    #: uniform routing, a factor of 1)
    capacity_factor: float | None = None
    #: MLA's query compression rank (0: q projected directly, as DeepSeek-V2-Lite)
    q_lora_rank: int = 0
    #: > 0: multi-head latent attention (DeepSeek-V2/V3) with this kv compression rank
    kv_lora_rank: int = 0
    #: MLA's rotary part of each q/k head (k's shared by the heads)
    qk_rope_head_dim: int = 0
    #: MLA's value head size (None: head_dim)
    v_head_dim: int | None = None

    @property
    def act(self) -> str:
        return self.activation or ("swiglu" if self.arch == "llama" else "gelu")

    @property
    def attn(self) -> str:
        return self.attention or ("flash" if self.arch == "llama" else "eager")

    @property
    def hdim(self) -> int:
        """The head size in effect (q/k's non-rotary part with MLA)."""
        return self.head_dim or self.hidden // self.heads

    @property
    def nrm(self) -> str:
        """The normalisation in effect: rms or layer."""
        return self.norm or ("rms" if self.arch == "llama" else "layer")

    @property
    def pos(self) -> str:
        """The positions in effect: rope, learned, alibi or none."""
        return self.positions or ("rope" if self.arch == "llama" else "learned")

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def vdim(self) -> int:
        """The value head size (MLA's v_head_dim, else the head size)."""
        return self.v_head_dim or self.hdim

    @property
    def expert_ffn(self) -> int:
        return self.moe_ffn or self.ffn

    def is_moe_layer(self, i: int) -> bool:
        """Layer ``i`` has routed experts (past the first dense_layers)."""
        return self.experts > 0 and i >= self.dense_layers

    @property
    def n_kv(self) -> int:
        return self.kv_heads or self.heads

    def check(self) -> None:
        if self.arch not in ("llama", "gpt2"):
            raise ProgramError(f"model: unknown arch {self.arch!r} (llama or gpt2)")
        for k in ("layers", "hidden", "heads", "ffn", "vocab", "seq", "batch"):
            if int(getattr(self, k)) < 1:
                raise ProgramError(f"model: {k} must be >= 1")
        if self.head_dim is None and self.hidden % self.heads:
            raise ProgramError(f"model: hidden {self.hidden} is not divisible by heads {self.heads} "
                               f"(or give head_dim)")
        if self.heads % self.n_kv:
            raise ProgramError(f"model: heads {self.heads} is not divisible by kv_heads {self.n_kv}")
        if not 0.0 <= float(self.dropout) < 1.0:
            raise ProgramError(f"model: dropout must be in [0, 1), got {self.dropout}")
        if self.dropout and self.arch != "gpt2":
            raise ProgramError(f"model: dropout is modelled for gpt2 only, not {self.arch}")
        if self.act not in ACTIVATIONS:
            raise ProgramError(f"model: unknown activation {self.act!r} ({', '.join(ACTIVATIONS)})")
        if self.attn not in ("flash", "eager"):
            raise ProgramError(f"model: unknown attention {self.attn!r} (flash or eager)")
        if self.attn == "eager" and self.arch != "gpt2":
            raise ProgramError(f"model: eager attention is modelled for gpt2 only, not {self.arch}")
        if self.arch == "gpt2" and self.n_kv != self.heads and self.attn == "eager":
            raise ProgramError("model: grouped kv heads need attention flash in the gpt2 arch")
        self._check_variants()
        self._check_moe()
        self._check_mla()

    def _check_variants(self) -> None:
        for k in ("head_dim", "moe_ffn", "v_head_dim"):
            v = getattr(self, k)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ProgramError(f"model: {k} must be an integer >= 1 (or null), got {v!r}")
        for k in ("experts", "shared_experts", "dense_layers", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim"):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ProgramError(f"model: {k} must be an integer >= 0, got {v!r}")
        if self.nrm not in NORMS:
            raise ProgramError(f"model: unknown norm {self.nrm!r} ({' or '.join(NORMS)})")
        if self.pos not in POSITIONS:
            raise ProgramError(f"model: unknown positions {self.pos!r} ({', '.join(POSITIONS)})")
        if self.pos == "rope" and not self.mla and self.hdim % 2:
            raise ProgramError(f"model: rope needs an even head_dim, got {self.hdim}")

    def _check_moe(self) -> None:
        if not self.experts:
            for k in ("shared_experts", "dense_layers"):
                if getattr(self, k):
                    raise ProgramError(f"model: {k} {getattr(self, k)} needs experts >= 1 (a MoE model)")
            if self.moe_ffn is not None or self.capacity_factor is not None:
                k = "moe_ffn" if self.moe_ffn is not None else "capacity_factor"
                raise ProgramError(f"model: {k} needs experts >= 1 (a MoE model)")
            return
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or not 1 <= self.top_k <= self.experts:
            raise ProgramError(f"model: top_k must be from 1 to experts {self.experts}, got {self.top_k!r}")
        if self.dense_layers >= self.layers:
            raise ProgramError(f"model: dense_layers {self.dense_layers} leaves no MoE layer of {self.layers}")
        cf = self.capacity_factor
        if cf is not None and (isinstance(cf, bool) or not isinstance(cf, (int, float)) or not 0 < cf <= 1024):
            raise ProgramError(f"model: capacity_factor must be a number in (0, 1024] (or null), got {cf!r}")
        if self.dropout:
            raise ProgramError("model: dropout is not modelled with experts (a MoE model)")

    def _check_mla(self) -> None:
        if not self.mla:
            for k in ("q_lora_rank", "qk_rope_head_dim"):
                if getattr(self, k):
                    raise ProgramError(f"model: {k} {getattr(self, k)} needs kv_lora_rank >= 1 (MLA)")
            if self.v_head_dim is not None:
                raise ProgramError("model: v_head_dim needs kv_lora_rank >= 1 (MLA)")
            return
        if self.attn != "flash":
            raise ProgramError("model: kv_lora_rank (MLA) needs attention flash, not eager")
        if self.pos != "rope" or self.qk_rope_head_dim < 2 or self.qk_rope_head_dim % 2:
            raise ProgramError(f"model: kv_lora_rank (MLA) needs positions rope and an even qk_rope_head_dim >= 2, "
                               f"got {self.pos} and {self.qk_rope_head_dim}")
        if self.kv_heads is not None and self.kv_heads != self.heads:
            raise ProgramError(f"model: kv_heads {self.kv_heads} with kv_lora_rank (MLA): MLA has one kv head per "
                               f"q head")

    def with_(self, **kw: Any) -> ModelConfig:
        return replace(self, **kw)


#: Published sizes (GPT-2's vocabulary padded to 50304 as Megatron-LM does, so it divides
#: tensor-parallel degrees); tiny ones for tests and ``--verify``.
PRESETS: dict[str, ModelConfig] = {
    # GPT-2 as trained today: flash attention (PyTorch SDPA in HF transformers, Megatron-Core)
    "gpt2-small": ModelConfig("gpt2", 12, 768, 12, None, 3072, 50304, 1024, 8, "bfloat16", attention="flash"),
    "gpt2-medium": ModelConfig("gpt2", 24, 1024, 16, None, 4096, 50304, 1024, 8, "bfloat16", attention="flash"),
    "llama-7b": ModelConfig("llama", 32, 4096, 32, 32, 11008, 32000, 4096, 8, "bfloat16"),
    "llama-13b": ModelConfig("llama", 40, 5120, 40, 40, 13824, 32000, 4096, 8, "bfloat16"),
    "llama-70b": ModelConfig("llama", 80, 8192, 64, 8, 28672, 32000, 4096, 8, "bfloat16"),
    "tiny-llama": ModelConfig("llama", 2, 16, 4, 2, 32, 64, 8, 4, "float32"),
    "tiny-gpt2": ModelConfig("gpt2", 2, 16, 4, None, 32, 64, 8, 4, "float32"),
    # GPT with Megatron's dropouts (p = 0.1) and its attention of 2022 (the scores materialised,
    # eager), the layer Korthikanti et al. (2022) count: GPT-2
    # small's sizes, the 22B model of their Table 3 (microbatch 4, seq 2048, vocab 51200), tiny
    "gpt-dropout-small": ModelConfig("gpt2", 12, 768, 12, None, 3072, 50304, 1024, 8, "bfloat16", 0.1),
    "gpt-dropout-22b": ModelConfig("gpt2", 48, 6144, 64, None, 24576, 51200, 2048, 4, "bfloat16", 0.1),
    "tiny-gpt-dropout": ModelConfig("gpt2", 2, 16, 4, None, 32, 64, 8, 4, "float32", 0.1),
}


ACTIVATIONS = ("swiglu", "geglu", "gelu", "squared_relu", "relu")
NORMS = ("rms", "layer")
POSITIONS = ("rope", "learned", "alibi", "none")
#: the fields of a ``--model-config`` and their kinds
_CONFIG_FIELDS = {"base": "str", "name": "str", "arch": "str", "layers": "int", "hidden": "int", "heads": "int",
                  "kv_heads": "int?", "ffn": "int", "vocab": "int", "seq": "int", "batch": "int", "dtype": "str",
                  "dropout": "num", "tied_embeddings": "bool", "activation": "str?", "attention": "str?",
                  "head_dim": "int?", "norm": "str?", "positions": "str?", "qkv_bias": "bool", "linear_bias": "bool",
                  "embed_norm": "bool", "experts": "count", "top_k": "int", "moe_ffn": "int?",
                  "shared_experts": "count", "dense_layers": "count", "capacity_factor": "num?",
                  "q_lora_rank": "count", "kv_lora_rank": "count", "qk_rope_head_dim": "count", "v_head_dim": "int?"}
_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
           "fp32": "float32", "float32": "float32"}


def is_config_text(name: str) -> bool:
    """A ``--model`` value that is a config (a JSON object or a ``.json`` path), not a preset."""
    t = name.strip()
    return t.startswith("{") or t.lower().endswith(".json")


def _check_field(k: str, v: Any) -> None:
    """ProgramError naming ``--model-config``'s field ``k`` where ``v`` is not of its kind
    (``?``: null allowed, the arch's default)."""
    kind = _CONFIG_FIELDS[k]
    if kind.endswith("?"):
        if v is None:
            return
        kind = kind[:-1]
    is_int = isinstance(v, int) and not isinstance(v, bool)
    ok = {"str": isinstance(v, str), "bool": isinstance(v, bool),
          "int": is_int and 1 <= v <= 1 << 31, "count": is_int and 0 <= v <= 1 << 31,
          "num": isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf")}[kind]
    if not ok:
        what = {"str": "a string", "bool": "true or false", "int": f"an integer from 1 to {1 << 31}",
                "count": f"an integer from 0 to {1 << 31}", "num": "a finite number"}[kind]
        if _CONFIG_FIELDS[k].endswith("?"):
            what += " or null"
        raise ProgramError(f"--model-config {k}: expected {what}, got {json.dumps(v)[:40]}")


def config_from_json(text: str) -> ModelConfig:
    """``--model-config``: a JSON object (or a ``.json`` file holding one) with the fields of
    :class:`ModelConfig` (``ffn`` the MLP's hidden size, ``kv_heads`` grouped-query heads,
    ``dtype`` bf16 / fp16 / fp32, ``activation``, ``attention``, ``tied_embeddings``), and
    ``base``: a preset whose sizes the others override (else llama's defaults for a field not
    given: layers, hidden, heads, ffn and vocab must then be given). ProgramError naming the
    field otherwise."""
    raw = text.strip()
    if not raw.startswith("{"):
        if not os.path.isfile(raw):
            raise ProgramError(f"--model-config {raw[:100]!r}: no such file")
        try:
            with open(raw, encoding="utf-8") as f:
                raw = f.read(1 << 20)
        except (OSError, UnicodeDecodeError) as exc:
            raise ProgramError(f"--model-config {text[:100]!r}: cannot read it ({type(exc).__name__})") from None
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ProgramError(f"--model-config: not valid JSON ({str(exc)[:80]})") from None
    if not isinstance(obj, dict):
        raise ProgramError("--model-config: expected a JSON object of model fields")
    if is_hf_config(obj):  # a HuggingFace config.json, mapped to the fields (models/hf_config.py)
        obj = hf_fields(obj)
    unknown = sorted(set(obj) - set(_CONFIG_FIELDS))
    if unknown:
        raise ProgramError(f"--model-config: unknown field {str(unknown[0])[:40]!r} "
                           f"(fields: {', '.join(sorted(_CONFIG_FIELDS))})")
    for k, v in obj.items():
        _check_field(k, v)
    if "base" in obj:
        cfg = preset(obj["base"])
    else:
        missing = [k for k in ("layers", "hidden", "heads", "ffn", "vocab") if k not in obj]
        if missing:
            raise ProgramError(f"--model-config: missing {missing[0]!r} (or give \"base\": a preset to start from)")
        cfg = ModelConfig("llama", seq=2048, batch=1, dtype="bfloat16")
    kw = {k: v for k, v in obj.items() if k != "base"}
    if "dtype" in kw:
        if kw["dtype"].lower() not in _DTYPES:
            raise ProgramError(f"--model-config dtype: expected bf16, fp16 or fp32, got {kw['dtype'][:20]!r}")
        kw["dtype"] = _DTYPES[kw["dtype"].lower()]
    if "name" not in kw:
        kw["name"] = f"custom {obj['base']}" if "base" in obj else "custom"
    cfg = cfg.with_(**kw)
    try:
        cfg.check()
    except ProgramError as exc:
        raise ProgramError(f"--model-config: {str(exc).removeprefix('model: ')}") from None
    return cfg


def config_json(cfg: ModelConfig) -> str:
    """``cfg`` as a ``--model-config`` JSON object (every field)."""
    return json.dumps({f.name: getattr(cfg, f.name) for f in fields(cfg) if getattr(cfg, f.name) is not None},
                      separators=(",", ":"))


def tiny_like(cfg: ModelConfig) -> str:
    """The tiny model of ``cfg``'s architecture (``--verify`` simulates it): a tiny preset, or,
    where ``cfg`` has a variant (activation, attention, tied embeddings, grouped kv heads), a
    config of the tiny preset's sizes with that variant."""
    base = "tiny-llama" if cfg.arch == "llama" else "tiny-gpt-dropout" if cfg.dropout else "tiny-gpt2"
    tiny = PRESETS[base]
    # grouped kv heads: tiny-llama has them already; a grouped gpt2 gets half as many kv heads
    kv = tiny.n_kv if cfg.arch == "llama" else tiny.heads // 2 if cfg.n_kv != cfg.heads else tiny.heads
    variant = {"activation": cfg.act, "attention": cfg.attn, "tied_embeddings": cfg.tied_embeddings,
               "kv_heads": kv}
    if all(getattr(tiny.with_(**variant), f) == getattr(tiny, f) for f in ("act", "attn", "tied_embeddings", "n_kv")):
        return base
    return json.dumps({"base": base, "name": base + " variant", **variant}, separators=(",", ":"))


def model_label(name: str) -> str:
    """How a ``--model`` value is named in titles: the preset's name, or a config's ``name``."""
    return preset(name).name or "custom" if is_config_text(name) else name


def preset(name: str) -> ModelConfig:
    """A preset by name, a catalog model (:mod:`spmdkit.models.catalog`) by name, or a config
    (:func:`is_config_text`) read by :func:`config_from_json`."""
    if is_config_text(name):
        return config_from_json(name)
    if name in PRESETS:
        return PRESETS[name]
    fields = catalog.config_fields(name)  # a published architecture (models/catalog/)
    if fields is None:
        raise ProgramError(catalog.unknown_message(name, list(PRESETS)))
    return ModelConfig(**fields)


@dataclass
class Model:
    """A built training step and the roles strategies read."""

    config: ModelConfig
    program: Program
    #: parameter name -> role: embedding, position, column, row, head, norm
    roles: dict[str, str]
    #: residual-stream activations (Megatron sequence parallel shards their sequence axis)
    residual: list[str]
    #: normalised activations that feed the column-parallel projections
    norm_outputs: list[str]
    #: parameter -> (gradient, optimizer states, updated parameter, updated states)
    optimizer: dict[str, tuple[str, tuple[str, ...], str, tuple[str, ...]]]
    #: outputs of the row-parallel projections (their gradients are gathered under sequence parallel)
    row_outputs: list[str] = field(default_factory=list)
    inputs: dict[str, str] = field(default_factory=dict)
    loss: str = "loss"
    vocab_parallel_loss: bool = False


# -- the models -------------------------------------------------------------------------------


def _norm(t: Tape, cfg: ModelConfig, m: Model, x: str, name: str, scale: str, bias: str | None = None) -> str:
    """``x`` normalised: RMS norm without ``bias`` (llama), layer norm with it (gpt2); its outputs
    ``<name>.out`` and the float32 statistics; recorded among the norm outputs."""
    B, S, H, dt = cfg.batch, cfg.seq, cfg.hidden, cfg.dtype
    out = (name + ".out", [B, S, H], dt)
    if bias is None:
        n, _ = t.op("fused_rms_norm", {"x": x, "scale": scale}, [out, (name + ".invvar", [B, S], "float32")],
                    epsilon=1e-6)
    else:
        n, _, _ = t.op("layer_norm", {"x": x, "scale": scale, "bias": bias},
                       [out, (name + ".mean", [B, S], "float32"), (name + ".var", [B, S], "float32")],
                       epsilon=1e-5, begin_norm_axis=2)
    assert n is not None
    m.norm_outputs.append(n)
    return n


def _row_residual(t: Tape, cfg: ModelConfig, m: Model, x: Any, weight: str, name: str, h: str, resid: str) -> str:
    """The row-parallel projection ``x @ weight`` (``name``, recorded among the row outputs;
    dropped out where cfg.dropout) added to the residual stream ``h`` as ``resid``."""
    B, S, H, dt = cfg.batch, cfg.seq, cfg.hidden, cfg.dtype
    (o,) = t.op("matmul", {"x": x, "y": weight}, [(name, [B, S, H], dt)])
    m.row_outputs.append(name)
    if cfg.dropout:
        o = _dropout(t, cfg, o, name + ".dropout", m)
    (r,) = t.op("add", {"x": h, "y": o}, [(resid, [B, S, H], dt)])
    assert r is not None
    return r


def _mlp_act(t: Tape, cfg: ModelConfig, x: str, w_gate: str | None, w_up: str, gate: str, up: str, p: str) -> str:
    """The MLP up to its down projection: ``swiglu(x @ w_gate, x @ w_up)``, or the activation
    (gelu, relu, squared ReLU) of ``x @ w_up``; outputs named ``gate`` / ``up`` and after the
    activation."""
    B, S, F, dt = cfg.batch, cfg.seq, cfg.ffn, cfg.dtype
    a = cfg.act
    if a == "swiglu":
        assert w_gate is not None
        (g,) = t.op("matmul", {"x": x, "y": w_gate}, [(gate, [B, S, F], dt)])
        (u,) = t.op("matmul", {"x": x, "y": w_up}, [(up, [B, S, F], dt)])
        (out,) = t.op("swiglu", {"x": g, "y": u}, [(p + "swiglu", [B, S, F], dt)])
    else:
        (u,) = t.op("matmul", {"x": x, "y": w_up}, [(up, [B, S, F], dt)])
        if a == "gelu":
            (out,) = t.op("gelu", {"x": u}, [(p + "gelu", [B, S, F], dt)], approximate=True)
        else:
            (out,) = t.op("relu", {"x": u}, [(p + "relu", [B, S, F], dt)])
            if a == "squared_relu":
                (out,) = t.op("square", {"x": out}, [(p + "relu.sq", [B, S, F], dt)])
    assert out is not None
    return out


def _flash_core(t: Tape, cfg: ModelConfig, m: Model, p: str, q: str, k: str, v: str, rope: bool) -> str:
    """Causal ``flash_attention`` of the projections ``q`` / ``k`` / ``v`` ([B, S, heads x
    head_dim], kv heads grouped), rotated first when ``rope``; the output as [B, S, H]."""
    B, S, nh, nkv, hd, dt = cfg.batch, cfg.seq, cfg.heads, cfg.n_kv, cfg.hdim, cfg.dtype
    (q4,) = t.op("reshape", {"x": q}, [(p + "q4", [B, S, nh, hd], dt)], shape=(B, S, nh, hd))
    (k4,) = t.op("reshape", {"x": k}, [(p + "k4", [B, S, nkv, hd], dt)], shape=(B, S, nkv, hd))
    (v4,) = t.op("reshape", {"x": v}, [(p + "v4", [B, S, nkv, hd], dt)], shape=(B, S, nkv, hd))
    if rope:
        # q and k rotated by separate calls: with grouped kv heads their head counts differ
        q4, _, _ = t.op("fused_rotary_position_embedding",
                        {"q": q4, "k": None, "v": None, "sin": m.inputs["sin"], "cos": m.inputs["cos"]},
                        [(p + "q_rope", [B, S, nh, hd], dt), None, None], use_neox_rotary_style=True)
        k4, _, _ = t.op("fused_rotary_position_embedding",
                        {"q": k4, "k": None, "v": None, "sin": m.inputs["sin"], "cos": m.inputs["cos"]},
                        [(p + "k_rope", [B, S, nkv, hd], dt), None, None], use_neox_rotary_style=True)
    att, _, _, _ = t.op("flash_attention", {"q": q4, "k": k4, "v": v4},
                        [(p + "attn", [B, S, nh, hd], dt), None, (p + "attn.lse", [B, nh, S], "float32"),
                         (p + "attn.seed_offset", [2], "int64")], causal=True)
    (a2,) = t.op("reshape", {"x": att}, [(p + "attn2d", [B, S, nh * hd], dt)], shape=(B, S, nh * hd))
    assert a2 is not None
    return a2


def _llama_layer(t: Tape, cfg: ModelConfig, i: int, h: str, m: Model) -> str:
    b = t.b
    B, S, H, F = cfg.batch, cfg.seq, cfg.hidden, cfg.ffn
    nh, nkv, hd = cfg.heads, cfg.n_kv, cfg.hdim
    dt = cfg.dtype
    p = f"layers.{i}."
    b.layer = f"layer {i}"
    ln1 = t.param(p + "attn_norm", [H], dt)
    wq = t.param(p + "wq", [H, nh * hd], dt)
    wk = t.param(p + "wk", [H, nkv * hd], dt)
    wv = t.param(p + "wv", [H, nkv * hd], dt)
    wo = t.param(p + "wo", [nh * hd, H], dt)
    ln2 = t.param(p + "mlp_norm", [H], dt)
    wg = t.param(p + "w_gate", [H, F], dt) if cfg.act == "swiglu" else None
    wu = t.param(p + "w_up", [H, F], dt)
    wd = t.param(p + "w_down", [F, H], dt)
    m.roles.update({ln1: "norm", ln2: "norm", wq: "column", wk: "column", wv: "column", wo: "row",
                    wu: "column", wd: "row"})
    if wg is not None:
        m.roles[wg] = "column"
    n1 = _norm(t, cfg, m, h, p + "attn_norm", ln1)
    (q,) = t.op("matmul", {"x": n1, "y": wq}, [(p + "q", [B, S, nh * hd], dt)])
    (k,) = t.op("matmul", {"x": n1, "y": wk}, [(p + "k", [B, S, nkv * hd], dt)])
    (v,) = t.op("matmul", {"x": n1, "y": wv}, [(p + "v", [B, S, nkv * hd], dt)])
    assert q is not None and k is not None and v is not None
    a2 = _flash_core(t, cfg, m, p, q, k, v, rope=True)
    h1 = _row_residual(t, cfg, m, a2, wo, p + "attn_out", h, p + "resid1")
    n2 = _norm(t, cfg, m, h1, p + "mlp_norm", ln2)
    act = _mlp_act(t, cfg, n2, wg, wu, p + "gate", p + "up", p)
    h2 = _row_residual(t, cfg, m, act, wd, p + "mlp_out", h1, p + "resid2")
    m.residual.extend([h1, h2])
    return h2


def _dropout(t: Tape, cfg: ModelConfig, x: Any, name: str, m: Model | None = None) -> str:
    """Megatron's dropout on ``x``: the dropped tensor (``dropout``) and its keep mask, uint8
    (one byte an element, as the backward keeps it); the gradient is ``dropout_grad(mask,
    out_grad, p)``. The registered ``dropout`` rule has one output, so the mask is made by a
    ``bernoulli`` op of the same shape and layout right after it; it reads the dropout's output
    (not ``x``, whose layout it has). ``m``: ``x`` is a row-parallel projection's output and the
    dropout is on the residual stream: sequence parallel shards ``x`` (its partial sum
    reduce-scattered, as Megatron's row-parallel linear does), the output and the mask on
    the sequence axis; tensor parallel alone all-reduces ``x`` before the dropout."""
    shape = list(t.b.get(x).shape)
    mask = name + ".mask"
    (out,) = t.op("dropout", {"x": x}, [(name, shape, cfg.dtype)], grad_extra={"mask": mask, "p": float(cfg.dropout)})
    t.op("bernoulli", {"x": out}, [(mask, shape, "uint8")])
    assert out is not None and mask is not None
    if m is not None:
        m.residual.extend([x, out, mask])
    return out


def _gpt2_layer(t: Tape, cfg: ModelConfig, i: int, h: str, m: Model) -> str:
    b = t.b
    B, S, H, F = cfg.batch, cfg.seq, cfg.hidden, cfg.ffn
    nh, hd = cfg.heads, cfg.hdim
    dt = cfg.dtype
    p = f"layers.{i}."
    b.layer = f"layer {i}"
    kv = cfg.n_kv * hd
    names = ["ln1.w", "ln1.b", "wq", "wk", "wv", "wo", "ln2.w", "ln2.b", "fc1", "fc2"]
    shapes = [[H], [H], [H, H], [H, kv], [H, kv], [H, H], [H], [H], [H, F], [F, H]]
    roles = ["norm", "norm", "column", "column", "column", "row", "norm", "norm", "column", "row"]
    if cfg.act == "swiglu":
        names, shapes, roles = [*names, "fc1.gate"], [*shapes, [H, F]], [*roles, "column"]
    w = {n: t.param(p + n, s, dt) for n, s in zip(names, shapes)}
    m.roles.update({p + n: r for n, r in zip(names, roles)})
    n1 = _norm(t, cfg, m, h, p + "ln1", w["ln1.w"], w["ln1.b"])
    if cfg.attn == "flash":
        qkv = [t.op("matmul", {"x": n1, "y": w["w" + nm]}, [(p + nm, [B, S, H if nm == "q" else kv], dt)])[0]
               for nm in ("q", "k", "v")]
        assert all(isinstance(x, str) for x in qkv)
        return _gpt2_mlp(t, cfg, m, p, h, _flash_core(t, cfg, m, p, str(qkv[0]), str(qkv[1]), str(qkv[2]), rope=False), w)
    heads: dict[str, str] = {}
    for nm in ("q", "k", "v"):
        (x,) = t.op("matmul", {"x": n1, "y": w["w" + nm]}, [(p + nm, [B, S, H], dt)])
        (x4,) = t.op("reshape", {"x": x}, [(p + nm + "4", [B, S, nh, hd], dt)], shape=(B, S, nh, hd))
        (xt,) = t.op("transpose", {"x": x4}, [(p + nm + "t", [B, nh, S, hd], dt)], perm=(0, 2, 1, 3))
        assert xt is not None
        heads[nm] = xt
    (sc,) = t.op("matmul", {"x": heads["q"], "y": heads["k"]}, [(p + "scores", [B, nh, S, S], dt)], trans_y=True)
    (sc2,) = t.op("scale", {"x": sc}, [(p + "scores.scaled", [B, nh, S, S], dt)])
    (scm,) = t.op("add", {"x": sc2, "y": m.inputs["mask"]}, [(p + "scores.masked", [B, nh, S, S], dt)])
    (pr,) = t.op("softmax", {"x": scm}, [(p + "probs", [B, nh, S, S], dt)], axis=-1)
    if cfg.dropout:
        pr = _dropout(t, cfg, pr, p + "probs.dropout")
    (ctx,) = t.op("matmul", {"x": pr, "y": heads["v"]}, [(p + "ctx", [B, nh, S, hd], dt)])
    (ct,) = t.op("transpose", {"x": ctx}, [(p + "ctx.t", [B, S, nh, hd], dt)], perm=(0, 2, 1, 3))
    (c2,) = t.op("reshape", {"x": ct}, [(p + "ctx2d", [B, S, H], dt)], shape=(B, S, H))
    assert c2 is not None
    return _gpt2_mlp(t, cfg, m, p, h, c2, w)


def _gpt2_mlp(t: Tape, cfg: ModelConfig, m: Model, p: str, h: str, ctx: str, w: dict[str, str]) -> str:
    """A gpt2 layer from its attention's output ``ctx``: the output projection and residual,
    LayerNorm, the MLP (:func:`_mlp_act`) and its residual."""
    h1 = _row_residual(t, cfg, m, ctx, w["wo"], p + "attn_out", h, p + "resid1")
    n2 = _norm(t, cfg, m, h1, p + "ln2", w["ln2.w"], w["ln2.b"])
    act = _mlp_act(t, cfg, n2, w.get("fc1.gate"), w["fc1"], p + "fc1.gate.out", p + "fc1.out", p)
    h2 = _row_residual(t, cfg, m, act, w["fc2"], p + "mlp_out", h1, p + "resid2")
    m.residual.extend([h1, h2])
    return h2


def build_model(cfg: ModelConfig, vocab_parallel_loss: bool = False, optimizer: str = "adamw",
                validate: bool = True, check_rules: bool = True) -> Model:
    """The training step of ``cfg``: forward, backward and one optimizer update per parameter.
    ``vocab_parallel_loss`` uses ``c_softmax_with_cross_entropy`` (for a vocab-sharded head)."""
    cfg.check()
    for k in ("experts", "kv_lora_rank", "qkv_bias", "linear_bias", "embed_norm", "head_dim", "norm", "positions"):
        if getattr(cfg, k) and getattr(cfg, k) != getattr(ModelConfig(cfg.arch), k):  # built in the next commits
            raise ProgramError(f"model: {k} is not built yet")
    if cfg.act == "geglu":
        raise ProgramError("model: activation geglu is not built yet")
    b = ProgramBuilder(f"{cfg.arch} {cfg.layers} layers")
    t = Tape(b)
    m = Model(cfg, Program([], []), {}, [], [], {}, vocab_parallel_loss=vocab_parallel_loss)
    B, S, H, V = cfg.batch, cfg.seq, cfg.hidden, cfg.vocab
    dt = cfg.dtype
    b.layer = "embedding"
    tokens = b.tensor("tokens", [B, S], "int64", "input")
    labels = b.tensor("labels", [B, S, 1], "int64", "input")
    m.inputs.update({"tokens": tokens, "labels": labels})
    emb = t.param("embed", [V, H], dt)
    m.roles[emb] = "embedding"
    (h,) = t.op("embedding", {"x": tokens, "weight": emb}, [("embed.out", [B, S, H], dt)])
    assert h is not None
    if cfg.arch == "llama":
        m.inputs["sin"] = b.tensor("rope.sin", [1, S, 1, cfg.hdim], dt, "input")
        m.inputs["cos"] = b.tensor("rope.cos", [1, S, 1, cfg.hdim], dt, "input")
    else:
        positions = b.tensor("positions", [B, S], "int64", "input")
        m.inputs["positions"] = positions
        if cfg.attn == "eager":  # flash attention masks inside its kernel
            m.inputs["mask"] = b.tensor("causal_mask", [1, 1, S, S], dt, "input")
        wpe = t.param("pos_embed", [S, H], dt)
        m.roles[wpe] = "position"
        (pe,) = t.op("embedding", {"x": positions, "weight": wpe}, [("pos_embed.out", [B, S, H], dt)])
        m.residual.append(h)  # the token embedding's (partial) output joins the residual stream
        (h,) = t.op("add", {"x": h, "y": pe}, [("embed.sum", [B, S, H], dt)])
        assert h is not None
    m.residual.append(h)
    for i in range(cfg.layers):
        h = (_llama_layer if cfg.arch == "llama" else _gpt2_layer)(t, cfg, i, h, m)
    b.layer = "head"
    if cfg.arch == "llama":
        fn = t.param("final_norm", [H], dt)
        m.roles[fn] = "norm"
        nf = _norm(t, cfg, m, h, "final_norm", fn)
    else:
        fw, fb = t.param("final_norm.w", [H], dt), t.param("final_norm.b", [H], dt)
        m.roles.update({fw: "norm", fb: "norm"})
        nf = _norm(t, cfg, m, h, "final_norm", fw, fb)
    if cfg.tied_embeddings:  # the head is the embedding table, transposed
        (logits,) = t.op("matmul", {"x": nf, "y": emb}, [("logits", [B, S, V], dt)], trans_y=True)
    else:
        head = t.param("lm_head", [H, V], dt)
        m.roles[head] = "head"
        (logits,) = t.op("matmul", {"x": nf, "y": head}, [("logits", [B, S, V], dt)])
    if vocab_parallel_loss:
        _, loss_tok = t.op("c_softmax_with_cross_entropy", {"x": logits, "label": labels},
                           [("softmax", [B, S, V], dt), ("loss.token", [B, S, 1], "float32")])
    else:
        _, loss_tok = t.op("cross_entropy_with_softmax", {"x": logits, "label": labels},
                           [("softmax", [B, S, V], dt), ("loss.token", [B, S, 1], "float32")])
    # the loss is the sum of the token losses (a mean differs by a constant factor and shards alike)
    (loss,) = t.op("sum", {"x": loss_tok}, [("loss", [], "float32")], axis=(), keep_dim=False)
    assert loss is not None
    m.loss = loss
    grads = t.backward(loss)
    add_optimizer(b, m, grads, optimizer)
    m.program = b.build(validate=validate, rules=check_rules)
    return m


def add_optimizer(b: ProgramBuilder, m: Model, grads: Mapping[str, str], kind: str) -> None:
    """The optimizer phase: one ``kind`` (sgd, adam, adamw) update per parameter -> gradient of ``grads``."""
    b.phase = "optimizer"
    b.layer = "optimizer"
    lr = b.tensor("learning_rate", [1], "float32", "input")
    for p, g in grads.items():
        t = b.get(p)
        if kind == "sgd":
            b.op("sgd", {"param": p, "learning_rate": lr, "grad": g},
                 [b.tensor(p + ".new", t.shape, t.dtype, "parameter", inplace_of=p), None], name=f"update {p}")
            m.optimizer[p] = (g, (), p + ".new", ())
            continue
        m1 = b.tensor(p + ".moment1", t.shape, "float32", "optimizer_state")
        m2 = b.tensor(p + ".moment2", t.shape, "float32", "optimizer_state")
        b1 = b.tensor(p + ".beta1_pow", [1], "float32", "optimizer_state")
        b2 = b.tensor(p + ".beta2_pow", [1], "float32", "optimizer_state")
        # mixed precision: a parameter below fp32 has an fp32 master copy the update runs on
        # (Paddle's multi_precision), held with the moments (the K = 12 bytes per parameter of
        # ZeRO's mixed-precision Adam: master, moment1, moment2)
        master = None if t.dtype in ("float32", "float64") else \
            b.tensor(p + ".master", t.shape, "float32", "optimizer_state")
        outs = [b.tensor(p + ".new", t.shape, t.dtype, "parameter", inplace_of=p),
                b.tensor(m1 + ".new", t.shape, "float32", "optimizer_state", inplace_of=m1),
                b.tensor(m2 + ".new", t.shape, "float32", "optimizer_state", inplace_of=m2), None,
                b.tensor(b1 + ".new", [1], "float32", "optimizer_state", inplace_of=b1),
                b.tensor(b2 + ".new", [1], "float32", "optimizer_state", inplace_of=b2),
                None if master is None else
                b.tensor(master + ".new", t.shape, "float32", "optimizer_state", inplace_of=master)]
        ins = {"param": p, "grad": g, "learning_rate": lr, "moment1": m1, "moment2": m2,
               "beta1_pow": b1, "beta2_pow": b2}
        extra: dict[str, Any] = {"with_decay": True, "coeff": 0.01} if kind == "adamw" else {}
        if master is not None:
            ins["master_param"] = master
            extra["multi_precision"] = True
        b.op(kind, ins, outs, name=f"update {p}", **extra)
        states = (m1, m2) if master is None else (m1, m2, master)
        m.optimizer[p] = (g, states, p + ".new", tuple(s + ".new" for s in states))


__all__ = ["Model", "ModelConfig", "PRESETS", "add_optimizer", "build_model", "preset"]
