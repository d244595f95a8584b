"""The local tier's blob files: put, get, size, exists, delete and list, in worker threads.

Each key is a file at the same relative path under the tier's root; a write goes to a
temporary file renamed over the key, a read holds a shared ``flock`` while it reads.
"""

from __future__ import annotations

import fcntl
import os
import stat
from collections.abc import Callable, Sequence
from typing import TypeVar

from tiercheck.errors import BlobNotFound, StorageError
from tiercheck.tiers import atomic
from tiercheck.tiers.local.files import (
    READ_ATTEMPTS,
    check_written,
    walk_keys,
)
from tiercheck.tiers.local.space import _Space

_T = TypeVar("_T")


class _BlobFiles(_Space):
    """The local tier's blocking operations on blob files (run in worker threads)."""

    _fsync: bool

    def _path(self, key: str) -> str:
        return os.path.join(self._root, key)

    def _put_sync(self, key: str, views: Sequence[memoryview]) -> None:
        self._ensure_scanned()
        self._retry_when_full(lambda: self._put_once(key, views))
        if self._fsync:
            atomic.fsync_dir_of(self._path(key))

    def _put_once(self, key: str, views: Sequence[memoryview]) -> None:
        nbytes = sum(view.nbytes for view in views)
        target = self._path(key)
        spare = self._claim(key, nbytes)
        temp_path: str | None = None
        try:
            fd, temp_path = self._open_temp(os.path.dirname(target), spare, nbytes)
            try:
                if spare is not None:
                    # A fresh file needs no backing (write reports ENOSPC, it cannot fault);
                    # a recycled one that grows gets its new pages before a byte is copied.
                    self._size_and_back(fd, nbytes)
                atomic.write_all(fd, views)
                if self._fsync:
                    os.fsync(fd)
                check_written(fd, nbytes)  # not cut short by someone else meanwhile
            finally:
                os.close(fd)
            self._publish(key, temp_path, target, nbytes)
        except BaseException:
            if temp_path is not None:
                atomic.discard(temp_path)
            self._unclaim(nbytes)
            raise

    def _get_sync(self, key: str) -> memoryview:
        # Read, never mapped (see tiercheck.tiers.local.files): the blob's file may be cut
        # short by anyone, and a mapping of it would then kill this process. Into recycled
        # memory where there is some: fresh pages cost more than the copy.
        return self._read_locked(key, self._memory.read)

    def _get_range_sync(self, key: str, start: int, end: int) -> memoryview:
        def part(fd: int, size: int) -> memoryview:
            begin = min(start, size)
            return self._memory.read(fd, min(end, size) - begin, begin)

        return self._read_locked(key, part)

    def _read_locked(self, key: str, read: Callable[[int, int], _T]) -> _T:
        """``read(fd, size)`` on the blob file of ``key``, under a shared ``flock``."""
        self._ensure_scanned()
        path = self._path(key)
        for _ in range(READ_ATTEMPTS):
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
                return read(fd, st.st_size)
            finally:
                os.close(fd)
        raise StorageError(
            f"reading {key!r} from the local tier at {self._root} failed: it was replaced "
            f"{READ_ATTEMPTS} times while being opened"
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
        private = os.path.join(folder, atomic.temp_name())
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
            size = self._forget(key)
            # Off its key but still on the filesystem: counted until kept or removed.
            self._leaving += size
        self._keep_or_remove(private, size)
        atomic.prune_empty_dirs(folder, self._root)

    def _list_sync(self, head: str, prefix: str) -> Sequence[str]:
        self._ensure_scanned()
        start = os.path.join(self._root, head) if head else self._root
        return [key for key in walk_keys(self._root, start) if key.startswith(prefix)]
