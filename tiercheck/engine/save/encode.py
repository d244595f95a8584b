"""Encoding: from a staged snapshot to one blob per encoding, handed to the tier lanes.

Jobs are encoded one after the other, in save order (a delta needs its base encoded first):
the raw payload is hashed; a snapshot staged in a tier's own memory is published there; the
state is encoded once per encoding its tiers use (``"full"``: the payload as is; ``"packed"``:
a delta against the base in memory, byte planes, zstd) and offered to each tier's lane.
A base stays in memory (:attr:`Encoder.base`) until the next base replaces it. The encoder
executes the save's plan (:mod:`tiercheck.engine.save.plan`) and tells the schedule what became of
a base (:meth:`~tiercheck.engine.save.schedule.Schedule.base_in_memory` and the like); the one
decision it takes is the one known only now: a delta whose base is not in memory is encoded as a
base (:func:`~tiercheck.engine.save.plan.base_unusable`).

An overlapped snapshot (``overlap=True``) is encoded while the caller may not have confirmed it
unchanged yet (see :mod:`tiercheck.engine.save.staging`): it is published in the tier whose memory
it was staged in only once confirmed, memory tiers' lanes write it only then, and no commit round
counts it before. A snapshot found changed fails the version in every tier, and the next save is a
base. The job's slot is given back once it is encoded, not once it is confirmed: the
caller, who confirms, may be waiting for that slot.

On a node's first rank other than rank 0 the tiers that outlive the cluster get the lean state
instead (:func:`tiercheck.codec.replica.lean`): its replicated values are references to rank
0's blob, so those tiers hold them once in all; the memory tiers, which a node restores from
alone, keep them whole. A lean delta is encoded against the base's lean state, which is what
those tiers hold of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from concurrent.futures import Executor
from typing import Any

from tiercheck.codec import BlobMeta, CodecOptions, RawState, encode, finalize_full_blob
from tiercheck.codec.format.digest import chunk_digests, tree_root
from tiercheck.codec.replica import Lean, lean, skeleton_steps
from tiercheck.consistency.manifest import Abort, Begin
from tiercheck.defaults import encoding_kind
from tiercheck.engine.commit.tier import TierPipeline, writes_commit_records
from tiercheck.engine.jobs import BaseInMemory, Job
from tiercheck.engine.journal import Journal
from tiercheck.engine.options import Options, TierEncoding
from tiercheck.engine.save.plan import base_unusable
from tiercheck.engine.save.schedule import Schedule
from tiercheck.errors import FormatError, StateChanged, TierClosed, TierWriteFailed
from tiercheck.tiers.base import Buffer

__all__ = ["Encoder", "encode_blob"]

logger = logging.getLogger("tiercheck")


class Encoder:
    """Runs each save's encoding task; holds the newest base for the deltas after it."""

    def __init__(
        self,
        options: Options,
        journal: Journal,
        cpu: Executor,
        pipes: Mapping[str, TierPipeline],
        schedule: Schedule,
    ) -> None:
        self.options = options
        self.topo = options.job.topology
        self.rank = self.topo.rank
        self.journal = journal
        #: Worker threads for hashing and compression.
        self.cpu = cpu
        self.pipes = pipes
        self.schedule = schedule
        #: The newest base, in memory: what deltas are encoded against.
        self.base: BaseInMemory | None = None
        #: Encoding tasks not done yet.
        self.tasks: set[asyncio.Task[None]] = set()
        # The last lean layout made, by the skeleton and paths it was made from.
        self._lean: tuple[bytes, tuple[tuple[Any, ...], ...], Lean | None] | None = None

    def start(self, job: Job) -> None:
        """Encode ``job`` in the background, after the job before it."""
        self.schedule.occupy(job)
        task = asyncio.create_task(self.run(job))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def drop_base(self) -> None:
        """Let the base in memory go (a restore, or the close)."""
        if self.base is not None:
            self.base.holder.drop()
            self.base = None

    async def run(self, job: Job) -> None:
        """Hash, publish locally, encode for the other tiers, hand blobs to the tier lanes.

        An overlapped snapshot is published, and its version counted as good, only once the
        caller confirmed it unchanged (:meth:`~tiercheck.engine.jobs.Job.unconfirmed`);
        everything else goes ahead meanwhile."""
        assert job.holder is not None
        raw: RawState | None = None
        try:
            raw = await self._encode_job(job)
        finally:
            # The next save may now encode (against this one, when it is a base) and take this
            # one's slot, even while this one waits for its confirmation: the caller waits for
            # slots, and only the caller's own calls confirm (see tiercheck.engine.save.staging).
            job.encoded.set()
            await self.schedule.release(job)
        try:
            if raw is not None:
                await self._settle(job)
            if job.publish is not None:
                await job.publish
        finally:
            publish = job.take_publish()
            if publish is not None and not publish.done():
                publish.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await publish
            job.holder.drop()
            job.let_go()

    async def _encode_job(self, job: Job) -> RawState | None:
        """Everything but the verdict on an overlapped snapshot: the raw state (``None`` when
        the version failed, every tier told why). A snapshot staged in a tier's memory is
        published by a task of its own (:attr:`Job.publish`) once it is confirmed."""
        assert job.layout is not None
        assert job.payload is not None
        assert job.holder is not None
        doing = "staging"
        try:
            await job.after_previous()
            # An overlapped snapshot: nothing reads the payload before it is staged.
            await job.copied()
            if job.confirmed is not None and job.confirmed.done():
                found = job.confirmed.exception()
                if found is not None:
                    raise found  # found changed already: nothing to encode
            doing = "encoding"
            # Decided before the manifest is told, so that its record says what the blob is.
            base: RawState | None = None
            in_memory = None if self.base is None else self.base.raw.version
            if base_unusable(job.kind, job.base_version, in_memory):
                logger.warning(
                    "tiercheck: base %s of version %s is unavailable; encoding it as a base",
                    job.base_version,
                    job.version,
                )
                job.encode_as_base()
            elif job.kind == "delta":
                assert self.base is not None
                base = self.base.raw
            delta = job.kind == "delta"
            self.journal.log(
                Begin(
                    job.version,
                    self.rank,
                    "delta" if delta else "base",
                    job.base_version if delta else None,
                )
            )
            # The leaves of the digest are kept: a full blob stores them (format 1.1), so that
            # a reader of part of it can check what it reads.
            leaves = await asyncio.to_thread(chunk_digests, job.payload, executor=self.cpu)
            digest = tree_root(leaves, job.layout.payload_nbytes)
            raw = RawState(job.version, job.layout, job.payload, digest, tuple(leaves))
            if job.reservation is not None:
                assert job.reserved_in is not None
                # Published as soon as the caller confirms it, while the rest is encoded.
                job.publishing(
                    asyncio.create_task(
                        _publish_when_confirmed(
                            self.pipes[job.reserved_in], job, raw, cpu=self.cpu, rank=self.rank
                        )
                    )
                )
            # What the durable tiers store: the lean state, on a node's first rank but rank 0.
            lean_raw = (
                await self._lean_state(job, raw) if job.replicated_paths is not None else None
            )
            base_in_memory = self.base if base is not None else None
            encoded: dict[tuple[TierEncoding, bool], tuple[list[Buffer], BlobMeta]] = {}
            for name, encoding in job.targets.items():
                if job.results[name].done():  # skipped when staging
                    continue
                if job.publish is not None and name == job.reserved_in:
                    continue  # staged in place: the publishing task decides it
                durable = job.replicated_paths is not None and writes_commit_records(
                    self.pipes[name].tier
                )
                source = lean_raw if durable and lean_raw is not None else raw
                if (encoding, durable) not in encoded:
                    against = None if base_in_memory is None else base_in_memory.for_tier(durable)
                    encoded[encoding, durable] = await self._encode(source, encoding, against)
                parts, meta = encoded[encoding, durable]
                # A memory tier's lane waits for the confirmation before it writes; a durable
                # tier's writes at once, and its commit round waits
                # (tiercheck.engine.commit.commit). A blob stored as is from the staged
                # snapshot is views of it (not of the lean state, which is its own memory).
                self.pipes[name].lane.offer(
                    job, parts, meta, views=meta.encoding.as_is and source is raw
                )
            if job.kind == "base":
                # Held at once, for the next save's deltas (if it is not confirmed, the save
                # after it is a base: see _settle).
                self.schedule.base_in_memory(job.version)
                job.holder.acquire()
                old, self.base = self.base, BaseInMemory(raw, job.holder, lean_raw)
                if old is not None:
                    old.holder.drop()
        except Exception as exc:
            if isinstance(exc, StateChanged):
                logger.warning("tiercheck: version %s is not stored: %s", job.version, exc)
            elif isinstance(exc, TierClosed):
                # The checkpointer closed under it (a close that stopped waiting, an exit): an
                # expected end of this version, not a fault of tiercheck's to trace.
                logger.warning(
                    "tiercheck: version %s is not stored: the checkpointer closed first (%s)",
                    job.version,
                    exc,
                )
            else:
                logger.exception("tiercheck: %s version %s failed", doing, job.version)
            self.journal.log(Abort(job.version, self.rank, f"{doing} failed: {exc!r}"))
            if job.publish is None:
                await _abort_reservation(job)
            for name in job.targets:
                if job.publish is not None and name == job.reserved_in:
                    # A confirmed snapshot is stored there whatever became of the encoding.
                    continue
                job.lane_done(
                    name,
                    None,
                    TierWriteFailed(
                        f"version {job.version} could not be "
                        f"{'staged' if doing == 'staging' else 'encoded'}: {exc!r}"
                    ),
                    cause=exc,
                )
            if job.kind == "base":
                self.schedule.base_failed(job.version)
            return None
        return raw

    async def _settle(self, job: Job) -> None:
        """Wait for the caller's verdict on the snapshot (at once for a blocking save); a
        snapshot that is not confirmed fails the version in every tier."""
        why = await job.unconfirmed()
        if why is None:
            return
        cause = why.__cause__ if why.__cause__ is not None else why
        if isinstance(cause, StateChanged):
            logger.warning("tiercheck: version %s is not stored: %s", job.version, cause)
        else:
            logger.warning("tiercheck: version %s is not stored: %r", job.version, cause)
        self.journal.log(Abort(job.version, self.rank, f"staging failed: {cause!r}"))
        for name in job.targets:
            job.lane_done(name, None, job.staged_failure(cause))
        if job.kind == "base":
            # No more deltas against it: the next save is a base. The copy in memory stays until
            # that one replaces it -- a delta encoding now may still be reading it.
            self.schedule.base_unconfirmed(job.version)

    async def _lean_state(self, job: Job, raw: RawState) -> RawState | None:
        """``raw`` with its replicated state left to rank 0 (see
        :func:`~tiercheck.codec.replica.lean`); ``None`` when it holds none."""
        assert job.replicated_paths is not None
        # Needed by a durable tier this version goes to, or, for a base, by the deltas after it.
        wanted = job.targets if job.kind == "delta" else self.pipes
        if not any(writes_commit_records(self.pipes[name].tier) for name in wanted):
            return None
        layout = raw.layout
        cached = self._lean
        if (
            cached is not None
            and cached[0] == layout.skeleton
            and cached[1] == job.replicated_paths
        ):
            made = cached[2]
        else:
            made = None
            steps = [skeleton_steps(h) for h in job.replicated_paths]
            try:
                if any(step is None for step in steps):
                    raise ValueError("a Replicated value sits under a key no skeleton holds")
                made = await asyncio.to_thread(
                    lean, layout, [s for s in steps if s is not None], 0, self.topo.world_size
                )
            except (ValueError, FormatError) as exc:
                # Safe, only larger: the durable tiers get this rank's replicated state too.
                logger.warning(
                    "tiercheck: rank %s stores its replicated state whole in durable tiers "
                    "(it could not be told apart: %s)",
                    self.rank,
                    exc,
                )
            self._lean = (layout.skeleton, job.replicated_paths, made)
        if made is None:
            return None
        try:
            payload = await asyncio.to_thread(made.payload, layout, raw.payload)
            leaves = await asyncio.to_thread(chunk_digests, payload, executor=self.cpu)
        except Exception:
            # The lean copy is an economy: without it the durable tiers store the state whole.
            logger.exception(
                "tiercheck: rank %s could not make version %s lean; durable tiers store it whole",
                self.rank,
                raw.version,
            )
            return None
        return RawState(
            raw.version,
            made.layout,
            payload,
            tree_root(leaves, made.layout.payload_nbytes),
            tuple(leaves),
        )

    async def _encode(
        self, raw: RawState, encoding: TierEncoding, base: RawState | None
    ) -> tuple[list[Buffer], BlobMeta]:
        return await encode_blob(
            raw,
            encoding,
            rank=self.rank,
            base=base,
            options=self.options.encode.codec,
            cpu=self.cpu,
        )


