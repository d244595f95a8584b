"""The one way the engine's ranks talk to each other: :func:`step`.

Each collective is a named :class:`~tiercheck.consistency.protocol.Step` with one message class
(:data:`~tiercheck.consistency.protocol.STEP_MESSAGES`): every rank sends its message and gets
everyone's, by rank -- an all-gather of msgpack bytes on one of the coordinator's channels,
never pickle. The coordinator bounds the wait (``peer_timeout`` for the gloo groups it
creates; a :class:`~tiercheck.testing.LocalGroup` its own ``timeout``); a failure or timeout
comes back as :class:`~tiercheck.errors.PeerUnavailable` naming the step and the channel.

Each message travels in an envelope naming its step and a *tag* (a commit round's version):
after a channel failed and reconnected, the ranks may not be at the same exchange any more
(one timed out of a round that another completed or entered late), and an exchange whose ranks
are not all at the same step and tag is :class:`OutOfStep` -- never one rank's message read as
another's, or a vote of one version counted for another. The commit rounds resynchronize from
there (:mod:`tiercheck.consistency.resync`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from typing import Protocol, TypeVar

import msgpack

from tiercheck._threads import DaemonExecutor
from tiercheck.consistency.coordinator import (
    ChannelDown,
    Coordinator,
    SoloCoordinator,
    TorchCoordinator,
)
from tiercheck.consistency.protocol import STEP_MESSAGES, Message, SessionToken, Step
from tiercheck.errors import PeerUnavailable

__all__ = ["Channels", "OutOfStep", "Side", "step"]

logger = logging.getLogger("tiercheck")

M = TypeVar("M", bound=Message)


class OutOfStep(PeerUnavailable):
    """The ranks met in one exchange while at different steps or tags (after a channel failed
    and reconnected): nobody's message was used.

    :attr:`positions` says where each rank was, by rank: ``(step value, tag)``.
    """

    def __init__(self, message: str, positions: list[tuple[str, int | None]]) -> None:
        super().__init__(message)
        #: Where each rank was, by rank: the step's value and the tag.
        self.positions = positions


class Side(Protocol):
    """What :func:`step` needs: the coordinator, and one serial executor per channel (its
    exchanges must happen in the same order on every rank)."""

    @property
    def coordinator(self) -> Coordinator:
        """The ranks' coordinator."""
        ...

    @property
    def channels(self) -> Mapping[str, Executor]:
        """Channel name -> the single (daemon) thread its exchanges run on."""
        ...


async def step(
    side: Side, which: Step, message: M, *, channel: str = "control", tag: int | None = None
) -> list[M]:
    """Every rank's ``message`` of step ``which`` on ``channel``, by rank (an all-gather).

    ``tag`` names what the exchange is about beyond its step (a commit round's version); every
    rank must be at the same step and tag. A job of one rank exchanges nothing: its own message
    comes back. Raises :class:`~tiercheck.errors.PeerUnavailable` naming the step when the
    exchange failed or timed out (a rank is gone or silent), :class:`OutOfStep` when the ranks
    met at different steps or tags; ``TypeError`` for a message the step does not take.
    """
    kind = STEP_MESSAGES[which]
    if type(message) is not kind:
        raise TypeError(
            f"step {which.value!r} exchanges {kind.__name__}, not {type(message).__name__}"
        )
    coordinator = side.coordinator
    if coordinator.world_size == 1:
        return [message]
    logger.debug(
        "tiercheck: step %r on channel %r (rank %s of %s)",
        which.value,
        channel,
        coordinator.rank,
        coordinator.world_size,
    )
    envelope = {"s": which.value, "t": tag, "m": message.to_wire()}
    packed = msgpack.packb(envelope, use_bin_type=True)
    loop = asyncio.get_running_loop()
    try:
        gathered = await loop.run_in_executor(
            side.channels[channel], coordinator.all_gather, channel, packed
        )
    except ChannelDown as exc:
        raise ChannelDown(f"step {which.value!r} on channel {channel!r}: {exc}") from exc
    except PeerUnavailable as exc:
        raise PeerUnavailable(f"step {which.value!r} on channel {channel!r}: {exc}") from exc
    except Exception as exc:
        exc.add_note(f"tiercheck: in step {which.value!r} on channel {channel!r}")
        raise
    envelopes = [msgpack.unpackb(g, raw=False) for g in gathered]
    positions = [_position(e) for e in envelopes]
    if any(p != (which.value, tag) for p in positions):
        where = ", ".join(
            f"rank {r} at {s!r}" + ("" if t is None else f" of {t}")
            for r, (s, t) in enumerate(positions)
        )
        raise OutOfStep(
            f"step {which.value!r} on channel {channel!r}: the ranks are out of step ({where})",
            positions,
        )
    return [type(message).from_wire(e["m"]) for e in envelopes]


