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
from spmdkit.core.errors import ShapeMismatchError, SpmdError
from spmdkit.core.spec import DistTensorSpec, SpmdResult
from spmdkit.engine.axes import make_attr, normalize_axis, unpartial
from spmdkit.engine.declare import Answer, Way, declare, ones
from spmdkit.engine.facts import facts
from spmdkit.engine.notation import ALPHABET, BROADCAST, Coshard, Notation, letters_for
from spmdkit.engine.outshape import Args, Expect, UnknownShape, axis_of, broadcast, same
from spmdkit.ops._cost import copy, lookup, one_per_element, scatter_grad

# Every mode but where's forward checks per call that each letter has one size over its tensors
# (``letters=True``): the shapes of out / out_grad / updates against x and the index.


def _index(ni: int, tail: tuple[int, ...], allow_0d: bool = True) -> str:
    """A gather / scatter index's letters: 0-d ``""``, [N] ``k``, [N, 1] ``k1`` (``tail``: its
    sizes after the first); index_select's must be 1-D."""
    if ni == 1 or (allow_0d and (ni == 0 or tail in ((1,), (-1,)))):
        return ("", "k", "k1")[ni]
    shape = f" of shape [N, {', '.join(map(str, tail))}]" if ni > 1 else ""
    raise ShapeMismatchError(f"index must be {'0-d, 1-D or [N, 1]' if allow_0d else '1-D'}, got a {ni}-D index{shape}")


# -- gather / index_select ----------------------------------------------------------------------


def gather_notation(kind: str, nd: int, axis: int, ni: int, tail: tuple[int, ...]) -> Notation:
    """gather and its grad read each co-shard as its largest mesh dim; index_select keeps
    co-shards, and its grad shards out_grad as x and the index say (Paddle 3.3.1 does not read
    out_grad's own sharding; sound, so kept)."""
    if nd == 0:
        raise ShapeMismatchError("x must have at least 1 dim, got a 0-d tensor")
    x = letters_for(nd + 1)[:nd]
    ax = normalize_axis("", axis, nd, tensor="x")
    idx = _index(ni, tail, not kind.startswith("index_select")).replace("k", ALPHABET[nd])
    out = x[:ax] + idx[:1] + x[ax + 1 :]
    coshard = Coshard.LARGEST if kind in ("gather", "gather_grad") else Coshard.KEEP
    if kind.endswith("grad"):
        sources = (0, 1) if kind == "index_select_grad" else None
        return Notation([x, idx, out], [x], replicated=x[ax], coshard=coshard, sources=sources)
    return Notation([x, idx], [out], replicated=x[ax], coshard=coshard)


def _gather(kind: str, paddle: str, doc: str) -> Way:
    key = "x, axis, index, index.shape[1:]"
    return Way(partial(gather_notation, kind), key=key, letters=True, paddle=paddle, doc=f"{kind} ({paddle}): {doc}")


_G_GRAD = "``abc, k, akc -> abc``; x_grad partial SUM over the index's mesh dims, the gathered axis replicated."
_G_SIG = "x: T, index: T, axis: int = 0"
_G_GRAD_SIG = "x: T, index: T, out_grad: T, axis: int = 0"
declare(
    "gather", _G_SIG, _gather("gather", "GatherInferSpmdBase", "``abc, k -> akc``, the gathered axis replicated."),
    reverse=_gather("gather", "GatherInferSpmdReverseBase", "x and index from out; out as they produce it."),
    outputs="out: T",
)  # fmt: skip
declare("gather_grad", _G_GRAD_SIG, _gather("gather_grad", "GatherGradInferSpmd", _G_GRAD))
declare(
    "index_select", _G_SIG,
    _gather("index_select", "IndexSelectInferSpmd", "``abc, k -> akc``, the gathered axis replicated."),
    grad=_gather("index_select_grad", "IndexSelectGradInferSpmd", _G_GRAD),
    grad_signature=_G_GRAD_SIG, grad_name="index_select_grad",
)  # fmt: skip


# -- gather_nd / scatter_nd_add -----------------------------------------------------------------


def nd_notation(kind: str, nd: int, ni: int, k: int) -> Notation:
    """x ``XT``, index ``Bq``, out / updates ``BT`` (module docstring), each co-shard read as its
    largest mesh dim; ``k``: the coordinate count."""
    if ni == 0:
        raise ShapeMismatchError("index must have at least 1 dim (the coordinates), got a 0-d tensor")
    if k < 0:
        raise ShapeMismatchError("index's last dim (the coordinate count) must be known, got -1")
    if k > nd:
        raise ShapeMismatchError(f"index's last dim ({k} coordinates) exceeds x's rank ({nd})")
    x = letters_for(nd + ni)[:nd]
    b = ALPHABET[nd : nd + ni - 1]
    idx = b + ALPHABET[nd + ni - 1]
    bt = b + x[k:]
    nt = partial(Notation, replicated=x[:k] + idx[-1], coshard=Coshard.LARGEST)
    if kind == "gather_nd":
        return nt([x, idx], [bt])
    if kind == "scatter_nd_add_grad":
        return nt([idx, bt, x], [x, bt])
    return nt([x, idx, bt], [x], sources=(1, 2) if kind == "scatter_nd_add" else None)  # and the grad / reverse


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


