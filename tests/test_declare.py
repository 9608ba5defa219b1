"""engine/declare.py: rule functions generated from declarations (spmdkit.engine.declare)."""

from __future__ import annotations

import inspect
import random

import pytest

from spmdkit.core.dist_attr import ReduceType, TensorDistAttr
from spmdkit.core.errors import InvalidArgumentError, InvalidAttributeError, InvalidMeshError, ShapeMismatchError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.spec import DistTensorSpec
from spmdkit.engine.compiler import compile_plan, infer, traced
from spmdkit.engine.declare import Way, declare, generate, ones
from spmdkit.engine.notation import Notation, letters_for
from spmdkit.engine.signature import GRAD, REVERSE
from spmdkit.ops import get_rule, set_cache_enabled

M = ProcessMesh([2, 4])


def t(shape: list[int], dm: list[object], mesh: ProcessMesh = M) -> DistTensorSpec:
    return DistTensorSpec(shape, mesh=mesh, dims_mapping=dm)


def _rowwise(ndim: int, axis: int) -> Notation:
    x = letters_for(ndim)
    if not 0 <= axis < ndim:
        raise InvalidAttributeError(f"axis {axis} out of range")
    return Notation([x], [x], replicated=x[axis], prune="*")


def test_generated_function_has_the_real_signature_and_answers_as_the_plan() -> None:
    f = generate("rowwise", "x: T, axis: int = 1", Way(_rowwise, key="x, axis"), name="rowwise_forward")
    assert f.__name__ == "rowwise_forward"
    assert list(inspect.signature(f).parameters) == ["x", "axis"]
    assert inspect.signature(f).parameters["axis"].default == 1
    assert "*" not in f.source.split("\n")[0]  # no *args parsing
    rng = random.Random(0)
    for _ in range(200):
        nd = rng.randint(1, 4)
        shape = [rng.choice([1, 2, 3, 4, 6, 8]) for _ in range(nd)]
        dm = [rng.choice([-1, 0, 1]) for _ in range(nd)]
        if dm.count(0) > 1 or dm.count(1) > 1:
            continue
        axis = rng.randrange(nd)
        x = t(shape, dm)
        want = infer(compile_plan(_rowwise(nd, axis)), "rowwise", (x,), (), M, ("x",))
        got = f(x, axis)
        assert (tuple(got.inputs), tuple(got.outputs)) == want
        assert got.inputs[0].dims_mapping[axis] == -1  # type: ignore[union-attr]


def test_plan_compiled_once_per_key_not_per_shape() -> None:
    calls: list[tuple[int, int]] = []

    def nt(ndim: int, axis: int) -> Notation:
        calls.append((ndim, axis))
        return _rowwise(ndim, axis)

    f = generate("rowwise", "x: T, axis: int = 1", Way(nt, key="x, axis"))
    for n in range(1, 40):
        f(t([2 * n, 4 * n, 3], [0, 1, -1]), 2)
    assert calls == [(3, 2)]
    f(t([2, 4, 3], [0, 1, -1]), 1)
    assert calls == [(3, 2), (3, 1)]
    assert f.plan((3, 2)) is f.plan((3, 2))
    assert f.plan((3, 2)).notation == _rowwise(3, 2)


def test_errors_name_the_op_and_the_arguments() -> None:
    f = generate("rowwise", "x: T, out: T, axis: int = 1", Way(_rowwise, key="x, axis", same=[("x", "out")]),
                 "backward", ["out"])  # fmt: skip
    x = t([4, 8], [0, -1])
    with pytest.raises(ShapeMismatchError, match=r"rowwise: out has shape \[4, 6\], x has \[4, 8\]"):
        f(x, t([4, 6], [-1, -1]), 1)
    with pytest.raises(InvalidMeshError, match="rowwise: out lies on a different mesh than x"):
        f(x, t([4, 8], [-1, -1], ProcessMesh([8])), 1)
    # a notation function's error without the op gets it
    with pytest.raises(InvalidAttributeError, match=r"^rowwise: axis 5 out of range$"):
        f(x, t([4, 8], [-1, -1]), 5)
    # more than 26 dims: letters_for's error names the op
    big = t([1] * 27, [-1] * 27)
    with pytest.raises(ShapeMismatchError, match=r"^rowwise: tensors of more than 26 dims"):
        f(big, big, 0)
    # -1 sizes match anything
    r = f(t([-1, 8], [0, -1]), t([4, -1], [0, 1]), 1)
    assert r.inputs[0].dims_mapping == (0, -1)  # type: ignore[union-attr]


