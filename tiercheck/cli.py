"""The ``tiercheck`` command line: list, inspect, verify, export and trim stored checkpoints.

Subcommands (``tiercheck <command> --help`` for each)::

    tiercheck ls      [URL]            jobs and versions: kind, base, ranks, committed, size
    tiercheck inspect URL              per blob: encoding, stages, base, checksum, sizes, ratio
    tiercheck verify  URL              read and check every blob and record; exit 1 on a problem
    tiercheck export  URL OUT          a version as OUT.pt (torch.save) and OUT.safetensors
    tiercheck gc      URL --keep N     apply retention (--dry-run to only list what would go;
                                       --purge-quarantine to remove set-aside blobs too)

A location (``URL``) is a persistent URL or folder -- the checkpointer's ``persistent=`` URL, or
it plus the job id -- or a node root (``/dev/shm/tiercheck/<job>/<node>``, or ``--local-root
PATH``); see :func:`tiercheck.catalog.find_locations`. Every command takes ``--json`` (one JSON
document on stdout) and ``--no-progress``; progress bars go to stderr, only on a terminal and
only where ``tqdm`` is installed.

Exit codes: ``0`` success (``verify``: no problem, warnings allowed), ``1`` problems found or the
operation failed, ``2`` usage errors (bad arguments, a location or job that does not exist, an
unknown protocol), ``130`` interrupted. Errors are one line on stderr, never a traceback (set
``TIERCHECK_DEBUG=1`` to see one).

Commands are registered in one table, :data:`COMMANDS`; a command implemented elsewhere is one
:class:`ExternalCommand` entry (see the ``demo`` hook at the end of the table).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.util
import json
import os
import sys
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal

from tiercheck.catalog import (
    BlobEntry,
    Catalog,
    Location,
    LocationError,
    NullProgress,
    OpenLocation,
    Progress,
    apply_gc,
    default_search_paths,
    export,
    find_locations,
    inspect_blobs,
    plan_gc,
    verify,
)
from tiercheck.errors import ConfigError, TiercheckError

__all__ = [
    "COMMANDS",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_PROBLEMS",
    "EXIT_USAGE",
    "Command",
    "Console",
    "ExternalCommand",
    "UsageError",
    "build_parser",
    "main",
]

EXIT_OK = 0
#: ``verify`` found a problem, or an operation failed (a blob that does not decode...).
EXIT_PROBLEMS = 1
#: Bad arguments, or a location, job, version or rank that does not exist.
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class UsageError(Exception):
    """The command line asks for something that cannot be done as asked (exit code 2)."""


# --- output ----------------------------------------------------------------------------------


class _Bar:
    """A :class:`~tiercheck.catalog.Progress` drawn with ``tqdm`` on stderr, when enabled."""

    def __init__(self, enabled: bool, stream: IO[str]) -> None:
        self._enabled = enabled
        self._stream = stream
        self._bar: Any = None

    def start(self, total: int, what: str) -> None:
        """Open a bar of ``total`` steps (none for a single step: it would only flicker)."""
        self.finish()
        if self._enabled and total > 1:
            # Imported by name: tqdm is optional and ships no type stubs.
            tqdm: Any = importlib.import_module("tqdm").tqdm
            self._bar = tqdm(total=total, desc=what, file=self._stream, leave=False, unit="blob")

    def advance(self, n: int = 1) -> None:
        """Move the bar on."""
        if self._bar is not None:
            self._bar.update(n)

    def finish(self) -> None:
        """Close the bar."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class Console:
    """Where a command writes: human text or one JSON document on stdout, notes on stderr."""

    def __init__(self, *, json_mode: bool, progress: bool) -> None:
        self.json_mode = json_mode
        # Looked up now, not at import: tests and callers may have replaced sys.stdout.
        self.out: IO[str] = sys.stdout
        self.err: IO[str] = sys.stderr
        have_tqdm = importlib.util.find_spec("tqdm") is not None
        self._progress = progress and have_tqdm and self.err.isatty()

    def progress(self) -> Progress:
        """A progress reporter for one operation (silent when disabled)."""
        return _Bar(True, self.err) if self._progress else NullProgress()

    def line(self, text: str = "") -> None:
        """A line of human output (stdout)."""
        print(text, file=self.out)

    def note(self, text: str) -> None:
        """A remark beside the output (stderr): warnings, hints."""
        print(f"tiercheck: {text}", file=self.err)

    def json(self, document: Any) -> None:
        """The command's result as JSON (stdout)."""
        json.dump(document, self.out, indent=2, sort_keys=False)
        self.out.write("\n")


