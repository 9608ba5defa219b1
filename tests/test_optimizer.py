"""Optimizer updates (adam, adamw, sgd): hand-checked against Paddle's AdamInferSpmdDynamic /
SgdInferSpmd logic (paddle/phi/infermeta/spmd_rules/optimizer.cc; these rules are not
registered in Paddle 3.3.1 under these names, so there is no oracle and no Paddle unit test),
deviations, errors, the references and soundness."""

# mypy: disable-error-code="union-attr,index,arg-type"
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from spmd_helpers import J, T, assert_sound, dms
from spmd_helpers import global_ctx as _ctx
from spmdkit.core.errors import InvalidArgumentError, ShapeMismatchError, SpmdError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.ops import get_rule
from spmdkit.sim import SOUND, UNSOUND, verify
from spmdkit.sim.reference import get_reference

M = ProcessMesh([2, 2])
SHAPE = [4, 6]


def s(dm: list[Any], partial: Any = None) -> Any:
    return T(M, SHAPE, dm, partial)


def one(dm: list[Any] | None = None) -> Any:
    return T(M, [1], dm or [-1])


def _adam(name: str, param: Any, grad: Any, m1: Any, m2: Any, *, lr: Any = None, m2max: Any = None,
          b1p: Any = None, b2p: Any = None, master: Any = None, skip: Any = None, amsgrad: bool = False) -> Any:
    args = (param, grad, lr or one(), m1, m2, m2max, b1p or one(), b2p or one(), master, skip)
    if name == "adam":
        return get_rule(name).infer_forward(*args, 0.9, 0.999, 1e-8, False, 1000, False, False, amsgrad)
    return get_rule(name).infer_forward(*args, 0.9, 0.999, 1e-8, 1.0, 0.01, False, False, 1000, False, False, amsgrad)


def _pt(a: Any) -> dict[int, str]:
    return {d: str(t.value) for d, t in a.partial}


# ---------------------------------------------------------------------------
# hand-checked against Paddle's logic
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_adam_vote_where_paddle_agrees(name: str) -> None:
    # Paddle: param and grad merged elementwise ([0,1]), then per axis the mappings of param, grad,
    # moment1, moment2 vote: the unsharded ones abstain -> [0,1] for every state tensor
    r = _adam(name, s([0, 1]), s([0, 1]), s([0, -1]), s([-1, 1]))
    assert dms(r.inputs) == [(0, 1), (0, 1), (-1,), (0, 1), (0, 1), None, (-1,), (-1,), None, None]
    assert dms(r.outputs) == [(0, 1), (0, 1), (0, 1), None, (-1,), (-1,), None]
    # param [0,-1], grad [-1,0]: Paddle's elementwise merge gives [0,-1] to both (mesh dim 0 goes to
    # the first axis); spmdkit's vote drops the later claim of mesh dim 0 alike
    r = _adam(name, s([0, -1]), s([-1, 0]), s([-1, -1]), s([-1, -1]))
    assert dms(r.inputs)[:5] == [(0, -1), (0, -1), (-1,), (0, -1), (0, -1)]
    # moment1 and moment2 shard one axis on two different mesh dims: the axis is replicated
    r = _adam(name, s([-1, -1]), s([-1, -1]), s([0, -1]), s([1, -1]))
    assert dms(r.outputs)[:3] == [(-1, -1)] * 3
    # master_param does not vote, it takes the result
    r = _adam(name, s([0, 1]), s([0, 1]), s([-1, -1]), s([-1, -1]), master=s([1, 0]))
    assert r.inputs[8].dims_mapping == (0, 1) and r.outputs[6].dims_mapping == (0, 1)


def test_adam_amsgrad_moment2_max_votes() -> None:
    r = _adam("adam", s([-1, -1]), s([-1, -1]), s([-1, -1]), s([-1, -1]), m2max=s([0, 1]), amsgrad=True)
    assert dms(r.inputs)[:6] == [(0, 1)] * 2 + [(-1,)] + [(0, 1)] * 3
    assert r.outputs[3].dims_mapping == (0, 1)
    # without amsgrad moment2_max does not vote and has no output
    r = _adam("adam", s([-1, -1]), s([-1, -1]), s([-1, -1]), s([-1, -1]), m2max=s([0, 1]))
    assert r.inputs[5].dims_mapping == (-1, -1) and r.outputs[3] is None


def test_partial_grad_is_reduced_first() -> None:
    """As Paddle (the input dist attrs are copied without partial): a partial grad must be reduced
    before the update, which is not linear in grad."""
    r = _adam("adam", s([0, -1]), s([0, -1], {1: "sum"}), s([-1, -1]), s([-1, -1]))
    assert not r.inputs[1].partial and all(not a.partial for a in r.outputs if a is not None)
    r = get_rule("sgd").infer_forward(s([0, -1]), one(), s([-1, -1], {1: "sum"}), None)
    assert dms(r.inputs) == [(0, -1), (-1,), (0, -1), None] and not r.inputs[2].partial


