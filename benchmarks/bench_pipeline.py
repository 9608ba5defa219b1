#!/usr/bin/env python3
"""Pipeline planning speed at full size: Llama 3.1 405B (126 layers) on pp=16, dp=8, tp=8.

    python benchmarks/bench_pipeline.py [--repeat 3]

Times ``spmdkit plan`` end to end, each command as its own process (the interpreter's start
and the imports included, as a user runs it), median of --repeat runs: the 405B config with
the naive split given (``--stages 8 x 14,7,7``), the same with the automatic split (126 layers
do not divide into 16 stages: balanced by predicted time, 7, 8 x 14, 7), and the catalog's
``llama3.1-405b`` where the catalog has it. The target (issue 27): under 2 s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from spmdkit.models.zoo import preset  # noqa: E402

CONFIG = ('{"base":"llama-70b","layers":126,"hidden":16384,"heads":128,"kv_heads":8,"ffn":53248,'
          '"vocab":128256,"seq":8192,"batch":1}')
MESH = ["--mesh", "pp=16,dp=8,tp=8", "--strategy", "megatron", "--device", "h100"]
NAIVE = ",".join(["8"] * 14 + ["7", "7"])


def _commands() -> list[tuple[str, list[str]]]:
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
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
