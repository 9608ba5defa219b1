"""torch kernels of the ``moe`` family (:mod:`spmdkit.ops.moe`): moe_gate_dispatch, moe_combine and
their gradients, with the optional leading batch axis (each batch row dispatched and combined on
its own) and chunk axis after it (each chunk of a row on its own), equal to the numpy references of :mod:`spmdkit.sim.refs.moe` and vectorised over the
batch, the tokens and the top-k choices (no Python loop over tokens).

- ``moe_gate_dispatch``: each token's experts are the top k of ``gate_logits + corr_bias`` (among
  the experts of its ``topk_groups`` best of ``groups`` groups where the op is group-limited), ties
  to the lower expert (a stable descending sort, as the reference's stable argsort); its combine
  weights the gate values of those experts. Tokens take expert slots in (k, token) order: a
  choice's slot is the number of earlier choices of the same expert in that order (a stable sort
  of the choices by expert), a choice past ``capacity`` is dropped (combine weight 0, scatter
  index 0); ``expert_offset`` counts every choice, dropped ones included, cumulatively.
- ``moe_gate_dispatch_grad``: a choice is kept where its combine weight is > 0 (the reference's
  test); grad_x sums grad_y's rows of the kept slots (a rank holding a block of the experts,
  ``local_experts``, those of its own experts: its share), grad_gate_logits scatters
  grad_combine_weights to the chosen experts.
- ``moe_combine`` gathers x's rows through scatter_index and sums them weighted; its grad scatters
  ``grad_y * w`` back to the rows (``scatter_add``), sums ``grad_y * x[scatter_index]`` over h and
  gives a zero grad_scatter_index (an index has no gradient). A rank holding a block of the rows
  (``local_rows``; its first row's global index from the reference's ``localize`` hook) sums and
  writes only the rows it holds: its share of the sum.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from spmdkit.execute.kernels._common import Args, floating, register, tensor
from spmdkit.sim.reference import Ctx


def _batched(fn: Callable[..., tuple[torch.Tensor, ...]], rank: int, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``fn`` of batched tensors (a leading batch axis) on ``xs``: a call whose first tensor has
    rank ``rank`` (unbatched) runs on a batch of one and drops it again; a chunked call (a batch
    and a chunk axis first, rank ``rank + 2``) runs with the two folded into one batch axis."""
    if xs[0].ndim == rank + 2:
        b, t = xs[0].shape[:2]
        outs = fn(*(x.reshape(b * t, *x.shape[2:]) for x in xs))
        return tuple(o.reshape(b, t, *o.shape[1:]) for o in outs)
    if xs[0].ndim != rank:
        return fn(*xs)
    return tuple(o.squeeze(0) for o in fn(*(x.unsqueeze(0) for x in xs)))


def _rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[b, index[b, ...]]`` for x [B, T, H] and index [B, ...]: [B, ..., H]."""
    b, h = x.shape[0], x.shape[-1]
    flat = index.reshape(b, -1, 1).expand(-1, -1, h)
    return x.gather(1, flat).reshape(*index.shape, h)


# -- moe_combine -----------------------------------------------------------------------------------


def _own(x: torch.Tensor, si: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(each global row index of ``si`` as a row of this rank's x [B, T_local, H], clamped where the
    rank does not hold it; whether it holds it): its rows are ``[start, start + T_local)``."""
    idx = si - start
    ok = (idx >= 0) & (idx < x.shape[1])
    return torch.where(ok, idx, torch.zeros_like(idx)), ok


def _combine(x: torch.Tensor, w: torch.Tensor, si: torch.Tensor, start: int = 0) -> tuple[torch.Tensor, ...]:
    idx, ok = _own(x, si, start)
    if x.shape[1] == 0:
        return (torch.zeros((*si.shape[:2], x.shape[-1]), dtype=x.dtype, device=x.device),)
    return (torch.einsum("bskh,bsk->bsh", _rows(x, idx), (w * ok).to(x.dtype)),)


