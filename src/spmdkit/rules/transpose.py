"""transpose (transpose2) and transpose_grad: a permutation of the axes.

Notation ``abc -> cab`` for perm ``[2, 0, 1]``. Every sharding moves with its axis.
Paddle 3.3.1 drops a mesh dim that does not divide its axis on the output only
(x[4,6,8] ``[0,-1,1]`` on mesh [2,3] -> out ``[-1,0,-1]``, x kept), which is
unsound; spmdkit drops it on the input too (x ``[0,-1,-1]``). A partial input
stays partial in forward (transpose is linear), as in Paddle. The reverse rule
carries no partial out back (as in Paddle: x is asked for unpartial, and so out
comes out unpartial).
"""

from __future__ import annotations

from spmdkit.core.dist_attr import TensorDistAttr
from spmdkit.core.errors import InvalidAttributeError
from spmdkit.core.spec import DistTensorSpec
from spmdkit.engine.declare import Answer, Way, declare
from spmdkit.engine.notation import Notation, letters_for, with_partial


def _perm(perm: tuple[int, ...], ndim: int) -> tuple[int, ...]:
    if len(perm) != ndim:
        raise InvalidAttributeError(f"perm {list(perm)} has {len(perm)} entries for a {ndim}-D x")
    out = tuple(p + ndim if p < 0 else p for p in perm)
    if sorted(out) != list(range(ndim)):
        raise InvalidAttributeError(f"perm {list(perm)} is not a permutation of 0..{ndim - 1}")
    return out


def notation(ndim: int, perm: tuple[int, ...]) -> Notation:
    """``abc -> cab`` for perm ``[2, 0, 1]`` (out axis i is x axis perm[i]), uneven mesh dims dropped."""
    x = letters_for(ndim)
    return Notation([x], ["".join(x[i] for i in _perm(perm, ndim))], prune="*")


def grad_notation(ndim: int, perm: tuple[int, ...]) -> Notation:
    """x_grad = transpose(out_grad, inverse(perm)): ``cab -> abc`` for perm ``[2, 0, 1]``."""
    g = letters_for(ndim)
    x = [""] * ndim
    for i, src in enumerate(_perm(perm, ndim)):
        x[src] = g[i]
    return Notation([g], ["".join(x)], prune="*")


def _keep_partial(ins: tuple[TensorDistAttr, ...], outs: tuple[TensorDistAttr, ...], src: DistTensorSpec,
                  perm: tuple[int, ...]) -> Answer:  # fmt: skip
    """Post-hook: a linear op, so the input's partial status passes through to the output."""
    pt = src.dist_attr.partial
    if pt:
        return [with_partial(a, pt) for a in ins], [with_partial(a, pt) for a in outs]
    return ins, outs


declare(
    "transpose", "x: T, perm: ints",
    Way(notation, key="x, perm", post=_keep_partial, post_if="x.dist_attr.partial", paddle="TransposeInferSpmd",
        doc="out axis i is x axis perm[i]; every sharding moves with its axis (uneven mesh dims dropped)."),
    reverse=Way(notation, key="x, perm", letters=True, paddle="TransposeInferSpmdReverse",
                doc="x from out: each out axis's sharding goes back to the x axis it came from."),
    outputs="out: T", aliases=("transpose2",),
)  # fmt: skip
declare(
    "transpose_grad", "out_grad: T, perm: ints",
    Way(grad_notation, key="out_grad, perm", post=_keep_partial, post_if="out_grad.dist_attr.partial",
        paddle="TransposeGradInferSpmd",
        doc="x_grad = transpose(out_grad, inverse(perm))."),
)  # fmt: skip
