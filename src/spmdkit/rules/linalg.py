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

from functools import lru_cache, partial
from typing import Any

from spmdkit.core.dist_attr import DimsMapping, Entry, ReduceType, TensorDistAttr, entry_dims
from spmdkit.core.errors import InvalidAttributeError, ShapeMismatchError, SpmdError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.spec import DistTensorSpec, SpmdResult
from spmdkit.engine.axes import replicated_like
from spmdkit.engine.compile import Plan, compile_plan, infer
from spmdkit.engine.memo import memo
from spmdkit.engine.notation import BROADCAST, Notation, einsum_forward, fast_result, named_mesh
from spmdkit.rules._absent import zero_d_absent
from spmdkit.engine.declare import Answer, Way, declare
from spmdkit.rules import matmul
from spmdkit.rules.registry import Rule, get_rule, register, reverse_signature

Shape = tuple[int, ...]
_SUM = ReduceType.SUM
_make = TensorDistAttr.unchecked

_RULES: dict[str, Rule] = {}


def _rule(name: str) -> Rule:
    r = _RULES.get(name)
    if r is None:
        r = _RULES[name] = get_rule(name)
    return r


def _call(op: str, name: str, mode: str, *args: Any) -> SpmdResult:
    """The public matmul rule, its errors renamed to ``op``."""
    try:
        return _rule(name).infer(mode, *args)
    except SpmdError as e:
        msg = str(e)
        for pre in ("matmul_grad: ", "matmul: "):
            if msg.startswith(pre):
                msg = msg[len(pre):]
        raise type(e)(f"{op}: {msg}") from None


def _partial_over(mesh: ProcessMesh, dm: DimsMapping, entries: tuple[Entry, ...] | list[Entry]) -> TensorDistAttr:
    pt: list[int] = []
    for e in entries:
        pt.extend(entry_dims(e))
    return _make(mesh, dm, tuple((d, _SUM) for d in sorted(pt)))


# ---------------------------------------------------------------------------
# bmm
# ---------------------------------------------------------------------------


def _check_bmm(op: str, x: DistTensorSpec, y: DistTensorSpec, g: DistTensorSpec | None = None) -> None:
    for name, t in (("x", x), ("y", y), ("out_grad", g)):
        if t is not None and len(t.shape) != 3:
            raise ShapeMismatchError(f"{op}: {name} must be 3-D, got shape {list(t.shape)}")
    xs, ys = x.shape, y.shape

    def eq(a: int, b: int) -> bool:
        return a == b or a < 0 or b < 0

    if not eq(xs[2], ys[1]):
        raise ShapeMismatchError(f"{op}: x's width {xs[2]} differs from y's height {ys[1]} (x {list(xs)}, y {list(ys)})")
    if not eq(xs[0], ys[0]):
        raise ShapeMismatchError(f"{op}: x and y have different batch sizes ({xs[0]} vs {ys[0]})")
    if g is not None:
        want = (xs[0], xs[1], ys[2])
        if not all(eq(a, b) for a, b in zip(g.shape, want)):
            raise ShapeMismatchError(f"{op}: out_grad shape {list(g.shape)} does not match x @ y = {list(want)}")


