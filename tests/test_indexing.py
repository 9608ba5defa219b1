"""indexing family (gather, index_select, gather_nd, scatter, scatter_nd_add, where and their grads):
Paddle's unit-test cases, hand-checked answers, deviations, grads, errors and soundness."""

# mypy: disable-error-code="union-attr,index,arg-type"
from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from spmd_helpers import J, T, dms, soundness_tests
from spmd_helpers import global_ctx as _ctx
from spmdkit.core.dist_attr import ReduceType
from spmdkit.core.errors import (
    InvalidAttributeError,
    InvalidDimsMappingError,
    InvalidMeshError,
    ShapeMismatchError,
    SpmdError,
)
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.spec import DistTensorSpec
from spmdkit.io.codec import answer_line
from spmdkit.ops import get_rule
from spmdkit.sim import SOUND, UNSOUND, verify
from spmdkit.sim.reference import get_reference

M2 = ProcessMesh([2])
M4 = ProcessMesh([4])
M22 = ProcessMesh([2, 2])
M23 = ProcessMesh([2, 3])
M24 = ProcessMesh([2, 4])
SUM0 = ((0, ReduceType.SUM),)


def R(dm: list[Any], partial: Any = None) -> dict[str, Any]:
    d: dict[str, Any] = {"dims_mapping": dm}
    if partial is not None:
        d["partial"] = partial
    return d


def case(rule: str, mesh: list[int], mode: str, *args: Any) -> dict[str, Any]:
    return {"rule": rule, "mesh": mesh, "mode": mode, "args": list(args)}


def paddle(ins: list[Any], outs: list[Any]) -> dict[str, Any]:
    return {"inputs": ins, "outputs": outs}


# ---------------------------------------------------------------------------
# Paddle's own unit tests (test/auto_parallel/spmd_rules/test_<op>_rule.py)
# ---------------------------------------------------------------------------


def test_paddle_gather_single_mesh_dim() -> None:
    """test_gather_rule.py::test_single_mesh_dim (mesh [4], x [64, 32, 48], index [16])."""
    r = get_rule("gather")
    x = [64, 32, 48]
    res = r.infer_forward(T(M4, x, [0, -1, -1]), T(M4, [16], [-1]), 0)
    assert dms(res.inputs) == [(-1, -1, -1), (-1,)] and dms(res.outputs) == [(-1, -1, -1)]
    res = r.infer_forward(T(M4, x, [-1, 0, -1]), T(M4, [16], [-1]), 0)
    assert dms(res.inputs) == [(-1, 0, -1), (-1,)] and dms(res.outputs) == [(-1, 0, -1)]
    res = r.infer_forward(T(M4, x, [0, -1, -1]), T(M4, [16], [0]), 0)
    assert dms(res.inputs) == [(-1, -1, -1), (0,)] and dms(res.outputs) == [(0, -1, -1)]
    # 0-d index: Paddle's test gives it the mapping [0] (Paddle requires one entry for a 0-d
    # tensor); spmdkit takes the well-formed 0-entry mapping and answers as Paddle otherwise
    res = r.infer_forward(T(M4, x, [-1, 0, -1]), T(M4, [], []), 1)
    assert dms(res.inputs) == [(-1, -1, -1), ()] and dms(res.outputs) == [(-1, -1)]


def test_paddle_gather_multi_mesh_dim() -> None:
    """test_gather_rule.py::test_multi_mesh_dim (mesh [2, 3], axis 1)."""
    r = get_rule("gather")
    x = [64, 32, 48]
    res = r.infer_forward(T(M23, x, [0, 1, -1]), T(M23, [16], [1]), 1)
    assert dms(res.inputs) == [(0, -1, -1), (1,)] and dms(res.outputs) == [(0, 1, -1)]
    # Paddle: index stays [0] while out drops it (indexing-index-conflict); spmdkit replicates it
    res = r.infer_forward(T(M23, x, [0, 1, -1]), T(M23, [16], [0]), 1)
    assert dms(res.inputs) == [(0, -1, -1), (-1,)] and dms(res.outputs) == [(0, -1, -1)]


def test_paddle_gather_reverse() -> None:
    """test_gather_rule.py::test_reverse_multi_mesh_dim: out [1, 0, -1] -> x [1, -1, -1], index [0].
    Paddle's test passes out with x's shape ([64, 32, 48] for index [16]): rejected; with out's
    true shape [64, 16, 48] spmdkit answers as Paddle."""
    r = get_rule("gather")
    x, i = T(M23, [64, 32, 48], [-1, -1, -1]), T(M23, [16], [-1])
    with pytest.raises(ShapeMismatchError, match="gather"):
        r.infer_backward(x, i, T(M23, [64, 32, 48], [1, 0, -1]), 1)
    res = r.infer_backward(x, i, T(M23, [64, 16, 48], [1, 0, -1]), 1)
    assert dms(res.inputs) == [(1, -1, -1), (0,)] and dms(res.outputs) == [(1, 0, -1)]


