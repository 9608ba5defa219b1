"""The elementwise family: unary ops, binary ops with numpy broadcasting, and their grads.

Notations (Paddle 3.3.1's ``elementwise.cc``):

* unary ``abcd -> abcd``; Paddle 3.3.1 drops a mesh dim that does not divide its
  axis (minor co-shard dims first), on the input and the output alike;
* binary with broadcasting, aligned on the trailing axes, ``1`` for a size-1 axis
  (never sharded): x ``[4, 1]``, y ``[3, 4, 5]`` -> ``1bc, abc -> abc``
  (``bc`` for x but with a ``1``: ``b1``, ``abc -> abc``). Uneven shardings are kept
  (balanced split is sound for elementwise ops); a co-sharded axis keeps only its
  largest mesh dim, the first of equal sizes (as Paddle 3.3.1 does).

Partial inputs: the plain rules reshard a partial input to replicated (sound);
``multiply`` keeps one input's partial SUM/AVG status when it collides with no
sharding (``x_p * y`` summed over the mesh dim is ``x * y``; ``x_p * y_p`` is not, so
the other input is made replicated); ``cast`` keeps the input's partial status.

Grad rules: unary grads take out_grad's sharding for every tensor (partial
cleared); binary grads give the gradient of a broadcast input partial SUM over
the mesh dims that shard the axes it was broadcast along.
"""

from __future__ import annotations

from functools import lru_cache

from spmdkit.core.dist_attr import DimsMapping, Partial, ReduceType, TensorDistAttr, entry_dims
from spmdkit.core.errors import InvalidAttributeError, InvalidMeshError, ShapeMismatchError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.spec import DistTensorSpec, SpmdResult
from spmdkit.engine.compile import Plan, compile_plan, infer
from spmdkit.engine.memo import memo
from spmdkit.engine.notation import (
    ALPHABET,
    BROADCAST,
    Notation,
    einsum_backward,
    einsum_forward,
    fast_result,
    letters_for,
)
from spmdkit.rules._common import check_like
from spmdkit.rules.registry import register

_NLETTERS = len(ALPHABET)
_make = TensorDistAttr.unchecked

# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def _mesh2(op: str, a: DistTensorSpec, b: DistTensorSpec, na: str, nb: str) -> ProcessMesh:
    m = a.dist_attr.mesh
    if b.dist_attr.mesh != m:
        raise InvalidMeshError(
            f"{op}: {na} and {nb} lie on different meshes ({m!r} and {b.dist_attr.mesh!r})"
        )
    return m


def _used_dims(dm: DimsMapping) -> set[int]:
    used: set[int] = set()
    for e in dm:
        used.update(entry_dims(e))
    return used


# ---------------------------------------------------------------------------
# unary
# ---------------------------------------------------------------------------


@lru_cache(maxsize=64)
def _unary_notation(ndim: int) -> Notation:
    if ndim > len(ALPHABET):
        raise ShapeMismatchError(f"tensors of more than {len(ALPHABET)} dims are not supported")
    a = ALPHABET[:ndim]
    return Notation([a], [a], prune="*")


def _unary_fwd(op: str, x: DistTensorSpec) -> SpmdResult:
    ins, outs = einsum_forward(op, _unary_notation(len(x.shape)), [x], ["x"])
    return SpmdResult(ins, outs)


def _unary_bwd(op: str, x: DistTensorSpec, out: DistTensorSpec) -> SpmdResult:
    if len(out.shape) != len(x.shape):
        raise ShapeMismatchError(f"{op}: out has {len(out.shape)} dims but x has {len(x.shape)}")
    ins, outs = einsum_backward(op, _unary_notation(len(x.shape)), [x], [out], ["x", "out"])
    return SpmdResult(ins, outs)


def _make_unary(op: str) -> tuple[object, object]:
    def forward(x: DistTensorSpec) -> SpmdResult:
        return _unary_fwd(op, x)

    def backward(x: DistTensorSpec, out: DistTensorSpec) -> SpmdResult:
        return _unary_bwd(op, x, out)

    forward.__name__ = f"{op}_forward"
    forward.__doc__ = f"{op}: elementwise unary; out is sharded as x (uneven mesh dims dropped)."
    backward.__name__ = f"{op}_backward"
    return forward, backward


