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
x's shape (the shape of ``x_shape`` / ``xshape`` / ``x``).

Deviations from Paddle 3.3.1 (docs/deviations.md, "View family"): invalid targets and axes
raise; unsqueeze places new axes as the op does (one after another), and the reverse rules
do not co-shard an out axis whose size the mesh dims do not divide.

Bound: unsqueeze inserts at most :data:`MAX_NEW_AXES` (1024) axes (Paddle's tensors have at
most 9 dims); a longer ``axis`` list is an InvalidAttributeError (placing the axes one after
another costs time quadratic in their number).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

from spmdkit.core.dist_attr import TensorDistAttr
from spmdkit.core.errors import InvalidAttributeError, ShapeMismatchError
from spmdkit.core.spec import DistTensorSpec, SpmdResult
from spmdkit.engine.compile import infer
from spmdkit.engine.dim_trans import (
    DimTrans,
    Link,
    flatten_reverse_trans,
    flatten_trans,
    invert_trans,
    links,
    reshape_links,
    resolve_target,
    squeeze_trans,
    unsqueeze_trans,
    view_plan,
)
from spmdkit.engine.notation import fast_result
from spmdkit.engine.registry import register

_make = TensorDistAttr.unchecked


def _check_sizes(op: str, spec: DistTensorSpec, name: str, dynamic: bool = False) -> None:
    """Sizes >= 1; with ``dynamic`` (reshape's x and out) a size may also be -1 (unknown)."""
    for s in spec.shape:
        if s <= 0 and not (dynamic and s == -1):
            raise ShapeMismatchError(f"{op}: {name} has shape {list(spec.shape)}; view rules need sizes >= 1"
                                     + (" (or -1 for a dynamic size)" if dynamic else ""))


def _forward(op: str, x: DistTensorSpec, ln: tuple[Link, ...], out_shape: tuple[int, ...], keep: bool = True,
             name: str = "x") -> tuple[TensorDistAttr, TensorDistAttr]:
    """(x's attr, out's) for x viewed as ``out_shape`` through ``ln``. ``keep`` (reshape,
    flatten, the grads): co-shards read as they are and a partial x kept on x and out (the
    post-hook: a view is linear, so x's partial sum passes to out; the engine reshards a partial
    input); else (squeeze, unsqueeze: as Paddle 3.3.1) co-shards read as their largest mesh dim
    and a partial x resharded."""
    a = x.dist_attr
    (i,), (o,) = infer(view_plan(len(x.shape), ln, keep), op, (x,), (), a.mesh, (name,), out_shapes=(out_shape,))
    if keep and a.partial:
        return _make(a.mesh, i.dims_mapping, a.partial), _make(a.mesh, o.dims_mapping, a.partial)  # type: ignore[union-attr]
    return i, o  # type: ignore[return-value]


def _reverse(op: str, x: DistTensorSpec, out: DistTensorSpec, out_shape: tuple[int, ...],
             ln: tuple[Link, ...] | None = None) -> SpmdResult:
    """x from out through ``ln`` (each x axis's link to out's axes; reshape's when None)."""
    if tuple(out.shape) != tuple(out_shape):
        raise ShapeMismatchError(f"{op}: out has shape {list(out.shape)} but x of shape {list(x.shape)} "
                                 f"gives {list(out_shape)}")
    if ln is None:
        ln = reshape_links(out.shape, x.shape)
    p = view_plan(len(out.shape), ln, False, True)
    return fast_result(*infer(p, op, (x,), (out,), out.dist_attr.mesh, ("x", "out")))


def _grad(op: str, xs_name: str, xs: DistTensorSpec, out_grad: DistTensorSpec, *attrs: object) -> SpmdResult:
    """x_grad = out_grad viewed as x's shape; ``xs`` (x's shape holder) is returned as given
    (squeeze / unsqueeze grads' ``axis`` unused)."""
    _check_sizes(op, xs, xs_name)
    _check_sizes(op, out_grad, "out_grad")
    n = math.prod(xs.shape)
    if n != math.prod(out_grad.shape):
        raise ShapeMismatchError(f"{op}: out_grad of shape {list(out_grad.shape)} does not hold the "
                                 f"{n} elements of {xs_name} of shape {list(xs.shape)}")
    i, o = _forward(op, out_grad, reshape_links(out_grad.shape, xs.shape), xs.shape, name="out_grad")
    return fast_result((xs.dist_attr, i), (o,))


# -- reshape -------------------------------------------------------------------------------------


def reshape_forward(x: DistTensorSpec, shape: tuple[int, ...]) -> SpmdResult:
    """out = x viewed as ``shape`` (0 copies x's size, one -1 inferred; a dynamic (-1) size of x
    must be copied by a 0 at its index)."""
    xs = x.shape
    for v in xs:
        if v <= 0:
            _check_sizes("reshape", x, "x", dynamic=True)
            break
    tgt = resolve_target("reshape", shape, xs)
    i, o = _forward("reshape", x, reshape_links(xs, tgt), tgt)
    return fast_result((i,), (o,))


