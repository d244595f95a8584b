"""The stager on its own (tiercheck/engine/save/stage.py): where a snapshot is copied, and what the
job is told about it -- with a real local tier where a tier reserves memory, and a stand-in for the
pipeline around it (the stager asks it only to reserve, and to skip the job)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch

from tiercheck.codec.encode.plan import Flat, Planner
from tiercheck.consistency.keys import blob_key
from tiercheck.engine.jobs import Job
from tiercheck.engine.results import SaveHandle, SaveStats
from tiercheck.engine.save.stage import Stager
from tiercheck.errors import StateChanged, TierFull, TierWriteFailed
from tiercheck.tiers.base import Reservation
from tiercheck.tiers.local import LocalTier


def _options(*, overlap: bool = False) -> Any:
    """What the stager reads of a checkpointer's options: the rank, and whether saves overlap."""
    return SimpleNamespace(
        job=SimpleNamespace(topology=SimpleNamespace(rank=0)),
        schedule=SimpleNamespace(overlap=overlap),
    )


class _Pipe:
    """The stager's view of one tier's pipeline: it reserves in the tier, and records skips."""

    def __init__(self, tier: LocalTier) -> None:
        self.tier = tier
        self.name = tier.name
        self.reserved: list[Reservation] = []
        self.skipped: list[tuple[Job, BaseException]] = []
        #: What reserve raises instead of reserving (a plugin tier's bug), if anything.
        self.broken: Exception | None = None

    async def reserve(self, key: str, size: int) -> Reservation:
        if self.broken is not None:
            raise self.broken
        reservation = await self.tier.reserve(key, size)
        self.reserved.append(reservation)
        return reservation

    def skip(self, job: Job, exc: BaseException) -> None:
        self.skipped.append((job, exc))


def _state() -> dict[str, Any]:
    return {
        "w": torch.arange(3000, dtype=torch.float32),
        "b": torch.arange(17, dtype=torch.int64) * -3,
        "step": 7,
    }


def _job(flat: Flat, version: int = 4, targets: tuple[str, ...] = ("local",)) -> Job:
    stats = SaveStats(version, "base", raw_bytes=flat.layout.payload_nbytes)
    return Job(
        version=version,
        kind="base",
        base_version=None,
        targets=dict.fromkeys(targets, "full"),
        handle=SaveHandle(version, list(targets), stats),
        started=time.perf_counter(),
        layout=flat.layout,
    )


def _assert_holds(job: Job, flat: Flat) -> None:
    """The job's payload holds exactly the flattened state's tensors, each where the layout
    puts it."""
    assert job.payload is not None
    assert flat.layout is job.layout
    assert job.payload.numel() == flat.layout.payload_nbytes
    views = flat.layout.views(job.payload)
    assert len(views) == len(flat.tensors) > 0
    for view, tensor in zip(views, flat.tensors, strict=True):
        assert torch.equal(view, tensor)


async def test_a_blocking_save_copies_the_state_into_a_pool_buffer() -> None:
    stager = Stager(_options(), {})
    flat = Planner().flatten(_state())
    job = _job(flat)
    await stager.stage(job, flat, None, into=None)
    _assert_holds(job, flat)
    # A copy of the state, not a view of it: training may change the state at once.
    flat.tensors[0].add_(1)
    assert job.payload is not None
    assert not torch.equal(flat.layout.views(job.payload)[0], flat.tensors[0])
    assert (job.reservation, job.reserved_in, job.copy, job.confirmed) == (None, None, None, None)
    lent = stager.pool.allocated_bytes
    assert lent >= flat.layout.payload_nbytes
    # The holder gives the buffer back to the pool, which lends it again, allocating nothing.
    assert job.holder is not None
    job.holder.drop()
    again = _job(flat, version=5)
    await stager.stage(again, flat, None, into=None)
    assert stager.pool.allocated_bytes == lent
    _assert_holds(again, flat)


async def test_a_save_staged_in_a_reserving_tier_copies_into_its_memory(tmp_path: Path) -> None:
    tier = LocalTier(tmp_path / "local")
    pipe = _Pipe(tier)
    stager = Stager(_options(), cast(Any, {"local": pipe}))
    flat = Planner().flatten(_state())
    job = _job(flat)
    await stager.stage(job, flat, None, into="local")
    try:
        assert not pipe.skipped
        [reservation] = pipe.reserved
        assert reservation.key == blob_key(job.version, 0, "full")
        assert job.reservation is reservation
        assert job.reserved_in == "local"
        assert stager.pool.allocated_bytes == 0, "nothing is taken from the staging pool"
        _assert_holds(job, flat)
        # The payload is the reservation's memory itself (the blob, once published).
        whole = torch.frombuffer(reservation.buffer, dtype=torch.uint8)
        assert job.payload is not None
        start = job.payload.data_ptr() - whole.data_ptr()
        assert start > 0
        assert start + job.payload.numel() == whole.numel()
        assert tier.usage == len(reservation.buffer)
    finally:
        await reservation.abort()
        await tier.aclose()


