"""Lowerings of ATen ops to the ``attention`` family's rules (:mod:`spmdkit.ops.attention`):
scaled_dot_product_attention -> ``flash_attention`` on Paddle's ``[b, s, h, d]`` (transposes around
it; a non-default scale multiplies q first; one kv head is repeated to q's heads, so that the op's
rule can split the heads, as HF's ``repeat_kv`` does), or spelt out with a mask."""

from __future__ import annotations

import math
from typing import Any

import torch

from spmdkit.models.torch_import.aten.loss import cross_entropy_unflattened
from spmdkit.models.torch_import.context import TORCH_DTYPES, Hook, ImportContext, Name


def _repeat_heads(c: ImportContext, t: Any, hq: int, n: str) -> Name:
    """``[b, hk, s, d]`` kv heads repeated to ``hq`` (each kv head beside the q heads that use it)."""
    ts, dt = c.shape(t), c.dtype(t)
    g = hq // ts[1]
    u = c.emit1("unsqueeze", {"x": t}, (c.fresh(n + "u"), (ts[0], ts[1], 1, ts[2], ts[3]), dt), axis=(2,))
    e = c.emit1("expand", {"x": u}, (c.fresh(n + "e"), (ts[0], ts[1], g, ts[2], ts[3]), dt),
                shape=(ts[0], ts[1], g, ts[2], ts[3]))
    return c.reshape(e, (ts[0], hq, ts[2], ts[3]), c.fresh(n + "rep"))


def _sdpa(c: ImportContext) -> Any:
    q, k, v = c.args[:3]
    mask = c.arg(3, "attn_mask")
    dropout = float(c.arg(4, "dropout_p", 0.0))
    causal = bool(c.arg(5, "is_causal", False))
    scale = c.kwargs.get("scale", c.args[6] if len(c.args) > 6 else None)
    if dropout:
        raise c.unsupported("attention dropout (export in eval mode or with dropout_p=0)")
    qs, ks = c.shape(q), c.shape(k)
    if len(qs) != 4 or len(ks) != 4:
        raise c.unsupported(f"attention on {len(qs)}-D q (4-D [batch, heads, seq, head_dim] only)")
    b_, hq, s, d = qs
    hk = ks[1]
    dt = c.dtype(q)
    default_scale = scale is None or math.isclose(float(scale), 1.0 / math.sqrt(d), rel_tol=1e-12)
    if mask is None and hq % hk == 0:
        if scale is not None and not default_scale:  # softmax(q k^T * scale) = flash's softmax((q * scale sqrt(d)) k^T / sqrt(d))
            q = c.emit1("multiply", {"x": q, "y": float(scale) * math.sqrt(d)}, (c.fresh("q_scaled"), qs, dt))
        if hk == 1 < hq:  # multi-query: the op's rule splits q's heads only over whole kv heads (as HF's repeat_kv)
            k, v = _repeat_heads(c, k, hq, "k"), _repeat_heads(c, v, hq, "v")
        perm = (0, 2, 1, 3)
        qt, kt, vt = (c.transpose(t, perm, c.fresh(n)) for t, n in ((q, "q"), (k, "k"), (v, "v")))
        vs = c.shape(vt)
        outs = [(c.fresh("bshd"), (b_, s, hq, vs[3]), dt), None, (c.fresh("lse"), (b_, hq, s), "float32"),
                (c.fresh("seed_offset"), (2,), "int64")]
        o, _, _, _ = c.emit("flash_attention", {"q": qt, "k": kt, "v": vt}, outs, causal=causal)
        return c.transpose(o, perm, c.name)
    # spelt out: softmax(q k^T * scale + mask) v
    if hk != hq:
        k, v = _repeat_heads(c, k, hq, "k"), _repeat_heads(c, v, hq, "v")
    t_ = c.shape(k)[2]
    sc = c.emit1("matmul", {"x": q, "y": k}, (c.fresh("scores"), (b_, hq, s, t_), dt), trans_y=True)
    sc = c.emit1("multiply", {"x": sc, "y": float(scale) if scale is not None else 1.0 / math.sqrt(d)},
                 (c.fresh("scaled"), (b_, hq, s, t_), dt))
    add: Any = None
    if causal:
        add = torch.zeros(s, t_, dtype=TORCH_DTYPES[dt]).masked_fill(
            ~torch.ones(s, t_, dtype=torch.bool).tril(), float("-inf"))
    if mask is not None:
        if isinstance(mask, torch.Tensor):
            m = mask if mask.dtype != torch.bool else torch.zeros(mask.shape, dtype=TORCH_DTYPES[dt]).masked_fill(
                ~mask, float("-inf"))
            add = m if add is None else add + m
        elif c.dtype(mask) == "bool":  # True = attend: where(mask, scores, -inf)
            if add is not None:
                sc = c.emit1("add", {"x": sc, "y": add}, (c.fresh("causal"), (b_, hq, s, t_), dt))
                add = None
            sc = c.emit1("where", {"condition": mask, "x": sc, "y": c.tensor(float("-inf"), dt)},
                         (c.fresh("masked"), (b_, hq, s, t_), dt))
        else:
            if add is not None:
                sc = c.emit1("add", {"x": sc, "y": add}, (c.fresh("causal"), (b_, hq, s, t_), dt))
                add = None
            add = mask
    if add is not None:
        sc = c.emit1("add", {"x": sc, "y": add}, (c.fresh("masked"), (b_, hq, s, t_), dt))
    pr = c.emit1("softmax", {"x": sc}, (c.fresh("probs"), (b_, hq, s, t_), dt), axis=3)
    return c.emit1("matmul", {"x": pr, "y": v})