def _combine_grad(x: torch.Tensor, w: torch.Tensor, si: torch.Tensor, gy: torch.Tensor, start: int = 0
                  ) -> tuple[torch.Tensor, ...]:
    b, s, k = si.shape
    h = x.shape[-1]
    idx, ok = _own(x, si, start)
    wk = (w * ok).to(gy.dtype)
    contrib = (gy[:, :, None, :] * wk[:, :, :, None]).reshape(b, s * k, h)
    gx = torch.zeros(x.shape, dtype=gy.dtype, device=gy.device)
    if x.shape[1] == 0:
        return gx.to(x.dtype), torch.zeros_like(w), torch.zeros(si.shape, dtype=w.dtype, device=w.device)
    gx.scatter_add_(1, idx.reshape(b, s * k, 1).expand(-1, -1, h), contrib)
    gw = (torch.einsum("bskh,bsh->bsk", _rows(x, idx).to(gy.dtype), gy) * ok).to(w.dtype)
    return gx.to(x.dtype), gw, torch.zeros(si.shape, dtype=w.dtype, device=w.device)


@register("moe_combine")
def _k_combine(a: Args, c: Ctx) -> tuple[Any, ...]:
    start = int(a.get("_row_start", 0))
    return _batched(lambda x, w, si: _combine(x, w, si, start), 2, floating(a["x"]), floating(a["combine_weights"]),
                    tensor(a["scatter_index"]).to(torch.int64))


@register("moe_combine_grad")
def _k_combine_grad(a: Args, c: Ctx) -> tuple[Any, ...]:
    start = int(a.get("_row_start", 0))
    return _batched(lambda x, w, si, gy: _combine_grad(x, w, si, gy, start), 2, floating(a["x"]),
                    floating(a["combine_weights"]), tensor(a["scatter_index"]).to(torch.int64), floating(a["grad_y"]))


# -- moe_gate_dispatch -----------------------------------------------------------------------------


def _slots(eid: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot, count): for choices ``eid`` [B, N] in dispatch order, each choice's place among the
    earlier choices of its expert, and each expert's number of choices [B, E]."""
    b, n = eid.shape
    count = torch.zeros((b, experts), dtype=torch.int64, device=eid.device)
    count.scatter_add_(1, eid, torch.ones_like(eid))
    start = torch.cumsum(count, 1) - count
    by_expert, order = torch.sort(eid, dim=1, stable=True)
    place = torch.arange(n, device=eid.device).expand(b, n) - start.gather(1, by_expert)
    return torch.empty_like(eid).scatter_(1, order, place), count


def limit_groups(sel: torch.Tensor, groups: int, topk_groups: int) -> torch.Tensor:
    """``sel`` [B, S, E] with the experts outside each token's ``topk_groups`` best of ``groups``
    contiguous groups set to -inf (a group scored by its two highest: HF's DeepseekV3TopkRouter)."""
    e = sel.shape[-1]
    if groups <= 1 or topk_groups >= groups or sel.numel() == 0:
        return sel
    per = e // groups
    grouped = sel.reshape(*sel.shape[:-1], groups, per)
    score = torch.sort(grouped, dim=-1, descending=True).values[..., :min(2, per)].sum(-1)
    best = torch.sort(score, dim=-1, descending=True, stable=True).indices[..., :topk_groups]
    keep = torch.zeros_like(score, dtype=torch.bool).scatter_(-1, best, True)
    return sel.masked_fill(~keep.repeat_interleave(per, dim=-1), float("-inf"))


