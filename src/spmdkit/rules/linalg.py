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
SUM over the mesh dims of out_grad's other axes; reserve_space as out_grad.

fused_linear_param_grad_add (FusedLinearParamGradAddInferSpmd(x, dout, dweight, dbias,
multi_precision, has_bias)): ``[b] s k, [b] s n -> k n`` (dweight_out = dweight + x^T dout
over all leading axes) and ``[b] s n -> n`` (dbias_out = dbias + sum of dout): dweight_out is
partial SUM over the mesh dims of the leading axes (Paddle: matmul with trans_x, then the
broadcast batch axes reduced). dweight / dbias are required sharded as the outputs they
accumulate into (Paddle raises where they differ; spmdkit answers the reshard).
Reverse (spmdkit's own; Paddle's backward is a fake returning nothing): ``k`` and ``n``
from dweight_out / dbias_out (dbias_out's ``n`` where dweight_out leaves it free), the
leading axes replicated; the outputs are what those inputs produce (never partial).

einsum (EinsumInferSpmd(inputs, equation); EinsumGradInferSpmd(inputs, inner_cache,
out_grad, equation) in the backward slot, as Paddle): the equation is the notation
(``...`` expanded to right-aligned letters, size-1 ellipsis axes broadcast; implicit
output = the letters used once, sorted). Letters merge over the inputs (the engine's
merge), a letter repeated in one operand (a diagonal) is replicated, every letter keeps
only mesh dims that divide its size, out is partial SUM over the contracted letters.
einsum_grad: the same merge over the inputs and out_grad; each input's grad is sharded as
that input and partial SUM over the letters it lacks. Paddle 3.3.1 replicates every
operand of a non-outer einsum (sound, but all communication): spmdkit shards
(einsum-notation).

Deviations (docs/deviations.md): gemm-reserve-space, gemm-matmul-merge, gemm-two-mesh-dims,
gemm-partial-unsharded-k, gemm-shape-checks, bmm-grad-raises, mm-size1-axis,
flpga-paddle-crash, flpga-accumulator-reshard, flpga-dbias-from-input, flpga-fake-reverse,
einsum-notation.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from spmdkit.core.dist_attr import DimsMapping, Entry, ReduceType, TensorDistAttr, entry_dims
from spmdkit.core.errors import InvalidAttributeError, ShapeMismatchError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.spec import DistTensorSpec
from spmdkit.engine.axes import replicated_like
from spmdkit.engine.declare import Answer, Way, declare
from spmdkit.engine.memo import memo
from spmdkit.engine.notation import BROADCAST, Notation
from spmdkit.rules import matmul
from spmdkit.rules._absent import zero_d_absent

Shape = tuple[int, ...]
_SUM = ReduceType.SUM
_make = TensorDistAttr.unchecked

def _partial_over(mesh: ProcessMesh, dm: DimsMapping, entries: tuple[Entry, ...] | list[Entry]) -> TensorDistAttr:
    pt: list[int] = []
    for e in entries:
        pt.extend(entry_dims(e))
    return _make(mesh, dm, tuple((d, _SUM) for d in sorted(pt)))


# ---------------------------------------------------------------------------
# bmm
# ---------------------------------------------------------------------------


declare(
    "bmm", "x: T, y: T",
    Way(matmul.notation, key="x, y, False, False", mask=("x", "y"), shapes="x: b m k; y: b k n",
        paddle="BmmInferSpmd", doc="BmmInferSpmd: ``bmk, bkn -> bmn`` (matmul on 3-D operands)."),
    grad=Way(matmul.grad_notation, key="x, y, False, False", mask=("x", "y", "out_grad"),
             shapes="x: b m k; y: b k n; out_grad: b m n", paddle="BmmGradInferSpmd",
             doc="BmmGradInferSpmd: matmul_grad on 3-D operands."),
    grad_signature="x: T, y: T, out_grad: T", grad_name="bmm_grad",
)  # fmt: skip


# ---------------------------------------------------------------------------
# fused_gemm_epilogue / linear_v2
# ---------------------------------------------------------------------------


def _check_bias(op: str, xname: str, yname: str, x: DistTensorSpec, y: DistTensorSpec, bias: DistTensorSpec | None,
                tx: bool, ty: bool) -> None:
    if len(y.shape) < 2:
        raise ShapeMismatchError(f"{op}: {yname} must have at least 2 dims for the bias add, got shape {list(y.shape)}")
    if len(x.shape) < 1:
        raise ShapeMismatchError(f"{op}: {xname} must have at least 1 dim, got shape {list(x.shape)}")
    if tx and len(x.shape) < 2:
        raise InvalidAttributeError(f"{op}: trans_x needs {xname} with at least 2 dims, got {list(x.shape)}")
    if bias is None:
        return
    if len(bias.shape) != 1:
        raise ShapeMismatchError(f"{op}: bias must be 1-D, got shape {list(bias.shape)}")
    n = y.shape[-2] if ty else y.shape[-1]
    b = bias.shape[0]
    if b != n and b >= 0 and n >= 0:
        raise ShapeMismatchError(f"{op}: bias has {b} elements but {yname} gives n = {n} (shape {list(y.shape)})")


def gemm_notation(kind: str, nx: int, ny: int, tx: bool, ty: bool, mask: tuple[int, ...]) -> Notation:
    """matmul's notation (``kind``: forward / reverse / grad) with the third tensor (bias /
    reserve_space) unlabelled: it is answered by the post-hooks as out's (out_grad's) last axis
    or as out_grad, never merged nor read for a letter's size; reserve_space (forward) as out."""
    if kind == "grad":
        nt = matmul.grad_notation(nx, ny, tx, ty, mask)
        x, y, out = nt.inputs
        return nt.relabel([x, y, None, out], nt.outputs)
    nt = (matmul.notation if kind == "forward" else matmul.reverse_notation)(nx, ny, tx, ty, mask)
    (x, y), (out,) = nt.inputs, nt.outputs
    return nt.relabel([x, y, None], [out, out if kind == "forward" else None])


def _gemm_post(linear: bool, reverse: bool = False) -> Any:
    """The forward's and the reverse's post-hook: bias as out's last axis (reserve_space as out);
    where a sharded k makes out partial SUM (forward), fused_gemm_epilogue asks for the bias
    partial over the same mesh dims (each rank adds its share, as Paddle 3.3.1 answers), linear_v2
    replicates the last two axes of input, weight, bias and out instead (Paddle's)."""

    def post(ins: Any, outs: Any, x: DistTensorSpec, y: DistTensorSpec, bias: Any, *rest: Any) -> Answer:
        ao = outs[0]
        mesh = ao.mesh
        if reverse:  # rest: out, reserve_space, the attributes
            ab = None if bias is None else _make(mesh, (ao.dims_mapping[-1],))
            return (ins[0], ins[1], ab), (ao, None if rest[1] is None else ao)
        if not ao.partial:
            return (ins[0], ins[1], None if bias is None else _make(mesh, (ao.dims_mapping[-1],))), outs
        if not linear:
            return (ins[0], ins[1], _make(mesh, (ao.dims_mapping[-1],), ao.partial)), outs
        ax, ay = (_make(mesh, _repl_last2(a.dims_mapping)) for a in ins[:2])
        out = _make(mesh, _repl_last2(ao.dims_mapping))
        return (ax, ay, None if bias is None else _make(mesh, (-1,))), (out, out)

    return post


def _repl_last2(dm: DimsMapping) -> DimsMapping:
    n = len(dm)
    return tuple(-1 if i >= n - 2 else e for i, e in enumerate(dm))


def _bias_grad(absent: bool) -> Any:
    """reserve_space as out_grad, bias as its last axis; bias_grad: out_grad's last axis, partial
    SUM over the mesh dims of its other axes (never over k's, as the engine would make it); None
    where there is no bias (linear_v2_grad)."""

    def post(ins: Any, outs: Any, x: DistTensorSpec, y: DistTensorSpec, third: Any, *rest: Any) -> Answer:
        ag = ins[3]
        gdm, mesh = ag.dims_mapping, ag.mesh
        t = None if third is None else _make(mesh, (gdm[-1],)) if absent else ag
        bg = None if absent and third is None else _partial_over(mesh, (gdm[-1],), gdm[:-1])
        return (ins[0], ins[1], t, ag), (*outs, bg)

    return post


def _reserve(op: str, t: DistTensorSpec | None, ref: DistTensorSpec, name: str) -> None:
    if t is not None and t.shape != ref.shape:
        raise ShapeMismatchError(f"{op}: reserve_space shape {list(t.shape)} differs from {name} shape {list(ref.shape)}")


def _bias_1d(op: str, bias: DistTensorSpec | None) -> None:
    if bias is not None and len(bias.shape) != 1:
        raise ShapeMismatchError(f"{op}: bias must be 1-D, got shape {list(bias.shape)}")


def _no_transpose(op: str, transpose_weight: bool) -> None:
    if transpose_weight:
        raise InvalidAttributeError(f"{op}: transpose_weight must be False in SPMD mode, got True")


def _absent(*names: str) -> Any:
    """A 0-D optional tensor (shape []) read as absent (spmdkit.rules._absent)."""
    return lambda fn, sig, outs: zero_d_absent(fn, sig, names, outs)


_GENV = {"_check_bias": _check_bias, "_out_shape": matmul._out_shape, "_reserve": _reserve, "_bias_1d": _bias_1d,
         "_no_transpose": _no_transpose, "_out": matmul._check_out("out"), "_og": matmul._check_out("out_grad")}
# (name, Paddle's name, x and y, the transposes, the third input of the grad, the signatures' attributes)
for _name, _pd, (_x, _y), (_tx, _ty), _third, _attrs, _gattrs, _pre in (
    ("fused_gemm_epilogue", "FusedGemmEpilogue", ("x", "y"), ("trans_x", "trans_y"), "reserve_space",
     "trans_x: bool = False, trans_y: bool = False", ", activation_grad: str = 'none'", ""),
    ("linear_v2", "LinearV2", ("input", "weight"), ("False", "False"), "bias", "transpose_weight: bool = False", "",
     "_no_transpose({op!r}, transpose_weight); "),
):
    _lin = _name == "linear_v2"
    _args = f"{_x}, {_y}, {_tx}, {_ty}"
    _bias = f"_check_bias({{op!r}}, {_x!r}, {_y!r}, {_x}, {_y}, bias, {_tx}, {_ty})"
    _rs = "_reserve({op!r}, reserve_space, out, 'out'); "
    _sig = f"{_x}: T, {_y}: T, bias: T{'?' if _lin else ''}, {_attrs}"
    _gop = f"{_name}_grad"
    _gsig = f"{_x}: T, {_y}: T, {_third}: T?, out_grad: T, {_attrs}{_gattrs}"
    _gthird = "_bias_1d({op!r}, bias)" if _lin else "_reserve({op!r}, reserve_space, out_grad, 'out_grad')"
    declare(
        _name, _sig,
        Way(partial(gemm_notation, "forward"), key=_args, mask=(_x, _y), env=_GENV,
            check=(_pre + _bias + f"; _out_shape({_x}.shape, {_y}.shape, {_tx}, {_ty})").format(op=_name),
            post=_gemm_post(_lin), wrap=_absent("bias") if _lin else None, paddle=f"{_pd}InferSpmdBase",
            doc=f"{_pd}InferSpmdBase: ``[b]mk, kn, n -> [b]mn`` (out, reserve_space); a sharded k makes out "
                "partial SUM and " + ("replicates the matmul axes." if _lin else "asks for bias partial alike.")),
        reverse=Way(partial(gemm_notation, "reverse"), key=_args, mask=(_x, _y), env=_GENV, post=_gemm_post(_lin, True),
                    check=(_pre + _bias + "; " + _rs + f"_out({_x}, {_y}, out, {_tx}, {_ty})").format(op=_name),
                    wrap=_absent(*("bias",) * _lin, "reserve_space"), paddle=f"{_pd}InferSpmdReverse",
                    doc=f"{_name} reverse (spmdkit's own): {_x}, {_y} from out (k replicated), bias as n."),
        outputs="out: T, reserve_space: T?",
    )  # fmt: skip
    declare(
        _gop, _gsig,
        Way(partial(gemm_notation, "grad"), key=_args,
            mask=(_x, _y, "out_grad"), env=_GENV, post=_bias_grad(_lin), wrap=_absent(_third),
            check=(_pre + f"_check_bias({{op!r}}, {_x!r}, {_y!r}, {_x}, {_y}, None, {_tx}, {_ty}); "
                   f"_og({_x}, {_y}, out_grad, {_tx}, {_ty}); " + _gthird).format(op=_gop),
            paddle=f"{_pd}GradInferSpmd",
            doc=f"{_pd}GradInferSpmd: matmul_grad for the grads of {_x} and {_y}; bias_grad as out_grad's last "
                "axis, partial SUM over the mesh dims of its other axes."),
    )  # fmt: skip


# ---------------------------------------------------------------------------
# fused_linear_param_grad_add
# ---------------------------------------------------------------------------


def _flpga_checks(op: str, x: DistTensorSpec, dout: DistTensorSpec, dweight: DistTensorSpec | None,
                  dbias: DistTensorSpec | None) -> None:
    """x and dout of one rank (>= 2) and leading axes; dweight ``[k, n]``, dbias ``[n]``."""
    xs, ds = x.shape, dout.shape
    if len(xs) < 2 or len(ds) < 2:
        raise ShapeMismatchError(
            f"{op}: x and dout must have at least 2 dims, got x {list(xs)} and dout {list(ds)}"
        )
    if len(xs) != len(ds):
        raise ShapeMismatchError(f"{op}: x {list(xs)} and dout {list(ds)} have different ranks")
    for i in range(len(xs) - 1):
        if xs[i] != ds[i] and xs[i] >= 0 and ds[i] >= 0:
            raise ShapeMismatchError(f"{op}: x {list(xs)} and dout {list(ds)} differ on leading axis {i}")
    _flpga_shape(op, "dweight", dweight, (xs[-1], ds[-1]))
    _flpga_shape(op, "dbias", dbias, (ds[-1],))


def _flpga_shape(op: str, name: str, t: DistTensorSpec | None, want: Shape) -> None:
    if t is None or len(t.shape) == 0 or 0 in t.shape:
        return
    if len(t.shape) != len(want) or any(a != b and a >= 0 and b >= 0 for a, b in zip(t.shape, want)):
        raise ShapeMismatchError(f"{op}: {name} shape {list(t.shape)} should be {list(want)}")


def _present(t: DistTensorSpec | None) -> bool:
    return t is not None and len(t.shape) > 0 and 0 not in t.shape


def _code(t: DistTensorSpec | None, on: bool = True) -> int:
    """How the reverse labels an accumulator: 1 present (and ``on``), -1 absent, its rank + 2
    where given but empty, 0-d or unused (replicated)."""
    return 1 if on and _present(t) else -1 if t is None else len(t.shape) + 2


def flpga_reverse_notation(nd: int, k1: bool, n1: bool, w: int, b: int, bias: bool, w_out: bool,
                           b_out: bool) -> Notation:
    """The reverse: ``1..1k, 1..1n, kn, n`` (x, dout, dweight, dbias), the outputs given where
    present (``w_out`` / ``b_out``), then the answer's ``kn, n`` (absent: ``Way.tail``; so none is
    partial), merged from the present outputs alone: k and n as dweight_out shards them, n from
    dbias_out where dweight_out leaves it free, n shards nothing where k took one of its mesh
    dims (``taken="letter"``); a size-1 k or n (``k1`` / ``n1``) never sharded; the leading
    axes replicated. ``w`` / ``b``: dweight / dbias as :func:`_code` labels them; no ``bias``:
    no dbias_out."""
    k, n = BROADCAST if k1 else "k", BROADCAST if n1 else "n"
    lead = BROADCAST * (nd - 1)

    def lab(code: int, full: str) -> str | None:
        return full if code == 1 else None if code == -1 else BROADCAST * (code - 2)

    given = [k + n if w_out else None, n if b_out else None]
    src = [i for i, on in ((4, w_out), (5, b_out)) if on]
    return Notation([lead + k, lead + n, lab(w, k + n), lab(b, n), *given, k + n, n if bias else None], [],
                    conflict="first", taken="letter", sources=src)


def flpga_notation(nd: int, mask: tuple[int, ...]) -> Notation:
    """x^T dout over the leading axes: matmul's notation with trans_x (as Paddle), its out
    ``[b] k n`` less the batch letters (dweight_out ``kn``: partial SUM over the mesh dims of the
    leading axes); dweight / dbias unlabelled (answered by :func:`_flpga_post`)."""
    nt = matmul.notation(nd, nd, True, False, mask)
    (x, d), (out,) = nt.inputs, nt.outputs
    assert out is not None
    return nt.relabel([x, d, None, None], [out[-2:]])


def _flpga_post(ins: Any, outs: Any, x: DistTensorSpec, dout: DistTensorSpec, dweight: DistTensorSpec | None,
                dbias: DistTensorSpec | None, multi_precision: bool, has_bias: bool) -> Answer:
    """dbias_out: dout's last axis, partial SUM over the mesh dims of its other axes (not k's);
    dweight / dbias asked sharded as the outputs they accumulate into (replicated where given
    empty, 0-D or, for dbias, unused)."""
    aw, ad = outs[0], ins[1]
    mesh, md = ad.mesh, ad.dims_mapping
    ab = _partial_over(mesh, (md[-1],), md[:-1]) if has_bias else None
    return (ins[0], ad, aw if _present(dweight) else replicated_like(mesh, dweight),
            ab if has_bias and _present(dbias) else replicated_like(mesh, dbias)), (aw, ab)


_FLPGA = "x: T, dout: T, dweight: T?, dbias: T?, multi_precision: bool = False, has_bias: bool = True"
_FENV = {"_checks": _flpga_checks, "_shape": _flpga_shape, "_code": _code, "_present": _present}
declare(
    "fused_linear_param_grad_add", _FLPGA,
    Way(flpga_notation, key="x", mask=("x", "dout"), post=_flpga_post, env=_FENV,
        check="_checks(_OP, x, dout, dweight, dbias)", paddle="FusedLinearParamGradAddInferSpmd",
        doc="FusedLinearParamGradAddInferSpmd: ``[b]sk, [b]sn -> kn, n``; dweight_out / dbias_out partial SUM "
            "over the leading axes' mesh dims; dweight / dbias sharded as they."),
    reverse=Way(flpga_reverse_notation, tail=2, env=_FENV,
                key="x, x.shape[-1] == 1, dout.shape[-1] == 1, _code(dweight), _code(dbias, has_bias), has_bias, "
                    "_present(dweight_out), has_bias and _present(dbias_out)",
                check="_checks(_OP, x, dout, dweight, dbias); "
                      "_shape(_OP, 'dweight_out', dweight_out, (x.shape[-1], dout.shape[-1])); "
                      "_shape(_OP, 'dbias_out', dbias_out, (dout.shape[-1],))",
                paddle="FusedLinearParamGradAddInferSpmdReverse",
                doc="fused_linear_param_grad_add reverse (spmdkit's own; Paddle's is a fake): k and n from the "
                    "outputs, the leading axes replicated."),
    outputs="dweight_out: T?, dbias_out: T?",
)  # fmt: skip


# ---------------------------------------------------------------------------
# einsum
# ---------------------------------------------------------------------------

_ELL = "".join(chr(0x3B1 + i) for i in range(24))  # labels of ellipsis axes (never in an equation)


@memo()
def einsum_notation(equation: str, shapes: tuple[Shape, ...], grad: bool = False,
                    cache: tuple[int, ...] = ()) -> Notation:
    """The notation of an einsum call: the equation with ``...`` expanded (right-aligned,
    size-1 axes broadcast), diagonal letters replicated, every letter pruned. With
    ``grad``: inputs ``ops + inner_cache + [out_grad]`` (the ``cache`` of those ranks
    replicated, -1 absent), outputs the grads of the ops."""
    op = "einsum_grad" if grad else "einsum"
    eq = equation.replace(" ", "")
    if eq.count("->") > 1:
        raise InvalidAttributeError(f"{op}: equation {equation!r} has more than one '->'")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(shapes):
        raise InvalidAttributeError(
            f"{op}: equation {equation!r} has {len(terms)} operands but inputs has {len(shapes)} tensors"
        )
    if not shapes:
        raise InvalidAttributeError(f"{op}: inputs is empty")

    def explicit(term: str, where: str) -> tuple[str, bool]:
        has = "..." in term
        t = term.replace("...", "", 1)
        if "." in t:
            raise InvalidAttributeError(f"{op}: equation {equation!r}: bad ellipsis in {where} {term!r}")
        for ch in t:
            if not ch.isascii() or not ch.isalpha():
                raise InvalidAttributeError(f"{op}: equation {equation!r}: {ch!r} is not a letter ({where})")
        return t, has

    parts: list[tuple[str, bool]] = []
    ell_n: list[int] = []
    for i, (term, shape) in enumerate(zip(terms, shapes)):
        t, has = explicit(term, f"operand {i}")
        n_ell = len(shape) - len(t)
        if (not has and n_ell != 0) or n_ell < 0:
            raise ShapeMismatchError(
                f"{op}: inputs[{i}] has {len(shape)} dims but the equation labels {term!r} give {len(t)}"
            )
        parts.append((t, has))
        ell_n.append(n_ell if has else 0)
    max_ell = max(ell_n)
    if max_ell > len(_ELL):
        raise ShapeMismatchError(f"{op}: too many ellipsis dims ({max_ell})")
    ell = _ELL[:max_ell]
    labels: list[str] = []
    for (t, has), n_e, term in zip(parts, ell_n, terms):
        if has:
            pre, _, post = term.partition("...")
            labels.append(pre + ell[max_ell - n_e:] + post)
        else:
            labels.append(t)
    if arrow:
        t, has = explicit(rhs, "the output")
        if not has and max_ell:
            raise InvalidAttributeError(f"{op}: equation {equation!r}: the operands have '...' but the output has not")
        out = rhs.replace("...", ell) if has else t
    else:
        counts: dict[str, int] = {}
        for lb in labels:
            for ch in lb:
                counts[ch] = counts.get(ch, 0) + 1
        out = ell + "".join(sorted(c for c, k in counts.items() if k == 1 and c not in ell))
    seen = set("".join(labels))
    for ch in out:
        if ch not in seen:
            raise InvalidAttributeError(f"{op}: equation {equation!r}: output letter {ch!r} is in no operand")
    if len(set(out)) != len(out):
        raise InvalidAttributeError(f"{op}: equation {equation!r}: the output repeats a letter")
    # sizes per letter; size-1 ellipsis axes broadcast
    size: dict[str, int] = {}
    for i, (lb, shape) in enumerate(zip(labels, shapes)):
        for ch, s in zip(lb, shape):
            if s < 0:
                continue
            cur = size.get(ch)
            if cur is None or cur == 1:
                if cur == 1 and s != 1 and ch not in ell:
                    raise ShapeMismatchError(f"{op}: letter {ch!r} has sizes 1 and {s} (inputs[{i}] {list(shape)})")
                size[ch] = s
            elif s != cur and not (s == 1 and ch in ell):
                raise ShapeMismatchError(
                    f"{op}: letter {ch!r} has sizes {cur} and {s} (inputs[{i}] shape {list(shape)})"
                )
    final: list[str] = []
    replicated: set[str] = set()
    for lb, shape in zip(labels, shapes):
        s2 = "".join(BROADCAST if (ch in ell and s == 1 and size.get(ch, 1) != 1) else ch for ch, s in zip(lb, shape))
        final.append(s2)
        real = [c for c in s2 if c != BROADCAST]
        replicated.update(c for c in real if real.count(c) > 1)
    if grad:
        held = [None if r < 0 else BROADCAST * r for r in cache]
        return Notation([*final, *held, out], final, replicated=replicated, prune="*")
    return Notation(final, [out], replicated=replicated, prune="*")


def _grads(ins: Any, outs: Any, *args: object) -> Any:  # grouped as Paddle's lists
    """einsum_grad's grads as one list (Paddle's grouping)."""
    return ins, (tuple(outs),)


_SHAPES = "tuple([t.shape for t in inputs])"
_ENV = {"_notation": einsum_notation}
_PRE = "if not inputs: _notation(equation, ())  # the equation's error: no operand given"
declare(
    "einsum", "inputs: [T], equation: str",
    Way(einsum_notation, key=f"equation, {_SHAPES}", letters=True, paddle="EinsumInferSpmd", env=_ENV, pre=_PRE,
        doc="EinsumInferSpmd: the equation as notation; contracted letters make out partial SUM."),
    grad=Way(lambda eq, shapes, cache: einsum_notation(eq, shapes, True, cache),
             key=f"equation, {_SHAPES}, inner_cache", letters=True, post=_grads, paddle="EinsumGradInferSpmd",
             env={"_notation": partial(einsum_notation, grad=True)}, pre=_PRE,
             doc="EinsumGradInferSpmd: merge over the inputs and out_grad; each input's grad sharded as it and "
                 "partial SUM over the letters it lacks; inner_cache replicated."),
    grad_signature="inputs: [T], inner_cache: [T?], out_grad: T, equation: str", grad_name="einsum_grad",
)  # fmt: skip
