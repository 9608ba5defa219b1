"""embedding family (embedding / lookup_table_v2, c_embedding, one_hot and the grads): Paddle's
unit-test cases, hand-checked answers, deviations, errors, numeric grads and soundness."""

# mypy: disable-error-code="union-attr,index,arg-type"
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from spmd_helpers import J, T, dms, soundness_tests
from spmd_helpers import global_ctx as _ctx
from spmd_helpers import numeric_grad as _numeric_grad
from spmdkit.core.dist_attr import ReduceType
from spmdkit.core.errors import InvalidAttributeError, InvalidMeshError, ShapeMismatchError, SpmdError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.ops import get_rule
from spmdkit.sim import SOUND, UNSOUND, verify
from spmdkit.sim.reference import get_reference

M2 = ProcessMesh([2])
M4 = ProcessMesh([4])
M22 = ProcessMesh([2, 2])
M24 = ProcessMesh([2, 4])
SUM = ReduceType.SUM


def R(dm: list[Any], partial: dict[str, str] | None = None) -> dict[str, Any]:
    return {"dims_mapping": dm, "partial": partial or {}}


def case(rule: str, mesh: list[int], mode: str, *args: Any) -> dict[str, Any]:
    return {"rule": rule, "mesh": mesh, "mode": mode, "args": list(args)}


# ---------------------------------------------------------------------------
# Paddle's own unit tests (test_embedding_rule.py, test_c_embedding_rule.py, test_one_hot_rule.py)
# ---------------------------------------------------------------------------


def test_paddle_embedding_forward() -> None:
    r = get_rule("lookup_table_v2")
    x = T(M24, [4, 1024], [1, -1])
    # data parallel
    res = r.infer_forward(x, T(M24, [512, 768], [-1, -1]), -1, False)
    assert dms(res.inputs) == [(1, -1), (-1, -1)] and dms(res.outputs) == [(1, -1, -1)]
    # table col-wise parallel & dp
    res = r.infer_forward(x, T(M24, [512, 768], [-1, 0]), -1, False)
    assert dms(res.inputs) == [(1, -1), (-1, 0)] and dms(res.outputs) == [(1, -1, 0)]
    # table row-wise parallel & dp: out partial on the row mesh dim
    res = r.infer_forward(x, T(M24, [512, 768], [0, -1]), -1, False)
    assert dms(res.inputs) == [(1, -1), (0, -1)] and dms(res.outputs) == [(1, -1, -1)]
    assert res.outputs[0].partial == ((0, SUM),)


def test_paddle_embedding_row_parallel_padding_and_sparse() -> None:
    """Paddle's test expects ValueError (row-wise parallel with padding_idx 128, or sparse);
    spmdkit answers with the rows replicated (embedding-padding-rows)."""
    r = get_rule("lookup_table_v2")
    for pad, sparse in ((128, False), (-1, True)):
        res = r.infer_forward(T(M24, [4, 1024], [1, -1]), T(M24, [512, 768], [0, -1]), pad, sparse)
        assert dms(res.inputs) == [(1, -1), (-1, -1)] and dms(res.outputs) == [(1, -1, -1)]
        assert not res.outputs[0].partial


def test_paddle_embedding_backward() -> None:
    r = get_rule("lookup_table_v2")
    x, w = T(M24, [4, 1024], [-1, -1]), T(M24, [512, 768], [-1, -1])
    for out, want_x, want_w in (([1, -1, -1], (1, -1), (-1, -1)), ([-1, 0, 1], (-1, 0), (-1, 1)),
                                ([1, 0, -1], (1, 0), (-1, -1))):
        res = r.infer_backward(x, w, T(M24, [4, 1024, 768], out), -1, False)
        assert dms(res.inputs) == [want_x, want_w] and dms(res.outputs) == [tuple(out)]


