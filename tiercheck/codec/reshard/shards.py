"""Old shards of one save, per DTensor: the checks and the cut behind :mod:`.reshard`.

:func:`read_stored` decodes one old rank's layout once (its skeleton's tree, see
:mod:`~tiercheck.codec.format.skeleton`, and its DTensor records by path); :func:`sharded_dtensor`
checks that a DTensor is held alike by every old rank and that their shards tile it (the rules are
in :mod:`~tiercheck.codec.reshard.reshard`'s docstring); :func:`new_shard` and :func:`pieces_for`
say what a new rank holds of it and which boxes of the old shards make that up. Pure: no I/O.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import operator
from collections.abc import Sequence
from typing import Any

import msgpack
import torch

from tiercheck.codec.format.layout import Layout, TensorSpec
from tiercheck.codec.format.skeleton import DTensorNode, leaves, read_tree
from tiercheck.errors import FormatError, ReshardError, ShardsInconsistent

__all__ = [
    "Piece",
    "Sharded",
    "Stored",
    "new_shard",
    "pieces_for",
    "plain_indices",
    "read_stored",
    "sharded_dtensor",
    "torch_chunk",
]

#: What the messages tell a user whose state cannot be resharded.
_SUPPORTED = (
    "tiercheck reshards DTensors saved on a 1-D mesh over all saving ranks with Shard(d) or "
    "Replicate() placements (FSDP2's layout) from the stored layout alone; any other mesh "
    "(2-D: FSDP2 + tensor parallel, HSDP) only in an in-place restore, "
    "restore(state, elastic=True), into the state parallelized on the new mesh"
)
INCONSISTENT = (
    "The old blobs do not belong to one consistent save: restore another version (or on the "
    "number of ranks that saved this one)."
)


# --- torch's rule ----------------------------------------------------------------------------


def torch_chunk(length: int, world: int, rank: int) -> tuple[int, int]:
    """``(offset, size)`` of rank ``rank``'s shard of ``length`` rows split over ``world`` ranks.

    torch's own rule for ``Shard(d)`` (``Shard.local_shard_size_and_offset`` and
    ``compute_local_shape_and_global_offset``): ``torch.chunk`` semantics, chunks of
    ``ceil(length / world)``; a rank past the end holds an empty shard at offset ``length``.
    """
    chunk = -(-length // world) if world else 0
    start = min(rank * chunk, length)
    return start, min(start + chunk, length) - start


@dataclasses.dataclass(frozen=True, slots=True)
class Piece:
    """One box copied from an old rank's tensor into a new tensor.

    ``size`` elements in every dimension, from ``src_start`` in tensor ``index`` of old rank
    ``rank`` to ``dst_start`` in the new tensor (all tuples have the tensor's number of
    dimensions; a 0-dim tensor has empty ones).
    """

    rank: int
    index: int
    src_start: tuple[int, ...]
    dst_start: tuple[int, ...]
    size: tuple[int, ...]

    @property
    def src(self) -> tuple[slice, ...]:
        """The box in the old tensor, as an index."""
        return tuple(slice(a, a + n) for a, n in zip(self.src_start, self.size, strict=True))

    @property
    def dst(self) -> tuple[slice, ...]:
        """The box in the new tensor, as an index."""
        return tuple(slice(a, a + n) for a, n in zip(self.dst_start, self.size, strict=True))


@dataclasses.dataclass
class Stored:
    """One old rank's layout, decoded once."""

    rank: int
    layout: Layout
    tree: Any
    dtensors: dict[str, DTensorNode]  # by the path of the local tensor's spec


def read_stored(rank: int, layout: Layout) -> Stored:
    """Old rank ``rank``'s ``layout`` decoded once: its skeleton's tree and DTensor records
    (:class:`~tiercheck.errors.FormatError` for a malformed skeleton or a record pointing at no
    tensor)."""
    try:
        tree = read_tree(layout.skeleton)
    except (msgpack.UnpackException, ValueError, TypeError) as exc:
        if isinstance(exc, FormatError):
            raise
        raise FormatError(f"old rank {rank}'s state skeleton is malformed: {exc}") from exc
    dtensors: dict[str, DTensorNode] = {}
    for dt in leaves(tree, _is_dtensor):
        if not 0 <= dt.index < len(layout.specs):
            raise FormatError(
                f"old rank {rank}'s skeleton refers to tensor {dt.index}; its layout has "
                f"{len(layout.specs)}"
            )
        dtensors[layout.specs[dt.index].path] = dt
    return Stored(rank, layout, tree, dtensors)


