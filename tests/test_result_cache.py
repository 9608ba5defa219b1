"""The per-call result cache: a cached answer equals a fresh one for every rule and mode, a key
function binds exactly as ``Mode.bind`` does, tensors equal by hash but not by value never share an
answer, and an answer is stored on its key's second call. Seeded and bounded in time."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from spmdkit.core.errors import SpmdError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.spec import DistTensorSpec
from spmdkit.engine import cache_keys
from spmdkit.engine.registry import cache_stats, clear_cache, get_rule, rule_names, set_cache_enabled
from spmdkit.io.codec import parse_case

GOLDEN = Path(__file__).parent / "golden"


def _cases() -> dict[tuple[str, str], list[dict[str, Any]]]:
    """Valid golden cases per (canonical rule, mode)."""
    out: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for f in sorted(GOLDEN.glob("*.jsonl")):
        for line in f.read_text().splitlines():
            if not line.strip():
                continue
            d = json.loads(line)
            if "error" in d.get("expect", {}):
                continue
            c = d["case"]
            out.setdefault((get_rule(c["rule"]).name, c.get("mode", "forward")), []).append(c)
    return out




def _answer(case: dict[str, Any]) -> Any:
    """The case's answer as plain data (or its error class), the arguments parsed anew."""
    try:
        r = parse_case(case).run()
    except SpmdError as exc:
        return type(exc).__name__
    return (r.inputs, r.outputs)


def _call(case: dict[str, Any]) -> Any:
    c = parse_case(case)
    return c.rule.infer(c.mode, *c.args)


