"""The zoo's hybrid linear attention: Qwen3-Next's Gated DeltaNet layer (HF transformers'
``Qwen3NextGatedDeltaNet``, Megatron-Core's ``GatedDeltaNet``) and the output gate of its softmax
attention layers.

A Gated DeltaNet layer (``ModelConfig.is_linear_layer``) in place of attention, on the
normalised ``x`` ``[B, S, hidden]``, with ``nk`` key heads of ``dk`` and ``nv`` value heads of
``dv`` (``Kd = nk dk``, ``Vd = nv dv``)::

    q, k = x @ wq, x @ wk                 [hidden, Kd] each   (column-parallel)
    v, z = x @ wv, x @ wz                 [hidden, Vd] each   (column-parallel; z the output gate)
    b, a = x @ wb, x @ wa                 [hidden, nv] each   (column-parallel)
    q, k, v = causal_conv1d(., conv_q / conv_k / conv_v)   width linear_conv, silu
    q, k repeated to nv heads (each key head serves nv / nk value heads, HF's repeat_interleave)
    g = -exp(A_log) softplus(a + dt_bias)   beta = sigmoid(b)        (A_log, dt_bias: [nv])
    o = gated_delta_rule(q, k, v, g, beta)  (q / k l2-normalised in the kernel, chunk 64)
    o = rms_norm(o over dv, norm [dv]) * silu(z)                      (HF's RMSNormGated)
    -> [B, S, Vd], then the row-parallel out projection ``wo`` [Vd, hidden]

HF and Megatron-Core hold q, k, v, z in one projection (``in_proj_qkvz``, Megatron's ``in_proj``
with b and a too) and convolve q, k, v as one tensor of 2 Kd + Vd channels; here each is its own
parameter (the same parameters, the same FLOPs in smaller GEMMs), so that tensor parallelism
splits each along its heads as Megatron's interleaved layout does. The convolution filters are
stored ``[width, channels]`` and, with dt_bias and A_log, sharded with the heads (role
``column_bias``); the gated norm's scale is replicated (role ``norm``). ``-1`` is the recorded
0-d input ``gdn.minus_one`` (the zoo has no negation op).
"""

from __future__ import annotations

import struct
from typing import Any

from spmdkit.models.zoo_config import Model, ModelConfig
from spmdkit.models.zoo_layers import linear, norm
from spmdkit.program.autodiff import Tape
from spmdkit.program.ir import Program, RecordedValue

#: the recorded -1 the decay is negated by
MINUS_ONE = "gdn.minus_one"


def gdn_params(t: Tape, cfg: ModelConfig, m: Model, p: str, w: dict[str, Any]) -> None:
    """A Gated DeltaNet layer's parameters into ``w`` (short name -> program name), with roles."""
    H, dt = cfg.hidden, cfg.dtype
    nk, nv, dk, dv = cfg.linear_key_heads, cfg.linear_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim

    def par(key: str, shape: list[int], role: str) -> None:
        w[key] = t.param(p + "gdn." + key, shape, dt)
        m.roles[w[key]] = role

    for key, width in (("wq", nk * dk), ("wk", nk * dk), ("wv", nv * dv), ("wz", nv * dv), ("wb", nv), ("wa", nv)):
        par(key, [H, width], "column")
    for key, width in (("conv_q", nk * dk), ("conv_k", nk * dk), ("conv_v", nv * dv)):
        par(key, [cfg.linear_conv, width], "column_bias")
    par("dt_bias", [nv], "column_bias")
    par("A_log", [nv], "column_bias")
    par("norm", [dv], "norm")
    w["o"] = t.param(p + "gdn.wo", [nv * dv, H], dt)
    m.roles[w["o"]] = "row"


def _op(t: Tape, rule: str, ins: dict[str, Any], name: str, out: list[int], dt: str, **attrs: Any) -> str:
    (y,) = t.op(rule, ins, [(name, out, dt)], **attrs)
    assert y is not None
    return y


def _heads(t: Tape, x: str, name: str, B: int, S: int, n: int, d: int, rep: int, dt: str) -> str:
    """``x`` [B, S, n d] as [B, S, n rep, d]: each head repeated ``rep`` times in place (HF's
    ``repeat_interleave`` on the heads)."""
    x4 = _op(t, "reshape", {"x": x}, name + "4", [B, S, n, d], dt, shape=(B, S, n, d))
    if rep == 1:
        return x4
    x5 = _op(t, "reshape", {"x": x4}, name + "5", [B, S, n, 1, d], dt, shape=(B, S, n, 1, d))
    xe = _op(t, "expand", {"x": x5}, name + ".rep", [B, S, n, rep, d], dt, shape=(B, S, n, rep, d))
    return _op(t, "reshape", {"x": xe}, name + ".heads", [B, S, n * rep, d], dt, shape=(B, S, n * rep, d))


