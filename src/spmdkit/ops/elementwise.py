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

from dataclasses import replace
from functools import partial
from typing import Any

from spmdkit.core.dist_attr import ReduceType, TensorDistAttr, entry_dims
from spmdkit.core.errors import InvalidAttributeError, ShapeMismatchError
from spmdkit.core.spec import DistTensorSpec
from spmdkit.engine.declare import Answer, PartialIn, Way, declare, ones
from spmdkit.engine.facts import facts
from spmdkit.engine.notation import BROADCAST, Coshard, Notation, UnitAxes, letters_for
from spmdkit.engine.outshape import Args, Expect, broadcast, same
from spmdkit.ops._cost import by_bytes, fill, one_per_element

_make = TensorDistAttr.unchecked
Attrs = tuple[TensorDistAttr, ...]


def unary_notation(ndim: int) -> Notation:
    a = letters_for(ndim)
    return Notation([a], [a], prune="*")


def unary_grad_notation(n: int, ndim: int) -> Notation:
    """``n`` tensors and out_grad, ``abc, ..., abc -> abc``: the letters from out_grad alone."""
    a = letters_for(ndim)
    return Notation([a] * (n + 1), [a], sources=(n,))


# integer / bool target dtypes: a sum of casts is not the cast of the sum
_INT_DTYPES = frozenset({"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"})
_MONOTONE = frozenset({ReduceType.MAX, ReduceType.MIN})
_LINEAR = frozenset({ReduceType.SUM, ReduceType.AVG})


def _cast_post(ins: Attrs, outs: Attrs, x: DistTensorSpec, dtype: object) -> Answer:
    """cast keeps x's partial status (a cast of a sum is the sum of casts; for an integer
    dtype only where the reduce type is max / min: rounding commutes with those alone)."""
    s = str(dtype).lower()
    for prefix in ("paddle.", "datatype.", "torch.", "np.", "numpy."):
        s = s[len(prefix) :] if s.startswith(prefix) else s
    pt = x.dist_attr.partial
    if s in _INT_DTYPES:
        pt = tuple(p for p in pt if p[1] in _MONOTONE)
    if not pt:
        return ins, outs
    return (_make(ins[0].mesh, ins[0].dims_mapping, pt),), (_make(outs[0].mesh, outs[0].dims_mapping, pt),)


def _keep_grad_partial(ins: Attrs, outs: Attrs, x: DistTensorSpec, out_grad: DistTensorSpec) -> Answer:
    """cast_grad: x_grad = cast(out_grad) back to x's dtype; it keeps out_grad's partial."""
    g = _make(outs[0].mesh, outs[0].dims_mapping, out_grad.dist_attr.partial)
    return (*ins[:-1], g), (g,)


def _multiply_post(ins: Attrs, outs: Attrs, x: DistTensorSpec, y: DistTensorSpec) -> Answer:
    """multiply (ElementwiseBinaryWithPartialInferSpmd): a partial SUM/AVG input stays
    partial (and so does out) where no sharding takes its mesh dims; the other input
    is made replicated over its partial dims (x_p * y_p summed is not x * y)."""
    px = x.dist_attr.partial
    pt = px or y.dist_attr.partial
    used = {d for e in outs[0].dims_mapping for d in entry_dims(e)}
    if any(d in used or r not in _LINEAR for d, r in pt):
        return ins, outs
    new, i = list(ins), 0 if px else 1
    new[i] = _make(ins[i].mesh, ins[i].dims_mapping, pt)
    return new, [_make(outs[0].mesh, outs[0].dims_mapping, pt)]


# binary: numpy broadcasting, a size-1 axis labelled ``1``


def _bkey(x: DistTensorSpec, y: DistTensorSpec) -> tuple[int, int, int, int]:
    """The key of x and y shapes that broadcast (Paddle's GetBinaryNotations): their ranks and
    size-1 masks; ShapeMismatchError where they do not."""
    xs, ys = x.shape, y.shape
    nx, ny = len(xs), len(ys)
    if 1 not in xs and 1 not in ys and (xs[nx - ny :] == ys if nx >= ny else ys[ny - nx :] == xs):
        return nx, ny, 0, 0  # the common case: equal trailing axes, none of size 1
    n = max(nx, ny)
    letters_for(n)  # at most 26 axes
    for i in range(n - min(nx, ny), n):
        sx, sy = xs[i - n + nx], ys[i - n + ny]
        if sx != sy and sx != 1 and sy != 1 and sx >= 0 and sy >= 0:
            raise ShapeMismatchError(f"x shape {list(xs)} and y shape {list(ys)} do not broadcast "
                                     f"(x axis {i - n + nx} has {sx}, y axis {i - n + ny} has {sy})")
    return nx, ny, ones(x), ones(y)


