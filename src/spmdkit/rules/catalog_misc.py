"""Misc catalog ops: argsort, cummax, cummin, roll, take_along_axis, put_along_axis,
index_put, nonzero, unique, p_norm and label_smooth, with their backward and grad rules.

Notation (x ``abc``; ``1`` marks an axis that is never sharded). Partial inputs are made
replicated everywhere. Except for argsort (which keeps co-shards, as Paddle's rule does), a
co-sharded axis is read as one mesh dim, its largest (the first of equal sizes), as Paddle
3.3.1's rules read ``dims_mapping()``.

- ``argsort`` (ArgSortInferSpmd(x, axis, descending, stable)): ``abc -> abc, abc`` (out,
  indices), the sorted axis replicated, co-shards kept. Paddle registers
  ArgSortGradInferSpmd(indices, x, out_grad, ...) as its backward; it is also
  ``argsort_grad``: every tensor takes x's mapping with the axis replicated (Paddle raises
  where indices and x are sharded differently; spmdkit answers, indices are resharded).
- ``cummax`` / ``cummin`` (CummaxInferSpmd / CumminInferSpmd(x, axis, dtype)): as argsort.
  Grads (CummaxGradInferSpmd(x, indices, out_grad, axis, dtype), also the backward slot):
  ``abc, abc, abc -> abc``, the non-axis letters merged over the three tensors (a conflict
  is resolved: the larger tensor keeps its sharding), the axis replicated.
- ``roll`` (RollInferSpmd(x, shifts, axis)): ``abc -> abc`` with the rolled axes replicated
  (an empty ``axis`` rolls the flattened tensor: every axis replicated). Backward slot and
  ``roll_grad`` (RollGradInferSpmd(x, out_grad, shifts, axis)): x and out_grad merged, the
  rolled axes replicated, x_grad as x.
- ``take_along_axis`` (TakeAlongAxisInferSpmd(x, index, axis)): ``a1c, abc -> abc``: x is
  never sharded on the axis, index (and out) may be; an axis where x and index differ in
  size is ``1`` in both (replicated: the kernel reads x's leading rows). Backward slot and
  ``take_along_axis_grad`` (x, index, out_grad, axis): letters from out_grad alone, x and
  x_grad ``a1c``; where out_grad / index are sharded on the axis each rank scatters only its
  part, so x_grad is partial SUM over those mesh dims of size > 1 (Paddle: not partial,
  unsound).
- ``put_along_axis`` (PutAlongAxisInferSpmd(x, index, value, axis, reduce, include_self)):
  ``a1c, a1c, a1c -> a1c``: the axis, and every axis where index or value differ from x in
  size, replicated; the other axes merged over the three. Backward slot and
  ``put_along_axis_grad`` (x, index, value, out, out_grad, ...): the same letters taken from
  out_grad alone; outputs x_grad, value_grad.
- ``index_put`` (IndexPutInferSpmd(x, indices, value, accumulate)): x's first
  ``len(indices)`` axes replicated, the rest keep their sharding; indices 1-D replicated;
  value (any rank up to that of the indexed shape ``[n, *x.shape[len(indices):]]``, onto
  which it broadcasts from the right): an axis that meets one of x's kept axes with the
  same size (not 1) is sharded as that axis, every other axis (the indexed positions, a
  size-1 axis) replicated (Paddle replicates value while x's axes stay sharded: the local
  shapes do not broadcast). A 1-D value is thus sharded as x's last axis where
  ``len(indices) < x.ndim`` and its size is not 1.
  Backward slot and ``index_put_grad`` (x, indices, value, out_grad, accumulate): x,
  out_grad and x_grad as x above; value_grad sums out_grad[indices] over the kept axes
  value does not lie along, so it is partial SUM over the mesh dims sharding those axes.
  Paddle never marks value_grad partial (unsound).
- ``nonzero`` (NonZeroInferSpmd(x) / NonZeroInferSpmdReverse(x, out)): ``abc -> 11``: all
  replicated. The output's row count is data-dependent; the rule takes whatever shape it
  is given (2-D, second size x.ndim) and assumes nothing else about it.
- ``unique`` (UniqueInferSpmd(x, return_index, return_inverse, return_counts, axis,
  dtype)): everything replicated; out is 1-D without ``axis`` (x.ndim-D with it), index,
  inverse and counts 1-D and absent (None) unless asked for. Paddle has no backward; the
  reverse built here (x, out, indices, inverse, counts, ...) answers the same: the sizes of
  the data-dependent outputs are never checked, only their ranks.
- ``p_norm`` (PNormInferSpmd(x, porder, axis, epsilon, keepdims, asvector)): a reduction
  over ``axis`` (every axis with ``asvector``). A sharded reduced axis leaves out partial
  where a reduce type is right: SUM for porder 0 (a count) and 1 (a sum of |x|), MAX for
  +inf, MIN for -inf; for any other porder the reduced axes are replicated (a sum of local
  norms is not the norm; Paddle marks them partial SUM). Reverse (PNormInferSpmdReverse):
  x takes out's sharding on the kept axes, reduced axes replicated, out as x produces it.
  ``p_norm_grad`` (PNormGradInferSpmd(x, out, out_grad, ...)): ``abc, ac, ac -> abc`` (``a1c``
  with keepdims), merged over the three, the reduced axes replicated.
- ``label_smooth`` (LabelSmoothInferSpmd(label, prior_dist, epsilon)): with prior_dist an
  elementwise binary op (prior_dist broadcast from the right; its mesh dims that label's
  leading axes use are dropped first, as Paddle does; size-1 axes are never sharded).
  Without it the class (last) axis is replicated: the kernel adds epsilon / the class count
  it sees locally (Paddle keeps the axis sharded, unsound); on the other axes, as Paddle's
  elementwise unary rule, mesh dims that do not divide the axis are dropped (minor first).
  Backward slot and ``label_smooth_grad`` (LabelSmoothGradInferSpmd(out_grad, epsilon)):
  out_grad and label_grad sharded as out_grad, not partial.

Deviations from Paddle 3.3.1 (docs/deviations.md, ``misc-*``): take_along_axis_grad's
missing partial; index_put's value broadcast, partial indices and value_grad partial;
p_norm's partial type and its reverse echoing out; label_smooth without prior_dist;
conflicts Paddle raises on (argsort_grad, take_along_axis, roll_grad, nonzero,
label_smooth); take_along_axis's negative axis (Paddle fails); illegal input Paddle accepts
(nonzero's ``[1, 1, 1]``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from spmdkit.core.dist_attr import DimsMapping, Entry, ReduceType, TensorDistAttr, entry_dims
from spmdkit.core.errors import InvalidArgumentError, InvalidAttributeError, ShapeMismatchError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.spec import DistTensorSpec, SpmdResult
from spmdkit.engine.axes import normalize_axis, one_mesh_dim_per_axis
from spmdkit.engine.memo import memo
from spmdkit.engine.notation import ALPHABET, BROADCAST, Notation, fast_result, merge_letters, named_mesh, project_all
from spmdkit.rules.registry import register

Shape = tuple[int, ...]
_make = TensorDistAttr.unchecked

# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def _letters(op: str, n: int) -> str:
    if n > len(ALPHABET):
        raise ShapeMismatchError(f"{op}: tensors of more than {len(ALPHABET)} dims are not supported")
    return ALPHABET[:n]


@memo()
def _clear(dm: DimsMapping, axes: frozenset[int]) -> DimsMapping:
    return tuple(-1 if i in axes else e for i, e in enumerate(dm))


def _same_ndim(op: str, t: DistTensorSpec, n: int, name: str, what: str) -> None:
    if len(t.shape) != n:
        raise ShapeMismatchError(f"{op}: {name} has {len(t.shape)} dims, but {what} has {n}")


def _same_shape(op: str, t: DistTensorSpec, shape: Shape, name: str, what: str) -> None:
    _same_ndim(op, t, len(shape), name, what)
    for i, (s, w) in enumerate(zip(t.shape, shape)):
        if s != w and s >= 0 and w >= 0:
            raise ShapeMismatchError(f"{op}: {name} axis {i} has size {s}, but {what} has {w}")


def _one(t: DistTensorSpec) -> DistTensorSpec:
    """The spec with every co-sharded axis read as its largest mesh dim (as Paddle reads
    ``dims_mapping()`` of a co-sharded tensor)."""
    return one_mesh_dim_per_axis(t)


def _mesh(op: str, named: Sequence[tuple[str, DistTensorSpec | None]]) -> ProcessMesh:
    return named_mesh(op, named)


def _run(
    notation: Notation,
    merge_axes: Sequence[str | None],
    specs: Sequence[DistTensorSpec | None],
    mesh: ProcessMesh,
) -> tuple[list[TensorDistAttr | None], list[TensorDistAttr | None]]:
    """Merge the letters of the tensors given ``merge_axes`` (None: not merged), project all."""
    merged = merge_letters(
        tuple(merge_axes),
        tuple(None if s is None else s.dist_attr.dims_mapping for s in specs),
        tuple(None if s is None else s.shape for s in specs),
        notation.replicated,
        notation.prune,
        mesh.shape,
    )
    return project_all(notation, merged, mesh)


# ---------------------------------------------------------------------------
# argsort, cummax, cummin: the axis replicated
# ---------------------------------------------------------------------------


def _axis_cleared(op: str, x: DistTensorSpec, axis: int) -> TensorDistAttr:
    attr = x.dist_attr
    nd = len(x.shape)
    ax = normalize_axis(op, axis, nd)
    dm = _clear(attr.dims_mapping, frozenset((ax,))) if nd else ()
    return _make(attr.mesh, dm)


def argsort_forward(x: DistTensorSpec, axis: int = -1, descending: bool = False, stable: bool = False) -> SpmdResult:
    """ArgSortInferSpmd: x, out and indices sharded as x with the sorted axis replicated."""
    a = _axis_cleared("argsort", x, axis)
    return fast_result((a,), (a, a))


def argsort_grad(
    indices: DistTensorSpec, x: DistTensorSpec, out_grad: DistTensorSpec, axis: int = -1,
    descending: bool = False, stable: bool = False,
) -> SpmdResult:
    """ArgSortGradInferSpmd: indices, x, out_grad and x_grad take x's mapping, axis replicated."""
    op = "argsort_grad"
    _mesh(op, (("indices", indices), ("x", x), ("out_grad", out_grad)))
    _same_shape(op, indices, x.shape, "indices", "x")
    _same_shape(op, out_grad, x.shape, "out_grad", "x")
    a = _axis_cleared(op, x, axis)
    return fast_result((a, a, a), (a,))


