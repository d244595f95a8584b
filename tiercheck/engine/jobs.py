"""One save as it travels through the engine, and the memory it holds on to."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from tiercheck.codec import Layout, RawState
from tiercheck.consistency.manifest import Written
from tiercheck.engine.options import TierEncoding
from tiercheck.engine.results import SaveHandle
from tiercheck.engine.save.staging import SnapshotCopy
from tiercheck.errors import SaveSkipped, TierWriteFailed
from tiercheck.tiers.base import Reservation

__all__ = ["VERDICT_POLL_S", "BaseInMemory", "Holder", "InFlight", "Job", "LaneResult", "OwnBlob"]

logger = logging.getLogger("tiercheck")

#: The longest interval at which the pipeline looks whether an overlapped snapshot was
#: confirmed (see :meth:`Job.unconfirmed`).
VERDICT_POLL_S = 0.01


class Holder:
    """Reference count on a staging buffer or reservation; frees it when the last user is done."""

    def __init__(self, release: Callable[[], None]) -> None:
        self._release: Callable[[], None] | None = release
        self._refs = 1

    def acquire(self) -> None:
        """One more user of the memory."""
        self._refs += 1

    def drop(self) -> None:
        """One user fewer; the last one frees the memory."""
        self._refs -= 1
        if self._refs < 0:
            # More drops than holds: the memory was freed while a user still read it. A bug
            # in tiercheck; said loudly, never raised into the save that found it.
            logger.error("tiercheck: a snapshot's memory was given back more often than held")
        if self._refs == 0 and self._release is not None:
            # Forget the callback too: it references the memory, which must not outlive this.
            release, self._release = self._release, None
            release()


@dataclass(frozen=True, slots=True)
class LaneResult:
    """How writing one version to one tier ended, for this rank: written, or why not."""

    written: Written | None
    error: BaseException | None = None


@dataclass(eq=False)
class Job:
    """One save, from the snapshot to the last tier's commit round."""

    version: int
    kind: Literal["base", "delta", "skipped"]
    base_version: int | None
    targets: dict[str, TierEncoding]
    handle: SaveHandle
    started: float
    layout: Layout | None = None
    #: On a node's first rank other than rank 0: the paths of the ``Replicated`` values (see
    #: :func:`tiercheck.engine.stateful.for_save`), left out of its blobs in durable tiers.
    replicated_paths: tuple[tuple[Any, ...], ...] | None = None
    payload: torch.Tensor | None = None
    # The snapshot copy still running after save returned (overlapped saves only).
    copy: SnapshotCopy | None = None
    #: Overlapped saves: resolved once the caller confirmed the state unchanged between
    #: ``save`` and the copy's end (:attr:`SnapshotCopy.confirmed`); ``None`` for a blocking
    #: save. No tier makes the version restorable before: see :meth:`unconfirmed`.
    confirmed: concurrent.futures.Future[None] | None = None
    holder: Holder | None = None
    reservation: Reservation | None = None
    #: The task publishing the snapshot staged in :attr:`reservation` once confirmed.
    publish: asyncio.Task[None] | None = None
    _verdict: asyncio.Task[BaseException | None] | None = None
    # The tier the snapshot was reserved in (copied in place), if any.
    reserved_in: str | None = None
    #: The job launched through the pipeline before this one (it encodes first); dropped
    #: once it is encoded, so that a chain of finished jobs does not keep their memory alive.
    previous: Job | None = None
    encoded: asyncio.Event = field(default_factory=asyncio.Event)
    results: dict[str, asyncio.Future[LaneResult]] = field(default_factory=dict)
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    rounds_left: int = 0

    def staged_in(
        self,
        payload: torch.Tensor,
        holder: Holder,
        reservation: Reservation | None = None,
        reserved_in: str | None = None,
    ) -> None:
        """The snapshot's memory: ``payload``, freed through ``holder``; copied in place in
        ``reservation`` of the tier ``reserved_in``, if any."""
        self.payload, self.holder = payload, holder
        self.reservation, self.reserved_in = reservation, reserved_in

    def copying(self, copy: SnapshotCopy) -> None:
        """An overlapped snapshot: ``copy`` runs on after save returned, and the version waits
        for its confirmation."""
        self.copy = copy
        self.confirmed = copy.confirmed
        self.handle.staging(copy.done)

    async def copied(self) -> None:
        """Wait until the overlapped snapshot's copy is done (at once for a blocking save)."""
        if self.copy is not None:
            await asyncio.wrap_future(self.copy.done)
            self.copy = None

    def publishing(self, task: asyncio.Task[None]) -> None:
        """``task`` publishes the snapshot staged in :attr:`reservation` once confirmed."""
        self.publish = task

    def take_publish(self) -> asyncio.Task[None] | None:
        """The publishing task, if any, which the job no longer holds."""
        publish, self.publish = self.publish, None
        return publish

    def let_go(self) -> None:
        """The job is encoded and published: the holder (and, for a base, the encoder's base
        in memory) keeps the payload for as long as it is needed; the job itself must not, or
        finished saves would pin their memory."""
        self.payload = None
        self.reservation = None

    def skip_everywhere(self) -> None:
        """Back-pressure skipped the version: nothing is encoded, and each target tier's
        result is :class:`~tiercheck.errors.SaveSkipped`."""
        self.encoded.set()
        for name in self.targets:
            self.lane_done(name, None, SaveSkipped(f"version {self.version} was skipped"))

    def launch(self, previous: Job | None) -> None:
        """The job enters its tiers' pipelines after ``previous`` (``None``: not encoded
        through the pipeline, or the first): one result and one commit round per target."""
        self.previous = previous
        loop = asyncio.get_running_loop()
        for name in self.targets:
            if name not in self.results:
                self.results[name] = loop.create_future()
        self.rounds_left = len(self.targets)
        if not self.targets:
            self.finished.set()

    async def after_previous(self) -> None:
        """Wait until the job launched before this one is encoded (deltas go in order)."""
        if self.previous is not None:
            await self.previous.encoded.wait()
            self.previous = None

    def round_over(self) -> bool:
        """One of the job's commit rounds is over; ``True`` once the last one is."""
        self.rounds_left -= 1
        if self.rounds_left == 0:
            self.finished.set()
            return True
        return False

    def encode_as_base(self) -> None:
        """Planned as a delta, but its base is not in memory when it is encoded
        (:func:`~tiercheck.engine.save.plan.base_unusable`): it is encoded, and reported, as a
        base. (:attr:`base_version` stays: it is what was planned.)"""
        self.kind = "base"
        self.handle.stats.kind = "base"

    async def unconfirmed(self) -> BaseException | None:
        """Wait until the snapshot is confirmed: ``None``, or why the version must not be
        stored (:meth:`staged_failure` of it). At once for a blocking save."""
        if self.confirmed is None:
            return None
        if self._verdict is None:
            self._verdict = asyncio.get_running_loop().create_task(self._await_verdict())
        # Shared by every waiter of the job; one giving up must not cancel it for the others.
        return await asyncio.shield(self._verdict)

    async def _await_verdict(self) -> BaseException | None:
        """Poll :attr:`confirmed` (backing off up to :data:`VERDICT_POLL_S`).

        Polled rather than woken: the caller resolves it at its fence, and a wakeup from there
        would hand the interpreter lock to this loop's pipeline right at the fence, stalling
        the training thread for the pipeline's burst of work (measured: 3 to 10 ms at a fence
        whose copy was done). Polling costs at most that many milliseconds of commit latency.
        """
        fut = self.confirmed
        assert fut is not None
        delay = 0.001
        while not fut.done():
            await asyncio.sleep(delay)
            delay = min(2 * delay, VERDICT_POLL_S)
        error = fut.exception()
        return None if error is None else self.staged_failure(error)

    def staged_failure(self, exc: BaseException) -> TierWriteFailed:
        """The error each tier reports for a version whose snapshot failed (``exc`` as cause)."""
        error = TierWriteFailed(f"version {self.version} could not be staged: {exc!r}")
        error.__cause__ = exc
        return error

    def lane_done(
        self,
        tier: str,
        written: Written | None,
        error: BaseException | None = None,
        *,
        cause: BaseException | None = None,
    ) -> None:
        """This rank's write of the version to ``tier`` ended (the first word counts)."""
        fut = self.results.get(tier)
        if fut is None:  # decided while staging, before the job was launched
            fut = self.results[tier] = asyncio.get_running_loop().create_future()
        if fut.done():
            return
        if error is not None and cause is not None:
            error.__cause__ = cause
        fut.set_result(LaneResult(written, error))


