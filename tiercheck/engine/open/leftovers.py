"""What an opening cleans up: killed writers' leftovers, and its own remains when it fails.

:func:`sweep_leftovers` -- at opening, remove what killed writers of the job left in its tiers
(temporary files, uploads).

A writer killed mid-put leaves a temporary file (or, on S3, an unfinished multipart upload) that
no listing shows and nothing ever reads. Once this opening holds the job (after
:meth:`~tiercheck.engine.open.claim.Claim.guard`, which claimed the newest writer generation), every
other writer of the job is either dead or superseded, and each node's first rank removes those
leftovers of every tier that lists them (:class:`~tiercheck.tiers.SupportsLeftovers`) whose
verdict is ``"dead"`` -- the tier's own rule, which never removes the file of a process that runs
on this host (see :meth:`tiercheck.tiers.PersistentTier.leftovers`). Each node judges the
processes of its own host, which is why every node's first rank sweeps, not rank 0 alone.

A sweep never fails the opening: what cannot be listed or removed is logged and left for the
next opening or ``tiercheck gc``.

:func:`clean_failed_opening` -- an opening that fails (a refused claim, a durable location that
cannot be used, a peer that does not answer) removes what it made and what holds nothing: its
lock file, and where no other writer is open and the node's memory holds no checkpoint, the
rest of the node root's skeleton (:func:`tiercheck.guards.node.abandon_node_root`); and the empty
job folder its probe made in a local durable location. Memory that holds checkpoints, and the job's
durable records, stay as they were.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

from tiercheck.errors import TiercheckError
from tiercheck.guards import RankLock, abandon_node_root
from tiercheck.tiers import atomic
from tiercheck.tiers.base import SupportsLeftovers, Tier, WriterClaim

__all__ = ["clean_failed_opening", "sweep_leftovers", "sweep_node_root"]

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


def sweep_node_root(node_root: Path) -> int:
    """Remove the temporary files of dead processes at the top of a node root (an identity
    record being written when its writer was killed); return how many. ``blobs/`` and
    ``replicas/`` are their tiers' own business: the local tier removes its dead writers' files
    when it first lists itself (:func:`tiercheck.tiers.local.files.scan_sizes`). Blocking;
    never raises (a failure is logged)."""
    removed = 0
    try:
        for entry in list(os.scandir(node_root)):
            owner = atomic.parse_temp_owner(entry.name)
            if owner is None or not entry.is_file(follow_symlinks=False):
                continue
            if atomic.process_verdict(owner)[0] == "dead":
                atomic.discard(entry.path)
                removed += 1
    except FileNotFoundError:
        pass  # no node root yet
    except OSError as exc:
        logger.warning("tiercheck: could not clear dead writers' files in %s: %r", node_root, exc)
    return removed


async def clean_failed_opening(
    node_root: Path, lock: RankLock, job_id: str, since: float, durable: Sequence[Tier]
) -> None:
    """After a failed opening (begun at ``since``): remove what it left that holds nothing (see
    the module docstring). Never raises: a failure is logged, and the lock is released."""
    try:
        removed = await asyncio.to_thread(abandon_node_root, node_root, lock, job_id, since)
    except (OSError, TiercheckError) as exc:
        lock.release()
        logger.warning(
            "tiercheck: the failed opening could not clean up after itself in %s: %r",
            node_root,
            exc,
        )
        removed = []
    for tier in durable:
        inner: object = tier
        while getattr(inner, "inner", None) is not None:  # wrappers (fault injection, ...)
            inner = inner.inner  # type: ignore[attr-defined]
        folder = getattr(inner, "local_folder", None)
        if isinstance(folder, str) and await asyncio.to_thread(_rmdir_if_empty, folder):
            removed.append(folder)
    if removed:
        logger.info("tiercheck: the failed opening removed what it had made: %s", removed)


def _rmdir_if_empty(folder: str) -> bool:
    try:
        os.rmdir(folder)
    except OSError:
        return False  # not empty (the job's data, or a writer arriving), or already gone
    return True