def _make_cum(op: str, fwd_name: str):  # type: ignore[no-untyped-def]
    def forward(x: DistTensorSpec, axis: int = -1, dtype: object = "int64") -> SpmdResult:
        a = _axis_cleared(op, _one(x), axis)
        return fast_result((a,), (a, a))

    def grad(
        x: DistTensorSpec, indices: DistTensorSpec, out_grad: DistTensorSpec, axis: int = -1,
        dtype: object = "int64",
    ) -> SpmdResult:
        g = f"{op}_grad"
        mesh = _mesh(g, (("x", x), ("indices", indices), ("out_grad", out_grad)))
        nd = len(x.shape)
        _same_ndim(g, indices, nd, "indices", "x")
        _same_ndim(g, out_grad, nd, "out_grad", "x")
        ax = normalize_axis(g, axis, nd)
        if nd == 0:
            a = _make(mesh, ())
            return fast_result((a, a, a), (a,))
        # the axis' size is not checked (Paddle's own unit test passes an out_grad of another size)
        s = _letters(g, nd)
        n = Notation((s, s, s), (s,), replicated=s[ax])
        ins, outs = _run(n, (s, s, s), (_one(x), _one(indices), _one(out_grad)), mesh)
        return fast_result(tuple(ins), tuple(outs))

    forward.__name__ = f"{op}_forward"
    forward.__doc__ = f"{fwd_name}: out and indices sharded as x, the scanned axis replicated."
    grad.__name__ = f"{op}_grad"
    grad.__doc__ = f"{fwd_name.replace('Infer', 'GradInfer')}: non-axis letters merged, axis replicated."
    return forward, grad


