"""Norm family (layer_norm, fused_rms_norm and their grads): deviations, behaviour,
errors and a property test."""

# mypy: disable-error-code="union-attr,operator,index,arg-type,type-arg"
from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spmdkit.core.dist_attr import ReduceType
from spmdkit.core.errors import (
    InvalidArgumentError,
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

M22 = ProcessMesh([2, 2])
M23 = ProcessMesh([2, 3])
SUM = ReduceType.SUM


def T(mesh: ProcessMesh, shape: list[int], dm: list[object] | None = None, partial: object = None) -> DistTensorSpec:
    return DistTensorSpec(shape, mesh=mesh, dims_mapping=dm if dm is not None else [-1] * len(shape), partial=partial)


def dms(part: Any) -> list[Any]:
    return [None if a is None else a.dims_mapping for a in part]


def partials(part: Any) -> list[Any]:
    return [None if a is None else a.partial for a in part]


LN = get_rule("layer_norm")
LNG = get_rule("layer_norm_grad")
RMS = get_rule("fused_rms_norm")
RMSG = get_rule("rms_norm_grad")


def _sim_status(case: dict[str, Any], result: dict[str, Any] | None = None) -> str:
    pytest.importorskip("numpy")
    from spmdkit.sim import verify

    return verify(None, case, result=result).status


# ---------------------------------------------------------------------------
# deviations from Paddle 3.3.1 (docs/deviations/norm.md)
# ---------------------------------------------------------------------------


def test_ln_reverse_two_mesh_dims_resolved() -> None:
    # Paddle's own unit test expects NotImplementedError here
    r = LN.infer_backward(
        T(M23, [64, 32, 1024]), T(M23, [1024]), T(M23, [1024]),
        T(M23, [64, 32, 1024], [1, -1, -1]), T(M23, [64, 32], [0, -1]), T(M23, [64, 32]), 1e-3, 2,
    )  # fmt: skip
    assert dms(r.inputs) == [(1, -1, -1), (-1,), (-1,)]
    assert dms(r.outputs) == [(1, -1, -1), (1, -1), (1, -1)]


def test_rms_reverse_two_mesh_dims_resolved() -> None:
    r = RMS.infer_backward(
        T(M22, [8, 6, 4]), T(M22, [4]), T(M22, [8, 6, 4], [0, -1, -1]), T(M22, [8, 6], [1, -1]), 1e-6
    )
    assert dms(r.inputs) == [(0, -1, -1), (-1,)]
    assert dms(r.outputs) == [(0, -1, -1), (0, -1)]


_PARTIAL_OUT_CASE = {
    "rule": "layer_norm", "mesh": [2, 2], "mode": "backward",
    "args": [{"shape": [8, 6, 4]}, {"shape": [4]}, {"shape": [4]},
             {"shape": [8, 6, 4], "dims_mapping": [0, -1, -1], "partial": [1]},
             {"shape": [8, 6]}, {"shape": [8, 6]}, 1e-5, 2],
}  # fmt: skip
_PARTIAL_OUT_PADDLE = {
    "inputs": [{"dims_mapping": [0, -1, -1]}, {"dims_mapping": [-1]}, {"dims_mapping": [-1]}],
    "outputs": [{"dims_mapping": [0, -1, -1], "partial": {"1": "sum"}}, {"dims_mapping": [0, -1]},
                {"dims_mapping": [0, -1]}],
}  # fmt: skip


def test_ln_reverse_partial_out_cleared() -> None:
    got = answer_line(json.dumps(_PARTIAL_OUT_CASE))
    assert [o["partial"] for o in got["outputs"]] == [{}, {}, {}]
    assert got["outputs"][0]["dims_mapping"] == [0, -1, -1]
    assert _sim_status(_PARTIAL_OUT_CASE) == "sound"
    assert _sim_status(_PARTIAL_OUT_CASE, _PARTIAL_OUT_PADDLE) == "unsound"


_PARTIAL_X_CASE = {
    "rule": "layer_norm", "mesh": [2, 2], "mode": "backward",
    "args": [{"shape": [8, 6, 4], "partial": [1]}, {"shape": [4]}, {"shape": [4]},
             {"shape": [8, 6, 4], "dims_mapping": [0, -1, -1]}, {"shape": [8, 6]}, {"shape": [8, 6]}, 1e-5, 2],
}  # fmt: skip
_PARTIAL_X_PADDLE = {
    "inputs": [{"dims_mapping": [0, -1, -1], "partial": {"1": "sum"}}, {"dims_mapping": [-1]}, {"dims_mapping": [-1]}],
    "outputs": [{"dims_mapping": [0, -1, -1]}, {"dims_mapping": [0, -1]}, {"dims_mapping": [0, -1]}],
}  # fmt: skip


def test_ln_reverse_partial_x_cleared() -> None:
    got = answer_line(json.dumps(_PARTIAL_X_CASE))
    assert got["inputs"][0] == {"dims_mapping": [0, -1, -1], "partial": {}}
    assert _sim_status(_PARTIAL_X_CASE) == "sound"
    assert _sim_status(_PARTIAL_X_CASE, _PARTIAL_X_PADDLE) == "unsound"


def test_ln_forward_repeated_mesh_dim_rejected() -> None:
    line = {
        "rule": "layer_norm",
        "mesh": [2, 2],
        "args": [{"shape": [64, 32, 16], "dims_mapping": [0, 0, -1]}, {"shape": [16]}, {"shape": [16]}, 1e-5, 2],
    }
    got = answer_line(json.dumps(line))
    assert got["error"] == "InvalidDimsMappingError"
    assert "x" in got["message"] and "mesh dim 0" in got["message"]
    with pytest.raises(InvalidDimsMappingError):
        T(M22, [64, 32, 16], [0, 0, -1])


def test_ln_reverse_flat_mean_rejected() -> None:
    with pytest.raises(ShapeMismatchError, match=r"layer_norm: mean has shape \[48\], expected x.shape\[:2\]"):
        LN.infer_backward(T(M22, [8, 6, 4]), T(M22, [4]), T(M22, [4]), T(M22, [8, 6, 4], [0, -1, -1]),
                          T(M22, [48]), T(M22, [48]), 1e-5, 2)  # fmt: skip


def test_rms_absent_scale() -> None:
    r = RMS.infer_forward(T(M22, [8, 6, 4], [0, -1, 1]), None, 1e-6)
    assert dms(r.inputs) == [(0, -1, -1), None]
    assert dms(r.outputs) == [(0, -1, -1), (0, -1)]
    r = RMSG.infer_forward(T(M22, [8, 6, 4], [0, -1, -1]), None, T(M22, [8, 6], [0, -1]), T(M22, [8, 6, 4]), 1e-6)
    assert dms(r.outputs) == [(0, -1, -1), None]


def test_shape_checks() -> None:
    with pytest.raises(ShapeMismatchError, match="layer_norm: scale has 7 elements, the normalized axes of x have 4"):
        LN.infer_forward(T(M22, [8, 6, 4]), T(M22, [7]), T(M22, [4]), 1e-5, 2)
    with pytest.raises(ShapeMismatchError, match="layer_norm: bias must be 1-D"):
        LN.infer_forward(T(M22, [8, 6, 4]), T(M22, [4]), T(M22, [4, 1]), 1e-5, 2)
    with pytest.raises(ShapeMismatchError, match=r"layer_norm: out has shape \[8, 6, 5\]"):
        LN.infer_backward(T(M22, [8, 6, 4]), T(M22, [4]), T(M22, [4]), T(M22, [8, 6, 5]), T(M22, [8, 6]),
                          T(M22, [8, 6]), 1e-5, 2)  # fmt: skip
    with pytest.raises(ShapeMismatchError, match="fused_rms_norm: scale must be 1-D"):
        RMS.infer_forward(T(M22, [8, 6, 4]), T(M22, [4, 1]), 1e-6)
    with pytest.raises(ShapeMismatchError, match=r"fused_rms_norm: scale's axis 0 \(h\) is 5 but x's axis 2 is 4"):
        RMS.infer_forward(T(M22, [8, 6, 4]), T(M22, [5]), 1e-6)


def test_ln_grad_partial_inputs_cleared() -> None:
    # Paddle keeps x / mean / variance partial (only out_grad's is cleaned)
    r = LNG.infer_forward(
        T(M22, [8, 6, 4], [0, -1, -1], [1]), T(M22, [24]), T(M22, [24]), T(M22, [8], [0], [1]),
        T(M22, [8], [0], [1]), T(M22, [8, 6, 4], [0, -1, -1], [1]), 1e-5, 1,
    )  # fmt: skip
    assert partials(r.inputs) == [(), (), (), (), (), ()]
    assert dms(r.inputs) == [(0, -1, -1), (-1,), (-1,), (0,), (0,), (0, -1, -1)]
    assert partials(r.outputs) == [(), ((0, SUM),), ((0, SUM),)]


def test_rms_grad_merges_like_layer_norm_grad() -> None:
    # Paddle aligns by AlignDimsSharding's cost model; spmdkit merges (larger tensor wins)
    r = RMSG.infer_forward(T(M22, [8, 6, 4], [-1, -1, -1]), T(M22, [4]), T(M22, [8, 6], [-1, 1]),
                           T(M22, [8, 6, 4], [0, -1, 1]), 1e-6)  # fmt: skip
    assert dms(r.inputs) == [(0, 1, -1), (-1,), (0, 1), (0, 1, -1)]
    assert dms(r.outputs) == [(0, 1, -1), (-1,)]
    assert r.outputs[1].partial == ((0, SUM), (1, SUM))


# ---------------------------------------------------------------------------
# behaviour that agrees with Paddle 3.3.1
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mesh", "entry", "kept"),
    [([2, 3], [0, 1], 1), ([3, 2], [0, 1], 0), ([2, 2], [0, 1], 0), ([2, 2], [1, 0], 1), ([2, 4, 3], [2, 0, 1], 1)],
)
def test_co_shard_keeps_largest_mesh_dim(mesh: list[int], entry: list[int], kept: int) -> None:
    m = ProcessMesh(mesh)
    r = LN.infer_forward(T(m, [24, 4], [entry, -1]), None, None, 1e-5, 1)
    assert dms(r.inputs) == [(kept, -1), None, None]
    assert dms(r.outputs) == [(kept, -1), (kept,), (kept,)]


