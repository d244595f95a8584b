"""``tiercheck repair-job``: set a damaged job record aside, so that the job opens again.

A job's durable folder holds its job record (``JOB``: the job's incarnation token, its number of
ranks and world-size history; :mod:`tiercheck.consistency.identity`). When that record is
damaged (not JSON, a truncated write, an editor's slip), opening the job is refused with a
:class:`~tiercheck.errors.StorageError` naming this command, and nothing is read or changed.

``repair-job`` moves the damaged record aside -- a copy under ``quarantine/JOB.<UTC time>``,
then the record itself removed -- and changes nothing else: no version, no ``COMMIT`` record, no
blob is touched. The job's next opening then finds ``COMMIT`` records but no job record, as for a
job stored before job records existed, and writes the record anew: the incarnation token from
the nodes' memory when the identities there name this job at this location and agree (so that
memory keeps counting as this run's), else a fresh one; the world-size history from the nodes'
memory, or read off the ``COMMIT`` records (each says how many ranks saved its version). So no
version is lost. A record that is fine, or absent, is left alone (exit 0, saying so).
"""

from __future__ import annotations

import argparse
import time

from tiercheck.cli.args import location_args, locations_of
from tiercheck.cli.base import EXIT_OK, Console, UsageError
from tiercheck.consistency.identity import JOB_KEY, QUARANTINE_PREFIX, JobRecord
from tiercheck.errors import BlobNotFound, FormatError, UnsupportedFormat
from tiercheck.tiers.persistent import PersistentTier

__all__ = ["configure_repair_job", "run_repair_job"]


def configure_repair_job(p: argparse.ArgumentParser) -> None:
    """The arguments of ``repair-job``."""
    location_args(p)
    p.add_argument("--dry-run", action="store_true", help="only say what would be done")


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
        await tier.delete(JOB_KEY)
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
            f"the job record of {where} was damaged ({detail}); set aside as {moved_to}. No "
            "version was touched. The job's next opening writes the record anew from the "
            "nodes' memory and the COMMIT records."
        )
    return EXIT_OK
