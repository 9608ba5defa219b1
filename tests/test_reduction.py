"""Reduction family: Paddle's answers, deviations, grads, errors and property tests."""

# mypy: disable-error-code="union-attr,index,arg-type"
from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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
from spmdkit.ops.reduction import REDUCTION_OPS, notation
from spmdkit.sim import REJECTED, SOUND, verify, verify_rule

M4 = ProcessMesh([4])
M23 = ProcessMesh([2, 3])
S, AVG, MAX, MIN = ReduceType.SUM, ReduceType.AVG, ReduceType.MAX, ReduceType.MIN


def T(mesh: ProcessMesh, shape: list[int], dm: list[Any], partial: Any = None) -> DistTensorSpec:
    return DistTensorSpec(shape, mesh=mesh, dims_mapping=dm, partial=partial)


def one(res: Any, side: str = "outputs") -> tuple[Any, dict[int, ReduceType]]:
    a = getattr(res, side)[0]
    return a.dims_mapping, dict(a.partial)


def case(rule: str, mesh: list[int], args: list[Any], mode: str = "forward") -> dict[str, Any]:
    return {"rule": rule, "mesh": mesh, "mode": mode, "args": args}


def sound(c: dict[str, Any]) -> bool:
    return verify(None, c).status == SOUND


# ---------------------------------------------------------------------------
# Paddle's own unit test (test_reduction_rule.py), reduce types per op
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "rtype"), [("squared_l2_norm", S), ("max", MAX), ("sum", S), ("min", MIN)])
def test_paddle_unit_test_single_mesh_dim(name: str, rtype: ReduceType) -> None:
    r = get_rule(name)
    x = T(M4, [64, 32], [0, -1])
    for axis, keep, out_dm, pdims in (
        ([0], False, (-1,), {0}),
        ([0], True, (-1, -1), {0}),
        ([1], False, (0,), set()),
        ([1], True, (0, -1), set()),
        ([0, 1], False, (), {0}),
        ([0, 1], True, (-1, -1), {0}),
    ):
        res = r.infer_forward(x, axis, keep)
        assert one(res, "inputs") == ((0, -1), {})
        assert one(res) == (out_dm, {d: rtype for d in pdims})


def test_paddle_unit_test_multi_mesh_dim() -> None:
    r = get_rule("squared_l2_norm")
    for dm, keep, out_dm, pdims in (
        ([0, -1, -1], False, (0,), ()),
        ([-1, 0, 1], False, (-1,), (0, 1)),
        ([1, -1, -1], False, (1,), ()),
        ([0, 1, -1], False, (0,), (1,)),
        ([0, 1, -1], True, (0, -1, -1), (1,)),
    ):
        res = r.infer_forward(T(M23, [96, 24, 48], dm), [1, 2], keep)
        assert one(res, "inputs") == (tuple(dm), {})
        assert one(res) == (out_dm, {d: S for d in pdims})


def test_paddle_unit_test_backward() -> None:
    r = get_rule("max")
    x = T(M23, [96, 24, 48], [-1, -1, -1])
    for oshape, odm, keep, xdm in (
        ([96], [0], False, (0, -1, -1)),
        ([96], [-1], False, (-1, -1, -1)),
        ([96], [1], False, (1, -1, -1)),
        ([96, 1, 1], [0, -1, -1], True, (0, -1, -1)),
    ):
        res = r.infer_backward(x, T(M23, oshape, odm), [1, 2], keep)
        assert one(res, "inputs") == (xdm, {})
        assert one(res) == (tuple(odm), {})


# ---------------------------------------------------------------------------
# notation, axes, keep_dim
# ---------------------------------------------------------------------------


def test_notation() -> None:
    assert repr(notation(3, (1,))) == "Notation('abc->ac')"
    assert repr(notation(3, (-2,), True)) == "Notation('abc->a1c')"
    assert repr(notation(2)) == "Notation('ab->')"
    assert "replicated='b'" in repr(notation(2, (1,), reduce=None))
    assert "prune='b'" in repr(notation(2, (1,), reduce=AVG))


