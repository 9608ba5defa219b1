"""Numpy references of ``cp_attention`` and its grad (the context family, spmdkit.ops.context).

The op is attention whose causal mask is ``k_positions[j] <= q_positions[i]``. Every variant
is computed from one block function (:func:`block`: the attention of some queries over one
block of keys, with its log-sum-exp) and :func:`merge` (two blocks' outputs combined by their
log-sum-exps: the online-softmax rescaling); the grad from :func:`block_grad` (FlashAttention's
backward of one block, from out and softmax_lse). They are written once over :class:`XP` (the
numpy and torch spellings), so the torch kernels (spmdkit.execute.kernels.context) run the same
formulas.

- globally, and on a rank under ``allgather`` / ``alltoall``: one block, the keys the rank holds
  (all of them: the rule gathered them, or moved the sequence onto the heads);
- ``ring`` on a rank: the rank's queries against every block of the ring in ring order (its own
  first, then the block of the rank before it, ...), merged block by block. On a real engine
  (``Ctx.comm``) each next block arrives from the previous rank of the ring
  (``comm.ring_pass``); in the simulator (no comm) it is read from the global run's k / v /
  k_positions (``_GROUP``: the verifier runs the global op first) after checking that the
  rank's own pieces are exactly its slices of them (a mis-sharded input fails there). The
  backward passes each block on with its dK / dV accumulators, each rank adding its queries'
  share, so after ``n`` steps each block's gradient is back at its owner.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

import numpy as np

from spmdkit.core.dist_attr import entry_dims
from spmdkit.sim.cases import GENERATORS, Spec, TGen
from spmdkit.sim.mesh import balanced_split, local_slices, piece_index
from spmdkit.sim.reference import Arrays, Ctx, Reference, register_reference


class XP:
    """The array functions the block formulas use (numpy here; torch in the kernels)."""

    def __init__(self, lib: Any, amax: Callable[[Any], Any], repeat: Callable[[Any, int], Any],
                 full_like: Callable[[Any, float], Any]) -> None:
        self.lib = lib
        self.amax = amax  # max over the last axis, keeping it
        self.repeat = repeat  # each kv head n times (axis 2)
        self.full_like = full_like

    def einsum(self, eq: str, *xs: Any) -> Any:
        return self.lib.einsum(eq, *xs)


NP = XP(np, lambda x: x.max(axis=-1, keepdims=True), lambda x, n: np.repeat(x, n, axis=2),
        lambda x, v: np.full_like(x, v))


def _scores(xp: XP, q: Any, k: Any, qp: Any, kp: Any, causal: bool) -> tuple[Any, Any, float]:
    """Masked scores ``[b, h, s, t]`` of q over the block k (kv heads repeated), the visibility."""
    hq, hk = q.shape[2], k.shape[2]
    scale = 1.0 / math.sqrt(q.shape[3]) if q.shape[3] else 1.0
    ke = k if hq == hk or hk == 0 else xp.repeat(k, hq // hk)
    s = xp.einsum("bshd,bthd->bhst", q, ke) * scale
    vis = kp[None, :] <= qp[:, None] if causal else None
    if vis is not None:
        s = xp.lib.where(vis, s, xp.full_like(s, -math.inf))
    return s, vis, scale


def block(xp: XP, q: Any, k: Any, v: Any, qp: Any, kp: Any, causal: bool) -> tuple[Any, Any]:
    """(out ``[b, s, h, e]``, lse ``[b, h, s]``) of the queries over one block of keys; a query
    that sees no key of the block gets out 0 and lse -inf."""
    s, _, _ = _scores(xp, q, k, qp, kp, causal)
    if k.shape[1] == 0 or q.shape[1] == 0:  # an empty block (an uneven split): nothing seen
        ve = v if q.shape[2] == v.shape[2] or v.shape[2] == 0 else xp.repeat(v, q.shape[2] // v.shape[2])
        return xp.einsum("bshd,bthe->bshe", q[:, :, :, :0], ve[:, :0]), s.sum(-1) - math.inf
    m = xp.amax(s)
    m = xp.lib.where(xp.lib.isfinite(m), m, xp.full_like(m, 0.0))
    p = xp.lib.exp(s - m)
    den = p.sum(-1)
    safe = xp.lib.where(den > 0, den, xp.full_like(den, 1.0))
    lse = xp.lib.where(den > 0, xp.lib.log(safe) + m[..., 0], xp.full_like(den, -math.inf))
    hq, hk = q.shape[2], v.shape[2]
    ve = v if hq == hk or hk == 0 else xp.repeat(v, hq // hk)
    num = xp.einsum("bhst,bthe->bshe", p, ve)
    return num / safe.permute(0, 2, 1)[..., None] if hasattr(safe, "permute") else \
        num / np.transpose(safe, (0, 2, 1))[..., None], lse


def merge(xp: XP, out_a: Any, lse_a: Any, out_b: Any, lse_b: Any) -> tuple[Any, Any]:
    """Two blocks' (out, lse) as one: each output weighted by ``exp(lse - lse_new)``."""
    lse = xp.lib.logaddexp(lse_a, lse_b)
    ok = xp.lib.isfinite(lse)
    safe = xp.lib.where(ok, lse, xp.full_like(lse, 0.0))
    wa = xp.lib.where(ok, xp.lib.exp(lse_a - safe), xp.full_like(lse, 0.0))
    wb = xp.lib.where(ok, xp.lib.exp(lse_b - safe), xp.full_like(lse, 0.0))

    def t(w: Any) -> Any:  # [b, h, s] -> [b, s, h, 1]
        return (w.permute(0, 2, 1) if hasattr(w, "permute") else np.transpose(w, (0, 2, 1)))[..., None]

    return out_a * t(wa) + out_b * t(wb), lse


