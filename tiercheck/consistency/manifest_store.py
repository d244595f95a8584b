"""The manifest's LMDB environment: its tables, one write transaction per append, the queries.

Opened only by the node's manifest process (:mod:`tiercheck.consistency.manifestd`), after
:func:`~tiercheck.consistency.manifest_files.check_unmapped` found the environment sound. The
tables are described in :mod:`tiercheck.consistency.manifestd`. Imports the standard library,
``lmdb`` and ``msgpack`` only.
"""

from __future__ import annotations

import os
import signal
import struct
from typing import Any

import lmdb
import msgpack

__all__ = ["FORMAT", "KILL_AT_VARIABLE", "MAP_SIZE", "Store", "StoreError"]

#: The environment's own format (in the ``meta`` table).
FORMAT = 2
#: The map's size: virtual address space, not memory (pages are written as they are used).
MAP_SIZE = 1 << 30

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
        # One read transaction: one snapshot of the three tables.
        with self.env.begin() as txn:
            blobs = [self._logged(txn, v) for _k, v in txn.cursor(db=self.blobs)]
            commits = [self._logged(txn, v) for _k, v in txn.cursor(db=self.commits)]
            versions = [
                [_V.unpack(k)[0], msgpack.unpackb(v)] for k, v in txn.cursor(db=self.versions)
            ]
        return {"blobs": blobs, "commits": commits, "versions": versions}
