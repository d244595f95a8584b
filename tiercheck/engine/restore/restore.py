"""Restore: inventory, agree, fetch; nothing stored is changed.

Every rank inventories what it can rebuild from each tier (:meth:`Restorer._inventory`); the
ranks exchange inventories (:meth:`Restorer.agree`). Only when some version can be restored is
the caller's state asked for (so that nothing of the caller's runs on a fresh start); then the
ranks agree on the newest version every one of them can rebuild
(:func:`~tiercheck.consistency.recovery.agree`); each rank reads it from its fastest tier
(:class:`~tiercheck.engine.restore.read.Reader`) and checks it against the caller's state; the ranks
exchange verdicts, and a version that failed anywhere is passed over for the next older one.
Once the chosen version is whole on every rank, a pure step (:func:`restore_outcome`; a fresh
start's, :func:`fresh_outcome`) computes the :class:`RestoreOutcome` from what the ranks agreed:
what each tier counts as committed (the memory tiers' versions every rank holds adopted, the
manifest told), where the schedule restarts, and where the run goes on from
(:class:`~tiercheck.engine.restore.timeline.Continuation`: newer versions leave the timeline at the
next save, set aside in durable tiers, never deleted by a restore). :meth:`Restorer.apply`, the one
place that applies it, hands each part to the object that owns it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tiercheck.codec import RawState
from tiercheck.codec.decode.assembled import Resharded
from tiercheck.codec.decode.statetree import load_into
from tiercheck.codec.encode.plan import paused_gc
from tiercheck.codec.reshard.boxes import Target
from tiercheck.consistency.protocol import (
    InventoryReport,
    Outcome,
    RestoreVerdict,
    Step,
    whole_in_tier,
)
from tiercheck.consistency.recovery import Inventory, agree, candidates
from tiercheck.engine.collectives import Channels, step
from tiercheck.engine.commit.tier import commit_versions
from tiercheck.engine.open.claim import Claim
from tiercheck.engine.options import Options
from tiercheck.engine.part import RankPart
from tiercheck.engine.restore.elastic import ElasticReader, targets_in
from tiercheck.engine.restore.inplace import Direct, rebuild, write_round
from tiercheck.engine.restore.timeline import Continuation
from tiercheck.engine.results import Restored
from tiercheck.errors import (
    FormatError,
    ReshardError,
    RestoreError,
    ShardsInconsistent,
    StatefulError,
    StateMismatch,
    UnsupportedObject,
)

if TYPE_CHECKING:
    from tiercheck.engine.commit.tier import TierPipeline
    from tiercheck.engine.restore.read import Reader
    from tiercheck.engine.restore.timeline import Timeline
    from tiercheck.engine.save.encode import Encoder
    from tiercheck.engine.save.schedule import Schedule

__all__ = [
    "Agreement",
    "RestoreOutcome",
    "Restorer",
    "TierAdoption",
    "TierView",
    "all_loaded",
    "fresh_outcome",
    "rebuild",
    "rejection_report",
    "restore_outcome",
]

logger = logging.getLogger("tiercheck")

#: The errors a rank's refusal is raised as on every rank, by the name it travels under.
_REFUSALS: dict[str, type[Exception]] = {
    "StateMismatch": StateMismatch,
    "UnsupportedObject": UnsupportedObject,
    "ReshardError": ReshardError,
    "StatefulError": StatefulError,
}


@dataclass(frozen=True)
class Agreement:
    """What every rank knows once the inventories are exchanged: the versions every rank can
    rebuild (:func:`~tiercheck.consistency.recovery.candidates`), of which the restore tries
    the newest first. Made by :meth:`Restorer.agree`; the caller's state is asked for only
    once there is one (see :meth:`tiercheck.Checkpointer.restore`)."""

    mine: Inventory
    everyone: tuple[Inventory, ...]
    #: The tiers some rank could not list, and why (reported with any refusal).
    unlisted: tuple[str, ...]
    #: The version asked for, or ``None`` for the newest every rank can rebuild.
    version: int | None


def rejection_report(job_id: str, rejected: Mapping[int, list[str]], unlisted: list[str]) -> str:
    """The :class:`~tiercheck.errors.RestoreError` message when no version could be restored:
    why each was rejected, on which rank."""
    lines = [
        f"no version of job {job_id!r} could be restored; nothing was deleted "
        "(blobs that failed verification were set aside under quarantine/). Why each "
        "version was rejected:"
    ]
    for version in sorted(rejected, reverse=True):
        lines.append(f"  version {version}:")
        lines.extend(f"    {reason}" for reason in rejected[version])
    lines.extend(f"  {line}" for line in unlisted)
    lines.append("Run `tiercheck verify` on the locations for details.")
    return "\n".join(lines)


@dataclass(frozen=True)
class TierAdoption:
    """What one tier's pipeline takes on from a restore
    (:meth:`~tiercheck.engine.commit.tier.TierPipeline.adopt`)."""

    name: str
    #: Replaces what the tier counts as committed (a durable tier this rank listed: every
    #: version up to the restored one with a ``COMMIT`` record, another world's too, so that
    #: retention keeps the newest ``keep`` of them all); ``None``: unchanged.
    committed: frozenset[int] | None
    #: Versions committed too, in order (a memory tier's versions every rank holds whole that
    #: the manifest missed: a crash between a commit and its manifest line); the manifest is
    #: told.
    adopted: tuple[int, ...]


@dataclass(frozen=True)
class TierView:
    """What the pure step (:func:`restore_outcome`) needs to know of one tier, for this rank."""

    name: str
    durable: bool
    #: This rank could not list the tier for the restore.
    unlisted: bool
    #: The versions of this rank's blobs in the tier.
    own: frozenset[int]
    #: The versions the tier counts as committed now.
    committed: frozenset[int]
    #: A durable tier's versions with ``COMMIT`` records, as the inventory listed them.
    listed: frozenset[int] = frozenset()


@dataclass(frozen=True)
class RestoreOutcome:
    """What a restore (or a fresh start) leaves the engine to apply, in one place
    (:meth:`Restorer.apply`): made by :func:`restore_outcome` or :func:`fresh_outcome`."""

    #: The restored version; ``None`` when nothing was restored (a fresh start).
    version: int | None
    #: The tier this rank read from, and the one every rank read from, by rank.
    source_tier: str | None
    source_tiers: Mapping[int, str]
    #: How many ranks saved the version.
    saved_by: int
    #: Newer versions passed over, and why (by version: one line per rank).
    rejected: Mapping[int, tuple[str, ...]]
    #: What each tier's pipeline adopts, in pipeline order.
    tiers: tuple[TierAdoption, ...]
    #: The schedule restarts after this version (the next save a base, newer than it);
    #: ``None``: the session only starts (the first save checks what is stored).
    restart_from: int | None
    #: Where the run goes on from, for the timeline to settle at the next save (versions after
    #: it set aside); ``None``: nothing to settle.
    continuation: Continuation | None

    def restored(self, state: Any, seconds: float) -> Restored:
        """The caller's result of the restore, with the rebuilt ``state``."""
        assert self.version is not None
        assert self.source_tier is not None
        return Restored(
            version=self.version,
            state=state,
            source_tier=self.source_tier,
            source_tiers=self.source_tiers,
            seconds=seconds,
            rejected=self.rejected,
            saved_by=self.saved_by,
        )


