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

from collections.abc import Sequence
from functools import lru_cache, partial
from typing import Any

from spmdkit.core.dist_attr import Partial, ReduceType
from spmdkit.core.errors import InvalidAttributeError, ShapeMismatchError
from spmdkit.core.spec import DistTensorSpec
from spmdkit.engine.axes import make_attr, normalize_axis, numel, reduced_axes
from spmdkit.engine.declare import Answer, Way, declare, generate
from spmdkit.engine.notation import ALPHABET, BROADCAST, Notation, letters_for, with_partial
from spmdkit.engine.registry import register

Shape = tuple[int, ...]
Attrs = Sequence[Any]


def _check_shape(op: str, got: Shape, want: Shape, name: str, what: str) -> None:
    if len(got) != len(want):
        raise ShapeMismatchError(f"{op}: {name} has {len(got)} dims, but {what} gives {len(want)} (shape {list(want)})")
    for i, (s, w) in enumerate(zip(got, want)):
        if s != w and s >= 0 and w >= 0:
            raise ShapeMismatchError(f"{op}: {name} axis {i} has size {s}, but {what} gives {w}")


def _min2(op: str, t: DistTensorSpec, name: str) -> None:
    if len(t.shape) < 2:
        raise ShapeMismatchError(f"{op}: {name} must have at least 2 dims, got {len(t.shape)}")


def _same(nd: int) -> Notation:
    """``abc -> abc`` (the *_like creators; the reverse: x like out), never partial."""
    a = letters_for(nd)
    return Notation([a], [a])


def _as_given(ins: Attrs, outs: Attrs, x: DistTensorSpec, *attrs: Any) -> Answer:
    """post-hook: x returned as given (only its shape is read, so no reshard is asked of it); the
    engine answers an x that is not partial as given already (``post_if``)."""
    return (x.dist_attr,), outs


# ---------------------------------------------------------------------------
# triu / tril_triu
# ---------------------------------------------------------------------------


def _triu(nd: int) -> Notation:
    """``abcd -> abcd``, the last two axes replicated; the batch axes keep their sharding."""
    a = letters_for(nd)
    return Notation([a], [a], replicated=a[-2:])


# ---------------------------------------------------------------------------
# cumsum, argmax / argmin
# ---------------------------------------------------------------------------


def _axis(nd: int, ax: int, out: str) -> Notation:
    """``abc -> <out>`` with axis ``ax`` replicated, each co-shard read as its largest mesh dim
    (``out``: ``"same"``, ``"drop"`` the axis, ``"flat"``: everything replicated, out 1-D,
    ``"flat0"`` / ``"flatk"``: everything replicated, out 0-d / x's rank of size-1 axes)."""
    a = letters_for(nd)
    if out.startswith("flat"):
        return Notation([a], [{"flat": BROADCAST, "flat0": "", "flatk": BROADCAST * nd}[out]], replicated=a)
    o = a if out == "same" else a[:ax] + a[ax + 1 :]
    return Notation([a], [o], replicated=a[ax : ax + 1], coshard="largest")


def _cumsum(nd: int, axis: int, flatten: bool) -> Notation:
    return _axis(nd, 0, "flat") if flatten else _axis(nd, normalize_axis("", axis, nd, tensor="x"), "same")


def _cumsum_grad(nd: int, axis: int, flatten: bool) -> Notation:
    """x, out_grad -> x_grad: out_grad as the reverse rule infers it (merged alone), x and x_grad
    as x from it."""
    nt = _cumsum(nd, axis, flatten)
    x, o = nt.inputs[0], nt.outputs[0]
    return Notation([x, o], [x], replicated=nt.replicated, coshard=nt.coshard, sources=(1,))


def _cumsum_check(op: str, x: DistTensorSpec, out: DistTensorSpec, flatten: bool, name: str) -> None:
    _check_shape(op, out.shape, (numel(x.shape),) if flatten else x.shape, name, "cumsum of x")


