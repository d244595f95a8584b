"""Atomic publication of files: the one place tiercheck writes a file under its final name.

Every filesystem-backed tier (the local tier always, the persistent tier on local filesystems)
publishes a blob the same way:

1. :func:`create_temp` opens a new file under a unique, hidden *temporary name* in the target's
   own directory (so the final rename never crosses filesystems), creating the directory first
   if needed. :func:`adopt_temp` does the same with an existing file (a recycled one).
2. The caller writes the blob into it (:func:`write_all` writes a sequence of buffers without
   joining them) and optionally ``fsync``\\ s it.
3. :func:`publish` renames it over the final name with :func:`os.replace`, which is atomic on
   POSIX: a reader opens either the old file or the new one, never half of one.
4. On any failure before that, :func:`discard` removes the temporary file, so a failed write leaves
   the previous blob in place and no debris behind. (A process killed mid-write leaves its
   temporary file behind; its name says who wrote it, so that a later process can tell whether
   the writer is gone, see "Who wrote a temporary file" below.)

:func:`atomic_write` strings these together for callers that need nothing more.

Temporary names, and who wrote one, are :mod:`tiercheck.tiers.temps`'s (importable from here
too).

Directories
-----------
Deleting a blob may leave its directory empty; :func:`prune_empty_dirs` removes such directories
so that a long run does not accumulate thousands of them. That races with a writer that has just
created the directory and is about to create its temporary file there; :func:`create_temp`
therefore recreates a directory that vanished under it and tries again.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterable, Sequence

from tiercheck.tiers.temps import (
    INTERNAL_MARK,
    TempFile,
    TempOwner,
    Verdict,
    current_owner,
    find_temps,
    is_internal_name,
    owned_by_dead_process,
    parse_temp_name,
    parse_temp_owner,
    pid_alive,
    process_start,
    process_verdict,
    temp_name,
    valid_tag,
)

__all__ = [
    "INTERNAL_MARK",
    "TempFile",
    "TempOwner",
    "Verdict",
    "adopt_temp",
    "as_byte_view",
    "atomic_write",
    "atomic_write_file",
    "create_temp",
    "current_owner",
    "discard",
    "find_temps",
    "fsync_dir",
    "fsync_dir_of",
    "is_internal_name",
    "link_over",
    "make_dirs",
    "owned_by_dead_process",
    "parse_temp_name",
    "parse_temp_owner",
    "pid_alive",
    "process_start",
    "process_verdict",
    "prune_empty_dirs",
    "publish",
    "split_prefix",
    "temp_name",
    "valid_tag",
    "write_all",
]


# A directory removed by a concurrent prune between our mkdir and our open is recreated; more
# than a handful of such losses in a row means something else is deleting the folder.
_CREATE_ATTEMPTS = 8


def as_byte_view(data: object) -> memoryview:
    """Return a flat, one-byte-per-item (``B``) view of a bytes-like ``data``, without copying.

    Raises :class:`TypeError` for objects that do not expose a contiguous buffer, before any I/O,
    so that a failing put never touches storage.
    """
    try:
        view = memoryview(data)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(
            f"a blob must be a bytes-like object (bytes, bytearray, memoryview), "
            f"got {type(data).__name__}"
        ) from None
    if not view.c_contiguous:
        view.release()
        raise TypeError("a blob must be a C-contiguous buffer; copy it first (bytes(view))")
    if view.format == "B" and view.ndim == 1:
        return view
    # A view with items wider than one byte (an array of floats, a tensor's numpy view) is
    # stored as its raw bytes; len() of such a view counts items, nbytes counts bytes.
    flat = view.cast("B")
    view.release()
    return flat


def split_prefix(prefix: str) -> tuple[str, str]:
    """Split a listing prefix into its complete segments and the partial last one.

    ``"v1/rank"`` gives ``("v1", "rank")``; ``"v1/"`` gives ``("v1", "")``; ``"v"`` gives
    ``("", "v")``. The complete part names the folder a listing can start from.
    """
    head, _sep, tail = prefix.rpartition("/")
    return head, tail


def make_dirs(path: str, mode: int | None = None) -> None:
    """Create folder ``path`` and its missing parents.

    With ``mode``, every folder *created here* gets exactly that mode, whatever the umask (unlike
    :func:`os.makedirs`, which applies the mode to the leaf only and then through the umask).
    Folders that already exist are left alone.
    """
    missing: list[str] = []
    current = path
    while True:
        try:
            st = os.stat(current)
        except FileNotFoundError:
            missing.append(current)
            parent = os.path.dirname(current)
            if parent == current:
                break
            current = parent
            continue
        if not stat.S_ISDIR(st.st_mode):
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", current)
        break
    for folder in reversed(missing):
        try:
            os.mkdir(folder, 0o777 if mode is None else mode)
        except FileExistsError:
            # Created concurrently by another writer; fine as long as it is a folder.
            if not os.path.isdir(folder):
                raise
            continue
        if mode is not None:
            # mkdir's mode went through the umask; the caller asked for exactly this one.
            os.chmod(folder, mode)


def create_temp(
    directory: str,
    *,
    file_mode: int | None = None,
    dir_mode: int | None = None,
    tag: str | None = None,
) -> tuple[int, str]:
    """Create a new, empty temporary file in ``directory``; return ``(fd, path)``.

    The folder (and its parents) is created if missing, with ``dir_mode``. The file is opened
    read-write; with ``file_mode`` it gets exactly that mode whatever the umask, otherwise the
    usual ``0o666 & ~umask``. ``tag`` goes into the name (:func:`temp_name`).
    """
    last_error: FileNotFoundError | None = None
    for _ in range(_CREATE_ATTEMPTS):
        path = os.path.join(directory, temp_name(tag))
        try:
            fd = os.open(
                path,
                os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                0o600 if file_mode is not None else 0o666,
            )
        except FileNotFoundError as exc:
            last_error = exc
            make_dirs(directory, dir_mode)
            continue
        # A kept exception would hold this frame, and through it the caller's, in a reference
        # cycle: memory the caller maps next would then live until the garbage collector ran.
        last_error = None
        if file_mode is not None:
            try:
                os.fchmod(fd, file_mode)
            except BaseException:
                os.close(fd)
                discard(path)
                raise
        return fd, path
    assert last_error is not None
    raise last_error


def adopt_temp(source: str, directory: str, *, dir_mode: int | None = None) -> tuple[int, str]:
    """Move an existing file ``source`` into ``directory`` under a temporary name; open it.

    Returns ``(fd, path)`` like :func:`create_temp`. Used to recycle a file: its pages are
    already allocated. Raises :class:`FileNotFoundError` if ``source`` is gone.
    """
    last_error: FileNotFoundError | None = None
    for _ in range(_CREATE_ATTEMPTS):
        path = os.path.join(directory, temp_name())
        try:
            os.rename(source, path)
        except FileNotFoundError as exc:
            if not os.path.lexists(source):
                raise
            last_error = exc
            make_dirs(directory, dir_mode)
            continue
        last_error = None  # see create_temp: no cycle through a kept exception
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except BaseException:
            discard(path)
            raise
        return fd, path
    assert last_error is not None
    raise last_error


def write_all(fd: int, parts: Iterable[memoryview]) -> int:
    """Write every part, in order, from the file's current offset; return the bytes written.

    Each part is written straight from the caller's memory: no joining, no intermediate copy.
    Short writes (the kernel writes at most about 2 GiB per call) are continued.
    """
    total = 0
    for part in parts:
        view = part
        while view.nbytes:
            written = os.write(fd, view)
            if written <= 0:
                raise OSError(errno.EIO, "write made no progress")
            total += written
            view = view[written:]
    return total


def publish(temp_path: str, target: str, *, fsync_dir: bool = False) -> None:
    """Atomically rename ``temp_path`` over ``target`` (replacing it if present).

    With ``fsync_dir``, the folder is synced afterwards so that the rename itself is durable.
    """
    os.replace(temp_path, target)
    if fsync_dir:
        fsync_dir_of(target)


def fsync_dir_of(path: str) -> None:
    """``fsync`` the folder that holds ``path`` (makes a rename or creation durable)."""
    fsync_dir(os.path.dirname(path) or ".")


def fsync_dir(directory: str) -> None:
    """``fsync`` a folder."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def discard(path: str) -> None:
    """Remove a temporary file; a file that is already gone is fine."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def prune_empty_dirs(directory: str, stop: str) -> None:
    """Remove ``directory`` and then its parents while they are empty, never ``stop`` itself.

    ``directory`` must be ``stop`` or lie below it. Stops quietly at the first folder that is not
    empty or is already gone (both are the expected outcome of concurrent writers); any other
    failure is raised.
    """
    stop = os.path.normpath(stop)
    current = os.path.normpath(directory)
    while current != stop and current.startswith(stop + os.sep):
        try:
            os.rmdir(current)
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                return
            raise
        current = os.path.dirname(current)


def atomic_write(
    target: str,
    parts: Sequence[memoryview],
    *,
    fsync: bool = False,
    file_mode: int | None = None,
    dir_mode: int | None = None,
    tag: str | None = None,
) -> int:
    """Write the concatenation of ``parts`` to ``target`` atomically; return the size.

    Readers of ``target`` see the previous file or the whole new one. If anything fails, the
    temporary file is removed and the previous file is untouched. With ``fsync``, the data and
    the rename are made durable before returning. ``tag`` goes into the temporary file's name.
    """
    fd, temp_path = create_temp(
        os.path.dirname(target), file_mode=file_mode, dir_mode=dir_mode, tag=tag
    )
    try:
        try:
            size = write_all(fd, parts)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        publish(temp_path, target, fsync_dir=fsync)
    except BaseException:
        discard(temp_path)
        raise
    return size


def atomic_write_file(path: str | os.PathLike[str], data: bytes) -> int:
    """Write ``data`` to the local file ``path`` atomically; return the number of bytes written.

    A reader of ``path`` sees the previous file or the whole new one, never a part of either:
    the bytes go to a hidden temporary file in the same folder (made, with its parents, when
    missing) that is then renamed over ``path``. When anything fails, the temporary file is
    removed and the previous file is left as it was. Nothing is ``fsync``\\ ed: a power loss may
    leave either version. A process killed mid-write leaves its temporary file behind, named
    after its writer (``.tiercheck#tmp#<host>#<pid>...``). The integrations write their small
    pointer files with it; it is public as :func:`tiercheck.atomic_write_file`.
    """
    return atomic_write(os.fspath(path), [memoryview(data)])


# What link(2) answers where a filesystem cannot hard-link (callers then copy the bytes).
_NO_LINK_ERRNOS = frozenset({errno.EPERM, errno.EXDEV, errno.EMLINK, errno.EOPNOTSUPP})


def link_over(
    source: str, target: str, *, fsync: bool = False, dir_mode: int | None = None
) -> bool:
    """Publish ``target`` as a hard link to the file ``source``; ``False`` where the filesystem
    has no hard links (nothing is changed then).

    The link is made under a temporary name next to ``target`` and renamed over it, like any
    publication: ``target`` is the old file or ``source``'s, never missing in between. Only for
    files that are never written in place after publication (blobs): the two names share one
    file. :class:`FileNotFoundError` if ``source`` is gone.
    """
    directory = os.path.dirname(target)
    for _ in range(_CREATE_ATTEMPTS):
        temp = os.path.join(directory, temp_name())
        try:
            os.link(source, temp)
        except FileNotFoundError:
            if not os.path.exists(source):
                raise
            make_dirs(directory, dir_mode)
            continue
        except OSError as exc:
            if exc.errno in _NO_LINK_ERRNOS:
                return False
            raise
        try:
            publish(temp, target, fsync_dir=fsync)
        except BaseException:
            discard(temp)
            raise
        return True
    raise FileNotFoundError(errno.ENOENT, "the folder kept vanishing", directory)