async def encode_blob(
    raw: RawState,
    encoding: TierEncoding,
    *,
    rank: int,
    options: CodecOptions,
    cpu: Executor,
    base: RawState | None = None,
) -> tuple[list[Buffer], BlobMeta]:
    """``raw`` as a blob in ``encoding`` (:func:`tiercheck.codec.encode`; a delta against
    ``base`` where given and the encoding takes one), off the event loop unless it is stored
    as is (views of the payload and a header: no work worth a thread)."""
    if encoding_kind(encoding).as_is:
        return encode(raw, encoding, rank=rank, base=base, options=options)
    return await asyncio.to_thread(
        encode, raw, encoding, rank=rank, base=base, options=options, executor=cpu
    )


async def _publish_when_confirmed(
    pipe: TierPipeline, job: Job, raw: RawState, *, cpu: Executor, rank: int
) -> None:
    """Publish a snapshot staged in a tier's memory once the caller confirmed it; discard
    it otherwise (a blob there is restorable: a torn one must never get there)."""
    assert job.reserved_in is not None
    try:
        why = await job.unconfirmed()
        # As in the tier's lane: nothing is published before the timeline is settled for it.
        refused = why is None and not await pipe.takes_new()
    except asyncio.CancelledError:  # closing without waiting: nothing is published
        await _abort_reservation(job)
        raise
    if refused:
        await _abort_reservation(job)
        pipe.skip(job, pipe.refusal())
    elif why is None:
        await _publish_reserved(pipe, job, raw, cpu=cpu, rank=rank)
    else:
        await _abort_reservation(job)
        job.lane_done(job.reserved_in, None, why)


