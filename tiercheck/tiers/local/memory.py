"""The local tier's private memory: reservations and reads, recycled once nobody holds it.

A reservation's buffer, and the copy a read returns, are anonymous memory of this process, never
a mapping of the tier's files (see :mod:`tiercheck.tiers.local.files` for why: a file anyone can
truncate must never be touched through a mapping). Bytes reach a file by ``pwritev`` when a
reservation is committed, and come from it by ``preadv``.

Fresh memory costs a page fault and a zeroed page per 4 KiB the first time it is written (in a
virtual machine, several times what copying into that page costs), so buffers are recycled:
a buffer lent out comes back to the pool once the last object that can reach its memory is gone
-- the view handed out, any slice or cast of it, any tensor or array made from them. Each loan
is a ``ctypes`` array over the buffer, and every such object holds a reference to it (a
``memoryview`` through its managed buffer, ``torch.frombuffer`` through the view it keeps, numpy
through the buffer it exports), so its death, seen by a finalizer, proves the memory free. At
most :data:`KEEP_FREE` idle buffers are kept, in one pool per process (:data:`SHARED`) that
every local tier of the process draws from -- a checkpointer reopened in the same process, and
the peer tier's replica holder, reuse the same memory -- and none once no tier uses it.
"""

from __future__ import annotations

import collections
import ctypes
import mmap
import threading
import weakref
from typing import Final

from tiercheck.tiers.local.files import ANONYMOUS_FROM, anonymous_memory, read_exactly

__all__ = ["KEEP_FREE", "POOL_FROM", "SHARED", "MemoryPool"]

#: Idle buffers kept for the next reservation or read. One is enough for a job saving in a
#: loop: a save's buffer comes back once its version is encoded, and the next save's prepare
#: takes it (the newest base is held meanwhile, not idle).
KEEP_FREE: Final = 1
#: Reservations smaller than this get a plain ``bytearray`` (cheap to make, not pooled).
POOL_FROM: Final = ANONYMOUS_FROM


class MemoryPool:
    """Anonymous buffers lent to reservations and taken back when unreferenced.

    :meth:`take` (no system call: fit for the event loop) and :meth:`allocate` (in a worker
    thread) give a buffer; :meth:`lend` hands out a view of it that brings it back to the pool
    when the last reference to that memory dies; :meth:`give_back` returns one never lent.
    Idle buffers past :attr:`keep` are unmapped by :meth:`trim` (a worker thread's call:
    unmapping takes time). Users :meth:`attach` and :meth:`detach`; with none left, idle
    buffers are unmapped and buffers coming back are not kept. Thread-safe; buffers come back
    from whatever thread drops the last reference.
    """

    def __init__(self, *, keep: int = KEEP_FREE) -> None:
        self.keep = keep
        self._users = 0
        self._lock = threading.Lock()
        self._free: list[mmap.mmap] = []
        # Filled by finalizers, which may run inside any code (even under self._lock, in the
        # thread that drops a last reference): a deque appends without a lock.
        self._returned: collections.deque[mmap.mmap] = collections.deque()

    def attach(self) -> None:
        """One more user (a local tier, from its first use until it closes)."""
        with self._lock:
            self._users += 1

    def detach(self) -> None:
        """One user fewer; the last one gone unmaps the idle buffers."""
        with self._lock:
            self._users -= 1
            last = self._users <= 0
        if last:
            self.drop_free()

    @property
    def free_bytes(self) -> int:
        """Bytes of the idle buffers kept."""
        with self._lock:
            self._free.extend(self._drained())
            return sum(len(m) for m in self._free)

    def take(self, nbytes: int) -> mmap.mmap | None:
        """An idle buffer of at least ``nbytes`` (and at most twice that), else ``None``."""
        with self._lock:
            self._free.extend(self._drained())
            fitting = [m for m in self._free if nbytes <= len(m) <= 2 * nbytes]
            if not fitting:
                return None
            chosen = min(fitting, key=len)
            self._free.remove(chosen)
            return chosen

    @staticmethod
    def allocate(nbytes: int, *, populate: bool) -> mmap.mmap:
        """A new buffer of ``nbytes`` (> 0), faulted in if ``populate``; a worker thread's
        call."""
        return anonymous_memory(nbytes, populate=populate)

    def read(self, fd: int, nbytes: int, offset: int = 0) -> memoryview:
        """``nbytes`` of ``fd`` from ``offset``, read into a lent buffer (a bytearray when
        small); see :func:`~tiercheck.tiers.local.files.read_exactly`. A worker thread's call."""
        if nbytes < POOL_FROM:
            return read_exactly(fd, nbytes, offset)
        self.trim()
        # Not faulted in first: the read does that as it goes.
        memory = self.take(nbytes) or self.allocate(nbytes, populate=False)
        view = self.lend(memory, nbytes)
        # A failed read drops the view, which brings the buffer back.
        return read_exactly(fd, nbytes, offset, into=view)

    def lend(self, memory: mmap.mmap, nbytes: int) -> memoryview:
        """A writable ``B`` view of the first ``nbytes`` of ``memory``; ``memory`` comes back
        to the pool when nothing can reach it through this view any more."""
        loan = (ctypes.c_ubyte * nbytes).from_buffer(memory)
        weakref.finalize(loan, self._come_back, memory)
        return memoryview(loan).cast("B")

    def give_back(self, memory: mmap.mmap) -> None:
        """Return a buffer that was taken or allocated but never lent."""
        self._come_back(memory)

    def trim(self) -> None:
        """Unmap the idle buffers past the newest :attr:`keep` (a worker thread's call)."""
        with self._lock:
            self._free.extend(self._drained())
            cut = max(0, len(self._free) - self.keep)
            victims, self._free = self._free[:cut], self._free[cut:]
        for memory in victims:
            memory.close()

    def drop_free(self) -> bool:
        """Unmap every idle buffer; whether there was any."""
        with self._lock:
            self._free.extend(self._drained())
            dropped, self._free = self._free, []
        for memory in dropped:
            memory.close()
        return bool(dropped)

    def _come_back(self, memory: mmap.mmap) -> None:
        if self._users > 0:
            self._returned.append(memory)
        # Else dropped here: unmapped once the finalizer lets go of it.

    def _drained(self) -> list[mmap.mmap]:
        """The buffers returned since the last call, oldest first."""
        back = []
        while self._returned:
            back.append(self._returned.popleft())
        return back


#: The pool every local tier of this process draws from.
SHARED = MemoryPool()
