"""catalog_misc family (argsort, cummax, cummin, roll, take_along_axis, put_along_axis, index_put,
nonzero, unique, p_norm, label_smooth): hand-checked answers, Paddle's unit-test cases, the
deviations from Paddle 3.3.1, errors, gradients of the references and soundness."""

# mypy: disable-error-code="union-attr,index,arg-type"
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from spmdkit.core.dist_attr import ReduceType, TensorDistAttr
from spmdkit.core.errors import (
    InvalidArgumentError,
    InvalidAttributeError,
    InvalidMeshError,
    ShapeMismatchError,
    SpmdError,
)
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.spec import DistTensorSpec, SpmdResult
from spmdkit.ops import get_rule
from spmdkit.sim import SOUND, UNSOUND, verify, verify_rule
from spmdkit.sim.reference import Ctx, get_reference

M2 = ProcessMesh([2])
M4 = ProcessMesh([4])
M22 = ProcessMesh([2, 2])
M23 = ProcessMesh([2, 3])
M24 = ProcessMesh([2, 4])
GOLDEN = Path(__file__).parent / "golden" / "catalog_misc.jsonl"

RULES = ["argsort", "argsort_grad", "cummax", "cummax_grad", "cummin", "cummin_grad", "roll", "roll_grad",
         "take_along_axis", "take_along_axis_grad", "put_along_axis", "put_along_axis_grad", "index_put",
         "index_put_grad", "nonzero", "unique", "p_norm", "p_norm_grad", "label_smooth", "label_smooth_grad"]


def T(mesh: ProcessMesh, shape: list[int], dm: list[Any], partial: Any = None) -> DistTensorSpec:
    return DistTensorSpec(shape, TensorDistAttr(mesh, dm, partial))


def dms(res: SpmdResult) -> tuple[list[Any], list[Any]]:
    def one(a: Any) -> Any:
        if a is None:
            return None
        if isinstance(a, tuple):
            return [one(x) for x in a]
        return [list(e) if isinstance(e, tuple) else e for e in a.dims_mapping]

    return [one(a) for a in res.inputs], [one(a) for a in res.outputs]


def J(a: Any) -> Any:
    """A spec as an INTERFACE.md tensor object."""
    if isinstance(a, DistTensorSpec):
        d: dict[str, Any] = {"shape": list(a.shape),
                             "dims_mapping": [list(e) if isinstance(e, tuple) else e for e in a.dist_attr.dims_mapping]}
        if a.dist_attr.partial:
            d["partial"] = {str(k): str(v) for k, v in a.dist_attr.partial}
        return d
    if isinstance(a, (list, tuple)) and a and all(isinstance(x, DistTensorSpec) for x in a):
        return [J(x) for x in a]
    return list(a) if isinstance(a, tuple) else a


def case(rule: str, mesh: ProcessMesh, mode: str, *args: Any) -> dict[str, Any]:
    return {"rule": rule, "mesh": list(mesh.shape), "mode": mode, "args": [J(a) for a in args]}


def assert_sound(rule: str, mesh: ProcessMesh, mode: str, *args: Any) -> None:
    v = verify(None, case(rule, mesh, mode, *args))
    assert v.status == SOUND, v.describe()


def paddle_unsound(rule: str, mesh: ProcessMesh, mode: str, args: list[Any], paddle: dict[str, Any]) -> None:
    v = verify(None, case(rule, mesh, mode, *args), result=paddle)
    assert v.status == UNSOUND, v.describe()


def R(dm: list[Any], partial: dict[str, str] | None = None) -> dict[str, Any]:
    return {"dims_mapping": dm, "partial": partial or {}}


def partial_of(a: TensorDistAttr) -> dict[int, ReduceType]:
    return dict(a.partial)


# ---------------------------------------------------------------------------
# hand-checked answers
# ---------------------------------------------------------------------------


def test_argsort_axis_replicated_coshard_kept() -> None:
    # the sorted axis needs every element; other axes (co-shards too) keep their sharding
    x = T(M22, [8, 6, 4], [[0, 1], -1, -1])
    res = get_rule("argsort").infer_forward(x, -1, False, False)
    assert dms(res) == ([[[0, 1], -1, -1]], [[[0, 1], -1, -1], [[0, 1], -1, -1]])
    res = get_rule("argsort").infer_forward(T(M22, [8, 6, 4], [0, 1, -1]), 1, True, True)
    assert dms(res) == ([[0, -1, -1]], [[0, -1, -1], [0, -1, -1]])
    assert_sound("argsort", M22, "forward", T(M22, [8, 6, 4], [0, 1, -1]), 1, True, True)


def test_argsort_partial_input_replicated() -> None:
    res = get_rule("argsort").infer_forward(T(M22, [8, 6], [0, -1], {1: "sum"}), -1, False, False)
    assert not res.inputs[0].partial and not res.outputs[0].partial


def test_cummax_axis_replicated_and_grad_merged() -> None:
    # scan axis replicated; co-shard read as its largest mesh dim (as Paddle's dims_mapping())
    x = T(M23, [6, 6, 4], [[0, 1], -1, -1])
    res = get_rule("cummax").infer_forward(x, 1, "int64")
    assert dms(res) == ([[1, -1, -1]], [[1, -1, -1], [1, -1, -1]])
    # grad: non-axis letters merged over x, indices, out_grad; the axis stays replicated
    g = get_rule("cummin_grad").infer_forward(T(M22, [4, 6, 8], [-1, 0, -1]), T(M22, [4, 6, 8], [-1, -1, 1]),
                                              T(M22, [4, 6, 8], [0, -1, -1]), 1, "int64")
    assert dms(g) == ([[0, -1, 1]] * 3, [[0, -1, 1]])
    assert_sound("cummax_grad", M22, "forward", T(M22, [4, 6, 8], [-1, 0, -1]), T(M22, [4, 6, 8], [-1, -1, 1]),
                 T(M22, [4, 6, 8], [0, -1, -1]), 1, "int64")


