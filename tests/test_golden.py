"""Golden cases (tests/golden/*.jsonl): Paddle's unit-test cases and oracle answers as data.

Each line: {"case": CASE, "expect": RESULT | {"error": "ClassName"}, "source": "..."}
where CASE and RESULT are INTERFACE.md objects. A line may carry "deviation": the
docs/deviations.md entry for which spmdkit answers otherwise than Paddle 3.3.1
(then "expect" is spmdkit's sound answer and "paddle" what Paddle says).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spmdkit.io.codec import answer_line

GOLDEN = Path(__file__).parent / "golden"


def _load() -> list[tuple[str, dict]]:
    out = []
    for f in sorted(GOLDEN.glob("*.jsonl")):
        for i, line in enumerate(f.read_text().splitlines(), 1):
            if line.strip():
                out.append((f"{f.stem}:{i}", json.loads(line)))
    return out


CASES = _load()


def _norm(res: object) -> object:
    """Canonical form of a RES tree (partial {} and missing partial are equal)."""
    if res is None:
        return None
    if isinstance(res, list):
        return [_norm(r) for r in res]
    assert isinstance(res, dict)
    return {"dims_mapping": res["dims_mapping"], "partial": dict(sorted((res.get("partial") or {}).items()))}


@pytest.mark.parametrize(("where", "item"), CASES, ids=[c[0] for c in CASES])
def test_golden(where: str, item: dict) -> None:
    got = answer_line(json.dumps(item["case"]))
    exp = item["expect"]
    if "error" in exp:
        assert got.get("error") == exp["error"], f"{where}: expected {exp['error']}, got {got}"
        return
    assert "error" not in got, f"{where}: unexpected error {got}"
    assert _norm(got["inputs"]) == _norm(exp["inputs"]), f"{where}: inputs {got['inputs']} != {exp['inputs']}"
    assert _norm(got["outputs"]) == _norm(exp["outputs"]), f"{where}: outputs {got['outputs']} != {exp['outputs']}"


def test_golden_files_present() -> None:
    assert CASES, "no golden cases found"