def _size(n: int | None) -> str:
    if n is None:
        return "?"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _ratio(raw: int | None, stored: int | None) -> str:
    if not raw or not stored:
        return "-"
    return f"{raw / stored:.2f}x"


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]], right: str = "") -> list[str]:
    """An aligned text table; columns whose header is in ``right`` are right-aligned."""
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for row in cells:
        parts = [
            c.rjust(w) if headers[i] in right.split(",") else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(parts).rstrip())
    return lines


def _yes(value: bool | None) -> str:
    return "?" if value is None else ("yes" if value else "no")


def _ranks(entry_ranks: Sequence[int], expected: Sequence[int]) -> str:
    have = len(entry_ranks)
    return f"{have}/{len(expected)}" if expected else str(have)


# --- locations -------------------------------------------------------------------------------


def _storage_options(args: argparse.Namespace) -> dict[str, Any]:
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


async def _locations(args: argparse.Namespace, *, many: bool) -> list[Location]:
    """The locations the arguments name; exactly one unless ``many``."""
    url: str | None = args.url
    local_root: str | None = args.local_root
    options = _storage_options(args)
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


# --- ls --------------------------------------------------------------------------------------


def _configure_ls(p: argparse.ArgumentParser) -> None:
    _location_args(p, optional=True)


async def _run_ls(args: argparse.Namespace, console: Console) -> int:
    locations = await _locations(args, many=True)
    catalogs: list[Catalog] = []
    for loc in locations:
        async with OpenLocation(loc) as opened:
            catalogs.append(await opened.scan())
    if console.json_mode:
        console.json({"command": "ls", "locations": [c.to_json() for c in catalogs]})
        return EXIT_OK
    for i, cat in enumerate(catalogs):
        if i:
            console.line()
        _print_location_header(console, cat)
        rows = [
            [
                v,
                e.kind,
                "-" if e.base is None else e.base,
                _ranks(sorted(e.blobs), e.expected_ranks)
                + ("" if not e.missing_ranks else f" (missing {_short(e.missing_ranks)})"),
                _yes(e.committed),
                _size(e.size),
            ]
            for v, e in sorted(cat.versions.items())
        ]
        if rows:
            headers = ["VERSION", "KIND", "BASE", "RANKS", "COMMITTED", "SIZE"]
            for text in _table(headers, rows, right="VERSION,BASE,SIZE"):
                console.line("  " + text)
        else:
            console.line("  (no versions)")
    return EXIT_OK


def _short(values: Sequence[int], limit: int = 8) -> str:
    shown = ", ".join(str(v) for v in values[:limit])
    return shown + (f", ... ({len(values)} in all)" if len(values) > limit else "")


def _plural(n: int, what: str) -> str:
    return f"{n} {what}{'s' if n != 1 else ''}"


def _short_token(token: str) -> str:
    # Enough of the random token to tell incarnations apart by eye; --json has all of it.
    return token[:8]


def _print_location_header(console: Console, cat: Catalog) -> None:
    loc = cat.location
    extra = ", " + _plural(len(cat.ranks), "rank")
    if cat.manifest_error is not None:
        extra += ", manifest unreadable"
    elif loc.kind == "node" and all(e.committed is None for e in cat.versions.values()):
        extra += ", no manifest" if cat.versions else ""
    # Whose data this is: the job record (persistent) or the node's identity (node root).
    owner = cat.job_record or cat.identity
    if owner is not None:
        extra += f", world size {owner.world_size}, incarnation {_short_token(owner.token)}"
    if cat.job_record_error is not None:
        extra += ", job record unreadable"
    if cat.identity_error is not None:
        extra += ", identity unreadable"
    if cat.writer_generations:
        extra += f", writer generation {cat.writer_generations[-1]}"
    if cat.quarantined:
        extra += ", " + _plural(len(cat.quarantined), "quarantined blob")
    if cat.probes:
        extra += ", " + _plural(len(cat.probes), "leftover probe")
    console.line(f"{loc.describe()}{extra}")


