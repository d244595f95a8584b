"""The soak's oracle: what must hold after every fault, computed from the events the ranks
reported and from :class:`~tiercheck.testing.chaos.model.Reference` -- never from what the
checkpointer stored.

* **Training is never killed by storage**: a rank ends only when the driver signalled it, when a
  collective of the training failed because a peer was gone, or at the agreed end; a save never
  blocks training longer than ``stall_limit``; training never stops making progress.
* **Every restore is bit-exact**: every rank restores the same version, whose digest is the
  uninterrupted run's at that step (rank by rank).
* **No committed version is lost**: per tier, the newest version any rank's save handle reported
  committed there since the tier was last lost (:attr:`Oracle.known`); a restore after a fault
  must reach at least the newest such version among the tiers that survived it.
* **Commits resume**: after a transient fault, every tier reports a commit of a version newer
  than any it had committed when the fault ended, before the job saved K more.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from tiercheck.testing.chaos.catalog import TIERS
from tiercheck.testing.chaos.model import Reference

__all__ = ["Finding", "Oracle"]


class Finding(Exception):
    """An invariant that did not hold: ``check`` names it, the message says what was seen."""

    def __init__(self, check: str, message: str) -> None:
        super().__init__(f"[{check}] {message}")
        self.check = check
        self.message = message


@dataclass
class Restore:
    """What one rank reported about its restore."""

    rank: int
    version: int | None
    digest: str | None
    source: str | None


class Oracle:
    """The invariants, and what they are checked against."""

    def __init__(self, reference: Reference, *, stall_limit: float) -> None:
        self.reference = reference
        self.stall_limit = stall_limit
        #: The newest version reported committed per tier since the tier was last lost.
        self.known: dict[str, int | None] = dict.fromkeys(TIERS)
        #: Every commit report, in order: (tier, version).
        self.commits: list[tuple[str, int]] = []
        self.restores = 0
        #: The longest a save blocked training, less any time its own rank was stopped
        #: (SIGSTOP) meanwhile: a pause that lands inside a save is the fault, not a stall.
        self.max_stall = 0.0
        #: When each rank was stopped by the driver: rank -> [(began, ended)], wall time.
        self.stopped: dict[int, list[tuple[float, float]]] = {}
        #: What each rank's handle said about a version in a tier, in this incarnation:
        #: (tier, version) -> {rank: "commit" or "fail (why)"}.
        self.outcomes: dict[tuple[str, int], dict[int, str]] = {}

    def see(self, rank: int, event: dict[str, Any]) -> None:
        """Take one event of a rank into account (commits; saves that blocked too long)."""
        kind = event["e"]
        if kind in ("commit", "fail", "uncertain"):
            self._agree(rank, event)
        if kind == "commit":
            tier, version = event["tier"], int(event["v"])
            self.commits.append((tier, version))
            newest = self.known.get(tier)
            self.known[tier] = version if newest is None else max(newest, version)
        elif kind == "step":
            took, ended = float(event["stall"]), float(event.get("t", 0.0))
            stall = took - self._stopped_within(rank, ended - took, ended)
            self.max_stall = max(self.max_stall, stall)
            if stall > self.stall_limit:
                raise Finding(
                    "stalled",
                    f"rank {rank}'s save of version {event['v']} blocked training for "
                    f"{stall:.1f} s (limit {self.stall_limit} s)",
                )
        elif kind == "crashed":
            raise Finding(
                "killed-by-storage",
                f"rank {rank} crashed: {event['error']}\n{event.get('tb', '')}",
            )

    def was_stopped(self, rank: int, began: float, ended: float) -> None:
        """The driver stopped ``rank`` (SIGSTOP) from ``began`` to ``ended`` (wall time)."""
        self.stopped.setdefault(rank, []).append((began, ended))

    def _stopped_within(self, rank: int, start: float, end: float) -> float:
        """Seconds of ``[start, end]`` during which ``rank`` was stopped."""
        return sum(max(0.0, min(end, b) - max(start, a)) for a, b in self.stopped.get(rank, ()))

    def _agree(self, rank: int, event: dict[str, Any]) -> None:
        said = self.outcomes.setdefault((event["tier"], int(event["v"])), {})
        said[rank] = (
            event["e"] if event["e"] == "commit" else f"{event['e']} ({event.get('error')})"
        )

    def check_agreement(self) -> None:
        """A version is committed in a tier for every rank or for none: the handles of ranks
        that live on must agree (checked while no rank was killed: a rank killed in the middle
        of a round may have heard the outcome its survivors did not). A rank that lost the
        round's last exchange says ``uncertain``, which agrees with either."""
        for (tier, version), said in sorted(self.outcomes.items()):
            words = {word.split()[0] for word in said.values()} - {"uncertain"}
            if len(words) > 1:
                raise Finding(
                    "split-decision",
                    f"the ranks' handles disagree on version {version} in the {tier} tier: "
                    + "; ".join(f"rank {r}: {word[:300]}" for r, word in sorted(said.items())),
                )

    def new_incarnation(self) -> None:
        """Versions saved from now on are new saves (after a restore, the same numbers)."""
        self.outcomes.clear()

    def lose(self, tiers: Iterable[str]) -> None:
        """``tiers`` lost what they held (their committed versions no longer bind a restore)."""
        for tier in tiers:
            self.known[tier] = None

    def bound(self, survivors: Sequence[str]) -> tuple[int, str] | None:
        """The newest version committed in a tier of ``survivors``, and that tier."""
        found = [(v, t) for t in survivors if (v := self.known[t]) is not None]
        return max(found) if found else None

    def check_restore(
        self,
        restores: Sequence[Restore],
        survivors: Sequence[str],
        after: str,
        floor: tuple[int, str] | None = None,
    ) -> int | None:
        """Every rank restored the same version, bit-exact, at least the newest committed in a
        tier of ``survivors`` (and at least ``floor``, a version known to be whole, and where);
        returns that version (``None`` for a fresh start)."""
        versions = {r.version for r in restores}
        if len(versions) != 1:
            raise Finding(
                "inconsistent-restore",
                "ranks restored different versions after "
                f"{after}: {[(r.rank, r.version) for r in restores]}",
            )
        version = versions.pop()
        bound = max(filter(None, [self.bound(survivors), floor]), default=None)
        if version is None:
            if bound is not None:
                raise Finding(
                    "lost-committed",
                    f"after {after} the job started fresh, but version {bound[0]} was "
                    f"committed in the {bound[1]} tier, which survives it",
                )
            return None
        for r in restores:
            expected = self.reference.digest(version, r.rank)
            if r.digest != expected:
                raise Finding(
                    "not-bit-exact",
                    f"after {after} rank {r.rank} restored version {version} (from {r.source}) "
                    f"with digest {r.digest}; the uninterrupted run has {expected}",
                )
        if bound is not None and version < bound[0]:
            raise Finding(
                "lost-committed",
                f"after {after} the job restored version {version} (from "
                f"{sorted({r.source for r in restores if r.source})}), but version {bound[0]} "
                f"was committed in the {bound[1]} tier, which survives it",
            )
        self.restores += 1
        # Newer versions are off the timeline now (the first save after this sets them aside).
        for tier, newest in self.known.items():
            if newest is not None and newest > version:
                self.known[tier] = version
        return version

    def resumed(self, newest: dict[str, int | None], since: int) -> set[str]:
        """The tiers with a commit report, from index ``since`` on, of a version newer than
        ``newest[tier]`` (the newest they had committed before; ``None``: any version)."""
        return {
            t for t, v in self.commits[since:] if (before := newest.get(t)) is None or v > before
        }