def block_grad(xp: XP, q: Any, k: Any, v: Any, qp: Any, kp: Any, lse: Any, g: Any, delta: Any,
               causal: bool) -> tuple[Any, Any, Any]:
    """(dq, dk, dv) of one block: FlashAttention's backward from lse and ``delta = sum(g * out)``
    ``[b, h, s]``; dk, dv summed over each kv head's q heads."""
    s, vis, scale = _scores(xp, q, k, qp, kp, causal)
    p = xp.lib.exp(s - lse[..., None])
    if vis is not None:
        p = xp.lib.where(vis, p, xp.full_like(p, 0.0))
    hq, hk = q.shape[2], k.shape[2]
    rep = hq // hk if hk and hq != hk else 1
    ke = k if rep == 1 else xp.repeat(k, rep)
    ve = v if rep == 1 else xp.repeat(v, rep)
    dv = xp.einsum("bhst,bshe->bthe", p, g)
    dp = xp.einsum("bshe,bthe->bhst", g, ve)
    ds = p * (dp - delta[..., None])
    dq = xp.einsum("bhst,bthd->bshd", ds, ke) * scale
    dk = xp.einsum("bhst,bshd->bthd", ds, q) * scale
    if rep > 1:
        b, t, _, d = dk.shape
        dk = dk.reshape(b, t, hk, rep, d).sum(3)
        dv = dv.reshape(b, t, hk, rep, dv.shape[3]).sum(3)
    return dq, dk, dv


def delta_of(g: Any, out: Any) -> Any:
    """``sum_e g * out`` as ``[b, h, s]``."""
    d = (g * out).sum(-1)
    return d.permute(0, 2, 1) if hasattr(d, "permute") else np.transpose(d, (0, 2, 1))


# -- the ring on one rank ------------------------------------------------------------------------


def ring_of(c: Ctx, name: str = "k") -> tuple[tuple[int, ...], int, int]:
    """(the mesh dims of ``name``'s sequence axis, this rank's place in the ring, its size)."""
    dims = entry_dims(c.in_attrs[name].dims_mapping[1])
    if not dims or c.coords is None:
        return (), 0, 1
    i, n = piece_index(dims, c.coords, c.mesh.shape)
    return dims, i, n


