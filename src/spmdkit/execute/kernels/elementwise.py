"""torch kernels of the ``elementwise`` family (:mod:`spmdkit.ops.elementwise`): elementwise unary and
binary ops (one table each: ``UNARY``, ``BINARY``, naming the torch function of every op the numpy
tables have; the simulator's stand-ins, ``scale`` as ``2x + 0.5``, ``bernoulli`` a threshold,
``dropout`` the identity, kept as they are, so that both executors compute the same step), their
gradients (autograd of the forward, or the reference's formula where the grad op is given the
output), gelu, pow, dropout and cast."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from spmdkit.execute.kernels._common import DTYPES, Args, Kernel, UnaryT, floating, register, tensor, vjp
from spmdkit.sim.reference import Ctx, sum_to_shape

# -- elementwise unary -----------------------------------------------------------------------------
# name -> torch function; the simulator's stand-ins as the numpy table has them

_SELU_A = 1.6732632423543772
_SELU_S = 1.0507009873554805

UNARY: dict[str, UnaryT] = {
    "abs": torch.abs, "acos": torch.acos, "acosh": torch.acosh, "asin": torch.asin, "asinh": torch.asinh,
    "assign": torch.clone, "atan": torch.atan, "atanh": torch.atanh,
    "bernoulli": lambda x: (x > 0.5).to(x.dtype), "bitwise_not": torch.bitwise_not, "ceil": torch.ceil,
    "celu": lambda x: F.celu(x), "clip": lambda x: torch.clamp(x, -0.5, 0.5), "conj": torch.conj,
    "cos": torch.cos, "cosh": torch.cosh, "digamma": torch.digamma, "dropout": torch.clone,
    "elementwise_unary": torch.tanh, "elu": F.elu, "erf": torch.erf, "erfinv": torch.erfinv, "exp": torch.exp,
    "expm1": torch.expm1, "fill": lambda x: torch.full_like(x, 0.5), "floor": torch.floor,
    "hardshrink": lambda x: F.hardshrink(x, 0.5), "hardsigmoid": F.hardsigmoid, "hardswish": F.hardswish,
    "hardtanh": F.hardtanh, "leaky_relu": lambda x: F.leaky_relu(x, 0.02), "lgamma": torch.lgamma,
    "log": torch.log, "log10": torch.log10, "log1p": torch.log1p, "log2": torch.log2,
    "logical_not": torch.logical_not, "logit": torch.logit, "logsigmoid": F.logsigmoid, "mish": F.mish,
    "poisson": lambda x: torch.floor(x * 3.0), "pow": lambda x: x ** 3, "reciprocal": torch.reciprocal,
    "relu": torch.relu, "relu6": F.relu6, "round": torch.round, "rsqrt": torch.rsqrt,
    "scale": lambda x: 2.0 * x + 0.5, "selu": torch.selu, "sigmoid": torch.sigmoid, "sign": torch.sign,
    "silu": F.silu, "sin": torch.sin, "sinh": torch.sinh, "softplus": F.softplus,
    "softshrink": lambda x: F.softshrink(x, 0.5), "softsign": F.softsign, "sqrt": torch.sqrt,
    "square": torch.square, "stanh": lambda x: 1.7159 * torch.tanh(0.67 * x),
    "swish": F.silu, "tan": torch.tan, "tanh": torch.tanh, "tanh_shrink": lambda x: x - torch.tanh(x),
    "thresholded_relu": lambda x: torch.where(x > 1.0, x, torch.zeros_like(x)), "trunc": torch.trunc,
}
#: stand-ins whose numpy derivative is not the derivative of the forward (kept as the reference has it)
_DERIV: dict[str, UnaryT] = {
    "bernoulli": torch.zeros_like, "fill": torch.zeros_like, "poisson": torch.zeros_like,
    "dropout": torch.ones_like, "assign": torch.ones_like, "conj": torch.ones_like,
    "hardsigmoid": lambda x: ((x > -3) & (x < 3)).to(x.dtype) / 6.0,
    "clip": lambda x: ((x > -0.5) & (x < 0.5)).to(x.dtype),
    "hardtanh": lambda x: ((x > -1) & (x < 1)).to(x.dtype),
    "relu6": lambda x: ((x > 0) & (x < 6)).to(x.dtype),
    "relu": lambda x: (x > 0).to(x.dtype),
    "abs": torch.sign,
}
#: derivative through the output, for grad ops given ``out`` (the numpy reference's _DOUT)
_DOUT: dict[str, UnaryT] = {
    "relu": lambda o: (o > 0).to(o.dtype), "exp": lambda o: o, "sigmoid": lambda o: o * (1 - o),
    "tanh": lambda o: 1 - o * o, "sqrt": lambda o: 0.5 / o, "rsqrt": lambda o: -0.5 * o ** 3,
    "reciprocal": lambda o: -o * o, "relu6": lambda o: ((o > 0) & (o < 6)).to(o.dtype),
    "elu": lambda o: torch.where(o > 0, torch.ones_like(o), o + 1.0), "expm1": lambda o: o + 1.0,
    "selu": lambda o: torch.where(o > 0, torch.full_like(o, _SELU_S), o + _SELU_S * _SELU_A),
    "hardsigmoid": lambda o: ((o > 0) & (o < 1)).to(o.dtype) / 6.0, "silu": torch.ones_like,
}


def _generic_dout(o: torch.Tensor) -> torch.Tensor:
    """The numpy reference's derivative for an op given only ``out`` that has no formula: 1 + out²."""
    return 1.0 + o * o


