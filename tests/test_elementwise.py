"""Elementwise family: deviations, grads, errors and a property test."""

# mypy: disable-error-code="union-attr,operator,index,arg-type,type-arg"
from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spmdkit.core.dist_attr import ReduceType, TensorDistAttr
from spmdkit.core.errors import InvalidArgumentError, ShapeMismatchError, SpmdError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.spec import DistTensorSpec
from spmdkit.ops import get_rule


def T(mesh: ProcessMesh, shape: list[int], dm: list[object], partial: object = None) -> DistTensorSpec:
    return DistTensorSpec(shape, mesh=mesh, dims_mapping=dm, partial=partial)


M22 = ProcessMesh([2, 2])


def dms(res_part: Any) -> list[Any]:
    return [a.dims_mapping for a in res_part]


def test_add_two_mesh_dims_resolved() -> None:
    r = get_rule("add").infer_forward(T(M22, [4, 4], [0, 1]), T(M22, [4, 4], [1, 0]))
    assert dms(r.inputs) == [(0, 1), (0, 1)]
    assert dms(r.outputs) == [(0, 1)]


def test_add_larger_tensor_wins() -> None:
    r = get_rule("add").infer_forward(T(M22, [4], [1]), T(M22, [3, 4], [-1, 0]))
    assert dms(r.inputs) == [(0,), (-1, 0)]


def test_reverse_broadcast_out_is_what_inputs_produce() -> None:
    m = ProcessMesh([3, 4])
    r = get_rule("maximum").infer_backward(T(m, [1], [-1]), T(m, [1], [-1]), T(m, [1], [1]))
    assert dms(r.inputs) == [(-1,), (-1,)]
    assert dms(r.outputs) == [(-1,)]


def test_add_partial_cleared() -> None:
    r = get_rule("add").infer_forward(T(M22, [4, 6], [0, -1], [1]), T(M22, [4, 6], [-1, -1], [1]))
    assert all(not a.partial for a in r.inputs + r.outputs)


def test_multiply_partial_kept_from_one_input() -> None:
    r = get_rule("multiply").infer_forward(T(M22, [4, 6], [0, -1], [1]), T(M22, [4, 6], [-1, -1], [1]))
    assert r.inputs[0].partial == ((1, ReduceType.SUM),)
    assert r.inputs[1].partial == ()
    assert r.outputs[0].partial == ((1, ReduceType.SUM),)


def test_multiply_partial_cleared_when_sharding_takes_dim() -> None:
    r = get_rule("multiply").infer_forward(T(M22, [4, 6], [-1, -1], [1]), T(M22, [4, 6], [-1, 1]))
    assert dms(r.outputs) == [(-1, 1)]
    assert not r.outputs[0].partial and not r.inputs[0].partial


def test_multiply_max_partial_cleared() -> None:
    r = get_rule("multiply").infer_forward(T(M22, [4, 6], [0, -1], {1: "max"}), T(M22, [4, 6], [-1, -1]))
    assert not r.inputs[0].partial and not r.outputs[0].partial


def test_cast_partial() -> None:
    rule = get_rule("cast")
    r = rule.infer_forward(T(M22, [4, 6], [0, -1], [1]), "float16")
    assert r.outputs[0].partial == ((1, ReduceType.SUM),)
    r = rule.infer_forward(T(M22, [4, 6], [0, -1], [1]), "int32")
    assert not r.outputs[0].partial and not r.inputs[0].partial
    r = rule.infer_forward(T(M22, [4, 6], [0, -1], {1: "max"}), "int64")
    assert r.outputs[0].partial == ((1, ReduceType.MAX),)


def test_unary_prunes_uneven() -> None:
    m = ProcessMesh([2, 4])
    r = get_rule("relu").infer_forward(T(m, [3, 6], [1, 0]))
    assert dms(r.inputs) == [(-1, 0)] and dms(r.outputs) == [(-1, 0)]


def test_binary_grad_broadcast_partial() -> None:
    r = get_rule("add_grad").infer_forward(T(M22, [4, 1], [-1, -1]), T(M22, [4, 6], [-1, -1]), T(M22, [4, 6], [0, 1]))
    assert dms(r.inputs) == [(0, -1), (0, 1), (0, 1)]
    assert dms(r.outputs) == [(0, -1), (0, 1)]
    assert r.outputs[0].partial == ((1, ReduceType.SUM),)
    assert r.outputs[1].partial == ()


