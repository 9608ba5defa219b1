"""The rule table: :class:`Rule` (a named rule's modes and its cached calls), the result cache
shared by every rule, and ``register`` / ``get_rule`` / ``rule_names`` ...

A rule is registered with its forward function and, where it has one, its
backward function, declared as one of two kinds: Paddle's reverse rule
(``kind="reverse"``, with the op's ``outputs``: its signature is derived, the forward's
tensors, then the outputs, then the forward's attributes) or the grad rule Paddle
registers in that place (``kind="grad"``, with its own signature). Signatures and binding:
:mod:`spmdkit.engine.signature`; cache keys: :mod:`spmdkit.engine.cache_keys`.

The rules themselves (the catalogue, :mod:`spmdkit.ops`) register into this table when
imported. The engine never imports them (they import the engine): the package face
(``spmdkit/__init__.py``, run before any module of the package) installs with
:func:`set_catalogue` what imports them, and the first lookup runs it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from spmdkit.core.errors import InvalidArgumentError, SpmdError, UnknownRuleError, UnsupportedModeError
from spmdkit.core.spec import EXPLICIT_MESH_FLAG, SpmdResult
from spmdkit.engine.cache_keys import (
    CallKey,
    KeyLookup,
    explicit_meshes,
    general_lookup,
    key_function,
    keyword_key,
    result_bytes,
    spec_bytes,
)
from spmdkit.engine.memo import clear_memo, set_memo_enabled
from spmdkit.engine.signature import FORWARD, GRAD, REVERSE, Mode, RuleFn, cut, parse_signature, reverse_signature, show

T = TypeVar("T")

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


def _store(cache: dict[Any, Any], kn: CallKey, args: tuple[Any, ...], result: SpmdResult) -> None:
    """Store a call's answer under its key (beside what a hit compares, see :meth:`Rule._call`)
    within the bounds on entries and bytes. The byte estimate is the key's
    (from the key function; its slow items walked here) plus the answer's; a mesh with
    explicit process ids held by the cache is counted once per cache generation."""
    global _cache_entries, _cache_bytes
    key, check, size, slow, _ = kn
    size += result_bytes(result)
    meshes: list[Any] = []
    if slow is not None:
        for item in slow:
            size += spec_bytes(item, meshes)
    if size >= EXPLICIT_MESH_FLAG:
        size %= EXPLICIT_MESH_FLAG
        meshes.extend(explicit_meshes(args))
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
        #: typed key -> (what a hit compares, see CallKey; the answer)
        self._cache: dict[Any, tuple[tuple[Any, ...], SpmdResult]] = {}
        #: per tag (0 forward, 1 backward) and number of positional arguments: the mode's
        #: cache lookup (:func:`~spmdkit.engine.cache_keys.key_function`) for calls giving that many, made on first use
        self._keys: list[list[KeyLookup | None]] = [
            [None] * (len(forward.params) + 1), [None] * (len(backward.params) + 1 if backward else 0)]

    @property
    def modes(self) -> tuple[str, ...]:
        return ("forward", "backward") if self.backward is not None else ("forward",)

    def mode(self, mode: str) -> Mode:
        if not isinstance(mode, str):
            raise UnsupportedModeError(
                f"{self.name}: mode must be 'forward' or 'backward', got {type(mode).__name__} {show(mode)}"
            )
        if mode == "forward":
            return self.forward
        if mode == "backward":
            if self.backward is None:
                raise UnsupportedModeError(f"{self.name}: has no backward (reverse) rule")
            return self.backward
        raise UnsupportedModeError(f"{self.name}: unknown mode {show(mode)} (forward or backward)")

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
            kn = keyword_key(tag, args, kwargs)
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
                    kf = kfs[n] = key_function(m.params, n, tag, self._cache)
                kn = kf(args)
            else:
                kn = general_lookup(tag, self._cache, args)
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
                f"{self.name}: invalid input ({type(exc).__name__}: {cut(str(exc))})"
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
        raise UnknownRuleError(f"a rule name is a string, got {type(name).__name__} {show(name)}")
    try:
        return _RULES[name]
    except KeyError:
        raise UnknownRuleError(f"no SPMD rule named {show(name)}") from None


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


#: what imports the catalogue, run by the first lookup (see the module docstring); None once run
_catalogue: Callable[[], object] | None = None


def set_catalogue(load: Callable[[], object]) -> None:
    """Install ``load``, which imports every rule module (each registers its rules); the first
    lookup (:func:`get_rule`, :func:`has_rule`, :func:`rule_names`, :func:`all_rules`) runs it."""
    global _catalogue
    _catalogue = load


def _ensure_loaded() -> None:
    global _catalogue
    load = _catalogue
    if load is not None:
        _catalogue = None  # a lookup while the rule modules import finds what is registered so far
        load()
