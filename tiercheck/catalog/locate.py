"""Find the locations a user names, and open one: :func:`find_locations`, :class:`OpenLocation`."""

from __future__ import annotations

import asyncio
import re
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from tiercheck.catalog.base import Location, LocationError, local_path
from tiercheck.catalog.scan import Catalog, scan_location
from tiercheck.consistency import manifestd
from tiercheck.consistency.abandoned import ABANDONED_PREFIX, parse_tag
from tiercheck.consistency.identity import JOB_KEY, QUARANTINE_PREFIX, TOMBSTONE_KEY
from tiercheck.consistency.manifest import Manifest
from tiercheck.defaults import (
    BLOBS_DIR,
    DEFAULT_PERSISTENT_DIR,
    IDENTITY_FILE,
    LOCKS_DIR,
    MANIFEST_DIR,
    REPLICAS_DIR,
    NodeRoot,
    memory_base,
)
from tiercheck.errors import ConfigError, ManifestError, TiercheckError
from tiercheck.tiers.base import Buffer, Tier
from tiercheck.tiers.local import LocalTier
from tiercheck.tiers.persistent import PersistentTier

__all__ = ["OpenLocation", "default_search_paths", "find_locations"]

_T = TypeVar("_T")

# Any path that ends in a tiercheck key: the part before it is a job folder (or a node root's
# blobs/ folder), or such a folder's quarantine/ folder.
_TAIL = re.compile(r"^(?P<prefix>(?:.*/)?)v\d{12}/(?:r\d{5}\.(?:full|packed)|COMMIT)$")
# An abandoned set's folder, as a listing prefix: it belongs to the job folder above it.
_ABANDONED_DIR = re.compile(rf"^(?P<owner>(?:.*/)?){re.escape(ABANDONED_PREFIX)}(?P<tag>[^/]+)/$")
# A writer generation: with a job record beside it, the part before it is a job folder (one
# opened that has not saved anything yet).
_WRITER_TAIL = re.compile(r"^(?P<prefix>(?:.*/)?)writers/g\d{12}$")
# A folder of replicas a node keeps for one rank of a peer node (NodeRoot.parse_replica_key):
# <node root>/replicas/<job>/r<rank>/. Its blob keys look like a job folder's; it is not one.
_REPLICA_DIR = re.compile(rf"^(?P<root>.*?)/?{re.escape(REPLICAS_DIR)}/[^/]+/r\d{{5}}/$")
_BLOBS = BLOBS_DIR + "/"
_MANIFEST_DATA = f"{MANIFEST_DIR}/data.mdb"
# A node root's own records, as keys of a listing: what an opening makes before any blob.
_NODE_RECORD = re.compile(
    rf"^(?P<root>(?:.*/)?)(?:{re.escape(MANIFEST_DIR)}/data\.mdb|{re.escape(IDENTITY_FILE)}"
    rf"|{re.escape(LOCKS_DIR)}/r\d{{5}}\.lock)$"
)


def _manifest_damage(folder: str) -> str | None:
    """What is wrong with the manifest in ``folder`` (read, never mapped), unless a manifest
    process serves it now (it checked the environment before mapping it)."""
    if manifestd.served(folder):
        return None
    return manifestd.check_unmapped(folder)


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

    ``/dev/shm/tiercheck`` (node roots, by job; :func:`tiercheck.defaults.memory_base`) and
    ``./tiercheck-checkpoints`` (the default persistent folder); ``tiercheck ls`` without a URL
    looks in these.
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
    if local_root or NodeRoot(folder).is_one():
        return _node_location(folder)
    if job is not None and NodeRoot(folder / job).is_one():
        return _node_location(folder / job)
    return None


def _owner(prefix: str, committing: set[str], keys: set[str]) -> str:
    """The folder a matched key's ``prefix`` belongs to: its parent for a quarantine folder,
    the job folder for an abandoned set (``<job folder>/abandoned/<tag>/``)."""
    quarantine = prefix == QUARANTINE_PREFIX or prefix.endswith("/" + QUARANTINE_PREFIX)
    if quarantine and prefix not in committing and prefix + JOB_KEY not in keys:
        return prefix[: -len(QUARANTINE_PREFIX)]
    # A set holds COMMIT copies, but never a job record nor a tombstone, as a job folder
    # (whatever its name) does.
    m = _ABANDONED_DIR.match(prefix)
    if (
        m is not None
        and parse_tag(m.group("tag")) is not None
        and prefix + JOB_KEY not in keys
        and prefix + TOMBSTONE_KEY not in keys
    ):
        return m.group("owner")
    return prefix


