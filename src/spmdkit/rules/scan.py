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

from functools import lru_cache

from spmdkit.core.dist_attr import DimsMapping, Partial, ReduceType, TensorDistAttr
from spmdkit.core.errors import (
    InvalidArgumentError,
    InvalidAttributeError,
    InvalidMeshError,
    ShapeMismatchError,
)
from spmdkit.core.spec import DistTensorSpec, SpmdResult
from spmdkit.engine.axes import normalize_axis, numel, one_mesh_dim, reduced_axes
from spmdkit.engine.compile import Plan, compile_plan, infer
from spmdkit.engine.memo import memo
from spmdkit.engine.notation import (
    ALPHABET,
    BROADCAST,
    Notation,
    fast_result,
    letters_for,
    merge_letters,
    with_partial,
)
from spmdkit.rules._common import axis_plan
from spmdkit.rules.registry import register

Shape = tuple[int, ...]
_make = TensorDistAttr.unchecked

# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def _same_mesh(op: str, a: DistTensorSpec, b: DistTensorSpec, na: str, nb: str) -> None:
    if b.dist_attr.mesh != a.dist_attr.mesh:
        raise InvalidMeshError(f"{op}: {na} and {nb} lie on different meshes")


def _check_shape(op: str, got: Shape, want: Shape, name: str, what: str) -> None:
    if len(got) != len(want):
        raise ShapeMismatchError(f"{op}: {name} has {len(got)} dims, but {what} gives {len(want)} (shape {list(want)})")
    for i, (s, w) in enumerate(zip(got, want)):
        if s != w and s >= 0 and w >= 0:
            raise ShapeMismatchError(f"{op}: {name} axis {i} has size {s}, but {what} gives {w}")


# ---------------------------------------------------------------------------
# triu / tril_triu
# ---------------------------------------------------------------------------


@lru_cache(maxsize=64)
def _triu_plan(ndim: int, direction: str) -> Plan:
    """``abcd -> abcd``, the last two axes replicated; the batch axes keep their sharding."""
    a = letters_for(ndim)
    return compile_plan(Notation([a], [a], replicated=a[-2:]), direction)


def _triu(op: str, t: DistTensorSpec, name: str, out: DistTensorSpec | None = None) -> SpmdResult:
    """``t`` (and ``out``: the reverse, from out) under the triu notation."""
    nd = len(t.shape)
    if nd < 2:
        raise ShapeMismatchError(f"{op}: {name} must have at least 2 dims, got {nd}")
    if out is None:
        return fast_result(*infer(_triu_plan(nd, "forward"), op, (t,), (), t.dist_attr.mesh, (name,)))
    _check_shape(op, out.shape, t.shape, "out", f"{op} of x")
    return fast_result(*infer(_triu_plan(nd, "backward"), op, (t,), (out,), t.dist_attr.mesh, (name, "out")))


def _make_triu(op: str, fwd_name: str):  # type: ignore[no-untyped-def]
    def forward(x: DistTensorSpec, diagonal: int = 0, lower: bool = False) -> SpmdResult:
        return _triu(op, x, "x")

    def backward(x: DistTensorSpec, out: DistTensorSpec, diagonal: int = 0, lower: bool = False) -> SpmdResult:
        _same_mesh(op, x, out, "x", "out")
        return _triu(op, x, "x", out)

    forward.__name__ = f"{op}_forward"
    forward.__doc__ = f"{op} ({fwd_name}): the last two axes replicated, batch axes keep their sharding."
    backward.__name__ = f"{op}_backward"
    backward.__doc__ = f"{op} ({fwd_name}Reverse): x from out, the last two axes replicated."
    return forward, backward


def triu_grad(out_grd: DistTensorSpec, diagonal: int = 0) -> SpmdResult:
    """TriuGradInferSpmd(out_grd, diagonal): out_grad and x_grad alike, the last two axes
    replicated, not partial."""
    return _triu("triu_grad", out_grd, "out_grd")


