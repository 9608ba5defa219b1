"""bmm, linear_v2, fused_gemm_epilogue, fused_linear_param_grad_add: hand-checked answers,
simulator references against numeric gradients, soundness over generated cases."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from spmdkit.core import DistTensorSpec, ProcessMesh
from spmdkit.core.errors import SpmdError
from spmdkit.rules import get_rule
from spmdkit.sim import get_reference, verify_rule
from spmdkit.sim.ops import Ctx

M = ProcessMesh([2, 2])


def T(shape: list[int], dm: list[Any], partial: Any = None) -> DistTensorSpec:
    return DistTensorSpec(shape, mesh=M, dims_mapping=dm, partial=partial)


def _num_grad(f: Any, x: np.ndarray, g: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    out = np.zeros_like(x)
    it = np.nditer(x, flags=["multi_index"])
    for _ in it:
        i = it.multi_index
        xp, xm = x.copy(), x.copy()
        xp[i] += eps
        xm[i] -= eps
        out[i] = ((f(xp) - f(xm)) * g).sum() / (2 * eps)
    return out


def _run(name: str, args: dict[str, Any]) -> tuple[Any, ...]:
    ref = get_reference(name)
    assert ref is not None
    return ref.run(args, Ctx(M))


def test_bmm_column_parallel_and_contraction_partial() -> None:
    r = get_rule("bmm").infer_forward(T([4, 8, 6], [0, -1, -1]), T([4, 6, 10], [-1, -1, 1]))
    assert r.outputs[0].dims_mapping == (0, -1, 1) and not r.outputs[0].partial
    r = get_rule("bmm").infer_forward(T([4, 8, 6], [-1, -1, 1]), T([4, 6, 10], [-1, 1, -1]))
    assert dict(r.outputs[0].partial) == {1: "sum"}
    with pytest.raises(SpmdError, match="bmm"):
        get_rule("bmm").infer_forward(T([8, 6], [-1, -1]), T([4, 6, 10], [-1, -1, -1]))


@pytest.mark.parametrize("tw", [False, True])
def test_linear_v2_grad_reference_is_the_gradient(tw: bool) -> None:
    rng = np.random.default_rng(0)
    x, w, b = rng.standard_normal((3, 4)), rng.standard_normal((5, 4) if tw else (4, 5)), rng.standard_normal(5)
    g = rng.standard_normal((3, 5))
    dx, dw, db = _run("linear_v2_grad", {"input": x, "weight": w, "bias": b, "out_grad": g, "transpose_weight": tw})

    def out(x_: Any = x, w_: Any = w, b_: Any = b) -> np.ndarray:
        return _run("linear_v2", {"input": x_, "weight": w_, "bias": b_, "transpose_weight": tw})[0]

    np.testing.assert_allclose(dx, _num_grad(lambda v: out(x_=v), x, g), rtol=1e-6)
    np.testing.assert_allclose(dw, _num_grad(lambda v: out(w_=v), w, g), rtol=1e-6)
    np.testing.assert_allclose(db, _num_grad(lambda v: out(b_=v), b, g), rtol=1e-6)


def test_gemm_and_bmm_grad_references_are_gradients() -> None:
    rng = np.random.default_rng(1)
    x, y, b, g = rng.standard_normal((4, 3)), rng.standard_normal((5, 4)), rng.standard_normal(5), \
        rng.standard_normal((3, 5))
    kw = {"trans_x": True, "trans_y": True}
    dx, dy, db = _run("fused_gemm_epilogue_grad", {"x": x, "y": y, "reserve_space": None, "out_grad": g, **kw})

    def out(x_: Any = x, y_: Any = y, b_: Any = b) -> np.ndarray:
        return _run("fused_gemm_epilogue", {"x": x_, "y": y_, "bias": b_, **kw})[0]

    np.testing.assert_allclose(dx, _num_grad(lambda v: out(x_=v), x, g), rtol=1e-6)
    np.testing.assert_allclose(dy, _num_grad(lambda v: out(y_=v), y, g), rtol=1e-6)
    np.testing.assert_allclose(db, _num_grad(lambda v: out(b_=v), b, g), rtol=1e-6)
    x3, y3, g3 = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 4, 5)), rng.standard_normal((2, 3, 5))
    bx, by = _run("bmm_grad", {"x": x3, "y": y3, "out_grad": g3})
    np.testing.assert_allclose(bx, _num_grad(lambda v: _run("bmm", {"x": v, "y": y3})[0], x3, g3), rtol=1e-6)
    np.testing.assert_allclose(by, _num_grad(lambda v: _run("bmm", {"x": x3, "y": v})[0], y3, g3), rtol=1e-6)


def test_fused_linear_param_grad_add_accumulates() -> None:
    rng = np.random.default_rng(2)
    x, d, dw, db = (rng.standard_normal(s) for s in ((2, 3, 4), (2, 3, 5), (4, 5), (5,)))
    w_out, b_out = _run("fused_linear_param_grad_add", {"x": x, "dout": d, "dweight": dw, "dbias": db,
                                                        "has_bias": True})
    np.testing.assert_allclose(w_out, dw + x.reshape(6, 4).T @ d.reshape(6, 5))
    np.testing.assert_allclose(b_out, db + d.reshape(6, 5).sum(0))


@pytest.mark.parametrize("name", ["bmm", "bmm_grad", "linear_v2", "linear_v2_grad", "fused_gemm_epilogue",
                                  "fused_gemm_epilogue_grad", "fused_linear_param_grad_add"])
def test_sound_on_generated_cases(name: str) -> None:
    for mode in get_rule(name).modes:
        rep = verify_rule(name, 150, 5, mode)
        assert rep.unsound == 0, rep.first_unsound
        assert rep.sound > 0
