"""moe_amp family (moe_combine, moe_gate_dispatch, c_softmax_with_multi_label_cross_entropy, numel,
check_finite_and_unscale, update_loss_scaling, coalesce_tensor and the grads): Paddle's unit-test
cases, hand-checked answers, deviations, errors, numeric grads, the communicating kernel and
soundness."""

# mypy: disable-error-code="union-attr,index,arg-type"
from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from spmd_helpers import J, T, assert_sound, dms
from spmd_helpers import global_ctx as _ctx
from spmd_helpers import numeric_grad as _numeric_grad
from spmdkit.core.dist_attr import ReduceType, TensorDistAttr
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
from spmdkit.sim.mesh import shard
from spmdkit.sim.reference import Ctx, get_reference

M2 = ProcessMesh([2])
M22 = ProcessMesh([2, 2])
M222 = ProcessMesh([2, 2, 2])
SUM, MAX = ReduceType.SUM, ReduceType.MAX

MC, MD = "moe_combine", "moe_gate_dispatch"
ML = "c_softmax_with_multi_label_cross_entropy"
CFU, ULS, CT = "check_finite_and_unscale", "update_loss_scaling", "coalesce_tensor"


def R(dm: list[Any], partial: dict[str, str] | None = None) -> dict[str, Any]:
    return {"dims_mapping": dm, "partial": partial or {}}


def case(rule: str, mesh: list[int], mode: str, *args: Any) -> dict[str, Any]:
    return {"rule": rule, "mesh": mesh, "mode": mode, "args": list(args)}


def pt(a: TensorDistAttr) -> dict[int, ReduceType]:
    return dict(a.partial)


# ---------------------------------------------------------------------------
# Paddle's own unit tests: test_c_softmax_with_multi_label_cross_entropy_rule.py and the C++
# moe_combine_spmd_rule_test.cc / moe_gate_dispatch_spmd_rule_test.cc (all also golden lines)
# ---------------------------------------------------------------------------

ML_X, ML_L = [16, 128, 128], [16, 128, 4]


@pytest.mark.parametrize(("dx", "dl"), [([-1, -1, 1], [-1, -1, -1]), ([0, -1, 1], [0, -1, -1])])
def test_paddle_ml_cases(dx: list[int], dl: list[int]) -> None:
    """llama MP and MP-DP: the class axis stays sharded; Paddle's test passes ring_id 0 where
    sum_multi_label_loss goes (so False: loss shaped as the label)."""
    res = get_rule(ML).infer_forward(T(M22, ML_X, dx), T(M22, ML_L, dl), T(M22, ML_L, dl), -1, False, 0, 2)
    assert dms(res.inputs) == [tuple(dx), tuple(dl), tuple(dl)]
    assert dms(res.outputs) == [tuple(dx), tuple(dl)] and not res.outputs[1].partial


S, H, K = 1024, 512, 2


def test_paddle_moe_combine_replicated() -> None:
    rule = get_rule(MC)
    res = rule.infer_forward(T(M222, [S * K, H], [-1, -1]), T(M222, [S, K], [-1, -1]), T(M222, [S, K], [-1, -1]))
    assert dms(res.inputs) == [(-1, -1)] * 3 and dms(res.outputs) == [(-1, -1)]
    res = rule.infer_backward(T(M222, [S * K, H], [-1, -1]), T(M222, [S, K], [-1, -1]), T(M222, [S, K], [-1, -1]),
                              T(M222, [S, H], [-1, -1]))
    assert dms(res.inputs) == [(-1, -1)] * 4 and dms(res.outputs) == [(-1, -1)] * 3


def test_paddle_moe_combine_mp() -> None:
    """Paddle's mp case: x rows [1, -1] -> Paddle keeps x row-sharded with the tokens; spmdkit
    gathers x whole (rows are picked by scatter_index) and shards the tokens (deviation)."""
    rule = get_rule(MC)
    res = rule.infer_forward(T(M222, [S * K, H], [1, -1]), T(M222, [S, K], [1, -1]), T(M222, [S, K], [-1, -1]))
    assert dms(res.inputs) == [(-1, -1), (1, -1), (1, -1)] and dms(res.outputs) == [(1, -1)]
    res = rule.infer_backward(T(M222, [S * K, H], [1, -1]), T(M222, [S, K], [1, -1]), T(M222, [S, K], [-1, -1]),
                              T(M222, [S, H], [1, -1]))
    assert dms(res.inputs) == [(-1, -1), (1, -1), (1, -1), (1, -1)]
    assert dms(res.outputs) == [(-1, -1), (1, -1), (1, -1)] and pt(res.outputs[0]) == {1: SUM}


