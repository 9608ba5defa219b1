"""A seeded adversarial fuzzer of the Python rule API (``get_rule(name).infer_forward(...)``).

The library promises that every invalid argument to a rule is answered by an
:class:`~spmdkit.core.errors.SpmdError`, never another exception. :func:`fuzz_mode`
builds adversarial calls from a mode's declared parameters (``Mode.params``) and
collects every call that raised anything else::

    >>> from spmdkit.sim.fuzz import fuzz_all
    >>> report = fuzz_all(count=50, seed=0)
    >>> report.failures
    []

Each call starts from a valid one (half the time: a case of the simulator's
generators, answered as is a fifth of those times) or a plausible one (a mesh,
tensors of random ranks and sizes with legal dims_mappings, the attributes'
defaults or typical values) and applies one to three mutations: a wrong value in a slot (None, numbers of every kind and
size, NaN and infinities, strings, bytes, bytearrays, sets, dicts with mixed keys,
numpy scalars and arrays, deep nesting, foreign objects), tensors of unusual
ranks, huge / zero / dynamic sizes, tensors on other meshes, partials, empty or
wrong-length lists, too many or too few arguments, unknown or repeated keywords.
Sizes are adversarial but bounded (a call must return at once), except the
targeted huge sizes (up to ``2**63``) that a rule must refuse before it works.

``python -m spmdkit.sim.fuzz --count 1000`` runs every rule and mode (canonical
names) and prints the totals and any failure.
"""

from __future__ import annotations

import argparse
import random
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from spmdkit.core.dist_attr import TensorDistAttr
from spmdkit.core.errors import SpmdError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.spec import DistTensorSpec
from spmdkit.engine.registry import Rule, all_rules
from spmdkit.engine.signature import Mode, Param
from spmdkit.io.codec import parse_case
from spmdkit.sim.cases import generate_case

_MESH_SHAPES: tuple[tuple[int, ...], ...] = (
    (1,), (2,), (3,), (4,), (8,), (1, 1), (2, 2), (2, 3), (3, 1), (1, 4), (2, 2, 2), (4, 1, 2), (2, 1, 1, 2),
)
_SMALL_SIZES = (1, 2, 3, 4, 6, 8, 12, 16)
_ODD_SIZES = (0, 1, 5, 7, 9, 11, 13, 31, -1, 64)
_HUGE = (2**31, 2**31 - 1, 2**32 + 1, 2**53, 2**62, 2**63 - 1, 2**63, 2**64, 10**7, 10**9, 10**20)


def _deep(depth: int, leaf: Any = 1) -> Any:
    v: Any = leaf
    for _ in range(depth):
        v = [v]
    return v


def _deep_tuple(depth: int) -> Any:
    v: Any = 1
    for _ in range(depth):
        v = (v,)
    return v


class _Weird:
    """An object no rule expects (and whose comparisons raise)."""

    def __eq__(self, other: object) -> bool:
        raise RuntimeError("compared")

    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return "<weird>"


def _junk(r: random.Random, mesh: ProcessMesh) -> Any:
    """One adversarial value of any kind."""
    choices: list[Any] = [
        None, True, False, 0, 1, -1, 2, -2, 7, 2**31, 2**63, -(2**63), 2**64, 10**30,
        0.0, -0.0, 0.5, 1.0, -1.5, float("nan"), float("inf"), float("-inf"), 1e308, 5e-324,
        1 + 2j, "", "x", "sum", "float32", "-1", "0", "\x00", "é" * 3, b"", b"ab", bytearray(b"ab"),
        [], [[]], [None], [1, 2], [1, "a"], [1.5], [True, False], [-1, -1], [2**63], (), (1,), ((1, 2),),
        {}, {1: 2}, {1: 2, "a": 3}, {None: 1, 0: 2}, {(1,): [1]}, set(), {1, 2}, frozenset({3}),
        _deep(r.choice((50, 200, 2000))), _deep_tuple(r.choice((50, 200))), _Weird(), object(), ProcessMesh([2]),
        range(3), iter([1, 2]), slice(1, 2), Ellipsis, NotImplemented, type, len,
        np.int64(3), np.int32(-1), np.float32(1.5), np.float64("nan"), np.bool_(True), np.array([1, 2]),
        np.array(3), np.zeros((2, 2)), np.array([], dtype=np.int64), np.array(["a"]),
        _spec(r, mesh), [_spec(r, mesh), _spec(r, mesh)], [_spec(r, mesh), None],
    ]
    return r.choice(choices)