def test_paddle_c_embedding_cases() -> None:
    r = get_rule("c_embedding")
    res = r.infer_forward(T(M24, [512, 768], [-1, -1]), T(M24, [4, 1024], [1, -1]), 0, -1)
    assert dms(res.inputs) == [(-1, -1), (1, -1)] and dms(res.outputs) == [(1, -1, -1)]
    res = r.infer_forward(T(M24, [512, 768], [1, -1]), T(M24, [4, 1024], [-1, -1]), 0, -1)
    assert dms(res.inputs) == [(1, -1), (-1, -1)] and dms(res.outputs) == [(-1, -1, -1)]
    assert res.outputs[0].partial == ((1, SUM),)
    # backward slot = CEmbeddingGradInferSpmd (Paddle's test also passes vocab_size, which the binding drops)
    res = r.infer_backward(T(M24, [512, 768], [1, -1]), T(M24, [4, 1024], [-1, -1]),
                           T(M24, [4, 1024, 768], [-1, -1, -1]), 0)
    assert dms(res.inputs) == [(1, -1), (-1, -1), (-1, -1, -1)] and dms(res.outputs) == [(1, -1)]
    res = r.infer_backward(T(M24, [512, 768], [1, -1]), T(M24, [4, 1024], [0, -1]),
                           T(M24, [4, 1024, 768], [0, -1, -1]), 0)
    assert dms(res.inputs) == [(1, -1), (0, -1), (0, -1, -1)] and dms(res.outputs) == [(1, -1)]
    assert res.outputs[0].partial == ((0, SUM),)  # the batch is summed over


def test_paddle_one_hot_cases() -> None:
    r = get_rule("one_hot")
    res = r.infer_forward(T(M24, [4, 1024], [0, 1]), 30000)
    assert dms(res.inputs) == [(0, 1)] and dms(res.outputs) == [(0, 1, -1)]
    res = r.infer_backward(T(M24, [4, 1024], [0, 1]), T(M24, [4, 1024, 30000], [0, 1, -1]), 30000)
    assert dms(res.inputs) == [(0, 1)] and dms(res.outputs) == [(0, 1, -1)]
    res = r.infer_backward(T(M24, [4, 1024], [-1, -1]), T(M24, [4, 1024, 30000], [0, -1, 1]), 30000)
    assert dms(res.inputs) == [(0, -1)] and dms(res.outputs) == [(0, -1, -1)]


# ---------------------------------------------------------------------------
# hand-checked answers
# ---------------------------------------------------------------------------


def test_vocab_parallel_rows_make_out_partial() -> None:
    """Each rank looks up only the ids of its row range and writes zeros elsewhere: the
    rank-local outs add up to the lookup, so out is partial SUM over the row mesh dim."""
    res = get_rule("embedding").infer_forward(T(M24, [4, 6], [0, -1]), T(M24, [8, 4], [1, -1]))
    assert dms(res.inputs) == [(0, -1), (1, -1)] and dms(res.outputs) == [(0, -1, -1)]
    assert res.outputs[0].partial == ((1, SUM),)
    c = case("embedding", [2, 4], "forward", J([4, 6], [0, -1]), J([8, 4], [1, -1]), -1, False)
    assert verify(None, c).status == SOUND
    # the same sharding without the partial is what a rank's zeros would make wrong
    not_partial = {"inputs": [R([0, -1]), R([1, -1])], "outputs": [R([0, -1, -1])]}
    assert verify(None, c, result=not_partial).status == UNSOUND


def test_c_embedding_rows_partial() -> None:
    """c_embedding: same row split; ids outside [start_index, start_index + rows) look up zeros."""
    res = get_rule("c_embedding").infer_forward(T(M24, [8, 4], [1, -1]), T(M24, [4, 6], [0, -1]), 3, 11)
    assert dms(res.inputs) == [(1, -1), (0, -1)] and dms(res.outputs) == [(0, -1, -1)]
    assert res.outputs[0].partial == ((1, SUM),)
    c = case("c_embedding", [2, 4], "forward", J([8, 4], [1, -1]), J([4, 6], [0, -1]), 3, 11)
    assert verify(None, c).status == SOUND