def test_paddle_moe_gate_dispatch_cases() -> None:
    """Paddle's replicated and ep cases (3.3.1 interface: corr_bias absent, y / grad_y [E, C, H]).
    The replicated ones agree; in the ep ones spmdkit keeps the tokens replicated in the forward and
    the capacity axis of grad_y replicated in the grad (deviations)."""
    e, cap = 8, 1024
    rule = get_rule(MD)
    res = rule.infer_forward(T(M222, [S, H], [-1, -1]), T(M222, [S, 8], [-1, -1]), None, K, cap, True)
    assert dms(res.inputs) == [(-1, -1), (-1, -1), None]
    assert dms(res.outputs) == [(-1, -1, -1), (-1, -1), (-1, -1), (-1,), (-1, -1)]
    res = rule.infer_forward(T(M222, [S, H], [0, -1]), T(M222, [S, 8], [-1, -1]), None, K, cap, True)
    assert dms(res.inputs) == [(-1, -1), (-1, -1), None]
    assert dms(res.outputs) == [(-1, -1, -1), (-1, -1), (-1, -1), (-1,), (-1, -1)]
    shapes = ([S, K], [K, S], [S, K], [e, cap, H], [S, K])
    rep = [T(M222, s, [-1] * len(s)) for s in shapes]
    res = rule.infer_backward(*rep, K, cap, True)
    assert dms(res.inputs) == [(-1, -1), (-1, -1), (-1, -1), (-1, -1, -1), (-1, -1)]
    assert dms(res.outputs) == [(-1, -1), (-1, -1)]
    ep = [T(M222, s, d) for s, d in zip(shapes, ([0, -1], [-1, 0], [0, -1], [-1, 0, -1], [0, -1]))]
    res = rule.infer_backward(*ep, K, cap, True)
    assert dms(res.inputs) == [(0, -1), (-1, 0), (0, -1), (-1, -1, -1), (0, -1)]
    assert dms(res.outputs) == [(0, -1), (0, -1)]


# ---------------------------------------------------------------------------
# hand-checked answers
# ---------------------------------------------------------------------------


def test_combine_k_sharded_partial_on_its_mesh_dim() -> None:
    """k on mesh dim 0: y = sum over k is partial SUM over dim 0 (Paddle names dim 1); h is then
    replicated (Paddle's rule: k and h are not sharded together)."""
    res = get_rule(MC).infer_forward(T(M22, [16, 4], [-1, 1]), T(M22, [8, 2], [-1, 0]), T(M22, [8, 2], [-1, -1]))
    assert dms(res.inputs) == [(-1, -1), (-1, 0), (-1, 0)]
    assert res.outputs[0].dims_mapping == (-1, -1) and pt(res.outputs[0]) == {0: SUM}


def test_combine_hidden_axis_kept() -> None:
    res = get_rule(MC).infer_forward(T(M22, [16, 4], [0, 1]), T(M22, [8, 2], [0, -1]), T(M22, [8, 2], [-1, -1]))
    # x rows replicated; tokens on dim 0 (from combine_weights), hidden on dim 1
    assert dms(res.inputs) == [(-1, 1), (0, -1), (0, -1)] and dms(res.outputs) == [(0, 1)]
    assert not res.outputs[0].partial


def test_combine_grad_partials() -> None:
    """grad_x scatters the rows a rank holds: partial over the token dim; grad_combine_weights
    sums over h: partial over the hidden dim; k replicated; grad_scatter_index never partial."""
    res = get_rule("moe_combine_grad").infer_forward(
        T(M22, [16, 4], [-1, 1]), T(M22, [8, 2], [0, -1]), T(M22, [8, 2], [-1, -1]), T(M22, [8, 4], [0, 1]))
    assert dms(res.inputs) == [(-1, 1), (0, -1), (0, -1), (0, 1)]
    gx, gw, gsi = res.outputs
    assert gx.dims_mapping == (-1, 1) and pt(gx) == {0: SUM}
    assert gw.dims_mapping == (0, -1) and pt(gw) == {1: SUM}
    assert gsi.dims_mapping == (0, -1) and not gsi.partial
    res2 = get_rule(MC).infer_backward(
        T(M22, [16, 4], [-1, 1]), T(M22, [8, 2], [0, -1]), T(M22, [8, 2], [-1, -1]), T(M22, [8, 4], [0, 1]))
    assert res2 == res


def test_dispatch_only_hidden_axis_kept() -> None:
    res = get_rule(MD).infer_forward(T(M22, [8, 4], [0, 1]), T(M22, [8, 6], [0, -1]), T(M22, [6], [0]), 2, 4, True)
    assert dms(res.inputs) == [(-1, 1), (-1, -1), (-1,)]
    assert dms(res.outputs) == [(-1, -1, 1), (-1, -1), (-1, -1), (-1,), (-1, -1)]
    assert not any(a.partial for a in res.outputs)