# ---------------------------------------------------------------------------
# roll
# ---------------------------------------------------------------------------


def _roll_axes(op: str, nd: int, shifts: tuple[int, ...], axis: tuple[int, ...]) -> frozenset[int]:
    if not axis:
        if len(shifts) != 1:
            raise InvalidAttributeError(f"{op}: without axis, shifts must have 1 entry, got {len(shifts)}")
        return frozenset(range(nd))
    if len(axis) != len(shifts):
        raise InvalidAttributeError(
            f"{op}: axis has {len(axis)} entries but shifts has {len(shifts)} (they must be equal)"
        )
    return frozenset(normalize_axis(op, a, nd) for a in axis) if nd else frozenset()


def roll_forward(x: DistTensorSpec, shifts: tuple[int, ...] = (), axis: tuple[int, ...] = ()) -> SpmdResult:
    """RollInferSpmd: the rolled axes replicated (all of them for a flattened roll)."""
    attr = _one(x).dist_attr
    rolled = _roll_axes("roll", len(x.shape), shifts, axis)
    a = _make(attr.mesh, _clear(attr.dims_mapping, rolled))
    return fast_result((a,), (a,))


def roll_grad(
    x: DistTensorSpec, out_grad: DistTensorSpec, shifts: tuple[int, ...] = (), axis: tuple[int, ...] = ()
) -> SpmdResult:
    """RollGradInferSpmd: x and out_grad merged, rolled axes replicated, x_grad as x."""
    op = "roll_grad"
    mesh = _mesh(op, (("x", x), ("out_grad", out_grad)))
    nd = len(x.shape)
    _same_shape(op, out_grad, x.shape, "out_grad", "x")
    rolled = _roll_axes(op, nd, shifts, axis)
    s = _letters(op, nd)
    n = Notation((s, s), (s,), replicated="".join(s[i] for i in rolled))
    ins, outs = _run(n, (s, s), (_one(x), _one(out_grad)), mesh)
    return fast_result(tuple(ins), tuple(outs))


# ---------------------------------------------------------------------------
# take_along_axis / put_along_axis
# ---------------------------------------------------------------------------


@memo()
def _take_axes(x_shape: Shape, i_shape: Shape, ax: int) -> tuple[str, str]:
    """(x axes, index axes): x's axis is ``1``; an axis where the sizes differ is ``1`` in both."""
    s = ALPHABET[: len(i_shape)]
    xs = list(s)
    is_ = list(s)
    xs[ax] = BROADCAST
    for i in range(len(i_shape)):
        if i != ax and x_shape[i] != i_shape[i]:
            xs[i] = BROADCAST
            is_[i] = BROADCAST
    return "".join(xs), "".join(is_)


def _take_check(op: str, x: DistTensorSpec, index: DistTensorSpec, axis: int) -> int:
    nd = len(x.shape)
    _same_ndim(op, index, nd, "index", "x")
    if nd == 0:
        raise ShapeMismatchError(f"{op}: x must have at least 1 dim")
    if nd > len(ALPHABET):
        raise ShapeMismatchError(f"{op}: tensors of more than {len(ALPHABET)} dims are not supported")
    return normalize_axis(op, axis, nd)


def take_along_axis_forward(x: DistTensorSpec, index: DistTensorSpec, axis: int = 0) -> SpmdResult:
    """TakeAlongAxisInferSpmd: ``a1c, abc -> abc``."""
    op = "take_along_axis"
    mesh = _mesh(op, (("x", x), ("index", index)))
    ax = _take_check(op, x, index, axis)
    xa, ia = _take_axes(x.shape, index.shape, ax)
    n = Notation((xa, ia), (ia,))
    ins, outs = _run(n, (xa, ia), (_one(x), _one(index)), mesh)
    return fast_result(tuple(ins), tuple(outs))


def take_along_axis_grad(
    x: DistTensorSpec, index: DistTensorSpec, out_grad: DistTensorSpec, axis: int = 0
) -> SpmdResult:
    """TakeAlongAxisGradInferSpmd: letters from out_grad; x_grad ``a1c``, partial SUM over the
    mesh dims that shard index / out_grad on the axis."""
    op = "take_along_axis_grad"
    mesh = _mesh(op, (("x", x), ("index", index), ("out_grad", out_grad)))
    ax = _take_check(op, x, index, axis)
    _same_ndim(op, out_grad, len(x.shape), "out_grad", "x")
    xa, ia = _take_axes(x.shape, index.shape, ax)
    n = Notation((xa, ia, ia), (xa,))
    ins, outs = _run(n, (None, None, ia), (x, index, _one(out_grad)), mesh)
    return fast_result(tuple(ins), tuple(_no_unit_partial(a) for a in outs))


