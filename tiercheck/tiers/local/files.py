"""The local tier's file layer: its constants, and reading, mapping and walking blob files.

Stateless helpers shared by the pieces of :mod:`tiercheck.tiers.local`.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import weakref
from collections.abc import Callable, Iterator
from typing import Final

from tiercheck.errors import InvalidKey, StorageError, TiercheckError, TierFull
from tiercheck.tiers import atomic
from tiercheck.tiers.base import validate_key

DIR_MODE: Final = 0o700
FILE_MODE: Final = 0o600
# Spares live in one folder at the root; its name holds '#', so no key can reach it.
SPARES_DIR: Final = ".tiercheck#spares"
# A get retries when the file it opened was replaced or recycled before it could lock it; each
# retry sees a newer blob, so a few are plenty unless a writer rewrites the key nonstop.
READ_ATTEMPTS: Final = 64

# Pre-faults the pages of a mapping (Linux); elsewhere pages are faulted in on first touch.
MAP_POPULATE: Final = getattr(mmap, "MAP_POPULATE", 0)
# Blobs from this size on are read by mapping them (no copy); smaller ones are copied.
MAP_READS_FROM: Final = 1 << 20

# Reads at least this large go to anonymous memory rather than a bytearray (see read_exactly).
ANONYMOUS_FROM: Final = 1 << 20

# What a full filesystem answers (TierFull, see typed_os_error).
FULL_ERRNOS: Final = frozenset({errno.ENOSPC, errno.EDQUOT})
# What a filesystem that cannot preallocate answers to posix_fallocate (glibc emulates it on
# most; these remain where it cannot).
NO_FALLOCATE_ERRNOS: Final = frozenset({errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS})


def posix_fallocate() -> Callable[[int, int, int], None] | None:
    """``os.posix_fallocate``, or ``None`` on a platform without it (which does without).

    Looked up at each use, like any other ``os`` call, rather than bound once at import.
    """
    return getattr(os, "posix_fallocate", None)


def valid_key(key: str) -> bool:
    try:
        validate_key(key)
    except InvalidKey:
        return False
    return True


def map_private(fd: int, size: int) -> memoryview:
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


def walk_keys(root: str, start: str) -> Iterator[str]:
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
            if atomic.is_internal_name(entry.name):
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
            if valid_key(key):
                yield key


def read_exactly(fd: int, size: int, offset: int = 0) -> memoryview:
    """Read ``size`` bytes of ``fd`` from ``offset`` into new private memory (one copy).

    Large blobs land in anonymous memory: allocating it is instant and its pages are zeroed by
    the kernel inside the read, with the GIL released. A ``bytearray`` would be zero-filled by
    Python while holding the GIL, stalling the event loop for the whole time.
    """
    memory: bytearray | mmap.mmap = (
        mmap.mmap(-1, size) if size >= ANONYMOUS_FROM else bytearray(size)
    )
    view = memoryview(memory)
    done = 0
    while done < size:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise OSError(errno.EIO, f"file ended after {done} of {size} bytes")
        done += got
    return view


def scan_sizes(root: str, *, sweep: bool = True) -> dict[str, int]:
    """Sizes of every blob under ``root``; with ``sweep``, removes the temporary files and
    spares of dead processes on the way (:func:`tiercheck.tiers.atomic.owned_by_dead_process`:
    never a file whose writer runs, nor one whose writer cannot be judged from here)."""
    sizes: dict[str, int] = {}
    stack = [root]
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
            elif is_file and atomic.is_internal_name(entry.name):
                if sweep and atomic.owned_by_dead_process(entry.name):
                    atomic.discard(entry.path)
            elif is_file:
                key = os.path.relpath(entry.path, root)
                if valid_key(key):
                    with contextlib.suppress(FileNotFoundError):
                        sizes[key] = entry.stat(follow_symlinks=False).st_size
    return sizes


def typed_os_error(where: str, exc: OSError) -> TiercheckError:
    """The typed error for ``exc``, raised by the operation ``where`` describes: a full
    filesystem is :class:`~tiercheck.errors.TierFull`, anything else a
    :class:`~tiercheck.errors.StorageError`."""
    if exc.errno in FULL_ERRNOS:
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
