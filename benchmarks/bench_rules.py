"""Per-rule call cost: spmdkit uncached and cached, and Paddle 3.3.1's C++ rule beside it when importable.

    python benchmarks/bench_rules.py [--repeat N] [--number N] [RULE ...]

Prints one row per case: the median microseconds per call of

* ``spmdkit (uncached)``: ``get_rule(name).infer_forward(*args)`` with the result cache off,
  so every call runs the rule;
* ``spmdkit (cached)``: the same call with the cache on (a repeated call returns the stored
  answer, looked up by a typed key of the arguments before binding);
* ``paddle``: ``core.get_phi_spmd_rule(name).infer_forward(*args)`` with Paddle's own
  DistTensorSpec arguments built once, when ``paddle`` can be imported (run this script with
  a Python that has paddlepaddle==3.3.1 and spmdkit's ``src`` on ``sys.path``, e.g.
  ``PYTHONPATH=src /path/to/paddle-venv/bin/python benchmarks/bench_rules.py``);
* ``spmdkit distinct`` / ``paddle distinct``: a case never seen before on every call (one
  size of the case, ``VARY``, scaled by the call's index, so every call has new shapes and
  divisibility is kept), with the result cache on as by default; each round uses shapes no
  earlier round used. The ratio of these two is what a planner exploring new shapes sees.

``--all-cached`` times instead a repeated (cached) call of every registered rule-mode, one valid
case each (golden or generated), and prints the slowest.

``--timer cpu`` times with this process's CPU time instead of the wall clock (both sides alike;
on a shared, loaded machine the ratios are then far steadier).

Argument construction (the specs of every distinct call included) is outside the timed loop
for both sides. The timings are taken round by round (uncached, cached, paddle, distinct,
paddle distinct, then again), and each figure is the median over the rounds, so a load change
on the machine during the run does not favour one side.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import timeit
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from spmdkit.io.codec import parse_case
from spmdkit.ops import has_rule, set_cache_enabled


def _t(shape: list[int], dm: list[Any]) -> dict[str, Any]:
    return {"shape": shape, "dims_mapping": dm}


#: (label, case): a case in the INTERFACE format.
CASES: list[tuple[str, dict[str, Any]]] = [
    ("reshape", {"rule": "reshape", "mesh": [2, 4], "mode": "forward",
                 "args": [_t([6, 12, 48, 24], [0, 1, -1, -1]), [1, 72, 48, 4, 6]]}),
    ("matmul 3-D", {"rule": "matmul", "mesh": [2, 4], "mode": "forward",
                    "args": [_t([8, 1024, 512], [0, -1, 1]), _t([512, 2048], [1, -1]), False, False]}),
    ("matmul backward", {"rule": "matmul", "mesh": [2, 4], "mode": "backward",
                         "args": [_t([8, 1024, 512], [-1, -1, -1]), _t([512, 2048], [-1, -1]),
                                  _t([8, 1024, 2048], [0, -1, 1]), False, False]}),
    ("layer_norm", {"rule": "layer_norm", "mesh": [2, 4], "mode": "forward",
                    "args": [_t([8, 1024, 768], [0, 1, -1]), _t([768], [-1]), _t([768], [-1]), 1e-5, 2]}),
    ("layer_norm backward", {"rule": "layer_norm", "mesh": [2, 4], "mode": "backward",
                             "args": [_t([8, 1024, 768], [-1, -1, -1]), _t([768], [-1]), _t([768], [-1]),
                                      _t([8, 1024, 768], [0, 1, -1]), _t([8, 1024], [0, 1]),
                                      _t([8, 1024], [0, 1]), 1e-5, 2]}),
    ("add (broadcast)", {"rule": "add", "mesh": [2, 4], "mode": "forward",
                         "args": [_t([8, 1024, 768], [0, -1, 1]), _t([768], [-1])]}),
    ("relu", {"rule": "relu", "mesh": [2, 4], "mode": "forward", "args": [_t([8, 1024, 768], [0, -1, 1])]}),
    ("softmax", {"rule": "softmax", "mesh": [2, 4], "mode": "forward",
                 "args": [_t([8, 12, 1024, 1024], [0, 1, -1, -1]), -1]}),
    ("sum", {"rule": "sum", "mesh": [2, 4], "mode": "forward",
             "args": [_t([8, 1024, 768], [0, -1, 1]), [1, 2], False]}),
    ("transpose", {"rule": "transpose", "mesh": [2, 4], "mode": "forward",
                   "args": [_t([8, 1024, 12, 64], [0, -1, 1, -1]), [0, 2, 1, 3]]}),
    ("conv2d", {"rule": "conv2d", "mesh": [2, 4], "mode": "forward",
                "args": [_t([8, 64, 32, 32], [0, 1, -1, -1]), _t([128, 64, 3, 3], [-1, 1, -1, -1])]}),
    ("embedding", {"rule": "embedding", "mesh": [2, 4], "mode": "forward",
                   "args": [_t([8, 1024], [0, -1]), _t([32000, 4096], [1, -1]), -1, False]}),
    ("flash_attention", {"rule": "flash_attention", "mesh": [2, 4], "mode": "forward",
                         "args": [_t([8, 1024, 32, 128], [0, -1, 1, -1]), _t([8, 1024, 32, 128], [0, -1, 1, -1]),
                                  _t([8, 1024, 32, 128], [0, -1, 1, -1]), _t([2], [-1]), _t([8, 1, 1024, 1024],
                                  [0, -1, -1, -1]), 0.0, True, False, False]}),
    # rules on the generic path (no hand-written fast path)
    ("conv2d_transpose", {"rule": "conv2d_transpose", "mesh": [2, 4], "mode": "forward",
                          "args": [_t([8, 64, 32, 32], [0, -1, -1, -1]), _t([64, 128, 3, 3], [-1, 1, -1, -1]),
                                   [1, 1], [0, 0], [], [], "EXPLICIT", 1, [1, 1], "NCHW"]}),
    ("depthwise_conv2d", {"rule": "depthwise_conv2d", "mesh": [2, 4], "mode": "forward",
                          "args": [_t([8, 64, 32, 32], [0, 1, -1, -1]), _t([64, 1, 3, 3], [1, -1, -1, -1]),
                                   [1, 1], [0, 0], "EXPLICIT", 64, [1, 1], "NCHW"]}),
    ("argsort", {"rule": "argsort", "mesh": [2, 4], "mode": "forward",
                 "args": [_t([8, 1024, 768], [0, -1, 1]), -1, False, False]}),
    ("topk", {"rule": "topk", "mesh": [2, 4], "mode": "forward",
              "args": [_t([8, 1024, 768], [0, -1, 1]), 4, -1, True, True]}),
    ("take_along_axis", {"rule": "take_along_axis", "mesh": [2, 4], "mode": "forward",
                         "args": [_t([8, 1024, 768], [0, -1, 1]), _t([8, 1024, 768], [0, 1, -1]), 1]}),
    ("gather", {"rule": "gather", "mesh": [2, 4], "mode": "forward",
                "args": [_t([1024, 768], [0, 1]), _t([512], [0]), 0]}),
    ("index_select", {"rule": "index_select", "mesh": [2, 4], "mode": "forward",
                      "args": [_t([8, 1024, 768], [0, -1, 1]), _t([512], [-1]), 1]}),
]

#: the cases of issue 17's distinct-shapes target (geometric mean <= 0.8x Paddle, each <= 1.0x)
TARGET = ("reshape", "matmul 3-D", "layer_norm", "layer_norm backward", "add (broadcast)", "softmax", "sum",
          "transpose")
#: the generic-path cases (target: within 2x Paddle)
GENERIC = ("conv2d_transpose", "depthwise_conv2d", "argsort", "topk", "take_along_axis", "gather", "index_select")


#: per case label: the size scaled by the call's index in the distinct-shapes column
VARY: dict[str, int] = {
    "reshape": 48, "matmul 3-D": 1024, "matmul backward": 1024, "layer_norm": 1024,
    "layer_norm backward": 1024, "add (broadcast)": 1024, "relu": 1024, "softmax": 12, "sum": 1024,
    "transpose": 1024, "conv2d": 32, "embedding": 1024, "flash_attention": 1024,
    "conv2d_transpose": 32, "depthwise_conv2d": 32, "argsort": 1024, "topk": 1024, "take_along_axis": 1024,
    "gather": 1024, "index_select": 1024,
}


def _vary(case: dict[str, Any], size: int, k: int) -> dict[str, Any]:
    """A copy of ``case`` with every ``size`` in a shape or a list attribute made ``size * k``."""

    def sub(a: Any) -> Any:
        if isinstance(a, dict):
            return {**a, "shape": [s * k if s == size else s for s in a["shape"]]}
        if isinstance(a, list) and a and all(isinstance(x, int) and not isinstance(x, bool) for x in a):
            return [s * k if s == size else s for s in a]
        if isinstance(a, list):
            return [sub(x) for x in a]
        return a

    return {**case, "args": [sub(a) for a in case["args"]]}


#: the clock of every timing (``--timer cpu``: this process's CPU time, which a shared machine's
#: load disturbs far less than wall time)
_clock = time.perf_counter


def _interleaved_us(fns: list[Any], repeat: int, number: int) -> list[float | None]:
    """Median microseconds per call of each callable (None stays None), timed round by round:
    each round times every callable once in turn, so a change of machine load during the run
    hits all sides alike instead of whichever block happened to run then. An entry is
    ``(fn, cache)`` (``fn()`` timed ``number`` times) or ``(loop, cache, n)`` with ``loop(r)``
    making ``n`` calls of round r's own arguments (timed once, reported per call)."""
    times: list[list[float]] = [[] for _ in fns]
    for r in range(repeat):
        for i, entry in enumerate(fns):
            fn, cache = entry[0], entry[1]
            if fn is None:
                continue
            set_cache_enabled(cache)
            if len(entry) == 3:
                t0 = _clock()
                fn(r)
                times[i].append((_clock() - t0) / entry[2] * number)
            else:
                times[i].append(timeit.Timer(fn, timer=_clock).timeit(number=number))
    set_cache_enabled(True)
    return [statistics.median(t) / number * 1e6 if t else None for t in times]


