"""The node's manifest: a log of what happened to every version, and its index.

One journal file per node (``manifest/journal``), shared by every rank (process) of that node.
Each :meth:`Manifest.append` writes one *frame* at the end of the file, in one ``write`` under
an exclusive ``flock``: the records of that call, together, under one checksum. A crash in the
middle of it leaves an unfinished last frame, which readers ignore and the next writer cuts
off, so an append is there whole or not at all. The index -- which blobs are durable in which
tier, which versions are committed where, what each version is -- is derived from the log, in
the memory of every handle: it replays the frames other processes appended since it last
looked, before it answers, and :meth:`Manifest.rebuild_index` replays the whole file again. The
log keeps only what is still worth telling: once it has grown well past what the last
compaction left, the checkpointer compacts it after retention (:meth:`Manifest.compact_if_grown`),
writing the records of versions still held to a new file renamed over the journal.

Records (``op`` field):

==========  ==================================================================================
``begin``    a rank started saving version ``v`` (its kind and, for a delta, its base)
``durable``  a rank's blob of ``v`` is durable in a tier: key, size, checksum, raw digest, base
``commit``   ``v`` is committed in a tier: every rank's blob of it (and of its base) is durable
``evict``    a rank removed its blob of ``v`` from a tier (retention, or truncation on restore)
``abort``    a rank gave ``v`` up (skipped, or its staging failed)
==========  ==================================================================================

Index: ``blobs`` (tier, version, rank) -> the durable record; ``commits`` (tier, version) -> the
commit record; ``versions`` version -> what ranks began/aborted it.

The journal is read with ``pread`` and written with ``write``, never mapped into memory. It lives
with the node's blobs in shared memory, where anyone may truncate it (an operator's cleanup, a
second job on the same root); a process touching a mapping of a file cut short under it dies of
``SIGBUS``, which Python cannot catch -- what an LMDB environment (read through its map) did.
Here a journal cut short is an unfinished last frame: the records past the cut are lost, the
rest is read, and a handle that had read past the cut replays the file from the start (logged).

The manifest knows keys and versions, never tensors. It is a record of the past, not the source
of truth for recovery: recovery trusts only what the tiers themselves prove (blob checksums and
the persistent tier's ``COMMIT`` objects), so a lost or corrupt manifest costs history, never
data. A journal whose bytes are damaged (a frame that fails its checksum, a file that is not a
journal, another format) raises :class:`~tiercheck.errors.ManifestError`, at opening or at the
first call that reads the damage; move the folder aside to start a new one.

Appends are not synced (``fsync``): a node root lives in memory, which a power loss takes anyway.

Every method is synchronous and quick (microseconds; a compaction or an opening reads the whole
file: about a millisecond per thousand records); async callers run them in a thread, as they do
all file work.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import logging
import os
import secrets
import socket
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import msgpack
import xxhash

from tiercheck.errors import ManifestError

__all__ = [
    "JOURNAL",
    "Abort",
    "Begin",
    "Commit",
    "Durable",
    "Evict",
    "Manifest",
    "Record",
]

logger = logging.getLogger("tiercheck")

FORMAT_VERSION = 1
#: The journal's file name in the manifest folder.
JOURNAL = "journal"
#: What manifests of tiercheck before the journal left (LMDB): never opened, never mapped.
_LMDB_FILES = ("data.mdb", "lock.mdb")
# A compaction writes the new journal under this name first (host and pid: debris of a process
# that died is recognised and removed).
_COMPACTING = "journal#compacting#"
_HOST = socket.gethostname().replace("#", "_") or "localhost"

# A frame: magic, body length, xxh32 of the body, xxh32 of the 12 bytes before; then the body.
# The header's own checksum tells a damaged length (corruption) from a file that ends inside a
# frame (an append cut short: ignored, then cut off by the next writer).
_HEADER = struct.Struct(">4sIII")
_MAGIC = b"TCMJ"
#: No frame is larger (a compaction writes the kept records in frames of at most this).
_MAX_FRAME = 1 << 24
_RECORDS_PER_FRAME = 10_000
# An append whose frame someone else's truncation displaced is written again, a few times.
_WRITE_ATTEMPTS = 4


@dataclass(frozen=True, slots=True)
class Begin:
    """A rank started saving ``version``."""

    op: ClassVar[str] = "begin"
    version: int
    rank: int
    kind: Literal["base", "delta"]
    base: int | None = None
    time: float = 0.0


@dataclass(frozen=True, slots=True)
class Durable:
    """A rank's blob of ``version`` is durable in ``tier``."""

    op: ClassVar[str] = "durable"
    version: int
    rank: int
    tier: str
    key: str
    size: int
    checksum: int
    raw_digest: int
    #: The base version this blob is a delta against, or ``None`` for a self-contained blob.
    base: int | None = None
    time: float = 0.0


