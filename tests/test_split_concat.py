"""split_concat family (split, split_with_num, unbind, concat, stack and their grads):
Paddle's unit-test cases, hand-checked answers, deviations, grads, errors and soundness."""

# mypy: disable-error-code="union-attr,index,arg-type"
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from spmd_helpers import J, T, dms, soundness_tests
from spmd_helpers import global_ctx as _ctx
from spmdkit.core.dist_attr import ReduceType
from spmdkit.core.errors import InvalidAttributeError, InvalidMeshError, ShapeMismatchError, SpmdError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.ops import get_rule
from spmdkit.sim import SOUND, UNSOUND, verify
from spmdkit.sim.reference import get_reference

M22 = ProcessMesh([2, 2])
M23 = ProcessMesh([2, 3])
M24 = ProcessMesh([2, 4])
M2 = ProcessMesh([2])
M4 = ProcessMesh([4])
SUM = ((0, ReduceType.SUM),)


def R(dm: list[Any], partial: Any = None) -> dict[str, Any]:
    return {"dims_mapping": dm, "partial": partial or {}}


# ---------------------------------------------------------------------------
# Paddle's own unit tests (test_split_rule.py, test_concat_rule.py, test_stack_rule.py,
# test_unbind_rule.py)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(("mesh", "shape", "dm", "name", "attr", "axis", "want"), [
    (M4, [64, 32, 48], [0, -1, -1], "split_with_num", 2, 1, (0, -1, -1)),
    (M4, [64, 32, 48], [0, -1, -1], "split", [15, 16, 17], 2, (0, -1, -1)),
    (M4, [64, 32, 48], [-1, -1, 0], "split", [15, 16, 17], 2, (-1, -1, -1)),
    (M4, [64, 32, 48], [0, -1, -1], "split_with_num", 2, -2, (0, -1, -1)),
    (M23, [96, 32, 48, 24], [0, 1, -1, -1], "split_with_num", 3, -1, (0, 1, -1, -1)),
    (M23, [96, 32, 48, 24], [0, 1, -1, -1], "split", [32, 32, 32], 0, (-1, 1, -1, -1)),
])
def test_paddle_split_forward(mesh: ProcessMesh, shape: list[int], dm: list[Any], name: str, attr: Any, axis: int,
                              want: tuple[int, ...]) -> None:
    res = get_rule(name).infer_forward(T(mesh, shape, dm), attr, axis)
    n = attr if isinstance(attr, int) else len(attr)
    assert dms(res.inputs) == [want] and len(res.outputs) == 1 and dms(res.outputs[0]) == [want] * n


def _pieces(mesh: ProcessMesh, shape: list[int], axis: int, sizes: list[int], mappings: list[list[Any]]) -> tuple:
    out = []
    for s, dm in zip(sizes, mappings):
        sh = list(shape)
        sh[axis] = s
        out.append(T(mesh, sh, dm))
    return tuple(out)


