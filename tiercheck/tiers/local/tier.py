"""The local tier's class: its options, its public operations, and running them in threads.

A training process that crashes leaves its checkpoints behind here for its restarted self: the
blobs are ordinary files in a memory-backed filesystem, owned by the kernel, not by the process.
See :class:`LocalTier`.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import TypeVar

from tiercheck.defaults import NodeRoot, default_root
from tiercheck.errors import ConfigError, TiercheckError
from tiercheck.tiers import atomic
from tiercheck.tiers.base import Buffer, FailureScope, Tier, TierSetup, check_range
from tiercheck.tiers.local.blobs import _BlobFiles
from tiercheck.tiers.local.files import SPARES_DIR, posix_fallocate, typed_os_error
from tiercheck.tiers.local.memory import SHARED, MemoryPool
from tiercheck.tiers.local.reservation import LocalReservation, _Reserving
from tiercheck.tiers.local.space import _Prepared, _Spare

_T = TypeVar("_T")


class LocalTier(_Reserving, _BlobFiles, Tier):
    """Blobs as files in this node's shared memory; they outlive the process that wrote them.

    ``LocalTier(root=None, *, job_id="default", node=None, capacity=None, spare_files=4,
    fsync=False, populate=True, name="local", sweep=True)``

    Layout
        Each key is a file at the same relative path under :attr:`root` (default
        ``/dev/shm/tiercheck/<job_id>/<node>``, see :func:`default_root`). Folders are created
        with mode ``0700`` and files with ``0600``, whatever the umask: checkpoints may hold
        anything a model was trained on. A key cannot also be the folder of another key
        (``a`` and ``a/b``); such a put raises :class:`~tiercheck.errors.StorageError`. Names
        with ``#`` (never valid in keys) belong to the tier itself: temporary files and spares.

    Writes
        ``put``/``putv`` write the caller's buffers straight into a temporary file (no join, no
        intermediate copy) and rename it over the key (see :mod:`tiercheck.tiers.atomic`).
        :meth:`reserve` hands out memory to fill (private to this process, recycled from one
        reservation to the next, see :mod:`tiercheck.tiers.local.memory`) together with a
        temporary file sized for it; the commit writes the memory into the file and renames
        it. ``fsync=True`` syncs files and folders, for a ``root`` on a disk; memory needs no
        syncing. All file work runs in worker threads, never on the event loop.

    Reads
        ``get`` returns a private, writable ``memoryview`` (read once from the file with
        ``preadv``, into memory recycled from earlier reads and reservations once nothing made
        from them is left) because the file may be replaced, recycled or cut short afterwards.
        A get holds a shared ``flock`` on the file while it reads, which keeps the file from
        being recycled under it. ``get_range`` (:class:`~tiercheck.tiers.SupportsRangedGet`)
        reads only the slice asked for, the same way.

    Files others change
        No file of the tier is ever mapped into memory, so nothing another process does to
        them -- an operator's cleanup truncating them, a second job on the same root -- can
        kill this one with ``SIGBUS``. A blob cut short reads as a short read or fails its
        checksum: a damaged blob, which a restore sets aside and reads from the next tier. A
        temporary file cut short while a put or commit writes it fails that write
        (:class:`~tiercheck.errors.StorageError`); the key keeps its previous blob.

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

        A full filesystem raises :class:`~tiercheck.errors.TierFull` too. A reservation's
        file (and prepared memory's) is allocated in full (``posix_fallocate``) before the
        buffer is handed out, so a tmpfs that cannot hold it (Docker's default ``/dev/shm`` is
        64 MB) answers ``ENOSPC`` before any byte is copied, not at commit. A recycled file
        that grows gets its new pages the same way (the pages it has are not allocated
        again); a put into a new file learns of ``ENOSPC`` from ``write``. On failure the
        temporary file (recycled or not) is removed, :attr:`usage` is as before and the key
        keeps its previous blob. Spares and prepared memory occupy the filesystem: when it is
        full they are dropped and the write is tried once more before it fails. Where the
        filesystem cannot preallocate (``posix_fallocate`` unsupported), files are only sized,
        the tier logs that once, and a full filesystem there shows only at commit.

    Recycling
        Filling freshly created shared-memory pages costs a page fault and a zeroed page per
        4 KiB; refilling pages that exist runs at memory-copy speed. So when a blob is deleted,
        its file may be kept as a *spare* (at most ``spare_files`` of them, hidden in
        ``<root>/.tiercheck#spares``), and the next put or reserve refills a spare instead of a
        new file. Spares are memory held: :attr:`spare_bytes` counts them, and with a
        ``capacity`` the tier keeps ``usage + spare_bytes <= capacity`` by dropping spares
        (largest first) as soon as room is needed; they never cause ``TierFull``. A file is only
        recycled if nobody can still read it: deletion takes an exclusive, non-blocking
        ``flock`` on it, which fails while a ``get`` (in any process) reads it; such a file is
        simply removed. ``spare_files=0`` turns recycling off. Spares and temporary files left
        by a process that died are removed by the next instance that opens the root (unless
        ``sweep=False``: tools that only read, such as ``tiercheck ls``, list them instead, see
        :mod:`tiercheck.catalog.leftovers`).

        The memory reservations and reads hand out is recycled too: one idle buffer is kept
        per process, for all its local tiers (:mod:`tiercheck.tiers.local.memory`), reused only
        once nothing made from it (views, tensors) is left, and freed when the last tier
        closes.

    ``populate=True`` faults a reservation's memory in when it is allocated, inside
    :meth:`reserve`'s or :meth:`prepare`'s worker thread, so that the copy into the buffer runs
    at memory speed.

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
        sweep: bool = True,
    ) -> None:
        if capacity is not None and (
            not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 0
        ):
            raise ConfigError(f"capacity must be a number of bytes >= 0 or None, got {capacity!r}")
        if not isinstance(spare_files, int) or isinstance(spare_files, bool) or spare_files < 0:
            raise ConfigError(f"spare_files must be an int >= 0, got {spare_files!r}")
        for flag, value in (("fsync", fsync), ("populate", populate)):
            if not isinstance(value, bool):
                raise ConfigError(f"{flag} must be True or False, got {value!r}")
        if root is not None and not isinstance(root, (str, os.PathLike)):
            raise ConfigError(f"root must be a folder (a str or a path) or None, got {root!r}")
        self._default_root = root is None
        resolved = default_root(job_id, node) if root is None else Path(root)
        self._root = os.path.abspath(os.fspath(resolved))
        self._spares_dir = os.path.join(self._root, SPARES_DIR)
        self.name = name
        self._capacity = capacity
        self._spare_limit = spare_files
        self._fsync = fsync
        self._populate = populate
        self._sweep = sweep
        # The memory reservations and reads hand out, recycled (shared by the process's tiers).
        self._memory: MemoryPool = SHARED
        self._attached = False

        # Guards the accounting below; held only for dictionary work and renames, never for
        # data transfer, so event-loop code that reads the properties never waits long.
        self._lock = threading.Lock()
        self._left = threading.Condition(self._lock)
        self._scan_lock = threading.Lock()
        self._scanned = False
        self._sizes: dict[str, int] = {}
        self._stored = 0
        self._pending = 0
        self._spares: list[_Spare] = []
        self._prepared: _Prepared | None = None
        self._spare_bytes = 0
        self._leaving = 0
        self._reservations: set[LocalReservation] = set()
        # Turned off for good, for this root, the first time its filesystem cannot preallocate.
        self._fallocate_ok = posix_fallocate() is not None

    def __repr__(self) -> str:
        return f"LocalTier(root={self._root!r})"

    # --- the Tier interface -------------------------------------------------------------------

    async def put(self, key: str, data: Buffer) -> None:
        """Store ``data`` under ``key`` atomically (temporary file, then rename)."""
        self._check_key(key)
        # The views are left to the garbage collector, not released: if this coroutine is
        # cancelled, the worker thread may still be writing from them.
        view = atomic.as_byte_view(data)
        await self._run("put", key, self._put_sync, key, (view,))

    async def putv(self, key: str, parts: Sequence[Buffer]) -> None:
        """Store the concatenation of ``parts``, writing each part in turn (no join)."""
        self._check_key(key)
        views = [atomic.as_byte_view(part) for part in parts]
        await self._run("put", key, self._put_sync, key, views)

    async def get(self, key: str) -> memoryview:
        """Return a private, writable copy of the blob under ``key``."""
        self._check_key(key)
        return await self._run("get", key, self._get_sync, key)

    async def get_range(self, key: str, start: int, end: int) -> memoryview:
        """Bytes ``[start, end)`` of the blob under ``key``, clipped to its size, in private memory.

        :class:`~tiercheck.tiers.SupportsRangedGet`: only the slice is read from the file, under
        the same shared lock as ``get``.
        """
        self._check_key(key)
        check_range(start, end)
        return await self._run("get_range", key, self._get_range_sync, key, start, end)

    async def read_file(self, key: str, fn: Callable[[int, int], _T]) -> _T:
        """``fn(fd, size)`` on the blob file of ``key``, in a worker thread, under the shared
        lock ``get`` reads under (:class:`~tiercheck.tiers.SupportsFileRead`)."""
        self._check_key(key)
        return await self._run("read", key, self._read_locked, key, fn)

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
        head = self._check_prefix(prefix)
        keys = await self._run("list", prefix, self._list_sync, head, prefix)
        for key in keys:
            yield key

    async def reserve(self, key: str, nbytes: int) -> LocalReservation:
        """Hand out ``nbytes`` of memory that becomes the blob ``key`` once committed.

        The buffer's initial contents are unspecified (recycled memory still holds old bytes):
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

        Sizing and backing a file and faulting in the memory to fill is most of what a reserve
        costs. Done here, ahead of time and off the caller's critical path, the next
        ``reserve(key, nbytes)`` only hands them out. At most one region is kept ready; it
        counts against the capacity like a reservation, until a write of another size needs its
        room. The file is allocated here, in full (see "Capacity" in :class:`LocalTier`).
        Returns ``False`` (and prepares nothing) when it would not fit, in the capacity, in the
        filesystem or in memory.
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
            where = f"{op} of key {key!r} in the local tier at {self._root}"
            raise typed_os_error(where, exc) from exc
