"""View ops: reshape (reshape2), flatten, squeeze, unsqueeze (unsqueeze2) and their grads.

Notation: a list of ``spmdkit.engine.dim_trans`` entries, one per output axis, e.g. reshape
[6,12,48,24] -> [1,72,48,4,6] is ``Singleton, Flatten(0,1), InputDim(2), Split(3,(4,6),0),
Split(3,(4,6),1)``. Its structure (``links``, sizes abstracted) is compiled once into an engine
plan (``view_plan``) that moves x's dims_mapping to out; a partial x stays partial (a view is
linear). The reverse rule runs the list from out's shape to x's; as in Paddle 3.3.1 a
co-sharded out axis is read as its largest mesh dim, and out is returned as the x it infers
produces it (never partial: Paddle's reshape keeps out's partial over an x it asks unpartial,
which is unsound). squeeze and unsqueeze forward drop a partial x (reshard) and read co-shards
as their largest mesh dim, reshape and flatten keep both. Grad rules reshape out_grad back to
x's shape (the shape of ``x_shape`` / ``xshape`` / ``x``, returned as given).

Deviations from Paddle 3.3.1 (docs/deviations.md, "View family"): invalid targets and axes
raise; unsqueeze places new axes as the op does (one after another), and the reverse rules
do not co-shard an out axis whose size the mesh dims do not divide.

Bound: unsqueeze inserts at most :data:`MAX_NEW_AXES` (1024) axes (Paddle's tensors have at
most 9 dims); a longer ``axis`` list is an InvalidAttributeError (placing the axes one after
another costs time quadratic in their number).
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

from spmdkit.core.errors import InvalidAttributeError, ShapeMismatchError
from spmdkit.core.spec import DistTensorSpec
from spmdkit.engine import dim_trans as dt
from spmdkit.engine.axes import make_attr
from spmdkit.engine.declare import Answer, Let, PartialIn, Way, declare
from spmdkit.engine.dim_trans import DimTrans, Link
from spmdkit.engine.facts import facts
from spmdkit.engine.notation import Notation
from spmdkit.engine.outshape import Args, Expect, ShapeFn, UnknownShape, axis_of
from spmdkit.ops._cost import no_kernel

#: The most axes one unsqueeze inserts (see the module docstring).
MAX_NEW_AXES = 1024


def notation(keep: bool, backward: bool, n: int, ln: tuple[Link, ...]) -> Notation:
    """A view from ``n`` axes to ``len(ln)`` axes linked as ``ln`` (``dim_trans.view_plan``); ``keep``: co-shards
    read as they are (reshape, flatten, the grads), else as their largest mesh dim (squeeze, unsqueeze, every
    reverse rule, as Paddle 3.3.1); ``backward``: a reverse rule's, from out's axes to x's, merged over out."""
    return dt.view_plan(n, ln, keep, backward).notation


def grad_notation(n: int, ln: tuple[Link, ...]) -> Notation:
    """A grad's: x's shape holder unlabelled (returned as given), out_grad viewed as x's shape."""
    nt = dt.view_plan(n, ln).notation
    return nt.relabel([None, *nt.inputs], nt.outputs)


def _sizes(op: str, spec: DistTensorSpec, name: str, dynamic: bool = False) -> None:
    """Sizes >= 1; with ``dynamic`` (reshape's x and out) a size may also be -1 (unknown)."""
    for s in spec.shape:
        if s <= 0 and not (dynamic and s == -1):
            raise ShapeMismatchError(f"{op}: {name} has shape {list(spec.shape)}; need sizes >= 1{' or -1' * dynamic}")


def _out(op: str, x: DistTensorSpec, out: DistTensorSpec, out_shape: tuple[int, ...]) -> None:
    if tuple(out.shape) != tuple(out_shape):
        raise ShapeMismatchError(f"{op}: out has shape {list(out.shape)}, x {list(x.shape)} gives {list(out_shape)}")


def _linear(ins: Any, outs: Any, x: DistTensorSpec, *attrs: object) -> Answer:
    """x's partial kept on x and out (a view is linear; the engine reshards a partial input)."""
    a = x.dist_attr
    return (make_attr(a.mesh, ins[0].dims_mapping, a.partial),), (make_attr(a.mesh, outs[0].dims_mapping, a.partial),)


def _grad_check(op: str, xs_name: str, xs: DistTensorSpec, out_grad: DistTensorSpec) -> None:
    _sizes(op, xs, xs_name)
    _sizes(op, out_grad, "out_grad")
    n = math.prod(xs.shape)
    if n != math.prod(out_grad.shape):
        raise ShapeMismatchError(f"{op}: out_grad {list(out_grad.shape)} does not hold the {n} elements of {xs_name}")


def _x_shape_check(op: str, x_shape: DistTensorSpec, out_grad: DistTensorSpec) -> None:
    _grad_check(op, "x_shape", x_shape, out_grad)


