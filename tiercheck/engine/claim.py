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
from typing import TYPE_CHECKING, Any, Protocol

from tiercheck.consistency.commit import CommitRecord
from tiercheck.consistency.identity import JobRecord, NodeIdentity
from tiercheck.consistency.keys import commit_key
from tiercheck.consistency.protocol import ClaimOutcome, OpenFacts, Outcome, Step
from tiercheck.consistency.worlds import Spans, parse_spans, span_after, spans_of, world_of
from tiercheck.engine.collectives import Side, step
from tiercheck.engine.stale import Stale, made_at, stale_message
from tiercheck.engine.stored import commit_versions, location
from tiercheck.errors import (
    FormatError,
    JobLocked,
    StaleMemory,
    StorageError,
    Superseded,
    TiercheckError,
    UnsupportedFormat,
    WorldSizeMismatch,
)
from tiercheck.guard import (
    Fence,
    RankLock,
    deletion_facts,
    discard_node_memory,
    forget_deleted,
    node_holds_data,
    node_versions,
    probe,
    read_identity,
    read_job_record,
    write_identity,
    write_job_record,
)
from tiercheck.tiers.base import Tier

if TYPE_CHECKING:
    from tiercheck.engine.options import Options
    from tiercheck.engine.results import CheckpointerStats
    from tiercheck.topology import Topology

__all__ = ["Claim", "ClaimContext", "Stale", "gather_facts", "read_job_facts", "stale_message"]

logger = logging.getLogger("tiercheck")


class ClaimContext(Side, Protocol):
    """What the claim needs of the engine's shared state (the engine's ``Context``, which
    holds the claim: a narrow view, so that this module does not import that one)."""

    @property
    def options(self) -> Options:
        """The checkpointer's options."""
        ...

    @property
    def topo(self) -> Topology:
        """This rank's place in the job."""
        ...

    @property
    def rank(self) -> int:
        """This rank."""
        ...

    @property
    def job_id(self) -> str:
        """The job's id."""
        ...

    @property
    def session(self) -> str:
        """The incarnation of this opening, agreed by every rank."""
        ...

    @property
    def stats(self) -> CheckpointerStats:
        """Running totals (the claim marks ``superseded``)."""
        ...


