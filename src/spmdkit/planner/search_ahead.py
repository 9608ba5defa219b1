"""A second process that computes a lazy search's bounds ahead of it (issue 30).

A pruned search whose layer floors are lazy (:func:`spmdkit.planner.search._step_bounds`: more
layer keys than it is worth planning up front; DeepSeek-V3 on 2,048 devices has 223) refines
each configuration's bound when its turn comes (:class:`Refiner`): its layer key planned on a
shallow copy (:meth:`spmdkit.planner.search_floor.StepFloor.of`), the pipelines' split floors,
under ZeRO-3 its parameter gathers' copies; one after the other with the configurations it
plans, on one core. A bound is a pure function of the configuration, so where the process has a
second core :class:`Ahead` forks one worker that computes the bounds in the order the search
takes the configurations and sends each back with the layer floors it planned. The search takes
a bound from it where it has come or is being computed (it waits for it), and computes it
itself otherwise: each configuration is claimed once, under a lock; the worker skips what the
search has passed and what the best step found already prunes (its FLOPs bound at least the
best: the search's best only falls, so the search will not refine it). A configuration's bound
from its own plans (``gathers``: ZeRO-3's parameter gathers, every rank's tail) is computed by
the worker where the first is under the best found so far (so wherever the search will need
it). The strategies' notes a bound's plans raise in the worker are sent with it and raised when
the search takes it. While the worker computes the bound the search waits for, the search
computes the next free ones itself (within :data:`LOOKAHEAD`).

The search's answer, its rows and what it prunes do not depend on who computed a bound
(``tests/test_search_ahead.py``); only the wall time does. The worker is forked (the search's
models, bounds and floor are its memory as they were; only the bounds and floors it sends are
pickled), exits when its work is done or the search closes the pipe (:meth:`Ahead.close`, or
when the :class:`Ahead` is collected), and is a daemon (it dies with the search's process).
Where ``fork`` is not available or the process has one core, none is started; a caller whose
other threads may hold locks when it searches (``fork`` copies only the calling thread) passes
``workers=0``.
"""

from __future__ import annotations

import heapq
import math
import multiprocessing
import os
import queue
import signal
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from multiprocessing.connection import Connection
from typing import Any

from spmdkit.planner.search_floor import NO_FLOOR, StepFloor
from spmdkit.planner.search_space import Config

