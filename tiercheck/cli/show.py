"""``tiercheck ls`` and ``tiercheck inspect``: what is stored, per version and per blob."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from tiercheck.catalog import BlobEntry, Catalog, OpenLocation, inspect_blobs
from tiercheck.cli.args import location_args, locations_of, nonnegative
from tiercheck.cli.base import (
    EXIT_OK,
    EXIT_PROBLEMS,
    Console,
    UsageError,
    abandoned_line,
    fmt_ratio,
    fmt_size,
    leftover_line,
    plural,
    print_location_header,
    ranks_of,
    short,
    table,
    yes_no,
)
from tiercheck.codec.replica import referenced

__all__ = ["configure_inspect", "configure_ls", "run_inspect", "run_ls"]


def configure_ls(p: argparse.ArgumentParser) -> None:
    location_args(p, optional=True)


async def run_ls(args: argparse.Namespace, console: Console) -> int:
    locations = await locations_of(args, many=True)
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
        print_location_header(console, cat)
        rows = [
            [
                v,
                e.kind,
                "-" if e.base is None else e.base,
                ranks_of(sorted(e.blobs), e.expected_ranks)
                + ("" if not e.missing_ranks else f" (missing {short(e.missing_ranks)})"),
                yes_no(e.committed),
                fmt_size(e.size),
            ]
            for v, e in sorted(cat.versions.items())
        ]
        if rows:
            headers = ["VERSION", "KIND", "BASE", "RANKS", "COMMITTED", "SIZE"]
            for text in table(headers, rows, right="VERSION,BASE,SIZE"):
                console.line("  " + text)
        else:
            console.line("  (no versions)")
        for aside in cat.abandoned:
            console.line("  " + abandoned_line(cat, aside))
        if cat.location.kind == "node" and not cat.has_blobs:
            console.line(
                "  no blobs/ folder: only what an opening of the job made before it failed or "
                f"was killed ({', '.join(cat.node_records) or 'nothing'}); harmless, and "
                "`tiercheck rm-job` removes it"
            )
        for held in cat.replicas:
            console.line(
                f"  peer replicas held for rank {held.rank} of job {held.job!r}: versions "
                f"{short(held.versions) or 'none'} "
                f"({plural(held.blobs, 'blob')}, {fmt_size(held.size)})"
            )
        for item in cat.leftovers:
            console.line("  leftover " + leftover_line(item))
        if cat.leftovers_error is not None:
            console.line(f"  leftovers of killed writers cannot be listed: {cat.leftovers_error}")
    return EXIT_OK


def configure_inspect(p: argparse.ArgumentParser) -> None:
    location_args(p)
    p.add_argument("--version", type=nonnegative, help="only this version (default: all)")
    p.add_argument("--rank", type=nonnegative, help="only this rank's blobs (default: all)")
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
            # Ranks whose blob of the version holds the replicated state this one refers to
            # (its tensors are not in this blob, nor in its tensor count).
            replicas_from=sorted(referenced(meta.layout)),
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


async def run_inspect(args: argparse.Namespace, console: Console) -> int:
    (loc,) = await locations_of(args, many=False)
    async with OpenLocation(loc) as opened:
        cat = await opened.scan()
        versions = sorted(cat.versions) if args.version is None else [args.version]
        if args.version is not None and args.version not in cat.versions:
            raise UsageError(
                f"version {args.version} is not in the {loc.describe()}; it holds "
                f"{short(sorted(cat.versions)) or 'no versions'}"
            )
        if args.rank is not None and args.rank not in cat.ranks:
            raise UsageError(
                f"rank {args.rank} is not in the {loc.describe()}; ranks: {short(cat.ranks)}"
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

    print_location_header(console, cat)
    if manifest is not None:
        committed = ", ".join(
            f"{tier}: {short(vs) or 'none'}" for tier, vs in sorted(manifest["committed"].items())
        )
        console.line(f"manifest: {manifest['records']} log records; committed {committed}")
    total_raw = total_stored = 0
    for v in versions:
        entry = cat.versions[v]
        console.line()
        console.line(
            f"version {v}: {entry.kind}"
            + ("" if entry.base is None else f" against {entry.base}")
            + f", ranks {ranks_of(sorted(entry.blobs), entry.expected_ranks)}"
            + f", committed {yes_no(entry.committed)}"
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
                    fmt_size(blob.size),
                    blob.encoding,
                    "-" if blob.base is None else blob.base,
                    fmt_size(raw),
                    fmt_ratio(raw, blob.size),
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
        for text in table(headers, rows, right="RANK,SIZE,BASE,RAW,RATIO,TENSORS"):
            console.line("  " + text)
        if args.tensors:
            for blob in chosen(v):
                if blob.meta is None:
                    continue
                console.line(f"  tensors of {blob.key}:")
                trows = [
                    [s.path, str(s.dtype).removeprefix("torch."), list(s.shape), fmt_size(s.nbytes)]
                    for s in blob.meta.layout.specs
                ]
                for text in table(["PATH", "DTYPE", "SHAPE", "BYTES"], trows, right="BYTES"):
                    console.line("    " + text)
    if total_stored:
        console.line()
        console.line(
            f"total: {fmt_size(total_stored)} stored for {fmt_size(total_raw)} of state "
            f"({fmt_ratio(total_raw, total_stored)})"
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
