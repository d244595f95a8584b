"""DelegatingTier: forwards every operation and exactly the inner tier's optional abilities."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tiercheck import Checkpointer
from tiercheck.errors import BlobNotFound, InvalidKey, TierClosed
from tiercheck.testing import TierTests
from tiercheck.tiers import (
    DelegatingTier,
    FailureScope,
    LocalTier,
    PersistentTier,
    SupportsPrepare,
    SupportsRangedGet,
    SupportsReserve,
    Tier,
)
from tiercheck.tiers.base import SupportsStopServing

from .dict_tier import DictTier


class TestDelegatingLocalTier(TierTests):
    """A wrapped local tier keeps the whole contract, reserve included."""

    async def make_tier(self, tmp_path: Path) -> Tier:
        return DelegatingTier(LocalTier(tmp_path / "local"))

    async def reopen_tier(self, tier: Tier, tmp_path: Path) -> Tier:
        return DelegatingTier(LocalTier(tmp_path / "local"))

    async def raw_get(self, tier: Tier, key: str) -> bytes:
        return (tier.inner.root / key).read_bytes()  # type: ignore[attr-defined]

    async def raw_put(self, tier: Tier, key: str, data: bytes) -> None:
        path = tier.inner.root / key  # type: ignore[attr-defined]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


class TestDelegatingPersistentTier(TierTests):
    """A wrapped persistent tier (no optional abilities) keeps the whole contract."""

    async def make_tier(self, tmp_path: Path) -> Tier:
        return DelegatingTier(PersistentTier((tmp_path / "durable").as_uri()))

    async def reopen_tier(self, tier: Tier, tmp_path: Path) -> Tier:
        return DelegatingTier(PersistentTier((tmp_path / "durable").as_uri()))


class _Serving(DictTier):
    """A tier with the stop_serving ability (as the peer tier has)."""

    stopped = False

    async def stop_serving(self, timeout: float | None = None) -> bool:
        self.stopped = True
        return True


class Recording(DelegatingTier):
    """Records every operation it forwards; refuses those in ``refuse``."""

    def __init__(self, inner: Tier, refuse: frozenset[str] = frozenset()) -> None:
        super().__init__(inner, name="recording")
        self.ops: list[tuple[str, str]] = []
        self.refuse = refuse

    async def before(self, op: str, key: str) -> None:
        self.ops.append((op, key))
        if op in self.refuse:
            raise PermissionError(f"{op} refused")


def test_abilities_follow_the_inner_tier(tmp_path: Path) -> None:
    """reserve and prepare only over a tier that has them, stop_serving likewise; nesting and
    subclasses keep them; name and survives default to the inner tier's."""
    local = DelegatingTier(LocalTier(tmp_path / "local"))
    durable = DelegatingTier(PersistentTier((tmp_path / "durable").as_uri()))
    serving = DelegatingTier(_Serving())
    nested = Recording(DelegatingTier(LocalTier(tmp_path / "other")))
    assert isinstance(local, SupportsReserve)
    assert isinstance(local, SupportsPrepare)
    assert not isinstance(local, SupportsStopServing)
    assert not isinstance(durable, (SupportsReserve, SupportsPrepare, SupportsStopServing))
    assert isinstance(serving, SupportsStopServing)
    assert not isinstance(serving, SupportsReserve)
    assert isinstance(local, SupportsRangedGet)
    assert isinstance(durable, SupportsRangedGet)
    assert isinstance(nested, SupportsRangedGet)
    assert not isinstance(serving, SupportsRangedGet)
    assert isinstance(nested, Recording)
    assert isinstance(nested, SupportsReserve)
    assert isinstance(nested, SupportsPrepare)
    assert (local.name, local.survives) == ("local", FailureScope.PROCESS)
    assert (durable.name, durable.survives) == ("persistent", FailureScope.CLUSTER)
    assert nested.name == "recording"
    assert type(nested).__name__ == "Recording"
    renamed = DelegatingTier(DictTier(), name="memo", survives=FailureScope.NODE)
    assert (renamed.name, renamed.survives) == ("memo", FailureScope.NODE)


def test_only_a_tier_can_be_wrapped() -> None:
    with pytest.raises(TypeError):
        DelegatingTier(object())  # type: ignore[arg-type]


