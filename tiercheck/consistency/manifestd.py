"""The node's manifest process: the one process of a node that maps the manifest's LMDB environment.

An LMDB environment is read through a memory map, and a process that touches a page of a map
whose file was cut short under it dies of ``SIGBUS`` -- a signal Python cannot catch. A node
root lives in shared memory where anyone may cut a file short (an operator's cleanup, a second
job on the same root). So no training process maps the environment: one small process per node
does, and the node's ranks talk to it over a local socket
(:class:`~tiercheck.consistency.manifest.Manifest` is the client). If that process dies, the
ranks lose history, never a checkpoint: they say so once and start a new one, which finds the
damage at rest, sets the environment aside and starts anew.

This module is the server and what it needs, and nothing more: it imports the standard library,
``lmdb`` and ``msgpack`` only (never ``torch`` or the rest of tiercheck), so a server starts in a
few tens of milliseconds, and the command line can use its checks at rest without starting one.

* :func:`check_at_rest` -- what is wrong with an environment at rest, read with ``pread`` (never
  mapped): both meta pages (magic, version, page size), the newer one's last page within the
  file, and ``lock.mdb``'s header. About 10 us.
* :class:`Store` -- the environment and its tables, one write transaction per append holding the
  log records and the index updates together.
* :func:`serve` -- the process: takes the manifest folder's server lock, sets a damaged
  environment aside (``manifest.damaged-<UTC time>`` in the manifest folder), opens the
  environment, answers requests (a thread per connection: readers see a snapshot and never wait
  for the writer; writers take LMDB's own lock), and exits once no client has been connected
  for :data:`IDLE_EXIT` seconds or the folder it serves is gone.

The environment's tables (named databases):

============  ============================================================================
``log``       sequence (8 bytes, big-endian) -> one record (msgpack, its ``op`` first)
``blobs``     tier, version, rank -> sequence of the ``durable`` (written) record
``commits``   tier, version -> sequence of the ``commit`` record
``versions``  version -> which ranks began and aborted it, its kind and base (msgpack)
``meta``      ``format`` -> :data:`FORMAT`; ``pruned`` -> log records left by the last prune
============  ============================================================================
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import lmdb
import lmdb.verify as lmdb_verify
import msgpack

__all__ = [
    "DATA",
    "FORMAT",
    "IDLE_EXIT",
    "KILL_AT_VARIABLE",
    "LOCK",
    "SERVER_LOCK",
    "Store",
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

#: The environment's data file and lock file, in the manifest folder.
DATA = "data.mdb"
LOCK = "lock.mdb"
#: The file whose exclusive ``flock`` the serving process holds for its life.
SERVER_LOCK = "server.lock"
#: The prefix of a damaged environment set aside in the manifest folder.
DAMAGED_PREFIX = "manifest.damaged-"
#: The environment's own format (in the ``meta`` table).
FORMAT = 2
#: A server with no client for this long exits (seconds).
IDLE_EXIT = 5.0
#: The largest message either side accepts (a log of a few hundred thousand records).
MAX_MESSAGE = 1 << 28
#: The map's size: virtual address space, not memory (pages are written as they are used).
MAP_SIZE = 1 << 30

_MAGIC = 0xBEEFC0DE
_DATA_VERSION = 1  # LMDB 0.9's data format
_LOCK_VERSION = 1  # LMDB 0.9's lock format (mti_format's low bits)
_PAGE_HEADER = 16
_P_META = 0x08
# Linux has abstract sockets: nothing on disk to go stale or to be too long a path.
_ABSTRACT = "linux" in sys.platform
_LEN = struct.Struct(">I")
_SEQ = struct.Struct(">Q")
_VR = struct.Struct(">QI")
_V = struct.Struct(">Q")


#: A crash point for tests (read when the server starts): ``append:N`` -- the server kills
#: itself with ``SIGKILL`` inside the write transaction of its N-th record, before it commits;
#: ``prune`` -- inside its first prune's transaction, the deletes made, before it commits.
KILL_AT_VARIABLE = "TIERCHECK_MANIFEST_KILL_AT"


def _kill_point() -> tuple[str, int] | None:
    spec = os.environ.get(KILL_AT_VARIABLE, "")
    op, _, count = spec.partition(":")
    if op not in ("append", "prune"):
        return None
    return op, int(count or 1)


class StoreError(Exception):
    """A request the store cannot carry out (a bad record, an environment that fails)."""


# --- checks at rest ---------------------------------------------------------------------------


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


# --- the store --------------------------------------------------------------------------------


def _tier_key(tier: str, *rest: bytes) -> bytes:
    return tier.encode() + b"\0" + b"".join(rest)


def _blob_key(tier: str, version: int, rank: int) -> bytes:
    return _tier_key(tier, _VR.pack(version, rank))


def _commit_key(tier: str, version: int) -> bytes:
    return _tier_key(tier, _V.pack(version))


def _split_tier(key: bytes) -> tuple[str, bytes]:
    tier, _, rest = bytes(key).partition(b"\0")
    return tier.decode(), rest


_OPS = {"begin", "durable", "commit", "evict", "abort"}
_INT_FIELDS = {
    "begin": ("version", "rank"),
    "durable": ("version", "rank", "size", "checksum", "raw_digest"),
    "commit": ("version",),
    "evict": ("version", "rank"),
    "abort": ("version", "rank"),
}


def _valid(fields: Any) -> dict[str, Any]:
    """``fields`` as a record the store can index (:class:`StoreError` when not one)."""
    if not isinstance(fields, dict) or fields.get("op") not in _OPS:
        raise StoreError(f"not a manifest record: {fields!r}")
    for name in _INT_FIELDS[fields["op"]]:
        value = fields.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise StoreError(f"record field {name!r} is not a count: {fields!r}")
    if fields["op"] in ("durable", "commit", "evict") and not isinstance(fields.get("tier"), str):
        raise StoreError(f"record without a tier: {fields!r}")
    return fields


class Store:
    """The manifest's LMDB environment in ``folder`` (opened here: the caller has checked it at
    rest). Thread-safe: each call is one transaction."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.env = lmdb.open(
            folder,
            map_size=MAP_SIZE,
            max_dbs=8,
            subdir=True,
            sync=False,  # a node root lives in memory, which a power loss takes anyway
            metasync=False,
            readahead=False,
            writemap=False,  # pages are written with write(): a crash leaves a txn whole or none
            lock=True,
        )
        self._kill_at = _kill_point()
        self._applied = 0
        try:
            with self.env.begin(write=True) as txn:
                self.log = self.env.open_db(b"log", txn=txn)
                self.blobs = self.env.open_db(b"blobs", txn=txn)
                self.commits = self.env.open_db(b"commits", txn=txn)
                self.versions = self.env.open_db(b"versions", txn=txn)
                self.meta = self.env.open_db(b"meta", txn=txn)
                found = txn.get(b"format", db=self.meta)
                if found is None and txn.stat(self.log)["entries"]:
                    raise StoreError(
                        f"the environment at {folder} holds a log but no format: not a manifest "
                        "this build wrote"
                    )
                if found is None:
                    txn.put(b"format", _LEN.pack(FORMAT), db=self.meta)
                elif _LEN.unpack(found)[0] != FORMAT:
                    raise StoreError(
                        f"the manifest at {folder} has format {_LEN.unpack(found)[0]}, this "
                        f"build reads format {FORMAT}"
                    )
        except BaseException:
            self.env.close()
            raise

    def close(self) -> None:
        """Close the environment."""
        self.env.close()

    # --- writing --------------------------------------------------------------------------

    def append(self, records: list[dict[str, Any]]) -> None:
        """Append ``records`` to the log and apply them to the index: one transaction."""
        checked = [_valid(r) for r in records]
        with self.env.begin(write=True) as txn:
            cursor = txn.cursor(db=self.log)
            seq = _SEQ.unpack(cursor.key())[0] + 1 if cursor.last() else 0
            for fields in checked:
                txn.put(_SEQ.pack(seq), msgpack.packb(fields, use_bin_type=True), db=self.log)
                self._apply(txn, seq, fields)
                seq += 1
                self._applied += 1
                self._crash_point("append", self._applied)

    def _crash_point(self, op: str, count: int) -> None:
        if self._kill_at == (op, count):
            os.kill(os.getpid(), signal.SIGKILL)

    def _apply(self, txn: lmdb.Transaction, seq: int, fields: dict[str, Any]) -> None:
        """Apply one record (log sequence ``seq``) to the index: the only place it is derived."""
        op, version = fields["op"], fields["version"]
        if op in ("begin", "abort"):
            raw = txn.get(_V.pack(version), db=self.versions)
            entry = (
                {"begun": [], "aborted": [], "kind": None, "base": None}
                if raw is None
                else msgpack.unpackb(raw)
            )
            field = "begun" if op == "begin" else "aborted"
            if fields["rank"] not in entry[field]:
                entry[field] = sorted([*entry[field], fields["rank"]])
            if op == "begin":
                entry["kind"], entry["base"] = fields.get("kind"), fields.get("base")
            txn.put(_V.pack(version), msgpack.packb(entry, use_bin_type=True), db=self.versions)
        elif op == "durable":
            key = _blob_key(fields["tier"], version, fields["rank"])
            txn.put(key, _SEQ.pack(seq), db=self.blobs)
        elif op == "commit":
            txn.put(_commit_key(fields["tier"], version), _SEQ.pack(seq), db=self.commits)
        elif op == "evict":
            txn.delete(_blob_key(fields["tier"], version, fields["rank"]), db=self.blobs)
            # A version missing one rank's blob is no longer whole in that tier.
            txn.delete(_commit_key(fields["tier"], version), db=self.commits)

    def rebuild_index(self) -> None:
        """Drop the index and derive it again from the whole log, in one transaction."""
        with self.env.begin(write=True) as txn:
            for db in (self.blobs, self.commits, self.versions):
                txn.drop(db, delete=False)
            for key, value in txn.cursor(db=self.log):
                self._apply(txn, _SEQ.unpack(key)[0], msgpack.unpackb(value))

    def prune(self, keep_after: int, min_records: int = 0, growth: int = 0) -> int:
        """Delete the log records of versions older than ``keep_after`` that no index entry
        mentions (evicted from every tier, or aborted), and their ``versions`` entries.

        Only when the log holds more than ``min_records`` records and more than ``growth``
        times as many as the last prune left (0 and 0: always). One transaction; the pages
        freed are reused by later appends. Returns the number of records deleted.
        """
        with self.env.begin(write=True) as txn:
            count = txn.stat(self.log)["entries"]
            raw = txn.get(b"pruned", db=self.meta)
            left = _SEQ.unpack(raw)[0] if raw else 0
            if count <= max(min_records, growth * left):
                return 0
            live = {
                _V.unpack(_split_tier(k)[1][:8])[0]
                for k in txn.cursor(db=self.blobs).iternext(values=False)
            }
            live |= {
                _V.unpack(_split_tier(k)[1])[0]
                for k in txn.cursor(db=self.commits).iternext(values=False)
            }
            doomed: list[bytes] = []
            gone: set[int] = set()
            for key, value in txn.cursor(db=self.log):
                version = msgpack.unpackb(value)["version"]
                if version < keep_after and version not in live:
                    doomed.append(bytes(key))
                    gone.add(version)
            for key in doomed:
                txn.delete(key, db=self.log)
            for version in gone:
                txn.delete(_V.pack(version), db=self.versions)
            self._crash_point("prune", 1)
            txn.put(b"pruned", _SEQ.pack(count - len(doomed)), db=self.meta)
            return len(doomed)

    # --- reading --------------------------------------------------------------------------

    def log_records(self) -> list[dict[str, Any]]:
        """Every record in the log, oldest first."""
        with self.env.begin() as txn:
            return [msgpack.unpackb(v) for _k, v in txn.cursor(db=self.log)]

    def log_size(self) -> int:
        """How many records the log holds."""
        with self.env.begin() as txn:
            return int(txn.stat(self.log)["entries"])

    def blobs_of(self, tier: str | None, version: int | None, rank: int | None) -> list[Any]:
        """The written (not evicted) records, filtered; sorted by tier, version, rank."""
        out = []
        with self.env.begin() as txn:
            cursor = txn.cursor(db=self.blobs)
            start = _tier_key(tier) if tier is not None else b""
            if tier is not None and version is not None:
                start = _tier_key(tier, _V.pack(version))
            found = cursor.set_range(start) if start else cursor.first()
            while found:
                t, rest = _split_tier(cursor.key())
                if tier is not None and t != tier:
                    break
                v, r = _VR.unpack(rest)
                if tier is not None and version is not None and v != version:
                    break
                if (version is None or v == version) and (rank is None or r == rank):
                    out.append(self._logged(txn, cursor.value()))
                found = cursor.next()
        return out

    def committed(self, tier: str) -> list[int]:
        """Versions committed in ``tier`` and not since evicted, ascending."""
        out = []
        with self.env.begin() as txn:
            cursor = txn.cursor(db=self.commits)
            found = cursor.set_range(_tier_key(tier))
            while found:
                t, rest = _split_tier(cursor.key())
                if t != tier:
                    break
                out.append(_V.unpack(rest)[0])
                found = cursor.next()
        return out

    def is_committed(self, tier: str, version: int) -> bool:
        """Whether ``version`` is committed in ``tier``."""
        with self.env.begin() as txn:
            return txn.get(_commit_key(tier, version), db=self.commits) is not None

    def _logged(self, txn: lmdb.Transaction, seq: bytes) -> Any:
        """The log record an index entry points at."""
        raw = txn.get(seq, db=self.log)
        if raw is None:
            raise StoreError(f"the index points at log record {seq.hex()}, which is not there")
        return msgpack.unpackb(raw)

    def versions_of(self) -> list[list[Any]]:
        """``[version, entry]`` pairs of the ``versions`` table, ascending."""
        with self.env.begin() as txn:
            return [[_V.unpack(k)[0], msgpack.unpackb(v)] for k, v in txn.cursor(db=self.versions)]

    def dump_index(self) -> dict[str, Any]:
        """The whole index as plain data: ``blobs`` and ``commits`` as lists of records,
        ``versions`` as ``[version, entry]`` pairs."""
        with self.env.begin() as txn:
            blobs = [self._logged(txn, v) for _k, v in txn.cursor(db=self.blobs)]
            commits = [self._logged(txn, v) for _k, v in txn.cursor(db=self.commits)]
        return {"blobs": blobs, "commits": commits, "versions": self.versions_of()}


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


