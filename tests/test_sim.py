"""The numeric simulator: shard / assemble, the references, the judge, generated soundness runs."""

from __future__ import annotations

import argparse
import io
import json
from typing import Any

import numpy as np
import pytest

from spmdkit.cli.verify import add_verify_command
from spmdkit.core import ProcessMesh, ReduceType, SpmdResult, TensorDistAttr
from spmdkit.engine import registry
from spmdkit.engine.registry import Rule, get_rule
from spmdkit.engine.signature import Mode
from spmdkit.io.codec import Case, decode_args
from spmdkit.sim import (
    REJECTED,
    SOUND,
    UNSOUND,
    AssembleError,
    assemble,
    balanced_split,
    generate_cases,
    shard,
    verifiable_rules,
    verify,
    verify_rule,
)
from spmdkit.sim.cases import mode_reference
from spmdkit.sim.mesh import reduce_pieces, split_partial
from spmdkit.sim.reference import REFERENCES, Ctx, get_reference

# -- helpers ----------------------------------------------------------------------------------


def attr(mesh: list[int] | ProcessMesh, dm: list[Any], partial: Any = None) -> TensorDistAttr:
    m = mesh if isinstance(mesh, ProcessMesh) else ProcessMesh(mesh)
    return TensorDistAttr(m, dm, partial)


def fake_rule(name: str, fwd: Any, sig: str, bwd: Any = None, bsig: str = "") -> Rule:
    """An unregistered rule (for feeding the judge deliberately wrong answers)."""
    return Rule(name, Mode(fwd, sig, "FakeInferSpmd"), Mode(bwd, bsig, "FakeInferSpmdReverse", "reverse") if bwd else None)


def make_case(rule: Rule, mesh: list[int], args: list[Any], mode: str = "forward") -> Case:
    m = ProcessMesh(mesh)
    return Case(rule, mode, m, decode_args(rule, rule.mode(mode), m, args))


def answer(mesh: list[int], ins: list[Any], outs: list[Any]) -> Any:
    """A rule function that ignores its input and answers ``(ins, outs)`` (dims_mapping, partial) pairs."""
    m = ProcessMesh(mesh)

    def mk(x: Any) -> Any:
        if x is None:
            return None
        dm, pt = x if isinstance(x, tuple) else (x, None)
        return TensorDistAttr(m, dm, pt)

    def fn(*args: Any) -> SpmdResult:
        return SpmdResult([mk(x) for x in ins], [mk(x) for x in outs])

    return fn


# -- balanced split, shard, assemble ----------------------------------------------------------


def test_balanced_split_is_torch_chunk() -> None:
    assert balanced_split(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert balanced_split(5, 4) == [(0, 2), (2, 4), (4, 5), (5, 5)]
    assert balanced_split(9, 4) == [(0, 3), (3, 6), (6, 9), (9, 9)]
    assert balanced_split(1, 3) == [(0, 1), (1, 1), (1, 1)]
    assert balanced_split(0, 2) == [(0, 0), (0, 0)]


def test_shard_mesh_order_and_coshard() -> None:
    x = np.arange(24).reshape(6, 4)
    a = attr([2, 3], [[1, 0], -1])  # axis 0 over mesh dim 1 (major) then 0 (minor): 6 pieces
    loc = shard(x, a)
    m = ProcessMesh([2, 3])
    for r in range(6):
        c = m.coords(r)
        piece = c[1] * 2 + c[0]
        np.testing.assert_array_equal(loc[r], x[piece : piece + 1])
    np.testing.assert_array_equal(assemble(loc, a, x.shape), x)


@pytest.mark.parametrize(
    ("mesh", "dm", "shape"),
    [
        ([4], [0, -1], (5, 3)),
        ([4], [-1, 0], (2, 9)),
        ([2, 3], [1, 0], (7, 5)),
        ([2, 2], [[0, 1]], (6,)),
        ([3, 2, 2], [[2, 0], -1, 1], (13, 1, 3)),
        ([2, 4], [-1, -1], (3, 3)),
        ([3], [0], (1,)),
    ],
)
def test_round_trip_uneven_and_coshard(mesh: list[int], dm: list[Any], shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal(shape)
    a = attr(mesh, dm)
    loc = shard(x, a, rng)
    assert sum(p.size for p in loc) >= x.size
    np.testing.assert_array_equal(assemble(loc, a, shape), x)


def test_uneven_pieces_are_ceil_sized_last_smaller() -> None:
    a = attr([4], [0])
    loc = shard(np.arange(5.0), a)
    assert [p.shape[0] for p in loc] == [2, 2, 1, 0]


_FLOAT_TYPES = ["sum", "avg", "max", "min", "prod"]


@pytest.mark.parametrize("rtype", _FLOAT_TYPES)
@pytest.mark.parametrize("mesh", [[3], [2, 2]])
def test_round_trip_partial_float(rtype: str, mesh: list[int]) -> None:
    rng = np.random.default_rng(7)
    x = rng.standard_normal((4, 5))
    pdims = {str(d): rtype for d in range(len(mesh))}
    a = attr(mesh, [-1, -1], pdims)
    loc = shard(x, a, rng)
    # the ranks hold different values, none of which is the truth everywhere
    assert not all(np.allclose(loc[0], p) for p in loc[1:])
    np.testing.assert_allclose(assemble(loc, a, x.shape), x, rtol=1e-9, atol=1e-12, equal_nan=False)


@pytest.mark.parametrize("rtype", ["any", "all", "sum", "max", "min", "prod"])
def test_round_trip_partial_bool(rtype: str) -> None:
    rng = np.random.default_rng(3)
    x = rng.random((6, 3)) < 0.5
    a = attr([4], [-1, -1], {"0": rtype})
    loc = shard(x, a, rng)
    np.testing.assert_array_equal(assemble(loc, a, x.shape), x)


@pytest.mark.parametrize("rtype", ["sum", "avg", "max", "min", "prod"])
def test_round_trip_partial_int(rtype: str) -> None:
    rng = np.random.default_rng(5)
    x = rng.integers(-8, 9, size=(5, 4))
    a = attr([3], [-1, -1], {"0": rtype})
    loc = shard(x, a, rng)
    np.testing.assert_array_equal(assemble(loc, a, x.shape), x)


def test_partial_with_sharding_round_trip() -> None:
    rng = np.random.default_rng(11)
    x = rng.standard_normal((7, 6))
    a = attr([2, 3, 2], [2, -1], {"0": "max", "1": "sum"})
    np.testing.assert_allclose(assemble(shard(x, a, rng), a, x.shape), x, rtol=1e-9, atol=1e-12, equal_nan=False)


@pytest.mark.parametrize("true_type", _FLOAT_TYPES)
def test_wrong_reduce_type_never_passes(true_type: str) -> None:
    """Pieces split for one reduce type never reduce to the truth with another."""
    rng = np.random.default_rng(13)
    x = rng.standard_normal((6, 6))
    for n in (2, 3, 4):
        pieces = split_partial(x, ReduceType(true_type), n, rng)
        np.testing.assert_allclose(reduce_pieces(pieces, ReduceType(true_type)), x, rtol=1e-9, atol=1e-12, equal_nan=False)
        for other in _FLOAT_TYPES:
            if other != true_type:
                assert not np.allclose(reduce_pieces(pieces, ReduceType(other)), x), (true_type, other, n)


def test_avg_pieces_are_not_copies() -> None:
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 3))
    pieces = split_partial(x, ReduceType.AVG, 3, rng)
    assert all(not np.allclose(p, x) for p in pieces)