def ring_forward(xp: XP, q: Any, k: Any, v: Any, qp: Any, kp: Any, causal: bool, n: int,
                 nxt: Callable[[int, list[Any]], list[Any]]) -> tuple[Any, Any]:
    """The rank's queries over the ``n`` blocks of the ring: its own, then ``nxt(step, [k, v,
    kp])`` for each of the ``n - 1`` next (the previous rank's block)."""
    out, lse = block(xp, q, k, v, qp, kp, causal)
    cur = [k, v, kp]
    for j in range(1, n):
        cur = nxt(j, cur)
        o2, l2 = block(xp, q, cur[0], cur[1], qp, cur[2], causal)
        out, lse = merge(xp, out, lse, o2, l2)
    return out, lse


def ring_backward(xp: XP, q: Any, k: Any, v: Any, qp: Any, kp: Any, out: Any, lse: Any, g: Any, causal: bool,
                  n: int, nxt: Callable[[int, list[Any]], list[Any]]) -> tuple[Any, Any, Any]:
    """(dq, dk, dv) of the rank: its queries' grads over every block; each block's dK / dV
    accumulated as it travels (``nxt(step, [k, v, kp, dk, dv])``), back at its owner after ``n``
    passes."""
    delta = delta_of(g, out)
    cur = [k, v, kp, xp.full_like(k, 0.0), xp.full_like(v, 0.0)]
    dq = xp.full_like(q, 0.0)
    for j in range(n):
        if j:
            cur = nxt(j, cur)
        a, b, c = block_grad(xp, q, cur[0], cur[1], qp, cur[2], lse, g, delta, causal)
        dq = dq + a
        cur = [cur[0], cur[1], cur[2], cur[3] + b, cur[4] + c]
    if n > 1:
        cur = nxt(n, cur)
    return dq, cur[3], cur[4]


#: the global run's inputs of the last cp_attention / cp_attention_grad, for the simulated ranks
_GROUP: dict[str, Any] = {}


def _f(x: Any) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def _ints(x: Any) -> np.ndarray:
    return np.asarray(x, dtype=np.int64)


def _sim_blocks(a: Arrays, c: Ctx, names: tuple[str, ...]) -> Callable[[int], list[np.ndarray]]:
    """``blocks(step)``: in the simulator, the block of the rank ``step`` places
    before this one, of the global ``names``, after checking this rank's pieces are its slices."""
    _dims, i, n = ring_of(c)
    for nm in names:
        g = _GROUP.get(nm)
        if g is None or tuple(g.shape) != tuple(c.shapes.get(nm) or ()):
            raise ValueError(f"cp_attention: no global run to ring {nm} from")
        sl = local_slices(c.in_attrs[nm], g.shape, c.coords or ())
        if np.shape(a[nm]) != g[sl].shape or not np.allclose(_f(a[nm]), g[sl], rtol=1e-7, atol=1e-9):
            raise ValueError(f"cp_attention: the local {nm} is not this rank's slice of it")

    def blocks(step: int) -> list[np.ndarray]:
        owner = (i - step) % n
        out = []
        for nm in names:
            g = _GROUP[nm]
            sl = list(local_slices(c.in_attrs[nm], g.shape, c.coords or ()))
            ax = 0 if nm.endswith("positions") else 2 if nm == "softmax_lse" else 1
            lo, hi = balanced_split(g.shape[ax], n)[owner]
            sl[ax] = slice(lo, hi)
            out.append(g[tuple(sl)])
        return out

    return blocks


