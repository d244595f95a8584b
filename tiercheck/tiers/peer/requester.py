"""The peer tier's requester side: asking holders to put, get, delete, and waiting for answers.

Each exchange runs, blocking, on one of the tier's daemon threads (see
:meth:`_Requester._run`); any failure of it marks the holder down.
"""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import msgpack
import numpy as np

from tiercheck._threads import DaemonExecutor
from tiercheck.errors import BlobNotFound, PeerUnavailable, StorageError, TiercheckError, TierFull
from tiercheck.tiers.peer.link import _Link
from tiercheck.tiers.peer.wire import (
    GET_CHUNK,
    as_tensor,
    chunk_size,
    chunk_tag,
    claim_key,
    pieces,
)

T = TypeVar("T")


class _Requester(_Link):
    """The peer tier's requests to the holders of this rank's replicas (blocking parts)."""

    timeout: float
    namespace: str
    chunk_bytes: int
    _threads: DaemonExecutor

    async def _run(self, dst: int, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``, an exchange with holder ``dst``, on a daemon thread; fails at once
        (without using a thread) while ``dst`` is down."""
        self._check_up(dst)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._threads, self._guarded, dst, fn, *args)

    def _guarded(self, dst: int, fn: Callable[..., T], *args: Any) -> T:
        """Run one exchange with ``dst``; any failure of it (not a refusal) marks ``dst`` down."""
        self._check_up(dst)  # it may have gone down while this call was queued
        try:
            return fn(*args)
        except TiercheckError:
            raise  # PeerUnavailable marked it already; other errors are the holder's answers
        except (RuntimeError, OSError, ValueError) as exc:
            # A store operation or gloo transfer failed (torch raises RuntimeError subclasses,
            # sockets OSError), or the holder's answer was garbled.
            raise self._went_down(dst, f"{type(exc).__name__}: {exc}") from exc

    def _send_request(self, dst: int, message: dict[str, Any]) -> int:
        store = self._store_here()
        seq = int(store.add(f"seq/{dst}", 1))
        message = {**message, "src": self.topology.rank, "seq": seq, "ns": self.namespace}
        store.set(f"req/{dst}/{seq}", msgpack.packb(message, use_bin_type=True))
        return seq

    def _reply(self, dst: int, seq: int, step: str) -> dict[str, Any]:
        """Wait for the holder's answer to request ``seq`` (phase ``step``)."""
        import torch.distributed as dist

        store = self._store_here()
        key = f"resp/{self.topology.rank}/{dst}/{seq}/{step}"
        try:
            store.wait([key], datetime.timedelta(seconds=self.timeout))
        except dist.DistError as exc:
            if step != "ready" or not self._served(store, dst, seq):
                raise self._went_down(
                    dst, f"no answer within {self.timeout:.0f}s, its node may be gone ({exc})"
                ) from exc
            # The holder took the request just now: it answers and moves the data.
            try:
                store.wait([key], datetime.timedelta(seconds=self.timeout))
            except dist.DistError as again:
                raise self._went_down(
                    dst, f"no answer within {2 * self.timeout:.0f}s after taking the request"
                ) from again
        reply: dict[str, Any] = msgpack.unpackb(store.get(key), raw=False)
        store.delete_key(key)
        if step == "ready":
            store.delete_key(claim_key(self.topology.rank, dst, seq))
        if not reply.get("ok", False):
            kind = reply.get("error_type", "")
            text = f"rank {dst}: {reply.get('error', 'unknown error')}"
            if kind == "missing":
                raise BlobNotFound(text)
            if kind == "tier-full":
                raise TierFull(text)
            raise StorageError(text)
        return reply

    def _served(self, store: Any, dst: int, seq: int) -> bool:
        """Whether holder ``dst`` took request ``seq`` after all; else it never will (this
        rank gives it up, in the store, before the holder can take it).

        A holder that answers "ready" then moves the data with gloo; if this rank had given
        up by then, that transfer would wait for the timeout and gloo would close the pair
        for good -- no transfer between the two ranks would work again (a holder back from
        a pause finds such requests waiting).
        """
        return bool(
            store.compare_set(claim_key(self.topology.rank, dst, seq), "", "cancelled") == b"served"
        )

    def _call(self, dst: int, message: dict[str, Any]) -> dict[str, Any]:
        seq = self._send_request(dst, message)
        return self._reply(dst, seq, "done")

    def _put_sync(self, dst: int, key: str, views: Sequence[memoryview]) -> None:
        sizes = [v.nbytes for v in views]
        chunk = chunk_size(sum(sizes), self.chunk_bytes)
        epoch = self._pair_epoch(dst)
        message = {"op": "put", "key": key, "sizes": sizes, "chunk": chunk, "epoch": epoch}
        seq = self._send_request(dst, message)
        self._reply(dst, seq, "ready")
        try:
            group, peer = self._transfer_group(dst, epoch)
            works = [
                self._isend(group, peer, as_tensor(piece), chunk_tag(seq, "put", i))
                for i, piece in enumerate(pieces(views, chunk))
            ]
            self._wait_all(works, dst)
            self._reply(dst, seq, "done")
        except (PeerUnavailable, RuntimeError, OSError):
            # The data may be stuck between the two: the pair's connection is done with.
            self._pair_broke(dst, epoch)
            raise

    def _get_sync(
        self,
        dst: int,
        key: str,
        byte_range: tuple[int, int] | None = None,
        owner: int | None = None,
    ) -> memoryview:
        """The blob under ``key`` from ``dst``: all of it, or ``byte_range`` (clipped); from
        rank ``owner``'s replicas where given (else the requesting rank's own)."""
        epoch = self._pair_epoch(dst)
        message: dict[str, Any] = {
            "op": "get",
            "key": key,
            "chunk": min(self.chunk_bytes, GET_CHUNK),
            "epoch": epoch,
        }
        if byte_range is not None:
            message["range"] = list(byte_range)
        if owner is not None:
            message["owner"] = owner
        seq = self._send_request(dst, message)
        reply = self._reply(dst, seq, "ready")
        size = int(reply["size"])
        if byte_range is not None and not reply.get("ranged", False):
            # Receive what is coming all the same (an unmatched send would hang the holder),
            # but never pass a whole blob off as a part of it.
            self._receive(dst, seq, size, epoch)
            raise StorageError(
                f"rank {dst} does not serve ranged reads (an older tiercheck?); read all of "
                f"{key!r} instead"
            )
        return self._receive(dst, seq, size, epoch)

    def _receive(self, dst: int, seq: int, size: int, epoch: int) -> memoryview:
        # Not a bytearray (zero-filled by Python, holding the GIL): numpy's memory is touched
        # first by gloo's receive, on huge pages (see tiercheck.codec.rawstate.host_buffer).
        out = np.empty(size, dtype=np.uint8).data
        try:
            group, peer = self._transfer_group(dst, epoch)
            chunk = chunk_size(size, min(self.chunk_bytes, GET_CHUNK))
            works = [
                self._irecv(group, peer, as_tensor(piece), chunk_tag(seq, "get", i))
                for i, piece in enumerate(pieces([out], chunk))
            ]
            self._wait_all(works, dst)
        except (PeerUnavailable, RuntimeError, OSError):
            self._pair_broke(dst, epoch)
            raise
        return out