def gelu_forward(x: DistTensorSpec, approximate: bool = False) -> SpmdResult:
    """gelu: elementwise unary."""
    return _unary_fwd("gelu", x)


def gelu_grad(x: DistTensorSpec, out_grad: DistTensorSpec, approximate: bool = False) -> SpmdResult:
    """GeluGradInferSpmd: x and x_grad take out_grad's sharding."""
    return _unary_grad("gelu_grad", (x,), ("x",), out_grad)


# integer / bool target dtypes: a sum of casts is not the cast of the sum
_INT_DTYPES = frozenset(
    {"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"}
)
_MONOTONE = frozenset({ReduceType.MAX, ReduceType.MIN})


def _dtype_name(dtype: object) -> str:
    s = str(dtype).lower()
    for prefix in ("paddle.", "datatype.", "torch.", "np.", "numpy."):
        if s.startswith(prefix):
            s = s[len(prefix) :]
    return s


def _cast_partial(partial: Partial, dtype: object) -> Partial:
    if not partial or _dtype_name(dtype) not in _INT_DTYPES:
        return partial
    # rounding to an integer type commutes with max / min only
    return tuple(p for p in partial if p[1] in _MONOTONE)


def cast_forward(x: DistTensorSpec, dtype: object = "float32") -> SpmdResult:
    """cast (CastInferSpmd): elementwise unary keeping x's partial status."""
    ins, outs = einsum_forward("cast", _unary_notation(len(x.shape)), [x], ["x"])
    pt = _cast_partial(x.dist_attr.partial, dtype)
    if pt:
        xi, o = ins[0], outs[0]
        assert xi is not None and o is not None
        ins = [TensorDistAttr.unchecked(xi.mesh, xi.dims_mapping, pt)]
        outs = [TensorDistAttr.unchecked(o.mesh, o.dims_mapping, pt)]
    return SpmdResult(ins, outs)


def cast_backward(x: DistTensorSpec, out: DistTensorSpec, dtype: object = "float32") -> SpmdResult:
    return _unary_bwd("cast", x, out)


# ---------------------------------------------------------------------------
# unary grads (ElementwiseUnaryGradInferSpmd overloads)
# ---------------------------------------------------------------------------


def _unary_grad(
    op: str,
    tensors: tuple[DistTensorSpec, ...],
    names: tuple[str, ...],
    out_grad: DistTensorSpec,
    keep_partial: bool = False,
) -> SpmdResult:
    """Every tensor (and the grad) takes out_grad's dims_mapping (``abc, abc -> abc``, merged
    from out_grad alone); partial cleared (``keep_partial``: out_grad's kept on it and the grad)."""
    mesh = out_grad.dist_attr.mesh
    for t, n in zip(tensors, names):
        if t.dist_attr.mesh != mesh:
            raise InvalidMeshError(f"{op}: {n} and out_grad lie on different meshes")
        check_like(op, out_grad, t, "out_grad", n)
    ins, outs = infer(_unary_grad_plan(len(out_grad.shape), len(tensors)), op, (*tensors, out_grad), (), mesh)
    if keep_partial and out_grad.dist_attr.partial:
        g = outs[0]
        assert g is not None
        g = TensorDistAttr.unchecked(mesh, g.dims_mapping, out_grad.dist_attr.partial)
        return fast_result((*ins[:-1], g), (g,))
    return fast_result(ins, outs)


@lru_cache(maxsize=256)
def _unary_grad_plan(ndim: int, n: int) -> Plan:
    """``n`` tensors and out_grad, ``abc, ..., abc -> abc``: the letters from out_grad alone."""
    a = letters_for(ndim)
    return compile_plan(Notation([a] * (n + 1), [a], sources=(n,)))


def elementwise_unary_grad(x: DistTensorSpec, out_grad: DistTensorSpec) -> SpmdResult:
    """ElementwiseUnaryGradInferSpmd(x, out_grad)."""
    return _unary_grad("elementwise_unary_grad", (x,), ("x",), out_grad)