def test_hidden_axis_is_elementwise() -> None:
    res = get_rule("embedding").infer_forward(T(M24, [4, 6], [-1, 0]), T(M24, [8, 4], [-1, 1]))
    assert dms(res.outputs) == [(-1, 0, 1)] and not res.outputs[0].partial


def test_coshard_rows_keep_largest_mesh_dim() -> None:
    res = get_rule("embedding").infer_forward(T(M24, [4, 6], [-1, -1]), T(M24, [8, 4], [(0, 1), -1]))
    assert dms(res.inputs) == [(-1, -1), (1, -1)] and res.outputs[0].partial == ((1, SUM),)


def test_partial_inputs_resharded() -> None:
    """Ids cannot be partial (a sum of ids is not an id), nor a table the lookup reads rows from."""
    res = get_rule("embedding").infer_forward(T(M24, [4, 6], [-1, -1], [0]), T(M24, [8, 4], [-1, 1], [0]))
    assert not any(a.partial for a in res.inputs) and not res.outputs[0].partial
    assert dms(res.outputs) == [(-1, -1, 1)]
    res = get_rule("one_hot").infer_forward(T(M4, [4, 8], [-1, -1], [0]), 5)
    assert not res.inputs[0].partial and not res.outputs[0].partial


def test_embedding_grad_rows_and_batch() -> None:
    """weight_grad keeps the weight's row split (each rank scatters only its own rows) and is
    partial SUM over the batch mesh dims (each rank scatters only its own ids)."""
    g = get_rule("embedding_grad")
    res = g.infer_forward(T(M24, [4, 6], [0, -1]), T(M24, [8, 4], [1, -1]), T(M24, [4, 6, 4], [-1, -1, -1]))
    assert dms(res.inputs) == [(0, -1), (1, -1), (0, -1, -1)] and dms(res.outputs) == [(1, -1)]
    assert res.outputs[0].partial == ((0, SUM),)
    # the hidden axis merges weight and out_grad
    res = g.infer_forward(T(M24, [4, 6], [0, -1]), T(M24, [8, 4], [-1, -1]), T(M24, [4, 6, 4], [-1, -1, 1]))
    assert dms(res.inputs) == [(0, -1), (-1, 1), (0, -1, 1)] and dms(res.outputs) == [(-1, 1)]
    # padding_idx: the rows are replicated (the vocab-parallel kernel has no padding_idx)
    res = g.infer_forward(T(M24, [4, 6], [0, -1]), T(M24, [8, 4], [1, -1]), T(M24, [4, 6, 4], [-1, -1, -1]), 3)
    assert dms(res.outputs) == [(-1, -1)] and res.outputs[0].partial == ((0, SUM),)


def test_c_embedding_grad_rule() -> None:
    res = get_rule("c_embedding_grad").infer_forward(T(M24, [8, 4], [1, -1]), T(M24, [4, 6], [0, -1]),
                                                     T(M24, [4, 6, 4], [0, -1, -1]), 0)
    assert dms(res.inputs) == [(1, -1), (0, -1), (0, -1, -1)] and dms(res.outputs) == [(1, -1)]
    assert res.outputs[0].partial == ((0, SUM),)


def test_one_hot_class_axis_replicated() -> None:
    """The new class axis is never sharded; a reverse request for it is dropped."""
    res = get_rule("one_hot").infer_backward(T(M24, [4, 6], [-1, -1]), T(M24, [4, 6, 5], [-1, 0, 1]), 5)
    assert dms(res.inputs) == [(-1, 0)] and dms(res.outputs) == [(-1, 0, -1)]


def test_embedding_reverse_partial_out_becomes_rows() -> None:
    """A SUM-partial out over a mesh dim no axis uses is what vocab-parallel rows produce."""
    res = get_rule("embedding").infer_backward(T(M22, [4, 6], [-1, -1]), T(M22, [8, 4], [-1, -1]),
                                               T(M22, [4, 6, 4], [0, -1, -1], [1]))
    assert dms(res.inputs) == [(0, -1), (1, -1)] and dms(res.outputs) == [(0, -1, -1)]
    assert res.outputs[0].partial == ((1, SUM),)


