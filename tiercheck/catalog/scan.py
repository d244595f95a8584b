"""What an opened location holds: :func:`scan_location` lists it into a :class:`Catalog`.

A catalog lists versions (each rank's blob and what records say of it: size, base, whether it is
committed), the records beside them (job record, writer generations, quarantined blobs, probes
in a persistent job folder; manifest and identity in a node root), the versions the run went
back from (abandoned sets, persistent job folders: :class:`AbandonedSetEntry`), what killed
writers left (temporary files, unfinished uploads: :mod:`tiercheck.catalog.leftovers`) and, in a
node root, the replicas the node keeps for ranks of other nodes. Scanning reads no blob, only
small records; :func:`tiercheck.catalog.read.inspect_blobs` reads blob headers into a catalog's
entries.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from tiercheck.catalog.base import LOCAL_TIER, REQUESTS, Location, LocationError
from tiercheck.catalog.leftovers import find_leftovers
from tiercheck.codec import BlobMeta
from tiercheck.consistency.abandoned import (
    ABANDONED_PREFIX,
    SET_NAME,
    AbandonedSet,
    abandoned_key,
    parse_abandoned_key,
    parse_tag,
    set_record_key,
)
from tiercheck.consistency.commit import CommitRecord
from tiercheck.consistency.identity import (
    JOB_KEY,
    PROBE_PREFIX,
    TOMBSTONE_KEY,
    JobRecord,
    NodeIdentity,
    Tombstone,
    WriterRecord,
    parse_quarantine_key,
    parse_writer_key,
    writer_key,
)
from tiercheck.consistency.keys import BlobKind, commit_key, parse_blob_key, parse_commit_key
from tiercheck.consistency.manifest import Durable
from tiercheck.consistency.protocol import committed_in_tier
from tiercheck.consistency.worlds import world_of
from tiercheck.defaults import NodeRoot
from tiercheck.errors import BlobNotFound, FormatError, ManifestError, StorageError, TiercheckError
from tiercheck.tiers.base import Leftover
from tiercheck.tiers.local import LocalTier

if TYPE_CHECKING:
    from tiercheck.catalog.locate import OpenLocation

__all__ = [
    "AbandonedSetEntry",
    "BlobEntry",
    "BlobKindName",
    "Catalog",
    "HeldReplicas",
    "QuarantinedBlob",
    "VersionEntry",
    "scan_location",
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

    @property
    def kind(self) -> BlobKindName:
        """``full``, ``base``, ``delta``, or ``packed`` when not known without reading."""
        if self.encoding == "full":
            return "full"
        if not self.base_known:
            return "packed"
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
class HeldReplicas:
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
    #: Set when the node's manifest exists but cannot be read.
    manifest_error: str | None = None
    #: The manifest's durable records of the local tier, by (version, rank).
    durable: dict[tuple[int, int], Durable] = field(default_factory=dict)
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
    replicas: list[HeldReplicas] = field(default_factory=list)
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


async def scan_location(opened: OpenLocation) -> Catalog:
    """List ``opened`` into a :class:`Catalog` (reads no blob, only small records).

    What every key is (:func:`_sort_keys`), then the records that describe the keys: ``COMMIT``
    records, the job record and newest writer generation (persistent job folders); the manifest,
    identity and held replicas (node roots); the blobs' sizes; and what killed writers left.
    """
    loc = opened.location
    root = opened.node_root
    try:
        if root is not None and not await asyncio.to_thread(root.blobs.is_dir):
            keys = []  # only what an opening left (listing would make the folder)
        else:
            keys = [key async for key in opened.tier.list("")]
    except TiercheckError as exc:
        raise LocationError(f"cannot list the {loc.describe()}: {exc}") from exc
    catalog, commit_keys, has_job = _sort_keys(loc, keys)
    catalog.manifest_error = opened.manifest_error
    if loc.kind == "persistent":
        await _read_commits(opened, catalog, commit_keys)
        if has_job:
            await _read_job_record(opened, catalog)
        if TOMBSTONE_KEY in keys:
            await _read_tombstone(opened, catalog)
        if catalog.writer_generations:
            await _read_newest_writer(opened, catalog)
        await asyncio.gather(*(_read_abandoned(opened, a) for a in catalog.abandoned))
    else:
        assert root is not None
        catalog.has_blobs = await asyncio.to_thread(root.blobs.is_dir)
        records = await asyncio.to_thread(root.records)
        catalog.node_records = [str(p.relative_to(root.path)) for p in records]
        await _read_manifest(opened, catalog)
        await _read_identity(opened, catalog)
        _apply_worlds(catalog)
        await _read_replicas(opened, catalog)
    await _fill_sizes(opened, catalog)
    try:
        catalog.leftovers = await find_leftovers(loc, opened.tier, catalog.newest_writer)
    except (TiercheckError, OSError) as exc:
        catalog.leftovers_error = f"{type(exc).__name__}: {exc}"
    return catalog


def _apply_worlds(catalog: Catalog) -> None:
    """A node root of a job that changed its number of ranks: each version expects the ranks
    of the world that saved it (the identity's history, see tiercheck.consistency.worlds)."""
    identity = catalog.identity
    if identity is None or not identity.worlds:
        return
    for v, entry in catalog.versions.items():
        size = world_of(v, identity.worlds, identity.world_size)
        entry.expected_ranks = tuple(r for r in entry.expected_ranks if r < size)


def _sort_keys(loc: Location, keys: Iterable[str]) -> tuple[Catalog, list[tuple[int, str]], bool]:
    """A catalog of what the key names say, the ``COMMIT`` keys to read, and whether a job
    record is present."""
    versions: dict[int, VersionEntry] = {}
    commit_keys: list[tuple[int, str]] = []
    sets: dict[str, AbandonedSetEntry] = {}
    catalog = Catalog(loc, versions, ())
    has_job = False
    persistent = loc.kind == "persistent"
    for key in sorted(keys):
        original = parse_quarantine_key(key)
        if original is not None:
            where = parse_blob_key(original)
            catalog.quarantined.append(
                QuarantinedBlob(
                    key,
                    original,
                    None if where is None else where.version,
                    None if where is None else where.rank,
                )
            )
            continue
        if persistent and _sort_abandoned(sets, key):
            continue
        # Only tiers that outlive the cluster hold these; in a node's blobs/ they are foreign.
        if persistent and key == JOB_KEY:
            has_job = True
            continue
        if persistent and key == TOMBSTONE_KEY:
            continue  # read by scan_location
        if persistent and (generation := parse_writer_key(key)) is not None:
            catalog.writer_generations.append(generation)
            continue
        if persistent and key.startswith(PROBE_PREFIX):
            catalog.probes.append(key)
            continue
        parsed = parse_blob_key(key)
        if parsed is not None:
            entry = versions.setdefault(parsed.version, VersionEntry(parsed.version))
            blob = BlobEntry(key, parsed.version, parsed.rank, parsed.kind)
            if parsed.kind == "full":
                blob.base_known = True
            # Two encodings of one rank's version in one tier: keep the full one, as the
            # checkpointer's restore does (the cheaper read).
            if parsed.rank not in entry.blobs or parsed.kind == "full":
                entry.blobs[parsed.rank] = blob
            continue
        v = parse_commit_key(key)
        if v is not None:
            versions.setdefault(v, VersionEntry(v))
            commit_keys.append((v, key))
            continue
        catalog.foreign.append(key)
    catalog.writer_generations.sort()
    catalog.abandoned = [sets[tag] for tag in sorted(sets)]
    return catalog, commit_keys, has_job


def _sort_abandoned(sets: dict[str, AbandonedSetEntry], key: str) -> bool:
    """File ``key`` into its abandoned set, if it is one of a set's keys (its ``SET`` record, a
    ``COMMIT`` copy or a blob); anything else under ``abandoned/`` is not tiercheck's."""
    parsed = parse_abandoned_key(key)
    if parsed is None:
        return False
    tag, inner = parsed
    where = parse_blob_key(inner)
    copied = parse_commit_key(inner)
    if inner != SET_NAME and where is None and copied is None:
        return False
    tagged = parse_tag(tag)
    assert tagged is not None  # parse_abandoned_key checked it
    aside = sets.setdefault(tag, AbandonedSetEntry(tag, tagged[0], tagged[1]))
    aside.keys.append(key)
    if inner == SET_NAME:
        aside.has_record = True
    elif where is not None:
        entry = aside.versions.setdefault(where.version, VersionEntry(where.version))
        blob = BlobEntry(key, where.version, where.rank, where.kind)
        blob.base_known = where.kind == "full"
        if where.rank not in entry.blobs or where.kind == "full":
            entry.blobs[where.rank] = blob
    elif copied is not None:
        aside.versions.setdefault(copied, VersionEntry(copied)).committed = True
    return True


async def _read_record(opened: OpenLocation, key: str) -> bytes:
    """The small record under ``key``; raises what the tier raises."""
    return bytes(await opened.tier.get(key))


async def _read_job_record(opened: OpenLocation, catalog: Catalog) -> None:
    try:
        catalog.job_record = JobRecord.from_bytes(await _read_record(opened, JOB_KEY))
    except (FormatError, BlobNotFound, StorageError) as exc:
        catalog.job_record_error = f"{type(exc).__name__}: {exc}"


async def _read_tombstone(opened: OpenLocation, catalog: Catalog) -> None:
    try:
        catalog.tombstone = Tombstone.from_bytes(await _read_record(opened, TOMBSTONE_KEY))
    except (FormatError, BlobNotFound, StorageError) as exc:
        catalog.tombstone_error = f"{type(exc).__name__}: {exc}"


async def _read_newest_writer(opened: OpenLocation, catalog: Catalog) -> None:
    generation = catalog.writer_generations[-1]
    key = writer_key(generation)
    try:
        record = WriterRecord.from_bytes(await _read_record(opened, key))
    except (FormatError, BlobNotFound, StorageError) as exc:
        catalog.writer_error = f"{type(exc).__name__}: {exc}"
        return
    if record.generation != generation:
        catalog.writer_error = f"{key} describes generation {record.generation}"
        return
    catalog.newest_writer = record


async def _read_identity(opened: OpenLocation, catalog: Catalog) -> None:
    assert opened.node_root is not None  # a node root's scan
    path = opened.node_root.identity
    try:
        data = await asyncio.to_thread(path.read_bytes)
    except FileNotFoundError:
        return  # written by newer checkpointers only; its absence is normal
    except OSError as exc:
        catalog.identity_error = f"{type(exc).__name__}: {exc}"
        return
    try:
        catalog.identity = NodeIdentity.from_bytes(data)
    except FormatError as exc:
        catalog.identity_error = f"{type(exc).__name__}: {exc}"


async def _read_commits(
    opened: OpenLocation, catalog: Catalog, commit_keys: list[tuple[int, str]]
) -> None:
    sem = asyncio.Semaphore(REQUESTS)

    async def one(version: int, key: str) -> None:
        entry = catalog.versions[version]
        entry.committed = True  # present: it claims the version whole, readable or not
        async with sem:
            try:
                data = await opened.tier.get(key)
                record = CommitRecord.from_bytes(bytes(data))
            except (FormatError, BlobNotFound, StorageError) as exc:
                entry.commit_error = f"{type(exc).__name__}: {exc}"
                return
        if record.version != version:
            entry.commit_error = f"{key} describes version {record.version}"
            return
        entry.commit = record
        for e in record.entries:
            blob = entry.blobs.get(e.rank)
            if blob is not None and blob.key == e.key:
                blob.size = e.size
                blob.base = e.base
                blob.base_known = True

    await asyncio.gather(*(one(v, k) for v, k in commit_keys))
    sizes = [e.commit.world_size for _, e in sorted(catalog.versions.items()) if e.commit]
    seen = {r for e in catalog.versions.values() for r in e.blobs}
    # Without a COMMIT of its own, a version should have every rank of the job's newest
    # COMMIT record; with none anywhere, every rank seen in any version.
    job_ranks = tuple(range(sizes[-1])) if sizes else tuple(sorted(seen))
    catalog.ranks = tuple(sorted(set(job_ranks) | seen))
    for entry in catalog.versions.values():
        entry.expected_ranks = tuple(range(entry.commit.world_size)) if entry.commit else job_ranks


async def _read_abandoned(opened: OpenLocation, aside: AbandonedSetEntry) -> None:
    """An abandoned set's ``SET`` record, its ``COMMIT`` copies (what they say of the blobs
    beside them, as :func:`_read_commits` does for live versions) and the sizes of its keys.
    What cannot be read is kept as an error for :func:`~tiercheck.catalog.verify`."""
    sem = asyncio.Semaphore(REQUESTS)
    aside.keys.sort()
    if aside.has_record:
        try:
            data = await _read_record(opened, set_record_key(aside.tag))
            aside.record = AbandonedSet.from_bytes(data)
        except (FormatError, BlobNotFound, StorageError) as exc:
            aside.record_error = f"{type(exc).__name__}: {exc}"

    async def commit(version: int) -> None:
        entry = aside.versions[version]
        key = abandoned_key(aside.tag, commit_key(version))
        async with sem:
            try:
                record = CommitRecord.from_bytes(await _read_record(opened, key))
            except (FormatError, BlobNotFound, StorageError) as exc:
                entry.commit_error = f"{type(exc).__name__}: {exc}"
                return
        if record.version != version:
            entry.commit_error = f"{key} describes version {record.version}"
            return
        entry.commit = record
        entry.expected_ranks = tuple(range(record.world_size))
        for e in record.entries:
            blob = entry.blobs.get(e.rank)
            if blob is not None and blob.key == abandoned_key(aside.tag, e.key):
                blob.size = e.size
                blob.base = e.base
                blob.base_known = True

    await asyncio.gather(*(commit(v) for v, e in aside.versions.items() if e.committed))
    known = {b.key: b.size for b in aside.blobs() if b.size is not None}
    sizes: dict[str, int | None] = {}

    async def size(key: str) -> None:
        async with sem:
            try:
                sizes[key] = await opened.tier.get_size(key)
            except (BlobNotFound, StorageError):
                sizes[key] = None  # gone since the listing, or unreadable: verify says which

    await asyncio.gather(*(size(k) for k in aside.keys if k not in known))
    for blob in aside.blobs():
        if blob.size is None:
            blob.size = sizes.get(blob.key)
    every = [known.get(k, sizes.get(k)) for k in aside.keys]
    aside.size = None if None in every else sum(n for n in every if n is not None)


async def _read_manifest(opened: OpenLocation, catalog: Catalog) -> None:
    manifest = opened.manifest
    committed: set[int] = set()
    begun: set[int] = set()
    if manifest is not None:
        try:
            durable = await opened.in_manifest_thread(manifest.blobs, LOCAL_TIER)
            committed = set(await opened.in_manifest_thread(manifest.committed, LOCAL_TIER))
            known = await opened.in_manifest_thread(manifest.versions)
        except ManifestError as exc:
            catalog.manifest_error = opened.manifest_error = str(exc)
            manifest = None
        else:
            catalog.durable = {(d.version, d.rank): d for d in durable}
            begun = {r for info in known.values() for r in info.get("begun", [])}
    seen = {r for e in catalog.versions.values() for r in e.blobs}
    catalog.ranks = tuple(sorted(seen | begun))
    # The engine's rule for a memory tier: the manifest saw it committed, and it is there.
    committed = committed_in_tier(commit_records=False, recorded=committed, held=catalog.versions)
    for v, entry in catalog.versions.items():
        entry.expected_ranks = catalog.ranks
        entry.committed = (v in committed) if manifest is not None else None
        for rank, blob in entry.blobs.items():
            record = catalog.durable.get((v, rank))
            if record is not None and record.key == blob.key:
                blob.size = record.size
                blob.base = record.base
                blob.base_known = True


async def _fill_sizes(opened: OpenLocation, catalog: Catalog) -> None:
    sem = asyncio.Semaphore(REQUESTS)

    async def one(blob: BlobEntry) -> None:
        async with sem:
            try:
                blob.size = await opened.tier.get_size(blob.key)
            except (BlobNotFound, StorageError):
                blob.size = None  # gone since the listing, or unreadable: verify says which

    async def quarantined(blob: QuarantinedBlob) -> None:
        async with sem:
            try:
                blob.size = await opened.tier.get_size(blob.key)
            except (BlobNotFound, StorageError):
                blob.size = None  # as above; verify reports it

    await asyncio.gather(
        *(one(b) for b in catalog.blobs() if b.size is None),
        *(quarantined(q) for q in catalog.quarantined),
    )


async def _read_replicas(opened: OpenLocation, catalog: Catalog) -> None:
    """Summarise ``replicas/``: what the node keeps for ranks of other nodes."""
    assert opened.node_root is not None  # a node root's scan
    folder = opened.node_root.replicas
    if not await asyncio.to_thread(folder.is_dir):
        return
    held: dict[tuple[str, int], dict[str, int]] = {}  # (job, rank) -> key -> version
    async with LocalTier(folder, spare_files=0, name="replicas", sweep=False) as tier:
        try:
            keys = [key async for key in tier.list("")]
        except TiercheckError as exc:
            raise LocationError(f"cannot list {folder}: {exc}") from exc
        for key in keys:
            parsed = NodeRoot.parse_replica_key(key)
            where = None if parsed is None else parse_blob_key(parsed[2])
            if parsed is not None and where is not None:
                held.setdefault((parsed[0], parsed[1]), {})[key] = where.version
        sizes: dict[str, int | None] = {}
        sem = asyncio.Semaphore(REQUESTS)

        async def size(key: str) -> None:
            async with sem:
                try:
                    sizes[key] = await tier.get_size(key)
                except (BlobNotFound, StorageError):
                    sizes[key] = None  # gone since the listing, or unreadable

        await asyncio.gather(*(size(k) for blobs in held.values() for k in blobs))
    for (job, rank), blobs in sorted(held.items()):
        known = [sizes.get(k) for k in blobs]
        total = None if None in known else sum(s for s in known if s is not None)
        versions = sorted(set(blobs.values()))
        catalog.replicas.append(HeldReplicas(job, rank, versions, len(blobs), total))