def _make_unary_grad(op: str, inputs: tuple[str, ...]) -> tuple[object, str]:
    """A grad rule over (inputs..., out_grad) for one of the overloads."""
    n = len(inputs)
    if n == 0:

        def fn0(out_grad: DistTensorSpec) -> SpmdResult:
            return _unary_grad(op, (), (), out_grad)

        fn: object = fn0
    elif n == 1:

        def fn1(a: DistTensorSpec, out_grad: DistTensorSpec) -> SpmdResult:
            return _unary_grad(op, (a,), inputs, out_grad)

        fn = fn1
    else:

        def fn2(a: DistTensorSpec, b: DistTensorSpec, out_grad: DistTensorSpec) -> SpmdResult:
            return _unary_grad(op, (a, b), inputs, out_grad)

        fn = fn2
    fn.__doc__ = f"{op}: ElementwiseUnaryGradInferSpmd({', '.join((*inputs, 'out_grad'))})"
    sig = ", ".join(f"{i}: T" for i in (*inputs, "out_grad"))
    return fn, sig


def cast_grad(x: DistTensorSpec, out_grad: DistTensorSpec) -> SpmdResult:
    """cast_grad: x_grad = cast(out_grad) back to x's dtype; keeps out_grad's partial."""
    return _unary_grad("cast_grad", (x,), ("x",), out_grad, keep_partial=True)


def pow_grad(x: DistTensorSpec, out_grad: DistTensorSpec, y: object = 1.0) -> SpmdResult:
    """PowGradInferSpmd(x, out_grad, y)."""
    return _unary_grad("pow_grad", (x,), ("x",), out_grad)


def scale_grad(out_grad: DistTensorSpec) -> SpmdResult:
    """scale_grad: ElementwiseUnaryGradInferSpmd(out_grad)."""
    return _unary_grad("scale_grad", (), (), out_grad)


# ---------------------------------------------------------------------------
# binary
# ---------------------------------------------------------------------------


@memo(4096)
def _binary_notation(xs: tuple[int, ...], ys: tuple[int, ...]) -> tuple[str, str, str] | str:
    """Paddle's GetBinaryNotations; a string result is the error message."""
    nx, ny = len(xs), len(ys)
    n = max(nx, ny)
    if n > len(ALPHABET):
        return f"tensors of more than {len(ALPHABET)} dims are not supported"
    letters = ALPHABET[:n]
    xa = list(letters[n - nx :])
    ya = list(letters[n - ny :])
    out = list(letters)
    for i in range(n):
        ix, iy = i - (n - nx), i - (n - ny)
        bx = ix < 0 or xs[ix] == 1
        by = iy < 0 or ys[iy] == 1
        if ix >= 0 and xs[ix] == 1:
            xa[ix] = BROADCAST
        if iy >= 0 and ys[iy] == 1:
            ya[iy] = BROADCAST
        if bx and by:
            out[i] = BROADCAST
        if not bx and not by:
            sx, sy = xs[ix], ys[iy]
            if sx != sy and sx >= 0 and sy >= 0:
                return (
                    f"x shape {list(xs)} and y shape {list(ys)} do not broadcast "
                    f"(x axis {ix} has {sx}, y axis {iy} has {sy})"
                )
    return "".join(xa), "".join(ya), "".join(out)


def _notation2(op: str, x: DistTensorSpec, y: DistTensorSpec) -> tuple[str, str, str]:
    nt = _binary_notation(x.shape, y.shape)
    if isinstance(nt, str):
        raise ShapeMismatchError(f"{op}: {nt}")
    return nt


def _binary_fwd(op: str, x: DistTensorSpec, y: DistTensorSpec, names: tuple[str, str] = ("x", "y")) -> SpmdResult:
    mesh = x.dist_attr.mesh
    ym = y.dist_attr.mesh
    if ym is not mesh and ym != mesh:
        _mesh2(op, x, y, *names)
    p = _binary_plan(x.shape, y.shape)
    if p is None:
        _notation2(op, x, y)  # raises
        raise AssertionError("unreachable")
    return fast_result(*infer(p, op, (x, y), (), mesh, names))


