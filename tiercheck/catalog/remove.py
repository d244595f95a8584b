"""Delete a whole job from a location: :func:`plan_job_removal` lists, :func:`remove_job` deletes.

The one command that removes a job's records too (``tiercheck rm-job``; ``gc`` never does), and
so the one that must be sure nobody is writing the job:

* in a **node root**, every writer holds an exclusive lock on ``locks/r<rank>.lock`` while it is
  open (:class:`tiercheck.guards.node.RankLock`). The removal takes every one of those locks first
  and holds them while it deletes: a live writer makes it fail with
  :class:`~tiercheck.errors.JobLocked` before anything is deleted, and a writer starting meanwhile
  is refused by the lock the removal holds. The whole node root goes: its blobs, the
  replicas it keeps for other nodes, its manifest, its identity, its lock files; then the folder
  itself and its job folder where they are left empty.
* in a **persistent job folder** a writer's lock lives in its node's memory. The job's memory on
  *this* node (node roots under the memory base whose identity names the location:
  :func:`job_memory`) is removed with it, under its locks as above; a temporary file that a
  process of this host is writing right now refuses the removal too. A writer on another host
  cannot be seen: :attr:`JobRemoval.liveness` says so and names the newest writer generation;
  the caller decides -- and such a writer, should it still run, stops writing there at its next
  write (:class:`tiercheck.guards.node.Fence` finds the tombstone). First a **tombstone** is written
  (``DELETED``: the incarnation deleted and its newest writer generation), so that memory of the
  deleted incarnation on any node -- those this command cannot reach -- is discarded, never
  restored, by the job's next opening. Then every tiercheck key goes: the writer generations
  first (a writer still running stops at once), ``COMMIT`` records (a removal cut short never
  leaves a ``COMMIT`` pointing at a removed blob), blobs, the abandoned sets' ``SET`` records (a
  set cut short reads as unfinished, never as whole), then the rest of the abandoned sets,
  quarantined blobs and probes, the job record last (until it goes, a second ``rm-job`` finds
  the job and finishes it; an opening in between refuses with
  :class:`~tiercheck.errors.JobDeleted`). Then what killed writers left,
  where its writer is gone. Keys that are not tiercheck's are left alone, and with them the
  folder; the tombstone stays, and ``tiercheck ls`` shows the job as deleted.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tiercheck.catalog.base import REQUESTS, Location, NullProgress, Progress, local_path
from tiercheck.catalog.scan import AbandonedSetEntry, Catalog, KeptReplicas
from tiercheck.consistency.abandoned import SET_NAME, parse_abandoned_key
from tiercheck.consistency.identity import (
    JOB_KEY,
    PROBE_PREFIX,
    NodeIdentity,
    Tombstone,
    parse_quarantine_key,
    parse_writer_key,
    writer_key,
)
from tiercheck.consistency.keys import parse_blob_key, parse_commit_key
from tiercheck.defaults import NodeRoot, memory_base
from tiercheck.errors import FormatError, JobLocked, TiercheckError
from tiercheck.guards import NodeLocks, lock_files, read_tombstone, write_tombstone
from tiercheck.tiers import atomic
from tiercheck.tiers.base import Leftover
from tiercheck.tiers.persistent import PersistentTier

__all__ = ["JobRemoval", "check_no_writer", "job_memory", "plan_job_removal", "remove_job"]


@dataclass
class JobRemoval:
    """Everything :func:`remove_job` deletes from one location, listed before it deletes."""

    location: Location
    #: The versions stored (every one of them goes).
    versions: list[int]
    #: Blobs of those versions.
    blobs: int
    #: ``COMMIT`` records (persistent job folders).
    commit_records: int
    #: Blobs a restore set aside.
    quarantined: int
    #: Bytes of the blobs listed, where known (``None`` when some size is unknown).
    size: int | None
    #: The records that go too: ``JOB``, writer generations, probes (persistent); the
    #: manifest, ``identity.json`` and the lock files (node root).
    records: list[str]
    #: The replicas a node root keeps for ranks of other nodes (they go with it).
    replicas: list[KeptReplicas] = field(default_factory=list)
    #: The abandoned sets (persistent job folders): versions the run went back from, and
    #: unfinished set-asides. Every one of them goes.
    abandoned: list[AbandonedSetEntry] = field(default_factory=list)
    #: Keys that are not tiercheck's (persistent job folders): left alone.
    left_alone: list[str] = field(default_factory=list)
    #: ``"checked"`` -- a node root: no writer holds a lock now, and none can while it is
    #: removed; ``"unknown"`` -- a persistent job folder: whether a run writes there cannot be
    #: told from it (see :attr:`newest_writer`).
    liveness: Literal["checked", "unknown"] = "unknown"
    #: The newest writer generation, as a line for people (persistent job folders).
    newest_writer: str | None = None
    #: Whether that writer's process still runs, on this host (``None``: cannot tell here).
    newest_writer_running: bool | None = None
    #: What killed writers left (all of it is listed; only what is removable goes).
    leftovers: list[Leftover] = field(default_factory=list)
    #: The incarnations deleted (job record tokens) and their newest writer generation,
    #: for the tombstone (persistent job folders).
    tokens: list[str] = field(default_factory=list)
    generation: int | None = None
    #: What an earlier ``rm-job`` deleted here (persistent job folders).
    tombstone: Tombstone | None = None
    #: Why this location is part of the removal, when it was not named: a node root holding
    #: the job's memory on this node, found under the memory base.
    found_as: str | None = None

    def to_json(self) -> dict[str, Any]:
        """Plain data for ``--json`` output."""
        return {
            **self.location.to_json(),
            "versions": self.versions,
            "blobs": self.blobs,
            "commit_records": self.commit_records,
            "quarantined": self.quarantined,
            "size": self.size,
            "records": self.records,
            "replicas": [r.to_json() for r in self.replicas],
            "abandoned": [a.to_json() for a in self.abandoned],
            "left_alone": self.left_alone,
            "liveness": self.liveness,
            "newest_writer": self.newest_writer,
            "newest_writer_running": self.newest_writer_running,
            "leftovers": [item.to_json() for item in self.leftovers],
            "incarnations": self.tokens,
            "already_deleted": None if self.tombstone is None else list(self.tombstone.tokens),
            "found_as": self.found_as,
        }


async def plan_job_removal(catalog: Catalog) -> JobRemoval:
    """What removing the job from ``catalog``'s location deletes (nothing is deleted here)."""
    loc = catalog.location
    blobs = catalog.blobs()
    sizes = [b.size for b in blobs] + [q.size for q in catalog.quarantined]
    size = None if None in sizes else sum(s for s in sizes if s is not None)
    records: list[str] = []
    plan = JobRemoval(
        location=loc,
        versions=sorted(catalog.versions),
        blobs=len(blobs),
        commit_records=sum(
            1 for e in catalog.versions.values() if e.commit or e.commit_error is not None
        ),
        quarantined=len(catalog.quarantined),
        size=size,
        records=records,
        leftovers=list(catalog.leftovers),
    )
    if loc.kind == "node":
        root = NodeRoot(Path(loc.url))
        locks = await asyncio.to_thread(lock_files, root)
        for path, present in (
            (root.manifest, await asyncio.to_thread(root.manifest.is_dir)),
            (root.identity, await asyncio.to_thread(root.identity.exists)),
        ):
            if present:
                records.append(str(path))
        records.extend(str(p) for _, p in locks)
        plan.replicas = list(catalog.replicas)
        plan.liveness = "checked"
        return plan
    if catalog.job_record is not None or catalog.job_record_error is not None:
        records.append(JOB_KEY)
    records.extend(writer_key(g) for g in catalog.writer_generations)
    records.extend(catalog.probes)
    plan.abandoned = list(catalog.abandoned)
    plan.left_alone = list(catalog.foreign)
    plan.tombstone = catalog.tombstone
    if catalog.job_record is not None:
        plan.tokens.append(catalog.job_record.token)
    if catalog.writer_generations:
        plan.generation = catalog.writer_generations[-1]
    writer = catalog.newest_writer
    if writer is not None:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(writer.time))
        plan.newest_writer = (
            f"generation {writer.generation}: pid {writer.pid} on {writer.host or '?'}, "
            f"opened {since}"
        )
        owner = atomic.TempOwner(
            writer.host, writer.pid, writer.start or None, writer.kernel or None
        )
        verdict = atomic.process_verdict(owner)[0] if writer.pid > 0 else "unknown"
        plan.newest_writer_running = None if verdict == "unknown" else verdict == "live"
    elif catalog.writer_generations:
        plan.newest_writer = f"generation {catalog.writer_generations[-1]} (record unreadable)"
    return plan


