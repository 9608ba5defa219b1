"""slice family (slice, strided_slice, tile, expand, expand_as, pad and their grads):
Paddle's unit-test cases, hand-checked answers, deviations, grads, errors and soundness.

Paddle has no test_strided_slice_rule.py; strided_slice is covered by hand-checked cases here
and by oracle lines in tests/golden/slice.jsonl."""

# mypy: disable-error-code="union-attr,index,arg-type"
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from spmd_helpers import J, T, dms, soundness_tests
from spmd_helpers import global_ctx as _ctx
from spmdkit.core.dist_attr import ReduceType
from spmdkit.core.errors import InvalidAttributeError, InvalidMeshError, ShapeMismatchError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.ops import get_rule
from spmdkit.sim import SOUND, UNSOUND, verify
from spmdkit.sim.reference import get_reference

M22 = ProcessMesh([2, 2])
M24 = ProcessMesh([2, 4])
M2 = ProcessMesh([2])
M3 = ProcessMesh([3])
M4 = ProcessMesh([4])


def R(dm: list[Any], partial: Any = None) -> dict[str, Any]:
    return {"dims_mapping": dm, "partial": partial or {}}


def sums(*dims: int) -> tuple[tuple[int, ReduceType], ...]:
    return tuple((d, ReduceType.SUM) for d in dims)


# ---------------------------------------------------------------------------
# Paddle's own unit tests (test_slice_rule.py, test_tile_rule.py, test_expand_rule.py,
# test_expand_as_rule.py, test_pad_rule.py)
# ---------------------------------------------------------------------------

# test_slice_rule.py: x [8, 8, 16, 16] on mesh [2, 4]; Paddle passes decrease_axis [0] for an axis
# it does not slice (tests/test_slice.py::test_slice_invalid_decrease); these are the same cases
# without it, with the answers Paddle's test asserts.
SLICE_CASES = [
    ([-1, 0, 1, -1], [-1], [4], [8], (-1, 0, 1, -1)),
    ([-1, -1, 1, 0], [-1], [4], [-1], (-1, -1, 1, -1)),
    ([0, -1, -1, 1], [1, 2], [4, 4], [-1, 32], (0, -1, -1, 1)),
    ([-1, 1, 0, -1], [1, 2], [4, 4], [-1, 32], (-1, -1, -1, -1)),
    ([0, 1, -1, -1], [0, 1, 2, 3], [0, 0, 4, 4], [4, 4, -1, 32], (-1, -1, -1, -1)),
]
SLICE_REVERSE_CASES = [
    ([-1, -1, 0, 1], [-1], [4], [8], (-1, -1, 0, -1)),
    ([-1, 1, 0, -1], [-1], [4], [-1], (-1, 1, 0, -1)),
    ([-1, 1, 0, -1], [1, 2], [4, 4], [-1, 32], (-1, -1, -1, -1)),
    ([0, -1, -1, 1], [1, 2], [4, 4], [-1, 32], (0, -1, -1, 1)),
    ([0, 1, -1, -1], [0, 1, 2, 3], [0, 0, 4, 4], [4, 4, -1, 32], (-1, -1, -1, -1)),
]


@pytest.mark.parametrize(("dm", "axes", "starts", "ends", "want"), SLICE_CASES)
def test_paddle_slice_forward(dm: list[Any], axes: list[int], starts: list[int], ends: list[int],
                              want: tuple[int, ...]) -> None:
    res = get_rule("slice").infer_forward(T(M24, [8, 8, 16, 16], dm), axes, starts, ends, [0], [])
    assert dms(res.inputs) == [want] and dms(res.outputs) == [want]


@pytest.mark.parametrize(("dm", "axes", "starts", "ends", "want"), SLICE_REVERSE_CASES)
def test_paddle_slice_backward(dm: list[Any], axes: list[int], starts: list[int], ends: list[int],
                               want: tuple[int, ...]) -> None:
    # Paddle's test passes an output of the input's shape; only the mappings matter here
    res = get_rule("slice").infer_backward(T(M24, [8, 8, 16, 16], [-1] * 4), T(M24, [8, 8, 16, 16], dm),
                                           axes, starts, ends, [0], [])
    assert dms(res.inputs) == [want] and dms(res.outputs) == [want]


