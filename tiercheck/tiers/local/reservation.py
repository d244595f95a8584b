"""Reservations of the local tier: memory handed out, to become a blob once committed.

:class:`LocalReservation` is what :meth:`~tiercheck.tiers.local.LocalTier.reserve` returns;
``_Reserving`` is the tier's side of it (preparing memory ahead, reserving, committing and
aborting), run in worker threads.

The memory handed out is private to this process (:mod:`tiercheck.tiers.local.memory`), never a
mapping of the file it becomes: the file is sized and backed at reserve time (so a full
filesystem is :class:`~tiercheck.errors.TierFull` then), written with ``pwritev`` at commit and
checked whole before it is renamed over its key. Someone cutting the file short meanwhile makes
that commit fail; nothing they do to the tier's files can reach the buffer.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from tiercheck.errors import TierFull
from tiercheck.tiers import atomic
from tiercheck.tiers.local.files import DIR_MODE, FULL_ERRNOS, check_written, write_exactly
from tiercheck.tiers.local.memory import POOL_FROM, MemoryPool
from tiercheck.tiers.local.space import _Prepared, _Space

_T = TypeVar("_T")

_OPEN, _COMMITTING, _COMMITTED, _ABORTED = "open", "committing", "committed", "aborted"

# Memory that cannot be had is, for prepare, memory that does not fit.
_NO_ROOM_ERRNOS = FULL_ERRNOS | {errno.ENOMEM}


class _Reserving(_Space):
    """The local tier's reservations and prepared memory (see :class:`LocalReservation`)."""

    _fsync: bool
    _populate: bool
    _reservations: set[LocalReservation]
    _memory: MemoryPool

    if TYPE_CHECKING:

        def _path(self, key: str) -> str: ...

        def _check_open(self) -> None: ...

        async def _run(self, op: str, key: str, fn: Callable[..., _T], *args: object) -> _T: ...

    def _prepare_sync(self, nbytes: int) -> bool:
        self._ensure_scanned()
        with self._lock:
            current = self._prepared
            if current is not None and current.nbytes == nbytes:
                return True
            self._prepared = None
        if current is not None:
            self._drop_prepared(current)
        self._memory.trim()
        if nbytes == 0:
            return True
        try:
            prepared = self._retry_when_full(lambda: self._prepare_once(nbytes))
        except TierFull:
            return False
        except OSError as exc:
            if exc.errno in _NO_ROOM_ERRNOS:
                return False  # no room for it: nothing prepared, nothing left behind
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
        memory: mmap.mmap | None = None
        try:
            fd, path = self._open_temp(self._spares_dir, spare, nbytes)
            self._size_and_back(fd, nbytes)
            memory = self._memory_for(nbytes)
        except BaseException:
            if memory is not None:
                self._memory.give_back(memory)
            if fd >= 0:
                os.close(fd)
            if path is not None:
                atomic.discard(path)
            self._unclaim(nbytes)
            raise
        return _Prepared(fd, path, memory, nbytes)

    def _memory_for(self, nbytes: int) -> mmap.mmap | None:
        """A pooled buffer for a reservation of ``nbytes`` (``None``: small, a bytearray)."""
        if nbytes < POOL_FROM:
            return None
        return self._memory.take(nbytes) or self._memory.allocate(nbytes, populate=self._populate)

    def _lend(self, memory: mmap.mmap | None, nbytes: int) -> memoryview:
        if memory is None:
            return memoryview(bytearray(nbytes))
        return self._memory.lend(memory, nbytes)

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
            view=self._lend(prepared.memory, nbytes),
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
        memory: mmap.mmap | None = None
        try:
            fd, temp_path = self._open_temp(os.path.dirname(target), spare, nbytes)
            # Storage held now, before the caller fills the buffer: a full filesystem is
            # TierFull here rather than at commit, after the copy.
            self._size_and_back(fd, nbytes)
            memory = self._memory_for(nbytes)
        except BaseException:
            if memory is not None:
                self._memory.give_back(memory)
            if fd >= 0:
                os.close(fd)
            if temp_path is not None:
                atomic.discard(temp_path)
            self._unclaim(nbytes)
            raise
        reservation = LocalReservation(
            self,
            key=key,
            target=target,
            temp_path=temp_path,
            fd=fd,
            view=self._lend(memory, nbytes),
        )
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
            fd = reservation._file.fd
            write_exactly(fd, reservation._view, 0)
            if self._fsync:
                os.fsync(fd)
            # The one moment someone else's truncate of the temporary file shows: a file cut
            # short under the write is refused here, never published as a blob.
            check_written(fd, reservation.nbytes)
            target_dir = os.path.dirname(reservation._target)
            if os.path.dirname(reservation._temp_path) != target_dir:
                atomic.make_dirs(target_dir, DIR_MODE)  # prepared memory lives elsewhere
            self._publish(
                reservation.key, reservation._temp_path, reservation._target, reservation.nbytes
            )
        except BaseException:
            with self._lock:
                reservation._state = _OPEN
            raise
        with self._lock:
            reservation._state = _COMMITTED
        # The buffer is private: the file is not needed to keep it readable.
        reservation._file.close()
        if self._fsync:
            atomic.fsync_dir_of(reservation._target)
        self._memory.trim()

    def _abort_sync(self, reservation: LocalReservation, *, releasing: bool = False) -> None:
        with self._lock:
            if reservation._state == _ABORTED or (releasing and reservation._state == _COMMITTED):
                return
            if reservation._state != _OPEN:
                raise RuntimeError(f"cannot abort {reservation!r}: it is {reservation._state}")
            reservation._state = _ABORTED
            self._pending -= reservation.nbytes
            self._leaving += reservation.nbytes  # until its file is gone
        reservation._file.close()
        self._remove_leaving(reservation._temp_path, reservation.nbytes)

    def _close_sync(self) -> None:
        """Closing: drop prepared memory and spares, abort reservations not committed."""
        with self._lock:
            prepared, self._prepared = self._prepared, None
        if prepared is not None:
            self._drop_prepared(prepared)
        with self._lock:
            victims, self._spares = self._spares, []
            self._spare_bytes = 0
            self._leaving += sum(v.size for v in victims)
            uncommitted = [r for r in self._reservations if r._state == _OPEN]
        for reservation in uncommitted:
            with contextlib.suppress(RuntimeError):
                # Raced with its own commit, which then owns it.
                self._abort_sync(reservation)
        for victim in victims:
            self._remove_leaving(victim.path, victim.size)
        if self._attached:
            self._attached = False
            self._memory.detach()

    def _released(self, reservation: LocalReservation) -> None:
        with self._lock:
            self._reservations.discard(reservation)


