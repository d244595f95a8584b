"""What a checkpointer hands back: save handles, figures, and the result of a restore."""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import time
import warnings
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal, Protocol

from tiercheck.errors import ConfigError, TierNotTargeted

__all__ = [
    "OWN_STORAGE_BYTES",
    "CheckpointerStats",
    "Restored",
    "SaveHandle",
    "SaveStats",
    "TierSaveStats",
    "check_timeout",
]


def check_timeout(timeout: object) -> float | None:
    """``timeout`` as seconds to wait (``None``: no limit); a
    :class:`~tiercheck.errors.ConfigError` for anything but a number >= 0 or ``None``."""
    if timeout is None:
        return None
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or math.isnan(timeout)
        or timeout < 0
    ):
        raise ConfigError(f"timeout must be a number of seconds >= 0 or None, got {timeout!r}")
    return float(timeout)


@dataclass
class TierSaveStats:
    """How one version fared in one tier."""

    #: ``"uncertain"``: this rank lost the last exchange of the version's commit round after
    #: voting yes, so the other ranks may have committed it (see
    #: :class:`~tiercheck.errors.CommitUncertain`); ``"failed"``: it is certainly not committed.
    state: Literal["pending", "committed", "failed", "uncertain", "skipped"] = "pending"
    #: Bytes written to the tier for this rank.
    bytes: int = 0
    #: Seconds from the start of ``save`` until committed (or failed).
    seconds: float | None = None
    error: str | None = None


@dataclass
class SaveStats:
    """Figures of one save."""

    version: int
    kind: Literal["base", "delta", "skipped"]
    #: Seconds ``save`` blocked the caller (flatten, back-pressure wait, snapshot copy; with
    #: ``overlap=True`` the copy is not included).
    stall_s: float = 0.0
    #: Seconds from the start of ``save`` until the snapshot was copied (staged), once it is.
    staged_s: float | None = None
    #: Bytes of the raw payload (every tensor, laid out flat).
    raw_bytes: int = 0
    tiers: dict[str, TierSaveStats] = field(default_factory=dict)


@dataclass
class CheckpointerStats:
    """Running totals of a checkpointer."""

    saves: int = 0
    skipped: int = 0
    committed: dict[str, int] = field(default_factory=dict)
    failed: dict[str, int] = field(default_factory=dict)
    last_committed: dict[str, int] = field(default_factory=dict)
    evicted: dict[str, int] = field(default_factory=dict)
    stall_s_total: float = 0.0
    manifest_errors: int = 0
    #: Node manifests found damaged by a new manifest process this rank was the first to reach,
    #: and set aside (``manifest.damaged-<UTC time>``; a new one was started and refilled).
    manifest_set_aside: int = 0
    #: Times the node's manifest process was found gone (killed, or a file cut short under it)
    #: and a new one started.
    manifest_restarts: int = 0
    #: Reads of a restore that failed and were followed by another read: a tier that could
    #: not serve a version, or a blob that failed while read straight into the state (its
    #: tier is then read again the ordinary way, which counts again if it fails too).
    restore_fallbacks: int = 0
    #: Bytes of other ranks' blobs read by elastic restores (ranged reads where the tier
    #: serves them, whole blobs where it does not).
    reshard_bytes_read: int = 0
    #: Versions a tier could not take at all (full, unusable when staging), by tier; they
    #: still went to the other tiers.
    tier_skips: dict[str, int] = field(default_factory=dict)
    #: Blobs that failed verification during a restore and were set aside (``quarantine/``).
    quarantined: int = 0
    #: Whether a newer opening of the job took over its durable tiers (this one stopped
    #: writing there; see :class:`~tiercheck.errors.Superseded`).
    superseded: bool = False
    #: Durable tiers this opening could not reach when it opened and has not claimed since (it
    #: opened on the nodes' memory; see :mod:`tiercheck.engine.open.rejoin`), by name, with the
    #: error; empty once every one is claimed again.
    unreachable: dict[str, str] = field(default_factory=dict)
    #: Saves whose state had the structure of the save before it, so that its layout was
    #: reused instead of walked and planned anew (see :mod:`tiercheck.codec.encode.plan`).
    layouts_reused: int = 0
    #: Saves whose layout was planned anew (the first, and any whose structure changed).
    layouts_planned: int = 0
    #: Host memory the staging pool holds now, in bytes: buffers for snapshots that are not
    #: copied straight into a tier's own memory (0 while every save is).
    staging_bytes: int = 0

    def snapshot(
        self, *, layouts_reused: int, layouts_planned: int, staging_bytes: int
    ) -> CheckpointerStats:
        """A copy that shares nothing with this object (its per-tier dictionaries included),
        with the figures kept elsewhere filled in."""
        copied = replace(
            self,
            layouts_reused=layouts_reused,
            layouts_planned=layouts_planned,
            staging_bytes=staging_bytes,
        )
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, dict):
                setattr(copied, f.name, dict(value))
        return copied


