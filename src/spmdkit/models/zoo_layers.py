"""The zoo's layers: the embedding, one decoder layer of any variant :class:`ModelConfig`
describes, the final norm.

A decoder layer is ``h + attn(norm(h))`` then ``+ mlp(norm(.))`` (pre-norm, as GPT-2, LLaMA,
BLOOM, Gemma, DeepSeek). Its variants:

- norm: ``rms`` (``fused_rms_norm``, a scale) or ``layer`` (``layer_norm``, a scale and a bias);
- attention: ``flash`` (one ``flash_attention`` kernel, grouped kv heads) or ``eager`` (the
  scores materialised, softmax, gpt2 only); heads of ``head_dim`` (q/k/v ``heads x head_dim``
  wide, the output projection ``[heads x head_dim, hidden]``); MLA (:func:`_mla`) where
  ``kv_lora_rank > 0``;
- positions: ``rope`` (``fused_rotary_position_embedding`` on q and k), ``learned`` (a position
  table added to the token embedding), ``alibi`` or ``none``. ALiBi under flash attention is
  modelled as flash attention without a mask: the kernels that train BLOOM-like models
  (FlashAttention-2's ``alibi_slopes``, Megatron's fused softmax) add the bias per head inside the
  kernel from a slope per head, so it adds no parameter, no stored tensor and no communication
  (the heads are sharded as without it); under eager attention the bias is an input
  ``alibi_mask [1, heads, s, s]`` added to the scores in place of the causal mask (BLOOM's
  ``baddbmm``), sharded with the heads;
- MLP: ``swiglu`` / ``geglu`` (gate and up projections, ``silu`` / ``gelu`` of the gate times
  up) or ``gelu`` / ``relu`` / ``squared_relu`` of one up projection; routed experts in the
  layers past ``dense_layers`` (:mod:`spmdkit.models.zoo_moe`);
- biases: ``qkv_bias`` (q, k, v), ``linear_bias`` (every linear layer but the LM head), each
  added to its projection's output (role ``column_bias`` after a column-parallel projection:
  sharded with its output features; ``bias`` after a row-parallel one: replicated, added after
  the partial sums are reduced, as Megatron's RowParallelLinear adds it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from spmdkit.models.zoo_config import Model, ModelConfig
from spmdkit.program.autodiff import Tape

#: per arch: the short names of a layer's parameters -> their names in the program
NAMES = {
    "llama": {"n1": "attn_norm", "n2": "mlp_norm", "q": "wq", "k": "wk", "v": "wv", "o": "wo", "gate": "w_gate",
              "up": "w_up", "down": "w_down", "gate.out": "gate", "up.out": "up"},
    "gpt2": {"n1": "ln1", "n2": "ln2", "q": "wq", "k": "wk", "v": "wv", "o": "wo", "gate": "fc1.gate", "up": "fc1",
             "down": "fc2", "gate.out": "fc1.gate.out", "up.out": "fc1.out"},
}
GATED = ("swiglu", "geglu")


def norm_params(t: Tape, cfg: ModelConfig, m: Model, name: str, size: int, kind: str | None = None) -> tuple[str, str | None]:
    """A norm's scale (and bias for a layer norm) named as ``cfg``'s arch names them (llama
    ``name`` / ``name.bias``, gpt2 ``name.w`` / ``name.b``), role ``norm``."""
    layer = (kind or cfg.nrm) == "layer"
    s, bn = (name, name + ".bias") if cfg.arch == "llama" else (name + ".w", name + ".b")
    scale = t.param(s, [size], cfg.dtype)
    m.roles[scale] = "norm"
    bias = t.param(bn, [size], cfg.dtype) if layer else None
    if bias is not None:
        m.roles[bias] = "norm"
    return scale, bias


def norm(t: Tape, cfg: ModelConfig, m: Model | None, x: str, name: str, scale: str, bias: str | None = None) -> str:
    """``x`` normalised over its last axis: RMS norm without ``bias``, layer norm with it; its
    outputs ``<name>.out`` and the float32 statistics; recorded among the norm outputs where
    ``m`` is given (they feed column-parallel projections)."""
    shape = list(t.b.get(x).shape)
    out = (name + ".out", shape, cfg.dtype)
    if bias is None:
        n, _ = t.op("fused_rms_norm", {"x": x, "scale": scale}, [out, (name + ".invvar", shape[:-1], "float32")],
                    epsilon=1e-6)
    else:
        n, _, _ = t.op("layer_norm", {"x": x, "scale": scale, "bias": bias},
                       [out, (name + ".mean", shape[:-1], "float32"), (name + ".var", shape[:-1], "float32")],
                       epsilon=1e-5, begin_norm_axis=len(shape) - 1)
    assert n is not None
    if m is not None:
        m.norm_outputs.append(n)
    return n


def linear(t: Tape, cfg: ModelConfig, x: str, w: str, bias: str | None, name: str) -> str:
    """``x @ w`` (named ``name``), plus ``bias`` where given (``name.biased``)."""
    xs, ws = t.b.get(x).shape, t.b.get(w).shape
    shape = [*xs[:-1], ws[-1]]
    (y,) = t.op("matmul", {"x": x, "y": w}, [(name, shape, cfg.dtype)])
    if bias is not None:
        (y,) = t.op("add", {"x": y, "y": bias}, [(name + ".biased", shape, cfg.dtype)])
    assert y is not None
    return y


def row_residual(t: Tape, cfg: ModelConfig, m: Model, x: Any, weight: str, bias: str | None, name: str, h: str,
                 resid: str) -> str:
    """The row-parallel projection ``x @ weight`` (``name``, recorded among the row outputs;
    its bias added; dropped out where cfg.dropout) added to the residual stream ``h`` as ``resid``."""
    B, S, H, dt = cfg.batch, cfg.seq, cfg.hidden, cfg.dtype
    (o,) = t.op("matmul", {"x": x, "y": weight}, [(name, [B, S, H], dt)])
    m.row_outputs.append(name)
    if bias is not None:
        (o,) = t.op("add", {"x": o, "y": bias}, [(name + ".biased", [B, S, H], dt)])
    if cfg.dropout:
        o = dropout(t, cfg, o, name + ".dropout", m)
    (r,) = t.op("add", {"x": h, "y": o}, [(resid, [B, S, H], dt)])
    assert r is not None
    return r


def mlp_act(t: Tape, cfg: ModelConfig, x: str, w: dict[str, Any], names: dict[str, str], p: str) -> str:
    """The MLP up to its down projection: ``act(x @ w_gate) * (x @ w_up)`` (swiglu, geglu) or
    the activation (gelu, relu, squared ReLU) of ``x @ w_up``, biases added where ``w`` has
    them (``gate.b``, ``up.b``); the projections named ``names["gate.out"]`` / ``["up.out"]``
    (with ``p``), then the activation ``p + act``. Any leading shape (tokens, or experts x
    capacity)."""
    a = cfg.act
    if a in GATED:
        g = linear(t, cfg, x, w["gate"], w.get("gate.b"), p + names["gate.out"])
        u = linear(t, cfg, x, w["up"], w.get("up.b"), p + names["up.out"])
        shape, dt = list(t.b.get(u).shape), cfg.dtype
        if a == "swiglu":
            (out,) = t.op("swiglu", {"x": g, "y": u}, [(p + "swiglu", shape, dt)])
        else:
            (ge,) = t.op("gelu", {"x": g}, [(p + "gelu", shape, dt)], approximate=True)
            (out,) = t.op("multiply", {"x": ge, "y": u}, [(p + "geglu", shape, dt)])
    else:
        u = linear(t, cfg, x, w["up"], w.get("up.b"), p + names["up.out"])
        shape, dt = list(t.b.get(u).shape), cfg.dtype
        if a == "gelu":
            (out,) = t.op("gelu", {"x": u}, [(p + "gelu", shape, dt)], approximate=True)
        else:
            (out,) = t.op("relu", {"x": u}, [(p + "relu", shape, dt)])
            if a == "squared_relu":
                (out,) = t.op("square", {"x": out}, [(p + "relu.sq", shape, dt)])
    assert out is not None
    return out


def rope(t: Tape, m: Model, x: str, name: str) -> str:
    """``x`` [b, s, heads, d] rotated by the model's sin / cos (neox style)."""
    out, _, _ = t.op("fused_rotary_position_embedding",
                     {"q": x, "k": None, "v": None, "sin": m.inputs["sin"], "cos": m.inputs["cos"]},
                     [(name, list(t.b.get(x).shape), t.b.get(x).dtype), None, None], use_neox_rotary_style=True)
    assert out is not None
    return out


