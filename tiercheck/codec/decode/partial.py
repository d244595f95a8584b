"""Reading part of a blob: its meta, then only the bytes of the tensors a caller wants.

For elastic restore a rank needs some tensors of other ranks' blobs, and should not move (or
hash) whole blobs to get them. Everything here reads through a *fetch* function,
``fetch(start, end) -> bytes [start, end) of the blob``, clipped to the blob's size as a slice
is (exactly :meth:`~tiercheck.tiers.SupportsRangedGet.get_range` with its key bound, run
synchronously; or a slice of a blob in memory). The functions are synchronous: an async caller
runs them in a worker thread, with a fetch that waits for the tier there.

What is checked, before any byte is used:

* the preamble and header, as :func:`~.blob.read_meta` checks them (:func:`read_meta_ranged`);
* full blobs of format 1.1: every 8 MiB chunk read, against its digest in the header (the leaves
  of the body digest). A tensor costs the chunks it overlaps, no more. A full blob of format 1.0
  (or one written without chunk digests) cannot be checked by parts: its whole body is read and
  hashed, in bounded pieces, and the tensors are returned only when the body matches;
* packed blobs: every frame read, against its digest in the header, before it is decompressed.
  A tensor costs the frames that hold its bytes (small tensors share frames). A delta needs the
  same tensors of its base: give the base as a :class:`~.blob.RawState` in memory, or as a
  :class:`RangedBlob` read by ranges too (its own base, if any, likewise).

A mismatch raises :class:`~tiercheck.errors.ChecksumMismatch` naming the blob and the chunk or
frame; a blob shorter than its header says raises :class:`~tiercheck.errors.FormatError`.
Unlike :func:`~.blob.decode`, a partial read cannot check the raw digest of the whole payload
(it does not rebuild the whole payload): the chunk and frame digests, and the base's identity
(version and raw digest) for a delta, are what vouch for the bytes.

A caller that needs only part of a tensor (a new shard overlapping part of an old one) gives
its byte span: only the chunks or frames overlapping the span are then read, and the tensor's
bytes outside the span are left unset.

The tensors returned are the caller's own: fresh memory per tensor, never a view of a buffer
that is reused, nor of the fetched bytes.
"""

from __future__ import annotations

import operator
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch
import xxhash

from tiercheck.codec.format.blobformat import (
    PREAMBLE_NBYTES,
    BlobMeta,
    FrameExtent,
    frame_extents,
    parse,
    read_head,
)
from tiercheck.codec.format.digest import DIGEST_CHUNK, tree_root
from tiercheck.codec.format.layout import align
from tiercheck.codec.packed.frames import Buffer, DecodeSettings, decode_frame
from tiercheck.codec.packed.frames import Piece as FramePiece
from tiercheck.codec.rawstate import RawState, host_buffer
from tiercheck.codec.resources import U8, ScratchPool, run_bounded
from tiercheck.errors import BaseMismatch, ChecksumMismatch, FormatError

__all__ = [
    "DEFAULT_FIRST_READ",
    "DEFAULT_MAX_READ",
    "Fetch",
    "RangedBlob",
    "Spans",
    "read_meta_ranged",
    "read_tensors",
    "widen",
]

#: ``fetch(start, end)``: bytes ``[start, end)`` of one blob, clipped to its size.
Fetch = Callable[[int, int], Buffer]
#: Per tensor index, the bytes ``[start, end)`` of the tensor that are wanted (others: all).
Spans = Mapping[int, tuple[int, int]]

_K = TypeVar("_K")


def widen(spans: dict[_K, tuple[int, int]], key: _K, span: tuple[int, int]) -> None:
    """Make ``spans[key]`` cover ``span`` too (the smallest span holding both)."""
    had = spans.get(key)
    spans[key] = span if had is None else (min(had[0], span[0]), max(had[1], span[1]))


