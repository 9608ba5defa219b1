"""Numpy references and case generators of the elementwise family (spmdkit.ops.elementwise): the
unary ops (UNARY: forward, derivative, value domain), gelu, pow, dropout, cast, the binary ops
(BINARY, with Paddle's old elementwise_* names as aliases) and their grads.

Random ops (bernoulli, dropout, poisson) use deterministic stand-ins: what a rule claims is a
layout, and an elementwise stand-in has the same layout law.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

import numpy as np

from spmdkit.sim.cases import GENERATORS, Shape, Spec, TGen, rand_shape
from spmdkit.sim.reference import Arrays, Ctx, Reference, as_f64, register_reference, sum_to_shape


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


# -- case generators ----------------------------------------------------------------------------


def _g_unary(r: random.Random, m: list[int], ref: Reference) -> Spec:
    return {"x": TGen(rand_shape(r, m)), "approximate": r.random() < 0.5}


def _g_cast(r: random.Random, m: list[int], ref: Reference) -> Spec:
    return {"x": TGen(rand_shape(r, m)), "dtype": r.choice(("float32", "float64", "float16", "int32", "int64", "bool"))}


def _g_unary_grad(r: random.Random, m: list[int], ref: Reference) -> Spec:
    s = rand_shape(r, m)
    return {"x": TGen(s), "out": TGen(s), "out_grad": TGen(s, "real"), "approximate": r.random() < 0.5,
            "y": r.choice((2.0, 3.0, 0.5, 1.0))}


def _g_dropout_grad(r: random.Random, m: list[int], ref: Reference) -> Spec:
    s = rand_shape(r, m)
    return {"mask": TGen(s, "bool"), "out_grad": TGen(s, "real"), "p": r.choice((0.0, 0.1, 0.5)),
            "is_test": r.random() < 0.2, "mode": r.choice(("upscale_in_train", "downscale_in_infer"))}


def _broadcast_pair(r: random.Random, m: list[int]) -> tuple[Shape, Shape]:
    x = list(rand_shape(r, m))
    y = list(x)
    for i in range(len(y)):
        u = r.random()
        if u < 0.15:
            y[i] = 1
        elif u < 0.25:
            x[i] = 1
    cut = r.randint(0, len(y)) if r.random() < 0.3 else 0
    y = y[cut:]
    if r.random() < 0.5:
        return tuple(x), tuple(y)
    return tuple(y), tuple(x)


def _g_binary(r: random.Random, m: list[int], ref: Reference) -> Spec:
    x, y = _broadcast_pair(r, m)
    return {"x": TGen(x), "y": TGen(y)}


def _g_binary_grad(r: random.Random, m: list[int], ref: Reference) -> Spec:
    x, y = _broadcast_pair(r, m)
    o = np.broadcast_shapes(x, y)
    return {"x": TGen(x), "y": TGen(y), "out": TGen(o, "real"), "out_grad": TGen(o, "real"), "axis": -1}


GENERATORS.update({
    "unary": _g_unary,
    "cast": _g_cast,
    "unary_grad": _g_unary_grad,
    "dropout_grad": _g_dropout_grad,
    "binary": _g_binary,
    "binary_grad": _g_binary_grad,
})

__all__ = ["BINARY", "UNARY"]
