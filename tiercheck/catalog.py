"""What is stored where: find, list, inspect, verify, export and trim checkpoints at rest.

The read side of tiercheck, for tools (the ``tiercheck`` command line is built on it) rather than
for training code. It works on *locations*, each one tier's view of one job:

* a **persistent job folder** -- ``<url>/<job_id>/`` of a :class:`~tiercheck.tiers.PersistentTier`
  (``file://``, a plain path, ``s3://``, ``memory://``...): ``packed`` blobs and ``COMMIT``
  records, and beside them the job record (``JOB``), the writer generations (``writers/g...``),
  blobs a restore set aside (``quarantine/<original key>``) and, after a crash while the job was
  opening, leftover probe objects (``probe/...``) -- see :mod:`tiercheck.consistency.identity`;
* a **node root** -- ``/dev/shm/tiercheck/<job>/<node>/`` (any folder holding ``blobs/`` and
  ``manifest/``): the node's :class:`~tiercheck.tiers.LocalTier` (``blobs/``, usually ``full``
  blobs, possibly ``quarantine/...`` too), its LMDB manifest (``manifest/``), its identity
  (``identity.json``) and the writers' locks (``locks/``).

:meth:`Store.scan` reads the job record, the newest writer generation and a node's identity
(their parse errors become :func:`verify` findings) and lists quarantined blobs apart from the
versions: nothing reads them as checkpoints (``inspect`` and ``export`` ignore them), ``verify``
reports each one, and ``gc`` keeps them unless asked to purge them. No command ever removes the
job record, a writer generation, a probe object or the identity file.

:func:`find_locations` turns what a user typed into locations (see its docstring for the
rules), :class:`Store` opens one, :meth:`Store.scan` lists it into a :class:`Catalog`, and
:func:`inspect_blobs`, :func:`verify`, :func:`export` and :func:`plan_gc` / :func:`apply_gc` do
the work. All tier I/O goes through the async :class:`~tiercheck.tiers.Tier` API; hashing,
decoding, the manifest and file writes run in worker threads, never on the event loop.

What "committed" means here is what recovery trusts: in a persistent job folder, a ``COMMIT``
record; in a node root, the manifest's ``commit`` record for the ``local`` tier (the local tier
writes no ``COMMIT`` objects). A version whose blobs are not all present is *torn*: a problem
when it claims to be committed, normal (a crash mid-save) when it does not.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import urllib.parse
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar

import numpy as np
import torch

from tiercheck.codec import BlobMeta, RawState, decode, own_copy, read_meta
from tiercheck.codec import verify as verify_blob
from tiercheck.consistency.commit import CommitRecord
from tiercheck.consistency.identity import (
    JOB_KEY,
    PROBE_PREFIX,
    QUARANTINE_PREFIX,
    JobRecord,
    NodeIdentity,
    WriterRecord,
    parse_quarantine_key,
    parse_writer_key,
    writer_key,
)
from tiercheck.consistency.keys import (
    BlobKind,
    blob_key,
    commit_key,
    parse_blob_key,
    parse_commit_key,
)
from tiercheck.consistency.manifest import Durable, Evict, Manifest
from tiercheck.consistency.retention import evictable
from tiercheck.defaults import DEFAULT_PERSISTENT_DIR, IDENTITY_FILE, memory_base
from tiercheck.errors import (
    BlobNotFound,
    ConfigError,
    FormatError,
    ManifestError,
    StorageError,
    TiercheckError,
)
from tiercheck.tiers.base import Buffer, Tier
from tiercheck.tiers.local import LocalTier
from tiercheck.tiers.persistent import PersistentTier

__all__ = [
    "FINDING_CODES",
    "LOCAL_TIER",
    "BlobEntry",
    "BlobKindName",
    "Catalog",
    "ExportResult",
    "Finding",
    "GcPlan",
    "Location",
    "LocationError",
    "NullProgress",
    "Progress",
    "QuarantinedBlob",
    "Store",
    "VerifyReport",
    "VersionEntry",
    "apply_gc",
    "default_search_paths",
    "export",
    "find_locations",
    "inspect_blobs",
    "plan_gc",
    "safetensors_payload",
    "verify",
]

_T = TypeVar("_T")

#: How a blob is encoded, as far as is known: ``full`` (raw payload, self-contained), ``base``
#: (packed, self-contained), ``delta`` (packed, needs its base), or ``packed`` (packed, base or
#: delta not known without reading the blob's header).
BlobKindName = Literal["full", "base", "delta", "packed"]

#: The local tier's name in a node's manifest (what the checkpointer logs it under).
LOCAL_TIER = "local"

# How many small requests (sizes, COMMIT records, deletes) run at once against a tier; blob
# reads are bounded more tightly (_READS) because each holds a whole blob in memory.
_REQUESTS = 16
_READS = 2

# Any path that ends in a tiercheck key: the part before it is a job folder (or a node root's
# blobs/ folder), or such a folder's quarantine/ folder.
_TAIL = re.compile(r"^(?P<prefix>(?:.*/)?)v\d{12}/(?:r\d{5}\.(?:full|packed)|COMMIT)$")
# A writer generation: with a job record beside it, the part before it is a job folder (one
# opened that has not saved anything yet).
_WRITER_TAIL = re.compile(r"^(?P<prefix>(?:.*/)?)writers/g\d{12}$")


class LocationError(ConfigError):
    """What was given does not name tiercheck data: a wrong URL, protocol, path or job.

    The message says what was expected and, where it can, what was found instead (for example
    the jobs stored at a URL when ``--job`` named none of them).
    """


# --- progress --------------------------------------------------------------------------------


class Progress(Protocol):
    """Where long operations report how far they are (a progress bar, or nothing)."""

    def start(self, total: int, what: str) -> None:
        """A new phase of ``total`` steps begins."""

    def advance(self, n: int = 1) -> None:
        """``n`` more steps of the current phase are done."""

    def finish(self) -> None:
        """The current phase is over."""


class NullProgress:
    """A :class:`Progress` that shows nothing."""

    def start(self, total: int, what: str) -> None:
        """Ignore the start of a phase."""

    def advance(self, n: int = 1) -> None:
        """Ignore progress."""

    def finish(self) -> None:
        """Ignore the end of a phase."""


# --- locations -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Location:
    """One tier's view of one job: a persistent job folder or a node root.

    ``url`` is the job folder's URL (persistent) or the node root's path (node); ``job`` the
    job's name as the folder names it (for a node root, by the ``<job>/<node>`` convention, the
    parent folder's name); ``node`` the node root's folder name.
    """

    kind: Literal["persistent", "node"]
    url: str
    job: str
    node: str | None = None
    storage_options: Mapping[str, Any] = field(default_factory=dict, compare=False)

    @property
    def tier_name(self) -> str:
        """The tier the location's blobs live in: ``"persistent"`` or ``"local"``."""
        return "persistent" if self.kind == "persistent" else LOCAL_TIER

    def describe(self) -> str:
        """One line naming the location, for messages."""
        if self.kind == "persistent":
            return f"persistent job {self.job!r} at {self.url}"
        return f"node root {self.url} (job {self.job!r}, node {self.node!r})"

    def to_json(self) -> dict[str, Any]:
        """Plain data for ``--json`` output."""
        return {"tier": self.tier_name, "url": self.url, "job": self.job, "node": self.node}