#: Restored tensors up to this size have storage of their own; larger ones are views into one
#: shared buffer (see :class:`Restored`).
OWN_STORAGE_BYTES = 64 * 1024


@dataclass(frozen=True)
class Restored:
    """The result of a restore.

    Without a live state to fill, tensors larger than :data:`OWN_STORAGE_BYTES` are views into
    one buffer holding the whole version (no copy beyond the read); they are valid for as long
    as they are referenced. Smaller ones (RNG states, counters, scalars) have storage of their
    own, so code that reads a tensor's storage from its start (``torch.set_rng_state``) gets
    the right bytes.
    """

    version: int
    #: The restored state: the caller's own object, filled in place, when one was passed.
    state: Any
    #: The tier this rank read from.
    source_tier: str
    #: The tier every rank read from, by rank.
    source_tiers: Mapping[int, str]
    seconds: float
    #: Newer versions that were passed over, and why (by version: one line per rank and tier).
    rejected: Mapping[int, tuple[str, ...]] = field(default_factory=dict)
    #: How many ranks saved the version: this run's number, or another one when the restore
    #: resharded it (``elastic=True``).
    saved_by: int = 0


def _resolved() -> concurrent.futures.Future[None]:
    fut: concurrent.futures.Future[None] = concurrent.futures.Future()
    fut.set_result(None)
    return fut


class _Point(Protocol):
    """The confirmation point a handle passes (the engine's stager; see
    :mod:`tiercheck.engine.save.staging`)."""

    def settle(self, *, wait: bool, timeout: float | None = None) -> None: ...

    async def asettle(self, timeout: float | None = None) -> None: ...


class _Done:
    """What :meth:`SaveHandle.done` answers: a bool, and for code written against 0.1, where
    ``done`` was a coroutine, still awaitable (with a :class:`DeprecationWarning`)."""

    __slots__ = ("_answer", "_handle", "_tier")

    def __init__(self, answer: bool, handle: SaveHandle, tier: str | None) -> None:
        self._answer = answer
        self._handle = handle
        self._tier = tier

    def __bool__(self) -> bool:
        return self._answer

    def __eq__(self, other: object) -> bool:
        return bool(self) == other if isinstance(other, bool) else NotImplemented

    def __hash__(self) -> int:
        return hash(self._answer)

    def __repr__(self) -> str:
        return repr(self._answer)

    def __await__(self) -> Generator[Any, None, None]:
        warnings.warn(
            "`await handle.done(tier)` is deprecated: done() now answers at once, as "
            "concurrent.futures.Future.done() does; wait with `await handle.result_async(tier)`",
            DeprecationWarning,
            stacklevel=2,
        )
        return self._handle.result_async(self._tier).__await__()


