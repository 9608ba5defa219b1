"""The notation every rule declares: data, the :class:`Notation` and its typed merge policy.

A rule labels every axis of every tensor with a letter (``"mk,kn->mn"`` for
matmul); ``1`` labels a size-1 broadcast axis, which is never sharded. The
engine then

1. *merges* the shardings of all tensors per letter (a replicated axis takes any
   sharding; where two tensors shard one letter over different mesh dims the
   larger tensor wins and the other is resharded),
2. *resolves* a mesh dim claimed by several letters (the letter that claimed it
   first keeps it),
3. drops the letters the rule keeps replicated and, where the rule asks for it,
   the mesh dims that do not divide a letter's size (minor dims first),
4. *projects* the result back onto each tensor, and marks an output partial over
   the mesh dims of letters it does not have (with the rule's reduce type).

Forward runs the merge over the inputs; backward (Paddle's reverse rule) over the
outputs, and then computes the outputs from the inputs it inferred, so that the
answer is always one the inputs really produce.

This module only says what a notation is; :mod:`spmdkit.engine.compiler` runs it (compiled
plans) and :mod:`spmdkit.engine.merge` is the plain reference of what it means.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from enum import StrEnum
from typing import Any

from spmdkit.core.dist_attr import ReduceType
from spmdkit.core.errors import ShapeMismatchError

BROADCAST = "1"
ALPHABET = "abcdefghijklmnopqrstuvwxyz"


class Coshard(StrEnum):
    """How a merged tensor's co-sharded entry is read."""

    KEEP = "keep"  #: as it is
    LARGEST = "largest"  #: as its largest mesh dim (Paddle's merges)


class Conflict(StrEnum):
    """Two merged tensors sharding one letter differently (see ``Notation``)."""

    WEIGHT = "weight"
    FIRST = "first"
    UNION = "union"
    REPLICATE = "replicate"
    HEAVIEST = "heaviest"
    ALIGN = "align"


class Order(StrEnum):
    """The order letters resolve a mesh dim several claim (or a tuple of groups, see ``Notation``)."""

    CLAIM = "claim"
    NOTATION = "notation"


class ReplicatedClaims(StrEnum):
    """What becomes of the mesh dims a replicated letter is sharded on."""

    DROP = "drop"
    BLOCK = "block"


class Sizes(StrEnum):
    """Where a letter's size is read."""

    FIRST = "first"
    KNOWN = "known"


class Size1(StrEnum):
    """Whether an input's size-1 axes shard what their letter does."""

    KEEP = "keep"
    BROADCAST = "broadcast"


class UnitAxes(StrEnum):
    """An axis labelled ``1`` on a merged tensor."""

    SKIP = "skip"
    CLAIM = "claim"


class Taken(StrEnum):
    """A letter whose mesh dims an earlier letter took."""

    DIMS = "dims"
    LETTER = "letter"
    KEEP = "keep"


class PartialMerge(StrEnum):
    """A partial merged tensor."""

    REPLICATE = "replicate"
    KEEP = "keep"
    LINEAR = "linear"


def _member(name: str, kind: type[StrEnum], value: object) -> Any:
    """``value`` as a member of the policy field's enum (a str naming one is read as that member);
    ValueError for a value the engine does not know (a rule's declaration error)."""
    if value.__class__ is kind:
        return value
    try:
        return kind(value)  # type: ignore[arg-type]
    except ValueError:
        allowed = tuple(m.value for m in kind)
        raise ValueError(f"Notation: {name} must be one of {allowed}, got {value!r}") from None


def _order(order: Order | str | Sequence[str]) -> Order | tuple[str, ...]:
    """The ``order`` policy: an :class:`Order`, or a tuple of groups of letters."""
    if isinstance(order, str):
        try:
            return Order(order)
        except ValueError:
            raise ValueError(
                f"Notation: order must be 'claim', 'notation' or a tuple of groups, got {order!r}"
            ) from None
    groups = tuple(order)
    named = [c for g in groups if g != "*" for c in g.lstrip(">")]
    if len(named) != len(set(named)) or groups.count("*") > 1:
        raise ValueError(f"Notation: order groups must not share letters, got {groups!r}")
    return groups


