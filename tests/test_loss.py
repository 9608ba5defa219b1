"""loss family (cross_entropy_with_softmax / softmax_with_cross_entropy, c_softmax_with_cross_entropy,
mean_all and the grads): Paddle's unit-test cases, hand-checked answers, deviations, errors,
numeric grads and soundness."""

# mypy: disable-error-code="union-attr,index,arg-type"
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from spmd_helpers import J, T, dms, soundness_tests
from spmd_helpers import global_ctx as _ctx
from spmd_helpers import numeric_grad as _numeric_grad
from spmdkit.core.dist_attr import ReduceType
from spmdkit.core.errors import InvalidAttributeError, InvalidMeshError, ShapeMismatchError, SpmdError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.ops import get_rule
from spmdkit.sim import SOUND, UNSOUND, verify
from spmdkit.sim.reference import get_reference

M2 = ProcessMesh([2])
M4 = ProcessMesh([4])
M22 = ProcessMesh([2, 2])
M23 = ProcessMesh([2, 3])
M24 = ProcessMesh([2, 4])
AVG = ReduceType.AVG

CE = "cross_entropy_with_softmax"
CS = "c_softmax_with_cross_entropy"
# soft_label, use_softmax, numeric_stable_mode, ignore_index, axis as in Paddle's test
CE_ATTRS = (False, True, True, -1, -1)


def R(dm: list[Any], partial: dict[str, str] | None = None) -> dict[str, Any]:
    return {"dims_mapping": dm, "partial": partial or {}}


def case(rule: str, mesh: list[int], mode: str, *args: Any) -> dict[str, Any]:
    return {"rule": rule, "mesh": mesh, "mode": mode, "args": list(args)}


# ---------------------------------------------------------------------------
# Paddle's own unit tests (test_cross_entropy_with_softmax_rule.py,
# test_c_softmax_with_cross_entropy_rule.py, test_mean_all_rule.py)
# ---------------------------------------------------------------------------

X = [8, 1024, 50304]
LABEL = [8, 1024, 1]


def test_paddle_ce_gpt_dp() -> None:
    res = get_rule(CE).infer_forward(T(M24, X, [1, -1, -1]), T(M24, LABEL, [-1, 0, -1]), *CE_ATTRS)
    assert dms(res.inputs) == [(1, 0, -1), (1, 0, -1)] and dms(res.outputs) == [(1, 0, -1), (1, 0, -1)]


def test_paddle_ce_normalized_axis() -> None:
    """axis 1 (of size 1024) unsharded, the last axis sharded: elementwise for this softmax."""
    res = get_rule(CE).infer_forward(T(M24, X, [1, -1, 0]), T(M24, [8, 1, 50304], [-1, -1, -1]),
                                     False, True, True, -1, 1)
    assert dms(res.inputs) == [(1, -1, 0), (1, -1, 0)] and dms(res.outputs) == [(1, -1, 0), (1, -1, 0)]


def test_paddle_ce_class_axis_cases() -> None:
    """Paddle's GPT MP / MP-DP cases keep the class axis sharded (loss-class-axis); its soft-label
    and axis-1 cases expect ValueError. spmdkit replicates the class axis in all four."""
    r = get_rule(CE)
    res = r.infer_forward(T(M24, X, [-1, -1, 0]), T(M24, LABEL, [-1, -1, -1]), *CE_ATTRS)
    assert dms(res.inputs) == [(-1, -1, -1)] * 2 and dms(res.outputs) == [(-1, -1, -1)] * 2
    res = r.infer_forward(T(M24, X, [-1, -1, 0]), T(M24, LABEL, [1, -1, -1]), *CE_ATTRS)
    assert dms(res.inputs) == [(1, -1, -1)] * 2 and dms(res.outputs) == [(1, -1, -1)] * 2
    res = r.infer_forward(T(M24, X, [-1, -1, 0]), T(M24, X, [1, -1, -1]), True, True, True, -1, -1)
    assert dms(res.inputs) == [(1, -1, -1)] * 2 and dms(res.outputs) == [(1, -1, -1)] * 2
    res = r.infer_forward(T(M24, X, [-1, 0, -1]), T(M24, [8, 1, 50304], [1, -1, -1]), False, True, True, -1, 1)
    assert dms(res.inputs) == [(1, -1, -1)] * 2 and dms(res.outputs) == [(1, -1, -1)] * 2


