"""conv family (conv2d, conv3d, conv2d_transpose, depthwise_conv2d, batch_norm, group_norm,
instance_norm, roi_align and their grads): Paddle's unit-test cases, hand-checked answers,
deviations, errors, numeric grads and soundness."""

# mypy: disable-error-code="union-attr,index,arg-type"
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from spmd_helpers import T, dms, soundness_tests
from spmd_helpers import global_ctx as _ctx
from spmd_helpers import numeric_grad as _numeric_grad
from spmdkit.core.dist_attr import ReduceType
from spmdkit.core.errors import InvalidAttributeError, InvalidMeshError, ShapeMismatchError, SpmdError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.ops import get_rule
from spmdkit.sim import SOUND, UNSOUND, verify
from spmdkit.sim.reference import get_reference

M2 = ProcessMesh([2])
M22 = ProcessMesh([2, 2])
M222 = ProcessMesh([2, 2, 2])
SUM = ReduceType.SUM


def parts(attrs: Any) -> list[Any]:
    return [None if a is None else dict(a.partial) for a in attrs]


def case(rule: str, mesh: list[int], mode: str, *args: Any) -> dict[str, Any]:
    return {"rule": rule, "mesh": mesh, "mode": mode, "args": list(args)}


def J(shape: list[int], dm: list[Any], partial: Any = None) -> dict[str, Any]:
    d: dict[str, Any] = {"shape": shape, "dims_mapping": dm}
    if partial is not None:
        d["partial"] = partial
    return d


A3: tuple[Any, ...] = ([1, 1, 1], [0, 0, 0], "EXPLICIT", 1, [1, 1, 1])
AT: tuple[Any, ...] = ([1, 1], [0, 0], [], [], "EXPLICIT", 1, [1, 1])
AD: tuple[Any, ...] = ([1, 1], [0, 0], "EXPLICIT", 4, [1, 1])

# ---------------------------------------------------------------------------
# Paddle's own unit tests (test_conv2d_rule.py, test_conv3d_rule.py, test_conv2d_transpose_rule.py,
# test_depthwise_conv2d_rule.py, test_roi_align_rule.py)
# ---------------------------------------------------------------------------

_FWD = [  # input dm, filter dm -> output dm, output partial mesh dims
    ([0, -1], [-1, -1], [0, -1], {}),
    ([-1, -1], [0, -1], [-1, 0], {}),
    ([0, -1], [1, -1], [0, 1], {}),
    ([-1, 0], [-1, 0], [-1, -1], {0: SUM}),
    ([0, 2], [1, 2], [0, 1], {2: SUM}),
]


@pytest.mark.parametrize(("x", "w", "out", "pt"), _FWD)
def test_paddle_conv2d_forward(x: list[int], w: list[int], out: list[int], pt: dict[int, Any]) -> None:
    r = get_rule("conv2d").infer_forward(T(M222, [2, 4, 8, 8], [*x, -1, -1]), T(M222, [10, 4, 3, 3], [*w, -1, -1]))
    assert dms(r.inputs) == [(*x, -1, -1), (*w, -1, -1)]
    assert dms(r.outputs) == [(*out, -1, -1)] and parts(r.outputs) == [pt]


@pytest.mark.parametrize(("x", "w", "out", "pt"), _FWD)
def test_paddle_conv3d_forward(x: list[int], w: list[int], out: list[int], pt: dict[int, Any]) -> None:
    r = get_rule("conv3d").infer_forward(T(M222, [2, 4, 6, 8, 8], [*x, -1, -1, -1]),
                                         T(M222, [10, 4, 2, 3, 3], [*w, -1, -1, -1]), *A3, "NCDHW")
    assert dms(r.outputs) == [(*out, -1, -1, -1)] and parts(r.outputs) == [pt]


def test_paddle_conv2d_reverse() -> None:
    r = get_rule("conv2d").infer_backward(T(M222, [2, 4, 8, 8], [-1] * 4), T(M222, [10, 4, 3, 3], [-1] * 4),
                                          T(M222, [2, 10, 6, 6], [0, 1, -1, -1]))
    assert dms(r.inputs) == [(0, -1, -1, -1), (1, -1, -1, -1)]
    assert dms(r.outputs) == [(0, 1, -1, -1)] and parts(r.outputs) == [{}]


@pytest.mark.parametrize(("x", "w", "out", "pt"), [
    ([0, -1], [-1, -1], [0, -1], {}),
    ([-1, -1], [-1, 0], [-1, 0], {}),
    ([0, -1], [-1, 1], [0, 1], {}),
    ([-1, 0], [0, -1], [-1, -1], {0: SUM}),
    ([0, 2], [2, 1], [0, 1], {2: SUM}),
])
def test_paddle_conv2d_transpose_forward(x: list[int], w: list[int], out: list[int], pt: dict[int, Any]) -> None:
    r = get_rule("conv2d_transpose").infer_forward(T(M222, [2, 4, 8, 8], [*x, -1, -1]),
                                                   T(M222, [4, 6, 3, 3], [*w, -1, -1]), *AT, "NCHW")
    assert dms(r.outputs) == [(*out, -1, -1)] and parts(r.outputs) == [pt]


def test_paddle_conv2d_transpose_grad() -> None:
    """Paddle's case 1: input_grad partial over m's mesh dim, filter_grad over n's."""
    r = get_rule("conv2d_transpose").infer_backward(
        T(M222, [2, 4, 8, 8], [-1] * 4), T(M222, [4, 6, 3, 3], [-1] * 4), T(M222, [2, 6, 10, 10], [0, 1, -1, -1]),
        *AT, "NCHW")
    assert dms(r.inputs) == [(0, -1, -1, -1), (-1, 1, -1, -1), (0, 1, -1, -1)]
    assert dms(r.outputs) == [(0, -1, -1, -1), (-1, 1, -1, -1)]
    assert parts(r.outputs) == [{1: SUM}, {0: SUM}]