async def test_a_reservation_that_fails_skips_that_tier_and_stages_in_the_pool(
    tmp_path: Path,
) -> None:
    tier = LocalTier(tmp_path / "local", capacity=64)  # far too small for the snapshot
    pipe = _Pipe(tier)
    stager = Stager(_options(), cast(Any, {"local": pipe}))
    flat = Planner().flatten(_state())
    job = _job(flat, targets=("local", "persistent"))
    await stager.stage(job, flat, None, into="local")
    try:
        [(skipped, why)] = pipe.skipped
        assert skipped is job
        assert isinstance(why, TierFull)
        assert (job.reservation, job.reserved_in) == (None, None)
        assert stager.pool.allocated_bytes >= flat.layout.payload_nbytes
        _assert_holds(job, flat)
        assert [k async for k in tier.list("")] == []
        assert tier.usage == 0
    finally:
        await tier.aclose()


async def test_a_tier_whose_reserve_has_a_bug_is_skipped_and_training_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Not only storage errors: whatever a plugin tier's reserve raises stays out of save."""
    tier = LocalTier(tmp_path / "local")
    pipe = _Pipe(tier)
    pipe.broken = RuntimeError("a plugin's bug")
    stager = Stager(_options(), cast(Any, {"local": pipe}))
    flat = Planner().flatten(_state())
    job = _job(flat, targets=("local", "persistent"))
    try:
        with caplog.at_level(logging.ERROR, logger="tiercheck"):
            await stager.stage(job, flat, None, into="local")
        [(skipped, why)] = pipe.skipped
        assert skipped is job
        assert why is pipe.broken
        assert "the 'local' tier's reserve raised an unexpected error" in caplog.text
        assert job.reserved_in is None
        _assert_holds(job, flat)
    finally:
        await tier.aclose()


def _unreadable(flat: Flat) -> Flat:
    """``flat`` with a tensor whose bytes cannot be read (a meta tensor): the copy fails."""
    tensors = [torch.empty_like(flat.tensors[0], device="meta"), *flat.tensors[1:]]
    return dataclasses.replace(flat, tensors=tensors)


async def test_a_copy_that_fails_gives_the_memory_back_and_reaches_the_caller(
    tmp_path: Path,
) -> None:
    flat = Planner().flatten(_state())
    bad = _unreadable(flat)
    # Into the pool: the buffer is back in it (the next save reuses it).
    stager = Stager(_options(), {})
    with pytest.raises(RuntimeError, match="device"):
        await stager.stage(_job(flat), bad, None, into=None)
    lent = stager.pool.allocated_bytes
    assert lent > 0
    await stager.stage(_job(flat, version=5), flat, None, into=None)
    assert stager.pool.allocated_bytes == lent
    # Into a tier's memory: the reservation is discarded, nothing is left in the tier.
    tier = LocalTier(tmp_path / "local")
    stager = Stager(_options(), cast(Any, {"local": _Pipe(tier)}))
    try:
        with pytest.raises(RuntimeError, match="device"):
            await stager.stage(_job(flat), bad, None, into="local")
        assert tier.usage == 0
        assert [k async for k in tier.list("")] == []
    finally:
        await tier.aclose()


async def test_an_overlapped_copy_hands_the_handle_its_fence_and_waits_for_confirmation() -> None:
    stager = Stager(_options(overlap=True), {})
    # The copy runs on the loop's default executor: hold its one thread until the test lets
    # it go, so that the copy is seen before it ran.
    gate = threading.Event()
    pool = ThreadPoolExecutor(1, thread_name_prefix="test-stage")
    asyncio.get_running_loop().set_default_executor(pool)
    pool.submit(gate.wait, 5)
    try:
        flat = Planner().flatten(_state())
        job = _job(flat)
        await stager.stage(job, flat, None, into=None)
        copy = job.copy
        assert copy is not None
        assert job.confirmed is copy.confirmed
        assert copy in stager.copies
        # The handle's fence is the copy: not staged before the bytes are in the buffer.
        assert not copy.done.done()
        with pytest.raises(TimeoutError):
            job.handle.staged(timeout=0.01)
        gate.set()
        await asyncio.wait_for(asyncio.wrap_future(copy.done), 5)
        job.handle.staged(timeout=5)
        assert job.handle.is_staged
        _assert_holds(job, flat)
        # Copied, but not confirmed: the version waits (no tier may count it yet).
        verdict = asyncio.ensure_future(job.unconfirmed())
        await asyncio.sleep(0.05)
        assert not verdict.done()
        assert not copy.confirmed.done()
        # The caller's confirmation point decides it; the stager forgets the copy.
        stager.settle(wait=True, timeout=5)
        assert await asyncio.wait_for(verdict, 5) is None
        assert copy not in stager.copies
    finally:
        gate.set()
        stager.close()
        pool.shutdown(wait=True)


async def test_an_overlapped_copy_changed_before_the_fence_fails_the_version() -> None:
    stager = Stager(_options(overlap=True), {})
    try:
        flat = Planner().flatten(_state())
        job = _job(flat)
        await stager.stage(job, flat, None, into=None)
        assert job.copy is not None
        await asyncio.wait_for(asyncio.wrap_future(job.copy.done), 5)
        flat.tensors[0].mul_(2)  # training changed the state before passing the fence
        stager.fence(timeout=5)
        why = await asyncio.wait_for(job.unconfirmed(), 5)
        assert isinstance(why, TierWriteFailed)
        assert isinstance(why.__cause__, StateChanged)
        assert not stager.copies
    finally:
        stager.close()