def _shown(value: object) -> object:
    """A policy value as the repr shows it (an enum member as its string)."""
    return value.value if isinstance(value, StrEnum) else value


_POLICY = ("coshard", "conflict", "order", "replicated_claims", "uneven", "size1_claims", "sizes", "size1",
           "unit_axes", "taken", "sources", "flatten", "partial")


class Notation:
    """An einsum-like labelling of one op call, with the policy of its merge.

    ``inputs`` / ``outputs``: one string of letters per tensor (``None`` for an absent
    optional tensor). ``replicated``: letters that must stay unsharded.
    ``reduce``: the reduce type of outputs made partial by letters they lack
    (one type, or a mapping letter -> type; unlisted letters use SUM).
    ``prune``: letters whose mesh dims must divide their size (``"*"`` for all).

    Policy (keywords, each a member of this module's enum of that name: :class:`Coshard`,
    :class:`Conflict`, :class:`Order` (or a tuple of groups), :class:`ReplicatedClaims`,
    :class:`Sizes`, :class:`Size1`, :class:`UnitAxes`, :class:`Taken`, :class:`PartialMerge`; a
    str naming a member is read as it, an unknown one is a ValueError. The defaults are
    :func:`~spmdkit.engine.compiler.merge_letters`'s behaviour; the steps are spelled out in
    :mod:`spmdkit.engine.merge`):

    * ``coshard``: ``"keep"`` a co-sharded entry as it is, or read it as its ``"largest"``
      mesh dim (Paddle's merges);
    * ``conflict``: two tensors sharding one letter differently: the one with more elements
      keeps it (``"weight"``), the first (``"first"``), the letter is co-sharded over both
      (``"union"``, as Paddle's matmul), or it is replicated (``"replicate"``, co-shards
      compared whole: Paddle's optimizer vote); ``"heaviest"``: the tensor with the most
      elements of all that shard the letter keeps its sharding (the first on a tie; unlike
      ``"weight"``, which weighs a challenger against the first claimer only); or the vote is
      per mesh dim (``"align"``, Paddle's concat / stack): a mesh dim every merged tensor places
      alike (sharding one letter, or partial) keeps that placement, a letter so co-sharded its
      highest mesh dim; each other mesh dim, in mesh order, goes to the unsharded letter of
      least resharding cost (the local element counts of the merged tensors not sharding it;
      never a letter smaller than the mesh dim on a tensor), or to none;
    * ``order``: the order letters resolve a mesh dim several claim: as first claimed
      (``"claim"``), as they appear in the notation (``"notation"``), or a tuple of groups:
      ``"*"`` the letters no group names, by claim; ``"mn"`` these letters by claim; ``">mn"``
      these letters by size, largest first (the written order on a tie);
    * ``replicated_claims``: ``"drop"`` (a replicated letter's mesh dims are simply dropped)
      or ``"block"`` (they are removed from every other entry before merging);
    * ``uneven``: pruned letters that keep uneven shardings, pruned only where their size is 1;
    * ``size1_claims``: letters that, where their size is 1, still claim the mesh dims pruning
      took from them (so later letters cannot take them);
    * ``sizes``: a letter's size: the first size other than 1 on the merged tensors
      (``"first"``), or the first known one (>= 0, not 1) on the inputs (``"known"``);
    * ``size1``: ``"keep"``, or ``"broadcast"``: an input's size-1 axes shard nothing (their
      sharding still counts for the letter in the merge);
    * ``unit_axes``: an axis labelled ``1`` on a merged tensor is ``"skip"``-ped, or, with
      ``"claim"`` (Paddle's elementwise merge; ``order="claim"`` only), takes the mesh dims it
      is sharded on at its place in the claim order (a later letter loses them) and shards
      nothing;
    * ``taken``: a letter whose mesh dims an earlier letter took loses those ``"dims"``, or
      shards nothing (``"letter"``), or ``"keep"``s them (letters of unrelated tensors, say a
      list of tensors updated one by one, never compete for a mesh dim; an output lacking
      several letters is partial over each mesh dim once);
    * ``sources``: the indices of the inputs the forward merge reads (``None``: all); the
      others take the merged letters without adding theirs (a grad rule's tensors sharded as
      out_grad says, say);
    * ``flatten``: letter strings such as ``"abc"``, each a flattened (or split) axis, Paddle's
      reshape propagation: where ``a`` is sharded it is co-sharded over its own mesh dims, then
      those of ``b``, then ``c``, while they are sharded, each letter's mesh dims whole: the
      longest such run whose mesh product divides every size ``a`` has on the call's tensors
      (inputs and outputs; -1 sizes do not count); ``b`` and ``c`` shard nothing. A
      one-letter string keeps the letter's mesh dims whole or not at all.
    * ``partial``: a partial merged tensor is resharded to ``"replicate"``-d, or a mesh dim on
      which every merged tensor is partial with one reduce type stays partial on every tensor
      (``"keep"``: a linear op), or the same for SUM and AVG only (``"linear"``, Paddle's
      concat).
    """

    __slots__ = (
        "_hash",
        "_key",
        "conflict",
        "coshard",
        "flatten",
        "input_letters",
        "inputs",
        "letters",
        "order",
        "outputs",
        "partial",
        "prune",
        "reduce",
        "replicated",
        "replicated_claims",
        "size1",
        "size1_claims",
        "sizes",
        "sources",
        "taken",
        "uneven",
        "unit_axes",
    )

    def __init__(
        self,
        inputs: Sequence[str | None],
        outputs: Sequence[str | None],
        replicated: Iterable[str] = "",
        reduce: ReduceType | Mapping[str, ReduceType] = ReduceType.SUM,
        prune: str = "",
        *,
        coshard: Coshard = Coshard.KEEP,
        conflict: Conflict = Conflict.WEIGHT,
        order: Order | tuple[str, ...] = Order.CLAIM,
        replicated_claims: ReplicatedClaims = ReplicatedClaims.DROP,
        uneven: str = "",
        size1_claims: str = "",
        sizes: Sizes = Sizes.FIRST,
        size1: Size1 = Size1.KEEP,
        unit_axes: UnitAxes = UnitAxes.SKIP,
        taken: Taken = Taken.DIMS,
        sources: Iterable[int] | None = None,
        flatten: Iterable[str] = (),
        partial: PartialMerge = PartialMerge.REPLICATE,
    ) -> None:
        self.inputs = tuple(inputs)
        self.outputs = tuple(outputs)
        self.replicated = frozenset(replicated)
        self.reduce = reduce if isinstance(reduce, ReduceType) else dict(reduce)
        self.prune = prune
        self.coshard: Coshard = _member("coshard", Coshard, coshard)
        self.conflict: Conflict = _member("conflict", Conflict, conflict)
        self.partial: PartialMerge = _member("partial", PartialMerge, partial)
        self.replicated_claims: ReplicatedClaims = _member("replicated_claims", ReplicatedClaims, replicated_claims)
        self.sizes: Sizes = _member("sizes", Sizes, sizes)
        self.size1: Size1 = _member("size1", Size1, size1)
        self.unit_axes: UnitAxes = _member("unit_axes", UnitAxes, unit_axes)
        self.taken: Taken = _member("taken", Taken, taken)
        self.order: Order | tuple[str, ...] = order if order.__class__ is Order else _order(order)
        if self.unit_axes is UnitAxes.CLAIM and self.order is not Order.CLAIM:
            raise ValueError(f"Notation: unit_axes='claim' resolves in claim order, got order={_shown(self.order)!r}")
        if self.unit_axes is UnitAxes.CLAIM and self.conflict is Conflict.ALIGN:
            raise ValueError("Notation: conflict='align' votes per mesh dim, unit_axes='claim' per axis")
        self.uneven, self.size1_claims = uneven, size1_claims
        self.sources = None if sources is None else tuple(sources)
        if self.sources is not None and not all(0 <= i < len(self.inputs) for i in self.sources):
            raise ValueError(f"Notation: sources {self.sources} must index the {len(self.inputs)} inputs")
        self.letters = "".join(dict.fromkeys("".join([a for a in (*self.inputs, *self.outputs) if a]))).replace(
            BROADCAST, ""
        )
        self.flatten = tuple(flatten)
        if self.flatten:
            chained = "".join(self.flatten)
            if len(set(chained)) != len(chained) or not all(self.flatten) or any(c not in self.letters for c in chained):
                raise ValueError(f"Notation: flatten {self.flatten} must be disjoint strings of the notation's letters")
        red = self.reduce if isinstance(self.reduce, ReduceType) else tuple(sorted(self.reduce.items()))
        self._key = (self.inputs, self.outputs, self.replicated, red, prune, self.coshard, self.conflict, self.order,
                     self.replicated_claims, uneven, size1_claims, self.sizes, self.size1, self.unit_axes, self.taken,
                     self.sources, self.flatten, self.partial)
        self._hash = hash(self._key)
        self.input_letters = frozenset("".join(a for a in self.inputs if a))

    def relabel(self, inputs: Sequence[str | None], outputs: Sequence[str | None]) -> Notation:
        """A notation of other tensors with the same flags and policy (a grad rule's, say)."""
        return Notation(
            inputs, outputs, self.replicated, self.reduce, self.prune, coshard=self.coshard, conflict=self.conflict,
            order=self.order, replicated_claims=self.replicated_claims, uneven=self.uneven,
            size1_claims=self.size1_claims, sizes=self.sizes, size1=self.size1, unit_axes=self.unit_axes,
            taken=self.taken, sources=self.sources, flatten=self.flatten, partial=self.partial,
        )  # fmt: skip

    def replace(self, **policy: object) -> Notation:
        """This notation with some policy fields changed (``nt.replace(coshard="largest")``)."""
        kw: dict[str, Any] = {name: getattr(self, name) for name in _POLICY}
        kw.update(policy)
        return Notation(self.inputs, self.outputs, self.replicated, self.reduce, self.prune, **kw)

    def prunes(self, letter: str) -> bool:
        """Whether ``letter``'s mesh dims must divide its size."""
        return bool(self.prune) and (self.prune == "*" or letter in self.prune)

    @classmethod
    def parse(cls, text: str, **kw: object) -> Notation:
        """``Notation.parse("mk,kn->mn", replicated="k")``; ``_`` stands for an absent tensor."""
        lhs, _, rhs = text.replace(" ", "").partition("->")

        def side(s: str) -> list[str | None]:
            return [None if t == "_" else t for t in s.split(",")] if s else []

        return cls(side(lhs), side(rhs), **kw)  # type: ignore[arg-type]

    def reduce_type(self, letter: str) -> ReduceType:
        if isinstance(self.reduce, ReduceType):
            return self.reduce
        return self.reduce.get(letter, ReduceType.SUM)

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, Notation) and self._key == other._key)

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        def side(ts: tuple[str | None, ...]) -> str:
            return ",".join("_" if t is None else t for t in ts)

        s = f"{side(self.inputs)}->{side(self.outputs)}"
        extra = []
        if self.replicated:
            extra.append(f"replicated={''.join(sorted(self.replicated))!r}")
        if self.prune:
            extra.append(f"prune={self.prune!r}")
        for name, default in (("coshard", "keep"), ("conflict", "weight"), ("order", "claim"),
                              ("replicated_claims", "drop"), ("uneven", ""), ("size1_claims", ""),
                              ("sizes", "first"), ("size1", "keep"), ("unit_axes", "skip"), ("taken", "dims"), ("sources", None),
                              ("flatten", ()), ("partial", "replicate")):
            if getattr(self, name) != default:
                extra.append(f"{name}={_shown(getattr(self, name))!r}")
        return f"Notation({s!r}{', ' if extra else ''}{', '.join(extra)})"


def letters_for(ndim: int, offset: int = 0) -> str:
    """The first ``ndim`` letters of the alphabet (after ``offset``)."""
    if ndim + offset > len(ALPHABET):
        raise ShapeMismatchError(f"tensors of more than {len(ALPHABET) - offset} dims are not supported")
    return ALPHABET[offset : offset + ndim]