@pytest.mark.parametrize("fmt", ["NCHW", "NHWC"])
def test_paddle_depthwise_batch_cases(fmt: str) -> None:
    """The cases of Paddle's test that shard only the batch, or a channel it resets."""
    shape = [2, 4, 8, 8] if fmt == "NCHW" else [2, 8, 8, 4]
    dw = get_rule("depthwise_conv2d")
    r = dw.infer_forward(T(M222, shape, [0, -1, -1, -1]), T(M222, [8, 1, 3, 3], [-1] * 4), *AD, fmt)
    assert dms(r.outputs) == [(0, -1, -1, -1)]
    cdm = [-1, 0, -1, -1] if fmt == "NCHW" else [-1, -1, -1, 0]
    r = dw.infer_forward(T(M222, shape, cdm), T(M222, [8, 1, 3, 3], [-1] * 4), *AD, fmt)
    assert dms(r.inputs) == [(-1,) * 4, (-1,) * 4] and dms(r.outputs) == [(-1,) * 4]


def test_paddle_roi_align_cases_corrected() -> None:
    """Paddle's roi_align test with boxes [6, 4] and out_grad [6, 4, 3, 3] (its own shapes,
    boxes [6, 6] and out_grad [6, 2, 3, 3], are rejected: roi-shape-checks)."""
    m = M22
    x, bx, bn = T(m, [2, 4, 16, 16], [0, 1, -1, -1]), T(m, [6, 4], [-1, 1]), T(m, [2], [-1])
    ra = get_rule("roi_align")
    for n in (bn, None):
        r = ra.infer_forward(x, bx, n, 3, 3, 0.5, -1, True)
        assert dms(r.inputs) == [(-1, 1, -1, -1), (-1, -1), None if n is None else (-1,)]
        assert dms(r.outputs) == [(-1, 1, -1, -1)]
        r = ra.infer_backward(x, bx, n, T(m, [6, 4, 3, 3], [0, -1, -1, -1]), 3, 3, 0.5, -1, True)
        assert dms(r.inputs) == [(-1, 1, -1, -1), (-1, -1), None if n is None else (-1,), (-1, 1, -1, -1)]
        assert dms(r.outputs) == [(-1, 1, -1, -1)] and parts(r.outputs) == [{}]


# ---------------------------------------------------------------------------
# deviations from Paddle 3.3.1
# ---------------------------------------------------------------------------


def test_conv_spatial_axes_replicated() -> None:
    """conv-spatial-sharded: Paddle keeps a sharded H / W of the input on the output (and
    shards the filter's kernel axes); a rank would miss the halo rows."""
    c = case("conv2d", [3], "forward", J([4, 1, 4, 6], [-1, -1, -1, 0]), J([1, 1, 3, 2], [0, -1, -1, -1]))
    paddle = {"inputs": [{"dims_mapping": [-1, -1, -1, 0]}, {"dims_mapping": [-1, -1, -1, 0]}],
              "outputs": [{"dims_mapping": [-1, -1, -1, 0]}]}
    assert verify(None, c, result=paddle).status == UNSOUND
    r = get_rule("conv2d").infer_forward(T(ProcessMesh([3]), [4, 1, 4, 6], [-1, -1, -1, 0]),
                                         T(ProcessMesh([3]), [1, 1, 3, 2], [0, -1, -1, -1]))
    assert dms(r.inputs) == [(-1, -1, -1, -1), (0, -1, -1, -1)] and dms(r.outputs) == [(-1, 0, -1, -1)]
    assert verify(None, c).status == SOUND
    # the reverse infers no spatial sharding either
    r = get_rule("conv2d").infer_backward(T(M2, [1, 4, 4, 6], [0, -1, -1, -1]), T(M2, [3, 4, 3, 3], [-1, 0, -1, -1]),
                                          T(M2, [1, 3, 2, 4], [-1, -1, -1, 0]))
    assert dms(r.inputs) == [(-1,) * 4, (-1,) * 4] and dms(r.outputs) == [(-1,) * 4]


def test_conv_channel_conflict_resolved() -> None:
    """conv-paddle-raises: Paddle raises where the input and the filter shard the in-channels
    differently; the larger tensor keeps its sharding."""
    m = ProcessMesh([3, 2])
    r = get_rule("conv2d").infer_forward(T(m, [6, 4, 4, 3], [-1] * 4), T(m, [1, 4, 1, 3], [-1, 0, 1, -1]))
    assert dms(r.inputs) == [(-1, 0, -1, -1), (-1, 0, -1, -1)]
    assert dms(r.outputs) == [(-1,) * 4] and parts(r.outputs) == [{0: SUM}]
    r = get_rule("conv2d").infer_forward(T(m, [6, 4, 4, 3], [-1, 1, -1, -1]), T(m, [2, 4, 1, 3], [-1, 0, -1, -1]))
    assert dms(r.inputs) == [(-1, 1, -1, -1), (-1, 1, -1, -1)] and parts(r.outputs) == [{1: SUM}]


def test_conv2d_reverse_out_is_what_inputs_produce() -> None:
    """conv-reverse-out: Paddle echoes a co-sharded or partial output its inputs cannot produce."""
    m = ProcessMesh([4, 3, 2])
    r = get_rule("conv2d").infer_backward(T(m, [4, 4, 2, 4], [-1] * 4), T(m, [4, 4, 1, 2], [-1] * 4),
                                          T(m, [4, 4, 2, 3], [-1, (1, 0), -1, -1]))
    assert dms(r.inputs) == [(-1,) * 4, (0, -1, -1, -1)] and dms(r.outputs) == [(-1, 0, -1, -1)]
    r = get_rule("conv2d").infer_backward(T(M2, [2, 4, 3, 3], [-1] * 4), T(M2, [4, 4, 1, 1], [-1] * 4),
                                          T(M2, [2, 4, 3, 3], [-1] * 4, partial=[0]))
    assert parts(r.outputs) == [{}]


