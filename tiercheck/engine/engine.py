"""The engine: the parts of a checkpointer put together, on its private event loop.

One save, in order (see also :mod:`tiercheck.checkpointer`): :meth:`Engine.save` checks the
version and flattens the state (:class:`~tiercheck.codec.encode.plan.Planner`), the
:class:`~tiercheck.engine.save.schedule.Schedule` decides base or delta and applies back-pressure,
the :class:`~tiercheck.engine.save.stage.Stager` copies the snapshot into host memory, and
:meth:`Engine._launch` hands the job to the :class:`~tiercheck.engine.save.encode.Encoder` and to
each target tier's :class:`~tiercheck.engine.commit.tier.TierPipeline` (lane, then commit round).
A restore is the :class:`~tiercheck.engine.restore.restore.Restorer`'s; closing, the
:class:`~tiercheck.engine.close.shutdown.Shutdown`'s.
"""

from __future__ import annotations

import asyncio
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tiercheck.codec.encode.flatten import ReplicaRef
from tiercheck.codec.encode.plan import Planner
from tiercheck.consistency.manifest import Abort
from tiercheck.defaults import NodeRoot, persistent_job_url
from tiercheck.engine.close.preempt import PREEMPT_CHANNEL, Preemption
from tiercheck.engine.close.shutdown import Shutdown
from tiercheck.engine.collectives import Channels
from tiercheck.engine.commit.tier import TierPipeline, build_tier, writes_commit_records
from tiercheck.engine.health import Health
from tiercheck.engine.jobs import InFlight, Job
from tiercheck.engine.journal import Journal
from tiercheck.engine.open.claim import Claim
from tiercheck.engine.open.leftovers import sweep_leftovers, sweep_node_root
from tiercheck.engine.open.rejoin import Rejoin
from tiercheck.engine.options import CloseMode, Options
from tiercheck.engine.restore.elastic import ElasticReader
from tiercheck.engine.restore.read import Reader
from tiercheck.engine.restore.restore import Agreement, Restorer, all_loaded
from tiercheck.engine.restore.timeline import TIMELINE_CHANNEL, Timeline
from tiercheck.engine.results import CheckpointerStats, Restored, SaveHandle, SaveStats
from tiercheck.engine.save.encode import Encoder
from tiercheck.engine.save.plan import SavePlan
from tiercheck.engine.save.schedule import Schedule
from tiercheck.engine.save.stage import Stager
from tiercheck.errors import ConfigError, TierClosed
from tiercheck.tiers.base import Tier, TierSetup

__all__ = ["Engine", "tier_setup"]


