"""``tiercheck repair-job``: set a damaged job record aside, so that the job opens again.

A job's durable folder holds its job record (``JOB``: the job's incarnation token, its number of
ranks and world-size history; :mod:`tiercheck.consistency.identity`). When that record is
damaged (not JSON, a truncated write, an editor's slip), opening the job is refused with a
:class:`~tiercheck.errors.StorageError` naming this command, and nothing is read or changed.

``repair-job`` keeps a copy of the damaged record under ``quarantine/JOB.<UTC time>`` and writes
a *repaired* record in its place: a new token, and the number of ranks and world-size history
read off the ``COMMIT`` records (each says how many ranks saved its version). Nothing else
changes: no version, no ``COMMIT`` record, no blob is touched. The job's next opening takes the
incarnation token (and history) that the nodes' memory of this location names, where their
identities agree, so that memory keeps counting as this run's, and rewrites the record. So no
version is lost. A record that is fine, or absent, is left alone (exit 0, saying so).
"""

from __future__ import annotations

import argparse
import os
import time

from tiercheck.cli.args import location_args, locations_of
from tiercheck.cli.base import EXIT_OK, Console, UsageError
from tiercheck.consistency.commit import CommitRecord
from tiercheck.consistency.identity import JOB_KEY, QUARANTINE_PREFIX, JobRecord
from tiercheck.consistency.keys import commit_key, parse_commit_key
from tiercheck.consistency.worlds import spans_of
from tiercheck.errors import BlobNotFound, FormatError, UnsupportedFormat
from tiercheck.tiers.persistent import PersistentTier

__all__ = ["configure_repair_job", "run_repair_job"]


def configure_repair_job(p: argparse.ArgumentParser) -> None:
    """The arguments of ``repair-job``."""
    location_args(p)
    p.add_argument("--dry-run", action="store_true", help="only say what would be done")


async def _rebuilt(tier: PersistentTier, job: str) -> JobRecord | None:
    """A repaired job record from the ``COMMIT`` records (``None`` when there are none)."""
    versions = sorted(
        [v async for key in tier.list("v") if (v := parse_commit_key(key)) is not None]
    )
    saved_by = []
    for version in versions:
        try:
            record = CommitRecord.from_bytes(bytes(await tier.get(commit_key(version))))
        except (BlobNotFound, FormatError):
            continue  # a damaged COMMIT record says nothing; restore judges that version
        saved_by.append((version, record.world_size))
    if not saved_by:
        return None
    return JobRecord(
        job,
        os.urandom(8).hex(),
        saved_by[-1][1],
        time.time(),
        worlds=spans_of(saved_by),
        repaired=True,
    )


async def run_repair_job(args: argparse.Namespace, console: Console) -> int:
    """Check the job record; set it aside when it is damaged."""
    if args.url is None:
        raise UsageError("repair-job needs the job's persistent URL or folder")
    args.tier = "persistent"
    (loc,) = await locations_of(args, many=False)
    tier = PersistentTier(loc.url, storage_options=loc.storage_options)
    state, detail, moved_to = "damaged", "", ""
    try:
        data = bytes(await tier.get(JOB_KEY))
    except BlobNotFound:
        state = "absent"
    else:
        try:
            record = JobRecord.from_bytes(data)
        except UnsupportedFormat as exc:
            # Written by a newer tiercheck: not damaged, and not ours to touch.
            state, detail = "newer", str(exc)
        except FormatError as exc:
            detail = str(exc)
        else:
            state = "ok"
            detail = f"token {record.token[:8]}, saved by {record.world_size} ranks" + (
                f", history {list(record.worlds)}" if record.worlds else ""
            )
    if state == "damaged" and not args.dry_run:
        moved_to = f"{QUARANTINE_PREFIX}{JOB_KEY}.{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
        await tier.put(moved_to, data)
        repaired = await _rebuilt(tier, loc.job)
        if repaired is None:
            await tier.delete(JOB_KEY)  # nothing committed: the next opening starts afresh
        else:
            await tier.put(JOB_KEY, repaired.to_bytes())
    if console.json_mode:
        console.json(
            {
                "command": "repair-job",
                "job": loc.job,
                "location": loc.url,
                "record": state,
                "detail": detail,
                "dry_run": args.dry_run,
                "set_aside_as": moved_to or None,
            }
        )
        return EXIT_OK
    where = loc.describe()
    if state == "ok":
        console.line(f"the job record of {where} is fine ({detail}); nothing to repair")
    elif state == "absent":
        console.line(
            f"{where} has no job record; its next opening writes one (from the nodes' memory "
            "and the COMMIT records); nothing to repair"
        )
    elif state == "newer":
        console.line(f"the job record of {where} was written by a newer tiercheck: {detail}")
    elif args.dry_run:
        console.line(
            f"the job record of {where} is damaged ({detail}); repair-job would set it aside "
            f"under {QUARANTINE_PREFIX} (nothing else changes)"
        )
    else:
        console.line(
            f"the job record of {where} was damaged ({detail}); set aside as {moved_to} and "
            "written anew from the COMMIT records. No version was touched. The job's next "
            "opening takes the token its nodes' memory names and rewrites the record."
        )
    return EXIT_OK