def _xshape_check(op: str, xshape: DistTensorSpec, out_grad: DistTensorSpec) -> None:
    _grad_check(op, "xshape", xshape, out_grad)


def _x_check(op: str, x: DistTensorSpec, out_grad: DistTensorSpec) -> None:
    _grad_check(op, "x", x, out_grad)


#: a grad's check and out_shapes hooks, by the name of its shape holder (x_shape, xshape or x)
_x_shape = (_x_shape_check, lambda x_shape: (x_shape.shape,))
_xshape = (_xshape_check, lambda xshape: (xshape.shape,))
_x = (_x_check, lambda x: (x.shape,))


def _grad_post(ins: Any, outs: Any, xs: DistTensorSpec, out_grad: DistTensorSpec, *attrs: object) -> Answer:
    """x's shape holder returned as given (the grads' ``axis`` unused); out_grad's partial kept on it and x_grad."""
    i, o = _linear(ins[1:], outs, out_grad) if out_grad.dist_attr.partial else (ins[1:], outs)
    return (xs.dist_attr, *i), o


def _unsqueeze(x: DistTensorSpec, axis: tuple[int, ...]) -> tuple[tuple[DimTrans, ...], tuple[int, ...]]:
    if len(axis) > MAX_NEW_AXES:
        raise InvalidAttributeError(f"unsqueeze: axis has {len(axis)} entries; at most {MAX_NEW_AXES} are answered")
    return dt.unsqueeze_trans(x.shape, tuple(axis))


def _target(shape: list[int], x: DistTensorSpec) -> tuple[int, ...]:
    """reshape's out shape (0 copies x's size, one -1 inferred)."""
    return dt.resolve_target("reshape", shape, x.shape)


def _reshaped(op: str, x: DistTensorSpec, shape: list[int]) -> tuple[int, ...]:
    """x's sizes checked, then reshape's out shape (bound to ``tgt``)."""
    _sizes(op, x, "x", True)
    return dt.resolve_target("reshape", shape, x.shape)


def _reshape_reverse(op: str, x: DistTensorSpec, out: DistTensorSpec, shape: list[int]) -> None:
    _sizes(op, x, "x", True)
    _sizes(op, out, "out", True)
    _out(op, x, out, _target(shape, x))


def _x_sizes(op: str, x: DistTensorSpec) -> None:
    _sizes(op, x, "x")


def _flatten(x: DistTensorSpec, start_axis: int, stop_axis: int) -> tuple[tuple[DimTrans, ...], tuple[int, ...]]:
    return dt.flatten_trans(x.shape, int(start_axis), int(stop_axis))


def _squeeze(x: DistTensorSpec, axis: list[int]) -> tuple[tuple[DimTrans, ...], tuple[int, ...]]:
    return dt.squeeze_trans(x.shape, tuple(axis))


def _out_view(op: str, x: DistTensorSpec, out: DistTensorSpec, view: tuple[Any, tuple[int, ...]]) -> None:
    """The reverse rule's out: shaped as the view of x."""
    _out(op, x, out, view[1])


_ENV = {"dt": dt}
declare(
    "reshape", "x: T, shape: ints",
    Way(partial(notation, True, False), key="x, dt.reshape_links(x.shape, tgt)", out_shapes=lambda tgt: (tgt,),
        env=_ENV, check=Let("tgt", _reshaped),
        post=_linear, post_if=PartialIn("x"), paddle="ReshapeInferSpmd",
        doc="out = x viewed as ``shape`` (0 copies x's size, one -1 inferred; a dynamic (-1) size of x must be "
            "copied by a 0 at its index)."),
    reverse=Way(partial(notation, False, True), key="out, dt.reshape_links(out.shape, x.shape)", env=_ENV,
                check=_reshape_reverse, paddle="ReshapeInferSpmdReverse", doc="x from out through the list out -> x."),
    outputs="out: T", aliases=("reshape2",),
)  # fmt: skip
# flatten, squeeze, unsqueeze: the op's list and out shape (``view``), the reverse's list out -> x
_FLAT = "x.shape, int(start_axis), int(stop_axis)"
for _op, _lists, _rev, _keep, _sig, _aliases, _doc in (
    ("flatten", _flatten, f"dt.flatten_reverse_trans({_FLAT})", True,
     "x: T, start_axis: int, stop_axis: int", (), "Axes start_axis..stop_axis merged into one."),
    ("squeeze", _squeeze, "dt.invert_trans(view[0], x.ndim)", False, "x: T, axis: ints",
     (), "Size-1 axes in ``axis`` (all when empty) removed; sharding on kept size-1 axes dropped."),
    ("unsqueeze", _unsqueeze, "dt.invert_trans(view[0], x.ndim)", False, "x: T, axis: ints", ("unsqueeze2",),
     "New size-1 axes inserted at ``axis`` (one after another, as the op does)."),
):
    _pd = _op.capitalize()
    _check = (_x_sizes, Let("view", _lists))
    declare(
        _op, _sig,
        Way(partial(notation, _keep, False), key="x, dt.links(view[0])", env=_ENV, check=_check,
            out_shapes=lambda view: (view[1],), post=_linear if _keep else None, post_if=PartialIn("x"),
            paddle=f"{_pd}InferSpmd", doc=_doc),
        reverse=Way(partial(notation, False, True), key=f"out, dt.links({_rev})", env=_ENV,
                    check=(*_check, _out_view), paddle=f"{_pd}InferSpmdReverse",
                    doc=f"{_op} reverse: x from out through the inverted list."),
        outputs="out: T", aliases=_aliases,
    )  # fmt: skip
