"""Indexing ops: gather, index_select, gather_nd, scatter, scatter_nd_add, where and their grads.

Notation (x ``[a b c]``, the gathered axis ``b``; ``k`` the index's own letter)::

    gather / index_select   abc, k -> akc          (b replicated; 0-d index: abc, _ -> ac;
                                                    an index [N, 1]: abc, k1 -> akc)
    gather_grad             abc, k, akc -> abc     (x, index, out_grad -> x_grad; b replicated,
                                                    x_grad partial SUM over k's mesh dims)
    index_select_grad       the same (Paddle's IndexSelectGradInferSpmd, index_select's backward slot)
    gather_nd               XT, Bq -> BT           (x = indexed axes X + trailing T; index = batch B
                                                    + the coordinate axis q; X and q replicated)
    gather_nd_grad          XT, Bq, BT -> XT       (x_grad partial SUM over B's mesh dims)
    scatter                 zT, b, bT -> zT        (x, index [N], updates [N, ...] -> out; z, b replicated)
    scatter_grad            b, bT, zT -> zT, bT    (index, updates, out_grad -> x_grad, updates_grad)
    scatter_nd_add          XT, Bq, BT -> XT       (X, q replicated; B sharded: out partial SUM and
                                                    x required partial SUM over B's mesh dims)
    scatter_nd_add_grad     Bq, BT, XT -> XT, BT   (x_grad = out_grad, updates_grad = gather_nd)
    where                   cond, x, y -> out      (elementwise with numpy broadcasting; a size-1
                                                    broadcast axis is ``1``: never sharded)
    where_grad              cond, x, y, og -> xg, yg (broadcast letters make a grad partial SUM)

What is replicated: the gathered / scattered axis of x (the index holds global positions),
the coordinate axis of an index, and, in scatter, the updates' batch axis (overwriting
rows cannot be summed: sharding it would count x once per rank). Partial inputs are
resharded to replicated (index tensors cannot be partial), except that scatter_nd_add asks
for x partial SUM over the mesh dims sharding the updates' batch axes: each rank adds its
own updates to its share of x, and out is the partial SUM of the pieces.

Merging follows Paddle 3.3.1 where that is sound: gather / index_select / gather_nd merge x
and index; scatter and scatter_nd_add merge index and updates only (x takes out's sharding);
where merges condition and x (y's own sharding is not read, as in Paddle). A mesh dim
claimed by two letters stays with the first (x's letters before the index's); where two
tensors shard one letter differently the larger tensor wins. A co-sharded axis keeps one
mesh dim, its largest (as Paddle's merge). Reverse rules infer the inputs from the outputs
and return the outputs those inputs produce.

Deviations (``docs/deviations.md``, ``indexing-*``): Paddle keeps an index sharded on a mesh
dim x already uses while out drops it; echoes a partial out in reverse; gather_nd answers a
mesh dim twice; scatter / scatter_nd_add mark out partial over a sharded updates batch with
x replicated (x counted once per rank); scatter_nd_add labels the index's coordinate axis as
an updates axis (shards it); where shards size-1 broadcast axes and rejects a condition of
lower rank; a negative gather axis crashes Paddle. The grads that Paddle has (gather_grad,
gather_nd_grad, scatter_grad, where_grad) are not reachable through Paddle's rule table;
gather_nd_grad there misses the partial x_grad of a sharded index batch.
"""

from __future__ import annotations

from collections.abc import Sequence

from spmdkit.core.dist_attr import ReduceType, TensorDistAttr
from spmdkit.core.errors import InvalidAttributeError, ShapeMismatchError
from spmdkit.core.spec import DistTensorSpec, SpmdResult
from spmdkit.engine.axes import one_mesh_dim_per_axis, unpartial
from spmdkit.engine.memo import memo
from spmdkit.engine.notation import (
    ALPHABET,
    BROADCAST,
    Notation,
    check_letters,
    common_mesh,
    einsum_backward,
    einsum_forward,
    fast_result,
    merge_specs,
    project_all,
)
from spmdkit.rules._common import forward_largest, reverse_largest
from spmdkit.rules.registry import register

