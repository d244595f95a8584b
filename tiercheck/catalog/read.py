"""Reading a catalog's blobs: headers (:func:`inspect_blobs`), or whole (:func:`decode_blob`,
and :func:`decode_resolved`, which completes a blob's references to replicated state from the
blobs of the ranks that stored it)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from tiercheck.catalog.base import READS, NullProgress, Progress, bounded
from tiercheck.catalog.locate import OpenLocation
from tiercheck.catalog.scan import BlobEntry, Catalog
from tiercheck.codec import RawState, read_meta
from tiercheck.codec.decode.assembled import Resharded
from tiercheck.codec.decode.blobread import complete, read_blob
from tiercheck.errors import BlobNotFound, TiercheckError

__all__ = ["decode_blob", "decode_resolved", "inspect_blobs"]


async def inspect_blobs(
    opened: OpenLocation, blobs: Sequence[BlobEntry], progress: Progress | None = None
) -> dict[str, str]:
    """Read the headers of ``blobs`` (entries of a :class:`~tiercheck.catalog.Catalog`) into
    the entries.

    Returns the keys that could not be read, with the reason. The tier API reads whole blobs,
    so this reads every chosen blob once (the body is not hashed: that is
    :func:`~tiercheck.catalog.verify`).
    """
    progress = progress or NullProgress()
    errors: dict[str, str] = {}

    async def one(blob: BlobEntry) -> None:
        try:
            data = await opened.get(blob.key)
            blob.learn(await asyncio.to_thread(read_meta, data))
        except (TiercheckError, OSError) as exc:
            errors[blob.key] = f"{type(exc).__name__}: {exc}"

    progress.start(len(blobs), "reading headers")
    try:
        await bounded(blobs, one, READS, progress)
    finally:
        progress.finish()
    return errors


async def decode_blob(opened: OpenLocation, catalog: Catalog, blob: BlobEntry) -> RawState:
    """Read and decode ``blob``, reading and decoding its base first when it is a delta.

    Decoding checks every blob's checksum and the payload against the digest recorded at save
    time, so what comes back is bit for bit what was saved, or an error (the reading rule of
    restore: :func:`tiercheck.codec.decode.blobread.read_blob`).
    """

    async def find_base(version: int, rank: int) -> str:
        entry = catalog.versions.get(version)
        base_blob = None if entry is None else entry.blobs.get(rank)
        if base_blob is None:
            raise BlobNotFound(
                f"{blob.key} is a delta against version {version}, which has no blob "
                f"of rank {rank} in the {catalog.location.tier_name} tier"
            )
        return base_blob.key

    return await read_blob(opened.get, blob.key, find_base=find_base)


async def decode_resolved(
    opened: OpenLocation, catalog: Catalog, blob: BlobEntry
) -> RawState | Resharded:
    """:func:`decode_blob`, with the blob's references to replicated state (see
    :class:`tiercheck.Replicated`) replaced by the values the blobs of the storing ranks (of
    the same version, in the same location) hold: the state the rank would have saved whole."""
    raw = await decode_blob(opened, catalog, blob)
    entry = catalog.versions[raw.version]

    async def read(rank: int) -> RawState:
        other = entry.blobs.get(rank)
        if other is None:
            raise BlobNotFound(
                f"{blob.key} refers (perhaps through another rank's blob) to rank {rank}'s blob "
                f"of version {raw.version} for replicated state; the "
                f"{catalog.location.tier_name} tier holds none"
            )
        return await decode_blob(opened, catalog, other)

    rank = next(r for r, b in entry.blobs.items() if b is blob)
    return await complete(raw, rank, len(entry.blobs), read)
