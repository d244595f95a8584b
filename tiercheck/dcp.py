"""What tiercheck stores, read by ``torch.distributed.checkpoint`` (DCP).

:class:`TiercheckStorageReader` is a DCP ``StorageReader`` over one stored version: pass it to
``dcp.load(state_dict, storage_reader=...)`` and DCP's own planner loads the version into any
layout DCP supports -- another mesh, another number of ranks, a plain model in one process
(``no_dist=True``). :func:`write_dcp` writes a version as a DCP checkpoint folder (``tiercheck
export URL OUT --format dcp``), which ``dcp.load(..., checkpoint_id=OUT)`` reads with no
tiercheck installed.

How the reader works: the version is put together whole from every rank's blob
(:func:`tiercheck.catalog.export.whole_state`: sharded DTensors as their full tensors,
deltas applied, every tensor checked against the digest recorded at save time), and DCP sees
each tensor as one chunk of its full shape under the key DCP's planner gives it (the state's
nested keys joined by dots, as ``dcp.save`` flattens a state dict). Each rank that loads puts
the whole version together once per reader (a reader caches it; :meth:`reset` drops it), so a
load needs the host memory of the whole state on every rank: fine for the models a job
restarts elsewhere to inspect or to convert, not yet for reading a few shards of a very large
one (ranged reads of only the shards a rank needs are not built yet).

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
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

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
from tiercheck.catalog.export import whole_state
from tiercheck.catalog.locate import OpenLocation, find_locations
from tiercheck.errors import BlobNotFound

__all__ = ["TiercheckStorageReader", "dcp_metadata", "write_dcp"]


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
    committed there, :class:`~tiercheck.errors.CorruptBlob` for data that fails its digest.
    Nothing stored is ever changed.
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
        #: What had to be decided putting the version together (logged by nobody: for the
        #: caller to look at), e.g. state outside DTensors that differed between ranks.
        self.warnings: list[str] = []
        self._flat: dict[str, Any] | None = None

    # --- StorageReader ------------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Called by DCP at the start of a load: a ``checkpoint_id`` given to ``dcp.load``
        names another location; the version is put together again at the next read."""
        if checkpoint_id is not None:
            self.url = os.fspath(checkpoint_id)
        self._flat = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's description of the version: each tensor one chunk of its full shape, each
        other entry bytes."""
        return dcp_metadata(self._state())

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
        """Copy what ``plan`` asks for out of the version into the planner's tensors."""
        flat = self._state()
        for item in plan.items:
            value = flat[item.storage_index.fqn]
            if item.type == LoadItemType.BYTE_IO:
                buffer = io.BytesIO()
                torch.save(value, buffer)
                buffer.seek(0)
                planner.load_bytes(item, buffer)
                continue
            source = value
            for dim, (start, length) in enumerate(
                zip(item.storage_offsets, item.lengths, strict=True)
            ):
                source = source.narrow(dim, start, length)
            target = planner.resolve_tensor(item).detach()
            if target.size() != source.size():
                raise ValueError(
                    f"DCP asked for {tuple(target.size())} of {item.storage_index.fqn!r} at "
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

    def _state(self) -> dict[str, Any]:
        if self._flat is None:
            # On a thread with a loop of its own: DCP calls from synchronous code, which may
            # itself run inside an event loop.
            with concurrent.futures.ThreadPoolExecutor(1, "tiercheck-dcp") as pool:
                state = pool.submit(asyncio.run, self._read()).result()
            self._flat, _ = flatten_state_dict(state)
        return self._flat

    async def _read(self) -> Any:
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
            self.warnings = []
            state, _ = await whole_state(opened, catalog, version, warnings=self.warnings)
        self.read_version = version
        return state


def dcp_metadata(flat: Mapping[str, Any]) -> Metadata:
    """DCP metadata of a flattened state (keys as ``dcp.save`` flattens them): a tensor is one
    chunk of its full shape, anything else bytes."""
    entries: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    for key, value in flat.items():
        if isinstance(value, torch.Tensor):
            size = value.size()
            entries[key] = TensorStorageMetadata(
                properties=TensorProperties(dtype=value.dtype),
                size=size,
                chunks=[ChunkStorageMetadata(offsets=torch.Size([0] * len(size)), sizes=size)],
            )
        else:
            entries[key] = BytesStorageMetadata()
    return Metadata(state_dict_metadata=entries)


def write_dcp(state: Mapping[str, Any], folder: Path) -> None:
    """Write ``state`` (a whole state, no DTensors) as a DCP checkpoint into the empty
    ``folder``, in this one process (``tiercheck export --format dcp`` writes it beside its
    final name and renames it into place: :func:`tiercheck.catalog.export.write_folder`)."""
    with warnings.catch_warnings():
        # One process is what this is: DCP's warning that it assumes one says nothing.
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp_save(dict(state), storage_writer=FileSystemWriter(folder), no_dist=True)