def _no_unit_partial(a: TensorDistAttr | None) -> TensorDistAttr | None:
    """``a`` without partial mesh dims of size 1 (a no-op reduction; Paddle does not mark them)."""
    if a is None or not a.partial:
        return a
    ms = a.mesh.shape
    pt = tuple((d, r) for d, r in a.partial if ms[d] != 1)
    return a if pt == a.partial else _make(a.mesh, a.dims_mapping, pt)


_PUT_REDUCE = ("assign", "add", "mul", "multiply", "amin", "amax", "mean")


@memo()
def _put_axes(x_shape: Shape, i_shape: Shape, v_shape: Shape, ax: int) -> str:
    s = list(ALPHABET[: len(x_shape)])
    s[ax] = BROADCAST
    for i in range(len(x_shape)):
        if i != ax and (x_shape[i] != i_shape[i] or x_shape[i] != v_shape[i]):
            s[i] = BROADCAST
    return "".join(s)


def _put_check(
    op: str, x: DistTensorSpec, index: DistTensorSpec, value: DistTensorSpec, axis: int, reduce: str
) -> str:
    nd = len(x.shape)
    _same_ndim(op, index, nd, "index", "x")
    _same_ndim(op, value, nd, "value", "x")
    if nd == 0:
        raise ShapeMismatchError(f"{op}: x must have at least 1 dim")
    if nd > len(ALPHABET):
        raise ShapeMismatchError(f"{op}: tensors of more than {len(ALPHABET)} dims are not supported")
    if reduce not in _PUT_REDUCE:
        raise InvalidAttributeError(f"{op}: reduce {reduce!r} is not one of {', '.join(_PUT_REDUCE)}")
    ax = normalize_axis(op, axis, nd)
    return _put_axes(x.shape, index.shape, value.shape, ax)


def put_along_axis_forward(
    x: DistTensorSpec, index: DistTensorSpec, value: DistTensorSpec, axis: int = 0,
    reduce: str = "assign", include_self: bool = True,
) -> SpmdResult:
    """PutAlongAxisInferSpmd: ``a1c, a1c, a1c -> a1c``."""
    op = "put_along_axis"
    mesh = _mesh(op, (("x", x), ("index", index), ("value", value)))
    s = _put_check(op, x, index, value, axis, reduce)
    n = Notation((s, s, s), (s,))
    ins, outs = _run(n, (s, s, s), (_one(x), _one(index), _one(value)), mesh)
    return fast_result(tuple(ins), tuple(outs))


def put_along_axis_grad(
    x: DistTensorSpec, index: DistTensorSpec, value: DistTensorSpec, out: DistTensorSpec,
    out_grad: DistTensorSpec, axis: int = 0, reduce: str = "assign", include_self: bool = True,
) -> SpmdResult:
    """PutAlongAxisGradInferSpmd: every tensor ``a1c``, the letters taken from out_grad."""
    op = "put_along_axis_grad"
    mesh = _mesh(op, (("x", x), ("index", index), ("value", value), ("out", out), ("out_grad", out_grad)))
    s = _put_check(op, x, index, value, axis, reduce)
    _same_shape(op, out, x.shape, "out", "x")
    _same_shape(op, out_grad, x.shape, "out_grad", "x")
    n = Notation((s, s, s, s, s), (s, s))
    ins, outs = _run(n, (None, None, None, None, s), (x, index, value, out, _one(out_grad)), mesh)
    return fast_result(tuple(ins), tuple(outs))


# ---------------------------------------------------------------------------
# index_put
# ---------------------------------------------------------------------------


def _index_put_check(
    op: str, x: DistTensorSpec, indices: tuple[DistTensorSpec, ...], value: DistTensorSpec
) -> tuple[int, tuple[int, ...]]:
    """(number of indexed axes, per value axis the x axis it lies along or -1).

    ``x[indices]`` has the indexed shape ``[n, *x.shape[k:]]`` (n the indices' length, k their
    number); value broadcasts onto it from the right (numpy rules). A value axis lies along
    an x axis where it meets one of x's kept axes with the same size (not 1); it lies along
    nothing (-1) where it meets the indexed positions or has size 1 (a broadcast)."""
    nd = len(x.shape)
    k = len(indices)
    if k == 0:
        raise InvalidArgumentError(f"{op}: indices must hold at least one index tensor")
    if k > nd:
        raise ShapeMismatchError(f"{op}: {k} index tensors for a {nd}-D x (at most {nd})")
    n = -2
    for i, t in enumerate(indices):
        if len(t.shape) != 1:
            raise ShapeMismatchError(f"{op}: indices[{i}] must be 1-D, got {len(t.shape)} dims")
        if n == -2 or n < 0:
            n = t.shape[0]
        elif 0 <= t.shape[0] != n:
            raise ShapeMismatchError(f"{op}: indices[{i}] has {t.shape[0]} entries, indices[0] has {n}")
    target = (n, *x.shape[k:])  # the indexed shape value broadcasts onto
    vs = value.shape
    if len(vs) == 0:
        raise ShapeMismatchError(f"{op}: value must have at least 1 dim, got a 0-d value")
    if len(vs) > len(target):
        raise ShapeMismatchError(
            f"{op}: value has {len(vs)} dims, more than the {len(target)} of the indexed shape "
            f"{list(target)} (indices' length, then x's axes {k}..{nd - 1})"
        )
    off = len(target) - len(vs)
    along: list[int] = []
    for j, v in enumerate(vs):
        size = target[off + j]
        if v >= 0 and size >= 0 and v != size and v != 1:
            raise ShapeMismatchError(
                f"{op}: value shape {list(vs)} does not broadcast onto the indexed shape {list(target)} "
                f"(value axis {j} has size {v}, the indexed shape {size})"
            )
        xa = k - 1 + off + j  # the x axis this value axis meets (k - 1: the indexed positions)
        along.append(xa if xa >= k and v != 1 else -1)
    return k, tuple(along)