#: a configuration's state in the shared array: free, computed by the search, by the worker
_FREE, _SEARCH, _WORKER = 0, 1, 2
#: how far past its place the search looks for a bound to compute while it waits for the worker
LOOKAHEAD = 64


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class Ahead:
    """A forked process computing ``bound(cfg)`` (the search's step bound on ``floor``'s layer
    floors, :func:`spmdkit.planner.search._step_bound`) of each of ``order`` (configurations, in
    the order the search takes them) ahead of the search (module docstring), and sending each
    with the layer floors it planned for it."""

    def __init__(self, floor: StepFloor, order: Sequence[Config], bound: Callable[..., float],
                 lows: Mapping[Config, float] | None = None) -> None:
        self.floor, self.bound = floor, bound
        self.lows = lows or {}
        self.order = list(dict.fromkeys(order))
        self.index = {c: i for i, c in enumerate(self.order)}
        self.got: dict[int, tuple[float, float | None, list[Any]]] = {}
        #: bounds the search took from here (the worker's, and those it computed ahead of its
        #: place while the worker computed the one it waited for: ``meanwhile``); of them, those
        #: with the configuration's own plans
        self.taken = self.gathered = self.meanwhile = 0
        ctx = multiprocessing.get_context("fork")
        self.state = ctx.RawArray("b", len(self.order))
        self.at = ctx.RawValue("i", 0)  # the search's place in ``order``: the worker skips what it has passed
        self.best = ctx.RawValue("d", math.inf)  # the best step the search has found
        self.lock = ctx.Lock()
        self.conn, child = ctx.Pipe(duplex=False)
        self.alive = True
        self.proc = ctx.Process(target=self._work, args=(bound, child), daemon=True, name="spmdkit-floors")
        self.proc.start()
        child.close()
        weakref.finalize(self, _stop, self.proc, self.conn)

    def _claim(self, i: int, who: int) -> bool:
        with self.lock:
            if self.state[i] != _FREE:
                return False
            self.state[i] = who
            return True

    def _work(self, bound: Callable[..., float], conn: Connection) -> None:
        """The worker: each configuration's bound, in order, where the search has not claimed it;
        its bound from its own plans too (``gathers``) where the first is under the best step
        found so far (the search's best only falls: where the worker's is not under it, the
        search's will not be when it gets there)."""
        self.conn.close()
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the search's to handle (it stops the worker)
        cache = self.floor.cache
        # sent by a thread: a full pipe (the search planning a configuration for seconds, not
        # reading) must not stop the worker computing
        out: queue.SimpleQueue[Any] = queue.SimpleQueue()
        feeder = threading.Thread(target=_feed, args=(out, conn), daemon=True)
        feeder.start()
        try:
            for i, cfg in enumerate(self.order):
                if i < self.at.value or self.lows.get(cfg, -math.inf) >= self.best.value \
                        or not self._claim(i, _WORKER):
                    continue
                before, had = self.floor.plans, set(cache)
                low, z, notes = self._one(cfg, bound)
                new = {k: (None if v is NO_FLOOR else v) for k, v in cache.items() if k not in had}
                out.put((i, low, z, new, self.floor.plans - before, notes))
        except Exception:
            pass  # what it has not received itself (and raises what that raises)
        finally:
            out.put(None)
            feeder.join()
            conn.close()

    def _one(self, cfg: Config, bound: Callable[..., float]) -> tuple[float, float | None, list[Any]]:
        """``cfg``'s bound, its bound from its own plans where the first is under the best found so
        far, and the notes their plans raised."""
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            low = bound(cfg)
            z = bound(cfg, gathers=True) if low < self.best.value and self.floor.own_key(cfg) else None
        return low, z, [(w.message, w.category) for w in said]

    def _next_free(self, j: int) -> int | None:
        """The first configuration after ``j`` (within :data:`LOOKAHEAD`) that neither has claimed
        and whose bound so far is under the best found, claimed for the search."""
        for k in range(j + 1, min(j + 1 + LOOKAHEAD, len(self.order))):
            if self.state[k] == _FREE and self.lows.get(self.order[k], -math.inf) < self.best.value \
                    and self._claim(k, _SEARCH):
                return k
        return None

    def _receive(self, block: bool) -> bool:
        """One bound from the worker, its layer floors into the floor's cache (``block``: wait
        for it); False when none came (the worker has ended where ``block``)."""
        if not self.alive or not (block or self.conn.poll()):
            return False
        try:
            i, low, z, new, plans, notes = self.conn.recv()
        except (EOFError, OSError):
            self.alive = False
            return False
        for k, v in new.items():
            self.floor.cache.setdefault(k, NO_FLOOR if v is None else v)
        self.floor.plans += plans
        self.got[i] = (low, z, notes)
        return True

    def take(self, cfg: Config, best: float) -> tuple[float, float | None] | None:
        """``cfg``'s bound from the worker and, where it computed it, its bound from its own plans
        (``gathers``: ZeRO-3's gathers, each rank's tail; the notes their plans raised, raised
        now), or None: the search computes them (claimed, so the worker does not). ``best``: the
        best step the search has found."""
        self.best.value = best
        while self._receive(block=False):
            pass
        i = self.index.get(cfg)
        if i is None:
            return None
        self.at.value = i
        if i not in self.got and self._claim(i, _SEARCH):
            return None
        j = i
        while i not in self.got:  # the worker is computing it: the next ones meanwhile, then wait
            nxt = self._next_free(j)
            if nxt is not None:
                j = nxt
                self.got[j] = self._one(self.order[j], self.bound)
                self.meanwhile += 1
                while self._receive(block=False):
                    pass
            elif not self._receive(block=True):
                return None  # the worker ended without it: the search computes it
        low, z, notes = self.got.pop(i)
        for message, category in notes:
            warnings.warn(message, category, stacklevel=2)
        self.taken += 1
        self.gathered += z is not None
        return low, z

    def close(self) -> None:
        """Stop the worker (it may be computing bounds no one needs now)."""
        self.alive = False
        _stop(self.proc, self.conn)