Shape = tuple[int, ...]
Merged = tuple[tuple[str, tuple[int, ...]], ...]


# -- helpers ------------------------------------------------------------------------------------


def _one_dim(specs: Sequence[DistTensorSpec]) -> list[DistTensorSpec]:
    """A co-sharded axis keeps one mesh dim, its largest (the first of equal sizes)."""
    return [one_mesh_dim_per_axis(s) for s in specs]


def _need(op: str, n: int) -> None:
    if n > len(ALPHABET):
        raise ShapeMismatchError(f"{op}: the tensors need {n} axis letters, at most {len(ALPHABET)} are supported")


def _axis(op: str, axis: int, ndim: int) -> int:
    if not -ndim <= axis < ndim:
        raise InvalidAttributeError(f"{op}: axis {axis} is out of range for x of {ndim} dims [{-ndim}, {ndim})")
    return axis + ndim if axis < 0 else axis


def _x_nonscalar(op: str, x: DistTensorSpec, name: str = "x") -> int:
    nd = len(x.shape)
    if nd == 0:
        raise ShapeMismatchError(f"{op}: {name} must have at least 1 dim, got a 0-d tensor")
    return nd


def _same(op: str, a: int, b: int, what: str) -> None:
    if a != b and a >= 0 and b >= 0:
        raise ShapeMismatchError(f"{op}: {what} ({a} vs {b})")


def _index_axes(op: str, index: DistTensorSpec, letter: str, allow_0d: bool = True) -> str:
    """A gather / scatter index: 0-d (``""``), [N] (``k``) or [N, 1] (``k1``)."""
    shp = index.shape
    if len(shp) == 0 and allow_0d:
        return ""
    if len(shp) == 1:
        return letter
    if len(shp) == 2 and shp[1] in (1, -1):
        return letter + BROADCAST
    want = "1-D" if not allow_0d else "0-d, 1-D or [N, 1]"
    raise ShapeMismatchError(f"{op}: index must be {want}, got shape {list(shp)}")


def _result(ins: Sequence[TensorDistAttr | None], outs: Sequence[TensorDistAttr | None]) -> SpmdResult:
    return fast_result(tuple(ins), tuple(outs))


def _no_partial(a: TensorDistAttr | None) -> TensorDistAttr | None:
    return None if a is None else unpartial(a)


def _with_sum(a: TensorDistAttr | None, dims: tuple[int, ...]) -> TensorDistAttr | None:
    if a is None or not dims:
        return a
    pt = dict(a.partial)
    for d in dims:
        pt[d] = ReduceType.SUM
    return TensorDistAttr.unchecked(a.mesh, a.dims_mapping, tuple(sorted(pt.items())))


# -- gather / index_select ----------------------------------------------------------------------


@memo()
def _gather_notation(nd: int, axis: int, idx_axes: str, grad: bool) -> Notation:
    x = ALPHABET[:nd]
    k = ALPHABET[nd]
    out = x[:axis] + (k if idx_axes else "") + x[axis + 1 :]
    idx = idx_axes.replace("k", k)
    if grad:
        return Notation([x, idx, out], [x], replicated=x[axis])
    return Notation([x, idx], [out], replicated=x[axis])


def _gather_setup(op: str, x: DistTensorSpec, index: DistTensorSpec, axis: object,
                  index_1d: bool, grad: bool) -> Notation:
    nd = _x_nonscalar(op, x)
    _need(op, nd + 1)
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise InvalidAttributeError(f"{op}: axis must be an int, got {axis!r}")
    ax = _axis(op, axis, nd)
    idx_axes = _index_axes(op, index, "k", allow_0d=not index_1d)
    return _gather_notation(nd, ax, idx_axes, grad)