def test_negative_duplicate_and_empty_axes() -> None:
    r = get_rule("sum")
    x = T(M23, [6, 4, 2], [0, 1, -1])
    assert one(r.infer_forward(x, [-1, -2], False)) == ((0,), {1: S})
    assert one(r.infer_forward(x, [1, -2, 1], True)) == ((0, -1, -1), {1: S})
    assert one(r.infer_forward(x, [], False)) == ((), {0: S, 1: S})
    assert one(r.infer_forward(x)) == ((), {0: S, 1: S})  # axis defaults to all


def test_zero_dim_input() -> None:
    r = get_rule("sum")
    for axis in ([], [0], [-1]):
        assert one(r.infer_forward(T(M23, [], []), axis, False)) == ((), {})


def test_coshard_keeps_largest_mesh_dim() -> None:
    """As Paddle 3.3.1: [[0, 1]] on mesh [2, 3] keeps mesh dim 1 (size 3)."""
    r = get_rule("sum")
    assert one(r.infer_forward(T(M23, [6, 4], [(0, 1), -1]), [0], False), "inputs") == ((1, -1), {})
    assert one(r.infer_forward(T(M23, [6, 4], [(0, 1), -1]), [0], False)) == ((-1,), {1: S})
    m222 = ProcessMesh([2, 2, 2])
    assert one(get_rule("max").infer_forward(T(m222, [8, 4], [(2, 0), -1]), [1], False)) == ((2,), {})


def test_uneven_kept_for_sum_and_max() -> None:
    """A sharded reduced axis split unevenly stays partial for sum / max (an empty shard
    contributes the identity), as in Paddle."""
    c = case("max", [4], [{"shape": [6, 4], "dims_mapping": [0, -1]}, [0], False])
    assert one(get_rule("max").infer_forward(T(M4, [6, 4], [0, -1]), [0], False)) == ((-1,), {0: MAX})
    assert sound(c)


# ---------------------------------------------------------------------------
# deviations (docs/deviations/reduction.md)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "rtype"),
    [("max", "max"), ("reduce_max", "max"), ("amax", "max"), ("min", "min"), ("amin", "min"),
     ("prod", "prod"), ("all", "all")],
)
def test_reduction_partial_type(name: str, rtype: str) -> None:
    """reduction-partial-type (DESIGN class 1): Paddle marks out partial SUM."""
    m3 = ProcessMesh([3])
    res = get_rule(name).infer_forward(T(m3, [6], [0]), [0], False)
    assert one(res) == ((), {0: ReduceType(rtype)})
    c = case(name, [3], [{"shape": [6], "dims_mapping": [0]}, [0], False])
    assert sound(c)
    if name != "any":  # a bool sum read as a bool is an `any`: Paddle's SUM is sound there
        paddle = {"inputs": [{"dims_mapping": [0], "partial": {}}],
                  "outputs": [{"dims_mapping": [], "partial": {"0": "sum"}}]}
        assert verify(None, c, result=paddle).status != SOUND


def test_reduction_any_is_partial_sum_as_in_paddle() -> None:
    """any: partial SUM as Paddle answers; sound on booleans (a sum of booleans is their OR)."""
    res = get_rule("any").infer_forward(T(M23, [6, 4], [0, 1]), [1], False)
    assert one(res) == ((0,), {1: ReduceType.SUM})
    c = case("any", [2, 3], [{"shape": [6, 4], "dims_mapping": [0, 1]}, [1], False])
    assert sound(c)


def test_frobenius_replicate() -> None:
    """frobenius-replicate (DESIGN class 2): a sqrt of a sum has no partial type."""
    r = get_rule("frobenius_norm")
    res = r.infer_forward(T(M23, [6, 4, 5], [0, 1, -1]), [1, 2], True)
    assert one(res, "inputs") == ((0, -1, -1), {})
    assert one(res) == ((0, -1, -1), {})
    c = case("frobenius_norm", [2, 3], [{"shape": [6, 4, 5], "dims_mapping": [0, 1, -1]}, [1, 2], True])
    assert sound(c)
    paddle = {"inputs": [{"dims_mapping": [0, 1, -1], "partial": {}}],
              "outputs": [{"dims_mapping": [0, -1, -1], "partial": {"1": "sum"}}]}
    assert verify(None, c, result=paddle).status != SOUND
    # a partial x is resharded: the norm of an addend is not an addend of the norm
    res = r.infer_forward(T(M23, [6, 4], [0, -1], {1: "sum"}), [1], False)
    assert one(res, "inputs") == ((0, -1), {})


