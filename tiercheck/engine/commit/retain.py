"""What one tier keeps: what it counts as committed, retention after each commit round, and
versions removed from it.

A part of :class:`~tiercheck.engine.commit.tier.TierPipeline` (which sets these attributes up and
keeps them current); a restore's outcome and a vanished base change what it counts as committed
(:meth:`Retention.adopt`, :meth:`Retention.forget_bases`); retention trims the tier to its
policy's ``keep``, never deleting a base a kept delta needs, a version in flight, or from a tier
this rank cannot see whole.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Iterable, Mapping

from tiercheck.consistency.abandoned import ABANDONED_PREFIX, SetInfo, kept_and_removable
from tiercheck.consistency.keys import commit_key, parse_blob_key, parse_commit_key
from tiercheck.consistency.manifest import Commit, Evict
from tiercheck.consistency.resync import unsure_kept
from tiercheck.consistency.retention import UNKNOWN_BASE, evictable
from tiercheck.defaults import encoding_kind
from tiercheck.engine.health import CommitLag
from tiercheck.engine.jobs import OwnBlob
from tiercheck.engine.journal import Journal
from tiercheck.engine.open.claim import Claim
from tiercheck.engine.options import TierPolicy
from tiercheck.engine.results import CheckpointerStats
from tiercheck.engine.stored import commit_versions
from tiercheck.tiers.base import Tier
from tiercheck.topology import Topology

__all__ = ["Retention", "sort_blob_keys"]

logger = logging.getLogger("tiercheck")


class Retention:
    """What is committed, retention and removal of versions, for
    :class:`~tiercheck.engine.commit.tier.TierPipeline`."""

    rank: int
    topo: Topology
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
    unsure: set[int]
    lag: CommitLag
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
        self.lag.opened(self.committed)

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
            records = await commit_versions(self.tier)
            self._adopt_unsure(records)
            self.committed &= records
        # Abandoned sets: those retention lets go, and the live bases the others still need
        # (every rank decides alike; rank 0 removes the sets' keys).
        protected, removable = kept_and_removable(self.abandoned, self.committed, self.policy.keep)
        # A round this rank lost on a peer error may be committed for the others: its blob
        # stays until no rank would keep it anyway.
        self.unsure = unsure_kept(self.unsure, self.committed, self.policy.keep)
        shielded = protected | self.unsure
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
            protected=shielded,
        )
        # Newest first: a delta goes before its base, so no COMMIT record is ever left naming
        # a base that is gone, whenever the process dies.
        for version in reversed(doomed):
            await self.evict(version, "retention")
        for tag in removable:
            await self.remove_abandoned(tag)

    def _adopt_unsure(self, records: Collection[int]) -> None:
        """Versions whose round this rank lost on a peer error but whose ``COMMIT`` record is
        in the tier: rank 0 wrote it after every rank said yes, so they are committed."""
        for version in sorted(self.unsure & set(records)):
            self.unsure.discard(version)
            if version in self.committed:
                continue
            self.committed.add(version)
            self.journal.log(Commit(version, self.name))
            self.stats.committed[self.name] = self.stats.committed.get(self.name, 0) + 1
            if version > self.stats.last_committed.get(self.name, -1):
                self.stats.last_committed[self.name] = version
            self.lag.committed(version)
            logger.warning(
                "tiercheck: version %s is committed in the %r tier after all: its COMMIT record "
                "is there, though this rank lost the round's last exchange (its handle said "
                "it failed)",
                version,
                self.name,
            )

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

    # --- what the tier holds, as this rank lists it -------------------------------------------

    async def list_own(self) -> dict[int, OwnBlob]:
        """This rank's blobs in the tier, by version, with the base each is a delta on.

        Also refreshes :attr:`others` from the same listing.
        """
        written = await self.journal.blobs(self.name, self.rank)
        keys = [key async for key in self.tier.list("v")]
        out, self.others = sort_blob_keys(
            keys,
            rank=self.rank,
            world=self.topo.world_size,
            world_of=self.claim.world_of,
            bases={d.version: d.base for d in written},
        )
        return out

    def keys_from(self, first: int) -> dict[int, list[str]]:
        """This rank's blob keys of versions ``>= first``, by version (those of another world's
        versions this rank looks after included, see :attr:`others`)."""
        out: dict[int, list[str]] = {}
        for version, blob in self.own.items():
            if version >= first:
                out.setdefault(version, []).append(blob.key)
        for version, keys in self.others.items():
            if version >= first:
                out.setdefault(version, []).extend(keys)
        return out

    async def restorable(self) -> list[int]:
        """Committed versions that are still there and whose base is too, as this rank sees."""
        if self.name in self.claim.pending:
            return []  # unreachable since the job opened: nothing of it is known
        try:
            if self.durable:
                present = await commit_versions(self.tier)
            else:
                present = set(await self.list_own())
        except Exception as exc:
            logger.warning("tiercheck: cannot list the %r tier: %r", self.name, exc)
            return sorted(self.committed)
        there = self.committed & present
        # A delta whose base is gone cannot be restored from this tier.
        bases = {v: b.base for v, b in self.own.items()}
        return sorted(v for v in there if bases.get(v) in (None, UNKNOWN_BASE) or bases[v] in there)


def sort_blob_keys(
    keys: Iterable[str],
    *,
    rank: int,
    world: int,
    world_of: Callable[[int], int],
    bases: Mapping[int, int | None],
) -> tuple[dict[int, OwnBlob], dict[int, list[str]]]:
    """A tier's blob ``keys`` as rank ``rank`` of ``world`` sees them: its own blobs by version
    (with the base each is a delta on: from ``bases``, what the manifest knows, else
    :data:`~tiercheck.consistency.retention.UNKNOWN_BASE`), and the keys of versions another
    number of ranks saved that this rank removes when retention drops them (old ranks ``s``
    with ``s % world == rank``). ``world_of``: how many ranks saved a version."""
    own: dict[int, OwnBlob] = {}
    others: dict[int, list[str]] = {}
    for key in keys:
        parsed = parse_blob_key(key)
        if parsed is None:
            continue
        # A version another number of ranks saved is not this rank's state, whatever its
        # rank number: only an elastic restore reads it (tiercheck.engine.restore.elastic).
        if world_of(parsed.version) != world:
            if parsed.rank % world == rank:
                others.setdefault(parsed.version, []).append(key)
            continue
        if parsed.rank == rank:
            if encoding_kind(parsed.kind).as_is:
                base = None
            elif parsed.version in bases:
                base = bases[parsed.version]
            else:
                # Not in this node's manifest (a new node): any older blob may be its base.
                base = UNKNOWN_BASE
            own[parsed.version] = OwnBlob(key, base)
    return own, others
