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

Every rule runs a notation compiled per key (x's rank, argument order, rows replicated) on
the engine; the reverse rule's vocab-parallel row sharding is a post-hook on its answer (no
notation derives an input letter from an output's partial status).
"""

from __future__ import annotations

from functools import lru_cache

from spmdkit.core.dist_attr import ReduceType, TensorDistAttr, dims_entry, entry_dims
from spmdkit.core.errors import InvalidAttributeError, ShapeMismatchError
from spmdkit.core.spec import DistTensorSpec, SpmdResult
from spmdkit.engine.compile import Plan, compile_plan, infer
from spmdkit.engine.notation import ALPHABET, Notation, common_mesh, fast_result
from spmdkit.engine.registry import register
from spmdkit.rules._common import check_int, forward_largest, op_rule, reverse_largest

# batch letters of the ids: the alphabet without the weight's j (vocab) and k (hidden)
_BATCH = "abcdefghilmnopqrstuvwxyz"


@lru_cache(maxsize=1024)
def _plan(op: str, nd: int, kind: str, weight_first: bool, rows_replicated: bool) -> Plan:
    """The compiled plan per key (x's rank, kind: forward / reverse / grad, argument order,
    rows replicated): ``ab, jk -> abk`` (grad ``ab, jk, abk -> jk``), co-shards read as their
    largest mesh dim."""
    if nd > len(_BATCH):
        raise ShapeMismatchError(f"{op}: x has {nd} dims, at most {len(_BATCH)} are supported")
    b = _BATCH[:nd]
    ins = ["jk", b] if weight_first else [b, "jk"]
    if kind == "grad":
        nt = Notation([*ins, b + "k"], ["jk"], "j" if rows_replicated else "", coshard="largest")
    else:
        nt = Notation(ins, [b + "k"], "j" if rows_replicated else "", coshard="largest")
    return compile_plan(nt, "backward" if kind == "reverse" else "forward")


def _check(op: str, x: DistTensorSpec, weight: DistTensorSpec, out: DistTensorSpec | None = None,
           name: str = "out_grad") -> None:
    """weight is ``[vocab, hidden]``; ``out`` (where given) has shape ``x.shape + [hidden]``."""
    if len(weight.shape) != 2:
        raise ShapeMismatchError(
            f"{op}: weight (the embedding table) must be 2-D [vocab, hidden], got {len(weight.shape)}-D"
        )
    if out is None:
        return
    want = (*x.shape, weight.shape[1])
    if len(out.shape) != len(want):
        raise ShapeMismatchError(f"{op}: {name} has {len(out.shape)} dims, expected x's {len(x.shape)} + 1")
    for i, (s, t) in enumerate(zip(out.shape, want)):
        if s != t and s >= 0 and t >= 0:
            raise ShapeMismatchError(f"{op}: {name} has size {s} on axis {i}, expected {t} (x.shape + [hidden])")


def _rows_replicated(op: str, padding_idx: object, sparse: object) -> bool:
    return check_int(op, "padding_idx", padding_idx) != -1 or bool(sparse)


def _run(op: str, p: Plan, specs: tuple[DistTensorSpec, ...], names: tuple[str, ...]) -> SpmdResult:
    return fast_result(*infer(p, op, specs, (), common_mesh(op, specs), names))


def embedding_forward(x: DistTensorSpec, weight: DistTensorSpec, padding_idx: int = -1,
                      sparse: bool = False) -> SpmdResult:
    """embedding (EmbeddingInferSpmd): ``ab, jk -> abk``; sharded rows make out partial SUM."""
    op = "embedding"
    _check(op, x, weight)
    p = _plan(op, len(x.shape), "forward", False, _rows_replicated(op, padding_idx, sparse))
    return _run(op, p, (x, weight), ("x", "weight"))


def embedding_backward(x: DistTensorSpec, weight: DistTensorSpec, out: DistTensorSpec, padding_idx: int = -1,
                       sparse: bool = False) -> SpmdResult:
    """embedding (EmbeddingInferSpmdReverse): x and the hidden axis from out; out as they produce it."""
    op = "embedding"
    _check(op, x, weight, out, "out")
    rows = _rows_replicated(op, padding_idx, sparse)
    mesh = common_mesh(op, (x, weight, out))
    ins, outs = infer(_plan(op, len(x.shape), "reverse", False, rows), op, (x, weight), (out,), mesh,
                      ("x", "weight", "out"))
    pt = out.dist_attr.partial
    if rows or not pt:
        return fast_result(ins, outs)
    # Post-hook, vocab parallel: out partial SUM over mesh dims no letter uses means the weight's
    # rows are sharded there (each rank looked up its own rows). No notation derives an input
    # letter from an output's partial status, so the rows letter j is set here and out made
    # partial over it, as the forward plan would (out lacks j).
    used = {d for a in ins for e in a.dims_mapping for d in entry_dims(e)}  # type: ignore[union-attr]
    free = tuple(d for d, r in pt if r is ReduceType.SUM and d not in used)
    if not free:
        return fast_result(ins, outs)
    w, o = ins[1], outs[0]
    assert w is not None and o is not None
    make = TensorDistAttr.unchecked
    return fast_result((ins[0], make(mesh, (dims_entry(free), w.dims_mapping[1]))),
                       (make(mesh, o.dims_mapping, tuple(sorted((d, ReduceType.SUM) for d in free))),))


def embedding_grad(x: DistTensorSpec, weight: DistTensorSpec, out_grad: DistTensorSpec, padding_idx: int = -1,
                   sparse: bool = False) -> SpmdResult:
    """embedding_grad (EmbeddingGradInferSpmd): ``ab, jk, abk -> jk``; weight_grad keeps the
    weight's row sharding and is partial SUM over the batch letters' mesh dims."""
    op = "embedding_grad"
    _check(op, x, weight, out_grad)
    p = _plan(op, len(x.shape), "grad", False, _rows_replicated(op, padding_idx, sparse))
    return _run(op, p, (x, weight, out_grad), ("x", "weight", "out_grad"))


# -- c_embedding (the vocab-parallel kernel with an explicit start index) ------------------------


def c_embedding_forward(weight: DistTensorSpec, x: DistTensorSpec, start_index: int = 0,
                        vocab_size: int = -1) -> SpmdResult:
    """c_embedding (CEmbeddingInferSpmd): ``jk, ab -> abk``; ids outside
    ``[start_index, start_index + rows)`` give zeros, sharded rows make out partial SUM."""
    op = "c_embedding"
    _check(op, x, weight)
    check_int(op, "start_index", start_index)
    check_int(op, "vocab_size", vocab_size)
    return _run(op, _plan(op, len(x.shape), "forward", True, False), (weight, x), ("weight", "x"))


def _c_embedding_grad(op: str, weight: DistTensorSpec, x: DistTensorSpec, out_grad: DistTensorSpec,
                      start_index: int = 0) -> SpmdResult:
    _check(op, x, weight, out_grad)
    check_int(op, "start_index", start_index)
    p = _plan(op, len(x.shape), "grad", True, False)
    return _run(op, p, (weight, x, out_grad), ("weight", "x", "out_grad"))


def _c_grad_rule(op: str):  # type: ignore[no-untyped-def]
    return op_rule(op, _c_embedding_grad, f"{op} (CEmbeddingGradInferSpmd): ``jk, ab, abk -> jk``; weight_grad "
                   "keeps the weight's sharding, partial SUM over the batch letters' mesh dims.")


# -- one_hot ------------------------------------------------------------------------------------


@lru_cache(maxsize=1024)
def _one_hot_notation(nd: int) -> Notation:
    if nd >= len(ALPHABET):
        raise ShapeMismatchError(f"one_hot: x has {nd} dims, at most {len(ALPHABET) - 1} are supported")
    a = ALPHABET[:nd]
    return Notation([a], [a + ALPHABET[nd]])


def _check_classes(num_classes: object) -> None:
    if check_int("one_hot", "num_classes", num_classes) < 1:
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
    return reverse_largest("one_hot", _one_hot_notation(len(x.shape)), [x], [out], ["x", "out"])


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
    _c_grad_rule("c_embedding"), "weight: T, x: T, out_grad: T, start_index: int = 0", kind="grad",
    forward_name="CEmbeddingInferSpmd", backward_name="CEmbeddingGradInferSpmd",
)  # fmt: skip
register(
    "c_embedding_grad", _c_grad_rule("c_embedding_grad"),
    "weight: T, x: T, out_grad: T, start_index: int = 0", forward_name="CEmbeddingGradInferSpmd",
)  # fmt: skip
register(
    "one_hot", one_hot_forward, "x: T, num_classes: int", one_hot_backward, kind="reverse", outputs="out: T",
    forward_name="OneHotInferSpmd", backward_name="OneHotInferSpmdReverse",
)  # fmt: skip
