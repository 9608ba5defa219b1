"""torch kernels of the ops behind the rules: what a rank of ``spmdkit run --kernels torch`` runs
on its local shards, in the program's dtype (float32, bfloat16, float16), on CPU or GPU.

Each kernel mirrors the numpy reference of its op (:mod:`spmdkit.sim.refs`, one module per family)
family by family, with torch's own ops instead of numpy's:

- elementwise unary, binary and reductions: one table each (``UNARY``, ``BINARY``,
  ``REDUCTIONS``) naming the torch function of every op the numpy tables have; the simulator's
  stand-ins (``scale`` is ``2x + 0.5``, ``bernoulli`` a threshold, ``dropout`` the identity) are
  kept as they are, so that both executors compute the same step;
- gradients: ``torch.autograd`` of the forward kernel where the grad op is given the forward's
  inputs (elementwise, matmul, reductions, views, gathers, convolutions, attention, rotary
  embedding): torch's own backward kernels, one vector-Jacobian product per op; where the grad op
  is given saved statistics or the output instead (softmax, layer / RMS norm, the losses, the
  output-based unary grads) the reference's formula, in torch;
- the rest one kernel per rule (norms, matmul, attention through
  ``scaled_dot_product_attention``, the losses, AdamW / SGD, embedding, views, indexing);
- where the numpy reference's formula is the kernel, it is written once and runs here on
  :data:`TORCH` (:class:`spmdkit.sim.reference.ArrayLib`): ``sum_to_shape``, matmul and its grad, the
  rotary embedding and its grad, the Adam / AdamW update.

The attributes a rank sees are made local by the numpy reference's own ``localize`` hook (a
reshape's target in local sizes, an embedding shard's first row), so a torch kernel computes
what its reference computes on the same pieces. A kernel that communicates
(``c_softmax_with_cross_entropy``) all-reduces through ``Ctx.comm`` on torch tensors.

A rule without a kernel here is refused by name (:func:`missing_kernels`,
:class:`NoTorchKernelError`): there is no silent fallback to numpy. :func:`kernel_names` lists
every rule (and alias) that has one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from spmdkit.core.errors import ProgramError
from spmdkit.sim.reference import ArrayLib, Ctx, Reference, get_reference, paddle_axes, reduce_axes, sum_to_shape
from spmdkit.sim.refs.attention import rope
from spmdkit.sim.refs.matmul import matmul, matmul_grad
from spmdkit.sim.refs.optimizer import adam_update

Args = dict[str, Any]
Kernel = Callable[[Args, Ctx], Sequence[Any]]

#: program dtype name -> torch dtype
DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8,
    "bool": torch.bool,
}

KERNELS: dict[str, Kernel] = {}


class NoTorchKernelError(ProgramError):
    """An op of the program has no torch kernel (``--kernels numpy`` runs it)."""


def register(*names: str) -> Callable[[Kernel], Kernel]:
    def deco(fn: Kernel) -> Kernel:
        for n in names:
            KERNELS[n] = fn
        return fn

    return deco


def get_kernel(name: str) -> Kernel | None:
    """The torch kernel of a rule name (or any alias of that rule), None if there is none."""
    from spmdkit.engine.registry import by_rule_name

    return by_rule_name(KERNELS, name)


def kernel_names() -> list[str]:
    """Every rule name with a torch kernel (aliases included)."""
    return sorted(KERNELS)


#: rule -> (attribute, what): a kernel that exists but not for this attribute set true
_UNSUPPORTED = {"flash_attention": ("return_softmax", "flash_attention with return_softmax")}


def missing_kernels(program: Any) -> dict[str, str]:
    """Rules of ``program`` with no torch kernel, or none for the attributes an op sets
    ("flash_attention with return_softmax"): -> the first op that uses it."""
    out: dict[str, str] = {}
    for op in program.ops:
        bad = _UNSUPPORTED.get(op.rule)
        key = bad[1] if bad is not None and op.attrs.get(bad[0]) else op.rule
        if (get_kernel(op.rule) is None or key != op.rule) and key not in out:
            out[key] = op.name
    return out


def check_kernels(program: Any) -> None:
    """Raise :class:`NoTorchKernelError` naming every op whose rule has no torch kernel."""
    miss = missing_kernels(program)
    if miss:
        names = ", ".join(f"{r} (op {o})" for r, o in sorted(miss.items()))
        raise NoTorchKernelError(f"--kernels torch: no torch kernel for {names}; run with --kernels numpy "
                                 f"(spmdkit's float64 numpy references) instead")


def run_kernel(ref: Reference, kernel: Kernel, args: Args, ctx: Ctx) -> tuple[Any, ...]:
    """Run ``kernel`` on ``args`` (torch tensors), after the numpy reference's ``localize`` hook
    on a rank (the same local attributes the reference would get)."""
    a = ref.localize(args, ctx) if ref.localize is not None and not ctx.is_global else args
    return tuple(kernel(a, ctx))


# -- helpers ---------------------------------------------------------------------------------------


def _t(x: Any) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.as_tensor(x)


def _fl(x: Any) -> torch.Tensor:
    """A floating tensor (ints and bools become the default float dtype, as numpy's _f does)."""
    t = _t(x)
    return t if t.is_floating_point() else t.to(torch.get_default_dtype())


def _ax(axis: Any, ndim: int) -> int:
    a = int(axis)
    if ndim == 0:
        return 0
    return a + ndim if a < 0 else a


#: the formulas written once for numpy and torch (spmdkit.sim.reference.ArrayLib) on torch: the
#: program's dtype, computed rotary angles in float32 as torch's own kernels compute them
TORCH = ArrayLib(array=_t, floats=lambda v, like: torch.as_tensor(v, dtype=torch.float32, device=like.device),
                 ints=lambda v: _t(v).to(torch.int64), cast=lambda x, like: x.to(like.dtype), concat=torch.cat,
                 stack=torch.stack, repeat=torch.repeat_interleave, sin=torch.sin, cos=torch.cos, sqrt=torch.sqrt,
                 maximum=torch.maximum)


def vjp(fn: Callable[..., Any], primals: Sequence[Any], grads: Any, wrt: Sequence[bool] | None = None
        ) -> list[torch.Tensor | None]:
    """torch autograd's vector-Jacobian product of ``fn`` at ``primals`` (the gradient of
    ``sum(fn(*primals) * grads)`` with respect to each primal marked in ``wrt``; None for the
    others and for absent or non-floating primals)."""
    wrt = [True] * len(primals) if wrt is None else list(wrt)
    ins: list[Any] = []
    leaves: list[torch.Tensor] = []
    for p, w in zip(primals, wrt):
        if isinstance(p, torch.Tensor) and w and p.is_floating_point():
            q = p.detach().requires_grad_(True)
            leaves.append(q)
            ins.append(q)
        else:
            ins.append(p)
    if not leaves:
        return [None] * len(primals)
    with torch.enable_grad():
        out = fn(*ins)
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        gs = list(grads) if isinstance(grads, (tuple, list)) else [grads]
        pairs = [(o, g) for o, g in zip(outs, gs) if o is not None and g is not None and o.requires_grad]
        got: Sequence[torch.Tensor | None] = (
            torch.autograd.grad([o for o, _ in pairs], leaves, [g.to(o.dtype).expand_as(o) for o, g in pairs],
                                allow_unused=True) if pairs else [None] * len(leaves))
    res: list[torch.Tensor | None] = []
    it = iter(zip(leaves, got))
    for p, w in zip(primals, wrt):
        if isinstance(p, torch.Tensor) and w and p.is_floating_point():
            leaf, g = next(it)
            res.append(torch.zeros_like(leaf) if g is None else g)
        else:
            res.append(None)
    return res


# -- elementwise unary -----------------------------------------------------------------------------
# name -> torch function; the simulator's stand-ins as the numpy table has them

_SELU_A = 1.6732632423543772
_SELU_S = 1.0507009873554805

UnaryT = Callable[[torch.Tensor], torch.Tensor]
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
    return lambda a, c: (fn(_t(a["x"])),)


def _unary_grad_kernel(name: str) -> Kernel:
    fn = UNARY[name]
    deriv = _DERIV.get(name)

    def grad(a: Args, c: Ctx) -> tuple[Any, ...]:
        g = _t(a["out_grad"])
        x = a.get("x")
        if x is None and a.get("out") is not None:
            o = _t(a["out"])
            return (g * _DOUT.get(name, _generic_dout)(o),)
        at = _t(x) if x is not None else torch.zeros_like(g)  # out_grad only: a constant derivative
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
    return (_gelu(_t(a["x"]), bool(a.get("approximate", False))),)


@register("gelu_grad")
def _k_gelu_grad(a: Args, c: Ctx) -> tuple[Any, ...]:
    approx = bool(a.get("approximate", False))
    return (vjp(lambda x: _gelu(x, approx), [_t(a["x"])], _t(a["out_grad"]))[0],)


@register("pow_grad")
def _k_pow_grad(a: Args, c: Ctx) -> tuple[Any, ...]:
    y = float(a.get("y", 1.0))
    x = _t(a["x"])
    return (_t(a["out_grad"]) * y * x ** (y - 1.0),)


@register("dropout_grad")
def _k_dropout_grad(a: Args, c: Ctx) -> tuple[Any, ...]:
    g = _t(a["out_grad"])
    mask = _t(a["mask"]).to(g.dtype)
    p = float(a.get("p", 0.5))
    upscale = a.get("mode", "upscale_in_train") == "upscale_in_train"
    if bool(a.get("is_test", False)):
        return (g * (1.0 - p) if not upscale else g.clone(),)
    if upscale:
        return (g * mask / (1.0 - p) if p < 1.0 else torch.zeros_like(g),)
    return (g * mask,)


@register("cast_grad")
def _k_cast_grad(a: Args, c: Ctx) -> tuple[Any, ...]:
    return (_t(a["out_grad"]).clone(),)


@register("cast")
def _k_cast(a: Args, c: Ctx) -> tuple[Any, ...]:
    dt = a.get("dtype", "float32")
    key = str(getattr(dt, "name", dt)).lower().replace("paddle.", "").replace("datatype.", "")
    return (_t(a["x"]).to(DTYPES.get(key, torch.float32)),)


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
    return lambda a, c: (fn(_t(a["x"]), _t(a["y"])),)


def _binary_grad_kernel(name: str) -> Kernel:
    fn = BINARY[name]
    dd = _BIN_DERIV.get(name)

    def grad(a: Args, c: Ctx) -> tuple[Any, ...]:
        x, y, g = _fl(a["x"]), _fl(a["y"]), _t(a["out_grad"])
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


@register("where")
def _k_where(a: Args, c: Ctx) -> tuple[Any, ...]:
    return (torch.where(_t(a["condition"]).to(torch.bool), _t(a["x"]), _t(a["y"])),)


@register("where_grad")
def _k_where_grad(a: Args, c: Ctx) -> tuple[Any, ...]:
    cond = _t(a["condition"]).to(torch.bool)
    g = _t(a["out_grad"])
    cb = torch.broadcast_to(cond, g.shape)
    z = torch.zeros((), dtype=g.dtype, device=g.device)
    return (sum_to_shape(torch.where(cb, g, z), _t(a["x"]).shape), sum_to_shape(torch.where(cb, z, g), _t(a["y"]).shape))


@register("add_n")
def _k_add_n(a: Args, c: Ctx) -> tuple[Any, ...]:
    xs = [_t(t) for t in a["input"]]
    return (sum(xs[1:], xs[0].clone()),)


@register("full_like")
def _k_full_like(a: Args, c: Ctx) -> tuple[Any, ...]:
    x = _t(a["x"])
    return (torch.full(x.shape, float(a.get("y", 0.0)), dtype=torch.float64, device=x.device),)


# -- reductions ------------------------------------------------------------------------------------

ReduceT = Callable[[torch.Tensor, tuple[int, ...], bool], torch.Tensor]


def _extreme(is_max: bool) -> ReduceT:
    def r(x: torch.Tensor, ax: tuple[int, ...], keep: bool) -> torch.Tensor:
        if x.numel() == 0:  # the identity of MAX / MIN over an empty local slice
            shape = [1 if i in ax else s for i, s in enumerate(x.shape)] if keep else \
                [s for i, s in enumerate(x.shape) if i not in ax]
            if x.dtype == torch.bool:
                return torch.full(shape, not is_max, dtype=x.dtype, device=x.device)
            info = torch.finfo(x.dtype) if x.is_floating_point() else torch.iinfo(x.dtype)
            fill = (-math.inf if is_max else math.inf) if x.is_floating_point() else (info.min if is_max else info.max)
            return torch.full(shape, fill, dtype=x.dtype, device=x.device)
        return torch.amax(x, dim=ax, keepdim=keep) if is_max else torch.amin(x, dim=ax, keepdim=keep)

    return r


def _prod(x: torch.Tensor, ax: tuple[int, ...], keep: bool) -> torch.Tensor:
    for d in sorted(ax, reverse=True):
        x = torch.prod(x, dim=d, keepdim=True)
    return x if keep else x.reshape([s for i, s in enumerate(x.shape) if i not in ax])


REDUCTIONS: dict[str, ReduceT] = {
    "sum": lambda x, ax, k: torch.sum(x, dim=ax, keepdim=k),
    "mean": lambda x, ax, k: torch.mean(_fl(x), dim=ax, keepdim=k),
    "max": _extreme(True), "min": _extreme(False), "prod": _prod,
    "any": lambda x, ax, k: torch.any(x.to(torch.bool), dim=ax, keepdim=k) if ax else x.to(torch.bool),
    "all": lambda x, ax, k: torch.all(x.to(torch.bool), dim=ax, keepdim=k) if ax else x.to(torch.bool),
    "squared_l2_norm": lambda x, ax, k: torch.sum(x * x, dim=ax, keepdim=k),
    "frobenius_norm": lambda x, ax, k: torch.sqrt(torch.sum(x * x, dim=ax, keepdim=k)),
}
_REDUCTION_ALIASES = {"reduce_sum": "sum", "reduce_max": "max", "amax": "max", "amin": "min",
                      "reduce_mean": "mean", "reduce_min": "min", "reduce_prod": "prod", "reduce_any": "any",
                      "reduce_all": "all"}
_REDUCE_BASE_TYPES = {0: "sum", 1: "max", 2: "min", 3: "prod", 4: "mean", 5: "any", 6: "all"}


def _reduce(name: str, a: Args, c: Ctx) -> torch.Tensor:
    fn = REDUCTIONS[name]
    x = _t(a["x"])
    keep = bool(a.get("keep_dim", False))
    if x.ndim == 0:
        out = x.clone() if name not in ("squared_l2_norm", "frobenius_norm") else fn(x.reshape(1), (0,), False)
    else:
        out = fn(x, paddle_axes(a.get("axis", ()), x.ndim), keep)
    if c.out_ndim(0) == 1 and out.ndim == 0:  # squared_l2_norm: Paddle's output is [1]
        out = out.reshape(1)
    return out


def _reduction_kernel(name: str) -> Kernel:
    return lambda a, c: (_reduce(name, a, c),)


for _n in REDUCTIONS:
    register(_n, *[k for k, v in _REDUCTION_ALIASES.items() if v == _n])(_reduction_kernel(_n))


@register("reduce_base")
def _k_reduce_base(a: Args, c: Ctx) -> tuple[Any, ...]:
    return (_reduce(_REDUCE_BASE_TYPES.get(int(a.get("reduce_type", 0)), "sum"), a, c),)


def _reduction_grad_kernel(name: str) -> Kernel:
    def grad(a: Args, c: Ctx) -> tuple[Any, ...]:
        x, g = _fl(a["x"]), _t(a["out_grad"])
        ax = reduce_axes(a, x.ndim)
        keep = bool(a.get("keep_dim", False))
        if name in ("max", "min"):  # every tied extreme gets the whole gradient, as the reference
            out = a.get("out")
            o = _t(out) if out is not None else REDUCTIONS[name](x, ax, True)
            shp = [1 if i in ax else s for i, s in enumerate(x.shape)]
            gb = g.reshape(shp) if not keep else g
            return ((x == o.reshape(shp)).to(g.dtype) * gb,)
        if x.ndim == 0:
            gx = vjp(lambda v: REDUCTIONS[name](v.reshape(1), (0,), False).reshape(()), [x], g.reshape(()))[0]
            return (gx,)
        want = REDUCTIONS[name](x, ax, keep).shape
        return (vjp(lambda v: REDUCTIONS[name](v, ax, keep), [x], g.reshape(want))[0],)

    return grad


for _n in ("sum", "mean", "max", "min", "prod", "squared_l2_norm", "frobenius_norm"):
    register(f"{_n}_grad", *[f"{k}_grad" for k, v in _REDUCTION_ALIASES.items() if v == _n])(
        _reduction_grad_kernel(_n))


@register("mean_all")
def _k_mean_all(a: Args, c: Ctx) -> tuple[Any, ...]:
    return (torch.mean(_fl(a["x"])),)


@register("mean_all_grad")
def _k_mean_all_grad(a: Args, c: Ctx) -> tuple[Any, ...]:
    x, g = _t(a["x"]), _t(a["out_grad"])
    return (torch.full_like(_fl(x), 0.0) + g.reshape(-1)[0] / max(x.numel(), 1),)


# -- softmax ---------------------------------------------------------------------------------------


def _softmax_kernel(fn: Callable[..., torch.Tensor], of_0d: UnaryT) -> Kernel:
    def k(a: Args, c: Ctx) -> tuple[Any, ...]:
        x = _t(a["x"])
        return (of_0d(x) if x.ndim == 0 else fn(x, dim=_ax(a.get("axis", -1), x.ndim)),)

    return k


def _softmax_grad_kernel(backward: Callable[..., torch.Tensor]) -> Kernel:
    def k(a: Args, c: Ctx) -> tuple[Any, ...]:
        out, g = _t(a["out"]), _t(a["out_grad"])
        if out.ndim == 0:
            return (torch.zeros_like(g),)
        return (backward(g, out, _ax(a.get("axis", -1), out.ndim), g.dtype),)

    return k


# (rule, forward, its value on a 0-d tensor, torch's backward from the output)
for _n, _fwd, _of_0d, _bwd in (("softmax", torch.softmax, torch.ones_like, torch._softmax_backward_data),
                               ("log_softmax", torch.log_softmax, torch.zeros_like, torch._log_softmax_backward_data)):
    register(_n)(_softmax_kernel(_fwd, _of_0d))
    register(f"{_n}_grad")(_softmax_grad_kernel(_bwd))


# -- layer_norm / rms_norm (statistics in float32 for half inputs, as torch's kernels keep them) --


def _acc(x: torch.Tensor) -> torch.Tensor:
    return x.float() if x.dtype in (torch.bfloat16, torch.float16) else x


def _stat_shape(stat: torch.Tensor, c: Ctx, i: int) -> torch.Tensor:
    nd = c.out_ndim(i)
    if nd is not None and nd != stat.ndim:
        if nd == 1:
            return stat.reshape(-1)
        if nd == 0 and stat.numel() == 1:
            return stat.reshape(())
    return stat


def _bna(a: Args, ndim: int) -> int:
    b = int(a.get("begin_norm_axis", 1))
    return b + ndim if b < 0 else b


@register("layer_norm")
def _k_layer_norm(a: Args, c: Ctx) -> tuple[Any, ...]:
    x = _t(a["x"])
    b = _bna(a, x.ndim)
    eps = float(a.get("epsilon", 1e-5))
    tail = tuple(x.shape[b:])
    w = None if a.get("scale") is None else _t(a["scale"]).reshape(tail).to(x.dtype)
    bias = None if a.get("bias") is None else _t(a["bias"]).reshape(tail).to(x.dtype)
    ax = tuple(range(b, x.ndim))
    if not tail:  # nothing to normalise over: (x - x) / sqrt(eps), then the affine part
        out = torch.zeros_like(x)
        out = out if w is None else out * w
        out = out if bias is None else out + bias
        return (out, _stat_shape(_acc(x).clone(), c, 1), _stat_shape(torch.zeros(x.shape, device=x.device), c, 2))
    out = F.layer_norm(x, tail, w, bias, eps)
    var, mean = torch.var_mean(_acc(x), dim=ax, unbiased=False) if ax else (torch.zeros(x.shape, device=x.device),
                                                                             _acc(x).clone())
    return (out, _stat_shape(mean, c, 1), _stat_shape(var, c, 2))


_LN_STAT: dict[tuple[str, torch.dtype], torch.dtype] = {}


def _ln_stat_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype of the statistics torch's layer norm keeps for ``x`` on its device (a half
    input's are float32 on CUDA, its own dtype on the CPU): what its backward expects."""
    key = (x.device.type, x.dtype)
    if key not in _LN_STAT:
        probe = torch.zeros((1, 2), dtype=x.dtype, device=x.device)
        _LN_STAT[key] = torch.native_layer_norm(probe, [2], None, None, 1e-5)[1].dtype
    return _LN_STAT[key]


@register("layer_norm_grad")
def _k_layer_norm_grad(a: Args, c: Ctx) -> tuple[Any, ...]:
    x, g = _t(a["x"]), _t(a["out_grad"])
    b = _bna(a, x.ndim)
    eps = float(a.get("epsilon", 1e-5))
    bs, tail = tuple(x.shape[:b]), tuple(x.shape[b:])
    kshape = bs + (1,) * len(tail)
    mean = _acc(_t(a["mean"])).reshape(kshape)
    rstd = torch.rsqrt(_acc(_t(a["variance"])).reshape(kshape) + eps)
    w = None if a.get("scale") is None else _t(a["scale"]).reshape(tail).to(x.dtype)
    bias = None if a.get("bias") is None else _t(a["bias"]).reshape(tail).to(x.dtype)
    if not tail:  # x_hat is 0: no gradient to x or the scale, the bias gets the sum of out_grad
        return (torch.zeros_like(x), None if w is None else torch.zeros(1, dtype=g.dtype, device=g.device),
                None if bias is None else g.sum().reshape(1))
    mask = [True, w is not None, bias is not None]
    sd = _ln_stat_dtype(x)
    dx, dw, db = torch.ops.aten.native_layer_norm_backward(g.to(x.dtype), x, list(tail), mean.to(sd), rstd.to(sd), w,
                                                           bias, mask)
    n_tail = int(math.prod(tail)) if tail else 1
    return (dx, None if dw is None else dw.reshape(n_tail), None if db is None else db.reshape(n_tail))


@register("fused_rms_norm", "rms_norm")
def _k_rms_norm(a: Args, c: Ctx) -> tuple[Any, ...]:
    x = _t(a["x"])
    eps = float(a.get("epsilon", 1e-5))
    if x.ndim == 0:
        raise ValueError("rms_norm needs at least 1-D x")
    xf = _acc(x)
    inv = torch.rsqrt((xf * xf).mean(dim=-1, keepdim=True) + eps)
    out = (xf * inv).to(x.dtype)
    if a.get("scale") is not None:
        out = out * _t(a["scale"]).reshape(x.shape[-1:])
    return (out, _stat_shape(inv.reshape(x.shape[:-1]), c, 1))


@register("rms_norm_grad", "fused_rms_norm_grad")
def _k_rms_norm_grad(a: Args, c: Ctx) -> tuple[Any, ...]:
    x, g = _t(a["x"]), _t(a["out_grad"])
    xf, gf = _acc(x), _acc(g)
    inv = _acc(_t(a["invvar"])).reshape((*x.shape[:-1], 1))
    has_scale = a.get("scale") is not None
    scale = _acc(_t(a["scale"])).reshape(x.shape[-1:]) if has_scale else torch.ones(x.shape[-1:], device=x.device)
    gs = gf * scale
    m = (gs * xf).mean(dim=-1, keepdim=True)
    dx = inv * gs - xf * inv ** 3 * m
    dscale = (gf * xf * inv).reshape(-1, x.shape[-1]).sum(dim=0) if has_scale else None
    return (dx.to(x.dtype), None if dscale is None else dscale.to(g.dtype))


# -- matmul ----------------------------------------------------------------------------------------


@register("matmul", "matmul_v2", "bmm")
def _k_matmul(a: Args, c: Ctx) -> tuple[Any, ...]:
    return (matmul(_t(a["x"]), _t(a["y"]), bool(a.get("trans_x", False)), bool(a.get("trans_y", False))),)


@register("matmul_grad", "matmul_v2_grad")
def _k_matmul_grad(a: Args, c: Ctx) -> tuple[Any, ...]:
    return matmul_grad(_t(a["x"]), _t(a["y"]), _t(a["out_grad"]), bool(a.get("trans_x", False)),
                       bool(a.get("trans_y", False)))


# -- transpose, reshape and the views --------------------------------------------------------------


def _perm(perm: Any, ndim: int) -> list[int]:
    return [int(p) + ndim if int(p) < 0 else int(p) for p in perm]


@register("transpose", "transpose2")
def _k_transpose(a: Args, c: Ctx) -> tuple[Any, ...]:
    x = _t(a["x"])
    return (x.permute(_perm(a["perm"], x.ndim)).contiguous(),)


@register("transpose_grad")
def _k_transpose_grad(a: Args, c: Ctx) -> tuple[Any, ...]:
    g = _t(a["out_grad"])
    p = _perm(a["perm"], g.ndim)
    inv = [0] * len(p)
    for i, v in enumerate(p):
        inv[v] = i
    return (g.permute(inv).contiguous(),)


@register("reshape", "reshape2")
def _k_reshape(a: Args, c: Ctx) -> tuple[Any, ...]:
    from spmdkit.sim.refs.view import resolve_shape

    x = _t(a["x"])
    if not c.is_global and c.out_attrs:  # the localize hook's local target
        return (x.reshape(tuple(a["shape"])),)
    return (x.reshape(resolve_shape(a["shape"], tuple(x.shape))),)


def _view_kernel(name: str, shape_of: Callable[[Args, tuple[int, ...]], tuple[int, ...]]) -> Kernel:
    def fn(a: Args, c: Ctx) -> tuple[Any, ...]:
        x = _t(a[name])
        shape = shape_of(a, tuple(x.shape)) if c.is_global else tuple(a["shape"])
        return (x.reshape(shape),)

    return fn


def _view_grad_kernel(holder: str) -> Kernel:
    def fn(a: Args, c: Ctx) -> tuple[Any, ...]:
        g = _t(a["out_grad"])
        return (g.reshape(tuple(_t(a[holder]).shape) if c.is_global else tuple(a["shape"])),)

    return fn


def _register_views() -> None:
    from spmdkit.sim.refs import view as o

    for n, shape_of in (("flatten", o.flatten_shape), ("squeeze", o.squeeze_shape),
                        ("unsqueeze", o.unsqueeze_shape)):
        register(n, *(("unsqueeze2",) if n == "unsqueeze" else ()))(_view_kernel("x", shape_of))
    for n, holder in (("reshape_grad", "x_shape"), ("flatten_grad", "xshape"), ("squeeze_grad", "xshape"),
                      ("unsqueeze_grad", "x")):
        register(n)(_view_grad_kernel(holder))


_register_views()


# -- slice, expand, pad, split, concat -------------------------------------------------------------


def slice_index(shape: Sequence[int], axes: Any, starts: Any, ends: Any, strides: Any = None) -> tuple[slice, ...]:
    from spmdkit.sim.refs.slice import slice_index as idx

    return idx(tuple(shape), axes, starts, ends, strides)


@register("slice")
def _k_slice(a: Args, c: Ctx) -> tuple[Any, ...]:
    x = _t(a["input"])
    out = x[slice_index(x.shape, a["axes"], a["starts"], a["ends"])]
    dec = [int(d) + x.ndim if int(d) < 0 else int(d) for d in (a.get("decrease_axis") or ())]
    if dec:
        out = out.reshape(tuple(s for i, s in enumerate(out.shape) if i not in dec))
    return (out.contiguous(),)


@register("slice_grad")
def _k_slice_grad(a: Args, c: Ctx) -> tuple[Any, ...]:
    x, g = _t(a["input"]), _t(a["out_grad"])
    idx = slice_index(x.shape, a["axes"], a["starts"], a["ends"], a.get("strides"))
    out = torch.zeros(x.shape, dtype=g.dtype, device=g.device)
    out[idx] = g.reshape(out[idx].shape)
    return (out,)


@register("expand")
def _k_expand(a: Args, c: Ctx) -> tuple[Any, ...]:
    from spmdkit.sim.refs.slice import expand_target

    x = _t(a["x"])
    return (torch.broadcast_to(x, expand_target(a["shape"], tuple(x.shape))).contiguous(),)


@register("expand_grad", "expand_as_grad", "expand_as_v2_grad")
def _k_expand_grad(a: Args, c: Ctx) -> tuple[Any, ...]:
    return (sum_to_shape(_t(a["out_grad"]), _t(a["x"]).shape),)


@register("pad")
def _k_pad(a: Args, c: Ctx) -> tuple[Any, ...]:
    x = _t(a["x"])
    p = [int(v) for v in a["paddings"]]
    flat: list[int] = []
    for i in reversed(range(x.ndim)):  # F.pad: last dim first
        flat += [p[2 * i], p[2 * i + 1]]
    return (F.pad(x, flat, value=a.get("pad_value", 0)),)


def _sections(sections: Any, size: int) -> list[int]:
    s = [int(v) for v in sections]
    if -1 in s:
        s[s.index(-1)] = size - sum(v for v in s if v != -1)
    return s


@register("split")
def _k_split(a: Args, c: Ctx) -> tuple[Any, ...]:
    x = _t(a["x"])
    ax = _ax(a.get("axis", 0), x.ndim)
    return tuple(p.contiguous() for p in torch.split(x, _sections(a["sections"], x.shape[ax]), dim=ax))


@register("split_with_num")
def _k_split_with_num(a: Args, c: Ctx) -> tuple[Any, ...]:
    x = _t(a["x"])
    return tuple(p.contiguous() for p in torch.chunk(x, int(a["num"]), dim=_ax(a.get("axis", 0), x.ndim)))


def _concat_kernel(name: str) -> Kernel:
    def fn(a: Args, c: Ctx) -> tuple[Any, ...]:
        xs = [_t(t) for t in a[name]]
        return (torch.cat(xs, dim=_ax(a.get("axis", 0), xs[0].ndim)),)

    return fn


register("concat")(_concat_kernel("x"))
register("split_grad", "split_with_num_grad")(_concat_kernel("out_grad"))


@register("concat_grad")
def _k_concat_grad(a: Args, c: Ctx) -> tuple[Any, ...]:
    g = _t(a["output_grad"])
    ax = _ax(a.get("axis", 0), g.ndim)
    return tuple(p.contiguous() for p in torch.split(g, [_t(t).shape[ax] for t in a["x"]], dim=ax))


def _stack_kernel(name: str) -> Kernel:
    def fn(a: Args, c: Ctx) -> tuple[Any, ...]:
        xs = [_t(t) for t in a[name]]
        return (torch.stack(xs, dim=_ax(a.get("axis", 0), xs[0].ndim + 1)),)

    return fn


def _unbind_kernel(name: str) -> Kernel:
    def fn(a: Args, c: Ctx) -> tuple[Any, ...]:
        x = _t(a[name])
        return tuple(v.clone() for v in torch.unbind(x, dim=_ax(a.get("axis", 0), x.ndim)))

    return fn


register("stack")(_stack_kernel("x"))
register("unbind_grad")(_stack_kernel("out_grad"))
register("unbind")(_unbind_kernel("x"))
register("stack_grad")(_unbind_kernel("output_grad"))


@register("add_n_grad")
def _k_add_n_grad(a: Args, c: Ctx) -> tuple[Any, ...]:
    g = _t(a["out_grad"])
    return tuple(g.clone() for _ in a["inputs"])


@register("tile")
def _k_tile(a: Args, c: Ctx) -> tuple[Any, ...]:
    return (torch.tile(_t(a["x"]), tuple(int(v) for v in a["repeat_times"])),)


@register("tile_grad")
def _k_tile_grad(a: Args, c: Ctx) -> tuple[Any, ...]:
    x, g = _t(a["x"]), _t(a["out_grad"])
    lead = g.ndim - x.ndim
    g = g.sum(dim=tuple(range(lead))) if lead else g
    if 0 in x.shape:
        return (torch.zeros(x.shape, dtype=g.dtype, device=g.device),)
    shp: list[int] = []
    for sx, sg in zip(x.shape, g.shape):  # the repeats this rank sees: local out_grad / local x
        shp += [sg // sx, sx]
    return (g.reshape(shp).sum(dim=tuple(range(0, 2 * x.ndim, 2))),)


@register("expand_as", "expand_as_v2")
def _k_expand_as(a: Args, c: Ctx) -> tuple[Any, ...]:
    from spmdkit.sim.refs.slice import expand_target

    x = _t(a["x"])
    tgt = tuple(_t(a["y"]).shape) if a.get("y") is not None else expand_target(a["target_shape"], tuple(x.shape))
    return (torch.broadcast_to(x, tgt).contiguous(),)


def _like_kernel(value: float | None) -> Kernel:
    def fn(a: Args, c: Ctx) -> tuple[Any, ...]:
        x = _t(a["x"])
        v = float(a.get("y", 0.0)) if value is None else value
        return (torch.full(x.shape, v, dtype=torch.float64, device=x.device),)

    return fn


register("empty_like", "zeros_like")(_like_kernel(0.0))
register("ones_like")(_like_kernel(1.0))


@register("numel")
def _k_numel(a: Args, c: Ctx) -> tuple[Any, ...]:
    x = _t(a["x"])
    return (torch.tensor(x.numel(), dtype=torch.int64, device=x.device),)


def _put_along_kernel(a: Args, c: Ctx) -> tuple[Any, ...]:
    """topk_grad / argsort_grad: out_grad put back where the indices took it from."""
    x, g = _fl(a["x"]), _t(a["out_grad"])
    if x.ndim == 0:
        return (g.clone(),)
    ax = _ax(a.get("axis", -1), x.ndim)
    out = torch.zeros(x.shape, dtype=g.dtype, device=g.device)
    return (out.scatter(ax, _t(a["indices"]).to(torch.int64), g),)


register("topk_grad", "argsort_grad")(_put_along_kernel)


@register("cumsum_grad")
def _k_cumsum_grad(a: Args, c: Ctx) -> tuple[Any, ...]:
    x = _t(a["x"])
    flatten = bool(a.get("flatten", False))
    args = {"x": _t(a["out_grad"]), "axis": 0 if flatten else a.get("axis", -1), "flatten": False,
            "exclusive": bool(a.get("exclusive", False)), "reverse": not bool(a.get("reverse", False))}
    return (_k_cumsum(args, c)[0].reshape(x.shape),)


@register("index_put_grad")
def _k_index_put_grad(a: Args, c: Ctx) -> tuple[Any, ...]:
    g = _t(a["out_grad"])
    idx = tuple(_t(t).to(torch.int64) for t in a["indices"])
    gx = g.clone()
    if not bool(a.get("accumulate", False)):
        gx[idx] = 0.0
    return gx, sum_to_shape(g[idx], _t(a["value"]).shape)


# -- embedding, one_hot, gathers ---------------------------------------------------------------------


def _lookup(ids: torch.Tensor, w: torch.Tensor, start: int, padding_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = ids.to(torch.int64) - start
    ok = (idx >= 0) & (idx < w.shape[0])
    if padding_idx >= 0:
        ok &= ids != padding_idx
    return torch.where(ok, idx, torch.zeros_like(idx)), ok


@register("embedding", "lookup_table_v2")
def _k_embedding(a: Args, c: Ctx) -> tuple[Any, ...]:
    w = _t(a["weight"])
    idx, ok = _lookup(_t(a["x"]), w, int(a.get("_row_start", 0)), int(a.get("padding_idx", -1)))
    return (F.embedding(idx, w) * ok.unsqueeze(-1).to(w.dtype),)


@register("embedding_grad", "lookup_table_v2_grad")
def _k_embedding_grad(a: Args, c: Ctx) -> tuple[Any, ...]:
    w, g = _t(a["weight"]), _t(a["out_grad"])
    idx, ok = _lookup(_t(a["x"]), w, int(a.get("_row_start", 0)), int(a.get("padding_idx", -1)))
    out = torch.zeros(w.shape, dtype=g.dtype, device=g.device)
    out.index_add_(0, idx[ok], g[ok])
    return (out,)


@register("c_embedding")
def _k_c_embedding(a: Args, c: Ctx) -> tuple[Any, ...]:
    w = _t(a["weight"])
    idx, ok = _lookup(_t(a["x"]), w, int(a.get("start_index", 0)) + int(a.get("_row_start", 0)), -1)
    return (F.embedding(idx, w) * ok.unsqueeze(-1).to(w.dtype),)


@register("c_embedding_grad")
def _k_c_embedding_grad(a: Args, c: Ctx) -> tuple[Any, ...]:
    w, g = _t(a["weight"]), _t(a["out_grad"])
    idx, ok = _lookup(_t(a["x"]), w, int(a.get("start_index", 0)) + int(a.get("_row_start", 0)), -1)
    out = torch.zeros(w.shape, dtype=g.dtype, device=g.device)
    out.index_add_(0, idx[ok], g[ok])
    return (out,)


@register("one_hot")
def _k_one_hot(a: Args, c: Ctx) -> tuple[Any, ...]:
    i = _t(a["x"]).to(torch.int64)
    n = int(a["num_classes"])
    ok = (i >= 0) & (i < n)
    return (F.one_hot(torch.where(ok, i, torch.zeros_like(i)), n) * ok.unsqueeze(-1),)


def _fold(idx: torch.Tensor, size: int) -> torch.Tensor:
    if size <= 0:
        return torch.zeros_like(idx)
    return torch.remainder(idx, size)


def _flat_index(index: Any) -> torch.Tensor:
    i = _t(index).to(torch.int64)
    return i.reshape(-1) if i.ndim == 2 else i


@register("index_select", "gather")
def _k_index_select(a: Args, c: Ctx) -> tuple[Any, ...]:
    x = _t(a["x"])
    ax = _ax(a.get("axis", 0), x.ndim)
    idx = _fold(_flat_index(a["index"]), x.shape[ax])
    if idx.ndim == 0:
        return (torch.select(x, ax, int(idx)).clone(),)
    return (torch.index_select(x, ax, idx),)


@register("index_select_grad", "gather_grad")
def _k_index_select_grad(a: Args, c: Ctx) -> tuple[Any, ...]:
    x, g = _t(a["x"]), _t(a["out_grad"])
    ax = _ax(a.get("axis", 0), x.ndim)
    idx = _fold(_flat_index(a["index"]), x.shape[ax])
    out = torch.zeros(x.shape, dtype=g.dtype, device=g.device)
    if idx.ndim == 0:
        out.select(ax, int(idx)).add_(g)
    else:
        out.index_add_(ax, idx, g)
    return (out,)


def _crop(x: torch.Tensor, shape: Sequence[int], ax: int) -> tuple[slice, ...]:
    if len(shape) != x.ndim:
        raise ValueError("index must have x's number of dims")
    return tuple(slice(None) if i == ax else slice(0, shape[i]) for i in range(x.ndim))


@register("take_along_axis")
def _k_take_along_axis(a: Args, c: Ctx) -> tuple[Any, ...]:
    x, idx = _t(a["x"]), _t(a["index"]).to(torch.int64)
    ax = _ax(a.get("axis", 0), x.ndim)
    return (torch.take_along_dim(x[_crop(x, idx.shape, ax)], idx, dim=ax),)


@register("take_along_axis_grad")
def _k_take_along_axis_grad(a: Args, c: Ctx) -> tuple[Any, ...]:
    x, idx, g = _t(a["x"]), _t(a["index"]).to(torch.int64), _t(a["out_grad"])
    ax = _ax(a.get("axis", 0), x.ndim)
    out = torch.zeros(x.shape, dtype=g.dtype, device=g.device)
    out[_crop(x, idx.shape, ax)].scatter_add_(ax, idx, g)
    return (out,)


@register("index_put")
def _k_index_put(a: Args, c: Ctx) -> tuple[Any, ...]:
    x = _t(a["x"])
    idx = tuple(_t(t).to(torch.int64) for t in a["indices"])
    v = _t(a["value"]).to(x.dtype)
    return (torch.index_put(x, idx, torch.broadcast_to(v, x[idx].shape), accumulate=bool(a.get("accumulate", False))),)


# -- sorting and scans -----------------------------------------------------------------------------


@register("topk")
def _k_topk(a: Args, c: Ctx) -> tuple[Any, ...]:
    x = _t(a["x"])
    ax = _ax(a.get("axis", -1), x.ndim)
    largest = bool(a.get("largest", True))
    order = torch.sort(x, dim=ax, descending=largest, stable=True).indices
    idx = order.narrow(ax, 0, int(a.get("k", 1)))
    return (torch.take_along_dim(x, idx, dim=ax), idx)


@register("argsort")
def _k_argsort(a: Args, c: Ctx) -> tuple[Any, ...]:
    x = _t(a["x"])
    if x.ndim == 0:
        return (x.clone(), torch.zeros((), dtype=torch.int64, device=x.device))
    ax = _ax(a.get("axis", -1), x.ndim)
    s = torch.sort(x, dim=ax, descending=bool(a.get("descending", False)), stable=True)
    return (s.values, s.indices)


@register("cumsum")
def _k_cumsum(a: Args, c: Ctx) -> tuple[Any, ...]:
    x = _t(a["x"])
    if a.get("flatten", False):
        x, ax = x.reshape(-1), 0
    elif x.ndim == 0:
        return (x.clone(),)
    else:
        ax = _ax(a.get("axis", -1), x.ndim)
    rev = bool(a.get("reverse", False))
    if rev:
        x = torch.flip(x, (ax,))
    out = torch.cumsum(x, dim=ax)
    if a.get("exclusive", False):
        out = out - x
    if rev:
        out = torch.flip(out, (ax,))
    return (out,)


# -- fused ops: swiglu, rotary embedding -------------------------------------------------------------


def _halves(a: Args) -> tuple[torch.Tensor, torch.Tensor | None]:
    x = _t(a["x"])
    y = a.get("y")
    if y is not None and _t(y).ndim == 0 and x.ndim > 0:
        y = None
    return x, None if y is None else _t(y)


def _swiglu_fn(x: torch.Tensor, y: torch.Tensor | None) -> torch.Tensor:
    if y is None:
        u, w = x.chunk(2, dim=-1)
        return F.silu(u) * w
    return F.silu(x) * y


@register("swiglu")
def _k_swiglu(a: Args, c: Ctx) -> tuple[Any, ...]:
    x, y = _halves(a)
    return (_swiglu_fn(x, y),)


@register("swiglu_grad")
def _k_swiglu_grad(a: Args, c: Ctx) -> tuple[Any, ...]:
    x, y = _halves(a)
    dx, dy = vjp(_swiglu_fn, [x, y], _t(a["out_grad"]))
    return (dx, dy)


def _opt(a: Args, name: str) -> Any:
    v = a.get(name)
    return None if v is None or _t(v).ndim == 0 else _t(v)


register("fused_rotary_position_embedding", "fused_rope")(lambda a, c: rope(a, TORCH))
register("fused_rotary_position_embedding_grad", "fused_rope_grad")(lambda a, c: rope(a, TORCH, grad=True))


# -- flash_attention: torch's scaled_dot_product_attention on Paddle's [b, s, h, d] layout --------------


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool
               ) -> torch.Tensor:
    hq, hk = q.shape[2], k.shape[2]
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if hk and hq != hk:
        kt = kt.repeat_interleave(hq // hk, dim=1)
        vt = vt.repeat_interleave(hq // hk, dim=1)
    if causal and mask is None and q.shape[1] == k.shape[1]:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
    else:
        m = None if mask is None else mask.to(q.dtype)
        if causal:
            tri = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool, device=q.device).tril()
            neg = torch.zeros(tri.shape, dtype=q.dtype, device=q.device).masked_fill(~tri, -math.inf)
            m = neg if m is None else m + neg
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=m)
    return out.transpose(1, 2)


def _lse(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
    hq, hk = q.shape[2], k.shape[2]
    ke = k.repeat_interleave(hq // hk, dim=2) if hk and hq != hk else k
    s = torch.einsum("bshd,bthd->bhst", _acc(q), _acc(ke)) / math.sqrt(q.shape[3] or 1)
    if mask is not None:
        s = s + _acc(mask)
    if causal:
        tri = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~tri, -math.inf)
    return torch.logsumexp(s, dim=-1)


@register("flash_attention")
def _k_flash_attention(a: Args, c: Ctx) -> tuple[Any, ...]:
    q, k, v = _t(a["q"]), _t(a["k"]), _t(a["v"])
    mask, causal = _opt(a, "attn_mask"), bool(a.get("causal"))
    out = _attention(q, k, v, mask, causal)
    if a.get("return_softmax"):
        raise ValueError("flash_attention: return_softmax has no torch kernel")
    seed = torch.zeros(2, dtype=torch.int64, device=q.device)
    return (out, None, _lse(q, k, mask, causal), seed)


@register("flash_attention_grad")
def _k_flash_attention_grad(a: Args, c: Ctx) -> tuple[Any, ...]:
    q, k, v = _t(a["q"]), _t(a["k"]), _t(a["v"])
    mask, causal = _opt(a, "attn_mask"), bool(a.get("causal"))
    dq, dk, dv = vjp(lambda q_, k_, v_: _attention(q_, k_, v_, mask, causal), [q, k, v], _t(a["out_grad"]))
    return (dq, dk, dv)


# -- losses ------------------------------------------------------------------------------------------


def _ce(x: torch.Tensor, label: torch.Tensor, ignore_index: int, ax: int, soft: bool, use_softmax: bool
        ) -> tuple[torch.Tensor, torch.Tensor]:
    if use_softmax:
        logsm = torch.log_softmax(x, dim=ax)
        sm = torch.exp(logsm)
    else:
        sm, logsm = x.clone(), torch.log(x)
    if soft:
        return sm, -(label.to(x.dtype) * logsm).sum(dim=ax, keepdim=True)
    lab = label.to(torch.int64)
    valid = lab != ignore_index
    idx = torch.clamp(lab, 0, max(x.shape[ax] - 1, 0))
    picked = torch.take_along_dim(logsm, idx, dim=ax)
    return sm, torch.where(valid, -picked, torch.zeros_like(picked))


def _ce_grad(label: torch.Tensor, sm: torch.Tensor, g: torch.Tensor, ignore_index: int, ax: int, soft: bool,
             use_softmax: bool, class_start: int = 0) -> torch.Tensor:
    if soft:
        lab_f = label.to(sm.dtype)
        return (sm - lab_f) * g if use_softmax else -lab_f / sm * g
    lab = label.to(torch.int64)
    valid = lab != ignore_index
    shape = [1] * sm.ndim
    shape[ax] = sm.shape[ax]
    classes = torch.arange(class_start, class_start + sm.shape[ax], device=sm.device).reshape(shape)
    onehot = (lab == classes).to(sm.dtype)
    out = (sm - onehot) * g if use_softmax else -onehot / sm * g
    return torch.where(valid, out, torch.zeros_like(out))


@register("cross_entropy_with_softmax", "softmax_with_cross_entropy")
def _k_ce(a: Args, c: Ctx) -> tuple[Any, ...]:
    x = _t(a["x"])
    return _ce(x, _t(a["label"]), int(a.get("ignore_index", -100)), _ax(a.get("axis", -1), x.ndim),
               bool(a.get("soft_label", False)), bool(a.get("use_softmax", True)))


@register("cross_entropy_with_softmax_grad", "softmax_with_cross_entropy_grad")
def _k_ce_grad(a: Args, c: Ctx) -> tuple[Any, ...]:
    sm = _t(a["softmax"])
    return (_ce_grad(_t(a["label"]), sm, _t(a["loss_grad"]), int(a.get("ignore_index", -100)),
                     _ax(a.get("axis", -1), sm.ndim), bool(a.get("soft_label", False)),
                     bool(a.get("use_softmax", True))),)


@register("c_softmax_with_cross_entropy")
def _k_c_softmax(a: Args, c: Ctx) -> tuple[Any, ...]:
    """The class axis sharded: the max, the sum of exponentials and the label's logit
    all-reduced over the mesh dims that shard it (``Ctx.comm``), as Megatron's kernel does."""
    from spmdkit.core.dist_attr import entry_dims
    from spmdkit.sim.refs.loss import class_start

    x = _t(a["x"])
    ig = int(a.get("ignore_index", -100))
    if c.is_global:
        return _ce(x, _t(a["label"]), ig, x.ndim - 1, False, True)
    if c.comm is None:
        raise ValueError("c_softmax_with_cross_entropy: a rank's torch kernel needs Ctx.comm (the class group)")
    dims = entry_dims(c.in_attrs["x"].dims_mapping[-1])
    start = class_start(c, "x")
    m = c.comm.all_reduce(torch.amax(x, dim=-1, keepdim=True), dims, "max")
    e = torch.exp(x - m)
    s = c.comm.all_reduce(e.sum(dim=-1, keepdim=True), dims, "sum")
    lab = _t(a["label"]).to(torch.int64)
    valid = lab != ig
    loc = torch.clamp(lab, 0, max(int(c.shapes["x"][-1]) - 1, 0)) - start
    mine = (loc >= 0) & (loc < x.shape[-1])
    picked = torch.take_along_dim(x, torch.clamp(loc, 0, max(x.shape[-1] - 1, 0)), dim=-1)
    xl = c.comm.all_reduce(torch.where(mine, picked, torch.zeros_like(picked)), dims, "sum")
    loss = -(xl - m - torch.log(s))
    return e / s, torch.where(valid, loss, torch.zeros_like(loss))


@register("c_softmax_with_cross_entropy_grad")
def _k_c_softmax_grad(a: Args, c: Ctx) -> tuple[Any, ...]:
    sm = _t(a["softmax"])
    return (_ce_grad(_t(a["label"]), sm, _t(a["loss_grad"]), int(a.get("ignore_index", -100)), sm.ndim - 1, False,
                     True, int(a.get("_class_start", 0))),)


# -- convolutions (1-3 spatial dims; autograd for the gradients) -------------------------------------


def _conv_fn(a: Args) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    from spmdkit.sim.refs.conv import channels_last, conv_geometry

    last = channels_last(a)
    groups = int(a.get("groups", 1))

    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xc = x.movedim(-1, 1) if last else x
        nsp = xc.ndim - 2
        st, pads, dil = conv_geometry(tuple(xc.shape[2:]), tuple(w.shape[2:]), a, nsp)
        flat: list[int] = []
        for lo, hi in reversed(pads):
            flat += [lo, hi]
        xp = F.pad(xc, flat) if any(flat) else xc
        conv = (F.conv1d, F.conv2d, F.conv3d)[nsp - 1]
        y = conv(xp, w.to(xc.dtype), None, st, 0, dil, groups)
        return y.movedim(1, -1) if last else y

    return fn


@register("conv1d", "conv2d", "conv3d")
def _k_conv(a: Args, c: Ctx) -> tuple[Any, ...]:
    return (_conv_fn(a)(_t(a["input"]), _t(a["filter"])),)


@register("conv1d_grad", "conv2d_grad", "conv3d_grad")
def _k_conv_grad(a: Args, c: Ctx) -> tuple[Any, ...]:
    gx, gw = vjp(_conv_fn(a), [_t(a["input"]), _t(a["filter"])], _t(a["output_grad"]))
    return (gx, gw)


# -- optimizers ----------------------------------------------------------------------------------------


def _scalar(x: Any) -> float:
    return float(_t(x).reshape(-1)[0].item())


def _adam_kernel(decoupled: bool) -> Kernel:
    """Adam / AdamW as Paddle's kernel computes them (the reference's update, in torch): the
    moments in their own dtype, a float32 master copy updated where given (multi-precision:
    the parameter is then the master rounded to its dtype)."""

    def fn(a: Args, c: Ctx) -> tuple[Any, ...]:
        amsgrad = bool(a.get("amsgrad", False))
        b1, b2 = float(a.get("beta1", 0.9)), float(a.get("beta2", 0.999))
        lr = _scalar(a["learning_rate"])
        b1p, b2p = _t(a["beta1_pow"]), _t(a["beta2_pow"])
        m1, m2 = _t(a["moment1"]), _t(a["moment2"])
        g = _t(a["grad"]).to(m1.dtype)
        m2max = a.get("moment2_max")
        master = a.get("master_param")
        use_master = master is not None and bool(a.get("multi_precision", False))
        p0 = _t(a["param"])
        skip = a.get("skip_update")
        if skip is not None and _t(skip).numel() and bool(_t(skip).reshape(-1)[0]):
            mm = _t(m2max).clone() if amsgrad and m2max is not None else None
            return (p0.clone(), m1.clone(), m2.clone(), mm, b1p.clone(), b2p.clone(),
                    None if master is None else _t(master).clone())

        def update(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
            return adam_update(p, g, m1, m2, _t(m2max) if amsgrad and m2max is not None else None, a, decoupled,
                               lr, _scalar(b1p), _scalar(b2p), TORCH)

        mo = None
        if master is not None:
            mo, m1o, m2o, m2mo = update(_t(master))
        if use_master:
            assert mo is not None
            po = mo.to(p0.dtype)
        else:
            po, m1o, m2o, m2mo = update(p0)
        if a.get("use_global_beta_pow", False):
            b1o, b2o = b1p.clone(), b2p.clone()
        else:
            b1o, b2o = b1p * b1, b2p * b2
        return po, m1o, m2o, m2mo, b1o, b2o, mo

    return fn


register("adam", "adam_")(_adam_kernel(False))
register("adamw", "adamw_")(_adam_kernel(True))


@register("sgd", "sgd_")
def _k_sgd(a: Args, c: Ctx) -> tuple[Any, ...]:
    lr = _scalar(a["learning_rate"])
    g = _t(a["grad"])
    master = a.get("master_param")
    mo = None if master is None else _t(master) - lr * g.to(_t(master).dtype)
    if mo is not None and a.get("multi_precision", False):
        return mo.to(_t(a["param"]).dtype), mo
    return (_t(a["param"]) - lr * g, mo)


def reference_of(rule: str) -> Reference | None:
    """The numpy reference whose localize hook a kernel shares."""
    return get_reference(rule)


__all__ = ["BINARY", "DTYPES", "KERNELS", "NoTorchKernelError", "REDUCTIONS", "TORCH", "UNARY", "check_kernels",
           "get_kernel", "kernel_names", "missing_kernels", "register", "run_kernel", "sum_to_shape", "vjp"]