@dataclass(frozen=True, slots=True)
class Commit:
    """``version`` is committed in ``tier``: whole for every rank, base included."""

    op: ClassVar[str] = "commit"
    version: int
    tier: str
    time: float = 0.0


@dataclass(frozen=True, slots=True)
class Evict:
    """A rank removed its blob of ``version`` from ``tier``."""

    op: ClassVar[str] = "evict"
    version: int
    rank: int
    tier: str
    reason: str = "retention"
    time: float = 0.0


@dataclass(frozen=True, slots=True)
class Abort:
    """A rank gave up ``version``: the whole save (skipped, or its staging or encoding failed)."""

    op: ClassVar[str] = "abort"
    version: int
    rank: int
    reason: str
    time: float = 0.0


Record = Begin | Durable | Commit | Evict | Abort
_RECORD_TYPES: dict[str, type[Record]] = {
    cls.op: cls for cls in (Begin, Durable, Commit, Evict, Abort)
}


_MISSING = object()


def _frame(body: dict[str, Any]) -> bytes:
    data = msgpack.packb(body, use_bin_type=True)
    if len(data) > _MAX_FRAME:
        raise ManifestError(f"a manifest append of {len(data)} bytes is over {_MAX_FRAME}")
    head = _HEADER.pack(_MAGIC, len(data), xxhash.xxh32_intdigest(data), 0)[:12]
    return head + struct.pack(">I", xxhash.xxh32_intdigest(head)) + data


def _fields(record: Record) -> dict[str, Any]:
    return {"op": record.op, **dataclasses.asdict(record)}


def _record(fields: Any, where: str) -> Record:
    try:
        fields = dict(fields)
        cls = _RECORD_TYPES[fields.pop("op")]
        if cls is Abort:
            # Logs written before Abort lost its `tier` field (always "", the whole save)
            # still carry it.
            fields.pop("tier", None)
        return cls(**fields)
    except (ValueError, KeyError, TypeError) as exc:
        raise ManifestError(f"manifest record at {where} is not a valid record: {exc!r}") from exc


@dataclass
class _Parsed:
    """Frames read from the journal: their bodies, where the last complete one ends, and that
    frame itself (where it starts and its bytes: what tells later whether the file was cut or
    rewritten under it)."""

    bodies: list[dict[str, Any]]
    end: int
    last: tuple[int, bytes] | None
    #: Where each frame starts (in the file).
    starts: list[int]


def _parse(data: bytes, start: int, path: str, *, tolerant: bool = False) -> _Parsed:
    """The complete frames of ``data`` (the journal's bytes from offset ``start``).

    Bytes after the last complete frame that could be the start of one are left (an append cut
    short); anything else that is not a valid frame raises :class:`ManifestError` -- unless
    ``tolerant``, where the frames before it are what is read (see ``Manifest._cut_tail``).
    """
    bodies: list[dict[str, Any]] = []
    starts: list[int] = []
    pos, last = 0, None
    while len(data) - pos >= _HEADER.size:
        magic, length, body_check, head_check = _HEADER.unpack_from(data, pos)
        where = f"byte {start + pos} of {path}"
        damage = None
        if magic != _MAGIC or xxhash.xxh32_intdigest(data[pos : pos + 12]) != head_check:
            damage = "not a record header"
        elif length > _MAX_FRAME:
            damage = f"a frame of {length} B"
        elif len(data) - pos - _HEADER.size < length:
            break  # an append cut short (a writer died, or the file was truncated)
        else:
            body = data[pos + _HEADER.size : pos + _HEADER.size + length]
            if xxhash.xxh32_intdigest(body) != body_check:
                damage = "a record fails its checksum"
        decoded: Any = None
        if damage is None:
            try:
                decoded = msgpack.unpackb(body, raw=False, strict_map_key=False)
            except (ValueError, msgpack.UnpackException) as exc:
                damage = repr(exc)
            else:
                if not isinstance(decoded, dict):
                    damage = "not a frame"
        if damage is not None:
            if tolerant:
                break
            raise ManifestError(
                f"the manifest journal is damaged at {where} ({damage}). Move the manifest "
                "folder aside: recovery proceeds from what the tiers prove."
            )
        bodies.append(decoded)
        starts.append(start + pos)
        end = pos + _HEADER.size + length
        last = (start + pos, bytes(data[pos:end]))
        pos = end
    return _Parsed(bodies, start + pos, last, starts)