def _feed(out: queue.SimpleQueue[Any], conn: Connection) -> None:
    """The worker's sender: each item of ``out`` through ``conn`` until None (or the search has
    closed the pipe)."""
    try:
        for item in iter(out.get, None):
            conn.send(item)
    except (BrokenPipeError, OSError):
        pass


def _stop(proc: Any, conn: Connection) -> None:
    conn.close()
    if proc.is_alive():
        proc.terminate()
    proc.join()


class Refiner:
    """The search's refinement of a configuration's bound when its turn comes (``bound``: the
    search's ``_step_bound`` on ``floor``): its layers' floor where the floors are ``lazy`` (from
    an :class:`Ahead` where one is started), then its own plans' (``gathers``: under ZeRO-3 its
    parameter gathers', two more shallow copies, and every rank's tail,
    :mod:`spmdkit.planner.search_floor_tail`, one; so only where the first does not reach the
    best step found)."""

    def __init__(self, floor: StepFloor | None, lazy: bool, bound: Callable[..., float]) -> None:
        self.floor, self.lazy, self.bound = floor, lazy, bound
        self.ahead: Ahead | None = None

    def start(self, order: Iterable[Config], workers: int | None, lows: Mapping[Config, float] | None = None) -> None:
        """An :class:`Ahead` computing the bounds of ``order`` where ``workers`` (default: one
        where this process may run on two cores or more) is at least 1 and ``fork`` is
        available; else none (the search computes each itself)."""
        n = (1 if cores() > 1 else 0) if workers is None else workers
        if self.floor is not None and n >= 1 and "fork" in multiprocessing.get_all_start_methods():
            self.ahead = Ahead(self.floor, list(order), self.bound, lows)

    def wants(self, cfg: Config) -> bool:
        """Whether ``cfg``'s bound can be refined."""
        return self.floor is not None and (self.lazy or self.floor.own_key(cfg) is not None)

    def refine(self, cfg: Config, low: float, best: float) -> float:
        """``cfg``'s refined bound (``low``: its bound so far; ``best``: the best step found)."""
        z = None
        if self.lazy:
            got = self.ahead.take(cfg, best) if self.ahead is not None else None
            low, z = got if got is not None else (self.bound(cfg), None)
        if low < best and self.floor is not None and self.floor.own_key(cfg) is not None:
            low = z if z is not None else self.bound(cfg, gathers=True)
        return low

    def close(self) -> None:
        if self.ahead is not None:
            self.ahead.close()


def least_refined(order: Sequence[Config], lows: dict[Config, float], refine: Callable[[Config], float],
                  n: int) -> list[Config]:
    """The ``n`` configurations of ``order`` of least refined bound: best first on ``lows`` (ties
    in ``order``'s order), each refined (``refine``: its bound from its own plans, ``lows``
    updated to the larger) when it comes first, taken when it comes first refined. Each taken
    one's refined bound is no more than any other's (a bound only rises when refined), and only
    those that come first are refined (a search's seeds: :func:`spmdkit.planner.search._seeds`)."""
    heap = [(lows[c], i, False) for i, c in enumerate(order)]
    heapq.heapify(heap)
    out: list[Config] = []
    while heap and len(out) < n:
        _low, i, done = heapq.heappop(heap)
        c = order[i]
        if done:
            out.append(c)
            continue
        lows[c] = max(lows[c], refine(c))
        heapq.heappush(heap, (lows[c], i, True))
    return out


__all__ = ["Ahead", "Refiner", "cores", "least_refined"]
