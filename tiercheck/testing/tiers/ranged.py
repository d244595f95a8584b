"""Conformance tests of ranged reads, for tiers that implement SupportsRangedGet."""

from __future__ import annotations

import pytest

from tiercheck.errors import BlobNotFound, InvalidKey
from tiercheck.testing.tiers.support import _blob, _KiB, _MiB, _TierTestBase, assert_same_bytes
from tiercheck.tiers.base import SupportsRangedGet, Tier


class _RangedTests(_TierTestBase):
    """The ``test_get_range_*`` tests (skipped for tiers without ranged reads)."""

    def _ranged(self, tier: Tier) -> SupportsRangedGet:
        if not isinstance(tier, SupportsRangedGet):
            pytest.skip(f"{type(tier).__name__} does not implement SupportsRangedGet")
        return tier

    async def test_get_range_returns_the_slice(self, tier: Tier) -> None:
        """Ranges at the start, in the middle, at the end and across the whole blob."""
        ranged = self._ranged(tier)
        data = _blob(3 * _MiB + 123, 40)
        await tier.put("range/blob", data)
        n = len(data)
        for start, end in [
            (0, 1),
            (0, 64),
            (1, 4 * _KiB + 3),
            (_MiB - 5, 2 * _MiB + 7),
            (n - 10, n),
            (n - 1, n),
            (0, n),
        ]:
            got = await ranged.get_range("range/blob", start, end)
            assert_same_bytes(got, data[start:end], f"range [{start}, {end})")

    async def test_get_range_is_clipped_at_the_end(self, tier: Tier) -> None:
        """Past the end, a range is clipped like a slice: short, or empty."""
        ranged = self._ranged(tier)
        data = _blob(10 * _KiB + 1, 41)
        await tier.put("range/short", data)
        n = len(data)
        assert_same_bytes(await ranged.get_range("range/short", n - 7, n + 100), data[n - 7 :])
        assert_same_bytes(await ranged.get_range("range/short", 0, 10 * n), data)
        assert_same_bytes(await ranged.get_range("range/short", n, n + 5), b"")
        assert_same_bytes(await ranged.get_range("range/short", n + 3, n + 9), b"")

    async def test_get_range_empty(self, tier: Tier) -> None:
        """An empty range of a stored blob is empty; so is any range of an empty blob."""
        ranged = self._ranged(tier)
        await tier.put("range/some", b"abcdef")
        await tier.put("range/empty", b"")
        assert_same_bytes(await ranged.get_range("range/some", 3, 3), b"")
        assert_same_bytes(await ranged.get_range("range/empty", 0, 0), b"")
        assert_same_bytes(await ranged.get_range("range/empty", 0, 10), b"")

    async def test_get_range_sees_an_overwrite(self, tier: Tier) -> None:
        """After a put replaces a blob, ranges come from the new one."""
        ranged = self._ranged(tier)
        old, new = _blob(64 * _KiB, 42), _blob(32 * _KiB, 43)
        await tier.put("range/over", old)
        await tier.put("range/over", new)
        assert_same_bytes(await ranged.get_range("range/over", 100, 40 * _KiB), new[100:])

    async def test_get_range_of_a_missing_key(self, tier: Tier) -> None:
        """A missing (or deleted) key raises BlobNotFound, even for an empty range."""
        ranged = self._ranged(tier)
        with pytest.raises(BlobNotFound):
            await ranged.get_range("range/missing", 0, 10)
        with pytest.raises(BlobNotFound):
            await ranged.get_range("range/missing", 0, 0)
        await tier.put("range/gone", b"data")
        await tier.delete("range/gone")
        with pytest.raises(BlobNotFound):
            await ranged.get_range("range/gone", 0, 4)

    async def test_get_range_refuses_bad_bounds(self, tier: Tier) -> None:
        """Negative or reversed bounds and invalid keys are refused before any I/O."""
        ranged = self._ranged(tier)
        await tier.put("range/bounds", b"0123456789")
        for start, end in [(-1, 5), (5, 4), (0, -1)]:
            with pytest.raises(ValueError, match="byte range"):
                await ranged.get_range("range/bounds", start, end)
        with pytest.raises(InvalidKey):
            await ranged.get_range("a//b", 0, 1)
