"""Staging: the snapshot copy from the caller's tensors into host memory.

The copy goes straight into a tier's own memory when the save's plan says so (the fastest tier
that can reserve memory, :class:`~tiercheck.tiers.base.SupportsReserve`, and stores the
version as is: :func:`~tiercheck.engine.save.plan.plan_save`); else into a staging buffer lent by
a pool (pinned for GPU tensors). A blocking save copies to the end; an
overlapped one (``overlap=True``) starts the copy on a worker thread and hands the caller the
fence (:meth:`Stager.fence`, :meth:`~tiercheck.SaveHandle.staged`).

An overlapped copy stays in :attr:`Stager.copies` until the caller confirmed the state
unchanged since ``save`` (see :mod:`tiercheck.engine.save.staging`): :meth:`Stager.settle` is that
confirmation point, called on the caller's side by the fence, the next save, ``wait``,
``restore``, ``close`` and the save handles -- never from the engine's loop, which cannot know
what the training thread has done. While a checkpointer with overlapped saves is open, every
optimizer step is such a fence too (a global step pre-hook): fused optimizers write parameters
and their state without bumping version counters, so their step must not run during a copy.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from tiercheck.codec import full_blob_size, write_full_blob
from tiercheck.codec.encode.plan import Flat, Planner
from tiercheck.consistency.keys import blob_key
from tiercheck.engine.commit.tier import prepare_for
from tiercheck.engine.jobs import Holder, Job
from tiercheck.engine.options import Options
from tiercheck.engine.save.plan import staging_tier
from tiercheck.engine.save.staging import SnapshotCopy, StagingBuffer, StagingPool
from tiercheck.errors import TiercheckError, TierWriteFailed
from tiercheck.tiers.base import SupportsReserve

if TYPE_CHECKING:
    from tiercheck.engine.commit.tier import TierPipeline

__all__ = ["Stager"]

logger = logging.getLogger("tiercheck")


class Stager:
    """Copies snapshots into host memory; keeps the overlapped copies not confirmed yet."""

    def __init__(self, options: Options, pipes: Mapping[str, TierPipeline]) -> None:
        self.options = options
        self.rank = options.job.topology.rank
        self.pipes = pipes
        self.pool = StagingPool()
        #: Overlapped snapshot copies not confirmed yet (or not failed yet); read by the
        #: confirmation points from the caller's threads.
        self.copies: set[SnapshotCopy] = set()
        self.copies_lock = threading.Lock()
        self._step_fence: Any = None
        if options.schedule.overlap:
            handle = register_optimizer_step_pre_hook(_step_fence(weakref.ref(self)))
            self._step_fence = handle
            # A checkpointer dropped without closing must not leave the hook behind.
            weakref.finalize(self, handle.remove)

    def fence(self, timeout: float | None) -> None:
        """Block (any thread) until every overlapped snapshot started so far is staged, and
        confirm them (see :meth:`settle`)."""
        self.settle(wait=True, timeout=timeout)

    def settle(self, *, wait: bool, timeout: float | None = None) -> None:
        """A confirmation point (see :mod:`tiercheck.engine.save.staging`): confirm or fail every
        pending overlapped copy that is done; with ``wait``, first wait for every one of them to be
        done (:class:`TimeoutError` if ``timeout`` passes first; those done are still decided).

        Call it only on the caller's side, where every in-place change the training code made
        before has returned: the public calls that are points do, never the engine's loop.
        """
        with self.copies_lock:
            copies = list(self.copies)
        if not copies:
            return
        try:
            if wait:
                deadline = None if timeout is None else time.monotonic() + timeout
                for copy in copies:
                    copy.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        finally:
            for copy in copies:
                copy.confirm()

    async def asettle(self, timeout: float | None = None) -> None:
        """:meth:`settle` with ``wait``, for the caller's event loop (it waits without blocking
        the loop; the copies not done when ``timeout`` passes stay pending)."""
        with self.copies_lock:
            copies = list(self.copies)
        if not copies:
            return
        pending = [asyncio.wrap_future(c.done) for c in copies if not c.done.done()]
        if pending:
            await asyncio.wait(pending, timeout=timeout)
        for copy in copies:
            copy.confirm()

    def abandon(self, why: str) -> None:
        """Fail every overlapped copy not confirmed yet (the checkpointer is closing)."""
        with self.copies_lock:
            copies = list(self.copies)
        for copy in copies:
            copy.abandon(TierWriteFailed(why))

    def close(self) -> None:
        """Release the pool and the optimizer step hook."""
        if self._step_fence is not None:
            self._step_fence.remove()
        self.pool.clear()

    async def prepare(self, planner: Planner, state: Any, version: int) -> int:
        """Ready the memory a save of ``state`` as ``version`` will be copied into, ahead of it
        (:meth:`tiercheck.Checkpointer.prepare`): the state is flattened as the save will
        flatten it (the save then reuses that layout), and the tier a save's plan would copy
        it into (:func:`~tiercheck.engine.save.plan.plan_save`: the first that reserves memory
        and stores blobs as is, for a state on the host or without pinned staging) sizes,
        backs and faults in room for its blob in the background. Returns the bytes readied
        (0 where no tier will be copied into, or a save has reserved already)."""
        flat = planner.flatten(state)
        into = staging_tier(
            [n for n, p in self.pipes.items() if isinstance(p.tier, SupportsReserve)],
            {n: p.policy.encoding for n, p in self.pipes.items()},
            on_host=flat.on_host,
            pinned=self.pool.pin,
        )
        if into is None:
            return 0
        size, _ = full_blob_size(flat.layout, version=version, rank=self.rank)
        return size if prepare_for(self.pipes[into], size) else 0

    async def stage(
        self, job: Job, flat: Flat, marks: dict[int, Any] | None, *, into: str | None
    ) -> None:
        """Copy the state into host memory: the memory of the tier ``into``, where the save's
        plan says so (:attr:`~tiercheck.engine.save.plan.SavePlan.stage_in`), else a staging buffer.

        A snapshot copied into a tier's own memory (:class:`SupportsReserve`, the local tier)
        is, once published, the stored blob. A tier that cannot take the version (full, or
        failing) is skipped for it, and the snapshot goes to a staging buffer instead, so the
        other tiers still get it: storage trouble never reaches the caller. (The plan names
        no tier for tensors on a GPU with a pinned pool: a device-to-host copy into shared
        memory could not be asynchronous; the tier then gets a copy like any other tier.)
        """
        layout = job.layout
        assert layout is not None
        rank, watch = self.rank, self.options.schedule.overlap
        if into is not None:
            reserving = self.pipes[into]
            size, offset = full_blob_size(layout, version=job.version, rank=rank)
            key = blob_key(job.version, rank, "full")
            try:
                reservation = await reserving.reserve(key, size)
            except Exception as exc:
                if not isinstance(exc, (TiercheckError, OSError)):
                    # A bug in a plugin tier must not reach training: that tier goes without.
                    logger.exception(
                        "tiercheck: the %r tier's reserve raised an unexpected error",
                        reserving.name,
                    )
                reserving.skip(job, exc)
            else:
                try:
                    write_full_blob(reservation.buffer, layout, version=job.version, rank=self.rank)
                    whole = torch.frombuffer(reservation.buffer, dtype=torch.uint8)
                    payload = whole[offset : offset + layout.payload_nbytes]
                    copy = SnapshotCopy(flat, payload, marks=marks, watch=watch)
                    await self._copy(job, copy)
                except BaseException:
                    await reservation.abort()
                    raise
                job.staged_in(payload, Holder(reservation.release), reservation, reserving.name)
                return
        lent: StagingBuffer = self.pool.acquire(layout.payload_nbytes)
        try:
            copy = SnapshotCopy(
                flat,
                lent.data,
                cache=lent.cache,
                marks=marks,
                watch=watch,
            )
            await self._copy(job, copy)
        except BaseException:
            self.pool.release(lent)
            raise
        job.staged_in(lent.data, Holder(lambda: self.pool.release(lent)))

    async def _copy(self, job: Job, copy: SnapshotCopy) -> None:
        """Run the snapshot copy: to its end (blocking saves), or started on a worker thread
        with the handle's fence set to it (overlapped saves; the pipeline awaits it, and no
        tier makes the version restorable before it is confirmed: :attr:`Job.confirmed`)."""
        if not self.options.schedule.overlap:
            await asyncio.to_thread(copy.run)
            copy.done.result()  # the copy's error, if any, is the caller's: save raises it
            return
        job.copying(copy)
        stats = job.handle.stats
        started = job.started
        # A future keeps its callbacks for good: one that held the copy would make a cycle
        # (copy -> future -> callback -> copy), and the copy -- with the buffer it copied into --
        # would live until the garbage collector ran, so the next save would map a fresh one.
        mine = weakref.ref(copy)

        def staged(fut: concurrent.futures.Future[None]) -> None:
            stats.staged_s = time.perf_counter() - started

        def decided(fut: concurrent.futures.Future[None]) -> None:
            live = mine()
            if live is not None:
                with self.copies_lock:
                    self.copies.discard(live)

        with self.copies_lock:
            self.copies.add(copy)
        copy.done.add_done_callback(staged)
        copy.confirmed.add_done_callback(decided)
        # Never awaited: run() reports through copy.done, which the pipeline awaits.
        asyncio.get_running_loop().run_in_executor(None, copy.run)


def _step_fence(stager: weakref.ref[Stager]) -> Callable[[Any, Any, Any], None]:
    """The global optimizer step pre-hook of a stager with overlapped saves: a step waits for
    the copies in flight and confirms them (it is a fence; see the module docstring)."""

    def hook(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
        live = stager()
        if live is not None and live.copies:
            live.settle(wait=True)

    return hook