class SaveHandle:
    """What ``save`` returns: a way to wait for the version to be committed in each tier.

    Named as :class:`concurrent.futures.Future` taught: ``handle.result("local", timeout)``
    blocks until the version is committed in that tier (for every rank) and raises why not;
    ``await handle.result_async("local")`` is its non-blocking twin; ``handle.done("local")``
    answers at once whether that outcome is decided. Asking about a tier
    the version does not go to raises :class:`~tiercheck.errors.TierNotTargeted` at once; a
    version that could not be committed raises :class:`~tiercheck.errors.TierWriteFailed`;
    a skipped save raises :class:`~tiercheck.errors.SaveSkipped`.

    With ``overlap=True`` the snapshot copy runs after ``save`` returned: :meth:`staged` (or
    ``await handle.staged_async()``) is the fence to pass before changing the state. Passing the
    fence, and waiting with :meth:`result` or :meth:`result_async`, also confirms the copies that
    are done (the version counters are compared on the calling side, see
    :mod:`tiercheck.engine.save.staging`): no tier stores an overlapped version before it is
    confirmed.
    """

    def __init__(self, version: int, tiers: Sequence[str], stats: SaveStats) -> None:
        self.version = version
        #: The tiers this version goes to.
        self.tiers = tuple(tiers)
        self.stats = stats
        self._futures: dict[str, concurrent.futures.Future[None]] = {
            t: concurrent.futures.Future() for t in tiers
        }
        # Resolved once the snapshot is copied (at once for a blocking or skipped save).
        self._staged: concurrent.futures.Future[None] = _resolved()
        # Where the calls on this handle confirm overlapped copies (set by the engine).
        self._point: _Point | None = None
        for t in tiers:
            stats.tiers[t] = TierSaveStats()

    def staged(self, timeout: float | None = None) -> None:
        """Block until the snapshot copy is done: from then on the state may change.

        The fence of an overlapped save (``Checkpointer(..., overlap=True)``); returns at once
        for a blocking save. It never raises the copy's own failure (that failure, such as
        :class:`~tiercheck.errors.StateChanged`, is raised by :meth:`done` for every tier); only
        :class:`TimeoutError` when ``timeout`` passes first -- the state must then not change.
        """
        concurrent.futures.wait([self._staged], check_timeout(timeout))
        if not self._staged.done():
            raise TimeoutError(f"version {self.version} was not staged within {timeout} s")
        if self._point is not None:
            self._point.settle(wait=False)

    async def staged_async(self) -> None:
        """Wait, without blocking the event loop, until the snapshot copy is done."""
        await asyncio.wait([asyncio.wrap_future(self._staged)])
        if self._point is not None:
            self._point.settle(wait=False)

    @property
    def is_staged(self) -> bool:
        """Whether the snapshot copy is done (never blocks)."""
        return self._staged.done()

    @property
    def skipped(self) -> bool:
        """Whether the save was skipped by back-pressure."""
        return self.stats.kind == "skipped"

    def _futures_for(self, tier: str | None) -> list[concurrent.futures.Future[None]]:
        if tier is None:
            return list(self._futures.values())
        try:
            return [self._futures[tier]]
        except KeyError:
            raise TierNotTargeted(
                f"version {self.version} does not go to the {tier!r} tier "
                f"(it goes to {list(self.tiers)}); check the tier's `versions` policy"
            ) from None

    async def result_async(self, tier: str | None = None) -> None:
        """Wait, without blocking the event loop, until the version is committed in ``tier``
        (every targeted tier if ``None``); raises as :meth:`result` does.

        Waits for the overlapped copies in flight first, and confirms them."""
        futures = self._futures_for(tier)
        if self._point is not None:
            await self._point.asettle()
        for fut in futures:
            await asyncio.wrap_future(fut)

    def done(self, tier: str | None = None) -> _Done:
        """Whether the version's outcome in ``tier`` (every targeted tier if ``None``) is
        decided -- committed or failed -- answered at once, like
        :meth:`concurrent.futures.Future.done`.

        Until 0.1 this was the coroutine :meth:`result_async` is now; ``await handle.done(t)``
        still waits as it did, with a :class:`DeprecationWarning`."""
        futures = self._futures_for(tier)
        return _Done(all(f.done() for f in futures), self, tier)

    def result(self, tier: str | None = None, timeout: float | None = None) -> None:
        """Block until the version is committed in ``tier`` (every targeted tier if ``None``);
        raises :class:`~tiercheck.errors.TierWriteFailed` (or why not) where it failed,
        :class:`TimeoutError` where ``timeout`` passes first."""
        timeout = check_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        futures = self._futures_for(tier)
        if self._point is not None:
            self._point.settle(wait=True, timeout=timeout)
        for fut in futures:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            fut.result(left)

    def committed(self, tier: str) -> bool:
        """Whether the version is committed in ``tier`` already (never blocks)."""
        fut = self._futures_for(tier)[0]
        return fut.done() and fut.exception() is None

    # --- the engine's side (not for callers) ----------------------------------------------

    def confirm_at(self, point: _Point) -> None:
        """The engine's: the calls on this handle confirm overlapped copies at ``point``."""
        self._point = point

    def staging(self, copied: concurrent.futures.Future[None]) -> None:
        """The engine's: the snapshot copy runs on after ``save`` returned; ``copied``
        resolves once it is done (see :meth:`staged`)."""
        self._staged = copied

    def tier_future(self, tier: str) -> concurrent.futures.Future[None] | None:
        """The engine's: what waiters on ``tier`` wait for; ``None`` where not targeted."""
        return self._futures.get(tier)

    def undecided_tiers(self) -> list[str]:
        """The engine's: the targeted tiers where the version is neither committed nor failed
        yet, in target order."""
        return [t for t, fut in self._futures.items() if not fut.done()]

    def resolve_tier(self, tier: str, error: BaseException | None = None) -> None:
        """The engine's: the version is committed in ``tier`` (``error`` ``None``) or failed
        there (``error`` is what the waiters raise); the first word counts."""
        fut = self._futures[tier]
        if fut.done():
            return
        if error is None:
            fut.set_result(None)
        else:
            fut.set_exception(error)

    def __repr__(self) -> str:
        states = {t: s.state for t, s in self.stats.tiers.items()}
        return f"SaveHandle(version={self.version}, kind={self.stats.kind!r}, tiers={states})"
