"""The peer tier's holder side: the server thread that keeps other ranks' replicas.

Every rank runs one server thread; it waits on the store for requests addressed to it, one at a
time, and keeps what it receives in its node's shared memory (a
:class:`~tiercheck.tiers.local.LocalTier`), under ``<namespace>/r<rank>/<key>``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from typing import Any

import msgpack

from tiercheck._threads import DaemonExecutor
from tiercheck.errors import BlobNotFound, ConfigError, PeerUnavailable, TiercheckError, TierFull
from tiercheck.tiers.base import check_range
from tiercheck.tiers.local import LocalTier
from tiercheck.tiers.local.files import anonymous_memory, read_exactly
from tiercheck.tiers.peer.link import _Link
from tiercheck.tiers.peer.wire import (
    GET_DEPTH,
    IDLE_WAIT,
    as_tensor,
    chunk_bounds,
    chunk_size,
    chunk_tag,
    claim_key,
    pieces,
)

logger = logging.getLogger("tiercheck")


class _Holding(_Link):
    """The peer tier's server: answering requests and holding replicas for other ranks."""

    timeout: float
    _holder: LocalTier
    _stop: threading.Event
    _stopped: bool | None
    _server: threading.Thread | None
    _threads: DaemonExecutor
    _waiting_for: int | None
    _server_loop: asyncio.AbstractEventLoop

    async def stop_serving(self, timeout: float | None = None) -> bool:
        """Stop answering other ranks' requests; the last store traffic of this rank.

        Queues a "stop" request to this rank's own server behind every earlier request and
        waits for the server to finish them and exit, for at most ``timeout`` seconds
        (default: the tier's ``timeout``). Returns whether it stopped in time; a store that
        cannot be reached, or a server still busy at the deadline, is logged once (WARNING) and
        left behind on its daemon thread. Idempotent: later calls return the first outcome.
        """
        if self._stopped is not None:
            return self._stopped
        self._stop.set()
        if self._server is None:
            self._stopped = True
            return True
        bound = self.timeout if timeout is None else max(0.0, float(timeout))
        deadline = time.monotonic() + bound
        loop = asyncio.get_running_loop()
        problem = ""
        try:
            # Bounded: a store whose host is unreachable could block a store call for minutes.
            await asyncio.wait_for(
                loop.run_in_executor(self._threads, self._wake_server), timeout=bound
            )
        except TimeoutError:
            problem = f"the store did not take the stop request within {bound:.0f}s"
        except Exception as exc:  # the store is gone: the server's own wait fails and it exits
            problem = f"the store could not be reached ({exc})"
        left = max(0.0, deadline - time.monotonic())
        server = self._server
        await loop.run_in_executor(self._threads, server.join, left)
        if server.is_alive():
            problem = problem or f"the server was still busy after {bound:.0f}s"
        self._stopped = not problem
        if problem:
            logger.warning(
                "tiercheck: the peer server of rank %s was not stopped cleanly: %s; "
                "left to end with the process",
                self.topology.rank,
                problem,
            )
        return self._stopped

    def _wake_server(self) -> None:
        """Queue a "stop" request to this rank's own server, behind every earlier request.

        Requests are numbered first and sent second, so a requester that died in between
        left a hole the server would wait on; the holes before the stop request are filled
        with "skip" requests (only where no request is: ``compare_set`` never overwrites one).
        """
        me = self.topology.rank
        store = self._store_here()
        seq = int(store.add(f"seq/{me}", 1))
        message = {"op": "stop", "src": me, "seq": seq}
        store.set(f"req/{me}/{seq}", msgpack.packb(message, use_bin_type=True))
        waiting_for = self._waiting_for
        if waiting_for is not None:
            skip = msgpack.packb({"op": "skip", "src": me, "seq": 0}, use_bin_type=True)
            for hole in range(waiting_for, seq):
                store.compare_set(f"req/{me}/{hole}", b"", skip)

    def _serve(self) -> None:
        """Answer requests addressed to this rank, one at a time, until asked to stop."""
        import torch.distributed as dist

        asyncio.set_event_loop(self._server_loop)
        me = self.topology.rank
        try:
            store = self._store.clone()
            for seq in itertools.count(1):
                key = f"req/{me}/{seq}"
                self._waiting_for = seq
                while True:
                    try:
                        store.wait([key], IDLE_WAIT)
                        break
                    except dist.DistStoreError:  # nothing yet: waiting again is safe
                        if self._stop.is_set():
                            return
                        if store.check([f"req/{me}/{seq + 1}"]):
                            break  # a hole: its requester died between numbering and asking
                self._waiting_for = None
                if not store.check([key]):
                    logger.warning(
                        "tiercheck: the peer server of rank %s skips request %s: its sender "
                        "never sent it (it died while asking)",
                        me,
                        seq,
                    )
                    continue
                message = msgpack.unpackb(store.get(key), raw=False)
                store.delete_key(key)
                if message["op"] == "stop":
                    return
                if message["op"] == "skip":
                    continue
                try:
                    self._handle(store, message)
                except Exception:
                    logger.exception("tiercheck: the peer server of rank %s failed a request", me)
        except dist.DistError as exc:
            if self._stop.is_set():  # closing, and the store left first: nothing is lost
                logger.debug("tiercheck: the peer server of rank %s stopped: %s", me, exc)
            else:
                logger.warning(
                    "tiercheck: the peer server of rank %s lost the store and stopped: %s", me, exc
                )
        finally:
            self._server_loop.run_until_complete(self._server_loop.shutdown_default_executor())
            self._server_loop.close()

    def _take(self, store: Any, message: dict[str, Any]) -> bool:
        """Take a request that moves data, unless its sender gave it up (it waited longer than
        the timeout: this rank was paused, or slow); a data transfer nobody waits for would
        make gloo close the pair between the two ranks for good."""
        src, seq = int(message["src"]), int(message["seq"])
        key = claim_key(src, self.topology.rank, seq)
        if store.compare_set(key, "", "served") == b"served":
            return True
        store.delete_key(key)
        logger.info("tiercheck: rank %s gave up request %s before it was taken; skipped", src, seq)
        return False

    def _outdated(self, store: Any, message: dict[str, Any]) -> bool:
        """Refuse a data request at an epoch the pair left (see ``_Link._epoch_over``)."""
        why = self._epoch_over(int(message["src"]), int(message.get("epoch", 0)))
        if why is not None:
            self._refuse(store, message, "ready", PeerUnavailable(why))
        return why is not None

    def _answer(self, store: Any, message: dict[str, Any], step: str, **fields: Any) -> None:
        src, seq = message["src"], message["seq"]
        body = {"ok": True, **fields}
        key = f"resp/{src}/{self.topology.rank}/{seq}/{step}"
        store.set(key, msgpack.packb(body, use_bin_type=True))

    def _refuse(self, store: Any, message: dict[str, Any], step: str, exc: BaseException) -> None:
        kind = (
            "missing"
            if isinstance(exc, FileNotFoundError)
            else "tier-full"
            if isinstance(exc, TierFull)
            else "error"
        )
        src, seq = message["src"], message["seq"]
        body = {"ok": False, "error_type": kind, "error": f"{type(exc).__name__}: {exc}"}
        key = f"resp/{src}/{self.topology.rank}/{seq}/{step}"
        store.set(key, msgpack.packb(body, use_bin_type=True))

    def _held_prefix(self, message: dict[str, Any]) -> str:
        """Where the holder keeps what ``message``'s sender stores (namespace, then rank).

        A read (``get``, ``list``) may name another ``owner``: a rank of the sender's node whose
        blob holds replicated state the sender's refers to, kept in the same node memory when
        this holder's node holds that rank's replicas too. Writes always go to the sender's own.
        """
        owner = message.get("owner") if message["op"] in ("get", "list") else None
        rank = int(message["src"] if owner is None else owner)
        return f"{message['ns']}/r{rank:05d}/"

    def _held_key(self, message: dict[str, Any]) -> str:
        return self._held_prefix(message) + str(message["key"])

    def _handle(self, store: Any, message: dict[str, Any]) -> None:
        op = message["op"]
        run = self._server_loop.run_until_complete
        try:
            if op == "put":
                self._serve_put(store, message)
                return
            if op == "get":
                self._serve_get(store, message)
                return
            key = self._held_key(message)
            if op == "delete":
                run(self._holder.delete(key))
                self._answer(store, message, "done")
            elif op == "exists":
                self._answer(store, message, "done", exists=run(self._holder.exists(key)))
            elif op == "size":
                try:
                    size = run(self._holder.get_size(key))
                except BlobNotFound:
                    size = -1
                self._answer(store, message, "done", size=size)
            elif op == "list":
                prefix = self._held_prefix(message)

                async def listing() -> list[str]:
                    return [k[len(prefix) :] async for k in self._holder.list(key)]

                self._answer(store, message, "done", keys=run(listing()))
            else:
                raise ConfigError(f"unknown peer request {op!r}")
        except (TiercheckError, OSError) as exc:
            self._refuse(store, message, "done", exc)

    def _serve_put(self, store: Any, message: dict[str, Any]) -> None:

        run = self._server_loop.run_until_complete
        sizes: list[int] = message["sizes"]
        if not self._take(store, message) or self._outdated(store, message):
            return
        try:
            reservation = run(self._holder.reserve(self._held_key(message), sum(sizes)))
        except (TiercheckError, OSError) as exc:
            self._refuse(store, message, "ready", exc)
            return
        src, seq = int(message["src"]), int(message["seq"])
        try:
            self._answer(store, message, "ready")
            buffer, offset, parts = reservation.buffer, 0, []
            for size in sizes:  # the sender's parts, laid end to end in the reservation
                parts.append(buffer[offset : offset + size])
                offset += size
            epoch = int(message.get("epoch", 0))
            try:
                group, peer = self._transfer_group(src, epoch)
                # Cut exactly as the sender did: its chunk size travels with the request.
                works = [
                    self._irecv(group, peer, as_tensor(piece), chunk_tag(seq, "put", i))
                    for i, piece in enumerate(pieces(parts, int(message["chunk"])))
                ]
                self._wait_all(works, src)
            except Exception:
                self._pair_broke(src, epoch)
                raise
            run(reservation.commit())
        except BaseException as exc:
            run(reservation.abort())
            if isinstance(exc, Exception):
                logger.warning(
                    "tiercheck: receiving %r from rank %s failed: %r", message["key"], src, exc
                )
                self._refuse(store, message, "done", exc)
                return
            raise
        finally:
            reservation.release()
        self._answer(store, message, "done")
        # The next blob from this rank is likely the same size (the next version of the same
        # state): ready its memory now, off the transfer's critical path.
        try:
            run(self._holder.prepare(sum(sizes)))
        except (TiercheckError, OSError) as exc:
            logger.warning("tiercheck: preparing replica memory failed: %r", exc)

    def _serve_get(self, store: Any, message: dict[str, Any]) -> None:

        run = self._server_loop.run_until_complete
        key = self._held_key(message)
        byte_range = message.get("range")
        if not self._take(store, message) or self._outdated(store, message):
            return
        if byte_range is None:
            _serve_whole(self, store, message, key)
            return
        try:
            start, end = check_range(*byte_range)
            data = memoryview(run(self._holder.get_range(key, start, end))).cast("B")
        except (TiercheckError, OSError, ValueError, TypeError) as exc:
            # ValueError/TypeError: a malformed range, which a requester checks before asking.
            self._refuse(store, message, "ready", exc)
            return
        if data.readonly:
            data = memoryview(bytearray(data))
        # "ranged" tells the requester its range was honoured (a holder from before ranged
        # reads would send the whole blob instead).
        self._answer(store, message, "ready", size=data.nbytes, ranged=True)
        src, seq = int(message["src"]), int(message["seq"])
        chunk = chunk_size(data.nbytes, int(message["chunk"]))
        epoch = int(message.get("epoch", 0))
        try:
            group, peer = self._transfer_group(src, epoch)
            works = [
                self._isend(group, peer, as_tensor(piece), chunk_tag(seq, "get", i))
                for i, piece in enumerate(pieces([data], chunk))
            ]
            self._wait_all(works, src)
        except Exception:
            self._pair_broke(src, epoch)
            raise