@memo()
def _index_put_core(
    dm: DimsMapping, k: int, along: tuple[int, ...]
) -> tuple[DimsMapping, DimsMapping, tuple[int, ...]]:
    """(x mapping, value mapping, mesh dims of the kept axes value_grad sums over)."""
    nd = len(dm)
    xdm = tuple(-1 if i < k else e for i, e in enumerate(dm))
    vdm: DimsMapping = tuple(xdm[a] if a >= 0 else -1 for a in along)
    summed: list[int] = []
    for i in range(k, nd):
        if i not in along:
            summed.extend(entry_dims(xdm[i]))
    return xdm, vdm, tuple(sorted(summed))


def _unit_free(dims: tuple[int, ...], mesh_shape: Shape) -> tuple[int, ...]:
    return tuple(d for d in dims if mesh_shape[d] != 1)


def index_put_forward(
    x: DistTensorSpec, indices: tuple[DistTensorSpec, ...], value: DistTensorSpec, accumulate: bool = False
) -> SpmdResult:
    """IndexPutInferSpmd: the indexed axes replicated, indices replicated, value replicated or
    sharded as x's last axis where it broadcasts onto it."""
    op = "index_put"
    mesh = _mesh(op, (("x", x), *((f"indices[{i}]", t) for i, t in enumerate(indices)), ("value", value)))
    k, along = _index_put_check(op, x, indices, value)
    xdm, vdm, _ = _index_put_core(_one(x).dist_attr.dims_mapping, k, along)
    xa = _make(mesh, xdm)
    rep = _make(mesh, (-1,))
    ins: tuple[Any, ...] = (xa, tuple(rep for _ in indices), _make(mesh, vdm))
    return fast_result(ins, (xa,))


def index_put_grad(
    x: DistTensorSpec, indices: tuple[DistTensorSpec, ...], value: DistTensorSpec, out_grad: DistTensorSpec,
    accumulate: bool = False,
) -> SpmdResult:
    """IndexPutGradInferSpmd: x, out_grad, x_grad as the forward's x; value_grad partial SUM over
    the mesh dims of the trailing axes it sums over."""
    op = "index_put_grad"
    mesh = _mesh(op, (("x", x), *((f"indices[{i}]", t) for i, t in enumerate(indices)), ("value", value),
                      ("out_grad", out_grad)))
    k, along = _index_put_check(op, x, indices, value)
    _same_shape(op, out_grad, x.shape, "out_grad", "x")
    xdm, vdm, summed = _index_put_core(_one(x).dist_attr.dims_mapping, k, along)
    summed = _unit_free(summed, mesh.shape)
    xa = _make(mesh, xdm)
    va = _make(mesh, vdm)
    rep = _make(mesh, (-1,))
    vg = _make(mesh, vdm, tuple((d, ReduceType.SUM) for d in summed)) if summed else va
    ins: tuple[Any, ...] = (xa, tuple(rep for _ in indices), va, xa)
    return fast_result(ins, (xa, vg))


# ---------------------------------------------------------------------------
# nonzero, unique: replicated
# ---------------------------------------------------------------------------


def _nonzero_check(op: str, x: DistTensorSpec) -> None:
    if len(x.shape) == 0:
        raise ShapeMismatchError(f"{op}: x must have at least 1 dim (nonzero of a 0-d tensor is undefined)")


def nonzero_forward(x: DistTensorSpec) -> SpmdResult:
    """NonZeroInferSpmd: x and out ([nnz, x.ndim], data-dependent rows) replicated."""
    _nonzero_check("nonzero", x)
    mesh = x.dist_attr.mesh
    return fast_result((_make(mesh, (-1,) * len(x.shape)),), (_make(mesh, (-1, -1)),))


def nonzero_backward(x: DistTensorSpec, out: DistTensorSpec) -> SpmdResult:
    """NonZeroInferSpmdReverse: everything replicated; out's row count is not checked."""
    op = "nonzero"
    mesh = _mesh(op, (("x", x), ("out", out)))
    _nonzero_check(op, x)
    if len(out.shape) != 2:
        raise ShapeMismatchError(f"{op}: out must be 2-D ([nnz, x.ndim]), got {len(out.shape)} dims")
    if out.shape[1] >= 0 and out.shape[1] != len(x.shape):
        raise ShapeMismatchError(f"{op}: out's second axis has size {out.shape[1]}, x has {len(x.shape)} dims")
    return fast_result((_make(mesh, (-1,) * len(x.shape)),), (_make(mesh, (-1, -1)),))


def _unique_axis(op: str, nd: int, axis: tuple[int, ...]) -> int | None:
    if not axis:
        return None
    if len(axis) > 1:
        raise InvalidAttributeError(f"{op}: axis must hold at most one axis, got {list(axis)}")
    if nd == 0:
        raise InvalidAttributeError(f"{op}: axis {axis[0]} given for a 0-d x")
    return normalize_axis(op, axis[0], nd)


