"""transpose, default_data_parallel, replicated: deviations from Paddle, errors."""

from __future__ import annotations

import pytest

from spmdkit.core.errors import (
    InvalidArgumentError,
    InvalidAttributeError,
    InvalidDimsMappingError,
    ShapeMismatchError,
    SpmdError,
)
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.spec import DistTensorSpec
from spmdkit.io.codec import answer_line
from spmdkit.ops import get_rule
from spmdkit.sim import verify


def T(mesh: ProcessMesh, shape: list[int], dm: list[object], partial: object = None) -> DistTensorSpec:
    return DistTensorSpec(shape, mesh=mesh, dims_mapping=dm, partial=partial)


M23 = ProcessMesh([2, 3])


def test_transpose_uneven_pruned_on_input_too() -> None:
    # Paddle 3.3.1: in [0,-1,1] (kept), out [-1,0,-1]: the input shard on axis 2 (8 over 3) is lost
    case = {"rule": "transpose", "mesh": [2, 3], "args": [{"shape": [4, 6, 8], "dims_mapping": [0, -1, 1]}, [2, 0, 1]]}
    r = get_rule("transpose").infer_forward(T(M23, [4, 6, 8], [0, -1, 1]), [2, 0, 1])
    assert r.inputs[0].dims_mapping == (0, -1, -1)
    assert r.outputs[0].dims_mapping == (-1, 0, -1)
    assert verify("transpose", case).sound
    paddle = {"inputs": [{"dims_mapping": [0, -1, 1]}], "outputs": [{"dims_mapping": [-1, 0, -1]}]}
    assert verify("transpose", case, result=paddle).status == "unsound"


def test_transpose_reverse_output_is_what_x_produces() -> None:
    # Paddle 3.3.1 returns out [1,0,-1] unchanged, but 8 does not split over mesh dim 1 (size 3)
    r = get_rule("transpose").infer_backward(T(M23, [4, 6, 8], [-1, -1, -1]), T(M23, [8, 4, 6], [1, 0, -1]), [2, 0, 1])
    assert r.inputs[0].dims_mapping == (0, -1, -1)
    assert r.outputs[0].dims_mapping == (-1, 0, -1)


def test_transpose_keeps_partial_forward_not_backward() -> None:
    m = ProcessMesh([2, 4])
    r = get_rule("transpose").infer_forward(T(m, [4, 6, 8], [0, -1, -1], [1]), [2, 0, 1])
    assert r.outputs[0].partial == r.inputs[0].partial and r.outputs[0].partial
    r = get_rule("transpose").infer_backward(T(m, [4, 6, 8], [-1, -1, -1]), T(m, [8, 4, 6], [-1, 0, -1], [1]), [2, 0, 1])
    assert not r.outputs[0].partial and not r.inputs[0].partial


def test_transpose_reverse_rejects_illegal_x() -> None:
    # Paddle's own unit test passes x [1, 0] on a 1-D mesh to infer_backward (it ignores x); spmdkit rejects it
    line = answer_line('{"rule":"transpose","mesh":[4],"mode":"backward","args":[{"shape":[64,36],"dims_mapping":[1,0]},'
                       '{"shape":[36,64],"dims_mapping":[-1,0]},[1,0]]}')
    assert line["error"] == "InvalidDimsMappingError" and "'x'" in line["message"]


@pytest.mark.parametrize(("perm", "msg"), [([0, 1], "2 entries for a 3-D x"), ([0, 0, 1], "not a permutation"),
                                           ([0, 1, 3], "not a permutation")])
def test_transpose_bad_perm(perm: list[int], msg: str) -> None:
    with pytest.raises(InvalidAttributeError, match=msg):
        get_rule("transpose").infer_forward(T(M23, [4, 6, 8], [0, -1, 1]), perm)


def test_transpose_reverse_rank_mismatch() -> None:
    with pytest.raises(ShapeMismatchError, match="out has 2 dims"):
        get_rule("transpose").infer_backward(T(M23, [4, 6, 8], [-1, -1, -1]), T(M23, [8, 4], [-1, -1]), [2, 0, 1])


def test_transpose_grad_inverse_perm() -> None:
    r = get_rule("transpose_grad").infer_forward(T(M23, [8, 4, 6], [1, 0, -1]), [2, 0, 1])
    # out_grad axis i is x axis perm[i]: x_grad = [out_grad axis 1, axis 2, axis 0]; 8 % 3 != 0 drops mesh dim 1
    assert r.outputs[0].dims_mapping == (0, -1, -1)


def test_default_dp_two_mesh_dims_resolved() -> None:
    # Paddle 3.3.1 raises NotImplementedError ("sharded by two different mesh dimension")
    x, y = T(M23, [10, 10, 32, 48], [0, -1, -1, -1]), T(M23, [32, 48], [1, -1])
    r = get_rule("default_data_parallel").infer_forward([x, y], [T(M23, [10, 32], [-1, -1])])
    assert [a.dims_mapping for a in r.inputs] == [(0, -1, -1, -1), (0, -1)]
    assert [a.dims_mapping for a in r.outputs] == [(0, -1)]


def test_default_dp_zero_d_output_replicates_everything() -> None:
    x = T(M23, [6, 4], [0, -1])
    r = get_rule("default_").infer_forward([x], [T(M23, [], [])])
    assert r.inputs[0].dims_mapping == (-1, -1) and r.outputs[0].dims_mapping == ()


def test_default_dp_co_shard_keeps_largest_mesh_dim() -> None:
    m = ProcessMesh([1, 4])
    r = get_rule("default_data_parallel").infer_forward([T(m, [8], [(0, 1)])], [T(m, [8, 3], [-1, -1])])
    assert r.inputs[0].dims_mapping == (1,) and r.outputs[0].dims_mapping == (1, -1)


def test_generic_rules_need_a_tensor() -> None:
    for name in ("default_data_parallel", "replicated"):
        with pytest.raises(InvalidArgumentError, match="no tensor"):
            get_rule(name).infer_forward([], [])


def test_generic_rules_mesh_mismatch() -> None:
    with pytest.raises(SpmdError):
        get_rule("replicated").infer_forward([T(M23, [4], [0])], [T(ProcessMesh([6]), [4], [-1])])


def test_replicated_clears_everything() -> None:
    r = get_rule("replicated").infer_backward([T(M23, [4, 6], [0, 1])], [T(M23, [4], [1], [0])])
    assert r.inputs[0].dims_mapping == (-1, -1) and r.outputs[0].dims_mapping == (-1,)
    assert not r.outputs[0].partial


def test_bad_dims_mapping_names_argument() -> None:
    with pytest.raises(InvalidDimsMappingError):
        T(M23, [4, 6], [0, 0])



def test_verify_reports_an_illegal_answer_as_unsound() -> None:
    case = {"rule": "transpose", "mesh": [2, 3], "args": [{"shape": [4, 6], "dims_mapping": [0, -1]}, [1, 0]]}
    bad = {"inputs": [{"dims_mapping": [0, -1], "partial": {"0": "sum"}}], "outputs": [{"dims_mapping": [-1, 0]}]}
    v = verify("transpose", case, result=bad)
    assert v.status == "unsound" and "illegal" in v.detail
