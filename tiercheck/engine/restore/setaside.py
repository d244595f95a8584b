"""Setting versions aside, whole, in one durable tier: the protocol of a going back.

:func:`set_aside` is collective (every rank, the same steps on one channel): the committed
versions after the restored one are copied into an abandoned set
(:mod:`tiercheck.consistency.abandoned`) -- every rank its blobs, then rank 0 their ``COMMIT``
records and the set's ``SET`` record --, then rank 0 removes the originals' ``COMMIT`` records,
and only then does every rank remove its blobs after the restored version. A death at any point
leaves each version whole where it was or in its set (at most a set without its ``SET``:
copies). :class:`~tiercheck.engine.restore.timeline.Timeline` decides when it runs.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tiercheck.consistency.abandoned import (
    AbandonedSet,
    SetInfo,
    abandoned_key,
    set_record_key,
    set_tag,
)
from tiercheck.consistency.commit import CommitRecord
from tiercheck.consistency.keys import commit_key
from tiercheck.consistency.protocol import Outcome, SetAsideCompletion, SetAsideListing, Step
from tiercheck.engine.collectives import Channels, step
from tiercheck.engine.open.claim import Claim
from tiercheck.engine.stored import commit_versions
from tiercheck.errors import BlobNotFound, FormatError
from tiercheck.tiers.base import copy_blob

if TYPE_CHECKING:
    from tiercheck.engine.commit.tier import TierPipeline

__all__ = ["Continuation", "SetAsideFailed", "set_aside"]

logger = logging.getLogger("tiercheck")


@dataclass(frozen=True, slots=True)
class SetAsideFailed:
    """Where :func:`set_aside` stopped (every rank alike): nothing of it is lost."""

    #: The part of the protocol that failed ("listing it", "copying blobs", ...).
    step: str
    #: Where each version is now.
    kept: str
    #: Each rank's error, by rank (``None``: that rank's part worked).
    errors: list[str | None]

    def first(self) -> tuple[int, str]:
        """The first rank that failed, and its error."""
        return next((r, e) for r, e in enumerate(self.errors) if e is not None)


def _failure(errors: list[str | None], step: str, kept: str) -> SetAsideFailed | None:
    return SetAsideFailed(step, kept, errors) if any(e is not None for e in errors) else None


@dataclass(frozen=True, slots=True)
class Continuation:
    """What a restore leaves for the first save after it: the run goes on from ``version``
    (see :class:`~tiercheck.engine.restore.timeline.Timeline`)."""

    #: The restored version; ``-1`` when nothing whole was stored (the run starts over).
    version: int
    #: Why the versions after it leave the timeline (logged, and kept in the ``SET`` record).
    reason: str
    #: Whether a durable tier holds committed versions after it, or may (one could not be
    #: listed): the run goes back from them, and its first save waits until they are set
    #: aside (:meth:`Timeline.settle <tiercheck.engine.restore.timeline.Timeline.settle>`).
    newer_durable: bool = False


async def set_aside(
    pipe: TierPipeline, c: Continuation, claim: Claim, channels: Channels, channel: str
) -> SetAsideFailed | None:
    """Collective, in one durable tier: set the committed versions after ``c.version`` aside
    as a whole abandoned set, then remove them (and uncommitted pieces) from the run's
    timeline. On any rank's failure nothing is removed: where it stopped, for every rank."""
    tier = pipe.tier
    rank = claim.rank
    first = c.version + 1
    if pipe.unlisted and not claim.superseded:
        # Its listing failed (at opening, or when it was claimed after an outage): try
        # again, or what this rank holds there is not known.
        await pipe.load()
    mine = pipe.keys_from(first)
    committed: list[int] = []
    error: str | None = None
    if claim.superseded:
        error = "a newer opening of the job owns the tier"
    elif pipe.unlisted:
        error = "this rank cannot list the tier"
    elif rank == 0:
        try:
            committed = sorted(v for v in await commit_versions(tier) if v >= first)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
    listed = await step(
        channels, Step.SET_ASIDE_LIST, SetAsideListing(committed, error), channel=channel
    )
    committed = list(listed[0].committed)
    failed = _failure([e.error for e in listed], "listing it", "nothing was removed")
    if failed is not None:
        return failed
    tag = set_tag(first, channels.session)
    if committed:
        # 1. Every rank copies its blobs of the committed versions into the set.
        error = None
        try:
            for version in committed:
                for key in mine.get(version, ()):
                    await claim.check(tier)
                    await copy_blob(tier, key, abandoned_key(tag, key))
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        copied = await step(channels, Step.SET_ASIDE_COPY, Outcome(error), channel=channel)
        failed = _failure([e.error for e in copied], "copying blobs", "nothing was removed")
        if failed is not None:
            return failed
        # 2. Rank 0 completes the set (COMMIT records, then SET) and only then takes the
        #    versions off the timeline by removing their COMMIT records.
        error = None
        needs: list[int] = []
        held: list[int] = list(committed)
        if rank == 0:
            try:
                held, needs = await _complete_set(
                    pipe, tag, c, committed, claim=claim, channels=channels
                )
                for version in committed:
                    await claim.check(tier)
                    await tier.delete(commit_key(version))
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
        completed = await step(
            channels,
            Step.SET_ASIDE_COMPLETE,
            SetAsideCompletion(error, needs, held),
            channel=channel,
        )
        info = SetInfo(first, frozenset(completed[0].held), frozenset(completed[0].needs))
        kept = f"each of versions {committed} is whole where it was or in abandoned/{tag}/"
        failed = _failure([e.error for e in completed], "completing the set", kept)
        if failed is not None:
            return failed
        logger.warning(
            "tiercheck: versions %s of job %r left its timeline (%s); they are kept in the %r "
            "tier under abandoned/%s/ (`tiercheck ls` lists them) until the run has %s "
            "committed versions of its own there, or `tiercheck gc --abandoned`",
            committed,
            claim.job_id,
            c.reason,
            pipe.name,
            tag,
            pipe.policy.keep,
        )
        pipe.note_abandoned(tag, info)
    # 3. Every rank removes its blobs after the restored version: copies of them are in
    #    the set, or they never committed. Whether that worked is agreed too: rank 0 lists the
    #    tier for it and the others may not need to, and a rank that counted the tier settled
    #    while another did not would make the next attempt's exchanges alone (chaos soak seed
    #    6108: rank 0 blocked for good, its retries waiting on a rank that had moved on).
    error = None
    try:
        await pipe.truncate_from(first, f"abandoned: {c.reason}")
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    removed = await step(channels, Step.SET_ASIDE_REMOVE, Outcome(error), channel=channel)
    return _failure(
        [e.error for e in removed],
        "removing the versions after it",
        "each version is whole where it was or in its abandoned set",
    )


