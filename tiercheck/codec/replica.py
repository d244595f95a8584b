"""Replicated state stored once per node: a blob's references resolved against the storing blob.

A rank that is not its node's first stores, in place of replicated state, a
:class:`~tiercheck.codec.flatten.ReplicaRef` -- "rank ``L`` of this same save stores the value
here" (see :class:`tiercheck.Replicated`). :func:`resolve` takes the layout of such a blob and
the layouts of the blobs it refers to (headers only, no tensor bytes) and gives the layout the
rank would have saved had it stored everything itself, with, for each of its tensors, the blob
and tensor index it comes from. The engine then reads those tensors (its own blob's and the
storing rank's), and everything downstream -- the check against the caller's state, the copy
into it, resharding onto another world, export -- sees an ordinary layout and its tensors.

Pure: no I/O. A reference to a rank whose layout is not given, or a storing blob that lacks the
referenced path (or holds another kind of value there), is a
:class:`~tiercheck.errors.FormatError`: the blobs do not belong together.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import msgpack
import torch

from tiercheck.codec.flatten import _EXT_NDARRAY, _EXT_REPLICA, _EXT_TENSOR, Layout
from tiercheck.codec.plan import paused_gc
from tiercheck.codec.reshard import _DTensor, _leaves, _ODict, _pack, _Tuple, _unpack
from tiercheck.errors import FormatError

__all__ = ["Resolved", "referenced", "resolve", "resolve_all", "take"]


@dataclasses.dataclass(frozen=True)
class Resolved:
    """A layout with its references replaced by the values they point to.

    ``sources[i]`` is ``(rank, index)``: tensor ``i`` of :attr:`layout` is tensor ``index`` of
    rank ``rank``'s blob (the resolving rank's own blob, or a storing rank's).
    """

    layout: Layout
    sources: tuple[tuple[int, int], ...]


def referenced(layout: Layout) -> set[int]:
    """The ranks whose blobs ``layout``'s references point to (empty: it holds none)."""
    if not layout.has_refs:
        return set()
    refs = _leaves(
        _tree(layout, "the blob"),
        lambda obj: type(obj) is msgpack.ExtType and obj.code == _EXT_REPLICA,
    )
    return {_ref(obj)[0] for obj in refs}


def _tree(layout: Layout, whose: str) -> Any:
    try:
        return _unpack(layout.skeleton)
    except (msgpack.UnpackException, ValueError, TypeError) as exc:
        if isinstance(exc, FormatError):
            raise
        raise FormatError(f"{whose}'s state skeleton is malformed: {exc}") from exc


def _ref(ext: msgpack.ExtType) -> tuple[int, dict[str, Any] | None]:
    try:
        rank, record = msgpack.unpackb(ext.data, strict_map_key=False, raw=False)
    except (msgpack.UnpackException, ValueError, TypeError) as exc:
        raise FormatError(f"skeleton holds a malformed replica reference: {exc}") from exc
    if type(rank) is not int or not (record is None or type(record) is dict):
        raise FormatError(f"skeleton holds a malformed replica reference {ext.data!r}")
    return rank, record