class _Found:
    """What a recursive listing reveals: locations, and replica folders seen on the way."""

    def __init__(self) -> None:
        self.locations: dict[str, Location] = {}
        #: Replica folders (<node root>/replicas/<job>/r<rank>/) seen, by listing prefix.
        self.replicas: set[str] = set()
        #: Those of them outside any node root.
        self.stray_replicas: list[str] = []


def _replica_holder(full: str, path: str | None) -> tuple[bool, Path | None]:
    """Whether the folder ``full`` is a node's replicas of a peer rank, and (local listings
    only) the node root holding it, where that is a node root."""
    m = _REPLICA_DIR.match(full.rstrip("/") + "/")
    if m is None:
        return False, None
    root = Path(m.group("root") or "/") if path is not None else None
    return True, root if root is not None and NodeRoot(root).looks_like_one() else None


def _classify(
    keys: Sequence[str], target: str, path: str | None, options: Mapping[str, Any]
) -> _Found:
    """The job folders and node roots that a recursive listing of ``target`` reveals."""
    out = _Found()
    found = out.locations
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
        # A deleted job's folder: its tombstone (and maybe what killed writers left) stays.
        if key == TOMBSTONE_KEY or key.endswith("/" + TOMBSTONE_KEY):
            matches.append((key[: -len(TOMBSTONE_KEY)], key))
    for prefix, _key in matches:
        if prefix in found or prefix in out.replicas:
            continue
        if path is not None and (prefix == _BLOBS or prefix.endswith("/" + _BLOBS)):
            root = Path(path) / prefix[: -len(_BLOBS)]
            if NodeRoot(root).looks_like_one() or prefix not in committing:
                found[prefix] = _node_location(root)
                continue
        full = str(Path(path) / prefix) if path is not None else _join(target, prefix)
        # A node's replicas of a peer rank hold neither COMMIT records nor a job record; they
        # belong to the node root (its catalog lists them), never to a job of their own.
        own_records = (
            prefix in committing or prefix + JOB_KEY in keyset or prefix + TOMBSTONE_KEY in keyset
        )
        replicas, holder = (False, None) if own_records else _replica_holder(full, path)
        if replicas:
            out.replicas.add(prefix)
            if holder is not None:
                found.setdefault(str(holder.resolve()), _node_location(holder))
            else:
                out.stray_replicas.append(prefix)
            continue
        url = _join(target, prefix)
        found[prefix] = Location("persistent", url, _last_segment(url), None, options)
    if path is not None:
        # Node roots whose blobs were all evicted still have their manifest; one whose opening
        # failed or was killed may hold only its identity or lock files.
        for key in keys:
            m = _NODE_RECORD.match(key)
            if m is None or m.group("root") in found:
                continue
            root = Path(path) / m.group("root")
            if NodeRoot(root).is_one():
                found.setdefault(str(root.resolve()), _node_location(root))
    return out