# ---------------------------------------------------------------------------
# deviations (docs/deviations.md, embedding-*); Paddle's answers from the oracle
# ---------------------------------------------------------------------------


def test_padding_rows_replicated() -> None:
    """embedding-padding-rows: Paddle raises ValueError for row-sharded weights with padding_idx
    != -1 or sparse; spmdkit reshards the rows to replicated (so out is not partial)."""
    for pad, sparse in ((2, False), (-1, True)):
        res = get_rule("embedding").infer_forward(T(M2, [4, 6], [-1, -1]), T(M2, [8, 4], [0, -1]), pad, sparse)
        assert dms(res.inputs) == [(-1, -1), (-1, -1)] and dms(res.outputs) == [(-1, -1, -1)]
        assert not res.outputs[0].partial
        c = case("embedding", [2], "forward", J([4, 6], [-1, -1]), J([8, 4], [0, -1]), pad, sparse)
        assert verify(None, c).status == SOUND
    # a hidden split is fine with padding_idx (Paddle agrees)
    res = get_rule("embedding").infer_forward(T(M2, [4, 6], [-1, -1]), T(M2, [8, 4], [-1, 0]), 2, False)
    assert dms(res.inputs) == [(-1, -1), (-1, 0)] and dms(res.outputs) == [(-1, -1, 0)]


def test_embedding_mesh_conflict_resolved() -> None:
    """embedding-mesh-conflict: Paddle raises (PreconditionNotMet: Multiple Tensor Axes sharded by
    same mesh dimension) where x's batch and the weight claim one mesh dim; spmdkit keeps x's claim."""
    res = get_rule("embedding").infer_forward(T(M22, [4, 6], [0, -1]), T(M22, [8, 4], [-1, 0]))
    assert dms(res.inputs) == [(0, -1), (-1, -1)] and dms(res.outputs) == [(0, -1, -1)]
    res = get_rule("embedding").infer_forward(T(M22, [4, 6], [0, -1]), T(M22, [8, 4], [0, 1]))
    assert dms(res.inputs) == [(0, -1), (-1, 1)] and dms(res.outputs) == [(0, -1, 1)]
    assert not res.outputs[0].partial
    res = get_rule("c_embedding").infer_forward(T(M22, [8, 4], [0, -1]), T(M22, [6], [0]), 0, 8)
    assert dms(res.inputs) == [(0, -1), (-1,)] and res.outputs[0].partial == ((0, SUM),)
    # CEmbeddingGradInferSpmd raises for x [0] and out_grad [1, -1] (axis a on two mesh dims)
    res = get_rule("c_embedding").infer_backward(T(M22, [4, 8], [-1, -1]), T(M22, [6], [0]),
                                                 T(M22, [6, 8], [1, -1]), 0)
    assert dms(res.inputs) == [(-1, -1), (1,), (1, -1)] and res.outputs[0].partial == ((1, SUM),)
    for c in (case("embedding", [2, 2], "forward", J([4, 6], [0, -1]), J([8, 4], [0, 1]), -1, False),
              case("c_embedding", [2, 2], "backward", J([4, 8], [-1, -1]), J([6], [0]), J([6, 8], [1, -1]), 0)):
        assert verify(None, c).status == SOUND