# --- inspect ---------------------------------------------------------------------------------


def _configure_inspect(p: argparse.ArgumentParser) -> None:
    _location_args(p)
    p.add_argument("--version", type=_nonnegative, help="only this version (default: all)")
    p.add_argument("--rank", type=_nonnegative, help="only this rank's blobs (default: all)")
    p.add_argument(
        "--tensors", action="store_true", help="also list each blob's tensors (path, dtype, shape)"
    )


def _blob_json(blob: BlobEntry, tensors: bool) -> dict[str, Any]:
    meta = blob.meta
    out: dict[str, Any] = {
        "key": blob.key,
        "version": blob.version,
        "rank": blob.rank,
        "size": blob.size,
        "encoding": blob.encoding,
        "kind": blob.kind,
        "base": blob.base,
    }
    if meta is not None:
        raw = meta.layout.payload_nbytes
        out.update(
            stages=list(meta.stages),
            checksum=f"{meta.checksum:#018x}",
            raw_digest=f"{meta.raw_digest:#018x}",
            raw_size=raw,
            ratio=None if not meta.nbytes else raw / meta.nbytes,
            tensor_count=len(meta.layout.specs),
        )
        if tensors:
            out["tensors"] = [
                {
                    "path": s.path,
                    "dtype": str(s.dtype).removeprefix("torch."),
                    "shape": list(s.shape),
                    "nbytes": s.nbytes,
                }
                for s in meta.layout.specs
            ]
    return out


def _stage_names(stages: Sequence[str]) -> str:
    return ",".join(s.removeprefix("tiercheck.") for s in stages)


async def _run_inspect(args: argparse.Namespace, console: Console) -> int:
    (loc,) = await _locations(args, many=False)
    async with OpenLocation(loc) as opened:
        cat = await opened.scan()
        versions = sorted(cat.versions) if args.version is None else [args.version]
        if args.version is not None and args.version not in cat.versions:
            raise UsageError(
                f"version {args.version} is not in the {loc.describe()}; it holds "
                f"{_short(sorted(cat.versions)) or 'no versions'}"
            )
        if args.rank is not None and args.rank not in cat.ranks:
            raise UsageError(
                f"rank {args.rank} is not in the {loc.describe()}; ranks: {_short(cat.ranks)}"
            )

        def chosen(v: int) -> list[BlobEntry]:
            return [b for b in cat.blobs([v]) if args.rank in (None, b.rank)]

        errors = await inspect_blobs(
            opened, [b for v in versions for b in chosen(v)], progress=console.progress()
        )
        manifest = await _manifest_summary(opened)

    if console.json_mode:
        doc = {
            "command": "inspect",
            **cat.to_json(),
            "versions": [
                {
                    **cat.versions[v].to_json(),
                    "blobs": [_blob_json(b, args.tensors) for b in chosen(v)],
                }
                for v in versions
            ],
            "errors": errors,
            "manifest": manifest,
        }
        console.json(doc)
        return EXIT_PROBLEMS if errors else EXIT_OK

    _print_location_header(console, cat)
    if manifest is not None:
        committed = ", ".join(
            f"{tier}: {_short(vs) or 'none'}" for tier, vs in sorted(manifest["committed"].items())
        )
        console.line(f"manifest: {manifest['records']} log records; committed {committed}")
    total_raw = total_stored = 0
    for v in versions:
        entry = cat.versions[v]
        console.line()
        console.line(
            f"version {v}: {entry.kind}"
            + ("" if entry.base is None else f" against {entry.base}")
            + f", ranks {_ranks(sorted(entry.blobs), entry.expected_ranks)}"
            + f", committed {_yes(entry.committed)}"
        )
        rows = []
        for blob in chosen(v):
            meta = blob.meta
            raw = None if meta is None else meta.layout.payload_nbytes
            if raw is not None and blob.size is not None:
                total_raw += raw
                total_stored += blob.size
            rows.append(
                [
                    blob.key,
                    blob.rank,
                    _size(blob.size),
                    blob.encoding,
                    "-" if blob.base is None else blob.base,
                    _size(raw),
                    _ratio(raw, blob.size),
                    "?" if meta is None else len(meta.layout.specs),
                    "?" if meta is None else f"{meta.checksum:016x}",
                    "?" if meta is None else _stage_names(meta.stages),
                ]
            )
        headers = [
            "KEY",
            "RANK",
            "SIZE",
            "ENCODING",
            "BASE",
            "RAW",
            "RATIO",
            "TENSORS",
            "CHECKSUM",
            "STAGES",
        ]
        for text in _table(headers, rows, right="RANK,SIZE,BASE,RAW,RATIO,TENSORS"):
            console.line("  " + text)
        if args.tensors:
            for blob in chosen(v):
                if blob.meta is None:
                    continue
                console.line(f"  tensors of {blob.key}:")
                trows = [
                    [s.path, str(s.dtype).removeprefix("torch."), list(s.shape), _size(s.nbytes)]
                    for s in blob.meta.layout.specs
                ]
                for text in _table(["PATH", "DTYPE", "SHAPE", "BYTES"], trows, right="BYTES"):
                    console.line("    " + text)
    if total_stored:
        console.line()
        console.line(
            f"total: {_size(total_stored)} stored for {_size(total_raw)} of state "
            f"({_ratio(total_raw, total_stored)})"
        )
    for key, why in errors.items():
        console.note(f"cannot read {key}: {why}")
    return EXIT_PROBLEMS if errors else EXIT_OK


