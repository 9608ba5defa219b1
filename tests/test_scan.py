"""scan family (triu, tril_triu, cumsum, argmax, argmin, topk, logsumexp, add_n, *_like):
Paddle's unit-test cases, hand-checked answers, deviations, grads, errors and soundness."""

# mypy: disable-error-code="union-attr,index,arg-type"
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from spmd_helpers import J, T, dms, soundness_tests
from spmd_helpers import global_ctx as _ctx
from spmd_helpers import numeric_grad as _numeric_grad
from spmdkit.core.dist_attr import ReduceType
from spmdkit.core.errors import (
    InvalidArgumentError,
    InvalidAttributeError,
    InvalidMeshError,
    ShapeMismatchError,
    SpmdError,
)
from spmdkit.core.mesh import ProcessMesh
from spmdkit.ops import get_rule
from spmdkit.sim import SOUND, UNSOUND, verify
from spmdkit.sim.reference import get_reference

M22 = ProcessMesh([2, 2])
M23 = ProcessMesh([2, 3])
M24 = ProcessMesh([2, 4])
M4 = ProcessMesh([4])


# ---------------------------------------------------------------------------
# Paddle's own unit tests (test_triu_rule.py, test_cumsum_rule.py, test_argmax_rule.py, ...)
# ---------------------------------------------------------------------------


def test_paddle_triu_cases() -> None:
    x = T(M22, [16, 16, 16], [0, -1, 1])
    for name, extra in (("triu", (0,)), ("tril_triu", (0, False))):
        r = get_rule(name)
        for res in (r.infer_forward(x, *extra), r.infer_backward(x, x, *extra)):
            assert dms(res.inputs) == [(0, -1, -1)] and dms(res.outputs) == [(0, -1, -1)]


def test_paddle_cumsum_cases() -> None:
    r = get_rule("cumsum")
    x = T(M24, [64, 32, 48], [-1, 0, 1])
    res = r.infer_forward(x, 1, False, False, False)
    assert dms(res.inputs) == [(-1, -1, 1)] and dms(res.outputs) == [(-1, -1, 1)]
    res = r.infer_forward(x, 0, False, False, False)
    assert dms(res.inputs) == [(-1, 0, 1)] and dms(res.outputs) == [(-1, 0, 1)]
    res = r.infer_forward(x, -1, True, False, False)
    assert dms(res.inputs) == [(-1, -1, -1)] and dms(res.outputs) == [(-1,)]
    res = r.infer_backward(T(M24, [64, 32, 48], [-1, -1, 1]), T(M24, [64, 32, 48], [-1, -1, 1]), 1, False, False, False)
    assert dms(res.inputs) == [(-1, -1, 1)] and dms(res.outputs) == [(-1, -1, 1)]
    res = r.infer_backward(x, T(M24, [64 * 32 * 48], [-1]), -1, True, False, False)
    assert dms(res.inputs) == [(-1, -1, -1)] and dms(res.outputs) == [(-1,)]


@pytest.mark.parametrize("name", ["argmax", "argmin"])
def test_paddle_arg_cases(name: str) -> None:
    r = get_rule(name)
    x = T(M23, [64, 32, 48], [0, 1, -1])
    for axis, keep, want_x, want_o in ((1, False, (0, -1, -1), (0, -1)), (-1, False, (0, 1, -1), (0, 1)),
                                       (-1, True, (0, 1, -1), (0, 1, -1))):
        res = r.infer_forward(x, axis, keep, False)
        assert dms(res.inputs) == [want_x] and dms(res.outputs) == [want_o]
    xr = T(M23, [64, 32, 48], [-1, -1, -1])
    res = r.infer_backward(xr, T(M23, [64, 48], [0, -1]), 1, False, False)
    assert dms(res.inputs) == [(0, -1, -1)] and dms(res.outputs) == [(0, -1)]
    res = r.infer_backward(xr, T(M23, [64, 32], [0, 1]), -1, False, False)
    assert dms(res.inputs) == [(0, 1, -1)] and dms(res.outputs) == [(0, 1)]
    res = r.infer_backward(xr, T(M23, [1, 1, 1], [0, 1, -1]), -1, True, True)
    assert dms(res.inputs) == [(-1, -1, -1)] and dms(res.outputs) == [(-1, -1, -1)]


