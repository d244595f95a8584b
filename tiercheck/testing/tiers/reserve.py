"""Conformance tests of reservations, for tiers that implement SupportsReserve."""

from __future__ import annotations

import pytest

from tiercheck.errors import BlobNotFound
from tiercheck.testing.tiers.support import (
    _blob,
    _KiB,
    _listed,
    _MiB,
    _TierTestBase,
    assert_same_bytes,
)
from tiercheck.tiers.base import Tier


class _ReserveTests(_TierTestBase):
    """The ``test_reserve_*`` tests (skipped for tiers that cannot reserve)."""

    async def test_reserve_commit_publishes_the_buffer(self, tier: Tier) -> None:
        """What is written into a reservation's buffer is the blob once committed."""
        reserving = self._reserving(tier)
        data = _blob(3 * _MiB + 17, 30)
        reservation = await reserving.reserve("res/blob", len(data))
        try:
            assert reservation.key == "res/blob"
            assert reservation.buffer.nbytes == len(data)
            reservation.buffer[:] = data
            await reservation.commit()
            assert_same_bytes(await tier.get("res/blob"), data)
            assert await tier.get_size("res/blob") == len(data)
            assert_same_bytes(reservation.buffer, data, "buffer after commit")
        finally:
            reservation.release()
        assert_same_bytes(await tier.get("res/blob"), data)

    async def test_reserve_is_invisible_until_commit(self, tier: Tier) -> None:
        """Before commit, a new key is absent and an existing key still holds its old blob."""
        reserving = self._reserving(tier)
        await tier.put("res/old", b"old blob")
        fresh = await reserving.reserve("res/new", 10)
        again = await reserving.reserve("res/old", 10)
        try:
            fresh.buffer[:] = b"0123456789"
            again.buffer[:] = b"9876543210"
            assert not await tier.exists("res/new")
            with pytest.raises(BlobNotFound):
                await tier.get("res/new")
            assert_same_bytes(await tier.get("res/old"), b"old blob")
            assert await _listed(tier) == ["res/old"]
            await fresh.commit()
            await again.commit()
            assert_same_bytes(await tier.get("res/new"), b"0123456789")
            assert_same_bytes(await tier.get("res/old"), b"9876543210")
        finally:
            fresh.release()
            again.release()

    async def test_reserve_abort_leaves_nothing(self, tier: Tier) -> None:
        """An aborted reservation leaves no blob, no listing entry, and the old blob intact."""
        reserving = self._reserving(tier)
        await tier.put("res/kept", b"kept")
        for key in ("res/gone", "res/kept"):
            reservation = await reserving.reserve(key, 4096)
            try:
                reservation.buffer[:] = b"\xab" * 4096
                await reservation.abort()
            finally:
                reservation.release()
        assert not await tier.exists("res/gone")
        assert_same_bytes(await tier.get("res/kept"), b"kept")
        assert await _listed(tier) == ["res/kept"]

    async def test_reserve_release_without_commit_discards(self, tier: Tier) -> None:
        """Releasing a reservation that was neither committed nor aborted stores nothing."""
        reserving = self._reserving(tier)
        reservation = await reserving.reserve("res/dropped", 100)
        reservation.buffer[:] = b"\x01" * 100
        reservation.release()
        assert not await tier.exists("res/dropped")
        assert await _listed(tier) == []

    async def test_reserve_zero_bytes(self, tier: Tier) -> None:
        """A reservation of 0 bytes commits an empty blob."""
        reserving = self._reserving(tier)
        reservation = await reserving.reserve("res/zero", 0)
        try:
            assert reservation.buffer.nbytes == 0
            await reservation.commit()
        finally:
            reservation.release()
        assert await tier.exists("res/zero")
        assert_same_bytes(await tier.get("res/zero"), b"")

    async def test_reserve_after_delete_gives_correct_contents(self, tier: Tier) -> None:
        """Reusing memory after deletes (recycling) never mixes old bytes into new blobs."""
        reserving = self._reserving(tier)
        sizes = [2 * _MiB, 2 * _MiB, 3 * _MiB + 1, 512 * _KiB, 2 * _MiB, 1, 4 * _MiB]
        previous: str | None = None
        for i, size in enumerate(sizes):
            key = f"cycle/{i}"
            data = _blob(size, 40 + i)
            if i % 3 == 2:
                await tier.put(key, data)
            else:
                reservation = await reserving.reserve(key, size)
                try:
                    reservation.buffer[:] = data
                    await reservation.commit()
                finally:
                    reservation.release()
            assert_same_bytes(await tier.get(key), data, key)
            if previous is not None:
                await tier.delete(previous)
            previous = key
        assert await _listed(tier) == [f"cycle/{len(sizes) - 1}"]

    async def test_reserved_buffer_survives_delete_and_reuse(self, tier: Tier) -> None:
        """A committed, unreleased buffer keeps its bytes after its key is deleted and reused."""
        reserving = self._reserving(tier)
        size = 1 * _MiB
        first_data, second_data = _blob(size, 50), _blob(size, 51)
        first = await reserving.reserve("keep/first", size)
        try:
            first.buffer[:] = first_data
            await first.commit()
            await tier.delete("keep/first")
            second = await reserving.reserve("keep/second", size)
            try:
                second.buffer[:] = second_data
                await second.commit()
            finally:
                second.release()
            third = await reserving.reserve("keep/first", size)
            try:
                third.buffer[:] = second_data
                await third.commit()
            finally:
                third.release()
            assert_same_bytes(first.buffer, first_data, "the first, still-held buffer")
        finally:
            first.release()
        assert_same_bytes(await tier.get("keep/second"), second_data)
        assert_same_bytes(await tier.get("keep/first"), second_data)
