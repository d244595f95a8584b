"""The manifest's folder as files: what is wrong with an LMDB environment, read without mapping
it, and setting a damaged one aside.

Nothing here opens the environment through LMDB (which maps it): every byte is read with
``pread``, so a file cut short is a finding, never a ``SIGBUS``. Used by the manifest process
before it maps an environment (:mod:`tiercheck.consistency.manifestd`) and by the command line
where no process serves one. Imports the standard library and ``lmdb.verify`` (pure Python) only:
the manifest process loads it without the rest of tiercheck.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import struct
import time

import lmdb.verify as lmdb_verify

__all__ = [
    "DAMAGED_PREFIX",
    "DATA",
    "LOCK",
    "SERVER_LOCK",
    "check_at_rest",
    "check_unmapped",
    "served",
    "set_aside",
]

#: The environment's data file and lock file, in the manifest folder.
DATA = "data.mdb"
LOCK = "lock.mdb"
#: The file whose exclusive ``flock`` the serving process holds for its life.
SERVER_LOCK = "server.lock"
#: The prefix of a damaged environment set aside in the manifest folder.
DAMAGED_PREFIX = "manifest.damaged-"

_MAGIC = 0xBEEFC0DE
_DATA_VERSION = 1  # LMDB 0.9's data format
_LOCK_VERSION = 1  # LMDB 0.9's lock format (mti_format's low bits)
_PAGE_HEADER = 16
_P_META = 0x08


def _meta(fd: int, offset: int) -> tuple[int, int, int, int, int, int] | None:
    """``(flags, magic, version, page size, last page, txnid)`` of the meta page at ``offset``,
    or ``None`` where the file ends before it."""
    buf = os.pread(fd, _PAGE_HEADER + 152, offset)
    if len(buf) < _PAGE_HEADER + 152:
        return None
    (flags,) = struct.unpack_from("=H", buf, 10)
    magic, version = struct.unpack_from("=II", buf, _PAGE_HEADER)
    (psize,) = struct.unpack_from("=I", buf, _PAGE_HEADER + 24)  # mm_psize: the free DB's pad
    last, txnid = struct.unpack_from("=QQ", buf, _PAGE_HEADER + 24 + 96)
    return flags, magic, version, psize, last, txnid


def check_at_rest(folder: str) -> str | None:
    """What is wrong with the LMDB environment in ``folder`` at rest, or ``None`` if nothing is
    (or there is no environment yet).

    Read with ``pread``, never mapped: both meta pages must be meta pages with LMDB's magic,
    data version and one power-of-two page size; the file must hold every page up to the last
    one the newer meta page names (a file cut short at rest is caught here, before a map would
    touch the missing pages); ``lock.mdb``, where present, must start with LMDB's lock magic
    and format. A page garbled inside the tree is not seen here: LMDB's own checks raise
    :class:`lmdb.CorruptedError` for it, which the server treats the same way.
    """
    data = os.path.join(folder, DATA)
    try:
        fd = os.open(data, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return f"{DATA} is empty"
        first = _meta(fd, 0)
        if first is None:
            return f"{DATA} is {size} bytes, shorter than its first meta page"
        psize = first[3]
        if psize < 512 or psize > 1 << 16 or psize & (psize - 1):
            return f"{DATA} names an impossible page size ({psize})"
        second = _meta(fd, psize)
        if second is None:
            return f"{DATA} is {size} bytes, shorter than its second meta page"
        for i, (flags, magic, version, page, _last, _txn) in enumerate((first, second)):
            if magic != _MAGIC or not flags & _P_META:
                return f"meta page {i} of {DATA} is not an LMDB meta page"
            if version != _DATA_VERSION:
                return f"meta page {i} of {DATA} has data version {version}, not {_DATA_VERSION}"
            if page != psize:
                return f"the meta pages of {DATA} disagree on the page size ({psize}, {page})"
        last = max((first, second), key=lambda m: m[5])[4]
        if size < (last + 1) * psize:
            return (
                f"{DATA} is {size} bytes, cut short: its last committed page ({last}) ends at "
                f"byte {(last + 1) * psize}"
            )
    finally:
        os.close(fd)
    lock = os.path.join(folder, LOCK)
    try:
        with open(lock, "rb") as f:
            head = f.read(8)
    except FileNotFoundError:
        return None
    if len(head) < 8:
        return f"{LOCK} is {len(head)} bytes, not a lock file"
    magic, fmt = struct.unpack("=II", head)
    if magic != _MAGIC or fmt & 0xFFFF != _LOCK_VERSION:
        return f"{LOCK} is not an LMDB lock file"
    return None


def set_aside(folder: str, why: str) -> str:
    """Move the environment's files in ``folder`` into a new ``manifest.damaged-<UTC time>``
    folder beside them; return its path. Nothing is deleted."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    aside = os.path.join(folder, f"{DAMAGED_PREFIX}{stamp}")
    n = 1
    while os.path.exists(aside):
        n += 1
        aside = os.path.join(folder, f"{DAMAGED_PREFIX}{stamp}.{n}")
    os.mkdir(aside, 0o700)
    for name in (DATA, LOCK):
        with contextlib.suppress(FileNotFoundError):
            os.rename(os.path.join(folder, name), os.path.join(aside, name))
    with open(os.path.join(aside, "why.txt"), "w", encoding="utf-8") as f:
        f.write(why + "\n")
    return aside


def check_unmapped(folder: str) -> str | None:
    """What is wrong with the environment in ``folder``, or ``None`` (sound, or none yet):
    :func:`check_at_rest`, then every page of its tree walked by LMDB's own verifier
    (:mod:`lmdb.verify`), all read with ``pread``, never mapped -- about 2 ms per thousand
    records. Meant for an environment nobody writes meanwhile (the server runs it before it
    opens one; ``tiercheck verify`` where no server runs)."""
    why = check_at_rest(folder)
    if why is not None or not os.path.exists(os.path.join(folder, DATA)):
        return why
    try:
        problems: list[str] = lmdb_verify.verify(folder)  # type: ignore[no-untyped-call]
    except (lmdb_verify.VerifyError, OSError, struct.error, ValueError) as exc:
        problems = [str(exc)]
    if not problems:
        return None
    more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
    return "; ".join(problems[:3]) + more


def served(folder: str) -> bool:
    """Whether a manifest process serves ``folder`` now (it holds the folder's server lock)."""
    try:
        fd = os.open(os.path.join(folder, SERVER_LOCK), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return True
        raise
    finally:
        os.close(fd)  # closing drops a lock taken here
    return False
