"""One tier's pipeline: its writer lane, its commit rounds, what it holds, what it keeps.

Every tier a checkpointer uses gets a :class:`TierPipeline`. Encoded versions arrive in its
*lane* (:class:`~tiercheck.engine.commit.lane.Lane`), whose worker writes them one at a time, in
version order, and reports each as written (or why not) to the job. The round worker
(:class:`~tiercheck.engine.commit.commit.CommitRounds`) then decides with the other ranks whether
the version is committed in this tier, and after each round :meth:`TierPipeline.retain` trims the
tier to its policy's ``keep``.

What the pipeline knows about its tier, for this rank: :attr:`~TierPipeline.own` (this rank's
blobs, by version, with the base each is a delta on), :attr:`~TierPipeline.committed` (versions
committed for every rank), :attr:`~TierPipeline.settled` (the newest version whose round is
over), and whether the tier could be listed at all (:attr:`~TierPipeline.unlisted`: nothing is
deleted from a tier this rank cannot see whole).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from tiercheck.codec import BlobMeta
from tiercheck.consistency.abandoned import (
    SetInfo,
)
from tiercheck.consistency.manifest import Commit, Written
from tiercheck.consistency.protocol import committed_in_tier
from tiercheck.engine.collectives import Channels
from tiercheck.engine.commit.retain import Retention
from tiercheck.engine.health import CommitLag
from tiercheck.engine.jobs import InFlight, Job, OwnBlob
from tiercheck.engine.journal import Journal
from tiercheck.engine.open.claim import Claim
from tiercheck.engine.options import Options, TierPolicy
from tiercheck.engine.results import CheckpointerStats
from tiercheck.engine.stored import (
    abandoned_sets,
    build_tier,
    commit_versions,
    location,
    writes_commit_records,
)
from tiercheck.errors import CommitUncertain, TierFull, TierWriteFailed
from tiercheck.tiers.base import Reservation, SupportsPrepare, SupportsReserve, Tier

__all__ = [
    "TierPipeline",
    "abandoned_sets",
    "build_tier",
    "commit_versions",
    "location",
    "prepare_after",
    "prepare_for",
    "writes_commit_records",
]

logger = logging.getLogger("tiercheck")


class TierPipeline(Retention):
    """One tier's queue and writer, commit rounds, holdings, idle signal and retention."""

    def __init__(
        self,
        tier: Tier,
        policy: TierPolicy,
        *,
        options: Options,
        stats: CheckpointerStats,
        journal: Journal,
        claim: Claim,
        channels: Channels,
        inflight: InFlight,
        on_base_lost: Callable[[], None],
    ) -> None:
        from tiercheck.engine.commit.commit import CommitRounds
        from tiercheck.engine.commit.lane import Lane

        self.options = options
        self.topo = options.job.topology
        self.rank = self.topo.rank
        self.job_id = options.job.job_id
        self.stats = stats
        self.journal = journal
        self.claim = claim
        #: The ranks' channels; this tier's commit rounds run on the one named after it.
        self.channels = channels
        #: The saves in flight (a job leaves once its last tier's round is over).
        self.inflight = inflight
        self.tier = tier
        self.name = tier.name
        self.policy = policy
        #: Commits proven by COMMIT records in the tier (it outlives the cluster).
        self.durable = writes_commit_records(tier)
        #: The writer: encoded versions waiting to be written, in version order.
        self.lane = Lane(self)
        self.rounds = CommitRounds(self, on_base_lost)
        self._on_base_lost = on_base_lost
        #: Why the tier takes no new versions for now (see :meth:`block`), or ``None``.
        self.blocked: str | None = None
        #: Clear while the timeline is being settled for the tier in the background (after a
        #: restore): versions wait in the lane, and whether the tier takes them is known then.
        self.timeline_ready = asyncio.Event()
        self.timeline_ready.set()
        #: Whole abandoned sets in the tier (durable tiers), by tag.
        self.abandoned: dict[str, SetInfo] = {}
        #: Set while the round worker has nothing left to do (retention included).
        self.idle = asyncio.Event()
        self.idle.set()
        self.flushing: set[int] = set()
        self.retention_idle = asyncio.Event()
        self.retention_idle.set()
        #: This rank's blobs in the tier, by version.
        self.own: dict[int, OwnBlob] = {}
        #: Versions another number of ranks saved (tiercheck.consistency.worlds), with the keys
        #: of their blobs this rank removes when retention drops them: old ranks ``s`` with
        #: ``s % world_size == rank``, so that together the ranks remove them all.
        self.others: dict[int, list[str]] = {}
        #: Versions committed in the tier for every rank.
        self.committed: set[int] = set()
        #: The newest version whose commit round is over: everything newer is in flight.
        self.settled = -1
        #: This rank could not list the tier: retention never deletes from it blindly.
        self.unlisted = False
        #: Size of the last reservation in this tier: the next is likely the same.
        self.reserve_size = 0
        self.workers: list[asyncio.Task[None]] = []
        # Reasons a version could not be taken that were logged already; cleared on a commit.
        self.skip_logged: set[str] = set()
        # Trouble with another rank was logged (once per spell, see peer_trouble).
        self.peer_warned = False
        #: How far the newest commit lags behind the saves sent here (see health()).
        health = options.health
        self.lag = CommitLag(self.name, saves=health.behind_saves, seconds=health.behind_seconds)
        #: Versions whose round failed here on a peer error after this rank voted yes: the
        #: other ranks may have committed them (see tiercheck.consistency.resync).
        self.unsure: set[int] = set()

    # --- what the tier holds ----------------------------------------------------------------

    async def load(self) -> None:
        """At opening (or once a tier unreachable then is claimed): list this rank's blobs and
        what is committed (never fatal)."""
        self.unlisted = False
        try:
            self.own = await self.list_own()
            # What retention counts in a durable tier is what its COMMIT records prove, not
            # what this node's manifest remembers (it may be new).
            self.committed = committed_in_tier(
                commit_records=self.durable,
                recorded=(
                    await commit_versions(self.tier)
                    if self.durable
                    else await self.journal.committed(self.name)
                ),
                held={**self.others, **self.own},
            )
            if self.durable:
                self.abandoned = await abandoned_sets(self.tier)
            self.lag.opened(self.committed)
        except Exception as exc:
            logger.error(
                "tiercheck: cannot list the %r tier (%r); nothing will be deleted from it "
                "until a restore lists it",
                self.name,
                exc,
            )
            self.unlisted = True
            self.own = {}
            self.committed = set()

    async def relist(self) -> dict[int, OwnBlob]:
        """List this rank's blobs anew (a restore's inventory): :attr:`own` is what is there."""
        self.own = await self.list_own()
        return self.own

    def listed(self, ok: bool) -> None:
        """Whether a restore's inventory could list the tier (see :attr:`unlisted`)."""
        self.unlisted = not ok

    def block(self, reason: str, *, announced: bool = False) -> None:
        """Take no new versions (each is dropped for this tier, with ``reason``) and keep
        retention away, until :meth:`unblock`: the tier still holds another timeline's
        versions, a record the run needs could not be written there, or it is not claimed
        (unreachable when the job opened). ``announced``: the reason was logged at WARNING
        already, so the versions dropped for it are only counted (``stats.tier_skips``)."""
        self.blocked = reason
        if announced:
            self.skip_logged.add(TierWriteFailed.__name__)

    async def takes_new(self) -> bool:
        """Whether the tier takes a new version now: once its timeline is settled (after a
        restore, :mod:`tiercheck.engine.restore.timeline`), whether it is not blocked."""
        if not self.timeline_ready.is_set():
            await self.timeline_ready.wait()
        return self.blocked is None

    def refusal(self) -> TierWriteFailed:
        """Why a version is not taken while the tier is blocked (see :meth:`block`)."""
        return TierWriteFailed(
            f"the {self.name!r} tier takes no new versions for now: {self.blocked}"
        )

    def rebase(self) -> None:
        """The run's next save is a base (this tier holds no base of its current deltas)."""
        self._on_base_lost()

    def unblock(self, *, announced: bool = False) -> None:
        """Take versions again; the next save is a base (the tier holds none of the run's
        current deltas' base). ``announced``: said at WARNING already (a tier claimed again
        after an outage)."""
        if self.blocked is None:
            return
        self.blocked = None
        self._on_base_lost()
        if not announced:
            logger.warning("tiercheck: the %r tier takes new versions again", self.name)

    def note_abandoned(self, tag: str, info: SetInfo) -> None:
        """A whole abandoned set ``tag`` now lies in the tier."""
        self.abandoned[tag] = info

    # --- workers ------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the lane worker and the round worker."""
        self.workers.append(asyncio.create_task(self.lane.run()))
        self.workers.append(asyncio.create_task(self.rounds.run()))

    def end(self) -> None:
        """Tell both workers to end once their queues are drained."""
        self.lane.queue.put_nowait(None)
        self.rounds.queue.put_nowait(None)

    def launch(self, job: Job) -> None:
        """``job`` goes to this tier: queue its commit round (in version order)."""
        self.rounds.queue.put_nowait(job)
        self.idle.clear()
        self.lag.sent(job.version)

    def ready_after(self, version: int) -> None:
        """After a restore of ``version``: :func:`prepare_after` for this tier."""
        prepare_after(self, version)

    # --- writing ------------------------------------------------------------------------------

    async def reserve(self, key: str, size: int) -> Reservation:
        """Reserve ``size`` bytes in the tier; when full, let pending retention free room first."""
        tier = self.tier
        assert isinstance(tier, SupportsReserve)
        self.reserve_size = size
        try:
            return await tier.reserve(key, size)
        except TierFull:
            if self.idle.is_set():
                raise
        # Retention runs after each commit round; the previous version's may still be on
        # its way to freeing an old one. Bounded: training waits seconds at most.
        with contextlib.suppress(TimeoutError):
            timeout = min(self.options.coordination.peer_timeout, 10.0)
            await asyncio.wait_for(self.idle.wait(), timeout=timeout)
        return await tier.reserve(key, size)

    def skip(self, job: Job, exc: BaseException) -> None:
        """The tier cannot take this version: count it, log the reason once, go on without it."""
        name = self.name
        stats = job.handle.stats.tiers[name]
        stats.state = "skipped"
        stats.error = f"{type(exc).__name__}: {exc}"
        self.stats.tier_skips[name] = self.stats.tier_skips.get(name, 0) + 1
        condition = type(exc).__name__
        if condition not in self.skip_logged:
            self.skip_logged.add(condition)
            logger.warning(
                "tiercheck: the %r tier cannot take version %s (%s: %s); the version still goes "
                "to the other tiers. Further versions it cannot take for this reason are counted "
                "in stats.tier_skips, not logged.",
                name,
                job.version,
                type(exc).__name__,
                exc,
            )
        job.lane_done(
            name,
            None,
            TierWriteFailed(f"version {job.version} was not stored in the {name!r} tier: {exc}"),
            cause=exc,
        )

    def record_written(self, job: Job, key: str, meta: BlobMeta) -> Written:
        """This rank's blob of ``job`` is in the tier: remember it and log it."""
        base = meta.base.version if meta.base is not None else None
        record = Written(
            job.version,
            self.rank,
            self.name,
            key,
            meta.nbytes,
            meta.checksum,
            meta.raw_digest,
            base,
        )
        self.own[job.version] = OwnBlob(key, base)
        self.journal.log(record)
        job.handle.stats.tiers[self.name].bytes = meta.nbytes
        return record

    def record_flushed(self, version: int, key: str, meta: BlobMeta) -> None:
        """This rank's blob of ``version``, a base the flush on SIGTERM wrote, is in the tier."""
        self.own[version] = OwnBlob(key, None)
        self.journal.log(
            Written(version, self.rank, self.name, key, meta.nbytes, meta.checksum, meta.raw_digest)
        )

    def round_over(self, version: int) -> None:
        """The commit round of ``version`` is over (committed or not): see :attr:`settled`."""
        self.settled = max(self.settled, version)

    def commit(self, version: int) -> None:
        """``version`` is committed in the tier for every rank: count it, tell the manifest;
        the reasons logged once and the trouble with peers start over."""
        self.committed.add(version)
        self.journal.log(Commit(version, self.name))
        self.skip_logged.clear()
        self.peer_warned = False
        self.lag.committed(version)

    def peers_back(self) -> None:
        """Work with the other ranks succeeded again: the next trouble is warned about."""
        self.peer_warned = False

    def peer_trouble(self, what: str, exc: BaseException) -> None:
        """Another rank is gone or silent: one WARNING line per spell, then DEBUG."""
        if self.peer_warned:
            logger.debug("tiercheck: %s in %r: %s", what, self.name, exc)
            return
        self.peer_warned = True
        logger.warning(
            "tiercheck: %s in the %r tier failed: %s (further failures of this kind are logged "
            "at DEBUG until the tier works again)",
            what,
            self.name,
            exc,
        )

    # --- keeping ------------------------------------------------------------------------------

    def fail(self, job: Job, error: BaseException) -> None:
        """``job`` is not committed in the tier: record why, and tell its handle."""
        stats = job.handle.stats.tiers[self.name]
        skipped = stats.state == "skipped"  # counted in tier_skips already
        if stats.state == "pending":
            stats.state = "uncertain" if isinstance(error, CommitUncertain) else "failed"
            stats.error = str(error)
            stats.seconds = time.perf_counter() - job.started
        if job.kind != "skipped" and not skipped:
            self.stats.failed[self.name] = self.stats.failed.get(self.name, 0) + 1
        self.lag.failed(job.version, error)
        job.handle.resolve_tier(self.name, error)


