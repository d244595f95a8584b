"""Reading one version back: this rank's blob from one tier, verified, its base with it.

Every blob is checked as it is read (:func:`tiercheck.blobread.read_blob`, the rule the CLI
reads by too: its header, then every checksum while decoding); a blob
that fails is set aside under ``quarantine/`` in its tier, where no cleanup deletes it, and the
next tier is tried (:meth:`Reader.fetch`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from tiercheck.blobread import read_blob
from tiercheck.codec import RawState
from tiercheck.consistency.commit import CommitRecord
from tiercheck.consistency.identity import quarantine_key
from tiercheck.consistency.keys import commit_key, parse_blob_key, version_prefix
from tiercheck.consistency.recovery import Inventory
from tiercheck.engine.jobs import OwnBlob
from tiercheck.engine.tier import writes_commit_records
from tiercheck.errors import (
    BlobNotFound,
    RestoreError,
    UnsupportedFormat,
)
from tiercheck.tiers.base import Buffer, Tier

if TYPE_CHECKING:
    from tiercheck.engine.context import Context
    from tiercheck.engine.tier import TierPipeline

__all__ = ["Reader"]

logger = logging.getLogger("tiercheck")


class Reader:
    """Reads this rank's blobs of a version, fastest tier first."""

    def __init__(self, ctx: Context, pipes: dict[str, TierPipeline]) -> None:
        self.ctx = ctx
        self.pipes = pipes

    async def fetch(
        self, version: int, mine: Inventory
    ) -> tuple[RawState | None, str | None, list[str]]:
        """Read ``version`` from the fastest tier that serves it; else why each tier could not."""
        reasons: list[str] = []
        for name in mine.sources(version):
            try:
                return await self.read(self.pipes[name].tier, version), name, reasons
            except Exception as exc:
                self.ctx.stats.restore_fallbacks += 1
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

    async def read(self, tier: Tier, version: int) -> RawState:
        """This rank's blob of ``version`` in ``tier``, verified (see :mod:`tiercheck.blobread`);
        a blob that fails verification is quarantined."""

        async def find_base(base: int, rank: int) -> str:
            return await self._own_key(tier, base)

        async def damaged(key: str, blob: Buffer, exc: Exception) -> None:
            await self.quarantine(tier, key, blob, exc)

        return await read_blob(
            tier.get,
            await self._own_key(tier, version),
            find_base=find_base,
            expect=(version, self.ctx.rank),
            executor=self.ctx.cpu,
            on_damaged=damaged,
        )

    async def _own_key(self, tier: Tier, version: int) -> str:
        if writes_commit_records(tier):
            record = CommitRecord.from_bytes(bytes(await tier.get(commit_key(version))))
            if record.world_size != self.ctx.topo.world_size:
                raise RestoreError(
                    f"version {version} was saved by {record.world_size} ranks; this job has "
                    f"{self.ctx.topo.world_size}, and the job's world-size history says this "
                    "run's number saved it: the COMMIT record and the job record disagree"
                )
            entry = record.entry(self.ctx.rank)
            own = self.pipes[tier.name].own
            if version in own:  # the record knows the base: no need to guess
                own[version] = OwnBlob(entry.key, entry.base)
            return entry.key
        keys = [k async for k in tier.list(version_prefix(version))]
        mine = sorted(
            (p.kind, k)
            for k in keys
            if (p := parse_blob_key(k)) is not None and p.rank == self.ctx.rank
        )
        if not mine:
            raise BlobNotFound(
                f"rank {self.ctx.rank} has no blob of version {version} in {tier.name!r}"
            )
        return mine[0][1]  # "full" sorts before "packed": the cheaper read

    async def quarantine(self, tier: Tier, key: str, blob: Buffer, exc: Exception) -> None:
        """Set a blob that failed verification aside, so no cleanup can ever delete it."""
        if isinstance(exc, UnsupportedFormat):
            return  # written by a newer build: not damaged, and kept as it is
        if self.ctx.claim.superseded and writes_commit_records(tier):
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
        self.ctx.stats.quarantined += 1
        logger.warning(
            "tiercheck: %s in %r failed verification (%s); set aside as %s for inspection "
            "(`tiercheck verify` lists it)",
            key,
            tier.name,
            exc,
            where,
        )
