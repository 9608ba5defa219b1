"""matmul family: Paddle's answers, deviations, grads, errors and a property test."""

# mypy: disable-error-code="union-attr,index,arg-type"
from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spmdkit.core import errors
from spmdkit.core.dist_attr import ReduceType
from spmdkit.core.errors import (
    InvalidAttributeError,
    InvalidMeshError,
    ShapeMismatchError,
    SpmdError,
)
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.spec import DistTensorSpec
from spmdkit.ops import get_rule
from spmdkit.sim import REJECTED, SOUND, verify

S = ReduceType.SUM
M22 = ProcessMesh([2, 2])
M23 = ProcessMesh([2, 3])


def T(mesh: ProcessMesh, shape: list[int], dm: list[Any], partial: Any = None) -> DistTensorSpec:
    return DistTensorSpec(shape, mesh=mesh, dims_mapping=dm, partial=partial)


def dms(attrs: Any) -> list[Any]:
    return [a.dims_mapping for a in attrs]


MM = get_rule("matmul")
GRAD = get_rule("matmul_grad")


def test_alias() -> None:
    assert get_rule("matmul_v2") is MM


def test_known_case_contracting_axis_partial() -> None:
    r = MM.infer_forward(T(M22, [64, 32], [1, 0]), T(M22, [32, 48], [0, -1]), False, False)
    assert dms(r.inputs) == [(1, 0), (0, -1)]
    assert r.outputs[0].dims_mapping == (1, -1)
    assert r.outputs[0].partial == ((0, S),)


def test_k_sharded_differently_is_coshared() -> None:
    # Paddle 3.3.1: x k on 0, y k on 1 -> k co-sharded, the larger mesh dim major
    m = ProcessMesh([3, 2])
    r = MM.infer_forward(T(m, [6, 36], [-1, 0]), T(m, [36, 6], [1, -1]))
    assert dms(r.inputs) == [(-1, (0, 1)), ((0, 1), -1)]
    assert r.outputs[0].partial == ((0, S), (1, S))


def test_uneven_k_dropped_uneven_m_kept() -> None:
    r = MM.infer_forward(T(M23, [7, 32], [0, 1]), T(M23, [32, 5], [-1, -1]))
    assert dms(r.inputs) == [(0, -1), (-1, -1)]
    assert dms(r.outputs) == [(0, -1)]


def test_mn_conflict_larger_axis_wins() -> None:
    r = MM.infer_forward(T(M22, [4, 36], [0, -1]), T(M22, [36, 400], [-1, 0]))
    assert dms(r.outputs) == [(-1, 0)]
    r = MM.infer_forward(T(M22, [400, 36], [0, -1]), T(M22, [36, 4], [-1, 0]))
    assert dms(r.outputs) == [(0, -1)]


def test_batch_broadcast_size1_axis_propagates() -> None:
    r = MM.infer_forward(T(M23, [1, 6, 32], [0, -1, -1]), T(M23, [4, 32, 48], [-1, -1, 1]))
    assert dms(r.inputs) == [(-1, -1, -1), (0, -1, 1)]
    assert dms(r.outputs) == [(0, -1, 1)]


def test_trans() -> None:
    r = MM.infer_forward(T(M22, [8, 4], [0, 1]), T(M22, [4, 8], [1, 0]), True, True)
    assert dms(r.inputs) == [(0, 1), (-1, 0)]
    assert r.outputs[0].dims_mapping == (1, -1)
    assert r.outputs[0].partial == ((0, S),)


def test_one_d_operands() -> None:
    r = MM.infer_forward(T(M23, [30], [1]), T(M23, [30], [1]))
    assert r.outputs[0].dims_mapping == ()
    assert r.outputs[0].partial == ((1, S),)
    r = MM.infer_forward(T(M23, [32], [0]), T(M23, [4, 32, 6], [1, -1, -1]))
    assert dms(r.inputs) == [(0,), (-1, 0, -1)]
    assert r.outputs[0].dims_mapping == (-1, -1)


def test_partial_input_made_replicated() -> None:
    r = MM.infer_forward(T(M23, [6, 32], [-1, -1], [0]), T(M23, [32, 48], [-1, -1]))
    assert not r.inputs[0].partial and not r.outputs[0].partial