def test_paddle_tile_cases() -> None:
    x = T(M22, [16, 16, 16], [0, -1, 1])
    res = get_rule("tile").infer_forward(x, [2, 2, 1, 1])
    assert dms(res.inputs) == [(-1, -1, 1)] and dms(res.outputs) == [(-1, -1, -1, 1)]
    res = get_rule("tile").infer_backward(x, T(M22, [2, 32, 16, 16], [-1, -1, -1, 1]), [2, 2, 1, 1])
    assert dms(res.inputs) == [(-1, -1, 1)] and dms(res.outputs) == [(-1, -1, -1, 1)]


def test_paddle_pad_cases() -> None:
    x = T(M24, [8, 16, 16], [0, 1, -1])
    res = get_rule("pad").infer_forward(x, [0, 0, 0, 1, 2, 3], 0)
    assert dms(res.inputs) == [(0, -1, -1)] and dms(res.outputs) == [(0, -1, -1)]
    # Paddle's test passes out of x's shape to PadGradInferSpmd (x from out)
    res = get_rule("pad").infer_backward(x, x, [0, 0, 0, 1, 2, 3], 0)
    assert dms(res.inputs) == [(0, -1, -1)] and dms(res.outputs) == [(0, -1, -1)]


EXPAND_FORWARD = [
    ([8, 12, 1, 24], [0, -1, -1, 1], [-1, -1, 8, 24], (0, -1, -1, 1), (0, -1, -1, 1)),
    ([8, 12, 1, 24], [0, -1, -1, 1], [-1, -1, 10, -1], (0, -1, -1, 1), (0, -1, -1, 1)),
    ([8, 12, 1, 24], [1, 0, -1, -1], [1, -1, -1, 1, -1], (1, 0, -1, -1), (-1, 1, 0, -1, -1)),
    ([8, 12, 1, 24], [1, -1, -1, 0], [4, -1, 12, 8, -1], (1, -1, -1, 0), (-1, 1, -1, -1, 0)),
    ([8, 12, 1, 24], [1, -1, -1, 0], [4, 1, -1, -1, 1, -1], (1, -1, -1, 0), (-1, -1, 1, -1, -1, 0)),
    ([1, 12, 8, 4], [-1, 0, -1, -1], [8, -1, -1, -1], (-1, 0, -1, -1), (-1, 0, -1, -1)),
    ([1, 12, 8, 4], [-1, 0, 1, -1], [8, 8, -1, -1, -1], (-1, 0, 1, -1), (-1, -1, 0, 1, -1)),
]
EXPAND_BACKWARD = [
    ([8, 12, 1, 24], [8, 12, 8, 24], [-1, -1, 0, 1], [-1, -1, 8, -1], (-1, -1, -1, 1), (-1, -1, -1, 1)),
    ([8, 12, 1, 24], [8, 12, 10, 24], [0, -1, -1, 1], [-1, -1, 10, -1], (0, -1, -1, 1), (0, -1, -1, 1)),
    ([8, 12, 1, 24], [1, 8, 12, 1, 24], [-1, 1, 0, -1, -1], [1, -1, -1, -1, -1], (1, 0, -1, -1),
     (-1, 1, 0, -1, -1)),
    ([8, 12, 1, 24], [4, 8, 12, 8, 24], [0, -1, -1, 1, -1], [4, -1, -1, 8, -1], (-1, -1, -1, -1),
     (-1, -1, -1, -1, -1)),
    ([8, 12, 1, 24], [4, 8, 12, 8, 24], [-1, 1, -1, -1, 0], [4, -1, -1, 8, -1], (1, -1, -1, 0),
     (-1, 1, -1, -1, 0)),
    ([8, 12, 1, 24], [4, 1, 8, 12, 1, 24], [-1, -1, 1, -1, -1, 0], [4, 1, -1, -1, -1, -1], (1, -1, -1, 0),
     (-1, -1, 1, -1, -1, 0)),
    ([1, 12, 8, 4], [8, 12, 8, 4], [1, 0, -1, -1], [8, -1, -1, -1], (-1, 0, -1, -1), (-1, 0, -1, -1)),
    ([1, 12, 8, 4], [8, 8, 12, 8, 4], [-1, -1, 0, 1, -1], [8, 8, -1, -1, -1], (-1, 0, 1, -1),
     (-1, -1, 0, 1, -1)),
]


