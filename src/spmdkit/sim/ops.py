"""Numpy references of the ops behind the rules, and how their attributes become local.

A :class:`Reference` computes an op from named arguments (Paddle's parameter
names: ``{"x": array, "axis": -1}``) and a :class:`Ctx` that says where it runs
(globally, or on one rank with its local shards). The verifier calls it once on
the global arrays and once per rank on the local ones. ``localize`` is the hook
that turns global attributes into the local ones a rank's kernel would get
(identity for every op of the foundation set: axes, perm, begin_norm_axis stay as
they are; a reshape target in local sizes or an embedding's vocabulary range
would be computed there).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from spmdkit.core.mesh import ProcessMesh

Arrays = dict[str, Any]


@dataclass(frozen=True)
class Ctx:
    """Where a reference runs: ``rank is None`` for the global (unsharded) run."""

    mesh: ProcessMesh
    rank: int | None = None
    coords: tuple[int, ...] | None = None
    in_attrs: dict[str, Any] = field(default_factory=dict)
    shapes: dict[str, Any] = field(default_factory=dict)
    out_ndims: tuple[int | None, ...] = ()
    out_attrs: tuple[Any, ...] = ()
    out_shapes: tuple[Any, ...] = ()
    #: where a kernel itself communicates (c_softmax_with_cross_entropy's class group) and a real
    #: engine runs the rank (the torch.distributed executor): ``comm.all_reduce(array, mesh_dims,
    #: op)`` with op "sum" or "max" over the groups of those mesh dims. None in the simulator.
    comm: Any = None

    @property
    def is_global(self) -> bool:
        return self.rank is None

    def out_ndim(self, i: int) -> int | None:
        return self.out_ndims[i] if i < len(self.out_ndims) else None


RefFn = Callable[[Arrays, Ctx], Sequence[Any]]


@dataclass(frozen=True)
class Reference:
    """The numpy reference of one op (or grad op).

    ``inputs``: the data tensor parameters it needs; ``optional``: tensor parameters
    it accepts absent (``None``); ``spec_params``: tensor parameters that only
    describe outputs (``outs`` of default_data_parallel); ``outputs``: names of the
    outputs in Paddle's order; ``family``: the case generator (spmdkit.sim.cases);
    ``domains``: value domain per input (real, pos, unit, gt1, prob, nonzero, int,
    nzint, bool); ``prepare``: makes dependent inputs consistent (mean from x, ...).
    """

    name: str
    fn: RefFn
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    family: str
    optional: tuple[str, ...] = ()
    spec_params: tuple[str, ...] = ()
    domains: dict[str, str] = field(default_factory=dict)
    prepare: Callable[[Arrays], None] | None = None
    localize: Callable[[Arrays, Ctx], Arrays] | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def tensor_params(self) -> tuple[str, ...]:
        return self.inputs + self.optional + self.spec_params

    def domain(self, name: str) -> str:
        return str(self.domains.get(name, self.meta.get("domain", "real")))

    def run(self, args: Arrays, ctx: Ctx) -> tuple[Any, ...]:
        a = self.localize(args, ctx) if self.localize is not None and not ctx.is_global else args
        out = self.fn(a, ctx)
        return tuple(out)


REFERENCES: dict[str, Reference] = {}


def register_reference(ref: Reference, *aliases: str) -> Reference:
    for n in (ref.name, *aliases):
        REFERENCES[n] = ref
    return ref


def get_reference(name: str) -> Reference | None:
    """The reference for a rule name (or any alias of that rule), None if there is none."""
    from spmdkit.engine.registry import by_rule_name

    return by_rule_name(REFERENCES, name)


# -- helpers ----------------------------------------------------------------------------------


def as_f64(x: Any) -> np.ndarray:
    """``x`` as a float64 array (the references compute in float64)."""
    return np.asarray(x, dtype=np.float64)


def paddle_axes(axis: Any, ndim: int) -> tuple[int, ...]:
    """Paddle's axis list: empty (or None) = all axes; negatives count from the end."""
    if axis is None:
        return tuple(range(ndim))
    ax = (axis,) if isinstance(axis, int) else tuple(axis)
    if not ax:
        return tuple(range(ndim))
    out = []
    for a in ax:
        a = int(a)
        if a < 0:
            a += ndim
        if not 0 <= a < max(ndim, 1):
            raise ValueError(f"axis {a} out of range for a {ndim}-D tensor")
        out.append(a)
    return tuple(sorted(set(out)))


def reduce_axes(a: Arrays, ndim: int) -> tuple[int, ...]:
    """A reduction's axes: Paddle's ``axis`` list (checked even then), all of them with ``reduce_all``."""
    ax = paddle_axes(a.get("axis", ()), ndim)
    return tuple(range(ndim)) if a.get("reduce_all", False) else ax


# -- formulas written once for numpy and torch ---------------------------------------------------
# The torch kernels (spmdkit.execute.kernels) run the same formulas on torch tensors: they use the
# methods and operators numpy arrays and torch tensors share (``@``, ``.sum(axis=, keepdims=)``,
# ``.reshape``, ``.swapaxes``, indexing, ``abs``, ``%``) and an :class:`ArrayLib` for the rest.


@dataclass(frozen=True)
class ArrayLib:
    """The array functions whose numpy and torch spellings differ: :data:`NUMPY` (the references,
    in float64) and ``spmdkit.execute.kernels.TORCH`` (the program's dtype)."""

    #: an input as the library computes on it (numpy: float64)
    array: Callable[[Any], Any]
    #: (values, like): floats in the dtype angles are computed in, on ``like``'s device
    floats: Callable[[Any, Any], Any]
    #: integer indices (int64)
    ints: Callable[[Any], Any]
    #: (x, like): ``x`` in ``like``'s dtype (numpy: ``x`` as it is, everything is float64)
    cast: Callable[[Any, Any], Any]
    concat: Callable[[list[Any], int], Any]
    stack: Callable[[list[Any], int], Any]
    #: (x, n, axis): every element ``n`` times along ``axis``
    repeat: Callable[[Any, int, int], Any]
    sin: Callable[[Any], Any]
    cos: Callable[[Any], Any]
    sqrt: Callable[[Any], Any]
    maximum: Callable[[Any, Any], Any]


NUMPY = ArrayLib(array=as_f64, floats=lambda v, like: np.asarray(v, dtype=np.float64),
                 ints=lambda v: np.asarray(v, dtype=np.int64), cast=lambda x, like: x, concat=np.concatenate,
                 stack=np.stack, repeat=np.repeat, sin=np.sin, cos=np.cos, sqrt=np.sqrt, maximum=np.maximum)