async def find_locations(
    target: str,
    *,
    job: str | None = None,
    local_root: bool = False,
    storage_options: Mapping[str, Any] | None = None,
) -> list[Location]:
    """The locations ``target`` names, sorted; raises :class:`LocationError` if there are none.

    ``target`` may be:

    * a node root (a folder holding ``blobs/`` and ``manifest/``, or only what an opening
      that failed or was killed left there: ``identity.json``, ``locks/r<rank>.lock``; with
      ``local_root=True`` any folder is taken as one, so a node whose manifest is gone can
      still be read);
    * a persistent job folder: a URL or path whose keys are ``v<version>/r<rank>.<kind>`` and
      ``v<version>/COMMIT`` (the URL given to the checkpointer plus the job id), or that holds
      a ``JOB`` record and ``writers/`` generations (a job opened that has saved nothing yet);
      blobs under ``<job folder>/quarantine/`` belong to that job folder;
    * any folder or URL above these -- the checkpointer's ``persistent=`` URL holding one folder
      per job, ``/dev/shm/tiercheck`` holding ``<job>/<node>`` roots: everything below it is
      listed and every job folder and node root found is returned.

    The replicas a node keeps for ranks of other nodes (``<node root>/replicas/<job>/r<rank>/``)
    are never a location of their own: they belong to their node root, whose catalog lists them
    (:attr:`Catalog.replicas <tiercheck.catalog.Catalog.replicas>`).

    ``job`` keeps only the locations of that job (for a job folder, its folder name; for a
    node root, its parent folder's name); when it matches none, the error lists the jobs found.
    Listing a large bucket from its top reads every key name: give the job's URL where it is
    known.
    """
    options = dict(storage_options or {})
    path = local_path(target)
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
    classified = await asyncio.to_thread(_classify, keys, target, path, options)
    found = classified.locations
    if not found:
        stray = ""
        if classified.stray_replicas:
            stray = (
                f"; it holds only peer replicas ({classified.stray_replicas[0]}...), which "
                "a node root lists: give the node root"
            )
        raise LocationError(
            f"no tiercheck checkpoints at {target!r}: expected a job folder holding "
            "v<version>/r<rank>.packed|full and v<version>/COMMIT keys (or a JOB record and "
            "writers/), a folder of such job folders, or a node root holding blobs/ and "
            f"manifest/{stray}"
        )
    located = sorted(set(found.values()), key=lambda loc: (loc.kind, loc.job, loc.url))
    if job is None:
        return located
    matching = [loc for loc in located if loc.job == job]
    if not matching:
        jobs = ", ".join(sorted({loc.job for loc in located}))
        raise LocationError(f"no job {job!r} at {target!r}; jobs found: {jobs}")
    return matching


class OpenLocation:
    """An opened location: its tier and, for a node root, its manifest.

    Use as ``async with OpenLocation(location) as opened:``, then :meth:`scan` it into a
    :class:`~tiercheck.catalog.Catalog` and hand both to :func:`~tiercheck.catalog.verify`,
    :func:`~tiercheck.catalog.export`, :func:`~tiercheck.catalog.plan_gc`... Nothing is
    created: a node root's folders must exist (the manifest is opened only where
    ``manifest/`` does).
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
            layout = NodeRoot(Path(location.url))
            if not layout.is_one():
                raise LocationError(
                    f"{location.url} holds no {_BLOBS} folder nor any record of a node root "
                    "(manifest/, identity.json, locks/); not a node root"
                )
            blobs = layout.blobs
            # No spare files: this process is short-lived, and a spare it kept would be memory
            # the job's own local tier does not know about.
            # Nor sweeping: what dead writers left is listed (catalog.leftovers), and only
            # `gc` removes it.
            self.tier = LocalTier(blobs, spare_files=0, sweep=False)
        self.manifest: Manifest | None = None
        self.manifest_error: str | None = None
        # Manifest calls are quick but blocking file work: one thread of their own.
        self._manifest_thread = ThreadPoolExecutor(1, thread_name_prefix="tiercheck-manifest")

    @property
    def node_root(self) -> NodeRoot | None:
        """The node root's layout (``None`` for a persistent job folder)."""
        return None if self.location.kind != "node" else NodeRoot(Path(self.location.url))

    async def __aenter__(self) -> OpenLocation:
        root = self.node_root
        if root is not None and root.manifest.is_dir():
            # A command reads the manifest; it never repairs it: one damaged at rest (and not
            # served by a job's manifest process, which checked it when it started) is
            # reported, not opened -- opening would set it aside and start a new one.
            damage = await self.in_manifest_thread(_manifest_damage, str(root.manifest))
            if damage is not None:
                self.manifest_error = (
                    f"the manifest is damaged ({damage}); the job's next opening on this node "
                    "sets it aside and starts a new one (checkpoints are unaffected)"
                )
                return self
            try:
                self.manifest = await self.in_manifest_thread(Manifest, root.manifest)
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
        """List the location into a :class:`~tiercheck.catalog.Catalog` (reads no blob, only
        small records); see :func:`tiercheck.catalog.scan.scan_location`."""
        return await scan_location(self)