def test_reverse_normalized_axis_mesh_dim_blocks_stats() -> None:
    # out shards its normalized axis on mesh dim 1: Paddle's merge then drops it from mean
    r = LN.infer_backward(T(M22, [8, 6, 4]), T(M22, [4]), T(M22, [4]), T(M22, [8, 6, 4], [0, -1, 1]),
                          T(M22, [8, 6], [-1, 1]), T(M22, [8, 6]), 1e-5, 2)  # fmt: skip
    assert dms(r.inputs)[0] == (0, -1, -1)
    assert dms(r.outputs) == [(0, -1, -1), (0, -1), (0, -1)]
    r = RMS.infer_backward(
        T(M22, [8, 6, 4]), T(M22, [4]), T(M22, [8, 6, 4], [-1, -1, 1]), T(M22, [8, 6], [-1, 1]), 1e-6
    )
    assert dms(r.outputs) == [(-1, -1, -1), (-1, -1)]


def test_uneven_batch_kept() -> None:
    r = LN.infer_forward(T(ProcessMesh([4]), [6, 32, 16], [0, -1, -1]), T(ProcessMesh([4]), [512]), None, 1e-5, 1)
    assert dms(r.outputs) == [(0, -1, -1), (0,), (0,)]


def test_forward_partial_x_resharded() -> None:
    r = LN.infer_forward(T(M22, [8, 6, 4], [0, -1, -1], [1]), T(M22, [24], [0]), T(M22, [24], None, [0]), 1e-5, 1)
    assert partials(r.inputs) == [(), (), ()]
    assert dms(r.inputs) == [(0, -1, -1), (-1,), (-1,)]
    assert partials(r.outputs) == [(), (), ()]


