"""The node's manifest: a log of what happened to every version, and its index, in LMDB.

One LMDB environment per node (``manifest/data.mdb``), shared by every rank (process) of that
node. Each :meth:`Manifest.append` is one write transaction holding the records of that call
*and* their index updates, so a crash (of anyone, at any point) leaves both or neither. The
index -- which blobs are written to which tier, which versions are committed where, what each
version is -- lives in the environment beside the log, so every process asks it the same
question and gets the same answer, from a snapshot that never waits for a writer. Records of
versions no tier holds any more are deleted after retention (:meth:`Manifest.compact_if_grown`);
the pages they held are reused by later appends.

Records (``op`` field):

==========  ==================================================================================
``begin``    a rank started saving version ``v`` (its kind and, for a delta, its base)
``durable``  a rank's blob of ``v`` is written to a tier (:class:`Written`; the op keeps its old
             name): key, size, checksum, raw digest, base
``commit``   ``v`` is committed in a tier: every rank's blob of it (and of its base) is written
``evict``    a rank removed its blob of ``v`` from a tier (retention, or truncation on restore)
``abort``    a rank gave ``v`` up (skipped, or its staging failed)
==========  ==================================================================================

A version's life across the tiers -- begun, written per tier, committed per tier, evicted,
abandoned -- is these records, and the engine asks the index which versions the node's memory
tiers hold whole (:meth:`Manifest.committed`).

**No training process maps the environment.** LMDB reads through a memory map, and touching a
map whose file someone cut short kills the process with ``SIGBUS``; a node root lives in shared
memory, where anyone may cut a file short. So one small process per node maps it
(:mod:`tiercheck.consistency.manifestd`), and a :class:`Manifest` is that process's client over
a local socket: the first handle of a node starts it, the others find it, and it exits a few
seconds after its last client. If it dies (a file cut short under it, a ``kill``), the handles
say so once, start a new one and go on; an environment damaged at rest (cut short, garbled,
another format, a ``lock.mdb`` of garbage) is found before anyone maps it, set aside as
``manifest.damaged-<UTC time>`` in the manifest folder, and started anew. The first handle
to connect to that new process -- on a node, usually the one that started it -- is told
(:attr:`Manifest.notes`: one WARNING, counted by the checkpointer of that rank).

The manifest knows keys and versions, never tensors. It is a record of the past, not the source
of truth for recovery: recovery trusts only what the tiers themselves prove (blob checksums and
the persistent tier's ``COMMIT`` objects), so a lost or damaged manifest costs history, never
data.

A node root written by the manifest of tiercheck 0.1's journal (``manifest/journal``) is read
once, with ``pread``: its records are carried over into the environment and the file renamed
``journal.carried-over`` (or, if nothing in it can be read, ``journal.damaged-<UTC time>``).

Every method is synchronous (a round trip to the node's manifest process: tens of
microseconds); async callers run them in a thread, as they do all file work.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

from tiercheck._process import pid_alive
from tiercheck.consistency import manifestd
from tiercheck.consistency.records import (
    Abort,
    Begin,
    Commit,
    Evict,
    Record,
    Written,
    parse_frames,
    parse_record,
    record_fields,
)
from tiercheck.errors import ManifestError

#: The name :class:`Written` had before the glossary gave "durable" one meaning (deprecated).
Durable = Written

__all__ = [
    "JOURNAL",
    "Abort",
    "Begin",
    "Commit",
    "Evict",
    "Manifest",
    "Record",
    "Written",
]

logger = logging.getLogger("tiercheck")

#: The file of the journal manifests of tiercheck 0.1 wrote (carried over when found).
JOURNAL = "journal"
#: How long a handle waits for a server it started to answer (seconds).
START_TIMEOUT = 20.0
#: How long a handle waits for a new connection's greeting before trying again (seconds).
HELLO_TIMEOUT = 5.0
#: How long a handle waits for an answer before it takes the manifest process as stuck.
REQUEST_TIMEOUT = 60.0
#: After a server could not be started, how long a handle fails at once before trying again.
RETRY_AFTER = 10.0
# Appends of a carried-over journal are sent this many records at a time.
_CARRY_BATCH = 5000
# Starts the manifest process without importing tiercheck's package (and so torch): the two
# packages it needs are made as empty namespaces over their folders, and their modules import
# the standard library, lmdb and msgpack only. A few tens of milliseconds instead of seconds.
_BOOT = (
    "import sys, types\n"
    "for name, path in (('tiercheck', sys.argv[1]), ('tiercheck.consistency', sys.argv[2])):\n"
    "    package = types.ModuleType(name)\n"
    "    package.__path__ = [path]\n"
    "    sys.modules[name] = package\n"
    "from tiercheck.consistency.manifestd import main\n"
    "sys.exit(main(sys.argv[3:]))\n"
)
_CONSISTENCY = os.path.dirname(os.path.abspath(manifestd.__file__))


class Manifest:
    """A handle on one node's manifest (see the module docstring).

    Args:
        path: the manifest folder (created if missing, mode 0700).

    Raises:
        ManifestError: the folder cannot be made, or no manifest process can be started.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.path.realpath(os.fspath(path))
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None
        self._closed = False
        self._down_until = 0.0
        self._lost_logged = False
        #: Damage a new manifest process found and set aside, told to the first handle that
        #: connected to it: this one (one line each; logged at WARNING once, here).
        self.notes: list[str] = []
        #: How many times this handle found its manifest process gone and started another.
        self.restarts = 0
        #: The pid of the manifest process this handle talks to.
        self.server_pid: int | None = None
        try:
            os.makedirs(self.path, mode=0o700, exist_ok=True)
        except OSError as exc:
            raise ManifestError(
                f"cannot open the manifest at {self.path}: {exc}. Recovery proceeds from what "
                "the tiers prove."
            ) from exc
        with self._lock:
            self._connect()
        try:
            _carry_over(self)
        except OSError as exc:  # history only: the manifest itself is open and works
            logger.warning("tiercheck: cannot carry over the journal in %s: %r", self.path, exc)

    # --- the server ---------------------------------------------------------------------------

    def _connect(self) -> None:
        """Connect to the node's manifest process, starting one where none answers."""
        if time.monotonic() < self._down_until:
            raise ManifestError(
                f"no manifest process for {self.path} (starting one failed moments ago)"
            )
        try:
            address = manifestd.socket_address(self.path)
        except OSError as exc:
            raise ManifestError(f"cannot open the manifest at {self.path}: {exc}") from exc
        deadline = time.monotonic() + START_TIMEOUT
        pause, started = 0.002, 0.0
        while True:
            sock = self._try_connect(address)
            if sock is not None:
                reply = self._hello(sock)
                if reply is not None:
                    break
                # Accepted by a manifest process that was dying (killed, or exiting idle).
            if time.monotonic() > deadline:
                self._down_until = time.monotonic() + RETRY_AFTER
                raise ManifestError(
                    f"cannot start the manifest process for {self.path} (see its server.log); "
                    "running without history, checkpoints are unaffected"
                )
            if time.monotonic() - started > 1.0:
                # None answers: start one (again after a while: the one started may have
                # found another still holding the folder, exiting). One that cannot start
                # says so at once: no waiting out the deadline for it.
                try:
                    _start_server(self.path)
                except ManifestError:
                    self._down_until = time.monotonic() + RETRY_AFTER
                    raise
                started = time.monotonic()
                continue  # it answers now, unless another one holds the folder
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        self._sock = sock
        # A handle dropped without close() (a process dying on purpose in a test, a caller's
        # bug) closes its connection when collected, as a file would.
        self._finalizer = weakref.finalize(self, sock.close)
        self.server_pid = int(reply["ok"]["pid"])
        for note in reply["ok"]["notes"]:
            self.notes.append(note)
            logger.warning("tiercheck: %s", note)

    def _hello(self, sock: socket.socket) -> dict[str, Any] | None:
        """The server's greeting on a new connection, or ``None`` (the socket closed) where it
        went away meanwhile."""
        try:
            # A server accepts within a few milliseconds, or is stuck (stopped, starved):
            # either way, the caller tries again rather than waits on it.
            sock.settimeout(HELLO_TIMEOUT)
            manifestd.send_message(sock, {"op": "hello"})
            reply = manifestd.recv_message(sock)
            sock.settimeout(REQUEST_TIMEOUT)
        except (OSError, manifestd.StoreError):
            reply = None
        if not isinstance(reply, dict) or not isinstance(reply.get("ok"), dict):
            sock.close()
            return None
        return reply

    @staticmethod
    def _try_connect(address: str | bytes) -> socket.socket | None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(address)
        except (ConnectionRefusedError, FileNotFoundError):
            sock.close()
            return None
        except OSError:
            sock.close()
            raise
        return sock

    def _call(self, op: str, *args: Any) -> Any:
        """One request to the manifest process; a process found gone is replaced and the request
        sent once more (every request is idempotent for the index)."""
        with self._lock:
            if self._closed:
                raise ManifestError(f"the manifest at {self.path} is closed")
            for attempt in range(2):
                if self._sock is None:
                    self._connect()
                assert self._sock is not None
                try:
                    manifestd.send_message(self._sock, {"op": op, "args": list(args)})
                    reply = manifestd.recv_message(self._sock)
                except TimeoutError:
                    # A manifest process that does not answer in REQUEST_TIMEOUT is stuck: it
                    # holds nothing a new one cannot rebuild, so it goes.
                    self._kill_server()
                    reply = None
                except (OSError, manifestd.StoreError):
                    reply = None
                if reply is None:
                    self._lost(attempt)
                    continue
                if "err" in reply:
                    if reply.get("kind") == "damaged":
                        self._drop_socket()
                    raise ManifestError(f"the manifest at {self.path}: {reply['err']}")
                return reply["ok"]
        raise ManifestError(
            f"the manifest process for {self.path} went away twice during one request"
        )

    def _lost(self, attempt: int) -> None:
        """The manifest process stopped answering: forget it (the next call starts another)."""
        pid = self.server_pid
        self._drop_socket()
        self.restarts += 1
        if not self._lost_logged:
            self._lost_logged = True
            logger.warning(
                "tiercheck: the node's manifest process (pid %s) for %s is gone; starting a new "
                "one (history since its last append may be lost, checkpoints are not)%s",
                pid,
                self.path,
                "" if attempt == 0 else "; it went away again",
            )

    def _kill_server(self) -> None:
        pid = self.server_pid
        if pid is not None:
            logger.error(
                "tiercheck: the node's manifest process (pid %d) did not answer in %.0f s; "
                "killing it",
                pid,
                REQUEST_TIMEOUT,
            )
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)

    def _drop_socket(self) -> None:
        self._sock = None
        if self._finalizer is not None:
            self._finalizer()  # closes the socket, once
            self._finalizer = None

    # --- writing ------------------------------------------------------------------------------

    def append(self, *records: Record) -> None:
        """Append ``records`` to the log and apply them to the index, all or none."""
        now = time.time()
        stamped = [r if r.time else dataclasses.replace(r, time=now) for r in records]
        self._call("append", [record_fields(r) for r in stamped])

    def rebuild_index(self) -> None:
        """Drop the index and derive it again from the whole log (one transaction)."""
        self._call("rebuild_index")

    def compact(self, keep_after: int) -> int:
        """Delete the log records of versions older than ``keep_after`` that no index entry
        mentions (evicted from every tier, or aborted), and their ``versions`` entries.

        Returns the number of log records removed. The records of a version still present in
        the ``blobs`` or ``commits`` index are never touched, so a rebuild after compaction
        gives the same index as before it. One transaction: a crash at any moment leaves the
        log as it was or compacted, never in between; the pages freed are reused.
        """
        return int(self._call("prune", keep_after))

    def compact_if_grown(self, keep_after: int, *, min_records: int = 1000, growth: int = 4) -> int:
        """:meth:`compact` once the log has grown well past what the last compaction left.

        Due when the log holds more than ``min_records`` records and more than ``growth``
        times as many as the last compaction left (records of versions still held are
        kept, so a log that is mostly live is not pruned at every save: the work stays a
        constant per append). Returns the number of records removed (0 when not due).
        """
        return int(self._call("prune", keep_after, min_records, growth))

    # --- reading ------------------------------------------------------------------------------

    def log_size(self) -> int:
        """How many records the log holds."""
        return int(self._call("log_size"))

    def log(self) -> Iterator[Record]:
        """Every record still in the log, oldest first."""
        found = self._call("log")
        records = [parse_record(f, f"the log of {self.path}") for f in found]
        yield from records

    def blobs(
        self, tier: str | None = None, version: int | None = None, rank: int | None = None
    ) -> list[Written]:
        """Written, not evicted blobs, filtered by tier, version and rank; sorted."""
        found = self._call("blobs", tier, version, rank)
        return [_written(f, self.path) for f in found]

    def committed(self, tier: str) -> list[int]:
        """Versions committed in ``tier`` and not since evicted, ascending."""
        return [int(v) for v in self._call("committed", tier)]

    def is_committed(self, tier: str, version: int) -> bool:
        """Whether ``version`` is committed in ``tier``."""
        return bool(self._call("is_committed", tier, version))

    def versions(self) -> dict[int, dict[str, Any]]:
        """Per version: which ranks began and aborted it, its kind and its base."""
        return {int(v): entry for v, entry in self._call("versions")}

    def dump_index(self) -> dict[str, Any]:
        """The whole index as plain data (for tests and ``tiercheck inspect``)."""
        found = self._call("dump_index")
        blobs = [_written(f, self.path) for f in found["blobs"]]
        commits = [
            c
            for c in (parse_record(f, f"the index of {self.path}") for f in found["commits"])
            if isinstance(c, Commit)
        ]
        return {
            "blobs": {(b.tier, b.version, b.rank): b for b in sorted(blobs, key=_blob_order)},
            "commits": {
                (c.tier, c.version): c for c in sorted(commits, key=lambda c: (c.tier, c.version))
            },
            "versions": {int(v): entry for v, entry in found["versions"]},
        }

    # --- lifecycle ----------------------------------------------------------------------------

    def close(self) -> None:
        """Close this handle (other handles, in this process or others, are not affected)."""
        with self._lock:
            self._closed = True
            self._drop_socket()

    def __enter__(self) -> Manifest:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Manifest({self.path!r})"