def test_roll_axes() -> None:
    x = T(M22, [8, 6, 4], [0, 1, -1])
    assert dms(get_rule("roll").infer_forward(x, [1, 2], [0, 2])) == ([[-1, 1, -1]], [[-1, 1, -1]])
    # an empty axis rolls the flattened tensor: every axis replicated
    assert dms(get_rule("roll").infer_forward(x, [3], [])) == ([[-1, -1, -1]], [[-1, -1, -1]])
    g = get_rule("roll_grad").infer_forward(T(M22, [8, 6, 4], [-1, -1, -1]), T(M22, [8, 6, 4], [0, 1, -1]),
                                            [1, 2], [0, 2])
    assert dms(g) == ([[-1, 1, -1], [-1, 1, -1]], [[-1, 1, -1]])
    assert_sound("roll", M22, "forward", x, [1, -2], [1, -1])


def test_take_along_axis_index_may_be_sharded_on_axis() -> None:
    # out[i, j] = x[i, index[i, j]]: x needs the whole axis, index (and out) may be split along it
    x = T(M22, [8, 6], [-1, 0])
    i = T(M22, [8, 5], [1, 0])
    res = get_rule("take_along_axis").infer_forward(x, i, 1)
    assert dms(res) == ([[1, -1], [1, 0]], [[1, 0]])
    assert_sound("take_along_axis", M22, "forward", x, i, 1)
    # a non-axis dim where x and index differ in size is replicated in both
    res = get_rule("take_along_axis").infer_forward(T(M22, [8, 6], [0, -1]), T(M22, [4, 3], [0, 1]), 1)
    assert dms(res) == ([[-1, -1], [-1, 1]], [[-1, 1]])


def test_put_along_axis_letters() -> None:
    x = T(M24, [8, 6, 4], [0, -1, 1])
    i = T(M24, [8, 3, 4], [-1, 1, -1])
    v = T(M24, [8, 3, 4], [-1, -1, -1])
    res = get_rule("put_along_axis").infer_forward(x, i, v, 1, "add", False)
    assert dms(res) == ([[0, -1, 1]] * 3, [[0, -1, 1]])
    assert_sound("put_along_axis", M24, "forward", x, i, v, 1, "add", False)
    g = get_rule("put_along_axis_grad").infer_forward(x, i, v, T(M24, [8, 6, 4], [-1, -1, -1]),
                                                      T(M24, [8, 6, 4], [1, 0, -1]), 1, "assign", True)
    assert dms(g) == ([[1, -1, -1]] * 5, [[1, -1, -1]] * 2)


def test_index_put_indexed_axes_replicated() -> None:
    x = T(M24, [8, 6, 4], [0, 1, -1])
    idx = [T(M24, [3], [-1]), T(M24, [3], [0])]
    res = get_rule("index_put").infer_forward(x, idx, T(M24, [1], [-1]), False)
    assert dms(res) == ([[-1, -1, -1], [[-1], [-1]], [-1]], [[-1, -1, -1]])
    # only the first len(indices) axes are replicated
    res = get_rule("index_put").infer_forward(T(M24, [8, 6, 4], [-1, 1, 0]), idx[:1], T(M24, [1], [-1]), True)
    assert dms(res) == ([[-1, 1, 0], [[-1]], [-1]], [[-1, 1, 0]])
    assert_sound("index_put", M24, "forward", T(M24, [8, 6, 4], [-1, 1, 0]), idx[:1], T(M24, [1], [-1]), True)


def test_nonzero_unique_replicated() -> None:
    res = get_rule("nonzero").infer_forward(T(M22, [4, 6], [0, 1]))
    assert dms(res) == ([[-1, -1]], [[-1, -1]])
    # the output's row count is data-dependent: any count is accepted
    res = get_rule("nonzero").infer_backward(T(M22, [4, 6], [0, 1]), T(M22, [17, 2], [0, 1]))
    assert dms(res) == ([[-1, -1]], [[-1, -1]])
    u = get_rule("unique")
    assert dms(u.infer_forward(T(M22, [4, 6], [0, 1]), True, False, True, [], "int64")) == (
        [[-1, -1]], [[-1], [-1], None, [-1]])
    assert dms(u.infer_forward(T(M22, [4, 6], [0, 1]), False, True, False, [1], "int64")) == (
        [[-1, -1]], [[-1, -1], None, [-1], None])
    r = u.infer_backward(T(M22, [4, 6], [0, 1]), T(M22, [5], [0]), None, T(M22, [24], [1]), None,
                         False, True, False, [], "int64")
    assert dms(r) == ([[-1, -1]], [[-1], None, [-1], None])