def test_check_post_mask_and_optional_tensors() -> None:
    seen: list[int] = []

    def check(x: DistTensorSpec, y: DistTensorSpec | None, flag: bool) -> None:
        if flag and y is None:
            raise InvalidAttributeError("flag needs y")

    def post(ins: tuple[TensorDistAttr, ...], outs: tuple[TensorDistAttr, ...], x: DistTensorSpec,
             y: DistTensorSpec | None, flag: bool) -> tuple[list[TensorDistAttr], list[TensorDistAttr]]:  # fmt: skip
        o = outs[0]
        assert o.dims_mapping == (0, 1)  # the broadcast axis's letter still sharded on out
        return list(ins), [TensorDistAttr(o.mesh, [0, -1], {1: ReduceType.MAX})]

    def nt(nx: int, ny: int, flag: bool, mask: tuple[int, int]) -> Notation:
        seen.append(mask[0])
        a = letters_for(nx)
        return Notation([a, None if ny < 0 else a], [a], size1="broadcast")

    way = Way(nt, key="x, y, flag", mask=("x", "y"), check=check, post=post)
    f = generate("pair", "x: T, y: T?, flag: bool = False", way)
    r = f(t([4, 1], [0, 1]), None, False)
    assert r.inputs == (TensorDistAttr(M, [0, -1]), None)  # the size-1 axis shards nothing
    assert r.outputs[0].partial == ((1, ReduceType.MAX),)  # type: ignore[union-attr]
    assert seen == [0b10]
    with pytest.raises(InvalidAttributeError, match=r"^pair: flag needs y$"):
        f(t([4, 1], [0, 1]), None, True)
    with pytest.raises(InvalidMeshError, match="pair: y lies on a different mesh"):
        f(t([4, 2], [0, -1]), t([4, 2], [-1, -1], ProcessMesh([8])), False)
    assert ones(t([1, 3, 1], [-1, -1, -1])) == 0b101 and ones(None) == 0


def test_letters_check_and_callable_key() -> None:
    def perm_nt(ndim: int, first: int) -> Notation:
        x = letters_for(ndim)
        return Notation([x], [x[first:] + x[:first]])

    way = Way(perm_nt, key=lambda x, out, k: (len(x.shape), k), letters=True)
    f = generate("roll", "x: T, out: T, k: int = 1", way, "backward", ["out"])
    r = f(t([2, 4], [-1, -1]), t([4, 2], [1, 0]), 1)
    assert r.inputs[0].dims_mapping == (0, 1)  # type: ignore[union-attr]
    with pytest.raises(ShapeMismatchError, match="roll: axis sizes disagree: x has 2 and out has 3"):
        f(t([2, 4], [-1, -1]), t([4, 3], [-1, -1]), 1)


def test_bad_declarations_rejected() -> None:
    with pytest.raises(ValueError, match="same-shape pair"):
        generate("op", "x: T", Way(_rowwise, same=[("x", "z")]))
    with pytest.raises(ValueError, match="single tensor"):
        generate("op", "x: T, xs: [T]", Way(_rowwise, same=[("x", "xs")]))
    with pytest.raises(ValueError, match="inputs' order"):
        generate("op", "x: T, y: T", Way(_rowwise, mask=("y", "x")))
    with pytest.raises(ValueError, match="not both"):
        declare("never_registered", "x: T", Way(_rowwise), reverse=Way(_rowwise), grad=Way(_rowwise),
                outputs="out: T", grad_signature="x: T, out_grad: T")  # fmt: skip


def test_declared_rules_registered_with_kinds_and_answered_through_plans() -> None:
    sm = get_rule("softmax")
    assert sm.backward is not None and sm.backward.kind == REVERSE
    assert [p.name for p in sm.backward.params] == ["x", "out", "axis"]
    assert (sm.forward.function_name, sm.backward.function_name) == ("SoftmaxInferSpmd", "SoftmaxInferSpmdReverse")
    assert sm.outputs == ("out",)
    set_cache_enabled(False)
    try:
        with traced() as ops:
            sm.infer_forward(t([4, 8], [0, 1]), -1)
            sm.infer_backward(t([4, 8], [-1, -1]), t([4, 8], [0, 1]), 0)
            get_rule("softmax_grad").infer_forward(t([4, 8], [0, 1]), t([4, 8], [1, -1]), 1)
        assert ops == ["softmax", "softmax", "softmax_grad"]
    finally:
        set_cache_enabled(True)
    assert GRAD == "grad"