def cp_sdpa(q_positions: torch.Tensor, k_positions: torch.Tensor, variant: str, balance: str,
            masked: list[str]) -> Hook:
    """The lowering of ``scaled_dot_product_attention`` under context parallelism (``import_hf``
    with ``cp``; docs/context.md): causal sdpa without a mask -> ``cp_attention`` (``variant``,
    ``balance``) at the positions the (zig-zag laid out) tokens hold, ``q_positions`` /
    ``k_positions`` (``[seq]`` int64: one constant each, shared by every layer). Attention with a
    mask, or not causal, is lowered as without cp and named in ``masked`` (the importer then
    refuses cp: a window, an overlay or a bias cannot be split by position alone)."""

    def hook(c: ImportContext) -> Any:
        q, k, v = c.args[:3]
        mask = c.arg(3, "attn_mask")
        causal = bool(c.arg(5, "is_causal", False))
        scale = c.kwargs.get("scale", c.args[6] if len(c.args) > 6 else None)
        qs, ks = c.shape(q), c.shape(k)
        if mask is not None or not causal or len(qs) != 4 or len(ks) != 4 or qs[1] % ks[1] or float(
                c.arg(4, "dropout_p", 0.0)):
            masked.append("an attention mask" if mask is not None else "attention that is not causal"
                          if not causal else "attention of another shape")
            return _sdpa(c)
        b_, hq, s, d = qs
        dt = c.dtype(q)
        if ks[1] == 1 < hq:  # multi-query: as the lowering without cp
            k, v = _repeat_heads(c, k, hq, "k"), _repeat_heads(c, v, hq, "v")
        if scale is not None and not math.isclose(float(scale), 1.0 / math.sqrt(d), rel_tol=1e-12):
            q = c.emit1("multiply", {"x": q, "y": float(scale) * math.sqrt(d)}, (c.fresh("q_scaled"), qs, dt))
        perm = (0, 2, 1, 3)
        qt, kt, vt = (c.transpose(t, perm, c.fresh(n)) for t, n in ((q, "q"), (k, "k"), (v, "v")))
        outs = [(c.fresh("bshd"), (b_, s, hq, c.shape(vt)[3]), dt), (c.fresh("lse"), (b_, hq, s), "float32")]
        o, _ = c.emit("cp_attention", {"q": qt, "k": kt, "v": vt, "q_positions": q_positions,
                                       "k_positions": k_positions}, outs, causal=True, variant=variant,
                      balance=balance)
        return c.transpose(o, perm, c.name)

    return hook


def cp_mapping(q_positions: torch.Tensor, k_positions: torch.Tensor, variant: str, balance: str,
               masked: list[str]) -> dict[str, Hook]:
    """``import_module(mapping=...)`` under context parallelism: :func:`cp_sdpa` for sdpa; the loss
    on the unflattened ``[batch, seq, vocab]`` logits (HF flattens them; the sequence split over
    cp cannot be flattened with the batch in place)."""
    return {"aten.scaled_dot_product_attention": cp_sdpa(q_positions, k_positions, variant, balance, masked),
            "aten.cross_entropy_loss": cross_entropy_unflattened()}


def _sdpa_tuple(c: ImportContext) -> Any:
    out = _sdpa(c)
    n = len(c.val()) if isinstance(c.val(), (list, tuple)) else 1
    return (out, *([None] * (n - 1)))


def _table() -> dict[str, Hook]:
    t: dict[str, Hook] = {}
    t["aten.scaled_dot_product_attention"] = _sdpa
    for k in ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
              "_scaled_dot_product_efficient_attention"):
        t["aten." + k] = _sdpa_tuple
    return t


#: ATen op (packet or overload) -> its lowering
ATEN = _table()