def test_embedding_reverse_out_produced() -> None:
    """embedding-reverse-out (DESIGN class 4): EmbeddingInferSpmdReverse echoes out; spmdkit
    returns the out the inferred inputs produce."""
    # out partial over mesh dim 0 while Paddle's inputs are replicated
    c = case("embedding", [4], "backward", J([4, 6], [-1, -1]), J([8, 4], [-1, -1]), J([4, 6, 4], [-1, -1, -1], [0]),
             -1, False)
    paddle = {"inputs": [R([-1, -1]), R([-1, -1])], "outputs": [R([-1, -1, -1], {"0": "sum"})]}
    assert verify(None, c, result=paddle).status == UNSOUND
    res = get_rule("embedding").infer_backward(T(M4, [4, 6], [-1, -1]), T(M4, [8, 4], [-1, -1]),
                                               T(M4, [4, 6, 4], [-1, -1, -1], [0]))
    assert dms(res.inputs) == [(-1, -1), (0, -1)] and res.outputs[0].partial == ((0, SUM),)
    assert verify(None, c).status == SOUND
    # a co-sharded hidden axis: Paddle shards the weight on mesh dim 0 only but echoes out [.., [0, 1]]
    c = case("embedding", [2, 2], "backward", J([4, 6], [-1, -1]), J([8, 4], [-1, -1]), J([4, 6, 4], [-1, -1, [0, 1]]),
             -1, False)
    paddle = {"inputs": [R([-1, -1]), R([-1, 0])], "outputs": [R([-1, -1, [0, 1]])]}
    assert verify(None, c, result=paddle).status == UNSOUND
    res = get_rule("embedding").infer_backward(T(M22, [4, 6], [-1, -1]), T(M22, [8, 4], [-1, -1]),
                                               T(M22, [4, 6, 4], [-1, -1, (0, 1)]))
    assert dms(res.inputs) == [(-1, -1), (-1, 0)] and dms(res.outputs) == [(-1, -1, 0)]
    # with padding_idx the rows stay replicated, so a partial out cannot be produced
    c = case("embedding", [2, 2], "backward", J([4, 6], [-1, -1]), J([8, 4], [-1, -1]), J([4, 6, 4], [0, -1, -1], [1]),
             3, False)
    paddle = {"inputs": [R([0, -1]), R([-1, -1])], "outputs": [R([0, -1, -1], {"1": "sum"})]}
    assert verify(None, c, result=paddle).status == UNSOUND
    res = get_rule("embedding").infer_backward(T(M22, [4, 6], [-1, -1]), T(M22, [8, 4], [-1, -1]),
                                               T(M22, [4, 6, 4], [0, -1, -1], [1]), 3)
    assert dms(res.inputs) == [(0, -1), (-1, -1)] and not res.outputs[0].partial


def test_c_embedding_grad_merged() -> None:
    """embedding-c-grad (DESIGN class 6/8): CEmbeddingGradInferSpmd copies the weight's attr onto
    weight_grad and keeps x and out_grad as given."""
    r = get_rule("c_embedding")
    # hidden sharded on the weight, not on out_grad: Paddle's weight_grad [-1, 0] is built from a
    # full-width out_grad
    c = case("c_embedding", [2], "backward", J([5, 8], [-1, 0]), J([6], [-1]), J([6, 8], [-1, -1]), 0)
    paddle = {"inputs": [R([-1, 0]), R([-1]), R([-1, -1])], "outputs": [R([-1, 0])]}
    assert verify(None, c, result=paddle).status == UNSOUND
    res = r.infer_backward(T(M2, [5, 8], [-1, 0]), T(M2, [6], [-1]), T(M2, [6, 8], [-1, -1]), 0)
    assert dms(res.inputs) == [(-1, 0), (-1,), (-1, 0)] and dms(res.outputs) == [(-1, 0)]
    assert verify(None, c).status == SOUND
    # a partial x (ids) is kept by Paddle
    c = case("c_embedding", [2, 2], "backward", J([4, 8], [1, -1]), J([6], [-1], [0]), J([6, 8], [-1, -1]), 0)
    paddle = {"inputs": [R([1, -1]), R([-1], {"0": "sum"}), R([-1, -1])], "outputs": [R([1, -1])]}
    assert verify(None, c, result=paddle).status == UNSOUND
    res = r.infer_backward(T(M22, [4, 8], [1, -1]), T(M22, [6], [-1], [0]), T(M22, [6, 8], [-1, -1]), 0)
    assert not any(a.partial for a in res.inputs) and dms(res.outputs) == [(1, -1)] and not res.outputs[0].partial
    # a partial weight is copied onto weight_grad by Paddle
    c = case("c_embedding", [2, 2], "backward", J([4, 8], [1, -1], [0]), J([6], [-1]), J([6, 8], [-1, -1]), 0)
    paddle = {"inputs": [R([1, -1], {"0": "sum"}), R([-1]), R([-1, -1])], "outputs": [R([1, -1], {"0": "sum"})]}
    assert verify(None, c, result=paddle).status == UNSOUND
    assert verify(None, c).status == SOUND
    # batch and rows on one mesh dim: Paddle raises ("Trying to Set dim 0 as Partial which is a
    # Sharding dim"); spmdkit keeps the rows and reshards out_grad
    res = r.infer_backward(T(M2, [5, 8], [0, -1]), T(M2, [6], [-1]), T(M2, [6, 8], [0, -1]), 0)
    assert dms(res.inputs) == [(0, -1), (-1,), (-1, -1)] and dms(res.outputs) == [(0, -1)]
    assert not res.outputs[0].partial