def gated_delta_net(t: Tape, cfg: ModelConfig, m: Model, p: str, x: str, w: dict[str, Any]) -> str:
    """The Gated DeltaNet of the normalised ``x`` up to its out projection (module docstring):
    [B, S, Vd]."""
    B, S, dt = cfg.batch, cfg.seq, cfg.dtype
    nk, nv, dk, dv = cfg.linear_key_heads, cfg.linear_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    g = p + "gdn."
    proj = {k: linear(t, cfg, x, w[k], None, g + k[1:]) for k in ("wq", "wk", "wv", "wz", "wb", "wa")}
    conv = {k: _op(t, "causal_conv1d", {"x": proj["w" + k], "weight": w["conv_" + k]}, g + k + ".conv",
                   list(t.b.get(proj["w" + k]).shape), dt, activation="silu") for k in ("q", "k", "v")}
    q4 = _heads(t, conv["q"], g + "q", B, S, nk, dk, nv // nk, dt)
    k4 = _heads(t, conv["k"], g + "k", B, S, nk, dk, nv // nk, dt)
    v4 = _heads(t, conv["v"], g + "v", B, S, nv, dv, 1, dt)
    ab = _op(t, "add", {"x": proj["wa"], "y": w["dt_bias"]}, g + "a.biased", [B, S, nv], dt)
    sp = _op(t, "softplus", {"x": ab}, g + "a.softplus", [B, S, nv], dt)
    rate = _op(t, "exp", {"x": w["A_log"]}, g + "A", [nv], dt)
    neg = _op(t, "multiply", {"x": rate, "y": MINUS_ONE}, g + "A.neg", [nv], dt)
    decay = _op(t, "multiply", {"x": sp, "y": neg}, g + "decay", [B, S, nv], dt)
    beta = _op(t, "sigmoid", {"x": proj["wb"]}, g + "beta", [B, S, nv], dt)
    out, _ = t.op("gated_delta_rule", {"q": q4, "k": k4, "v": v4, "g": decay, "beta": beta},
                  [(g + "core", [B, S, nv, dv], dt), (g + "wy", [B, S, nv, 64], dt)], chunk_size=64, qk_l2norm=True)
    assert out is not None
    normed = norm(t, cfg, None, out, g + "out_norm", w["norm"])
    z4 = _op(t, "reshape", {"x": proj["wz"]}, g + "z4", [B, S, nv, dv], dt, shape=(B, S, nv, dv))
    zs = _op(t, "silu", {"x": z4}, g + "z.silu", [B, S, nv, dv], dt)
    gated = _op(t, "multiply", {"x": normed, "y": zs}, g + "gated", [B, S, nv, dv], dt)
    return _op(t, "reshape", {"x": gated}, g + "out2d", [B, S, nv * dv], dt, shape=(B, S, nv * dv))


def gate_attention(t: Tape, cfg: ModelConfig, p: str, x: str, ctx: str, w: dict[str, Any]) -> str:
    """Softmax attention's output ``ctx`` [B, S, heads x head_dim] times ``sigmoid(x @
    w_attn_gate)`` (Qwen3-Next's ``attn_output_gate``: HF's q_proj makes the gate beside q)."""
    shape, dt = list(t.b.get(ctx).shape), cfg.dtype
    gl = linear(t, cfg, x, w["attn_gate"], None, p + "attn_gate.logit")
    gs = _op(t, "sigmoid", {"x": gl}, p + "attn_gate.sigmoid", shape, dt)
    return _op(t, "multiply", {"x": ctx, "y": gs}, p + "attn.gated", shape, dt)


def minus_one_input(t: Tape, cfg: ModelConfig) -> None:
    """The 0-d input ``gdn.minus_one`` in the model's dtype (its value recorded by
    :func:`record_minus_one`), where a layer is Gated DeltaNet."""
    if any(cfg.is_linear_layer(i) for i in range(cfg.layers)):
        t.b.tensor(MINUS_ONE, [], cfg.dtype, "input")


def record_minus_one(prog: Program) -> None:
    """The value of ``gdn.minus_one`` (where the program has it): -1 in its dtype's storage."""
    t = prog.tensors.get(MINUS_ONE)
    if t is None:
        return
    fmt = {"float64": "<d", "float32": "<f", "float16": "<e"}.get(t.dtype)
    data = struct.pack(fmt, -1.0) if fmt else struct.pack("<H", 0xBF80)  # bfloat16 -1: 0xBF80
    prog.values[MINUS_ONE] = RecordedValue(t.dtype, (), data)


__all__ = ["MINUS_ONE", "gate_attention", "gated_delta_net", "gdn_params", "minus_one_input", "record_minus_one"]
