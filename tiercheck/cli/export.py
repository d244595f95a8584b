"""``tiercheck export``: a stored version as ``OUT.pt`` and ``OUT.safetensors``."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from typing import Literal

from tiercheck.catalog import OpenLocation, export
from tiercheck.cli.args import location_args, locations_of, nonnegative
from tiercheck.cli.base import EXIT_OK, Console, UsageError, fmt_size, short

__all__ = ["configure_export", "run_export"]


def configure_export(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "paths",
        nargs="+",
        metavar="[URL] OUT",
        help="the location (omit with --local-root) and the output path without extension: "
        "OUT.pt and/or OUT.safetensors are written",
    )
    location_args(p, positional=False)
    p.add_argument(
        "--version", type=nonnegative, help="the version (default: the newest committed one)"
    )
    p.add_argument("--rank", type=nonnegative, help="the rank (default: the only one)")
    p.add_argument(
        "--full",
        action="store_true",
        help="the whole state put together from every rank's blob: sharded DTensors (FSDP2) "
        "as full tensors",
    )
    p.add_argument(
        "--format",
        choices=("pt", "safetensors", "both"),
        default="both",
        help="what to write (default: both)",
    )
    p.add_argument("--force", action="store_true", help="overwrite existing output files")
    p.add_argument(
        "--allow-pickle",
        action="store_true",
        help="decode states that hold pickled objects (only for checkpoints you trust)",
    )


def _export_targets(args: argparse.Namespace) -> tuple[Path, list[Literal["pt", "safetensors"]]]:
    paths: list[str] = args.paths
    if len(paths) == 2:
        args.url, out = paths
    elif len(paths) == 1 and args.local_root is not None:
        out = paths[0]
    elif len(paths) == 1:
        raise UsageError("export needs a location and an output path: tiercheck export URL OUT")
    else:
        raise UsageError(f"export takes a location and one output path, got {paths}")
    formats: list[Literal["pt", "safetensors"]] = (
        ["pt", "safetensors"] if args.format == "both" else [args.format]
    )
    if "safetensors" in formats and importlib.util.find_spec("safetensors") is None:
        raise UsageError(
            "safetensors is not installed: pip install 'tiercheck[safetensors]', or pass "
            "--format pt"
        )
    stem = Path(out)
    if stem.suffix in (".pt", ".safetensors"):
        stem = stem.with_suffix("")
    if not args.force:
        for fmt in formats:
            path = stem.with_name(f"{stem.name}.{fmt}")
            if path.exists():
                raise UsageError(f"{path} exists; pass --force to overwrite it")
    return stem, formats


async def run_export(args: argparse.Namespace, console: Console) -> int:
    args.url = None
    stem, formats = _export_targets(args)
    (loc,) = await locations_of(args, many=False)
    async with OpenLocation(loc) as opened:
        cat = await opened.scan()
        version = args.version
        if version is None:
            restorable = cat.restorable()
            if not restorable:
                raise UsageError(
                    f"the {loc.describe()} holds no committed version; pass --version "
                    f"(versions: {short(sorted(cat.versions)) or 'none'})"
                )
            version = restorable[-1]
        entry = cat.versions.get(version)
        if entry is None:
            raise UsageError(
                f"version {version} is not in the {loc.describe()}; it holds "
                f"{short(sorted(cat.versions)) or 'no versions'}"
            )
        rank = args.rank
        if args.full and rank is not None:
            raise UsageError("pass --rank or --full, not both")
        if args.full:
            pass
        elif rank is None:
            if len(cat.ranks) != 1:
                raise UsageError(
                    f"the {loc.describe()} holds ranks {short(cat.ranks)}; pass --rank, or "
                    "--full for the whole state"
                )
            rank = cat.ranks[0]
        if rank is not None and rank not in entry.blobs:
            raise UsageError(
                f"version {version} has no blob of rank {rank} in the {loc.describe()}; "
                f"ranks present: {short(sorted(entry.blobs)) or 'none'}"
            )
        if not entry.committed and not console.json_mode:
            which = "every rank's blob" if rank is None else f"rank {rank}'s blob"
            console.note(f"version {version} is not committed; exporting {which} anyway")
        result = await export(
            opened,
            cat,
            version=version,
            rank=rank,
            out=stem,
            formats=formats,
            allow_pickle=args.allow_pickle,
            progress=console.progress(),
        )
    if console.json_mode:
        console.json({"command": "export", **result.to_json()})
        return EXIT_OK
    which = "the whole state" if result.rank is None else f"rank {result.rank}"
    console.line(
        f"exported version {result.version} {which} ({result.tensors} tensors) "
        f"from the {loc.describe()}"
    )
    for fmt, path, size in result.files:
        console.line(f"  {fmt:<12} {path} ({fmt_size(size)})")
    for warning in result.warnings:
        console.note(warning)
    return EXIT_OK
