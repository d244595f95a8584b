"""The peer tier: each rank's blobs, replicated into the memory of a rank on another node.

Placement is a ring over nodes (see :meth:`tiercheck.topology.Topology.replica_targets`): the
ranks of node *i* keep their replicas on node *i+1* (more replicas: *i+2*, ...), never on their
own node, so a lost node's checkpoints survive on its neighbour.

Transport, on the engine the training job already runs: ``torch.distributed``.

* **Data** moves by gloo point-to-point on a process group of its own (never the training's),
  in chunks, received straight into the holder's shared memory (no intermediate buffer).
* **Control** -- "rank 3 wants to put 40 MB under key k", "ready", "done" -- goes through the
  job's key-value store (the one ``init_process_group`` set up). A store wait can time out and
  be retried safely, whereas a gloo receive that times out breaks its pair of ranks for good,
  so every rank runs one *server* thread that waits on the store for requests addressed to
  it and does point-to-point only when both sides have agreed on it.

Every request is two-phase where data moves: the requester asks, the holder prepares (or
refuses: full, missing key) and answers, and only then do the bytes flow, so a refused put
never leaves a send hanging.

A dead holder costs one failure, not one per operation. *Any* failed exchange with a holder --
no answer within ``timeout``, a gloo transfer that fails, a store operation that fails --
marks it **down** (logged once, at WARNING, without a traceback), and from then on every
operation that needs it (put, get, delete, exists, size, list) fails at once with
:class:`~tiercheck.errors.PeerUnavailable` instead of waiting. A down holder is tried again
after ``retry_after`` seconds (default: ``timeout``), so a holder that was only slow, or a
restarted one, is used again later; :meth:`PeerTier.mark_down` lets the caller mark one down
on its own knowledge. A refusal by a live holder (missing key, full memory) is an answer, not
a failure: it marks nothing.

Blocking work (store waits, transfers) runs on daemon threads of the tier's own
(:class:`~tiercheck._threads.DaemonExecutor`), never on ``asyncio.to_thread``'s executor, so a
call still waiting on a dead holder never keeps the process alive at exit.

A holder stores the replicas it keeps for others in its own node's shared memory (a
:class:`~tiercheck.tiers.local.LocalTier` under ``holder_root``), so they survive the holder
process crashing too -- only the loss of the holder's node takes them.

Lifecycle: every rank constructs its ``PeerTier`` at the same point of the program (creating the
process group is a collective). The peer tier is usable while the holders' processes are alive
and serving: during training and during restore. Closing has two steps, because the store may
be gone soon after the job ends (its host leaves once its own workers are done):

1. :meth:`PeerTier.stop_serving` -- the last store traffic of this rank: it queues a "stop"
   request behind every earlier one and waits (bounded) for the server thread to finish. A
   job calls it on every rank once every rank is done saving, and leaves only after every rank
   has stopped serving (the checkpointer's close does exactly that).
2. :meth:`PeerTier.aclose` -- releases local resources and touches neither the store nor
   another rank when serving was stopped before; otherwise it stops serving first, bounded.
"""

from __future__ import annotations

import asyncio
import datetime
import itertools
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import msgpack
import torch

from tiercheck._threads import DaemonExecutor
from tiercheck.defaults import NodeRoot
from tiercheck.errors import (
    BlobNotFound,
    ConfigError,
    PeerUnavailable,
    StorageError,
    TiercheckError,
    TierFull,
)
from tiercheck.tiers.base import Buffer, FailureScope, Tier, TierSetup, validate_key
from tiercheck.tiers.local import LocalTier
from tiercheck.topology import Topology

__all__ = ["PeerTier"]

T = TypeVar("T")

logger = logging.getLogger("tiercheck")

# An idle server blocks in one long store wait (each timed-out wait makes c10d log a warning,
# so it must not poll); closing wakes it with a "stop" request of its own.
_IDLE_WAIT = datetime.timedelta(seconds=60)
_MAX_CHUNKS = 1 << 10
_SEQ_SPACE = 1 << 19


