"""Whether each tier keeps committing: how far its newest committed version lags behind.

A tier can stop committing while training goes on and every ``save`` returns at once: another
rank paused past ``peer_timeout``, durable storage is down, the tier is full. Each tier's
pipeline keeps a :class:`CommitLag`: the newest version committed there (as this rank knows),
when it was saved, and the saves sent to the tier since then that did not commit. When those
are more than ``behind_saves`` saves, or the oldest of them is older than ``behind_seconds``,
the tier is *behind*: one WARNING says so, and one more when it commits again.
:meth:`tiercheck.Checkpointer.health` hands the same figures to a trainer or a monitor
(:class:`Health`).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

__all__ = ["CommitLag", "Health", "TierHealth"]

logger = logging.getLogger("tiercheck")


@dataclass(frozen=True, slots=True)
class TierHealth:
    """Whether one tier keeps committing, as this rank sees it (a snapshot).

    Attributes:
        tier: the tier's name.
        newest: the newest version committed in the tier (``None``: none is).
        newest_age_s: seconds since that version was saved; ``None`` when it was committed
            before this opening (its age is not known here) or when there is none.
        saves_since: saves sent to the tier after ``newest`` that are not committed there:
            pending, failed or dropped (a tier that takes bases only counts bases).
        behind_s: seconds since the oldest of those saves (``0.0`` when there are none): how
            long the tier has gone without committing a newer save.
        behind: ``saves_since`` is more than the checkpointer's ``behind_saves``, or
            ``behind_s`` more than its ``behind_seconds``. A restore from this tier now would
            go back to ``newest``.
        last_error: why the latest save sent to the tier did not commit there (``None``: none
            failed since this opening).
    """

    tier: str
    newest: int | None
    newest_age_s: float | None
    saves_since: int
    behind_s: float
    behind: bool
    last_error: str | None


@dataclass(frozen=True, slots=True)
class Health:
    """Whether each tier keeps committing, by tier name, fastest first (a snapshot; see
    :meth:`tiercheck.Checkpointer.health`)."""

    tiers: Mapping[str, TierHealth] = field(default_factory=dict)

    @property
    def behind(self) -> list[str]:
        """The tiers that are behind (empty when every tier keeps committing)."""
        return [name for name, tier in self.tiers.items() if tier.behind]


#: What :meth:`CommitLag.snapshot` reads, swapped whole on the loop so that another thread
#: never sees half an update: newest, its save time, saves since, the oldest's save time,
#: the last error.
_View = tuple[int | None, float | None, int, float | None, str | None]


class CommitLag:
    """One tier's commit lag; fed on the engine's loop, read from any thread.

    Args:
        tier: the tier's name (for the log).
        saves: more saves than this since the newest commit make the tier behind.
        seconds: an oldest uncommitted save older than this makes the tier behind.
    """

    def __init__(self, tier: str, *, saves: int, seconds: float) -> None:
        self.tier = tier
        self.saves = saves
        self.seconds = seconds
        self._newest: int | None = None
        self._newest_saved: float | None = None
        # Versions sent to the tier after the newest committed one, with when they were saved
        # (monotonic), oldest first.
        self._since: deque[tuple[int, float]] = deque()
        self._last_error: str | None = None
        self._behind = False
        # While behind: since when no save sent here committed (monotonic), and the most saves
        # seen waiting.
        self._behind_since = 0.0
        self._missed = 0
        self._view: _View = (None, None, 0, None, None)

    def opened(self, committed: Collection[int]) -> None:
        """What the tier held committed at opening (or after a restore settled it): the newest
        of it, whose age is not known here."""
        newest = max(committed, default=None)
        if newest is not None and (self._newest is None or newest > self._newest):
            self._newest, self._newest_saved = newest, None
            self._drop_upto(newest)
        self._publish()

    def sent(self, version: int) -> None:
        """A save of ``version`` was sent to the tier (its round is queued)."""
        if self._newest is None or version > self._newest:
            self._since.append((version, time.monotonic()))
        self._publish()
        self._judge()

    def committed(self, version: int) -> None:
        """``version`` is committed in the tier."""
        if self._newest is not None and version <= self._newest:
            return
        saved = next((t for v, t in self._since if v == version), None)
        self._newest, self._newest_saved = version, saved
        self._drop_upto(version)
        self._publish()
        self._judge(committed=version)

    def failed(self, version: int, error: BaseException | str) -> None:
        """The save of ``version`` did not commit in the tier (``error`` says why)."""
        text = str(error)
        # The engine's errors name the version; a bare reason gets it added.
        self._last_error = (text if str(version) in text else f"version {version}: {text}")[:500]
        self._publish()
        self._judge()

    def snapshot(self) -> TierHealth:
        """The figures now (callable from any thread)."""
        newest, newest_saved, count, oldest, last_error = self._view
        now = time.monotonic()
        behind_s = 0.0 if oldest is None else max(0.0, now - oldest)
        return TierHealth(
            tier=self.tier,
            newest=newest,
            newest_age_s=None if newest_saved is None else max(0.0, now - newest_saved),
            saves_since=count,
            behind_s=behind_s,
            behind=self._is_behind(count, behind_s),
            last_error=last_error,
        )

    def _is_behind(self, count: int, behind_s: float) -> bool:
        return count > self.saves or (count > 0 and behind_s > self.seconds)

    def _drop_upto(self, version: int) -> None:
        while self._since and self._since[0][0] <= version:
            self._since.popleft()

    def _publish(self) -> None:
        oldest = self._since[0][1] if self._since else None
        self._view = (
            self._newest,
            self._newest_saved,
            len(self._since),
            oldest,
            self._last_error,
        )

    def _judge(self, committed: int | None = None) -> None:
        """Log the transitions: falling behind (WARNING), committing again (WARNING)."""
        health = self.snapshot()
        if health.behind and not self._behind:
            self._behind = True
            self._behind_since = time.monotonic() - health.behind_s
            self._missed = health.saves_since
            count = health.saves_since
            saves = f"{count} save{'' if count == 1 else 's'} sent to it"
            logger.warning(
                "tiercheck: the %r tier is behind: %s, and %s %s not committed there (the "
                "oldest %.1fs ago; limits: behind_saves=%s, behind_seconds=%s); a restore from "
                "it now would %s. Latest failure: %s. Checkpointer.health() has the figures; a "
                "WARNING says when it commits again.",
                self.tier,
                "it has no committed version"
                if health.newest is None
                else f"its newest committed version is {health.newest}",
                saves if health.newest is None else f"the {saves} since",
                "has" if count == 1 else "have",
                health.behind_s,
                self.saves,
                f"{self.seconds:g}",
                "find nothing there"
                if health.newest is None
                else f"go back to version {health.newest}",
                health.last_error or "none yet, they are pending",
            )
        elif self._behind and committed is not None and not health.behind:
            self._behind = False
            logger.warning(
                "tiercheck: the %r tier commits again: version %s is committed there (for %.1fs "
                "before, none of the saves sent to it committed; up to %s were waiting)",
                self.tier,
                committed,
                time.monotonic() - self._behind_since,
                self._missed,
            )
        elif self._behind:
            self._missed = max(self._missed, health.saves_since)
