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

from collections.abc import Callable
from functools import lru_cache, partial
from typing import Any

from spmdkit.core.dist_attr import ReduceType
from spmdkit.core.errors import InvalidAttributeError, ShapeMismatchError, SpmdError
from spmdkit.core.spec import DistTensorSpec, SpmdResult
from spmdkit.engine.axes import make_attr, unpartial
from spmdkit.engine.declare import Answer, Way, declare, ones
from spmdkit.engine.notation import ALPHABET, BROADCAST, Notation

Shape = tuple[int, ...]
_INDEX = {0: "", 1: "k", 2: "k1"}  # a gather / scatter index: 0-d, [N] or [N, 1]


def _need(n: int) -> None:
    if n > len(ALPHABET):
        raise ShapeMismatchError(f"the tensors need {n} axis letters, at most {len(ALPHABET)} are supported")


def _same(a: int, b: int, what: str) -> None:
    if a != b and a >= 0 and b >= 0:
        raise ShapeMismatchError(what)


def _index_axes(ni: int, allow_0d: bool = True) -> str:
    if ni in _INDEX and (ni or allow_0d):
        return _INDEX[ni]
    raise ShapeMismatchError(f"index must be {'0-d, 1-D or [N, 1]' if allow_0d else '1-D'}, got a {ni}-D tensor")


def _index2(index: DistTensorSpec, allow_0d: bool = True) -> None:
    """An index of rank 2 (or more): [N, 1] only, where a 0-d index is allowed (gather, scatter)."""
    shp = index.shape
    if not (allow_0d and len(shp) == 2 and shp[1] in (1, -1)):
        want = "0-d, 1-D or [N, 1]" if allow_0d else "1-D"
        raise ShapeMismatchError(f"index must be {want}, got shape {list(shp)}")


# -- gather / index_select ----------------------------------------------------------------------


def _x_axis(nd: int, axis: object) -> int:
    if nd == 0:
        raise ShapeMismatchError("x must have at least 1 dim, got a 0-d tensor")
    _need(nd + 1)
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise InvalidAttributeError(f"axis must be an int, got {axis!r}")
    if not -nd <= axis < nd:
        raise InvalidAttributeError(f"axis {axis} is out of range for x of {nd} dims [{-nd}, {nd})")
    return axis + nd if axis < 0 else axis


def gather_notation(kind: str, nd: int, axis: int, ni: int) -> Notation:
    """``abc, k -> akc`` (gather, index_select: x, index -> out; an index [N, 1]: ``k1``; a 0-d
    index: ``abc, _ -> ac``), the gathered axis replicated; the grads ``abc, k, akc -> abc``
    (x_grad partial SUM over k's mesh dims). gather reads each co-shard as its largest mesh
    dim; index_select keeps co-shards, and its grad shards out_grad as x and the index say
    (Paddle 3.3.1 does not read out_grad's own sharding; sound, so kept)."""
    ax = _x_axis(nd, axis)
    idx = _index_axes(ni, not kind.startswith("index_select")).replace("k", ALPHABET[nd])
    x = ALPHABET[:nd]
    out = x[:ax] + idx[:1] + x[ax + 1 :]
    if kind.endswith("grad"):
        sources = (0, 1) if kind == "index_select_grad" else None
        return Notation([x, idx, out], [x], replicated=x[ax], coshard="largest" if kind == "gather_grad" else "keep",
                        sources=sources)  # fmt: skip
    return Notation([x, idx], [out], replicated=x[ax], coshard="largest" if kind == "gather" else "keep")


def _gather_check(x: DistTensorSpec, index: DistTensorSpec, axis: object, allow_0d: bool) -> None:
    """An index of rank 2 or more (after x and axis are checked, in the notation's order)."""
    _x_axis(len(x.shape), axis)
    _index2(index, allow_0d)


_ENV: dict[str, Any] = {"_gather": _gather_check}
_G_KEY = "x, axis, index"


def _gather_way(kind: str, paddle: str, doc: str, **kw: Any) -> Way:
    return Way(partial(gather_notation, kind), key=_G_KEY, letters=True, env=_ENV, paddle=paddle, doc=doc,
               check=f"len(index.shape) < 2 or _gather(x, index, axis, {not kind.startswith('index_select')})",
               **kw)  # fmt: skip


