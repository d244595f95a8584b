"""How ranks agree: a small all-gather of bytes on named side channels.

Global commit watermarks, the ``COMMIT`` record's contents and the recovery agreement all reduce
to "every rank contributes a few bytes and everyone sees all of them". Each *channel* is an
ordered stream of such exchanges: calls on one channel happen in the same order on every rank,
and channels are independent of each other (one per tier, plus ``"control"``), so a slow
persistent upload never holds back the commit of the local tier.

Calls are blocking and are made from worker threads, never from the event loop and never on
the training's own process group: the distributed coordinator creates dedicated gloo groups.
The checkpointer makes them on daemon threads (:mod:`tiercheck._threads`): an exchange waiting
on a dead rank never keeps the process alive at exit.

A channel whose exchange failed is **broken** for good: after a failed or timed-out gloo
collective the ranks no longer agree on where the stream stands (some may have completed the
exchange that failed on others), so every later call on that channel fails at once with
:class:`~tiercheck.errors.PeerUnavailable` instead of waiting for a timeout again.
"""

from __future__ import annotations

import datetime
import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence

from tiercheck.errors import ConfigError, PeerUnavailable

__all__ = ["Coordinator", "SoloCoordinator", "TorchCoordinator"]

logger = logging.getLogger("tiercheck")


class Coordinator(ABC):
    """Exchanges between the ranks of one job, on named channels."""

    rank: int
    world_size: int

    @abstractmethod
    def all_gather(self, channel: str, payload: bytes) -> list[bytes]:
        """Contribute ``payload``; return every rank's payload, indexed by rank (blocking)."""

    @property
    def broken(self) -> str | None:
        """Why exchanges can no longer succeed (an exchange failed: a rank is gone), or
        ``None``. Every commit needs every rank, so a caller may stop waiting for one."""
        return None

    def close(self) -> None:  # noqa: B027 - a no-op default is the right default here
        """Release resources."""


class SoloCoordinator(Coordinator):
    """A job of one rank: every exchange returns the rank's own payload."""

    def __init__(self) -> None:
        self.rank = 0
        self.world_size = 1

    def all_gather(self, channel: str, payload: bytes) -> list[bytes]:
        """Return ``[payload]``."""
        return [payload]


class TorchCoordinator(Coordinator):
    """Exchanges over dedicated gloo process groups, one per channel.

    Must be constructed on every rank, in the same order relative to other group creations,
    after ``torch.distributed`` is initialized (creating a group is itself a collective).

    Args:
        channels: the channel names; one gloo group is created for each.
        timeout: seconds an exchange may wait for the slowest rank before failing with
            :class:`~tiercheck.errors.PeerUnavailable` (a dead rank never hangs training).
    """

    def __init__(self, channels: Sequence[str], *, timeout: float = 300.0) -> None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError(
                "TorchCoordinator needs torch.distributed initialized "
                "(call torch.distributed.init_process_group first)"
            )
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.timeout = timeout
        delta = datetime.timedelta(seconds=timeout)
        self._groups = {
            name: dist.new_group(backend="gloo", timeout=delta) for name in sorted(set(channels))
        }
        self._locks = {name: threading.Lock() for name in self._groups}
        self._broken: dict[str, str] = {}

    def all_gather(self, channel: str, payload: bytes) -> list[bytes]:
        """All-gather ``payload`` on the channel's own gloo group (sizes first, then bytes)."""
        import torch
        import torch.distributed as dist

        try:
            group = self._groups[channel]
        except KeyError:
            raise ConfigError(
                f"unknown coordination channel {channel!r}; known: {sorted(self._groups)}"
            ) from None
        with self._locks[channel]:
            if channel in self._broken:
                raise PeerUnavailable(
                    f"channel {channel!r} is broken since an earlier exchange failed "
                    f"({self._broken[channel]}); rank {self.rank} does not use it again"
                )
            try:
                size = torch.tensor([len(payload)], dtype=torch.int64)
                sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
                dist.all_gather(sizes, size, group=group)
                longest = max(int(s.item()) for s in sizes)
                mine = torch.zeros(max(longest, 1), dtype=torch.uint8)
                if payload:
                    mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
                out = [torch.empty_like(mine) for _ in range(self.world_size)]
                dist.all_gather(out, mine, group=group)
            except RuntimeError as exc:
                self._broken[channel] = f"{type(exc).__name__}: {exc}"[:300]
                raise PeerUnavailable(
                    f"exchange on channel {channel!r} failed or timed out after {self.timeout}s "
                    f"(rank {self.rank} of {self.world_size}): {exc}"
                ) from exc
        return [bytes(t[: int(s.item())].numpy()) for t, s in zip(out, sizes, strict=True)]

    @property
    def broken(self) -> str | None:
        """The failure of the first channel that broke, if any."""
        return next(iter(self._broken.values()), None)

    def close(self) -> None:
        """Destroy the dedicated groups that no exchange is using (no store traffic: a gloo
        group is torn down locally).

        A group whose exchange is still in flight (a rank died mid-exchange and the call waits
        for its timeout on a daemon thread) is left alone: destroying it would wait for that
        exchange. Best effort: the default group may already be gone.
        """
        import torch.distributed as dist

        busy = []
        for name, group in list(self._groups.items()):
            lock = self._locks[name]
            if not lock.acquire(blocking=False):
                busy.append(name)
                continue
            try:
                if dist.is_initialized():
                    dist.destroy_process_group(group)
            except (RuntimeError, ValueError) as exc:  # already destroyed with the default group
                logger.debug("tiercheck: destroying the %r channel's group: %r", name, exc)
            finally:
                lock.release()
            del self._groups[name]
        if busy:
            logger.debug("tiercheck: channels %s still exchanging; their groups are left", busy)
