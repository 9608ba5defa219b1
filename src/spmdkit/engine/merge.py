"""Merge helpers and the reference merge: what a :class:`~spmdkit.engine.notation.Notation`
and its policy mean, written plainly with dicts keyed by letter.

The compiled plans of :mod:`spmdkit.engine.compiler` are the fast path; :func:`reference_merge`
is the specification they are tested against (tests/test_engine_compiled.py). The steps, per
the notation's policy fields (see ``Notation``):

1. *read* each merged tensor's entry per axis: ``coshard="keep"`` takes a co-sharded entry as
   it is, ``"largest"`` as its largest mesh dim (Paddle's reading); ``replicated_claims=
   "block"`` removes from every entry the mesh dims that the tensors shard replicated letters
   on (the replicated letter keeps the mesh dim, as Paddle's merge lets it);
2. *merge* per letter: the first tensor sharding a letter claims it; another tensor sharding
   it over other mesh dims: ``conflict="weight"`` the one with more elements keeps it (the
   first on a tie), ``"heaviest"`` the one with most elements of all tensors sharding it keeps
   it (the first on a tie), ``"first"`` the first keeps it, ``"replicate"`` the letter shards nothing
   (co-shards compared whole), ``"union"`` the letter is co-sharded over all of them (larger mesh product major, earlier tensor first on a tie; a mesh dim that
   another letter also wants goes minor); ``"align"`` votes per mesh dim instead
   (:func:`aligned`, Paddle's AlignDimsSharding);
2b. *flatten* (``flatten`` strings such as ``"abc"``): where ``a`` is sharded, it takes its own
   mesh dims, then ``b``'s, then ``c``'s (those not in the run yet) while they add any, each letter's whole: the
   longest such run whose mesh product divides every size ``a`` has on the call's tensors
   (-1 sizes do not count); ``b`` and ``c`` shard nothing;
3. *order* the letters: ``order="claim"`` as first claimed, ``"notation"`` as they first appear
   in the notation's tensors, or groups (see ``Notation``);
4. *resolve* in that order: replicated letters shard nothing, a mesh dim taken by an earlier
   letter is dropped (``taken="letter"``: the letter shards nothing; ``"keep"``: kept), pruned letters drop minor mesh dims until the product divides their size
   (``uneven`` letters only where their size is 1); a letter claims the mesh dims it keeps,
   or, for ``size1_claims`` letters of size 1, those it had before pruning. Under
   ``unit_axes="claim"`` an axis labelled ``1`` that is sharded takes its mesh dims (those not
   taken yet) at its place in the claim order, and shards nothing.

Letter sizes (``sizes="first"``): the first size other than 1 on the merged tensors;
(``"known"``): the first size >= 0 other than 1 on the inputs (-1 where only -1 is seen,
1 where only 1).

Partial (``partial="keep"`` / ``"linear"``): :func:`kept_partial`, on every tensor.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from spmdkit.core.dist_attr import DimsMapping, Entry, Partial, ReduceType
from spmdkit.engine.axes import largest_mesh_dim, mesh_size
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


def merge_weight(shape: Sequence[int]) -> int:
    """A tensor's weight when two tensors shard one axis differently (the larger keeps its
    sharding): its element count, unknown (-1) and zero sizes counted as 1."""
    n = 1
    for s in shape:
        n *= s if s > 0 else 1
    return n


def union_dims(cands: Sequence[tuple[int, ...]], mesh_shape: Sequence[int]) -> tuple[int, ...]:
    """A letter sharded differently by several tensors, co-sharded over all their mesh dims:
    the larger mesh product major (the earlier on a tie), each mesh dim once."""
    out: list[int] = []
    for d in sorted(cands, key=lambda c: -mesh_size(mesh_shape, c)):
        for x in d:
            if x not in out:
                out.append(x)
    return tuple(out)


def shared_minor(merged: dict[str, tuple[int, ...]], unions: Sequence[str]) -> None:
    """In a co-sharded (union) letter, the mesh dims another letter also wants go minor."""
    count: dict[int, int] = {}
    for d in merged.values():
        for x in d:
            count[x] = count.get(x, 0) + 1
    if all(v == 1 for v in count.values()):
        return
    for ch in unions:
        d = merged[ch]
        if len(d) > 1:
            merged[ch] = tuple(x for x in d if count[x] == 1) + tuple(x for x in d if count[x] > 1)


def letter_order(notation: Notation, claims: Sequence[str], sizes: dict[str, int]) -> list[str]:
    """The letters in the order they resolve mesh-dim conflicts (see ``Notation.order``)."""
    order = notation.order
    if order is Order.CLAIM:
        return list(claims)
    if order is Order.NOTATION:
        return [c for c in notation.letters if c in claims]
    named = {c for g in order for c in g.lstrip(">") if g != "*"}
    out: list[str] = []
    for g in order:
        if g == "*":
            out.extend(c for c in claims if c not in named)
        elif g.startswith(">"):
            out.extend(sorted((c for c in g[1:] if c in claims), key=lambda c: -sizes.get(c, 1)))
        else:
            out.extend(c for c in claims if c in g)
    return out


def letter_sizes(
    notation: Notation,
    axes: Sequence[str | None],
    shapes: Sequence[Sequence[int] | None],
    all_axes: Sequence[str | None],
    all_shapes: Sequence[Sequence[int] | None],
) -> dict[str, int]:
    """Each letter's size under the notation's ``sizes`` policy (module docstring)."""
    sizes: dict[str, int] = {}
    if notation.sizes is Sizes.FIRST:
        for t_axes, shape in zip(axes, shapes):
            if t_axes is None or shape is None:
                continue
            for ch, s in zip(t_axes, shape):
                if ch != BROADCAST and ch not in sizes and s != 1:
                    sizes[ch] = s
        return sizes
    seen: dict[str, int] = {}
    for t_axes, shape in zip(all_axes, all_shapes):
        if t_axes is None or shape is None:
            continue
        for ch, s in zip(t_axes, shape):
            if ch == BROADCAST:
                continue
            if s >= 0 and s != 1:
                if seen.get(ch, 0) != 2:
                    sizes[ch], seen[ch] = s, 2
            elif s == -1 and seen.get(ch, 0) < 1:
                sizes[ch], seen[ch] = -1, 1
    return sizes


def kept_partial(mode: PartialMerge, partials: Sequence[Partial]) -> Partial:
    """``partial="keep"`` / ``"linear"``: the (mesh dim, reduce type) pairs every merged tensor's
    ``partials`` hold (``"linear"``: SUM and AVG only); ``()`` for ``"replicate"``."""
    if mode is PartialMerge.REPLICATE or not partials:
        return ()
    return tuple(x for x in partials[0] if (mode is PartialMerge.KEEP or x[1] in (ReduceType.SUM, ReduceType.AVG))
                 and all(x in pt for pt in partials[1:]))


def aligned(
    notation: Notation,
    axes: Sequence[str | None],
    mappings: Sequence[DimsMapping | None],
    shapes: Sequence[Sequence[int] | None],
    partials: Sequence[Partial | None] | None,
    mesh_shape: Sequence[int],
    blocked: set[int],
) -> dict[str, tuple[int, ...]]:
    """``conflict="align"``: the vote per mesh dim of Paddle's AlignDimsSharding (concat, stack).

    Each merged tensor places every mesh dim: on the letter it shards (``1`` for a size-1
    axis), as partial with its reduce type, or nowhere. A mesh dim every tensor places alike on
    an unreplicated letter goes to that letter (a letter so given several keeps the highest).
    Then each other mesh dim, in mesh order, goes to the unreplicated letter no mesh dim went to
    yet whose resharding costs least: the sum of the local element counts (sizes divided by
    their sharding, rounded up; -1 read as 1) of the tensors carrying the letter unsharded; a
    letter with a known size smaller than the mesh dim on any tensor is never chosen; the
    earlier letter on a tie; none where no letter qualifies."""
    rep = notation.replicated
    live: list[tuple[str, Sequence[int], dict[int, object], set[str], int]] = []
    for ti, (t_axes, dm) in enumerate(zip(axes, mappings)):
        if t_axes is None or dm is None:
            continue
        shape = shapes[ti] or (-1,) * len(dm)
        place: dict[int, object] = {}
        sharded: set[str] = set()
        local = 1
        for ch, e, size in zip(t_axes, dm, shape):
            if notation.coshard is Coshard.LARGEST:
                e = largest_mesh_dim(e, mesh_shape)
            d = (() if e < 0 else (e,)) if isinstance(e, int) else tuple(e)
            if blocked and ch not in rep:
                d = tuple(x for x in d if x not in blocked)
            for x in d:
                place[x] = ch
            if d:
                sharded.add(ch)
            local *= -(-(size if size >= 0 else 1) // mesh_size(mesh_shape, d))
        for x, r in (partials[ti] or ()) if partials else ():
            place[x] = ("P", r)
        live.append((t_axes, shape, place, sharded, local))
    merged: dict[str, tuple[int, ...]] = {ch: () for t_axes, *_ in live for ch in t_axes if ch != BROADCAST}
    if not live:
        return merged
    later: list[int] = []
    for md in range(len(mesh_shape)):
        p0 = live[0][2].get(md)
        if any(t[2].get(md) != p0 for t in live):
            later.append(md)
        elif isinstance(p0, str) and p0 != BROADCAST and p0 not in rep:
            merged[p0] = (md,)
    done = {ch for ch, d in merged.items() if d}
    for md in later:
        best, best_cost = "", -1
        for ch in notation.letters:
            if ch not in merged or ch in rep or ch in done:
                continue
            cost = 0
            for t_axes, shape, _, sharded, local in live:
                if any(c == ch and 0 <= s < mesh_shape[md] for c, s in zip(t_axes, shape)):
                    break
                if ch in t_axes and ch not in sharded:
                    cost += local
            else:
                if best_cost < 0 or cost < best_cost:
                    best, best_cost = ch, cost
        if best:
            merged[best] = (md,)
            done.add(best)
    return merged


def reference_merge(
    notation: Notation,
    axes: Sequence[str | None],
    mappings: Sequence[DimsMapping | None],
    shapes: Sequence[Sequence[int] | None],
    mesh_shape: Sequence[int],
    all_axes: Sequence[str | None] | None = None,
    all_shapes: Sequence[Sequence[int] | None] | None = None,
    every_axes: Sequence[str | None] | None = None,
    every_shapes: Sequence[Sequence[int] | None] | None = None,
    partials: Sequence[Partial | None] | None = None,
) -> dict[str, tuple[int, ...]]:
    """The mesh dims of every letter the tensors labelled ``axes`` carry, under the notation's
    policy (module docstring); ``all_axes`` / ``all_shapes``: the inputs, for
    ``sizes="known"`` (default: the merged tensors); ``every_axes`` / ``every_shapes``: every
    tensor of the call, inputs then outputs, for the sizes of ``flatten`` letters (default: the
    merged tensors); ``partials``: the merged tensors' partial status (read by
    ``conflict="align"`` only)."""
    if all_axes is None or all_shapes is None:
        all_axes, all_shapes = axes, shapes
    if every_axes is None or every_shapes is None:
        every_axes, every_shapes = axes, shapes
    rep = notation.replicated
    # 1. read
    read, blocked = _read_entries(notation, axes, mappings, mesh_shape)
    unit = notation.unit_axes is UnitAxes.CLAIM
    # 2. merge
    merged: dict[str, tuple[int, ...]] = {}
    cands: dict[str, list[tuple[int, ...]]] = {}
    holder: dict[str, int] = {}
    claims: list[str] = []
    seq: list[str | tuple[int, ...]] = []  # claim order: a letter, or a unit axis's mesh dims
    for ti, row in enumerate(read):
        for ch, d in row:
            if blocked and ch not in rep:
                d = tuple(x for x in d if x not in blocked)
            if ch == BROADCAST:
                if d:
                    seq.append(d)
                continue
            merged.setdefault(ch, ())
            if not d:
                continue
            if ch not in claims:
                claims.append(ch)
                seq.append(ch)
                merged[ch], holder[ch], cands[ch] = d, ti, [d]
            elif notation.conflict is Conflict.HEAVIEST:
                s_new, s_old = shapes[ti], shapes[holder[ch]]
                if (merge_weight(s_new) if s_new is not None else 0) > (
                        merge_weight(s_old) if s_old is not None else 0):
                    merged[ch], holder[ch] = d, ti
            elif d != merged[ch] or notation.conflict is Conflict.UNION:
                if notation.conflict is Conflict.WEIGHT:
                    s_new, s_old = shapes[ti], shapes[holder[ch]]
                    w_new = merge_weight(s_new) if s_new is not None else 0
                    w_old = merge_weight(s_old) if s_old is not None else 0
                    if w_new > w_old:
                        merged[ch], holder[ch] = d, ti
                elif notation.conflict is Conflict.REPLICATE:
                    merged[ch] = ()
                elif notation.conflict is Conflict.UNION and d not in cands[ch]:
                    cands[ch].append(d)
    if notation.conflict is Conflict.ALIGN:
        merged = aligned(notation, axes, mappings, shapes, partials, mesh_shape, blocked)
        claims = [ch for ch in notation.letters if merged.get(ch)]
        seq = list(claims)
    if notation.conflict is Conflict.UNION:
        unions = [ch for ch in claims if len(cands[ch]) > 1]
        for ch in unions:
            merged[ch] = union_dims(cands[ch], mesh_shape)
        if unions:
            shared_minor(merged, unions)
    # 2b. flatten
    _flatten_chains(notation, merged, every_axes, every_shapes, mesh_shape)
    # 3. order, 4. resolve
    sizes = letter_sizes(notation, axes, shapes, all_axes, all_shapes)
    steps: list[str | tuple[int, ...]] = seq if unit else list(letter_order(notation, claims, sizes))
    _resolve_letters(notation, merged, steps, sizes, mesh_shape)
    return merged


def _read_entries(
    notation: Notation, axes: Sequence[str | None], mappings: Sequence[DimsMapping | None], mesh_shape: Sequence[int]
) -> tuple[list[list[tuple[str, tuple[int, ...]]]], set[int]]:
    """Step 1: each merged tensor's ``(letter, mesh dims)`` per axis read, and the mesh dims
    ``replicated_claims="block"`` removes from every other entry."""
    rep = notation.replicated
    read: list[list[tuple[str, tuple[int, ...]]]] = []
    blocked: set[int] = set()
    unit = notation.unit_axes is UnitAxes.CLAIM
    for t_axes, dm in zip(axes, mappings):
        row: list[tuple[str, tuple[int, ...]]] = []
        if t_axes is not None and dm is not None:
            for ch, e in zip(t_axes, dm):
                if ch == BROADCAST and not unit:
                    continue
                if notation.coshard is Coshard.LARGEST:
                    e = largest_mesh_dim(e, mesh_shape)
                d = (() if e < 0 else (e,)) if isinstance(e, int) else tuple(e)
                row.append((ch, d))
                if notation.replicated_claims is ReplicatedClaims.BLOCK and ch in rep:
                    blocked.update(d)
        read.append(row)
    return read, blocked


def _flatten_chains(
    notation: Notation,
    merged: dict[str, tuple[int, ...]],
    every_axes: Sequence[str | None],
    every_shapes: Sequence[Sequence[int] | None],
    mesh_shape: Sequence[int],
) -> None:
    """Step 2b: each ``flatten`` chain's first letter takes the longest run of its letters' mesh
    dims that divides its sizes; the others shard nothing."""
    for chain in notation.flatten:
        if merged.get(chain[0]):
            sizes_a = [s for t_axes, shape in zip(every_axes, every_shapes) if t_axes is not None and shape is not None
                       for ch, s in zip(t_axes, shape) if ch == chain[0] and s >= 0]
            keep: tuple[int, ...] = ()
            for ch in chain:
                d = keep + tuple(x for x in merged.get(ch, ()) if x not in keep)
                if len(d) == len(keep) or any(s % mesh_size(mesh_shape, d) for s in sizes_a):
                    break
                keep = d
            merged[chain[0]] = keep
        for ch in chain[1:]:
            if ch in merged:
                merged[ch] = ()


def _resolve_letters(
    notation: Notation,
    merged: dict[str, tuple[int, ...]],
    steps: Sequence[str | tuple[int, ...]],
    sizes: dict[str, int],
    mesh_shape: Sequence[int],
) -> None:
    """Steps 3 and 4: in the order of ``steps`` (a letter, or a unit axis's mesh dims), replicated
    letters and taken mesh dims dropped, pruned letters cut to divide their size."""
    rep = notation.replicated
    used: set[int] = set()
    for step in steps:
        if isinstance(step, tuple):
            used.update(step)
            continue
        ch = step
        if ch in rep:
            merged[ch] = ()
            continue
        d = merged[ch] if notation.taken is Taken.KEEP else tuple(x for x in merged[ch] if x not in used)
        if notation.taken is Taken.LETTER and len(d) < len(merged[ch]):
            d = ()
        size = sizes.get(ch, 1)
        claim = d
        if notation.prunes(ch) and size >= 0 and (size == 1 or ch not in notation.uneven):
            while d and size % mesh_size(mesh_shape, d) != 0:
                d = d[:-1]
            if not (size == 1 and ch in notation.size1_claims):
                claim = d
        used.update(claim)
        merged[ch] = d


def project(axes: str, letters: Mapping[str, tuple[int, ...]]) -> DimsMapping:
    """The dims_mapping of a tensor labelled ``axes`` under a letter map."""
    out: list[Entry] = []
    get = letters.get
    for ch in axes:
        d = get(ch)
        if not d:
            out.append(-1)
        elif len(d) == 1:
            out.append(d[0])
        else:
            out.append(d)
    return tuple(out)


def partial_of(
    axes: str, letters: Mapping[str, tuple[int, ...]], notation: Notation
) -> Partial:
    """Partial status of an output: the mesh dims of letters it lacks."""
    pt: dict[int, ReduceType] | None = None
    for ch, dims in letters.items():
        if dims and ch not in axes:
            r = notation.reduce_type(ch)
            if pt is None:
                pt = {}
            for d in dims:
                pt[d] = r
    if pt is None:
        return ()
    return tuple(sorted(pt.items()))
