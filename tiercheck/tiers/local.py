"""The local tier: this node's host memory, as files in shared memory (``/dev/shm``).

A training process that crashes leaves its checkpoints behind here for its restarted self: the
blobs are ordinary files in a memory-backed filesystem, owned by the kernel, not by the process.
See :class:`LocalTier`.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import mmap
import os
import stat
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, TypeVar

# default_root lives with the rest of the node layout in tiercheck.defaults; importable here too.
from tiercheck.defaults import NodeRoot, default_root
from tiercheck.errors import (
    BlobNotFound,
    ConfigError,
    InvalidKey,
    StorageError,
    TiercheckError,
    TierFull,
)
from tiercheck.tiers import _atomic
from tiercheck.tiers.base import Buffer, FailureScope, Tier, TierSetup, validate_key

__all__ = ["LocalReservation", "LocalTier", "default_root"]

_T = TypeVar("_T")

logger = logging.getLogger("tiercheck")

_DIR_MODE: Final = 0o700
_FILE_MODE: Final = 0o600
# Spares live in one folder at the root; its name holds '#', so no key can reach it.
_SPARES_DIR: Final = ".tiercheck#spares"
# A get retries when the file it opened was replaced or recycled before it could lock it; each
# retry sees a newer blob, so a few are plenty unless a writer rewrites the key nonstop.
_READ_ATTEMPTS: Final = 64

# Pre-faults the pages of a mapping (Linux); elsewhere pages are faulted in on first touch.
_MAP_POPULATE: Final = getattr(mmap, "MAP_POPULATE", 0)
# Blobs from this size on are read by mapping them (no copy); smaller ones are copied.
_MAP_READS_FROM: Final = 1 << 20

# Reads at least this large go to anonymous memory rather than a bytearray (see _read_exactly).
_ANONYMOUS_FROM: Final = 1 << 20

_OPEN, _COMMITTING, _COMMITTED, _ABORTED = "open", "committing", "committed", "aborted"

# What a full filesystem answers (TierFull, see LocalTier._os_error).
_FULL_ERRNOS: Final = frozenset({errno.ENOSPC, errno.EDQUOT})
# What a filesystem that cannot preallocate answers to posix_fallocate (glibc emulates it on
# most; these remain where it cannot).
_NO_FALLOCATE_ERRNOS: Final = frozenset({errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS})


def _posix_fallocate() -> Callable[[int, int, int], None] | None:
    """``os.posix_fallocate``, or ``None`` on a platform without it (which does without).

    Looked up at each use, like any other ``os`` call, rather than bound once at import.
    """
    return getattr(os, "posix_fallocate", None)


def _valid_key(key: str) -> bool:
    try:
        validate_key(key)
    except InvalidKey:
        return False
    return True


def _map_private(fd: int, size: int) -> memoryview:
    """The file behind ``fd`` as private, copy-on-write memory: a zero-copy read.

    The caller holds a shared ``flock`` on ``fd``. A duplicate of the descriptor keeps that
    lock for as long as the mapping lives, so the file can be deleted but never recycled (nor
    written) under it; writes to the mapping stay private to this process. The stored blob
    is therefore as safe from the caller, and the caller from later writers, as with a copy.
    """
    keeper = os.dup(fd)  # shares the open file description, hence the lock
    try:
        # No MAP_POPULATE: on a private writable mapping it faults every page for writing,
        # copying the whole blob; lazily, reads map the shared pages and only writes copy.
        mapping = mmap.mmap(
            keeper, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
        )
    except BaseException:
        os.close(keeper)
        raise
    weakref.finalize(mapping, os.close, keeper)
    return memoryview(mapping)


@dataclass(slots=True)
class _Spare:
    """A file kept after its blob was deleted, to be refilled by a later put or reserve."""

    path: str
    size: int


@dataclass(eq=False)
class _Prepared:
    """Memory made ready ahead of a reserve: a sized, mapped, populated hidden file."""

    fd: int
    path: str
    mapping: mmap.mmap
    view: memoryview
    nbytes: int


class LocalTier(Tier):
    """Blobs as files in this node's shared memory; they outlive the process that wrote them.

    ``LocalTier(root=None, *, job_id="default", node=None, capacity=None, spare_files=4,
    fsync=False, populate=True, name="local")``

    Layout
        Each key is a file at the same relative path under :attr:`root` (default
        ``/dev/shm/tiercheck/<job_id>/<node>``, see :func:`default_root`). Folders are created
        with mode ``0700`` and files with ``0600``, whatever the umask: checkpoints may hold
        anything a model was trained on. A key cannot also be the folder of another key
        (``a`` and ``a/b``); such a put raises :class:`~tiercheck.errors.StorageError`. Names
        with ``#`` (never valid in keys) belong to the tier itself: temporary files and spares.

    Writes
        ``put``/``putv`` write the caller's buffers straight into a temporary file (no join, no
        intermediate copy) and rename it over the key (see :mod:`tiercheck.tiers._atomic`).
        :meth:`reserve` hands out the temporary file itself, mapped into memory, so that a
        snapshot copied into it *is* the blob once committed. ``fsync=True`` syncs files and
        folders, for a ``root`` on a disk; memory needs no syncing. All file work runs in
        worker threads, never on the event loop.

    Reads
        ``get`` returns a private, writable ``memoryview`` (read once from the file) because
        the file may be replaced or recycled afterwards. A get holds a shared ``flock`` on the
        file while it reads, which keeps the file from being recycled under it.

    Capacity
        With ``capacity`` (bytes), a put or reserve that would make the stored total (every
        blob this instance knows of, plus writes in flight) exceed it raises
        :class:`~tiercheck.errors.TierFull` before anything is written. An overwrite counts the
        new size in place of the old one; while it is in flight both exist for a moment.
        :attr:`usage` is that stored total. The count starts from a scan of :attr:`root` at first
        use and then follows this instance's own puts and deletes: several processes sharing one
        root each keep their own count and do not see each other's later writes (call
        :meth:`refresh_usage` to rescan). Memory kept ready by :meth:`prepare` counts as in
        flight until a reserve takes it; a write that fits only without it drops it instead of
        raising.

        A full filesystem raises :class:`~tiercheck.errors.TierFull` too, and never kills the
        process with ``SIGBUS``. Memory handed out to be written through a mapping
        (:meth:`reserve`, :meth:`prepare`) is allocated in full (``posix_fallocate``) before it
        is mapped, so a tmpfs that cannot hold it (Docker's default ``/dev/shm`` is 64 MB)
        answers ``ENOSPC`` before any byte is copied, instead of faulting on the first copy into
        the buffer. A recycled file that grows gets its new pages the same way before it is
        written (the pages it has are not allocated again); a put into a new file learns of
        ``ENOSPC`` from ``write``, which cannot fault. On failure the temporary file (recycled
        or not) is removed, :attr:`usage` is as before and the key keeps its previous blob.
        Spares and prepared memory occupy the filesystem: when it is full they are dropped and
        the write is tried once more before it fails. Where the filesystem cannot preallocate
        (``posix_fallocate`` unsupported), files are only sized, the tier logs that once, and a
        full filesystem there may still show only when the memory is written.

    Recycling
        Filling freshly created shared-memory pages costs a page fault and a zeroed page per
        4 KiB; refilling pages that exist runs at memory-copy speed. So when a blob is deleted,
        its file may be kept as a *spare* (at most ``spare_files`` of them, hidden in
        ``<root>/.tiercheck#spares``), and the next put or reserve refills a spare instead of a
        new file. Spares are memory held: :attr:`spare_bytes` counts them, and with a
        ``capacity`` the tier keeps ``usage + spare_bytes <= capacity`` by dropping spares
        (largest first) as soon as room is needed; they never cause ``TierFull``. A file is only
        recycled if nobody can still read it: deletion takes an exclusive, non-blocking
        ``flock`` on it, which fails while a ``get`` (in any process) reads it or while a
        committed :class:`LocalReservation` that has not been released maps it; such a file is
        simply removed (its pages live on until the last reader lets go). ``spare_files=0``
        turns recycling off. Spares and temporary files left by a process that died are removed
        by the next instance that opens the root.

    ``populate=True`` pre-faults a reservation's pages when mapping it (``MAP_POPULATE``), inside
    :meth:`reserve`'s worker thread, so that the copy into the buffer runs at memory speed. (It
    cannot report a page the filesystem refuses; allocating the file first does, see
    "Capacity".)

    Linux (and other POSIX systems with ``flock``) only. Thread-safe; one instance may be used
    from one event loop at a time.
    """

    name = "local"
    survives = FailureScope.PROCESS

    @classmethod
    def for_job(cls, setup: TierSetup) -> LocalTier:
        """The node's local tier of a checkpointer: blobs under its shared-memory folder."""
        return cls(NodeRoot(setup.node_root).blobs, capacity=setup.local_capacity)

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        *,
        job_id: str = "default",
        node: str | None = None,
        capacity: int | None = None,
        spare_files: int = 4,
        fsync: bool = False,
        populate: bool = True,
        name: str = "local",
    ) -> None:
        if capacity is not None and (
            not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 0
        ):
            raise ConfigError(f"capacity must be a number of bytes >= 0 or None, got {capacity!r}")
        if not isinstance(spare_files, int) or isinstance(spare_files, bool) or spare_files < 0:
            raise ConfigError(f"spare_files must be an int >= 0, got {spare_files!r}")
        self._default_root = root is None
        resolved = default_root(job_id, node) if root is None else Path(root)
        self._root = os.path.abspath(os.fspath(resolved))
        self._spares_dir = os.path.join(self._root, _SPARES_DIR)
        self.name = name
        self._capacity = capacity
        self._spare_limit = spare_files
        self._fsync = fsync
        self._populate = populate

        # Guards the accounting below; held only for dictionary work and renames, never for
        # data transfer, so event-loop code that reads the properties never waits long.
        self._lock = threading.Lock()
        self._scan_lock = threading.Lock()
        self._scanned = False
        self._sizes: dict[str, int] = {}
        self._stored = 0
        self._pending = 0
        self._spares: list[_Spare] = []
        self._prepared: _Prepared | None = None
        self._spare_bytes = 0
        self._reservations: set[LocalReservation] = set()
        # Turned off for good, for this root, the first time its filesystem cannot preallocate.
        self._fallocate_ok = _posix_fallocate() is not None

    def __repr__(self) -> str:
        return f"LocalTier(root={self._root!r})"

    # --- properties ---------------------------------------------------------------------------

    @property
    def root(self) -> Path:
        """The folder that holds this tier's blobs."""
        return Path(self._root)

    @property
    def capacity(self) -> int | None:
        """The configured capacity in bytes, or ``None`` for no limit."""
        return self._capacity

    @property
    def usage(self) -> int:
        """Bytes of stored blobs plus writes in flight, as this instance counts them.

        Zero until the first operation has scanned the root.
        """
        with self._lock:
            return self._stored + self._pending

    @property
    def spare_bytes(self) -> int:
        """Bytes held in spare files kept for recycling (see the class docstring)."""
        with self._lock:
            return self._spare_bytes

    @property
    def spare_count(self) -> int:
        """Number of spare files kept for recycling."""
        with self._lock:
            return len(self._spares)

    # --- the Tier interface -------------------------------------------------------------------

    async def put(self, key: str, data: Buffer) -> None:
        """Store ``data`` under ``key`` atomically (temporary file, then rename)."""
        self._check_key(key)
        # The views are left to the garbage collector, not released: if this coroutine is
        # cancelled, the worker thread may still be writing from them.
        view = _atomic.as_byte_view(data)
        await self._run("put", key, self._put_sync, key, (view,))

    async def putv(self, key: str, parts: Sequence[Buffer]) -> None:
        """Store the concatenation of ``parts``, writing each part in turn (no join)."""
        self._check_key(key)
        views = [_atomic.as_byte_view(part) for part in parts]
        await self._run("put", key, self._put_sync, key, views)

    async def get(self, key: str) -> memoryview:
        """Return a private, writable copy of the blob under ``key``."""
        self._check_key(key)
        return await self._run("get", key, self._get_sync, key)

    async def get_size(self, key: str) -> int:
        """Size of the blob under ``key`` (one ``stat``)."""
        self._check_key(key)
        return await self._run("get_size", key, self._size_sync, key)

    async def exists(self, key: str) -> bool:
        """Whether a blob is stored under ``key``."""
        self._check_key(key)
        return await self._run("exists", key, self._exists_sync, key)

    async def delete(self, key: str) -> None:
        """Remove the blob under ``key`` (idempotent); its file may be kept as a spare."""
        self._check_key(key)
        await self._run("delete", key, self._delete_sync, key)

    async def list(self, prefix: str = "") -> AsyncIterator[str]:
        """Yield every stored key that starts with ``prefix``.

        ``prefix`` is a plain string prefix; its complete segments (before the last ``/``) must
        form a valid key, otherwise :class:`~tiercheck.errors.InvalidKey` is raised.
        """
        self._check_open()
        if not isinstance(prefix, str):
            raise InvalidKey(f"a prefix must be a str, got {type(prefix).__name__}")
        head, _partial = _atomic.split_prefix(prefix)
        if head:
            validate_key(head)
        keys = await self._run("list", prefix, self._list_sync, head, prefix)
        for key in keys:
            yield key

    async def reserve(self, key: str, nbytes: int) -> LocalReservation:
        """Hand out ``nbytes`` of shared memory that becomes the blob ``key`` once committed.

        The buffer's initial contents are unspecified (a recycled file still holds old bytes):
        fill all of it. See :class:`LocalReservation` for the rest of the lifecycle. Counts
        against the capacity from now on; raises :class:`~tiercheck.errors.TierFull` if it does
        not fit.
        """
        self._check_key(key)
        if not isinstance(nbytes, int) or isinstance(nbytes, bool):
            raise TypeError(f"nbytes must be an int, got {type(nbytes).__name__}")
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        # Prepared memory is handed out without any I/O (no thread hop either): this is on
        # the caller's critical path, the snapshot.
        ready = self._take_prepared(key, nbytes) if self._scanned else None
        if ready is not None:
            return ready
        return await self._run("reserve", key, self._reserve_sync, key, nbytes)

    async def prepare(self, nbytes: int) -> bool:
        """Make memory ready for a coming :meth:`reserve` of exactly ``nbytes`` bytes.

        Sizing a file and mapping its pages is most of what a reserve costs. Done here, ahead
        of time and off the caller's critical path, the next ``reserve(key, nbytes)`` only
        renames a file. At most one region is kept ready; it counts against the capacity like
        a reservation, until a write of another size needs its room. The memory is allocated
        here, in full (see "Capacity" in :class:`LocalTier`). Returns ``False`` (and prepares
        nothing) when it would not fit, in the capacity or in the filesystem.
        """
        self._check_open()
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
            raise ValueError(f"nbytes must be an int >= 0, got {nbytes!r}")
        return await self._run("prepare", "", self._prepare_sync, nbytes)

    async def refresh_usage(self) -> int:
        """Rescan :attr:`root` and recount :attr:`usage` from what is there now; return it.

        Picks up blobs written or removed by other processes sharing the root. Call it while
        this instance has no put or delete in flight: those may be counted twice or not at all.
        """
        self._check_open()
        return await self._run("refresh_usage", "", self._refresh_sync)

    async def aclose(self) -> None:
        """Close the tier: abort uncommitted reservations and free spares. Blobs stay stored.

        Committed reservations stay readable until released.
        """
        if self._closed:
            return
        await super().aclose()
        await self._run("aclose", "", self._close_sync)

    # --- running blocking work ----------------------------------------------------------------

    async def _run(self, op: str, key: str, fn: Callable[..., _T], *args: object) -> _T:
        try:
            return await asyncio.to_thread(fn, *args)
        except TiercheckError:
            raise
        except OSError as exc:
            raise self._os_error(op, key, exc) from exc

    def _os_error(self, op: str, key: str, exc: OSError) -> TiercheckError:
        where = f"{op} of key {key!r} in the local tier at {self._root}"
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return TierFull(
                f"{where}: the filesystem is full ({exc.strerror}); nothing was written. "
                "Free memory (delete old versions) or give the tier a larger root (in a "
                "container, a larger /dev/shm: docker run --shm-size=...)."
            )
        if isinstance(exc, (NotADirectoryError, IsADirectoryError)):
            return StorageError(
                f"{where} failed: a key cannot be both a blob and the folder of other keys "
                f"(like 'a' and 'a/b') in a filesystem-backed tier ({exc})"
            )
        return StorageError(f"{where} failed: {exc}")

    # --- setup --------------------------------------------------------------------------------

    def _ensure_scanned(self) -> None:
        if self._scanned:
            return
        with self._scan_lock:
            self._scan_once()

    def _scan_once(self) -> None:
        """Under the scan lock: create the root and count what it holds, the first time."""
        if self._scanned:
            # Another thread did it while this one waited for the lock.
            return
        _atomic.make_dirs(self._root, _DIR_MODE)
        self._check_root()
        sizes = self._scan_sync()
        with self._lock:
            self._sizes = sizes
            self._stored = sum(sizes.values())
        self._scanned = True

    def _check_root(self) -> None:
        st = os.lstat(self._root)
        if not stat.S_ISDIR(st.st_mode):
            raise StorageError(f"the local tier's root {self._root} is not a folder")
        # A shared /dev/shm lets anyone create our default folder before us; refuse to store
        # checkpoints in a folder someone else owns.
        if self._default_root and st.st_uid != os.getuid():
            raise StorageError(
                f"the local tier's root {self._root} belongs to uid {st.st_uid}, not to this "
                f"user (uid {os.getuid()}); pass root= or another job_id"
            )

    def _scan_sync(self) -> dict[str, int]:
        """Sizes of every blob under the root; removes debris of dead processes on the way."""
        sizes: dict[str, int] = {}
        stack = [self._root]
        while stack:
            folder = stack.pop()
            try:
                entries = list(os.scandir(folder))
            except (FileNotFoundError, NotADirectoryError):
                continue
            for entry in entries:
                try:
                    is_dir = entry.is_dir(follow_symlinks=False)
                    is_file = entry.is_file(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if is_dir:
                    stack.append(entry.path)
                elif is_file and _atomic.is_internal_name(entry.name):
                    if _atomic.owned_by_dead_process(entry.name):
                        _atomic.discard(entry.path)
                elif is_file:
                    key = os.path.relpath(entry.path, self._root)
                    if _valid_key(key):
                        with contextlib.suppress(FileNotFoundError):
                            sizes[key] = entry.stat(follow_symlinks=False).st_size
        return sizes

    def _refresh_sync(self) -> int:
        self._ensure_scanned()
        sizes = self._scan_sync()
        with self._lock:
            self._sizes = sizes
            self._stored = sum(sizes.values())
            return self._stored + self._pending

    # --- accounting -----------------------------------------------------------------------------

    def _claim(self, key: str, nbytes: int) -> _Spare | None:
        """Count ``nbytes`` as in flight (or raise TierFull); take a spare to refill if any.

        Memory held only to be fast never makes a write fail: the prepared region is given up
        when that makes room, and spares are dropped (largest first) as long as room is needed.
        """
        victims: list[_Spare] = []
        dropped: _Prepared | None = None
        with self._lock:
            if self._capacity is not None:
                after = self._stored - self._sizes.get(key, 0) + self._pending + nbytes
                prepared = self._prepared
                if (
                    after > self._capacity
                    and prepared is not None
                    and after - prepared.nbytes <= self._capacity
                ):
                    # Dropped only where that makes room: a write that fails anyway leaves it
                    # to serve the next reserve of its size.
                    self._prepared = None
                    self._pending -= prepared.nbytes
                    after -= prepared.nbytes
                    dropped = prepared
                if after > self._capacity:
                    raise TierFull(
                        f"storing {nbytes} bytes under {key!r} would bring the local tier at "
                        f"{self._root} to {after} bytes, over its capacity of "
                        f"{self._capacity}; nothing was written. Delete old versions first."
                    )
            spare = self._take_spare(nbytes) if nbytes > 0 else None
            if self._capacity is not None:
                # Spares are droppable: keep blobs + spares within capacity, largest first.
                self._spares.sort(key=lambda s: s.size)
                while self._spares and after + self._spare_bytes > self._capacity:
                    victim = self._spares.pop()
                    self._spare_bytes -= victim.size
                    victims.append(victim)
            self._pending += nbytes
        if dropped is not None:
            self._free_prepared(dropped)
        for victim in victims:
            _atomic.discard(victim.path)
        return spare

    def _take_spare(self, nbytes: int) -> _Spare | None:
        """Under the lock: the smallest spare that fits ``nbytes``, else the largest one."""
        if not self._spares:
            return None
        fitting = [s for s in self._spares if s.size >= nbytes]
        if fitting:
            chosen = min(fitting, key=lambda s: s.size)
        else:
            chosen = max(self._spares, key=lambda s: s.size)
        self._spares.remove(chosen)
        self._spare_bytes -= chosen.size
        return chosen

    def _unclaim(self, nbytes: int) -> None:
        with self._lock:
            self._pending -= nbytes

    def _drop_held_memory(self) -> bool:
        """Free the prepared region and every spare; whether there was any to free.

        Both are memory kept only to make the next write faster, and both occupy the
        filesystem: when it is full, a write needs their room more.
        """
        with self._lock:
            prepared, self._prepared = self._prepared, None
            spares, self._spares = self._spares, []
            self._spare_bytes = 0
        if prepared is not None:
            self._drop_prepared(prepared)
        for spare in spares:
            _atomic.discard(spare.path)
        return prepared is not None or bool(spares)

    def _retry_when_full(self, attempt: Callable[[], _T]) -> _T:
        """Run ``attempt``; if the filesystem is full, free held memory and run it once more.

        ``attempt`` must leave nothing behind when it fails (files, accounting).
        """
        try:
            return attempt()
        except OSError as exc:
            # TierFull (an OSError) is the capacity talking, which _claim already handled.
            if isinstance(exc, TiercheckError) or exc.errno not in _FULL_ERRNOS:
                raise
            if not self._drop_held_memory():
                raise
        return attempt()

    def _size_and_back(self, fd: int, nbytes: int) -> None:
        """Make the file behind ``fd`` ``nbytes`` long, with storage held for every byte.

        A file that is going to be mapped must be backed before any page of it is touched:
        where the filesystem (a full tmpfs) cannot give a page to a shared mapping, the
        process that touches it dies of SIGBUS (and ``MAP_POPULATE`` fails silently), whereas
        ``posix_fallocate`` fails here with ``ENOSPC``, which is :class:`TierFull`. Pages a
        recycled file already holds are not allocated again: ``st_blocks`` tells whether every
        byte kept is backed (an ``fstat``: microseconds, where allocating the present pages of
        256 MiB anew costs 4-6 ms, a quarter to a third of a recycled reserve, on the save's
        critical path). Where the filesystem cannot preallocate at all, the file is only sized.
        """
        old_size = os.fstat(fd).st_size
        if old_size != nbytes:
            os.ftruncate(fd, nbytes)
        fallocate = _posix_fallocate()
        if nbytes == 0 or not self._fallocate_ok or fallocate is None:
            return
        kept = min(old_size, nbytes)
        # A file whose allocated blocks cover its kept bytes has no hole in them: only the
        # growth needs storage. (tmpfs frees the pages past a shrunken end at once.)
        start = kept if kept and os.fstat(fd).st_blocks * 512 >= kept else 0
        if start >= nbytes:
            return
        try:
            fallocate(fd, start, nbytes - start)
        except OSError as exc:
            if exc.errno not in _NO_FALLOCATE_ERRNOS:
                raise
            self._fallocate_ok = False
            logger.info(
                "tiercheck: the filesystem of the local tier at %s cannot preallocate files "
                "(%s); files are sized without it, so a full filesystem there may be noticed "
                "only when memory is written",
                self._root,
                exc.strerror,
            )

    def _publish(self, key: str, temp_path: str, target: str, nbytes: int) -> None:
        """Rename a finished temporary file over ``key`` and move its bytes to stored."""
        with self._lock:
            _atomic.publish(temp_path, target)
            self._pending -= nbytes
            self._stored += nbytes - self._sizes.get(key, 0)
            self._sizes[key] = nbytes

    def _open_temp(self, directory: str, spare: _Spare | None) -> tuple[int, str]:
        if spare is not None:
            try:
                return _atomic.adopt_temp(spare.path, directory, dir_mode=_DIR_MODE)
            except FileNotFoundError:
                # Removed behind our back (a cleanup by another process); use a fresh file.
                pass
        return _atomic.create_temp(directory, file_mode=_FILE_MODE, dir_mode=_DIR_MODE)

    def _keep_or_remove(self, path: str) -> None:
        """Keep the unreachable file ``path`` as a spare if nobody can read it; else remove it."""
        if self._spare_limit == 0 or self._closed:
            _atomic.discard(path)
            return
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                # A reader or a live reservation still has it: its pages must not be reused.
                locked = False
            else:
                locked = True
            size = os.fstat(fd).st_size
            if locked and size > 0:
                _atomic.make_dirs(self._spares_dir, _DIR_MODE)
                spare_path = os.path.join(self._spares_dir, _atomic.temp_name())
                os.rename(path, spare_path)
                victims: list[_Spare] = []
                with self._lock:
                    self._spares.append(_Spare(spare_path, size))
                    self._spare_bytes += size
                    if len(self._spares) > self._spare_limit:
                        self._spares.sort(key=lambda s: s.size)
                        victims.append(self._spares.pop(0))
                        self._spare_bytes -= victims[0].size
                for victim in victims:
                    _atomic.discard(victim.path)
                return
        finally:
            os.close(fd)
        _atomic.discard(path)

    # --- blocking operations (run in worker threads) --------------------------------------------

    def _path(self, key: str) -> str:
        return os.path.join(self._root, key)

    def _put_sync(self, key: str, views: Sequence[memoryview]) -> None:
        self._ensure_scanned()
        self._retry_when_full(lambda: self._put_once(key, views))
        if self._fsync:
            _atomic.fsync_dir_of(self._path(key))

    def _put_once(self, key: str, views: Sequence[memoryview]) -> None:
        nbytes = sum(view.nbytes for view in views)
        target = self._path(key)
        spare = self._claim(key, nbytes)
        temp_path: str | None = None
        try:
            fd, temp_path = self._open_temp(os.path.dirname(target), spare)
            try:
                if spare is not None:
                    # A fresh file needs no backing (write reports ENOSPC, it cannot fault);
                    # a recycled one that grows gets its new pages before a byte is copied.
                    self._size_and_back(fd, nbytes)
                _atomic.write_all(fd, views)
                if self._fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            self._publish(key, temp_path, target, nbytes)
        except BaseException:
            if temp_path is not None:
                _atomic.discard(temp_path)
            self._unclaim(nbytes)
            raise

    def _get_sync(self, key: str) -> memoryview:
        self._ensure_scanned()
        path = self._path(key)
        for _ in range(_READ_ATTEMPTS):
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except (FileNotFoundError, NotADirectoryError):
                raise BlobNotFound(f"no blob {key!r} in the local tier at {self._root}") from None
            try:
                # Shared lock first, then check the name still leads to this file: from then on
                # it can be neither recycled (that needs an exclusive lock) nor written.
                fcntl.flock(fd, fcntl.LOCK_SH)
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise BlobNotFound(
                        f"no blob {key!r} in the local tier at {self._root} (it is a folder)"
                    )
                try:
                    now = os.stat(path)
                except (FileNotFoundError, NotADirectoryError):
                    raise BlobNotFound(
                        f"no blob {key!r} in the local tier at {self._root} (deleted)"
                    ) from None
                if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                    continue
                if st.st_size >= _MAP_READS_FROM:
                    return _map_private(fd, st.st_size)
                return _read_exactly(fd, st.st_size)
            finally:
                os.close(fd)
        raise StorageError(
            f"reading {key!r} from the local tier at {self._root} failed: it was replaced "
            f"{_READ_ATTEMPTS} times while being opened"
        )

    def _size_sync(self, key: str) -> int:
        self._ensure_scanned()
        try:
            st = os.stat(self._path(key))
        except (FileNotFoundError, NotADirectoryError):
            raise BlobNotFound(f"no blob {key!r} in the local tier at {self._root}") from None
        if not stat.S_ISREG(st.st_mode):
            raise BlobNotFound(f"no blob {key!r} in the local tier at {self._root} (a folder)")
        return st.st_size

    def _exists_sync(self, key: str) -> bool:
        self._ensure_scanned()
        try:
            st = os.stat(self._path(key))
        except (FileNotFoundError, NotADirectoryError):
            return False
        return stat.S_ISREG(st.st_mode)

    def _delete_sync(self, key: str) -> None:
        self._ensure_scanned()
        path = self._path(key)
        folder = os.path.dirname(path)
        private = os.path.join(folder, _atomic.temp_name())
        with self._lock:
            try:
                st = os.lstat(path)
            except (FileNotFoundError, NotADirectoryError):
                self._forget(key)
                return
            if not stat.S_ISREG(st.st_mode):
                # A folder: the key is only a prefix of other keys, there is no blob to delete.
                return
            # Take the file off its key name first; afterwards no new reader can open it, so
            # the lock test in _keep_or_remove cannot be overtaken.
            try:
                os.rename(path, private)
            except FileNotFoundError:
                self._forget(key)
                return
            self._forget(key)
        try:
            self._keep_or_remove(private)
        except BaseException:
            _atomic.discard(private)
            raise
        _atomic.prune_empty_dirs(folder, self._root)

    def _forget(self, key: str) -> None:
        """Under the lock: the blob under ``key`` is gone."""
        self._stored -= self._sizes.pop(key, 0)

    def _list_sync(self, head: str, prefix: str) -> Sequence[str]:
        self._ensure_scanned()
        start = os.path.join(self._root, head) if head else self._root
        return [key for key in _walk_keys(self._root, start) if key.startswith(prefix)]

    def _prepare_sync(self, nbytes: int) -> bool:
        self._ensure_scanned()
        with self._lock:
            current = self._prepared
            if current is not None and current.nbytes == nbytes:
                return True
            self._prepared = None
        if current is not None:
            self._drop_prepared(current)
        if nbytes == 0:
            return True
        try:
            prepared = self._retry_when_full(lambda: self._prepare_once(nbytes))
        except TierFull:
            return False
        except OSError as exc:
            if exc.errno in _FULL_ERRNOS:
                return False  # the filesystem is full: nothing prepared, nothing left behind
            raise
        with self._lock:
            if self._prepared is None and not self._closed:
                self._prepared = prepared
                return True
        self._drop_prepared(prepared)  # lost a race with another prepare, or closed meanwhile
        return True

    def _prepare_once(self, nbytes: int) -> _Prepared:
        spare = self._claim("", nbytes)
        fd = -1
        path: str | None = None
        try:
            fd, path = self._open_temp(self._spares_dir, spare)
            self._size_and_back(fd, nbytes)
            flags = mmap.MAP_SHARED | (_MAP_POPULATE if self._populate else 0)
            mapping = mmap.mmap(fd, nbytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            if path is not None:
                _atomic.discard(path)
            self._unclaim(nbytes)
            raise
        return _Prepared(fd, path, mapping, memoryview(mapping), nbytes)

    def _drop_prepared(self, prepared: _Prepared) -> None:
        """Free the prepared region and give back the bytes it counted as in flight."""
        self._free_prepared(prepared)
        self._unclaim(prepared.nbytes)

    @staticmethod
    def _free_prepared(prepared: _Prepared) -> None:
        prepared.view.release()
        prepared.mapping.close()
        os.close(prepared.fd)
        _atomic.discard(prepared.path)

    def _take_prepared(self, key: str, nbytes: int) -> LocalReservation | None:
        """A reservation made of the prepared memory, if it has the right size (no I/O).

        Its file stays in the hidden spares folder until the commit renames it over the key.
        """
        with self._lock:
            prepared = self._prepared
            if prepared is None or prepared.nbytes != nbytes or nbytes == 0 or self._closed:
                return None
            self._prepared = None
        reservation = LocalReservation(
            self,
            key=key,
            target=self._path(key),
            temp_path=prepared.path,
            fd=prepared.fd,
            mapping=prepared.mapping,
            view=prepared.view,
        )
        with self._lock:
            self._reservations.add(reservation)
        return reservation

    def _reserve_sync(self, key: str, nbytes: int) -> LocalReservation:
        self._ensure_scanned()
        ready = self._take_prepared(key, nbytes)
        if ready is not None:
            return ready
        return self._retry_when_full(lambda: self._reserve_once(key, nbytes))

    def _reserve_once(self, key: str, nbytes: int) -> LocalReservation:
        target = self._path(key)
        spare = self._claim(key, nbytes)
        fd = -1
        temp_path: str | None = None
        mapping: mmap.mmap | None = None
        view: memoryview | None = None
        try:
            fd, temp_path = self._open_temp(os.path.dirname(target), spare)
            # Backed before it is mapped: the caller copies straight into these pages.
            self._size_and_back(fd, nbytes)
            if nbytes:
                flags = mmap.MAP_SHARED | (_MAP_POPULATE if self._populate else 0)
                mapping = mmap.mmap(fd, nbytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
                view = memoryview(mapping)
            else:
                view = memoryview(bytearray())
            reservation = LocalReservation(
                self,
                key=key,
                target=target,
                temp_path=temp_path,
                fd=fd,
                mapping=mapping,
                view=view,
            )
        except BaseException:
            if view is not None:
                view.release()
            if mapping is not None:
                mapping.close()
            if fd >= 0:
                os.close(fd)
            if temp_path is not None:
                _atomic.discard(temp_path)
            self._unclaim(nbytes)
            raise
        with self._lock:
            self._reservations.add(reservation)
        return reservation

    def _commit_sync(self, reservation: LocalReservation) -> None:
        # The state changes here, in the worker, so that a commit cancelled before its worker
        # started leaves the reservation open, and so that release() can tell a running commit.
        with self._lock:
            if reservation._state != _OPEN:
                raise RuntimeError(
                    f"cannot commit {reservation!r}: only an open reservation can be committed"
                )
            reservation._state = _COMMITTING
        try:
            if self._fsync:
                if reservation._mapping is not None:
                    reservation._mapping.flush()
                os.fsync(reservation._fd)
            # Held until release: while it is, deleting the key cannot recycle the file that
            # the caller may still be reading through the buffer.
            fcntl.flock(reservation._fd, fcntl.LOCK_SH)
            target_dir = os.path.dirname(reservation._target)
            if os.path.dirname(reservation._temp_path) != target_dir:
                _atomic.make_dirs(target_dir, _DIR_MODE)  # prepared memory lives elsewhere
            self._publish(
                reservation.key, reservation._temp_path, reservation._target, reservation.nbytes
            )
        except BaseException:
            with self._lock:
                reservation._state = _OPEN
            raise
        with self._lock:
            reservation._state = _COMMITTED
        if self._fsync:
            _atomic.fsync_dir_of(reservation._target)

    def _abort_sync(self, reservation: LocalReservation, *, releasing: bool = False) -> None:
        with self._lock:
            if reservation._state == _ABORTED or (releasing and reservation._state == _COMMITTED):
                return
            if reservation._state != _OPEN:
                raise RuntimeError(f"cannot abort {reservation!r}: it is {reservation._state}")
            reservation._state = _ABORTED
            self._pending -= reservation.nbytes
        _atomic.discard(reservation._temp_path)

    def _released(self, reservation: LocalReservation) -> None:
        with self._lock:
            self._reservations.discard(reservation)

    def _close_sync(self) -> None:
        with self._lock:
            prepared, self._prepared = self._prepared, None
        if prepared is not None:
            self._drop_prepared(prepared)
        with self._lock:
            victims = [s.path for s in self._spares]
            self._spares.clear()
            self._spare_bytes = 0
            uncommitted = [r for r in self._reservations if r._state == _OPEN]
        for reservation in uncommitted:
            with contextlib.suppress(RuntimeError):
                # Raced with its own commit, which then owns it.
                self._abort_sync(reservation)
        for path in victims:
            _atomic.discard(path)


def _walk_keys(root: str, start: str) -> Iterator[str]:
    """Every blob key at or below folder ``start`` (skips the tier's own files and folders)."""
    stack = [start]
    while stack:
        folder = stack.pop()
        try:
            entries = list(os.scandir(folder))
        except (FileNotFoundError, NotADirectoryError):
            # Pruned by a concurrent delete, or the prefix names a blob: nothing below it.
            continue
        for entry in entries:
            if _atomic.is_internal_name(entry.name):
                continue
            try:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                    continue
                if not entry.is_file(follow_symlinks=False):
                    continue
            except FileNotFoundError:
                continue
            key = os.path.relpath(entry.path, root)
            if _valid_key(key):
                yield key


def _read_exactly(fd: int, size: int) -> memoryview:
    """Read ``size`` bytes from the start of ``fd`` into new private memory (one copy).

    Large blobs land in anonymous memory: allocating it is instant and its pages are zeroed by
    the kernel inside the read, with the GIL released. A ``bytearray`` would be zero-filled by
    Python while holding the GIL, stalling the event loop for the whole time.
    """
    memory: bytearray | mmap.mmap = (
        mmap.mmap(-1, size) if size >= _ANONYMOUS_FROM else bytearray(size)
    )
    view = memoryview(memory)
    done = 0
    while done < size:
        got = os.preadv(fd, [view[done:]], done)
        if got == 0:
            raise OSError(errno.EIO, f"file ended after {done} of {size} bytes")
        done += got
    return view


class LocalReservation:
    """Shared memory that becomes a blob of the :class:`LocalTier` when committed.

    Returned by :meth:`LocalTier.reserve`; implements :class:`~tiercheck.tiers.Reservation`.

    1. Fill :attr:`buffer` completely (for example ``torch.frombuffer(r.buffer, dtype=...)``
       and ``copy_`` into it). Until commit, readers of the key see the previous blob or none.
    2. ``await commit()`` publishes it atomically, or ``await abort()`` discards it.
    3. The buffer stays readable after commit; call :meth:`release` when done with it. The
       memory stays mapped as long as any view or tensor made from the buffer lives, and while
       it is mapped, deleting the key never lets the file be recycled under it.

    ``release()`` without commit or abort discards the temporary file inline (a file removal
    on the calling thread; prefer ``await abort()`` on an event loop).
    """

    __slots__ = (
        "__weakref__",
        "_fd",
        "_key",
        "_mapping",
        "_nbytes",
        "_released_flag",
        "_state",
        "_target",
        "_temp_path",
        "_tier",
        "_view",
    )

    def __init__(
        self,
        tier: LocalTier,
        *,
        key: str,
        target: str,
        temp_path: str,
        fd: int,
        mapping: mmap.mmap | None,
        view: memoryview,
    ) -> None:
        self._tier = tier
        self._key = key
        self._target = target
        self._temp_path = temp_path
        self._fd = fd
        self._mapping = mapping
        self._view = view
        self._nbytes = view.nbytes
        self._state = _OPEN
        self._released_flag = False
        if mapping is None:
            # Nothing maps the (empty) file: the descriptor only has to outlive commit.
            weakref.finalize(self, os.close, fd)
        else:
            weakref.finalize(mapping, os.close, fd)

    def __repr__(self) -> str:
        return f"LocalReservation(key={self._key!r}, nbytes={self._nbytes}, state={self._state})"

    @property
    def key(self) -> str:
        """The key the buffer is published under on commit."""
        return self._key

    @property
    def nbytes(self) -> int:
        """Size of the buffer, and of the blob it becomes."""
        return self._nbytes

    @property
    def buffer(self) -> memoryview:
        """The writable memory (``B`` format). Invalid after :meth:`release`."""
        if self._released_flag:
            raise ValueError(f"{self!r} was released; its buffer is gone")
        return self._view

    @property
    def committed(self) -> bool:
        """Whether :meth:`commit` has completed."""
        return self._state == _COMMITTED

    async def commit(self) -> None:
        """Publish the buffer as the blob under :attr:`key`, atomically.

        Raises :class:`RuntimeError` if the reservation is not open (committed, aborted or
        released already) and :class:`~tiercheck.errors.TierClosed` after the tier was closed.
        """
        self._tier._check_open()
        if self._state != _OPEN or self._released_flag:
            raise RuntimeError(f"cannot commit {self!r}: only an open reservation can be")
        await self._tier._run("commit", self._key, self._tier._commit_sync, self)

    async def abort(self) -> None:
        """Discard the reservation; the key keeps its previous blob (or none). Idempotent.

        Raises :class:`RuntimeError` once committed.
        """
        if self._state == _ABORTED:
            return
        if self._state != _OPEN:
            raise RuntimeError(f"cannot abort {self!r}: it is {self._state}")
        await self._tier._run("abort", self._key, self._tier._abort_sync, self)

    def release(self) -> None:
        """Give the buffer back; the file may be recycled once its key is deleted.

        Idempotent. Tensors and views made from the buffer stay valid: the memory is unmapped
        (and the file becomes recyclable) when the last of them is gone.
        """
        if self._released_flag:
            return
        # Discards the file if neither committed nor aborted; raises while a commit runs.
        self._tier._abort_sync(self, releasing=True)
        self._released_flag = True
        # Never unmap explicitly: torch.frombuffer and friends keep a reference to the view
        # object but no buffer export, so an explicit munmap would leave their tensors
        # pointing at freed memory. Dropping our references unmaps at once if nobody else
        # holds the view, or later when the last tensor goes; the finalizer registered in
        # __init__ then closes the file, which drops the lock that keeps it from recycling.
        self._view = memoryview(b"")
        self._mapping = None
        self._tier._released(self)