def _tag(seq: int, op: str, chunk: int) -> int:
    """The gloo tag of one chunk of a request's data.

    Every outstanding message between two ranks gets a tag of its own: gloo does not pair
    several pending receives of one tag reliably. The lowest bit tells puts from gets: two
    ranks may hold each other's replicas (a ring of two nodes), one rank's server then receives
    put data from the other while its requester receives get data from it, and their sequence
    numbers come from different counters.
    """
    return (((seq % _SEQ_SPACE) * _MAX_CHUNKS + chunk) << 1) | (1 if op == "get" else 0)


DEFAULT_CHUNK = 64 << 20


def _default_store() -> Any:
    """The key-value store ``torch.distributed`` was initialized with."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError(
            "the peer tier needs torch.distributed initialized (init_process_group) "
            "or an explicit store= and group="
        )
    world = dist.group.WORLD
    getter = getattr(world, "get_group_store", None)
    if getter is not None:
        return getter()
    return dist.distributed_c10d._get_default_store()


def validate_key_quietly(value: str) -> str | None:
    """``value`` if it is a valid key segment, else ``None``."""
    try:
        return validate_key(value)
    except TiercheckError:
        return None


def _chunks(total: int, chunk: int) -> list[tuple[int, int]]:
    return [(a, min(total, a + chunk)) for a in range(0, total, chunk)]


def _pieces(views: Sequence[memoryview], chunk: int) -> list[memoryview]:
    """How a message is cut into point-to-point transfers (both sides cut alike)."""
    return [view[a:b] for view in views for a, b in _chunks(view.nbytes, chunk)]


def _chunk_size(total: int, preferred: int) -> int:
    """``preferred``, grown if needed so that ``total`` bytes take at most ``_MAX_CHUNKS``."""
    return max(preferred, -(-total // _MAX_CHUNKS))


def _as_tensor(view: memoryview) -> torch.Tensor:
    """A uint8 tensor over ``view`` (which must be writable: torch refuses read-only memory)."""
    return torch.frombuffer(view, dtype=torch.uint8)


#: Blocking calls the tier may have in flight at once (puts, retention, restore, the stop).
_MAX_THREADS = 16


class PeerTier(Tier):
    """Replicas of this rank's blobs in the memory of ranks on other nodes.

    Args:
        topology: where ranks sit; the replica holders follow from it.
        holder_root: this node's shared-memory folder for the replicas it keeps for others.
        replicas: how many other nodes keep a copy (at most ``num_nodes - 1``). A put succeeds
            only when every holder has the blob durable in its memory.
        placement: which ranks hold this rank's replicas, instead of the ring: a function of
            the topology returning ranks (for example spreading replicas across racks).
            Ranks on this rank's own node are refused: they die with it.
        timeout: seconds any exchange with a holder may take before failing.
        namespace: where on the holders this tier's replicas live (one per job); stable
            across restarts, so a restarted job finds what its holders kept.
        session: names this incarnation's control messages in the store (a restarted job
            uses a new one, so it never reads the requests of the one that died).
        store, group: the key-value store and gloo process group to use; by default the
            store of the initialized default group and a new gloo group.
        serve: whether this process answers other ranks' requests. Exactly one peer tier per
            rank and session serves (tests that open several on one rank pass ``False``).
        chunk_bytes: size of each point-to-point message; bounds no buffer (data is received in
            place) but lets a huge blob move as several transfers.
        name: the tier's name.
        retry_after: seconds a holder stays marked down after a failed exchange before it is
            tried again (default: ``timeout``).
    """

    survives = FailureScope.NODE

    @classmethod
    def for_job(cls, setup: TierSetup) -> PeerTier:
        """A checkpointer's peer tier: the job's placement, replicas held under the node's
        shared-memory folder, exchanges bounded by ``peer_timeout``."""
        return cls(
            topology=setup.topology,
            holder_root=NodeRoot(setup.node_root).replicas,
            replicas=setup.peer_replicas,
            timeout=setup.peer_timeout,
            namespace=setup.job_id,
            session=f"{setup.job_id}.{setup.session}",
        )

    def __init__(
        self,
        *,
        topology: Topology,
        holder_root: str | os.PathLike[str],
        replicas: int = 1,
        placement: Callable[[Topology], Sequence[int]] | None = None,
        timeout: float = 300.0,
        namespace: str = "default",
        session: str = "default",
        store: Any = None,
        group: Any = None,
        serve: bool = True,
        chunk_bytes: int = DEFAULT_CHUNK,
        name: str = "peer",
        retry_after: float | None = None,
    ) -> None:
        import torch.distributed as dist

        self.name = name
        self.topology = topology
        self.timeout = float(timeout)
        self.retry_after = self.timeout if retry_after is None else float(retry_after)
        if topology.num_nodes < 2:
            raise ConfigError(
                "the peer tier needs at least two nodes (it keeps replicas on another node); "
                f"this job has {topology.world_size} ranks on one node. Set ranks_per_node, "
                "or leave 'peer' out of the tiers"
            )
        if replicas < 1:
            raise ConfigError(f"replicas must be at least 1, got {replicas}")
        for what, value in (("namespace", namespace), ("session", session)):
            if not value or "/" in value or validate_key_quietly(value) is None:
                raise ConfigError(f"{what} must be a valid name without '/', got {value!r}")
        self.targets = (
            topology.replica_targets(replicas)
            if placement is None
            else [int(r) for r in placement(topology)]
        )
        bad = [r for r in self.targets if not 0 <= r < topology.world_size]
        same = [r for r in self.targets if topology.node_of(r) == topology.node_index]
        if bad or same or not self.targets or len(set(self.targets)) != len(self.targets):
            raise ConfigError(
                f"replica holders of rank {topology.rank} must be distinct ranks on other "
                f"nodes; got {self.targets} (on this node: {same}, out of range: {bad})"
            )
        self.namespace = namespace
        self.chunk_bytes = chunk_bytes
        # Typed loosely: torch's stubs omit PrefixStore's export and its clone().
        prefix_store: Any = dist.PrefixStore  # type: ignore[attr-defined]
        self._store: Any = prefix_store(
            f"tiercheck/peer/{session}", store if store is not None else _default_store()
        )
        self._group = (
            group
            if group is not None
            else dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout))
        )
        self._holder = LocalTier(Path(holder_root), name=f"{name}-holder")
        self._local = threading.local()
        self._down_lock = threading.Lock()
        self._down_until: dict[int, float] = {}
        self._threads = DaemonExecutor(_MAX_THREADS, f"tiercheck-peer-r{topology.rank}")
        self._stop = threading.Event()
        self._stopped: bool | None = None  # how stop_serving ended, once it ran
        self._waiting_for: int | None = None  # the request the idle server waits for
        self._server: threading.Thread | None = None
        self._server_loop = asyncio.new_event_loop()
        if serve:
            self._server = threading.Thread(
                target=self._serve, name=f"tiercheck-peer-server-r{topology.rank}", daemon=True
            )
            self._server.start()

    # --- the Tier interface (requester side) --------------------------------------------------

    async def put(self, key: str, data: Buffer) -> None:
        """Store ``data`` under ``key`` on every holder (atomic on each)."""
        await self.putv(key, [data])

    async def putv(self, key: str, parts: Sequence[Buffer]) -> None:
        """Store the concatenation of ``parts`` on every holder, without joining them."""
        self._check_key(key)
        views = []
        for part in parts:
            view = memoryview(part).cast("B")
            if view.readonly:  # torch sends only from writable memory; such parts are small
                view = memoryview(bytearray(view))
            views.append(view)
        for dst in self.targets:
            await self._run(dst, self._put_sync, dst, key, views)

    async def get(self, key: str) -> Buffer:
        """The blob under ``key`` from the first holder that has it."""
        self._check_key(key)
        missing: BlobNotFound | None = None
        errors: list[BaseException] = []
        for dst in self.targets:
            try:
                return await self._run(dst, self._get_sync, dst, key)
            except BlobNotFound as exc:
                missing = exc
            except (PeerUnavailable, StorageError) as exc:
                errors.append(exc)
        if missing is not None or not errors:
            raise BlobNotFound(f"no holder of rank {self.topology.rank} has {key!r}") from missing
        raise errors[0]

    async def delete(self, key: str) -> None:
        """Delete ``key`` on every holder (idempotent)."""
        self._check_key(key)
        for dst in self.targets:
            await self._run(dst, self._call, dst, {"op": "delete", "key": key})

    async def exists(self, key: str) -> bool:
        """Whether any holder has ``key``."""
        self._check_key(key)
        for dst in self.targets:
            reply = await self._run(dst, self._call, dst, {"op": "exists", "key": key})
            if reply["exists"]:
                return True
        return False

    async def get_size(self, key: str) -> int:
        """Size of ``key`` on the first holder that has it."""
        self._check_key(key)
        for dst in self.targets:
            reply = await self._run(dst, self._call, dst, {"op": "size", "key": key})
            if reply["size"] >= 0:
                return int(reply["size"])
        raise BlobNotFound(f"no holder of rank {self.topology.rank} has {key!r}")

    async def list(self, prefix: str = "") -> AsyncIterator[str]:
        """Keys held for this rank, by prefix: the union over the holders that answer.

        A holder that is down or fails is left out (it was logged when it went down); when no
        holder answers, :class:`~tiercheck.errors.PeerUnavailable` is raised rather than an
        empty listing that would look like "nothing stored".
        """
        self._check_open()
        seen: set[str] = set()
        errors: list[PeerUnavailable] = []
        for dst in self.targets:
            try:
                reply = await self._run(dst, self._call, dst, {"op": "list", "key": prefix})
            except PeerUnavailable as exc:
                errors.append(exc)
                continue
            for key in reply["keys"]:
                if key not in seen:
                    seen.add(key)
                    yield key
        if len(errors) == len(self.targets):
            raise errors[0]

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

    async def aclose(self) -> None:
        """Release everything (replicas stay in shared memory for a restarted process).

        Touches neither the store nor another rank if :meth:`stop_serving` ran before;
        otherwise stops serving first, for at most ``timeout`` seconds.
        """
        if self._closed:
            return
        await super().aclose()
        if self._stopped is None:
            await self.stop_serving()
        if self._server is None:
            self._server_loop.close()
        await self._holder.aclose()
        # Calls still blocked on a dead holder stay on their daemon threads; nothing waits.
        self._threads.shutdown(wait=False, cancel_futures=True)

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

    def __repr__(self) -> str:
        return f"PeerTier(rank={self.topology.rank}, targets={self.targets})"

    # --- requester side, blocking (worker threads) --------------------------------------------

    def _store_here(self) -> Any:
        """A store connection for this thread: one connection serializes its calls."""
        store = getattr(self._local, "store", None)
        if store is None:
            store = self._store.clone()
            self._local.store = store
        return store

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
            raise self._went_down(
                dst, f"no answer within {self.timeout:.0f}s, its node may be gone ({exc})"
            ) from exc
        reply: dict[str, Any] = msgpack.unpackb(store.get(key), raw=False)
        store.delete_key(key)
        if not reply.get("ok", False):
            kind = reply.get("error_type", "")
            text = f"rank {dst}: {reply.get('error', 'unknown error')}"
            if kind == "missing":
                raise BlobNotFound(text)
            if kind == "full":
                raise TierFull(text)
            raise StorageError(text)
        return reply

    def _call(self, dst: int, message: dict[str, Any]) -> dict[str, Any]:
        seq = self._send_request(dst, message)
        return self._reply(dst, seq, "done")

    def _put_sync(self, dst: int, key: str, views: Sequence[memoryview]) -> None:
        import torch.distributed as dist

        sizes = [v.nbytes for v in views]
        chunk = _chunk_size(sum(sizes), self.chunk_bytes)
        message = {"op": "put", "key": key, "sizes": sizes, "chunk": chunk}
        seq = self._send_request(dst, message)
        self._reply(dst, seq, "ready")
        works = []
        for i, piece in enumerate(_pieces(views, chunk)):
            tag = _tag(seq, "put", i)
            works.append(dist.isend(_as_tensor(piece), dst, group=self._group, tag=tag))
        self._wait_all(works, dst)
        self._reply(dst, seq, "done")

    def _get_sync(self, dst: int, key: str) -> memoryview:
        import torch.distributed as dist

        seq = self._send_request(dst, {"op": "get", "key": key, "chunk": self.chunk_bytes})
        reply = self._reply(dst, seq, "ready")
        size = int(reply["size"])
        out = memoryview(bytearray(size))
        works = [
            dist.irecv(_as_tensor(piece), dst, group=self._group, tag=_tag(seq, "get", i))
            for i, piece in enumerate(_pieces([out], _chunk_size(size, self.chunk_bytes)))
        ]
        self._wait_all(works, dst)
        return out

    def _wait_all(self, works: Sequence[Any], peer: int) -> None:
        try:
            for work in works:
                work.wait()  # exactly once per work: a second wait on gloo breaks the pair
        except RuntimeError as exc:
            raise self._went_down(
                peer, f"moving data between ranks {self.topology.rank} and {peer} failed: {exc}"
            ) from exc

    # --- holder side: the server thread -------------------------------------------------------

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
                        store.wait([key], _IDLE_WAIT)
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

    def _answer(self, store: Any, message: dict[str, Any], step: str, **fields: Any) -> None:
        src, seq = message["src"], message["seq"]
        body = {"ok": True, **fields}
        key = f"resp/{src}/{self.topology.rank}/{seq}/{step}"
        store.set(key, msgpack.packb(body, use_bin_type=True))

    def _refuse(self, store: Any, message: dict[str, Any], step: str, exc: BaseException) -> None:
        kind = (
            "missing"
            if isinstance(exc, FileNotFoundError)
            else "full"
            if isinstance(exc, TierFull)
            else "error"
        )
        src, seq = message["src"], message["seq"]
        body = {"ok": False, "error_type": kind, "error": f"{type(exc).__name__}: {exc}"}
        key = f"resp/{src}/{self.topology.rank}/{seq}/{step}"
        store.set(key, msgpack.packb(body, use_bin_type=True))

    def _held_prefix(self, message: dict[str, Any]) -> str:
        """Where the holder keeps what ``message``'s sender stores (namespace, then rank)."""
        return f"{message['ns']}/r{int(message['src']):05d}/"

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
        import torch.distributed as dist

        run = self._server_loop.run_until_complete
        sizes: list[int] = message["sizes"]
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
            # Cut exactly as the sender did: its chunk size travels with the request.
            works = [
                dist.irecv(_as_tensor(piece), src, group=self._group, tag=_tag(seq, "put", i))
                for i, piece in enumerate(_pieces(parts, int(message["chunk"])))
            ]
            self._wait_all(works, src)
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
        import torch.distributed as dist

        run = self._server_loop.run_until_complete
        try:
            data = memoryview(run(self._holder.get(self._held_key(message)))).cast("B")
        except (TiercheckError, OSError) as exc:
            self._refuse(store, message, "ready", exc)
            return
        if data.readonly:
            data = memoryview(bytearray(data))
        self._answer(store, message, "ready", size=data.nbytes)
        src, seq = int(message["src"]), int(message["seq"])
        chunk = _chunk_size(data.nbytes, int(message["chunk"]))
        works = [
            dist.isend(_as_tensor(piece), src, group=self._group, tag=_tag(seq, "get", i))
            for i, piece in enumerate(_pieces([data], chunk))
        ]
        self._wait_all(works, src)
