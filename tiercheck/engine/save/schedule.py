"""Save scheduling: which versions may be saved, their plans, and back-pressure.

Saves are scheduled in call order (one at a time, under the engine's save lock). The schedule
gathers what a save's plan depends on and has :func:`~tiercheck.engine.save.plan.plan_save` decide
(every ``base_every``-th save is a base, the others deltas against the newest base -- unless no
base is planned yet, or a delta's base vanished from a tier: :meth:`Schedule.lose_base`). At
most ``max_pending`` saves are encoded at once; beyond that ``on_busy`` waits for a slot or
skips the save. The first save of a session may not overwrite versions already stored (restore
first). The schedule's fields change only through its methods: the engine and the encoder say
what happened (:meth:`Schedule.staged`, :meth:`Schedule.base_in_memory`, ...), the schedule
keeps it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import TYPE_CHECKING

from tiercheck.consistency.keys import check_version
from tiercheck.engine.jobs import Job
from tiercheck.engine.open.claim import Claim
from tiercheck.engine.options import Options
from tiercheck.engine.results import CheckpointerStats
from tiercheck.engine.save.plan import SaveInputs, SavePlan, plan_save, waits_for_slot
from tiercheck.errors import VersionError
from tiercheck.tiers.base import SupportsReserve

if TYPE_CHECKING:
    from tiercheck.engine.commit.tier import TierPipeline

__all__ = ["Schedule"]


class Schedule:
    """Where the sequence of saves stands."""

    def __init__(
        self,
        options: Options,
        stats: CheckpointerStats,
        claim: Claim,
        pipes: Mapping[str, TierPipeline],
    ) -> None:
        self.options = options
        self.topo = options.job.topology
        self.job_id = options.job.job_id
        self.stats = stats
        self.claim = claim
        self.pipes = pipes
        self.last_version: int | None = None
        #: Saves scheduled since opening (or since the restore): decides bases.
        self.count = 0
        #: The base the next delta is encoded against.
        self.planned_base: int | None = None
        # A delta's base vanished from a tier: the next save is encoded as a base.
        self.force_base = False
        #: Whether this session saved or restored yet (the first save checks what is stored).
        self.session_started = False
        #: Saves still being staged or encoded, oldest first.
        self.pending: list[Job] = []
        self.slot_freed = asyncio.Condition()
        #: The newest job launched through the pipeline (the next one encodes after it).
        self.last_job: Job | None = None

    def check_version(self, version: int) -> None:
        """A :class:`VersionError` unless ``version`` may be saved next."""
        check_version(version)
        if self.last_version is not None and version <= self.last_version:
            raise VersionError(
                f"versions must increase: version {version} after {self.last_version}; "
                "after restoring v, save versions greater than v"
            )

    async def check_fresh_start(self, version: int) -> None:
        """Refuse a first save that would mix with versions already stored for this job.

        Without a restore, saving version ``v`` while versions ``>= v`` are stored would let a
        later restore combine blobs of two different runs; deleting them instead would destroy
        checkpoints on a mistake. So this is an error with a way out.
        """
        if self.session_started:
            return
        claim = self.claim
        if claim.pending:
            raise VersionError(
                f"job {self.job_id!r} opened on its memory: the durable tiers "
                f"{sorted(claim.pending)} cannot be reached, so whether they store version "
                f"{version} or later cannot be checked. Call restore() first to continue the "
                "run (it reads from memory), or use a new job_id to start another"
            )
        if claim.world_changed:
            raise VersionError(
                f"job {self.job_id!r} was saved by {claim.stored_world} ranks and this run "
                f"has {self.topo.world_size}: call restore() first (it reshards the newest "
                "version onto this world), or use a new job_id to start another run"
            )
        stored = [(name, v) for name, p in self.pipes.items() for v in p.own if v >= version]
        if stored:
            newest = max(v for _, v in stored)
            raise VersionError(
                f"job {self.job_id!r} already stores version {newest} (>= {version}) in "
                f"{sorted({n for n, _ in stored})}; call restore() first to continue that run, "
                "use a new job_id to start another, or remove the old versions with `tiercheck gc`"
            )

    async def plan(self, version: int, *, on_host: bool, pinned: bool) -> SavePlan:
        """The plan of the save of ``version`` (:func:`~tiercheck.engine.save.plan.plan_save`).

        A busy save with ``on_busy="wait"`` waits for a slot first; its tiers are chosen from
        the schedule as it was when it was called, base or delta from the schedule after the
        wait (a base may have been encoded, or lost, meanwhile). A plan for a base clears
        ``force_base``. ``on_host``/``pinned``: where the state is, and whether the staging
        pool pins (they decide whether a tier's memory can take the copy).
        """
        options = self.options
        count, busy = self.count, self.busy()
        policies = {name: options.tiers.policy(name) for name in self.pipes}
        if waits_for_slot(busy, options.schedule.on_busy):
            await self.wait_for_slot()
        plan = plan_save(
            SaveInputs(
                version=version,
                count=count,
                base_every=options.schedule.base_every,
                policies=policies,
                busy=busy,
                on_busy=options.schedule.on_busy,
                planned_base=self.planned_base,
                force_base=self.force_base,
                reservable=tuple(
                    n for n, p in self.pipes.items() if isinstance(p.tier, SupportsReserve)
                ),
                on_host=on_host,
                pinned=pinned,
            )
        )
        if plan.kind == "base":
            self.force_base = False
        return plan

    def busy(self) -> bool:
        """Whether ``max_pending`` saves are being encoded already."""
        return len(self.pending) >= self.options.schedule.max_pending

    async def wait_for_slot(self) -> None:
        """Wait until fewer than ``max_pending`` saves are being encoded."""
        max_pending = self.options.schedule.max_pending
        async with self.slot_freed:
            await self.slot_freed.wait_for(lambda: len(self.pending) < max_pending)

    def consume(self, version: int) -> None:
        """The save of ``version`` happened (possibly as a skip): advance the schedule."""
        self.session_started = True
        self.last_version = version
        self.count += 1
        self.stats.saves += 1

    def staged(self, plan: SavePlan) -> None:
        """The snapshot of ``plan``'s version is staged: the schedule advances, and a base is
        what the next deltas are planned against."""
        self.consume(plan.version)
        if plan.kind == "base":
            self.planned_base = plan.version

    def base_in_memory(self, version: int) -> None:
        """The base ``version`` is encoded and held in memory: deltas go against it."""
        self.planned_base = version

    def base_failed(self, version: int) -> None:
        """The base ``version`` could not be encoded: no delta is planned against it."""
        if self.planned_base == version:
            self.planned_base = None

    def base_unconfirmed(self, version: int) -> None:
        """The snapshot of the base ``version`` was found changed: no delta against it, and
        the next save is a base."""
        self.base_failed(version)
        self.lose_base()

    def lose_base(self) -> None:
        """A delta's base vanished from a tier: the next save is a base."""
        self.force_base = True

    def occupy(self, job: Job) -> None:
        """``job`` is about to be encoded: it holds a slot until :meth:`release`."""
        self.pending.append(job)

    async def release(self, job: Job) -> None:
        """``job`` is encoded (or failed): its slot is free."""
        if job in self.pending:
            self.pending.remove(job)
        async with self.slot_freed:
            self.slot_freed.notify_all()

    def follow(self, job: Job) -> Job | None:
        """``job`` is launched through the pipeline: the job it follows (``None``: the first)."""
        previous, self.last_job = self.last_job, job
        return previous

    def begin_session(self) -> None:
        """A fresh start was agreed (a restore found nothing to restore): the first save
        checks what is stored no more."""
        self.session_started = True

    def restart_from(self, version: int) -> None:
        """After restoring ``version``: the next save is a base, newer than it."""
        self.session_started = True
        self.last_version = version
        self.count = 0
        self.planned_base = None
