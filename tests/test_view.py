"""View family: the DimTrans algebra, reshape / flatten / squeeze / unsqueeze rules, errors,
deviations from Paddle 3.3.1 and a hypothesis soundness property."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spmdkit.core import DistTensorSpec, ProcessMesh, TensorDistAttr
from spmdkit.core.errors import InvalidAttributeError, ShapeMismatchError, SpmdError
from spmdkit.engine.dim_trans import (
    Flatten,
    InputDim,
    Singleton,
    Split,
    flatten_trans,
    reshape_trans,
    squeeze_trans,
    unsqueeze_trans,
)
from spmdkit.ops import get_rule
from spmdkit.sim import verify_rule


def spec(mesh: list[int], shape: list[int], dm: list[object], partial: object = None) -> DistTensorSpec:
    return DistTensorSpec(shape, TensorDistAttr(ProcessMesh(mesh), dm, partial))


def dms(res: object) -> tuple[list[object], list[object]]:
    return ([list(a.dims_mapping) for a in res.inputs], [list(a.dims_mapping) for a in res.outputs])  # type: ignore[attr-defined]


def test_reshape_trans_golden() -> None:
    s = Split(InputDim(3), (4, 6), 0)
    assert reshape_trans((6, 12, 48, 24), (1, 72, 48, 4, 6)) == (
        Singleton(), Flatten((0, 1)), InputDim(2), s, Split(InputDim(3), (4, 6), 1))
    assert reshape_trans((1, 8), (1, 8)) == (InputDim(0), InputDim(1))  # 1 -> 1 keeps the axis
    assert reshape_trans((1, 8), (8,)) == (InputDim(1),)
    assert reshape_trans((8,), (1, 8)) == (Singleton(), InputDim(0))
    assert reshape_trans((4, 1, 8), (32,)) == (Flatten((0, 2)),)
    assert flatten_trans((8, 16, 4), 1, 2) == ((InputDim(0), Flatten((1, 2))), (8, 64))
    assert squeeze_trans((8, 1, 4), (0,)) == ((InputDim(0), Singleton(), InputDim(2)), (8, 1, 4))
    assert unsqueeze_trans((8, 4), (0, -1)) == ((Singleton(), InputDim(0), InputDim(1), Singleton()), (1, 8, 4, 1))


def test_reshape_coshard() -> None:
    f = get_rule("reshape").infer_forward
    assert dms(f(spec([2, 4], [8, 16], [0, 1]), [128])) == ([[(0, 1), -1]], [[(0, 1)]])
    assert dms(f(spec([2, 4, 2], [8, 16, 4], [0, 1, 2]), [512])) == ([[(0, 1), -1, -1]], [[(0, 1)]])
    assert dms(f(spec([2, 4], [6, 16], [0, 1]), [96])) == ([[0, -1]], [[0]])
    assert dms(f(spec([2, 4], [16, 3], [(0, 1), -1]), [8, 2, 3])) == ([[(0, 1), -1]], [[(0, 1), -1, -1]])
    assert dms(f(spec([2, 4], [8, 6], [(0, 1), -1]), [2, 4, 6])) == ([[-1, -1]], [[-1, -1, -1]])


def test_reshape_split_divisibility_and_uneven() -> None:
    f = get_rule("reshape").infer_forward
    assert dms(f(spec([3, 4], [24], [1]), [2, 12])) == ([[-1]], [[-1, -1]])
    assert dms(f(spec([4], [6, 5], [0, -1]), [30])) == ([[-1, -1]], [[-1]])  # uneven leftmost: dropped
    assert dms(f(spec([4], [6, 5], [0, -1]), [0, 5])) == ([[0, -1]], [[0, -1]])  # axis unchanged: kept


@pytest.mark.parametrize("target, msg", [([-1, -1], "more than one -1"), ([5, 7], "holds 35"),
                                         ([-2, -16], "negative size"), ([4, 0, 0], "has 0 at index 2")])
def test_reshape_bad_target(target: list[int], msg: str) -> None:
    with pytest.raises(InvalidAttributeError, match=msg) as e:
        get_rule("reshape").infer_forward(spec([2, 4], [8, 4], [0, 1]), target)
    assert "shape" in str(e.value) and "reshape" in str(e.value)


def test_axis_errors() -> None:
    x = spec([2, 4], [8, 1, 4], [0, -1, -1])
    with pytest.raises(InvalidAttributeError, match="stop_axis"):
        get_rule("flatten").infer_forward(x, 0, 3)
    with pytest.raises(InvalidAttributeError, match="flatten: start_axis 2 comes after stop_axis 1"):
        get_rule("flatten").infer_forward(x, 2, 1)
    assert dms(get_rule("flatten").infer_forward(x, 2, -1)) == ([[0, -1, -1]], [[0, -1, -1]])  # 2 == -1: identity
    with pytest.raises(InvalidAttributeError, match="squeeze: axis 5"):
        get_rule("squeeze").infer_forward(x, [5])
    with pytest.raises(InvalidAttributeError, match="unsqueeze: axis 5"):
        get_rule("unsqueeze").infer_forward(x, [5])


def test_invalid_axis_raises() -> None:
    """view-invalid-attr: Paddle answers squeeze axis 5 of a 3-D x; spmdkit raises."""
    with pytest.raises(SpmdError):
        get_rule("squeeze").infer_forward(spec([2, 4], [8, 1, 4], [0, 1, -1]), [5])


def test_unsqueeze_axis_order() -> None:
    """view-unsqueeze-axis-order: [8,4] unsqueeze [0,-1] is [1,8,4,1] (as the op)."""
    r = get_rule("unsqueeze").infer_forward(spec([2, 4], [8, 4], [0, 1]), [0, -1])
    assert dms(r) == ([[0, 1]], [[-1, 0, 1, -1]])
    r = get_rule("unsqueeze").infer_forward(spec([2, 4], [8, 4], [0, 1]), [1, 1])
    assert dms(r) == ([[0, 1]], [[0, -1, -1, 1]])


def test_reverse_partial_out_cleared() -> None:
    """view-reverse-partial: out is what the (unpartial) x produces."""
    x = spec([2, 4], [8, 16], [-1, -1])
    out = spec([2, 4], [128], [0], [1])
    r = get_rule("reshape").infer_backward(x, out, [-1])
    assert dms(r) == ([[0, -1]], [[0]])
    assert not r.outputs[0].partial and not r.inputs[0].partial


def test_reverse_flatten_uneven() -> None:
    """view-reverse-flatten-uneven: out [2,4,16] [0,1,-1] -> x [8,16] [0,-1] (not co-shard)."""
    x = spec([2, 4], [8, 16], [-1, -1])
    out = spec([2, 4], [2, 4, 16], [0, 1, -1])
    assert dms(get_rule("reshape").infer_backward(x, out, [2, 4, 16])) == ([[0, -1]], [[0, -1, -1]])


def test_partial_forward() -> None:
    r = get_rule("reshape").infer_forward(spec([2, 4], [8, 16], [0, -1], [1]), [128])
    assert r.outputs[0].partial and r.inputs[0].partial
    r = get_rule("squeeze").infer_forward(spec([2, 4], [8, 1, 4], [0, -1, -1], [1]), [1])
    assert not r.outputs[0].partial


def test_grads() -> None:
    r = get_rule("reshape_grad").infer_forward(spec([2, 4], [8, 4], [0, 1]), spec([2, 4], [32], [0]))
    assert [list(a.dims_mapping) for a in r.outputs] == [[0, -1]]


@pytest.mark.parametrize("name", ["reshape", "flatten", "squeeze", "unsqueeze", "reshape_grad",
                                  "flatten_grad", "squeeze_grad", "unsqueeze_grad"])
def test_sound_generated(name: str) -> None:
    for mode in ("forward", "backward"):
        rep = verify_rule(name, 60, seed=3, mode=mode)
        assert rep.unsound == 0, rep.first_unsound


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([1, 2, 3, 4, 6, 8]), min_size=1, max_size=4),
       st.lists(st.sampled_from([-1, 0, 1]), min_size=4, max_size=4), st.data())
def test_reshape_property(shape: list[int], dm: list[int], data: st.DataObject) -> None:
    from spmdkit.sim.verify import verify

    dm = dm[: len(shape)]
    if dm.count(0) > 1 or dm.count(1) > 1:
        return
    n = 1
    for s in shape:
        n *= s
    a = data.draw(st.sampled_from([d for d in range(1, n + 1) if n % d == 0]))
    case = {"rule": "reshape", "mesh": [2, 3], "mode": "forward",
            "args": [{"shape": shape, "dims_mapping": dm}, [a, -1]]}
    v = verify(None, case)
    assert v.status != "unsound", v.detail


def test_reshape_dynamic_sizes() -> None:
    """Paddle's reshape unit test: x [-1,-1,3072], shape [0,0,-1,192] (0 copies the dynamic axis,
    -1 is inferred from the known sizes: 16)."""
    f = get_rule("reshape").infer_forward
    assert dms(f(spec([2, 3], [-1, -1, 3072], [0, 1, -1]), [0, 0, -1, 192])) == ([[0, 1, -1]], [[0, 1, -1, -1]])
    # 16 is not divisible by mesh dim 1 (3): the split's first piece cannot keep it
    assert dms(f(spec([2, 3], [-1, -1, 3072], [0, -1, 1]), [0, 0, -1, 192])) == ([[0, -1, -1]], [[0, -1, -1, -1]])
    assert dms(f(spec([2, 3], [-1, -1, 3072], [1, -1, 0]), [0, 0, -1, 192])) == ([[1, -1, 0]], [[1, -1, 0, -1]])
    b = get_rule("reshape").infer_backward
    r = b(spec([2, 3], [-1, -1, 3072], [-1, -1, -1]), spec([2, 3], [-1, -1, 16, 192], [1, 0, -1, -1]),
          [0, 0, -1, 192])
    assert dms(r) == ([[1, 0, -1]], [[1, 0, -1, -1]])


def test_reshape_dynamic_after_size1_axes() -> None:
    """A dynamic axis after size-1 axes the two shapes place differently stays at its index (the
    walk once lost the alignment there and looped forever or failed with an IndexError)."""
    f, b = get_rule("reshape").infer_forward, get_rule("reshape").infer_backward
    r = b(spec([2, 3], [2, 1, -1, 1], [-1, -1, 1, -1]), spec([2, 3], [1, 2, -1, 1], [-1, 1, -1, 0]), [1, 2, 0, 1])
    assert dms(r) == ([[1, -1, -1, 0]], [[-1, 1, -1, 0]])
    r = f(spec([2], [1, 1, 3, 8, -1, 2], [-1, -1, -1, -1, -1, 0]), [4, 2, 3, 1, 0, 2, 1])
    assert dms(r) == ([[-1, -1, -1, -1, -1, 0]], [[-1, -1, -1, -1, -1, 0, -1]])
    r = f(spec([3, 4], [1, 2, -1, 1], [-1, -1, 1, 0]), [2, 1, 0])
    assert dms(r) == ([[-1, -1, 1, -1]], [[-1, -1, 1]])


@pytest.mark.parametrize(("shape", "target", "msg"), [
    ([6, -1], [0, 6], "must copy it with 0 at index 1"),
    ([4, -1], [2, 0, 2], "same elements before the dynamic axis 1"),
    ([-1, -1], [-1, 0], "must copy it with 0 at index 0"),
])
def test_reshape_dynamic_sizes_not_copied(shape: list[int], target: list[int], msg: str) -> None:
    with pytest.raises(ShapeMismatchError) as e:
        get_rule("reshape").infer_forward(spec([2], shape, [-1] * len(shape)), target)
    assert msg in str(e.value) and "reshape" in str(e.value)


def _paddle_view(trans: tuple[object, ...], shape: tuple[int, ...], dm: tuple[object, ...],
                 mesh: tuple[int, ...]) -> tuple[tuple[object, ...], tuple[object, ...]]:
    """A plain transcription of Paddle 3.3.1's propagation through a list (dim_trans.cc), the
    spec the rules' compiled plans are held to: (x's dims_mapping, out's)."""

    def dims(e: object) -> tuple[int, ...]:
        return e if isinstance(e, tuple) else () if e == -1 else (e,)  # type: ignore[return-value]

    new_in: list[object] = [-1] * len(shape)
    out: list[object] = [-1] * len(trans)
    for i, t in enumerate(trans):
        if isinstance(t, InputDim):
            out[i] = new_in[t.dim] = dm[t.dim]
            continue
        if isinstance(t, Flatten):
            axes, sizes = t.dims, [shape[t.dims[0]]]
        elif isinstance(t, Split) and t.piece == 0:
            axes = (t.source.dim,) if isinstance(t.source, InputDim) else t.source.dims  # type: ignore[union-attr]
            sizes = [shape[axes[0]], t.shape[0]]
        else:
            continue
        keep: tuple[int, ...] = ()
        p = 1
        for k in axes:  # the leftmost axis's mesh dims, then the next sharded axes', whole
            if not dims(dm[k]):
                break
            for d in dims(dm[k]):
                p *= mesh[d]
            if any(s % p for s in sizes):
                break
            keep += dims(dm[k])
        if keep:
            out[i] = new_in[axes[0]] = keep[0] if len(keep) == 1 else keep
    return tuple(new_in), tuple(out)