def _arg(nd: int, axis: int, keepdims: bool, flatten: bool) -> Notation:
    ax = normalize_axis("", axis, nd, tensor="x")
    return _axis(nd, ax, ("flatk" if keepdims else "flat0") if flatten else "same" if keepdims or nd == 0 else "drop")


def _arg_check(op: str, x: DistTensorSpec, out: DistTensorSpec, axis: int, keepdims: bool, flatten: bool) -> None:
    ax = normalize_axis(op, axis, len(x.shape), tensor="x")
    s = x.shape
    want = ((1,) * len(s) if keepdims else ()) if flatten else () if not s else (
        (*s[:ax], 1, *s[ax + 1:]) if keepdims else (*s[:ax], *s[ax + 1:]))  # fmt: skip
    _check_shape(op, out.shape, want, "out", f"{op} of x")


# ---------------------------------------------------------------------------
# topk
# ---------------------------------------------------------------------------


def _topk_check(op: str, x: DistTensorSpec, k: int, axis: int, *more: DistTensorSpec) -> None:
    """x at least 1-D, k in 1..size; ``more``: the grad's indices and out_grad, shaped as x
    except on the axis (Paddle's own unit test passes indices of x's shape)."""
    nd = len(x.shape)
    if more:
        for name, t in zip(("indices", "out_grad"), more):
            if len(t.shape) != nd:
                raise ShapeMismatchError(f"{op}: {name} has {len(t.shape)} dims but x has {nd}")
    if nd == 0:
        raise ShapeMismatchError(f"{op}: x must have at least 1 dim (axis {axis} is out of range for a 0-d x)")
    ax = normalize_axis(op, axis, nd, tensor="x")
    if k < 1:
        raise InvalidAttributeError(f"{op}: k must be >= 1, got {k}")
    size = x.shape[ax]
    if 0 <= size < k:
        raise InvalidAttributeError(f"{op}: k {k} is larger than x's axis {ax} size {size}")
    for name, t in zip(("indices", "out_grad"), more) if more else ():
        for i, (s, w) in enumerate(zip(t.shape, x.shape)):
            if i != ax and s != w and s >= 0 and w >= 0:
                raise ShapeMismatchError(f"{op}: {name} axis {i} has size {s}, but x has {w}")


def _topk(n_in: int, n_out: int, nd: int, axis: int) -> Notation:
    """``abc -> abc, abc`` (out, indices); the grad ``abc, abc, abc -> abc`` merged over the three
    (the larger tensor keeps a letter they shard differently); the topk axis replicated, each
    co-shard read as its largest mesh dim."""
    a = ALPHABET[:nd]
    ax = normalize_axis("", axis, nd)
    return Notation([a] * n_in, [a] * n_out, replicated=a[ax], coshard="largest")


# ---------------------------------------------------------------------------
# logsumexp
# ---------------------------------------------------------------------------


@lru_cache(maxsize=4096)
def _lse_pos(nd: int, axis: tuple[int, ...], keepdims: bool, reduce_all: bool) -> tuple[tuple[bool, ...], Shape]:
    return reduced_axes("", nd, axis, keepdims, reduce_all)


def _lse(grad: bool, nd: int, axis: tuple[int, ...], keepdims: bool, reduce_all: bool) -> Notation:
    """``abc -> ac`` (``a1c`` with keepdims), the reduced letters replicated, each co-shard read
    as its largest mesh dim; the grad ``abc, ac, ac -> abc`` merged from out_grad alone."""
    reduced, pos = _lse_pos(nd, axis, keepdims, reduce_all)
    x = letters_for(nd)
    o = "".join(BROADCAST if p < 0 else x[p] for p in pos)
    red = "".join(c for c, r in zip(x, reduced) if r)
    if grad:
        return Notation([x, o, o], [x], replicated=red, coshard="largest", sources=(2,))
    return Notation([x], [o], replicated=red, coshard="largest")


def _lse_check(op: str, x: DistTensorSpec, axis: tuple[int, ...], keepdims: bool, reduce_all: bool,
               *outs: DistTensorSpec) -> None:  # fmt: skip
    want = tuple(1 if i < 0 else x.shape[i] for i in _lse_pos(len(x.shape), axis, keepdims, reduce_all)[1])
    for name, t in zip(("out", "out_grad"), outs):
        _check_shape(op, t.shape, want, name, "reducing x")


