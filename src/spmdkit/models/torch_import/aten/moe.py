"""Lowerings of HF's MoE blocks (:mod:`spmdkit.models.torch_import.moe`: ``spmdkit::moe_route`` and
``spmdkit::moe_experts``, the custom ops a block's router and experts are exported as) to the
``moe`` family's rules, as the zoo builds its MoE (:mod:`spmdkit.models.zoo_moe`):

- the router: the tokens as ``[B, S, H]`` (each sequence routed on its own: the batch axis
  data parallelism shards), ``matmul(trans_y)`` with the router's ``[E, H]`` weight, the gate
  values ``softmax`` (or ``sigmoid``: DeepSeek-V3) over the experts, in the dtype HF computes them;
  its top-k outputs are a :class:`Routed` record (what the experts need), not tensors;
- the experts: ``moe_gate_dispatch`` of the tokens by the gate values (the top k chosen with the
  correction bias added where the router has one) into ``[B, E, C, H]``; the combine weights
  renormalised (``norm_topk_prob``) and scaled (``routed_scaling_factor``) as the router does;
  ``[B, E, C, H] @ [E, H, F]`` for gate and up (the parts of HF's fused ``gate_up_proj``, made
  parameters ``[E, in, out]`` by the importer), ``swiglu`` (or the activation times up),
  ``@ [E, F, H]`` (``down_proj``), reshape to ``[B, E x C, H]``, ``moe_combine``.

Routed in chunks (``spmdkit::moe_route``'s ``chunks`` > 1: an import for context parallelism or
for ETP = 1 under sp, :func:`spmdkit.models.hf.import_hf`), each sequence's tokens are viewed as
``[B, T, S / T, H]`` and every tensor above has the lead axes ``[B, T]``: each chunk (a cp, tp or
cp x tp rank's tokens) routed on its own with the capacity of a chunk, as the zoo's
``moe_chunks`` (:mod:`spmdkit.models.zoo_moe`).

DeepSeek-V3's group-limited top-k (the experts of the ``topk_group`` best of ``n_group`` groups)
is the dispatch's ``groups`` / ``topk_groups`` (its kernels pick among those groups' experts, and
the cost model counts the nodes a token reaches by them). What differs from HF: tokens past an expert's capacity are dropped (none with the capacity
``dropless``: every token of a sequence), the kept choices of a token renormalised among themselves
(Mixtral, Qwen3-MoE, DeepSeek-V3 divide by the sum plus 1e-20, DeepSeek-V3's own guard: a token
with every choice dropped gets none)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from spmdkit.models.torch_import.context import Hook, ImportContext, Name, dtype_name


@dataclass(frozen=True)
class Routed:
    """A router's top-k outputs as the experts lowering reads them."""

    probs: Name  # the gate values [B, S, E]
    bias: Name | None  # the correction bias [E] the top k is chosen with
    top_k: int
    norm: bool
    scale: float
    batch: int
    seq: int
    dtype: str  # of HF's top-k weights
    tokens: tuple[Name, Name]  # the router's input and its [B, S, H] view
    groups: int = 1  # group-limited top-k: the top_k among the experts of the topk_groups best of groups
    topk_groups: int = 1
    chunks: int = 1  # each sequence routed in that many chunks (cp, tp): the lead axes [B, T], S / T tokens a chunk


@dataclass(frozen=True)
class Bank:
    """An expert bank parameter as the importer made it: its ``[E, in, out]`` parts (gate and up
    of a fused ``gate_up_proj``; one part otherwise)."""

    parts: tuple[Name, ...]


