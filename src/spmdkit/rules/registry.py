"""Rule objects, argument binding and the name -> rule registry.

A rule is registered with its forward function and, where it has one, its
backward function, declared as one of two kinds: Paddle's reverse rule
(``kind="reverse"``, with the op's ``outputs``: its signature is derived, the forward's
tensors, then the outputs, then the forward's attributes) or the grad rule Paddle
registers in that place (``kind="grad"``, with its own signature). Signatures are strings
in Paddle 3.3.1's parameter order, e.g. ``"x: T, y: T, trans_x: bool = False"``.

Kinds: ``T`` a tensor (DistTensorSpec), ``T?`` an optional tensor (``None`` when
absent), ``[T]`` a list of tensors, ``[T?]`` a list whose items may be absent; attributes: ``bool``, ``int``,
``float``, ``str``, ``ints`` (a list of ints; a single int is taken as a
one-item list), ``floats``, ``scalar`` (int or float), ``any``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

from spmdkit.core.errors import (
    InvalidArgumentError,
    InvalidAttributeError,
    SpmdError,
    UnknownRuleError,
    UnsupportedModeError,
)
from spmdkit.core.spec import EXPLICIT_MESH_FLAG, DistTensorSpec, SpmdResult
from spmdkit.engine.memo import clear_memo, set_memo_enabled

T = TypeVar("T")

RuleFn = Callable[..., SpmdResult]

_NO_DEFAULT = object()
#: The result cache (shared by every rule) holds at most this many answers ...
_CACHE_LIMIT = 100_000
#: ... and at most about this many bytes (an estimate per answer: its key's tensors and attributes,
#: its result, and once per cache generation each mesh with explicit process ids it holds). Reaching
#: either bound empties it; a call never depends on what is cached (the key carries argument types).
_CACHE_BYTES_LIMIT = 64 * 2**20
_cache_enabled = True
_cache_entries = 0
_cache_bytes = 0
_cache_meshes: set[int] = set()  # id() of the explicit-id meshes counted in _cache_bytes
#: An answer is stored on the second call with its key, not the first: the hashes of keys seen
#: once are kept here (at most this many, plain ints: then it starts over), so a call never seen
#: before costs no store and leaves nothing behind (a planner trying new shapes, a batch of
#: distinct cases), and a repeated call is answered from the cache from its third time on.
_SEEN_LIMIT = 100_000
_seen: set[int] = set()


def set_cache_enabled(enabled: bool) -> None:
    """Turn the per-call result cache on or off (on by default). Off also turns off the
    engine's memo tables, so an uncached call computes its answer from scratch."""
    global _cache_enabled
    _cache_enabled = bool(enabled)
    set_memo_enabled(enabled)


def cache_enabled() -> bool:
    return _cache_enabled


def clear_cache() -> None:
    _clear_results()
    _seen.clear()
    clear_memo()


def _clear_results() -> None:
    global _cache_entries, _cache_bytes
    for r in set(_RULES.values()):
        r._cache.clear()
    _cache_entries = 0
    _cache_bytes = 0
    _cache_meshes.clear()


def cache_stats() -> dict[str, int]:
    """The result cache's size: ``entries`` and estimated ``bytes`` (both bounded, see above), and
    ``seen``: keys seen once, whose answer is stored when they come again."""
    return {"entries": _cache_entries, "bytes": _cache_bytes,
            "entries_limit": _CACHE_LIMIT, "bytes_limit": _CACHE_BYTES_LIMIT, "seen": len(_seen)}


class _Uncacheable(Exception):
    pass


# Tags of the typed cache key: a key never makes True equal 1, 1.0 equal 1, -0.0 equal 0.0, a list
# equal a tuple or a dict equal a list of pairs (all equal under ==, but rules may answer otherwise).
_K_BOOL = object()
_K_TRUE = object()
_K_FALSE = object()
_K_FLOAT = object()
_K_NEGZERO = object()
_K_LIST = object()
_K_TUPLE = object()
_K_DICT = object()
_K_KW = object()
#: ints of at most this magnitude are counted as one small object by the byte estimate
_SMALL_INT = 2**62


