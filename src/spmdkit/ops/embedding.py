"""Embedding lookups: embedding (lookup_table_v2), c_embedding, one_hot and the grads.

Notation (x: ids of any rank, letters ``ab...``; weight ``[vocab, hidden]`` = ``jk``)::

    embedding       ab, jk -> abk          (x, weight -> out)
    embedding_grad  ab, jk, abk -> jk      (x, weight, out_grad -> weight_grad)
    c_embedding     jk, ab -> abk          (weight, x -> out; Paddle's argument order)
    c_embedding_grad jk, ab, abk -> jk     (weight, x, out_grad -> weight_grad)
    one_hot         ab -> abz              (the class axis z is new: never sharded)

Vocab parallel: the weight's row letter ``j`` may stay sharded; each rank then looks up
only the ids of its own row range and writes zeros for the others, so ``out`` is partial
SUM over j's mesh dims (the simulator's localize hook gives a rank its row range). In the
grads each rank accumulates only the ids of its rows, so ``weight_grad`` keeps the
weight's row sharding; the batch letters are summed over, so ``weight_grad`` is partial
SUM over their mesh dims. ``hidden`` (``k``) is elementwise. Where two tensors claim one
mesh dim the first-claiming letter keeps it (x's batch letters before the weight's);
where two shard one letter differently the larger tensor wins (Paddle raises on both).
Every partial input is resharded to replicated (ids cannot be partial; Paddle clears a
partial weight too).

Rows are replicated where the vocab-parallel kernel cannot run: ``padding_idx != -1`` or
``sparse`` (Paddle raises instead). The reverse rules infer x and the weight's hidden
axis from out; a SUM-partial out over a free mesh dim becomes the weight's row sharding
(vocab parallel), and the outputs returned are those the inferred inputs produce (Paddle
echoes out, partial included). Deviations: ``docs/deviations.md`` ``embedding-*``.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from spmdkit.core.dist_attr import ReduceType, TensorDistAttr, dims_entry, entry_dims
from spmdkit.core.errors import ShapeMismatchError
from spmdkit.core.spec import DistTensorSpec
from spmdkit.engine.declare import Way, declare
from spmdkit.engine.facts import facts
from spmdkit.engine.notation import ALPHABET, Coshard, Notation
from spmdkit.engine.outshape import Args, Expect, UnknownShape
from spmdkit.ops._cost import copy, lookup, scatter_grad

# batch letters of the ids: the alphabet without the weight's j (vocab) and k (hidden)
_BATCH = "abcdefghilmnopqrstuvwxyz"


def notation(kind: str, weight_first: bool, nd: int, rows_replicated: bool) -> Notation:
    """``ab, jk -> abk`` (grad ``ab, jk, abk -> jk``; c_embedding: the weight first), co-shards
    read as their largest mesh dim; ``kind``: forward / reverse (compiled backward) / grad."""
    if nd > len(_BATCH):
        raise ShapeMismatchError(f"x has {nd} dims, at most {len(_BATCH)} are supported")
    b = _BATCH[:nd]
    ins = ["jk", b] if weight_first else [b, "jk"]
    rep = "j" if rows_replicated else ""
    if kind == "grad":
        return Notation([*ins, b + "k"], ["jk"], rep, coshard=Coshard.LARGEST)
    return Notation(ins, [b + "k"], rep, coshard=Coshard.LARGEST)


def one_hot_notation(nd: int) -> Notation:
    """``ab -> abz``: the new class axis replicated, co-shards read as their largest mesh dim."""
    if nd >= len(ALPHABET):
        raise ShapeMismatchError(f"x has {nd} dims, at most {len(ALPHABET) - 1} are supported")
    a = ALPHABET[:nd]
    return Notation([a], [a + ALPHABET[nd]], coshard=Coshard.LARGEST)


def _ids_out(x: DistTensorSpec, out: DistTensorSpec, name: str) -> None:
    """``out`` (``out_grad``) is shaped ``x.shape + [hidden]`` (the hidden axis: ``shapes``)."""
    if len(out.shape) != len(x.shape) + 1:
        raise ShapeMismatchError(f"{name} has {len(out.shape)} dims, expected x's {len(x.shape)} + 1")
    for i, (s, t) in enumerate(zip(out.shape, x.shape)):
        if s != t and s >= 0 and t >= 0:
            raise ShapeMismatchError(f"{name} has size {s} on axis {i}, expected {t} (x.shape + [hidden])")


def _vocab_parallel(ins: Any, outs: Any, x: DistTensorSpec, weight: DistTensorSpec, out: DistTensorSpec,
                    padding_idx: int, sparse: bool) -> Any:
    """Post-hook of the reverse rule, vocab parallel: out partial SUM over mesh dims no letter uses
    means the weight's rows are sharded there (each rank looked up its own rows). No notation
    derives an input letter from an output's partial status, so the rows letter j is set here
    and out made partial over it, as the forward plan would (out lacks j)."""
    used = {d for a in ins for e in a.dims_mapping for d in entry_dims(e)}
    free = tuple(d for d, r in out.dist_attr.partial if r is ReduceType.SUM and d not in used)
    if not free:
        return ins, outs
    w, o, mesh, make = ins[1], outs[0], out.dist_attr.mesh, TensorDistAttr.unchecked
    return ((ins[0], make(mesh, (dims_entry(free), w.dims_mapping[1]))),
            (make(mesh, o.dims_mapping, tuple(sorted((d, ReduceType.SUM) for d in free))),))  # fmt: skip


def _ids_out_grad(x: DistTensorSpec, out_grad: DistTensorSpec) -> None:
    _ids_out(x, out_grad, "out_grad")


def _ids_out_check(x: DistTensorSpec, out: DistTensorSpec) -> None:
    _ids_out(x, out, "out")


def _vocab_parallel_if(out: DistTensorSpec, padding_idx: int, sparse: bool) -> Any:
    """Where the reverse rule's answer takes the vocab-parallel kernel's shape (:func:`_vocab_parallel`)."""
    return out.dist_attr.partial and padding_idx == -1 and not sparse


def _one_hot_out(out: DistTensorSpec, num_classes: int) -> None:
    """one_hot's reverse: out's last axis has num_classes (its rank and other sizes: ``letters``)."""
    if out.shape and out.shape[-1] >= 0 and out.shape[-1] != num_classes:
        raise ShapeMismatchError(f"out's last axis has {out.shape[-1]} classes, num_classes is {num_classes}")


def _grad(op: str, weight_first: bool, key: str, paddle: str) -> Way:
    return Way(partial(notation, "grad", weight_first), key=key, shapes="weight: _ h; out_grad: ... h",
               check=_ids_out_grad, paddle=paddle,
               doc=f"{op} ({paddle}): ``{'jk, ab' if weight_first else 'ab, jk'}, abk -> jk``; weight_grad keeps "
                   "the weight's row sharding and is partial SUM over the batch letters' mesh dims.")  # fmt: skip


#: x's rank; the rows replicated where the vocab-parallel kernel cannot run
_ROWS = "x, padding_idx != -1 or sparse"
declare(
    "embedding", "x: T, weight: T, padding_idx: int = -1, sparse: bool = False",
    Way(partial(notation, "forward", False), key=_ROWS, shapes="weight: _ _", paddle="EmbeddingInferSpmd",
        doc="embedding (EmbeddingInferSpmd): ``ab, jk -> abk``; sharded rows make out partial SUM."),
    reverse=Way(partial(notation, "reverse", False), key=_ROWS, shapes="weight: _ h; out: ... h",
                check=_ids_out_check, post=_vocab_parallel, post_if=_vocab_parallel_if,
                paddle="EmbeddingInferSpmdReverse",
                doc="embedding (EmbeddingInferSpmdReverse): x and the hidden axis from out; out as they produce it."),
    outputs="out: T", aliases=("lookup_table_v2",),
)  # fmt: skip
declare("embedding_grad", "x: T, weight: T, out_grad: T, padding_idx: int = -1, sparse: bool = False",
        _grad("embedding_grad", False, _ROWS, "EmbeddingGradInferSpmd"), aliases=("lookup_table_v2_grad",))

# c_embedding (the vocab-parallel kernel with an explicit start index); its grad is a rule of its own
# too, its errors naming the op called (c_embedding in c_embedding's backward slot)
_C_SIG = "weight: T, x: T, start_index: int = 0, vocab_size: int = -1"
_CG_SIG = "weight: T, x: T, out_grad: T, start_index: int = 0"
_C_FWD = Way(partial(notation, "forward", True), key="x, False", shapes="weight: _ _", paddle="CEmbeddingInferSpmd",
             doc="c_embedding (CEmbeddingInferSpmd): ``jk, ab -> abk``; ids outside ``[start_index, start_index + "
                 "rows)`` give zeros, sharded rows make out partial SUM.")  # fmt: skip
declare("c_embedding", _C_SIG, _C_FWD, grad=_grad("c_embedding", True, "x, False", "CEmbeddingGradInferSpmd"),
        grad_signature=_CG_SIG, grad_op="c_embedding")
declare("c_embedding_grad", _CG_SIG, _grad("c_embedding_grad", True, "x, False", "CEmbeddingGradInferSpmd"))

declare(
    "one_hot", "x: T, num_classes: int",
    Way(one_hot_notation, key="x", require=("num_classes >= 1",), paddle="OneHotInferSpmd",
        doc="one_hot (OneHotInferSpmd): ``ab -> abz``, the new class axis replicated."),
    reverse=Way(one_hot_notation, key="x", require=("num_classes >= 1",), check=_one_hot_out,
                letters=True, paddle="OneHotInferSpmdReverse",
                doc="one_hot (OneHotInferSpmdReverse): x from out's leading axes; the class axis replicated."),
    outputs="out: T",
)  # fmt: skip


# -- output shapes / grads ----------------------------------------------------------------------


def _embedding_shape(a: Args) -> list[Expect]:
    w = a.s("weight")
    if len(w) != 2:
        raise UnknownShape
    return [(*a.s("x"), w[1])]


def _c_embedding_shape(a: Args) -> list[Expect]:
    return [a.s("x") + a.s("weight")[1:2]]


def _one_hot_shape(a: Args) -> list[Expect]:
    n = a.a("num_classes")
    if not isinstance(n, int) or n < 0:
        raise UnknownShape
    return [(*a.s("x"), n)]


facts("embedding", shape=_embedding_shape, grad="embedding_grad", wrt=("weight",))
facts("c_embedding", shape=_c_embedding_shape)
facts("one_hot", shape=_one_hot_shape)
facts("embedding_grad", "c_embedding_grad", grad_like=("weight",))


# -- cost

facts("embedding", "c_embedding", cost=lookup)
facts("embedding_grad", "c_embedding_grad", cost=scatter_grad)
facts("one_hot", cost=copy)
