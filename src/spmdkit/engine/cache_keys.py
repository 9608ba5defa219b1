"""Keys of the result cache (:mod:`spmdkit.engine.registry`): typed keys of a call, the
byte estimates of what an entry holds, and the key functions generated per mode and number of
positional arguments (the cached-call fast path)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from spmdkit.core.spec import EXPLICIT_MESH_FLAG, DistTensorSpec, SpmdResult
from spmdkit.engine.codegen import define


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


_UNCACHEABLE = object()


def value_key(v: Any) -> Any:
    """``v`` as a hashable key item equal to another only for equal values of equal types (a
    rule's attribute, as the result cache keys it), or :data:`UNCACHEABLE` for a value whose
    equality is not known to be exact (a memo must then call, not look up)."""
    try:
        return _typed(v)
    except (_Uncacheable, RecursionError):
        return _UNCACHEABLE


#: what :func:`value_key` gives for a value it cannot key
UNCACHEABLE = _UNCACHEABLE


def positional_key(tag: int, args: tuple[Any, ...]) -> CallKey | None:
    """The :data:`CallKey` of a call with positional arguments only (the general path of a mode's
    key function), or None when it cannot be cached.

    A tensor enters the key as its precomputed hash, so that the key hashes and compares in C;
    an entry therefore stores the call's arguments beside its answer, and a hit is taken only
    when they are equal too (see :meth:`~spmdkit.engine.registry.Rule._call`). Attributes enter typed (:func:`_typed`,
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
CallKey = tuple[tuple[Any, ...], tuple[Any, ...], int, "list[Any] | None", "tuple[Any, ...] | None"]


def keyword_key(tag: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> CallKey | None:
    """:func:`positional_key`, for a call with keyword arguments (tensors in the key as themselves;
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


def spec_bytes(v: Any, meshes: list[Any]) -> int:
    """Estimated bytes of one key item walked item by item (the slow path: attributes other than
    flat lists of ints or tensors; the explicit-id meshes of its tensors are collected in
    ``meshes``)."""
    c = v.__class__
    if c is DistTensorSpec:
        if v.dist_attr.mesh._process_ids is not None:
            meshes.append(v.dist_attr.mesh)
        return int(v._nbytes) % EXPLICIT_MESH_FLAG
    if c is tuple:
        return 64 + sum(8 + spec_bytes(x, meshes) for x in v)
    if c is str:
        return 50 + len(v)
    if c is int:
        return 32 if v.bit_length() < 60 else 32 + v.bit_length() // 8
    return 32


def result_bytes(result: SpmdResult) -> int:
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


def explicit_meshes(args: tuple[Any, ...]) -> list[Any]:
    """The explicit-id meshes of a call's positional tensors, in and out of lists (rare)."""
    out = []
    for v in args:
        for t in v if v.__class__ is list or v.__class__ is tuple else (v,):
            if t.__class__ is DistTensorSpec and t.dist_attr.mesh._process_ids is not None:
                out.append(t.dist_attr.mesh)
    return out



_K_FAST = object()  # first item of a key made by a mode's key function
_K_ZERO = object()


def _zero_item(v: object) -> object:
    """The key item of a false plain value (0, 0.0, -0.0, "", False, None; its class beside it
    where needed): -0.0 apart from the rest (0.0 and -0.0 are equal under ==)."""
    return _K_NEGZERO if v.__class__ is float and str(v)[0] == "-" else _K_ZERO


class _Fast(NamedTuple):
    """How a mode's key function (:func:`key_function`) takes one parameter kind; ``{v}`` is the
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


KeyLookup = Callable[[tuple[Any, ...]], "SpmdResult | CallKey | None"]


def general_lookup(tag: int, cache: dict[Any, Any], args: tuple[Any, ...]) -> SpmdResult | CallKey | None:
    """The cached answer of a call with positional arguments, else its :data:`CallKey` (None when it
    cannot be cached): the general path of a key function."""
    kn = positional_key(tag, args)
    if kn is not None:
        hit = cache.get(kn[0])
        if hit is not None and hit[0] == kn[1]:
            return hit[1]  # type: ignore[no-any-return]
    return kn


def key_function(params: Sequence[Any], n: int, tag: int, cache: dict[Any, Any]) -> KeyLookup:
    """The cache lookup of one mode's calls with ``n`` positional arguments (``cache``: the
    rule's): the cached answer, else the call's :data:`CallKey` (None when it cannot be cached).
    :func:`general_lookup` made specific to the signature, binding too: when the first ``n``
    parameters have kinds of :data:`_FAST_KINDS` it is generated code, in which a call whose
    values meet their kinds' conditions gets its key without a loop over the arguments (its first
    item :data:`_K_FAST`, so that it never equals a key of the general path; the kind at each
    position is fixed among such keys, so its items need no type tags beyond what binding keeps)
    and, on a miss, its bytes and bound arguments (the defaults of the parameters after the
    ``n``-th added; None where one of them is required), the same as :meth:`Mode.bind` gives;
    any other call takes the general path, bound by :meth:`Mode.bind`."""
    general = functools.partial(general_lookup, tag, cache)
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
    fn: KeyLookup = define(src, f"cache key {', '.join(kinds)}", "key", env)
    fn.source = src  # type: ignore[attr-defined]
    return fn