def test_assemble_reports_differing_replicas() -> None:
    a = attr([2, 2], [0, -1])
    x = np.arange(8.0).reshape(4, 2)
    loc = shard(x, a)
    loc[3] = loc[3] + 1.0  # rank 3 (coords 1,1) should equal rank 2 (coords 1,0)
    with pytest.raises(AssembleError) as e:
        assemble(loc, a, x.shape)
    assert e.value.ranks == (2, 3)
    assert "replica" in str(e.value)


def test_assemble_reports_wrong_local_shape() -> None:
    a = attr([2], [0])
    with pytest.raises(AssembleError) as e:
        assemble([np.zeros(3), np.zeros(3)], a, (4,))
    assert e.value.ranks == (0,)


# -- the judge catches broken rules -----------------------------------------------------------

MATMUL_SIG = "x: T, y: T, trans_x: bool = False, trans_y: bool = False"
MM_ARGS = [{"shape": [4, 6], "dims_mapping": [-1, 0]}, {"shape": [6, 3], "dims_mapping": [0, -1]}, False, False]


def test_matmul_sharded_k_without_partial_is_unsound() -> None:
    rule = fake_rule("matmul", answer([2], [[-1, 0], [0, -1]], [[-1, -1]]), MATMUL_SIG)
    v = verify(None, make_case(rule, [2], MM_ARGS))
    assert v.status == UNSOUND, v
    assert v.output == 0
    assert "replica" in v.detail and set(v.ranks) == {0, 1}


def test_matmul_sharded_k_with_partial_sum_is_sound() -> None:
    rule = fake_rule("matmul", answer([2], [[-1, 0], [0, -1]], [([-1, -1], {"0": "sum"})]), MATMUL_SIG)
    assert verify(None, make_case(rule, [2], MM_ARGS)).status == SOUND


def test_matmul_mismatched_k_shards_fail_locally() -> None:
    rule = fake_rule("matmul", answer([2], [[-1, 0], [-1, -1]], [([-1, -1], {"0": "sum"})]), MATMUL_SIG)
    v = verify(None, make_case(rule, [2], MM_ARGS))
    assert v.status == UNSOUND and "fails on rank" in v.detail


def test_softmax_with_sharded_axis_is_unsound() -> None:
    rule = fake_rule("softmax", answer([2], [[-1, 0]], [[-1, 0]]), "x: T, axis: int = -1")
    v = verify(None, make_case(rule, [2], [{"shape": [3, 8], "dims_mapping": [-1, 0]}, -1]))
    assert v.status == UNSOUND and v.output == 0
    assert "differs" in v.detail


def test_softmax_with_replicated_axis_is_sound() -> None:
    rule = fake_rule("softmax", answer([2], [[0, -1]], [[0, -1]]), "x: T, axis: int = -1")
    assert verify(None, make_case(rule, [2], [{"shape": [3, 8], "dims_mapping": [0, 0 - 1]}, -1])).status == SOUND


RED_SIG = "x: T, axis: ints = (), keep_dim: bool = False"


@pytest.mark.parametrize(("op", "claimed", "ok"), [
    ("max", "sum", False), ("max", "max", True), ("amin", "max", False), ("amin", "min", True),
    ("prod", "sum", False), ("prod", "prod", True), ("sum", "avg", False), ("sum", "sum", True),
    ("mean", "sum", False), ("mean", "avg", True), ("all", "any", False), ("all", "all", True),
])
def test_reduction_partial_type(op: str, claimed: str, ok: bool) -> None:
    rule = fake_rule(op, answer([3], [[0, -1]], [([-1], {"0": claimed})]), RED_SIG)
    v = verify(None, make_case(rule, [3], [{"shape": [6, 2], "dims_mapping": [0, -1]}, [0], False]))
    assert v.status == (SOUND if ok else UNSOUND), v


