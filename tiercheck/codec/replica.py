"""Replicated state stored once: references between the blobs of one save, made and resolved.

A rank that is not its node's first stores, in place of replicated state, a
:class:`~tiercheck.codec.encode.flatten.ReplicaRef` -- "rank ``L`` of this same save stores the
value here" (see :class:`tiercheck.Replicated`). In the tiers that outlive the cluster a node's
first rank ``L > 0`` stores a reference to rank 0 in turn (:func:`lean`), so those tiers hold the
value once in all: a reference may lead to a blob that refers on, and is followed to the blob
that holds the value.

:func:`resolve` takes the layout of a blob and the layouts of the blobs its references lead to
(headers only, no tensor bytes) and gives the layout the rank would have saved had it stored
everything itself, with, for each of its tensors, the blob and tensor index it comes from. The
engine then reads those tensors, and everything downstream -- the check against the caller's
state, the copy into it, resharding onto another world, export -- sees an ordinary layout and
its tensors.

Pure: no I/O. A reference to a rank whose layout is not given, a storing blob that lacks the
referenced path (or holds another kind of value there), or references that go round in a
circle, are a :class:`~tiercheck.errors.FormatError`: the blobs do not belong together.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import msgpack
import torch

from tiercheck.codec.encode.flatten import Layout, replicated_record
from tiercheck.codec.format.skeleton import (
    EXT_NDARRAY,
    EXT_REPLICA,
    EXT_TENSOR,
    MISSING,
    DTensorNode,
    Tuple,
    Walker,
    child,
    encode_int,
    leaves,
    read_tree,
    where,
    write_tree,
)
from tiercheck.codec.resources import paused_gc
from tiercheck.errors import FormatError

__all__ = [
    "Lean",
    "Resolved",
    "lean",
    "referenced",
    "resolve",
    "resolve_all",
    "skeleton_steps",
    "take",
]


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
    refs = leaves(_tree(layout, "the blob"), _is_ref)
    return {_ref(obj)[0] for obj in refs}


def _tree(layout: Layout, whose: str) -> Any:
    try:
        return read_tree(layout.skeleton)
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


class _Resolver(Walker[int]):
    """Walks rank trees (``ctx``: whose tree the node is in), renumbering tensors and, in the
    resolving rank's own tree, replacing references with the values they lead to."""

    def __init__(self, own: Layout, rank: int, stores: Mapping[int, Layout]) -> None:
        self.rank = rank
        self.layouts = {**stores, rank: own}
        self.trees: dict[int, Any] = {}
        self.entries: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
        self.sources: list[tuple[int, int]] = []
        # The ranks whose references are being followed, outermost first.
        self.chain: list[int] = []

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

    def leaf(self, node: Any, steps: list[Any], ctx: int) -> Any:
        if type(node) is DTensorNode:
            return DTensorNode(self.tensor(ctx, node.index), node.record)
        if type(node) is msgpack.ExtType:
            if node.code == EXT_TENSOR:
                index = msgpack.unpackb(node.data)
                return msgpack.ExtType(EXT_TENSOR, msgpack.packb(self.tensor(ctx, index)))
            if node.code == EXT_NDARRAY:
                fields = msgpack.unpackb(node.data, raw=False, strict_map_key=False)
                fields[0] = self.tensor(ctx, fields[0])
                return msgpack.ExtType(EXT_NDARRAY, msgpack.packb(fields, use_bin_type=True))
            if node.code == EXT_REPLICA:
                return self.replica(node, ctx, steps)
        return node

    def replica(self, ext: msgpack.ExtType, holder: int, steps: list[Any]) -> Any:
        """The value the reference ``ext`` (in rank ``holder``'s tree at ``steps``) leads to,
        following the storing rank's own reference where it holds one."""
        store, record = _ref(ext)
        if store == holder:
            raise FormatError(f"rank {store}'s blob refers to itself")
        if store in self.chain:
            raise FormatError(
                f"the references of ranks {[*self.chain, holder]} to one another for the value "
                f"at {where(steps)} go round in a circle"
            )
        self.chain.append(holder)
        try:
            node = self.tree(store)
            for step in steps:
                if _is_ref(node):
                    break  # the storing rank refers on, for a value holding this one
                node = child(node, step)
                if node is MISSING:
                    raise FormatError(
                        f"rank {holder}'s blob refers to rank {store}'s for the value at "
                        f"{where(steps)}, which rank {store}'s blob does not hold"
                    )
            if _is_ref(node):
                value = self.replica(node, store, steps)
                if record is None:
                    return value
                if type(value) is not DTensorNode:
                    raise FormatError(
                        f"rank {holder}'s blob refers to rank {store}'s for a DTensor at "
                        f"{where(steps)}; the value that leads to is something else"
                    )
                self.check_shape(value.index, record, holder, steps)
                return DTensorNode(value.index, record)
            if record is None:
                return self.walk(node, steps, store)
            if type(node) is not DTensorNode:
                raise FormatError(
                    f"rank {holder}'s blob refers to rank {store}'s for a DTensor at "
                    f"{where(steps)}; rank {store}'s holds something else there"
                )
            index = self.tensor(store, node.index)
            self.check_shape(index, record, holder, steps)
            # The bytes are the storing rank's; the layout record stays the referring rank's.
            return DTensorNode(index, record)
        finally:
            self.chain.pop()

    def check_shape(
        self, index: int, record: dict[str, Any], holder: int, steps: list[Any]
    ) -> None:
        """Tensor ``index`` (of the resolved layout) has the global shape ``record`` says."""
        rank, _ = self.sources[index]
        if list(self.entries[index][2]) != list(record.get("shape", ())):
            raise FormatError(
                f"rank {rank}'s replicated DTensor at {where(steps)} does not have the global "
                f"shape rank {holder} recorded ({record.get('shape')})"
            )


