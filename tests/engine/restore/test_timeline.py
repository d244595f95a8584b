"""Going back to an older version: the versions after it are set aside, never deleted, and the
run's first save is where that happens (tiercheck/engine/restore/timeline.py).

Faults are real: the durable folder is bind-mounted onto itself and remounted read-only while
the run goes on, as a store that stops taking writes would.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.test_never_lose import assert_restores, job, save_versions, state_of
from tiercheck import SyncCheckpointer, TierWriteFailed
from tiercheck.consistency.abandoned import AbandonedSet
from tiercheck.engine.restore.timeline import RETRY_EVERY
from tiercheck.tiers import DelegatingTier, LocalTier, PersistentTier


def abandoned(root: Path) -> dict[str, AbandonedSet]:
    """The whole abandoned sets in the durable job folder, by tag."""
    return {
        p.parent.name: AbandonedSet.from_bytes(p.read_bytes())
        for p in (root / "durable" / "job").glob("abandoned/*/SET")
    }


def live(root: Path) -> list[int]:
    """Versions with a COMMIT record on the job's timeline in the durable tier."""
    return sorted(int(p.parent.name[1:]) for p in (root / "durable" / "job").glob("v*/COMMIT"))


class Hanging(DelegatingTier):
    """Every operation waits while :attr:`answering` is clear (at most a minute: a save that
    waited for it fails the test instead of hanging it)."""

    def __init__(self, inner: PersistentTier) -> None:
        super().__init__(inner)
        self.answering = threading.Event()
        self.answering.set()
        self.hung = threading.Event()

    async def before(self, op: str, key: str) -> None:
        if not self.answering.is_set():
            self.hung.set()
            await asyncio.to_thread(self.answering.wait, 60)


def opened(root: Path, store: Hanging, close_timeout: float = 30.0) -> SyncCheckpointer:
    """A local and a durable tier, every version persisted."""
    return SyncCheckpointer(
        "job",
        local_root=root / "node",
        tiers=[LocalTier(root / "node" / "blobs"), store],
        persist="all",
        base_every=2,
        keep={"local": 3, "persistent": 10},
        threads=1,
        close_timeout=close_timeout,
    )


def test_going_back_sets_the_newer_versions_aside_at_the_first_save(tmp_path: Path) -> None:
    save_versions(tmp_path, 1, range(6), persist="all", keep={"local": 2, "persistent": 4})
    originals = {
        p.relative_to(tmp_path / "durable" / "job"): p.read_bytes()
        for p in (tmp_path / "durable" / "job").glob("v00000000000[45]/*")
    }
    with job(tmp_path, 0, 1, None, persist="all", keep={"local": 2, "persistent": 4}) as ckpt:
        restored = ckpt.restore(version=3)
        assert restored is not None
        assert restored.version == 3
        assert live(tmp_path) == [2, 3, 4, 5]  # looking changes nothing
        ckpt.save(4, state_of(104))
        ckpt.wait()
        (tag,) = abandoned(tmp_path)
        record = abandoned(tmp_path)[tag]
        assert record.versions == (4, 5)
        assert record.restored == 3
        assert "went back to version 3" in record.reason
        # The set holds the originals, byte for byte; the live folder the new version 4.
        for key, data in originals.items():
            assert (tmp_path / "durable" / "job" / "abandoned" / tag / key).read_bytes() == data
        assert live(tmp_path) == [2, 3, 4]
        # `tiercheck ls` shows the set; retention removes it once the run has `keep` (4)
        # committed versions of its own from version 4 on.
        for v in (5, 6, 7):
            ckpt.save(v, state_of(100 + v))
            ckpt.wait()
            assert bool(abandoned(tmp_path)) == (v < 7), v
    assert_restores_new(tmp_path, 7)


def assert_restores_new(root: Path, version: int) -> None:
    with job(root, 0, 1, None, node="fresh", persist="all") as ckpt:
        got = ckpt.restore()
    assert got is not None
    assert got.version == version
    assert torch.equal(got.state["w"], state_of(100 + version)["w"])