def test_paddle_c_softmax_cases() -> None:
    r = get_rule(CS)
    for x, lab in (([-1, -1, 1], [-1, -1, -1]), ([0, -1, 1], [0, -1, -1])):
        res = r.infer_forward(T(M22, [16, 128, 128], x), T(M22, [16, 128, 1], lab), -1, 0, 2)
        assert dms(res.inputs) == [tuple(x), tuple(lab)] and dms(res.outputs) == [tuple(x), tuple(lab)]
        assert not any(a.partial for a in res.outputs)


def test_paddle_mean_all_cases() -> None:
    r = get_rule("mean_all")
    res = r.infer_forward(T(M22, [4, 8], [0, -1]))
    assert dms(res.inputs) == [(0, -1)] and dms(res.outputs) == [()]
    assert res.outputs[0].partial == ((0, AVG),)
    res = r.infer_backward(T(M22, [4, 8], [1, 0]), T(M22, [], []))
    assert dms(res.inputs) == [(-1, -1), ()] and dms(res.outputs) == [(-1, -1)]


# ---------------------------------------------------------------------------
# hand-checked answers
# ---------------------------------------------------------------------------


def test_ce_batch_axes_merged() -> None:
    """Every row's softmax and loss are computed on its own rank: batch axes keep (and merge) their
    sharding, uneven included."""
    res = get_rule(CE).infer_forward(T(M24, [8, 6, 12], [0, -1, 1]), T(M24, [8, 6, 1], [-1, 1, -1]))
    assert dms(res.inputs) == [(0, 1, -1)] * 2 and dms(res.outputs) == [(0, 1, -1)] * 2
    res = get_rule(CE).infer_forward(T(M24, [5, 12], [1, -1]), T(M24, [5, 1], [-1, -1]))
    assert dms(res.outputs) == [(1, -1)] * 2
    assert verify(None, case(CE, [2, 4], "forward", J([5, 12], [1, -1]), J([5, 1], [-1, -1]),
                             False, True, True, -100, -1)).status == SOUND


def test_ce_axis_not_last() -> None:
    res = get_rule(CE).infer_forward(T(M24, [8, 6, 12], [0, 1, -1]), T(M24, [8, 1, 12], [-1, -1, -1]),
                                     False, True, True, -100, 1)
    assert dms(res.inputs) == [(0, -1, -1)] * 2 and dms(res.outputs) == [(0, -1, -1)] * 2


def test_ce_partial_inputs_resharded() -> None:
    """softmax and log are not linear: a partial x (or label) is resharded to replicated."""
    res = get_rule(CE).infer_forward(T(M22, [4, 6], [0, -1], [1]), T(M22, [4, 1], [-1, -1], [1]))
    assert not any(a.partial for a in res.inputs) and not any(a.partial for a in res.outputs)


def test_ce_reverse_from_outputs() -> None:
    res = get_rule(CE).infer_backward(T(M24, [8, 12], [-1, -1]), T(M24, [8, 1], [-1, -1]),
                                      T(M24, [8, 12], [-1, 1]), T(M24, [8, 1], [0, -1]))
    assert dms(res.inputs) == [(0, -1)] * 2 and dms(res.outputs) == [(0, -1)] * 2


def test_ce_grad_rule() -> None:
    """x_grad = softmax - one_hot(label), per row: batch axes merged, the class axis replicated."""
    res = get_rule("cross_entropy_with_softmax_grad").infer_forward(
        T(M24, [8, 1], [0, -1]), T(M24, [8, 12], [-1, 1]), T(M24, [8, 1], [-1, -1], [1])
    )
    assert dms(res.inputs) == [(0, -1)] * 3 and dms(res.outputs) == [(0, -1)]
    assert not any(a.partial for a in res.inputs)


def test_c_softmax_class_axis_stays_sharded() -> None:
    """c_softmax_with_cross_entropy all-reduces the max and the sum of exponentials over the ranks
    that share the class axis, so that axis may stay sharded; the loss is complete (not partial).
    The same answer is unsound for the plain kernel (the softmax would be local)."""
    res = get_rule(CS).infer_forward(T(M24, [8, 12], [0, 1]), T(M24, [8, 1], [-1, -1]), -100, 0, 4)
    assert dms(res.inputs) == [(0, 1), (0, -1)] and dms(res.outputs) == [(0, 1), (0, -1)]
    assert not res.outputs[1].partial
    assert verify(None, case(CS, [2, 4], "forward", J([8, 12], [0, 1]), J([8, 1], [-1, -1]), -100, 0, 4)).status == SOUND
    plain = case(CE, [2, 4], "forward", J([8, 12], [0, 1]), J([8, 1], [-1, -1]), False, True, True, -100, -1)
    sharded = {"inputs": [R([0, 1]), R([0, -1])], "outputs": [R([0, 1]), R([0, -1])]}
    assert verify(None, plain, result=sharded).status == UNSOUND