@pytest.mark.parametrize(("mesh", "shape", "name", "attr", "axis", "sizes", "mappings", "want"), [
    (M4, [64, 32, 48], "split_with_num", 2, 1, [16, 16], [[0, -1, -1]] * 2, (0, -1, -1)),
    (M4, [64, 32, 48], "split", [15, 16, 17], 2, [15, 16, 17], [[0, -1, -1]] * 3, (0, -1, -1)),
    (M4, [64, 32, 48], "split", [15, 16, 17], 2, [15, 16, 17], [[-1, -1, -1]] * 3, (-1, -1, -1)),
    (M4, [64, 32, 48], "split_with_num", 2, -2, [16, 16], [[0, -1, -1]] * 2, (0, -1, -1)),
    # a piece sharded on the split axis: that axis is replicated in x
    (M4, [64, 32, 48], "split_with_num", 2, -2, [16, 16], [[-1, 0, -1], [-1, -1, -1]], (-1, -1, -1)),
    (M23, [96, 32, 48, 24], "split_with_num", 3, -1, [8, 8, 8], [[0, 1, -1, -1]] * 3, (0, 1, -1, -1)),
    (M23, [96, 32, 48, 24], "split", [32, 32, 32], 0, [32, 32, 32], [[-1, 1, -1, -1]] * 3, (-1, 1, -1, -1)),
    # Paddle's test gives these pieces the shape [32, 32, 48, 24] (a typo for axis 0); the
    # answer asserted there, mesh dim 1 on two axes dropped from both, is spmdkit's too
    (M23, [96, 32, 48, 24], "split", [16, 16, 16], 2, [16, 16, 16],
     [[0, -1, 1, -1], [-1, 1, -1, -1], [-1, -1, -1, -1]], (0, -1, -1, -1)),
])
def test_paddle_split_backward(mesh: ProcessMesh, shape: list[int], name: str, attr: Any, axis: int,
                               sizes: list[int], mappings: list[list[Any]], want: tuple[int, ...]) -> None:
    ax = axis % len(shape)
    res = get_rule(name).infer_backward(T(mesh, shape, [-1] * len(shape)), _pieces(mesh, shape, ax, sizes, mappings),
                                        attr, axis)
    assert dms(res.inputs) == [want] and dms(res.outputs[0]) == [want] * len(sizes)


def test_paddle_concat_cases() -> None:
    shapes, mappings = [[16, 16, 16], [4, 16, 16], [2, 16, 16]], [[-1, 0, 1], [-1, 1, 0], [-1, -1, 0]]
    xs = tuple(T(M22, s, d) for s, d in zip(shapes, mappings))
    res = get_rule("concat").infer_forward(xs, 0)
    assert dms(res.inputs[0]) == [(-1, 1, 0)] * 3 and dms(res.outputs) == [(-1, 1, 0)]
    # Paddle's test passes output [4, 16, 16]; the concatenation is [22, 16, 16]
    res = get_rule("concat").infer_backward(xs, T(M22, [22, 16, 16], [-1, 1, 0]), 0)
    assert dms(res.inputs[0]) == [(-1, 1, 0)] * 3 and dms(res.outputs) == [(-1, 1, 0)]


def test_paddle_stack_cases() -> None:
    xs = (T(M24, [2, 4], [0, -1]), T(M24, [2, 4], [0, -1]))
    res = get_rule("stack").infer_forward(xs, -1)
    assert dms(res.outputs) == [(0, -1, -1)] and dms(res.inputs[0]) == [(0, -1)] * 2
    res = get_rule("stack").infer_backward(xs, T(M24, [2, 4, 2], [0, -1, -1]), -1)
    assert dms(res.inputs[0]) == [(0, -1)] * 2 and dms(res.outputs) == [(0, -1, -1)]


def test_paddle_unbind_cases() -> None:
    r = get_rule("unbind")
    for dm, axis, want_x, want_o in (([-1, -1, -1], 1, (-1, -1, -1), (-1, -1)), ([0, -1, 1], 1, (0, -1, 1), (0, 1)),
                                     ([0, 1, -1], -2, (0, -1, -1), (0, -1))):
        res = r.infer_forward(T(M23, [64, 2, 48], dm), axis)
        assert dms(res.inputs) == [want_x] and dms(res.outputs[0]) == [want_o] * 2
    with pytest.raises(InvalidAttributeError, match="unbind: axis 3"):
        r.infer_forward(T(M23, [64, 2, 48], [0, 1, -1]), 3)
    x = T(M23, [64, 2, 48], [-1, -1, -1])
    for m0, m1, axis in (([0, 1], [0, -1], 1), ([0, -1], [-1, 1], -2)):
        res = r.infer_backward(x, (T(M23, [64, 48], m0), T(M23, [64, 48], m1)), axis)
        assert dms(res.inputs) == [(0, -1, 1)] and dms(res.outputs[0]) == [(0, 1)] * 2
    # the third case ([0, 1], [1, 0]) raises in Paddle: tests/test_split_concat.py::test_split_reverse_conflict


