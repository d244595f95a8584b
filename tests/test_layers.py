"""The package's floor plan, layering and size limits, read from the source (imports parsed
with ``ast``).

Layers, lowest first: the leaves (errors, buffer, defaults, topology, _threads, _process,
smallfile); the tiers, the codec and consistency (each importing only the leaves); the guards
of stored data (``guards``); the engine and the catalog (neither importing the other); the
public face (``checkpointer``, ``sync``, ``dcp``, ``adapters``, ``tiercheck``), the command line
and the integrations, which reach the tiers and the engine only through the public face. Every
import counts: at module level, in a function, or under ``TYPE_CHECKING``; no module of the
package imports itself back through others. Nothing lies loose at the package's root but the
public face and the leaves.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "tiercheck"

#: Modules and classes may not be longer than these (lines, docstrings included).
MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 300

#: The parts whose sizes this test holds to the limits: the whole package, part by part.
SIZED = (
    *sorted(p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()),
    "*.py",
)


def module_name(path: Path) -> str:
    """``tiercheck/a/b.py`` -> ``tiercheck.a.b``; a package's ``__init__`` is the package."""
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_in(source: str, module: str, *, is_package: bool = False) -> list[tuple[str, int]]:
    """Every ``tiercheck`` module (or name in one) the ``source`` of ``module`` imports, with
    its line: absolute and relative imports, at module level, in functions, under
    ``TYPE_CHECKING``."""
    package = module if is_package else module.rpartition(".")[0]
    found: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(source, module)):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = parts[: len(parts) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            # "from tiercheck import tiers" imports the module tiercheck.tiers.
            found += [(f"{target}.{alias.name}", node.lineno) for alias in node.names]
    return [(name, line) for name, line in found if name.split(".")[0] == "tiercheck"]


def imported(path: Path) -> list[tuple[str, int]]:
    """What the source file ``path`` imports (see :func:`imports_in`)."""
    return imports_in(path.read_text(), module_name(path), is_package=path.name == "__init__.py")


def under(name: str, prefix: str) -> bool:
    """Whether the dotted ``name`` is ``prefix`` or inside it."""
    return name == prefix or name.startswith(prefix + ".")


def violations(sources: str, forbidden: tuple[str, ...]) -> list[str]:
    """Imports of ``forbidden`` modules by the modules of ``sources`` (a folder or a file)."""
    start = ROOT / sources
    if sources == "*.py":  # the package's own top-level modules
        files = sorted(ROOT.glob("*.py"))
    else:
        files = sorted(start.rglob("*.py")) if start.is_dir() else [start]
    assert files, f"no source files under {start}"
    return [
        f"{path.relative_to(ROOT.parent)}:{line} imports {name}"
        for path in files
        for name, line in imported(path)
        if any(under(name, f"tiercheck.{f}") for f in forbidden)
    ]


ABOVE_THE_PARTS = ("engine", "catalog", "checkpointer", "sync", "integrations", "cli")

RULES = {
    # The catalog (what the command line reads) shares blobread with restore, never the engine.
    "catalog": ("engine",),
    # The integrations use the public face, like any user.
    "integrations": ("tiers", "engine"),
    # The shared readers and the guards sit below both the engine and the catalog.
    "codec/decode/blobread.py": ABOVE_THE_PARTS,
    "codec/decode/statetree.py": ABOVE_THE_PARTS,
    "guards/node.py": ABOVE_THE_PARTS,
    "guards/durable.py": ABOVE_THE_PARTS,
}

#: What the tiers, the codec and consistency may import besides themselves: the leaves.
LEAVES = ("errors", "buffer", "defaults", "topology", "_threads", "_process", "smallfile")

#: The public face: what users import by module path.
PUBLIC_FACE = ("__init__", "__main__", "checkpointer", "sync", "errors", "dcp", "adapters")


@pytest.mark.parametrize(("sources", "forbidden"), RULES.items(), ids=list(RULES))
def test_no_part_imports_a_layer_it_may_not(sources: str, forbidden: tuple[str, ...]) -> None:
    assert violations(sources, forbidden) == []


def test_the_import_parser_sees_every_kind_of_import() -> None:
    """The rules above can fail: the parser finds absolute, relative, nested and guarded imports."""
    source = (
        "from __future__ import annotations\n"
        "from typing import TYPE_CHECKING\n"
        "import tiercheck.engine.restore.read\n"
        "from ..engine import restore\n"
        "from tiercheck import engine\n"
        "if TYPE_CHECKING:\n"
        "    from tiercheck.engine.core import CheckpointerCore\n"
        "def f() -> None:\n"
        "    from .scan import Catalog\n"
    )
    found = [name for name, _line in imports_in(source, "tiercheck.catalog.probe")]
    assert found == [
        "tiercheck.engine.restore.read",
        "tiercheck.engine.restore",
        "tiercheck.engine",
        "tiercheck.engine.core.CheckpointerCore",
        "tiercheck.catalog.scan.Catalog",
    ]
    assert [
        n for n, _ in imports_in("from . import scan", "tiercheck.catalog", is_package=True)
    ] == ["tiercheck.catalog.scan"]
    assert violations("catalog", ("catalog.scan",)) != []  # a rule that matches fails


@pytest.mark.parametrize("part", ["tiers", "codec", "consistency"])
def test_the_parts_below_the_engine_import_only_the_leaves(part: str) -> None:
    """Nothing above them (engine, catalog, checkpointer, integrations, cli...), nor each other."""
    outside = [
        f"{path.relative_to(ROOT.parent)}:{line} imports {name}"
        for path in sorted((ROOT / part).rglob("*.py"))
        for name, line in imported(path)
        if not any(under(name, f"tiercheck.{m}") for m in (part, *LEAVES))
    ]
    assert outside == []


def oversized(sources: str) -> list[str]:
    """Modules over :data:`MAX_MODULE_LINES` and classes over :data:`MAX_CLASS_LINES`."""
    start = ROOT / sources
    if sources == "*.py":  # the package's own top-level modules
        files = sorted(ROOT.glob("*.py"))
    else:
        files = sorted(start.rglob("*.py")) if start.is_dir() else [start]
    found = []
    for path in files:
        text = path.read_text()
        lines = len(text.splitlines())
        where = path.relative_to(ROOT.parent)
        if lines > MAX_MODULE_LINES:
            found.append(f"{where}: {lines} lines")
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, ast.ClassDef):
                assert node.end_lineno is not None
                size = node.end_lineno - node.lineno + 1
                if size > MAX_CLASS_LINES:
                    found.append(f"{where}: class {node.name} {size} lines")
    return found