@pytest.mark.parametrize(("shape", "dm", "target", "want_x", "want_o"), EXPAND_FORWARD)
def test_paddle_expand_forward(shape: list[int], dm: list[Any], target: list[int], want_x: tuple[int, ...],
                               want_o: tuple[int, ...]) -> None:
    """test_expand_rule.py (Paddle 3.3.1 registers no "expand" rule, so these have no oracle)."""
    res = get_rule("expand").infer_forward(T(M24, shape, dm), target)
    assert dms(res.inputs) == [want_x] and dms(res.outputs) == [want_o]


@pytest.mark.parametrize(("shape", "oshape", "odm", "target", "want_x", "want_o"), EXPAND_BACKWARD)
def test_paddle_expand_backward(shape: list[int], oshape: list[int], odm: list[Any], target: list[int],
                                want_x: tuple[int, ...], want_o: tuple[int, ...]) -> None:
    res = get_rule("expand").infer_backward(T(M24, shape, [-1] * len(shape)), T(M24, oshape, odm), target)
    assert dms(res.inputs) == [want_x] and dms(res.outputs) == [want_o]


@pytest.mark.parametrize(("xs", "xdm", "ydm", "want_x"), [
    ([1, 48], [-1, -1], [0, 1, -1], (-1, -1)),
    ([1, 48], [-1, -1], [0, -1, 1], (-1, 1)),
    ([2, 1, 48], [0, -1, -1], [0, 1, -1], (0, -1, -1)),
    ([2, 1, 48], [-1, -1, 0], [0, 1, -1], (0, -1, -1)),
])
def test_paddle_expand_as_with_y(xs: list[int], xdm: list[Any], ydm: list[Any], want_x: tuple[int, ...]) -> None:
    """test_expand_as_rule.py names the [2, 32, 48] tensor x and the small one y; the op expands
    the small one, so it is x here (Paddle's binding answers the same)."""
    res = get_rule("expand_as").infer_forward(T(M22, xs, xdm), T(M22, [2, 32, 48], ydm), [2, 32, 48])
    assert dms(res.inputs) == [want_x, tuple(ydm)] and dms(res.outputs) == [tuple(ydm)]


@pytest.mark.parametrize(("xs", "xdm", "want_o"), [
    ([1, 48], [-1, -1], (-1, -1, -1)),
    ([1, 48], [-1, 0], (-1, -1, 0)),
    ([2, 1, 48], [0, -1, -1], (0, -1, -1)),
    ([2, 32, 48], [0, 1, -1], (0, 1, -1)),
])
def test_paddle_expand_as_without_y(xs: list[int], xdm: list[Any], want_o: tuple[int, ...]) -> None:
    res = get_rule("expand_as").infer_forward(T(M22, xs, xdm), None, [2, 32, 48])
    assert dms(res.inputs) == [tuple(xdm), None] and dms(res.outputs) == [want_o]


@pytest.mark.parametrize(("xdm", "gdm", "want_x", "want_p"), [
    ([-1, -1], [0, 1, -1], (-1, -1), (0, 1)),
    ([-1, 1], [0, -1, 1], (-1, 1), (0,)),
    ([-1, -1], [0, -1, 1], (-1, 1), (0,)),
])
def test_paddle_expand_as_grad(xdm: list[Any], gdm: list[Any], want_x: tuple[int, ...], want_p: tuple[int, ...]) -> None:
    """expand_as's backward slot is ExpandAsGradInferSpmd(x, out_grad): x_grad partial over the
    mesh dims out_grad has on broadcast axes."""
    for name, mode in (("expand_as", "backward"), ("expand_as_grad", "forward")):
        r = get_rule(name)
        fn = r.infer_backward if mode == "backward" else r.infer_forward
        res = fn(T(M22, [1, 48], xdm), T(M22, [2, 32, 48], gdm), [2, 32, 48])
        assert dms(res.inputs) == [want_x, tuple(gdm)] and dms(res.outputs) == [want_x]
        assert res.outputs[0].partial == sums(*want_p)


# ---------------------------------------------------------------------------
# hand-checked answers
# ---------------------------------------------------------------------------


