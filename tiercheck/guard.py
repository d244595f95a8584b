"""Guards that keep one job's stored data safe from other runs and from bad locations.

Used by the checkpointer when it opens (see :mod:`tiercheck.consistency.identity` for the
records themselves):

* :class:`RankLock` -- one live writer per rank of a job on a node: an exclusive ``flock`` on
  ``<node root>/locks/r<rank>.lock``, held for as long as the checkpointer is open. The kernel
  drops it when the process dies, so a crashed writer never blocks its own restart. A lock file
  may be removed by whoever holds it (:meth:`RankLock.release`, :class:`NodeLocks`): a taker
  checks, once it holds the lock, that the file it locked is still the one under the name.
* :class:`NodeLocks` -- every writer lock of a node root at once (``tiercheck rm-job``, and an
  opening that failed cleaning up after itself: :func:`abandon_node_root`).
* the node identity (:func:`read_identity`, :func:`write_identity`, :func:`node_holds_data`,
  :func:`discard_node_memory`): which incarnation a node's shared memory belongs to.
* :class:`Fence` -- writer generations in a durable tier: the newest opening of a job owns its
  durable storage; an older one that is still running notices before it writes and stops, and
  so does one whose job ``tiercheck rm-job`` deleted (:func:`read_tombstone`).
* :func:`probe` -- write, read back and delete a small object, so that a durable location that
  cannot be used fails when the job opens, not days later.

Blocking file work here is meant to run in worker threads (the checkpointer calls these through
``asyncio.to_thread``); the async functions use only the :class:`~tiercheck.tiers.Tier` API.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import socket
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tiercheck.consistency.identity import (
    JOB_KEY,
    TOMBSTONE_KEY,
    WRITERS_PREFIX,
    JobRecord,
    NodeIdentity,
    Tombstone,
    WriterRecord,
    parse_writer_key,
    probe_key,
    writer_key,
)
from tiercheck.consistency.keys import parse_version_folder
from tiercheck.consistency.manifest import Manifest
from tiercheck.defaults import NodeRoot, memory_base
from tiercheck.errors import (
    BlobNotFound,
    FormatError,
    JobDeleted,
    JobLocked,
    ManifestError,
    StorageError,
    Superseded,
    TiercheckError,
)
from tiercheck.tiers import atomic
from tiercheck.tiers.base import Tier

__all__ = [
    "Fence",
    "NodeLocks",
    "RankLock",
    "abandon_node_root",
    "deletion_facts",
    "discard_node_memory",
    "forget_deleted",
    "lock_files",
    "node_holds_data",
    "node_versions",
    "probe",
    "read_identity",
    "read_job_record",
    "read_tombstone",
    "write_identity",
    "write_job_record",
    "write_tombstone",
    "writer_record",
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
        #: Whether taking the lock created its file (a failed opening removes only such).
        self.created = False
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock, or raise :class:`~tiercheck.errors.JobLocked`."""
        if self._fd is not None:
            return
        try:
            self._fd, self.created = _lock_file(self.path)
        except _Held as held:
            raise JobLocked(
                f"rank {self.rank} of this job is already being written on this node "
                f"({held.holder or 'holder unknown'}; lock {self.path}). Two runs of one job "
                "would overwrite each other's checkpoints: stop the other run, or give this one "
                "another job_id."
            ) from None
        try:
            note = f"pid {os.getpid()} on {socket.gethostname()} since {time.ctime()}".encode()
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, note, 0)
        except OSError as exc:  # the note is for people; the lock itself is what counts
            logger.debug("tiercheck: could not note the lock holder in %s: %r", self.path, exc)

    def release(self, *, remove: bool = False) -> None:
        """Drop the lock (idempotent). With ``remove``, the lock file goes first, while still
        held: a process that opened it meanwhile finds, once it gets the lock, that the file is
        no longer under its name, and takes a fresh one (see :func:`_lock_file`)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if remove:
                _unlink_if_same(self.path, fd)
        finally:
            os.close(fd)


# A lock file removed between our open and our flock is taken again; more than a few such
# losses in a row means something removes the folder as fast as it is made.
_LOCK_ATTEMPTS = 16


def _same_file(path: Path, fd: int) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)


def _unlink_if_same(path: Path, fd: int) -> None:
    """Remove ``path`` if it is still the file ``fd`` holds locked."""
    if _same_file(path, fd):
        path.unlink(missing_ok=True)


class _Held(Exception):
    """The lock is held by another open file (its holder's note, for messages)."""

    def __init__(self, holder: str) -> None:
        super().__init__(holder)
        self.holder = holder


def _lock_file(path: Path, *, create: bool = True) -> tuple[int, bool]:
    """An exclusive, non-blocking ``flock`` on ``path`` (created if ``create``): its fd, and
    whether this call created the file.

    Raises :class:`_Held` (with the holder's note) when another open file holds it, and
    :class:`FileNotFoundError` when ``path`` is missing and not to be created. A file removed by
    its holder while we waited for it (see :meth:`RankLock.release`) is not the lock any more:
    it is opened again.
    """
    for _attempt in range(_LOCK_ATTEMPTS):
        created = False
        try:
            if create:
                atomic.make_dirs(str(path.parent), 0o700)
                try:
                    flags = os.O_RDWR | os.O_CLOEXEC | os.O_CREAT | os.O_EXCL
                    fd, created = os.open(path, flags, 0o600), True
                except FileExistsError:
                    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            else:
                fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            if not create:
                raise
            continue  # removed (it or its folder) between two of our calls: again
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_small(fd)
            os.close(fd)
            raise _Held(holder) from None
        except BaseException:
            os.close(fd)
            raise
        if _same_file(path, fd):
            return fd, created
        os.close(fd)  # removed (or replaced) by its holder before we got it
        if not create:
            raise FileNotFoundError(errno.ENOENT, "lock file removed", str(path))
    raise OSError(
        errno.EAGAIN,
        f"the lock file keeps being removed and made again; is a cleanup running in a loop "
        f"over this node's memory? ({path})",
    )


class NodeLocks:
    """Every writer lock of a node root, held by this process (each as :class:`RankLock`
    takes it), or :class:`~tiercheck.errors.JobLocked` naming the first one a writer holds.

    ``skip`` names a lock file this process already holds itself (a failing opening's own).
    Nothing is written into the files. While held, no writer of the job can open on this node.
    """

    def __init__(self, root: NodeRoot, job: str, *, skip: Path | None = None) -> None:
        #: The lock files held, by rank.
        self.held: list[tuple[int, Path]] = []
        self._fds: list[int] = []
        try:
            for rank, path in lock_files(root):
                if skip is not None and path == skip:
                    continue
                try:
                    fd, _ = _lock_file(path, create=False)
                except FileNotFoundError:
                    continue  # removed by its holder meanwhile: nobody's lock now
                except _Held as held:
                    raise JobLocked(
                        f"rank {rank} of job {job!r} is being written in {root.path} "
                        f"({held.holder or 'holder unknown'}; lock {path}); nothing was "
                        "deleted: stop the run first"
                    ) from None
                self._fds.append(fd)
                self.held.append((rank, path))
        except BaseException:
            self.release()
            raise

    def remove_files(self) -> None:
        """Remove every held lock file (still held: see :meth:`RankLock.release`)."""
        for (_rank, path), fd in zip(self.held, self._fds, strict=True):
            _unlink_if_same(path, fd)

    def release(self) -> None:
        """Let go of every lock."""
        fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)