def test_binary_grad_missing_leading_dim_partial() -> None:
    r = get_rule("multiply_grad").infer_forward(T(M22, [6], [-1]), T(M22, [4, 6], [-1, -1]), T(M22, [4, 6], [0, 1]))
    assert dms(r.outputs) == [(1,), (0, 1)]
    assert r.outputs[0].partial == ((0, ReduceType.SUM),)


def test_divide_grad_out_not_partial() -> None:
    og = T(M22, [4, 6], [0, -1], [1])
    x = T(M22, [4, 6], [-1, -1])
    r = get_rule("divide_grad").infer_forward(x, x, x, og)
    assert len(r.inputs) == 4 and all(not a.partial for a in r.inputs)
    assert dms(r.inputs) == [(0, -1)] * 4


def test_unary_grads() -> None:
    og = T(M22, [4, 6], [0, 1], [])
    x = T(M22, [4, 6], [-1, -1])
    assert dms(get_rule("gelu_grad").infer_forward(x, og, True).outputs) == [(0, 1)]
    assert dms(get_rule("relu_grad").infer_forward(x, og).inputs) == [(0, 1), (0, 1)]
    assert len(get_rule("silu_grad").infer_forward(x, x, og).inputs) == 3
    assert len(get_rule("scale_grad").infer_forward(og).inputs) == 1
    r = get_rule("dropout_grad").infer_forward(T(M22, [4, 6], [0, -1]), og, 0.5, False, "upscale_in_train")
    assert dms(r.outputs) == [(0, 1)]
    r = get_rule("cast_grad").infer_forward(x, T(M22, [4, 6], [0, -1], [1]))
    assert r.outputs[0].partial == ((1, ReduceType.SUM),)


def test_errors() -> None:
    with pytest.raises(ShapeMismatchError, match=r"add.*y"):
        get_rule("add").infer_forward(T(M22, [3, 4], [-1, -1]), T(M22, [5, 4], [-1, -1]))
    with pytest.raises(ShapeMismatchError, match=r"relu.*out"):
        get_rule("relu").infer_backward(T(M22, [4, 4], [-1, -1]), T(M22, [4, 4, 4], [-1, -1, -1]))
    with pytest.raises(InvalidArgumentError, match=r"add.*3 arguments|add: takes"):
        get_rule("add").infer_forward(T(M22, [4], [-1]), T(M22, [4], [-1]), T(M22, [4], [-1]))
    with pytest.raises(InvalidArgumentError, match=r"relu.*'x'"):
        get_rule("relu").infer_forward(3)
    with pytest.raises(ShapeMismatchError, match=r"add_grad.*x"):
        get_rule("add_grad").infer_forward(T(M22, [5], [-1]), T(M22, [4], [-1]), T(M22, [4], [-1]))


@st.composite
def _case(draw: st.DrawFn) -> tuple:
    mshape = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
    mesh = ProcessMesh(mshape)
    nd = draw(st.integers(0, 3))
    shape = draw(st.lists(st.sampled_from([1, 2, 3, 4, 6]), min_size=nd, max_size=nd))
    yshape = [s if draw(st.booleans()) else 1 for s in shape][draw(st.integers(0, nd)) :]

    def spec(shp: list[int]) -> DistTensorSpec:
        dims = draw(st.permutations(list(range(len(mshape)))))
        dm = [-1] * len(shp)
        rest = []
        for d in dims:
            i = draw(st.integers(-1, len(shp) - 1))
            if i >= 0 and dm[i] == -1:
                dm[i] = d
            else:
                rest.append(d)
        pt = [d for d in rest if draw(st.booleans())]
        return T(mesh, shp, dm, pt)

    op = draw(st.sampled_from(["add", "multiply", "relu", "add_grad", "cast"]))
    return op, spec, shape, yshape


@settings(max_examples=150, deadline=None)
@given(_case())
def test_property_well_formed(c: tuple) -> None:
    op, spec, shape, yshape = c
    rule = get_rule(op)
    try:
        if op == "relu":
            r = rule.infer_forward(spec(shape))
        elif op == "cast":
            r = rule.infer_forward(spec(shape), "int32")
        elif op == "add_grad":
            r = rule.infer_forward(spec(shape), spec(yshape), spec(shape))
        else:
            r = rule.infer_forward(spec(shape), spec(yshape))
    except SpmdError:
        return
    n_in = {"relu": 1, "cast": 1, "add_grad": 3}.get(op, 2)
    assert len(r.inputs) == n_in
    for a in list(r.inputs) + list(r.outputs):
        TensorDistAttr(a.mesh, a.dims_mapping, a.partial)