@dataclasses.dataclass
class Sharded:
    """One DTensor as all old ranks hold it."""

    path: str
    record: dict[str, Any]  # old rank 0's
    dtype: torch.dtype
    dim: int | None  # the sharded dimension; None: replicated
    # Per old rank, ascending by start: (start, stop, rank, index) along ``dim``.
    intervals: list[tuple[int, int, int, int]]
    indices: list[int]  # the local tensor's index in each old rank's layout
    local_shapes: list[tuple[int, ...]]


#: A DTensor record's fields that every rank holding it must agree on.
global_fields = operator.itemgetter("shape", "stride", "placements", "mesh", "names", "device")


def _refuse_layout(path: str, what: str) -> ReshardError:
    return ReshardError(
        f"cannot reshard the DTensor at {path}: {what}. {_SUPPORTED}. Restore on the number "
        "of ranks that saved it, or save this state with a supported layout."
    )


def sharded_dtensor(path: str, olds: Sequence[Stored]) -> Sharded:
    """The DTensor at ``path`` as every old rank holds it, checked: one the rules support
    (else :class:`~tiercheck.errors.ReshardError`), the same layout on every old rank and old
    shards that tile it exactly (else :class:`~tiercheck.errors.ShardsInconsistent`)."""
    n = len(olds)
    first = olds[0].dtensors[path]
    record = first.record
    dtype = olds[0].layout.specs[first.index].dtype
    try:
        shape = tuple(int(d) for d in record["shape"])
        mesh = [int(d) for d in record["mesh"]]
        placements = [list(p) for p in record["placements"]]
        reference = global_fields(record)
    except (KeyError, TypeError, ValueError) as exc:
        raise FormatError(f"old rank 0 holds a malformed DTensor record at {path}: {exc}") from exc
    if len(mesh) != 1 or len(placements) != 1:
        raise _refuse_layout(path, f"it was saved on a mesh of shape {tuple(mesh)}")
    if mesh[0] > n:
        # No rank of a save can sit on a mesh larger than that save's world: the record of
        # which world saved the version, or the blobs, are not what they should be.
        raise ShardsInconsistent(
            f"cannot reshard the DTensor at {path}: it was saved on a mesh of {mesh[0]} ranks, "
            f"but {n} ranks are recorded as having saved the version. {INCONSISTENT}"
        )
    if mesh[0] != n:
        raise _refuse_layout(
            path, f"it was saved on a mesh of {mesh[0]} ranks, but {n} ranks saved the version"
        )
    placement = placements[0]
    kind = placement[0] if placement else None
    dim: int | None
    if kind == "replicate":
        dim = None
    elif kind == "shard" and len(placement) == 2 and type(placement[1]) is int:
        dim = placement[1]
        if not 0 <= dim < len(shape):
            raise _refuse_layout(path, f"it is sharded on dimension {dim} of a {shape} tensor")
    else:
        raise _refuse_layout(path, f"its placement is {placement!r}")
    indices: list[int] = []
    local_shapes: list[tuple[int, ...]] = []
    intervals: list[tuple[int, int, int, int]] = []
    zeros = (0,) * len(shape)
    for old in olds:
        spec, offset, index = held_shard(path, old, reference, dtype)
        local = spec.shape
        if dim is None:
            fits = offset == zeros and local == shape
        else:
            # Along the sharded dimension an empty shard may sit anywhere up to the end
            # (torch puts it at the end); elsewhere each shard spans the whole dimension.
            fits = (
                len(offset) == len(local) == len(shape)
                and offset[:dim] == zeros[:dim]
                and offset[dim + 1 :] == zeros[dim + 1 :]
                and local[:dim] == shape[:dim]
                and local[dim + 1 :] == shape[dim + 1 :]
                and offset[dim] >= 0
                and offset[dim] + local[dim] <= shape[dim]
            )
        if not fits:
            raise _tiling(path, old.rank, offset, local, shape)
        indices.append(index)
        local_shapes.append(local)
        if dim is not None:
            intervals.append((offset[dim], offset[dim] + local[dim], old.rank, index))
    if dim is not None:
        intervals.sort()
        end = 0
        for start, stop, rank, _ in intervals:
            if start == stop:
                continue
            if start != end:
                raise ShardsInconsistent(
                    f"cannot reshard the DTensor at {path}: the old shards do not cover its "
                    f"dimension {dim} exactly (old rank {rank}'s shard starts at {start}, the "
                    f"shards before it end at {end}). {INCONSISTENT}"
                )
            end = stop
        if end != shape[dim]:
            raise ShardsInconsistent(
                f"cannot reshard the DTensor at {path}: the old shards cover its dimension "
                f"{dim} up to {end} of {shape[dim]}. {INCONSISTENT}"
            )
        intervals = [iv for iv in intervals if iv[0] != iv[1]]
    return Sharded(path, record, dtype, dim, intervals, indices, local_shapes)


