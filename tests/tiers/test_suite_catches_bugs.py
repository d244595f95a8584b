"""The test kit fails tiers that break the contract (so its tests can fail at all).

Each broken tier below has one bug and is otherwise sound. :class:`~tiercheck.testing.TierTests`
catches the ones a single call shows; its optional hooks catch those that only the backing
storage (``raw_get``/``raw_put``) or a reopen (``reopen_tier``) shows; and
:class:`~tiercheck.testing.TierStateMachine` catches those that only a sequence of steps shows.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from tiercheck.errors import BlobNotFound
from tiercheck.testing import TierStateMachine, TierTests
from tiercheck.tiers import Buffer, Tier, validate_key
from tiercheck.tiers.base import check_range

from .dict_tier import DictTier

SUITE = TierTests()
# What a failing conformance test raises: a failed assert, or pytest.fail().
FAILED = (AssertionError, pytest.fail.Exception)

# Fixed examples, so that "the machine finds the bug" is a property of the code, not of luck;
# no shrinking (finding is the point here, and shrinking a stateful run takes long), one bug.
# A hunt stops at the bug it finds; the room to search is for the bugs that take several
# steps in a row to show (RecyclesHeldBuffers needs tens of examples).
SEARCH = settings(
    max_examples=300,
    stateful_step_count=20,
    derandomize=True,
    database=None,
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    report_multiple_bugs=False,
    suppress_health_check=[HealthCheck.too_slow],
)
# The same, for the runs that must pass: they run every example, so fewer of them.
PASS = settings(SEARCH, max_examples=100)


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


class RangedDictTier(DictTier):
    """A correct dict tier with ranged reads."""

    async def get_range(self, key: str, start: int, end: int) -> Buffer:
        """The slice of the stored bytes."""
        check_range(start, end)
        return memoryview(await self.get(key))[start:end]


class TestRangedDictTier(TierTests):
    """The suite passes a correct tier with ranged reads that is not a built-in one."""

    async def make_tier(self, tmp_path: Path) -> Tier:
        return RangedDictTier()


class RangeOffByOne(RangedDictTier):
    async def get_range(self, key: str, start: int, end: int) -> Buffer:
        return memoryview(await self.get(key))[start : end + 1]


class RangeNotClipped(RangedDictTier):
    async def get_range(self, key: str, start: int, end: int) -> Buffer:
        data = memoryview(await self.get(key))
        return bytes(data[start:end]).ljust(end - start, b"\0")


class RangeOfNothingIsFound(RangedDictTier):
    async def get_range(self, key: str, start: int, end: int) -> Buffer:
        if start == end:
            return b""
        return await super().get_range(key, start, end)


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


class ForgetsOnReopen(SharedDictTier):
    """Keeps its blobs in memory of its own, never on the disk it is opened over: every call
    of one instance answers right, and a reopen finds nothing (data lost on a restart)."""

    def __init__(self, disk: dict[str, bytes] | None = None) -> None:
        super().__init__()


DISK_SUITE = _DiskSuite()
DiskCheck = Callable[[TierTests, Tier, Path], Awaitable[None]]

BROKEN_STORAGE: list[tuple[type[Tier], DiskCheck]] = [
    (CachesInsteadOfStoring, lambda s, t, p: s.test_backing_storage_holds_what_put_stored(t, 10)),
    (ReadsAStaleCopy, lambda s, t, p: s.test_backing_storage_follows_overwrites(t)),
    (DeletesOnlyInMemory, lambda s, t, p: s.test_reopen_keeps_what_was_stored(t, p)),
    (ForgetsOnReopen, lambda s, t, p: s.test_reopen_keeps_what_was_stored(t, p)),
    (ForgetsOnReopen, lambda s, t, p: s.test_reopen_keeps_changes_made_after_a_reopen(t, p)),
    (CommitsOnClose, lambda s, t, p: s.test_reopen_shows_no_uncommitted_reservation(t, p)),
]


@pytest.mark.parametrize(
    ("cls", "check"),
    BROKEN_STORAGE,
    ids=[f"{c.__name__}-{i}" for i, (c, _) in enumerate(BROKEN_STORAGE)],
)
async def test_hooks_catch_a_tier_that_breaks_its_storage(
    cls: type[Tier], check: DiskCheck, tmp_path: Path
) -> None:
    """Each of these tiers passes for itself; the back door or the reopen shows the lie."""
    tier = cls()
    await SUITE.test_round_trip_small(tier, "bytes")
    with pytest.raises(FAILED):
        await check(DISK_SUITE, cls(), tmp_path)


async def test_the_storage_checks_say_which_hook_is_missing(tmp_path: Path) -> None:
    """Without the hooks, the reopen and back-door tests skip, naming the hook to define."""
    with pytest.raises(pytest.skip.Exception, match="does not define reopen_tier"):
        await SUITE.test_reopen_keeps_what_was_stored(ForgetsOnReopen(), tmp_path)
    with pytest.raises(pytest.skip.Exception, match="does not define raw_get and raw_put"):
        await SUITE.test_backing_storage_holds_what_put_stored(CachesInsteadOfStoring(), 10)


Check = Callable[[TierTests, Tier], Awaitable[None]]

BROKEN: list[tuple[type[Tier], Check]] = [
    (TornWrites, lambda s, t: s.test_reader_never_sees_a_partial_blob(t)),
    (ListsTemporaries, lambda s, t: s.test_list_never_shows_temporary_files(t)),
    (SkipsKeyValidation, lambda s, t: s.test_invalid_keys_are_rejected(t, "a/../b")),
    (KeepsCallersBuffer, lambda s, t: s.test_put_takes_a_snapshot(t)),
    (IgnoresClose, lambda s, t: s.test_use_after_aclose_raises_tier_closed(t)),
    (ListsOtherPrefixes, lambda s, t: s.test_list_by_prefix_with_nested_keys(t)),
    (RecyclesTooEarly, lambda s, t: s.test_reserved_buffer_survives_delete_and_reuse(t)),
    (RangeOffByOne, lambda s, t: s.test_get_range_returns_the_slice(t)),
    (RangeNotClipped, lambda s, t: s.test_get_range_is_clipped_at_the_end(t)),
]


@pytest.mark.parametrize(("cls", "check"), BROKEN, ids=[c.__name__ for c, _ in BROKEN])
async def test_suite_fails_a_broken_tier(cls: type[Tier], check: Check) -> None:
    """Each broken tier fails the conformance test aimed at its bug."""
    tier = cls()
    with pytest.raises(FAILED):
        await check(SUITE, tier)


async def test_suite_fails_a_range_read_that_finds_a_missing_key() -> None:
    """An empty range of a missing key must still be BlobNotFound."""
    with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
        await SUITE.test_get_range_of_a_missing_key(RangeOfNothingIsFound())


async def test_suite_fails_a_non_idempotent_delete() -> None:
    """A delete that raises for a missing key fails the idempotent-delete test."""
    with pytest.raises(KeyError):
        await SUITE.test_delete_is_idempotent(DeleteRaisesWhenMissing())


@pytest.mark.parametrize("cls", [cls for cls, _ in BROKEN], ids=lambda c: c.__name__)
async def test_broken_tiers_pass_the_other_checks(cls: type[Tier]) -> None:
    """The broken tiers are otherwise sound: a plain round trip works (the bug is targeted)."""
    tier = cls()
    await SUITE.test_round_trip_small(tier, "bytes")


# --- the state machine: tiers with a bug that no single call shows --------------------------


class RecyclesHeldBuffers(SharedDictTier):
    """Hands a buffer out again as soon as its key is deleted, although it is still held."""

    def __init__(self, disk: dict[str, bytes] | None = None) -> None:
        super().__init__(disk)
        self.held: list[DictReservation] = []

    async def reserve(self, key: str, nbytes: int) -> DictReservation:
        reservation = await super().reserve(key, nbytes)
        self.held.append(reservation)
        release = reservation.release

        def release_and_forget() -> None:
            self.held.remove(reservation)
            release()

        reservation.release = release_and_forget  # type: ignore[method-assign]
        return reservation

    async def delete(self, key: str) -> None:
        await super().delete(key)
        for reservation in self.held:
            if reservation.key == key:
                self.pool.insert(0, reservation.buffer.obj)  # type: ignore[arg-type]


class RemembersTheFirstSize(SharedDictTier):
    """Answers get_size from what a key first held, not what it holds."""

    async def get_size(self, key: str) -> int:
        sizes: dict[str, int] = self.__dict__.setdefault("sizes", {})
        return sizes.setdefault(key, await super().get_size(key))


class PutvKeepsTheFirstPart(SharedDictTier):
    """Stores only the first part of a putv."""

    async def putv(self, key: str, parts: Any) -> None:
        await self.put(key, parts[0] if parts else b"")


class AbortPublishes(SharedDictTier):
    """Publishes an aborted reservation."""

    async def reserve(self, key: str, nbytes: int) -> DictReservation:
        reservation = await super().reserve(key, nbytes)

        async def abort() -> None:
            await reservation.commit()

        reservation.abort = abort  # type: ignore[method-assign]
        return reservation


class WritesBackOnClose(SharedDictTier):
    """Keeps a copy of every put and writes it back on close, forgetting deletes: a blob
    deleted before a reopen comes back."""

    async def put(self, key: str, data: Buffer) -> None:
        await super().put(key, data)
        self.__dict__.setdefault("written", {})[key] = self.blobs[key]

    async def aclose(self) -> None:
        self.blobs.update(self.__dict__.get("written", {}))
        await super().aclose()


BUGGY = [RecyclesHeldBuffers, RemembersTheFirstSize, PutvKeepsTheFirstPart, AbortPublishes]
BUGGY_ON_REOPEN = [DeletesOnlyInMemory, WritesBackOnClose, ForgetsOnReopen]


class BugHunt(TierStateMachine):
    """One key and small blobs: every step meets the others on it."""

    keys = ("k",)
    max_size = 64


def _hunt(cls: type[SharedDictTier]) -> BugHunt:
    return BugHunt(
        lambda folder: cls(),
        reopen_tier=lambda tier, folder: cls(tier.blobs),  # type: ignore[attr-defined]
    )


@pytest.mark.parametrize("cls", BUGGY + BUGGY_ON_REOPEN, ids=lambda c: c.__name__)
def test_the_machine_catches_a_tier_that_drifts_from_the_dict(cls: type[SharedDictTier]) -> None:
    """Each of these tiers answers single calls plausibly; a sequence of steps shows the bug."""
    with pytest.raises(AssertionError):
        run_state_machine_as_test(lambda: _hunt(cls), settings=SEARCH)


# A short sequence that shows each bug, as (rule, arguments). The search above finds these
# (or longer ones) by itself; these pin down that the machine's invariants see the bug, whatever
# examples Hypothesis draws in a given session (its generation also draws on constants it finds
# in the loaded modules, so the number of examples a search needs varies from run to run).
SHORT: dict[type[SharedDictTier], list[tuple[str, tuple[object, ...]]]] = {
    RecyclesHeldBuffers: [
        ("reserve", (0, 10, 1, "hold")),
        ("delete", (0,)),
        ("reserve", (0, 10, 2, "commit")),
    ],
    RemembersTheFirstSize: [("put", (0, 10, 1)), ("put", (0, 20, 2))],
    PutvKeepsTheFirstPart: [("putv", (0, [20, 20], 1))],
    AbortPublishes: [("reserve", (0, 10, 1, "abort"))],
    DeletesOnlyInMemory: [("put", (0, 10, 1)), ("delete", (0,)), ("reopen", ())],
    WritesBackOnClose: [("put", (0, 10, 1)), ("delete", (0,)), ("reopen", ())],
    ForgetsOnReopen: [("put", (0, 10, 1)), ("reopen", ())],
}


def _steps(machine: BugHunt, steps: list[tuple[str, tuple[object, ...]]]) -> None:
    """Take ``steps`` and check the machine's invariants after each, as Hypothesis would."""
    try:
        for rule, args in steps:
            getattr(machine, rule)(*args)
            machine.every_key_reads_back_its_value()
            machine.listing_matches()
            machine.held_buffers_keep_their_bytes()
    finally:
        machine.teardown()


@pytest.mark.parametrize("cls", list(SHORT), ids=lambda c: c.__name__)
def test_a_short_sequence_shows_the_bug(cls: type[SharedDictTier]) -> None:
    """The sequence passes the correct tier and fails the broken one."""
    _steps(_hunt(SharedDictTier), SHORT[cls])
    with pytest.raises(AssertionError):
        _steps(_hunt(cls), SHORT[cls])


@pytest.mark.parametrize("cls", BUGGY_ON_REOPEN, ids=lambda c: c.__name__)
def test_those_that_lose_data_only_on_reopen_pass_without_it(cls: type[SharedDictTier]) -> None:
    """(So it is the reopen step that catches them.)"""
    run_state_machine_as_test(lambda: BugHunt(lambda folder: cls()), settings=PASS)