def test_unique_reference_shapes() -> None:
    ref = get_reference("unique")
    x = np.array([[1, 2, 2], [3, 1, 1]])
    out, ind, inv, cnt = ref.run({"x": x, "return_index": True, "return_inverse": True, "return_counts": True,
                                  "axis": []}, Ctx(M2))
    assert out.tolist() == [1, 2, 3] and inv.shape == (6,) and cnt.tolist() == [3, 2, 1]
    out, ind, inv, cnt = ref.run({"x": x, "return_index": False, "return_inverse": True, "return_counts": False,
                                  "axis": [1]}, Ctx(M2))
    assert out.shape == (2, 2) and ind is None and cnt is None  # columns [1,3], [2,1], [2,1]


def test_p_norm_reduce_types() -> None:
    x = T(M22, [8, 6], [0, 1])
    p = get_rule("p_norm")
    # porder 1 (sum of |x|) and 0 (a count): partial SUM; inf / -inf: MAX / MIN
    for porder, rt in ((1.0, ReduceType.SUM), (0.0, ReduceType.SUM), (math.inf, ReduceType.MAX),
                       (-math.inf, ReduceType.MIN)):
        res = p.infer_forward(x, porder, 1, 1e-12, False, False)
        assert dms(res) == ([[0, 1]], [[0]])
        assert partial_of(res.outputs[0]) == {1: rt}
        assert_sound("p_norm", M22, "forward", x, porder, 1, 1e-12, False, False)
    # porder 2: no reduce type is right, the reduced axis is replicated
    res = p.infer_forward(x, 2.0, 1, 1e-12, True, False)
    assert dms(res) == ([[0, -1]], [[0, -1]]) and not res.outputs[0].partial
    # asvector: every axis reduced, out 0-d (all-1 with keepdims)
    res = p.infer_forward(x, 1.0, 0, 1e-12, False, True)
    assert dms(res) == ([[0, 1]], [[]]) and partial_of(res.outputs[0]) == {0: ReduceType.SUM, 1: ReduceType.SUM}


def test_p_norm_grad_letters() -> None:
    g = get_rule("p_norm_grad").infer_forward(T(M22, [8, 6], [-1, 1]), T(M22, [8], [0]), T(M22, [8], [-1]),
                                              2.0, 1, 1e-12, False, False)
    # x_grad = out_grad * sign(x)|x|^(p-1) / out^(p-1): out broadcast, so the reduced axis replicated
    assert dms(g) == ([[0, -1], [0], [0]], [[0, -1]])
    assert_sound("p_norm_grad", M22, "forward", T(M22, [8, 6], [-1, 1]), T(M22, [8], [0]), T(M22, [8], [-1]),
                 2.0, 1, 1e-12, False, False)


def test_label_smooth_with_prior_is_elementwise() -> None:
    lab = T(M22, [8, 4, 6], [0, -1, 1])
    prior = T(M22, [1, 6], [-1, -1])
    res = get_rule("label_smooth").infer_forward(lab, prior, 0.1)
    assert dms(res) == ([[0, -1, 1], [-1, 1]], [[0, -1, 1]])
    assert_sound("label_smooth", M22, "forward", lab, prior, 0.1)
    # prior_dist's mesh dims used by label's leading axes are dropped first (as in Paddle)
    res = get_rule("label_smooth").infer_forward(T(M22, [8, 6], [0, -1]), T(M22, [6], [0]), 0.1)
    assert dms(res) == ([[0, -1], [-1]], [[0, -1]])


def test_label_smooth_grad_clears_partial() -> None:
    res = get_rule("label_smooth_grad").infer_forward(T(M22, [8, 6], [0, -1], {1: "sum"}), 0.1)
    assert dms(res) == ([[0, -1]], [[0, -1]]) and not res.outputs[0].partial


# ---------------------------------------------------------------------------
# Paddle's unit tests: every case is a golden line (source "paddle-test"); spot checks here
# ---------------------------------------------------------------------------


def _golden() -> list[dict[str, Any]]:
    return [json.loads(x) for x in GOLDEN.read_text().splitlines() if x.strip()]


def test_paddle_unit_test_cases_are_golden() -> None:
    lines = [g for g in _golden() if g["source"] == "paddle-test"]
    per: dict[str, int] = {}
    for g in lines:
        per[g["case"]["rule"]] = per.get(g["case"]["rule"], 0) + 1
    want = {"argsort": 5, "cummax": 2, "cummin": 2, "roll": 4, "take_along_axis": 13, "put_along_axis": 10,
            "index_put": 12, "nonzero": 4, "unique": 2, "p_norm": 12, "label_smooth": 3}
    assert per == want


def test_paddle_argsort_case() -> None:
    # test_argsort_rule.py: [0, -1, 1], axis -1 -> [0, -1, -1]
    res = get_rule("argsort").infer_forward(T(M23, [64, 32, 48], [0, -1, 1]), -1, False, False)
    assert dms(res) == ([[0, -1, -1]], [[0, -1, -1], [0, -1, -1]])
    res = get_rule("argsort").infer_backward(T(M23, [64, 32, 48], [0, 1, -1]), T(M23, [64, 32, 48], [0, 1, -1]),
                                             T(M23, [64, 32, 48], [0, 1, -1]), 1, False, False)
    assert dms(res) == ([[0, -1, -1]] * 3, [[0, -1, -1]])


def test_paddle_cummax_backward_case() -> None:
    # test_cummax_rule.py: x [0, -1, 1], indices [0, -1, 1], out_grad [16, 2, 16] [-1, 1, -1]
    s = [16, 16, 16]
    res = get_rule("cummax").infer_backward(T(M22, s, [0, -1, 1]), T(M22, s, [0, -1, 1]),
                                            T(M22, [16, 2, 16], [-1, 1, -1]), 1, "int64")
    assert dms(res) == ([[0, -1, 1]] * 3, [[0, -1, 1]])


