"""The README and the pages under ``docs/`` link right, on GitHub and on the MkDocs site.

``mkdocs build --strict`` (in CI) checks the links between the pages under ``docs/`` as the site
resolves them. These tests check what it cannot see: the README's links (the README is not a
page of the site), every link as GitHub resolves it, and that each heading gets the same anchor
on GitHub and on the site, so that one link works in both. They also keep the README a front
door (short, with the test command ``.ci/run`` reads from it).
"""

from __future__ import annotations

import re
import subprocess
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"

#: The README stays a front door; the rest lives under docs/ (issue #20).
README_MAX_LINES = 300

_FENCE = re.compile(r"^(`{3,})")
_HEADING = re.compile(r"^(#{1,6}) +(.*?) *#*$")
_LINK = re.compile(r"!?\[(?:[^\]]|\][^(])*\]\(([^)\s]+)\)")


def _pages() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def _prose(path: Path) -> list[str]:
    """The lines of ``path`` outside fenced code blocks (blanks in their place)."""
    out, fence = [], None
    for line in path.read_text().splitlines():
        m = _FENCE.match(line)
        if fence is None and m is not None:
            fence = m.group(1)
            out.append("")
        elif fence is not None:
            if line.strip() == fence:
                fence = None
            out.append("")
        else:
            out.append(line)
    return out


def _text(heading: str) -> str:
    """A heading's text as rendered: links by their text, no code or emphasis marks."""
    heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    return heading.replace("`", "").replace("**", "").replace("*", "")


def github_anchor(text: str) -> str:
    """The anchor GitHub gives a heading (github-slugger): lower case, punctuation removed,
    each space a hyphen."""
    text = text.strip().lower()
    kept = "".join(
        c
        for c in text
        if c in " -_" or unicodedata.category(c)[0] in "LMN"  # letters, marks, numbers
    )
    return kept.replace(" ", "-")


def mkdocs_anchor(text: str) -> str:
    """The anchor MkDocs gives a heading (Python-Markdown's ``toc`` slugify)."""
    value = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    value = re.sub(r"[^\w\s-]", "", value).strip().lower()
    return re.sub(r"[-\s]+", "-", value)


def _headings(path: Path) -> list[str]:
    return [_text(m.group(2)) for line in _prose(path) if (m := _HEADING.match(line))]


def _links(path: Path) -> list[tuple[int, str]]:
    """``(line, target)`` of every Markdown link and image outside code, but not inside
    inline code spans."""
    out = []
    for number, line in enumerate(_prose(path), 1):
        plain = re.sub(r"`[^`]*`", "", line)
        out.extend((number, m.group(1)) for m in _LINK.finditer(plain))
    return out


def test_every_heading_has_the_same_anchor_on_github_and_on_the_site() -> None:
    differ = [
        f"{path.relative_to(ROOT)}: {text!r} -> #{github_anchor(text)} / #{mkdocs_anchor(text)}"
        for path in _pages()
        for text in _headings(path)
        if github_anchor(text) != mkdocs_anchor(text)
    ]
    assert not differ, f"reword these headings (punctuation between words): {differ}"


def test_headings_are_unique_within_a_page() -> None:
    # GitHub and MkDocs number repeated anchors differently (-1 and _1).
    for path in _pages():
        anchors = [github_anchor(text) for text in _headings(path)]
        repeated = sorted({a for a in anchors if anchors.count(a) > 1})
        assert not repeated, f"{path.relative_to(ROOT)} repeats the headings {repeated}"


def test_every_relative_link_resolves_as_github_reads_it() -> None:
    broken = []
    for path in _pages():
        for line, target in _links(path):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            where = f"{path.relative_to(ROOT)}:{line}: {target}"
            if not dest.exists():
                broken.append(f"{where} (no such file)")
            elif (
                anchor
                and dest.suffix == ".md"
                and anchor not in {github_anchor(t) for t in _headings(dest)}
            ):
                broken.append(f"{where} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_readme_links_every_page_of_the_site() -> None:
    linked = {
        (README.parent / target.partition("#")[0]).resolve()
        for _, target in _links(README)
        if target.startswith("docs/")
    }
    missing = [
        str(page.relative_to(ROOT)) for page in sorted(DOCS.rglob("*.md")) if page not in linked
    ]
    # Pages of the trainer integrations are reached through their overview.
    missing = [p for p in missing if p not in ("docs/lightning.md", "docs/huggingface.md")]
    assert not missing, f"the README links no way to {missing}"


def test_the_readme_stays_a_front_door() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move the detail to a "
        "page under docs/ and link it"
    )


def test_the_test_command_is_where_ci_reads_it() -> None:
    # Exactly what .ci/run runs: the lines between the markers, without them and the fence.
    ci = (ROOT / ".ci" / "run").read_text()
    sed = "sed -n '/<!-- test-command -->/,/<!-- \\/test-command -->/p' README.md"
    assert sed in ci, ".ci/run no longer reads the test command this way: update this test"
    text = README.read_text()
    assert text.count("<!-- test-command -->") == 1
    assert text.count("<!-- /test-command -->") == 1
    extracted = subprocess.run(
        ["bash", "-c", f"{sed} | grep -v '^<!--' | grep -v '^```'"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert extracted.count("\n") == 0, f"one command line expected, got {extracted!r}"
    assert "python -m pytest" in extracted
    assert "pip install" in extracted
