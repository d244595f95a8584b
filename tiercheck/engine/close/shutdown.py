"""Closing: three ways to end, none of which raises for a peer or a store that is gone.

``"collective"`` (the normal end) finishes every save, then leaves the store and the other ranks
in order; ``"bounded"`` (leaving on an exception) gives the saves in flight ``close_timeout``
seconds, memory tiers first, and agrees with no one; ``"now"`` waits for nothing. Each then
releases everything local (:meth:`Shutdown._release`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from tiercheck.consistency.protocol import SavesDone, ServingStopped, Step
from tiercheck.engine.collectives import step
from tiercheck.engine.open.leftovers import clean_failed_opening
from tiercheck.engine.options import CloseMode
from tiercheck.errors import TierWriteFailed
from tiercheck.tiers.base import SupportsStopServing

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

    from tiercheck.engine.close.preempt import Preemption
    from tiercheck.engine.collectives import Channels
    from tiercheck.engine.commit.tier import TierPipeline
    from tiercheck.engine.jobs import InFlight
    from tiercheck.engine.journal import Journal
    from tiercheck.engine.open.claim import Claim
    from tiercheck.engine.open.rejoin import Rejoin
    from tiercheck.engine.options import Options
    from tiercheck.engine.restore.timeline import Timeline
    from tiercheck.engine.save.encode import Encoder
    from tiercheck.engine.save.stage import Stager
    from tiercheck.tiers.base import Tier

__all__ = ["Closable", "Shutdown"]

logger = logging.getLogger("tiercheck")


class Closable(Protocol):
    """What closing needs of the engine (:class:`~tiercheck.engine.engine.Engine`, which holds
    the :class:`Shutdown`: a narrow view, so that this module does not import that one)."""

    cfg: Options
    channels: Channels
    claim: Claim
    journal: Journal
    cpu: ThreadPoolExecutor
    inflight: InFlight
    tiers: list[Tier]
    pipes: dict[str, TierPipeline]
    encoder: Encoder
    stager: Stager
    preemption: Preemption
    rejoin: Rejoin
    timeline: Timeline
    save_lock: asyncio.Lock
    opened: bool
    open_started: float | None
    closed: bool
    closing: bool

    def mark_closing(self) -> None:
        """A close began (a second one returns at once)."""
        ...

    def mark_closed(self) -> None:
        """No save or restore is accepted any more."""
        ...

    async def wait(self) -> None:
        """Wait until every save so far is committed or failed in every tier."""
        ...


class Shutdown:
    """How an engine closes (see the module docstring)."""

    def __init__(self, engine: Closable) -> None:
        self.engine = engine
        # Whether a failed agreement of the close was logged (once per close).
        self.close_warned = False

    async def close(self, how: CloseMode) -> None:
        """Close, in one of three ways (see :data:`CloseMode`); never raises for a peer or a
        store that is gone, and never waits on one beyond the configured bounds."""
        if self.engine.closed or self.engine.closing:
            return
        self.engine.mark_closing()
        # A flush on SIGTERM in progress ends first (within its grace); none starts from now.
        await self.engine.preemption.finished()
        self.engine.rejoin.stop()
        if how != "collective":
            # The timeline's settling in the background stops here (leaving on an error, once
            # an attempt under way ends, within close_timeout); the tiers it was still settling
            # take no version of this run (only the normal end waits for it).
            bounded = how == "bounded" and self.engine.opened
            within = self.engine.cfg.coordination.close_timeout if bounded else 0.0
            await self.engine.timeline.stop(within=within)
        # The close decides every overlapped save: the caller confirmed what it could before
        # calling this (see CheckpointerCore._last_point); nothing can confirm the rest now.
        self.engine.stager.abandon(
            "the checkpointer closed before the snapshot was confirmed unchanged since save"
        )
        try:
            if how != "now" and self.engine.opened:
                await self._let_staging_finish()
            if how == "collective" and self.engine.opened:
                await self._close_collectively()
                return
            if how == "bounded" and self.engine.opened:
                await self._flush_bounded()
            await self._close_now()
        finally:
            self.engine.mark_closed()

    async def _let_staging_finish(self) -> None:
        """A save may still be staging (its caller was interrupted, by a KeyboardInterrupt say,
        while the copy ran on): let it finish and launch, so that the waits below see it as a
        save in flight instead of closing the tiers under it. Bounded by ``close_timeout``."""
        lock = self.engine.save_lock
        if not lock.locked():
            return
        try:
            await asyncio.wait_for(lock.acquire(), self.engine.cfg.coordination.close_timeout)
        except TimeoutError:
            logger.warning(
                "tiercheck: a save still staging after close_timeout is abandoned by the close"
            )
            return
        lock.release()

    async def _close_collectively(self) -> None:
        """The normal end: finish every save, then leave the store and the peers in order.

        1. wait for every save in flight (its writes, commit rounds and retention may use the
           store and other ranks);
        2. agree on the "control" channel that every rank is done saving -- from then on no
           rank sends requests to another's peer server;
        3. stop this rank's peer server: the last store traffic (bounded);
        4. agree that every rank has stopped serving -- from then on nothing touches the store
           or another rank, so a rank may leave (and the store's host with it) at once;
        5. release tiers, manifest and coordination groups locally.

        A rank or store that is gone makes an agreement fail: logged once at WARNING, and the
        close goes on without it.
        """
        try:
            await self.engine.wait()
            saved = True
        except Exception:
            logger.exception("tiercheck: finishing the saves in flight failed")
            saved = False
        await self.engine.timeline.stop()  # waiting only for a retry, if anything
        self.engine.mark_closed()
        await self._end_workers(cancel=False)
        collective = self.engine.channels.coordinator.world_size > 1
        if collective:
            await self._agree("every rank is done saving", Step.CLOSE_SAVED, SavesDone(saved))
        stopped = await self._stop_serving()
        if collective:
            await self._agree(
                "every rank has stopped serving", Step.CLOSE_STOPPED, ServingStopped(stopped)
            )
        await self._release(flush=True)

    async def _flush_bounded(self) -> None:
        """Leaving on an exception: give the saves in flight ``close_timeout`` seconds to
        settle, memory tiers first (local, then peer, then the rest). No agreement with the
        other ranks: they may be failing too. Once an exchange with the other ranks has
        failed, no pending save can commit any more (a commit needs every rank): stop there."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.engine.cfg.coordination.close_timeout
        for tier in self.engine.tiers:  # fastest first: the order of survival scopes
            futures = [
                future
                for job in self.engine.inflight
                if (future := job.handle.tier_future(tier.name)) is not None
            ]
            settled = _when_all_done(futures)
            while not settled.is_set():
                broken = self.engine.channels.coordinator.broken
                left = deadline - loop.time()
                if broken is None and left > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(settled.wait(), min(0.1, left))
                    continue
                logger.warning(
                    "tiercheck: leaving on an error; the saves still in flight in the %r tier "
                    "and after it are abandoned: %s",
                    tier.name,
                    f"an exchange with the other ranks failed ({broken})"
                    if broken is not None
                    else "still pending after close_timeout "
                    f"({self.engine.cfg.coordination.close_timeout:.0f}s)",
                )
                return

    async def _close_now(self) -> None:
        """Close without waiting for saves: cancel the pipeline, stop serving (bounded), release."""
        self.engine.mark_closed()
        pending = list(self.engine.inflight)  # cancelled round workers drop their jobs from the set
        await self._end_workers(cancel=True)
        for job in pending:  # whoever waits on their handles learns they never commit
            for name in job.handle.undecided_tiers():
                self.engine.pipes[name].fail(
                    job,
                    TierWriteFailed(
                        f"version {job.version} was abandoned in the {name!r} tier: the "
                        "checkpointer closed without waiting for it"
                    ),
                )
        self.engine.inflight.clear()
        await self._stop_serving()
        await self._release(flush=False)

    async def _end_workers(self, *, cancel: bool) -> None:
        """End the lane and round workers (and, when cancelling, the pipelines), bounded."""
        workers = [task for pipe in self.engine.pipes.values() for task in pipe.workers]
        for pipe in self.engine.pipes.values():
            pipe.end()
        tasks = [*workers, *self.engine.encoder.tasks] if cancel else workers
        if cancel:
            for task in tasks:
                task.cancel()
        if not tasks:
            return
        # Idle workers end at their sentinel within a turn of the loop; the grace only
        # matters after a failed wait(), when something may still block.
        _, stuck = await asyncio.wait(
            tasks, timeout=max(self.engine.cfg.coordination.close_timeout, 1.0)
        )
        for task in stuck:
            task.cancel()
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                logger.error("tiercheck: a pipeline worker failed: %r", task.exception())

    async def _stop_serving(self) -> bool:
        """Stop every tier's server (the peer tier's), each for at most ``close_timeout``."""
        stopped = True
        for tier in self.engine.tiers:
            if isinstance(tier, SupportsStopServing):
                try:
                    stopped &= await tier.stop_serving(self.engine.cfg.coordination.close_timeout)
                except Exception as exc:
                    logger.warning("tiercheck: stopping the %r tier's server: %r", tier.name, exc)
                    stopped = False
        return stopped

    async def _agree(self, what: str, which: Step, mine: SavesDone | ServingStopped) -> bool:
        """One agreement of the close on the "control" channel; a failure is logged once."""
        try:
            everyone = await step(self.engine.channels, which, mine)
        except Exception as exc:
            if not self.close_warned:
                self.close_warned = True
                logger.warning(
                    "tiercheck: closing without the other ranks: could not agree that %s (%s)",
                    what,
                    exc,
                )
            return False
        return all(e.ok for e in everyone)

    async def _release(self, *, flush: bool) -> None:
        """Release everything local. Touches neither the store nor another rank."""
        self.engine.encoder.drop_base()
        for tier in self.engine.tiers:
            try:
                await tier.aclose()
            except Exception:
                logger.exception("tiercheck: closing the %r tier failed", tier.name)
        self.engine.journal.close()  # local appends only
        try:
            self.engine.channels.close()
        except Exception:
            logger.exception("tiercheck: closing the coordination groups failed")
        self.engine.cpu.shutdown(wait=flush)
        self.engine.stager.close()
        claim = self.engine.claim
        started = self.engine.open_started
        if self.engine.opened or started is None:
            claim.lock.release()
        else:
            # The opening failed: what it made goes, and its lock with it.
            cfg = self.engine.cfg
            await clean_failed_opening(
                cfg.job.node_root, claim.lock, cfg.job.job_id, started, claim.durable
            )


def _when_all_done(futures: Sequence[concurrent.futures.Future[Any]]) -> asyncio.Event:
    """An event set once every future is done. The futures are neither awaited nor cancelled:
    they belong to the caller's save handles."""
    loop = asyncio.get_running_loop()
    settled = asyncio.Event()
    left = len(futures)
    lock = threading.Lock()
    if not futures:
        settled.set()

    def one_done(_: concurrent.futures.Future[Any]) -> None:
        nonlocal left
        with lock:
            left -= 1
            if left == 0:
                loop.call_soon_threadsafe(settled.set)

    for future in futures:
        future.add_done_callback(one_done)
    return settled
