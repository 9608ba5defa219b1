"""fused family: swiglu, fused_dropout_add and their grads.

Paddle's unit-test cases, hand-checked cases, the deviations from Paddle 3.3.1 (Paddle's
answer judged by the simulator), errors, the references' gradients against numeric
differentiation, and soundness over generated cases.
"""

# mypy: disable-error-code="union-attr,index,arg-type,operator"
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from spmd_helpers import R, T, dms
from spmdkit.core.dist_attr import ReduceType
from spmdkit.core.errors import InvalidAttributeError, InvalidMeshError, ShapeMismatchError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.ops import get_rule
from spmdkit.sim import SOUND, UNSOUND, verify, verify_rule
from spmdkit.sim.reference import Ctx, get_reference

M24 = ProcessMesh([2, 4])
M23 = ProcessMesh([2, 3])

SW = get_rule("swiglu")
SWG = get_rule("swiglu_grad")
FDA = get_rule("fused_dropout_add")
FDAG = get_rule("fused_dropout_add_grad")


# -- Paddle's unit tests (test_fused_dropout_add_rule.py) ----------------------------------------


def test_paddle_unit_test_fused_dropout_add() -> None:
    x, y = T(M24, [2, 4], [0, -1]), T(M24, [2, 4], [0, -1])
    r = FDA.infer_forward(x, y)
    assert dms(r.inputs) == [(0, -1), (0, -1)] and dms(r.outputs) == [(0, -1), (-1,)]
    r = FDA.infer_backward(x, y, T(M24, [2, 4], [0, -1]), T(M24, [2], [-1]))
    assert dms(r.inputs) == [(0, -1), (0, -1)] and dms(r.outputs) == [(0, -1), (-1,)]


# -- swiglu ---------------------------------------------------------------------------------------


def test_swiglu_llama_mlp() -> None:
    """gate and up projections [b, s, ffn] with ffn on tp: all stay sharded alike, nothing partial."""
    x, y = T(M24, [4, 16, 64], [0, -1, 1]), T(M24, [4, 16, 64], [0, -1, 1])
    r = SW.infer_forward(x, y)
    assert dms(r.inputs) == [(0, -1, 1)] * 2 and dms(r.outputs) == [(0, -1, 1)]
    g = SWG.infer_forward(x, y, T(M24, [4, 16, 64], [0, -1, 1]))
    assert dms(g.inputs) == [(0, -1, 1)] * 3 and dms(g.outputs) == [(0, -1, 1)] * 2
    assert all(not a.partial for a in (*g.inputs, *g.outputs))


def test_swiglu_binary_merge() -> None:
    """x's axes claim first; y fills axes x leaves replicated; a co-shard keeps its largest dim."""
    r = SW.infer_forward(T(M24, [4, 8], [0, -1]), T(M24, [4, 8], [-1, 1]))
    assert dms(r.outputs) == [(0, 1)]
    r = SW.infer_forward(T(M24, [8, 8], [[0, 1], -1]), T(M24, [8, 8], [-1, -1]))
    assert dms(r.outputs) == [(1, -1)]
    r = SW.infer_forward(T(M24, [1, 8], [0, -1]), T(M24, [1, 8], [-1, 0]))
    assert dms(r.outputs) == [(-1, -1)]  # a size-1 axis claims mesh dim 0 and shards nothing


def test_swiglu_partial_cleared() -> None:
    r = SW.infer_forward(T(M24, [4, 8], [0, -1], [1]), T(M24, [4, 8], [0, -1]))
    assert all(not a.partial for a in (*r.inputs, *r.outputs))