def test_channel_last_output_layout() -> None:
    """conv-channel-last-out: for NDHWC / NHWC the output's channels are its last axis; Paddle
    labels the output ``nm..`` whatever the format."""
    r = get_rule("conv3d").infer_forward(T(M222, [2, 6, 8, 8, 4], [0, -1, -1, -1, 2]),
                                         T(M222, [10, 4, 2, 3, 3], [1, 2, -1, -1, -1]), *A3, "NDHWC")
    assert dms(r.outputs) == [(0, -1, -1, -1, 1)] and parts(r.outputs) == [{2: SUM}]
    r = get_rule("conv2d_transpose").infer_forward(T(M222, [2, 8, 8, 4], [0, -1, -1, 2]),
                                                   T(M222, [4, 6, 3, 3], [2, 1, -1, -1]), *AT, "NHWC")
    assert dms(r.outputs) == [(0, -1, -1, 1)] and parts(r.outputs) == [{2: SUM}]
    c = case("conv2d_transpose", [2, 2, 2], "forward", J([2, 3, 3, 4], [0, -1, -1, 2]), J([4, 2, 2, 2], [2, 1, -1, -1]),
             *AT, "NHWC")
    assert verify(None, c).status == SOUND
    paddle = {"inputs": [{"dims_mapping": [0, -1, -1, 2]}, {"dims_mapping": [2, 1, -1, -1]}],
              "outputs": [{"dims_mapping": [0, 1, -1, -1], "partial": {"2": "sum"}}]}
    assert verify(None, c, result=paddle).status == UNSOUND


def test_conv_shape_checks() -> None:
    """conv-shape-checks: channel counts that do not match raise (Paddle's conv3d and
    conv2d_transpose tests pass NCDHW / NCHW shapes with a channel-last data_format)."""
    with pytest.raises(ShapeMismatchError, match=r"conv3d_grad: the input has 8 channels"):
        get_rule("conv3d").infer_backward(T(M222, [2, 4, 8, 8, 8], [-1] * 5), T(M222, [10, 4, 3, 3, 3], [-1] * 5),
                                          T(M222, [2, 10, 6, 6, 6], [0, 1, -1, -1, -1]), *A3, "NDHWC")
    with pytest.raises(ShapeMismatchError, match="conv2d_transpose_grad: output_grad"):
        get_rule("conv2d_transpose").infer_backward(T(M222, [2, 8, 8, 4], [-1] * 4), T(M222, [4, 6, 3, 3], [-1] * 4),
                                                    T(M222, [2, 6, 10, 10], [0, 1, -1, -1]), *AT, "NHWC")
    with pytest.raises(ShapeMismatchError, match="conv2d: input must be 4-D"):
        get_rule("conv2d").infer_forward(T(M2, [2, 4, 8], [-1] * 3), T(M2, [4, 4, 3, 3], [-1] * 4))
    with pytest.raises(ShapeMismatchError, match="conv2d: filter must be 4-D"):
        get_rule("conv2d").infer_forward(T(M2, [2, 4, 8, 8], [-1] * 4), T(M2, [4, 4, 3], [-1] * 3))
    with pytest.raises(ShapeMismatchError, match="conv2d: the input has 4 channels"):
        get_rule("conv2d").infer_forward(T(M2, [2, 4, 8, 8], [-1] * 4), T(M2, [4, 3, 3, 3], [-1] * 4))
    with pytest.raises(ShapeMismatchError, match="conv2d: output"):
        get_rule("conv2d").infer_backward(T(M2, [2, 4, 8, 8], [-1] * 4), T(M2, [5, 4, 3, 3], [-1] * 4),
                                          T(M2, [2, 4, 6, 6], [-1] * 4))


def test_conv_grad_partial_out_grad() -> None:
    """conv-grad-partial-channel: Paddle keeps out_grad partial on the mesh dim that also shards
    the in-channels (each rank would hold another addend of out_grad times its own channels:
    unsound); spmdkit reshards out_grad there. A SUM partial on a free mesh dim is kept and
    both grads are partial there too (they are linear in out_grad)."""
    args = (T(M222, [2, 4, 8, 8], [0, 2, -1, -1]), T(M222, [4, 6, 3, 3], [2, 1, -1, -1]),
            T(M222, [2, 6, 10, 10], [0, 1, -1, -1], partial=[2]), *AT, "NCHW")
    r = get_rule("conv2d_transpose").infer_backward(*args)
    assert dms(r.inputs) == [(0, 2, -1, -1), (2, 1, -1, -1), (0, 1, -1, -1)] and parts(r.inputs)[2] == {}
    assert parts(r.outputs) == [{1: SUM}, {0: SUM}]
    c = case("conv2d_transpose", [2, 2, 2], "backward", J([2, 4, 3, 3], [0, 2, -1, -1]), J([4, 6, 2, 2], [2, 1, -1, -1]),
             J([2, 6, 4, 4], [0, 1, -1, -1], [2]), *AT, "NCHW")
    paddle = {"inputs": [{"dims_mapping": [0, 2, -1, -1]}, {"dims_mapping": [2, 1, -1, -1]},
                         {"dims_mapping": [0, 1, -1, -1], "partial": {"2": "sum"}}],
              "outputs": [{"dims_mapping": [0, 2, -1, -1], "partial": {"1": "sum"}},
                          {"dims_mapping": [2, 1, -1, -1], "partial": {"0": "sum"}}]}
    assert verify(None, c, result=paddle).status == UNSOUND
    assert verify(None, c).status == SOUND
    # a free mesh dim: the partial stays
    r = get_rule("conv2d_grad").infer_forward(T(M222, [2, 4, 5, 5], [0, -1, -1, -1]), T(M222, [6, 4, 3, 3], [-1] * 4),
                                              T(M222, [2, 6, 3, 3], [0, 1, -1, -1], partial=[2]))
    assert parts(r.inputs)[2] == {2: SUM} and parts(r.outputs) == [{1: SUM, 2: SUM}, {0: SUM, 2: SUM}]
    c = case("conv2d_grad", [2, 2, 2], "forward", J([2, 4, 5, 5], [0, -1, -1, -1]), J([6, 4, 3, 3], [-1] * 4),
             J([2, 6, 3, 3], [0, 1, -1, -1], [2]))
    assert verify(None, c).status == SOUND