#: The first read of :func:`read_meta_ranged`: the preamble and, usually, the whole header.
DEFAULT_FIRST_READ = 64 << 10
#: The most one fetch of :func:`read_tensors` asks for (a run of adjacent chunks or frames).
DEFAULT_MAX_READ = 64 << 20


@dataclass(frozen=True)
class RangedBlob:
    """A blob read by ranges: its meta (:func:`read_meta_ranged`), its fetch, and -- for a
    delta -- its base, itself a :class:`RangedBlob` or a :class:`~.blob.RawState` in memory.

    Pass one as the ``base`` of :func:`read_tensors` to read a delta's base tensors by ranges.
    """

    meta: BlobMeta
    fetch: Fetch
    base: RangedBlob | RawState | None = None

    def read(
        self,
        wanted: Sequence[int],
        *,
        spans: Spans | None = None,
        max_read: int = DEFAULT_MAX_READ,
        threads: int = 1,
        executor: Executor | None = None,
    ) -> dict[int, torch.Tensor]:
        """:func:`read_tensors` of this blob, with its base."""
        return read_tensors(
            self.meta,
            self.fetch,
            wanted,
            base=self.base,
            spans=spans,
            max_read=max_read,
            threads=threads,
            executor=executor,
        )


def _bytes(data: Buffer) -> memoryview:
    view = memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _fetch_exactly(fetch: Fetch, start: int, end: int, what: str) -> memoryview:
    got = _bytes(fetch(start, end))
    if len(got) != end - start:
        raise FormatError(
            f"{what}: asked for bytes [{start}, {end}) and got {len(got)} of {end - start}: "
            "the blob is shorter than its header says (truncated?)"
        )
    return got


def read_meta_ranged(
    fetch: Fetch, *, size: int | None = None, first_read: int = DEFAULT_FIRST_READ
) -> BlobMeta:
    """A blob's meta through at most two ranged reads, checked as :func:`~.blob.read_meta` does.

    The first read asks for ``first_read`` bytes (the preamble, and the header when it fits);
    a longer header costs a second read of the rest. ``size``: the blob's size, if the caller
    knows it (the tier's ``get_size``), checked against the preamble's; otherwise the preamble
    is trusted for it (it is checksummed) and a truncated body shows when it is read.
    """
    first = _bytes(fetch(0, max(first_read, PREAMBLE_NBYTES)))
    _head, header_nbytes, body_nbytes, _kind = read_head(first)
    offset = align(PREAMBLE_NBYTES + header_nbytes)
    if len(first) >= offset:
        view = first[:offset]
    else:
        rest = _fetch_exactly(fetch, len(first), offset, "reading the blob header")
        view = memoryview(b"".join((first, rest)))
    return parse(view, offset + body_nbytes if size is None else size)


def _describe(meta: BlobMeta) -> str:
    return f"blob of version {meta.version} rank {meta.rank} (checksum {meta.checksum:#018x})"


def _check_wanted(meta: BlobMeta, wanted: Iterable[int]) -> list[int]:
    count = len(meta.layout.specs)
    indices: set[int] = set()
    for i in wanted:
        try:
            index = operator.index(i)  # ints, numpy ints; not floats
        except TypeError:
            index = -1
        if isinstance(i, bool) or not 0 <= index < count:
            raise ValueError(f"tensor index {i!r} is not one of the {count} tensors of the blob")
        indices.add(index)
    return sorted(indices)


def _spans(
    meta: BlobMeta, indices: Sequence[int], spans: Spans | None
) -> dict[int, tuple[int, int]]:
    """Each wanted tensor's span, checked (a tensor without one: all its bytes)."""
    specs = meta.layout.specs
    out = {i: (0, specs[i].nbytes) for i in indices}
    for i, span in (spans or {}).items():
        if i not in out:
            raise ValueError(f"a span is given for tensor {i!r}, which is not wanted")
        lo, hi = span
        if type(lo) is not int or type(hi) is not int or not 0 <= lo <= hi <= specs[i].nbytes:
            raise ValueError(
                f"span {span!r} of tensor {i} is not within its {specs[i].nbytes} bytes"
            )
        out[i] = (lo, hi)
    return out


