"""A Hypothesis state machine that checks any tier against a plain dict, step by step.

:class:`TierStateMachine` runs random sequences of ``put``, ``putv``, ``delete``, reservations
(committed, aborted, dropped, or committed and *held*: not released) and reopens, applies the
same changes to a ``dict``, and after every step checks that the tier and the dict agree: every
key reads back its value (or is absent), sizes and listings match, held buffers keep their
bytes. Hypothesis then shrinks a failure to a short sequence of steps.

It needs ``hypothesis`` (the ``test`` extra). Two ways to use it::

    # a factory: the tier over a fresh folder (the machine makes one per run and removes it)
    from hypothesis.stateful import run_state_machine_as_test
    from tiercheck.testing import TierStateMachine

    def test_my_tier_behaves_like_a_dict():
        run_state_machine_as_test(lambda: TierStateMachine(lambda folder: MyTier(folder)))

    # or a subclass, whose TestCase pytest collects; reopen_tier adds the "reopen" step
    class MyTierMachine(TierStateMachine):
        async def make_tier(self, folder):
            return MyTier(folder)

        async def reopen_tier(self, tier, folder):
            return MyTier(folder)

    TestMyTierMachine = MyTierMachine.TestCase

A subclass may add its own ``@invariant``\\ s (the tier is :attr:`TierStateMachine.tier`, the
dict :attr:`TierStateMachine.model`; :meth:`TierStateMachine.run` runs a coroutine), and change
:attr:`~TierStateMachine.keys` and :attr:`~TierStateMachine.max_size`. The factories may be
plain functions or coroutine functions.

The rules and invariants are plain methods: to replay a failure by hand (or pin one down in a
test), make the machine, call the steps Hypothesis reported and then the invariants, and call
:meth:`~TierStateMachine.teardown` at the end.
"""

from __future__ import annotations

import asyncio
import inspect
import random
import shutil
import tempfile
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from hypothesis import currently_in_test_context, note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tiercheck.errors import BlobNotFound
from tiercheck.tiers.base import Reservation, SupportsReserve, Tier

__all__ = ["TierStateMachine"]

_T = TypeVar("_T")

#: A tier factory: the folder the run may store in -> the tier (or an awaitable of it).
MakeTier = Callable[[Path], Tier | Awaitable[Tier]]
#: A reopening factory: the closed tier and its folder -> a new tier over the same storage.
ReopenTier = Callable[[Tier, Path], Tier | Awaitable[Tier]]

# Draws are indexes and seeds, mapped through the machine's settings, so that a subclass can
# change its keys and sizes without redefining the rules (and Hypothesis shrinks them to 0).
_WHICH = st.integers(min_value=0, max_value=63)
_SIZE = st.integers(min_value=0, max_value=1 << 20)
_SEED = st.integers(min_value=0, max_value=1 << 16)


def _data(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)


