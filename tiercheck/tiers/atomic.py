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

Names
-----
Every name tiercheck itself creates inside a tier's folder contains ``#``, a character that
:func:`~tiercheck.tiers.base.validate_key` forbids in keys. So no key can ever name a temporary
or internal file, and listings tell them apart from blobs by the name alone
(:func:`is_internal_name`). They also start with ``.`` so that ordinary directory listings hide
them from people.

Who wrote a temporary file
--------------------------
A temporary name is ``.tiercheck#tmp#<host>#<pid>-<start>-<kernel>#<token>[#<tag>]``: the host
name, the process id, the process's start time (clock ticks since boot, from ``/proc``), an id
of the kernel instance and pid namespace the pid belongs to (a hash of the boot id and the pid
namespace), a random token, and optionally a *tag* the caller chose (the persistent tier puts
the writer's session there). :func:`parse_temp_owner` reads it back as a :class:`TempOwner`;
names of earlier releases (``<host>#<pid>#<token>``) are read too, without start time or kernel.

:func:`process_verdict` says what can be known of the writer from this process:

* ``"live"`` -- the same host and kernel instance, and a process with that pid *and start time*
  runs: it may be writing the file now. Such a file is never removed.
* ``"dead"`` -- the same host and kernel instance, and no such process: no pid reuse can fool
  this, since a reused pid has another start time. (Names of earlier releases carry no start
  time: there a running process with the pid counts as the writer, which errs on the safe side.)
* ``"unknown"`` -- another host, or another pid namespace or boot of this one (a container with
  the same host name; a host that rebooted looks the same and is not told apart): a pid means
  nothing there. Callers that may remove such files need a rule of their own; the persistent
  tier's is in :meth:`~tiercheck.tiers.PersistentTier.leftovers`.

:func:`find_temps` lists the temporary files below a folder, with size and modification time.

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
import hashlib
import os
import re
import secrets
import socket
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final, Literal

__all__ = [
    "INTERNAL_MARK",
    "TempFile",
    "TempOwner",
    "Verdict",
    "adopt_temp",
    "as_byte_view",
    "atomic_write",
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

#: The character that marks a name as tiercheck's own (never valid in a key).
INTERNAL_MARK = "#"

_TEMP_PREFIX = ".tiercheck#tmp#"

# A directory removed by a concurrent prune between our mkdir and our open is recreated; more
# than a handful of such losses in a row means something else is deleting the folder.
_CREATE_ATTEMPTS = 8

# Hostnames are made of letters, digits, '-' and '.', so they never contain the separator.
_HOST = socket.gethostname().replace(INTERNAL_MARK, "_") or "localhost"


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


def _kernel_instance() -> str:
    """An id of this boot of this kernel and of this process's pid namespace (8 hex digits).

    Two processes share it exactly when their pids can be compared: same boot, same namespace.
    ``"0"`` where ``/proc`` tells neither (not Linux).
    """
    parts = []
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            parts.append(f.read().strip())
    except OSError:
        pass
    with contextlib.suppress(OSError):
        parts.append(str(os.stat("/proc/self/ns/pid").st_ino).encode())
    if not parts:
        return "0"
    return hashlib.blake2b(b"/".join(parts), digest_size=4).hexdigest()


# A child made by fork shares both; a process that enters another pid namespace is a new one.
_KERNEL: Final = _kernel_instance()

# A tag is a short token of letters, digits, '-' and '_' (a session id, typically).
_TAG = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_OWNER_V2 = re.compile(r"^(\d+)-(\d+)-([0-9a-f]{1,16})$")


def process_start(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot), or ``None`` if it cannot be read.

    Field 22 of ``/proc/<pid>/stat``; a pid that is reused gets another start time.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces and parentheses itself.
    fields = text.rpartition(b")")[2].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


_OWN_START: dict[int, int] = {}


def _own_start() -> int:
    pid = os.getpid()
    start = _OWN_START.get(pid)
    if start is None:
        # 0: unknown (no /proc); such names are judged by pid alone.
        start = _OWN_START[pid] = process_start(pid) or 0
    return start


def valid_tag(tag: str) -> bool:
    """Whether ``tag`` may go into a temporary name (1 to 64 letters, digits, ``-``, ``_``)."""
    return isinstance(tag, str) and _TAG.match(tag) is not None


def temp_name(tag: str | None = None) -> str:
    """A fresh temporary file name: hidden, unique, and naming its writer (see the module
    docstring). ``tag`` (:func:`valid_tag`) is recorded in the name."""
    if tag is not None and not valid_tag(tag):
        raise ValueError(f"a temporary name's tag must match {_TAG.pattern}, got {tag!r}")
    owner = f"{os.getpid()}-{_own_start()}-{_KERNEL}"
    name = f"{_TEMP_PREFIX}{_HOST}#{owner}#{secrets.token_hex(8)}"
    return name if tag is None else f"{name}#{tag}"


@dataclass(frozen=True, slots=True)
class TempOwner:
    """Who made a temporary file, as its name says (see :func:`parse_temp_owner`)."""

    host: str
    pid: int
    #: The process's start time (clock ticks since boot); ``None`` in names of earlier
    #: releases, ``0`` where the writer could not read it.
    start: int | None = None
    #: The writer's kernel instance and pid namespace (:func:`process_verdict`); ``None`` in
    #: names of earlier releases.
    kernel: str | None = None
    #: The tag the writer gave (the persistent tier's: the writer's session), if any.
    tag: str | None = None

    def describe(self) -> str:
        """``pid 123 on host-a``, for messages."""
        return f"pid {self.pid} on {self.host}"


def current_owner() -> TempOwner:
    """This process, as :func:`temp_name` names it (for records that must say who wrote them)."""
    return TempOwner(_HOST, os.getpid(), _own_start(), _KERNEL)


def parse_temp_owner(name: str) -> TempOwner | None:
    """Who made the temporary file ``name``; ``None`` when it is not a temporary name."""
    if not name.startswith(_TEMP_PREFIX):
        return None
    fields = name[len(_TEMP_PREFIX) :].split(INTERNAL_MARK)
    if len(fields) not in (3, 4) or not all(fields[:3]):
        return None
    host, owner, _token = fields[:3]
    tag = fields[3] if len(fields) == 4 else None
    if tag is not None and not _TAG.match(tag):
        return None
    if owner.isdigit():
        return TempOwner(host, int(owner), tag=tag)
    m = _OWNER_V2.match(owner)
    if m is None:
        return None
    return TempOwner(host, int(m.group(1)), int(m.group(2)), m.group(3), tag)


def parse_temp_name(name: str) -> tuple[str, int] | None:
    """``(host, pid)`` of the process that made the temporary file ``name``, or ``None``.

    ``None`` means the name is not one of :func:`temp_name`'s.
    """
    owner = parse_temp_owner(name)
    return None if owner is None else (owner.host, owner.pid)


#: What can be known of a temporary file's writer from here (see :func:`process_verdict`).
Verdict = Literal["live", "dead", "unknown"]


def process_verdict(owner: TempOwner) -> tuple[Verdict, str]:
    """Whether the process that made a temporary file runs, with the reason, for people.

    See the module docstring: ``"live"`` and ``"dead"`` only for a writer on this host, in this
    boot and pid namespace; ``"unknown"`` for any other.
    """
    who = owner.describe()
    if owner.host != _HOST:
        return "unknown", f"written by {who}, another host"
    if owner.kernel is not None and owner.kernel != _KERNEL:
        return "unknown", (
            f"written by {who}, in another pid namespace (a container) or before a reboot"
        )
    if not pid_alive(owner.pid):
        return "dead", f"its writer, {who}, has exited"
    if owner.start:
        start = process_start(owner.pid)
        if start is not None and start != owner.start:
            return "dead", f"its writer, {who}, has exited (the pid now belongs to another process)"
    return "live", f"its writer, {who}, is running"


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists (in this pid namespace)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        # It exists but belongs to another user.
        return True
    return True


def owned_by_dead_process(name: str) -> bool:
    """Whether ``name`` was made by a process of this host that no longer runs.

    Only names that carry a host and a pid (temporary files, spares) can be judged; anything else
    -- and any writer that cannot be judged from here (:func:`process_verdict`) -- is reported as
    alive, so callers never delete what they cannot attribute.
    """
    owner = parse_temp_owner(name)
    return owner is not None and process_verdict(owner)[0] == "dead"


def is_internal_name(name: str) -> bool:
    """Whether a file or folder name is tiercheck's own (temporary, spare...), never a key."""
    return INTERNAL_MARK in name


@dataclass(frozen=True, slots=True)
class TempFile:
    """A temporary file found below a folder (see :func:`find_temps`)."""

    #: Its path.
    path: str
    #: Who made it, from its name.
    owner: TempOwner
    #: Its size and last modification (seconds since the epoch), when it was listed.
    size: int
    mtime: float


def find_temps(root: str) -> list[TempFile]:
    """Every temporary file at or below folder ``root`` (tiercheck's hidden folders included).

    Only names :func:`parse_temp_owner` reads are listed; files that vanish while listing (a
    writer renaming its file) are skipped. A missing ``root`` holds none.
    """
    found: list[TempFile] = []
    stack = [root]
    while stack:
        folder = stack.pop()
        try:
            entries = list(os.scandir(folder))
        except (FileNotFoundError, NotADirectoryError):
            continue
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                    continue
                owner = parse_temp_owner(entry.name)
                if owner is None or not entry.is_file(follow_symlinks=False):
                    continue
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            found.append(TempFile(entry.path, owner, st.st_size, st.st_mtime))
    found.sort(key=lambda t: t.path)
    return found


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