def _local_path(target: str) -> str | None:
    """The filesystem path ``target`` names, or ``None`` when it is a remote URL."""
    parsed = urllib.parse.urlsplit(target)
    if parsed.scheme in ("file", "local"):
        # file:///data/x -> /data/x; file://localhost/data/x too.
        return urllib.parse.unquote(parsed.path) or "/"
    if "://" in target or "::" in target:
        return None
    return os.path.expanduser(target)


def _is_node_root(path: Path) -> bool:
    return (path / "blobs").is_dir() and (path / "manifest").is_dir()


def _node_location(path: Path) -> Location:
    path = path.resolve()
    return Location("node", str(path), job=path.parent.name, node=path.name)


def _join(url: str, prefix: str) -> str:
    return url if not prefix else url.rstrip("/") + "/" + prefix.strip("/")


def _last_segment(url: str) -> str:
    path = urllib.parse.urlsplit(url).path if "://" in url else url
    name = path.rstrip("/").rsplit("/", 1)[-1]
    if not name and "://" in url:
        name = urllib.parse.urlsplit(url).netloc
    return name


def default_search_paths() -> list[str]:
    """Where the checkpointer stores things by default, those that exist.

    ``/dev/shm/tiercheck`` (node roots, by job) and ``./tiercheck-checkpoints`` (the default
    persistent folder); ``tiercheck ls`` without a URL looks in these.
    """
    candidates = [memory_base(), Path(DEFAULT_PERSISTENT_DIR).resolve()]
    return [str(p) for p in candidates if p.is_dir()]


def _probe_folder(target: str, folder: Path, job: str | None, local_root: bool) -> Location | None:
    """The node root local ``folder`` is (or holds as ``job``), else ``None``; checks it exists."""
    if not folder.exists():
        raise LocationError(
            f"{target!r} does not exist; expected a persistent URL or folder (the "
            "checkpointer's persistent= URL, or it plus the job id) or a node root "
            "(/dev/shm/tiercheck/<job>/<node>)"
        )
    if not folder.is_dir():
        raise LocationError(f"{target!r} is a file; expected a folder of checkpoints")
    if local_root or _is_node_root(folder):
        return _node_location(folder)
    if job is not None and _is_node_root(folder / job):
        return _node_location(folder / job)
    return None


def _owner(prefix: str, committing: set[str], keys: set[str]) -> str:
    """The folder a matched key's ``prefix`` belongs to: its parent for a quarantine folder."""
    quarantine = prefix == QUARANTINE_PREFIX or prefix.endswith("/" + QUARANTINE_PREFIX)
    if quarantine and prefix not in committing and prefix + JOB_KEY not in keys:
        return prefix[: -len(QUARANTINE_PREFIX)]
    return prefix


def _classify(
    keys: Sequence[str], target: str, path: str | None, options: Mapping[str, Any]
) -> dict[str, Location]:
    """The job folders and node roots that a recursive listing of ``target`` reveals."""
    found: dict[str, Location] = {}
    keyset = set(keys)
    matches = [(m.group("prefix"), key) for key in keys if (m := _TAIL.match(key)) is not None]
    # Only persistent job folders hold COMMIT records: a blobs/ folder without any is a node
    # root's, even where its manifest is gone.
    committing = {prefix for prefix, key in matches if key.endswith("/COMMIT")}
    # Blobs under <folder>/quarantine/ belong to <folder>, not to a job named "quarantine":
    # quarantine holds no COMMIT record and no job record, a job folder of that name does.
    matches = [(_owner(prefix, committing, keyset), key) for prefix, key in matches]
    committing = {prefix for prefix, key in matches if key.endswith("/COMMIT")}
    for key in keys:
        m = _WRITER_TAIL.match(key)
        if m is not None and m.group("prefix") + JOB_KEY in keyset:
            matches.append((m.group("prefix"), key))
    for prefix, _key in matches:
        if prefix in found:
            continue
        if path is not None and (prefix == "blobs/" or prefix.endswith("/blobs/")):
            root = Path(path) / prefix[: -len("blobs/")]
            if _is_node_root(root) or prefix not in committing:
                found[prefix] = _node_location(root)
                continue
        url = _join(target, prefix)
        found[prefix] = Location("persistent", url, _last_segment(url), None, options)
    if path is not None:
        # Node roots whose blobs were all evicted still have their manifest.
        for key in keys:
            if key == "manifest/data.mdb" or key.endswith("/manifest/data.mdb"):
                root = Path(path) / key[: -len("manifest/data.mdb")]
                if _is_node_root(root):
                    found.setdefault(str(root), _node_location(root))
    return found


async def find_locations(
    target: str,
    *,
    job: str | None = None,
    local_root: bool = False,
    storage_options: Mapping[str, Any] | None = None,
) -> list[Location]:
    """The locations ``target`` names, sorted; raises :class:`LocationError` if there are none.

    ``target`` may be:

    * a node root (a folder holding ``blobs/`` and ``manifest/``; with ``local_root=True`` any
      folder is taken as one, so a node whose manifest is gone can still be read);
    * a persistent job folder: a URL or path whose keys are ``v<version>/r<rank>.<kind>`` and
      ``v<version>/COMMIT`` (the URL given to the checkpointer plus the job id), or that holds
      a ``JOB`` record and ``writers/`` generations (a job opened that has saved nothing yet);
      blobs under ``<job folder>/quarantine/`` belong to that job folder;
    * any folder or URL above these -- the checkpointer's ``persistent=`` URL holding one folder
      per job, ``/dev/shm/tiercheck`` holding ``<job>/<node>`` roots: everything below it is
      listed and every job folder and node root found is returned.

    ``job`` keeps only the locations of that job (for a job folder, its folder name; for a
    node root, its parent folder's name); when it matches none, the error lists the jobs found.
    Listing a large bucket from its top reads every key name: give the job's URL where it is
    known.
    """
    options = dict(storage_options or {})
    path = _local_path(target)
    if path is not None:
        direct = await asyncio.to_thread(_probe_folder, target, Path(path), job, local_root)
        if direct is not None:
            return [direct]
    elif local_root:
        raise LocationError(f"a node root is a local folder, not the URL {target!r}")

    try:
        tier = PersistentTier(target, storage_options=options)
    except ConfigError as exc:
        raise LocationError(str(exc)) from exc
    try:
        keys = [key async for key in tier.list("")]
    except TiercheckError as exc:
        raise LocationError(f"cannot list {target!r}: {exc}") from exc
    finally:
        await tier.aclose()
    # Telling node roots from job folders stats folders: a worker thread's job.
    found = await asyncio.to_thread(_classify, keys, target, path, options)
    if not found:
        raise LocationError(
            f"no tiercheck checkpoints at {target!r}: expected a job folder holding "
            "v<version>/r<rank>.packed|full and v<version>/COMMIT keys (or a JOB record and "
            "writers/), a folder of such job folders, or a node root holding blobs/ and "
            "manifest/"
        )
    located = sorted(set(found.values()), key=lambda loc: (loc.kind, loc.job, loc.url))
    if job is None:
        return located
    matching = [loc for loc in located if loc.job == job]
    if not matching:
        jobs = ", ".join(sorted({loc.job for loc in located}))
        raise LocationError(f"no job {job!r} at {target!r}; jobs found: {jobs}")
    return matching


