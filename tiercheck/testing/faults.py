"""Fault injection: tiers that fail or "die" at a chosen operation, for crash-consistency tests.

A :class:`FaultPlan` is shared by every wrapped tier of one simulated process. It numbers the
mutating operations (put, putv, delete, reservation commit) across all of them, in the order
they happen. At operation ``die_at`` the process "dies": that operation and every later one on
any wrapped tier raises :class:`SimulatedCrash` without touching storage, exactly as if the
process had been killed between two writes. Operations listed in ``fail_at`` raise
:class:`InjectedFault` once (a transient error) and the process lives on. :func:`abandon`
stops a checkpointer dead, as the crash of its process would.

Example::

    plan = FaultPlan(die_at=7)
    tiers = [FaultyTier(LocalTier(root), plan), FaultyTier(PersistentTier(url), plan)]
    ckpt = Checkpointer("job", tiers=tiers, ...)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Final

from tiercheck.tiers.base import Tier
from tiercheck.tiers.wrapper import DelegatingTier

if TYPE_CHECKING:
    from tiercheck.engine.core import CheckpointerCore

__all__ = ["FaultPlan", "FaultyTier", "InjectedFault", "SimulatedCrash", "abandon"]


class SimulatedCrash(Exception):
    """Raised by every wrapped operation from the moment the simulated process died."""


class InjectedFault(OSError):
    """A one-off, transient failure of one operation."""


class FaultPlan:
    """Numbers mutating operations across tiers and decides which one fails or kills.

    Args:
        die_at: the 1-based number of the operation at which the process dies (``None``: never).
        fail_at: numbers of operations that fail once with :class:`InjectedFault`.
        reads_die: whether reads also fail after death (they do by default: a dead process
            reads nothing either).
        die_on: a predicate on ``(op, tier, key)``: the process dies at the first mutating
            operation it accepts (for example the commit of one version's blob).
        on_death: called once, at the moment of death, before the operation raises. A
            multi-process test passes ``lambda: os.kill(os.getpid(), signal.SIGKILL)`` to turn
            the simulated death into a real one at that exact point.
    """

    def __init__(
        self,
        die_at: int | None = None,
        fail_at: Collection[int] = (),
        *,
        reads_die: bool = True,
        die_on: Callable[[str, str, str], bool] | None = None,
        on_death: Callable[[], None] | None = None,
    ) -> None:
        self.die_at = die_at
        self.fail_at = frozenset(fail_at)
        self.reads_die = reads_die
        self.die_on = die_on
        self.on_death = on_death
        self.count = 0
        self.dead = False
        self.log: list[tuple[int, str, str, str]] = []
        self._lock = threading.Lock()

    def kill(self) -> None:
        """Die now, whatever the count."""
        with self._lock:
            self.dead = True

    def write(self, op: str, tier: str, key: str) -> None:
        """Account for one mutating operation; raise if it must fail."""
        with self._lock:
            if self.dead:
                raise SimulatedCrash(f"process is dead; {op} {tier}:{key} not done")
            self.count += 1
            n = self.count
            self.log.append((n, op, tier, key))
            dies = (self.die_at is not None and n >= self.die_at) or (
                self.die_on is not None and self.die_on(op, tier, key)
            )
            if dies:
                self.dead = True
                if self.on_death is not None:
                    self.on_death()
                raise SimulatedCrash(f"process died at operation {n} ({op} {tier}:{key})")
            if n in self.fail_at:
                raise InjectedFault(f"injected failure of operation {n} ({op} {tier}:{key})")

    def read(self, op: str, tier: str, key: str) -> None:
        """Account for a read: it fails only after death (when ``reads_die``)."""
        if self.dead and self.reads_die:
            raise SimulatedCrash(f"process is dead; {op} {tier}:{key} not done")


# How each forwarded operation counts in the plan: a mutation of stored data, a read, or
# neither (aborting and closing write nothing, and stay possible after death). Removing a dead
# writer's leftovers touches no stored blob: it fails after death like a read, unnumbered.
_WRITES: Final = {
    "put": "put",
    "putv": "put",
    "copy": "copy",
    "delete": "delete",
    "commit": "commit",
}
_READS: Final = frozenset(
    {
        "get",
        "get_range",
        "get_size",
        "exists",
        "list",
        "reserve",
        "prepare",
        "leftovers",
        "remove_leftovers",
    }
)


class FaultyTier(DelegatingTier):
    """Wraps a tier, consulting a :class:`FaultPlan` before every operation.

    A :class:`~tiercheck.tiers.DelegatingTier`: it has the optional abilities (``reserve``,
    ``prepare``, ``copy``, ...) of the tier it wraps. ``put``, ``putv``, ``copy``, ``delete`` and
    a reservation's ``commit`` are the plan's numbered writes; ``get``, ``get_range``,
    ``get_size``, ``exists``, ``list``, ``reserve``, ``prepare``, ``leftovers`` and
    ``remove_leftovers`` fail once the process is dead; ``abort``,
    ``stop_serving`` and ``aclose`` always go through (they store nothing).
    """

    def __init__(self, inner: Tier, plan: FaultPlan) -> None:
        super().__init__(inner)
        self.plan = plan

    @classmethod
    def wrap(cls, inner: Tier, plan: FaultPlan) -> FaultyTier:
        """The same as ``FaultyTier(inner, plan)`` (kept for callers written before it was)."""
        return cls(inner, plan)

    async def before(self, op: str, key: str) -> None:
        """Account for ``op`` in the plan; raise if it fails or the process is dead."""
        write = _WRITES.get(op)
        if write is not None:
            self.plan.write(write, self.name, key)
        elif op in _READS:
            self.plan.read(op, self.name, key)


def abandon(checkpointer: CheckpointerCore) -> None:
    """Stop ``checkpointer`` dead, as a crashed process would: nothing is flushed or closed.

    Its private event loop stops where it is; only the job lock is let go, as the kernel lets
    a dead process's locks go. For tests that model a crash inside one process.
    """
    # The checkpointer's own private state: this is the test kit, standing in for the kernel.
    checkpointer._closed = True
    loop, engine = checkpointer._loop, checkpointer._engine
    if loop is not None:
        if engine is not None:
            engine.mark_closed()
        loop.stop()
        checkpointer._loop = None
    if engine is not None:
        engine.claim.lock.release()