def sum_to_shape(a: Any, shape: Sequence[int]) -> Any:
    """Sum a broadcast gradient back to ``shape`` (numpy broadcasting rules): a numpy array, a
    torch tensor, or anything else as a numpy array."""
    if not hasattr(a, "ndim"):
        a = np.asarray(a)
    lead = a.ndim - len(shape)
    if lead > 0:
        a = a.sum(axis=tuple(range(lead)))
    ax = tuple(i for i, s in enumerate(shape) if s == 1 and a.shape[i] != 1)
    if ax:
        a = a.sum(axis=ax, keepdims=True)
    return a.reshape(tuple(shape))


def swap_last(a: Any) -> Any:
    """The last two axes swapped (a 0-D or 1-D array as it is)."""
    return a.swapaxes(-1, -2) if a.ndim >= 2 else a


def matmul(x: Any, y: Any, trans_x: bool = False, trans_y: bool = False) -> Any:
    """Paddle's matmul: ``x @ y`` after the optional transposes of the last two axes."""
    return (swap_last(x) if trans_x else x) @ (swap_last(y) if trans_y else y)


def matmul_grad(x: Any, y: Any, g: Any, trans_x: bool, trans_y: bool) -> tuple[Any, Any]:
    """The gradients of :func:`matmul` for ``out_grad`` ``g``: (x_grad, y_grad), summed over the
    broadcast batch axes, in the shapes of ``x`` and ``y``."""
    tx, ty = trans_x and x.ndim >= 2, trans_y and y.ndim >= 2  # a vector is not transposed
    x2 = x.reshape(1, -1) if x.ndim == 1 else x
    y2 = y.reshape(-1, 1) if y.ndim == 1 else y
    A = swap_last(x2) if tx else x2
    B = swap_last(y2) if ty else y2
    batch = np.broadcast_shapes(tuple(A.shape[:-2]), tuple(B.shape[:-2]))
    g2 = g.reshape((*batch, A.shape[-2], B.shape[-1]))
    dA = g2 @ swap_last(B)
    dB = swap_last(A) @ g2
    dx2 = swap_last(dA) if tx else dA
    dy2 = swap_last(dB) if ty else dB
    return sum_to_shape(dx2, x2.shape).reshape(x.shape), sum_to_shape(dy2, y2.shape).reshape(y.shape)


def _vec(fn: Callable[[float], float]) -> Callable[[np.ndarray], np.ndarray]:
    v = np.vectorize(fn, otypes=[np.float64])

    def g(x: np.ndarray) -> np.ndarray:
        x = as_f64(x)
        return np.asarray(v(x)) if x.size else x.copy()

    return g


_erf = _vec(math.erf)
_lgamma = _vec(math.lgamma)


def _digamma_scalar(x: float) -> float:
    r = 0.0
    while x < 6.0:
        r -= 1.0 / x
        x += 1.0
    f = 1.0 / (x * x)
    return r + math.log(x) - 0.5 / x - f * (1 / 12 - f * (1 / 120 - f * (1 / 252 - f * (1 / 240 - f / 132))))


_digamma = _vec(_digamma_scalar)


def _erfinv_scalar(y: float) -> float:
    if y <= -1.0:
        return -math.inf
    if y >= 1.0:
        return math.inf
    x = 0.0
    for _ in range(60):
        err = math.erf(x) - y
        x -= err / (2.0 / math.sqrt(math.pi) * math.exp(-x * x))
        if abs(err) < 1e-15:
            break
    return x


_erfinv = _vec(_erfinv_scalar)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return np.asarray(1.0 / (1.0 + np.exp(-as_f64(x))))


def _softplus(x: np.ndarray) -> np.ndarray:
    x = as_f64(x)
    return np.asarray(np.logaddexp(0.0, x))


def _gelu(x: np.ndarray, approximate: bool = False) -> np.ndarray:
    x = as_f64(x)
    if approximate:
        return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


_SELU_A = 1.6732632423543772
_SELU_S = 1.0507009873554805


def _num_deriv(fn: Callable[[np.ndarray], np.ndarray]) -> Callable[[np.ndarray], np.ndarray]:
    def d(x: np.ndarray) -> np.ndarray:
        x = as_f64(x)
        h = 1e-6 * (1.0 + np.abs(x))
        return np.asarray((fn(x + h) - fn(x - h)) / (2 * h))

    return d


# -- elementwise unary ------------------------------------------------------------------------
# name -> (forward fn, derivative fn or None (central difference), domain)
# Random ops (bernoulli, dropout, poisson) use deterministic stand-ins: what a rule claims
# is a layout, and an elementwise stand-in has the same layout law.

