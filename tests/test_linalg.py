"""bmm, linear_v2, fused_gemm_epilogue, fused_linear_param_grad_add, einsum: Paddle's unit-test
cases, hand-checked answers, deviations, errors, simulator references against numeric
gradients, soundness over generated cases."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from spmdkit.core import DistTensorSpec, ProcessMesh
from spmdkit.core.errors import InvalidAttributeError, ShapeMismatchError, SpmdError
from spmdkit.ops import get_rule
from spmdkit.sim import SOUND, UNSOUND, get_reference, verify, verify_rule
from spmdkit.sim.reference import Ctx

M = ProcessMesh([2, 2])
M23 = ProcessMesh([2, 3])
M3 = ProcessMesh([3])


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

    np.testing.assert_allclose(dx, _num_grad(lambda v: out(x_=v), x, g), rtol=1e-6, equal_nan=False)
    np.testing.assert_allclose(dw, _num_grad(lambda v: out(w_=v), w, g), rtol=1e-6, equal_nan=False)
    np.testing.assert_allclose(db, _num_grad(lambda v: out(b_=v), b, g), rtol=1e-6, equal_nan=False)


def test_gemm_and_bmm_grad_references_are_gradients() -> None:
    rng = np.random.default_rng(1)
    x, y, b, g = rng.standard_normal((4, 3)), rng.standard_normal((5, 4)), rng.standard_normal(5), \
        rng.standard_normal((3, 5))
    kw = {"trans_x": True, "trans_y": True}
    dx, dy, db = _run("fused_gemm_epilogue_grad", {"x": x, "y": y, "reserve_space": None, "out_grad": g, **kw})

    def out(x_: Any = x, y_: Any = y, b_: Any = b) -> np.ndarray:
        return _run("fused_gemm_epilogue", {"x": x_, "y": y_, "bias": b_, **kw})[0]

    np.testing.assert_allclose(dx, _num_grad(lambda v: out(x_=v), x, g), rtol=1e-6, equal_nan=False)
    np.testing.assert_allclose(dy, _num_grad(lambda v: out(y_=v), y, g), rtol=1e-6, equal_nan=False)
    np.testing.assert_allclose(db, _num_grad(lambda v: out(b_=v), b, g), rtol=1e-6, equal_nan=False)
    x3, y3, g3 = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 4, 5)), rng.standard_normal((2, 3, 5))
    bx, by = _run("bmm_grad", {"x": x3, "y": y3, "out_grad": g3})
    np.testing.assert_allclose(bx, _num_grad(lambda v: _run("bmm", {"x": v, "y": y3})[0], x3, g3), rtol=1e-6, equal_nan=False)
    np.testing.assert_allclose(by, _num_grad(lambda v: _run("bmm", {"x": x3, "y": v})[0], y3, g3), rtol=1e-6, equal_nan=False)


def test_fused_linear_param_grad_add_accumulates() -> None:
    rng = np.random.default_rng(2)
    x, d, dw, db = (rng.standard_normal(s) for s in ((2, 3, 4), (2, 3, 5), (4, 5), (5,)))
    w_out, b_out = _run("fused_linear_param_grad_add", {"x": x, "dout": d, "dweight": dw, "dbias": db,
                                                        "has_bias": True})
    np.testing.assert_allclose(w_out, dw + x.reshape(6, 4).T @ d.reshape(6, 5), equal_nan=False)
    np.testing.assert_allclose(b_out, db + d.reshape(6, 5).sum(0), equal_nan=False)


def _dm(attrs: Any) -> list[Any]:
    return [None if a is None else [None if b is None else b.dims_mapping for b in a]
            if isinstance(a, (list, tuple)) else a.dims_mapping for a in attrs]


def _pt(a: Any) -> dict[int, str]:
    return {d: str(t.value) for d, t in a.partial}


def S(mesh: ProcessMesh, shape: list[int], dm: list[Any], partial: Any = None) -> DistTensorSpec:
    return DistTensorSpec(shape, mesh=mesh, dims_mapping=dm, partial=partial)


def J(shape: list[int], dm: list[Any], partial: Any = None) -> dict[str, Any]:
    d: dict[str, Any] = {"shape": shape, "dims_mapping": dm}
    if partial is not None:
        d["partial"] = partial
    return d


def _gemm(x: DistTensorSpec, y: DistTensorSpec, b: DistTensorSpec, tx: bool = False, ty: bool = False) -> Any:
    return get_rule("fused_gemm_epilogue").infer_forward(x, y, b, tx, ty)


# ---------------------------------------------------------------------------
# Paddle's own unit tests
# ---------------------------------------------------------------------------

# test_fused_gemm_epilogue_rule.py (mesh [2,3], x [64,32], y [32,48], bias [48]): the cases whose
# shapes are consistent. A sharded k keeps out partial and asks for bias partial alike
# (Paddle 3.3.1 itself answers so, although its unit test says "force to replicate").
_GEMM_PT = [
    # x dm, y dm, bias dm, want x, y, bias, out, out partial
    ([1, 0], [0, -1], [-1], [1, 0], [0, -1], [-1], [1, -1], {0: "sum"}),
    ([1, -1], [-1, -1], [-1], [1, -1], [-1, -1], [-1], [1, -1], {}),
    ([-1, -1], [-1, 0], [-1], [-1, -1], [-1, 0], [0], [-1, 0], {}),
    ([1, 0], [-1, -1], [-1], [1, 0], [0, -1], [-1], [1, -1], {0: "sum"}),
    # y's k on mesh dim 1 (size 3) does not divide 32: pruned, as spmdkit's and Paddle's matmul
    ([-1, -1], [1, 0], [-1], [-1, -1], [-1, 0], [0], [-1, 0], {}),
    ([1, -1], [-1, -1], [0], [1, -1], [-1, -1], [-1], [1, -1], {}),
    ([-1, -1], [-1, 0], [0], [-1, -1], [-1, 0], [0], [-1, 0], {}),
    ([1, -1], [-1, -1], [1], [1, -1], [-1, -1], [-1], [1, -1], {}),
    ([-1, -1], [-1, 0], [1], [-1, -1], [-1, 0], [0], [-1, 0], {}),
]


@pytest.mark.parametrize("case", _GEMM_PT)
def test_paddle_fused_gemm_epilogue_cases(case: Any) -> None:
    xd, yd, bd, wx, wy, wb, wo, wp = case
    r = _gemm(S(M23, [64, 32], xd), S(M23, [32, 48], yd), S(M23, [48], bd))
    assert _dm(r.inputs) == [tuple(wx), tuple(wy), tuple(wb)]
    assert r.outputs[0].dims_mapping == tuple(wo) and _pt(r.outputs[0]) == wp
    assert _pt(r.inputs[2]) == wp  # bias partial exactly where out is
    assert r.outputs[1] == r.outputs[0]  # reserve_space as out (gemm-reserve-space)


def test_paddle_fused_gemm_epilogue_batched_cases() -> None:
    x = [512, 48, 64, 32]
    r = _gemm(S(M23, x, [1, -1, -1, 0]), S(M23, [32, 48], [-1, -1]), S(M23, [48], [-1]))
    assert _dm(r.inputs) == [(-1, -1, -1, 0), (0, -1), (-1,)]
    assert r.outputs[0].dims_mapping == (-1, -1, -1, -1) and _pt(r.outputs[0]) == {0: "sum"}
    # 512 is not divisible by mesh dim 1 (3): spmdkit (as matmul) drops it, Paddle's fused
    # gemm keeps it (gemm-matmul-merge)
    for bias in ([-1], [0], [1]):
        r = _gemm(S(M23, x, [1, 0, -1, -1]), S(M23, [32, 48], [-1, -1]), S(M23, [48], bias))
        assert _dm(r.inputs) == [(-1, 0, -1, -1), (-1, -1), (-1,)]
        assert r.outputs[0].dims_mapping == (-1, 0, -1, -1) and not r.outputs[0].partial


def test_gemm_shape_checks() -> None:
    """Paddle's unit test also runs trans_x / trans_y on x [512,48,64,32], y [32,48], bias [48],
    whose k or n do not match: Paddle answers, spmdkit rejects (gemm-shape-checks)."""
    x, y, b = S(M23, [512, 48, 64, 32], [1, -1, -1, 0]), S(M23, [32, 48], [-1, -1]), S(M23, [48], [-1])
    with pytest.raises(ShapeMismatchError, match=r"fused_gemm_epilogue.*\bk\b"):
        _gemm(x, y, b, True, False)
    with pytest.raises(ShapeMismatchError, match=r"fused_gemm_epilogue: the contracting axis k"):  # and n != 48
        _gemm(x, S(M23, [32, 48], [1, 0]), b, False, True)
    with pytest.raises(ShapeMismatchError, match="fused_gemm_epilogue: bias axis 0 has size 32"):
        _gemm(x, y, S(M23, [32], [-1]), False, False)
    with pytest.raises(ShapeMismatchError, match="linear_v2: bias"):
        get_rule("linear_v2").infer_forward(S(M23, [8, 32], [-1, -1]), S(M23, [32, 48], [-1, -1]),
                                            S(M23, [32], [-1]))


def test_paddle_fused_linear_param_grad_add_cases() -> None:
    """test_fused_linear_param_grad_add_rule.py: mesh [2,2], empty dweight / dbias."""
    r = get_rule("fused_linear_param_grad_add")
    e = T([], [])
    res = r.infer_forward(T([2, 512, 1024], [0, -1, -1]), T([2, 512, 2048], [0, -1, 1]), e, e, False, True)
    assert _dm(res.outputs) == [(-1, 1), (1,)]
    assert _pt(res.outputs[0]) == {0: "sum"} and _pt(res.outputs[1]) == {0: "sum"}  # the batch axis summed
    res = r.infer_forward(T([2, 512, 1024], [0, -1, 1]), T([2, 512, 2048], [0, -1, -1]), e, e, False, True)
    assert _dm(res.outputs) == [(1, -1), (-1,)]
    assert _pt(res.outputs[0]) == {0: "sum"}


def test_paddle_einsum_cases() -> None:
    """test_einsum_rule.py calls Paddle's EinsumInferSpmdBase(inputs, is_outer, out_dim), without the
    equation; translated with equations that fit its shapes (the first with m = 4 in both)."""
    r = get_rule("einsum")
    # outer products: out = the operands' mappings side by side
    res = r.infer_forward([T([16, 16, 16], [-1, -1, -1]), T([4, 16, 16], [-1, 1, 0])], "abc,def->abcdef")
    assert _dm(res.inputs) == [[(-1, -1, -1), (-1, 1, 0)]] and _dm(res.outputs) == [(-1, -1, -1, -1, 1, 0)]
    res = r.infer_forward([T([16], [0]), T([4], [-1])], "i,j -> ij")
    assert _dm(res.inputs) == [[(0,), (-1,)]] and _dm(res.outputs) == [(0, -1)]


def test_einsum_shards_by_notation() -> None:
    """einsum-notation: Paddle replicates every operand of a non-outer einsum, and of an outer
    product with both operands sharded replicates the first; spmdkit merges the letters."""
    r = get_rule("einsum")
    res = r.infer_forward([T([4, 16, 16], [-1, 0, 1]), T([4, 16, 16], [-1, 1, 0])], "mij,mlh->ljm")
    # i on 0 and j on 1 (from the first operand) win; l, h lose their mesh dims; i is contracted
    assert _dm(res.inputs) == [[(-1, 0, 1), (-1, -1, -1)]]
    assert _dm(res.outputs) == [(-1, 1, -1)] and _pt(res.outputs[0]) == {0: "sum"}
    res = r.infer_forward([T([16, 16, 16], [-1, -1, 1]), T([4, 16, 16], [-1, 1, 0])], "abc,def->abcdef")
    assert _dm(res.inputs) == [[(-1, -1, 1), (-1, -1, 0)]] and _dm(res.outputs) == [(-1, -1, 1, -1, -1, 0)]
    case = {"rule": "einsum", "mesh": [2, 2], "mode": "forward",
            "args": [[J([4, 16, 16], [-1, 0, 1]), J([4, 16, 16], [-1, 1, 0])], "mij,mlh->ljm"]}
    assert verify(None, case).status == SOUND


# ---------------------------------------------------------------------------
# hand-checked cases
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(("eq", "ins", "want_in", "want_out", "partial"), [
    # a matmul: k (j) sharded on 1 -> out partial over 1
    ("ij,jk->ik", [([4, 6], [0, 1]), ([6, 8], [1, -1])], [(0, 1), (1, -1)], (0, -1), {1: "sum"}),
    # the implicit output of ij,jk is ik
    ("ij,jk", [([4, 6], [0, 1]), ([6, 8], [1, -1])], [(0, 1), (1, -1)], (0, -1), {1: "sum"}),
    # a batch letter shared by both operands
    ("bij,bjk->bik", [([2, 4, 6], [0, -1, 1]), ([2, 6, 8], [-1, 1, -1])], [(0, -1, 1), (0, 1, -1)], (0, -1, -1),
     {1: "sum"}),
    # an outer product keeps both shardings
    ("i,j->ij", [([4], [0]), ([6], [1])], [(0,), (1,)], (0, 1), {}),
    # '...' right-aligned; the size-1 broadcast axis of the first operand is never sharded
    ("...ij,...jk->...ik", [([1, 4, 6], [0, -1, -1]), ([4, 6, 8], [0, -1, 1])], [(-1, -1, -1), (0, -1, 1)],
     (0, -1, 1), {}),
    # a diagonal letter is replicated
    ("ii->i", [([4, 4], [0, 1])], [(-1, -1)], (-1,), {}),
    # three operands: b and c contracted, c on mesh dim 1
    ("ab,bc,cd->ad", [([4, 6], [0, -1]), ([6, 8], [-1, 1]), ([8, 2], [-1, -1])], [(0, -1), (-1, 1), (1, -1)],
     (0, -1), {1: "sum"}),
    # i = 3 is not divisible by mesh dim 0 (2): pruned
    ("ij,jk->ik", [([3, 6], [0, 1]), ([6, 8], [-1, -1])], [(-1, 1), (1, -1)], (-1, -1), {1: "sum"}),
    # a full sum: out partial over every mesh dim the letters used
    ("ij->", [([4, 6], [0, 1])], [(0, 1)], (), {0: "sum", 1: "sum"}),
])
def test_einsum_hand_checked(eq: str, ins: Any, want_in: Any, want_out: Any, partial: Any) -> None:
    res = get_rule("einsum").infer_forward([T(s, d) for s, d in ins], eq)
    assert _dm(res.inputs) == [want_in]
    assert res.outputs[0].dims_mapping == want_out and _pt(res.outputs[0]) == partial
    case = {"rule": "einsum", "mesh": [2, 2], "mode": "forward", "args": [[J(s, d) for s, d in ins], eq]}
    assert verify(None, case).status == SOUND


def test_einsum_grad_hand_checked() -> None:
    """Each grad is sharded as its operand and partial over the mesh dims of the letters it lacks."""
    g = get_rule("einsum_grad")
    res = g.infer_forward([T([4, 6], [0, 1]), T([6, 8], [1, -1])], [], T([4, 8], [0, -1]), "ij,jk->ik")
    assert _dm(res.outputs) == [[(0, 1), (1, -1)]]
    assert _pt(res.outputs[0][0]) == {} and _pt(res.outputs[0][1]) == {0: "sum"}  # dy = x^T g sums over i
    res = g.infer_forward([T([4, 6], [0, -1]), T([6, 8], [-1, -1])], [], T([4, 8], [-1, 1]), "ij,jk->ik")
    assert _dm(res.inputs[0]) == [(0, -1), (-1, 1)] and res.inputs[2].dims_mapping == (0, 1)
    assert _pt(res.outputs[0][0]) == {1: "sum"} and _pt(res.outputs[0][1]) == {0: "sum"}


def test_gemm_hand_checked() -> None:
    # a sharded k: fused_gemm_epilogue keeps out partial and asks bias partial over the same dims
    r = _gemm(T([8, 4], [0, 1]), T([4, 6], [1, -1]), T([6], [-1]))
    assert _dm(r.inputs) == [(0, 1), (1, -1), (-1,)] and _pt(r.inputs[2]) == {1: "sum"}
    assert r.outputs[0].dims_mapping == (0, -1) and _pt(r.outputs[0]) == {1: "sum"}
    # linear_v2 replicates the matmul axes instead (as Paddle's LinearV2)
    r = get_rule("linear_v2").infer_forward(T([8, 4], [0, 1]), T([4, 6], [1, -1]), T([6], [-1]))
    assert _dm(r.inputs) == [(-1, -1), (-1, -1), (-1,)] and _dm(r.outputs) == [(-1, -1), (-1, -1)]
    # the reverse: x, y, bias from out (k replicated)
    r = get_rule("fused_gemm_epilogue").infer_backward(T([8, 4], [-1, -1]), T([4, 6], [-1, -1]), T([6], [-1]),
                                                       T([8, 6], [0, 1]), T([8, 6], [-1, -1]), False, False)
    assert _dm(r.inputs) == [(0, -1), (-1, 1), (1,)] and _dm(r.outputs) == [(0, 1), (0, 1)]
    # grads: bias_grad as out_grad's last axis, partial over the other axes' mesh dims
    r = get_rule("fused_gemm_epilogue_grad").infer_forward(T([8, 4], [0, -1]), T([4, 6], [-1, 1]), None,
                                                           T([8, 6], [0, 1]), False, False, "none")
    assert _dm(r.outputs) == [(0, -1), (-1, 1), (1,)]
    assert [_pt(a) for a in r.outputs] == [{1: "sum"}, {0: "sum"}, {0: "sum"}]
    r = get_rule("linear_v2_grad").infer_forward(T([2, 8, 4], [0, -1, -1]), T([4, 6], [-1, 1]), T([6], [1]),
                                                 T([2, 8, 6], [0, -1, 1]))
    assert _dm(r.outputs) == [(0, -1, -1), (-1, 1), (1,)] and _pt(r.outputs[2]) == {0: "sum"}


def test_gemm_reserve_space_sharded_as_out() -> None:
    """gemm-reserve-space: Paddle 3.3.1 answers reserve_space with an empty dims_mapping."""
    for name in ("fused_gemm_epilogue", "linear_v2"):
        r = get_rule(name).infer_forward(T([8, 4], [0, -1]), T([4, 6], [-1, 1]), T([6], [-1]), False)
        assert r.outputs[1].dims_mapping == (0, 1) == r.outputs[0].dims_mapping


def test_gemm_merges_as_matmul() -> None:
    """gemm-matmul-merge: mesh [3], x [4,4,3] [-1,-1,0], w [3,4] [-1,0]: k and n claim mesh dim 0;
    spmdkit (as matmul) keeps n, Paddle's older merge replicates everything (both sound)."""
    r = get_rule("linear_v2").infer_forward(S(M3, [4, 4, 3], [-1, -1, 0]), S(M3, [3, 4], [-1, 0]),
                                            S(M3, [4], [-1]))
    assert _dm(r.inputs) == [(-1, -1, -1), (-1, 0), (0,)] and r.outputs[0].dims_mapping == (-1, -1, 0)
    m = get_rule("matmul").infer_forward(S(M3, [4, 4, 3], [-1, -1, 0]), S(M3, [3, 4], [-1, 0]), False, False)
    assert m.outputs[0].dims_mapping == r.outputs[0].dims_mapping