# ---------------------------------------------------------------------------
# hand-checked answers
# ---------------------------------------------------------------------------


def test_split_axis_replicated_others_uneven_kept() -> None:
    """Every piece is a contiguous range of the split axis: that axis must be whole on each rank;
    the other axes are copied through, an uneven split there (6 over 4) included."""
    res = get_rule("split").infer_forward(T(M4, [6, 8], [0, -1]), [4, 4], 1)
    assert dms(res.inputs) == [(0, -1)] and dms(res.outputs[0]) == [(0, -1)] * 2
    res = get_rule("split").infer_forward(T(M4, [8, 6], [-1, 0]), [3, 3], 1)
    assert dms(res.inputs) == [(-1, -1)]


def test_split_coshard_keeps_largest_mesh_dim() -> None:
    """As Paddle 3.3.1: a co-sharded axis keeps its largest mesh dim (mesh [2, 4] -> dim 1)."""
    for name, attr in (("split", [4, 4]), ("split_with_num", 2)):
        res = get_rule(name).infer_forward(T(M24, [8, 8], [(0, 1), -1]), attr, 1)
        assert dms(res.inputs) == [(1, -1)] and dms(res.outputs[0]) == [(1, -1)] * 2
    res = get_rule("unbind").infer_forward(T(M24, [3, 8], [-1, (0, 1)]), 0)
    assert dms(res.inputs) == [(-1, 1)] and dms(res.outputs[0]) == [(1,)] * 3


def test_split_partial_cleared() -> None:
    """As Paddle: a partial x is reduced first, the pieces are not partial."""
    res = get_rule("split").infer_forward(T(M22, [8, 8], [0, -1], [1]), [4, 4], 0)
    assert not res.inputs[0].partial and not any(o.partial for o in res.outputs[0])


def test_split_reverse_larger_piece_wins() -> None:
    """Pieces sharding one axis over different mesh dims: the larger piece keeps its sharding."""
    x = T(M22, [8, 8], [-1, -1])
    r = get_rule("split")
    res = r.infer_backward(x, (T(M22, [8, 3], [0, -1]), T(M22, [8, 5], [1, -1])), [3, 5], 1)
    assert dms(res.inputs) == [(1, -1)]
    res = r.infer_backward(x, (T(M22, [8, 5], [0, -1]), T(M22, [8, 3], [1, -1])), [5, 3], 1)
    assert dms(res.inputs) == [(0, -1)] and dms(res.outputs[0]) == [(0, -1)] * 2


def test_concat_agreeing_inputs_keep_uneven_sharding() -> None:
    """Every input sharded alike off the concat axis: kept, even 3 over 4 (each rank concatenates
    its own columns)."""
    res = get_rule("concat").infer_forward((T(M4, [4, 3], [-1, 0]), T(M4, [2, 3], [-1, 0])), 0)
    assert dms(res.inputs[0]) == [(-1, 0)] * 2 and dms(res.outputs) == [(-1, 0)]


def test_concat_axis_sharding_moves_to_a_kept_axis() -> None:
    """Sharded on the concat axis: that mesh dim moves to the cheapest other axis; a mesh dim the
    inputs disagree on (x0 S(1), x1 R) goes there too if the axis is free."""
    res = get_rule("concat").infer_forward((T(M22, [4, 8], [0, 1]), T(M22, [2, 8], [0, 1])), 0)
    assert dms(res.inputs[0]) == [(-1, 1)] * 2 and dms(res.outputs) == [(-1, 1)]
    res = get_rule("concat").infer_forward((T(M22, [4, 8], [-1, 0]), T(M22, [2, 8], [-1, 1])), 0)
    assert dms(res.inputs[0]) == [(-1, 0)] * 2 and dms(res.outputs) == [(-1, 0)]