def prepare_after(pipe: TierPipeline, version: int) -> None:
    """Where ``pipe``'s tier prepares memory for a reservation
    (:class:`~tiercheck.tiers.SupportsPrepare`), ready the next save's in the background after
    a restore of ``version``, sized as this rank's blob of ``version`` there: the next save is
    most likely the same size, and its first reservation then costs a rename instead of
    sizing, backing and faulting in memory inside the training step."""
    tier = pipe.tier
    own = pipe.own.get(version)
    if own is None or pipe.reserve_size or not isinstance(tier, SupportsPrepare):
        return

    async def prepare() -> None:
        try:
            size = await tier.get_size(own.key)
            if not pipe.reserve_size:  # no save has reserved meanwhile
                pipe.reserve_size = size
                await tier.prepare(size)
        except Exception:
            logger.exception("tiercheck: preparing memory in %r failed", pipe.name)

    pipe.workers.append(asyncio.create_task(prepare()))


def prepare_for(pipe: TierPipeline, size: int) -> bool:
    """Where ``pipe``'s tier prepares memory for a reservation
    (:class:`~tiercheck.tiers.SupportsPrepare`) and no save has reserved there yet, ready
    ``size`` bytes for the first one in the background; whether it was started."""
    tier = pipe.tier
    if pipe.reserve_size or not isinstance(tier, SupportsPrepare):
        return False
    pipe.reserve_size = size

    async def prepare() -> None:
        try:
            await tier.prepare(size)
        except Exception:
            logger.exception("tiercheck: preparing memory in %r failed", pipe.name)

    pipe.workers.append(asyncio.create_task(prepare()))
    return True
