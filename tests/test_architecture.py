"""The house's rules, read from the source (docs/architecture.md): the floors in the order a plan is
made, imports only downward, no import circle, small files and functions, package imports at
module level, ``exec`` only in the engine's code generator, no memo by object id kept by hand."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = SRC / "spmdkit"

#: the floors, lowest first: a module may import its own floor and the floors before it
FLOORS = ("core", "engine", "ops", "io", "program", "models", "strategies", "cost", "planner", "sim", "execute",
          "outputs", "cli")
#: modules that stand on no floor: the package's face and ``python -m spmdkit``
FACES = ("spmdkit", "spmdkit.__main__")

MAX_FILE_LINES = 1000
MAX_FUNCTION_LINES = 150
LONG_FUNCTION_LINES = 120
MAX_LONG_FUNCTIONS = 3
MAX_INNER_IMPORTS = 20
#: the one module that runs generated code
CODEGEN = "spmdkit.engine.codegen"


def _module(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> dict[str, tuple[Path, ast.Module]]:
    return {_module(p): (p, ast.parse(p.read_text(), str(p))) for p in sorted(PKG.rglob("*.py"))}


SOURCES = _sources()


def test_the_sources_are_read() -> None:
    assert len(SOURCES) > 100 and "spmdkit.core.mesh" in SOURCES and "spmdkit.cli" in SOURCES


def _imports(name: str, tree: ast.Module, path: Path) -> Iterator[tuple[str, int, bool]]:
    """(imported spmdkit module, line, inside a function) for every import of the package."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def walk(node: ast.AST, inner: bool) -> Iterator[tuple[str, int, bool]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                for a in child.names:
                    if a.name.split(".")[0] == "spmdkit":
                        yield a.name, child.lineno, inner
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join([*up, base] if base else up)
                if base.split(".")[0] == "spmdkit":
                    for a in child.names:  # ``from spmdkit.x import y`` may name the module x.y
                        yield (f"{base}.{a.name}" if f"{base}.{a.name}" in SOURCES else base), child.lineno, inner
            else:
                yield from walk(child, inner or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef))

    yield from walk(tree, False)


def _floor(name: str) -> int | None:
    parts = name.split(".")
    return FLOORS.index(parts[1]) if len(parts) > 1 and parts[1] in FLOORS else None


def test_every_module_stands_on_a_floor() -> None:
    lost = [n for n in SOURCES if n not in FACES and _floor(n) is None]
    assert not lost, f"modules on no floor of {FLOORS}: {lost}"


def test_imports_run_only_downward() -> None:
    upward = []
    for name, (path, tree) in SOURCES.items():
        mine = _floor(name)
        if mine is None:
            continue
        for target, line, _ in _imports(name, tree, path):
            theirs = _floor(target)
            if theirs is None or theirs > mine:
                upward.append(f"{path.relative_to(SRC)}:{line} ({FLOORS[mine]}) imports {target}")
    assert not upward, "imports that run back up a floor:\n" + "\n".join(upward)


def test_no_import_circle() -> None:
    graph: dict[str, set[str]] = {n: set() for n in SOURCES}
    for name, (path, tree) in SOURCES.items():
        for target, _, _ in _imports(name, tree, path):
            while target not in SOURCES and "." in target:  # ``import spmdkit.x.y`` of a name
                target = target.rpartition(".")[0]
            if target != name and target in SOURCES:
                graph[name].add(target)
    for name in FACES:  # the face imports everything and nothing imports it back
        graph[name] = set()
    # Tarjan's strongly connected components: a component of two or more modules is a circle
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


def test_files_are_small() -> None:
    big = {str(p.relative_to(SRC)): n for p, _ in SOURCES.values() if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert not big, f"files over {MAX_FILE_LINES} lines: {big}"


def _functions() -> Iterator[tuple[str, int]]:
    for path, tree in SOURCES.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                assert node.end_lineno is not None
                yield f"{path.relative_to(SRC)}:{node.lineno} {node.name}", node.end_lineno - node.lineno + 1


def test_functions_are_short() -> None:
    sizes = dict(_functions())
    over = {k: v for k, v in sizes.items() if v > MAX_FUNCTION_LINES}
    long = {k: v for k, v in sizes.items() if v > LONG_FUNCTION_LINES}
    assert not over, f"functions over {MAX_FUNCTION_LINES} lines: {over}"
    assert len(long) <= MAX_LONG_FUNCTIONS, f"more than {MAX_LONG_FUNCTIONS} functions over {LONG_FUNCTION_LINES} lines: {long}"


def test_package_imports_at_module_level() -> None:
    inner = sorted({f"{path.relative_to(SRC)}:{line}" for name, (path, tree) in SOURCES.items()
                    for _, line, is_inner in _imports(name, tree, path) if is_inner})  # one per statement
    assert len(inner) <= MAX_INNER_IMPORTS, f"{len(inner)} package imports inside functions:\n" + "\n".join(inner)


def test_exec_only_in_the_code_generator() -> None:
    found = []
    for name, (path, tree) in SOURCES.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("exec", "eval"):
                if name != CODEGEN:
                    found.append(f"{path.relative_to(SRC)}:{node.lineno} {node.func.id}")
    assert not found, f"exec / eval outside {CODEGEN}: {found}"


def _id_memos(tree: ast.Module) -> Iterator[tuple[int, str]]:
    """Module-level dicts keyed by int and made empty (``X: dict[int, ...] = {}``): a memo by object
    id kept by hand, which no ``clear_cache`` empties and whose ids outlive their objects (the house
    keeps such memos in ``spmdkit.engine.memo.Recent``)."""
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and \
                isinstance(node.value, ast.Dict) and not node.value.keys and \
                ast.unparse(node.annotation).replace(" ", "").startswith("dict[int,"):
            yield node.lineno, node.target.id


def test_no_memo_by_id_kept_by_hand() -> None:
    found = [f"{path.relative_to(SRC)}:{line} {n}" for path, tree in SOURCES.values() for line, n in _id_memos(tree)]
    assert not found, f"module-level dicts by int key (use spmdkit.engine.memo.Recent): {found}"
    assert [n for _, n in _id_memos(ast.parse("_M: dict[int, tuple[int, str]] = {}\n"))] == ["_M"]


@pytest.mark.parametrize("bad", ["from spmdkit.cli.plan import main\n", "def f():\n    import spmdkit.planner.auto\n"])
def test_an_upward_import_is_found(bad: str) -> None:
    """The checks read what they should: an upward import at module level or in a function."""
    tree = ast.parse(bad)
    got = list(_imports("spmdkit.core.mesh", tree, PKG / "core" / "mesh.py"))
    assert got and all(_floor(t) is not None and _floor(t) > _floor("spmdkit.core.mesh") for t, _, _ in got)  # type: ignore[operator]