def test_sgd_hand_checked() -> None:
    # SgdInferSpmd: param and grad merged elementwise, learning_rate replicated, master as param
    r = get_rule("sgd").infer_forward(s([0, -1]), one(), s([-1, 1]), s([-1, -1]))
    assert dms(r.inputs) == [(0, 1), (-1,), (0, 1), (0, 1)] and dms(r.outputs) == [(0, 1), (0, 1)]
    r = get_rule("sgd").infer_forward(s([0, -1]), one(), s([-1, 1]), None)
    assert dms(r.outputs) == [(0, 1), None]


def test_reverse_from_the_outputs() -> None:
    """spmdkit's own reverse (Paddle has none): the state inputs from the state outputs."""
    r = get_rule("adam").infer_backward(s([-1, -1]), s([-1, -1]), one(), s([-1, -1]), s([-1, -1]), None, one(),
                                        one(), None, None, s([0, 1]), s([0, -1]), s([-1, -1]), None, one(), one(),
                                        None)
    assert dms(r.inputs)[:5] == [(0, 1), (0, 1), (-1,), (0, 1), (0, 1)]
    assert dms(r.outputs) == [(0, 1), (0, 1), (0, 1), None, (-1,), (-1,), None]
    r = get_rule("sgd").infer_backward(s([-1, -1]), one(), s([-1, -1]), None, s([1, 0]), None)
    assert dms(r.inputs) == [(1, 0), (-1,), (1, 0), None] and dms(r.outputs) == [(1, 0), None]


# ---------------------------------------------------------------------------
# deviations
# ---------------------------------------------------------------------------


def _adam_case(param: Any, grad: Any, m1: Any, m2: Any, lr: Any = None, b1p: Any = None, skip: Any = None) -> Any:
    one_ = J([1], [-1])
    return {"rule": "adam", "mesh": [2, 2], "mode": "forward",
            "args": [param, grad, lr or one_, m1, m2, None, b1p or one_, one_, None, skip]}


def test_optimizer_scalars_replicated() -> None:
    """optimizer-scalars-replicated: Paddle keeps learning_rate / beta1_pow / beta2_pow as given,
    e.g. learning_rate [1] sharded [0]: a size-1 tensor split over mesh dim 0 (one rank holds
    it, the other an empty shard, yet every rank needs the value). spmdkit replicates them."""
    r = _adam("adam", s([0, -1]), s([0, -1]), s([-1, -1]), s([-1, -1]), lr=one([0]), b1p=one([1]), b2p=one([0]))
    assert dms(r.inputs)[2] == (-1,) and dms(r.inputs)[6:8] == [(-1,), (-1,)]
    assert dms(r.outputs)[4:6] == [(-1,), (-1,)]
    r = get_rule("sgd").infer_forward(s([0, -1]), one([1]), s([0, -1]), None)
    assert r.inputs[1].dims_mapping == (-1,)
    case = _adam_case(J(SHAPE, [0, -1]), J(SHAPE, [0, -1]), J(SHAPE, [-1, -1]), J(SHAPE, [-1, -1]),
                      lr=J([1], [0]))
    assert verify(None, case).status == SOUND


def test_optimizer_skip_update_replicated() -> None:
    """optimizer-skip-update: Paddle raises "skip_update should be replicated" on a sharded
    skip_update; spmdkit asks for it replicated."""
    r = _adam("adam", s([0, -1]), s([0, -1]), s([-1, -1]), s([-1, -1]), skip=one([0]))
    assert r.inputs[9].dims_mapping == (-1,) and not r.inputs[9].partial


def test_optimizer_two_mesh_dims_replicated() -> None:
    """optimizer-two-mesh-dims: param [0,-1], grad [1,-1]: Paddle's ElementwiseBinaryInferSpmd
    (the first step of AdamInferSpmdDynamic and SgdInferSpmd) raises "Tensor Axis[a] is Sharded
    by two different mesh dimension"; spmdkit replicates that axis on every state tensor."""
    r = _adam("adam", s([0, -1]), s([1, -1]), s([-1, -1]), s([-1, -1]))
    assert dms(r.inputs)[:2] == [(-1, -1), (-1, -1)] and dms(r.outputs)[:3] == [(-1, -1)] * 3
    r = get_rule("sgd").infer_forward(s([0, -1]), one(), s([1, -1]), s([-1, -1]))
    assert dms(r.inputs) == [(-1, -1), (-1,), (-1, -1), (-1, -1)]
    case = {"rule": "sgd", "mesh": [2, 2], "mode": "forward",
            "args": [J(SHAPE, [0, -1]), J([1], [-1]), J(SHAPE, [1, -1]), None]}
    assert verify(None, case).status == SOUND