_G_GRAD_DOC = "``abc, k, akc -> abc``; x_grad partial SUM over the index's mesh dims, the gathered axis replicated."
declare(
    "gather", "x: T, index: T, axis: int = 0",
    _gather_way("gather", "GatherInferSpmdBase", "gather (GatherInferSpmdBase): ``abc, k -> akc``, the gathered "
                "axis replicated."),
    reverse=_gather_way("gather", "GatherInferSpmdReverseBase",
                        "gather (GatherInferSpmdReverseBase): x and index from out; out as they produce it."),
    outputs="out: T",
)  # fmt: skip
declare(
    "gather_grad", "x: T, index: T, out_grad: T, axis: int = 0",
    _gather_way("gather_grad", "GatherGradInferSpmd", f"gather_grad (GatherGradInferSpmd): {_G_GRAD_DOC}"),
)
declare(
    "index_select", "x: T, index: T, axis: int = 0",
    _gather_way("index_select", "IndexSelectInferSpmd", "index_select (IndexSelectInferSpmd): ``abc, k -> akc``, "
                "the gathered axis replicated."),
    grad=_gather_way("index_select_grad", "IndexSelectGradInferSpmd",
                     f"index_select_grad (IndexSelectGradInferSpmd): {_G_GRAD_DOC}"),
    grad_signature="x: T, index: T, out_grad: T, axis: int = 0", grad_name="index_select_grad",
)  # fmt: skip


# -- gather_nd / scatter_nd_add -----------------------------------------------------------------


def nd_notation(kind: str, nd: int, ni: int, k: int) -> Notation:
    """x ``XT`` (the indexed axes X, the trailing T), index ``Bq`` (batch B, coordinates q),
    out / updates ``BT``; X and q replicated, each co-shard read as its largest mesh dim::

        gather_nd       XT, Bq -> BT
        gather_nd_grad  XT, Bq, BT -> XT        (x_grad partial SUM over B's mesh dims)
        scatter_nd_add  XT, Bq, BT -> XT        (index and updates merged; out partial SUM over B)
        scatter_nd_add_grad  Bq, BT, XT -> XT, BT
    """
    if ni == 0:
        raise ShapeMismatchError("index must have at least 1 dim (the coordinates), got a 0-d tensor")
    if k < 0:
        raise ShapeMismatchError("index's last dim (the coordinate count) must be known, got -1")
    if k > nd:
        raise ShapeMismatchError(f"index's last dim ({k} coordinates) exceeds x's rank ({nd})")
    _need(nd + ni)
    x = ALPHABET[:nd]
    b = ALPHABET[nd : nd + ni - 1]
    idx = b + ALPHABET[nd + ni - 1]
    bt = b + x[k:]
    rep = x[:k] + idx[-1]
    if kind == "gather_nd":
        return Notation([x, idx], [bt], replicated=rep, coshard="largest")
    if kind == "gather_nd_grad":
        return Notation([x, idx, bt], [x], replicated=rep, coshard="largest")
    if kind == "scatter_nd_add":
        return Notation([x, idx, bt], [x], replicated=rep, coshard="largest", sources=(1, 2))
    if kind == "scatter_nd_add_rev":
        return Notation([x, idx, bt], [x], replicated=rep, coshard="largest")
    return Notation([idx, bt, x], [x, bt], replicated=rep, coshard="largest")  # scatter_nd_add_grad


def _trailing(name: str, t: DistTensorSpec, index: DistTensorSpec, x: DistTensorSpec) -> None:
    """``t`` (out, updates) shaped ``index.shape[:-1] + x.shape[k:]``."""
    if not index.shape or not 0 <= index.shape[-1] <= len(x.shape):
        return  # the notation names what is wrong with the index
    k = index.shape[-1]
    want = (*index.shape[:-1], *x.shape[k:])
    if len(t.shape) != len(want):
        raise ShapeMismatchError(
            f"{name} has {len(t.shape)} dims, expected index.shape[:-1] + x.shape[{k}:] = {list(want)}"
        )
    for i, (s, w) in enumerate(zip(t.shape, want)):
        _same(s, w, f"{name} has size {s} on axis {i}, expected {w} (index.shape[:-1] + x.shape[{k}:])")