def _unary_kernel(name: str) -> Kernel:
    fn = UNARY[name]
    return lambda a, c: (fn(tensor(a["x"])),)


def _unary_grad_kernel(name: str) -> Kernel:
    fn = UNARY[name]
    deriv = _DERIV.get(name)

    def grad(a: Args, c: Ctx) -> tuple[Any, ...]:
        g = tensor(a["out_grad"])
        x = a.get("x")
        if x is None and a.get("out") is not None:
            o = tensor(a["out"])
            return (g * _DOUT.get(name, _generic_dout)(o),)
        at = tensor(x) if x is not None else torch.zeros_like(g)  # out_grad only: a constant derivative
        if deriv is not None:
            return (g * deriv(at),)
        return (vjp(fn, [at], g)[0],)

    return grad


for _n in UNARY:
    register(_n)(_unary_kernel(_n))
    if _n not in ("bitwise_not", "logical_not"):
        register(f"{_n}_grad")(_unary_grad_kernel(_n))


def _gelu(x: torch.Tensor, approximate: bool) -> torch.Tensor:
    return F.gelu(x, approximate="tanh" if approximate else "none")


@register("gelu")
def _k_gelu(a: Args, c: Ctx) -> tuple[Any, ...]:
    return (_gelu(tensor(a["x"]), bool(a.get("approximate", False))),)


@register("gelu_grad")
def _k_gelu_grad(a: Args, c: Ctx) -> tuple[Any, ...]:
    approx = bool(a.get("approximate", False))
    return (vjp(lambda x: _gelu(x, approx), [tensor(a["x"])], tensor(a["out_grad"]))[0],)


@register("pow_grad")
def _k_pow_grad(a: Args, c: Ctx) -> tuple[Any, ...]:
    y = float(a.get("y", 1.0))
    x = tensor(a["x"])
    return (tensor(a["out_grad"]) * y * x ** (y - 1.0),)


@register("dropout_grad")
def _k_dropout_grad(a: Args, c: Ctx) -> tuple[Any, ...]:
    g = tensor(a["out_grad"])
    mask = tensor(a["mask"]).to(g.dtype)
    p = float(a.get("p", 0.5))
    upscale = a.get("mode", "upscale_in_train") == "upscale_in_train"
    if bool(a.get("is_test", False)):
        return (g * (1.0 - p) if not upscale else g.clone(),)
    if upscale:
        return (g * mask / (1.0 - p) if p < 1.0 else torch.zeros_like(g),)
    return (g * mask,)


@register("cast_grad")
def _k_cast_grad(a: Args, c: Ctx) -> tuple[Any, ...]:
    return (tensor(a["out_grad"]).clone(),)


