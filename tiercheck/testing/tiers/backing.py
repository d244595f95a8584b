"""Conformance tests through the back door: the backing storage holds what the tier claims."""

from __future__ import annotations

import pytest

from tiercheck.testing.tiers.support import (
    _blob,
    _listed,
    _MiB,
    _TierTestBase,
    assert_same_bytes,
)
from tiercheck.tiers.base import Tier


class _BackingTests(_TierTestBase):
    """The ``test_backing_*`` tests (for subclasses that define raw_get and raw_put)."""

    # --- the backing storage (subclasses that define raw_get and raw_put) ----------------------

    @pytest.mark.parametrize("size", [0, 1000, 2 * _MiB + 3])
    async def test_backing_storage_holds_what_put_stored(self, tier: Tier, size: int) -> None:
        """put and putv store their bytes in the backing storage, under the key given."""
        self._require("raw_get", "raw_put")
        data = _blob(size, 70)
        await tier.put("back/put", data)
        assert_same_bytes(await self._raw_stored(tier, "back/put", "put"), data, "backing put")
        half = size // 2
        await tier.putv("back/deep/putv", [data[:half], b"", data[half:]])
        stored = await self._raw_stored(tier, "back/deep/putv", "putv")
        assert_same_bytes(stored, data, "backing putv")
        assert await self._raw_missing(tier, "back/other")

    async def test_backing_storage_holds_a_committed_reservation(self, tier: Tier) -> None:
        """A reservation is absent from the backing storage until commit, then it is there."""
        self._require("raw_get", "raw_put")
        reserving = self._reserving(tier)
        data = _blob(_MiB + 5, 71)
        reservation = await reserving.reserve("back/reserved", len(data))
        try:
            reservation.buffer[:] = data
            assert await self._raw_missing(tier, "back/reserved")
            await reservation.commit()
        finally:
            reservation.release()
        stored = await self._raw_stored(tier, "back/reserved", "commit")
        assert_same_bytes(stored, data, "backing reserve")

    @pytest.mark.parametrize("size", [0, 1000, 2 * _MiB + 3])
    async def test_backing_storage_is_what_get_reads(self, tier: Tier, size: int) -> None:
        """Blobs put into the backing storage directly are found, sized, read and listed."""
        self._require("raw_get", "raw_put")
        data = _blob(size, 72)
        await self.raw_put(tier, "raw/blob", data)
        await self.raw_put(tier, "raw/deep/er", b"deeper")
        assert await tier.exists("raw/blob")
        assert await tier.get_size("raw/blob") == size
        assert_same_bytes(await tier.get("raw/blob"), data, "get of a raw blob")
        assert_same_bytes(await tier.get("raw/deep/er"), b"deeper", "get of a raw blob")
        assert await _listed(tier) == ["raw/blob", "raw/deep/er"]
        assert await _listed(tier, "raw/d") == ["raw/deep/er"]

    async def test_backing_storage_loses_what_delete_removed(self, tier: Tier) -> None:
        """delete removes the blob from the backing storage, whoever wrote it there."""
        self._require("raw_get", "raw_put")
        await tier.put("del/put", b"by put")
        await self.raw_put(tier, "del/raw", b"by the back door")
        await tier.delete("del/put")
        await tier.delete("del/raw")
        assert await self._raw_missing(tier, "del/put")
        assert await self._raw_missing(tier, "del/raw")
        assert await _listed(tier) == []

    async def test_backing_storage_follows_overwrites(self, tier: Tier) -> None:
        """An overwrite by put replaces what the back door wrote, and the other way round; a
        failed put changes nothing there."""
        self._require("raw_get", "raw_put")
        await self.raw_put(tier, "over/key", _blob(5000, 73))
        await tier.put("over/key", b"by put")
        stored = await self._raw_stored(tier, "over/key", "put")
        assert_same_bytes(stored, b"by put", "after put")
        with pytest.raises(TypeError):
            await tier.put("over/key", 12345)  # type: ignore[arg-type]
        stored = await self._raw_stored(tier, "over/key", "a failed put")
        assert_same_bytes(stored, b"by put", "after a failed put")
        await self.raw_put(tier, "over/key", b"by the back door")
        assert_same_bytes(await tier.get("over/key"), b"by the back door", "get after raw put")
        assert await tier.get_size("over/key") == len(b"by the back door")
