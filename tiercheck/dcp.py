"""What tiercheck stores, read by ``torch.distributed.checkpoint`` (DCP).

:class:`TiercheckStorageReader` is a DCP ``StorageReader`` over one stored version: pass it to
``dcp.load(state_dict, storage_reader=...)`` and DCP's own planner loads the version into any
layout DCP supports -- another mesh, another number of ranks, a plain model in one process
(``no_dist=True``). :func:`write_dcp` writes a whole state as a DCP checkpoint folder
(``tiercheck export URL OUT --format dcp``), which ``dcp.load(..., checkpoint_id=OUT)`` reads
with no tiercheck installed.

How the reader works: every rank's blob of the version is decoded (deltas applied, every
tensor checked against the digest recorded at save time), and DCP sees each stored DTensor as
the chunks the ranks that saved it held -- each local shard at its global offset, a region
several ranks held (replicated on a mesh dimension) once -- under the key DCP's planner gives
it (the state's nested keys joined by dots, as ``dcp.save`` flattens a state dict). DCP's
planner then works out which parts of which chunks each loading rank needs, so any layout DCP
can load into works, meshes of two dimensions (FSDP + tensor parallel, HSDP) included. A
tensor outside DTensors is one chunk; where ranks stored different values for it (their RNG
states, say), rank 0's is read and :attr:`TiercheckStorageReader.warnings` says so. Each rank
that loads decodes every blob of the version once per reader (a reader caches them;
:meth:`~TiercheckStorageReader.reset` drops them), so a load needs the host memory of the
whole state on every loading rank; decoding only the blobs a rank's chunks come from, with
ranged reads, is not built yet.

Entries that are not tensors (step counters, learning rates, strings) reach DCP the way DCP
reads them from its own checkpoints: as ``torch.save`` bytes that its planner loads with
``torch.load``. That is DCP's format, not tiercheck's default path: the reader makes them from
the values tiercheck stored as plain data, and never unpickles anything it read.

This module imports ``torch.distributed.checkpoint``; ``import tiercheck`` does not import it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import io
import logging
import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from tiercheck.catalog.base import LocationError
from tiercheck.catalog.locate import OpenLocation, find_locations
from tiercheck.catalog.read import decode_resolved
from tiercheck.catalog.regions import same_value
from tiercheck.codec import DTensorShard, unflatten
from tiercheck.errors import BlobNotFound, ShardsInconsistent

__all__ = ["TiercheckStorageReader", "write_dcp"]

logger = logging.getLogger("tiercheck")


class TiercheckStorageReader(StorageReader):
    """A ``torch.distributed.checkpoint`` reader of one version tiercheck stored.

    Args:
        url: where the job's checkpoints are: the checkpointer's ``persistent=`` URL (``file://``,
            ``s3://``, a path...), that URL plus the job id, or a node root
            (``/dev/shm/tiercheck/<job>/<node>``) -- what ``tiercheck ls`` accepts.
        job_id: the job, where ``url`` holds several.
        version: the version to read; default: the newest committed one there.
        storage_options: fsspec options for ``url`` (for ``s3://``: ``key``, ``secret``,
            ``client_kwargs={"endpoint_url": ...}``).

    ``dcp.load(state_dict, storage_reader=TiercheckStorageReader(url, "job"))`` loads it into
    ``state_dict`` (tensors and DTensors in place), on one process with ``no_dist=True`` or on
    every rank of a job. The keys of ``state_dict`` must be those of the saved state (nested
    the same way); a key the version lacks is DCP's error, unless the planner allows partial
    loads. Errors: :class:`~tiercheck.catalog.LocationError` for a location or job that is not
    there, :class:`~tiercheck.errors.BlobNotFound` for a version that is not stored whole and
    committed there, :class:`~tiercheck.errors.ChecksumMismatch` for data that fails its
    checksums or digest. Nothing stored is ever changed.
    """

    def __init__(
        self,
        url: str | os.PathLike[str],
        job_id: str | None = None,
        *,
        version: int | None = None,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.url = os.fspath(url)
        self.job_id = job_id
        self.version = version
        self.storage_options = dict(storage_options or {})
        #: The version read, once :meth:`read_metadata` ran.
        self.read_version: int | None = None
        #: What had to be decided putting the version together, e.g. state outside DTensors
        #: that differed between ranks (each also logged once at WARNING).
        self.warnings: list[str] = []
        self._chunks: _Chunks | None = None

    # --- StorageReader ------------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Called by DCP at the start of a load: a ``checkpoint_id`` given to ``dcp.load``
        names another location; the version is put together again at the next read."""
        if checkpoint_id is not None:
            self.url = os.fspath(checkpoint_id)
        self._chunks = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's description of the version: each stored DTensor as the shards its ranks held,
        each other tensor one chunk of its full shape, each other entry bytes."""
        return self._version().metadata()

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        """Nothing to set up: every rank reads the version itself."""

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """The planner's plan, as it is."""
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """The planner's plans, as they are."""
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Copy what ``plan`` asks for out of the version's chunks into the planner's
        tensors."""
        version = self._version()
        for item in plan.items:
            index = item.storage_index
            if item.type == LoadItemType.BYTE_IO:
                buffer = io.BytesIO()
                torch.save(version.values[index.fqn], buffer)
                buffer.seek(0)
                planner.load_bytes(item, buffer)
                continue
            source = version.chunk(index.fqn, index.offset)
            for dim, (start, length) in enumerate(
                zip(item.storage_offsets, item.lengths, strict=True)
            ):
                source = source.narrow(dim, start, length)
            target = planner.resolve_tensor(item).detach()
            if target.size() != source.size():
                raise ValueError(
                    f"DCP asked for {tuple(target.size())} of {index.fqn!r} at "
                    f"{tuple(item.storage_offsets)} and got {tuple(source.size())}; the "
                    "planner and the stored version disagree"
                )
            target.copy_(source)
            planner.commit_tensor(item, target)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """``False``: DCP never picks this reader by itself; pass it as ``storage_reader``."""
        return False

    # --- the version --------------------------------------------------------------------------

    def _version(self) -> _Chunks:
        if self._chunks is None:
            # On a thread with a loop of its own: DCP calls from synchronous code, which may
            # itself run inside an event loop.
            with concurrent.futures.ThreadPoolExecutor(1, "tiercheck-dcp") as pool:
                self._chunks = pool.submit(asyncio.run, self._read()).result()
        return self._chunks

    async def _read(self) -> _Chunks:
        found = await find_locations(
            self.url, job=self.job_id, storage_options=self.storage_options
        )
        if len(found) != 1:
            listing = "; ".join(loc.describe() for loc in found)
            raise LocationError(
                f"{self.url} holds more than one location ({listing}); pass job_id, or the "
                "URL of one job folder or node root"
            )
        async with OpenLocation(found[0]) as opened:
            catalog = await opened.scan()
            restorable = catalog.restorable()
            where = found[0].describe()
            if self.version is None:
                if not restorable:
                    raise BlobNotFound(f"the {where} holds no committed version")
                version = restorable[-1]
            elif self.version not in restorable:
                raise BlobNotFound(
                    f"version {self.version} is not stored whole and committed in the {where}; "
                    f"committed: {restorable or 'none'}"
                )
            else:
                version = self.version
            blobs = catalog.versions[version].blobs
            chunks = _Chunks()
            for rank in sorted(blobs):
                raw = await decode_resolved(opened, catalog, blobs[rank])
                tree = unflatten(raw.layout, raw.tensors(), allow_pickle=False)
                del raw
                flat, _ = flatten_state_dict(tree)
                chunks.add(rank, flat)
        self.read_version = version
        self.warnings = chunks.warnings
        for warning in self.warnings:
            logger.warning("tiercheck: reading version %s for DCP: %s", version, warning)
        return chunks


class _Chunks:
    """A version as DCP reads it: per key, the chunks of a tensor or the value of an entry."""

    def __init__(self) -> None:
        #: Tensors: their dtype, global shape and chunks by offset.
        self.tensors: dict[str, tuple[torch.dtype, torch.Size, dict[tuple[int, ...], Any]]] = {}
        #: Entries that are not tensors.
        self.values: dict[str, Any] = {}
        self.warnings: list[str] = []
        # What rank 0 (the lowest rank that has the key) stored outside DTensors.
        self._plain: dict[str, tuple[int, Any]] = {}

    def add(self, rank: int, flat: Mapping[str, Any]) -> None:
        """Take one old rank's flattened state."""
        for key, value in flat.items():
            if isinstance(value, DTensorShard):
                self._shard(rank, key, value)
            elif key in self._plain:
                first, seen = self._plain[key]
                if not same_value(seen, value):
                    self.warnings.append(
                        f"{key}: ranks {first} and {rank} stored different values outside "
                        f"DTensors; rank {first}'s is read"
                    )
            else:
                self._plain[key] = (rank, value)
                if isinstance(value, torch.Tensor):
                    whole = tuple(0 for _ in value.shape)
                    self.tensors[key] = (value.dtype, value.size(), {whole: value})
                else:
                    self.values[key] = value

    def _shard(self, rank: int, key: str, shard: DTensorShard) -> None:
        shape = torch.Size(shard.shape)
        dtype = shard.local.dtype
        entry = self.tensors.setdefault(key, (dtype, shape, {}))
        if entry[0] != dtype or entry[1] != shape:
            raise ShardsInconsistent(
                f"{key}: rank {rank} stored a {dtype}{tuple(shape)} DTensor where another rank "
                f"stored {entry[0]}{tuple(entry[1])}; the blobs are not of one save"
            )
        if shard.local.numel() == 0:
            return  # an empty shard (a rank past the end of a dimension) holds nothing
        # A region several ranks hold (replicated on a mesh dimension) is read once; they
        # must agree on it, or the blobs are not of one save.
        held = entry[2].setdefault(tuple(shard.offset), shard.local)
        if held is not shard.local and not same_value(held, shard.local):
            raise ShardsInconsistent(
                f"{key}: ranks hold the region at {tuple(shard.offset)} with different values "
                f"(rank {rank} among them); the blobs are not of one save"
            )

    def metadata(self) -> Metadata:
        """DCP's metadata of the version."""
        entries: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
        for key, (dtype, shape, chunks) in self.tensors.items():
            entries[key] = TensorStorageMetadata(
                properties=TensorProperties(dtype=dtype),
                size=shape,
                chunks=[
                    ChunkStorageMetadata(offsets=torch.Size(offset), sizes=local.size())
                    for offset, local in sorted(chunks.items())
                ],
            )
        for key in self.values:
            entries[key] = BytesStorageMetadata()
        return Metadata(state_dict_metadata=entries)

    def chunk(self, key: str, offset: Sequence[int] | None) -> torch.Tensor:
        """The chunk of tensor ``key`` that starts at ``offset``."""
        chunks = self.tensors[key][2]
        found = chunks.get(tuple(offset or ()))
        if found is None:
            raise ValueError(
                f"DCP asked for the chunk of {key!r} at {tuple(offset or ())}; the stored "
                f"version has chunks at {sorted(chunks)}"
            )
        return cast(torch.Tensor, found)


def write_dcp(state: Mapping[str, Any], folder: Path) -> None:
    """Write ``state`` (a whole state, no DTensors) as a DCP checkpoint into the empty
    ``folder``, in this one process (``tiercheck export --format dcp`` writes it beside its
    final name and renames it into place: :func:`tiercheck.catalog.export.write_folder`)."""
    with warnings.catch_warnings():
        # One process is what this is: DCP's warning that it assumes one says nothing.
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp_save(dict(state), storage_writer=FileSystemWriter(folder), no_dist=True)
