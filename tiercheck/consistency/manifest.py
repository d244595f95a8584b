"""The node's manifest: a log of what happened to every version, and its index.

One journal file per node (``manifest/journal``), shared by every rank (process) of that node.
Each :meth:`Manifest.append` writes one *frame* at the end of the file, in one ``write`` under
an exclusive ``flock``: the records of that call, together, under one checksum. A crash in the
middle of it leaves an unfinished last frame, which readers ignore and the next writer cuts
off, so an append is there whole or not at all. The index -- which blobs are written to which
tier, which versions are committed where, what each version is -- is derived from the log, in
the memory of every handle: it replays the frames other processes appended since it last
looked, before it answers, and :meth:`Manifest.rebuild_index` replays the whole file again. The
log keeps only what is still worth telling: once it has grown well past what the last
compaction left, the checkpointer compacts it after retention (:meth:`Manifest.compact_if_grown`),
writing the records of versions still held to a new file renamed over the journal.

Records (``op`` field):

==========  ==================================================================================
``begin``    a rank started saving version ``v`` (its kind and, for a delta, its base)
``durable``  a rank's blob of ``v`` is written to a tier (:class:`Written`; the op keeps its old
             name): key, size, checksum, raw digest, base
``commit``   ``v`` is committed in a tier: every rank's blob of it (and of its base) is written
``evict``    a rank removed its blob of ``v`` from a tier (retention, or truncation on restore)
``abort``    a rank gave ``v`` up (skipped, or its staging failed)
==========  ==================================================================================

Index: ``blobs`` (tier, version, rank) -> the written record; ``commits`` (tier, version) -> the
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

The journal file itself (opening, locking, catching up, cutting off an append cut short) is
:class:`~tiercheck.consistency.journal_file.JournalFile`, which :class:`Manifest` extends with the
index, appending, compaction and the queries; the records and the frame format are in
:mod:`tiercheck.consistency.records` (the records are importable from here).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import os
import secrets
import time
from collections.abc import Iterator
from typing import Any

from tiercheck.consistency.journal_file import (
    COMPACTING,
    HOST,
    JOURNAL,
    WRITE_ATTEMPTS,
    JournalFile,
)
from tiercheck.consistency.records import (
    FORMAT_VERSION,
    RECORDS_PER_FRAME,
    Abort,
    Begin,
    Commit,
    Evict,
    Record,
    Written,
    pack_frame,
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

_MISSING = object()


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


class Manifest(JournalFile):
    """The log (appended to, compacted now and then) and its index for one node. See the module
    docstring.

    Args:
        path: the manifest folder (created if missing, mode 0700); the journal is a file in it.
    """

    # --- the index ----------------------------------------------------------------------------

    def _reset_index(self) -> None:
        self._blobs: dict[tuple[str, int, int], Written] = {}
        self._commits: dict[tuple[str, int], Commit] = {}
        self._versions: dict[int, dict[str, Any]] = {}

    # --- writing ------------------------------------------------------------------------------

    def append(self, *records: Record) -> None:
        """Append ``records`` to the log and apply them to the index, all or none."""
        now = time.time()
        stamped = [r if r.time else dataclasses.replace(r, time=now) for r in records]
        frame = pack_frame({"records": [record_fields(r) for r in stamped]})
        with self._locked(exclusive=True):
            for _attempt in range(WRITE_ATTEMPTS):
                data = frame
                if self._offset == 0:  # an empty journal starts with its format
                    data = pack_frame({"meta": {"format": FORMAT_VERSION, "compacted": 0}}) + frame
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
            f"writer ({WRITE_ATTEMPTS} attempts). Is something else writing or truncating it?"
        )

    def _apply(self, record: Record, undo: _Undo | None = None) -> None:
        """Apply one record to the index (the only place the index is derived)."""
        if isinstance(record, Begin):
            self._update_version(record.version, "begun", record.rank, record, undo)
        elif isinstance(record, Abort):
            self._update_version(record.version, "aborted", record.rank, record, undo)
        elif isinstance(record, Written):
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
        frames = [pack_frame({"meta": {"format": FORMAT_VERSION, "compacted": left}})]
        for i in range(0, len(kept), RECORDS_PER_FRAME):
            part = kept[i : i + RECORDS_PER_FRAME]
            frames.append(pack_frame({"records": [record_fields(r) for r in part]}))
        temp = os.path.join(self.path, f"{COMPACTING}{HOST}#{os.getpid()}#{secrets.token_hex(4)}")
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
    ) -> list[Written]:
        """Written, not evicted blobs, filtered by tier, version and rank; sorted."""
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

    def __enter__(self) -> Manifest:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Manifest({self.path!r})"
