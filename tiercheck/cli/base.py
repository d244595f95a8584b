"""What every command shares: exit codes, usage errors, the console, and text formatting."""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
import time
from collections.abc import Sequence
from typing import IO, Any, cast

from tiercheck.catalog import AbandonedSetEntry, Catalog, NullProgress, Progress
from tiercheck.cli.pipe import GuardedStream
from tiercheck.tiers.base import Leftover

__all__ = [
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_PROBLEMS",
    "EXIT_USAGE",
    "Console",
    "ProgressBar",
    "UsageError",
    "abandoned_line",
    "abandoned_summary",
    "fmt_age",
    "fmt_ratio",
    "fmt_size",
    "fmt_time",
    "leftover_line",
    "plural",
    "print_location_header",
    "ranks_of",
    "short",
    "short_token",
    "table",
    "yes_no",
]

EXIT_OK = 0
#: ``verify`` found a problem, or an operation failed (a blob that does not decode...).
EXIT_PROBLEMS = 1
#: Bad arguments, or a location, job, version or rank that does not exist.
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class UsageError(Exception):
    """The command line asks for something that cannot be done as asked (exit code 2)."""


class ProgressBar:
    """A :class:`~tiercheck.catalog.Progress` drawn with ``tqdm`` on stderr, when enabled."""

    def __init__(self, enabled: bool, stream: IO[str]) -> None:
        self._enabled = enabled
        self._stream = stream
        self._bar: Any = None

    def start(self, total: int, what: str) -> None:
        """Open a bar of ``total`` steps (none for a single step: it would only flicker)."""
        self.finish()
        if self._enabled and total > 1:
            # Imported by name: tqdm is optional and ships no type stubs.
            tqdm: Any = importlib.import_module("tqdm").tqdm
            self._bar = tqdm(total=total, desc=what, file=self._stream, leave=False, unit="blob")

    def advance(self, n: int = 1) -> None:
        """Move the bar on."""
        if self._bar is not None:
            self._bar.update(n)

    def finish(self) -> None:
        """Close the bar."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class Console:
    """Where a command writes: human text or one JSON document on stdout, notes on stderr."""

    def __init__(self, *, json_mode: bool, progress: bool) -> None:
        self.json_mode = json_mode
        # Looked up now, not at import: tests and callers may have replaced sys.stdout. A
        # reader that goes away (`| head`) is OutputClosed, never a failure to report.
        self.out: IO[str] = cast("IO[str]", GuardedStream(sys.stdout))
        self.err: IO[str] = cast("IO[str]", GuardedStream(sys.stderr))
        self.inp: IO[str] = sys.stdin
        have_tqdm = importlib.util.find_spec("tqdm") is not None
        self._progress = progress and have_tqdm and self.err.isatty()

    def progress(self) -> Progress:
        """A progress reporter for one operation (silent when disabled)."""
        return ProgressBar(True, self.err) if self._progress else NullProgress()

    def line(self, text: str = "") -> None:
        """A line of human output (stdout)."""
        print(text, file=self.out)

    def note(self, text: str) -> None:
        """A remark beside the output (stderr): warnings, hints."""
        print(f"tiercheck: {text}", file=self.err)

    def can_ask(self) -> bool:
        """Whether a person can be asked: human output, and a terminal on stdin."""
        return not self.json_mode and self.inp.isatty()

    def ask(self, question: str) -> str:
        """Ask on stderr, read one line from stdin (blocking: call it in a thread)."""
        print(question, end="", file=self.err, flush=True)
        return self.inp.readline().strip()

    def json(self, document: Any) -> None:
        """The command's result as JSON (stdout)."""
        json.dump(document, self.out, indent=2, sort_keys=False)
        self.out.write("\n")