def _route(c: ImportContext) -> Any:
    x, w, bias = c.args[0], c.args[1], c.arg(2, "bias")
    score, bias_used, norm, scale, groups, keep, top_k, batch = c.args[3:11]
    wdt = dtype_name(c.args[11]) if isinstance(c.args[11], torch.dtype) else "float32"
    # the gate values' dtype (torch_import.moe._router_dtypes): HF's softmax in float32 even where
    # the top-k weights it returns are cast back to bfloat16 (Qwen2/3-MoE, OLMoE)
    sdt = dtype_name(c.args[13]) if len(c.args) > 13 and isinstance(c.args[13], torch.dtype) else wdt
    xs, ws = c.shape(x), c.shape(w)
    h, e = xs[-1], ws[0]
    t = 1
    for s in xs[:-1]:
        t *= s
    b = batch if batch > 0 and t % batch == 0 else 1
    s = t // b
    n = int(c.args[12]) if len(c.args) > 12 else 1  # the chunks a sequence is routed in (cp, tp)
    if s % n:  # the capacity was sized for a chunk (torch_import.moe.lowered_moe)
        raise c.unsupported(f"a sequence of {s} tokens does not split into the {n} chunks its MoE block is routed in")
    lead = (b,) if n == 1 else (b, n)  # routed in chunks (cp, tp): [B, T, S / T, H], each chunk on its own
    x3 = tokens = _as(c, x, (*lead, s // n, h))
    if c.dtype(x3) != c.dtype(w):  # DeepSeek-V3: the router in float32
        x3 = c.emit1("cast", {"x": x3}, (c.fresh("tokens_f"), (*lead, s // n, h), c.dtype(w)), dtype=c.dtype(w))
    ldt = c.dtype(w)
    logits = c.emit1("matmul", {"x": x3, "y": w}, (c.fresh("logits"), (*lead, s // n, e), ldt), trans_y=True)
    pin = logits
    if ldt != sdt:  # softmax(logits.float()), softmax(logits, dtype=torch.float)
        pin = c.emit1("cast", {"x": logits}, (c.fresh("logits_f"), (*lead, s // n, e), sdt), dtype=sdt)
    pdt = c.dtype(pin)
    if score == "softmax":
        probs = c.emit1("softmax", {"x": pin}, (c.fresh("probs"), (*lead, s // n, e), pdt), axis=-1)
    else:
        probs = c.emit1("sigmoid", {"x": pin}, (c.fresh("probs"), (*lead, s // n, e), pdt))
    used = any(len(u.args) > 1 and u.args[1] == 0 and u.users for u in c.node.users)
    out0 = c.reshape(logits, (t, e), c.fresh("router_logits")) if used else None
    r = Routed(probs, c.tensor(bias) if bias_used and bias is not None else None, int(top_k), bool(norm),
               float(scale), b, s, wdt, (c.tensor(x), tokens), int(groups), int(keep), n)
    return (out0, r, r)


def _experts(c: ImportContext) -> Any:
    x, idx, wts, up, down = c.args[:5]
    act, approximate, gated, _transposed, cap = c.args[5:10]
    if not isinstance(idx, Routed) or idx is not wts:
        raise c.unsupported("the experts' top-k indices and weights are not a router's (spmdkit::moe_route)")
    if not isinstance(up, Bank) or not isinstance(down, Bank):
        raise c.unsupported("the expert banks are not parameters of the module")
    r = idx
    xs = c.shape(x)
    lead = (r.batch,) if r.chunks == 1 else (r.batch, r.chunks)  # routed in chunks: [B, T, ...] (cp)
    s, h, k = r.seq // r.chunks, xs[-1], r.top_k
    e = c.shape(r.probs)[-1]
    dt = c.dtype(x)
    x3 = r.tokens[1] if c.tensor(x) == r.tokens[0] else _as(c, x, (*lead, s, h))
    y, cw, si, _, _ = c.emit("moe_gate_dispatch", {"x": x3, "gate_logits": r.probs, "corr_bias": r.bias},
                             [(c.fresh("dispatch"), (*lead, e, cap, h), dt),
                              (c.fresh("dispatch.weights"), (*lead, s, k), c.dtype(r.probs)),
                              (c.fresh("dispatch.index"), (*lead, k, s), "int64"),
                              (c.fresh("dispatch.offset"), (*lead, e), "int64"),
                              (c.fresh("dispatch.expert"), (*lead, s, k), "int64")], k=k, capacity=cap, use_pad=True,
                             **({"groups": r.groups, "topk_groups": r.topk_groups}
                                if 1 < r.groups and r.topk_groups < r.groups else {}))
    assert y is not None and cw is not None and si is not None
    wd = c.dtype(cw)
    if r.norm:  # + 1e-20 (DeepSeek-V3's own): a token whose every choice was dropped keeps weights 0, not 0 / 0
        tot = c.emit1("sum", {"x": cw}, (c.fresh("weights_sum"), (*lead, s, 1), wd), axis=(-1,), keep_dim=True)
        tot = c.emit1("add", {"x": tot, "y": c.tensor(1e-20, wd)}, (c.fresh("weights_sum_eps"), (*lead, s, 1), wd))
        cw = c.emit1("divide", {"x": cw, "y": tot}, (c.fresh("weights_norm"), (*lead, s, k), wd))
    if r.scale != 1.0:
        cw = c.emit1("multiply", {"x": cw, "y": c.tensor(float(r.scale), wd)}, (c.fresh("weights_scaled"), (*lead, s, k), wd))
    if c.dtype(cw) != dt:
        cw = c.emit1("cast", {"x": cw}, (c.fresh("weights_cast"), (*lead, s, k), dt), dtype=dt)
    f = c.shape(down.parts[0])[1]
    rule, approx = str(act), bool(approximate)
    if gated:
        g = c.emit1("matmul", {"x": y, "y": up.parts[0]}, (c.fresh("gate"), (*lead, e, cap, f), dt))
        u = c.emit1("matmul", {"x": y, "y": up.parts[1]}, (c.fresh("up"), (*lead, e, cap, f), dt))
        if rule == "silu":
            a = c.emit1("swiglu", {"x": g, "y": u}, (c.fresh("swiglu"), (*lead, e, cap, f), dt))
        else:
            ga = _activation(c, g, rule, approx, (*lead, e, cap, f), dt)
            a = c.emit1("multiply", {"x": ga, "y": u}, (c.fresh("gated"), (*lead, e, cap, f), dt))
    else:
        u = c.emit1("matmul", {"x": y, "y": up.parts[0]}, (c.fresh("up"), (*lead, e, cap, f), dt))
        a = _activation(c, u, rule, approx, (*lead, e, cap, f), dt)
    dn = c.emit1("matmul", {"x": a, "y": down.parts[0]}, (c.fresh("down"), (*lead, e, cap, h), dt))
    rows = c.reshape(dn, (*lead, e * cap, h), c.fresh("rows"))
    perm = (0, 2, 1) if r.chunks == 1 else (0, 1, 3, 2)
    (sit,) = c.emit_nograd("transpose", {"x": si}, [(c.fresh("dispatch.index.t"), (*lead, s, k), "int64")], perm=perm)
    same = tuple(xs) == (*lead, s, h)
    out = c.emit1("moe_combine", {"x": rows, "combine_weights": cw, "scatter_index": sit},
                  (c.name if same else c.fresh("combined"), (*lead, s, h), dt))
    return out if same else c.reshape(out, xs, c.name)


def _as(c: ImportContext, x: Any, shape: tuple[int, ...]) -> Name:
    """``x`` as ``shape`` (itself where it has it)."""
    return c.tensor(x) if tuple(c.shape(x)) == shape else c.reshape(x, shape, c.fresh("tokens"))


def _activation(c: ImportContext, x: Name, rule: str, approx: bool, shape: tuple[int, ...], dt: str) -> Name:
    if rule == "gelu":
        return c.emit1("gelu", {"x": x}, (c.fresh("act"), shape, dt), approximate=approx)
    return c.emit1(rule, {"x": x}, (c.fresh("act"), shape, dt))


def _table() -> dict[str, Hook]:
    return {"spmdkit.moe_route": _route, "spmdkit.moe_experts": _experts}


#: op (packet) -> its lowering
ATEN = _table()
