"""After a restore the run goes on from the restored version; the first save settles it.

A restore reads and changes nothing stored: restoring an older version only to look at it,
then closing, leaves the job exactly as it was. What a restore decides is kept as a
:class:`Continuation`, and only when the run saves again (:meth:`Timeline.settle`, at the start
of the first save, before anything of it is written) is the job made to continue from there:

1. **Versions after the restored one** leave the run's timeline, or a later save of the same
   number would be mixed with them. In a tier that outlives the cluster, the committed ones are
   *set aside*, whole, as an abandoned set (:mod:`tiercheck.consistency.abandoned`): every rank
   copies its blobs there, then rank 0 copies their ``COMMIT`` records and writes the set's
   ``SET`` record, removes the ``COMMIT`` records, and only then does every rank remove its
   blobs. A death at any point leaves either the versions where they were (and at most a set
   without its ``SET``: copies) or a whole set. Pieces of versions that never committed are
   removed. Memory tiers drop them (they are not durable; their committed versions that matter
   are in the durable tier, or were the caller's to give up by going back).
2. **The world-size history**, when the run has another number of ranks than the versions'
   history says saves from here on, is recorded -- after step 1, so that no version the history
   would misdescribe is left on the timeline at any moment.

The memory tiers' part runs on the save's path (local work). The durable tiers' part runs on a
background task (:meth:`Timeline._work`), its exchanges on a channel of its own
(:data:`TIMELINE_CHANNEL`): until an attempt is over, each durable tier it settles holds the
new versions (:attr:`TierPipeline.timeline_ready <tiercheck.engine.commit.tier.TierPipeline>`
clear), so a store that hangs or refuses right after a restart stalls no save. The save waits for
the first attempt only where it must: a durable tier holds (or may hold) committed versions after
the restored one (:attr:`Continuation.newer_durable`: once the save returns they are off the
timeline, or a crash would bring the abandoned timeline back), or the world-size record is owed
(no version of this world is stored before the history says so).

A durable tier where either step fails (an outage) takes no new versions (each is skipped for
it, with the reason) until a retry succeeds; a retry is signalled every :data:`RETRY_EVERY`
saves after the first, at the same save on every rank. A durable tier the job could not reach
when it opened is owed its part without trying, and settles it as soon as it is claimed
(:meth:`Timeline.rejoined`, see :mod:`tiercheck.engine.open.rejoin`). A version is never written
over blobs that another timeline left there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

from tiercheck.engine.collectives import Channels
from tiercheck.engine.open.claim import Claim
from tiercheck.engine.options import RESERVED_CHANNELS, Options
from tiercheck.engine.part import RankPart
from tiercheck.engine.restore.setaside import Continuation, SetAsideFailed, set_aside

if TYPE_CHECKING:
    from tiercheck.engine.commit.tier import TierPipeline

__all__ = ["RETRY_EVERY", "TIMELINE_CHANNEL", "Continuation", "Timeline"]

logger = logging.getLogger("tiercheck")

#: A durable tier whose settling failed is tried again every this many saves.
RETRY_EVERY = 10

#: The channel the background worker's exchanges run on (nothing else uses it).
TIMELINE_CHANNEL = RESERVED_CHANNELS[2]

_STOPPED = "the checkpointer stopped settling the timeline after a restore"


class Timeline(RankPart):
    """Settles, after a restore, the timeline the run continues: the memory tiers at the first
    save, the durable ones in the background (see the module docstring)."""

    def __init__(
        self,
        options: Options,
        claim: Claim,
        channels: Channels,
        pipes: Mapping[str, TierPipeline],
    ) -> None:
        super().__init__(options, claim, pipes)
        self.channels = channels
        self._pending: Continuation | None = None
        # What could not be settled yet: per durable tier, the continuation still owed there;
        # and whether the world-size record is still owed (it needs every durable tier).
        self._owed: dict[str, Continuation] = {}
        self._world_owed: int | None = None
        # Whether this opening saved anything yet (its first save may owe the history).
        self._saved = False
        # Tiers claimed again after an outage, not unblocked yet (see rejoined).
        self._rejoined: set[str] = set()
        # The background worker settling what is owed, while there is any; clear while it is
        # in an attempt (its exchanges under way); saves since it was started, and the signal
        # of a retry (every RETRY_EVERY of them).
        self._worker: asyncio.Task[None] | None = None
        self._attempt_over = asyncio.Event()
        self._attempt_over.set()
        self._since_start = 0
        self._retry_due = asyncio.Event()

    def continue_from(self, continuation: Continuation) -> None:
        """A restore chose where the run goes on from; settled at the next save."""
        self._pending = continuation

    @property
    def newest_on_timeline(self) -> int | None:
        """While a restore's continuation is not settled yet, the newest version on the run's
        timeline (the restored one; ``-1``: none): newer ones still stored leave it at the next
        save. ``None`` when no continuation is pending."""
        return None if self._pending is None else self._pending.version

    async def settle(self, version: int) -> None:
        """At the start of the save of ``version`` (every rank, in the same order): settle a
        pending continuation (the memory tiers now, the durable ones in the background, before
        anything of this run's versions is written there), or signal a retry of what could
        not be settled before. Never raises for a tier's failure: that tier takes no new
        versions until a retry succeeds."""
        first_save, self._saved = not self._saved, True
        pending, self._pending = self._pending, None
        if pending is not None:
            # A new continuation replaces whatever an earlier one still owed: its set-aside
            # covers every version after the (older or equal) version restored now.
            self._owed.clear()
            self._world_owed = None
            await self._settle(pending)
            return
        if first_save and self._world_owed is None and self.claim.needs_world_record(version):
            # A run that restored nothing (or never asked) on a job with a world-size history:
            # its versions are this world's from the first one on, whatever the history said
            # of versions that were never stored or were lost with a node's memory.
            self._world_owed = version
            self._start()
            await self._attempt_over.wait()  # see _settle
            return
        if self._worker is None:
            if self._owed.keys() - self.claim.pending or self._world_owed is not None:
                self._start()  # owed still, after a restore stopped the worker (see quiesce)
            return
        self._since_start += 1
        if self._since_start % RETRY_EVERY == 0:
            self._hold()
            self._retry_due.set()

    async def _settle(self, c: Continuation) -> None:
        first = c.version + 1
        logger.info(
            "tiercheck: job %r goes on from version %s; versions from %s on leave its "
            "timeline (%s)",
            self.job_id,
            c.version,
            first,
            c.reason,
        )
        for pipe in self.pipes.values():
            if pipe.durable:
                # Unreachable since the job opened (pending): nothing is written there before
                # it is claimed, and then this comes first (rejoined). Else the worker's.
                self._owed[pipe.name] = c
            else:
                await pipe.truncate_from(first, f"abandoned: {c.reason}")
        if self.claim.needs_world_record(first):
            self._world_owed = first
        self._start()
        if c.newer_durable or self._world_owed is not None:
            # Committed versions after the restored one are durable (the run went back on
            # purpose, or may have): once this save returns they must be off the timeline, or
            # a crash now would bring the abandoned timeline back. Likewise the world-size
            # history: no version of this world may be stored before it says so. The save
            # waits for the first attempt then; a restart from the newest version on as many
            # ranks has nothing to set aside there and never waits.
            await self._attempt_over.wait()

    # --- the background worker ----------------------------------------------------------------

    def _targets(self) -> list[TierPipeline]:
        """The tiers that wait for the worker's next attempt: the durable tiers it settles
        (every one, while the world-size record is owed)."""
        return [
            p
            for p in self.pipes.values()
            if p.durable
            and p.name not in self.claim.pending
            and (p.name in self._owed or self._world_owed is not None)
        ]

    def _hold(self) -> None:
        """The targets of the next attempt take no version until it is over; a blocked one
        gets a base first (it holds no base of the run's deltas)."""
        targets = self._targets()
        if any(p.blocked is not None for p in targets):
            targets[0].rebase()
        for pipe in targets:
            pipe.timeline_ready.clear()

    def _release(self) -> None:
        for pipe in self.pipes.values():
            pipe.timeline_ready.set()

    def _start(self) -> None:
        """Start the worker (every rank at the same save): its first attempt now."""
        if not self._targets() and self._world_owed is None:
            self._unblock_settled()
            return
        self._hold()
        self._since_start = 0
        self._retry_due.clear()
        self._attempt_over.clear()
        self._worker = asyncio.create_task(self._work())

    async def _work(self) -> None:
        """Attempt what is owed; while anything still is, again at each retry signal. Its
        exchanges run on their own channel, so that nothing on the save's path waits for them
        (an outage of durable storage right after a restart stalls no save)."""
        try:
            while True:
                try:
                    await self._attempt()
                except asyncio.CancelledError:
                    # Stopped in an attempt: blocked before the tiers are released below, or
                    # a version waiting on them would go in over what was not settled.
                    self._block_owed(_STOPPED)
                    raise
                except Exception:
                    # A bug, not a tier's failure (those block the tier inside): what the
                    # attempt did not finish stays owed, and its tiers take no version.
                    logger.exception("tiercheck: settling the timeline after a restore failed")
                    self._block_owed("settling the timeline after a restore failed (logged)")
                finally:
                    self._attempt_over.set()
                    self._release()
                if not self._owed.keys() - self.claim.pending and self._world_owed is None:
                    return
                await self._retry_due.wait()
                self._retry_due.clear()
                self._attempt_over.clear()
        finally:
            self._attempt_over.set()
            self._worker = None

    async def _attempt(self) -> None:
        # A tier pending now is settled once it is claimed (rejoined), not here.
        todo = [(n, c) for n, c in sorted(self._owed.items()) if n not in self.claim.pending]
        for name, continuation in todo:
            if await self._set_aside_or_block(self.pipes[name], continuation, TIMELINE_CHANNEL):
                self._owed.pop(name, None)
        if self._world_owed is not None:
            await self._record_world(self._world_owed)
        self._unblock_settled()

    async def quiesce(self) -> None:
        """Before a restore (which reads the tiers and may set a new continuation): let an
        attempt under way end, then stop the worker; what is still owed stays owed."""
        await self._attempt_over.wait()
        await self.stop()

    async def stop(self, within: float = 0.0) -> None:
        """Stop the worker (closing), once an attempt under way is over or ``within`` seconds
        have passed. Cancelled in an attempt, each version is still whole where it was or in
        its abandoned set (the steps are ordered for a death at any point); the tiers it was
        settling take no version of this run."""
        worker = self._worker
        if worker is None:
            return
        if within > 0 and not self._attempt_over.is_set():
            # A close bounded in time lets the saves waiting on this attempt reach the tier
            # when it ends in time (a store that is only slow), instead of failing them.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._attempt_over.wait(), within)
        worker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await worker
        if not self._attempt_over.is_set():
            # Cancelled before its first step ran (its own handling above never did).
            self._block_owed(_STOPPED)
            self._attempt_over.set()
            self._worker = None
        self._release()

    def _block_owed(self, reason: str) -> None:
        """The durable tiers still owed their part take no version (``reason``)."""
        for pipe in self.pipes.values():
            if pipe.durable and (pipe.name in self._owed or self._world_owed is not None):
                pipe.block(reason)

    # --- attempts -----------------------------------------------------------------------------

    async def _set_aside_or_block(
        self, pipe: TierPipeline, c: Continuation, channel: str = "control"
    ) -> bool:
        """Set the versions after ``c.version`` aside in ``pipe``'s tier; ``False`` (and the
        tier blocked, ``c`` owed there) when that failed."""
        try:
            failed = await set_aside(pipe, c, self.claim, self.channels, channel)
        except Exception as exc:
            # An exchange with the other ranks failed (a rank is gone or silent): where the
            # protocol stopped, each version is still whole where it was or in its set.
            failed = SetAsideFailed(
                "agreeing with the other ranks",
                "each version is whole where it was or in its abandoned set",
                [f"{type(exc).__name__}: {exc}"],
            )
        if failed is None:
            return True
        self._failed(pipe, c, failed)
        return False

    async def _record_world(self, first: int) -> None:
        try:
            error = await self.claim.record_world(first, channel=TIMELINE_CHANNEL)
        except Exception as exc:  # an exchange with the other ranks failed
            error = f"{type(exc).__name__}: {exc}"
        if error is None:
            self._world_owed = None
            return
        self._world_owed = first
        for pipe in self.pipes.values():
            if pipe.durable:
                pipe.block(
                    "the job record could not be updated for this run's "
                    f"{self.topo.world_size} ranks ({error}); retried every {RETRY_EVERY} "
                    "saves"
                )

    def _unblock_settled(self) -> None:
        for pipe in self.pipes.values():
            if (
                pipe.blocked
                and pipe.name not in self._owed
                and self._world_owed is None
                and pipe.name not in self.claim.pending
                and pipe.name not in self.claim.refused
            ):
                pipe.unblock(announced=pipe.name in self._rejoined)
                self._rejoined.discard(pipe.name)

    async def rejoined(self, name: str) -> None:
        """The durable tier ``name``, unreachable since the job opened, is claimed now (at the
        start of a save, every rank alike: :mod:`tiercheck.engine.open.rejoin`): settle what it is
        owed, then let it take versions. A continuation still pending is settled by this same
        save's :meth:`settle`, which the tier is part of now, and which unblocks it."""
        self._rejoined.add(name)  # claimed with a WARNING that says so already
        if self._pending is not None:
            return
        owed = self._owed.pop(name, None)
        if owed is not None:
            await self._set_aside_or_block(self.pipes[name], owed)
        self._unblock_settled()

    def _failed(self, pipe: TierPipeline, c: Continuation, failed: SetAsideFailed) -> None:
        rank, error = failed.first()
        self._owed[pipe.name] = c
        reason = (
            f"the versions after {c.version} could not be set aside in it ({failed.step}: rank "
            f"{rank}: {error}); {failed.kept}, and the tier takes no new versions until they are "
            f"set aside (retried every {RETRY_EVERY} saves)"
        )
        logger.error("tiercheck: the %r tier of job %r: %s", pipe.name, self.job_id, reason)
        pipe.block(reason)