class TierStateMachine(RuleBasedStateMachine):
    """Checks a tier against a dict after every step; see the module docstring.

    ``TierStateMachine(make_tier=None, *, reopen_tier=None)``: factories for the tier, used
    by the default :meth:`make_tier` and :meth:`reopen_tier`; a subclass overrides those
    methods instead. Without a way to reopen, the "reopen" step is never taken; a tier without
    :class:`~tiercheck.tiers.SupportsReserve` never takes the reservation steps.
    """

    #: The keys the steps use; none may be the folder of another (``a`` and ``a/b``).
    keys: ClassVar[tuple[str, ...]] = ("k0", "k1", "d/k2", "d/k3", "d/e/k4")
    #: The largest blob (and reservation) a step stores, in bytes.
    max_size: ClassVar[int] = 3000

    def __init__(
        self, make_tier: MakeTier | None = None, *, reopen_tier: ReopenTier | None = None
    ) -> None:
        super().__init__()
        self._make = make_tier
        self._reopen = reopen_tier
        self._loop = asyncio.new_event_loop()
        self.folder = Path(tempfile.mkdtemp(prefix="tiercheck-machine-"))
        #: What the tier must hold: key -> bytes.
        self.model: dict[str, bytes] = {}
        #: Committed reservations not released yet, with the bytes their buffers must show.
        self.held: list[tuple[Reservation, bytes]] = []
        try:
            #: The tier under test.
            self.tier: Tier = self.run(self.make_tier(self.folder))
        except BaseException:
            self._shut_down()
            raise
        self.reserving = isinstance(self.tier, SupportsReserve)
        self.reopens = self._reopen is not None or (
            type(self).reopen_tier is not TierStateMachine.reopen_tier
        )

    # --- hooks --------------------------------------------------------------------------------

    async def make_tier(self, folder: Path) -> Tier:
        """A fresh, empty tier that may store under ``folder``. Override, or pass a factory."""
        if self._make is None:
            raise NotImplementedError(
                f"{type(self).__name__} needs a tier: pass make_tier= or override make_tier"
            )
        return await _resolve(self._make(folder))

    async def reopen_tier(self, tier: Tier, folder: Path) -> Tier:
        """A new tier over the storage of ``tier`` (closed by then). Override, or pass one."""
        if self._reopen is None:
            raise NotImplementedError(f"{type(self).__name__} cannot reopen its tier")
        return await _resolve(self._reopen(tier, folder))

    async def destroy_tier(self, tier: Tier) -> None:
        """Remove what a run stored outside :attr:`folder` (the tier is closed). Does nothing."""

    def run(self, coroutine: Coroutine[Any, Any, _T]) -> _T:
        """Run ``coroutine`` on the machine's own event loop and return its result."""
        return self._loop.run_until_complete(coroutine)

    # --- steps --------------------------------------------------------------------------------

    def _key(self, which: int) -> str:
        return self.keys[which % len(self.keys)]

    def _size(self, size: int) -> int:
        return size % (self.max_size + 1)

    @rule(which=_WHICH, size=_SIZE, seed=_SEED)
    def put(self, which: int, size: int, seed: int) -> None:
        """Store a blob (or replace one)."""
        key, data = self._key(which), _data(self._size(size), seed)
        _note(f"put {key!r}: {len(data)} bytes")
        self.run(self.tier.put(key, data))
        self.model[key] = data

    @rule(which=_WHICH, sizes=st.lists(_SIZE, max_size=4), seed=_SEED)
    def putv(self, which: int, sizes: list[int], seed: int) -> None:
        """Store the concatenation of a few parts (some may be empty, or none at all)."""
        key = self._key(which)
        parts = [_data(self._size(s) // 2, seed + i) for i, s in enumerate(sizes)]
        _note(f"putv {key!r}: parts of {[len(p) for p in parts]} bytes")
        self.run(self.tier.putv(key, parts))
        self.model[key] = b"".join(parts)

    @rule(which=_WHICH)
    def delete(self, which: int) -> None:
        """Delete a key, stored or not."""
        key = self._key(which)
        _note(f"delete {key!r}")
        self.run(self.tier.delete(key))
        self.model.pop(key, None)

    @precondition(lambda self: self.reserving)
    @rule(
        which=_WHICH,
        size=_SIZE,
        seed=_SEED,
        end=st.sampled_from(["commit", "hold", "abort", "drop"]),
    )
    def reserve(self, which: int, size: int, seed: int, end: str) -> None:
        """Fill a reservation, then commit (and release or hold it), abort, or just release."""
        key, data = self._key(which), _data(self._size(size), seed)
        _note(f"reserve {key!r}: {len(data)} bytes, then {end}")
        tier = self.tier
        assert isinstance(tier, SupportsReserve)
        reservation = self.run(tier.reserve(key, len(data)))
        reservation.buffer[:] = data
        if end in ("commit", "hold"):
            self.run(reservation.commit())
            self.model[key] = data
        elif end == "abort":
            self.run(reservation.abort())
        if end == "hold":
            self.held.append((reservation, data))
        else:
            reservation.release()

    @precondition(lambda self: bool(self.held))
    @rule(which=_WHICH)
    def release(self, which: int) -> None:
        """Release one held reservation."""
        reservation, _ = self.held.pop(which % len(self.held))
        _note(f"release the held reservation of {reservation.key!r}")
        reservation.release()

    @precondition(lambda self: self.reopens)
    @rule()
    def reopen(self) -> None:
        """Close the tier and open its storage anew (held reservations stay held)."""
        _note("reopen")
        old = self.tier
        self.run(old.aclose())
        self.tier = self.run(self.reopen_tier(old, self.folder))
        assert self.tier is not old, "reopen_tier must return a new instance"

    # --- what must hold after every step ------------------------------------------------------

    @invariant()
    def every_key_reads_back_its_value(self) -> None:
        """A stored key is found with its size and bytes; any other is absent."""
        for key in self.keys:
            if key in self.model:
                expected = self.model[key]
                assert self.run(self.tier.exists(key)), f"{key!r} is missing"
                assert self.run(self.tier.get_size(key)) == len(expected), key
                got = memoryview(self.run(self.tier.get(key))).cast("B")
                assert got.tobytes() == expected, f"{key!r} does not read back what was stored"
            else:
                assert not self.run(self.tier.exists(key)), f"{key!r} should be absent"
                try:
                    self.run(self.tier.get(key))
                except BlobNotFound:
                    continue
                raise AssertionError(f"get of the absent key {key!r} did not raise BlobNotFound")

    @invariant()
    def listing_matches(self) -> None:
        """The listing, whole and by prefix, is the model's keys."""
        for prefix in sorted({"", *(k.rpartition("/")[0] + "/" for k in self.keys if "/" in k)}):
            listed = self.run(_collect(self.tier, prefix))
            expected = sorted(k for k in self.model if k.startswith(prefix))
            assert listed == expected, f"list({prefix!r}) gave {listed}, expected {expected}"

    @invariant()
    def held_buffers_keep_their_bytes(self) -> None:
        """A committed, unreleased buffer shows its bytes, whatever happened to its key since."""
        for reservation, data in self.held:
            assert reservation.buffer.tobytes() == data, (
                f"the held buffer of {reservation.key!r} changed"
            )

    # --- the end of a run ---------------------------------------------------------------------

    def teardown(self) -> None:
        """Release, close and destroy the tier; remove the folder; close the event loop."""
        try:
            for reservation, _ in self.held:
                reservation.release()
            self.held.clear()
            if hasattr(self, "tier"):
                self.run(self.tier.aclose())
                self.run(self.destroy_tier(self.tier))
        finally:
            self._shut_down()

    def _shut_down(self) -> None:
        try:
            self._loop.run_until_complete(self._loop.shutdown_default_executor())
        finally:
            self._loop.close()
            shutil.rmtree(self.folder, ignore_errors=True)


def _note(text: str) -> None:
    """Note a step for Hypothesis's report; outside a Hypothesis run (steps taken by hand, as
    when replaying a failure), there is nothing to note it in."""
    if currently_in_test_context():
        note(text)


async def _resolve(made: Tier | Awaitable[Tier]) -> Tier:
    tier = await made if inspect.isawaitable(made) else made
    if not isinstance(tier, Tier):
        raise TypeError(f"the tier factory returned {type(tier).__name__}, not a Tier")
    return tier


async def _collect(tier: Tier, prefix: str) -> list[str]:
    return sorted([key async for key in tier.list(prefix)])
