"""A version's DTensors put together whole from their stored shards by region, on any mesh.

Each stored shard says where it sits in its global tensor (its record's ``offset``, with the
local tensor's shape: see :mod:`tiercheck.codec.format.dtensor`), whatever the mesh and placements
that gave it -- two dimensions (FSDP2 + tensor parallel, HSDP) included, as DCP reads them too.
:func:`whole_by_regions` copies every shard into its place in the full tensor, once per region
(ranks that hold one region, replicated on a mesh dimension, must agree bit for bit), and checks
that the shards cover the tensor exactly. What :func:`tiercheck.catalog.export.whole_state` uses
where the 1-D reshard (:mod:`tiercheck.codec.reshard.reshard`) does not apply.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from tiercheck.codec import DTensorShard
from tiercheck.errors import ShardsInconsistent

__all__ = ["same_value", "whole_by_regions"]

_Path = tuple[Any, ...]


def _walk(obj: Any, path: _Path, visit: Callable[[_Path, Any], None]) -> None:
    """Call ``visit(path, leaf)`` for every leaf under ``obj`` (dicts, lists and tuples are
    walked; a DTensor shard is a leaf)."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            _walk(value, (*path, key), visit)
    elif type(obj) in (list, tuple):
        for i, value in enumerate(obj):
            _walk(value, (*path, i), visit)
    else:
        visit(path, obj)


def _replace(obj: Any, path: _Path, convert: Callable[[_Path, Any], Any]) -> Any:
    if isinstance(obj, dict):
        return {key: _replace(value, (*path, key), convert) for key, value in obj.items()}
    if type(obj) is list:
        return [_replace(value, (*path, i), convert) for i, value in enumerate(obj)]
    if type(obj) is tuple:
        return tuple(_replace(value, (*path, i), convert) for i, value in enumerate(obj))
    return convert(path, obj)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    # Compared as bytes, never as values: NaNs and -0.0 compare exactly.
    return t.contiguous().reshape(-1).view(torch.uint8)


def same_value(a: Any, b: Any) -> bool:
    """Whether two stored values are equal: tensors bit for bit (dtype, shape and bytes), other
    values by ``==`` (by ``repr`` where ``==`` gives no single answer, as for numpy arrays)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(_bytes(a), _bytes(b))
        )
    try:
        return bool(a == b)
    except (TypeError, ValueError, RuntimeError):  # e.g. numpy arrays of several elements
        return repr(a) == repr(b)


def _whole(where: str, shards: Sequence[tuple[int, DTensorShard]]) -> torch.Tensor:
    """The full tensor of one DTensor from every rank's shard."""
    first = shards[0][1]
    shape, dtype = first.shape, first.local.dtype
    full = torch.empty(shape, dtype=dtype)
    covered = torch.zeros(shape, dtype=torch.int8)
    placed: dict[tuple[int, ...], tuple[int, torch.Tensor]] = {}
    for rank, shard in shards:
        local = shard.local
        if shard.shape != shape or local.dtype != dtype:
            raise ShardsInconsistent(
                f"{where}: rank {rank} stored a {local.dtype}{shard.shape} DTensor where rank "
                f"{shards[0][0]} stored {dtype}{shape}; the blobs are not of one save"
            )
        if local.numel() == 0:
            continue
        box = tuple(slice(o, o + n) for o, n in zip(shard.offset, local.shape, strict=True))
        if any(s.stop > d for s, d in zip(box, shape, strict=True)) or len(box) != len(shape):
            raise ShardsInconsistent(
                f"{where}: rank {rank}'s shard {tuple(local.shape)} at {shard.offset} lies "
                f"outside the global shape {shape}"
            )
        seen = placed.get(shard.offset)
        if seen is not None:
            if not same_value(seen[1], local):
                raise ShardsInconsistent(
                    f"{where}: ranks {seen[0]} and {rank} hold the region at {shard.offset} "
                    "with different values; the blobs are not of one save"
                )
            continue
        placed[shard.offset] = (rank, local)
        full[box] = local
        covered[box] += 1
    if covered.numel() and not bool((covered == 1).all()):
        raise ShardsInconsistent(
            f"{where}: the stored shards do not cover the {shape} tensor exactly once"
        )
    return full


def whole_by_regions(trees: Sequence[Any], warnings: list[str]) -> Any:
    """Rank 0's state (``trees[0]``, as rebuilt from its blob) with every DTensor shard
    replaced by the full tensor put together from every rank's shard of it (``trees[r]``:
    rank ``r``'s). State outside DTensors is rank 0's; where another rank stored it
    differently, ``warnings`` says so (one entry naming the paths)."""
    shards: dict[_Path, list[tuple[int, DTensorShard]]] = {}
    plain: dict[_Path, Any] = {}
    differ: list[str] = []
    for rank, tree in enumerate(trees):

        def visit(path: _Path, leaf: Any, rank: int = rank) -> None:
            if isinstance(leaf, DTensorShard):
                shards.setdefault(path, []).append((rank, leaf))
            elif rank == 0:
                plain[path] = leaf
            elif path in plain and not same_value(plain[path], leaf):
                differ.append(f"{_text(path)} (rank {rank})")

        _walk(tree, (), visit)
    if differ:
        shown = ", ".join(differ[:5]) + (f" and {len(differ) - 5} more" if len(differ) > 5 else "")
        warnings.append(f"state outside DTensors differs between ranks; rank 0's was used: {shown}")

    def convert(path: _Path, leaf: Any) -> Any:
        if isinstance(leaf, DTensorShard):
            return _whole(_text(path), shards[path])
        return leaf

    return _replace(trees[0], (), convert)


def _text(path: _Path) -> str:
    return "".join(f"[{p!r}]" for p in path) or "the state"