def test_depthwise_grouped_channels_replicated() -> None:
    """dw-grouped-channels: with groups > 1 a rank holding some output channels would need another
    ``groups``; Paddle shards the filter's output channels of depthwise_conv2d anyway."""
    dw = get_rule("depthwise_conv2d")
    r = dw.infer_forward(T(M222, [2, 4, 8, 8], [0, -1, -1, -1]), T(M222, [8, 1, 3, 3], [1, -1, -1, -1]), *AD, "NCHW")
    assert dms(r.inputs) == [(0, -1, -1, -1), (-1,) * 4] and dms(r.outputs) == [(0, -1, -1, -1)]
    c = case("depthwise_conv2d", [2], "forward", J([1, 2, 3, 3], [-1] * 4), J([4, 1, 2, 2], [0, -1, -1, -1]),
             [1, 1], [0, 0], "EXPLICIT", 2, [1, 1], "NCHW")
    paddle = {"inputs": [{"dims_mapping": [-1] * 4}, {"dims_mapping": [0, -1, -1, -1]}],
              "outputs": [{"dims_mapping": [-1, 0, -1, -1]}]}
    assert verify(None, c, result=paddle).status == UNSOUND
    assert verify(None, c).status == SOUND
    r = dw.infer_backward(T(M222, [2, 4, 8, 8], [-1] * 4), T(M222, [8, 1, 3, 3], [-1] * 4),
                          T(M222, [2, 8, 6, 6], [0, 1, -1, -1]), *AD, "NCHW")
    assert dms(r.inputs) == [(0, -1, -1, -1), (-1,) * 4, (0, -1, -1, -1)]
    assert dms(r.outputs) == [(0, -1, -1, -1), (-1,) * 4] and parts(r.outputs) == [{}, {0: SUM}]
    # grouped conv3d / conv2d_transpose likewise; groups 1 depthwise is a plain conv
    r = get_rule("conv3d").infer_forward(T(M22, [2, 4, 3, 3, 3], [0, 1, -1, -1, -1]),
                                         T(M22, [4, 2, 1, 1, 1], [-1, 1, -1, -1, -1]),
                                         [1, 1, 1], [0, 0, 0], "EXPLICIT", 2, [1, 1, 1], "NCDHW")
    assert dms(r.inputs) == [(0, -1, -1, -1, -1), (-1,) * 5] and parts(r.outputs) == [{}]
    r = dw.infer_forward(T(M2, [2, 1, 4, 4], [-1] * 4), T(M2, [4, 1, 3, 3], [0, -1, -1, -1]),
                         [1, 1], [0, 0], "EXPLICIT", 1, [1, 1], "NCHW")
    assert dms(r.outputs) == [(-1, 0, -1, -1)]


def test_batch_norm_scale_bias_follow_channels() -> None:
    """bn-scale-bias: with the channels sharded Paddle leaves scale / bias replicated (a rank's
    kernel then gets [C] for [C/k] channels); spmdkit shards them like the channels."""
    m = ProcessMesh([4, 2])
    x = T(m, [3, 2, 3, 1], [-1, 1, -1, 0])
    v = [T(m, [2], [1]) for _ in range(4)]
    r = get_rule("batch_norm").infer_forward(x, *v)
    assert dms(r.inputs) == [(-1, 1, -1, -1), (1,), (1,), (1,), (1,)]
    assert dms(r.outputs) == [(-1, 1, -1, -1), (1,), (1,), (1,), (1,), (-1,)]
    c = case("batch_norm", [4, 2], "forward", J([3, 2, 3, 1], [-1, 1, -1, -1]), J([2], [1]), J([2], [1]),
             J([2], [-1]), J([2], [-1]))
    paddle = {"inputs": [{"dims_mapping": [-1, 1, -1, -1]}, {"dims_mapping": [1]}, {"dims_mapping": [1]},
                         {"dims_mapping": [-1]}, {"dims_mapping": [-1]}],
              "outputs": [{"dims_mapping": [-1, 1, -1, -1]}] + [{"dims_mapping": [1]}] * 4 + [{"dims_mapping": [-1]}]}
    assert verify(None, c, result=paddle).status == UNSOUND
    assert verify(None, c).status == SOUND


def test_batch_norm_batch_replicated_and_reverse() -> None:
    """Batch statistics need the whole batch: n and the spatial axes are replicated; the reverse
    (Paddle has none) takes the channel sharding from out and the statistics."""
    r = get_rule("batch_norm").infer_forward(T(M22, [4, 6, 3], [0, -1, 1]), *[T(M22, [6], [-1])] * 4)
    assert dms(r.inputs)[0] == (-1, -1, -1) and dms(r.outputs)[1:5] == [(-1,)] * 4
    vec = [T(M22, [6], [-1])] * 4
    r = get_rule("batch_norm").infer_backward(T(M22, [4, 6, 3], [-1] * 3), *vec, T(M22, [4, 6, 3], [0, 1, -1]),
                                              T(M22, [6], [1]), T(M22, [6], [-1]), T(M22, [6], [-1]),
                                              T(M22, [6], [-1]), None)
    assert dms(r.inputs) == [(-1, 1, -1), (1,), (1,), (1,), (1,)]
    assert dms(r.outputs) == [(-1, 1, -1), (1,), (1,), (1,), (1,), None]


