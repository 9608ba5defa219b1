"""transpose (transpose2) and transpose_grad: a permutation of the axes.

Notation ``abc -> cab`` for perm ``[2, 0, 1]``. Every sharding moves with its axis.
Paddle 3.3.1 drops a mesh dim that does not divide its axis on the output only
(x[4,6,8] ``[0,-1,1]`` on mesh [2,3] -> out ``[-1,0,-1]``, x kept), which is
unsound; spmdkit drops it on the input too (x ``[0,-1,-1]``). A partial input
stays partial in forward (transpose is linear), as in Paddle.
"""

from __future__ import annotations

from functools import lru_cache

from spmdkit.core.dist_attr import TensorDistAttr
from spmdkit.core.errors import InvalidAttributeError, ShapeMismatchError
from spmdkit.core.spec import DistTensorSpec, SpmdResult
from spmdkit.engine.notation import Notation, einsum_backward, einsum_forward, letters_for, with_partial
from spmdkit.rules.registry import register


def _perm(op: str, perm: tuple[int, ...], ndim: int) -> tuple[int, ...]:
    if len(perm) != ndim:
        raise InvalidAttributeError(f"{op}: perm {list(perm)} has {len(perm)} entries for a {ndim}-D x")
    out = tuple(p + ndim if p < 0 else p for p in perm)
    if sorted(out) != list(range(ndim)):
        raise InvalidAttributeError(f"{op}: perm {list(perm)} is not a permutation of 0..{ndim - 1}")
    return out


@lru_cache(maxsize=1024)
def _notation(op: str, ndim: int, perm: tuple[int, ...]) -> Notation:
    p = _perm(op, perm, ndim)
    x = letters_for(ndim)
    return Notation([x], ["".join(x[i] for i in p)], prune="*")


@lru_cache(maxsize=1024)
def _grad_notation(ndim: int, perm: tuple[int, ...]) -> Notation:
    p = _perm("transpose_grad", perm, ndim)
    g = letters_for(ndim)
    x = [""] * len(p)
    for i, src in enumerate(p):
        x[src] = g[i]
    return Notation([g], ["".join(x)], prune="*")


def _keep_partial(src: DistTensorSpec, ins: list[TensorDistAttr | None], outs: list[TensorDistAttr | None]) -> SpmdResult:
    """A linear op: the input's partial status passes through to the output."""
    pt = src.dist_attr.partial
    if pt:
        return SpmdResult([with_partial(a, pt) for a in ins if a is not None],
                          [with_partial(a, pt) for a in outs if a is not None])
    return SpmdResult(ins, outs)


def transpose_forward(x: DistTensorSpec, perm: tuple[int, ...]) -> SpmdResult:
    """out axis i is x axis perm[i]; every sharding moves with its axis (uneven mesh dims dropped)."""
    nt = _notation("transpose", x.ndim, perm)
    ins, outs = einsum_forward("transpose", nt, [x], ["x"])
    return _keep_partial(x, ins, outs)


def transpose_backward(x: DistTensorSpec, out: DistTensorSpec, perm: tuple[int, ...]) -> SpmdResult:
    """x from out: each out axis's sharding goes back to the x axis it came from; out is
    returned as that x produces it. A partial out is not carried back (as in Paddle: x is
    asked for unpartial, and so out comes out unpartial)."""
    if out.ndim != x.ndim:
        raise ShapeMismatchError(f"transpose: out has {out.ndim} dims but x has {x.ndim}")
    nt = _notation("transpose", x.ndim, perm)
    ins, outs = einsum_backward("transpose", nt, [x], [out], ["x", "out"])
    return SpmdResult(ins, outs)


def transpose_grad(out_grad: DistTensorSpec, perm: tuple[int, ...]) -> SpmdResult:
    """x_grad = transpose(out_grad, inverse(perm))."""
    nt = _grad_notation(out_grad.ndim, perm)
    ins, outs = einsum_forward("transpose_grad", nt, [out_grad], ["out_grad"])
    return _keep_partial(out_grad, ins, outs)


register(
    "transpose",
    transpose_forward,
    "x: T, perm: ints",
    transpose_backward,
    kind="reverse", outputs="out: T",
    aliases=("transpose2",),
    forward_name="TransposeInferSpmd",
    backward_name="TransposeInferSpmdReverse",
)
register("transpose_grad", transpose_grad, "out_grad: T, perm: ints", forward_name="TransposeGradInferSpmd")
