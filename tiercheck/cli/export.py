"""``tiercheck export``: a stored version as ``OUT.pt`` and ``OUT.safetensors``, or as the folder
``OUT``: a DCP checkpoint or a Hugging Face model."""

from __future__ import annotations

import argparse
import importlib.util
import re
from pathlib import Path

import torch

from tiercheck.catalog import Catalog, OpenLocation, export
from tiercheck.catalog.export import ExportFormat, HfOptions
from tiercheck.cli.args import location_args, locations_of, nonnegative
from tiercheck.cli.base import EXIT_OK, Console, UsageError, fmt_size, short

__all__ = ["configure_export", "run_export"]


def configure_export(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "paths",
        nargs="+",
        metavar="[URL] OUT",
        help="the location (omit with --local-root) and the output path without extension: "
        "OUT.pt and/or OUT.safetensors are written, or with --format dcp the folder OUT",
    )
    location_args(p, positional=False)
    p.add_argument(
        "--version", type=nonnegative, help="the version (default: the newest committed one)"
    )
    p.add_argument("--rank", type=nonnegative, help="the rank (default: the only one)")
    p.add_argument(
        "--abandoned",
        metavar="TAG",
        help="take the version from the abandoned set TAG (versions the run went back from; "
        "`tiercheck ls` lists them): the way back to a version a restore left behind "
        "(default version: the set's newest)",
    )
    p.add_argument(
        "--full",
        action="store_true",
        help="the whole state put together from every rank's blob: sharded DTensors (FSDP2) "
        "as full tensors",
    )
    p.add_argument(
        "--format",
        choices=("pt", "safetensors", "both", "dcp", "hf"),
        default="both",
        help="what to write (default: both .pt and .safetensors); dcp: a "
        "torch.distributed.checkpoint folder, which dcp.load(state_dict, checkpoint_id=OUT) "
        "reads into any mesh or number of ranks; hf: a Hugging Face model folder (sharded "
        "safetensors, and config.json where the Trainer integration saved it), which "
        "from_pretrained(OUT) loads (both with --full where the job had several ranks)",
    )
    p.add_argument(
        "--dtype",
        choices=sorted(_DTYPES),
        help="with --format hf: cast floating-point tensors to this dtype (default: as stored)",
    )
    p.add_argument(
        "--max-shard-size",
        type=_size,
        default=5_000_000_000,
        metavar="SIZE",
        help="with --format hf: the most bytes in one safetensors file, e.g. 500MB "
        "(default: 5GB, as Hugging Face)",
    )
    p.add_argument("--force", action="store_true", help="overwrite existing output files")
    p.add_argument(
        "--allow-pickle",
        action="store_true",
        help="decode states that hold pickled objects (only for checkpoints you trust)",
    )


_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20}


def _size(text: str) -> int:
    """A size in bytes: a number with an optional unit (KB, MB, GB, KiB, MiB)."""
    match = re.fullmatch(r"\s*([0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in _UNITS or int(match.group(1)) == 0:
        raise argparse.ArgumentTypeError(
            f"expected a positive size such as 500MB or 5GB, got {text!r}"
        )
    return int(match.group(1)) * _UNITS[unit]


def _export_targets(args: argparse.Namespace) -> tuple[Path, list[ExportFormat]]:
    paths: list[str] = args.paths
    if len(paths) == 2:
        args.url, out = paths
    elif len(paths) == 1 and args.local_root is not None:
        out = paths[0]
    elif len(paths) == 1:
        raise UsageError("export needs a location and an output path: tiercheck export URL OUT")
    else:
        raise UsageError(f"export takes a location and one output path, got {paths}")
    formats: list[ExportFormat] = ["pt", "safetensors"] if args.format == "both" else [args.format]
    if args.dtype is not None and formats != ["hf"]:
        raise UsageError("--dtype is for --format hf")
    if ("safetensors" in formats or "hf" in formats) and importlib.util.find_spec(
        "safetensors"
    ) is None:
        raise UsageError(
            "safetensors is not installed: pip install 'tiercheck[safetensors]', or pass "
            "--format pt"
        )
    stem = Path(out)
    if stem.suffix in (".pt", ".safetensors"):
        stem = stem.with_suffix("")
    if not args.force:
        for fmt in formats:
            path = stem if fmt in ("dcp", "hf") else stem.with_name(f"{stem.name}.{fmt}")
            if path.exists():
                raise UsageError(f"{path} exists; pass --force to overwrite it")
    return stem, formats


def _abandoned_view(cat: Catalog, tag: str, version: int | None) -> tuple[Catalog, str, int]:
    """The abandoned set ``tag`` of ``cat`` as a catalog to export from, what to call it, and
    its newest whole version; usage errors for a set that is not there, unfinished, or does
    not hold ``version``."""
    where = cat.location.describe()
    aside = cat.abandoned_set(tag)
    if aside is None:
        tags = ", ".join(a.tag for a in cat.abandoned) or "none"
        raise UsageError(f"no abandoned set {tag!r} in the {where}; abandoned sets: {tags}")
    if not aside.has_record:
        raise UsageError(
            f"abandoned set {tag} is unfinished (no SET record): an opening died while setting "
            "its versions aside, and their originals stayed in place -- export them without "
            "--abandoned"
        )
    whole = [v for v in sorted(aside.versions) if aside.versions[v].complete]
    if version is not None and version not in aside.versions:
        raise UsageError(
            f"version {version} is not in abandoned set {tag}; it holds "
            f"{short(sorted(aside.versions)) or 'no versions'}"
        )
    if version is None and not whole:
        raise UsageError(
            f"abandoned set {tag} holds no whole version (`tiercheck verify` says what is missing)"
        )
    return cat.abandoned_view(tag), f"abandoned set {tag} of the {where}", (version or whole[-1])


async def run_export(args: argparse.Namespace, console: Console) -> int:
    args.url = None
    stem, formats = _export_targets(args)
    (loc,) = await locations_of(args, many=False)
    async with OpenLocation(loc) as opened:
        cat = await opened.scan()
        where = loc.describe()
        if args.abandoned is not None:
            cat, where, newest = _abandoned_view(cat, args.abandoned, args.version)
            args.version = newest if args.version is None else args.version
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
                f"version {version} is not in the {where}; it holds "
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
                    f"the {where} holds ranks {short(cat.ranks)}; pass --rank, or "
                    "--full for the whole state"
                )
            rank = cat.ranks[0]
        if rank is not None and rank not in entry.blobs:
            raise UsageError(
                f"version {version} has no blob of rank {rank} in the {where}; "
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
            force=args.force,
            hf=HfOptions(
                dtype=None if args.dtype is None else _DTYPES[args.dtype],
                max_shard=args.max_shard_size,
            ),
            allow_pickle=args.allow_pickle,
            progress=console.progress(),
            abandoned=args.abandoned,
        )
    if console.json_mode:
        console.json({"command": "export", **result.to_json()})
        return EXIT_OK
    which = "the whole state" if result.rank is None else f"rank {result.rank}"
    console.line(
        f"exported version {result.version} {which} ({result.tensors} tensors) from the {where}"
    )
    for fmt, path, size in result.files:
        console.line(f"  {fmt:<12} {path} ({fmt_size(size)})")
    for warning in result.warnings:
        console.note(warning)
    return EXIT_OK
