"""Fault injection: tiers that fail or "die" at a chosen operation, for crash-consistency tests.

A :class:`FaultPlan` is shared by every wrapped tier of one simulated process. It numbers the
mutating operations (put, putv, delete, reservation commit) across all of them, in the order
they happen. At operation ``die_at`` the process "dies": that operation and every later one on
any wrapped tier raises :class:`SimulatedCrash` without touching storage, exactly as if the
process had been killed between two writes. Operations listed in ``fail_at`` raise
:class:`InjectedFault` once (a transient error) and the process lives on.

Example::

    plan = FaultPlan(die_at=7)
    tiers = [FaultyTier.wrap(LocalTier(root), plan), FaultyTier.wrap(PersistentTier(url), plan)]
    ckpt = Checkpointer("job", tiers=tiers, ...)
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable, Collection, Sequence

from tiercheck.tiers.base import Buffer, Reservation, SupportsReserve, Tier

__all__ = ["FaultPlan", "FaultyTier", "InjectedFault", "SimulatedCrash"]


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


class FaultyTier(Tier):
    """Wraps a tier, consulting a :class:`FaultPlan` before every operation.

    Use :meth:`wrap`, which keeps the optional abilities (such as ``reserve``) of the inner tier.
    """

    def __init__(self, inner: Tier, plan: FaultPlan) -> None:
        self.inner = inner
        self.plan = plan
        self.name = inner.name
        self.survives = inner.survives

    @classmethod
    def wrap(cls, inner: Tier, plan: FaultPlan) -> FaultyTier:
        """A faulty wrapper with the same optional abilities as ``inner``."""
        if isinstance(inner, SupportsReserve):
            return _FaultyReservingTier(inner, plan)
        return cls(inner, plan)

    async def put(self, key: str, data: Buffer) -> None:
        """Put, unless the plan says this operation fails or the process is dead."""
        self.plan.write("put", self.name, key)
        await self.inner.put(key, data)

    async def putv(self, key: str, parts: Sequence[Buffer]) -> None:
        """Put a sequence of parts, under the same plan as :meth:`put`."""
        self.plan.write("put", self.name, key)
        await self.inner.putv(key, parts)

    async def get(self, key: str) -> Buffer:
        """Get, unless the process is dead."""
        self.plan.read("get", self.name, key)
        return await self.inner.get(key)

    async def delete(self, key: str) -> None:
        """Delete, unless the plan says this operation fails or the process is dead."""
        self.plan.write("delete", self.name, key)
        await self.inner.delete(key)

    async def exists(self, key: str) -> bool:
        """Exists, unless the process is dead."""
        self.plan.read("exists", self.name, key)
        return await self.inner.exists(key)

    async def list(self, prefix: str = "") -> AsyncIterator[str]:
        """List, unless the process is dead."""
        self.plan.read("list", self.name, prefix)
        async for key in self.inner.list(prefix):
            yield key

    async def get_size(self, key: str) -> int:
        """Size, unless the process is dead."""
        self.plan.read("get_size", self.name, key)
        return await self.inner.get_size(key)

    async def aclose(self) -> None:
        """Close the inner tier (closing is allowed even when dead: it writes nothing)."""
        await super().aclose()
        await self.inner.aclose()

    def __repr__(self) -> str:
        return f"FaultyTier({self.inner!r})"


class _FaultyReservation:
    """A reservation whose commit is one operation of the plan."""

    def __init__(self, inner: Reservation, plan: FaultPlan, tier: str) -> None:
        self._inner = inner
        self._plan = plan
        self._tier = tier

    @property
    def key(self) -> str:
        return self._inner.key

    @property
    def buffer(self) -> memoryview:
        return self._inner.buffer

    async def commit(self) -> None:
        self._plan.write("commit", self._tier, self._inner.key)
        await self._inner.commit()

    async def abort(self) -> None:
        await self._inner.abort()

    def release(self) -> None:
        self._inner.release()


class _FaultyReservingTier(FaultyTier):
    """A faulty wrapper of a tier that supports ``reserve``."""

    async def reserve(self, key: str, nbytes: int) -> Reservation:
        """Reserve in the inner tier; the plan governs the commit."""
        self.plan.read("reserve", self.name, key)
        assert isinstance(self.inner, SupportsReserve)
        inner = await self.inner.reserve(key, nbytes)
        return _FaultyReservation(inner, self.plan, self.name)
