"""The local tier's space: what it stores and holds, against its capacity and the filesystem.

Counts stored bytes and writes in flight against the capacity, keeps deleted files as spares
for recycling and one region of prepared memory, and sizes files with storage behind every
byte (``posix_fallocate``) so that a full filesystem is a :class:`~tiercheck.errors.TierFull`
as soon as memory is reserved, not once it is filled. See "Capacity" and "Recycling" in
:class:`~tiercheck.tiers.local.LocalTier`.

Two layers of the tier's class: :class:`_Accounting` keeps the counts (and the read-outs
:attr:`~tiercheck.tiers.local.LocalTier.usage`, ``spare_bytes``...), :class:`_Space` the files
as the counts see them (sizing and backing, publishing, spares in and out).
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from tiercheck.errors import StorageError, TiercheckError, TierFull
from tiercheck.tiers import atomic
from tiercheck.tiers.local.files import (
    DIR_MODE,
    FILE_MODE,
    FULL_ERRNOS,
    NO_FALLOCATE_ERRNOS,
    posix_fallocate,
    scan_sizes,
)
from tiercheck.tiers.local.memory import MemoryPool

_T = TypeVar("_T")

# Seconds a write waits at most for room that files being removed are about to free.
_LEAVING_WAIT = 30.0

logger = logging.getLogger("tiercheck")


@dataclass(slots=True)
class _Spare:
    """A file kept after its blob was deleted, to be refilled by a later put or reserve."""

    path: str
    size: int


@dataclass(eq=False)
class _Prepared:
    """Made ready ahead of a reserve: a sized, backed hidden file and the memory to fill
    (``None`` for a small size, which gets a ``bytearray``)."""

    fd: int
    path: str
    memory: mmap.mmap | None
    nbytes: int


class _Accounting:
    """The local tier's accounting of stored, in-flight, spare and prepared bytes.

    A part of :class:`~tiercheck.tiers.local.LocalTier` (which sets these attributes up);
    the methods run in worker threads, the properties anywhere.
    """

    _root: str
    _spares_dir: str
    _sweep: bool
    _default_root: bool
    _capacity: int | None
    _spare_limit: int
    _closed: bool
    _lock: threading.Lock
    _left: threading.Condition  # on _lock: notified when bytes stop leaving
    _scan_lock: threading.Lock
    _scanned: bool
    _sizes: dict[str, int]
    _stored: int
    _pending: int
    _spares: list[_Spare]
    _prepared: _Prepared | None
    _spare_bytes: int
    # Bytes of files no longer counted as blobs, spares or in flight but not removed yet: they
    # still occupy the filesystem, so the capacity counts them until they are gone.
    _leaving: int
    _fallocate_ok: bool
    _memory: MemoryPool
    _attached: bool

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
        atomic.make_dirs(self._root, DIR_MODE)
        self._check_root()
        sizes = self._scan_sync()
        with self._lock:
            self._sizes = sizes
            self._stored = sum(sizes.values())
            if not self._attached and not self._closed:
                self._attached = True  # detached when the tier closes
                self._memory.attach()
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
        """Sizes of every blob under the root; removes debris of dead processes on the way
        (unless the tier was made with ``sweep=False``)."""
        return scan_sizes(self._root, sweep=self._sweep)

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
                capacity = self._capacity

                def count() -> int:
                    return (
                        self._stored - self._sizes.get(key, 0) + self._pending + self._leaving
                    ) + nbytes

                # Room being freed (a deleted blob on its way to the spares or out) is only
                # milliseconds away: wait for it rather than refuse the write.
                self._left.wait_for(
                    lambda: count() <= capacity or self._leaving == 0, timeout=_LEAVING_WAIT
                )
                after = count()
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
                    self._leaving += prepared.nbytes  # until its file is gone, below
                    after -= prepared.nbytes
                    dropped = prepared
                if after > self._capacity:
                    raise TierFull(
                        f"storing {nbytes} bytes under {key!r} would bring the local tier at "
                        f"{self._root} to {after} bytes, over its capacity of "
                        f"{self._capacity}; nothing was written. Delete old versions first."
                    )
            spare = self._take_spare(nbytes) if nbytes > 0 else None
            if spare is not None and spare.size > nbytes:
                # The spare's pages beyond nbytes stay until _open_temp cuts them off.
                self._leaving += spare.size - nbytes
            if self._capacity is not None:
                if spare is not None:
                    after += max(spare.size - nbytes, 0)
                # Spares are droppable: keep blobs + spares within capacity, largest first.
                self._spares.sort(key=lambda s: s.size)
                while self._spares and after + self._spare_bytes > self._capacity:
                    victim = self._spares.pop()
                    self._spare_bytes -= victim.size
                    self._leaving += victim.size
                    victims.append(victim)
            self._pending += nbytes
        if dropped is not None:
            try:
                self._free_prepared(dropped)
            finally:
                self._gone(dropped.nbytes)
        for victim in victims:
            self._remove_leaving(victim.path, victim.size)
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
        filesystem: when it is full, a write needs their room more. (Idle pooled buffers are
        process memory, not the filesystem's, and stay.)
        """
        with self._lock:
            prepared, self._prepared = self._prepared, None
            spares, self._spares = self._spares, []
            self._spare_bytes = 0
            self._leaving += sum(s.size for s in spares)
        if prepared is not None:
            self._drop_prepared(prepared)
        for spare in spares:
            self._remove_leaving(spare.path, spare.size)
        return prepared is not None or bool(spares)

    def _retry_when_full(self, attempt: Callable[[], _T]) -> _T:
        """Run ``attempt``; if the filesystem is full, free held memory and run it once more.

        ``attempt`` must leave nothing behind when it fails (files, accounting).
        """
        try:
            return attempt()
        except OSError as exc:
            # TierFull (an OSError) is the capacity talking, which _claim already handled.
            if isinstance(exc, TiercheckError) or exc.errno not in FULL_ERRNOS:
                raise
            if not self._drop_held_memory():
                raise
        return attempt()

    def _remove_leaving(self, path: str, nbytes: int) -> None:
        """Remove ``path``, then stop counting its ``nbytes`` as leaving."""
        try:
            atomic.discard(path)
        finally:
            self._gone(nbytes)

    def _gone(self, nbytes: int) -> None:
        """``nbytes`` counted as leaving no longer occupy the filesystem: writes waiting for
        room may count again."""
        with self._lock:
            self._leaving -= nbytes
            self._left.notify_all()

    def _forget(self, key: str) -> int:
        """Under the lock: the blob under ``key`` is gone; its size as counted."""
        size = self._sizes.pop(key, 0)
        self._stored -= size
        return size

    def _drop_prepared(self, prepared: _Prepared) -> None:
        """Free the prepared region and give back the bytes it counted as in flight."""
        self._free_prepared(prepared)
        self._unclaim(prepared.nbytes)

    def _free_prepared(self, prepared: _Prepared) -> None:
        if prepared.memory is not None:
            self._memory.give_back(prepared.memory)
        os.close(prepared.fd)
        atomic.discard(prepared.path)