def restore_outcome(
    *,
    chosen: int,
    requested: int | None,
    source: str,
    sources: Sequence[str | None],
    rejected: Mapping[int, Sequence[str]],
    saved_by: int,
    tiers: Sequence[TierView],
    everyone: Sequence[Inventory],
) -> RestoreOutcome:
    """The outcome of restoring ``chosen``, whole on every rank (pure: nothing is changed).

    ``requested``: the version asked for, or ``None`` (the newest every rank could restore);
    ``source``: the tier this rank read from, ``sources`` every rank's by rank; ``rejected``:
    why newer versions were passed over; ``saved_by``: how many ranks saved ``chosen``;
    ``tiers``: this rank's view of each tier, in pipeline order; ``everyone``: the inventories
    the ranks exchanged.
    """
    adoptions = []
    for tier in tiers:
        if tier.durable:
            committed = None if tier.unlisted else frozenset(v for v in tier.listed if v <= chosen)
            adoptions.append(TierAdoption(tier.name, committed, ()))
        else:
            # A memory tier's commits live in the node's manifest, written just after the
            # commit: a crash in between leaves a version whole in the tier (every rank's blob
            # there, each put atomic) that the manifest does not know, and retention would
            # take it for a failed save's leftover and delete it, the restored version
            # included. The inventories every rank exchanged show what is whole: adopt it.
            whole = whole_in_tier(tier.name, tier.own, everyone)
            adopted = tuple(sorted(v for v in whole - tier.committed if v <= chosen))
            adoptions.append(TierAdoption(tier.name, None, adopted))
    if requested is not None:
        reason = f"the run went back to version {chosen}"
    elif rejected:
        reason = f"versions {sorted(rejected)} could not be restored"
    else:
        reason = f"the run went on from version {chosen}, the newest every rank could restore"
    return RestoreOutcome(
        version=chosen,
        source_tier=source,
        source_tiers={r: s or "" for r, s in enumerate(sources)},
        saved_by=saved_by,
        rejected={v: tuple(lines) for v, lines in rejected.items()},
        tiers=tuple(adoptions),
        restart_from=chosen,
        continuation=Continuation(
            chosen,
            reason,
            newer_durable=any(
                t.durable and (t.unlisted or any(v > chosen for v in t.listed)) for t in tiers
            ),
        ),
    )


