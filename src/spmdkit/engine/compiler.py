"""Compiled plans: a notation and its policy, specialised once per key, run on int tuples.

:func:`compile_plan` turns a :class:`~spmdkit.engine.notation.Notation` (letters, flags and
policy), a direction (``"forward"``: merge the inputs; ``"backward"``: merge the outputs, as
Paddle's reverse rules do) and a key of what changes the plan (for ``size1="broadcast"`` the
size-1 axes of each input) into a :class:`RulePlan`: letters become ints, every policy a flag or
an int tuple, every tensor a tuple of letter ids. :func:`run` answers a call from the plan
with lists indexed by letter, no dicts; :func:`infer` adds the projection onto every tensor.
The answer is :func:`spmdkit.engine.merge.reference_merge`'s (tests/test_engine_compiled.py
holds them equal on random cases). A plan's fast path is straight-line Python generated here
(:func:`_generate`, in named steps) and made a function by :func:`spmdkit.engine.codegen.define`.
:func:`merge_letters` (the default policy on plain tuples) and :func:`einsum_forward` (a
notation's forward answer) are the plans' two direct uses.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import lru_cache
from typing import Any

from spmdkit.core.dist_attr import DimsMapping, Entry, Partial, ReduceType, TensorDistAttr
from spmdkit.core.errors import ShapeMismatchError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.spec import DistTensorSpec
from spmdkit.engine.axes import largest_mesh_dim, mesh_size
from spmdkit.engine.codegen import define
from spmdkit.engine.memo import memo
from spmdkit.engine.merge import kept_partial, merge_weight
from spmdkit.engine.notation import (
    BROADCAST,
    Conflict,
    Coshard,
    Notation,
    Order,
    PartialMerge,
    ReplicatedClaims,
    Sizes,
    Taken,
    UnitAxes,
)
from spmdkit.engine.tensors import attr_as, check_letters, common_mesh

_make = TensorDistAttr._make
#: (d,) for a mesh dim d: no tuple built per entry
_ONE = tuple((d,) for d in range(64))

_CONFLICT = {Conflict.WEIGHT: 0, Conflict.FIRST: 1, Conflict.UNION: 2, Conflict.REPLICATE: 3, Conflict.HEAVIEST: 4,
             Conflict.ALIGN: 5}
#: conflict="align": a partial placement's code (-3 - index), apart from letters (>= 0),
#: size-1 axes (-2) and nothing (-1)
_RT = {r: -3 - i for i, r in enumerate(ReduceType)}


class RulePlan:
    """A notation compiled for one direction and key (see the module docstring)."""

    __slots__ = (
        "align_letters", "block", "chain_out", "chain_src", "chains", "conflict", "fast", "fast_letters", "groups",
        "in_axes", "in_letters", "keep_partial", "largest", "letter_ids", "n", "notation", "order_kind", "out_axes",
        "out_missing", "prune", "rep", "s1claim", "size_src", "sizes_known", "src", "taken_keep", "taken_letter",
        "uneven", "unit",
    )  # fmt: skip

    def __init__(self, notation: Notation, direction: str, mask: tuple[int, ...]) -> None:
        nt = notation
        letters = nt.letters
        lid = {c: i for i, c in enumerate(letters)}
        self.letter_ids = lid
        n = len(letters)
        self.notation = nt
        self.n = n

        def ids(axes: str) -> tuple[int, ...]:
            return tuple(-1 if c == BROADCAST else lid[c] for c in axes)

        merged: tuple[str | None, ...] = nt.inputs if direction == "forward" else nt.outputs
        if direction == "forward" and nt.sources is not None:  # the other inputs are projected only
            merged = tuple(a if ti in nt.sources else None for ti, a in enumerate(merged))
        self.src = tuple((ti, ids(a)) for ti, a in enumerate(merged) if a is not None)
        self.rep = tuple(c in nt.replicated for c in letters)
        self.block = nt.replicated_claims is ReplicatedClaims.BLOCK and any(self.rep)
        self.largest = nt.coshard is Coshard.LARGEST
        self.unit = nt.unit_axes is UnitAxes.CLAIM
        self.taken_letter = nt.taken is Taken.LETTER
        self.taken_keep = nt.taken is Taken.KEEP
        self.conflict = _CONFLICT[nt.conflict]
        self.keep_partial = nt.partial is not PartialMerge.REPLICATE
        # conflict="align": the letters a mesh dim may go to (carried by a merged tensor)
        self.align_letters = tuple(sorted({a for _, t in self.src for a in t if a >= 0 and not self.rep[a]}))
        self.prune = tuple(nt.prunes(c) for c in letters)
        self.uneven = tuple(c in nt.uneven for c in letters)
        self.s1claim = tuple(c in nt.size1_claims for c in letters)
        # letter sizes: (tensor index, axis) sources in the order they are read
        self.sizes_known = nt.sizes is Sizes.KNOWN
        if self.sizes_known:
            every = list(enumerate(nt.inputs))
        else:
            every = list(enumerate(merged))
        src: list[list[tuple[int, int]]] = [[] for _ in range(n)]
        for ti, a in every:
            if a is not None:
                for i, c in enumerate(a):
                    if c != BROADCAST:
                        src[lid[c]].append((ti, i))
        self.size_src = tuple(tuple(s) for s in src)
        # flatten chains (letter ids) and where their first letter sits on every tensor
        # (inputs, then outputs: (tensor index, axis))
        self.chains = tuple(tuple(lid[c] for c in chain) for chain in nt.flatten)
        tensors = (*nt.inputs, *nt.outputs)
        self.chain_src = tuple(
            tuple((ti, i) for ti, a in enumerate(tensors) if a is not None for i, c in enumerate(a) if c == chain[0])
            for chain in nt.flatten
        )
        self.chain_out = any(ti >= len(nt.inputs) for cs in self.chain_src for ti, _ in cs)
        # the order of resolution
        order = nt.order
        groups: list[tuple[int, tuple[int, ...]]] = []
        if order is Order.CLAIM:
            self.order_kind = 0
        elif order is Order.NOTATION:
            self.order_kind = 1
        else:
            self.order_kind = 2
            named = {c for g in order if g != "*" for c in g.lstrip(">")}
            for g in order:
                if g == "*":
                    groups.append((0, tuple(lid[c] for c in letters if c not in named)))
                elif g.startswith(">"):
                    groups.append((1, tuple(lid[c] for c in g[1:] if c in lid)))
                else:
                    groups.append((0, tuple(lid[c] for c in g if c in lid)))
        self.groups = tuple(groups)
        # backward: a letter no input carries shards nothing
        have = set("".join(a for a in nt.inputs if a))
        self.in_letters = tuple(c in have for c in letters) if direction == "backward" else None
        # projections; an input's size-1 axes (mask bits) shard nothing under size1="broadcast"
        in_axes: list[tuple[int, ...] | None] = []
        for j, a in enumerate(nt.inputs):
            if a is None:
                in_axes.append(None)
                continue
            m = mask[j] if mask else 0
            in_axes.append(tuple(-1 if (m >> i) & 1 else x for i, x in enumerate(ids(a))))
        self.in_axes = tuple(in_axes)
        self.out_axes = tuple(None if a is None else ids(a) for a in nt.outputs)
        # the letters an output lacks; a chain's other letters and replicated letters shard
        # nothing, so never make it partial
        never = {c for chain in nt.flatten for c in chain[1:]} | nt.replicated
        self.out_missing = tuple(
            None if a is None else tuple((lid[c], nt.reduce_type(c)) for c in letters if c not in a and c not in never)
            for a in nt.outputs
        )
        size = sum(len(a) for a in (*nt.inputs, *nt.outputs) if a)
        self.fast = _generate(self, direction) if size <= _EAGER else _lazy(self, direction)
        self.fast_letters: Any = None  # merge_letters' generated code, made on first use


#: a plan labelling more axes than this generates its code on its second use, not when compiled:
#: compiling the straight-line code of a long list of tensors (an AMP op over a model's grads)
#: costs far more than the general path of the one call that may be all the plan ever answers
_EAGER = 96


def _lazy(p: RulePlan, direction: str) -> Any:
    """A stand-in for the generated code of a big plan: declines its first call (the general
    path answers it), generates the code on the second."""

    def first(inputs: Any, outputs: Any, mesh: Any, out_shapes: Any = None) -> None:
        p.fast = second
        return None

    def second(inputs: Any, outputs: Any, mesh: Any, out_shapes: Any = None) -> Any:
        p.fast = _generate(p, direction)
        return p.fast(inputs, outputs, mesh, out_shapes)

    return first


_plans: dict[tuple[Notation, str, tuple[int, ...]], RulePlan] = {}

#: while :func:`traced` is active: the op of every call the engine answers
_trace: list[str] | None = None


@contextmanager
def traced() -> Iterator[list[str]]:
    """Record the op name of every call answered through a compiled plan (:func:`infer`, and
    ``merge_letters`` as ``"merge_letters"``) while active: a test can assert a rule is
    answered by the engine (with the result cache off, ``set_cache_enabled(False)``, which also
    turns off the memo tables: a cached answer reaches no rule)."""
    global _trace
    prev, _trace = _trace, []
    try:
        yield _trace
    finally:
        _trace = prev


def note(op: str) -> None:
    """Record ``op`` while :func:`traced` is active."""
    if _trace is not None:
        _trace.append(op)


def compile_plan(notation: Notation, direction: str = "forward", mask: tuple[int, ...] = ()) -> RulePlan:
    """The plan of ``notation`` for ``direction`` and the inputs' size-1 ``mask`` (one bit per
    axis per input; ``()`` for none), compiled once."""
    key = (notation, direction, mask)
    p = _plans.get(key)
    if p is None:
        if len(_plans) > 65536:
            _plans.clear()
        p = _plans[key] = RulePlan(notation, direction, mask)
    return p


def run(
    p: RulePlan,
    dms: Sequence[DimsMapping | None],
    shapes: Sequence[Sequence[int] | None],
    all_shapes: Sequence[Sequence[int] | None],
    mesh_shape: Sequence[int],
    every: Sequence[Sequence[int] | None] = (),
    partials: Sequence[Partial | None] | None = None,
) -> list[tuple[int, ...]]:
    """The mesh dims of every letter (by id) for the merged tensors' ``dms`` / ``shapes``
    (``all_shapes``: the inputs', for ``sizes="known"``; ``every``: every tensor's shape,
    inputs then outputs, for ``flatten`` chains; ``partials``: the merged tensors' partial
    status, read by ``conflict="align"``)."""
    n = p.n
    blocked = _blocked(p, dms, mesh_shape) if p.block else 0
    cur: list[tuple[int, ...] | None] = [None] * n
    cands: dict[int, list[tuple[int, ...]]] | None = None
    if p.conflict == 5:  # the vote per mesh dim, in place of the per-letter merge
        claims = _aligned(p, cur, dms, shapes, partials, mesh_shape, blocked)
    else:
        claims, cands = _merged(p, cur, dms, shapes, mesh_shape, blocked)
    if not claims:
        return [()] * n
    if cands:
        _unions(cur, cands, mesh_shape)
    for chain, where in zip(p.chains, p.chain_src):
        _chain(cur, chain, [every[ti][i] for ti, i in where if every[ti] is not None], mesh_shape)  # type: ignore[index]
    return _resolve(p, _order(p, claims, cur, shapes, all_shapes), cur, shapes, all_shapes, mesh_shape)


def _blocked(p: RulePlan, dms: Sequence[DimsMapping | None], mesh_shape: Sequence[int]) -> int:
    """``replicated_claims="block"``: the mesh dims (bits) the merged tensors shard replicated letters on."""
    rep, largest = p.rep, p.largest
    blocked = 0
    for ti, ids in p.src:
        dm = dms[ti]
        if dm is None:
            continue
        for a, e in zip(ids, dm):
            if a >= 0 and rep[a]:
                if e.__class__ is int:
                    if e >= 0:
                        blocked |= 1 << e
                else:
                    for x in (largest_mesh_dim(e, mesh_shape),) if largest else e:  # type: ignore[union-attr]
                        blocked |= 1 << x
    return blocked


def _merged(
    p: RulePlan,
    cur: list[tuple[int, ...] | None],
    dms: Sequence[DimsMapping | None],
    shapes: Sequence[Sequence[int] | None],
    mesh_shape: Sequence[int],
    blocked: int,
) -> tuple[list[int], dict[int, list[tuple[int, ...]]] | None]:
    """The merge per letter (the conflict policy): fills ``cur``; returns the claims in order (a
    letter id, or ``~mask`` for a size-1 axis's mesh dims under ``unit_axes="claim"``) and, under
    ``conflict="union"``, each contested letter's candidates."""
    rep, largest, unit, conflict = p.rep, p.largest, p.unit, p.conflict
    hold = [0] * p.n
    claims: list[int] = []
    cands: dict[int, list[tuple[int, ...]]] | None = None
    for ti, ids in p.src:
        dm = dms[ti]
        if dm is None:
            continue
        for a, e in zip(ids, dm):
            if a < 0 and not unit:
                continue
            if e.__class__ is int:
                if e < 0:
                    continue
                d: tuple[int, ...] = _ONE[e]
            elif largest:
                d = _ONE[largest_mesh_dim(e, mesh_shape)]
            else:
                d = e  # type: ignore[assignment]
            if blocked and (a < 0 or not rep[a]):
                d = tuple([x for x in d if not (blocked >> x) & 1])
                if not d:
                    continue
            if a < 0:  # unit_axes="claim": a size-1 axis takes its mesh dims (~mask) in claim order
                m = 0
                for x in d:
                    m |= 1 << x
                claims.append(~m)
                continue
            c = cur[a]
            if c is None:
                cur[a] = d
                hold[a] = ti
                claims.append(a)
            elif conflict == 4:  # heaviest: any heavier tensor sharding the letter takes it
                s_new, s_old = shapes[ti], shapes[hold[a]]
                if (merge_weight(s_new) if s_new is not None else 0) > (
                    merge_weight(s_old) if s_old is not None else 0
                ):
                    cur[a] = d
                    hold[a] = ti
            elif c != d:
                if conflict == 0:
                    s_new, s_old = shapes[ti], shapes[hold[a]]
                    if (merge_weight(s_new) if s_new is not None else 0) > (
                        merge_weight(s_old) if s_old is not None else 0
                    ):
                        cur[a] = d
                        hold[a] = ti
                elif conflict == 2:
                    if cands is None:
                        cands = {}
                    lst = cands.get(a)
                    if lst is None:
                        cands[a] = [c, d]
                    elif d not in lst:
                        lst.append(d)
                elif conflict == 3:
                    cur[a] = ()
    return claims, cands


def _order(p: RulePlan, claims: list[int], cur: list[tuple[int, ...] | None], shapes: Sequence[Sequence[int] | None],
           all_shapes: Sequence[Sequence[int] | None]) -> Sequence[int]:  # fmt: skip
    """The order the claims resolve in (``Notation.order``)."""
    size_src = p.size_src
    known = p.sizes_known
    kind = p.order_kind
    if kind == 0:
        order: Sequence[int] = claims
    elif kind == 1:
        order = sorted(claims)
    else:
        order = []
        for gk, g in p.groups:
            if gk == 0:
                if len(g) == 1:
                    if cur[g[0]] is not None:
                        order.append(g[0])
                else:
                    order.extend([a for a in claims if a in g])
            else:
                got = [a for a in g if cur[a] is not None]
                if len(got) > 1:
                    sz = [_size(size_src[a], shapes, all_shapes, known) for a in got]
                    got = [a for _, a in sorted(zip([-s for s in sz], got), key=lambda t: t[0])]
                order.extend(got)
    return order


def _resolve(
    p: RulePlan,
    order: Sequence[int],
    cur: list[tuple[int, ...] | None],
    shapes: Sequence[Sequence[int] | None],
    all_shapes: Sequence[Sequence[int] | None],
    mesh_shape: Sequence[int],
) -> list[tuple[int, ...]]:
    """Each letter's mesh dims, resolved in ``order``: replicated letters and taken mesh dims
    dropped (``taken``), pruned letters cut to divide their sizes (read only here)."""
    rep, size_src, known = p.rep, p.size_src, p.sizes_known
    final: list[tuple[int, ...]] = [()] * p.n
    prune, uneven, s1claim = p.prune, p.uneven, p.s1claim
    keep = p.taken_keep
    used = 0
    for a in order:
        if a < 0:
            used |= ~a
            continue
        if rep[a]:
            continue
        d: tuple[int, ...] = cur[a]  # type: ignore[assignment]
        if used and not keep:
            d2 = tuple([x for x in d if not (used >> x) & 1])
            d = () if p.taken_letter and len(d2) < len(d) else d2
        claim = d
        if prune[a] and d:
            size = _size(size_src[a], shapes, all_shapes, known)
            if size >= 0 and (size == 1 or not uneven[a]):
                while d and size % mesh_size(mesh_shape, d) != 0:
                    d = d[:-1]
                if not (size == 1 and s1claim[a]):
                    claim = d
        for x in claim:
            used |= 1 << x
        final[a] = d
    return final


def _chain(cur: list[tuple[int, ...] | None], chain: tuple[int, ...], sizes: list[int],
           mesh_shape: Sequence[int]) -> None:
    """``flatten``: the chain's first letter takes the longest run of its letters' mesh dims
    whose product divides every known size in ``sizes``; the others shard nothing."""
    if cur[chain[0]]:
        keep: tuple[int, ...] = ()
        for a in chain:
            d = keep + tuple([x for x in cur[a] or () if x not in keep])
            if len(d) == len(keep) or any(s >= 0 and s % mesh_size(mesh_shape, d) for s in sizes):
                break
            keep = d
        cur[chain[0]] = keep
    for a in chain[1:]:
        if cur[a] is not None:
            cur[a] = ()


def _aligned(
    p: RulePlan,
    cur: list[tuple[int, ...] | None],
    dms: Sequence[DimsMapping | None],
    shapes: Sequence[Sequence[int] | None],
    partials: Sequence[Partial | None] | None,
    mesh_shape: Sequence[int],
    blocked: int,
) -> list[int]:
    """``conflict="align"`` (:func:`spmdkit.engine.merge.aligned`) on letter ids: fills ``cur``,
    returns the letters given a mesh dim."""
    nm, n = len(mesh_shape), p.n
    rep, largest = p.rep, p.largest
    places: list[list[int]] = []
    cost = [0] * n  # per letter: the local sizes of the tensors carrying it unsharded
    least = [-1] * n  # per letter: its least known size (-1: none known)
    have = 0  # the letters the live tensors carry
    for ti, ids in p.src:
        dm = dms[ti]
        if dm is None:
            continue
        shape = shapes[ti] or (-1,) * len(dm)
        pl = [-1] * nm
        sh = 0
        local = 1
        for a, e, size in zip(ids, dm, shape):
            d: tuple[int, ...] = (
                (() if e < 0 else _ONE[e]) if e.__class__ is int
                else _ONE[largest_mesh_dim(e, mesh_shape)] if largest else e  # type: ignore[assignment]
            )
            if blocked and (a < 0 or not rep[a]):
                d = tuple([x for x in d if not (blocked >> x) & 1])
            if d:
                for x in d:
                    pl[x] = a if a >= 0 else -2
                if a >= 0:
                    sh |= 1 << a
            if size < 0:
                size = 1
            elif a >= 0 and (least[a] < 0 or size < least[a]):
                least[a] = size
            local *= -(-size // mesh_size(mesh_shape, d)) if d else size
        if partials is not None and partials[ti]:
            for x, r in partials[ti]:  # type: ignore[union-attr]
                pl[x] = _RT[r]
        places.append(pl)
        seen = sh
        for a in ids:
            if a >= 0 and not (seen >> a) & 1:
                seen |= 1 << a
                cost[a] += local
        have |= seen
    if not places:
        return []
    done = 0
    later: list[int] = []
    first = places[0]
    for md in range(nm):
        v = first[md]
        for pl in places:
            if pl[md] != v:
                later.append(md)
                break
        else:
            if v >= 0 and not rep[v]:
                cur[v] = _ONE[md]  # the highest of a co-shard
                done |= 1 << v
    for md in later:
        m = mesh_shape[md]
        best = -1
        for a in p.align_letters:
            if (done >> a) & 1 or not (have >> a) & 1 or 0 <= least[a] < m:
                continue
            if best < 0 or cost[a] < cost[best]:
                best = a
        if best >= 0:
            cur[best] = _ONE[md]
            done |= 1 << best
    return [a for a in range(n) if (done >> a) & 1]


def _size(
    src: tuple[tuple[int, int], ...],
    shapes: Sequence[Sequence[int] | None],
    all_shapes: Sequence[Sequence[int] | None],
    known: bool,
) -> int:
    """A letter's size from its sources (see ``Notation.sizes``)."""
    if not known:
        for ti, i in src:
            s = shapes[ti]
            if s is not None and s[i] != 1:
                return s[i]
        return 1
    res = 1
    for ti, i in src:
        s = all_shapes[ti]
        if s is None:
            continue
        x = s[i]
        if x >= 0 and x != 1:
            return x
        if x == -1:
            res = -1
    return res


def _unions(
    cur: list[tuple[int, ...] | None], cands: dict[int, list[tuple[int, ...]]], mesh_shape: Sequence[int]
) -> None:
    """``conflict="union"``: co-shard each contested letter over all its candidates; a mesh dim
    another letter also wants goes minor."""
    for a, lst in cands.items():
        out: list[int] = []
        for d in sorted(lst, key=lambda c: -mesh_size(mesh_shape, c)):
            for x in d:
                if x not in out:
                    out.append(x)
        cur[a] = tuple(out)
    count: dict[int, int] = {}
    for dims in cur:
        if dims:
            for x in dims:
                count[x] = count.get(x, 0) + 1
    if any(v > 1 for v in count.values()):
        for a in cands:
            dims = cur[a]
            if dims is not None and len(dims) > 1:
                cur[a] = tuple(x for x in dims if count[x] == 1) + tuple(x for x in dims if count[x] > 1)


def entries(final: list[tuple[int, ...]]) -> list[Entry]:
    return [-1 if not d else d[0] if len(d) == 1 else d for d in final]


def project_dm(ids: tuple[int, ...], ent: list[Entry]) -> DimsMapping:
    return tuple([-1 if a < 0 else ent[a] for a in ids])


def out_partial(
    missing: tuple[tuple[int, ReduceType], ...], final: list[tuple[int, ...]], taken_keep: bool = False
) -> tuple[tuple[int, ReduceType], ...]:
    """The partial of an output: the mesh dims of the letters it lacks, with their reduce types."""
    pt: list[tuple[int, ReduceType]] | None = None
    for a, r in missing:
        d = final[a]
        if d:
            if pt is None:
                pt = []
            pt.extend((x, r) for x in d)
    if pt is None:
        return ()
    if len(pt) > 1:
        pt.sort(key=lambda t: t[0])
        if taken_keep:  # letters may share a mesh dim: each once (the first letter's type)
            pt = [t for i, t in enumerate(pt) if i == 0 or pt[i - 1][0] != t[0]]
    return tuple(pt)


def infer(
    p: RulePlan,
    op: str,
    inputs: Sequence[DistTensorSpec | None],
    outputs: Sequence[DistTensorSpec | None],
    mesh: ProcessMesh,
    names: Sequence[str] | None = None,
    fast: bool = True,
    out_shapes: Sequence[Sequence[int] | None] | None = None,
) -> tuple[tuple[TensorDistAttr | None, ...], tuple[TensorDistAttr | None, ...]]:
    """Every input's and output's dist attr under the plan (``outputs`` empty in the forward
    direction). Inputs come back without partial (a partial input is resharded); outputs are
    partial over the mesh dims of the letters they lack. ``fast``: try the plan's generated
    code first (it answers the common case; ``fast=False`` for the general path alone).
    ``out_shapes``: the outputs' shapes in the forward direction, needed where a ``flatten``
    letter is on an output (its sizes there count)."""
    if _trace is not None:
        _trace.append(op)
    nt = p.notation
    forward = not outputs
    if forward and p.chain_out and out_shapes is None:
        raise ValueError(f"{op}: the plan of {nt!r} needs the outputs' shapes (out_shapes)")
    if fast:
        r = p.fast(inputs, outputs, mesh, out_shapes)
        if r is not None:
            return r  # type: ignore[no-any-return]
    merged = inputs if forward else outputs
    axes = nt.inputs if forward else nt.outputs
    dms: list[DimsMapping | None] = []
    shapes: list[Any] = []
    for j, t in enumerate(merged):
        if t is None:
            dms.append(None)
            shapes.append(None)
            continue
        dm = t.dist_attr.dims_mapping
        a = axes[j]
        if a is not None and len(dm) != len(a):
            nm = names[j if forward else len(inputs) + j] if names else f"tensor {j}"
            raise ShapeMismatchError(f"{op}: {nm} has {len(dm)} dims, expected {len(a)}")
        dms.append(dm)
        shapes.append(t.shape)
    all_shapes: Any = shapes
    if p.sizes_known and not forward:
        all_shapes = [None if t is None else t.shape for t in inputs]
    every: list[Any] = []
    if p.chains:
        every = [None if t is None else t.shape for t in inputs]
        every += list(out_shapes or ()) if forward else [None if t is None else t.shape for t in outputs]
    pts: list[Partial | None] | None = None
    kept: Partial = ()
    if p.keep_partial or p.conflict == 5:
        pts = [None if t is None else t.dist_attr.partial for t in merged]
        kept = kept_partial(nt.partial, [pts[ti] for ti, _ in p.src if dms[ti] is not None])  # type: ignore[misc]
    final = run(p, dms, shapes, all_shapes, mesh.shape, every, pts)
    if p.in_letters is not None:
        keep = p.in_letters
        final = [d if keep[a] else () for a, d in enumerate(final)]
    ent = entries(final)
    ins: list[TensorDistAttr | None] = []
    made: dict[tuple[int, ...], TensorDistAttr] = {}  # one attr per labelling (many tensors share one)
    for t, ids in zip(inputs, p.in_axes):
        if ids is None:
            ins.append(None)
            continue
        at = made.get(ids)
        if at is None:
            at = made[ids] = _make(mesh, project_dm(ids, ent), kept)
        if t is None or kept:  # an absent tensor the notation labels: the attr it would need
            ins.append(at)
        else:
            src = t.dist_attr
            ins.append(src if src.mesh is mesh and not src.partial and src.dims_mapping == at.dims_mapping else at)
    outs: list[TensorDistAttr | None] = []
    for j, (ids, missing) in enumerate(zip(p.out_axes, p.out_missing)):
        if ids is None or missing is None:
            outs.append(None)
            continue
        dm = project_dm(ids, ent)
        pt = out_partial(missing, final, p.taken_keep) if missing else ()
        if kept:
            pt = tuple(sorted(pt + kept, key=_first))
        if not forward and not pt and outputs[j] is not None:
            outs.append(attr_as(outputs[j].dist_attr, mesh, dm))  # type: ignore[union-attr]
        else:
            outs.append(_make(mesh, dm, pt))
    return tuple(ins), tuple(outs)


# ---------------------------------------------------------------------------
# the generated fast path
# ---------------------------------------------------------------------------


def _generate(p: RulePlan, direction: str, raw: bool = False) -> Any:
    """Straight-line Python for the plan's common case: every entry a single mesh dim (or a
    co-shard read as its largest), no two tensors sharding one letter differently (under
    ``conflict="first"`` the first simply wins), no two letters (nor, under ``unit_axes="claim"``,
    sharded size-1 axes) on one mesh dim (under ``order="claim"`` with no letter pruned, no flatten
    chain and ``taken`` other than "keep", the code drops such a mesh dim from the later claim
    itself, as :func:`run` does), no replicated
    letter sharded under ``replicated_claims="block"``. Then the order of resolution cannot
    matter and each letter prunes on its own. Any other case returns None: :func:`infer` takes
    the general path (:func:`run`), which answers it as the reference does.

    ``raw`` (forward only): ``fast(D, S, ms)`` on the inputs' dims_mappings, shapes and the
    mesh shape, returning ``((letter, mesh dims), ...)`` in the notation's letter order (what
    ``merge_letters`` answers), or None."""
    nt = p.notation
    align = p.conflict == 5
    if align and not raw and len({frozenset(a for a in ids if a >= 0) for _, ids in p.src}) > 1:
        return _decline  # conflict="align" on tensors of different letters: the general path
    forward = direction == "forward"
    lines = ["def fast(D, S, ms):"] if raw else ["def fast(I, O, mesh, Z=None):", "    ms = mesh.shape"]
    emit = lines.append
    # two letters on one mesh dim, resolved here in claim order (P: where a letter was first
    # sharded) where no letter prunes; otherwise the general path resolves them
    resolve = (p.order_kind == 0 and not p.unit and not p.taken_keep and not p.chains
               and not any(p.prune[a] for a in range(p.n) if not p.rep[a]))
    read: set[int] = set()  # the letters read
    units: list[str] = []  # unit_axes="claim": the mesh dim of each size-1 axis
    twice = _gen_reads(p, forward, raw, resolve, read, units, emit)
    ent = _gen_chains(p, forward, read, emit) if p.chains and not raw else set()
    live = _gen_claims(p, raw, resolve, read, units, twice, emit)
    _gen_prunes(p, raw, read, live, ent, emit)
    if raw:
        emit("    return (" + "".join(f"({c!r}, () if L{a} < 0 else _ONE[L{a}]), " for a, c in enumerate(nt.letters)) + ")")
        return _fast_fn(lines, f"plan {nt!r} letters", {})
    return _gen_answer(p, forward, ent, lines, f"plan {nt!r} {direction}")


def _gen_reads(p: RulePlan, forward: bool, raw: bool, resolve: bool, read: set[int], units: list[str],
               emit: Callable[[str], None]) -> bool:  # fmt: skip
    """The generated reads of the merged tensors' entries: ``L{a}`` per letter read (added to
    ``read``), the size-1 axes' ``U{k}`` (``units``), their agreement, ``P{a}`` where the claims
    are resolved here. Returns whether a letter is read on two axes (two claims can then share a
    mesh dim)."""
    align = p.conflict == 5
    src_name = "I" if forward else "O"
    twice = False
    pos = 0
    for ti, ids in p.src:
        if raw:
            emit(f"    d{ti} = D[{ti}]")
            emit(f"    s{ti} = S[{ti}]")
            emit(f"    if d{ti} is None or s{ti} is None: return None")
        else:
            emit(f"    t = {src_name}[{ti}]")
            emit("    if t is None: return None")
            emit(f"    d{ti} = t.dist_attr.dims_mapping")
            if align or p.keep_partial:  # a partial tensor: the general path
                emit("    if t.dist_attr.partial: return None")
        emit(f"    if len(d{ti}) != {len(ids)}: return None")
        if not p.sizes_known and not raw:
            emit(f"    s{ti} = t.shape")
        for i, a in enumerate(ids):
            if a < 0 and align:  # a sharded size-1 axis may move a mesh dim: the general path
                emit(f"    if d{ti}[{i}] != -1: return None")
                continue
            if a < 0:
                if p.unit:
                    var = f"U{len(units)}"
                    units.append(var)
                    emit(f"    {var} = d{ti}[{i}]")
                    emit(f"    if {var}.__class__ is not int:")
                    emit(f"        {var} = _largest({var}, ms)" if p.largest else "        return None")
                continue
            twice = twice or a in read
            var = f"L{a}" if a not in read else "e"
            emit(f"    {var} = d{ti}[{i}]")
            emit(f"    if {var}.__class__ is not int:")
            emit(f"        {var} = _largest({var}, ms)" if p.largest else "        return None")
            if a in read and align:  # every tensor places every mesh dim alike
                emit(f"    if e != L{a}: return None")
            elif a in read:
                emit("    if e != -1:")
                emit(f"        if L{a} == -1: L{a} = e" + (f"; P{a} = {pos}" if resolve else ""))
                if p.conflict != 1:
                    emit(f"        elif e != L{a}: return None")
            elif resolve:
                emit(f"    P{a} = {pos}")
            pos += 1
            read.add(a)
    return twice


def _gen_claims(p: RulePlan, raw: bool, resolve: bool, read: set[int], units: list[str], twice: bool,
                emit: Callable[[str], None]) -> list[int]:  # fmt: skip
    """The generated code emptying the replicated letters, then checking (or, with ``resolve``,
    resolving in claim order) that no two claimers take one mesh dim. Returns the live letters."""
    for a in sorted(read):
        if p.rep[a]:
            if p.block:
                emit(f"    if L{a} != -1: return None")
            emit(f"    L{a} = -1")
    live = [a for a in sorted(read) if not p.rep[a]]
    # no two claimers (letters, size-1 axes) on one mesh dim: the claim order cannot matter
    claimers = [f"L{a}" for a in live] + units
    # one merged tensor, each letter once: its (valid) dims_mapping never repeats a mesh dim
    if len(claimers) > 1 and not p.taken_keep and (raw or len(p.src) > 1 or twice or units):
        emit("    u = c = 0" if resolve else "    u = 0")
        for v in claimers:
            emit(f"    if {v} >= 0:")
            emit(f"        b = 1 << {v}")
            emit("        if u & b: " + ("c = 1" if resolve else "return None"))
            emit("        u |= b")
        if resolve:  # a mesh dim a letter claimed earlier is dropped from a later one
            emit("    if c:")
            emit(f"        Q = sorted([{', '.join(f'(P{a}, {k})' for k, a in enumerate(live))}])")
            emit(f"        V = [{', '.join(f'L{a}' for a in live)}]")
            emit("        u = 0")
            emit("        for _, k in Q:")
            emit("            x = V[k]")
            emit("            if x >= 0:")
            emit("                if (u >> x) & 1: V[k] = -1")
            emit("                else: u |= 1 << x")
            emit(f"        {', '.join(f'L{a}' for a in live)}, = V")
    return live


def _gen_prunes(p: RulePlan, raw: bool, read: set[int], live: list[int], ent: set[int],
                emit: Callable[[str], None]) -> None:  # fmt: skip
    """The generated code after the claims: a chain's other letters emptied, each pruned letter
    dropped where its mesh dim does not divide its size, the letters not read (or, backward, no
    input carries) emptied."""
    rest = [x for chain in p.chains for x in chain[1:] if x in read]
    if rest and not raw:  # a chain's other letters shard nothing (their mesh dims are its first's)
        emit("    " + " = ".join(f"L{x}" for x in rest) + " = -1")
    for a in live:
        if not p.prune[a]:
            continue
        srcs = p.size_src[a]
        emit(f"    if L{a} >= 0:")
        if p.sizes_known:
            # the first size >= 0 other than 1; else -1 where one is -1; else 1
            shape = "S[{}]" if raw else "I[{}].shape"
            for ti, _ in srcs:
                emit(f"        if {'S' if raw else 'I'}[{ti}] is None: return None")
            if not srcs:
                emit("        s = 1")
            for k, (ti, i) in enumerate(srcs):
                if k == 0:
                    emit(f"        s = {shape.format(ti)}[{i}]")
                    continue
                emit("        if s == 1 or s == -1:")
                emit(f"            v = {shape.format(ti)}[{i}]")
                emit("            if v >= 0 and v != 1: s = v")
                emit("            elif v == -1: s = -1")
        else:
            if not srcs:
                emit("        s = 1")
            for k, (ti, i) in enumerate(srcs):
                emit(f"        {'s' if k == 0 else '    s'} = s{ti}[{i}]" if k == 0 else f"        if s == 1: s = s{ti}[{i}]")
        cond = "s == 1" if p.uneven[a] else "s >= 0"
        emit(f"        if {cond} and s % ms[L{a}]: L{a} = -1")
    for a in range(p.n):
        if a not in read or (p.in_letters is not None and not p.in_letters[a]):
            emit(f"    L{a} = -1" + (f"; E{a} = -1" if a in ent else ""))
    for a in sorted(ent):  # a co-sharded chain letter making an output partial: the general path
        if any(m is not None and any(x == a for x, _ in m) for m in p.out_missing):
            emit(f"    if E{a}.__class__ is tuple: return None")


def _gen_answer(p: RulePlan, forward: bool, ent: set[int], lines: list[str], what: str) -> Any:
    """The generated answer of a (not raw) plan: one attr per input, then per output (partial
    over the mesh dims of the letters it lacks), and the function made of ``lines``."""
    emit = lines.append

    def dm(ids: tuple[int, ...]) -> str:
        return "(" + "".join(("-1" if a < 0 else f"E{a}" if a in ent else f"L{a}") + ", " for a in ids) + ")"


    # one attr per distinct (dims_mapping, no partial): an output sharded as an input is that
    # input's attr (dist attrs are immutable)
    plain: dict[str, str] = {}
    ins = []
    for j, in_ids in enumerate(p.in_axes):
        if in_ids is None:
            ins.append("None")
            continue
        # an absent tensor the notation labels (one the merge does not read): the attr it would need
        # (an earlier tensor's where it is labelled alike: dist attrs are immutable)
        key = dm(in_ids)
        absent = plain.get(key) or f"_make(mesh, {key})"
        emit(f"    i{j} = {absent} if I[{j}] is None else _attr_as(I[{j}].dist_attr, mesh, {key})")
        plain.setdefault(key, f"i{j}")
        ins.append(f"i{j}")
    outs = []
    consts: dict[str, Any] = {}
    for j, (out_ids, missing) in enumerate(zip(p.out_axes, p.out_missing)):
        if out_ids is None or missing is None:
            outs.append("None")
            continue
        ids = out_ids
        if not missing:
            if not forward:
                emit(f"    if O[{j}] is None: return None")
                outs.append(f"_attr_as(O[{j}].dist_attr, mesh, {dm(ids)})")
            elif dm(ids) in plain:
                outs.append(plain[dm(ids)])
            else:
                emit(f"    o{j} = _make(mesh, {dm(ids)})")
                plain[dm(ids)] = f"o{j}"
                outs.append(f"o{j}")
            continue
        if len(missing) == 1:
            a, r = missing[0]
            consts[f"R{j}_0"] = r
            pt = f"(((L{a}, R{j}_0),) if L{a} >= 0 else ())"
        else:
            emit(f"    pt{j} = []")
            for k, (a, r) in enumerate(missing):
                consts[f"R{j}_{k}"] = r
                emit(f"    if L{a} >= 0: pt{j}.append((L{a}, R{j}_{k}))")
            emit(f"    pt{j}.sort(key=_first)")
            pt = f"_uniq(pt{j})" if p.taken_keep else f"tuple(pt{j})"
        outs.append(f"_make(mesh, {dm(ids)}, {pt})")
    emit(f"    return ({''.join(x + ', ' for x in ins)}), ({''.join(x + ', ' for x in outs)})")
    return _fast_fn(lines, what, consts)


def _gen_chains(p: RulePlan, forward: bool, read: set[int], emit: Any) -> set[int]:
    """The generated code of the plan's ``flatten`` chains (after the reads): each chain's first
    letter's entry ``E{a}`` (a mesh dim or a co-shard tuple); ``L{a}`` stays its first mesh dim
    and the other letters keep theirs for the claim check, then shard nothing. A chain with a
    replicated letter or a pruned first letter declines where its first letter is sharded.
    Returns the letters with an ``E`` variable (the caller empties the others after the claim
    check)."""
    ent: set[int] = set()
    n_in = len(p.notation.inputs)
    # the merged tensors' shapes are read already (s{ti}; their tensors checked not None)
    merged = {ti if forward else n_in + ti for ti, _ in p.src} if not p.sizes_known else set()
    for chain, where in zip(p.chains, p.chain_src):
        a = chain[0]
        if a not in read:
            continue
        if p.rep[a] or p.prune[a] or any(p.rep[x] for x in chain[1:] if x in read):
            emit(f"    if L{a} >= 0: return None")
            continue
        ent.add(a)
        emit(f"    E{a} = L{a}")
        emit(f"    if L{a} >= 0:")
        sizes = []
        for k, (ti, i) in enumerate(where):
            if ti in merged:
                sizes.append(f"s{ti if forward else ti - n_in}[{i}]")
            elif ti < n_in:
                t = f"I[{ti}]"
                emit(f"        if {t} is None: return None")
                sizes.append(f"{t}.shape[{i}]")
            elif forward:
                t = f"Z[{ti - n_in}]"
                emit(f"        if Z is None or {t} is None: return None")
                sizes.append(f"{t}[{i}]")
            else:
                t = f"O[{ti - n_in}]"
                emit(f"        if {t} is None: return None")
                sizes.append(f"{t}.shape[{i}]")
            emit(f"        z{k} = {sizes[-1]}")
        fail = " or ".join(f"(z{k} >= 0 and z{k} % q)" for k in range(len(sizes))) or "False"
        emit(f"        q = ms[L{a}]")
        emit(f"        if {fail}: E{a} = L{a} = -1")
        ind = "        "
        got = [f"L{a}"]
        for x in chain[1:]:
            if x not in read:
                break
            emit(f"{ind}{'elif' if len(got) == 1 else 'if'} L{x} >= 0:")
            ind += "    "
            emit(f"{ind}q *= ms[L{x}]")
            emit(f"{ind}if not ({fail}):")
            ind += "    "
            got.append(f"L{x}")
            emit(f"{ind}E{a} = ({', '.join(got)})")
    return ent


def _fast_fn(lines: list[str], name: str, consts: dict[str, Any]) -> Any:
    """The function ``fast`` the generated ``lines`` define."""
    ns: dict[str, Any] = {"_attr_as": attr_as, "_make": _make, "_largest": largest_mesh_dim, "_first": _first,
                          "_ONE": _ONE, "_uniq": _uniq, **consts}  # fmt: skip
    return define("\n".join(lines), name, "fast", ns)


def _decline(*args: Any) -> None:
    """A plan's fast path that answers no case (the general path answers all)."""
    return None


def _first(t: tuple[int, ReduceType]) -> int:
    return t[0]


def _uniq(pt: list[tuple[int, ReduceType]]) -> tuple[tuple[int, ReduceType], ...]:
    """A sorted partial with each mesh dim once (``taken="keep"``: letters may share one)."""
    return tuple(t for i, t in enumerate(pt) if i == 0 or pt[i - 1][0] != t[0])


# ---------------------------------------------------------------------------
# the default policy on plain tuples, and a notation's forward answer
# ---------------------------------------------------------------------------


@memo()
def merge_letters(
    axes: tuple[str | None, ...],
    mappings: tuple[DimsMapping | None, ...],
    shapes: tuple[tuple[int, ...] | None, ...],
    replicated: frozenset[str],
    prune: str,
    mesh_shape: tuple[int, ...],
) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """Merge per-letter shardings over several tensors; returns ``((letter, mesh dims), ...)``
    in the order letters first appear.

    Per letter: the first tensor sharding it claims it; where another tensor shards it over
    other mesh dims, the larger tensor (by element count) keeps its sharding and the other is
    resharded (Paddle raises here). Then, in claim order, a mesh dim already taken by an
    earlier letter is dropped, replicated letters lose their sharding, and pruned letters drop
    minor mesh dims until the mesh size divides the axis size (the default policy of a
    :class:`Notation`, run by its compiled plan)."""
    if _trace is not None:
        note("merge_letters")
    p = compile_plan(_merge_notation(axes, replicated, prune))
    fast = p.fast_letters
    if fast is None:
        fast = p.fast_letters = _generate(p, "forward", raw=True)
    got = fast(mappings, shapes, mesh_shape)
    if got is not None:
        return got  # type: ignore[no-any-return]
    if None in mappings:
        shapes = tuple(None if dm is None else s for dm, s in zip(mappings, shapes))
    final = run(p, mappings, shapes, shapes, mesh_shape)
    if None not in mappings:  # every letter seen, in the notation's order
        return tuple(zip(p.notation.letters, final))
    lid = p.letter_ids
    seen: dict[str, tuple[int, ...]] = {}
    for t_axes, dm in zip(axes, mappings):
        if t_axes is not None and dm is not None:
            for ch in t_axes:
                if ch != BROADCAST and ch not in seen:
                    seen[ch] = final[lid[ch]]
    return tuple(seen.items())


@lru_cache(maxsize=4096)
def _merge_notation(axes: tuple[str | None, ...], replicated: frozenset[str], prune: str) -> Notation:
    return Notation(axes, (), replicated, prune=prune)


def einsum_forward(
    op: str,
    notation: Notation,
    inputs: Sequence[DistTensorSpec | None],
    names: Sequence[str] | None = None,
) -> tuple[list[TensorDistAttr | None], list[TensorDistAttr | None]]:
    """Infer the inputs' required dist attrs and the outputs' from the inputs (the notation's
    compiled plan)."""
    if len(inputs) == 1 and inputs[0] is not None:
        mesh = inputs[0].dist_attr.mesh  # one tensor: its letters cannot disagree in size
    else:
        mesh = common_mesh(op, inputs)
        check_letters(op, notation.inputs, inputs, names)
    ins, outs = infer(compile_plan(notation), op, inputs, (), mesh, names)
    return list(ins), list(outs)
