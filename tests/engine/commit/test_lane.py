"""One tier's writer lane on its own (tiercheck/engine/commit/lane.py): what it takes, in which
order it writes, and how a version ends there -- with real blobs, a real in-memory tier (failing
where :mod:`tiercheck.testing.faults` says), a real claim, and a stand-in for the rest of the
pipeline (:class:`~tiercheck.engine.commit.pipe.Pipe`), which records what the lane told it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch

from tests.tiers.dict_tier import DictTier
from tiercheck.codec import BlobMeta, RawState, encode_full
from tiercheck.codec.decode.decoder import decode
from tiercheck.codec.encode.plan import Planner
from tiercheck.codec.format.digest import chunk_digests, tree_root
from tiercheck.consistency.keys import blob_key
from tiercheck.consistency.manifest import Written
from tiercheck.engine.collectives import Channels
from tiercheck.engine.commit.lane import Lane
from tiercheck.engine.jobs import Holder, Job
from tiercheck.engine.open.claim import Claim
from tiercheck.engine.results import CheckpointerStats, SaveHandle, SaveStats
from tiercheck.errors import StateChanged, Superseded, TierWriteFailed
from tiercheck.testing.faults import FaultPlan, FaultyTier, InjectedFault
from tiercheck.tiers.base import Buffer, Tier
from tiercheck.topology import Topology


class _Pipe:
    """The lane's view of its pipeline: the tier, its options and claim; records what the lane
    reported (skips, durable blobs, trouble with peers)."""

    def __init__(
        self, tier: Tier, claim: Claim, *, durable: bool = False, tier_queue: int = 4
    ) -> None:
        self.options = SimpleNamespace(tiers=SimpleNamespace(tier_queue=tier_queue))
        self.rank = 0
        self.tier = tier
        self.name = tier.name
        self.durable = durable
        self.claim = claim
        self.blocked: str | None = None
        self.timeline_ready = asyncio.Event()
        self.timeline_ready.set()
        #: What the tier commits and holds for this rank (none of these tests commits).
        self.committed: set[int] = set()
        self.own: dict[int, Any] = {}
        self.skipped: list[tuple[int, BaseException]] = []
        self.recorded: list[int] = []

    async def takes_new(self) -> bool:
        await self.timeline_ready.wait()
        return self.blocked is None

    def refusal(self) -> TierWriteFailed:
        return TierWriteFailed(
            f"the {self.name!r} tier takes no new versions for now: {self.blocked}"
        )

    def skip(self, job: Job, exc: BaseException) -> None:
        self.skipped.append((job.version, exc))
        job.lane_done(self.name, None, exc)

    def record_written(self, job: Job, key: str, meta: BlobMeta) -> Written:
        self.recorded.append(job.version)
        return Written(job.version, self.rank, self.name, key, meta.nbytes, meta.checksum, 0)

    def peer_trouble(self, what: str, exc: BaseException) -> None:
        raise AssertionError(f"no peer is involved here: {what}: {exc!r}")


def _claim(tmp_path: Path) -> Claim:
    options: Any = SimpleNamespace(
        job=SimpleNamespace(topology=Topology(0, 1, 1), job_id="job", node_root=tmp_path)
    )
    return Claim(options, CheckpointerStats(), Channels())


class _Version:
    """One encoded version as the encoder offers it: its job, its blob's parts and metadata,
    and whether the memory its parts reference was given back."""

    def __init__(self, version: int, tier: str) -> None:
        state = {"w": torch.full((512,), float(version)), "version": version}
        flat = Planner().flatten(state)
        payload = torch.empty(flat.layout.payload_nbytes, dtype=torch.uint8)
        flat.write(payload)
        leaves = chunk_digests(payload)
        raw = RawState(
            version, flat.layout, payload, tree_root(leaves, len(payload)), tuple(leaves)
        )
        self.parts: list[Buffer]
        self.parts, self.meta = encode_full(raw, rank=0)
        self.released = False
        stats = SaveStats(version, "base", raw_bytes=len(payload))
        self.job = Job(
            version,
            "base",
            None,
            {tier: "full"},
            SaveHandle(version, [tier], stats),
            time.perf_counter(),
        )
        self.job.staged_in(payload, Holder(self._release))
        self.job.launch(None)

    def _release(self) -> None:
        self.released = True

    def offer(self, lane: Lane) -> bool:
        """Offer the blob as the encoder does: its parts are views of the job's memory."""
        return lane.offer(self.job, self.parts, self.meta, views=True)

    def let_go(self) -> None:
        """The encoder lets go of the job's own hold on its memory."""
        assert self.job.holder is not None
        self.job.holder.drop()

    async def result(self, tier: str) -> Any:
        return await asyncio.wait_for(self.job.results[tier], 5)


async def _drain(lane: Lane) -> None:
    lane.queue.put_nowait(None)
    await asyncio.wait_for(lane.run(), 10)


