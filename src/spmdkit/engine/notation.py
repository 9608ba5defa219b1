"""The einsum-notation machinery every rule runs on.

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
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from typing import Any

from spmdkit.core.dist_attr import (
    DimsMapping,
    Entry,
    Partial,
    ReduceType,
    TensorDistAttr,
)
from spmdkit.core.errors import InvalidMeshError, ShapeMismatchError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.spec import DistTensorSpec, SpmdResult
from spmdkit.engine.memo import memo
from spmdkit.engine.merge import merge_weight as merge_weight

BROADCAST = "1"
ALPHABET = "abcdefghijklmnopqrstuvwxyz"


def _check_policy(
    coshard: str, conflict: str, order: str | tuple[str, ...], replicated_claims: str, sizes: str, size1: str,
    unit_axes: str = "skip", taken: str = "dims", partial: str = "replicate",
) -> None:
    """ValueError for a policy value the engine does not know (a rule's declaration error)."""
    for name, val, allowed in (("coshard", coshard, ("keep", "largest")),
                               ("conflict", conflict, ("weight", "first", "union", "replicate", "heaviest", "align")),
                               ("partial", partial, ("replicate", "keep", "linear")),
                               ("replicated_claims", replicated_claims, ("drop", "block")),
                               ("sizes", sizes, ("first", "known")), ("size1", size1, ("keep", "broadcast")),
                               ("unit_axes", unit_axes, ("skip", "claim")), ("taken", taken, ("dims", "letter", "keep"))):
        if val not in allowed:
            raise ValueError(f"Notation: {name} must be one of {allowed}, got {val!r}")
    if unit_axes == "claim" and order != "claim":
        raise ValueError(f"Notation: unit_axes='claim' resolves in claim order, got order={order!r}")
    if unit_axes == "claim" and conflict == "align":
        raise ValueError("Notation: conflict='align' votes per mesh dim, unit_axes='claim' per axis")
    if isinstance(order, str):
        if order not in ("claim", "notation"):
            raise ValueError(f"Notation: order must be 'claim', 'notation' or a tuple of groups, got {order!r}")
        return
    named = [c for g in order if g != "*" for c in g.lstrip(">")]
    if len(named) != len(set(named)) or list(order).count("*") > 1:
        raise ValueError(f"Notation: order groups must not share letters, got {order!r}")


_POLICY = ("coshard", "conflict", "order", "replicated_claims", "uneven", "size1_claims", "sizes", "size1",
           "unit_axes", "taken", "sources", "flatten", "partial")


class Notation:
    """An einsum-like labelling of one op call, with the policy of its merge.

    ``inputs`` / ``outputs``: one string of letters per tensor (``None`` for an absent
    optional tensor). ``replicated``: letters that must stay unsharded.
    ``reduce``: the reduce type of outputs made partial by letters they lack
    (one type, or a mapping letter -> type; unlisted letters use SUM).
    ``prune``: letters whose mesh dims must divide their size (``"*"`` for all).

    Policy (keywords; the defaults are :func:`merge_letters`'s behaviour; the steps are
    spelled out in :mod:`spmdkit.engine.merge`):

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
        coshard: str = "keep",
        conflict: str = "weight",
        order: str | tuple[str, ...] = "claim",
        replicated_claims: str = "drop",
        uneven: str = "",
        size1_claims: str = "",
        sizes: str = "first",
        size1: str = "keep",
        unit_axes: str = "skip",
        taken: str = "dims",
        sources: Iterable[int] | None = None,
        flatten: Iterable[str] = (),
        partial: str = "replicate",
    ) -> None:
        self.inputs = tuple(inputs)
        self.outputs = tuple(outputs)
        self.replicated = frozenset(replicated)
        self.reduce = reduce if isinstance(reduce, ReduceType) else dict(reduce)
        self.prune = prune
        if (coshard != "keep" or conflict != "weight" or order != "claim" or replicated_claims != "drop"
                or sizes != "first" or size1 != "keep" or unit_axes != "skip" or taken != "dims"
                or partial != "replicate"):  # fmt: skip
            _check_policy(coshard, conflict, order, replicated_claims, sizes, size1, unit_axes, taken, partial)
        self.coshard, self.conflict, self.order = coshard, conflict, order if isinstance(order, str) else tuple(order)
        self.replicated_claims, self.uneven, self.size1_claims = replicated_claims, uneven, size1_claims
        self.sizes, self.size1, self.unit_axes, self.taken = sizes, size1, unit_axes, taken
        self.sources = None if sources is None else tuple(sources)
        self.partial = partial
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
        self._key = (self.inputs, self.outputs, self.replicated, red, prune, coshard, conflict, self.order,
                     replicated_claims, uneven, size1_claims, sizes, size1, unit_axes, taken, self.sources,
                     self.flatten, partial)
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
                extra.append(f"{name}={getattr(self, name)!r}")
        return f"Notation({s!r}{', ' if extra else ''}{', '.join(extra)})"


# ---------------------------------------------------------------------------
# merge / resolve / project on plain tuples (cached: pure functions of small keys)
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
    if _compile._trace is not None:
        _compile.note("merge_letters")
    p = _compile.compile_plan(_merge_notation(axes, replicated, prune))
    fast = p.fast_letters
    if fast is None:
        fast = p.fast_letters = _compile._generate(p, "forward", raw=True)
    got = fast(mappings, shapes, mesh_shape)
    if got is not None:
        return got  # type: ignore[no-any-return]
    if None in mappings:
        shapes = tuple(None if dm is None else s for dm, s in zip(mappings, shapes))
    final = _compile.run(p, mappings, shapes, shapes, mesh_shape)
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


# ---------------------------------------------------------------------------
# the two directions
# ---------------------------------------------------------------------------


def common_mesh(op: str, specs: Iterable[DistTensorSpec | None]) -> ProcessMesh:
    mesh: ProcessMesh | None = None
    for s in specs:
        if s is None:
            continue
        m = s.dist_attr.mesh
        if mesh is None:
            mesh = m
        elif m is not mesh and m != mesh:
            raise InvalidMeshError(f"{op}: the tensors lie on different meshes ({mesh!r} and {m!r})")
    if mesh is None:
        raise InvalidMeshError(f"{op}: no tensor given, so no mesh")
    return mesh


def named_mesh(op: str, named: Iterable[tuple[str, DistTensorSpec | None]]) -> ProcessMesh:
    """The one mesh of the named tensors (absent ones skipped); InvalidMeshError naming the two
    tensors that disagree."""
    mesh: ProcessMesh | None = None
    first = ""
    for name, t in named:
        if t is None:
            continue
        m = t.dist_attr.mesh
        if mesh is None:
            mesh, first = m, name
        elif m is not mesh and m != mesh:
            raise InvalidMeshError(f"{op}: {name} lies on a different mesh than {first} ({m!r} vs {mesh!r})")
    if mesh is None:
        raise InvalidMeshError(f"{op}: no tensor given, so no mesh")
    return mesh


def check_letters(
    op: str,
    axes: Sequence[str | None],
    specs: Sequence[DistTensorSpec | None],
    names: Sequence[str] | None = None,
) -> None:
    """Raise ShapeMismatchError where one letter has two sizes (size 1 and -1 excepted)."""
    seen: dict[str, int] = {}
    where: dict[str, int] = {}
    ti = -1
    for t_axes, s in zip(axes, specs):
        ti += 1
        if t_axes is None or s is None:
            continue
        shape = s.shape
        if len(t_axes) != len(shape):
            nm = names[ti] if names else f"tensor {ti}"
            raise ShapeMismatchError(f"{op}: {nm} has {len(shape)} dims, expected {len(t_axes)}")
        i = -1
        for ch in t_axes:
            i += 1
            if ch == BROADCAST:
                continue
            size = shape[i]
            if size < 0:
                continue
            prev = seen.get(ch)
            if prev is None:
                seen[ch] = size
                where[ch] = ti
            elif prev != size:
                pi = where[ch]
                a = names[pi] if names else f"tensor {pi}"
                b = names[ti] if names else f"tensor {ti}"
                raise ShapeMismatchError(
                    f"{op}: axis sizes disagree: {a} has {prev} and {b} has {size} on the same axis"
                )


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
    ins, outs = _compile.infer(_compile.compile_plan(notation), op, inputs, (), mesh, names)
    return list(ins), list(outs)


def with_partial(attr: TensorDistAttr, partial: Partial) -> TensorDistAttr:
    """A copy of ``attr`` with extra partial mesh dims (engine-internal, no validation)."""
    if not partial:
        return attr
    merged = dict(attr.partial)
    merged.update(partial)
    return TensorDistAttr._make(attr.mesh, attr.dims_mapping, tuple(sorted(merged.items())))


def letters_for(ndim: int, offset: int = 0) -> str:
    """The first ``ndim`` letters of the alphabet (after ``offset``)."""
    if ndim + offset > len(ALPHABET):
        raise ShapeMismatchError(f"tensors of more than {len(ALPHABET) - offset} dims are not supported")
    return ALPHABET[offset : offset + ndim]


# ---------------------------------------------------------------------------
# unvalidated constructors for the rules' hot paths
# ---------------------------------------------------------------------------

_new = object.__new__
_set_inputs = SpmdResult.__dict__["inputs"].__set__
_set_outputs = SpmdResult.__dict__["outputs"].__set__
_set_result_hash = SpmdResult.__dict__["_hash"].__set__
_make_attr = TensorDistAttr._make


def fast_result(
    inputs: tuple[TensorDistAttr | None, ...], outputs: tuple[TensorDistAttr | None, ...]
) -> SpmdResult:
    """``SpmdResult(inputs, outputs)`` for tuples of dist attrs (or None), unvalidated."""
    r = _new(SpmdResult)
    _set_inputs(r, inputs)
    _set_outputs(r, outputs)
    _set_result_hash(r, None)
    return r


def attr_as(src: TensorDistAttr, mesh: ProcessMesh, dims_mapping: DimsMapping) -> TensorDistAttr:
    """``TensorDistAttr._make(mesh, dims_mapping)``, or ``src`` itself where it is that attr
    already (dist attrs are immutable, so the answer is the same)."""
    if src.mesh is mesh and not src.partial and src.dims_mapping == dims_mapping:
        return src
    return _make_attr(mesh, dims_mapping)


# the compiled plans (engine/compile.py imports this module: bound here, read at call time)
from spmdkit.engine import compiler as _compile  # noqa: E402