@lru_cache(maxsize=4096)
def _binary_plan(xs: tuple[int, ...], ys: tuple[int, ...]) -> Plan | None:
    """The forward plan for x / y shapes that broadcast (None where they do not)."""
    if not _broadcasts(xs, ys):
        return None
    return compile_plan(_binary_nt(tuple([s == 1 for s in xs]), tuple([s == 1 for s in ys]), "forward"))


def _broadcasts(xs: tuple[int, ...], ys: tuple[int, ...]) -> bool:
    """Whether :func:`_binary_notation` accepts the shapes."""
    nx, ny = len(xs), len(ys)
    n = nx if nx >= ny else ny
    if n > _NLETTERS:
        return False
    ox, oy = n - nx, n - ny
    for j in range(ox if ox > oy else oy, n):
        sx, sy = xs[j - ox], ys[j - oy]
        if sx != sy and sx != 1 and sy != 1 and sx >= 0 and sy >= 0:
            return False
    return True


def _binary_bwd(op: str, x: DistTensorSpec, y: DistTensorSpec, out: DistTensorSpec) -> SpmdResult:
    xa, ya, oa = x.dist_attr, y.dist_attr, out.dist_attr
    mesh = xa.mesh
    if ya.mesh is not mesh and ya.mesh != mesh:
        _mesh2(op, x, y, "x", "y")
    if oa.mesh is not mesh and oa.mesh != mesh:
        raise InvalidMeshError(f"{op}: out lies on a different mesh than x and y")
    xs, ys, os_ = x.shape, y.shape, out.shape
    if not _broadcasts(xs, ys):
        _notation2(op, x, y)  # raises
    nx, ny = len(xs), len(ys)
    n = nx if nx >= ny else ny
    if len(os_) != n:
        raise ShapeMismatchError(
            f"{op}: out has {len(os_)} dims but the broadcast of x and y has {n}"
        )
    for i in range(n):
        s = os_[i]
        if s < 0:
            continue
        ix, iy = i - (n - nx), i - (n - ny)
        want = 1
        if ix >= 0 and xs[ix] != 1:
            want = xs[ix]
        elif iy >= 0 and ys[iy] != 1:
            want = ys[iy]
        if want >= 0 and s != want:
            raise ShapeMismatchError(f"{op}: out axis {i} has {s}, but x and y broadcast to {want}")
    # x and y take out's letters (a co-shard read as its largest mesh dim); out is what they make
    nt = _binary_nt(tuple([s == 1 for s in xs]), tuple([s == 1 for s in ys]), "backward")
    ins, outs = einsum_backward(op, nt, (x, y), (out,))
    return fast_result(tuple(ins), tuple(outs))


@lru_cache(maxsize=4096)
def _binary_nt(x_unit: tuple[bool, ...], y_unit: tuple[bool, ...], direction: str) -> Notation:
    """The binary notation of shapes that broadcast, from their size-1 masks alone, with
    Paddle's merge: a co-shard read as its largest mesh dim; forward: where x and y shard one
    letter over different mesh dims the larger tensor wins (x on a tie), letters and the
    sharded size-1 axes (``1``) take their mesh dims in claim order (x's axes, then y's), a
    size-1 axis sharding nothing."""
    nt = _binary_notation(tuple([1 if u else 2 for u in x_unit]), tuple([1 if u else 2 for u in y_unit]))
    assert not isinstance(nt, str)  # the shapes were checked to broadcast
    if direction == "forward":
        return Notation(nt[:2], nt[2:], coshard="largest", unit_axes="claim")
    return Notation(nt[:2], nt[2:], coshard="largest")


def _make_binary(op: str) -> tuple[object, object]:
    def forward(x: DistTensorSpec, y: DistTensorSpec) -> SpmdResult:
        return _binary_fwd(op, x, y)

    def backward(x: DistTensorSpec, y: DistTensorSpec, out: DistTensorSpec) -> SpmdResult:
        return _binary_bwd(op, x, y, out)

    forward.__name__ = f"{op}_forward"
    forward.__doc__ = f"{op}: elementwise binary with numpy broadcasting."
    backward.__name__ = f"{op}_backward"
    return forward, backward