def flash(t: Tape, cfg: ModelConfig, p: str, q4: str, k4: str, v4: str) -> str:
    """Causal ``flash_attention`` of [b, s, heads, d] q / k / v; the output as [b, s, heads x dv]."""
    B, S, nh, dt = cfg.batch, cfg.seq, cfg.heads, cfg.dtype
    dv = t.b.get(v4).shape[-1]
    if cfg.cp > 1:  # context parallel: attention at the positions the (permuted) tokens hold
        att, _ = t.op("cp_attention", {"q": q4, "k": k4, "v": v4, "q_positions": "cp.positions",
                                       "k_positions": "cp.key_positions"},
                      [(p + "attn", [B, S, nh, dv], dt), (p + "attn.lse", [B, nh, S], "float32")],
                      causal=True, variant=cfg.cp_attention, balance=cfg.cp_balance)
        (a2,) = t.op("reshape", {"x": att}, [(p + "attn2d", [B, S, nh * dv], dt)], shape=(B, S, nh * dv))
        assert a2 is not None
        return a2
    att, _, _, _ = t.op("flash_attention", {"q": q4, "k": k4, "v": v4},
                        [(p + "attn", [B, S, nh, dv], dt), None, (p + "attn.lse", [B, nh, S], "float32"),
                         (p + "attn.seed_offset", [2], "int64")], causal=True)
    (a2,) = t.op("reshape", {"x": att}, [(p + "attn2d", [B, S, nh * dv], dt)], shape=(B, S, nh * dv))
    assert a2 is not None
    return a2