def _unique_outs(
    mesh: ProcessMesh, nd: int, ax: int | None, ri: bool, rv: bool, rc: bool
) -> tuple[TensorDistAttr | None, ...]:
    one = _make(mesh, (-1,))
    out = one if ax is None else _make(mesh, (-1,) * nd)
    return (out, one if ri else None, one if rv else None, one if rc else None)


def unique_forward(
    x: DistTensorSpec, return_index: bool = False, return_inverse: bool = False, return_counts: bool = False,
    axis: tuple[int, ...] = (), dtype: object = "int64",
) -> SpmdResult:
    """UniqueInferSpmd: all replicated; out 1-D without axis; absent outputs None."""
    op = "unique"
    nd = len(x.shape)
    ax = _unique_axis(op, nd, axis)
    mesh = x.dist_attr.mesh
    return fast_result((_make(mesh, (-1,) * nd),), _unique_outs(mesh, nd, ax, return_index, return_inverse,
                                                                  return_counts))


def unique_backward(
    x: DistTensorSpec, out: DistTensorSpec, indices: DistTensorSpec | None = None,
    inverse: DistTensorSpec | None = None, counts: DistTensorSpec | None = None,
    return_index: bool = False, return_inverse: bool = False, return_counts: bool = False,
    axis: tuple[int, ...] = (), dtype: object = "int64",
) -> SpmdResult:
    """unique reverse (spmdkit): all replicated; only the outputs' ranks are checked."""
    op = "unique"
    mesh = _mesh(op, (("x", x), ("out", out), ("indices", indices), ("inverse", inverse), ("counts", counts)))
    nd = len(x.shape)
    ax = _unique_axis(op, nd, axis)
    want = 1 if ax is None else nd
    if len(out.shape) != want:
        raise ShapeMismatchError(f"{op}: out has {len(out.shape)} dims, expected {want}")
    for name, t, flag, attr in (("indices", indices, return_index, "return_index"),
                                ("inverse", inverse, return_inverse, "return_inverse"),
                                ("counts", counts, return_counts, "return_counts")):
        if t is not None and len(t.shape) != 1:
            raise ShapeMismatchError(f"{op}: {name} must be 1-D, got {len(t.shape)} dims")
        if t is not None and not flag:
            raise InvalidArgumentError(f"{op}: {name} given but {attr} is False")
    return fast_result((_make(mesh, (-1,) * nd),), _unique_outs(mesh, nd, ax, return_index, return_inverse,
                                                                  return_counts))


# ---------------------------------------------------------------------------
# p_norm
# ---------------------------------------------------------------------------


def _pnorm_reduce(porder: float) -> ReduceType | None:
    """The partial type a sharded reduced axis leaves, None where there is none."""
    if porder == 0.0 or porder == 1.0:
        return ReduceType.SUM
    if math.isinf(porder):
        return ReduceType.MAX if porder > 0 else ReduceType.MIN
    return None


@memo()
def _pnorm_notation(nd: int, axis: int, keepdims: bool, asvector: bool, porder: float) -> Notation:
    s = ALPHABET[:nd]
    if nd == 0:
        red: frozenset[int] = frozenset()
    elif asvector:
        red = frozenset(range(nd))
    else:
        red = frozenset((axis,))
    if keepdims:
        o = "".join(BROADCAST if i in red else c for i, c in enumerate(s))
    else:
        o = "".join(c for i, c in enumerate(s) if i not in red)
    rt = _pnorm_reduce(porder)
    reduced = "".join(s[i] for i in sorted(red))
    return Notation((s,), (o,), replicated="" if rt is not None else reduced, reduce=rt or ReduceType.SUM)


def _pnorm_setup(op: str, x: DistTensorSpec, porder: float, axis: int, keepdims: bool, asvector: bool) -> Notation:
    nd = len(x.shape)
    if nd > len(ALPHABET):
        raise ShapeMismatchError(f"{op}: tensors of more than {len(ALPHABET)} dims are not supported")
    if math.isnan(porder):
        raise InvalidAttributeError(f"{op}: porder must be a number, got nan")
    ax = 0 if asvector and nd else normalize_axis(op, axis, nd)
    return _pnorm_notation(nd, ax, bool(keepdims), bool(asvector), float(porder))


def p_norm_forward(
    x: DistTensorSpec, porder: float = 2.0, axis: int = -1, epsilon: float = 1e-12, keepdims: bool = False,
    asvector: bool = False,
) -> SpmdResult:
    """PNormInferSpmd: a reduction; a sharded reduced axis is partial only where a type is right."""
    n = _pnorm_setup("p_norm", x, porder, axis, keepdims, asvector)
    mesh = x.dist_attr.mesh
    ins, outs = _run(n, n.inputs, (_one(x),), mesh)
    return fast_result(tuple(ins), tuple(outs))


def p_norm_backward(
    x: DistTensorSpec, out: DistTensorSpec, porder: float = 2.0, axis: int = -1, epsilon: float = 1e-12,
    keepdims: bool = False, asvector: bool = False,
) -> SpmdResult:
    """PNormInferSpmdReverse: x from out on the kept axes, reduced axes replicated."""
    op = "p_norm"
    mesh = _mesh(op, (("x", x), ("out", out)))
    n = _pnorm_setup(op, x, porder, axis, keepdims, asvector)
    o = n.outputs[0]
    assert o is not None
    _same_shape(op, out, _pnorm_out_shape(x.shape, n), "out", "p_norm of x")
    # x's letters from out only; the reduced letters (absent from out or `1`) stay unsharded
    ins, _ = _run(n, (None, o), (None, _one(out)), mesh)
    xa = ins[0]
    assert xa is not None
    ins2, outs2 = _run(n, n.inputs, (DistTensorSpec(x.shape, xa),), mesh)
    return fast_result(tuple(ins2), tuple(outs2))


