"""Apply retention to a location at rest: :func:`plan_gc` decides, :func:`apply_gc` removes.

The rule is the checkpointer's own (:func:`tiercheck.consistency.retention.evictable`): keep the
newest committed versions and the bases their deltas need. Only versions' blobs, ``COMMIT``
records, (when asked) quarantined blobs, abandoned sets (those retention lets go, or all of them
when asked; see :func:`plan_gc`), and what killed writers left whose writer is gone (temporary
files, unfinished uploads: :mod:`tiercheck.catalog.leftovers`) are ever removed.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from tiercheck.catalog.base import LOCAL_TIER, REQUESTS, Location, NullProgress, Progress
from tiercheck.catalog.leftovers import remove_leftovers
from tiercheck.catalog.locate import OpenLocation
from tiercheck.catalog.read import inspect_blobs
from tiercheck.catalog.scan import AbandonedSetEntry, Catalog
from tiercheck.consistency.abandoned import SET_NAME, expired, parse_abandoned_key
from tiercheck.consistency.identity import WriterRecord, parse_quarantine_key
from tiercheck.consistency.keys import commit_key, parse_blob_key, parse_commit_key
from tiercheck.consistency.manifest import Evict
from tiercheck.consistency.retention import evictable
from tiercheck.errors import ConfigError, StorageError
from tiercheck.tiers.base import Leftover

__all__ = ["AbandonedFate", "GcPlan", "apply_gc", "plan_gc"]


@dataclass(frozen=True)
class AbandonedFate:
    """What a gc plan does with one abandoned set, and why."""

    tag: str
    #: The versions it holds (those its ``SET`` record lists, when readable).
    versions: list[int]
    #: Whether it has its ``SET`` record (``False``: an unfinished set).
    finished: bool
    blobs: int
    keys: int
    size: int | None
    why: str

    @classmethod
    def of(cls, aside: AbandonedSetEntry, why: str) -> AbandonedFate:
        """The fate of ``aside``, for ``why``."""
        return cls(
            aside.tag,
            aside.listed,
            aside.has_record,
            len(aside.blobs()),
            len(aside.keys),
            aside.size,
            why,
        )

    def to_json(self) -> dict[str, Any]:
        """Plain data for ``--json`` output."""
        return {
            "tag": self.tag,
            "versions": self.versions,
            "finished": self.finished,
            "blobs": self.blobs,
            "keys": self.keys,
            "size": self.size,
            "why": self.why,
        }


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
    #: What killed writers left whose writer is gone: removed (judged again first).
    leftovers: list[Leftover] = field(default_factory=list)
    #: What writers left that may still be being written: kept.
    leftovers_kept: list[Leftover] = field(default_factory=list)
    #: The leftovers actually removed by :func:`apply_gc` (judged again right before).
    leftovers_removed: list[Leftover] = field(default_factory=list)
    #: The job's current writer, against which the leftovers are judged.
    writer: WriterRecord | None = field(default=None, compare=False)
    #: Whether every abandoned set goes (``abandoned``), not only those retention lets go.
    abandoned: bool = False
    #: Abandoned sets removed, and kept, each with why.
    abandoned_removed: list[AbandonedFate] = field(default_factory=list)
    abandoned_kept: list[AbandonedFate] = field(default_factory=list)
    #: Keys of the abandoned sets removed: every ``SET`` record first, then the rest.
    abandoned_keys: list[str] = field(default_factory=list)
    #: Versions kept because a kept abandoned set's delta needs them as its base.
    kept_for_abandoned: list[int] = field(default_factory=list)

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
            "leftovers": [item.to_json() for item in self.leftovers],
            "leftovers_kept": [item.to_json() for item in self.leftovers_kept],
            "leftovers_removed": [item.to_json() for item in self.leftovers_removed],
            "abandoned": self.abandoned,
            "abandoned_removed": [f.to_json() for f in self.abandoned_removed],
            "abandoned_kept": [f.to_json() for f in self.abandoned_kept],
            "abandoned_keys": self.abandoned_keys,
            "kept_for_abandoned": self.kept_for_abandoned,
        }


async def plan_gc(
    opened: OpenLocation,
    catalog: Catalog,
    keep: int,
    *,
    purge_quarantine: bool = False,
    abandoned: bool = False,
) -> GcPlan:
    """Decide what retention with ``keep`` versions removes (nothing is deleted here).

    The newest ``keep`` committed versions stay, and so does the base of every kept delta
    (:func:`tiercheck.consistency.retention.evictable`, the rule the checkpointer applies).
    Versions newer than the newest committed one stay too: a live job may still be saving
    them, and after a crash the checkpointer's own restore clears them. Everything else goes,
    torn and uncommitted versions included. In a node root without a manifest, "committed"
    means "has every rank's blob".

    Quarantined blobs stay for inspection unless ``purge_quarantine`` (then all of them go).
    What killed writers left goes when its writer is gone (``Leftover.removable``); the rest of
    it stays. The job record, writer generations, probe objects and a node's ``identity.json``
    are never part of a plan.

    Abandoned sets (persistent job folders) follow the checkpointer's rule
    (:func:`tiercheck.consistency.abandoned.expired` with ``keep``): a finished set goes once
    the run has ``keep`` whole committed versions of its own from the set's first version on;
    with ``abandoned``, every finished set goes. An unfinished set (no ``SET`` record: copies
    only) goes as debris, unless the job's newest opening made it -- that opening may be
    setting versions aside right now -- or the newest writer cannot be read
    (:meth:`Catalog.unfinished_fate <tiercheck.catalog.Catalog.unfinished_fate>`). A set that is
    kept keeps what its deltas need: the live versions they are deltas on stay
    (:attr:`GcPlan.kept_for_abandoned`), and so does a set holding such a version.
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
        errors = await inspect_blobs(opened, unknown)
        if errors:
            key, why = next(iter(errors.items()))
            raise StorageError(
                f"cannot tell which base kept version's blob {key} needs ({why}); nothing "
                "was removed. Run `tiercheck verify` on this location."
            )

    removed_sets, kept_sets, protected = await _plan_abandoned(
        opened, catalog, committed, keep, abandoned
    )
    doomed: dict[int, list[int]] = {}  # rank -> versions
    shield: set[int] = set(kept)
    for rank in catalog.ranks:
        own = {v: e.blobs[rank].base for v, e in catalog.versions.items() if rank in e.blobs}
        if not own:
            continue
        doomed[rank] = evictable(
            committed=committed, own=own, keep=keep, settled_upto=newest, protected=protected
        )
        shield.update(b for v in kept if (b := own.get(v)) is not None)
    based = shield - set(kept)
    shield.update(protected)
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
        kept_as_base=sorted(based),
        in_flight=[v for v in sorted(catalog.versions) if v > newest],
        commit_keys=commit_keys,
        blob_keys=blob_keys,
        purge_quarantine=purge_quarantine,
        quarantine_keys=[q.key for q in catalog.quarantined] if purge_quarantine else [],
        quarantine_kept=[] if purge_quarantine else [q.key for q in catalog.quarantined],
        leftovers=[item for item in catalog.leftovers if item.removable],
        leftovers_kept=[item for item in catalog.leftovers if not item.removable],
        writer=catalog.newest_writer,
        abandoned=abandoned,
        abandoned_removed=[AbandonedFate.of(a, why) for a, why in removed_sets],
        abandoned_kept=[AbandonedFate.of(a, why) for a, why in kept_sets],
        # SET records first: a removal cut short leaves unfinished sets, never a whole one
        # missing pieces.
        abandoned_keys=sorted(
            (k for a, _ in removed_sets for k in a.keys),
            key=lambda k: (not k.endswith("/" + SET_NAME), k),
        ),
        kept_for_abandoned=sorted(protected - set(kept) - based),
    )