def _versions_in(tier: DictTier) -> list[int]:
    return [decode(blob).version for blob in tier.blobs.values()]


class _OneAtATime(DictTier):
    """Counts how many writes overlap (a write takes a little while)."""

    def __init__(self) -> None:
        super().__init__()
        self.running = 0
        self.most = 0

    async def putv(self, key: str, parts: Sequence[Buffer]) -> None:
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            await asyncio.sleep(0.01)
            await super().putv(key, parts)
        finally:
            self.running -= 1


async def test_the_lane_writes_each_version_in_order_one_at_a_time(tmp_path: Path) -> None:
    tier = _OneAtATime()
    pipe = _Pipe(tier, _claim(tmp_path))
    lane = Lane(cast(Any, pipe))
    versions = [_Version(v, tier.name) for v in (1, 2, 3)]
    assert all(v.offer(lane) for v in versions)
    await _drain(lane)
    assert _versions_in(tier) == [1, 2, 3]
    assert tier.most == 1
    assert pipe.recorded == [1, 2, 3]
    for v in versions:
        result = await v.result(tier.name)
        assert result.error is None
        assert result.written.key == blob_key(v.job.version, 0, "full")
        # The lane let go of the memory its parts referenced: the last hold frees it.
        v.let_go()
        assert v.released


async def test_a_lane_tier_queue_versions_behind_passes_over_the_oldest(tmp_path: Path) -> None:
    tier = DictTier()
    pipe = _Pipe(tier, _claim(tmp_path), tier_queue=2)
    lane = Lane(cast(Any, pipe))
    versions = [_Version(v, tier.name) for v in (1, 2, 3)]
    # The lane is not writing (a slow tier): two wait; the third makes room for itself by
    # passing over the oldest (each is self-contained), never the newest.
    assert [v.offer(lane) for v in versions] == [True, True, True]
    dropped = await versions[0].result(tier.name)
    assert isinstance(dropped.error, TierWriteFailed)
    assert (
        "version 1 was passed over for the 'dict' tier: it is 2 versions behind, and the newest "
        "whole versions go first (it keeps 2, 3)"
    ) in str(dropped.error)
    # Passed over: the lane holds nothing of it (the encoder's hold is the last).
    versions[0].let_go()
    assert versions[0].released
    await _drain(lane)
    assert _versions_in(tier) == [2, 3]
    # Once the lane caught up, versions are taken in order again.
    lane = Lane(cast(Any, pipe))
    later = [_Version(v, tier.name) for v in (4, 5)]
    assert all(v.offer(lane) for v in later)
    await _drain(lane)
    assert _versions_in(tier) == [2, 3, 4, 5]


async def test_a_write_that_fails_fails_the_version_in_that_tier_and_the_lane_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    inner = DictTier()
    tier = FaultyTier(inner, FaultPlan(fail_at={2}))  # the second write fails
    pipe = _Pipe(tier, _claim(tmp_path))
    lane = Lane(cast(Any, pipe))
    versions = [_Version(v, tier.name) for v in (1, 2, 3)]
    assert all(v.offer(lane) for v in versions)
    with caplog.at_level(logging.WARNING, logger="tiercheck"):
        await _drain(lane)
    failed = await versions[1].result(tier.name)
    assert failed.written is None
    assert isinstance(failed.error, TierWriteFailed)
    assert "version 2 could not be written to the 'dict' tier" in str(failed.error)
    assert isinstance(failed.error.__cause__, InjectedFault)
    assert f"writing {blob_key(2, 0, 'full')} to the 'dict' tier failed" in caplog.text
    assert [(await v.result(tier.name)).error for v in (versions[0], versions[2])] == [None, None]
    assert _versions_in(inner) == [1, 3]
    assert pipe.recorded == [1, 3]
    for v in versions:  # a failed write lets go of the memory too
        v.let_go()
        assert v.released


async def test_a_durable_tier_that_failed_a_write_sends_the_newest_version_next(
    tmp_path: Path,
) -> None:
    """A failed write in a durable tier (an outage): what queued up meanwhile is stale, and the
    tier sends the newest whole version next. A memory tier goes on in order: a full tier there
    is each rank's own, and frees room as retention runs."""
    for durable, kept in ((True, [4]), (False, [2, 3, 4])):
        inner = DictTier()
        tier = FaultyTier(inner, FaultPlan(fail_at={1}))  # the first write fails
        pipe = _Pipe(tier, _claim(tmp_path), durable=durable)
        lane = Lane(cast(Any, pipe))
        versions = [_Version(v, tier.name) for v in (1, 2, 3, 4)]
        assert all(v.offer(lane) for v in versions)
        await _drain(lane)
        assert _versions_in(inner) == kept, durable
        for passed in versions[1:3] if durable else ():
            result = await passed.result(tier.name)
            assert isinstance(result.error, TierWriteFailed)
            assert (
                f"version {passed.job.version} was passed over for the 'dict' tier: writing "
                "version 1 failed, and the newest whole versions go first (it keeps 4)"
            ) in str(result.error)
        for v in versions:
            v.let_go()
            assert v.released


