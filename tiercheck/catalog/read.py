"""Reading a catalog's blobs: headers (:func:`inspect_blobs`), or whole (:func:`decode_blob`)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from tiercheck.blobread import read_blob
from tiercheck.catalog.base import READS, NullProgress, Progress, bounded
from tiercheck.catalog.locate import OpenLocation
from tiercheck.catalog.scan import BlobEntry, Catalog
from tiercheck.codec import RawState, read_meta
from tiercheck.errors import BlobNotFound, TiercheckError

__all__ = ["decode_blob", "inspect_blobs"]


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
    restore: :func:`tiercheck.blobread.read_blob`).
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