def test_paddle_gather_nd_cases() -> None:
    """test_gather_nd_rule.py (mesh [2, 4])."""
    r = get_rule("gather_nd")
    res = r.infer_forward(T(M24, [10, 20], [-1, -1]), T(M24, [2, 4, 1], [0, -1, -1]))
    assert dms(res.inputs) == [(-1, -1), (0, -1, -1)] and dms(res.outputs) == [(0, -1, -1)]
    res = r.infer_forward(T(M24, [10], [-1]), T(M24, [8, 1], [0, -1]))
    assert dms(res.inputs) == [(-1,), (0, -1)] and dms(res.outputs) == [(0,)]
    res = r.infer_backward(T(M24, [10, 20], [-1, -1]), T(M24, [2, 4, 1], [0, -1, -1]), T(M24, [2, 4, 20], [0, -1, -1]))
    assert dms(res.inputs) == [(-1, -1), (0, -1, -1)] and dms(res.outputs) == [(0, -1, -1)]
    res = r.infer_backward(T(M24, [10], [-1]), T(M24, [8, 1], [0, -1]), T(M24, [8], [0]))
    assert dms(res.inputs) == [(-1,), (0, -1)] and dms(res.outputs) == [(0,)]
    # "same shape" cases: index [4] holds 4 coordinates into a 1-D x (indexing-paddle-test-shapes)
    with pytest.raises(ShapeMismatchError, match="gather_nd: index"):
        r.infer_forward(T(M24, [10], [-1]), T(M24, [4], [0]))
    with pytest.raises(ShapeMismatchError, match="gather_nd: index"):
        r.infer_backward(T(M24, [10], [-1]), T(M24, [4], [0]), T(M24, [4], [0]))


def _scatter_like(name: str, idx: list[int], idx_dm: list[Any] | None = None) -> list[Any]:
    """The five forward cases and the reverse case of test_scatter_rule.py / test_scatter_nd_add_rule.py
    with the index shape ``idx``; each item (inputs, outputs-with-partial)."""
    r = get_rule(name)
    x, u = [64, 32, 48], [32, 32, 48]
    extra = (True,) if name == "scatter" else ()

    def i(m: ProcessMesh, d: int) -> DistTensorSpec:
        return T(m, idx, [d] + [-1] * (len(idx) - 1))

    out = []
    for m, xd, idd, ud in ((M4, [-1, -1, -1], -1, [-1, 0, -1]), (M4, [0, -1, -1], -1, [0, -1, -1]),
                           (M4, [-1, 0, -1], -1, [-1, -1, -1]), (M23, [1, -1, 0], -1, [-1, 0, -1]),
                           (M23, [-1, -1, -1], 0, [-1, 1, -1])):
        out.append(r.infer_forward(T(m, x, xd), i(m, idd), T(m, u, ud), *extra))
    out.append(r.infer_backward(T(M23, x, [-1, -1, -1]), i(M23, -1), T(M23, u, [-1, -1, -1]),
                                T(M23, x, [1, 0, -1]), *extra))
    return out


def test_paddle_scatter_cases() -> None:
    """test_scatter_rule.py. Paddle's test uses index [16] with updates [32, ...]: rejected. With
    index [32] spmdkit answers as Paddle except where Paddle shards the updates' batch axis and marks
    out partial (cases 2 and 5, indexing-scatter-batch): spmdkit replicates that axis."""
    r = get_rule("scatter")
    with pytest.raises(ShapeMismatchError, match=r"scatter: .*updates"):
        r.infer_forward(T(M4, [64, 32, 48], [-1, -1, -1]), T(M4, [16], [-1]), T(M4, [32, 32, 48], [-1, 0, -1]), True)
    res = _scatter_like("scatter", [32])
    want = [
        ([(-1, 0, -1), (-1,), (-1, 0, -1)], (-1, 0, -1)),
        ([(-1, -1, -1), (-1,), (-1, -1, -1)], (-1, -1, -1)),  # Paddle: index [0], out partial {0}
        ([(-1, -1, -1), (-1,), (-1, -1, -1)], (-1, -1, -1)),
        ([(-1, 0, -1), (-1,), (-1, 0, -1)], (-1, 0, -1)),
        ([(-1, 1, -1), (-1,), (-1, 1, -1)], (-1, 1, -1)),  # Paddle: index [0], updates [0,1,-1], partial {0}
        ([(-1, 0, -1), (-1,), (-1, 0, -1)], (-1, 0, -1)),  # reverse
    ]
    for got, (ins, o) in zip(res, want):
        assert dms(got.inputs) == ins and dms(got.outputs) == [o] and not got.outputs[0].partial


def test_paddle_scatter_nd_add_cases() -> None:
    """test_scatter_nd_add_rule.py. Paddle's test uses index [16] (16 coordinates into a 3-D x):
    rejected. With index [32, 1] spmdkit answers as Paddle on x, updates and out, except that the
    index's coordinate axis stays replicated and, with the updates' batch sharded (cases 2 and 5),
    x is asked partial SUM, as out (indexing-scatter-nd-add)."""
    r = get_rule("scatter_nd_add")
    with pytest.raises(ShapeMismatchError, match="scatter_nd_add: index"):
        r.infer_forward(T(M4, [64, 32, 48], [-1, -1, -1]), T(M4, [16], [-1]), T(M4, [32, 32, 48], [-1, 0, -1]))
    res = _scatter_like("scatter_nd_add", [32, 1])
    want = [
        ([(-1, 0, -1), (-1, -1), (-1, 0, -1)], (-1, 0, -1), False),
        ([(-1, -1, -1), (0, -1), (0, -1, -1)], (-1, -1, -1), True),
        ([(-1, -1, -1), (-1, -1), (-1, -1, -1)], (-1, -1, -1), False),
        ([(-1, 0, -1), (-1, -1), (-1, 0, -1)], (-1, 0, -1), False),
        ([(-1, 1, -1), (0, -1), (0, 1, -1)], (-1, 1, -1), True),
        ([(-1, 0, -1), (-1, -1), (-1, 0, -1)], (-1, 0, -1), False),
    ]
    for got, (ins, o, part) in zip(res, want):
        assert dms(got.inputs) == ins and dms(got.outputs) == [o]
        assert got.outputs[0].partial == (SUM0 if part else ())
        assert got.inputs[0].partial == got.outputs[0].partial


