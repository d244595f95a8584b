"""Conformance tests of concurrent use: many operations at once, readers racing writers."""

from __future__ import annotations

import asyncio

import pytest

from tiercheck.testing.tiers.support import (
    _blob,
    _equals,
    _KiB,
    _listed,
    _raw,
    _TierTestBase,
    assert_same_bytes,
)
from tiercheck.tiers.base import Tier


class _ConcurrencyTests(_TierTestBase):
    """Concurrent puts and gets, atomic overwrites, failed puts."""

    # --- concurrency and atomicity ------------------------------------------------------------

    async def test_many_concurrent_puts_and_gets(self, tier: Tier) -> None:
        """``concurrency`` puts, then gets, of different keys at once all land correctly."""
        n = self.concurrency
        blobs = {f"conc/{i:03d}": _blob(8 * _KiB + i, 100 + i) for i in range(n)}
        await asyncio.gather(*(tier.put(k, v) for k, v in blobs.items()))
        got = await asyncio.gather(*(tier.get(k) for k in blobs))
        for (key, expected), data in zip(blobs.items(), got, strict=True):
            assert_same_bytes(data, expected, key)
        assert await _listed(tier, "conc/") == sorted(blobs)
        await asyncio.gather(*(tier.delete(k) for k in blobs))
        assert await _listed(tier) == []

    async def test_reader_never_sees_a_partial_blob(self, tier: Tier) -> None:
        """Readers racing writers of one key always read one of the written blobs, whole."""
        blob_a = _blob(self.race_size, 20)
        blob_b = _blob(self.race_size + 4099, 21)
        await tier.put("race", blob_a)
        done = asyncio.Event()

        async def writer(first: bytes, second: bytes, *, reserve: bool) -> None:
            for i in range(self.race_rounds):
                await self._write(tier, "race", first if i % 2 == 0 else second, reserve=reserve)

        async def reader() -> int:
            reads = 0
            while not done.is_set():
                got = await tier.get("race")
                assert _equals(got, blob_a) or _equals(got, blob_b), (
                    f"read {_raw(got).nbytes} bytes that are neither blob"
                )
                reads += 1
                # A tier whose get never suspends would otherwise starve the writers.
                await asyncio.sleep(0)
            return reads

        readers = [asyncio.create_task(reader()) for _ in range(2)]
        try:
            await asyncio.gather(
                writer(blob_b, blob_a, reserve=False), writer(blob_a, blob_b, reserve=True)
            )
        finally:
            done.set()
        counts = await asyncio.gather(*readers)
        assert sum(counts) > 0
        final = await tier.get("race")
        assert _equals(final, blob_a) or _equals(final, blob_b)

    async def test_failed_put_keeps_the_previous_blob(self, tier: Tier) -> None:
        """A put given something that is not a buffer raises TypeError and changes nothing."""
        await tier.put("keep", b"previous")
        bad_values: list[object] = [12345, "a str is not bytes", None, object()]
        for bad in bad_values:
            with pytest.raises(TypeError):
                await tier.put("keep", bad)  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            await tier.putv("keep", [b"ok", 12345])  # type: ignore[list-item]
        with pytest.raises(TypeError):
            await tier.put("fresh", 12345)  # type: ignore[arg-type]
        assert_same_bytes(await tier.get("keep"), b"previous")
        assert not await tier.exists("fresh")
        assert await _listed(tier) == ["keep"]