def test_paddle_topk_cases() -> None:
    r = get_rule("topk")
    res = r.infer_forward(T(M22, [16, 16, 16], [0, 1, -1]), 2, 1, True, True)
    assert dms(res.inputs) == [(0, -1, -1)] and dms(res.outputs) == [(0, -1, -1), (0, -1, -1)]
    # Paddle's test passes indices of x's shape; the topk axis' size is not checked
    x = T(M22, [16, 16, 16], [0, -1, 1])
    res = r.infer_backward(x, x, T(M22, [16, 2, 16], [-1, 1, -1]), 2, 1, True, True)
    assert dms(res.inputs) == [(0, -1, 1)] * 3 and dms(res.outputs) == [(0, -1, 1)]


def test_paddle_add_n_cases() -> None:
    r = get_rule("add_n")
    x = T(M22, [16, 16, 16], [0, -1, -1])
    res = r.infer_forward([x, x])
    assert [dms(v) for v in res.inputs] == [[(0, -1, -1)] * 2] and dms(res.outputs) == [(0, -1, -1)]
    res = r.infer_forward([T(M22, [16, 16, 16], [0, -1, -1], [1]), T(M22, [16, 16, 16], [-1, -1, -1], [1])])
    assert all(a.partial == ((1, ReduceType.SUM),) and a.dims_mapping == (0, -1, -1) for a in res.inputs[0])
    assert res.outputs[0].partial == ((1, ReduceType.SUM),)


def test_paddle_logsumexp_kept_axes() -> None:
    """test_logsumexp_rule.py: kept axes keep their sharding (the partial answers are a deviation)."""
    r = get_rule("logsumexp")
    res = r.infer_forward(T(M4, [64, 32], [0, -1]), [1], False, False)
    assert dms(res.inputs) == [(0, -1)] and dms(res.outputs) == [(0,)] and not res.outputs[0].partial
    res = r.infer_backward(T(M23, [96, 24, 48], [-1, -1, -1]), T(M23, [96, 1, 1], [0, -1, -1]), [1, 2], True, False)
    assert dms(res.inputs) == [(0, -1, -1)] and dms(res.outputs) == [(0, -1, -1)]


# ---------------------------------------------------------------------------
# hand-checked answers
# ---------------------------------------------------------------------------


def test_cumsum_scanned_axis_replicated_others_uneven_kept() -> None:
    """A prefix sum is per slice along the other axes: an uneven split there is fine."""
    res = get_rule("cumsum").infer_forward(T(M24, [5, 8, 8], [1, 0, -1]), 1)
    assert dms(res.inputs) == [(1, -1, -1)] and dms(res.outputs) == [(1, -1, -1)]


def test_coshard_keeps_largest_mesh_dim() -> None:
    """As Paddle 3.3.1: a co-sharded axis keeps its largest mesh dim (mesh [2, 4] -> dim 1)."""
    for name, args in (("cumsum", (1,)), ("argmax", (1,)), ("topk", (2, 1))):
        res = get_rule(name).infer_forward(T(M24, [8, 8, 8], [(0, 1), -1, -1]), *args)
        assert dms(res.inputs) == [(1, -1, -1)], name
    res = get_rule("cumsum").infer_forward(T(ProcessMesh([4, 2]), [8, 8, 8], [(0, 1), -1, -1]), 1)
    assert dms(res.inputs) == [(0, -1, -1)]


def test_partial_inputs_cleared() -> None:
    for name, args in (("triu", (0,)), ("cumsum", (0,)), ("argmax", (0,)), ("topk", (1, 0)),
                       ("logsumexp", ([0],))):
        res = get_rule(name).infer_forward(T(M22, [4, 4], [-1, -1], [1]), *args)
        assert not res.inputs[0].partial and not res.outputs[0].partial, name


