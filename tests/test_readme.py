"""The README stays true: its generated tables are current, and its examples run as shown."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

from spmdkit.io.codec import answer_line

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
_spec = importlib.util.spec_from_file_location("readme_tables", ROOT / "scripts" / "readme_tables.py")
assert _spec and _spec.loader
readme_tables = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(readme_tables)


def test_generated_tables_are_current() -> None:
    for name in readme_tables.TABLES:
        assert f"<!-- {name} -->" in README, f"README has no {name} markers"
    fresh = readme_tables.render(README)
    assert readme_tables.comparable(fresh) == readme_tables.comparable(README), \
        "README's generated parts are stale: run python scripts/readme_tables.py"


def test_batch_example_output_is_real() -> None:
    block = README[README.index("spmdkit infer --batch"):]
    cases = re.findall(r"'(\{\"id\":\d.*?\})'", README)
    assert len(cases) == 2
    shown = [json.loads(x) for x in re.findall(r"^(\{\"id\": \d.*)$", block, flags=re.M)[:2]]
    assert [answer_line(c) for c in cases] == shown


def test_the_catalog_count_is_current() -> None:
    """The README's count of the catalog's architectures is what ``spmdkit models`` lists (it said
    37 after Qwen3-Next made 38)."""
    from spmdkit.models.catalog import entries

    said = re.search(r"`spmdkit models` lists the catalog: (\d+) published architectures", README)
    assert said and int(said.group(1)) == len(entries())