def _dims_mapping(r: random.Random, nd: int, mesh: ProcessMesh, p_shard: float) -> list[Any]:
    dm: list[Any] = [-1] * nd
    if nd == 0:
        return dm
    for d in range(mesh.ndim):
        if r.random() < p_shard:
            i = r.randrange(nd)
            if dm[i] == -1:
                dm[i] = d
            elif r.random() < 0.3:
                dm[i] = (*((dm[i],) if isinstance(dm[i], int) else dm[i]), d)
    return dm


def _spec(r: random.Random, mesh: ProcessMesh, nd: int | None = None, sizes: tuple[int, ...] = _SMALL_SIZES,
          p_shard: float = 0.4, p_partial: float = 0.1) -> DistTensorSpec:
    if nd is None:
        nd = r.choice((0, 1, 2, 2, 3, 3, 4, 5))
    shape = [r.choice(sizes) for _ in range(nd)]
    dm = _dims_mapping(r, nd, mesh, p_shard)
    partial: Any = None
    used = {d for e in dm for d in ((e,) if isinstance(e, int) else e) if d >= 0}
    free = [d for d in range(mesh.ndim) if d not in used]
    if free and r.random() < p_partial:
        partial = {r.choice(free): r.choice(("sum", "avg", "max", "min", "prod", "any", "all"))}
    return DistTensorSpec(shape, mesh=mesh, dims_mapping=dm, partial=partial)


_RAW_ENTRIES: tuple[Any, ...] = (
    -1, 0, 1, 2, 5, -2, 2**63, 1.5, True, None, "0", [0, 1], (1, 0), [0, 0], [-1, 0], [[0]], [], np.int64(0),
)
_RAW_PARTIALS: tuple[Any, ...] = (
    None, [0], [1], {0: "sum"}, {1: "avg"}, {0: "bogus"}, {5: "sum"}, {-1: "max"}, {"0": "min"}, [(0, "sum")],
    {0.0: "sum"}, {True: "sum"}, "sum", 0, {0, 1}, [(0, "sum", 1)], np.array([0]), {0: None},
)


def _raw_spec(r: random.Random, mesh: ProcessMesh) -> DistTensorSpec:
    """A spec from adversarial pieces (dims_mapping entries out of range, repeated, co-shards,
    of the wrong length or type; partials on sharding mesh dims or of unknown reduce types;
    odd sizes; meshes with odd process ids / names): most are refused by the constructors
    (SpmdError), the rest are legal but unusual."""
    if r.random() < 0.3:
        shp = list(r.choice(_MESH_SHAPES))
        n = 1
        for v in shp:
            n *= v
        ids = r.sample(range(3 * n), n) if r.random() < 0.5 else None
        names = [f"m{i}" for i in range(len(shp))] if r.random() < 0.5 else None
        mesh = ProcessMesh(shp, ids, names)
    nd = r.choice((0, 1, 2, 3, 4))
    shape: list[Any] = [r.choice((*_SMALL_SIZES, 0, -1)) for _ in range(nd)]
    if r.random() < 0.2:
        shape = [r.choice((-2, 1.5, True, None, 2**63, np.int64(2), "3")) for _ in range(max(nd, 1))]
    n_entries = nd if r.random() < 0.8 else r.choice((0, nd + 1, max(nd - 1, 0)))
    dm = [r.choice(_RAW_ENTRIES) if r.random() < 0.3 else r.choice((-1, *range(mesh.ndim)))
          for _ in range(n_entries)]
    partial = r.choice(_RAW_PARTIALS) if r.random() < 0.4 else None
    if r.random() < 0.5:
        return DistTensorSpec(shape, TensorDistAttr(mesh, dm, partial))
    return DistTensorSpec(shape, mesh=mesh, dims_mapping=dm, partial=partial)


