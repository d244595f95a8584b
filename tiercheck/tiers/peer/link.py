"""The peer tier's links to other ranks: store connections, data transfers, down holders.

A holder that fails an exchange is marked down for ``retry_after`` seconds; operations towards
it then fail at once with :class:`~tiercheck.errors.PeerUnavailable` (see
:mod:`tiercheck.tiers.peer`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from tiercheck.errors import PeerUnavailable
from tiercheck.topology import Topology

logger = logging.getLogger("tiercheck")


class _Link:
    """What both sides of the peer tier share: store connections and who is down.

    A part of :class:`~tiercheck.tiers.peer.PeerTier`, which sets these attributes up.
    """

    topology: Topology
    retry_after: float
    _store: Any
    _group: Any
    _local: threading.local
    _down_lock: threading.Lock
    _down_until: dict[int, float]

    def mark_down(self, rank: int, reason: str = "") -> None:
        """Treat holder ``rank`` as unreachable for ``retry_after`` seconds (fail fast).

        For a caller that learned by other means that the rank is gone. Logged once per
        transition to down, like a failure the tier sees itself.
        """
        self._went_down(rank, reason or "marked down by the caller")

    def is_down(self, rank: int) -> bool:
        """Whether operations towards holder ``rank`` currently fail fast."""
        with self._down_lock:
            return time.monotonic() < self._down_until.get(rank, 0.0)

    def _store_here(self) -> Any:
        """A store connection for this thread: one connection serializes its calls."""
        store = getattr(self._local, "store", None)
        if store is None:
            store = self._store.clone()
            self._local.store = store
        return store

    def _check_up(self, dst: int) -> None:
        with self._down_lock:
            left = self._down_until.get(dst, 0.0) - time.monotonic()
        if left > 0:
            raise PeerUnavailable(
                f"rank {dst} (holder of rank {self.topology.rank}'s replicas) is unreachable; "
                f"not trying it again for {left:.0f}s"
            )

    def _went_down(self, dst: int, reason: str) -> PeerUnavailable:
        """Mark ``dst`` down (logging the transition once); the error to raise for it."""
        now = time.monotonic()
        with self._down_lock:
            was_up = now >= self._down_until.get(dst, 0.0)
            self._down_until[dst] = max(self._down_until.get(dst, 0.0), now + self.retry_after)
        if was_up:
            logger.warning(
                "tiercheck: peer tier of rank %s: rank %s is unreachable (%s); operations "
                "towards it fail at once for the next %.0fs",
                self.topology.rank,
                dst,
                reason,
                self.retry_after,
            )
        return PeerUnavailable(
            f"rank {dst} (holder of rank {self.topology.rank}'s replicas) is unreachable: {reason}"
        )

    def _wait_all(self, works: Sequence[Any], peer: int) -> None:
        try:
            for work in works:
                work.wait()  # exactly once per work: a second wait on gloo breaks the pair
        except RuntimeError as exc:
            raise self._went_down(
                peer, f"moving data between ranks {self.topology.rank} and {peer} failed: {exc}"
            ) from exc
