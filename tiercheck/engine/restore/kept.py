"""A node's own blobs together with the peer replicas it holds, as one tier to read from.

When a job of several nodes loses one and starts again on fewer ranks, the lost node's blobs
survive as the peer replicas another node holds (``replicas/<job>/r<rank>/`` under that node's
root, as the peer tier keeps them; see :mod:`tiercheck.tiers.peer`). A node that holds its own
old ranks' blobs in its local tier and the others' as replicas holds the whole version in its
own memory: an elastic restore (:mod:`tiercheck.engine.restore.elastic`) reads it from there instead
of from durable storage.

:class:`WithKeptReplicas` lists and reads both as if they were one tier keyed as the local tier is
(``v<version>/r<rank>.<kind>``): a blob comes from the local tier when it is there, else from
the replica kept for its rank. Reading only: a blob that fails verification is set aside
next to where it lies (the peer tier's own quarantine layout for a replica), never deleted.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Collection

from tiercheck.consistency.identity import parse_quarantine_key
from tiercheck.consistency.keys import parse_blob_key
from tiercheck.errors import BlobNotFound, StorageError
from tiercheck.tiers.base import Buffer, FailureScope, Tier

__all__ = ["WithKeptReplicas"]


class WithKeptReplicas(Tier):
    """``local``'s blobs, completed by the replicas ``kept`` keeps for job ``job``'s ranks.

    ``kept`` is a tier over a node root's ``replicas/`` folder (keys
    ``<job>/r<rank, 5 digits>/<that rank's key>``). A key is read from ``local`` when it is
    there, else from the replica kept for the rank its name says.
    """

    survives = FailureScope.PROCESS

    def __init__(self, local: Tier, kept: Tier, job: str) -> None:
        self.name = local.name
        self.local = local
        self.kept = kept
        self.job = job

    def _kept_key(self, key: str) -> str:
        parsed = parse_blob_key(parse_quarantine_key(key) or key)
        if parsed is None:
            raise BlobNotFound(f"{key} is not a blob key; {self.name!r} holds no such blob")
        return f"{self.job}/r{parsed.rank:05d}/{key}"

    async def get(self, key: str) -> Buffer:
        """The blob under ``key``: the local tier's, else the kept replica."""
        try:
            return await self.local.get(key)
        except BlobNotFound:
            return await self.kept.get(self._kept_key(key))

    async def get_range(self, key: str, start: int, end: int) -> Buffer:
        """Bytes ``[start, end)`` of the blob under ``key`` (clipped as a slice is): the local
        tier's, else the kept replica's."""
        try:
            return await _get_range(self.local, key, start, end)
        except BlobNotFound:
            return await _get_range(self.kept, self._kept_key(key), start, end)

    async def put(self, key: str, data: Buffer) -> None:
        """Only a quarantined blob may be written: set aside next to where the original lies."""
        original = parse_quarantine_key(key)
        if original is None:
            raise StorageError(f"{self.name!r} with kept replicas is read only; cannot put {key}")
        if await self.local.exists(original):
            await self.local.put(key, data)
        else:
            await self.kept.put(self._kept_key(key), data)

    async def delete(self, key: str) -> None:
        """Refused: nothing read through this view is ever deleted through it."""
        raise StorageError(f"{self.name!r} with kept replicas is read only; cannot delete {key}")

    async def exists(self, key: str) -> bool:
        """Whether the blob under ``key`` is there (locally or as a kept replica)."""
        return await self.local.exists(key) or await self.kept.exists(self._kept_key(key))

    async def list(self, prefix: str = "") -> AsyncIterator[str]:
        """The local tier's keys under ``prefix``, then the kept replicas' it lacks (as the
        local tier would name them)."""
        seen: set[str] = set()
        async for key in self.local.list(prefix):
            seen.add(key)
            yield key
        async for key in self.kept_keys(prefix, seen):
            yield key

    async def kept_keys(self, prefix: str = "", skip: Collection[str] = ()) -> AsyncIterator[str]:
        """The kept replicas' keys under ``prefix`` (as the local tier would name them), but
        those in ``skip``."""
        async for key in self.kept.list(f"{self.job}/"):
            _, _, rest = key.partition("/")
            owner, _, inner = rest.partition("/")
            parsed = parse_blob_key(inner)
            if (
                parsed is not None
                and owner == f"r{parsed.rank:05d}"
                and inner.startswith(prefix)
                and inner not in skip
            ):
                yield inner


async def _get_range(tier: Tier, key: str, start: int, end: int) -> Buffer:
    get_range = getattr(tier, "get_range", None)
    if callable(get_range):
        part: Buffer = await get_range(key, start, end)
        return part
    return memoryview(await tier.get(key)).cast("B")[start:end]
