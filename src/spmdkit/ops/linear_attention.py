"""Linear attention (Gated DeltaNet, Qwen3-Next's hybrid layers): ``gated_delta_rule``,
``causal_conv1d`` and their grads (spmdkit's own ops; docs/models.md, "Gated DeltaNet").

gated_delta_rule (Yang, Kautz, Hatamizadeh 2024, "Gated Delta Networks", arXiv 2412.06464; the
kernel is flash-linear-attention's ``chunk_gated_delta_rule``), q ``[b, s, h, d]``, k ``[b, s,
h, d]``, v ``[b, s, h, e]``, g ``[b, s, h]`` (the log decay, <= 0 in a model), beta ``[b, s,
h]``; per batch row and head a state ``S`` ``[d, e]`` from 0::

    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - (exp(g_t) S_{t-1})^T k_t))^T
    out_t = S_t^T q_t

with q and k l2-normalised over d first (``qk_l2norm``, HF's ``use_qk_l2norm_in_kernel``) and q
scaled by ``scale`` (0: ``1 / sqrt(d)``, FLA's default). The second output ``wy`` ``[b, s, h,
chunk_size]`` is what the chunked kernel keeps for its backward besides its inputs (FLA's ``A``,
in q's dtype): per chunk of ``chunk_size`` tokens the inverse ``(I + L)^-1`` of the unit
lower-triangular ``L_ij = beta_i exp(G_i - G_j) k_i . k_j`` (i > j, ``G`` the cumulative log
decay inside the chunk; the WY / UT transform), row i of the chunk's inverse at the chunk's token
i. The kernel recomputes the per-chunk states in its backward and does not keep them.

Sharding::

    bshd, bshd, bshe, bsh, bsh -> bshe, bshc            (s, d, e, c replicated)
    grad: q k v g beta wy out_grad -> q_grad k_grad v_grad g_grad beta_grad   (the same letters)

Batch and heads may be sharded (tensor parallelism shards the heads: each rank its heads'
recurrences). The sequence is not: the recurrence carries its state from the first token to the
last (the chunked kernel passes it chunk to chunk), so a sequence-sharded input is gathered (the
rule replicates ``s``, as flash_attention does). Context parallelism, which would keep the
sequence split through the layer, is refused where the model is built (ModelConfig:
Megatron-Core's GatedDeltaNet has ``# TODO: support CP``, NVIDIA/Megatron-LM
``megatron/core/ssm/gated_delta_net.py``).

causal_conv1d (the short depthwise convolution of Gated DeltaNet and Mamba, Tri Dao's
``causal_conv1d_fn``), x ``[b, s, c]``, weight ``[w, c]`` (one filter of width w a channel;
stored width-major so that its channels are its last axis, as a column-parallel bias's),
``out[b, t, c] = act(sum_j weight[j, c] x[b, t - w + 1 + j, c])`` (x zero before the first
token), act ``silu`` or ``none``::

    bsc, wc -> bsc                                      (s, w replicated)
    grad: x weight out_grad -> x_grad, weight_grad      (weight_grad partial over b's mesh dims)

Channels and batch may be sharded; the sequence is replicated (a split needs the w - 1 tokens
before it).

Cost (per device, on the local shapes): causal_conv1d is memory-bound (``2 w`` FLOPs an element
and the activation). gated_delta_rule runs FLA's chunked algorithm, counted GEMM by GEMM at the
device's rates by shape (:func:`_gdr_gemms`): per chunk of C tokens the intra-chunk products
``K K^T`` (C x C x d), the triangular solve of ``I + L`` (counted C^3 / 3 multiply-adds), the WY
products ``w = T (beta K)`` and ``u = T (beta V)``, the state recurrence (``v_new = u - w S``
and ``S += K^T v_new``: sequential over the chunks, one d x e state tile a (batch, head), timed
as one GEMM whose reduction runs over the sequence) and the output ``Q S + (Q K^T) v_new``. The
backward recomputes w, u and the states, then the gradients: 2x the forward's FLOPs counted as
model FLOPs (autodiff's accounting), the recomputation executed beside them. Bytes: the inputs,
outputs and the intermediates each kernel writes and the next reads (A in fp32 then solved, w,
u, v_new, the per-chunk states in bf16).
"""

from __future__ import annotations

from typing import Any

from spmdkit.core.errors import InvalidAttributeError
from spmdkit.engine.declare import Way, declare
from spmdkit.engine.facts import LocalOp, OpCost, facts
from spmdkit.engine.notation import Coshard, Notation
from spmdkit.engine.outshape import Args, Expect, UnknownShape
from spmdkit.ops._cost import numel

