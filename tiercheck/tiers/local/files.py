"""The local tier's file layer: its constants, and reading, writing and walking blob files.

Stateless helpers shared by the pieces of :mod:`tiercheck.tiers.local`.

No file of the tier is ever mapped into memory. A file in shared memory can be cut short by
anyone who can open it -- an operator's cleanup script, ``truncate``, a second job pointed at
the same root -- and a process that touches a page of a mapping past its file's new end dies of
``SIGBUS``, a signal Python cannot handle (its handler runs only after the faulting instruction,
which faults again). Private copy-on-write mappings are no exception: pages not yet copied are
the file's. So bytes move between files and memory only through ``preadv``/``pwritev``, into
and out of anonymous memory of this process, which nobody else can shrink: a file cut short
gives a short read or a hole, which the tier reports as an error, never a signal.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
from collections.abc import Callable, Iterator
from typing import Final

from tiercheck.errors import InvalidKey, StorageError, TiercheckError, TierFull
from tiercheck.tiers import atomic
from tiercheck.tiers.base import validate_key
from tiercheck.tiers.temps import walk_files

DIR_MODE: Final = 0o700
FILE_MODE: Final = 0o600
# Spares live in one folder at the root; its name holds '#', so no key can reach it.
SPARES_DIR: Final = ".tiercheck#spares"
# A get retries when the file it opened was replaced or recycled before it could lock it; each
# retry sees a newer blob, so a few are plenty unless a writer rewrites the key nonstop.
READ_ATTEMPTS: Final = 64

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


def walk_keys(root: str, start: str) -> Iterator[str]:
    """Every blob key at or below folder ``start`` (skips the tier's own files and folders)."""
    # A folder pruned by a concurrent delete, or a prefix that names a blob: nothing below it.
    for entry in walk_files(start, enter=lambda name: not atomic.is_internal_name(name)):
        if atomic.is_internal_name(entry.name):
            continue
        key = os.path.relpath(entry.path, root)
        if valid_key(key):
            yield key


def anonymous_memory(size: int, *, populate: bool = False) -> mmap.mmap:
    """``size`` bytes (> 0) of new private memory, not backed by any file.

    With ``populate``, every page is faulted in now (``MAP_POPULATE``), so that writing into it
    later runs at memory speed; without, pages come on first touch (a read into it faults them
    in as it goes: faulting them first would cost the same again). Call it in a worker thread:
    faulting in pages takes time (the GIL is released meanwhile). No huge pages are asked for:
    where the kernel defragments for them on demand (its default for memory that asks), a fault
    can stall for a long time; the system's own policy applies.
    """
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    if populate:
        flags |= getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(-1, size, flags=flags)


def read_exactly(fd: int, size: int, offset: int = 0, into: memoryview | None = None) -> memoryview:
    """Read ``size`` bytes of ``fd`` from ``offset`` into private memory (one copy).

    Into ``into`` (``size`` bytes, writable) when given, else into new memory: anonymous memory
    for large reads (:func:`anonymous_memory`: allocating it is instant and its pages are
    zeroed by the kernel inside the read, with the GIL released; a ``bytearray`` would be
    zero-filled by Python while holding the GIL, stalling the event loop for the whole time).
    A file that ends early (cut short by someone else) is an ``EIO`` :class:`OSError`, never a
    partly filled buffer.
    """
    if into is not None:
        view = into
    else:
        view = memoryview(anonymous_memory(size) if size >= ANONYMOUS_FROM else bytearray(size))
    done = 0
    while done < size:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise OSError(errno.EIO, f"file ended after {done} of {size} bytes")
        done += got
    return view


def write_exactly(fd: int, view: memoryview, offset: int = 0) -> None:
    """Write all of ``view`` into ``fd`` at ``offset`` (``pwritev``, short writes continued)."""
    done, size = 0, view.nbytes
    while done < size:
        written = os.pwritev(fd, [view[done:]], offset + done)
        if written <= 0:
            raise OSError(errno.EIO, "write made no progress")
        done += written


def check_written(fd: int, nbytes: int) -> None:
    """After writing ``nbytes`` from offset 0: raise if the file is not exactly that, whole.

    Someone else may have cut the file short while it was written (``truncate`` on a temporary
    file in shared memory): it then ends early, or, where the writer went on past the cut, it
    has a hole of zeros where pages were dropped. Either is an ``EIO`` :class:`OSError`. The
    allocated blocks answer in one ``fstat``; only where they fall short of the size (a hole,
    or a filesystem that compresses) does ``SEEK_HOLE`` look for a hole.
    """
    st = os.fstat(fd)
    if st.st_size != nbytes:
        raise OSError(
            errno.EIO,
            f"the file holds {st.st_size} bytes after {nbytes} were written: something else "
            "changed it meanwhile (truncated it?)",
        )
    if nbytes and st.st_blocks * 512 < nbytes:
        seek_hole = getattr(os, "SEEK_HOLE", None)
        hole = nbytes if seek_hole is None else os.lseek(fd, 0, seek_hole)
        if hole < nbytes:
            raise OSError(
                errno.EIO,
                f"the file has a hole at byte {hole} of {nbytes} after it was written: "
                "something else cut it short meanwhile (truncate?)",
            )


def scan_sizes(root: str, *, sweep: bool = True) -> dict[str, int]:
    """Sizes of every blob under ``root``; with ``sweep``, removes the temporary files and
    spares of dead processes on the way (:func:`tiercheck.tiers.atomic.owned_by_dead_process`:
    never a file whose writer runs, nor one whose writer cannot be judged from here)."""
    sizes: dict[str, int] = {}
    for entry in walk_files(root):
        if atomic.is_internal_name(entry.name):
            if sweep and atomic.owned_by_dead_process(entry.name):
                atomic.discard(entry.path)
            continue
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