_LINEAR = frozenset({ReduceType.SUM, ReduceType.AVG})


def multiply_forward(x: DistTensorSpec, y: DistTensorSpec) -> SpmdResult:
    """multiply (ElementwiseBinaryWithPartialInferSpmd): a partial SUM/AVG input stays
    partial (and so does out) where no sharding takes its mesh dims; the other input
    is made replicated over its partial dims (x_p * y_p summed is not x * y)."""
    res = _binary_fwd("multiply", x, y)
    px, py = x.dist_attr.partial, y.dist_attr.partial
    if not px and not py:
        return res
    primary = 0 if px else 1
    pt = px if px else py
    ox = res.outputs[0]
    assert isinstance(ox, TensorDistAttr)
    used = _used_dims(ox.dims_mapping)
    if any(d in used or r not in _LINEAR for d, r in pt):
        return res
    ins = list(res.inputs)
    a = ins[primary]
    assert isinstance(a, TensorDistAttr)
    ins[primary] = TensorDistAttr.unchecked(a.mesh, a.dims_mapping, pt)
    return SpmdResult(ins, [TensorDistAttr.unchecked(ox.mesh, ox.dims_mapping, pt)])


def multiply_backward(x: DistTensorSpec, y: DistTensorSpec, out: DistTensorSpec) -> SpmdResult:
    return _binary_bwd("multiply", x, y, out)


# ---------------------------------------------------------------------------
# binary grads (ElementwiseBinaryGradInferSpmd)
# ---------------------------------------------------------------------------


@lru_cache(maxsize=4096)
def _binary_grad_plan(xs: tuple[int, ...], ys: tuple[int, ...], nd: int, with_out: bool) -> Plan:
    return _binary_grad_unit_plan(tuple([s == 1 for s in xs]), tuple([s == 1 for s in ys]), nd, with_out)


@lru_cache(maxsize=1024)
def _binary_grad_unit_plan(x_unit: tuple[bool, ...], y_unit: tuple[bool, ...], nd: int, with_out: bool) -> Plan:
    """``1c, bc, abc -> 1c, bc`` (x, y, [out,] out_grad -> x_grad, y_grad), merged from out_grad
    alone: an input takes out_grad's sharding on its axes (a size-1 axis ``1``: unsharded),
    its grad is partial SUM over the mesh dims of the axes it was broadcast along."""
    g = letters_for(nd)

    def lab(unit: tuple[bool, ...]) -> str:
        off = nd - len(unit)
        return "".join(BROADCAST if u else g[i + off] for i, u in enumerate(unit))

    x, y = lab(x_unit), lab(y_unit)
    ins = [x, y, g, g] if with_out else [x, y, g]
    return compile_plan(Notation(ins, [x, y], sources=(len(ins) - 1,)))


def _check_grad_shapes(op: str, t: DistTensorSpec, name: str, og: DistTensorSpec) -> None:
    diff = len(og.shape) - len(t.shape)
    if diff < 0:
        raise ShapeMismatchError(
            f"{op}: {name} has {len(t.shape)} dims, more than out_grad's {len(og.shape)}"
        )
    for i, s in enumerate(t.shape):
        g = og.shape[i + diff]
        if s != 1 and s != g and s >= 0 and g >= 0:
            raise ShapeMismatchError(
                f"{op}: {name} axis {i} has {s}, which does not broadcast to out_grad's {g}"
            )


def _binary_grad(
    op: str,
    x: DistTensorSpec,
    y: DistTensorSpec,
    out: DistTensorSpec | None,
    out_grad: DistTensorSpec,
    axis: int,
) -> SpmdResult:
    mesh = out_grad.dist_attr.mesh
    tensors = [("x", x), ("y", y)] + ([("out", out)] if out is not None else [])
    for n, t in tensors:
        if t.dist_attr.mesh != mesh:
            raise InvalidMeshError(f"{op}: {n} and out_grad lie on different meshes")
    _check_grad_shapes(op, x, "x", out_grad)
    _check_grad_shapes(op, y, "y", out_grad)
    if out is not None:
        check_like(op, out_grad, out, "out_grad", "out")
    nd = len(out_grad.shape)
    if axis != -1:
        ok = all(len(t.shape) == nd or axis == nd - len(t.shape) for t in (x, y))
        if not ok:
            raise InvalidAttributeError(
                f"{op}: axis {axis} is not supported (only -1, numpy-style trailing alignment)"
            )
    p = _binary_grad_plan(x.shape, y.shape, nd, out is not None)
    specs = (x, y, out_grad) if out is None else (x, y, out, out_grad)
    return fast_result(*infer(p, op, specs, (), mesh))


