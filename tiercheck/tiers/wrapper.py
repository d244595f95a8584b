"""A tier that forwards every operation to another tier: the base of tiers that add behaviour.

:class:`DelegatingTier` wraps an *inner* tier and forwards each call to it -- the five abstract
methods, ``putv``, ``get_size``, ``aclose``, and the optional abilities the inner tier has
(``reserve``, ``prepare``, ``stop_serving``, ``get_range``, ``copy``, ``leftovers``). A
subclass adds behaviour around the calls without re-implementing the forwarding: fault injection
(:class:`tiercheck.testing.faults.FaultyTier`), latency, metrics, logging, access checks.
Example::

    class CountingTier(DelegatingTier):
        def __init__(self, inner: Tier) -> None:
            super().__init__(inner)
            self.calls: collections.Counter[str] = collections.Counter()

        async def before(self, op: str, key: str) -> None:
            self.calls[op] += 1

    ckpt = Checkpointer("run-1", tiers=[CountingTier(LocalTier()), "persistent"])

Where the blobs live is the inner tier's business: code that needs the storing tier (the
checkpointer records where a durable tier keeps its data) follows :attr:`DelegatingTier.inner`
down to it.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Sequence
from typing import Any, Final, TypeVar, cast

from tiercheck.tiers.base import (
    Buffer,
    FailureScope,
    Leftover,
    Reservation,
    SupportsCopy,
    SupportsLeftovers,
    SupportsPrepare,
    SupportsRangedGet,
    SupportsReserve,
    SupportsStopServing,
    Tier,
    WriterClaim,
)

__all__ = ["OPERATIONS", "DelegatedReservation", "DelegatingTier"]

_D = TypeVar("_D", bound="DelegatingTier")

#: The names :meth:`DelegatingTier.before` is called with, one per forwarded operation.
#: ``"commit"`` and ``"abort"`` are those of a reservation handed out by ``reserve``.
OPERATIONS: Final = frozenset(
    {
        "put",
        "putv",
        "get",
        "get_range",
        "get_size",
        "exists",
        "delete",
        "list",
        "reserve",
        "commit",
        "abort",
        "copy",
        "prepare",
        "stop_serving",
        "leftovers",
        "remove_leftovers",
    }
)


class DelegatingTier(Tier):
    """Forwards every operation, and every optional ability of :attr:`inner`, to :attr:`inner`.

    ``DelegatingTier(inner, *, name=None, survives=None)`` -- ``name`` and ``survives`` default
    to the inner tier's.

    Abilities
        The wrapper has exactly the optional abilities of its inner tier: it implements
        :class:`~tiercheck.tiers.SupportsReserve` (``reserve``) if and only if the inner tier
        does, and likewise :class:`~tiercheck.tiers.SupportsPrepare`,
        :class:`~tiercheck.tiers.SupportsStopServing`,
        :class:`~tiercheck.tiers.SupportsRangedGet`, :class:`~tiercheck.tiers.SupportsCopy` and
        :class:`~tiercheck.tiers.SupportsLeftovers`. (So an instance's class is a subclass,
        of the same name, of the class constructed, with the forwarding of those abilities
        added; ``isinstance(w, YourSubclass)`` holds as usual.)

    Adding behaviour
        Override :meth:`before`, which every forwarded operation awaits first with its name
        (one of :data:`OPERATIONS`) and its key; raising there fails the operation before the
        inner tier sees it. Reservations are wrapped in :class:`DelegatedReservation`, whose
        ``commit`` and ``abort`` go through :meth:`before` too. Overriding the methods
        themselves works as well (call ``super()``), except for ``reserve``, ``prepare``,
        ``stop_serving``, ``get_range``, ``copy``, ``leftovers`` and ``remove_leftovers``:
        their forwarding comes first in the class's MRO (an ability follows the inner tier,
        always), so change them through :meth:`before` and :meth:`wrap_reservation`.

    Checks
        The wrapper checks first that it is open and that the key is valid, so that a closed
        wrapper raises :class:`~tiercheck.errors.TierClosed` and an invalid key
        :class:`~tiercheck.errors.InvalidKey` before :meth:`before` runs. :meth:`aclose` closes
        the wrapper, then the inner tier; it does not go through :meth:`before`.
    """

    def __new__(cls: type[_D], inner: Tier | None = None, *args: Any, **kwargs: Any) -> _D:
        made = cls if inner is None else _class_for(cls, _abilities(inner))
        return cast(_D, super().__new__(made))

    def __init__(
        self,
        inner: Tier,
        *,
        name: str | None = None,
        survives: FailureScope | None = None,
    ) -> None:
        if not isinstance(inner, Tier):
            raise TypeError(f"a DelegatingTier wraps a Tier, got {type(inner).__name__}")
        #: The wrapped tier.
        self.inner = inner
        self.name = inner.name if name is None else name
        self.survives = inner.survives if survives is None else survives

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"

    async def before(self, op: str, key: str) -> None:
        """Called ahead of each forwarded operation ``op`` on ``key``; does nothing by default.

        ``key`` is the prefix for ``list`` and ``""`` for ``prepare`` and ``stop_serving``.
        """

    def wrap_reservation(self, reservation: Reservation) -> Reservation:
        """The reservation ``reserve`` returns for one the inner tier handed out."""
        return DelegatedReservation(self, reservation)

    # --- the Tier interface -------------------------------------------------------------------

    async def put(self, key: str, data: Buffer) -> None:
        """Forward :meth:`Tier.put`."""
        self._check_key(key)
        await self.before("put", key)
        await self.inner.put(key, data)

    async def putv(self, key: str, parts: Sequence[Buffer]) -> None:
        """Forward :meth:`Tier.putv` (the inner tier's, not a join)."""
        self._check_key(key)
        await self.before("putv", key)
        await self.inner.putv(key, parts)

    async def get(self, key: str) -> Buffer:
        """Forward :meth:`Tier.get`."""
        self._check_key(key)
        await self.before("get", key)
        return await self.inner.get(key)

    async def get_size(self, key: str) -> int:
        """Forward :meth:`Tier.get_size` (the inner tier's, not a read)."""
        self._check_key(key)
        await self.before("get_size", key)
        return await self.inner.get_size(key)

    async def exists(self, key: str) -> bool:
        """Forward :meth:`Tier.exists`."""
        self._check_key(key)
        await self.before("exists", key)
        return await self.inner.exists(key)

    async def delete(self, key: str) -> None:
        """Forward :meth:`Tier.delete`."""
        self._check_key(key)
        await self.before("delete", key)
        await self.inner.delete(key)

    async def list(self, prefix: str = "") -> AsyncIterator[str]:
        """Forward :meth:`Tier.list`."""
        self._check_open()
        await self.before("list", prefix)
        async for key in self.inner.list(prefix):
            yield key

    async def aclose(self) -> None:
        """Close this wrapper, then the inner tier. Idempotent."""
        await super().aclose()
        await self.inner.aclose()


class DelegatedReservation:
    """A reservation of the inner tier, handed out by a :class:`DelegatingTier`.

    Implements :class:`~tiercheck.tiers.Reservation`; ``commit`` and ``abort`` await the
    tier's :meth:`~DelegatingTier.before` first (``"commit"``, ``"abort"``).
    """

    def __init__(self, tier: DelegatingTier, inner: Reservation) -> None:
        self._tier = tier
        #: The inner tier's reservation.
        self.inner = inner

    def __repr__(self) -> str:
        return f"DelegatedReservation({self.inner!r})"

    @property
    def key(self) -> str:
        """The key the buffer is published under on commit."""
        return self.inner.key

    @property
    def buffer(self) -> memoryview:
        """The inner reservation's writable memory."""
        return self.inner.buffer

    async def commit(self) -> None:
        """Publish the buffer (after ``before("commit", key)``)."""
        await self._tier.before("commit", self.inner.key)
        await self.inner.commit()

    async def abort(self) -> None:
        """Discard the reservation (after ``before("abort", key)``)."""
        await self._tier.before("abort", self.inner.key)
        await self.inner.abort()

    def release(self) -> None:
        """Give the buffer back."""
        self.inner.release()


# --- the optional abilities, mixed into a subclass when the inner tier has them ----------------


class _ForwardsReserve(DelegatingTier):
    async def reserve(self, key: str, nbytes: int) -> Reservation:
        """Forward :meth:`SupportsReserve.reserve`; the reservation is wrapped."""
        self._check_key(key)
        await self.before("reserve", key)
        inner = self.inner
        assert isinstance(inner, SupportsReserve)
        return self.wrap_reservation(await inner.reserve(key, nbytes))


class _ForwardsPrepare(DelegatingTier):
    async def prepare(self, nbytes: int) -> bool:
        """Forward :meth:`SupportsPrepare.prepare`."""
        self._check_open()
        await self.before("prepare", "")
        inner = self.inner
        assert isinstance(inner, SupportsPrepare)
        return await inner.prepare(nbytes)


class _ForwardsStopServing(DelegatingTier):
    async def stop_serving(self, timeout: float | None = None) -> bool:
        """Forward :meth:`SupportsStopServing.stop_serving`."""
        await self.before("stop_serving", "")
        inner = self.inner
        assert isinstance(inner, SupportsStopServing)
        return await inner.stop_serving(timeout)


class _ForwardsRangedGet(DelegatingTier):
    async def get_range(self, key: str, start: int, end: int) -> Buffer:
        """Forward :meth:`SupportsRangedGet.get_range` (``before`` sees ``"get_range"``)."""
        self._check_key(key)
        await self.before("get_range", key)
        inner = self.inner
        assert isinstance(inner, SupportsRangedGet)
        return await inner.get_range(key, start, end)


class _ForwardsCopy(DelegatingTier):
    async def copy(self, src: str, dst: str) -> None:
        """Forward :meth:`SupportsCopy.copy` (``before`` sees ``"copy"`` with ``dst``)."""
        self._check_key(src)
        self._check_key(dst)
        await self.before("copy", dst)
        inner = self.inner
        assert isinstance(inner, SupportsCopy)
        await inner.copy(src, dst)


class _ForwardsLeftovers(DelegatingTier):
    async def leftovers(self, writer: WriterClaim | None = None) -> list[Leftover]:
        """Forward :meth:`SupportsLeftovers.leftovers`."""
        self._check_open()
        await self.before("leftovers", "")
        inner = self.inner
        assert isinstance(inner, SupportsLeftovers)
        return await inner.leftovers(writer)

    async def remove_leftovers(
        self, items: Sequence[Leftover], writer: WriterClaim | None = None
    ) -> list[Leftover]:
        """Forward :meth:`SupportsLeftovers.remove_leftovers`."""
        self._check_open()
        await self.before("remove_leftovers", "")
        inner = self.inner
        assert isinstance(inner, SupportsLeftovers)
        return await inner.remove_leftovers(items, writer)


_ABILITIES: Final[tuple[tuple[type, type[DelegatingTier]], ...]] = (
    (SupportsReserve, _ForwardsReserve),
    (SupportsCopy, _ForwardsCopy),
    (SupportsRangedGet, _ForwardsRangedGet),
    (SupportsPrepare, _ForwardsPrepare),
    (SupportsStopServing, _ForwardsStopServing),
    (SupportsLeftovers, _ForwardsLeftovers),
)


def _abilities(inner: Tier) -> tuple[type[DelegatingTier], ...]:
    return tuple(mixin for protocol, mixin in _ABILITIES if isinstance(inner, protocol))


def _class_for(
    cls: type[DelegatingTier], mixins: tuple[type[DelegatingTier], ...]
) -> type[DelegatingTier]:
    """``cls`` with the forwarding of ``mixins`` added (``cls`` itself when there are none)."""
    # A class made here, used again (type(w)(other_inner)), starts from the class it was made of.
    base: type[DelegatingTier] = cls.__dict__.get("_abilities_of", cls)
    return _made(base, mixins) if mixins else base


@functools.cache
def _made(
    base: type[DelegatingTier], mixins: tuple[type[DelegatingTier], ...]
) -> type[DelegatingTier]:
    namespace = {
        "__module__": base.__module__,
        "__qualname__": base.__qualname__,
        "__doc__": base.__doc__,
        "_abilities_of": base,
    }
    # The forwarding comes first in the MRO: an ability follows the inner tier, always.
    return type(base.__name__, (*mixins, base), namespace)
