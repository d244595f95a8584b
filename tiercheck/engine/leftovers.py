"""At opening: remove what killed writers of the job left in its tiers (temporary files, uploads).

A writer killed mid-put leaves a temporary file (or, on S3, an unfinished multipart upload) that
no listing shows and nothing ever reads. Once this opening holds the job (after
:meth:`~tiercheck.engine.claim.Claim.guard`, which claimed the newest writer generation), every
other writer of the job is either dead or superseded, and each node's first rank removes those
leftovers of every tier that lists them (:class:`~tiercheck.tiers.SupportsLeftovers`) whose
verdict is ``"dead"`` -- the tier's own rule, which never removes the file of a process that runs
on this host (see :meth:`tiercheck.tiers.PersistentTier.leftovers`). Each node judges the
processes of its own host, which is why every node's first rank sweeps, not rank 0 alone.

A sweep never fails the opening: what cannot be listed or removed is logged and left for the
next opening or ``tiercheck gc``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from tiercheck.errors import TiercheckError
from tiercheck.tiers.base import SupportsLeftovers, Tier, WriterClaim

__all__ = ["sweep_leftovers"]

logger = logging.getLogger("tiercheck")


async def sweep_leftovers(tiers: Sequence[Tier], session: str) -> int:
    """Remove the dead writers' leftovers of ``tiers``; return how many were removed.

    ``session`` is this opening's, which holds the job's newest writer generation.
    """
    writer = WriterClaim(session, time.time())
    removed_total = 0
    for tier in tiers:
        if not isinstance(tier, SupportsLeftovers):
            continue
        try:
            found = await tier.leftovers(writer)
            dead = [item for item in found if item.removable]
            removed = await tier.remove_leftovers(dead, writer) if dead else []
        except (TiercheckError, OSError) as exc:
            logger.warning(
                "tiercheck: could not clear what killed writers left in the %r tier (%s); "
                "`tiercheck gc` removes it later",
                tier.name,
                exc,
            )
            continue
        removed_total += len(removed)
        if removed:
            size = sum(item.size or 0 for item in removed)
            logger.warning(
                "tiercheck: removed %d leftover(s) of killed writers from the %r tier (%d "
                "bytes): %s",
                len(removed),
                tier.name,
                size,
                "; ".join(f"{item.name}: {item.why}" for item in removed[:3])
                + ("; ..." if len(removed) > 3 else ""),
            )
        gone = {item.name for item in removed}
        kept = [item for item in found if item.name not in gone]
        if kept:
            logger.info(
                "tiercheck: kept %d leftover(s) in the %r tier whose writer may still be "
                "writing: %s",
                len(kept),
                tier.name,
                "; ".join(f"{item.name}: {item.why}" for item in kept[:3]),
            )
    return removed_total
