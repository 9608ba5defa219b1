#!/usr/bin/env python3
"""Pipeline planning speed at full size: Llama 3.1 405B (126 layers) on pp=16, dp=8, tp=8.

    python benchmarks/bench_pipeline.py [--repeat 3]

Times ``spmdkit plan`` end to end, each command as its own process (the interpreter's start
and the imports included, as a user runs it), median of --repeat runs: the 405B config with
the naive split given (``--stages 8 x 14,7,7``), the same with the automatic split (126 layers
do not divide into 16 stages: balanced by predicted time, 7, 8 x 14, 7), and the catalog's
``llama3.1-405b`` where the catalog has it. The target (issue 27): under 2 s.

``--phases`` breaks the catalog command's CPU time down instead (each run its own process,
median of --repeat): the imports, the model build (the zoo), the propagation (its setup, sweeps
and plan), the step and pipeline estimates (per-op costs, memory per stage), the report.
``--phases -- ARGS`` breaks down ``spmdkit plan ARGS`` instead (e.g. ``-- --model deepseek-v3
--mesh dp=8,tp=8 --strategy megatron --device h100``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if "--phases-child" not in sys.argv:  # a child finds its tree on PYTHONPATH
    sys.path.insert(0, str(ROOT / "src"))

CONFIG = ('{"base":"llama-70b","layers":126,"hidden":16384,"heads":128,"kv_heads":8,"ffn":53248,'
          '"vocab":128256,"seq":8192,"batch":1}')
MESH = ["--mesh", "pp=16,dp=8,tp=8", "--strategy", "megatron", "--device", "h100"]
NAIVE = ",".join(["8"] * 14 + ["7", "7"])


def _commands() -> list[tuple[str, list[str]]]:
    from spmdkit.models.zoo import preset  # here: a --phases child times the imports itself

    rows = [("405B config, --stages 8x14,7,7", ["--model-config", CONFIG, *MESH, "--stages", NAIVE]),
            ("405B config, automatic split", ["--model-config", CONFIG, *MESH])]
    for name in ("llama3.1-405b", "llama3-405b"):
        try:
            preset(name)
        except Exception:  # not in this catalog
            continue
        rows.append((f"--model {name}, automatic split", ["--model", name, *MESH]))
        break
    return rows


#: (module, function, label) timed by --phases where the command calls them (inclusive CPU s)
PHASES = [("spmdkit.planner.planning", "load_preset", "build (zoo)"),
          ("spmdkit.planner.planning", "annotate", "annotate (strategy)"),
          ("spmdkit.planner.planning", "propagate", "propagate"),
          ("spmdkit.cli.pipeline", "step_estimate", "step estimate (recost, per-op costs)"),
          ("spmdkit.cli.plan", "step_estimate", "step estimate (recost, per-op costs)"),
          ("spmdkit.cli.plan", "memory_per_device", "memory"),
          ("spmdkit.cli.pipeline", "estimate_pipeline", "pipeline estimate (per-op costs, memory per stage)"),
          ("spmdkit.cli.pipeline", "write_report", "report"),
          ("spmdkit.cli.pipeline", "write_pipeline", "report"),
          ("spmdkit.cli.plan", "write_report", "report")]


def _phases_child(argv: list[str]) -> None:
    """One run of ``spmdkit plan argv`` in this process: CPU seconds per phase, as one JSON line."""
    t0 = time.process_time()
    cli = importlib.import_module("spmdkit.cli")
    for m in ("spmdkit.cli.plan", "spmdkit.cli.pipeline", "spmdkit.planner.planning"):
        importlib.import_module(m)
    acc: dict[str, float] = {"imports": time.process_time() - t0}
    depth: dict[str, int] = {}

    def wrap(mod: object, attr: str, label: str) -> None:
        fn = getattr(mod, attr)

        def timed(*args: object, **kw: object) -> object:
            depth[label] = depth.get(label, 0) + 1
            t = time.process_time()
            try:
                return fn(*args, **kw)
            finally:
                depth[label] -= 1
                if not depth[label]:
                    acc[label] = acc.get(label, 0.0) + time.process_time() - t

        setattr(mod, attr, timed)

    for mod, attr, label in PHASES:
        m = importlib.import_module(mod)
        if hasattr(m, attr):
            wrap(m, attr, label)
    t1 = time.process_time()
    with contextlib.redirect_stdout(io.StringIO()):
        cli.main(["plan", *argv])
    acc["total"] = acc["imports"] + time.process_time() - t1
    acc["other"] = acc["total"] - sum(v for k, v in acc.items() if k != "total")
    print(json.dumps(acc))


def _phases(argv: list[str], repeat: int, env: dict[str, str]) -> None:
    runs = [json.loads(subprocess.run([sys.executable, __file__, "--phases-child", "--", *argv], env=env,
                                      capture_output=True, text=True, check=True).stdout.splitlines()[-1])
            for _ in range(repeat)]
    print(f"spmdkit plan {' '.join(argv)}: CPU s per phase (median of {repeat} processes)")
    for k in runs[0]:
        med = statistics.median(r.get(k, 0.0) for r in runs)
        print(f"  {k:<52} {med:>6.3f}  {100 * med / statistics.median(r['total'] for r in runs):>4.0f}%")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--phases", action="store_true", help="the CPU time per phase of one command")
    ap.add_argument("--phases-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tree", type=Path, default=ROOT, help="time this checkout's src (default: this one)")
    ap.add_argument("args", nargs="*", help="after --: the spmdkit plan arguments --phases breaks down")
    a = ap.parse_args()
    env = dict(os.environ, PYTHONPATH=str(a.tree.resolve() / "src"))
    if a.phases_child:
        _phases_child(a.args)
        return 0
    if a.phases:
        _phases(a.args or _commands()[-1][1], a.repeat, env)
        return 0
    print(f"spmdkit plan, pp=16 x dp=8 x tp=8 megatron on h100 (median of {a.repeat} processes)")
    print(f"{'command':<40} {'wall s':>7} {'cpu s':>7}  split")
    for label, argv in _commands():
        walls, cpus, split = [], [], ""
        for _ in range(a.repeat):
            t0 = time.perf_counter()
            c0 = os.times()
            out = subprocess.run([sys.executable, "-m", "spmdkit", "plan", *argv], env=env, capture_output=True,
                                 text=True, check=True).stdout
            c1 = os.times()
            walls.append(time.perf_counter() - t0)
            cpus.append((c1.children_user + c1.children_system) - (c0.children_user + c0.children_system))
            split = next((ln.split("layers per stage ")[1].split(";")[0] for ln in out.splitlines()
                          if "layers per stage " in ln), "")
        print(f"{label:<40} {statistics.median(walls):>7.2f} {statistics.median(cpus):>7.2f}  {split}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