def _runs(
    items: Sequence[int], extent: Callable[[int], tuple[int, int]], cap: int
) -> list[list[int]]:
    """``items`` (sorted) grouped into runs whose extents are adjacent, each at most ``cap``
    bytes long unless a single item is longer."""
    runs: list[list[int]] = []
    end = -1
    begin = 0
    for item in items:
        start, stop = extent(item)
        if runs and start == end and stop - begin <= cap:
            runs[-1].append(item)
        else:
            runs.append([item])
            begin = start
        end = stop
    return runs


def _copy_overlap(out: U8, out_start: int, data: memoryview, data_start: int) -> None:
    """Copy into ``out`` (which holds bytes from ``out_start``) what ``data`` (bytes from
    ``data_start``) has of them."""
    lo = max(out_start, data_start)
    hi = min(out_start + len(out), data_start + len(data))
    if lo < hi:
        np.copyto(
            out[lo - out_start : hi - out_start],
            np.frombuffer(data[lo - data_start : hi - data_start], dtype=np.uint8),
        )


def _outputs(meta: BlobMeta, indices: Sequence[int]) -> dict[int, U8]:
    return {i: host_buffer(meta.layout.specs[i].nbytes).numpy() for i in indices}


def _read_full(
    meta: BlobMeta, fetch: Fetch, spans: Mapping[int, tuple[int, int]], max_read: int
) -> dict[int, U8]:
    specs = meta.layout.specs
    n = meta.layout.payload_nbytes
    outs = _outputs(meta, list(spans))
    wanted = [i for i, (lo, hi) in spans.items() if hi > lo]
    leaves = meta.chunk_digests
    if leaves is None:
        _read_full_unchunked(meta, fetch, outs, max_read)
        return outs
    chunks = sorted(
        {
            c
            for i in wanted
            for c in range(
                (specs[i].offset + spans[i][0]) // DIGEST_CHUNK,
                (specs[i].offset + spans[i][1] - 1) // DIGEST_CHUNK + 1,
            )
        }
    )

    def extent(c: int) -> tuple[int, int]:
        return c * DIGEST_CHUNK, min((c + 1) * DIGEST_CHUNK, n)

    for run in _runs(chunks, extent, max_read):
        start, end = extent(run[0])[0], extent(run[-1])[1]
        data = _fetch_exactly(
            fetch, meta.body_offset + start, meta.body_offset + end, f"reading {_describe(meta)}"
        )
        for c in run:
            lo, hi = extent(c)
            if xxhash.xxh3_64_intdigest(data[lo - start : hi - start]) != leaves[c]:
                raise ChecksumMismatch(
                    f"chunk {c} (payload bytes [{lo}, {hi})) of {_describe(meta)} does not match "
                    "its digest: the blob is corrupt; read another copy"
                )
        for i in wanted:
            _copy_overlap(outs[i], specs[i].offset, data, start)
    return outs


