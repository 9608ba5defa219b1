"""torch kernels of the ``context`` family (:mod:`spmdkit.ops.context`): ``cp_attention`` and its
grad, the numpy reference's block formulas (:mod:`spmdkit.sim.refs.context`) on torch, computed in
float32 (softmax_lse is float32; out and the grads in the inputs' dtype). Under
``variant='ring'`` the kv blocks (and in the backward their dK / dV accumulators) travel round
the ranks of the sequence's mesh dim by send / recv (``Ctx.comm.ring_pass``), each block's
output merged into the running one by its log-sum-exp (the online-softmax rescaling)."""

from __future__ import annotations

from typing import Any

import torch

from spmdkit.execute.kernels._common import Args, register, tensor
from spmdkit.sim.reference import Ctx
from spmdkit.sim.refs.context import XP, block, block_grad, delta_of, ring_backward, ring_forward, ring_of

TXP = XP(torch, lambda x: x.amax(dim=-1, keepdim=True), lambda x, n: x.repeat_interleave(n, dim=2),
         lambda x, v: torch.full_like(x, v))


def _f32(x: Any) -> torch.Tensor:
    t = tensor(x)
    return t.to(torch.float32) if t.dtype in (torch.bfloat16, torch.float16) else t


def _ring(c: Ctx) -> tuple[tuple[int, ...], int]:
    dims, _, n = ring_of(c)
    if n > 1 and c.comm is None:
        raise ValueError("cp_attention: a rank's ring kernel needs Ctx.comm (the cp group)")
    return dims, n


@register("cp_attention")
def _k_cp_attention(a: Args, c: Ctx) -> tuple[Any, ...]:
    q = tensor(a["q"])
    qf, kf, vf = _f32(q), _f32(a["k"]), _f32(a["v"])
    qp, kp = tensor(a["q_positions"]).to(torch.int64), tensor(a["k_positions"]).to(torch.int64)
    causal = bool(a.get("causal", True))
    if a.get("variant") == "ring" and not c.is_global:
        dims, n = _ring(c)
        out, lse = ring_forward(TXP, qf, kf, vf, qp, kp, causal, n, lambda j, cur: c.comm.ring_pass(cur, dims))
    else:
        out, lse = block(TXP, qf, kf, vf, qp, kp, causal)
    return out.to(q.dtype), lse.to(torch.float32)


@register("cp_attention_grad")
def _k_cp_attention_grad(a: Args, c: Ctx) -> tuple[Any, ...]:
    q, k, v = tensor(a["q"]), tensor(a["k"]), tensor(a["v"])
    qf, kf, vf, out, lse, g = (_f32(a[n]) for n in ("q", "k", "v", "out", "softmax_lse", "out_grad"))
    qp, kp = tensor(a["q_positions"]).to(torch.int64), tensor(a["k_positions"]).to(torch.int64)
    causal = bool(a.get("causal", True))
    if a.get("variant") == "ring" and not c.is_global:
        dims, n = _ring(c)
        dq, dk, dv = ring_backward(TXP, qf, kf, vf, qp, kp, out, lse, g, causal, n,
                                   lambda j, cur: c.comm.ring_pass(cur, dims))
    else:
        dq, dk, dv = block_grad(TXP, qf, kf, vf, qp, kp, lse, g, delta_of(g, out), causal)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
