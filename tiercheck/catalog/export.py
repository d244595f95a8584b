"""Write a stored version out as ordinary files: :func:`export` (``torch.save`` and
safetensors), laid out for safetensors by :func:`safetensors_payload`."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from tiercheck.catalog.base import Location, NullProgress, Progress
from tiercheck.catalog.locate import OpenLocation
from tiercheck.catalog.read import decode_blob, decode_resolved
from tiercheck.catalog.regions import whole_by_regions
from tiercheck.catalog.scan import Catalog
from tiercheck.codec import DTensorShard, unflatten
from tiercheck.codec.decode.statetree import own_copy
from tiercheck.codec.format.dtypes import safetensors_dtypes
from tiercheck.codec.replica import resolve_all
from tiercheck.codec.reshard.reshard import assemble, plan_reshard
from tiercheck.errors import BlobNotFound, ReshardError

__all__ = [
    "EXPORT_MODE",
    "ExportFormat",
    "ExportResult",
    "HfOptions",
    "export",
    "safetensors_payload",
    "whole_state",
    "write_folder",
]

#: What :func:`export` writes: ``OUT.pt``, ``OUT.safetensors``, or the folder ``OUT`` as a DCP
#: checkpoint or a Hugging Face model (sharded safetensors).
ExportFormat = Literal["pt", "safetensors", "dcp", "hf"]


@dataclass(frozen=True)
class HfOptions:
    """How :func:`export` writes a Hugging Face model folder."""

    #: Floating-point tensors cast to this dtype (``None``: as stored).
    dtype: torch.dtype | None = None
    #: The most bytes of tensors in one safetensors file (Hugging Face's default, 5 GB).
    max_shard: int = 5_000_000_000


@dataclass
class ExportResult:
    """What :func:`export` wrote."""

    location: Location
    version: int
    #: The rank exported, or ``None`` for the whole state assembled from every rank.
    rank: int | None
    #: ``(format, path, bytes)`` per file written.
    files: list[tuple[str, str, int]]
    tensors: int
    warnings: list[str]
    #: The abandoned set the version was taken from, or ``None`` for the run's own timeline.
    abandoned: str | None = None

    def to_json(self) -> dict[str, Any]:
        """Plain data for ``--json`` output."""
        return {
            **self.location.to_json(),
            "abandoned": self.abandoned,
            "version": self.version,
            "rank": self.rank,
            "full": self.rank is None,
            "tensors": self.tensors,
            "files": [{"format": f, "path": p, "bytes": n} for f, p, n in self.files],
            "warnings": self.warnings,
        }


_SAFETENSORS_DTYPES = safetensors_dtypes()

_JSON_SCALARS = (type(None), bool, int, float, str)


def _jsonable(value: Any) -> bool:
    if isinstance(value, _JSON_SCALARS):
        return True
    if isinstance(value, (list, tuple)):
        return all(_jsonable(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _jsonable(v) for k, v in value.items())
    return False


def safetensors_payload(
    state: Any, *, meta: Mapping[str, Any]
) -> tuple[dict[str, torch.Tensor], dict[str, str], list[str]]:
    """Flatten ``state`` for a safetensors file: ``(tensors, metadata, warnings)``.

    Tensors are keyed by their path in the state, dotted (``model.0.weight``, ``optim.state.0
    .exp_avg``) -- or, if two paths would give one dotted name, in subscript form
    (``['model']['0.weight']``) for all of them. numpy arrays become tensors. A tensor of a
    dtype safetensors cannot hold (complex128, complex32, bit types) is stored as its raw bytes
    (``uint8``), its dtype and shape listed in the ``tiercheck`` metadata entry under
    ``raw_dtypes``. Every other leaf (numbers, strings, ``None``, and lists or string-keyed
    dicts of these; also empty containers) goes into the metadata as JSON under its dotted
    path; leaves JSON cannot hold (bytes, complex numbers, dtypes...) are left out and named in
    the warnings. The ``tiercheck`` entry holds ``meta`` plus the key style; ``format`` is
    ``pt``, as the Hugging Face tools expect.
    """
    tensors: list[tuple[tuple[Any, ...], str, torch.Tensor]] = []
    leaves: list[tuple[tuple[Any, ...], Any]] = []

    def walk(obj: Any, parts: tuple[Any, ...], subscript: str) -> None:
        if isinstance(obj, torch.Tensor):
            tensors.append((parts, subscript, obj))
        elif isinstance(obj, np.ndarray):
            try:
                tensors.append((parts, subscript, torch.from_numpy(np.ascontiguousarray(obj))))
            except TypeError:
                raw = np.ascontiguousarray(obj).reshape(-1).view(np.uint8)
                tensors.append((parts, subscript, torch.from_numpy(raw.copy())))
                warnings.append(f"{subscript}: numpy dtype {obj.dtype} stored as raw bytes")
        elif isinstance(obj, dict) and obj:
            for k, v in obj.items():
                walk(v, (*parts, k), f"{subscript}[{k!r}]")
        elif isinstance(obj, (list, tuple)) and obj and not _jsonable(obj):
            for i, v in enumerate(obj):
                walk(v, (*parts, i), f"{subscript}[{i}]")
        else:
            leaves.append((parts, obj))

    warnings: list[str] = []
    walk(state, (), "")
    dotted = [".".join(str(p) for p in parts) for parts, _, _ in tensors]
    style = "dotted" if len(set(dotted)) == len(dotted) and all(dotted) else "subscript"
    names = dotted if style == "dotted" else [sub for _, sub, _ in tensors]

    out: dict[str, torch.Tensor] = {}
    raw_dtypes: dict[str, list[Any]] = {}
    for name, (_, _, tensor) in zip(names, tensors, strict=True):
        t = tensor.detach().cpu().contiguous()
        if t.dtype not in _SAFETENSORS_DTYPES:
            raw_dtypes[name] = [str(t.dtype).removeprefix("torch."), list(t.shape)]
            t = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
            warnings.append(f"{name}: dtype {raw_dtypes[name][0]} stored as raw bytes (uint8)")
        out[name] = t

    metadata: dict[str, str] = {
        "format": "pt",
        "tiercheck": json.dumps({**meta, "keys": style, "raw_dtypes": raw_dtypes}),
    }
    for parts, leaf in leaves:
        name = ".".join(str(p) for p in parts) or "."
        value = leaf.item() if isinstance(leaf, np.generic) else leaf
        if not _jsonable(value):
            warnings.append(f"{name}: a {type(value).__name__} leaf has no JSON form; left out")
            continue
        if name in metadata:
            warnings.append(f"{name}: clashes with the reserved metadata entry; left out")
            continue
        metadata[name] = json.dumps(value)
    return out, metadata, warnings


#: The mode of exported files, whatever the umask: owner only, as the local tier keeps its blobs.
#: An export holds the same data as the checkpoint (weights, optimizer state, anything the
#: state carried); sharing it is the owner's decision (``chmod``).
EXPORT_MODE = 0o600


def _write_atomic(path: Path, write: Callable[[Path], None]) -> int:
    """Write a file through a temporary name, renamed into place once complete.

    The temporary file is created with :data:`EXPORT_MODE` before anything is written, so no
    byte of it is ever readable by others, and keeps that mode whatever the writer does.
    """
    temp = path.with_name(f".{path.name}.tiercheck-tmp")
    try:
        temp.unlink(missing_ok=True)  # a leftover of an export cut short
        os.close(os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, EXPORT_MODE))
        os.chmod(temp, EXPORT_MODE)  # O_CREAT's mode went through the umask
        write(temp)
        # A writer that replaced the file instead of writing into it made it anew.
        os.chmod(temp, EXPORT_MODE)
        os.replace(temp, path)
    finally:
        temp.unlink(missing_ok=True)
    return path.stat().st_size


def write_folder(path: Path, write: Callable[[Path], None], *, force: bool = False) -> int:
    """Write a folder of files through a temporary folder beside ``path``, renamed into place
    once complete (an existing ``path`` only with ``force``, and only then moved away); every
    file :data:`EXPORT_MODE`, every folder owner-only. Returns the bytes written."""
    if path.exists() and not force:
        raise FileExistsError(f"{path} exists; pass --force to replace it")
    temp = path.with_name(f".{path.name}.tiercheck-tmp")
    old = path.with_name(f".{path.name}.tiercheck-old")
    for leftover in (temp, old):  # of an export cut short
        if leftover.exists():
            shutil.rmtree(leftover)
    try:
        os.mkdir(temp, 0o700)
        os.chmod(temp, 0o700)  # mkdir's mode went through the umask
        write(temp)
        size = 0
        for folder, dirs, names in os.walk(temp):
            for d in dirs:
                os.chmod(os.path.join(folder, d), 0o700)
            for name in names:
                os.chmod(os.path.join(folder, name), EXPORT_MODE)
                size += os.path.getsize(os.path.join(folder, name))
        if path.exists():
            path.rename(old)
        temp.rename(path)
    finally:
        if temp.exists():
            shutil.rmtree(temp)
    if old.exists():
        shutil.rmtree(old)
    return size


def _local_shards(state: Any) -> tuple[Any, int]:
    """``state`` with every stored DTensor replaced by its local tensor, and how many."""
    count = 0

    def convert(obj: Any) -> Any:
        nonlocal count
        if isinstance(obj, DTensorShard):
            count += 1
            return obj.local
        if isinstance(obj, dict):
            for key, value in list(obj.items()):
                obj[key] = convert(value)
            return obj
        if type(obj) is list:
            obj[:] = [convert(v) for v in obj]
            return obj
        if type(obj) is tuple:
            return tuple(convert(v) for v in obj)
        return obj

    return convert(state), count


async def _assembled(
    opened: OpenLocation,
    catalog: Catalog,
    version: int,
    warnings: list[str],
    *,
    allow_pickle: bool,
) -> tuple[Any, int]:
    """The whole state of ``version``: every rank's blob put together as one rank's, and how
    many tensors and values it holds.

    DTensors become their full (unsharded) tensors: by :func:`~tiercheck.codec.reshard.reshard.
    plan_reshard` onto a world of one where it applies (1-D meshes), else by region
    (:func:`~tiercheck.catalog.regions.whole_by_regions`: meshes of two dimensions, strided
    placements). State outside DTensors must be the same on every rank, or it is rank 0's (and
    a warning says so).
    """
    entry = catalog.versions[version]
    ranks = sorted(entry.blobs)
    if ranks != list(range(len(ranks))):
        raise BlobNotFound(
            f"version {version} has blobs of ranks {ranks} in the "
            f"{catalog.location.tier_name} tier; the whole state needs every rank from 0"
        )
    raws = [await decode_blob(opened, catalog, entry.blobs[r]) for r in ranks]
    # Replicated state a rank stored as a reference is taken from the rank that stored it.
    resolved = resolve_all([raw.layout for raw in raws])
    layouts = [r.layout for r in resolved]
    tensors = {s: raw.tensors() for s, raw in enumerate(raws)}

    def olds(wanted: Mapping[int, Sequence[int]]) -> dict[int, dict[int, torch.Tensor]]:
        return {
            s: {i: tensors[resolved[s].sources[i][0]][resolved[s].sources[i][1]] for i in idx}
            for s, idx in wanted.items()
        }

    try:
        try:
            plan = plan_reshard(layouts, new_rank=0, new_world=1, per_rank="refuse")
            parts = assemble(plan, olds(plan.wanted))  # compares plain state bit for bit too
        except ReshardError as exc:
            if "per_rank='wrap'" not in str(exc):
                raise
            plan = plan_reshard(layouts, new_rank=0, new_world=1, per_rank="wrap")
            parts = assemble(plan, olds(plan.wanted))
            warnings.append(
                "state outside DTensors differs between ranks; rank 0's was exported: "
                + str(exc).splitlines()[1].strip()
            )
    except ReshardError:
        if not layouts[0].has_dtensors:
            raise
        # A layout the 1-D reshard does not take (a mesh of two dimensions, strided
        # placements): put each DTensor together by region instead.
        trees = [
            unflatten(
                r.layout, [tensors[src][i] for src, i in r.sources], allow_pickle=allow_pickle
            )
            for r in resolved
        ]
        return whole_by_regions(trees, warnings), len(layouts[0].specs)
    return unflatten(plan.layout, parts, allow_pickle=allow_pickle), len(plan.layout.specs)


async def whole_state(
    opened: OpenLocation,
    catalog: Catalog,
    version: int,
    *,
    allow_pickle: bool = False,
    warnings: list[str] | None = None,
) -> tuple[Any, int]:
    """The whole state of ``version`` as it was saved, nested, put together from every rank's
    blob: sharded DTensors as their full tensors (see :func:`_assembled`), each tensor its own
    storage, bit-exact (decoding checks the digests recorded at save time). Returns it and how
    many entries it has; what had to be decided (state outside DTensors that differs between
    ranks) is appended to ``warnings``."""
    notes = [] if warnings is None else warnings
    state, count = await _assembled(opened, catalog, version, notes, allow_pickle=allow_pickle)
    state, _ = _local_shards(own_copy(state))  # each the full tensor: a mesh of one rank
    return state, count


async def export(
    opened: OpenLocation,
    catalog: Catalog,
    *,
    version: int,
    rank: int | None,
    out: Path,
    formats: Sequence[ExportFormat],
    force: bool = False,
    hf: HfOptions | None = None,
    allow_pickle: bool = False,
    progress: Progress | None = None,
    abandoned: str | None = None,
) -> ExportResult:
    """Decode ``rank``'s blob of ``version`` (with its base) and write it as ``out.pt``,
    ``out.safetensors`` and/or the DCP checkpoint folder ``out`` (``formats``); with
    ``rank=None``, the whole state put together from every rank's blob (sharded DTensors as full
    tensors, see :func:`_assembled`). The DCP folder is written by
    :func:`tiercheck.dcp.write_dcp`: ``dcp.load(state_dict, checkpoint_id=out)`` reads it into
    any layout DCP supports. The Hugging Face folder (:mod:`tiercheck.catalog.hf`, as ``hf``
    says) holds the model's tensors as sharded safetensors, and its config where the Trainer
    integration saved it: ``from_pretrained(out)`` loads it. A folder is written by
    :func:`write_folder` (an existing one is replaced only with ``force``).

    The ``.pt`` file is ``torch.save`` of the restored state -- nested as it was saved, every
    tensor its own storage -- and so a pickle, as every ``torch.save`` file is; load it with
    ``torch.load`` (``weights_only=True`` works for states of tensors, numbers, strings and
    containers). The safetensors file is laid out by :func:`safetensors_payload`. Files are
    written under a temporary name and renamed into place, both with mode ``0600``
    (:data:`EXPORT_MODE`, whatever the umask). The state is bit-exact: decoding checks it
    against the digest recorded at save time.

    To export a version of an abandoned set, pass the set's view
    (:meth:`Catalog.abandoned_view <tiercheck.catalog.Catalog.abandoned_view>`) as ``catalog``
    and its tag as ``abandoned`` (recorded in the result and the safetensors metadata).
    """
    progress = progress or NullProgress()
    hf = hf or HfOptions()
    entry = catalog.versions[version]
    which = "every rank" if rank is None else f"rank {rank}"
    progress.start(1 + len(formats), f"exporting version {version} {which}")
    files: list[tuple[str, str, int]] = []
    warnings: list[str] = []
    try:
        if rank is None:
            state, count = await whole_state(
                opened, catalog, version, allow_pickle=allow_pickle, warnings=warnings
            )
        else:
            raw = await decode_resolved(opened, catalog, entry.blobs[rank])
            count = len(raw.layout.specs)
            state = own_copy(unflatten(raw.layout, raw.tensors(), allow_pickle=allow_pickle))
            has_dtensors = raw.layout.has_dtensors
            del raw
            if has_dtensors:
                state, count_shards = _local_shards(state)
                warnings.append(
                    f"{count_shards} DTensors were exported as rank {rank}'s local shards; "
                    "their layout (global shape, placements, mesh, offsets) is not in the "
                    "exported files"
                )
        progress.advance()
        await asyncio.to_thread(out.parent.mkdir, parents=True, exist_ok=True)
        if "pt" in formats:
            path = out.with_name(out.name + ".pt")

            def save_pt(temp: Path) -> None:
                torch.save(state, temp)

            size = await asyncio.to_thread(_write_atomic, path, save_pt)
            files.append(("pt", str(path), size))
            progress.advance()
        if "safetensors" in formats:
            from safetensors.torch import save_file

            meta = {
                "job": catalog.location.job,
                "version": version,
                "rank": "all" if rank is None else rank,
                "tier": catalog.location.tier_name,
            }
            if abandoned is not None:
                meta["abandoned"] = abandoned
            tensors, metadata, warnings = await asyncio.to_thread(
                safetensors_payload, state, meta=meta
            )
            path = out.with_name(out.name + ".safetensors")

            def save_st(temp: Path) -> None:
                save_file(tensors, str(temp), metadata=metadata)

            size = await asyncio.to_thread(_write_atomic, path, save_st)
            files.append(("safetensors", str(path), size))
            progress.advance()
        if "dcp" in formats:
            from tiercheck.dcp import write_dcp

            size = await asyncio.to_thread(
                write_folder, out, functools.partial(write_dcp, state), force=force
            )
            files.append(("dcp", str(out), size))
            progress.advance()
        if "hf" in formats:
            from tiercheck.catalog.hf import hf_model, write_hf

            tensors, config, notes = hf_model(state, dtype=hf.dtype)
            warnings.extend(notes)
            write = functools.partial(write_hf, tensors, config, max_shard=hf.max_shard)
            size = await asyncio.to_thread(write_folder, out, write, force=force)
            files.append(("hf", str(out), size))
            progress.advance()
    finally:
        progress.finish()
    return ExportResult(catalog.location, version, rank, files, count, warnings, abandoned)
