"""No import cycle inside tiercheck/engine/, counting every import: at module level, under
``TYPE_CHECKING`` and inside functions (each is a dependency the design has, whether or not
Python happens to run it at import time)."""

from __future__ import annotations

import ast
from pathlib import Path

import tiercheck.engine

ENGINE = Path(tiercheck.engine.__file__).parent


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The engine modules ``path`` imports, anywhere in it."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from . import x / from .x import y
                base = (node.module or "").split(".")[0]
                found |= {base} if base else {a.name for a in node.names}
            elif node.module == "tiercheck.engine":
                found |= {a.name for a in node.names}
            elif node.module and node.module.startswith("tiercheck.engine."):
                found.add(node.module.split(".")[2])
        elif isinstance(node, ast.Import):
            found |= {
                a.name.split(".")[2] for a in node.names if a.name.startswith("tiercheck.engine.")
            }
    return (found & modules) - {path.stem}


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges[v]):
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
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_cycle() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(edges) == [["a", "b", "c"]]


def test_no_module_of_the_engine_imports_itself_back() -> None:
    paths = {p.stem: p for p in ENGINE.glob("*.py") if p.stem != "__init__"}
    modules = set(paths)
    assert {"claim", "collectives", "tier", "commit", "engine", "shutdown"} <= modules
    edges = {name: _imports(path, modules) for name, path in paths.items()}
    cycles = _cycles(edges)
    described = ["; ".join(f"{m} imports {sorted(edges[m] & set(c))}" for m in c) for c in cycles]
    assert not cycles, "import cycles in tiercheck/engine/:\n" + "\n".join(described)