for _op, _sig, _holder in (("reshape", "x_shape: T, out_grad: T", _x_shape),
                           ("flatten", "xshape: T, out_grad: T", _xshape),
                           ("squeeze", "xshape: T, out_grad: T, axis: ints = []", _xshape),
                           ("unsqueeze", "x: T, out_grad: T, axis: ints = []", _x)):
    _xs = _sig.split(":")[0]
    declare(
        f"{_op}_grad", _sig,
        Way(grad_notation, key=f"out_grad, dt.reshape_links(out_grad.shape, {_xs}.shape)", env=_ENV,
            check=_holder[0], out_shapes=_holder[1],
            post=_grad_post, paddle=f"{_op.capitalize()}GradInferSpmd",
            doc="x_grad = out_grad viewed as x's shape; the shape holder is returned as given."),
    )  # fmt: skip


# -- output shapes / grads ----------------------------------------------------------------------


def _reshape_shape(a: Args) -> list[Expect]:
    """out: ``shape`` with a 0 copying x's size at its index and one -1 inferred."""
    x, shape = a.s("x"), a.a("shape")
    out: list[int] = []
    infer = -1
    for i, v in enumerate(shape):
        if v == 0:
            if i >= len(x):
                raise UnknownShape
            out.append(x[i])
        elif v == -1:
            if infer >= 0:
                raise UnknownShape
            infer = i
            out.append(-1)
        elif v > 0:
            out.append(v)
        else:
            raise UnknownShape
    if infer >= 0:
        known = math.prod([v for v in out if v != -1])
        if known == 0:
            raise UnknownShape
        out[infer] = math.prod(x) // known
    return [tuple(out)]


def _flatten_shape(a: Args) -> list[Expect]:
    x = a.s("x")
    if not x:
        return [(1,)]
    start, stop = axis_of(a.a("start_axis"), len(x)), axis_of(a.a("stop_axis"), len(x))
    if start > stop:
        raise UnknownShape
    return [(*x[:start], math.prod(x[start:stop + 1]), *x[stop + 1:])]


def _squeeze_shape(a: Args) -> list[Expect]:
    x = a.s("x")
    axes = a.a("axis") or ()
    if not axes:
        return [tuple(v for v in x if v != 1)]
    drop = {axis_of(ax, len(x)) for ax in axes}
    return [tuple(v for i, v in enumerate(x) if not (i in drop and v == 1))]


def _unsqueeze_shape(a: Args) -> list[Expect]:
    out = list(a.s("x"))
    for ax in a.a("axis") or ():
        nd = len(out) + 1
        if not -nd <= ax < nd:
            raise UnknownShape
        out.insert(ax % nd, 1)
    return [tuple(out)]


def _view_grad_shape(holder: str) -> ShapeFn:
    """x_grad has the shape the holder records: x itself, or Paddle's xshape ``[0, *x.shape]``
    (the rule's output rank says which)."""

    def view_grad(a: Args) -> list[Expect]:
        h = a.s(holder)
        if holder == "x":
            return [h]
        nd = a.nd(0)
        if nd == len(h):
            return [h]
        if nd == len(h) - 1 and h and h[0] == 0:
            return [h[1:]]
        raise UnknownShape

    return view_grad


facts("reshape", shape=_reshape_shape)
facts("flatten", shape=_flatten_shape)
facts("squeeze", shape=_squeeze_shape)
facts("unsqueeze", shape=_unsqueeze_shape)
for _op, _held in (("reshape", "x_shape"), ("flatten", "xshape"), ("squeeze", "xshape"), ("unsqueeze", "x")):
    facts(f"{_op}_grad", shape=_view_grad_shape(_held))
for _op in ("reshape", "unsqueeze", "squeeze"):  # autodiff
    facts(_op, grad=f"{_op}_grad", wrt=("x",))


# -- cost

#: views: metadata only, no kernel
facts("reshape", "squeeze", "unsqueeze", "flatten", "reshape_grad", "squeeze_grad", "unsqueeze_grad", "flatten_grad",
      cost=no_kernel)
