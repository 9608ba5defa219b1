"""Scans, arg-reductions and misc: triu, tril_triu, cumsum, argmax, argmin, topk,
logsumexp, add_n and the ``*_like`` creators, with their reverse and grad rules.

Notation (x ``abc``; a co-sharded axis keeps one mesh dim, its largest (the first of
equal sizes), as Paddle 3.3.1's rules do, except triu / tril_triu which keep it):

- ``triu`` / ``tril_triu`` (TriuInferSpmd, TrilTriuInferSpmd): ``ab[ij] -> ab[ij]``, the
  last two axes (the matrix) replicated: the mask depends on global row / column indices.
  x must have at least 2 dims. Grads (TriuGradInferSpmd(out_grd, diagonal), spelled as in
  Paddle; tril_triu_grad(out_grad, diagonal, lower) after Paddle's backward op): the same on
  out_grad, x_grad sharded as out_grad.
- ``cumsum`` (CumSumInferSpmd(x, axis, flatten, exclusive, reverse)): ``abc -> abc`` with
  the scanned axis replicated; ``flatten`` replicates everything and out is 1-D
  (``[numel]``). cumsum_grad (CumSumGradInferSpmd(x, out_grad, ...)): out_grad as the
  reverse rule infers it, x and x_grad as x from it (Paddle returns x as given, but the
  kernel shapes x_grad by the local x, so x must be sharded as x_grad).
- ``argmax`` / ``argmin`` (ArgMaxInferSpmdBase / ArgMinInferSpmdBase(x, axis, keepdims,
  flatten)): ``abc -> ac`` (``a1c`` with keepdims), the arg axis replicated; ``flatten``
  replicates x and out is 0-d (``[1, 1, 1]`` with keepdims). No grad.
- ``topk`` (TopkInferSpmd(x, k, axis, largest, sorted)): ``abc -> abc, abc`` (out,
  indices), the topk axis replicated. Paddle registers TopkGradInferSpmd(x, indices,
  out_grad, k, axis, largest, sorted) as topk's backward; it is also ``topk_grad``:
  ``abc, akc, akc -> abc``, the non-axis letters merged over the three tensors.
- ``logsumexp`` (LogSumExpInferSpmd(x, axis, keepdims, reduce_all)): a reduction whose
  reduced axes are replicated (no partial type is right for a log of a sum); kept axes
  keep their sharding. ``reduce_all`` (or an empty axis list) reduces every axis.
  logsumexp_grad (LogSumExpGradInferSpmd(x, out, out_grad, ...)): x, x_grad take
  out_grad's sharding on the kept axes, reduced axes replicated; out, out_grad not
  partial and unsharded on kept size-1 axes.
- ``add_n`` (AddNInferSpmd(input: vector)): ``ab, ab, ... -> ab``, shardings merged (a
  conflict is resolved, the first tensor keeping its sharding); inputs all partial with
  one and the same linear status (SUM / AVG) keep it and out is partial so, otherwise
  partial inputs are made replicated. Reverse (Paddle has none): inputs take out's
  sharding, not partial. add_n_grad(inputs, out_grad) (Paddle's backward op): each
  input's grad is out_grad, partial included; the inputs are returned as given.
- ``full_like`` (FullLikeInferSpmd(x, y, dtype)), ``empty_like`` (EmptyLikeInferSpmd(x,
  dtype)), ``ones_like``, ``zeros_like`` (CreateLikeInferSpmd(x)): out sharded like x,
  never partial; x is returned as given (only its shape is used). These are not Paddle
  3.3.1 registered rule names (no oracle); the reverse rule (built here) gives x out's
  sharding. No grads.

Partial inputs of every other rule here are made replicated, as Paddle does.

Deviations from Paddle 3.3.1 (docs/deviations.md, ``scan-*``): triu / tril_triu answer
one mesh dim for the output of a co-sharded batch axis while keeping the co-shard on x
(class 6: spmdkit keeps it on both); logsumexp marks a sharded reduced axis partial SUM
(class 2: replicated); logsumexp ignores ``reduce_all`` (class 5: spmdkit reduces every
axis, as the kernel does); argmax / argmin with flatten and not keepdims answer a 1-D out
for a 0-d output (class 5); reverse rules echo a partial ``out`` (class 4); add_n keeps a
common MAX / MIN / PROD partial status (unsound: a sum of maxima is not a maximum of
sums) and raises on conflicting shardings (class 8); topk_grad and add_n raise on
conflicts where spmdkit resolves them; Paddle crashes on a negative cumsum axis and on
out-of-range axes (spmdkit raises SpmdError).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache, partial
from typing import Any

from spmdkit.core.dist_attr import Partial, ReduceType
from spmdkit.core.errors import InvalidAttributeError, ShapeMismatchError
from spmdkit.core.spec import DistTensorSpec
from spmdkit.engine.axes import make_attr, normalize_axis, numel, reduced_axes
from spmdkit.engine.declare import PartialIn, Way, declare
from spmdkit.engine.facts import facts
from spmdkit.engine.notation import BROADCAST, Coshard, Notation, letters_for
from spmdkit.engine.outshape import Args, Expect, UnknownShape, axis_of, broadcast, over_axis_or_all, reduced, same
from spmdkit.engine.tensors import with_partial
from spmdkit.ops._common import check_same_ndim, check_same_shape
from spmdkit.ops._cost import by_bytes, copy, fill, no_kernel, one_per_element
from spmdkit.ops.reduction import as_given, check_reduced, reduced_letters

Attrs = Sequence[Any]
#: reduced_axes, cached (a reverse rule's check reads it per call)
_axes = lru_cache(maxsize=4096)(reduced_axes)


def _same(nd: int, matrix: bool = False) -> Notation:
    """``abc -> abc``, never partial (the *_like creators; the reverse: x like out); ``matrix`` (triu):
    the last two axes replicated, the batch axes keep their sharding."""
    a = letters_for(nd)
    return Notation([a], [a], replicated=a[-2:] if matrix else "")


def _cumsum(grad: bool, nd: int, axis: int, flatten: bool) -> Notation:
    """``abc -> abc``, the scanned axis replicated (each co-shard read as its largest mesh dim); flatten:
    everything replicated, out 1-D. The grad ``abc, abc -> abc``: out_grad as the reverse rule infers it
    (merged alone), x and x_grad as x from it."""
    ax = 0 if flatten else normalize_axis("", axis, nd, tensor="x")
    a = letters_for(nd)
    o, rep, cs = (BROADCAST, a, Coshard.KEEP) if flatten else (a, a[ax : ax + 1], Coshard.LARGEST)
    if grad:
        return Notation([a, o], [a], replicated=rep, coshard=cs, sources=(1,))
    return Notation([a], [o], replicated=rep, coshard=cs)


def _reduce(grad: bool, nd: int, axis: tuple[int, ...], keepdims: bool, reduce_all: bool) -> Notation:
    """logsumexp, argmax / argmin (``axis``: the arg axis, ``reduce_all``: flatten): ``abc -> ac``
    (``a1c`` with keepdims), the reduced letters replicated, each co-shard read as its largest mesh
    dim; the grad ``abc, ac, ac -> abc`` merged from out_grad alone."""
    x, o, red, _ = reduced_letters(nd, axis, keepdims, reduce_all)
    if grad:
        return Notation([x, o, o], [x], replicated=red, coshard=Coshard.LARGEST, sources=(2,))
    return Notation([x], [o], replicated=red, coshard=Coshard.LARGEST)


def _check_reduced(op: str, x: DistTensorSpec, axis: tuple[int, ...], keep: bool, every: bool, *outs: Any) -> None:
    """out (and out_grad) shaped as x reduced (the axes checked first)."""
    pos = _axes(op, len(x.shape), axis, keep, every)[1]
    for name, t in zip(("out", "out_grad"), outs):
        check_reduced(op, t, x, pos, name)


def _topk_check(op: str, x: DistTensorSpec, k: int, axis: int, indices: DistTensorSpec | None = None,
                out_grad: DistTensorSpec | None = None) -> None:  # fmt: skip
    """x at least 1-D, k in 1..size; the grad's indices and out_grad shaped as x except on the
    axis (Paddle's own unit test passes indices of x's shape)."""
    more = () if indices is None or out_grad is None else (indices, out_grad)
    nd = len(x.shape)
    if more:
        for name, t in zip(("indices", "out_grad"), more):
            check_same_ndim(op, t, nd, name, "x")
    if nd == 0:
        raise ShapeMismatchError(f"{op}: x must have at least 1 dim (axis {axis} is out of range for a 0-d x)")
    ax = normalize_axis(op, axis, nd, tensor="x")
    if k < 1 or 0 <= x.shape[ax] < k:
        raise InvalidAttributeError(f"{op}: k must be at least 1 and at most x's axis {ax} size {x.shape[ax]}, got {k}")
    for name, t in zip(("indices", "out_grad"), more) if more else ():
        check_same_shape(op, t, (*x.shape[:ax], t.shape[ax], *x.shape[ax + 1 :]), name, "x")


def _topk(n_in: int, n_out: int, nd: int, axis: int) -> Notation:
    """``abc -> abc, abc`` (out, indices); the grad ``abc, abc, abc -> abc`` merged over the three
    (the larger tensor keeps a letter they shard differently); the topk axis replicated, each
    co-shard read as its largest mesh dim."""
    a = letters_for(nd)
    return Notation([a] * n_in, [a] * n_out, replicated=a[normalize_axis("", axis, nd)], coshard=Coshard.LARGEST)


_LINEAR = frozenset({ReduceType.SUM, ReduceType.AVG})


def _add_n(n_in: int, nd: int, grad: bool = False) -> Notation:
    """``abc, abc, ... -> abc``: merged (a letter sharded differently: the larger tensor keeps
    it), each co-shard read as its largest mesh dim; the reverse from out alone. The grad
    ``abc (out_grad) -> abc, ...``: every grad sharded as out_grad; the inputs are not in the
    notation (None: their attrs are the post-hook's)."""
    a = letters_for(nd)
    return Notation([*[None] * n_in, a], [a] * n_in) if grad else Notation([a] * n_in, [a], coshard=Coshard.LARGEST)


def _add_n_check(op: str, inputs: Sequence[DistTensorSpec], name: str, other: Any = None, oname: str = "") -> None:
    """every input shaped as the first, and ``other`` (out, out_grad) too (-1 matches any size)."""
    shape = inputs[0].shape
    for i, t in enumerate(inputs):
        if t.shape != shape:
            check_same_shape(op, t, shape, f"{name}[{i}]", f"{name}[0]")
    if other is not None and other.shape != shape:
        check_same_shape(op, other, shape, oname, "adding the inputs")


def _add_n_partial(ins: Attrs, outs: Attrs, input: Sequence[DistTensorSpec]) -> tuple[Any, Any]:
    """post-hook: inputs all partial with one and the same linear status (SUM / AVG) keep it and
    out is partial so; every input is answered as out (as the engine answers them where input[0]
    is not partial: ``post_if``)."""
    a = outs[0]
    pt: Partial = input[0].dist_attr.partial
    if all(r in _LINEAR for _, r in pt) and all(t.dist_attr.partial == pt for t in input[1:]):
        a = make_attr(a.mesh, a.dims_mapping, pt)
    return ((a,) * len(input),), (a,)


def _add_n_grad_post(ins: Attrs, outs: Attrs, inputs: Sequence[DistTensorSpec], out_grad: Any) -> tuple[Any, Any]:
    """post-hook: each grad IS out_grad, so a partial out_grad passes to every grad (a linear op),
    and the inputs, whose values the grad never reads, are not resharded (nor is out_grad). The
    inputs' attrs are one tuple (a list parameter's), the grads flat."""
    g = out_grad.dist_attr
    grads = tuple(outs) if not g.partial else (with_partial(outs[0], g.partial),) * len(inputs)
    return (tuple(t.dist_attr for t in inputs), g), (grads,)


# ---------------------------------------------------------------------------
# declarations
# ---------------------------------------------------------------------------

def _cumsum_out(op: str, x: DistTensorSpec, out: DistTensorSpec, flatten: bool) -> None:
    check_same_shape(op, out, (numel(x.shape),) if flatten else x.shape, "out", "cumsum of x")


def _cumsum_out_grad(op: str, x: DistTensorSpec, out_grad: DistTensorSpec, flatten: bool) -> None:
    check_same_shape(op, out_grad, (numel(x.shape),) if flatten else x.shape, "out_grad", "cumsum of x")


def _arg_out(op: str, x: DistTensorSpec, axis: int, keepdims: bool, flatten: bool, out: DistTensorSpec) -> None:
    _check_reduced(op, x, (axis,), keepdims, flatten, out)


def _logsumexp_outs(op: str, x: DistTensorSpec, axis: tuple[int, ...], keepdims: bool, reduce_all: bool,
                    out: DistTensorSpec, out_grad: DistTensorSpec | None = None) -> None:  # fmt: skip
    _check_reduced(op, x, axis, keepdims, reduce_all, *((out,) if out_grad is None else (out, out_grad)))


def _add_n_in(op: str, input: Sequence[DistTensorSpec]) -> None:
    _add_n_check(op, input, "input")


def _add_n_out(op: str, input: Sequence[DistTensorSpec], out: DistTensorSpec) -> None:
    _add_n_check(op, input, "input", out, "out")


def _add_n_grads(op: str, inputs: Sequence[DistTensorSpec], out_grad: DistTensorSpec) -> None:
    _add_n_check(op, inputs, "inputs", out_grad, "out_grad")


_TRIU = "diagonal: int = 0"
for _op, _fn, _attrs, _g, _gfn in (
    ("triu", "TriuInferSpmd", _TRIU, "out_grd", "TriuGradInferSpmd"),
    ("tril_triu", "TrilTriuInferSpmd", _TRIU + ", lower: bool = False", "out_grad", "tril_triu_grad (backward op)"),
):
    _way = Way(_same, key="x, True", shapes="x: ... _ _", paddle=_fn)
    _rev = Way(_same, key="x, True", shapes="x: ... _ _", same=[("x", "out")], paddle=_fn + "Reverse")
    declare(_op, f"x: T, {_attrs}", _way, reverse=_rev, outputs="out: T")
    declare(f"{_op}_grad", f"{_g}: T, {_attrs}", Way(_same, key=f"{_g}, True", shapes=f"{_g}: ... _ _", paddle=_gfn))

_CS = "axis: int = -1, flatten: bool = False, exclusive: bool = False, reverse: bool = False"
_CS_KW: dict[str, Any] = {"key": "x, axis, flatten"}
_way = Way(partial(_cumsum, False), paddle="CumSumInferSpmd", **_CS_KW)
_rev = Way(partial(_cumsum, False), check=_cumsum_out, paddle="CumSumInferSpmdReverse", **_CS_KW)
declare("cumsum", f"x: T, {_CS}", _way, reverse=_rev, outputs="out: T")
_way = Way(partial(_cumsum, True), check=_cumsum_out_grad, paddle="CumSumGradInferSpmd", **_CS_KW)
declare("cumsum_grad", f"x: T, out_grad: T, {_CS}", _way)

_ARG = "axis: int = -1, keepdims: bool = False, flatten: bool = False"
_ARG_KW: dict[str, Any] = {"key": "x, (axis,), keepdims, flatten"}
for _op, _fn in (("argmax", "ArgMaxInferSpmd"), ("argmin", "ArgMinInferSpmd")):
    _way = Way(partial(_reduce, False), paddle=_fn + "Base", **_ARG_KW)
    _rev = Way(partial(_reduce, False), check=_arg_out, paddle=_fn + "ReverseBase", **_ARG_KW)
    declare(_op, f"x: T, {_ARG}", _way, reverse=_rev, outputs="out: T")

_TK = "k: int = 1, axis: int = -1, largest: bool = True, sorted: bool = True"
_TK_GRAD = f"x: T, indices: T, out_grad: T, {_TK}"
_TK_GRAD_WAY = Way(partial(_topk, 3, 1), key="x, axis", check=_topk_check, paddle="TopkGradInferSpmd")
# topk's backward slot is Paddle's TopkGradInferSpmd under topk's own name (errors name topk); it
# is also the rule topk_grad
_way = Way(partial(_topk, 1, 2), key="x, axis", check=_topk_check, paddle="TopkInferSpmd")
declare("topk", f"x: T, {_TK}", _way, grad=_TK_GRAD_WAY, grad_signature=_TK_GRAD, grad_op="topk")
declare("topk_grad", _TK_GRAD, _TK_GRAD_WAY)

_LS = "axis: ints = [], keepdims: bool = False, reduce_all: bool = False"
_LS_KW: dict[str, Any] = {"key": "x, axis, keepdims, reduce_all", "check": _logsumexp_outs}
_way = Way(partial(_reduce, False), key=_LS_KW["key"], paddle="LogSumExpInferSpmd")
_rev = Way(partial(_reduce, False), paddle="LogSumExpInferSpmdReverse", **_LS_KW)
declare("logsumexp", f"x: T, {_LS}", _way, reverse=_rev, outputs="out: T")
_way = Way(partial(_reduce, True), paddle="LogSumExpGradInferSpmd", **_LS_KW)
declare("logsumexp_grad", f"x: T, out: T, out_grad: T, {_LS}", _way)

_AN_KW: dict[str, Any] = {
    "key": "len(input), len(input[0].shape)",
    "nonempty": ("input",),
}
_way = Way(
    _add_n,
    check=_add_n_in,
    post=_add_n_partial,
    post_if=lambda input: input[0].dist_attr.partial,
    paddle="AddNInferSpmd",
    **_AN_KW,
)
_rev = Way(_add_n, check=_add_n_out, paddle="add_n reverse (spmdkit)", **_AN_KW)
declare("add_n", "input: [T]", _way, reverse=_rev, outputs="out: T")
_way = Way(
    partial(_add_n, grad=True),
    key="len(inputs), out_grad",
    check=_add_n_grads,
    nonempty=("inputs",),
    post=_add_n_grad_post,
    paddle="add_n_grad (backward op)",
)
declare("add_n_grad", "inputs: [T], out_grad: T", _way)

for _op, _fn, _attrs in (
    ("full_like", "FullLikeInferSpmd", ", y: scalar = 0.0, dtype: any = None"),
    ("empty_like", "EmptyLikeInferSpmd", ", dtype: any = None"),
    ("ones_like", "CreateLikeInferSpmd", ""),
    ("zeros_like", "CreateLikeInferSpmd", ""),
):
    _way = Way(_same, key="x", post=as_given, post_if=PartialIn("x"), paddle=_fn)
    _rev = Way(_same, key="x", same=[("x", "out")], paddle=f"{_op} reverse (spmdkit)")
    declare(_op, f"x: T{_attrs}", _way, reverse=_rev, outputs="out: T")


# -- output shapes / grads ----------------------------------------------------------------------


def _add_n_shape(a: Args) -> list[Expect]:
    xs = [s for s in a.vec("input") if s is not None]
    if not xs:
        raise UnknownShape
    return [broadcast(*xs)]


def _cumsum_shape(a: Args) -> list[Expect]:
    x = a.s("x")
    return [(math.prod(x),) if a.a("flatten", False) else x]


def _topk_shape(a: Args) -> list[Expect]:
    """out and indices: x with k entries along the axis."""
    x = a.s("x")
    if not x:
        return [(), ()]
    ax = axis_of(a.a("axis", -1), len(x))
    k = a.a("k", 1)
    out = (*x[:ax], k, *x[ax + 1:])
    return [out, out]


facts("triu", "tril_triu", "full_like", "empty_like", "ones_like", "zeros_like", shape=same)
facts("triu_grad", "tril_triu_grad", grad_like=("=",))  # x_grad has out_grad's shape
facts("cumsum", shape=_cumsum_shape)
facts("argmax", "argmin", shape=over_axis_or_all("flatten"))
facts("topk", shape=_topk_shape)
facts("logsumexp", shape=reduced)
facts("add_n", shape=_add_n_shape)
facts("add_n_grad", grad_like=("inputs",))


# -- cost

facts("triu", "triu_grad", "tril_triu", "tril_triu_grad", "cumsum", "cumsum_grad", "topk", "topk_grad", cost=copy)
facts("argmax", "argmin", "logsumexp", "logsumexp_grad", "add_n", cost=one_per_element)
#: add_n's grad hands out_grad to every input: no FLOPs
facts("add_n_grad", cost=by_bytes(0))
facts("full_like", "ones_like", "zeros_like", cost=fill)
facts("empty_like", cost=no_kernel)