# --- the catalog -----------------------------------------------------------------------------


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


def _record_json(record: JobRecord | WriterRecord | NodeIdentity | None) -> dict[str, Any] | None:
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
    #: The node's identity (node roots), when present and readable.
    identity: NodeIdentity | None = None
    #: Why a present identity file could not be read.
    identity_error: str | None = None

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
            "identity": _record_json(self.identity),
            "identity_error": self.identity_error,
        }


class Store:
    """An open location: its tier and, for a node root, its manifest.

    Use as ``async with Store(location) as store:``. Nothing is created: a node root's folders
    must exist (the manifest is opened only where ``manifest/`` does).
    """

    def __init__(self, location: Location) -> None:
        self.location = location
        self.tier: Tier
        if location.kind == "persistent":
            try:
                self.tier = PersistentTier(location.url, storage_options=location.storage_options)
            except ConfigError as exc:
                raise LocationError(str(exc)) from exc
        else:
            blobs = Path(location.url) / "blobs"
            if not blobs.is_dir():
                raise LocationError(f"{location.url} holds no blobs/ folder; not a node root")
            # No spare files: this process is short-lived, and a spare it kept would be memory
            # the job's own local tier does not know about.
            self.tier = LocalTier(blobs, spare_files=0)
        self.manifest: Manifest | None = None
        self.manifest_error: str | None = None
        # LMDB calls are quick but blocking, and transactions belong to a thread: one thread.
        self._manifest_thread = ThreadPoolExecutor(1, thread_name_prefix="tiercheck-manifest")

    async def __aenter__(self) -> Store:
        folder = Path(self.location.url) / "manifest"
        if self.location.kind == "node" and folder.is_dir():
            try:
                self.manifest = await self.in_manifest_thread(Manifest, folder)
            except ManifestError as exc:
                self.manifest_error = str(exc)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the tier and the manifest."""
        await self.tier.aclose()
        if self.manifest is not None:
            await self.in_manifest_thread(self.manifest.close)
            self.manifest = None
        self._manifest_thread.shutdown(wait=True)

    async def in_manifest_thread(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run a manifest call on the manifest's own thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._manifest_thread, fn, *args)

    async def get(self, key: str) -> Buffer:
        """The blob under ``key``."""
        return await self.tier.get(key)

    async def scan(self) -> Catalog:
        """List the location into a :class:`Catalog` (reads no blob, only small records)."""
        loc = self.location
        try:
            keys = [key async for key in self.tier.list("")]
        except TiercheckError as exc:
            raise LocationError(f"cannot list the {loc.describe()}: {exc}") from exc
        versions: dict[int, VersionEntry] = {}
        commit_keys: list[tuple[int, str]] = []
        foreign: list[str] = []
        quarantined: list[QuarantinedBlob] = []
        writers: list[int] = []
        probes: list[str] = []
        has_job = False
        persistent = loc.kind == "persistent"
        for key in sorted(keys):
            original = parse_quarantine_key(key)
            if original is not None:
                where = parse_blob_key(original)
                quarantined.append(
                    QuarantinedBlob(
                        key,
                        original,
                        None if where is None else where.version,
                        None if where is None else where.rank,
                    )
                )
                continue
            # Only tiers that outlive the cluster hold these; in a node's blobs/ they are foreign.
            if persistent and key == JOB_KEY:
                has_job = True
                continue
            if persistent and (generation := parse_writer_key(key)) is not None:
                writers.append(generation)
                continue
            if persistent and key.startswith(PROBE_PREFIX):
                probes.append(key)
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
            foreign.append(key)

        catalog = Catalog(
            loc,
            versions,
            (),
            self.manifest_error,
            foreign=foreign,
            writer_generations=sorted(writers),
            quarantined=quarantined,
            probes=probes,
        )
        if persistent:
            await self._read_commits(catalog, commit_keys)
            if has_job:
                await self._read_job_record(catalog)
            if writers:
                await self._read_newest_writer(catalog)
        else:
            await self._read_manifest(catalog)
            await self._read_identity(catalog)
        await self._fill_sizes(catalog)
        return catalog

    async def _read_record(self, key: str) -> bytes:
        """The small record under ``key``; raises what the tier raises."""
        return bytes(await self.tier.get(key))

    async def _read_job_record(self, catalog: Catalog) -> None:
        try:
            catalog.job_record = JobRecord.from_bytes(await self._read_record(JOB_KEY))
        except (FormatError, BlobNotFound, StorageError) as exc:
            catalog.job_record_error = f"{type(exc).__name__}: {exc}"

    async def _read_newest_writer(self, catalog: Catalog) -> None:
        generation = catalog.writer_generations[-1]
        key = writer_key(generation)
        try:
            record = WriterRecord.from_bytes(await self._read_record(key))
        except (FormatError, BlobNotFound, StorageError) as exc:
            catalog.writer_error = f"{type(exc).__name__}: {exc}"
            return
        if record.generation != generation:
            catalog.writer_error = f"{key} describes generation {record.generation}"
            return
        catalog.newest_writer = record

    async def _read_identity(self, catalog: Catalog) -> None:
        path = Path(self.location.url) / IDENTITY_FILE
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

    async def _read_commits(self, catalog: Catalog, commit_keys: list[tuple[int, str]]) -> None:
        sem = asyncio.Semaphore(_REQUESTS)

        async def one(version: int, key: str) -> None:
            entry = catalog.versions[version]
            entry.committed = True  # present: it claims the version whole, readable or not
            async with sem:
                try:
                    data = await self.tier.get(key)
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
            entry.expected_ranks = (
                tuple(range(entry.commit.world_size)) if entry.commit else job_ranks
            )

    async def _read_manifest(self, catalog: Catalog) -> None:
        manifest = self.manifest
        committed: set[int] = set()
        begun: set[int] = set()
        if manifest is not None:
            try:
                durable = await self.in_manifest_thread(manifest.blobs, LOCAL_TIER)
                committed = set(await self.in_manifest_thread(manifest.committed, LOCAL_TIER))
                known = await self.in_manifest_thread(manifest.versions)
            except ManifestError as exc:
                catalog.manifest_error = self.manifest_error = str(exc)
                manifest = None
            else:
                catalog.durable = {(d.version, d.rank): d for d in durable}
                begun = {r for info in known.values() for r in info.get("begun", [])}
        seen = {r for e in catalog.versions.values() for r in e.blobs}
        catalog.ranks = tuple(sorted(seen | begun))
        for v, entry in catalog.versions.items():
            entry.expected_ranks = catalog.ranks
            entry.committed = (v in committed) if manifest is not None else None
            for rank, blob in entry.blobs.items():
                record = catalog.durable.get((v, rank))
                if record is not None and record.key == blob.key:
                    blob.size = record.size
                    blob.base = record.base
                    blob.base_known = True

    async def _fill_sizes(self, catalog: Catalog) -> None:
        sem = asyncio.Semaphore(_REQUESTS)

        async def one(blob: BlobEntry) -> None:
            async with sem:
                try:
                    blob.size = await self.tier.get_size(blob.key)
                except (BlobNotFound, StorageError):
                    blob.size = None  # gone since the listing, or unreadable: verify says which

        async def quarantined(blob: QuarantinedBlob) -> None:
            async with sem:
                try:
                    blob.size = await self.tier.get_size(blob.key)
                except (BlobNotFound, StorageError):
                    blob.size = None  # as above; verify reports it

        await asyncio.gather(
            *(one(b) for b in catalog.blobs() if b.size is None),
            *(quarantined(q) for q in catalog.quarantined),
        )


# --- inspect ---------------------------------------------------------------------------------


async def _bounded(
    items: Sequence[_T], fn: Callable[[_T], Any], limit: int, progress: Progress
) -> None:
    """Run ``await fn(item)`` for every item, ``limit`` at a time, advancing ``progress``."""
    sem = asyncio.Semaphore(limit)

    async def one(item: _T) -> None:
        async with sem:
            await fn(item)
        progress.advance()

    await asyncio.gather(*(one(i) for i in items))


async def inspect_blobs(
    store: Store, blobs: Sequence[BlobEntry], progress: Progress | None = None
) -> dict[str, str]:
    """Read the headers of ``blobs`` (entries of a :class:`Catalog`) into the entries.

    Returns the keys that could not be read, with the reason. The tier API reads whole blobs,
    so this reads every chosen blob once (the body is not hashed: that is :func:`verify`).
    """
    progress = progress or NullProgress()
    errors: dict[str, str] = {}

    async def one(blob: BlobEntry) -> None:
        try:
            data = await store.get(blob.key)
            blob.learn(await asyncio.to_thread(read_meta, data))
        except (TiercheckError, OSError) as exc:
            errors[blob.key] = f"{type(exc).__name__}: {exc}"

    progress.start(len(blobs), "reading headers")
    try:
        await _bounded(blobs, one, _READS, progress)
    finally:
        progress.finish()
    return errors


# --- verify ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Finding:
    """Something :func:`verify` found.

    ``severity`` is ``"problem"`` (the data is not what it claims: a failed checksum, a missing
    blob of a committed version, a delta without its base) or ``"warning"`` (normal after a
    crash, or harmless: a torn version that never claimed to be committed). ``code`` is a
    stable, machine-readable name (see :data:`FINDING_CODES`).
    """

    severity: Literal["problem", "warning"]
    code: str
    message: str
    key: str | None = None
    version: int | None = None
    rank: int | None = None

    def to_json(self) -> dict[str, Any]:
        """Plain data for ``--json`` output."""
        return {
            "severity": self.severity,
            "code": self.code,
            "message": self.message,
            "key": self.key,
            "version": self.version,
            "rank": self.rank,
        }


#: Every ``Finding.code``, with what it means.
FINDING_CODES: Mapping[str, str] = {
    "corrupt": "a blob fails its checksum or is not a readable blob",
    "unreadable": "a blob could not be read from the tier",
    "wrong-key": "a blob's header names another version, rank or encoding than its key",
    "missing-base": "a delta's base blob is not in the same location",
    "base-mismatch": "a delta's base blob is not the one it was encoded against",
    "torn-committed": "a committed version lacks some rank's blob",
    "torn": "an uncommitted version lacks some rank's blob (normal after a crash)",
    "uncommitted": "a version has every blob but is not committed (no COMMIT / manifest commit)",
    "commit-unreadable": "a COMMIT record is not a valid record",
    "commit-mismatch": "a COMMIT record disagrees with the blob it lists",
    "manifest": "the node's manifest cannot be read",
    "manifest-mismatch": "a blob differs from what the manifest recorded as durable",
    "decode": "a version does not decode to the payload recorded at save time",
    "record-unreadable": "the job record, the newest writer generation or a node's identity.json "
    "is not a valid record",
    "job-record-mismatch": "the job record disagrees with the newest COMMIT record (world size "
    "or job id)",
    "quarantined": "a restore set a blob aside after it failed verification; the version was "
    "not restored from it (warning)",
    "probe-leftover": "a probe object of an opening that did not finish (a crash while the job "
    "was opening, or one opening now; warning)",
}


@dataclass
class VerifyReport:
    """What :func:`verify` checked and found."""

    location: Location
    versions: list[int]
    blobs_checked: int
    findings: list[Finding]

    @property
    def problems(self) -> list[Finding]:
        """Findings of severity ``problem``."""
        return [f for f in self.findings if f.severity == "problem"]

    @property
    def warnings(self) -> list[Finding]:
        """Findings of severity ``warning``."""
        return [f for f in self.findings if f.severity == "warning"]

    def to_json(self) -> dict[str, Any]:
        """Plain data for ``--json`` output."""
        return {
            **self.location.to_json(),
            "versions": self.versions,
            "blobs_checked": self.blobs_checked,
            "problems": len(self.problems),
            "warnings": len(self.warnings),
            "findings": [f.to_json() for f in self.findings],
        }


def _hex(value: int) -> str:
    return f"{value:#018x}"


async def verify(
    store: Store,
    catalog: Catalog,
    versions: Iterable[int] | None = None,
    *,
    deep: bool = False,
    progress: Progress | None = None,
) -> VerifyReport:
    """Check the blobs of ``versions`` (all if ``None``) and the records that describe them.

    Every blob is read and checked against its checksum (:func:`tiercheck.codec.verify`);
    deltas must have their base -- the exact one, by raw digest -- in the same location; a
    ``COMMIT`` record must match the blobs it lists (key, size, checksum, raw digest, base); in
    a node root, blobs must match the manifest's durable records. Torn versions are problems
    when they claim to be committed and warnings otherwise. With ``deep``, every version is
    also decoded (against its base) to check the payload end to end, as a restore would.

    The location's own records are checked too, whatever ``versions`` says: a job record, the
    newest writer generation or a node's identity that cannot be read, and a job record that
    disagrees with the newest ``COMMIT`` record, are problems; a leftover probe object is a
    warning. Every quarantined blob (of ``versions``, when given) is a warning; its copy is read
    and checked to say why it was set aside.
    """
    progress = progress or NullProgress()
    chosen = sorted(catalog.versions) if versions is None else sorted(set(versions))
    findings: list[Finding] = []
    if catalog.manifest_error is not None:
        findings.append(Finding("problem", "manifest", catalog.manifest_error))

    # Blobs of the chosen versions, plus the bases their deltas need (a corrupt base makes a
    # delta unrestorable, so it is checked too).
    todo: dict[str, BlobEntry] = {b.key: b for b in catalog.blobs(chosen)}
    metas: dict[str, BlobMeta] = {}
    failed: set[str] = set()

    async def check(blob: BlobEntry) -> None:
        try:
            data = await store.get(blob.key)
        except (TiercheckError, OSError) as exc:
            failed.add(blob.key)
            findings.append(
                Finding(
                    "problem",
                    "unreadable",
                    f"{blob.key}: cannot be read: {exc}",
                    blob.key,
                    blob.version,
                    blob.rank,
                )
            )
            return
        try:
            meta = await asyncio.to_thread(verify_blob, data)
        except (TiercheckError, ValueError) as exc:
            failed.add(blob.key)
            findings.append(
                Finding(
                    "problem",
                    "corrupt",
                    f"{blob.key}: {type(exc).__name__}: {exc}",
                    blob.key,
                    blob.version,
                    blob.rank,
                )
            )
            return
        blob.learn(meta)
        metas[blob.key] = meta
        if (meta.version, meta.rank, meta.kind) != (blob.version, blob.rank, blob.encoding):
            findings.append(
                Finding(
                    "problem",
                    "wrong-key",
                    f"{blob.key} holds a {meta.kind} blob of version {meta.version} rank "
                    f"{meta.rank}",
                    blob.key,
                    blob.version,
                    blob.rank,
                )
            )

    progress.start(len(todo), "verifying blobs")
    try:
        await _bounded(list(todo.values()), check, _READS, progress)
        bases: dict[str, BlobEntry] = {}
        for meta in metas.values():
            if meta.base is None:
                continue
            entry = catalog.versions.get(meta.base.version)
            base_blob = None if entry is None else entry.blobs.get(meta.rank)
            if base_blob is not None and base_blob.key not in todo:
                bases[base_blob.key] = base_blob
        if bases:
            progress.start(len(bases), "verifying bases")
            await _bounded(list(bases.values()), check, _READS, progress)
            todo.update(bases)
    finally:
        progress.finish()

    for v in chosen:
        entry = catalog.versions[v]
        findings.extend(_version_findings(catalog, entry, metas, failed))
    findings.extend(_record_findings(catalog))
    wanted = set(chosen)
    aside = [q for q in catalog.quarantined if versions is None or q.version in wanted]
    if aside:
        findings.extend(await _quarantine_findings(store, catalog, aside, progress))
    if deep:
        findings.extend(await _deep_check(store, catalog, chosen, failed, progress))
    order = {"problem": 0, "warning": 1}
    findings.sort(
        key=lambda f: (
            order[f.severity],
            -1 if f.version is None else f.version,
            -1 if f.rank is None else f.rank,
            f.code,
        )
    )
    return VerifyReport(catalog.location, chosen, len(todo), findings)


def _version_findings(
    catalog: Catalog, entry: VersionEntry, metas: Mapping[str, BlobMeta], failed: set[str]
) -> list[Finding]:
    out: list[Finding] = []
    v = entry.version
    loc = catalog.location

    def add(severity: Literal["problem", "warning"], code: str, msg: str, **kw: Any) -> None:
        out.append(Finding(severity, code, msg, version=v, **kw))

    # Deltas need their exact base, in this location.
    for rank, blob in sorted(entry.blobs.items()):
        meta = metas.get(blob.key)
        if meta is None or meta.base is None:
            continue
        want = meta.base
        base_entry = catalog.versions.get(want.version)
        base_blob = None if base_entry is None else base_entry.blobs.get(rank)
        if base_blob is None:
            add(
                "problem",
                "missing-base",
                f"{blob.key} is a delta against version {want.version}, whose blob "
                f"{blob_key(want.version, rank, 'packed')} is not in the {loc.tier_name} tier",
                key=blob.key,
                rank=rank,
            )
            continue
        base_meta = metas.get(base_blob.key)
        if base_meta is None:
            continue  # the base itself is reported as unreadable or corrupt
        if base_meta.base is not None or base_meta.raw_digest != want.raw_digest:
            add(
                "problem",
                "base-mismatch",
                f"{blob.key} is a delta against version {want.version} with raw digest "
                f"{_hex(want.raw_digest)}; {base_blob.key} is "
                + (
                    "itself a delta"
                    if base_meta.base is not None
                    else f"raw digest {_hex(base_meta.raw_digest)}"
                ),
                key=blob.key,
                rank=rank,
            )

    # Torn versions.
    missing = entry.missing_ranks
    if missing and entry.committed:
        aside = {q.rank: q.key for q in catalog.quarantined if q.version == v}
        for rank in missing:
            where = f" (a restore set it aside as {aside[rank]})" if rank in aside else ""
            add(
                "problem",
                "torn-committed",
                f"version {v} is committed but rank {rank}'s blob is missing{where}",
                key=blob_key(v, rank, "packed" if loc.kind == "persistent" else "full"),
                rank=rank,
            )
    elif missing:
        add(
            "warning",
            "torn",
            f"version {v} lacks the blobs of ranks {missing} and is not committed (normal "
            "after a crash mid-save; restore skips it and `tiercheck gc` removes it)",
        )
    elif entry.committed is False and entry.blobs:
        proof = "no COMMIT record" if loc.kind == "persistent" else "no commit in the manifest"
        add(
            "warning",
            "uncommitted",
            f"version {v} has every blob but {proof} (still being saved, or the save failed "
            "before committing)",
        )

    # The COMMIT record against the blobs.
    if entry.commit_error is not None:
        add(
            "problem",
            "commit-unreadable",
            f"{commit_key(v)}: {entry.commit_error}",
            key=commit_key(v),
        )
    if entry.commit is not None:
        for e in entry.commit.entries:
            listed = entry.blobs.get(e.rank)
            if listed is None:
                continue  # reported as torn-committed
            meta = metas.get(listed.key)
            diffs = []
            if listed.key != e.key:
                diffs.append(f"key {e.key} != {listed.key}")
            if meta is not None:
                if meta.nbytes != e.size:
                    diffs.append(f"size {e.size} != {meta.nbytes}")
                if meta.checksum != e.checksum:
                    diffs.append(f"checksum {_hex(e.checksum)} != {_hex(meta.checksum)}")
                if meta.raw_digest != e.raw_digest:
                    diffs.append(f"raw digest {_hex(e.raw_digest)} != {_hex(meta.raw_digest)}")
                base = None if meta.base is None else meta.base.version
                if base != e.base:
                    diffs.append(f"base {e.base} != {base}")
            if diffs:
                add(
                    "problem",
                    "commit-mismatch",
                    f"{commit_key(v)} disagrees with {listed.key}: " + "; ".join(diffs),
                    key=listed.key,
                    rank=e.rank,
                )

    # The manifest's durable records against the blobs (node roots).
    if loc.kind == "node":
        for rank, blob in sorted(entry.blobs.items()):
            record = catalog.durable.get((v, rank))
            meta = metas.get(blob.key)
            if record is None or meta is None or record.key != blob.key:
                continue
            if (record.size, record.checksum) != (meta.nbytes, meta.checksum):
                add(
                    "problem",
                    "manifest-mismatch",
                    f"{blob.key} is {meta.nbytes} bytes with checksum {_hex(meta.checksum)}; "
                    f"the manifest recorded {record.size} bytes, {_hex(record.checksum)}",
                    key=blob.key,
                    rank=rank,
                )
    return out


def _record_findings(catalog: Catalog) -> list[Finding]:
    """What is wrong with the location's own records: job record, writers, identity, probes."""
    out: list[Finding] = []
    unreadable = [
        (JOB_KEY, catalog.job_record_error),
        (
            writer_key(catalog.writer_generations[-1]) if catalog.writer_generations else "",
            catalog.writer_error,
        ),
        (IDENTITY_FILE, catalog.identity_error),
    ]
    for key, error in unreadable:
        if error is not None:
            out.append(Finding("problem", "record-unreadable", f"{key}: {error}", key))
    job, commit = catalog.job_record, catalog.newest_commit
    if job is not None and commit is not None:
        diffs = []
        if job.world_size != commit.world_size:
            diffs.append(f"world size {job.world_size} != {commit.world_size}")
        if job.job_id != commit.job_id:
            diffs.append(f"job id {job.job_id!r} != {commit.job_id!r}")
        if diffs:
            out.append(
                Finding(
                    "problem",
                    "job-record-mismatch",
                    f"{JOB_KEY} disagrees with {commit_key(commit.version)}, the newest COMMIT "
                    f"record: " + "; ".join(diffs) + " (a run of this job is refused, or data "
                    "of two jobs is mixed here)",
                    JOB_KEY,
                    commit.version,
                )
            )
    for key in catalog.probes:
        out.append(
            Finding(
                "warning",
                "probe-leftover",
                f"{key} was left by an opening of the job that did not finish (a crash while "
                "it was opening, or one opening right now); harmless, and safe to delete once "
                "no run of the job is starting",
                key,
            )
        )
    return out