class _File:
    """A reservation's temporary file descriptor, closed once (by commit, abort or the GC)."""

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


class LocalReservation:
    """Memory that becomes a blob of the local tier when committed.

    Returned by :meth:`~tiercheck.tiers.local.LocalTier.reserve`; implements
    :class:`~tiercheck.tiers.Reservation`.

    1. Fill :attr:`buffer` completely (for example ``torch.frombuffer(r.buffer, dtype=...)``
       and ``copy_`` into it). Until commit, readers of the key see the previous blob or none.
    2. ``await commit()`` writes it to the tier's file and publishes that atomically, or
       ``await abort()`` discards it. A commit whose file was cut short meanwhile (by another
       process) fails with :class:`~tiercheck.errors.StorageError`; the reservation stays open.
    3. The buffer stays readable after commit; call :meth:`release` when done with it. It is
       private memory of this process, not the stored file: deleting or recycling the key, or
       anything done to the file, never changes it. It lives as long as any view or tensor made
       from it, and goes back to the tier for a later reservation only after the last is gone.

    ``release()`` without commit or abort discards the temporary file inline (a file removal
    on the calling thread; prefer ``await abort()`` on an event loop).
    """

    __slots__ = (
        "__weakref__",
        "_file",
        "_key",
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
        tier: _Reserving,
        *,
        key: str,
        target: str,
        temp_path: str,
        fd: int,
        view: memoryview,
    ) -> None:
        self._tier = tier
        self._key = key
        self._target = target
        self._temp_path = temp_path
        self._file = _File(fd)
        self._view = view
        self._nbytes = view.nbytes
        self._state = _OPEN
        self._released_flag = False
        # Commit and abort close the file; a reservation dropped without either closes it here.
        weakref.finalize(self, self._file.close)

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
        """Give the buffer back; the tier reuses its memory once nothing references it.

        Idempotent. Tensors and views made from the buffer stay valid: the memory goes back to
        the tier only when the last of them is gone.
        """
        if self._released_flag:
            return
        # Discards the file if neither committed nor aborted; raises while a commit runs.
        self._tier._abort_sync(self, releasing=True)
        self._released_flag = True
        # Never freed explicitly: torch.frombuffer and friends keep a reference to the view
        # object but no buffer export, so freeing now would leave their tensors pointing at
        # memory handed to the next reservation. Dropping our reference returns it at once if
        # nobody else holds it, or later, when the last tensor goes.
        self._view = memoryview(b"")
        self._tier._released(self)