def _labels(g: str, n: int, unit: int) -> str:
    """The last ``n`` letters of ``g``, ``1`` on the axes of the bit mask ``unit`` (size 1)."""
    return "".join(BROADCAST if (unit >> i) & 1 else g[len(g) - n + i] for i in range(n))


def binary_notation(direction: str, nx: int, ny: int, ux: int, uy: int) -> Notation:
    """The notation of x and y shapes that broadcast, from their ranks and size-1 masks, with
    Paddle's merge: a co-shard read as its largest mesh dim; forward: where x and y shard one
    letter over different mesh dims the larger tensor wins (x on a tie), letters and the
    sharded size-1 axes (``1``) take their mesh dims in claim order (x's axes, then y's), a
    size-1 axis sharding nothing; reverse: x and y take out's letters."""
    n = max(nx, ny)
    g = letters_for(n)
    x, y = _labels(g, nx, ux), _labels(g, ny, uy)
    pairs = zip(x.rjust(n, BROADCAST), y.rjust(n, BROADCAST))
    out = "".join(BROADCAST if a == b == BROADCAST else g[i] for i, (a, b) in enumerate(pairs))
    if direction == "forward":
        return Notation([x, y], [out], coshard=Coshard.LARGEST, unit_axes=UnitAxes.CLAIM)
    return Notation([x, y], [out], coshard=Coshard.LARGEST)


def _out_check(x: DistTensorSpec, y: DistTensorSpec, out: DistTensorSpec) -> None:
    """The reverse rule's out: the broadcast of x and y (per axis the first known size not 1)."""
    xs, ys, os_ = x.shape, y.shape, out.shape
    nx, ny, _, _ = _bkey(x, y)
    n = max(nx, ny)
    if len(os_) != n:
        raise ShapeMismatchError(f"out has {len(os_)} dims but the broadcast of x and y has {n}")
    for i, s in enumerate(os_):
        wx = xs[i - n + nx] if i >= n - nx else 1
        wy = ys[i - n + ny] if i >= n - ny else 1
        want = wx if wx >= 0 and wx != 1 else wy if wy != 1 else wx
        if s >= 0 and want >= 0 and s != want:
            raise ShapeMismatchError(f"out axis {i} has {s}, but x and y broadcast to {want}")


def binary_grad_notation(with_out: bool, nd: int, nx: int, ny: int, ux: int, uy: int) -> Notation:
    """``1c, bc, abc -> 1c, bc`` (x, y, [out,] out_grad -> x_grad, y_grad), merged from out_grad
    alone: an input takes out_grad's sharding on its axes (a size-1 axis ``1``: unsharded),
    its grad is partial SUM over the mesh dims of the axes it was broadcast along
    (ElementwiseBinaryGradInferSpmd)."""
    g = letters_for(nd)
    x, y = _labels(g, nx, ux), _labels(g, ny, uy)
    ins = [x, y, g, g] if with_out else [x, y, g]
    return Notation(ins, [x, y], sources=(len(ins) - 1,))


def _grad_check(x: DistTensorSpec, y: DistTensorSpec, out_grad: DistTensorSpec, axis: int) -> None:
    """x and y broadcast to out_grad; ``axis`` -1 (numpy-style trailing alignment) or the
    alignment they have."""
    gs = out_grad.shape
    nd = len(gs)
    for name, t in (("x", x), ("y", y)):
        diff = nd - len(t.shape)
        if diff < 0:
            raise ShapeMismatchError(f"{name} has {len(t.shape)} dims, more than out_grad's {nd}")
        for i, s in enumerate(t.shape):
            g = gs[i + diff]
            if s != 1 and s != g and s >= 0 and g >= 0:
                raise ShapeMismatchError(f"{name} axis {i} has {s}, which does not broadcast to out_grad's {g}")
    if axis != -1 and not all(len(t.shape) == nd or axis == nd - len(t.shape) for t in (x, y)):
        raise InvalidAttributeError(f"axis {axis} is not supported (only -1, numpy-style trailing alignment)")