def test_paddle_where_cases() -> None:
    """test_where_rule.py: condition [16,16,16] [-1,0,-1], x [16,16] [-1,0], y [16] [0]: condition
    claims mesh 0 on axis 1 first, so x's last axis and y lose it."""
    r = get_rule("where")
    c, x, y = T(M22, [16, 16, 16], [-1, 0, -1]), T(M22, [16, 16], [-1, 0]), T(M22, [16], [0])
    for res in (r.infer_forward(c, x, y), r.infer_backward(c, x, y, c)):
        assert dms(res.inputs) == [(-1, 0, -1), (0, -1), (-1,)] and dms(res.outputs) == [(-1, 0, -1)]


def test_paddle_index_select_cases() -> None:
    """test_index_select_rule.py (cases in comments): forward [-1,-1,-1], [0], axis 1 -> out
    [-1,0,-1]; backward (IndexSelectGradInferSpmd) -> x_grad [-1,-1,-1] partial SUM on mesh 0."""
    r = get_rule("index_select")
    x, i = T(M2, [8, 16, 4], [-1, -1, -1]), T(M2, [6], [0])
    res = r.infer_forward(x, i, 1)
    assert dms(res.inputs) == [(-1, -1, -1), (0,)] and dms(res.outputs) == [(-1, 0, -1)]
    res = r.infer_backward(x, i, T(M2, [8, 6, 4], [-1, 0, -1]), 1)
    assert dms(res.inputs) == [(-1, -1, -1), (0,), (-1, 0, -1)] and dms(res.outputs) == [(-1, -1, -1)]
    assert res.outputs[0].partial == SUM0


# ---------------------------------------------------------------------------
# hand-checked answers
# ---------------------------------------------------------------------------


def test_gather_axis_replicated_other_axes_kept() -> None:
    """The index holds global positions on the gathered axis: that axis is replicated, the others
    pass through to out, and the index's sharding becomes out's gathered axis."""
    res = get_rule("gather").infer_forward(T(M23, [6, 8, 4], [-1, 0, 1]), T(M23, [4], [-1]), 1)
    assert dms(res.inputs) == [(-1, -1, 1), (-1,)] and dms(res.outputs) == [(-1, -1, 1)]
    res = get_rule("gather").infer_forward(T(M23, [6, 8], [-1, 1]), T(M23, [4], [0], [1]), -2)
    assert dms(res.inputs) == [(-1, 1), (0,)] and dms(res.outputs) == [(0, 1)]
    assert not any(a.partial for a in res.inputs)  # an index cannot be partial


def test_gather_index_n1_and_0d() -> None:
    """An index [N, 1] acts as [N] (its size-1 axis never sharded); a 0-d index drops the axis."""
    res = get_rule("gather").infer_forward(T(M23, [6, 8], [-1, 1]), T(M23, [4, 1], [0, -1]), 0)
    assert dms(res.inputs) == [(-1, 1), (0, -1)] and dms(res.outputs) == [(0, 1)]
    res = get_rule("gather").infer_forward(T(M23, [6, 8], [-1, 1]), T(M23, [], []), 0)
    assert dms(res.inputs) == [(-1, 1), ()] and dms(res.outputs) == [(1,)]


def test_gather_coshard_keeps_largest() -> None:
    """gather keeps one mesh dim of a co-sharded axis (the largest, as Paddle's merge); index_select
    keeps the co-shard (IndexSelectInferSpmd does not reduce it; sound)."""
    res = get_rule("gather").infer_forward(T(M24, [8, 8], [(0, 1), -1]), T(M24, [4], [-1]), 1)
    assert dms(res.inputs) == [(1, -1), (-1,)] and dms(res.outputs) == [(1, -1)]
    res = get_rule("index_select").infer_forward(T(M22, [6, 8], [(0, 1), -1]), T(M22, [4], [-1]), 1)
    assert dms(res.inputs) == [((0, 1), -1), (-1,)] and dms(res.outputs) == [((0, 1), -1)]


def test_gather_grads_partial_over_index() -> None:
    """x_grad is a scatter-add of out_grad: with the index sharded each rank adds its own rows,
    so x_grad is partial SUM over the index's mesh dims."""
    for name in ("gather_grad", "index_select_grad"):
        res = get_rule(name).infer_forward(T(M23, [6, 8], [-1, 1]), T(M23, [4], [0]), T(M23, [4, 8], [-1, -1]), 0)
        assert dms(res.inputs) == [(-1, 1), (0,), (0, 1)] and dms(res.outputs) == [(-1, 1)], name
        assert res.outputs[0].partial == SUM0, name