# ---------------------------------------------------------------------------
# add_n
# ---------------------------------------------------------------------------

_LINEAR = frozenset({ReduceType.SUM, ReduceType.AVG})


def _add_n(n_in: int, nd: int) -> Notation:
    """``abc, abc, ... -> abc``: merged (a letter sharded differently: the larger tensor keeps
    it), each co-shard read as its largest mesh dim; the reverse from out alone."""
    a = letters_for(nd)
    return Notation([a] * n_in, [a], coshard="largest")


def _add_n_grad(n: int, nd: int) -> Notation:
    """``abc (out_grad) -> abc, ...``: every grad sharded as out_grad; the inputs are not in the
    notation (None: their attrs are the post-hook's)."""
    a = letters_for(nd)
    return Notation([*[None] * n, a], [a] * n)


def _add_n_check(op: str, inputs: Sequence[DistTensorSpec], name: str, other: DistTensorSpec | None = None,
                 oname: str = "", what: str = "") -> None:  # fmt: skip
    first = inputs[0]
    if len(first.shape) > len(ALPHABET):
        raise ShapeMismatchError(f"{op}: tensors of more than {len(ALPHABET)} dims are not supported")
    shape = first.shape
    for i, t in enumerate(inputs):
        if t.shape != shape:
            _check_shape(op, t.shape, shape, f"{name}[{i}]", f"{name}[0]")
    if other is not None and other.shape != shape:
        _check_shape(op, other.shape, shape, oname, what)


def _add_n_partial(ins: Attrs, outs: Attrs, input: Sequence[DistTensorSpec]) -> tuple[Any, Any]:
    """post-hook: inputs all partial with one and the same linear status (SUM / AVG) keep it and
    out is partial so; every input is answered as out (as the engine answers them where input[0]
    is not partial: ``post_if``)."""
    a = outs[0]
    pt: Partial = input[0].dist_attr.partial
    if pt and not all(r in _LINEAR for _, r in pt):
        pt = ()
    if pt:
        for t in input[1:]:
            if t.dist_attr.partial != pt:
                pt = ()
                break
    if pt:
        a = make_attr(a.mesh, a.dims_mapping, pt)
    return ((a,) * len(input),), (a,)


def _add_n_grad_post(
    ins: Attrs, outs: Attrs, inputs: Sequence[DistTensorSpec], out_grad: DistTensorSpec
) -> tuple[Any, Any]:
    """post-hook: each grad IS out_grad, so a partial out_grad passes to every grad (a linear op),
    and the inputs, whose values the grad never reads, are not resharded (nor is out_grad). The
    inputs' attrs are one tuple (a list parameter's), the grads flat."""
    g = out_grad.dist_attr
    grads = tuple(outs) if not g.partial else (with_partial(outs[0], g.partial),) * len(inputs)
    return (tuple(t.dist_attr for t in inputs), g), (grads,)


# ---------------------------------------------------------------------------
# declarations
# ---------------------------------------------------------------------------

_ENV = {"_min2": _min2, "_check_shape": _check_shape, "_cumsum_check": _cumsum_check, "_arg_check": _arg_check,
        "_topk_check": _topk_check, "_lse_check": _lse_check, "_add_n_check": _add_n_check}  # fmt: skip
_OUT = "_check_shape({op!r}, out.shape, x.shape, 'out', {what!r})"
for _op, _fn, _attrs in (("triu", "TriuInferSpmd", "diagonal: int = 0"),
                         ("tril_triu", "TrilTriuInferSpmd", "diagonal: int = 0, lower: bool = False")):
    declare(
        _op, f"x: T, {_attrs}",
        Way(_triu, key="x", check=f"_min2({_op!r}, x, 'x')", env=_ENV, paddle=_fn,
            doc=f"{_op} ({_fn}): the last two axes replicated, batch axes keep their sharding."),
        reverse=Way(_triu, key="x", check=f"_min2({_op!r}, x, 'x'); " + _OUT.format(op=_op, what=f"{_op} of x"),
                    env=_ENV, paddle=f"{_fn}Reverse", doc=f"{_op} ({_fn}Reverse): x from out, the last two axes "
                    "replicated."),
        outputs="out: T",
    )  # fmt: skip
