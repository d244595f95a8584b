"""Whether an opening may go ahead: a pure function of what every rank saw.

Every rank computes the same :class:`OpeningVerdict` from the same exchange (the ``open-facts``
step), so every rank raises the same typed error, or none does; :meth:`tiercheck.engine.open.claim.
Claim.guard` applies the verdict.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tiercheck.consistency.identity import NodeIdentity
from tiercheck.consistency.protocol import OpenFacts
from tiercheck.consistency.worlds import Spans, parse_spans, world_of
from tiercheck.engine.open.stale import Stale, made_at, stale_message
from tiercheck.errors import JobLocked, StaleMemory, StorageError, WorldSizeMismatch
from tiercheck.guards import forget_deleted

__all__ = ["OpeningVerdict", "RejoinVerdict", "judge_opening", "judge_rejoin"]

logger = logging.getLogger("tiercheck")


@dataclass(frozen=True)
class OpeningVerdict:
    """What an opening that may go ahead found out about the job and its nodes."""

    #: Nodes whose memory goes, and why (stale, or of a deleted incarnation).
    discard: dict[int, str]
    #: Nodes whose memory belongs to an incarnation `tiercheck rm-job` deleted (discarded
    #: whatever ``stale_memory`` says).
    deleted_nodes: dict[int, str]
    #: The job record is behind what the nodes' identities know (its last update failed).
    record_behind: bool
    #: How many ranks saved the job's newest versions, and its world-size history.
    stored_world: int
    worlds: Spans
    #: How many times the history was changed.
    revision: int
    #: The job's incarnation.
    job_token: str
    #: Nodes whose memory this opening adopts as its own (``stale_memory="adopt"``).
    adopted: tuple[int, ...]
    #: Durable tiers some rank could not reach, with why (the first rank's word): the job
    #: opens on its memory, which holds this run's versions, and claims them later (see
    #: :mod:`tiercheck.engine.open.rejoin`). Empty on a normal opening.
    unreachable: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class _History:
    """Whose history the stored versions follow, as the opening judges it: the incarnation's
    token, the world size that saved the newest versions and the history of world sizes, how
    many times that history changed, and where it was read (for the messages)."""

    token: str
    world_size: int
    worlds: Spans
    revision: int
    where: str
    #: The job record is behind what the nodes' identities know (its last update failed).
    record_behind: bool = False


def judge_opening(
    everyone: Sequence[OpenFacts],
    *,
    job_id: str,
    here: str | None,
    ranks: int,
    elastic: bool,
    stale_policy: str,
    node_root: str,
) -> OpeningVerdict:
    """Decide, from what every rank saw, whether this run may open (raising the typed error
    that says why not).

    ``here`` names the durable location (``None`` without a durable tier), ``ranks`` is this
    run's world size, ``stale_policy`` its ``stale_memory`` option.

    A durable tier that some rank cannot *reach* (its probe failed for a cause that passes,
    :attr:`OpenFacts.unreachable`) does not stop the opening when the nodes' memory holds
    versions this run can verify as its own without it: every node that holds data names this
    job, this location and one incarnation (the job record's, where rank 0 could read it), and
    nothing of it is stale. The verdict then names the tier (:attr:`OpeningVerdict.unreachable`)
    and discards nothing. Otherwise, and for a tier that refused (a permission error, a missing
    bucket), :class:`~tiercheck.errors.StorageError` as ever.

    In order: the storage must be usable (:func:`_usable_storage`) and the job record readable;
    each node's identity is read (:func:`_identities`) and the memory of deleted incarnations
    set apart; the history the stored versions follow is found -- in the job record, in the
    memory alone while the durable tier is away, or in the memory of a job without one
    (:func:`_history`); the world size must match it; every node whose memory is not this
    run's is named (:func:`_stale_nodes`); and the verdict follows, on the memory alone
    (:func:`_on_memory_alone`) or by ``stale_memory``.
    """
    unusable, unreachable = _usable_storage(everyone, job_id)
    first = everyone[0]
    if first.job_error:
        raise StorageError(
            f"cannot read the job record (JOB) of {job_id!r} at "
            f"{here if here is not None else '?'}: {first.job_error}. "
            "Nothing was read or changed. If the record is damaged, `tiercheck repair-job "
            f"<persistent URL> --job {job_id}` sets it aside and the next opening "
            "writes it anew from the COMMIT records and the nodes' memory, without losing "
            "a version."
        )
    nodes: dict[int, OpenFacts] = {}
    for e in everyone:
        nodes.setdefault(e.node, e)
    identities, stale = _identities(nodes)
    # Memory of an incarnation `tiercheck rm-job` deleted is nobody's: out of the judging.
    deleted_nodes = forget_deleted(identities, first.to_wire(), job_id, here)
    history = _history(
        first,
        identities,
        job_id=job_id,
        here=here,
        ranks=ranks,
        unreachable=unreachable,
        unusable=unusable,
    )
    if history.world_size != ranks and not elastic:
        raise WorldSizeMismatch(
            f"job {job_id!r} {history.where} was saved by {history.world_size} ranks; this run "
            f"has {ranks}. Restart with {history.world_size} ranks, pass elastic=True to "
            "restore it resharded onto this number of ranks, or give this run another "
            "job_id. Nothing stored was read or changed."
        )
    absent = first.job is not None and first.job["state"] == "absent"
    _stale_nodes(
        stale,
        identities,
        nodes,
        deleted_nodes=deleted_nodes,
        history=history,
        job_id=job_id,
        here=here,
        absent=absent,
    )

    def verdict(discard: dict[int, str], adopted: tuple[int, ...]) -> OpeningVerdict:
        return OpeningVerdict(
            discard=discard,
            deleted_nodes=deleted_nodes,
            record_behind=history.record_behind,
            stored_world=history.world_size,
            worlds=history.worlds,
            revision=history.revision,
            job_token=history.token,
            adopted=adopted,
            unreachable=unreachable,
        )

    if unreachable:
        _on_memory_alone(
            stale,
            identities,
            nodes,
            deleted_nodes=deleted_nodes,
            history=history,
            job_id=job_id,
            unusable=unusable,
        )
        return verdict({}, ())
    # Memory of an incarnation `tiercheck rm-job` deleted goes whatever the policy says.
    deleted = dict(deleted_nodes)
    if not stale or stale_policy == "discard":
        return verdict({**{n: why.text for n, why in stale.items()}, **deleted}, ())
    if stale_policy == "adopt" and all(
        why.kind in ("damaged", "predates") for why in stale.values()
    ):
        logger.warning(
            "tiercheck: adopting the memory of nodes %s as this run's (stale_memory='adopt'): %s",
            sorted(stale),
            "; ".join(f"node {n}: {why.text}" for n, why in sorted(stale.items())),
        )
        return verdict(deleted, tuple(sorted(stale)))
    damaged = tuple(sorted(n for n, why in stale.items() if why.kind == "damaged"))
    raise StaleMemory(stale_message(job_id, node_root, stale, first, nodes), damaged=damaged)


def _usable_storage(everyone: Sequence[OpenFacts], job_id: str) -> tuple[str, dict[str, str]]:
    """Raise where a rank holds the job's lock (:class:`~tiercheck.errors.JobLocked`) or a
    durable tier refused (:class:`~tiercheck.errors.StorageError`); else what to say should the
    storage turn out unusable after all, and the tiers some rank could not reach (the first
    rank's word for each)."""
    locked = [e.lock for e in everyone if e.lock]
    if locked:
        raise JobLocked(locked[0] + (f" ({len(locked)} ranks)" if len(locked) > 1 else ""))
    broken = [f"rank {r}: {msg}" for r, e in enumerate(everyone) for msg in e.probe.values()]
    unusable = (
        "the durable storage of job "
        f"{job_id!r} cannot be used, so the job does not start:\n  " + "\n  ".join(broken[:8])
    )
    refused = [t for e in everyone for t in e.probe if t not in e.unreachable]
    if refused:
        raise StorageError(unusable)
    unreachable: dict[str, str] = {}
    for e in everyone:
        for tier, why in e.unreachable.items():
            unreachable.setdefault(tier, why)
    return unusable, unreachable


def _no_stand_in(unusable: str, why: str) -> StorageError:
    """The error of a durable tier that cannot be reached when the memory cannot stand in."""
    return StorageError(
        f"{unusable}\nIt cannot be reached, and the nodes' memory cannot stand in for it: "
        f"{why}. Nothing was changed."
    )


def _identities(
    nodes: Mapping[int, OpenFacts],
) -> tuple[dict[int, NodeIdentity | None], dict[int, Stale]]:
    """Each node's identity (``None``: none, or none readable), and the nodes already stale
    because theirs cannot be read while they hold data."""
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
    return identities, stale


def _history(
    first: OpenFacts,
    identities: Mapping[int, NodeIdentity | None],
    *,
    job_id: str,
    here: str | None,
    ranks: int,
    unreachable: Mapping[str, str],
    unusable: str,
) -> _History:
    """Whose history the stored versions follow: the job record's (where rank 0 read one, or
    found the location without one), else the memory's alone (a durable tier that cannot be
    reached, or none at all)."""
    if first.job is not None:
        return _history_of_the_record(first, identities, job_id, here, ranks)
    if unreachable:
        # Rank 0 could not read the job record: the memory's identities are checked against
        # what they can be checked against here -- this job, this location, one incarnation
        # -- and against the job record once the tier is back (tiercheck.engine.open.rejoin).
        tokens = {
            i.token
            for i in identities.values()
            if i is not None and i.job_id == job_id and i.persistent == here
        }
        if not tokens:
            raise _no_stand_in(unusable, f"it holds no versions of job {job_id!r} saved to {here}")
        if len(tokens) > 1:
            raise _no_stand_in(
                unusable,
                f"its nodes hold memory of different runs of the job (tokens {sorted(tokens)})",
            )
        token = tokens.pop()
        known = [i for i in identities.values() if i is not None and i.token == token]
        return _remembered(token, known)
    # No durable tier: the memory's is the only history.
    tokens = {i.token for i in identities.values() if i is not None}
    if len(tokens) > 1:
        raise StaleMemory(
            f"the nodes of job {job_id!r} hold memory of different runs "
            f"(tokens {sorted(tokens)}); with no durable tier to tell which is this "
            "run's, none is used. Nothing was changed. Pass stale_memory='discard' "
            "to delete every node's memory of the job and start over (its versions "
            "exist nowhere else: there is no durable tier), or use another job_id."
        )
    token = tokens.pop() if tokens else first.fresh_token or ""
    known = [i for i in identities.values() if i is not None]
    if known:
        return _remembered(token, known)
    return _History(token, ranks, (), 0, "in the nodes' memory")


def _remembered(token: str, known: Sequence[NodeIdentity]) -> _History:
    """The history the nodes' memory holds of incarnation ``token``: nodes that joined later,
    or missed an update, know less, so the newest identity wins."""
    best = max(known, key=lambda i: (i.revision, len(i.worlds)))
    return _History(token, best.world_size, best.worlds, best.revision, "in the nodes' memory")


def _history_of_the_record(
    first: OpenFacts,
    identities: Mapping[int, NodeIdentity | None],
    job_id: str,
    here: str | None,
    ranks: int,
) -> _History:
    """The history rank 0 found at the durable location: its job record's -- or the nodes'
    where they know better (the record's last update failed, or `tiercheck repair-job` wrote
    it) -- or, where the location has no record, the memory's that names this job there."""
    job = first.job
    assert job is not None
    where = f"at {here}"
    ours = {
        i.token: i
        for i in identities.values()
        if i is not None and i.job_id == job_id and i.persistent == here
    }
    if job["state"] == "found":
        token, world_size = job["token"], job["world_size"]
        worlds = parse_spans(job.get("worlds"), world_size)
        revision = int(job.get("revision", 0))
        record_behind = False
        newer = [
            i
            for i in identities.values()
            if i is not None and i.token == token and i.job_id == job_id and i.persistent == here
        ]
        if job.get("repaired"):
            # `tiercheck repair-job` wrote this record with a new token: the incarnation is
            # the one the nodes' memory of this location names, where they agree.
            if len(ours) == 1:
                token = next(iter(ours))
                newer = [i for i in identities.values() if i is not None and i.token == token]
                revision = -1  # whatever the identities say is newer than the repair
            record_behind = True
        newest = max(newer, key=lambda i: i.revision, default=None)
        if newest is not None and newest.revision > revision:
            # The record's last update failed; the nodes recorded the change: theirs is
            # the history the stored versions follow.
            world_size, worlds, revision = newest.world_size, newest.worlds, newest.revision
            record_behind = True
        return _History(token, world_size, worlds, revision, where, record_behind)
    absent = job["state"] == "absent"
    world_size = job.get("world_size", ranks)
    worlds = parse_spans(job.get("worlds"), world_size)
    revision = 0
    if len(ours) != 1:
        return _History(first.fresh_token or "", world_size, worlds, revision, where)
    # The location lost its job record (deleted, a lifecycle rule, set aside by
    # `tiercheck repair-job`) while the job was away, or predates it; the memory that names
    # it is this job's.
    token, remembered = next(iter(ours.items()))
    newest = max(job.get("committed") or [0])
    if absent or world_of(newest, remembered.worlds, remembered.world_size) == world_of(
        newest, worlds, world_size
    ):
        world_size, worlds = remembered.world_size, remembered.worlds
        revision = remembered.revision
    if absent:
        logger.warning(
            "tiercheck: the durable location %s of job %r holds nothing, but the "
            "nodes' memory holds this job's checkpoints written there: the location "
            "was emptied. Using the memory and writing the job record again.",
            here,
            job_id,
        )
    return _History(token, world_size, worlds, revision, where)


def _stale_nodes(
    stale: dict[int, Stale],
    identities: Mapping[int, NodeIdentity | None],
    nodes: Mapping[int, OpenFacts],
    *,
    deleted_nodes: Mapping[int, str],
    history: _History,
    job_id: str,
    here: str | None,
    absent: bool,
) -> None:
    """Add to ``stale`` every node whose memory is not this run's, and why."""
    token = history.token
    for n, identity in identities.items():
        if n in stale or n in deleted_nodes:
            continue
        if identity is None:
            if absent and nodes[n].has_data:
                stale[n] = Stale(
                    "predates",
                    "it holds checkpoints but no identity record, and the job's durable "
                    "location holds nothing: they are not known to be this run's",
                )
        elif identity.job_id != job_id:
            stale[n] = Stale("another-run", f"it belongs to job {identity.job_id!r}, not this one")
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


def _on_memory_alone(
    stale: Mapping[int, Stale],
    identities: Mapping[int, NodeIdentity | None],
    nodes: Mapping[int, OpenFacts],
    *,
    deleted_nodes: Mapping[int, str],
    history: _History,
    job_id: str,
    unusable: str,
) -> None:
    """Opening on memory alone: all of it must verify as this run's, and none is discarded
    (what the unreachable tier holds cannot be compared with it); raise where it does not, or
    where it holds no version of the job."""
    doubts = [f"node {n}: {why.text}" for n, why in sorted(stale.items())]
    doubts += [f"node {n}: {why}" for n, why in sorted(deleted_nodes.items())]
    doubts += [
        f"node {n}: it holds checkpoints but no identity record"
        for n, identity in sorted(identities.items())
        if identity is None and nodes[n].has_data and n not in stale
    ]
    if doubts:
        raise _no_stand_in(unusable, "; ".join(doubts))
    held = [
        v
        for n, e in nodes.items()
        if (identity := identities.get(n)) is not None and identity.token == history.token
        for v in e.held or ()
    ]
    if not held:
        raise _no_stand_in(unusable, f"it holds no versions of job {job_id!r}")


@dataclass(frozen=True)
class RejoinVerdict:
    """Whether an opening that could not reach a durable tier may claim it now that it can
    (:func:`judge_rejoin`)."""

    #: Why this run must never write to the tier; ``None``: it may claim it.
    refused: str | None = None
    #: The job record must be written (before anything else): the location lost it, holds a
    #: repaired one, or one older than what this run knows.
    write_record: bool = False
    #: What to tell the user at WARNING, if anything (the location was emptied).
    note: str | None = None


def judge_rejoin(
    job: Mapping[str, Any],
    deleted: Mapping[str, Any],
    *,
    job_id: str,
    here: str,
    token: str,
    revision: int,
    worlds: Spans,
    stored_world: int,
    opened_at: float,
    newest_writer: tuple[float, str] | None,
) -> RejoinVerdict:
    """Decide whether this run may claim a durable tier it could not reach when it opened.

    The checks the opening could not make there, made now, before anything is written: ``job``
    is what the tier says of the job (:func:`~tiercheck.engine.open.claim.read_job_facts`),
    ``deleted`` what its tombstone says (:func:`~tiercheck.guards.node.deletion_facts`); ``token``,
    ``revision``, ``worlds`` and ``stored_world`` are the incarnation and world-size history
    this run took from the nodes' memory; ``opened_at`` is when this run opened (seconds since
    the epoch), ``newest_writer`` the time and session of the newest writer generation in the
    tier (``None``: none).

    Refused (for good: the run goes on with its memory tiers alone): the job was deleted there
    by ``tiercheck rm-job``; a writer generation was claimed after this run opened (that opening
    is the newer one and keeps the job); the location holds another incarnation of the job
    (deleted and started anew there); its versions were saved by another number of ranks than
    this run's history says. Else it may claim it, writing the job record first where the
    location lost it, holds a repaired one, or one older than what this run knows.
    """
    state = job.get("state")
    if deleted.get("tombstone"):
        tokens = set(deleted.get("deleted") or ())
        if token in tokens or state != "found" or job.get("token") in tokens:
            return RejoinVerdict(
                refused=f"job {job_id!r} was deleted from {here} by `tiercheck rm-job` while "
                "this run could not reach it"
            )
    if newest_writer is not None and newest_writer[0] > opened_at:
        when, session = newest_writer
        return RejoinVerdict(
            refused=f"another opening of job {job_id!r} (session {session}) claimed {here} at "
            f"{made_at(when)}, after this run opened ({made_at(opened_at)}) and while it could "
            "not reach it: that opening is the newer one and keeps the job there"
        )
    if state == "found":
        if job.get("token") == token:
            return RejoinVerdict(write_record=revision > int(job.get("revision", 0)))
        if job.get("repaired"):
            # `tiercheck repair-job` wrote it with a new token: the incarnation is the one the
            # nodes' memory names (as an opening decides, see judge_opening).
            return RejoinVerdict(write_record=True)
        return RejoinVerdict(
            refused=f"{here} holds another run of job {job_id!r} (token "
            f"{str(job.get('token'))[:8]}), not the one this run's memory belongs to (token "
            f"{token[:8]}): the job was deleted or started anew there while this run could "
            "not reach it"
        )
    committed = list(job.get("committed") or ())
    if state == "legacy" and committed:
        newest = max(committed)
        size = int(job.get("world_size", stored_world))
        theirs = world_of(newest, parse_spans(job.get("worlds"), size), size)
        ours = world_of(newest, worlds, stored_world)
        if theirs != ours:
            return RejoinVerdict(
                refused=f"{here} holds versions of job {job_id!r} without a job record, the "
                f"newest ({newest}) saved by {theirs} ranks where this run's history says "
                f"{ours}: they are not known to be this run's"
            )
        return RejoinVerdict(write_record=True)
    return RejoinVerdict(
        write_record=True,
        note=f"the durable location {here} of job {job_id!r} holds nothing: it was emptied "
        "while this run could not reach it. Writing the job record again; the run's versions "
        "go there from now on.",
    )
