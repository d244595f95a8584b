"""What a catalog is made of: the entries :func:`~tiercheck.catalog.scan.scan_location` fills.

A :class:`Catalog` lists one location's versions (:class:`VersionEntry`, each rank's
:class:`BlobEntry`), its quarantined blobs, the replicas a node keeps for other nodes' ranks
(:class:`KeptReplicas`), its abandoned sets (:class:`AbandonedSetEntry`) and the records
beside them. Plain data and the queries on it; no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from tiercheck.catalog.base import Location
from tiercheck.codec import BlobMeta
from tiercheck.consistency.abandoned import ABANDONED_PREFIX, AbandonedSet
from tiercheck.consistency.commit import CommitRecord
from tiercheck.consistency.identity import JobRecord, NodeIdentity, Tombstone, WriterRecord
from tiercheck.consistency.keys import BlobKey, BlobKind
from tiercheck.consistency.manifest import Written
from tiercheck.defaults import encoding_kind
from tiercheck.tiers.base import Leftover

__all__ = [
    "AbandonedSetEntry",
    "BlobEntry",
    "BlobKindName",
    "Catalog",
    "KeptReplicas",
    "QuarantinedBlob",
    "VersionEntry",
]

#: How a blob is encoded, as far as is known: ``full`` (raw payload, self-contained), ``base``
#: (packed, self-contained), ``delta`` (packed, needs its base), or ``packed`` (packed, base or
#: delta not known without reading the blob's header).
BlobKindName = Literal["full", "base", "delta", "packed"]


@dataclass
class BlobEntry:
    """One stored blob, as far as listing (and possibly reading its header) tells."""

    key: str
    version: int
    rank: int
    encoding: BlobKind
    #: Bytes stored, from a record (COMMIT or manifest) or the tier; ``None`` if unknown.
    size: int | None = None
    #: The base version a delta needs; only meaningful when ``base_known``.
    base: int | None = None
    base_known: bool = False
    #: The blob's header, once read (:func:`inspect_blobs`, :func:`verify`).
    meta: BlobMeta | None = None

    def __post_init__(self) -> None:
        # A blob stored as is has no base: its name tells.
        if encoding_kind(self.encoding).as_is:
            self.base_known = True

    @classmethod
    def listed(cls, key: str, where: BlobKey) -> BlobEntry:
        """The entry of blob ``key`` found in a listing (``where``: its parsed key)."""
        return cls(key, where.version, where.rank, where.kind)

    @property
    def read_order(self) -> tuple[int, str]:
        """Sorts a rank's blobs of one version: the one a restore reads first comes first
        (:attr:`tiercheck.consistency.keys.BlobKey.read_order`)."""
        return encoding_kind(self.encoding).read_order, self.key

    @property
    def kind(self) -> BlobKindName:
        """``full``, ``base``, ``delta``, or ``packed`` when not known without reading."""
        if encoding_kind(self.encoding).as_is or not self.base_known:
            return self.encoding
        return "base" if self.base is None else "delta"

    def learn(self, meta: BlobMeta) -> None:
        """Record what the blob's header says."""
        self.meta = meta
        self.size = meta.nbytes
        self.base = None if meta.base is None else meta.base.version
        self.base_known = True


@dataclass
class VersionEntry:
    """Everything stored for one version in one location."""

    version: int
    #: The version's blobs, by rank.
    blobs: dict[int, BlobEntry] = field(default_factory=dict)
    #: Whether the version claims to be committed (``None``: cannot tell, no manifest).
    committed: bool | None = False
    #: The persistent ``COMMIT`` record, when present and readable.
    commit: CommitRecord | None = None
    #: Why a present ``COMMIT`` record could not be read.
    commit_error: str | None = None
    #: The ranks that should each have a blob.
    expected_ranks: tuple[int, ...] = ()

    def add(self, blob: BlobEntry) -> None:
        """File ``blob`` as its rank's. Of two encodings of a rank's version in one tier, the
        one a restore reads is kept (the cheaper read)."""
        held = self.blobs.get(blob.rank)
        if held is None or blob.read_order < held.read_order:
            self.blobs[blob.rank] = blob

    @property
    def missing_ranks(self) -> list[int]:
        """Expected ranks without a blob of this version."""
        return [r for r in self.expected_ranks if r not in self.blobs]

    @property
    def complete(self) -> bool:
        """Whether every expected rank has a blob."""
        return bool(self.blobs) and not self.missing_ranks

    @property
    def kind(self) -> str:
        """The blobs' kind (:data:`BlobKindName`), or ``mixed`` when ranks disagree."""
        kinds = {b.kind for b in self.blobs.values()}
        if len(kinds) > 1:
            kinds.discard("packed")
        if not kinds:
            return "none"
        return kinds.pop() if len(kinds) == 1 else "mixed"

    @property
    def base(self) -> int | None:
        """The base version the blobs are deltas against (``None``: none, or not known)."""
        bases = {b.base for b in self.blobs.values() if b.base_known and b.base is not None}
        return bases.pop() if len(bases) == 1 else None

    @property
    def size(self) -> int | None:
        """Bytes stored for the version (``None`` if some size is unknown)."""
        sizes = [b.size for b in self.blobs.values()]
        return None if any(s is None for s in sizes) else sum(s for s in sizes if s is not None)

    def to_json(self) -> dict[str, Any]:
        """Plain data for ``--json`` output."""
        return {
            "version": self.version,
            "kind": self.kind,
            "base": self.base,
            "ranks": sorted(self.blobs),
            "expected_ranks": list(self.expected_ranks),
            "missing_ranks": self.missing_ranks,
            "complete": self.complete,
            "committed": self.committed,
            "size": self.size,
        }


