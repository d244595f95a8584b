"""The docs name the code as it is: every backticked path, class member and module member in
the pages under ``docs/`` and the README exists in the source, and the architecture page's table
of the protocol's steps lists every :class:`~tiercheck.consistency.protocol.Step`, in order,
with its message class. Read from the source with ``ast``: nothing is imported but the steps."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

from tiercheck.consistency.protocol import STEP_MESSAGES, Step

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tiercheck"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

_SPAN = re.compile(r"`([^`\n]+)`")
#: A Python file of the repository (not torch's), as the pages write them: from the
#: repository's root (``tests/test_docs.py``), from the package's (``engine/steps.py``), or from
#: the package named in the same breath (``claim.py`` beside ``engine/open/``,
#: ``encode/plan.py``).
_PATH = re.compile(r"^(?!torch/)(?:[\w.-]+/)*[\w-]+\.py$")
#: ``Owner.member`` or ``module.member`` (a call's parentheses and arguments allowed).
_DOTTED = re.compile(r"^([A-Za-z_]\w*)\.([A-Za-z_]\w*)(?:\(.*\))?$")


class Index:
    """What the package defines: classes and their members, modules and their names."""

    def __init__(self) -> None:
        self.members: dict[str, set[str]] = defaultdict(set)
        self.bases: dict[str, set[str]] = defaultdict(set)
        self.modules: dict[str, set[str]] = defaultdict(set)
        for path in sorted(PACKAGE.rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            names = self.modules[path.stem]
            for node in tree.body:
                names |= _bound(node)
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    self._add_class(node)

    def _add_class(self, node: ast.ClassDef) -> None:
        members = self.members[node.name]
        for base in node.bases:
            if isinstance(base, ast.Name):
                self.bases[node.name].add(base.id)
            elif isinstance(base, ast.Subscript) and isinstance(base.value, ast.Name):
                self.bases[node.name].add(base.value.id)
        for item in node.body:
            members |= _bound(item)
        for sub in ast.walk(node):
            if (
                isinstance(sub, ast.Attribute)
                and isinstance(sub.value, ast.Name)
                and sub.value.id in ("self", "cls")
                and isinstance(sub.ctx, ast.Store)
            ):
                members.add(sub.attr)

    def has_member(self, owner: str, member: str, seen: frozenset[str] = frozenset()) -> bool:
        """Whether class ``owner`` (or a base of it defined in the package) has ``member``."""
        if member in self.members.get(owner, ()):
            return True
        return any(
            self.has_member(base, member, seen | {owner})
            for base in self.bases.get(owner, ())
            if base not in seen
        )


def _bound(node: ast.stmt) -> set[str]:
    """The names a statement of a module or class body binds."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, ast.Assign):
        return {t.id for t in node.targets if isinstance(t, ast.Name)}
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return {node.target.id}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in node.names}
    if isinstance(node, (ast.If, ast.Try)):
        return {n for child in node.body for n in _bound(child)}
    return set()


#: A file and a name in it, side by side: ``engine/open/claim.py` `Claim.guard``.
_BESIDE = re.compile(r"`((?:[\w.-]+/)*[\w-]+\.py)` `([A-Za-z_]\w*)(?:\.([A-Za-z_]\w*))?(?:\(\))?`")


def named_in_files(pages: list[Path], root: Path, index: Index) -> list[str]:
    """The names the pages place in a file (``path.py` `name``) that the file does not define
    (at its top level, or as a member of a class it defines)."""
    found = []
    sources = python_files(root)
    for page in pages:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            for m in _BESIDE.finditer(line):
                path, name, member = m.groups()
                files = [p for p in sources if p.as_posix().endswith("/" + path)]
                if not files:
                    continue  # a path that does not exist is drifted()'s finding
                tree = ast.parse(files[0].read_text())
                ok = name in {n for node in tree.body for n in _bound(node)}
                if ok and member is not None:
                    ok = index.has_member(name, member)
                if not ok:
                    what = name if member is None else f"{name}.{member}"
                    found.append(f"{page.relative_to(root)}:{number}: {path} has no {what}")
    return found


def _spans(page: Path) -> list[tuple[int, str]]:
    """``(line, text)`` of every inline code span of ``page``, fenced blocks included (the
    floor plan is one)."""
    return [
        (number, m.group(1).strip())
        for number, line in enumerate(page.read_text().splitlines(), 1)
        for m in _SPAN.finditer(line)
    ]


def python_files(root: Path) -> list[Path]:
    """The Python files of the package and of the repository at ``root`` (its tests, its
    benchmarks and its top level), each once."""
    found = [*PACKAGE.rglob("*.py"), *root.glob("*.py")]
    for part in ("tests", "bench"):
        found += (root / part).rglob("*.py")
    return list(dict.fromkeys(found))


