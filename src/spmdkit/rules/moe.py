"""Mixture-of-experts routing: moe_combine and moe_gate_dispatch, with their grads.

Notation (letters; ``1`` a size-1 axis)::

    moe_combine            th, sk, sk -> sh          (x, combine_weights, scatter_index -> y)
                           t replicated; y partial SUM over the mesh dims of k; h replicated
                           where k is sharded (as Paddle)
    moe_combine_grad       th, sk, sk, sh -> th, sk, sk   (x, combine_weights, scatter_index, grad_y ->
                           grad_x, grad_combine_weights, grad_scatter_index); t, k replicated;
                           grad_x partial SUM over s, grad_combine_weights partial SUM over h
    moe_gate_dispatch      sh, se, e -> ech, sk, ks, e, sk   (x, gate_logits, corr_bias -> y,
                           combine_weights, scatter_index, expert_offset, expert_id); only h may
                           stay sharded (s, e, k, c replicated); nothing partial
    moe_gate_dispatch_grad sk, ks, sk, ech, sk -> sh, se   (combine_weights, scatter_index, expert_id,
                           grad_y, grad_combine_weights -> grad_x, grad_gate_logits); k, e, c
                           replicated; nothing partial

What the data-dependent rules assume. ``scatter_index`` holds *global* row indices:
moe_combine gathers rows of x through it (``y[i] = sum_k x[scatter_index[i, k]] *
combine_weights[i, k]``), so x's row axis (t, of size S*K) is its own letter and is replicated;
Paddle labels it with the token letter s and shards it with the tokens (sound only where each
rank's scatter_index points into its own x block with local indices). moe_gate_dispatch is
answered as one global dispatch with ``use_pad`` layout: y is ``[E, capacity, H]`` (Paddle's
``esh``, its capacity axis labelled with the token letter), tokens are placed in expert slots in
(k, token) order over all S tokens and dropped past ``capacity``; which slot a token takes, and
whether it is dropped (its combine weight zeroed, its scatter index 0), depends on every token
before it, so s (and the capacity axis) stay replicated, and the top-k over experts needs every
expert, so e stays replicated. The combine weights are the gate values of the chosen experts
(``gate_logits[i, expert_id[i, k]]``, chosen by ``gate_logits + corr_bias``); the grad kernel
scatters grad_combine_weights back to those experts.

Deviations from Paddle 3.3.1 (``docs/deviations.md`` ``moe-amp-*``): moe_combine's x rows
replicated (Paddle shards them with s) and y partial over k's own mesh dim (Paddle always names
mesh dim 1); moe_combine_grad x rows replicated, grad_x partial over s, grad_combine_weights
partial over h; moe_gate_dispatch s and e replicated (Paddle shards the capacity axis of y with s
and keeps the top-k axis e sharded); its grad keeps grad_y's capacity and expert axes replicated.
Each reverse rule (Paddle has none) infers the inputs from the outputs and returns the outputs
those inputs produce.
"""

from __future__ import annotations

from typing import Any

from spmdkit.core.dist_attr import TensorDistAttr
from spmdkit.core.errors import InvalidAttributeError
from spmdkit.core.spec import DistTensorSpec
from spmdkit.engine.axes import make_attr, unpartial
from spmdkit.engine.declare import Answer, Way, declare
from spmdkit.engine.notation import Notation
from spmdkit.rules._common import check_bool, check_int, check_ndim

# every co-shard read as its largest mesh dim (Paddle's merge); letters of one size checked
_COMBINE = Notation(["th", "sk", "sk"], ["sh"], replicated="t", coshard="largest")
_COMBINE_GRAD = Notation(["th", "sk", "sk", "sh"], ["th", "sk", "sk"], replicated="tk", coshard="largest")
_DISPATCH_OUTS = ["ech", "sk", "ks", "e", "sk"]
_DISPATCH_GRAD = Notation(["sk", "ks", "sk", "ech", "sk"], ["sh", "se"], replicated="keck", coshard="largest")


def _dispatch(corr_bias: int) -> Notation:
    return Notation(["sh", "se", "e" if corr_bias >= 0 else None], _DISPATCH_OUTS, replicated="seck", coshard="largest")


def _ndims(op: str, **tensors: Any) -> None:
    """Each named tensor of the rank given with it (``x=(x, 2)``; an absent one skipped)."""
    for name, (t, nd) in tensors.items():
        if t is not None:
            check_ndim(op, name, t, nd)


def _dispatch_attrs(op: str, k: object, capacity: object, use_pad: object) -> None:
    check_int(op, "k", k, 1)
    check_int(op, "capacity", capacity, 0)
    check_bool(op, "use_pad", use_pad)