def test_dispatch_grad_tokens_and_hidden() -> None:
    res = get_rule("moe_gate_dispatch_grad").infer_forward(
        T(M22, [8, 2], [0, 1]), T(M22, [2, 8], [-1, 0]), T(M22, [8, 2], [0, -1]), T(M22, [6, 4, 4], [0, -1, 1]),
        T(M22, [8, 2], [0, -1]), 2, 4, True)
    assert dms(res.inputs) == [(0, -1), (-1, 0), (0, -1), (-1, -1, 1), (0, -1)]
    assert dms(res.outputs) == [(0, 1), (0, -1)] and not any(a.partial for a in res.outputs)


def test_ml_loss_partial_over_label_axis() -> None:
    """Labels sharded on dim 0 and summed: each rank sums its own labels, the loss is partial SUM
    over dim 0; softmax is never partial; without the sum the loss is sharded as the labels."""
    args = (T(M22, [4, 8], [-1, 1]), T(M22, [4, 4], [-1, 0]), T(M22, [4, 4], [-1, -1]))
    res = get_rule(ML).infer_forward(*args, -100, True, 0, 2)
    assert dms(res.inputs) == [(-1, 1), (-1, 0), (-1, 0)]
    assert res.outputs[0].dims_mapping == (-1, 1) and not res.outputs[0].partial
    assert res.outputs[1].dims_mapping == (-1, -1) and pt(res.outputs[1]) == {0: SUM}
    res = get_rule(ML).infer_forward(*args, -100, False, 0, 2)
    assert dms(res.outputs) == [(-1, 1), (-1, 0)] and not res.outputs[1].partial


def test_ml_reverse_from_outputs() -> None:
    """Reverse: batch and class from softmax, the label axis from the (unsummed) loss."""
    res = get_rule(ML).infer_backward(T(M22, [4, 6, 8], [-1, -1, -1]), T(M22, [4, 6, 3], [-1, -1, -1]),
                                      T(M22, [4, 6, 3], [-1, -1, -1]), T(M22, [4, 6, 8], [0, -1, 1]),
                                      T(M22, [4, 6, 3], [-1, -1, -1]), -100, True, 0, 2)
    assert dms(res.inputs) == [(0, -1, 1), (0, -1, -1), (0, -1, -1)]
    assert dms(res.outputs) == [(0, -1, 1), (0, -1, -1)] and not res.outputs[1].partial
    res = get_rule(ML).infer_backward(T(M22, [4, 8], [-1, -1]), T(M22, [4, 3], [-1, -1]), T(M22, [4, 3], [-1, -1]),
                                      T(M22, [4, 8], [-1, -1]), T(M22, [4, 3], [-1, 0]), -100, False, 0, 2)
    assert dms(res.inputs) == [(-1, -1), (-1, 0), (-1, 0)] and dms(res.outputs) == [(-1, -1), (-1, 0)]


def test_ml_grad_label_axis_replicated() -> None:
    res = get_rule(f"{ML}_grad").infer_forward(T(M22, [4, 8], [0, 1]), T(M22, [4, 3], [-1, 1]),
                                               T(M22, [4, 3], [0, -1]), T(M22, [4, 1], [0, -1]), -100, True, 0, 2)
    assert dms(res.inputs) == [(0, 1), (0, -1), (0, -1), (0, -1)] and dms(res.outputs) == [(0, 1)]


def test_numel_partial_over_sharding_dims() -> None:
    """Local element counts add up to the global count (uneven shards included); x as given, its
    partial kept (numel reads no values)."""
    x = T(ProcessMesh([2, 2, 3]), [5, 7], [[0, 2], -1], partial={1: "sum"})
    res = get_rule("numel").infer_forward(x)
    assert res.inputs[0] == x.dist_attr
    assert res.outputs[0].dims_mapping == () and pt(res.outputs[0]) == {0: SUM, 2: SUM}
    res = get_rule("numel").infer_backward(T(M22, [4, 4], [0, 1]), T(M22, [], [], partial=[0]))
    assert dms(res.inputs) == [(-1, -1)] and dms(res.outputs) == [()] and not res.outputs[0].partial


