"""The conformance suite fails tiers that break the contract (so its tests can fail at all)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from tiercheck.errors import BlobNotFound
from tiercheck.testing import TierTests
from tiercheck.tiers import Buffer, Tier, validate_key

from .dict_tier import DictTier

SUITE = TierTests()
# What a failing conformance test raises: a failed assert, or pytest.fail().
FAILED = (AssertionError, pytest.fail.Exception)


class DictReservation:
    """A reservation for the dict tiers below: a bytearray copied into the dict on commit."""

    def __init__(self, tier: ReservingDictTier, key: str, buffer: bytearray, nbytes: int) -> None:
        self._tier = tier
        self._key = key
        self._view = memoryview(buffer)[:nbytes]
        self.open = True

    @property
    def key(self) -> str:
        """The key it commits to."""
        return self._key

    @property
    def buffer(self) -> memoryview:
        """The writable memory."""
        return self._view

    async def commit(self) -> None:
        """Copy the buffer in as the blob."""
        self._tier.blobs[self._key] = self._view.tobytes()
        self.open = False

    async def abort(self) -> None:
        """Forget it."""
        self.open = False

    def release(self) -> None:
        """Give the memory back to the pool."""
        self._tier.pool.append(self._view.obj)  # type: ignore[arg-type]


class ReservingDictTier(DictTier):
    """A correct dict tier that supports reserve, recycling released buffers only."""

    def __init__(self) -> None:
        super().__init__()
        self.pool: list[bytearray] = []

    async def reserve(self, key: str, nbytes: int) -> DictReservation:
        """A buffer from the pool of released ones, or a new one."""
        self._check_open()
        validate_key(key)
        fitting = [b for b in self.pool if len(b) >= nbytes]
        if fitting:
            self.pool.remove(fitting[0])
            return DictReservation(self, key, fitting[0], nbytes)
        return DictReservation(self, key, bytearray(nbytes), nbytes)


class TestReservingDictTier(TierTests):
    """The suite passes a correct reserve-capable tier that is not the local tier."""

    async def make_tier(self, tmp_path: Path) -> Tier:
        return ReservingDictTier()


class SharedDictTier(ReservingDictTier):
    """A correct dict tier over a dict that outlives it (a stand-in for a disk): reopenable."""

    def __init__(self, disk: dict[str, bytes] | None = None) -> None:
        super().__init__()
        if disk is not None:
            self.blobs = disk


class _DiskSuite(TierTests):
    """The suite with its optional hooks wired to a SharedDictTier's dict."""

    async def make_tier(self, tmp_path: Path) -> Tier:
        return SharedDictTier()

    async def reopen_tier(self, tier: Tier, tmp_path: Path) -> Tier:
        assert isinstance(tier, SharedDictTier)
        return type(tier)(tier.blobs)

    async def raw_get(self, tier: Tier, key: str) -> bytes:
        assert isinstance(tier, DictTier)
        try:
            return tier.blobs[key]
        except KeyError:
            raise FileNotFoundError(key) from None

    async def raw_put(self, tier: Tier, key: str, data: bytes) -> None:
        assert isinstance(tier, DictTier)
        tier.blobs[key] = bytes(data)


class TestSharedDictTier(_DiskSuite):
    """The suite passes a correct tier that keeps its blobs across a reopen, hooks and all."""


# --- broken tiers, one bug each ------------------------------------------------------------------