def _make_gather(op: str, index_1d: bool, fname: str, rname: str):  # type: ignore[no-untyped-def]
    def forward(x: DistTensorSpec, index: DistTensorSpec, axis: int = 0) -> SpmdResult:
        n = _gather_setup(op, x, index, axis, index_1d, False)
        ins, outs = einsum_forward(op, n, (x, index) if index_1d else _one_dim((x, index)), ("x", "index"))
        return _result(ins, outs)

    def backward(x: DistTensorSpec, index: DistTensorSpec, out: DistTensorSpec, axis: int = 0) -> SpmdResult:
        n = _gather_setup(op, x, index, axis, index_1d, False)
        ins, outs = einsum_backward(op, n, _one_dim((x, index)), _one_dim((out,)), ("x", "index", "out"))
        return _result(ins, outs)

    forward.__name__ = f"{op}_forward"
    forward.__doc__ = f"{op} ({fname}): ``abc, k -> akc``, the gathered axis replicated."
    backward.__name__ = f"{op}_backward"
    backward.__doc__ = f"{op} ({rname}): x and index from out; out as they produce it."
    return forward, backward


def _make_gather_grad(op: str, index_1d: bool, fname: str):  # type: ignore[no-untyped-def]
    def grad(x: DistTensorSpec, index: DistTensorSpec, out_grad: DistTensorSpec, axis: int = 0) -> SpmdResult:
        n = _gather_setup(op, x, index, axis, index_1d, True)
        if not index_1d:
            ins, outs = einsum_forward(op, n, _one_dim((x, index, out_grad)), ("x", "index", "out_grad"))
            return _result(ins, outs)
        # index_select_grad: Paddle 3.3.1 shards out_grad as x and the index say (out_grad's
        # own sharding is not read); sound, so kept
        mesh = common_mesh(op, (x, index, out_grad))
        check_letters(op, n.inputs, (x, index, out_grad), ("x", "index", "out_grad"))
        merged = merge_specs(n, n.inputs[:2], (x, index), mesh)
        ins, outs = project_all(n, merged, mesh)
        return _result(ins, outs)

    grad.__name__ = op
    grad.__doc__ = (f"{op} ({fname}): ``abc, k, akc -> abc``; x_grad partial SUM over the index's mesh "
                    "dims, the gathered axis replicated.")
    return grad


_gather_fwd, _gather_bwd = _make_gather("gather", False, "GatherInferSpmdBase", "GatherInferSpmdReverseBase")
register(
    "gather", _gather_fwd, "x: T, index: T, axis: int = 0",
    _gather_bwd, kind="reverse", outputs="out: T",
    forward_name="GatherInferSpmdBase", backward_name="GatherInferSpmdReverseBase",
)  # fmt: skip
register(
    "gather_grad", _make_gather_grad("gather_grad", False, "GatherGradInferSpmd"),
    "x: T, index: T, out_grad: T, axis: int = 0", forward_name="GatherGradInferSpmd",
)  # fmt: skip

_is_fwd, _ = _make_gather("index_select", True, "IndexSelectInferSpmd", "")
_is_grad = _make_gather_grad("index_select_grad", True, "IndexSelectGradInferSpmd")
register(
    "index_select", _is_fwd, "x: T, index: T, axis: int = 0",
    _is_grad, "x: T, index: T, out_grad: T, axis: int = 0", kind="grad",
    forward_name="IndexSelectInferSpmd", backward_name="IndexSelectGradInferSpmd",
)  # fmt: skip
register(
    "index_select_grad", _make_gather_grad("index_select_grad", True, "IndexSelectGradInferSpmd"),
    "x: T, index: T, out_grad: T, axis: int = 0", forward_name="IndexSelectGradInferSpmd",
)  # fmt: skip


# -- gather_nd / scatter_nd_add -----------------------------------------------------------------


def _nd_parts(op: str, x_shape: Shape, index: DistTensorSpec) -> tuple[int, int, int]:
    """(x ndim, index ndim, coordinate count k) of a gather_nd / scatter_nd_add index."""
    ni = len(index.shape)
    if ni == 0:
        raise ShapeMismatchError(f"{op}: index must have at least 1 dim (the coordinates), got a 0-d tensor")
    k = index.shape[-1]
    nd = len(x_shape)
    if k < 0:
        raise ShapeMismatchError(f"{op}: index's last dim (the coordinate count) must be known, got -1")
    if k > nd:
        raise ShapeMismatchError(
            f"{op}: index's last dim ({k} coordinates) exceeds x's rank ({nd}); index shape {list(index.shape)}"
        )
    _need(op, nd + ni)
    return nd, ni, k