def test_cfu_found_infinite_max() -> None:
    """One x and two: each keeps its sharding less partial; found_infinite partial MAX over every
    mesh dim sharding an x; scale replicated."""
    res = get_rule(CFU).infer_forward([T(M22, [4, 4], [0, -1], partial=[1])], T(M22, [1], [-1]))
    assert dms(res.inputs[0]) == [(0, -1)] and not res.inputs[0][0].partial
    assert dms(res.outputs[0]) == [(0, -1)] and pt(res.outputs[1]) == {0: MAX}
    res = get_rule(CFU).infer_forward([T(M22, [4], [1]), T(M22, [6, 2], [0, -1])], T(M22, [1], [0]))
    assert res.inputs[1].dims_mapping == (-1,) and pt(res.outputs[1]) == {0: MAX, 1: MAX}
    res = get_rule(CFU).infer_backward([T(M22, [4], [-1])], T(M22, [1], [-1]), [T(M22, [4], [1])],
                                       T(M22, [1], [-1]))
    assert dms(res.inputs[0]) == [(1,)] and pt(res.outputs[1]) == {1: MAX}


def test_uls_state_replicated() -> None:
    one = [1]
    res = get_rule(ULS).infer_forward([T(M22, [4, 4], [0, 1], partial=None)], T(M22, one, [0]),
                                      T(M22, one, [-1], partial=[1]), T(M22, one, [-1]), T(M22, one, [1]),
                                      1000, 2, 2.0, 0.5, False)
    assert dms(res.inputs[0]) == [(0, 1)]
    assert [a.dims_mapping for a in res.inputs[1:]] == [(-1,)] * 4 and not any(a.partial for a in res.inputs[1:])
    assert dms(res.outputs[0]) == [(0, 1)] and [a.dims_mapping for a in res.outputs[1:]] == [(-1,)] * 3


def test_coalesce_replicated() -> None:
    res = get_rule(CT).infer_forward([T(M22, [4, 4], [0, 1])], "float32", True)
    assert dms(res.inputs[0]) == [(-1, -1)] and dms(res.outputs[0]) == [(-1, -1)]
    assert res.outputs[1].dims_mapping == (-1,)


# ---------------------------------------------------------------------------
# deviations (docs/deviations.md moe-amp-*): Paddle's answer is unsound, spmdkit's is sound
# ---------------------------------------------------------------------------


def _both(c: dict[str, Any], paddle: dict[str, Any]) -> None:
    assert verify(None, c, result=paddle).status == UNSOUND
    assert verify(None, c).status == SOUND


def test_dev_combine_rows() -> None:
    """Paddle's mp answer (x rows sharded with the tokens) and its partial on mesh dim 1 for a k
    sharded on dim 0 are unsound."""
    c = case(MC, [2, 2], "forward", J([16, 4], [1, -1]), J([8, 2], [1, -1]), J([8, 2], [-1, -1]))
    _both(c, {"inputs": [R([1, -1]), R([1, -1]), R([1, -1])], "outputs": [R([1, -1])]})
    c = case(MC, [2, 2], "forward", J([16, 4], [-1, -1]), J([8, 2], [-1, 0]), J([8, 2], [-1, -1]))
    _both(c, {"inputs": [R([-1, -1]), R([-1, 0]), R([-1, 0])], "outputs": [R([-1, -1], {"1": "sum"})]})


def test_dev_combine_grad() -> None:
    c = case(MC, [2, 2], "backward", J([16, 4], [1, -1]), J([8, 2], [1, -1]), J([8, 2], [-1, -1]), J([8, 4], [1, -1]))
    _both(c, {"inputs": [R([1, -1])] * 4, "outputs": [R([1, -1])] * 3})
    c = case(MC, [2, 2], "backward", J([16, 4], [-1, 1]), J([8, 2], [-1, -1]), J([8, 2], [-1, -1]), J([8, 4], [-1, 1]))
    _both(c, {"inputs": [R([-1, 1]), R([-1, -1]), R([-1, -1]), R([-1, 1])],
              "outputs": [R([-1, 1]), R([-1, -1]), R([-1, -1])]})


def test_dev_dispatch_global() -> None:
    """Paddle's ep answer (tokens and the capacity axis of y sharded) and a sharded expert axis of
    gate_logits (top-k over a slice of the experts) are unsound."""
    c = case(MD, [2], "forward", J([8, 4], [0, -1]), J([8, 4], [-1, -1]), None, 2, 4, True)
    _both(c, {"inputs": [R([0, -1]), R([0, -1]), None],
              "outputs": [R([-1, 0, -1]), R([0, -1]), R([-1, 0]), R([-1]), R([0, -1])]})
    c = case(MD, [2], "forward", J([8, 4], [-1, -1]), J([8, 4], [-1, 0]), None, 2, 4, True)
    _both(c, {"inputs": [R([-1, -1]), R([-1, 0]), None],
              "outputs": [R([0, -1, -1]), R([-1, -1]), R([-1, -1]), R([0]), R([-1, -1])]})