def test_slice_unsliced_axes_keep_uneven_sharding_partial_cleared() -> None:
    """Only the sliced axis must be whole: 6 rows over 4 ranks stay; a partial input is reduced
    first (as Paddle)."""
    res = get_rule("slice").infer_forward(T(M4, [6, 4], [0, -1]), [1], [0], [2])
    assert dms(res.inputs) == [(0, -1)] and dms(res.outputs) == [(0, -1)]
    res = get_rule("slice").infer_forward(T(ProcessMesh([2, 2, 2]), [8, 6, 4], [1, 0, -1], [2]), [1], [0], [3])
    assert dms(res.inputs) == [(1, -1, -1)] and not res.inputs[0].partial and not res.outputs[0].partial


def test_slice_coshard_keeps_largest_mesh_dim() -> None:
    res = get_rule("slice").infer_forward(T(M24, [8, 6, 4], [(0, 1), -1, -1]), [1], [0], [3])
    assert dms(res.inputs) == [(1, -1, -1)] and dms(res.outputs) == [(1, -1, -1)]


def test_slice_decrease_and_reverse() -> None:
    res = get_rule("slice").infer_forward(T(M24, [8, 6, 4], [0, 1, -1]), [1], [2], [3], [1], [1])
    assert dms(res.inputs) == [(0, -1, -1)] and dms(res.outputs) == [(0, -1)]
    res = get_rule("slice").infer_backward(T(M24, [8, 6, 4], [-1, -1, -1]), T(M24, [8, 4], [0, 1]), [1], [2], [3],
                                           [1], [1])
    assert dms(res.inputs) == [(0, -1, 1)] and dms(res.outputs) == [(0, 1)]


def test_slice_grad_merges_input_and_out_grad() -> None:
    """out_grad claims first, input fills the axes it leaves; the sliced axis is replicated."""
    res = get_rule("slice_grad").infer_forward(T(M24, [8, 6, 4], [0, -1, -1]), T(M24, [8, 4], [-1, 1]), [1], [2],
                                               [3], [], [1])
    assert dms(res.inputs) == [(0, -1, 1), (0, 1)] and dms(res.outputs) == [(0, -1, 1)]
    res = get_rule("slice_grad").infer_forward(T(M24, [8, 6, 4], [0, -1, -1]), T(M24, [8, 1, 4], [1, 0, -1]), [1],
                                               [2], [3])
    assert dms(res.inputs) == [(0, -1, -1), (0, -1, -1)]


def test_strided_slice_sliced_axis_replicated() -> None:
    res = get_rule("strided_slice").infer_forward(T(M24, [8, 6, 4], [0, 1, -1]), [1], [0], [6], [2])
    assert dms(res.inputs) == [(0, -1, -1)] and dms(res.outputs) == [(0, -1, -1)]
    # the backward slot is Paddle's grad rule StridedSliceGradInferSpmd(input, out_grad)
    res = get_rule("strided_slice").infer_backward(T(M24, [8, 6, 4], [0, -1, -1]), T(M24, [8, 3, 4], [-1, 1, -1]),
                                                   [1], [0], [6], [2])
    assert dms(res.inputs) == [(0, -1, -1), (0, -1, -1)] and dms(res.outputs) == [(0, -1, -1)]


def test_tile_new_and_tiled_axes() -> None:
    res = get_rule("tile").infer_forward(T(M22, [4, 6], [0, 1]), [2, 1, 1])
    assert dms(res.inputs) == [(0, 1)] and dms(res.outputs) == [(-1, 0, 1)]
    res = get_rule("tile").infer_forward(T(M22, [4, 6], [0, 1]), [2, 1])
    assert dms(res.inputs) == [(-1, 1)] and dms(res.outputs) == [(-1, 1)]


def test_tile_grad_new_axis_partial() -> None:
    """out_grad sharded on a new leading axis: each rank sums its copies, x_grad is partial SUM."""
    res = get_rule("tile_grad").infer_forward(T(M22, [4, 6], [-1, -1]), T(M22, [2, 4, 6], [0, 1, -1]), [2, 1, 1])
    assert dms(res.inputs) == [(1, -1), (0, 1, -1)] and dms(res.outputs) == [(1, -1)]
    assert res.outputs[0].partial == sums(0)
    res = get_rule("tile_grad").infer_forward(T(M22, [4, 6], [0, -1]), T(M22, [8, 6], [1, -1]), [2, 1])
    assert dms(res.outputs) == [(-1, -1)] and not res.outputs[0].partial