@memo()
def _nd_letters(nd: int, ni: int, k: int) -> tuple[str, str, str, str]:
    """(x axes X+T, index axes B+q, batch B + trailing T, X + q: the replicated letters)."""
    x = ALPHABET[:nd]
    b = ALPHABET[nd : nd + ni - 1]
    q = ALPHABET[nd + ni - 1]
    return x, b + q, b + x[k:], x[:k] + q


@memo()
def _gather_nd_notation(nd: int, ni: int, k: int, grad: bool) -> Notation:
    x, idx, out, rep = _nd_letters(nd, ni, k)
    if grad:
        return Notation([x, idx, out], [x], replicated=rep)
    return Notation([x, idx], [out], replicated=rep)


def _check_batch_trailing(op: str, name: str, t: DistTensorSpec, index: DistTensorSpec, x_shape: Shape,
                          k: int) -> None:
    want = (*index.shape[:-1], *x_shape[k:])
    if len(t.shape) != len(want):
        raise ShapeMismatchError(
            f"{op}: {name} has {len(t.shape)} dims, expected index.shape[:-1] + x.shape[{k}:] = {list(want)}"
        )
    for i, (s, w) in enumerate(zip(t.shape, want)):
        _same(op, s, w, f"{name} has size {s} on axis {i}, expected {w} (index.shape[:-1] + x.shape[{k}:])")


def gather_nd_forward(x: DistTensorSpec, index: DistTensorSpec) -> SpmdResult:
    """gather_nd (GatherNdInferSpmd): ``XT, Bq -> BT``; indexed axes and coordinates replicated."""
    op = "gather_nd"
    nd, ni, k = _nd_parts(op, x.shape, index)
    n = _gather_nd_notation(nd, ni, k, False)
    return forward_largest(op, n, (x, index), ("x", "index"))


def gather_nd_backward(x: DistTensorSpec, index: DistTensorSpec, out: DistTensorSpec) -> SpmdResult:
    """gather_nd (GatherNdInferSpmdReverse): B to the index, T to x, from out."""
    op = "gather_nd"
    nd, ni, k = _nd_parts(op, x.shape, index)
    _check_batch_trailing(op, "out", out, index, x.shape, k)
    n = _gather_nd_notation(nd, ni, k, False)
    return reverse_largest(op, n, (x, index), (out,), ("x", "index", "out"))


def gather_nd_grad(x: DistTensorSpec, index: DistTensorSpec, out_grad: DistTensorSpec) -> SpmdResult:
    """gather_nd_grad (GatherNdGradInferSpmd): ``XT, Bq, BT -> XT``; x_grad partial SUM over B's mesh dims."""
    op = "gather_nd_grad"
    nd, ni, k = _nd_parts(op, x.shape, index)
    _check_batch_trailing(op, "out_grad", out_grad, index, x.shape, k)
    n = _gather_nd_notation(nd, ni, k, True)
    return forward_largest(op, n, (x, index, out_grad), ("x", "index", "out_grad"))


register(
    "gather_nd", gather_nd_forward, "x: T, index: T", gather_nd_backward, kind="reverse", outputs="out: T",
    forward_name="GatherNdInferSpmd", backward_name="GatherNdInferSpmdReverse",
)  # fmt: skip
register("gather_nd_grad", gather_nd_grad, "x: T, index: T, out_grad: T", forward_name="GatherNdGradInferSpmd")


@memo()
def _snd_notation(nd: int, ni: int, k: int, grad: bool) -> Notation:
    x, idx, upd, rep = _nd_letters(nd, ni, k)
    if grad:  # index, updates, out_grad -> x_grad, updates_grad
        return Notation([idx, upd, x], [x, upd], replicated=rep)
    return Notation([x, idx, upd], [x], replicated=rep)