def test_avg_over_uneven_shards_is_unsound() -> None:
    rule = fake_rule("mean", answer([2], [[0]], [([], {"0": "avg"})]), RED_SIG)
    v = verify(None, make_case(rule, [2], [{"shape": [5], "dims_mapping": [0]}, [0], False]))
    assert v.status == UNSOUND
    rule = fake_rule("mean", answer([2], [[0]], [([], {"0": "avg"})]), RED_SIG)
    assert verify(None, make_case(rule, [2], [{"shape": [6], "dims_mapping": [0]}, [0], False])).status == SOUND


def test_replicated_claim_for_differing_values_names_the_ranks() -> None:
    rule = fake_rule("sum", answer([2, 2], [[1, -1]], [[-1]]), RED_SIG)
    v = verify(None, make_case(rule, [2, 2], [{"shape": [4, 3], "dims_mapping": [1, -1]}, [0], False]))
    assert v.status == UNSOUND
    assert "should hold equal replicas" in v.detail
    assert v.ranks == (0, 1, 3)  # ranks 1 and 3 (mesh dim 1 coord 1) hold other sums than rank 0


def test_kept_partial_input_through_nonlinear_op_is_unsound() -> None:
    rule = fake_rule("exp", answer([2], [([-1], {"0": "sum"})], [([-1], {"0": "sum"})]), "x: T")
    v = verify(None, make_case(rule, [2], [{"shape": [5], "partial": [0]}]))
    assert v.status == UNSOUND


def test_layer_norm_with_sharded_normalized_axis_is_unsound() -> None:
    sig = "x: T, scale: T?, bias: T?, epsilon: float = 1e-5, begin_norm_axis: int = 1"
    x = {"shape": [4, 6], "dims_mapping": [0, 1]}
    ok = answer([2, 2], [[0, -1], [-1], [-1]], [[0, -1], [0], [0]])
    bad = answer([2, 2], [[0, 1], [-1], [-1]], [[0, 1], [0], [0]])
    args = [x, {"shape": [6]}, {"shape": [6]}, 1e-5, 1]
    assert verify(None, make_case(fake_rule("layer_norm", ok, sig), [2, 2], args)).status == SOUND
    v = verify(None, make_case(fake_rule("layer_norm", bad, sig), [2, 2], args))
    assert v.status == UNSOUND and "fails on rank" in v.detail  # a local x of 3 columns, a scale of 6
    v = verify(None, make_case(fake_rule("layer_norm", bad, sig), [2, 2], [x, None, None, 1e-5, 1]))
    assert v.status == UNSOUND and v.output == 0  # normalized over 3 of the 6 columns


def test_wrong_length_dims_mapping_is_unsound() -> None:
    rule = fake_rule("sum", answer([2], [[-1, -1]], [[-1, -1]]), RED_SIG)
    v = verify(None, make_case(rule, [2], [{"shape": [4, 3]}, [0], False]))
    assert v.status == UNSOUND and "entries for a 1-D" in v.detail


def test_reverse_answer_whose_outputs_the_inputs_cannot_produce() -> None:
    """DESIGN class 4: a reverse rule echoing the requested output."""
    bwd = answer([2, 3], [[-1, -1]], [[1, 0]])
    rule = fake_rule("transpose", answer([2, 3], [[-1, -1]], [[-1, -1]]), "x: T, perm: ints", bwd,
                     "x: T, out: T, perm: ints")
    case = make_case(rule, [2, 3], [{"shape": [48, 64]}, {"shape": [64, 48], "dims_mapping": [1, 0]}, [1, 0]],
                     mode="backward")
    v = verify(None, case)
    assert v.status == UNSOUND and v.output == 0


def test_reject_is_reported() -> None:
    from spmdkit.core.errors import InvalidAttributeError

    def fn(*a: Any) -> SpmdResult:
        raise InvalidAttributeError("softmax: bad axis")

    v = verify(None, make_case(fake_rule("softmax", fn, "x: T, axis: int = -1"), [2], [{"shape": [3]}, 5]))
    assert v.status == REJECTED and v.error == "InvalidAttributeError"


def test_verify_result_override_and_json_case() -> None:
    case = {"rule": "transpose", "mesh": [2], "args": [{"shape": [4, 3], "dims_mapping": [0, -1]}, [1, 0]]}
    assert verify(None, case).status == SOUND
    m = ProcessMesh([2])
    wrong = SpmdResult([TensorDistAttr(m, [0, -1])], [TensorDistAttr(m, [0, -1])])
    v = verify(None, case, result=wrong)
    assert v.status == UNSOUND
    line = v.case_line()
    assert line.startswith("spmdkit infer '") and json.loads(line[len("spmdkit infer '"):-1])["rule"] == "transpose"


# -- the references: analytic gradients against finite differences ------------------------------


def _num_grad(f: Any, x: np.ndarray, g: np.ndarray, h: float = 1e-6) -> np.ndarray:
    out = np.zeros_like(x)
    it = np.nditer(x, flags=["multi_index"])
    for _ in it:
        i = it.multi_index
        xp, xm = x.copy(), x.copy()
        xp[i] += h
        xm[i] -= h
        out[i] = (np.sum(f(xp) * g) - np.sum(f(xm) * g)) / (2 * h)
    return out


CTX = Ctx(ProcessMesh([1]))


def _fwd(name: str, **kw: Any) -> Any:
    ref = REFERENCES[name]
    return ref.run(kw, CTX)