def test_batch_norm_grad_channels() -> None:
    """BatchNormGradInferSpmd: scale_grad / bias_grad sharded like the channels (Paddle:
    replicated, which a rank holding [C/k] of them cannot produce)."""
    m = M22
    v = T(m, [6], [-1])
    r = get_rule("batch_norm_grad").infer_forward(T(m, [4, 3, 6], [0, -1, 1]), v, v, v, v, v, v, None,
                                                  T(m, [4, 3, 6], [0, -1, 1]), 0.9, 1e-5, "NHWC")
    assert dms(r.inputs) == [(-1, -1, 1), (1,), (1,), (1,), (1,), (1,), (1,), None, (-1, -1, 1)]
    assert dms(r.outputs) == [(-1, -1, 1), (1,), (1,)] and parts(r.outputs) == [{}, {}, {}]


def test_group_norm_batch_only() -> None:
    """GroupNormInferSpmdBase: only the batch is shardable; mean / variance are [N, groups]."""
    r = get_rule("group_norm").infer_forward(T(M22, [4, 6, 3], [0, 1, -1]), T(M22, [6], [1]), None)
    assert dms(r.inputs) == [(0, -1, -1), (-1,), None]
    assert dms(r.outputs) == [(0, -1, -1), (0, -1), (0, -1)]
    r = get_rule("group_norm").infer_backward(T(M22, [4, 6, 3], [-1] * 3), None, None, T(M22, [4, 6, 3], [-1, 0, 1]),
                                              T(M22, [4, 2], [1, 0]), T(M22, [4, 2], [-1, -1]))
    assert dms(r.inputs)[0] == (1, -1, -1) and dms(r.outputs) == [(1, -1, -1), (1, -1), (1, -1)]
    r = get_rule("group_norm_grad").infer_forward(
        T(M22, [4, 6, 3], [0, 1, -1]), T(M22, [6], [-1]), T(M22, [6], [-1]), T(M22, [4, 6, 3], [-1] * 3),
        T(M22, [4, 2], [-1, -1]), T(M22, [4, 2], [-1, -1]), T(M22, [4, 6, 3], [-1] * 3), 1e-5, 2, "NCHW")
    assert dms(r.outputs) == [(0, -1, -1), (-1,), (-1,)] and parts(r.outputs) == [{}, {0: SUM}, {0: SUM}]


def test_instance_norm_flat_stats() -> None:
    """in-flat-stats: saved_mean / saved_variance are flat [N*C] (Paddle answers 2 entries);
    they carry n's and c's mesh dims co-sharded where that splits the flat axis the same way,
    else c (then n) is replicated; scale / bias follow c (Paddle: replicated)."""
    ins = get_rule("instance_norm")
    r = ins.infer_forward(T(M22, [2, 4, 3, 3], [0, 1, -1, -1]), T(M22, [4], [-1]), T(M22, [4], [-1]), 1e-5)
    assert dms(r.inputs) == [(0, 1, -1, -1), (1,), (1,)]
    assert dms(r.outputs) == [(0, 1, -1, -1), ((0, 1),), ((0, 1),)]
    r = ins.infer_forward(T(M2, [2, 1, 3, 2], [-1, 0, -1, -1]), T(M2, [1], [-1]), None, 1e-5)
    assert dms(r.inputs)[0] == (-1, -1, -1, -1) and dms(r.outputs)[1] == (-1,)
    r = ins.infer_forward(T(M2, [1, 4, 3, 2], [-1, 0, -1, -1]), None, None, 1e-5)
    assert dms(r.outputs) == [(-1, 0, -1, -1), (0,), (0,)]
    r = ins.infer_forward(T(M2, [3, 4, 3, 2], [0, -1, -1, -1]), None, None, 1e-5)  # uneven n: flat split differs
    assert dms(r.outputs)[1] == (-1,)
    c = case("instance_norm", [2, 2], "forward", J([2, 4, 3, 3], [0, 1, -1, -1]), J([4], [-1]), J([4], [-1]), 1e-5)
    assert verify(None, c).status == SOUND
    paddle = {"inputs": [{"dims_mapping": [0, 1, -1, -1]}, {"dims_mapping": [-1]}, {"dims_mapping": [-1]}],
              "outputs": [{"dims_mapping": [0, 1, -1, -1]}, {"dims_mapping": [0, 1]}, {"dims_mapping": [0, 1]}]}
    assert verify(None, c, result=paddle).status == UNSOUND


def test_instance_norm_grad_flat_stats() -> None:
    """in-grad-paddle-raises: InstanceNormGradInferSpmd requires 2-D saved statistics and raises
    on the real (flat [N*C]) ones; spmdkit answers, scale_grad / bias_grad partial over n."""
    r = get_rule("instance_norm").infer_backward(
        T(M22, [2, 4, 3, 3], [0, 1, -1, -1]), T(M22, [4], [-1]), T(M22, [4], [-1]), T(M22, [8], [-1]),
        T(M22, [8], [-1]), T(M22, [2, 4, 3, 3], [-1] * 4), 1e-5)
    assert dms(r.inputs) == [(0, 1, -1, -1), (1,), (1,), ((0, 1),), ((0, 1),), (0, 1, -1, -1)]
    assert dms(r.outputs) == [(0, 1, -1, -1), (1,), (1,)] and parts(r.outputs) == [{}, {0: SUM}, {0: SUM}]
    with pytest.raises(ShapeMismatchError, match="instance_norm_grad: saved_mean must be 1-D"):
        get_rule("instance_norm_grad").infer_forward(
            T(M22, [2, 4, 3, 3], [-1] * 4), None, None, T(M22, [2, 4], [-1, -1]), T(M22, [8], [-1]),
            T(M22, [2, 4, 3, 3], [-1] * 4))


