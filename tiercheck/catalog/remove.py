"""Delete a whole job from a location: :func:`plan_job_removal` lists, :func:`remove_job` deletes.

The one command that removes a job's records too (``tiercheck rm-job``; ``gc`` never does), and
so the one that must be sure nobody is writing the job:

* in a **node root**, every writer holds an exclusive lock on ``locks/r<rank>.lock`` while it is
  open (:class:`tiercheck.guard.RankLock`). The removal takes every one of those locks first and
  holds them while it deletes: a live writer makes it fail with
  :class:`~tiercheck.errors.JobLocked` before anything is deleted, and a writer starting
  meanwhile is refused by the lock the removal holds. The whole node root goes: its blobs, the
  replicas it keeps for other nodes, its manifest, its identity, its lock files; then the folder
  itself and its job folder where they are left empty.
* in a **persistent job folder** nothing tells a live writer apart from a finished one: its lock
  lives in its node's memory. :attr:`JobRemoval.liveness` says so and names the newest writer
  generation; the caller decides. Every tiercheck key goes: ``COMMIT`` records first (a removal
  cut short never leaves a ``COMMIT`` pointing at a removed blob), then blobs, quarantined blobs
  and probes, then the job record, and the writer generations last (a removal cut short never
  leaves the job record without its data, which a later run of the job id would take for its
  own; until the job record goes, a second ``rm-job`` finds the job and finishes). Keys that are
  not tiercheck's are left alone, and with them the folder.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tiercheck.catalog.base import REQUESTS, Location, NullProgress, Progress, local_path
from tiercheck.catalog.scan import Catalog, HeldReplicas
from tiercheck.consistency.identity import (
    JOB_KEY,
    PROBE_PREFIX,
    parse_quarantine_key,
    parse_writer_key,
    writer_key,
)
from tiercheck.consistency.keys import parse_blob_key, parse_commit_key
from tiercheck.defaults import NodeRoot, memory_base
from tiercheck.errors import JobLocked
from tiercheck.tiers.persistent import PersistentTier

__all__ = ["JobRemoval", "check_no_writer", "plan_job_removal", "remove_job"]


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
    replicas: list[HeldReplicas] = field(default_factory=list)
    #: Keys that are not tiercheck's (persistent job folders): left alone.
    left_alone: list[str] = field(default_factory=list)
    #: ``"checked"`` -- a node root: no writer holds a lock now, and none can while it is
    #: removed; ``"unknown"`` -- a persistent job folder: whether a run writes there cannot be
    #: told from it (see :attr:`newest_writer`).
    liveness: Literal["checked", "unknown"] = "unknown"
    #: The newest writer generation, as a line for people (persistent job folders).
    newest_writer: str | None = None

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
            "left_alone": self.left_alone,
            "liveness": self.liveness,
            "newest_writer": self.newest_writer,
        }


def _lock_files(root: NodeRoot) -> list[tuple[int, Path]]:
    if not root.locks.is_dir():
        return []
    found = [(NodeRoot.lock_rank(p.name), p) for p in sorted(root.locks.iterdir())]
    return [(rank, p) for rank, p in found if rank is not None]


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
    )
    if loc.kind == "node":
        root = NodeRoot(Path(loc.url))
        locks = await asyncio.to_thread(_lock_files, root)
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
    plan.left_alone = list(catalog.foreign)
    writer = catalog.newest_writer
    if writer is not None:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(writer.time))
        plan.newest_writer = (
            f"generation {writer.generation}: pid {writer.pid} on {writer.host or '?'}, "
            f"opened {since}"
        )
    elif catalog.writer_generations:
        plan.newest_writer = f"generation {catalog.writer_generations[-1]} (record unreadable)"
    return plan


class _HeldLocks:
    """Every writer lock of a node root, held by this process (the protocol of
    :class:`tiercheck.guard.RankLock`: an exclusive ``flock`` on the lock file). Nothing is
    written into the files."""

    def __init__(self, root: NodeRoot, job: str) -> None:
        self.paths: list[Path] = []
        self._fds: list[int] = []
        try:
            for rank, path in _lock_files(root):
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    holder = os.pread(fd, 256, 0).decode(errors="replace").strip()
                    os.close(fd)
                    raise JobLocked(
                        f"rank {rank} of job {job!r} is being written in {root.path} "
                        f"({holder or 'holder unknown'}; lock {path}); nothing was deleted: "
                        "stop the run first"
                    ) from None
                except BaseException:
                    os.close(fd)
                    raise
                self._fds.append(fd)
                self.paths.append(path)
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        """Let go of every lock."""
        fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)


def check_no_writer(plan: JobRemoval) -> None:
    """Raise :class:`~tiercheck.errors.JobLocked` if a writer holds a lock in the plan's node
    root now (a blocking call: run it in a thread). Persistent job folders cannot tell."""
    if plan.location.kind == "node":
        _HeldLocks(NodeRoot(Path(plan.location.url)), plan.location.job).release()


def _rmdir_if_empty(folder: Path) -> bool:
    if folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()
        return True
    return False


def _remove_node_root(root: NodeRoot, job: str) -> None:
    locks = _HeldLocks(root, job)
    try:
        for folder in (root.blobs, root.replicas, root.manifest):
            if folder.exists():
                shutil.rmtree(folder)
        root.identity.unlink(missing_ok=True)
        # Unlinked while held: a writer that opened one before now fails on our lock, and one
        # starting later creates a fresh file in a fresh node root.
        for path in locks.paths:
            path.unlink(missing_ok=True)
    finally:
        locks.release()
    # Folders left empty go too (something written meanwhile keeps them); the job's folder
    # above the node root only where it is tiercheck's own (<memory base>/<job>/<node>).
    _rmdir_if_empty(root.locks)
    if _rmdir_if_empty(root.path) and root.path.parent.parent == memory_base():
        _rmdir_if_empty(root.path.parent)


def _persistent_order(key: str) -> int | None:
    """When a tiercheck key goes (``None``: not tiercheck's, left alone)."""
    if parse_commit_key(key) is not None:
        return 0
    if parse_blob_key(key) is not None:
        return 1
    if parse_quarantine_key(key) is not None or key.startswith(PROBE_PREFIX):
        return 2
    if key == JOB_KEY:
        return 3
    if parse_writer_key(key) is not None:
        return 4
    return None


async def _remove_persistent(loc: Location, progress: Progress) -> None:
    async with PersistentTier(loc.url, storage_options=loc.storage_options) as tier:
        keys = [key async for key in tier.list("")]
        stages: list[list[str]] = [[] for _ in range(5)]
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
    path = local_path(loc.url)
    if path is not None:
        # The tier prunes the folders it empties, up to the job folder itself.
        await asyncio.to_thread(_rmdir_if_empty, Path(path))


async def remove_job(plan: JobRemoval, progress: Progress | None = None) -> None:
    """Delete everything ``plan`` lists (the location must not be open).

    A node root is removed under every writer lock it holds (:class:`~tiercheck.errors.JobLocked`
    before anything is deleted when a writer holds one); a persistent job folder key by key,
    ``COMMIT`` records first and writer generations last, leaving keys that are not tiercheck's.
    """
    progress = progress or NullProgress()
    loc = plan.location
    if loc.kind == "node":
        await asyncio.to_thread(_remove_node_root, NodeRoot(Path(loc.url)), loc.job)
    else:
        await _remove_persistent(loc, progress)
