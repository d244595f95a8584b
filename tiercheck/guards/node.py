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
* the guards of a durable location are in :mod:`tiercheck.guards.durable`:
  :class:`Fence` -- writer generations in a durable tier: the newest opening of a job owns its
  durable storage; an older one that is still running notices before it writes and stops, and
  so does one whose job ``tiercheck rm-job`` deleted (:func:`read_tombstone`); :func:`probe` --
  write, read back and delete a small object, so that a durable location that cannot be used
  fails when the job opens, not days later.

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
from pathlib import Path

from tiercheck.consistency.identity import NodeIdentity
from tiercheck.consistency.keys import parse_version_folder
from tiercheck.consistency.manifest import Manifest
from tiercheck.defaults import NodeRoot, memory_base
from tiercheck.errors import FormatError, JobLocked, ManifestError
from tiercheck.tiers import atomic

__all__ = [
    "NodeLocks",
    "RankLock",
    "abandon_node_root",
    "discard_node_memory",
    "lock_files",
    "node_holds_data",
    "node_versions",
    "read_identity",
    "write_identity",
]

logger = logging.getLogger("tiercheck")


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
