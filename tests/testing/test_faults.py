"""FaultPlan and FaultyTier: numbered writes, death, one-off faults, abilities kept."""

from __future__ import annotations

from pathlib import Path

import pytest

from tiercheck.testing import TierTests
from tiercheck.testing.faults import FaultPlan, FaultyTier, InjectedFault, SimulatedCrash
from tiercheck.tiers import (
    LocalTier,
    PersistentTier,
    SupportsPrepare,
    SupportsRangedGet,
    SupportsReserve,
    Tier,
)


class TestFaultyTierWithAPlanThatNeverFires(TierTests):
    """Wrapped under a plan that never fires, the local tier keeps the whole contract."""

    async def make_tier(self, tmp_path: Path) -> Tier:
        return FaultyTier(LocalTier(tmp_path / "local"), FaultPlan())

    async def reopen_tier(self, tier: Tier, tmp_path: Path) -> Tier:
        return FaultyTier(LocalTier(tmp_path / "local"), FaultPlan())

    async def raw_get(self, tier: Tier, key: str) -> bytes:
        return (tmp_root(tier) / key).read_bytes()

    async def raw_put(self, tier: Tier, key: str, data: bytes) -> None:
        path = tmp_root(tier) / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def tmp_root(tier: Tier) -> Path:
    assert isinstance(tier, FaultyTier)
    assert isinstance(tier.inner, LocalTier)
    return tier.inner.root


def stored(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in root.rglob("*")
        if p.is_file() and "#" not in p.as_posix()
    }


async def test_writes_are_numbered_across_tiers_until_death(tmp_path: Path) -> None:
    """Writes of every wrapped tier count in one sequence; from die_at on, nothing is done,
    reads included, and storage stays as it was at the moment of death."""
    plan = FaultPlan(die_at=4)
    local = FaultyTier(LocalTier(tmp_path / "local"), plan)
    durable = FaultyTier(PersistentTier((tmp_path / "durable").as_uri()), plan)
    await local.put("a", b"1")
    await durable.putv("b", [b"2", b"3"])
    reservation = await local.reserve("c", 1)
    reservation.buffer[:] = b"4"
    await reservation.commit()
    reservation.release()
    before = stored(tmp_path)
    with pytest.raises(SimulatedCrash):
        await durable.delete("b")
    assert plan.dead
    for call in (lambda: local.put("d", b"5"), lambda: local.get("a"), lambda: durable.exists("b")):
        with pytest.raises(SimulatedCrash):
            await call()
    with pytest.raises(SimulatedCrash):
        await local.prepare(10)
    assert stored(tmp_path) == before
    assert [(n, op, tier, key) for n, op, tier, key in plan.log] == [
        (1, "put", "local", "a"),
        (2, "put", "persistent", "b"),
        (3, "commit", "local", "c"),
        (4, "delete", "persistent", "b"),
    ]
    # Closing stores nothing and stays possible after death.
    await local.aclose()
    await durable.aclose()
    assert local.inner.closed
    assert durable.inner.closed


async def test_a_one_off_fault_fails_once(tmp_path: Path) -> None:
    """An operation in fail_at raises InjectedFault (an OSError), changes nothing, and the
    same call succeeds when tried again."""
    plan = FaultPlan(fail_at={2})
    tier = FaultyTier(LocalTier(tmp_path / "local"), plan)
    await tier.put("k", b"old")
    with pytest.raises(InjectedFault) as info:
        await tier.put("k", b"new")
    assert isinstance(info.value, OSError)
    assert bytes(await tier.get("k")) == b"old"
    await tier.put("k", b"new")
    assert bytes(await tier.get("k")) == b"new"
    assert not plan.dead
    await tier.aclose()


async def test_die_on_picks_the_operation_and_on_death_runs_once(tmp_path: Path) -> None:
    deaths: list[int] = []
    plan = FaultPlan(
        die_on=lambda op, tier, key: op == "commit" and key.startswith("v2/"),
        on_death=lambda: deaths.append(len(deaths)),
    )
    tier = FaultyTier(LocalTier(tmp_path / "local"), plan)
    for version in (1, 2):
        reservation = await tier.reserve(f"v{version}/blob", 3)
        reservation.buffer[:] = b"abc"
        try:
            await reservation.commit()
        except SimulatedCrash:
            await reservation.abort()  # aborting stores nothing: allowed after death
        finally:
            reservation.release()
    assert deaths == [0]
    assert plan.dead
    assert stored(tmp_path / "local") == {"v1/blob": b"abc"}
    await tier.aclose()


def test_a_faulty_tier_has_the_abilities_of_its_inner_tier(tmp_path: Path) -> None:
    plan = FaultPlan()
    local = FaultyTier(LocalTier(tmp_path / "local"), plan)
    durable = FaultyTier.wrap(PersistentTier((tmp_path / "durable").as_uri()), plan)
    assert isinstance(local, SupportsReserve)
    assert isinstance(local, SupportsPrepare)
    assert not isinstance(durable, SupportsReserve)
    assert not isinstance(durable, SupportsPrepare)
    assert (local.name, durable.name) == ("local", "persistent")


async def test_ranged_reads_are_reads_of_the_plan(tmp_path: Path) -> None:
    """get_range goes through the plan like get: it works while alive, fails once dead."""
    plan = FaultPlan(die_on=lambda op, tier, key: op == "delete")
    tier = FaultyTier(PersistentTier((tmp_path / "durable").as_uri()), plan)
    assert isinstance(tier, SupportsRangedGet)
    await tier.put("k", b"0123456789")
    assert bytes(await tier.get_range("k", 2, 5)) == b"234"
    with pytest.raises(SimulatedCrash):
        await tier.delete("k")
    with pytest.raises(SimulatedCrash):
        await tier.get_range("k", 2, 5)
    await tier.aclose()
