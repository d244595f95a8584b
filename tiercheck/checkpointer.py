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
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import msgpack
import torch

from tiercheck._loop import LoopThread
from tiercheck._threads import DaemonExecutor
from tiercheck.codec import (
    BlobMeta,
    CodecOptions,
    Layout,
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
from tiercheck.consistency.commit import CommitEntry, CommitRecord
from tiercheck.consistency.coordinator import Coordinator, SoloCoordinator
from tiercheck.consistency.identity import JobRecord, NodeIdentity, quarantine_key
from tiercheck.consistency.keys import (
    MAX_VERSION,
    BlobKind,
    blob_key,
    commit_key,
    parse_blob_key,
    parse_commit_key,
    version_prefix,
)
from tiercheck.consistency.manifest import Abort, Begin, Commit, Durable, Evict, Manifest, Record
from tiercheck.consistency.recovery import Inventory, agree, candidates
from tiercheck.consistency.retention import UNKNOWN_BASE, evictable
from tiercheck.defaults import (
    NodeRoot,
    persistent_job_url,
)
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
from tiercheck.errors import (
    BlobNotFound,
    ChecksumMismatch,
    ConfigError,
    FormatError,
    JobLocked,
    PeerUnavailable,
    RestoreError,
    SaveSkipped,
    StaleMemory,
    StateChanged,
    StateMismatch,
    StorageError,
    Superseded,
    TiercheckError,
    TierClosed,
    TierFull,
    TierNotTargeted,
    TierWriteFailed,
    UnsupportedFormat,
    UnsupportedObject,
    VersionError,
    WorldSizeMismatch,
)
from tiercheck.guard import (
    Fence,
    RankLock,
    discard_node_memory,
    node_holds_data,
    probe,
    read_identity,
    read_job_record,
    write_identity,
    write_job_record,
)
from tiercheck.staging import SnapshotCopy, StagingBuffer, StagingPool, caller_marks
from tiercheck.tiers.base import (
    Buffer,
    FailureScope,
    Reservation,
    SupportsPrepare,
    SupportsReserve,
    SupportsStopServing,
    Tier,
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

# --- public value types ----------------------------------------------------------------------


@dataclass
class TierSaveStats:
    """How one version fared in one tier."""

    state: Literal["pending", "committed", "failed", "skipped"] = "pending"
    #: Bytes written to the tier for this rank.
    bytes: int = 0
    #: Seconds from the start of ``save`` until committed (or failed).
    seconds: float | None = None
    error: str | None = None


@dataclass
class SaveStats:
    """Figures of one save."""

    version: int
    kind: Literal["base", "delta", "skipped"]
    #: Seconds ``save`` blocked the caller (flatten, back-pressure wait, snapshot copy; with
    #: ``overlap=True`` the copy is not included).
    stall_s: float = 0.0
    #: Seconds from the start of ``save`` until the snapshot was copied (staged), once it is.
    staged_s: float | None = None
    #: Bytes of the raw payload (every tensor, laid out flat).
    raw_bytes: int = 0
    tiers: dict[str, TierSaveStats] = field(default_factory=dict)


@dataclass
class CheckpointerStats:
    """Running totals of a checkpointer."""

    saves: int = 0
    skipped: int = 0
    committed: dict[str, int] = field(default_factory=dict)
    failed: dict[str, int] = field(default_factory=dict)
    last_committed: dict[str, int] = field(default_factory=dict)
    evicted: dict[str, int] = field(default_factory=dict)
    stall_s_total: float = 0.0
    manifest_errors: int = 0
    restore_fallbacks: int = 0
    #: Versions a tier could not take at all (full, unusable when staging), by tier; they
    #: still went to the other tiers.
    tier_skips: dict[str, int] = field(default_factory=dict)
    #: Blobs that failed verification during a restore and were set aside (``quarantine/``).
    quarantined: int = 0
    #: Whether a newer opening of the job took over its durable tiers (this one stopped
    #: writing there; see :class:`~tiercheck.errors.Superseded`).
    superseded: bool = False


#: Restored tensors up to this size have storage of their own; larger ones are views into one
#: shared buffer (see :class:`Restored`).
OWN_STORAGE_BYTES = 64 * 1024


@dataclass(frozen=True)
class Restored:
    """The result of a restore.

    Without a live state to fill, tensors larger than :data:`OWN_STORAGE_BYTES` are views into
    one buffer holding the whole version (no copy beyond the read); they are valid for as long
    as they are referenced. Smaller ones (RNG states, counters, scalars) have storage of their
    own, so code that reads a tensor's storage from its start (``torch.set_rng_state``) gets
    the right bytes.
    """

    version: int
    #: The restored state: the caller's own object, filled in place, when one was passed.
    state: Any
    #: The tier this rank read from.
    source_tier: str
    #: The tier every rank read from, by rank.
    source_tiers: Mapping[int, str]
    seconds: float
    #: Newer versions that were passed over, and why (by version: one line per rank and tier).
    rejected: Mapping[int, tuple[str, ...]] = field(default_factory=dict)


def _resolved() -> concurrent.futures.Future[None]:
    fut: concurrent.futures.Future[None] = concurrent.futures.Future()
    fut.set_result(None)
    return fut


class SaveHandle:
    """What ``save`` returns: a way to wait for the version to be committed in each tier.

    ``await handle.done("local")`` resolves once the version is committed in that tier (for
    every rank); ``handle.result("local", timeout)`` is the blocking form. Asking about a tier
    the version does not go to raises :class:`~tiercheck.errors.TierNotTargeted` at once; a
    version that could not be committed raises :class:`~tiercheck.errors.TierWriteFailed`;
    a skipped save raises :class:`~tiercheck.errors.SaveSkipped`.

    With ``overlap=True`` the snapshot copy runs after ``save`` returned: :meth:`staged` (or
    ``await handle.staged_async()``) is the fence to pass before changing the state.
    """

    def __init__(self, version: int, tiers: Sequence[str], stats: SaveStats) -> None:
        self.version = version
        #: The tiers this version goes to.
        self.tiers = tuple(tiers)
        self.stats = stats
        self._futures: dict[str, concurrent.futures.Future[None]] = {
            t: concurrent.futures.Future() for t in tiers
        }
        # Resolved once the snapshot is copied (at once for a blocking or skipped save).
        self._staged: concurrent.futures.Future[None] = _resolved()
        for t in tiers:
            stats.tiers[t] = TierSaveStats()

    def staged(self, timeout: float | None = None) -> None:
        """Block until the snapshot copy is done: from then on the state may change.

        The fence of an overlapped save (``Checkpointer(..., overlap=True)``); returns at once
        for a blocking save. It never raises the copy's own failure (that failure, such as
        :class:`~tiercheck.errors.StateChanged`, is raised by :meth:`done` for every tier); only
        :class:`TimeoutError` when ``timeout`` passes first -- the state must then not change.
        """
        concurrent.futures.wait([self._staged], timeout)
        if not self._staged.done():
            raise TimeoutError(f"version {self.version} was not staged within {timeout} s")

    async def staged_async(self) -> None:
        """Wait, without blocking the event loop, until the snapshot copy is done."""
        await asyncio.wait([asyncio.wrap_future(self._staged)])

    @property
    def is_staged(self) -> bool:
        """Whether the snapshot copy is done (never blocks)."""
        return self._staged.done()

    @property
    def skipped(self) -> bool:
        """Whether the save was skipped by back-pressure."""
        return self.stats.kind == "skipped"

    def _futures_for(self, tier: str | None) -> list[concurrent.futures.Future[None]]:
        if tier is None:
            return list(self._futures.values())
        try:
            return [self._futures[tier]]
        except KeyError:
            raise TierNotTargeted(
                f"version {self.version} does not go to the {tier!r} tier "
                f"(it goes to {list(self.tiers)}); check the tier's `versions` policy"
            ) from None

    async def done(self, tier: str | None = None) -> None:
        """Wait until the version is committed in ``tier`` (every targeted tier if ``None``)."""
        for fut in self._futures_for(tier):
            await asyncio.wrap_future(fut)

    def result(self, tier: str | None = None, timeout: float | None = None) -> None:
        """Blocking form of :meth:`done`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for fut in self._futures_for(tier):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            fut.result(left)

    def committed(self, tier: str) -> bool:
        """Whether the version is committed in ``tier`` already (never blocks)."""
        fut = self._futures_for(tier)[0]
        return fut.done() and fut.exception() is None

    def _resolve(self, tier: str, error: BaseException | None = None) -> None:
        fut = self._futures[tier]
        if fut.done():
            return
        if error is None:
            fut.set_result(None)
        else:
            fut.set_exception(error)

    def __repr__(self) -> str:
        states = {t: s.state for t, s in self.stats.tiers.items()}
        return f"SaveHandle(version={self.version}, kind={self.stats.kind!r}, tiers={states})"


# --- pipeline internals ----------------------------------------------------------------------


class _Holder:
    """Reference count on a staging buffer or reservation; frees it when the last user is done."""

    def __init__(self, release: Callable[[], None]) -> None:
        self._release: Callable[[], None] | None = release
        self._refs = 1

    def acquire(self) -> None:
        self._refs += 1

    def drop(self) -> None:
        self._refs -= 1
        if self._refs == 0 and self._release is not None:
            # Forget the callback too: it references the memory, which must not outlive this.
            release, self._release = self._release, None
            release()


@dataclass(frozen=True, slots=True)
class _LaneResult:
    durable: Durable | None
    error: BaseException | None = None


@dataclass(eq=False)
class _Job:
    version: int
    kind: Literal["base", "delta", "skipped"]
    base_version: int | None
    targets: dict[str, TierEncoding]
    handle: SaveHandle
    started: float
    layout: Layout | None = None
    payload: torch.Tensor | None = None
    # The snapshot copy still running after save returned (overlapped saves only).
    copy: SnapshotCopy | None = None
    holder: _Holder | None = None
    reservation: Reservation | None = None
    previous: _Job | None = None
    encoded: asyncio.Event = field(default_factory=asyncio.Event)
    results: dict[str, asyncio.Future[_LaneResult]] = field(default_factory=dict)
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    rounds_left: int = 0


@dataclass(frozen=True, slots=True)
class _OwnBlob:
    key: str
    base: int | None


@dataclass(frozen=True, slots=True)
class _Base:
    raw: RawState
    holder: _Holder


class _Engine:
    """All state and logic; lives on the private loop. See the module docstring."""

    def __init__(self, config: Options) -> None:
        self.cfg = config
        self.topo = config.job.topology
        self.rank = config.job.topology.rank
        self.stats = CheckpointerStats()
        self.tiers: list[Tier] = []
        self.manifest: Manifest | None = None
        self.coordinator: Coordinator = SoloCoordinator()
        self.pool = StagingPool()
        # The previous save's structure: a repeating state is not walked and encoded anew.
        self.planner = Planner(allow_pickle=config.encode.allow_pickle)
        # Overlapped snapshot copies not done yet; read by fence() from the caller's thread.
        self.copies: set[SnapshotCopy] = set()
        self.copies_lock = threading.Lock()
        self.cpu = ThreadPoolExecutor(config.encode.threads, thread_name_prefix="tiercheck-cpu")
        self.manifest_exec = ThreadPoolExecutor(1, thread_name_prefix="tiercheck-manifest")
        # One thread per channel keeps its exchanges in order; daemon threads, because an
        # exchange may wait on a dead rank for minutes and must never delay the process's exit.
        self.channel_exec: dict[str, DaemonExecutor] = {}
        self.lanes: dict[str, asyncio.Queue[tuple[_Job, list[Buffer], BlobMeta] | None]] = {}
        self.round_queues: dict[str, asyncio.Queue[_Job | None]] = {}
        # Set while a tier's round worker has nothing left to do (retention included).
        self.idle: dict[str, asyncio.Event] = {}
        self.workers: list[asyncio.Task[None]] = []
        self.pipelines: set[asyncio.Task[None]] = set()
        self.jobs: set[_Job] = set()
        self.own: dict[str, dict[int, _OwnBlob]] = {}
        self.committed: dict[str, set[int]] = {}
        self.settled: dict[str, int] = {}
        self.pending: list[_Job] = []
        self.slot_freed = asyncio.Condition()
        self.save_lock = asyncio.Lock()
        self.last_job: _Job | None = None
        self.last_version: int | None = None
        self.count = 0
        self.planned_base: int | None = None
        self.base: _Base | None = None
        self.session_started = False
        self.reserve_size = 0  # size of the last local reservation: the next is likely the same
        self.opened = False
        self.session = ""
        self.closed = False
        self.lock = RankLock(config.job.node_root, config.job.topology.rank)
        # The job's incarnation (see tiercheck.consistency.identity) and, per durable tier, the
        # writer generation this opening claimed there.
        self.job_token = ""
        self.fences: dict[str, Fence] = {}
        self.superseded = False
        # A delta's base vanished from a tier: the next save is encoded as a base.
        self.force_base = False
        # Tiers this rank could not list: retention never deletes from them blindly.
        self.unlisted: set[str] = set()
        # (tier, reason) pairs already logged as skips; cleared when the tier takes a version.
        self.skip_logged: set[tuple[str, str]] = set()
        self.manifest_failing = False
        self.closing = False
        self.close_warned = False
        # Tiers whose trouble with another rank was logged (once per spell, see _peer_trouble).
        self.peer_warned: set[str] = set()

    # --- opening ------------------------------------------------------------------------------

    async def open(self) -> None:
        cfg = self.cfg
        # Coordination first: creating process groups is a collective, and every rank must
        # create them in the same order (the coordinator's, then the peer tier's).
        self.channel_exec["control"] = DaemonExecutor(1, "tiercheck-sync-control")
        loop = asyncio.get_running_loop()
        if cfg.coordination.coordinator is not None:
            self.coordinator = cfg.coordination.coordinator
        elif self.topo.world_size > 1:
            from tiercheck.consistency.coordinator import TorchCoordinator

            names = [t.name if isinstance(t, Tier) else t for t in cfg.tiers.specs]
            # Creating groups waits on every rank: on a daemon thread, like every exchange.
            self.coordinator = await loop.run_in_executor(
                self.channel_exec["control"],
                lambda: TorchCoordinator(
                    ["control", *names], timeout=cfg.coordination.peer_timeout
                ),
            )
        # One token per incarnation of the job, agreed by all ranks: keeps a restarted job
        # from reading the key-value store entries of the one that died.
        token = os.urandom(8).hex()
        self.session = str((await self._exchange("control", {"token": token}))[0]["token"])
        # Every tier but the peer tier: constructing that one is a collective, so it waits
        # until every rank has passed the checks below (which fail on every rank alike).
        for spec in cfg.tiers.specs:
            if isinstance(spec, Tier):
                self.tiers.append(spec)
            elif spec != "peer":
                self.tiers.append(await asyncio.to_thread(self._make_tier, spec))
        await self._guard()
        if "peer" in cfg.tiers.specs:
            self.tiers.append(await asyncio.to_thread(self._make_tier, "peer"))
        names = [t.name for t in self.tiers]
        if len(set(names)) != len(names):
            raise ConfigError(f"tier names must be unique, got {names}")
        self.tiers.sort(key=lambda t: int(t.survives))
        try:
            self.manifest = await asyncio.to_thread(Manifest, NodeRoot(cfg.job.node_root).manifest)
        except TiercheckError as exc:
            self.stats.manifest_errors += 1
            logger.error("tiercheck: running without a manifest: %s", exc)
        for tier in self.tiers:
            self.policy(tier.name)  # fail early on a tier without a policy
            self.settled[tier.name] = -1
            self.lanes[tier.name] = asyncio.Queue()
            self.round_queues[tier.name] = asyncio.Queue()
            self.idle[tier.name] = asyncio.Event()
            self.idle[tier.name].set()
            self.channel_exec[tier.name] = DaemonExecutor(1, f"tiercheck-sync-{tier.name}")
            try:
                self.own[tier.name] = await self._list_own(tier)
                if self.writes_commit_records(tier):
                    # What retention counts in a durable tier is what its COMMIT records
                    # prove, not what this node's manifest remembers (it may be new).
                    self.committed[tier.name] = await self._commit_versions(tier)
                else:
                    known = set(self.manifest.committed(tier.name)) if self.manifest else set()
                    self.committed[tier.name] = {v for v in known if v in self.own[tier.name]}
            except Exception as exc:
                logger.error(
                    "tiercheck: cannot list the %r tier (%r); nothing will be deleted from it "
                    "until a restore lists it",
                    tier.name,
                    exc,
                )
                self.unlisted.add(tier.name)
                self.own[tier.name] = {}
                self.committed[tier.name] = set()
            self.workers.append(asyncio.create_task(self._lane_worker(tier)))
            self.workers.append(asyncio.create_task(self._round_worker(tier)))
        self.opened = True

    # --- guards: whose data this is, one writer, usable locations -------------------------------

    def _durable_tiers(self) -> list[Tier]:
        return [t for t in self.tiers if self.writes_commit_records(t)]

    def _location(self, tier: Tier) -> str:
        """Where a durable tier stores, as recorded in node identities."""
        inner: Any = tier
        while getattr(inner, "inner", None) is not None:  # wrappers (fault injection, ...)
            inner = inner.inner
        return str(getattr(inner, "url", None) or repr(inner))

    async def _guard(self) -> None:
        """Refuse to open over data this run must not touch; the same verdict on every rank.

        Each rank gathers what it can see (its writer lock, whether the durable tiers work, its
        node's identity); rank 0 also reads or creates the job record and claims a writer
        generation. One exchange later every rank decides from the same facts, so every rank
        raises the same typed error, or none does.
        """
        cfg, topo = self.cfg, self.topo
        mine: dict[str, Any] = {"node": topo.node_index, "local_rank": topo.local_rank}
        try:
            await asyncio.to_thread(self.lock.acquire)
        except (JobLocked, OSError) as exc:
            mine["lock"] = str(exc)
        durable = self._durable_tiers()
        probes: dict[str, str] = {}
        for tier in durable:
            try:
                await probe(tier, self.session, self.rank)
            except (TiercheckError, OSError) as exc:
                probes[tier.name] = str(exc)
        mine["probe"] = probes
        if self.rank == 0 and durable and not probes:
            try:
                mine["job"] = await self._read_job_record(durable)
            except (TiercheckError, OSError) as exc:
                mine["job_error"] = f"{type(exc).__name__}: {exc}"
        try:
            identity = await asyncio.to_thread(read_identity, cfg.job.node_root)
            mine["identity"] = None if identity is None else identity.to_bytes().decode()
        except (TiercheckError, OSError) as exc:
            mine["identity_error"] = str(exc)
        try:
            mine["has_data"] = await asyncio.to_thread(node_holds_data, cfg.job.node_root)
        except OSError:
            mine["has_data"] = True  # cannot look: assume there is something to protect
        if self.rank == 0:
            mine["fresh_token"] = os.urandom(8).hex()
        everyone = await self._exchange("control", mine)
        stale = self._judge(everyone)
        # Past this point every rank may open: only now is anything written.
        if stale and topo.local_rank == 0 and topo.node_index in stale:
            logger.warning(
                "tiercheck: discarding the memory of node %s at %s (stale_memory='discard'): %s",
                topo.node_index,
                cfg.job.node_root,
                stale[topo.node_index],
            )
            await asyncio.to_thread(discard_node_memory, cfg.job.node_root)
        claimed: dict[str, int] = {}
        failure = ""
        if self.rank == 0 and durable:
            try:
                if everyone[0]["job"]["state"] != "found":
                    await self._write_job_record()
                for tier in durable:
                    fence = Fence(tier, self.session)
                    claimed[tier.name] = await fence.claim()
                    self.fences[tier.name] = fence
            except (TiercheckError, OSError) as exc:
                failure = f"{type(exc).__name__}: {exc}"
        # Also a barrier: no rank reads its node's memory while it is being discarded.
        decided = await self._exchange("control", {"generations": claimed, "failure": failure})
        if decided[0]["failure"]:
            raise StorageError(
                f"cannot claim job {cfg.job.job_id!r} in its durable storage: "
                f"{decided[0]['failure']}"
            )
        for tier in durable:
            if tier.name not in self.fences:
                fence = Fence(tier, self.session)
                fence.adopt(int(decided[0]["generations"][tier.name]))
                self.fences[tier.name] = fence
        me = everyone[self.rank]
        if topo.local_rank == 0 and (me.get("identity") is None or topo.node_index in stale):
            identity = NodeIdentity(
                job_id=cfg.job.job_id,
                token=self.job_token,
                world_size=topo.world_size,
                persistent=self._location(durable[0]) if durable else None,
                created=time.time(),
            )
            try:
                await asyncio.to_thread(write_identity, cfg.job.node_root, identity)
            except OSError as exc:  # memory that cannot take a small file takes no blob either
                logger.warning("tiercheck: cannot record the node's identity: %r", exc)

    async def _write_job_record(self) -> None:
        record = JobRecord(self.cfg.job.job_id, self.job_token, self.topo.world_size, time.time())
        for tier in self._durable_tiers():
            await write_job_record(tier, record)

    async def _read_job_record(self, durable: Sequence[Tier]) -> dict[str, Any]:
        """Rank 0: what the durable tiers say about the job's incarnation.

        ``state`` is ``"found"`` (a job record), ``"legacy"`` (``COMMIT`` records written
        before job records existed; the newest says how many ranks saved them) or ``"absent"``
        (nothing stored: a new location, or one that was emptied).
        """
        for tier in durable:
            record = await read_job_record(tier)
            if record is not None:
                return {
                    "state": "found",
                    "token": record.token,
                    "world_size": record.world_size,
                }
        newest = max(await self._commit_versions(durable[0]), default=None)
        if newest is None:
            return {"state": "absent"}
        commit = CommitRecord.from_bytes(bytes(await durable[0].get(commit_key(newest))))
        return {"state": "legacy", "world_size": commit.world_size}

    def _judge(self, everyone: Sequence[Mapping[str, Any]]) -> dict[int, str]:
        """Decide, from what every rank saw, whether this run may open; return stale nodes.

        Pure: every rank computes the same verdict from the same exchange.
        """
        cfg, topo = self.cfg, self.topo
        locked = [e["lock"] for e in everyone if e.get("lock")]
        if locked:
            raise JobLocked(locked[0] + (f" ({len(locked)} ranks)" if len(locked) > 1 else ""))
        broken = [f"rank {r}: {msg}" for r, e in enumerate(everyone) for msg in e["probe"].values()]
        if broken:
            raise StorageError(
                "the durable storage of job "
                f"{cfg.job.job_id!r} cannot be used, so the job does not start:\n  "
                + "\n  ".join(broken[:8])
            )
        first = everyone[0]
        if first.get("job_error"):
            raise StorageError(
                f"cannot read or write the job record of {cfg.job.job_id!r}: {first['job_error']}"
            )
        nodes: dict[int, Mapping[str, Any]] = {}
        for e in everyone:
            nodes.setdefault(int(e["node"]), e)
        identities: dict[int, NodeIdentity | None] = {}
        stale: dict[int, str] = {}
        for n, e in nodes.items():
            if e.get("identity_error"):
                stale[n] = f"its identity record is unreadable ({e['identity_error']})"
                identities[n] = None
                continue
            text = e.get("identity")
            identities[n] = None if text is None else NodeIdentity.from_bytes(text.encode())
        job = first.get("job")
        durable = self._durable_tiers()
        here = self._location(durable[0]) if durable else None
        # Identities of nodes whose memory says it belongs to this job at this location.
        ours = {
            i.token: i
            for i in identities.values()
            if i is not None and i.job_id == cfg.job.job_id and i.persistent == here
        }
        absent = job is not None and job["state"] == "absent"
        if job is not None and job["state"] == "found":
            token, world_size = job["token"], job["world_size"]
            where = f"at {here}"
        elif job is not None:
            where = f"at {here}"
            if len(ours) == 1:
                # The location lost its records (deleted, a lifecycle rule) while the job was
                # away, or predates them; the memory that names it is this job's.
                token, remembered = next(iter(ours.items()))
                world_size = job.get("world_size", remembered.world_size)
                if absent:
                    logger.warning(
                        "tiercheck: the durable location %s of job %r holds nothing, but the "
                        "nodes' memory holds this job's checkpoints written there: the location "
                        "was emptied. Using the memory and writing the job record again.",
                        here,
                        cfg.job.job_id,
                    )
            else:
                token = first["fresh_token"]
                world_size = job.get("world_size", topo.world_size)
        else:
            tokens = {i.token for i in identities.values() if i is not None}
            if len(tokens) > 1:
                raise StaleMemory(
                    f"the nodes of job {cfg.job.job_id!r} hold memory of different runs "
                    f"(tokens {sorted(tokens)}); with no durable tier to tell which is this "
                    "run's, none is used. Pass stale_memory='discard' to start over, or "
                    "another job_id."
                )
            token = tokens.pop() if tokens else first["fresh_token"]
            sizes = {i.world_size for i in identities.values() if i is not None}
            world_size = sizes.pop() if len(sizes) == 1 else topo.world_size
            where = "in the nodes' memory"
        if world_size != topo.world_size:
            raise WorldSizeMismatch(
                f"job {cfg.job.job_id!r} {where} was saved by {world_size} ranks; this run has "
                f"{topo.world_size}. Restoring onto another number of ranks is not supported "
                f"yet: restart with {world_size} ranks, or give this run another job_id. "
                "Nothing stored was read or changed."
            )
        for n, identity in identities.items():
            if n in stale:
                continue
            if identity is None:
                if absent and nodes[n]["has_data"]:
                    stale[n] = (
                        "it holds checkpoints from before this job's durable location existed"
                    )
            elif identity.job_id != cfg.job.job_id or identity.token != token:
                stale[n] = (
                    f"it belongs to another run of {identity.job_id!r} (token "
                    f"{identity.token[:8]}, durable location {identity.persistent})"
                )
        self.job_token = token
        if stale and cfg.job.stale_memory != "discard":
            lines = [f"node {n}: {why}" for n, why in sorted(stale.items())]
            raise StaleMemory(
                f"the shared memory of job {cfg.job.job_id!r} (for this rank: {cfg.job.node_root}) "
                "holds checkpoints of another run with the same name; they are not restored as "
                "this run's:\n  "
                + "\n  ".join(lines)
                + "\nTo continue that run, point this one at its durable location. To discard "
                "that memory, pass stale_memory='discard' (or delete the folder). Or use "
                "another job_id. Nothing was changed."
            )
        return stale

    def _make_tier(self, name: str) -> Tier:
        cfg = self.cfg
        if name == "local":
            from tiercheck.tiers.local import LocalTier

            return LocalTier(NodeRoot(cfg.job.node_root).blobs, capacity=cfg.tiers.local_capacity)
        if name == "persistent":
            from tiercheck.tiers.persistent import PersistentTier

            return PersistentTier(
                persistent_job_url(cfg.job.persistent_url, cfg.job.job_id),
                storage_options=cfg.job.storage_options,
            )
        from tiercheck.tiers.registry import get_tier_class

        if name == "peer":
            # Found through the registry like any plugin; it takes the job's placement.
            peer: Any = get_tier_class("peer")
            tier: Tier = peer(
                topology=self.topo,
                holder_root=NodeRoot(cfg.job.node_root).replicas,
                replicas=cfg.tiers.peer_replicas,
                timeout=cfg.coordination.peer_timeout,
                namespace=cfg.job.job_id,
                session=f"{cfg.job.job_id}.{self.session}",
            )
            return tier

        cls = get_tier_class(name)
        try:
            return cls()
        except TypeError as exc:
            raise ConfigError(
                f"the {name!r} tier needs arguments; construct it yourself and pass the instance "
                f"in `tiers=[...]`: {exc}"
            ) from exc

    def policy(self, tier: str) -> TierPolicy:
        return self.cfg.tiers.policy(tier)

    def tier(self, name: str) -> Tier:
        for t in self.tiers:
            if t.name == name:
                return t
        raise ConfigError(f"no tier named {name!r}")

    def writes_commit_records(self, tier: Tier) -> bool:
        return tier.survives >= FailureScope.CLUSTER

    async def _list_own(self, tier: Tier) -> dict[int, _OwnBlob]:
        out: dict[int, _OwnBlob] = {}
        bases: dict[int, int | None] = {}
        if self.manifest is not None:
            durable = await self._in_manifest_thread(
                self.manifest.blobs, tier.name, None, self.rank
            )
            bases = {d.version: d.base for d in durable}
        async for key in tier.list("v"):
            parsed = parse_blob_key(key)
            if parsed is not None and parsed.rank == self.rank:
                if parsed.kind == "full":
                    base = None
                elif parsed.version in bases:
                    base = bases[parsed.version]
                else:
                    # Not in this node's manifest (a new node): any older blob may be its base.
                    base = UNKNOWN_BASE
                out[parsed.version] = _OwnBlob(key, base)
        return out

    async def _commit_versions(self, tier: Tier) -> set[int]:
        """Versions with a ``COMMIT`` record in ``tier``."""
        found: set[int] = set()
        async for key in tier.list("v"):
            v = parse_commit_key(key)
            if v is not None:
                found.add(v)
        return found

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
            t.name: self.policy(t.name).encoding
            for t in self.tiers
            if self.policy(t.name).targets(version, scheduled_base)
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
        job = _Job(
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
        job = _Job(version, "skipped", None, targets, handle, started)
        job.encoded.set()
        for name in targets:
            fut: asyncio.Future[_LaneResult] = asyncio.get_running_loop().create_future()
            fut.set_result(_LaneResult(None, SaveSkipped(f"version {version} was skipped")))
            job.results[name] = fut
            stats.tiers[name].state = "skipped"
        self._log(Abort(version, self.rank, "skipped: previous save still in flight"))
        self._launch(job, pipeline=False)
        return handle

    async def _stage(self, job: _Job, flat: Flat, marks: dict[int, Any] | None) -> None:
        """Copy the state into host memory: the local tier's own memory where possible.

        A local tier that cannot take the version (full, or failing) is skipped for it, and the
        snapshot goes to a staging buffer instead, so the other tiers still get it: storage
        trouble never reaches the caller. Tensors on a GPU go to a pinned staging buffer (a
        device-to-host copy into shared memory could not be asynchronous); the local tier then
        gets a copy of it like any other tier.
        """
        layout = job.layout
        assert layout is not None
        local = next((t for t in self.tiers if t.name == "local"), None)
        if (
            local is not None
            and job.targets.get("local") == "full"
            and isinstance(local, SupportsReserve)
            and (flat.on_host or not self.pool.pin)
        ):
            size, offset = full_blob_size(layout, version=job.version, rank=self.rank)
            self.reserve_size = size
            key = blob_key(job.version, self.rank, "full")
            try:
                reservation = await self._reserve(local, key, size)
            except (TiercheckError, OSError) as exc:
                self._skip_tier(job, "local", exc)
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
                job.payload = payload
                job.holder = _Holder(reservation.release)
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
        job.holder = _Holder(lambda: self.pool.release(lent))

    async def _copy(self, job: _Job, copy: SnapshotCopy) -> None:
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

    async def _reserve(self, tier: Tier, key: str, size: int) -> Reservation:
        """Reserve ``size`` bytes in ``tier``; when full, let pending retention free room first."""
        assert isinstance(tier, SupportsReserve)
        try:
            return await tier.reserve(key, size)
        except TierFull:
            idle = self.idle[tier.name]
            if idle.is_set():
                raise
        # Retention runs after each commit round; the previous version's may still be on
        # its way to freeing an old one. Bounded: training waits seconds at most.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(
                idle.wait(), timeout=min(self.cfg.coordination.peer_timeout, 10.0)
            )
        return await tier.reserve(key, size)

    def _skip_tier(self, job: _Job, name: str, exc: BaseException) -> None:
        """``name`` cannot take this version: count it, log the reason once, go on without it."""
        stats = job.handle.stats.tiers[name]
        stats.state = "skipped"
        stats.error = f"{type(exc).__name__}: {exc}"
        self.stats.tier_skips[name] = self.stats.tier_skips.get(name, 0) + 1
        condition = (name, type(exc).__name__)
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
        self._lane_done(
            job,
            name,
            None,
            TierWriteFailed(f"version {job.version} was not stored in the {name!r} tier: {exc}"),
            cause=exc,
        )

    def _launch(self, job: _Job, *, pipeline: bool = True) -> None:
        loop = asyncio.get_running_loop()
        if pipeline:
            job.previous = self.last_job
            self.last_job = job
        for name in job.targets:
            if name not in job.results:
                job.results[name] = loop.create_future()
            self.round_queues[name].put_nowait(job)
            self.idle[name].clear()
        job.rounds_left = len(job.targets)
        self.jobs.add(job)
        if not job.targets:
            job.finished.set()
        if pipeline:
            self.pending.append(job)
            task = asyncio.create_task(self._pipeline(job))
            self.pipelines.add(task)
            task.add_done_callback(self.pipelines.discard)

    async def _pipeline(self, job: _Job) -> None:
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
                if self.lanes[name].qsize() >= self.cfg.tiers.tier_queue:
                    self._lane_done(
                        job,
                        name,
                        None,
                        TierWriteFailed(
                            f"the {name!r} tier is {self.cfg.tiers.tier_queue} versions behind; "
                            f"version {job.version} was dropped for it"
                        ),
                    )
                    continue
                if encoding == "full":
                    job.holder.acquire()  # the parts reference the staged payload
                self.lanes[name].put_nowait((job, parts, meta))
            if job.kind == "base":
                self.planned_base = job.version
                job.holder.acquire()
                old, self.base = self.base, _Base(raw, job.holder)
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
                and "local" in job.results
                and not job.results["local"].done()
            ):
                with contextlib.suppress(Exception):
                    await job.reservation.abort()
            for name in job.targets:
                self._lane_done(
                    job,
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

    async def _publish_reserved(self, job: _Job, digest: int) -> None:
        reservation = job.reservation
        assert reservation is not None
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
                "tiercheck: publishing version %s in the local tier failed", job.version
            )
            with contextlib.suppress(Exception):
                await reservation.abort()
            self._lane_done(
                job,
                "local",
                None,
                TierWriteFailed(
                    f"version {job.version} could not be written to the local tier: {exc!r}"
                ),
                cause=exc,
            )
            return
        durable = self._durable(job, "local", reservation.key, meta)
        self._lane_done(job, "local", durable)

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

    def _durable(self, job: _Job, tier: str, key: str, meta: BlobMeta) -> Durable:
        base = meta.base.version if meta.base is not None else None
        record = Durable(
            job.version, self.rank, tier, key, meta.nbytes, meta.checksum, meta.raw_digest, base
        )
        self.own[tier][job.version] = _OwnBlob(key, base)
        self._log(record)
        stats = job.handle.stats.tiers[tier]
        stats.bytes = meta.nbytes
        return record

    def _lane_done(
        self,
        job: _Job,
        tier: str,
        durable: Durable | None,
        error: BaseException | None = None,
        *,
        cause: BaseException | None = None,
    ) -> None:
        fut = job.results.get(tier)
        if fut is None:  # decided while staging, before the job was launched
            fut = job.results[tier] = asyncio.get_running_loop().create_future()
        if fut.done():
            return
        if error is not None and cause is not None:
            error.__cause__ = cause
        fut.set_result(_LaneResult(durable, error))

    async def _lane_worker(self, tier: Tier) -> None:
        """Write blobs to one tier, one at a time, in version order."""
        queue = self.lanes[tier.name]
        while True:
            item = await queue.get()
            if item is None:
                return
            job, parts, meta = item
            kind: BlobKind = "full" if meta.kind == "full" else "packed"
            key = blob_key(job.version, self.rank, kind)
            try:
                if self.writes_commit_records(tier):
                    await self._check_fence(tier)
                await tier.putv(key, parts)
            except Exception as exc:
                if isinstance(exc, PeerUnavailable):
                    self._peer_trouble(tier.name, f"writing {key}", exc)
                elif not isinstance(exc, Superseded):
                    logger.warning(
                        "tiercheck: writing %s to the %r tier failed: %r", key, tier.name, exc
                    )
                self._lane_done(
                    job,
                    tier.name,
                    None,
                    TierWriteFailed(
                        f"version {job.version} could not be written to the "
                        f"{tier.name!r} tier: {exc!r}"
                    ),
                    cause=exc,
                )
            else:
                self._lane_done(job, tier.name, self._durable(job, tier.name, key, meta))
            finally:
                if kind == "full" and job.holder is not None:
                    job.holder.drop()
                # Do not keep the last blob alive while waiting for the next one.
                del item, parts

    def _peer_trouble(self, tier: str, what: str, exc: BaseException) -> None:
        """Another rank is gone or silent: one WARNING line per tier and spell, then DEBUG."""
        if tier in self.peer_warned:
            logger.debug("tiercheck: %s in %r: %s", what, tier, exc)
            return
        self.peer_warned.add(tier)
        logger.warning(
            "tiercheck: %s in the %r tier failed: %s (further failures of this kind are logged "
            "at DEBUG until the tier works again)",
            what,
            tier,
            exc,
        )

    async def _check_fence(self, tier: Tier) -> None:
        """Before durable data is written: is this opening still the job's writer there?"""
        if self.superseded:
            raise Superseded(
                f"a newer opening of job {self.cfg.job.job_id!r} took over the {tier.name!r} tier; "
                "this run no longer writes there"
            )
        fence = self.fences.get(tier.name)
        if fence is None:
            return
        try:
            if await fence.check():
                await self._write_job_record()  # the location was emptied under the job
        except Superseded as exc:
            self.superseded = True
            self.stats.superseded = True
            logger.error(
                "tiercheck: %s. Its saves still go to the memory tiers; durable saves, retention "
                "and restore-time cleanup in %r stop.",
                exc,
                tier.name,
            )
            raise

    # --- committing ---------------------------------------------------------------------------

    async def _round_worker(self, tier: Tier) -> None:
        """Decide, version by version, whether each is committed in ``tier`` for every rank."""
        queue = self.round_queues[tier.name]
        while True:
            job = await queue.get()
            if job is None:
                return
            peers_gone = False
            try:
                await self._round(tier, job)
            except PeerUnavailable as exc:  # expected when a rank dies: one line, no traceback
                peers_gone = True
                self._peer_trouble(tier.name, f"committing version {job.version}", exc)
                self._fail(
                    job,
                    tier.name,
                    TierWriteFailed(
                        f"version {job.version} could not be committed in the "
                        f"{tier.name!r} tier: {exc}"
                    ),
                )
            except Exception as exc:
                logger.exception(
                    "tiercheck: committing version %s in %r failed", job.version, tier.name
                )
                self._fail(
                    job,
                    tier.name,
                    TierWriteFailed(
                        f"version {job.version} could not be committed in the "
                        f"{tier.name!r} tier: {exc!r}"
                    ),
                )
            finally:
                self.settled[tier.name] = max(self.settled[tier.name], job.version)
                job.rounds_left -= 1
                if job.rounds_left == 0:
                    job.finished.set()
                    self.jobs.discard(job)
            # A round that lost its peers committed nothing new, and retention in a tier that
            # needs them (the peer tier) would only wait for them to time out again.
            if not peers_gone:
                try:
                    await self._retain(tier)
                except PeerUnavailable as exc:
                    self._peer_trouble(tier.name, "retention", exc)
                except Exception:
                    logger.exception("tiercheck: retention in the %r tier failed", tier.name)
                else:
                    self.peer_warned.discard(tier.name)
            if isinstance(tier, SupportsPrepare) and self.reserve_size and queue.empty():
                # Retention just freed memory to recycle: ready the next snapshot's, so the
                # next save's reserve costs a rename instead of sizing and mapping pages.
                try:
                    await tier.prepare(self.reserve_size)
                except Exception:
                    logger.exception("tiercheck: preparing memory in %r failed", tier.name)
            if queue.empty():
                self.idle[tier.name].set()

    async def _exchange(self, channel: str, payload: Mapping[str, Any]) -> list[dict[str, Any]]:
        if self.coordinator.world_size == 1:
            return [dict(payload)]
        packed = msgpack.packb(payload, use_bin_type=True)
        loop = asyncio.get_running_loop()
        gathered = await loop.run_in_executor(
            self.channel_exec[channel], self.coordinator.all_gather, channel, packed
        )
        return [msgpack.unpackb(g, raw=False) for g in gathered]

    async def _round(self, tier: Tier, job: _Job) -> None:
        name = tier.name
        result = await job.results[name]
        durable = result.durable
        ok = durable is not None and (durable.base is None or durable.base in self.committed[name])
        base_missing = False
        if ok and durable is not None and durable.base is not None:
            # A base can vanish from under a live job (a deleted folder, a lifecycle rule, a
            # holder that lost its memory): a delta against it must not be reported committed.
            base_missing = not await self._base_present(tier, durable.base)
            ok = not base_missing
        mine: dict[str, Any] = {"ok": ok, "base_missing": base_missing}
        if durable is not None:
            mine.update(
                key=durable.key,
                size=durable.size,
                checksum=durable.checksum,
                raw_digest=durable.raw_digest,
                base=durable.base,
            )
        everyone = await self._exchange(name, mine)
        failed = [r for r, e in enumerate(everyone) if not e["ok"]]
        why = ""
        if not failed and self.writes_commit_records(tier):
            failed, why = await self._write_commit_record(tier, job.version, everyone)
        if any(e.get("base_missing") for e in everyone) or why == "base-missing":
            self._lose_bases(name, {e["base"] for e in everyone if e.get("base") is not None})
        if failed:
            if result.error is not None:
                error: BaseException = result.error
            elif why == "superseded":
                error = TierWriteFailed(
                    f"version {job.version} was not committed in the {name!r} tier: a newer "
                    "opening of this job took it over"
                )
            elif (
                base_missing
                or why == "base-missing"
                or any(e.get("base_missing") for e in everyone)
            ):
                error = TierWriteFailed(
                    f"version {job.version} is a delta whose base vanished from the {name!r} "
                    "tier; the next save is stored as a base"
                )
            elif (
                durable is not None
                and durable.base is not None
                and durable.base not in self.committed[name]
            ):
                error = TierWriteFailed(
                    f"version {job.version} is a delta on base {durable.base}, which is not "
                    f"committed in the {name!r} tier"
                )
            else:
                error = TierWriteFailed(
                    f"version {job.version} is not whole in the {name!r} tier: "
                    f"ranks {failed} could not make it durable"
                )
            self._fail(job, name, error)
            return
        self.committed[name].add(job.version)
        self._log(Commit(job.version, name))
        self.skip_logged = {c for c in self.skip_logged if c[0] != name}
        self.peer_warned.discard(name)
        stats = job.handle.stats.tiers[name]
        stats.state = "committed"
        stats.seconds = time.perf_counter() - job.started
        self.stats.committed[name] = self.stats.committed.get(name, 0) + 1
        self.stats.last_committed[name] = job.version
        job.handle._resolve(name)

    async def _base_present(self, tier: Tier, base: int) -> bool:
        blob = self.own[tier.name].get(base)
        if blob is None:
            return False
        try:
            return await tier.exists(blob.key)
        except Exception as exc:
            logger.warning(
                "tiercheck: cannot tell whether base %s is still in %r: %r", base, tier.name, exc
            )
            return False

    def _lose_bases(self, tier: str, bases: set[int]) -> None:
        """Bases that vanished from ``tier``: forget them; the next save starts a new one."""
        self.force_base = True
        for base in bases:
            self.committed[tier].discard(base)
        logger.warning(
            "tiercheck: a delta's base vanished from the %r tier (of versions %s); the next "
            "save is stored as a base",
            tier,
            sorted(bases),
        )

    async def _write_commit_record(
        self, tier: Tier, version: int, everyone: list[dict[str, Any]]
    ) -> tuple[list[int], str]:
        """Rank 0 writes the ``COMMIT`` record; everyone learns whether it landed, and why not."""
        ok, why = True, ""
        if self.rank == 0:
            try:
                await self._check_fence(tier)
                bases = sorted({e["base"] for e in everyone if e["base"] is not None})
                for base in bases:
                    if not await tier.exists(commit_key(base)):
                        ok, why = False, "base-missing"
                if ok:
                    record = CommitRecord(
                        job_id=self.cfg.job.job_id,
                        version=version,
                        world_size=len(everyone),
                        time=time.time(),
                        entries=tuple(
                            CommitEntry(
                                rank=r,
                                key=e["key"],
                                size=e["size"],
                                checksum=e["checksum"],
                                raw_digest=e["raw_digest"],
                                base=e["base"],
                            )
                            for r, e in enumerate(everyone)
                        ),
                    )
                    await tier.put(commit_key(version), record.to_bytes())
            except Superseded:
                ok, why = False, "superseded"
            except Exception:
                logger.exception("tiercheck: writing the COMMIT record of %s failed", version)
                ok, why = False, "error"
        confirmed = await self._exchange(tier.name, {"ok": ok, "why": why})
        if confirmed[0]["ok"]:
            return [], ""
        if confirmed[0]["why"] == "superseded":
            self.superseded = self.stats.superseded = True
        return [0], str(confirmed[0]["why"])

    def _fail(self, job: _Job, tier: str, error: BaseException) -> None:
        stats = job.handle.stats.tiers[tier]
        skipped = stats.state == "skipped"  # counted in tier_skips already
        if stats.state == "pending":
            stats.state = "failed"
            stats.error = str(error)
            stats.seconds = time.perf_counter() - job.started
        if job.kind != "skipped" and not skipped:
            self.stats.failed[tier] = self.stats.failed.get(tier, 0) + 1
        job.handle._resolve(tier, error)

    async def _retain(self, tier: Tier) -> None:
        name = tier.name
        if name in self.unlisted or (self.superseded and self.writes_commit_records(tier)):
            return  # never delete from a tier this run cannot see whole, or no longer owns
        if self.writes_commit_records(tier):
            # Count what is there: versions whose COMMIT record vanished (a deleted folder, a
            # lifecycle rule) must not count towards `keep`.
            self.committed[name] &= await self._commit_versions(tier)
        doomed = evictable(
            committed=self.committed[name],
            own={v: b.base for v, b in self.own[name].items()},
            keep=self.policy(name).keep,
            # Rounds run in version order, so everything newer than `settled` is in flight
            # in this tier and stays; in flight elsewhere does not matter here.
            settled_upto=self.settled[name],
        )
        # Newest first: a delta goes before its base, so no COMMIT record is ever left naming
        # a base that is gone, whenever the process dies.
        for version in reversed(doomed):
            await self._evict(tier, version, "retention")

    async def _evict(self, tier: Tier, version: int, reason: str) -> None:
        name = tier.name
        if self.superseded and self.writes_commit_records(tier):
            return
        if self.rank == 0 and self.writes_commit_records(tier):
            await tier.delete(commit_key(version))
        blob = self.own[name].pop(version, None)
        if blob is not None:
            await tier.delete(blob.key)
        self.committed[name].discard(version)
        self.stats.evicted[name] = self.stats.evicted.get(name, 0) + 1
        self._log(Evict(version, self.rank, name, reason))

    async def _check_fresh_start(self, version: int) -> None:
        """Refuse a first save that would mix with versions already stored for this job.

        Without a restore, saving version ``v`` while versions ``>= v`` are stored would let a
        later restore combine blobs of two different runs; deleting them instead would destroy
        checkpoints on a mistake. So this is an error with a way out.
        """
        stored = [(name, v) for name, blobs in self.own.items() for v in blobs if v >= version]
        if stored:
            newest = max(v for _, v in stored)
            raise VersionError(
                f"job {self.cfg.job.job_id!r} already stores version {newest} (>= {version}) in "
                f"{sorted({n for n, _ in stored})}; call restore() first to continue that run, "
                "use a new job_id to start another, or remove the old versions with `tiercheck gc`"
            )

    async def _truncate_from(self, first: int, reason: str) -> None:
        """Remove this rank's blobs (and rank 0's COMMIT records) of versions >= ``first``."""
        for tier in self.tiers:
            doomed = {v for v in self.own[tier.name] if v >= first}
            if self.rank == 0 and self.writes_commit_records(tier):
                async for key in tier.list("v"):
                    v = parse_commit_key(key)
                    if v is not None and v >= first:
                        doomed.add(v)
            for version in sorted(doomed, reverse=True):
                try:
                    await self._evict(tier, version, reason)
                except Exception:
                    logger.exception(
                        "tiercheck: removing version %s from %r failed", version, tier.name
                    )

    # --- manifest -----------------------------------------------------------------------------

    def _log(self, *records: Record) -> None:
        """Append to the manifest in its own thread; failures are logged and counted."""
        if self.manifest is None:
            return
        manifest = self.manifest
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(self.manifest_exec, manifest.append, *records)
        fut.add_done_callback(self._manifest_done)

    def _manifest_done(self, fut: asyncio.Future[None]) -> None:
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is None:
            if self.manifest_failing:
                self.manifest_failing = False
                logger.warning("tiercheck: manifest writes work again")
            return
        self.stats.manifest_errors += 1
        if not self.manifest_failing:  # once per spell of failures, not once per record
            self.manifest_failing = True
            logger.error(
                "tiercheck: manifest write failed: %r; checkpoints are unaffected (restore trusts "
                "the tiers), history is lost until it works again; further failures are counted "
                "in stats.manifest_errors",
                exc,
            )

    async def _in_manifest_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.manifest_exec, fn, *args)

    # --- waiting and restoring ----------------------------------------------------------------

    async def wait(self) -> None:
        """Wait until every save so far is committed or failed in every tier, and the
        background work that follows (retention, preparing memory) is done too."""
        while self.jobs:
            job = next(iter(self.jobs))
            await job.finished.wait()
            self.jobs.discard(job)
        for event in self.idle.values():
            await event.wait()
        if self.manifest is not None:
            await self._in_manifest_thread(lambda: None)

    async def newest(self) -> dict[str, int | None]:
        """The newest committed version of each tier, as this rank knows it."""
        return {name: max(vs, default=None) for name, vs in self.committed.items()}

    async def _inventory(self) -> tuple[Inventory, dict[str, str]]:
        """What this rank can rebuild, per tier, and the tiers it could not list (and why)."""
        by_tier: dict[str, frozenset[int]] = {}
        errors: dict[str, str] = {}
        for tier in self.tiers:
            try:
                self.own[tier.name] = await self._list_own(tier)
                if self.writes_commit_records(tier):
                    versions = await self._commit_versions(tier)
                else:
                    versions = set(self.own[tier.name])
            except Exception as exc:
                logger.warning("tiercheck: cannot list the %r tier for restore: %r", tier.name, exc)
                errors[tier.name] = f"{type(exc).__name__}: {exc}"
                self.unlisted.add(tier.name)
                versions = set()
            else:
                self.unlisted.discard(tier.name)
            by_tier[tier.name] = frozenset(versions)
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
            if version in self.own[tier.name]:  # the record knows the base: no need to guess
                self.own[tier.name][version] = _OwnBlob(entry.key, entry.base)
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
        if self.superseded and self.writes_commit_records(tier):
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
        gathered = await self._exchange("control", {"inv": mine.to_wire(), "errors": errors})
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
            verdicts = await self._exchange(
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
            if tier.name not in self.unlisted:
                self.committed[tier.name] = {
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
        for tier in self.tiers:
            name = tier.name
            if self.writes_commit_records(tier):
                continue
            whole = set(self.own[name])
            for inventory in everyone:
                whole &= inventory.by_tier.get(name, frozenset())
            adopted = sorted(v for v in whole - self.committed[name] if v <= upto)
            if adopted:
                self.committed[name].update(adopted)
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
        out: dict[str, list[int]] = {}
        for tier in self.tiers:
            name = tier.name
            try:
                if self.writes_commit_records(tier):
                    present = await self._commit_versions(tier)
                else:
                    present = set(await self._list_own(tier))
            except Exception as exc:
                logger.warning("tiercheck: cannot list the %r tier: %r", name, exc)
                out[name] = sorted(self.committed[name])
                continue
            there = self.committed[name] & present
            # A delta whose base is gone cannot be restored from this tier.
            bases = {v: b.base for v, b in self.own[name].items()}
            out[name] = sorted(
                v for v in there if bases.get(v) in (None, UNKNOWN_BASE) or bases[v] in there
            )
        return out

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
        collective = self.coordinator.world_size > 1
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
                broken = self.coordinator.broken
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
                    self._fail(
                        job,
                        name,
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
        for name in self.lanes:
            self.lanes[name].put_nowait(None)
            self.round_queues[name].put_nowait(None)
        tasks = [*self.workers, *self.pipelines] if cancel else list(self.workers)
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
            everyone = await self._exchange("control", mine)
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
        self.manifest_exec.shutdown(wait=True)  # local appends only
        if self.manifest is not None:
            self.manifest.close()
        for ex in self.channel_exec.values():
            # An exchange still waiting on a dead rank stays on its daemon thread.
            ex.shutdown(wait=False, cancel_futures=True)
        try:
            self.coordinator.close()
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
