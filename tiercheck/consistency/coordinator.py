"""How ranks agree: a small all-gather of bytes on named side channels.

Global commit watermarks, the ``COMMIT`` record's contents and the recovery agreement all reduce
to "every rank contributes a few bytes and everyone sees all of them". Each *channel* is an
ordered stream of such exchanges: calls on one channel happen in the same order on every rank,
and channels are independent of each other (one per tier, plus ``"control"``), so a slow
persistent upload never holds back the commit of the local tier.

Calls are blocking and are made from worker threads, never from the event loop and never on
the training's own process group: the distributed coordinator creates dedicated gloo groups.
"""

from __future__ import annotations

import datetime
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence

from tiercheck.errors import ConfigError, PeerUnavailable

__all__ = ["Coordinator", "SoloCoordinator", "TorchCoordinator"]


class Coordinator(ABC):
    """Exchanges between the ranks of one job, on named channels."""

    rank: int
    world_size: int

    @abstractmethod
    def all_gather(self, channel: str, payload: bytes) -> list[bytes]:
        """Contribute ``payload``; return every rank's payload, indexed by rank (blocking)."""

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
                raise PeerUnavailable(
                    f"exchange on channel {channel!r} failed or timed out after {self.timeout}s "
                    f"(rank {self.rank} of {self.world_size}): {exc}"
                ) from exc
        return [bytes(t[: int(s.item())].numpy()) for t, s in zip(out, sizes, strict=True)]

    def close(self) -> None:
        """Destroy the dedicated groups (best effort: the default group may already be gone)."""
        import torch.distributed as dist

        if dist.is_initialized():
            for group in self._groups.values():
                dist.destroy_process_group(group)
        self._groups.clear()
