"""One tier's writer lane: encoded versions in, written blobs out, one at a time, in order.

The encoder offers each encoded version to the lane of every tier it goes to
(:meth:`Lane.offer`); a lane ``tier_queue`` versions behind drops the version for its tier
rather than hold training's memory (:func:`~tiercheck.engine.plan.queue_full`). The lane
worker (:meth:`Lane.run`) writes each blob -- in a memory tier, whose blobs are restorable
once there, only after the caller confirmed an overlapped snapshot unchanged
(:meth:`~tiercheck.engine.jobs.Job.unconfirmed`) --, records it as written in the pipeline's
holdings and the manifest, and reports the outcome to the job; the pipeline's commit round
(:mod:`tiercheck.engine.commit`) takes it from there.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from tiercheck.codec import BlobMeta
from tiercheck.consistency.keys import BlobKind, blob_key
from tiercheck.engine.jobs import Job
from tiercheck.engine.plan import queue_full
from tiercheck.errors import PeerUnavailable, Superseded, TierWriteFailed
from tiercheck.tiers.base import Buffer

if TYPE_CHECKING:
    from tiercheck.engine.pipe import Pipe as TierPipeline

__all__ = ["Lane", "LaneItem"]

logger = logging.getLogger("tiercheck")

#: What waits in a tier's lane: the job, the blob's parts, and its metadata.
LaneItem = tuple[Job, list[Buffer], BlobMeta]


class Lane:
    """The writer worker of one tier's pipeline, and its queue."""

    def __init__(self, pipe: TierPipeline) -> None:
        self.pipe = pipe
        #: Encoded versions waiting to be written; ``None`` ends the worker.
        self.queue: asyncio.Queue[LaneItem | None] = asyncio.Queue()

    def offer(self, job: Job, parts: list[Buffer], meta: BlobMeta) -> bool:
        """Queue an encoded version for writing; ``False`` (and the version dropped for this
        tier) when the tier is ``tier_queue`` versions behind."""
        tier_queue = self.pipe.options.tiers.tier_queue
        if self.pipe.blocked is not None:
            self.pipe.skip(
                job,
                TierWriteFailed(
                    f"the {self.pipe.name!r} tier takes no new versions for now: "
                    f"{self.pipe.blocked}"
                ),
            )
            return False
        if queue_full(self.queue.qsize(), tier_queue):
            job.lane_done(
                self.pipe.name,
                None,
                TierWriteFailed(
                    f"the {self.pipe.name!r} tier is {tier_queue} versions behind; "
                    f"version {job.version} was dropped for it"
                ),
            )
            return False
        self.queue.put_nowait((job, parts, meta))
        return True

    async def run(self) -> None:
        """Write blobs to the tier, one at a time, in version order."""
        pipe = self.pipe
        tier, queue = pipe.tier, self.queue
        while True:
            item = await queue.get()
            if item is None:
                return
            job, parts, meta = item
            kind: BlobKind = "full" if meta.kind == "full" else "packed"
            key = blob_key(job.version, pipe.rank, kind)
            try:
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
            else:
                job.lane_done(tier.name, pipe.record_written(job, key, meta))
            finally:
                if kind == "full" and job.holder is not None:
                    job.holder.drop()
                # Do not keep the last blob alive while waiting for the next one.
                del item, parts
