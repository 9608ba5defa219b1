"""Numpy references of the linear-attention family (spmdkit.ops.linear_attention):
``gated_delta_rule``, ``causal_conv1d`` and their grads.

The forwards are written once over :class:`LA` (the numpy and torch spellings), so the torch
kernels (spmdkit.execute.kernels.linear_attention) run the same formulas: the gated delta rule
token by token (the recurrence the chunked kernel computes chunk by chunk; equal to HF's
``torch_chunk_gated_delta_rule``, tests/test_linear_attention.py), its ``wy`` output chunk by
chunk. The grads here are the recurrence's backward written out (:func:`_gdr_backward`, the
states kept from the forward); the torch kernels take torch's autograd of the forward instead,
so each checks the other.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

import numpy as np

from spmdkit.sim.cases import GENERATORS, Spec, TGen
from spmdkit.sim.reference import Arrays, Ctx, Reference, register_reference

#: the l2 norm's epsilon (FLA's and HF's l2norm)
EPS = 1e-6


class LA:
    """The array functions the formulas use (numpy here; torch in the kernels)."""

    def __init__(self, lib: Any, cat: Callable[[list[Any], int], Any], zeros: Callable[[Any, tuple[int, ...]], Any],
                 lower: Callable[[Any, int], Any], eye: Callable[[Any, int], Any]) -> None:
        self.lib = lib
        self.cat = cat  # concatenate along an axis
        self.zeros = zeros  # zeros of a shape, in the dtype (and device) of an array
        self.lower = lower  # the strictly lower-triangular boolean mask n x n, beside an array
        self.eye = eye  # the identity n x n, in the dtype (and device) of an array

    def einsum(self, eq: str, *xs: Any) -> Any:
        return self.lib.einsum(eq, *xs)


NP = LA(np, lambda xs, ax: np.concatenate(xs, axis=ax), lambda like, shape: np.zeros(shape, dtype=like.dtype),
        lambda like, n: np.tril(np.ones((n, n), dtype=bool), -1), lambda like, n: np.eye(n, dtype=like.dtype))


def _rnorm(xp: LA, x: Any) -> Any:
    """``1 / sqrt(sum x^2 + eps)`` over the last axis, kept as an axis of 1."""
    return 1.0 / xp.lib.sqrt((x * x).sum(-1)[..., None] + EPS)


def scale_of(scale: float, d: int) -> float:
    """The query scale: ``scale``, or ``1 / sqrt(d)`` where it is 0 (FLA's default)."""
    return float(scale) if scale else (1.0 / math.sqrt(d) if d else 1.0)


def gdr_inputs(xp: LA, q: Any, k: Any, scale: float, l2: bool) -> tuple[Any, Any]:
    """q and k as the recurrence reads them: l2-normalised (where ``l2``), q scaled."""
    if l2:
        q, k = q * _rnorm(xp, q), k * _rnorm(xp, k)
    return q * scale_of(scale, q.shape[-1]), k


def gdr_forward(xp: LA, q: Any, k: Any, v: Any, g: Any, beta: Any) -> tuple[Any, list[Any]]:
    """(out ``[b, s, h, e]``, the states ``S_0 .. S_s`` ``[b, h, d, e]``) of the recurrence on
    the prepared q, k (:func:`gdr_inputs`)."""
    b, s, h, d = q.shape
    S = xp.zeros(v, (b, h, d, v.shape[3]))
    states, outs = [S], []
    for t in range(s):
        A = S * xp.lib.exp(g[:, t])[..., None, None]
        m = xp.einsum("bhde,bhd->bhe", A, k[:, t])
        S = A + xp.einsum("bhd,bhe->bhde", k[:, t], beta[:, t][..., None] * (v[:, t] - m))
        states.append(S)
        outs.append(xp.einsum("bhde,bhd->bhe", S, q[:, t]))
    out = xp.lib.stack(outs, 1) if outs else xp.zeros(v, tuple(v.shape))
    return out, states


def gdr_wy(xp: LA, k: Any, g: Any, beta: Any, chunk: int) -> Any:
    """``wy`` ``[b, s, h, chunk]`` (module docstring of spmdkit.ops.linear_attention): per chunk
    ``(I + L)^-1``, row i at the chunk's token i, its columns past the chunk's length zero."""
    b, s, h, _ = k.shape
    pieces = []
    for t0 in range(0, s, chunk):
        kc, c = k[:, t0:t0 + chunk], min(chunk, s - t0)
        G = xp.einsum("bch->bhc", g[:, t0:t0 + chunk].cumsum(1))
        low = xp.lower(k, c)
        diff = xp.lib.where(low, G[..., :, None] - G[..., None, :], 0.0 * G[..., :, None])
        bi = xp.einsum("bch->bhc", beta[:, t0:t0 + chunk])[..., None]
        L = xp.lib.where(low, bi * xp.einsum("bihd,bjhd->bhij", kc, kc) * xp.lib.exp(diff), 0.0 * diff)
        T = xp.lib.linalg.inv(xp.eye(k, c) + L)
        piece = xp.einsum("bhij->bihj", T)
        if c < chunk:
            piece = xp.cat([piece, xp.zeros(piece, (b, c, h, chunk - c))], 3)
        pieces.append(piece)
    return xp.cat(pieces, 1) if pieces else xp.zeros(k, (b, 0, h, chunk))


def _f(x: Any) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def _gdr(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    q, k, v, g, beta = (_f(a[n]) for n in ("q", "k", "v", "g", "beta"))
    qs, ks = gdr_inputs(NP, q, k, float(a.get("scale", 0.0)), bool(a.get("qk_l2norm", True)))
    out, _ = gdr_forward(NP, qs, ks, v, g, beta)
    return out, gdr_wy(NP, ks, g, beta, int(a.get("chunk_size", 64)))


def _l2_backward(x: np.ndarray, dy: np.ndarray) -> np.ndarray:
    """The gradient through ``y = x / sqrt(sum x^2 + eps)`` (over the last axis)."""
    r: np.ndarray = _rnorm(NP, x)
    return np.asarray(r * dy - x * r**3 * (dy * x).sum(-1)[..., None])


def _gdr_backward(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                  states: list[np.ndarray], dout: np.ndarray) -> tuple[np.ndarray, ...]:
    """(dq, dk, dv, dg, dbeta) of the recurrence on the prepared q, k, from its states, the
    token loop reversed."""
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    dg, dbeta = np.zeros_like(g), np.zeros_like(beta)
    dS = np.zeros_like(states[0])
    for t in range(q.shape[1] - 1, -1, -1):
        a = np.exp(g[:, t])[..., None, None]
        A = states[t] * a
        kt, qt, do = k[:, t], q[:, t], dout[:, t]
        u = v[:, t] - np.einsum("bhde,bhd->bhe", A, kt)
        dl = beta[:, t][..., None] * u
        dq[:, t] = np.einsum("bhde,bhe->bhd", states[t + 1], do)
        dS = dS + np.einsum("bhd,bhe->bhde", qt, do)
        ddl = np.einsum("bhde,bhd->bhe", dS, kt)
        dbeta[:, t] = (ddl * u).sum(-1)
        du = beta[:, t][..., None] * ddl
        dv[:, t] = du
        dA = dS - np.einsum("bhd,bhe->bhde", kt, du)
        dk[:, t] = np.einsum("bhde,bhe->bhd", dS, dl) - np.einsum("bhde,bhe->bhd", A, du)
        dg[:, t] = (dA * A).sum((-2, -1))
        dS = dA * a
    return dq, dk, dv, dg, dbeta


def _gdr_grad(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    q, k, v, g, beta, og = (_f(a[n]) for n in ("q", "k", "v", "g", "beta", "out_grad"))
    scale, l2 = float(a.get("scale", 0.0)), bool(a.get("qk_l2norm", True))
    qs, ks = gdr_inputs(NP, q, k, scale, l2)
    _, states = gdr_forward(NP, qs, ks, v, g, beta)
    dq, dk, dv, dg, dbeta = _gdr_backward(qs, ks, v, g, beta, states, og)
    dq = dq * scale_of(scale, q.shape[-1])
    if l2:
        dq, dk = _l2_backward(q, dq), _l2_backward(k, dk)
    return dq, dk, dv, dg, dbeta


# -- causal_conv1d -------------------------------------------------------------------------------


def conv_pre(xp: LA, x: Any, w: Any) -> Any:
    """``sum_j w[j] x[t - W + 1 + j]`` (x zero before the first token), before the activation."""
    width, s = w.shape[0], x.shape[1]
    xpad = xp.cat([xp.zeros(x, (x.shape[0], width - 1, x.shape[2])), x], 1) if width > 1 else x
    y = xp.zeros(x, tuple(x.shape))
    for j in range(width):
        y = y + w[j] * xpad[:, j:j + s]
    return y


def conv_forward(xp: LA, x: Any, w: Any, activation: str) -> Any:
    y = conv_pre(xp, x, w)
    return y / (1.0 + xp.lib.exp(-y)) if activation == "silu" else y


def _conv(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    return (conv_forward(NP, _f(a["x"]), _f(a["weight"]), str(a.get("activation", "silu"))),)


def _conv_grad(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    x, w, og = _f(a["x"]), _f(a["weight"]), _f(a["out_grad"])
    width, s = w.shape[0], x.shape[1]
    dy = og
    if str(a.get("activation", "silu")) == "silu":
        y = conv_pre(NP, x, w)
        sg = 1.0 / (1.0 + np.exp(-y))
        dy = og * sg * (1.0 + y * (1.0 - sg))
    xpad = np.concatenate([np.zeros((x.shape[0], width - 1, x.shape[2])), x], axis=1)
    dxpad = np.zeros_like(xpad)
    dw = np.zeros_like(w)
    for j in range(width):
        dw[j] = (dy * xpad[:, j:j + s]).sum((0, 1))
        dxpad[:, j:j + s] += w[j] * dy
    return dxpad[:, width - 1:], dw


# -- cases --------------------------------------------------------------------------------------


def _g_gdr(r: random.Random, m: list[int], ref: Reference) -> Spec:
    """Batch and heads of the mesh's sizes at times (to be sharded), a short sequence over one or
    several chunks, the decay in (-0.9, 0.9), beta in (0.05, 0.95)."""
    b, h = r.choice((1, 2, *m)), r.choice((1, 2, 3, *m))
    s, d, e = r.randint(1, 6), r.randint(1, 3), r.randint(1, 3)
    spec: Spec = {"q": TGen((b, s, h, d)), "k": TGen((b, s, h, d)), "v": TGen((b, s, h, e)),
                  "g": TGen((b, s, h), "unit"), "beta": TGen((b, s, h), "prob"),
                  "scale": r.choice((0.0, 0.0, 0.5)), "chunk_size": r.choice((2, 3, 64)),
                  "qk_l2norm": r.random() < 0.7}
    if ref.name.endswith("_grad"):
        spec.update(wy=TGen((b, s, h, spec["chunk_size"])), out_grad=TGen((b, s, h, e)))
    return spec


def _g_conv(r: random.Random, m: list[int], ref: Reference) -> Spec:
    b, ch = r.choice((1, 2, *m)), r.choice((1, 2, 3, *m))
    s, w = r.randint(1, 6), r.randint(1, 4)
    spec: Spec = {"x": TGen((b, s, ch)), "weight": TGen((w, ch)), "activation": r.choice(ACTS)}
    if ref.name.endswith("_grad"):
        spec["out_grad"] = TGen((b, s, ch))
    return spec


ACTS = ("silu", "silu", "none")
for _n in ("gated_delta_rule", "gated_delta_rule_grad"):
    GENERATORS[_n] = _g_gdr
for _n in ("causal_conv1d", "causal_conv1d_grad"):
    GENERATORS[_n] = _g_conv

_DOM = {"g": "unit", "beta": "prob"}
register_reference(Reference("gated_delta_rule", _gdr, ("q", "k", "v", "g", "beta"), ("out", "wy"),
                             "gated_delta_rule", domains=_DOM))
register_reference(Reference("gated_delta_rule_grad", _gdr_grad, ("q", "k", "v", "g", "beta", "wy", "out_grad"),
                             ("q_grad", "k_grad", "v_grad", "g_grad", "beta_grad"), "gated_delta_rule_grad",
                             domains=_DOM))
register_reference(Reference("causal_conv1d", _conv, ("x", "weight"), ("out",), "causal_conv1d"))
register_reference(Reference("causal_conv1d_grad", _conv_grad, ("x", "weight", "out_grad"), ("x_grad", "weight_grad"),
                             "causal_conv1d_grad"))

__all__ = ["EPS", "LA", "NP", "conv_forward", "gdr_forward", "gdr_inputs", "gdr_wy", "scale_of"]
