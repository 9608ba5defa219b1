"""Numpy references and case generators: flash_attention, fused_rotary_position_embedding, grads.

flash_attention is plain softmax attention (scale 1/sqrt(head_dim), optional additive
attn_mask, causal = top-left aligned lower triangle, dropout 0, grouped kv heads repeated
over their q heads); its grad is the real gradient, computed as FlashAttention's backward
does from out and softmax_lse (so the verifier also checks how those are sharded).
fused_rotary_position_embedding rotates q / k / v by sin/cos (``x * cos + R(x) * sin``,
R = rotate-half for the neox style, pairwise rotation otherwise); without sin/cos the
angles are computed from positions 0.. (or position_ids) and rotary_emb_base; its grad is
``g * cos - R(g * sin)`` (R is antisymmetric).
"""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np

from spmdkit.sim.cases import GENERATORS, Spec, TGen, rand_size
from spmdkit.sim.reference import NUMPY, ArrayLib, Arrays, Ctx, Reference, register_reference

# -- flash_attention ----------------------------------------------------------------------------


def _expand_kv(t: np.ndarray, hq: int) -> np.ndarray:
    hk = t.shape[2]
    if hk == 0 or hq == hk:
        return t
    return np.repeat(t, hq // hk, axis=2)


def _opt(a: Arrays, name: str) -> Any:
    """An optional input, None where absent or 0-D (how Paddle's callers pass an absent one)."""
    v = a.get(name)
    return None if v is None or np.ndim(v) == 0 else v


def _scores(a: Arrays) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    q, k, v = (np.asarray(a[n], dtype=np.float64) for n in ("q", "k", "v"))
    hq = q.shape[2]
    ke, ve = _expand_kv(k, hq), _expand_kv(v, hq)
    d = q.shape[3]
    scale = 1.0 / math.sqrt(d) if d else 1.0
    s = np.einsum("bshd,bthd->bhst", q, ke) * scale
    mask = _opt(a, "attn_mask")
    if mask is not None:
        s = s + np.asarray(mask, dtype=np.float64)
    if a.get("causal"):
        sq, sk = s.shape[2], s.shape[3]
        tri = np.tril(np.ones((sq, sk), dtype=bool))
        s = np.where(tri, s, -np.inf)
    return s, ke, ve, scale


def _lse(s: np.ndarray) -> np.ndarray:
    if s.shape[-1] == 0:
        return np.full(s.shape[:-1], -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    return np.asarray((np.log(np.exp(s - m).sum(axis=-1, keepdims=True)) + m)[..., 0])


def _flash_attention(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    s, _, ve, _ = _scores(a)
    lse = _lse(s)
    p = np.exp(s - lse[..., None]) if s.size else np.zeros(s.shape)
    out = np.einsum("bhst,bthe->bshe", p, ve)
    return (out, p if a.get("return_softmax") else None, lse, np.zeros(2, dtype=np.int64))


def _flash_attention_grad(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    s, ke, ve, scale = _scores(a)
    q = np.asarray(a["q"], dtype=np.float64)
    out = np.asarray(a["out"], dtype=np.float64)
    lse = np.asarray(a["softmax_lse"], dtype=np.float64)
    g = np.asarray(a["out_grad"], dtype=np.float64)
    p = np.exp(s - lse[..., None]) if s.size else np.zeros(s.shape)
    dv = np.einsum("bhst,bshe->bthe", p, g)
    dp = np.einsum("bshe,bthe->bhst", g, ve)
    delta = np.einsum("bshe,bshe->bhs", g, out)
    ds = p * (dp - delta[..., None])
    dq = np.einsum("bhst,bthd->bshd", ds, ke) * scale
    dk = np.einsum("bhst,bshd->bthd", ds, q) * scale
    hk = np.shape(a["k"])[2]
    hq = q.shape[2]
    if hk and hq != hk:
        b, t, _, d = dk.shape
        dk = dk.reshape(b, t, hk, hq // hk, d).sum(axis=3)
        dv = dv.reshape(b, t, hk, hq // hk, dv.shape[3]).sum(axis=3)
    return (dq, dk, dv)


def _prep_flash_grad(a: Arrays) -> None:
    out, _, lse, _ = _flash_attention(a, None)  # type: ignore[arg-type]
    a["out"] = out
    a["softmax_lse"] = lse


register_reference(Reference(
    "flash_attention", _flash_attention, ("q", "k", "v"), ("out", "softmax", "softmax_lse", "seed_offset"),
    "flash_attention", optional=("fixed_seed_offset", "attn_mask"), domains={"fixed_seed_offset": "int"},
))  # fmt: skip
register_reference(Reference(
    "flash_attention_grad", _flash_attention_grad, ("q", "k", "v", "out", "softmax_lse", "out_grad"),
    ("q_grad", "k_grad", "v_grad"), "flash_attention_grad", optional=("seed_offset", "attn_mask"),
    domains={"seed_offset": "int"}, prepare=_prep_flash_grad,
))  # fmt: skip


def _small(r: random.Random, m: list[int], hi: int = 5) -> int:
    v = rand_size(r, m)
    return v if v <= hi else r.randint(1, hi)


def _g_flash(r: random.Random, m: list[int], ref: Reference) -> Spec:
    b = _small(r, m, 6)
    sq, sk = r.randint(1, 4), r.randint(1, 4)
    if r.random() < 0.4:
        sk = sq
    hk = _small(r, m, 4)
    hq = hk * r.choice((1, 1, 1, 2, 4)) if hk <= 4 else hk
    d, e = r.randint(1, 3), r.randint(1, 3)
    if r.random() < 0.5:
        e = d
    mask = None
    if r.random() < 0.35:
        mask = TGen((b if r.random() < 0.7 else 1, hq if r.random() < 0.5 else 1, sq, sk), "real")
    causal = r.random() < 0.4
    return {
        "q": TGen((b, sq, hq, d)), "k": TGen((b, sk, hk, d)), "v": TGen((b, sk, hk, e)),
        "fixed_seed_offset": TGen((2,), "int") if r.random() < 0.2 else None,
        "attn_mask": mask, "dropout": 0.0, "causal": causal, "return_softmax": r.random() < 0.4,
        "is_test": r.random() < 0.3,
    }  # fmt: skip


def _g_flash_grad(r: random.Random, m: list[int], ref: Reference) -> Spec:
    sp = _g_flash(r, m, ref)
    b, sq, hq, _ = sp["q"].shape
    e = sp["v"].shape[3]
    return {
        "q": sp["q"], "k": sp["k"], "v": sp["v"], "out": TGen((b, sq, hq, e)), "softmax_lse": TGen((b, hq, sq)),
        "seed_offset": TGen((2,), "int") if r.random() < 0.5 else None, "attn_mask": sp["attn_mask"],
        "out_grad": TGen((b, sq, hq, e), "real"), "dropout": 0.0, "causal": sp["causal"],
    }  # fmt: skip


GENERATORS["flash_attention"] = _g_flash
GENERATORS["flash_attention_grad"] = _g_flash_grad


# -- fused_rotary_position_embedding -----------------------------------------------------------


def _rot(x: Any, neox: bool, xp: ArrayLib) -> Any:
    """R(x): rotate-half (neox) or the pairwise rotation (x0, x1) -> (-x1, x0)."""
    if neox:
        h = x.shape[-1] // 2
        return xp.concat([-x[..., h:], x[..., :h]], -1)
    return xp.stack([-x[..., 1::2], x[..., 0::2]], -1).reshape(x.shape)


def _sin_cos(a: Arrays, q: Any, xp: ArrayLib) -> tuple[Any, Any]:
    """sin/cos broadcastable against q (``[b, s, h, d]`` or time-major ``[s, b, h, d]``); computed
    angles in ``xp.floats``'s dtype, then in q's."""
    tm = bool(a.get("time_major", False))
    neox = bool(a.get("use_neox_rotary_style", True))
    s = q.shape[0] if tm else q.shape[1]
    d = q.shape[3]
    ids = _opt(a, "position_ids")
    sin, cos = _opt(a, "sin"), _opt(a, "cos")
    if sin is None or cos is None:
        base = float(a.get("rotary_emb_base", 10000.0))
        inv = base ** (-xp.floats(list(range(0, d, 2)), q) / max(d, 1))
        pos = xp.floats(ids, q) if ids is not None else xp.floats(list(range(s)), q)[None, :]
        f = pos[..., None] * inv  # [b|1, s, d/2]
        f = xp.concat([f, f], -1) if neox else xp.repeat(f, 2, -1)
        st, ct = xp.cast(xp.sin(f), q), xp.cast(xp.cos(f), q)
    else:
        st, ct = xp.array(sin).reshape(-1, d), xp.array(cos).reshape(-1, d)
        if ids is not None:
            idx = abs(xp.ints(ids)) % max(st.shape[0], 1)
            st, ct = st[idx], ct[idx]  # [b, s, d]
        else:
            st, ct = st[None], ct[None]  # [1, s, d]
    st, ct = st[:, :, None, :], ct[:, :, None, :]  # [b|1, s, 1, d]
    if tm:
        st, ct = st.swapaxes(0, 1), ct.swapaxes(0, 1)
    return st, ct


def rope(a: Arrays, xp: ArrayLib, grad: bool = False) -> tuple[Any, ...]:
    """fused_rotary_position_embedding in the array library ``xp`` (the torch kernel runs it too):
    ``x * cos + R(x) * sin`` of q, k, v; with ``grad`` its grad, ``g * cos - R(g * sin)`` of the
    out_*_grad. None for an absent input."""
    names = ("out_q_grad", "out_k_grad", "out_v_grad") if grad else ("q", "k", "v")
    neox = bool(a.get("use_neox_rotary_style", True))
    st, ct = _sin_cos(a, xp.array(a[names[0]]), xp)
    outs: list[Any] = []
    for n in names:
        x = _opt(a, n)
        if x is None:
            outs.append(None)
            continue
        x = xp.array(x)
        outs.append(x * ct - _rot(x * st, neox, xp) if grad else x * ct + _rot(x, neox, xp) * st)
    return tuple(outs)


def _prep_rope(a: Arrays) -> None:
    ids = _opt(a, "position_ids")
    if ids is None:
        return
    sin = _opt(a, "sin")
    n = int(np.shape(sin)[-3] if np.ndim(sin) == 4 else np.shape(sin)[0]) if sin is not None else 64
    a["position_ids"] = np.abs(np.asarray(ids, dtype=np.int64)) % max(n, 1)


register_reference(Reference(
    "fused_rotary_position_embedding", lambda a, c: rope(a, NUMPY), ("q",), ("out_q", "out_k", "out_v"), "rope",
    optional=("k", "v", "sin", "cos", "position_ids"), domains={"position_ids": "int"}, prepare=_prep_rope,
), "fused_rope")  # fmt: skip
register_reference(Reference(
    "fused_rotary_position_embedding_grad", lambda a, c: rope(a, NUMPY, grad=True), ("out_q_grad",), ("q_grad", "k_grad", "v_grad"),
    "rope_grad", optional=("out_k_grad", "out_v_grad", "sin", "cos", "position_ids"),
    domains={"position_ids": "int"}, prepare=_prep_rope,
), "fused_rope_grad")  # fmt: skip


def _g_rope_parts(r: random.Random, m: list[int]) -> tuple[tuple[int, ...], dict[str, Any]]:
    b, s, h = _small(r, m, 6), _small(r, m, 6), _small(r, m, 4)
    d = r.choice((2, 4))
    tm = r.random() < 0.25
    qs = (s, b, h, d) if tm else (b, s, h, d)
    ids = r.random() < 0.3
    sin: TGen | None = None
    if r.random() < 0.75:
        sl = s + (r.randint(0, 2) if ids else 0)
        sin = TGen((1, sl, 1, d) if r.random() < 0.7 else (sl, d), "real")
    return qs, {
        "sin": sin, "cos": sin, "position_ids": TGen((b, s), "int") if ids else None,
        "use_neox_rotary_style": r.random() < 0.6, "time_major": tm, "rotary_emb_base": 10000.0,
        **({"local_positions": r.random() < 0.5} if ids else {}),
    }  # fmt: skip


def _g_rope(r: random.Random, m: list[int], ref: Reference) -> Spec:
    qs, rest = _g_rope_parts(r, m)
    return {"q": TGen(qs), "k": TGen(qs) if r.random() < 0.7 else None,
            "v": TGen(qs) if r.random() < 0.5 else None, **rest}


def _g_rope_grad(r: random.Random, m: list[int], ref: Reference) -> Spec:
    qs, rest = _g_rope_parts(r, m)
    return {"out_q_grad": TGen(qs), "out_k_grad": TGen(qs) if r.random() < 0.7 else None,
            "out_v_grad": TGen(qs) if r.random() < 0.5 else None, **rest}


GENERATORS["rope"] = _g_rope
GENERATORS["rope_grad"] = _g_rope_grad