async def test_a_blocked_tier_skips_the_version(tmp_path: Path) -> None:
    tier = DictTier()
    pipe = _Pipe(tier, _claim(tmp_path))
    pipe.blocked = "it holds another timeline's versions"
    lane = Lane(cast(Any, pipe))
    v = _Version(1, tier.name)
    assert not v.offer(lane)
    [(version, why)] = pipe.skipped
    assert version == 1
    assert isinstance(why, TierWriteFailed)
    assert "takes no new versions for now: it holds another timeline's versions" in str(why)
    assert lane.queue.empty()


async def test_a_tier_whose_timeline_is_being_settled_holds_versions_until_it_is(
    tmp_path: Path,
) -> None:
    """After a restore the timeline is settled in the background
    (tiercheck.engine.restore.timeline): meanwhile versions wait in the lane -- neither written nor
    dropped; once it is settled they are written, or, where the settling failed and blocked the
    tier, skipped with the reason."""
    for outcome in ("settled", "blocked"):
        tier = DictTier()
        pipe = _Pipe(tier, _claim(tmp_path), durable=True)
        pipe.blocked = "not settled yet"
        pipe.timeline_ready.clear()
        lane = Lane(cast(Any, pipe))
        worker = asyncio.create_task(lane.run())
        versions = [_Version(v, tier.name) for v in (1, 2)]
        assert all(v.offer(lane) for v in versions)  # a blocked tier would refuse at once
        await asyncio.sleep(0.05)
        assert not tier.blobs
        assert not pipe.skipped
        assert not any(v.job.results[tier.name].done() for v in versions)
        pipe.blocked = None if outcome == "settled" else "the versions could not be set aside"
        pipe.timeline_ready.set()
        lane.queue.put_nowait(None)
        await asyncio.wait_for(worker, 10)
        if outcome == "settled":
            assert _versions_in(tier) == [1, 2]
            assert not pipe.skipped
        else:
            assert not tier.blobs
            assert [v for v, _ in pipe.skipped] == [1, 2]
            assert all("could not be set aside" in str(e) for _, e in pipe.skipped)
        for v in versions:
            v.let_go()
            assert v.released


async def test_a_memory_tier_writes_an_overlapped_snapshot_only_once_confirmed(
    tmp_path: Path,
) -> None:
    tier = DictTier()
    pipe = _Pipe(tier, _claim(tmp_path))
    lane = Lane(cast(Any, pipe))
    good, torn, after = (_Version(v, tier.name) for v in (1, 2, 3))
    verdicts: list[concurrent.futures.Future[None]] = []
    for v in (good, torn):
        verdict: concurrent.futures.Future[None] = concurrent.futures.Future()
        v.job.confirmed = verdict
        verdicts.append(verdict)
    for v in (good, torn, after):
        assert v.offer(lane)
    worker = asyncio.ensure_future(_drain(lane))
    await asyncio.sleep(0.05)
    assert tier.blobs == {}, "nothing is written before the caller confirmed the snapshot"
    verdicts[0].set_result(None)
    await asyncio.wait_for(good.result(tier.name), 5)
    assert _versions_in(tier) == [1]
    verdicts[1].set_exception(StateChanged("changed before the fence"))
    await asyncio.wait_for(worker, 5)
    refused = await torn.result(tier.name)
    assert isinstance(refused.error, TierWriteFailed)
    assert isinstance(refused.error.__cause__, StateChanged)
    assert _versions_in(tier) == [1, 3]
    assert pipe.recorded == [1, 3]


async def test_a_durable_tier_writes_at_once_while_its_claim_holds(tmp_path: Path) -> None:
    tier = DictTier()
    claim = _claim(tmp_path)
    pipe = _Pipe(tier, claim, durable=True)
    lane = Lane(cast(Any, pipe))
    first = _Version(1, tier.name)
    # Not confirmed yet: a durable tier's blob is not restorable before its COMMIT record,
    # which the commit round writes only once the snapshot is confirmed.
    first.job.confirmed = concurrent.futures.Future()
    assert first.offer(lane)
    await _drain(lane)
    assert _versions_in(tier) == [1]
    # A newer opening took the job over: this one writes nothing more there.
    claim.mark_superseded()
    lane = Lane(cast(Any, pipe))
    second = _Version(2, tier.name)
    assert second.offer(lane)
    await _drain(lane)
    refused = await second.result(tier.name)
    assert isinstance(refused.error, TierWriteFailed)
    assert isinstance(refused.error.__cause__, Superseded)
    assert _versions_in(tier) == [1]