async def _quarantine_findings(
    store: Store, catalog: Catalog, aside: Sequence[QuarantinedBlob], progress: Progress
) -> list[Finding]:
    """One warning per quarantined blob, saying why it was set aside where its bytes tell."""
    out: list[Finding] = []

    async def one(blob: QuarantinedBlob) -> None:
        try:
            data = await store.get(blob.key)
        except (TiercheckError, OSError) as exc:
            why = f"its copy cannot be read now ({type(exc).__name__}: {exc})"
        else:
            try:
                meta = await asyncio.to_thread(verify_blob, data)
            except (TiercheckError, ValueError) as exc:
                why = f"{type(exc).__name__}: {exc}"
            else:
                where = parse_blob_key(blob.original)
                if where is not None and (meta.version, meta.rank, meta.kind) != (
                    where.version,
                    where.rank,
                    where.kind,
                ):
                    why = (
                        f"it holds a {meta.kind} blob of version {meta.version} rank "
                        f"{meta.rank}, not the one its key names"
                    )
                else:
                    why = (
                        "its bytes pass their checksum now (it may have failed to decode, or "
                        "its delta base was missing or not the one it was encoded against)"
                    )
            del data
        if blob.version is not None:
            what = f"rank {blob.rank}'s blob of version {blob.version}"
            entry = catalog.versions.get(blob.version)
            now = None if entry is None or blob.rank is None else entry.blobs.get(blob.rank)
            outcome = f"version {blob.version} was not restored from it" + (
                f" ({now.key} holds a blob again)" if now is not None else ""
            )
        else:
            what, outcome = blob.original, "nothing was restored from it"
        out.append(
            Finding(
                "warning",
                "quarantined",
                f"{blob.key}: {what} was set aside by a restore: {why}; {outcome}. The copy "
                "holds the original bytes and stays for inspection; `tiercheck gc "
                "--purge-quarantine` removes it",
                blob.key,
                blob.version,
                blob.rank,
            )
        )

    progress.start(len(aside), "verifying quarantined blobs")
    try:
        await _bounded(aside, one, _READS, progress)
    finally:
        progress.finish()
    return out