def _experts(op: str, gate_logits: DistTensorSpec, k: int) -> None:
    if 0 <= gate_logits.shape[1] < k:
        raise InvalidAttributeError(f"{op}: k {k} exceeds the number of experts {gate_logits.shape[1]}")


def _combine_post(ins: list[TensorDistAttr], outs: list[TensorDistAttr], *args: object) -> Answer:
    """As Paddle, k and h are not sharded together: where k is sharded, h is replicated."""
    if ins[1].dims_mapping[1] == -1:
        return ins, outs
    x, y = ins[0], outs[0]
    return ((make_attr(x.mesh, (x.dims_mapping[0], -1)), *ins[1:]),
            (make_attr(y.mesh, (y.dims_mapping[0], -1), y.partial),))  # fmt: skip


def _combine_grad_post(ins: Any, outs: Any, *args: object) -> Answer:
    """grad_scatter_index is never partial (an index is not summed)."""
    return ins, (outs[0], outs[1], unpartial(outs[2]))


def _no_partial(ins: Any, outs: Any, *args: object) -> Answer:
    """Nothing partial: a rank holding part of h dispatches its part of every row (the
    engine would make the outputs lacking h partial over its mesh dims)."""
    return ins, tuple(None if a is None else unpartial(a) for a in outs)


_ENV = {"_ndims": _ndims, "_attrs": _dispatch_attrs, "_experts": _experts}
_COMBINE_CHECK = "_ndims(_OP, x=(x, 2), combine_weights=(combine_weights, 2), scatter_index=(scatter_index, 2))"
declare(
    "moe_combine", "x: T, combine_weights: T, scatter_index: T",
    Way(lambda: _COMBINE, key=lambda *a: (), check=_COMBINE_CHECK, env=_ENV, letters=True, post=_combine_post,
        paddle="MoECombineInferSpmd",
        doc="moe_combine (MoECombineInferSpmd): rows of x replicated (gathered through scatter_index), "
            "tokens s and hidden h follow the inputs; y partial SUM over k's mesh dims."),
    grad=Way(lambda: _COMBINE_GRAD, key=lambda *a: (), check=_COMBINE_CHECK[:-1] + ", grad_y=(grad_y, 2))", env=_ENV,
             letters=True, post=_combine_grad_post, paddle="MoECombineGradInferSpmd",
             doc="moe_combine_grad (MoECombineGradInferSpmd): x rows and k replicated; grad_x scatters the rows "
                 "a rank holds (partial SUM over s), grad_combine_weights sums over h (partial SUM over h)."),
    grad_signature="x: T, combine_weights: T, scatter_index: T, grad_y: T", grad_name="moe_combine_grad",
)  # fmt: skip
# the attribute k is read by the checks only: the generated function keeps its key in a local k
declare(
    "moe_gate_dispatch", "x: T, gate_logits: T, corr_bias: T?, k: int, capacity: int, use_pad: bool",
    Way(_dispatch, key="corr_bias", env=_ENV, letters=True, post=_no_partial, paddle="MoEGateDispatchInferSpmd",
        check="_attrs(_OP, k, capacity, use_pad); _ndims(_OP, x=(x, 2), gate_logits=(gate_logits, 2), "
              "corr_bias=(corr_bias, 1)); _experts(_OP, gate_logits, k)",
        doc="moe_gate_dispatch (MoEGateDispatchInferSpmd): one global dispatch: only the hidden axis h keeps "
            "its sharding (x -> y); tokens, experts, k and capacity replicated; nothing partial."),
    grad=Way(lambda: _DISPATCH_GRAD, key=lambda *a: (), env=_ENV, letters=True, post=_no_partial,
             check="_attrs(_OP, k, capacity, use_pad); _ndims(_OP, combine_weights=(combine_weights, 2), "
                   "scatter_index=(scatter_index, 2), expert_id=(expert_id, 2), grad_y=(grad_y, 3), "
                   "grad_combine_weights=(grad_combine_weights, 2))",
             paddle="MoEGateDispatchGradInferSpmd",
             doc="moe_gate_dispatch_grad (MoEGateDispatchGradInferSpmd): tokens s and hidden h follow the "
                 "inputs; grad_y's expert and capacity axes and k replicated (grad_x gathers rows of grad_y "
                 "through scatter_index); nothing partial."),
    grad_signature="combine_weights: T, scatter_index: T, expert_id: T, grad_y: T, grad_combine_weights: T, "
                   "k: int, capacity: int, use_pad: bool",
    grad_name="moe_gate_dispatch_grad",
)  # fmt: skip
