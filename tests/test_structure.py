"""The shape of the code: no import cycle between the package's modules, no function too
long to read at once (docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: Where the package's modules live, and the name each folder is imported as.
ROOTS = ((REPO / "dtprofile", "dtprofile"), (REPO / "integrations", "dtprofile.integrations"))
#: The longest a function may be, from its ``def`` to its last line, docstring included.
MAX_FUNCTION_LINES = 120


def _modules() -> dict[str, tuple[Path, bool]]:
    out = {}
    for folder, package in ROOTS:
        for path in folder.rglob("*.py"):
            parts = [p for p in path.relative_to(folder).with_suffix("").parts if p != "__init__"]
            out[".".join([package, *parts])] = (path, path.name == "__init__.py")
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (any import, TYPE_CHECKING included: a
    cycle there is one a reader must untangle too). ``from . import x`` imports module x
    where x is one, else the package."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, (path, is_package) in modules.items():
        base = name.split(".") if is_package else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                target = node.module or ""
                if node.level:
                    target = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
                subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules]
                graph[name] |= set(subs or ([target] if target in modules else [])) - {name}
            elif isinstance(node, ast.Import):
                graph[name] |= {a.name for a in node.names if a.name in modules} - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

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
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_between_the_packages_modules():
    graph = import_graph()
    assert len(graph) > 50 and graph["dtprofile.engine"], "the graph is the package's"
    assert cycles(graph) == []


def test_no_function_longer_than_the_limit():
    long = []
    for path, _ in _modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, long