@register("cast")
def _k_cast(a: Args, c: Ctx) -> tuple[Any, ...]:
    dt = a.get("dtype", "float32")
    key = str(getattr(dt, "name", dt)).lower().replace("paddle.", "").replace("datatype.", "")
    return (tensor(a["x"]).to(DTYPES.get(key, torch.float32)),)


# -- elementwise binary ----------------------------------------------------------------------------

BinaryT = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
BINARY: dict[str, BinaryT] = {
    "add": torch.add, "subtract": torch.sub, "multiply": torch.mul, "divide": torch.div,
    "elementwise_pow": torch.pow, "maximum": torch.maximum, "minimum": torch.minimum, "fmax": torch.fmax,
    "fmin": torch.fmin, "remainder": torch.remainder, "floor_divide": torch.floor_divide,
    "trunc_divide": lambda x, y: torch.trunc(x / y).to(torch.int64),
    "bitwise_and": torch.bitwise_and, "bitwise_or": torch.bitwise_or, "bitwise_xor": torch.bitwise_xor,
    "logical_and": torch.logical_and, "logical_or": torch.logical_or, "logical_xor": torch.logical_xor,
    "not_equal": torch.ne, "greater_than": torch.gt, "less_than": torch.lt, "heaviside": torch.heaviside,
    "elementwise_binary": lambda x, y: x * y + x,
}
#: gradients that are not autograd's: the reference's tie rule (the whole gradient to x where
#: x wins, to y on ties) and the stand-ins' (remainder, floor_divide)
_BIN_DERIV: dict[str, tuple[BinaryT, BinaryT]] = {
    "maximum": (lambda x, y: (x > y).to(x.dtype), lambda x, y: (x <= y).to(x.dtype)),
    "minimum": (lambda x, y: (x < y).to(x.dtype), lambda x, y: (x >= y).to(x.dtype)),
    "fmax": (lambda x, y: (x > y).to(x.dtype), lambda x, y: (x <= y).to(x.dtype)),
    "fmin": (lambda x, y: (x < y).to(x.dtype), lambda x, y: (x >= y).to(x.dtype)),
    "remainder": (lambda x, y: torch.ones_like(x * y), lambda x, y: -torch.floor_divide(x, y).to(x.dtype)),
    "floor_divide": (lambda x, y: torch.zeros_like(x * y), lambda x, y: torch.zeros_like(x * y)),
    "heaviside": (lambda x, y: torch.zeros_like(x * y), lambda x, y: (x == 0).to(y.dtype) * torch.ones_like(y)),
}
_BINARY_ALIASES = {"elementwise_add": "add", "elementwise_sub": "subtract", "elementwise_mul": "multiply",
                   "elementwise_div": "divide", "pow_binary": "elementwise_pow"}
_NO_GRAD = {"trunc_divide", "bitwise_and", "bitwise_or", "bitwise_xor", "logical_and", "logical_or",
            "logical_xor", "not_equal", "greater_than", "less_than"}


def _binary_kernel(name: str) -> Kernel:
    fn = BINARY[name]
    return lambda a, c: (fn(tensor(a["x"]), tensor(a["y"])),)


def _binary_grad_kernel(name: str) -> Kernel:
    fn = BINARY[name]
    dd = _BIN_DERIV.get(name)

    def grad(a: Args, c: Ctx) -> tuple[Any, ...]:
        x, y, g = floating(a["x"]), floating(a["y"]), tensor(a["out_grad"])
        if dd is not None:
            gx = g * torch.broadcast_to(dd[0](x, y), g.shape)
            gy = g * torch.broadcast_to(dd[1](x, y), g.shape)
            return (sum_to_shape(gx, x.shape), sum_to_shape(gy, y.shape))
        gx_, gy_ = vjp(fn, [x, y], g)
        return (gx_, gy_)

    return grad


for _n in BINARY:
    _aliases = [k for k, v in _BINARY_ALIASES.items() if v == _n]
    register(_n, *_aliases)(_binary_kernel(_n))
    if _n not in _NO_GRAD:
        register(f"{_n}_grad", *[f"{k}_grad" for k in _aliases])(_binary_grad_kernel(_n))