def test_squared_l2_norm_partial_sum_but_no_passthrough() -> None:
    r = get_rule("squared_l2_norm")
    res = r.infer_forward(T(M23, [6, 4], [0, -1], {1: "sum"}), [0], False)
    assert one(res, "inputs") == ((0, -1), {})
    assert one(res) == ((-1,), {0: S})


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("how", ["mean", "reduce_base"])
def test_mean_uneven_avg(how: str) -> None:
    """mean-uneven-avg (DESIGN class 7): AVG partial only where the split is even."""
    r = get_rule(how)
    extra = [4] if how == "reduce_base" else []
    res = r.infer_forward(T(M4, [6, 4], [0, -1]), [0], False, *extra)
    assert one(res, "inputs") == ((-1, -1), {})
    assert one(res) == ((-1,), {})
    res = r.infer_forward(T(M4, [8, 4], [0, -1]), [0], False, *extra)
    assert one(res) == ((-1,), {0: AVG})
    res = r.infer_forward(T(M23, [8, 5], [0, 1]), [], True, *extra)
    assert one(res, "inputs") == ((0, -1), {})
    assert one(res) == ((-1, -1), {0: AVG})
    c = case("reduce_base", [4], [{"shape": [6, 4], "dims_mapping": [0, -1]}, [0], False, 4])
    paddle = {"inputs": [{"dims_mapping": [0, -1], "partial": {}}],
              "outputs": [{"dims_mapping": [-1], "partial": {"0": "avg"}}]}
    assert verify(None, c, result=paddle).status != SOUND
    assert sound(c)


def test_reduction_partial_input_resharded_as_in_paddle() -> None:
    """A partial x is resharded to non-partial, as Paddle answers."""
    for name, rt in (("sum", "sum"), ("max", "max"), ("mean", "sum"), ("prod", "prod")):
        res = get_rule(name).infer_forward(T(M23, [6, 4], [0, -1], {1: rt}), [0], False)
        assert one(res, "inputs") == ((0, -1), {})
        assert one(res)[1] == ({0: AVG} if name == "mean" else {0: get_rule(name).infer_forward(
            T(M23, [6, 4], [0, -1]), [0], False).outputs[0].partial[0][1]})


def test_reduction_reverse_out() -> None:
    """reduction-reverse-out (DESIGN class 4): out is what x produces."""
    r = get_rule("sum")
    x = T(M23, [6, 4], [-1, -1])
    # partial out: Paddle echoes partial{0: sum} over a replicated x
    res = r.infer_backward(x, T(M23, [6], [1], {0: "sum"}), [1], False)
    assert one(res, "inputs") == ((1, -1), {})
    assert one(res) == ((1,), {})
    # a sharded size-1 kept axis: Paddle echoes [0, 1]
    res = r.infer_backward(x, T(M23, [6, 1], [0, 1]), [1], True)
    assert one(res, "inputs") == ((0, -1), {})
    assert one(res) == ((0, -1), {})
    # Paddle's unit test with the partial out
    res = get_rule("max").infer_backward(
        T(M23, [96, 24, 48], [-1, -1, -1]), T(M23, [96, 1, 1], [0, -1, -1], {1: "sum"}), [1, 2], True
    )
    assert one(res, "inputs") == ((0, -1, -1), {})
    assert one(res) == ((0, -1, -1), {})
    c = case("sum", [2, 3], [{"shape": [6, 4]}, {"shape": [6], "dims_mapping": [1], "partial": {"0": "sum"}}, [1],
                             False], "backward")
    assert sound(c)
    paddle = {"inputs": [{"dims_mapping": [1, -1], "partial": {}}],
              "outputs": [{"dims_mapping": [1], "partial": {"0": "sum"}}]}
    assert verify(None, c, result=paddle).status != SOUND