async def _complete_set(
    pipe: TierPipeline,
    tag: str,
    c: Continuation,
    committed: list[int],
    *,
    claim: Claim,
    channels: Channels,
) -> tuple[list[int], list[int]]:
    """Rank 0: the ``COMMIT`` records into the set, then its ``SET`` record (merged with one
    an earlier, interrupted attempt of this opening wrote). Returns the versions the set
    holds and those outside it that its deltas are encoded against (retention keeps them
    while the set stays)."""
    tier = pipe.tier
    for version in committed:
        await claim.check(tier)
        await copy_blob(tier, commit_key(version), abandoned_key(tag, commit_key(version)))
    versions = set(committed)
    try:
        earlier = AbandonedSet.from_bytes(bytes(await tier.get(set_record_key(tag))))
        versions.update(earlier.versions)
    except (BlobNotFound, FormatError):
        pass  # the first attempt (or an unreadable one, replaced)
    record = AbandonedSet(
        job_id=claim.job_id,
        restored=c.version,
        versions=tuple(sorted(versions)),
        session=channels.session,
        time=time.time(),
        reason=c.reason,
    )
    needs: set[int] = set()
    for version in versions:
        commit = CommitRecord.from_bytes(
            bytes(await tier.get(abandoned_key(tag, commit_key(version))))
        )
        needs.update(e.base for e in commit.entries if e.base is not None)
    await claim.check(tier)
    await tier.put(set_record_key(tag), record.to_bytes())
    return sorted(versions), sorted(needs - versions)
