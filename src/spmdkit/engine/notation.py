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

from spmdkit.core.dist_attr import (
    DimsMapping,
    Entry,
    Partial,
    ReduceType,
    TensorDistAttr,
    dims_entry,
    entry_dims,
)
from spmdkit.core.errors import InvalidMeshError, ShapeMismatchError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.spec import DistTensorSpec

LetterMap = dict[str, tuple[int, ...]]

BROADCAST = "1"
ALPHABET = "abcdefghijklmnopqrstuvwxyz"


class Notation:
    """An einsum-like labelling of one op call.

    ``inputs`` / ``outputs``: one string of letters per tensor (``None`` for an absent
    optional tensor). ``replicated``: letters that must stay unsharded.
    ``reduce``: the reduce type of outputs made partial by letters they lack
    (one type, or a mapping letter -> type; unlisted letters use SUM).
    ``prune``: letters whose mesh dims must divide their size (``"*"`` for all).
    """

    __slots__ = ("_key", "inputs", "outputs", "prune", "reduce", "replicated")

    def __init__(
        self,
        inputs: Sequence[str | None],
        outputs: Sequence[str | None],
        replicated: Iterable[str] = "",
        reduce: ReduceType | Mapping[str, ReduceType] = ReduceType.SUM,
        prune: str = "",
    ) -> None:
        self.inputs = tuple(inputs)
        self.outputs = tuple(outputs)
        self.replicated = frozenset(replicated)
        self.reduce = reduce if isinstance(reduce, ReduceType) else dict(reduce)
        self.prune = prune
        red = self.reduce if isinstance(self.reduce, ReduceType) else tuple(sorted(self.reduce.items()))
        self._key = (self.inputs, self.outputs, self.replicated, red, prune)

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
        return isinstance(other, Notation) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __repr__(self) -> str:
        def side(ts: tuple[str | None, ...]) -> str:
            return ",".join("_" if t is None else t for t in ts)

        s = f"{side(self.inputs)}->{side(self.outputs)}"
        extra = []
        if self.replicated:
            extra.append(f"replicated={''.join(sorted(self.replicated))!r}")
        if self.prune:
            extra.append(f"prune={self.prune!r}")
        return f"Notation({s!r}{', ' if extra else ''}{', '.join(extra)})"


# ---------------------------------------------------------------------------
# merge / resolve / project on plain tuples (cached: pure functions of small keys)
# ---------------------------------------------------------------------------


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s if s > 0 else 1
    return n


@lru_cache(maxsize=65536)
def merge_letters(
    axes: tuple[str | None, ...],
    mappings: tuple[DimsMapping | None, ...],
    shapes: tuple[tuple[int, ...] | None, ...],
    replicated: frozenset[str],
    prune: str,
    mesh_shape: tuple[int, ...],
) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """Merge per-letter shardings over several tensors; returns ``((letter, mesh dims), ...)``
    in the order letters first appear."""
    dims_of: dict[str, tuple[int, ...]] = {}
    weight: dict[str, int] = {}
    claim_order: dict[str, int] = {}
    order: list[str] = []
    size_of: dict[str, int] = {}
    pos = 0
    for t_axes, dm, shape in zip(axes, mappings, shapes):
        if t_axes is None or dm is None:
            continue
        n = _numel(shape) if shape is not None else 0
        for i, ch in enumerate(t_axes):
            pos += 1
            if ch == BROADCAST:
                continue
            if ch not in dims_of:
                dims_of[ch] = ()
                order.append(ch)
            if shape is not None and ch not in size_of and shape[i] != 1:
                size_of[ch] = shape[i]
            d = entry_dims(dm[i])
            if not d:
                continue
            cur = dims_of[ch]
            if not cur:
                dims_of[ch] = d
                weight[ch] = n
                claim_order[ch] = pos
            elif d != cur and n > weight[ch]:
                # two tensors shard one axis differently: the larger one keeps its
                # sharding, the other is resharded (Paddle raises here)
                dims_of[ch] = d
                weight[ch] = n
    # a mesh dim claimed by several letters: the first claim keeps it
    used: set[int] = set()
    for ch in sorted(claim_order, key=claim_order.__getitem__):
        d = dims_of[ch]
        if ch in replicated:
            dims_of[ch] = ()
            continue
        kept = tuple(x for x in d if x not in used)
        if prune and (prune == "*" or ch in prune):
            size = size_of.get(ch, 1)
            while kept and size > 0 and size % _prod(mesh_shape, kept) != 0:
                kept = kept[:-1]
        used.update(kept)
        dims_of[ch] = kept
    return tuple((ch, dims_of[ch]) for ch in order)


def _prod(mesh_shape: tuple[int, ...], dims: tuple[int, ...]) -> int:
    p = 1
    for d in dims:
        p *= mesh_shape[d]
    return p