def _attr(r: random.Random, p: Param) -> Any:
    """A typical value of an attribute (its default when it has one, most of the time)."""
    if not p.required and r.random() < 0.6:
        d = p.default
        return list(d) if isinstance(d, tuple) else d
    k = p.kind
    if k == "bool":
        return r.random() < 0.5
    if k == "int":
        return r.choice((-1, 0, 1, 2, -2, 3))
    if k in ("float", "scalar"):
        return r.choice((0.0, 1.0, 0.5, 1e-5, 2, -1.0))
    if k == "str":
        return r.choice(("", "sum", "mean", "NCHW", "NHWC", "float32", "upscale_in_train", "x"))
    if k == "ints":
        return [r.choice((-1, 0, 1, 2, 3)) for _ in range(r.choice((0, 1, 2, 3)))]
    if k == "floats":
        return [r.choice((0.0, 1.0, 0.5)) for _ in range(r.choice((0, 1, 2)))]
    return r.choice((None, 0, 1.5, "float32", [1, 2], {"a": 1}))


def _tensor_arg(r: random.Random, p: Param, mesh: ProcessMesh, nd_hint: int) -> Any:
    nd = nd_hint if r.random() < 0.6 else None
    if p.kind == "T":
        return _spec(r, mesh, nd)
    if p.kind == "T?":
        return None if r.random() < 0.3 else _spec(r, mesh, nd)
    n = r.choice((0, 1, 2, 2, 3, 4))
    items: list[Any] = [_spec(r, mesh, nd) for _ in range(n)]
    if p.kind == "[T?]" and items and r.random() < 0.3:
        items[r.randrange(len(items))] = None
    return items


def _base_call(r: random.Random, mode: Mode, mesh: ProcessMesh) -> list[Any]:
    nd_hint = r.choice((1, 2, 3, 4))
    out: list[Any] = []
    for p in mode.params:
        out.append(_tensor_arg(r, p, mesh, nd_hint) if p.is_tensor else _attr(r, p))
    return out


def _mutate_tensor(r: random.Random, v: Any, mesh: ProcessMesh) -> Any:
    """An adversarial tensor (or list of them) in place of ``v``."""
    kind = r.randrange(10)
    if kind == 0:  # huge sizes, sharded or not
        nd = r.choice((0, 1, 2, 3))
        sizes = tuple(r.choice(_HUGE) for _ in range(3))
        return _spec(r, mesh, nd, sizes + _SMALL_SIZES[:2])
    if kind == 1:  # zero, dynamic and odd sizes
        return _spec(r, mesh, r.choice((1, 2, 3, 4)), _ODD_SIZES)
    if kind == 2:  # another mesh
        other = ProcessMesh(list(r.choice(_MESH_SHAPES)))
        return _spec(r, other)
    if kind == 3:  # high rank
        return _spec(r, mesh, r.choice((6, 8, 9, 12)), (1, 2))
    if kind == 4:  # fully sharded, co-shards, partial
        return _spec(r, mesh, r.choice((1, 2, 3)), _SMALL_SIZES, p_shard=1.0, p_partial=1.0)
    if kind == 5:  # a list where one tensor is wanted, or the other way round
        if isinstance(v, (list, tuple)):
            return v[0] if v else _spec(r, mesh)
        return [v, v] if r.random() < 0.5 else [v]
    if kind == 6:  # a long list of tensors
        return [_spec(r, mesh, 1) for _ in range(r.choice((0, 17, 64)))]
    if kind == 8:  # built from raw adversarial pieces through the public constructors
        return _raw_spec(r, mesh)
    if kind == 7:  # a 0-D tensor
        return _spec(r, mesh, 0)
    return _junk(r, mesh)


def _mutate_attr(r: random.Random, p: Param, v: Any, mesh: ProcessMesh) -> Any:
    k = p.kind
    roll = r.randrange(6)
    if roll == 0:
        return _junk(r, mesh)
    if k in ("int", "scalar", "float") or roll == 1:
        return r.choice((*_HUGE, -(2**63), -(10**9), -1, -2, 0, 5, 64, 2.5, float("nan"), float("inf"),
                         np.int64(2), np.float64(0.5), True))
    if k in ("ints", "floats"):
        n = r.choice((0, 1, 3, 9, 40))
        pool = (*_HUGE[:5], -(2**63), -1, 0, 1, 2, 3, -3, 1.5, None, "a", np.int64(1), [1], float("nan"))
        items = [r.choice(pool) if r.random() < 0.4 else r.choice((-1, 0, 1, 2)) for _ in range(n)]
        return items if r.random() < 0.8 else tuple(items)
    if k == "str":
        return r.choice(("", "\x00", "x" * 1000, "SUM", "nchw", "None", 1, None, b"NCHW"))
    if k == "bool":
        return r.choice((0, 1, 2, -1, "true", "false", None, np.bool_(False), 1.0, [True]))
    return r.choice((np.array([1.0, 2.0]), {1, 2}, bytearray(b"z"), {1: 2, "k": [1]}, {"a": {2: {1.5: None}}},
                     [np.int32(4), {7}], _deep(3000), _deep_tuple(300), float("nan"), 2**64, _Weird()))