def test_dev_dispatch_grad() -> None:
    c = case(MD, [2], "backward", J([8, 2], [0, -1]), J([2, 8], [-1, 0]), J([8, 2], [0, -1]), J([4, 4, 3], [-1, 0, -1]),
             J([8, 2], [0, -1]), 2, 4, True)
    _both(c, {"inputs": [R([0, -1]), R([-1, 0]), R([0, -1]), R([-1, 0, -1]), R([0, -1])],
              "outputs": [R([0, -1]), R([0, -1])]})


def test_dev_ml_loss_partial() -> None:
    c = case(ML, [2, 2], "forward", J([4, 8], [-1, 1]), J([4, 4], [-1, 0]), J([4, 4], [-1, -1]), -100, True, 0, 2)
    _both(c, {"inputs": [R([-1, 1]), R([-1, 0]), R([-1, 0])], "outputs": [R([-1, 1]), R([-1, -1])]})


def test_dev_ml_reverse() -> None:
    """Paddle has no reverse rule; spmdkit's answers the outputs its inputs produce."""
    c = case(ML, [2, 2], "backward", J([4, 8], [-1, -1]), J([4, 4], [-1, -1]), J([4, 4], [-1, -1]),
             J([4, 8], [0, 1]), J([4, 1], [-1, -1], [1]), -100, True, 0, 2)
    assert verify(None, c).status == SOUND
    res = get_rule(ML).infer_backward(T(M22, [4, 8], [-1, -1]), T(M22, [4, 4], [-1, -1]), T(M22, [4, 4], [-1, -1]),
                                      T(M22, [4, 8], [0, 1]), T(M22, [4, 1], [-1, -1], [1]), -100, True, 0, 2)
    assert dms(res.outputs) == [(0, 1), (0, -1)] and not res.outputs[1].partial


def test_dev_ml_grad() -> None:
    """Paddle's grad keeps the label axis sharded and answers x_grad as softmax: each rank would
    subtract only its own labels."""
    c = case(f"{ML}_grad", [2], "forward", J([4, 8], [-1, -1]), J([4, 4], [-1, 0]), J([4, 4], [-1, 0]),
             J([4, 1], [-1, -1]), -100, True, 0, 2)
    _both(c, {"inputs": [R([-1, -1]), R([-1, 0]), R([-1, 0]), R([-1, -1])], "outputs": [R([-1, -1])]})


def test_dev_amp_state() -> None:
    """Paddle keeps scale and the loss-scaling state as given (here partial / sharded)."""
    c = case(CFU, [2], "forward", [J([4, 3], [0, -1])], J([1], [-1], [0]))
    _both(c, {"inputs": [[R([0, -1])], R([-1], {"0": "sum"})], "outputs": [[R([0, -1])], R([-1], {"0": "max"})]})
    c = case(ULS, [2], "forward", [J([4, 3], [-1, -1])], J([1], [-1]), J([1], [-1], [0]), J([1], [-1]), J([1], [-1]),
             1, 2, 2.0, 0.5, False)
    _both(c, {"inputs": [[R([-1, -1])], R([-1]), R([-1], {"0": "sum"}), R([-1]), R([-1])],
              "outputs": [[R([-1, -1])], R([-1]), R([-1]), R([-1])]})


def test_dev_coalesce_replicated() -> None:
    c = case(CT, [2], "forward", [J([4, 3], [0, -1]), J([5], [-1])], "float32", True, False, False, 0.0, True, 16, 4)
    _both(c, {"inputs": [[R([0, -1]), R([-1])]], "outputs": [[R([0, -1]), R([-1])], R([-1])]})


def test_dev_paddle_errors() -> None:
    """Paddle raises where two tensors shard the token axis on different mesh dims, or where its fixed
    partial mesh dim 1 already shards an axis; spmdkit resolves both soundly."""
    c = case(MC, [2, 2], "forward", J([16, 4], [-1, -1]), J([8, 2], [0, -1]), J([8, 2], [1, -1]))
    assert verify(None, c).status == SOUND
    c = case(MC, [2, 2], "forward", J([16, 4], [-1, -1]), J([8, 2], [1, 0]), J([8, 2], [-1, -1]))
    assert verify(None, c).status == SOUND
    res = get_rule(MC).infer_forward(T(M22, [16, 4], [-1, -1]), T(M22, [8, 2], [1, 0]), T(M22, [8, 2], [-1, -1]))
    assert res.outputs[0].dims_mapping == (1, -1) and pt(res.outputs[0]) == {0: SUM}


# ---------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------

