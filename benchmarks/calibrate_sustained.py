"""The Hopper presets' sustained share (``Rates.sustained``, docs/devices.md "Sustained rates"),
calibrated on the published H100 runs, and how well it carries to a source it was not fitted on.

    python benchmarks/calibrate_sustained.py [--runs FILE] [--grid 1.0,0.9,0.85,0.8,0.75]

Every H100 run of the shared file without context parallelism (cp runs make their own error band)
is planned through the CLI as ``benchmarks/fidelity.py`` plans it, with the Hopper presets'
``sustained`` set to each value of the grid. The calibrated value is where the runs' median
``ratio`` (predicted / measured speed) crosses 1, linear between grid points. Then each source in
turn is held out: the value is fitted on the others' runs and the held-out source's median
``|ratio - 1|`` is printed beside its uncalibrated one. Prints tables; asserts nothing (the
fidelity tests check what the presets give).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fidelity
from spmdkit.cost import devices

HOPPER = ("h100", "h200", "h800")


def ratios(rows: list[dict], value: float) -> dict[str, float]:
    """Each run's ratio with the Hopper presets' ``sustained`` at ``value``."""
    saved = {k: devices.DEVICES[k] for k in HOPPER}
    try:
        for k, dev in saved.items():
            devices.DEVICES[k] = replace(dev, rates=replace(dev.rates, sustained=value))
        results, unsupported = fidelity.evaluate(rows)
    finally:
        devices.DEVICES.update(saved)
    if unsupported:
        raise SystemExit(f"unsupported runs: {unsupported}")
    return {r["id"]: r["ratio"] for r in results}


def crossing(grid: list[float], by_value: dict[float, dict[str, float]], ids: list[str]) -> float | None:
    """Where the median ratio of ``ids`` crosses 1 along the grid (linear between its points)."""
    meds = [statistics.median(by_value[v][i] for i in ids) for v in grid]
    for (a, ma), (b, mb) in zip(zip(grid, meds), zip(grid[1:], meds[1:])):
        if (ma - 1.0) * (mb - 1.0) <= 0.0 and ma != mb:
            return a + (b - a) * (ma - 1.0) / (ma - mb)
    return None


def at(value: float, grid: list[float], by_value: dict[float, dict[str, float]], i: str) -> float:
    """Run ``i``'s ratio at ``value``, linear between the grid points around it."""
    pts = sorted(grid)
    for a, b in itertools.pairwise(pts):
        if a <= value <= b:
            w = (value - a) / (b - a)
            return (1.0 - w) * by_value[a][i] + w * by_value[b][i]
    raise ValueError(f"{value} outside the grid")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default=str(fidelity.RUNS))
    ap.add_argument("--grid", default="1.0,0.9,0.85,0.8,0.75")
    a = ap.parse_args()
    grid = sorted({float(x) for x in a.grid.split(",")}, reverse=True)
    rows = [r for r in json.loads(Path(a.runs).read_text())
            if str(r["hardware"]["gpu"]).startswith("H100") and (r["parallelism"].get("cp") or 1) == 1]
    source = {r["id"]: r["id"].split("_")[0] for r in rows}
    by_value = {v: ratios(rows, v) for v in grid}
    ids = sorted(source)
    print(f"{len(ids)} H100 runs without cp; median ratio by sustained share:")
    print("| sustained | median ratio | median abs(ratio - 1) | " + " | ".join(sorted(set(source.values()))) + " |")
    print("|---" * (3 + len(set(source.values()))) + "|")
    for v in grid:
        r = by_value[v]
        per = [statistics.median(r[i] for i in ids if source[i] == s) for s in sorted(set(source.values()))]
        print(f"| {v:g} | {statistics.median(r[i] for i in ids):.3f} | "
              f"{statistics.median(abs(r[i] - 1) for i in ids):.3f} | " + " | ".join(f"{x:.3f}" for x in per) + " |")
    fit = crossing(grid, by_value, ids)
    print(f"\ncalibrated (median ratio 1 over all {len(ids)} runs): {fit:.3f}" if fit else "\nno crossing in the grid")
    print("\nheld out by source: fitted on the others, the held-out runs' median abs(ratio - 1)")
    print("| held out | runs | fitted on the others | held out, calibrated | held out, uncalibrated (1.0) |")
    print("|---|---|---|---|---|")
    top = max(grid)
    for s in sorted(set(source.values())):
        rest = [i for i in ids if source[i] != s]
        mine = [i for i in ids if source[i] == s]
        f = crossing(grid, by_value, rest)
        if f is None:
            print(f"| {s} | {len(mine)} | no crossing | | |")
            continue
        cal = statistics.median(abs(at(f, grid, by_value, i) - 1) for i in mine)
        raw = statistics.median(abs(by_value[top][i] - 1) for i in mine) if top == 1.0 else float("nan")
        print(f"| {s} | {len(mine)} | {f:.3f} | {cal:.3f} | {raw:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
