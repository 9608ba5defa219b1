"""The docs are true to the code: docs/deviations.md has a section for every deviation id a
golden line uses and every test a section names exists; every module, name, file and link that
README.md and docs/*.md name exists."""

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


# --- every module, name and file the README and docs/*.md point at exists --------------------

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SRC = ROOT / "src" / "spmdkit"
# `spmdkit.a.b.c`: a module, or a module and then attributes
DOTTED = re.compile(r"(?<![\w.])spmdkit(?:\.[A-Za-z_]\w*)+")
# `from spmdkit.x import a, b` (one line or parenthesised over several)
FROM_IMPORT = re.compile(r"^\s*from\s+(spmdkit(?:\.\w+)*)\s+import\s+(\([^)]*\)|[^\n]+)", re.M)
# a path to a Python file: `engine/declare.py`, `src/spmdkit/ops/norm.py`, `tests/test_x.py`, `norm.py`
PY_PATH = re.compile(r"(?<![\w./-])((?:\.\./)*[\w-]+(?:/[\w-]+)*\.py)\b")
# a folder of the package written as a path: `src/spmdkit/planner/auto/`
SRC_DIR = re.compile(r"(?<![\w./-])src/spmdkit((?:/\w+)*)/?(?![\w./])")
# Python files of other projects that the docs name (Paddle's unit tests, an example traceback)
FOREIGN = {"test_reduction_rule.py", "test_slice_rule.py", "model.py", "_view_ops.py"}


def _resolve(dotted: str) -> str | None:
    """None when `dotted` names a module or an attribute reachable from one; else the reason."""
    import importlib

    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        name = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name is not None and name.startswith(e.name) and e.name.startswith("spmdkit"):
                continue  # this prefix is not a module: try a shorter one
            optional = (e.name or "").split(".")[0] in ("torch", "transformers", "jax", "paddle", "numpy", "highspy")
            return None if optional else f"{name}: {e}"  # an extra not installed: not judged here
        for i, attr in enumerate(parts[cut:]):
            if not hasattr(obj, attr):
                return f"{'.'.join(parts[: cut + i])} has no attribute {attr!r}"
            obj = getattr(obj, attr)
        return None
    return "no importable prefix"


def _dotted_names(text: str) -> set[str]:
    names = {m.rstrip(".") for m in DOTTED.findall(text)}
    for module, what in FROM_IMPORT.findall(text):
        for item in what.strip("()").split(","):
            item = item.split("#")[0].split(" as ")[0].strip()
            if item and item != "*":
                names.add(f"{module}.{item}")
    return names


def _all_files() -> list[str]:
    return [p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.py") if ".venv" not in p.parts]


def _path_exists(path: str, files: list[str]) -> bool:
    if (ROOT / path).is_file():
        return True
    # a path inside the package written from its floor (`ops/norm.py`, `refs/norm.py`) or a bare
    # file name: some file of the repository ends with it
    return any(f == path or f.endswith("/" + path) for f in files)


def _torch_file(path: str) -> bool:
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return True  # no torch here: nothing to check it against
    return (Path(next(iter(spec.submodule_search_locations))).parent / path).is_file()


def stale_references(text: str, files: list[str] | None = None) -> list[str]:
    """Every dotted name and path in `text` that does not exist in the code as it is now."""
    files = _all_files() if files is None else files
    bad = []
    for name in sorted(_dotted_names(text)):
        why = _resolve(name)
        if why:
            bad.append(f"{name} ({why})")
    for path in sorted(set(PY_PATH.findall(text))):
        if path in FOREIGN or path.startswith("../"):
            continue  # another project's file, or one outside this repository
        if path.startswith("torch/"):  # torch's own source: checked against the torch installed
            if not _torch_file(path):
                bad.append(f"{path} (not in the installed torch)")
            continue
        if not _path_exists(path, files):
            bad.append(f"{path} (no such file)")
    for sub in sorted(set(SRC_DIR.findall(text))):
        if not (SRC / sub.lstrip("/")).exists():
            bad.append(f"src/spmdkit{sub} (no such file or folder)")
    return bad


def test_every_named_module_and_file_exists() -> None:
    files = _all_files()
    bad = {doc.relative_to(ROOT).as_posix(): stale_references(doc.read_text(), files) for doc in DOCS}
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, "stale names in the docs:\n" + "\n".join(f"{k}: {', '.join(v)}" for k, v in bad.items())


def test_the_name_check_catches_a_stale_name() -> None:
    """The check is not vacuous: true names pass, each kind of stale one is caught."""
    files = _all_files()
    true = "`spmdkit.core.reshard.plan_reshard`, `ops/norm.py`, `src/spmdkit/planner/auto/`, `refs/norm.py`"
    assert stale_references(true, files) == []
    for stale in (
        "spmdkit.graph.compute",  # a module that moved
        "spmdkit.core.reshard.no_such_function",  # an attribute that is gone
        "from spmdkit.ops import get_rule, no_such_name",  # a name imported in a code block
        "`graph/compute.py`",  # a floor path that moved
        "`src/spmdkit/rules/norm.py`",
        "`src/spmdkit/graph/`",
        "`torch_exec.py`",  # a bare file name that is gone
    ):
        assert stale_references(stale, files), f"the check misses {stale!r}"


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but hyphens dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_resolves() -> None:
    """A relative link names a file that exists, and its #anchor a heading of that file."""
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # http:, https:, mailto:
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            assert file.exists(), f"{doc.name}: link to {target}: no such file"
            if anchor:
                heads = re.findall(r"^#+ (.*)$", file.read_text(), flags=re.M)
                assert anchor in {_slug(h) for h in heads}, f"{doc.name}: link to {target}: no such heading"
