"""What one tier keeps: what it counts as committed, retention after each commit round, and
versions removed from it.

A part of :class:`~tiercheck.engine.tier.TierPipeline` (which sets these attributes up and
keeps them current); a restore's outcome and a vanished base change what it counts as committed
(:meth:`Retention.adopt`, :meth:`Retention.forget_bases`); retention trims the tier to its
policy's ``keep``, never deleting a base a kept delta needs, a version in flight, or from a tier
this rank cannot see whole.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection

from tiercheck.consistency.abandoned import ABANDONED_PREFIX, SetInfo, kept_and_removable
from tiercheck.consistency.keys import commit_key, parse_commit_key
from tiercheck.consistency.manifest import Commit, Evict
from tiercheck.consistency.retention import UNKNOWN_BASE, evictable
from tiercheck.engine.claim import Claim
from tiercheck.engine.jobs import OwnBlob
from tiercheck.engine.journal import Journal
from tiercheck.engine.options import TierPolicy
from tiercheck.engine.results import CheckpointerStats
from tiercheck.engine.stored import commit_versions
from tiercheck.tiers.base import Tier

__all__ = ["Retention"]

logger = logging.getLogger("tiercheck")


class Retention:
    """What is committed, retention and removal of versions, for
    :class:`~tiercheck.engine.tier.TierPipeline`."""

    rank: int
    stats: CheckpointerStats
    journal: Journal
    claim: Claim
    tier: Tier
    name: str
    policy: TierPolicy
    durable: bool
    blocked: str | None
    unlisted: bool
    abandoned: dict[str, SetInfo]
    own: dict[int, OwnBlob]
    others: dict[int, list[str]]
    committed: set[int]
    settled: int
    #: Versions the flush on SIGTERM is writing to the tier (no retention pass meanwhile).
    flushing: set[int]
    #: Set while no retention pass runs.
    retention_idle: asyncio.Event

    def adopt(self, *, committed: Collection[int] | None, adopted: Collection[int]) -> None:
        """What a restore settled for the tier: ``committed`` (where not ``None``) replaces
        what it counts as committed (a durable tier's ``COMMIT`` records); ``adopted``, in
        order, are whole for every rank and committed too (a memory tier's versions the
        manifest missed: it is told)."""
        if committed is not None:
            self.committed = set(committed)
        if adopted:
            self.committed.update(adopted)
            self.journal.log(*(Commit(v, self.name) for v in adopted))

    def forget_bases(self, bases: Collection[int]) -> None:
        """``bases`` vanished from the tier: no longer committed there."""
        for base in bases:
            self.committed.discard(base)

    async def retain(self) -> None:
        """Trim the tier to its policy's ``keep`` (never a base a kept delta needs, never a
        version in flight)."""
        if self.unlisted or self.blocked or (self.claim.superseded and self.durable):
            # Never delete from a tier this run cannot see whole or no longer owns, nor from
            # one that still holds another timeline's versions (they would count as its own).
            return
        if self.flushing:
            # The flush on SIGTERM writes and commits a version here outside the rounds: a pass
            # now could count it uncommitted and delete it. The next round's pass trims.
            return
        self.retention_idle.clear()
        try:
            await self._retain()
        finally:
            self.retention_idle.set()

    async def _retain(self) -> None:
        if self.durable:
            # Count what is there: versions whose COMMIT record vanished (a deleted folder, a
            # lifecycle rule) must not count towards `keep`.
            self.committed &= await commit_versions(self.tier)
        # Abandoned sets: those retention lets go, and the live bases the others still need
        # (every rank decides alike; rank 0 removes the sets' keys).
        protected, removable = kept_and_removable(self.abandoned, self.committed, self.policy.keep)
        doomed = evictable(
            committed=self.committed,
            # Another world's packed blob may be a delta on any older version: UNKNOWN_BASE
            # keeps those while it stays.
            own={
                **{
                    v: None if all(k.endswith(".full") for k in keys) else UNKNOWN_BASE
                    for v, keys in self.others.items()
                },
                **{v: b.base for v, b in self.own.items()},
            },
            keep=self.policy.keep,
            # Rounds run in version order, so everything newer than `settled` is in flight
            # in this tier and stays; in flight elsewhere does not matter here.
            settled_upto=self.settled,
            protected=protected,
        )
        # Newest first: a delta goes before its base, so no COMMIT record is ever left naming
        # a base that is gone, whenever the process dies.
        for version in reversed(doomed):
            await self.evict(version, "retention")
        for tag in removable:
            await self.remove_abandoned(tag)

    async def remove_abandoned(self, tag: str) -> None:
        """Delete the abandoned set ``tag``: its ``SET`` record first (it is then an
        incomplete set, which nothing restores), then everything else in it."""
        self.abandoned.pop(tag, None)
        if self.rank != 0:
            return
        prefix = f"{ABANDONED_PREFIX}{tag}/"
        keys = [key async for key in self.tier.list(prefix)]
        for key in sorted(keys, key=lambda k: not k.endswith("/SET")):
            await self.claim.check(self.tier)
            await self.tier.delete(key)
        logger.info(
            "tiercheck: removed the abandoned set %s from the %r tier: the run holds %s "
            "committed versions of its own after it",
            tag,
            self.name,
            self.policy.keep,
        )

    async def evict(self, version: int, reason: str) -> None:
        """Delete ``version`` from the tier: this rank's blob, and rank 0 its COMMIT record."""
        if self.claim.superseded and self.durable:
            return
        if self.rank == 0 and self.durable:
            await self.tier.delete(commit_key(version))
        blob = self.own.pop(version, None)
        if blob is not None:
            await self.tier.delete(blob.key)
        for key in self.others.pop(version, []):
            await self.tier.delete(key)
        self.committed.discard(version)
        self.stats.evicted[self.name] = self.stats.evicted.get(self.name, 0) + 1
        self.journal.log(Evict(version, self.rank, self.name, reason))

    async def truncate_from(self, first: int, reason: str) -> None:
        """Remove this rank's blobs (and rank 0's COMMIT records) of versions >= ``first``."""
        doomed = {v for v in (*self.own, *self.others) if v >= first}
        if self.rank == 0 and self.durable:
            async for key in self.tier.list("v"):
                v = parse_commit_key(key)
                if v is not None and v >= first:
                    doomed.add(v)
        for version in sorted(doomed, reverse=True):
            try:
                await self.evict(version, reason)
            except Exception:
                logger.exception(
                    "tiercheck: removing version %s from %r failed", version, self.name
                )
