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

from spmdkit.core.errors import InvalidAttributeError
from spmdkit.core.spec import DistTensorSpec, SpmdResult
from spmdkit.engine.memo import memo
from spmdkit.engine.notation import Notation, fast_result, named_mesh
from spmdkit.rules._common import check_bool, check_int, check_ndim, letter_attr, merge_one_dim
from spmdkit.rules.registry import register

Letters = tuple[tuple[str, tuple[int, ...]], ...]


# -- moe_combine -----------------------------------------------------------------------------------

_COMBINE = Notation(["th", "sk", "sk"], ["sh"], replicated="t")
_COMBINE_GRAD = Notation(["th", "sk", "sk", "sh"], ["th", "sk", "sk"], replicated="tk")


def _combine_checks(op: str, x: DistTensorSpec, cw: DistTensorSpec, si: DistTensorSpec) -> None:
    check_ndim(op, "x", x, 2)
    check_ndim(op, "combine_weights", cw, 2)
    check_ndim(op, "scatter_index", si, 2)


@memo()
def _combine_letters(merged: Letters) -> dict[str, tuple[int, ...]]:
    letters = dict(merged)
    if letters.get("k"):
        letters["h"] = ()  # Paddle: k and h are not sharded together
    return letters


def moe_combine_forward(x: DistTensorSpec, combine_weights: DistTensorSpec, scatter_index: DistTensorSpec
                        ) -> SpmdResult:
    """moe_combine (MoECombineInferSpmd): rows of x replicated (gathered through scatter_index),
    tokens s and hidden h follow the inputs; y partial SUM over k's mesh dims."""
    op = "moe_combine"
    _combine_checks(op, x, combine_weights, scatter_index)
    specs = (x, combine_weights, scatter_index)
    names = ("x", "combine_weights", "scatter_index")
    mesh = named_mesh(op, zip(names, specs))
    merged = merge_one_dim(op, _COMBINE, _COMBINE.inputs, specs, names, mesh)
    letters = _combine_letters(tuple(merged.items()))
    ins = tuple(letter_attr(mesh, a, letters) for a in _COMBINE.inputs)
    return fast_result(ins, (letter_attr(mesh, "sh", letters, "k"),))


def moe_combine_grad(x: DistTensorSpec, combine_weights: DistTensorSpec, scatter_index: DistTensorSpec,
                     grad_y: DistTensorSpec) -> SpmdResult:
    """moe_combine_grad (MoECombineGradInferSpmd): x rows and k replicated; grad_x scatters the
    rows a rank holds (partial SUM over s), grad_combine_weights sums over h (partial SUM over h)."""
    op = "moe_combine_grad"
    _combine_checks(op, x, combine_weights, scatter_index)
    check_ndim(op, "grad_y", grad_y, 2)
    specs = (x, combine_weights, scatter_index, grad_y)
    names = ("x", "combine_weights", "scatter_index", "grad_y")
    mesh = named_mesh(op, zip(names, specs))
    letters = merge_one_dim(op, _COMBINE_GRAD, _COMBINE_GRAD.inputs, specs, names, mesh)
    ins = tuple(letter_attr(mesh, a, letters) for a in _COMBINE_GRAD.inputs)
    outs = (letter_attr(mesh, "th", letters, "s"), letter_attr(mesh, "sk", letters, "h"), letter_attr(mesh, "sk", letters))
    return fast_result(ins, outs)


# -- moe_gate_dispatch -----------------------------------------------------------------------------

_DISPATCH = Notation(["sh", "se", "e"], ["ech", "sk", "ks", "e", "sk"], replicated="seck")
_DISPATCH_GRAD = Notation(["sk", "ks", "sk", "ech", "sk"], ["sh", "se"], replicated="keck")


def _dispatch_attrs(op: str, k: object, capacity: object, use_pad: object) -> None:
    check_int(op, "k", k, 1)
    check_int(op, "capacity", capacity, 0)
    check_bool(op, "use_pad", use_pad)


