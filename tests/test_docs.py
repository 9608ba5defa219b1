"""docs/deviations.md is true: every deviation id used by a golden line has a section, and
every test a section names exists."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "deviations.md"


def _sections() -> dict[str, str]:
    text = DOC.read_text()
    out: dict[str, str] = {}
    for block in re.split(r"^## ", text, flags=re.M)[1:]:
        head, _, body = block.partition("\n")
        ids = re.findall(r"[a-z0-9]+(?:-[a-z0-9]+)+", head.split("(")[0])
        for i in ids:
            out[i] = body
    return out


def test_every_golden_deviation_is_documented() -> None:
    sections = _sections()
    used = set()
    for f in (ROOT / "tests" / "golden").glob("*.jsonl"):
        for line in f.read_text().splitlines():
            if '"deviation"' in line:
                item = json.loads(line)
                used.add(item["deviation"])
                assert "paddle" in item, f"{f.name}: a deviation line must record Paddle's answer"
    missing = sorted(used - set(sections))
    assert not missing, f"deviation ids without a section in docs/deviations.md: {missing}"


def test_every_named_test_exists() -> None:
    text = DOC.read_text()
    refs = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", text)
    assert refs, "docs/deviations.md names no tests"
    for path, name in refs:
        src = (ROOT / path).read_text()
        assert re.search(rf"^def {name}\(", src, flags=re.M), f"{path}::{name} named in docs/deviations.md does not exist"


def test_every_section_names_a_test() -> None:
    text = DOC.read_text()
    for block in re.split(r"^## ", text, flags=re.M)[1:]:
        head = block.partition("\n")[0]
        if "Sound extension" in head or "Known difference" in head:
            continue
        assert "tests/" in block, f"section {head!r} names no test"
