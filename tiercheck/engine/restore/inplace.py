"""Restoring into the caller's state straight from a file: the header first, the bytes last.

The general way back (:class:`~tiercheck.engine.restore.read.Reader`) reads a whole blob into fresh
memory, verifies it, checks the caller's state against it, then copies it in: the blob is held
twice, and at a process's start the fresh memory's page faults cost several times the copy.
Where this rank's blob is a file in a tier that lets a reader ``pread`` it
(:class:`~tiercheck.tiers.SupportsFileRead`: the local tier), is a full blob with chunk digests
and refers to no other blob, and the caller gives a state to restore into (``strict``):

1. :func:`open_direct` reads and checks the blob's header only (its preamble and header
   checksums; its version and rank): a :class:`Direct`.
2. The caller's state is checked against the version's structure (:meth:`Direct.stand_in`: the
   layout's tensors on the ``meta`` device) exactly as before, and the ranks exchange verdicts:
   a state that does not fit still has nothing written into it.
3. :func:`write_direct` pairs each of the state's tensors with its bytes in the payload
   (:func:`~tiercheck.codec.decode.statetree.pair_into`), then reads the payload chunk by chunk into
   each thread's small buffer, checks every chunk against its digest, and only then copies its bytes
   to the tensors (:func:`~tiercheck.codec.decode.scatter.read_scattered`). No byte that failed its
   check reaches the state; every byte of the blob is checked.

What a failure leaves: a chunk that fails its check stops the read, and the tensors hold the
bytes of the chunks checked before it (each one the version's own, verified), the others their
former values. The restore then reads the version from the next tier the ordinary way (the
damaged blob is set aside there), or goes to an older version -- each overwrites every tensor,
since a strict restore writes them all. Only when nothing can be restored does the state keep
such a mix, and the :class:`~tiercheck.errors.RestoreError` says so.

Tensors that cannot take their bytes by address (on a GPU, not contiguous, conjugate or negative
views, tensor subclasses, or overlapping another target) are staged in host memory and copied
after the read, in the order :func:`~tiercheck.codec.decode.statetree.load_into` would copy them.
"""

from __future__ import annotations

import asyncio
import logging
import operator
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

import numpy as np
import numpy.typing as npt
import torch
from torch.autograd.graph import increment_version

from tiercheck.codec import RawState, unflatten
from tiercheck.codec.decode.assembled import Resharded
from tiercheck.codec.decode.partial import read_meta_ranged
from tiercheck.codec.decode.scatter import (
    Scatter,
    plan_scatter,
    read_scattered,
    scatterable,
    spans_overlap,
)
from tiercheck.codec.decode.statetree import check_into, copy_all, load_into, pair_into
from tiercheck.codec.format.blobformat import PREAMBLE_NBYTES, BlobMeta
from tiercheck.codec.format.layout import TensorSpec, align
from tiercheck.codec.rawstate import host_buffer
from tiercheck.codec.resources import paused_gc
from tiercheck.consistency.protocol import RestoreVerdict, Step
from tiercheck.engine.collectives import step
from tiercheck.engine.results import OWN_STORAGE_BYTES
from tiercheck.errors import FormatError, StateMismatch, TiercheckError, UnsupportedObject
from tiercheck.tiers.base import SupportsFileRead, Tier

if TYPE_CHECKING:
    from tiercheck.consistency.recovery import Inventory
    from tiercheck.engine.collectives import Channels
    from tiercheck.engine.options import Options
    from tiercheck.engine.results import CheckpointerStats

logger = logging.getLogger("tiercheck")

__all__ = [
    "READERS",
    "Direct",
    "Reader",
    "Restoring",
    "direct_ok",
    "open_direct",
    "reads_files",
    "rebuild",
    "write_direct",
    "write_round",
    "write_version",
]

_DIRECT_TYPES = (torch.Tensor, torch.nn.Parameter)
#: At most this many threads read a blob into the state: the read is bound by memory
#: bandwidth, which a few threads fill, and each keeps an 8 MiB buffer (a node's ranks
#: restore at once, and the codec's thread count is every core).
READERS = 4


