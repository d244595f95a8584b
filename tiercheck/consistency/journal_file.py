"""The manifest's journal file: opening it, locking it, reading what others appended, and
repairing an append cut short.

:class:`JournalFile` holds the file and the log read from it;
:class:`~tiercheck.consistency.manifest.Manifest` derives its index from that log (the
``_apply`` hook) and adds appending, compaction and the queries. See
:mod:`tiercheck.consistency.manifest` for what the journal is and the rules it keeps; the frame
format is in :mod:`tiercheck.consistency.records`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import socket
import threading
from collections.abc import Iterator
from typing import Any

from tiercheck.consistency.records import FORMAT_VERSION, HEADER, Record, parse_frames, parse_record
from tiercheck.errors import ManifestError

__all__ = ["COMPACTING", "HOST", "JOURNAL", "WRITE_ATTEMPTS", "JournalFile"]

logger = logging.getLogger("tiercheck")

#: The journal's file name in the manifest folder.
JOURNAL = "journal"
#: What manifests of tiercheck before the journal left (LMDB): never opened, never mapped.
_LMDB_FILES = ("data.mdb", "lock.mdb")
# A compaction writes the new journal under this name first (host and pid: debris of a process
# that died is recognised and removed).
COMPACTING = "journal#compacting#"
HOST = socket.gethostname().replace("#", "_") or "localhost"
# An append whose frame someone else's truncation displaced is written again, a few times.
WRITE_ATTEMPTS = 4


def dead_compaction(name: str) -> bool:
    """Whether ``name`` is the unfinished new journal of a compaction whose process is gone."""
    if not name.startswith(COMPACTING):
        return False
    host, _, rest = name[len(COMPACTING) :].partition("#")
    pid_text = rest.partition("#")[0]
    if host != HOST or not pid_text.isdigit():
        return False
    try:
        os.kill(int(pid_text), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


class JournalFile:
    """The journal file of one node's manifest, and the log read from it (see the module
    docstring). A subclass keeps the index: it resets it in ``_reset_index`` and applies each
    record read in ``_apply``.

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
        self._compacted = 0
        self._reset_index()

    def _reset_index(self) -> None:
        """Forget the index derived from the log (the subclass's)."""
        raise NotImplementedError

    def _apply(self, record: Record) -> None:
        """Apply one record read from the journal to the index (the subclass's)."""
        raise NotImplementedError

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
                if dead_compaction(entry.name):
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
            parsed = parse_frames(data, self._offset, self._journal)
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
        return os.pread(self._fd, HEADER.size, start) == frame[: HEADER.size]

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
        for _attempt in range(WRITE_ATTEMPTS):
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
        parsed = parse_frames(data, 0, self._journal, tolerant=True)
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
            record = parse_record(fields, f"record #{len(self._records)} of {self._journal}")
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
