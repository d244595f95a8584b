"""The flush on SIGTERM: the newest version committed in memory made durable, within a grace.

:class:`Preemption` runs on the engine's loop when the process gets SIGTERM (the handler is
:mod:`tiercheck.engine.close.sigterm`'s). In order, each phase bounded by one deadline (the signal's
time plus ``preemption_grace``):

1. the save in progress, if any, launches (the save lock);
2. step ``PREEMPT_BEGIN``: the ranks learn the newest version every one of them launched (the
   *horizon*: a rank that got the signal one save ahead waits for nothing the others never
   send);
3. the saves in flight up to the horizon finish in the memory tiers (half the time left at
   most);
4. step ``PREEMPT_OFFER``: the ranks agree on the newest version committed in memory on every
   rank, and on the durable tiers that hold nothing as new
   (:func:`~tiercheck.consistency.preempt.choose_flush`);
5. per such tier: each rank reads its blob of that version back from memory (verified, with its
   base), encodes it as a base in the tier's encoding and writes it there -- unless the
   version's own save targets the tier, which is waited for instead --; step ``PREEMPT_VOTE``;
   rank 0 writes the ``COMMIT`` record; step ``PREEMPT_ACK``;
6. what is left of the grace goes to the saves up to the horizon still in flight in the
   durable tiers (their own rounds: a slow store's queue), which the end of the process would
   otherwise cut short.

Every exchange is on the ``"preempt"`` channel, never a tier's own: a rank that gives up (its
grace ran out) leaves no tier's commit rounds out of step, only that channel, which this
engine then uses no more. A flush never raises: it logs what became of it and returns a
:class:`FlushReport`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from tiercheck.codec import RawState
from tiercheck.consistency.keys import blob_key, commit_key
from tiercheck.consistency.preempt import (
    FlushVote,
    PreemptBegin,
    PreemptOffer,
    choose_flush,
    flush_horizon,
    flush_outcome,
    flush_record,
)
from tiercheck.consistency.protocol import AckReason, CommitAck, Message, Step
from tiercheck.engine.collectives import Channels, step
from tiercheck.engine.commit.tier import TierPipeline
from tiercheck.engine.jobs import InFlight
from tiercheck.engine.journal import Journal
from tiercheck.engine.open.claim import Claim
from tiercheck.engine.options import RESERVED_CHANNELS, Options
from tiercheck.engine.restore.read import Reader
from tiercheck.engine.restore.restore import Restorer
from tiercheck.engine.restore.timeline import Timeline
from tiercheck.engine.results import CheckpointerStats
from tiercheck.engine.save.encode import encode_blob
from tiercheck.engine.save.schedule import Schedule
from tiercheck.errors import PeerUnavailable, Superseded

__all__ = ["PREEMPT_CHANNEL", "FlushReport", "Flushable", "Preemption"]

logger = logging.getLogger("tiercheck")

#: The coordination channel of the flush's steps (one gloo group of its own).
PREEMPT_CHANNEL = RESERVED_CHANNELS[1]

M = TypeVar("M", bound=Message)


class _GaveUp(Exception):
    """The flush ran out of its grace, or lost the other ranks."""


@dataclass(frozen=True)
class FlushReport:
    """What one flush on SIGTERM did.

    Attributes:
        version: the version it made durable (or found durable), ``None`` when none was chosen.
        durable: the tiers where the flush committed it.
        already: the tiers where its own save had committed it meanwhile.
        failed: the tiers where it could not be committed, with why.
        why: why nothing (more) was done, in words ("" when everything was).
        trouble: whether something went wrong (a rank refused or did not answer, the grace ran
            out, a tier could not take the version): versions are left only in memory that
            the flush should have made durable.
        seconds: how long the flush took.
    """

    version: int | None = None
    durable: tuple[str, ...] = ()
    already: tuple[str, ...] = ()
    failed: Mapping[str, str] = field(default_factory=dict)
    why: str = ""
    trouble: bool = False
    seconds: float = 0.0


class Flushable(Protocol):
    """What the flush needs of the engine (:class:`~tiercheck.engine.engine.Engine`, which
    holds the :class:`Preemption`: a narrow view, so that this module does not import that one)."""

    cfg: Options
    stats: CheckpointerStats
    journal: Journal
    claim: Claim
    channels: Channels
    pipes: dict[str, TierPipeline]
    inflight: InFlight
    schedule: Schedule
    timeline: Timeline
    restorer: Restorer
    cpu: ThreadPoolExecutor
    save_lock: asyncio.Lock
    opened: bool
    closing: bool
    closed: bool


class Preemption:
    """The flush on SIGTERM of one engine (see the module docstring)."""

    def __init__(self, engine: Flushable) -> None:
        self.engine = engine
        self.options = engine.cfg
        self.rank = engine.cfg.job.topology.rank
        # The engine's parts, which live as long as it does.
        self.stats = engine.stats
        self.journal = engine.journal
        self.claim = engine.claim
        self.channels = engine.channels
        self.pipes = engine.pipes
        self.inflight = engine.inflight
        self.schedule = engine.schedule
        self.timeline = engine.timeline
        self.reader: Reader = engine.restorer.reader
        self.cpu = engine.cpu
        #: Why this engine flushes no more (an earlier flush gave up mid-exchange: the
        #: ``"preempt"`` channel is out of step), or ``None``.
        self.broken: str | None = None
        self._running: asyncio.Task[Any] | None = None
        # The step waiting for the other ranks now, if any (named when the grace runs out).
        self._waiting: str | None = None

    def is_open(self) -> bool:
        """Whether the engine is open and not closing (a close finishes the saves itself)."""
        engine = self.engine
        return engine.opened and not (engine.closing or engine.closed)

    async def finished(self) -> None:
        """Wait until a flush in progress ended (a close waits for it: it is bounded by its
        grace, and the saves it makes durable must not be closed under it)."""
        running = self._running
        if running is not None and not running.done():
            await asyncio.wait([running])

    async def flush(self, deadline: float) -> FlushReport:
        """Make the newest version committed in memory durable, by ``deadline`` (a
        :func:`time.monotonic` time). Collective on the ``"preempt"`` channel; never raises."""
        started = time.monotonic()
        self._running = asyncio.current_task()
        if self.broken is not None:
            report = FlushReport(why=self.broken, trouble=True)
        elif not self.is_open():
            report = FlushReport(why="the checkpointer is closing")
        else:
            try:
                async with asyncio.timeout_at(deadline):
                    async with self.engine.save_lock:  # the save in progress launches first
                        report = await self._flush(deadline)
            except (TimeoutError, _GaveUp, PeerUnavailable) as exc:
                why = str(exc)
                if isinstance(exc, TimeoutError):
                    why = f"the grace of {self.options.preemption.grace:g} s ran out" + (
                        f": not every rank answered step {self._waiting!r}" if self._waiting else ""
                    )
                self.broken = f"an earlier flush on SIGTERM gave up ({why})"
                report = FlushReport(why=why, trouble=True)
            except Exception as exc:
                logger.exception("tiercheck: the flush on SIGTERM failed")
                self.broken = f"an earlier flush on SIGTERM failed ({exc!r})"
                report = FlushReport(why=repr(exc), trouble=True)
        report = dataclasses.replace(report, seconds=time.monotonic() - started)
        _log(report)
        return report

    async def _flush(self, deadline: float) -> FlushReport:
        last = self.schedule.last_version
        refusal = (
            "a newer opening of this job took its durable tiers over"
            if self.claim.superseded
            else ""
        )
        begins = await self._step(
            Step.PREEMPT_BEGIN, PreemptBegin(-1 if last is None else last, refusal), deadline
        )
        horizon, why = flush_horizon(begins)
        if horizon is None:
            return FlushReport(why=why, trouble=why.startswith("not every rank"))
        now = time.monotonic()
        await self._finish(horizon, now + (deadline - now) / 2, durable=False)
        offers = await self._step(Step.PREEMPT_OFFER, self._offer(horizon), deadline)
        choice = choose_flush(offers)
        version = choice.version
        if version is None or not choice.tiers:
            await self._finish(horizon, deadline, durable=True)
            return FlushReport(version, why=choice.why, trouble=choice.trouble)
        raw, unreadable = await self._read(version)
        durable: list[str] = []
        already: list[str] = []
        failed: dict[str, str] = {}
        for name in choice.tiers:
            pipe = self.pipes[name]
            try:
                vote = await self._write(pipe, version, raw, unreadable, deadline)
                votes = await self._step(Step.PREEMPT_VOTE, vote, deadline)
                is_durable, ranks = flush_outcome(votes, version, name)
                if is_durable:
                    already.append(name)
                elif ranks:
                    failed[name] = "; ".join(
                        f"rank {r}: {votes[r].why or 'out of step'}" for r in ranks
                    )
                elif await self._commit(pipe, votes, deadline):
                    durable.append(name)
                else:
                    failed[name] = "rank 0 could not write the COMMIT record"
            finally:
                pipe.flushing.discard(version)
        await self._finish(horizon, deadline, durable=True)
        with contextlib.suppress(Exception):
            # The manifest's records of the flush, before the process ends (history only).
            await asyncio.wait_for(self.journal.drained(), max(0.0, deadline - time.monotonic()))
        return FlushReport(
            version,
            tuple(durable),
            tuple(already),
            failed,
            choice.why,
            trouble=choice.trouble or bool(failed),
        )

    async def _step(self, which: Step, message: M, deadline: float) -> list[M]:
        """One step on the ``"preempt"`` channel, bounded by ``deadline``."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise _GaveUp(f"no time was left for step {which.value!r}")
        # Shielded: giving up must not cancel the exchange under the channel's thread, and its
        # outcome is read (and dropped) whenever it comes.
        task = asyncio.ensure_future(step(self.channels, which, message, channel=PREEMPT_CHANNEL))
        task.add_done_callback(_read_outcome)
        # Left set when the whole flush's deadline cancels the wait: its report names the step.
        self._waiting = which.value
        try:
            everyone = await asyncio.wait_for(asyncio.shield(task), left)
        except TimeoutError:
            raise _GaveUp(
                f"the grace of {self.options.preemption.grace:g} s ran out: not every rank "
                f"answered step {which.value!r}"
            ) from None
        self._waiting = None
        return everyone

    async def _finish(self, horizon: int, until: float, *, durable: bool) -> None:
        """Wait (until ``until`` at most) for the saves up to ``horizon`` still in flight in
        the memory tiers (``durable`` false: the version they commit is what the flush can make
        durable) or in the durable ones (their own rounds, cut short by the end otherwise)."""
        futures = [
            fut
            for job in self.inflight
            # An overlapped snapshot the caller has not confirmed yet commits nowhere before.
            if job.version <= horizon and (job.confirmed is None or job.confirmed.done())
            for name in job.targets
            if name in self.pipes
            and self.pipes[name].durable == durable
            and (fut := job.handle.tier_future(name)) is not None
            and not fut.done()
        ]
        if futures:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    _all_done(futures).wait(), max(0.0, until - time.monotonic())
                )

    def _offer(self, horizon: int) -> PreemptOffer:
        """What this rank offers: versions committed in memory with its blob there, up to the
        horizon and on the run's timeline; each durable tier's newest committed version."""
        top = horizon
        on_timeline = self.timeline.newest_on_timeline
        if on_timeline is not None:
            top = min(top, on_timeline)
        memory: set[int] = set()
        durable: dict[str, int] = {}
        blocked: dict[str, str] = {}
        for name, pipe in self.pipes.items():
            if not pipe.durable:
                memory |= {v for v in pipe.committed if v in pipe.own and v <= top}
                continue
            durable[name] = max(pipe.committed, default=-1)
            if not pipe.timeline_ready.is_set():
                blocked[name] = "its timeline is being settled after a restore"
            elif pipe.blocked is not None:
                blocked[name] = pipe.blocked
            elif pipe.unlisted:
                blocked[name] = "this rank could not list it: its newest version is unknown"
        return PreemptOffer(sorted(memory), durable, blocked)

    async def _read(self, version: int) -> tuple[RawState | None, str]:
        """This rank's blob of ``version`` from the fastest memory tier that serves it,
        verified; else ``None`` and why."""
        reasons = []
        for name, pipe in self.pipes.items():
            if pipe.durable or version not in pipe.committed or version not in pipe.own:
                continue
            try:
                return await self.reader.read(pipe.tier, version), ""
            except Exception as exc:
                reasons.append(f"{name}: {type(exc).__name__}: {exc}")
        return None, "cannot read it back from memory (" + "; ".join(reasons) + ")"

    async def _write(
        self,
        pipe: TierPipeline,
        version: int,
        raw: RawState | None,
        unreadable: str,
        deadline: float,
    ) -> FlushVote:
        """This rank's part in ``pipe``'s tier: its blob written (as a base: the tier may lack
        the base a delta would need), or the version found committed there meanwhile, or why
        not."""
        name = pipe.name
        own = next(
            (
                fut
                for job in self.inflight
                if job.version == version and (fut := job.handle.tier_future(name)) is not None
            ),
            None,
        )
        if own is not None and not own.done():
            # Its own save writes the same key: wait for it rather than race it.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    _all_done([own]).wait(), max(0.0, deadline - time.monotonic()) * 0.8
                )
            if not own.done():
                return FlushVote(version, name, why="its own save to this tier is still in flight")
        if version in pipe.committed:
            return FlushVote(version, name, already=True)
        if raw is None:
            return FlushVote(version, name, why=unreadable)
        # No retention pass in the tier from now until the flush ends, and none still running:
        # one could take the version for an uncommitted piece and delete it.
        pipe.flushing.add(version)
        await pipe.retention_idle.wait()
        try:
            codec, encoding = self.options.encode.codec, pipe.policy.encoding
            parts, meta = await encode_blob(
                raw, encoding, rank=self.rank, options=codec, cpu=self.cpu
            )
            key = blob_key(version, self.rank, meta.kind)
            await self.claim.check(pipe.tier)
            await pipe.tier.putv(key, parts)
        except Exception as exc:
            logger.warning(
                "tiercheck: SIGTERM: writing version %s to the %r tier failed: %r",
                version,
                name,
                exc,
            )
            return FlushVote(version, name, why=f"{type(exc).__name__}: {exc}")
        pipe.record_flushed(version, key, meta)
        return FlushVote(
            version,
            name,
            key=key,
            size=meta.nbytes,
            checksum=meta.checksum,
            raw_digest=meta.raw_digest,
        )

    async def _commit(
        self, pipe: TierPipeline, votes: Sequence[FlushVote], deadline: float
    ) -> bool:
        """Rank 0 writes the ``COMMIT`` record; every rank learns whether it landed."""
        ok = True
        why: AckReason = ""
        version = votes[0].version
        if self.rank == 0:
            ok, why = await self._write_record(pipe, votes)
        acks = await self._step(Step.PREEMPT_ACK, CommitAck(ok, why), deadline)
        if not acks[0].ok:
            if acks[0].why == "superseded":
                self.claim.mark_superseded()
            return False
        pipe.commit(version)
        name = pipe.name
        self.stats.committed[name] = self.stats.committed.get(name, 0) + 1
        self.stats.last_committed[name] = max(version, self.stats.last_committed.get(name, -1))
        return True

    async def _write_record(
        self, pipe: TierPipeline, votes: Sequence[FlushVote]
    ) -> tuple[bool, AckReason]:
        try:
            await self.claim.check(pipe.tier)
            record = flush_record(self.options.job.job_id, votes, time.time())
            await pipe.tier.put(commit_key(record.version), record.to_bytes())
        except Superseded:
            return False, "superseded"
        except Exception:
            logger.exception(
                "tiercheck: SIGTERM: writing the COMMIT record of %s in %r failed",
                votes[0].version,
                pipe.name,
            )
            return False, "error"
        return True, ""


