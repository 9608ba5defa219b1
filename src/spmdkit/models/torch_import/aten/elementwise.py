"""Lowerings of ATen ops to the ``elementwise`` family's rules (:mod:`spmdkit.ops.elementwise`):
contiguous / clone / alias / detach (the input itself), arithmetic and comparisons (a Python scalar
operand a 0-d constant), the unary ops (same names), gelu, pow, casts, dropout (eval or p=0 only),
clamp, isinf / isnan; complex numbers as their real parts (a trailing axis of 2: ``polar``,
``view_as_complex`` / ``view_as_real``, a complex product), as Llama 4's rotary embedding uses them."""

from __future__ import annotations

from typing import Any

import torch

from spmdkit.models.torch_import.context import Hook, ImportContext


def _identity(c: ImportContext) -> Any:
    return c.args[0]


def _binary(rule: str, negate: bool = False) -> Hook:
    """``rule(x, y)`` (``logical_not`` of it where ``negate``); a Python scalar operand becomes a
    0-d constant of the other operand's dtype; arithmetic on mixed dtypes casts to the result's."""

    def h(c: ImportContext) -> Any:
        x, y = c.args[0], c.args[1]
        if c.is_complex(0) or c.is_complex(1):
            return _complex(c, rule)
        alpha = c.kwargs.get("alpha", 1)
        if rule == "subtract" and c.target.startswith("aten.rsub"):
            x, y = y, x
        od = c.out_dtype()
        arith = od.startswith(("float", "bfloat")) and od != "bool"
        if alpha != 1:
            y = c.emit1("multiply", {"x": y, "y": alpha},
                        (c.fresh("alpha"), c.shape(y) if c.is_tensor(y) else (), c.out_dtype()))
        if rule == "divide" and not c.is_tensor(y):
            return c.emit1("multiply", {"x": x, "y": 1.0 / float(y)})
        other = x if c.is_tensor(x) else y
        cd = od if arith or not c.is_tensor(other) else c.dtype(other)
        ins = {}
        for k, v in (("x", x), ("y", y)):
            if arith and c.is_tensor(v) and c.dtype(v) != od:
                v = c.emit1("cast", {"x": v}, (c.fresh("cast"), c.shape(v), od), dtype=od)
            ins[k] = v if c.is_tensor(v) else c.tensor(v, cd)
        if negate:
            t = c.emit1(rule, ins, c.fresh("neg"))
            return c.emit1("logical_not", {"x": t})
        if ins["x"] == ins["y"] and rule in ("multiply", "add"):  # x * x, x + x: one read of x
            if rule == "multiply":
                return c.emit1("square", {"x": ins["x"]})
            return c.emit1("multiply", {"x": ins["x"], "y": c.tensor(2.0, od)})
        return c.emit1(rule, ins)
    return h


def _complex(c: ImportContext, rule: str) -> Any:
    """Arithmetic on complex tensors held as their parts ``[..., 2]``: a real scalar or a real
    tensor scales both parts; complex by complex: ``add`` / ``subtract`` part-wise, ``multiply``
    ``(a + bi)(c + di) = (ac - bd) + (ad + bc)i`` (the parts sliced off, the result stacked)."""
    x, y = c.args[0], c.args[1]
    od = c.out_dtype()
    cx, cy = c.is_complex(0), c.is_complex(1)
    if c.kwargs.get("alpha", 1) != 1:
        raise c.unsupported("complex arithmetic with alpha")
    if not (cx and cy):
        if rule != "multiply" and not (rule == "divide" and cx):
            raise c.unsupported(f"{rule} of a complex and a real tensor")
        z, r = (x, y) if cx else (y, x)
        if rule == "divide":
            r = 1.0 / float(r) if not c.is_tensor(r) else c.emit1("reciprocal", {"x": r}, (c.fresh("inv"), c.shape(r), od))
        if c.is_tensor(r):
            rs = c.shape(r)
            r = c.reshape(r, (*rs, 1), c.fresh("col"))
        return c.emit1("multiply", {"x": z, "y": r if c.is_tensor(r) else c.tensor(float(r), od)})
    if rule in ("add", "subtract"):
        return c.emit1(rule, {"x": x, "y": y})
    if rule != "multiply":
        raise c.unsupported(f"complex {rule}")

    def parts(v: Any) -> tuple[Any, Any]:
        vs = c.shape(v)
        got = []
        for k in (0, 1):
            got.append(c.emit1("slice", {"input": v}, (c.fresh("re" if k == 0 else "im"), vs[:-1], c.dtype(v)),
                               axes=(len(vs) - 1,), starts=(k,), ends=(k + 1,), decrease_axis=(len(vs) - 1,)))
        return got[0], got[1]

    (a, b), (p, q) = parts(x), parts(y)
    half = c.out_shape()[:-1]

    def prod(u: Any, v: Any, tag: str) -> Any:
        return c.emit1("multiply", {"x": u, "y": v}, (c.fresh(tag), half, od))

    re = c.emit1("subtract", {"x": prod(a, p, "ac"), "y": prod(b, q, "bd")}, (c.fresh("real"), half, od))
    im = c.emit1("add", {"x": prod(a, q, "ad"), "y": prod(b, p, "bc")}, (c.fresh("imag"), half, od))
    return c.emit1("stack", {"x": (re, im)}, axis=len(half))


