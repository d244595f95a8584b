"""Several ranks of one job inside one process, for fast tests of multi-rank behaviour.

:class:`LocalGroup` connects N checkpointers running in one process (each on its own thread,
each with its own memory root) the way a real job's ranks are connected: each gets a
:class:`~tiercheck.consistency.coordinator.Coordinator` from :meth:`LocalGroup.coordinator`, and
their exchanges meet in memory. ``group.fail()`` makes every pending and later exchange fail,
as a dead rank would. Example::

    group = LocalGroup(2)

    def rank(r):
        with SyncCheckpointer("job", rank=r, world_size=2, coordinator=group.coordinator(r),
                              local_root=root / f"node{r}", persistent=url) as ckpt:
            ckpt.save(0, state_of(r))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]

The peer tier needs ``torch.distributed`` and is not available this way.
"""

from __future__ import annotations

import threading
from collections import defaultdict

from tiercheck.consistency.coordinator import Coordinator
from tiercheck.errors import PeerUnavailable

__all__ = ["LocalGroup", "ThreadCoordinator"]


class LocalGroup:
    """The meeting point of the in-process ranks of one job.

    Args:
        world_size: how many ranks take part.
        timeout: seconds an exchange waits for the slowest rank before failing with
            :class:`~tiercheck.errors.PeerUnavailable`.
    """

    def __init__(self, world_size: int, *, timeout: float = 60.0) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.timeout = timeout
        self._cond = threading.Condition()
        # (channel, exchange number) -> rank -> payload; removed once every rank has read it.
        self._slots: dict[tuple[str, int], dict[int, bytes]] = {}
        self._readers: dict[tuple[str, int], int] = defaultdict(int)
        self._next: dict[tuple[str, int], int] = defaultdict(int)
        self._failed = False

    def coordinator(self, rank: int) -> ThreadCoordinator:
        """The coordinator of ``rank``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        return ThreadCoordinator(self, rank)

    def fail(self) -> None:
        """Make every pending and later exchange fail, as when a rank dies."""
        with self._cond:
            self._failed = True
            self._cond.notify_all()

    def _gather(self, channel: str, rank: int, payload: bytes) -> list[bytes]:
        with self._cond:
            if self._failed:
                raise PeerUnavailable(f"the local group failed (channel {channel!r})")
            n = self._next[(channel, rank)]
            self._next[(channel, rank)] = n + 1
            slot = self._slots.setdefault((channel, n), {})
            slot[rank] = payload
            self._cond.notify_all()
            done = self._cond.wait_for(
                lambda: self._failed or len(slot) == self.world_size, self.timeout
            )
            if self._failed or not done:
                raise PeerUnavailable(
                    f"exchange {n} on channel {channel!r} failed or timed out after "
                    f"{self.timeout}s (rank {rank} of {self.world_size}; "
                    f"{len(slot)} ranks arrived)"
                )
            out = [slot[r] for r in range(self.world_size)]
            self._readers[(channel, n)] += 1
            if self._readers[(channel, n)] == self.world_size:
                del self._slots[(channel, n)], self._readers[(channel, n)]
            return out


class ThreadCoordinator(Coordinator):
    """One rank's view of a :class:`LocalGroup`."""

    def __init__(self, group: LocalGroup, rank: int) -> None:
        self.group = group
        self.rank = rank
        self.world_size = group.world_size

    def all_gather(self, channel: str, payload: bytes) -> list[bytes]:
        """Contribute ``payload``; every rank's payload, by rank, once all have contributed."""
        return self.group._gather(channel, self.rank, bytes(payload))
