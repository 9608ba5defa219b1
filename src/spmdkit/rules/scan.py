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
from typing import Any

from spmdkit.core.dist_attr import Partial, ReduceType
from spmdkit.core.errors import (
    InvalidArgumentError,
    InvalidAttributeError,
    InvalidMeshError,
    ShapeMismatchError,
)
from spmdkit.core.spec import DistTensorSpec, SpmdResult
from spmdkit.engine.axes import make_attr, normalize_axis, numel, reduced_axes
from spmdkit.engine.compile import Plan, compile_plan, infer
from spmdkit.engine.notation import ALPHABET, BROADCAST, Notation, fast_result, letters_for, with_partial
from spmdkit.engine.registry import register
from spmdkit.rules._common import axis_plan

Shape = tuple[int, ...]

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


def _run(op: str, plan: Plan, *ts: DistTensorSpec, out: DistTensorSpec | None = None,
         names: tuple[str, ...] = ("x",)) -> SpmdResult:
    """The plan's answer for the inputs ``ts`` (``out``: the reverse, from out)."""
    mesh = ts[0].dist_attr.mesh
    if out is None:
        return fast_result(*infer(plan, op, ts, (), mesh, names))
    return fast_result(*infer(plan, op, ts, (out,), mesh, (*names, "out")))


# ---------------------------------------------------------------------------
# triu / tril_triu
# ---------------------------------------------------------------------------


@lru_cache(maxsize=64)
def _triu_plan(ndim: int, direction: str) -> Plan:
    """``abcd -> abcd``, the last two axes replicated; the batch axes keep their sharding."""
    a = letters_for(ndim)
    return compile_plan(Notation([a], [a], replicated=a[-2:]), direction)


def _triu(op: str, t: DistTensorSpec, name: str = "x", out: DistTensorSpec | None = None) -> SpmdResult:
    """``t`` (and ``out``: the reverse, from out) under the triu notation."""
    nd = len(t.shape)
    if nd < 2:
        raise ShapeMismatchError(f"{op}: {name} must have at least 2 dims, got {nd}")
    if out is not None:
        _check_shape(op, out.shape, t.shape, "out", f"{op} of x")
    return _run(op, _triu_plan(nd, "forward" if out is None else "backward"), t, out=out, names=(name,))


def _triu_rule(op: str) -> tuple[Any, Any]:
    def forward(x: DistTensorSpec, *attrs: Any) -> SpmdResult:
        return _triu(op, x)

    def backward(x: DistTensorSpec, out: DistTensorSpec, *attrs: Any) -> SpmdResult:
        _same_mesh(op, x, out, "x", "out")
        return _triu(op, x, "x", out)

    return forward, backward


def triu_grad(out_grd: DistTensorSpec, diagonal: int = 0) -> SpmdResult:
    """TriuGradInferSpmd(out_grd, diagonal): out_grad and x_grad alike, the last two axes
    replicated, not partial."""
    return _triu("triu_grad", out_grd, "out_grd")


def tril_triu_grad(out_grad: DistTensorSpec, diagonal: int = 0, lower: bool = False) -> SpmdResult:
    """tril_triu_grad(out_grad, diagonal, lower): as triu_grad."""
    return _triu("tril_triu_grad", out_grad, "out_grad")


# ---------------------------------------------------------------------------
# cumsum, argmax / argmin
# ---------------------------------------------------------------------------


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
    return _run("cumsum", _axis_plan(nd, ax, "flat" if flatten else "same", "forward"), x)


def _cumsum_reverse(op: str, x: DistTensorSpec, out: DistTensorSpec, axis: int, flatten: bool, name: str) -> SpmdResult:
    _same_mesh(op, x, out, "x", name)
    _check_shape(op, out.shape, (numel(x.shape),) if flatten else x.shape, name, "cumsum of x")
    nd = len(x.shape)
    ax = 0 if flatten else normalize_axis(op, axis, nd, tensor="x")
    return _run(op, _axis_plan(nd, ax, "flat" if flatten else "same", "backward"), x, out=out)