def _same_location(recorded: str | None, url: str) -> bool:
    """Whether a node identity's ``persistent`` names the job folder at ``url``."""
    if recorded is None:
        return False
    a, b = local_path(recorded), local_path(url)
    if a is not None and b is not None:
        return os.path.realpath(a) == os.path.realpath(b)
    return recorded.rstrip("/") == url.rstrip("/")


def _memory_of(job: str, url: str) -> list[tuple[Path, NodeIdentity]]:
    base = memory_base() / job
    if not base.is_dir():
        return []
    found = []
    for folder in sorted(base.iterdir()):
        try:
            identity = NodeIdentity.from_bytes(NodeRoot(folder).identity.read_bytes())
        except (OSError, FormatError):
            continue  # no identity, or unreadable: whose memory it is cannot be told
        if identity.job_id == job and _same_location(identity.persistent, url):
            found.append((folder, identity))
    return found


async def job_memory(plan: JobRemoval) -> list[Location]:
    """This node's memory of the persistent job ``plan`` removes: node roots under the memory
    base (``/dev/shm/tiercheck/<job>/<node>``) whose identity names the job and its location.

    Their incarnations join ``plan.tokens`` (so the tombstone names them even where the job
    record is gone). Node roots elsewhere (``local_root=``) cannot be found from the location;
    the tombstone makes their next opening discard them.
    """
    loc = plan.location
    if loc.kind != "persistent":
        return []
    found = await asyncio.to_thread(_memory_of, loc.job, loc.url)
    for _folder, identity in found:
        if identity.token not in plan.tokens:
            plan.tokens.append(identity.token)
    return [
        Location("node", str(folder.resolve()), job=loc.job, node=folder.name)
        for folder, _identity in found
    ]


