"""Matmul variants: bmm, fused_gemm_epilogue, linear_v2, fused_linear_param_grad_add and
einsum, with their grads.

bmm (BmmInferSpmd / BmmGradInferSpmd in the backward slot, as Paddle): matmul's notation
``b m k, b k n -> b m n`` on 3-D operands only (the matmul rule answers; a sharded ``k``
makes out partial SUM). bmm_grad is matmul_grad on 3-D operands.

fused_gemm_epilogue (FusedGemmEpilogueInferSpmdBase(x, y, bias, trans_x, trans_y)) and
linear_v2 (LinearV2InferSpmdBase(input, weight, bias, transpose_weight)):
``[b] m k, k n, n -> [b] m n`` (out, reserve_space). The matmul part merges as matmul;
bias follows out's ``n`` (bias's own sharding is not merged). A sharded ``k`` makes out
partial SUM: fused_gemm_epilogue then asks for bias partial SUM over the same mesh dims
(each rank adds its share, as Paddle 3.3.1 answers); linear_v2 replicates the last two axes
of input, weight, bias and out instead (batch axes kept), as Paddle does. reserve_space is
sharded as out (Paddle answers it with an empty dims_mapping: gemm-reserve-space).
Reverse (spmdkit's own, Paddle has none): matmul's reverse (``k`` replicated) from out,
bias as out's ``n``; out and reserve_space are what those inputs produce.
linear_v2's bias is optional (``None`` / JSON null, as Paddle accepts): its answer is then
None, and so is linear_v2_grad's bias_grad.
Grads: fused_gemm_epilogue_grad(x, y, reserve_space, out_grad, trans_x, trans_y,
activation_grad) and linear_v2_grad(input, weight, bias, out_grad, transpose_weight):
matmul_grad for x_grad / y_grad; bias_grad is sharded as out_grad's last axis and partial
SUM over the mesh dims of out_grad's other axes (never over k's, as the engine would make
it); reserve_space as out_grad. An optional bias / reserve_space given 0-D is read as absent.

fused_linear_param_grad_add (FusedLinearParamGradAddInferSpmd(x, dout, dweight, dbias,
multi_precision, has_bias)): ``[b] s k, [b] s n -> k n`` (dweight_out = dweight + x^T dout
over all leading axes) and ``[b] s n -> n`` (dbias_out = dbias + sum of dout): dweight_out is
partial SUM over the mesh dims of the leading axes (Paddle: matmul with trans_x, then the
broadcast batch axes reduced); dbias_out is dout's last axis, partial SUM over the mesh dims of
its other axes. dweight / dbias are required sharded as the outputs they accumulate into
(replicated where given empty, 0-D or, for dbias, unused; Paddle raises where they differ;
spmdkit answers the reshard).
Reverse (spmdkit's own; Paddle's backward is a fake returning nothing): ``k`` and ``n``
from dweight_out / dbias_out (dbias_out's ``n`` where dweight_out leaves it free, none where
``k`` took one of its mesh dims; a size-1 ``k`` / ``n`` never sharded), the leading axes
replicated; the outputs are what those inputs produce (never partial).

einsum (EinsumInferSpmd(inputs, equation); EinsumGradInferSpmd(inputs, inner_cache,
out_grad, equation) in the backward slot, as Paddle): the equation is the notation
(``...`` expanded to right-aligned letters, size-1 ellipsis axes broadcast; implicit
output = the letters used once, sorted). Letters merge over the inputs (the engine's
merge), a letter repeated in one operand (a diagonal) is replicated, every letter keeps
only mesh dims that divide its size, out is partial SUM over the contracted letters.
einsum_grad: the same merge over the inputs and out_grad; each input's grad is sharded as
that input and partial SUM over the letters it lacks; inner_cache replicated. Paddle 3.3.1
replicates every operand of a non-outer einsum (sound, but all communication): spmdkit
shards (einsum-notation).

Deviations (docs/deviations.md): gemm-reserve-space, gemm-matmul-merge, gemm-two-mesh-dims,
gemm-partial-unsharded-k, gemm-shape-checks, bmm-grad-raises, mm-size1-axis,
flpga-paddle-crash, flpga-accumulator-reshard, flpga-dbias-from-input, flpga-fake-reverse,
einsum-notation.
"""