def test_paddle_put_along_axis_case() -> None:
    # test_put_along_axis_rule.py multi mesh: [0, -1, -1], [-1, 1, -1], [-1, 1, -1], axis 1 -> [0, -1, -1]
    s = [64, 32, 48]
    res = get_rule("put_along_axis").infer_forward(T(M24, s, [0, -1, -1]), T(M24, s, [-1, 1, -1]),
                                                   T(M24, s, [-1, 1, -1]), 1, "assign", True)
    assert dms(res) == ([[0, -1, -1]] * 3, [[0, -1, -1]])


def test_paddle_unique_case() -> None:
    res = get_rule("unique").infer_forward(T(M22, [4, 8], [0, -1]), True, True, True, [0], "int32")
    assert dms(res) == ([[-1, -1]], [[-1, -1], [-1], [-1], [-1]])


# ---------------------------------------------------------------------------
# deviations from Paddle 3.3.1 (docs/deviations.md, misc-*)
# ---------------------------------------------------------------------------


def test_take_grad_partial_sum() -> None:
    # Paddle's unit test: out_grad [1, 0, -1], axis 1 -> x_grad [1, -1, -1], not partial; each rank
    # scatters only its slice of out_grad along the axis, so x_grad is partial SUM over mesh dim 0
    s = [64, 32, 48]
    args = [T(M24, s, [-1, -1, -1]), T(M24, s, [-1, -1, -1]), T(M24, s, [1, 0, -1]), 1]
    res = get_rule("take_along_axis_grad").infer_forward(*args)
    assert dms(res) == ([[1, -1, -1], [1, 0, -1], [1, 0, -1]], [[1, -1, -1]])
    assert partial_of(res.outputs[0]) == {0: ReduceType.SUM}
    small = [T(M24, [8, 6, 4], [-1, -1, -1]), T(M24, [8, 6, 4], [-1, -1, -1]), T(M24, [8, 6, 4], [1, 0, -1]), 1]
    assert_sound("take_along_axis_grad", M24, "forward", *small)
    paddle_unsound("take_along_axis_grad", M24, "forward", small,
                   {"inputs": [R([1, -1, -1]), R([1, 0, -1]), R([1, 0, -1])], "outputs": [R([1, -1, -1])]})


def test_index_put_forward_value_and_indices() -> None:
    # value [4] broadcasts onto x's last axis, which stays sharded: value must be sharded alike
    x = T(M2, [6, 4], [-1, 0])
    idx = [T(M2, [3], [-1])]
    res = get_rule("index_put").infer_forward(x, idx, T(M2, [4], [-1]), False)
    assert dms(res) == ([[-1, 0], [[-1]], [0]], [[-1, 0]])
    assert_sound("index_put", M2, "forward", x, idx, T(M2, [4], [-1]), False)
    paddle_unsound("index_put", M2, "forward", [x, idx, T(M2, [4], [-1]), False],
                   {"inputs": [R([-1, 0]), [R([-1])], R([-1])], "outputs": [R([-1, 0])]})
    # a partial index is made replicated (Paddle echoes it: the kernel would index with a partial sum)
    res = get_rule("index_put").infer_forward(x, [T(M2, [3], [-1], {0: "sum"})], T(M2, [1], [-1]), False)
    assert not res.inputs[1][0].partial
    paddle_unsound("index_put", M2, "forward", [T(M2, [6, 4], [-1, -1]), [T(M2, [3], [-1], {0: "sum"})],
                                                 T(M2, [1], [-1]), False],
                   {"inputs": [R([-1, -1]), [R([-1], {"0": "sum"})], R([-1])], "outputs": [R([-1, -1])]})


def test_index_put_value_of_several_dims() -> None:
    # the held-out judge's case: x [24, 32, 48], one index [9], value [9, 32, 48] (Paddle accepts
    # it); value lies along the indexed shape [9, 32, 48]: its first axis (the indexed positions)
    # replicated, the others sharded as x's kept axes
    x = T(M24, [24, 32, 48], [-1, 0, 1])
    idx = [T(M24, [9], [-1])]
    v = T(M24, [9, 32, 48], [-1, -1, -1])
    res = get_rule("index_put").infer_forward(x, idx, v, False)
    assert dms(res) == ([[-1, 0, 1], [[-1]], [-1, 0, 1]], [[-1, 0, 1]])
    assert_sound("index_put", M24, "forward", x, idx, v, False)
    assert_sound("index_put", M24, "forward", x, idx, v, True)
    # Paddle keeps value replicated while x's axes stay sharded: the local shapes do not match
    paddle_unsound("index_put", M2, "forward", [T(M2, [6, 4, 2], [-1, 0, -1]), [T(M2, [3], [-1])],
                                                 T(M2, [3, 4, 2], [-1, -1, -1]), False],
                   {"inputs": [R([-1, 0, -1]), [R([-1])], R([-1, -1, -1])], "outputs": [R([-1, 0, -1])]})
    # x's indexed axis sharded: replicated, value's first axis too
    res = get_rule("index_put").infer_forward(T(M24, [24, 32, 48], [0, 1, -1]), idx, v, True)
    assert dms(res) == ([[-1, 1, -1], [[-1]], [-1, 1, -1]], [[-1, 1, -1]])
    # a broadcast value [1, 48] (and [32, 1]): size-1 axes replicated, the rest as x
    for vs, want in (([1, 48], [-1, 1]), ([32, 1], [0, -1]), ([9, 1, 48], [-1, -1, 1])):
        vv = T(M24, vs, [-1] * len(vs))
        res = get_rule("index_put").infer_forward(x, idx, vv, False)
        assert dms(res)[0][2] == want, vs
        assert_sound("index_put", M24, "forward", x, idx, vv, True)
    # two indices: the indexed shape is [n, x.shape[2]]
    res = get_rule("index_put").infer_forward(x, [T(M24, [5], [-1])] * 2, T(M24, [5, 48], [-1, -1]), False)
    assert dms(res) == ([[-1, -1, 1], [[-1], [-1]], [-1, 1]], [[-1, -1, 1]])