async def _deep_check(
    store: Store, catalog: Catalog, versions: Sequence[int], failed: set[str], progress: Progress
) -> list[Finding]:
    """Decode every blob of ``versions`` (against its base) and report what does not decode."""
    blobs = [b for b in catalog.blobs(versions) if b.key not in failed]
    out: list[Finding] = []

    async def one(blob: BlobEntry) -> None:
        try:
            await _decode_blob(store, catalog, blob)
        except (TiercheckError, OSError, ValueError) as exc:
            out.append(
                Finding(
                    "problem",
                    "decode",
                    f"{blob.key} does not decode: {type(exc).__name__}: {exc}",
                    blob.key,
                    blob.version,
                    blob.rank,
                )
            )

    progress.start(len(blobs), "decoding")
    try:
        # One at a time: a decode holds the blob, its base and two payloads in memory.
        await _bounded(blobs, one, 1, progress)
    finally:
        progress.finish()
    return out


async def _decode_blob(store: Store, catalog: Catalog, blob: BlobEntry) -> RawState:
    """Read and decode ``blob``, reading and decoding its base first when it is a delta."""
    data = await store.get(blob.key)
    meta = await asyncio.to_thread(read_meta, data)
    base: RawState | None = None
    if meta.base is not None:
        entry = catalog.versions.get(meta.base.version)
        base_blob = None if entry is None else entry.blobs.get(meta.rank)
        if base_blob is None:
            raise BlobNotFound(
                f"{blob.key} is a delta against version {meta.base.version}, which has no blob "
                f"of rank {meta.rank} in the {catalog.location.tier_name} tier"
            )
        base_data = await store.get(base_blob.key)
        base_meta = await asyncio.to_thread(read_meta, base_data)
        if base_meta.base is not None:
            raise FormatError(f"{base_blob.key} is a delta, but a base must be self-contained")
        base = await asyncio.to_thread(decode, base_data)
        del base_data
    return await asyncio.to_thread(decode, data, base=base)