def _nd(kind: str, paddle: str, doc: str, x: str = "x", **kw: Any) -> Way:
    """A mode keyed by the ranks of x (``x``: its parameter) and index and the coordinate count."""
    return Way(partial(nd_notation, kind), key=f"{x}, index, (index.shape[-1] if index.shape else 0)", letters=True,
               paddle=paddle, doc=doc, **kw)  # fmt: skip


declare(
    "gather_nd", "x: T, index: T",
    _nd("gather_nd", "GatherNdInferSpmd",
        "gather_nd (GatherNdInferSpmd): ``XT, Bq -> BT``; indexed axes and coordinates replicated."),
    reverse=_nd("gather_nd", "GatherNdInferSpmdReverse",
                "gather_nd (GatherNdInferSpmdReverse): B to the index, T to x, from out."),
    outputs="out: T",
)  # fmt: skip
declare(
    "gather_nd_grad", "x: T, index: T, out_grad: T",
    _nd("gather_nd_grad", "GatherNdGradInferSpmd",
        "gather_nd_grad (GatherNdGradInferSpmd): ``XT, Bq, BT -> XT``; x_grad partial SUM over B's mesh dims."),
)  # fmt: skip
declare(
    "scatter_nd_add", "x: T, index: T, updates: T",
    _nd("scatter_nd_add", "ScatterNdAddInferSpmd", "scatter_nd_add (ScatterNdAddInferSpmd): ``XT, Bq, BT -> XT``; "
        "a sharded batch B makes out partial SUM and asks for x partial SUM over the same mesh dims.", post=_batch_sum),
    reverse=_nd("scatter_nd_add_rev", "ScatterNdAddInferSpmdReverse",
                "scatter_nd_add (ScatterNdAddInferSpmdReverse): T from out to x and updates; X, B replicated."),
    outputs="out: T",
)  # fmt: skip
declare(
    "scatter_nd_add_grad", "index: T, updates: T, out_grad: T",
    _nd("scatter_nd_add_grad", "", "scatter_nd_add_grad: ``Bq, BT, XT -> XT, BT``; x_grad = out_grad, "
        "updates_grad = gather_nd(out_grad).", "out_grad", post=_x_grad_whole),
)


# -- scatter --------------------------------------------------------------------------------------


def scatter_notation(kind: str, nd: int, ni: int, tail: tuple[int, ...]) -> Notation:
    """``zT, b, bT -> zT``; the grad ``b, bT, zT -> zT, bT`` merges index and out_grad."""
    if nd == 0:
        raise ShapeMismatchError(f"{'out_grad' if kind == 'grad' else 'x'} must have at least 1 dim, got a 0-d tensor")
    t, z, b = letters_for(nd + 1)[: nd - 1], ALPHABET[nd - 1], ALPHABET[nd]
    idx = _index(ni, tail).replace("k", b)
    upd = (b + t) if idx else t
    if kind == "grad":  # index, updates, out_grad -> x_grad, updates_grad
        return Notation([idx, upd, z + t], [z + t, upd], replicated=z + b, coshard=Coshard.LARGEST, sources=(0, 2))
    return Notation([z + t, idx, upd], [z + t], replicated=z + b, coshard=Coshard.LARGEST,
                    sources=(1, 2) if kind == "forward" else None)  # fmt: skip


def _scatter(kind: str, x: str, paddle: str, doc: str) -> Way:
    key = f"{x}, index, index.shape[1:]"
    return Way(partial(scatter_notation, kind), key=key, letters=True, paddle=paddle, doc=doc)


_SC_ATTR = "overwrite: bool = True"
declare(
    "scatter", f"x: T, index: T, updates: T, {_SC_ATTR}",
    _scatter("forward", "x", "ScatterInferSpmd", "scatter (ScatterInferSpmd): ``zT, b, bT -> zT``; rows and the "
             "updates' batch replicated, the trailing axes from the updates (x takes out's sharding)."),
    reverse=_scatter("reverse", "x", "ScatterInferSpmdReverse", "scatter (ScatterInferSpmdReverse): the trailing "
                     "axes from out; rows and batch replicated."),
    outputs="out: T",
)  # fmt: skip
declare(
    "scatter_grad", f"index: T, updates: T, out_grad: T, {_SC_ATTR}",
    _scatter("grad", "out_grad", "ScatterGradInferSpmd", "scatter_grad (ScatterGradInferSpmd): "
             "``b, bT, zT -> zT, bT``; the trailing axes from out_grad."),
)  # fmt: skip


# -- where ----------------------------------------------------------------------------------------