@dataclass
class Failure:
    """One call that raised something other than an SpmdError."""

    op: str
    mode: str
    call: str
    error: str
    traceback: str

    def __str__(self) -> str:
        return f"{self.op} [{self.mode}] {self.call}\n  -> {self.error}\n{self.traceback}"


@dataclass
class FuzzReport:
    calls: int = 0
    answered: int = 0
    refused: int = 0
    constructor_refused: int = 0  # calls not made: a DistTensorSpec / mesh constructor refused a piece
    failures: list[Failure] = field(default_factory=list)
    slowest: tuple[float, str] = (0.0, "")
    slow: list[tuple[float, str]] = field(default_factory=list)  # calls over SLOW_CALL_S
    per_mode: dict[tuple[str, str], int] = field(default_factory=dict)

    def merge(self, other: FuzzReport) -> None:
        self.calls += other.calls
        self.answered += other.answered
        self.refused += other.refused
        self.constructor_refused += other.constructor_refused
        self.failures.extend(other.failures)
        self.slow.extend(other.slow)
        self.per_mode.update(other.per_mode)
        if other.slowest[0] > self.slowest[0]:
            self.slowest = other.slowest


def _short(v: Any, limit: int = 300) -> str:
    try:
        s = repr(v)
    except Exception as e:  # a deep or hostile value: describe it instead
        s = f"<unrepresentable {type(v).__name__}: {type(e).__name__}>"
    return s if len(s) <= limit else s[: limit - 3] + "..."


def _text(e: BaseException, limit: int = 500) -> str:
    try:
        s = str(e)
    except Exception:  # a hostile __str__
        s = "<no message>"
    return s if len(s) <= limit else s[: limit - 3] + "..."


def _valid_pool(rule: Rule, mode_name: str, seed: int, n: int) -> list[tuple[ProcessMesh, list[Any]]]:
    """Up to ``n`` valid calls of the mode from the simulator's case generators (none where the
    rule has no generator): the starting points that reach the rules' deeper code."""
    out: list[tuple[ProcessMesh, list[Any]]] = []
    for i in range(n):
        try:
            case = generate_case(rule.name, mode_name, seed, i)
            if case is None:
                break
            c = parse_case(case)
        except SpmdError:
            continue
        out.append((c.mesh, list(c.args)))
    return out


def _make_call(r: random.Random, mode: Mode,
               pool: list[tuple[ProcessMesh, list[Any]]] | None = None) -> tuple[list[Any], dict[str, Any]]:
    if pool and r.random() < 0.5:  # a valid case, then (mostly) mutated
        mesh, base = r.choice(pool)
        args = list(base)
        n_mut = r.choice((0, 1, 1, 2, 3))
    else:
        mesh = ProcessMesh(list(r.choice(_MESH_SHAPES)))
        args = _base_call(r, mode, mesh)
        n_mut = r.choice((1, 1, 2, 3))
    params = mode.params
    kwargs: dict[str, Any] = {}
    for _ in range(n_mut):
        what = r.randrange(10)
        if what <= 5 and params:  # a slot
            i = r.randrange(len(params))
            p = params[i]
            if i >= len(args):
                continue
            args[i] = _mutate_tensor(r, args[i], mesh) if (p.is_tensor or r.random() < 0.15) else _mutate_attr(
                r, p, args[i], mesh)
        elif what == 6:  # None everywhere
            args = [None if r.random() < 0.5 else a for a in args]
        elif what == 7:  # too many or too few
            if r.random() < 0.5 and args:
                args = args[: r.randrange(len(args))]
            else:
                args = args + [_junk(r, mesh) for _ in range(r.choice((1, 2, 5)))]
        elif what == 8:  # keywords: all, some, unknown, repeated
            sub = r.randrange(4)
            if sub == 0:
                kwargs = {p.name: a for p, a in zip(params, args)}
                args = []
            elif sub == 1 and args:
                cut = r.randrange(len(args))
                kwargs = {p.name: a for p, a in zip(params[cut:], args[cut:])}
                args = args[:cut]
            elif sub == 2:
                kwargs = {r.choice(("mdoe", "x_", "axis ", "", "self", "args")): _junk(r, mesh)}
            elif params:
                kwargs = {params[0].name: args[0] if args else None}
        else:  # every tensor on one mesh, sharded on every mesh dim it can
            args = [_spec(r, mesh, a.ndim, p_shard=1.0) if isinstance(a, DistTensorSpec) else a for a in args]
    return args, kwargs