ACTIVATIONS = ("silu", "none")

_Q, _V, _G, _WY = "bshd", "bshe", "bsh", "bshc"


def gdr_notation(kind: str) -> Notation:
    """The module docstring's letters: batch and heads shardable, the rest replicated."""
    if kind == "forward":
        return Notation([_Q, _Q, _V, _G, _G], [_V, _WY], replicated="sdec", coshard=Coshard.KEEP)
    return Notation([_Q, _Q, _V, _G, _G, _WY, _V], [_Q, _Q, _V, _G, _G], replicated="sdec", coshard=Coshard.KEEP)


_GDR_ATTRS = "scale: float = 0.0, chunk_size: int = 64, qk_l2norm: bool = True"
_GDR_SHAPES = "q: b s h d; k: b s h d; v: b s h e; g: b s h; beta: b s h"
_GDR_REQUIRE = ("chunk_size >= 1", "scale >= 0.0")
declare(
    "gated_delta_rule", "q: T, k: T, v: T, g: T, beta: T, " + _GDR_ATTRS,
    Way(lambda *_: gdr_notation("forward"), shapes=_GDR_SHAPES, require=_GDR_REQUIRE,
        doc="gated_delta_rule: batch and heads sharded, the sequence and head dims replicated (the recurrence "
            "runs along the whole sequence)."),
    reverse=Way(lambda *_: gdr_notation("forward"), shapes=_GDR_SHAPES, require=_GDR_REQUIRE,
                doc="gated_delta_rule: the inputs from out and wy (batch and heads)."),
    outputs="out: T, wy: T",
)  # fmt: skip
declare(
    "gated_delta_rule_grad", "q: T, k: T, v: T, g: T, beta: T, wy: T, out_grad: T, " + _GDR_ATTRS,
    Way(lambda *_: gdr_notation("grad"), require=_GDR_REQUIRE,
        shapes=_GDR_SHAPES + "; wy: b s h c; out_grad: b s h e",
        doc="gated_delta_rule_grad: the grads sharded as q, k, v, g, beta (batch and heads only)."),
)  # fmt: skip