def drifted(pages: list[Path], index: Index, root: Path = ROOT) -> list[str]:
    """The code names in ``pages`` (under ``root``) that the source does not have."""
    found = []
    known = [p.as_posix() for p in python_files(root)]
    for page in pages:
        for line, text in _spans(page):
            where = f"{page.relative_to(root)}:{line}: `{text}`"
            if _PATH.match(text):
                if not any(p.endswith("/" + text) for p in known):
                    found.append(f"{where} (no such path)")
                continue
            m = _DOTTED.match(text)
            if m is None:
                continue
            owner, member = m.groups()
            if owner in index.members:
                if not index.has_member(owner, member):
                    found.append(f"{where} ({owner} has no {member})")
            elif (
                owner in index.modules
                and owner not in _FOREIGN_MODULES
                and member not in index.modules[owner]
            ):
                found.append(f"{where} (module {owner} has no {member})")
    return found


#: Module names of the package that the pages also use for something else: ``dcp`` for
#: ``torch.distributed.checkpoint`` (``dcp.load``), the others for objects (``tier.putv``,
#: ``catalog.written``, ``model.state_dict()``).
_FOREIGN_MODULES = {"catalog", "dcp", "model", "tier"}


def test_the_docs_name_code_that_exists() -> None:
    found = drifted(PAGES, Index())
    assert not found, "the docs name code that does not exist:\n" + "\n".join(found)


def test_the_docs_place_names_in_the_files_that_define_them() -> None:
    found = named_in_files(PAGES, ROOT, Index())
    assert not found, "the docs place names in files that lack them:\n" + "\n".join(found)


def test_the_drift_check_finds_drift(tmp_path: Path) -> None:
    """The checks above can fail: a missing method, module member, path and name in a file are
    each found; what exists is not."""
    page = tmp_path / "page.md"
    page.write_text(
        "`Timeline._set_aside`, `Timeline.settle`, `journal.Nothing`, `journal.Journal`,\n"
        "`engine/nowhere.py`, `engine/steps.py`, `Step.VOTE`\n"
        "`engine/open/claim.py` `Claim.guard`, `engine/steps.py` `Nope`\n"
    )
    index = Index()
    found = [entry.partition(": ")[2] for entry in drifted([page], index, root=tmp_path)]
    assert found == [
        "`Timeline._set_aside` (Timeline has no _set_aside)",
        "`journal.Nothing` (module journal has no Nothing)",
        "`engine/nowhere.py` (no such path)",
    ]
    placed = [entry.partition(": ")[2] for entry in named_in_files([page], tmp_path, index)]
    assert placed == ["engine/steps.py has no Nope"]


_ROW = re.compile(r"^\| `([a-z-]+)` \| `(\w+)`")


def test_the_step_table_lists_every_step_with_its_message() -> None:
    page = (ROOT / "docs" / "architecture.md").read_text()
    table = page[page.index("## The protocol's steps") :]
    table = table[: table.index("\n## ")]
    rows = [m.groups() for line in table.splitlines() if (m := _ROW.match(line))]
    assert [step for step, _ in rows] == [s.value for s in Step]
    assert dict(rows) == {s.value: STEP_MESSAGES[s].__name__ for s in Step}


def _floor_plan() -> list[str]:
    """The lines of the floor plan's diagram in ``docs/architecture.md``."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    section = page[page.index("## Floor plan") :]
    block = section[section.index("```\n") + 4 :]
    return block[: block.index("```")].splitlines()


def test_the_floor_plan_names_every_package_and_module() -> None:
    """The diagram names every package of ``tiercheck/``, every phase of the engine and every
    part of the codec with each of its modules, and every module at their roots and the
    package's: the floor plan matches the tree."""
    lines = _floor_plan()
    text = "\n".join(lines)
    words = set(re.findall(r"[A-Za-z_]+", text))
    missing = []
    for package in sorted(p for p in PACKAGE.iterdir() if (p / "__init__.py").exists()):
        if f"{package.name}/" not in text:
            missing.append(f"{package.name}/")
    for module in sorted(PACKAGE.glob("*.py")):
        if module.stem not in ("__init__", "__main__") and module.stem not in words:
            missing.append(module.name)
    for part in ("engine", "codec"):
        folder = PACKAGE / part
        for module in sorted(folder.glob("*.py")):
            if module.stem != "__init__" and f"{module.name}" not in text:
                missing.append(f"{part}/{module.name}")
        for sub in sorted(p for p in folder.iterdir() if (p / "__init__.py").exists()):
            [line] = [line for line in lines if re.match(rf"^\s+{sub.name}/\s", line)] or [""]
            named = set(re.findall(r"[a-z_]+", line))
            missing += [
                f"{part}/{sub.name}/{m.name}"
                for m in sorted(sub.glob("*.py"))
                if m.stem != "__init__" and m.stem not in named
            ]
    assert not missing, f"the floor plan (docs/architecture.md) does not name {missing}"