def _flash_core(t: Tape, cfg: ModelConfig, m: Model, p: str, q: str, k: str, v: str) -> str:
    """Causal ``flash_attention`` of the projections ``q`` / ``k`` / ``v`` ([B, S, heads x
    head_dim], kv heads grouped), rotated first under rope; the output as [B, S, heads x head_dim]."""
    B, S, nh, nkv, hd, dt = cfg.batch, cfg.seq, cfg.heads, cfg.n_kv, cfg.hdim, cfg.dtype
    (q4,) = t.op("reshape", {"x": q}, [(p + "q4", [B, S, nh, hd], dt)], shape=(B, S, nh, hd))
    (k4,) = t.op("reshape", {"x": k}, [(p + "k4", [B, S, nkv, hd], dt)], shape=(B, S, nkv, hd))
    (v4,) = t.op("reshape", {"x": v}, [(p + "v4", [B, S, nkv, hd], dt)], shape=(B, S, nkv, hd))
    assert q4 is not None and k4 is not None and v4 is not None
    if cfg.pos == "rope":  # q and k rotated by separate calls: with grouped kv heads their head counts differ
        q4, k4 = rope(t, m, q4, p + "q_rope"), rope(t, m, k4, p + "k_rope")
    return flash(t, cfg, p, q4, k4, v4)