class _Space(_Accounting):
    """The local tier's files as its accounting sees them: sized and backed, published under
    their key, taken from the spares, and kept as spares or removed once off their key."""

    def _size_and_back(self, fd: int, nbytes: int) -> None:
        """Make the file behind ``fd`` ``nbytes`` long, with storage held for every byte.

        A reservation's file is backed before its buffer is handed out: where the filesystem
        (a full tmpfs) cannot hold it, ``posix_fallocate`` fails here with ``ENOSPC``, which is
        :class:`TierFull`, before the caller copies a byte, rather than at commit (no file is
        ever mapped, so it could not be a ``SIGBUS`` either way). Pages a recycled file already
        holds are not allocated again: ``st_blocks`` tells whether every byte kept is backed
        (an ``fstat``: microseconds, where allocating the present pages of 256 MiB anew costs
        4-6 ms, a quarter to a third of a recycled reserve, on the save's critical path). Where
        the filesystem cannot preallocate at all, the file is only sized.
        """
        old_size = os.fstat(fd).st_size
        if old_size != nbytes:
            os.ftruncate(fd, nbytes)
        fallocate = posix_fallocate()
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
            if exc.errno not in NO_FALLOCATE_ERRNOS:
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
            atomic.publish(temp_path, target)
            self._pending -= nbytes
            self._stored += nbytes - self._sizes.get(key, 0)
            self._sizes[key] = nbytes

    def _open_temp(self, directory: str, spare: _Spare | None, nbytes: int) -> tuple[int, str]:
        """A temporary file in ``directory`` for ``nbytes``: ``spare`` renamed there (cut to
        ``nbytes`` if longer), or a fresh one."""
        if spare is not None:
            excess = max(spare.size - nbytes, 0)
            try:
                fd, path = atomic.adopt_temp(spare.path, directory, dir_mode=DIR_MODE)
                if excess:
                    try:
                        os.ftruncate(fd, nbytes)
                    except BaseException:
                        os.close(fd)
                        atomic.discard(path)
                        raise
                return fd, path
            except FileNotFoundError:
                # Removed behind our back (a cleanup by another process); use a fresh file.
                pass
            finally:
                if excess:
                    self._gone(excess)
        return atomic.create_temp(directory, file_mode=FILE_MODE, dir_mode=DIR_MODE)

    def _keep_or_remove(self, path: str, nbytes: int) -> None:
        """Keep the unreachable file ``path`` as a spare if nobody can read it; else remove it.

        Its ``nbytes`` were counted as leaving when it was taken off its key (under the lock),
        so that no write counts its room as free while the file still holds it.
        """
        if self._spare_limit == 0 or self._closed:
            self._remove_leaving(path, nbytes)
            return
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except BaseException:
            self._remove_leaving(path, nbytes)
            raise
        kept = False
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
                atomic.make_dirs(self._spares_dir, DIR_MODE)
                spare_path = os.path.join(self._spares_dir, atomic.temp_name())
                os.rename(path, spare_path)
                kept = True
                victims: list[_Spare] = []
                with self._lock:
                    self._leaving -= nbytes
                    self._left.notify_all()
                    self._spares.append(_Spare(spare_path, size))
                    self._spare_bytes += size
                    if len(self._spares) > self._spare_limit:
                        self._spares.sort(key=lambda s: s.size)
                        victims.append(self._spares.pop(0))
                        self._spare_bytes -= victims[0].size
                        self._leaving += victims[0].size
                for victim in victims:
                    self._remove_leaving(victim.path, victim.size)
        finally:
            os.close(fd)
            if not kept:
                self._remove_leaving(path, nbytes)
