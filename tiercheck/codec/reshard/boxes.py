"""Resharding by region, driven by the state restored into: meshes of any number of dimensions.

The 1-D rules of :mod:`~tiercheck.codec.reshard.reshard` work out a new rank's shard from the stored
layout alone (torch's ``Shard(d)`` rule over the new world). A DTensor on a mesh of two or more
dimensions -- FSDP2 + tensor parallel (``(dp, tp)``, ``_StridedShard`` placements), HSDP
(``(replicate, shard)``) -- cannot be worked out that way: the new mesh is the caller's choice.
So an in-place elastic restore hands the plan the caller's own DTensor records
(:class:`Target`: each live DTensor's global shape, placements, mesh, coordinate, offset and
local shape, as :func:`~tiercheck.codec.format.dtensor.layout_of` gives them; see
:func:`tiercheck.engine.restore.elastic.targets_in`), and the new shard is cut
from the old ones by region:

* every old rank's shard is a box of the global tensor: its record's ``offset`` and its local
  shape (what DCP reads as a chunk, too);
* ranks that hold one region (replicated on a mesh dimension) hold the same box; the lowest of
  them is read. Boxes that partly overlap, lie outside the tensor or leave part of it uncovered
  are :class:`~tiercheck.errors.ShardsInconsistent` (the blobs are not of one save);
* the new shard (the caller's box) is made of its intersections with the old boxes;
* the caller's DTensor must have the stored dtype, global shape and stride, else
  :class:`~tiercheck.errors.ReshardError` (nothing is written into the state).

Pure: no I/O, no process group.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from tiercheck.codec.reshard.shards import INCONSISTENT, Piece, Stored, global_fields, held_shard
from tiercheck.errors import FormatError, ReshardError, ShardsInconsistent

__all__ = [
    "Boxed",
    "Target",
    "boxed_dtensor",
    "by_region",
    "check_target",
    "pieces_in",
    "with_inferred",
]


@dataclasses.dataclass(frozen=True)
class Target:
    """One DTensor of the state restored into, on this rank: its record and local shard's
    dtype and shape."""

    record: dict[str, Any]
    dtype: torch.dtype
    local: tuple[int, ...]

    @property
    def offset(self) -> tuple[int, ...]:
        """The global offset of this rank's shard."""
        return tuple(int(o) for o in self.record["offset"])