def test_reduction_reverse_coshard() -> None:
    """reduction-reverse-coshard: a co-sharded out keeps its largest mesh dim, as the
    forward rule does (Paddle echoes the co-shard, or raises on kept size-1 axes)."""
    r = get_rule("sum")
    res = r.infer_backward(T(M23, [6, 4], [-1, -1]), T(M23, [6], [(0, 1)]), [1], False)
    assert one(res, "inputs") == ((1, -1), {})
    assert one(res) == ((1,), {})
    m321 = ProcessMesh([3, 2, 1])
    res = get_rule("max").infer_backward(T(m321, [9, 4], [-1, -1]), T(m321, [1, 1], [(2, 0), 1]), [-2, -1], True)
    assert one(res, "inputs") == ((-1, -1), {})
    assert one(res) == ((-1, -1), {})


def test_reverse_then_forward_agree() -> None:
    for name in REDUCTION_OPS:
        r = get_rule(name)
        x = T(M23, [6, 4, 5], [-1, -1, -1])
        res = r.infer_backward(x, T(M23, [6, 5], [1, 0]), [1], False)
        xa = res.inputs[0]
        fwd = r.infer_forward(DistTensorSpec(x.shape, xa), [1], False)
        assert fwd.outputs == res.outputs


# ---------------------------------------------------------------------------
# grads
# ---------------------------------------------------------------------------


def test_sum_grad() -> None:
    r = get_rule("sum_grad")
    res = r.infer_forward(T(M23, [6, 4, 5], [0, 1, -1]), T(M23, [6, 5], [1, 0], {}), [1], False, False)
    assert [a.dims_mapping for a in res.inputs] == [(1, -1, 0), (1, 0)]
    assert one(res) == ((1, -1, 0), {})
    # keep_dim: the size-1 kept axis is never sharded
    res = r.infer_forward(T(M23, [6, 4], [-1, -1]), T(M23, [6, 1], [0, 1]), [1], True, False)
    assert [a.dims_mapping for a in res.inputs] == [(0, -1), (0, -1)]
    # reduce_all overrides axis
    res = r.infer_forward(T(M23, [6, 4], [-1, -1]), T(M23, [], []), [1], False, True)
    assert one(res) == ((-1, -1), {})


def test_max_grad_clears_partial() -> None:
    r = get_rule("max_grad")
    og = T(M23, [6], [0], {1: "sum"})
    res = r.infer_forward(T(M23, [6, 4], [-1, 1]), og, og, [1], False, False)
    assert [(a.dims_mapping, a.partial) for a in res.inputs] == [((0, -1), ()), ((0,), ()), ((0,), ())]
    assert one(res) == ((0, -1), {})


def test_reduction_grad_keeps_x_sharding() -> None:
    """sum_grad: x_grad is out_grad broadcast over the reduced axes: x's sharding of those axes
    is kept, so a sum over a batch-sharded loss needs no all-gather in backward; a mesh dim
    out_grad already uses is not taken twice. (mean_grad divides by the reduced count, which a
    rank's local kernel would take from its shard: it keeps the reduced axes replicated.)"""
    r = get_rule("sum_grad")
    res = r.infer_forward(T(M23, [4, 6, 1], [0, 1, -1]), T(M23, [], []), [], False, True)
    assert one(res) == ((0, 1, -1), {})
    res = r.infer_forward(T(M23, [4, 6], [0, 1]), T(M23, [4], [1]), [1], False, False)
    assert one(res) == ((1, -1), {})
    assert verify_rule("sum_grad", 200, 3).unsound == 0
    res = get_rule("mean_grad").infer_forward(T(M23, [4, 6, 1], [0, 1, -1]), T(M23, [], []), [], False, True)
    assert one(res) == ((-1, -1, -1), {})


def test_squared_l2_norm_grad_one_element_out() -> None:
    """Paddle's squared_l2_norm outputs [1]; its grad accepts that."""
    res = get_rule("squared_l2_norm_grad").infer_forward(T(M23, [6, 4], [0, 1]), T(M23, [1], [0]))
    assert [a.dims_mapping for a in res.inputs] == [(-1, -1), (-1,)]