def fmt_size(n: int | None) -> str:
    if n is None:
        return "?"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def fmt_age(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def leftover_line(item: Leftover) -> str:
    """One line for people about something a killed writer left (``ls``, ``gc``, ``rm-job``)."""
    what = "temporary file" if item.kind == "temporary" else "unfinished upload of"
    when = "last changed" if item.kind == "temporary" else "started"
    fate = (
        "removable: the job's next opening or `tiercheck gc` removes it"
        if item.removable
        else "kept"
    )
    return (
        f"{what} {item.name}: {fmt_size(item.size)}, {when} {fmt_age(item.age)} ago; "
        f"{item.why}; {fate}"
    )


def fmt_time(when: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(when))


def abandoned_summary(aside: AbandonedSetEntry) -> str:
    """What an abandoned set holds, for people: ``versions [4, 5] (2 blobs, 14.6 KiB)``."""
    return (
        f"versions [{short(aside.listed)}] "
        f"({plural(len(aside.blobs()), 'blob')}, {fmt_size(aside.size)})"
    )


def abandoned_line(cat: Catalog, aside: AbandonedSetEntry) -> str:
    """One line for people about an abandoned set (``ls``): what it holds, when and why it was
    set aside, and until when it stays."""
    held = f"{plural(len(aside.blobs()), 'blob')}, {fmt_size(aside.size)}"
    versions = f"versions [{short(aside.listed)}]"
    if not aside.has_record:
        _, why = cat.unfinished_fate(aside)
        return (
            f"abandoned: an unfinished set-aside (copies; the originals stayed in place) of "
            f"{versions} (set {aside.tag}; {held}) -- {why}"
        )
    if aside.record is None:
        return (
            f"abandoned: {versions} (set {aside.tag}; {held}) -- its SET record cannot be read "
            f"({aside.record_error}): `tiercheck verify` reports it, `tiercheck gc --abandoned` "
            "removes the set"
        )
    record = aside.record
    own = len(cat.committed_from(aside.first))
    return (
        f"abandoned: {versions} (set {aside.tag}, set aside {fmt_time(record.time)} when "
        f"{record.reason}; {held}) -- kept until the run has as many committed versions of its "
        f"own from version {aside.first} on as its persistent tier keeps ({own} so far), or "
        "`tiercheck gc --abandoned`"
    )


def fmt_ratio(raw: int | None, stored: int | None) -> str:
    if not raw or not stored:
        return "-"
    return f"{raw / stored:.2f}x"


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], right: str = "") -> list[str]:
    """An aligned text table; columns whose header is in ``right`` are right-aligned."""
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for row in cells:
        parts = [
            c.rjust(w) if headers[i] in right.split(",") else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(parts).rstrip())
    return lines


def yes_no(value: bool | None) -> str:
    return "?" if value is None else ("yes" if value else "no")


def ranks_of(entry_ranks: Sequence[int], expected: Sequence[int]) -> str:
    have = len(entry_ranks)
    return f"{have}/{len(expected)}" if expected else str(have)


def short(values: Sequence[int], limit: int = 8) -> str:
    shown = ", ".join(str(v) for v in values[:limit])
    return shown + (f", ... ({len(values)} in all)" if len(values) > limit else "")


def plural(n: int, what: str) -> str:
    return f"{n} {what}{'s' if n != 1 else ''}"


def short_token(token: str) -> str:
    # Enough of the random token to tell incarnations apart by eye; --json has all of it.
    return token[:8]


def print_location_header(console: Console, cat: Catalog) -> None:
    loc = cat.location
    extra = ", " + plural(len(cat.ranks), "rank")
    if cat.manifest_error is not None:
        extra += ", manifest unreadable"
    elif cat.manifest_versions is not None:
        extra += f", manifest of {plural(cat.manifest_versions, 'version')}"
    elif loc.kind == "node":
        extra += ", no manifest"
    # Whose data this is: the job record (persistent) or the node's identity (node root).
    owner = cat.job_record or cat.identity
    if owner is not None:
        extra += f", world size {owner.world_size}, incarnation {short_token(owner.token)}"
    if cat.job_record_error is not None:
        extra += ", job record unreadable"
    if cat.identity_error is not None:
        extra += ", identity unreadable"
    if cat.writer_generations:
        extra += f", writer generation {cat.writer_generations[-1]}"
    if cat.quarantined:
        extra += ", " + plural(len(cat.quarantined), "quarantined blob")
    if cat.probes:
        extra += ", " + plural(len(cat.probes), "leftover probe")
    if cat.abandoned:
        extra += ", " + plural(len(cat.abandoned), "abandoned set")
    if cat.leftovers:
        extra += ", " + plural(len(cat.leftovers), "killed writer's leftover")
    if cat.tombstone_error is not None:
        extra += ", tombstone unreadable"
    console.line(f"{loc.describe()}{extra}")
    tomb = cat.tombstone
    if tomb is not None:
        when = fmt_time(tomb.time)
        tokens = ", ".join(short_token(t) for t in tomb.tokens) or "unknown"
        now = "" if cat.job_record is not None else "; nothing of it is stored here now"
        console.line(
            f"  deleted by `tiercheck rm-job` on {when} (incarnation {tokens}){now}: memory "
            "of it that any node still holds is discarded, never restored, when the job opens"
        )