def tril_triu_grad(out_grad: DistTensorSpec, diagonal: int = 0, lower: bool = False) -> SpmdResult:
    """tril_triu_grad(out_grad, diagonal, lower): as triu_grad."""
    return _triu("tril_triu_grad", out_grad, "out_grad")


# ---------------------------------------------------------------------------
# cumsum
# ---------------------------------------------------------------------------


@memo()
def _unshard_axis(dm: DimsMapping, mesh_shape: Shape, axis: int) -> DimsMapping:
    s = list(one_mesh_dim(dm, mesh_shape))
    if s:
        s[axis] = -1
    return tuple(s)


@lru_cache(maxsize=4096)
def _axis_plan(nd: int, ax: int, out: str, direction: str) -> Plan:
    """``abc -> <out>`` with axis ``ax`` replicated, each co-shard read as its largest mesh dim
    (``out``: ``"same"``, ``"drop"`` the axis, ``"flat"``: everything replicated, out 1-D,
    ``"flat0"`` / ``"flatk"``: everything replicated, out 0-d / x's rank of size-1 axes)."""
    a = letters_for(nd)
    if out.startswith("flat"):
        o = {"flat": BROADCAST, "flat0": "", "flatk": BROADCAST * nd}[out]
        return compile_plan(Notation([a], [o], replicated=a), direction)
    o = a if out == "same" else a[:ax] + a[ax + 1 :]
    return compile_plan(Notation([a], [o], replicated=a[ax : ax + 1], coshard="largest"), direction)


def cumsum_forward(
    x: DistTensorSpec, axis: int = -1, flatten: bool = False, exclusive: bool = False, reverse: bool = False
) -> SpmdResult:
    """CumSumInferSpmd: the scanned axis replicated; flatten: all replicated, out 1-D."""
    nd = len(x.shape)
    ax = 0 if flatten else normalize_axis("cumsum", axis, nd, tensor="x")
    p = _axis_plan(nd, ax, "flat" if flatten else "same", "forward")
    return fast_result(*infer(p, "cumsum", (x,), (), x.dist_attr.mesh, ("x",)))


def _cumsum_out_shape(x: DistTensorSpec, flatten: bool) -> Shape:
    return (numel(x.shape),) if flatten else x.shape


def _cumsum_reverse(
    op: str, x: DistTensorSpec, out: DistTensorSpec, axis: int, flatten: bool, name: str
) -> tuple[TensorDistAttr, TensorDistAttr]:
    _same_mesh(op, x, out, "x", name)
    _check_shape(op, out.shape, _cumsum_out_shape(x, flatten), name, "cumsum of x")
    nd = len(x.shape)
    ax = 0 if flatten else normalize_axis(op, axis, nd, tensor="x")
    p = _axis_plan(nd, ax, "flat" if flatten else "same", "backward")
    ins, outs = infer(p, op, (x,), (out,), x.dist_attr.mesh, ("x", name))
    assert ins[0] is not None and outs[0] is not None
    return ins[0], outs[0]


def cumsum_backward(
    x: DistTensorSpec, out: DistTensorSpec, axis: int = -1, flatten: bool = False,
    exclusive: bool = False, reverse: bool = False,
) -> SpmdResult:
    """CumSumInferSpmdReverse: x from out, the scanned axis replicated."""
    xa, oa = _cumsum_reverse("cumsum", x, out, axis, flatten, "out")
    return fast_result((xa,), (oa,))


def cumsum_grad(
    x: DistTensorSpec, out_grad: DistTensorSpec, axis: int = -1, flatten: bool = False,
    exclusive: bool = False, reverse: bool = False,
) -> SpmdResult:
    """CumSumGradInferSpmd: out_grad as the reverse rule infers it, x and x_grad as x from it
    (Paddle returns x as given: the kernel shapes x_grad by the local x, so x must match)."""
    xa, ga = _cumsum_reverse("cumsum_grad", x, out_grad, axis, flatten, "out_grad")
    return fast_result((xa, ga), (xa,))


# ---------------------------------------------------------------------------
# argmax / argmin
# ---------------------------------------------------------------------------