def test_gather_nd_indexed_axes_and_coordinates_replicated() -> None:
    """gather_nd: x's indexed axes and the index's coordinate axis are replicated; the index's batch
    axes and x's trailing axes make out."""
    r = get_rule("gather_nd")
    res = r.infer_forward(T(M23, [6, 8, 4], [0, 1, -1]), T(M23, [5, 2], [-1, -1]))
    assert dms(res.inputs) == [(-1, -1, -1), (-1, -1)] and dms(res.outputs) == [(-1, -1)]
    res = r.infer_forward(T(M23, [6, 8, 4], [-1, -1, 1]), T(M23, [6, 2], [0, 1]))
    assert dms(res.inputs) == [(-1, -1, 1), (0, -1)] and dms(res.outputs) == [(0, 1)]


def test_gather_nd_grad_partial_over_batch() -> None:
    res = get_rule("gather_nd_grad").infer_forward(T(M23, [6, 8, 4], [-1, -1, 1]), T(M23, [6, 2], [0, -1]),
                                                   T(M23, [6, 4], [-1, -1]))
    assert dms(res.inputs) == [(-1, -1, 1), (0, -1), (0, 1)] and dms(res.outputs) == [(-1, -1, 1)]
    assert res.outputs[0].partial == SUM0


def test_scatter_rows_and_batch_replicated() -> None:
    """scatter overwrites x's rows: the rows axis and the updates' batch axis stay replicated, the
    trailing axes come from the updates (x takes out's sharding)."""
    res = get_rule("scatter").infer_forward(T(M23, [8, 6], [0, 1]), T(M23, [4], [0]), T(M23, [4, 6], [0, -1]), True)
    assert dms(res.inputs) == [(-1, -1), (-1,), (-1, -1)] and dms(res.outputs) == [(-1, -1)]
    res = get_rule("scatter").infer_forward(T(M2, [6, 4], [-1, 0]), T(M2, [], []), T(M2, [4], [0]), True)
    assert dms(res.inputs) == [(-1, 0), (), (0,)] and dms(res.outputs) == [(-1, 0)]


def test_scatter_grad() -> None:
    res = get_rule("scatter_grad").infer_forward(T(M23, [4], [0]), T(M23, [4, 6], [0, -1]), T(M23, [8, 6], [0, 1]),
                                                 True)
    assert dms(res.inputs) == [(-1,), (-1, 1), (-1, 1)] and dms(res.outputs) == [(-1, 1), (-1, 1)]
    assert not any(a.partial for a in res.outputs)


def test_scatter_nd_add_x_partial_over_batch() -> None:
    """Each rank adds its own share of updates: x is asked partial SUM over the batch's mesh dims
    (so x is counted once), and out is partial SUM."""
    r = get_rule("scatter_nd_add")
    res = r.infer_forward(T(M23, [8, 6], [-1, 1]), T(M23, [4, 1], [0, -1]), T(M23, [4, 6], [-1, -1]))
    assert dms(res.inputs) == [(-1, -1), (0, -1), (0, -1)] and dms(res.outputs) == [(-1, -1)]
    assert res.inputs[0].partial == SUM0 and res.outputs[0].partial == SUM0
    res = r.infer_backward(T(M23, [8, 6], [0, 1]), T(M23, [4, 1], [0, -1]), T(M23, [4, 6], [-1, -1]),
                           T(M23, [8, 6], [0, 1]))
    assert dms(res.inputs) == [(-1, 1), (-1, -1), (-1, 1)] and dms(res.outputs) == [(-1, 1)]


def test_scatter_nd_add_grad() -> None:
    """x_grad is out_grad itself (never partial); updates_grad gathers it."""
    res = get_rule("scatter_nd_add_grad").infer_forward(T(M23, [4, 1], [0, -1]), T(M23, [4, 6], [-1, 1]),
                                                        T(M23, [8, 6], [-1, -1]))
    assert dms(res.inputs) == [(0, -1), (0, 1), (-1, 1)] and dms(res.outputs) == [(-1, 1), (0, 1)]
    assert not any(a.partial for a in res.outputs)


def test_where_broadcast_axes_never_sharded() -> None:
    r = get_rule("where")
    res = r.infer_forward(T(M22, [4, 1], [0, 1]), T(M22, [4, 6], [-1, 1]), T(M22, [6], [0]))
    assert dms(res.inputs) == [(0, -1), (0, 1), (1,)] and dms(res.outputs) == [(0, 1)]
    res = r.infer_backward(T(M22, [4, 1], [-1, -1]), T(M22, [4, 6], [-1, -1]), T(M22, [6], [-1]),
                           T(M22, [4, 6], [0, 1]))
    assert dms(res.inputs) == [(0, -1), (0, 1), (1,)] and dms(res.outputs) == [(0, 1)]


def test_where_grad_partial_over_broadcast() -> None:
    """x [1, 6] broadcast over axis 0 (sharded on mesh 0): x_grad sums over it, partial SUM on mesh 0."""
    res = get_rule("where_grad").infer_forward(T(M22, [4, 6], [0, -1]), T(M22, [1, 6], [-1, 1]),
                                               T(M22, [6], [-1]), T(M22, [4, 6], [-1, -1]))
    assert dms(res.outputs) == [(-1, 1), (1,)]
    assert res.outputs[0].partial == SUM0 and res.outputs[1].partial == SUM0


# ---------------------------------------------------------------------------
# deviations (docs/deviations.md, indexing-*)
# ---------------------------------------------------------------------------


