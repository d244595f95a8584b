"""What :func:`~tiercheck.catalog.verify` reports, and the findings a catalog shows without
reading a blob.

:class:`Finding` (with its stable codes, :data:`FINDING_CODES`) and :class:`VerifyReport`;
:func:`version_findings` judges one version's blobs against its records (a ``COMMIT`` record,
the manifest, an abandoned set's ``SET`` record) once its blobs were read, and
:func:`record_findings` the location's own records. No I/O here: reading is
:mod:`tiercheck.catalog.verify`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from tiercheck.catalog.base import Location
from tiercheck.catalog.scan import (
    AbandonedSetEntry,
    Catalog,
    VersionEntry,
)
from tiercheck.codec import BlobMeta
from tiercheck.consistency.abandoned import parse_abandoned_key, set_record_key
from tiercheck.consistency.identity import JOB_KEY, TOMBSTONE_KEY, writer_key
from tiercheck.consistency.keys import blob_key, commit_key
from tiercheck.defaults import IDENTITY_FILE, default_encoding

__all__ = [
    "FINDING_CODES",
    "Finding",
    "VerifyReport",
    "hex_value",
    "record_findings",
    "tag_of",
    "version_findings",
]


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
    "manifest-mismatch": "a blob differs from what the manifest recorded as written",
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


def tag_of(key: str) -> str | None:
    """The abandoned set a key is in, if any."""
    parsed = parse_abandoned_key(key)
    return None if parsed is None else parsed[0]


def hex_value(value: int) -> str:
    """A checksum or digest as it is shown in a finding (``0x`` and 16 hex digits)."""
    return f"{value:#018x}"


def version_findings(
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
                f"{hex_value(want.raw_digest)}; {base_blob.key} is "
                + (
                    "itself a delta"
                    if base_meta.base is not None
                    else f"raw digest {hex_value(base_meta.raw_digest)}"
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
                key=blob_key(v, rank, default_encoding(loc.kind == "persistent")),
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
                    diffs.append(f"checksum {hex_value(e.checksum)} != {hex_value(meta.checksum)}")
                if meta.raw_digest != e.raw_digest:
                    diffs.append(
                        f"raw digest {hex_value(e.raw_digest)} != {hex_value(meta.raw_digest)}"
                    )
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

    # The manifest's written records against the blobs (node roots).
    if loc.kind == "node":
        for rank, blob in sorted(entry.blobs.items()):
            record = catalog.written.get((v, rank))
            meta = metas.get(blob.key)
            if record is None or meta is None or record.key != blob.key:
                continue
            if (record.size, record.checksum) != (meta.nbytes, meta.checksum):
                add(
                    "problem",
                    "manifest-mismatch",
                    f"{blob.key} is {meta.nbytes} bytes with checksum {hex_value(meta.checksum)}; "
                    f"the manifest recorded {record.size} bytes, {hex_value(record.checksum)}",
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


def record_findings(catalog: Catalog) -> list[Finding]:
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
