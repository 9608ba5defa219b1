#!/usr/bin/env python3
"""Developer tool (not used by the tests): oracle cases from the simulator's case generators.

    python scripts/oracle_cases.py OUT.jsonl N SEED RULE [RULE ...] [--modes forward,backward]

Writes N cases per rule and mode as INTERFACE.md case lines (without ids). Partial
inputs are written as lists of mesh dims (SUM): the Paddle binding behind
../shared/tools/paddle_oracle.py can only set SUM partial on inputs. Feed the file to
scripts/oracle_compare.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from spmdkit.core.errors import SpmdError
from spmdkit.sim.cases import generate_cases


def as_sum_partial(a: Any) -> Any:
    if isinstance(a, dict) and "shape" in a:
        p = a.get("partial")
        if isinstance(p, dict):
            a["partial"] = sorted(int(k) for k in p)
        return a
    if isinstance(a, list):
        return [as_sum_partial(x) for x in a]
    return a


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("n", type=int)
    ap.add_argument("seed", type=int)
    ap.add_argument("rules", nargs="+")
    ap.add_argument("--modes", default="forward,backward")
    a = ap.parse_args()
    count = 0
    with open(a.out, "w") as f:
        for r in a.rules:
            for m in a.modes.split(","):
                try:
                    cases = generate_cases(r, a.n, seed=a.seed, mode=m)
                except SpmdError as exc:
                    print(f"{r} {m}: {exc}", file=sys.stderr)
                    continue
                for c in cases:
                    c.pop("id", None)
                    c["args"] = [as_sum_partial(x) for x in c["args"]]
                    f.write(json.dumps(c) + "\n")
                    count += 1
    print(f"{count} cases -> {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
