"""The peer tier's links to other ranks: store connections, data transfers, down holders.

A holder that fails an exchange is marked down for ``retry_after`` seconds; operations towards
it then fail at once with :class:`~tiercheck.errors.PeerUnavailable` (see
:mod:`tiercheck.tiers.peer`).

Data moves over gloo. A transfer that fails or times out (a rank paused in the middle of one)
makes gloo close the connection between the two ranks for good, so no later transfer between
them could work. Each pair of ranks therefore has an *epoch* in the store, 0 to begin with:
transfers of epoch 0 use the tier's group; a failed transfer moves the pair to the next epoch
(compare-and-set: once however many see it), and transfers of a later epoch use a gloo group
of just the two ranks, made for that epoch through the store by both of them after the holder
said "ready". Every request names the epoch it was made in.
"""

from __future__ import annotations

import concurrent.futures
import datetime
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
    timeout: float
    _store: Any
    _group: Any
    _local: threading.local
    _down_lock: threading.Lock
    _down_until: dict[int, float]
    #: Groups of two for transfers with a peer after epoch 0: peer -> (epoch, group).
    _pairs: dict[int, tuple[int, Any]]
    _pair_locks: dict[int, threading.Lock]
    #: A pair's group being made: peer -> (epoch, its future); the newest epoch tried.
    _building: dict[int, tuple[int, concurrent.futures.Future[Any]]]
    _tried: dict[int, int]

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

    # --- transfers: epochs and groups of two ---------------------------------------------------

    def _pair_key(self, peer: int) -> str:
        low, high = sorted((self.topology.rank, peer))
        return f"pair/{low}-{high}"

    def _pair_epoch(self, peer: int) -> int:
        """The epoch transfers with ``peer`` use now (``add`` of 0 reads it, 0 when unset)."""
        return int(self._store_here().add(f"{self._pair_key(peer)}/epoch", 0))

    def _epoch_over(self, peer: int, epoch: int) -> str | None:
        """Why a request from ``peer`` that names ``epoch`` moves no data: the pair has left
        that epoch (its sender read it before a transfer failed), and no group of it is made
        again (see :meth:`_transfer_group`); its sender's next request names the new one."""
        now = self._pair_epoch(peer)
        if epoch >= now:
            return None
        return f"the request names the pair's epoch {epoch}, which is over (it is {now} now)"

    def _pair_broke(self, peer: int, epoch: int) -> None:
        """A transfer with ``peer`` at ``epoch`` failed: gloo may have closed the connection
        for good, so the pair moves to the next epoch (once, however many saw it) and this
        side drops its group of that epoch."""
        try:
            self._store_here().compare_set(
                f"{self._pair_key(peer)}/epoch", str(epoch), str(epoch + 1)
            )
        except Exception as exc:  # the store is gone too: the next request fails on it
            logger.warning("tiercheck: cannot move the pair with rank %s on: %r", peer, exc)
        with self._pair_lock(peer):
            if self._pairs.get(peer, (None, None))[0] == epoch:
                del self._pairs[peer]

    def _pair_lock(self, peer: int) -> threading.Lock:
        with self._down_lock:
            return self._pair_locks.setdefault(peer, threading.Lock())

    def _transfer_group(self, peer: int, epoch: int) -> tuple[Any, int]:
        """The group a transfer with ``peer`` at ``epoch`` uses, and ``peer``'s rank in it:
        the tier's group at epoch 0, else the pair's group of that epoch (made here, with the
        other side making it at the same time, when this side has none yet).

        Making a pair's group is a rendezvous of the two sides, and a side that gave up on it
        leaves the other connecting to an address nobody listens on (for the gloo connect
        timeout, ten seconds and more, while it may hold the holder's server thread: chaos
        soak seed 4101). So a group is made on a thread of its own and waited for at most
        twice ``timeout``: past that the epoch counts as broken (the caller moves the pair on)
        and whatever that thread makes later is dropped. Each side tries each epoch once: an
        epoch older than one tried already is refused, never made a second time over the same
        keys in the store."""
        if epoch == 0:
            return self._group, peer
        other = 1 if self.topology.rank < peer else 0
        with self._pair_lock(peer):
            held = self._pairs.get(peer)
            if held is not None and held[0] == epoch:
                return held[1], other
            building = self._building.get(peer)
            if building is None or building[0] != epoch:
                if epoch <= self._tried.get(peer, 0):
                    raise self._went_down(
                        peer, f"the pair's epoch {epoch} is over (epoch {self._tried[peer]} tried)"
                    )
                future: concurrent.futures.Future[Any] = concurrent.futures.Future()
                threading.Thread(
                    target=self._make_pair_group,
                    args=(peer, epoch, 1 - other, future),
                    name=f"tiercheck-peer-pair-{peer}-{epoch}",
                    daemon=True,
                ).start()
                building = self._building[peer] = (epoch, future)
                self._tried[peer] = epoch
        try:
            group = building[1].result(timeout=2 * self.timeout)
        except concurrent.futures.TimeoutError as exc:
            raise self._went_down(
                peer, f"the pair's group of epoch {epoch} was not made within {2 * self.timeout}s"
            ) from exc
        except Exception as exc:
            raise self._went_down(peer, f"making the pair's group of epoch {epoch}: {exc}") from exc
        with self._pair_lock(peer):
            if self._building.get(peer, (None, None))[0] == epoch:
                del self._building[peer]
            held = self._pairs.get(peer)
            if held is None or held[0] < epoch:
                self._pairs[peer] = (epoch, group)
        return group, other

    def _make_pair_group(
        self, peer: int, epoch: int, me: int, future: concurrent.futures.Future[Any]
    ) -> None:
        """Make the pair's gloo group of ``epoch`` (``me``: this side's rank in it) into
        ``future``; on its own store connection, whose waits are bounded by the tier's."""
        try:
            from torch.distributed.distributed_c10d import PrefixStore, ProcessGroupGloo

            store = self._store.clone()
            store.set_timeout(datetime.timedelta(seconds=2 * self.timeout))
            group = ProcessGroupGloo(
                PrefixStore(f"{self._pair_key(peer)}/{epoch}/", store),
                me,
                2,
                datetime.timedelta(seconds=self.timeout),
            )
        except Exception as exc:
            future.set_exception(exc)
            return
        future.set_result(group)

    def _isend(self, group: Any, peer: int, tensor: Any, tag: int) -> Any:
        """Start sending ``tensor`` to ``peer`` (its rank in ``group``) on ``group``."""
        import torch.distributed as dist

        if group is self._group:
            return dist.isend(tensor, peer, group=group, tag=tag)
        return group.send([tensor], peer, tag)

    def _irecv(self, group: Any, peer: int, tensor: Any, tag: int) -> Any:
        """Start receiving ``tensor`` from ``peer`` (its rank in ``group``) on ``group``."""
        import torch.distributed as dist

        if group is self._group:
            return dist.irecv(tensor, peer, group=group, tag=tag)
        return group.recv([tensor], peer, tag)