# -- deviations (docs/deviations/matmul.md) ---------------------------------------------------


def test_size1_axis_not_sharded() -> None:
    """mm-size1-axis: Paddle answers out [0, -1] (m of size 1 sharded while x is replicated)."""
    r = MM.infer_forward(T(M22, [1, 32], [0, -1]), T(M22, [32, 4], [-1, -1]))
    assert dms(r.inputs) == [(-1, -1), (-1, -1)]
    assert dms(r.outputs) == [(-1, -1)]


def test_reverse_out_is_what_inputs_produce() -> None:
    """mm-reverse-out: Paddle's unit-test case, out [64, 48] [1, 0] on mesh [2, 3]."""
    x, y = T(M23, [64, 32], [-1, -1]), T(M23, [32, 48], [-1, -1])
    r = MM.infer_backward(x, y, T(M23, [64, 48], [1, 0]))
    assert dms(r.inputs) == [(-1, -1), (-1, 0)]
    assert dms(r.outputs) == [(-1, 0)]  # Paddle: [1, 0], which x [-1, -1] cannot produce
    r = MM.infer_backward(x, y, T(M23, [64, 48], [-1, -1], [0]))
    assert not r.outputs[0].partial  # Paddle keeps partial{0} over replicated inputs


def test_reverse_one_d() -> None:
    """mm-reverse-1d: Paddle 3.3.1 rejects every reverse call with a 1-D operand."""
    r = MM.infer_backward(T(M23, [32], [-1]), T(M23, [32, 48], [-1, -1]), T(M23, [48], [1]))
    assert dms(r.inputs) == [(-1,), (-1, 1)]
    assert dms(r.outputs) == [(1,)]


def test_size1_batch_no_crash() -> None:
    """mm-size1-batch-crash: Paddle fails (vector::_M_fill_insert) on this valid input."""
    r = MM.infer_forward(T(M23, [1, 3, 32], [1, -1, -1]), T(M23, [6, 1, 32, 4], [-1, 0, -1, -1]))
    c = {"rule": "matmul", "mesh": [2, 3], "mode": "forward",
         "args": [{"shape": [1, 3, 32], "dims_mapping": [1, -1, -1]},
                  {"shape": [6, 1, 32, 4], "dims_mapping": [-1, 0, -1, -1]}, False, False]}  # fmt: skip
    assert verify(None, c).status == SOUND
    assert len(r.outputs[0].dims_mapping) == 4


# -- grad -------------------------------------------------------------------------------------


def test_grad_partials() -> None:
    x = T(M22, [1, 8, 6], [-1, 0, -1])
    y = T(M22, [4, 6, 10], [1, -1, -1])
    g = T(M22, [4, 8, 10], [1, 0, -1])
    r = GRAD.infer_forward(x, y, g)
    assert dms(r.inputs) == [(-1, 0, -1), (1, -1, -1), (1, 0, -1)]
    xg, yg = r.outputs
    assert xg.dims_mapping == (-1, 0, -1) and xg.partial == ((1, S),)  # summed over the broadcast batch
    assert yg.dims_mapping == (1, -1, -1) and yg.partial == ((0, S),)  # summed over m


def test_grad_k_sharded_not_partial() -> None:
    r = GRAD.infer_forward(T(M22, [8, 6], [-1, 1]), T(M22, [6, 4], [1, -1]), T(M22, [8, 4], [0, -1]))
    xg, yg = r.outputs
    assert xg.dims_mapping == (0, 1) and not xg.partial
    assert yg.dims_mapping == (1, -1) and yg.partial == ((0, S),)


# -- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "err", "words"),
    [
        (([], [3]), ShapeMismatchError, "at least 1 dim"),
        (([4, 5], [6, 3]), ShapeMismatchError, "contracting axis"),
        (([2, 4, 5], [3, 5, 3]), ShapeMismatchError, "batch axes"),
    ],
)
def test_shape_errors(args: tuple[list[int], list[int]], err: type, words: str) -> None:
    xs, ys = args
    with pytest.raises(err, match=words) as ei:
        MM.infer_forward(T(M22, xs, [-1] * len(xs)), T(M22, ys, [-1] * len(ys)))
    assert "matmul" in str(ei.value)