from __future__ import annotations

from functools import partial
from typing import Any, TypeGuard

from spmdkit.core.dist_attr import DimsMapping, ReduceType, TensorDistAttr, entry_dims
from spmdkit.core.errors import InvalidAttributeError, ShapeMismatchError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.spec import DistTensorSpec as T
from spmdkit.engine.axes import replicated_like
from spmdkit.engine.declare import Answer, Way, declare
from spmdkit.engine.facts import LocalOp, OpCost, facts
from spmdkit.engine.memo import memo
from spmdkit.engine.notation import BROADCAST, Conflict, Notation, Taken
from spmdkit.engine.outshape import Args, Expect, UnknownShape, broadcast
from spmdkit.ops import matmul
from spmdkit.ops._absent import absent_0d
from spmdkit.ops._common import check_same_shape
from spmdkit.ops._cost import numel

Shape = tuple[int, ...]
_make = TensorDistAttr.unchecked


def _partial_over(mesh: ProcessMesh, dm: DimsMapping) -> TensorDistAttr:
    """``dm``'s last axis, partial SUM over the mesh dims of its other axes (bias_grad, dbias_out)."""
    pt = sorted(d for e in dm[:-1] for d in entry_dims(e))
    return _make(mesh, dm[-1:], tuple((d, ReduceType.SUM) for d in pt))


# -- bmm ---------------------------------------------------------------------------------------
declare(
    "bmm", "x: T, y: T",
    Way(matmul.notation, key="x, y, False, False", mask=("x", "y"), shapes="x: b m k; y: b k n",
        paddle="BmmInferSpmd", doc="BmmInferSpmd: ``bmk, bkn -> bmn`` (matmul on 3-D operands)."),
    grad=Way(matmul.grad_notation, key="x, y, False, False", mask=("x", "y", "out_grad"),
             shapes="x: b m k; y: b k n; out_grad: b m n", paddle="BmmGradInferSpmd",
             doc="BmmGradInferSpmd: matmul_grad on 3-D operands."),
    grad_signature="x: T, y: T, out_grad: T", grad_name="bmm_grad",
)  # fmt: skip


# -- fused_gemm_epilogue / linear_v2 ---------------------------------------------------------
def gemm_notation(kind: str, nx: int, ny: int, tx: bool, ty: bool, mask: tuple[int, ...]) -> Notation:
    """matmul's notation (``kind``: forward / reverse / grad), bias / reserve_space unlabelled (the
    post-hooks answer them: never merged nor read for a letter's size); reserve_space (forward) as out."""
    if kind == "grad":
        nt = matmul.grad_notation(nx, ny, tx, ty, mask)
        x, y, out = nt.inputs
        return nt.relabel([x, y, None, out], nt.outputs)
    nt = (matmul.notation if kind == "forward" else matmul.reverse_notation)(nx, ny, tx, ty, mask)
    (x, y), (out,) = nt.inputs, nt.outputs
    return nt.relabel([x, y, None], [out, out if kind == "forward" else None])


def _gemm_check(
    op: str, x: T, y: T, bias: T | None, tx: bool, ty: bool, out: T | None = None, name: str = "out"
) -> None:
    """x @ y as matmul checks it, bias its ``n``, ``out`` (out / out_grad) its shape."""
    want = matmul.out_shape(x.shape, y.shape, tx, ty)
    if bias is not None and bias.shape != want[-1:]:
        check_same_shape(op, bias, want[-1:], "bias", "the matmul's n")
    if out is not None and out.shape != want:
        check_same_shape(op, out, want, name, "x @ y")


def _gemm_post(linear: bool, reverse: bool = False) -> Any:
    """The forward's / reverse's post-hook: bias, reserve_space, a partial out (module docstring)."""

    def post(ins: Any, outs: Any, x: T, y: T, bias: Any, *rest: Any) -> Answer:
        ao = outs[0]
        mesh, n = ao.mesh, ao.dims_mapping[-1:]
        ab = None if bias is None else _make(mesh, n)
        if reverse:  # rest: out, reserve_space, the attributes
            return (ins[0], ins[1], ab), (ao, None if rest[1] is None else ao)
        if not ao.partial:
            return (ins[0], ins[1], ab), outs
        if not linear:
            return (ins[0], ins[1], _make(mesh, n, ao.partial)), outs
        last2 = [a.dims_mapping[:-2] + (-1,) * min(2, len(a.dims_mapping)) for a in (ins[0], ins[1], ao)]
        ax, ay, out = (_make(mesh, dm) for dm in last2)
        return (ax, ay, None if bias is None else _make(mesh, (-1,))), (out, out)

    return post