def _typed(v: Any) -> Any:
    """``v`` as a cache-key item that equals another only for equal values of equal types;
    _Uncacheable for a value of another class (its equality is not known to be exact)."""
    c = v.__class__
    if c is DistTensorSpec or c is int or c is str or v is None:
        return v
    if c is bool:
        return (_K_BOOL, v)
    if c is float:
        if v == 0.0 and str(v)[0] == "-":
            return _K_NEGZERO
        return (_K_FLOAT, v)
    if c is list or c is tuple:
        return (_K_LIST if c is list else _K_TUPLE, *[_typed(x) for x in v])
    if c is dict:
        return (_K_DICT, *[(_typed(k), _typed(x)) for k, x in v.items()])
    raise _Uncacheable


def _positional_key(tag: int, args: tuple[Any, ...]) -> _Key | None:
    """The :data:`_Key` of a call with positional arguments only (the general path of a mode's
    key function), or None when it cannot be cached.

    A tensor enters the key as its precomputed hash, so that the key hashes and compares in C;
    an entry therefore stores the call's arguments beside its answer, and a hit is taken only
    when they are equal too (see :meth:`Rule._call`). Attributes enter typed (:func:`_typed`,
    inlined here for the common kinds). The byte estimate comes from the tensors' own
    (:func:`~spmdkit.core.spec.spec_nbytes`) and the attributes' lengths, without a walk."""
    key: list[Any] = [tag]
    nb = 200 + 16 * len(args)
    slow: list[Any] | None = None
    for a in args:
        c = a.__class__
        if c is DistTensorSpec:
            key.append(a._hash)
            nb += a._nbytes
        elif c is int:
            key.append(a)
            if not -_SMALL_INT < a < _SMALL_INT:
                nb += a.bit_length() >> 3
        elif c is bool:
            key.append(_K_TRUE if a else _K_FALSE)
        elif a is None:
            key.append(None)
        elif c is float:
            if a == 0.0 and str(a)[0] == "-":
                key.append(_K_NEGZERO)
            else:
                key.append(_K_FLOAT)
                key.append(a)
        elif c is str:
            key.append(a)
            nb += 50 + len(a)
        else:
            if c is list or c is tuple:  # a list of ints, or of tensors (None for absent ones)
                items: list[Any] = [_K_LIST if c is list else _K_TUPLE]
                bits = 0  # the OR of the ints: its bit length bounds theirs
                for x in a:
                    xc = x.__class__
                    if xc is int:
                        items.append(x)
                        bits |= x
                    elif xc is DistTensorSpec:
                        items.append(x._hash)
                        nb += x._nbytes
                    elif x is None:
                        items.append(None)
                    else:
                        break
                else:
                    key.append(tuple(items))
                    nb += 64 + 40 * len(a)
                    if not -_SMALL_INT < bits < _SMALL_INT:
                        nb += len(a) * (bits.bit_length() >> 3)
                    continue
            try:
                item = _typed(a)
            except (_Uncacheable, RecursionError):
                return None
            key.append(item)
            if slow is None:
                slow = []
            slow.append(item)
    # every item is hashable by construction (ints, strs, tags, tuples of typed items)
    return tuple(key), args, nb, slow, None


#: what a key function gives: the key, what a hit must find equal in the entry, the byte estimate,
#: the key's items whose bytes are estimated by a walk when stored (None: none), and the call's
#: bound arguments where the key function bound them (None: :meth:`Mode.bind` binds)
_Key = tuple[tuple[Any, ...], tuple[Any, ...], int, "list[Any] | None", "tuple[Any, ...] | None"]