def _eager(t: Tape, cfg: ModelConfig, m: Model, p: str, n1: str, w: dict[str, Any]) -> str:
    """Eager attention (gpt2) of the normalised ``n1``: the q, k, v projections, scores ``q
    k^T``, scaled, the causal mask (or ALiBi bias) added, softmax (dropped out where
    cfg.dropout), times v; [B, S, heads x head_dim]."""
    B, S, nh, hd, dt = cfg.batch, cfg.seq, cfg.heads, cfg.hdim, cfg.dtype
    heads: dict[str, str] = {}
    for nm in ("q", "k", "v"):
        x = linear(t, cfg, n1, w[nm], w.get(nm + ".b"), p + nm)
        (x4,) = t.op("reshape", {"x": x}, [(p + nm + "4", [B, S, nh, hd], dt)], shape=(B, S, nh, hd))
        (xt,) = t.op("transpose", {"x": x4}, [(p + nm + "t", [B, nh, S, hd], dt)], perm=(0, 2, 1, 3))
        assert xt is not None
        heads[nm] = xt
    (sc,) = t.op("matmul", {"x": heads["q"], "y": heads["k"]}, [(p + "scores", [B, nh, S, S], dt)], trans_y=True)
    (sc2,) = t.op("scale", {"x": sc}, [(p + "scores.scaled", [B, nh, S, S], dt)])
    (scm,) = t.op("add", {"x": sc2, "y": m.inputs["mask"]}, [(p + "scores.masked", [B, nh, S, S], dt)])
    (pr,) = t.op("softmax", {"x": scm}, [(p + "probs", [B, nh, S, S], dt)], axis=-1)
    if cfg.dropout:
        pr = dropout(t, cfg, pr, p + "probs.dropout")
    (ctx,) = t.op("matmul", {"x": pr, "y": heads["v"]}, [(p + "ctx", [B, nh, S, hd], dt)])
    (ct,) = t.op("transpose", {"x": ctx}, [(p + "ctx.t", [B, S, nh, hd], dt)], perm=(0, 2, 1, 3))
    (c2,) = t.op("reshape", {"x": ct}, [(p + "ctx2d", [B, S, nh * hd], dt)], shape=(B, S, nh * hd))
    assert c2 is not None
    return c2


def _split(t: Tape, x: str, sizes: tuple[int, ...], names: tuple[str, ...]) -> list[str]:
    """``x`` split on its last axis into pieces of ``sizes``."""
    xt = t.b.get(x)
    outs = [[(n, [*xt.shape[:-1], s], xt.dtype) for n, s in zip(names, sizes)]]
    (pieces,) = t.op("split", {"x": x}, outs, sections=sizes, axis=len(xt.shape) - 1)
    assert isinstance(pieces, (list, tuple))
    return [str(n) for n in pieces]


def _mla(t: Tape, cfg: ModelConfig, m: Model, p: str, x: str, w: dict[str, Any]) -> str:
    """Multi-head latent attention (DeepSeek-V2/V3): q from ``x @ wq`` (or ``rmsnorm(x @ wq_a)
    @ wq_b`` with q_lora_rank), heads of head_dim + qk_rope_head_dim (the rope part rotated);
    the latent ``x @ wkv_a`` split into the kv latent (normalised, then ``@ wkv_b``: k's
    non-rotary part and v per head) and k's rope part, rotated and shared by the heads;
    causal flash attention with v heads of v_head_dim; [B, S, heads x v_head_dim]."""
    B, S, nh, dt = cfg.batch, cfg.seq, cfg.heads, cfg.dtype
    dn, dr, dv, r = cfg.hdim, cfg.qk_rope_head_dim, cfg.vdim, cfg.kv_lora_rank
    if cfg.q_lora_rank:
        cq = linear(t, cfg, x, w["wq_a"], None, p + "q_latent")
        q = linear(t, cfg, norm(t, cfg, None, cq, p + "q_norm", w["q_norm"]), w["wq_b"], None, p + "q")
    else:
        q = linear(t, cfg, x, w["q"], None, p + "q")
    (q4,) = t.op("reshape", {"x": q}, [(p + "q4", [B, S, nh, dn + dr], dt)], shape=(B, S, nh, dn + dr))
    assert q4 is not None
    q_nope, q_pe = _split(t, q4, (dn, dr), (p + "q_nope", p + "q_pe"))
    ckv = linear(t, cfg, x, w["wkv_a"], None, p + "kv_latent")
    c, k_pe = _split(t, ckv, (r, dr), (p + "kv_c", p + "k_pe"))
    kv = linear(t, cfg, norm(t, cfg, None, c, p + "kv_norm", w["kv_norm"]), w["wkv_b"], None, p + "kv")
    (kv4,) = t.op("reshape", {"x": kv}, [(p + "kv4", [B, S, nh, dn + dv], dt)], shape=(B, S, nh, dn + dv))
    assert kv4 is not None
    k_nope, v4 = _split(t, kv4, (dn, dv), (p + "k_nope", p + "v4"))
    (kp4,) = t.op("reshape", {"x": k_pe}, [(p + "k_pe4", [B, S, 1, dr], dt)], shape=(B, S, 1, dr))
    assert kp4 is not None
    kr = rope(t, m, kp4, p + "k_rope")
    (ke,) = t.op("expand", {"x": kr}, [(p + "k_rope.heads", [B, S, nh, dr], dt)], shape=(B, S, nh, dr))
    qr = rope(t, m, q_pe, p + "q_rope")
    (qf,) = t.op("concat", {"x": (q_nope, qr)}, [(p + "q_full", [B, S, nh, dn + dr], dt)], axis=3)
    (kf,) = t.op("concat", {"x": (k_nope, ke)}, [(p + "k_full", [B, S, nh, dn + dr], dt)], axis=3)
    assert qf is not None and kf is not None
    return flash(t, cfg, p, qf, kf, v4)