class _Undo:
    """What an append changed in the index, to put back if the append fails."""

    def __init__(self) -> None:
        self.changes: list[tuple[dict[Any, Any], Any, Any]] = []

    def note(self, table: dict[Any, Any], key: Any) -> None:
        self.changes.append((table, key, table.get(key, _MISSING)))

    def rollback(self) -> None:
        for table, key, old in reversed(self.changes):
            if old is _MISSING:
                table.pop(key, None)
            else:
                table[key] = old


def _dead_compaction(name: str) -> bool:
    """Whether ``name`` is the unfinished new journal of a compaction whose process is gone."""
    if not name.startswith(_COMPACTING):
        return False
    host, _, rest = name[len(_COMPACTING) :].partition("#")
    pid_text = rest.partition("#")[0]
    if host != _HOST or not pid_text.isdigit():
        return False
    try:
        os.kill(int(pid_text), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


class Manifest:
    """The log (appended to, compacted now and then) and its index for one node. See the module
    docstring.

    Args:
        path: the manifest folder (created if missing, mode 0700); the journal is a file in it.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.path.realpath(os.fspath(path))
        self._journal = os.path.join(self.path, JOURNAL)
        self._lock = threading.Lock()
        self._notes: list[tuple[int, str, tuple[object, ...]]] = []
        self._closed = False
        self._fd = -1
        self._reset()
        try:
            os.makedirs(self.path, mode=0o700, exist_ok=True)
            self._remove_debris()
            self._open_journal()
        except OSError as exc:
            self._close_fd()
            raise ManifestError(
                f"cannot open the manifest at {self.path}: {exc}. Recovery proceeds from what "
                "the tiers prove."
            ) from exc
        try:
            with self._locked(exclusive=False):
                pass  # reads the whole journal: a damaged one fails here
        except BaseException:
            self._close_fd()
            self._closed = True
            raise
        if any(os.path.exists(os.path.join(self.path, name)) for name in _LMDB_FILES):
            logger.info(
                "tiercheck: %s holds an LMDB manifest of an older tiercheck (data.mdb); it is "
                "not read (the history in it is not shown) and may be deleted",
                self.path,
            )

    # --- the file -----------------------------------------------------------------------------

    def _reset(self) -> None:
        """Forget everything read: the next call replays the journal from its start."""
        self._offset = 0
        self._formatted = False  # the journal's first frame, its format, was read
        self._last: tuple[int, bytes] | None = None
        self._records: list[Record] = []
        self._blobs: dict[tuple[str, int, int], Durable] = {}
        self._commits: dict[tuple[str, int], Commit] = {}
        self._versions: dict[int, dict[str, Any]] = {}
        self._compacted = 0

    def _open_journal(self) -> None:
        fd = os.open(self._journal, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        self._close_fd()
        self._fd = fd

    def _close_fd(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

    def _remove_debris(self) -> None:
        with os.scandir(self.path) as entries:
            for entry in entries:
                if _dead_compaction(entry.name):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)

    @contextlib.contextmanager
    def _locked(self, *, exclusive: bool) -> Iterator[None]:
        """Hold the journal's ``flock`` (shared to read, exclusive to write) with the index
        caught up with everything appended before."""
        with self._lock:
            self._check_open()
            try:
                size = self._lock_current(exclusive)
            except OSError as exc:
                raise ManifestError(f"cannot read the manifest at {self.path}: {exc}") from exc
            try:
                try:
                    self._catch_up(size, exclusive)
                except ManifestError:
                    raise
                except OSError as exc:
                    raise ManifestError(f"cannot read the manifest at {self.path}: {exc}") from exc
                yield
            finally:
                with contextlib.suppress(OSError):
                    fcntl.flock(self._fd, fcntl.LOCK_UN)
                # Said once the lock is let go: a log handler that blocks (a full pipe) must
                # not hold up the other ranks of the node.
                notes, self._notes = self._notes, []
                for level, message, args in notes:
                    logger.log(level, message, *args)

    def _note(self, level: int, message: str, *args: object) -> None:
        """Log ``message`` once the journal's lock is let go (see ``_locked``)."""
        self._notes.append((level, message, args))

    def _lock_current(self, exclusive: bool) -> int:
        """Lock the file that is the journal now (a compaction elsewhere may have replaced it,
        someone may have removed it); return its size."""
        while True:
            fcntl.flock(self._fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            mine = os.fstat(self._fd)
            try:
                now = os.stat(self._journal)
            except FileNotFoundError:
                now = None
            if now is not None and (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino):
                return mine.st_size
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            if now is None:
                self._note(
                    logging.ERROR,
                    "tiercheck: the manifest journal %s was removed while in use; starting a new "
                    "one (the history before is lost; checkpoints are not: restore trusts the "
                    "tiers)",
                    self._journal,
                )
                os.makedirs(self.path, mode=0o700, exist_ok=True)
            self._open_journal()
            self._reset()

    def _catch_up(self, size: int, exclusive: bool) -> None:
        """Apply the frames appended since this handle last read (another process's)."""
        if size < self._offset or (self._last is not None and not self._same_last()):
            self._note(
                logging.ERROR,
                "tiercheck: the manifest journal %s was cut short or rewritten while in use "
                "(now %d bytes, %d read before); reading it again from the start: the history "
                "past the cut is lost (checkpoints are not: restore trusts the tiers)",
                self._journal,
                size,
                self._offset,
            )
            self._reset()
        if size > self._offset:
            data = self._read(self._offset, size - self._offset)
            parsed = _parse(data, self._offset, self._journal)
            for body in parsed.bodies:
                self._take(body)
            self._offset = parsed.end
            if parsed.last is not None:
                self._last = parsed.last
        if exclusive and size > self._offset:
            # An append cut short (its writer died, or the file was truncated mid-frame):
            # nobody is writing now (this handle holds the lock), so those bytes are debris.
            self._note(
                logging.WARNING,
                "tiercheck: dropping %d bytes at the end of the manifest journal %s: an append "
                "that never finished (its writer died, or the file was cut short)",
                size - self._offset,
                self._journal,
            )
            self._cut_tail()

    def _same_last(self) -> bool:
        """Whether the last frame read is still where it was (its header: one small read)."""
        assert self._last is not None
        start, frame = self._last
        return os.pread(self._fd, _HEADER.size, start) == frame[: _HEADER.size]

    def _intact(self) -> bool:
        """Whether the journal ends exactly after the last frame read, which is still there."""
        if os.fstat(self._fd).st_size != self._offset:
            return False
        if self._last is None:
            return self._offset == 0
        start, frame = self._last
        return os.pread(self._fd, len(frame), start) == frame

    def _cut_tail(self) -> None:
        """Under the exclusive lock: end the journal at the last complete frame read.

        ``ftruncate`` to a length lengthens a file that someone else cut shorter meanwhile
        (with zeros, over the end of a frame): checked afterwards, and then the journal is
        read again up to its first damage -- debris of that race, or of the cut -- and cut
        there, until it holds.
        """
        for _attempt in range(_WRITE_ATTEMPTS):
            if os.fstat(self._fd).st_size > self._offset:
                os.ftruncate(self._fd, self._offset)
            if self._intact():
                return
            self._replay_tolerant()
        raise ManifestError(
            f"cannot repair the manifest at {self.path}: the journal kept changing under its "
            "writer. Is something else truncating it?"
        )

    def _replay_tolerant(self) -> None:
        """Under the exclusive lock, after the journal changed under this writer: read it again
        from its start up to the first frame that is not whole."""
        self._note(
            logging.ERROR,
            "tiercheck: the manifest journal %s changed under its writer; reading it again up to "
            "its first damaged record (the history past it is lost; checkpoints are not)",
            self._journal,
        )
        self._reset()
        data = self._read(0, os.fstat(self._fd).st_size)
        parsed = _parse(data, 0, self._journal, tolerant=True)
        self._offset, self._last = parsed.end, parsed.last
        for i, body in enumerate(parsed.bodies):
            if not self._formatted and "meta" not in body:
                # Records where the format belongs (a frame that landed on a file cut to
                # nothing): debris like the rest from here on.
                self._offset = parsed.starts[i]
                self._last = None
                if i:
                    begin = parsed.starts[i - 1]
                    self._last = (begin, data[begin : parsed.starts[i]])
                break
            self._take(body)

    def _read(self, offset: int, size: int) -> bytes:
        parts, done = [], 0
        while done < size:
            chunk = os.pread(self._fd, size - done, offset + done)
            if not chunk:  # cut short since the fstat: what is there is what counts
                break
            parts.append(chunk)
            done += len(chunk)
        return b"".join(parts)

    def _take(self, body: dict[str, Any]) -> None:
        """Apply one frame read from the journal."""
        meta = body.get("meta")
        if meta is not None:
            version = meta.get("format") if isinstance(meta, dict) else None
            if version != FORMAT_VERSION:
                raise ManifestError(
                    f"the manifest at {self.path} has format {version}, this build reads format "
                    f"{FORMAT_VERSION}"
                )
            self._compacted = int(meta.get("compacted", 0))
            self._formatted = True
            return
        if not self._formatted:
            raise ManifestError(
                f"the manifest journal {self._journal} does not start with its format: it is not "
                "a journal this build wrote. Move the manifest folder aside."
            )
        records = body.get("records")
        if not isinstance(records, list):
            raise ManifestError(f"the manifest journal {self._journal} holds an unknown frame")
        for fields in records:
            record = _record(fields, f"record #{len(self._records)} of {self._journal}")
            self._apply(record)
            self._records.append(record)

    def _write(self, data: bytes) -> int:
        """Append ``data`` (whole frames) at the end of the journal; return where it landed.

        On failure, what was written of it is cut off again.
        """
        try:
            view = memoryview(data)
            while view.nbytes:
                written = os.write(self._fd, view)
                if written <= 0:
                    raise OSError(errno.EIO, "write made no progress")
                view = view[written:]
            # O_APPEND: the write went to the end of the file as it was then, and left the
            # file position after it.
            return os.lseek(self._fd, 0, os.SEEK_CUR) - len(data)
        except OSError as exc:
            with contextlib.suppress(OSError):  # best effort: the next writer cuts it anyway
                self._cut_tail()
            raise ManifestError(f"cannot write to the manifest at {self.path}: {exc}") from exc

    # --- writing ------------------------------------------------------------------------------

    def append(self, *records: Record) -> None:
        """Append ``records`` to the log and apply them to the index, all or none."""
        now = time.time()
        stamped = [r if r.time else dataclasses.replace(r, time=now) for r in records]
        frame = _frame({"records": [_fields(r) for r in stamped]})
        with self._locked(exclusive=True):
            for _attempt in range(_WRITE_ATTEMPTS):
                data = frame
                if self._offset == 0:  # an empty journal starts with its format
                    data = _frame({"meta": {"format": FORMAT_VERSION, "compacted": 0}}) + frame
                undo = _Undo()
                try:
                    for record in stamped:
                        self._apply(record, undo)
                    start = self._write(data)
                except BaseException:
                    undo.rollback()
                    raise
                if start == self._offset:
                    self._records.extend(stamped)
                    self._formatted = True
                    self._last = (start + len(data) - len(frame), frame)
                    self._offset += len(data)
                    return
                # Someone else cut the file short (or wrote to it) between reading its end and
                # this write: the frame sits after whatever is there now. Read the journal again
                # up to its first damage; the frame counts if it is whole there, else it is cut
                # off with the rest and written again.
                undo.rollback()
                self._note(
                    logging.ERROR,
                    "tiercheck: the manifest journal %s changed under its writer (it ended at "
                    "byte %d, not %d)",
                    self._journal,
                    start,
                    self._offset,
                )
                try:
                    self._replay_tolerant()
                    if self._last == (start + len(data) - len(frame), frame):
                        return  # read back whole where it landed: appended
                    self._cut_tail()
                except OSError as exc:
                    if isinstance(exc, ManifestError):
                        raise
                    raise ManifestError(f"cannot read the manifest at {self.path}: {exc}") from exc
        raise ManifestError(
            f"cannot append to the manifest at {self.path}: the journal kept changing under its "
            f"writer ({_WRITE_ATTEMPTS} attempts). Is something else writing or truncating it?"
        )

    def _apply(self, record: Record, undo: _Undo | None = None) -> None:
        """Apply one record to the index (the only place the index is derived)."""
        if isinstance(record, Begin):
            self._update_version(record.version, "begun", record.rank, record, undo)
        elif isinstance(record, Abort):
            self._update_version(record.version, "aborted", record.rank, record, undo)
        elif isinstance(record, Durable):
            self._set(self._blobs, (record.tier, record.version, record.rank), record, undo)
        elif isinstance(record, Commit):
            self._set(self._commits, (record.tier, record.version), record, undo)
        elif isinstance(record, Evict):
            self._set(self._blobs, (record.tier, record.version, record.rank), _MISSING, undo)
            # A version missing one rank's blob is no longer whole in that tier.
            self._set(self._commits, (record.tier, record.version), _MISSING, undo)

    @staticmethod
    def _set(table: dict[Any, Any], key: Any, value: Any, undo: _Undo | None) -> None:
        if undo is not None:
            undo.note(table, key)
        if value is _MISSING:
            table.pop(key, None)
        else:
            table[key] = value

    def _update_version(
        self, version: int, field: str, rank: int, record: Record, undo: _Undo | None
    ) -> None:
        old = self._versions.get(version)
        entry: dict[str, Any] = (
            {"begun": [], "aborted": [], "kind": None, "base": None}
            if old is None
            else {**old, "begun": list(old["begun"]), "aborted": list(old["aborted"])}
        )
        if rank not in entry[field]:
            entry[field].append(rank)
            entry[field].sort()
        if isinstance(record, Begin):
            entry["kind"], entry["base"] = record.kind, record.base
        self._set(self._versions, version, entry, undo)

    def rebuild_index(self) -> None:
        """Drop the index and rebuild it by replaying the whole journal."""
        with self._lock:
            self._reset()
        with self._locked(exclusive=False):
            pass

    def compact(self, keep_after: int) -> int:
        """Drop the log records of versions older than ``keep_after`` that no index entry
        mentions (evicted from every tier, or aborted), and their ``versions`` entries.

        Returns the number of log records removed. The records of a version still present in
        the ``blobs`` or ``commits`` index are never touched, so a rebuild after compaction
        gives the same index as before it. The records kept are written to a new file that is
        renamed over the journal: a crash at any moment leaves the journal as it was or
        compacted, never in between, and the other ranks of the node, which find the new file
        the next time they lock the journal, read it from its start. The checkpointer calls
        :meth:`compact_if_grown` after retention, with ``keep_after`` its oldest version still
        in flight.
        """
        with self._locked(exclusive=True):
            return self._compact(keep_after, self._compacted)

    def compact_if_grown(self, keep_after: int, *, min_records: int = 1000, growth: int = 4) -> int:
        """:meth:`compact` once the log has grown well past what the last compaction left.

        Due when the log holds more than ``min_records`` records and more than ``growth``
        times as many as the last compaction left (records of versions still held are
        kept, so a log that is mostly live is not rewritten at every save: the work stays a
        constant per append). Returns the number of records removed (0 when not due).
        """
        with self._locked(exclusive=True):
            if len(self._records) <= max(min_records, growth * self._compacted):
                return 0
            return self._compact(keep_after, None)

    def _compact(self, keep_after: int, compacted: int | None) -> int:
        """Under the exclusive lock: rewrite the journal with the records worth keeping.

        ``compacted``: what to record as the size the last compaction left (``None``: what
        this one leaves).
        """
        live = {v for _, v, _ in self._blobs} | {v for _, v in self._commits}
        kept = [r for r in self._records if r.version >= keep_after or r.version in live]
        left = len(kept) if compacted is None else compacted
        frames = [_frame({"meta": {"format": FORMAT_VERSION, "compacted": left}})]
        for i in range(0, len(kept), _RECORDS_PER_FRAME):
            part = kept[i : i + _RECORDS_PER_FRAME]
            frames.append(_frame({"records": [_fields(r) for r in part]}))
        temp = os.path.join(self.path, f"{_COMPACTING}{_HOST}#{os.getpid()}#{secrets.token_hex(4)}")
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                data = memoryview(b"".join(frames))
                while data.nbytes:
                    data = data[os.write(fd, data) :]
            finally:
                os.close(fd)
            self._install(temp)
        except OSError as exc:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)
            raise ManifestError(f"cannot compact the manifest at {self.path}: {exc}") from exc
        removed = len(self._records) - len(kept)
        # This handle reads the new file from its start, like every other: what it holds is
        # the index minus what was compacted away.
        try:
            self._open_journal()
            self._reset()
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            self._catch_up(os.fstat(self._fd).st_size, exclusive=True)
        except OSError as exc:
            if isinstance(exc, ManifestError):
                raise
            raise ManifestError(f"cannot reopen the manifest at {self.path}: {exc}") from exc
        return removed

    def _install(self, temp: str) -> None:
        """Rename the compacted journal ``temp`` over the journal (the compaction's commit)."""
        os.replace(temp, self._journal)

    def log_size(self) -> int:
        """How many records the log holds."""
        with self._locked(exclusive=False):
            return len(self._records)

    # --- reading ------------------------------------------------------------------------------

    def log(self) -> Iterator[Record]:
        """Every record still in the log, oldest first."""
        with self._locked(exclusive=False):
            records = list(self._records)
        yield from records

    def blobs(
        self, tier: str | None = None, version: int | None = None, rank: int | None = None
    ) -> list[Durable]:
        """Durable, not evicted blobs, filtered by tier, version and rank; sorted."""
        with self._locked(exclusive=False):
            found = [
                record
                for (t, v, r), record in self._blobs.items()
                if (tier is None or t == tier)
                and (version is None or v == version)
                and (rank is None or r == rank)
            ]
        return sorted(found, key=lambda r: (r.tier, r.version, r.rank))

    def committed(self, tier: str) -> list[int]:
        """Versions committed in ``tier`` and not since evicted, ascending."""
        with self._locked(exclusive=False):
            return sorted(v for t, v in self._commits if t == tier)

    def is_committed(self, tier: str, version: int) -> bool:
        """Whether ``version`` is committed in ``tier``."""
        with self._locked(exclusive=False):
            return (tier, version) in self._commits

    def versions(self) -> dict[int, dict[str, Any]]:
        """Per version: which ranks began and aborted it, its kind and its base."""
        with self._locked(exclusive=False):
            return self._versions_copy()

    def _versions_copy(self) -> dict[int, dict[str, Any]]:
        return {
            v: {**e, "begun": list(e["begun"]), "aborted": list(e["aborted"])}
            for v, e in sorted(self._versions.items())
        }

    def dump_index(self) -> dict[str, Any]:
        """The whole index as plain data (for tests and ``tiercheck inspect``)."""
        with self._locked(exclusive=False):
            return {
                "blobs": dict(sorted(self._blobs.items())),
                "commits": dict(sorted(self._commits.items())),
                "versions": self._versions_copy(),
            }

    # --- lifecycle ----------------------------------------------------------------------------

    def close(self) -> None:
        """Close this handle (other handles, in this process or others, are not affected)."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._close_fd()

    def _check_open(self) -> None:
        if self._closed:
            raise ManifestError(f"the manifest at {self.path} is closed")

    def __enter__(self) -> Manifest:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Manifest({self.path!r})"