def test_optimizer_repeated_mesh_dim() -> None:
    """optimizer-repeated-mesh-dim: param [0,-1], moment1 [-1,0]: Paddle's per-axis vote does not
    look across axes and answers [0,0] (mesh dim 0 on two axes: an illegal dims_mapping) for
    every state tensor; spmdkit keeps mesh dim 0 on the first axis: [0,-1]."""
    r = _adam("adam", s([0, -1]), s([-1, -1]), s([-1, 0]), s([-1, -1]))
    assert dms(r.inputs)[:5] == [(0, -1), (0, -1), (-1,), (0, -1), (0, -1)]
    one_ = {"dims_mapping": [-1], "partial": {}}
    bad = {"dims_mapping": [0, 0], "partial": {}}
    case = _adam_case(J(SHAPE, [0, -1]), J(SHAPE, [-1, -1]), J(SHAPE, [-1, 0]), J(SHAPE, [-1, -1]))
    paddle = {"inputs": [bad, bad, one_, bad, bad, None, one_, one_, None, None],
              "outputs": [bad, bad, bad, None, one_, one_, None]}
    assert verify(None, case, result=paddle).status == UNSOUND
    assert verify(None, case).status == SOUND


# ---------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------


def test_errors() -> None:
    with pytest.raises(ShapeMismatchError) as ei:
        _adam("adam", s([-1, -1]), T(M, [4, 5], [-1, -1]), s([-1, -1]), s([-1, -1]))
    assert str(ei.value).startswith("adam") and "grad" in str(ei.value)
    with pytest.raises(ShapeMismatchError) as ei:
        _adam("adamw", s([-1, -1]), s([-1, -1]), T(M, [4], [-1]), s([-1, -1]))
    assert str(ei.value).startswith("adamw") and "moment1" in str(ei.value)
    with pytest.raises(InvalidArgumentError) as ei2:
        _adam("adam", s([-1, -1]), s([-1, -1]), s([-1, -1]), s([-1, -1]), amsgrad=True)
    assert str(ei2.value).startswith("adam") and "moment2_max" in str(ei2.value)
    with pytest.raises(ShapeMismatchError) as ei:
        get_rule("sgd").infer_forward(s([-1, -1]), one(), s([-1, -1]), T(M, [6, 4], [-1, -1]))
    assert str(ei.value).startswith("sgd") and "master_param" in str(ei.value)
    with pytest.raises(SpmdError, match=r"sgd.*grad"):
        get_rule("sgd").infer_forward(s([-1, -1]), one(), T(M, [4, 6, 1], [-1, -1, -1]), None)


# ---------------------------------------------------------------------------
# references, soundness
# ---------------------------------------------------------------------------


def test_adam_reference_one_step() -> None:
    rng = np.random.default_rng(0)
    p, g, m1 = rng.standard_normal((3, 2)), rng.standard_normal((3, 2)), rng.standard_normal((3, 2))
    m2 = rng.uniform(0.5, 2.0, (3, 2))
    a = {"param": p, "grad": g, "learning_rate": np.array([0.1]), "moment1": m1, "moment2": m2,
         "beta1_pow": np.array([0.9]), "beta2_pow": np.array([0.999]), "beta1": 0.9, "beta2": 0.999,
         "epsilon": 1e-8}
    po, m1o, _, _, b1o, b2o, _ = get_reference("adam").run(a, _ctx())
    m1w, m2w = 0.9 * m1 + 0.1 * g, 0.999 * m2 + 0.001 * g * g
    lr_t = 0.1 * np.sqrt(1 - 0.999) / (1 - 0.9)
    np.testing.assert_allclose(po, p - lr_t * m1w / (np.sqrt(m2w) + 1e-8 * np.sqrt(1 - 0.999)), equal_nan=False)
    np.testing.assert_allclose(m1o, m1w, equal_nan=False)
    np.testing.assert_allclose(b1o, [0.81], equal_nan=False)
    np.testing.assert_allclose(b2o, [0.999 * 0.999], equal_nan=False)
    po, _ = get_reference("sgd").run({"param": p, "learning_rate": np.array([0.5]), "grad": g}, _ctx())
    np.testing.assert_allclose(po, p - 0.5 * g, equal_nan=False)


@pytest.mark.parametrize("name", ["adam", "adamw", "sgd"])
@pytest.mark.parametrize("mode", ["forward", "backward"])
def test_sound(name: str, mode: str) -> None:
    assert_sound(name, 200, 3, mode)