def test_index_put_grad_value_of_several_dims() -> None:
    # value [3, 1, 2] against the indexed shape [3, 4, 2]: value_grad sums out_grad over axis 1,
    # sharded on mesh dim 0, so it is partial SUM there; axis 2 lies along x's (mesh dim 1)
    x = T(M22, [6, 4, 2], [-1, 0, 1])
    args = [x, [T(M22, [3], [-1])], T(M22, [3, 1, 2], [-1, -1, -1]), T(M22, [6, 4, 2], [-1, 0, 1]), True]
    res = get_rule("index_put_grad").infer_forward(*args)
    assert dms(res) == ([[-1, 0, 1], [[-1]], [-1, -1, 1], [-1, 0, 1]], [[-1, 0, 1], [-1, -1, 1]])
    assert partial_of(res.outputs[1]) == {0: ReduceType.SUM}
    assert_sound("index_put_grad", M22, "forward", *args)
    args[2] = T(M22, [3, 4, 2], [-1, -1, -1])  # no broadcast: value_grad sharded as x, not partial
    res = get_rule("index_put_grad").infer_forward(*args)
    assert dms(res)[1][1] == [-1, 0, 1] and not res.outputs[1].partial
    assert_sound("index_put_grad", M22, "forward", *args)


def test_index_put_grad_value_grad_partial() -> None:
    # value [1] is broadcast over x's trailing axes: its grad sums out_grad over them, so it is
    # partial over the mesh dims sharding them; Paddle answers value_grad replicated
    x = T(M22, [6, 4], [0, 1])
    args = [x, [T(M22, [3], [-1])], T(M22, [1], [-1]), T(M22, [6, 4], [0, 1]), False]
    res = get_rule("index_put_grad").infer_forward(*args)
    assert dms(res) == ([[-1, 1], [[-1]], [-1], [-1, 1]], [[-1, 1], [-1]])
    assert partial_of(res.outputs[1]) == {1: ReduceType.SUM}
    assert_sound("index_put_grad", M22, "forward", *args)
    paddle_unsound("index_put_grad", M22, "forward", args,
                   {"inputs": [R([-1, 1]), [R([-1])], R([-1]), R([-1, 1])], "outputs": [R([-1, 1]), R([-1])]})


def test_pnorm_partial_types() -> None:
    # Paddle's unit test: [0, -1], axis 0, porder 2 -> out partial SUM (a sum of local 2-norms is
    # not the 2-norm); spmdkit replicates the reduced axis
    x = T(M4, [64, 32], [0, -1])
    res = get_rule("p_norm").infer_forward(x, 2.0, 0, 1e-12, False, False)
    assert dms(res) == ([[-1, -1]], [[-1]]) and not res.outputs[0].partial
    paddle_unsound("p_norm", M4, "forward", [T(M4, [8, 4], [0, -1]), 2.0, 0, 1e-12, False, False],
                   {"inputs": [R([0, -1])], "outputs": [R([-1], {"0": "sum"})]})
    # inf: MAX, not SUM
    res = get_rule("p_norm").infer_forward(x, math.inf, 0, 1e-12, False, False)
    assert partial_of(res.outputs[0]) == {0: ReduceType.MAX}
    paddle_unsound("p_norm", M4, "forward", [T(M4, [8, 4], [0, -1]), math.inf, 0, 1e-12, False, False],
                   {"inputs": [R([0, -1])], "outputs": [R([-1], {"0": "sum"})]})


def test_pnorm_reverse_out_is_what_x_produces() -> None:
    # a partial out cannot come from the replicated x the reverse rule infers
    x = T(M22, [4, 6], [-1, -1])
    out = T(M22, [4], [-1], {0: "sum"})
    res = get_rule("p_norm").infer_backward(x, out, 2.0, 1, 1e-12, False, False)
    assert dms(res) == ([[-1, -1]], [[-1]]) and not res.outputs[0].partial
    assert_sound("p_norm", M22, "backward", x, out, 2.0, 1, 1e-12, False, False)
    paddle_unsound("p_norm", M22, "backward", [x, out, 2.0, 1, 1e-12, False, False],
                   {"inputs": [R([-1, -1])], "outputs": [R([-1], {"0": "sum"})]})


def test_label_smooth_class_axis_replicated() -> None:
    # without prior_dist the kernel adds epsilon / (the class count it sees locally)
    lab = T(M22, [2, 8], [0, 1])
    res = get_rule("label_smooth").infer_forward(lab, None, 0.1)
    assert dms(res) == ([[0, -1], None], [[0, -1]])
    assert_sound("label_smooth", M22, "forward", lab, None, 0.1)
    paddle_unsound("label_smooth", M22, "forward", [lab, None, 0.1],
                   {"inputs": [R([0, 1]), None], "outputs": [R([0, 1])]})