@lru_cache(maxsize=4096)
def where_notation(grad: bool, nc: int, nx: int, ny: int, mc: int, mx: int, my: int) -> Notation:
    """Ranks ``n*``, size-1 axes ``m*`` of condition, x, y: a size-1 axis is ``1`` (never
    sharded) unless every tensor has size 1 there."""
    nd = max(nc, nx, ny)
    letters = letters_for(nd)
    ranks, masks = (nc, nx, ny), (mc, mx, my)
    one = [all((m >> (i - nd + n)) & 1 for n, m in zip(ranks, masks) if i >= nd - n) for i in range(nd)]
    axes = ["".join(BROADCAST if (m >> j) & 1 and not one[nd - n + j] else letters[nd - n + j] for j in range(n))
            for n, m in zip(ranks, masks)]  # fmt: skip
    if grad:
        return Notation([*axes, letters], [axes[1], axes[2]], coshard=Coshard.LARGEST)
    return Notation(axes, [letters], coshard=Coshard.LARGEST)


def _broadcast(condition: DistTensorSpec, x: DistTensorSpec, y: DistTensorSpec) -> None:
    """condition, x and y broadcast together (numpy's rules; -1 matches any size)."""
    nd = max(len(condition.shape), len(x.shape), len(y.shape))
    for i in range(nd):
        size = 1
        for nm, s in (("condition", condition.shape), ("x", x.shape), ("y", y.shape)):
            v = s[i - nd + len(s)] if i >= nd - len(s) else 1
            if v == 1:
                continue
            if size == 1 or size < 0:
                size = v
            elif v != size and v >= 0:
                raise ShapeMismatchError(
                    f"{nm} (shape {list(s)}) does not broadcast with the others on axis {i} ({v} vs {size})"
                )


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


def _where_check(condition: DistTensorSpec, x: DistTensorSpec, y: DistTensorSpec) -> None:
    if not condition.shape == x.shape == y.shape:
        _broadcast(condition, x, y)


_W_KEY = "condition, x, y, ones(condition), ones(x), ones(y)"
declare(
    "where", "condition: T, x: T, y: T",
    Way(partial(where_notation, False), key=_W_KEY, check=_where_check, wrap=_y_unread, paddle="WhereInferSpmd",
        doc="where (WhereInferSpmd): elementwise over the broadcast shape; condition and x merged (y's own "
            "sharding is read only on the axes neither of them has)."),
    reverse=Way(partial(where_notation, False), key=_W_KEY, letters=True, paddle="WhereInferSpmdReverse",
                doc="where (WhereInferSpmdReverse): every input from out (broadcast axes replicated)."),
    outputs="output: T",
)  # fmt: skip
declare(
    "where_grad", "condition: T, x: T, y: T, out_grad: T",
    Way(partial(where_notation, True), key=_W_KEY, letters=True, paddle="WhereGradInferSpmd",
        doc="where_grad (WhereGradInferSpmd): elementwise; a grad is partial SUM over the mesh dims of the "
            "broadcast axes its input lacks."),
)  # fmt: skip


# -- output shapes / grads ----------------------------------------------------------------------


def _gather_shape(a: Args) -> list[Expect]:
    """x with the axis replaced by the index's length (a 0-D, 1-D or [N, 1] index)."""
    x, idx = a.s("x"), a.s("index")
    if len(idx) == 2 and idx[1] == 1:
        idx = (idx[0],)
    elif len(idx) > 1:
        raise UnknownShape
    ax = axis_of(a.a("axis", 0), len(x))
    return [x[:ax] + idx + x[ax + 1:]]


def _index_select_shape(a: Args) -> list[Expect]:
    x, idx = a.s("x"), a.s("index")
    ax = axis_of(a.a("axis", 0), len(x))
    if len(idx) != 1:
        raise UnknownShape
    return [x[:ax] + idx + x[ax + 1:]]


def _gather_nd_shape(a: Args) -> list[Expect]:
    x, idx = a.s("x"), a.s("index")
    if not idx or idx[-1] > len(x):
        raise UnknownShape
    return [idx[:-1] + x[idx[-1]:]]


def _where_shape(a: Args) -> list[Expect]:
    return [broadcast(a.s("condition"), a.s("x"), a.s("y"))]


facts("gather", shape=_gather_shape)
facts("index_select", shape=_index_select_shape, grad="index_select_grad", wrt=("x",))
facts("gather_nd", shape=_gather_nd_shape, grad="gather_nd_grad", wrt=("x",))
facts("scatter", "scatter_nd_add", shape=same)
facts("where", shape=_where_shape, grad="where_grad", wrt=("x", "y"))
facts("scatter_grad", "scatter_nd_add_grad", grad_like=("=", "updates"))
facts("where_grad", grad_like=("x", "y"))


# -- cost

facts("gather", "gather_nd", "index_select", cost=lookup)
facts("gather_grad", "gather_nd_grad", "index_select_grad", cost=scatter_grad)
facts("scatter", "scatter_grad", "scatter_nd_add", "scatter_nd_add_grad", cost=copy)
facts("where", "where_grad", cost=one_per_element)