def test_expand_and_grad() -> None:
    res = get_rule("expand").infer_forward(T(M22, [1, 6], [0, 1]), [3, 4, 6])
    assert dms(res.inputs) == [(-1, 1)] and dms(res.outputs) == [(-1, -1, 1)]
    res = get_rule("expand").infer_backward(T(M22, [1, 6], [-1, -1]), T(M22, [3, 4, 6], [0, -1, 1]), [3, 4, 6])
    assert dms(res.inputs) == [(-1, 1)] and dms(res.outputs) == [(-1, -1, 1)]
    res = get_rule("expand_grad").infer_forward(T(M22, [1, 6], [-1, -1]), T(M22, [3, 4, 6], [0, -1, 1]), [3, 4, 6])
    assert dms(res.outputs) == [(-1, 1)] and res.outputs[0].partial == sums(0)


def test_expand_as_coshard_y() -> None:
    """y co-sharded: out and y keep y's largest mesh dim (as Paddle), x follows."""
    res = get_rule("expand_as").infer_forward(T(M24, [4, 6], [-1, -1]), T(M24, [3, 4, 6], [-1, (0, 1), -1]), [3, 4, 6])
    assert dms(res.inputs) == [(1, -1), (-1, 1, -1)] and dms(res.outputs) == [(-1, 1, -1)]


def test_pad_unpadded_axes_kept() -> None:
    res = get_rule("pad").infer_forward(T(M24, [8, 6, 4], [0, 1, -1]), [0, 0, 1, 1, 0, 0], 0)
    assert dms(res.inputs) == [(0, -1, -1)] and dms(res.outputs) == [(0, -1, -1)]
    res = get_rule("pad").infer_forward(T(M4, [6, 4], [0, -1]), [0, 0, 1, 1], 0)
    assert dms(res.inputs) == [(0, -1)]
    res = get_rule("pad_grad").infer_forward(T(M24, [8, 8, 4], [0, 1, -1]), [0, 0, 1, 1, 0, 0], 0)
    assert dms(res.inputs) == [(0, -1, -1)] and dms(res.outputs) == [(0, -1, -1)]


# ---------------------------------------------------------------------------
# deviations (docs/deviations.md)
# ---------------------------------------------------------------------------


def test_slice_decrease_out() -> None:
    """slice-decrease-out (DESIGN class 5): with decrease_axis Paddle answers out with one entry
    per input axis."""
    case = {"rule": "slice", "mesh": [2, 4], "mode": "forward",
            "args": [J([8, 6, 4], [0, 1, -1]), [1], [2], [3], [1], [1]]}
    paddle = {"inputs": [R([0, -1, -1])], "outputs": [R([0, -1, -1])]}
    assert verify(None, case, result=paddle).status == UNSOUND
    res = get_rule("slice").infer_forward(T(M24, [8, 6, 4], [0, 1, -1]), [1], [2], [3], [1], [1])
    assert dms(res.outputs) == [(0, -1)]
    assert verify(None, case).status == SOUND


def test_slice_reverse_decrease() -> None:
    """slice-reverse-decrease (DESIGN class 8): Paddle's reverse raises for any output of lower
    rank (a non-empty decrease_axis); spmdkit puts the decreased axes back."""
    case = {"rule": "slice", "mesh": [2, 4], "mode": "backward",
            "args": [J([8, 6, 4], [-1, -1, -1]), J([8, 4], [0, 1]), [1], [2], [3], [1], [1]]}
    res = get_rule("slice").infer_backward(T(M24, [8, 6, 4], [-1, -1, -1]), T(M24, [8, 4], [0, 1]), [1], [2], [3],
                                           [1], [1])
    assert dms(res.inputs) == [(0, -1, 1)] and dms(res.outputs) == [(0, 1)]
    assert verify(None, case).status == SOUND


@pytest.mark.parametrize(("dm", "axes", "starts", "ends", "want"), SLICE_CASES[:4])
def test_slice_invalid_decrease(dm: list[Any], axes: list[int], starts: list[int], ends: list[int],
                                want: tuple[int, ...]) -> None:
    """slice-invalid-decrease: Paddle's own test passes decrease_axis [0] for an axis it does not
    slice (size 8: the kernel could not drop it); Paddle answers, spmdkit raises."""
    with pytest.raises(InvalidAttributeError, match="slice: decrease_axis 0 is not a sliced axis"):
        get_rule("slice").infer_forward(T(M24, [8, 8, 16, 16], dm), axes, starts, ends, [0], [0])
    with pytest.raises(InvalidAttributeError, match="slice: decrease_axis 0"):
        get_rule("slice").infer_backward(T(M24, [8, 8, 16, 16], [-1] * 4), T(M24, [8, 8, 16, 16], dm), axes, starts,
                                         ends, [0], [0])