def test_layer_norm_grad_matches_numeric() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 2, 4))
    s, b = rng.standard_normal(8), rng.standard_normal(8)
    g = rng.standard_normal(x.shape)
    _, mean, var = _fwd("layer_norm", x=x, scale=s, bias=b, epsilon=1e-5, begin_norm_axis=1)
    dx, ds, db = _fwd("layer_norm_grad", x=x, scale=s, bias=b, mean=mean, variance=var, out_grad=g,
                      epsilon=1e-5, begin_norm_axis=1)
    np.testing.assert_allclose(dx, _num_grad(lambda t: _fwd("layer_norm", x=t, scale=s, bias=b, begin_norm_axis=1)[0],
                                             x, g), rtol=1e-5, atol=1e-6, equal_nan=False)
    np.testing.assert_allclose(ds, _num_grad(lambda t: _fwd("layer_norm", x=x, scale=t, bias=b, begin_norm_axis=1)[0],
                                             s, g), rtol=1e-5, atol=1e-6, equal_nan=False)
    np.testing.assert_allclose(db, g.sum(axis=0).reshape(-1), rtol=1e-9, equal_nan=False)


def test_rms_norm_grad_matches_numeric() -> None:
    rng = np.random.default_rng(1)
    x, s = rng.standard_normal((3, 5)), rng.standard_normal(5)
    g = rng.standard_normal(x.shape)
    _, inv = _fwd("fused_rms_norm", x=x, scale=s, epsilon=1e-6)
    dx, ds = _fwd("rms_norm_grad", x=x, scale=s, invvar=inv, out_grad=g, epsilon=1e-6)
    np.testing.assert_allclose(dx, _num_grad(lambda t: _fwd("fused_rms_norm", x=t, scale=s, epsilon=1e-6)[0], x, g),
                               rtol=1e-5, atol=1e-6, equal_nan=False)
    np.testing.assert_allclose(ds, _num_grad(lambda t: _fwd("fused_rms_norm", x=x, scale=t, epsilon=1e-6)[0], s, g),
                               rtol=1e-5, atol=1e-6, equal_nan=False)


@pytest.mark.parametrize(("xs", "ys", "tx", "ty"), [
    ((3, 4), (4, 2), False, False), ((4, 3), (2, 4), True, True), ((2, 1, 3, 4), (5, 4, 2), False, False),
    ((4,), (4, 2), False, False), ((3, 4), (4,), False, False), ((4,), (2, 4), False, True), ((4,), (4,), False, False),
])
def test_matmul_grad_matches_numeric(xs: tuple[int, ...], ys: tuple[int, ...], tx: bool, ty: bool) -> None:
    rng = np.random.default_rng(2)
    x, y = rng.standard_normal(xs), rng.standard_normal(ys)
    (o,) = _fwd("matmul", x=x, y=y, trans_x=tx, trans_y=ty)
    g = rng.standard_normal(np.shape(o))
    dx, dy = _fwd("matmul_grad", x=x, y=y, out_grad=g, trans_x=tx, trans_y=ty)
    np.testing.assert_allclose(dx, _num_grad(lambda t: _fwd("matmul", x=t, y=y, trans_x=tx, trans_y=ty)[0], x, g),
                               rtol=1e-5, atol=1e-6, equal_nan=False)
    np.testing.assert_allclose(dy, _num_grad(lambda t: _fwd("matmul", x=x, y=t, trans_x=tx, trans_y=ty)[0], y, g),
                               rtol=1e-5, atol=1e-6, equal_nan=False)


@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
def test_softmax_grads_match_numeric(name: str) -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 4))
    g = rng.standard_normal(x.shape)
    (out,) = _fwd(name, x=x, axis=0)
    (dx,) = _fwd(f"{name}_grad", out=out, out_grad=g, axis=0)
    np.testing.assert_allclose(dx, _num_grad(lambda t: _fwd(name, x=t, axis=0)[0], x, g), rtol=1e-5, atol=1e-6, equal_nan=False)


@pytest.mark.parametrize("name", ["add", "subtract", "multiply", "divide", "elementwise_pow", "maximum", "fmin"])
def test_binary_grads_match_numeric_with_broadcast(name: str) -> None:
    rng = np.random.default_rng(4)
    x = rng.uniform(0.5, 2.0, (3, 1, 4))
    y = rng.uniform(0.5, 2.0, (2, 4))
    g = rng.standard_normal((3, 2, 4))
    dx, dy = _fwd(f"{name}_grad", x=x, y=y, out_grad=g)
    np.testing.assert_allclose(dx, _num_grad(lambda t: _fwd(name, x=t, y=y)[0], x, g), rtol=1e-5, atol=1e-6, equal_nan=False)
    np.testing.assert_allclose(dy, _num_grad(lambda t: _fwd(name, x=x, y=t)[0], y, g), rtol=1e-5, atol=1e-6, equal_nan=False)


@pytest.mark.parametrize("name", ["sum", "mean", "max", "min", "prod", "squared_l2_norm", "frobenius_norm"])
@pytest.mark.parametrize("keep", [False, True])
def test_reduction_grads_match_numeric(name: str, keep: bool) -> None:
    rng = np.random.default_rng(5)
    x = rng.uniform(0.5, 2.0, (3, 4, 2))
    (o,) = _fwd(name, x=x, axis=[0, -1], keep_dim=keep)
    g = rng.standard_normal(np.shape(o))
    (dx,) = _fwd(f"{name}_grad", x=x, out=o, out_grad=g, axis=[0, -1], keep_dim=keep, reduce_all=False)
    np.testing.assert_allclose(dx, _num_grad(lambda t: _fwd(name, x=t, axis=[0, -1], keep_dim=keep)[0], x, g),
                               rtol=1e-5, atol=1e-6, equal_nan=False)