class Reader(Protocol):
    """What :func:`write_version` reads by: :class:`~tiercheck.engine.restore.read.Reader`."""

    @property
    def cpu(self) -> Executor:
        """Worker threads."""
        ...

    @property
    def stats(self) -> CheckpointerStats:
        """Where a fallback is counted."""
        ...

    async def fetch(self, version: int, mine: Inventory) -> tuple[Any, str | None, list[str]]:
        """The version read the ordinary way, its tier, and why the others could not."""
        ...


class Restoring(Protocol):
    """What :func:`write_round` needs: :class:`~tiercheck.engine.restore.restore.Restorer`."""

    @property
    def reader(self) -> Reader:
        """Reads blobs."""
        ...

    @property
    def options(self) -> Options:
        """The job's options."""
        ...

    @property
    def channels(self) -> Channels:
        """Where the ranks exchange."""
        ...


@dataclass(frozen=True)
class Direct:
    """This rank's blob of one version in a file tier: its header read and checked, its
    payload not read yet (see the module)."""

    tier: SupportsFileRead
    tier_name: str
    key: str
    meta: BlobMeta
    #: The blob's first bytes as its meta was parsed from (the read checks they are unchanged).
    preamble: bytes

    def stand_in(self) -> Sequence[torch.Tensor | TensorSpec]:
        """What stands for the version's tensors while the caller's state is checked and paired
        with it: their structure, no bytes. The layout's own records (no tensor is made) where
        the version holds no DTensor; else views of a payload on the ``meta`` device (a DTensor
        record is rebuilt around a tensor)."""
        layout = self.meta.layout
        if not layout.has_dtensors:
            return layout.specs
        with torch.inference_mode():  # only read from, as a decoded version's views are
            payload = torch.empty(layout.payload_nbytes, dtype=torch.uint8, device="meta")
            return layout.views(payload)


def reads_files(tier: Tier) -> bool:
    """Whether ``tier`` serves :func:`open_direct` (:class:`~tiercheck.tiers.SupportsFileRead`)."""
    return isinstance(tier, SupportsFileRead)


def direct_ok(meta: BlobMeta) -> bool:
    """Whether a blob of ``meta`` can be restored by :func:`write_direct`."""
    layout = meta.layout
    return scatterable(meta) and not layout.has_refs and not layout.has_arrays


def _pread(fd: int, size: int) -> Callable[[int, int], bytes]:
    def fetch(start: int, end: int) -> bytes:
        start, end = min(start, size), min(end, size)
        out = bytearray()
        while len(out) < end - start:
            got = os.pread(fd, end - start - len(out), start + len(out))
            if not got:
                break
            out += got
        return bytes(out)

    return fetch


async def open_direct(tier: Tier, name: str, key: str, expect: tuple[int, int]) -> Direct | None:
    """The :class:`Direct` of the blob under ``key`` in ``tier``, or ``None`` where it cannot be
    restored that way (not a file tier, or a blob :func:`direct_ok` refuses). Raises what a
    damaged or missing header raises (:class:`~tiercheck.errors.ChecksumMismatch`,
    :class:`~tiercheck.errors.FormatError`, :class:`~tiercheck.errors.BlobNotFound`): the caller
    then reads the blob the ordinary way, which sets a damaged one aside."""
    if not isinstance(tier, SupportsFileRead):
        return None

    def head(fd: int, size: int) -> tuple[BlobMeta, bytes]:
        fetch = _pread(fd, size)
        with paused_gc():  # a header of thousands of tensors: see there
            return read_meta_ranged(fetch, size=size), fetch(0, PREAMBLE_NBYTES)

    meta, preamble = await tier.read_file(key, head)
    if (meta.version, meta.rank) != expect:
        raise FormatError(
            f"{key} holds version {meta.version} of rank {meta.rank}, not version "
            f"{expect[0]} of rank {expect[1]}"
        )
    if not direct_ok(meta):
        return None
    return Direct(tier, name, key, meta, preamble)