def _with_generated(cases: dict[tuple[str, str], list[dict[str, Any]]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """Add, for each mode without a golden case, the first valid case of the simulator's generator."""
    from spmdkit.sim.cases import generate_case

    for name in rule_names(include_aliases=False):
        rule = get_rule(name)
        for mode in rule.modes:
            if (name, mode) in cases:
                continue
            for i in range(10):
                try:
                    c = generate_case(name, mode, 0, i)
                except Exception:  # a generator that cannot build this mode's case
                    c = None
                if c is None:
                    break
                if not isinstance(_answer(c), str):
                    cases[(name, mode)] = [c]
                    break
    return cases


def _all_modes() -> int:
    return sum(len(get_rule(n).modes) for n in rule_names(include_aliases=False))


CASES = _with_generated(_cases())


def test_every_rule_mode_cached_answer_equals_fresh() -> None:
    """Every mode with a case (golden, else generated; two cases where there are two): the third
    call with freshly parsed (equal, not identical) tensors is served from the cache (the stored
    object comes back) and equals the answer computed with every cache off."""
    assert len(CASES) >= 0.95 * _all_modes()
    rng = random.Random(5)
    modes = 0
    for key in sorted(CASES):
        for case in rng.sample(CASES[key], min(2, len(CASES[key]))):
            set_cache_enabled(False)
            try:
                fresh = _answer(case)
            finally:
                set_cache_enabled(True)
            if isinstance(fresh, str):
                continue
            clear_cache()
            first, second, third = _call(case), _call(case), _call(case)
            assert third is second, f"{key}: the third call was not answered from the cache"
            for got in (first, second, third):
                assert (got.inputs, got.outputs) == fresh, f"{key} {case}: cached {got} != fresh {fresh}"
            modes += 1
    clear_cache()
    assert modes >= len(CASES)


def test_first_call_stores_nothing_second_stores_third_hits() -> None:
    clear_cache()
    case = {"rule": "matmul", "mesh": [2, 2], "args": [{"shape": [4, 6], "dims_mapping": [0, -1]},
                                                       {"shape": [6, 8], "dims_mapping": [-1, 1]}]}
    a = _call(case)
    assert cache_stats()["entries"] == 0 and cache_stats()["seen"] == 1
    b = _call(case)
    assert cache_stats()["entries"] == 1 and b is not a and b == a
    assert _call(case) is b
    clear_cache()
    assert cache_stats()["entries"] == 0 and cache_stats()["seen"] == 0


def test_equal_hash_different_tensor_is_not_served_the_other_answer() -> None:
    """A tensor enters the key by hash: a hit also compares the tensors, so a spec forged to have
    another's hash gets its own answer, not the stored one."""
    m = ProcessMesh([2, 2])
    rule = get_rule("softmax")
    a = DistTensorSpec([4, 8], mesh=m, dims_mapping=[0, 1])
    b = DistTensorSpec([4, 8], mesh=m, dims_mapping=[1, -1])
    clear_cache()
    rule.infer_forward(a, 0)
    stored = rule.infer_forward(a, 0)
    set_cache_enabled(False)
    try:
        fresh_b = rule.infer_forward(b, 0)
    finally:
        set_cache_enabled(True)
    assert fresh_b != stored
    object.__setattr__(b, "_hash", a._hash)  # a hash collision, forged
    assert rule.infer_forward(b, 0) == fresh_b
    # through the general path too (an argument given as a keyword)
    clear_cache()
    for _ in range(2):
        rule.infer_forward(a, axis=0)
    assert rule.infer_forward(b, axis=0) == fresh_b
    clear_cache()


def _typed(v: Any) -> Any:
    """``v`` with every value's class beside it (so 1 != True != 1.0, (1,) != [1], 0.0 != -0.0)."""
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, tuple(_typed(x) for x in v))
    if isinstance(v, float):
        return ("float", repr(v))
    return (type(v).__name__, v)


def _variants(rng: random.Random, args: list[Any], params: Any) -> list[tuple[Any, ...]]:
    """The call itself and type-perturbed twins: lists as tuples, ints as floats and bools, floats
    as ints, -0.0, a huge int, None for a tensor, trailing arguments left to their defaults."""
    out = [tuple(args)]
    for _ in range(6):
        v = list(args)
        i = rng.randrange(len(v))
        x = v[i]
        choices: list[Any] = [None, -0.0, 0.0, 2**70, "s", True, 1]
        if isinstance(x, list) and x:
            choices += [tuple(x), [float(y) if isinstance(y, int) else y for y in x], [True] * len(x),
                        [2 ** 70, *x[1:]], [None, *x[1:]], [*x[:-1], None]]
        elif isinstance(x, bool):
            choices += [int(x)]
        elif isinstance(x, int):
            choices += [float(x), bool(x % 2), -x]
        elif isinstance(x, float):
            choices += [int(x), -x]
        v[i] = rng.choice(choices)
        out.append(tuple(v))
    n_req = sum(1 for p in params if p.required)
    if len(args) > n_req:
        out.append(tuple(args[: rng.randint(n_req, len(args) - 1)]))
    return out


def test_key_function_binds_as_mode_bind() -> None:
    """Wherever a mode's key function binds a call itself, it gives what ``Mode.bind`` gives (values
    and their classes), and it never binds a call that ``Mode.bind`` refuses."""
    rng = random.Random(11)
    checked = bound_here = 0
    for name in rule_names(include_aliases=False):
        rule = get_rule(name)
        for mode_name in rule.modes:
            cases = CASES.get((name, mode_name))
            if not cases:
                continue
            m = rule.mode(mode_name)
            tag = 0 if m is rule.forward else 1
            try:
                args = list(parse_case(rng.choice(cases)).args)
            except SpmdError:
                continue
            for call in _variants(rng, args, m.params):
                if len(call) > len(m.params):
                    continue
                kn = cache_keys.key_function(m.params, len(call), tag, {})(call)
                try:
                    want: Any = _typed(m.bind(name, call, {}))
                except SpmdError:
                    want = None
                checked += 1
                if kn is None or kn[4] is None:
                    continue
                bound_here += 1
                assert want is not None, f"{name} {mode_name}: key function bound {call!r}, bind refuses it"
                assert _typed(kn[4]) == want, f"{name} {mode_name}: {call!r} bound as {kn[4]!r}"
    assert checked > 2000 and bound_here > 800


def test_twins_that_bind_alike_share_an_entry_others_do_not() -> None:
    """[1, 0] and (1, 0) bind alike (a tuple): one entry; True where an int is declared is refused,
    never served the int's answer."""
    m = ProcessMesh([2])
    x = DistTensorSpec([4, 6], mesh=m, dims_mapping=[0, -1])
    rule = get_rule("transpose")
    clear_cache()
    rule.infer_forward(x, [1, 0])
    stored = rule.infer_forward(x, [1, 0])
    assert rule.infer_forward(x, (1, 0)) is stored
    softmax = get_rule("softmax")
    for _ in range(2):
        softmax.infer_forward(x, 1)
    with pytest.raises(SpmdError):
        softmax.infer_forward(x, True)
    clear_cache()


def test_memo_stores_on_the_second_call_and_is_bypassed_when_off() -> None:
    from spmdkit.engine.memo import memo, memo_enabled, set_memo_enabled

    calls: list[tuple[int, ...]] = []

    @memo(maxsize=3)
    def double(*xs: int) -> tuple[int, ...]:
        calls.append(xs)
        return tuple(2 * x for x in xs)

    assert memo_enabled()
    assert [double(1), double(1), double(1), double(1)] == [(2,)] * 4
    assert len(calls) == 2  # computed on the first and second call, then served
    for k in range(2, 9):  # past maxsize the tables start over; answers stay right
        assert double(k) == double(k) == double(k) == (2 * k,)
    set_memo_enabled(False)
    try:
        n = len(calls)
        assert double(1) == (2,) and len(calls) == n + 1
    finally:
        set_memo_enabled(True)
    double.cache_clear()  # type: ignore[attr-defined]
    n = len(calls)
    double(5)
    double(5)
    assert len(calls) == n + 2


def test_recent_keeps_the_most_recently_used_and_is_reached_by_clear_cache_and_the_switch() -> None:
    """engine.memo.Recent (the op_communication, step compute, fusion, MoE and built-model memos):
    the ``limit`` most recently used values, a value served again moved to the front; emptied by
    spmdkit.ops.clear_cache() (also one an object owns); with the caches off every get makes."""
    from spmdkit.engine.memo import Recent
    from spmdkit.ops import set_cache_enabled

    made: list[str] = []

    def make(k: str) -> str:
        made.append(k)
        return k.upper()

    r: Recent[str] = Recent(2)
    assert [r.get(k, lambda k=k: make(k)) for k in "abab"] == ["A", "B", "A", "B"]
    assert made == ["a", "b"] and r.hits == 2 and len(r) == 2
    r.get("a", lambda: make("a"))  # a used last: c pushes b out
    r.get("c", lambda: make("c"))
    assert list(r.values) == ["a", "c"]
    r.get("b", lambda: make("b"))
    assert made == ["a", "b", "c", "b"] and list(r.values) == ["c", "b"]
    # known: the look-up alone (no refresh of the order, no count)
    assert r.known("c") == "C" and r.known("a") is None and list(r.values) == ["c", "b"] and r.hits == 3
    set_cache_enabled(False)
    try:
        assert r.known("c") is None  # off: nothing kept before is served
    finally:
        set_cache_enabled(True)
    clear_cache()
    assert len(r) == 0
    set_cache_enabled(False)
    try:
        assert r.get("d", lambda: make("d")) == r.get("d", lambda: make("d")) == "D"
        assert made[-2:] == ["d", "d"] and len(r) == 0
    finally:
        set_cache_enabled(True)