@pytest.fixture
def durable_mount(tmp_path: Path) -> Iterator[Path]:
    """The durable folder bind-mounted onto itself, so that a test can make it read-only."""
    folder = tmp_path / "durable"
    folder.mkdir()
    bound = subprocess.run(
        ["mount", "--bind", str(folder), str(folder)], capture_output=True, text=True, check=False
    )
    if bound.returncode != 0:
        pytest.skip(f"cannot bind-mount a folder here: {bound.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def remount(folder: Path, mode: str) -> None:
    done = subprocess.run(
        ["mount", "-o", f"remount,bind,{mode}", str(folder)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot remount {mode} here: {done.stderr.strip()}")
    if mode == "ro":
        try:
            (folder / ".probe").write_bytes(b"x")
        except OSError:
            return
        pytest.skip("a read-only remount is still writable on this machine")


def test_a_store_that_refuses_the_set_aside_takes_no_new_versions_until_it_can(
    tmp_path: Path, durable_mount: Path
) -> None:
    options = {"persist": "all", "base_every": 2, "keep": {"local": 2, "persistent": 20}}
    save_versions(tmp_path, 1, range(6), **options)
    before = {p: p.read_bytes() for p in durable_mount.rglob("v*/*")}
    last = 3 + RETRY_EVERY + 2
    with job(tmp_path, 0, 1, None, **options) as ckpt:
        assert ckpt.restore(version=2) is not None
        remount(durable_mount, "ro")
        try:
            first = ckpt.save(3, state_of(103))
            with pytest.raises(TierWriteFailed, match="could not be set aside"):
                first.result("persistent", timeout=60)
            first.result("local", timeout=60)  # memory goes on
            # Nothing was removed from the store; training saves on.
            assert {p: p.read_bytes() for p in durable_mount.rglob("v*/*")} == before
            for v in range(4, 3 + RETRY_EVERY):
                h = ckpt.save(v, state_of(100 + v))
                h.result("local", timeout=60)
                with pytest.raises(TierWriteFailed, match="takes no new versions"):
                    h.result("persistent", timeout=60)
                assert h.stats.tiers["persistent"].state == "skipped"
        finally:
            remount(durable_mount, "rw")
        # The retry (every RETRY_EVERY saves) sets the versions aside, and the tier takes
        # versions again, starting from a base.
        handles = [ckpt.save(v, state_of(100 + v)) for v in range(3 + RETRY_EVERY, last + 1)]
        ckpt.wait()
        assert handles[0].stats.kind == "base"
        assert all(h.committed("persistent") for h in handles)
    (record,) = abandoned(tmp_path).values()
    assert record.versions == (3, 4, 5)
    assert live(tmp_path)[-1] == last
    assert_restores_new(tmp_path, last)


def test_a_restore_only_to_look_changes_nothing(tmp_path: Path) -> None:
    save_versions(tmp_path, 1, range(5), persist="all")
    stored = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and "/v0" in str(p)}
    with job(tmp_path, 0, 1, None, persist="all") as ckpt:
        got = ckpt.restore(version=2)
        assert got is not None
        assert got.version == 2
    after = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and "/v0" in str(p)}
    assert after == stored
    assert_restores(tmp_path, 1, 4)
    assert not abandoned(tmp_path)


def _whole_somewhere(durable: Path, version: int) -> bool:
    """Whether ``version`` of the old timeline is whole live (its COMMIT record and every blob
    it names) or whole in an abandoned set with its SET record."""
    from tiercheck.consistency.commit import CommitRecord

    def whole(folder: Path) -> bool:
        commit = folder / f"v{version:012d}" / "COMMIT"
        if not commit.exists():
            return False
        record = CommitRecord.from_bytes(commit.read_bytes())
        return all((folder / e.key).exists() for e in record.entries)

    if whole(durable):
        return True
    return any(
        version in AbandonedSet.from_bytes((s / "SET").read_bytes()).versions and whole(s)
        for s in durable.glob("abandoned/*")
        if (s / "SET").exists()
    )


def test_a_death_at_any_write_of_the_first_save_after_going_back_loses_nothing(
    tmp_path: Path,
) -> None:
    """Systematically: the process dies at the k-th write from the start of the first save
    after ``restore(version=2)``, for every k up to the last write of that save. Afterwards
    every version of the old timeline after 2 is whole somewhere (live, or in a whole set),
    what a restore gives is the content of the timeline that saved it, and the next run
    settles the timeline and goes on."""
    from tiercheck import SyncCheckpointer
    from tiercheck.testing.faults import FaultPlan, FaultyTier, SimulatedCrash, abandon
    from tiercheck.tiers import LocalTier, PersistentTier

    def opened(root: Path, plan: FaultPlan) -> SyncCheckpointer:
        return SyncCheckpointer(
            "job",
            local_root=root / "node",
            tiers=[
                FaultyTier(LocalTier(root / "node" / "blobs"), plan),
                FaultyTier(PersistentTier((root / "durable" / "job").as_uri()), plan),
            ],
            persist="all",
            base_every=2,
            keep={"local": 2, "persistent": 10},
            threads=1,
        )

    def old(v: int) -> dict[str, object]:
        return state_of(v)

    def new(v: int) -> dict[str, object]:
        return state_of(100 + v)

    def prepared(root: Path) -> set[int]:
        """Saves 0..5; returns the versions after 2 committed durably (a loaded machine may
        drop one for the persistent tier: `tier_queue`), the ones that must never be lost."""
        with opened(root, FaultPlan()) as ckpt:
            handles = [ckpt.save(v, old(v)) for v in range(6)]
            ckpt.wait()
        return {h.version for h in handles if h.version > 2 and h.committed("persistent")}

    # How many writes the first save makes when nothing dies.
    probe = tmp_path / "probe"
    prepared(probe)
    plan = FaultPlan()
    with opened(probe, plan) as ckpt:
        ckpt.restore(version=2)
        before = plan.count
        ckpt.save(3, new(3))
        ckpt.wait()
        writes = plan.count - before
    assert writes > 8  # copies, COMMIT copies, SET, deletions, then the save itself
    for k in range(1, writes + 1):
        root = tmp_path / f"k{k}"
        durably = prepared(root)
        plan = FaultPlan()
        ckpt = opened(root, plan)
        ckpt.restore(version=2)
        plan.die_at = plan.count + k
        try:
            ckpt.save(3, new(3))
            ckpt.wait()
        except SimulatedCrash:
            pass
        abandon(ckpt)
        durable = root / "durable" / "job"
        for v in durably:
            assert _whole_somewhere(durable, v), (k, v, plan.log[-12:])
        with opened(root, FaultPlan()) as again:
            got = again.restore()
            assert got is not None, k
            # The version restored is one timeline's, whole: the new 3 only if it committed.
            fresh = got.version == 3 and torch.equal(got.state["w"], new(3)["w"])
            assert fresh or torch.equal(got.state["w"], old(got.version)["w"]), (k, got.version)
            again.save(got.version + 1, new(got.version + 1))
            again.wait()
        with opened(root, FaultPlan()) as last:
            final = last.restore()
        assert final is not None
        assert final.version == got.version + 1
        assert torch.equal(final.state["w"], new(final.version)["w"])
        for v in durably:
            assert v <= got.version or _whole_somewhere(durable, v), (k, v)


def test_a_restart_whose_durable_storage_hangs_at_its_first_save_trains_on(
    tmp_path: Path,
) -> None:
    """A restart from the newest version (nothing durable to set aside): the first save's
    settling of the timeline in durable storage runs in the background, so a store that hangs
    right then stalls no save -- memory commits go on -- and the versions reach it, whole,
    once it answers again (chaos soak seeds 3102, 3103)."""
    uri = (tmp_path / "durable" / "job").as_uri()
    with opened(tmp_path, Hanging(PersistentTier(uri))) as ckpt:
        for v in range(4):
            ckpt.save(v, state_of(v))
        ckpt.wait()
    store = Hanging(PersistentTier(uri))
    with opened(tmp_path, store) as ckpt:
        got = ckpt.restore()
        assert got is not None
        assert got.version == 3
        store.answering.clear()  # the store hangs from here on
        handles = []
        for v in (4, 5, 6):
            # Each save returns and commits in memory while the store does not answer.
            handle = ckpt.save(v, state_of(v))
            handle.result("local", timeout=60)
            handles.append(handle)
        assert store.hung.is_set()
        assert not any(h.tier_future("persistent").done() for h in handles)  # type: ignore[union-attr]
        store.answering.set()
        ckpt.wait()
        # The versions that waited meanwhile reach the store (the newest whole ones first,
        # within tier_queue), the newest of them included.
        assert handles[-1].committed("persistent")
    with opened(tmp_path / "elsewhere", Hanging(PersistentTier(uri))) as fresh:
        final = fresh.restore()
    assert final is not None
    assert final.version == 6
    assert torch.equal(final.state["w"], state_of(6)["w"])


@pytest.mark.parametrize("answers_after", [0.5, 3.0])
def test_leaving_on_an_error_while_the_first_save_settles_the_timeline(
    tmp_path: Path, answers_after: float
) -> None:
    """The bounded close of a run leaving on an error lets the timeline's attempt under way
    end within close_timeout (a slow store): the save waiting on it reaches the store (CI
    found the close cutting it: test_closing_decides_what_no_fence_confirmed). A store that
    answers only after close_timeout has its attempt cut: the tier is blocked before it is
    released, so the save that waited fails there, typed, even though the store answers while
    the close still flushes -- it is never written where the timeline was not settled -- and
    every version durable before is still whole."""
    uri = (tmp_path / "durable" / "job").as_uri()
    with opened(tmp_path, Hanging(PersistentTier(uri))) as ckpt:
        for v in range(2):
            ckpt.save(v, state_of(v))
    store = Hanging(PersistentTier(uri))

    def leave_while_settling() -> None:
        with opened(tmp_path, store, close_timeout=2.0) as ckpt:
            got = ckpt.restore()
            assert got is not None
            assert got.version == 1
            store.answering.clear()
            handle = ckpt.save(2, state_of(2))
            handle.result("local", timeout=60)
            assert store.hung.wait(30)  # the timeline's attempt waits on the store
            threading.Timer(answers_after, store.answering.set).start()
            raise RuntimeError(handle)

    with pytest.raises(RuntimeError) as info:
        leave_while_settling()
    handle = info.value.args[0]
    settled = answers_after < 2.0
    if settled:
        assert handle.committed("persistent")
    else:
        with pytest.raises(TierWriteFailed, match="stopped settling"):
            handle.result("persistent")
    with opened(tmp_path / "elsewhere", Hanging(PersistentTier(uri))) as fresh:
        final = fresh.restore()
    assert final is not None
    assert final.version == (2 if settled else 1)
    assert torch.equal(final.state["w"], state_of(final.version)["w"])


def test_when_one_rank_fails_to_settle_the_timeline_every_rank_retries_it(tmp_path: Path) -> None:
    """Rank 0 lists the durable tier to remove the versions after the restored one (their
    COMMIT records) and the other ranks need not: when that listing fails on rank 0 alone,
    every rank must count the tier unsettled, or the retry's exchanges are made by rank 0 alone
    and the tier stays blocked for good (chaos soak seed 6108). Both ranks skip the first
    versions there, retry together, and the newest versions reach the store."""
    from tests.test_never_lose import run_ranks
    from tiercheck.testing import LocalGroup

    class FailsOneListing(DelegatingTier):
        """Once armed, the second listing fails (the first is the set-aside's own)."""

        def __init__(self, inner: PersistentTier) -> None:
            super().__init__(inner)
            self.armed = False
            self.listings = 0

        async def before(self, op: str, key: str) -> None:
            if self.armed and op == "list":
                self.listings += 1
                if self.listings == 2:
                    raise OSError("the store refused this listing")

    uri = (tmp_path / "durable" / "job").as_uri()

    def opened(rank: int, group: LocalGroup, store: Any) -> SyncCheckpointer:
        return SyncCheckpointer(
            "job",
            rank=rank,
            world_size=2,
            ranks_per_node=2,
            coordinator=group.coordinator(rank),
            local_root=tmp_path / "node",
            tiers=[LocalTier(tmp_path / "node" / "blobs"), store],
            persist="all",
            keep={"local": 3, "persistent": 30},
            peer_timeout=5,
        )

    first = LocalGroup(2, timeout=5)

    def save(rank: int) -> None:
        with opened(rank, first, PersistentTier(uri)) as ckpt:
            for v in range(4):
                ckpt.save(v, state_of(v))

    run_ranks(2, save)
    again = LocalGroup(2, timeout=5)
    last = 4 + RETRY_EVERY + 2

    def go_on(rank: int) -> list[Any]:
        store = FailsOneListing(PersistentTier(uri))
        with opened(rank, again, store) as ckpt:
            got = ckpt.restore()
            assert got is not None
            assert got.version == 3
            store.armed = rank == 0
            handles = [ckpt.save(v, state_of(v)) for v in range(4, last + 1)]
            ckpt.wait()
        return [h.committed("persistent") for h in handles]

    committed = run_ranks(2, go_on)
    assert committed[0] == committed[1], "the ranks' handles agree"
    assert not committed[0][0], "the first save after the restore is skipped there"
    assert committed[0][-1], "the newest version reaches the store after the retry"
    shutil.rmtree(tmp_path / "node")  # the cluster is lost: the store alone brings it back
    final = LocalGroup(2, timeout=5)

    def restore(rank: int) -> int:
        with opened(rank, final, PersistentTier(uri)) as ckpt:
            got = ckpt.restore()
            assert got is not None
            assert torch.equal(got.state["w"], state_of(got.version)["w"])
            return got.version

    assert run_ranks(2, restore) == [last, last]