@pytest.mark.parametrize("sources", SIZED)
def test_modules_and_classes_stay_small(sources: str) -> None:
    assert oversized(sources) == []


def test_nothing_lies_loose_at_the_root_but_the_public_face_and_the_leaves() -> None:
    loose = sorted(p.stem for p in ROOT.glob("*.py"))
    assert [m for m in loose if m not in PUBLIC_FACE + LEAVES] == []


def test_the_leaves_import_nothing_of_the_package_but_the_errors() -> None:
    found = [
        f"{m}.py:{line} imports {name}"
        for m in LEAVES
        for name, line in imported(ROOT / f"{m}.py")
        if not under(name, "tiercheck.errors")
    ]
    assert found == []


def all_modules() -> dict[str, Path]:
    """Every module of the package by dotted name."""
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def module_of(name: str, modules: dict[str, Path]) -> str | None:
    """The module an imported dotted ``name`` (a module, or a name in one) belongs to."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of the package it imports (anywhere in it, see :func:`imports_in`)."""
    modules = all_modules()
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = {module_of(n, modules) for n, _line in imported(path)}
        edges[name] = {m for m in found if m is not None and m != name}
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, successors = work[-1]
            w = next(successors, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_the_cycle_finder_finds_a_cycle() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert cycles(edges) == [["a", "b", "c"]]


def test_no_module_of_the_package_imports_itself_back() -> None:
    edges = import_graph()
    assert {"tiercheck.engine.open.claim", "tiercheck.codec.encode.flatten"} <= set(edges)
    # A package's __init__ counts as a module: one of its modules importing names the __init__
    # re-exports from another module of it is an edge like any other.
    found = cycles(edges)
    described = ["; ".join(f"{m} imports {sorted(edges[m] & set(c))}" for m in c) for c in found]
    assert not found, "import circles in tiercheck/:\n" + "\n".join(described)


def test_the_moved_modules_keep_their_old_import_paths() -> None:
    """``tiercheck.guard``, ``tiercheck.stateful``... name the modules at their new homes."""
    import importlib

    import tiercheck

    for old, new in tiercheck.MOVED_MODULES.items():
        module = importlib.import_module(f"tiercheck.{old}")
        assert module is importlib.import_module(new), old
        assert getattr(tiercheck, old) is module
    assert importlib.import_module("tiercheck.guard").RankLock is not None
    assert (
        importlib.import_module("tiercheck.fence").Fence
        is importlib.import_module("tiercheck.guards").Fence
    )
