"""Numpy references and case generators of the moe family (spmdkit.ops.moe): moe_combine,
moe_gate_dispatch and their grads.

``moe_combine``: ``y[i] = sum_k x[scatter_index[i, k]] * combine_weights[i, k]`` with global row
indices (``prepare`` folds scatter_index into x's rows); its grad scatters ``grad_y * w`` back to
x's rows (``grad_x``), sums ``grad_y * x[scatter_index]`` over h (``grad_combine_weights``) and
gives a zero ``grad_scatter_index`` (an index has no gradient).

``moe_gate_dispatch``: one global dispatch in ``use_pad`` layout. The experts of a token are the
top k of ``gate_logits + corr_bias`` (group-limited with ``groups`` > 1: among the experts of its
``topk_groups`` best groups, DeepSeek-V3's node-limited routing); its combine weights are the gate values of those experts.
Tokens take expert slots in (k, token) order; past ``capacity`` a token is dropped (combine weight
0, scatter index 0), else ``y[e, slot] = x[token]`` and ``scatter_index[k, token] = e *
capacity + slot``; ``expert_offset[e]`` counts the assignments to experts ``<= e``. The grad
gathers grad_y through scatter_index for the kept slots and scatters grad_combine_weights to the
chosen experts (``prepare`` makes its index inputs those of a real dispatch).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np

from spmdkit.sim.cases import GENERATORS, TGen, rand_size
from spmdkit.sim.reference import Arrays, Ctx, Reference, register_reference


def _f(x: Any) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def _i(x: Any) -> np.ndarray:
    return np.asarray(x).astype(np.int64)


# -- moe_combine -----------------------------------------------------------------------------------


def _batched(fn: Any, *arrays: np.ndarray, rank: int = 2) -> tuple[np.ndarray, ...]:
    """``fn`` of 2-D arrays (the first of rank ``rank``), or of each batch row of a batched
    call (a leading batch axis, and a chunk axis after it: every row, every chunk of a row,
    dispatched / combined on its own), stacked."""
    if arrays[0].ndim == rank:
        return tuple(fn(*arrays))
    if not arrays[0].shape[0]:  # no row (a rank's empty piece): the outputs of one, none of them
        one = _batched(fn, *(np.zeros(a.shape[1:], a.dtype) for a in arrays), rank=rank)
        return tuple(np.zeros((0, *np.shape(o))) for o in one)
    rows = [_batched(fn, *(a[b] for a in arrays), rank=rank) for b in range(arrays[0].shape[0])]
    return tuple(np.stack([r[i] for r in rows]) for i in range(len(rows[0])))


def _combine2(x: np.ndarray, w: np.ndarray, si: np.ndarray) -> tuple[np.ndarray]:
    return (np.einsum("skh,sk->sh", x[si], w),)


def _combine(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    return _batched(_combine2, _f(a["x"]), _f(a["combine_weights"]), _i(a["scatter_index"]))


def _combine_grad2(x: np.ndarray, w: np.ndarray, si: np.ndarray, gy: np.ndarray) -> tuple[np.ndarray, ...]:
    gx = np.zeros_like(x)
    np.add.at(gx, si.reshape(-1), (gy[:, None, :] * w[:, :, None]).reshape(si.size, x.shape[1]))
    gw = np.einsum("skh,sh->sk", x[si], gy)
    return gx, gw, np.zeros(si.shape)


def _combine_grad(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    return _batched(_combine_grad2, _f(a["x"]), _f(a["combine_weights"]), _i(a["scatter_index"]), _f(a["grad_y"]))


def _prep_combine(a: Arrays) -> None:
    rows = max(int(np.shape(a["x"])[-2]), 1)
    a["scatter_index"] = np.abs(_i(a["scatter_index"])) % rows


register_reference(Reference("moe_combine", _combine, ("x", "combine_weights", "scatter_index"), ("y",),
                             "moe_combine", domains={"scatter_index": "int"}, prepare=_prep_combine))
register_reference(Reference("moe_combine_grad", _combine_grad, ("x", "combine_weights", "scatter_index", "grad_y"),
                             ("grad_x", "grad_combine_weights", "grad_scatter_index"), "moe_combine_grad",
                             domains={"scatter_index": "int"}, prepare=_prep_combine))

# -- moe_gate_dispatch -----------------------------------------------------------------------------


def limit_groups(sel: np.ndarray, groups: int, topk_groups: int) -> np.ndarray:
    """``sel`` [S, E] with the experts outside each token's ``topk_groups`` best of ``groups``
    contiguous expert groups set to -inf (DeepSeek-V3's node-limited routing: a group's score is
    the sum of its two highest scores, HF's ``DeepseekV3TopkRouter``)."""
    s, e = sel.shape
    if groups <= 1 or topk_groups >= groups or not s:
        return sel
    per = e // groups
    grouped = np.sort(sel.reshape(s, groups, per), axis=2)[:, :, ::-1]
    score = grouped[:, :, :min(2, per)].sum(axis=2)
    keep = np.zeros((s, groups), dtype=bool)
    np.put_along_axis(keep, np.argsort(-score, axis=1, kind="stable")[:, :topk_groups], True, axis=1)
    return np.where(np.repeat(keep, per, axis=1), sel, -np.inf)


def dispatch(x: np.ndarray, gl: np.ndarray, cb: np.ndarray | None, k: int, cap: int, groups: int = 1,
             topk_groups: int = 1) -> tuple[np.ndarray, ...]:
    """(y, combine_weights, scatter_index, expert_offset, expert_id) of one global dispatch (the
    top k among the experts of the ``topk_groups`` best of ``groups`` groups: :func:`limit_groups`)."""
    s, e = gl.shape
    sel = limit_groups(gl + cb[None, :] if cb is not None else gl, groups, topk_groups)
    eid = np.argsort(-sel, axis=1, kind="stable")[:, :k].astype(np.int64)
    cw = np.take_along_axis(gl, eid, axis=1) if s else np.zeros((0, k))
    y = np.zeros((e, cap, x.shape[1]))
    si = np.zeros((k, s), dtype=np.int64)
    count = [0] * e
    for kk in range(k):
        for i in range(s):
            ex = int(eid[i, kk])
            p = count[ex]
            count[ex] += 1
            if p < cap:
                y[ex, p] = x[i]
                si[kk, i] = ex * cap + p
            else:
                cw[i, kk] = 0.0
    offset = np.cumsum(np.asarray(count, dtype=np.int64))
    return y, cw, si, offset, eid


def _dispatch(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    cb = a.get("corr_bias")
    k, cap = int(a["k"]), int(a["capacity"])
    g, kg = int(a.get("groups", 1) or 1), int(a.get("topk_groups", 1) or 1)
    return _batched(lambda x, gl: dispatch(x, gl, None if cb is None else _f(cb), k, cap, g, kg),
                    _f(a["x"]), _f(a["gate_logits"]))


def _dispatch_grad(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    return _batched(_dispatch_grad2, _f(a["combine_weights"]), _i(a["scatter_index"]), _i(a["expert_id"]),
                    _f(a["grad_y"]), _f(a["grad_combine_weights"]))


def _dispatch_grad2(cw: np.ndarray, si: np.ndarray, eid: np.ndarray, gy: np.ndarray, gcw: np.ndarray
                    ) -> tuple[np.ndarray, ...]:
    e, cap, h = gy.shape
    s, k = cw.shape
    gx = np.zeros((s, h))
    ggl = np.zeros((s, e))
    for kk in range(k):
        for i in range(s):
            if cw[i, kk] > 0 and cap > 0:
                slot = int(si[kk, i])
                gx[i] += gy[slot // cap, slot % cap]
                ggl[i, int(eid[i, kk])] += gcw[i, kk]
    return gx, ggl


def _prep_dispatch_grad(a: Arrays) -> None:
    """Index inputs of a real dispatch with the case's shapes (k <= E by the generator), each
    batch row (and chunk) its own dispatch."""
    *lead, s, k = np.shape(a["combine_weights"])
    e, cap, _ = np.shape(a["grad_y"])[-3:]
    rng = np.random.default_rng(1000 * s + 10 * k + e)
    gl = rng.uniform(0.5, 2.0, size=(*lead, s, e))
    _, cw, si, _, eid = _batched(lambda x, g: dispatch(x, g, None, int(k), int(cap)), np.zeros((*lead, s, 1)), gl)
    a["combine_weights"], a["scatter_index"], a["expert_id"] = cw, si, eid


register_reference(Reference("moe_gate_dispatch", _dispatch, ("x", "gate_logits"),
                             ("y", "combine_weights", "scatter_index", "expert_offset", "expert_id"),
                             "moe_gate_dispatch", optional=("corr_bias",), domains={"gate_logits": "pos"}))
register_reference(Reference("moe_gate_dispatch_grad", _dispatch_grad,
                             ("combine_weights", "scatter_index", "expert_id", "grad_y", "grad_combine_weights"),
                             ("grad_x", "grad_gate_logits"), "moe_gate_dispatch_grad",
                             domains={"combine_weights": "pos", "scatter_index": "int", "expert_id": "int"},
                             prepare=_prep_dispatch_grad))


# -- case generators ----------------------------------------------------------------------------


def _g_combine(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    s, k, h = rand_size(r, m), r.randint(1, 3), rand_size(r, m)
    rows = s * k if r.random() < 0.7 else rand_size(r, m)
    return {"x": TGen((rows, h)), "combine_weights": TGen((s, k)), "scatter_index": TGen((s, k), "int")}


def _g_combine_grad(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    sp = _g_combine(r, m, ref)
    sp["grad_y"] = TGen((sp["combine_weights"].shape[0], sp["x"].shape[1]))
    return sp


def _dispatch_sizes(r: random.Random, m: list[int]) -> tuple[int, int, int, int, int]:
    s, h, e = rand_size(r, m), rand_size(r, m), rand_size(r, m)
    k = r.randint(1, min(e, 3))
    cap = r.choice((0, 1, max(1, s * k // e), s * k, r.randint(1, 6)))
    return s, h, e, k, cap


def _g_dispatch(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    s, h, e, k, cap = _dispatch_sizes(r, m)
    return {"x": TGen((s, h)), "gate_logits": TGen((s, e), "pos"),
            "corr_bias": TGen((e,)) if r.random() < 0.6 else None,
            "k": k, "capacity": cap, "use_pad": r.random() < 0.9}


def _g_dispatch_grad(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    s, h, e, k, cap = _dispatch_sizes(r, m)
    return {"combine_weights": TGen((s, k), "pos"), "scatter_index": TGen((k, s), "int"),
            "expert_id": TGen((s, k), "int"), "grad_y": TGen((e, cap, h)), "grad_combine_weights": TGen((s, k)),
            "k": k, "capacity": cap, "use_pad": r.random() < 0.9}


def _leading(gen: Any) -> Any:
    """``gen`` with, in 2 cases of 3, leading axes on every tensor but corr_bias: a batch axis
    (spmdkit's zoo: each sequence routed on its own), or a batch and a chunk axis (each
    sequence routed in chunks: Megatron's ETP = 1 token path over tp, each cp rank's own tokens
    under cp), each of one size across the tensors."""
    def wrapped(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
        spec = gen(r, m, ref)
        lead = (rand_size(r, m), rand_size(r, m))[:r.choice((0, 1, 2))]
        return {n: TGen((*lead, *v.shape), v.domain) if isinstance(v, TGen) and n != "corr_bias" else v
                for n, v in spec.items()}
    return wrapped


GENERATORS.update({
    "moe_combine": _leading(_g_combine),
    "moe_combine_grad": _leading(_g_combine_grad),
    "moe_gate_dispatch": _leading(_g_dispatch),
    "moe_gate_dispatch_grad": _leading(_g_dispatch_grad),
})