declare("triu_grad", "out_grd: T, diagonal: int = 0",
        Way(_triu, key="out_grd", check="_min2('triu_grad', out_grd, 'out_grd')", env=_ENV, paddle="TriuGradInferSpmd",
            doc="TriuGradInferSpmd(out_grd, diagonal): out_grad and x_grad alike, the last two axes replicated, "
                "not partial."))  # fmt: skip
declare("tril_triu_grad", "out_grad: T, diagonal: int = 0, lower: bool = False",
        Way(_triu, key="out_grad", check="_min2('tril_triu_grad', out_grad, 'out_grad')", env=_ENV,
            paddle="tril_triu_grad (backward op)", doc="tril_triu_grad(out_grad, diagonal, lower): as triu_grad."))  # fmt: skip

_CS = "axis: int = -1, flatten: bool = False, exclusive: bool = False, reverse: bool = False"
declare(
    "cumsum", f"x: T, {_CS}",
    Way(_cumsum, key="x, axis, flatten", paddle="CumSumInferSpmd",
        doc="CumSumInferSpmd: the scanned axis replicated; flatten: all replicated, out 1-D."),
    reverse=Way(_cumsum, key="x, axis, flatten", check="_cumsum_check('cumsum', x, out, flatten, 'out')", env=_ENV,
                paddle="CumSumInferSpmdReverse", doc="CumSumInferSpmdReverse: x from out, the scanned axis replicated."),
    outputs="out: T",
)  # fmt: skip
declare(
    "cumsum_grad", f"x: T, out_grad: T, {_CS}",
    Way(_cumsum_grad, key="x, axis, flatten", check="_cumsum_check('cumsum_grad', x, out_grad, flatten, 'out_grad')",
        env=_ENV, paddle="CumSumGradInferSpmd",
        doc="CumSumGradInferSpmd: out_grad as the reverse rule infers it, x and x_grad as x from it (Paddle returns "
            "x as given: the kernel shapes x_grad by the local x, so x must match)."),
)  # fmt: skip
for _op, _fn in (("argmax", "ArgMaxInferSpmdBase"), ("argmin", "ArgMinInferSpmdBase")):
    declare(
        _op, "x: T, axis: int = -1, keepdims: bool = False, flatten: bool = False",
        Way(_arg, key="x, axis, keepdims, flatten", paddle=_fn,
            doc=f"{_op} ({_fn}): the arg axis replicated; flatten: x replicated, out 0-d."),
        reverse=Way(_arg, key="x, axis, keepdims, flatten", env=_ENV,
                    check=f"_arg_check({_op!r}, x, out, axis, keepdims, flatten)",
                    paddle=_fn.replace("InferSpmdBase", "InferSpmdReverseBase"), doc=f"{_op}: x from out."),
        outputs="out: T",
    )  # fmt: skip

_TK = "k: int = 1, axis: int = -1, largest: bool = True, sorted: bool = True"
_TK_GRAD = f"x: T, indices: T, out_grad: T, {_TK}"


def _topk_grad_way(op: str) -> Way:
    return Way(partial(_topk, 3, 1), key="x, axis", check=f"_topk_check({op!r}, x, k, axis, indices, out_grad)",
               env=_ENV, paddle="TopkGradInferSpmd",
               doc="TopkGradInferSpmd: x, indices, out_grad and x_grad sharded alike, the topk axis replicated.")