def _bias_grad(absent: bool) -> Any:
    """reserve_space as out_grad (bias as its last axis); bias_grad (None without a bias)."""

    def post(ins: Any, outs: Any, x: T, y: T, third: Any, *rest: Any) -> Answer:
        ag = ins[3]
        t = None if third is None else _make(ag.mesh, ag.dims_mapping[-1:]) if absent else ag
        bg = None if absent and third is None else _partial_over(ag.mesh, ag.dims_mapping)
        return (ins[0], ins[1], t, ag), (*outs, bg)

    return post


def _fge_check(op: str, x: T, y: T, bias: T | None, trans_x: bool, trans_y: bool, out: T | None = None) -> None:
    _gemm_check(op, x, y, bias, trans_x, trans_y, out)


def _fge_grad_check(op: str, x: T, y: T, trans_x: bool, trans_y: bool, out_grad: T) -> None:
    _gemm_check(op, x, y, None, trans_x, trans_y, out_grad, "out_grad")


def _linear_check(op: str, input: T, weight: T, bias: T | None, out: T | None = None) -> None:
    _gemm_check(op, input, weight, bias, False, False, out)


def _linear_grad_check(op: str, input: T, weight: T, out_grad: T) -> None:
    _gemm_check(op, input, weight, None, False, False, out_grad, "out_grad")


_NO_TW = ("not transpose_weight", "transpose_weight is not supported in SPMD mode")
# (name, x and y, the transposes, the attributes, the checks of the forward and reverse, of the grad); linear_v2's
# bias and its grad's are optional, transpose_weight must be False (SPMD mode), fused_gemm_epilogue_grad takes
# reserve_space in bias's place
for _name, _x, _y, _t, _attrs, _check, _grad_check in (
    ("fused_gemm_epilogue", "x", "y", "trans_x, trans_y", "trans_x: bool = False, trans_y: bool = False", _fge_check,
     _fge_grad_check),
    ("linear_v2", "input", "weight", "False, False", "transpose_weight: bool = False", _linear_check,
     _linear_grad_check),
):
    _lin = _name == "linear_v2"
    _pd, _third = _name.title().replace("_", ""), "bias" if _lin else "reserve_space"
    _kw: dict[str, Any] = {"key": f"{_x}, {_y}, {_t}", "require": (_NO_TW,) * _lin}
    _shapes = f"{_y}: ... _ _"
    declare(
        _name, f"{_x}: T, {_y}: T, bias: T{'?' * _lin}, {_attrs}",
        Way(partial(gemm_notation, "forward"), mask=(_x, _y), **_kw, shapes=_shapes,
            check=_check, post=_gemm_post(_lin), wrap=absent_0d("bias") if _lin else None,
            paddle=f"{_pd}InferSpmdBase", doc=f"{_pd}InferSpmdBase: ``[b]mk, kn, n -> [b]mn`` (out, reserve_space)."),
        reverse=Way(partial(gemm_notation, "reverse"), mask=(_x, _y), **_kw, shapes=_shapes,
                    same=[("out", "reserve_space")], check=_check,
                    post=_gemm_post(_lin, True), wrap=absent_0d(*("bias",) * _lin, "reserve_space"),
                    paddle=f"{_pd}InferSpmdReverse",
                    doc=f"{_name} reverse (spmdkit's own): {_x}, {_y} from out (k replicated), bias as n."),
        outputs="out: T, reserve_space: T?",
    )  # fmt: skip
    declare(
        f"{_name}_grad", f"{_x}: T, {_y}: T, {_third}: T?, out_grad: T, {_attrs}"
                         + ", activation_grad: str = 'none'" * (not _lin),
        Way(partial(gemm_notation, "grad"), mask=(_x, _y, "out_grad"), **_kw, shapes=_shapes + "; bias: _" * _lin,
            same=() if _lin else [("out_grad", "reserve_space")], post=_bias_grad(_lin), wrap=absent_0d(_third),
            check=_grad_check, paddle=f"{_pd}GradInferSpmd",
            doc=f"{_pd}GradInferSpmd: matmul_grad for the grads of {_x} and {_y}; bias_grad from out_grad."),
    )  # fmt: skip