def _act(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise InvalidAttributeError(f"activation {activation!r} is not one of {', '.join(ACTIVATIONS)}")


def _conv_notation(*_: Any) -> Notation:
    return Notation(["bsc", "wc"], ["bsc"], replicated="sw", coshard=Coshard.KEEP)


_CONV_ATTRS = "activation: str = 'silu'"
declare(
    "causal_conv1d", "x: T, weight: T, " + _CONV_ATTRS,
    Way(_conv_notation, shapes="x: b s c; weight: w c", check=_act,
        doc="causal_conv1d: batch and channels sharded, the sequence and the filter width replicated."),
    reverse=Way(_conv_notation, shapes="x: b s c; weight: w c", check=_act,
                doc="causal_conv1d: x and the filters from out (batch and channels)."),
    outputs="out: T",
)  # fmt: skip
declare(
    "causal_conv1d_grad", "x: T, weight: T, out_grad: T, " + _CONV_ATTRS,
    Way(lambda *_: Notation(["bsc", "wc", "bsc"], ["bsc", "wc"], replicated="sw", coshard=Coshard.KEEP),
        shapes="x: b s c; weight: w c; out_grad: b s c", check=_act,
        doc="causal_conv1d_grad: x_grad as x; weight_grad partial over the batch's mesh dims."),
)  # fmt: skip


# -- output shapes / grads ----------------------------------------------------------------------


def _gdr_shape(a: Args) -> list[Expect]:
    q, v = a.s("q"), a.s("v")
    if len(q) != 4 or len(v) != 4:
        raise UnknownShape
    return [tuple(v), (q[0], q[1], q[2], int(a.values.get("chunk_size", 64)))]


facts("gated_delta_rule", shape=_gdr_shape, grad="gated_delta_rule_grad", wrt=("q", "k", "v", "g", "beta"),
      outputs=("out", "wy"))
facts("gated_delta_rule_grad", grad_like=("q", "k", "v", "g", "beta"))
facts("causal_conv1d", shape=lambda a: [a.s("x")], grad="causal_conv1d_grad", wrt=("x", "weight"))
facts("causal_conv1d_grad", grad_like=("x", "weight"))


# -- cost ---------------------------------------------------------------------------------------


def _gdr_gemms(c: LocalOp, backward: bool) -> tuple[tuple[int, int, int, int], ...]:
    """The GEMMs of FLA's chunked kernels on the local shapes (module docstring), each ``(batch,
    m, n, k)``: the per-chunk ones batched over batch x heads x chunks, the state recurrence over
    batch x heads with its reduction along the sequence (its chunks run one after another)."""
    q, v = c.one("q"), c.one("v")
    assert q is not None and v is not None
    b, s, h, d = q[0][-4], q[0][-3], q[0][-2], q[0][-1]
    e, cs = v[0][-1], max(1, int(c.attr("chunk_size", 64)))
    C = min(cs, s)
    bh, bhn = b * h, b * h * -(-s // cs)
    kkt, solve = (bhn, C, C, d), (bhn, C, C, max(1, C // 3))
    w, u = (bhn, C, d, C), (bhn, C, e, C)
    out = ((bhn, C, e, d), (bhn, C, C, d), (bhn, C, e, C))  # Q S, Q K^T, (Q K^T) v_new
    if not backward:
        return (kkt, solve, w, u, (bh, d, e, 2 * s), *out)
    # recompute w, u and the states; dv local (Q K^T, its product with dO); the state gradients
    # (sequential, three products a chunk); dq, dk, dw (three with the states), ds, and the two
    # of ds; the WY backward (dA from dw and du, dk and dv through T, dk through the K K^T)
    return (w, u, (bh, d, e, 2 * s), (bhn, C, C, d), (bhn, C, e, C), (bh, d, e, 3 * s),
            (bhn, C, d, e), (bhn, C, d, e), (bhn, C, d, e), (bhn, C, C, e), (bhn, C, d, C), (bhn, C, d, C),
            (bhn, C, C, d), (bhn, C, C, e), (bhn, C, d, C), (bhn, C, e, C), (bhn, C, d, C), (bhn, C, d, C))


def _gdr_bytes(c: LocalOp, backward: bool) -> float:
    """The inputs and outputs, and per token and head the intermediates each kernel writes and
    the next reads: the chunk's A (fp32, then solved: q's itemsize), w and u, v_new, and per
    chunk the d x e state (bf16), each written and read once; the backward writes and reads
    them about thrice (the recomputed w, u and states, and their gradients). The l2 norms of q
    and k read and write them once more."""
    q, v = c.one("q"), c.one("v")
    assert q is not None and v is not None
    b, s, h, d = q[0][-4], q[0][-3], q[0][-2], q[0][-1]
    e, item, cs = v[0][-1], q[1], max(1, int(c.attr("chunk_size", 64)))
    per_token = 2 * (cs * 4 + cs * item + (d + e) * item + e * item) + 2 * d * e * 2 / cs
    inter = b * s * h * per_token * (3 if backward else 1)
    l2 = 2 * 2 * b * s * h * d * item if c.attr("qk_l2norm", True) else 0
    return c.in_bytes + c.out_bytes + inter + l2


def _gdr_cost(backward: bool) -> Any:
    def cost(c: LocalOp) -> OpCost:
        fwd = sum(2.0 * bt * m * n * k for bt, m, n, k in _gdr_gemms(c, False))
        gemms = _gdr_gemms(c, backward)
        executed = sum(2.0 * bt * m * n * k for bt, m, n, k in gemms)
        model = 2.0 * fwd if backward else fwd
        return OpCost(executed, model, _gdr_bytes(c, backward), True, c.dtype(), gemms=gemms,
                      kernels=7 if backward else 6)

    return cost


def _conv_cost(backward: bool) -> Any:
    """Memory-bound: x (and out_grad) read, the outputs written; 2 w FLOPs an element (4 w in the
    backward: x_grad and weight_grad) and the activation's few."""

    def cost(c: LocalOp) -> OpCost:
        x, w = c.one("x"), c.one("weight")
        assert x is not None and w is not None
        n, width = numel(x[0]), w[0][0]
        f = float(n * ((4 if backward else 2) * width + 4))
        return OpCost(f, f, c.in_bytes + c.out_bytes, False, c.dtype())

    return cost


facts("gated_delta_rule", cost=_gdr_cost(False))
facts("gated_delta_rule_grad", cost=_gdr_cost(True))
facts("causal_conv1d", cost=_conv_cost(False))
facts("causal_conv1d_grad", cost=_conv_cost(True))

__all__ = ["ACTIVATIONS", "gdr_notation"]