@dataclass
class _Plan:
    """Where the payload goes: the scatter, the tensors written by address, and the staged."""

    scatter: Scatter
    written: list[torch.Tensor]
    staged_targets: list[torch.Tensor]
    staged_sources: list[torch.Tensor]
    #: Keeps the staging memory alive while the scatter writes into it.
    staging: torch.Tensor | None


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes of host memory ``t`` may touch."""
    if t.numel() == 0:
        return (0, 0)
    reach = sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride(), strict=True)) + 1
    low = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True) if s < 0)
    start = t.data_ptr() + low * t.element_size()
    return (start, start + reach * t.element_size())


def _direct(targets: Sequence[torch.Tensor]) -> list[bool]:
    """Which targets take their bytes by address: plain contiguous host tensors."""
    Tensor = torch.Tensor
    # The common case (every target qualifies) in a few calls that loop in C.
    if (
        set(map(type, targets)) <= set(_DIRECT_TYPES)
        and all(map(operator.attrgetter("is_cpu"), targets))
        and set(map(operator.attrgetter("layout"), targets)) <= {torch.strided}
        and all(map(Tensor.is_contiguous, targets))
        and not any(map(Tensor.is_conj, targets))
        and not any(map(Tensor.is_neg, targets))
    ):
        return [True] * len(targets)
    return [
        type(t) in _DIRECT_TYPES
        and t.is_cpu
        and t.layout is torch.strided
        and t.is_contiguous()
        and not t.is_conj()
        and not t.is_neg()
        for t in targets
    ]


def _plan(
    layout_nbytes: int,
    targets: Sequence[torch.Tensor],
    sources: Sequence[torch.Tensor | TensorSpec],
) -> _Plan:
    n = len(targets)
    Tensor = torch.Tensor
    sizes = np.fromiter(map(operator.attrgetter("nbytes"), sources), np.int64, n)
    if set(map(type, sources)) <= {TensorSpec}:
        # The layout's records (the stand-in of a state without DTensors): their offsets.
        offsets = np.fromiter(map(operator.attrgetter("offset"), sources), np.int64, n)
    else:
        # Views of the stand-in payload: where each starts in it.
        views = cast(Sequence[torch.Tensor], sources)
        offsets = np.fromiter(map(Tensor.storage_offset, views), np.int64, n) * np.fromiter(
            map(Tensor.element_size, views), np.int64, n
        )
    direct = _direct(targets)
    if all(direct):
        starts = np.fromiter(map(Tensor.data_ptr, targets), np.int64, n)
        if _disjoint(np.stack((starts, starts + sizes), 1)):
            # The common case: every target written by address, in the order given.
            return _Plan(
                plan_scatter(layout_nbytes, np.stack((offsets, sizes, starts), 1)),
                list(targets),
                [],
                [],
                None,
            )
        spans = np.stack((starts, starts + sizes), 1)
    else:
        spans = np.array(
            [
                (t.data_ptr(), t.data_ptr() + int(size))
                if d
                else (_span(t) if t.is_cpu else (0, 0))
                for d, t, size in zip(direct, targets, sizes, strict=True)
            ],
            dtype=np.int64,
        ).reshape(n, 2)
    if _disjoint(spans):
        written_at = [i for i in range(n) if direct[i]]
        staged = [i for i in range(n) if not direct[i]]
    else:
        written_at, staged = _untangle(direct, [(int(a), int(b)) for a, b in spans.tolist()])
    rows = [np.stack((offsets[written_at], sizes[written_at], spans[written_at, 0]), 1)]
    staging = None
    staged_sources: list[torch.Tensor] = []
    if staged:
        widths = [align(int(sizes[i])) for i in staged]
        staging = host_buffer(sum(widths))
        base = staging.data_ptr()
        at = 0
        places = []
        for i, width in zip(staged, widths, strict=True):
            places.append(base + at)
            s = sources[i]
            staged_sources.append(staging[at : at + int(sizes[i])].view(s.dtype).view(s.shape))
            at += width
        rows.append(np.stack((offsets[staged], sizes[staged], np.array(places, np.int64)), 1))
    return _Plan(
        plan_scatter(layout_nbytes, np.concatenate(rows)),
        [targets[i] for i in range(n) if direct[i]],
        [targets[i] for i in staged],
        staged_sources,
        staging,
    )


def _disjoint(spans: npt.NDArray[np.int64]) -> bool:
    """Whether no two non-empty ``(start, end)`` rows overlap."""
    kept = spans[spans[:, 1] > spans[:, 0]]
    if len(kept) < 2:
        return True
    kept = kept[np.argsort(kept[:, 0], kind="stable")]
    return bool((kept[:-1, 1] <= kept[1:, 0]).all())


def _untangle(
    direct: Sequence[bool], spans: Sequence[tuple[int, int]]
) -> tuple[list[int], list[int]]:
    """Targets that overlap: which are written by address, which staged (in walk order).

    A tensor listed twice (tied weights: the same span) is written once, with the bytes the
    last of walk-order copies would leave; any other overlap is staged, so that its copies
    happen in walk order, after the writes (which overlap nothing).
    """
    n = len(direct)
    last: dict[tuple[int, int], int] = {}
    for i in range(n):
        if direct[i]:
            last[spans[i]] = i
    unique = [i for i in range(n) if not direct[i] or last[spans[i]] == i]
    overlapping = spans_overlap([spans[i] for i in unique])
    clashing = {spans[i] for i, bad in zip(unique, overlapping, strict=True) if bad}
    written_at = [
        i for i in range(n) if direct[i] and spans[i] not in clashing and last[spans[i]] == i
    ]
    staged = [i for i in range(n) if not direct[i] or spans[i] in clashing]
    return written_at, staged


async def write_direct(
    direct: Direct, state: Any, rebuilt: Any, *, executor: Executor, threads: int
) -> Any:
    """Write the version into ``state``, which :func:`~tiercheck.codec.decode.statetree.check_into`
    found ``rebuilt`` (made from :meth:`Direct.stand_in`) to fit, strictly; returns what
    :func:`~tiercheck.codec.decode.statetree.load_into` would (see the module for what a failure
    leaves).

    ``threads`` workers read and check chunks (this call's thread and ``threads - 1`` on
    ``executor``)."""
    meta = direct.meta

    def prepare() -> tuple[Any, _Plan]:
        with paused_gc():
            result, targets, sources = pair_into(state, rebuilt)
            return result, _plan(meta.layout.payload_nbytes, targets, sources)

    result, plan = await asyncio.to_thread(prepare)

    def read(fd: int, size: int) -> None:
        read_scattered(
            fd, size, meta, direct.preamble, plan.scatter, executor=executor, threads=threads
        )

    await direct.tier.read_file(direct.key, read)

    def finish() -> None:
        # The bytes were written behind torch's back: tell autograd, as copy_ would have.
        with torch.no_grad():
            if plan.written:
                increment_version(plan.written)
            copy_all(plan.staged_targets, plan.staged_sources)

    await asyncio.to_thread(finish)
    return result


def rebuild(
    raw: RawState | Resharded | Direct, state: Any, strict: bool, *, allow_pickle: bool
) -> Any:
    """The version as a state; with a live ``state``, checked to fit it (nothing written).

    For a :class:`Direct` (whose bytes are not read yet), its :meth:`~Direct.stand_in`: the
    structure to check ``state`` against, with tensors of no data.
    """
    if isinstance(raw, Direct):
        assert state is not None  # a Direct is read for a state to restore into
        stood = unflatten(raw.meta.layout, raw.stand_in(), allow_pickle=allow_pickle)
        return _checked(state, stood, strict, raw.meta.version)
    if state is not None:
        # Views only read from, to be copied into the state (and cloned where strict=False
        # adds a key): inference tensors, which cost less to make than tracked views.
        with torch.inference_mode():
            tensors = raw.tensors()
    else:
        tensors = raw.tensors()
    if state is None:
        # Small tensors get storage of their own: some consumers read a tensor from the
        # start of its storage, ignoring the offset of a view (torch.set_rng_state does).
        # Large ones stay views of the payload: no second copy.
        tensors = [t.clone() if t.nbytes <= OWN_STORAGE_BYTES else t for t in tensors]
    rebuilt = unflatten(raw.layout, tensors, allow_pickle=allow_pickle)
    return rebuilt if state is None else _checked(state, rebuilt, strict, raw.version)


def _checked(state: Any, rebuilt: Any, strict: bool, version: int) -> Any:
    """``rebuilt``, once :func:`check_into` found that ``state`` fits it; else
    :class:`~tiercheck.errors.StateMismatch` naming every place that does not."""
    mismatches = check_into(state, rebuilt, strict=strict)
    if mismatches:
        shown = mismatches[:50]
        more = len(mismatches) - len(shown)
        raise StateMismatch(
            f"the state to restore into does not match version {version}; nothing "
            "was written into it:\n  "
            + "\n  ".join(shown)
            + (f"\n  ... and {more} more" if more else "")
            + "\nRestore without a state (restore()) and load what fits yourself, or "
            "pass strict=False to allow keys present on one side only."
        )
    return rebuilt


async def write_version(
    reader: Reader,
    direct: Direct,
    mine: Inventory,
    state: Any,
    rebuilt: Any,
    *,
    allow_pickle: bool,
    threads: int,
) -> tuple[RestoreVerdict, Any]:
    """Write ``direct``'s version into ``state`` (:func:`write_direct`); where that fails, read
    the version the ordinary way, from the first tier that serves it (the damaged blob is set
    aside), and load it. Returns this rank's ``WRITTEN`` verdict and the restored state."""
    version = direct.meta.version
    try:
        done = await write_direct(direct, state, rebuilt, executor=reader.cpu, threads=threads)
        return RestoreVerdict(True, direct.tier_name), done
    except Exception as exc:
        reader.stats.restore_fallbacks += 1
        logger.warning(
            "tiercheck: version %s from the %r tier could not be read into the state (%r); "
            "reading it the ordinary way",
            version,
            direct.tier_name,
            exc,
            # A damaged or vanished blob is expected; anything else is a bug: its traceback.
            exc_info=not isinstance(exc, (TiercheckError, OSError)),
        )
        reasons = [
            f"{direct.tier_name}: {type(exc).__name__}: {exc} (the state's tensors may hold "
            f"verified bytes of version {version} read before that)"
        ]
    raw, source, more = await reader.fetch(version, mine)
    reasons += more
    if raw is None or isinstance(raw, Direct):
        return RestoreVerdict(False, None, tuple(reasons)), None
    try:
        with paused_gc():
            checked = rebuild(raw, state, True, allow_pickle=allow_pickle)
            done = load_into(state, checked, strict=True, checked=True)
    except (StateMismatch, UnsupportedObject, FormatError) as exc:
        reasons.append(f"{source}: {type(exc).__name__}: {exc}")
        return RestoreVerdict(False, None, tuple(reasons)), None
    return RestoreVerdict(True, source, tuple(reasons)), done


async def write_round(
    restorer: Restoring,
    raw: Any,
    mine: Inventory,
    state: Any,
    rebuilt: Any,
    *,
    source: str | None,
) -> tuple[list[RestoreVerdict], Any, str | None]:
    """Step ``WRITTEN``, once every rank's ``VERDICT`` was ok and some rank's ``direct``: this
    rank writes the version into ``state`` if ``raw`` is a :class:`Direct`
    (:func:`write_version`), and every rank says how that went. Returns the verdicts, the
    restored state (``None`` where this rank had nothing to write yet) and this rank's tier."""
    done, written = RestoreVerdict(True, source), None
    if isinstance(raw, Direct):
        done, written = await write_version(
            restorer.reader,
            raw,
            mine,
            state,
            rebuilt,
            allow_pickle=restorer.options.encode.allow_pickle,
            threads=min(restorer.options.encode.threads, READERS),
        )
    return await step(restorer.channels, Step.WRITTEN, done), written, done.source
