"""What a tier's writer lane and round worker see of their pipeline.

:class:`~tiercheck.engine.commit.tier.TierPipeline` makes its
:class:`~tiercheck.engine.commit.lane.Lane` and
:class:`~tiercheck.engine.commit.commit.CommitRounds` and hands them itself; they know it through
this narrow view, so that neither imports the module that builds them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from tiercheck.codec import BlobMeta
    from tiercheck.consistency.manifest import Written
    from tiercheck.engine.collectives import Channels
    from tiercheck.engine.jobs import InFlight, Job, OwnBlob
    from tiercheck.engine.journal import Journal
    from tiercheck.engine.open.claim import Claim
    from tiercheck.engine.options import Options
    from tiercheck.engine.results import CheckpointerStats
    from tiercheck.errors import TierWriteFailed
    from tiercheck.tiers.base import Tier

__all__ = ["Pipe"]


class Pipe(Protocol):
    """One tier's pipeline, as its lane and its round worker use it."""

    options: Options
    rank: int
    job_id: str
    stats: CheckpointerStats
    journal: Journal
    claim: Claim
    channels: Channels
    inflight: InFlight
    tier: Tier
    name: str
    #: Commits proven by ``COMMIT`` records in the tier.
    durable: bool
    #: Why the tier takes no new versions for now, or ``None``.
    blocked: str | None
    #: Clear while the timeline is being settled for the tier: nothing is written meanwhile.
    timeline_ready: asyncio.Event
    own: dict[int, OwnBlob]
    committed: set[int]
    #: Versions whose round failed here on a peer error after this rank voted yes.
    unsure: set[int]
    reserve_size: int
    idle: asyncio.Event

    async def takes_new(self) -> bool:
        """Whether the tier takes a new version now (waits while its timeline settles)."""
        ...

    def refusal(self) -> TierWriteFailed:
        """Why a version is not taken while the tier is blocked."""
        ...

    def skip(self, job: Job, exc: BaseException) -> None:
        """``job`` is not written to this tier (``exc`` says why)."""
        ...

    def fail(self, job: Job, error: BaseException) -> None:
        """``job`` failed in this tier."""
        ...

    def record_written(self, job: Job, key: str, meta: BlobMeta) -> Written:
        """This rank's blob ``key`` of ``job`` is written to the tier."""
        ...

    def peer_trouble(self, what: str, exc: BaseException) -> None:
        """The other ranks (or a holder) failed ``what``; warned once until it works again."""
        ...

    def round_over(self, version: int) -> None:
        """The commit round of ``version`` is over (committed or not)."""
        ...

    def commit(self, version: int) -> None:
        """``version`` is committed in the tier for every rank."""
        ...

    def forget_bases(self, bases: Collection[int]) -> None:
        """``bases`` vanished from the tier: no longer committed there."""
        ...

    def peers_back(self) -> None:
        """Work with the other ranks succeeded again."""
        ...

    async def retain(self) -> None:
        """Trim the tier to its policy's ``keep``."""
        ...