def test_begin_norm_axis_edges() -> None:
    r = LN.infer_forward(T(M22, [8, 6, 4], [0, 1, -1]), T(M22, [192]), T(M22, [192]), 1e-5, 0)
    assert dms(r.outputs) == [(-1, -1, -1), (), ()]
    r = LN.infer_forward(T(M22, [8, 6, 4], [0, 1, -1]), None, None, 1e-5, 3)
    assert dms(r.outputs) == [(0, 1, -1), (0, 1, -1), (0, 1, -1)]
    r = LNG.infer_forward(T(M22, [8, 6, 4], [0, 1, -1]), T(M22, [192]), None, T(M22, []), T(M22, []),
                          T(M22, [8, 6, 4], [0, 1, -1]), 1e-5, 0)  # fmt: skip
    assert dms(r.outputs) == [(-1, -1, -1), (-1,), None]
    assert partials(r.outputs) == [(), (), None]


def test_ln_grad_scale_grad_partial() -> None:
    r = LNG.infer_forward(T(M22, [16, 32, 32], [0, 1, -1]), T(M22, [32], [0]), T(M22, [32], [0]),
                          T(M22, [16, 32], [0, 1]), T(M22, [16, 32], [0, 1]), T(M22, [16, 32, 32], [0, 1, -1]),
                          1.0, 2)  # fmt: skip
    assert dms(r.inputs) == [(0, 1, -1), (-1,), (-1,), (0, 1), (0, 1), (0, 1, -1)]
    assert dms(r.outputs) == [(0, 1, -1), (-1,), (-1,)]
    assert partials(r.outputs) == [(), ((0, SUM), (1, SUM)), ((0, SUM), (1, SUM))]