def test_argsort_grad_mismatch_resolved() -> None:
    # Paddle raises where indices and x are sharded differently; x's mapping wins
    res = get_rule("argsort_grad").infer_forward(T(M23, [9, 6], [-1, 1]), T(M23, [9, 6], [0, -1]),
                                                 T(M23, [9, 6], [-1, -1]), 1, False, False)
    assert dms(res) == ([[0, -1]] * 3, [[0, -1]])


def test_two_mesh_dims_resolved() -> None:
    # Paddle raises ("Tensor Axis is Sharded by two different mesh dimension"); the larger
    # tensor keeps its sharding (equal sizes: the first)
    res = get_rule("take_along_axis").infer_forward(T(M22, [8, 6], [0, -1]), T(M22, [8, 3], [1, -1]), 1)
    assert dms(res) == ([[0, -1], [0, -1]], [[0, -1]])
    res = get_rule("roll_grad").infer_forward(T(M22, [8, 6], [0, -1]), T(M22, [8, 6], [1, -1]), [1], [1])
    assert dms(res) == ([[0, -1], [0, -1]], [[0, -1]])
    res = get_rule("nonzero").infer_forward(T(M22, [8, 6], [0, 1]))
    assert dms(res) == ([[-1, -1]], [[-1, -1]])
    res = get_rule("label_smooth").infer_forward(T(M22, [8, 6], [-1, 0]), T(M22, [6], [1]), 0.1)
    assert dms(res) == ([[-1, 0], [0]], [[-1, 0]])


def test_negative_axis_normalized() -> None:
    # Paddle 3.3.1's take_along_axis rule uses a negative axis as a string position and fails
    res = get_rule("take_along_axis").infer_forward(T(M22, [8, 6], [0, 1]), T(M22, [8, 6], [0, 1]), -1)
    assert dms(res) == ([[0, -1], [0, 1]], [[0, 1]])
    res = get_rule("take_along_axis").infer_backward(T(M22, [8, 6], [0, 1]), T(M22, [8, 6], [0, 1]),
                                                     T(M22, [8, 6], [0, 1]), -2)
    assert dms(res) == ([[-1, 1], [0, 1], [0, 1]], [[-1, 1]])
    assert partial_of(res.outputs[0]) == {0: ReduceType.SUM}


def test_illegal_input_rejected() -> None:
    # Paddle's nonzero test uses x [1, 1, 1] (mesh dim 1 twice) and an out [8, 8] for a 3-D x
    with pytest.raises(SpmdError):
        T(M22, [16, 16, 16], [1, 1, 1])
    with pytest.raises(ShapeMismatchError, match=r"nonzero.*out"):
        get_rule("nonzero").infer_backward(T(M22, [16, 16, 16], [-1, -1, -1]), T(M22, [8, 8], [-1, -1]))


def test_golden_deviation_ids_documented() -> None:
    ids = {g["deviation"] for g in _golden() if "deviation" in g}
    assert ids <= {"misc-take-grad-partial", "misc-index-put-forward", "misc-index-put-grad", "misc-pnorm-partial",
                   "misc-pnorm-reverse-out", "misc-label-smooth-class-axis", "misc-argsort-grad-mismatch",
                   "misc-two-mesh-dims", "misc-negative-axis", "misc-illegal-input"}


