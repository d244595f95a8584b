"""Guards of a durable location: the job record, the tombstone, writer generations, the probe.

Used by the checkpointer when it opens (:mod:`tiercheck.engine.open.claim`) and by the command line
(see :mod:`tiercheck.consistency.identity` for the records themselves):

* :func:`read_job_record`, :func:`write_job_record` -- the job's own record;
* :func:`read_tombstone`, :func:`write_tombstone`, :func:`deletion_facts`,
  :func:`forget_deleted` -- what ``tiercheck rm-job`` deleted, and what an opening makes of it;
* :class:`Fence` -- writer generations in a durable tier: the newest opening of a job owns its
  durable storage; an older one that is still running notices before it writes and stops, and
  so does one whose job ``tiercheck rm-job`` deleted (:func:`read_tombstone`);
* :func:`probe` -- write, read back and delete a small object, so that a durable location that
  cannot be used fails when the job opens, not days later.

Only the :class:`~tiercheck.tiers.Tier` API is used here. Importable from
:mod:`tiercheck.guards.node` too.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Mapping, Sequence
from typing import Any

from tiercheck.consistency.identity import (
    JOB_KEY,
    TOMBSTONE_KEY,
    WRITERS_PREFIX,
    JobRecord,
    NodeIdentity,
    Tombstone,
    WriterRecord,
    parse_writer_key,
    probe_key,
    writer_key,
)
from tiercheck.errors import (
    BlobNotFound,
    FormatError,
    JobDeleted,
    StorageError,
    Superseded,
    TiercheckError,
)
from tiercheck.tiers import atomic
from tiercheck.tiers.base import Tier

__all__ = [
    "Fence",
    "deletion_facts",
    "forget_deleted",
    "probe",
    "read_job_record",
    "read_tombstone",
    "write_job_record",
    "write_tombstone",
    "writer_record",
]

logger = logging.getLogger("tiercheck")

#: Writer generations kept besides the live one: enough for an operator to see who ran last.
KEEP_WRITERS = 4


async def read_job_record(tier: Tier) -> JobRecord | None:
    """The tier's job record, or ``None`` when it has none."""
    try:
        data = await tier.get(JOB_KEY)
    except BlobNotFound:
        return None
    return JobRecord.from_bytes(bytes(data))


async def write_job_record(tier: Tier, record: JobRecord) -> None:
    """Store the job record."""
    await tier.put(JOB_KEY, record.to_bytes())


async def read_tombstone(tier: Tier) -> Tombstone | None:
    """What ``tiercheck rm-job`` deleted at this location (its tombstone), or ``None``."""
    try:
        data = await tier.get(TOMBSTONE_KEY)
    except BlobNotFound:
        return None
    return Tombstone.from_bytes(bytes(data))


async def write_tombstone(tier: Tier, record: Tombstone) -> None:
    """Store the tombstone."""
    await tier.put(TOMBSTONE_KEY, record.to_bytes())


async def deletion_facts(tiers: Sequence[Tier]) -> dict[str, Any]:
    """Rank 0, at opening: what the durable tiers' tombstones say, for :func:`forget_deleted`.

    ``{"deleted": [tokens...], "tombstone": bool}`` -- the incarnations ``tiercheck rm-job``
    deleted, and whether a tombstone is there at all -- or, when a tombstone cannot be read,
    ``{"job_error": why}`` (the opening then fails as for a job record that cannot be read:
    whether memory may be restored cannot be told).
    """
    tokens: list[str] = []
    found = False
    for tier in tiers:
        try:
            tombstone = await read_tombstone(tier)
        except (TiercheckError, OSError) as exc:
            return {"job_error": f"its tombstone ({TOMBSTONE_KEY}) cannot be read: {exc}"}
        if tombstone is not None:
            found = True
            tokens += [t for t in tombstone.tokens if t not in tokens]
    return {"deleted": tokens, "tombstone": found}


