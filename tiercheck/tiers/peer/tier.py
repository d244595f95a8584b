"""The peer tier's class: its options, its public operations, and how it stops serving.

See :mod:`tiercheck.tiers.peer` for the design (placement, transport, failures, lifecycle).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime
import logging
import os
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

from tiercheck._threads import DaemonExecutor
from tiercheck.defaults import NodeRoot
from tiercheck.errors import BlobNotFound, ConfigError, PeerUnavailable, StorageError
from tiercheck.tiers.base import Buffer, FailureScope, Tier, TierSetup, check_range
from tiercheck.tiers.local import LocalTier
from tiercheck.tiers.peer.requester import _Requester
from tiercheck.tiers.peer.server import _Holding
from tiercheck.tiers.peer.wire import DEFAULT_CHUNK, default_store, validate_key_quietly
from tiercheck.topology import Topology

logger = logging.getLogger("tiercheck")

#: Blocking calls the tier may have in flight at once (puts, retention, restore, the stop).
_MAX_THREADS = 16


class PeerTier(_Requester, _Holding, Tier):
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

    name = "peer"
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
            f"tiercheck/peer/{session}", store if store is not None else default_store()
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
        self._pairs: dict[int, tuple[int, Any]] = {}
        self._pair_locks: dict[int, threading.Lock] = {}
        self._building: dict[int, tuple[int, concurrent.futures.Future[Any]]] = {}
        self._tried: dict[int, int] = {}
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
        return await self._get_from_holders(key, None)

    async def get_range(self, key: str, start: int, end: int) -> Buffer:
        """Bytes ``[start, end)`` of the blob under ``key``, clipped to its size, from the first
        holder that has it (:class:`~tiercheck.tiers.SupportsRangedGet`): the holder reads only
        that slice of its replica, and only the slice crosses the network."""
        self._check_key(key)
        return await self._get_from_holders(key, check_range(start, end))

    async def _get_from_holders(self, key: str, byte_range: tuple[int, int] | None) -> Buffer:
        missing: BlobNotFound | None = None
        errors: list[BaseException] = []
        for dst in self.targets:
            try:
                return await self._run(dst, self._get_sync, dst, key, byte_range)
            except BlobNotFound as exc:
                missing = exc
            except (PeerUnavailable, StorageError) as exc:
                errors.append(exc)
        if missing is not None or not errors:
            raise BlobNotFound(f"no holder of rank {self.topology.rank} has {key!r}") from missing
        raise errors[0]

    async def get_for(self, owner: int, key: str) -> Buffer:
        """The blob rank ``owner`` stored under ``key``, from a holder of this rank's replicas
        (found where that holder's node keeps ``owner``'s replicas too, as ring placement does
        for the ranks of one node); :class:`~tiercheck.errors.BlobNotFound` otherwise."""
        self._check_key(key)
        missing: BlobNotFound | None = None
        errors: list[BaseException] = []
        for dst in self.targets:
            try:
                return await self._run(dst, self._get_sync, dst, key, None, owner)
            except BlobNotFound as exc:
                missing = exc
            except (PeerUnavailable, StorageError) as exc:
                errors.append(exc)
        if missing is not None or not errors:
            raise BlobNotFound(
                f"no holder of rank {self.topology.rank} has rank {owner}'s {key!r}"
            ) from missing
        raise errors[0]

    async def list_for(self, owner: int, prefix: str = "") -> AsyncIterator[str]:
        """Keys rank ``owner`` stored, by prefix, as the holders of this rank's replicas see
        them (see :meth:`get_for`)."""
        self._check_open()
        seen: set[str] = set()
        errors: list[PeerUnavailable] = []
        for dst in self.targets:
            message = {"op": "list", "key": prefix, "owner": owner}
            try:
                reply = await self._run(dst, self._call, dst, message)
            except PeerUnavailable as exc:
                errors.append(exc)
                continue
            for key in reply["keys"]:
                if key not in seen:
                    seen.add(key)
                    yield key
        if len(errors) == len(self.targets):
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

    def __repr__(self) -> str:
        return f"PeerTier(rank={self.topology.rank}, targets={self.targets})"
