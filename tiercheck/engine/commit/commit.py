"""The commit round: the ranks agree, version by version, on what is whole in one tier.

A version is *committed* in a tier once every rank's blob of it, and of its base, is written
there -- and, for an overlapped snapshot, once the caller confirmed it unchanged since ``save``
(a rank whose snapshot is torn votes against it, so it fails on every rank). Each rank votes
(its blob's record, or why it has none); rank 0 writes the ``COMMIT`` record in tiers that
outlive the cluster and every rank learns whether it landed. Rounds run in
version order, one tier at a time each, on the tier's own channel (never the training's own
process group); after each round the tier's retention runs.

Every exchange of a round is tagged with its version. After a rank paused past the timeout, the
channel reconnects and the ranks may meet at different rounds; they then resynchronize
(:func:`~tiercheck.consistency.resync.resync`): the ranks behind fail their rounds up to the
furthest rank's version, which waits for them -- commits resume at once, and a version is
committed only where every rank stood at it and said yes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from tiercheck.consistency.coordinator import ChannelDown
from tiercheck.consistency.keys import commit_key
from tiercheck.consistency.protocol import (
    AckReason,
    CommitAck,
    Message,
    Step,
    Vote,
    commit_record,
    round_failures,
)
from tiercheck.consistency.resync import PHASES, position_key, resync
from tiercheck.engine.collectives import OutOfStep, step
from tiercheck.engine.jobs import Job, LaneResult
from tiercheck.engine.open.claim import keep_identity
from tiercheck.errors import CommitUncertain, PeerUnavailable, Superseded, TierWriteFailed
from tiercheck.tiers.base import SupportsPrepare

if TYPE_CHECKING:
    from tiercheck.engine.commit.pipe import Pipe

__all__ = ["CommitRounds"]

logger = logging.getLogger("tiercheck")

M = TypeVar("M", bound=Message)

#: Exchanges a round waits at the furthest position for the ranks behind to catch up (each
#: bounded by the timeout); they skip to it at once, so one or two are the rule.
CATCH_UP_TRIES = 8


class CommitRounds:
    """The round worker of one tier's pipeline."""

    def __init__(self, pipe: Pipe, on_base_lost: Callable[[], None]) -> None:
        self.pipe = pipe
        #: Jobs waiting for their round, in version order; ``None`` ends the worker.
        self.queue: asyncio.Queue[Job | None] = asyncio.Queue()
        # A delta's base vanished: the schedule stores the next save as a base.
        self.on_base_lost = on_base_lost
        #: Rounds of versions below this fail without an exchange: the other ranks are past
        #: them (see tiercheck.consistency.resync).
        self.floor = -1

    async def run(self) -> None:
        """Decide, version by version, whether each is committed in the tier for every rank."""
        pipe, tier, queue = self.pipe, self.pipe.tier, self.queue
        while True:
            job = await queue.get()
            if job is None:
                return
            peers_gone = False
            try:
                await self._round(job)
            except PeerUnavailable as exc:  # expected when a rank dies: one line, no traceback
                peers_gone = True
                pipe.peer_trouble(f"committing version {job.version}", exc)
                pipe.fail(job, _lost_round(job.version, tier.name, exc, job.version in pipe.unsure))
            except Exception as exc:
                logger.exception(
                    "tiercheck: committing version %s in %r failed", job.version, tier.name
                )
                pipe.fail(
                    job,
                    TierWriteFailed(
                        f"version {job.version} could not be committed in the "
                        f"{tier.name!r} tier: {exc!r}"
                    ),
                )
            finally:
                pipe.round_over(job.version)
                if job.round_over():
                    pipe.inflight.discard(job)
            # A round that lost its peers committed nothing new, and retention in a tier that
            # needs them (the peer tier) would only wait for them to time out again.
            if not peers_gone:
                try:
                    await pipe.retain()
                except PeerUnavailable as exc:
                    pipe.peer_trouble("retention", exc)
                except Exception:
                    logger.exception("tiercheck: retention in the %r tier failed", tier.name)
                else:
                    pipe.peers_back()
                if not pipe.durable:
                    # The node's memory folder may have been removed under the job: its
                    # identity record is what lets a later opening trust what it holds now.
                    try:
                        await keep_identity(pipe.claim)
                    except Exception:
                        logger.exception("tiercheck: keeping the node's identity record failed")
                # Retention may have left the versions of whole saves behind in every tier:
                # their records need not stay in the manifest's log (versions in flight do).
                pipe.journal.compact(pipe.inflight.oldest_version(default=job.version + 1))
            if isinstance(tier, SupportsPrepare) and pipe.reserve_size and queue.empty():
                # Retention just freed memory to recycle: ready the next snapshot's, so the
                # next save's reserve costs a rename instead of sizing and mapping pages.
                try:
                    await tier.prepare(pipe.reserve_size)
                except Exception:
                    logger.exception("tiercheck: preparing memory in %r failed", tier.name)
            if queue.empty():
                pipe.idle.set()

    async def _round(self, job: Job) -> None:
        pipe, name = self.pipe, self.pipe.name
        result = await job.results[name]
        if result.written is not None:
            # A durable tier may hold the blob already; it commits only a confirmed snapshot.
            unconfirmed = await job.unconfirmed()
            if unconfirmed is not None:
                result = LaneResult(None, unconfirmed)
        written = result.written
        ok = written is not None and (written.base is None or written.base in pipe.committed)
        base_missing = False
        if ok and written is not None and written.base is not None:
            # A base can vanish from under a live job (a deleted folder, a lifecycle rule, a
            # holder that lost its memory): a delta against it must not be reported committed.
            base_missing = not await self._base_present(written.base)
            ok = not base_missing
        if written is None:
            mine = Vote(ok, base_missing)
        else:
            mine = Vote(
                ok,
                base_missing,
                key=written.key,
                size=written.size,
                checksum=written.checksum,
                raw_digest=written.raw_digest,
                base=written.base,
            )
        if ok and job.version >= self.floor:
            # Until the round is decided here, the others may commit it without this rank
            # knowing (a lost last exchange): its blob stays (see Retention.retain). A round
            # below the floor is never exchanged: nobody can commit it.
            pipe.unsure.add(job.version)
        # Phase 2, vote: every rank's word on this version in this tier.
        try:
            everyone = await self.exchange(Step.VOTE, mine, job.version)
        except (OutOfStep, ChannelDown):
            # Out of step: every rank that met in it saw the ranks apart, so nobody used the
            # exchange (this rank's earlier tries at it were out of step too: one that failed
            # otherwise ends the round as uncertain). Down: this rank's vote was never sent.
            # Either way nobody can have committed the version.
            pipe.unsure.discard(job.version)
            raise
        # Phase 3, decide: unanimous, and (in a durable tier) the COMMIT record landed.
        failed = round_failures(everyone)
        why: AckReason = ""
        if not failed and pipe.durable:
            failed, why = await self._write_commit_record(job.version, everyone)
        pipe.unsure.discard(job.version)  # decided, alike on every rank
        if any(v.base_missing for v in everyone) or why == "base-missing":
            self._lose_bases({v.base for v in everyone if v.base is not None})
        if failed:
            if result.error is not None:
                error: BaseException = result.error
            elif why == "superseded":
                error = TierWriteFailed(
                    f"version {job.version} was not committed in the {name!r} tier: a newer "
                    "opening of this job took it over"
                )
            elif base_missing or why == "base-missing" or any(v.base_missing for v in everyone):
                error = TierWriteFailed(
                    f"version {job.version} is a delta whose base vanished from the {name!r} "
                    "tier; the next save is stored as a base"
                )
            elif (
                written is not None
                and written.base is not None
                and written.base not in pipe.committed
            ):
                error = TierWriteFailed(
                    f"version {job.version} is a delta on base {written.base}, which is not "
                    f"committed in the {name!r} tier"
                )
            elif why == "error":
                error = TierWriteFailed(
                    f"version {job.version} is not committed in the {name!r} tier: its COMMIT "
                    "record was not written (rank 0's log says why)"
                )
            else:
                error = TierWriteFailed(
                    f"version {job.version} is not whole in the {name!r} tier: "
                    f"ranks {failed} could not write it"
                )
            pipe.fail(job, error)
            return
        pipe.commit(job.version)
        stats = job.handle.stats.tiers[name]
        stats.state = "committed"
        stats.seconds = time.perf_counter() - job.started
        pipe.stats.committed[name] = pipe.stats.committed.get(name, 0) + 1
        pipe.stats.last_committed[name] = job.version
        job.handle.resolve_tier(name)

    async def exchange(self, which: Step, message: M, version: int) -> list[M]:
        """Every rank's ``message`` of step ``which`` in the round of ``version``, by rank.

        Raises :class:`~tiercheck.errors.PeerUnavailable` when the exchange failed, when the
        other ranks are past this round (they stood further, or did before: :attr:`floor`),
        or when they did not catch up with it in :data:`CATCH_UP_TRIES` exchanges.
        """
        name = self.pipe.name
        if version < self.floor:
            raise PeerUnavailable(
                f"the other ranks went past version {version} in the {name!r} tier while this "
                f"rank was behind (they stand at version {self.floor}); it cannot be committed"
            )
        last: OutOfStep | None = None
        for _ in range(CATCH_UP_TRIES):
            try:
                return await step(self.pipe.channels, which, message, channel=name, tag=version)
            except OutOfStep as exc:
                decision = resync((which.value, version), exc.positions)
                if decision.behind:
                    self.floor = max(self.floor, decision.floor)
                    logger.info(
                        "tiercheck: the ranks were out of step in the %r tier (%s); this rank "
                        "gives up the rounds before version %s",
                        name,
                        _where(exc.positions),
                        decision.floor,
                    )
                    raise
                logger.info(
                    "tiercheck: the ranks were out of step in the %r tier (%s); this rank "
                    "waits at %r of version %s for the others",
                    name,
                    _where(exc.positions),
                    which.value,
                    version,
                )
                last = exc
        raise PeerUnavailable(
            f"the other ranks did not catch up with version {version} in the {name!r} tier "
            f"after {CATCH_UP_TRIES} exchanges: {last}"
        ) from last

    async def _base_present(self, base: int) -> bool:
        tier = self.pipe.tier
        blob = self.pipe.own.get(base)
        if blob is None:
            return False
        try:
            return await tier.exists(blob.key)
        except Exception as exc:
            logger.warning(
                "tiercheck: cannot tell whether base %s is still in %r: %r", base, tier.name, exc
            )
            return False

    def _lose_bases(self, bases: set[int]) -> None:
        """Bases that vanished from ``tier``: forget them; the next save starts a new one."""
        self.on_base_lost()
        self.pipe.forget_bases(bases)
        logger.warning(
            "tiercheck: a delta's base vanished from the %r tier (of versions %s); the next "
            "save is stored as a base",
            self.pipe.name,
            sorted(bases),
        )

    async def _write_commit_record(
        self, version: int, everyone: list[Vote]
    ) -> tuple[list[int], AckReason]:
        """Rank 0 writes the ``COMMIT`` record; everyone learns whether it landed, and why not."""
        pipe, tier = self.pipe, self.pipe.tier
        ok = True
        why: AckReason = ""
        if pipe.rank == 0:
            try:
                await pipe.claim.check(tier)
                bases = sorted({v.base for v in everyone if v.base is not None})
                for base in bases:
                    if not await tier.exists(commit_key(base)):
                        ok, why = False, "base-missing"
                if ok:
                    record = commit_record(pipe.job_id, version, everyone, time.time())
                    await tier.put(commit_key(version), record.to_bytes())
            except Superseded:
                ok, why = False, "superseded"
            except Exception:
                logger.exception("tiercheck: writing the COMMIT record of %s failed", version)
                ok, why = False, "error"
        try:
            acks = await self.exchange(Step.ACK, CommitAck(ok, why), version)
        except OutOfStep as exc:
            if pipe.rank != 0 and position_key(exc.positions[0]) > (version, PHASES["ack"]):
                # Rank 0 is past this round, its record written or not for good: the tier
                # says which (a record there commits the version, for every rank).
                pipe.peer_trouble(f"learning whether version {version} committed", exc)
                try:
                    landed = await tier.exists(commit_key(version))
                except Exception as unread:
                    logger.warning(
                        "tiercheck: cannot tell whether version %s committed in %r: %r",
                        version,
                        tier.name,
                        unread,
                    )
                    raise exc from unread  # uncertain here
                acks = [CommitAck(landed, "" if landed else "error")]
            elif pipe.rank != 0:
                raise  # rank 0 may yet write the record: the round is uncertain here
            else:
                pipe.peer_trouble(f"telling the others whether version {version} committed", exc)
                acks = [CommitAck(ok, why)]
        except PeerUnavailable as exc:
            if pipe.rank != 0:
                raise  # rank 0 may have written the record: the round is uncertain here
            # The record decides, and rank 0 knows whether it landed; the others learn it
            # from the tier (Retention adopts the versions whose record they find).
            pipe.peer_trouble(f"telling the others whether version {version} committed", exc)
            acks = [CommitAck(ok, why)]
        ack = acks[0]  # rank 0's is the one that counts
        if ack.ok:
            return [], ""
        if ack.why == "superseded":
            pipe.claim.mark_superseded()
        return [0], ack.why


def _lost_round(version: int, tier: str, exc: PeerUnavailable, unsure: bool) -> TierWriteFailed:
    """The error of a round that lost its peers: uncertain where this rank said yes and the
    others may have heard every yes (``unsure``), else a failure."""
    if unsure:
        return CommitUncertain(
            f"version {version} may or may not be committed in the {tier!r} tier: this rank "
            f"voted yes, then lost the round's last exchange ({exc}); the other ranks may have "
            "committed it, so its blob is kept and a restore uses it if every rank has it"
        )
    return TierWriteFailed(f"version {version} could not be committed in the {tier!r} tier: {exc}")


def _where(positions: list[tuple[str, int | None]]) -> str:
    """Where each rank stood, for the log."""
    return ", ".join(
        f"rank {r} at {s!r} of {t}" if t is not None else f"rank {r} at {s!r}"
        for r, (s, t) in enumerate(positions)
    )
