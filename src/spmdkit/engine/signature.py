"""Rule signatures: parsing, attribute coercion and argument binding (:class:`Mode`).

Signatures are strings in Paddle 3.3.1's parameter order, e.g. ``"x: T, y: T, trans_x: bool = False"``.
Kinds: ``T`` a tensor (DistTensorSpec), ``T?`` an optional tensor (``None`` when
absent), ``[T]`` a list of tensors, ``[T?]`` a list whose items may be absent; attributes: ``bool``, ``int``,
``float``, ``str``, ``ints`` (a list of ints; a single int is taken as a
one-item list), ``floats``, ``scalar`` (int or float), ``any``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from spmdkit.core.errors import InvalidArgumentError, InvalidAttributeError
from spmdkit.core.spec import DistTensorSpec, SpmdResult

RuleFn = Callable[..., SpmdResult]

_NO_DEFAULT = object()


@dataclass(frozen=True)
class Param:
    name: str
    kind: str
    default: Any = _NO_DEFAULT

    @property
    def is_tensor(self) -> bool:
        return self.kind in ("T", "T?", "[T]", "[T?]")

    @property
    def required(self) -> bool:
        return self.default is _NO_DEFAULT


_ATTR_KINDS = {"bool", "int", "float", "str", "ints", "floats", "scalar", "any"}
_TENSOR_KINDS = {"T", "T?", "[T]", "[T?]"}


def parse_signature(sig: str) -> tuple[Param, ...]:
    """``"x: T, axis: int = -1"`` -> Params."""
    params: list[Param] = []
    if not sig.strip():
        return ()
    for part in _split_params(sig):
        part = part.strip()
        name, _, rest = part.partition(":")
        kind, eq, default_text = rest.partition("=")
        kind = kind.strip()
        if kind not in _ATTR_KINDS and kind not in _TENSOR_KINDS:
            raise ValueError(f"bad parameter kind {kind!r} in signature {sig!r}")
        default: Any = _NO_DEFAULT
        if eq:
            default = _parse_default(default_text.strip())
        params.append(Param(name.strip(), kind, default))
    return tuple(params)


def _split_params(sig: str) -> list[str]:
    """The comma-separated parameters of a signature; commas inside brackets or quotes (a
    default like ``ints = [1, 1]`` or ``str = "a,b"``) do not split."""
    parts: list[str] = []
    depth = 0
    quote = ""
    cur: list[str] = []
    for ch in sig:
        if quote:
            if ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch in "[(":
            depth += 1
        elif ch in "])":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
            continue
        cur.append(ch)
    parts.append("".join(cur))
    return parts


def _parse_default(text: str) -> Any:
    import ast

    if text == "None":
        return None
    if text == "true":
        return True
    if text == "false":
        return False
    value = ast.literal_eval(text)
    if isinstance(value, list):
        return tuple(value)
    return value



def reverse_signature(forward_sig: str, outputs: str) -> str:
    """The signature of a reverse rule: the forward's tensors, then the op's ``outputs``
    (``"out: T"``, ``"out: T, indices: T?"``), then the forward's attributes."""
    fwd = _split_params(forward_sig) if forward_sig.strip() else []
    parsed = list(zip(fwd, parse_signature(forward_sig)))
    outs = _split_params(outputs) if outputs.strip() else []
    return ",".join([*(p for p, q in parsed if q.is_tensor), *outs, *(p for p, q in parsed if not q.is_tensor)])


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def coerce_attr(op: str, p: Param, v: Any) -> Any:
    """Validate one attribute and return it in canonical (hashable) form."""
    k = p.kind
    if k == "bool":
        if isinstance(v, bool):
            return v
        if _is_int(v) and v in (0, 1):
            return bool(v)
    elif k == "int":
        if _is_int(v):
            return v
        if isinstance(v, float) and v.is_integer():
            return int(v)
    elif k == "float" or k == "scalar":
        if _is_int(v):
            return v if k == "scalar" else float(v)
        if isinstance(v, float):
            return v
        if isinstance(v, bool) and k == "scalar":
            return v
    elif k == "str":
        if isinstance(v, str):
            return v
    elif k == "ints":
        if v.__class__ is list or v.__class__ is tuple:
            for x in v:
                if x.__class__ is not int:
                    break
            else:
                return tuple(v)
        if _is_int(v):
            return (v,)
        if isinstance(v, (list, tuple)) and all(_is_int(x) for x in v):
            return tuple(v)
    elif k == "floats":
        if isinstance(v, (list, tuple)) and all(_is_int(x) or isinstance(x, float) for x in v):
            return tuple(float(x) for x in v)
    elif k == "any":
        return _freeze(v, op, p.name)
    raise InvalidAttributeError(f"{op}: attribute {p.name!r} must be {_KIND_TEXT[k]}, got {show(v)}")