def _arg_out_shape(shape: Shape, ax: int, keepdims: bool, flatten: bool) -> Shape:
    if flatten:
        return (1,) * len(shape) if keepdims else ()
    if not shape:
        return ()
    if keepdims:
        return (*shape[:ax], 1, *shape[ax + 1:])
    return (*shape[:ax], *shape[ax + 1:])


def _arg_out(nd: int, keepdims: bool, flatten: bool) -> str:
    """The out of argmax / argmin's notation (see _axis_plan)."""
    if flatten:
        return "flatk" if keepdims else "flat0"
    return "same" if keepdims or nd == 0 else "drop"


def _make_arg(op: str, fwd_name: str):  # type: ignore[no-untyped-def]
    def forward(x: DistTensorSpec, axis: int = -1, keepdims: bool = False, flatten: bool = False) -> SpmdResult:
        nd = len(x.shape)
        ax = normalize_axis(op, axis, nd, tensor="x")
        p = _axis_plan(nd, ax, _arg_out(nd, keepdims, flatten), "forward")
        return fast_result(*infer(p, op, (x,), (), x.dist_attr.mesh, ("x",)))

    def backward(
        x: DistTensorSpec, out: DistTensorSpec, axis: int = -1, keepdims: bool = False, flatten: bool = False
    ) -> SpmdResult:
        _same_mesh(op, x, out, "x", "out")
        mesh = x.dist_attr.mesh
        nd = len(x.shape)
        ax = normalize_axis(op, axis, nd, tensor="x")
        _check_shape(op, out.shape, _arg_out_shape(x.shape, ax, keepdims, flatten), "out", f"{op} of x")
        p = _axis_plan(nd, ax, _arg_out(nd, keepdims, flatten), "backward")
        return fast_result(*infer(p, op, (x,), (out,), mesh, ("x", "out")))

    forward.__name__ = f"{op}_forward"
    forward.__doc__ = f"{op} ({fwd_name}): the arg axis replicated; flatten: x replicated, out 0-d."
    backward.__name__ = f"{op}_backward"
    backward.__doc__ = f"{op} ({fwd_name.replace('InferSpmdBase', 'InferSpmdReverseBase')}): x from out."
    return forward, backward


# ---------------------------------------------------------------------------
# topk
# ---------------------------------------------------------------------------


def _topk_checks(op: str, x: DistTensorSpec, k: int, axis: int) -> int:
    nd = len(x.shape)
    if nd == 0:
        raise ShapeMismatchError(f"{op}: x must have at least 1 dim (axis {axis} is out of range for a 0-d x)")
    ax = normalize_axis(op, axis, nd, tensor="x")
    if k < 1:
        raise InvalidAttributeError(f"{op}: k must be >= 1, got {k}")
    size = x.shape[ax]
    if 0 <= size < k:
        raise InvalidAttributeError(f"{op}: k {k} is larger than x's axis {ax} size {size}")
    return ax


def topk_forward(
    x: DistTensorSpec, k: int = 1, axis: int = -1, largest: bool = True, sorted: bool = True
) -> SpmdResult:
    """TopkInferSpmd: out and indices sharded as x, the topk axis replicated."""
    ax = _topk_checks("topk", x, k, axis)
    return fast_result(*infer(axis_plan(len(x.shape), ax, 1, 2, "largest"), "topk", (x,), (), x.dist_attr.mesh, ("x",)))