def test_c_softmax_grad_rule() -> None:
    """Each rank subtracts the one-hot of the labels in its own class range: x_grad as softmax."""
    res = get_rule("c_softmax_with_cross_entropy_grad").infer_forward(
        T(M24, [8, 12], [-1, 1]), T(M24, [8, 1], [0, -1]), T(M24, [8, 1], [-1, -1]), -100, 0, 4
    )
    assert dms(res.inputs) == [(0, 1), (0, -1), (0, -1)] and dms(res.outputs) == [(0, 1)]


def test_mean_all_partial_avg() -> None:
    """Equal-sized local means: the mean is their average, partial AVG over every mesh dim used."""
    res = get_rule("mean_all").infer_forward(T(M24, [4, 8], [0, 1]))
    assert dms(res.inputs) == [(0, 1)] and res.outputs[0].partial == ((0, AVG), (1, AVG))
    res = get_rule("mean_all").infer_forward(T(M24, [8, 3], [(0, 1), -1]))  # co-shard: largest mesh dim
    assert dms(res.inputs) == [(1, -1)] and res.outputs[0].partial == ((1, AVG),)
    res = get_rule("mean_all").infer_forward(T(M24, [], []))
    assert dms(res.inputs) == [()] and not res.outputs[0].partial


def test_mean_all_grad_replicated() -> None:
    """The grad kernel divides by the local element count: only a replicated x_grad is right."""
    res = get_rule("mean_all_grad").infer_forward(T(M24, [4, 8], [0, 1]), T(M24, [], [], [0]))
    assert dms(res.inputs) == [(-1, -1), ()] and dms(res.outputs) == [(-1, -1)]
    assert not any(a.partial for a in res.inputs)
    c = case("mean_all_grad", [2, 4], "forward", J([4, 8], [0, 1]), J([], []))
    sharded = {"inputs": [R([0, 1]), R([])], "outputs": [R([0, 1])]}
    assert verify(None, c, result=sharded).status == UNSOUND


# ---------------------------------------------------------------------------
# deviations (docs/deviations.md, loss-*); Paddle's answers from the oracle
# ---------------------------------------------------------------------------


def test_mean_all_uneven_dropped() -> None:
    """loss-mean-all-uneven (DESIGN class 7): Paddle answers AVG partial over uneven shards."""
    c = case("mean_all", [2], "forward", J([3, 4], [0, -1]))
    paddle = {"inputs": [R([0, -1])], "outputs": [R([], {"0": "avg"})]}
    assert verify(None, c, result=paddle).status == UNSOUND
    res = get_rule("mean_all").infer_forward(T(M2, [3, 4], [0, -1]))
    assert dms(res.inputs) == [(-1, -1)] and not res.outputs[0].partial
    assert verify(None, c).status == SOUND
    c = case("mean_all", [2, 3], "forward", J([4, 5], [0, 1]))
    paddle = {"inputs": [R([0, 1])], "outputs": [R([], {"0": "avg", "1": "avg"})]}
    assert verify(None, c, result=paddle).status == UNSOUND
    res = get_rule("mean_all").infer_forward(T(M23, [4, 5], [0, 1]))
    assert dms(res.inputs) == [(0, -1)] and res.outputs[0].partial == ((0, AVG),)
    assert verify(None, c).status == SOUND