def test_like_out_never_partial() -> None:
    """full_like / empty_like / ones_like / zeros_like: out sharded like x, x as given."""
    x = T(M22, [4, 6], [0, -1], [1])
    for name, args in (("full_like", (1.5, None)), ("empty_like", (None,)), ("ones_like", ()), ("zeros_like", ())):
        res = get_rule(name).infer_forward(x, *args)
        assert res.inputs[0] == x.dist_attr
        assert res.outputs[0].dims_mapping == (0, -1) and not res.outputs[0].partial
        res = get_rule(name).infer_backward(T(M22, [4, 6], [-1, -1]), T(M22, [4, 6], [-1, 1], [0]), *args)
        assert dms(res.inputs) == [(-1, 1)] and not res.outputs[0].partial


def test_add_n_reverse_built() -> None:
    """Paddle has no add_n reverse; spmdkit's: every input takes out's sharding."""
    res = get_rule("add_n").infer_backward([T(M22, [4, 4], [-1, -1])] * 3, T(M22, [4, 4], [1, -1], [0]))
    assert [dms(v) for v in res.inputs] == [[(1, -1)] * 3] and dms(res.outputs) == [(1, -1)]
    assert not res.outputs[0].partial


def test_add_n_grad_is_out_grad() -> None:
    g = T(M22, [4, 4], [1, -1], [0])
    res = get_rule("add_n_grad").infer_forward([T(M22, [4, 4], [0, -1])] * 2, g)
    assert res.outputs == ((g.dist_attr, g.dist_attr),)


def test_topk_grad_merges_non_axis_letters() -> None:
    res = get_rule("topk_grad").infer_forward(
        T(M22, [8, 8, 8], [0, -1, -1]), T(M22, [8, 8, 2], [-1, -1, -1]), T(M22, [8, 8, 2], [-1, 1, -1]), 2, -1
    )
    assert dms(res.inputs) == [(0, 1, -1)] * 3 and dms(res.outputs) == [(0, 1, -1)]


def test_logsumexp_grad() -> None:
    res = get_rule("logsumexp_grad").infer_forward(
        T(M22, [8, 6], [-1, 1]), T(M22, [8, 1], [0, -1], [1]), T(M22, [8, 1], [0, 1]), [1], True, False
    )
    assert dms(res.inputs) == [(0, -1), (0, -1), (0, -1)] and dms(res.outputs) == [(0, -1)]
    assert not any(a.partial for a in res.inputs)


def test_triu_grads() -> None:
    g = T(M22, [3, 8, 8], [0, -1, -1], [1])
    for name, args in (("triu_grad", (1,)), ("tril_triu_grad", (1, True))):
        res = get_rule(name).infer_forward(T(M22, [3, 8, 8], [0, 1, -1]), *args)
        assert dms(res.inputs) == [(0, -1, -1)] and dms(res.outputs) == [(0, -1, -1)]
    assert not get_rule("triu_grad").infer_forward(g, 0).inputs[0].partial


# ---------------------------------------------------------------------------
# deviations (docs/deviations.md, scan-*)
# ---------------------------------------------------------------------------


def test_triu_coshard_kept_on_output() -> None:
    """scan-triu-coshard: Paddle keeps x [(0,1),-1,-1] but answers out [1,-1,-1]."""
    case = {"rule": "triu", "mesh": [2, 4], "mode": "forward", "args": [J([8, 8, 8], [[0, 1], -1, -1]), 0]}
    paddle = {"inputs": [{"dims_mapping": [[0, 1], -1, -1]}], "outputs": [{"dims_mapping": [1, -1, -1]}]}
    assert verify(None, case, result=paddle).status == UNSOUND
    res = get_rule("triu").infer_forward(T(M24, [8, 8, 8], [(0, 1), -1, -1]), 0)
    assert dms(res.inputs) == [((0, 1), -1, -1)] and dms(res.outputs) == [((0, 1), -1, -1)]
    assert verify(None, case).status == SOUND


def test_logsumexp_reduced_axis_replicated() -> None:
    """scan-lse-partial (DESIGN class 2): Paddle answers out partial SUM over a sharded reduced axis."""
    case = {"rule": "logsumexp", "mesh": [4], "mode": "forward", "args": [J([64, 32], [0, -1]), [0], False, False]}
    paddle = {"inputs": [{"dims_mapping": [0, -1]}], "outputs": [{"dims_mapping": [-1], "partial": {"0": "sum"}}]}
    assert verify(None, case, result=paddle).status == UNSOUND
    res = get_rule("logsumexp").infer_forward(T(M4, [64, 32], [0, -1]), [0], False, False)
    assert dms(res.inputs) == [(-1, -1)] and dms(res.outputs) == [(-1,)] and not res.outputs[0].partial