def _frozen(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    return value


def with_inferred(stored: Stored, targets: Mapping[str, Target]) -> dict[str, Target]:
    """``targets``, plus one for each stored DTensor the state restored into lacks (a fresh
    optimizer holds no moments yet) where that can be told: the DTensors stored with the same
    global layout (dtype aside: shape, stride, placements, mesh) that the state does hold all
    sit one way on the new mesh -- as an optimizer's moment sits like its parameter. Where they
    sit several ways the DTensor gets no target (and a 2-D one is refused, naming it)."""
    if not targets:
        return {}
    keys = {path: _layout_key(dt.record) for path, dt in stored.dtensors.items()}
    seen: dict[Any, dict[Any, Target]] = {}
    for path, key in keys.items():
        target = targets.get(path)
        if target is not None and key is not None:
            seen.setdefault(key, {})[_frozen(target.record), target.local] = target
    out = dict(targets)
    for path, key in keys.items():
        found = seen.get(key, {}) if key is not None and path not in out else {}
        if len(found) == 1:
            like = next(iter(found.values()))
            dtype = stored.layout.specs[stored.dtensors[path].index].dtype
            out[path] = Target(like.record, dtype, like.local)
    return out


def _layout_key(record: Mapping[str, Any]) -> Any:
    """A record's global layout, hashable; ``None`` for a malformed record (planning names
    it)."""
    try:
        return _frozen(global_fields(record))
    except KeyError:
        return None


def by_region(record: Mapping[str, Any], target: Target | None, world: int) -> bool:
    """Whether a DTensor stored with ``record`` goes to ``target`` by region: where either
    side is not the 1-D layout the stored-layout rules handle (a mesh of one dimension over all
    ``world`` old ranks, placed ``Shard(d)`` or ``Replicate()``)."""
    if target is None:
        return False

    def simple(rec: Mapping[str, Any], ranks: int | None) -> bool:
        mesh = list(rec.get("mesh") or ())
        placements = list(rec.get("placements") or ())
        return (
            len(mesh) == 1
            and (ranks is None or mesh[0] == ranks)
            and len(placements) == 1
            and bool(placements[0])
            and placements[0][0] in ("shard", "replicate")
        )

    return not (simple(record, world) and simple(target.record, None))


@dataclasses.dataclass(frozen=True)
class Boxed:
    """One DTensor as the old ranks hold it: its distinct regions, each read from the lowest
    old rank holding it."""

    path: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    #: ``(offset, size, old rank, index of the local tensor in that rank's layout)``.
    boxes: tuple[tuple[tuple[int, ...], tuple[int, ...], int, int], ...]


def boxed_dtensor(path: str, olds: Sequence[Stored]) -> Boxed:
    """The DTensor at ``path`` as every old rank holds it, checked to be one save's: the same
    global layout on every old rank, boxes that tile the tensor exactly (replicas of a region
    as the same box). Else :class:`~tiercheck.errors.ShardsInconsistent`."""
    first = olds[0].dtensors[path]
    dtype = olds[0].layout.specs[first.index].dtype
    try:
        reference = global_fields(first.record)
        shape = tuple(int(d) for d in first.record["shape"])
        stride = tuple(int(d) for d in first.record["stride"])
    except (KeyError, TypeError, ValueError) as exc:
        raise FormatError(f"old rank 0 holds a malformed DTensor record at {path}: {exc}") from exc
    regions: dict[tuple[int, ...], tuple[tuple[int, ...], int, int]] = {}
    for old in olds:
        spec, offset, index = held_shard(path, old, reference, dtype)
        size = spec.shape
        if (
            len(offset) != len(shape)
            or len(size) != len(shape)
            or any(o < 0 or o + n > d for o, n, d in zip(offset, size, shape, strict=True))
        ):
            raise ShardsInconsistent(
                f"cannot reshard the DTensor at {path}: old rank {old.rank}'s shard {size} at "
                f"{offset} lies outside the global shape {shape}. {INCONSISTENT}"
            )
        if math.prod(size) == 0:
            continue
        seen = regions.get(offset)
        if seen is None:
            regions[offset] = (size, old.rank, index)
        elif seen[0] != size:
            raise ShardsInconsistent(
                f"cannot reshard the DTensor at {path}: old ranks {seen[1]} and {old.rank} hold "
                f"shards {seen[0]} and {size} at the same offset {offset}. {INCONSISTENT}"
            )
    boxes = tuple((o, s, r, i) for o, (s, r, i) in sorted(regions.items()))
    _check_tiling(path, shape, boxes)
    return Boxed(path, dtype, shape, stride, boxes)


def _check_tiling(
    path: str,
    shape: tuple[int, ...],
    boxes: Sequence[tuple[tuple[int, ...], tuple[int, ...], int, int]],
) -> None:
    """Every element of the tensor in exactly one box (counted on the grid their edges make)."""
    if math.prod(shape) == 0:
        return
    cuts = [
        sorted({0, dim} | {o[d] for o, _, _, _ in boxes} | {o[d] + s[d] for o, s, _, _ in boxes})
        for d, dim in enumerate(shape)
    ]
    counts = np.zeros([len(c) - 1 for c in cuts], dtype=np.int32)
    for offset, size, _, _ in boxes:
        cell = tuple(
            slice(bisect.bisect_left(c, o), bisect.bisect_left(c, o + n))
            for c, o, n in zip(cuts, offset, size, strict=True)
        )
        counts[cell] += 1
    if not bool((counts == 1).all()):
        raise ShardsInconsistent(
            f"cannot reshard the DTensor at {path}: the old shards do not cover its {shape} "
            f"global shape exactly once. {INCONSISTENT}"
        )


def check_target(boxed: Boxed, target: Target) -> None:
    """Refuse (:class:`~tiercheck.errors.ReshardError`) a DTensor of the caller's state that is
    not the stored one: another dtype, global shape or stride, or a shard outside it."""
    try:
        shape = tuple(int(d) for d in target.record["shape"])
        stride = tuple(int(d) for d in target.record["stride"])
        offset = target.offset
    except (KeyError, TypeError, ValueError) as exc:
        raise ReshardError(f"the DTensor at {boxed.path} has no usable layout: {exc}") from exc
    if (target.dtype, shape, stride) != (boxed.dtype, boxed.shape, boxed.stride):
        raise ReshardError(
            f"the state to restore into holds a {str(target.dtype).removeprefix('torch.')}"
            f"{shape} DTensor (stride {stride}) at {boxed.path}; the version stored a "
            f"{str(boxed.dtype).removeprefix('torch.')}{boxed.shape} one (stride "
            f"{boxed.stride}). Nothing was written into the state: build the model as the job "
            "that saved the version did (the same shapes and dtypes)."
        )
    if len(offset) != len(shape) or any(
        o < 0 or o + n > d for o, n, d in zip(offset, target.local, shape, strict=True)
    ):
        raise ReshardError(
            f"the DTensor at {boxed.path} in the state to restore into holds a shard "
            f"{target.local} at {offset}, outside its global shape {shape}"
        )


def pieces_in(boxed: Boxed, target: Target) -> list[Piece]:
    """The boxes of old shards that make up the caller's shard ``target`` of ``boxed``."""
    local, lo = target.local, target.offset
    if math.prod(local) == 0:
        return []
    out: list[Piece] = []
    for offset, size, rank, index in boxed.boxes:
        start = [max(a, b) for a, b in zip(lo, offset, strict=True)]
        stop = [min(a + n, b + m) for a, n, b, m in zip(lo, local, offset, size, strict=True)]
        if any(a >= b for a, b in zip(start, stop, strict=True)):
            continue
        out.append(
            Piece(
                rank,
                index,
                tuple(a - b for a, b in zip(start, offset, strict=True)),
                tuple(a - b for a, b in zip(start, lo, strict=True)),
                tuple(b - a for a, b in zip(start, stop, strict=True)),
            )
        )
    return out