def test_trans_on_1d_rejected() -> None:
    with pytest.raises(InvalidAttributeError, match="trans_x"):
        MM.infer_forward(T(M22, [4], [-1]), T(M22, [4, 3], [-1, -1]), True, False)


def test_mesh_mismatch() -> None:
    with pytest.raises(InvalidMeshError, match="y"):
        MM.infer_forward(T(M22, [4, 4], [-1, -1]), T(M23, [4, 4], [-1, -1]))


def test_reverse_out_shape_checked() -> None:
    with pytest.raises(ShapeMismatchError, match="out"):
        MM.infer_backward(T(M22, [4, 5], [-1, -1]), T(M22, [5, 6], [-1, -1]), T(M22, [4, 7], [-1, -1]))
    with pytest.raises(ShapeMismatchError, match="out_grad"):
        GRAD.infer_forward(T(M22, [4, 5], [-1, -1]), T(M22, [5, 6], [-1, -1]), T(M22, [4, 6, 1], [-1, -1, -1]))


# -- property ---------------------------------------------------------------------------------


@st.composite
def _cases(draw: Any) -> dict[str, Any]:
    mesh = draw(st.sampled_from([[2], [4], [2, 2], [2, 3], [3, 2, 2], [1, 2]]))
    sizes = st.sampled_from([1, 2, 3, 4, 6, 8])
    m, k, n = draw(sizes), draw(sizes), draw(sizes)
    nb = draw(st.integers(0, 2))
    batch = [draw(sizes) for _ in range(nb)]
    x1, y1 = draw(st.booleans()) and draw(st.booleans()), draw(st.booleans()) and draw(st.booleans())
    tx, ty = (not x1) and draw(st.booleans()), (not y1) and draw(st.booleans())
    bx = [b if draw(st.integers(0, 4)) else 1 for b in batch][draw(st.integers(0, nb)) :]
    by = [b if draw(st.integers(0, 4)) else 1 for b in batch][draw(st.integers(0, nb)) :]
    xs = [k] if x1 else [*bx, *((k, m) if tx else (m, k))]
    ys = [k] if y1 else [*by, *((n, k) if ty else (k, n))]

    def mapping(nd: int) -> list[Any]:
        free = list(range(len(mesh)))
        out: list[Any] = []
        for _ in range(nd):
            if free and draw(st.booleans()):
                if len(free) >= 2 and draw(st.integers(0, 4)) == 0:
                    out.append([free.pop(), free.pop()])
                else:
                    out.append(free.pop(draw(st.integers(0, len(free) - 1))))
            else:
                out.append(-1)
        return out

    mode = draw(st.sampled_from(["forward", "backward", "grad"]))
    x = {"shape": xs, "dims_mapping": mapping(len(xs))}
    y = {"shape": ys, "dims_mapping": mapping(len(ys))}
    if mode == "forward":
        return {"rule": "matmul", "mesh": mesh, "mode": "forward", "args": [x, y, tx, ty]}
    nbo = max(len(xs) - 2, len(ys) - 2, 0)
    ob = [max(a, b) for a, b in zip(([1] * nbo + bx)[-nbo:] if nbo else [], ([1] * nbo + by)[-nbo:] if nbo else [])]
    os_ = [*ob, *([] if x1 else [m]), *([] if y1 else [n])]
    o = {"shape": os_, "dims_mapping": mapping(len(os_))}
    if mode == "backward":
        return {"rule": "matmul", "mesh": mesh, "mode": "backward", "args": [x, y, o, tx, ty]}
    return {"rule": "matmul_grad", "mesh": mesh, "mode": "forward", "args": [x, y, o, tx, ty]}


@settings(max_examples=150, deadline=None)
@given(_cases())
def test_property_sound_or_error(case: dict[str, Any]) -> None:
    v = verify(None, case)
    assert v.status in (SOUND, REJECTED), v.detail
    if v.status == REJECTED:
        assert v.error and issubclass(getattr(errors, v.error), SpmdError)