def _topk_grad(
    op: str, x: DistTensorSpec, indices: DistTensorSpec, out_grad: DistTensorSpec, k: int, axis: int
) -> SpmdResult:
    nd = len(x.shape)
    _same_mesh(op, x, indices, "x", "indices")
    _same_mesh(op, x, out_grad, "x", "out_grad")
    if len(indices.shape) != nd:
        raise ShapeMismatchError(f"{op}: indices has {len(indices.shape)} dims but x has {nd}")
    if len(out_grad.shape) != nd:
        raise ShapeMismatchError(f"{op}: out_grad has {len(out_grad.shape)} dims but x has {nd}")
    ax = _topk_checks(op, x, k, axis)
    # the topk axis' size is not checked (Paddle's own unit test passes indices of x's shape)
    for name, t in (("indices", indices), ("out_grad", out_grad)):
        for i, (s, w) in enumerate(zip(t.shape, x.shape)):
            if i != ax and s != w and s >= 0 and w >= 0:
                raise ShapeMismatchError(f"{op}: {name} axis {i} has size {s}, but x has {w}")
    mesh = x.dist_attr.mesh
    a = _make(mesh, _topk_grad_core(
        x.dist_attr.dims_mapping, indices.dist_attr.dims_mapping, out_grad.dist_attr.dims_mapping,
        x.shape, indices.shape, out_grad.shape, ax, mesh.shape,
    ))  # fmt: skip
    return fast_result((a, a, a), (a,))


@memo()
def _topk_grad_core(
    xdm: DimsMapping, idm: DimsMapping, gdm: DimsMapping, xs: Shape, ish: Shape, gs: Shape, ax: int,
    mesh_shape: Shape,
) -> DimsMapping:
    nd = len(xs)
    letters = ALPHABET[:nd]
    kx = letters
    ki = letters[:ax] + "1" + letters[ax + 1:]  # the topk axis is never merged
    merged = dict(merge_letters(
        (kx, ki, ki),
        (_unshard_axis(xdm, mesh_shape, ax), _unshard_axis(idm, mesh_shape, ax), _unshard_axis(gdm, mesh_shape, ax)),
        (xs, ish, gs), frozenset(), "", mesh_shape,
    ))  # fmt: skip
    out: list[int] = []
    for i, ch in enumerate(letters):
        d = merged.get(ch, ())
        out.append(-1 if i == ax or not d else d[0])
    return tuple(out)


def topk_grad(
    x: DistTensorSpec, indices: DistTensorSpec, out_grad: DistTensorSpec, k: int = 1, axis: int = -1,
    largest: bool = True, sorted: bool = True,
) -> SpmdResult:
    """TopkGradInferSpmd: x, indices, out_grad and x_grad sharded alike, the topk axis replicated."""
    return _topk_grad("topk_grad", x, indices, out_grad, k, axis)


def _topk_backward(
    x: DistTensorSpec, indices: DistTensorSpec, out_grad: DistTensorSpec, k: int = 1, axis: int = -1,
    largest: bool = True, sorted: bool = True,
) -> SpmdResult:
    """TopkGradInferSpmd (Paddle's backward slot for topk): as topk_grad."""
    return _topk_grad("topk", x, indices, out_grad, k, axis)


# ---------------------------------------------------------------------------
# logsumexp
# ---------------------------------------------------------------------------


@memo()
def _lse_plan(ndim: int, axis: tuple[int, ...], keepdims: bool, reduce_all: bool) -> tuple[tuple[bool, ...], Shape]:
    """(reduced flag per x axis, the x axis of each out axis (-1: a kept size-1 axis))."""
    return reduced_axes("logsumexp", ndim, axis, keepdims, reduce_all)


@lru_cache(maxsize=4096)
def _lse_notation(reduced: tuple[bool, ...], pos: Shape, grad: bool) -> Notation:
    """``abc -> ac`` (``a1c`` with keepdims), the reduced letters replicated, each co-shard read
    as its largest mesh dim; the grad ``abc, ac, ac -> abc`` merged from out_grad alone."""
    x = letters_for(len(reduced))
    o = "".join(BROADCAST if p < 0 else x[p] for p in pos)
    red = "".join(c for c, r in zip(x, reduced) if r)
    if grad:
        return Notation([x, o, o], [x], replicated=red, coshard="largest", sources=(2,))
    return Notation([x], [o], replicated=red, coshard="largest")


def _lse_out_shape(shape: Shape, pos: Shape) -> Shape:
    return tuple(1 if p < 0 else shape[p] for p in pos)


