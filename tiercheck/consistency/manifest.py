"""The node's manifest: a log of what happened to every version, and its index, in LMDB.

One LMDB environment per node, shared by every rank (process) of that node. Each write is one
LMDB transaction that appends records to the ``log`` table *and* applies them to the index
tables, so the index never disagrees with the log, and a crash at any moment leaves either the
whole transaction or none of it. The index can always be rebuilt by replaying the log
(:meth:`Manifest.rebuild_index`). The log keeps only what is still worth telling: once it has
grown well past what the last compaction left, the checkpointer compacts it after retention
(:meth:`Manifest.compact_if_grown`), dropping the records of versions gone from every tier.

Records (``op`` field):

==========  ==================================================================================
``begin``    a rank started saving version ``v`` (its kind and, for a delta, its base)
``durable``  a rank's blob of ``v`` is durable in a tier: key, size, checksum, raw digest, base
``commit``   ``v`` is committed in a tier: every rank's blob of it (and of its base) is durable
``evict``    a rank removed its blob of ``v`` from a tier (retention, or truncation on restore)
``abort``    a rank gave ``v`` up (skipped, or its staging failed)
==========  ==================================================================================

Index tables: ``blobs`` (tier, version, rank) -> the durable record; ``commits`` (tier, version)
-> the commit record; ``versions`` version -> what ranks began/aborted it.

The manifest knows keys and versions, never tensors. It is a record of the past, not the source
of truth for recovery: recovery trusts only what the tiers themselves prove (blob checksums and
the persistent tier's ``COMMIT`` objects), so a lost or corrupt manifest costs history, never
data. A corrupt or unopenable manifest raises :class:`~tiercheck.errors.ManifestError`.

Every method is synchronous and quick (microseconds to a millisecond); async callers run them
in a thread, as they do all file work.
"""

from __future__ import annotations

import dataclasses
import os
import struct
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import lmdb
import msgpack
import xxhash

from tiercheck.errors import ManifestError

__all__ = [
    "Abort",
    "Begin",
    "Commit",
    "Durable",
    "Evict",
    "Manifest",
    "Record",
]

FORMAT_VERSION = 1
_U64 = struct.Struct(">Q")
_U32 = struct.Struct(">I")
_CHECK = struct.Struct(">I")  # xxh32 of the msgpack body, guards every stored value


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


def _encode(record: Record) -> bytes:
    body = msgpack.packb({"op": record.op, **dataclasses.asdict(record)}, use_bin_type=True)
    return _CHECK.pack(xxhash.xxh32_intdigest(body)) + body


def _decode(value: bytes, where: str) -> Record:
    if len(value) < _CHECK.size:
        raise ManifestError(f"manifest value at {where} is truncated ({len(value)} bytes)")
    (check,) = _CHECK.unpack_from(value)
    body = value[_CHECK.size :]
    if xxhash.xxh32_intdigest(body) != check:
        raise ManifestError(
            f"manifest value at {where} fails its checksum; the manifest is corrupt. "
            "Move it aside: recovery proceeds from what the tiers prove."
        )
    try:
        fields = msgpack.unpackb(body, raw=False)
        cls = _RECORD_TYPES[fields.pop("op")]
        if cls is Abort:
            # Logs written before Abort lost its `tier` field (always "", the whole save)
            # still carry it.
            fields.pop("tier", None)
        return cls(**fields)
    except (ValueError, KeyError, TypeError, msgpack.UnpackException) as exc:
        raise ManifestError(f"manifest value at {where} is not a valid record: {exc}") from exc


def _tier_key(tier: str, version: int, rank: int | None = None) -> bytes:
    key = tier.encode() + b"\0" + _U64.pack(version)
    return key if rank is None else key + _U32.pack(rank)


def _split_tier_key(key: bytes) -> tuple[str, int, int | None]:
    tier, _, rest = key.partition(b"\0")
    version = _U64.unpack_from(rest)[0]
    rank = _U32.unpack_from(rest, _U64.size)[0] if len(rest) > _U64.size else None
    return tier.decode(), version, rank


