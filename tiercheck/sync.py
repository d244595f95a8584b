"""The checkpointer for code without an event loop: same behaviour, blocking calls.

The pipeline runs on the checkpointer's private loop thread either way, so a synchronous
training loop gets the same background behaviour as an async one: ``save`` blocks only for the
snapshot copy.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from tiercheck.checkpointer import (
    BusyPolicy,
    Checkpointer,
    CheckpointerStats,
    Restored,
    SaveHandle,
    TierEncoding,
    TierPolicy,
    VersionSelector,
)
from tiercheck.codec import CodecOptions
from tiercheck.consistency.coordinator import Coordinator
from tiercheck.tiers.base import Tier
from tiercheck.topology import Topology

__all__ = ["SyncCheckpointer"]


class SyncCheckpointer:
    """A blocking :class:`~tiercheck.Checkpointer`; takes exactly the same arguments.

    Example::

        with tiercheck.SyncCheckpointer("run-1", persistent="file:///data/ckpt") as ckpt:
            restored = ckpt.restore(state)           # None on a fresh start
            for step in range(start, steps):
                train_step()
                handle = ckpt.save(step, state)      # returns after the snapshot copy
            handle.result("persistent")              # optionally wait for durability
    """

    def __init__(
        self,
        job_id: str,
        *,
        persistent: str | None = None,
        local_root: str | os.PathLike[str] | None = None,
        tiers: Sequence[str | Tier] | None = None,
        base_every: int = 10,
        keep: int | Mapping[str, int] | None = None,
        persist: VersionSelector = "base",
        encodings: Mapping[str, TierEncoding] | None = None,
        policies: Mapping[str, TierPolicy] | None = None,
        on_busy: BusyPolicy = "wait",
        max_pending: int = 1,
        tier_queue: int = 4,
        codec: CodecOptions | None = None,
        allow_pickle: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        ranks_per_node: int | None = None,
        node: str | None = None,
        coordinator: Coordinator | None = None,
        local_capacity: int | None = None,
        peer_replicas: int = 1,
        peer_timeout: float = 300.0,
        threads: int = 0,
    ) -> None:
        self._async = Checkpointer(
            job_id,
            persistent=persistent,
            local_root=local_root,
            tiers=tiers,
            base_every=base_every,
            keep=keep,
            persist=persist,
            encodings=encodings,
            policies=policies,
            on_busy=on_busy,
            max_pending=max_pending,
            tier_queue=tier_queue,
            codec=codec,
            allow_pickle=allow_pickle,
            rank=rank,
            world_size=world_size,
            ranks_per_node=ranks_per_node,
            node=node,
            coordinator=coordinator,
            local_capacity=local_capacity,
            peer_replicas=peer_replicas,
            peer_timeout=peer_timeout,
            threads=threads,
        )

    @property
    def checkpointer(self) -> Checkpointer:
        """The async checkpointer underneath."""
        return self._async

    @property
    def job_id(self) -> str:
        """The job's name."""
        return self._async.job_id

    @property
    def topology(self) -> Topology:
        """Where this rank sits."""
        return self._async.topology

    @property
    def tier_names(self) -> list[str]:
        """The tiers in use, fastest first."""
        return self._async.tier_names

    @property
    def stats(self) -> CheckpointerStats:
        """Running totals (a snapshot copy)."""
        return self._async.stats

    def open(self) -> SyncCheckpointer:
        """Open tiers, manifest and coordination (done on first use if not called)."""
        loop, engine = self._async._start()
        if not engine.opened:
            try:
                loop.call(engine.open())
            except BaseException:
                self.close(flush=False)
                raise
        return self

    def _engine(self) -> Any:
        self.open()
        loop, engine = self._async._start()
        return loop, engine

    def save(self, version: int, state: Any) -> SaveHandle:
        """Snapshot ``state`` as ``version``; returns once training may modify it again."""
        loop, engine = self._engine()
        handle: SaveHandle = loop.call(engine.save(version, state))
        return handle

    def restore(self, state: Any = None, *, version: int | None = None) -> Restored | None:
        """Restore the newest version every rank can rebuild; see :meth:`Checkpointer.restore`."""
        loop, engine = self._engine()
        restored: Restored | None = loop.call(engine.restore(state, version))
        return restored

    def wait(self) -> None:
        """Block until every save so far is committed or failed in each of its tiers."""
        loop, engine = self._engine()
        loop.call(engine.wait())

    def versions(self) -> dict[str, list[int]]:
        """Versions committed in each tier, as known to this rank."""
        loop, engine = self._engine()
        versions: dict[str, list[int]] = loop.call(engine.versions())
        return versions

    def close(self, *, flush: bool = True) -> None:
        """Finish the saves in flight (unless ``flush=False``), then release everything."""
        ckpt = self._async
        ckpt._closed = True
        if ckpt._loop is None or ckpt._engine is None:
            return
        loop, engine = ckpt._loop, ckpt._engine
        try:
            loop.call(engine.aclose(flush))
        finally:
            loop.stop()
            ckpt._loop = None

    def _abandon(self) -> None:
        """Stop dead, as a crashed process would (for tests)."""
        self._async._abandon()

    def __enter__(self) -> SyncCheckpointer:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()