def check_no_writer(plan: JobRemoval) -> None:
    """Raise :class:`~tiercheck.errors.JobLocked` if a writer is seen writing the plan's
    location now (a blocking call: run it in a thread): a lock held in a node root, or a
    temporary file a running process of this host is writing in a persistent job folder.
    Writers on other hosts cannot be seen (see :attr:`JobRemoval.liveness`)."""
    if plan.location.kind == "node":
        NodeLocks(NodeRoot(Path(plan.location.url)), plan.location.job).release()
        return
    live = [item for item in plan.leftovers if item.verdict == "live"]
    if live:
        raise JobLocked(
            f"job {plan.location.job!r} is being written at {plan.location.url} now: "
            f"{live[0].name} is being written ({live[0].why}); nothing was deleted: stop the "
            "run first"
        )


def _rmdir_if_empty(folder: Path) -> bool:
    if folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()
        return True
    return False


def _remove_node_root(root: NodeRoot, job: str) -> None:
    locks = NodeLocks(root, job)
    try:
        for folder in (root.blobs, root.replicas, root.manifest):
            if folder.exists():
                shutil.rmtree(folder)
        root.identity.unlink(missing_ok=True)
        # Dead writers' temporary files beside them (an identity being written when killed).
        for temp in atomic.find_temps(str(root.path)):
            if atomic.process_verdict(temp.owner)[0] == "dead":
                atomic.discard(temp.path)
        # Unlinked while held: a writer that opened one before finds, once it gets the lock,
        # that the file is gone and takes a fresh one (see tiercheck.guards.node.RankLock).
        locks.remove_files()
    finally:
        locks.release()
    # Folders left empty go too (something written meanwhile keeps them); the job's folder
    # above the node root only where it is tiercheck's own (<memory base>/<job>/<node>).
    _rmdir_if_empty(root.locks)
    if _rmdir_if_empty(root.path) and root.path.parent.parent == memory_base():
        _rmdir_if_empty(root.path.parent)