ONE = [1]
ERRORS = [
    (MC, "forward", (T(M22, [4, 4, 4], [-1, -1, -1]), T(M22, [4, 2], [-1, -1]), T(M22, [4, 2], [-1, -1])),
     ShapeMismatchError, "x"),
    (MC, "forward", (T(M22, [8, 4], [-1, -1]), T(M22, [4, 2], [-1, -1]), T(M22, [4, 3], [-1, -1])),
     ShapeMismatchError, "scatter_index"),
    ("moe_combine_grad", "forward", (T(M22, [8, 4], [-1, -1]), T(M22, [4, 2], [-1, -1]), T(M22, [4, 2], [-1, -1]),
                                     T(M22, [4], [-1])), ShapeMismatchError, "grad_y"),
    (MD, "forward", (T(M22, [8, 4], [-1, -1]), T(M22, [8, 3], [-1, -1]), None, 4, 4, True),
     InvalidAttributeError, "k"),
    (MD, "forward", (T(M22, [8, 4], [-1, -1]), T(M22, [8, 3], [-1, -1]), T(M22, [4], [-1]), 2, 4, True),
     ShapeMismatchError, "corr_bias"),
    (MD, "forward", (T(M22, [8, 4], [-1, -1]), T(M22, [8, 3], [-1, -1]), None, 2, -1, True),
     InvalidAttributeError, "capacity"),
    (MD, "backward", (T(M22, [8, 2], [-1, -1]), T(M22, [2, 8], [-1, -1]), T(M22, [8, 2], [-1, -1]),
                      T(M22, [8, 4], [-1, -1]), T(M22, [8, 2], [-1, -1]), 2, 4, True), ShapeMismatchError, "grad_y"),
    (ML, "forward", (T(M22, [4, 8], [-1, -1]), T(M22, [4], [-1]), T(M22, [4, 2], [-1, -1]), -100, True, 0, 2),
     ShapeMismatchError, "label"),
    (ML, "forward", (T(M22, [4, 8], [-1, -1]), T(M22, [4, 2], [-1, -1]), T(M22, [4, 2], [-1, -1]), -100, True, 0, 0),
     InvalidAttributeError, "nranks"),
    (ML, "forward", (T(M22, [4, 8], [-1, -1]), T(M22, [5, 2], [-1, -1]), T(M22, [5, 2], [-1, -1]), -100, True, 0, 2),
     ShapeMismatchError, "label"),
    (f"{ML}_grad", "forward", (T(M22, [4, 8], [-1, -1]), T(M22, [4, 2], [-1, -1]), T(M22, [4, 2], [-1, -1]),
                               T(M22, [4], [-1]), -100, True, 0, 2), ShapeMismatchError, "loss_grad"),
    ("numel", "backward", (T(M22, [4], [-1]), T(M22, [2], [-1])), ShapeMismatchError, "out"),
    (CFU, "forward", ([T(M22, [4], [-1])], T(M22, [2], [-1])), ShapeMismatchError, "scale"),
    (CFU, "forward", ([], T(M22, [1], [-1])), InvalidArgumentError, "xs"),
    (CFU, "forward", ([T(M22, [4], [-1])], T(M2, [1], [-1])), InvalidMeshError, "scale"),
    (ULS, "forward", ([T(M22, [4], [-1])], T(M22, ONE, [-1]), T(M22, [3], [-1]), T(M22, ONE, [-1]),
                      T(M22, ONE, [-1]), 1, 2, 2.0, 0.5), ShapeMismatchError, "prev_loss_scaling"),
    (ULS, "forward", ([T(M22, [4], [-1])], T(M22, ONE, [-1]), T(M22, ONE, [-1]), T(M22, ONE, [-1]),
                      T(M22, ONE, [-1]), 1, 2, "x", 0.5), InvalidAttributeError, "incr_ratio"),
    (CT, "forward", ([],), InvalidArgumentError, "input"),
    (CT, "forward", ([T(M22, [4], [-1])], None), InvalidAttributeError, "dtype"),
    # attributes the signature types: the registry rejects them before the rule runs
    (CT, "forward", ([T(M22, [4], [-1])], "float32", "yes"), InvalidAttributeError, "copy_data"),
    (CT, "backward", ([T(M22, [4], [-1])], [T(M22, [4], [-1])], T(M22, [4], [-1]), "float32", False, False, False,
                      0.0, True, True), InvalidAttributeError, "align_size"),
    (ULS, "forward", ([T(M22, [4], [-1])], T(M22, ONE, [-1]), T(M22, ONE, [-1]), T(M22, ONE, [-1]),
                      T(M22, ONE, [-1]), 1.5, 2, 2.0, 0.5), InvalidAttributeError, "incr_every_n_steps"),
    (ULS, "forward", ([T(M22, [4], [-1])], T(M22, ONE, [-1]), T(M22, ONE, [-1]), T(M22, ONE, [-1]),
                      T(M22, ONE, [-1]), 1, 2, 2.0, 0.5, "no"), InvalidAttributeError, "stop_update"),
    (MD, "forward", (T(M22, [8, 4], [-1, -1]), T(M22, [8, 3], [-1, -1]), None, True, 4, True),
     InvalidAttributeError, "k"),
    (MD, "forward", (T(M22, [8, 4], [-1, -1]), T(M22, [8, 3], [-1, -1]), None, 2, 4, 2),
     InvalidAttributeError, "use_pad"),
    (MD, "backward", (T(M22, [8, 2], [-1, -1]), T(M22, [2, 8], [-1, -1]), T(M22, [8, 2], [-1, -1]),
                      T(M22, [8, 4, 4], [-1, -1, -1]), T(M22, [8, 2], [-1, -1]), 0, 4, True),
     InvalidAttributeError, "k"),
    (CT, "backward", ([T(M22, [4], [-1])], [T(M22, [4], [-1])], T(M22, [4, 1], [-1, -1])),
     ShapeMismatchError, "fused_output"),
]