UnaryFn = Callable[[np.ndarray], np.ndarray]
UNARY: dict[str, tuple[UnaryFn, UnaryFn | None, str]] = {
    "abs": (np.abs, lambda x: np.sign(x), "real"),
    "acos": (np.arccos, lambda x: -1.0 / np.sqrt(1 - x * x), "unit"),
    "acosh": (np.arccosh, lambda x: 1.0 / np.sqrt(x * x - 1), "gt1"),
    "asin": (np.arcsin, lambda x: 1.0 / np.sqrt(1 - x * x), "unit"),
    "asinh": (np.arcsinh, lambda x: 1.0 / np.sqrt(x * x + 1), "real"),
    "assign": (lambda x: np.array(x, copy=True), lambda x: np.ones_like(as_f64(x)), "real"),
    "atan": (np.arctan, lambda x: 1.0 / (1 + x * x), "real"),
    "atanh": (np.arctanh, lambda x: 1.0 / (1 - x * x), "unit"),
    "bernoulli": (lambda x: (as_f64(x) > 0.5).astype(np.float64), lambda x: np.zeros_like(as_f64(x)), "prob"),
    "bitwise_not": (np.invert, None, "int"),
    "ceil": (np.ceil, lambda x: np.zeros_like(as_f64(x)), "real"),
    "celu": (lambda x: np.maximum(0, x) + np.minimum(0, np.expm1(x)), lambda x: np.where(x > 0, 1.0, np.exp(x)), "real"),
    "clip": (lambda x: np.clip(x, -0.5, 0.5), lambda x: ((x > -0.5) & (x < 0.5)).astype(np.float64), "real"),
    "conj": (np.conj, lambda x: np.ones_like(as_f64(x)), "real"),
    "cos": (np.cos, lambda x: -np.sin(x), "real"),
    "cosh": (np.cosh, np.sinh, "real"),
    "digamma": (_digamma, None, "pos"),
    "dropout": (lambda x: np.array(x, copy=True), lambda x: np.ones_like(as_f64(x)), "real"),
    "elementwise_unary": (np.tanh, lambda x: 1 - np.tanh(x) ** 2, "real"),
    "elu": (lambda x: np.where(x > 0, x, np.expm1(np.minimum(x, 0))), lambda x: np.where(x > 0, 1.0, np.exp(x)), "real"),
    "erf": (_erf, lambda x: 2 / math.sqrt(math.pi) * np.exp(-x * x), "real"),
    "erfinv": (_erfinv, None, "unit"),
    "exp": (np.exp, np.exp, "real"),
    "expm1": (np.expm1, np.exp, "real"),
    "fill": (lambda x: np.full_like(as_f64(x), 0.5), lambda x: np.zeros_like(as_f64(x)), "real"),
    "floor": (np.floor, lambda x: np.zeros_like(as_f64(x)), "real"),
    "hardshrink": (lambda x: np.where(np.abs(x) > 0.5, x, 0.0), lambda x: (np.abs(x) > 0.5).astype(np.float64), "real"),
    "hardsigmoid": (lambda x: np.clip(x / 6 + 0.5, 0, 1), lambda x: ((x > -3) & (x < 3)) / 6.0, "real"),
    "hardswish": (lambda x: x * np.clip(x + 3, 0, 6) / 6, None, "real"),
    "hardtanh": (lambda x: np.clip(x, -1, 1), lambda x: ((x > -1) & (x < 1)).astype(np.float64), "real"),
    "leaky_relu": (lambda x: np.where(x > 0, x, 0.02 * x), lambda x: np.where(x > 0, 1.0, 0.02), "real"),
    "lgamma": (_lgamma, _digamma, "pos"),
    "log": (np.log, lambda x: 1.0 / x, "pos"),
    "log10": (np.log10, lambda x: 1.0 / (x * math.log(10)), "pos"),
    "log1p": (np.log1p, lambda x: 1.0 / (1 + x), "pos"),
    "log2": (np.log2, lambda x: 1.0 / (x * math.log(2)), "pos"),
    "logical_not": (np.logical_not, None, "bool"),
    "logit": (lambda x: np.log(x / (1 - x)), lambda x: 1.0 / (x * (1 - x)), "prob"),
    "logsigmoid": (lambda x: -_softplus(-x), lambda x: _sigmoid(-x), "real"),
    "mish": (lambda x: x * np.tanh(_softplus(x)), None, "real"),
    "poisson": (lambda x: np.floor(as_f64(x) * 3.0), lambda x: np.zeros_like(as_f64(x)), "pos"),
    "pow": (lambda x: as_f64(x) ** 3, lambda x: 3 * as_f64(x) ** 2, "real"),
    "reciprocal": (lambda x: 1.0 / as_f64(x), lambda x: -1.0 / as_f64(x) ** 2, "nonzero"),
    "relu": (lambda x: np.maximum(x, 0.0), lambda x: (x > 0).astype(np.float64), "real"),
    "relu6": (lambda x: np.clip(x, 0.0, 6.0), lambda x: ((x > 0) & (x < 6)).astype(np.float64), "real"),
    "round": (np.round, lambda x: np.zeros_like(as_f64(x)), "real"),
    "rsqrt": (lambda x: 1.0 / np.sqrt(x), lambda x: -0.5 * as_f64(x) ** -1.5, "pos"),
    "scale": (lambda x: 2.0 * as_f64(x) + 0.5, lambda x: np.full_like(as_f64(x), 2.0), "real"),
    "selu": (lambda x: _SELU_S * np.where(x > 0, x, _SELU_A * np.expm1(np.minimum(x, 0))),
             lambda x: _SELU_S * np.where(x > 0, 1.0, _SELU_A * np.exp(x)), "real"),
    "sigmoid": (_sigmoid, lambda x: _sigmoid(x) * (1 - _sigmoid(x)), "real"),
    "sign": (np.sign, lambda x: np.zeros_like(as_f64(x)), "real"),
    "silu": (lambda x: x * _sigmoid(x), lambda x: _sigmoid(x) * (1 + x * (1 - _sigmoid(x))), "real"),
    "sin": (np.sin, np.cos, "real"),
    "sinh": (np.sinh, np.cosh, "real"),
    "softplus": (_softplus, _sigmoid, "real"),
    "softshrink": (lambda x: np.where(x > 0.5, x - 0.5, np.where(x < -0.5, x + 0.5, 0.0)),
                   lambda x: (np.abs(x) > 0.5).astype(np.float64), "real"),
    "softsign": (lambda x: x / (1 + np.abs(x)), lambda x: 1.0 / (1 + np.abs(x)) ** 2, "real"),
    "sqrt": (np.sqrt, lambda x: 0.5 / np.sqrt(x), "pos"),
    "square": (np.square, lambda x: 2 * as_f64(x), "real"),
    "stanh": (lambda x: 1.7159 * np.tanh(0.67 * x), lambda x: 1.7159 * 0.67 * (1 - np.tanh(0.67 * x) ** 2), "real"),
    "swish": (lambda x: x * _sigmoid(x), lambda x: _sigmoid(x) * (1 + x * (1 - _sigmoid(x))), "real"),
    "tan": (np.tan, lambda x: 1.0 / np.cos(x) ** 2, "unit"),
    "tanh": (np.tanh, lambda x: 1 - np.tanh(x) ** 2, "real"),
    "tanh_shrink": (lambda x: x - np.tanh(x), lambda x: np.tanh(x) ** 2, "real"),
    "thresholded_relu": (lambda x: np.where(x > 1.0, x, 0.0), lambda x: (x > 1.0).astype(np.float64), "real"),
    "trunc": (np.trunc, lambda x: np.zeros_like(as_f64(x)), "real"),
}


def _unary_derivative(name: str) -> UnaryFn:
    fn, d, _ = UNARY[name]
    return d if d is not None else _num_deriv(fn)


# derivative expressed through the output (for grad rules that take out, not x)
_DOUT: dict[str, UnaryFn] = {
    "relu": lambda o: (o > 0).astype(np.float64),
    "exp": lambda o: as_f64(o),
    "sigmoid": lambda o: o * (1 - o),
    "tanh": lambda o: 1 - o * o,
    "sqrt": lambda o: 0.5 / o,
    "rsqrt": lambda o: -0.5 * o**3,
    "reciprocal": lambda o: -o * o,
    "relu6": lambda o: ((o > 0) & (o < 6)).astype(np.float64),
    "elu": lambda o: np.where(o > 0, 1.0, o + 1.0),
    "expm1": lambda o: as_f64(o) + 1.0,
    "selu": lambda o: np.where(o > 0, _SELU_S, o + _SELU_S * _SELU_A),
    "hardsigmoid": lambda o: ((o > 0) & (o < 1)) / 6.0,
    "silu": lambda o: np.ones_like(as_f64(o)),
}


def _generic_dout(o: np.ndarray) -> np.ndarray:
    return np.asarray(1.0 + as_f64(o) ** 2)


def _unary_ref(name: str) -> Reference:
    fn, _, dom = UNARY[name]
    return Reference(name, lambda a, c: (fn(a["x"]),), ("x",), ("out",), "unary", meta={"domain": dom})


