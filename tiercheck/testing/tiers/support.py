"""What the conformance suite's groups share: test data, byte comparisons, the tier hooks."""

from __future__ import annotations

import functools
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import ClassVar

import pytest
import pytest_asyncio

from tiercheck.tiers.base import Buffer, SupportsReserve, Tier

_KiB = 1024
_MiB = 1024 * _KiB

# Keys a tier must store, list and return unchanged (all valid per validate_key).
UNUSUAL_KEYS: tuple[str, ...] = (
    "with space/in the name",
    "ünïcødé/ключ/键/🙂",
    "punct/a=b+c@d%e~f,g!h(i)'j;k&l$m",
    "dots/a.b",
    "dots/a.b.c/d.e.f",
    "dots/.hidden",
    "dots/..two-leading",
    "dots/...",
    "deep/" + "/".join(f"level{i}" for i in range(24)),
    "trailing.dot./x.",
    "MiXeD/CaSe",
)

# Keys validate_key rejects; every operation must raise InvalidKey for them before any I/O.
INVALID_KEYS: tuple[object, ...] = (
    "",
    ".",
    "..",
    "a/../b",
    "a/./b",
    "/absolute",
    "a//b",
    "trailing/",
    "back\\slash",
    "question?mark",
    "hash#mark",
    "colon:name",
    "star*",
    "nul\x00byte",
    "new\nline",
    "del\x7fchar",
    " leading-space",
    "trailing-space ",
    "x" * 1025,
    None,
    5,
    b"bytes-key",
)


@functools.lru_cache(maxsize=8)
def _blob(size: int, seed: int) -> bytes:
    """``size`` pseudo-random bytes; different seeds differ almost everywhere.

    Cached: making 64 MiB of them takes longer than most tiers take to store them.
    """
    return random.Random(seed).randbytes(size)


def _as_kind(data: bytes, kind: str) -> Buffer:
    if kind == "bytes":
        return data
    if kind == "bytearray":
        return bytearray(data)
    if kind == "memoryview":
        # A view into the middle of a larger buffer, so that tiers honour its offset and length.
        padded = bytearray(b"\xee" * 7 + data + b"\xee" * 5)
        return memoryview(padded)[7 : 7 + len(data)]
    raise AssertionError(f"unknown buffer kind {kind}")


def _raw(data: object) -> memoryview:
    return memoryview(data).cast("B")  # type: ignore[arg-type]


def _same(a: memoryview, b: memoryview) -> bool:
    # memoryview == memoryview compares item by item; bytes compare with memcmp.
    return a.nbytes == b.nbytes and a.tobytes() == b.tobytes()


def assert_same_bytes(got: object, expected: object, what: str = "blob") -> None:
    """Assert two bytes-like objects are equal; on failure say where, without dumping them."""
    a, b = _raw(got), _raw(expected)
    if _same(a, b):
        return
    if a.nbytes != b.nbytes:
        raise AssertionError(f"{what}: got {a.nbytes} bytes, expected {b.nbytes}")
    step = _MiB
    start = next(i for i in range(0, a.nbytes, step) if a[i : i + step] != b[i : i + step])
    first = next(i for i in range(start, min(start + step, a.nbytes)) if a[i] != b[i])
    raise AssertionError(f"{what}: {a.nbytes} bytes, first difference at offset {first}")


def _equals(got: object, expected: bytes) -> bool:
    return _same(_raw(got), _raw(expected))


async def _listed(tier: Tier, prefix: str = "") -> list[str]:
    return sorted([key async for key in tier.list(prefix)])


class _TierTestBase:
    """The hooks, settings and fixture of :class:`~tiercheck.testing.TierTests` (see there)."""

    #: Size of the large-blob round trips (at least 64 MiB by default).
    large_size: ClassVar[int] = 64 * _MiB
    #: Size of the two blobs that writers alternate in the atomicity race.
    race_size: ClassVar[int] = 4 * _MiB
    #: How many puts each of the two racing writers makes.
    race_rounds: ClassVar[int] = 6
    #: How many different keys the concurrency test writes and reads at once.
    concurrency: ClassVar[int] = 64

    async def make_tier(self, tmp_path: Path) -> Tier:
        """Return a fresh, empty tier for one test. Subclasses must override this."""
        raise NotImplementedError(f"{type(self).__name__} must define make_tier(tmp_path)")

    async def destroy_tier(self, tier: Tier) -> None:
        """Clean up after one test (the tier is already closed). Does nothing by default."""

    async def reopen_tier(self, tier: Tier, tmp_path: Path) -> Tier:
        """Return a new tier over the storage of ``tier`` (closed by then). Optional.

        Not defined by default: the ``test_reopen_*`` tests are then skipped.
        """
        raise NotImplementedError(f"{type(self).__name__} does not define reopen_tier")

    async def raw_get(self, tier: Tier, key: str) -> bytes:
        """The bytes stored under ``key``, read from the backing storage without ``tier``.

        Optional (with :meth:`raw_put`); raise :class:`FileNotFoundError` where nothing is
        stored. Not defined by default: the ``test_backing_*`` tests are then skipped.
        """
        raise NotImplementedError(f"{type(self).__name__} does not define raw_get")

    async def raw_put(self, tier: Tier, key: str, data: bytes) -> None:
        """Store ``data`` under ``key`` in the backing storage without ``tier``. Optional."""
        raise NotImplementedError(f"{type(self).__name__} does not define raw_put")

    def _require(self, *hooks: str) -> None:
        """Skip the test, saying why, unless the subclass defines every one of ``hooks``."""
        missing = [h for h in hooks if getattr(type(self), h) is getattr(_TierTestBase, h)]
        if missing:
            why = {
                "reopen_tier": "a tier whose blobs outlive the instance that stored them",
                "raw_get": "a back door to the tier's backing storage",
                "raw_put": "a back door to the tier's backing storage",
            }
            pytest.skip(
                f"{type(self).__name__} does not define {' and '.join(missing)} "
                f"(define it for {why[missing[0]]})"
            )

    async def _raw_stored(self, tier: Tier, key: str, what: str) -> bytes:
        """What the backing storage holds under ``key``; a failed test if it holds nothing."""
        try:
            return await self.raw_get(tier, key)
        except FileNotFoundError:
            raise AssertionError(
                f"{what}: the backing storage holds nothing under {key!r}"
            ) from None

    async def _raw_missing(self, tier: Tier, key: str) -> bool:
        """Whether the backing storage holds nothing under ``key`` (by the back door)."""
        try:
            await self.raw_get(tier, key)
        except FileNotFoundError:
            return True
        return False

    @pytest_asyncio.fixture
    async def tier(self, tmp_path: Path) -> AsyncIterator[Tier]:
        """The tier under test, closed and destroyed after the test."""
        made = await self.make_tier(tmp_path)
        try:
            yield made
        finally:
            await made.aclose()
            await self.destroy_tier(made)

    async def _write(self, tier: Tier, key: str, data: bytes, *, reserve: bool) -> None:
        """put, or with ``reserve`` reserve + commit on tiers that can."""
        if reserve and isinstance(tier, SupportsReserve):
            reservation = await tier.reserve(key, len(data))
            try:
                reservation.buffer[:] = data
                await reservation.commit()
            finally:
                reservation.release()
        else:
            await tier.put(key, data)

    def _reserving(self, tier: Tier) -> SupportsReserve:
        if not isinstance(tier, SupportsReserve):
            pytest.skip(f"{type(tier).__name__} does not implement SupportsReserve")
        return tier