def _make_binary_grad(op: str, with_out: bool) -> object:
    if with_out:

        def fn_out(
            x: DistTensorSpec, y: DistTensorSpec, out: DistTensorSpec, out_grad: DistTensorSpec, axis: int = -1
        ) -> SpmdResult:
            return _binary_grad(op, x, y, out, out_grad, axis)

        fn_out.__doc__ = f"{op}: ElementwiseBinaryGradInferSpmd(x, y, out, out_grad, axis)"
        return fn_out

    def fn(x: DistTensorSpec, y: DistTensorSpec, out_grad: DistTensorSpec, axis: int = -1) -> SpmdResult:
        return _binary_grad(op, x, y, None, out_grad, axis)

    fn.__doc__ = f"{op}: ElementwiseBinaryGradInferSpmd(x, y, out_grad, axis)"
    return fn


def dropout_grad(
    mask: DistTensorSpec,
    out_grad: DistTensorSpec,
    p: object = 0.5,
    is_test: bool = False,
    mode: str = "upscale_in_train",
) -> SpmdResult:
    """DropoutBwdInferSpmd: ElementwiseBinaryInferSpmd(mask, out_grad)."""
    return _binary_fwd("dropout_grad", mask, out_grad, ("mask", "out_grad"))


# ---------------------------------------------------------------------------
# registration
# ---------------------------------------------------------------------------

#: every Paddle 3.3.1 name registered to ElementwiseUnaryInferSpmd / ...Reverse
UNARY_OPS = (
    "abs", "acos", "acosh", "asin", "asinh", "assign", "atan", "atanh", "bernoulli",
    "bitwise_not", "ceil", "celu", "clip", "conj", "cos", "cosh", "digamma", "dropout",
    "elementwise_unary", "elu", "erf", "erfinv", "exp", "expm1", "fill", "floor",
    "hardshrink", "hardsigmoid", "hardswish", "hardtanh", "leaky_relu", "lgamma", "log",
    "log10", "log1p", "log2", "logical_not", "logit", "logsigmoid", "mish", "poisson", "pow",
    "reciprocal", "relu", "relu6", "round", "rsqrt", "scale", "selu", "sigmoid", "sign",
    "silu", "sin", "sinh", "softplus", "softshrink", "softsign", "sqrt", "square", "stanh",
    "swish", "tan", "tanh", "tanh_shrink", "thresholded_relu", "trunc",
)  # fmt: skip

#: every Paddle 3.3.1 name registered to ElementwiseBinaryInferSpmd / ...Reverse
BINARY_OPS = (
    "add", "bitwise_and", "bitwise_or", "bitwise_xor", "divide", "elementwise_add",
    "elementwise_binary", "elementwise_div", "elementwise_mul", "elementwise_pow",
    "floor_divide", "fmax", "fmin", "greater_than", "heaviside", "less_than",
    "logical_and", "logical_or", "logical_xor", "maximum", "minimum", "not_equal",
    "remainder", "subtract", "trunc_divide",
)  # fmt: skip

#: unary grad rules: the tensors Paddle's grad kernel takes before out_grad
UNARY_GRADS: dict[str, tuple[str, ...]] = {
    # (out, out_grad)
    **{f"{n}_grad": ("out",) for n in ("relu", "relu6", "sigmoid", "tanh", "exp", "expm1", "sqrt",
                                       "rsqrt", "reciprocal", "hardsigmoid", "selu")},
    # (x, out_grad)
    **{f"{n}_grad": ("x",) for n in ("abs", "acos", "acosh", "asin", "asinh", "atan", "atanh",
                                     "cos", "cosh", "sin", "sinh", "tan", "log", "log10", "log1p",
                                     "log2", "square", "erf", "erfinv", "softsign", "softplus",
                                     "softshrink", "hardshrink", "hardswish", "hardtanh",
                                     "leaky_relu", "logsigmoid", "mish", "swish", "tanh_shrink",
                                     "thresholded_relu", "logit", "stanh", "celu", "clip",
                                     "digamma", "lgamma")},
    # (x, out, out_grad)
    "silu_grad": ("x", "out"),
    "elu_grad": ("x", "out"),
    # (out_grad)
    **{f"{n}_grad": () for n in ("floor", "ceil", "round", "trunc", "sign")},
}  # fmt: skip