def test_gemm_k_on_two_mesh_dims_resolved() -> None:
    """gemm-two-mesh-dims: x and y shard k on different mesh dims; Paddle raises "Tensor Axis[k] is
    Sharded by two different mesh dimension", spmdkit merges (as matmul)."""
    r = _gemm(T([8, 4], [-1, 0]), T([4, 6], [1, -1]), T([6], [-1]))
    assert r.inputs[0].dims_mapping[1] == r.inputs[1].dims_mapping[0] != -1
    assert _pt(r.outputs[0]) == _pt(r.inputs[2]) != {}


def test_gemm_partial_only_with_sharded_k() -> None:
    """gemm-partial-unsharded-k: mesh [3], x [1,1] [0,-1] (trans_x), y [1,9] [-1,0]: k has size 1;
    Paddle replicates x and y yet answers out and bias partial{0} (every rank adds the whole
    product: 3 times the sum). spmdkit: out [-1,0], nothing partial."""
    case = {"rule": "fused_gemm_epilogue", "mesh": [3], "mode": "forward",
            "args": [J([1, 1], [0, -1]), J([1, 9], [-1, 0]), J([9], [-1]), True, False]}
    r = _gemm(S(M3, [1, 1], [0, -1]), S(M3, [1, 9], [-1, 0]), S(M3, [9], [-1]), True, False)
    assert _dm(r.inputs) == [(-1, -1), (-1, 0), (0,)] and r.outputs[0].dims_mapping == (-1, 0)
    assert not r.outputs[0].partial
    assert verify(None, case).status == SOUND
    paddle = {"inputs": [J([1, 1], [-1, -1]), J([1, 9], [-1, -1]), J([9], [-1], {"0": "sum"})],
              "outputs": [J([1, 9], [-1, -1], {"0": "sum"}), J([1, 9], [-1, -1], {"0": "sum"})]}
    assert verify(None, case, result=paddle).status == UNSOUND


