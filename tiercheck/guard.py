"""Guards that keep one job's stored data safe from other runs and from bad locations.

Used by the checkpointer when it opens (see :mod:`tiercheck.consistency.identity` for the
records themselves):

* :class:`RankLock` -- one live writer per rank of a job on a node: an exclusive ``flock`` on
  ``<node root>/locks/r<rank>.lock``, held for as long as the checkpointer is open. The kernel
  drops it when the process dies, so a crashed writer never blocks its own restart.
* the node identity (:func:`read_identity`, :func:`write_identity`, :func:`node_holds_data`,
  :func:`discard_node_memory`): which incarnation a node's shared memory belongs to.
* :class:`Fence` -- writer generations in a durable tier: the newest opening of a job owns its
  durable storage; an older one that is still running notices before it writes and stops.
* :func:`probe` -- write, read back and delete a small object, so that a durable location that
  cannot be used fails when the job opens, not days later.

Blocking file work here is meant to run in worker threads (the checkpointer calls these through
``asyncio.to_thread``); the async functions use only the :class:`~tiercheck.tiers.Tier` API.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import socket
import time
from pathlib import Path

from tiercheck.consistency.identity import (
    JOB_KEY,
    WRITERS_PREFIX,
    JobRecord,
    NodeIdentity,
    WriterRecord,
    parse_writer_key,
    probe_key,
    writer_key,
)
from tiercheck.consistency.keys import parse_version_folder
from tiercheck.defaults import NodeRoot
from tiercheck.errors import (
    BlobNotFound,
    FormatError,
    JobLocked,
    StorageError,
    Superseded,
    TiercheckError,
)
from tiercheck.tiers import atomic
from tiercheck.tiers.base import Tier

__all__ = [
    "Fence",
    "RankLock",
    "discard_node_memory",
    "node_holds_data",
    "node_versions",
    "probe",
    "read_identity",
    "read_job_record",
    "write_identity",
    "write_job_record",
]

logger = logging.getLogger("tiercheck")

#: Writer generations kept besides the live one: enough for an operator to see who ran last.
KEEP_WRITERS = 4


class RankLock:
    """An exclusive lock on one rank of one job on this node, held while open.

    Args:
        node_root: the node's memory root.
        rank: the rank the lock is for.

    :meth:`acquire` raises :class:`~tiercheck.errors.JobLocked` naming the holder's process when
    another live process (or another open checkpointer in this one) holds it.
    """

    def __init__(self, node_root: Path, rank: int) -> None:
        self.path = NodeRoot(node_root).lock(rank)
        self.rank = rank
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock, or raise :class:`~tiercheck.errors.JobLocked`."""
        if self._fd is not None:
            return
        atomic.make_dirs(str(self.path.parent), 0o700)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_small(fd)
            os.close(fd)
            raise JobLocked(
                f"rank {self.rank} of this job is already being written on this node "
                f"({holder or 'holder unknown'}; lock {self.path}). Two runs of one job would "
                "overwrite each other's checkpoints: stop the other run, or give this one another "
                "job_id."
            ) from None
        except BaseException:
            os.close(fd)
            raise
        try:
            note = f"pid {os.getpid()} on {socket.gethostname()} since {time.ctime()}".encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, note, 0)
        except OSError as exc:  # the note is for people; the lock itself is what counts
            logger.debug("tiercheck: could not note the lock holder in %s: %r", self.path, exc)
        self._fd = fd

    def release(self) -> None:
        """Drop the lock (idempotent). The file stays: removing it would race a new holder."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def _read_small(fd: int) -> str:
    try:
        return os.pread(fd, 256, 0).decode(errors="replace").strip()
    except OSError:
        return ""


# --- node identity ---------------------------------------------------------------------------


def read_identity(node_root: Path) -> NodeIdentity | None:
    """The node's identity record, or ``None`` when there is none.

    A record that cannot be parsed raises :class:`~tiercheck.errors.FormatError`.
    """
    try:
        data = NodeRoot(node_root).identity.read_bytes()
    except FileNotFoundError:
        return None
    return NodeIdentity.from_bytes(data)


def write_identity(node_root: Path, identity: NodeIdentity) -> None:
    """Write (or replace) the node's identity record atomically."""
    atomic.make_dirs(str(node_root), 0o700)
    path = NodeRoot(node_root).identity
    atomic.atomic_write(str(path), [memoryview(identity.to_bytes())])


def node_holds_data(node_root: Path) -> bool:
    """Whether the node's memory holds any checkpoint data (a blob or a replica)."""
    for folder in NodeRoot(node_root).data_dirs:
        for _folder, _dirs, files in os.walk(folder):
            if any(not atomic.is_internal_name(f) for f in files):
                return True
    return False


def node_versions(node_root: Path) -> list[int]:
    """The versions the node's local tier holds blobs of (by folder name), ascending."""
    found = []
    try:
        entries = list(os.scandir(NodeRoot(node_root).blobs))
    except FileNotFoundError:
        return []
    for entry in entries:
        parsed = parse_version_folder(entry.name)
        if parsed is not None and entry.is_dir(follow_symlinks=False):
            found.append(parsed)
    return sorted(found)