def cumsum_backward(
    x: DistTensorSpec, out: DistTensorSpec, axis: int = -1, flatten: bool = False,
    exclusive: bool = False, reverse: bool = False,
) -> SpmdResult:
    """CumSumInferSpmdReverse: x from out, the scanned axis replicated."""
    return _cumsum_reverse("cumsum", x, out, axis, flatten, "out")


def cumsum_grad(
    x: DistTensorSpec, out_grad: DistTensorSpec, axis: int = -1, flatten: bool = False,
    exclusive: bool = False, reverse: bool = False,
) -> SpmdResult:
    """CumSumGradInferSpmd: out_grad as the reverse rule infers it, x and x_grad as x from it
    (Paddle returns x as given: the kernel shapes x_grad by the local x, so x must match)."""
    r = _cumsum_reverse("cumsum_grad", x, out_grad, axis, flatten, "out_grad")
    return fast_result((r.inputs[0], r.outputs[0]), (r.inputs[0],))  # type: ignore[arg-type]


def _arg_rule(op: str) -> tuple[Any, Any]:
    def plan(x: DistTensorSpec, axis: int, keepdims: bool, flatten: bool, direction: str) -> tuple[Plan, int]:
        nd = len(x.shape)
        ax = normalize_axis(op, axis, nd, tensor="x")
        out = ("flatk" if keepdims else "flat0") if flatten else "same" if keepdims or nd == 0 else "drop"
        return _axis_plan(nd, ax, out, direction), ax

    def forward(x: DistTensorSpec, axis: int = -1, keepdims: bool = False, flatten: bool = False) -> SpmdResult:
        return _run(op, plan(x, axis, keepdims, flatten, "forward")[0], x)

    def backward(
        x: DistTensorSpec, out: DistTensorSpec, axis: int = -1, keepdims: bool = False, flatten: bool = False
    ) -> SpmdResult:
        _same_mesh(op, x, out, "x", "out")
        p, ax = plan(x, axis, keepdims, flatten, "backward")
        s = x.shape
        want = ((1,) * len(s) if keepdims else ()) if flatten else () if not s else (
            (*s[:ax], 1, *s[ax + 1:]) if keepdims else (*s[:ax], *s[ax + 1:]))  # fmt: skip
        _check_shape(op, out.shape, want, "out", f"{op} of x")
        return _run(op, p, x, out=out)

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
    return _run("topk", axis_plan(len(x.shape), ax, 1, 2, "largest"), x)


def _topk_grad(
    op: str, x: DistTensorSpec, indices: DistTensorSpec, out_grad: DistTensorSpec, k: int, axis: int
) -> SpmdResult:
    for name, t in (("indices", indices), ("out_grad", out_grad)):
        _same_mesh(op, x, t, "x", name)
    for name, t in (("indices", indices), ("out_grad", out_grad)):
        if len(t.shape) != len(x.shape):
            raise ShapeMismatchError(f"{op}: {name} has {len(t.shape)} dims but x has {len(x.shape)}")
    ax = _topk_checks(op, x, k, axis)
    # the topk axis' size is not checked (Paddle's own unit test passes indices of x's shape)
    for name, t in (("indices", indices), ("out_grad", out_grad)):
        for i, (s, w) in enumerate(zip(t.shape, x.shape)):
            if i != ax and s != w and s >= 0 and w >= 0:
                raise ShapeMismatchError(f"{op}: {name} axis {i} has size {s}, but x has {w}")
    # ``abc, abc, abc -> abc``: merged over the three (the larger tensor keeps a letter they
    # shard differently), the topk axis replicated, each co-shard read as its largest mesh dim
    p = axis_plan(len(x.shape), ax, 3, 1, "largest")
    return _run(op, p, x, indices, out_grad, names=("x", "indices", "out_grad"))


def topk_grad(
    x: DistTensorSpec, indices: DistTensorSpec, out_grad: DistTensorSpec, k: int = 1, axis: int = -1,
    largest: bool = True, sorted: bool = True,
) -> SpmdResult:
    """TopkGradInferSpmd: x, indices, out_grad and x_grad sharded alike, the topk axis replicated."""
    return _topk_grad("topk_grad", x, indices, out_grad, k, axis)


