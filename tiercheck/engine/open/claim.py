"""This opening's claim on the job: whose data this is, one writer, usable locations.

Opening a checkpointer must never touch data of another run, nor let two live openings write
the same durable location. :meth:`Claim.guard` decides, with the same facts on every rank, whether
this run may open (and which nodes' memory is stale); :meth:`Claim.check` runs before every
durable write and stops this opening from writing once a newer one took the job over.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import aiofiles.os

from tiercheck.consistency.commit import CommitRecord
from tiercheck.consistency.identity import JobRecord, NodeIdentity
from tiercheck.consistency.keys import commit_key
from tiercheck.consistency.protocol import ClaimOutcome, OpenFacts, Outcome, Step
from tiercheck.consistency.worlds import Spans, span_after, spans_of, world_of
from tiercheck.defaults import NodeRoot
from tiercheck.engine.collectives import Channels, step
from tiercheck.engine.open.judgement import judge_opening
from tiercheck.engine.open.stale import Stale, stale_message
from tiercheck.engine.options import Options
from tiercheck.engine.results import CheckpointerStats
from tiercheck.engine.stored import commit_versions, location
from tiercheck.errors import (
    FormatError,
    JobLocked,
    StorageError,
    Superseded,
    TiercheckError,
    UnsupportedFormat,
)
from tiercheck.guards import (
    Fence,
    RankLock,
    deletion_facts,
    discard_node_memory,
    node_holds_data,
    node_versions,
    probe,
    read_job_record,
    write_identity,
    write_job_record,
)
from tiercheck.smallfile import read_small
from tiercheck.tiers.base import Tier
from tiercheck.tiers.storage import is_transient

__all__ = [
    "Claim",
    "Stale",
    "gather_facts",
    "keep_identity",
    "passes",
    "read_job_facts",
    "stale_message",
]

logger = logging.getLogger("tiercheck")


async def gather_facts(
    options: Options, session: str, lock_of_rank: RankLock, durable: Sequence[Tier]
) -> OpenFacts:
    """What this rank sees before the job opens (step ``OPEN_FACTS``): its writer lock (taken
    here), whether the durable tiers work, its node's identity and memory; rank 0 also what
    the durable tiers say of the job (:func:`read_job_facts`) and of its deletion."""
    cfg, topo = options, options.job.topology
    rank = topo.rank
    locked = None
    try:
        await asyncio.to_thread(lock_of_rank.acquire)
    except (JobLocked, OSError) as exc:
        locked = str(exc)
    probes: dict[str, str] = {}
    unreachable: dict[str, str] = {}
    for tier in durable:
        try:
            await probe(tier, session, rank)
        except (TiercheckError, OSError) as exc:
            probes[tier.name] = str(exc)
            if passes(exc):
                # The storage call's own words, without the probe's advice around them.
                unreachable[tier.name] = str(exc.__cause__ or exc)
    job: dict[str, Any] | None = None
    job_error: str | None = None
    deleted: dict[str, Any] = {}
    if rank == 0 and durable and not probes:
        try:
            job = await read_job_facts(durable)
        except (TiercheckError, OSError) as exc:
            job_error = f"{type(exc).__name__}: {exc}"
        if job_error is None:
            deleted = await deletion_facts(durable)  # what `tiercheck rm-job` deleted
            job_error = deleted.get("job_error")
    identity_text: str | None = None
    identity_error: str | None = None
    damaged = False
    try:
        data = await read_small(NodeRoot(cfg.job.node_root).identity)  # aiofiles
        identity = None if data is None else NodeIdentity.from_bytes(data)
        identity_text = None if identity is None else identity.to_bytes().decode()
    except (TiercheckError, OSError) as exc:
        identity_error = str(exc)
        # Cut short or garbled (not written by a newer build): damaged, not another run's.
        damaged = isinstance(exc, FormatError) and not isinstance(exc, UnsupportedFormat)
    try:
        has_data = await asyncio.to_thread(node_holds_data, cfg.job.node_root)
    except OSError:
        has_data = True  # cannot look: assume there is something to protect
    held: list[int] | None = None
    if topo.local_rank == 0:
        try:
            held = await asyncio.to_thread(node_versions, cfg.job.node_root)
        except OSError as exc:
            logger.debug("tiercheck: cannot list the node's memory: %r", exc)
    return OpenFacts(
        node=topo.node_index,
        local_rank=topo.local_rank,
        lock=locked,
        probe=probes,
        unreachable=unreachable,
        job=job,
        job_error=job_error,
        deleted=deleted.get("deleted"),
        tombstone=deleted.get("tombstone"),
        identity=identity_text,
        identity_error=identity_error,
        identity_damaged=damaged,
        has_data=has_data,
        held=held,
        fresh_token=os.urandom(8).hex() if rank == 0 else None,
    )


def passes(exc: BaseException) -> bool:
    """Whether a failed storage call failed for a cause that passes -- the store cannot be
    reached (a connection or timeout error) -- rather than one that stays (a permission error,
    a missing bucket, a damaged record): judged on the first cause, under the storage errors
    that wrap it (:func:`~tiercheck.tiers.storage.is_transient`)."""
    root: BaseException = exc
    seen = {id(root)}
    while root.__cause__ is not None and id(root.__cause__) not in seen:
        root = root.__cause__
        seen.add(id(root))
    if isinstance(root, TiercheckError):
        return False  # tiercheck's own verdict (a damaged record, a mismatch): it stays
    return is_transient(root)


async def read_job_facts(durable: Sequence[Tier]) -> dict[str, Any]:
    """Rank 0: what the durable tiers say about the job's incarnation.

    ``state`` is ``"found"`` (a job record), ``"legacy"`` (``COMMIT`` records but no job
    record: written before job records existed, or one set aside by ``tiercheck
    repair-job``; the history is read off the ``COMMIT`` records, each of which says how
    many ranks saved its version) or ``"absent"`` (nothing stored: a new location, or one
    that was emptied). ``committed``: the versions with ``COMMIT`` records.
    """
    committed = sorted(await commit_versions(durable[0]))
    for tier in durable:
        record = await read_job_record(tier)
        if record is not None:
            return {
                "state": "found",
                "token": record.token,
                "world_size": record.world_size,
                "worlds": [list(span) for span in record.worlds],
                "revision": record.revision,
                "repaired": record.repaired,
                "committed": committed,
            }
    if not committed:
        return {"state": "absent", "committed": []}
    sizes = []
    for version in committed:
        commit = CommitRecord.from_bytes(bytes(await durable[0].get(commit_key(version))))
        sizes.append((version, commit.world_size))
    return {
        "state": "legacy",
        "world_size": sizes[-1][1],
        "worlds": [list(span) for span in spans_of(sizes)],
        "committed": committed,
    }


class Claim:
    """The writer lock of this rank, the job's incarnation, and the fences of durable tiers."""

    def __init__(self, options: Options, stats: CheckpointerStats, channels: Channels) -> None:
        self.options = options
        self.topo = options.job.topology
        self.rank = self.topo.rank
        self.job_id = options.job.job_id
        self.stats = stats
        self.channels = channels
        self.lock = RankLock(options.job.node_root, self.rank)
        # The job's incarnation (see tiercheck.consistency.identity) and, per durable tier, the
        # writer generation this opening claimed there.
        self.job_token = ""
        self.fences: dict[str, Fence] = {}
        #: Whether a newer opening took the durable tiers over (see Superseded).
        self.superseded = False
        #: The tiers that outlive the cluster (set once the tiers are built).
        self.durable: list[Tier] = []
        #: How many ranks saved the job's newest versions, and its world-size history (see
        #: tiercheck.consistency.worlds); set by :meth:`judge`.
        self.stored_world = self.topo.world_size
        self.worlds: Spans = ()
        #: How many times the history was changed (the newer of the job record and the nodes'
        #: identities wins where they disagree).
        self.revision = 0
        # The job record at the durable location is behind what the nodes' identities know
        # (its last update failed): rank 0 rewrites it at open.
        self._record_behind = False
        # Nodes whose memory this opening adopted as its own (stale_memory="adopt").
        self._adopted: list[int] = []
        #: Nodes whose memory belongs to an incarnation `tiercheck rm-job` deleted (set by
        #: :meth:`judge`; discarded by :meth:`guard` whatever ``stale_memory`` says).
        self.deleted_nodes: dict[int, str] = {}
        #: Durable tiers some rank could not reach when the job opened (it opened on its
        #: memory), by name, with why: nothing of this opening is written there until
        #: :meth:`rejoined` (see :mod:`tiercheck.engine.open.rejoin`), and :meth:`check` refuses.
        self.pending: dict[str, str] = {}
        #: Durable tiers that were :attr:`pending`, and that this opening must never write:
        #: what they held once reached again was not this run's to write (see :meth:`refuse`).
        self.refused: dict[str, str] = {}
        #: When this opening began (seconds since the epoch): a writer generation claimed in
        #: a durable tier after it is a newer opening's.
        self.opened_at = 0.0

    @property
    def world_changed(self) -> bool:
        """Whether this run has another number of ranks than the one that saved the job."""
        return self.stored_world != self.topo.world_size

    @property
    def claimed(self) -> list[Tier]:
        """The durable tiers this opening holds (all of them but those still
        :attr:`pending`)."""
        return [t for t in self.durable if t.name not in self.pending]

    def world_of(self, version: int) -> int:
        """How many ranks saved ``version``."""
        return world_of(version, self.worlds, self.stored_world)

    def needs_world_record(self, first_version: int) -> bool:
        """Whether versions from ``first_version`` on, saved by this run, need the world-size
        history changed: this run has another number of ranks than the history's newest span,
        or the history names spans from ``first_version`` on (versions that left the timeline)."""
        if self.stored_world != self.topo.world_size:
            return True
        return any(first >= first_version for first, _ in self.worlds)

    async def record_world(self, first_version: int, *, channel: str = "control") -> str | None:
        """Collective: versions from ``first_version`` on are this world's.

        Every rank updates what it knows the same way; each node's first rank records it in
        its node's identity (memory tiers hold this world's versions from now on), rank 0 in
        the job record of the durable tiers. Returns why the job record could not be written
        (every rank alike; the durable tiers must then take no versions until
        :meth:`sync_job_record` succeeds), else ``None``. The identities carry a newer revision
        than the record then, so an opening in between believes them.
        """
        new = self.topo.world_size
        self.worlds = span_after(self.worlds, self.stored_world, first_version, new)
        self.stored_world = new
        self.revision += 1
        if self.topo.local_rank == 0:
            await self.record_identity()
        return await self.sync_job_record(channel=channel)

    async def sync_job_record(self, *, channel: str = "control") -> str | None:
        """Collective (on ``channel``): rank 0 writes the job record with what every rank
        knows; returns why it could not (every rank alike), else ``None``."""
        error = None
        if self.rank == 0 and self.durable and not self.superseded:
            try:
                await self.write_job_record()
            except (TiercheckError, OSError) as exc:
                error = f"{type(exc).__name__}: {exc}"
        said = await step(self.channels, Step.JOB_RECORD, Outcome(error), channel=channel)
        failed = [e.error for e in said if e.error is not None]
        return failed[0] if failed else None

    async def guard(self) -> None:
        """Refuse to open over data this run must not touch; the same verdict on every rank.

        Each rank gathers what it can see (its writer lock, whether the durable tiers work, its
        node's identity); rank 0 also reads or creates the job record and claims a writer
        generation. One exchange later every rank decides from the same facts, so every rank
        raises the same typed error, or none does.
        """
        cfg, topo = self.options, self.topo
        durable = self.durable
        self.opened_at = time.time()
        mine = await gather_facts(self.options, self.channels.session, self.lock, durable)
        everyone = await step(self.channels, Step.OPEN_FACTS, mine)
        stale = self.judge(everyone)
        if self.pending:
            self._warn_degraded(everyone)
            durable = self.claimed
        # Past this point every rank may open: only now is anything written.
        if stale and topo.local_rank == 0 and topo.node_index in stale:
            logger.warning(
                "tiercheck: discarding the memory of node %s at %s%s: %s",
                topo.node_index,
                cfg.job.node_root,
                "" if topo.node_index in self.deleted_nodes else " (stale_memory='discard')",
                stale[topo.node_index],
            )
            await asyncio.to_thread(discard_node_memory, cfg.job.node_root)
        generations: dict[str, int] = {}
        failure = ""
        if self.rank == 0 and durable:
            try:
                if (everyone[0].job or {}).get("state") != "found" or self._record_behind:
                    await self.write_job_record()
                for tier in durable:
                    fence = Fence(tier, self.channels.session)
                    generations[tier.name] = await fence.claim()
                    self.fences[tier.name] = fence
            except (TiercheckError, OSError) as exc:
                failure = f"{type(exc).__name__}: {exc}"
        # Also a barrier: no rank reads its node's memory while it is being discarded.
        outcome = ClaimOutcome(generations, failure)
        decided = (await step(self.channels, Step.CLAIM, outcome))[0]
        if decided.failure:
            raise StorageError(
                f"cannot claim job {cfg.job.job_id!r} in its durable storage: {decided.failure}"
            )
        for tier in durable:
            if tier.name not in self.fences:
                fence = Fence(tier, self.channels.session)
                fence.adopt(decided.generations[tier.name])
                self.fences[tier.name] = fence
        me = everyone[self.rank]
        if topo.local_rank == 0 and (
            me.identity is None or topo.node_index in stale or topo.node_index in self._adopted
        ):
            await self.record_identity()

    def _warn_degraded(self, everyone: Sequence[OpenFacts]) -> None:
        """The job opens on its memory: one WARNING naming the tiers and why."""
        held = sorted({v for e in everyone for v in e.held or ()})
        cfg = self.options.coordination
        for name, why in sorted(self.pending.items()):
            logger.warning(
                "tiercheck: the durable %r tier of job %r cannot be reached (%s). The job opens "
                "on its memory, which holds versions %s of this run: restore() reads from "
                "memory, saves go to the memory tiers, and the %r tier is tried again in the "
                "background (every %gs to %gs). Once every rank reaches it, this run's "
                "ownership there is checked and it takes versions again; until then "
                "stats.unreachable names it.",
                name,
                self.job_id,
                why,
                held,
                name,
                cfg.durable_retry_delay,
                cfg.durable_retry_max,
            )

    async def record_identity(self) -> None:
        """Write this node's identity record (the job, its incarnation, its worlds) as this
        opening knows them."""
        durable = self.durable
        identity = NodeIdentity(
            job_id=self.job_id,
            token=self.job_token,
            world_size=self.stored_world,
            persistent=location(durable[0]) if durable else None,
            created=time.time(),
            worlds=self.worlds,
            revision=self.revision,
        )
        try:
            await asyncio.to_thread(write_identity, self.options.job.node_root, identity)
        except OSError as exc:  # memory that cannot take a small file takes no blob either
            logger.warning("tiercheck: cannot record the node's identity: %r", exc)

    def job_record(self) -> JobRecord:
        """The job record, as this opening knows the job."""
        return JobRecord(
            self.options.job.job_id,
            self.job_token,
            self.stored_world,
            time.time(),
            worlds=self.worlds,
            revision=self.revision,
        )

    async def write_job_record(self) -> None:
        """Store the job record in every durable tier this opening holds (one still
        :attr:`pending` gets it once claimed)."""
        record = self.job_record()
        for tier in self.claimed:
            await write_job_record(tier, record)

    def judge(self, everyone: Sequence[OpenFacts]) -> dict[int, str]:
        """Decide, from what every rank saw, whether this run may open; return the nodes
        whose memory goes (:func:`~tiercheck.engine.open.judgement.judge_opening`, applied here)."""
        cfg = self.options
        verdict = judge_opening(
            everyone,
            job_id=cfg.job.job_id,
            here=location(self.durable[0]) if self.durable else None,
            ranks=self.topo.world_size,
            elastic=cfg.job.elastic,
            stale_policy=cfg.job.stale_memory,
            node_root=str(cfg.job.node_root),
        )
        self.deleted_nodes = verdict.deleted_nodes
        self.pending = dict(verdict.unreachable)
        if self.pending and everyone[0].job is None:
            # Rank 0 read nothing of the job (a tier it could not reach): the ownership of
            # the tiers it could reach was not checked either, so they wait too.
            unchecked = f"not checked while {sorted(self.pending)} cannot be reached"
            for tier in self.durable:
                self.pending.setdefault(tier.name, unchecked)
        self.stats.unreachable = dict(self.pending)
        self._record_behind = verdict.record_behind
        self.stored_world = verdict.stored_world
        self.worlds = verdict.worlds
        self.revision = verdict.revision
        self.job_token = verdict.job_token
        self._adopted = list(verdict.adopted)
        return verdict.discard

    def use_durable(self, tiers: list[Tier]) -> None:
        """The tiers that outlive the cluster, once they are built (see :attr:`durable`)."""
        self.durable = tiers

    def mark_superseded(self) -> None:
        """A newer opening of the job took the durable tiers over: this one stops writing
        there (see :class:`~tiercheck.errors.Superseded`)."""
        self.superseded = True
        self.stats.superseded = True

    def rejoined(self, tier: Tier, generation: int) -> None:
        """A tier :attr:`pending` since opening is claimed: writer ``generation`` is this
        opening's there (every rank, once rank 0 claimed it; see
        :mod:`tiercheck.engine.open.rejoin`)."""
        fence = Fence(tier, self.channels.session)
        fence.adopt(generation)
        self.fences[tier.name] = fence
        self.pending.pop(tier.name, None)
        self.stats.unreachable.pop(tier.name, None)

    def refuse(self, tier: Tier, why: str) -> None:
        """A tier :attr:`pending` since opening must never be written by this opening (every
        rank, once rank 0 judged it; see :mod:`tiercheck.engine.open.rejoin`): it counts as
        superseded there."""
        self.pending.pop(tier.name, None)
        self.stats.unreachable.pop(tier.name, None)
        self.refused[tier.name] = why
        self.mark_superseded()

    async def check(self, tier: Tier) -> None:
        """Before durable data is written: is this opening still the job's writer there?"""
        if tier.name in self.pending:
            raise StorageError(
                f"the {tier.name!r} tier was unreachable when job {self.job_id!r} opened and "
                "is not claimed yet: this opening writes nothing there until it is"
            )
        if self.superseded:
            raise Superseded(
                f"a newer opening of job {self.job_id!r} took over the {tier.name!r} tier; "
                "this run no longer writes there"
            )
        fence = self.fences.get(tier.name)
        if fence is None:
            return
        try:
            if await fence.check():
                await self.write_job_record()  # the location was emptied under the job
        except Superseded as exc:
            self.mark_superseded()
            logger.error(
                "tiercheck: %s. Its saves still go to the memory tiers; durable saves, retention "
                "and restore-time cleanup in %r stop.",
                exc,
                tier.name,
            )
            raise


async def keep_identity(claim: Claim) -> None:
    """Write the node's identity record again where it went missing under the live job (its
    memory folder removed by an operator or a cleanup job; the job writes on and commits
    resume): without it, a restart while durable storage is down could not tell that the
    node's memory holds this run's versions, and would refuse it. Each node's first rank, once
    the job is open; never where a newer opening took the job over."""
    if claim.topo.local_rank != 0 or not claim.opened_at or claim.superseded:
        return
    path = NodeRoot(claim.options.job.node_root).identity
    if await aiofiles.os.path.exists(path):
        return
    logger.warning(
        "tiercheck: the node's identity record %s is gone (was the node's memory folder "
        "removed under the live job?); writing it again",
        path,
    )
    await claim.record_identity()
