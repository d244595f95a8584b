"""Check what a location holds: :func:`verify` reads every blob and record and reports
:class:`Finding` s (problems and warnings, each with a stable code from :data:`FINDING_CODES`).

Abandoned sets (versions the run went back from, :class:`~tiercheck.catalog.AbandonedSetEntry`)
are checked as the live versions are, each through its own view
(:meth:`Catalog.abandoned_view <tiercheck.catalog.Catalog.abandoned_view>`): a set's deltas
take their bases from the set, or from where the job kept that version since the set was made.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from tiercheck.catalog.base import READS, Location, NullProgress, Progress, bounded
from tiercheck.catalog.locate import OpenLocation
from tiercheck.catalog.read import decode_blob
from tiercheck.catalog.scan import (
    AbandonedSetEntry,
    BlobEntry,
    Catalog,
    QuarantinedBlob,
    VersionEntry,
)
from tiercheck.codec import BlobMeta
from tiercheck.codec import verify as verify_blob
from tiercheck.consistency.abandoned import parse_abandoned_key, set_record_key
from tiercheck.consistency.identity import JOB_KEY, TOMBSTONE_KEY, writer_key
from tiercheck.consistency.keys import blob_key, commit_key, parse_blob_key
from tiercheck.defaults import IDENTITY_FILE
from tiercheck.errors import TiercheckError

__all__ = ["FINDING_CODES", "Finding", "VerifyReport", "verify"]


@dataclass(frozen=True, slots=True)
class Finding:
    """Something :func:`verify` found.

    ``severity`` is ``"problem"`` (the data is not what it claims: a failed checksum, a missing
    blob of a committed version, a delta without its base) or ``"warning"`` (normal after a
    crash, or harmless: a torn version that never claimed to be committed). ``code`` is a
    stable, machine-readable name (see :data:`FINDING_CODES`). ``abandoned`` names the
    abandoned set the finding is about (``version`` is then the version's number in it).
    """

    severity: Literal["problem", "warning"]
    code: str
    message: str
    key: str | None = None
    version: int | None = None
    rank: int | None = None
    abandoned: str | None = None

    def to_json(self) -> dict[str, Any]:
        """Plain data for ``--json`` output."""
        return {
            "severity": self.severity,
            "code": self.code,
            "message": self.message,
            "key": self.key,
            "version": self.version,
            "rank": self.rank,
            "abandoned": self.abandoned,
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
    "deletion-unfinished": "the tombstone `tiercheck rm-job` left names the incarnation the job "
    "record is of: the deletion did not finish (the job refuses to open: run rm-job again)",
    "quarantined": "a restore set a blob aside after it failed verification; the version was "
    "not restored from it (warning)",
    "probe-leftover": "a probe object of an opening that did not finish (a crash while the job "
    "was opening, or one opening now; warning)",
    "leftover": "a temporary file or unfinished upload whose writer is gone (a process killed "
    "mid-write); never read, removed at the job's next opening or by `tiercheck gc` (warning)",
    "leftover-kept": "a temporary file or unfinished upload whose writer may still be writing it "
    "(it runs on this host, or cannot be judged from here yet); kept (warning)",
    "leftovers-unlisted": "the location's temporary files or unfinished uploads could not be "
    "listed (warning)",
    "abandoned-incomplete": "an abandoned set (versions the run went back from, kept under "
    "abandoned/<tag>/) lacks the COMMIT copy of a version its SET record lists, or a blob a "
    "COMMIT copy names: that version cannot be had back from the set",
    "abandoned-unfinished": "an abandoned set without its SET record: an opening died while "
    "setting versions aside (copies only; the originals stayed in place), or a removal of the "
    "set was cut short; nothing reads it, and `tiercheck gc` removes it unless the job's newest "
    "opening made it (warning)",
}


@dataclass
class VerifyReport:
    """What :func:`verify` checked and found."""

    location: Location
    versions: list[int]
    blobs_checked: int
    findings: list[Finding]
    #: The abandoned sets whose versions were checked (those with a ``SET`` record).
    abandoned: list[str] = field(default_factory=list)

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
            "abandoned": self.abandoned,
            "blobs_checked": self.blobs_checked,
            "problems": len(self.problems),
            "warnings": len(self.warnings),
            "findings": [f.to_json() for f in self.findings],
        }


def _tag_of(key: str) -> str | None:
    """The abandoned set a key is in, if any."""
    parsed = parse_abandoned_key(key)
    return None if parsed is None else parsed[0]


def _hex(value: int) -> str:
    return f"{value:#018x}"


async def verify(
    opened: OpenLocation,
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
    newest writer generation, a node's identity or an abandoned set's ``SET`` record that
    cannot be read, and a job record that disagrees with the newest ``COMMIT`` record, are
    problems; a leftover probe object, each temporary file or unfinished upload a killed writer
    left (with its size, age and whether its writer is gone), and each unfinished abandoned set
    (no ``SET`` record; its copies are not read), are warnings. Every quarantined blob (of
    ``versions``, when given) is a warning; its copy is read and checked to say why it was set
    aside.

    The versions of every finished abandoned set (of ``versions``, when given) are checked as
    live ones are -- blobs read and verified, deltas against their exact base, ``COMMIT``
    copies against the blobs, and with ``deep`` decoded -- and each version its ``SET`` record
    lists must have its ``COMMIT`` copy and every blob that copy names
    (``abandoned-incomplete``).
    """
    progress = progress or NullProgress()
    chosen = sorted(catalog.versions) if versions is None else sorted(set(versions))
    findings: list[Finding] = []
    if catalog.manifest_error is not None:
        findings.append(Finding("problem", "manifest", catalog.manifest_error))

    # Blobs of the chosen versions, plus the bases their deltas need (a corrupt base makes a
    # delta unrestorable, so it is checked too).
    todo: dict[str, BlobEntry] = {b.key: b for b in catalog.blobs(chosen)}
    # Where each blob's delta base is looked up: the location, or the view of its set.
    owner: dict[str, Catalog] = dict.fromkeys(todo, catalog)
    sets = [a for a in catalog.abandoned if a.has_record]
    views = {a.tag: catalog.abandoned_view(a.tag) for a in sets}
    for aside in sets:
        for blob in aside.blobs(None if versions is None else chosen):
            todo[blob.key] = blob
            owner[blob.key] = views[aside.tag]
    metas: dict[str, BlobMeta] = {}
    failed: set[str] = set()

    async def check(blob: BlobEntry) -> None:
        try:
            data = await opened.get(blob.key)
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
                    _tag_of(blob.key),
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
                    _tag_of(blob.key),
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
                    _tag_of(blob.key),
                )
            )

    progress.start(len(todo), "verifying blobs")
    try:
        await bounded(list(todo.values()), check, READS, progress)
        bases: dict[str, BlobEntry] = {}
        for key, meta in metas.items():
            if meta.base is None:
                continue
            entry = owner.get(key, catalog).versions.get(meta.base.version)
            base_blob = None if entry is None else entry.blobs.get(meta.rank)
            if base_blob is not None and base_blob.key not in todo:
                bases[base_blob.key] = base_blob
        if bases:
            progress.start(len(bases), "verifying bases")
            await bounded(list(bases.values()), check, READS, progress)
            todo.update(bases)
    finally:
        progress.finish()

    for v in chosen:
        entry = catalog.versions[v]
        findings.extend(_version_findings(catalog, entry, metas, failed))
    wanted = set(chosen)
    for aside in sets:
        for v in sorted({*aside.listed, *aside.versions}):
            if versions is None or v in wanted:
                entry = aside.versions.get(v) or VersionEntry(v)
                findings.extend(_version_findings(views[aside.tag], entry, metas, failed, aside))
    findings.extend(_record_findings(catalog))
    quarantined = [q for q in catalog.quarantined if versions is None or q.version in wanted]
    if quarantined:
        findings.extend(await _quarantine_findings(opened, catalog, quarantined, progress))
    if deep:
        decode = [(catalog, b) for b in catalog.blobs(chosen)]
        decode += [
            (views[a.tag], b) for a in sets for b in a.blobs(None if versions is None else chosen)
        ]
        findings.extend(await _deep_check(opened, decode, failed, progress))
    order = {"problem": 0, "warning": 1}
    findings.sort(
        key=lambda f: (
            order[f.severity],
            -1 if f.version is None else f.version,
            -1 if f.rank is None else f.rank,
            f.code,
        )
    )
    return VerifyReport(catalog.location, chosen, len(todo), findings, [a.tag for a in sets])


