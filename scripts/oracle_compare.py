#!/usr/bin/env python3
"""Developer tool (not used by the tests): compare spmdkit with Paddle 3.3.1 on cases.

    python scripts/oracle_compare.py cases.jsonl [--paddle-python ~/paddle-venv/bin/python]
        [--write-golden tests/golden/foo.jsonl --source oracle]

Runs every case through spmdkit (in this interpreter) and through
../shared/tools/paddle_oracle.py (in the Paddle venv), prints the differences and
a summary. With --write-golden, appends the cases where both agree (or where Paddle
errors and spmdkit too) as golden lines, and the differing cases that a
``--deviation RULE:MODE:KIND=ID`` option classifies (KIND: inputs-differ,
outputs-differ, both-differ, paddle-error, ours-error; ``*`` matches any RULE or
MODE) as golden lines carrying ``"deviation": ID`` and Paddle's answer. Paddle's flat
list for a rule's one vector output (split, unbind) is nested as spmdkit writes it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from spmdkit.io.codec import answer_line  # noqa: E402

ORACLE = ROOT.parent / "shared" / "tools" / "paddle_oracle.py"


def norm(res):
    if res is None:
        return None
    if isinstance(res, list):
        return [norm(r) for r in res]
    return {"dims_mapping": res["dims_mapping"], "partial": dict(sorted((res.get("partial") or {}).items()))}


def run_oracle(lines, py):
    p = subprocess.run(
        [py, str(ORACLE), "--batch", "--bare", "--fork"],
        input="\n".join(lines) + "\n",
        capture_output=True,
        text=True,
        env={**os.environ, "GLOG_minloglevel": "3"},
    )
    out = [json.loads(x) for x in p.stdout.splitlines() if x.strip()]
    if len(out) != len(lines):
        raise SystemExit(f"oracle returned {len(out)} lines for {len(lines)} cases\n{p.stderr[-2000:]}")
    return out


def nest_vector_outputs(pr, ours):
    """Paddle's binding returns a rule's one vector output (split, unbind, ...) as a flat list
    of dist attrs; spmdkit nests it as one list entry. Nest Paddle's to compare like with like."""
    po, oo = pr.get("outputs"), ours.get("outputs")
    if (isinstance(po, list) and isinstance(oo, list) and len(oo) == 1 and isinstance(oo[0], list)
            and all(isinstance(x, dict) for x in po) and len(po) == len(oo[0])):
        pr["outputs"] = [po]
    return pr


def diff_kind(pr, ours):
    if "error" in pr:
        return "both-error" if "error" in ours else "paddle-error"
    if "error" in ours:
        return "ours-error"
    if norm(pr["outputs"]) == norm(ours["outputs"]):
        return "inputs-differ"
    if norm(pr["inputs"]) == norm(ours["inputs"]):
        return "outputs-differ"
    return "both-differ"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("cases")
    ap.add_argument("--paddle-python", default=os.path.expanduser("~/paddle-venv/bin/python"))
    ap.add_argument("--write-golden")
    ap.add_argument("--source", default="oracle")
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--deviation", action="append", default=[], metavar="RULE:MODE:KIND=ID")
    ns = ap.parse_args()
    devs = {}
    for d in ns.deviation:
        k, _, v = d.partition("=")
        devs[tuple(k.split(":"))] = v
    lines = [x for x in Path(ns.cases).read_text().splitlines() if x.strip()]
    paddle = run_oracle(lines, ns.paddle_python)
    agree = differ = both_err = 0
    golden = []
    for line, pr in zip(lines, paddle):
        ours = answer_line(line)
        case = json.loads(line)
        pr = nest_vector_outputs(pr, ours)
        if "error" in pr and "error" in ours:
            both_err += 1
            golden.append({"case": case, "expect": {"error": ours["error"]}, "source": ns.source, "paddle_error": pr["error"]})
            continue
        if "error" not in pr and "error" not in ours and norm(pr["inputs"]) == norm(ours["inputs"]) and norm(pr["outputs"]) == norm(ours["outputs"]):
            agree += 1
            golden.append({"case": case, "expect": {"inputs": ours["inputs"], "outputs": ours["outputs"]}, "source": ns.source})
            continue
        differ += 1
        kind = diff_kind(pr, ours)
        mode = case.get("mode", "forward")
        dev = next((v for (r, m, k), v in devs.items()
                    if r in (case["rule"], "*") and m in (mode, "*") and k == kind), None)
        if dev is not None:
            exp = {"error": ours["error"]} if "error" in ours else {"inputs": ours["inputs"], "outputs": ours["outputs"]}
            pres = {"error": pr["error"]} if "error" in pr else {"inputs": pr["inputs"], "outputs": pr["outputs"]}
            golden.append({"case": case, "expect": exp, "source": ns.source, "deviation": dev, "paddle": pres})
            continue
        if not ns.quiet:
            print("CASE  ", line)
            print("paddle", json.dumps(pr))
            print("ours  ", json.dumps(ours))
            print()
    nd = sum(1 for g in golden if "deviation" in g)
    print(f"{len(lines)} cases: {agree} agree, {both_err} both error, {differ} differ "
          f"({nd} classified as deviations, {differ - nd} unexplained)")
    if ns.write_golden:
        with open(ns.write_golden, "a") as f:
            for g in golden:
                f.write(json.dumps(g) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
