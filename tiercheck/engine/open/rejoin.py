"""A durable tier the job could not reach when it opened: tried again, checked, then claimed.

When a durable tier cannot be reached at opening and the nodes' memory holds versions this run
can verify as its own (:func:`~tiercheck.engine.open.judgement.judge_opening`), the job opens on its
memory: the tier is *pending* (:attr:`Claim.pending <tiercheck.engine.open.claim.Claim.pending>`),
nothing of this opening is written there (its pipeline is blocked, ``Claim.check`` refuses),
restore reads from the memory tiers, and saves go there. :class:`Rejoin` gets the tier back:

1. **Probe, in the background.** Each rank writes, reads back and deletes a small object
   (:func:`~tiercheck.guards.node.probe`) until that works: first after ``durable_retry_delay``
   seconds, each wait twice the one before, at most ``durable_retry_max``, with jitter (many
   ranks do not retry in lockstep). No exchange: each rank learns alone that it reaches it.
2. **Agree, at the start of a save** (:meth:`Rejoin.settle`; every rank saves the same
   versions in the same order, so every rank takes these steps alike): every rank says which
   pending tiers it reached (step ``REACHED``). A tier every rank reached is claimed now; the
   others wait for a later save. While a tier is pending this exchange is the only cost a save
   pays (one small all-gather on the "control" channel).
3. **Check, then claim: rank 0**, before anything is written there. What the opening could not
   check is checked now (:func:`~tiercheck.engine.open.judgement.judge_rejoin`): the tombstone of
   ``tiercheck rm-job``, the newest writer generation (one claimed after this run opened is a
   newer opening's, which keeps the job), the job record (another incarnation's means this
   run's memory is not its). Then the job record is written where it is missing or behind, and
   a writer generation is claimed (:meth:`~tiercheck.guards.node.Fence.claim`), as an opening does.
   Every rank learns the outcome (step ``REJOIN``) and applies it alike.
4. **Take versions.** Each rank lists the tier (what it holds, what is committed there), the
   timeline first sets aside what the restore left owed there (versions after the restored one,
   :meth:`~tiercheck.engine.restore.timeline.Timeline.rejoined`), and the tier takes versions from
   this save on -- newest first where it fell behind (:func:`~tiercheck.engine.save.plan.catch_up`).
   A refused tier is never written by this opening (it counts as superseded there: ERROR logged,
   ``stats.superseded``); a claim that failed because the tier went away again goes back to 1.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from tiercheck.consistency.protocol import Reached, Rejoined, Step
from tiercheck.engine.collectives import Channels, step
from tiercheck.engine.open.claim import Claim, read_job_facts
from tiercheck.engine.open.judgement import judge_rejoin
from tiercheck.engine.open.leftovers import sweep_leftovers
from tiercheck.engine.options import Options
from tiercheck.engine.part import RankPart
from tiercheck.engine.stored import location
from tiercheck.errors import FormatError, StorageError, TiercheckError
from tiercheck.guards import Fence, deletion_facts, probe, write_job_record

if TYPE_CHECKING:
    from tiercheck.engine.commit.tier import TierPipeline
    from tiercheck.engine.restore.timeline import Timeline

__all__ = ["Rejoin"]

logger = logging.getLogger("tiercheck")


class Rejoin(RankPart):
    """Gets back the durable tiers this opening could not reach (see the module docstring)."""

    def __init__(
        self,
        options: Options,
        claim: Claim,
        channels: Channels,
        pipes: Mapping[str, TierPipeline],
        timeline: Timeline,
    ) -> None:
        super().__init__(options, claim, pipes)
        self.channels = channels
        self.timeline = timeline
        # Pending tiers this rank's probe reached since it last failed to claim them.
        self._reached: set[str] = set()
        self._probes: dict[str, asyncio.Task[None]] = {}
        # Pending tiers whose claim failed since they were last reached, logged once each.
        self._claim_failed: set[str] = set()

    def holds_back(self, pipe: TierPipeline) -> bool:
        """At opening, for each tier's pipeline: whether it is pending -- then it is not listed
        (it cannot be reached) and takes no versions before it is claimed (blocked)."""
        why = self.claim.pending.get(pipe.name)
        if why is None:
            return False
        pipe.listed(False)
        pipe.block(
            f"it could not be reached when the job opened ({why}); it is tried again in the "
            "background",
            announced=True,
        )
        return True

    def start(self) -> None:
        """Once the job is open: probe every pending tier in the background."""
        for name in sorted(self.claim.pending):
            self._probe(name)

    def stop(self) -> None:
        """Closing: stop probing."""
        for task in self._probes.values():
            task.cancel()
        self._probes.clear()

    def _probe(self, name: str) -> None:
        running = self._probes.get(name)
        if running is None or running.done():
            self._probes[name] = asyncio.create_task(
                self._probe_until_reached(name), name=f"tiercheck-rejoin-{name}"
            )

    async def _probe_until_reached(self, name: str) -> None:
        """Step 1: probe ``name`` with bounded, jittered, doubling waits until it works."""
        cfg = self.options.coordination
        tier = self.pipes[name].tier
        delay = cfg.durable_retry_delay
        try:
            while name in self.claim.pending:
                await asyncio.sleep(random.uniform(delay / 2, delay))
                try:
                    await probe(tier, self.channels.session, self.rank)
                except (TiercheckError, OSError) as exc:
                    self.claim.stats.unreachable[name] = str(exc)
                    logger.debug("tiercheck: the %r tier is still unreachable: %s", name, exc)
                    delay = min(delay * 2, cfg.durable_retry_max)
                    continue
                logger.debug("tiercheck: rank %s reaches the %r tier again", self.rank, name)
                self._reached.add(name)
                return
        except asyncio.CancelledError:
            raise
        except Exception:
            # A bug, not an outage: the tier stays pending (never written), and says so.
            logger.exception("tiercheck: probing the %r tier failed", name)

    async def settle(self) -> None:
        """At the start of every save, on every rank in the same order (steps 2 to 4): claim
        the pending tiers every rank reaches. Never raises for a tier's failure; an exchange
        with the other ranks that fails raises as any save's does."""
        pending = sorted(self.claim.pending)
        if not pending:
            return
        mine = Reached(tuple(name for name in pending if name in self._reached))
        said = await step(self.channels, Step.REACHED, mine)
        ready = [name for name in pending if all(name in s.tiers for s in said)]
        if not ready:
            return
        outcome = await self._check_and_claim(ready) if self.rank == 0 else Rejoined()
        decided = (await step(self.channels, Step.REJOIN, outcome))[0]
        for name in ready:
            await self._apply(name, decided)

    async def _apply(self, name: str, decided: Rejoined) -> None:
        """Step 4, on every rank alike: what rank 0 decided for the tier ``name``."""
        pipe = self.pipes[name]
        if name in decided.generations:
            generation = decided.generations[name]
            self.claim.rejoined(pipe.tier, generation)
            self._claim_failed.discard(name)
            if self.options.job.topology.local_rank == 0:
                # As at opening: what killed writers left there can go now.
                await sweep_leftovers([pipe.tier], self.channels.session)
            await pipe.load()
            logger.warning(
                "tiercheck: the durable %r tier of job %r is reachable again; this opening "
                "checked it and claimed it (writer generation %s): it takes versions again",
                name,
                self.claim.job_id,
                generation,
            )
            await self.timeline.rejoined(name)
        elif name in decided.refused:
            why = decided.refused[name]
            self.claim.refuse(pipe.tier, why)
            pipe.block(f"this run does not own it: {why}", announced=True)
            logger.error(
                "tiercheck: the durable %r tier of job %r is reachable again, but this run "
                "never writes there: %s. Its saves still go to the memory tiers; nothing there "
                "was changed.",
                name,
                self.claim.job_id,
                why,
            )
        else:
            why = decided.failed.get(name, "rank 0 did not say")
            self.claim.stats.unreachable[name] = why
            self._reached.discard(name)
            if name not in self._claim_failed:
                self._claim_failed.add(name)
                logger.warning(
                    "tiercheck: claiming the durable %r tier of job %r again failed (%s); it "
                    "is tried again in the background",
                    name,
                    self.claim.job_id,
                    why,
                )
            self._probe(name)

    async def _check_and_claim(self, names: Sequence[str]) -> Rejoined:
        """Step 3, rank 0: check each tier every rank reached, and claim the ones this run may
        write (nothing is written to one before it is checked)."""
        claim = self.claim
        generations: dict[str, int] = {}
        refused: dict[str, str] = {}
        failed: dict[str, str] = {}
        for name in names:
            tier = self.pipes[name].tier
            try:
                job = await read_job_facts([tier])
                deleted = await deletion_facts([tier])
                if "job_error" in deleted:
                    raise StorageError(str(deleted["job_error"]))
                fence = Fence(tier, self.channels.session)
                newest = await fence.newest_writer()
                verdict = judge_rejoin(
                    job,
                    deleted,
                    job_id=claim.job_id,
                    here=location(tier),
                    token=claim.job_token,
                    revision=claim.revision,
                    worlds=claim.worlds,
                    stored_world=claim.stored_world,
                    opened_at=claim.opened_at,
                    newest_writer=None if newest is None else (newest.time, newest.session),
                )
                if verdict.refused is not None:
                    refused[name] = verdict.refused
                    continue
                if verdict.note is not None:
                    logger.warning("tiercheck: %s", verdict.note)
                if verdict.write_record:
                    await write_job_record(tier, claim.job_record())
                generations[name] = await fence.claim()
            except FormatError as exc:
                refused[name] = (
                    f"what it says of the job cannot be read ({exc}); `tiercheck repair-job` "
                    "sets a damaged job record aside, and the next opening writes it anew"
                )
            except (TiercheckError, OSError) as exc:
                failed[name] = f"{type(exc).__name__}: {exc}"
            except Exception as exc:
                # Not the storage's doing: said (with its traceback), and the other ranks,
                # waiting for this rank's word, get it as for any failed claim.
                logger.exception("tiercheck: checking the %r tier failed", name)
                failed[name] = f"{type(exc).__name__}: {exc}"
        return Rejoined(generations, refused, failed)