def logsumexp_forward(
    x: DistTensorSpec, axis: tuple[int, ...] = (), keepdims: bool = False, reduce_all: bool = False
) -> SpmdResult:
    """LogSumExpInferSpmd: kept axes keep their sharding, reduced axes replicated (no partial)."""
    reduced, pos = _lse_plan(len(x.shape), axis, keepdims, reduce_all)
    p = compile_plan(_lse_notation(reduced, pos, False))
    return fast_result(*infer(p, "logsumexp", (x,), (), x.dist_attr.mesh, ("x",)))


def logsumexp_backward(
    x: DistTensorSpec, out: DistTensorSpec, axis: tuple[int, ...] = (), keepdims: bool = False,
    reduce_all: bool = False,
) -> SpmdResult:
    """LogSumExpInferSpmdReverse: x from out on the kept axes, reduced axes replicated."""
    _same_mesh("logsumexp", x, out, "x", "out")
    mesh = x.dist_attr.mesh
    reduced, pos = _lse_plan(len(x.shape), axis, keepdims, reduce_all)
    _check_shape("logsumexp", out.shape, _lse_out_shape(x.shape, pos), "out", "reducing x")
    p = compile_plan(_lse_notation(reduced, pos, False), "backward")
    return fast_result(*infer(p, "logsumexp", (x,), (out,), mesh, ("x", "out")))


def logsumexp_grad(
    x: DistTensorSpec, out: DistTensorSpec, out_grad: DistTensorSpec, axis: tuple[int, ...] = (),
    keepdims: bool = False, reduce_all: bool = False,
) -> SpmdResult:
    """LogSumExpGradInferSpmd: x, x_grad from out_grad's kept axes, reduced axes replicated."""
    op = "logsumexp_grad"
    _same_mesh(op, x, out, "x", "out")
    _same_mesh(op, x, out_grad, "x", "out_grad")
    mesh = x.dist_attr.mesh
    reduced, pos = _lse_plan(len(x.shape), axis, keepdims, reduce_all)
    want = _lse_out_shape(x.shape, pos)
    _check_shape(op, out.shape, want, "out", "reducing x")
    _check_shape(op, out_grad.shape, want, "out_grad", "reducing x")
    p = compile_plan(_lse_notation(reduced, pos, True))
    return fast_result(*infer(p, op, (x, out, out_grad), (), mesh, ("x", "out", "out_grad")))


# ---------------------------------------------------------------------------
# add_n
# ---------------------------------------------------------------------------

_LINEAR = frozenset({ReduceType.SUM, ReduceType.AVG})


@lru_cache(maxsize=1024)
def _add_n_plan(nd: int, n: int, direction: str) -> Plan:
    """``abc, abc, ... -> abc``: merged (a letter sharded differently: the larger tensor keeps
    it), each co-shard read as its largest mesh dim; the reverse from out alone."""
    a = letters_for(nd)
    return compile_plan(Notation([a] * n, [a], coshard="largest"), direction)


def _add_n_inputs(op: str, inputs: tuple[DistTensorSpec, ...], name: str) -> None:
    if not inputs:
        raise InvalidArgumentError(f"{op}: {name} must hold at least one tensor")
    first = inputs[0]
    if len(first.shape) > len(ALPHABET):
        raise ShapeMismatchError(f"{op}: tensors of more than {len(ALPHABET)} dims are not supported")
    for i, t in enumerate(inputs[1:], 1):
        _same_mesh(op, first, t, f"{name}[0]", f"{name}[{i}]")
        _check_shape(op, t.shape, first.shape, f"{name}[{i}]", f"{name}[0]")


def add_n_forward(input: tuple[DistTensorSpec, ...]) -> SpmdResult:
    """AddNInferSpmd: shardings merged; a common linear partial status is kept."""
    _add_n_inputs("add_n", input, "input")
    mesh = input[0].dist_attr.mesh
    _, outs = infer(_add_n_plan(len(input[0].shape), len(input), "forward"), "add_n", input, (), mesh)
    a = outs[0]
    assert a is not None
    pt: Partial = input[0].dist_attr.partial
    if pt and not all(r in _LINEAR for _, r in pt):
        pt = ()
    if pt:
        for t in input[1:]:
            if t.dist_attr.partial != pt:
                pt = ()
                break
    if pt:
        a = _make(mesh, a.dims_mapping, pt)
    return fast_result(((a,) * len(input),), (a,))  # type: ignore[arg-type]