#: every Paddle 3.3.1 name registered to ElementwiseUnaryInferSpmd / ...Reverse
UNARY_OPS = """abs acos acosh asin asinh assign atan atanh bernoulli bitwise_not ceil celu clip conj cos cosh digamma
    dropout elementwise_unary elu erf erfinv exp expm1 fill floor hardshrink hardsigmoid hardswish hardtanh leaky_relu
    lgamma log log10 log1p log2 logical_not logit logsigmoid mish poisson pow reciprocal relu relu6 round rsqrt scale
    selu sigmoid sign silu sin sinh softplus softshrink softsign sqrt square stanh swish tan tanh tanh_shrink
    thresholded_relu trunc""".split()
#: every Paddle 3.3.1 name registered to ElementwiseBinaryInferSpmd / ...Reverse
BINARY_OPS = """add bitwise_and bitwise_or bitwise_xor divide elementwise_add elementwise_binary elementwise_div
    elementwise_mul elementwise_pow floor_divide fmax fmin greater_than heaviside less_than logical_and logical_or
    logical_xor maximum minimum not_equal remainder subtract trunc_divide""".split()
#: the unary grad rules (``NAME_grad``) by the tensors Paddle's grad kernel takes before out_grad
UNARY_GRADS = {
    ("out",): "relu relu6 sigmoid tanh exp expm1 sqrt rsqrt reciprocal hardsigmoid selu",
    ("x",): """elementwise_unary abs acos acosh asin asinh atan atanh cos cosh sin sinh tan log log10 log1p log2 square
        erf erfinv softsign softplus softshrink hardshrink hardswish hardtanh leaky_relu logsigmoid mish swish
        tanh_shrink thresholded_relu logit stanh celu clip digamma lgamma""",
    ("x", "out"): "silu elu",
    (): "floor ceil round trunc sign scale",
}
#: the binary grad rules (``NAME_grad``) over (x, y, out_grad); divide_grad takes out too
BINARY_GRADS = """add subtract multiply maximum minimum elementwise_pow fmax fmin heaviside remainder
    floor_divide""".split()

_UNARY = Way(unary_notation, key="x", paddle="ElementwiseUnaryInferSpmd",
             doc="elementwise unary: out is sharded as x (uneven mesh dims dropped).")
_UNARY_REV = Way(unary_notation, key="x", letters=True, paddle="ElementwiseUnaryInferSpmdReverse",
                 doc="elementwise unary reverse: x from out; out is what x produces.")
#: the binary key, ``_bkey``'s common case inlined (no size-1 axis, y's shape x's trailing axes)
_BKEY = ("*((len(x.shape), len(y.shape), 0, 0) if 1 not in x.shape and 1 not in y.shape"
         " and x.shape[len(x.shape) - len(y.shape):] == y.shape else _bkey(x, y))")
_ENV = {"_bkey": _bkey}
_BINARY = Way(partial(binary_notation, "forward"), key=_BKEY, env=_ENV, paddle="ElementwiseBinaryInferSpmd",
              doc="elementwise binary with numpy broadcasting.")
_BINARY_REV = Way(partial(binary_notation, "backward"), key=_BKEY, check=_out_check, env=_ENV,
                  paddle="ElementwiseBinaryInferSpmdReverse",
                  doc="elementwise binary reverse: x and y take out's letters; out is what they make.")


def _unary_grad(inputs: tuple[str, ...], paddle: str = "ElementwiseUnaryGradInferSpmd", **kw: Any) -> Way:
    """A grad rule over (inputs..., out_grad): every tensor sharded as out_grad, partial cleared."""
    return Way(partial(unary_grad_notation, len(inputs)), key="out_grad", same=[("out_grad", n) for n in inputs],
               paddle=paddle, doc=f"{paddle}({', '.join((*inputs, 'out_grad'))})", **kw)


def _binary_grad(with_out: bool) -> Way:
    return Way(partial(binary_grad_notation, with_out), key="out_grad, x, y, ones(x), ones(y)",
               check=_grad_check, env=_ENV, same=[("out_grad", "out")] if with_out else [],
               paddle="ElementwiseBinaryGradInferSpmd",
               doc=f"ElementwiseBinaryGradInferSpmd(x, y, {'out, ' if with_out else ''}out_grad, axis)")


for _n in UNARY_OPS:
    declare(_n, "x: T", _UNARY, reverse=_UNARY_REV, outputs="out: T")