def test_concat_mismatched_partial_cleared() -> None:
    """Only one input partial: a partial and a full piece do not concatenate to a partial whole."""
    res = get_rule("concat").infer_forward((T(M22, [4, 8], [-1, -1], [0]), T(M22, [2, 8], [-1, -1])), 0)
    assert not any(a.partial for a in res.inputs[0]) and not res.outputs[0].partial


def test_stack_new_axis_replicated() -> None:
    res = get_rule("stack").infer_forward((T(M22, [4, 8], [0, -1]), T(M22, [4, 8], [0, 1])), 1)
    assert dms(res.inputs[0]) == [(0, 1)] * 2 and dms(res.outputs) == [(0, -1, 1)]
    res = get_rule("stack").infer_backward((T(M22, [4, 8], [-1, -1]),) * 2, T(M22, [4, 2, 8], [0, 1, -1]), 1)
    assert dms(res.inputs[0]) == [(0, -1)] * 2 and dms(res.outputs) == [(0, -1, -1)]


def test_stack_partial_kept() -> None:
    """Stacking is linear: inputs partial alike give a partial output (as Paddle)."""
    xs = (T(M4, [4, 8], [-1, -1], [0]), T(M4, [4, 8], [-1, -1], [0]))
    res = get_rule("stack").infer_forward(xs, 0)
    assert res.outputs[0].partial == SUM and all(a.partial == SUM for a in res.inputs[0])


def test_concat_grad_aligns_x_and_output_grad() -> None:
    """output_grad sharded on the concat axis, x on the other: mesh dim 0 moves to axis 1, mesh
    dim 1 then finds axis 1 taken and is dropped; every x_grad is sharded as its x."""
    xs = (T(M22, [4, 8], [-1, 1]), T(M22, [2, 8], [-1, 1]))
    res = get_rule("concat_grad").infer_forward(xs, T(M22, [6, 8], [0, -1]), 0)
    assert dms(res.inputs[0]) == [(-1, 0)] * 2 and res.inputs[1].dims_mapping == (-1, 0)
    assert dms(res.outputs[0]) == [(-1, 0)] * 2


def test_split_grad_is_concat() -> None:
    res = get_rule("split_grad").infer_forward((T(M22, [8, 3], [0, -1]), T(M22, [8, 5], [0, 1])), 1)
    assert dms(res.inputs[0]) == [(0, -1)] * 2 and dms(res.outputs) == [(0, -1)]


def test_unbind_grad_is_stack() -> None:
    res = get_rule("unbind_grad").infer_forward((T(M22, [8, 3], [0, -1]), T(M22, [8, 3], [0, -1])), 0)
    assert dms(res.outputs) == [(-1, 0, -1)]


def test_stack_grad() -> None:
    """The stacked axis replicated; a partial output_grad gives partial x_grads (linear)."""
    res = get_rule("stack_grad").infer_forward(T(M22, [4, 2, 8], [0, 1, -1]), 1)
    assert dms(res.inputs) == [(0, -1, -1)] and dms(res.outputs[0]) == [(0, -1)] * 2
    res = get_rule("stack_grad").infer_forward(T(M22, [4, 2, 8], [0, -1, -1], [1]), 1)
    assert all(a.partial == ((1, ReduceType.SUM),) for a in res.outputs[0])


# ---------------------------------------------------------------------------
# deviations (docs/deviations.md)
# ---------------------------------------------------------------------------


def test_concat_reverse_out() -> None:
    """concat-reverse-out (DESIGN class 4): Paddle returns the requested output sharded on the
    concat axis while the inputs it returns are replicated there."""
    case = {"rule": "concat", "mesh": [2], "mode": "backward",
            "args": [[J([4, 3], [-1, -1]), J([4, 3], [-1, -1])], J([8, 3], [0, -1]), 0]}
    paddle = {"inputs": [[R([-1, -1]), R([-1, -1])]], "outputs": [R([0, -1])]}
    assert verify(None, case, result=paddle).status == UNSOUND
    res = get_rule("concat").infer_backward((T(M2, [4, 3], [-1, -1]),) * 2, T(M2, [8, 3], [0, -1]), 0)
    assert dms(res.inputs[0]) == [(-1, -1)] * 2 and dms(res.outputs) == [(-1, -1)]
    assert verify(None, case).status == SOUND
    # a partial output is not kept either: the inputs returned are not partial
    res = get_rule("concat").infer_backward((T(M4, [2], [0]), T(M4, [1], [-1])), T(M4, [3], [-1], [0]), 0)
    assert not res.outputs[0].partial