declare(
    "bmm", "x: T, y: T",
    Way(matmul.notation, key="x, y, False, False", mask=("x", "y"), check="_check_bmm('bmm', x, y)",
        env={"_check_bmm": _check_bmm}, paddle="BmmInferSpmd", doc="BmmInferSpmd: ``bmk, bkn -> bmn`` (matmul on 3-D operands)."),
    grad=Way(matmul.grad_notation, key="x, y, False, False", mask=("x", "y", "out_grad"),
             check="_check_bmm('bmm_grad', x, y, out_grad)", env={"_check_bmm": _check_bmm},
             paddle="BmmGradInferSpmd", doc="BmmGradInferSpmd: matmul_grad on 3-D operands."),
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


def _repl_last2(dm: DimsMapping) -> DimsMapping:
    n = len(dm)
    return tuple(-1 if i >= n - 2 else e for i, e in enumerate(dm))


@memo()
def _gemm_fwd_fix(
    mx: DimsMapping, my: DimsMapping, mo: DimsMapping, partial: bool
) -> tuple[DimsMapping, DimsMapping, DimsMapping, DimsMapping]:
    if partial:
        return _repl_last2(mx), _repl_last2(my), (-1,), _repl_last2(mo)
    return mx, my, (mo[-1],), mo


def _gemm_forward(op: str, names: tuple[str, str], x: DistTensorSpec, y: DistTensorSpec, bias: DistTensorSpec | None,
                  tx: bool, ty: bool, partial_ok: bool = False) -> SpmdResult:
    _check_bias(op, names[0], names[1], x, y, bias, tx, ty)
    mesh = named_mesh(op, ((names[0], x), (names[1], y), ("bias", bias)))
    r = _call(op, "matmul", "forward", x, y, tx, ty)
    ax, ay = r.inputs[0], r.inputs[1]
    ao = r.outputs[0]
    assert isinstance(ax, TensorDistAttr) and isinstance(ay, TensorDistAttr) and isinstance(ao, TensorDistAttr)
    if partial_ok and ao.partial:
        # a sharded k: out is partial SUM, and the bias is added once in total by asking for it
        # partial over the same mesh dims (each rank adds its share)
        ab = _make(mesh, (ao.dims_mapping[-1],), ao.partial)
        return fast_result((ax, ay, ab), (ao, ao))
    mx, my, mb, mo = _gemm_fwd_fix(ax.dims_mapping, ay.dims_mapping, ao.dims_mapping, bool(ao.partial))
    out = _make(mesh, mo)
    return fast_result((_make(mesh, mx), _make(mesh, my), None if bias is None else _make(mesh, mb)), (out, out))


def _gemm_backward(op: str, names: tuple[str, str], x: DistTensorSpec, y: DistTensorSpec, bias: DistTensorSpec | None,
                   out: DistTensorSpec, reserve_space: DistTensorSpec | None, tx: bool, ty: bool) -> SpmdResult:
    _check_bias(op, names[0], names[1], x, y, bias, tx, ty)
    mesh = named_mesh(op, ((names[0], x), (names[1], y), ("bias", bias), ("out", out), ("reserve_space", reserve_space)))
    if reserve_space is not None and reserve_space.shape != out.shape:
        raise ShapeMismatchError(
            f"{op}: reserve_space shape {list(reserve_space.shape)} differs from out shape {list(out.shape)}"
        )
    r = _call(op, "matmul", "backward", x, y, out, tx, ty)
    ao = r.outputs[0]
    assert isinstance(ao, TensorDistAttr)
    ab = None if bias is None else _make(mesh, (ao.dims_mapping[-1],))
    return fast_result((r.inputs[0], r.inputs[1], ab),  # type: ignore[arg-type]
                       (ao, None if reserve_space is None else ao))


def _gemm_grad(op: str, names: tuple[str, str], x: DistTensorSpec, y: DistTensorSpec,
               extra: tuple[tuple[str, DistTensorSpec | None], ...], out_grad: DistTensorSpec,
               tx: bool, ty: bool, absent_bias_grad: bool = False) -> SpmdResult:
    _check_bias(op, names[0], names[1], x, y, None, tx, ty)
    mesh = named_mesh(op, ((names[0], x), (names[1], y), *extra, ("out_grad", out_grad)))
    r = _call(op, "matmul_grad", "forward", x, y, out_grad, tx, ty)
    ag = r.inputs[2]
    assert isinstance(ag, TensorDistAttr)
    gdm = ag.dims_mapping
    bias_grad: TensorDistAttr | None = _partial_over(mesh, (gdm[-1],), gdm[:-1])
    ins: list[TensorDistAttr | None] = [r.inputs[0], r.inputs[1]]  # type: ignore[list-item]
    for name, t in extra:
        if t is None:
            ins.append(None)
        elif name == "reserve_space":
            if t.shape != out_grad.shape:
                raise ShapeMismatchError(
                    f"{op}: reserve_space shape {list(t.shape)} differs from out_grad shape {list(out_grad.shape)}"
                )
            ins.append(ag)
        else:  # bias: not used by the grads
            if len(t.shape) != 1:
                raise ShapeMismatchError(f"{op}: bias must be 1-D, got shape {list(t.shape)}")
            ins.append(_make(mesh, (gdm[-1],)))
    if absent_bias_grad:
        bias_grad = None  # no bias, no bias_grad
    return fast_result((ins[0], ins[1], ins[2], ag), (r.outputs[0], r.outputs[1], bias_grad))  # type: ignore[arg-type]


_XY = ("x", "y")
_IW = ("input", "weight")


def fused_gemm_epilogue_forward(x: DistTensorSpec, y: DistTensorSpec, bias: DistTensorSpec, trans_x: bool = False,
                                trans_y: bool = False) -> SpmdResult:
    """FusedGemmEpilogueInferSpmdBase: ``[b]mk, kn, n -> [b]mn`` (out, reserve_space); a
    sharded k makes out partial SUM and asks for bias partial alike (as Paddle 3.3.1)."""
    return _gemm_forward("fused_gemm_epilogue", _XY, x, y, bias, trans_x, trans_y, partial_ok=True)


def fused_gemm_epilogue_backward(x: DistTensorSpec, y: DistTensorSpec, bias: DistTensorSpec, out: DistTensorSpec,
                                 reserve_space: DistTensorSpec | None, trans_x: bool = False,
                                 trans_y: bool = False) -> SpmdResult:
    """fused_gemm_epilogue reverse (spmdkit's own): x, y from out (k replicated), bias as n."""
    return _gemm_backward("fused_gemm_epilogue", _XY, x, y, bias, out, reserve_space, trans_x, trans_y)


def fused_gemm_epilogue_grad(x: DistTensorSpec, y: DistTensorSpec, reserve_space: DistTensorSpec | None,
                             out_grad: DistTensorSpec, trans_x: bool = False, trans_y: bool = False,
                             activation_grad: str = "none") -> SpmdResult:
    """fused_gemm_epilogue_grad: matmul_grad for x_grad / y_grad; bias_grad as out_grad's
    last axis, partial SUM over the mesh dims of its other axes."""
    return _gemm_grad("fused_gemm_epilogue_grad", _XY, x, y, (("reserve_space", reserve_space),), out_grad,
                      trans_x, trans_y)


def _no_transpose(op: str, transpose_weight: bool) -> None:
    if transpose_weight:
        raise InvalidAttributeError(f"{op}: transpose_weight must be False in SPMD mode, got True")


def linear_v2_forward(input: DistTensorSpec, weight: DistTensorSpec, bias: DistTensorSpec | None,
                      transpose_weight: bool = False) -> SpmdResult:
    """LinearV2InferSpmdBase: ``[b]mk, kn, n -> [b]mn`` (out, reserve); a sharded k
    replicates the matmul axes."""
    _no_transpose("linear_v2", transpose_weight)
    return _gemm_forward("linear_v2", _IW, input, weight, bias, False, False)


def linear_v2_backward(input: DistTensorSpec, weight: DistTensorSpec, bias: DistTensorSpec | None, out: DistTensorSpec,
                       reserve_space: DistTensorSpec | None, transpose_weight: bool = False) -> SpmdResult:
    """linear_v2 reverse (spmdkit's own): input, weight from out (k replicated), bias as n."""
    _no_transpose("linear_v2", transpose_weight)
    return _gemm_backward("linear_v2", _IW, input, weight, bias, out, reserve_space, False, False)


def linear_v2_grad(input: DistTensorSpec, weight: DistTensorSpec, bias: DistTensorSpec | None, out_grad: DistTensorSpec,
                   transpose_weight: bool = False) -> SpmdResult:
    """linear_v2_grad: matmul_grad for input_grad / weight_grad; bias_grad as out_grad's last
    axis, partial SUM over its other axes."""
    _no_transpose("linear_v2_grad", transpose_weight)
    return _gemm_grad("linear_v2_grad", _IW, input, weight, (("bias", bias),), out_grad, False, False,
                      absent_bias_grad=bias is None)


# a 0-D optional tensor (shape []) is read as absent (spmdkit.rules._absent): (name, Paddle's name,
# forward, its signature and absent slots, reverse and its absent slots, grad, its signature and absent slots)
_GEMMS: tuple[tuple[Any, ...], ...] = (
    ("fused_gemm_epilogue", "FusedGemmEpilogue", fused_gemm_epilogue_forward,
     "x: T, y: T, bias: T, trans_x: bool = False, trans_y: bool = False", (),
     fused_gemm_epilogue_backward, ("reserve_space",), fused_gemm_epilogue_grad,
     "x: T, y: T, reserve_space: T?, out_grad: T, trans_x: bool = False, trans_y: bool = False, "
     "activation_grad: str = 'none'", ("reserve_space",)),
    ("linear_v2", "LinearV2", linear_v2_forward, "input: T, weight: T, bias: T?, transpose_weight: bool = False",
     ("bias",), linear_v2_backward, ("bias", "reserve_space"), linear_v2_grad,
     "input: T, weight: T, bias: T?, out_grad: T, transpose_weight: bool = False", ("bias",)),
)
for _name, _pd, _fwd, _sig, _fabs, _bwd, _babs, _grad, _gsig, _gabs in _GEMMS:
    _rev = reverse_signature(_sig, "out: T, reserve_space: T?")
    register(_name, zero_d_absent(_fwd, _sig, _fabs) if _fabs else _fwd, _sig,
             zero_d_absent(_bwd, _rev, _babs, outputs=("out", "reserve_space")), kind="reverse",
             outputs="out: T, reserve_space: T?", forward_name=f"{_pd}InferSpmdBase",
             backward_name=f"{_pd}InferSpmdReverse")  # fmt: skip
    register(f"{_name}_grad", zero_d_absent(_grad, _gsig, _gabs), _gsig, forward_name=f"{_pd}GradInferSpmd")


# ---------------------------------------------------------------------------
# fused_linear_param_grad_add
# ---------------------------------------------------------------------------


def _flpga_check(op: str, x: DistTensorSpec, dout: DistTensorSpec) -> None:
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


@lru_cache(maxsize=1024)
def _flpga_reverse_plan(nd: int, k1: bool, n1: bool, w: int, b: int, bias: bool, w_out: bool, b_out: bool) -> Plan:
    """The reverse: ``1..1k, 1..1n, kn, n, kn, n`` (x, dout, dweight, dbias, dweight_out,
    dbias_out), every answer an input of the notation (so none is partial), merged from the
    present outputs alone (``w_out`` / ``b_out``): k and n as dweight_out shards them, n from
    dbias_out where dweight_out leaves it free, n shards nothing where k took one of its mesh
    dims (``taken="letter"``); a size-1 k or n (``k1`` / ``n1``) never sharded; the leading
    axes replicated. ``w`` / ``b``: dweight / dbias as :func:`_code` labels them; no ``bias``:
    no dbias_out."""
    k, n = BROADCAST if k1 else "k", BROADCAST if n1 else "n"
    lead = BROADCAST * (nd - 1)

    def lab(code: int, full: str) -> str | None:
        return full if code == 1 else None if code == -1 else BROADCAST * (code - 2)

    src = [i for i, on in ((4, w_out), (5, b_out)) if on]
    return compile_plan(Notation([lead + k, lead + n, lab(w, k + n), lab(b, n), k + n, n if bias else None], [],
                                 conflict="first", taken="letter", sources=src))


def _flpga(op: str, x: DistTensorSpec, dout: DistTensorSpec, dweight: DistTensorSpec | None,
           dbias: DistTensorSpec | None, has_bias: bool,
           outs: tuple[DistTensorSpec | None, DistTensorSpec | None] | None = None) -> SpmdResult:
    named: tuple[tuple[str, DistTensorSpec | None], ...] = (("x", x), ("dout", dout), ("dweight", dweight),
                                                            ("dbias", dbias))
    if outs is not None:
        named = (*named, ("dweight_out", outs[0]), ("dbias_out", outs[1]))
    mesh = named_mesh(op, named)
    _flpga_check(op, x, dout)
    k, n = x.shape[-1], dout.shape[-1]
    _flpga_shape(op, "dweight", dweight, (k, n))
    _flpga_shape(op, "dbias", dbias, (n,))
    nd = len(x.shape)
    if outs is None:  # the forward
        # x^T dout over the leading axes: matmul with trans_x (as Paddle), then the batch
        # axes summed away (partial)
        r = _call(op, "matmul", "forward", x, dout, True, False)
        axa, ada, ao = r.inputs[0], r.inputs[1], r.outputs[0]
        assert isinstance(axa, TensorDistAttr) and isinstance(ada, TensorDistAttr) and isinstance(ao, TensorDistAttr)
        mx, md = axa.dims_mapping, ada.dims_mapping
        odm = ao.dims_mapping
        wdm: DimsMapping = (odm[-2], odm[-1])
        lead_w: list[Entry] = [d for d, _ in ao.partial]
        lead_w.extend(odm[:-2])
    else:  # the reverse
        wo, bo = outs
        _flpga_shape(op, "dweight_out", wo, (k, n))
        _flpga_shape(op, "dbias_out", bo, (n,))
        w_out, b_out = _present(wo), has_bias and _present(bo)
        p = _flpga_reverse_plan(nd, k == 1, n == 1, _code(dweight), _code(dbias, has_bias), has_bias, w_out, b_out)
        a, _ = infer(p, op, (x, dout, dweight, dbias, wo if w_out else None, bo if b_out else None), (), mesh)
        return fast_result(a[:4], a[4:])
    aw = _partial_over(mesh, wdm, lead_w)
    ab = _partial_over(mesh, (md[-1],), md[:-1]) if has_bias else None
    return fast_result(
        (_make(mesh, mx), _make(mesh, md), aw if _present(dweight) else replicated_like(mesh, dweight),
         (ab if has_bias and _present(dbias) else replicated_like(mesh, dbias))),
        (aw, ab),
    )


def fused_linear_param_grad_add_forward(x: DistTensorSpec, dout: DistTensorSpec, dweight: DistTensorSpec | None,
                                        dbias: DistTensorSpec | None, multi_precision: bool = False,
                                        has_bias: bool = True) -> SpmdResult:
    """FusedLinearParamGradAddInferSpmd: ``[b]sk, [b]sn -> kn, n``; dweight_out / dbias_out
    partial SUM over the leading axes' mesh dims; dweight / dbias sharded as they."""
    return _flpga("fused_linear_param_grad_add", x, dout, dweight, dbias, has_bias)


def fused_linear_param_grad_add_backward(x: DistTensorSpec, dout: DistTensorSpec, dweight: DistTensorSpec | None,
                                         dbias: DistTensorSpec | None, dweight_out: DistTensorSpec | None,
                                         dbias_out: DistTensorSpec | None, multi_precision: bool = False,
                                         has_bias: bool = True) -> SpmdResult:
    """fused_linear_param_grad_add reverse (spmdkit's own; Paddle's is a fake): k and n from
    the outputs, the leading axes replicated."""
    return _flpga("fused_linear_param_grad_add", x, dout, dweight, dbias, has_bias, (dweight_out, dbias_out))


register(
    "fused_linear_param_grad_add", fused_linear_param_grad_add_forward,
    "x: T, dout: T, dweight: T?, dbias: T?, multi_precision: bool = False, has_bias: bool = True",
    fused_linear_param_grad_add_backward,
    kind="reverse", outputs="dweight_out: T?, dbias_out: T?",
    forward_name="FusedLinearParamGradAddInferSpmd", backward_name="FusedLinearParamGradAddInferSpmdReverse",
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


def _grads(ins: Any, outs: Any, *args: object) -> Answer:
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