def _cp_attention(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    q, k, v = _f(a["q"]), _f(a["k"]), _f(a["v"])
    qp, kp = _ints(a["q_positions"]), _ints(a["k_positions"])
    causal = bool(a.get("causal", True))
    if c.is_global:
        _GROUP.update(k=k.copy(), v=v.copy(), k_positions=kp.copy())
    if c.is_global or a.get("variant") != "ring":
        return block(NP, q, k, v, qp, kp, causal)
    dims, _, n = ring_of(c)
    if c.comm is not None:
        return ring_forward(NP, q, k, v, qp, kp, causal, n, lambda j, cur: c.comm.ring_pass(cur, dims))
    blocks = _sim_blocks(a, c, ("k", "v", "k_positions"))
    return ring_forward(NP, q, k, v, qp, kp, causal, n, lambda j, cur: blocks(j))


def _cp_attention_grad(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    q, k, v, out, lse, g = (_f(a[n]) for n in ("q", "k", "v", "out", "softmax_lse", "out_grad"))
    qp, kp = _ints(a["q_positions"]), _ints(a["k_positions"])
    causal = bool(a.get("causal", True))
    if c.is_global:
        _GROUP.update({n: _f(a[n]).copy() for n in ("q", "k", "v", "out", "softmax_lse", "out_grad")})
        _GROUP.update(q_positions=qp.copy(), k_positions=kp.copy())
    if c.is_global or a.get("variant") != "ring":
        return block_grad(NP, q, k, v, qp, kp, lse, g, delta_of(g, out), causal)
    dims, _i, n = ring_of(c)
    if c.comm is not None:
        return ring_backward(NP, q, k, v, qp, kp, out, lse, g, causal, n, lambda j, cur: c.comm.ring_pass(cur, dims))
    kv = _sim_blocks(a, c, ("k", "v", "k_positions"))
    qs = _sim_blocks(a, c, ("q", "q_positions", "out", "softmax_lse", "out_grad"))
    dq = np.zeros_like(q)
    for j in range(n):  # this rank's queries over every block
        kb, vb, kpb = kv(j)
        dq = dq + block_grad(NP, q, kb, vb, qp, kpb, lse, g, delta_of(g, out), causal)[0]
    dk, dv = np.zeros_like(k), np.zeros_like(v)
    for j in range(n):  # this block's grads from every rank's queries, as the ring accumulates them
        qb, qpb, ob, lb, gb = qs(-j)
        _, b, cc = block_grad(NP, qb, k, v, qpb, kp, lb, gb, delta_of(gb, ob), causal)
        dk, dv = dk + b, dv + cc
    return dq, dk, dv


def _prep_grad(a: Arrays) -> None:
    out, lse = block(NP, _f(a["q"]), _f(a["k"]), _f(a["v"]), _ints(a["q_positions"]), _ints(a["k_positions"]),
                     bool(a.get("causal", True)))
    a["out"], a["softmax_lse"] = out, lse


def _g_cp(r: random.Random, m: list[int], ref: Reference) -> Spec:
    """q, k, v of a shared sequence (ring needs one), grouped heads, positions in the int domain
    (a query may see no key: its row is 0 with lse -inf), a variant."""
    b, s = r.randint(1, 3), r.choice((2, 4, 4, 6, 8))
    hk = r.randint(1, 3)
    hq = hk * r.choice((1, 1, 2))
    d, e = r.randint(1, 3), r.randint(1, 3)
    return {"q": TGen((b, s, hq, d)), "k": TGen((b, s, hk, d)), "v": TGen((b, s, hk, e)),
            "q_positions": TGen((s,), "int"), "k_positions": TGen((s,), "int"), "causal": r.random() < 0.8,
            "variant": r.choice(("allgather", "ring", "alltoall")), "balance": "zigzag"}


def _g_cp_grad(r: random.Random, m: list[int], ref: Reference) -> Spec:
    sp = _g_cp(r, m, ref)
    b, s, hq, _ = sp["q"].shape
    e = sp["v"].shape[3]
    return {**sp, "out": TGen((b, s, hq, e)), "softmax_lse": TGen((b, hq, s)), "out_grad": TGen((b, s, hq, e))}


GENERATORS["cp_attention"] = _g_cp
GENERATORS["cp_attention_grad"] = _g_cp_grad

register_reference(Reference("cp_attention", _cp_attention, ("q", "k", "v", "q_positions", "k_positions"),
                             ("out", "softmax_lse"), "cp_attention",
                             domains={"q_positions": "int", "k_positions": "int"}))
register_reference(Reference("cp_attention_grad", _cp_attention_grad,
                             ("q", "k", "v", "out", "softmax_lse", "q_positions", "k_positions", "out_grad"),
                             ("q_grad", "k_grad", "v_grad"), "cp_attention_grad",
                             domains={"q_positions": "int", "k_positions": "int"}, prepare=_prep_grad))

__all__ = ["NP", "XP", "block", "block_grad", "delta_of", "merge", "ring_backward", "ring_forward", "ring_of"]