def test_logsumexp_reduce_all() -> None:
    """scan-lse-reduce-all (DESIGN class 5): Paddle ignores reduce_all and answers a 1-D out."""
    res = get_rule("logsumexp").infer_forward(T(M24, [8, 8], [-1, 1]), [0], False, True)
    assert dms(res.inputs) == [(-1, -1)] and dms(res.outputs) == [()]
    case = {"rule": "logsumexp", "mesh": [2, 4], "mode": "forward", "args": [J([8, 8], [-1, 1]), [0], False, True]}
    paddle = {"inputs": [{"dims_mapping": [-1, 1]}], "outputs": [{"dims_mapping": [1]}]}
    assert verify(None, case, result=paddle).status == UNSOUND


def test_logsumexp_reverse_out_not_partial() -> None:
    """scan-lse-reverse-out (DESIGN class 4): Paddle echoes out's partial status."""
    res = get_rule("logsumexp").infer_backward(
        T(M23, [96, 24, 48], [-1, -1, -1]), T(M23, [96, 1, 1], [0, -1, -1], [1]), [1, 2], True, False
    )
    assert dms(res.outputs) == [(0, -1, -1)] and not res.outputs[0].partial


def test_arg_flatten_out_is_0d() -> None:
    """scan-arg-flatten-0d (DESIGN class 5): argmax with flatten (not keepdims) is 0-d; Paddle answers [-1]."""
    for name in ("argmax", "argmin"):
        res = get_rule(name).infer_forward(T(M23, [64, 32, 48], [0, 1, -1]), -1, False, True)
        assert dms(res.outputs) == [()]
        res = get_rule(name).infer_backward(T(M23, [6, 4], [-1, -1]), T(M23, [], []), -1, False, True)
        assert dms(res.inputs) == [(-1, -1)] and dms(res.outputs) == [()]
    case = {"rule": "argmax", "mesh": [2, 3], "mode": "forward", "args": [J([6, 4], [0, 1]), -1, False, True]}
    paddle = {"inputs": [{"dims_mapping": [-1, -1]}], "outputs": [{"dims_mapping": [-1]}]}
    assert verify(None, case, result=paddle).status == UNSOUND


def test_arg_reverse_keepdims_axis_replicated() -> None:
    """scan-arg-reverse-axis (DESIGN class 4): with keepdims, Paddle's reverse copies out's sharding of
    the size-1 arg axis onto x's arg axis."""
    case = {"rule": "argmin", "mesh": [2, 3, 3], "mode": "backward",
            "args": [J([3, 8, 36], [0, -1, -1]), J([1, 8, 36], [[0, 1], -1, 2]), -3, True, False]}
    paddle = {"inputs": [{"dims_mapping": [1, -1, 2]}], "outputs": [{"dims_mapping": [1, -1, 2]}]}
    assert verify(None, case, result=paddle).status == UNSOUND
    res = get_rule("argmin").infer_backward(T(ProcessMesh([2, 3, 3]), [3, 8, 36], [0, -1, -1]),
                                            T(ProcessMesh([2, 3, 3]), [1, 8, 36], [(0, 1), -1, 2]), -3, True, False)
    assert dms(res.inputs) == [(-1, -1, 2)] and dms(res.outputs) == [(-1, -1, 2)]


def test_cumsum_negative_axis() -> None:
    """scan-cumsum-negative-axis: Paddle indexes the mapping with a negative axis (a crash, or the
    scanned axis left sharded); spmdkit counts it from the end."""
    res = get_rule("cumsum").infer_forward(T(ProcessMesh([1, 4]), [2, 8, 1], [1, 0, -1]), -3, False, True, False)
    assert dms(res.inputs) == [(-1, 0, -1)] and dms(res.outputs) == [(-1, 0, -1)]
    case = {"rule": "cumsum", "mesh": [2, 4], "mode": "forward",
            "args": [J([8, 8], [1, -1]), -2, False, False, False]}
    paddle = {"inputs": [{"dims_mapping": [1, -1]}], "outputs": [{"dims_mapping": [1, -1]}]}
    assert verify(None, case, result=paddle).status == UNSOUND
    assert verify(None, case).status == SOUND