class TornWrites(DictTier):
    """Publishes the first half of a blob, yields, then the whole: not atomic."""

    async def put(self, key: str, data: Buffer) -> None:
        raw = memoryview(data).tobytes()
        await super().put(key, raw[: len(raw) // 2])
        await asyncio.sleep(0)
        await super().put(key, raw)


class ListsTemporaries(DictTier):
    """Writes under a temporary key first and lists it."""

    async def put(self, key: str, data: Buffer) -> None:
        self.blobs[f"{key}.tmp"] = b""
        await asyncio.sleep(0)
        await super().put(key, data)
        del self.blobs[f"{key}.tmp"]


class SkipsKeyValidation(DictTier):
    """Stores under any key, valid or not."""

    async def put(self, key: str, data: Buffer) -> None:
        self.blobs[key] = memoryview(data).tobytes()


class KeepsCallersBuffer(DictTier):
    """Keeps a reference to the caller's buffer instead of a copy."""

    async def put(self, key: str, data: Buffer) -> None:
        await super().put(key, b"")
        self.blobs[key] = data  # type: ignore[assignment]


class IgnoresClose(DictTier):
    """Keeps working after aclose."""

    def _check_open(self) -> None:
        return None


class DeleteRaisesWhenMissing(DictTier):
    """Delete of a missing key raises KeyError."""

    async def delete(self, key: str) -> None:
        validate_key(key)
        del self.blobs[key]


class ListsOtherPrefixes(DictTier):
    """Ignores the prefix (lists everything)."""

    async def list(self, prefix: str = "") -> AsyncIterator[str]:
        for key in list(self.blobs):
            yield key


class RecyclesTooEarly(ReservingDictTier):
    """Recycles a buffer on delete although its reservation was never released."""

    async def delete(self, key: str) -> None:
        await super().delete(key)
        for reservation in self.live:
            if reservation.key == key:
                self.pool.append(reservation.buffer.obj)  # type: ignore[arg-type]

    async def reserve(self, key: str, nbytes: int) -> DictReservation:
        reservation = await super().reserve(key, nbytes)
        self.live = [*getattr(self, "live", []), reservation]
        return reservation


class CachesInsteadOfStoring(SharedDictTier):
    """Answers from a cache of its own; what it claims to store never reaches the disk."""

    async def put(self, key: str, data: Buffer) -> None:
        validate_key(key)
        self.cache = {**getattr(self, "cache", {}), key: memoryview(data).tobytes()}

    async def get(self, key: str) -> bytes:
        cache: dict[str, bytes] = getattr(self, "cache", {})
        return cache[key] if key in cache else await super().get(key)


class ReadsAStaleCopy(SharedDictTier):
    """Reads a copy of the disk taken when it was made, not what the disk holds now."""

    def __init__(self, disk: dict[str, bytes] | None = None) -> None:
        super().__init__(disk)
        self.copy = dict(self.blobs)

    async def put(self, key: str, data: Buffer) -> None:
        await super().put(key, data)
        self.copy[key] = self.blobs[key]

    async def get(self, key: str) -> bytes:
        validate_key(key)
        try:
            return self.copy[key]
        except KeyError:
            raise BlobNotFound(key) from None


class DeletesOnlyInMemory(SharedDictTier):
    """Hides deleted blobs in memory; the disk keeps them, so they come back on a reopen."""

    def __init__(self, disk: dict[str, bytes] | None = None) -> None:
        super().__init__(disk)
        self.hidden: set[str] = set()

    async def put(self, key: str, data: Buffer) -> None:
        await super().put(key, data)
        self.hidden.discard(key)

    async def reserve(self, key: str, nbytes: int) -> DictReservation:
        reservation = await super().reserve(key, nbytes)
        commit = reservation.commit

        async def commit_and_show() -> None:
            await commit()
            self.hidden.discard(key)

        reservation.commit = commit_and_show  # type: ignore[method-assign]
        return reservation

    async def delete(self, key: str) -> None:
        validate_key(key)
        self.hidden.add(key)

    async def get(self, key: str) -> bytes:
        if key in self.hidden:
            raise BlobNotFound(key)
        return await super().get(key)

    async def exists(self, key: str) -> bool:
        return key not in self.hidden and await super().exists(key)

    async def list(self, prefix: str = "") -> AsyncIterator[str]:
        async for key in super().list(prefix):
            if key not in self.hidden:
                yield key


class CommitsOnClose(SharedDictTier):
    """Publishes open reservations when it closes, although nobody committed them."""

    async def reserve(self, key: str, nbytes: int) -> DictReservation:
        reservation = await super().reserve(key, nbytes)
        self.open = [*getattr(self, "open", []), reservation]
        return reservation

    async def aclose(self) -> None:
        for reservation in getattr(self, "open", []):
            if reservation.open:
                await reservation.commit()
        await super().aclose()


DISK_SUITE = _DiskSuite()
DiskCheck = Callable[[TierTests, Tier, Path], Awaitable[None]]

BROKEN_STORAGE: list[tuple[type[Tier], DiskCheck]] = [
    (CachesInsteadOfStoring, lambda s, t, p: s.test_backing_storage_holds_what_put_stored(t, 10)),
    (ReadsAStaleCopy, lambda s, t, p: s.test_backing_storage_follows_overwrites(t)),
    (DeletesOnlyInMemory, lambda s, t, p: s.test_reopen_keeps_what_was_stored(t, p)),
    (CommitsOnClose, lambda s, t, p: s.test_reopen_shows_no_uncommitted_reservation(t, p)),
]


@pytest.mark.parametrize(
    ("cls", "check"), BROKEN_STORAGE, ids=[c.__name__ for c, _ in BROKEN_STORAGE]
)
async def test_hooks_catch_a_tier_that_breaks_its_storage(
    cls: type[Tier], check: DiskCheck, tmp_path: Path
) -> None:
    """Each of these tiers passes for itself; the back door or the reopen shows the lie."""
    tier = cls()
    await SUITE.test_round_trip_small(tier, "bytes")
    with pytest.raises(FAILED):
        await check(DISK_SUITE, cls(), tmp_path)


Check = Callable[[TierTests, Tier], Awaitable[None]]

BROKEN: list[tuple[type[Tier], Check]] = [
    (TornWrites, lambda s, t: s.test_reader_never_sees_a_partial_blob(t)),
    (ListsTemporaries, lambda s, t: s.test_list_never_shows_temporary_files(t)),
    (SkipsKeyValidation, lambda s, t: s.test_invalid_keys_are_rejected(t, "a/../b")),
    (KeepsCallersBuffer, lambda s, t: s.test_put_takes_a_snapshot(t)),
    (IgnoresClose, lambda s, t: s.test_use_after_aclose_raises_tier_closed(t)),
    (ListsOtherPrefixes, lambda s, t: s.test_list_by_prefix_with_nested_keys(t)),
    (RecyclesTooEarly, lambda s, t: s.test_reserved_buffer_survives_delete_and_reuse(t)),
]


@pytest.mark.parametrize(("cls", "check"), BROKEN, ids=[c.__name__ for c, _ in BROKEN])
async def test_suite_fails_a_broken_tier(cls: type[Tier], check: Check) -> None:
    """Each broken tier fails the conformance test aimed at its bug."""
    tier = cls()
    with pytest.raises(FAILED):
        await check(SUITE, tier)


async def test_suite_fails_a_non_idempotent_delete() -> None:
    """A delete that raises for a missing key fails the idempotent-delete test."""
    with pytest.raises(KeyError):
        await SUITE.test_delete_is_idempotent(DeleteRaisesWhenMissing())


@pytest.mark.parametrize("cls", [cls for cls, _ in BROKEN], ids=lambda c: c.__name__)
async def test_broken_tiers_pass_the_other_checks(cls: type[Tier]) -> None:
    """The broken tiers are otherwise sound: a plain round trip works (the bug is targeted)."""
    tier = cls()
    await SUITE.test_round_trip_small(tier, "bytes")