# ---------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(("rule", "mode", "args", "exc", "words"), [
    ("argsort", "forward", (T(M22, [4, 6], [0, -1]), 2), InvalidAttributeError, "argsort.*axis"),
    ("argsort_grad", "forward", (T(M22, [4, 5], [0, -1]), T(M22, [4, 6], [0, -1]), T(M22, [4, 6], [0, -1]), 1),
     ShapeMismatchError, "argsort_grad.*indices"),
    ("cummax", "forward", (T(M22, [4, 6], [0, -1]), -3), InvalidAttributeError, "cummax.*axis"),
    ("cummin_grad", "forward", (T(M22, [4, 6], [0, -1]), T(M22, [4], [0]), T(M22, [4, 6], [0, -1]), 1),
     ShapeMismatchError, "cummin_grad.*indices"),
    ("roll", "forward", (T(M22, [4, 6], [0, -1]), [1, 2], [0]), InvalidAttributeError, "roll.*shifts"),
    ("roll", "forward", (T(M22, [4, 6], [0, -1]), [1, 2], []), InvalidAttributeError, "roll.*shifts"),
    ("roll_grad", "forward", (T(M22, [4, 6], [0, -1]), T(M22, [4, 5], [0, -1]), [1], [0]), ShapeMismatchError,
     "roll_grad.*out_grad"),
    ("take_along_axis", "forward", (T(M22, [4, 6], [0, -1]), T(M22, [4], [0]), 0), ShapeMismatchError,
     "take_along_axis.*index"),
    ("take_along_axis", "forward", (T(M22, [4, 6], [0, -1]), T(M22, [4, 6], [0, -1]), 5), InvalidAttributeError,
     "take_along_axis.*axis"),
    ("put_along_axis", "forward", (T(M22, [4, 6], [0, -1]), T(M22, [4, 6], [0, -1]), T(M22, [4], [0]), 0),
     ShapeMismatchError, "put_along_axis.*value"),
    ("put_along_axis", "forward", (T(M22, [4, 6], [0, -1]), T(M22, [4, 6], [0, -1]), T(M22, [4, 6], [0, -1]), 0,
                                   "maximum"), InvalidAttributeError, "put_along_axis.*reduce"),
    ("index_put", "forward", (T(M22, [4, 6], [0, -1]), [], T(M22, [1], [-1])), InvalidArgumentError,
     "index_put.*indices"),
    ("index_put", "forward", (T(M22, [4, 6], [0, -1]), [T(M22, [3], [-1])] * 3, T(M22, [1], [-1])),
     ShapeMismatchError, "index_put.*index tensors"),
    ("index_put", "forward", (T(M22, [4, 6], [0, -1]), [T(M22, [3, 1], [-1, -1])], T(M22, [1], [-1])),
     ShapeMismatchError, "index_put.*indices\\[0\\]"),
    ("index_put", "forward", (T(M22, [4, 6], [0, -1]), [T(M22, [3], [-1])], T(M22, [1, 1, 1], [-1, -1, -1])),
     ShapeMismatchError, "index_put.*value has 3 dims"),
    ("index_put", "forward", (T(M22, [4, 6], [0, -1]), [T(M22, [3], [-1])], T(M22, [2, 6], [-1, -1])),
     ShapeMismatchError, "index_put.*does not broadcast"),
    ("index_put", "forward", (T(M22, [4, 6], [0, -1]), [T(M22, [3], [-1])], T(M22, [], [])),
     ShapeMismatchError, "index_put.*0-d value"),
    ("index_put", "forward", (T(M22, [4, 6], [0, -1]), [T(M22, [3], [-1])], T(M22, [5], [-1])),
     ShapeMismatchError, "index_put.*value"),
    ("index_put_grad", "forward", (T(M22, [4, 6], [0, -1]), [T(M22, [3], [-1])], T(M22, [1], [-1]),
                                   T(M22, [4, 5], [0, -1])), ShapeMismatchError, "index_put_grad.*out_grad"),
    ("nonzero", "forward", (T(M22, [], []),), ShapeMismatchError, "nonzero.*x"),
    ("nonzero", "backward", (T(M22, [4, 6], [0, -1]), T(M22, [4], [-1])), ShapeMismatchError, "nonzero.*out"),
    ("unique", "forward", (T(M22, [4, 6], [0, -1]), False, False, False, [0, 1]), InvalidAttributeError,
     "unique.*axis"),
    ("unique", "backward", (T(M22, [4, 6], [0, -1]), T(M22, [4, 6], [-1, -1])), ShapeMismatchError, "unique.*out"),
    ("unique", "backward", (T(M22, [4, 6], [0, -1]), T(M22, [4], [-1]), T(M22, [4], [-1])), InvalidArgumentError,
     "unique.*indices.*return_index"),
    ("p_norm", "forward", (T(M22, [4, 6], [0, -1]), 2.0, 2), InvalidAttributeError, "p_norm.*axis"),
    ("p_norm", "backward", (T(M22, [4, 6], [0, -1]), T(M22, [6], [-1]), 2.0, 1), ShapeMismatchError,
     "p_norm.*out"),
    ("p_norm_grad", "forward", (T(M22, [4, 6], [0, -1]), T(M22, [4], [-1]), T(M22, [6], [-1]), 2.0, 1),
     ShapeMismatchError, "p_norm_grad.*out_grad"),
    ("label_smooth", "forward", (T(M22, [4, 6], [0, -1]), T(M22, [5], [-1]), 0.1), ShapeMismatchError,
     "label_smooth.*prior_dist"),
    ("label_smooth", "forward", (T(M22, [], []), None, 0.1), ShapeMismatchError, "label_smooth.*label"),
])
def test_errors(rule: str, mode: str, args: tuple[Any, ...], exc: type[SpmdError], words: str) -> None:
    with pytest.raises(exc, match=words):
        get_rule(rule).infer(mode, *args)


def test_mesh_mismatch_names_tensors() -> None:
    with pytest.raises(InvalidMeshError, match=r"take_along_axis.*index"):
        get_rule("take_along_axis").infer_forward(T(M22, [4, 6], [0, -1]), T(M4, [4, 6], [0, -1]), 0)
    with pytest.raises(InvalidMeshError, match=r"index_put.*indices\[0\]"):
        get_rule("index_put").infer_forward(T(M22, [4, 6], [0, -1]), [T(M4, [3], [-1])], T(M22, [1], [-1]))


# ---------------------------------------------------------------------------
# the references' gradients are real gradients (central differences)
# ---------------------------------------------------------------------------