def test_one_hot_input_matches_out() -> None:
    """embedding-one-hot-input (DESIGN class 6): OneHotInferSpmd keeps a partial or co-sharded x
    while out is neither."""
    c = case("one_hot", [4], "forward", J([4, 8], [-1, -1], [0]), 5)
    paddle = {"inputs": [R([-1, -1], {"0": "sum"})], "outputs": [R([-1, -1, -1])]}
    assert verify(None, c, result=paddle).status == UNSOUND
    assert verify(None, c).status == SOUND
    c = case("one_hot", [2, 4], "forward", J([8], [[0, 1]]), 5)
    paddle = {"inputs": [R([[0, 1]])], "outputs": [R([1, -1])]}
    assert verify(None, c, result=paddle).status == UNSOUND
    res = get_rule("one_hot").infer_forward(T(M24, [8], [(0, 1)]), 5)
    assert dms(res.inputs) == [(1,)] and dms(res.outputs) == [(1, -1)]
    assert verify(None, c).status == SOUND


# ---------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "mode", "args", "exc", "words"),
    [
        ("embedding", "forward", (T(M22, [4, 6], [-1, -1]), T(M22, [8], [-1])), ShapeMismatchError, "weight"),
        ("embedding", "forward", (T(M22, [4, 6], [-1, -1]), T(M22, [8, 4], [-1, -1]), 1.5), InvalidAttributeError,
         "padding_idx"),
        ("embedding", "backward", (T(M22, [4, 6], [-1, -1]), T(M22, [8, 4], [-1, -1]), T(M22, [4, 6, 5], [-1, -1, -1])),
         ShapeMismatchError, "out"),
        ("embedding", "backward", (T(M22, [4, 6], [-1, -1]), T(M22, [8, 4], [-1, -1]), T(M22, [4, 6], [-1, -1])),
         ShapeMismatchError, "out"),
        ("embedding", "backward", (T(M22, [4, 6], [-1, -1]), T(M22, [8, 4], [-1, -1]), T(M4, [4, 6, 4], [-1, -1, -1])),
         InvalidMeshError, "mesh"),
        ("embedding_grad", "forward",
         (T(M22, [4, 6], [-1, -1]), T(M22, [8, 4], [-1, -1]), T(M22, [4, 7, 4], [-1, -1, -1])),
         ShapeMismatchError, "out_grad"),
        ("c_embedding", "forward", (T(M22, [8, 4, 2], [-1, -1, -1]), T(M22, [4], [-1])), ShapeMismatchError, "weight"),
        ("c_embedding", "forward", (T(M22, [8, 4], [-1, -1]), T(M22, [4], [-1]), "0"), InvalidAttributeError,
         "start_index"),
        ("c_embedding_grad", "forward", (T(M22, [8, 4], [-1, -1]), T(M22, [4], [-1]), T(M22, [4, 5], [-1, -1])),
         ShapeMismatchError, "out_grad"),
        ("one_hot", "forward", (T(M22, [4], [-1]), 0), InvalidAttributeError, "num_classes"),
        ("one_hot", "forward", (T(M22, [4], [-1]), True), InvalidAttributeError, "num_classes"),
        ("one_hot", "backward", (T(M22, [4], [-1]), T(M22, [4, 6], [-1, -1]), 5), ShapeMismatchError, "num_classes"),
        ("one_hot", "backward", (T(M22, [4], [-1]), T(M22, [4], [-1]), 5), ShapeMismatchError, "out"),
        # out's rank is checked with its letters (num_classes matches its last axis here)
        ("one_hot", "backward", (T(M22, [4], [-1]), T(M22, [4, 2, 5], [-1, -1, -1]), 5), ShapeMismatchError,
         "out has 3 dims"),
        ("one_hot", "backward", (T(M22, [4], [-1]), T(M22, [3, 5], [-1, -1]), 5), ShapeMismatchError, "out"),
        ("embedding", "backward", (T(M22, [4, 6], [-1, -1]), T(M22, [8, 4], [-1, -1]), T(M22, [4, 6, 5], [-1, -1, -1])),
         ShapeMismatchError, "out's axis 2 (h) is 5 but weight's axis 1 is 4"),
    ],
)
def test_errors(name: str, mode: str, args: tuple[Any, ...], exc: type, words: str) -> None:
    r = get_rule(name)
    with pytest.raises(exc) as e:
        (r.infer_forward if mode == "forward" else r.infer_backward)(*args)
    assert isinstance(e.value, SpmdError)
    msg = str(e.value)
    assert msg.startswith(name) and words in msg, msg