def test_stack_reverse_out() -> None:
    """stack-reverse-out (DESIGN class 4): Paddle returns output sharded on the stacked axis."""
    case = {"rule": "stack", "mesh": [2], "mode": "backward",
            "args": [[J([4, 3], [-1, -1]), J([4, 3], [-1, -1])], J([2, 4, 3], [0, -1, -1]), 0]}
    paddle = {"inputs": [[R([-1, -1]), R([-1, -1])]], "outputs": [R([0, -1, -1])]}
    assert verify(None, case, result=paddle).status == UNSOUND
    res = get_rule("stack").infer_backward((T(M2, [4, 3], [-1, -1]),) * 2, T(M2, [2, 4, 3], [0, -1, -1]), 0)
    assert dms(res.outputs) == [(-1, -1, -1)]
    assert verify(None, case).status == SOUND


def test_concat_partial_input_kept_on_output() -> None:
    """concat-partial-input (DESIGN class 6): every input partial SUM; Paddle keeps them partial
    but answers a non-partial output. spmdkit keeps the partial status on the output."""
    case = {"rule": "concat", "mesh": [4], "mode": "forward",
            "args": [[J([4, 8], [-1, -1], [0]), J([2, 8], [-1, -1], [0])], 0]}
    paddle = {"inputs": [[R([-1, -1], {"0": "sum"}), R([-1, -1], {"0": "sum"})]], "outputs": [R([-1, -1])]}
    assert verify(None, case, result=paddle).status == UNSOUND
    res = get_rule("concat").infer_forward((T(M4, [4, 8], [-1, -1], [0]), T(M4, [2, 8], [-1, -1], [0])), 0)
    assert all(a.partial == SUM for a in res.inputs[0]) and res.outputs[0].partial == SUM
    assert verify(None, case).status == SOUND


def test_unbind_partial_input_cleared() -> None:
    """unbind-partial-input (DESIGN class 6): Paddle keeps x partial, the slices not partial."""
    case = {"rule": "unbind", "mesh": [2], "mode": "forward", "args": [J([4, 3], [-1, -1], [0]), 0]}
    paddle = {"inputs": [R([-1, -1], {"0": "sum"})], "outputs": [[R([-1])] * 4]}
    assert verify(None, case, result=paddle).status == UNSOUND
    res = get_rule("unbind").infer_forward(T(M2, [4, 3], [-1, -1], [0]), 0)
    assert not res.inputs[0].partial and not any(o.partial for o in res.outputs[0])
    assert verify(None, case).status == SOUND


def test_split_reverse_conflict() -> None:
    """split-reverse-conflict (DESIGN class 8): Paddle raises NotImplementedError where two pieces
    shard one axis over different mesh dims (its own unbind test: [0, 1], [1, 0]); spmdkit
    resolves: the larger piece (the first of equal ones) keeps its sharding, a mesh dim then used
    twice is dropped."""
    x = T(M23, [64, 2, 48], [-1, -1, -1])
    res = get_rule("unbind").infer_backward(x, (T(M23, [64, 48], [0, 1]), T(M23, [64, 48], [1, 0])), 1)
    assert dms(res.inputs) == [(0, -1, 1)] and dms(res.outputs[0]) == [(0, 1)] * 2
    case = {"rule": "split", "mesh": [2, 2], "mode": "backward",
            "args": [J([8, 8], [-1, -1]), [J([8, 3], [0, -1]), J([8, 5], [1, -1])], [3, 5], 1]}
    assert verify(None, case).status == SOUND
    res = get_rule("split_with_num").infer_backward(
        T(M22, [8, 8], [-1, -1]), (T(M22, [8, 4], [0, -1]), T(M22, [8, 4], [1, 0])), 2, 1)
    assert dms(res.inputs) == [(0, -1)]