def _is_ref(node: Any) -> bool:
    return type(node) is msgpack.ExtType and node.code == EXT_REPLICA


def resolve(own: Layout, rank: int, stores: Mapping[int, Layout]) -> Resolved:
    """``own`` (rank ``rank``'s layout) with each reference replaced by the value it points to
    in ``stores[L]`` (the layout of rank ``L``'s blob of the same version).

    A layout without references comes back as it is, each tensor its own.
    """
    if not own.has_refs:
        return Resolved(own, tuple((rank, i) for i in range(len(own.specs))))
    with paused_gc():
        resolver = _Resolver(own, rank, stores)
        tree = resolver.walk(resolver.tree(rank), [], rank)
        skeleton = write_tree(tree)
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
    # Every other layout is offered: a reference may lead on from the blob it names.
    return [
        resolve(layout, s, {r: other for r, other in enumerate(layouts) if r != s})
        for s, layout in enumerate(layouts)
    ]


# --- storing replicated state once: the lean layout of a node's first rank -------------------


@dataclasses.dataclass(frozen=True)
class Lean:
    """A layout with its replicated state replaced by references to the rank that stores it.

    What a node's first rank ``L > 0`` stores in the tiers that outlive the cluster (see
    :func:`lean`): ``keep[i]`` is the index, in the full layout, of tensor ``i`` of
    :attr:`layout`.
    """

    layout: Layout
    keep: tuple[int, ...]

    def payload(self, full: Layout, payload: torch.Tensor) -> torch.Tensor:
        """The lean payload: the kept tensors' bytes, copied out of ``payload`` (``full``'s)."""
        out = torch.zeros(self.layout.payload_nbytes, dtype=torch.uint8, device=payload.device)
        for spec, j in zip(self.layout.specs, self.keep, strict=True):
            src = full.specs[j]
            out[spec.offset : spec.offset + spec.nbytes] = payload[
                src.offset : src.offset + src.nbytes
            ]
        return out


class _Leaner(_Resolver):
    """Walks a full layout, replacing replicated values with references to ``store``."""

    def __init__(
        self, full: Layout, store: int, at: frozenset[tuple[Any, ...]], world: int
    ) -> None:
        super().__init__(full, _FULL, {})
        self.store = store
        self.at = at
        self.world = world
        self.hit: set[tuple[Any, ...]] = set()
        self.replaced = 0

    def walk(self, node: Any, steps: list[Any], ctx: int) -> Any:
        if self.at:
            here = tuple(steps)
            if here in self.at:
                self.hit.add(here)
                self.replaced += 1
                return msgpack.ExtType(
                    EXT_REPLICA, msgpack.packb([self.store, None], use_bin_type=True)
                )
        if type(node) is DTensorNode and replicated_record(node.record, self.world):
            self.replaced += 1
            record = msgpack.packb(
                [self.store, node.record], use_bin_type=True, unicode_errors="surrogatepass"
            )
            return msgpack.ExtType(EXT_REPLICA, record)
        if _is_ref(node):
            raise FormatError("a layout to make lean holds references already")
        return super().walk(node, steps, ctx)


_FULL = -1  # the rank the leaner knows the full layout as


def lean(
    layout: Layout, at: Collection[tuple[Any, ...]], store: int, world_size: int
) -> Lean | None:
    """``layout`` with its replicated state replaced by references to rank ``store``.

    Replicated are: the values at the skeleton steps ``at`` (each a path of keys and indices
    from the root, as :func:`skeleton_steps` gives them), and every DTensor placed
    ``Replicate()`` on a mesh of all ``world_size`` ranks. ``None`` when there is neither.
    A step the skeleton does not hold raises :class:`ValueError` (nothing is made lean).
    """
    wanted = frozenset(at)
    if not wanted and not layout.has_dtensors:
        return None
    with paused_gc():
        leaner = _Leaner(layout, store, wanted, world_size)
        tree = leaner.walk(_tree(layout, "the blob"), [], _FULL)
        missed = wanted - leaner.hit
        if missed:
            raise ValueError(
                f"the state skeleton holds no value at {sorted(where(m) for m in missed)}"
            )
        if not leaner.replaced:
            return None
        skeleton = write_tree(tree)
        built = Layout.build(skeleton, leaner.entries)
    built.__dict__["has_refs"] = True
    for name in ("has_arrays", "has_dtensors"):
        if layout.__dict__.get(name) is False:  # a lean layout holds a part of the full one's
            built.__dict__[name] = False
    return Lean(built, tuple(index for _, index in leaner.sources))


def skeleton_steps(steps: Sequence[object]) -> tuple[Any, ...] | None:
    """A path of the caller's keys and indices as the skeleton holds them (an integer beyond
    64 bits as its extension, a tuple key as a tuple); ``None`` for a key no skeleton holds."""
    try:
        return tuple(_skeleton_key(step) for step in steps)
    except _NotAKey:
        return None


class _NotAKey(Exception):
    pass


def _skeleton_key(key: object) -> Any:
    t = type(key)
    if key is None or t is str or t is bool or t is float or t is bytes:
        return key
    if t is int:
        return encode_int(key)  # type: ignore[arg-type]
    if t is tuple:
        return Tuple(tuple(_skeleton_key(k) for k in key))  # type: ignore[attr-defined]
    raise _NotAKey