def _position(envelope: object) -> tuple[str, int | None]:
    """The step and tag an envelope names (``("?", None)`` for anything else)."""
    if not isinstance(envelope, dict) or not isinstance(envelope.get("s"), str):
        return ("?", None)
    tag = envelope.get("t")
    return (envelope["s"], tag if isinstance(tag, int) and not isinstance(tag, bool) else None)


class Channels:
    """This rank's side of the exchanges: the coordinator, one serial thread per channel, and
    the session every rank agreed at opening. A :class:`Side`; it changes only through its
    methods (the engine opens it, :mod:`~tiercheck.engine.close.shutdown` closes it)."""

    def __init__(self) -> None:
        self._coordinator: Coordinator = SoloCoordinator()
        # One thread per channel keeps its exchanges in order; daemon threads, because an
        # exchange may wait on a dead rank for minutes and must never delay the process's exit.
        self._executors: dict[str, DaemonExecutor] = {}
        self._session = ""

    @property
    def coordinator(self) -> Coordinator:
        """The ranks' coordinator (a :class:`SoloCoordinator` until :meth:`use`)."""
        return self._coordinator

    @property
    def channels(self) -> Mapping[str, Executor]:
        """Channel name -> the single daemon thread its exchanges run on."""
        return self._executors

    @property
    def session(self) -> str:
        """The session: this opening's token, agreed by every rank (``""`` before
        :meth:`agree_session`)."""
        return self._session

    def add(self, name: str) -> Executor:
        """Open channel ``name`` (its serial thread); returns that thread."""
        executor = self._executors[name] = DaemonExecutor(1, f"tiercheck-sync-{name}")
        return executor

    async def connect(
        self,
        coordinator: Coordinator | None,
        *,
        world_size: int,
        names: Sequence[str],
        timeout: float,
    ) -> None:
        """Open the ``"control"`` channel and exchange through ``coordinator``; without one, a
        job of several ranks makes a :class:`TorchCoordinator` with a group per channel of
        ``names`` (``timeout``: ``peer_timeout``), a job of one rank exchanges nothing."""
        control = self.add("control")
        if coordinator is not None:
            self._coordinator = coordinator
        elif world_size > 1:
            # Creating groups is a collective that waits on every rank: on a daemon thread,
            # like every exchange.
            self._coordinator = await asyncio.get_running_loop().run_in_executor(
                control, lambda: TorchCoordinator(list(names), timeout=timeout)
            )

    async def agree_session(self, token: str) -> str:
        """Step ``SESSION``: every rank proposes ``token``; rank 0's is the session."""
        self._session = (await step(self, Step.SESSION, SessionToken(token)))[0].token
        return self._session

    def close(self) -> None:
        """Stop the channels' threads (an exchange still waiting on a dead rank stays on its
        daemon thread) and close the coordinator's groups."""
        for executor in self._executors.values():
            executor.shutdown(wait=False, cancel_futures=True)
        self._coordinator.close()