def _batch_sum(ins: Any, outs: Any, *args: object) -> Answer:
    """scatter_nd_add: where the updates' batch B is sharded, each rank adds its own updates to
    its share of x, so x is asked partial SUM over B's mesh dims (out is partial over them)."""
    dims = {d for e in ins[1].dims_mapping[:-1] for d in ((e,) if isinstance(e, int) else e) if d >= 0}
    if not dims:
        return ins, outs
    x = ins[0]
    pt = dict(x.partial)
    for d in dims:
        pt[d] = ReduceType.SUM
    return (make_attr(x.mesh, x.dims_mapping, tuple(sorted(pt.items()))), *ins[1:]), outs


def _x_grad_whole(ins: Any, outs: Any, *args: object) -> Answer:
    """scatter_nd_add_grad: x_grad is out_grad itself, nothing is summed over B."""
    return ins, (unpartial(outs[0]), outs[1])


_ENV.update(_trailing=_trailing)


def _nd_way(kind: str, paddle: str, doc: str, check: str = "", x: str = "x", **kw: Any) -> Way:
    """A gather_nd / scatter_nd_add mode keyed by the ranks of x (``x``: its parameter) and index
    and the coordinate count; ``check``: the tensor shaped ``index.shape[:-1] + x.shape[k:]``."""
    t = f"_trailing({check!r}, {check}, index, {x})" if check else None
    return Way(partial(nd_notation, kind), key=f"{x}, index, (index.shape[-1] if index.shape else 0)", letters=True,
               env=_ENV, check=t, paddle=paddle, doc=doc, **kw)  # fmt: skip


declare(
    "gather_nd", "x: T, index: T",
    _nd_way("gather_nd", "GatherNdInferSpmd",
            "gather_nd (GatherNdInferSpmd): ``XT, Bq -> BT``; indexed axes and coordinates replicated."),
    reverse=_nd_way("gather_nd", "GatherNdInferSpmdReverse",
                    "gather_nd (GatherNdInferSpmdReverse): B to the index, T to x, from out.", "out"),
    outputs="out: T",
)  # fmt: skip
declare(
    "gather_nd_grad", "x: T, index: T, out_grad: T",
    _nd_way("gather_nd_grad", "GatherNdGradInferSpmd", "gather_nd_grad (GatherNdGradInferSpmd): ``XT, Bq, BT -> XT``; "
            "x_grad partial SUM over B's mesh dims.", "out_grad"),
)  # fmt: skip
declare(
    "scatter_nd_add", "x: T, index: T, updates: T",
    _nd_way("scatter_nd_add", "ScatterNdAddInferSpmd", "scatter_nd_add (ScatterNdAddInferSpmd): ``XT, Bq, BT -> "
            "XT``; a sharded batch B makes out partial SUM and asks for x partial SUM over the same mesh dims.",
            "updates", post=_batch_sum),
    reverse=_nd_way("scatter_nd_add_rev", "ScatterNdAddInferSpmdReverse", "scatter_nd_add "
                    "(ScatterNdAddInferSpmdReverse): T from out to x and updates; X, B replicated.", "updates"),
    outputs="out: T",
)  # fmt: skip
declare(
    "scatter_nd_add_grad", "index: T, updates: T, out_grad: T",
    _nd_way("scatter_nd_add_grad", "", "scatter_nd_add_grad: ``Bq, BT, XT -> XT, BT``; x_grad = out_grad, "
            "updates_grad = gather_nd(out_grad).", "updates", "out_grad", post=_x_grad_whole),
)


# -- scatter --------------------------------------------------------------------------------------