#: A call slower than this is listed in the report (not a failure: timings are not asserted).
SLOW_CALL_S = 0.25
_TARGET_SIZES = (10**7, 2**31, 2**62, 2**63, 2**64)


def _targeted_calls(r: random.Random, mode: Mode, n_bases: int = 2) -> list[tuple[list[Any], dict[str, Any]]]:
    """Huge sizes placed deliberately: every int-like attribute set to each of
    ``_TARGET_SIZES`` (and a list of them), and every axis of every tensor set to each, in a few
    plausible base calls. These are the calls where work proportional to a size would hang."""
    out: list[tuple[list[Any], dict[str, Any]]] = []
    for _ in range(n_bases):
        mesh = ProcessMesh(list(r.choice(_MESH_SHAPES[:8])))
        base = _base_call(r, mode, mesh)
        for i, p in enumerate(mode.params):
            if p.kind in ("int", "scalar", "float", "any"):
                for big in _TARGET_SIZES:
                    out.append(([*base[:i], big, *base[i + 1:]], {}))
            elif p.kind in ("ints", "floats"):
                for big in _TARGET_SIZES:
                    out.append(([*base[:i], [big], *base[i + 1:]], {}))
                    out.append(([*base[:i], [1] * 5000 if big == 10**7 else [big, 1], *base[i + 1:]], {}))
            elif isinstance(base[i], DistTensorSpec):
                t = base[i]
                for ax in range(t.ndim):
                    for big in _TARGET_SIZES:
                        shape = list(t.shape)
                        shape[ax] = big
                        spec = DistTensorSpec(shape, t.dist_attr)
                        out.append(([*base[:i], spec, *base[i + 1:]], {}))
                        # the same size on every tensor's same axis (shapes that agree)
                        same = [DistTensorSpec([*a.shape[:ax], big, *a.shape[ax + 1:]], a.dist_attr)
                                if isinstance(a, DistTensorSpec) and a.ndim > ax else a for a in base]
                        out.append((same, {}))
    return out


def _invoke(rule: Rule, mode_name: str, how: int, args: list[Any], kwargs: dict[str, Any]) -> Any:
    if how == 0:
        return rule.infer(mode_name, *args, **kwargs)
    if mode_name == "forward":
        return rule.infer_forward(*args, **kwargs)
    return rule.infer_backward(*args, **kwargs)


class CallTimeout(BaseException):
    """A call ran past the fuzzer's per-call limit (a hang)."""


def _on_alarm(signum: int, frame: Any) -> None:
    raise CallTimeout("the call ran past the per-call time limit")


def fuzz_mode(rule: Rule, mode_name: str, count: int, seed: int, call_timeout: float | None = 10.0,
              targeted: bool = True) -> FuzzReport:
    """``count`` random adversarial calls of one rule's mode, after the targeted huge-size calls
    (``targeted``); any non-SpmdError is a failure, and so is a call that runs past
    ``call_timeout`` seconds (where the platform has ``signal.setitimer``)."""
    rep = FuzzReport()
    use_alarm = bool(call_timeout) and hasattr(signal, "setitimer")
    if use_alarm:
        old = signal.signal(signal.SIGALRM, _on_alarm)
    try:
        _fuzz_mode(rep, rule, mode_name, count, seed, call_timeout if use_alarm else None, targeted)
    finally:
        if use_alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
    return rep