def test_swiglu_halved_axis() -> None:
    """swiglu-halved-axis (DESIGN class 6): without y, Paddle keeps x's last axis sharded, so each
    rank pairs the wrong halves; spmdkit replicates it (a mesh dim of size 1 may stay)."""
    case = {"rule": "swiglu", "mesh": [2, 2], "mode": "forward",
            "args": [{"shape": [6, 4], "dims_mapping": [-1, 0]}, None]}
    paddle = {"inputs": [R([-1, 0]), None], "outputs": [R([-1, 0])]}
    assert verify(None, case, result=paddle).status == UNSOUND
    v = verify(None, case)
    assert v.status == SOUND and dms(v.result.inputs) == [(-1, -1), None]
    r = SW.infer_forward(T(ProcessMesh([4, 1]), [18], [1]), None)
    assert dms(r.outputs) == [(1,)]
    # the other axes as Paddle's unary rule: uneven mesh dims dropped
    r = SW.infer_forward(T(M24, [9, 10], [0, -1]), None)
    assert dms(r.inputs) == [(-1, -1), None]
    r = SW.infer_forward(T(M24, [8, 10], [0, -1]), None)
    assert dms(r.inputs) == [(0, -1), None]
    r = SW.infer_backward(T(M24, [8, 10], [-1, -1]), None, T(M24, [8, 5], [0, 1]))
    assert dms(r.inputs) == [(0, -1), None] and dms(r.outputs) == [(0, -1)]
    g = SWG.infer_forward(T(M24, [8, 10], [-1, 1]), None, T(M24, [8, 5], [0, -1]))
    assert dms(g.inputs) == [(0, -1), None, (0, -1)] and dms(g.outputs) == [(0, -1), None]


def test_swiglu_two_mesh_dims_resolved() -> None:
    """swiglu-two-mesh-dims (DESIGN class 8): Paddle raises; x keeps its sharding."""
    r = SW.infer_forward(T(M24, [4, 8], [0, -1]), T(M24, [4, 8], [1, -1]))
    assert dms(r.inputs) == [(0, -1)] * 2


def test_swiglu_reverse_out() -> None:
    """swiglu-reverse-out (DESIGN class 4): Paddle returns out [0] on a size-1 axis with x, y
    replicated; spmdkit answers the out they produce."""
    case = {"rule": "swiglu", "mesh": [4], "mode": "backward",
            "args": [{"shape": [1], "dims_mapping": [-1]}, {"shape": [1], "dims_mapping": [-1]},
                     {"shape": [1], "dims_mapping": [0]}]}
    paddle = {"inputs": [R([-1]), R([-1])], "outputs": [R([0])]}
    assert verify(None, case, result=paddle).status == UNSOUND
    v = verify(None, case)
    assert v.status == SOUND and dms(v.result.outputs) == [(-1,)]


# -- fused_dropout_add ---------------------------------------------------------------------------


def test_fda_inputs_echoed() -> None:
    """fda-inputs-echoed (DESIGN class 6): Paddle returns x and y as given while out is merged."""
    case = {"rule": "fused_dropout_add", "mesh": [2], "mode": "forward",
            "args": [{"shape": [6, 6, 1, 9], "dims_mapping": [-1, 0, -1, -1]},
                     {"shape": [6, 6, 1, 9], "dims_mapping": [-1, -1, -1, -1], "partial": [0]}]}
    paddle = {"inputs": [R([-1, 0, -1, -1]), R([-1, -1, -1, -1], {"0": "sum"})],
              "outputs": [R([-1, 0, -1, -1]), R([-1])]}
    assert verify(None, case, result=paddle).status == UNSOUND
    v = verify(None, case)
    assert v.status == SOUND
    assert dms(v.result.inputs) == [(-1, 0, -1, -1)] * 2 and not v.result.inputs[1].partial


def test_fda_two_mesh_dims_resolved() -> None:
    """fda-two-mesh-dims (DESIGN class 8): Paddle raises; x keeps its sharding."""
    r = FDA.infer_forward(T(ProcessMesh([4, 4]), [7, 8], [0, -1]), T(ProcessMesh([4, 4]), [7, 8], [1, 0]))
    assert dms(r.inputs) == [(0, -1)] * 2


