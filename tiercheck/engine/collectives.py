"""The one way the engine's ranks talk to each other: :func:`step`.

Each collective is a named :class:`~tiercheck.consistency.protocol.Step` with one message class
(:data:`~tiercheck.consistency.protocol.STEP_MESSAGES`): every rank sends its message and gets
everyone's, by rank -- an all-gather of msgpack bytes on one of the coordinator's channels,
never pickle. The coordinator bounds the wait (``peer_timeout`` for the gloo groups it
creates; a :class:`~tiercheck.testing.LocalGroup` its own ``timeout``); a failure or timeout
comes back as :class:`~tiercheck.errors.PeerUnavailable` naming the step and the channel.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from concurrent.futures import Executor
from typing import Protocol, TypeVar

import msgpack

from tiercheck.consistency.coordinator import Coordinator
from tiercheck.consistency.protocol import STEP_MESSAGES, Message, Step
from tiercheck.errors import PeerUnavailable

__all__ = ["Side", "step"]

logger = logging.getLogger("tiercheck")

M = TypeVar("M", bound=Message)


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


async def step(side: Side, which: Step, message: M, *, channel: str = "control") -> list[M]:
    """Every rank's ``message`` of step ``which`` on ``channel``, by rank (an all-gather).

    A job of one rank exchanges nothing: its own message comes back. Raises
    :class:`~tiercheck.errors.PeerUnavailable` naming the step when the exchange failed or
    timed out (a rank is gone or silent); ``TypeError`` for a message the step does not take.
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
    packed = msgpack.packb(message.to_wire(), use_bin_type=True)
    loop = asyncio.get_running_loop()
    try:
        gathered = await loop.run_in_executor(
            side.channels[channel], coordinator.all_gather, channel, packed
        )
    except PeerUnavailable as exc:
        raise PeerUnavailable(f"step {which.value!r} on channel {channel!r}: {exc}") from exc
    except Exception as exc:
        exc.add_note(f"tiercheck: in step {which.value!r} on channel {channel!r}")
        raise
    return [type(message).from_wire(msgpack.unpackb(g, raw=False)) for g in gathered]
