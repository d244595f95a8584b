"""Arguments every command shares, and the locations they name."""

from __future__ import annotations

import argparse
import json
from typing import Any

from tiercheck.catalog import Location, LocationError, default_search_paths, find_locations
from tiercheck.cli.base import UsageError
from tiercheck.defaults import check_job_id
from tiercheck.errors import ConfigError

__all__ = [
    "job_id",
    "location_args",
    "locations_of",
    "nonnegative",
    "output_args",
    "parse_storage_options",
    "positive",
]


def parse_storage_options(args: argparse.Namespace) -> dict[str, Any]:
    raw = getattr(args, "storage_options", None)
    if not raw:
        return {}
    try:
        options = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--storage-options must be a JSON object: {exc}") from exc
    if not isinstance(options, dict):
        raise UsageError("--storage-options must be a JSON object, like '{\"anon\": true}'")
    return options


async def locations_of(args: argparse.Namespace, *, many: bool) -> list[Location]:
    """The locations the arguments name; exactly one unless ``many``."""
    url: str | None = args.url
    local_root: str | None = args.local_root
    options = parse_storage_options(args)
    if url is not None and local_root is not None:
        raise UsageError("give a location or --local-root, not both")
    if local_root is not None:
        found = await find_locations(local_root, local_root=True)
    elif url is not None:
        found = await find_locations(url, job=args.job, storage_options=options)
    elif many:
        found = []
        searched = default_search_paths()
        for path in searched:
            try:
                found += await find_locations(path, job=args.job)
            except LocationError:
                continue
        if not found:
            where = " or ".join(searched) or "the checkpointer's default places (none exists)"
            raise LocationError(
                f"no location given and no checkpoints in {where}; give a persistent URL or "
                "folder, or a node root"
            )
    else:
        raise UsageError("give a location: a persistent URL or folder, or a node root")
    tier: str | None = args.tier
    if tier is not None:
        kept = [loc for loc in found if loc.tier_name == tier]
        if not kept:
            listing = "; ".join(loc.describe() for loc in found)
            raise LocationError(f"no {tier} location among those found: {listing}")
        found = kept
    if many or len(found) == 1:
        return found
    listing = "; ".join(loc.describe() for loc in found)
    jobs = sorted({loc.job for loc in found})
    tiers = sorted({loc.tier_name for loc in found})
    if len(jobs) > 1:
        hint = f"pass --job (one of: {', '.join(jobs)})"
    elif len(tiers) > 1 and len(found) == len(tiers):
        hint = f"pass --tier ({' or '.join(tiers)})"
    else:
        hint = "give one of them as the location"
    raise UsageError(f"{url or local_root} holds {len(found)} locations: {listing}; {hint}")


def nonnegative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value}")
    return value


def job_id(text: str) -> str:
    """A ``--job`` value: a job id as the checkpointer takes it (see
    :func:`tiercheck.defaults.check_job_id`)."""
    try:
        return check_job_id(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def positive(text: str) -> int:
    value = nonnegative(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {value}")
    return value


def location_args(
    p: argparse.ArgumentParser, *, optional: bool = False, positional: bool = True
) -> None:
    if positional:
        p.add_argument(
            "url",
            nargs="?",
            metavar="URL",
            help="a persistent URL or folder (file://, s3://, memory://, a path; the "
            "checkpointer's persistent= URL, or it plus the job id) or a node root"
            + (" (default: the checkpointer's default places)" if optional else ""),
        )
    p.add_argument("--job", type=job_id, help="the job, where the location holds several")
    p.add_argument(
        "--tier",
        choices=("local", "persistent"),
        help="only node roots (local) or only persistent job folders, where a folder holds both",
    )
    p.add_argument(
        "--local-root",
        metavar="PATH",
        help="read PATH as a node root (blobs/ and manifest/), instead of a URL",
    )
    p.add_argument(
        "--storage-options",
        metavar="JSON",
        help="fsspec storage options as a JSON object (for s3://: key, secret, "
        'client_kwargs={"endpoint_url": ...})',
    )


def output_args(p: argparse.ArgumentParser, *, default: Any) -> None:
    # On the main parser and on each subcommand, so they work before or after the command.
    p.add_argument("--json", action="store_true", default=default, help="JSON output on stdout")
    p.add_argument("--no-progress", action="store_true", default=default, help="no progress bars")