async def _manifest_summary(opened: OpenLocation) -> dict[str, Any] | None:
    manifest = opened.manifest
    if manifest is None:
        return None
    index = await opened.in_manifest_thread(manifest.dump_index)
    records = await opened.in_manifest_thread(lambda: sum(1 for _ in manifest.log()))
    committed: dict[str, list[int]] = {}
    for tier, version in index["commits"]:
        committed.setdefault(tier, []).append(version)
    return {"records": records, "committed": {t: sorted(vs) for t, vs in committed.items()}}


# --- verify ----------------------------------------------------------------------------------


def _configure_verify(p: argparse.ArgumentParser) -> None:
    _location_args(p)
    p.add_argument("--version", type=_nonnegative, help="only this version (default: all)")
    p.add_argument(
        "--deep",
        action="store_true",
        help="also decode every version against its base, as a restore would (slower)",
    )


async def _run_verify(args: argparse.Namespace, console: Console) -> int:
    # A URL may hold several jobs or node roots: verify them all. Nothing given is an error.
    locations = await _locations(args, many=args.url is not None)
    reports = []
    for loc in locations:
        async with OpenLocation(loc) as opened:
            cat = await opened.scan()
            if args.version is not None and args.version not in cat.versions:
                if len(locations) == 1:
                    raise UsageError(
                        f"version {args.version} is not in the {loc.describe()}; it holds "
                        f"{_short(sorted(cat.versions)) or 'no versions'}"
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
        console.line(
            f"{report.location.describe()}: {n} version{'s' if n != 1 else ''}, "
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


# --- export ----------------------------------------------------------------------------------


def _configure_export(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "paths",
        nargs="+",
        metavar="[URL] OUT",
        help="the location (omit with --local-root) and the output path without extension: "
        "OUT.pt and/or OUT.safetensors are written",
    )
    _location_args(p, positional=False)
    p.add_argument(
        "--version", type=_nonnegative, help="the version (default: the newest committed one)"
    )
    p.add_argument("--rank", type=_nonnegative, help="the rank (default: the only one)")
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


async def _run_export(args: argparse.Namespace, console: Console) -> int:
    args.url = None
    stem, formats = _export_targets(args)
    (loc,) = await _locations(args, many=False)
    async with OpenLocation(loc) as opened:
        cat = await opened.scan()
        version = args.version
        if version is None:
            restorable = cat.restorable()
            if not restorable:
                raise UsageError(
                    f"the {loc.describe()} holds no committed version; pass --version "
                    f"(versions: {_short(sorted(cat.versions)) or 'none'})"
                )
            version = restorable[-1]
        entry = cat.versions.get(version)
        if entry is None:
            raise UsageError(
                f"version {version} is not in the {loc.describe()}; it holds "
                f"{_short(sorted(cat.versions)) or 'no versions'}"
            )
        rank = args.rank
        if rank is None:
            if len(cat.ranks) != 1:
                raise UsageError(
                    f"the {loc.describe()} holds ranks {_short(cat.ranks)}; pass --rank"
                )
            rank = cat.ranks[0]
        if rank not in entry.blobs:
            raise UsageError(
                f"version {version} has no blob of rank {rank} in the {loc.describe()}; "
                f"ranks present: {_short(sorted(entry.blobs)) or 'none'}"
            )
        if not entry.committed and not console.json_mode:
            console.note(f"version {version} is not committed; exporting rank {rank}'s blob anyway")
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
    console.line(
        f"exported version {result.version} rank {result.rank} ({result.tensors} tensors) "
        f"from the {loc.describe()}"
    )
    for fmt, path, size in result.files:
        console.line(f"  {fmt:<12} {path} ({_size(size)})")
    for warning in result.warnings:
        console.note(warning)
    return EXIT_OK


# --- gc --------------------------------------------------------------------------------------


def _configure_gc(p: argparse.ArgumentParser) -> None:
    _location_args(p)
    p.add_argument(
        "--keep",
        type=_positive,
        required=True,
        help="how many of the newest committed versions to keep (bases they need stay too)",
    )
    p.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    p.add_argument(
        "--purge-quarantine",
        action="store_true",
        help="also remove the blobs a restore set aside (quarantine/...; kept by default for "
        "inspection: `tiercheck verify` says why each was set aside)",
    )


async def _run_gc(args: argparse.Namespace, console: Console) -> int:
    (loc,) = await _locations(args, many=False)
    async with OpenLocation(loc) as opened:
        cat = await opened.scan()
        plan = await plan_gc(opened, cat, args.keep, purge_quarantine=args.purge_quarantine)
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
            bases = f" and the bases they need: {_short(plan.kept_as_base)}"
        console.line(f"  keeping versions {_short(plan.kept)}{bases}")
    if plan.in_flight:
        console.line(
            f"  leaving versions {_short(plan.in_flight)} alone: newer than the newest committed "
            "one (a live job may still be saving them)"
        )
    removed = plan.removed_versions
    verb = "would remove" if args.dry_run else "removed"
    if not removed and not plan.quarantine_keys:
        console.line("  nothing to remove")
    if removed:
        console.line(
            f"  {verb} versions {_short(removed)}: "
            f"{_plural(len(plan.commit_keys), 'COMMIT record')}, "
            f"{_plural(len(plan.blob_keys), 'blob')}"
        )
        if args.dry_run:
            for key in plan.commit_keys:
                console.line(f"    {key}")
            for key, _, _ in plan.blob_keys:
                console.line(f"    {key}")
    if plan.quarantine_keys:
        console.line(f"  {verb} {_plural(len(plan.quarantine_keys), 'quarantined blob')}")
        if args.dry_run:
            for key in plan.quarantine_keys:
                console.line(f"    {key}")
    if plan.quarantine_kept:
        n = len(plan.quarantine_kept)
        console.line(
            f"  keeping {_plural(n, 'quarantined blob')} (set aside by a restore; "
            f"--purge-quarantine removes {'it' if n == 1 else 'them'})"
        )
        if args.dry_run:
            for key in plan.quarantine_kept:
                console.line(f"    {key}")
    return EXIT_OK


# --- arguments -------------------------------------------------------------------------------


def _nonnegative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value}")
    return value


def _positive(text: str) -> int:
    value = _nonnegative(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {value}")
    return value


def _location_args(
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
    p.add_argument("--job", help="the job, where the location holds several")
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


def _output_args(p: argparse.ArgumentParser, *, default: Any) -> None:
    # On the main parser and on each subcommand, so they work before or after the command.
    p.add_argument("--json", action="store_true", default=default, help="JSON output on stdout")
    p.add_argument("--no-progress", action="store_true", default=default, help="no progress bars")


# --- the command table -----------------------------------------------------------------------

Runner = Callable[[argparse.Namespace, Console], Coroutine[Any, Any, int]]


@dataclass(frozen=True)
class Command:
    """A subcommand implemented here: its arguments and its (async) body."""

    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Runner


@dataclass(frozen=True)
class ExternalCommand:
    """A subcommand implemented in another module, imported only when it runs.

    ``target`` is ``"module:function"``; the function takes the arguments after the
    subcommand's name (a list of strings) and returns an exit code (``None`` means 0). It
    parses its own arguments (``--help`` included).
    """

    name: str
    help: str
    target: str

    def load(self) -> Callable[[list[str]], int | None]:
        """Import the function."""
        module, _, attr = self.target.partition(":")
        fn: Callable[[list[str]], int | None] = getattr(importlib.import_module(module), attr)
        return fn


COMMANDS: list[Command | ExternalCommand] = [
    Command("ls", "list jobs and versions", _configure_ls, _run_ls),
    Command(
        "inspect",
        "show blobs: encoding, sizes, ratios, checksums",
        _configure_inspect,
        _run_inspect,
    ),
    Command(
        "verify",
        "check every blob and record (exit 1 on a problem)",
        _configure_verify,
        _run_verify,
    ),
    Command(
        "export",
        "write a version as torch.save and safetensors files",
        _configure_export,
        _run_export,
    ),
    Command("gc", "apply retention: keep the newest N committed versions", _configure_gc, _run_gc),
]

# --- hook: `tiercheck demo` ------------------------------------------------------------------
# The demo lives in tiercheck/demo.py (`main(argv: list[str]) -> int | None`). It registers
# here as soon as that module exists; find_spec looks for it without importing it, so the other
# commands never pay for the demo's imports.
if importlib.util.find_spec("tiercheck.demo") is not None:
    COMMANDS.append(
        ExternalCommand(
            "demo", "train, kill and restore: the end-to-end showcase", "tiercheck.demo:main"
        )
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every :class:`Command` in :data:`COMMANDS`."""
    parser = argparse.ArgumentParser(
        prog="tiercheck",
        description="List, inspect, verify, export and trim tiercheck checkpoints.",
        epilog="Exit codes: 0 ok, 1 problems found or the operation failed, 2 usage error.",
    )
    _output_args(parser, default=False)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for cmd in COMMANDS:
        if isinstance(cmd, ExternalCommand):
            # Listed for --help only: main() hands its arguments over before parsing.
            sub.add_parser(cmd.name, help=cmd.help, add_help=False)
            continue
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        _output_args(p, default=argparse.SUPPRESS)
        cmd.configure(p)
        p.set_defaults(_run=cmd.run)
    return parser


def _error(console: Console, exc: BaseException, code: int) -> int:
    message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if console.json_mode:
        console.json({"error": {"type": type(exc).__name__, "message": message, "exit_code": code}})
    print(f"tiercheck: error: {message}", file=console.err)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    for cmd in COMMANDS:
        if isinstance(cmd, ExternalCommand) and args_list[:1] == [cmd.name]:
            return cmd.load()(args_list[1:]) or EXIT_OK

    parser = build_parser()
    try:
        args = parser.parse_args(args_list)
    except SystemExit as exc:  # argparse's own exit: --help (0) or a usage error (2)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    console = Console(json_mode=args.json, progress=not args.no_progress)
    run: Runner | None = getattr(args, "_run", None)
    if run is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    debug = os.environ.get("TIERCHECK_DEBUG", "") not in ("", "0")
    try:
        return asyncio.run(run(args, console))
    except KeyboardInterrupt:
        print("tiercheck: interrupted", file=console.err)
        return EXIT_INTERRUPTED
    except (UsageError, LocationError, ConfigError) as exc:
        if debug:
            raise
        return _error(console, exc, EXIT_USAGE)
    except (TiercheckError, OSError, ValueError) as exc:
        # A failure while working (a blob that does not decode, storage that fails): one line.
        if debug:
            raise
        return _error(console, exc, EXIT_PROBLEMS)


if __name__ == "__main__":
    sys.exit(main())