def lock_files(root: NodeRoot) -> list[tuple[int, Path]]:
    """The writer lock files of a node root, by rank."""
    if not root.locks.is_dir():
        return []
    found = [(NodeRoot.lock_rank(p.name), p) for p in sorted(root.locks.iterdir())]
    return [(rank, p) for rank, p in found if rank is not None]


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


def _manifest_is_empty(folder: Path) -> bool:
    """Whether the manifest in ``folder`` holds no record (or there is none)."""
    if not folder.is_dir():
        return True
    try:
        manifest = Manifest(folder)
    except ManifestError:
        return False  # cannot tell: it may hold history
    try:
        return manifest.log_size() == 0
    except ManifestError:
        return False
    finally:
        manifest.close()


def abandon_node_root(node_root: Path, lock: RankLock, job: str, since: float) -> list[str]:
    """After an opening failed: remove what it made in the node's memory, if that holds nothing.

    ``lock`` is the failing rank's own lock (still held); it is released, and its file removed
    if taking it made the file. ``since`` is when the opening began (this host's clock). Then,
    if no other writer holds a lock in the node root, the node's memory holds no checkpoint (no
    blob, no replica), and its identity is absent or was written by this opening (created at
    or after ``since``), the rest of the skeleton goes -- that ``identity.json``, an empty
    ``manifest/``, the empty ``blobs/`` and ``replicas/``, the other ranks' free lock files --
    and then ``locks/``, the node root and its job's folder under the memory base where left
    empty. So a failed opening of a new job
    leaves nothing behind, while one refused over memory it did not make (a ``StaleMemory``
    refusal) leaves that memory as it was.

    Returns what was removed (paths), for the log. Blocking: run it in a thread.
    """
    layout = NodeRoot(node_root)
    removed: list[str] = []
    if lock.held and lock.created:
        removed.append(str(lock.path))
    lock.release(remove=lock.created)
    try:
        others = NodeLocks(layout, job)
    except JobLocked:
        return removed  # another rank of the job is (still) open here: its memory stays
    try:
        if _made_since(layout, since) and not node_holds_data(node_root):
            if _manifest_is_empty(layout.manifest):
                for folder in (*layout.data_dirs, layout.manifest):
                    if folder.exists():
                        shutil.rmtree(folder)
                        removed.append(str(folder))
                if layout.identity.exists():
                    layout.identity.unlink(missing_ok=True)
                    removed.append(str(layout.identity))
            # Dead writers' temporary files (an identity being written when it failed).
            for temp in atomic.find_temps(str(node_root)):
                if atomic.process_verdict(temp.owner)[0] == "dead":
                    atomic.discard(temp.path)
            others.remove_files()
            removed.extend(str(p) for _, p in others.held)
    finally:
        others.release()
    for folder in (layout.locks, layout.path):
        _rmdir_if_empty(folder)
    if layout.path.parent.parent == memory_base():
        _rmdir_if_empty(layout.path.parent)
    return removed