# --- export ----------------------------------------------------------------------------------


@dataclass
class ExportResult:
    """What :func:`export` wrote."""

    location: Location
    version: int
    rank: int
    #: ``(format, path, bytes)`` per file written.
    files: list[tuple[str, str, int]]
    tensors: int
    warnings: list[str]

    def to_json(self) -> dict[str, Any]:
        """Plain data for ``--json`` output."""
        return {
            **self.location.to_json(),
            "version": self.version,
            "rank": self.rank,
            "tensors": self.tensors,
            "files": [{"format": f, "path": p, "bytes": n} for f, p, n in self.files],
            "warnings": self.warnings,
        }


# Torch dtypes a safetensors file can hold, by name (looked up, as some builds lack a few).
_SAFETENSORS_DTYPES = frozenset(
    getattr(torch, name)
    for name in (
        "bool",
        "uint8",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "complex64",
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
    )
    if isinstance(getattr(torch, name, None), torch.dtype)
)

_JSON_SCALARS = (type(None), bool, int, float, str)


def _jsonable(value: Any) -> bool:
    if isinstance(value, _JSON_SCALARS):
        return True
    if isinstance(value, (list, tuple)):
        return all(_jsonable(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _jsonable(v) for k, v in value.items())
    return False


def safetensors_payload(
    state: Any, *, meta: Mapping[str, Any]
) -> tuple[dict[str, torch.Tensor], dict[str, str], list[str]]:
    """Flatten ``state`` for a safetensors file: ``(tensors, metadata, warnings)``.

    Tensors are keyed by their path in the state, dotted (``model.0.weight``, ``optim.state.0
    .exp_avg``) -- or, if two paths would give one dotted name, in subscript form
    (``['model']['0.weight']``) for all of them. numpy arrays become tensors. A tensor of a
    dtype safetensors cannot hold (complex128, complex32, bit types) is stored as its raw bytes
    (``uint8``), its dtype and shape listed in the ``tiercheck`` metadata entry under
    ``raw_dtypes``. Every other leaf (numbers, strings, ``None``, and lists or string-keyed
    dicts of these; also empty containers) goes into the metadata as JSON under its dotted
    path; leaves JSON cannot hold (bytes, complex numbers, dtypes...) are left out and named in
    the warnings. The ``tiercheck`` entry holds ``meta`` plus the key style; ``format`` is
    ``pt``, as the Hugging Face tools expect.
    """
    tensors: list[tuple[tuple[Any, ...], str, torch.Tensor]] = []
    leaves: list[tuple[tuple[Any, ...], Any]] = []

    def walk(obj: Any, parts: tuple[Any, ...], subscript: str) -> None:
        if isinstance(obj, torch.Tensor):
            tensors.append((parts, subscript, obj))
        elif isinstance(obj, np.ndarray):
            try:
                tensors.append((parts, subscript, torch.from_numpy(np.ascontiguousarray(obj))))
            except TypeError:
                raw = np.ascontiguousarray(obj).reshape(-1).view(np.uint8)
                tensors.append((parts, subscript, torch.from_numpy(raw.copy())))
                warnings.append(f"{subscript}: numpy dtype {obj.dtype} stored as raw bytes")
        elif isinstance(obj, dict) and obj:
            for k, v in obj.items():
                walk(v, (*parts, k), f"{subscript}[{k!r}]")
        elif isinstance(obj, (list, tuple)) and obj and not _jsonable(obj):
            for i, v in enumerate(obj):
                walk(v, (*parts, i), f"{subscript}[{i}]")
        else:
            leaves.append((parts, obj))

    warnings: list[str] = []
    walk(state, (), "")
    dotted = [".".join(str(p) for p in parts) for parts, _, _ in tensors]
    style = "dotted" if len(set(dotted)) == len(dotted) and all(dotted) else "subscript"
    names = dotted if style == "dotted" else [sub for _, sub, _ in tensors]

    out: dict[str, torch.Tensor] = {}
    raw_dtypes: dict[str, list[Any]] = {}
    for name, (_, _, tensor) in zip(names, tensors, strict=True):
        t = tensor.detach().cpu().contiguous()
        if t.dtype not in _SAFETENSORS_DTYPES:
            raw_dtypes[name] = [str(t.dtype).removeprefix("torch."), list(t.shape)]
            t = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
            warnings.append(f"{name}: dtype {raw_dtypes[name][0]} stored as raw bytes (uint8)")
        out[name] = t

    metadata: dict[str, str] = {
        "format": "pt",
        "tiercheck": json.dumps({**meta, "keys": style, "raw_dtypes": raw_dtypes}),
    }
    for parts, leaf in leaves:
        name = ".".join(str(p) for p in parts) or "."
        value = leaf.item() if isinstance(leaf, np.generic) else leaf
        if not _jsonable(value):
            warnings.append(f"{name}: a {type(value).__name__} leaf has no JSON form; left out")
            continue
        if name in metadata:
            warnings.append(f"{name}: clashes with the reserved metadata entry; left out")
            continue
        metadata[name] = json.dumps(value)
    return out, metadata, warnings


def _write_atomic(path: Path, write: Callable[[Path], None]) -> int:
    """Write a file through a temporary name, renamed into place once complete."""
    temp = path.with_name(f".{path.name}.tiercheck-tmp")
    try:
        write(temp)
        os.replace(temp, path)
    finally:
        temp.unlink(missing_ok=True)
    return path.stat().st_size


async def export(
    store: Store,
    catalog: Catalog,
    *,
    version: int,
    rank: int,
    out: Path,
    formats: Sequence[Literal["pt", "safetensors"]],
    allow_pickle: bool = False,
    progress: Progress | None = None,
) -> ExportResult:
    """Decode ``rank``'s blob of ``version`` (with its base) and write it as ``out.pt`` and/or
    ``out.safetensors``.

    The ``.pt`` file is ``torch.save`` of the restored state -- nested as it was saved, every
    tensor its own storage -- and so a pickle, as every ``torch.save`` file is; load it with
    ``torch.load`` (``weights_only=True`` works for states of tensors, numbers, strings and
    containers). The safetensors file is laid out by :func:`safetensors_payload`. Files are
    written under a temporary name and renamed into place. The state is bit-exact: decoding
    checks it against the digest recorded at save time.
    """
    progress = progress or NullProgress()
    entry = catalog.versions[version]
    blob = entry.blobs[rank]
    progress.start(1 + len(formats), f"exporting version {version} rank {rank}")
    files: list[tuple[str, str, int]] = []
    warnings: list[str] = []
    try:
        raw = await _decode_blob(store, catalog, blob)
        count = len(raw.layout.specs)
        state = own_copy(raw.state(allow_pickle=allow_pickle))
        del raw
        progress.advance()
        await asyncio.to_thread(out.parent.mkdir, parents=True, exist_ok=True)
        if "pt" in formats:
            path = out.with_name(out.name + ".pt")

            def save_pt(temp: Path) -> None:
                torch.save(state, temp)

            size = await asyncio.to_thread(_write_atomic, path, save_pt)
            files.append(("pt", str(path), size))
            progress.advance()
        if "safetensors" in formats:
            from safetensors.torch import save_file

            meta = {
                "job": catalog.location.job,
                "version": version,
                "rank": rank,
                "tier": catalog.location.tier_name,
            }
            tensors, metadata, warnings = await asyncio.to_thread(
                safetensors_payload, state, meta=meta
            )
            path = out.with_name(out.name + ".safetensors")

            def save_st(temp: Path) -> None:
                save_file(tensors, str(temp), metadata=metadata)

            size = await asyncio.to_thread(_write_atomic, path, save_st)
            files.append(("safetensors", str(path), size))
            progress.advance()
    finally:
        progress.finish()
    return ExportResult(catalog.location, version, rank, files, count, warnings)


# --- gc --------------------------------------------------------------------------------------


@dataclass
class GcPlan:
    """What :func:`apply_gc` will remove, and why the rest stays."""

    location: Location
    keep: int
    #: Versions kept because they are among the newest ``keep`` committed.
    kept: list[int]
    #: Versions kept because a kept delta needs them as its base.
    kept_as_base: list[int]
    #: Versions newer than the newest committed one: possibly still being saved, left alone.
    in_flight: list[int]
    #: ``COMMIT`` records to remove (persistent), removed before any blob.
    commit_keys: list[str]
    #: Blob keys to remove, with (version, rank).
    blob_keys: list[tuple[str, int, int]]
    #: Whether quarantined blobs are removed (``purge_quarantine``).
    purge_quarantine: bool = False
    #: Quarantined blobs to remove (only with ``purge_quarantine``), removed last.
    quarantine_keys: list[str] = field(default_factory=list)
    #: Quarantined blobs kept (all of them without ``purge_quarantine``).
    quarantine_kept: list[str] = field(default_factory=list)

    @property
    def removed_versions(self) -> list[int]:
        """Versions something is removed of."""
        versions = {v for _, v, _ in self.blob_keys}
        versions.update(v for k in self.commit_keys if (v := parse_commit_key(k)) is not None)
        return sorted(versions)

    def to_json(self) -> dict[str, Any]:
        """Plain data for ``--json`` output."""
        return {
            **self.location.to_json(),
            "keep": self.keep,
            "kept": self.kept,
            "kept_as_base": self.kept_as_base,
            "in_flight": self.in_flight,
            "removed_versions": self.removed_versions,
            "commit_keys": self.commit_keys,
            "blob_keys": [k for k, _, _ in self.blob_keys],
            "purge_quarantine": self.purge_quarantine,
            "quarantine_keys": self.quarantine_keys,
            "quarantine_kept": self.quarantine_kept,
        }


async def plan_gc(
    store: Store, catalog: Catalog, keep: int, *, purge_quarantine: bool = False
) -> GcPlan:
    """Decide what retention with ``keep`` versions removes (nothing is deleted here).

    The newest ``keep`` committed versions stay, and so does the base of every kept delta
    (:func:`tiercheck.consistency.retention.evictable`, the rule the checkpointer applies).
    Versions newer than the newest committed one stay too: a live job may still be saving
    them, and after a crash the checkpointer's own restore clears them. Everything else goes,
    torn and uncommitted versions included. In a node root without a manifest, "committed"
    means "has every rank's blob".

    Quarantined blobs stay for inspection unless ``purge_quarantine`` (then all of them go).
    The job record, writer generations, probe objects and a node's ``identity.json`` are never
    part of a plan.
    """
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    # Only whole versions count: a committed version that lost a blob cannot be restored, so
    # keeping it would keep one restorable version fewer than asked.
    committed = [
        v for v, e in sorted(catalog.versions.items()) if e.complete and e.committed is not False
    ]
    newest = committed[-1] if committed else -1
    kept = committed[-keep:]
    # A kept version's base must be known; read the header of packed blobs no record describes.
    unknown = [b for v in kept for b in catalog.versions[v].blobs.values() if not b.base_known]
    if unknown:
        errors = await inspect_blobs(store, unknown)
        if errors:
            key, why = next(iter(errors.items()))
            raise StorageError(
                f"cannot tell which base kept version's blob {key} needs ({why}); nothing "
                "was removed. Run `tiercheck verify` on this location."
            )

    doomed: dict[int, list[int]] = {}  # rank -> versions
    shield: set[int] = set(kept)
    for rank in catalog.ranks:
        own = {v: e.blobs[rank].base for v, e in catalog.versions.items() if rank in e.blobs}
        if not own:
            continue
        doomed[rank] = evictable(committed=committed, own=own, keep=keep, settled_upto=newest)
        shield.update(b for v in kept if (b := own.get(v)) is not None)
    blob_keys = sorted(
        (catalog.versions[v].blobs[r].key, v, r) for r, vs in doomed.items() for v in vs
    )
    commit_keys = sorted(
        commit_key(v)
        for v, e in catalog.versions.items()
        if (e.commit is not None or e.commit_error is not None) and v <= newest and v not in shield
    )
    return GcPlan(
        location=catalog.location,
        keep=keep,
        kept=kept,
        kept_as_base=sorted(shield - set(kept)),
        in_flight=[v for v in sorted(catalog.versions) if v > newest],
        commit_keys=commit_keys,
        blob_keys=blob_keys,
        purge_quarantine=purge_quarantine,
        quarantine_keys=[q.key for q in catalog.quarantined] if purge_quarantine else [],
        quarantine_kept=[] if purge_quarantine else [q.key for q in catalog.quarantined],
    )


def _check_plan(plan: GcPlan) -> None:
    """Refuse a plan (a caller may build one by hand) that names anything but what gc removes."""
    wrong = [k for k in plan.commit_keys if parse_commit_key(k) is None]
    wrong += [k for k, _, _ in plan.blob_keys if parse_blob_key(k) is None]
    wrong += [k for k in plan.quarantine_keys if parse_quarantine_key(k) is None]
    if wrong:
        raise ConfigError(
            f"a gc plan may only remove COMMIT records, blobs and quarantined blobs; it lists "
            f"{wrong[:3]}; nothing was removed"
        )


async def apply_gc(store: Store, plan: GcPlan, progress: Progress | None = None) -> None:
    """Remove what ``plan`` lists: every ``COMMIT`` record first, then the blobs, then the
    quarantined blobs it lists.

    The order keeps a crash half-way harmless: a version loses its proof of being whole before
    any of its blobs, so no ``COMMIT`` ever points at a deleted blob. In a node root, each
    removal of a version's blob is logged in the manifest (``evict``, reason ``gc``), as the
    checkpointer logs its own retention. A plan that lists any other key (the job record, a
    writer generation...) is refused with :class:`~tiercheck.errors.ConfigError` before anything
    is removed.
    """
    _check_plan(plan)
    progress = progress or NullProgress()
    sem = asyncio.Semaphore(_REQUESTS)

    async def delete(key: str) -> None:
        async with sem:
            await store.tier.delete(key)
        progress.advance()

    total = len(plan.commit_keys) + len(plan.blob_keys) + len(plan.quarantine_keys)
    progress.start(total, "removing")
    try:
        await asyncio.gather(*(delete(k) for k in plan.commit_keys))
        await asyncio.gather(*(delete(k) for k, _, _ in plan.blob_keys))
        await asyncio.gather(*(delete(k) for k in plan.quarantine_keys))
    finally:
        progress.finish()
    if store.manifest is not None and plan.blob_keys:
        records = [Evict(v, r, LOCAL_TIER, reason="gc") for _, v, r in plan.blob_keys]
        await store.in_manifest_thread(store.manifest.append, *records)