# topk's backward slot is Paddle's TopkGradInferSpmd under topk's own name (errors name topk); it
# is also the rule topk_grad
register("topk", generate("topk", f"x: T, {_TK}", Way(
             partial(_topk, 1, 2), key="x, axis", check="_topk_check('topk', x, k, axis)", env=_ENV,
             doc="TopkInferSpmd: out and indices sharded as x, the topk axis replicated."), name="topk_forward"),
         f"x: T, {_TK}", generate("topk", _TK_GRAD, _topk_grad_way("topk"), name="topk_backward"), _TK_GRAD,
         kind="grad", forward_name="TopkInferSpmd", backward_name="TopkGradInferSpmd")  # fmt: skip
declare("topk_grad", _TK_GRAD, _topk_grad_way("topk_grad"))

_LS = "axis: ints = [], keepdims: bool = False, reduce_all: bool = False"
_LS_KEY = "x, axis, keepdims, reduce_all"
declare(
    "logsumexp", f"x: T, {_LS}",
    Way(partial(_lse, False), key=_LS_KEY, paddle="LogSumExpInferSpmd",
        doc="LogSumExpInferSpmd: kept axes keep their sharding, reduced axes replicated (no partial)."),
    reverse=Way(partial(_lse, False), key=_LS_KEY, check="_lse_check('logsumexp', x, axis, keepdims, reduce_all, out)",
                env=_ENV, paddle="LogSumExpInferSpmdReverse",
                doc="LogSumExpInferSpmdReverse: x from out on the kept axes, reduced axes replicated."),
    outputs="out: T",
)  # fmt: skip
declare(
    "logsumexp_grad", f"x: T, out: T, out_grad: T, {_LS}",
    Way(partial(_lse, True), key=_LS_KEY, check="_lse_check('logsumexp_grad', x, axis, keepdims, reduce_all, out, out_grad)",
        env=_ENV, paddle="LogSumExpGradInferSpmd",
        doc="LogSumExpGradInferSpmd: x, x_grad from out_grad's kept axes, reduced axes replicated."),
)  # fmt: skip

declare(
    "add_n", "input: [T]",
    Way(_add_n, key="len(input), len(input[0].shape)", check="_add_n_check('add_n', input, 'input')", env=_ENV,
        post=_add_n_partial, post_if="input[0].dist_attr.partial", nonempty=("input",),
        paddle="AddNInferSpmd",
        doc="AddNInferSpmd: shardings merged; a common linear partial status is kept."),
    reverse=Way(_add_n, key="len(input), len(input[0].shape)", env=_ENV, nonempty=("input",),
                check="_add_n_check('add_n', input, 'input', out, 'out', 'adding the inputs')",
                paddle="add_n reverse (spmdkit)",
                doc="add_n reverse (built here; Paddle 3.3.1 has none): every input takes out's sharding."),
    outputs="out: T",
)  # fmt: skip
declare(
    "add_n_grad", "inputs: [T], out_grad: T",
    Way(_add_n_grad, key="len(inputs), out_grad", env=_ENV, post=_add_n_grad_post, nonempty=("inputs",),
        check="_add_n_check('add_n_grad', inputs, 'inputs', out_grad, 'out_grad', 'adding the inputs')",
        paddle="add_n_grad (backward op)", doc="add_n_grad(inputs, out_grad): every input's grad is out_grad (partial "
        "included); the inputs are returned as given (only their shapes are used)."),
)  # fmt: skip
for _op, _fn, _attrs in (("full_like", "FullLikeInferSpmd", ", y: scalar = 0.0, dtype: any = None"),
                         ("empty_like", "EmptyLikeInferSpmd", ", dtype: any = None"),
                         ("ones_like", "CreateLikeInferSpmd", ""), ("zeros_like", "CreateLikeInferSpmd", "")):
    declare(
        _op, f"x: T{_attrs}",
        Way(_same, key="x", post=_as_given, post_if="x.dist_attr.partial", paddle=_fn,
            doc=f"{_op} ({_fn}): out sharded like x, not partial; x as given."),
        reverse=Way(_same, key="x", check=_OUT.format(op=_op, what="x"), env=_ENV, paddle=f"{_op} reverse (spmdkit)",
                    doc=f"{_op} reverse (built here): x like out."),
        outputs="out: T",
    )  # fmt: skip