def test_ce_class_axis_replicated() -> None:
    """loss-class-axis (DESIGN class 9): Paddle keeps the class axis sharded (a local softmax) or
    raises (soft label, axis not last, use_softmax=False); spmdkit replicates it."""
    c = case(CE, [2], "forward", J([4, 6], [-1, 0]), J([4, 1], [-1, -1]), False, True, True, -100, -1)
    paddle = {"inputs": [R([-1, 0]), R([-1, -1])], "outputs": [R([-1, 0]), R([-1, -1])]}
    assert verify(None, c, result=paddle).status == UNSOUND
    assert verify(None, c).status == SOUND
    r = get_rule(CE)
    for x, lab, attrs in (([4, 6], [4, 1], (False, True, True, -100, -1)),
                          ([4, 6], [4, 6], (True, True, True, -100, -1)),  # Paddle: ValueError (soft label)
                          ([4, 6], [4, 1], (False, False, True, -100, -1))):  # Paddle: ValueError (use_softmax)
        res = r.infer_forward(T(M2, x, [-1, 0]), T(M2, lab, [-1, -1]), *attrs)
        assert dms(res.inputs) == [(-1, -1)] * 2 and dms(res.outputs) == [(-1, -1)] * 2
    res = r.infer_forward(T(M2, [6, 4], [0, -1]), T(M2, [1, 4], [-1, -1]), False, True, True, -100, 0)
    assert dms(res.inputs) == [(-1, -1)] * 2  # Paddle: ValueError (axis not last)
    # the reverse rule keeps a sharded class axis of softmax_out too
    c = case(CE, [2], "backward", J([4, 6], [-1, -1]), J([4, 1], [-1, -1]), J([4, 6], [-1, 0]), J([4, 1], [-1, -1]),
             False, True, True, -100, -1)
    paddle = {"inputs": [R([-1, 0]), R([-1, -1])], "outputs": [R([-1, 0]), R([-1, -1])]}
    assert verify(None, c, result=paddle).status == UNSOUND
    res = r.infer_backward(T(M2, [4, 6], [-1, -1]), T(M2, [4, 1], [-1, -1]), T(M2, [4, 6], [-1, 0]),
                           T(M2, [4, 1], [-1, -1]))
    assert dms(res.inputs) == [(-1, -1)] * 2 and dms(res.outputs) == [(-1, -1)] * 2


def test_ce_no_softmax_mapping() -> None:
    """loss-no-softmax (DESIGN class 5): with use_softmax=False Paddle answers softmax a 0-length
    dims_mapping (forward) and fails in the reverse (basic_string::substr, or a crash)."""
    c = case(CE, [2], "forward", J([4, 6], [0, -1]), J([4, 1], [-1, -1]), False, False, True, -100, -1)
    paddle = {"inputs": [R([0, -1]), R([0, -1])], "outputs": [R([]), R([0, -1])]}
    assert verify(None, c, result=paddle).status == UNSOUND
    res = get_rule(CE).infer_forward(T(M2, [4, 6], [0, -1]), T(M2, [4, 1], [-1, -1]), False, False, True, -100, -1)
    assert dms(res.outputs) == [(0, -1), (0, -1)]
    assert verify(None, c).status == SOUND
    res = get_rule(CE).infer_backward(T(M2, [4, 6], [-1, -1]), T(M2, [4, 1], [-1, -1]), T(M2, [4, 6], [0, -1]),
                                      T(M2, [4, 1], [0, -1]), False, False, True, -100, -1)
    assert dms(res.inputs) == [(0, -1)] * 2 and dms(res.outputs) == [(0, -1)] * 2


def test_ce_reverse_no_partial() -> None:
    """loss-reverse-partial (DESIGN class 4): the reverse keeps a partial x or echoes a partial
    softmax_out that replicated inputs cannot produce."""
    c = case(CE, [2], "backward", J([4, 6], [-1, -1], [0]), J([4, 1], [-1, -1]), J([4, 6], [0, -1]),
             J([4, 1], [0, -1]), False, True, True, -100, -1)
    paddle = {"inputs": [R([0, -1], {"0": "sum"}), R([0, -1])], "outputs": [R([0, -1]), R([0, -1])]}
    assert verify(None, c, result=paddle).status == UNSOUND
    assert verify(None, c).status == SOUND
    c = case(CE, [2], "backward", J([4, 6], [-1, -1]), J([4, 1], [-1, -1]), J([4, 6], [-1, -1], [0]),
             J([4, 1], [-1, -1]), False, True, True, -100, -1)
    paddle = {"inputs": [R([-1, -1]), R([-1, -1])], "outputs": [R([-1, -1], {"0": "sum"}), R([-1, -1])]}
    assert verify(None, c, result=paddle).status == UNSOUND
    res = get_rule(CE).infer_backward(T(M2, [4, 6], [-1, -1]), T(M2, [4, 1], [-1, -1]),
                                      T(M2, [4, 6], [-1, -1], [0]), T(M2, [4, 1], [-1, -1]))
    assert not any(a.partial for a in (*res.inputs, *res.outputs))