class _SharedEnv:
    """LMDB forbids opening one environment twice in a process: share it, counted."""

    _lock = threading.Lock()
    _open: ClassVar[dict[str, tuple[lmdb.Environment, int]]] = {}

    @classmethod
    def acquire(cls, path: str, map_size: int) -> lmdb.Environment:
        with cls._lock:
            if path in cls._open:
                env, count = cls._open[path]
                cls._open[path] = (env, count + 1)
                return env
            Path(path).mkdir(mode=0o700, parents=True, exist_ok=True)
            try:
                env = lmdb.open(path, map_size=map_size, max_dbs=8, mode=0o600, subdir=True)
            except lmdb.Error as exc:
                raise ManifestError(
                    f"cannot open the manifest at {path}: {exc}. If it is corrupt, move it aside; "
                    "recovery proceeds from what the tiers prove."
                ) from exc
            cls._open[path] = (env, 1)
            return env

    @classmethod
    def release(cls, path: str) -> None:
        with cls._lock:
            env, count = cls._open[path]
            if count > 1:
                cls._open[path] = (env, count - 1)
            else:
                del cls._open[path]
                env.close()


class Manifest:
    """The log (appended to, compacted now and then) and its index for one node. See the module
    docstring.

    Args:
        path: folder of the LMDB environment (created if missing, mode 0700).
        map_size: the most bytes the environment may grow to (a sparse reservation).
    """

    def __init__(self, path: str | os.PathLike[str], *, map_size: int = 1 << 30) -> None:
        self.path = os.path.realpath(os.fspath(path))
        self._env = _SharedEnv.acquire(self.path, map_size)
        self._closed = False
        try:
            with self._env.begin(write=True) as txn:
                self._log = self._env.open_db(b"log", txn=txn)
                self._meta = self._env.open_db(b"meta", txn=txn)
                self._blobs = self._env.open_db(b"blobs", txn=txn)
                self._commits = self._env.open_db(b"commits", txn=txn)
                self._versions = self._env.open_db(b"versions", txn=txn)
                stored = txn.get(b"format", db=self._meta)
                if stored is None:
                    txn.put(b"format", _U32.pack(FORMAT_VERSION), db=self._meta)
                elif _U32.unpack(stored)[0] != FORMAT_VERSION:
                    raise ManifestError(
                        f"the manifest at {self.path} has format {_U32.unpack(stored)[0]}, "
                        f"this build reads format {FORMAT_VERSION}"
                    )
        except lmdb.Error as exc:
            _SharedEnv.release(self.path)
            raise ManifestError(f"cannot read the manifest at {self.path}: {exc}") from exc
        except ManifestError:
            _SharedEnv.release(self.path)
            raise

    # --- writing ------------------------------------------------------------------------------

    def append(self, *records: Record) -> None:
        """Append ``records`` to the log and apply them to the index, in one transaction."""
        self._check_open()
        now = time.time()
        stamped = [r if r.time else dataclasses.replace(r, time=now) for r in records]
        try:
            with self._env.begin(write=True) as txn:
                raw_seq = txn.get(b"seq", db=self._meta)
                seq = 0 if raw_seq is None else _U64.unpack(raw_seq)[0]
                for record in stamped:
                    txn.put(_U64.pack(seq), _encode(record), db=self._log, append=True)
                    seq += 1
                    self._apply(txn, record)
                txn.put(b"seq", _U64.pack(seq), db=self._meta)
        except lmdb.Error as exc:
            raise ManifestError(f"cannot write to the manifest at {self.path}: {exc}") from exc

    def _apply(self, txn: lmdb.Transaction, record: Record) -> None:
        """Apply one record to the index tables (the only place the index is derived)."""
        if isinstance(record, Begin):
            self._update_version(txn, record.version, "begun", record.rank, record)
        elif isinstance(record, Abort):
            self._update_version(txn, record.version, "aborted", record.rank, record)
        elif isinstance(record, Durable):
            key = _tier_key(record.tier, record.version, record.rank)
            txn.put(key, _encode(record), db=self._blobs)
        elif isinstance(record, Commit):
            txn.put(_tier_key(record.tier, record.version), _encode(record), db=self._commits)
        elif isinstance(record, Evict):
            txn.delete(_tier_key(record.tier, record.version, record.rank), db=self._blobs)
            # A version missing one rank's blob is no longer whole in that tier.
            txn.delete(_tier_key(record.tier, record.version), db=self._commits)

    def _update_version(
        self, txn: lmdb.Transaction, version: int, field: str, rank: int, record: Record
    ) -> None:
        key = _U64.pack(version)
        raw = txn.get(key, db=self._versions)
        entry: dict[str, Any] = (
            {"begun": [], "aborted": [], "kind": None, "base": None}
            if raw is None
            else msgpack.unpackb(raw, raw=False)
        )
        if rank not in entry[field]:
            entry[field].append(rank)
            entry[field].sort()
        if isinstance(record, Begin):
            entry["kind"], entry["base"] = record.kind, record.base
        txn.put(key, msgpack.packb(entry, use_bin_type=True), db=self._versions)

    def rebuild_index(self) -> None:
        """Drop the index tables and rebuild them by replaying the whole log."""
        self._check_open()
        try:
            with self._env.begin(write=True) as txn:
                for db in (self._blobs, self._commits, self._versions):
                    txn.drop(db, delete=False)
                for seq, value in txn.cursor(db=self._log):
                    self._apply(txn, _decode(value, f"log #{_U64.unpack(seq)[0]}"))
        except lmdb.Error as exc:
            raise ManifestError(f"cannot rebuild the manifest at {self.path}: {exc}") from exc

    def compact(self, keep_after: int) -> int:
        """Drop the log records of versions older than ``keep_after`` that no index entry
        mentions (evicted from every tier, or aborted), and their ``versions`` entries.

        Returns the number of log records removed. The records of a version still present in
        the ``blobs`` or ``commits`` table are never touched, so a rebuild after compaction
        gives the same index as before it. The whole rewrite is one LMDB write transaction: a
        crash at any moment leaves the log as it was or compacted, never in between (LMDB's
        copy-on-write pages become visible only when the transaction commits), and every rank
        of the node keeps using the one environment it has open (a new file renamed over it
        would leave them writing to the old one). The freed pages are reused by later appends,
        so the file stops growing. The checkpointer calls :meth:`compact_if_grown` after
        retention, with ``keep_after`` its oldest version still in flight.
        """
        self._check_open()
        try:
            with self._env.begin(write=True) as txn:
                return self._compact(txn, keep_after)
        except lmdb.Error as exc:
            raise ManifestError(f"cannot compact the manifest at {self.path}: {exc}") from exc

    def compact_if_grown(self, keep_after: int, *, min_records: int = 1000, growth: int = 4) -> int:
        """:meth:`compact` once the log has grown well past what the last compaction left.

        Due when the log holds more than ``min_records`` records and more than ``growth``
        times as many as the last compaction left (records of versions still held are
        kept, so a log that is mostly live is not rescanned at every save: the work stays a
        constant per append). Returns the number of records removed (0 when not due).
        """
        self._check_open()
        try:
            with self._env.begin() as txn:
                if not self._compaction_due(txn, min_records, growth):
                    return 0
            # Checked again under the write lock: another rank of the node may have just done it.
            with self._env.begin(write=True) as txn:
                if not self._compaction_due(txn, min_records, growth):
                    return 0
                removed = self._compact(txn, keep_after)
                left = txn.stat(self._log)["entries"]
                txn.put(b"compacted", _U64.pack(left), db=self._meta)
                return removed
        except lmdb.Error as exc:
            raise ManifestError(f"cannot compact the manifest at {self.path}: {exc}") from exc

    def log_size(self) -> int:
        """How many records the log holds."""
        self._check_open()
        with self._env.begin() as txn:
            entries: int = txn.stat(self._log)["entries"]
            return entries

    def _compaction_due(self, txn: lmdb.Transaction, min_records: int, growth: int) -> bool:
        entries: int = txn.stat(self._log)["entries"]
        raw = txn.get(b"compacted", db=self._meta)
        left = 0 if raw is None else _U64.unpack(raw)[0]
        return entries > max(min_records, growth * left)

    def _compact(self, txn: lmdb.Transaction, keep_after: int) -> int:
        live = {_split_tier_key(bytes(k))[1] for k, _ in txn.cursor(db=self._blobs)}
        live |= {_split_tier_key(bytes(k))[1] for k, _ in txn.cursor(db=self._commits)}
        doomed = []
        for seq, value in txn.cursor(db=self._log):
            record = _decode(bytes(value), f"log #{_U64.unpack(seq)[0]}")
            if record.version < keep_after and record.version not in live:
                doomed.append(seq)
        for seq in doomed:
            txn.delete(seq, db=self._log)
        stale = [k for k, _ in txn.cursor(db=self._versions) if _U64.unpack(k)[0] < keep_after]
        for k in stale:
            if _U64.unpack(k)[0] not in live:
                txn.delete(k, db=self._versions)
        return len(doomed)

    # --- reading ------------------------------------------------------------------------------

    def log(self) -> Iterator[Record]:
        """Every record still in the log, oldest first."""
        self._check_open()
        with self._env.begin() as txn:
            items = list(txn.cursor(db=self._log))
        for seq, value in items:
            yield _decode(value, f"log #{_U64.unpack(seq)[0]}")

    def blobs(
        self, tier: str | None = None, version: int | None = None, rank: int | None = None
    ) -> list[Durable]:
        """Durable, not evicted blobs, filtered by tier, version and rank; sorted."""
        self._check_open()
        prefix = b"" if tier is None else tier.encode() + b"\0"
        if tier is not None and version is not None:
            prefix = _tier_key(tier, version)
        out = []
        with self._env.begin() as txn:
            cursor = txn.cursor(db=self._blobs)
            found = cursor.set_range(prefix) if prefix else cursor.first()
            while found:
                key, value = cursor.item()
                if not key.startswith(prefix):
                    break
                rec = _decode(value, f"blobs[{key!r}]")
                if isinstance(rec, Durable) and (
                    (version is None or rec.version == version)
                    and (rank is None or rec.rank == rank)
                ):
                    out.append(rec)
                found = cursor.next()
        return sorted(out, key=lambda r: (r.tier, r.version, r.rank))

    def committed(self, tier: str) -> list[int]:
        """Versions committed in ``tier`` and not since evicted, ascending."""
        return sorted(v for t, v, _ in self._iter_keys(self._commits) if t == tier)

    def is_committed(self, tier: str, version: int) -> bool:
        """Whether ``version`` is committed in ``tier``."""
        self._check_open()
        with self._env.begin() as txn:
            return txn.get(_tier_key(tier, version), db=self._commits) is not None

    def versions(self) -> dict[int, dict[str, Any]]:
        """Per version: which ranks began and aborted it, its kind and its base."""
        self._check_open()
        with self._env.begin() as txn:
            return {
                _U64.unpack(k)[0]: msgpack.unpackb(v, raw=False)
                for k, v in txn.cursor(db=self._versions)
            }

    def dump_index(self) -> dict[str, Any]:
        """The whole index as plain data (for tests and ``tiercheck inspect``)."""
        self._check_open()
        with self._env.begin() as txn:
            blobs = {_split_tier_key(k): _decode(v, "blobs") for k, v in txn.cursor(db=self._blobs)}
            commits = {
                _split_tier_key(k)[:2]: _decode(v, "commits")
                for k, v in txn.cursor(db=self._commits)
            }
        return {"blobs": blobs, "commits": commits, "versions": self.versions()}

    def _iter_keys(self, db: Any) -> Iterable[tuple[str, int, int | None]]:
        self._check_open()
        with self._env.begin() as txn:
            keys = [k for k, _ in txn.cursor(db=db)]
        return [_split_tier_key(k) for k in keys]

    # --- lifecycle ----------------------------------------------------------------------------

    def close(self) -> None:
        """Close this handle (the environment closes when its last handle in the process does)."""
        if not self._closed:
            self._closed = True
            _SharedEnv.release(self.path)

    def _check_open(self) -> None:
        if self._closed:
            raise ManifestError(f"the manifest at {self.path} is closed")

    def __enter__(self) -> Manifest:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Manifest({self.path!r})"
