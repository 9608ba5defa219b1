"""Memo tables for pure functions of a rule call's inputs, switchable as one.

Rules and the engine memoize pure functions keyed by what a call depends on (mappings,
shapes, attributes). ``spmdkit.ops.set_cache_enabled(False)`` turns every such table off
together with the rule result cache, so that an "uncached" call computes its answer from
scratch (the benchmark's uncached figure means exactly that). Three kinds: :func:`memo` (a
decorator, keyed by the arguments), :func:`memo_table` (a plain dict, its key and bound kept by
hand) and :class:`Recent` (the most recently used values by a key the caller makes, bounded).
"""

from __future__ import annotations

import gc
import weakref
from collections import OrderedDict
from collections.abc import Callable
from functools import wraps
from typing import Any, Generic, TypeVar

F = TypeVar("F", bound=Callable[..., Any])
_V = TypeVar("_V")

_enabled = True
_tables: list[Any] = []
#: every :class:`Recent` made (held weakly: one an object owns goes with it)
_recents: weakref.WeakSet[Recent[Any]] = weakref.WeakSet()


def set_memo_enabled(enabled: bool) -> None:
    global _enabled
    _enabled = bool(enabled)


def memo_enabled() -> bool:
    return _enabled


def clear_memo() -> None:
    for t in _tables:
        t.cache_clear()
    for r in list(_recents):
        r.cache_clear()


def release_by_id() -> None:
    """Empty every :class:`Recent` keyed by object ids (``by_id``; those keyed by value, the memo
    tables and the rule results are kept): called when a command returns (:func:`spmdkit.cli.main`), whose
    plans and programs no caller can reach, so no later call can pass one of them again (a later
    object's key is a later object's id). Their entries would otherwise keep up to ``limit``
    whole plans alive in a long-lived process (a test session, a notebook, a loop over
    commands): millions of containers the cyclic collector walks on every full pass."""
    for r in list(_recents):
        if r.by_id:
            r.cache_clear()


_MISS = object()


def memo(maxsize: int = 65536) -> Callable[[F], F]:
    """``@memo()``: a memo table for a pure function of hashable arguments, bypassed while memo
    tables are off. Like the rule result cache, an answer is stored on the second call with its
    arguments (the hashes of arguments seen once are kept, as plain ints), so arguments never
    seen before (new shapes) cost no store and leave nothing behind; at most ``maxsize``
    answers and ``maxsize`` hashes are kept (each table starts over when full)."""

    def deco(fn: F) -> F:
        table: dict[Any, Any] = {}
        seen: set[int] = set()

        @wraps(fn)
        def wrapper(*args: Any) -> Any:
            if not _enabled:
                return fn(*args)
            r = table.get(args, _MISS)
            if r is not _MISS:
                return r
            r = fn(*args)
            h = hash(args)
            if h in seen:
                if len(table) >= maxsize:
                    table.clear()
                table[args] = r
            else:
                if len(seen) >= maxsize:
                    seen.clear()
                seen.add(h)
            return r

        def cache_clear() -> None:
            table.clear()
            seen.clear()

        _tables.append(wrapper)
        wrapper.cache_clear = cache_clear  # type: ignore[attr-defined]
        wrapper.raw = fn  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return deco



class _Table(dict):  # type: ignore[type-arg]
    def cache_clear(self) -> None:
        self.clear()


def memo_table() -> dict[Any, Any]:
    """A plain dict for a memo kept by hand (its own key and bound), emptied with every memo
    table by :func:`clear_memo` (``spmdkit.ops.clear_cache()``)."""
    t = _Table()
    _tables.append(t)
    return t


class Recent(Generic[_V]):
    """The ``limit`` most recently used values by key, for a memo kept by hand: :meth:`get` makes
    a missing one and drops the least recently used over the limit; ``hits`` counts the values
    served again. Emptied with every memo table by :func:`clear_memo`
    (``spmdkit.ops.clear_cache()``); while memo tables are off (``set_cache_enabled(False)``)
    :meth:`get` makes every value afresh and keeps none. A key of object ids is sound only while
    those objects live: keep them in the value (an entry is dropped whole)."""

    __slots__ = ("__weakref__", "by_id", "hits", "limit", "values")

    def __init__(self, limit: int, by_id: bool = False) -> None:
        self.limit = limit
        self.values: OrderedDict[Any, _V] = OrderedDict()
        self.hits = 0
        #: keyed by the ids of objects its values hold (a plan, a program): emptied by
        #: :func:`release_by_id` when the objects a command made are out of every caller's reach
        self.by_id = by_id
        _recents.add(self)

    def __len__(self) -> int:
        return len(self.values)

    def get(self, key: Any, make: Callable[[], _V]) -> _V:
        """The value kept for ``key``, else ``make()`` (kept, the least recently used dropped
        beyond ``limit``)."""
        if not _enabled:
            return make()
        values = self.values
        got = values.get(key, _MISS)
        if got is not _MISS:
            self.hits += 1
            values.move_to_end(key)
            return got  # type: ignore[return-value]
        got = values[key] = make()
        if len(values) > self.limit:
            values.popitem(last=False)
        return got

    def known(self, key: Any) -> _V | None:
        """The value kept for ``key``, or None: a hot path's look-up, without :meth:`get`'s
        refresh of its place (a value read only so is the first dropped when the limit is met)
        or its count; None while memo tables are off, as :meth:`get` keeps none then."""
        return self.values.get(key) if _enabled else None

    def cache_clear(self) -> None:
        self.values.clear()


def gc_paused(fn: F) -> F:
    """``@gc_paused``: the cyclic garbage collector paused while ``fn`` runs (and resumed after,
    where it was on). A whole-model plan allocates hundreds of thousands of small containers that
    live on (ops, dist attrs, rule answers); each allocation burst otherwise triggers collections
    that walk the whole, growing heap, a third of a 126-layer plan's time, and find nothing
    (what these functions drop is freed by reference counting; a cycle left is collected after)."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not gc.isenabled():
            return fn(*args, **kwargs)
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            gc.enable()

    return wrapper  # type: ignore[return-value]