async def _plan_abandoned(
    opened: OpenLocation, catalog: Catalog, committed: list[int], keep: int, everything: bool
) -> tuple[list[tuple[AbandonedSetEntry, str]], list[tuple[AbandonedSetEntry, str]], set[int]]:
    """Which abandoned sets go and which stay (each with why), and the live versions the kept
    sets' deltas need as bases (see :func:`plan_gc`)."""
    finished = {a.tag: a.first for a in catalog.abandoned if a.has_record}
    expiring = set(expired(finished, committed, keep))
    fates: dict[str, tuple[bool, str]] = {}  # tag -> (removed, why)
    for aside in catalog.abandoned:
        own = sum(1 for v in committed if v >= aside.first)
        if not aside.has_record:
            removable, why = catalog.unfinished_fate(aside)
            if removable:
                why = (
                    "an unfinished set-aside (no SET record; copies only, nothing reads it) of "
                    "an opening that is no longer the job's newest"
                )
            fates[aside.tag] = (removable, why.removeprefix("kept: "))
        elif everything:
            fates[aside.tag] = (True, "removed as asked (--abandoned)")
        elif aside.tag in expiring:
            fates[aside.tag] = (
                True,
                f"the run has {own} whole committed version{'s' if own != 1 else ''} of its own "
                f"from version {aside.first} on, at least --keep {keep}: retention lets the set go",
            )
        else:
            fates[aside.tag] = (
                False,
                f"the run has {own} whole committed version{'s' if own != 1 else ''} of its own "
                f"from version {aside.first} on, fewer than --keep {keep} (--abandoned removes it)",
            )
    # What kept finished sets need: a delta's base older than the set is the live version, or
    # a later set's copy of it (Catalog.base_source); that set stays too. Until nothing changes.
    protected: set[int] = set()
    done: set[str] = set()
    while True:
        todo = [
            a
            for a in catalog.abandoned
            if a.has_record and not fates[a.tag][0] and a.tag not in done
        ]
        if not todo:
            break
        for aside in todo:
            done.add(aside.tag)
            unknown = [b for b in aside.blobs() if not b.base_known]
            if unknown:
                errors = await inspect_blobs(opened, unknown)
                if errors:
                    key, why = next(iter(errors.items()))
                    raise StorageError(
                        f"cannot tell which base {key}, in abandoned set {aside.tag} that gc "
                        f"keeps, needs ({why}); nothing was removed. Run `tiercheck verify` on "
                        "this location, or remove the abandoned sets with --abandoned."
                    )
            for blob in aside.blobs():
                base = blob.base
                if base is None or base in aside.versions:
                    continue
                source = catalog.base_source(aside.tag, base)
                if source is None:
                    protected.add(base)
                elif fates[source.tag][0]:
                    fates[source.tag] = (
                        False,
                        f"abandoned set {aside.tag}, which stays, needs version {base} from it as "
                        "a delta's base",
                    )
    removed = [(a, fates[a.tag][1]) for a in catalog.abandoned if fates[a.tag][0]]
    kept = [(a, fates[a.tag][1]) for a in catalog.abandoned if not fates[a.tag][0]]
    return removed, kept, protected & set(catalog.versions)