def _fuzz_mode(rep: FuzzReport, rule: Rule, mode_name: str, count: int, seed: int,
               call_timeout: float | None, targeted_calls: bool) -> None:
    mode = rule.mode(mode_name)
    r = random.Random(f"{seed}:{rule.name}:{mode_name}")
    targeted = _targeted_calls(r, mode) if targeted_calls else []
    pool = _valid_pool(rule, mode_name, seed, 8)
    for k in range(count + len(targeted)):
        if k < len(targeted):
            args, kwargs = targeted[k]
        else:
            try:
                args, kwargs = _make_call(r, mode, pool)
            except SpmdError:
                rep.constructor_refused += 1  # an illegal spec refused by its constructor: no rule call
                continue
            except Exception as e:  # a constructor failing otherwise is a failure too
                rep.failures.append(Failure(
                    "<constructor>", mode_name, f"building a call of {rule.name}",
                    f"{type(e).__name__}: {_text(e)}", traceback.format_exc(limit=-4),
                ))
                continue
        how = r.randrange(2)
        t0 = time.perf_counter()
        try:
            if call_timeout:
                signal.setitimer(signal.ITIMER_REAL, call_timeout)
            try:
                _invoke(rule, mode_name, how, args, kwargs)
            finally:
                if call_timeout:
                    signal.setitimer(signal.ITIMER_REAL, 0)
            rep.answered += 1
        except SpmdError:
            rep.refused += 1
        except BaseException as e:  # the very thing collected
            if isinstance(e, KeyboardInterrupt):
                raise
            rep.failures.append(Failure(
                rule.name, mode_name, f"args={_short(args)} kwargs={_short(kwargs)}",
                f"{type(e).__name__}: {_text(e)}", traceback.format_exc(limit=-4),
            ))
        dt = time.perf_counter() - t0
        rep.calls += 1
        if dt > SLOW_CALL_S:
            rep.slow.append((dt, f"{rule.name} [{mode_name}] args={_short(args, 200)}"))
        if dt > rep.slowest[0]:
            rep.slowest = (dt, f"{rule.name} [{mode_name}] args={_short(args, 200)}")
    rep.per_mode[(rule.name, mode_name)] = count + len(targeted)


def canonical_rules() -> list[Rule]:
    """Every registered rule once (aliases share their rule), sorted by name."""
    seen: dict[str, Rule] = {}
    for r in all_rules().values():
        seen.setdefault(r.name, r)
    return [seen[n] for n in sorted(seen)]


def fuzz_all(count: int, seed: int = 0, names: list[str] | None = None,
             call_timeout: float | None = 10.0) -> FuzzReport:
    """``count`` adversarial calls for every rule-mode (or those of ``names``)."""
    total = FuzzReport()
    for rule in canonical_rules():
        if names and rule.name not in names:
            continue
        for m in rule.modes:
            total.merge(fuzz_mode(rule, m, count, seed, call_timeout))
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m spmdkit.sim.fuzz", description=__doc__.split("\n")[0])
    ap.add_argument("--count", type=int, default=1000, help="calls per rule and mode (default 1000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rule", action="append", help="only these rules (repeatable)")
    ap.add_argument("--call-timeout", type=float, default=10.0, help="seconds before a call counts as a hang")
    ap.add_argument("--show", type=int, default=20, help="failures to print in full (default 20)")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    rep = fuzz_all(a.count, a.seed, a.rule, a.call_timeout)
    dt = time.perf_counter() - t0
    print(f"{len(rep.per_mode)} rule-modes, {rep.calls} calls in {dt:.1f} s: {rep.answered} answered, "
          f"{rep.refused} refused (SpmdError), {len(rep.failures)} other exceptions "
          f"({rep.constructor_refused} built specs refused by their constructors); "
          f"slowest call {rep.slowest[0] * 1e3:.1f} ms ({rep.slowest[1]})")
    for dt, what in sorted(rep.slow, reverse=True)[:10]:
        print(f"  slow: {dt * 1e3:.0f} ms {what}")
    by_kind: dict[tuple[str, str, str], int] = {}
    for f in rep.failures:
        key = (f.op, f.mode, f.error.split(":")[0])
        by_kind[key] = by_kind.get(key, 0) + 1
    for (op, mode, err), n in sorted(by_kind.items()):
        print(f"  {op} [{mode}] {err} x{n}")
    shown: set[tuple[str, str, str]] = set()
    for f in rep.failures:
        key = (f.op, f.mode, f.error.split(":")[0])
        if key in shown or len(shown) >= a.show:
            continue
        shown.add(key)
        print(f)
    return 1 if rep.failures else 0


if __name__ == "__main__":
    sys.exit(main())