def test_loss_mesh_conflict_resolved() -> None:
    """loss-mesh-conflict (DESIGN class 8): Paddle raises (Unimplemented: Tensor Axis[a] is Sharded
    by two different mesh dimension) where x and label shard the batch on different mesh dims."""
    for name, attrs in ((CE, (False, True, True, -100, -1)), (CS, (-100, 0, 2))):
        res = get_rule(name).infer_forward(T(M22, [4, 6], [0, -1]), T(M22, [4, 1], [1, -1]), *attrs)
        assert dms(res.inputs) == [(0, -1)] * 2 and dms(res.outputs) == [(0, -1)] * 2
        assert verify(None, case(name, [2, 2], "forward", J([4, 6], [0, -1]), J([4, 1], [1, -1]), *attrs)).status == SOUND
    res = get_rule(CE).infer_backward(T(M22, [4, 6], [-1, -1]), T(M22, [4, 1], [-1, -1]), T(M22, [4, 6], [0, -1]),
                                      T(M22, [4, 1], [1, -1]))
    assert dms(res.inputs) == [(0, -1)] * 2  # softmax_out, the larger tensor, keeps its sharding


def test_c_softmax_reverse() -> None:
    """loss-c-softmax-reverse: Paddle registers no reverse rule (NotFound); spmdkit infers x and
    label from softmax and loss."""
    res = get_rule(CS).infer_backward(T(M22, [4, 6], [-1, -1]), T(M22, [4, 1], [-1, -1]), T(M22, [4, 6], [0, 1]),
                                      T(M22, [4, 1], [0, -1], [1]), -100, 0, 2)
    assert dms(res.inputs) == [(0, 1), (0, -1)] and dms(res.outputs) == [(0, 1), (0, -1)]
    assert not any(a.partial for a in res.outputs)
    c = case(CS, [2, 2], "backward", J([4, 6], [-1, -1]), J([4, 1], [-1, -1]), J([4, 6], [0, 1]), J([4, 1], [0, -1]),
             -100, 0, 2)
    assert verify(None, c).status == SOUND


# ---------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "mode", "args", "exc", "words"),
    [
        (CE, "forward", (T(M22, [4, 6], [-1, -1]), T(M22, [4, 2], [-1, -1])), ShapeMismatchError, "label"),
        (CE, "forward", (T(M22, [4, 6], [-1, -1]), T(M22, [4], [-1])), ShapeMismatchError, "label"),
        (CE, "forward", (T(M22, [4, 6], [-1, -1]), T(M22, [4, 1], [-1, -1]), False, True, True, -100, 2),
         InvalidAttributeError, "axis"),
        (CE, "forward", (T(M22, [], []), T(M22, [], [])), ShapeMismatchError, "logits"),
        (CE, "forward", (T(M22, [4, 6], [-1, -1]), T(M22, [4, 6, 1], [-1, -1, -1]), True), ShapeMismatchError,
         "label"),
        (CE, "forward", (T(M22, [4, 6], [-1, -1]), T(M22, [4, 1], [-1, -1]), "x"), InvalidAttributeError,
         "soft_label"),
        (CE, "backward",
         (T(M22, [4, 6], [-1, -1]), T(M22, [4, 1], [-1, -1]), T(M22, [4, 6], [-1, -1]), T(M22, [4, 6], [-1, -1])),
         ShapeMismatchError, "loss"),
        ("cross_entropy_with_softmax_grad", "forward",
         (T(M22, [4, 1], [-1, -1]), T(M22, [4, 6], [-1, -1]), T(M22, [4, 3], [-1, -1])), ShapeMismatchError,
         "loss_grad"),
        (CS, "forward", (T(M22, [4, 6], [-1, -1]), T(M22, [4, 2], [-1, -1])), ShapeMismatchError, "label"),
        (CS, "forward", (T(M22, [4, 6], [-1, -1]), T(M22, [4, 1], [-1, -1]), -100, 0, 0), InvalidAttributeError,
         "nranks"),
        (CS, "forward", (T(M22, [], []), T(M22, [], [])), ShapeMismatchError, "logits"),
        (CS, "backward",
         (T(M22, [4, 6], [-1, -1]), T(M22, [4, 1], [-1, -1]), T(M22, [4, 6], [-1, -1]), T(M4, [4, 1], [-1, -1])),
         InvalidMeshError, "mesh"),
        ("c_softmax_with_cross_entropy_grad", "forward",
         (T(M22, [4, 6], [-1, -1]), T(M22, [4, 1], [-1, -1]), T(M22, [4, 2], [-1, -1])), ShapeMismatchError,
         "loss_grad"),
        ("mean_all_grad", "forward", (T(M22, [4, 6], [-1, -1]), T(M22, [2], [-1])), ShapeMismatchError, "out_grad"),
        ("mean_all", "backward", (T(M22, [4, 6], [-1, -1]), T(M4, [], [])), InvalidMeshError, "mesh"),
    ],
)
def test_errors(name: str, mode: str, args: tuple[Any, ...], exc: type, words: str) -> None:
    r = get_rule(name)
    with pytest.raises(exc) as e:
        (r.infer_forward if mode == "forward" else r.infer_backward)(*args)
    assert isinstance(e.value, SpmdError)
    msg = str(e.value)
    assert msg.startswith(name) and words in msg, msg