def _start_server(path: str) -> None:
    """Launch a manifest process for the folder (it detaches; if another holds the folder's
    server lock already, it exits at once)."""
    log = os.path.join(path, "server.log")
    try:
        with open(log, "ab") as err:
            done = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    _BOOT,
                    os.path.dirname(_CONSISTENCY),
                    _CONSISTENCY,
                    "--detach",
                    path,
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
                cwd=path,  # nothing of the caller's folder shadows lmdb or msgpack
                close_fds=True,
                check=False,
                timeout=START_TIMEOUT,
            )
    except (OSError, subprocess.SubprocessError) as exc:
        raise ManifestError(f"cannot start the manifest process for {path}: {exc}") from exc
    if done.returncode != 0:
        raise ManifestError(
            f"the manifest process for {path} could not start (exit {done.returncode}; its "
            f"error is in {log}: {_last_line(log)})"
        )


def _last_line(path: str) -> str:
    """The last line of the text file ``path`` (its last 4 KiB read), or ``""``."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 4096))
            lines = f.read().decode(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1] if lines else ""


# --- a journal of tiercheck 0.1 ------------------------------------------------------------


def _carry_over(manifest: Manifest) -> None:
    """Carry the records of a ``journal`` of tiercheck 0.1 over into the environment, once.

    The handle that renames it ``journal.carrying-<pid>`` carries it; one killed meanwhile
    leaves that name, which the next handle of a process that outlives it takes back
    (:func:`_take_back_abandoned`). Records carried twice are in the log twice; the index is
    the same. Where the manifest process fails meanwhile, the journal goes back under its name
    for the next opening: nothing is set aside that was not found damaged."""
    journal = os.path.join(manifest.path, JOURNAL)
    _take_back_abandoned(journal)
    if not os.path.exists(journal):
        return
    mine = f"{journal}.carrying-{os.getpid()}"
    try:
        os.rename(journal, mine)  # one handle of the node wins; the others go on
    except FileNotFoundError:
        return
    except OSError as exc:
        logger.warning("tiercheck: cannot carry over the journal %s: %s", journal, exc)
        return
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    try:
        with open(mine, "rb") as f:
            data = f.read()
        records, damage = _journal_records(data, journal)
    except OSError as exc:
        records, damage = [], repr(exc)
    try:
        for i in range(0, len(records), _CARRY_BATCH):
            manifest.append(*records[i : i + _CARRY_BATCH])
    except ManifestError as exc:
        _give_back(mine, journal)
        logger.warning(
            "tiercheck: carrying the journal %s over failed (%s); it is carried at the next "
            "opening",
            journal,
            exc,
        )
        return
    done = f"{journal}.carried-over" if records else f"{journal}.damaged-{stamp}"
    try:
        os.rename(mine, done)
    except OSError as exc:
        # Taken back meanwhile by a handle that could not see this process (another pid
        # namespace), or a folder that refuses the rename: the records are in the environment
        # either way; a journal left as carrying-<pid> is taken back once this process is gone
        # and carried again (the log gets the records twice, the index stays the same).
        logger.warning("tiercheck: cannot rename the carried journal %s: %s", mine, exc)
        return
    if records:
        logger.info(
            "tiercheck: carried %d records of the journal %s over into the LMDB manifest%s",
            len(records),
            journal,
            f" (the rest is damaged: {damage})" if damage else "",
        )
    else:
        logger.warning(
            "tiercheck: the journal %s holds no record that can be read (%s); set aside as "
            "%s (its history is lost, checkpoints are not)",
            journal,
            damage or "empty",
            done,
        )


def _take_back_abandoned(journal: str) -> None:
    """Put back under its name a journal whose carrying process is gone (killed mid-way)."""
    folder, name = os.path.split(journal)
    try:
        entries = os.listdir(folder)
    except OSError:
        return
    for entry in sorted(entries):
        pid = entry.removeprefix(f"{name}.carrying-")
        if entry == pid or not pid.isdigit() or pid_alive(int(pid)):
            continue
        _give_back(os.path.join(folder, entry), journal)


def _give_back(taken: str, journal: str) -> None:
    """Rename ``taken`` back to ``journal``, never over one that is there again."""
    try:
        os.link(taken, journal)  # fails where a journal is back under the name
        os.unlink(taken)
    except FileExistsError:
        return
    except OSError as exc:
        logger.warning("tiercheck: cannot put the journal %s back: %s", taken, exc)


def _blob_order(record: Written) -> tuple[str, int, int]:
    return (record.tier, record.version, record.rank)


def _written(fields: Any, path: str) -> Written:
    record = parse_record(fields, f"the index of {path}")
    if not isinstance(record, Written):
        raise ManifestError(f"the manifest at {path} indexes {record!r} as a written blob")
    return record


def _journal_records(data: bytes, path: str) -> tuple[list[Record], str | None]:
    """The records of a tiercheck 0.1 journal's bytes, up to its first damage (described)."""
    parsed = parse_frames(data, 0, path, tolerant=True)
    records: list[Record] = []
    damage = None if parsed.end == len(data) else f"unreadable from byte {parsed.end}"
    for i, body in enumerate(parsed.bodies):
        if "meta" in body:
            continue
        if i == 0:
            return [], "it does not start with its format"
        try:
            records.extend(
                parse_record(fields, f"record #{len(records)} of {path}")
                for fields in body.get("records", [])
            )
        except ManifestError as exc:
            return records, str(exc)
    return records, damage