def test_index_conflict() -> None:
    """indexing-index-conflict: x and the index claim one mesh dim; Paddle keeps the index sharded
    while out drops it (gather) or shards out twice on it (gather_nd)."""
    c = case("gather", [2, 3], "forward", J([6, 8], [0, -1]), J([4], [0]), 1)
    p = paddle([R([0, -1]), R([0])], [R([0, -1])])
    assert verify(None, c, result=p).status == UNSOUND
    res = get_rule("gather").infer_forward(T(M23, [6, 8], [0, -1]), T(M23, [4], [0]), 1)
    assert dms(res.inputs) == [(0, -1), (-1,)] and dms(res.outputs) == [(0, -1)]
    assert verify(None, c).status == SOUND
    c = case("gather_nd", [2], "forward", J([2, 2, 2], [-1, 0, -1]), J([2, 4, 1], [0, -1, -1]))
    p = paddle([R([-1, 0, -1]), R([0, -1, -1])], [R([0, -1, 0, -1])])
    assert verify(None, c, result=p).status == UNSOUND
    res = get_rule("gather_nd").infer_forward(T(M2, [2, 2, 2], [-1, 0, -1]), T(M2, [2, 4, 1], [0, -1, -1]))
    assert dms(res.inputs) == [(-1, 0, -1), (-1, -1, -1)] and dms(res.outputs) == [(-1, -1, 0, -1)]
    assert verify(None, c).status == SOUND


def test_reverse_out() -> None:
    """indexing-reverse-out: Paddle's gather / gather_nd reverse echo a partial or co-sharded out."""
    c = case("gather", [3], "backward", J([6], [-1]), J([1], [0]), J([1], [-1], [0]), 0)
    p = paddle([R([-1]), R([-1])], [R([-1], {"0": "sum"})])
    assert verify(None, c, result=p).status == UNSOUND
    assert verify(None, c).status == SOUND
    res = get_rule("gather").infer_backward(T(ProcessMesh([3]), [6], [-1]), T(ProcessMesh([3]), [1], [0]),
                                            T(ProcessMesh([3]), [1], [-1], [0]), 0)
    assert dms(res.outputs) == [(-1,)] and not res.outputs[0].partial
    c = case("gather_nd", [2, 2], "backward", J([4, 2], [-1, -1]), J([2, 1], [0, 1]), J([2, 2], [[0, 1], -1]))
    p = paddle([R([-1, -1]), R([0, -1])], [R([[0, 1], -1])])
    assert verify(None, c, result=p).status == UNSOUND
    res = get_rule("gather_nd").infer_backward(T(M22, [4, 2], [-1, -1]), T(M22, [2, 1], [0, 1]),
                                               T(M22, [2, 2], [(0, 1), -1]))
    assert dms(res.inputs) == [(-1, -1), (0, -1)] and dms(res.outputs) == [(0, -1)]
    assert verify(None, c).status == SOUND


def test_scatter_batch_replicated() -> None:
    """indexing-scatter-batch: Paddle shards the updates' batch axis and marks out partial SUM with x
    replicated (its own unit test, index [32]): x is counted once per rank."""
    args = (J([64, 32, 48], [0, -1, -1]), J([32], [-1]), J([32, 32, 48], [0, -1, -1]), True)
    c = case("scatter", [4], "forward", *args)
    p = paddle([R([-1, -1, -1]), R([0]), R([0, -1, -1])], [R([-1, -1, -1], {"0": "sum"})])
    assert verify(None, c, result=p).status == UNSOUND
    assert verify(None, c).status == SOUND
    res = get_rule("scatter").infer_forward(T(M4, [64, 32, 48], [0, -1, -1]), T(M4, [32], [-1]),
                                            T(M4, [32, 32, 48], [0, -1, -1]), True)
    assert dms(res.inputs) == [(-1, -1, -1), (-1,), (-1, -1, -1)] and not res.outputs[0].partial


def test_scatter_nd_add_x_partial() -> None:
    """indexing-scatter-nd-add: Paddle keeps x replicated under a partial out, and shards the
    index's coordinate axis (labelling it as an updates axis)."""
    c = case("scatter_nd_add", [4], "forward", J([64, 32, 48], [0, -1, -1]), J([32, 1], [-1, -1]),
             J([32, 32, 48], [0, -1, -1]))
    p = paddle([R([-1, -1, -1]), R([0, -1]), R([0, -1, -1])], [R([-1, -1, -1], {"0": "sum"})])
    assert verify(None, c, result=p).status == UNSOUND
    assert verify(None, c).status == SOUND
    c = case("scatter_nd_add", [4], "forward", J([64, 32, 48], [-1, -1, -1]), J([32, 1], [-1, -1]),
             J([32, 32, 48], [-1, 0, -1]))
    p = paddle([R([-1, 0, -1]), R([-1, 0]), R([-1, 0, -1])], [R([-1, 0, -1])])
    assert verify(None, c, result=p).status == UNSOUND
    res = get_rule("scatter_nd_add").infer_forward(T(M4, [64, 32, 48], [-1, -1, -1]), T(M4, [32, 1], [-1, -1]),
                                                   T(M4, [32, 32, 48], [-1, 0, -1]))
    assert dms(res.inputs) == [(-1, 0, -1), (-1, -1), (-1, 0, -1)]
    assert verify(None, c).status == SOUND