def test_bmm_grad_answers_where_paddle_raises() -> None:
    """bmm-grad-raises: BmmGradInferSpmd raises "(Unavailable) The matmul grad infer spmd ... verify
    error" whenever the grad matmuls would reshard; spmdkit answers the reshard. mesh [2,4],
    x [2,12,6] [0,1,-1], y [2,6,6] [0,-1,-1], out_grad [2,12,6] [0,-1,-1] (Paddle raises): out_grad
    is asked [0,1,-1], y_grad is partial over m's mesh dim 1."""
    m24 = ProcessMesh([2, 4])
    r = get_rule("bmm").infer_backward(S(m24, [2, 12, 6], [0, 1, -1]), S(m24, [2, 6, 6], [0, -1, -1]),
                                       S(m24, [2, 12, 6], [0, -1, -1]))
    assert _dm(r.inputs) == [(0, 1, -1), (0, -1, -1), (0, 1, -1)]
    assert _dm(r.outputs) == [(0, 1, -1), (0, -1, -1)] and _pt(r.outputs[1]) == {1: "sum"}
    case = {"rule": "bmm", "mesh": [2, 4], "mode": "backward",
            "args": [J([2, 12, 6], [0, 1, -1]), J([2, 6, 6], [0, -1, -1]), J([2, 12, 6], [0, -1, -1])]}
    assert verify(None, case).status == SOUND