@pytest.mark.parametrize(("name", "mode", "args", "exc", "word"), ERRORS,
                         ids=[f"{e[0]}-{e[1]}-{e[4]}-{i}" for i, e in enumerate(ERRORS)])
def test_errors(name: str, mode: str, args: tuple[Any, ...], exc: type, word: str) -> None:
    with pytest.raises(exc) as info:
        get_rule(name).infer(mode, *args)
    assert isinstance(info.value, SpmdError)
    msg = str(info.value)
    assert name.removesuffix("_grad") in msg and word in msg, msg


# ---------------------------------------------------------------------------
# references: real gradients (numeric differentiation), the communicating kernel
# ---------------------------------------------------------------------------


def test_combine_grad_numeric() -> None:
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((6, 3)), rng.standard_normal((4, 2))
    si = np.array([[0, 5], [2, 2], [1, 3], [4, 0]])
    gy = rng.standard_normal((4, 3))
    fwd, grad = get_reference(MC), get_reference("moe_combine_grad")
    gx, gw, gsi = grad.run({"x": x, "combine_weights": w, "scatter_index": si, "grad_y": gy}, _ctx())
    def f_x(v: np.ndarray) -> Any:
        return fwd.run({"x": v, "combine_weights": w, "scatter_index": si}, _ctx())[0]
    def f_w(v: np.ndarray) -> Any:
        return fwd.run({"x": x, "combine_weights": v, "scatter_index": si}, _ctx())[0]
    assert np.allclose(gx, _numeric_grad(f_x, x, gy), atol=1e-6)
    assert np.allclose(gw, _numeric_grad(f_w, w, gy), atol=1e-6)
    assert not gsi.any()


def test_dispatch_and_grad_numeric() -> None:
    rng = np.random.default_rng(1)
    s, h, e, k, cap = 6, 3, 4, 2, 2
    x, gl, cb = rng.standard_normal((s, h)), rng.uniform(0.5, 2.0, (s, e)), rng.standard_normal(e)
    fwd, grad = get_reference(MD), get_reference("moe_gate_dispatch_grad")
    attrs = {"k": k, "capacity": cap, "use_pad": True}
    y, cw, si, off, eid = fwd.run({"x": x, "gate_logits": gl, "corr_bias": cb, **attrs}, _ctx())
    # every assignment counted; those past an expert's capacity dropped (weight 0)
    assert y.shape == (e, cap, h) and off[-1] == s * k
    assert (cw == 0).sum() == sum(max(0, int(np.sum(eid == j)) - cap) for j in range(e))
    gy, gcw = rng.standard_normal(y.shape), rng.standard_normal(cw.shape)
    gx, ggl = grad.run({"combine_weights": cw, "scatter_index": si, "expert_id": eid, "grad_y": gy,
                        "grad_combine_weights": gcw, **attrs}, _ctx())
    def f_x(v: np.ndarray) -> Any:
        return fwd.run({"x": v, "gate_logits": gl, "corr_bias": cb, **attrs}, _ctx())[0]
    def f_gl(v: np.ndarray) -> Any:
        return fwd.run({"x": x, "gate_logits": v, "corr_bias": cb, **attrs}, _ctx())[1]
    assert np.allclose(gx, _numeric_grad(f_x, x, gy), atol=1e-6)
    assert np.allclose(ggl, _numeric_grad(f_gl, gl, gcw, h=1e-7), atol=1e-5)


