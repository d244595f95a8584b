"""The node's manifest process: the one process of a node that maps the manifest's LMDB environment.

An LMDB environment is read through a memory map, and a process that touches a page of a map
whose file was cut short under it dies of ``SIGBUS`` -- a signal Python cannot catch. A node
root lives in shared memory where anyone may cut a file short (an operator's cleanup, a second
job on the same root). So no training process maps the environment: one small process per node
does, and the node's ranks talk to it over a local socket
(:class:`~tiercheck.consistency.manifest.Manifest` is the client). If that process dies, the
ranks lose history, never a checkpoint: they say so once and start a new one, which finds the
damage at rest, sets the environment aside and starts anew.

This module is the server and its wire; :mod:`tiercheck.consistency.manifest_files` checks an
environment without mapping it and sets a damaged one aside, and
:mod:`tiercheck.consistency.manifest_store` is the environment itself. The three import the
standard library, ``lmdb`` and ``msgpack`` only (never ``torch`` or the rest of tiercheck), so a
server starts in a few tens of milliseconds.

* :func:`serve` -- the process: takes the manifest folder's server lock, checks the environment
  (:func:`~tiercheck.consistency.manifest_files.check_unmapped`), sets a damaged one aside
  (``manifest.damaged-<UTC time>`` in the manifest folder), opens it
  (:class:`~tiercheck.consistency.manifest_store.Store`: one write transaction per append
  holding the log records and the index updates together), answers requests (a thread per
  connection: readers see a snapshot and never wait for the writer; writers take LMDB's own
  lock), and exits once no client has been connected for :data:`IDLE_EXIT` seconds or the
  folder it serves is gone.

The environment's tables (named databases):

============  ============================================================================
``log``       sequence (8 bytes, big-endian) -> one record (msgpack, its ``op`` first)
``blobs``     tier, version, rank -> sequence of the ``durable`` (written) record
``commits``   tier, version -> sequence of the ``commit`` record
``versions``  version -> which ranks began and aborted it, its kind and base (msgpack)
``meta``      ``format`` -> ``FORMAT`` (2); ``pruned`` -> log records left by the last prune
============  ============================================================================
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import socket
import struct
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import lmdb
import msgpack

from tiercheck.consistency.manifest_files import (
    DAMAGED_PREFIX,
    DATA,
    LOCK,
    SERVER_LOCK,
    check_at_rest,
    check_unmapped,
    served,
    set_aside,
)
from tiercheck.consistency.manifest_store import KILL_AT_VARIABLE, Store, StoreError

__all__ = [
    "DAMAGED_PREFIX",
    "DATA",
    "IDLE_EXIT",
    "KILL_AT_VARIABLE",
    "LOCK",
    "SERVER_LOCK",
    "StoreError",
    "check_at_rest",
    "check_unmapped",
    "main",
    "recv_message",
    "send_message",
    "serve",
    "served",
    "socket_address",
]

#: A server with no client for this long exits (seconds).
IDLE_EXIT = 5.0
#: The largest message either side accepts (a log of a few hundred thousand records).
MAX_MESSAGE = 1 << 28

# Linux has abstract sockets: nothing on disk to go stale or to be too long a path.
_ABSTRACT = "linux" in sys.platform
_LEN = struct.Struct(">I")


# --- the wire ---------------------------------------------------------------------------------


def socket_address(folder: str) -> str | bytes:
    """The address the server of the manifest folder ``folder`` listens on.

    Linux: an abstract socket named by the folder's path and inode (nothing on disk to go
    stale; a folder deleted and made again at the same path gets another server). Elsewhere: a
    socket file in the folder.
    """
    st = os.stat(folder)
    if _ABSTRACT:
        digest = hashlib.sha256(f"{folder}\0{st.st_dev}\0{st.st_ino}".encode()).hexdigest()
        return b"\0tiercheck-manifest-" + digest[:32].encode()
    return os.path.join(folder, "server.sock")


def send_message(sock: socket.socket, body: Any) -> None:
    """Send ``body`` (msgpack) with its length before it."""
    data = msgpack.packb(body, use_bin_type=True)
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv_exactly(sock: socket.socket, size: int) -> bytes | None:
    parts, done = [], 0
    while done < size:
        chunk = sock.recv(min(size - done, 1 << 20))
        if not chunk:
            return None
        parts.append(chunk)
        done += len(chunk)
    return b"".join(parts)


def recv_message(sock: socket.socket) -> Any:
    """The next message, or ``None`` where the other side closed the connection."""
    head = _recv_exactly(sock, _LEN.size)
    if head is None:
        return None
    (size,) = _LEN.unpack(head)
    if size > MAX_MESSAGE:
        raise StoreError(f"a message of {size} bytes is over {MAX_MESSAGE}")
    body = _recv_exactly(sock, size)
    if body is None:
        return None
    return msgpack.unpackb(body, strict_map_key=False)


class _Server:
    """One node's manifest server (see :func:`serve`)."""

    def __init__(self, folder: str, listener: socket.socket, store: Store, notes: list[str]):
        self.folder = folder
        self.listener = listener
        self.store = store
        self.notes = notes  # damage found at start: told to the first client, once
        self.lock = threading.Lock()
        self.clients = 0
        self.idle_since = time.monotonic()
        self.stopping = False
        self.identity = os.stat(folder)
        self.handlers: dict[str, Callable[..., Any]] = {
            "append": self.store.append,
            "log": self.store.log_records,
            "log_size": self.store.log_size,
            "blobs": self.store.blobs_of,
            "committed": self.store.committed,
            "is_committed": self.store.is_committed,
            "versions": self.store.versions_of,
            "dump_index": self.store.dump_index,
            "rebuild_index": self.store.rebuild_index,
            "prune": self.store.prune,
            "ping": os.getpid,
        }

    def run(self) -> None:
        self.listener.settimeout(0.5)
        while not self.stopping:
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                if self._done():
                    break
                continue
            if not self._trusted(conn):
                conn.close()
                continue
            with self.lock:
                self.clients += 1
            threading.Thread(target=self._client, args=(conn,), daemon=True).start()

    @staticmethod
    def _trusted(conn: socket.socket) -> bool:
        """Whether the peer runs as this server's user (or root): an abstract socket has no
        file permissions, so any local user could connect."""
        if not hasattr(socket, "SO_PEERCRED"):
            return True  # a socket file in the folder (mode 0700) guards it instead
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _pid, uid, _gid = struct.unpack("3i", creds)
        return uid in (0, os.getuid())

    def _done(self) -> bool:
        """Whether to exit: idle too long, or the folder served is gone or replaced."""
        try:
            st = os.stat(self.folder)
            data = os.stat(os.path.join(self.folder, DATA))
        except FileNotFoundError:
            return True
        if (st.st_dev, st.st_ino) != (self.identity.st_dev, self.identity.st_ino):
            return True
        if data.st_nlink == 0:
            return True
        with self.lock:
            return self.clients == 0 and time.monotonic() - self.idle_since > IDLE_EXIT

    def _client(self, conn: socket.socket) -> None:
        try:
            with conn:
                while True:
                    request = recv_message(conn)
                    if request is None:
                        return
                    send_message(conn, self._answer(request))
        except (OSError, StoreError):
            return  # the client went away mid-message: nothing of it was applied
        finally:
            with self.lock:
                self.clients -= 1
                self.idle_since = time.monotonic()

    def _answer(self, request: Any) -> dict[str, Any]:
        if not isinstance(request, dict) or request.get("op") not in (*self.handlers, "hello"):
            return {"err": f"unknown request {request!r}", "kind": "request"}
        if self.stopping:
            return {"err": "the manifest was found damaged and set aside", "kind": "damaged"}
        if request["op"] == "hello":
            with self.lock:
                notes, self.notes = self.notes, []
            return {"ok": {"pid": os.getpid(), "notes": notes}}
        try:
            return {"ok": self.handlers[request["op"]](*request.get("args", ()))}
        except StoreError as exc:
            return {"err": str(exc), "kind": "request"}
        except _DAMAGED as exc:
            # A page garbled or cut away under the server (LMDB says so in several words: a
            # corrupt page, a page not found, a panic, a transaction it failed inside): the
            # environment is set aside (renaming a mapped file is harmless) and this server
            # stops; the next one starts anew. Answering a mere store error instead would keep
            # a damaged environment in service, failing every request that reads that page.
            with self.lock:
                if not self.stopping:
                    self.stopping = True
                    set_aside(
                        self.folder,
                        f"LMDB could not read it while serving: {type(exc).__name__}: {exc}",
                    )
            return {
                "err": f"the manifest is damaged: {type(exc).__name__}: {exc}",
                "kind": "damaged",
            }
        except (lmdb.Error, OSError, TypeError, ValueError, KeyError) as exc:
            # Answered, never a dropped connection: the client would take that for a dead
            # process and send the request again.
            return {"err": f"{type(exc).__name__}: {exc}", "kind": "store"}