def test_bmm_size1_axis_not_sharded() -> None:
    """mm-size1-axis for bmm: m = 1 sharded on x stays unsharded."""
    r = get_rule("bmm").infer_forward(T([4, 1, 6], [-1, 0, -1]), T([4, 6, 10], [-1, -1, -1]))
    assert _dm(r.inputs) == [(-1, -1, -1), (-1, -1, -1)] and _dm(r.outputs) == [(-1, -1, -1)]


def test_flpga_defaults_answer() -> None:
    """flpga-paddle-crash: Paddle 3.3.1 crashes (SIGSEGV) when called with multi_precision and
    has_bias left to their defaults; spmdkit answers, also with dweight / dbias absent."""
    r = get_rule("fused_linear_param_grad_add")
    res = r.infer_forward(T([4, 2], [1, -1]), T([4, 5], [-1, -1]), None, None)
    assert _dm(res.inputs) == [(1, -1), (1, -1), None, None]
    assert _dm(res.outputs) == [(-1, -1), (-1,)] and _pt(res.outputs[0]) == {1: "sum"} == _pt(res.outputs[1])


def test_flpga_accumulator_resharded() -> None:
    """flpga-accumulator-reshard: dweight / dbias sharded otherwise than the outputs they accumulate
    into: Paddle raises "dweight_dist_attr ... and weight_grad_dist_attr ... should be equal",
    spmdkit asks for them sharded as the outputs (a replicated accumulator becomes partial: one
    rank keeps it, the others hold zeros)."""
    r = get_rule("fused_linear_param_grad_add")
    res = r.infer_forward(T([4, 2], [1, -1]), T([4, 5], [-1, -1]), T([2, 5], [-1, -1]), T([5], [-1]), False, True)
    assert _dm(res.inputs)[2:] == [(-1, -1), (-1,)]
    assert _pt(res.inputs[2]) == {1: "sum"} == _pt(res.inputs[3])
    assert res.inputs[2] == res.outputs[0] and res.inputs[3] == res.outputs[1]
    case = {"rule": "fused_linear_param_grad_add", "mesh": [2, 2], "mode": "forward",
            "args": [J([4, 2], [1, -1]), J([4, 5], [-1, -1]), J([2, 5], [-1, -1]), J([5], [-1]), False, True]}
    assert verify(None, case).status == SOUND


