#!/usr/bin/env python3
"""The published stage split against ``--stages auto`` on the published runs with pipelines.

    python benchmarks/stages.py [--runs FILE ...] [--only PREFIX[,PREFIX]] [--layers N]

Each run with pp > 1 of the runs file (default: the team's shared fidelity file,
``../shared/fidelity/published-runs.json`` beside the repository, else this repository's copy
``benchmarks/data/published-runs.json``) is planned as :mod:`benchmarks.fidelity` plans it
(its command line: the published mesh, schedule, virtual stages, microbatches and, where
the layers do not divide, the framework's split: torchtitan's ``generate_split_points``),
then again
with ``--stages auto`` (:func:`spmdkit.planner.partition.partition`: the slowest stage as
fast as it can be within each rank's memory, kept where its predicted step beats the default
split). The table: the published split and its predicted step, auto's split and step,
whether each fits, and which candidate auto kept (``partition``: the min-max split, which is
also the even one where they coincide; ``default``: the balanced split; ``even``: the first
stages one layer more). ``--layers N`` plans every run at N layers (a quick look; the "published"
split then is the same rule at N layers).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from fidelity import RUNS, Unsupported, express, run_cli
from fidelity import _split as framework_split

#: the team's shared fidelity file, beside the repository (../shared) or beside its worktrees (../../shared)
SHARED = next((d / "shared" / "fidelity" / "published-runs.json" for d in Path(__file__).resolve().parents[1:4]
               if (d / "shared" / "fidelity" / "published-runs.json").exists()), None)
GIB = 1024**3


def _split(counts: list[int]) -> str:
    """``8 x 16`` for an even split, else the counts run-length coded (``7, 8 x 14, 7``)."""
    out: list[str] = []
    k = 0
    while k < len(counts):
        j = k
        while j < len(counts) and counts[j] == counts[k]:
            j += 1
        out.append(f"{counts[k]} x {j - k}" if j - k > 1 else str(counts[k]))
        k = j
    return ", ".join(out)


def _with_layers(argv: list[str], layers: int) -> list[str]:
    """``argv`` with its model config at ``layers`` layers, split as :mod:`fidelity` splits a
    run (evenly; where the layers do not divide, as the run's framework does)."""
    n = _dim(argv, "--mesh", "pp") * (_flag(argv, "--virtual-stages") or 1)
    framework = argv[argv.index("--framework") + 1] if "--framework" in argv else "megatron"
    split = ["--stages", ",".join(map(str, framework_split(layers, n, framework)))] if layers % n else []
    out: list[str] = []
    it = iter(argv)
    for a in it:
        if a == "--stages":
            next(it)
            continue
        if a == "--model-config":
            cfg = json.loads(next(it))
            out += [a, json.dumps({**cfg, "layers": layers})]
            continue
        out.append(a)
    return out + split


def compare(row: dict[str, Any], tmp: Path, layers: int | None = None) -> dict[str, Any]:
    """The run ``row`` planned with its published split and with ``--stages auto``: splits,
    predicted steps, the fullest ranks, whether each fits."""
    case = express(row, tmp)
    argv = _with_layers(case.argv, layers) if layers else list(case.argv)
    base = list(argv)
    auto = [*[a for a in argv if a != "--json"], "--stages", "auto", "--json"]
    if "--stages" in auto[:-3]:  # the published --stages replaced by auto
        k = auto.index("--stages")
        del auto[k:k + 2]
    out: dict[str, Any] = {"id": row["id"]}
    for name, cmd in (("published", base), ("auto", auto)):
        t0 = time.perf_counter()
        d = run_cli(cmd)["pipeline"]
        need = max(x["memory"]["device_total"] for x in d["devices"])
        out[name] = {"counts": d["layers_per_stage"], "step_s": d["step_overlap_s"], "fullest_gib": need / GIB,
                     "fits": need <= case.device_memory_gib * GIB, "seconds": time.perf_counter() - t0}
        if name == "auto":
            out["chosen"] = d["stages_auto"]["chosen"]
    out["pp"], out["vp"] = _dim(argv, "--mesh", "pp"), _flag(argv, "--virtual-stages") or 1
    out["microbatches"] = _flag(argv, "--microbatches")
    return out


def _flag(argv: list[str], name: str) -> int | None:
    return int(argv[argv.index(name) + 1]) if name in argv else None


def _dim(argv: list[str], flag: str, dim: str) -> int:
    for part in argv[argv.index(flag) + 1].split(","):
        k, _, v = part.partition("=")
        if k == dim:
            return int(v)
    return 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", action="append", default=None, help="a runs file, repeatable")
    ap.add_argument("--only", help="comma list of run id prefixes")
    ap.add_argument("--layers", type=int, help="plan every run at this many layers (a quick look; the published "
                                               "split then is fidelity.py's rule at that many layers)")
    a = ap.parse_args()
    runs = a.runs or [str(SHARED or RUNS)]
    rows = [r for f in runs for r in json.loads(Path(f).read_text()) if int(r["parallelism"]["pp"]) > 1]
    if a.only:
        rows = [r for r in rows if r["id"].startswith(tuple(a.only.split(",")))]
    print(f"{len(rows)} runs with pipelines from {', '.join(runs)}")
    head = (f"{'run':44} {'pp x vp':>8} {'m':>4}  {'published split':24} {'step s':>8} {'fits':>4}  "
            f"{'auto split':30} {'step s':>8} {'fits':>4} {'auto/pub':>8}  chosen")
    print(head)
    print("-" * len(head))
    worse, uneven_missed, n = 0, 0, 0
    with tempfile.TemporaryDirectory() as tmp:
        for row in rows:
            try:
                r = compare(row, Path(tmp), a.layers)
            except Unsupported as e:
                print(f"{row['id']:44} unsupported: {e}")
                continue
            except RuntimeError as e:
                print(f"{row['id']:44} failed: {str(e)[:120]}")
                continue
            n += 1
            pub, got = r["published"], r["auto"]
            ratio = got["step_s"] / pub["step_s"] if pub["step_s"] else float("nan")
            # auto loses only where the published split does not fit and auto's does (a slower step that runs)
            if ratio > 1 + 1e-9 and not (got["fits"] and not pub["fits"]):
                worse += 1
            if len(set(pub["counts"])) > 1 and len(set(got["counts"])) == 1:
                uneven_missed += 1
            print(f"{r['id']:44} {r['pp']:>3} x {r['vp']:<3} {r['microbatches'] or 1:>4}  {_split(pub['counts']):24.24} "
                  f"{pub['step_s']:>8.3f} {'yes' if pub['fits'] else 'no':>4}  {_split(got['counts']):30.30} "
                  f"{got['step_s']:>8.3f} {'yes' if got['fits'] else 'no':>4} {ratio:>8.4f}  {r['chosen']}")
    print(f"\n{n} runs: auto slower than the published split in {worse}; the published split uneven and auto's "
          f"even in {uneven_missed}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