def _persistent_order(key: str) -> int | None:
    """When a tiercheck key goes (``None``: not tiercheck's, left alone; so is the tombstone)."""
    if parse_writer_key(key) is not None:
        return 0
    if parse_commit_key(key) is not None:
        return 1
    if parse_blob_key(key) is not None:
        return 2
    inside = parse_abandoned_key(key)
    if inside is not None and inside[1] == SET_NAME:
        return 3
    if inside is not None and (
        parse_blob_key(inside[1]) is not None or parse_commit_key(inside[1]) is not None
    ):
        return 4
    if parse_quarantine_key(key) is not None or key.startswith(PROBE_PREFIX):
        return 4
    if key == JOB_KEY:
        return 5
    return None


async def _write_tombstone(tier: PersistentTier, plan: JobRemoval) -> None:
    try:
        old = await read_tombstone(tier)
    except (TiercheckError, OSError):
        old = None  # unreadable: replaced by one that names at least this deletion
    base = old or Tombstone(plan.location.job)
    record = base.deleting(
        plan.tokens, plan.generation, when=time.time(), host=socket.gethostname(), pid=os.getpid()
    )
    await write_tombstone(tier, record)


async def _remove_persistent(plan: JobRemoval, progress: Progress) -> None:
    loc = plan.location
    tier = PersistentTier(loc.url, storage_options=loc.storage_options)
    async with tier:
        # First: from now on, no opening restores memory of this incarnation, and a writer
        # of it that still runs stops writing here.
        await _write_tombstone(tier, plan)
        keys = [key async for key in tier.list("")]
        stages: list[list[str]] = [[] for _ in range(6)]  # see _persistent_order
        for key in keys:
            stage = _persistent_order(key)
            if stage is not None:
                stages[stage].append(key)
        sem = asyncio.Semaphore(REQUESTS)

        async def delete(key: str) -> None:
            async with sem:
                await tier.delete(key)
            progress.advance()

        progress.start(sum(len(s) for s in stages), "removing")
        try:
            for stage_keys in stages:
                await asyncio.gather(*(delete(k) for k in stage_keys))
        finally:
            progress.finish()
        # No writer owns the location now: what is left goes by the age rule (and at once
        # where its writer's process, on this host, is gone).
        doomed = [item for item in plan.leftovers if item.verdict != "live"]
        if doomed:
            fresh = {item.name: item for item in await tier.leftovers(None)}
            doomed = [fresh[i.name] for i in doomed if i.name in fresh and fresh[i.name].removable]
            await tier.remove_leftovers(doomed, None)
    path = local_path(loc.url)
    if path is not None:
        # The tier prunes the folders it empties, up to the job folder itself.
        await asyncio.to_thread(_rmdir_if_empty, Path(path))


async def remove_job(plan: JobRemoval, progress: Progress | None = None) -> None:
    """Delete everything ``plan`` lists (the location must not be open).

    A node root is removed under every writer lock it holds (:class:`~tiercheck.errors.JobLocked`
    before anything is deleted when a writer holds one); a persistent job folder key by key,
    after its tombstone is written (see the module docstring for the order), leaving keys that
    are not tiercheck's, and the tombstone.
    """
    progress = progress or NullProgress()
    loc = plan.location
    if loc.kind == "node":
        await asyncio.to_thread(_remove_node_root, NodeRoot(Path(loc.url)), loc.job)
    else:
        await _remove_persistent(plan, progress)