def test_flpga_dbias_from_inferred_dout() -> None:
    """flpga-dbias-from-input: mesh [2,2], x [4,2] [1,0], dout [4,5] [[0,1],-1]: dout is asked
    [1,-1]; Paddle derives dbias_out from the dout it was given (partial{0,1}: sums twice over
    mesh dim 0), spmdkit from the dout it asks for (partial{1})."""
    e = T([], [])
    res = get_rule("fused_linear_param_grad_add").infer_forward(T([4, 2], [1, 0]), T([4, 5], [[0, 1], -1]), e, e,
                                                                False, True)
    assert _dm(res.inputs)[:2] == [(1, 0), (1, -1)]
    assert _dm(res.outputs) == [(0, -1), (-1,)] and _pt(res.outputs[1]) == {1: "sum"}
    case = {"rule": "fused_linear_param_grad_add", "mesh": [2, 2], "mode": "forward",
            "args": [J([4, 2], [1, 0]), J([4, 5], [[0, 1], -1]), J([], []), J([], []), False, True]}
    paddle = {"inputs": [J([4, 2], [1, 0]), J([4, 5], [1, -1]), J([], []), J([], [])],
              "outputs": [J([2, 5], [0, -1], {"1": "sum"}), J([5], [-1], {"0": "sum", "1": "sum"})]}
    assert verify(None, case, result=paddle).status == UNSOUND
    assert verify(None, case).status == SOUND