def _made_since(layout: NodeRoot, since: float) -> bool:
    """Whether the node's identity is absent, or was written at or after ``since``."""
    try:
        identity = NodeIdentity.from_bytes(layout.identity.read_bytes())
    except FileNotFoundError:
        return True
    except (OSError, FormatError):
        return False  # someone's, unreadable: left alone
    return identity.created >= since


def _rmdir_if_empty(folder: Path) -> None:
    try:
        folder.rmdir()
    except OSError as exc:
        # Not empty (a writer arrived), or gone: both fine; anything else is reported.
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
            raise


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


async def read_tombstone(tier: Tier) -> Tombstone | None:
    """What ``tiercheck rm-job`` deleted at this location (its tombstone), or ``None``."""
    try:
        data = await tier.get(TOMBSTONE_KEY)
    except BlobNotFound:
        return None
    return Tombstone.from_bytes(bytes(data))


async def write_tombstone(tier: Tier, record: Tombstone) -> None:
    """Store the tombstone."""
    await tier.put(TOMBSTONE_KEY, record.to_bytes())


async def deletion_facts(tiers: Sequence[Tier]) -> dict[str, Any]:
    """Rank 0, at opening: what the durable tiers' tombstones say, for :func:`forget_deleted`.

    ``{"deleted": [tokens...], "tombstone": bool}`` -- the incarnations ``tiercheck rm-job``
    deleted, and whether a tombstone is there at all -- or, when a tombstone cannot be read,
    ``{"job_error": why}`` (the opening then fails as for a job record that cannot be read:
    whether memory may be restored cannot be told).
    """
    tokens: list[str] = []
    found = False
    for tier in tiers:
        try:
            tombstone = await read_tombstone(tier)
        except (TiercheckError, OSError) as exc:
            return {"job_error": f"its tombstone ({TOMBSTONE_KEY}) cannot be read: {exc}"}
        if tombstone is not None:
            found = True
            tokens += [t for t in tombstone.tokens if t not in tokens]
    return {"deleted": tokens, "tombstone": found}