async def gather_facts(
    ctx: ClaimContext, lock_of_rank: RankLock, durable: Sequence[Tier]
) -> OpenFacts:
    """What this rank sees before the job opens (step ``OPEN_FACTS``): its writer lock (taken
    here), whether the durable tiers work, its node's identity and memory; rank 0 also what
    the durable tiers say of the job (:func:`read_job_facts`) and of its deletion."""
    cfg, topo = ctx.options, ctx.topo
    locked = None
    try:
        await asyncio.to_thread(lock_of_rank.acquire)
    except (JobLocked, OSError) as exc:
        locked = str(exc)
    probes: dict[str, str] = {}
    for tier in durable:
        try:
            await probe(tier, ctx.session, ctx.rank)
        except (TiercheckError, OSError) as exc:
            probes[tier.name] = str(exc)
    job: dict[str, Any] | None = None
    job_error: str | None = None
    deleted: dict[str, Any] = {}
    if ctx.rank == 0 and durable and not probes:
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
        identity = await asyncio.to_thread(read_identity, cfg.job.node_root)
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
        job=job,
        job_error=job_error,
        deleted=deleted.get("deleted"),
        tombstone=deleted.get("tombstone"),
        identity=identity_text,
        identity_error=identity_error,
        identity_damaged=damaged,
        has_data=has_data,
        held=held,
        fresh_token=os.urandom(8).hex() if ctx.rank == 0 else None,
    )


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

    def __init__(self, ctx: ClaimContext) -> None:
        self.ctx = ctx
        self.lock = RankLock(ctx.options.job.node_root, ctx.rank)
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
        self.stored_world = ctx.topo.world_size
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

    @property
    def world_changed(self) -> bool:
        """Whether this run has another number of ranks than the one that saved the job."""
        return self.stored_world != self.ctx.topo.world_size

    def world_of(self, version: int) -> int:
        """How many ranks saved ``version``."""
        return world_of(version, self.worlds, self.stored_world)

    def needs_world_record(self, first_version: int) -> bool:
        """Whether versions from ``first_version`` on, saved by this run, need the world-size
        history changed: this run has another number of ranks than the history's newest span,
        or the history names spans from ``first_version`` on (versions that left the timeline)."""
        if self.stored_world != self.ctx.topo.world_size:
            return True
        return any(first >= first_version for first, _ in self.worlds)

    async def record_world(self, first_version: int) -> str | None:
        """Collective: versions from ``first_version`` on are this world's.

        Every rank updates what it knows the same way; each node's first rank records it in
        its node's identity (memory tiers hold this world's versions from now on), rank 0 in
        the job record of the durable tiers. Returns why the job record could not be written
        (every rank alike; the durable tiers must then take no versions until
        :meth:`sync_job_record` succeeds), else ``None``. The identities carry a newer revision
        than the record then, so an opening in between believes them.
        """
        new = self.ctx.topo.world_size
        self.worlds = span_after(self.worlds, self.stored_world, first_version, new)
        self.stored_world = new
        self.revision += 1
        if self.ctx.topo.local_rank == 0:
            await self._write_identity()
        return await self.sync_job_record()

    async def sync_job_record(self) -> str | None:
        """Collective: rank 0 writes the job record with what every rank knows; returns why
        it could not (every rank alike), else ``None``."""
        error = None
        if self.ctx.rank == 0 and self.durable and not self.superseded:
            try:
                await self.write_job_record()
            except (TiercheckError, OSError) as exc:
                error = f"{type(exc).__name__}: {exc}"
        said = await step(self.ctx, Step.JOB_RECORD, Outcome(error))
        failed = [e.error for e in said if e.error is not None]
        return failed[0] if failed else None

    async def guard(self) -> None:
        """Refuse to open over data this run must not touch; the same verdict on every rank.

        Each rank gathers what it can see (its writer lock, whether the durable tiers work, its
        node's identity); rank 0 also reads or creates the job record and claims a writer
        generation. One exchange later every rank decides from the same facts, so every rank
        raises the same typed error, or none does.
        """
        cfg, topo = self.ctx.options, self.ctx.topo
        durable = self.durable
        mine = await gather_facts(self.ctx, self.lock, durable)
        everyone = await step(self.ctx, Step.OPEN_FACTS, mine)
        stale = self.judge(everyone)
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
        claimed: dict[str, int] = {}
        failure = ""
        if self.ctx.rank == 0 and durable:
            try:
                if (everyone[0].job or {}).get("state") != "found" or self._record_behind:
                    await self.write_job_record()
                for tier in durable:
                    fence = Fence(tier, self.ctx.session)
                    claimed[tier.name] = await fence.claim()
                    self.fences[tier.name] = fence
            except (TiercheckError, OSError) as exc:
                failure = f"{type(exc).__name__}: {exc}"
        # Also a barrier: no rank reads its node's memory while it is being discarded.
        decided = (await step(self.ctx, Step.CLAIM, ClaimOutcome(claimed, failure)))[0]
        if decided.failure:
            raise StorageError(
                f"cannot claim job {cfg.job.job_id!r} in its durable storage: {decided.failure}"
            )
        for tier in durable:
            if tier.name not in self.fences:
                fence = Fence(tier, self.ctx.session)
                fence.adopt(decided.generations[tier.name])
                self.fences[tier.name] = fence
        me = everyone[self.ctx.rank]
        if topo.local_rank == 0 and (
            me.identity is None or topo.node_index in stale or topo.node_index in self._adopted
        ):
            await self._write_identity()

    async def _write_identity(self) -> None:
        durable = self.durable
        identity = NodeIdentity(
            job_id=self.ctx.job_id,
            token=self.job_token,
            world_size=self.stored_world,
            persistent=location(durable[0]) if durable else None,
            created=time.time(),
            worlds=self.worlds,
            revision=self.revision,
        )
        try:
            await asyncio.to_thread(write_identity, self.ctx.options.job.node_root, identity)
        except OSError as exc:  # memory that cannot take a small file takes no blob either
            logger.warning("tiercheck: cannot record the node's identity: %r", exc)

    async def write_job_record(self) -> None:
        record = JobRecord(
            self.ctx.options.job.job_id,
            self.job_token,
            self.stored_world,
            time.time(),
            worlds=self.worlds,
            revision=self.revision,
        )
        for tier in self.durable:
            await write_job_record(tier, record)

    def judge(self, everyone: Sequence[OpenFacts]) -> dict[int, str]:
        """Decide, from what every rank saw, whether this run may open; return stale nodes.

        Pure: every rank computes the same verdict from the same exchange.
        """
        cfg, topo = self.ctx.options, self.ctx.topo
        locked = [e.lock for e in everyone if e.lock]
        if locked:
            raise JobLocked(locked[0] + (f" ({len(locked)} ranks)" if len(locked) > 1 else ""))
        broken = [f"rank {r}: {msg}" for r, e in enumerate(everyone) for msg in e.probe.values()]
        if broken:
            raise StorageError(
                "the durable storage of job "
                f"{cfg.job.job_id!r} cannot be used, so the job does not start:\n  "
                + "\n  ".join(broken[:8])
            )
        first = everyone[0]
        if first.job_error:
            raise StorageError(
                f"cannot read the job record (JOB) of {cfg.job.job_id!r} at "
                f"{location(self.durable[0]) if self.durable else '?'}: {first.job_error}. "
                "Nothing was read or changed. If the record is damaged, `tiercheck repair-job "
                f"<persistent URL> --job {cfg.job.job_id}` sets it aside and the next opening "
                "writes it anew from the COMMIT records and the nodes' memory, without losing "
                "a version."
            )
        nodes: dict[int, OpenFacts] = {}
        for e in everyone:
            nodes.setdefault(e.node, e)
        identities: dict[int, NodeIdentity | None] = {}
        stale: dict[int, Stale] = {}
        for n, e in nodes.items():
            if e.identity_error:
                identities[n] = None
                if e.identity_damaged and not e.has_data:
                    continue  # nothing to protect: the record is written anew
                if e.identity_damaged:
                    stale[n] = Stale(
                        "damaged",
                        f"its identity record is damaged ({e.identity_error}): whose "
                        "checkpoints it holds cannot be told",
                    )
                else:
                    stale[n] = Stale(
                        "unreadable",
                        f"its identity record cannot be read ({e.identity_error})",
                    )
                continue
            text = e.identity
            identities[n] = None if text is None else NodeIdentity.from_bytes(text.encode())
        job = first.job
        durable = self.durable
        here = location(durable[0]) if durable else None
        # Memory of an incarnation `tiercheck rm-job` deleted is nobody's: out of the judging.
        self.deleted_nodes = forget_deleted(identities, first.to_wire(), cfg.job.job_id, here)
        # Identities of nodes whose memory says it belongs to this job at this location.
        ours = {
            i.token: i
            for i in identities.values()
            if i is not None and i.job_id == cfg.job.job_id and i.persistent == here
        }
        absent = job is not None and job["state"] == "absent"
        worlds: Spans = ()
        revision = 0
        self._record_behind = False
        if job is not None and job["state"] == "found":
            token, world_size = job["token"], job["world_size"]
            worlds = parse_spans(job.get("worlds"), world_size)
            revision = int(job.get("revision", 0))
            where = f"at {here}"
            newer = [
                i
                for i in identities.values()
                if i is not None
                and i.token == token
                and i.job_id == cfg.job.job_id
                and i.persistent == here
            ]
            if job.get("repaired"):
                # `tiercheck repair-job` wrote this record with a new token: the incarnation is
                # the one the nodes' memory of this location names, where they agree.
                tokens = {
                    i.token
                    for i in identities.values()
                    if i is not None and i.job_id == cfg.job.job_id and i.persistent == here
                }
                if len(tokens) == 1:
                    token = tokens.pop()
                    newer = [i for i in identities.values() if i is not None and i.token == token]
                    revision = -1  # whatever the identities say is newer than the repair
                self._record_behind = True
            newest = max(newer, key=lambda i: i.revision, default=None)
            if newest is not None and newest.revision > revision:
                # The record's last update failed; the nodes recorded the change: theirs is
                # the history the stored versions follow.
                world_size, worlds, revision = newest.world_size, newest.worlds, newest.revision
                self._record_behind = True
        elif job is not None:
            where = f"at {here}"
            world_size = job.get("world_size", topo.world_size)
            worlds = parse_spans(job.get("worlds"), world_size)
            if len(ours) == 1:
                # The location lost its job record (deleted, a lifecycle rule, set aside by
                # `tiercheck repair-job`) while the job was away, or predates it; the memory
                # that names it is this job's.
                token, remembered = next(iter(ours.items()))
                if absent or world_of(
                    max(job.get("committed") or [0]), remembered.worlds, remembered.world_size
                ) == world_of(max(job.get("committed") or [0]), worlds, world_size):
                    world_size, worlds = remembered.world_size, remembered.worlds
                    revision = remembered.revision
                if absent:
                    logger.warning(
                        "tiercheck: the durable location %s of job %r holds nothing, but the "
                        "nodes' memory holds this job's checkpoints written there: the location "
                        "was emptied. Using the memory and writing the job record again.",
                        here,
                        cfg.job.job_id,
                    )
            else:
                token = first.fresh_token or ""
        else:
            tokens = {i.token for i in identities.values() if i is not None}
            if len(tokens) > 1:
                raise StaleMemory(
                    f"the nodes of job {cfg.job.job_id!r} hold memory of different runs "
                    f"(tokens {sorted(tokens)}); with no durable tier to tell which is this "
                    "run's, none is used. Nothing was changed. Pass stale_memory='discard' "
                    "to delete every node's memory of the job and start over (its versions "
                    "exist nowhere else: there is no durable tier), or use another job_id."
                )
            token = tokens.pop() if tokens else first.fresh_token or ""
            known = [i for i in identities.values() if i is not None]
            if known:
                # Nodes that joined later, or missed an update, know less: the newest wins.
                best = max(known, key=lambda i: (i.revision, len(i.worlds)))
                world_size, worlds, revision = best.world_size, best.worlds, best.revision
            else:
                world_size = topo.world_size
            where = "in the nodes' memory"
        if world_size != topo.world_size and not cfg.job.elastic:
            raise WorldSizeMismatch(
                f"job {cfg.job.job_id!r} {where} was saved by {world_size} ranks; this run has "
                f"{topo.world_size}. Restart with {world_size} ranks, pass elastic=True to "
                "restore it resharded onto this number of ranks, or give this run another "
                "job_id. Nothing stored was read or changed."
            )
        self.stored_world = world_size
        self.worlds = worlds
        self.revision = revision
        for n, identity in identities.items():
            if n in stale or n in self.deleted_nodes:
                continue
            if identity is None:
                if absent and nodes[n].has_data:
                    stale[n] = Stale(
                        "predates",
                        "it holds checkpoints but no identity record, and the job's durable "
                        "location holds nothing: they are not known to be this run's",
                    )
            elif identity.job_id != cfg.job.job_id:
                stale[n] = Stale(
                    "another-run", f"it belongs to job {identity.job_id!r}, not this one"
                )
            elif identity.token == token:
                continue  # this incarnation's memory (its folder may have moved: same token)
            elif identity.persistent != here:
                stale[n] = Stale(
                    "another-location",
                    f"it belongs to this job as saved to another durable location "
                    f"({identity.persistent}; this run uses {here})",
                )
            else:
                stale[n] = Stale(
                    "another-run",
                    f"it belongs to another run of {identity.job_id!r} at the same durable "
                    f"location (token {identity.token[:8]}, made "
                    f"{made_at(identity.created)}), not the one the job record names (token "
                    f"{token[:8]}): the job was deleted or started anew there since",
                )
        self.job_token = token
        policy = cfg.job.stale_memory
        # Memory of an incarnation `tiercheck rm-job` deleted goes whatever the policy says.
        deleted = dict(self.deleted_nodes)
        if not stale or policy == "discard":
            return {**{n: why.text for n, why in stale.items()}, **deleted}
        if policy == "adopt" and all(why.kind in ("damaged", "predates") for why in stale.values()):
            logger.warning(
                "tiercheck: adopting the memory of nodes %s as this run's (stale_memory='adopt'): "
                "%s",
                sorted(stale),
                "; ".join(f"node {n}: {why.text}" for n, why in sorted(stale.items())),
            )
            self._adopted = sorted(stale)
            return deleted
        root = str(cfg.job.node_root)
        damaged = tuple(sorted(n for n, why in stale.items() if why.kind == "damaged"))
        raise StaleMemory(stale_message(cfg.job.job_id, root, stale, first, nodes), damaged=damaged)

    async def check(self, tier: Tier) -> None:
        """Before durable data is written: is this opening still the job's writer there?"""
        if self.superseded:
            raise Superseded(
                f"a newer opening of job {self.ctx.job_id!r} took over the {tier.name!r} tier; "
                "this run no longer writes there"
            )
        fence = self.fences.get(tier.name)
        if fence is None:
            return
        try:
            if await fence.check():
                await self.write_job_record()  # the location was emptied under the job
        except Superseded as exc:
            self.superseded = True
            self.ctx.stats.superseded = True
            logger.error(
                "tiercheck: %s. Its saves still go to the memory tiers; durable saves, retention "
                "and restore-time cleanup in %r stop.",
                exc,
                tier.name,
            )
            raise
