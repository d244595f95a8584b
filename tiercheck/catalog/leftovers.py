"""What killed writers left in a location: list it (:func:`find_leftovers`), remove it.

A writer killed while it writes a blob leaves a temporary file (or, on S3, an unfinished
multipart upload) that listings of keys never show. The catalog lists them beside the versions
so that ``ls`` and ``verify`` show them, ``gc`` removes those whose writer is gone, and
``rm-job`` removes them with the job.

* In a **persistent job folder** the tier judges them (:meth:`tiercheck.tiers.PersistentTier
  .leftovers`), against the job's current writer: the newest writer generation.
* In a **node root** (always this host's memory) every temporary file below it is judged by
  its writer's process (:func:`tiercheck.tiers.atomic.process_verdict`): removable once that
  process is gone, never while it runs.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from tiercheck.catalog.base import Location
from tiercheck.consistency.identity import WriterRecord
from tiercheck.tiers import atomic
from tiercheck.tiers.base import Leftover, SupportsLeftovers, Tier, WriterClaim

__all__ = ["find_leftovers", "node_leftovers", "remove_leftovers", "writer_claim"]


def writer_claim(record: WriterRecord | None) -> WriterClaim | None:
    """The current writer a writer generation's record names."""
    return None if record is None else WriterClaim(record.session, record.time)


def _judge(root: str, temp: atomic.TempFile) -> Leftover:
    verdict, why = atomic.process_verdict(temp.owner)
    age = max(0.0, time.time() - temp.mtime)
    name = os.path.relpath(temp.path, root)
    return Leftover("temporary", name, temp.size, age, verdict, why, temp.path)


def node_leftovers(root: Path) -> list[Leftover]:
    """Every temporary file below node root ``root``, judged by its writer's process
    (blocking: run it in a thread)."""
    return [_judge(str(root), t) for t in atomic.find_temps(str(root))]


def _remove_node_leftover(root: Path, item: Leftover) -> Leftover | None:
    path = item.handle
    owner = atomic.parse_temp_owner(os.path.basename(path))
    inside = os.path.normpath(path).startswith(os.path.normpath(root) + os.sep)
    if owner is None or not inside:
        return None  # not a temporary file of this node root: never removed
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    judged = _judge(str(root), atomic.TempFile(path, owner, st.st_size, st.st_mtime))
    if not judged.removable:
        return None
    atomic.discard(path)
    return judged


async def find_leftovers(
    location: Location, tier: Tier, writer: WriterRecord | None
) -> list[Leftover]:
    """What killed writers left in ``location`` (whose tier is ``tier``), each judged."""
    if location.kind == "node":
        return await asyncio.to_thread(node_leftovers, Path(location.url))
    if isinstance(tier, SupportsLeftovers):
        return await tier.leftovers(writer_claim(writer))
    return []


async def remove_leftovers(
    location: Location, tier: Tier, items: list[Leftover], writer: WriterRecord | None
) -> list[Leftover]:
    """Remove those of ``items`` that are still removable when judged again; return them."""
    if not items:
        return []
    if location.kind == "node":
        root = Path(location.url)
        done = [await asyncio.to_thread(_remove_node_leftover, root, i) for i in items]
        return [d for d in done if d is not None]
    if isinstance(tier, SupportsLeftovers):
        return await tier.remove_leftovers(items, writer_claim(writer))
    return []