def test_lists_of_tensors() -> None:
    """A ``[T]`` parameter: its items are inputs of the notation in order, the key holds their
    ranks, the answer holds their attrs as one tuple, errors name the item."""

    def stack_nt(ranks: tuple[int, ...]) -> Notation:
        a = letters_for(ranks[0])
        return Notation([a] * len(ranks), ["z" + a], replicated="z")

    f = generate("stackish", "x: [T], axis: int = 0", Way(stack_nt, key="x"), name="stackish")
    xs = [t([4, 6], [0, -1]), t([4, 6], [-1, 1])]
    r = f(xs, 0)
    assert isinstance(r.inputs[0], tuple) and len(r.inputs[0]) == 2
    assert [a.dims_mapping for a in r.inputs[0]] == [(0, 1), (0, 1)]  # merged: weight tie, first claims
    assert r.outputs[0].dims_mapping == (-1, 0, 1)  # type: ignore[union-attr]
    assert f.plan(((2, 2),)).notation == stack_nt((2, 2))
    with pytest.raises(InvalidMeshError, match=r"stackish: x\[1\] lies on a different mesh than x\[0\]"):
        f([xs[0], t([4, 6], [-1, -1], ProcessMesh([8]))], 0)
    with pytest.raises(InvalidMeshError, match="stackish: no tensor"):
        f([], 0)

    # reverse of a split: the outputs a list, letters checked per item
    def split_nt(nd: int, ranks: tuple[int, ...]) -> Notation:
        a = letters_for(nd)
        return Notation([a], [a] * len(ranks))

    g = generate("splitish", "x: T, out: [T]", Way(split_nt, key="x, out", letters=True), "backward", ["out"])
    r = g(t([4, 6], [-1, -1]), [t([4, 6], [0, -1]), t([4, 6], [-1, -1])])
    assert r.inputs[0].dims_mapping == (0, -1)  # type: ignore[union-attr]
    assert [a.dims_mapping for a in r.outputs[0]] == [(0, -1), (0, -1)]  # type: ignore[union-attr]
    with pytest.raises(ShapeMismatchError, match=r"splitish: axis sizes disagree: x has 4 and out\[1\] has 5"):
        g(t([4, 6], [-1, -1]), [t([4, 6], [0, -1]), t([5, 6], [-1, -1])])