BINARY_GRADS = ("add_grad", "subtract_grad", "multiply_grad", "maximum_grad", "minimum_grad",
                "elementwise_pow_grad", "fmax_grad", "fmin_grad", "heaviside_grad",
                "remainder_grad", "floor_divide_grad")  # fmt: skip


def _register_all() -> None:
    for name in UNARY_OPS:
        f, b = _make_unary(name)
        register(
            name, f, "x: T", b, kind="reverse", outputs="out: T",  # type: ignore[arg-type]
            forward_name="ElementwiseUnaryInferSpmd", backward_name="ElementwiseUnaryInferSpmdReverse",
        )  # fmt: skip
    register(
        "gelu", gelu_forward, "x: T, approximate: bool = False", gelu_grad,
        "x: T, out_grad: T, approximate: bool = False", kind="grad", grad_name="gelu_grad",
        forward_name="GeluInferSpmd", backward_name="GeluGradInferSpmd",
    )  # fmt: skip
    register(
        "cast", cast_forward, "x: T, dtype: any = 'float32'", cast_backward,
        kind="reverse", outputs="out: T",
        forward_name="CastInferSpmd", backward_name="ElementwiseUnaryInferSpmdReverse",
    )  # fmt: skip
    for name in BINARY_OPS:
        f, b = _make_binary(name)
        register(
            name, f, "x: T, y: T", b, kind="reverse", outputs="out: T",  # type: ignore[arg-type]
            forward_name="ElementwiseBinaryInferSpmd", backward_name="ElementwiseBinaryInferSpmdReverse",
        )  # fmt: skip
    register(
        "multiply", multiply_forward, "x: T, y: T", multiply_backward, kind="reverse", outputs="out: T",
        forward_name="ElementwiseBinaryWithPartialInferSpmd",
        backward_name="ElementwiseBinaryInferSpmdReverse",
    )  # fmt: skip
    # grads
    register("elementwise_unary_grad", elementwise_unary_grad, "x: T, out_grad: T",
             forward_name="ElementwiseUnaryGradInferSpmd")  # fmt: skip
    for name, inputs in UNARY_GRADS.items():
        fn, sig = _make_unary_grad(name, inputs)
        register(name, fn, sig, forward_name="ElementwiseUnaryGradInferSpmd")  # type: ignore[arg-type]
    register("cast_grad", cast_grad, "x: T, out_grad: T", forward_name="ElementwiseUnaryGradInferSpmd")
    register("pow_grad", pow_grad, "x: T, out_grad: T, y: scalar = 1.0", forward_name="PowGradInferSpmd")
    register("scale_grad", scale_grad, "out_grad: T", forward_name="ElementwiseUnaryGradInferSpmd")
    register(
        "dropout_grad", dropout_grad,
        "mask: T, out_grad: T, p: scalar = 0.5, is_test: bool = False, mode: str = 'upscale_in_train'",
        forward_name="DropoutBwdInferSpmd",
    )  # fmt: skip
    for name in BINARY_GRADS:
        register(name, _make_binary_grad(name, False), "x: T, y: T, out_grad: T, axis: int = -1",  # type: ignore[arg-type]
                 forward_name="ElementwiseBinaryGradInferSpmd")  # fmt: skip
    register("divide_grad", _make_binary_grad("divide_grad", True),  # type: ignore[arg-type]
             "x: T, y: T, out: T, out_grad: T, axis: int = -1",
             forward_name="ElementwiseBinaryGradInferSpmd")  # fmt: skip


_register_all()