def _cache_key(tag: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Key | None:
    """``(key, check, bytes, slow items)`` of a call (see :data:`_Key` and
    :func:`_positional_key`), or None when it cannot be cached."""
    if not kwargs:
        return _positional_key(tag, args)
    return _keyword_key(tag, args, kwargs)


def _keyword_key(tag: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Key | None:
    """:func:`_cache_key` of a call with keyword arguments (tensors in the key as themselves;
    the byte estimate made by a walk of the whole key when it is stored)."""
    key: list[Any] = [tag]
    try:
        for a in args:
            key.append(_typed(a))
        key.append(_K_KW)
        for name, v in kwargs.items():
            key.append(name)
            key.append(_typed(v))
    except (_Uncacheable, RecursionError):
        return None
    out = tuple(key)
    return out, args, 200 + 16 * (len(args) + len(kwargs)), [out], None


def _spec_bytes(v: Any, meshes: list[Any]) -> int:
    """Estimated bytes of one key item walked item by item (the slow path: attributes other than
    flat lists of ints or tensors; the explicit-id meshes of its tensors are collected in
    ``meshes``)."""
    c = v.__class__
    if c is DistTensorSpec:
        if v.dist_attr.mesh._process_ids is not None:
            meshes.append(v.dist_attr.mesh)
        return int(v._nbytes) % EXPLICIT_MESH_FLAG
    if c is tuple:
        return 64 + sum(8 + _spec_bytes(x, meshes) for x in v)
    if c is str:
        return 50 + len(v)
    if c is int:
        return 32 if v.bit_length() < 60 else 32 + v.bit_length() // 8
    return 32


def _result_bytes(result: SpmdResult) -> int:
    n = 160
    for group in (result.inputs, result.outputs):
        for a in group:
            if a is None:
                n += 8
            elif isinstance(a, tuple):
                n += 64 + sum(8 if x is None else 200 + 16 * len(x.dims_mapping) for x in a)
            else:
                n += 200 + 16 * len(a.dims_mapping)
    return n


def _explicit_meshes(args: tuple[Any, ...]) -> list[Any]:
    """The explicit-id meshes of a call's positional tensors, in and out of lists (rare)."""
    out = []
    for v in args:
        for t in v if v.__class__ is list or v.__class__ is tuple else (v,):
            if t.__class__ is DistTensorSpec and t.dist_attr.mesh._process_ids is not None:
                out.append(t.dist_attr.mesh)
    return out


def _store(cache: dict[Any, Any], kn: _Key, args: tuple[Any, ...], result: SpmdResult) -> None:
    """Store a call's answer under its key (beside what a hit compares, see :meth:`Rule._call`)
    within the bounds on entries and bytes. The byte estimate is the key's
    (from :func:`_cache_key`; its slow items walked here) plus the answer's; a mesh with
    explicit process ids held by the cache is counted once per cache generation."""
    global _cache_entries, _cache_bytes
    key, check, size, slow, _ = kn
    size += _result_bytes(result)
    meshes: list[Any] = []
    if slow is not None:
        for item in slow:
            size += _spec_bytes(item, meshes)
    if size >= EXPLICIT_MESH_FLAG:
        size %= EXPLICIT_MESH_FLAG
        meshes.extend(_explicit_meshes(args))
    if not meshes:
        if _cache_entries >= _CACHE_LIMIT or _cache_bytes + size > _CACHE_BYTES_LIMIT:
            _clear_results()
            if size > _CACHE_BYTES_LIMIT:
                return
        cache[key] = (check, result)
        _cache_entries += 1
        _cache_bytes += size
        return
    explicit = {id(m): m.size for m in meshes}
    extra = sum(100 + 40 * n for i, n in explicit.items() if i not in _cache_meshes)
    if _cache_entries >= _CACHE_LIMIT or _cache_bytes + size + extra > _CACHE_BYTES_LIMIT:
        _clear_results()
        extra = sum(100 + 40 * n for n in explicit.values())
        if size + extra > _CACHE_BYTES_LIMIT:
            return
    _cache_meshes.update(explicit)
    cache[key] = (check, result)
    _cache_entries += 1
    _cache_bytes += size + extra


_K_FAST = object()  # first item of a key made by a mode's key function
_K_ZERO = object()


def _zero_item(v: object) -> object:
    """The key item of a false plain value (0, 0.0, -0.0, "", False, None; its class beside it
    where needed): -0.0 apart from the rest (0.0 and -0.0 are equal under ==)."""
    return _K_NEGZERO if v.__class__ is float and str(v)[0] == "-" else _K_ZERO


class _Fast(NamedTuple):
    """How a mode's key function (:func:`_key_function`) takes one parameter kind; ``{v}`` is the
    value. ``cond`` holds exactly for the values :meth:`Mode.bind` takes (as they are, or as
    ``bound`` makes them, the same as bind's), so that such a call is bound here too."""

    cond: str
    pre: str  # statements run once every condition holds (item loops, conversions)
    key: str  # its key item (equal for two values only when their bound values are)
    check: str  # what a hit compares for it ("": nothing, the key item is exact)
    size: str  # its bytes beyond the per-argument constant (an expression, "" for none) ...
    const: int  # ... and a constant
    bound: str  # the bound value


_SMALL_INT_COND = "({v}.__class__ is int and -_B < {v} < _B)"
_LIST_COND = "({v}.__class__ is list or {v}.__class__ is tuple)"
_INTS_PRE = """\
            for x in {v}:
                if x.__class__ is not int:
                    return general(a)
                b |= x
            i_{v} = tuple({v})
"""
_TENSORS_PRE = """\
            t_{v} = []
            e_{v} = []
            n_{v} = 0
            for x in {v}:
                if x.__class__ is _S:
                    t_{v}.append(x._hash)
                    e_{v}.append(x._eq)
                    n_{v} += x._nbytes
                elif {none_ok} and x is None:
                    t_{v}.append(None)
                    e_{v}.append(None)
                else:
                    return general(a)
"""
#: the parameter kinds a key function takes (``floats`` and keyword calls take the general path)
_FAST_KINDS: dict[str, _Fast] = {
    "T": _Fast("{v}.__class__ is _S", "", "{v}._hash", "{v}._eq", "{v}._nbytes", 0, "{v}"),
    "T?": _Fast("({v} is None or {v}.__class__ is _S)", "", "(None if {v} is None else {v}._hash)",
                "(None if {v} is None else {v}._eq)", "(0 if {v} is None else {v}._nbytes)", 0, "{v}"),
    "bool": _Fast("{v}.__class__ is bool", "", "{v}", "", "", 0, "{v}"),
    "int": _Fast(_SMALL_INT_COND, "", "{v}", "", "", 0, "{v}"),
    # bound as a float (JSON gives 2 for 2.0); 0.0 and -0.0 told apart
    "float": _Fast("({v}.__class__ is float or " + _SMALL_INT_COND + ")",
                   "            f_{v} = {v} if {v}.__class__ is float else float({v})\n",
                   "(f_{v} or _Z(f_{v}))", "", "", 0, "f_{v}"),
    # kept as given: the class beside the value in the key (True is not 1, 1 is not 1.0)
    "scalar": _Fast("({v}.__class__ is float or {v}.__class__ is bool or " + _SMALL_INT_COND + ")", "",
                    "({v}.__class__, {v} or _Z({v}))", "", "", 0, "{v}"),
    "any": _Fast("({v}.__class__ in _P or " + _SMALL_INT_COND + ")", "", "({v}.__class__, {v} or _Z({v}))", "",
                 "(len({v}) if {v}.__class__ is str else 0)", 0, "{v}"),
    "str": _Fast("{v}.__class__ is str", "", "{v}", "", "len({v})", 50, "{v}"),
    "ints": _Fast(_LIST_COND, _INTS_PRE, "i_{v}", "", "40 * len({v})", 64, "i_{v}"),
    "[T]": _Fast(_LIST_COND, _TENSORS_PRE.replace("{none_ok}", "False"), "tuple(t_{v})", "tuple(e_{v})",
                 "8 * len({v}) + n_{v}", 64, "tuple({v})"),
    "[T?]": _Fast(_LIST_COND, _TENSORS_PRE.replace("{none_ok}", "True"), "tuple(t_{v})", "tuple(e_{v})",
                  "8 * len({v}) + n_{v}", 64, "tuple({v})"),
}
#: the classes of an ``any`` value a key function takes as it is (an int when not huge too)
_PLAIN = frozenset({float, bool, str, type(None)})


_Lookup = Callable[[tuple[Any, ...]], "SpmdResult | _Key | None"]


def _general_lookup(tag: int, cache: dict[Any, Any], args: tuple[Any, ...]) -> SpmdResult | _Key | None:
    """The cached answer of a call with positional arguments, else its :data:`_Key` (None when it
    cannot be cached): the general path of a key function."""
    kn = _positional_key(tag, args)
    if kn is not None:
        hit = cache.get(kn[0])
        if hit is not None and hit[0] == kn[1]:
            return hit[1]  # type: ignore[no-any-return]
    return kn


def _key_function(params: Sequence[Any], n: int, tag: int, cache: dict[Any, Any]) -> _Lookup:
    """The cache lookup of one mode's calls with ``n`` positional arguments (``cache``: the
    rule's): the cached answer, else the call's :data:`_Key` (None when it cannot be cached).
    :func:`_general_lookup` made specific to the signature, binding too: when the first ``n``
    parameters have kinds of :data:`_FAST_KINDS` it is generated code, in which a call whose
    values meet their kinds' conditions gets its key without a loop over the arguments (its first
    item :data:`_K_FAST`, so that it never equals a key of the general path; the kind at each
    position is fixed among such keys, so its items need no type tags beyond what binding keeps)
    and, on a miss, its bytes and bound arguments (the defaults of the parameters after the
    ``n``-th added; None where one of them is required), the same as :meth:`Mode.bind` gives;
    any other call takes the general path, bound by :meth:`Mode.bind`."""
    general = functools.partial(_general_lookup, tag, cache)
    kinds = [p.kind for p in params[:n]]
    if not kinds or any(k not in _FAST_KINDS for k in kinds):
        return general
    rest = params[n:]
    tail = None if any(p.required for p in rest) else tuple(p.default for p in rest)
    names = [f"a{i}" for i in range(n)]
    fast = [_FAST_KINDS[k] for k in kinds]
    base = 200 + 16 * n + sum(f.const for f in fast)
    sizes = [str(base)] + [f.size.format(v=v) for v, f in zip(names, fast) if f.size]
    checks = "".join(f.check.format(v=v) + ", " for v, f in zip(names, fast) if f.check)
    bound = f"({''.join(f.bound.format(v=v) + ', ' for v, f in zip(names, fast))})" + (" + _TAIL" if tail else "")
    if tail is None:
        bound = "None"
    ints = "ints" in kinds
    src = (
        "def key(a):\n"
        f"    if len(a) == {n}:\n"
        f"        {', '.join(names)}, = a\n"
        f"        if {' and '.join(f.cond.format(v=v) for v, f in zip(names, fast))}:\n"
        + ("            b = 0\n" if ints else "")
        + "".join(f.pre.format(v=v) for v, f in zip(names, fast))
        + ("            if not -_B < b < _B:\n                return general(a)\n" if ints else "")
        + f"            k = ({tag}, _F, {', '.join(f.key.format(v=v) for v, f in zip(names, fast))})\n"
        f"            c = ({checks})\n"
        "            hit = _get(k)\n"
        "            if hit is not None and hit[0] == c:\n"
        "                return hit[1]\n"
        f"            return k, c, {' + '.join(sizes)}, None, {bound}\n"
        "    return general(a)\n"
    )
    env: dict[str, Any] = {"_S": DistTensorSpec, "_B": _SMALL_INT, "_Z": _zero_item, "_F": _K_FAST,
                           "_P": _PLAIN, "_TAIL": tail, "_get": cache.get, "general": general}
    exec(compile(src, f"<cache key {', '.join(kinds)}>", "exec"), env)
    fn: _Lookup = env["key"]
    fn.source = src  # type: ignore[attr-defined]
    return fn


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
    raise InvalidAttributeError(f"{op}: attribute {p.name!r} must be {_KIND_TEXT[k]}, got {_show(v)}")


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
    return (type(k).__name__, _show(k, 200))


def _show(v: Any, limit: int = 200) -> str:
    """``repr(v)`` cut to ``limit`` characters, and safe for values whose repr fails or recurses."""
    try:
        text = reprlib_repr(v)
    except Exception:  # a hostile __repr__
        return f"<{type(v).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _cut(text: str, limit: int = 300) -> str:
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
    return f"{type(v).__name__} {_show(v)}"


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


class Rule:
    """A named SPMD rule: ``infer_forward(*args)`` and ``infer_backward(*args)``.

    Arguments follow Paddle 3.3.1's parameter order and may also be given by
    Paddle's parameter names. Answers are cached per distinct call.
    """

    __slots__ = ("_cache", "_keys", "aliases", "backward", "doc", "forward", "name", "outputs")

    def __init__(self, name: str, forward: Mode, backward: Mode | None, doc: str = "",
                 outputs: Sequence[str] = ()) -> None:
        self.name = name
        self.forward = forward
        self.backward = backward
        self.doc = doc
        self.aliases: tuple[str, ...] = ()
        #: the op's output tensors (the reverse rule's extra parameters), where declared
        self.outputs = tuple(outputs)
        #: typed key -> (what a hit compares, see _Key; the answer)
        self._cache: dict[Any, tuple[tuple[Any, ...], SpmdResult]] = {}
        #: per tag (0 forward, 1 backward) and number of positional arguments: the mode's
        #: cache lookup (:func:`_key_function`) for calls giving that many, made on first use
        self._keys: list[list[_Lookup | None]] = [
            [None] * (len(forward.params) + 1), [None] * (len(backward.params) + 1 if backward else 0)]

    @property
    def modes(self) -> tuple[str, ...]:
        return ("forward", "backward") if self.backward is not None else ("forward",)

    def mode(self, mode: str) -> Mode:
        if not isinstance(mode, str):
            raise UnsupportedModeError(
                f"{self.name}: mode must be 'forward' or 'backward', got {type(mode).__name__} {_show(mode)}"
            )
        if mode == "forward":
            return self.forward
        if mode == "backward":
            if self.backward is None:
                raise UnsupportedModeError(f"{self.name}: has no backward (reverse) rule")
            return self.backward
        raise UnsupportedModeError(f"{self.name}: unknown mode {_show(mode)} (forward or backward)")

    # ``self`` and ``mode`` are positional-only: a rule parameter may be called ``mode``, and an
    # unknown keyword ``self=`` is the rule's InvalidArgumentError, not Python's TypeError
    def infer_forward(self, /, *args: Any, **kwargs: Any) -> SpmdResult:
        return self._call(self.forward, 0, args, kwargs)

    def infer_backward(self, /, *args: Any, **kwargs: Any) -> SpmdResult:
        if self.backward is None:
            raise UnsupportedModeError(f"{self.name}: has no backward (reverse) rule")
        return self._call(self.backward, 1, args, kwargs)

    def infer(self, mode: str, /, *args: Any, **kwargs: Any) -> SpmdResult:
        m = self.mode(mode)
        return self._call(m, 0 if m is self.forward else 1, args, kwargs)

    def _call(self, m: Mode, tag: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> SpmdResult:
        kn: Any
        if not _cache_enabled:
            kn = None
        elif kwargs:
            kn = _keyword_key(tag, args, kwargs)
            if kn is not None:
                hit = self._cache.get(kn[0])
                # the key holds tensors as themselves here; kn[1] is the positional arguments
                if hit is not None and hit[0] == kn[1]:
                    return hit[1]
        else:
            # the key holds tensors by hash: a hit also needs them equal (the check, kn[1]: their
            # equality tuples or the arguments themselves; the attributes are exact in the key)
            kfs = self._keys[tag]
            n = len(args)
            if n < len(kfs):
                kf = kfs[n]
                if kf is None:
                    kf = kfs[n] = _key_function(m.params, n, tag, self._cache)
                kn = kf(args)
            else:
                kn = _general_lookup(tag, self._cache, args)
            if kn.__class__ is SpmdResult:
                return kn
        if kn is None or kn[4] is None:
            bound = m.bind(self.name, args, kwargs)
        else:
            bound = kn[4]
        try:
            result = m.fn(*bound)
        except SpmdError:
            raise
        except (IndexError, KeyError, ValueError, TypeError, ArithmeticError, AttributeError) as exc:
            # an unforeseen malformed input (ArithmeticError: also OverflowError from a size past
            # what Python indexes): report it as a library error, never a traceback
            raise InvalidArgumentError(
                f"{self.name}: invalid input ({type(exc).__name__}: {_cut(str(exc))})"
            ) from exc
        except (MemoryError, RecursionError) as exc:
            # sizes or nesting beyond what one call may take: refused, named, never a traceback
            raise InvalidArgumentError(
                f"{self.name}: input too large to answer ({type(exc).__name__})"
            ) from None
        if kn is not None:
            h = hash(kn[0])
            if h in _seen:
                _store(self._cache, kn, args, result)
            else:
                if len(_seen) >= _SEEN_LIMIT:
                    _seen.clear()
                _seen.add(h)
        return result

    def __repr__(self) -> str:
        return f"Rule({self.name!r}, modes={self.modes})"


_RULES: dict[str, Rule] = {}
_CANONICAL: dict[str, Rule] = {}


def reverse_signature(forward_sig: str, outputs: str) -> str:
    """The signature of a reverse rule: the forward's tensors, then the op's ``outputs``
    (``"out: T"``, ``"out: T, indices: T?"``), then the forward's attributes."""
    fwd = _split_params(forward_sig) if forward_sig.strip() else []
    tensors = [p for p, q in zip(fwd, parse_signature(forward_sig)) if q.is_tensor]
    attrs = [p for p, q in zip(fwd, parse_signature(forward_sig)) if not q.is_tensor]
    outs = _split_params(outputs) if outputs.strip() else []
    return ",".join([*tensors, *outs, *attrs])


def register(
    name: str,
    forward: RuleFn,
    forward_sig: str,
    backward: RuleFn | None = None,
    backward_sig: str = "",
    *,
    kind: str = "",
    outputs: str = "",
    grad_name: str = "",
    grad_aliases: Sequence[str] = (),
    aliases: Sequence[str] = (),
    doc: str = "",
    forward_name: str = "",
    backward_name: str = "",
) -> Rule:
    """Register a rule (and its aliases). Re-registering a name is an error.

    The backward slot is declared with its ``kind``: ``"reverse"`` (Paddle's reverse rule) with
    the op's ``outputs`` (e.g. ``"out: T"``; empty where the forward signature holds them
    already), its signature then derived by :func:`reverse_signature` (``backward_sig`` is not
    given); or ``"grad"`` (a grad rule in
    that place) with its ``backward_sig`` in Paddle's order; ``grad_name`` (and
    ``grad_aliases``) also registers that grad rule as a rule of its own, forward only."""
    if grad_name and (kind != GRAD or backward is None):
        raise ValueError(f"rule {name!r}: grad_name {grad_name!r} needs a grad rule in the backward slot")
    if backward is None:
        if kind or outputs or backward_sig:
            raise ValueError(f"rule {name!r}: kind / outputs / backward_sig without a backward function")
        bwd = None
    elif kind == REVERSE:
        if backward_sig:
            raise ValueError(f"rule {name!r}: a reverse rule declares its outputs, not a signature")
        bwd = Mode(backward, reverse_signature(forward_sig, outputs), backward_name, REVERSE)
    elif kind == GRAD:
        if outputs or not backward_sig:
            raise ValueError(f"rule {name!r}: a grad rule declares its signature, not outputs")
        bwd = Mode(backward, backward_sig, backward_name, GRAD)
    else:
        raise ValueError(f"rule {name!r}: bad backward kind {kind!r} (a backward declares kind='reverse' or 'grad')")
    rule = Rule(
        name,
        Mode(forward, forward_sig, forward_name, FORWARD),
        bwd,
        doc or (forward.__doc__ or "").strip().split("\n")[0],
        [p.name for p in parse_signature(outputs)] if outputs.strip() else (),
    )
    rule.aliases = tuple(aliases)
    for n in (name, *aliases):
        if n in _RULES:
            raise ValueError(f"rule {n!r} registered twice")
        _RULES[n] = rule
    _CANONICAL[name] = rule
    if grad_name:
        assert backward is not None  # checked above
        register(grad_name, backward, backward_sig, aliases=grad_aliases, forward_name=backward_name)
    return rule


def backward_kind(rule: Rule) -> str:
    """The declared kind of the rule's backward slot (:data:`REVERSE` or :data:`GRAD`), ``""``
    without one."""
    if rule.backward is None:
        return ""
    return rule.backward.kind


def is_reverse(rule: Rule) -> bool:
    """Is the rule's backward slot a reverse rule (the op's outputs -> its inputs), not a grad rule?"""
    return backward_kind(rule) == REVERSE


def output_params(rule: Rule) -> list[str]:
    """The backward (reverse) rule's tensor params that are outputs of the op, in order."""
    if rule.backward is None:
        return []
    if rule.outputs:
        return list(rule.outputs)
    fwd = [p.name for p in rule.forward.params if p.is_tensor]
    return [p.name for p in rule.backward.params if p.is_tensor and p.name not in fwd]


def get_rule(name: str) -> Rule:
    """The rule registered under ``name`` (or an alias of it)."""
    _ensure_loaded()
    if not isinstance(name, str):  # never hash or compare a foreign value (a deep tuple would crash)
        raise UnknownRuleError(f"a rule name is a string, got {type(name).__name__} {_show(name)}")
    try:
        return _RULES[name]
    except KeyError:
        raise UnknownRuleError(f"no SPMD rule named {_show(name)}") from None


def by_rule_name(table: Mapping[str, T], name: str) -> T | None:
    """``table[name]``, else the entry of the rule ``name`` names under its own name or any of its
    aliases (a table keyed by some of a rule's names: the simulator's references, the torch
    kernels); None when there is none or ``name`` is no rule."""
    got = table.get(name) if isinstance(name, str) else None
    if got is not None or not has_rule(name):
        return got
    rule = _RULES[name]
    for n in (rule.name, *rule.aliases):
        if n in table:
            return table[n]
    return None


def has_rule(name: str) -> bool:
    _ensure_loaded()
    return isinstance(name, str) and name in _RULES


def rule_names(include_aliases: bool = True) -> list[str]:
    """Every registered name, sorted."""
    _ensure_loaded()
    return sorted(_RULES if include_aliases else _CANONICAL)


def all_rules() -> dict[str, Rule]:
    _ensure_loaded()
    return dict(_RULES)


_loaded = False


def _ensure_loaded() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        import spmdkit.rules  # noqa: F401  (imports every rule module)
