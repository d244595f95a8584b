"""Reading one version back: this rank's blob from one tier, verified, its base with it.

Every blob is checked as it is read (:func:`tiercheck.codec.decode.blobread.read_blob`, the rule the
CLI reads by too: its header, then every checksum while decoding); a blob that fails is set aside
under ``quarantine/`` in its tier, where no cleanup deletes it, and the next tier is tried
(:meth:`Reader.fetch`).

A blob that holds references to replicated state its node's first rank stored
(:class:`~tiercheck.codec.encode.flatten.ReplicaRef`) is completed from that rank's blob of the same
version in the same tier -- and, in a durable tier, from rank 0's, which that rank's refers to --
verified the same way (:func:`tiercheck.codec.decode.blobread.complete`); when such a blob is
missing or damaged there, the tier fails for this rank and the next is tried.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from concurrent.futures import Executor
from typing import TYPE_CHECKING

from tiercheck.codec import RawState
from tiercheck.codec.decode.assembled import Resharded
from tiercheck.codec.decode.blobread import complete, read_blob
from tiercheck.consistency.commit import CommitRecord
from tiercheck.consistency.identity import quarantine_key
from tiercheck.consistency.keys import commit_key, parse_blob_key, version_prefix
from tiercheck.consistency.recovery import Inventory
from tiercheck.engine.commit.tier import writes_commit_records
from tiercheck.engine.jobs import OwnBlob
from tiercheck.engine.open.claim import Claim
from tiercheck.engine.options import Options
from tiercheck.engine.part import RankPart
from tiercheck.engine.restore.inplace import Direct, open_direct, reads_files
from tiercheck.engine.results import CheckpointerStats
from tiercheck.errors import (
    BlobNotFound,
    RestoreError,
    TiercheckError,
    UnsupportedFormat,
)
from tiercheck.tiers.base import Buffer, Tier

if TYPE_CHECKING:
    from tiercheck.engine.commit.tier import TierPipeline

__all__ = ["Reader"]

logger = logging.getLogger("tiercheck")


class Reader(RankPart):
    """Reads this rank's blobs of a version, fastest tier first."""

    def __init__(
        self,
        options: Options,
        stats: CheckpointerStats,
        claim: Claim,
        cpu: Executor,
        pipes: Mapping[str, TierPipeline],
    ) -> None:
        super().__init__(options, claim, pipes)
        self.stats = stats
        #: Worker threads for checking digests.
        self.cpu = cpu

    async def fetch(
        self, version: int, mine: Inventory, *, direct: bool = False
    ) -> tuple[RawState | Resharded | Direct | None, str | None, list[str]]:
        """Read ``version`` from the fastest tier that serves it; else why each tier could not.

        ``direct``: the caller restores into a state of its own, strictly; where the fastest
        tier can serve that straight from its file (:mod:`tiercheck.engine.restore.inplace`), only
        the blob's header is read, and a :class:`~tiercheck.engine.restore.inplace.Direct` comes
        back.
        """
        reasons: list[str] = []
        sources = mine.sources(version)
        if direct and sources and reads_files(self.pipes[sources[0]].tier):
            name = sources[0]
            try:
                tier = self.pipes[name].tier
                key = await self._own_key(tier, version, self.rank)
                found = await open_direct(tier, name, key, (version, self.rank))
            except (TiercheckError, OSError) as exc:
                # Read the ordinary way, which sets a damaged blob aside and says why.
                logger.debug("tiercheck: no direct read of version %s: %r", version, exc)
            except Exception:
                logger.exception(
                    "tiercheck: reading the header of version %s failed unexpectedly; "
                    "reading it the ordinary way",
                    version,
                )
            else:
                if found is not None:
                    return found, name, reasons
        for name in sources:
            try:
                return await self.read_whole(self.pipes[name].tier, version), name, reasons
            except Exception as exc:
                self.stats.restore_fallbacks += 1
                reasons.append(f"{name}: {type(exc).__name__}: {exc}")
                logger.warning(
                    "tiercheck: version %s from the %r tier is unusable (%r); trying the next tier",
                    version,
                    name,
                    exc,
                )
        if not reasons:
            reasons.append("no tier holds this rank's blob of it")
        return None, None, reasons

    async def read_whole(self, tier: Tier, version: int) -> RawState | Resharded:
        """This rank's blob of ``version`` from ``tier``, its references (if any) resolved
        against the blobs of the ranks that store the replicated state."""
        raw = await self.read(tier, version)

        async def read(rank: int) -> RawState:
            return await self.read(tier, version, rank=rank)

        return await complete(raw, self.rank, self.topo.world_size, read)

    async def read(self, tier: Tier, version: int, *, rank: int | None = None) -> RawState:
        """Rank ``rank``'s blob (this rank's by default) of ``version`` in ``tier``, verified
        with its base (see :mod:`tiercheck.codec.decode.blobread`); a blob that fails is
        quarantined."""
        owner = self.rank if rank is None else rank

        async def get(key: str) -> Buffer:
            return await self._get(tier, key, owner)

        async def find_base(base: int, _rank: int) -> str:
            return await self._own_key(tier, base, owner)

        async def damaged(key: str, blob: Buffer, exc: Exception) -> None:
            await self.quarantine(tier, key, blob, exc)

        async def other_base(base: int, rank: int, why: Exception) -> RawState:
            return await self._base_elsewhere(tier, base, rank, why)

        return await read_blob(
            get,
            await self._own_key(tier, version, owner),
            find_base=find_base,
            expect=(version, owner),
            executor=self.cpu,
            on_damaged=damaged,
            other_base=other_base,
        )

    async def _base_elsewhere(self, tier: Tier, base: int, rank: int, why: Exception) -> RawState:
        """Rank ``rank``'s ``base`` from the other tiers, fastest first, when the copy in
        ``tier`` beside a delta cannot be read (``why``): a delta whose base is damaged in one
        tier is restorable wherever an intact copy of that base is. Raises ``why`` when no
        other tier has one."""
        for name, pipe in self.pipes.items():
            if pipe.tier is tier:
                continue
            try:
                found = await self.read(pipe.tier, base, rank=rank)
            except Exception as exc:
                logger.debug("tiercheck: base %s of rank %s not in %r: %r", base, rank, name, exc)
                continue
            logger.warning(
                "tiercheck: the base %s of rank %s in %r cannot be read (%s); using the copy in %r",
                base,
                rank,
                tier.name,
                why,
                name,
            )
            return found
        raise why

    async def _get(self, tier: Tier, key: str, rank: int) -> Buffer:
        if rank == self.rank:
            return await tier.get(key)
        # Another rank's blob: the peer tier keeps each rank's replicas apart.
        get_for = getattr(tier, "get_for", None)
        if callable(get_for):
            blob: Buffer = await get_for(rank, key)
            return blob
        return await tier.get(key)

    async def _own_key(self, tier: Tier, version: int, rank: int) -> str:
        if writes_commit_records(tier):
            record = CommitRecord.from_bytes(bytes(await tier.get(commit_key(version))))
            if record.world_size != self.topo.world_size:
                raise RestoreError(
                    f"version {version} was saved by {record.world_size} ranks; this job has "
                    f"{self.topo.world_size}, and the job's world-size history says this "
                    "run's number saved it: the COMMIT record and the job record disagree"
                )
            entry = record.entry(rank)
            own = self.pipes[tier.name].own
            if rank == self.rank and version in own:  # the record knows the base
                own[version] = OwnBlob(entry.key, entry.base)
            return entry.key
        list_for = getattr(tier, "list_for", None)
        listing = (
            list_for(rank, version_prefix(version))
            if rank != self.rank and callable(list_for)
            else tier.list(version_prefix(version))
        )
        keys = [k async for k in listing]
        mine = sorted(
            p.read_order for k in keys if (p := parse_blob_key(k)) is not None and p.rank == rank
        )
        if not mine:
            raise BlobNotFound(f"rank {rank} has no blob of version {version} in {tier.name!r}")
        return mine[0][1]  # the cheaper read

    async def quarantine(self, tier: Tier, key: str, blob: Buffer, exc: Exception) -> None:
        """Set a blob that failed verification aside, so no cleanup can ever delete it."""
        if isinstance(exc, UnsupportedFormat):
            return  # written by a newer build: not damaged, and kept as it is
        if self.claim.superseded and writes_commit_records(tier):
            return
        where = quarantine_key(key)
        try:
            await tier.put(where, blob)
        except Exception as put_exc:
            logger.error(
                "tiercheck: %s in %r failed verification (%s) and could not be set aside as %s "
                "(%r); it stays under its own key",
                key,
                tier.name,
                exc,
                where,
                put_exc,
            )
            return
        self.stats.quarantined += 1
        logger.warning(
            "tiercheck: %s in %r failed verification (%s); set aside as %s for inspection "
            "(`tiercheck verify` lists it)",
            key,
            tier.name,
            exc,
            where,
        )