def attention(t: Tape, cfg: ModelConfig, m: Model, p: str, x: str, w: dict[str, Any]) -> str:
    """The attention of the normalised ``x`` up to its output projection: MLA, flash or eager."""
    if cfg.mla:
        return _mla(t, cfg, m, p, x, w)
    if cfg.attn == "eager":
        return _eager(t, cfg, m, p, x, w)
    q, k, v = (linear(t, cfg, x, w[k], w.get(k + ".b"), p + k) for k in ("q", "k", "v"))
    return _flash_core(t, cfg, m, p, q, k, v)


def layer_params(t: Tape, cfg: ModelConfig, m: Model, p: str, moe: bool,
                 mixer: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """A layer's parameters (short name -> program name) with their roles, in the order the
    arch has always declared them (norm, attention, norm, MLP); ``mixer``: declares another
    token mixer's in place of attention's (Gated DeltaNet: :func:`spmdkit.models.zoo_linear.gdn_params`)."""
    H, F, dt, nm = cfg.hidden, cfg.ffn, cfg.dtype, NAMES[cfg.arch]
    nh, nkv, hd = cfg.heads, cfg.n_kv, cfg.hdim
    w: dict[str, Any] = {}

    def par(key: str, shape: list[int], role: str, bias: bool = False) -> None:
        w[key] = t.param(p + nm.get(key, key), shape, dt)
        m.roles[w[key]] = role
        if bias:
            w[key + ".b"] = t.param(w[key] + ".bias", [shape[-1]], dt)
            m.roles[w[key + ".b"]] = "column_bias" if role == "column" else "bias"

    w["n1"], w["n1.b"] = norm_params(t, cfg, m, p + nm["n1"], H)
    qkvb = cfg.qkv_bias or cfg.linear_bias
    if mixer is not None:
        mixer(w)
    elif cfg.mla:
        dn, dr, dv, r, qr = cfg.hdim, cfg.qk_rope_head_dim, cfg.vdim, cfg.kv_lora_rank, cfg.q_lora_rank
        if qr:
            par("wq_a", [H, qr], "replicated")
            w["q_norm"], _ = norm_params(t, cfg, m, p + "q_norm", qr, "rms")
            par("wq_b", [qr, nh * (dn + dr)], "column")
        else:
            par("q", [H, nh * (dn + dr)], "column")
        par("wkv_a", [H, r + dr], "replicated")
        w["kv_norm"], _ = norm_params(t, cfg, m, p + "kv_norm", r, "rms")
        par("wkv_b", [r, nh * (dn + dv)], "column")
        par("o", [nh * dv, H], "row", cfg.linear_bias)
    else:
        par("q", [H, nh * hd], "column", qkvb)
        par("k", [H, nkv * hd], "column", qkvb)
        par("v", [H, nkv * hd], "column", qkvb)
        par("o", [nh * hd, H], "row", cfg.linear_bias)
        if cfg.attention_gate:
            par("attn_gate", [H, nh * hd], "column")
    w["n2"], w["n2.b"] = norm_params(t, cfg, m, p + nm["n2"], H)
    if not moe:
        lb = cfg.linear_bias
        if cfg.act in GATED and cfg.arch == "llama":
            par("gate", [H, F], "column", lb)
        par("up", [H, F], "column", lb)
        par("down", [F, H], "row", lb)
        if cfg.act in GATED and cfg.arch != "llama":
            par("gate", [H, F], "column", lb)
    return w


def dropout(t: Tape, cfg: ModelConfig, x: Any, name: str, m: Model | None = None) -> str:
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


def embed(t: Tape, cfg: ModelConfig, m: Model) -> tuple[str, str]:
    """The inputs (tokens, labels, the positions' inputs), the token embedding (and the
    learned positions, the embedding norm): (the embedding table, the residual stream)."""
    b = t.b
    B, S, H, V, dt = cfg.batch, cfg.seq, cfg.hidden, cfg.vocab, cfg.dtype
    b.layer = "embedding"
    tokens = b.tensor("tokens", [B, S], "int64", "input")
    labels = b.tensor("labels", [B, S, 1], "int64", "input")
    m.inputs.update({"tokens": tokens, "labels": labels})
    emb = t.param("embed", [V, H], dt)
    m.roles[emb] = "embedding"
    (h,) = t.op("embedding", {"x": tokens, "weight": emb}, [("embed.out", [B, S, H], dt)])
    assert h is not None
    if cfg.pos == "rope":
        d = cfg.qk_rope_head_dim if cfg.mla else cfg.hdim
        m.inputs["sin"] = b.tensor("rope.sin", [1, S, 1, d], dt, "input")
        m.inputs["cos"] = b.tensor("rope.cos", [1, S, 1, d], dt, "input")
    if cfg.pos == "learned":
        m.inputs["positions"] = b.tensor("positions", [B, S], "int64", "input")
    if cfg.cp > 1 and cfg.attn == "flash":  # each token's place in the sequence (cp_attention's mask)
        m.inputs["cp_positions"] = b.tensor("cp.positions", [S], "int64", "input")
        m.inputs["cp_key_positions"] = b.tensor("cp.key_positions", [S], "int64", "input")
    if cfg.attn == "eager":  # flash attention masks inside its kernel (and adds ALiBi's bias there)
        nh = cfg.heads if cfg.pos == "alibi" else 1
        name = "alibi_mask" if cfg.pos == "alibi" else "causal_mask"
        m.inputs["mask"] = b.tensor(name, [1, nh, S, S], dt, "input")
    if cfg.pos == "learned":
        wpe = t.param("pos_embed", [S, H], dt)
        m.roles[wpe] = "position"
        (pe,) = t.op("embedding", {"x": m.inputs["positions"], "weight": wpe}, [("pos_embed.out", [B, S, H], dt)])
        m.residual.append(h)  # the token embedding's (partial) output joins the residual stream
        (h,) = t.op("add", {"x": h, "y": pe}, [("embed.sum", [B, S, H], dt)])
        assert h is not None
    if cfg.embed_norm:  # BLOOM's word_embeddings_layernorm: a LayerNorm on the residual stream
        m.residual.append(h)
        scale, bias = norm_params(t, cfg, m, "embed_norm", H, "layer")
        h = norm(t, cfg, None, h, "embed_norm", scale, bias)
    m.residual.append(h)
    return emb, h


def cp_order(cfg: ModelConfig) -> list[int]:
    """The sequence's positions in the order the tokens are laid out: under ``cp_balance``
    zigzag (cp > 1) rank i of cp holds chunks i and 2cp-1-i of 2cp, so the global order is
    chunk 0, 2cp-1, 1, 2cp-2, ...; else 0, 1, ..."""
    S, n = cfg.seq, cfg.cp
    if n <= 1 or cfg.cp_balance != "zigzag":
        return list(range(S))
    c = S // (2 * n)
    return [p for i in range(n) for j in (i, 2 * n - 1 - i) for p in range(j * c, (j + 1) * c)]


def final_norm(t: Tape, cfg: ModelConfig, m: Model, h: str) -> str:
    """The final norm of the residual stream ``h`` (llama ``final_norm``, gpt2
    ``final_norm.w`` / ``.b``)."""
    t.b.layer = "head"
    scale, bias = norm_params(t, cfg, m, "final_norm", cfg.hidden)
    return norm(t, cfg, m, h, "final_norm", scale, bias)


__all__ = ["cp_order", "GATED", "NAMES", "attention", "dropout", "layer_params", "embed", "final_norm", "linear", "mlp_act", "norm",
           "norm_params", "row_residual"]