# ---------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "args", "exc", "words"),
    [
        ("split", (T(M22, [8, 8], [0, -1]), [3, 4], 1), InvalidAttributeError, "sections"),
        ("split", (T(M22, [8, 8], [0, -1]), [], 1), InvalidAttributeError, "sections"),
        ("split", (T(M22, [8, 8], [0, -1]), [-1, -1], 1), InvalidAttributeError, "sections"),
        ("split", (T(M22, [8, 8], [0, -1]), [4, 4], 2), InvalidAttributeError, "axis"),
        ("split", (T(M22, [], []), [1], 0), ShapeMismatchError, "x"),
        ("split_with_num", (T(M22, [8, 6], [0, -1]), 4, 1), InvalidAttributeError, "num"),
        ("split_with_num", (T(M22, [8, 6], [0, -1]), 0, 1), InvalidAttributeError, "num"),
        ("unbind", (T(M22, [8, 6], [0, -1]), -3), InvalidAttributeError, "axis"),
        ("concat", ((T(M22, [4, 8], [-1, -1]), T(M22, [2, 6], [-1, -1])), 0), ShapeMismatchError, "x[1]"),
        ("concat", ((T(M22, [4, 8], [-1, -1]), T(M22, [4], [-1])), 0), ShapeMismatchError, "x[1]"),
        ("concat", ((T(M22, [4, 8], [-1, -1]),), 2), InvalidAttributeError, "axis"),
        ("concat", ((), 0), SpmdError, "concat"),
        ("stack", ((T(M22, [4, 8], [-1, -1]), T(M22, [4, 6], [-1, -1])), 0), ShapeMismatchError, "x[1]"),
        ("stack", ((T(M22, [4, 8], [-1, -1]),), 3), InvalidAttributeError, "axis"),
        ("stack_grad", (T(M22, [4, 8], [-1, -1]), 2), InvalidAttributeError, "axis"),
        # an empty output_grad placeholder cannot stand for 2-D x: refused (the rank was answered wrong)
        ("concat_grad", ((T(M22, [4, 8], [-1, -1]),), T(M22, [0], [-1]), 0), ShapeMismatchError, "x[0] has 2 dims"),
        ("split_grad", ((T(M22, [4, 8], [-1, -1]), T(M22, [4, 6], [-1, -1])), 0), ShapeMismatchError,
         "out_grad[1]"),
    ],
)
def test_errors(name: str, args: tuple[Any, ...], exc: type, words: str) -> None:
    with pytest.raises(exc) as e:
        get_rule(name).infer_forward(*args)
    msg = str(e.value)
    assert msg.startswith(name) and words in msg


def test_backward_errors() -> None:
    x = T(M22, [8, 8], [-1, -1])
    with pytest.raises(ShapeMismatchError, match="split: out has 1 tensors"):
        get_rule("split").infer_backward(x, (T(M22, [8, 8], [-1, -1]),), [4, 4], 1)
    with pytest.raises(ShapeMismatchError, match=r"split: out\[0\]"):
        get_rule("split").infer_backward(x, (T(M22, [7, 4], [-1, -1]), T(M22, [8, 4], [-1, -1])), [4, 4], 1)
    with pytest.raises(ShapeMismatchError, match=r"unbind: out\[1\] has 2 dims"):
        get_rule("unbind").infer_backward(T(M22, [2, 8], [-1, -1]), (T(M22, [8], [-1]), T(M22, [8, 1], [-1, -1])), 0)
    with pytest.raises(ShapeMismatchError, match="stack: output has size 3 on axis 0"):
        get_rule("stack").infer_backward((T(M22, [4], [-1]),) * 2, T(M22, [3, 4], [-1, -1]), 0)
    with pytest.raises(InvalidMeshError, match="concat"):
        get_rule("concat").infer_backward((T(M22, [4], [-1]),), T(M4, [4], [-1]), 0)