def test_roi_align_grad_conflict_resolved() -> None:
    """roi-grad-conflict: Paddle raises where x and out_grad shard the channels differently;
    the larger tensor (here out_grad, 45 elements against 24) keeps its sharding."""
    m = ProcessMesh([2, 3])
    r = get_rule("roi_align").infer_backward(T(m, [2, 3, 2, 2], [-1, 1, -1, -1]), T(m, [5, 4], [-1, -1]),
                                             T(m, [2], [-1]), T(m, [5, 3, 3, 1], [-1, 0, -1, -1]), 3, 1, 0.5, 2, False)
    assert dms(r.inputs) == [(-1, 0, -1, -1), (-1, -1), (-1,), (-1, 0, -1, -1)] and dms(r.outputs) == [(-1, 0, -1, -1)]


def test_roi_align_shape_checks() -> None:
    """roi-shape-checks: boxes must be [K, 4] and out_grad [K, C, ph, pw] (Paddle's own test
    passes boxes [6, 6] and out_grad with 2 of x's 4 channels)."""
    x, bn = T(M22, [2, 4, 16, 16], [0, 1, -1, -1]), T(M22, [2], [-1])
    with pytest.raises(ShapeMismatchError, match="roi_align: boxes' axis 1 must be 4"):
        get_rule("roi_align").infer_forward(x, T(M22, [6, 6], [-1, 1]), bn, 3, 3, 0.5, -1, True)
    with pytest.raises(ShapeMismatchError, match=r"roi_align_grad: out_grad's axis 1 \(c\) is 2 but x's axis 1 is 4"):
        get_rule("roi_align").infer_backward(x, T(M22, [6, 4], [-1, 1]), bn, T(M22, [6, 2, 3, 3], [0, -1, -1, -1]),
                                             3, 3, 0.5, -1, True)
    with pytest.raises(ShapeMismatchError, match="roi_align: boxes_num's axis 0"):
        get_rule("roi_align").infer_forward(x, T(M22, [6, 4], [-1, 1]), T(M22, [3], [-1]), 3, 3, 0.5, -1, True)
    with pytest.raises(InvalidAttributeError, match="roi_align: pooled_height"):
        get_rule("roi_align").infer_forward(x, T(M22, [6, 4], [-1, 1]), bn, 0, 3, 0.5, -1, True)


# ---------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------


def test_errors_name_op_and_argument() -> None:
    with pytest.raises(InvalidAttributeError, match=r"conv3d: needs data_format in .* got data_format = 'NCHW'"):
        get_rule("conv3d").infer_forward(T(M2, [2, 4, 3, 3, 3], [-1] * 5), T(M2, [4, 4, 1, 1, 1], [-1] * 5),
                                         *A3, "NCHW")
    with pytest.raises(InvalidAttributeError, match="depthwise_conv2d: needs groups >= 1, got groups = 0"):
        get_rule("depthwise_conv2d").infer_forward(T(M2, [2, 4, 3, 3], [-1] * 4), T(M2, [4, 1, 1, 1], [-1] * 4),
                                                   [1, 1], [0, 0], "EXPLICIT", 0, [1, 1], "NCHW")
    with pytest.raises(ShapeMismatchError, match="conv2d_transpose: the input has 4 channels, the filter expects 3"):
        get_rule("conv2d_transpose").infer_forward(T(M2, [2, 4, 3, 3], [-1] * 4), T(M2, [3, 4, 1, 1], [-1] * 4),
                                                   *AT, "NCHW")
    with pytest.raises(InvalidMeshError, match="conv2d: filter lies on a different mesh"):
        get_rule("conv2d").infer_forward(T(M2, [2, 4, 3, 3], [-1] * 4), T(M22, [4, 4, 1, 1], [-1] * 4))
    with pytest.raises(ShapeMismatchError, match="batch_norm: x must be at least 2-D"):
        get_rule("batch_norm").infer_forward(T(M2, [4], [-1]), *[T(M2, [4], [-1])] * 4)
    with pytest.raises(ShapeMismatchError, match=r"batch_norm: scale's axis 0 \(c\) is 3 but x's axis 1 is 4"):
        get_rule("batch_norm").infer_forward(T(M2, [2, 4], [-1, -1]), T(M2, [4], [-1]), T(M2, [4], [-1]),
                                             T(M2, [3], [-1]), None)
    with pytest.raises(ShapeMismatchError, match="group_norm: x must be at least 3-D"):
        get_rule("group_norm").infer_forward(T(M2, [2, 4], [-1, -1]), None, None)
    with pytest.raises(ShapeMismatchError, match="group_norm: mean must be 2-D"):
        get_rule("group_norm").infer_backward(T(M2, [2, 4, 3], [-1] * 3), None, None, T(M2, [2, 4, 3], [-1] * 3),
                                              T(M2, [2], [-1]), T(M2, [2, 2], [-1, -1]))
    with pytest.raises(InvalidAttributeError, match=r"group_norm_grad: needs groups == -1 .*, got groups = 0"):
        get_rule("group_norm_grad").infer_forward(
            T(M2, [2, 4, 3], [-1] * 3), None, None, T(M2, [2, 4, 3], [-1] * 3), T(M2, [2, 2], [-1, -1]),
            T(M2, [2, 2], [-1, -1]), T(M2, [2, 4, 3], [-1] * 3), 1e-5, 0)
    with pytest.raises(ShapeMismatchError, match="instance_norm: x must be 4-D"):
        get_rule("instance_norm").infer_forward(T(M2, [2, 4, 3], [-1] * 3), None, None)
    with pytest.raises(SpmdError):
        get_rule("conv2d").infer_forward(T(M2, [2, 4, 3, 3], [-1] * 4), None)


