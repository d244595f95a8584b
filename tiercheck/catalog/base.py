"""What every part of the catalog shares: locations, their error, progress, request bounds."""

from __future__ import annotations

import asyncio
import os
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar

from tiercheck.errors import ConfigError

__all__ = [
    "LOCAL_TIER",
    "READS",
    "REQUESTS",
    "Location",
    "LocationError",
    "NullProgress",
    "Progress",
    "bounded",
    "local_path",
]

_T = TypeVar("_T")

#: The local tier's name in a node's manifest (what the checkpointer logs it under).
LOCAL_TIER = "local"

#: How many small requests (sizes, COMMIT records, deletes) run at once against a tier; blob
#: reads are bounded more tightly (:data:`READS`) because each holds a whole blob in memory.
REQUESTS = 16
READS = 2


class LocationError(ConfigError):
    """What was given does not name tiercheck data: a wrong URL, protocol, path or job.

    The message says what was expected and, where it can, what was found instead (for example
    the jobs stored at a URL when ``--job`` named none of them).
    """


@dataclass(frozen=True, slots=True)
class Location:
    """One tier's view of one job: a persistent job folder or a node root.

    ``url`` is the job folder's URL (persistent) or the node root's path (node); ``job`` the
    job's name as the folder names it (for a node root, by the ``<job>/<node>`` convention, the
    parent folder's name); ``node`` the node root's folder name.
    """

    kind: Literal["persistent", "node"]
    url: str
    job: str
    node: str | None = None
    storage_options: Mapping[str, Any] = field(default_factory=dict, compare=False)

    @property
    def tier_name(self) -> str:
        """The tier the location's blobs live in: ``"persistent"`` or ``"local"``."""
        return "persistent" if self.kind == "persistent" else LOCAL_TIER

    def describe(self) -> str:
        """One line naming the location, for messages."""
        if self.kind == "persistent":
            return f"persistent job {self.job!r} at {self.url}"
        return f"node root {self.url} (job {self.job!r}, node {self.node!r})"

    def to_json(self) -> dict[str, Any]:
        """Plain data for ``--json`` output."""
        return {"tier": self.tier_name, "url": self.url, "job": self.job, "node": self.node}


class Progress(Protocol):
    """Where long operations report how far they are (a progress bar, or nothing)."""

    def start(self, total: int, what: str) -> None:
        """A new phase of ``total`` steps begins."""

    def advance(self, n: int = 1) -> None:
        """``n`` more steps of the current phase are done."""

    def finish(self) -> None:
        """The current phase is over."""


class NullProgress:
    """A :class:`Progress` that shows nothing."""

    def start(self, total: int, what: str) -> None:
        """Ignore the start of a phase."""

    def advance(self, n: int = 1) -> None:
        """Ignore progress."""

    def finish(self) -> None:
        """Ignore the end of a phase."""


async def bounded(
    items: Sequence[_T], fn: Callable[[_T], Any], limit: int, progress: Progress
) -> None:
    """Run ``await fn(item)`` for every item, ``limit`` at a time, advancing ``progress``."""
    sem = asyncio.Semaphore(limit)

    async def one(item: _T) -> None:
        async with sem:
            await fn(item)
        progress.advance()

    await asyncio.gather(*(one(i) for i in items))


def local_path(target: str) -> str | None:
    """The filesystem path ``target`` (a URL or a path) names, or ``None`` for a remote URL."""
    parsed = urllib.parse.urlsplit(target)
    if parsed.scheme in ("file", "local"):
        # file:///data/x -> /data/x; file://localhost/data/x too.
        return urllib.parse.unquote(parsed.path) or "/"
    if "://" in target or "::" in target:
        return None
    return os.path.expanduser(target)