def test_flpga_reverse() -> None:
    """flpga-fake-reverse: Paddle's backward slot answers no dist attrs at all; spmdkit infers k and
    n from dweight_out / dbias_out (leading axes replicated)."""
    res = get_rule("fused_linear_param_grad_add").infer_backward(
        T([4, 8, 2], [0, -1, -1]), T([4, 8, 6], [-1, -1, -1]), None, None, T([2, 6], [0, 1]), T([6], [1]), False, True)
    assert _dm(res.inputs) == [(-1, -1, 0), (-1, -1, 1), None, None]
    assert _dm(res.outputs) == [(0, 1), (1,)] and not res.outputs[0].partial


# ---------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "args", "exc", "what"), [
    ("bmm", (T([8, 6], [-1, -1]), T([4, 6, 10], [-1, -1, -1])), ShapeMismatchError, "x"),
    ("bmm", (T([4, 8, 6], [-1, -1, -1]), T([4, 5, 10], [-1, -1, -1])), ShapeMismatchError, "y"),
    ("bmm_grad", (T([4, 8, 6], [-1, -1, -1]), T([4, 6, 10], [-1, -1, -1]), T([4, 8, 9], [-1, -1, -1])),
     ShapeMismatchError, "out_grad"),
    ("linear_v2", (T([8, 4], [-1, -1]), T([6, 4], [-1, -1]), T([6], [-1]), True), InvalidAttributeError,
     "transpose_weight"),
    ("fused_gemm_epilogue", (T([8, 4], [-1, -1]), T([4, 6], [-1, -1]), T([5], [-1])), ShapeMismatchError, "bias"),
    ("fused_gemm_epilogue", (T([8, 4], [-1, -1]), T([4, 6], [-1, -1]), T([6, 1], [-1, -1])), ShapeMismatchError,
     "bias"),
    ("fused_linear_param_grad_add", (T([4, 2], [-1, -1]), T([4, 3, 5], [-1, -1, -1]), None, None),
     ShapeMismatchError, "dout"),
    ("fused_linear_param_grad_add", (T([4, 2], [-1, -1]), T([4, 5], [-1, -1]), T([2, 4], [-1, -1]), None),
     ShapeMismatchError, "dweight"),
    ("einsum", ([T([4, 6], [-1, -1])], "ij,jk->ik"), InvalidAttributeError, "equation"),
    ("einsum", ([T([4, 6], [-1, -1]), T([5, 8], [-1, -1])], "ij,jk->ik"), ShapeMismatchError, "inputs"),
    ("einsum", ([T([4, 6], [-1, -1])], "ij->ik"), InvalidAttributeError, "output letter"),
    ("einsum", ([T([4, 6, 2], [-1, -1, -1])], "ij->ij"), ShapeMismatchError, "inputs[0]"),
    ("einsum", ([T([4, 6], [-1, -1]), T([4, 6], [-1, -1])], "...,...->"), InvalidAttributeError, "'...'"),
])
def test_errors(name: str, args: Any, exc: type, what: str) -> None:
    with pytest.raises(exc) as ei:
        get_rule(name).infer_forward(*args)
    assert issubclass(exc, SpmdError)
    assert str(ei.value).startswith(name) and what in str(ei.value)