declare("gelu", "x: T, approximate: bool = False", Way(unary_notation, key="x", paddle="GeluInferSpmd"),
        grad=_unary_grad(("x",), "GeluGradInferSpmd"), grad_signature="x: T, out_grad: T, approximate: bool = False",
        grad_name="gelu_grad")
declare("cast", "x: T, dtype: any = 'float32'",
        replace(_UNARY, post=_cast_post, post_if=PartialIn("x"), paddle="CastInferSpmd",
                doc="cast (CastInferSpmd): elementwise unary keeping x's partial status."),
        reverse=_UNARY_REV, outputs="out: T")
for _n in BINARY_OPS:
    declare(_n, "x: T, y: T", _BINARY, reverse=_BINARY_REV, outputs="out: T")
declare("multiply", "x: T, y: T",
        replace(_BINARY, post=_multiply_post, post_if=PartialIn("x", "y"),
                paddle="ElementwiseBinaryWithPartialInferSpmd", doc=_multiply_post.__doc__ or ""),
        reverse=_BINARY_REV, outputs="out: T")
declare("dropout_grad",
        "mask: T, out_grad: T, p: scalar = 0.5, is_test: bool = False, mode: str = 'upscale_in_train'",
        replace(_BINARY, key="*_bkey(mask, out_grad)", paddle="DropoutBwdInferSpmd",
                doc="DropoutBwdInferSpmd: ElementwiseBinaryInferSpmd(mask, out_grad)."))
for _inputs, _names in UNARY_GRADS.items():
    for _n in _names.split():
        declare(f"{_n}_grad", ", ".join(f"{i}: T" for i in (*_inputs, "out_grad")), _unary_grad(_inputs))
declare("cast_grad", "x: T, out_grad: T",
        _unary_grad(("x",), post=_keep_grad_partial, post_if=PartialIn("out_grad")))
declare("pow_grad", "x: T, out_grad: T, y: scalar = 1.0", _unary_grad(("x",), "PowGradInferSpmd"))
for _n in BINARY_GRADS:
    declare(f"{_n}_grad", "x: T, y: T, out_grad: T, axis: int = -1", _binary_grad(False))
declare("divide_grad", "x: T, y: T, out: T, out_grad: T, axis: int = -1", _binary_grad(True))


# -- output shapes / grads ----------------------------------------------------------------------


def _binary_shape(a: Args) -> list[Expect]:
    return [broadcast(a.s("x"), a.s("y"))]


facts(*UNARY_OPS, "gelu", "cast", shape=same)
facts(*BINARY_OPS, "multiply", shape=_binary_shape)
#: the unary grads that take no x (nor dropout_grad): x_grad has out_grad's shape
facts(*(f"{_n}_grad" for _inputs, _names in UNARY_GRADS.items() if "x" not in _inputs for _n in _names.split()),
      "dropout_grad", grad_like=("=",))
# autodiff (the grad rule NAME_grad): the built-in models' ops (the dropout mask and p: the Tape's grad_extra,
# see spmdkit.models.zoo), those of models imported from torch and HuggingFace (tests/test_torch_import.py and
# tests/test_hf.py check each gradient against torch's autograd), mixed-precision casts
for _n in ("gelu", "scale", "dropout", "square", "rsqrt", "silu", "sqrt", "relu", "tanh", "exp", "sigmoid", "cast",
           "softplus"):
    facts(_n, grad=f"{_n}_grad", wrt=("x",))
for _n in ("add", "multiply", "subtract", "divide", "elementwise_pow"):
    facts(_n, grad=f"{_n}_grad", wrt=("x", "y"))


# -- cost

#: memory-bound: every input read and output written once, one nominal FLOP per output element
facts(*UNARY_OPS, *BINARY_OPS, *(f"{n}_grad" for names in UNARY_GRADS.values() for n in names.split()),
      *(f"{n}_grad" for n in BINARY_GRADS), "multiply", "cast", "cast_grad", "pow_grad", "divide_grad", "dropout_grad",
      cost=one_per_element)
facts("fill", cost=fill)
#: nominal FLOPs per output element of the activations that cost more than one
facts("gelu", cost=by_bytes(8))
facts("gelu_grad", cost=by_bytes(10))
facts("silu", cost=by_bytes(4))
facts("silu_grad", cost=by_bytes(6))