@pytest.mark.parametrize("name", ["relu", "gelu", "silu", "tanh", "exp", "log", "sqrt", "asin", "lgamma", "erf",
                                  "mish", "selu", "logit", "softplus", "digamma"])
def test_unary_grads_match_numeric(name: str) -> None:
    rng = np.random.default_rng(6)
    dom = get_reference(name).domain("x")  # type: ignore[union-attr]
    from spmdkit.sim.cases import make_array

    x = make_array((7,), dom, rng) + (0.01 if name == "relu" else 0.0)
    g = rng.standard_normal(x.shape)
    (dx,) = _fwd(f"{name}_grad", x=x, out_grad=g)
    np.testing.assert_allclose(dx, _num_grad(lambda t: _fwd(name, x=t)[0], x, g, h=1e-5), rtol=1e-4, atol=1e-5, equal_nan=False)


def test_transpose_grad_inverts() -> None:
    x = np.arange(24.0).reshape(2, 3, 4)
    (o,) = _fwd("transpose", x=x, perm=[2, 0, -2])
    (back,) = _fwd("transpose_grad", out_grad=o, perm=[2, 0, -2])
    np.testing.assert_array_equal(back, x)


# -- case generation --------------------------------------------------------------------------


def test_generation_is_reproducible() -> None:
    a = generate_cases("transpose", 20, seed=3, mode="backward")
    b = generate_cases("transpose", 20, seed=3, mode="backward")
    c = generate_cases("transpose", 20, seed=4, mode="backward")
    assert a == b and a != c and len(a) == 20


def test_generated_cases_cover_the_space() -> None:
    cases = generate_cases("transpose", 200, seed=0, mode="forward")
    meshes = {len(c["mesh"]) for c in cases}
    assert meshes == {1, 2, 3}
    dms = [c["args"][0]["dims_mapping"] for c in cases]
    assert any(any(isinstance(e, list) for e in dm) for dm in dms), "no co-sharding generated"
    assert any("partial" in c["args"][0] for c in cases), "no partial input generated"
    assert any(any(p < 0 for p in c["args"][1]) for c in cases), "no negative perm entries"
    uneven = 0
    for c in cases:
        for s, e in zip(c["args"][0]["shape"], c["args"][0]["dims_mapping"]):
            dims = e if isinstance(e, list) else ([] if e == -1 else [e])
            n = int(np.prod([c["mesh"][d] for d in dims])) if dims else 1
            uneven += s % n != 0
    assert uneven > 10


# -- soundness run over every registered rule with a reference ----------------------------------

N_SOUNDNESS = 30
_PAIRS = [(n, m) for n in verifiable_rules() for m in get_rule(n).modes
          if mode_reference(get_rule(n), m)[0] is not None]


@pytest.mark.parametrize(("rule", "mode"), _PAIRS, ids=[f"{n}-{m}" for n, m in _PAIRS])
def test_soundness(rule: str, mode: str) -> None:
    rep = verify_rule(rule, N_SOUNDNESS, seed=0, mode=mode)
    assert rep.cases > 0, rep.note
    assert rep.sound > 0, (
        f"{rule} {mode}: no generated case came out sound ({rep.rejected} rejected, {rep.skipped} skipped): "
        + (rep.first_skipped.detail if rep.first_skipped is not None else "every case rejected")
    )
    assert rep.unsound == 0, (
        f"{rule} {mode}: {rep.unsound}/{rep.cases} unsound; first: {rep.first_unsound.detail}\n"  # type: ignore[union-attr]
        f"{rep.first_unsound.case_line()}"  # type: ignore[union-attr]
    )


def test_transpose_has_a_reference_and_is_verified() -> None:
    assert ("transpose", "forward") in _PAIRS and ("transpose", "backward") in _PAIRS
    rep = verify_rule("transpose", 40, seed=1, mode="forward")
    assert rep.cases == 40 and rep.sound + rep.rejected == 40 and rep.sound > 20


# -- the CLI ----------------------------------------------------------------------------------


def _cli(argv: list[str]) -> tuple[int, str]:
    p = argparse.ArgumentParser(prog="spmdkit")
    sub = p.add_subparsers(dest="command", required=True)
    add_verify_command(sub)
    ns = p.parse_args(argv)
    out = io.StringIO()
    return ns.fn(ns, out), out.getvalue()


def test_cli_verify_table() -> None:
    rc, text = _cli(["verify", "transpose", "--cases", "5", "--mode", "both", "--seed", "2"])
    assert rc == 0
    rows = [ln.split() for ln in text.splitlines() if ln.startswith("transpose ")]
    assert [r[1] for r in rows] == ["forward", "backward"]
    assert all(r[2] == "5" and r[4] == "0" for r in rows)


def test_cli_verify_reports_unsound_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(x: Any, axis: int = -1) -> SpmdResult:  # keeps every sharding, the softmax axis too
        return SpmdResult([x.dist_attr.replace(partial=None)], [x.dist_attr.replace(partial=None)])

    rule = fake_rule("broken_softmax", broken, "x: T, axis: int = -1")
    monkeypatch.setitem(registry._RULES, "broken_softmax", rule)
    monkeypatch.setitem(REFERENCES, "broken_softmax", REFERENCES["softmax"])
    rc, text = _cli(["verify", "broken_softmax", "--cases", "30", "--mode", "forward"])
    assert rc == 1
    assert "UNSOUND broken_softmax forward" in text
    line = next(ln.strip() for ln in text.splitlines() if ln.strip().startswith("spmdkit infer '"))
    case = json.loads(line[len("spmdkit infer '"):-1])
    assert verify(None, case).status == UNSOUND  # the printed line reproduces it