def _unary_grad_ref(name: str) -> Reference:
    fn, _, dom = UNARY[name]
    deriv = _unary_derivative(name)
    dout: UnaryFn = _DOUT.get(name, _generic_dout)

    def grad(a: Arrays, c: Ctx) -> tuple[Any, ...]:
        g = as_f64(a["out_grad"])
        if a.get("x") is not None:
            return (g * deriv(as_f64(a["x"])),)
        if a.get("out") is not None:
            return (g * dout(as_f64(a["out"])),)
        # out_grad only: ops with a constant derivative (scale, ceil, sign, ...)
        return (g * deriv(np.zeros_like(g)),)

    def prepare(a: Arrays) -> None:
        if a.get("x") is not None and "out" in a:
            a["out"] = fn(a["x"])

    return Reference(
        f"{name}_grad", grad, ("out_grad",), ("x_grad",), "unary_grad", optional=("x", "out"),
        domains={"out_grad": "real", "x": dom, "out": "real"}, prepare=prepare, meta={"domain": dom, "op": name},
    )


for _n in UNARY:
    if _n in ("bitwise_not", "logical_not"):
        register_reference(_unary_ref(_n))
    else:
        register_reference(_unary_ref(_n))
        register_reference(_unary_grad_ref(_n))


def _gelu_fwd(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    return (_gelu(a["x"], bool(a.get("approximate", False))),)


def _gelu_grad(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    approx = bool(a.get("approximate", False))
    d = _num_deriv(lambda x: _gelu(x, approx))
    return (as_f64(a["out_grad"]) * d(as_f64(a["x"])),)


register_reference(Reference("gelu", _gelu_fwd, ("x",), ("out",), "unary"))
register_reference(Reference("gelu_grad", _gelu_grad, ("x", "out_grad"), ("x_grad",), "unary_grad"))

def _pow_grad(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    y = float(a.get("y", 1.0))
    x = as_f64(a["x"])
    return (as_f64(a["out_grad"]) * y * x ** (y - 1.0),)


def _dropout_grad(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    mask = as_f64(a["mask"])
    g = as_f64(a["out_grad"])
    p = float(a.get("p", 0.5))
    if bool(a.get("is_test", False)):
        return (g * (1.0 - p) if a.get("mode", "upscale_in_train") != "upscale_in_train" else g.copy(),)
    if a.get("mode", "upscale_in_train") == "upscale_in_train":
        return (g * mask / (1.0 - p) if p < 1.0 else np.zeros_like(g),)
    return (g * mask,)


register_reference(Reference("pow_grad", _pow_grad, ("x", "out_grad"), ("x_grad",), "unary_grad",
                             domains={"x": "pos"}, meta={"op": "pow"}))
register_reference(Reference("dropout_grad", _dropout_grad, ("mask", "out_grad"), ("x_grad",), "dropout_grad",
                             domains={"mask": "bool"}))
register_reference(Reference("cast_grad", lambda a, c: (as_f64(a["out_grad"]).copy(),), ("out_grad",), ("x_grad",),
                             "unary_grad", optional=("x",)))

_CAST_TYPES = {
    "float64": np.float64, "float32": np.float32, "float16": np.float16, "bfloat16": np.float32,
    "int64": np.int64, "int32": np.int32, "int16": np.int16, "int8": np.int8, "uint8": np.uint8, "bool": np.bool_,
}


def _cast(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    dt = a.get("dtype", "float32")
    key = str(getattr(dt, "name", dt)).lower().replace("paddle.", "").replace("datatype.", "")
    t = _CAST_TYPES.get(key, np.float32)
    if t is np.bool_ or np.issubdtype(t, np.integer):
        return (np.asarray(a["x"]).astype(t),)
    # float targets are simulated in float64: the layout law is what is judged, not rounding
    return (np.asarray(a["x"]).astype(np.float64),)


register_reference(Reference("cast", _cast, ("x",), ("out",), "cast"))


# -- elementwise binary -----------------------------------------------------------------------

BinaryFn = Callable[[np.ndarray, np.ndarray], np.ndarray]
# name -> (fn, (dfdx, dfdy) or None, domain of x, domain of y)
BINARY: dict[str, tuple[BinaryFn, tuple[BinaryFn, BinaryFn] | None, str, str]] = {
    "add": (np.add, (lambda x, y: np.ones_like(x * y), lambda x, y: np.ones_like(x * y)), "real", "real"),
    "subtract": (np.subtract, (lambda x, y: np.ones_like(x * y), lambda x, y: -np.ones_like(x * y)), "real", "real"),
    "multiply": (np.multiply, (lambda x, y: y * np.ones_like(x), lambda x, y: x * np.ones_like(y)), "real", "real"),
    "divide": (np.divide, (lambda x, y: 1.0 / y * np.ones_like(x), lambda x, y: -x / (y * y)), "real", "nonzero"),
    "elementwise_pow": (np.power, (lambda x, y: y * x ** (y - 1), lambda x, y: x**y * np.log(x)), "pos", "real"),
    "maximum": (np.maximum, (lambda x, y: (x > y) * 1.0, lambda x, y: (x <= y) * 1.0), "real", "real"),
    "minimum": (np.minimum, (lambda x, y: (x < y) * 1.0, lambda x, y: (x >= y) * 1.0), "real", "real"),
    "fmax": (np.fmax, (lambda x, y: (x > y) * 1.0, lambda x, y: (x <= y) * 1.0), "real", "real"),
    "fmin": (np.fmin, (lambda x, y: (x < y) * 1.0, lambda x, y: (x >= y) * 1.0), "real", "real"),
    "remainder": (np.remainder, (lambda x, y: np.ones_like(x * y, dtype=np.float64),
                                 lambda x, y: -np.floor_divide(x, y) * 1.0), "int", "nzint"),
    "floor_divide": (np.floor_divide, (lambda x, y: np.zeros_like(x * y, dtype=np.float64),
                                       lambda x, y: np.zeros_like(x * y, dtype=np.float64)), "int", "nzint"),
    "trunc_divide": (lambda x, y: np.trunc(x / y).astype(np.int64), None, "int", "nzint"),
    "bitwise_and": (np.bitwise_and, None, "int", "int"),
    "bitwise_or": (np.bitwise_or, None, "int", "int"),
    "bitwise_xor": (np.bitwise_xor, None, "int", "int"),
    "logical_and": (np.logical_and, None, "bool", "bool"),
    "logical_or": (np.logical_or, None, "bool", "bool"),
    "logical_xor": (np.logical_xor, None, "bool", "bool"),
    "not_equal": (np.not_equal, None, "int", "int"),
    "greater_than": (np.greater, None, "real", "real"),
    "less_than": (np.less, None, "real", "real"),
    "heaviside": (np.heaviside, (lambda x, y: np.zeros_like(x * y), lambda x, y: (x == 0) * np.ones_like(y)), "real",
                  "real"),
    "elementwise_binary": (lambda x, y: x * y + x, (lambda x, y: y + 1.0, lambda x, y: x * np.ones_like(y)), "real", "real"),
}
BINARY_ALIASES = {
    "elementwise_add": "add",
    "elementwise_sub": "subtract",
    "elementwise_mul": "multiply",
    "elementwise_div": "divide",
    "pow_binary": "elementwise_pow",
}


def _binary_ref(name: str) -> Reference:
    fn, _, dx, dy = BINARY[name]
    return Reference(name, lambda a, c: (fn(a["x"], a["y"]),), ("x", "y"), ("out",), "binary",
                     domains={"x": dx, "y": dy})


def _binary_grad_ref(name: str) -> Reference:
    fn, dd, domx, domy = BINARY[name]
    assert dd is not None
    dfx, dfy = dd

    def grad(a: Arrays, c: Ctx) -> tuple[Any, ...]:
        x, y, g = as_f64(a["x"]), as_f64(a["y"]), as_f64(a["out_grad"])
        gx = g * np.broadcast_to(dfx(x, y), g.shape)
        gy = g * np.broadcast_to(dfy(x, y), g.shape)
        return (sum_to_shape(gx, x.shape), sum_to_shape(gy, y.shape))

    def prepare(a: Arrays) -> None:
        if "out" in a and a.get("out") is not None:
            a["out"] = fn(a["x"], a["y"])

    return Reference(f"{name}_grad", grad, ("x", "y", "out_grad"), ("x_grad", "y_grad"), "binary_grad",
                     optional=("out",), domains={"x": domx, "y": domy}, prepare=prepare, meta={"op": name})


for _n, (_fn, _d, _dx, _dy) in BINARY.items():
    register_reference(_binary_ref(_n), *[k for k, v in BINARY_ALIASES.items() if v == _n])
    if _d is not None:
        register_reference(_binary_grad_ref(_n), *[f"{k}_grad" for k, v in BINARY_ALIASES.items() if v == _n])


# -- softmax ----------------------------------------------------------------------------------


def _softmax(x: np.ndarray, axis: int) -> np.ndarray:
    x = as_f64(x)
    if x.ndim == 0:
        return np.ones_like(x)
    m = x.max(axis=axis, keepdims=True) if x.size else x
    e = np.exp(x - m)
    return np.asarray(e / e.sum(axis=axis, keepdims=True))


def _log_softmax(x: np.ndarray, axis: int) -> np.ndarray:
    x = as_f64(x)
    if x.ndim == 0:
        return np.zeros_like(x)
    m = x.max(axis=axis, keepdims=True) if x.size else x
    return np.asarray(x - m - np.log(np.exp(x - m).sum(axis=axis, keepdims=True)))


def norm_axis(axis: Any, ndim: int, any_0d: bool = False) -> int:
    """A reference's axis attribute in [0, ndim) (a 0-d tensor takes 0 or -1, any axis with
    ``any_0d``); ValueError else."""
    a = int(axis)
    if ndim == 0:
        if a not in (0, -1) and not any_0d:
            raise ValueError(f"axis {axis} out of range for a 0-d tensor")
        return 0
    if a < 0:
        a += ndim
    if not 0 <= a < ndim:
        raise ValueError(f"axis {axis} out of range")
    return a


def _axis1(axis: Any, ndim: int) -> int:
    """softmax's axis: any on a 0-d tensor (its softmax is 1 whatever the axis)."""
    return norm_axis(axis, ndim, any_0d=True)


def _softmax_grad(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    out, g = as_f64(a["out"]), as_f64(a["out_grad"])
    if out.ndim == 0:
        return (np.zeros_like(g),)
    ax = _axis1(a.get("axis", -1), out.ndim)
    return (out * (g - (g * out).sum(axis=ax, keepdims=True)),)


def _log_softmax_grad(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    out, g = as_f64(a["out"]), as_f64(a["out_grad"])
    if out.ndim == 0:
        return (np.zeros_like(g),)
    ax = _axis1(a.get("axis", -1), out.ndim)
    return (g - np.exp(out) * g.sum(axis=ax, keepdims=True),)


def _prep_softmax(a: Arrays) -> None:
    a["out"] = _softmax(a["out"], _axis1(a.get("axis", -1), np.ndim(a["out"])))


def _prep_log_softmax(a: Arrays) -> None:
    a["out"] = _log_softmax(a["out"], _axis1(a.get("axis", -1), np.ndim(a["out"])))


register_reference(Reference(
    "softmax", lambda a, c: (_softmax(a["x"], _axis1(a.get("axis", -1), np.ndim(a["x"]))),), ("x",), ("out",), "softmax"))
register_reference(Reference(
    "log_softmax", lambda a, c: (_log_softmax(a["x"], _axis1(a.get("axis", -1), np.ndim(a["x"]))),), ("x",), ("out",),
    "softmax"))
register_reference(Reference("softmax_grad", _softmax_grad, ("out", "out_grad"), ("x_grad",), "softmax_grad",
                             prepare=_prep_softmax))
register_reference(Reference("log_softmax_grad", _log_softmax_grad, ("out", "out_grad"), ("x_grad",), "softmax_grad",
                             prepare=_prep_log_softmax))


# -- layer_norm / rms_norm --------------------------------------------------------------------


def _bna(a: Arrays, ndim: int) -> int:
    b = int(a.get("begin_norm_axis", 1))
    if b < 0:
        b += ndim
    if not 0 <= b <= ndim:
        raise ValueError(f"begin_norm_axis {b} out of range")
    return b


def _stat_shape(stat: np.ndarray, c: Ctx, i: int) -> np.ndarray:
    """mean / variance / invvar: shaped x.shape[:begin_norm_axis], or flattened to 1-D where
    the rule says so (Paddle's kernels return 1-D [prod(batch dims)])."""
    nd = c.out_ndim(i)
    if nd is not None and nd != stat.ndim:
        if nd == 1:
            return stat.reshape(-1)
        if nd == 0 and stat.size == 1:
            return stat.reshape(())
    return stat


def _layer_norm(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    x = as_f64(a["x"])
    b = _bna(a, x.ndim)
    eps = float(a.get("epsilon", 1e-5))
    ax = tuple(range(b, x.ndim))
    mean = x.mean(axis=ax, keepdims=True) if x.size else np.zeros(x.shape[:b] + (1,) * (x.ndim - b))
    var = ((x - mean) ** 2).mean(axis=ax, keepdims=True) if x.size else mean.copy()
    out = (x - mean) / np.sqrt(var + eps)
    tail = x.shape[b:]
    if a.get("scale") is not None:
        out = out * as_f64(a["scale"]).reshape(tail)
    if a.get("bias") is not None:
        out = out + as_f64(a["bias"]).reshape(tail)
    bs = x.shape[:b]
    return (out, _stat_shape(mean.reshape(bs), c, 1), _stat_shape(var.reshape(bs), c, 2))


def _layer_norm_grad(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    x, g = as_f64(a["x"]), as_f64(a["out_grad"])
    b = _bna(a, x.ndim)
    eps = float(a.get("epsilon", 1e-5))
    bs, tail = x.shape[:b], x.shape[b:]
    ax = tuple(range(b, x.ndim))
    bax = tuple(range(b))
    kshape = bs + (1,) * len(tail)
    mean = as_f64(a["mean"]).reshape(kshape)
    var = as_f64(a["variance"]).reshape(kshape)
    inv = 1.0 / np.sqrt(var + eps)
    xh = (x - mean) * inv
    scale = as_f64(a["scale"]).reshape(tail) if a.get("scale") is not None else np.ones(tail)
    gs = g * scale
    if x.size:
        dx = inv * (gs - gs.mean(axis=ax, keepdims=True) - xh * (gs * xh).mean(axis=ax, keepdims=True))
    else:
        dx = np.zeros_like(x)
    n_tail = int(np.prod(tail)) if tail else 1
    dscale = (g * xh).sum(axis=bax).reshape(n_tail) if a.get("scale") is not None else None
    dbias = g.sum(axis=bax).reshape(n_tail) if a.get("bias") is not None else None
    return (dx, dscale, dbias)


def _prep_layer_norm_grad(a: Arrays) -> None:
    x = as_f64(a["x"])
    b = _bna(a, x.ndim)
    ax = tuple(range(b, x.ndim))
    shp = np.shape(a["mean"])
    if x.size:
        m = x.mean(axis=ax)
        v = ((x - x.mean(axis=ax, keepdims=True)) ** 2).mean(axis=ax)
        a["mean"] = m.reshape(shp)
        a["variance"] = v.reshape(shp)


register_reference(Reference("layer_norm", _layer_norm, ("x",), ("out", "mean", "variance"), "layer_norm",
                             optional=("scale", "bias")))
register_reference(Reference("layer_norm_grad", _layer_norm_grad, ("x", "mean", "variance", "out_grad"),
                             ("x_grad", "scale_grad", "bias_grad"), "layer_norm_grad", optional=("scale", "bias"),
                             domains={"variance": "pos"}, prepare=_prep_layer_norm_grad))


def _rms_norm(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    x = as_f64(a["x"])
    eps = float(a.get("epsilon", 1e-5))
    if x.ndim == 0:
        raise ValueError("rms_norm needs at least 1-D x")
    ms = (x * x).mean(axis=-1, keepdims=True) if x.shape[-1] else np.zeros((*x.shape[:-1], 1))
    inv = 1.0 / np.sqrt(ms + eps)
    out = x * inv
    if a.get("scale") is not None:
        out = out * as_f64(a["scale"]).reshape(x.shape[-1:])
    return (out, _stat_shape(inv.reshape(x.shape[:-1]), c, 1))


def _rms_norm_grad(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    x, g = as_f64(a["x"]), as_f64(a["out_grad"])
    inv = as_f64(a["invvar"]).reshape((*x.shape[:-1], 1))
    scale = as_f64(a["scale"]).reshape(x.shape[-1:]) if a.get("scale") is not None else np.ones(x.shape[-1:])
    gs = g * scale
    m = (gs * x).mean(axis=-1, keepdims=True) if x.shape[-1] else np.zeros_like(inv)
    dx = inv * gs - x * inv**3 * m
    dscale = (g * x * inv).reshape(-1, x.shape[-1]).sum(axis=0) if a.get("scale") is not None else None
    return (dx, dscale)


def _prep_rms_norm_grad(a: Arrays) -> None:
    x = as_f64(a["x"])
    eps = float(a.get("epsilon", 1e-5))
    if x.ndim and x.shape[-1]:
        a["invvar"] = (1.0 / np.sqrt((x * x).mean(axis=-1) + eps)).reshape(np.shape(a["invvar"]))


register_reference(Reference("fused_rms_norm", _rms_norm, ("x",), ("out", "invvar"), "rms_norm",
                             optional=("scale",)), "rms_norm")
register_reference(Reference("rms_norm_grad", _rms_norm_grad, ("x", "invvar", "out_grad"), ("x_grad", "scale_grad"),
                             "rms_norm_grad", optional=("scale",), domains={"invvar": "pos"},
                             prepare=_prep_rms_norm_grad), "fused_rms_norm_grad")


# -- matmul -----------------------------------------------------------------------------------


def _matmul(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    return (matmul(as_f64(a["x"]), as_f64(a["y"]), bool(a.get("trans_x", False)), bool(a.get("trans_y", False))),)


def _matmul_grad(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    return matmul_grad(as_f64(a["x"]), as_f64(a["y"]), as_f64(a["out_grad"]), bool(a.get("trans_x", False)),
                       bool(a.get("trans_y", False)))


register_reference(Reference("matmul", _matmul, ("x", "y"), ("out",), "matmul"), "matmul_v2", "bmm")
register_reference(Reference("matmul_grad", _matmul_grad, ("x", "y", "out_grad"), ("x_grad", "y_grad"),
                             "matmul_grad"), "matmul_v2_grad")


# -- reductions -------------------------------------------------------------------------------


def _red(np_fn: Callable[..., np.ndarray]) -> Callable[[np.ndarray, tuple[int, ...], bool], np.ndarray]:
    def r(x: np.ndarray, ax: tuple[int, ...], keep: bool) -> np.ndarray:
        return np.asarray(np_fn(x, axis=ax, keepdims=keep))

    return r


def _sq_l2(x: np.ndarray, ax: tuple[int, ...], keep: bool) -> np.ndarray:
    x = as_f64(x)
    return np.asarray((x * x).sum(axis=ax, keepdims=keep))


def _frob(x: np.ndarray, ax: tuple[int, ...], keep: bool) -> np.ndarray:
    return np.asarray(np.sqrt(_sq_l2(x, ax, keep)))


ReduceFn = Callable[[np.ndarray, tuple[int, ...], bool], np.ndarray]
# name -> (fn, domain)
def _extreme(is_max: bool) -> ReduceFn:
    """max / min whose reduction over an empty (local) slice is the identity (-inf / +inf):
    what a rank holding no elements contributes to a partial MAX / MIN."""

    def r(x: np.ndarray, ax: tuple[int, ...], keep: bool) -> np.ndarray:
        x = np.asarray(x)
        if np.issubdtype(x.dtype, np.integer):
            info = np.iinfo(x.dtype)
            init: Any = info.min if is_max else info.max
        elif x.dtype == np.bool_:
            init = not is_max
        else:
            init = -np.inf if is_max else np.inf
        fn = np.max if is_max else np.min
        return np.asarray(fn(x, axis=ax, keepdims=keep, initial=init))

    return r


REDUCTIONS: dict[str, tuple[ReduceFn, str]] = {
    "sum": (_red(np.sum), "real"),
    "mean": (_red(np.mean), "real"),
    "max": (_extreme(True), "real"),
    "min": (_extreme(False), "real"),
    "prod": (_red(np.prod), "nonzero"),
    "any": (_red(np.any), "bool"),
    "all": (_red(np.all), "bool"),
    "squared_l2_norm": (_sq_l2, "real"),
    "frobenius_norm": (_frob, "real"),
}
REDUCTION_ALIASES = {"reduce_sum": "sum", "reduce_max": "max", "amax": "max", "amin": "min", "reduce_mean": "mean",
                     "reduce_min": "min", "reduce_prod": "prod", "reduce_any": "any", "reduce_all": "all"}
#: Paddle's ReduceType enum (reduce_base's reduce_type attribute)
REDUCE_BASE_TYPES = {0: "sum", 1: "max", 2: "min", 3: "prod", 4: "mean", 5: "any", 6: "all"}


def _reduction(fn: ReduceFn, name: str) -> RefFn:
    def run(a: Arrays, c: Ctx) -> tuple[Any, ...]:
        x = np.asarray(a["x"])
        ax = paddle_axes(a.get("axis", ()), x.ndim)
        keep = bool(a.get("keep_dim", False))
        if x.ndim == 0:
            out = np.asarray(fn(x, (), keep)) if name != "mean" else x.astype(np.float64)
        else:
            out = fn(x, ax, keep)
        nd = c.out_ndim(0)
        if nd == 1 and out.ndim == 0:  # squared_l2_norm: Paddle's output is [1]
            out = out.reshape(1)
        return (out,)

    return run


def _reduction_ref(name: str) -> Reference:
    fn, dom = REDUCTIONS[name]
    return Reference(name, _reduction(fn, name), ("x",), ("out",), "reduction", meta={"domain": dom, "op": name})


for _n in REDUCTIONS:
    register_reference(_reduction_ref(_n), *[k for k, v in REDUCTION_ALIASES.items() if v == _n])


def _reduce_base(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    name = REDUCE_BASE_TYPES.get(int(a.get("reduce_type", 0)), "sum")
    fn, _ = REDUCTIONS[name]
    return tuple(_reduction(fn, name)(a, c))


register_reference(Reference("reduce_base", _reduce_base, ("x",), ("out",), "reduce_base"))


def _expand_back(g: np.ndarray, xshape: tuple[int, ...], ax: tuple[int, ...], keep: bool) -> np.ndarray:
    if not keep:
        shp = tuple(1 if i in ax else s for i, s in enumerate(xshape))
        g = g.reshape(shp) if g.size == int(np.prod(shp)) else g
    return np.broadcast_to(g, xshape)


def _reduction_grad(name: str) -> RefFn:
    def run(a: Arrays, c: Ctx) -> tuple[Any, ...]:
        x, g = as_f64(a["x"]), as_f64(a["out_grad"])
        ax = reduce_axes(a, x.ndim)
        keep = bool(a.get("keep_dim", False))
        gb = _expand_back(g, x.shape, ax, keep)
        if name == "sum":
            return (np.array(gb),)
        if name == "mean":
            n = int(np.prod([x.shape[i] for i in ax])) if ax else 1
            return (gb / max(n, 1),)
        if name == "squared_l2_norm":
            return (2 * x * gb,)
        if name == "frobenius_norm":
            fro = _frob(x, ax, True)
            return (x / np.where(fro == 0, 1.0, fro) * gb,)
        if name in ("max", "min"):
            out: Any = a.get("out")
            if out is None:
                out = (np.max if name == "max" else np.min)(x, axis=ax, keepdims=True)
            ob = _expand_back(as_f64(out), x.shape, ax, keep)
            return ((x == ob) * gb,)
        if name == "prod":
            pout: Any = a.get("out")
            if pout is None:
                pout = np.prod(x, axis=ax, keepdims=True)
            return (_expand_back(as_f64(pout), x.shape, ax, keep) / x * gb,)
        raise ValueError(f"no gradient for {name}")

    return run


def _prep_reduction_grad(name: str) -> Callable[[Arrays], None]:
    fn, _ = REDUCTIONS[name]

    def prep(a: Arrays) -> None:
        if a.get("out") is not None:
            x = np.asarray(a["x"])
            a["out"] = np.asarray(fn(x, reduce_axes(a, x.ndim), bool(a.get("keep_dim", False)))).reshape(np.shape(a["out"]))

    return prep


for _n in ("sum", "mean", "max", "min", "prod", "squared_l2_norm", "frobenius_norm"):
    register_reference(
        Reference(f"{_n}_grad", _reduction_grad(_n), ("x", "out_grad"), ("x_grad",), "reduction_grad",
                  optional=("out",), domains={"x": REDUCTIONS[_n][1]}, prepare=_prep_reduction_grad(_n),
                  meta={"op": _n}),
        *[f"{k}_grad" for k, v in REDUCTION_ALIASES.items() if v == _n],
    )


# -- transpose --------------------------------------------------------------------------------


def _perm(perm: Any, ndim: int) -> tuple[int, ...]:
    return tuple(int(p) + ndim if int(p) < 0 else int(p) for p in perm)


def _transpose(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    x = np.asarray(a["x"])
    return (np.transpose(x, _perm(a["perm"], x.ndim)),)


def _transpose_grad(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    g = np.asarray(a["out_grad"])
    p = _perm(a["perm"], g.ndim)
    return (np.transpose(g, np.argsort(p)),)


register_reference(Reference("transpose", _transpose, ("x",), ("out",), "transpose"), "transpose2")
register_reference(Reference("transpose_grad", _transpose_grad, ("out_grad",), ("x_grad",), "transpose_grad"))


# -- default_data_parallel / replicated -------------------------------------------------------
# A stand-in op for the generic rules: every output row b depends on row b of every input
# (default_data_parallel), or every output depends on every element of every input
# (replicated). Output shapes come from the ``outs`` specs; a rank makes its outputs with
# the batch size of its local inputs (data parallel) and the global sizes elsewhere.


def _pattern(shape: tuple[int, ...]) -> np.ndarray:
    n = int(np.prod(shape)) if shape else 1
    return (np.arange(n, dtype=np.float64) % 7 + 1.0).reshape(shape) / 7.0


def _dp(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    ins = [np.asarray(t) for t in (a.get("ins") or []) if t is not None]
    out_shapes = [tuple(s) if s is not None else None for s in c.shapes.get("outs", [])]
    batch = None
    for t in ins:
        if t.ndim:
            batch = t.shape[0]
            break
    rowsum = None
    for t in ins:
        if t.ndim == 0:
            continue
        r = np.tanh(as_f64(t)).reshape(t.shape[0], int(np.prod(t.shape[1:]))).sum(axis=1)
        rowsum = r if rowsum is None else rowsum + r
    outs: list[Any] = []
    for s in out_shapes:
        if s is None:
            outs.append(None)
            continue
        if not s:
            outs.append(np.asarray(sum(float(np.tanh(as_f64(t)).sum()) for t in ins)))
            continue
        b = batch if batch is not None else s[0]
        shp = (b, *s[1:])
        rs = rowsum if rowsum is not None else np.zeros(b)
        outs.append(rs.reshape((b,) + (1,) * (len(s) - 1)) * _pattern((1, *shp[1:])))
    return tuple(outs)


def _replicated(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    ins = [np.asarray(t) for t in (a.get("ins") or []) if t is not None]
    total = sum(float(np.tanh(as_f64(t)).sum()) for t in ins)
    return tuple(None if s is None else total * _pattern(tuple(s)) for s in c.shapes.get("outs", []))


register_reference(Reference("default_data_parallel", _dp, ("ins",), (), "default_dp", spec_params=("outs",)),
                   "default_")
register_reference(Reference("replicated", _replicated, ("ins",), (), "replicated", spec_params=("outs",)))


# -- reshape (the localize hook at work) ---------------------------------------------------------


def resolve_shape(target: Sequence[int], in_shape: Sequence[int]) -> tuple[int, ...]:
    """Paddle's reshape target: 0 copies the input size at that index, one -1 is inferred."""
    out = [in_shape[i] if t == 0 and i < len(in_shape) else int(t) for i, t in enumerate(target)]
    n = int(np.prod(in_shape)) if in_shape else 1
    if out.count(-1) > 1:
        raise ValueError(f"reshape: more than one -1 in {list(target)}")
    if -1 in out:
        rest = int(np.prod([v for v in out if v != -1])) if len(out) > 1 else 1
        if rest == 0 or n % rest:
            raise ValueError(f"reshape: cannot infer -1 in {list(target)} for {list(in_shape)}")
        out[out.index(-1)] = n // rest
    if int(np.prod(out)) != n:
        raise ValueError(f"reshape: {list(target)} does not hold {n} elements")
    return tuple(out)


def _reshape(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    x = np.asarray(a["x"])
    if not c.is_global and c.out_attrs:  # a local target (from the out sharding): 0 is a size
        return (x.reshape(tuple(a["shape"])),)
    return (x.reshape(resolve_shape(a["shape"], x.shape)),)


def _reshape_localize(a: Arrays, c: Ctx) -> Arrays:
    """A rank reshapes its local x to the local piece of the output the rule claims."""
    from spmdkit.sim.mesh import local_shape

    out = dict(a)
    attr = c.out_attrs[0] if c.out_attrs else None
    gshape = c.out_shapes[0] if c.out_shapes else None
    if attr is not None and gshape is not None and c.coords is not None:
        out["shape"] = local_shape(attr, gshape, c.coords)
    return out


register_reference(Reference("reshape", _reshape, ("x",), ("out",), "reshape", localize=_reshape_localize), "reshape2")


def _view_to(name: str) -> RefFn:
    """A view op (flatten, squeeze, unsqueeze) run as a reshape to its global out shape; on
    a rank the localize hook gives the local out shape (from the out sharding)."""

    def fn(a: Arrays, c: Ctx) -> tuple[Any, ...]:
        x = np.asarray(a[name])
        return (x.reshape(tuple(a["shape"])),)

    return fn


def _view_localize(shape_of: Callable[[Arrays, tuple[int, ...]], tuple[int, ...]], name: str) -> Callable[
        [Arrays, Ctx], Arrays]:
    def loc(a: Arrays, c: Ctx) -> Arrays:
        out = dict(a)
        if c.is_global:
            out["shape"] = shape_of(a, tuple(np.shape(a[name])))
            return out
        return _reshape_localize(out, c)

    return loc


def _view_run(shape_of: Callable[[Arrays, tuple[int, ...]], tuple[int, ...]], name: str) -> RefFn:
    base = _view_to(name)
    loc = _view_localize(shape_of, name)

    def fn(a: Arrays, c: Ctx) -> tuple[Any, ...]:
        if c.is_global:
            a = loc(a, c)
        return tuple(base(a, c))

    return fn


def _flatten_shape(a: Arrays, shp: tuple[int, ...]) -> tuple[int, ...]:
    from spmdkit.engine.dim_trans import flatten_trans

    return tuple(flatten_trans.raw(shp, int(a["start_axis"]), int(a["stop_axis"]))[1])  # type: ignore[attr-defined]


def _squeeze_shape(a: Arrays, shp: tuple[int, ...]) -> tuple[int, ...]:
    from spmdkit.engine.dim_trans import squeeze_trans

    return tuple(squeeze_trans.raw(shp, tuple(a["axis"]))[1])  # type: ignore[attr-defined]


def _unsqueeze_shape(a: Arrays, shp: tuple[int, ...]) -> tuple[int, ...]:
    from spmdkit.engine.dim_trans import unsqueeze_trans

    return tuple(unsqueeze_trans.raw(shp, tuple(a["axis"]))[1])  # type: ignore[attr-defined]


def _grad_shape(holder: str) -> Callable[[Arrays, tuple[int, ...]], tuple[int, ...]]:
    def f(a: Arrays, shp: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(np.shape(a[holder]))

    return f


def _grad_ref(holder: str) -> RefFn:
    """x_grad = out_grad viewed as the holder's shape (global, or the local x_grad piece)."""

    def fn(a: Arrays, c: Ctx) -> tuple[Any, ...]:
        g = np.asarray(a["out_grad"])
        if c.is_global:
            return (g.reshape(tuple(np.shape(a[holder]))),)
        return (g.reshape(tuple(a["shape"])),)

    return fn


def _grad_localize(a: Arrays, c: Ctx) -> Arrays:
    return _reshape_localize(a, c)


for _n, _f_shape, _fam in (("flatten", _flatten_shape, "flatten"), ("squeeze", _squeeze_shape, "squeeze"),
                           ("unsqueeze", _unsqueeze_shape, "unsqueeze")):
    register_reference(Reference(_n, _view_run(_f_shape, "x"), ("x",), ("out",), _fam,
                                 localize=_reshape_localize), *(("unsqueeze2",) if _n == "unsqueeze" else ()))

for _n, _holder in (("reshape_grad", "x_shape"), ("flatten_grad", "xshape"), ("squeeze_grad", "xshape"),
                    ("unsqueeze_grad", "x")):
    register_reference(Reference(_n, _grad_ref(_holder), ("out_grad",), ("x_grad",), "view_grad",
                                 spec_params=(_holder,), localize=_grad_localize, meta={"holder": _holder}))


def reference_names() -> list[str]:
    """Every name with a reference (including aliases)."""
    return sorted(REFERENCES)


__all__ = [
    "BINARY",
    "Ctx",
    "REFERENCES",
    "REDUCTIONS",
    "Reference",
    "UNARY",
    "ArrayLib",
    "NUMPY",
    "as_f64",
    "get_reference",
    "matmul",
    "matmul_grad",
    "paddle_axes",
    "reduce_axes",
    "reference_names",
    "register_reference",
    "sum_to_shape",
    "swap_last",
]