# ---------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------


def test_errors() -> None:
    x = T(M23, [6, 4], [0, 1])
    with pytest.raises(InvalidAttributeError, match=r"sum: axis 2 is out of range for a 2-D x"):
        get_rule("sum").infer_forward(x, [2], False)
    with pytest.raises(InvalidAttributeError, match=r"max: axis -3"):
        get_rule("max").infer_forward(x, [-3], False)
    with pytest.raises(InvalidAttributeError, match=r"0-d x"):
        get_rule("sum").infer_forward(T(M23, [], []), [1], False)
    with pytest.raises(InvalidAttributeError, match=r"reduce_base: needs 0 <= reduce_type <= 6, got reduce_type = 7"):
        get_rule("reduce_base").infer_forward(x, [0], False, 7)
    with pytest.raises(InvalidAttributeError, match=r"'axis'"):
        get_rule("sum").infer_forward(x, "0", False)
    with pytest.raises(ShapeMismatchError, match=r"sum: out has 2 dims"):
        get_rule("sum").infer_backward(x, T(M23, [6, 4], [-1, -1]), [1], False)
    with pytest.raises(ShapeMismatchError, match=r"sum: out axis 0 has size 5"):
        get_rule("sum").infer_backward(x, T(M23, [5], [-1]), [1], False)
    with pytest.raises(InvalidMeshError, match=r"sum: out lies on a different mesh than x"):
        get_rule("sum").infer_backward(x, T(ProcessMesh([6]), [6], [-1]), [1], False)
    with pytest.raises(ShapeMismatchError, match=r"sum_grad: out_grad has 2 dims"):
        get_rule("sum_grad").infer_forward(x, T(M23, [6, 4], [-1, -1]), [1], False, False)
    with pytest.raises(ShapeMismatchError, match=r"max_grad: out has shape"):
        get_rule("max_grad").infer_forward(x, T(M23, [5], [-1]), T(M23, [6], [-1]), [1], False, False)
    with pytest.raises(InvalidMeshError, match=r"max_grad: out lies on a different mesh than x"):
        get_rule("max_grad").infer_forward(x, T(ProcessMesh([6]), [6], [-1]), T(M23, [6], [-1]), [1], False,
                                           False)


# ---------------------------------------------------------------------------
# property: every answer sound (or a library error), by the simulator
# ---------------------------------------------------------------------------

_FWD = [*sorted(REDUCTION_OPS), "reduce_base"]
_GRADS = ["sum_grad", "mean_grad", "max_grad", "min_grad", "prod_grad", "squared_l2_norm_grad",
          "frobenius_norm_grad"]
_REDUCE = ["sum", "sum", "avg", "max", "min", "prod"]


@st.composite
def _cases(draw: Any) -> dict[str, Any]:
    mesh = draw(st.sampled_from([[2], [4], [2, 2], [2, 3], [3, 2, 2]]))
    shape = draw(st.lists(st.sampled_from([1, 2, 3, 4, 5, 6, 8, 12]), min_size=0, max_size=4))
    nd = len(shape)
    axis = draw(st.lists(st.integers(-nd, nd - 1), max_size=nd)) if nd else []
    keep = draw(st.booleans())

    def tensor(shp: list[int], partial: bool) -> dict[str, Any]:
        free = list(range(len(mesh)))
        dm: list[Any] = []
        for _ in shp:
            if free and draw(st.booleans()):
                if len(free) >= 2 and draw(st.integers(0, 3)) == 0:
                    dm.append([free.pop(), free.pop()])
                else:
                    dm.append(free.pop())
            else:
                dm.append(-1)
        t: dict[str, Any] = {"shape": shp, "dims_mapping": dm}
        if partial and free and draw(st.booleans()):
            t["partial"] = {str(free.pop()): draw(st.sampled_from(_REDUCE))}
        return t

    red = set(range(nd)) if not axis else {a % nd for a in axis}
    oshape = [1 if i in red else s for i, s in enumerate(shape) if keep or i not in red]
    rule = draw(st.sampled_from(_FWD + _GRADS))
    if rule in _GRADS:
        with_out = rule.split("_grad")[0] in ("max", "min", "prod", "frobenius_norm")
        args = [tensor(shape, False)] + [tensor(oshape, True) for _ in range(2 if with_out else 1)]
        return case(rule, mesh, [*args, axis, keep, False])
    mode = draw(st.sampled_from(["forward", "backward"]))
    extra = [draw(st.integers(0, 6))] if rule == "reduce_base" and mode == "forward" else []
    if mode == "forward":
        return case(rule, mesh, [tensor(shape, True), axis, keep, *extra])
    return case(rule, mesh, [tensor(shape, True), tensor(oshape, True), axis, keep], "backward")