def test_where_broadcast_axis() -> None:
    """indexing-where-broadcast: Paddle shards size-1 broadcast axes (y [1] on mesh 0 of size 4)."""
    c = case("where", [4], "forward", J([2], [0]), J([], []), J([1], [-1]))
    p = paddle([R([0]), R([]), R([0])], [R([0])])
    assert verify(None, c, result=p).status == UNSOUND
    res = get_rule("where").infer_forward(T(M4, [2], [0]), T(M4, [], []), T(M4, [1], [-1]))
    assert dms(res.inputs) == [(0,), (), (-1,)] and dms(res.outputs) == [(0,)]
    assert verify(None, c).status == SOUND
    c = case("where", [2, 4], "forward", J([1, 1], [-1, -1]), J([2, 1], [0, -1]), J([2, 1], [-1, -1]))
    p = paddle([R([0, -1]), R([0, -1]), R([0, -1])], [R([0, -1])])
    assert verify(None, c, result=p).status == UNSOUND
    assert verify(None, c).status == SOUND


def test_index_rank() -> None:
    """indexing-index-rank: for an index [N, 1] or a 0-d index / 0-d out Paddle answers mappings of
    the wrong length or shards the size-1 axis."""
    # gather reverse: a 1-entry mapping for the 2-D index
    res = get_rule("gather").infer_backward(T(M2, [2, 7, 6], [-1, 0, -1]), T(M2, [1, 1], [-1, 0]),
                                            T(M2, [2, 1, 6], [0, -1, -1]), 1)
    assert dms(res.inputs) == [(0, -1, -1), (-1, -1)] and dms(res.outputs) == [(0, -1, -1)]
    # scatter: Paddle shards the index's size-1 axis (and x's columns with it)
    c = case("scatter", [2], "forward", J([1, 9], [0, -1]), J([1, 1], [-1, 0]), J([1, 9], [0, -1]), False)
    p = paddle([R([-1, 0]), R([-1, 0]), R([-1, 0])], [R([-1, 0])])
    assert verify(None, c, result=p).status == UNSOUND
    assert verify(None, c).status == SOUND
    # gather_nd with a 0-d out: Paddle answers out [0]
    res = get_rule("gather_nd").infer_forward(T(ProcessMesh([1, 3]), [9], [0]), T(ProcessMesh([1, 3]), [1], [0]))
    assert dms(res.inputs) == [(-1,), (-1,)] and dms(res.outputs) == [()]
    # scatter with a 0-d index: Paddle answers a 2-entry mapping for the 3-D x
    res = get_rule("scatter").infer_forward(T(ProcessMesh([3, 4]), [9, 1, 7], [1, -1, 0]), T(ProcessMesh([3, 4]), [], []),
                                            T(ProcessMesh([3, 4]), [1, 7], [-1, -1]), False)
    assert dms(res.inputs) == [(-1, -1, -1), (), (-1, -1)] and dms(res.outputs) == [(-1, -1, -1)]


def test_paddle_errors_answered() -> None:
    """indexing-paddle-error: Paddle crashes on a negative gather axis, raises for a 0-d gather index,
    scatter_nd_add's rank check, a where condition of lower rank and one axis on two mesh dims;
    spmdkit answers (soundly)."""
    items = [
        case("gather", [2], "forward", J([4, 6], [0, -1]), J([3], [-1]), -1),
        case("gather", [2], "forward", J([4, 6], [0, -1]), J([], []), 1),
        case("scatter_nd_add", [2], "forward", J([2], [-1]), J([1, 1], [0, -1]), J([1], [-1])),
        case("where", [2], "backward", J([6], [-1]), J([4, 6], [-1, -1]), J([4, 6], [-1, -1]), J([4, 6], [0, -1])),
        case("where", [2, 2], "forward", J([4, 6], [0, 1]), J([4, 6], [1, 0]), J([6], [-1])),
    ]
    for c in items:
        assert verify(None, c).status == SOUND, c
    res = get_rule("where").infer_forward(T(M22, [4, 6], [0, 1]), T(M22, [4, 6], [1, 0]), T(M22, [6], [-1]))
    assert dms(res.inputs) == [(0, 1), (0, 1), (1,)]


def test_paddle_test_shapes_rejected() -> None:
    """indexing-paddle-test-shapes: Paddle's unit tests pass shapes the op rejects; spmdkit raises."""
    with pytest.raises(ShapeMismatchError, match=r"scatter: .*updates"):
        get_rule("scatter").infer_backward(T(M23, [64, 32, 48], [-1, -1, -1]), T(M23, [16], [-1]),
                                           T(M23, [32, 32, 48], [-1, -1, -1]), T(M23, [64, 32, 48], [1, 0, -1]), True)
    with pytest.raises(ShapeMismatchError, match="scatter_nd_add: index"):
        get_rule("scatter_nd_add").infer_backward(T(M23, [64, 32, 48], [-1, -1, -1]), T(M23, [16], [-1]),
                                                  T(M23, [32, 32, 48], [-1, -1, -1]), T(M23, [64, 32, 48], [1, 0, -1]))
    # the 0-d index of test_gather_rule.py carries the mapping [0]: malformed
    with pytest.raises(InvalidDimsMappingError, match="0 dims"):
        T(M4, [], [0])
    got = answer_line(json.dumps(case("gather", [4], "forward", J([64, 32, 48], [-1, 0, -1]), J([], [0]), 1)))
    assert got["error"] == "InvalidDimsMappingError" and "gather" in got["message"] and "index" in got["message"]