def test_einsum_grad_errors() -> None:
    with pytest.raises(ShapeMismatchError, match=r"einsum_grad.*inputs"):
        get_rule("einsum_grad").infer_forward([T([4, 6], [-1, -1]), T([5, 8], [-1, -1])], [], T([4, 8], [-1, -1]),
                                              "ij,jk->ik")


def test_einsum_without_operands_is_the_equations_error() -> None:
    """No operand given: the equation's error, einsum_grad as einsum (it raised a TypeError before, read by the
    batch interface as InvalidArgumentError "invalid input")."""
    og = T([4, 8], [-1, -1])
    for name, args in (("einsum", ([], "ij,jk->ik")), ("einsum_grad", ([], [], og, "ij,jk->ik"))):
        with pytest.raises(InvalidAttributeError, match=rf"^{name}: equation 'ij,jk->ik': 2 operands, but inputs"):
            get_rule(name).infer_forward(*args)


def test_gemm_reserve_space_unknown_size_matches() -> None:
    """reserve_space's unknown sizes (-1) match out's / out_grad's, as in every shape check (the shapes were
    compared exactly before); a known size that differs is rejected."""
    fge, grad = get_rule("fused_gemm_epilogue"), get_rule("fused_gemm_epilogue_grad")
    x, y, b, out = T([8, 4], [-1, -1]), T([4, 6], [-1, -1]), T([6], [-1]), T([8, 6], [0, 1])
    r = fge.infer_backward(x, y, b, out, T([-1, 6], [-1, -1]), False, False)
    assert r.outputs[1].dims_mapping == (0, 1) and r.inputs[0].dims_mapping == (0, -1)
    r = grad.infer_forward(x, y, T([8, -1], [-1, -1]), out, False, False)
    assert r.inputs[2].dims_mapping == (0, 1) and r.outputs[2].dims_mapping == (1,)
    with pytest.raises(ShapeMismatchError, match="fused_gemm_epilogue: reserve_space"):
        fge.infer_backward(x, y, b, out, T([7, 6], [-1, -1]), False, False)
    with pytest.raises(ShapeMismatchError, match="fused_gemm_epilogue_grad: reserve_space"):
        grad.infer_forward(x, y, T([8, 5], [-1, -1]), out, False, False)