_KIND_TEXT = {
    "bool": "a bool",
    "int": "an int",
    "float": "a number",
    "scalar": "a number",
    "str": "a string",
    "ints": "a list of ints",
    "floats": "a list of numbers",
    "any": "a value",
}


#: How deep an "any" attribute may nest lists / dicts (a dtype or a fill value needs 1 or 2).
MAX_ATTR_DEPTH = 32


def _freeze(v: Any, op: str = "", name: str = "", depth: int = 0) -> Any:
    """An "any" attribute in hashable canonical form: lists and tuples become tuples, dicts
    tuples of (key, value) pairs in a total order (keys of mixed types sort by type name,
    then value), sets frozensets, bytearrays bytes, numpy arrays and scalars their
    ``tolist()``. A value that stays unhashable, or nests deeper than
    :data:`MAX_ATTR_DEPTH`, is an InvalidAttributeError."""
    if v is None or v.__class__ in (str, int, float, bool):
        return v
    if depth >= MAX_ATTR_DEPTH:
        raise InvalidAttributeError(
            f"{op}: attribute {name!r} nests deeper than {MAX_ATTR_DEPTH} levels"
        )
    d = depth + 1
    if isinstance(v, (list, tuple)):
        return tuple(_freeze(x, op, name, d) for x in v)
    if isinstance(v, dict):
        items = [(_freeze(k, op, name, d), _freeze(x, op, name, d)) for k, x in v.items()]
        return tuple(sorted(items, key=_order_key))
    if isinstance(v, (set, frozenset)):
        return frozenset(_freeze(x, op, name, d) for x in v)
    if isinstance(v, bytearray):
        return bytes(v)
    tolist = getattr(type(v), "tolist", None)  # numpy arrays and scalars (no numpy import here)
    if tolist is not None and type(v).__module__ == "numpy":
        try:
            plain = v.tolist()
        except Exception as exc:  # a broken array-like: refuse it
            raise InvalidAttributeError(
                f"{op}: attribute {name!r}: cannot read {type(v).__name__} value ({type(exc).__name__})"
            ) from None
        return _freeze(plain, op, name, d)
    try:
        hash(v)
    except Exception:  # an unhashable or hostile value
        raise InvalidAttributeError(
            f"{op}: attribute {name!r} must be a number, string, bool, None or a list / dict of them, "
            f"got {type(v).__name__}"
        ) from None
    return v


def _order_key(kv: tuple[Any, Any]) -> tuple[str, str]:
    """A total order on frozen dict items whatever the key types (repr after type name)."""
    k = kv[0]
    return (type(k).__name__, show(k, 200))


def show(v: Any, limit: int = 200) -> str:
    """``repr(v)`` cut to ``limit`` characters, and safe for values whose repr fails or recurses."""
    try:
        text = reprlib_repr(v)
    except Exception:  # a hostile __repr__
        return f"<{type(v).__name__}>"
    return cut(text, limit)