def _topk_backward(x: DistTensorSpec, indices: DistTensorSpec, out_grad: DistTensorSpec, k: int = 1,
                   axis: int = -1, *attrs: Any) -> SpmdResult:
    """TopkGradInferSpmd (Paddle's backward slot for topk): as topk_grad."""
    return _topk_grad("topk", x, indices, out_grad, k, axis)


# ---------------------------------------------------------------------------
# logsumexp
# ---------------------------------------------------------------------------


@lru_cache(maxsize=4096)
def _lse_plan(ndim: int, axis: tuple[int, ...], keepdims: bool, reduce_all: bool, kind: str) -> tuple[Plan, Shape]:
    """(plan, the x axis of each out axis (-1: a kept size-1 axis)): ``abc -> ac`` (``a1c`` with
    keepdims), the reduced letters replicated, each co-shard read as its largest mesh dim
    (``kind``: ``"forward"``, ``"backward"``; ``"grad"``: ``abc, ac, ac -> abc`` merged from
    out_grad alone)."""
    reduced, pos = reduced_axes("logsumexp", ndim, axis, keepdims, reduce_all)
    x = letters_for(ndim)
    o = "".join(BROADCAST if p < 0 else x[p] for p in pos)
    red = "".join(c for c, r in zip(x, reduced) if r)
    if kind == "grad":
        return compile_plan(Notation([x, o, o], [x], replicated=red, coshard="largest", sources=(2,))), pos
    return compile_plan(Notation([x], [o], replicated=red, coshard="largest"), kind), pos


def logsumexp_forward(
    x: DistTensorSpec, axis: tuple[int, ...] = (), keepdims: bool = False, reduce_all: bool = False
) -> SpmdResult:
    """LogSumExpInferSpmd: kept axes keep their sharding, reduced axes replicated (no partial)."""
    return _run("logsumexp", _lse_plan(len(x.shape), tuple(axis), keepdims, reduce_all, "forward")[0], x)


def logsumexp_backward(
    x: DistTensorSpec, out: DistTensorSpec, axis: tuple[int, ...] = (), keepdims: bool = False,
    reduce_all: bool = False,
) -> SpmdResult:
    """LogSumExpInferSpmdReverse: x from out on the kept axes, reduced axes replicated."""
    _same_mesh("logsumexp", x, out, "x", "out")
    p, pos = _lse_plan(len(x.shape), tuple(axis), keepdims, reduce_all, "backward")
    _check_shape("logsumexp", out.shape, tuple(1 if i < 0 else x.shape[i] for i in pos), "out", "reducing x")
    return _run("logsumexp", p, x, out=out)


def logsumexp_grad(
    x: DistTensorSpec, out: DistTensorSpec, out_grad: DistTensorSpec, axis: tuple[int, ...] = (),
    keepdims: bool = False, reduce_all: bool = False,
) -> SpmdResult:
    """LogSumExpGradInferSpmd: x, x_grad from out_grad's kept axes, reduced axes replicated."""
    op = "logsumexp_grad"
    _same_mesh(op, x, out, "x", "out")
    _same_mesh(op, x, out_grad, "x", "out_grad")
    p, pos = _lse_plan(len(x.shape), tuple(axis), keepdims, reduce_all, "grad")
    want = tuple(1 if i < 0 else x.shape[i] for i in pos)
    _check_shape(op, out.shape, want, "out", "reducing x")
    _check_shape(op, out_grad.shape, want, "out_grad", "reducing x")
    return _run(op, p, x, out, out_grad, names=("x", "out", "out_grad"))


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
        a = make_attr(mesh, a.dims_mapping, pt)
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
    """``abc (out_grad) -> abc, ...``: every grad sharded as out_grad."""
    a = letters_for(nd)
    return compile_plan(Notation([a], [a] * n))