def _version_findings(
    catalog: Catalog,
    entry: VersionEntry,
    metas: Mapping[str, BlobMeta],
    failed: set[str],
    aside: AbandonedSetEntry | None = None,
) -> list[Finding]:
    """What is wrong with one version: of the location's timeline, or (``aside``) of an
    abandoned set, with ``catalog`` the set's view."""
    out: list[Finding] = []
    v = entry.version
    loc = catalog.location
    # Keys in a set's COMMIT copies are the original keys; the set holds them under its folder.
    prefix = "" if aside is None else aside.prefix
    tag = None if aside is None else aside.tag

    def add(severity: Literal["problem", "warning"], code: str, msg: str, **kw: Any) -> None:
        out.append(Finding(severity, code, msg, version=v, abandoned=tag, **kw))

    # Deltas need their exact base, in this location.
    for rank, blob in sorted(entry.blobs.items()):
        meta = metas.get(blob.key)
        if meta is None or meta.base is None:
            continue
        want = meta.base
        base_entry = catalog.versions.get(want.version)
        base_blob = None if base_entry is None else base_entry.blobs.get(rank)
        if base_blob is None:
            where = (
                f"is not in the {loc.tier_name} tier"
                if aside is None
                else f"is neither in abandoned set {tag} nor where the job kept version "
                f"{want.version} since the set was made (the live versions, or a later set)"
            )
            add(
                "problem",
                "missing-base",
                f"{blob.key} is a delta against version {want.version}, whose blob "
                f"{blob_key(want.version, rank, 'packed')} {where}",
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

    # Torn versions; in an abandoned set, what its SET record and COMMIT copies promise.
    missing = entry.missing_ranks
    if aside is not None:
        out.extend(_set_version_findings(aside, entry))
    elif missing and entry.committed:
        moved = {q.rank: q.key for q in catalog.quarantined if q.version == v}
        for rank in missing:
            where = f" (a restore set it aside as {moved[rank]})" if rank in moved else ""
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
            f"{prefix}{commit_key(v)}: {entry.commit_error}",
            key=prefix + commit_key(v),
        )
    if entry.commit is not None:
        for e in entry.commit.entries:
            listed = entry.blobs.get(e.rank)
            if listed is None:
                continue  # reported as torn-committed
            meta = metas.get(listed.key)
            diffs = []
            if listed.key != prefix + e.key:
                diffs.append(f"key {prefix}{e.key} != {listed.key}")
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
                    f"{prefix}{commit_key(v)} disagrees with {listed.key}: " + "; ".join(diffs),
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