# -- no false alarms: all-replicated answers are sound for every reference ----------------------

SIGS: dict[str, str] = {
    "exp": "x: T", "log": "x: T", "acosh": "x: T", "bitwise_not": "x: T", "logical_not": "x: T", "erfinv": "x: T",
    "gelu": "x: T, approximate: bool = False",
    "cast": "x: T, dtype: str = 'float32'",
    "tanh_grad": "x: T, out_grad: T", "relu_grad": "out: T, out_grad: T",
    "add": "x: T, y: T", "remainder": "x: T, y: T", "logical_xor": "x: T, y: T", "divide": "x: T, y: T",
    "multiply_grad": "x: T, y: T, out_grad: T, axis: int = -1",
    "softmax": "x: T, axis: int = -1", "log_softmax": "x: T, axis: int = -1",
    "softmax_grad": "out: T, out_grad: T, axis: int = -1",
    "layer_norm": "x: T, scale: T?, bias: T?, epsilon: float = 1e-5, begin_norm_axis: int = 1",
    "layer_norm_grad": "x: T, scale: T?, bias: T?, mean: T, variance: T, out_grad: T, epsilon: float = 1e-5, "
                       "begin_norm_axis: int = 1",
    "fused_rms_norm": "x: T, scale: T?, epsilon: float = 1e-5",
    "rms_norm_grad": "x: T, scale: T?, invvar: T, out_grad: T, epsilon: float = 1e-5",
    "matmul": MATMUL_SIG,
    "matmul_grad": "x: T, y: T, out_grad: T, trans_x: bool = False, trans_y: bool = False",
    "sum": RED_SIG, "mean": RED_SIG, "prod": RED_SIG, "all": RED_SIG, "frobenius_norm": RED_SIG,
    "reduce_base": RED_SIG + ", reduce_type: int = 0",
    "sum_grad": "x: T, out_grad: T, axis: ints = (), keep_dim: bool = False, reduce_all: bool = False",
    "max_grad": "x: T, out: T, out_grad: T, axis: ints = (), keep_dim: bool = False, reduce_all: bool = False",
    "transpose": "x: T, perm: ints", "transpose_grad": "out_grad: T, perm: ints",
    "default_data_parallel": "ins: [T?], outs: [T?]", "replicated": "ins: [T?], outs: [T?]",
}
REVERSE_SIGS = {
    "softmax": "x: T, out: T, axis: int = -1",
    "layer_norm": "x: T, scale: T?, bias: T?, out: T, mean: T, variance: T, epsilon: float = 1e-5, "
                  "begin_norm_axis: int = 1",
    "matmul": "x: T, y: T, out: T, trans_x: bool = False, trans_y: bool = False",
    "sum": "x: T, out: T, axis: ints = (), keep_dim: bool = False",
    "add": "x: T, y: T, out: T",
}


def _replicating(ref_name: str, sig: str) -> Any:
    """A rule that replicates every tensor (always sound)."""
    from spmdkit.core.spec import DistTensorSpec
    from spmdkit.engine.signature import parse_signature
    from spmdkit.sim.cases import make_array

    ref = REFERENCES[ref_name]
    names = [p.name for p in parse_signature(sig)]

    def rep(t: Any) -> Any:
        if t is None:
            return None
        if isinstance(t, (list, tuple)):
            return tuple(rep(x) for x in t)
        return TensorDistAttr.replicated(t.mesh, t.ndim)

    def fn(*args: Any) -> SpmdResult:
        named = dict(zip(names, args))
        tensors = [a for a, n in zip(args, names) if n in ref.tensor_params]
        mesh = next(t for t in _flat_specs(tensors)).mesh
        arrays: dict[str, Any] = {}
        shapes: dict[str, Any] = {}
        for n, a in named.items():
            if isinstance(a, DistTensorSpec):
                arrays[n], shapes[n] = make_array(a.shape, ref.domain(n), np.random.default_rng(0)), a.shape
            elif n in ref.tensor_params and isinstance(a, (list, tuple)):
                arrays[n] = [None if t is None else np.ones(t.shape) for t in a]  # real-valued inputs
                shapes[n] = [None if t is None else t.shape for t in a]
            else:
                arrays[n] = a
        with np.errstate(all="ignore"):
            outs = ref.run(arrays, Ctx(mesh, shapes=shapes))
        ins = [rep(a) for a, n in zip(args, names) if n in ref.tensor_params and n not in ref.spec_params]
        return SpmdResult(ins, [None if o is None else TensorDistAttr.replicated(mesh, np.ndim(o)) for o in outs])

    return fn


def _flat_specs(ts: list[Any]) -> list[Any]:
    out: list[Any] = []
    for t in ts:
        if isinstance(t, (list, tuple)):
            out.extend(x for x in t if x is not None)
        elif t is not None:
            out.append(t)
    return out


