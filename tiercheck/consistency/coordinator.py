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
through the job's key-value store -- on a thread of its own that tries again and again, each try
bounded by the timeout, until every rank has joined one epoch; a rank that paused for longer
than the timeout rejoins that way as soon as it sees its own exchange fail. Meanwhile a call on
the channel waits for the reconnection until the timeout has passed since the channel broke,
and then fails without having sent anything (:class:`ChannelDown`); once that much time has
passed, a call fails at once until the channel is joined again -- so the rounds queued behind a
rank that is gone fail together within one timeout, not one timeout each (chaos soak seed 6104:
twelve queued commit rounds held a close for a minute). Calls come from the tiers' round
workers, never from training.
(Tries made only when a call came could miss each other for as long as the saves went on: each
rank gave up an epoch while the other was between calls.) What a reconnection cannot tell is
where the exchanges stand: some ranks may have completed the exchange that failed on others. The
callers tag their exchanges and resynchronize (:mod:`tiercheck.engine.collectives`,
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

__all__ = ["ChannelDown", "Coordinator", "SoloCoordinator", "TorchCoordinator"]

logger = logging.getLogger("tiercheck")


class ChannelDown(PeerUnavailable):
    """A call on a broken channel that did not reconnect in time: nothing of it was sent, so
    no other rank can have used it."""


def _channel_down(
    channel: str, why: str, rank: int, timeout: float, since: float | None
) -> ChannelDown:
    """The error of a call on the broken ``channel``: broken ``since`` seconds ago, ``None``
    when it cannot reconnect at all (no key-value store)."""
    if since is None:
        return ChannelDown(
            f"channel {channel!r} is broken since an earlier exchange failed ({why}) and "
            f"cannot reconnect without the job's key-value store; rank {rank} does not use it "
            "again"
        )
    return ChannelDown(
        f"channel {channel!r} is broken ({why}); rank {rank} has not reconnected it in the "
        f"{since:.0f}s since (timeout {timeout}s) and keeps trying (every rank joins once its "
        "own exchange on it fails)"
    )


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

    A channel whose exchange failed is connected anew on a thread of its own (see the module
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
        #: The channels whose reconnection thread runs.
        self._reconnecting: set[str] = set()
        #: Set while the channel has a group (cleared when it breaks, set when it rejoins).
        self._joined = {name: threading.Event() for name in names}
        #: When each broken channel broke (monotonic): its calls wait until a timeout after.
        self._broke_at: dict[str, float] = {}
        for event in self._joined.values():
            event.set()
        self._closing = threading.Event()
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
        # Where the store is a TCPStore (torchrun's, a tcp:// init), each channel talks to it
        # through a client connection of its own: one client serves one request at a time, so
        # a reconnection waiting in the store would hold up every other channel's (and the
        # peer tier's messages) -- enough to make the ranks miss each other for good. The
        # same on every rank (it depends on the store's kind only).
        self._server: tuple[str, int] | None = None
        self._stores: dict[str, Any] = {}
        if self._store is not None:
            from torch._C._distributed_c10d import PrefixStore, TCPStore

            underlying = self._store
            while isinstance(underlying, PrefixStore):
                underlying = underlying.underlying_store
            if isinstance(underlying, TCPStore):
                self._server = (underlying.host, underlying.port)

    def all_gather(self, channel: str, payload: bytes) -> list[bytes]:
        """All-gather ``payload`` on the channel's own gloo group (sizes first, then bytes);
        connect the channel anew first when its last exchange failed."""
        import torch

        if channel not in self._groups:
            raise ConfigError(
                f"unknown coordination channel {channel!r}; known: {sorted(self._groups)}"
            )
        # A broken channel: wait for the reconnection (a round that waits meets the returning
        # rank at once) until a timeout after it broke; without it, nothing of this call was
        # sent.
        if self._groups[channel] is None and (
            self._store is None or not self._joined[channel].wait(self._left(channel))
        ):
            raise self._not_yet(channel)
        with self._locks[channel]:
            group = self._groups[channel]
            if group is None:
                raise self._not_yet(channel)
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
                self._joined[channel].clear()
                self._broke_at[channel] = time.monotonic()
                self._next_epoch(channel, self._epochs[channel])
                self._start_reconnecting(channel)
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

    def _left(self, channel: str) -> float:
        """How long a call on the broken ``channel`` still waits for its reconnection."""
        broke = self._broke_at.get(channel, time.monotonic())
        return max(0.0, broke + self.timeout - time.monotonic())

    def _epoch_key(self, channel: str) -> str:
        return f"{self._prefix}/{channel}/epoch"

    def _store_of(self, channel: str) -> Any:
        """The store client ``channel`` reconnects through (see ``__init__``)."""
        from torch._C._distributed_c10d import TCPStore

        if self._server is None:
            return self._store
        if channel not in self._stores:
            host, port = self._server
            self._stores[channel] = TCPStore(
                host,
                port,
                is_master=False,
                timeout=datetime.timedelta(seconds=self.timeout),
                wait_for_workers=False,
            )
        return self._stores[channel]

    def _next_epoch(self, channel: str, failed: int) -> None:
        """Move the channel past epoch ``failed`` in the store, unless a rank did already."""
        if self._store is None:
            return
        try:
            # An absent key is epoch 0; compare-and-set moves it once however many ranks fail.
            self._store_of(channel).compare_set(
                self._epoch_key(channel), str(failed) if failed else "", str(failed + 1)
            )
        except Exception as exc:
            logger.warning(
                "tiercheck: cannot move channel %r to a new epoch in the store: %r", channel, exc
            )

    def _not_yet(self, channel: str) -> ChannelDown:
        """The error of a call on ``channel`` while it is broken (nothing was sent)."""
        now = time.monotonic()
        since = None if self._store is None else now - self._broke_at.get(channel, now)
        why = self._broken.get(channel, "an earlier exchange failed")
        return _channel_down(channel, why, self.rank, self.timeout, since)

    def _start_reconnecting(self, channel: str) -> None:
        """Reconnect ``channel`` on a thread of its own (one per channel at a time)."""
        if self._store is None or channel in self._reconnecting or self._closing.is_set():
            return
        self._reconnecting.add(channel)
        threading.Thread(
            target=self._reconnect_until_joined,
            args=(channel,),
            name=f"tiercheck-reconnect-{channel}",
            daemon=True,  # a try waiting on a rank that is gone never keeps the process alive
        ).start()

    def _reconnect_until_joined(self, channel: str) -> None:
        """Try epoch after epoch until every rank joins one, or the coordinator closes."""
        try:
            while not self._closing.is_set():
                began = time.monotonic()
                group = self._try_epoch(channel)
                if group is not None:
                    with self._locks[channel]:
                        if self._closing.is_set() or channel not in self._groups:
                            return
                        self._groups[channel] = group
                        self._joined[channel].set()
                    return
                # A try that failed fast (the store is gone, a stale address refused) would
                # spin: wait a little, far less than the others' tries last.
                quick = self.timeout / 4 - (time.monotonic() - began)
                if quick > 0:
                    self._closing.wait(quick)
        except Exception:  # never silently: a reconnection that stops for good says why
            logger.exception("tiercheck: reconnecting channel %r stopped", channel)
        finally:
            self._reconnecting.discard(channel)

    def _try_epoch(self, channel: str) -> Any:
        """One try: a new gloo group for ``channel`` at the epoch the store names (every rank
        that saw the failure joins the same one), or ``None`` when the others did not all come
        within the timeout (the epoch is then given up, so that nobody joins it again).

        The ranks first meet in the store (each adds itself to the epoch's count; the last
        one to come says so), and only then make the group, each with a whole timeout for it:
        made straight away, a rank that joined late in another's try would fail with it at the
        end of that try, and with tries of the same length the two could keep missing each
        other at the same offset.
        """
        from torch.distributed.distributed_c10d import PrefixStore, ProcessGroupGloo

        epoch = self._epochs[channel]
        timeout = datetime.timedelta(seconds=self.timeout)
        stage = "meeting"
        try:
            store = self._store_of(channel)
            key = self._epoch_key(channel)
            if store.check([key]):
                epoch = max(epoch, int(store.get(key).decode() or 0))
            base = f"{self._prefix}/{channel}/{epoch}"
            if store.add(f"{base}/join/arrived", 1) >= self.world_size:
                store.set(f"{base}/join/all", b"1")
            try:
                store.wait([f"{base}/join/all"], timeout)
            except Exception:
                store.add(f"{base}/join/arrived", -1)  # gone: a late rank waits on
                raise
            stage = "connecting"
            group = ProcessGroupGloo(
                PrefixStore(f"{base}/", store), self.rank, self.world_size, timeout
            )
        except Exception as exc:
            # The others did not all come (a rank is still paused, or gone).
            self._next_epoch(channel, epoch)
            self._epochs[channel] = epoch
            self._broken[channel] = f"reconnecting failed ({stage}): {type(exc).__name__}: {exc}"[
                :300
            ]
            logger.debug("tiercheck: channel %r, epoch %s, %s: %r", channel, epoch, stage, exc)
            return None
        self._epochs[channel] = epoch
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

        self._closing.set()  # reconnections stop after their current try
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