def _set_version_findings(aside: AbandonedSetEntry, entry: VersionEntry) -> list[Finding]:
    """A version of a finished abandoned set must be whole in it: the ``COMMIT`` copy of every
    version the ``SET`` record lists, and every blob a ``COMMIT`` copy names."""
    out: list[Finding] = []
    v, prefix = entry.version, aside.prefix
    copy = prefix + commit_key(v)
    if v in aside.listed and not entry.committed:
        out.append(
            Finding(
                "problem",
                "abandoned-incomplete",
                f"abandoned set {aside.tag} lists version {v} in its SET record but holds no "
                f"COMMIT copy of it ({copy}): the version cannot be had back from the set",
                copy,
                v,
                abandoned=aside.tag,
            )
        )
    if entry.commit is not None:
        for e in entry.commit.entries:
            if e.rank not in entry.blobs:
                out.append(
                    Finding(
                        "problem",
                        "abandoned-incomplete",
                        f"{copy} names rank {e.rank}'s blob {prefix}{e.key}, which is not in "
                        f"the set: version {v} cannot be had back from abandoned set "
                        f"{aside.tag}",
                        prefix + e.key,
                        v,
                        e.rank,
                        abandoned=aside.tag,
                    )
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
        (TOMBSTONE_KEY, catalog.tombstone_error),
    ]
    for key, error in unreadable:
        if error is not None:
            out.append(Finding("problem", "record-unreadable", f"{key}: {error}", key))
    job, commit = catalog.job_record, catalog.newest_commit
    tombstone = catalog.tombstone
    if job is not None and tombstone is not None and job.token in tombstone.tokens:
        out.append(
            Finding(
                "problem",
                "deletion-unfinished",
                f"{TOMBSTONE_KEY} says `tiercheck rm-job` deleted incarnation {job.token[:8]}, yet "
                f"{JOB_KEY} and what else is left here are of it: the deletion did not finish "
                "(the job refuses to open here until it does). Run `tiercheck rm-job` on this "
                "location again",
                TOMBSTONE_KEY,
            )
        )
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
    for item in catalog.leftovers:
        size = "?" if item.size is None else f"{item.size} bytes"
        if item.age is not None:
            when = "last changed" if item.kind == "temporary" else "started"
            size += f", {when} {item.age:.0f} s ago"
        if item.removable:
            message = (
                f"{item.name} ({size}) was left by a writer that is gone: {item.why}. Never "
                "read; the job's next opening or `tiercheck gc` removes it"
            )
        else:
            message = f"{item.name} ({size}) may still be being written: {item.why}"
        code = "leftover" if item.removable else "leftover-kept"
        out.append(Finding("warning", code, message, item.name))
    if catalog.leftovers_error is not None:
        out.append(
            Finding(
                "warning",
                "leftovers-unlisted",
                f"temporary files and unfinished uploads cannot be listed: "
                f"{catalog.leftovers_error}",
            )
        )
    for aside in catalog.abandoned:
        if aside.record_error is not None:
            key = set_record_key(aside.tag)
            message = f"{key}: {aside.record_error}"
            out.append(Finding("problem", "record-unreadable", message, key, abandoned=aside.tag))
        if not aside.has_record:
            _, why = catalog.unfinished_fate(aside)
            out.append(
                Finding(
                    "warning",
                    "abandoned-unfinished",
                    f"{aside.prefix} has no SET record: an unfinished set-aside of versions "
                    f"{sorted(aside.versions)} ({len(aside.keys)} key"
                    f"{'s' if len(aside.keys) != 1 else ''}) -- an opening died while setting "
                    "them aside (copies only; the originals stayed in place), or a removal of "
                    f"the set was cut short. {why[0].upper()}{why[1:]}",
                    aside.prefix,
                    abandoned=aside.tag,
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
    opened: OpenLocation, catalog: Catalog, aside: Sequence[QuarantinedBlob], progress: Progress
) -> list[Finding]:
    """One warning per quarantined blob, saying why it was set aside where its bytes tell."""
    out: list[Finding] = []

    async def one(blob: QuarantinedBlob) -> None:
        try:
            data = await opened.get(blob.key)
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
        await bounded(aside, one, READS, progress)
    finally:
        progress.finish()
    return out


async def _deep_check(
    opened: OpenLocation,
    blobs: Sequence[tuple[Catalog, BlobEntry]],
    failed: set[str],
    progress: Progress,
) -> list[Finding]:
    """Decode every blob (against its base, found in the catalog beside it) and report what
    does not decode."""
    todo = [(cat, b) for cat, b in blobs if b.key not in failed]
    out: list[Finding] = []

    async def one(item: tuple[Catalog, BlobEntry]) -> None:
        catalog, blob = item
        try:
            await decode_blob(opened, catalog, blob)
        except (TiercheckError, OSError, ValueError) as exc:
            out.append(
                Finding(
                    "problem",
                    "decode",
                    f"{blob.key} does not decode: {type(exc).__name__}: {exc}",
                    blob.key,
                    blob.version,
                    blob.rank,
                    _tag_of(blob.key),
                )
            )

    progress.start(len(todo), "decoding")
    try:
        # One at a time: a decode holds the blob, its base and two payloads in memory.
        await bounded(todo, one, 1, progress)
    finally:
        progress.finish()
    return out