def _check_plan(plan: GcPlan) -> None:
    """Refuse a plan (a caller may build one by hand) that names anything but what gc removes."""
    wrong = [k for k in plan.commit_keys if parse_commit_key(k) is None]
    wrong += [k for k, _, _ in plan.blob_keys if parse_blob_key(k) is None]
    wrong += [k for k in plan.quarantine_keys if parse_quarantine_key(k) is None]
    wrong += [k for k in plan.abandoned_keys if parse_abandoned_key(k) is None]
    if wrong:
        raise ConfigError(
            f"a gc plan may only remove COMMIT records, blobs, quarantined blobs and abandoned "
            f"sets' keys; it lists {wrong[:3]}; nothing was removed"
        )


async def apply_gc(opened: OpenLocation, plan: GcPlan, progress: Progress | None = None) -> None:
    """Remove what ``plan`` lists: every ``COMMIT`` record first, then the blobs, then the
    quarantined blobs it lists, then the abandoned sets it lists (every ``SET`` record before
    anything else of them, so that a set half-removed reads as unfinished, never as whole),
    then the leftovers of killed writers (each judged again right before it goes: one whose
    writer turns out to be running stays; see :attr:`GcPlan.leftovers_removed`).

    The order keeps a crash half-way harmless: a version loses its proof of being whole before
    any of its blobs, so no ``COMMIT`` ever points at a deleted blob. In a node root, each
    removal of a version's blob is logged in the manifest (``evict``, reason ``gc``), as the
    checkpointer logs its own retention. A plan that lists any other key (the job record, a
    writer generation...) is refused with :class:`~tiercheck.errors.ConfigError` before anything
    is removed.
    """
    _check_plan(plan)
    progress = progress or NullProgress()
    sem = asyncio.Semaphore(REQUESTS)

    async def delete(key: str) -> None:
        async with sem:
            await opened.tier.delete(key)
        progress.advance()

    total = len(plan.commit_keys) + len(plan.blob_keys) + len(plan.quarantine_keys)
    total += len(plan.abandoned_keys)
    set_records = [k for k in plan.abandoned_keys if k.endswith("/" + SET_NAME)]
    rest = [k for k in plan.abandoned_keys if not k.endswith("/" + SET_NAME)]
    progress.start(total, "removing")
    try:
        await asyncio.gather(*(delete(k) for k in plan.commit_keys))
        await asyncio.gather(*(delete(k) for k, _, _ in plan.blob_keys))
        await asyncio.gather(*(delete(k) for k in plan.quarantine_keys))
        await asyncio.gather(*(delete(k) for k in set_records))
        await asyncio.gather(*(delete(k) for k in rest))
    finally:
        progress.finish()
    if opened.manifest is not None and plan.blob_keys:
        records = [Evict(v, r, LOCAL_TIER, reason="gc") for _, v, r in plan.blob_keys]
        await opened.in_manifest_thread(opened.manifest.append, *records)
    plan.leftovers_removed = await remove_leftovers(
        plan.location, opened.tier, plan.leftovers, plan.writer
    )