def fresh_outcome(*, torn: bool) -> RestoreOutcome:
    """The outcome of a fresh start (nothing any rank could restore); ``torn``: only pieces of
    saves that never committed are stored, which the first save removes."""
    return RestoreOutcome(
        version=None,
        source_tier=None,
        source_tiers={},
        saved_by=0,
        rejected={},
        tiers=(),
        restart_from=None,
        continuation=(
            Continuation(-1, "pieces of saves that never committed, no whole version")
            if torn
            else None
        ),
    )


async def all_loaded(channels: Channels, error: str | None) -> None:
    """After a restore, every rank says whether its ``load_state_dict`` calls succeeded
    (``error``: why this rank's failed).

    A Stateful object that refuses its value on one rank must not leave the other ranks
    training on: each rank whose own loading went well raises
    :class:`~tiercheck.errors.StatefulError` naming the ranks that failed (a rank that
    failed raises its own error).
    """
    said = await step(channels, Step.LOADED, Outcome(error))
    failed = [(r, e.error) for r, e in enumerate(said) if e.error is not None]
    if failed and error is None:
        rank, text = failed[0]
        raise StatefulError(
            f"the restore failed on ranks {[r for r, _ in failed]} (rank {rank}: {text}); "
            "this rank restored its part, but the job cannot go on from a partial state"
        )


