"""The Checkpointer on one node: save, commit, retention, restore, fallbacks, errors."""

from __future__ import annotations

import asyncio
import inspect
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import tiercheck
from tiercheck import (
    Checkpointer,
    ConfigError,
    RestoreError,
    SaveSkipped,
    StateMismatch,
    SyncCheckpointer,
    TierClosed,
    TierNotTargeted,
    TierWriteFailed,
    UnsupportedObject,
    VersionError,
)
from tiercheck.consistency.keys import parse_blob_key
from tiercheck.consistency.manifest import Manifest
from tiercheck.testing.faults import FaultPlan, FaultyTier, abandon
from tiercheck.tiers import DelegatingTier, FailureScope, LocalTier, PersistentTier, Tier

from .helpers import TinyTrainer, assert_state_equal, clone_state


def _ckpt(tmp_path: Path, **kw: Any) -> Checkpointer:
    kw.setdefault("local_root", tmp_path / "shm")
    kw.setdefault("persistent", (tmp_path / "durable").as_uri())
    return Checkpointer("job", **kw)


def _damage(path: Path) -> None:
    """Flip one bit in the middle of a stored file."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def _blobs_of(root: Path, version: int) -> list[Path]:
    """Every stored blob file of ``version`` under ``root``, whatever the tier."""
    return [p for p in root.rglob(f"v{version:012d}/r*") if p.is_file()]


def _keys(root: Path) -> list[str]:
    return sorted(
        str(p.relative_to(root))
        for p in root.rglob("*")
        if p.is_file() and not p.name.startswith(".")
    )


async def test_save_then_restore_is_bit_exact(tmp_path: Path) -> None:
    t = TinyTrainer()
    saved = {}
    async with _ckpt(tmp_path, base_every=3) as ckpt:
        for step in range(7):
            t.step()
            handle = await ckpt.save(step, t.state())
            saved[step] = clone_state(t.state())
            await handle.result_async("local")
        await ckpt.wait()
    async with _ckpt(tmp_path) as again:
        restored = await again.restore()
    assert restored is not None
    assert restored.version == 6
    assert restored.source_tier == "local"
    assert restored.source_tiers == {0: "local"}
    assert_state_equal(restored.state, saved[6])


async def test_a_restored_rng_state_can_be_set_directly(tmp_path: Path) -> None:
    # torch.set_rng_state reads a state tensor from the start of its storage: a view at an
    # offset into the shared payload would fail or set the wrong state.
    torch.manual_seed(7)
    big = torch.randn(100_000)  # larger than OWN_STORAGE_BYTES: stays a view, placed first
    state = {"big": big, "rng": torch.get_rng_state()}
    expected = torch.rand(5)
    async with _ckpt(tmp_path) as ckpt:
        await ckpt.save(0, state)
        await ckpt.wait()
    for tiers in (["local", "persistent"], ["persistent"]):
        async with _ckpt(tmp_path, tiers=tiers) as again:
            restored = await again.restore()
        assert restored is not None
        assert restored.source_tier == tiers[0]
        rng = restored.state["rng"]
        assert rng.storage_offset() == 0
        torch.set_rng_state(rng)
        assert torch.equal(torch.rand(5), expected)
        assert torch.equal(restored.state["big"], big)


async def test_state_may_change_as_soon_as_save_returns(tmp_path: Path) -> None:
    x = torch.arange(1000, dtype=torch.float32)
    async with _ckpt(tmp_path) as ckpt:
        handle = await ckpt.save(0, {"x": x})
        x.fill_(-1.0)  # training goes on before the pipeline has finished
        await handle.result_async()
        restored = await ckpt.restore()
    assert restored is not None
    assert torch.equal(restored.state["x"], torch.arange(1000, dtype=torch.float32))


async def test_restore_in_place_keeps_the_callers_tensors(tmp_path: Path) -> None:
    t = TinyTrainer()
    async with _ckpt(tmp_path) as ckpt:
        t.step()
        await (await ckpt.save(1, t.state())).result_async()
        expected = clone_state(t.state())
        params = list(t.model.parameters())
        t.step()  # move away from the saved point
        target = t.state()
        restored = await ckpt.restore(target)
    assert restored is not None
    assert restored.state is target
    assert all(a is b for a, b in zip(params, t.model.parameters(), strict=True))
    assert_state_equal(t.model.state_dict(), expected["model"])
    assert_state_equal(t.opt.state_dict()["state"], expected["optim"]["state"])


async def test_deltas_through_the_packed_tier_restore_bit_exact(tmp_path: Path) -> None:
    t = TinyTrainer()
    saved = {}
    # A deep queue: this test is about deltas, not about shedding load on a busy machine.
    async with _ckpt(
        tmp_path, base_every=4, persist="all", keep={"persistent": 10}, tier_queue=64
    ) as ckpt:
        for step in range(9):
            t.step()
            await ckpt.save(step, t.state())
            saved[step] = clone_state(t.state())
        await ckpt.wait()
        stats = ckpt.stats
    assert stats.committed["persistent"] == 9
    # Lose the node: a new checkpointer with an empty local root reads the durable tier.
    async with _ckpt(tmp_path, local_root=tmp_path / "new-node", persist="all") as fresh:
        restored = await fresh.restore()
    assert restored is not None
    assert restored.version == 8
    assert restored.source_tier == "persistent"
    assert_state_equal(restored.state, saved[8])


async def test_node_loss_restores_the_newest_persistent_base(tmp_path: Path) -> None:
    t = TinyTrainer()
    saved = {}
    async with _ckpt(tmp_path, base_every=3) as ckpt:
        for step in range(8):
            t.step()
            await ckpt.save(step, t.state())
            saved[step] = clone_state(t.state())
        await ckpt.wait()
    async with _ckpt(tmp_path, local_root=tmp_path / "new-node") as fresh:
        restored = await fresh.restore()
    assert restored is not None
    assert restored.version == 6  # bases: 0, 3, 6
    assert_state_equal(restored.state, saved[6])


async def test_a_corrupt_local_blob_falls_back_to_the_next_tier(tmp_path: Path) -> None:
    state = {"w": torch.randn(4096)}
    async with _ckpt(tmp_path, base_every=1) as ckpt:
        await (await ckpt.save(0, state)).result_async()
    _damage(next((tmp_path / "shm" / "blobs").rglob("r00000.full")))
    async with _ckpt(tmp_path) as again:
        restored = await again.restore()
        assert again.stats.restore_fallbacks == 1
    assert restored is not None
    assert restored.source_tier == "persistent"
    assert torch.equal(restored.state["w"], state["w"])


async def test_a_version_corrupt_everywhere_gives_way_to_an_older_one(tmp_path: Path) -> None:
    async with _ckpt(tmp_path, base_every=1, keep=3) as ckpt:
        for v in range(3):
            await (await ckpt.save(v, {"w": torch.full((100,), float(v))})).result_async()
    for blob in _blobs_of(tmp_path, 2):
        _damage(blob)
    async with _ckpt(tmp_path) as again:
        restored = await again.restore()
    assert restored is not None
    assert restored.version == 1
    assert torch.equal(restored.state["w"], torch.full((100,), 1.0))


async def test_retention_keeps_what_it_should(tmp_path: Path) -> None:
    async with _ckpt(tmp_path, base_every=4, keep={"local": 2, "persistent": 2}) as ckpt:
        for v in range(11):
            await ckpt.save(v, {"w": torch.full((64,), float(v))})
        await ckpt.wait()
        versions = await ckpt.versions()
    local = sorted({parse_blob_key(k).version for k in _keys(tmp_path / "shm" / "blobs")})  # type: ignore[union-attr]
    assert local == [9, 10]
    assert versions["local"] == [9, 10]
    assert versions["persistent"] == [4, 8]  # bases only, newest two
    durable = _keys(tmp_path / "durable" / "job")
    assert sorted(k for k in durable if k.startswith("v")) == sorted(
        [f"v{v:012d}/{n}" for v in (4, 8) for n in ("COMMIT", "r00000.packed")]
    )
    # Besides versions, only the job's own records: who it is, who writes it.
    assert {k.split("/")[0] for k in durable if not k.startswith("v")} == {"JOB", "writers"}


async def test_whole_versions_the_manifest_missed_are_kept_after_a_restore(tmp_path: Path) -> None:
    # A crash between a local commit and the manifest's record of it: the blobs are whole
    # in the tier, the manifest does not know. Modelled by losing the manifest outright.
    local_only: dict[str, Any] = {"tiers": ["local"], "keep": {"local": 2}}
    async with _ckpt(tmp_path, **local_only) as ckpt:
        for v in range(2):
            await ckpt.save(v, {"w": torch.full((64,), float(v))})
        await ckpt.wait()
    shutil.rmtree(tmp_path / "shm" / "manifest")

    async with _ckpt(tmp_path, **local_only) as again:
        restored = await again.restore()
        assert restored is not None
        assert restored.version == 1
        handle = await again.save(2, {"w": torch.full((64,), 2.0)})
        await handle.result_async("local")
        await again.wait()
        # Retention keeps the newest two: the restored version is one of them.
        assert (await again.versions())["local"] == [1, 2]
    assert sorted(p.parent.name for p in (tmp_path / "shm" / "blobs").rglob("r*.full")) == [
        f"v{v:012d}" for v in (1, 2)
    ]
    async with _ckpt(tmp_path, **local_only) as third:  # and the manifest now knows them
        assert (await third.versions())["local"] == [1, 2]


async def test_a_base_stays_while_a_kept_delta_needs_it(tmp_path: Path) -> None:
    async with _ckpt(
        tmp_path, base_every=5, persist="all", keep={"local": 1, "persistent": 2}
    ) as ckpt:
        for v in range(4):
            await ckpt.save(v, {"w": torch.full((64,), float(v))})
        await ckpt.wait()
        versions = await ckpt.versions()
    assert versions["persistent"] == [0, 2, 3]  # 0 stays: the base of the kept 2 and 3
    stored = _keys(tmp_path / "durable" / "job")
    assert "v000000000000/r00000.packed" in stored  # the base of 2 and 3
    assert "v000000000001/r00000.packed" not in stored


async def test_done_on_a_tier_the_version_skips_is_an_error_at_once(tmp_path: Path) -> None:
    async with _ckpt(tmp_path, base_every=2) as ckpt:
        base = await ckpt.save(0, {"w": torch.zeros(8)})
        delta = await ckpt.save(1, {"w": torch.ones(8)})
        assert base.tiers == ("local", "persistent")
        assert delta.tiers == ("local",)
        with pytest.raises(TierNotTargeted):
            await delta.result_async("persistent")
        with pytest.raises(TierNotTargeted):
            delta.result("nonexistent")
        await delta.result_async()
        assert delta.committed("local")


async def test_versions_must_increase(tmp_path: Path) -> None:
    async with _ckpt(tmp_path) as ckpt:
        await ckpt.save(5, {"w": torch.zeros(2)})
        for bad in (5, 4, -1, 1.5, True):
            with pytest.raises(VersionError):
                await ckpt.save(bad, {"w": torch.zeros(2)})  # type: ignore[arg-type]


async def test_a_fresh_run_over_stored_versions_is_refused_not_destroyed(tmp_path: Path) -> None:
    async with _ckpt(tmp_path) as ckpt:
        await ckpt.save(7, {"w": torch.zeros(2)})
    async with _ckpt(tmp_path) as again:
        with pytest.raises(VersionError):
            await again.save(3, {"w": torch.ones(2)})
        restored = await again.restore()
    assert restored is not None
    assert restored.version == 7


async def test_unsupported_state_is_a_typed_error_and_stores_nothing(tmp_path: Path) -> None:
    async with _ckpt(tmp_path) as ckpt:
        with pytest.raises(UnsupportedObject):
            await ckpt.save(0, {"w": torch.zeros(2), "bad": object()})
        await ckpt.save(0, {"w": torch.zeros(2)})  # the failed save did not consume the version
        await ckpt.wait()
        assert ckpt.stats.committed["local"] == 1


BAD_VERSIONS = ["20", "0", 20.0, True, False, -1, 10**12, None, np.int64(20)]


async def _settle(result: Any) -> Any:
    """The result of a call of either checkpointer (awaited where it is a coroutine)."""
    return await result if inspect.isawaitable(result) else result


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
async def test_a_version_that_is_not_an_int_is_refused_before_anything_opens(
    tmp_path: Path, sync: bool
) -> None:
    """``restore(version="20")`` once compared a string with ints ("version 20 cannot be
    rebuilt ... can rebuild [0, 10, 20]"); every bad version is a VersionError, on restore as
    on save, raised before the checkpointer opens (so before any exchange with other ranks)."""
    state = {"w": torch.arange(4.0)}
    kind = SyncCheckpointer if sync else Checkpointer
    durable = (tmp_path / "durable").as_uri()
    for bad in BAD_VERSIONS:
        fresh = kind("job", local_root=tmp_path / "shm", persistent=durable)
        with pytest.raises(VersionError, match=r"a version must be an int in \[0, "):
            await _settle(fresh.save(bad, state))  # type: ignore[arg-type]
        if bad is not None:  # restore(version=None) is the newest version
            with pytest.raises(VersionError, match=r"a version must be an int in \[0, "):
                await _settle(fresh.restore(version=bad))  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="strict"):
            await _settle(fresh.restore(strict="no"))  # type: ignore[arg-type]
        assert not fresh.opened, f"{bad!r}: the checkpointer was opened"
    assert not (tmp_path / "shm").exists()
    # The job itself is untouched by all this: it saves and restores as before.
    async with _ckpt(tmp_path) as ckpt:
        await ckpt.save(20, state)
        for bad in BAD_VERSIONS[:-2]:
            with pytest.raises(VersionError):
                await ckpt.restore(version=bad)  # type: ignore[arg-type]
        restored = await ckpt.restore(version=20)
    assert restored is not None
    assert restored.version == 20
    assert_state_equal(restored.state, state)


def test_bad_waits_and_closes_are_config_errors_and_the_job_goes_on(tmp_path: Path) -> None:
    """Timeouts that are not seconds, and close(flush="no") (which read as flush=True)."""
    state = {"w": torch.arange(3.0)}
    ckpt = SyncCheckpointer(
        "job", local_root=tmp_path / "shm", persistent=(tmp_path / "d").as_uri()
    )
    with ckpt:
        handle = ckpt.save(0, state)
        for bad in ("1", -1, float("nan"), True):
            with pytest.raises(ConfigError, match="timeout"):
                handle.result("local", timeout=bad)  # type: ignore[arg-type]
            with pytest.raises(ConfigError, match="timeout"):
                handle.staged(bad)  # type: ignore[arg-type]
            with pytest.raises(ConfigError, match="timeout"):
                ckpt.fence(bad)  # type: ignore[arg-type]
        for kw in ({"flush": "no"}, {"failed": 1}):
            with pytest.raises(ConfigError, match="must be True or False"):
                ckpt.close(**kw)  # type: ignore[arg-type]
        handle.result("local", timeout=60)
    with SyncCheckpointer(
        "job", local_root=tmp_path / "shm", persistent=(tmp_path / "d").as_uri()
    ) as again:
        restored = again.restore()
    assert restored is not None
    assert_state_equal(restored.state, state)


async def test_cyclic_deep_and_dataless_states_are_refused_and_the_job_goes_on(
    tmp_path: Path,
) -> None:
    """A list holding itself (a RecursionError before), containers nested absurdly deep, and
    tensors without data (stored silently with allow_pickle=True before): UnsupportedObject
    naming the path, whatever allow_pickle says, on save and as a restore target; a meta
    tensor as a restore target is a StateMismatch. Nothing is stored or written, the version
    is not used up, and the job restores bit-exact."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    loop: list[Any] = [torch.ones(2)]
    loop.append(loop)
    deep: dict[str, Any] = {}
    inner = deep
    for _ in range(2000):
        inner["d"] = {}
        inner = inner["d"]
    with FakeTensorMode():
        fake = torch.empty(3)
    replicated = tiercheck.Replicated(None)
    replicated.value = {"again": replicated}
    nested: list[tuple[Any, str]] = [
        ({"x": loop}, r"state\['x'\]\[1\]: it is state\['x'\] itself"),
        ({"r": replicated}, r"state\['r'\]\['again'\]: it is state\['r'\] itself"),
        ({"deep": deep}, "nested more than 100 deep"),
    ]
    dataless: list[tuple[Any, str]] = [
        ({"m": torch.empty(3, device="meta")}, r"state\['m'\]: a tensor on the meta device"),
        ({"p": torch.nn.Linear(2, 2, device="meta").weight}, "meta device"),
        ({"f": fake}, "fake tensor"),
    ]
    good = {"w": torch.randn(16), "step": 3}
    for allow_pickle in (False, True):
        root = tmp_path / f"pickle-{allow_pickle}"
        async with _ckpt(root, allow_pickle=allow_pickle, base_every=1) as ckpt:
            await ckpt.save(0, good)
            await ckpt.wait()
            stored = sorted(p for p in root.rglob("v0*/*") if p.is_file())
            for state, match in nested + dataless:
                with pytest.raises(UnsupportedObject, match=match):
                    await ckpt.save(1, state)
            for state, match in nested:
                with pytest.raises(UnsupportedObject, match=match):
                    await ckpt.restore(state)
            with pytest.raises(StateMismatch, match="meta device"):
                await ckpt.restore({"w": torch.empty(16, device="meta"), "step": 0})
            await ckpt.wait()
            assert sorted(p for p in root.rglob("v0*/*") if p.is_file()) == stored
            await ckpt.save(1, {"w": good["w"] + 1, "step": 4})  # version 1 is still free
        async with _ckpt(root, allow_pickle=allow_pickle) as again:
            restored = await again.restore()
        assert restored is not None
        assert restored.version == 1
        assert_state_equal(restored.state, {"w": good["w"] + 1, "step": 4})


async def test_restore_with_nothing_stored_returns_none(tmp_path: Path) -> None:
    async with _ckpt(tmp_path) as ckpt:
        assert await ckpt.restore() is None


async def test_restore_an_explicit_version(tmp_path: Path) -> None:
    async with _ckpt(tmp_path, base_every=1, keep=5) as ckpt:
        for v in range(4):
            await ckpt.save(v, {"v": torch.tensor(v)})
        await ckpt.wait()
        restored = await ckpt.restore(version=2)
        assert restored is not None
        assert int(restored.state["v"]) == 2
        with pytest.raises(RestoreError):
            await ckpt.restore(version=99)
        # A restore changes nothing stored: 3 is still there (the run may only be looking)...
        assert 3 in (await ckpt.versions())["local"]
        # ... until the run saves again and so continues the new timeline from 2.
        await ckpt.save(3, {"v": torch.tensor(33)})
        await ckpt.wait()
        again = await ckpt.restore()
    assert again is not None
    assert int(again.state["v"]) == 33


class _BrokenTier(DelegatingTier):
    """A durable tier that works when the job opens, then fails every write and read (a store
    that went down during training); exists and list still answer."""

    def __init__(self, inner: Tier) -> None:
        super().__init__(inner, name="persistent", survives=FailureScope.CLUSTER)
        self.down = False

    async def before(self, op: str, key: str) -> None:
        if self.down and op in ("put", "putv", "get", "get_size", "delete"):
            raise OSError("the store is down")


async def test_a_failing_tier_never_reaches_training(tmp_path: Path) -> None:
    local = LocalTier(tmp_path / "shm" / "blobs")
    broken = _BrokenTier(PersistentTier((tmp_path / "durable").as_uri()))
    async with _ckpt(tmp_path, tiers=[local, broken], base_every=1) as ckpt:
        broken.down = True
        handles = [await ckpt.save(v, {"w": torch.full((16,), float(v))}) for v in range(3)]
        for h in handles:
            await h.result_async("local")
            with pytest.raises(TierWriteFailed):
                await h.result_async("persistent")
            assert h.stats.tiers["persistent"].state == "failed"
        assert ckpt.stats.failed["persistent"] == 3
        restored = await ckpt.restore()
    assert restored is not None
    assert restored.version == 2


class _SlowTier(DelegatingTier):
    """A durable tier that takes its time to write (an overloaded object store)."""

    def __init__(self, inner: Tier, delay: float) -> None:
        super().__init__(inner, name="persistent", survives=FailureScope.CLUSTER)
        self.delay = delay

    async def before(self, op: str, key: str) -> None:
        if op in ("put", "putv"):
            await asyncio.sleep(self.delay)


async def test_a_slow_tier_never_stalls_saves_and_sheds_load(tmp_path: Path) -> None:
    slow = _SlowTier(PersistentTier((tmp_path / "durable").as_uri()), delay=0.5)
    local = LocalTier(tmp_path / "shm" / "blobs")
    async with _ckpt(tmp_path, tiers=[local, slow], base_every=1, tier_queue=1) as ckpt:
        started = time.perf_counter()
        handles = [await ckpt.save(v, {"w": torch.zeros(256)}) for v in range(6)]
        elapsed = time.perf_counter() - started
        await ckpt.wait()
    # Six saves did not wait for six slow writes (that would be 3 s).
    assert elapsed < 2.0
    states = [h.stats.tiers["persistent"].state for h in handles]
    assert "failed" in states  # some versions were dropped for the slow tier
    assert states[0] == "committed"
    assert all(h.stats.tiers["local"].state == "committed" for h in handles)


async def test_skip_policy_skips_and_counts(tmp_path: Path) -> None:
    slow_state = {"w": torch.randn(4_000_000)}
    async with _ckpt(tmp_path, on_busy="skip", base_every=1) as ckpt:
        handles = [await ckpt.save(v, slow_state) for v in range(6)]
        await ckpt.wait()
        skipped = [h for h in handles if h.skipped]
        assert ckpt.stats.skipped == len(skipped)
        assert skipped, "saving back to back with one encoding slot must skip some"
        with pytest.raises(SaveSkipped):
            await skipped[0].result_async()
        assert not handles[0].skipped


async def test_manifest_logs_durable_and_commit(tmp_path: Path) -> None:
    async with _ckpt(tmp_path, base_every=1) as ckpt:
        await (await ckpt.save(0, {"w": torch.zeros(4)})).result_async()
        await ckpt.wait()
    with Manifest(tmp_path / "shm" / "manifest") as m:
        ops = [(r.op, getattr(r, "tier", "")) for r in m.log()]
        assert ("durable", "local") in ops
        assert ("commit", "local") in ops
        assert ("commit", "persistent") in ops
        assert m.committed("persistent") == [0]


async def test_a_closed_checkpointer_refuses_use(tmp_path: Path) -> None:
    ckpt = _ckpt(tmp_path)
    await ckpt.open()
    await ckpt.aclose()
    with pytest.raises(TierClosed):
        await ckpt.save(0, {"w": torch.zeros(1)})


def test_bad_configuration_is_refused_before_any_io(tmp_path: Path) -> None:
    for kwargs in (
        {"base_every": 0},
        {"on_busy": "maybe"},
        {"keep": {"nonexistent": 2}},
        {"keep": 0},
        {"tiers": []},
        {"encodings": {"local": "zip"}},
    ):
        with pytest.raises(ConfigError):
            _ckpt(tmp_path, **kwargs)
    with pytest.raises(ConfigError):
        Checkpointer("a/b")
    assert not (tmp_path / "shm").exists()


def test_sync_checkpointer_round_trip(tmp_path: Path) -> None:
    t = TinyTrainer()
    with SyncCheckpointer(
        "job", local_root=tmp_path / "shm", persistent=(tmp_path / "durable").as_uri()
    ) as ckpt:
        assert ckpt.restore() is None
        for step in range(3):
            t.step()
            handle = ckpt.save(step, t.state())
        handle.result("local", timeout=30)
        expected = clone_state(t.state())
        t.step()
        restored = ckpt.restore(t.state())
    assert restored is not None
    assert restored.version == 2
    assert_state_equal(t.model.state_dict(), expected["model"])


async def test_a_crash_before_commit_restores_the_previous_version(tmp_path: Path) -> None:
    # Writes of version 0: local commit (1), persistent blob (2), COMMIT record (3).
    # The process dies at the 4th write after opening: publishing version 1 in the local tier.
    plan = FaultPlan()
    tiers: Sequence[Tier] = [
        FaultyTier.wrap(LocalTier(tmp_path / "shm" / "blobs"), plan),
        FaultyTier.wrap(PersistentTier((tmp_path / "durable").as_uri() + "/job"), plan),
    ]
    ckpt = _ckpt(tmp_path, tiers=tiers, base_every=1)
    await ckpt.open()  # writes records of its own (a probe, the job record, a writer's)
    opened = plan.count
    plan.die_at = opened + 4
    await (await ckpt.save(0, {"w": torch.zeros(32)})).result_async()
    handle = await ckpt.save(1, {"w": torch.ones(32)})
    with pytest.raises(TierWriteFailed):
        await handle.result_async("local")
    assert plan.dead
    assert [op for _, op, _, _ in plan.log[opened:]] == ["commit", "put", "put", "commit"]
    abandon(ckpt)
    async with _ckpt(tmp_path) as again:
        restored = await again.restore()
    assert restored is not None
    assert restored.version == 0
    assert torch.equal(restored.state["w"], torch.zeros(32))


def test_stats_are_a_copy_that_later_saves_do_not_change(tmp_path: Path) -> None:
    """``ckpt.stats`` is a snapshot: its per-tier figures are its own (they were the live
    dictionaries, so an older snapshot changed under its reader, and writing to one changed
    the checkpointer's)."""
    with SyncCheckpointer("job", local_root=tmp_path / "shm", tiers=["local"]) as ckpt:
        ckpt.save(0, {"w": torch.ones(8)}).result()
        first = ckpt.stats
        assert first.committed == {"local": 1}
        assert first.last_committed == {"local": 0}
        first.committed["local"] = 99  # a reader's own business
        ckpt.save(1, {"w": torch.ones(8)}).result()
        later = ckpt.stats
    assert first.last_committed == {"local": 0}
    assert later.committed == {"local": 2}
    assert later.last_committed == {"local": 1}