# ---------------------------------------------------------------------------
# the references' grads are real gradients
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("padding_idx", [-1, 2])
def test_embedding_grad_numeric(padding_idx: int) -> None:
    rng = np.random.default_rng(0)
    ids = np.array([[0, 2, 4], [2, 2, 1]])  # repeated ids accumulate
    w = rng.standard_normal((5, 3))
    g = rng.standard_normal((2, 3, 3))
    attrs = {"padding_idx": padding_idx, "sparse": False}
    fwd = get_reference("embedding")
    want = _numeric_grad(lambda v: fwd.run({"x": ids, "weight": v, **attrs}, _ctx())[0], w, g)
    got = get_reference("embedding_grad").run({"x": ids, "weight": w, "out_grad": g, **attrs}, _ctx())[0]
    assert np.allclose(got, want, atol=1e-5)
    if padding_idx >= 0:
        assert np.all(got[padding_idx] == 0)


@pytest.mark.parametrize("start_index", [0, 3])
def test_c_embedding_grad_numeric(start_index: int) -> None:
    rng = np.random.default_rng(1)
    ids = np.array([start_index, start_index + 3, start_index + 4, start_index + 1, start_index + 3])  # +4: out of range
    w = rng.standard_normal((4, 2))
    g = rng.standard_normal((5, 2))
    fwd = get_reference("c_embedding")
    out = fwd.run({"weight": w, "x": ids, "start_index": start_index}, _ctx())[0]
    assert np.all(out[2] == 0)
    want = _numeric_grad(lambda v: fwd.run({"weight": v, "x": ids, "start_index": start_index}, _ctx())[0], w, g)
    got = get_reference("c_embedding_grad").run({"weight": w, "x": ids, "out_grad": g, "start_index": start_index},
                                                _ctx())[0]
    assert np.allclose(got, want, atol=1e-5)


# ---------------------------------------------------------------------------
# soundness over generated cases
# ---------------------------------------------------------------------------

RULES = ["embedding", "lookup_table_v2", "c_embedding", "one_hot"]
GRADS = ["embedding_grad", "c_embedding_grad"]


test_sound, test_grad_sound = soundness_tests(RULES, GRADS, 200, 7)