def test_strided_slice_sharded_axis() -> None:
    """strided-slice-sharded-axis (DESIGN class 6): Paddle keeps the last axis sharded when it is
    sliced; each rank would take every other element of its own shard."""
    case = {"rule": "strided_slice", "mesh": [2], "mode": "forward",
            "args": [J([4, 8], [-1, 0]), [1], [1], [8], [3]]}
    paddle = {"inputs": [R([-1, 0])], "outputs": [R([-1, 0])]}
    assert verify(None, case, result=paddle).status == UNSOUND
    res = get_rule("strided_slice").infer_forward(T(M2, [4, 8], [-1, 0]), [1], [1], [8], [3])
    assert dms(res.inputs) == [(-1, -1)] and dms(res.outputs) == [(-1, -1)]
    # a full-range slice with stride 1 would keep it soundly; spmdkit replicates every sliced axis
    res = get_rule("strided_slice").infer_forward(T(M3, [2], [0]), [0], [0], [2], [1])
    assert dms(res.inputs) == [(-1,)]


def test_tile_reverse_out() -> None:
    """tile-reverse-out (DESIGN class 4): Paddle returns out sharded on a new leading axis that x
    cannot shard."""
    case = {"rule": "tile", "mesh": [2, 2], "mode": "backward",
            "args": [J([4, 6], [-1, -1]), J([2, 4, 6], [0, 1, -1]), [2, 1, 1]]}
    paddle = {"inputs": [R([1, -1])], "outputs": [R([0, 1, -1])]}
    assert verify(None, case, result=paddle).status == UNSOUND
    res = get_rule("tile").infer_backward(T(M22, [4, 6], [-1, -1]), T(M22, [2, 4, 6], [0, 1, -1]), [2, 1, 1])
    assert dms(res.inputs) == [(1, -1)] and dms(res.outputs) == [(-1, 1, -1)]
    assert verify(None, case).status == SOUND


def test_pad_coshard() -> None:
    """pad-coshard (DESIGN class 6): Paddle keeps x co-sharded [(0,1)] but answers out with one
    mesh dim (and the reverse: x one mesh dim, out co-sharded)."""
    case = {"rule": "pad", "mesh": [2, 4], "mode": "forward", "args": [J([8, 6, 4], [[0, 1], -1, -1]),
                                                                     [0, 0, 1, 1, 0, 0], 0]}
    paddle = {"inputs": [R([[0, 1], -1, -1])], "outputs": [R([1, -1, -1])]}
    assert verify(None, case, result=paddle).status == UNSOUND
    res = get_rule("pad").infer_forward(T(M24, [8, 6, 4], [(0, 1), -1, -1]), [0, 0, 1, 1, 0, 0], 0)
    assert dms(res.inputs) == [((0, 1), -1, -1)] and dms(res.outputs) == [((0, 1), -1, -1)]
    rcase = {"rule": "pad", "mesh": [2, 4], "mode": "backward",
             "args": [J([8, 6, 4], [-1, -1, -1]), J([8, 8, 4], [[0, 1], -1, -1]), [0, 0, 1, 1, 0, 0], 0]}
    rpaddle = {"inputs": [R([1, -1, -1])], "outputs": [R([[0, 1], -1, -1])]}
    assert verify(None, rcase, result=rpaddle).status == UNSOUND
    res = get_rule("pad").infer_backward(T(M24, [8, 6, 4], [-1, -1, -1]), T(M24, [8, 8, 4], [(0, 1), -1, -1]),
                                         [0, 0, 1, 1, 0, 0], 0)
    assert dms(res.inputs) == [(1, -1, -1)] and dms(res.outputs) == [(1, -1, -1)]