def scatter_notation(kind: str, nd: int, ni: int) -> Notation:
    """``zT, b, bT -> zT`` (x, index [N], updates [N, ...] -> out; the rows z and the updates'
    batch b replicated: overwriting rows cannot be summed); scatter merges index and updates
    only (x takes out's sharding); the grad ``b, bT, zT -> zT, bT`` merges index and out_grad."""
    if nd == 0:
        raise ShapeMismatchError(f"{'out_grad' if kind == 'grad' else 'x'} must have at least 1 dim, got a 0-d tensor")
    _need(nd + 1)
    t, z, b = ALPHABET[: nd - 1], ALPHABET[nd - 1], ALPHABET[nd]
    idx = _index_axes(ni).replace("k", b)
    upd = (b + t) if idx else t
    if kind == "grad":  # index, updates, out_grad -> x_grad, updates_grad
        return Notation([idx, upd, z + t], [z + t, upd], replicated=z + b, coshard="largest", sources=(0, 2))
    return Notation([z + t, idx, upd], [z + t], replicated=z + b, coshard="largest",
                    sources=(1, 2) if kind == "forward" else None)  # fmt: skip


def _scatter_check(x: DistTensorSpec, index: DistTensorSpec, updates: DistTensorSpec, overwrite: object,
                   xname: str) -> None:
    """updates shaped ``[len(index), *x.shape[1:]]`` (``x.shape[1:]`` for a 0-d index)."""
    if not isinstance(overwrite, bool):
        raise InvalidAttributeError(f"overwrite must be a bool, got {overwrite!r}")
    if not x.shape:
        return  # the notation says so
    if len(index.shape) > 1:
        _index2(index)
    want = (index.shape[0], *x.shape[1:]) if index.shape else tuple(x.shape[1:])
    if len(updates.shape) != len(want):
        raise ShapeMismatchError(
            f"updates has {len(updates.shape)} dims, expected {len(want)} (shape {list(want)}: "
            f"index's length + {xname}.shape[1:])"
        )
    for i, (s, w) in enumerate(zip(updates.shape, want)):
        _same(s, w, f"updates has size {s} on axis {i}, expected {w}")


_ENV.update(_scatter=_scatter_check)
_SC_SIG = "x: T, index: T, updates: T, overwrite: bool = True"
declare(
    "scatter", _SC_SIG,
    Way(partial(scatter_notation, "forward"), key="x, index", letters=True, env=_ENV,
        check="_scatter(x, index, updates, overwrite, 'x')", paddle="ScatterInferSpmd",
        doc="scatter (ScatterInferSpmd): ``zT, b, bT -> zT``; rows and the updates' batch replicated, the "
            "trailing axes from the updates (x takes out's sharding)."),
    reverse=Way(partial(scatter_notation, "reverse"), key="x, index", letters=True, env=_ENV,
                check="_scatter(x, index, updates, overwrite, 'x')", paddle="ScatterInferSpmdReverse",
                doc="scatter (ScatterInferSpmdReverse): the trailing axes from out; rows and batch replicated."),
    outputs="out: T",
)  # fmt: skip
declare(
    "scatter_grad", "index: T, updates: T, out_grad: T, overwrite: bool = True",
    Way(partial(scatter_notation, "grad"), key="out_grad, index", letters=True, env=_ENV,
        check="_scatter(out_grad, index, updates, overwrite, 'out_grad')", paddle="ScatterGradInferSpmd",
        doc="scatter_grad (ScatterGradInferSpmd): ``b, bT, zT -> zT, bT``; the trailing axes from out_grad."),
)  # fmt: skip


# -- where ----------------------------------------------------------------------------------------


@lru_cache(maxsize=4096)
def where_notation(grad: bool, nc: int, nx: int, ny: int, mc: int, mx: int, my: int) -> Notation:
    """Elementwise with numpy broadcasting over condition, x, y (ranks ``n*``, size-1 axes
    ``m*``): a size-1 axis is ``1`` (never sharded) unless every tensor has size 1 there; the
    grad ``cond, x, y, out_grad -> x_grad, y_grad`` (a grad partial SUM over the mesh dims of the
    broadcast axes its input lacks)."""
    nd = max(nc, nx, ny)
    _need(nd)
    letters = ALPHABET[:nd]
    ranks, masks = (nc, nx, ny), (mc, mx, my)
    one = [all((m >> (i - nd + n)) & 1 for n, m in zip(ranks, masks) if i >= nd - n) for i in range(nd)]
    axes = ["".join(BROADCAST if (m >> j) & 1 and not one[nd - n + j] else letters[nd - n + j] for j in range(n))
            for n, m in zip(ranks, masks)]  # fmt: skip
    if grad:
        return Notation([*axes, letters], [axes[1], axes[2]], coshard="largest")
    return Notation(axes, [letters], coshard="largest")