def project(axes: str, letters: Mapping[str, tuple[int, ...]]) -> DimsMapping:
    """The dims_mapping of a tensor labelled ``axes`` under a letter map."""
    out: list[Entry] = []
    for ch in axes:
        d = letters.get(ch, ())
        out.append(dims_entry(d) if d else -1)
    return tuple(out)


def partial_of(
    axes: str, letters: Mapping[str, tuple[int, ...]], notation: Notation
) -> Partial:
    """Partial status of an output: the mesh dims of letters it lacks."""
    pt: dict[int, ReduceType] = {}
    for ch, dims in letters.items():
        if dims and ch not in axes:
            r = notation.reduce_type(ch)
            for d in dims:
                pt[d] = r
    return tuple(sorted(pt.items()))


# ---------------------------------------------------------------------------
# the two directions
# ---------------------------------------------------------------------------


def common_mesh(op: str, specs: Iterable[DistTensorSpec | None]) -> ProcessMesh:
    mesh: ProcessMesh | None = None
    for s in specs:
        if s is None:
            continue
        if mesh is None:
            mesh = s.dist_attr.mesh
        elif s.dist_attr.mesh != mesh:
            raise InvalidMeshError(f"{op}: the tensors lie on different meshes ({mesh!r} and {s.dist_attr.mesh!r})")
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
    seen: dict[str, tuple[int, int]] = {}
    for ti, (t_axes, s) in enumerate(zip(axes, specs)):
        if t_axes is None or s is None:
            continue
        if len(t_axes) != len(s.shape):
            nm = names[ti] if names else f"tensor {ti}"
            raise ShapeMismatchError(f"{op}: {nm} has {len(s.shape)} dims, expected {len(t_axes)}")
        for i, ch in enumerate(t_axes):
            if ch == BROADCAST:
                continue
            size = s.shape[i]
            if size < 0:
                continue
            prev = seen.get(ch)
            if prev is None:
                seen[ch] = (size, ti)
            elif prev[0] != size:
                a = names[prev[1]] if names else f"tensor {prev[1]}"
                b = names[ti] if names else f"tensor {ti}"
                raise ShapeMismatchError(
                    f"{op}: axis sizes disagree: {a} has {prev[0]} and {b} has {size} on the same axis"
                )


def merge(
    notation: Notation,
    axes: Sequence[str | None],
    specs: Sequence[DistTensorSpec | None],
    mesh: ProcessMesh,
) -> LetterMap:
    merged = merge_letters(
        tuple(axes),
        tuple(None if s is None else s.dist_attr.dims_mapping for s in specs),
        tuple(None if s is None else s.shape for s in specs),
        notation.replicated,
        notation.prune,
        mesh.shape,
    )
    return dict(merged)


def attrs_from_letters(
    notation: Notation,
    letters: Mapping[str, tuple[int, ...]],
    mesh: ProcessMesh,
    axes: Sequence[str | None],
    with_partial: bool,
) -> list[TensorDistAttr | None]:
    out: list[TensorDistAttr | None] = []
    for t_axes in axes:
        if t_axes is None:
            out.append(None)
            continue
        pt = partial_of(t_axes, letters, notation) if with_partial else ()
        out.append(TensorDistAttr._make(mesh, project(t_axes, letters), pt))
    return out


def einsum_forward(
    op: str,
    notation: Notation,
    inputs: Sequence[DistTensorSpec | None],
    names: Sequence[str] | None = None,
) -> tuple[list[TensorDistAttr | None], list[TensorDistAttr | None]]:
    """Infer the inputs' required dist attrs and the outputs' from the inputs."""
    mesh = common_mesh(op, inputs)
    check_letters(op, notation.inputs, inputs, names)
    letters = merge(notation, notation.inputs, inputs, mesh)
    ins = attrs_from_letters(notation, letters, mesh, notation.inputs, False)
    outs = attrs_from_letters(notation, letters, mesh, notation.outputs, True)
    return ins, outs


def einsum_backward(
    op: str,
    notation: Notation,
    inputs: Sequence[DistTensorSpec | None],
    outputs: Sequence[DistTensorSpec | None],
    names: Sequence[str] | None = None,
) -> tuple[list[TensorDistAttr | None], list[TensorDistAttr | None]]:
    """Infer the inputs from the outputs' dist attrs; the outputs returned are those
    the inferred inputs produce."""
    mesh = common_mesh(op, list(inputs) + list(outputs))
    check_letters(op, list(notation.inputs) + list(notation.outputs), list(inputs) + list(outputs), names)
    letters = merge(notation, notation.outputs, outputs, mesh)
    # a letter no input carries cannot be sharded by the inputs
    in_letters = set("".join(a for a in notation.inputs if a))
    letters = {ch: d for ch, d in letters.items() if ch in in_letters}
    ins = attrs_from_letters(notation, letters, mesh, notation.inputs, False)
    outs = attrs_from_letters(notation, letters, mesh, notation.outputs, True)
    return ins, outs


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