# ---------------------------------------------------------------------------
# the references' grads are real gradients
# ---------------------------------------------------------------------------


def _softmax(x: np.ndarray, ax: int) -> np.ndarray:
    e = np.exp(x - x.max(axis=ax, keepdims=True))
    return np.asarray(e / e.sum(axis=ax, keepdims=True))


@pytest.mark.parametrize(("soft", "use_softmax", "axis"), [
    (False, True, -1), (False, True, 0), (True, True, -1), (False, False, -1), (True, False, 1),
])
def test_ce_grad_numeric(soft: bool, use_softmax: bool, axis: int) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 4))
    ax = axis % 2
    if not use_softmax:
        x = _softmax(x, ax)  # the logits are probabilities then
    if soft:
        label = _softmax(rng.standard_normal((3, 4)), ax)
    else:
        shape = [3, 4]
        shape[ax] = 1
        label = rng.integers(0, 4 if ax == 1 else 3, size=shape)
        label.flat[0] = 7  # ignore_index: loss and grad 0
    attrs = {"soft_label": soft, "use_softmax": use_softmax, "numeric_stable_mode": True, "ignore_index": 7,
             "axis": axis}
    fwd = get_reference(CE)
    sm, loss = fwd.run({"x": x, "label": label, **attrs}, _ctx())
    g = rng.standard_normal(loss.shape)
    want = _numeric_grad(lambda v: fwd.run({"x": v, "label": label, **attrs}, _ctx())[1], x, g)
    got = get_reference("cross_entropy_with_softmax_grad").run(
        {"label": label, "softmax": sm, "loss_grad": g, **attrs}, _ctx())[0]
    assert np.allclose(got, want, atol=1e-5)


def test_c_softmax_grad_numeric() -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 5))
    label = np.array([[1], [4], [-100], [0]])
    attrs = {"ignore_index": -100, "rank": 0, "nranks": 1}
    fwd = get_reference(CS)
    sm, loss = fwd.run({"x": x, "label": label, **attrs}, _ctx())
    g = rng.standard_normal(loss.shape)
    want = _numeric_grad(lambda v: fwd.run({"x": v, "label": label, **attrs}, _ctx())[1], x, g)
    got = get_reference("c_softmax_with_cross_entropy_grad").run(
        {"softmax": sm, "label": label, "loss_grad": g, **attrs}, _ctx())[0]
    assert np.allclose(got, want, atol=1e-5)
    assert np.all(got[2] == 0)


def test_mean_all_grad_numeric() -> None:
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 4))
    g = np.asarray(rng.standard_normal())
    fwd = get_reference("mean_all")
    want = _numeric_grad(lambda v: np.asarray(fwd.run({"x": v}, _ctx())[0]), x, g)
    got = get_reference("mean_all_grad").run({"x": x, "out_grad": g}, _ctx())[0]
    assert np.allclose(got, want, atol=1e-6)


# ---------------------------------------------------------------------------
# soundness over generated cases
# ---------------------------------------------------------------------------

RULES = [CE, "softmax_with_cross_entropy", CS, "mean_all"]
GRADS = ["cross_entropy_with_softmax_grad", "c_softmax_with_cross_entropy_grad", "mean_all_grad"]


test_sound, test_grad_sound = soundness_tests(RULES, GRADS, 200, 7)
