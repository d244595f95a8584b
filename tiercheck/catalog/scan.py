"""What an opened location holds: :func:`scan_location` lists it into a :class:`Catalog`.

A catalog lists versions (each rank's blob and what records say of it: size, base, whether it is
committed), the records beside them (job record, writer generations, quarantined blobs, probes
in a persistent job folder; manifest and identity in a node root), the versions the run went
back from (abandoned sets, persistent job folders: :class:`AbandonedSetEntry`), what killed
writers left (temporary files, unfinished uploads: :mod:`tiercheck.catalog.leftovers`) and, in a
node root, the replicas the node keeps for ranks of other nodes. Scanning reads no blob, only
small records; :func:`tiercheck.catalog.read.inspect_blobs` reads blob headers into a catalog's
entries. The entries themselves (plain data and queries) are in :mod:`tiercheck.catalog.entries`
and importable from here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from tiercheck.catalog.base import LOCAL_TIER, REQUESTS, Location, LocationError
from tiercheck.catalog.entries import (
    AbandonedSetEntry,
    BlobEntry,
    BlobKindName,
    Catalog,
    KeptReplicas,
    QuarantinedBlob,
    VersionEntry,
)
from tiercheck.catalog.leftovers import find_leftovers
from tiercheck.consistency.abandoned import (
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
from tiercheck.consistency.keys import commit_key, parse_blob_key, parse_commit_key
from tiercheck.consistency.protocol import committed_in_tier
from tiercheck.consistency.worlds import world_of
from tiercheck.defaults import NodeRoot
from tiercheck.errors import BlobNotFound, FormatError, ManifestError, StorageError, TiercheckError
from tiercheck.smallfile import read_small
from tiercheck.tiers.local import LocalTier

if TYPE_CHECKING:
    from tiercheck.consistency.manifest import Manifest
    from tiercheck.tiers.base import Tier

_T = TypeVar("_T")


class Opened(Protocol):
    """What a scan reads of an opened location (a
    :class:`~tiercheck.catalog.locate.OpenLocation`, which runs the scan: named here by what it
    offers, so this module does not import the one that imports it)."""

    location: Location
    tier: Tier
    manifest: Manifest | None
    manifest_error: str | None

    @property
    def node_root(self) -> NodeRoot | None:
        """The node root's layout (``None`` for a persistent job folder)."""

    async def in_manifest_thread(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run a manifest call on the manifest's own thread."""


__all__ = [
    "AbandonedSetEntry",
    "BlobEntry",
    "BlobKindName",
    "Catalog",
    "KeptReplicas",
    "QuarantinedBlob",
    "VersionEntry",
    "scan_location",
]


async def scan_location(opened: Opened) -> Catalog:
    """List ``opened`` into a :class:`Catalog` (reads no blob, only small records).

    What every key is (:func:`_sort_keys`), then the records that describe the keys: ``COMMIT``
    records, the job record and newest writer generation (persistent job folders); the manifest,
    identity and kept replicas (node roots); the blobs' sizes; and what killed writers left.
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
            versions.setdefault(parsed.version, VersionEntry(parsed.version)).add(
                BlobEntry.listed(key, parsed)
            )
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
        aside.versions.setdefault(where.version, VersionEntry(where.version)).add(
            BlobEntry.listed(key, where)
        )
    elif copied is not None:
        aside.versions.setdefault(copied, VersionEntry(copied)).committed = True
    return True


async def _read_record(opened: Opened, key: str) -> bytes:
    """The small record under ``key``; raises what the tier raises."""
    return bytes(await opened.tier.get(key))


async def _read_job_record(opened: Opened, catalog: Catalog) -> None:
    try:
        catalog.job_record = JobRecord.from_bytes(await _read_record(opened, JOB_KEY))
    except (FormatError, BlobNotFound, StorageError) as exc:
        catalog.job_record_error = f"{type(exc).__name__}: {exc}"


async def _read_tombstone(opened: Opened, catalog: Catalog) -> None:
    try:
        catalog.tombstone = Tombstone.from_bytes(await _read_record(opened, TOMBSTONE_KEY))
    except (FormatError, BlobNotFound, StorageError) as exc:
        catalog.tombstone_error = f"{type(exc).__name__}: {exc}"


async def _read_newest_writer(opened: Opened, catalog: Catalog) -> None:
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


async def _read_identity(opened: Opened, catalog: Catalog) -> None:
    assert opened.node_root is not None  # a node root's scan
    path = opened.node_root.identity
    try:
        data = await read_small(path)  # aiofiles (tiercheck/smallfile.py)
    except OSError as exc:
        catalog.identity_error = f"{type(exc).__name__}: {exc}"
        return
    if data is None:
        return  # written by newer checkpointers only; its absence is normal
    try:
        catalog.identity = NodeIdentity.from_bytes(data)
    except FormatError as exc:
        catalog.identity_error = f"{type(exc).__name__}: {exc}"


async def _read_commits(
    opened: Opened, catalog: Catalog, commit_keys: list[tuple[int, str]]
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


async def _read_abandoned(opened: Opened, aside: AbandonedSetEntry) -> None:
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


async def _read_manifest(opened: Opened, catalog: Catalog) -> None:
    manifest = opened.manifest
    committed: set[int] = set()
    begun: set[int] = set()
    if manifest is not None:
        try:
            written = await opened.in_manifest_thread(manifest.blobs, LOCAL_TIER)
            committed = set(await opened.in_manifest_thread(manifest.committed, LOCAL_TIER))
            known = await opened.in_manifest_thread(manifest.versions)
        except ManifestError as exc:
            catalog.manifest_error = opened.manifest_error = str(exc)
            manifest = None
        else:
            catalog.written = {(d.version, d.rank): d for d in written}
            begun = {r for info in known.values() for r in info.get("begun", [])}
            catalog.manifest_versions = len(set(known) | committed | {d.version for d in written})
    seen = {r for e in catalog.versions.values() for r in e.blobs}
    catalog.ranks = tuple(sorted(seen | begun))
    # The engine's rule for a memory tier: the manifest saw it committed, and it is there.
    committed = committed_in_tier(commit_records=False, recorded=committed, held=catalog.versions)
    for v, entry in catalog.versions.items():
        entry.expected_ranks = catalog.ranks
        entry.committed = (v in committed) if manifest is not None else None
        for rank, blob in entry.blobs.items():
            record = catalog.written.get((v, rank))
            if record is not None and record.key == blob.key:
                blob.size = record.size
                blob.base = record.base
                blob.base_known = True


async def _fill_sizes(opened: Opened, catalog: Catalog) -> None:
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


async def _read_replicas(opened: Opened, catalog: Catalog) -> None:
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
        catalog.replicas.append(KeptReplicas(job, rank, versions, len(blobs), total))