async def _abort_reservation(job: Job) -> None:
    """Discard a snapshot staged in a tier's memory that was not published (logged)."""
    if (
        job.reservation is not None
        and job.reserved_in in job.results
        and not job.results[job.reserved_in].done()
    ):
        try:
            await job.reservation.abort()
        except Exception:
            logger.exception(
                "tiercheck: discarding version %s from the %r tier failed",
                job.version,
                job.reserved_in,
            )


async def _publish_reserved(
    pipe: TierPipeline, job: Job, raw: RawState, *, cpu: Executor, rank: int
) -> None:
    """Finish the blob staged in ``pipe``'s memory and publish it (its lane result)."""
    reservation = job.reservation
    assert reservation is not None
    assert job.reserved_in is not None
    try:
        assert job.layout is not None
        meta = await asyncio.to_thread(
            finalize_full_blob,
            reservation.buffer,
            raw_digest=raw.raw_digest,
            chunk_digests=raw.chunk_digests,
            executor=cpu,
            known=(job.layout, job.version, rank),
        )
        await reservation.commit()
    except Exception as exc:
        logger.exception(
            "tiercheck: publishing version %s in the %s tier failed", job.version, pipe.name
        )
        try:
            await reservation.abort()
        except Exception:
            logger.exception(
                "tiercheck: discarding version %s from the %s tier failed", job.version, pipe.name
            )
        job.lane_done(
            pipe.name,
            None,
            TierWriteFailed(
                f"version {job.version} could not be written to the {pipe.name} tier: {exc!r}"
            ),
            cause=exc,
        )
        return
    durable = pipe.record_written(job, reservation.key, meta)
    job.lane_done(pipe.name, durable)