# ---------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "args", "exc", "words"),
    [
        ("gather", (T(M22, [4, 6], [0, -1]), T(M22, [3], [-1]), 2), InvalidAttributeError, "axis"),
        ("gather", (T(M22, [4, 6], [0, -1]), T(M22, [3], [-1]), 1.5), InvalidAttributeError, "axis"),
        ("gather", (T(M22, [], []), T(M22, [3], [-1]), 0), ShapeMismatchError, "x"),
        ("gather", (T(M22, [4, 6], [0, -1]), T(M22, [3, 2], [-1, -1]), 0), ShapeMismatchError, "index"),
        ("index_select", (T(M22, [4, 6], [0, -1]), T(M22, [], []), 0), ShapeMismatchError, "index"),
        ("index_select", (T(M22, [4, 6], [0, -1]), T(M22, [3], [-1]), -3), InvalidAttributeError, "axis"),
        ("gather_nd", (T(M22, [4, 6], [0, -1]), T(M22, [], [])), ShapeMismatchError, "index"),
        ("gather_nd", (T(M22, [4, 6], [0, -1]), T(M22, [5, 3], [-1, -1])), ShapeMismatchError, "index"),
        ("scatter", (T(M22, [8, 6], [0, -1]), T(M22, [4], [-1]), T(M22, [4, 5], [-1, -1]), True),
         ShapeMismatchError, "updates"),
        ("scatter", (T(M22, [8, 6], [0, -1]), T(M22, [4], [-1]), T(M22, [4, 6], [-1, -1]), 2),
         InvalidAttributeError, "overwrite"),
        ("scatter", (T(M22, [8, 6], [0, -1]), T(M22, [4, 2], [-1, -1]), T(M22, [4, 6], [-1, -1]), True),
         ShapeMismatchError, "index"),
        ("scatter_nd_add", (T(M22, [8, 6], [0, -1]), T(M22, [4, 1], [-1, -1]), T(M22, [4, 5], [-1, -1])),
         ShapeMismatchError, "updates"),
        ("where", (T(M22, [4, 6], [0, -1]), T(M22, [4, 5], [-1, -1]), T(M22, [6], [-1])), ShapeMismatchError, "x"),
        ("gather_grad", (T(M22, [4, 6], [0, -1]), T(M22, [3], [-1]), T(M22, [3, 6], [-1, -1]), 5),
         InvalidAttributeError, "axis"),
        ("gather_nd_grad", (T(M22, [4, 6], [0, -1]), T(M22, [3, 1], [-1, -1]), T(M22, [3, 5], [-1, -1])),
         ShapeMismatchError, "out_grad"),
        ("scatter_grad", (T(M22, [4], [-1]), T(M22, [4, 5], [-1, -1]), T(M22, [8, 6], [-1, -1]), True),
         ShapeMismatchError, "updates"),
        ("scatter_nd_add_grad", (T(M22, [4, 1], [-1, -1]), T(M22, [4, 5], [-1, -1]), T(M22, [8, 6], [-1, -1])),
         ShapeMismatchError, "updates"),
        ("where_grad", (T(M22, [4, 6], [0, -1]), T(M22, [4, 6], [-1, -1]), T(M22, [6], [-1]), T(M22, [4, 5], [-1, -1])),
         ShapeMismatchError, "out_grad"),
    ],
)
def test_errors(name: str, args: tuple[Any, ...], exc: type, words: str) -> None:
    with pytest.raises(exc) as e:
        get_rule(name).infer_forward(*args)
    msg = str(e.value)
    assert msg.startswith(name) and words in msg, msg


def test_backward_errors() -> None:
    with pytest.raises(ShapeMismatchError, match=r"gather_nd: .* out has"):
        get_rule("gather_nd").infer_backward(T(M22, [4, 6], [-1, -1]), T(M22, [3, 1], [-1, -1]), T(M22, [3, 5], [-1, -1]))
    with pytest.raises(ShapeMismatchError, match="where: output"):
        get_rule("where").infer_backward(T(M22, [4, 6], [-1, -1]), T(M22, [4, 6], [-1, -1]), T(M22, [6], [-1]),
                                         T(M22, [4], [-1]))
    with pytest.raises(InvalidMeshError, match="where"):
        get_rule("where").infer_forward(T(M22, [4, 6], [-1, -1]), T(M4, [4, 6], [-1, -1]), T(M22, [6], [-1]))
    with pytest.raises(SpmdError, match="scatter"):
        get_rule("scatter").infer_backward(T(M22, [8, 6], [-1, -1]), T(M22, [4], [-1]), T(M22, [4, 6], [-1, -1]),
                                           T(M22, [8, 5], [-1, -1]), True)


# ---------------------------------------------------------------------------
# the references' grads are real gradients
# ---------------------------------------------------------------------------


def _numeric_grad(fwd: Any, x: np.ndarray, g: np.ndarray) -> np.ndarray:
    out = np.zeros_like(x)
    h = 1e-6
    for i in np.ndindex(x.shape):
        xp, xm = x.copy(), x.copy()
        xp[i] += h
        xm[i] -= h
        out[i] = (np.sum(np.asarray(fwd(xp)) * g) - np.sum(np.asarray(fwd(xm)) * g)) / (2 * h)
    return out