def _batch_dims(merged: Merged, batch: str) -> tuple[int, ...]:
    out: list[int] = []
    for ch, ds in merged:
        if ch in batch:
            out.extend(ds)
    return tuple(sorted(out))


def scatter_nd_add_forward(x: DistTensorSpec, index: DistTensorSpec, updates: DistTensorSpec) -> SpmdResult:
    """scatter_nd_add (ScatterNdAddInferSpmd): ``XT, Bq, BT -> XT``; a sharded batch B makes out
    partial SUM and asks for x partial SUM over the same mesh dims."""
    op = "scatter_nd_add"
    nd, ni, k = _nd_parts(op, x.shape, index)
    _check_batch_trailing(op, "updates", updates, index, x.shape, k)
    n = _snd_notation(nd, ni, k, False)
    mesh = common_mesh(op, (x, index, updates))
    check_letters(op, n.inputs, (x, index, updates), ("x", "index", "updates"))
    x, index, updates = _one_dim((x, index, updates))
    merged = merge_specs(n, n.inputs[1:], (index, updates), mesh)
    ins, outs = project_all(n, merged, mesh)
    bdims = _batch_dims(merged, (n.inputs[1] or "")[:-1])
    ins[0] = _with_sum(ins[0], bdims)
    return _result(ins, outs)


def scatter_nd_add_backward(x: DistTensorSpec, index: DistTensorSpec, updates: DistTensorSpec,
                            out: DistTensorSpec) -> SpmdResult:
    """scatter_nd_add (ScatterNdAddInferSpmdReverse): T from out to x and updates; X, B replicated."""
    op = "scatter_nd_add"
    nd, ni, k = _nd_parts(op, x.shape, index)
    _check_batch_trailing(op, "updates", updates, index, x.shape, k)
    n = _snd_notation(nd, ni, k, False)
    return reverse_largest(op, n, (x, index, updates), (out,), ("x", "index", "updates", "out"))


def scatter_nd_add_grad(index: DistTensorSpec, updates: DistTensorSpec, out_grad: DistTensorSpec) -> SpmdResult:
    """scatter_nd_add_grad: ``Bq, BT, XT -> XT, BT``; x_grad = out_grad, updates_grad = gather_nd(out_grad)."""
    op = "scatter_nd_add_grad"
    nd, ni, k = _nd_parts(op, out_grad.shape, index)
    _check_batch_trailing(op, "updates", updates, index, out_grad.shape, k)
    n = _snd_notation(nd, ni, k, True)
    ins, outs = einsum_forward(op, n, _one_dim((index, updates, out_grad)), ("index", "updates", "out_grad"))
    outs[0] = _no_partial(outs[0])  # x_grad is out_grad itself: nothing is summed over B
    return _result(ins, outs)


register(
    "scatter_nd_add", scatter_nd_add_forward, "x: T, index: T, updates: T",
    scatter_nd_add_backward, kind="reverse", outputs="out: T",
    forward_name="ScatterNdAddInferSpmd", backward_name="ScatterNdAddInferSpmdReverse",
)  # fmt: skip
register("scatter_nd_add_grad", scatter_nd_add_grad, "index: T, updates: T, out_grad: T")


# -- scatter --------------------------------------------------------------------------------------


@memo()
def _scatter_notation(nd: int, idx_axes: str, grad: bool) -> Notation:
    t = ALPHABET[: nd - 1]
    z = ALPHABET[nd - 1]
    b = ALPHABET[nd]
    x = z + t
    idx = idx_axes.replace("k", b)
    upd = (b + t) if idx_axes else t
    if grad:  # index, updates, out_grad -> x_grad, updates_grad
        return Notation([idx, upd, x], [x, upd], replicated=z + b)
    return Notation([x, idx, upd], [x], replicated=z + b)