@dataclass
class QuarantinedBlob:
    """A blob a restore set aside after it failed verification (key ``quarantine/<original>``).

    The copy holds the original bytes, untouched; the version was not restored from it.
    """

    key: str
    #: The key the blob was stored under before it was set aside.
    original: str
    #: The version and rank the original key names (``None`` when it is not a blob key).
    version: int | None
    rank: int | None
    #: Bytes stored, from the tier; ``None`` if unknown.
    size: int | None = None

    def to_json(self) -> dict[str, Any]:
        """Plain data for ``--json`` output."""
        return {
            "key": self.key,
            "original": self.original,
            "version": self.version,
            "rank": self.rank,
            "size": self.size,
        }


@dataclass
class KeptReplicas:
    """The replicas a node keeps for one rank of a job on another node (the peer tier's copies).

    They live in the node root under ``replicas/<job>/r<rank>/``; a restore of that rank after
    its own node was lost reads them. They are not a location of their own: no command but
    ``ls`` reads them (``tiercheck rm-job`` removes them with the node root).
    """

    #: The job (the peer tier's namespace).
    job: str
    #: The rank whose blobs these are.
    rank: int
    #: The versions held, ascending.
    versions: list[int]
    #: Blobs held (several per version where one was set aside or held in two encodings).
    blobs: int
    #: Bytes held; ``None`` if a size could not be read.
    size: int | None

    def to_json(self) -> dict[str, Any]:
        """Plain data for ``--json`` output."""
        return {
            "job": self.job,
            "rank": self.rank,
            "versions": self.versions,
            "blobs": self.blobs,
            "size": self.size,
        }


@dataclass
class AbandonedSetEntry:
    """Versions the run went back from, set aside whole under ``abandoned/<tag>/`` of a
    persistent job folder (see :mod:`tiercheck.consistency.abandoned`).

    A set with its ``SET`` record (:attr:`has_record`) was finished: its versions left the run's
    timeline and are kept only here, until retention or ``tiercheck gc --abandoned`` removes
    them. A set without it is *unfinished*: the work of an opening that died while setting the
    versions aside (the originals were still in place, so it holds only copies), or what is left
    of a set whose removal was cut short (its ``SET`` record goes first).
    """

    tag: str
    #: The first version set aside, and the opening (session token) that did it (from the tag).
    first: int
    session: str
    #: Whether the ``SET`` record is present (readable or not).
    has_record: bool = False
    #: The ``SET`` record, when present and readable.
    record: AbandonedSet | None = None
    #: Why a present ``SET`` record could not be read.
    record_error: str | None = None
    #: What the set holds, by original version: its blobs (keys under the set's folder) and,
    #: as :attr:`VersionEntry.commit`, the copies of their ``COMMIT`` records.
    versions: dict[int, VersionEntry] = field(default_factory=dict)
    #: Every key of the set (``SET``, ``COMMIT`` copies, blobs), sorted.
    keys: list[str] = field(default_factory=list)
    #: Bytes of all its keys (``None`` if some size could not be read).
    size: int | None = None

    @property
    def prefix(self) -> str:
        """The folder of the set, as a key prefix."""
        return f"{ABANDONED_PREFIX}{self.tag}/"

    @property
    def whole(self) -> bool:
        """Whether the ``SET`` record is present and readable."""
        return self.record is not None

    @property
    def listed(self) -> list[int]:
        """The versions the ``SET`` record lists; without a readable one, those held."""
        if self.record is not None:
            return list(self.record.versions)
        return sorted(self.versions)

    @property
    def restored(self) -> int | None:
        """The version the run went on from (``-1``: it started over); ``None``: not known."""
        return None if self.record is None else self.record.restored

    @property
    def time(self) -> float | None:
        """When the set was made (``SET`` record), if known."""
        return None if self.record is None else self.record.time

    @property
    def reason(self) -> str | None:
        """Why the versions left the run's timeline (``SET`` record), if known."""
        return None if self.record is None else self.record.reason

    def blobs(self, versions: Iterable[int] | None = None) -> list[BlobEntry]:
        """The set's blobs of ``versions`` (all when ``None``), by version then rank."""
        chosen = sorted(self.versions) if versions is None else sorted(set(versions))
        return [
            self.versions[v].blobs[r]
            for v in chosen
            if v in self.versions
            for r in sorted(self.versions[v].blobs)
        ]

    def to_json(self) -> dict[str, Any]:
        """Plain data for ``--json`` output."""
        return {
            "tag": self.tag,
            "first": self.first,
            "session": self.session,
            "whole": self.whole,
            "has_record": self.has_record,
            "record_error": self.record_error,
            "versions": self.listed,
            "held": [e.to_json() for _, e in sorted(self.versions.items())],
            "restored": self.restored,
            "time": self.time,
            "reason": self.reason,
            "blobs": len(self.blobs()),
            "keys": len(self.keys),
            "size": self.size,
        }