def _read_full_unchunked(meta: BlobMeta, fetch: Fetch, outs: dict[int, U8], max_read: int) -> None:
    """A full blob without chunk digests: the whole body, hashed in pieces, checked at the end."""
    specs = meta.layout.specs
    n = meta.layout.payload_nbytes
    step = max(1, max_read // DIGEST_CHUNK) * DIGEST_CHUNK
    leaves: list[int] = []
    for start in range(0, n, step):
        end = min(start + step, n)
        data = _fetch_exactly(
            fetch, meta.body_offset + start, meta.body_offset + end, f"reading {_describe(meta)}"
        )
        leaves.extend(
            xxhash.xxh3_64_intdigest(data[i : i + DIGEST_CHUNK])
            for i in range(0, len(data), DIGEST_CHUNK)
        )
        for i, out in outs.items():
            _copy_overlap(out, specs[i].offset, data, start)
    if tree_root(leaves, n) != meta.body_digest:
        raise ChecksumMismatch(
            f"{_describe(meta)} does not match its checksum (a format 1.0 full blob, without "
            "chunk digests, read whole): the blob is corrupt; read another copy"
        )


def _base_bytes(
    meta: BlobMeta,
    spans: Mapping[int, tuple[int, int]],
    base: RangedBlob | RawState | None,
    *,
    max_read: int,
    threads: int,
    executor: Executor | None,
) -> list[U8 | None] | None:
    """Per spec of ``meta``, the bytes of its base tensor where a wanted tensor has one."""
    info = meta.packed
    assert info is not None
    if info.delta is None:
        return None
    want = meta.base
    assert want is not None
    if base is None:
        raise BaseMismatch(
            f"{_describe(meta)} is a delta against version {want.version} (raw digest "
            f"{want.raw_digest:#018x}); read it with that base"
        )
    have = base.meta if isinstance(base, RangedBlob) else base
    if have.version != want.version or have.raw_digest != want.raw_digest:
        raise BaseMismatch(
            f"{_describe(meta)} is a delta against version {want.version} (raw digest "
            f"{want.raw_digest:#018x}), but the base given is version {have.version} (raw "
            f"digest {have.raw_digest:#018x})"
        )
    base_layout = base.meta.layout if isinstance(base, RangedBlob) else base.layout
    base_specs = base_layout.specs
    specs = meta.layout.specs
    matches: dict[int, int] = {}
    for i in spans:
        j = info.delta[i]
        if j < 0 or not specs[i].nbytes:
            continue
        if j >= len(base_specs) or (base_specs[j].dtype, base_specs[j].shape) != (
            specs[i].dtype,
            specs[i].shape,
        ):
            raise FormatError(f"delta map points {specs[i].path} at a different base tensor")
        matches[i] = j
    got: dict[int, U8]
    if isinstance(base, RangedBlob):
        # The same bytes of each base tensor (same dtype and shape) as of the tensor XORed on it.
        base_spans: dict[int, tuple[int, int]] = {}
        for i, j in matches.items():
            widen(base_spans, j, spans[i])
        got = _read_bytes(
            base.meta,
            base.fetch,
            dict(sorted(base_spans.items())),
            base.base,
            max_read=max_read,
            threads=threads,
            executor=executor,
        )
    else:
        if base.payload.device.type != "cpu":
            raise ValueError(f"the base payload must be in host memory, got {base.payload.device}")
        payload = base.payload.numpy()
        got = {
            j: payload[base_specs[j].offset : base_specs[j].offset + base_specs[j].nbytes]
            for j in set(matches.values())
        }
    per_spec: list[U8 | None] = [None] * len(specs)
    for i, j in matches.items():
        per_spec[i] = got[j]
    return per_spec


def _read_packed(
    meta: BlobMeta,
    fetch: Fetch,
    spans: Mapping[int, tuple[int, int]],
    base: RangedBlob | RawState | None,
    *,
    max_read: int,
    threads: int,
    executor: Executor | None,
) -> dict[int, U8]:
    info = meta.packed
    assert info is not None
    base_targets = _base_bytes(
        meta, spans, base, max_read=max_read, threads=threads, executor=executor
    )
    outs = _outputs(meta, list(spans))
    specs = meta.layout.specs
    targets: list[U8 | None] = [None] * len(specs)
    for i in spans:
        targets[i] = outs[i]
    extents = frame_extents(meta, info)

    def used(piece: FramePiece) -> bool:
        span = spans.get(piece.spec)
        return span is not None and piece.start < span[1] and span[0] < piece.start + piece.nbytes

    frames = [k for k, e in enumerate(extents) if any(used(p) for p in e.frame.pieces)]
    settings = DecodeSettings(
        meta.layout,
        np.empty(0, dtype=np.uint8),
        None,
        (-1,) * len(specs),
        targets=targets,
        base_targets=base_targets,
    )
    pool = ScratchPool(info.frame_bytes)

    def extent(k: int) -> tuple[int, int]:
        return extents[k].start, extents[k].start + extents[k].nbytes

    for run in _runs(frames, extent, max_read):
        start, end = extent(run[0])[0], extent(run[-1])[1]
        data = _fetch_exactly(
            fetch, meta.body_offset + start, meta.body_offset + end, f"reading {_describe(meta)}"
        )

        def work(k: int, data: memoryview = data, start: int = start) -> None:
            e: FrameExtent = extents[k]
            stored = data[e.start - start : e.start - start + e.nbytes]
            try:
                decode_frame(e.frame, stored, e.entries, e.digest, s=settings, pool=pool)
            except ChecksumMismatch as exc:
                raise ChecksumMismatch(
                    f"frame {k} (body bytes [{e.start}, {e.start + e.nbytes})) of "
                    f"{_describe(meta)} does not match its digest: the blob is corrupt; read "
                    "another copy"
                ) from exc

        run_bounded(work, run, workers=threads, executor=executor)
    return outs


def _read_bytes(
    meta: BlobMeta,
    fetch: Fetch,
    spans: Mapping[int, tuple[int, int]],
    base: RangedBlob | RawState | None,
    *,
    max_read: int,
    threads: int,
    executor: Executor | None,
) -> dict[int, U8]:
    """Per wanted tensor (the keys of ``spans``, ascending), its bytes in fresh memory, those
    in its span read and checked (see the module docstring)."""
    if meta.encoding.as_is:
        return _read_full(meta, fetch, spans, max_read)
    return _read_packed(
        meta, fetch, spans, base, max_read=max_read, threads=threads, executor=executor
    )


def read_tensors(
    meta: BlobMeta,
    fetch: Fetch,
    wanted: Sequence[int],
    *,
    base: RangedBlob | RawState | None = None,
    spans: Spans | None = None,
    max_read: int = DEFAULT_MAX_READ,
    threads: int = 1,
    executor: Executor | None = None,
) -> dict[int, torch.Tensor]:
    """The tensors of the blob at the indices ``wanted`` (into ``meta.layout.specs``), checked.

    Reads only the chunks (full blobs) or frames (packed blobs) holding them, each checked
    against its digest before use (see the module docstring); adjacent ones are fetched
    together, at most ``max_read`` bytes a fetch (a single chunk or frame may be longer).
    ``base``: for a delta, its base (:class:`~tiercheck.errors.BaseMismatch` if it is missing
    or another); ignored otherwise. ``spans``: for some wanted tensors, the bytes
    ``[start, end)`` (C order) that are needed; only the chunks or frames overlapping them are
    read, and the tensor's other bytes are left unset. Packed frames decode on ``executor`` or
    ``threads`` threads (``0`` = ``os.cpu_count()``; default 1: the caller usually reads
    several blobs at once).

    Returns ``{index: tensor}`` with each tensor's dtype and shape from the layout, in fresh
    memory of its own. Raises :class:`ValueError` for an index the blob does not have, or a
    span that is not within its tensor's bytes.
    """
    if max_read <= 0:
        raise ValueError(f"max_read must be positive, got {max_read}")
    indices = _check_wanted(meta, wanted)
    got = _read_bytes(
        meta,
        fetch,
        _spans(meta, indices, spans),
        base,
        max_read=max_read,
        threads=threads or os.cpu_count() or 1,
        executor=executor,
    )
    specs = meta.layout.specs
    out: dict[int, torch.Tensor] = {}
    for i in indices:
        spec = specs[i]
        if spec.nbytes == 0:
            out[i] = torch.empty(spec.shape, dtype=spec.dtype)
        else:
            out[i] = torch.from_numpy(got[i]).view(spec.dtype).view(spec.shape)
    return out