# ---------------------------------------------------------------------------
# the references' grads are real gradients
# ---------------------------------------------------------------------------


def _numeric_vjp(f: Any, x: np.ndarray, gs: list[np.ndarray]) -> np.ndarray:
    """d/dx of sum_i <f(x)[i], gs[i]> by central differences (exact for these linear ops)."""
    def loss(v: np.ndarray) -> float:
        return float(sum(np.sum(np.asarray(o) * g) for o, g in zip(f(v), gs)))

    out = np.zeros_like(x)
    h = 1e-3
    for i in np.ndindex(x.shape):
        xp, xm = x.copy(), x.copy()
        xp[i] += h
        xm[i] -= h
        out[i] = (loss(xp) - loss(xm)) / (2 * h)
    return out


@pytest.mark.parametrize(("name", "grad", "attrs"), [
    ("split", "split_grad", {"sections": [1, -1, 2], "axis": 1}),
    ("split", "split_grad", {"sections": [2, 1], "axis": -3}),
    ("split_with_num", "split_with_num_grad", {"num": 2, "axis": 2}),
    ("unbind", "unbind_grad", {"axis": 1}),
    ("unbind", "unbind_grad", {"axis": -1}),
])
def test_split_grads_numeric(name: str, grad: str, attrs: dict[str, Any]) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5, 4))
    fwd = get_reference(name)
    outs = fwd.run({"x": x, **attrs}, _ctx())
    gs = [rng.standard_normal(np.shape(o)) for o in outs]
    want = _numeric_vjp(lambda v: fwd.run({"x": v, **attrs}, _ctx()), x, gs)
    got = get_reference(grad).run({"out_grad": gs, "axis": attrs["axis"]}, _ctx())[0]
    assert np.allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_concat_grad_numeric(axis: int) -> None:
    rng = np.random.default_rng(1)
    shapes = [[2, 3, 4], [2, 3, 4]]
    for s, n in zip(shapes, (2, 3)):
        s[axis] = n
    xs = [rng.standard_normal(s) for s in shapes]
    fwd = get_reference("concat")
    g = rng.standard_normal(fwd.run({"x": xs, "axis": axis}, _ctx())[0].shape)
    got = get_reference("concat_grad").run({"x": xs, "output_grad": g, "axis": axis}, _ctx())
    for i in range(2):
        def f(v: np.ndarray, i: int = i) -> Any:
            return fwd.run({"x": [v if j == i else xs[j] for j in range(2)], "axis": axis}, _ctx())

        assert np.allclose(got[i], _numeric_vjp(f, xs[i], [g]), atol=1e-6)


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_stack_grad_numeric(axis: int) -> None:
    rng = np.random.default_rng(2)
    xs = [rng.standard_normal((2, 3)) for _ in range(3)]
    fwd = get_reference("stack")
    g = rng.standard_normal(fwd.run({"x": xs, "axis": axis}, _ctx())[0].shape)
    got = get_reference("stack_grad").run({"output_grad": g, "axis": axis}, _ctx())
    assert len(got) == 3
    for i in range(3):
        def f(v: np.ndarray, i: int = i) -> Any:
            return fwd.run({"x": [v if j == i else xs[j] for j in range(3)], "axis": axis}, _ctx())

        assert np.allclose(got[i], _numeric_vjp(f, xs[i], [g]), atol=1e-6)


# ---------------------------------------------------------------------------
# soundness over generated cases
# ---------------------------------------------------------------------------

RULES = ["split", "split_with_num", "unbind", "concat", "stack"]
GRADS = ["split_grad", "split_with_num_grad", "unbind_grad", "concat_grad", "stack_grad"]


test_sound, test_grad_sound = soundness_tests(RULES, GRADS, 200, 11)