def _scatter_setup(op: str, x_shape: Shape, index: DistTensorSpec, updates: DistTensorSpec,
                   overwrite: object, xname: str, grad: bool = False) -> Notation:
    if not isinstance(overwrite, bool):
        raise InvalidAttributeError(f"{op}: overwrite must be a bool, got {overwrite!r}")
    nd = len(x_shape)
    if nd == 0:
        raise ShapeMismatchError(f"{op}: {xname} must have at least 1 dim, got a 0-d tensor")
    _need(op, nd + 1)
    idx_axes = _index_axes(op, index, "k")
    want = (index.shape[0], *x_shape[1:]) if idx_axes else tuple(x_shape[1:])
    if len(updates.shape) != len(want):
        raise ShapeMismatchError(
            f"{op}: updates has {len(updates.shape)} dims, expected {len(want)} (shape {list(want)}: "
            f"index's length + {xname}.shape[1:])"
        )
    for i, (s, w) in enumerate(zip(updates.shape, want)):
        _same(op, s, w, f"updates has size {s} on axis {i}, expected {w}")
    return _scatter_notation(nd, idx_axes, grad)


def scatter_forward(x: DistTensorSpec, index: DistTensorSpec, updates: DistTensorSpec,
                    overwrite: bool = True) -> SpmdResult:
    """scatter (ScatterInferSpmd): ``zT, b, bT -> zT``; rows and the updates' batch replicated,
    the trailing axes from the updates (x takes out's sharding)."""
    op = "scatter"
    n = _scatter_setup(op, x.shape, index, updates, overwrite, "x")
    mesh = common_mesh(op, (x, index, updates))
    check_letters(op, n.inputs, (x, index, updates), ("x", "index", "updates"))
    x, index, updates = _one_dim((x, index, updates))
    merged = merge_specs(n, n.inputs[1:], (index, updates), mesh)
    ins, outs = project_all(n, merged, mesh)
    return _result(ins, outs)


def scatter_backward(x: DistTensorSpec, index: DistTensorSpec, updates: DistTensorSpec, out: DistTensorSpec,
                     overwrite: bool = True) -> SpmdResult:
    """scatter (ScatterInferSpmdReverse): the trailing axes from out; rows and batch replicated."""
    op = "scatter"
    n = _scatter_setup(op, x.shape, index, updates, overwrite, "x")
    return reverse_largest(op, n, (x, index, updates), (out,), ("x", "index", "updates", "out"))


def scatter_grad(index: DistTensorSpec, updates: DistTensorSpec, out_grad: DistTensorSpec,
                 overwrite: bool = True) -> SpmdResult:
    """scatter_grad (ScatterGradInferSpmd): ``b, bT, zT -> zT, bT``; the trailing axes from out_grad."""
    op = "scatter_grad"
    n = _scatter_setup(op, out_grad.shape, index, updates, overwrite, "out_grad", True)
    mesh = common_mesh(op, (index, updates, out_grad))
    check_letters(op, n.inputs, (index, updates, out_grad), ("index", "updates", "out_grad"))
    index, updates, out_grad = _one_dim((index, updates, out_grad))
    merged = merge_specs(n, (n.inputs[0], n.inputs[2]), (index, out_grad), mesh)
    ins, outs = project_all(n, merged, mesh)
    return _result(ins, outs)


register(
    "scatter", scatter_forward, "x: T, index: T, updates: T, overwrite: bool = True",
    scatter_backward, kind="reverse", outputs="out: T",
    forward_name="ScatterInferSpmd", backward_name="ScatterInferSpmdReverse",
)  # fmt: skip
register("scatter_grad", scatter_grad, "index: T, updates: T, out_grad: T, overwrite: bool = True",
         forward_name="ScatterGradInferSpmd")


# -- where ----------------------------------------------------------------------------------------


def _broadcast(op: str, names: Sequence[str], shapes: Sequence[Shape]) -> Shape:
    nd = max(len(s) for s in shapes)
    out: list[int] = []
    for i in range(nd):
        size = 1
        for nm, s in zip(names, shapes):
            j = i - (nd - len(s))
            if j < 0:
                continue
            v = s[j]
            if v == 1:
                continue
            if size == 1:
                size = v
            elif v != size and v >= 0 and size >= 0:
                raise ShapeMismatchError(
                    f"{op}: {nm} (shape {list(s)}) does not broadcast with the others on axis {i} ({v} vs {size})"
                )
            elif size < 0:
                size = v
        out.append(size)
    return tuple(out)