def _pnorm_out_shape(shape: Shape, n: Notation) -> Shape:
    x, o = n.inputs[0], n.outputs[0]
    assert x is not None and o is not None
    size = dict(zip(x, shape))
    return tuple(1 if c == BROADCAST else size[c] for c in o)


def p_norm_grad(
    x: DistTensorSpec, out: DistTensorSpec, out_grad: DistTensorSpec, porder: float = 2.0, axis: int = -1,
    epsilon: float = 1e-12, keepdims: bool = False, asvector: bool = False,
) -> SpmdResult:
    """PNormGradInferSpmd: ``abc, ac, ac -> abc``, merged over the three, reduced axes replicated."""
    op = "p_norm_grad"
    mesh = _mesh(op, (("x", x), ("out", out), ("out_grad", out_grad)))
    n0 = _pnorm_setup(op, x, porder, axis, keepdims, asvector)
    xs, o = n0.inputs[0], n0.outputs[0]
    assert xs is not None and o is not None
    oshape = _pnorm_out_shape(x.shape, n0)
    _same_shape(op, out, oshape, "out", "p_norm of x")
    _same_shape(op, out_grad, oshape, "out_grad", "p_norm of x")
    reduced = "".join(c for c in xs if c not in o)
    n = _grad_notation(xs, o, reduced)
    ins, outs = _run(n, n.inputs, (_one(x), _one(out), _one(out_grad)), mesh)
    return fast_result(tuple(ins), tuple(outs))


@memo()
def _grad_notation(xs: str, o: str, reduced: str) -> Notation:
    return Notation((xs, o, o), (xs,), replicated=reduced)


# ---------------------------------------------------------------------------
# label_smooth
# ---------------------------------------------------------------------------


@memo()
def _label_axes(l_shape: Shape, p_shape: Shape) -> tuple[str, str]:
    """Right-aligned broadcast letters; a size-1 axis is ``1`` (never sharded, as in Paddle's
    elementwise rules)."""
    nd = len(l_shape)
    s = "".join(BROADCAST if v == 1 else c for v, c in zip(l_shape, ALPHABET[:nd]))
    off = nd - len(p_shape)
    p = "".join(BROADCAST if p_shape[i] == 1 else ALPHABET[off + i] for i in range(len(p_shape)))
    return s, p


def label_smooth_forward(label: DistTensorSpec, prior_dist: DistTensorSpec | None = None,
                         epsilon: float = 0.0) -> SpmdResult:
    """LabelSmoothInferSpmd: elementwise with prior_dist; without it the class axis replicated."""
    op = "label_smooth"
    nd = len(label.shape)
    if nd == 0:
        raise ShapeMismatchError(f"{op}: label must have at least 1 dim (the class axis)")
    if nd > len(ALPHABET):
        raise ShapeMismatchError(f"{op}: tensors of more than {len(ALPHABET)} dims are not supported")
    if prior_dist is None:
        attr = label.dist_attr
        a = _make(attr.mesh, _unary_dm(label.shape, attr.dims_mapping, attr.mesh.shape))
        return fast_result((a, None), (a,))
    mesh = _mesh(op, (("label", label), ("prior_dist", prior_dist)))
    pn = len(prior_dist.shape)
    if pn > nd:
        raise ShapeMismatchError(f"{op}: prior_dist has {pn} dims, more than label's {nd}")
    off = nd - pn
    for i, s in enumerate(prior_dist.shape):
        t = label.shape[off + i]
        if s != t and s != 1 and s >= 0 and t >= 0:
            raise ShapeMismatchError(
                f"{op}: prior_dist axis {i} has size {s}, which does not broadcast onto label's {t}"
            )
    la, pa = _label_axes(label.shape, prior_dist.shape)
    # Paddle drops prior_dist's mesh dims that label's leading (extra) axes use
    label = _one(label)
    lead = {d for e in label.dist_attr.dims_mapping[:off] for d in entry_dims(e)}
    pdm = prior_dist.dist_attr.dims_mapping
    if lead:
        pdm = tuple(_drop_dims(e, lead) for e in pdm)
    p2 = _one(DistTensorSpec(prior_dist.shape, _make(mesh, pdm)))
    n = _label_notation(la, pa)
    ins, outs = _run(n, (la, pa), (label, p2), mesh)
    return fast_result(tuple(ins), tuple(outs))


@memo()
def _unary_dm(shape: Shape, dm: DimsMapping, mesh_shape: Shape) -> DimsMapping:
    """label_smooth without prior_dist: the class axis replicated; elsewhere, as Paddle's
    elementwise unary rule, the mesh dims that do not divide an axis dropped (minor first)."""
    out: list[Entry] = []
    last = len(dm) - 1
    for i, e in enumerate(dm):
        d = entry_dims(e)
        if i == last:
            d = ()
        size = shape[i]
        if size >= 0:
            while d and size % math.prod(mesh_shape[x] for x in d) != 0:
                d = d[:-1]
        out.append(-1 if not d else d[0] if len(d) == 1 else d)
    return tuple(out)


def _drop_dims(e: Entry, drop: set[int]) -> Entry:
    d = tuple(x for x in entry_dims(e) if x not in drop)
    return -1 if not d else d[0] if len(d) == 1 else d


