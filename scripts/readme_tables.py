#!/usr/bin/env python3
"""Regenerate the README's generated tables (between <!-- name --> and <!-- /name --> markers):
the rules table (from the registry) and the golden-agreement table (from tests/golden).
tests/test_readme.py fails when they are stale."""

from __future__ import annotations

import collections
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from spmdkit.outputs.tables import rules_markdown  # noqa: E402


def golden_markdown() -> str:
    rows = ["| family | golden cases | from Paddle's unit tests | agree with Paddle | documented deviations |",
            "|---|---|---|---|---|"]
    tot: collections.Counter[str] = collections.Counter()
    for f in sorted((ROOT / "tests" / "golden").glob("*.jsonl")):
        items = [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
        n = len(items)
        pt = sum(1 for d in items if d.get("source") == "paddle-test")
        dev = sum(1 for d in items if "deviation" in d)
        rows.append(f"| {f.stem} | {n} | {pt} | {n - dev} | {dev} |")
        tot.update(n=n, pt=pt, dev=dev)
    rows.append(f"| **all** | {tot['n']} | {tot['pt']} | {tot['n'] - tot['dev']} | {tot['dev']} |")
    return "\n".join(rows)


TABLES = {"rules-table": rules_markdown, "golden-table": golden_markdown}


def render(text: str) -> str:
    for name, fn in TABLES.items():
        body = fn()
        text = re.sub(rf"(<!-- {name} -->\n).*?(\n<!-- /{name} -->)", lambda m, b=body: m.group(1) + b + m.group(2),
                      text, flags=re.S)
    return text


if __name__ == "__main__":
    p = ROOT / "README.md"
    p.write_text(render(p.read_text()))