# -- fused_linear_param_grad_add --------------------------------------------------------------
def _present(t: T | None) -> TypeGuard[T]:
    return t is not None and len(t.shape) > 0 and 0 not in t.shape


def _flpga_check(op: str, x: T, dout: T, **accs: T | None) -> None:
    """dout shaped as x but its last axis; an accumulator given non-empty ``k n`` (dweight) or ``n``."""
    k, n = x.shape[-1], dout.shape[-1]
    if dout.shape[:-1] != x.shape[:-1]:
        check_same_shape(op, dout, (*x.shape[:-1], n), "dout", "x")
    for name, t in accs.items():
        want = (k, n) if name.startswith("dweight") else (n,)
        if _present(t) and t.shape != want:
            check_same_shape(op, t, want, name, f"x and dout's {'[k, n]' if len(want) == 2 else 'n'}")


def _code(t: T | None, on: bool = True) -> int:
    """The reverse's label of an accumulator: 1 present (and ``on``), -1 absent, rank + 2 empty, 0-D or unused."""
    return 1 if on and _present(t) else -1 if t is None else len(t.shape) + 2


def flpga_reverse_notation(
    nd: int, k1: bool, n1: bool, w: int, b: int, bias: bool, w_out: bool, b_out: bool
) -> Notation:
    """``1..1k, 1..1n, kn, n`` (x, dout, dweight, dbias; ``w`` / ``b``: as :func:`_code` labels them),
    the outputs where present (``w_out`` / ``b_out``), then the answer's ``kn, n`` (``Way.tail``), merged
    from the present outputs alone; ``k1`` / ``n1``: a size-1 k / n; no ``bias``: no dbias_out."""
    k, n = BROADCAST if k1 else "k", BROADCAST if n1 else "n"
    lead = BROADCAST * (nd - 1)

    def lab(code: int, full: str) -> str | None:
        return full if code == 1 else None if code == -1 else BROADCAST * (code - 2)

    given = [k + n if w_out else None, n if b_out else None]
    src = [i for i, on in ((4, w_out), (5, b_out)) if on]
    tensors = [lead + k, lead + n, lab(w, k + n), lab(b, n), *given, k + n, n if bias else None]
    return Notation(tensors, [], conflict=Conflict.FIRST, taken=Taken.LETTER, sources=src)


def flpga_notation(nd: int, mask: tuple[int, ...]) -> Notation:
    """matmul's notation with trans_x (as Paddle), its out less the batch letters; dweight /
    dbias unlabelled (answered by :func:`_flpga_post`)."""
    nt = matmul.notation(nd, nd, True, False, mask)
    (x, d), (out,) = nt.inputs, nt.outputs
    assert out is not None
    return nt.relabel([x, d, None, None], [out[-2:]])


def _flpga_post(
    ins: Any, outs: Any, x: T, dout: T, dweight: T | None, dbias: T | None, multi_precision: bool, has_bias: bool
) -> Answer:
    aw, ad = outs[0], ins[1]
    ab = _partial_over(ad.mesh, ad.dims_mapping) if has_bias else None
    w = aw if _present(dweight) else replicated_like(ad.mesh, dweight)
    b = ab if has_bias and _present(dbias) else replicated_like(ad.mesh, dbias)
    return (ins[0], ad, w, b), (aw, ab)


def _flpga_accs(op: str, x: T, dout: T, dweight: T | None, dbias: T | None, dweight_out: T | None = None,
                dbias_out: T | None = None) -> None:  # fmt: skip
    _flpga_check(op, x, dout, dweight=dweight, dbias=dbias, dweight_out=dweight_out, dbias_out=dbias_out)


