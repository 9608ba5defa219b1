#!/usr/bin/env python3
"""How many rules catch a declared output shape that contradicts the op (issue 13).

Program validation (``spmdkit.graph.program.Program.validate``) checks declared output
shapes by calling each op's rule in reverse (backward) mode, which takes the outputs as
arguments. This script measures which rules that catches: for up to 20 golden backward
cases per rule (tests/golden, every tensor replicated), each output axis in turn is made one
larger, and the rule must answer ShapeMismatchError.

    python benchmarks/output_shape_coverage.py
"""

from __future__ import annotations

import collections
import copy
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from spmdkit.core.errors import ShapeMismatchError, SpmdError  # noqa: E402
from spmdkit.io.codec import parse_case  # noqa: E402
from spmdkit.rules.registry import all_rules, get_rule, output_params  # noqa: E402


def _replicated(a: Any) -> Any:
    if isinstance(a, dict) and "shape" in a:
        return {"shape": a["shape"], "dims_mapping": [-1] * len(a["shape"])}
    if isinstance(a, list) and a and all(isinstance(x, dict) and "shape" in x for x in a):
        return [_replicated(x) for x in a]
    return a


def main() -> int:
    det: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])  # rule -> [detected, tried]
    seen: collections.Counter[str] = collections.Counter()
    for f in sorted((ROOT / "tests" / "golden").glob("*.jsonl")):
        for line in f.read_text().splitlines():
            d = json.loads(line)
            c = d["case"]
            if c.get("mode") != "backward" or "error" in d.get("expect", {}):
                continue
            rule = get_rule(c["rule"])
            if rule.backward is None or seen[rule.name] >= 20:
                continue
            seen[rule.name] += 1
            params = [p.name for p in rule.backward.params]
            outs = set(output_params(rule))
            base = dict(c)
            base["args"] = [_replicated(a) for a in c["args"]]
            try:
                parse_case(base).run()
            except SpmdError:
                continue
            for i, (pn, a) in enumerate(zip(params, base["args"])):
                if pn not in outs or not (isinstance(a, dict) and "shape" in a):
                    continue
                for ax, s in enumerate(a["shape"]):
                    if s < 1:
                        continue
                    bad = copy.deepcopy(base)
                    bad["args"][i]["shape"][ax] = s + 1
                    det[rule.name][1] += 1
                    try:
                        parse_case(bad).run()
                    except ShapeMismatchError:
                        det[rule.name][0] += 1
                    except SpmdError:
                        pass
    canon = {r.name: r for r in all_rules().values()}
    with_bw = {n for n, r in canon.items() if r.backward is not None}
    full = sorted(n for n, (a, b) in det.items() if b and a == b)
    part = sorted(n for n, (a, b) in det.items() if 0 < a < b)
    none = sorted(n for n, (a, b) in det.items() if b and a == 0)
    print(f"rules: {len(canon)}; with a reverse mode (checked): {len(with_bw)}; without (rank only): "
          f"{len(canon) - len(with_bw)}")
    print(f"measured on golden backward cases: {len(det)} rules, {sum(b for _, b in det.values())} perturbed "
          f"output axes, {sum(a for a, _ in det.values())} caught")
    print(f"  every perturbed axis caught: {len(full)}")
    print(f"  some axes caught: {len(part)}: {', '.join(part)}")
    print(f"  none: {len(none)}: {', '.join(none)}")
    print(f"  with a reverse mode but no golden backward case (not measured): {len(with_bw - set(det))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