def moe_gate_dispatch_forward(x: DistTensorSpec, gate_logits: DistTensorSpec, corr_bias: DistTensorSpec | None,
                              k: int, capacity: int, use_pad: bool) -> SpmdResult:
    """moe_gate_dispatch (MoEGateDispatchInferSpmd): one global dispatch: only the hidden axis h
    keeps its sharding (x -> y); tokens, experts, k and capacity replicated; nothing partial."""
    op = "moe_gate_dispatch"
    _dispatch_attrs(op, k, capacity, use_pad)
    check_ndim(op, "x", x, 2)
    check_ndim(op, "gate_logits", gate_logits, 2)
    if corr_bias is not None:
        check_ndim(op, "corr_bias", corr_bias, 1)
    if 0 <= gate_logits.shape[1] < k:
        raise InvalidAttributeError(f"{op}: k {k} exceeds the number of experts {gate_logits.shape[1]}")
    specs = (x, gate_logits, corr_bias)
    names = ("x", "gate_logits", "corr_bias")
    mesh = named_mesh(op, zip(names, specs))
    letters = merge_one_dim(op, _DISPATCH, _DISPATCH.inputs, specs, names, mesh)
    ins = tuple(None if t is None else letter_attr(mesh, a, letters) for a, t in zip(_DISPATCH.inputs, specs))
    outs = tuple(letter_attr(mesh, a, letters) for a in _DISPATCH.outputs)
    return fast_result(ins, outs)


def moe_gate_dispatch_grad(combine_weights: DistTensorSpec, scatter_index: DistTensorSpec, expert_id: DistTensorSpec,
                           grad_y: DistTensorSpec, grad_combine_weights: DistTensorSpec, k: int, capacity: int,
                           use_pad: bool) -> SpmdResult:
    """moe_gate_dispatch_grad (MoEGateDispatchGradInferSpmd): tokens s and hidden h follow the
    inputs; grad_y's expert and capacity axes and k replicated (grad_x gathers rows of grad_y
    through scatter_index); nothing partial."""
    op = "moe_gate_dispatch_grad"
    _dispatch_attrs(op, k, capacity, use_pad)
    specs = (combine_weights, scatter_index, expert_id, grad_y, grad_combine_weights)
    names = ("combine_weights", "scatter_index", "expert_id", "grad_y", "grad_combine_weights")
    for n, t, nd in zip(names, specs, (2, 2, 2, 3, 2)):
        check_ndim(op, n, t, nd)
    mesh = named_mesh(op, zip(names, specs))
    letters = merge_one_dim(op, _DISPATCH_GRAD, _DISPATCH_GRAD.inputs, specs, names, mesh)
    ins = tuple(letter_attr(mesh, a, letters) for a in _DISPATCH_GRAD.inputs)
    outs = tuple(letter_attr(mesh, a, letters) for a in _DISPATCH_GRAD.outputs)
    return fast_result(ins, outs)




_COMBINE_SIG = "x: T, combine_weights: T, scatter_index: T"
_COMBINE_GRAD_SIG = "x: T, combine_weights: T, scatter_index: T, grad_y: T"
_DISPATCH_GRAD_SIG = ("combine_weights: T, scatter_index: T, expert_id: T, grad_y: T, grad_combine_weights: T, "
                      "k: int, capacity: int, use_pad: bool")
register(
    "moe_combine", moe_combine_forward, _COMBINE_SIG, moe_combine_grad, _COMBINE_GRAD_SIG, kind="grad", grad_name="moe_combine_grad",
    forward_name="MoECombineInferSpmd", backward_name="MoECombineGradInferSpmd",
)  # fmt: skip
register(
    "moe_gate_dispatch", moe_gate_dispatch_forward,
    "x: T, gate_logits: T, corr_bias: T?, k: int, capacity: int, use_pad: bool",
    moe_gate_dispatch_grad, _DISPATCH_GRAD_SIG, kind="grad", grad_name="moe_gate_dispatch_grad",
    forward_name="MoEGateDispatchInferSpmd", backward_name="MoEGateDispatchGradInferSpmd",
)  # fmt: skip