def dispatch(x: torch.Tensor, gl: torch.Tensor, cb: torch.Tensor | None, k: int, cap: int, groups: int = 1,
             topk_groups: int = 1) -> tuple[torch.Tensor, ...]:
    """(y, combine_weights, scatter_index, expert_offset, expert_id) of each batch row of x [B, S, H]
    and gate_logits [B, S, E] dispatched on its own (the top k among the experts of the
    ``topk_groups`` best of ``groups`` groups: :func:`limit_groups`)."""
    b, s, e = gl.shape
    h = x.shape[-1]
    sel = limit_groups(gl if cb is None else gl + cb.to(gl.dtype), groups, topk_groups)
    eid = torch.sort(sel, dim=-1, descending=True, stable=True).indices[..., :k]  # [B, S, K]
    order = eid.transpose(1, 2).reshape(b, k * s)  # (k, token) order
    slot, count = _slots(order, e)
    kept = slot < cap
    si = torch.where(kept, order * cap + slot, torch.zeros_like(slot))
    cw = gl.gather(-1, eid)
    cw = torch.where(kept.reshape(b, k, s).transpose(1, 2), cw, torch.zeros_like(cw))
    y = torch.zeros((b, e * cap, h), dtype=x.dtype, device=x.device)
    token = torch.arange(s, device=x.device).repeat(k).expand(b, k * s)
    row = torch.arange(b, device=x.device)[:, None].expand(b, k * s)
    y[row[kept], si[kept]] = x[row[kept], token[kept]]
    return (y.reshape(b, e, cap, h), cw, si.reshape(b, k, s), torch.cumsum(count, 1), eid)


def dispatch_grad(cw: torch.Tensor, si: torch.Tensor, eid: torch.Tensor, gy: torch.Tensor, gcw: torch.Tensor,
                  start: int = 0, experts: int | None = None) -> tuple[torch.Tensor, ...]:
    """(grad_x [B, S, H], grad_gate_logits [B, S, E]) of each batch row; a rank holding the slots
    of experts ``[start, start + E_local)`` of grad_y (``local_experts``) gathers only those,
    grad_gate_logits (no slot read) has every one of the ``experts`` columns."""
    b, e, cap, h = gy.shape
    s = cw.shape[1]
    slot = si.transpose(1, 2) - start * cap
    kept = cw > 0
    if cap == 0:
        kept = torch.zeros_like(kept)
    own = kept & (slot >= 0) & (slot < e * cap)
    rows = _rows(gy.reshape(b, e * cap, h), slot.clamp(0, max(e * cap - 1, 0))) if cap and e else \
        torch.zeros((b, s, cw.shape[2], h), dtype=gy.dtype, device=gy.device)
    gx = torch.where(own[..., None], rows, torch.zeros_like(rows)).sum(2)
    ggl = torch.zeros((b, s, e if experts is None else experts), dtype=gcw.dtype, device=gcw.device)
    ggl.scatter_add_(2, eid, torch.where(kept, gcw, torch.zeros_like(gcw)))
    return gx, ggl


@register("moe_gate_dispatch")
def _k_dispatch(a: Args, c: Ctx) -> tuple[Any, ...]:
    cb = a.get("corr_bias")
    k, cap = int(a["k"]), int(a["capacity"])
    g, kg = int(a.get("groups", 1) or 1), int(a.get("topk_groups", 1) or 1)
    return _batched(lambda x, gl: dispatch(x, gl, None if cb is None else floating(cb), k, cap, g, kg), 2,
                    floating(a["x"]), floating(a["gate_logits"]))


@register("moe_gate_dispatch_grad")
def _k_dispatch_grad(a: Args, c: Ctx) -> tuple[Any, ...]:
    start, experts = int(a.get("_expert_start", 0)), a.get("_experts")
    n = None if experts is None else int(experts)
    return _batched(lambda cw, si, eid, gy, gcw: dispatch_grad(cw, si, eid, gy, gcw, start, n), 2,
                    floating(a["combine_weights"]), tensor(a["scatter_index"]).to(torch.int64),
                    tensor(a["expert_id"]).to(torch.int64), floating(a["grad_y"]), floating(a["grad_combine_weights"]))