@memo()
def _label_notation(la: str, pa: str) -> Notation:
    return Notation((la, pa), (la,))


def label_smooth_grad(out_grad: DistTensorSpec, epsilon: float = 0.0) -> SpmdResult:
    """LabelSmoothGradInferSpmd: out_grad and label_grad sharded as out_grad, not partial."""
    attr = out_grad.dist_attr
    a = attr if not attr.partial else _make(attr.mesh, attr.dims_mapping)
    return fast_result((a,), (a,))


# ---------------------------------------------------------------------------
# registration
# ---------------------------------------------------------------------------


def _register_all() -> None:
    ag = "axis: int = -1, descending: bool = False, stable: bool = False"
    register("argsort", argsort_forward, f"x: T, {ag}", argsort_grad, f"indices: T, x: T, out_grad: T, {ag}", kind="grad",
             forward_name="ArgSortInferSpmd", backward_name="ArgSortGradInferSpmd")  # fmt: skip
    register("argsort_grad", argsort_grad, f"indices: T, x: T, out_grad: T, {ag}",
             forward_name="ArgSortGradInferSpmd")  # fmt: skip
    for op, fn in (("cummax", "CummaxInferSpmd"), ("cummin", "CumminInferSpmd")):
        f, g = _make_cum(op, fn)
        cs = "axis: int = -1, dtype: any = 'int64'"
        gname = fn.replace("InferSpmd", "GradInferSpmd")
        register(op, f, f"x: T, {cs}", g, f"x: T, indices: T, out_grad: T, {cs}", kind="grad",
                 forward_name=fn, backward_name=gname)  # fmt: skip
        register(f"{op}_grad", g, f"x: T, indices: T, out_grad: T, {cs}", forward_name=gname)
    rs = "shifts: ints, axis: ints = []"
    register("roll", roll_forward, f"x: T, {rs}", roll_grad, f"x: T, out_grad: T, {rs}", kind="grad",
             forward_name="RollInferSpmd", backward_name="RollGradInferSpmd")  # fmt: skip
    register("roll_grad", roll_grad, f"x: T, out_grad: T, {rs}", forward_name="RollGradInferSpmd")
    register("take_along_axis", take_along_axis_forward, "x: T, index: T, axis: int",
             take_along_axis_grad, "x: T, index: T, out_grad: T, axis: int", kind="grad",
             forward_name="TakeAlongAxisInferSpmd", backward_name="TakeAlongAxisGradInferSpmd")  # fmt: skip
    register("take_along_axis_grad", take_along_axis_grad, "x: T, index: T, out_grad: T, axis: int",
             forward_name="TakeAlongAxisGradInferSpmd")  # fmt: skip
    ps = "axis: int, reduce: str = 'assign', include_self: bool = True"
    register("put_along_axis", put_along_axis_forward, f"x: T, index: T, value: T, {ps}",
             put_along_axis_grad, f"x: T, index: T, value: T, out: T, out_grad: T, {ps}", kind="grad",
             forward_name="PutAlongAxisInferSpmd", backward_name="PutAlongAxisGradInferSpmd")  # fmt: skip
    register("put_along_axis_grad", put_along_axis_grad, f"x: T, index: T, value: T, out: T, out_grad: T, {ps}",
             forward_name="PutAlongAxisGradInferSpmd")  # fmt: skip
    register("index_put", index_put_forward, "x: T, indices: [T], value: T, accumulate: bool = False",
             index_put_grad, "x: T, indices: [T], value: T, out_grad: T, accumulate: bool = False", kind="grad",
             forward_name="IndexPutInferSpmd", backward_name="IndexPutGradInferSpmd")  # fmt: skip
    register("index_put_grad", index_put_grad, "x: T, indices: [T], value: T, out_grad: T, accumulate: bool = False",
             forward_name="IndexPutGradInferSpmd")  # fmt: skip
    register("nonzero", nonzero_forward, "x: T", nonzero_backward, kind="reverse", outputs="out: T",
             forward_name="NonZeroInferSpmd", backward_name="NonZeroInferSpmdReverse")  # fmt: skip
    us = ("return_index: bool = False, return_inverse: bool = False, return_counts: bool = False, "
          "axis: ints = [], dtype: any = 'int64'")
    register("unique", unique_forward, f"x: T, {us}", unique_backward,
             kind="reverse", outputs="out: T, indices: T? = None, inverse: T? = None, counts: T? = None",
             forward_name="UniqueInferSpmd", backward_name="unique reverse (spmdkit)")  # fmt: skip
    pn = "porder: float = 2.0, axis: int = -1, epsilon: float = 1e-12, keepdims: bool = False, asvector: bool = False"
    register("p_norm", p_norm_forward, f"x: T, {pn}", p_norm_backward, kind="reverse", outputs="out: T",
             forward_name="PNormInferSpmd", backward_name="PNormInferSpmdReverse")  # fmt: skip
    register("p_norm_grad", p_norm_grad, f"x: T, out: T, out_grad: T, {pn}", forward_name="PNormGradInferSpmd")
    register("label_smooth", label_smooth_forward, "label: T, prior_dist: T?, epsilon: float = 0.0",
             label_smooth_grad, "out_grad: T, epsilon: float = 0.0", kind="grad",
             forward_name="LabelSmoothInferSpmd", backward_name="LabelSmoothGradInferSpmd")  # fmt: skip
    register("label_smooth_grad", label_smooth_grad, "out_grad: T, epsilon: float = 0.0",
             forward_name="LabelSmoothGradInferSpmd")  # fmt: skip


_register_all()
