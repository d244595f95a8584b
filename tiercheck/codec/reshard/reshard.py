"""Elastic restore's core: what new rank ``q`` of ``M`` would have saved, from ``N`` old blobs.

A version saved by ``N`` ranks holds one blob per rank. :func:`plan_reshard` looks at the
:class:`~tiercheck.codec.encode.flatten.Layout` of every old blob (headers only, no tensor bytes)
and says what new rank ``q`` needs: the layout it would have saved itself
(:attr:`ReshardPlan.layout`), which tensors of which old blobs to read (:attr:`ReshardPlan.wanted`)
and which bytes of each (:attr:`ReshardPlan.spans`), so a ranged read fetches only those, and how to
cut them.
:func:`assemble` then builds the new rank's tensors from the old ones it was given. Both are
pure: no I/O, no process group, no collective; every new rank can compute the plan of every
other.

The rules:

* **DTensors** (their records: global shape and stride, placements, mesh, offset; see
  :mod:`~tiercheck.codec.format.dtensor`) are resharded onto a 1-D mesh over the new world with the
  same placements. What can be resharded: a DTensor saved on a 1-D mesh of all ``N`` ranks, placed
  ``Shard(d)`` or ``Replicate()`` -- FSDP2's layout. Under ``Shard(d)``, new rank ``q`` holds what
  torch gives it (``torch.chunk`` semantics: chunks of ``ceil(L / M)`` rows of dimension ``d``,
  ``L`` its global size; rank ``q`` starts at ``min(q * chunk, L)``, its size is clipped, and
  may be 0); its rows are cut from the old shards they overlap, located by each old record's
  offset and local shape (not by its coordinate). A ``Replicate()`` DTensor comes whole from
  the lowest old rank (0). The new record says mesh ``(M,)``, coordinate ``(q,)`` and the new
  offset; everything else (shape, stride, placements, mesh dimension names, device type) is
  kept. Refused with :class:`~tiercheck.errors.ReshardError`: ``Partial`` and ``_StridedShard``
  placements, meshes of several dimensions or of another size than ``N``, a DTensor whose global
  shape, stride, dtype or placements differ between old ranks (or that some old rank lacks), and
  old shards that do not tile the global tensor exactly.
* **Everything else** -- plain tensors, numpy arrays and the non-tensor values of the state
  (ints, strings, floats...) -- is not sharded, so it must come from one old rank, chosen by
  ``per_rank``:

  - ``"refuse"`` (the default): taken from old rank 0, and it must be the same on every old
    rank. Planning compares the non-tensor values (and the plain tensors' paths, dtypes and
    shapes) of all ``N`` layouts; :func:`assemble` compares, bit for bit, the plain tensors of
    old rank 0 with those of every other old rank this new rank reads. Any difference is a
    :class:`~tiercheck.errors.ReshardError` naming the paths and ranks. So that every old rank
    gets compared by someone, an old rank that no new rank reads for its shards is read (its
    plain tensors only) by new rank ``s % M``.
  - ``"wrap"``: taken from old rank ``q % N``, compared with nothing. For per-rank state that
    differs by design -- a rank's own data-loader position or RNG state goes to new rank ``q``
    from old rank ``q mod N`` (with ``M > N`` several new ranks start from the same one; with
    ``M < N`` the state of old ranks ``M..N-1`` is not used).

Replicated state an old rank stored as a reference to another rank (its node's first, or rank 0)
(:class:`~tiercheck.codec.encode.flatten.ReplicaRef`) is the storing rank's value: callers resolve
such layouts first (:func:`~tiercheck.codec.replica.resolve_all`), so the plan compares and reads
the values the references stand for, and the tensors come from the storing rank's blob. Given an
unresolved layout, the plan sees the reference as a value of its own that differs from the
storing rank's, and refuses (``per_rank="refuse"``).

Every dtype the codec stores, 0-dim tensors and zero-size dimensions are handled (bytes are
copied and compared as bytes, never as values: NaNs and ``-0.0`` travel exactly). ``N == M``
gives back every rank's own layout and tensors unchanged.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch

from tiercheck.codec.decode.partial import widen
from tiercheck.codec.format.layout import Layout, TensorSpec
from tiercheck.codec.format.skeleton import DTensorNode, differences, write_tree
from tiercheck.codec.reshard.boxes import (
    Boxed,
    Target,
    boxed_dtensor,
    by_region,
    check_target,
    pieces_in,
    with_inferred,
)
from tiercheck.codec.reshard.shards import (
    Piece,
    Sharded,
    Stored,
    new_shard,
    pieces_for,
    plain_indices,
    read_stored,
    sharded_dtensor,
    torch_chunk,
)
from tiercheck.codec.resources import paused_gc
from tiercheck.errors import ConfigError, ReshardError, ShardsInconsistent

__all__ = ["Piece", "ReshardPlan", "assemble", "plan_reshard", "torch_chunk"]

#: Where state outside DTensors comes from (see the module docstring).
PerRank = Literal["refuse", "wrap"]

#: The most paths (or rank pairs) one message names.
_MAX_SHOWN = 20


# --- the plan -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class _Check:
    """A plain tensor that old ranks 0 and ``rank`` must hold bit for bit alike."""

    path: str
    index0: int
    rank: int
    index: int


@dataclasses.dataclass(frozen=True)
class ReshardPlan:
    """What new rank :attr:`new_rank` of :attr:`new_world` reads and builds (see the module
    docstring for the rules).

    * :attr:`layout`: the layout that rank would have saved (DTensor records rewritten for the
      new world: mesh ``(M,)``, coordinate ``(q,)``, the new offset; specs with the new local
      shapes). Its tensors are what :func:`assemble` returns, in spec order.
    * :attr:`wanted`: old rank -> indices (ascending) of the tensors of that rank's layout
      that :func:`assemble` needs. Old ranks none of whose tensors are needed are absent.
    * :attr:`pieces`: for each tensor of :attr:`layout`, the boxes it is made of. A tensor with
      no elements has none.
    * :attr:`sources`: ``(old rank, index) -> (dtype, shape)`` of every wanted tensor, as its
      old layout says (what :func:`assemble` checks it was given).
    * :attr:`checks`: the plain tensors compared bit for bit between old rank 0 and the other
      old ranks read (``per_rank="refuse"`` only).
    * :attr:`spans`: ``(old rank, index) -> (start, end)``: the bytes of each wanted tensor
      (C order) that the pieces and checks use lie in ``[start, end)``. For ``Shard(0)`` they
      are exactly the rows a new shard overlaps; :func:`assemble` reads no byte outside them,
      so the others need not be read at all.
    """

    layout: Layout
    wanted: dict[int, tuple[int, ...]]
    pieces: tuple[tuple[Piece, ...], ...]
    sources: dict[tuple[int, int], tuple[torch.dtype, tuple[int, ...]]]
    checks: tuple[_Check, ...]
    new_rank: int
    new_world: int
    old_world: int
    per_rank: PerRank
    spans: dict[tuple[int, int], tuple[int, int]] = dataclasses.field(default_factory=dict)


def plan_reshard(
    stored: Sequence[Layout],
    *,
    new_rank: int,
    new_world: int,
    per_rank: PerRank = "refuse",
    targets: Mapping[str, Target] | None = None,
) -> ReshardPlan:
    """The plan of new rank ``new_rank`` of ``new_world`` to rebuild from the old blobs whose
    layouts are ``stored`` (``stored[s]``: old rank ``s``'s; ``N = len(stored)``).

    ``targets``: the DTensors of the state restored into, by path
    (:func:`~tiercheck.engine.restore.elastic.targets_in`). A DTensor that either side holds on
    another layout than a 1-D mesh of all ranks with ``Shard(d)`` or ``Replicate()`` (a 2-D mesh,
    ``_StridedShard``) is cut by region into the caller's shard
    (:mod:`~tiercheck.codec.reshard.boxes`); without a target (none given, none to be inferred: see
    :func:`~tiercheck.codec.reshard.boxes.with_inferred`) it is refused.

    Pure and deterministic: every new rank computes the same plans from the same layouts.
    Raises :class:`~tiercheck.errors.ReshardError` for state that cannot be resharded under the
    rules of the module docstring (the message says what is supported and what to do),
    :class:`~tiercheck.errors.ConfigError` for bad arguments and
    :class:`~tiercheck.errors.FormatError` for a malformed skeleton.
    """
    # Decoding N skeletons of thousands of entries makes tens of thousands of short-lived
    # objects: a collection triggered by them would walk the whole training process.
    with paused_gc():
        return _plan(stored, new_rank, new_world, per_rank, targets or {})


def _plan(
    stored: Sequence[Layout],
    new_rank: int,
    new_world: int,
    per_rank: PerRank,
    targets: Mapping[str, Target],
) -> ReshardPlan:
    n = len(stored)
    if n < 1:
        raise ConfigError("plan_reshard needs the layout of at least one old rank")
    if new_world < 1 or not 0 <= new_rank < new_world:
        raise ConfigError(f"new rank {new_rank} is not a rank of a world of {new_world}")
    if per_rank not in ("refuse", "wrap"):
        raise ConfigError(f"per_rank must be 'refuse' or 'wrap', got {per_rank!r}")
    olds = [read_stored(s, layout) for s, layout in enumerate(stored)]
    paths = set(olds[0].dtensors)
    for old in olds[1:]:
        if set(old.dtensors) != paths:
            extra = sorted(set(old.dtensors) ^ paths)[:_MAX_SHOWN]
            raise ShardsInconsistent(
                f"cannot reshard: old ranks 0 and {old.rank} hold DTensors at different paths "
                f"({extra}). The old ranks must hold the same DTensors (every rank of an FSDP2 "
                "job does)."
            )
    targets = with_inferred(olds[0], targets)
    region = {
        path for path, dt in olds[0].dtensors.items() if by_region(dt.record, targets.get(path), n)
    }
    sharded = {path: sharded_dtensor(path, olds) for path in olds[0].dtensors if path not in region}
    boxed: dict[str, Boxed] = {}
    for path in sorted(region):
        boxed[path] = boxed_dtensor(path, olds)
        check_target(boxed[path], targets[path])

    source = olds[new_rank % n if per_rank == "wrap" else 0]
    if per_rank == "refuse":
        _compare_plain(olds)

    # The new rank's layout: the source's skeleton and specs, each DTensor rewritten.
    entries: list[tuple[str, torch.dtype, tuple[int, ...]]] = [
        (spec.path, spec.dtype, spec.shape) for spec in source.layout.specs
    ]
    pieces: list[list[Piece]] = [[] for _ in entries]
    dtensor_indices: set[int] = set()

    def rewrite(dt: DTensorNode) -> DTensorNode:
        path = source.layout.specs[dt.index].path
        dtensor_indices.add(dt.index)
        if path in boxed:
            # The caller's own record: the shard it holds on its mesh is what is rebuilt.
            target = targets[path]
            entries[dt.index] = (path, target.dtype, target.local)
            pieces[dt.index] = pieces_in(boxed[path], target)
            return DTensorNode(dt.index, dict(target.record))
        sh = sharded[path]
        local, offset = new_shard(sh, new_rank, new_world)
        record = dict(dt.record)
        record["mesh"] = [new_world]
        record["coord"] = [new_rank]
        record["offset"] = offset
        entries[dt.index] = (path, sh.dtype, local)
        pieces[dt.index] = pieces_for(sh, local, offset)
        return DTensorNode(dt.index, record)

    skeleton = write_tree(source.tree, rewrite)
    layout = (
        source.layout
        if skeleton == source.layout.skeleton
        and all(
            entry[2] == spec.shape for entry, spec in zip(entries, source.layout.specs, strict=True)
        )
        else Layout.build(skeleton, entries)
    )
    for i in plain_indices(source.layout, dtensor_indices):
        shape = source.layout.specs[i].shape
        if math.prod(shape):
            zeros = (0,) * len(shape)
            pieces[i] = [Piece(source.rank, i, zeros, zeros, shape)]

    wanted: dict[int, set[int]] = {}
    for plist in pieces:
        for p in plist:
            wanted.setdefault(p.rank, set()).add(p.index)
    checks: list[_Check] = []
    if per_rank == "refuse" and n > 1:
        readers = set(wanted)
        # An old rank that no new rank reads for its shards is read by new rank s % M, so
        # that its plain tensors are compared too.
        shard_read = _read_for_shards(sharded, olds)
        shard_read |= {rank for b in boxed.values() for _, _, rank, _ in b.boxes}
        readers |= {s for s in range(1, n) if s not in shard_read and s % new_world == new_rank}
        plain0 = {olds[0].layout.specs[i].path: i for i in _plain_indices_of(olds[0])}
        for s in sorted(readers - {0}):
            for path, i0 in plain0.items():
                i = olds[s].layout.index[path]
                checks.append(_Check(path, i0, s, i))
                wanted.setdefault(0, set()).add(i0)
                wanted.setdefault(s, set()).add(i)
    sources = {
        (s, i): (stored[s].specs[i].dtype, stored[s].specs[i].shape)
        for s, indices in wanted.items()
        for i in indices
    }
    spans: dict[tuple[int, int], tuple[int, int]] = {}
    for plist in pieces:
        for p in plist:
            widen(spans, (p.rank, p.index), _box_span(stored[p.rank].specs[p.index], p))
    for check in checks:
        for key in ((0, check.index0), (check.rank, check.index)):
            spans[key] = (0, stored[key[0]].specs[key[1]].nbytes)
    return ReshardPlan(
        layout=layout,
        wanted={s: tuple(sorted(wanted[s])) for s in sorted(wanted) if wanted[s]},
        pieces=tuple(tuple(p) for p in pieces),
        sources=sources,
        checks=tuple(checks),
        new_rank=new_rank,
        new_world=new_world,
        old_world=n,
        per_rank=per_rank,
        spans={key: spans.get(key, (0, 0)) for key in sources},
    )


def _box_span(spec: TensorSpec, piece: Piece) -> tuple[int, int]:
    """The bytes (C order) of ``spec``'s tensor from the first to the last element of the box
    ``piece`` copies out of it."""
    first = last = 0
    stride = 1
    for d in range(len(spec.shape) - 1, -1, -1):
        first += piece.src_start[d] * stride
        last += (piece.src_start[d] + piece.size[d] - 1) * stride
        stride *= spec.shape[d]
    size = spec.dtype.itemsize
    return first * size, (last + 1) * size


def _plain_indices_of(old: Stored) -> list[int]:
    return plain_indices(old.layout, {dt.index for dt in old.dtensors.values()})


def _read_for_shards(sharded: Mapping[str, Sharded], olds: Sequence[Stored]) -> set[int]:
    """The old ranks some new rank reads DTensor pieces from, whatever the new world.

    Under ``Shard(d)`` every old shard with elements overlaps new shards with elements (the
    new shards tile the same dimension); a replicated DTensor is read from old rank 0.
    """
    out: set[int] = set()
    for sh in sharded.values():
        if sh.dim is None:
            if math.prod(sh.local_shapes[0]):
                out.add(0)
            continue
        for s in range(len(olds)):
            if math.prod(sh.local_shapes[s]):
                out.add(s)
    return out


def _compare_plain(olds: Sequence[Stored]) -> None:
    """Refuse when old ranks differ in their non-DTensor values or plain tensors' specs."""

    def normalized(dt: DTensorNode) -> Any:
        return ["dtensor", dt.index]

    first = olds[0]
    base = write_tree(first.tree, normalized)
    specs0 = [first.layout.specs[i] for i in _plain_indices_of(first)]
    problems: list[str] = []
    for old in olds[1:]:
        paths: list[str] = []
        if write_tree(old.tree, normalized) != base:
            paths = differences(first.tree, old.tree)
            if not paths:
                paths.append("(the encoding of the state)")
        specs = [old.layout.specs[i] for i in _plain_indices_of(old)]
        if [(s.path, s.dtype, s.shape) for s in specs] != [
            (s.path, s.dtype, s.shape) for s in specs0
        ]:
            mine = {s.path: (s.dtype, s.shape) for s in specs0}
            theirs = {s.path: (s.dtype, s.shape) for s in specs}
            paths.extend(
                f"{p} (tensor)"
                for p in sorted(set(mine) | set(theirs))
                if mine.get(p) != theirs.get(p)
            )
        if paths:
            shown = paths[:_MAX_SHOWN]
            more = f" and {len(paths) - len(shown)} more" if len(paths) > len(shown) else ""
            problems.append(f"old ranks 0 and {old.rank} differ at {', '.join(shown)}{more}")
    if problems:
        raise ReshardError(_per_rank_message(problems))


def _per_rank_message(problems: Sequence[str]) -> str:
    shown = list(problems[:_MAX_SHOWN])
    if len(problems) > len(shown):
        shown.append(f"... and {len(problems) - len(shown)} more")
    return (
        "cannot restore on another number of ranks: state outside DTensors must be the same on "
        "every old rank to be given to the new ranks, and it is not:\n  "
        + "\n  ".join(shown)
        + "\nIf this state is per-rank by design (a data-loader position, an RNG state), pass "
        "per_rank='wrap': new rank q then takes it from old rank q mod N. Otherwise restore on "
        "the number of ranks that saved the version."
    )


# --- assembling ------------------------------------------------------------------------------


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """``t`` as uint8 with a last dimension of its element size (a view; 0-dim included)."""
    return (
        t.unsqueeze(-1).view(torch.uint8)
        if t.is_contiguous()
        else t.contiguous().unsqueeze(-1).view(torch.uint8)
    )


def _fresh(dtype: torch.dtype, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    # Made as bytes then viewed: allocating some dtypes directly makes torch warn (complex32).
    raw = torch.empty((*shape, dtype.itemsize), dtype=torch.uint8, device=device)
    return raw.view(dtype).squeeze(-1)


def assemble(
    plan: ReshardPlan, old: Mapping[int, Mapping[int, torch.Tensor]]
) -> list[torch.Tensor]:
    """The new rank's tensors, in ``plan.layout.specs`` order, cut from the old ranks' tensors.

    ``old[s][i]`` is tensor ``i`` of old rank ``s``; those listed in ``plan.wanted`` must be
    there (with the dtype and shape of their old layout; others are ignored). Each returned
    tensor is fresh and contiguous, on the device of the old tensors it is cut from (the CPU
    when it has no elements). Under ``per_rank="refuse"`` the plain tensors of old rank 0 and
    of every other old rank read are first compared bit for bit: a difference raises
    :class:`~tiercheck.errors.ReshardError` naming the paths and ranks. A missing or misshapen
    old tensor raises ``ValueError`` (the caller's mistake, not the data's).
    """
    for (s, i), (dtype, shape) in plan.sources.items():
        t = old.get(s, {}).get(i)
        if t is None:
            raise ValueError(f"assemble needs tensor {i} of old rank {s} (see plan.wanted)")
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise ValueError(
                f"tensor {i} of old rank {s} is {t.dtype}{tuple(t.shape)}; its layout says "
                f"{dtype}{shape}"
            )
    differing: dict[int, list[str]] = {}
    for check in plan.checks:
        a = _bytes_of(old[0][check.index0])
        b = _bytes_of(old[check.rank][check.index])
        if a.device != b.device:
            b = b.to(a.device)
        if not torch.equal(a, b):
            differing.setdefault(check.rank, []).append(check.path)
    if differing:
        problems = []
        for rank, paths in sorted(differing.items()):
            shown = paths[:_MAX_SHOWN]
            more = f" and {len(paths) - len(shown)} more" if len(paths) > len(shown) else ""
            problems.append(
                f"old ranks 0 and {rank} hold different values at {', '.join(shown)}{more}"
            )
        raise ReshardError(_per_rank_message(problems))
    out: list[torch.Tensor] = []
    with torch.no_grad():
        for spec, pieces in zip(plan.layout.specs, plan.pieces, strict=True):
            device = old[pieces[0].rank][pieces[0].index].device if pieces else torch.device("cpu")
            new = _fresh(spec.dtype, spec.shape, device)
            dst_bytes = new.unsqueeze(-1).view(torch.uint8)
            for p in pieces:
                src_bytes = _bytes_of(old[p.rank][p.index])
                dst_bytes[p.dst].copy_(src_bytes[p.src])
            out.append(new)
    return out