def test_tail_nonempty_pre_and_out_shapes() -> None:
    """``tail``: every tensor an input of the notation, the answer's outputs absent labelled
    tensors (int) or the tensors from a parameter on (name), never partial; ``nonempty`` and
    ``pre`` run before the mesh is read; ``out_shapes`` reaches a flatten letter's sizes."""

    def upd(nd: int, *given: bool) -> Notation:  # x, lr (replicated), then the reverse's out, then x_out, lr_out
        a = letters_for(nd)
        src = [2] if given else [0]
        return Notation([a, "1", *([a] if given else []), a, "1"], [], sources=src)

    f = generate("upd", "x: T, lr: T", Way(upd, key="x", tail=2), name="upd")
    r = f(t([4, 6], [0, 1], ), t([1], [0]))
    assert [a.dims_mapping for a in r.inputs] == [(0, 1), (-1,)]
    assert [(a.dims_mapping, a.partial) for a in r.outputs] == [((0, 1), ()), ((-1,), ())]  # not partial
    g = generate("upd", "x: T, lr: T, x_out: T", Way(upd, key="x, True", tail=2), "backward", ["x_out"])
    r = g(t([4, 6], [-1, -1]), t([1], [-1]), t([4, 6], [1, -1]))
    assert [a.dims_mapping for a in r.inputs] == [(1, -1), (-1,)]  # merged from x_out alone
    assert [a.dims_mapping for a in r.outputs] == [(1, -1), (-1,)]

    def batch(ins: tuple[int, ...], outs: tuple[int, ...]) -> Notation:
        return Notation([None if k < 0 else "b" + "1" * (k - 1) for k in ins + outs], [], sources=range(len(ins)))

    h = generate("dp", "ins: [T?], outs: [T?]", Way(batch, key="ins, outs", tail="outs", nonempty=("ins", "outs")))
    r = h([t([8, 2], [0, 1]), None], [t([8], [-1])])
    assert r.inputs == (r.inputs[0], None) and r.inputs[0].dims_mapping == (0, -1)  # type: ignore[union-attr]
    assert r.outputs[0].dims_mapping == (0,)  # type: ignore[union-attr]
    with pytest.raises(InvalidArgumentError, match="dp: ins and outs hold no tensor"):
        h([None], [])

    def seen(equation: str) -> None:
        raise InvalidAttributeError(f"equation {equation!r} names no operand")

    def no_operand(x: list[DistTensorSpec], eq: str) -> None:
        if not x:
            seen(eq)

    e = generate("ein", "x: [T], eq: str", Way(lambda r: Notation(["a"] * len(r), ["a"]), key="x", pre=no_operand))
    with pytest.raises(InvalidAttributeError, match="ein: equation 'i' names no operand"):
        e([], "i")

    def view(n: int) -> Notation:  # x (a, b) -> out (a*b): a co-sharded over a's and b's mesh dims
        return Notation(["ab"], ["a"], flatten=["ab"])

    v = generate("flat", "x: T", Way(view, key="x", out_shapes=lambda x: ((x.shape[0] * x.shape[1],),)))
    assert v(t([8, 8], [0, 1])).outputs[0].dims_mapping == ((0, 1),)  # type: ignore[union-attr]
    w = generate("flat", "x: T", Way(view, key="x", out_shapes=lambda: ((4,),)))  # out's size counts: 8 does not divide 4
    assert w(t([8, 8], [0, 1])).outputs[0].dims_mapping == (0,)  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="tail 'zs' is not a tensor"):
        generate("bad", "x: T", Way(_rowwise, tail="zs"))
    with pytest.raises(ValueError, match="nonempty 'x' is not a list"):
        generate("bad", "x: T", Way(_rowwise, nonempty=("x",)))


def test_mask_may_skip_an_input() -> None:
    """A masked tensor after an unmasked one: 0 in the key's mask for the skipped input."""
    got: list[tuple[int, ...]] = []

    def nt(nx: int, mask: tuple[int, ...]) -> Notation:
        got.append(mask)
        a = letters_for(nx)
        return Notation([a, None, a], [a], size1="broadcast")

    f = generate("skip", "x: T, z: T?, y: T", Way(nt, key="x", mask=("x", "y")))
    r = f(t([4, 1], [0, 1]), None, t([4, 1], [-1, -1]))
    assert got == [(2, 0, 2)]
    assert r.inputs[0].dims_mapping == (0, -1)  # type: ignore[union-attr]


def test_parameters_named_like_the_generated_locals_are_not_hidden() -> None:
    """Tensors named k, p, m, r, mesh (and an attribute named e) answer as x, y, z, w, v, a do:
    the generated function's own locals never hide a parameter (flash_attention has a k)."""

    def nt(*ranks: int) -> Notation:
        return Notation([letters_for(r) for r in ranks], [letters_for(ranks[0])], conflict="first")

    plain = generate("five", "x: T, y: T, z: T, w: T, v: T, a: int = 0", Way(nt, key="x, y, z, w, v"))
    named = generate("five", "k: T, p: T, m: T, r: T, mesh: T, e: int = 0", Way(nt, key="k, p, m, r, mesh"))
    rng = random.Random(3)
    for _ in range(50):
        specs = [t([4, 8], [rng.choice([-1, 0, 1]), -1]) for _ in range(5)]
        assert plain(*specs, 1) == named(*specs, 1)
    other = ProcessMesh([4, 2])
    with pytest.raises(InvalidMeshError, match="five: mesh lies on a different mesh than k"):
        named(t([4, 8], [0, -1]), t([4, 8], [0, -1]), t([4, 8], [0, -1]), t([4, 8], [0, -1]), t([4, 8], [0, -1], other))