_FENV = {"_code": _code, "_present": _present}
declare(
    "fused_linear_param_grad_add", "x: T, dout: T, dweight: T?, dbias: T?, multi_precision: bool = False, "
                                   "has_bias: bool = True",
    Way(flpga_notation, key="x", mask=("x", "dout"), post=_flpga_post, env=_FENV, shapes="x: ... _ _; dout: ... _ _",
        check=_flpga_accs, paddle="FusedLinearParamGradAddInferSpmd",
        doc="FusedLinearParamGradAddInferSpmd: ``[b]sk, [b]sn -> kn, n``."),
    reverse=Way(flpga_reverse_notation, tail=2, env=_FENV, shapes="x: ... _ _; dout: ... _ _",
                key="x, x.shape[-1] == 1, dout.shape[-1] == 1, _code(dweight), _code(dbias, has_bias), has_bias, "
                    "_present(dweight_out), has_bias and _present(dbias_out)",
                check=_flpga_accs,
                paddle="FusedLinearParamGradAddInferSpmdReverse",
                doc="fused_linear_param_grad_add reverse (spmdkit's own): k and n from the outputs."),
    outputs="dweight_out: T?, dbias_out: T?",
)  # fmt: skip


# -- einsum ----------------------------------------------------------------------------------
_ELL = "".join(chr(0x3B1 + i) for i in range(24))  # labels of ellipsis axes (never in an equation)


@memo()
def einsum_notation(
    equation: str, shapes: tuple[Shape, ...], grad: bool = False, cache: tuple[int, ...] = ()
) -> Notation:
    """The notation of an einsum call (module docstring). With ``grad``: inputs ``ops +
    inner_cache + [out_grad]`` (the ``cache`` of those ranks replicated, -1 absent), outputs the
    grads of the ops. Errors name the equation (the generated rule adds the op)."""
    eq = equation.replace(" ", "")
    if eq.count("->") > 1:
        raise InvalidAttributeError(f"equation {equation!r} has more than one '->'")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(shapes):
        raise InvalidAttributeError(
            f"equation {equation!r}: {len(terms)} operands, but inputs has {len(shapes)} tensors"
        )

    def explicit(term: str, where: str) -> tuple[str, bool]:
        t = term.replace("...", "", 1)
        if "." in t:
            raise InvalidAttributeError(f"equation {equation!r}: bad ellipsis in {where} {term!r}")
        bad = [c for c in t if not c.isascii() or not c.isalpha()]
        if bad:
            raise InvalidAttributeError(f"equation {equation!r}: {bad[0]!r} is not a letter ({where})")
        return t, "..." in term

    ell_n: list[int] = []
    for i, (term, shape) in enumerate(zip(terms, shapes)):
        t, has = explicit(term, f"operand {i}")
        n_ell = len(shape) - len(t)
        if (not has and n_ell != 0) or n_ell < 0:
            raise ShapeMismatchError(f"inputs[{i}] has {len(shape)} dims, the equation's {term!r} labels {len(t)}")
        ell_n.append(n_ell if has else 0)
    max_ell = max(ell_n)
    if max_ell > len(_ELL):
        raise ShapeMismatchError(f"too many ellipsis dims ({max_ell})")
    ell = _ELL[:max_ell]
    labels = [term.replace("...", ell[max_ell - n :]) for term, n in zip(terms, ell_n)]
    used = "".join(labels)
    if arrow:
        t, has = explicit(rhs, "the output")
        if not has and max_ell:
            raise InvalidAttributeError(f"equation {equation!r}: the operands have '...' but the output has not")
        out = rhs.replace("...", ell) if has else t
    else:
        out = ell + "".join(sorted(c for c in set(used) if used.count(c) == 1 and c not in ell))
    for ch in out:
        if ch not in used:
            raise InvalidAttributeError(f"equation {equation!r}: output letter {ch!r} is in no operand")
    if len(set(out)) != len(out):
        raise InvalidAttributeError(f"equation {equation!r}: the output repeats a letter")
    size: dict[str, int] = {}  # per letter; size-1 ellipsis axes broadcast
    for i, (lb, shape) in enumerate(zip(labels, shapes)):
        for ch, s in zip(lb, shape):
            cur = size.get(ch)
            if s >= 0 and cur is not None and s != cur and not (ch in ell and 1 in (s, cur)):
                raise ShapeMismatchError(f"letter {ch!r} has sizes {cur} and {s} (inputs[{i}] shape {list(shape)})")
            if s >= 0 and (cur is None or cur == 1):
                size[ch] = s
    final = [
        "".join(BROADCAST if ch in ell and s == 1 and size.get(ch, 1) != 1 else ch for ch, s in zip(lb, shape))
        for lb, shape in zip(labels, shapes)
    ]
    replicated = {c for lb in final for c in lb if c != BROADCAST and lb.count(c) > 1}
    if grad:
        held = [None if r < 0 else BROADCAST * r for r in cache]
        return Notation([*final, *held, out], final, replicated=replicated, prune="*")
    return Notation(final, [out], replicated=replicated, prune="*")