def _spmdkit_args(case: dict[str, Any]) -> tuple[Any, tuple[Any, ...]]:
    c = parse_case(case)
    return (c.rule.infer_forward if c.mode == "forward" else c.rule.infer_backward), tuple(c.args)


def _spmdkit_call(case: dict[str, Any]) -> Any:
    f, args = _spmdkit_args(case)

    def call() -> Any:
        return f(*args)

    return call


def _distinct_loop(cases: list[list[dict[str, Any]]], build: Any) -> Any:
    """``loop(r)``: one call on each of round r's cases, arguments built beforehand."""
    built = [[build(c) for c in rnd] for rnd in cases]
    if any(b is None for rnd in built for b in rnd):
        return None

    def loop(r: int) -> None:
        for f, args in built[r]:
            f(*args)

    return loop


def _paddle_args(case: dict[str, Any]) -> tuple[Any, list[Any]] | None:
    """Paddle's rule function and its arguments for the case, or None without paddle."""
    try:
        import numpy as np
        from paddle.base import core
        from paddle.distributed import ProcessMesh
        from paddle.distributed.auto_parallel.static.dist_attribute import DistTensorSpec, TensorDistAttr
    except Exception:
        return None
    shape = tuple(case["mesh"])
    mesh = _MESHES.get(shape)
    if mesh is None:
        n = 1
        for s in shape:
            n *= s
        mesh = ProcessMesh(np.arange(n).reshape(shape).tolist(), dim_names=[f"d{i}" for i in range(len(shape))])
        _MESHES[shape] = mesh

    def spec(a: Any) -> Any:
        if not isinstance(a, dict):
            return a
        attr = TensorDistAttr()
        attr.process_mesh = mesh
        attr.dims_mapping = list(a["dims_mapping"])
        return DistTensorSpec(list(a["shape"]), attr)

    args = [spec(a) for a in case["args"]]
    rule = core.get_phi_spmd_rule(case["rule"])
    return (rule.infer_forward if case["mode"] == "forward" else rule.infer_backward), args