def forget_deleted(
    identities: dict[int, NodeIdentity | None],
    facts: Mapping[str, Any],
    job_id: str,
    where: str | None,
) -> dict[int, str]:
    """At opening: the nodes whose memory belongs to an incarnation ``tiercheck rm-job`` deleted.

    ``facts`` is rank 0's exchange (:func:`deletion_facts` and the job record's state, key
    ``"job"``); ``where`` the durable location, as identities record it. A node's memory is of
    a deleted incarnation when its identity names one of the tombstone's tokens -- or, while no
    new incarnation has started there since (a tombstone, no job record), when it names this
    job at ``where`` at all (a job record that was unreadable or missing when ``rm-job`` ran
    left no token to name). Those nodes' identities are set to ``None`` in ``identities``
    (their memory is not this run's, nor anyone's: the user deleted it) and returned with the
    reason; the caller discards that memory whatever ``stale_memory`` says, and starts the job
    afresh. A job record that names a deleted incarnation means the deletion did not finish, and
    ``COMMIT`` records without a job record mean a run of the deleted job wrote after it:
    :class:`~tiercheck.errors.JobDeleted` for both, before anything is changed.
    """
    tokens = set(facts.get("deleted") or ())
    if not facts.get("tombstone"):
        return {}
    job = facts.get("job") or {}
    since_deleted = job.get("state") != "found"
    if job.get("state") == "legacy":
        # COMMIT records without a job record, after a deletion: written by a run of the
        # deleted incarnation that was still writing (or a deletion cut short): not this run's.
        raise JobDeleted(
            f"job {job_id!r} at {where} was deleted by `tiercheck rm-job`, but versions were "
            "stored there since without a job record (a run of the deleted job still writing "
            f"when it was deleted?). Run `tiercheck rm-job {where} --job {job_id} --yes` again "
            "to remove them, then start the job. Nothing was changed."
        )
    if not since_deleted and job.get("token") in tokens:
        raise JobDeleted(
            f"job {job_id!r} at {where} was deleted by `tiercheck rm-job` (incarnation "
            f"{str(job['token'])[:8]}), but its job record is still there: the deletion did not "
            f"finish, or a run of that incarnation wrote it again. Run `tiercheck rm-job {where} "
            f"--job {job_id} --yes` again to finish it, then start the job. Nothing was changed."
        )
    gone: dict[int, str] = {}
    for node, identity in identities.items():
        if identity is None or identity.job_id != job_id:
            continue
        if identity.token in tokens or (since_deleted and identity.persistent == where):
            identities[node] = None
            gone[node] = (
                f"it holds incarnation {identity.token[:8]} of job {job_id!r}, which "
                f"`tiercheck rm-job` deleted from {where}: discarded, never restored"
            )
    return gone


def writer_record(generation: int, session: str) -> WriterRecord:
    """The record of writer generation ``generation``, claimed by this process for ``session``."""
    me = atomic.current_owner()
    return WriterRecord(
        generation,
        session,
        socket.gethostname(),
        me.pid,
        time.time(),
        start=me.start or 0,
        kernel=me.kernel or "",
    )


#: What the probe's steps are called once done ("could not be ...").
_DONE = {"write": "written", "read back": "read back", "delete": "deleted"}


async def probe(tier: Tier, session: str, rank: int) -> None:
    """Write a small object, read it back, delete it; raise what fails, naming the step."""
    key = probe_key(session, rank)
    payload = f"tiercheck probe {session} r{rank} {time.time()}".encode()
    step = "write"
    try:
        await tier.put(key, payload)
        step = "read back"
        back = bytes(await tier.get(key))
        if back != payload:
            raise StorageError(f"read back {len(back)} bytes that differ from what was written")
        step = "delete"
        await tier.delete(key)
    except TiercheckError as exc:
        raise StorageError(
            f"the {tier.name!r} tier ({tier!r}) cannot be used: a test object could not be "
            f"{_DONE[step]} ({exc}). Check the URL, the "
            "credentials (storage_options) and the permissions; nothing of the job was touched."
        ) from exc
    except OSError as exc:
        raise StorageError(
            f"the {tier.name!r} tier ({tier!r}) cannot be used: {step} of a test object failed "
            f"({exc!r}). Check the URL, the credentials and the permissions."
        ) from exc


