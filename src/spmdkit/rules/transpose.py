"""transpose (transpose2) and transpose_grad: a permutation of the axes."""

from __future__ import annotations

from spmdkit.core.errors import InvalidAttributeError
from spmdkit.core.spec import DistTensorSpec, SpmdResult
from spmdkit.engine.notation import Notation, einsum_backward, einsum_forward, letters_for
from spmdkit.rules.registry import register


def _perm(op: str, perm: tuple[int, ...], ndim: int) -> tuple[int, ...]:
    if len(perm) != ndim:
        raise InvalidAttributeError(f"{op}: perm {list(perm)} has {len(perm)} entries for a {ndim}-D x")
    out = tuple(p + ndim if p < 0 else p for p in perm)
    if sorted(out) != list(range(ndim)):
        raise InvalidAttributeError(f"{op}: perm {list(perm)} is not a permutation of 0..{ndim - 1}")
    return out


def _notation(op: str, ndim: int, perm: tuple[int, ...]) -> Notation:
    p = _perm(op, perm, ndim)
    x = letters_for(ndim)
    return Notation([x], ["".join(x[i] for i in p)])


def transpose_forward(x: DistTensorSpec, perm: tuple[int, ...]) -> SpmdResult:
    """out axis i is x axis perm[i]; every sharding moves with its axis."""
    nt = _notation("transpose", x.ndim, perm)
    ins, outs = einsum_forward("transpose", nt, [x], ["x"])
    return SpmdResult(ins, outs)


def transpose_backward(x: DistTensorSpec, out: DistTensorSpec, perm: tuple[int, ...]) -> SpmdResult:
    nt = _notation("transpose", x.ndim, perm)
    ins, outs = einsum_backward("transpose", nt, [x], [out], ["x", "out"])
    return SpmdResult(ins, outs)


def transpose_grad(out_grad: DistTensorSpec, perm: tuple[int, ...]) -> SpmdResult:
    """x_grad = transpose(out_grad, inverse(perm))."""
    p = _perm("transpose_grad", perm, out_grad.ndim)
    g = letters_for(out_grad.ndim)
    x = [""] * len(p)
    for i, src in enumerate(p):
        x[src] = g[i]
    nt = Notation([g], ["".join(x)])
    ins, outs = einsum_forward("transpose_grad", nt, [out_grad], ["out_grad"])
    return SpmdResult(ins, outs)


register(
    "transpose",
    transpose_forward,
    "x: T, perm: ints",
    transpose_backward,
    "x: T, out: T, perm: ints",
    aliases=("transpose2",),
    forward_name="TransposeInferSpmd",
    backward_name="TransposeInferSpmdReverse",
)
register("transpose_grad", transpose_grad, "out_grad: T, perm: ints", forward_name="TransposeGradInferSpmd")