def test_expand_as_no_y() -> None:
    """expand-as-no-y (DESIGN class 6): without y Paddle returns x as given (partial, co-sharded,
    or sharded on a size-1 broadcast axis) while out drops that."""
    for xdm, partial, pdm in (([[0, 1], -1], None, [-1, 0, -1]), ([1, -1], [0], [-1, 1, -1]),
                              ([0, 1], None, [-1, -1, 1])):
        shape = [1, 6] if xdm == [0, 1] else [4, 6]
        case = {"rule": "expand_as", "mesh": [2, 2], "mode": "forward", "args": [J(shape, xdm, partial), None, [3, 4, 6]]}
        paddle = {"inputs": [R(xdm, {"0": "sum"} if partial else None), None], "outputs": [R(pdm)]}
        assert verify(None, case, result=paddle).status == UNSOUND, xdm
        assert verify(None, case).status == SOUND, xdm
    res = get_rule("expand_as").infer_forward(T(M22, [4, 6], [(0, 1), -1]), None, [3, 4, 6])
    assert dms(res.inputs) == [((0, 1), -1), None] and dms(res.outputs) == [(-1, (0, 1), -1)]
    res = get_rule("expand_as").infer_forward(T(M22, [4, 6], [1, -1], [0]), None, [3, 4, 6])
    assert not res.inputs[0].partial and dms(res.outputs) == [(-1, 1, -1)]
    res = get_rule("expand_as").infer_forward(T(M22, [1, 6], [0, 1]), None, [3, 4, 6])
    assert dms(res.inputs) == [(-1, 1), None]


# ---------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------

X = T(M24, [8, 6, 4], [0, 1, -1])
Y = T(M24, [8, 6], [0, 1])


@pytest.mark.parametrize(
    ("name", "args", "exc", "words"),
    [
        ("slice", (X, [1], [2], [3], [], [0]), InvalidAttributeError, "decrease_axis"),
        ("slice", (X, [1], [2], [3], [], [3]), InvalidAttributeError, "decrease_axis"),
        ("slice", (X, [1, 1], [2, 2], [3, 3]), InvalidAttributeError, "axes"),
        ("slice", (X, [3], [2], [3]), InvalidAttributeError, "axes"),
        ("slice", (X, [1], [2, 3], [3]), InvalidAttributeError, "starts"),
        ("strided_slice", (X, [1], [2], [3], [0]), InvalidAttributeError, "strides"),
        ("strided_slice", (X, [1], [2], [3], [1, 1]), InvalidAttributeError, "strides"),
        ("tile", (X, [1, -1, 1]), InvalidAttributeError, "repeat_times"),
        ("tile_grad", (Y, T(M24, [8, 7], [0, 1]), [1, 1]), ShapeMismatchError, "out_grad"),
        ("expand", (Y, [8, 5]), ShapeMismatchError, "axis 1"),
        ("expand", (Y, [6]), InvalidAttributeError, "shape"),
        ("expand", (Y, [-1, 8, 6]), InvalidAttributeError, "shape"),
        ("expand_as", (Y, T(M24, [8, 5], [0, 1]), []), ShapeMismatchError, "y"),
        ("expand_as", (Y, T(M4, [8, 6], [0, -1]), []), InvalidMeshError, "different mesh"),
        ("expand_as", (Y, None, [6]), ShapeMismatchError, "target_shape"),
        ("expand_grad", (Y, T(M24, [8, 5], [0, 1]), [8, 5]), ShapeMismatchError, "axis 1"),
        ("pad", (Y, [1, 1, 1], 0), InvalidAttributeError, "paddings"),
        ("pad_grad", (Y, [1, 1, 1], 0), InvalidAttributeError, "paddings"),
        ("slice_grad", (X, T(M24, [8, 1, 4, 3], [1, 0, -1, -1]), [1], [2], [3]), ShapeMismatchError, "out_grad"),
    ],
)
def test_errors(name: str, args: tuple[Any, ...], exc: type, words: str) -> None:
    with pytest.raises(exc) as e:
        get_rule(name).infer_forward(*args)
    msg = str(e.value)
    assert msg.startswith(name) and words in msg