async def test_before_sees_every_operation_in_order(tmp_path: Path) -> None:
    """Every forwarded call goes through before(op, key) first, reservations included."""
    tier = Recording(LocalTier(tmp_path / "local"))
    assert isinstance(tier, SupportsReserve)
    assert isinstance(tier, SupportsPrepare)
    async with tier:
        await tier.put("a", b"1")
        await tier.putv("b/c", [b"2", b"3"])
        assert bytes(await tier.get("b/c")) == b"23"
        assert bytes(await tier.get_range("b/c", 1, 5)) == b"3"
        assert await tier.get_size("a") == 1
        assert await tier.exists("a")
        assert [k async for k in tier.list("b/")] == ["b/c"]
        await tier.delete("a")
        assert await tier.prepare(4)
        kept = await tier.reserve("r", 4)
        kept.buffer[:] = b"abcd"
        await kept.commit()
        kept.release()
        dropped = await tier.reserve("s", 2)
        await dropped.abort()
        dropped.release()
        assert bytes(await tier.inner.get("r")) == b"abcd"
    assert tier.ops == [
        ("put", "a"),
        ("putv", "b/c"),
        ("get", "b/c"),
        ("get_range", "b/c"),
        ("get_size", "a"),
        ("exists", "a"),
        ("list", "b/"),
        ("delete", "a"),
        ("prepare", ""),
        ("reserve", "r"),
        ("commit", "r"),
        ("reserve", "s"),
        ("abort", "s"),
    ]
    assert tier.inner.closed, "closing the wrapper closes the inner tier"


async def test_stop_serving_is_forwarded() -> None:
    inner = _Serving()
    tier = Recording(inner)
    assert isinstance(tier, SupportsStopServing)
    assert await tier.stop_serving(1.0)
    assert inner.stopped
    assert tier.ops == [("stop_serving", "")]


async def test_before_can_refuse_an_operation(tmp_path: Path) -> None:
    """What before refuses never reaches the inner tier: nothing changes there."""
    inner = LocalTier(tmp_path / "local")
    tier = Recording(inner, refuse=frozenset({"delete", "commit", "putv"}))
    async with tier:
        await tier.put("k", b"kept")
        with pytest.raises(PermissionError):
            await tier.delete("k")
        with pytest.raises(PermissionError):
            await tier.putv("k", [b"new"])
        reservation = await tier.reserve("r", 3)
        reservation.buffer[:] = b"xyz"
        with pytest.raises(PermissionError):
            await reservation.commit()
        await reservation.abort()
        reservation.release()
        assert bytes(await inner.get("k")) == b"kept"
        assert not await inner.exists("r")
        assert [k async for k in inner.list()] == ["k"]


async def test_invalid_keys_and_a_closed_wrapper_never_reach_before() -> None:
    """The wrapper checks the key and its own state first (before counts nothing for them)."""
    tier = Recording(DictTier())
    with pytest.raises(InvalidKey):
        await tier.put("a/../b", b"x")
    with pytest.raises(InvalidKey):
        await tier.get("")
    await tier.aclose()
    with pytest.raises(TierClosed):
        await tier.get("k")
    with pytest.raises(TierClosed):
        [k async for k in tier.list()]
    assert tier.ops == []


async def test_the_checkpointer_finds_the_storing_tier_through_inner(tmp_path: Path) -> None:
    """The durable location a job's memory is recorded under is the inner tier's URL.

    Shown where it decides something: the durable folder is emptied between two runs, and the
    memory still holds the job's checkpoints. The next run, through the plain tier (or the
    wrapped one after a plain run), recognises that memory as written at *this* location and
    restores from it, where a location named after the wrapper would make it another run's.
    """
    url = (tmp_path / "durable").as_uri()
    local_root = tmp_path / "shm"

    def tiers(wrapped: bool) -> list[Tier]:
        durable: Tier = PersistentTier(url)
        return [
            LocalTier(local_root / "blobs"),
            Recording(DelegatingTier(durable)) if wrapped else durable,
        ]

    for step, wrapped in enumerate([True, False, True]):
        async with Checkpointer("job", local_root=local_root, tiers=tiers(wrapped)) as ckpt:
            restored = await ckpt.restore()
            assert (restored.version if restored else None) == (step - 1 if step else None)
            await (await ckpt.save(step, {"w": torch.full((8,), float(step))})).result_async()
        shutil.rmtree(tmp_path / "durable")


async def test_a_missing_key_is_the_inner_tiers_answer() -> None:
    tier = DelegatingTier(DictTier())
    with pytest.raises(BlobNotFound):
        await tier.get("missing")
    assert not await tier.exists("missing")
