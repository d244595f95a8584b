"""A node's local tier completed by the peer replicas it holds (``engine/restore/kept.py``), as the
elastic restore of a job that lost a node reads it. Real local tiers on a temporary folder; the
replicas laid out as the peer tier's holder keeps them (``<job>/r<rank>/<key>``)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tiercheck.consistency.identity import quarantine_key
from tiercheck.consistency.keys import blob_key
from tiercheck.engine.restore.kept import WithKeptReplicas
from tiercheck.errors import BlobNotFound, StorageError
from tiercheck.tiers.local import LocalTier


async def listed(tier: WithKeptReplicas, prefix: str = "") -> list[str]:
    return sorted([key async for key in tier.list(prefix)])


def test_local_blobs_and_held_replicas_read_as_one_tier(tmp_path: Path) -> None:
    async def main() -> None:
        local = LocalTier(tmp_path / "blobs")
        held = LocalTier(tmp_path / "replicas", name="held")
        ours = {r: blob_key(5, r, "full") for r in (0, 1)}
        theirs = {r: blob_key(5, r, "packed") for r in (2, 3)}
        for r, key in ours.items():
            await local.put(key, f"local {r}".encode())
        for r, key in theirs.items():
            await held.put(f"job/r{r:05d}/{key}", f"held {r}".encode())
        # Another job's replica, one filed under the wrong rank, and a non-blob key: not listed.
        await held.put(f"other/r00002/{blob_key(5, 2, 'packed')}", b"x")
        await held.put(f"job/r00003/{blob_key(5, 2, 'packed')}", b"x")
        await held.put("job/r00002/notes", b"x")
        view = WithKeptReplicas(local, held, "job")
        assert await listed(view, "v") == sorted([*ours.values(), *theirs.values()])
        assert await listed(view, blob_key(5, 2, "packed")) == [theirs[2]]
        for r in range(4):
            key = ours.get(r) or theirs[r]
            where = "local" if r < 2 else "held"
            assert bytes(await view.get(key)) == f"{where} {r}".encode()
            assert bytes(await view.get_range(key, 0, 4)) == f"{where} {r}".encode()[:4]
            assert await view.exists(key)
        with pytest.raises(BlobNotFound):
            await view.get(blob_key(5, 7, "full"))
        with pytest.raises(BlobNotFound):
            await view.get_range(blob_key(5, 7, "full"), 0, 1)
        assert not await view.exists(blob_key(6, 0, "full"))
        # A local blob hides a kept replica of the same key.
        await held.put(f"job/r00000/{ours[0]}", b"held 0")
        assert bytes(await view.get(ours[0])) == b"local 0"
        assert (await listed(view, "v")).count(ours[0]) == 1

    asyncio.run(main())


def test_nothing_is_written_or_deleted_but_a_quarantined_copy_next_to_its_original(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        local = LocalTier(tmp_path / "blobs")
        held = LocalTier(tmp_path / "replicas", name="held")
        mine, replica = blob_key(5, 0, "full"), blob_key(5, 2, "packed")
        await local.put(mine, b"mine")
        await held.put(f"job/r00002/{replica}", b"replica")
        view = WithKeptReplicas(local, held, "job")
        with pytest.raises(StorageError, match="read only"):
            await view.put(blob_key(6, 0, "full"), b"new")
        with pytest.raises(StorageError, match="read only"):
            await view.delete(mine)
        with pytest.raises(StorageError, match="read only"):
            await view.delete(replica)
        # A blob that failed verification is set aside where the tier keeping it would.
        await view.put(quarantine_key(mine), b"mine")
        await view.put(quarantine_key(replica), b"replica")
        assert bytes(await local.get(quarantine_key(mine))) == b"mine"
        assert bytes(await held.get(f"job/r00002/{quarantine_key(replica)}")) == b"replica"
        # Everything stored before is still there, unchanged.
        assert bytes(await local.get(mine)) == b"mine"
        assert bytes(await held.get(f"job/r00002/{replica}")) == b"replica"

    asyncio.run(main())
