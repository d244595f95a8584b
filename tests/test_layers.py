"""The package's layering and size limits, read from the source (imports parsed with ``ast``).

Layers, lowest first: the leaves (errors, buffer, defaults, topology, _threads); the tiers, the
codec and consistency (each importing only the leaves); ``blobread`` and ``statetree`` (one
blob read back, verified; a decoded state put into live objects), the guards (``guard``,
``fence``); the engine and the catalog (neither importing the other); the public face
(``checkpointer``, ``sync``, ``tiercheck``), the command line and the integrations, which reach
the tiers and the engine only through the public face. Every import counts: at module level, in
a function, or under ``TYPE_CHECKING``.
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
    "blobread.py": ABOVE_THE_PARTS,
    "statetree.py": ABOVE_THE_PARTS,
    "guard.py": ABOVE_THE_PARTS,
    "fence.py": ABOVE_THE_PARTS,
}

#: What the tiers, the codec and consistency may import besides themselves: the leaves.
LEAVES = ("errors", "buffer", "defaults", "topology", "_threads")


@pytest.mark.parametrize(("sources", "forbidden"), RULES.items(), ids=list(RULES))
def test_no_part_imports_a_layer_it_may_not(sources: str, forbidden: tuple[str, ...]) -> None:
    assert violations(sources, forbidden) == []


def test_the_import_parser_sees_every_kind_of_import() -> None:
    """The rules above can fail: the parser finds absolute, relative, nested and guarded imports."""
    source = (
        "from __future__ import annotations\n"
        "from typing import TYPE_CHECKING\n"
        "import tiercheck.engine.read\n"
        "from ..engine import restore\n"
        "from tiercheck import engine\n"
        "if TYPE_CHECKING:\n"
        "    from tiercheck.engine.core import CheckpointerCore\n"
        "def f() -> None:\n"
        "    from .scan import Catalog\n"
    )
    found = [name for name, _line in imports_in(source, "tiercheck.catalog.probe")]
    assert found == [
        "tiercheck.engine.read",
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