def cut(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _make_repr() -> Callable[[Any], str]:
    import reprlib

    r = reprlib.Repr()
    r.maxlevel = 4
    r.maxlist = r.maxtuple = r.maxset = r.maxfrozenset = r.maxdict = 12
    r.maxstring = r.maxother = 120
    r.maxlong = 60
    return r.repr


reprlib_repr = _make_repr()


def _check_tensor(op: str, p: Param, v: Any) -> Any:
    k = p.kind
    if k == "T":
        if isinstance(v, DistTensorSpec):
            return v
        raise InvalidArgumentError(
            f"{op}: argument {p.name!r} must be a tensor (DistTensorSpec), got {_what(v)}"
        )
    if k == "T?":
        if v is None or isinstance(v, DistTensorSpec):
            return v
        raise InvalidArgumentError(
            f"{op}: argument {p.name!r} must be a tensor or None, got {_what(v)}"
        )
    # vector kinds
    if isinstance(v, (list, tuple)):
        items = tuple(v)
        for i, t in enumerate(items):
            if not isinstance(t, DistTensorSpec) and not (t is None and k == "[T?]"):
                raise InvalidArgumentError(
                    f"{op}: argument {p.name!r}[{i}] must be a tensor, got {_what(t)}"
                )
        return items
    raise InvalidArgumentError(f"{op}: argument {p.name!r} must be a list of tensors, got {_what(v)}")


def _what(v: Any) -> str:
    if v is None:
        return "None"
    if isinstance(v, (list, tuple)):
        return "a list"
    return f"{type(v).__name__} {show(v)}"


#: The kinds of a rule's modes: its forward rule; in the backward slot either Paddle's reverse
#: rule (the op's outputs -> its inputs) or a grad rule Paddle registers in that place.
FORWARD = "forward"
REVERSE = "reverse"
GRAD = "grad"
_KINDS = (FORWARD, REVERSE, GRAD)


class Mode:
    """One direction of a rule: a function, its parameters and its declared kind
    (:data:`FORWARD`, :data:`REVERSE` or :data:`GRAD`; ``""`` where not declared)."""

    __slots__ = ("fn", "function_name", "kind", "n_required", "names", "params")

    def __init__(self, fn: RuleFn, signature: str, function_name: str = "", kind: str = "") -> None:
        if kind and kind not in _KINDS:
            raise ValueError(f"bad mode kind {kind!r} (one of {', '.join(_KINDS)})")
        self.fn = fn
        self.params = parse_signature(signature)
        self.n_required = sum(1 for p in self.params if p.required)
        self.names = {p.name: i for i, p in enumerate(self.params)}
        self.function_name = function_name or getattr(fn, "__name__", "")
        self.kind = kind

    def bind(self, op: str, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        params = self.params
        n = len(params)
        if not kwargs and len(args) == n:
            # the common call: every argument given positionally
            out: list[Any] = []
            for p, v in zip(params, args):
                k = p.kind
                if k == "T" and v.__class__ is DistTensorSpec:
                    out.append(v)
                elif (k == "bool" and v.__class__ is bool) or (k == "int" and v.__class__ is int) or (
                    k == "float" and v.__class__ is float
                ):
                    out.append(v)
                elif p.is_tensor:
                    out.append(_check_tensor(op, p, v))
                else:
                    out.append(coerce_attr(op, p, v))
            return tuple(out)
        if len(args) > n:
            raise InvalidArgumentError(
                f"{op}: takes at most {n} arguments ({self.describe()}), got {len(args)}"
            )
        values: list[Any] = list(args) + [_NO_DEFAULT] * (n - len(args))
        out = []
        for key, v in kwargs.items():
            i = self.names.get(key)
            if i is None:
                raise InvalidArgumentError(f"{op}: unknown argument {key!r} ({self.describe()})")
            if values[i] is not _NO_DEFAULT:
                raise InvalidArgumentError(f"{op}: argument {key!r} given twice")
            values[i] = v
        for p, v in zip(params, values):
            if v is _NO_DEFAULT:
                if p.required:
                    raise InvalidArgumentError(f"{op}: missing argument {p.name!r} ({self.describe()})")
                v = p.default
                out.append(v)
                continue
            if p.is_tensor:
                out.append(_check_tensor(op, p, v))
            else:
                out.append(coerce_attr(op, p, v))
        return tuple(out)

    def describe(self) -> str:
        parts = []
        for p in self.params:
            s = f"{p.name}: {p.kind}"
            if not p.required:
                s += f" = {p.default!r}"
            parts.append(s)
        return ", ".join(parts)

