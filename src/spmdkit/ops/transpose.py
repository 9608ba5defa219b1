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

from functools import partial
from typing import Any

from spmdkit.core.errors import InvalidAttributeError
from spmdkit.core.spec import DistTensorSpec
from spmdkit.engine.declare import Answer, PartialIn, Way, declare
from spmdkit.engine.facts import facts
from spmdkit.engine.notation import Notation, letters_for
from spmdkit.engine.outshape import Args, Expect, UnknownShape
from spmdkit.engine.tensors import with_partial
from spmdkit.ops._cost import copy


def _perm(perm: tuple[int, ...], ndim: int) -> tuple[int, ...]:
    if len(perm) != ndim:
        raise InvalidAttributeError(f"perm {list(perm)} has {len(perm)} entries for a {ndim}-D x")
    out = tuple(p + ndim if p < 0 else p for p in perm)
    if sorted(out) != list(range(ndim)):
        raise InvalidAttributeError(f"perm {list(perm)} is not a permutation of 0..{ndim - 1}")
    return out


def notation(ndim: int, perm: tuple[int, ...], grad: bool = False) -> Notation:
    """``abc -> cab`` for perm ``[2, 0, 1]`` (out axis i is x axis perm[i]), uneven mesh dims
    dropped; the grad ``cab -> abc`` (x_grad = transpose(out_grad, inverse(perm)))."""
    x = letters_for(ndim)
    out = "".join(x[i] for i in _perm(perm, ndim))
    return Notation([out], [x], prune="*") if grad else Notation([x], [out], prune="*")


def _keep_partial(ins: Any, outs: Any, src: DistTensorSpec, perm: tuple[int, ...]) -> Answer:
    """A linear op: the partial input's partial status passes through to every tensor (the
    general path's ``partial=PartialMerge.KEEP`` gives the same, slower)."""
    pt = src.dist_attr.partial
    return [with_partial(a, pt) for a in ins], [with_partial(a, pt) for a in outs]


declare(
    "transpose", "x: T, perm: ints",
    Way(notation, key="x, perm", post=_keep_partial, post_if=PartialIn("x"), paddle="TransposeInferSpmd",
        doc="out axis i is x axis perm[i]; every sharding moves with its axis (uneven mesh dims dropped)."),
    reverse=Way(notation, key="x, perm", letters=True, paddle="TransposeInferSpmdReverse",
                doc="x from out: each out axis's sharding goes back to the x axis it came from."),
    outputs="out: T", aliases=("transpose2",),
)  # fmt: skip
declare(
    "transpose_grad", "out_grad: T, perm: ints",
    Way(partial(notation, grad=True), key="out_grad, perm", post=_keep_partial, post_if=PartialIn("out_grad"),
        paddle="TransposeGradInferSpmd", doc="x_grad = transpose(out_grad, inverse(perm))."),
)  # fmt: skip


# -- output shapes / grads ----------------------------------------------------------------------


def _transpose_shape(a: Args) -> list[Expect]:
    x = a.s("x")
    perm = a.a("perm")
    if len(perm) != len(x):
        raise UnknownShape
    return [tuple(x[p % len(x)] for p in perm)]


def _transpose_grad_shape(a: Args) -> list[Expect]:
    """x_grad: out_grad's axes put back through the inverse of perm."""
    g = a.s("out_grad")
    perm = [p % len(g) for p in a.a("perm")]
    if sorted(perm) != list(range(len(g))):
        raise UnknownShape
    out: list[int] = [0] * len(g)
    for i, p in enumerate(perm):
        out[p] = g[i]
    return [tuple(out)]


facts("transpose", shape=_transpose_shape, grad="transpose_grad", wrt=("x",))
facts("transpose_grad", shape=_transpose_grad_shape)


# -- cost

facts("transpose", "transpose_grad", cost=copy)
