"""torch kernels of the ``linear_attention`` family (:mod:`spmdkit.ops.linear_attention`):
``gated_delta_rule`` (the numpy reference's token recurrence and chunk inverses,
:mod:`spmdkit.sim.refs.linear_attention`, on torch: a naive kernel for tiny runs, not FLA's
chunked Triton one) and ``causal_conv1d``, computed in float32 (float64 stays so), the results in
the inputs' dtype; their grads by torch's autograd of the forward (the numpy reference writes the
backward out: each checks the other)."""

from __future__ import annotations

from typing import Any

import torch

from spmdkit.execute.kernels._common import Args, register, tensor, vjp
from spmdkit.sim.reference import Ctx
from spmdkit.sim.refs.linear_attention import LA, conv_forward, gdr_forward, gdr_inputs, gdr_wy

TLA = LA(torch, lambda xs, ax: torch.cat(xs, dim=ax),
         lambda like, shape: torch.zeros(shape, dtype=like.dtype, device=like.device),
         lambda like, n: torch.ones(n, n, dtype=torch.bool, device=like.device).tril(-1),
         lambda like, n: torch.eye(n, dtype=like.dtype, device=like.device))


def _f(x: Any) -> torch.Tensor:
    t = tensor(x)
    return t if t.dtype == torch.float64 else t.to(torch.float32)


def _gdr_qk(a: Args, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k as the kernel reads them (l2-normalised, q scaled)."""
    qs, ks = gdr_inputs(TLA, q, k, float(a.get("scale", 0.0)), bool(a.get("qk_l2norm", True)))
    return qs, ks


def _gdr_out(a: Args, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
             beta: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = gdr_forward(TLA, *_gdr_qk(a, q, k), v, g, beta)[0]
    return out


@register("gated_delta_rule")
def _k_gdr(a: Args, c: Ctx) -> tuple[Any, ...]:
    qf, kf, vf, gf, bf = (_f(a[n]) for n in ("q", "k", "v", "g", "beta"))
    qs, ks = _gdr_qk(a, qf, kf)  # once for the output and the chunk inverses
    out = gdr_forward(TLA, qs, ks, vf, gf, bf)[0]
    wy = gdr_wy(TLA, ks, gf, bf, int(a.get("chunk_size", 64)))
    return out.to(tensor(a["v"]).dtype), wy.to(tensor(a["q"]).dtype)


@register("gated_delta_rule_grad")
def _k_gdr_grad(a: Args, c: Ctx) -> tuple[Any, ...]:
    names = ("q", "k", "v", "g", "beta")
    prim = [_f(a[n]) for n in names]
    grads = vjp(lambda *xs: _gdr_out(a, *xs), prim, _f(a["out_grad"]))
    return tuple(gr.to(tensor(a[n]).dtype) if gr is not None else None for gr, n in zip(grads, names))


@register("causal_conv1d")
def _k_conv(a: Args, c: Ctx) -> tuple[Any, ...]:
    x = tensor(a["x"])
    return (conv_forward(TLA, _f(x), _f(a["weight"]), str(a.get("activation", "silu"))).to(x.dtype),)


@register("causal_conv1d_grad")
def _k_conv_grad(a: Args, c: Ctx) -> tuple[Any, ...]:
    act = str(a.get("activation", "silu"))
    x, w = tensor(a["x"]), tensor(a["weight"])
    dx, dw = vjp(lambda xx, ww: conv_forward(TLA, xx, ww, act), [_f(x), _f(w)], _f(a["out_grad"]))
    assert dx is not None and dw is not None
    return dx.to(x.dtype), dw.to(w.dtype)