def _grads(ins: Any, outs: Any, *args: object) -> Any:
    """einsum_grad's grads as one list (Paddle's grouping)."""
    return ins, (tuple(outs),)


_SHAPES = "tuple([t.shape for t in inputs])"
def _no_operand(inputs: list[T], equation: str) -> None:
    """No operand (so no mesh): the equation's own error first."""
    if not inputs:
        einsum_notation(equation, ())


_EKW: dict[str, Any] = {"letters": True, "pre": _no_operand}
declare(
    "einsum", "inputs: [T], equation: str",
    Way(einsum_notation, key=f"equation, {_SHAPES}", **_EKW, paddle="EinsumInferSpmd",
        doc="EinsumInferSpmd: the equation as notation; contracted letters make out partial SUM."),
    grad=Way(lambda eq, shapes, cache: einsum_notation(eq, shapes, True, cache), **_EKW, post=_grads,
             key=f"equation, {_SHAPES}, inner_cache", paddle="EinsumGradInferSpmd",
             doc="EinsumGradInferSpmd: merge over the inputs and out_grad; an input's grad partial over the letters "
                 "it lacks."),
    grad_signature="inputs: [T], inner_cache: [T?], out_grad: T, equation: str", grad_name="einsum_grad",
)  # fmt: skip


# -- output shapes / grads ----------------------------------------------------------------------


def _bmm_shape(a: Args) -> list[Expect]:
    x, y = a.s("x"), a.s("y")
    if len(x) != 3 or len(y) != 3:
        raise UnknownShape
    return [(x[0], x[1], y[2])]


def _linear_v2_shape(a: Args) -> list[Expect]:
    x, w = a.s("input"), a.s("weight")
    if not x or len(w) != 2:
        raise UnknownShape
    n = w[0] if a.a("transpose_weight", False) else w[1]
    return [(*x[:-1], n), None]


def _gemm_shape(a: Args) -> list[Expect]:
    x, y = a.s("x"), a.s("y")
    if len(x) < 2 or len(y) != 2:
        raise UnknownShape
    m = x[:-2] + ((x[-1],) if a.a("trans_x", False) else (x[-2],))
    n = y[0] if a.a("trans_y", False) else y[1]
    return [(*m, n), None]


def _flpga_shape(a: Args) -> list[Expect]:
    x, d = a.s("x"), a.s("dout")
    if not x or not d:
        raise UnknownShape
    return [(x[-1], d[-1]), (d[-1],) if a.a("has_bias", True) else None]