def _broadcast(condition: DistTensorSpec, x: DistTensorSpec, y: DistTensorSpec,
               out: DistTensorSpec | None = None, oname: str = "") -> None:
    """condition, x and y broadcast together (numpy's rules; -1 matches any size), onto
    ``out``'s shape where given."""
    shapes = (condition.shape, x.shape, y.shape)
    nd = max(len(s) for s in shapes)
    want: list[int] = []
    for i in range(nd):
        size = 1
        for nm, s in zip(("condition", "x", "y"), shapes):
            j = i - (nd - len(s))
            v = s[j] if j >= 0 else 1
            if v == 1:
                continue
            if size == 1 or size < 0:
                size = v
            elif v != size and v >= 0:
                raise ShapeMismatchError(
                    f"{nm} (shape {list(s)}) does not broadcast with the others on axis {i} ({v} vs {size})"
                )
        want.append(size)
    if out is None:
        return
    if len(out.shape) != nd:
        raise ShapeMismatchError(f"{oname} has {len(out.shape)} dims, the broadcast shape {want} has {nd}")
    for i, (v, w) in enumerate(zip(out.shape, want)):
        _same(v, w, f"{oname} has size {v} on axis {i}, the broadcast shape has {w}")


_ENV.update(_broadcast=_broadcast)
_W_KEY = "condition, x, y, ones(condition), ones(x), ones(y)"


@lru_cache(maxsize=4096)
def _x_letters(*key: int) -> tuple[int, ...]:
    """The axes of y whose letters condition or x carries."""
    c, x, y = where_notation(False, *key).inputs
    seen = set(c or "") | set(x or "")
    return tuple(j for j, ch in enumerate(y or "") if ch in seen)


def _y_unread(fn: Callable[..., SpmdResult], signature: str, outputs: Any) -> Callable[..., SpmdResult]:
    """where's forward: Paddle merges condition and x; y's own sharding is read only on the axes
    neither of them has (its other entries are read as unsharded before the merge)."""

    def where(condition: DistTensorSpec, x: DistTensorSpec, y: DistTensorSpec) -> SpmdResult:
        a = y.dist_attr
        dm = a.dims_mapping
        if dm.count(-1) < len(dm):
            try:
                axes = _x_letters(len(condition.shape), len(x.shape), len(y.shape), ones(condition), ones(x), ones(y))
            except SpmdError:
                return fn(condition, x, y)  # its checks say what is wrong
            if any(dm[j] != -1 for j in axes):
                cleared = tuple(-1 if j in axes else e for j, e in enumerate(dm))
                y = DistTensorSpec(y.shape, make_attr(a.mesh, cleared, a.partial))
        return fn(condition, x, y)

    where.__doc__ = fn.__doc__
    return where


def _where_way(paddle: str, doc: str, grad: bool, out: str = "", **kw: Any) -> Way:
    return Way(partial(where_notation, grad), key=_W_KEY, env=_ENV, paddle=paddle, doc=doc,
               check=f"condition.shape == x.shape == y.shape{f' == {out}.shape' if out else ''} or "
                     f"_broadcast(condition, x, y{f', {out}, {out!r}' if out else ''})", **kw)  # fmt: skip


declare(
    "where", "condition: T, x: T, y: T",
    _where_way("WhereInferSpmd", "where (WhereInferSpmd): elementwise over the broadcast shape; condition and x "
               "merged (y's own sharding is read only on the axes neither of them has).", False, wrap=_y_unread),
    reverse=_where_way("WhereInferSpmdReverse", "where (WhereInferSpmdReverse): every input from out (broadcast "
                       "axes replicated).", False, "output", letters=True),
    outputs="output: T",
)  # fmt: skip
declare(
    "where_grad", "condition: T, x: T, y: T, out_grad: T",
    _where_way("WhereGradInferSpmd", "where_grad (WhereGradInferSpmd): elementwise; a grad is partial SUM over the "
               "mesh dims of the broadcast axes its input lacks.", True, "out_grad", letters=True),
)  # fmt: skip