# ---------------------------------------------------------------------------
# references against numeric gradients, soundness
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(("eq", "shapes"), [
    ("ij,jk->ik", [(2, 3), (3, 4)]), ("ii->i", [(3, 3)]), ("iji,j", [(2, 3, 2), (3,)]),
    ("...ij,...jk", [(1, 2, 3), (4, 3, 2)]), ("bij,k->bk", [(2, 2, 3), (4,)]), ("i,j", [(2,), (3,)]),
    ("a...,...b->a...b", [(2, 1, 3), (4, 3, 5)]), (",ab->", [(), (2, 3)]), ("aab,bc,c->a", [(2, 2, 3), (3, 4), (4,)]),
])
def test_einsum_grad_reference_is_the_gradient(eq: str, shapes: list[tuple[int, ...]]) -> None:
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal(s) for s in shapes]
    out = _run("einsum", {"inputs": xs, "equation": eq})[0]
    np.testing.assert_allclose(out, np.einsum(eq, *xs), equal_nan=False)
    g = rng.standard_normal(np.shape(out))
    grads = _run("einsum_grad", {"inputs": xs, "inner_cache": [], "out_grad": g, "equation": eq})
    for i in range(len(xs)):
        def f(v: np.ndarray, i: int = i) -> np.ndarray:
            return np.asarray(_run("einsum", {"inputs": [v if j == i else x for j, x in enumerate(xs)],
                                              "equation": eq})[0])

        np.testing.assert_allclose(grads[i], _num_grad(f, xs[i], g), rtol=1e-5, atol=1e-8, equal_nan=False)


SOUND_RULES = ["bmm", "bmm_grad", "linear_v2", "linear_v2_grad", "fused_gemm_epilogue", "fused_gemm_epilogue_grad",
               "fused_linear_param_grad_add", "einsum", "einsum_grad"]


@pytest.mark.parametrize("name", SOUND_RULES)
def test_sound_on_generated_cases(name: str) -> None:
    for mode in get_rule(name).modes:
        rep = verify_rule(name, 200, 5, mode)
        assert rep.cases == 200 and rep.unsound == 0, rep.first_unsound
        assert rep.sound > 100


# ---------------------------------------------------------------------------
# linear_v2: an absent bias (None / JSON null, or 0-D as Paddle's callers pass it)
# ---------------------------------------------------------------------------


def test_linear_v2_absent_bias() -> None:
    from spmdkit.io.codec import answer_line

    lin = get_rule("linear_v2")
    x, w = T([8, 4], [0, -1]), T([4, 6], [-1, 1])
    with_bias = lin.infer_forward(x, w, T([6], [-1]))
    no_bias = lin.infer_forward(x, w, None)
    assert no_bias.inputs[2] is None
    assert no_bias.inputs[:2] == with_bias.inputs[:2] and no_bias.outputs == with_bias.outputs
    # keyword and default-free JSON forms
    assert lin.infer_forward(input=x, weight=w, bias=None) == no_bias
    got = answer_line('{"rule": "linear_v2", "mesh": [2, 3], "args": [{"shape": [8, 4], "dims_mapping": [0, -1]}, '
                      '{"shape": [4, 6], "dims_mapping": [-1, 1]}, null, false]}')
    assert "error" not in got and got["inputs"][2] is None
    # a sharded k: the matmul axes replicated, as with a bias
    r = lin.infer_forward(T([8, 4], [0, 1]), T([4, 6], [1, -1]), None)
    assert [a.dims_mapping for a in r.inputs[:2]] == [(-1, -1), (-1, -1)] and r.inputs[2] is None
    # grad: no bias, no bias_grad
    g = get_rule("linear_v2_grad").infer_forward(T([2, 8, 4], [0, -1, -1]), T([4, 6], [-1, 1]), None,
                                                 T([2, 8, 6], [0, -1, 1]))
    assert g.inputs[2] is None and g.outputs[2] is None and g.outputs[0] is not None
    # reverse
    rv = get_rule("linear_v2").infer_backward(x, w, None, T([8, 6], [0, 1]), None)
    assert rv.inputs[2] is None


@pytest.mark.parametrize(("rule", "mode", "slots"), [
    ("linear_v2", "forward", ["bias"]),
    ("linear_v2", "backward", ["bias", "reserve_space"]),
    ("linear_v2_grad", "forward", ["bias"]),
    ("fused_gemm_epilogue_grad", "forward", ["reserve_space"]),
])
def test_zero_d_optional_is_absent(rule: str, mode: str, slots: list[str]) -> None:
    from spmd_helpers import assert_0d_is_absent

    assert_0d_is_absent(rule, mode, 17, slots, n=16)


def test_linear_v2_absent_bias_sound() -> None:
    # the generator makes a quarter of its cases without a bias
    for mode, rule in (("forward", "linear_v2"), ("backward", "linear_v2"), ("forward", "linear_v2_grad")):
        rep = verify_rule(rule, 60, seed=23, mode=mode)
        assert rep.unsound == 0 and rep.skipped == 0, rep.first_unsound or rep.first_skipped