def test_paddle_crash_cases_answered() -> None:
    """scan-paddle-crash: Paddle 3.3.1 crashes on argmax / argmin of a 0-d x and on cumsum with a
    negative axis or a 0-d x; spmdkit answers (replicated)."""
    m = ProcessMesh([2, 2])
    for name, args in (("argmax", (-1, False, False)), ("argmin", (0, True, False)), ("cumsum", (0,))):
        res = get_rule(name).infer_forward(T(m, [], [], [1]), *args)
        assert dms(res.inputs) == [()] and dms(res.outputs) == [()] and not res.outputs[0].partial
    res = get_rule("cumsum").infer_forward(T(m, [4, 7], [0, -1]), -1)
    assert dms(res.inputs) == [(0, -1)]


def test_two_mesh_dims_resolved() -> None:
    """scan-two-mesh-dims (DESIGN class 8): add_n / topk_grad / logsumexp reverse raise where one axis
    is sharded on two mesh dims by two tensors; spmdkit resolves (the first tensor keeps its sharding,
    a mesh dim already taken is dropped)."""
    res = get_rule("add_n").infer_forward([T(M22, [8, 8], [0, -1]), T(M22, [8, 8], [1, 0])])
    assert [dms(v) for v in res.inputs] == [[(0, -1), (0, -1)]] and dms(res.outputs) == [(0, -1)]
    case = {"rule": "add_n", "mesh": [2, 2], "mode": "forward", "args": [[J([8, 8], [0, -1]), J([8, 8], [1, 0])]]}
    assert verify(None, case).status == SOUND
    res = get_rule("topk_grad").infer_forward(
        T(M22, [8, 8, 8], [0, -1, -1]), T(M22, [8, 8, 2], [1, -1, -1]), T(M22, [8, 8, 2], [1, 0, -1]), 2, 2
    )
    assert dms(res.outputs) == [(0, -1, -1)]


def test_illegal_input_rejected() -> None:
    """scan-illegal-input: Paddle answers for an out of the wrong shape (its own logsumexp test passes
    out [96, 1, 1] for a reduce-all) and for add_n inputs of different shapes; spmdkit raises."""
    with pytest.raises(ShapeMismatchError, match="logsumexp: out"):
        get_rule("logsumexp").infer_backward(
            T(M23, [96, 24, 48], [-1, -1, -1]), T(M23, [96, 1, 1], [-1, -1, -1], [1]), [0, 1, 2], True, True
        )
    with pytest.raises(ShapeMismatchError, match=r"add_n: input\[1\]"):
        get_rule("add_n").infer_forward([T(M22, [8, 8], [-1, -1]), T(M22, [8, 4], [-1, -1])])


def test_add_n_nonlinear_partial_cleared() -> None:
    """scan-add-n-partial-types: a common MAX partial status is not kept (a sum of maxima is not the
    maximum of sums); Paddle keeps any common status (its binding only sets SUM, so no golden line)."""
    xs = [T(M22, [4, 4], [0, -1], {1: "max"}), T(M22, [4, 4], [0, -1], {1: "max"})]
    res = get_rule("add_n").infer_forward(xs)
    assert not res.outputs[0].partial and not any(a.partial for a in res.inputs[0])
    case = {"rule": "add_n", "mesh": [2, 2], "mode": "forward",
            "args": [[J([4, 4], [0, -1], {"1": "max"}), J([4, 4], [0, -1], {"1": "max"})]]}
    paddle = {"inputs": [[{"dims_mapping": [0, -1], "partial": {"1": "max"}}] * 2],
              "outputs": [{"dims_mapping": [0, -1], "partial": {"1": "max"}}]}
    assert verify(None, case, result=paddle).status == UNSOUND
    avg = [T(M22, [4, 4], [0, -1], {1: "avg"})] * 2
    assert get_rule("add_n").infer_forward(avg).outputs[0].partial == ((1, ReduceType.AVG),)