def _polar(c: ImportContext) -> Any:
    """``polar(abs, angle)``: ``abs * cos(angle) + i abs * sin(angle)`` as its parts ``[..., 2]``."""
    r, th = c.args[0], c.args[1]
    half, od = c.out_shape()[:-1], c.out_dtype()
    got = []
    for fn in ("cos", "sin"):
        t = c.emit1(fn, {"x": th}, (c.fresh(fn), half, od))
        got.append(c.emit1("multiply", {"x": r, "y": t}, (c.fresh(fn + "_part"), half, od)))
    return c.emit1("stack", {"x": tuple(got)}, axis=len(half))


def _softplus(c: ImportContext) -> Any:
    """``softplus`` with beta 1 (Mamba's time step); its threshold (linear above 20) differs from
    log(1 + exp(x)) by under exp(-20) relative, below float32's rounding."""
    if float(c.arg(1, "beta", 1)) != 1.0:
        raise c.unsupported("softplus with beta other than 1")
    return c.emit1("softplus", {"x": c.args[0]})


def _neg(c: ImportContext) -> Any:
    return c.emit1("multiply", {"x": c.args[0], "y": -1.0})


def _unary(rule: str) -> Hook:
    def h(c: ImportContext) -> Any:
        return c.emit1(rule, {"x": c.args[0]})
    return h


def _gelu(c: ImportContext) -> Any:
    approx = c.kwargs.get("approximate", c.args[1] if len(c.args) > 1 else "none")
    return c.emit1("gelu", {"x": c.args[0]}, approximate=approx == "tanh")


def _pow(c: ImportContext) -> Any:
    x, e = c.args[0], c.args[1]
    if c.is_tensor(e) or not c.is_tensor(x):
        return c.emit1("elementwise_pow", {"x": x, "y": e})
    e = float(e)
    if e == 1.0:
        return c.tensor(x)
    named = {2.0: "square", 0.5: "sqrt", -0.5: "rsqrt", -1.0: "reciprocal"}
    if e in named:
        return c.emit1(named[e], {"x": x})
    return c.emit1("elementwise_pow", {"x": x, "y": e})


def _cast(c: ImportContext) -> Any:
    x = c.args[0]
    od = c.out_dtype()
    if not c.is_tensor(x) or c.dtype(x) == od:
        return x if not isinstance(x, torch.Tensor) else c.tensor(x)
    return c.emit1("cast", {"x": x}, dtype=od)


def _dropout(c: ImportContext) -> Any:
    p = float(c.arg(1, "p", 0.5))
    train = c.arg(2, "train", True)
    if p == 0.0 or not train:
        return c.args[0]
    raise c.unsupported("dropout in training mode (export the module in eval mode, or p=0)")


