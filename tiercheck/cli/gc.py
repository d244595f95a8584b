"""``tiercheck gc``: apply retention to a location at rest."""

from __future__ import annotations

import argparse

from tiercheck.catalog import AbandonedFate, OpenLocation, apply_gc, plan_gc
from tiercheck.cli.args import location_args, locations_of, positive
from tiercheck.cli.base import EXIT_OK, Console, fmt_size, leftover_line, plural, short
from tiercheck.consistency.abandoned import ABANDONED_PREFIX

__all__ = ["configure_gc", "run_gc"]


def configure_gc(p: argparse.ArgumentParser) -> None:
    location_args(p)
    p.add_argument(
        "--keep",
        type=positive,
        required=True,
        help="how many of the newest committed versions to keep (bases they need stay too)",
    )
    p.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    p.add_argument(
        "--abandoned",
        action="store_true",
        help="also remove every abandoned set (versions the run went back from, under "
        "abandoned/; by default a set stays until the run has --keep committed versions of its "
        "own after it, as the checkpointer's retention keeps it); an unfinished set the job's "
        "newest opening may be making right now stays",
    )
    p.add_argument(
        "--purge-quarantine",
        action="store_true",
        help="also remove the blobs a restore set aside (quarantine/...; kept by default for "
        "inspection: `tiercheck verify` says why each was set aside)",
    )


def _fate_summary(fate: AbandonedFate) -> str:
    what = "versions" if fate.finished else "an unfinished set-aside of versions"
    return f"{what} [{short(fate.versions)}] ({plural(fate.blobs, 'blob')}, {fmt_size(fate.size)})"


async def run_gc(args: argparse.Namespace, console: Console) -> int:
    (loc,) = await locations_of(args, many=False)
    async with OpenLocation(loc) as opened:
        cat = await opened.scan()
        plan = await plan_gc(
            opened,
            cat,
            args.keep,
            purge_quarantine=args.purge_quarantine,
            abandoned=args.abandoned,
        )
        if not args.dry_run:
            await apply_gc(opened, plan, progress=console.progress())
    if console.json_mode:
        console.json({"command": "gc", "dry_run": args.dry_run, **plan.to_json()})
        return EXIT_OK
    console.line(loc.describe())
    if not plan.kept:
        console.line("  no whole committed version: nothing to apply retention to")
    else:
        bases = ""
        if plan.kept_as_base:
            bases = f" and the bases they need: {short(plan.kept_as_base)}"
        console.line(f"  keeping versions {short(plan.kept)}{bases}")
    if plan.kept_for_abandoned:
        console.line(
            f"  keeping versions {short(plan.kept_for_abandoned)} too: a kept abandoned set's "
            "deltas need them as their base"
        )
    if plan.in_flight:
        console.line(
            f"  leaving versions {short(plan.in_flight)} alone: newer than the newest committed "
            "one (a live job may still be saving them)"
        )
    removed = plan.removed_versions
    verb = "would remove" if args.dry_run else "removed"
    if not removed and not plan.quarantine_keys and not plan.leftovers and not plan.abandoned_keys:
        console.line("  nothing to remove")
    if removed:
        console.line(
            f"  {verb} versions {short(removed)}: "
            f"{plural(len(plan.commit_keys), 'COMMIT record')}, "
            f"{plural(len(plan.blob_keys), 'blob')}"
        )
        if args.dry_run:
            for key in plan.commit_keys:
                console.line(f"    {key}")
            for key, _, _ in plan.blob_keys:
                console.line(f"    {key}")
    if plan.quarantine_keys:
        console.line(f"  {verb} {plural(len(plan.quarantine_keys), 'quarantined blob')}")
        if args.dry_run:
            for key in plan.quarantine_keys:
                console.line(f"    {key}")
    if plan.quarantine_kept:
        n = len(plan.quarantine_kept)
        console.line(
            f"  keeping {plural(n, 'quarantined blob')} (set aside by a restore; "
            f"--purge-quarantine removes {'it' if n == 1 else 'them'})"
        )
        if args.dry_run:
            for key in plan.quarantine_kept:
                console.line(f"    {key}")
    for fate in plan.abandoned_removed:
        console.line(f"  {verb} abandoned set {fate.tag}: {_fate_summary(fate)}: {fate.why}")
        if args.dry_run:
            for key in plan.abandoned_keys:
                if key.startswith(f"{ABANDONED_PREFIX}{fate.tag}/"):
                    console.line(f"    {key}")
    for fate in plan.abandoned_kept:
        console.line(f"  keeping abandoned set {fate.tag}: {_fate_summary(fate)}: {fate.why}")
    gone = plan.leftovers if args.dry_run else plan.leftovers_removed
    if gone:
        console.line(f"  {verb} {plural(len(gone), 'leftover')} of killed writers:")
        for item in gone:
            console.line(f"    {leftover_line(item).rpartition('; ')[0]}")
    # Judged dead when listed, alive when judged again right before removal.
    removed_names = {i.name for i in plan.leftovers_removed}
    spared = [i for i in plan.leftovers if not args.dry_run and i.name not in removed_names]
    for item in [*plan.leftovers_kept, *spared]:
        console.line(f"  keeping leftover {leftover_line(item).rpartition('; ')[0]}")
    return EXIT_OK
