"""Temporary file names: what marks a name as tiercheck's own, and who wrote a temporary file.

:mod:`tiercheck.tiers.atomic` writes every file under such a name first and renames it over
the final one; this module makes the names, reads them back and judges their writers. Every
name here is importable from :mod:`tiercheck.tiers.atomic` too.

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
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import secrets
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Final, Literal

from tiercheck._process import pid_alive

__all__ = [
    "INTERNAL_MARK",
    "TempFile",
    "TempOwner",
    "Verdict",
    "current_owner",
    "find_temps",
    "is_internal_name",
    "owned_by_dead_process",
    "parse_temp_name",
    "parse_temp_owner",
    "pid_alive",
    "process_start",
    "process_verdict",
    "temp_name",
    "valid_tag",
    "walk_files",
]

#: The character that marks a name as tiercheck's own (never valid in a key).
INTERNAL_MARK = "#"

_TEMP_PREFIX = ".tiercheck#tmp#"


# Hostnames are made of letters, digits, '-' and '.', so they never contain the separator.
_HOST = socket.gethostname().replace(INTERNAL_MARK, "_") or "localhost"


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


def walk_files(
    start: str, *, enter: Callable[[str], bool] = lambda _name: True
) -> Iterator[os.DirEntry[str]]:
    """Every regular file at or below folder ``start``, entering the folders whose name
    ``enter`` accepts (never following a link).

    Made for folders others change while it walks: a folder or file that vanishes meanwhile
    (a concurrent delete, a writer renaming its file) is passed over, as is a ``start`` that is
    missing or is a file.
    """
    stack = [start]
    while stack:
        folder = stack.pop()
        try:
            entries = list(os.scandir(folder))
        except (FileNotFoundError, NotADirectoryError):
            continue
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    if enter(entry.name):
                        stack.append(entry.path)
                    continue
                if not entry.is_file(follow_symlinks=False):
                    continue
            except FileNotFoundError:
                continue
            yield entry


def find_temps(root: str) -> list[TempFile]:
    """Every temporary file at or below folder ``root`` (tiercheck's hidden folders included).

    Only names :func:`parse_temp_owner` reads are listed; files that vanish while listing (a
    writer renaming its file) are skipped. A missing ``root`` holds none.
    """
    found: list[TempFile] = []
    for entry in walk_files(root):
        owner = parse_temp_owner(entry.name)
        if owner is None:
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        found.append(TempFile(entry.path, owner, st.st_size, st.st_mtime))
    found.sort(key=lambda t: t.path)
    return found
