"""One tier's writer lane: encoded versions in, written blobs out, one at a time, in order.

The encoder offers each encoded version to the lane of every tier it goes to
(:meth:`Lane.offer`); a lane ``tier_queue`` versions behind (:func:`~tiercheck.engine.save.plan.
queue_full`) holds no more of training's memory: it passes over the oldest versions waiting,
never the newest whole one (:func:`~tiercheck.engine.save.plan.make_room`); and a durable tier that
failed a write (an outage) sends the newest whole version next, passing over every older one
that waited meanwhile (:func:`~tiercheck.engine.save.plan.catch_up`). The lane worker
(:meth:`Lane.run`) writes each blob -- in a memory tier, whose blobs are restorable
once there, only after the caller confirmed an overlapped snapshot unchanged
(:meth:`~tiercheck.engine.jobs.Job.unconfirmed`) --, records it as written in the pipeline's
holdings and the manifest, and reports the outcome to the job; the pipeline's commit round
(:mod:`tiercheck.engine.commit.commit`) takes it from there.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tiercheck.codec import BlobMeta
from tiercheck.consistency.keys import blob_key
from tiercheck.engine.jobs import Holder, Job
from tiercheck.engine.save.plan import Kept, Waiting, catch_up, make_room, queue_full
from tiercheck.errors import PeerUnavailable, Superseded, TierWriteFailed
from tiercheck.tiers.base import Buffer

if TYPE_CHECKING:
    from tiercheck.engine.commit.pipe import Pipe as TierPipeline

__all__ = ["Lane", "LaneItem"]

logger = logging.getLogger("tiercheck")


@dataclass(eq=False, slots=True)
class LaneItem:
    """What waits in a tier's lane: the job, the blob's parts and its metadata."""

    job: Job
    parts: list[Buffer]
    meta: BlobMeta
    #: The staged snapshot's holder, while the parts are views of its memory: taken when the
    #: lane queues them, given back once when they are written or passed over.
    hold: Holder | None = None

    def let_go(self) -> None:
        """Give back the hold on the snapshot's memory, if this item still has one."""
        hold, self.hold = self.hold, None
        if hold is not None:
            hold.drop()


class Lane:
    """The writer worker of one tier's pipeline, and its queue."""

    def __init__(self, pipe: TierPipeline) -> None:
        self.pipe = pipe
        #: Encoded versions waiting to be written; ``None`` ends the worker.
        self.queue: asyncio.Queue[LaneItem | None] = asyncio.Queue()
        #: The version the worker is writing now, if any.
        self.writing: int | None = None

    def offer(self, job: Job, parts: list[Buffer], meta: BlobMeta, *, views: bool) -> bool:
        """Queue an encoded version for writing; ``False`` when it is dropped for this tier
        (the tier is blocked, or ``tier_queue`` versions behind and it is not among the newest
        whole ones: :func:`~tiercheck.engine.save.plan.make_room`).

        ``views``: the parts are views of the job's staged snapshot (a blob stored as is,
        :attr:`~tiercheck.defaults.EncodingKind.as_is`): the lane holds that memory while the
        blob waits and is written, and gives it back exactly once.
        """
        tier_queue = self.pipe.options.tiers.tier_queue
        if self.pipe.blocked is not None and self.pipe.timeline_ready.is_set():
            self.pipe.skip(job, self.pipe.refusal())
            return False
        item = LaneItem(job, parts, meta)
        if views and job.holder is not None:
            job.holder.acquire()
            item.hold = job.holder
        if queue_full(self.queue.qsize(), tier_queue):
            return self._keep(make_room, f"it is {tier_queue} versions behind", item)
        self.queue.put_nowait(item)
        return True

    def _keep(
        self,
        rule: Callable[[Sequence[Waiting], Collection[int], int], Kept],
        why: str,
        offered: LaneItem | None = None,
    ) -> bool:
        """Keep what ``rule`` keeps of the versions waiting (and ``offered``), in order; pass
        over the rest, saying ``why``. Returns whether ``offered`` stays."""
        pipe, queue = self.pipe, self.queue
        items: list[LaneItem] = []
        ended = False
        while not queue.empty():
            item = queue.get_nowait()
            if item is None:
                ended = True
            else:
                items.append(item)
        if offered is not None:
            items.append(offered)
        held = {*pipe.committed, *pipe.own, *([] if self.writing is None else [self.writing])}
        waiting = [
            Waiting(i.job.version, None if i.meta.base is None else i.meta.base.version)
            for i in items
        ]
        kept = rule(waiting, held, pipe.options.tiers.tier_queue).keep
        keeps = f"it keeps {', '.join(map(str, kept))}" if kept else "none waiting is whole"
        for item in items:
            job = item.job
            if job.version in kept:
                queue.put_nowait(item)
                continue
            job.lane_done(
                pipe.name,
                None,
                TierWriteFailed(
                    f"version {job.version} was passed over for the {pipe.name!r} tier: {why}, "
                    f"and the newest whole versions go first ({keeps})"
                ),
            )
            item.let_go()
        if ended:
            queue.put_nowait(None)
        return offered is not None and offered.job.version in kept

    async def run(self) -> None:
        """Write blobs to the tier, one at a time, in version order."""
        pipe = self.pipe
        tier, queue = pipe.tier, self.queue
        while True:
            item = await queue.get()
            if item is None:
                return
            job, parts, meta = item.job, item.parts, item.meta
            key = blob_key(job.version, pipe.rank, meta.kind)
            self.writing = job.version
            try:
                # After a restore, nothing of the run's new versions is written here before
                # the timeline is settled for the tier; whether it takes them is known then.
                if not await pipe.takes_new():
                    pipe.skip(job, pipe.refusal())
                    continue
                if not pipe.durable:
                    # A memory tier has no COMMIT record: a blob there is restorable, so one
                    # of a torn snapshot must never get there.
                    why = await job.unconfirmed()
                    if why is not None:
                        job.lane_done(tier.name, None, why)
                        continue
                if pipe.durable:
                    await pipe.claim.check(tier)
                await tier.putv(key, parts)
            except Exception as exc:
                if isinstance(exc, PeerUnavailable):
                    pipe.peer_trouble(f"writing {key}", exc)
                elif not isinstance(exc, Superseded):
                    logger.warning(
                        "tiercheck: writing %s to the %r tier failed: %r", key, tier.name, exc
                    )
                job.lane_done(
                    tier.name,
                    None,
                    TierWriteFailed(
                        f"version {job.version} could not be written to the "
                        f"{tier.name!r} tier: {exc!r}"
                    ),
                    cause=exc,
                )
                if pipe.durable and not isinstance(exc, Superseded) and not queue.empty():
                    # The tier is down, or was: what waited meanwhile is stale.
                    self.writing = None
                    self._keep(catch_up, f"writing version {job.version} failed")
            else:
                job.lane_done(tier.name, pipe.record_written(job, key, meta))
            finally:
                self.writing = None
                item.let_go()
                # Do not keep the last blob alive while waiting for the next one.
                del item, parts