def test_keyword_arguments_and_defaults() -> None:
    x = T(M22, [8, 6, 4], [0, -1, -1])
    r = LN.infer_forward(x=x, scale=None, bias=None)
    assert dms(r.outputs) == [(0, -1, -1), (0,), (0,)]
    r = get_rule("fused_rms_norm_grad").infer_forward(x, None, T(M22, [8, 6], [0, -1]), x)
    assert dms(r.outputs) == [(0, -1, -1), None]


# ---------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("bna", [-1, 4, 7])
def test_begin_norm_axis_out_of_range(bna: int) -> None:
    need = rf"needs 0 <= begin_norm_axis <= len\(x.shape\), got begin_norm_axis = {bna}, x's shape = \[8, 6, 4\]"
    with pytest.raises(InvalidAttributeError, match="layer_norm: " + need):
        LN.infer_forward(T(M22, [8, 6, 4]), None, None, 1e-5, bna)
    with pytest.raises(InvalidAttributeError, match="layer_norm_grad: " + need):
        LNG.infer_forward(T(M22, [8, 6, 4]), None, None, T(M22, [8]), T(M22, [8]), T(M22, [8, 6, 4]), 1e-5, bna)


def test_errors() -> None:
    with pytest.raises(ShapeMismatchError, match="fused_rms_norm: x must be at least 1-D"):
        RMS.infer_forward(T(M22, []), T(M22, [4]), 1e-6)
    with pytest.raises(ShapeMismatchError, match="rms_norm_grad: invvar has shape"):
        RMSG.infer_forward(T(M22, [8, 6, 4]), T(M22, [4]), T(M22, [8]), T(M22, [8, 6, 4]), 1e-6)
    with pytest.raises(ShapeMismatchError, match="rms_norm_grad: out_grad has shape"):
        RMSG.infer_forward(T(M22, [8, 6, 4]), T(M22, [4]), T(M22, [8, 6]), T(M22, [8, 6]), 1e-6)
    with pytest.raises(ShapeMismatchError, match="layer_norm_grad: variance has shape"):
        LNG.infer_forward(T(M22, [8, 6, 4]), None, None, T(M22, [8]), T(M22, [9]), T(M22, [8, 6, 4]), 1e-5, 1)
    with pytest.raises(ShapeMismatchError, match="layer_norm_grad: scale has 5 elements"):
        LNG.infer_forward(T(M22, [8, 6, 4]), T(M22, [5]), None, T(M22, [8]), T(M22, [8]), T(M22, [8, 6, 4]), 1e-5, 1)
    with pytest.raises(InvalidMeshError, match="layer_norm"):
        LN.infer_forward(T(M22, [8, 6, 4]), T(M23, [24]), None, 1e-5, 1)
    with pytest.raises(InvalidArgumentError, match="layer_norm: argument 'x' must be a tensor"):
        LN.infer_forward([8, 6, 4], None, None, 1e-5, 1)
    with pytest.raises(InvalidAttributeError, match="begin_norm_axis"):
        LN.infer_forward(T(M22, [8, 6, 4]), None, None, 1e-5, "1")
    with pytest.raises(InvalidArgumentError, match="fused_rms_norm: missing argument 'invvar'"):
        RMS.infer_backward(T(M22, [8, 6, 4]), None, T(M22, [8, 6, 4]))