def _read_outcome(task: asyncio.Future[Any]) -> None:
    """Read a step's outcome, so that one given up on is never reported as unretrieved."""
    if not task.cancelled() and task.exception() is not None:
        logger.debug("tiercheck: a step of the flush on SIGTERM failed: %r", task.exception())


def _all_done(futures: Sequence[concurrent.futures.Future[Any]]) -> asyncio.Event:
    """An event set once every future is done; the futures (save handles') are neither
    awaited nor cancelled here."""
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    left = [len(futures)]

    def one_done(_: concurrent.futures.Future[Any]) -> None:
        left[0] -= 1
        if left[0] == 0:
            loop.call_soon_threadsafe(done.set)

    for fut in futures:
        fut.add_done_callback(one_done)
    return done


def _log(report: FlushReport) -> None:
    """One line on what the flush did: WARNING when something went wrong, else INFO."""
    done: list[str] = []
    if report.durable:
        done.append(f"version {report.version} is now durable in {list(report.durable)}")
    if report.already:
        done.append(f"version {report.version} was durable already in {list(report.already)}")
    if report.failed:
        done.append(
            f"version {report.version} could not be made durable in "
            + "; ".join(f"{k!r} ({v})" for k, v in report.failed.items())
        )
    if report.why:
        done.append(("no version was made durable: " if not done else "") + report.why)
    line = "; ".join(done) or "nothing to do"
    if report.trouble:
        logger.warning(
            "tiercheck: SIGTERM: %s (%.2f s); what only memory holds is not durable",
            line,
            report.seconds,
        )
    else:
        logger.info("tiercheck: SIGTERM: %s (%.2f s)", line, report.seconds)