def test_cumsum_grad_x_sharded_as_x_grad() -> None:
    """scan-cumsum-grad-x: Paddle returns x as given, but the kernel shapes x_grad by the local x."""
    res = get_rule("cumsum_grad").infer_forward(T(M22, [4, 6], [0, 1]), T(M22, [24], [0]), 0, True)
    assert dms(res.inputs) == [(-1, -1), (-1,)] and dms(res.outputs) == [(-1, -1)]
    res = get_rule("cumsum_grad").infer_forward(T(M22, [4, 6], [-1, -1]), T(M22, [4, 6], [0, 1]), 1)
    assert dms(res.inputs) == [(0, -1), (0, -1)] and dms(res.outputs) == [(0, -1)]


# ---------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "args", "exc", "words"),
    [
        ("triu", (T(M22, [8], [0]), 0), ShapeMismatchError, "x"),
        ("triu_grad", (T(M22, [8], [0]), 0), ShapeMismatchError, "out_grd"),
        ("cumsum", (T(M22, [8, 8], [0, -1]), 2), InvalidAttributeError, "axis"),
        ("argmax", (T(M22, [8, 8], [0, -1]), -3), InvalidAttributeError, "axis"),
        ("argmin", (T(M22, [], []), 1), InvalidAttributeError, "axis"),
        ("topk", (T(M22, [8, 8], [0, -1]), 9, 1), InvalidAttributeError, "k"),
        ("topk", (T(M22, [8, 8], [0, -1]), 0, 1), InvalidAttributeError, "k"),
        ("topk", (T(M22, [], []), 1, 0), ShapeMismatchError, "x"),
        ("logsumexp", (T(M22, [8, 8], [0, -1]), [2]), InvalidAttributeError, "axis"),
        ("add_n", ([],), InvalidArgumentError, "input"),
    ],
)
def test_errors(name: str, args: tuple[Any, ...], exc: type, words: str) -> None:
    with pytest.raises(exc) as e:
        get_rule(name).infer_forward(*args)
    msg = str(e.value)
    assert msg.startswith(name) and words in msg


def test_backward_errors() -> None:
    with pytest.raises(ShapeMismatchError, match="cumsum: out"):
        get_rule("cumsum").infer_backward(T(M22, [4, 6], [-1, -1]), T(M22, [4, 6], [-1, -1]), 0, True)
    with pytest.raises(ShapeMismatchError, match="argmax: out"):
        get_rule("argmax").infer_backward(T(M22, [4, 6], [-1, -1]), T(M22, [4, 6], [-1, -1]), 0, False)
    with pytest.raises(InvalidMeshError, match="triu: out lies on a different mesh than x"):
        get_rule("triu").infer_backward(T(M22, [4, 6], [-1, -1]), T(M4, [4, 6], [-1, -1]), 0)
    with pytest.raises(ShapeMismatchError, match="topk_grad: out_grad"):
        get_rule("topk_grad").infer_forward(T(M22, [8, 8], [-1, -1]), T(M22, [8, 2], [-1, -1]),
                                            T(M22, [7, 2], [-1, -1]), 2, 1)
    with pytest.raises(SpmdError):
        get_rule("logsumexp_grad").infer_forward(T(M22, [8, 6], [-1, -1]), T(M22, [8], [-1]), T(M22, [6], [-1]), [1])
    # logsumexp and argmax check the axis before x's rank limit (26 letters); cumsum too
    big = T(M22, [2] * 27, [-1] * 27)
    for name, args in (("logsumexp", ([40],)), ("argmax", (40,)), ("cumsum", (40,))):
        with pytest.raises(InvalidAttributeError, match=f"{name}: axis 40 is out of range"):
            get_rule(name).infer_forward(big, *args)
    with pytest.raises(InvalidAttributeError, match="logsumexp: axis 40"):
        get_rule("logsumexp").infer_backward(big, T(M22, [2] * 27, [-1] * 27), [40])


