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

from spmdkit.core.dist_attr import ReduceType, TensorDistAttr
from spmdkit.core.errors import InvalidAttributeError, ShapeMismatchError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.spec import DistTensorSpec, SpmdResult
from spmdkit.engine.axes import one_mesh_dim_specs
from spmdkit.engine.memo import memo
from spmdkit.engine.notation import (
    ALPHABET,
    Notation,
    attr_as,
    check_letters,
    common_mesh,
    einsum_backward,
    fast_result,
    merge_specs,
    project_all,
)
from spmdkit.rules._common import forward_largest
from spmdkit.rules.registry import register

# batch letters of the ids: the alphabet without the weight's j (vocab) and k (hidden)
_BATCH = "abcdefghilmnopqrstuvwxyz"


def _batch(op: str, ndim: int) -> str:
    if ndim > len(_BATCH):
        raise ShapeMismatchError(f"{op}: x has {ndim} dims, at most {len(_BATCH)} are supported")
    return _BATCH[:ndim]


def _check_weight(op: str, weight: DistTensorSpec) -> None:
    if len(weight.shape) != 2:
        raise ShapeMismatchError(
            f"{op}: weight (the embedding table) must be 2-D [vocab, hidden], got {len(weight.shape)}-D"
        )


def _check_int(op: str, name: str, v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise InvalidAttributeError(f"{op}: {name} must be an int, got {v!r}")
    return v


def _rows_replicated(op: str, padding_idx: object, sparse: object) -> bool:
    return _check_int(op, "padding_idx", padding_idx) != -1 or bool(sparse)


@memo()
def _emb_notation(nd: int, weight_first: bool, rows_replicated: bool) -> Notation:
    b = _BATCH[:nd]
    ins = ["jk", b] if weight_first else [b, "jk"]
    return Notation(ins, [b + "k"], replicated="j" if rows_replicated else "")


@memo()
def _emb_grad_notation(nd: int, weight_first: bool, rows_replicated: bool) -> Notation:
    b = _BATCH[:nd]
    ins = ["jk", b, b + "k"] if weight_first else [b, "jk", b + "k"]
    return Notation(ins, ["jk"], replicated="j" if rows_replicated else "")


def _check_out(op: str, x: DistTensorSpec, weight: DistTensorSpec, out: DistTensorSpec, name: str) -> None:
    want = (*x.shape, weight.shape[1])
    if len(out.shape) != len(want):
        raise ShapeMismatchError(f"{op}: {name} has {len(out.shape)} dims, expected x's {len(x.shape)} + 1")
    for i, (s, t) in enumerate(zip(out.shape, want)):
        if s != t and s >= 0 and t >= 0:
            raise ShapeMismatchError(f"{op}: {name} has size {s} on axis {i}, expected {t} (x.shape + [hidden])")


#: the hand-written forward where no axis is co-sharded; tests compare it with the notation
#: engine, which answers every other case
FAST = True


def _emb_fast(x: DistTensorSpec, weight: DistTensorSpec, rows_replicated: bool) -> SpmdResult | None:
    """``ab, jk -> abk`` as the notation engine merges it: claims in order x's axes, j, k; a
    mesh dim an earlier claim took is dropped; replicated rows claim nothing; out partial SUM
    over j's mesh dim."""
    xa, wa = x.dist_attr, weight.dist_attr
    mesh = xa.mesh
    if (wa.mesh is not mesh and wa.mesh != mesh) or len(x.shape) > len(_BATCH):
        return None  # the generic path names what is wrong
    used = 0
    for e in xa.dims_mapping:
        if e.__class__ is not int:
            return None
        if e >= 0:
            used |= 1 << e  # a legal mapping uses a mesh dim once
    j, k = wa.dims_mapping
    if j.__class__ is not int or k.__class__ is not int:
        return None
    if rows_replicated:
        j = -1
    elif j >= 0:
        if (used >> j) & 1:
            j = -1
        else:
            used |= 1 << j
    if k >= 0 and (used >> k) & 1:
        k = -1
    xdm = xa.dims_mapping
    pt = ((j, ReduceType.SUM),) if j >= 0 else ()
    return fast_result((attr_as(xa, mesh, xdm), TensorDistAttr.unchecked(mesh, (j, k))),
                       (TensorDistAttr.unchecked(mesh, (*xdm, k), pt),))


def embedding_forward(x: DistTensorSpec, weight: DistTensorSpec, padding_idx: int = -1,
                      sparse: bool = False) -> SpmdResult:
    """embedding (EmbeddingInferSpmd): ``ab, jk -> abk``; sharded rows make out partial SUM."""
    op = "embedding"
    _check_weight(op, weight)
    rows = _rows_replicated(op, padding_idx, sparse)
    if FAST:
        r = _emb_fast(x, weight, rows)
        if r is not None:
            return r
    n = _emb_notation(len(x.shape), False, rows)
    return forward_largest(op, n, [x, weight], ["x", "weight"])


def _reverse_rows(
    n: Notation, merged: tuple[tuple[str, tuple[int, ...]], ...], out: DistTensorSpec, mesh: ProcessMesh
) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """Out partial SUM over mesh dims no letter uses: the weight's rows sharded on them."""
    if "j" in n.replicated or not out.dist_attr.partial:
        return merged
    used = {d for _, ds in merged for d in ds}
    free = tuple(d for d, r in out.dist_attr.partial if r is ReduceType.SUM and d not in used)
    if not free:
        return merged
    return (*((c, d) for c, d in merged if c != "j"), ("j", free))


def embedding_backward(x: DistTensorSpec, weight: DistTensorSpec, out: DistTensorSpec, padding_idx: int = -1,
                       sparse: bool = False) -> SpmdResult:
    """embedding (EmbeddingInferSpmdReverse): x and the hidden axis from out; out as they produce it."""
    op = "embedding"
    _check_weight(op, weight)
    _check_out(op, x, weight, out, "out")
    n = _emb_notation(len(x.shape), False, _rows_replicated(op, padding_idx, sparse))
    mesh = common_mesh(op, (x, weight, out))
    x, weight, out = one_mesh_dim_specs(x, weight, out)
    check_letters(op, (*n.inputs, *n.outputs), (x, weight, out), ("x", "weight", "out"))
    merged = tuple((c, d) for c, d in merge_specs(n, n.outputs, [out], mesh) if c in n.input_letters)
    ins, outs = project_all(n, _reverse_rows(n, merged, out, mesh), mesh)
    return fast_result(tuple(ins), tuple(outs))


def embedding_grad(x: DistTensorSpec, weight: DistTensorSpec, out_grad: DistTensorSpec, padding_idx: int = -1,
                   sparse: bool = False) -> SpmdResult:
    """embedding_grad (EmbeddingGradInferSpmd): ``ab, jk, abk -> jk``; weight_grad keeps the
    weight's row sharding and is partial SUM over the batch letters' mesh dims."""
    op = "embedding_grad"
    _check_weight(op, weight)
    _check_out(op, x, weight, out_grad, "out_grad")
    n = _emb_grad_notation(len(x.shape), False, _rows_replicated(op, padding_idx, sparse))
    return forward_largest(op, n, [x, weight, out_grad], ["x", "weight", "out_grad"])


# -- c_embedding (the vocab-parallel kernel with an explicit start index) ------------------------


def c_embedding_forward(weight: DistTensorSpec, x: DistTensorSpec, start_index: int = 0,
                        vocab_size: int = -1) -> SpmdResult:
    """c_embedding (CEmbeddingInferSpmd): ``jk, ab -> abk``; ids outside
    ``[start_index, start_index + rows)`` give zeros, sharded rows make out partial SUM."""
    op = "c_embedding"
    _check_weight(op, weight)
    _check_int(op, "start_index", start_index)
    _check_int(op, "vocab_size", vocab_size)
    n = _emb_notation(len(x.shape), True, False)
    return forward_largest(op, n, [weight, x], ["weight", "x"])


def _make_c_embedding_grad(op: str):  # type: ignore[no-untyped-def]
    def grad(weight: DistTensorSpec, x: DistTensorSpec, out_grad: DistTensorSpec, start_index: int = 0) -> SpmdResult:
        _check_weight(op, weight)
        _check_out(op, x, weight, out_grad, "out_grad")
        _check_int(op, "start_index", start_index)
        n = _emb_grad_notation(len(x.shape), True, False)
        return forward_largest(op, n, [weight, x, out_grad], ["weight", "x", "out_grad"])

    grad.__name__ = op
    grad.__doc__ = (f"{op} (CEmbeddingGradInferSpmd): ``jk, ab, abk -> jk``; weight_grad keeps the weight's "
                    "sharding, partial SUM over the batch letters' mesh dims.")
    return grad


# -- one_hot ------------------------------------------------------------------------------------


@memo()
def _one_hot_notation(nd: int) -> Notation:
    if nd >= len(ALPHABET):
        raise ShapeMismatchError(f"one_hot: x has {nd} dims, at most {len(ALPHABET) - 1} are supported")
    a = ALPHABET[:nd]
    return Notation([a], [a + ALPHABET[nd]])


def _check_classes(num_classes: object) -> None:
    if _check_int("one_hot", "num_classes", num_classes) < 1:
        raise InvalidAttributeError(f"one_hot: num_classes must be positive, got {num_classes}")


def one_hot_forward(x: DistTensorSpec, num_classes: int) -> SpmdResult:
    """one_hot (OneHotInferSpmd): ``ab -> abz``, the new class axis replicated."""
    _check_classes(num_classes)
    return forward_largest("one_hot", _one_hot_notation(len(x.shape)), [x], ["x"])


def one_hot_backward(x: DistTensorSpec, out: DistTensorSpec, num_classes: int) -> SpmdResult:
    """one_hot (OneHotInferSpmdReverse): x from out's leading axes; the class axis replicated."""
    _check_classes(num_classes)
    if len(out.shape) != len(x.shape) + 1:
        raise ShapeMismatchError(f"one_hot: out has {len(out.shape)} dims, expected x's {len(x.shape)} + 1")
    if out.shape[-1] >= 0 and out.shape[-1] != num_classes:
        raise ShapeMismatchError(f"one_hot: out's last axis has {out.shape[-1]} classes, num_classes is {num_classes}")
    x, out = one_mesh_dim_specs(x, out)
    ins, outs = einsum_backward("one_hot", _one_hot_notation(len(x.shape)), [x], [out], ["x", "out"])
    return fast_result(tuple(ins), tuple(outs))


register(
    "embedding", embedding_forward, "x: T, weight: T, padding_idx: int = -1, sparse: bool = False",
    embedding_backward, kind="reverse", outputs="out: T",
    aliases=("lookup_table_v2",), forward_name="EmbeddingInferSpmd", backward_name="EmbeddingInferSpmdReverse",
)  # fmt: skip
register(
    "embedding_grad", embedding_grad,
    "x: T, weight: T, out_grad: T, padding_idx: int = -1, sparse: bool = False",
    aliases=("lookup_table_v2_grad",), forward_name="EmbeddingGradInferSpmd",
)  # fmt: skip
register(
    "c_embedding", c_embedding_forward, "weight: T, x: T, start_index: int = 0, vocab_size: int = -1",
    _make_c_embedding_grad("c_embedding"), "weight: T, x: T, out_grad: T, start_index: int = 0", kind="grad",
    forward_name="CEmbeddingInferSpmd", backward_name="CEmbeddingGradInferSpmd",
)  # fmt: skip
register(
    "c_embedding_grad", _make_c_embedding_grad("c_embedding_grad"),
    "weight: T, x: T, out_grad: T, start_index: int = 0", forward_name="CEmbeddingGradInferSpmd",
)  # fmt: skip
register(
    "one_hot", one_hot_forward, "x: T, num_classes: int", one_hot_backward, kind="reverse", outputs="out: T",
    forward_name="OneHotInferSpmd", backward_name="OneHotInferSpmdReverse",
)  # fmt: skip