def add_n_backward(input: tuple[DistTensorSpec, ...], out: DistTensorSpec) -> SpmdResult:
    """add_n reverse (built here; Paddle 3.3.1 has none): every input takes out's sharding."""
    _add_n_inputs("add_n", input, "input")
    first = input[0]
    _same_mesh("add_n", first, out, "input[0]", "out")
    _check_shape("add_n", out.shape, first.shape, "out", "adding the inputs")
    p = _add_n_plan(len(first.shape), len(input), "backward")
    _, outs = infer(p, "add_n", input, (out,), first.dist_attr.mesh)
    return fast_result((outs * len(input),), outs)  # type: ignore[arg-type]


@lru_cache(maxsize=1024)
def _add_n_grad_plan(nd: int, n: int) -> Plan:
    """``abc, ..., abc (out_grad) -> abc, ...``: every grad as out_grad, merged from it alone."""
    a = letters_for(nd)
    return compile_plan(Notation([a] * (n + 1), [a] * n, sources=(n,)))


def add_n_grad(inputs: tuple[DistTensorSpec, ...], out_grad: DistTensorSpec) -> SpmdResult:
    """add_n_grad(inputs, out_grad): every input's grad is out_grad (partial included);
    the inputs are returned as given (only their shapes are used)."""
    op = "add_n_grad"
    _add_n_inputs(op, inputs, "inputs")
    _same_mesh(op, inputs[0], out_grad, "inputs[0]", "out_grad")
    _check_shape(op, out_grad.shape, inputs[0].shape, "out_grad", "adding the inputs")
    g = out_grad.dist_attr
    _, outs = infer(_add_n_grad_plan(len(g.dims_mapping), len(inputs)), op, (*inputs, out_grad), (), g.mesh)
    # post-hook: each grad IS out_grad, so a partial out_grad passes to every grad (a linear op),
    # and the inputs, whose values the grad never reads, are not resharded
    grads = outs if not g.partial else tuple(with_partial(a, g.partial) for a in outs)  # type: ignore[arg-type]
    return fast_result((tuple(t.dist_attr for t in inputs), g), (grads,))  # type: ignore[arg-type]


# ---------------------------------------------------------------------------
# full_like and friends
# ---------------------------------------------------------------------------


@lru_cache(maxsize=128)
def _like_plan(ndim: int, direction: str) -> Plan:
    """``abc -> abc``: out sharded like x (the reverse: x like out), never partial."""
    a = letters_for(ndim)
    return compile_plan(Notation([a], [a]), direction)


def _like_rule(op: str, fwd_name: str):  # type: ignore[no-untyped-def]
    """The forward (out like x; x returned as given: only its shape is read, so no reshard is
    asked of it) and the reverse (built here: x like out) of a ``*_like`` creator."""

    def forward(x: DistTensorSpec, *attrs: object) -> SpmdResult:
        _, outs = infer(_like_plan(len(x.shape), "forward"), op, (x,), (), x.dist_attr.mesh, ("x",))
        return fast_result((x.dist_attr,), outs)

    def backward(x: DistTensorSpec, out: DistTensorSpec, *attrs: object) -> SpmdResult:
        _same_mesh(op, x, out, "x", "out")
        _check_shape(op, out.shape, x.shape, "out", "x")
        p = _like_plan(len(x.shape), "backward")
        return fast_result(*infer(p, op, (x,), (out,), out.dist_attr.mesh, ("x", "out")))

    forward.__name__ = f"{op}_forward"
    forward.__doc__ = f"{op} ({fwd_name}): out sharded like x, not partial; x as given."
    backward.__name__ = f"{op}_backward"
    backward.__doc__ = f"{op} reverse (built here): x takes out's sharding."
    return forward, backward