def _einsum_shape(a: Args) -> list[Expect]:
    """numpy / Paddle einsum: letters name axes (size-1 axes broadcast), ``...`` the broadcast
    of the operands' unnamed axes; an implicit output is ``...`` then the letters used once,
    sorted."""
    eq = a.a("equation")
    xs = a.vec("inputs")
    if not isinstance(eq, str) or any(s is None for s in xs):
        raise UnknownShape
    eq = eq.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(xs):
        raise UnknownShape
    size: dict[str, int] = {}
    count: dict[str, int] = {}
    ell: list[tuple[int, ...]] = []
    for t, shape in zip(terms, xs):
        assert shape is not None
        if t.count("...") > 1 or ("." in t.replace("...", "")):
            raise UnknownShape
        head, dots, tail = t.partition("...")
        n_ell = len(shape) - len(head) - len(tail)
        if n_ell < 0 or (n_ell and not dots):
            raise UnknownShape
        named = list(zip(head, shape[:len(head)])) + list(zip(tail, shape[len(shape) - len(tail):]))
        if dots:
            ell.append(tuple(shape[len(head):len(head) + n_ell]))
        for ch, v in named:
            if not ch.isalpha():
                raise UnknownShape
            count[ch] = count.get(ch, 0) + 1
            if v != 1:
                if size.get(ch, 1) not in (1, v):
                    raise UnknownShape
                size[ch] = v
            else:
                size.setdefault(ch, 1)
    dims = broadcast(*ell) if ell else ()
    out = rhs if arrow else ("..." if ell else "") + "".join(sorted(ch for ch, n in count.items() if n == 1))
    if out.count("...") > 1 or "." in out.replace("...", ""):
        raise UnknownShape
    head, dots, tail = out.partition("...")
    if any(ch not in size for ch in head + tail):
        raise UnknownShape
    return [tuple(size[ch] for ch in head) + (dims if dots else ()) + tuple(size[ch] for ch in tail)]


def _gemm_grad_shape(a: Args) -> list[Expect]:
    x, y, g = a.s("x"), a.s("y"), a.s("out_grad")
    return [x, y, g[-1:] if g else None]


def _linear_v2_grad_shape(a: Args) -> list[Expect]:
    w = a.s("weight")
    b = a.opt("bias")
    return [a.s("input"), w, b]


facts("bmm", shape=_bmm_shape)
facts("einsum", shape=_einsum_shape)
facts("linear_v2", shape=_linear_v2_shape, unchecked="reserve_space is kernel workspace; out is checked")
facts("fused_gemm_epilogue", shape=_gemm_shape, unchecked="reserve_space is kernel workspace; out is checked")
facts("fused_linear_param_grad_add", shape=_flpga_shape)
facts("fused_gemm_epilogue_grad", shape=_gemm_grad_shape)
facts("linear_v2_grad", shape=_linear_v2_grad_shape)


# -- cost


def _param_grad_add_cost(c: LocalOp) -> OpCost:
    """dweight ``+= x^T dout``: ``2 · dout elements · k``."""
    x, dout = c.one("x"), c.one("dout")
    assert x is not None and dout is not None
    k = x[0][-1] if x[0] else 1
    f = 2.0 * numel(dout[0]) * k
    n = dout[0][-1] if dout[0] else 1
    return OpCost(f, f, c.in_bytes + c.out_bytes, True, c.dtype(), gemms=((1, k, n, numel(dout[0]) // max(n, 1)),))


def _einsum_flops(c: LocalOp) -> float | None:
    """One multiply-add per point of the letters' product space (one op per point for a single
    operand); None where the equation's operands are not all plain letters."""
    eq = str(c.attr("equation", ""))
    lhs = eq.split("->")[0]
    terms = lhs.split(",")
    xs = c.ins.get("inputs") or c.ins.get("x") or []
    if "." in eq or len(terms) != len(xs):
        return None
    size: dict[str, int] = {}
    for t, (s, _, _) in zip(terms, xs):
        if len(t) != len(s):
            return None
        for ch, n in zip(t, s):
            size[ch] = max(size.get(ch, 1), n)
    return (2.0 if len(xs) > 1 else 1.0) * numel(size.values())


def _einsum_cost(c: LocalOp) -> OpCost:
    """The forward's FLOPs, times the input gradients made for einsum_grad; an equation with an
    ellipsis is not costed."""
    f = _einsum_flops(c)
    if f is None:
        return OpCost(0.0, 0.0, c.in_bytes + c.out_bytes, covered=False)
    if c.rule.endswith("_grad"):
        f *= max(1, sum(1 for o in c.outs if o is not None))
    return OpCost(f, f, c.in_bytes + c.out_bytes, True, c.dtype())


facts("bmm", "fused_gemm_epilogue", "linear_v2", cost=matmul.cost)
facts("bmm_grad", "fused_gemm_epilogue_grad", "linear_v2_grad", cost=matmul.grad_cost)
facts("fused_linear_param_grad_add", cost=_param_grad_add_cost)
facts("einsum", "einsum_grad", cost=_einsum_cost)
