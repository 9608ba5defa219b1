"""A compiled plan: a :class:`~spmdkit.engine.notation.Notation` and its policy specialised for
one direction and key, as ints and int tuples (letters become ints, every policy a flag or an int
tuple, every tensor a tuple of letter ids). :mod:`spmdkit.engine.compiler` builds and runs plans;
:mod:`spmdkit.engine.fastpath` writes a plan's straight-line code.
"""

from __future__ import annotations

from typing import Any

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

#: (d,) for a mesh dim d: no tuple built per entry
_ONE = tuple((d,) for d in range(64))

_CONFLICT = {Conflict.WEIGHT: 0, Conflict.FIRST: 1, Conflict.UNION: 2, Conflict.REPLICATE: 3, Conflict.HEAVIEST: 4,
             Conflict.ALIGN: 5}


class RulePlan:
    """A notation compiled for one direction and key (see the module docstring); built by
    :func:`spmdkit.engine.compiler.compile_plan`."""

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
        #: the generated code answering the common case (set by the compiler:
        #: :func:`spmdkit.engine.fastpath.fast_path`)
        self.fast: Any = None
        self.fast_letters: Any = None  # merge_letters' generated code, made on first use


__all__ = ["RulePlan"]