def forget_deleted(
    identities: dict[int, NodeIdentity | None],
    facts: Mapping[str, Any],
    job_id: str,
    where: str | None,
) -> dict[int, str]:
    """At opening: the nodes whose memory belongs to an incarnation ``tiercheck rm-job`` deleted.

    ``facts`` is rank 0's exchange (:func:`deletion_facts` and the job record's state, key
    ``"job"``); ``where`` the durable location, as identities record it. A node's memory is of
    a deleted incarnation when its identity names one of the tombstone's tokens -- or, while no
    new incarnation has started there since (a tombstone, no job record), when it names this
    job at ``where`` at all (a job record that was unreadable or missing when ``rm-job`` ran
    left no token to name). Those nodes' identities are set to ``None`` in ``identities``
    (their memory is not this run's, nor anyone's: the user deleted it) and returned with the
    reason; the caller discards that memory whatever ``stale_memory`` says, and starts the job
    afresh. A job record that names a deleted incarnation means the deletion did not finish, and
    ``COMMIT`` records without a job record mean a run of the deleted job wrote after it:
    :class:`~tiercheck.errors.JobDeleted` for both, before anything is changed.
    """
    tokens = set(facts.get("deleted") or ())
    if not facts.get("tombstone"):
        return {}
    job = facts.get("job") or {}
    since_deleted = job.get("state") != "found"
    if job.get("state") == "legacy":
        # COMMIT records without a job record, after a deletion: written by a run of the
        # deleted incarnation that was still writing (or a deletion cut short): not this run's.
        raise JobDeleted(
            f"job {job_id!r} at {where} was deleted by `tiercheck rm-job`, but versions were "
            "stored there since without a job record (a run of the deleted job still writing "
            f"when it was deleted?). Run `tiercheck rm-job {where} --job {job_id} --yes` again "
            "to remove them, then start the job. Nothing was changed."
        )
    if not since_deleted and job.get("token") in tokens:
        raise JobDeleted(
            f"job {job_id!r} at {where} was deleted by `tiercheck rm-job` (incarnation "
            f"{str(job['token'])[:8]}), but its job record is still there: the deletion did not "
            f"finish, or a run of that incarnation wrote it again. Run `tiercheck rm-job {where} "
            f"--job {job_id} --yes` again to finish it, then start the job. Nothing was changed."
        )
    gone: dict[int, str] = {}
    for node, identity in identities.items():
        if identity is None or identity.job_id != job_id:
            continue
        if identity.token in tokens or (since_deleted and identity.persistent == where):
            identities[node] = None
            gone[node] = (
                f"it holds incarnation {identity.token[:8]} of job {job_id!r}, which "
                f"`tiercheck rm-job` deleted from {where}: discarded, never restored"
            )
    return gone


def writer_record(generation: int, session: str) -> WriterRecord:
    """The record of writer generation ``generation``, claimed by this process for ``session``."""
    me = atomic.current_owner()
    return WriterRecord(
        generation,
        session,
        socket.gethostname(),
        me.pid,
        time.time(),
        start=me.start or 0,
        kernel=me.kernel or "",
    )


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
        tombstone = await read_tombstone(self.tier)
        deleted = -1 if tombstone is None else tombstone.generation
        for _attempt in range(8):
            newest, generations = await self._newest()
            generation = max(-1 if newest is None else newest, deleted) + 1
            record = writer_record(generation, self.session)
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
        # The generations vanished. Deleted by `tiercheck rm-job`: this writer's job is gone.
        tombstone = await read_tombstone(self.tier)
        if tombstone is not None and tombstone.generation >= mine:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(tombstone.time))
            raise Superseded(
                f"job {tombstone.job_id!r} was deleted from {self.tier!r} by `tiercheck rm-job` "
                f"(pid {tombstone.pid} on {tombstone.host or '?'}, {when}) while this run was "
                "writing it; this run no longer writes there"
            )
        # Deleted folder, lifecycle rule: claim ours again.
        if not self._warned_lost:
            self._warned_lost = True
            logger.warning(
                "tiercheck: the writer records of %r are gone (was the location emptied?); "
                "claiming generation %s again",
                self.tier,
                mine,
            )
        await self.tier.put(writer_key(mine), writer_record(mine, self.session).to_bytes())
        return True
