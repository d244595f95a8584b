"""Check what a location holds: :func:`verify` reads every blob and record and reports
:class:`Finding` s (problems and warnings, each with a stable code from :data:`FINDING_CODES`).

Abandoned sets (versions the run went back from, :class:`~tiercheck.catalog.AbandonedSetEntry`)
are checked as the live versions are, each through its own view
(:meth:`Catalog.abandoned_view <tiercheck.catalog.Catalog.abandoned_view>`): a set's deltas
take their bases from the set, or from where the job kept that version since the set was made.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence

from tiercheck.catalog.base import READS, NullProgress, Progress, bounded
from tiercheck.catalog.findings import (
    FINDING_CODES,
    Finding,
    VerifyReport,
    record_findings,
    tag_of,
    version_findings,
)
from tiercheck.catalog.locate import OpenLocation
from tiercheck.catalog.read import decode_blob
from tiercheck.catalog.scan import (
    BlobEntry,
    Catalog,
    QuarantinedBlob,
    VersionEntry,
)
from tiercheck.codec import BlobMeta
from tiercheck.codec import verify as verify_blob
from tiercheck.consistency.keys import parse_blob_key
from tiercheck.errors import TiercheckError

__all__ = ["FINDING_CODES", "Finding", "VerifyReport", "verify"]


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
    a node root, blobs must match the manifest's written records. Torn versions are problems
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
                    tag_of(blob.key),
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
                    tag_of(blob.key),
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
                    tag_of(blob.key),
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
        findings.extend(version_findings(catalog, entry, metas, failed))
    wanted = set(chosen)
    for aside in sets:
        for v in sorted({*aside.listed, *aside.versions}):
            if versions is None or v in wanted:
                entry = aside.versions.get(v) or VersionEntry(v)
                findings.extend(version_findings(views[aside.tag], entry, metas, failed, aside))
    findings.extend(record_findings(catalog))
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
                    tag_of(blob.key),
                )
            )

    progress.start(len(todo), "decoding")
    try:
        # One at a time: a decode holds the blob, its base and two payloads in memory.
        await bounded(todo, one, 1, progress)
    finally:
        progress.finish()
    return out
