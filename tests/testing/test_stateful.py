"""TierStateMachine: passes correct tiers, built from a factory or by subclassing.

That it fails tiers that break the contract in ways only a sequence of steps shows is proved
with the kit's other bug hunts, in tests/tiers/test_suite_catches_bugs.py.

The built-in tiers run it next to their own tests: tests/tiers/test_local.py (with the local
tier's accounting as extra invariants) and tests/tiers/test_persistent.py (file://, memory://).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis.stateful import run_state_machine_as_test

from tests.tiers.dict_tier import DictTier
from tests.tiers.test_suite_catches_bugs import PASS, SharedDictTier
from tiercheck.testing import TierStateMachine
from tiercheck.tiers import Tier


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

    run_state_machine_as_test(lambda: TierStateMachine(make, reopen_tier=reopen), settings=PASS)
    assert reopened


def test_a_machine_without_a_tier_says_what_it_needs() -> None:
    with pytest.raises(NotImplementedError, match="make_tier"):
        TierStateMachine()


def test_a_factory_must_return_a_tier() -> None:
    with pytest.raises(TypeError, match="not a Tier"):
        TierStateMachine(lambda folder: object())  # type: ignore[arg-type,return-value]