@dataclass(frozen=True, slots=True)
class OwnBlob:
    """A blob of this rank in a tier: its key, and the version it is a delta on."""

    key: str
    base: int | None


@dataclass(frozen=True, slots=True)
class BaseInMemory:
    """The newest base's raw state, kept in memory to encode the next deltas against."""

    raw: RawState
    holder: Holder
    #: What durable tiers hold of it, where that is not ``raw`` (see :meth:`for_tier`).
    lean: RawState | None = None

    def for_tier(self, durable: bool) -> RawState:
        """The base a tier's deltas are encoded against: the one that tier stores."""
        return self.lean if durable and self.lean is not None else self.raw


class InFlight:
    """The saves whose commit rounds are not all over yet (in launch order)."""

    def __init__(self) -> None:
        self._jobs: dict[Job, None] = {}

    def add(self, job: Job) -> None:
        """``job`` was launched."""
        self._jobs[job] = None

    def discard(self, job: Job) -> None:
        """``job``'s rounds are all over (or it was given up)."""
        self._jobs.pop(job, None)

    def clear(self) -> None:
        """Forget every job (a close gave them up)."""
        self._jobs.clear()

    def __iter__(self) -> Iterator[Job]:
        return iter(list(self._jobs))

    def __len__(self) -> int:
        return len(self._jobs)

    def oldest_version(self, default: int) -> int:
        """The lowest version still in flight, or ``default`` when none is."""
        return min((j.version for j in self._jobs), default=default)

    async def drain(self) -> None:
        """Wait until every job launched so far (and any launched meanwhile) finished."""
        while self._jobs:
            job = next(iter(self._jobs))
            await job.finished.wait()
            self.discard(job)