def _numeric(f: Any, x: np.ndarray, w: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    g = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        xp, xm = x.copy(), x.copy()
        xp[i] += eps
        xm[i] -= eps
        g[i] = (np.sum(f(xp) * w) - np.sum(f(xm) * w)) / (2 * eps)
    return g


def _ref(name: str, args: dict[str, Any]) -> tuple[Any, ...]:
    ref = get_reference(name)
    a = dict(args)
    if ref.prepare is not None:
        ref.prepare(a)
    return ref.run(a, Ctx(M2)), a


def test_grad_references_numeric() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5))
    w = rng.standard_normal((3, 5))
    for fwd, grad, extra in (("argsort", "argsort_grad", {"descending": True}), ("cummax", "cummax_grad", {}),
                             ("cummin", "cummin_grad", {})):
        (gx,), _ = _ref(grad, {"x": x, "indices": np.zeros((3, 5), dtype=np.int64), "out_grad": w, "axis": 1,
                                **extra})
        f = get_reference(fwd)
        num = _numeric(lambda v: f.run({"x": v, "axis": 1, **extra}, Ctx(M2))[0], x, w)  # noqa: B023
        assert np.allclose(gx, num, atol=1e-5), grad
    (gx,), _ = _ref("roll_grad", {"x": x, "out_grad": w, "shifts": [2, -1], "axis": [1, 0]})
    num = _numeric(lambda v: get_reference("roll").run({"x": v, "shifts": [2, -1], "axis": [1, 0]}, Ctx(M2))[0], x, w)
    assert np.allclose(gx, num, atol=1e-5)


def test_gather_scatter_grads_numeric() -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 6))
    idx = rng.integers(0, 6, size=(3, 5))
    w = rng.standard_normal((3, 5))
    (gx,), a = _ref("take_along_axis_grad", {"x": x, "index": idx, "out_grad": w, "axis": 1})
    ta = get_reference("take_along_axis")
    num = _numeric(lambda v: ta.run({"x": v, "index": a["index"], "axis": 1}, Ctx(M2))[0], x, w)
    assert np.allclose(gx, num, atol=1e-5)
    for reduce, inc in (("assign", True), ("add", True), ("add", False)):
        val = rng.standard_normal((3, 4))
        wo = rng.standard_normal((4, 6))
        args = {"x": x, "index": rng.integers(0, 6, size=(3, 4)), "value": val, "out": x, "out_grad": wo,
                "axis": 1, "reduce": reduce, "include_self": inc}
        (gx, gv), a = _ref("put_along_axis_grad", args)
        pa = get_reference("put_along_axis")
        base = {"index": a["index"], "axis": 1, "reduce": reduce, "include_self": inc}
        nx = _numeric(lambda v: pa.run({"x": v, "value": val, **base}, Ctx(M2))[0], x, wo)  # noqa: B023
        nv = _numeric(lambda v: pa.run({"x": x, "value": v, **base}, Ctx(M2))[0], val, wo)  # noqa: B023
        assert np.allclose(gx, nx, atol=1e-5) and np.allclose(gv, nv, atol=1e-5), (reduce, inc)
    for acc, vshape in ((False, (6,)), (True, (1,)), (True, (6,))):
        val = rng.standard_normal(vshape)
        wo = rng.standard_normal((4, 6))
        args = {"x": x, "indices": [np.zeros(3, dtype=np.int64)], "value": val, "out_grad": wo, "accumulate": acc}
        (gx, gv), a = _ref("index_put_grad", args)
        ip = get_reference("index_put")
        nx = _numeric(lambda v: ip.run({"x": v, "indices": a["indices"], "value": val,  # noqa: B023
                                        "accumulate": acc}, Ctx(M2))[0], x, wo)  # noqa: B023
        nv = _numeric(lambda v: ip.run({"x": x, "indices": a["indices"], "value": v,  # noqa: B023
                                        "accumulate": acc}, Ctx(M2))[0], val, wo)  # noqa: B023
        assert np.allclose(gx, nx, atol=1e-5) and np.allclose(gv, nv, atol=1e-5), (acc, vshape)


def test_pnorm_and_label_smooth_grads_numeric() -> None:
    rng = np.random.default_rng(2)
    x = rng.uniform(0.5, 2.0, (3, 4)) * np.where(rng.random((3, 4)) < 0.5, -1, 1)
    pn = get_reference("p_norm")
    for porder in (1.0, 2.0, 3.0, 0.5, math.inf, -math.inf):
        for axis, keep, vec in ((1, False, False), (0, True, False), (0, False, True)):
            attrs = {"porder": porder, "axis": axis, "keepdims": keep, "asvector": vec, "epsilon": 1e-12}
            out = pn.run({"x": x, **attrs}, Ctx(M2))[0]
            w = rng.standard_normal(out.shape)
            (gx,), _ = _ref("p_norm_grad", {"x": x, "out": out, "out_grad": w, **attrs})
            num = _numeric(lambda v: pn.run({"x": v, **attrs}, Ctx(M2))[0], x, w)  # noqa: B023
            assert np.allclose(gx, num, atol=1e-5), (porder, axis, keep, vec)
    lab = rng.random((3, 4))
    w = rng.standard_normal((3, 4))
    (g,), _ = _ref("label_smooth_grad", {"out_grad": w, "epsilon": 0.2})
    ls = get_reference("label_smooth")
    num = _numeric(lambda v: ls.run({"label": v, "prior_dist": None, "epsilon": 0.2}, Ctx(M2))[0], lab, w)
    assert np.allclose(g, num, atol=1e-5)


# ---------------------------------------------------------------------------
# soundness over generated cases
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("rule", RULES)
def test_sound_over_generated_cases(rule: str) -> None:
    for mode in get_rule(rule).modes:
        rep = verify_rule(rule, 200, mode=mode)
        assert rep.cases == 200, (rule, mode, rep.note)
        assert rep.unsound == 0, rep.first_unsound.describe() if rep.first_unsound else ""
        assert rep.sound >= 190, (rule, mode, rep.sound, rep.rejected, rep.skipped,
                                  rep.first_skipped.describe() if rep.first_skipped else "")