@pytest.fixture
def scratch_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rules a test declares are gone after it (the registry's tables restored)."""
    from spmdkit.engine import registry

    get_rule("softmax")  # the catalogue loaded first
    monkeypatch.setattr(registry, "_RULES", dict(registry._RULES))
    monkeypatch.setattr(registry, "_CANONICAL", dict(registry._CANONICAL))


@pytest.mark.usefixtures("scratch_registry")
def test_optional_tensor_before_a_required_output_and_grad_op() -> None:
    """A reverse signature with an optional tensor before the outputs (``x, bias?, out``) is
    generated (no default before a required parameter); ``grad_op`` names the grad slot's
    errors apart from the grad rule registered under ``grad_name``."""

    def biased(nx: int, nb: int) -> Notation:
        a = letters_for(nx)
        return Notation([a, None if nb < 0 else a[-nb:]], [a])

    rule = declare(
        "test_declare_biased",
        "x: T, bias: T? = None, scale: float = 1.0",
        Way(biased, key="x, bias"),
        reverse=Way(biased, key="x, bias", shapes="x: ... c; bias: c"),
        outputs="out: T",
    )
    assert rule.backward is not None and [p.name for p in rule.backward.params] == ["x", "bias", "out", "scale"]
    params = inspect.signature(rule.backward.fn).parameters
    assert params["bias"].default is inspect.Parameter.empty and params["scale"].default == 1.0
    r = rule.infer_backward(t([4, 6], [-1, -1]), None, t([4, 6], [1, 0]), 2.0)
    assert r.inputs[0].dims_mapping == (1, 0) and r.inputs[1] is None  # type: ignore[union-attr]
    with pytest.raises(ShapeMismatchError, match="test_declare_biased: bias' axis 0"):
        rule.infer_backward(t([4, 6], [-1, -1]), t([5], [-1]), t([4, 6], [1, 0]), 2.0)

    def grad_nt(nx: int, ng: int) -> Notation:
        if nx != ng:
            raise ShapeMismatchError(f"out_grad has {ng} dims, x {nx}")
        return Notation([letters_for(nx)] * 2, [letters_for(nx)])

    declare(
        "test_declare_g",
        "x: T",
        Way(_rowwise, key="x, 0"),
        grad=Way(grad_nt),
        grad_signature="x: T, out_grad: T",
        grad_name="test_declare_g_grad",
        grad_op="test_declare_g",
    )
    g = get_rule("test_declare_g_grad")
    assert g.forward.fn.__name__ == "test_declare_g_grad"
    with pytest.raises(ShapeMismatchError, match=r"^test_declare_g: out_grad has 1 dims, x 2$"):
        g.infer_forward(t([4, 6], [0, -1]), t([4], [-1]))
    with pytest.raises(ValueError, match="grad_op"):
        declare("never_registered", "x: T", Way(_rowwise), grad_op="x")


def test_order_labels_the_tensors_in_another_order_and_answers_in_the_signature_s() -> None:
    """``order``: the notation (its default key, mesh check, merge and ``post``) sees the tensors
    in that order; the answer comes back in the signature's. The reverse below merges loss
    before softmax (the first claim kept), as cross_entropy_with_softmax's does."""

    def nt(nx: int, nl: int) -> Notation:
        x = letters_for(nx)
        return Notation([x, x[:-1] + "1"], [x[:-1] + "1", x], conflict="first")

    seen: list[tuple[object, ...]] = []

    def post(ins: tuple[TensorDistAttr, ...], outs: tuple[TensorDistAttr, ...], *args: object) -> object:
        seen.append(tuple(a.dims_mapping for a in outs))
        return ins, outs

    sig = "x: T, label: T, softmax: T, loss: T, axis: int = -1"
    way = Way(nt, key="x, label", order="x, label, loss, softmax", post=post)
    f = generate("ord", sig, way, "backward", ["softmax", "loss"])
    plain = generate(
        "ord",
        "x: T, label: T, loss: T, softmax: T, axis: int = -1",
        Way(nt, key="x, label"),
        "backward",
        ["loss", "softmax"],
    )
    rng = random.Random(5)
    for _ in range(100):
        x, lab = t([4, 6, 8], [-1, -1, -1]), t([4, 6, 1], [-1, -1, -1])
        pairs = [[-1, -1], [0, -1], [-1, 0], [1, -1], [-1, 1], [0, 1], [1, 0]]
        sm, loss = t([4, 6, 8], [*rng.choice(pairs), -1]), t([4, 6, 1], [*rng.choice(pairs), -1])
        got, want = f(x, lab, sm, loss, -1), plain(x, lab, loss, sm, -1)
        assert got.inputs == want.inputs and got.outputs == tuple(want.outputs)[::-1]
        assert seen[-1] == tuple(a.dims_mapping for a in want.outputs)  # post saw loss first
    assert f.source.count("_r[1][1], _r[1][0]") == 1
    with pytest.raises(InvalidMeshError, match="ord: loss lies on a different mesh than x"):
        f(t([4, 8], [0, -1]), t([4, 1], [0, -1]), t([4, 8], [0, -1]), t([4, 1], [0, -1], ProcessMesh([8])))
    with pytest.raises(ValueError, match="order"):
        generate("bad", sig, Way(nt, order="x, label, loss"), "backward", ["softmax", "loss"])
    # a forward rule: the inputs come back in the signature's order, the notation's outputs as they are
    fwd = generate("ord", "label: T, x: T", Way(lambda nx, nl: nt(nx, nl), order="x, label"))
    r = fwd(t([4, 6, 1], [0, -1, -1]), t([4, 6, 8], [-1, 1, -1]))
    assert [a.dims_mapping for a in r.inputs] == [(0, 1, -1), (0, 1, -1)]  # type: ignore[union-attr]
    assert [a.dims_mapping for a in r.outputs] == [(0, 1, -1), (0, 1, -1)]  # type: ignore[union-attr]
    assert len(fwd(t([4, 1], [0, -1]), t([4, 6], [-1, 1])).inputs[1].dims_mapping) == 2  # type: ignore[union-attr]


@pytest.mark.usefixtures("scratch_registry")
def test_direction_and_outputs_of_a_backward_slot() -> None:
    """A grad slot compiled backward (``direction="backward"``, ``outputs``: pad's grad infers x
    from out) and a reverse rule compiled forward (``direction="forward"``: concat / stack align
    the inputs and the output as one set); misuse is refused when declared."""

    def same(nx: int, *more: int) -> Notation:
        return Notation([letters_for(nx)] * (1 + len(more)), [letters_for(nx)])

    declare("test_declare_pad", "x: T", Way(same, key="x"), grad=Way(same, key="x", direction="backward",
            outputs=("out",)), grad_signature="x: T, out: T", grad_op="test_declare_pad")  # fmt: skip
    r = get_rule("test_declare_pad").infer_backward(t([4, 6], [-1, -1]), t([4, 6], [1, 0]))
    assert r.inputs[0].dims_mapping == (1, 0) and r.outputs[0].dims_mapping == (1, 0)  # type: ignore[union-attr]
    with pytest.raises(ShapeMismatchError, match=r"^test_declare_pad: "):
        get_rule("test_declare_pad").infer_backward(t([4, 6], [-1, -1]), t([4, 6, 2], [1, 0, -1]))

    rule = declare("test_declare_join", "x: T", Way(same, key="x"), reverse=Way(same, key="x, out", direction="forward"),
                   outputs="out: T")  # fmt: skip
    r = rule.infer_backward(t([4, 6], [0, -1]), t([4, 6], [-1, 1]))
    # both aligned as inputs of one merge: x keeps axis 0's mesh dim, out gives axis 1's
    assert [a.dims_mapping for a in r.inputs] == [(0, 1), (0, 1)]  # type: ignore[union-attr]
    assert [a.dims_mapping for a in r.outputs] == [(0, 1)]  # type: ignore[union-attr]

    with pytest.raises(ValueError, match="outputs"):
        declare("never_registered", "x: T", Way(same, key="x"), grad=Way(same, outputs=("out",)),
                grad_signature="x: T, out: T")  # fmt: skip
    with pytest.raises(ValueError, match="for a backward slot, not the forward rule"):
        declare("never_registered", "x: T", Way(same, key="x", direction="backward"))
    with pytest.raises(ValueError, match="direction must be 'forward' or 'backward', got 'sideways'"):
        declare("never_registered", "x: T", Way(same, key="x"), grad=Way(same, direction="sideways"),
                grad_signature="x: T, out: T")  # fmt: skip