def test_fda_reverse_out() -> None:
    """fda-reverse-out (DESIGN class 4): Paddle echoes the requested seed_offset (sharded here)
    and keeps out sharded on a size-1 axis; spmdkit answers what x, y produce."""
    case = {"rule": "fused_dropout_add", "mesh": [4], "mode": "backward",
            "args": [{"shape": [8, 1, 9], "dims_mapping": [-1, -1, -1]},
                     {"shape": [8, 1, 9], "dims_mapping": [-1, -1, 0]},
                     {"shape": [8, 1, 9], "dims_mapping": [0, -1, -1]},
                     {"shape": [2], "dims_mapping": [0]}]}
    paddle = {"inputs": [R([0, -1, -1]), R([0, -1, -1])], "outputs": [R([0, -1, -1]), R([0])]}
    assert verify(None, case, result=paddle).status == UNSOUND
    v = verify(None, case)
    assert v.status == SOUND and dms(v.result.outputs) == [(0, -1, -1), (-1,)]
    r = FDA.infer_backward(T(M24, [1, 7, 3], [-1, -1, -1]), T(M24, [1, 7, 3], [-1, -1, -1]),
                           T(M24, [1, 7, 3], [0, -1, 1]), None)
    assert dms(r.outputs) == [(-1, -1, 1), None]


def test_fda_grad_partial() -> None:
    """The grad is out_grad times a non-negative mask: SUM / MAX partial stays, PROD does not."""
    og = T(M24, [4, 8], [0, -1], {1: "sum"})
    r = FDAG.infer_forward(T(M24, [2], [1]), og, 0.1, False, "upscale_in_train", False)
    assert dms(r.inputs) == [(-1,), (0, -1)] and dms(r.outputs) == [(0, -1)] * 2
    assert r.outputs[0].partial == ((1, ReduceType.SUM),)
    r = FDAG.infer_forward(None, T(M24, [4, 8], [0, -1], {1: "prod"}))
    assert not r.outputs[0].partial and not r.inputs[1].partial and r.inputs[0] is None


# -- errors ---------------------------------------------------------------------------------------


def test_errors() -> None:
    with pytest.raises(ShapeMismatchError, match=r"swiglu: x and y differ on axis 1"):
        SW.infer_forward(T(M24, [4, 8], [-1, -1]), T(M24, [4, 6], [-1, -1]))
    with pytest.raises(ShapeMismatchError, match=r"swiglu: without y, x's last axis \(7\) must be even"):
        SW.infer_forward(T(M24, [4, 7], [-1, -1]), None)
    with pytest.raises(ShapeMismatchError, match=r"swiglu: x must be at least 1-D, got shape \[\]"):
        SW.infer_forward(T(M24, [], []), None)
    with pytest.raises(ShapeMismatchError, match=r"swiglu: out axis 1 has size 8, but x with its last axis halved"):
        SW.infer_backward(T(M24, [4, 8], [-1, -1]), None, T(M24, [4, 8], [-1, -1]))
    with pytest.raises(ShapeMismatchError, match=r"swiglu_grad: out_grad axis 1 has size 8, but x with its"):
        SWG.infer_forward(T(M24, [4, 8], [-1, -1]), None, T(M24, [4, 8], [-1, -1]))
    with pytest.raises(InvalidMeshError, match=r"swiglu: y lies on a different mesh than x"):
        SW.infer_forward(T(M24, [4, 8], [-1, -1]), T(M23, [4, 8], [-1, -1]))
    with pytest.raises(ShapeMismatchError, match=r"fused_dropout_add: y has shape \[1, 8\], x has \[4, 8\]"):
        FDA.infer_forward(T(M24, [4, 8], [-1, -1]), T(M24, [1, 8], [-1, -1]))
    with pytest.raises(ShapeMismatchError, match=r"fused_dropout_add: seed_offset"):
        FDA.infer_backward(T(M24, [4], [-1]), T(M24, [4], [-1]), T(M24, [4], [-1]), T(M24, [2, 1], [-1, -1]))
    with pytest.raises(InvalidAttributeError, match=r"fused_dropout_add_grad: needs .*0 <= p <= 1, got p = 1.5"):
        FDAG.infer_forward(None, T(M24, [4], [-1]), 1.5)
    with pytest.raises(InvalidAttributeError, match=r"fused_dropout_add_grad: needs mode in"):
        FDAG.infer_forward(None, T(M24, [4], [-1]), 0.1, False, "bogus")