class Restorer(RankPart):
    """The collective restore of one rank, in two steps: :meth:`agree` (what can be restored,
    if anything), then :meth:`restore` (read, check, copy in). Neither changes anything
    stored: what the run gives up by going on from the restored version is settled by its
    next save (:class:`~tiercheck.engine.restore.timeline.Timeline`)."""

    def __init__(
        self,
        options: Options,
        claim: Claim,
        channels: Channels,
        *,
        pipes: Mapping[str, TierPipeline],
        reader: Reader,
        elastic: ElasticReader,
        schedule: Schedule,
        encoder: Encoder,
        timeline: Timeline,
    ) -> None:
        super().__init__(options, claim, pipes)
        self.channels = channels
        self.reader = reader
        self.elastic = elastic
        self.schedule = schedule
        self.encoder = encoder
        self.timeline = timeline
        # The versions with COMMIT records in each durable tier, as the inventory listed them.
        self._listed: dict[str, set[int]] = {}

    async def agree(self, version: int | None) -> Agreement | None:
        """Exchange inventories; ``None`` when nothing is stored that any rank could restore
        (a fresh start), else what the ranks agree can be tried. Raises
        :class:`~tiercheck.errors.RestoreError` (every rank alike) when ``version`` cannot be
        rebuilt by every rank, or when versions are stored but none can be restored here."""
        mine, errors = await self._inventory()
        gathered = await step(self.channels, Step.INVENTORY, InventoryReport.of(mine, errors))
        everyone = tuple(report.inventory(r) for r, report in enumerate(gathered))
        unlisted = tuple(
            f"rank {r} cannot list the {tier!r} tier: {msg}"
            for r, report in enumerate(gathered)
            for tier, msg in sorted(report.errors.items())
        )
        possible = candidates(everyone)
        if version is not None and version not in possible:
            raise RestoreError(
                f"version {version} of job {self.job_id!r} cannot be restored: not every "
                f"rank can rebuild it from any tier. The versions every rank can rebuild: "
                f"{sorted(possible) or 'none'}; rank {self.rank} holds "
                f"{sorted(mine.versions()) or 'none'}. Nothing was changed."
                + ("".join(f"; {line}" for line in unlisted))
            )
        if possible:
            return Agreement(mine, everyone, unlisted, version)
        claim = self.claim
        if claim.world_changed:
            # Starting afresh here would file this world's saves under the old world's
            # history; what the old world left stays as it is.
            raise RestoreError(
                f"job {self.job_id!r} was saved by {claim.stored_world} ranks and "
                f"stores no version every one of this run's {self.topo.world_size} "
                "ranks can rebuild resharded (each needs every old rank's blob of it in one "
                "tier). Nothing was deleted. Restart with "
                f"{claim.stored_world} ranks, or use another job_id."
                + ("".join(f"; {line}" for line in unlisted))
            )
        if unlisted:
            raise RestoreError(
                f"cannot tell what job {self.job_id!r} stores, so nothing is restored "
                "and nothing is deleted:\n  " + "\n  ".join(unlisted)
            )
        if any(inv.versions() for inv in everyone):
            # Only torn versions: blobs of saves that no tier holds whole for every rank,
            # hence never committed anywhere. The first save removes them, or it could be
            # combined with them.
            logger.warning(
                "tiercheck: job %r stores no whole version, only pieces of saves that never "
                "committed (%s); the first save removes them",
                self.job_id,
                sorted(mine.versions()),
            )
            self.apply(fresh_outcome(torn=True))
        else:
            self.apply(fresh_outcome(torn=False))
        return None

    async def restore(
        self,
        agreement: Agreement,
        state: Any,
        strict: bool,
        started: float,
        *,
        failed: Exception | None = None,
    ) -> Restored:
        """Restore the version ``agreement`` leads to (see
        :meth:`tiercheck.Checkpointer.restore`). The saves in flight are done already.
        ``failed``: this rank has no target (making it raised that); every rank raises at the
        first exchange: the same error where it is a refusal of the state
        (:class:`~tiercheck.errors.UnsupportedObject`, ...), else
        :class:`~tiercheck.errors.StatefulError`."""
        mine, everyone, unlisted = agreement.mine, agreement.everyone, list(agreement.unlisted)
        version = agreement.version
        rejected: dict[int, list[str]] = {}
        excluded: set[int] = set()
        targets: dict[str, Target] | None = None
        while True:
            refusal: tuple[str, str] | None = None
            chosen = (
                version if version is not None else agree(everyone, excluded=frozenset(excluded))
            )
            if chosen is None:
                raise RestoreError(rejection_report(self.job_id, rejected, unlisted))
            raw: RawState | Resharded | Direct | None
            reasons: list[str]
            if failed is not None:
                raw, source, reasons = None, None, []
            elif self.claim.world_of(chosen) == self.topo.world_size:
                raw, source, reasons = await self.reader.fetch(
                    chosen, mine, direct=state is not None and strict
                )
            else:
                try:
                    if targets is None:
                        targets = await asyncio.to_thread(targets_in, state)
                    raw, source, reasons = await self.elastic.fetch(chosen, mine, targets)
                except ShardsInconsistent as exc:
                    # The blobs of this version do not make one save: no world can use it.
                    raw, source, reasons = None, None, [f"{type(exc).__name__}: {exc}"]
                except ReshardError as exc:
                    raw, source, reasons = None, None, []
                    refusal = ("ReshardError", str(exc))
            rebuilt: Any = None
            written: Any = None
            if failed is not None:
                kind = type(failed).__name__
                refusal = (
                    (kind, str(failed))
                    if kind in _REFUSALS
                    else (
                        "StatefulError",
                        f"building the state to restore into failed: {kind}: {failed}",
                    )
                )
                raw = None
            if raw is not None:
                try:
                    with paused_gc():  # tens of thousands of short-lived objects: see there
                        rebuilt = rebuild(
                            raw, state, strict, allow_pickle=self.options.encode.allow_pickle
                        )
                except StateMismatch as exc:
                    refusal = ("StateMismatch", str(exc))
                except UnsupportedObject as exc:
                    refusal = ("UnsupportedObject", str(exc))
                except FormatError as exc:
                    reasons.append(f"{source}: {type(exc).__name__}: {exc}")
                    raw = None
            direct = isinstance(raw, Direct)
            said = RestoreVerdict(raw is not None, source, tuple(reasons), refusal, direct)
            verdicts = await step(self.channels, Step.VERDICT, said)
            refusals = [(r, v.refusal) for r, v in enumerate(verdicts) if v.refusal is not None]
            if refusals:
                # The caller's state (or options) cannot take the version: nothing was
                # written into it, and nothing stored is removed.
                kind, text = refusals[0][1]
                ranks = [r for r, _ in refusals]
                message = f"rank {refusals[0][0]} (of ranks {ranks} refusing): {text}"
                raise _REFUSALS.get(kind, UnsupportedObject)(message)
            if all(v.ok for v in verdicts) and any(v.direct for v in verdicts):
                verdicts, written, source = await write_round(
                    self, raw, mine, state, rebuilt, source=source
                )
            if all(v.ok for v in verdicts):
                break
            for r, v in enumerate(verdicts):
                if not v.ok:
                    rejected.setdefault(chosen, []).extend(
                        f"rank {r}: {reason}" for reason in v.reasons
                    )
            bad = [r for r, v in enumerate(verdicts) if not v.ok]
            if version is not None:
                raise RestoreError(
                    f"version {version} failed verification on ranks {bad}; nothing was "
                    "deleted.\n" + rejection_report(self.job_id, rejected, unlisted)
                )
            logger.warning(
                "tiercheck: version %s failed verification on ranks %s; trying older", chosen, bad
            )
            excluded.add(chosen)
        assert raw is not None
        assert source is not None
        # The version is whole on every rank: from here on, the run continues from it.
        if written is not None:
            rebuilt = written
        elif state is not None:
            # rebuild() checked this state against this version, and the caller is waiting for
            # restore to return: copy without walking it a second time.
            with paused_gc():
                rebuilt = load_into(state, rebuilt, strict=strict, checked=True)
        old_world = self.claim.world_of(chosen)
        if old_world != self.topo.world_size:
            logger.info(
                "tiercheck: restored version %s of job %r saved by %s ranks onto %s ranks",
                chosen,
                self.job_id,
                old_world,
                self.topo.world_size,
            )
        outcome = restore_outcome(
            chosen=chosen,
            requested=version,
            source=source,
            sources=[v.source for v in verdicts],
            rejected=rejected,
            saved_by=old_world,
            tiers=[
                TierView(
                    pipe.name,
                    pipe.durable,
                    pipe.unlisted,
                    frozenset(pipe.own),
                    frozenset(pipe.committed),
                    frozenset(self._listed.get(pipe.name, ())),
                )
                for pipe in self.pipes.values()
            ],
            everyone=everyone,
        )
        self.apply(outcome)
        return outcome.restored(rebuilt, time.perf_counter() - started)

    def apply(self, outcome: RestoreOutcome) -> None:
        """The one place a restore's outcome changes the engine: each tier's pipeline adopts
        what it holds committed, the schedule (re)starts, the held base goes (after a
        restore), and the timeline learns where the run goes on from."""
        for adoption in outcome.tiers:
            self.pipes[adoption.name].adopt(committed=adoption.committed, adopted=adoption.adopted)
        for pipe in self.pipes.values():
            if outcome.version is not None:
                pipe.ready_after(outcome.version)
        if outcome.restart_from is not None:
            self.schedule.restart_from(outcome.restart_from)
            self.encoder.drop_base()
        else:
            self.schedule.begin_session()
        if outcome.continuation is not None:
            self.timeline.continue_from(outcome.continuation)

    async def _inventory(self) -> tuple[Inventory, dict[str, str]]:
        """What this rank can rebuild, per tier, and the tiers it could not list (and why)."""
        by_tier: dict[str, frozenset[int]] = {}
        errors: dict[str, str] = {}
        world = self.topo.world_size
        elastic = self.options.job.elastic
        for pipe in self.pipes.values():
            unreachable = self.claim.pending.get(pipe.name)
            if unreachable is not None:
                # Warned about at opening; listing it would only wait out its retries.
                errors[pipe.name] = f"unreachable since the job opened: {unreachable}"
                pipe.listed(False)
                by_tier[pipe.name] = frozenset()
                continue
            try:
                await pipe.relist()
                if pipe.durable:
                    listed = self._listed[pipe.name] = await commit_versions(pipe.tier)
                    versions = {v for v in listed if self.claim.world_of(v) == world}
                else:
                    listed = None
                    versions = set(pipe.own)  # this world's versions only
                if elastic:
                    versions |= await self.elastic.servable(pipe, listed)
            except Exception as exc:
                logger.warning("tiercheck: cannot list the %r tier for restore: %r", pipe.name, exc)
                errors[pipe.name] = f"{type(exc).__name__}: {exc}"
                pipe.listed(False)
                versions = set()
            else:
                pipe.listed(True)
            by_tier[pipe.name] = frozenset(versions)
        return Inventory(self.rank, by_tier), errors