def reshape_backward(x: DistTensorSpec, out: DistTensorSpec, shape: tuple[int, ...]) -> SpmdResult:
    """x from out through the list out -> x."""
    _check_sizes("reshape", x, "x", dynamic=True)
    _check_sizes("reshape", out, "out", dynamic=True)
    return _reverse("reshape", x, out, resolve_target("reshape", shape, x.shape))


# -- flatten, squeeze, unsqueeze: the op's list, its reverse, then as reshape ---------------------

#: The most axes one unsqueeze inserts (see the module docstring).
MAX_NEW_AXES = 1024

Lists = tuple[tuple[DimTrans, ...], tuple[int, ...]]


def _flatten(x: DistTensorSpec, start_axis: int, stop_axis: int) -> Lists:
    return flatten_trans(x.shape, int(start_axis), int(stop_axis))


def _flatten_reverse(x: DistTensorSpec, trans: tuple[DimTrans, ...], start_axis: int, stop_axis: int) -> tuple[DimTrans, ...]:
    return flatten_reverse_trans(x.shape, int(start_axis), int(stop_axis))


def _squeeze(x: DistTensorSpec, axis: tuple[int, ...]) -> Lists:
    return squeeze_trans(x.shape, tuple(axis))


def _unsqueeze(x: DistTensorSpec, axis: tuple[int, ...]) -> Lists:
    if len(axis) > MAX_NEW_AXES:
        raise InvalidAttributeError(f"unsqueeze: axis has {len(axis)} entries; at most {MAX_NEW_AXES} new axes are answered")
    return unsqueeze_trans(x.shape, tuple(axis))


def _inverse(x: DistTensorSpec, trans: tuple[DimTrans, ...], *attrs: object) -> tuple[DimTrans, ...]:
    return invert_trans(trans, x.ndim)


def _list_rules(op: str, lists: Callable[..., Lists], reverse: Callable[..., tuple[DimTrans, ...]],
                keep: bool) -> tuple[Callable[..., SpmdResult], Callable[..., SpmdResult]]:
    """The forward and reverse rules of a view op whose list and out shape ``lists(x, *attrs)``
    gives (``reverse(x, list, *attrs)``: the list out -> x), after checking x's sizes."""

    def forward(x: DistTensorSpec, *attrs: object) -> SpmdResult:
        _check_sizes(op, x, "x")
        trans, oshape = lists(x, *attrs)
        i, o = _forward(op, x, links(trans), oshape, keep)
        return fast_result((i,), (o,))

    def backward(x: DistTensorSpec, out: DistTensorSpec, *attrs: object) -> SpmdResult:
        _check_sizes(op, x, "x")
        trans, oshape = lists(x, *attrs)
        return _reverse(op, x, out, oshape, links(reverse(x, trans, *attrs)))

    return forward, backward


register("reshape", reshape_forward, "x: T, shape: ints", reshape_backward, kind="reverse", outputs="out: T",
         aliases=("reshape2",), forward_name="ReshapeInferSpmd", backward_name="ReshapeInferSpmdReverse")
for _op, _lists, _rev, _keep, _sig, _aliases, _doc in (
    ("flatten", _flatten, _flatten_reverse, True, "x: T, start_axis: int, stop_axis: int", (),
     "Axes start_axis..stop_axis merged into one."),
    ("squeeze", _squeeze, _inverse, False, "x: T, axis: ints", (),
     "Size-1 axes in ``axis`` (all when empty) removed; sharding on kept size-1 axes dropped."),
    ("unsqueeze", _unsqueeze, _inverse, False, "x: T, axis: ints", ("unsqueeze2",),
     "New size-1 axes inserted at ``axis`` (one after another, as the op does)."),
):
    _fwd, _bwd = _list_rules(_op, _lists, _rev, _keep)
    register(_op, _fwd, _sig, _bwd, kind="reverse", outputs="out: T", aliases=_aliases, doc=_doc,
             forward_name=f"{_op.capitalize()}InferSpmd", backward_name=f"{_op.capitalize()}InferSpmdReverse")
for _op, _sig in (("reshape", "x_shape: T, out_grad: T"), ("flatten", "xshape: T, out_grad: T"),
                  ("squeeze", "xshape: T, out_grad: T, axis: ints = []"), ("unsqueeze", "x: T, out_grad: T, axis: ints = []")):
    register(f"{_op}_grad", partial(_grad, f"{_op}_grad", _sig.split(":")[0]), _sig,
             doc="x_grad = out_grad viewed as x's shape; the shape holder is returned as given.",
             forward_name=f"{_op.capitalize()}GradInferSpmd")