@settings(max_examples=300, deadline=None)
@given(_cases())
def test_property_sound_or_error(c: dict[str, Any]) -> None:
    v = verify(None, c)
    assert v.status in (SOUND, REJECTED), v.detail
    if v.status == REJECTED:
        assert v.error is not None


def test_errors_are_library_errors() -> None:
    x = T(M23, [6, 4], [0, 1])
    for bad in ([9], [0, 7], [-9]):
        for name in _FWD:
            with pytest.raises(SpmdError):
                get_rule(name).infer_forward(x, bad, False)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_rule_reads_like_its_notation(data: Any) -> None:
    """Without co-shards and partial inputs the rule is the engine run on ``notation()``."""
    from spmdkit.engine.compiler import einsum_forward

    mesh = ProcessMesh(data.draw(st.sampled_from([[2], [4], [2, 3], [3, 2, 2]])))
    shape = data.draw(st.lists(st.sampled_from([1, 2, 3, 4, 6, 8]), min_size=1, max_size=4))
    nd = len(shape)
    dims = data.draw(st.permutations(list(range(mesh.ndim))))
    dm = [dims[i] if i < len(dims) and data.draw(st.booleans()) else -1 for i in range(nd)]
    axis = tuple(data.draw(st.lists(st.integers(-nd, nd - 1), max_size=nd)))
    keep = data.draw(st.booleans())
    name = data.draw(st.sampled_from(sorted(REDUCTION_OPS)))
    rtype = REDUCTION_OPS[name][0]
    x = T(mesh, shape, dm)
    ins, outs = einsum_forward(name, notation(nd, axis, keep, rtype), [x], ["x"])
    res = get_rule(name).infer_forward(x, list(axis), keep)
    assert list(res.inputs) == ins and list(res.outputs) == outs


def test_p_norm_and_numel_errors() -> None:
    x = T(M23, [6, 4], [0, 1])
    pn, pn_grad = get_rule("p_norm"), get_rule("p_norm_grad")
    with pytest.raises(InvalidAttributeError, match=r"p_norm: porder must be a number, got nan"):
        pn.infer_forward(x, float("nan"), 1)
    with pytest.raises(InvalidAttributeError, match=r"p_norm: porder"):  # porder before out's shape
        pn.infer_backward(x, T(M23, [5], [-1]), float("nan"), 1)
    with pytest.raises(ShapeMismatchError, match=r"p_norm: out axis 0 has size 5, but the reduced x \[6\] has 6"):
        pn.infer_backward(x, T(M23, [5], [-1]), 2.0, 1)
    with pytest.raises(ShapeMismatchError, match=r"p_norm_grad: out_grad has 2 dims"):
        pn_grad.infer_forward(x, T(M23, [6], [-1]), T(M23, [6, 1], [-1, -1]), 2.0, 1)
    with pytest.raises(ShapeMismatchError, match=r"numel: out must be 0-D"):
        get_rule("numel").infer_backward(x, T(M23, [1], [-1]))
    # x's rank limit (26 letters) is checked before the axis and porder
    big = T(M23, [2] * 27, [-1] * 27)
    with pytest.raises(ShapeMismatchError, match="more than 26 dims"):
        pn.infer_forward(big, float("nan"), 40)
    with pytest.raises(ShapeMismatchError, match="more than 26 dims"):
        get_rule("sum").infer_forward(big, [40], False)
