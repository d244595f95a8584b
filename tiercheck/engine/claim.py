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
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tiercheck.consistency.commit import CommitRecord
from tiercheck.consistency.identity import JobRecord, NodeIdentity
from tiercheck.consistency.keys import commit_key
from tiercheck.consistency.worlds import Spans, parse_spans, span_after, world_of
from tiercheck.engine.tier import commit_versions, location
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
    discard_node_memory,
    node_holds_data,
    probe,
    read_identity,
    read_job_record,
    write_identity,
    write_job_record,
)
from tiercheck.tiers.base import Tier

if TYPE_CHECKING:
    from tiercheck.engine.context import Context

__all__ = ["Claim"]

logger = logging.getLogger("tiercheck")


class Claim:
    """The writer lock of this rank, the job's incarnation, and the fences of durable tiers."""

    def __init__(self, ctx: Context) -> None:
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

    @property
    def world_changed(self) -> bool:
        """Whether this run has another number of ranks than the one that saved the job."""
        return self.stored_world != self.ctx.topo.world_size

    def world_of(self, version: int) -> int:
        """How many ranks saved ``version``."""
        return world_of(version, self.worlds, self.stored_world)

    async def record_world(self, first_version: int) -> None:
        """After an elastic restore: versions from ``first_version`` on are this world's.

        Rank 0 rewrites the job record in the durable tiers, each node's first rank its node's
        identity, so the next opening knows which versions which world saved. Every rank
        updates what it knows the same way.
        """
        before = (self.worlds, self.stored_world)
        new = self.ctx.topo.world_size
        self.worlds = span_after(self.worlds, self.stored_world, first_version, new)
        self.stored_world = new
        error = None
        if self.ctx.rank == 0 and self.durable and not self.superseded:
            try:
                await self.write_job_record()
            except (TiercheckError, OSError) as exc:
                error = f"{type(exc).__name__}: {exc}"
        # Collective: saves filed under the old history would be invisible to the next opening,
        # so no rank goes on when the record could not be written.
        said = await self.ctx.exchange("control", {"error": error})
        failed = [e["error"] for e in said if e["error"] is not None]
        if failed:
            self.worlds, self.stored_world = before
            raise StorageError(
                f"version {first_version - 1} of job {self.ctx.job_id!r} was restored onto "
                f"{new} ranks, but the job record could not be updated for that number "
                f"({failed[0]}); this run must not save until it is. Nothing was deleted; "
                "check the durable location and restore again."
            )
        if self.ctx.topo.local_rank == 0:
            await self._write_identity()

    async def guard(self) -> None:
        """Refuse to open over data this run must not touch; the same verdict on every rank.

        Each rank gathers what it can see (its writer lock, whether the durable tiers work, its
        node's identity); rank 0 also reads or creates the job record and claims a writer
        generation. One exchange later every rank decides from the same facts, so every rank
        raises the same typed error, or none does.
        """
        cfg, topo = self.ctx.options, self.ctx.topo
        mine: dict[str, Any] = {"node": topo.node_index, "local_rank": topo.local_rank}
        try:
            await asyncio.to_thread(self.lock.acquire)
        except (JobLocked, OSError) as exc:
            mine["lock"] = str(exc)
        durable = self.durable
        probes: dict[str, str] = {}
        for tier in durable:
            try:
                await probe(tier, self.ctx.session, self.ctx.rank)
            except (TiercheckError, OSError) as exc:
                probes[tier.name] = str(exc)
        mine["probe"] = probes
        if self.ctx.rank == 0 and durable and not probes:
            try:
                mine["job"] = await self._read_job_record(durable)
            except (TiercheckError, OSError) as exc:
                mine["job_error"] = f"{type(exc).__name__}: {exc}"
        try:
            identity = await asyncio.to_thread(read_identity, cfg.job.node_root)
            mine["identity"] = None if identity is None else identity.to_bytes().decode()
        except (TiercheckError, OSError) as exc:
            mine["identity_error"] = str(exc)
            # Cut short or garbled (not written by a newer build): damaged, not another run's.
            mine["identity_damaged"] = isinstance(exc, FormatError) and not isinstance(
                exc, UnsupportedFormat
            )
        try:
            mine["has_data"] = await asyncio.to_thread(node_holds_data, cfg.job.node_root)
        except OSError:
            mine["has_data"] = True  # cannot look: assume there is something to protect
        if self.ctx.rank == 0:
            mine["fresh_token"] = os.urandom(8).hex()
        everyone = await self.ctx.exchange("control", mine)
        stale = self.judge(everyone)
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
        if self.ctx.rank == 0 and durable:
            try:
                if everyone[0]["job"]["state"] != "found":
                    await self.write_job_record()
                for tier in durable:
                    fence = Fence(tier, self.ctx.session)
                    claimed[tier.name] = await fence.claim()
                    self.fences[tier.name] = fence
            except (TiercheckError, OSError) as exc:
                failure = f"{type(exc).__name__}: {exc}"
        # Also a barrier: no rank reads its node's memory while it is being discarded.
        decided = await self.ctx.exchange("control", {"generations": claimed, "failure": failure})
        if decided[0]["failure"]:
            raise StorageError(
                f"cannot claim job {cfg.job.job_id!r} in its durable storage: "
                f"{decided[0]['failure']}"
            )
        for tier in durable:
            if tier.name not in self.fences:
                fence = Fence(tier, self.ctx.session)
                fence.adopt(int(decided[0]["generations"][tier.name]))
                self.fences[tier.name] = fence
        me = everyone[self.ctx.rank]
        if topo.local_rank == 0 and (me.get("identity") is None or topo.node_index in stale):
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
        )
        for tier in self.durable:
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
                    "worlds": [list(span) for span in record.worlds],
                }
        newest = max(await commit_versions(durable[0]), default=None)
        if newest is None:
            return {"state": "absent"}
        commit = CommitRecord.from_bytes(bytes(await durable[0].get(commit_key(newest))))
        return {"state": "legacy", "world_size": commit.world_size}

    def judge(self, everyone: Sequence[Mapping[str, Any]]) -> dict[int, str]:
        """Decide, from what every rank saw, whether this run may open; return stale nodes.

        Pure: every rank computes the same verdict from the same exchange.
        """
        cfg, topo = self.ctx.options, self.ctx.topo
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
        damaged: set[int] = set()
        for n, e in nodes.items():
            if e.get("identity_error"):
                identities[n] = None
                if e.get("identity_damaged") and not e["has_data"]:
                    continue  # nothing to protect: the record is written anew
                if e.get("identity_damaged"):
                    damaged.add(n)
                    stale[n] = (
                        f"its identity record is damaged ({e['identity_error']}): whose "
                        "checkpoints it holds cannot be told"
                    )
                else:
                    stale[n] = f"its identity record is unreadable ({e['identity_error']})"
                continue
            text = e.get("identity")
            identities[n] = None if text is None else NodeIdentity.from_bytes(text.encode())
        job = first.get("job")
        durable = self.durable
        here = location(durable[0]) if durable else None
        # Identities of nodes whose memory says it belongs to this job at this location.
        ours = {
            i.token: i
            for i in identities.values()
            if i is not None and i.job_id == cfg.job.job_id and i.persistent == here
        }
        absent = job is not None and job["state"] == "absent"
        worlds: Spans = ()
        if job is not None and job["state"] == "found":
            token, world_size = job["token"], job["world_size"]
            worlds = parse_spans(job.get("worlds"), world_size)
            where = f"at {here}"
        elif job is not None:
            where = f"at {here}"
            if len(ours) == 1:
                # The location lost its records (deleted, a lifecycle rule) while the job was
                # away, or predates them; the memory that names it is this job's.
                token, remembered = next(iter(ours.items()))
                world_size = job.get("world_size", remembered.world_size)
                if world_size == remembered.world_size:
                    worlds = remembered.worlds
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
            known = [i for i in identities.values() if i is not None]
            sizes = {i.world_size for i in known}
            world_size = sizes.pop() if len(sizes) == 1 else topo.world_size
            # Nodes that joined later know less of the history: take the longest.
            histories = sorted((i.worlds for i in known if i.world_size == world_size), key=len)
            worlds = histories[-1] if histories else ()
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
            if set(stale) <= damaged:
                raise StaleMemory(
                    f"the shared memory of job {cfg.job.job_id!r} (for this rank: "
                    f"{cfg.job.node_root}) holds checkpoints whose identity record "
                    "(identity.json) is damaged, so they cannot be proven to be this run's; "
                    "they are not restored:\n  "
                    + "\n  ".join(lines)
                    + "\nTo start from the durable location (deleting that memory), pass "
                    "stale_memory='discard'; to keep it for inspection, move the folder aside "
                    "first. Nothing was changed.",
                    damaged=tuple(sorted(damaged)),
                )
            raise StaleMemory(
                f"the shared memory of job {cfg.job.job_id!r} (for this rank: {cfg.job.node_root}) "
                "holds checkpoints of another run with the same name; they are not restored as "
                "this run's:\n  "
                + "\n  ".join(lines)
                + "\nTo continue that run, point this one at its durable location. To discard "
                "that memory, pass stale_memory='discard' (or delete the folder). Or use "
                "another job_id. Nothing was changed.",
                damaged=tuple(sorted(damaged)),
            )
        return stale

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