def test_backward_errors() -> None:
    with pytest.raises(ShapeMismatchError, match="tile: out has 2 dims"):
        get_rule("tile").infer_backward(Y, Y, [1, 1, 1])
    with pytest.raises(ShapeMismatchError, match="tile: out has size 6 on axis 1"):
        get_rule("tile").infer_backward(Y, Y, [1, 2])
    with pytest.raises(ShapeMismatchError, match="pad: x and out differ on axis 1"):
        get_rule("pad").infer_backward(Y, T(M24, [8, 5], [0, 1]), [0, 0, 0, 0], 0)
    with pytest.raises(ShapeMismatchError, match="slice: output has 3 dims"):
        get_rule("slice").infer_backward(X, X, [1], [2], [3], [], [1])
    with pytest.raises(ShapeMismatchError, match="expand: shape and out differ"):
        get_rule("expand").infer_backward(Y, T(M24, [8, 7], [0, 1]), [8, 6])


# ---------------------------------------------------------------------------
# the references' grads are real gradients
# ---------------------------------------------------------------------------


def _numeric_vjp(f: Any, x: np.ndarray, g: np.ndarray) -> np.ndarray:
    out = np.zeros_like(x)
    h = 1e-3
    for i in np.ndindex(x.shape):
        xp, xm = x.copy(), x.copy()
        xp[i] += h
        xm[i] -= h
        out[i] = (np.sum(np.asarray(f(xp)) * g) - np.sum(np.asarray(f(xm)) * g)) / (2 * h)
    return out


def _check(fwd_name: str, grad_name: str, x: np.ndarray, attrs: dict[str, Any], xname: str, grad_args: Any) -> None:
    rng = np.random.default_rng(5)
    fwd = get_reference(fwd_name)

    def f(v: np.ndarray) -> Any:
        return fwd.run({xname: v, **attrs}, _ctx())[0]

    g = rng.standard_normal(np.shape(f(x)))
    got = get_reference(grad_name).run({**grad_args(x, g), **attrs}, _ctx())[0]
    assert np.allclose(got, _numeric_vjp(f, x, g), atol=1e-6)


@pytest.mark.parametrize("attrs", [
    {"axes": [1], "starts": [1], "ends": [3], "infer_flags": [1], "decrease_axis": []},
    {"axes": [0, 2], "starts": [-2, 0], "ends": [10**9, 1], "infer_flags": [1, 1], "decrease_axis": [2]},
])
def test_slice_grad_numeric(attrs: dict[str, Any]) -> None:
    x = np.random.default_rng(0).standard_normal((3, 4, 5))
    _check("slice", "slice_grad", x, attrs, "input", lambda x, g: {"input": x, "out_grad": g})


@pytest.mark.parametrize("attrs", [
    {"axes": [1], "starts": [0], "ends": [4], "strides": [2]},
    {"axes": [0, 2], "starts": [2, 4], "ends": [-4, 0], "strides": [-1, -2]},
])
def test_strided_slice_grad_numeric(attrs: dict[str, Any]) -> None:
    x = np.random.default_rng(1).standard_normal((3, 4, 5))
    _check("strided_slice", "strided_slice_grad", x, attrs, "input", lambda x, g: {"input": x, "out_grad": g})


@pytest.mark.parametrize("rep", [[2, 1], [1, 3], [2, 1, 2]])
def test_tile_grad_numeric(rep: list[int]) -> None:
    x = np.random.default_rng(2).standard_normal((2, 3))
    _check("tile", "tile_grad", x, {"repeat_times": rep}, "x", lambda x, g: {"x": x, "out_grad": g})


def test_expand_grads_numeric() -> None:
    x = np.random.default_rng(3).standard_normal((1, 3))
    _check("expand", "expand_grad", x, {"shape": [2, 4, -1]}, "x", lambda x, g: {"x": x, "out_grad": g})
    _check("expand_as", "expand_as_grad", x, {"y": np.zeros((2, 4, 3)), "target_shape": [2, 4, 3]}, "x",
           lambda x, g: {"x": x, "out_grad": g})


def test_pad_grad_numeric() -> None:
    x = np.random.default_rng(4).standard_normal((2, 3))
    _check("pad", "pad_grad", x, {"paddings": [1, 0, 2, 1], "pad_value": 0}, "x", lambda x, g: {"out_grad": g})


# ---------------------------------------------------------------------------
# soundness over generated cases
# ---------------------------------------------------------------------------

RULES = ["slice", "strided_slice", "tile", "expand_as", "expand", "pad"]
GRADS = ["slice_grad", "strided_slice_grad", "tile_grad", "expand_as_grad", "expand_grad", "pad_grad"]


test_sound, test_grad_sound = soundness_tests(RULES, GRADS, 200, 11)
