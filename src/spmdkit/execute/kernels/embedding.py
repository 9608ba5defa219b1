"""torch kernels of the ``embedding`` family (:mod:`spmdkit.ops.embedding`): embedding, the vocabulary-
parallel c_embedding (its shard's first row from the localize hook), one_hot, and their gradients."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from spmdkit.execute.kernels._common import Args, register, tensor
from spmdkit.sim.reference import Ctx


def _lookup(ids: torch.Tensor, w: torch.Tensor, start: int, padding_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = ids.to(torch.int64) - start
    ok = (idx >= 0) & (idx < w.shape[0])
    if padding_idx >= 0:
        ok &= ids != padding_idx
    return torch.where(ok, idx, torch.zeros_like(idx)), ok


@register("embedding", "lookup_table_v2")
def _k_embedding(a: Args, c: Ctx) -> tuple[Any, ...]:
    w = tensor(a["weight"])
    idx, ok = _lookup(tensor(a["x"]), w, int(a.get("_row_start", 0)), int(a.get("padding_idx", -1)))
    return (F.embedding(idx, w) * ok.unsqueeze(-1).to(w.dtype),)


@register("embedding_grad", "lookup_table_v2_grad")
def _k_embedding_grad(a: Args, c: Ctx) -> tuple[Any, ...]:
    w, g = tensor(a["weight"]), tensor(a["out_grad"])
    idx, ok = _lookup(tensor(a["x"]), w, int(a.get("_row_start", 0)), int(a.get("padding_idx", -1)))
    out = torch.zeros(w.shape, dtype=g.dtype, device=g.device)
    out.index_add_(0, idx[ok], g[ok])
    return (out,)


@register("c_embedding")
def _k_c_embedding(a: Args, c: Ctx) -> tuple[Any, ...]:
    w = tensor(a["weight"])
    idx, ok = _lookup(tensor(a["x"]), w, int(a.get("start_index", 0)) + int(a.get("_row_start", 0)), -1)
    return (F.embedding(idx, w) * ok.unsqueeze(-1).to(w.dtype),)


@register("c_embedding_grad")
def _k_c_embedding_grad(a: Args, c: Ctx) -> tuple[Any, ...]:
    w, g = tensor(a["weight"]), tensor(a["out_grad"])
    idx, ok = _lookup(tensor(a["x"]), w, int(a.get("start_index", 0)) + int(a.get("_row_start", 0)), -1)
    out = torch.zeros(w.shape, dtype=g.dtype, device=g.device)
    out.index_add_(0, idx[ok], g[ok])
    return (out,)


@register("one_hot")
def _k_one_hot(a: Args, c: Ctx) -> tuple[Any, ...]:
    i = tensor(a["x"]).to(torch.int64)
    n = int(a["num_classes"])
    ok = (i >= 0) & (i < n)
    return (F.one_hot(torch.where(ok, i, torch.zeros_like(i)), n) * ok.unsqueeze(-1),)