# ---------------------------------------------------------------------------
# registration
# ---------------------------------------------------------------------------


def _register_all() -> None:
    f, b = _make_triu("triu", "TriuInferSpmd")
    register("triu", f, "x: T, diagonal: int = 0", b, kind="reverse", outputs="out: T",
             forward_name="TriuInferSpmd", backward_name="TriuInferSpmdReverse")  # fmt: skip
    register("triu_grad", triu_grad, "out_grd: T, diagonal: int = 0", forward_name="TriuGradInferSpmd")
    f2, b2 = _make_triu("tril_triu", "TrilTriuInferSpmd")
    register("tril_triu", f2, "x: T, diagonal: int = 0, lower: bool = False",
             b2, kind="reverse", outputs="out: T",
             forward_name="TrilTriuInferSpmd", backward_name="TrilTriuInferSpmdReverse")  # fmt: skip
    register("tril_triu_grad", tril_triu_grad, "out_grad: T, diagonal: int = 0, lower: bool = False",
             forward_name="tril_triu_grad (backward op)")  # fmt: skip
    cs = "axis: int = -1, flatten: bool = False, exclusive: bool = False, reverse: bool = False"
    register("cumsum", cumsum_forward, f"x: T, {cs}", cumsum_backward, kind="reverse", outputs="out: T",
             forward_name="CumSumInferSpmd", backward_name="CumSumInferSpmdReverse")  # fmt: skip
    register("cumsum_grad", cumsum_grad, f"x: T, out_grad: T, {cs}", forward_name="CumSumGradInferSpmd")
    for op, fn in (("argmax", "ArgMaxInferSpmdBase"), ("argmin", "ArgMinInferSpmdBase")):
        af, ab = _make_arg(op, fn)
        register(op, af, "x: T, axis: int = -1, keepdims: bool = False, flatten: bool = False",
                 ab, kind="reverse", outputs="out: T",
                 forward_name=fn, backward_name=fn.replace("InferSpmdBase", "InferSpmdReverseBase"))  # fmt: skip
    tk = "k: int = 1, axis: int = -1, largest: bool = True, sorted: bool = True"
    register("topk", topk_forward, f"x: T, {tk}", _topk_backward, f"x: T, indices: T, out_grad: T, {tk}", kind="grad",
             forward_name="TopkInferSpmd", backward_name="TopkGradInferSpmd")  # fmt: skip
    register("topk_grad", topk_grad, f"x: T, indices: T, out_grad: T, {tk}", forward_name="TopkGradInferSpmd")
    ls = "axis: ints = [], keepdims: bool = False, reduce_all: bool = False"
    register("logsumexp", logsumexp_forward, f"x: T, {ls}", logsumexp_backward, kind="reverse", outputs="out: T",
             forward_name="LogSumExpInferSpmd", backward_name="LogSumExpInferSpmdReverse")  # fmt: skip
    register("logsumexp_grad", logsumexp_grad, f"x: T, out: T, out_grad: T, {ls}",
             forward_name="LogSumExpGradInferSpmd")  # fmt: skip
    register("add_n", add_n_forward, "input: [T]", add_n_backward, kind="reverse", outputs="out: T",
             forward_name="AddNInferSpmd", backward_name="add_n reverse (spmdkit)")  # fmt: skip
    register("add_n_grad", add_n_grad, "inputs: [T], out_grad: T", forward_name="add_n_grad (backward op)")
    for op, fn, attrs in (("full_like", "FullLikeInferSpmd", ", y: scalar = 0.0, dtype: any = None"),
                          ("empty_like", "EmptyLikeInferSpmd", ", dtype: any = None"),
                          ("ones_like", "CreateLikeInferSpmd", ""), ("zeros_like", "CreateLikeInferSpmd", "")):
        lf, lb = _like_rule(op, fn)
        register(op, lf, f"x: T{attrs}", lb, kind="reverse", outputs="out: T",
                 forward_name=fn, backward_name=f"{op} reverse (spmdkit)")  # fmt: skip


_register_all()