_MESHES: dict[tuple[int, ...], Any] = {}


def _paddle_call(case: dict[str, Any]) -> Any | None:
    """A zero-argument callable running Paddle's rule on the case, or None without paddle."""
    fa = _paddle_args(case)
    if fa is None:
        return None
    f, args = fa
    f(*args)

    def call() -> Any:
        return f(*args)

    return call


def cached_all(top: int = 10) -> int:
    """``--all-cached``: a repeated (cached) call of every rule-mode, one valid case each (the first
    golden case, else the simulator's first valid generated case), timed like the cached column;
    prints the slowest and how many take over 2 us."""
    import json

    from spmdkit.core.errors import SpmdError
    from spmdkit.ops import get_rule, rule_names
    from spmdkit.sim.cases import generate_case

    cases: dict[tuple[str, str], dict[str, Any]] = {}
    golden = Path(__file__).resolve().parent.parent / "tests" / "golden"
    for f in sorted(golden.glob("*.jsonl")):
        for line in f.read_text().splitlines():
            d = json.loads(line) if line.strip() else {}
            if d and "error" not in d.get("expect", {}):
                c = d["case"]
                cases.setdefault((get_rule(c["rule"]).name, c.get("mode", "forward")), c)
    rows = []
    missing = []
    for name in rule_names(include_aliases=False):
        for mode in get_rule(name).modes:
            found = [cases[(name, mode)]] if (name, mode) in cases else []
            found += [c for i in range(10) if (c := generate_case(name, mode, 0, i)) is not None]
            for c in found:
                try:
                    call = _spmdkit_call(c)
                    call()
                    break
                except SpmdError:
                    continue
            else:
                missing.append(f"{name} {mode}")
                continue
            call()
            rows.append((min(timeit.Timer(call, timer=_clock).repeat(9, 1000)) / 1000 * 1e6, name, mode))
    rows.sort(reverse=True)
    print(f"cached call of {len(rows)} rule-modes (no valid case: {len(missing)} {missing[:5]}):")
    for t, name, mode in rows[:top]:
        print(f"  {t:6.2f} us  {name} {mode}")
    print(f"over 2 us: {sum(1 for t, _, _ in rows if t > 2.0)}, max {rows[0][0]:.2f}, "
          f"median {statistics.median(t for t, _, _ in rows):.2f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rules", nargs="*", help="only these rules (default: all cases)")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--number", type=int, default=2000)
    ap.add_argument("--distinct", type=int, default=500, help="calls per round in the distinct-shapes column")
    ap.add_argument("--timer", choices=("wall", "cpu"), default="wall",
                    help="wall clock (default) or this process's CPU time (steadier on a loaded machine)")
    ap.add_argument("--all-cached", action="store_true",
                    help="instead: time a cached call of every rule-mode (one valid case each)")
    ns = ap.parse_args(argv)
    global _clock
    _clock = time.process_time if ns.timer == "cpu" else time.perf_counter
    if ns.all_cached:
        return cached_all()
    rows = []
    k0 = 2  # scale factors already used (the repeated case is k = 1)
    for label, case in CASES:
        if ns.rules and case["rule"] not in ns.rules:
            continue
        if not has_rule(case["rule"]):
            rows.append((label, None, None, None, None, None))
            continue
        call = _spmdkit_call(case)
        call()
        pcall = _paddle_call(case)
        size = VARY[label]
        rounds = [[_vary(case, size, k0 + r * ns.distinct + j) for j in range(ns.distinct)]
                  for r in range(ns.repeat)]
        dist = _distinct_loop(rounds, _spmdkit_args)
        pdist = _distinct_loop(rounds, _paddle_args) if pcall is not None else None
        unc, cached, pad, d, pd = _interleaved_us(
            [(call, False), (call, True), (pcall, True), (dist, True, ns.distinct), (pdist, True, ns.distinct)],
            ns.repeat, ns.number,
        )
        rows.append((label, unc, cached, pad, d, pd))
    head = ("case", "uncached us", "cached us", "paddle us", "uncached/paddle",
            "distinct us", "paddle distinct us", "distinct/paddle")
    fmt = "{:<20} {:>11} {:>9} {:>9} {:>15} {:>11} {:>18} {:>15}"
    print(fmt.format(*head))

    def num(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    def ratio(a: float | None, b: float | None) -> str:
        return "-" if a is None or b is None else f"{a / b:.2f}"

    ratios: dict[str, float] = {}
    for label, unc, cached, pad, d, pd in rows:
        if d is not None and pd is not None:
            ratios[label] = d / pd
        print(fmt.format(
            label, "not registered" if unc is None else num(unc), num(cached), num(pad), ratio(unc, pad),
            num(d), num(pd), ratio(d, pd),
        ))
    if ratios:
        print(f"geometric mean distinct/paddle: {statistics.geometric_mean(ratios.values()):.2f} (all cases)")
        for name, group in (("issue 17's eight", TARGET), ("generic path", GENERIC)):
            got = [ratios[k] for k in group if k in ratios]
            if got:
                print(f"  {name}: {statistics.geometric_mean(got):.2f}, max {max(got):.2f} ({len(got)} cases)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