@pytest.mark.parametrize("name", sorted(SIGS))
def test_replicated_answers_are_sound(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    ref = REFERENCES[name]
    bsig = REVERSE_SIGS.get(name, "")
    rule = fake_rule(f"fake_{name}", _replicating(name, SIGS[name]), SIGS[name],
                     _replicating(name, bsig) if bsig else None, bsig)
    monkeypatch.setitem(registry._RULES, f"fake_{name}", rule)
    monkeypatch.setitem(REFERENCES, f"fake_{name}", ref)
    for mode in rule.modes:
        rep = verify_rule(f"fake_{name}", 25, seed=5, mode=mode)
        assert rep.cases == 25, rep.note
        assert rep.unsound == 0 and rep.skipped == 0, (rep.first_unsound or rep.first_skipped).describe()  # type: ignore[union-attr]
        assert rep.sound == 25


@pytest.mark.parametrize(("op", "x_partial", "y_partial", "ok"), [
    ("multiply", True, False, True),   # linear in x: partial sum passes through
    ("multiply", True, True, False),   # (a0 + a1)(b0 + b1) != a0 b0 + a1 b1
    ("add", True, True, True),
    ("add", True, False, False),       # y would be added once per rank
    ("subtract", False, False, True),
])
def test_partial_pass_through_elementwise(op: str, x_partial: bool, y_partial: bool, ok: bool) -> None:
    px = ([-1, -1], {"0": "sum"}) if x_partial else [-1, -1]
    py = ([-1], {"0": "sum"}) if y_partial else [-1]
    rule = fake_rule(op, answer([3], [px, py], [([-1, -1], {"0": "sum"}) if (x_partial or y_partial) else [-1, -1]]),
                     "x: T, y: T")
    args = [{"shape": [4, 5], "partial": [0] if x_partial else None}, {"shape": [5], "partial": [0] if y_partial else None}]
    args = [{k: v for k, v in a.items() if v is not None} for a in args]
    assert verify(None, make_case(rule, [3], args)).status == (SOUND if ok else UNSOUND)


def test_bool_reduction_with_any() -> None:
    rule = fake_rule("any", answer([2], [[0]], [([], {"0": "any"})]), RED_SIG)
    assert verify(None, make_case(rule, [2], [{"shape": [6], "dims_mapping": [0]}, [], False])).status == SOUND


def test_default_data_parallel_batch_axis_only() -> None:
    sig = "ins: [T?], outs: [T?]"
    ins = [{"shape": [4, 3], "dims_mapping": [0, -1]}, {"shape": [4], "dims_mapping": [0]}]
    outs = [{"shape": [4, 5]}]
    good = fake_rule("default_data_parallel", answer([2], [[0, -1], [0]], [[0, -1]]), sig)
    assert verify(None, make_case(good, [2], [ins, outs])).status == SOUND
    bad = fake_rule("default_data_parallel", answer([2], [[0, -1], [0]], [[-1, 0]]), sig)
    assert verify(None, make_case(bad, [2], [ins, outs])).status == UNSOUND


RESHAPE_SIG = "x: T, shape: ints"


@pytest.mark.parametrize(("x_dm", "out_dm", "ok"), [
    ([0, -1], [0], True),     # flatten [4, 6] -> [24] keeping the leftmost axis sharded
    ([-1, 0], [0], False),    # a non-leftmost flattened axis kept sharded
    ([-1, 0], [-1], False),   # ... or claimed replicated: the local pieces differ
    ([-1, -1], [0], False),   # a local kernel cannot reshape all of x into half of the output
    ([-1, -1], [-1], True),
])
def test_reshape_flatten_sharding(x_dm: list[int], out_dm: list[int], ok: bool) -> None:
    rule = fake_rule("reshape", answer([2], [x_dm], [out_dm]), RESHAPE_SIG)
    v = verify(None, make_case(rule, [2], [{"shape": [4, 6], "dims_mapping": x_dm}, [-1]]))
    assert v.status == (SOUND if ok else UNSOUND), v


def test_reshape_targets_resolve_like_paddle() -> None:
    from spmdkit.sim.refs.view import resolve_shape

    assert resolve_shape([0, -1], (4, 3, 2)) == (4, 6)
    assert resolve_shape([2, 0, -1], (4, 3, 2)) == (2, 3, 4)
    with pytest.raises(ValueError):
        resolve_shape([5, -1], (4, 3))


def test_cli_verify_json() -> None:
    rc, text = _cli(["verify", "transpose_grad", "--cases", "4", "--json"])
    rows = [json.loads(ln) for ln in text.splitlines()]
    assert rc == 0 and rows == [{**rows[0], "rule": "transpose_grad", "mode": "forward", "cases": 4, "unsound": 0}]


# -- grad rules: typical sound answers are judged sound, typical mistakes unsound -----------------

LN_GRAD_SIG = SIGS["layer_norm_grad"]


@pytest.mark.parametrize(("partial_grads", "ok"), [(True, True), (False, False)])
def test_layer_norm_grad_batch_sharded(partial_grads: bool, ok: bool) -> None:
    pg = ([-1], {"0": "sum"}) if partial_grads else [-1]
    rule = fake_rule("layer_norm_grad", answer([2], [[0, -1], [-1], [-1], [0], [0], [0, -1]], [[0, -1], pg, pg]),
                     LN_GRAD_SIG)
    x = {"shape": [4, 6], "dims_mapping": [0, -1]}
    args = [x, {"shape": [6]}, {"shape": [6]}, {"shape": [4], "dims_mapping": [0]}, {"shape": [4], "dims_mapping": [0]},
            {"shape": [4, 6], "dims_mapping": [0, -1]}, 1e-5, 1]
    v = verify(None, make_case(rule, [2], args))
    assert v.status == (SOUND if ok else UNSOUND), v
    if not ok:
        assert v.output == 1


def test_rms_norm_grad_batch_sharded() -> None:
    sig = SIGS["rms_norm_grad"]
    rule = fake_rule("rms_norm_grad", answer([2], [[0, -1], [-1], [0], [0, -1]], [[0, -1], ([-1], {"0": "sum"})]), sig)
    args = [{"shape": [5, 3], "dims_mapping": [0, -1]}, {"shape": [3]}, {"shape": [5], "dims_mapping": [0]},
            {"shape": [5, 3], "dims_mapping": [0, -1]}, 1e-6]
    assert verify(None, make_case(rule, [2], args)).status == SOUND


@pytest.mark.parametrize(("ins", "outs", "ok"), [
    # m sharded: x_grad keeps it, y_grad is partial over it
    ([[0, -1], [-1, -1], [0, -1]], [[0, -1], ([-1, -1], {"0": "sum"})], True),
    ([[0, -1], [-1, -1], [0, -1]], [[0, -1], [-1, -1]], False),
    # k sharded: both grads sharded along k, out_grad replicated
    ([[-1, 0], [0, -1], [-1, -1]], [[-1, 0], [0, -1]], True),
])
def test_matmul_grad_answers(ins: list[Any], outs: list[Any], ok: bool) -> None:
    rule = fake_rule("matmul_grad", answer([2], ins, outs), SIGS["matmul_grad"])
    args = [{"shape": [4, 6], "dims_mapping": ins[0]}, {"shape": [6, 3], "dims_mapping": ins[1]},
            {"shape": [4, 3], "dims_mapping": ins[2]}, False, False]
    assert verify(None, make_case(rule, [2], args)).status == (SOUND if ok else UNSOUND)


def test_binary_grad_broadcast_axis_gives_partial_y_grad() -> None:
    sig = SIGS["multiply_grad"]
    good = fake_rule("multiply_grad", answer([2], [[0, -1], [-1], [0, -1]], [[0, -1], ([-1], {"0": "sum"})]), sig)
    bad = fake_rule("multiply_grad", answer([2], [[0, -1], [-1], [0, -1]], [[0, -1], [-1]]), sig)
    args = [{"shape": [4, 5], "dims_mapping": [0, -1]}, {"shape": [5]}, {"shape": [4, 5], "dims_mapping": [0, -1]}]
    assert verify(None, make_case(good, [2], args)).status == SOUND
    assert verify(None, make_case(bad, [2], args)).status == UNSOUND


def test_sum_grad_and_local_mean_grad() -> None:
    sig = SIGS["sum_grad"]
    args = [{"shape": [6, 4], "dims_mapping": [0, -1]}, {"shape": [4]}, [0], False, False]
    rule = fake_rule("sum_grad", answer([2], [[0, -1], [-1]], [[0, -1]]), sig)
    assert verify(None, make_case(rule, [2], args)).status == SOUND
    # mean_grad's local kernel divides by the local count of the reduced axis
    rule = fake_rule("mean_grad", answer([2], [[0, -1], [-1]], [[0, -1]]), sig)
    assert verify(None, make_case(rule, [2], args)).status == UNSOUND
    rule = fake_rule("mean_grad", answer([2], [[-1, 0], [0]], [[-1, 0]]), sig)
    assert verify(None, make_case(rule, [2], args)).status == SOUND


# -- a NaN never counts as equal (issue 13) -------------------------------------------------------


def test_close_never_equates_nan() -> None:
    from spmdkit.sim.mesh import arrays_close, max_abs_error, nonfinite_count

    a = np.array([1.0, np.nan, np.inf])
    assert not arrays_close(a, a.copy(), 1e-7, 1e-9)  # NaN equals nothing, itself included
    assert arrays_close(a, a.copy(), 1e-7, 1e-9, equal_nan=True)  # replicas agreeing bit for bit
    assert arrays_close(np.array([np.inf, -np.inf]), np.array([np.inf, -np.inf]), 1e-7, 1e-9)  # exact infinities
    assert not arrays_close(np.array([np.inf]), np.array([-np.inf]), 1e-7, 1e-9)
    assert not arrays_close(np.array([np.nan]), np.array([0.0]), 1e-7, 1e-9, equal_nan=True)
    assert nonfinite_count(a) == 2 and nonfinite_count(np.arange(3)) == 0
    assert max_abs_error(np.array([1.0, np.nan, 5.0]), np.array([1.5, 2.0, 5.0])) == 0.5  # finite positions
    # replicas that are NaN at the same places assemble; the value check is the caller's
    m = ProcessMesh([2])
    got = assemble([a, a.copy()], attr(m, [-1]), a.shape)
    assert np.isnan(got[1]) and got[0] == 1.0


def test_verify_never_calls_a_nan_output_sound(monkeypatch: pytest.MonkeyPatch) -> None:
    """log of normal samples (outside the reference's domain) is NaN at about half the places on
    every rank and in the unsharded run alike: not checkable, so skipped, never sound."""
    import importlib

    vmod = importlib.import_module("spmdkit.sim.verify")
    case = {"rule": "log", "mesh": [2], "args": [{"shape": [4, 6], "dims_mapping": [0, -1]}]}
    assert verify(None, case).status == SOUND  # positive inputs: checkable and sound
    monkeypatch.setattr(vmod, "make_array", lambda shape, domain, rng: rng.standard_normal(shape))
    v = verify(None, case)
    assert v.status == "skipped" and v.detail.startswith("not checkable: the unsharded op gives NaN"), v.detail
    assert "output 0 (" in v.detail and "values NaN)" in v.detail


def test_simulate_plan_fails_a_nan_step() -> None:
    from spmdkit.planner.propagate import propagate
    from spmdkit.program.ir import program_from_json
    from spmdkit.sim.plan import simulate_plan

    prog = program_from_json({"format": "spmdkit-program", "version": 1, "name": "log",
                              "tensors": [{"name": "x", "shape": [4, 8], "kind": "input"},
                                          {"name": "y", "shape": [4, 8]}],
                              "ops": [{"rule": "log", "name": "log", "inputs": {"x": "x"}, "outputs": ["y"]}]})
    rep = simulate_plan(propagate(prog, ProcessMesh([2]), {"x": [0, -1]}))
    assert not rep.ok
    assert rep.failures == [("y", "after log: not checkable, the unsharded value has 18 non-finite values of 32")]
