"""``tiercheck verify``: read and check every blob and record; exit 1 on a problem."""

from __future__ import annotations

import argparse

from tiercheck.catalog import OpenLocation, verify
from tiercheck.cli.args import location_args, locations_of, nonnegative
from tiercheck.cli.base import EXIT_OK, EXIT_PROBLEMS, Console, UsageError, plural, short

__all__ = ["configure_verify", "run_verify"]


def configure_verify(p: argparse.ArgumentParser) -> None:
    location_args(p)
    p.add_argument("--version", type=nonnegative, help="only this version (default: all)")
    p.add_argument(
        "--deep",
        action="store_true",
        help="also decode every version against its base, as a restore would (slower)",
    )


async def run_verify(args: argparse.Namespace, console: Console) -> int:
    # A URL may hold several jobs or node roots: verify them all. Nothing given is an error.
    locations = await locations_of(args, many=args.url is not None)
    reports = []
    for loc in locations:
        async with OpenLocation(loc) as opened:
            cat = await opened.scan()
            if args.version is not None and args.version not in cat.versions:
                if len(locations) == 1:
                    raise UsageError(
                        f"version {args.version} is not in the {loc.describe()}; it holds "
                        f"{short(sorted(cat.versions)) or 'no versions'}"
                    )
                continue
            chosen = None if args.version is None else [args.version]
            reports.append(
                await verify(opened, cat, chosen, deep=args.deep, progress=console.progress())
            )
    if args.version is not None and not reports:
        raise UsageError(f"version {args.version} is in none of the locations found")
    bad = any(r.problems for r in reports)
    if console.json_mode:
        console.json(
            {"command": "verify", "ok": not bad, "reports": [r.to_json() for r in reports]}
        )
        return EXIT_PROBLEMS if bad else EXIT_OK
    for i, report in enumerate(reports):
        if i:
            console.line()
        n = len(report.versions)
        sets = f"{plural(len(report.abandoned), 'abandoned set')}, " if report.abandoned else ""
        console.line(
            f"{report.location.describe()}: {n} version{'s' if n != 1 else ''}, {sets}"
            f"{report.blobs_checked} blob{'s' if report.blobs_checked != 1 else ''} checked"
        )
        for f in report.findings:
            label = "PROBLEM" if f.severity == "problem" else "warning"
            console.line(f"  {label:<8} {f.code:<19} {f.message}")
        p, w = len(report.problems), len(report.warnings)
        verdict = "ok" if not p else "PROBLEMS FOUND"
        console.line(
            f"  {verdict}: {p} problem{'s' if p != 1 else ''}, {w} warning{'s' if w != 1 else ''}"
        )
    return EXIT_PROBLEMS if bad else EXIT_OK
