"""``tiercheck rm-job``: delete a whole job, after listing what goes and being told to.

The job is named explicitly (``--job``), everything of it that the location holds is listed
first, and nothing is deleted without ``--yes`` or the job's name typed at the prompt. A
persistent location takes with it the job's memory on this node (node roots under
``/dev/shm/tiercheck/<job>/`` whose identity names it), and leaves a tombstone so that memory
on nodes it cannot reach is discarded, never restored, when the job next opens. A writer
holding the job's lock in a node root, or writing a file in the persistent location from this
host, refuses the whole removal before anything is deleted; a writer on another host cannot be
seen, and the listing says so.
"""

from __future__ import annotations

import argparse
import asyncio

from tiercheck.catalog import (
    JobRemoval,
    OpenLocation,
    check_no_writer,
    job_memory,
    plan_job_removal,
    remove_job,
)
from tiercheck.cli.args import location_args, locations_of
from tiercheck.cli.base import (
    EXIT_OK,
    EXIT_PROBLEMS,
    Console,
    UsageError,
    abandoned_summary,
    fmt_size,
    leftover_line,
    plural,
    short,
    short_token,
)

__all__ = ["configure_rm_job", "run_rm_job"]


def configure_rm_job(p: argparse.ArgumentParser) -> None:
    """The arguments of ``rm-job``."""
    location_args(p)
    p.add_argument("--yes", action="store_true", help="delete without asking")
    p.add_argument("--dry-run", action="store_true", help="only list what would be deleted")


def _describe(plan: JobRemoval) -> list[str]:
    """What goes from one location, as lines for people."""
    loc = plan.location
    parts = []
    if plan.versions:
        parts.append(
            f"versions {short(plan.versions)} ({plural(plan.blobs, 'blob')}, {fmt_size(plan.size)})"
        )
    else:
        parts.append("no versions")
    if plan.commit_records:
        parts.append(plural(plan.commit_records, "COMMIT record"))
    if plan.quarantined:
        parts.append(plural(plan.quarantined, "quarantined blob"))
    if plan.abandoned:
        parts.append(plural(len(plan.abandoned), "abandoned set"))
    for held in plan.replicas:
        parts.append(
            f"the peer replicas of rank {held.rank} of job {held.job!r} "
            f"({plural(held.blobs, 'blob')})"
        )
    if loc.kind == "node":
        parts.append("the whole folder: manifest, identity.json and locks included")
    else:
        records = [r for r in plan.records if not r.startswith(("writers/", "probe/"))]
        writers = sum(1 for r in plan.records if r.startswith("writers/"))
        probes = sum(1 for r in plan.records if r.startswith("probe/"))
        parts.extend(records)
        if writers:
            parts.append(plural(writers, "writer generation"))
        if probes:
            parts.append(plural(probes, "leftover probe"))
    lines = [f"  {loc.describe()}: " + ", ".join(parts)]
    if plan.found_as is not None:
        lines.append(f"    {plan.found_as}")
    for aside in plan.abandoned:
        what = "abandoned set" if aside.has_record else "unfinished set-aside (copies)"
        lines.append(f"    {what} {aside.tag}: {abandoned_summary(aside)}")
    if plan.liveness == "checked":
        lines.append("    no writer holds the job's lock on this node now")
    else:
        newest = f"; the newest writer: {plan.newest_writer}" if plan.newest_writer else ""
        if plan.newest_writer_running:
            newest += ", whose process still runs on this host"
        lines.append(
            "    cannot tell whether a run is writing there: a writer's lock is in its node's "
            f"memory, not in the persistent tier{newest}. Make sure no run of the job is "
            "running (one that is stops writing there once the job is deleted)"
        )
    if loc.kind == "persistent":
        deleted = ", ".join(short_token(t) for t in plan.tokens) or "unknown"
        lines.append(
            f"    leaves a tombstone (DELETED) naming incarnation {deleted}: memory of it "
            "that other nodes still hold is discarded, never restored, when the job next opens"
        )
        if plan.tombstone is not None and not plan.versions and not plan.tokens:
            lines.append("    (the job was already deleted here)")
    for item in plan.leftovers:
        fate = "kept" if item.verdict == "live" else "removed where its writer is gone"
        lines.append(f"    leftover {leftover_line(item).rpartition('; ')[0]}; {fate}")
    if loc.kind == "persistent" and plan.left_alone:
        lines.append(
            f"    left alone: {plural(len(plan.left_alone), 'key')} that tiercheck did not "
            f"write ({', '.join(plan.left_alone[:3])}{', ...' if len(plan.left_alone) > 3 else ''})"
        )
    return lines


async def run_rm_job(args: argparse.Namespace, console: Console) -> int:
    """Plan, confirm and delete."""
    job: str | None = args.job
    if not job:
        raise UsageError("rm-job needs --job NAME: the job to delete, named explicitly")
    if args.url is None and args.local_root is None:
        raise UsageError(
            "rm-job needs a location: a persistent URL or folder, a node root, or a folder "
            "holding them (such as /dev/shm/tiercheck)"
        )
    locations = await locations_of(args, many=True)
    for loc in locations:
        if loc.job != job:  # --local-root takes the job from the folder's name
            raise UsageError(
                f"the {loc.describe()} belongs to job {loc.job!r}, not {job!r}; nothing was deleted"
            )
    plans = []
    for loc in locations:
        async with OpenLocation(loc) as opened:
            catalog = await opened.scan()
        plans.append(await plan_job_removal(catalog))
    # The job's memory on this node goes with its durable location (found by its identity).
    named = {(p.location.kind, p.location.url) for p in plans}
    for plan in list(plans):
        for loc in await job_memory(plan):
            if ("node", loc.url) in named:
                continue
            named.add(("node", loc.url))
            async with OpenLocation(loc) as opened:
                catalog = await opened.scan()
            memory = await plan_job_removal(catalog)
            memory.found_as = (
                f"this job's memory on this node (its identity names {plan.location.url})"
            )
            plans.append(memory)
    # A live writer anywhere refuses the whole removal, before anything is deleted.
    for plan in plans:
        await asyncio.to_thread(check_no_writer, plan)

    where = plural(len(plans), "location")
    if not console.json_mode:
        verb = "would delete" if args.dry_run else "about to delete"
        console.line(f"{verb} job {job!r} from {where}:")
        for plan in plans:
            for line in _describe(plan):
                console.line(line)
    confirmed = args.yes
    if not args.dry_run and not confirmed:
        if not console.can_ask():
            raise UsageError(
                f"nothing was deleted: confirm with --yes (rm-job deletes job {job!r} from "
                f"{where}; --dry-run lists it)"
            )
        answer = await asyncio.to_thread(
            console.ask, f"type the job's name ({job}) to delete it, anything else to keep it: "
        )
        if answer != job:
            console.line("nothing was deleted")
            return EXIT_PROBLEMS
        confirmed = True
    deleted = False
    if confirmed and not args.dry_run:
        for plan in plans:
            await remove_job(plan, progress=console.progress())
        deleted = True
    if console.json_mode:
        console.json(
            {
                "command": "rm-job",
                "job": job,
                "dry_run": args.dry_run,
                "deleted": deleted,
                "locations": [p.to_json() for p in plans],
            }
        )
    elif deleted:
        console.line(f"deleted job {job!r} from {where}")
    return EXIT_OK
