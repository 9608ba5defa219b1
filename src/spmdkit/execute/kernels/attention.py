"""torch kernels of the ``attention`` family (:mod:`spmdkit.ops.attention`): flash_attention (torch's
``scaled_dot_product_attention`` on Paddle's ``[b, s, h, d]`` layout) and the rotary position
embedding (the reference's formula on torch), and their gradients."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from spmdkit.execute.kernels._common import TORCH, Args, acc, register, tensor, vjp
from spmdkit.sim.reference import Ctx
from spmdkit.sim.refs.attention import rope


def _opt(a: Args, name: str) -> Any:
    v = a.get(name)
    return None if v is None or tensor(v).ndim == 0 else tensor(v)


register("fused_rotary_position_embedding", "fused_rope")(lambda a, c: rope(a, TORCH))
register("fused_rotary_position_embedding_grad", "fused_rope_grad")(lambda a, c: rope(a, TORCH, grad=True))


# -- flash_attention: torch's scaled_dot_product_attention on Paddle's [b, s, h, d] layout --------------


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool
               ) -> torch.Tensor:
    hq, hk = q.shape[2], k.shape[2]
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if hk and hq != hk:
        kt = kt.repeat_interleave(hq // hk, dim=1)
        vt = vt.repeat_interleave(hq // hk, dim=1)
    if causal and mask is None and q.shape[1] == k.shape[1]:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
    else:
        m = None if mask is None else mask.to(q.dtype)
        if causal:
            tri = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool, device=q.device).tril()
            neg = torch.zeros(tri.shape, dtype=q.dtype, device=q.device).masked_fill(~tri, -math.inf)
            m = neg if m is None else m + neg
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=m)
    return out.transpose(1, 2)


def _lse(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
    hq, hk = q.shape[2], k.shape[2]
    ke = k.repeat_interleave(hq // hk, dim=2) if hk and hq != hk else k
    s = torch.einsum("bshd,bthd->bhst", acc(q), acc(ke)) / math.sqrt(q.shape[3] or 1)
    if mask is not None:
        s = s + acc(mask)
    if causal:
        tri = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~tri, -math.inf)
    return torch.logsumexp(s, dim=-1)


@register("flash_attention")
def _k_flash_attention(a: Args, c: Ctx) -> tuple[Any, ...]:
    q, k, v = tensor(a["q"]), tensor(a["k"]), tensor(a["v"])
    mask, causal = _opt(a, "attn_mask"), bool(a.get("causal"))
    out = _attention(q, k, v, mask, causal)
    if a.get("return_softmax"):
        raise ValueError("flash_attention: return_softmax has no torch kernel")
    seed = torch.zeros(2, dtype=torch.int64, device=q.device)
    return (out, None, _lse(q, k, mask, causal), seed)


@register("flash_attention_grad")
def _k_flash_attention_grad(a: Args, c: Ctx) -> tuple[Any, ...]:
    q, k, v = tensor(a["q"]), tensor(a["k"]), tensor(a["v"])
    mask, causal = _opt(a, "attn_mask"), bool(a.get("causal"))
    dq, dk, dv = vjp(lambda q_, k_, v_: _attention(q_, k_, v_, mask, causal), [q, k, v], tensor(a["out_grad"]))
    return (dq, dk, dv)