class _Resolver:
    def __init__(self, own: Layout, rank: int, stores: Mapping[int, Layout]) -> None:
        self.rank = rank
        self.layouts = {**stores, rank: own}
        self.trees: dict[int, Any] = {}
        self.entries: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
        self.sources: list[tuple[int, int]] = []

    def tree(self, rank: int) -> Any:
        if rank not in self.trees:
            if rank not in self.layouts:
                raise FormatError(
                    f"rank {self.rank}'s blob refers to rank {rank}'s blob of the same version, "
                    "which was not given"
                )
            self.trees[rank] = _tree(self.layouts[rank], f"rank {rank}")
        return self.trees[rank]

    def tensor(self, rank: int, index: object) -> int:
        specs = self.layouts[rank].specs
        if type(index) is not int or not 0 <= index < len(specs):
            raise FormatError(
                f"rank {rank}'s skeleton refers to tensor {index!r}; its layout has {len(specs)}"
            )
        spec = specs[index]
        self.entries.append((spec.path, spec.dtype, spec.shape))
        self.sources.append((rank, index))
        return len(self.entries) - 1

    def walk(self, obj: Any, rank: int, steps: list[Any]) -> Any:
        """``obj`` (a node of rank ``rank``'s tree at ``steps``) with tensors renumbered and,
        in the resolving rank's own tree, references replaced."""
        t = type(obj)
        if t is dict:
            out = {}
            for k, v in obj.items():
                steps.append(k)
                out[k] = self.walk(v, rank, steps)
                steps.pop()
            return out
        if t is list or t is _Tuple:
            items = []
            for i, v in enumerate(obj if t is list else obj.items):
                steps.append(i)
                items.append(self.walk(v, rank, steps))
                steps.pop()
            return items if t is list else _Tuple(tuple(items))
        if t is _ODict:
            mapping = self.walk(obj.mapping, rank, steps)
            steps.append(_META)
            meta = self.walk(obj.meta, rank, steps)
            steps.pop()
            return _ODict(mapping, meta)
        if t is _DTensor:
            return _DTensor(self.tensor(rank, obj.index), obj.record)
        if t is msgpack.ExtType:
            if obj.code == _EXT_TENSOR:
                index = msgpack.unpackb(obj.data)
                return msgpack.ExtType(_EXT_TENSOR, msgpack.packb(self.tensor(rank, index)))
            if obj.code == _EXT_NDARRAY:
                fields = msgpack.unpackb(obj.data, raw=False, strict_map_key=False)
                fields[0] = self.tensor(rank, fields[0])
                return msgpack.ExtType(_EXT_NDARRAY, msgpack.packb(fields, use_bin_type=True))
            if obj.code == _EXT_REPLICA:
                if rank != self.rank:
                    raise FormatError(
                        f"rank {rank}'s blob, referred to for replicated state, holds a "
                        "reference itself"
                    )
                return self.replica(obj, steps)
        return obj

    def replica(self, ext: msgpack.ExtType, steps: list[Any]) -> Any:
        store, record = _ref(ext)
        if store == self.rank:
            raise FormatError(f"rank {store}'s blob refers to itself")
        node = self.tree(store)
        for step in steps:
            node = _step(node, step)
            if node is _MISSING:
                raise FormatError(
                    f"rank {self.rank}'s blob refers to rank {store}'s for the value at "
                    f"{_where(steps)}, which rank {store}'s blob does not hold"
                )
        if record is None:
            return self.walk(node, store, steps)
        if type(node) is not _DTensor:
            raise FormatError(
                f"rank {self.rank}'s blob refers to rank {store}'s for a DTensor at "
                f"{_where(steps)}; rank {store}'s holds something else there"
            )
        specs = self.layouts[store].specs
        spec = specs[node.index] if 0 <= node.index < len(specs) else None
        if spec is None or list(spec.shape) != list(record.get("shape", ())):
            raise FormatError(
                f"rank {store}'s replicated DTensor at {_where(steps)} does not have the global "
                f"shape rank {self.rank} recorded ({record.get('shape')})"
            )
        # The bytes are the storing rank's; the layout record stays this rank's own.
        return _DTensor(self.tensor(store, node.index), record)


_META = object()  # the step into an OrderedDict's ``_metadata``
_MISSING = object()


def _step(node: Any, step: Any) -> Any:
    t = type(node)
    if step is _META:
        return node.meta if t is _ODict else _MISSING
    if t is _ODict:
        node, t = node.mapping, dict
    if t is dict:
        return node.get(step, _MISSING) if _hashable(step) else _MISSING
    if t is list or t is _Tuple:
        items = node if t is list else node.items
        return items[step] if type(step) is int and 0 <= step < len(items) else _MISSING
    return _MISSING


def _hashable(obj: Any) -> bool:
    try:
        hash(obj)
    except TypeError:
        return False
    return True


def _where(steps: Sequence[Any]) -> str:
    return "state" + "".join("._metadata" if s is _META else f"[{s!r}]" for s in steps)


def resolve(own: Layout, rank: int, stores: Mapping[int, Layout]) -> Resolved:
    """``own`` (rank ``rank``'s layout) with each reference replaced by the value it points to
    in ``stores[L]`` (the layout of rank ``L``'s blob of the same version).

    A layout without references comes back as it is, each tensor its own.
    """
    if not own.has_refs:
        return Resolved(own, tuple((rank, i) for i in range(len(own.specs))))
    with paused_gc():
        resolver = _Resolver(own, rank, stores)
        tree = resolver.walk(resolver.tree(rank), rank, [])
        skeleton = _pack(tree, lambda d: d)
        layout = Layout.build(skeleton, resolver.entries)
    if len(layout.index) != len(layout.specs):
        raise FormatError(f"rank {rank}'s blob and the blobs it refers to repeat tensor paths")
    layout.__dict__["has_refs"] = False
    return Resolved(layout, tuple(resolver.sources))


def take(resolved: Resolved, tensors: Mapping[int, Sequence[torch.Tensor]]) -> list[torch.Tensor]:
    """The tensors of ``resolved.layout``, from ``tensors[rank]`` (each blob's, in its order)."""
    return [tensors[r][i] for r, i in resolved.sources]


def resolve_all(layouts: Sequence[Layout]) -> list[Resolved]:
    """Every rank's layout of one save (``layouts[s]``: rank ``s``'s) resolved against the
    others'."""
    n = len(layouts)
    return [
        resolve(layout, s, {r: layouts[r] for r in referenced(layout) if 0 <= r < n})
        for s, layout in enumerate(layouts)
    ]