@pytest.mark.parametrize("summed", [True, False])
def test_ml_grad_numeric(summed: bool) -> None:
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 5))
    label = np.array([[0, 4, -100], [2, 2, 1], [3, -100, 0]])
    w = rng.uniform(0.5, 2.0, label.shape)
    fwd, grad = get_reference(ML), get_reference(f"{ML}_grad")
    attrs = {"ignore_index": -100, "sum_multi_label_loss": summed}
    sm, loss = fwd.run({"x": x, "label": label, "smooth_weight": w, **attrs}, _ctx())
    g = rng.standard_normal(loss.shape)
    (gx,) = grad.run({"softmax": sm, "label": label, "smooth_weight": w, "loss_grad": g, **attrs}, _ctx())
    def f(v: np.ndarray) -> Any:
        return fwd.run({"x": v, "label": label, "smooth_weight": w, **attrs}, _ctx())[1]
    assert np.allclose(gx, _numeric_grad(f, x, g), atol=1e-6)


class _ThreadComm:
    """all_reduce over the groups of some mesh dims, every rank in its own thread."""

    def __init__(self, mesh: ProcessMesh) -> None:
        self.mesh = mesh
        self.barrier = threading.Barrier(mesh.size)
        self.slots: dict[int, np.ndarray] = {}

    def for_rank(self, rank: int) -> Any:
        comm = self

        class One:
            def all_reduce(self, a: np.ndarray, dims: tuple[int, ...], op: str) -> np.ndarray:
                comm.barrier.wait()
                comm.slots[rank] = np.asarray(a)
                comm.barrier.wait()
                me = comm.mesh.coords(rank)
                group = [r for r in range(comm.mesh.size)
                         if all(c == m for i, (c, m) in enumerate(zip(comm.mesh.coords(r), me)) if i not in dims)]
                vals = np.stack([comm.slots[r] for r in group])
                out = vals.max(axis=0) if op == "max" else vals.sum(axis=0)
                comm.barrier.wait()
                return out

        return One()


def test_ml_communicating_kernel() -> None:
    """The kernel as real ranks run it (max, sum and picked logits all-reduced over the class group)
    gives the same local softmax and loss as the simulator's gathered run."""
    mesh = M22
    rule = get_rule(ML)
    x, lab = T(mesh, [4, 8], [0, 1]), T(mesh, [4, 3], [0, -1])
    res = rule.infer_forward(x, lab, lab, -100, True, 0, 2)
    rng = np.random.default_rng(3)
    gx = rng.standard_normal((4, 8))
    glab = np.array([[0, 7, -100], [3, 3, 5], [6, 1, 2], [-100, 4, 0]])
    gw = rng.uniform(0.5, 2.0, glab.shape)
    ref = get_reference(ML)
    attrs = {"ignore_index": -100, "sum_multi_label_loss": True}
    sm, loss = ref.run({"x": gx, "label": glab, "smooth_weight": gw, **attrs}, _ctx())
    xs, ls, ws = (shard(v, a, 0) for v, a in zip((gx, glab, gw), res.inputs))
    in_attrs = {"x": res.inputs[0], "label": res.inputs[1], "smooth_weight": res.inputs[2]}
    shapes = {"x": (4, 8), "label": (4, 3), "smooth_weight": (4, 3)}
    comm = _ThreadComm(mesh)
    outs: dict[int, Any] = {}

    def run(r: int) -> None:
        ctx = Ctx(mesh, r, mesh.coords(r), in_attrs, shapes, comm=comm.for_rank(r))
        outs[r] = ref.run({"x": xs[r], "label": ls[r], "smooth_weight": ws[r], **attrs}, ctx)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(mesh.size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sm_parts, loss_parts = shard(sm, res.outputs[0], 0), shard(loss, TensorDistAttr(mesh, [0, -1]), 0)
    for r in range(mesh.size):
        assert np.allclose(outs[r][0], sm_parts[r]) and np.allclose(outs[r][1], loss_parts[r])


# ---------------------------------------------------------------------------
# soundness over generated cases
# ---------------------------------------------------------------------------

SOUNDNESS = [(MC, "forward"), (MC, "backward"), ("moe_combine_grad", "forward"), (MD, "forward"), (MD, "backward"),
             ("moe_gate_dispatch_grad", "forward"), (ML, "forward"), (ML, "backward"), (f"{ML}_grad", "forward"),
             ("numel", "forward"), ("numel", "backward"), (CFU, "forward"), (CFU, "backward"), (ULS, "forward"),
             (ULS, "backward"), (CT, "forward"), (CT, "backward")]


@pytest.mark.parametrize(("name", "mode"), SOUNDNESS, ids=[f"{n}-{m}" for n, m in SOUNDNESS])
def test_sound(name: str, mode: str) -> None:
    assert_sound(name, 200, seed=11, mode=mode)
