"""Conformance tests of a tier's lifecycle: closing, and reopening over the same storage."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tiercheck.errors import BlobNotFound, TierClosed
from tiercheck.testing.tiers.support import (
    UNUSUAL_KEYS,
    _blob,
    _listed,
    _MiB,
    _TierTestBase,
    assert_same_bytes,
)
from tiercheck.tiers.base import SupportsReserve, Tier


class _LifecycleTests(_TierTestBase):
    """Use after close, ``async with``, and (with ``reopen_tier``) reopening."""

    # --- lifecycle ----------------------------------------------------------------------------

    async def test_use_after_aclose_raises_tier_closed(self, tier: Tier) -> None:
        """After aclose every operation raises TierClosed; aclose itself is idempotent."""
        await tier.put("kept", b"1")
        await tier.aclose()
        await tier.aclose()
        assert tier.closed
        calls: list[Callable[[], object]] = [
            lambda: tier.put("k", b"x"),
            lambda: tier.putv("k", [b"x"]),
            lambda: tier.get("kept"),
            lambda: tier.get_size("kept"),
            lambda: tier.exists("kept"),
            lambda: tier.delete("kept"),
        ]
        for call in calls:
            with pytest.raises(TierClosed):
                await call()  # type: ignore[misc]
        with pytest.raises(TierClosed):
            async for _ in tier.list():
                pass
        if isinstance(tier, SupportsReserve):
            with pytest.raises(TierClosed):
                await tier.reserve("k", 1)

    async def test_async_context_manager(self, tier: Tier) -> None:
        """``async with tier`` yields the tier and closes it on exit."""
        async with tier as entered:
            assert entered is tier
            await tier.put("ctx", b"1")
        assert tier.closed
        with pytest.raises(TierClosed):
            await tier.get("ctx")

    # --- closing and reopening (subclasses that define reopen_tier) ----------------------------

    async def _reopened(self, tier: Tier, tmp_path: Path) -> Tier:
        """Close ``tier`` and open its storage anew."""
        await tier.aclose()
        again = await self.reopen_tier(tier, tmp_path)
        assert again is not tier, "reopen_tier must return a new instance"
        assert not again.closed
        return again

    async def _assert_holds(self, tier: Tier, expected: dict[str, bytes], gone: list[str]) -> None:
        assert await _listed(tier) == sorted(expected)
        for key, data in expected.items():
            assert await tier.exists(key), key
            assert await tier.get_size(key) == len(data), key
            assert_same_bytes(await tier.get(key), data, key)
        for key in gone:
            assert not await tier.exists(key), key
            with pytest.raises(BlobNotFound):
                await tier.get(key)

    async def test_reopen_keeps_what_was_stored(self, tier: Tier, tmp_path: Path) -> None:
        """Blobs stored (put, putv, reserve), overwritten and deleted stay so after a reopen."""
        self._require("reopen_tier")
        expected = {
            "keep/small": _blob(1000, 60),
            "keep/empty": b"",
            "keep/deep/er/blob": _blob(2 * _MiB + 3, 61),
            "keep/vector": _blob(300, 62) + _blob(5000, 63),
            "keep/over": _blob(10, 64),
            UNUSUAL_KEYS[1]: UNUSUAL_KEYS[1].encode(),
        }
        for key in ("keep/small", "keep/empty", "keep/deep/er/blob", UNUSUAL_KEYS[1]):
            await tier.put(key, expected[key])
        await tier.putv("keep/vector", [_blob(300, 62), _blob(5000, 63)])
        await tier.put("keep/over", _blob(7000, 65))
        await tier.put("keep/over", expected["keep/over"])
        await tier.put("gone/deleted", b"deleted")
        await tier.delete("gone/deleted")
        if isinstance(tier, SupportsReserve):
            expected["keep/reserved"] = _blob(4096, 66)
            await self._write(tier, "keep/reserved", expected["keep/reserved"], reserve=True)
        again = await self._reopened(tier, tmp_path)
        try:
            await self._assert_holds(again, expected, ["gone/deleted"])
        finally:
            await again.aclose()

    async def test_reopen_keeps_changes_made_after_a_reopen(
        self, tier: Tier, tmp_path: Path
    ) -> None:
        """A reopened tier overwrites, deletes and adds, and a second reopen sees just that."""
        self._require("reopen_tier")
        await tier.put("a", b"first a")
        await tier.put("b/c", b"first b/c")
        await tier.put("d", b"first d")
        again = await self._reopened(tier, tmp_path)
        try:
            await again.put("a", b"second a")
            await again.delete("b/c")
            await again.put("e/f", b"new e/f")
            await self._assert_holds(
                again, {"a": b"second a", "d": b"first d", "e/f": b"new e/f"}, ["b/c"]
            )
            third = await self._reopened(again, tmp_path)
        finally:
            await again.aclose()
        try:
            await self._assert_holds(
                third, {"a": b"second a", "d": b"first d", "e/f": b"new e/f"}, ["b/c"]
            )
        finally:
            await third.aclose()

    async def test_reopen_shows_no_uncommitted_reservation(
        self, tier: Tier, tmp_path: Path
    ) -> None:
        """A reservation still open when the tier closes never becomes a blob, nor hides one."""
        self._require("reopen_tier")
        reserving = self._reserving(tier)
        await tier.put("res/old", b"old blob")
        fresh = await reserving.reserve("res/new", 4096)
        over = await reserving.reserve("res/old", 4096)
        try:
            fresh.buffer[:] = b"\x01" * 4096
            over.buffer[:] = b"\x02" * 4096
            again = await self._reopened(tier, tmp_path)
        finally:
            fresh.release()
            over.release()
        try:
            await self._assert_holds(again, {"res/old": b"old blob"}, ["res/new"])
        finally:
            await again.aclose()
