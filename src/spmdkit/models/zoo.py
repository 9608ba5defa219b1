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

The layers are built by :mod:`spmdkit.models.zoo_layers` (attention of any head size, MLA,
norms, positions, biases) and :mod:`spmdkit.models.zoo_moe` (routed and shared experts); the
config is :mod:`spmdkit.models.zoo_config` (docs/models.md, "Architectures").

Variants (:class:`ModelConfig`, ``--model-config``): ``activation`` (``swiglu`` / ``geglu``: gate
and up projections; ``gelu``, ``squared_relu`` (Nemotron, Primer) or ``relu``: one up projection),
``attention`` (``flash``: one fused ``flash_attention`` kernel, no ``s x s`` tensor, as
Megatron-Core, NeMo and torchtitan run it; ``eager``: the scores materialised, as GPT-2 and the
Megatron-LM of 2021-2022 ran it; gpt2 only), ``tied_embeddings`` (the LM head is the token
embedding, transposed), ``head_dim``, ``norm``, ``positions``, ``qkv_bias``, ``linear_bias``,
``embed_norm``, MoE (``experts``, ``top_k``, ``moe_ffn``, ``shared_experts``, ``dense_layers``,
``expert_groups``, ``topk_groups``,
``capacity_factor``) and MLA (``q_lora_rank``, ``kv_lora_rank``, ``qk_rope_head_dim``,
``v_head_dim``). :func:`preset` takes a preset name or a config as a JSON object or a ``.json``
file (:func:`config_from_json`).

Gradients of a tensor read by several ops are summed with ``add_n`` (which keeps a common
partial status, as Megatron sums the partial input gradients of its column-parallel
projections before one all-reduce).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from spmdkit.core.errors import ProgramError
from spmdkit.engine.memo import gc_paused
from spmdkit.models import catalog
from spmdkit.models.hf_config import hf_fields, is_hf_config
from spmdkit.models.zoo_config import ACTIVATIONS, NORMS, POSITIONS, Model, ModelConfig
from spmdkit.models.zoo_layers import (
    NAMES,
    attention,
    cp_order,
    embed,
    final_norm,
    layer_params,
    mlp_act,
    norm,
    row_residual,
)
from spmdkit.models.zoo_linear import gate_attention, gated_delta_net, gdn_params, minus_one_input, record_minus_one
from spmdkit.models.zoo_moe import aux_terms, moe_mlp
from spmdkit.models.zoo_mtp import mtp_modules
from spmdkit.program.autodiff import Tape
from spmdkit.program.ir import Program, ProgramBuilder, RecordedValue

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


#: the fields of a ``--model-config`` and their kinds
_CONFIG_FIELDS = {"base": "str", "name": "str", "arch": "str", "layers": "int", "hidden": "int", "heads": "int",
                  "kv_heads": "int?", "ffn": "int", "vocab": "int", "seq": "int", "batch": "int", "dtype": "str",
                  "dropout": "num", "tied_embeddings": "bool", "activation": "str?", "attention": "str?",
                  "head_dim": "int?", "norm": "str?", "positions": "str?", "qkv_bias": "bool", "linear_bias": "bool",
                  "embed_norm": "bool", "experts": "count", "top_k": "int", "moe_ffn": "int?",
                  "shared_experts": "count", "dense_layers": "count", "capacity_factor": "num?", "aux_loss": "bool",
                  "expert_groups": "int", "topk_groups": "int",
                  "q_lora_rank": "count", "kv_lora_rank": "count", "qk_rope_head_dim": "count", "v_head_dim": "int?",
                  "full_attention_interval": "count", "linear_key_heads": "count", "linear_value_heads": "count",
                  "linear_key_head_dim": "count", "linear_value_head_dim": "count", "linear_conv": "int",
                  "attention_gate": "bool", "shared_expert_gate": "bool", "mtp_layers": "count"}
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
        try:
            cfg = preset(obj["base"])
        except ProgramError as e:  # named as the field it is, not as --model (which was not given)
            msg = str(e)
            raise ProgramError("--model-config base: " + msg.removeprefix("--model: ")) from None
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
    """``cfg`` as a ``--model-config`` JSON object (every field but those the strategy sets:
    context parallelism's, ``--strategy ...,cp``, docs/context.md; the MoE routing chunks of
    ``--strategy megatron,sp,ep,etp=1``, docs/experts.md)."""
    return json.dumps({f.name: getattr(cfg, f.name) for f in fields(cfg) if getattr(cfg, f.name) is not None
                       and f.name not in ("cp", "cp_attention", "cp_balance", "moe_chunks")}, separators=(",", ":"))


