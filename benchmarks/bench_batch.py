"""Throughput and peak memory of ``spmdkit infer --batch`` on distinct and on repeated cases.

    python benchmarks/bench_batch.py [--distinct N] [--repeated N] [--no-cache] [--src DIR]

Generates N distinct cases (softmax, matmul, add, layer_norm, transpose with a different leading
size each, on a few meshes) and N repeated cases (the same 50 cases over and over), pipes each set
through a fresh ``python -m spmdkit infer --batch`` process and prints cases/s (wall clock of the
whole process, start-up included) and the process's peak RSS (``ru_maxrss`` of the
child). Every output line is checked to be one JSON object per input line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

SRC = Path(__file__).resolve().parent.parent / "src"

MESHES: list[Any] = [[2, 4], [4, 2], [8], {"shape": [2, 2], "dim_names": ["dp", "tp"]}]


def _t(shape: list[int], dm: list[int]) -> dict[str, Any]:
    return {"shape": shape, "dims_mapping": dm}


def make_case(i: int) -> dict[str, Any]:
    """The i-th distinct case (distinct by the leading size ``k`` and the template)."""
    k = 1 + i // 5
    mesh = MESHES[(i // 5) % len(MESHES)]
    kind = i % 5
    if kind == 0:
        return {"rule": "softmax", "mesh": mesh, "args": [_t([k, 64], [0, -1]), -1]}
    if kind == 1:
        return {"rule": "matmul", "mesh": mesh, "args": [_t([k, 64], [0, -1]), _t([64, 32], [-1, 0]), False, False]}
    if kind == 2:
        return {"rule": "add", "mesh": mesh, "args": [_t([k, 16, 8], [0, -1, -1]), _t([16, 8], [-1, -1])]}
    if kind == 3:
        return {"rule": "layer_norm", "mesh": mesh, "args": [_t([k, 8, 32], [0, -1, -1]), _t([32], [-1]),
                                                             _t([32], [-1]), 1e-5, 2]}
    return {"rule": "transpose", "mesh": mesh, "args": [_t([k, 4, 8], [0, -1, -1]), [2, 0, 1]]}


def run_batch(cases: Iterator[dict[str, Any]], extra: list[str], src: Path = SRC) -> tuple[float, float, int]:
    """(seconds, peak RSS in MB of the child, line count). The cases are streamed to a file first,
    so this process stays small (a forked child's peak RSS counts its parent's pages before exec)."""
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        n_in = 0
        for case in cases:
            f.write(json.dumps(case) + "\n")
            n_in += 1
        path = f.name
    env = dict(os.environ, PYTHONPATH=str(src))
    t0 = time.perf_counter()
    with open(path, "rb") as inp, tempfile.TemporaryFile() as outp:
        p = subprocess.Popen([sys.executable, "-m", "spmdkit", "infer", "--batch", *extra], stdin=inp,
                             stdout=outp, stderr=subprocess.PIPE, env=env)
        _, status, usage = os.wait4(p.pid, 0)
        dt = time.perf_counter() - t0
        p.returncode = os.waitstatus_to_exitcode(status)
        err = p.stderr.read() if p.stderr else b""
        os.unlink(path)
        if p.returncode != 0:
            raise SystemExit(f"spmdkit infer --batch exited {p.returncode}: {err.decode()[-2000:]}")
        outp.seek(0)
        n_out = errors = 0
        for o in outp:
            n_out += 1
            errors += "error" in json.loads(o)
    if n_out != n_in:
        raise SystemExit(f"{n_in} lines in, {n_out} out")
    if errors:
        print(f"  ({errors} error answers)")
    return dt, usage.ru_maxrss / 1024.0, n_out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--distinct", type=int, default=100_000)
    ap.add_argument("--repeated", type=int, default=100_000)
    ap.add_argument("--no-cache", action="store_true", help="pass --no-cache to spmdkit infer")
    ap.add_argument("--src", type=Path, default=SRC,
                    help="the spmdkit source tree to run (another checkout's src/, to compare before/after)")
    ns = ap.parse_args()
    extra = ["--no-cache"] if ns.no_cache else []
    dt, rss, n = run_batch((make_case(i % 50) for i in range(ns.repeated)), extra, ns.src)
    print(f"repeated: {n} cases in {dt:.2f} s = {n / dt:,.0f} cases/s, peak RSS {rss:.0f} MB")
    dt, rss, n = run_batch((make_case(i) for i in range(ns.distinct)), extra, ns.src)
    print(f"distinct: {n} cases in {dt:.2f} s = {n / dt:,.0f} cases/s, peak RSS {rss:.0f} MB")


if __name__ == "__main__":
    main()