# ---------------------------------------------------------------------------
# the references' grads are real gradients
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("axis", "flatten", "exclusive", "reverse"),
    [(0, False, False, False), (1, False, True, False), (-1, False, False, True), (0, False, True, True),
     (0, True, False, False), (0, True, True, True)],
)
def test_cumsum_grad_numeric(axis: int, flatten: bool, exclusive: bool, reverse: bool) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 4))
    attrs = {"axis": axis, "flatten": flatten, "exclusive": exclusive, "reverse": reverse}
    fwd = get_reference("cumsum")
    out = fwd.run({"x": x, **attrs}, _ctx())[0]
    g = rng.standard_normal(out.shape)
    want = _numeric_grad(lambda v: fwd.run({"x": v, **attrs}, _ctx())[0], x, g)
    got = get_reference("cumsum_grad").run({"x": x, "out_grad": g, **attrs}, _ctx())[0]
    assert np.allclose(got, want, atol=1e-5)


@pytest.mark.parametrize(("axis", "keep", "ra"), [([1], False, False), ([0, 2], True, False), ([], False, False),
                                                  ([0], False, True)])
def test_logsumexp_grad_numeric(axis: list[int], keep: bool, ra: bool) -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 4))
    attrs = {"axis": axis, "keepdims": keep, "reduce_all": ra}
    fwd = get_reference("logsumexp")
    out = fwd.run({"x": x, **attrs}, _ctx())[0]
    g = rng.standard_normal(out.shape)
    want = _numeric_grad(lambda v: fwd.run({"x": v, **attrs}, _ctx())[0], x, g)
    got = get_reference("logsumexp_grad").run({"x": x, "out": out, "out_grad": g, **attrs}, _ctx())[0]
    assert np.allclose(got, want, atol=1e-5)


@pytest.mark.parametrize(("axis", "largest"), [(0, True), (-1, False)])
def test_topk_grad_numeric(axis: int, largest: bool) -> None:
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 5))
    attrs = {"k": 2, "axis": axis, "largest": largest, "sorted": True}
    fwd = get_reference("topk")
    out, idx = fwd.run({"x": x, **attrs}, _ctx())
    g = rng.standard_normal(out.shape)
    want = _numeric_grad(lambda v: fwd.run({"x": v, **attrs}, _ctx())[0], x, g)
    got = get_reference("topk_grad").run({"x": x, "indices": idx, "out_grad": g, **attrs}, _ctx())[0]
    assert np.allclose(got, want, atol=1e-5)


@pytest.mark.parametrize(("fwd_name", "grad_name", "attrs", "gname"), [
    ("triu", "triu_grad", {"diagonal": 1}, "out_grd"),
    ("tril_triu", "tril_triu_grad", {"diagonal": -1, "lower": True}, "out_grad"),
    ("tril_triu", "tril_triu_grad", {"diagonal": 0, "lower": False}, "out_grad"),
])
def test_triu_grad_numeric(fwd_name: str, grad_name: str, attrs: dict[str, Any], gname: str) -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 4))
    g = rng.standard_normal(x.shape)
    fwd = get_reference(fwd_name)
    want = _numeric_grad(lambda v: fwd.run({"x": v, **attrs}, _ctx())[0], x, g)
    got = get_reference(grad_name).run({gname: g, **attrs}, _ctx())[0]
    assert np.allclose(got, want, atol=1e-5)


def test_add_n_grad_numeric() -> None:
    rng = np.random.default_rng(4)
    xs = [rng.standard_normal((2, 3)) for _ in range(3)]
    g = rng.standard_normal((2, 3))
    fwd = get_reference("add_n")
    grads = get_reference("add_n_grad").run({"inputs": xs, "out_grad": g}, _ctx())
    for i in range(3):
        def f(v: np.ndarray, i: int = i) -> np.ndarray:
            return np.asarray(fwd.run({"input": [v if j == i else xs[j] for j in range(3)]}, _ctx())[0])

        assert np.allclose(grads[i], _numeric_grad(f, xs[i], g), atol=1e-5)


# ---------------------------------------------------------------------------
# soundness over generated cases
# ---------------------------------------------------------------------------

RULES = ["triu", "tril_triu", "cumsum", "argmax", "argmin", "topk", "logsumexp", "add_n", "full_like",
         "empty_like", "ones_like", "zeros_like"]
GRADS = ["triu_grad", "tril_triu_grad", "cumsum_grad", "topk_grad", "logsumexp_grad", "add_n_grad"]


test_sound, test_grad_sound = soundness_tests(RULES, GRADS, 60, 7)