# ---------------------------------------------------------------------------
# property: every answer is sound (simulator) or an SpmdError
# ---------------------------------------------------------------------------


@st.composite
def _ln_case(draw: Any) -> dict[str, Any]:
    mesh = draw(st.lists(st.sampled_from([1, 2, 3, 4]), min_size=1, max_size=3))
    nd = draw(st.integers(0, 4))
    shape = draw(st.lists(st.sampled_from([1, 2, 3, 4, 6, 8]), min_size=nd, max_size=nd))
    free = list(range(len(mesh)))

    def mapping(n: int) -> list[Any]:
        out: list[Any] = []
        avail = list(free)
        for _ in range(n):
            if avail and draw(st.booleans()):
                if len(avail) >= 2 and draw(st.booleans()):
                    out.append([avail.pop(), avail.pop()])
                else:
                    out.append(avail.pop(draw(st.integers(0, len(avail) - 1))))
            else:
                out.append(-1)
        return out

    def tensor(s: list[int]) -> dict[str, Any]:
        dm = mapping(len(s))
        used = {d for e in dm for d in (e if isinstance(e, list) else [e]) if d != -1}
        rest = [d for d in free if d not in used]
        part = [d for d in rest if draw(st.integers(0, 4)) == 0]
        return {"shape": s, "dims_mapping": dm, "partial": part}

    rule = draw(st.sampled_from(["layer_norm", "fused_rms_norm", "layer_norm_grad", "rms_norm_grad"]))
    mode = draw(st.sampled_from(["forward", "backward"])) if rule in ("layer_norm", "fused_rms_norm") else "forward"
    if rule.startswith("layer_norm"):
        bna = draw(st.integers(0, nd))
        tail = 1
        for s in shape[bna:]:
            tail *= s
        opt = [tensor([tail]) if draw(st.booleans()) else None for _ in range(2)]
        stat = shape[:bna]
        if rule == "layer_norm_grad":
            args = [tensor(shape), *opt, tensor(stat), tensor(stat), tensor(shape), 1e-5, bna]
        elif mode == "forward":
            args = [tensor(shape), *opt, 1e-5, bna]
        else:
            args = [tensor(shape), *opt, tensor(shape), tensor(stat), tensor(stat), 1e-5, bna]
    else:
        scale = tensor(shape[-1:]) if shape and draw(st.booleans()) else None
        stat = shape[:-1]
        if rule == "rms_norm_grad":
            args = [tensor(shape), scale, tensor(stat), tensor(shape), 1e-6]
        elif mode == "forward":
            args = [tensor(shape), scale, 1e-6]
        else:
            args = [tensor(shape), scale, tensor(shape), tensor(stat), 1e-6]
    return {"rule": rule, "mesh": mesh, "mode": mode, "args": args}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_ln_case())
def test_property_sound_or_error(case: dict[str, Any]) -> None:
    got = answer_line(json.dumps(case))
    if "error" in got:
        assert got["error"] in {c.__name__ for c in _spmd_error_classes()}
        return
    status = _sim_status(case)
    assert status in ("sound", "skipped"), f"{status}: {json.dumps(case)}"


def _spmd_error_classes() -> list[type]:
    out: list[type] = []
    todo: list[type] = [SpmdError]
    while todo:
        c = todo.pop()
        out.append(c)
        todo.extend(c.__subclasses__())
    return out


@pytest.mark.parametrize(("rule", "mode"), [
    ("fused_rms_norm", "forward"), ("fused_rms_norm", "backward"), ("rms_norm_grad", "forward"),
])
def test_fused_rms_norm_zero_d_scale_is_absent(rule: str, mode: str) -> None:
    # a 0-D scale (shape []) is how Paddle's callers pass an absent one
    from spmd_helpers import assert_0d_is_absent

    assert_0d_is_absent(rule, mode, 19, ["scale"], n=12, sim_reads_0d=False)