def _run(name: str, args: dict[str, Any]) -> tuple[Any, ...]:
    return get_reference(name).run(args, _ctx())


@pytest.mark.parametrize(("fwd", "grad", "index", "axis"), [
    ("gather", "gather_grad", np.array([2, 0, 2, 1]), 1),
    ("gather", "gather_grad", np.array([[3], [0]]), -1),
    ("gather", "gather_grad", np.array(1), 0),
    ("index_select", "index_select_grad", np.array([1, 1, 0]), 0),
])
def test_gather_grad_numeric(fwd: str, grad: str, index: np.ndarray, axis: int) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 4, 2)) if axis != -1 else rng.standard_normal((3, 2, 4))
    out = _run(fwd, {"x": x, "index": index, "axis": axis})[0]
    g = rng.standard_normal(out.shape)
    want = _numeric_grad(lambda v: _run(fwd, {"x": v, "index": index, "axis": axis})[0], x, g)
    got = _run(grad, {"x": x, "index": index, "out_grad": g, "axis": axis})[0]
    assert np.allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("index", [np.array([[0, 1], [2, 3], [0, 1]]), np.array([[1], [1]]),
                                   np.array([[[0, 0, 1]], [[2, 3, 0]]])])
def test_gather_nd_grad_numeric(index: np.ndarray) -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 4, 2))
    out = _run("gather_nd", {"x": x, "index": index})[0]
    g = rng.standard_normal(out.shape)
    want = _numeric_grad(lambda v: _run("gather_nd", {"x": v, "index": index})[0], x, g)
    got = _run("gather_nd_grad", {"x": x, "index": index, "out_grad": g})[0]
    assert np.allclose(got, want, atol=1e-5)


@pytest.mark.parametrize(("index", "overwrite"), [(np.array([3, 0]), True), (np.array([1, 1, 4]), False),
                                                  (np.array([[2], [0]]), True), (np.array(2), True)])
def test_scatter_grad_numeric(index: np.ndarray, overwrite: bool) -> None:
    rng = np.random.default_rng(2)
    x = rng.standard_normal((5, 3))
    n = index.reshape(-1).shape[0]
    u = rng.standard_normal((3,) if index.ndim == 0 else (n, 3))
    g = rng.standard_normal(x.shape)
    xg, ug = _run("scatter_grad", {"index": index, "updates": u, "out_grad": g, "overwrite": overwrite})

    def f_x(v: np.ndarray) -> Any:
        return _run("scatter", {"x": v, "index": index, "updates": u, "overwrite": overwrite})[0]

    def f_u(v: np.ndarray) -> Any:
        return _run("scatter", {"x": x, "index": index, "updates": v, "overwrite": overwrite})[0]

    assert np.allclose(xg, _numeric_grad(f_x, x, g), atol=1e-5)
    assert np.allclose(ug, _numeric_grad(f_u, u, g), atol=1e-5)


@pytest.mark.parametrize("index", [np.array([[0, 1], [2, 0], [0, 1]]), np.array([[1], [3]])])
def test_scatter_nd_add_grad_numeric(index: np.ndarray) -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 2, 3))
    k = index.shape[-1]
    u = rng.standard_normal((*index.shape[:-1], *x.shape[k:]))
    g = rng.standard_normal(x.shape)
    xg, ug = _run("scatter_nd_add_grad", {"index": index, "updates": u, "out_grad": g})

    def f_x(v: np.ndarray) -> Any:
        return _run("scatter_nd_add", {"x": v, "index": index, "updates": u})[0]

    def f_u(v: np.ndarray) -> Any:
        return _run("scatter_nd_add", {"x": x, "index": index, "updates": v})[0]

    assert np.allclose(xg, _numeric_grad(f_x, x, g), atol=1e-5)
    assert np.allclose(ug, _numeric_grad(f_u, u, g), atol=1e-5)


@pytest.mark.parametrize(("cs", "xs", "ys"), [((3, 4), (3, 4), (3, 4)), ((3, 1), (1, 4), (4,)), ((4,), (3, 4), ())])
def test_where_grad_numeric(cs: tuple[int, ...], xs: tuple[int, ...], ys: tuple[int, ...]) -> None:
    rng = np.random.default_rng(4)
    cond = rng.random(cs) < 0.5
    x, y = rng.standard_normal(xs), rng.standard_normal(ys)
    g = rng.standard_normal(np.broadcast_shapes(cs, xs, ys))
    xg, yg = _run("where_grad", {"condition": cond, "x": x, "y": y, "out_grad": g})
    want_x = _numeric_grad(lambda v: _run("where", {"condition": cond, "x": v, "y": y})[0], x, g)
    want_y = _numeric_grad(lambda v: _run("where", {"condition": cond, "x": x, "y": v})[0], y, g)
    assert np.allclose(xg, want_x, atol=1e-5) and np.allclose(yg, want_y, atol=1e-5)


# ---------------------------------------------------------------------------
# soundness over generated cases
# ---------------------------------------------------------------------------

RULES = ["gather", "index_select", "gather_nd", "scatter", "scatter_nd_add", "where"]
GRADS = ["gather_grad", "index_select_grad", "gather_nd_grad", "scatter_grad", "scatter_nd_add_grad", "where_grad"]


test_sound, test_grad_sound = soundness_tests(RULES, GRADS, 200, 7)
