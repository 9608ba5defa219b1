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
  ``PYTHONPATH=src /path/to/paddle-venv/bin/python benchmarks/bench_rules.py``).

Argument construction is outside the timed loop for both sides. The three timings are taken
round by round (uncached, cached, paddle, then again), and each figure is the median over the
rounds, so a load change on the machine during the run does not favour one side.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import timeit
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from spmdkit.io.codec import parse_case
from spmdkit.rules import has_rule, set_cache_enabled


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
]


def _interleaved_us(fns: list[Any], repeat: int, number: int) -> list[float | None]:
    """Median microseconds per call of each callable (None stays None), timed round by round:
    each round times every callable once in turn, so a change of machine load during the run
    hits all sides alike instead of whichever block happened to run then."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for i, (fn, cache) in enumerate(fns):
            if fn is None:
                continue
            set_cache_enabled(cache)
            times[i].append(timeit.timeit(fn, number=number))
    set_cache_enabled(True)
    return [statistics.median(t) / number * 1e6 if t else None for t in times]


def _spmdkit_call(case: dict[str, Any]) -> Any:
    c = parse_case(case)
    f = c.rule.infer_forward if c.mode == "forward" else c.rule.infer_backward
    args = tuple(c.args)

    def call() -> Any:
        return f(*args)

    return call


def _paddle_call(case: dict[str, Any]) -> Any | None:
    """A zero-argument callable running Paddle's rule on the case, or None without paddle."""
    try:
        import numpy as np
        from paddle.base import core
        from paddle.distributed import ProcessMesh
        from paddle.distributed.auto_parallel.static.dist_attribute import DistTensorSpec, TensorDistAttr
    except Exception:
        return None
    shape = case["mesh"]
    n = 1
    for s in shape:
        n *= s
    mesh = ProcessMesh(np.arange(n).reshape(shape).tolist(), dim_names=[f"d{i}" for i in range(len(shape))])

    def spec(a: Any) -> Any:
        if not isinstance(a, dict):
            return a
        attr = TensorDistAttr()
        attr.process_mesh = mesh
        attr.dims_mapping = list(a["dims_mapping"])
        return DistTensorSpec(list(a["shape"]), attr)

    args = [spec(a) for a in case["args"]]
    rule = core.get_phi_spmd_rule(case["rule"])
    f = rule.infer_forward if case["mode"] == "forward" else rule.infer_backward
    f(*args)

    def call() -> Any:
        return f(*args)

    return call


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rules", nargs="*", help="only these rules (default: all cases)")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--number", type=int, default=2000)
    ns = ap.parse_args(argv)
    rows = []
    for label, case in CASES:
        if ns.rules and case["rule"] not in ns.rules:
            continue
        if not has_rule(case["rule"]):
            rows.append((label, None, None, None))
            continue
        call = _spmdkit_call(case)
        call()
        pcall = _paddle_call(case)
        unc, cached, pad = _interleaved_us([(call, False), (call, True), (pcall, True)], ns.repeat, ns.number)
        rows.append((label, unc, cached, pad))
    head = ("case", "spmdkit uncached us", "spmdkit cached us", "paddle us", "uncached/paddle")
    fmt = "{:<22} {:>20} {:>18} {:>10} {:>16}"
    print(fmt.format(*head))
    for label, unc, cached, pad in rows:
        print(fmt.format(
            label,
            "not registered" if unc is None else f"{unc:.2f}",
            "-" if cached is None else f"{cached:.2f}",
            "-" if pad is None else f"{pad:.2f}",
            "-" if pad is None or unc is None else f"{unc / pad:.2f}",
        ))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