def tiny_like(cfg: ModelConfig) -> str:
    """The tiny model of ``cfg``'s architecture (``--verify`` simulates it): a tiny preset, or,
    where ``cfg`` has a variant (activation, attention, tied embeddings, grouped kv heads, head
    size, norm, positions, biases, embedding norm, experts, MLA, MTP), a config of the tiny preset's
    sizes with that variant (4 experts of width 8, MLA ranks 8 / 6, rope part 4, one MTP module)."""
    base = "tiny-llama" if cfg.arch == "llama" else "tiny-gpt-dropout" if cfg.dropout else "tiny-gpt2"
    tiny = PRESETS[base]
    # grouped kv heads: tiny-llama has them already; a grouped gpt2 gets half as many kv heads
    kv = tiny.n_kv if cfg.arch == "llama" else tiny.heads // 2 if cfg.n_kv != cfg.heads else tiny.heads
    variant: dict[str, Any] = {"activation": cfg.act, "attention": cfg.attn, "tied_embeddings": cfg.tied_embeddings,
                               "kv_heads": kv, "norm": cfg.nrm, "positions": cfg.pos}
    variant.update({k: True for k in ("qkv_bias", "linear_bias", "embed_norm") if getattr(cfg, k)})
    if cfg.hdim != cfg.hidden // cfg.heads or cfg.hidden % cfg.heads:
        variant["head_dim"] = 2 * tiny.hdim  # q/k/v wider than hidden, as Gemma's
    if cfg.experts:
        variant.update({"experts": 4, "top_k": min(cfg.top_k, 2), "moe_ffn": 8,
                        "shared_experts": min(cfg.shared_experts, 1), "dense_layers": min(cfg.dense_layers, 1),
                        "capacity_factor": cfg.capacity_factor})
    if cfg.full_attention_interval:  # hybrid Gated DeltaNet: every other layer, grouped key heads
        variant.update({"full_attention_interval": 2, "linear_key_heads": 2, "linear_value_heads": 4,
                        "linear_key_head_dim": 4, "linear_value_head_dim": 4, "linear_conv": min(cfg.linear_conv, 4)})
    variant.update({k: True for k in ("attention_gate", "shared_expert_gate") if getattr(cfg, k)})
    if cfg.mtp_layers:  # one multi-token-prediction module (zoo_mtp)
        variant["mtp_layers"] = 1
    if cfg.mla:
        variant.update({"kv_heads": None, "kv_lora_rank": 8, "q_lora_rank": 6 if cfg.q_lora_rank else 0,
                        "qk_rope_head_dim": 4, "head_dim": 4, "v_head_dim": 6 if cfg.vdim != cfg.hdim else None})
    new = tiny.with_(**variant)
    if new == tiny.with_(activation=tiny.act, attention=tiny.attn, norm=tiny.nrm, positions=tiny.pos):
        return base
    return json.dumps({"base": base, "name": base + " variant", **{k: v for k, v in variant.items() if v is not None
                                                                    or k == "kv_heads"}}, separators=(",", ":"))


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



def decoder_layer(t: Tape, cfg: ModelConfig, i: int, h: str, m: Model, mtp: int | None = None) -> str:
    """Layer ``i`` of ``cfg`` on the residual stream ``h``; the stream after it. ``mtp`` = k: the
    transformer layer of multi-token-prediction module k instead (:mod:`spmdkit.models.zoo_mtp`:
    parameters ``mtp.<k>.*``, its ops labelled ``mtp[k]``, softmax attention, MoE where the model's
    last layer is)."""
    if mtp is None:
        p = f"layers.{i}."
        t.b.layer = f"layer {i}"
        moe, lin = cfg.is_moe_layer(i), cfg.is_linear_layer(i)
    else:
        p = f"mtp.{mtp}."
        t.b.layer = f"mtp[{mtp}]"
        moe, lin = cfg.is_moe_layer(cfg.layers - 1), False
    w = layer_params(t, cfg, m, p, moe, (lambda w: gdn_params(t, cfg, m, p, w)) if lin else None)
    nm = NAMES[cfg.arch]
    n1 = norm(t, cfg, m, h, p + nm["n1"], w["n1"], w["n1.b"])
    if lin:  # Gated DeltaNet (hybrid linear attention, zoo_linear)
        ctx = gated_delta_net(t, cfg, m, p, n1, w)
    else:
        ctx = attention(t, cfg, m, p, n1, w)
        if cfg.attention_gate:
            ctx = gate_attention(t, cfg, p, n1, ctx, w)
    h1 = row_residual(t, cfg, m, ctx, w["o"], w.get("o.b"), p + "attn_out", h, p + "resid1")
    n2 = norm(t, cfg, m, h1, p + nm["n2"], w["n2"], w["n2.b"])
    if moe:
        h2 = moe_mlp(t, cfg, m, p, n2, h1)
    else:
        act = mlp_act(t, cfg, n2, w, nm, p)
        h2 = row_residual(t, cfg, m, act, w["down"], w.get("down.b"), p + "mlp_out", h1, p + "resid2")
    m.residual.extend([h1, h2])
    return h2