# --- the server -------------------------------------------------------------------------------


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
        except lmdb.CorruptedError as exc:
            # A page garbled under the server: the environment is set aside (renaming a mapped
            # file is harmless) and this server stops; the next one starts anew.
            with self.lock:
                if not self.stopping:
                    self.stopping = True
                    set_aside(self.folder, f"LMDB found it corrupt while serving: {exc}")
            return {"err": f"the manifest is damaged: {exc}", "kind": "damaged"}
        except (lmdb.Error, TypeError, ValueError, KeyError) as exc:
            return {"err": f"{type(exc).__name__}: {exc}", "kind": "store"}


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


def serve(folder: str) -> int:
    """Serve the manifest folder ``folder`` until idle (see the module docstring).

    Returns 0 (served, or another server already serves it) or 1 (could not start).
    """
    os.makedirs(folder, mode=0o700, exist_ok=True)
    lock_fd = os.open(
        os.path.join(folder, SERVER_LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600
    )
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return 0  # another server holds it
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
            return 0  # a server of an earlier folder at this path is still exiting
        raise
    listener.listen(64)
    notes: list[str] = []
    # Nobody else has the environment open (this process holds the server lock): a lock file
    # holds only live processes' reader slots, so a sound one is reset by LMDB on open and a
    # garbled one is caught by check_at_rest.
    store = _open_store(folder, notes)
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


def _detach() -> bool:
    """Fork a server that outlives its starter: ``True`` in the server, ``False`` in the starter
    (which exits at once, so the client that launched it reaps it and no zombie is left)."""
    if os.fork():
        return False
    os.setsid()
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):
        os.dup2(null, fd)
    os.close(null)
    return True


def main(argv: list[str] | None = None) -> int:
    """``python manifestd.py [--detach] FOLDER``: serve one manifest folder (the client starts
    it so). What goes wrong is written to standard error (the client points it at
    ``server.log`` in the folder)."""
    args = sys.argv[1:] if argv is None else argv
    detach = args[:1] == ["--detach"]
    args = args[1:] if detach else args
    if len(args) != 1:
        print("usage: manifestd.py [--detach] MANIFEST_FOLDER", file=sys.stderr)
        return 2
    if detach and not _detach():
        return 0
    code = serve(os.path.realpath(args[0]))
    if detach:
        # Connections' threads may be inside an LMDB call; the environment is closed and
        # every transaction committed or never begun: leave without unwinding them.
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