def test_checks_beyond_the_shape_declarations() -> None:
    """What the declared shapes cannot say is checked too: the largest rank, per-channel lengths
    on a channel-last x, the flat N*C statistics, and roi_align's pooled sizes only after its shapes
    (Paddle's own test passes boxes [6, 6]: a shape error, whatever the attributes)."""
    vec = T(M2, [4], [-1])
    with pytest.raises(ShapeMismatchError, match="batch_norm: x must be at most 5-D"):
        get_rule("batch_norm").infer_forward(T(M2, [2, 4, 1, 1, 1, 1], [-1] * 6), vec, vec, vec, vec)
    with pytest.raises(ShapeMismatchError, match="group_norm: x must be at most 5-D"):
        get_rule("group_norm").infer_forward(T(M2, [2, 4, 1, 1, 1, 1], [-1] * 6), None, None)
    x = T(M2, [2, 3, 4], [-1] * 3)  # NHWC: the channels are the last axis (4)
    r = get_rule("batch_norm_grad").infer_forward(x, vec, vec, vec, vec, vec, vec, None, x, 0.9, 1e-5, "NHWC")
    assert dms(r.outputs) == [(-1, -1, -1), (-1,), (-1,)]
    with pytest.raises(ShapeMismatchError, match="batch_norm_grad: saved_mean's length is 4 but the channel"):
        get_rule("batch_norm_grad").infer_forward(x, None, None, *[T(M2, [3], [-1])] * 2, vec, T(M2, [3], [-1]),
                                                  None, x, 0.9, 1e-5, "NCHW")
    with pytest.raises(InvalidAttributeError, match=r"batch_norm_grad: needs len\(data_format\) >= 2"):
        get_rule("batch_norm_grad").infer_forward(x, vec, vec, vec, vec, vec, vec, None, x, 0.9, 1e-5, "N")
    with pytest.raises(ShapeMismatchError, match="group_norm_grad: scale's length is 3 but the channel count is 4"):
        get_rule("group_norm_grad").infer_forward(x, T(M2, [3], [-1]), None, x, T(M2, [2, 1], [-1, -1]),
                                                  T(M2, [2, 1], [-1, -1]), x, 1e-5, 1, "NHWC")
    with pytest.raises(ShapeMismatchError, match=r"instance_norm_grad: saved_variance's length is 7 but N\*C is 8"):
        get_rule("instance_norm_grad").infer_forward(T(M2, [2, 4, 3, 3], [-1] * 4), None, None, T(M2, [8], [-1]),
                                                     T(M2, [7], [-1]), T(M2, [2, 4, 3, 3], [-1] * 4))
    x, bn = T(M22, [2, 4, 16, 16], [0, 1, -1, -1]), T(M22, [2], [-1])
    with pytest.raises(ShapeMismatchError, match="roi_align: boxes' axis 1 must be 4"):
        get_rule("roi_align").infer_forward(x, T(M22, [6, 6], [-1, 1]), bn, 0, 3, 0.5, -1, True)
    with pytest.raises(ShapeMismatchError, match="conv2d_grad: 6 channels are not divisible by groups 4"):
        get_rule("conv2d_grad").infer_forward(T(M2, [2, 8, 5, 5], [-1] * 4), T(M2, [6, 2, 3, 3], [-1] * 4),
                                              T(M2, [2, 6, 3, 3], [-1] * 4), [1, 1], [0, 0], "EXPLICIT", [1, 1], 4)


def test_batch_norm_reverse_reserve_space() -> None:
    """The reverse answers a given reserve_space (an opaque buffer of any shape) 1-D replicated,
    an absent one None, and the statistics sharded like the channels of out."""
    vec = [T(M22, [6], [-1])] * 4
    outs = (T(M22, [4, 6, 3], [0, 1, -1]), T(M22, [6], [1]), T(M22, [6], [-1]), T(M22, [6], [-1]), T(M22, [6], [-1]))
    r = get_rule("batch_norm").infer_backward(T(M22, [4, 6, 3], [-1] * 3), *vec, *outs, T(M22, [5, 2], [0, 1]))
    assert dms(r.inputs) == [(-1, 1, -1), (1,), (1,), (1,), (1,)]
    assert dms(r.outputs) == [(-1, 1, -1), (1,), (1,), (1,), (1,), (-1,)] and parts(r.outputs) == [{}] * 6


# ---------------------------------------------------------------------------
# numeric gradients of the references
# ---------------------------------------------------------------------------

_RNG = np.random.default_rng(3)


def _grad_check(grad_name: str, fwd: Any, args: dict[str, Any], wrt: list[tuple[str, int]],
                out_key: str = "output_grad", atol: float = 1e-6) -> None:
    ref = get_reference(grad_name)
    a = dict(args)
    if ref.prepare is not None:
        ref.prepare(a)
    grads = ref.run(a, _ctx())
    for name, k in wrt:
        x0 = np.asarray(a[name], dtype=np.float64)

        def f(v: np.ndarray, name: str = name) -> np.ndarray:
            b = dict(a)
            b[name] = v
            return np.asarray(fwd(b))

        num = _numeric_grad(f, x0, np.asarray(a[out_key]))
        assert np.allclose(grads[k], num, atol=atol, rtol=1e-5), (grad_name, name)


def _fwd(name: str, k: int = 0) -> Any:
    ref = get_reference(name)
    return lambda b: ref.run(b, _ctx())[k]