@gc_paused
def build_model(cfg: ModelConfig, vocab_parallel_loss: bool = False, optimizer: str = "adamw",
                validate: bool = True, check_rules: bool = True) -> Model:
    """The training step of ``cfg``: forward, backward and one optimizer update per parameter.
    ``vocab_parallel_loss`` uses ``c_softmax_with_cross_entropy`` (for a vocab-sharded head)."""
    cfg.check()
    b = ProgramBuilder(f"{cfg.arch} {cfg.layers} layers")
    t = Tape(b)
    m = Model(cfg, Program([], []), {}, [], [], {}, vocab_parallel_loss=vocab_parallel_loss)
    H, V = cfg.hidden, cfg.vocab
    dt = cfg.dtype
    emb, h = embed(t, cfg, m)
    minus_one_input(t, cfg)
    labels = m.inputs["labels"]
    for i in range(cfg.layers):
        h = decoder_layer(t, cfg, i, h, m)
    nf = final_norm(t, cfg, m, h)
    head = emb if cfg.tied_embeddings else t.param("lm_head", [H, V], dt)  # tied: the table, transposed
    if not cfg.tied_embeddings:
        m.roles[head] = "head"
    loss_tok = head_loss(t, cfg, m, nf, head, labels, "")
    if cfg.mtp_layers:  # the multi-token-prediction modules, their token losses beside the model's
        loss_tok = mtp_modules(t, cfg, m, nf, emb, head, loss_tok, decoder_layer, head_loss)
    # the loss is the sum of the token losses (a mean differs by a constant factor and shards alike)
    if m.aux and loss_tok:  # MoE: the per-sequence load-balancing losses summed with the token losses (zoo_moe)
        loss_tok = aux_terms(t, m, loss_tok)
    (loss,) = t.op("sum", {"x": loss_tok}, [("loss", [], "float32")], axis=(), keep_dim=False)
    assert loss is not None
    m.loss = loss
    grads = t.backward(loss)
    add_optimizer(b, m, grads, optimizer)
    m.program = b.build(validate=validate, rules=check_rules)
    if cfg.cp > 1:
        record_cp_positions(cfg, m.program)
    record_minus_one(m.program)
    return m


def head_loss(t: Tape, cfg: ModelConfig, m: Model, x: str, head: str, labels: str, p: str) -> str:
    """The LM head ``head`` (``[hidden, vocab]``, or the tied ``[vocab, hidden]`` embedding,
    transposed) on the normalised ``x`` and the cross entropy against ``labels``
    (``c_softmax_with_cross_entropy`` where the head is vocab-parallel): the token losses [B, S, 1]
    (``p + "loss.token"``)."""
    B, S, V, dt = cfg.batch, cfg.seq, cfg.vocab, cfg.dtype
    tied: dict[str, Any] = {"trans_y": True} if cfg.tied_embeddings else {}
    (logits,) = t.op("matmul", {"x": x, "y": head}, [(p + "logits", [B, S, V], dt)], **tied)
    rule = "c_softmax_with_cross_entropy" if m.vocab_parallel_loss else "cross_entropy_with_softmax"
    _, loss_tok = t.op(rule, {"x": logits, "label": labels},
                       [(p + "softmax", [B, S, V], dt), (p + "loss.token", [B, S, 1], "float32")])
    assert loss_tok is not None
    return loss_tok


def record_cp_positions(cfg: ModelConfig, prog: Program) -> None:
    """The positions each token holds under context parallelism (:func:`cp_order`: the zig-zag
    order), recorded as the values of the inputs that carry them: ``cp.positions`` /
    ``cp.key_positions``, the learned ``positions`` (each row), and an eager model's
    ``causal_mask`` (0 where the key's position is at most the query's, -1e4 elsewhere; recorded up
    to 2,048 tokens). The rope tables' rows follow ``cp.positions``
    (:func:`spmdkit.sim.plan.source_values`)."""
    order = cp_order(cfg)
    S = len(order)
    data = struct.pack(f"<{S}q", *order)
    for n in ("cp.positions", "cp.key_positions"):
        if n in prog.tensors:
            prog.values[n] = RecordedValue("int64", (S,), data)
    if "positions" in prog.tensors:
        prog.values["positions"] = RecordedValue("int64", (cfg.batch, S), data * cfg.batch)
    if "causal_mask" in prog.tensors and S <= 2048:
        mask = [0.0 if kp <= qp else -1e4 for qp in order for kp in order]
        prog.values["causal_mask"] = RecordedValue("float32", (1, 1, S, S), struct.pack(f"<{S * S}f", *mask))


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


__all__ = ["ACTIVATIONS", "NORMS", "POSITIONS", "Model", "ModelConfig", "PRESETS", "add_optimizer", "build_model", "decoder_layer",
           "preset"]