def _record_json(
    record: JobRecord | WriterRecord | NodeIdentity | Tombstone | None,
) -> dict[str, Any] | None:
    return None if record is None else json.loads(record.to_bytes())


@dataclass
class Catalog:
    """A listing of one location: its versions, and what could not be read while listing."""

    location: Location
    versions: dict[int, VersionEntry]
    #: The ranks this location holds blobs for (the job's ranks; a node's ranks for node roots).
    ranks: tuple[int, ...]
    #: Set when the node's manifest exists but cannot be read (or is damaged at rest).
    manifest_error: str | None = None
    #: How many versions the node's manifest records (begun, written or committed), where it
    #: was read; ``None`` without one (persistent job folders, node roots without a manifest).
    manifest_versions: int | None = None
    #: The manifest's written records of the local tier, by (version, rank).
    written: dict[tuple[int, int], Written] = field(default_factory=dict)
    #: Keys the tier holds that are not tiercheck keys (left alone by every command).
    foreign: list[str] = field(default_factory=list)
    #: The job record (persistent job folders), when present and readable.
    job_record: JobRecord | None = None
    #: Why a present job record could not be read.
    job_record_error: str | None = None
    #: The writer generations stored (persistent job folders), ascending.
    writer_generations: list[int] = field(default_factory=list)
    #: The newest writer generation's record (the live, or last, writer), when readable.
    newest_writer: WriterRecord | None = None
    #: Why the newest writer generation's record could not be read.
    writer_error: str | None = None
    #: Blobs set aside by a restore, by key.
    quarantined: list[QuarantinedBlob] = field(default_factory=list)
    #: Probe objects left by an opening that did not finish (persistent job folders).
    probes: list[str] = field(default_factory=list)
    #: Versions the run went back from, set aside (persistent job folders), by tag.
    abandoned: list[AbandonedSetEntry] = field(default_factory=list)
    #: What ``tiercheck rm-job`` deleted here (persistent job folders), when present and readable.
    tombstone: Tombstone | None = None
    #: Why a present tombstone could not be read.
    tombstone_error: str | None = None
    #: The node's identity (node roots), when present and readable.
    identity: NodeIdentity | None = None
    #: Why a present identity file could not be read.
    identity_error: str | None = None
    #: The replicas the node keeps for ranks of other nodes (node roots), by job and rank.
    replicas: list[KeptReplicas] = field(default_factory=list)
    #: What killed writers left (temporary files, unfinished uploads), each judged.
    leftovers: list[Leftover] = field(default_factory=list)
    #: Why the leftovers could not be listed.
    leftovers_error: str | None = None
    #: A node root's own records, relative to it (``manifest``, ``identity.json``,
    #: ``locks/r<rank>.lock``), and whether it has a ``blobs/`` folder.
    node_records: list[str] = field(default_factory=list)
    has_blobs: bool = True

    @property
    def newest_commit(self) -> CommitRecord | None:
        """The readable ``COMMIT`` record of the newest version that has one."""
        records = [e.commit for _, e in sorted(self.versions.items()) if e.commit is not None]
        return records[-1] if records else None

    @property
    def committed_versions(self) -> list[int]:
        """Versions that claim to be committed, ascending."""
        return [v for v, e in sorted(self.versions.items()) if e.committed]

    def restorable(self) -> list[int]:
        """Versions committed (or, without a manifest, complete) and whole, ascending."""
        return [
            v
            for v, e in sorted(self.versions.items())
            if e.complete and (e.committed or (e.committed is None))
        ]

    def blobs(self, versions: Iterable[int] | None = None) -> list[BlobEntry]:
        """The blobs of ``versions`` (all when ``None``), by version then rank."""
        chosen = sorted(self.versions) if versions is None else sorted(set(versions))
        return [
            self.versions[v].blobs[r]
            for v in chosen
            if v in self.versions
            for r in sorted(self.versions[v].blobs)
        ]

    def abandoned_set(self, tag: str) -> AbandonedSetEntry | None:
        """The abandoned set ``tag``, if the location holds it."""
        return next((s for s in self.abandoned if s.tag == tag), None)

    def committed_from(self, first: int) -> list[int]:
        """The whole committed versions of the run's own timeline from ``first`` on: what
        retention counts against an abandoned set (see
        :func:`tiercheck.consistency.abandoned.expired`)."""
        return [v for v in self.restorable() if v >= first]

    def unfinished_fate(self, aside: AbandonedSetEntry) -> tuple[bool, str]:
        """Whether an unfinished set (no ``SET`` record) may be removed, and why (or why not).

        The job's newest opening may be setting versions aside right now: its unfinished set
        stays. One of any earlier opening is debris: that opening is over, or is cut off at its
        next write (a newer opening owns the job), and nothing ever reads such a set.
        """
        if self.writer_generations and self.newest_writer is None:
            return False, (
                "kept: the job's newest writer generation cannot be read, so whether its "
                "opening is setting these versions aside right now cannot be told"
            )
        if self.newest_writer is not None and self.newest_writer.session == aside.session:
            return False, (
                f"kept: the job's newest opening (writer generation "
                f"{self.newest_writer.generation}, session {aside.session}) made it and may be "
                "setting these versions aside right now; `tiercheck gc` removes it once a later "
                "opening of the job has started"
            )
        return True, (
            "removable: the opening that made it is no longer the job's newest (it is over, or "
            "stops at its next write), and nothing reads the set; `tiercheck gc` removes it"
        )

    def base_source(self, tag: str, version: int) -> AbandonedSetEntry | None:
        """Where the abandoned set ``tag`` finds ``version`` (older than its first version)
        as it was when the set was made: the earliest whole set made after it that holds
        ``version`` (the run went back past ``version`` since, so that set holds the copy),
        or ``None`` -- the live version, unchanged since (or none)."""
        aside = self.abandoned_set(tag)
        if aside is None or aside.record is None:
            return None
        made = aside.record.time
        later = sorted(
            (s for s in self.abandoned if s.record is not None and s.record.time > made),
            key=lambda s: (s.record.time if s.record is not None else 0.0, s.tag),
        )
        for other in later:
            if other.first <= version and version in other.versions:
                return other
        return None

    def abandoned_view(self, tag: str) -> Catalog:
        """The abandoned set ``tag`` as a catalog of its own: its versions, and the older
        versions its deltas may need as bases, each as it was when the set was made (see
        :meth:`base_source`). The keys are the stored keys (under ``abandoned/<tag>/`` for the
        set's own blobs), so :func:`~tiercheck.catalog.verify`, ``decode_blob`` and
        :func:`~tiercheck.catalog.export` read a set as they read the live versions.

        Raises :class:`KeyError` when the location holds no set ``tag``.
        """
        aside = self.abandoned_set(tag)
        if aside is None:
            raise KeyError(tag)
        versions: dict[int, VersionEntry] = {}
        for v in sorted({*self.versions, *(v for s in self.abandoned for v in s.versions)}):
            if v >= aside.first:
                continue
            source = self.base_source(tag, v)
            entry = self.versions.get(v) if source is None else source.versions.get(v)
            if entry is not None:
                versions[v] = entry
        versions.update(aside.versions)
        ranks = {r for e in aside.versions.values() for r in (*e.blobs, *e.expected_ranks)}
        return Catalog(self.location, versions, tuple(sorted(ranks)))

    def to_json(self) -> dict[str, Any]:
        """Plain data for ``--json`` output."""
        return {
            **self.location.to_json(),
            "ranks": list(self.ranks),
            "manifest_error": self.manifest_error,
            "manifest_versions": self.manifest_versions,
            "versions": [e.to_json() for _, e in sorted(self.versions.items())],
            "job_record": _record_json(self.job_record),
            "job_record_error": self.job_record_error,
            "writers": {
                "count": len(self.writer_generations),
                "newest": _record_json(self.newest_writer),
                "error": self.writer_error,
            },
            "quarantined": [q.to_json() for q in self.quarantined],
            "probes": self.probes,
            "abandoned": [a.to_json() for a in self.abandoned],
            "tombstone": _record_json(self.tombstone),
            "tombstone_error": self.tombstone_error,
            "identity": _record_json(self.identity),
            "identity_error": self.identity_error,
            "replicas": [r.to_json() for r in self.replicas],
            "leftovers": [item.to_json() for item in self.leftovers],
            "leftovers_error": self.leftovers_error,
            "node_records": self.node_records,
        }