@pytest.mark.parametrize(("name", "args"), [
    ("conv2d", {"input": (2, 4, 5, 5), "filter": (3, 4, 3, 3), "output_grad": (2, 3, 3, 3)}),
    ("conv2d", {"input": (1, 4, 5, 6), "filter": (4, 2, 2, 3), "output_grad": (1, 4, 3, 2), "strides": [2, 1],
                "paddings": [1, 0], "dilations": [1, 2], "groups": 2}),
    ("conv2d", {"input": (1, 5, 4, 2), "filter": (2, 2, 3, 1), "output_grad": (1, 5, 4, 2), "groups": 1,
                "padding_algorithm": "SAME", "data_format": "NHWC"}),
    ("conv3d", {"input": (1, 2, 3, 4, 3), "filter": (3, 2, 2, 2, 1), "output_grad": (1, 3, 2, 3, 3),
                "strides": [1, 2, 1], "paddings": [0, 1, 0]}),
    ("depthwise_conv2d", {"input": (2, 3, 4, 4), "filter": (6, 1, 2, 2), "output_grad": (2, 6, 3, 3), "groups": 3}),
])
def test_conv_grads_numeric(name: str, args: dict[str, Any]) -> None:
    a = {k: (_RNG.standard_normal(v) if isinstance(v, tuple) else v) for k, v in args.items()}
    _grad_check(f"{name}_grad", _fwd(name), a, [("input", 0), ("filter", 1)])


@pytest.mark.parametrize("args", [
    {"input": (2, 3, 3, 3), "filter": (3, 2, 2, 2), "output_grad": (2, 2, 4, 4)},
    {"input": (1, 4, 3, 2), "filter": (4, 1, 3, 2), "output_grad": (1, 2, 5, 4), "strides": [2, 2], "paddings": [1, 0],
     "groups": 2},
    {"input": (1, 3, 2, 2), "filter": (2, 3, 2, 2), "output_grad": (1, 5, 3, 3), "data_format": "NHWC",
     "dilations": [2, 1]},
])
def test_conv2d_transpose_grads_numeric(args: dict[str, Any]) -> None:
    a = {k: (_RNG.standard_normal(v) if isinstance(v, tuple) else v) for k, v in args.items()}
    (y,) = get_reference("conv2d_transpose").run(a, _ctx())
    assert y.shape == a["output_grad"].shape
    _grad_check("conv2d_transpose_grad", _fwd("conv2d_transpose"), a, [("input", 0), ("filter", 1)])


def test_conv_reference_against_direct_sum() -> None:
    """conv2d with stride / padding / dilation / groups against a direct quadruple loop."""
    x = _RNG.standard_normal((1, 4, 5, 6))
    w = _RNG.standard_normal((2, 2, 2, 3))
    a = {"input": x, "filter": w, "strides": [2, 1], "paddings": [1, 1], "dilations": [1, 2], "groups": 2}
    (y,) = get_reference("conv2d").run(a, _ctx())
    xp = np.pad(x, [(0, 0), (0, 0), (1, 1), (1, 1)])
    want = np.zeros((1, 2, 3, 4))
    for o in range(2):
        g = o  # 2 groups: output channel o reads input channels 2o, 2o + 1
        for i in range(3):
            for j in range(4):
                for c in range(2):
                    for p in range(2):
                        for q in range(3):
                            want[0, o, i, j] += xp[0, g * 2 + c, i * 2 + p, j + 2 * q] * w[o, c, p, q]
    assert np.allclose(y, want)


def test_norm_grads_numeric() -> None:
    x = _RNG.standard_normal((3, 2, 2, 2))
    sc, bi = _RNG.standard_normal(2) + 1.5, _RNG.standard_normal(2)
    # batch_norm (training, NCHW)
    a = {"x": x, "scale": sc, "bias": bi, "mean_out": np.zeros(2), "variance_out": np.ones(2),
         "saved_mean": None, "saved_variance": None, "reserve_space": None, "out_grad": _RNG.standard_normal(x.shape),
         "epsilon": 1e-5, "data_format": "NCHW", "mean": np.zeros(2), "variance": np.ones(2)}
    _grad_check("batch_norm_grad", _fwd("batch_norm"), a, [("x", 0), ("scale", 1), ("bias", 2)], "out_grad", 1e-5)
    # instance_norm
    a = {"x": x, "scale": sc, "bias": bi, "saved_mean": None, "saved_variance": None,
         "y_grad": _RNG.standard_normal(x.shape), "epsilon": 1e-5}
    _grad_check("instance_norm_grad", _fwd("instance_norm"), a, [("x", 0), ("scale", 1), ("bias", 2)], "y_grad", 1e-5)
    # group_norm: the forward reference uses default_groups(C) = 2 groups of 2 channels
    x4 = _RNG.standard_normal((2, 4, 3))
    s4, b4 = _RNG.standard_normal(4) + 1.5, _RNG.standard_normal(4)
    a = {"x": x4, "scale": s4, "bias": b4, "y": x4, "mean": np.zeros((2, 2)), "variance": np.ones((2, 2)),
         "y_grad": _RNG.standard_normal(x4.shape), "epsilon": 1e-5, "groups": 2, "data_format": "NCHW"}
    _grad_check("group_norm_grad", _fwd("group_norm"), a, [("x", 0), ("scale", 1), ("bias", 2)], "y_grad", 1e-5)


def test_roi_align_grad_numeric() -> None:
    a = {"x": _RNG.standard_normal((2, 2, 5, 6)), "boxes": _RNG.random((3, 4)), "boxes_num": np.array([1, 2]),
         "out_grad": _RNG.standard_normal((3, 2, 2, 3)), "pooled_height": 2, "pooled_width": 3,
         "spatial_scale": 0.5, "sampling_ratio": -1, "aligned": True}
    _grad_check("roi_align_grad", _fwd("roi_align"), a, [("x", 0)], "out_grad")


# ---------------------------------------------------------------------------
# soundness over generated cases
# ---------------------------------------------------------------------------

RULES = ["conv2d", "conv3d", "conv2d_transpose", "depthwise_conv2d", "batch_norm", "group_norm", "instance_norm",
         "roi_align"]
GRADS = ["conv2d_grad", "conv3d_grad", "conv2d_transpose_grad", "depthwise_conv2d_grad", "batch_norm_grad",
         "group_norm_grad", "instance_norm_grad", "roi_align_grad"]


test_sound, test_grad_sound = soundness_tests(RULES, GRADS, 200, 7)