@memo()
def _where_notation(shapes: tuple[Shape, ...], out: Shape, grad: bool) -> Notation:
    nd = len(out)
    letters = ALPHABET[:nd]
    axes = []
    for s in shapes:
        off = nd - len(s)
        axes.append("".join(BROADCAST if (v == 1 and out[off + j] != 1) else letters[off + j]
                            for j, v in enumerate(s)))
    if grad:  # condition, x, y, out_grad -> x_grad, y_grad
        return Notation([*axes, letters], [axes[1], axes[2]])
    return Notation(axes, [letters])


def _where_setup(op: str, condition: DistTensorSpec, x: DistTensorSpec, y: DistTensorSpec,
                 grad: bool) -> tuple[Notation, Shape]:
    shapes = (condition.shape, x.shape, y.shape)
    out = _broadcast(op, ("condition", "x", "y"), shapes)
    _need(op, len(out))
    return _where_notation(shapes, out, grad), out


def _check_out(op: str, name: str, t: DistTensorSpec, want: Shape) -> None:
    if len(t.shape) != len(want):
        raise ShapeMismatchError(f"{op}: {name} has {len(t.shape)} dims, the broadcast shape {list(want)} has "
                                 f"{len(want)}")
    for i, (s, w) in enumerate(zip(t.shape, want)):
        _same(op, s, w, f"{name} has size {s} on axis {i}, the broadcast shape has {w}")


def where_forward(condition: DistTensorSpec, x: DistTensorSpec, y: DistTensorSpec) -> SpmdResult:
    """where (WhereInferSpmd): elementwise over the broadcast shape; condition and x merged."""
    op = "where"
    n, _ = _where_setup(op, condition, x, y, False)
    mesh = common_mesh(op, (condition, x, y))
    condition, x, y = _one_dim((condition, x, y))
    # y's own sharding is not read (Paddle merges condition and x only), except on axes
    # neither of them has
    c_axes, x_axes, y_full = (a or "" for a in n.inputs)
    seen = set(c_axes) | set(x_axes)
    y_axes = "".join(c if c not in seen else BROADCAST for c in y_full)
    merged = merge_specs(n, (c_axes, x_axes, y_axes), (condition, x, y), mesh)
    ins, outs = project_all(n, merged, mesh)
    return _result(ins, outs)


def where_backward(condition: DistTensorSpec, x: DistTensorSpec, y: DistTensorSpec,
                   output: DistTensorSpec) -> SpmdResult:
    """where (WhereInferSpmdReverse): every input from out (broadcast axes replicated)."""
    op = "where"
    n, shape = _where_setup(op, condition, x, y, False)
    _check_out(op, "output", output, shape)
    return reverse_largest(op, n, (condition, x, y), (output,), ("condition", "x", "y", "output"))


def where_grad(condition: DistTensorSpec, x: DistTensorSpec, y: DistTensorSpec,
               out_grad: DistTensorSpec) -> SpmdResult:
    """where_grad (WhereGradInferSpmd): elementwise; a grad is partial SUM over the mesh dims of
    the broadcast axes its input lacks."""
    op = "where_grad"
    n, shape = _where_setup(op, condition, x, y, True)
    _check_out(op, "out_grad", out_grad, shape)
    return forward_largest(op, n, (condition, x, y, out_grad), ("condition", "x", "y", "out_grad"))


register(
    "where", where_forward, "condition: T, x: T, y: T", where_backward, kind="reverse", outputs="output: T",
    forward_name="WhereInferSpmd", backward_name="WhereInferSpmdReverse",
)  # fmt: skip
register("where_grad", where_grad, "condition: T, x: T, y: T, out_grad: T", forward_name="WhereGradInferSpmd")