def _serve_whole(holding: _Holding, store: Any, message: dict[str, Any], key: str) -> None:
    """A whole-blob get, sent from the replica's file under the local tier's shared lock:
    "ready" once the file is open, then each chunk read into one of ``GET_DEPTH`` reused
    buffers while the chunks before it are on the wire (no copy of the whole blob)."""
    src, seq = int(message["src"]), int(message["seq"])
    epoch = int(message.get("epoch", 0))
    answered = False

    def send(fd: int, size: int) -> None:
        nonlocal answered
        bounds = chunk_bounds(size, chunk_size(size, int(message["chunk"])))
        holding._answer(store, message, "ready", size=size, ranged=False)
        answered = True
        if not bounds:
            return
        group, peer = holding._transfer_group(src, epoch)
        depth = min(GET_DEPTH, len(bounds))
        staging = [memoryview(anonymous_memory(bounds[0][1])) for _ in range(depth)]
        works: list[Any] = []
        for i, (a, b) in enumerate(bounds):
            if i >= depth:  # chunk i - depth is sent: its buffer is free
                holding._wait_all([works[i - depth]], src)
            buf = read_exactly(fd, b - a, a, into=staging[i % depth][: b - a])
            works.append(holding._isend(group, peer, as_tensor(buf), chunk_tag(seq, "get", i)))
        holding._wait_all(works[max(0, len(works) - depth) :], src)  # each waited once

    try:
        holding._server_loop.run_until_complete(holding._holder.read_file(key, send))
    except Exception as exc:
        if answered:  # data may be stuck between the two: the pair's connection is done
            holding._pair_broke(src, epoch)
            raise
        if not isinstance(exc, (TiercheckError, OSError)):
            raise
        holding._refuse(store, message, "ready", exc)
