"""The node's manifest as the engine uses it: appended to in its own thread, never trusted.

The manifest is history (what was begun, made durable, committed, evicted); restore trusts the
tiers. So a manifest that cannot be opened or written is logged and counted, never fatal.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tiercheck.consistency.manifest import Manifest, Record, Written
from tiercheck.engine.results import CheckpointerStats
from tiercheck.errors import TiercheckError

__all__ = ["COMPACT_GROWTH", "COMPACT_MIN_RECORDS", "Journal"]

logger = logging.getLogger("tiercheck")

#: The log is compacted once it holds more than this many records (a few per save)...
COMPACT_MIN_RECORDS = 1000
#: ... and more than this many times what the last compaction left.
COMPACT_GROWTH = 4


class Journal:
    """Appends records to the manifest on one thread of its own, in order."""

    def __init__(self, stats: CheckpointerStats) -> None:
        self.stats = stats
        self.manifest: Manifest | None = None
        self._exec = ThreadPoolExecutor(1, thread_name_prefix="tiercheck-manifest")
        self._failing = False

    async def open(self, path: Path) -> None:
        """Open the manifest at ``path``; without one, the engine runs on (logged)."""
        try:
            self.manifest = await asyncio.to_thread(Manifest, path)
        except TiercheckError as exc:
            self.stats.manifest_errors += 1
            logger.error("tiercheck: running without a manifest: %s", exc)
            return
        # Damage found and set aside by a new manifest process this opening reached first
        # (logged once, at WARNING, by the manifest handle).
        self.stats.manifest_set_aside += len(self.manifest.notes)

    def log(self, *records: Record) -> None:
        """Append to the manifest in its own thread; failures are logged and counted."""
        if self.manifest is None:
            return
        manifest = self.manifest
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(self._exec, manifest.append, *records)
        fut.add_done_callback(self._done)

    def _done(self, fut: asyncio.Future[Any]) -> None:
        if fut.cancelled():
            return
        if self.manifest is not None:
            self.stats.manifest_restarts = self.manifest.restarts
            self.stats.manifest_set_aside = len(self.manifest.notes)
        exc = fut.exception()
        if exc is None:
            if self._failing:
                self._failing = False
                logger.warning("tiercheck: manifest writes work again")
            return
        self.stats.manifest_errors += 1
        if not self._failing:  # once per spell of failures, not once per record
            self._failing = True
            logger.error(
                "tiercheck: manifest write failed: %r; checkpoints are unaffected (restore trusts "
                "the tiers), history is lost until it works again; further failures are counted "
                "in stats.manifest_errors",
                exc,
            )

    def compact(self, keep_after: int) -> None:
        """After retention: compact the log if it has grown well past what is live (see
        :meth:`Manifest.compact_if_grown`), in the manifest's thread, after the appends queued
        before it. ``keep_after``: the oldest version this rank still has in flight (or the
        next one); failures are logged and counted like failed appends."""
        if self.manifest is None:
            return
        fut = asyncio.get_running_loop().run_in_executor(
            self._exec,
            functools.partial(
                self.manifest.compact_if_grown,
                keep_after,
                min_records=COMPACT_MIN_RECORDS,
                growth=COMPACT_GROWTH,
            ),
        )
        fut.add_done_callback(self._compacted)

    def _compacted(self, fut: asyncio.Future[int]) -> None:
        if not fut.cancelled() and fut.exception() is None and fut.result():
            logger.debug("tiercheck: compacted the manifest: %d records dropped", fut.result())
        self._done(fut)

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the manifest's thread, after the appends queued before it."""
        return await asyncio.get_running_loop().run_in_executor(self._exec, fn, *args)

    async def blobs(self, tier: str, rank: int) -> list[Written]:
        """The blobs of ``rank`` the manifest saw become durable in ``tier`` (none without one)."""
        if self.manifest is None:
            return []
        try:
            found: list[Written] = await self.run(self.manifest.blobs, tier, None, rank)
        except TiercheckError as exc:
            self.stats.manifest_errors += 1
            logger.error("tiercheck: cannot ask the manifest what %r holds: %s", tier, exc)
            return []
        return found

    async def committed(self, tier: str) -> set[int]:
        """The versions the manifest saw committed in ``tier`` (none without one, or where it
        cannot be asked: logged and counted)."""
        if self.manifest is None:
            return set()
        try:
            found: list[int] = await self.run(self.manifest.committed, tier)
        except TiercheckError as exc:
            self.stats.manifest_errors += 1
            logger.error("tiercheck: cannot ask the manifest what %r holds: %s", tier, exc)
            return set()
        return set(found)

    async def drained(self) -> None:
        """Wait until every record logged so far is appended (or failed)."""
        if self.manifest is not None:
            await self.run(lambda: None)

    def close(self) -> None:
        """Finish the appends queued (local work only) and close the manifest."""
        self._exec.shutdown(wait=True)
        if self.manifest is not None:
            self.manifest.close()
