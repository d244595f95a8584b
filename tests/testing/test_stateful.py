"""TierStateMachine: passes correct tiers (built from a factory or by subclassing), and fails
tiers that break the contract in ways only a sequence of steps shows.

The built-in tiers run it next to their own tests: tests/tiers/test_local.py (with the local
tier's accounting as extra invariants) and tests/tiers/test_persistent.py (file://, memory://).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from tests.tiers.dict_tier import DictTier
from tests.tiers.test_suite_catches_bugs import DeletesOnlyInMemory, DictReservation, SharedDictTier
from tiercheck.testing import TierStateMachine
from tiercheck.tiers import Buffer, Tier

# Fixed examples, so that "the machine finds the bug" is a property of the code, not of luck;
# no shrinking (finding is the point here, and shrinking a stateful run takes long), one bug.
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


class SharedDictMachine(TierStateMachine):
    """The subclass way: a reserving dict tier over a dict that outlives it, reopened."""

    async def make_tier(self, folder: Path) -> Tier:
        return SharedDictTier()

    async def reopen_tier(self, tier: Tier, folder: Path) -> Tier:
        assert isinstance(tier, SharedDictTier)
        return type(tier)(tier.blobs)


TestSharedDictMachine = SharedDictMachine.TestCase


def test_the_plugin_dict_tier_behaves_like_a_dict() -> None:
    """The factory way, with the third-party dict tier (no reserve, no reopen)."""
    run_state_machine_as_test(lambda: TierStateMachine(lambda folder: DictTier()))


def test_async_factories_and_the_reopen_step_are_used() -> None:
    """Coroutine factories work, and a machine that can reopen does take that step."""
    reopened: list[int] = []

    async def make(folder: Path) -> Tier:
        return SharedDictTier()

    async def reopen(tier: Tier, folder: Path) -> Tier:
        assert isinstance(tier, SharedDictTier)
        assert tier.closed
        reopened.append(1)
        return SharedDictTier(tier.blobs)

    run_state_machine_as_test(lambda: TierStateMachine(make, reopen_tier=reopen), settings=SEARCH)
    assert reopened


def test_a_machine_without_a_tier_says_what_it_needs() -> None:
    with pytest.raises(NotImplementedError, match="make_tier"):
        TierStateMachine()


def test_a_factory_must_return_a_tier() -> None:
    with pytest.raises(TypeError, match="not a Tier"):
        TierStateMachine(lambda folder: object())  # type: ignore[arg-type,return-value]


# --- tiers with a bug that no single call shows -------------------------------------------------


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
BUGGY_ON_REOPEN = [DeletesOnlyInMemory, WritesBackOnClose]


class BugHunt(TierStateMachine):
    """One key and small blobs: every step meets the others on it."""

    keys = ("k",)
    max_size = 64


@pytest.mark.parametrize("cls", BUGGY + BUGGY_ON_REOPEN, ids=lambda c: c.__name__)
def test_the_machine_catches_a_tier_that_drifts_from_the_dict(cls: type[SharedDictTier]) -> None:
    """Each of these tiers answers single calls plausibly; a sequence of steps shows the bug."""

    def machine() -> TierStateMachine:
        return BugHunt(
            lambda folder: cls(),
            reopen_tier=lambda tier, folder: cls(tier.blobs),  # type: ignore[attr-defined]
        )

    with pytest.raises(AssertionError):
        run_state_machine_as_test(machine, settings=SEARCH)


@pytest.mark.parametrize("cls", BUGGY_ON_REOPEN, ids=lambda c: c.__name__)
def test_those_that_lose_data_only_on_reopen_pass_without_it(cls: type[SharedDictTier]) -> None:
    """(So it is the reopen step that catches them.)"""
    run_state_machine_as_test(lambda: BugHunt(lambda folder: cls()), settings=SEARCH)
