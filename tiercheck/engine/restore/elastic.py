"""Elastic restore: a version saved by another number of ranks, resharded onto this world.

A version's world size comes from the job's history (:mod:`tiercheck.consistency.worlds`). When
it differs from this run's, no rank has "its" blob: new rank ``q`` reads the headers of every
old rank's blob, plans which old tensors it needs
(:func:`~tiercheck.codec.reshard.reshard.plan_reshard`; a DTensor on a mesh of two dimensions is cut
by region into the shard the caller's own DTensor holds, :func:`targets_in`), reads those -- only
the chunks or frames that hold the bytes of them it uses (the rows of an old
shard its new shard overlaps: :attr:`~tiercheck.codec.reshard.reshard.ReshardPlan.spans`), by ranged
reads where the tier serves them (:class:`~tiercheck.tiers.base.SupportsRangedGet`) or as
slices of the mapping where it maps its blobs into memory (the local tier), each range verified
against its checksum -- and puts together the state it would have saved itself
(:func:`~tiercheck.codec.reshard.reshard.assemble`). The result goes through the same check against
the caller's state and the same copy into it as any restore.

A tier can serve such a version when it holds every old rank's blob of it: the persistent tier
when the ``COMMIT`` record is there, a memory tier when its listing shows a blob of every old
rank (a one-node job: the node's shared memory holds all of them). The node's local tier counts
the peer replicas the node keeps as well (:class:`~tiercheck.engine.restore.kept.WithKeptReplicas`):
a job of two nodes that lost one holds the whole version on the other, its own ranks' blobs in
its local tier and the lost node's as the replicas it kept for them.

Replicated state an old rank stored as a reference to another rank (its node's first, or rank 0)
(:class:`~tiercheck.codec.encode.flatten.ReplicaRef`) is resolved before planning
(:func:`~tiercheck.codec.replica.resolve`): the plan sees the layout that rank would have saved
whole, and the tensors there are read from the rank that stored them.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
from collections.abc import Collection, Mapping
from concurrent.futures import Executor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tiercheck.codec import BlobMeta, RangedBlob, read_meta_ranged, read_tensors
from tiercheck.codec.decode.assembled import Resharded
from tiercheck.codec.decode.partial import Fetch, widen
from tiercheck.codec.decode.statetree import Lenient
from tiercheck.codec.format.dtensor import DTensorShard, is_dtensor, layout_of
from tiercheck.codec.replica import resolve_all
from tiercheck.codec.reshard.boxes import Target
from tiercheck.codec.reshard.reshard import assemble, plan_reshard
from tiercheck.consistency.commit import CommitRecord
from tiercheck.consistency.keys import commit_key, parse_blob_key, version_prefix
from tiercheck.consistency.recovery import Inventory
from tiercheck.defaults import NodeRoot
from tiercheck.engine.commit.tier import writes_commit_records
from tiercheck.engine.open.claim import Claim
from tiercheck.engine.options import Options
from tiercheck.engine.part import RankPart
from tiercheck.engine.restore.kept import WithKeptReplicas
from tiercheck.engine.results import CheckpointerStats
from tiercheck.errors import BlobNotFound, ChecksumMismatch, FormatError, ReshardError
from tiercheck.tiers.base import Buffer, SupportsRangedGet, Tier
from tiercheck.tiers.local import LocalTier

if TYPE_CHECKING:
    from tiercheck.engine.commit.tier import TierPipeline
    from tiercheck.engine.restore.read import Reader

__all__ = ["ElasticReader", "Resharded", "targets_in"]

logger = logging.getLogger("tiercheck")


def targets_in(state: Any) -> dict[str, Target]:
    """The DTensors of the state restored into, by the path their local tensor is stored under
    (none without a state): what a version of another world is resharded into where its layout
    alone cannot say (meshes of two dimensions). Live DTensors and stored ones
    (:class:`~tiercheck.codec.format.dtensor.DTensorShard`) count; a ``Stateful`` object stands for
    its ``state_dict()``."""
    out: dict[str, Target] = {}

    def walk(obj: Any, path: str) -> None:
        t = type(obj)
        if t is Lenient:
            walk(obj.template, path)
        elif isinstance(obj, dict):
            for key, value in obj.items():
                walk(value, f"{path}[{key!r}]")
        elif t is list or t is tuple:
            for i, value in enumerate(obj):
                walk(value, f"{path}[{i}]")
        elif t is DTensorShard:
            out[path] = Target(obj.record(), obj.local.dtype, tuple(obj.local.shape))
        elif is_dtensor(obj):
            try:
                record = layout_of(obj)
            except ValueError:
                # A placement with no stored form: the DTensor gets no target, and the check
                # of the state against the version names it.
                return
            local = obj.to_local()
            out[path] = Target(dict(record), local.dtype, tuple(local.shape))

    if state is not None:
        walk(state, "")
    return out


class ElasticReader(RankPart):
    """Reads versions another number of ranks saved, resharded for this rank."""

    def __init__(
        self,
        options: Options,
        stats: CheckpointerStats,
        claim: Claim,
        *,
        cpu: Executor,
        pipes: Mapping[str, TierPipeline],
        reader: Reader,
    ) -> None:
        super().__init__(options, claim, pipes)
        self.stats = stats
        #: Worker threads for checking digests.
        self.cpu = cpu
        self.reader = reader
        # The peer replicas this node holds for the job (read in place; see engine/restore/kept.py),
        # and the other worlds' versions the local tier serves only with them.
        self._kept: Tier | None = None
        self._with_kept: set[int] = set()
        # Blobs fetched during one read: the header and the tensors come from the same blob.
        self._blobs: dict[tuple[str, str], Buffer] = {}
        self._lock = threading.Lock()

    async def _get(self, tier: Tier, key: str) -> Buffer:
        blob = self._blobs.get((tier.name, key))
        if blob is None:
            blob = self._blobs[(tier.name, key)] = await tier.get(key)
        return blob

    async def servable(self, pipe: TierPipeline, listed: set[int] | None) -> set[int]:
        """Versions of other worlds ``pipe``'s tier holds whole (every old rank's blob).

        ``listed`` is what the durable tier's ``COMMIT`` records list; ``None`` for a memory
        tier, whose blobs are listed here.
        """
        world, claim = self.topo.world_size, self.claim
        if listed is not None:
            return {v for v in listed if claim.world_of(v) != world}

        def whole(keys: Collection[str]) -> set[int]:
            ranks: dict[int, set[int]] = {}
            for key in keys:
                parsed = parse_blob_key(key)
                if parsed is not None and claim.world_of(parsed.version) != world:
                    ranks.setdefault(parsed.version, set()).add(parsed.rank)
            return {v for v, held in ranks.items() if held >= set(range(claim.world_of(v)))}

        keys = {key async for key in pipe.tier.list("v")}
        alone = whole(keys)
        if not self._is_node_local(pipe.tier):
            return alone
        self._with_kept = set()
        held = self._kept_replicas()
        if held is None:
            return alone
        # A lost node's blobs survive as the replicas this node holds for its ranks.
        view = WithKeptReplicas(pipe.tier, held, self.job_id)
        keys |= {key async for key in view.kept_keys("v", keys)}
        self._with_kept = whole(keys) - alone
        return alone | self._with_kept

    def _is_node_local(self, tier: Tier) -> bool:
        """Whether ``tier`` is this node's local tier (its blobs under the node root)."""
        blobs = os.path.abspath(NodeRoot(self._node_root).blobs)
        return isinstance(tier, LocalTier) and os.path.abspath(tier.root) == blobs

    @property
    def _node_root(self) -> Path:
        return Path(self.options.job.node_root)

    def _kept_replicas(self) -> Tier | None:
        """The peer replicas this node holds (a tier over its ``replicas/`` folder), when it
        holds any of this job's."""
        if self._kept is None:
            replicas = NodeRoot(self._node_root).replicas
            if not (replicas / self.job_id).is_dir():
                return None
            self._kept = LocalTier(replicas, name="kept-replicas")
        return self._kept

    def _source(self, tier: Tier, version: int) -> Tier:
        """What ``version`` is read from in ``tier``: with the kept replicas where needed."""
        if version in self._with_kept and self._is_node_local(tier) and self._kept is not None:
            return WithKeptReplicas(tier, self._kept, self.job_id)
        return tier

    async def fetch(
        self, version: int, mine: Inventory, targets: Mapping[str, Target] | None = None
    ) -> tuple[Resharded | None, str | None, list[str]]:
        """Read ``version`` resharded from the fastest tier that serves it; else why not.

        ``targets``: the DTensors of the state restored into, by path (see
        :func:`~tiercheck.codec.reshard.reshard.plan_reshard`); DTensors on meshes of two or more
        dimensions are resharded into them by region.

        A :class:`~tiercheck.errors.ReshardError` (the version cannot be resharded onto this
        world at all) is raised, not passed over: no other tier would do better.
        """
        reasons: list[str] = []
        for name in mine.sources(version):
            try:
                return await self.read(self.pipes[name].tier, version, targets), name, reasons
            except ReshardError:
                raise
            except Exception as exc:
                self.stats.restore_fallbacks += 1
                reasons.append(f"{name}: {type(exc).__name__}: {exc}")
                logger.warning(
                    "tiercheck: version %s (resharded) from the %r tier is unusable (%r); "
                    "trying the next tier",
                    version,
                    name,
                    exc,
                )
        if not reasons:
            reasons.append("no tier holds every old rank's blob of it")
        return None, None, reasons

    async def read(
        self, tier: Tier, version: int, targets: Mapping[str, Target] | None = None
    ) -> Resharded:
        """This rank's share of ``version`` from ``tier``, put together from the old ranks'."""
        self._blobs.clear()
        try:
            return await self._read(self._source(tier, version), version, targets)
        finally:
            self._blobs.clear()

    async def _read(
        self, tier: Tier, version: int, targets: Mapping[str, Target] | None
    ) -> Resharded:
        old_world = self.claim.world_of(version)
        keys = await self._keys(tier, version, old_world)
        metas = await asyncio.gather(
            *(self._meta(tier, keys[s], version, s) for s in range(old_world))
        )
        # An old rank that stored references to its node's first rank (replicated state) is
        # planned with the layout it would have saved whole; its tensors there come from the
        # rank that stored them.
        resolved = await asyncio.to_thread(resolve_all, [m.layout for m in metas])
        plan = plan_reshard(
            [r.layout for r in resolved],
            new_rank=self.rank,
            new_world=self.topo.world_size,
            per_rank=self.options.job.per_rank,
            targets=targets,
        )
        # Per blob, the tensors wanted and the bytes of each the plan uses (a new shard needs
        # only the rows of an old one it overlaps).
        needed: dict[int, dict[int, tuple[int, int]]] = {}
        for s, wanted in plan.wanted.items():
            for i in wanted:
                r, j = resolved[s].sources[i]
                widen(needed.setdefault(r, {}), j, plan.spans[s, i])
        real: dict[int, Mapping[int, torch.Tensor]] = {}
        for r, spans in sorted(needed.items()):
            real[r] = await self._tensors(tier, keys[r], metas[r], spans)
        old: dict[int, Mapping[int, torch.Tensor]] = {
            s: {i: real[resolved[s].sources[i][0]][resolved[s].sources[i][1]] for i in wanted}
            for s, wanted in plan.wanted.items()
        }
        parts = await asyncio.to_thread(assemble, plan, old)
        return Resharded(version, plan.layout, tuple(parts), old_world)

    async def _keys(
        self, tier: Tier, version: int, old_world: int, ranks: range | None = None
    ) -> dict[int, str]:
        """The blob key of ``version`` in ``tier`` of each old rank in ``ranks`` (all)."""
        wanted = range(old_world) if ranks is None else ranks
        if writes_commit_records(tier):
            record = CommitRecord.from_bytes(bytes(await tier.get(commit_key(version))))
            if record.world_size != old_world:
                raise FormatError(
                    f"the COMMIT record of version {version} lists {record.world_size} ranks; "
                    f"the job's history says {old_world} saved it"
                )
            return {e.rank: e.key for e in record.entries}
        found: dict[int, tuple[int, str]] = {}
        async for key in tier.list(version_prefix(version)):
            parsed = parse_blob_key(key)
            if parsed is None or parsed.rank >= old_world:
                continue
            # The cheaper read first.
            if parsed.rank not in found or parsed.read_order < found[parsed.rank]:
                found[parsed.rank] = parsed.read_order
        missing = sorted(set(wanted) - set(found))
        if missing:
            raise BlobNotFound(
                f"{tier.name!r} lacks the blobs of old ranks {missing} of version {version}"
            )
        return {r: k for r, (_, k) in found.items()}

    async def _fetch(self, tier: Tier, key: str) -> Fetch:
        """A synchronous ``fetch(start, end)`` of ``key``'s bytes, for the codec's worker threads:
        ranged reads where the tier serves them, else slices of the whole blob (read once)."""
        loop = asyncio.get_running_loop()
        stats, lock = self.stats, self._lock
        # Every tier's get copies the whole blob (the local tier's too: it never maps a file
        # others may truncate), so a tier that serves ranges reads only what is needed.
        if isinstance(tier, SupportsRangedGet):
            ranged = tier

            def fetch(start: int, end: int) -> Buffer:
                got = asyncio.run_coroutine_threadsafe(
                    ranged.get_range(key, start, end), loop
                ).result()
                with lock:  # fetches run on several worker threads
                    stats.reshard_bytes_read += memoryview(got).nbytes
                return got

            return fetch
        whole = memoryview(await self._get(tier, key)).cast("B")

        def view(start: int, end: int) -> Buffer:
            part = whole[start:end]
            with lock:
                stats.reshard_bytes_read += part.nbytes
            return part

        return view

    async def _meta(self, tier: Tier, key: str, version: int, rank: int) -> BlobMeta:
        fetch = await self._fetch(tier, key)
        try:
            meta = await asyncio.to_thread(read_meta_ranged, fetch)
            if meta.version != version or meta.rank != rank:
                raise FormatError(
                    f"{key} in {tier.name!r} holds version {meta.version} of rank {meta.rank}"
                )
        except (ChecksumMismatch, FormatError) as exc:
            await self._quarantine(tier, key, exc)
            raise
        return meta

    async def _tensors(
        self, tier: Tier, key: str, meta: BlobMeta, spans: Mapping[int, tuple[int, int]]
    ) -> dict[int, torch.Tensor]:
        """The tensors of one old rank's blob at the indices ``spans`` names, their bytes in
        each span: only the chunks or frames that hold those, each checked against its digest
        (a delta's base likewise)."""
        base: RangedBlob | None = None
        if meta.base is not None:
            base_world = self.claim.world_of(meta.base.version)
            base_keys = await self._keys(
                tier, meta.base.version, base_world, range(meta.rank, meta.rank + 1)
            )
            base_key = base_keys[meta.rank]
            base_meta = await self._meta(tier, base_key, meta.base.version, meta.rank)
            if base_meta.base is not None:
                raise FormatError(f"{key}: its base {base_key} is a delta itself")
            base = RangedBlob(base_meta, await self._fetch(tier, base_key))
        fetch = await self._fetch(tier, key)
        try:
            return await asyncio.to_thread(
                functools.partial(
                    read_tensors,
                    meta,
                    fetch,
                    sorted(spans),
                    base=base,
                    spans=spans,
                    executor=self.cpu,
                )
            )
        except (ChecksumMismatch, FormatError) as exc:
            await self._quarantine(tier, key, exc)
            raise

    async def _quarantine(self, tier: Tier, key: str, exc: Exception) -> None:
        """Set a blob that failed verification aside (read whole for that: it is rare)."""
        try:
            blob = await self._get(tier, key)
        except Exception as get_exc:
            logger.error(
                "tiercheck: %s in %r failed verification (%s) and could not be read back to be "
                "set aside (%r); it stays under its own key",
                key,
                tier.name,
                exc,
                get_exc,
            )
            return
        await self.reader.quarantine(tier, key, blob, exc)