# -- the references' gradients ------------------------------------------------------------------


def _num_grad(f: Any, x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    g = np.zeros_like(x)
    it = np.nditer(x, flags=["multi_index"])
    for _ in it:
        i = it.multi_index
        xp, xm = x.copy(), x.copy()
        xp[i] += eps
        xm[i] -= eps
        g[i] = (f(xp) - f(xm)) / (2 * eps)
    return g


@pytest.mark.parametrize("with_y", [True, False])
def test_swiglu_grad_is_the_gradient(with_y: bool) -> None:
    rng = np.random.default_rng(0)
    fwd, bwd = get_reference("swiglu"), get_reference("swiglu_grad")
    ctx = Ctx(M24)
    x = rng.standard_normal((3, 4))
    y = rng.standard_normal((3, 4)) if with_y else None
    og = rng.standard_normal((3, 4) if with_y else (3, 2))
    dx, dy = bwd.run({"x": x, "y": y, "out_grad": og}, ctx)
    assert np.allclose(dx, _num_grad(lambda t: float((fwd.run({"x": t, "y": y}, ctx)[0] * og).sum()), x), atol=1e-6)
    if with_y:
        assert np.allclose(dy, _num_grad(lambda t: float((fwd.run({"x": x, "y": t}, ctx)[0] * og).sum()), y),
                           atol=1e-6)
    else:
        assert dy is None


def test_fused_dropout_add_grad_is_the_gradient() -> None:
    fwd, bwd = get_reference("fused_dropout_add"), get_reference("fused_dropout_add_grad")
    ctx = Ctx(M24)
    rng = np.random.default_rng(1)
    x, y, og = (rng.standard_normal((2, 3)) for _ in range(3))
    dx, dy = bwd.run({"out_grad": og, "p": 0.0}, ctx)
    assert np.allclose(dx, _num_grad(lambda t: float((fwd.run({"x": t, "y": y}, ctx)[0] * og).sum()), x))
    assert np.allclose(dy, _num_grad(lambda t: float((fwd.run({"x": x, "y": t}, ctx)[0] * og).sum()), y))


# -- soundness over generated cases ---------------------------------------------------------------


@pytest.mark.parametrize(("rule", "mode"), [
    ("swiglu", "forward"), ("swiglu", "backward"), ("swiglu_grad", "forward"),
    ("fused_dropout_add", "forward"), ("fused_dropout_add", "backward"), ("fused_dropout_add_grad", "forward"),
])  # fmt: skip
def test_sound_on_generated_cases(rule: str, mode: str) -> None:
    rep = verify_rule(rule, n=200, seed=7, mode=mode)
    assert rep.cases == 200 and rep.skipped == 0, rep.first_skipped
    assert rep.unsound == 0, rep.first_unsound


# ---------------------------------------------------------------------------
# a 0-D optional tensor (shape []) is how Paddle's callers pass an absent one
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(("rule", "mode", "slots"), [
    ("swiglu", "forward", ["y"]),
    ("swiglu", "backward", ["y"]),
    ("swiglu_grad", "forward", ["y"]),
    ("fused_dropout_add_grad", "forward", ["seed_offset"]),
])
def test_zero_d_optional_is_absent(rule: str, mode: str, slots: list[str]) -> None:
    from spmd_helpers import assert_0d_is_absent

    assert_0d_is_absent(rule, mode, 13, slots, n=20)

