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

A channel whose exchange failed is **broken** until it reconnects: gloo closes its connections
when a collective times out, so the channel's group can never exchange again. The distributed
coordinator then connects the channel anew -- a fresh gloo group under a new *epoch*, agreed
through the job's key-value store -- at the next call that needs it; a rank that paused for longer
than the timeout rejoins that way. A failed reconnection makes the channel fail at once for a
while (half the timeout) before the next try, so a rank that is gone for good costs each tier
about two timeouts, not one per save. What a reconnection cannot tell is where the exchanges
stand: some ranks may have completed the exchange that failed on others. The callers tag their
exchanges and resynchronize (:mod:`tiercheck.engine.collectives`,
:mod:`tiercheck.consistency.resync`).
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

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

    A channel whose exchange failed is connected anew by the next call on it (see the module
    docstring): a fresh gloo group, made outside ``torch.distributed``'s own registry (so
    nothing the training does with its groups is disturbed), under a key-value store prefix
    that names the channel and its epoch. Every rank that saw a failure moves the channel to
    the next epoch in the store (compare-and-set, so concurrent failures move it once), and
    every rank joins the epoch the store names.

    Args:
        channels: the channel names; one gloo group is created for each.
        timeout: seconds an exchange may wait for the slowest rank before failing with
            :class:`~tiercheck.errors.PeerUnavailable` (a dead rank never hangs training);
            also the bound of one reconnection.
    """

    def __init__(self, channels: Sequence[str], *, timeout: float = 300.0) -> None:
        import torch
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
        names = sorted(set(channels))
        #: The channel's current group; ``None`` once an exchange on it failed.
        self._groups: dict[str, Any] = {
            name: dist.new_group(backend="gloo", timeout=delta) for name in names
        }
        # The groups made here are in torch's registry (close destroys them), later ones not.
        self._registered = dict(self._groups)
        self._locks = {name: threading.Lock() for name in self._groups}
        #: Channels whose last exchange or reconnection failed, and why.
        self._broken: dict[str, str] = {}
        #: The epoch of each channel's current group (0: the group made here).
        self._epochs = dict.fromkeys(names, 0)
        #: Until when (monotonic) a channel whose reconnection failed fails at once.
        self._quiet_until: dict[str, float] = {}
        # One token per coordinator, the same on every rank: the store keys of this job's
        # reconnections never meet those of another incarnation sharing the store.
        token = torch.frombuffer(bytearray(os.urandom(8)), dtype=torch.uint8)
        tokens = [torch.empty_like(token) for _ in range(self.world_size)]
        self._groups[names[0]].allgather([tokens], [token]).wait()
        self._prefix = f"tiercheck/channels/{bytes(tokens[0].numpy()).hex()}"
        self._store: Any = None
        try:
            from torch.distributed.distributed_c10d import _get_default_store

            self._store = _get_default_store()
        except Exception as exc:  # a private helper of torch: do without reconnections
            logger.warning(
                "tiercheck: the job's key-value store is not reachable (%r); a coordination "
                "channel whose exchange fails will not reconnect",
                exc,
            )

    def all_gather(self, channel: str, payload: bytes) -> list[bytes]:
        """All-gather ``payload`` on the channel's own gloo group (sizes first, then bytes);
        connect the channel anew first when its last exchange failed."""
        import torch

        if channel not in self._groups:
            raise ConfigError(
                f"unknown coordination channel {channel!r}; known: {sorted(self._groups)}"
            )
        with self._locks[channel]:
            group = self._groups[channel]
            if group is None:
                group = self._reconnect(channel)
            try:
                size = torch.tensor([len(payload)], dtype=torch.int64)
                sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
                group.allgather([sizes], [size]).wait()
                longest = max(int(s.item()) for s in sizes)
                mine = torch.zeros(max(longest, 1), dtype=torch.uint8)
                if payload:
                    mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
                out = [torch.empty_like(mine) for _ in range(self.world_size)]
                group.allgather([out], [mine]).wait()
            except RuntimeError as exc:
                self._broken[channel] = f"{type(exc).__name__}: {exc}"[:300]
                # gloo closed the group's connections: this group is done with. The next call
                # connects anew (where the store allows it).
                self._groups[channel] = None
                self._next_epoch(channel, self._epochs[channel])
                raise PeerUnavailable(
                    f"exchange on channel {channel!r} failed or timed out after {self.timeout}s "
                    f"(rank {self.rank} of {self.world_size}): {exc}"
                ) from exc
            if self._broken.pop(channel, None) is not None:
                logger.warning(
                    "tiercheck: the coordination channel %r works again (epoch %s)",
                    channel,
                    self._epochs[channel],
                )
        return [bytes(t[: int(s.item())].numpy()) for t, s in zip(out, sizes, strict=True)]

    def _epoch_key(self, channel: str) -> str:
        return f"{self._prefix}/{channel}/epoch"

    def _next_epoch(self, channel: str, failed: int) -> None:
        """Move the channel past epoch ``failed`` in the store, unless a rank did already."""
        if self._store is None:
            return
        try:
            # An absent key is epoch 0; compare-and-set moves it once however many ranks fail.
            self._store.compare_set(
                self._epoch_key(channel), str(failed) if failed else "", str(failed + 1)
            )
        except Exception as exc:
            logger.warning(
                "tiercheck: cannot move channel %r to a new epoch in the store: %r", channel, exc
            )

    def _reconnect(self, channel: str) -> Any:
        """A new gloo group for ``channel`` at the epoch the store names (every rank that
        saw the failure joins the same one); :class:`PeerUnavailable` when it cannot be made."""
        from torch.distributed.distributed_c10d import PrefixStore, ProcessGroupGloo

        why = self._broken.get(channel, "an earlier exchange failed")
        if self._store is None:
            raise PeerUnavailable(
                f"channel {channel!r} is broken since an earlier exchange failed ({why}) and "
                f"cannot reconnect without the job's key-value store; rank {self.rank} does not "
                "use it again"
            )
        left = self._quiet_until.get(channel, 0.0) - time.monotonic()
        if left > 0:
            raise PeerUnavailable(
                f"channel {channel!r} is broken ({why}); rank {self.rank} tries to reconnect it "
                f"in {left:.1f}s"
            )
        epoch = self._epochs[channel]
        try:
            key = self._epoch_key(channel)
            if self._store.check([key]):
                epoch = max(epoch, int(self._store.get(key).decode() or 0))
            group = ProcessGroupGloo(
                PrefixStore(f"{self._prefix}/{channel}/{epoch}/", self._store),
                self.rank,
                self.world_size,
                datetime.timedelta(seconds=self.timeout),
            )
        except Exception as exc:
            # The others did not all come (a rank is still paused, or gone): give this epoch
            # up, so that nobody joins it again, and stay quiet for a while.
            self._next_epoch(channel, epoch)
            self._epochs[channel] = epoch
            self._quiet_until[channel] = time.monotonic() + self.timeout / 2
            self._broken[channel] = f"reconnecting failed: {type(exc).__name__}: {exc}"[:300]
            raise PeerUnavailable(
                f"channel {channel!r} could not reconnect within {self.timeout}s (epoch "
                f"{epoch}, rank {self.rank} of {self.world_size}): {exc}"
            ) from exc
        self._epochs[channel] = epoch
        self._groups[channel] = group
        return group

    @property
    def broken(self) -> str | None:
        """The failure of the first channel that is broken now (its last exchange or
        reconnection failed), if any."""
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
        for name in list(self._groups):
            lock = self._locks[name]
            if not lock.acquire(blocking=False):
                busy.append(name)
                continue
            try:
                registered = self._registered.pop(name)
                if dist.is_initialized():
                    dist.destroy_process_group(registered)
                # A group of a later epoch is not in torch's registry: dropping it is enough.
            except (RuntimeError, ValueError) as exc:  # already destroyed with the default group
                logger.debug("tiercheck: destroying the %r channel's group: %r", name, exc)
            finally:
                lock.release()
            del self._groups[name]
        if busy:
            logger.debug("tiercheck: channels %s still exchanging; their groups are left", busy)