def _clamp(c: ImportContext) -> Any:
    """``clamp`` / ``clip`` / ``clamp_min`` / ``clamp_max``: ``where(x < lo, lo, x)`` then
    ``where(x > hi, hi, .)``: the gradient reaches x where lo <= x <= hi, as torch's does
    (``maximum`` / ``minimum`` would give it to the bound at a tie); NaN passes through."""
    x = c.args[0]
    if c.target.startswith("aten.clamp_min"):
        lo, hi = c.args[1], None
    elif c.target.startswith("aten.clamp_max"):
        lo, hi = None, c.args[1]
    else:
        lo, hi = c.arg(1, "min"), c.arg(2, "max")
    xs, od = c.shape(x), c.out_dtype()
    cur: Any = x
    for bound, rule, tag in ((lo, "less_than", "lo"), (hi, "greater_than", "hi")):
        if bound is None:
            continue
        b = c.tensor(bound, od)
        out_of = c.emit1(rule, {"x": cur, "y": b}, (c.fresh(f"below_{tag}" if tag == "lo" else f"above_{tag}"),
                                                    xs, "bool"))
        last = tag == "hi" or hi is None
        cur = c.emit1("where", {"condition": out_of, "x": b, "y": cur}, None if last else (c.fresh("clamped"), xs, od))
    return cur if cur is not x else c.tensor(x)


def _isinf(c: ImportContext) -> Any:
    """``isinf(x)``: not (x != inf and x != -inf); ``isnan``: ``x != x``."""
    x = c.args[0]
    xs = c.shape(x)
    if c.target.startswith("aten.isnan"):
        return c.emit1("not_equal", {"x": x, "y": x})
    pos = c.emit1("not_equal", {"x": x, "y": c.tensor(float("inf"), c.dtype(x))}, (c.fresh("not_pos_inf"), xs, "bool"))
    neg = c.emit1("not_equal", {"x": x, "y": c.tensor(float("-inf"), c.dtype(x))}, (c.fresh("not_neg_inf"), xs, "bool"))
    fin = c.emit1("logical_and", {"x": pos, "y": neg}, (c.fresh("not_inf"), xs, "bool"))
    return c.emit1("logical_not", {"x": fin})


def _table() -> dict[str, Hook]:
    t: dict[str, Hook] = {}
    for k in ("contiguous", "clone", "alias", "detach", "lift_fresh_copy", "lift_fresh", "_assert_tensor_metadata"):
        t["aten." + k] = _identity
    t["aten.add"] = _binary("add")
    t["aten.sub"] = t["aten.rsub"] = _binary("subtract")
    t["aten.mul"] = _binary("multiply")
    t["aten.div"] = _binary("divide")
    t["aten.neg"] = _neg
    for k, r in (("ne", "not_equal"), ("lt", "less_than"), ("gt", "greater_than"), ("logical_and", "logical_and"),
                 ("logical_or", "logical_or"), ("bitwise_and", "bitwise_and"), ("bitwise_or", "bitwise_or"),
                 ("maximum", "maximum"), ("minimum", "minimum"), ("__or__", "bitwise_or"),
                 ("__and__", "bitwise_and"), ("floor_divide", "floor_divide"), ("remainder", "remainder")):
        t["aten." + k] = _binary(r)
    for k, r in (("eq", "not_equal"), ("le", "greater_than"), ("ge", "less_than")):
        t["aten." + k] = _binary(r, negate=True)
    for k in ("relu", "tanh", "exp", "rsqrt", "sqrt", "sigmoid", "silu", "log", "abs", "sin", "cos", "erf",
              "reciprocal", "square", "bitwise_not", "logical_not"):
        t["aten." + k] = _unary(k)
    t["aten.gelu"] = _gelu
    t["aten.pow"] = _pow
    t["aten._to_copy"] = t["aten.to"] = t["aten.type_as"] = _cast
    t["aten.dropout"] = _dropout
    t["aten.clamp"] = t["aten.clip"] = t["aten.clamp_min"] = t["aten.clamp_max"] = _clamp
    t["aten.isinf"] = t["aten.isnan"] = _isinf
    t["aten.polar"] = _polar
    t["aten.softplus"] = _softplus
    t["aten.view_as_complex"] = t["aten.view_as_real"] = _identity
    return t


#: ATen op (packet or overload) -> its lowering
ATEN = _table()