def add_n_grad(inputs: tuple[DistTensorSpec, ...], out_grad: DistTensorSpec) -> SpmdResult:
    """add_n_grad(inputs, out_grad): every input's grad is out_grad (partial included);
    the inputs are returned as given (only their shapes are used)."""
    op = "add_n_grad"
    _add_n_inputs(op, inputs, "inputs")
    _same_mesh(op, inputs[0], out_grad, "inputs[0]", "out_grad")
    _check_shape(op, out_grad.shape, inputs[0].shape, "out_grad", "adding the inputs")
    g = out_grad.dist_attr
    _, outs = infer(_add_n_grad_plan(len(g.dims_mapping), len(inputs)), op, (out_grad,), (), g.mesh, ("out_grad",))
    # post-hook: each grad IS out_grad, so a partial out_grad passes to every grad (a linear op),
    # and the inputs, whose values the grad never reads, are not resharded
    grads = outs if not g.partial else (with_partial(outs[0], g.partial),) * len(outs)  # type: ignore[arg-type]
    return fast_result((tuple(t.dist_attr for t in inputs), g), (grads,))  # type: ignore[arg-type]


# ---------------------------------------------------------------------------
# full_like and friends
# ---------------------------------------------------------------------------


@lru_cache(maxsize=128)
def _like_plan(ndim: int, direction: str) -> Plan:
    """``abc -> abc``: out sharded like x (the reverse: x like out), never partial."""
    a = letters_for(ndim)
    return compile_plan(Notation([a], [a]), direction)


def _like_rule(op: str) -> tuple[Any, Any]:
    """The forward (out like x; x returned as given: only its shape is read, so no reshard is
    asked of it) and the reverse (built here: x like out) of a ``*_like`` creator."""

    def forward(x: DistTensorSpec, *attrs: Any) -> SpmdResult:
        _, outs = infer(_like_plan(len(x.shape), "forward"), op, (x,), (), x.dist_attr.mesh, ("x",))
        return fast_result((x.dist_attr,), outs)

    def backward(x: DistTensorSpec, out: DistTensorSpec, *attrs: Any) -> SpmdResult:
        _same_mesh(op, x, out, "x", "out")
        _check_shape(op, out.shape, x.shape, "out", "x")
        return _run(op, _like_plan(len(x.shape), "backward"), x, out=out)

    return forward, backward


# ---------------------------------------------------------------------------
# registration
# ---------------------------------------------------------------------------


def _register_all() -> None:
    for op, fn, attrs in (("triu", "TriuInferSpmd", "diagonal: int = 0"),
                          ("tril_triu", "TrilTriuInferSpmd", "diagonal: int = 0, lower: bool = False")):
        f, b = _triu_rule(op)
        register(op, f, f"x: T, {attrs}", b, kind="reverse", outputs="out: T", forward_name=fn,
                 backward_name=f"{fn}Reverse", doc=f"{op} ({fn}): the last two axes replicated, batch axes keep their sharding.")  # fmt: skip
    register("triu_grad", triu_grad, "out_grd: T, diagonal: int = 0", forward_name="TriuGradInferSpmd")
    register("tril_triu_grad", tril_triu_grad, "out_grad: T, diagonal: int = 0, lower: bool = False",
             forward_name="tril_triu_grad (backward op)")  # fmt: skip
    cs = "axis: int = -1, flatten: bool = False, exclusive: bool = False, reverse: bool = False"
    register("cumsum", cumsum_forward, f"x: T, {cs}", cumsum_backward, kind="reverse", outputs="out: T",
             forward_name="CumSumInferSpmd", backward_name="CumSumInferSpmdReverse")  # fmt: skip
    register("cumsum_grad", cumsum_grad, f"x: T, out_grad: T, {cs}", forward_name="CumSumGradInferSpmd")
    for op, fn in (("argmax", "ArgMaxInferSpmdBase"), ("argmin", "ArgMinInferSpmdBase")):
        af, ab = _arg_rule(op)
        register(op, af, "x: T, axis: int = -1, keepdims: bool = False, flatten: bool = False",
                 ab, kind="reverse", outputs="out: T", forward_name=fn,
                 backward_name=fn.replace("InferSpmdBase", "InferSpmdReverseBase"),
                 doc=f"{op} ({fn}): the arg axis replicated; flatten: x replicated, out 0-d.")  # fmt: skip
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
        lf, lb = _like_rule(op)
        register(op, lf, f"x: T{attrs}", lb, kind="reverse", outputs="out: T", forward_name=fn,
                 backward_name=f"{op} reverse (spmdkit)", doc=f"{op} ({fn}): out sharded like x, not partial; x as given.")  # fmt: skip


_register_all()
