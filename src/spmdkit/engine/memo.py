"""Memo tables for pure functions of a rule call's inputs, switchable as one.

Rules and the engine memoize pure functions keyed by what a call depends on (mappings,
shapes, attributes). ``spmdkit.rules.set_cache_enabled(False)`` turns every such table off
together with the rule result cache, so that an "uncached" call computes its answer from
scratch (the benchmark's uncached figure means exactly that).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache, wraps
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

_enabled = True
_tables: list[Any] = []


def set_memo_enabled(enabled: bool) -> None:
    global _enabled
    _enabled = bool(enabled)


def memo_enabled() -> bool:
    return _enabled


def clear_memo() -> None:
    for t in _tables:
        t.cache_clear()


def memo(maxsize: int = 65536) -> Callable[[F], F]:
    """``@memo()``: like ``functools.lru_cache``, bypassed while memo tables are off."""

    def deco(fn: F) -> F:
        cached = lru_cache(maxsize=maxsize)(fn)
        _tables.append(cached)

        @wraps(fn)
        def wrapper(*args: Any) -> Any:
            if _enabled:
                return cached(*args)
            return fn(*args)

        wrapper.cache_clear = cached.cache_clear  # type: ignore[attr-defined]
        wrapper.raw = fn  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return deco