class Engine:
    """All state and logic of one checkpointer; lives on the private loop."""

    def __init__(self, config: Options) -> None:
        self.cfg = config
        self.topo = topo = config.job.topology
        self.rank = topo.rank
        #: Running totals (the public face hands out copies).
        self.stats = CheckpointerStats()
        #: The node's manifest, as this rank keeps it.
        self.journal = Journal(self.stats)
        #: This rank's side of the exchanges with the others.
        self.channels = Channels()
        #: The writer lock, the job's incarnation, the fences of durable tiers.
        self.claim = Claim(config, self.stats, self.channels)
        #: Worker threads for hashing and compression.
        self.cpu = ThreadPoolExecutor(config.encode.threads, thread_name_prefix="tiercheck-cpu")
        #: Saves whose commit rounds are not all over yet.
        self.inflight = InFlight()
        #: The tiers in use, fastest first (once open).
        self.tiers: list[Tier] = []
        #: Each tier's pipeline, by name, fastest first (once open).
        self.pipes: dict[str, TierPipeline] = {}
        leader = topo.node_index * topo.ranks_per_node
        #: On a rank that is not its node's first, the reference it stores in place of
        #: replicated state (that rank stores it); ``None`` on the first.
        self.replica = None if topo.rank == leader else ReplicaRef(leader)
        #: Whether this rank is a node's first other than rank 0: in durable tiers it leaves
        #: replicated state to rank 0 (see :func:`tiercheck.codec.replica.lean`).
        self.leans = topo.rank == leader and leader != 0
        self.planner = Planner(
            allow_pickle=config.encode.allow_pickle,
            replica=self.replica,
            world_size=topo.world_size,
        )
        self.schedule = Schedule(config, self.stats, self.claim, self.pipes)
        self.stager = Stager(config, self.pipes)
        self.encoder = Encoder(config, self.journal, self.cpu, self.pipes, self.schedule)
        self.timeline = Timeline(config, self.claim, self.channels, self.pipes)
        #: Gets back the durable tiers the opening could not reach.
        self.rejoin = Rejoin(config, self.claim, self.channels, self.pipes, self.timeline)
        reader = Reader(config, self.stats, self.claim, self.cpu, self.pipes)
        self.save_lock = asyncio.Lock()
        self.restorer = Restorer(
            config,
            self.claim,
            self.channels,
            pipes=self.pipes,
            reader=reader,
            elastic=ElasticReader(
                config, self.stats, self.claim, cpu=self.cpu, pipes=self.pipes, reader=reader
            ),
            schedule=self.schedule,
            encoder=self.encoder,
            timeline=self.timeline,
        )
        self.shutdown = Shutdown(self)
        #: The flush on SIGTERM (see tiercheck.engine.close.sigterm).
        self.preemption = Preemption(self)
        self.opened = False
        #: When :meth:`open` began (so a close before ``opened`` follows a failed opening).
        self.open_started: float | None = None
        self.closed = False
        self.closing = False

    def figures(self) -> CheckpointerStats:
        """A copy of the running totals, with the planner's and the staging pool's figures."""
        return self.stats.snapshot(
            layouts_reused=self.planner.hits,
            layouts_planned=self.planner.misses,
            staging_bytes=self.stager.pool.allocated_bytes,
        )

    def mark_closing(self) -> None:
        """A close began (see :class:`~tiercheck.engine.close.shutdown.Shutdown`)."""
        self.closing = True

    def mark_closed(self) -> None:
        """Closed: no save or restore is accepted any more."""
        self.closed = True

    # --- opening ------------------------------------------------------------------------------

    async def open(self) -> None:
        """Coordination, tiers (checked by the claim before anything is written), manifest,
        and each tier's pipeline with what it holds."""
        cfg, channels, claim = self.cfg, self.channels, self.claim
        self.open_started = time.time()
        # Coordination first: creating process groups is a collective, and every rank must
        # create them in the same order (the coordinator's, then the peer tier's).
        await channels.connect(
            cfg.coordination.coordinator,
            world_size=self.topo.world_size,
            # The flush on SIGTERM's channel exists whether or not this rank handles SIGTERM:
            # creating groups is a collective, the same on every rank whatever its options.
            names=["control", PREEMPT_CHANNEL, TIMELINE_CHANNEL, *cfg.tier_names],
            timeout=cfg.coordination.peer_timeout,
        )
        channels.add(PREEMPT_CHANNEL)
        channels.add(TIMELINE_CHANNEL)
        # One token per opening of the job (its session), agreed by all ranks: keeps a
        # restarted job from reading the key-value store entries of the one that died.
        session = await channels.agree_session(os.urandom(8).hex())
        setup = tier_setup(cfg, session)
        # Every tier but the peer tier: constructing that one is a collective, so it waits
        # until every rank has passed the checks below (which fail on every rank alike).
        for spec in cfg.tiers.specs:
            if isinstance(spec, Tier):
                self.tiers.append(spec)
            elif spec != "peer":
                self.tiers.append(await asyncio.to_thread(build_tier, spec, setup))
        claim.use_durable([t for t in self.tiers if writes_commit_records(t)])
        await claim.guard()
        if self.topo.local_rank == 0:
            # This opening now holds the job: what killed writers left can go (not where it
            # holds nothing yet: a tier it could not reach).
            await sweep_leftovers(claim.claimed, session)
            await asyncio.to_thread(sweep_node_root, cfg.job.node_root)
        if "peer" in cfg.tiers.specs:
            self.tiers.append(await asyncio.to_thread(build_tier, "peer", setup))
        names = [t.name for t in self.tiers]
        if len(set(names)) != len(names):
            raise ConfigError(f"tier names must be unique, got {names}")
        self.tiers.sort(key=lambda t: int(t.survives))
        claim.use_durable([t for t in self.tiers if writes_commit_records(t)])
        await self.journal.open(NodeRoot(cfg.job.node_root).manifest)
        for tier in self.tiers:
            # Fails early on a tier without a policy.
            policy = cfg.tiers.policy(tier.name)
            pipe = TierPipeline(
                tier,
                policy,
                options=cfg,
                stats=self.stats,
                journal=self.journal,
                claim=claim,
                channels=channels,
                inflight=self.inflight,
                on_base_lost=self.schedule.lose_base,
            )
            self.pipes[tier.name] = pipe
            channels.add(tier.name)
            if not self.rejoin.holds_back(pipe):
                await pipe.load()
            pipe.start()
        self.rejoin.start()
        self.opened = True

    # --- saving -------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self.closed:
            raise TierClosed("this checkpointer is closed")

    async def save(
        self,
        version: int,
        state: Any,
        marks: dict[int, Any] | None = None,
        replicated_paths: list[tuple[Any, ...]] | None = None,
    ) -> SaveHandle:
        """Snapshot ``state`` as ``version``; see :meth:`tiercheck.Checkpointer.save`.

        ``replicated_paths``: where :attr:`leans`, the paths of the state's ``Replicated``
        values (from :func:`tiercheck.engine.stateful.for_save`)."""
        # One save at a time: the schedule (version, base or delta) is decided in call order.
        async with self.save_lock:
            return await self._save(version, state, marks, replicated_paths)

    def fence(self, timeout: float | None) -> None:
        """Block (any thread but the loop's) until every overlapped snapshot started so far is
        staged, and confirm them (see :meth:`Stager.settle`)."""
        self.stager.fence(timeout)

    async def _save(
        self,
        version: int,
        state: Any,
        marks: dict[int, Any] | None = None,
        replicated_paths: list[tuple[Any, ...]] | None = None,
    ) -> SaveHandle:
        started = time.perf_counter()
        self._check_open()
        schedule = self.schedule
        schedule.check_version(version)
        # Inline: pure Python walking the state, shorter than a hop to a thread and back. A
        # state shaped like the previous one reuses its layout (see tiercheck.codec.encode.plan).
        flat = self.planner.flatten(state)
        layout = flat.layout
        await schedule.check_fresh_start(version)
        # A durable tier unreachable since opening is claimed here once every rank reaches it.
        await self.rejoin.settle()
        # After a restore, the first save settles where the run goes on from (versions that
        # left the timeline set aside, the world-size history) before anything of this version
        # is written anywhere -- and only once the save is known to be allowed at all.
        await self.timeline.settle(version)
        plan = await schedule.plan(version, on_host=flat.on_host, pinned=self.stager.pool.pin)
        if plan.kind == "skipped":
            schedule.consume(version)
            return self._skip(plan, started)
        stats = SaveStats(version, plan.kind, raw_bytes=layout.payload_nbytes)
        targets = plan.encodings
        handle = SaveHandle(version, list(targets), stats)
        handle.confirm_at(self.stager)
        job = Job(
            version=version,
            kind=plan.kind,
            base_version=plan.base,
            targets=targets,
            handle=handle,
            started=started,
            layout=layout,
            replicated_paths=tuple(replicated_paths or ()) if self.leans else None,
        )
        # A failure here leaves the version unused.
        await self.stager.stage(job, flat, marks, into=plan.stage_in)
        schedule.staged(plan)
        stats.stall_s = time.perf_counter() - started
        if job.copy is None:
            stats.staged_s = stats.stall_s
        self.stats.stall_s_total += stats.stall_s
        self._launch(job)
        return handle

    def _skip(self, plan: SavePlan, started: float) -> SaveHandle:
        """Back-pressure skipped ``plan``'s version: a handle that says so for every tier."""
        version, targets = plan.version, plan.encodings
        stats = SaveStats(version, "skipped", stall_s=time.perf_counter() - started)
        handle = SaveHandle(version, list(targets), stats)
        handle.confirm_at(self.stager)
        self.stats.skipped += 1
        job = Job(version, "skipped", None, targets, handle, started)
        job.skip_everywhere()
        for name in targets:
            stats.tiers[name].state = "skipped"
        self.journal.log(Abort(version, self.rank, "skipped: previous save still in flight"))
        self._launch(job, pipeline=False)
        return handle

    def _launch(self, job: Job, *, pipeline: bool = True) -> None:
        """Queue ``job``'s commit round in each target tier; encode it (unless skipped)."""
        job.launch(self.schedule.follow(job) if pipeline else None)
        for name in job.targets:
            self.pipes[name].launch(job)
        self.inflight.add(job)
        if pipeline:
            self.encoder.start(job)

    # --- waiting, restoring, closing ----------------------------------------------------------

    async def wait(self) -> None:
        """Wait until every save so far is committed or failed in every tier, and the
        background work that follows (retention, preparing memory) is done too."""
        await self.inflight.drain()
        for pipe in self.pipes.values():
            await pipe.idle.wait()
        await self.journal.drained()

    def health(self) -> Health:
        """Whether each tier keeps committing (from any thread: it reads snapshots)."""
        return Health({name: pipe.lag.snapshot() for name, pipe in list(self.pipes.items())})

    async def newest(self) -> dict[str, int | None]:
        """The newest committed version of each tier, as this rank knows it."""
        return {name: max(p.committed, default=None) for name, p in self.pipes.items()}

    async def versions(self) -> dict[str, list[int]]:
        """Committed versions per tier that are still there, as this rank sees them."""
        return {name: await pipe.restorable() for name, pipe in self.pipes.items()}

    async def restore_agree(self, version: int | None) -> Agreement | None:
        """The first step of a restore (collective): what every rank can restore, or ``None``
        on a fresh start; see :meth:`Restorer.agree`. The saves in flight finish first."""
        self._check_open()
        await self.wait()
        await self.timeline.quiesce()
        return await self.restorer.agree(version)

    async def restore_read(
        self,
        agreement: Agreement,
        state: Any,
        strict: bool,
        started: float,
        failed: Exception | None = None,
    ) -> Restored:
        """The second step (collective): read, check and copy in the agreed version; see
        :meth:`Restorer.restore`. ``failed``: this rank could not make its target (the
        caller's ``state_dict()`` raised, or the state cannot be a target), so every rank
        refuses."""
        self._check_open()
        return await self.restorer.restore(agreement, state, strict, started, failed=failed)

    async def loaded(self, error: str | None) -> None:
        """After a restore (collective): see :meth:`Restorer.loaded`."""
        await all_loaded(self.restorer.channels, error)

    async def aclose(self, how: CloseMode) -> None:
        """Close, in one of three ways (see :data:`~tiercheck.engine.options.CloseMode`)."""
        await self.shutdown.close(how)


def tier_setup(cfg: Options, session: str) -> TierSetup:
    """What a tier built by name is given (:func:`~tiercheck.engine.stored.build_tier`)."""
    return TierSetup(
        job_id=cfg.job.job_id,
        session=session,
        topology=cfg.job.topology,
        node_root=cfg.job.node_root,
        persistent_url=persistent_job_url(cfg.job.persistent_url, cfg.job.job_id),
        storage_options=cfg.job.storage_options,
        local_capacity=cfg.tiers.local_capacity,
        peer_replicas=cfg.tiers.peer_replicas,
        peer_timeout=cfg.coordination.peer_timeout,
    )