class Fence:
    """Writer generations in one durable tier: the newest opening of a job owns it.

    :meth:`claim` (one rank per job, at open) stores the next generation naming this opening's
    ``session``; :meth:`check` (any rank, before writing durable data) raises
    :class:`~tiercheck.errors.Superseded` when a newer generation exists. A location whose
    generations vanished (the folder was deleted, a lifecycle rule ran) is re-claimed with a
    warning: the writer is still the newest one anyone knows of.
    """

    def __init__(self, tier: Tier, session: str) -> None:
        self.tier = tier
        self.session = session
        self.generation: int | None = None
        self._warned_lost = False

    async def _newest(self) -> tuple[int | None, list[int]]:
        found: list[int] = []
        async for key in self.tier.list(WRITERS_PREFIX):
            generation = parse_writer_key(key)
            if generation is not None:
                found.append(generation)
        generations = sorted(found)
        return (generations[-1] if generations else None), generations

    async def claim(self) -> int:
        """Store the next generation for this session and return it (rank 0, at open)."""
        tombstone = await read_tombstone(self.tier)
        deleted = -1 if tombstone is None else tombstone.generation
        for _attempt in range(8):
            newest, generations = await self._newest()
            generation = max(-1 if newest is None else newest, deleted) + 1
            record = writer_record(generation, self.session)
            await self.tier.put(writer_key(generation), record.to_bytes())
            # Two openings may have picked the same number; the record that stayed decides.
            if await self._owner(generation) == self.session:
                self.generation = generation
                for old in generations[:-KEEP_WRITERS]:
                    await self.tier.delete(writer_key(old))
                return generation
        raise StorageError(
            f"could not claim a writer generation in {self.tier!r}: other openings of this job "
            "keep claiming the same ones. Is the job launched several times at once?"
        )

    async def _owner(self, generation: int) -> str | None:
        try:
            data = await self.tier.get(writer_key(generation))
        except BlobNotFound:
            return None
        try:
            return WriterRecord.from_bytes(bytes(data)).session
        except FormatError:
            return None

    async def newest_writer(self) -> WriterRecord | None:
        """The record of the newest writer generation in the tier (``None``: there is none, or
        it cannot be parsed)."""
        newest, _ = await self._newest()
        if newest is None:
            return None
        try:
            data = await self.tier.get(writer_key(newest))
            return WriterRecord.from_bytes(bytes(data))
        except (BlobNotFound, FormatError):
            return None

    def adopt(self, generation: int) -> None:
        """Use the generation another rank of this opening claimed."""
        self.generation = generation

    async def check(self) -> bool:
        """Raise :class:`~tiercheck.errors.Superseded` if a newer opening owns the tier.

        Returns whether the generations had vanished and this one was claimed again (the
        location was emptied: the caller may want to write its other records again too).
        """
        mine = self.generation
        if mine is None:
            raise Superseded("this opening holds no writer generation in the tier")
        newest, _ = await self._newest()
        if newest is not None and newest > mine:
            owner = await self._owner(newest)
            raise Superseded(
                f"another opening of this job (generation {newest}, session {owner}) took over "
                f"{self.tier!r} after this one (generation {mine}); this run no longer writes "
                "there. Stop one of the two runs: they share a job_id."
            )
        owner = await self._owner(mine) if newest == mine else None
        if newest == mine and owner == self.session:
            return False
        if newest == mine and owner is not None:
            raise Superseded(
                f"another opening of this job (session {owner}) claimed the same writer "
                f"generation {mine} in {self.tier!r}; this run no longer writes there"
            )
        # The generations vanished. Deleted by `tiercheck rm-job`: this writer's job is gone.
        tombstone = await read_tombstone(self.tier)
        if tombstone is not None and tombstone.generation >= mine:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(tombstone.time))
            raise Superseded(
                f"job {tombstone.job_id!r} was deleted from {self.tier!r} by `tiercheck rm-job` "
                f"(pid {tombstone.pid} on {tombstone.host or '?'}, {when}) while this run was "
                "writing it; this run no longer writes there"
            )
        # Deleted folder, lifecycle rule: claim ours again.
        if not self._warned_lost:
            self._warned_lost = True
            logger.warning(
                "tiercheck: the writer records of %r are gone (was the location emptied?); "
                "claiming generation %s again",
                self.tier,
                mine,
            )
        await self.tier.put(writer_key(mine), writer_record(mine, self.session).to_bytes())
        return True