#: What LMDB raises, serving, when the environment's pages are not what it wrote.
_DAMAGED = (
    lmdb.CorruptedError,
    lmdb.PageNotFoundError,
    lmdb.PanicError,
    lmdb.InvalidError,
    lmdb.BadTxnError,
)


def _open_store(folder: str, notes: list[str]) -> Store:
    """Open the environment in ``folder``: one damaged at rest (or one LMDB finds corrupt when
    opened) is set aside first and a new one made."""
    why = check_unmapped(folder)
    if why is None:
        try:
            store = Store(folder)
            store.log_size()
            store.versions_of()
            return store
        except (lmdb.Error, StoreError, ValueError, struct.error) as exc:
            why = f"{type(exc).__name__}: {exc}"
    aside = set_aside(folder, why)
    notes.append(
        f"the node's manifest at {folder} was damaged ({why}); it was set aside as {aside} and "
        "a new one started: its history is lost, never a checkpoint (restore trusts the tiers)"
    )
    return Store(folder)


def serve(folder: str, ready: Callable[[bytes], None] | None = None) -> int:
    """Serve the manifest folder ``folder`` until idle (see the module docstring).

    ``ready`` is told ``b"ok"`` once the environment is open and the socket listens, or
    ``b"busy"`` where another process serves the folder; an exception before either means
    this process could not start. Returns 0.
    """
    tell = ready or (lambda _word: None)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    lock_fd = os.open(
        os.path.join(folder, SERVER_LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600
    )
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            tell(b"busy")  # another server holds it
            return 0
        raise
    address = socket_address(folder)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    if isinstance(address, str):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(address)
    try:
        listener.bind(address)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            tell(b"busy")  # a server of an earlier folder at this path is still exiting
            return 0
        raise
    listener.listen(64)
    notes: list[str] = []
    # Nobody else has the environment open (this process holds the server lock): a lock file
    # holds only live processes' reader slots, so a sound one is reset by LMDB on open and a
    # garbled one is caught by check_at_rest.
    store = _open_store(folder, notes)
    tell(b"ok")
    try:
        _Server(folder, listener, store, notes).run()
    finally:
        listener.close()
        if isinstance(address, str):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(address)
        store.close()
        os.close(lock_fd)
    return 0


def _detach() -> tuple[bool, Callable[[bytes], None] | None, int]:
    """Fork a server that outlives its starter.

    In the server: ``(True, ready, 0)``, ``ready`` telling the starter how the start went. In
    the starter: ``(False, None, code)`` once the server said so (or died): 0 when it serves
    the folder (or another does), 1 when it could not start -- so the client that launched the
    starter learns that at once, and reaps it, leaving no zombie.
    """
    readable, writable = os.pipe()
    if os.fork():
        os.close(writable)
        said = b""
        while chunk := os.read(readable, 16):
            said += chunk
        os.close(readable)
        return False, None, 0 if said in (b"ok", b"busy") else 1
    os.close(readable)
    os.setsid()
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):
        os.dup2(null, fd)
    os.close(null)

    def ready(word: bytes) -> None:
        os.write(writable, word)
        os.close(writable)

    return True, ready, 0


def main(argv: list[str] | None = None) -> int:
    """``python manifestd.py [--detach] FOLDER``: serve one manifest folder (the client starts
    it so). What goes wrong is written to standard error (the client points it at
    ``server.log`` in the folder). With ``--detach`` it returns once the server it forked
    serves the folder (0) or failed to start (1)."""
    args = sys.argv[1:] if argv is None else argv
    detach = args[:1] == ["--detach"]
    args = args[1:] if detach else args
    if len(args) != 1:
        print("usage: manifestd.py [--detach] MANIFEST_FOLDER", file=sys.stderr)
        return 2
    ready = None
    if detach:
        server, ready, code = _detach()
        if not server:
            return code
    try:
        code = serve(os.path.realpath(args[0]), ready)
    except BaseException:
        if not detach:
            raise
        traceback.print_exc()
        code = 1
    if detach:
        # Connections' threads may be inside an LMDB call; the environment is closed and
        # every transaction committed or never begun: leave without unwinding them.
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