def held_shard(
    path: str, old: Stored, reference: Any, dtype: torch.dtype
) -> tuple[TensorSpec, tuple[int, ...], int]:
    """Old rank ``old``'s shard of the DTensor at ``path``: its spec, global offset and index in
    that rank's layout, checked to be laid out as old rank 0's (``reference``: its
    :data:`global_fields`; ``dtype``: its dtype). Else
    :class:`~tiercheck.errors.ShardsInconsistent` (:class:`~tiercheck.errors.FormatError` for a
    malformed record)."""
    dt = old.dtensors.get(path)
    if dt is None:
        raise ShardsInconsistent(
            f"cannot reshard: old rank 0 holds a DTensor at {path} but old rank {old.rank} "
            "does not. The old ranks must hold the same DTensors (every rank of an FSDP2 "
            "job does)."
        )
    spec = old.layout.specs[dt.index]
    try:
        fields = global_fields(dt.record)
        offset = tuple(map(int, dt.record["offset"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise FormatError(
            f"old rank {old.rank} holds a malformed DTensor record at {path}: {exc}"
        ) from exc
    if fields != reference or spec.dtype != dtype:
        raise ShardsInconsistent(
            f"cannot reshard the DTensor at {path}: old ranks 0 and {old.rank} disagree on "
            f"its layout (dtype, global shape, stride, placements or mesh): "
            f"{str(dtype).removeprefix('torch.')} {reference} against "
            f"{str(spec.dtype).removeprefix('torch.')} {fields}. {INCONSISTENT}"
        )
    return spec, offset, dt.index


def _tiling(
    path: str, rank: int, offset: tuple[int, ...], local: tuple[int, ...], shape: tuple[int, ...]
) -> ReshardError:
    return ShardsInconsistent(
        f"cannot reshard the DTensor at {path}: old rank {rank}'s local shard {local} at offset "
        f"{offset} is not one a 1-D mesh gives a global {shape} tensor, so the pieces would not "
        f"cover the new shards exactly. {INCONSISTENT}"
    )


def new_shard(sh: Sharded, new_rank: int, new_world: int) -> tuple[tuple[int, ...], list[int]]:
    """New rank's local shape and global offset of ``sh``."""
    shape = [int(d) for d in sh.record["shape"]]
    offset = [0] * len(shape)
    if sh.dim is not None:
        start, size = torch_chunk(shape[sh.dim], new_world, new_rank)
        offset[sh.dim] = start
        shape[sh.dim] = size
    return tuple(shape), offset


def pieces_for(sh: Sharded, local: tuple[int, ...], offset: list[int]) -> list[Piece]:
    """The boxes of old shards that make up the new shard of ``sh`` at ``offset`` (its local
    shape ``local``), in order along the sharded dimension; none when it has no elements."""
    if math.prod(local) == 0:
        return []
    zeros = (0,) * len(local)
    if sh.dim is None:
        return [Piece(0, sh.indices[0], zeros, zeros, local)]
    d = sh.dim
    lo, hi = offset[d], offset[d] + local[d]
    out: list[Piece] = []
    first = bisect.bisect_right([iv[1] for iv in sh.intervals], lo)
    for start, stop, rank, index in sh.intervals[first:]:
        if start >= hi:
            break
        a, b = max(lo, start), min(hi, stop)
        src = list(zeros)
        dst = list(zeros)
        size = list(local)
        src[d], dst[d], size[d] = a - start, a - lo, b - a
        out.append(Piece(rank, index, tuple(src), tuple(dst), tuple(size)))
    return out


def plain_indices(layout: Layout, dtensor_indices: set[int]) -> list[int]:
    """The indices of ``layout``'s tensors other than DTensors' local shards."""
    return [i for i in range(len(layout.specs)) if i not in dtensor_indices]


def _is_dtensor(node: Any) -> bool:
    return type(node) is DTensorNode