def discard_node_memory(node_root: Path) -> None:
    """Delete the node's checkpoint data, manifest and identity (an explicit operator choice).

    Locks stay: the ranks doing this hold them.
    """
    layout = NodeRoot(node_root)
    for folder in (*layout.data_dirs, layout.manifest):
        if folder.exists():
            shutil.rmtree(folder)
    layout.identity.unlink(missing_ok=True)


# --- durable tiers: job record, probe, fence --------------------------------------------------


async def read_job_record(tier: Tier) -> JobRecord | None:
    """The tier's job record, or ``None`` when it has none."""
    try:
        data = await tier.get(JOB_KEY)
    except BlobNotFound:
        return None
    return JobRecord.from_bytes(bytes(data))


async def write_job_record(tier: Tier, record: JobRecord) -> None:
    """Store the job record."""
    await tier.put(JOB_KEY, record.to_bytes())


async def probe(tier: Tier, session: str, rank: int) -> None:
    """Write a small object, read it back, delete it; raise what fails, naming the step."""
    key = probe_key(session, rank)
    payload = f"tiercheck probe {session} r{rank} {time.time()}".encode()
    step = "write"
    try:
        await tier.put(key, payload)
        step = "read back"
        back = bytes(await tier.get(key))
        if back != payload:
            raise StorageError(f"read back {len(back)} bytes that differ from what was written")
        step = "delete"
        await tier.delete(key)
    except TiercheckError as exc:
        raise StorageError(
            f"the {tier.name!r} tier ({tier!r}) cannot be used: a test object could not be "
            f"{'written' if step == 'write' else step + ' '}({exc}). Check the URL, the "
            "credentials (storage_options) and the permissions; nothing of the job was touched."
        ) from exc
    except OSError as exc:
        raise StorageError(
            f"the {tier.name!r} tier ({tier!r}) cannot be used: {step} of a test object failed "
            f"({exc!r}). Check the URL, the credentials and the permissions."
        ) from exc


class Fence:
    """Writer generations in one durable tier: the newest opening of a job owns it.

    :meth:`claim` (one rank per job, at open) stores the next generation naming this opening's
    ``session``; :meth:`check` (any rank, before writing durable data) raises
    :class:`~tiercheck.errors.Superseded` when a newer generation exists. A location whose
    generations vanished (the folder was deleted, a lifecycle rule ran) is re-claimed with a
    warning: the writer is still the newest one anyone knows of.
    """

    def __init__(self, tier: Tier, session: str) -> None:
        self.tier = tier
        self.session = session
        self.generation: int | None = None
        self._warned_lost = False

    async def _newest(self) -> tuple[int | None, list[int]]:
        found: list[int] = []
        async for key in self.tier.list(WRITERS_PREFIX):
            generation = parse_writer_key(key)
            if generation is not None:
                found.append(generation)
        generations = sorted(found)
        return (generations[-1] if generations else None), generations

    async def claim(self) -> int:
        """Store the next generation for this session and return it (rank 0, at open)."""
        for _attempt in range(8):
            newest, generations = await self._newest()
            generation = 0 if newest is None else newest + 1
            record = WriterRecord(
                generation, self.session, socket.gethostname(), os.getpid(), time.time()
            )
            await self.tier.put(writer_key(generation), record.to_bytes())
            # Two openings may have picked the same number; the record that stayed decides.
            if await self._owner(generation) == self.session:
                self.generation = generation
                for old in generations[:-KEEP_WRITERS]:
                    await self.tier.delete(writer_key(old))
                return generation
        raise StorageError(
            f"could not claim a writer generation in {self.tier!r}: other openings of this job "
            "keep claiming the same ones. Is the job launched several times at once?"
        )

    async def _owner(self, generation: int) -> str | None:
        try:
            data = await self.tier.get(writer_key(generation))
        except BlobNotFound:
            return None
        try:
            return WriterRecord.from_bytes(bytes(data)).session
        except FormatError:
            return None

    def adopt(self, generation: int) -> None:
        """Use the generation another rank of this opening claimed."""
        self.generation = generation

    async def check(self) -> bool:
        """Raise :class:`~tiercheck.errors.Superseded` if a newer opening owns the tier.

        Returns whether the generations had vanished and this one was claimed again (the
        location was emptied: the caller may want to write its other records again too).
        """
        mine = self.generation
        if mine is None:
            raise Superseded("this opening holds no writer generation in the tier")
        newest, _ = await self._newest()
        if newest is not None and newest > mine:
            owner = await self._owner(newest)
            raise Superseded(
                f"another opening of this job (generation {newest}, session {owner}) took over "
                f"{self.tier!r} after this one (generation {mine}); this run no longer writes "
                "there. Stop one of the two runs: they share a job_id."
            )
        owner = await self._owner(mine) if newest == mine else None
        if newest == mine and owner == self.session:
            return False
        if newest == mine and owner is not None:
            raise Superseded(
                f"another opening of this job (session {owner}) claimed the same writer "
                f"generation {mine} in {self.tier!r}; this run no longer writes there"
            )
        # The generations vanished (deleted folder, lifecycle rule): claim ours again.
        if not self._warned_lost:
            self._warned_lost = True
            logger.warning(
                "tiercheck: the writer records of %r are gone (was the location emptied?); "
                "claiming generation %s again",
                self.tier,
                mine,
            )
        record = WriterRecord(mine, self.session, socket.gethostname(), os.getpid(), time.time())
        await self.tier.put(writer_key(mine), record.to_bytes())
        return True