def test_rules_match_paddles_propagation() -> None:
    """The view rules' plans answer as the plain propagation over the op's list, on random
    shapes, co-shards and partial x (reshape and its reverse and grad, flatten, squeeze,
    unsqueeze); reshape_links is the structure of reshape_trans."""
    import random

    from spmdkit.engine.axes import one_mesh_dim
    from spmdkit.engine.dim_trans import invert_trans, links, reshape_links

    r = random.Random(7)

    def factor(n: int) -> list[int]:
        out = []
        while n > 1:
            d = r.choice([d for d in range(2, n + 1) if n % d == 0])
            out.append(d)
            n //= d
        for _ in range(r.randint(0, 2)):
            out.insert(r.randint(0, len(out)), 1)
        return out or [1]

    def mapping(nd: int, mesh: tuple[int, ...]) -> tuple[object, ...]:
        dm: list[object] = [-1] * nd
        for d in range(len(mesh) if nd else 0):
            i = r.randrange(nd)
            if dm[i] == -1:
                dm[i] = d
            elif r.random() < 0.5:
                prev = dm[i]
                dm[i] = (*(prev if isinstance(prev, tuple) else (prev,)), d)
        return tuple(dm)

    for _ in range(1500):
        n = r.choice([1, 2, 6, 8, 12, 24, 48, 72])
        a, b = tuple(factor(n)), tuple(factor(n))
        mesh = tuple(r.choice([2, 3, 4]) for _ in range(r.randint(1, 3)))
        dm, odm = mapping(len(a), mesh), mapping(len(b), mesh)
        pt = [d for d in range(len(mesh)) if r.random() < 0.2 and all(d not in (e if isinstance(e, tuple) else (e,)) for e in dm)]
        x = spec(list(mesh), list(a), list(dm), pt)
        key = (a, b, dm, odm, mesh, pt)
        assert reshape_links(a, b) == links(reshape_trans(a, b)), key
        got = get_rule("reshape").infer_forward(x, list(b))
        assert dms(got) == tuple([list(v)] for v in _paddle_view(reshape_trans(a, b), a, dm, mesh)), key
        assert got.inputs[0].partial == got.outputs[0].partial == x.dist_attr.partial, key
        got = get_rule("reshape").infer_backward(x, spec(list(mesh), list(b), list(odm)), list(b))
        want = _paddle_view(reshape_trans(b, a), b, one_mesh_dim(odm, mesh), mesh)  # type: ignore[arg-type]
        assert dms(got) == ([list(want[1])], [list(want[0])]), key
        got = get_rule("reshape_grad").infer_forward(spec(list(mesh), list(a), [-1] * len(a)), x)
        assert dms(got)[1] == [list(_paddle_view(reshape_trans(a, a), a, dm, mesh)[1])], key
        s0, s1 = sorted((r.randrange(len(a)), r.randrange(len(a))))
        trans, _ = flatten_trans(a, s0, s1)
        got = get_rule("flatten").infer_forward(x, s0, s1)
        assert dms(got) == tuple([list(v)] for v in _paddle_view(trans, a, dm, mesh)), key
        one = one_mesh_dim(dm, mesh)  # type: ignore[arg-type]
        for op, axis, make in (("squeeze", [i for i, v in enumerate(a) if v == 1 and r.random() < 0.5], squeeze_trans),
                               ("unsqueeze", [r.randint(0, len(a))], unsqueeze_trans)):
            trans, oshape = make(a, tuple(axis))
            got = get_rule(op).infer_forward(x, axis)
            assert dms(got) == tuple([list(v)] for v in _paddle_view(trans, a, one, mesh)), (op, key)
            assert not got.outputs[0].partial
            om = mapping(len(oshape), mesh)
            got = get_rule(op).infer_backward(x, spec(list(mesh), list(oshape), list(om)), axis)
            want = _paddle_view(invert_trans(trans, len(a)), oshape, one_mesh_dim(om, mesh), mesh)  # type: ignore[arg-type]
            assert dms(got) == ([list(want[1])], [list(want[0])]), (op, key)
