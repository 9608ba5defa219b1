"""softmax family: Paddle's answers, deviations, grads, errors and a property test."""

# mypy: disable-error-code="union-attr,index,arg-type"
from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spmdkit.core.errors import InvalidAttributeError, InvalidMeshError, ShapeMismatchError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.spec import DistTensorSpec
from spmdkit.ops import get_rule
from spmdkit.sim import REJECTED, SOUND, verify

M24 = ProcessMesh([2, 4])


def T(mesh: ProcessMesh, shape: list[int], dm: list[Any], partial: Any = None) -> DistTensorSpec:
    return DistTensorSpec(shape, mesh=mesh, dims_mapping=dm, partial=partial)


def dms(attrs: Any) -> list[Any]:
    return [a.dims_mapping for a in attrs]


@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
def test_paddle_unit_test_cases(name: str) -> None:
    r = get_rule(name)
    for dm, axis, want in (
        ([1, -1, -1], -1, (1, -1, -1)),
        ([-1, 1, -1], -1, (-1, 1, -1)),
        ([1, -1, 0], -1, (1, -1, -1)),
        ([-1, 1, 0], 1, (-1, -1, 0)),
        ([-1, 1, 0], -2, (-1, -1, 0)),
    ):
        res = r.infer_forward(T(M24, [8, 16, 48], dm), axis)
        assert dms(res.inputs) == [want] and dms(res.outputs) == [want]
        res = r.infer_backward(T(M24, [8, 16, 48], [-1, -1, -1]), T(M24, [8, 16, 48], dm), axis)
        assert dms(res.inputs) == [want] and dms(res.outputs) == [want]


def test_uneven_dropped_on_input_too() -> None:
    """sm-uneven-input (DESIGN class 3): Paddle answers x [-1, -1, 1], out [-1, -1, -1]."""
    r = get_rule("softmax").infer_forward(T(M24, [9, 5, 10], [-1, 0, 1]), 1)
    assert dms(r.inputs) == [(-1, -1, -1)]
    assert dms(r.outputs) == [(-1, -1, -1)]


def test_coshard_minor_dropped_first() -> None:
    r = get_rule("softmax").infer_forward(T(M24, [6, 5, 10], [(0, 1), -1, -1]), 2)
    assert dms(r.inputs) == [(0, -1, -1)] and dms(r.outputs) == [(0, -1, -1)]


def test_reverse_out_is_what_x_produces() -> None:
    """sm-reverse-out (DESIGN class 4): Paddle answers x replicated but out [0, -1, 1]."""
    r = get_rule("softmax").infer_backward(T(M24, [9, 5, 10], [-1, -1, -1]), T(M24, [9, 5, 10], [0, -1, 1]), 1)
    assert dms(r.inputs) == [(-1, -1, -1)]
    assert dms(r.outputs) == [(-1, -1, -1)]


def test_zero_d() -> None:
    """sm-0d: Paddle 3.3.1 crashes (segfault) on a 0-d x."""
    r = get_rule("softmax").infer_forward(T(M24, [], [], [0]), -1)
    assert dms(r.inputs) == [()] and not r.inputs[0].partial and not r.outputs[0].partial


def test_partial_input_cleared() -> None:
    r = get_rule("log_softmax").infer_forward(T(M24, [8, 4], [-1, -1], [0]), 0)
    assert not r.inputs[0].partial and not r.outputs[0].partial


def test_grad() -> None:
    g = get_rule("softmax_grad")
    r = g.infer_forward(T(M24, [8, 6, 4], [0, -1, 1]), T(M24, [8, 6, 4], [-1, 1, -1]), -1)
    assert dms(r.inputs) == [(0, 1, -1), (0, 1, -1)]
    assert dms(r.outputs) == [(0, 1, -1)]
    assert get_rule("log_softmax_grad").infer_forward(T(M24, [8, 4], [0, 1]), T(M24, [8, 4], [0, 1]), 0).outputs[
        0
    ].dims_mapping == (-1, 1)


@pytest.mark.parametrize("axis", [2, -3, 5])
def test_axis_out_of_range(axis: int) -> None:
    with pytest.raises(InvalidAttributeError, match=r"softmax: axis"):
        get_rule("softmax").infer_forward(T(M24, [4, 4], [0, 1]), axis)


def test_errors() -> None:
    with pytest.raises(InvalidAttributeError, match="0-d"):
        get_rule("softmax").infer_forward(T(M24, [], []), 1)
    with pytest.raises(ShapeMismatchError, match="out"):
        get_rule("softmax").infer_backward(T(M24, [4, 4], [-1, -1]), T(M24, [4, 5], [-1, -1]), 0)
    with pytest.raises(ShapeMismatchError, match="out_grad"):
        get_rule("softmax_grad").infer_forward(T(M24, [4, 4], [-1, -1]), T(M24, [4], [-1]), 0)
    with pytest.raises(InvalidMeshError, match="out_grad"):
        get_rule("softmax_grad").infer_forward(T(M24, [4], [-1]), T(ProcessMesh([8]), [4], [-1]), 0)


@st.composite
def _cases(draw: Any) -> dict[str, Any]:
    mesh = draw(st.sampled_from([[2], [4], [2, 2], [2, 3], [3, 2, 2]]))
    shape = draw(st.lists(st.sampled_from([1, 2, 3, 4, 5, 6, 8]), min_size=0, max_size=4))
    nd = len(shape)
    axis = draw(st.integers(-nd, nd - 1)) if nd else draw(st.sampled_from([0, -1]))

    def mapping() -> list[Any]:
        free = list(range(len(mesh)))
        out: list[Any] = []
        for _ in range(nd):
            if free and draw(st.booleans()):
                if len(free) >= 2 and draw(st.integers(0, 3)) == 0:
                    out.append([free.pop(), free.pop()])
                else:
                    out.append(free.pop())
            else:
                out.append(-1)
        return out

    rule = draw(st.sampled_from(["softmax", "log_softmax", "softmax_grad", "log_softmax_grad"]))
    mode = "forward" if rule.endswith("_grad") else draw(st.sampled_from(["forward", "backward"]))
    t = lambda: {"shape": shape, "dims_mapping": mapping()}  # noqa: E731
    args = [t(), axis] if mode == "forward" and not rule.endswith("_grad") else [t(), t(), axis]
    return {"rule": rule, "mesh": mesh, "mode": mode, "args": args}


@settings(max_examples=150, deadline=None)
@given(_cases())
def test_property_sound_or_error(case: dict[str, Any]) -> None:
    v = verify(None, case)
    assert v.status in (SOUND, REJECTED), v.detail
