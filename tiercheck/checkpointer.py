"""The checkpointer: save often, cheaply, to every tier; restore from the fastest survivor.

Lifecycle of one save (the order things happen in)
--------------------------------------------------
1. ``await ckpt.save(version, state)`` -- on the caller's side, the only blocking part:
   the state is flattened (no pickle; a state shaped like the previous one reuses its layout,
   see :mod:`tiercheck.codec.plan`) and its tensors are copied into host memory -- straight
   into the local tier's shared memory where that tier can hand it out, else into a reused
   staging buffer. If the previous save is still being encoded, the ``on_busy`` policy decides:
   ``"wait"`` for it, or ``"skip"`` this one (counted). It returns a :class:`SaveHandle`;
   training may change its tensors at once. With ``overlap=True`` it returns once the copy is
   started, and the state may change once the copy is done (:meth:`SaveHandle.staged`, the
   fence; see :mod:`tiercheck.staging`).
2. Background, in save order: the raw payload is hashed; the local blob is published; the
   state is encoded for the other tiers (a delta against the newest base, byte planes, zstd).
3. Background, per tier, in version order: the blob is written; the manifest logs it durable.
4. Background, per tier: the ranks exchange what became durable (a side channel, never the
   training's own process group); a version is *committed* in a tier once every rank's blob of
   it, and of its base, is durable there. For tiers that outlive the cluster a ``COMMIT`` record
   listing every blob is written last. ``handle.done(tier)`` resolves; retention then trims the
   tier (never a base a kept delta needs, never a version still in flight).

Restore: every rank inventories what it can reach, the ranks agree on the newest version every
one of them can rebuild, each reads it from its fastest source, verifying checksums and falling
back to the next tier on any missing or corrupt blob. Versions newer than the restored one are
then removed everywhere, so a later save can never be mixed with a blob of an abandoned future.

Errors in the background never reach training: they are logged (logger ``"tiercheck"``),
counted in :attr:`Checkpointer.stats`, raised from ``handle.done(tier)``, and the version simply
does not commit in that tier.

The pipeline runs on a private event loop on its own thread, so it advances while the caller
computes, whether the caller is synchronous (use :class:`SyncCheckpointer`) or async.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import torch

from tiercheck._loop import LoopThread
from tiercheck._threads import DaemonExecutor
from tiercheck.codec import (
    BlobMeta,
    CodecOptions,
    RawState,
    check_into,
    decode,
    encode_full,
    encode_packed,
    finalize_full_blob,
    full_blob_size,
    load_into,
    raw_digest,
    read_meta,
    unflatten,
    write_full_blob,
)
from tiercheck.codec.plan import Flat, Planner, paused_gc
from tiercheck.consistency.commit import CommitRecord
from tiercheck.consistency.coordinator import Coordinator
from tiercheck.consistency.identity import quarantine_key
from tiercheck.consistency.keys import (
    MAX_VERSION,
    blob_key,
    commit_key,
    parse_blob_key,
    version_prefix,
)
from tiercheck.consistency.manifest import Abort, Begin, Commit, Record
from tiercheck.consistency.recovery import Inventory, agree, candidates
from tiercheck.defaults import (
    NodeRoot,
    persistent_job_url,
)
from tiercheck.engine.context import Context
from tiercheck.engine.jobs import HeldBase, Holder, Job, LaneResult, OwnBlob
from tiercheck.engine.options import (
    BusyPolicy,
    CloseMode,
    Options,
    StalePolicy,
    TierEncoding,
    TierPolicy,
    VersionSelector,
    resolve_options,
)
from tiercheck.engine.results import (
    OWN_STORAGE_BYTES,
    CheckpointerStats,
    Restored,
    SaveHandle,
    SaveStats,
    TierSaveStats,
)
from tiercheck.engine.tier import TierPipeline, build_tier, commit_versions, writes_commit_records
from tiercheck.errors import (
    BlobNotFound,
    ChecksumMismatch,
    ConfigError,
    FormatError,
    RestoreError,
    SaveSkipped,
    StateChanged,
    StateMismatch,
    TiercheckError,
    TierClosed,
    TierWriteFailed,
    UnsupportedFormat,
    UnsupportedObject,
    VersionError,
)
from tiercheck.staging import SnapshotCopy, StagingBuffer, StagingPool, caller_marks
from tiercheck.tiers.base import (
    Buffer,
    SupportsReserve,
    SupportsStopServing,
    Tier,
    TierSetup,
)
from tiercheck.topology import Topology

__all__ = [
    "Checkpointer",
    "CheckpointerStats",
    "Restored",
    "SaveHandle",
    "SaveStats",
    "TierPolicy",
    "TierSaveStats",
]

logger = logging.getLogger("tiercheck")

# --- the engine ---------------------------------------------------------------------------


class _Engine:
    """All state and logic; lives on the private loop. See the module docstring."""

    def __init__(self, config: Options) -> None:
        self.cfg = config
        self.ctx = Context(config)
        self.topo = config.job.topology
        self.rank = config.job.topology.rank
        self.stats = self.ctx.stats
        self.tiers: list[Tier] = []
        #: Each tier's pipeline, by name, fastest first.
        self.pipes: dict[str, TierPipeline] = {}
        self.pool = StagingPool()
        # The previous save's structure: a repeating state is not walked and encoded anew.
        self.planner = Planner(allow_pickle=config.encode.allow_pickle)
        # Overlapped snapshot copies not done yet; read by fence() from the caller's thread.
        self.copies: set[SnapshotCopy] = set()
        self.copies_lock = threading.Lock()
        self.cpu = self.ctx.cpu
        self.pipelines: set[asyncio.Task[None]] = set()
        self.jobs = self.ctx.jobs
        self.pending: list[Job] = []
        self.slot_freed = asyncio.Condition()
        self.save_lock = asyncio.Lock()
        self.last_job: Job | None = None
        self.last_version: int | None = None
        self.count = 0
        self.planned_base: int | None = None
        self.base: HeldBase | None = None
        self.session_started = False
        self.opened = False
        self.closed = False
        self.lock = self.ctx.claim.lock
        # A delta's base vanished from a tier: the next save is encoded as a base.
        self.force_base = False
        self.closing = False
        self.close_warned = False

    # --- opening ------------------------------------------------------------------------------

    async def open(self) -> None:
        cfg, ctx = self.cfg, self.ctx
        # Coordination first: creating process groups is a collective, and every rank must
        # create them in the same order (the coordinator's, then the peer tier's).
        ctx.channels["control"] = DaemonExecutor(1, "tiercheck-sync-control")
        loop = asyncio.get_running_loop()
        if cfg.coordination.coordinator is not None:
            ctx.coordinator = cfg.coordination.coordinator
        elif self.topo.world_size > 1:
            from tiercheck.consistency.coordinator import TorchCoordinator

            names = cfg.tier_names
            # Creating groups waits on every rank: on a daemon thread, like every exchange.
            ctx.coordinator = await loop.run_in_executor(
                ctx.channels["control"],
                lambda: TorchCoordinator(
                    ["control", *names], timeout=cfg.coordination.peer_timeout
                ),
            )
        # One token per incarnation of the job, agreed by all ranks: keeps a restarted job
        # from reading the key-value store entries of the one that died.
        token = os.urandom(8).hex()
        ctx.session = str((await ctx.exchange("control", {"token": token}))[0]["token"])
        setup = TierSetup(
            job_id=cfg.job.job_id,
            session=ctx.session,
            topology=self.topo,
            node_root=cfg.job.node_root,
            persistent_url=persistent_job_url(cfg.job.persistent_url, cfg.job.job_id),
            storage_options=cfg.job.storage_options,
            local_capacity=cfg.tiers.local_capacity,
            peer_replicas=cfg.tiers.peer_replicas,
            peer_timeout=cfg.coordination.peer_timeout,
        )
        # Every tier but the peer tier: constructing that one is a collective, so it waits
        # until every rank has passed the checks below (which fail on every rank alike).
        for spec in cfg.tiers.specs:
            if isinstance(spec, Tier):
                self.tiers.append(spec)
            elif spec != "peer":
                self.tiers.append(await asyncio.to_thread(build_tier, spec, setup))
        ctx.claim.durable = [t for t in self.tiers if writes_commit_records(t)]
        await ctx.claim.guard()
        if "peer" in cfg.tiers.specs:
            self.tiers.append(await asyncio.to_thread(build_tier, "peer", setup))
        names = [t.name for t in self.tiers]
        if len(set(names)) != len(names):
            raise ConfigError(f"tier names must be unique, got {names}")
        self.tiers.sort(key=lambda t: int(t.survives))
        ctx.claim.durable = [t for t in self.tiers if writes_commit_records(t)]
        await ctx.journal.open(NodeRoot(cfg.job.node_root).manifest)
        for tier in self.tiers:
            # Fails early on a tier without a policy.
            pipe = TierPipeline(ctx, tier, cfg.tiers.policy(tier.name), self._lose_base)
            self.pipes[tier.name] = pipe
            ctx.channels[tier.name] = DaemonExecutor(1, f"tiercheck-sync-{tier.name}")
            await pipe.load()
            pipe.start()
        self.opened = True

    def _lose_base(self) -> None:
        self.force_base = True

    def _log(self, *records: Record) -> None:
        self.ctx.journal.log(*records)

    def _durable_tiers(self) -> list[Tier]:
        return self.ctx.claim.durable

    def writes_commit_records(self, tier: Tier) -> bool:
        return writes_commit_records(tier)

    # --- guards: whose data this is, one writer, usable locations -------------------------------

    def tier(self, name: str) -> Tier:
        for t in self.tiers:
            if t.name == name:
                return t
        raise ConfigError(f"no tier named {name!r}")

    # --- saving -------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self.closed:
            raise TierClosed("this checkpointer is closed")

    async def save(
        self, version: int, state: Any, marks: dict[int, Any] | None = None
    ) -> SaveHandle:
        # One save at a time: the schedule (version, base or delta) is decided in call order.
        async with self.save_lock:
            return await self._save(version, state, marks)

    def fence(self, timeout: float | None) -> None:
        """Block (any thread) until every overlapped snapshot started so far is staged."""
        with self.copies_lock:
            copies = list(self.copies)
        deadline = None if timeout is None else time.monotonic() + timeout
        for copy in copies:
            copy.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))

    async def _save(
        self, version: int, state: Any, marks: dict[int, Any] | None = None
    ) -> SaveHandle:
        started = time.perf_counter()
        self._check_open()
        if (
            isinstance(version, bool)
            or not isinstance(version, int)
            or not 0 <= version <= MAX_VERSION
        ):
            raise VersionError(f"a version must be an int in [0, {MAX_VERSION}], got {version!r}")
        if self.last_version is not None and version <= self.last_version:
            raise VersionError(
                f"versions must increase: version {version} after {self.last_version}; "
                "after restoring v, save versions greater than v"
            )
        # Inline: pure Python walking the state, shorter than a hop to a thread and back. A
        # state shaped like the previous one reuses its layout (see tiercheck.codec.plan).
        flat = self.planner.flatten(state)
        layout = flat.layout
        if not self.session_started:
            await self._check_fresh_start(version)
        scheduled_base = self.count % self.cfg.schedule.base_every == 0
        targets = {
            t.name: self.cfg.tiers.policy(t.name).encoding
            for t in self.tiers
            if self.cfg.tiers.policy(t.name).targets(version, scheduled_base)
        }
        busy = len(self.pending) >= self.cfg.schedule.max_pending
        if busy and self.cfg.schedule.on_busy == "skip":
            self._consume(version)
            return self._skip(version, targets, started)
        if busy:
            async with self.slot_freed:
                await self.slot_freed.wait_for(
                    lambda: len(self.pending) < self.cfg.schedule.max_pending
                )
        kind: Literal["base", "delta"] = (
            "base" if scheduled_base or self.planned_base is None or self.force_base else "delta"
        )
        if kind == "base":
            self.force_base = False
        stats = SaveStats(version, kind, raw_bytes=layout.payload_nbytes)
        handle = SaveHandle(version, list(targets), stats)
        job = Job(
            version=version,
            kind=kind,
            base_version=None if kind == "base" else self.planned_base,
            targets=targets,
            handle=handle,
            started=started,
            layout=layout,
        )
        await self._stage(job, flat, marks)  # a failure here leaves the version unused
        self._consume(version)
        if kind == "base":
            self.planned_base = version
        stats.stall_s = time.perf_counter() - started
        if job.copy is None:
            stats.staged_s = stats.stall_s
        self.stats.stall_s_total += stats.stall_s
        self._launch(job)
        return handle

    def _consume(self, version: int) -> None:
        """The save of ``version`` happened (possibly as a skip): advance the schedule."""
        self.session_started = True
        self.last_version = version
        self.count += 1
        self.stats.saves += 1

    def _skip(self, version: int, targets: dict[str, TierEncoding], started: float) -> SaveHandle:
        stats = SaveStats(version, "skipped", stall_s=time.perf_counter() - started)
        handle = SaveHandle(version, list(targets), stats)
        self.stats.skipped += 1
        job = Job(version, "skipped", None, targets, handle, started)
        job.encoded.set()
        for name in targets:
            fut: asyncio.Future[LaneResult] = asyncio.get_running_loop().create_future()
            fut.set_result(LaneResult(None, SaveSkipped(f"version {version} was skipped")))
            job.results[name] = fut
            stats.tiers[name].state = "skipped"
        self._log(Abort(version, self.rank, "skipped: previous save still in flight"))
        self._launch(job, pipeline=False)
        return handle

    async def _stage(self, job: Job, flat: Flat, marks: dict[int, Any] | None) -> None:
        """Copy the state into host memory: a tier's own memory where one can hand it out.

        The fastest tier that can reserve memory (:class:`SupportsReserve`, the local tier) and
        stores this version as is (``"full"``) receives the snapshot in place: once published,
        the copy is the stored blob. A tier that cannot take the version (full, or failing) is
        skipped for it, and the snapshot goes to a staging buffer instead, so the other tiers
        still get it: storage trouble never reaches the caller. Tensors on a GPU go to a pinned
        staging buffer (a device-to-host copy into shared memory could not be asynchronous);
        the reserving tier then gets a copy of it like any other tier.
        """
        layout = job.layout
        assert layout is not None
        reserving = next(
            (
                p
                for p in self.pipes.values()
                if isinstance(p.tier, SupportsReserve) and job.targets.get(p.name) == "full"
            ),
            None,
        )
        if reserving is not None and (flat.on_host or not self.pool.pin):
            size, offset = full_blob_size(layout, version=job.version, rank=self.rank)
            key = blob_key(job.version, self.rank, "full")
            try:
                reservation = await reserving.reserve(key, size)
            except (TiercheckError, OSError) as exc:
                reserving.skip(job, exc)
            else:
                try:
                    write_full_blob(reservation.buffer, layout, version=job.version, rank=self.rank)
                    whole = torch.frombuffer(reservation.buffer, dtype=torch.uint8)
                    payload = whole[offset : offset + layout.payload_nbytes]
                    copy = SnapshotCopy(flat, payload, marks=marks, watch=self.cfg.schedule.overlap)
                    await self._copy(job, copy)
                except BaseException:
                    await reservation.abort()
                    raise
                job.reservation = reservation
                job.reserved_in = reserving.name
                job.payload = payload
                job.holder = Holder(reservation.release)
                return
        lent: StagingBuffer = self.pool.acquire(layout.payload_nbytes)
        try:
            copy = SnapshotCopy(
                flat, lent.data, cache=lent.cache, marks=marks, watch=self.cfg.schedule.overlap
            )
            await self._copy(job, copy)
        except BaseException:
            self.pool.release(lent)
            raise
        job.payload = lent.data
        job.holder = Holder(lambda: self.pool.release(lent))

    async def _copy(self, job: Job, copy: SnapshotCopy) -> None:
        """Run the snapshot copy: to its end (blocking saves), or started on a worker thread
        with the handle's fence set to it (overlapped saves; the pipeline awaits it)."""
        if not self.cfg.schedule.overlap:
            await asyncio.to_thread(copy.run)
            copy.done.result()  # the copy's error, if any, is the caller's: save raises it
            return
        job.copy = copy
        handle = job.handle
        handle._staged = copy.done
        started = job.started

        def staged(fut: concurrent.futures.Future[None]) -> None:
            handle.stats.staged_s = time.perf_counter() - started
            with self.copies_lock:
                self.copies.discard(copy)

        with self.copies_lock:
            self.copies.add(copy)
        copy.done.add_done_callback(staged)
        # Never awaited: run() reports through copy.done, which the pipeline awaits.
        asyncio.get_running_loop().run_in_executor(None, copy.run)

    def _launch(self, job: Job, *, pipeline: bool = True) -> None:
        loop = asyncio.get_running_loop()
        if pipeline:
            job.previous = self.last_job
            self.last_job = job
        for name in job.targets:
            if name not in job.results:
                job.results[name] = loop.create_future()
            self.pipes[name].launch(job)
        job.rounds_left = len(job.targets)
        self.jobs.add(job)
        if not job.targets:
            job.finished.set()
        if pipeline:
            self.pending.append(job)
            task = asyncio.create_task(self._pipeline(job))
            self.pipelines.add(task)
            task.add_done_callback(self.pipelines.discard)

    async def _pipeline(self, job: Job) -> None:
        """Hash, publish locally, encode for the other tiers, hand blobs to the tier lanes."""
        assert job.layout is not None
        assert job.payload is not None
        assert job.holder is not None
        doing = "staging"
        try:
            if job.previous is not None:
                await job.previous.encoded.wait()
                job.previous = None  # a chain of finished jobs would keep their memory alive
            if job.copy is not None:
                # An overlapped snapshot: nothing reads the payload before it is staged.
                await asyncio.wrap_future(job.copy.done)
                job.copy = None
            doing = "encoding"
            self._log(
                Begin(
                    job.version,
                    self.rank,
                    "delta" if job.kind == "delta" else "base",
                    job.base_version,
                )
            )
            digest = await asyncio.to_thread(raw_digest, job.payload, executor=self.cpu)
            raw = RawState(job.version, job.layout, job.payload, digest)
            base: RawState | None = None
            if job.kind == "delta":
                if self.base is not None and self.base.raw.version == job.base_version:
                    base = self.base.raw
                else:
                    logger.warning(
                        "tiercheck: base %s of version %s is unavailable; encoding it as a base",
                        job.base_version,
                        job.version,
                    )
                    job.kind = "base"
                    job.handle.stats.kind = "base"
            if job.reservation is not None:
                await self._publish_reserved(job, digest)
            encoded: dict[TierEncoding, tuple[list[Buffer], BlobMeta]] = {}
            for name, encoding in job.targets.items():
                if job.results[name].done():  # published in place, or skipped when staging
                    continue
                if encoding not in encoded:
                    encoded[encoding] = await self._encode(raw, encoding, base)
                parts, meta = encoded[encoding]
                if self.pipes[name].offer(job, parts, meta) and encoding == "full":
                    job.holder.acquire()  # the parts reference the staged payload
            if job.kind == "base":
                self.planned_base = job.version
                job.holder.acquire()
                old, self.base = self.base, HeldBase(raw, job.holder)
                if old is not None:
                    old.holder.drop()
        except Exception as exc:
            if isinstance(exc, StateChanged):
                logger.warning("tiercheck: version %s is not stored: %s", job.version, exc)
            else:
                logger.exception("tiercheck: %s version %s failed", doing, job.version)
            self._log(Abort(job.version, self.rank, f"{doing} failed: {exc!r}"))
            if (
                job.reservation is not None
                and job.reserved_in in job.results
                and not job.results[job.reserved_in].done()
            ):
                with contextlib.suppress(Exception):
                    await job.reservation.abort()
            for name in job.targets:
                job.lane_done(
                    name,
                    None,
                    TierWriteFailed(
                        f"version {job.version} could not be "
                        f"{'staged' if doing == 'staging' else 'encoded'}: {exc!r}"
                    ),
                    cause=exc,
                )
            if job.kind == "base" and self.planned_base == job.version:
                self.planned_base = None
        finally:
            job.holder.drop()
            # The holder (and, for a base, self.base) keeps the payload for as long as it is
            # needed; the job itself must not, or finished saves would pin their memory.
            job.payload = None
            job.reservation = None
            job.encoded.set()
            if job in self.pending:
                self.pending.remove(job)
            async with self.slot_freed:
                self.slot_freed.notify_all()

    async def _publish_reserved(self, job: Job, digest: int) -> None:
        reservation = job.reservation
        assert reservation is not None
        assert job.reserved_in is not None
        pipe = self.pipes[job.reserved_in]
        try:
            assert job.layout is not None
            meta = await asyncio.to_thread(
                finalize_full_blob,
                reservation.buffer,
                raw_digest=digest,
                executor=self.cpu,
                known=(job.layout, job.version, self.rank),
            )
            await reservation.commit()
        except Exception as exc:
            logger.exception(
                "tiercheck: publishing version %s in the %s tier failed", job.version, pipe.name
            )
            with contextlib.suppress(Exception):
                await reservation.abort()
            job.lane_done(
                pipe.name,
                None,
                TierWriteFailed(
                    f"version {job.version} could not be written to the {pipe.name} tier: {exc!r}"
                ),
                cause=exc,
            )
            return
        durable = pipe.record_durable(job, reservation.key, meta)
        job.lane_done(pipe.name, durable)

    async def _encode(
        self, raw: RawState, encoding: TierEncoding, base: RawState | None
    ) -> tuple[list[Buffer], BlobMeta]:
        if encoding == "full":
            return encode_full(raw, rank=self.rank)
        return await asyncio.to_thread(
            encode_packed,
            raw,
            rank=self.rank,
            base=base,
            options=self.cfg.encode.codec,
            executor=self.cpu,
        )

    # --- committing ---------------------------------------------------------------------------

    async def _check_fresh_start(self, version: int) -> None:
        """Refuse a first save that would mix with versions already stored for this job.

        Without a restore, saving version ``v`` while versions ``>= v`` are stored would let a
        later restore combine blobs of two different runs; deleting them instead would destroy
        checkpoints on a mistake. So this is an error with a way out.
        """
        stored = [(name, v) for name, p in self.pipes.items() for v in p.own if v >= version]
        if stored:
            newest = max(v for _, v in stored)
            raise VersionError(
                f"job {self.cfg.job.job_id!r} already stores version {newest} (>= {version}) in "
                f"{sorted({n for n, _ in stored})}; call restore() first to continue that run, "
                "use a new job_id to start another, or remove the old versions with `tiercheck gc`"
            )

    async def _truncate_from(self, first: int, reason: str) -> None:
        """Remove this rank's blobs (and rank 0's COMMIT records) of versions >= ``first``."""
        for pipe in self.pipes.values():
            await pipe.truncate_from(first, reason)

    # --- waiting and restoring ----------------------------------------------------------------

    async def wait(self) -> None:
        """Wait until every save so far is committed or failed in every tier, and the
        background work that follows (retention, preparing memory) is done too."""
        while self.jobs:
            job = next(iter(self.jobs))
            await job.finished.wait()
            self.jobs.discard(job)
        for pipe in self.pipes.values():
            await pipe.idle.wait()
        await self.ctx.journal.drained()

    async def newest(self) -> dict[str, int | None]:
        """The newest committed version of each tier, as this rank knows it."""
        return {name: max(p.committed, default=None) for name, p in self.pipes.items()}

    async def _inventory(self) -> tuple[Inventory, dict[str, str]]:
        """What this rank can rebuild, per tier, and the tiers it could not list (and why)."""
        by_tier: dict[str, frozenset[int]] = {}
        errors: dict[str, str] = {}
        for pipe in self.pipes.values():
            try:
                pipe.own = await pipe.list_own()
                if pipe.durable:
                    versions = await commit_versions(pipe.tier)
                else:
                    versions = set(pipe.own)
            except Exception as exc:
                logger.warning("tiercheck: cannot list the %r tier for restore: %r", pipe.name, exc)
                errors[pipe.name] = f"{type(exc).__name__}: {exc}"
                pipe.unlisted = True
                versions = set()
            else:
                pipe.unlisted = False
            by_tier[pipe.name] = frozenset(versions)
        return Inventory(self.rank, by_tier), errors

    async def _own_key(self, tier: Tier, version: int) -> str:
        if self.writes_commit_records(tier):
            record = CommitRecord.from_bytes(bytes(await tier.get(commit_key(version))))
            if record.world_size != self.topo.world_size:
                raise RestoreError(
                    f"version {version} was saved by {record.world_size} ranks; this job has "
                    f"{self.topo.world_size} (resharding on restore is not supported)"
                )
            entry = record.entry(self.rank)
            own = self.pipes[tier.name].own
            if version in own:  # the record knows the base: no need to guess
                own[version] = OwnBlob(entry.key, entry.base)
            return entry.key
        keys = [k async for k in tier.list(version_prefix(version))]
        mine = sorted(
            (p.kind, k)
            for k in keys
            if (p := parse_blob_key(k)) is not None and p.rank == self.rank
        )
        if not mine:
            raise BlobNotFound(
                f"rank {self.rank} has no blob of version {version} in {tier.name!r}"
            )
        return mine[0][1]  # "full" sorts before "packed": the cheaper read

    async def _read(self, tier: Tier, version: int, *, as_base: bool = False) -> RawState:
        key = await self._own_key(tier, version)
        blob = await tier.get(key)
        try:
            meta = await asyncio.to_thread(read_meta, blob)
            if meta.version != version or meta.rank != self.rank:
                raise FormatError(
                    f"{key} in {tier.name!r} holds version {meta.version} of rank {meta.rank}"
                )
        except (ChecksumMismatch, FormatError) as exc:
            await self._quarantine(tier, key, blob, exc)
            raise
        base: RawState | None = None
        if meta.base is not None:
            if as_base:
                raise FormatError(f"{key} is a delta, but deltas are read only against a base")
            base = await self._read(tier, meta.base.version, as_base=True)
        try:
            return await asyncio.to_thread(decode, blob, base=base, executor=self.cpu, meta=meta)
        except (ChecksumMismatch, FormatError) as exc:
            await self._quarantine(tier, key, blob, exc)
            raise

    async def _quarantine(self, tier: Tier, key: str, blob: Buffer, exc: Exception) -> None:
        """Set a blob that failed verification aside, so no cleanup can ever delete it."""
        if isinstance(exc, UnsupportedFormat):
            return  # written by a newer build: not damaged, and kept as it is
        if self.ctx.claim.superseded and self.writes_commit_records(tier):
            return
        where = quarantine_key(key)
        try:
            await tier.put(where, blob)
        except Exception as put_exc:
            logger.error(
                "tiercheck: %s in %r failed verification (%s) and could not be set aside as %s "
                "(%r); it stays under its own key",
                key,
                tier.name,
                exc,
                where,
                put_exc,
            )
            return
        self.stats.quarantined += 1
        logger.warning(
            "tiercheck: %s in %r failed verification (%s); set aside as %s for inspection "
            "(`tiercheck verify` lists it)",
            key,
            tier.name,
            exc,
            where,
        )

    async def restore(
        self, state: Any, version: int | None, strict: bool = True
    ) -> Restored | None:
        started = time.perf_counter()
        self._check_open()
        await self.wait()
        mine, errors = await self._inventory()
        gathered = await self.ctx.exchange("control", {"inv": mine.to_wire(), "errors": errors})
        everyone = [Inventory.from_wire(r, e["inv"]) for r, e in enumerate(gathered)]
        unlisted = [
            f"rank {r} cannot list the {tier!r} tier: {msg}"
            for r, e in enumerate(gathered)
            for tier, msg in sorted(e["errors"].items())
        ]
        possible = candidates(everyone)
        if version is not None and version not in possible:
            raise RestoreError(
                f"version {version} cannot be rebuilt by every rank; rank {self.rank} can "
                f"rebuild {sorted(mine.versions())}" + ("".join(f"; {line}" for line in unlisted))
            )
        if not possible:
            if unlisted:
                raise RestoreError(
                    f"cannot tell what job {self.cfg.job.job_id!r} stores, so nothing is restored "
                    "and nothing is deleted:\n  " + "\n  ".join(unlisted)
                )
            if any(inv.versions() for inv in everyone):
                # Only torn versions: blobs of saves that no tier holds whole for every rank,
                # hence never committed anywhere. Remove them, or a later save of the same
                # version could be combined with them.
                logger.warning(
                    "tiercheck: job %r stores no whole version, only pieces of saves that never "
                    "committed (%s); removing them",
                    self.cfg.job.job_id,
                    sorted(mine.versions()),
                )
                await self._truncate_from(0, reason="restore: torn, never committed")
            self.session_started = True
            return None
        rejected: dict[int, list[str]] = {}
        excluded: set[int] = set()
        while True:
            chosen = (
                version if version is not None else agree(everyone, excluded=frozenset(excluded))
            )
            if chosen is None:
                raise RestoreError(self._rejection_report(rejected, unlisted))
            raw, source, reasons = await self._fetch(chosen, mine)
            rebuilt: Any = None
            refusal: list[str] | None = None
            if raw is not None:
                try:
                    with paused_gc():  # tens of thousands of short-lived objects: see there
                        rebuilt = self._rebuild(raw, state, strict)
                except StateMismatch as exc:
                    refusal = ["StateMismatch", str(exc)]
                except UnsupportedObject as exc:
                    refusal = ["UnsupportedObject", str(exc)]
                except FormatError as exc:
                    reasons.append(f"{source}: {type(exc).__name__}: {exc}")
                    raw = None
            verdicts = await self.ctx.exchange(
                "control",
                {"ok": raw is not None, "source": source, "reasons": reasons, "refusal": refusal},
            )
            refusals = [(r, v["refusal"]) for r, v in enumerate(verdicts) if v["refusal"]]
            if refusals:
                # The caller's state (or options) cannot take the version: nothing was
                # written into it, and nothing stored is removed.
                kind, text = refusals[0][1]
                ranks = [r for r, _ in refusals]
                message = f"rank {refusals[0][0]} (of ranks {ranks} refusing): {text}"
                raise (StateMismatch if kind == "StateMismatch" else UnsupportedObject)(message)
            if all(v["ok"] for v in verdicts):
                break
            for r, v in enumerate(verdicts):
                if not v["ok"]:
                    rejected.setdefault(chosen, []).extend(
                        f"rank {r}: {reason}" for reason in v["reasons"]
                    )
            bad = [r for r, v in enumerate(verdicts) if not v["ok"]]
            if version is not None:
                raise RestoreError(
                    f"version {version} failed verification on ranks {bad}; nothing was "
                    "deleted.\n" + self._rejection_report(rejected, unlisted)
                )
            logger.warning(
                "tiercheck: version %s failed verification on ranks %s; trying older", chosen, bad
            )
            excluded.add(chosen)
        assert raw is not None
        assert source is not None
        # The version is whole on every rank: from here on, the run continues from it.
        if state is not None:
            # _rebuild checked this state against this version, and the caller is waiting for
            # restore to return: copy without walking it a second time.
            with paused_gc():
                rebuilt = load_into(state, rebuilt, strict=strict, checked=True)
        await self._truncate_from(chosen + 1, reason="restore: abandoned future")
        self._adopt_whole(everyone, upto=chosen)
        for tier in self._durable_tiers():
            if not self.pipes[tier.name].unlisted:
                self.pipes[tier.name].committed = {
                    v for v in mine.by_tier.get(tier.name, frozenset()) if v <= chosen
                }
        self.session_started = True
        self.last_version = chosen
        self.count = 0
        self.planned_base = None
        if self.base is not None:
            self.base.holder.drop()
            self.base = None
        return Restored(
            version=chosen,
            state=rebuilt,
            source_tier=source,
            source_tiers={r: v["source"] for r, v in enumerate(verdicts)},
            seconds=time.perf_counter() - started,
            rejected={v: tuple(lines) for v, lines in rejected.items()},
        )

    def _rebuild(self, raw: RawState, state: Any, strict: bool) -> Any:
        """The version as a state; with a live ``state``, checked to fit it (nothing written)."""
        if state is not None:
            # Views only read from, to be copied into the state (and cloned where strict=False
            # adds a key): inference tensors, which cost less to make than tracked views.
            with torch.inference_mode():
                tensors = raw.tensors()
        else:
            tensors = raw.tensors()
        if state is None:
            # Small tensors get storage of their own: some consumers read a tensor from the
            # start of its storage, ignoring the offset of a view (torch.set_rng_state does).
            # Large ones stay views of the payload: no second copy.
            tensors = [t.clone() if t.nbytes <= OWN_STORAGE_BYTES else t for t in tensors]
        rebuilt = unflatten(raw.layout, tensors, allow_pickle=self.cfg.encode.allow_pickle)
        if state is not None:
            mismatches = check_into(state, rebuilt, strict=strict)
            if mismatches:
                shown = mismatches[:50]
                more = len(mismatches) - len(shown)
                raise StateMismatch(
                    f"the state to restore into does not match version {raw.version}; nothing "
                    "was written into it:\n  "
                    + "\n  ".join(shown)
                    + (f"\n  ... and {more} more" if more else "")
                    + "\nRestore without a state (restore()) and load what fits yourself, or "
                    "pass strict=False to allow keys present on one side only."
                )
        return rebuilt

    def _rejection_report(self, rejected: Mapping[int, list[str]], unlisted: list[str]) -> str:
        lines = [
            f"no version of job {self.cfg.job.job_id!r} could be restored; nothing was deleted "
            "(blobs that failed verification were set aside under quarantine/). Why each "
            "version was rejected:"
        ]
        for version in sorted(rejected, reverse=True):
            lines.append(f"  version {version}:")
            lines.extend(f"    {reason}" for reason in rejected[version])
        lines.extend(f"  {line}" for line in unlisted)
        lines.append("Run `tiercheck verify` on the locations for details.")
        return "\n".join(lines)

    def _adopt_whole(self, everyone: Sequence[Inventory], *, upto: int) -> None:
        """Count as committed, in the tiers without commit records, what every rank holds.

        Those tiers' commits live in the node's manifest, written just after the commit; a
        crash in between leaves a version whole in the tier (every rank's blob there, each put
        atomic) that the manifest does not know. Retention would then take it for a failed
        save's leftover and delete it, the restored version included. The inventories every
        rank exchanged for the restore show what is whole: adopt it, and record it.
        """
        for pipe in self.pipes.values():
            name = pipe.name
            if pipe.durable:
                continue
            whole = set(pipe.own)
            for inventory in everyone:
                whole &= inventory.by_tier.get(name, frozenset())
            adopted = sorted(v for v in whole - pipe.committed if v <= upto)
            if adopted:
                pipe.committed.update(adopted)
                self._log(*(Commit(v, name) for v in adopted))

    async def _fetch(
        self, version: int, mine: Inventory
    ) -> tuple[RawState | None, str | None, list[str]]:
        """Read ``version`` from the fastest tier that serves it; else why each tier could not."""
        reasons: list[str] = []
        for name in mine.sources(version):
            try:
                return await self._read(self.tier(name), version), name, reasons
            except Exception as exc:
                self.stats.restore_fallbacks += 1
                reasons.append(f"{name}: {type(exc).__name__}: {exc}")
                logger.warning(
                    "tiercheck: version %s from the %r tier is unusable (%r); trying the next tier",
                    version,
                    name,
                    exc,
                )
        if not reasons:
            reasons.append("no tier holds this rank's blob of it")
        return None, None, reasons

    async def versions(self) -> dict[str, list[int]]:
        """Committed versions per tier that are still there, as this rank sees them."""
        return {name: await pipe.restorable() for name, pipe in self.pipes.items()}

    # --- closing ------------------------------------------------------------------------------

    async def aclose(self, how: CloseMode) -> None:
        """Close, in one of three ways (see :data:`CloseMode`); never raises for a peer or a
        store that is gone, and never waits on one beyond the configured bounds."""
        if self.closed or self.closing:
            return
        self.closing = True
        try:
            if how == "collective" and self.opened:
                await self._close_collectively()
                return
            if how == "bounded" and self.opened:
                await self._flush_bounded()
            await self._close_now()
        finally:
            self.closed = True

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
            await self.wait()
            saved = True
        except Exception:
            logger.exception("tiercheck: finishing the saves in flight failed")
            saved = False
        self.closed = True
        await self._end_workers(cancel=False)
        collective = self.ctx.coordinator.world_size > 1
        if collective:
            await self._agree("every rank is done saving", {"saved": saved})
        stopped = await self._stop_serving()
        if collective:
            await self._agree("every rank has stopped serving", {"stopped": stopped})
        await self._release(flush=True)

    async def _flush_bounded(self) -> None:
        """Leaving on an exception: give the saves in flight ``close_timeout`` seconds to
        settle, memory tiers first (local, then peer, then the rest). No agreement with the
        other ranks: they may be failing too. Once an exchange with the other ranks has
        failed, no pending save can commit any more (a commit needs every rank): stop there."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.coordination.close_timeout
        for tier in self.tiers:  # fastest first: the order of survival scopes
            futures = [
                job.handle._futures[tier.name]
                for job in list(self.jobs)
                if tier.name in job.handle._futures
            ]
            settled = _when_all_done(futures)
            while not settled.is_set():
                broken = self.ctx.coordinator.broken
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
                    f"({self.cfg.coordination.close_timeout:.0f}s)",
                )
                return

    async def _close_now(self) -> None:
        """Close without waiting for saves: cancel the pipeline, stop serving (bounded), release."""
        self.closed = True
        pending = list(self.jobs)  # cancelled round workers drop their jobs from the set
        await self._end_workers(cancel=True)
        for job in pending:  # whoever waits on their handles learns they never commit
            for name, future in job.handle._futures.items():
                if not future.done():
                    self.pipes[name].fail(
                        job,
                        TierWriteFailed(
                            f"version {job.version} was abandoned in the {name!r} tier: the "
                            "checkpointer closed without waiting for it"
                        ),
                    )
        self.jobs.clear()
        await self._stop_serving()
        await self._release(flush=False)

    async def _end_workers(self, *, cancel: bool) -> None:
        """End the lane and round workers (and, when cancelling, the pipelines), bounded."""
        workers = [task for pipe in self.pipes.values() for task in pipe.workers]
        for pipe in self.pipes.values():
            pipe.end()
        tasks = [*workers, *self.pipelines] if cancel else workers
        if cancel:
            for task in tasks:
                task.cancel()
        if not tasks:
            return
        # Idle workers end at their sentinel within a turn of the loop; the grace only
        # matters after a failed wait(), when something may still block.
        _, stuck = await asyncio.wait(tasks, timeout=max(self.cfg.coordination.close_timeout, 1.0))
        for task in stuck:
            task.cancel()
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                logger.error("tiercheck: a pipeline worker failed: %r", task.exception())

    async def _stop_serving(self) -> bool:
        """Stop every tier's server (the peer tier's), each for at most ``close_timeout``."""
        stopped = True
        for tier in self.tiers:
            if isinstance(tier, SupportsStopServing):
                try:
                    stopped &= await tier.stop_serving(self.cfg.coordination.close_timeout)
                except Exception as exc:
                    logger.warning("tiercheck: stopping the %r tier's server: %r", tier.name, exc)
                    stopped = False
        return stopped

    async def _agree(self, what: str, mine: Mapping[str, Any]) -> bool:
        """One agreement of the close on the "control" channel; a failure is logged once."""
        try:
            everyone = await self.ctx.exchange("control", mine)
        except Exception as exc:
            if not self.close_warned:
                self.close_warned = True
                logger.warning(
                    "tiercheck: closing without the other ranks: could not agree that %s (%s)",
                    what,
                    exc,
                )
            return False
        return all(all(bool(v) for v in e.values()) for e in everyone)

    async def _release(self, *, flush: bool) -> None:
        """Release everything local. Touches neither the store nor another rank."""
        if self.base is not None:
            self.base.holder.drop()
            self.base = None
        for tier in self.tiers:
            try:
                await tier.aclose()
            except Exception:
                logger.exception("tiercheck: closing the %r tier failed", tier.name)
        self.ctx.journal.close()  # local appends only
        for ex in self.ctx.channels.values():
            # An exchange still waiting on a dead rank stays on its daemon thread.
            ex.shutdown(wait=False, cancel_futures=True)
        try:
            self.ctx.coordinator.close()
        except Exception:
            logger.exception("tiercheck: closing the coordination groups failed")
        self.cpu.shutdown(wait=flush)
        self.pool.clear()
        self.lock.release()


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


# --- the public face -------------------------------------------------------------------------


class _CheckpointerCore:
    """What :class:`Checkpointer` and :class:`~tiercheck.SyncCheckpointer` share: the
    configuration (one constructor for both) and the private loop the pipeline runs on."""

    def __init__(
        self,
        job_id: str,
        *,
        persistent: str | None = None,
        local_root: str | os.PathLike[str] | None = None,
        tiers: Sequence[str | Tier] | None = None,
        base_every: int = 10,
        keep: int | Mapping[str, int] | None = None,
        persist: VersionSelector = "base",
        encodings: Mapping[str, TierEncoding] | None = None,
        policies: Mapping[str, TierPolicy] | None = None,
        on_busy: BusyPolicy = "wait",
        max_pending: int = 1,
        overlap: bool = False,
        tier_queue: int = 4,
        codec: CodecOptions | None = None,
        allow_pickle: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        ranks_per_node: int | None = None,
        node: str | None = None,
        coordinator: Coordinator | None = None,
        local_capacity: int | None = None,
        peer_replicas: int = 1,
        peer_timeout: float = 300.0,
        threads: int = 0,
        storage_options: Mapping[str, Any] | None = None,
        stale_memory: StalePolicy = "error",
        close_timeout: float = 30.0,
    ) -> None:
        """Configure; nothing is opened or written until first use (or ``open``).

        Args:
            job_id: names the job; everything it stores sits under this name.
            persistent: an fsspec URL for durable storage (``file://``, ``s3://``, ``memory://``,
                ...), or ``None`` for ``./tiercheck-checkpoints``.
            local_root: this node's shared-memory folder (default
                ``/dev/shm/tiercheck/<job>/<node>``).
            tiers: tier names or :class:`~tiercheck.tiers.Tier` instances, any order (they are
                used fastest first). Default: ``local`` + ``persistent``, plus ``peer`` when the job
                spans more than one node.
            base_every: every ``base_every``-th save is a base, the others deltas against it.
            keep: versions each tier retains: one number for all tiers or a mapping by tier name
                (defaults: local 2, peer 2, persistent 3).
            persist: which versions go to tiers that outlive the cluster: ``"base"`` (default),
                ``"all"``, or a predicate on the version (bases always go).
            encodings: ``"full"`` or ``"packed"`` per tier name (default: ``full`` for the local
                tier, ``packed`` elsewhere).
            policies: full :class:`TierPolicy` objects by tier name (override the three above).
            on_busy: ``"wait"`` (default) or ``"skip"`` when the previous save is still encoding.
            max_pending: how many saves may be encoding at once before ``on_busy`` applies.
            overlap: ``save`` returns before the snapshot is copied; the copy runs on a worker
                thread (and, for GPU tensors, a side stream) while training computes. The state
                must not change until the copy is done: pass the fence first --
                ``handle.staged()``, ``ckpt.fence()``, or install it once with
                :func:`~tiercheck.fence_before_step` (an optimizer step pre-hook) or
                :func:`~tiercheck.fence_before_forward`. A change made before the fence that
                torch's version counters show makes the version fail
                (:class:`~tiercheck.errors.StateChanged`) instead of storing a torn copy.
            tier_queue: how many encoded versions may wait for one tier before newer ones are
                dropped for that tier (a slow remote store never blocks training).
            codec: compression options for packed blobs.
            allow_pickle: admit arbitrary Python objects in the state through pickle (off: a
                checkpoint from a stranger must not be able to run code).
            rank, world_size, ranks_per_node: placement; detected from torch.distributed and the
                launcher's environment when not given.
            node: the node's name (default ``node<index>``).
            coordinator: how ranks agree (default: none for one rank, dedicated gloo groups
                for more).
            local_capacity: bytes the local tier may use.
            peer_replicas, peer_timeout: peer tier replica count and the seconds any exchange with
                another rank may take before failing.
            threads: worker threads for hashing and compression (default: every core).
            storage_options: options for the ``persistent`` URL's fsspec filesystem, e.g. for
                S3 ``{"key": ..., "secret": ..., "client_kwargs": {"endpoint_url": ...}}``
                (default: the backend's own, such as the AWS environment variables).
            stale_memory: what to do with a node's shared memory that holds checkpoints of
                another run of the same ``job_id`` (another durable location, or a location
                that was made anew): ``"error"`` (default) refuses to open with
                :class:`~tiercheck.errors.StaleMemory`, ``"discard"`` deletes that memory.
            close_timeout: seconds the close may spend on each step that can wait on something
                it does not control: when leaving ``with``/``async with`` on an exception, the
                wait for the saves in flight (memory tiers first; no agreement with other
                ranks, which may be failing too), and stopping the peer tier's server. The
                normal close waits for every save without this bound (each exchange with
                another rank is bounded by ``peer_timeout``).

        Opening refuses, with a typed error and before anything is read or changed: a second
        live writer of the same rank on this node (:class:`~tiercheck.errors.JobLocked`), a
        durable location that cannot be written, read and deleted from
        (:class:`~tiercheck.errors.StorageError`), a job saved by another number of ranks
        (:class:`~tiercheck.errors.WorldSizeMismatch`), and stale memory (above). A second
        opening of the job elsewhere takes the durable tiers over; this one then stops writing
        there (:class:`~tiercheck.errors.Superseded`, ``stats.superseded``).

        Memory: staging costs one copy of the state (in the local tier's memory when it is used),
        a second copy is held as the delta base when a packed tier receives deltas, and each
        tier's queue holds at most ``tier_queue`` encoded versions.
        """
        self._config = resolve_options(
            job_id,
            persistent=persistent,
            local_root=local_root,
            tiers=tiers,
            base_every=base_every,
            keep=keep,
            persist=persist,
            encodings=encodings,
            policies=policies,
            on_busy=on_busy,
            max_pending=max_pending,
            overlap=overlap,
            tier_queue=tier_queue,
            codec=codec,
            allow_pickle=allow_pickle,
            rank=rank,
            world_size=world_size,
            ranks_per_node=ranks_per_node,
            node=node,
            coordinator=coordinator,
            local_capacity=local_capacity,
            peer_replicas=peer_replicas,
            peer_timeout=peer_timeout,
            threads=threads,
            storage_options=storage_options,
            stale_memory=stale_memory,
            close_timeout=close_timeout,
        )
        self._loop: LoopThread | None = None
        self._engine: _Engine | None = None
        self._closed = False

    # --- properties ---------------------------------------------------------------------------

    @property
    def job_id(self) -> str:
        """The job's name."""
        return self._config.job.job_id

    @property
    def topology(self) -> Topology:
        """Where this rank sits."""
        return self._config.job.topology

    @property
    def tier_names(self) -> list[str]:
        """The tiers in use, fastest first (after opening; configuration order before)."""
        if self._engine is not None and self._engine.tiers:
            return [t.name for t in self._engine.tiers]
        return [t.name if isinstance(t, Tier) else t for t in self._config.tiers.specs]

    @property
    def policies(self) -> Mapping[str, TierPolicy]:
        """The policy of each tier."""
        return dict(self._config.tiers.policies)

    @property
    def node_root(self) -> Path:
        """This node's shared-memory folder."""
        return self._config.job.node_root

    @property
    def persistent_job_url(self) -> str:
        """The job's folder in the built-in persistent tier: the ``persistent=`` URL plus the
        job id (where a ``"persistent"`` tier stores; a :class:`Tier` instance stores elsewhere).
        """
        return persistent_job_url(self._config.job.persistent_url, self._config.job.job_id)

    @property
    def stats(self) -> CheckpointerStats:
        """Running totals (a snapshot copy)."""
        if self._engine is None:
            return CheckpointerStats()
        return replace(self._engine.stats)

    def fence(self, timeout: float | None = None) -> None:
        """Block until every snapshot this checkpointer is still copying is staged.

        The fence of overlapped saves (``overlap=True``), for every save at once; returns at
        once when none is in flight (always, for blocking saves). Callable from any thread,
        including hooks (:func:`~tiercheck.fence_before_step`); never raises a copy's own
        failure, only :class:`TimeoutError` when ``timeout`` passes first.
        """
        engine = self._engine
        if engine is not None:
            engine.fence(timeout)

    # --- lifecycle ----------------------------------------------------------------------------

    def _start(self) -> tuple[LoopThread, _Engine]:
        if self._closed:
            raise TierClosed(f"the checkpointer of job {self.job_id!r} is closed")
        if self._engine is None or self._loop is None:
            self._loop = LoopThread(
                f"tiercheck-{self._config.job.job_id}-r{self._config.job.topology.rank}"
            )
            self._engine = _Engine(self._config)
        return self._loop, self._engine

    def _abandon(self) -> None:
        """Stop dead, as a crashed process would (for tests): nothing is flushed or closed."""
        self._closed = True
        if self._loop is not None:
            if self._engine is not None:
                self._engine.closed = True
            self._loop.stop()
            self._loop = None
        if self._engine is not None:
            self._engine.lock.release()  # the kernel drops a dead process's locks


class Checkpointer(_CheckpointerCore):
    """Tiered, asynchronous checkpointing of one rank's training state.

    ``save`` blocks only while the state is copied to host memory; the rest happens in the
    background (see the module docstring for the order of events). ``restore`` returns the
    newest version every rank can rebuild, from the fastest tier that has it.

    Constructed with ``job_id`` and keyword options (``persistent=``, ``tiers=``,
    ``base_every=``, ``keep=``, ...): see ``__init__``. :class:`~tiercheck.SyncCheckpointer`
    takes exactly the same.
    """

    async def open(self) -> Checkpointer:
        """Open tiers, manifest and coordination (done on first use if not called)."""
        if self._engine is not None and self._engine.opened:
            return self
        loop, engine = self._start()
        try:
            await loop.run(engine.open())
        except BaseException:
            await self._shutdown("now")
            raise
        return self

    async def _ensure_open(self) -> tuple[LoopThread, _Engine]:
        if self._closed:
            raise TierClosed(f"the checkpointer of job {self.job_id!r} is closed")
        if self._engine is None or not self._engine.opened:
            await self.open()
        assert self._loop is not None
        assert self._engine is not None
        return self._loop, self._engine

    async def __aenter__(self) -> Checkpointer:
        return await self.open()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        # On an exception the other ranks may be failing too: no agreement, a bounded flush.
        await self._shutdown("collective" if exc_type is None else "bounded")

    async def save(self, version: int, state: Any) -> SaveHandle:
        """Snapshot ``state`` as ``version`` and return once training may modify it again
        (with ``overlap=True``: once the copy is started; see :meth:`SaveHandle.staged`)."""
        marks = caller_marks()
        loop, engine = await self._ensure_open()
        return await loop.run(engine.save(version, state, marks))

    async def restore(
        self, state: Any = None, *, version: int | None = None, strict: bool = True
    ) -> Restored | None:
        """Restore the newest version every rank can rebuild (or exactly ``version``).

        Every rank must call it (it is collective). Returns ``None`` when nothing is stored (a
        fresh start). When versions are stored but none can be restored (corrupt everywhere,
        unreadable, a tier that cannot be listed) it raises
        :class:`~tiercheck.errors.RestoreError` listing, per version, rank and tier, why each
        was rejected -- and deletes nothing. Blobs that fail verification are set aside under
        ``quarantine/`` in their tier. Versions newer than the one restored are removed only
        after it was restored whole.

        With ``state`` given, tensors are copied into the caller's own tensors (optimizers keep
        their references) and the filled object is returned as ``Restored.state``. First the
        state is compared with the version: with ``strict=True`` structure, keys, shapes and
        dtypes must match; with ``strict=False`` keys present on one side only are allowed
        (the version's are added, the state's are left alone). Any mismatch raises
        :class:`~tiercheck.errors.StateMismatch` listing the paths, before anything is written
        into the state or removed from storage.
        """
        loop, engine = await self._ensure_open()
        return await loop.run(engine.restore(state, version, strict))

    async def wait(self) -> dict[str, int | None]:
        """Wait until every save so far is committed or failed in each of its tiers.

        Returns the newest version committed in each tier by then (``None`` for a tier that
        holds none): ``(await ckpt.wait())["persistent"]`` is the newest durable version.
        """
        loop, engine = await self._ensure_open()
        await loop.run(engine.wait())
        return await loop.run(engine.newest())

    async def versions(self) -> dict[str, list[int]]:
        """Versions committed in each tier, as known to this rank."""
        loop, engine = await self._ensure_open()
        return await loop.run(engine.versions())

    async def aclose(self, *, flush: bool = True, failed: bool = False) -> None:
        """Finish the saves in flight, then release everything; every rank must call it.

        The normal end of a job, collective: once every rank's saves are done, the ranks
        agree on it, stop their peer servers (the last use of the job's key-value store) and
        agree again, so that no rank leaves while another still needs the store or a peer.
        A rank or store that is gone is logged once and never makes this raise or hang
        beyond ``peer_timeout`` per exchange and ``close_timeout`` per local step.
        ``flush=False`` waits for nothing and agrees with no one: pending saves are abandoned.
        ``failed=True`` is the close of a rank leaving because of an error, as when it leaves
        ``async with`` on an exception: no agreement (the other ranks may be failing too), the
        saves in flight get ``close_timeout`` seconds, memory tiers first.
        """
        await self._shutdown("now" if not flush else "bounded" if failed else "collective")

    async def _shutdown(self, how: CloseMode) -> None:
        self._closed = True
        if self._loop is None or self._engine is None:
            return
        loop, engine = self._loop, self._engine
        try:
            await loop.run(engine.aclose(how))
        finally:
            loop.stop()
            self._loop = None
