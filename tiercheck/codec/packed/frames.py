"""The packed body: frames of tensor bytes, each split into planes, each plane raw or zstd.

Frame plan (a pure function of the layout, ``frame_bytes`` and whether planes are on, so the
decoder recomputes it instead of reading it): tensors are grouped by *plane width* -- their
element size when planes are on, 1 otherwise -- in ascending width, spec order within a group.
Each group's tensor bytes, concatenated without padding, are cut into frames of at most
``frame_bytes // 16 * 16`` bytes (a multiple of every width, so cuts fall between elements). A
frame therefore holds one piece of a big tensor, or many small tensors, and frames are
independent: they are encoded and decoded in parallel threads.

Per frame: its bytes (XORed with the base where the tensor has a match) are split into ``width``
planes; each plane is stored as ``(mode, bytes)`` with mode :data:`RAW` or :data:`ZSTD`, planes
back to back in plane order. Whether zstd pays is decided per plane from a sample (see
:class:`~.options.CodecOptions`). When every plane of the lower half of 4-, 8- or 16-byte
elements is to be stored raw (the low mantissa bytes of floats, usually), that half is not split
at all: it is stored as one entry of mode :data:`LOW` holding those bytes interleaved as they
were, followed by the planes of the upper half. Each frame's stored bytes carry their own
xxh3_64 digest in the header, checked before the frame is decompressed.

Speed: a frame that is one piece of one tensor is processed in 1 MiB blocks -- XOR a block,
split it into its planes (or join the planes of a block, XOR it) -- so the intermediate bytes
stay in L2 instead of making a round trip through memory.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import xxhash
import zstandard

from tiercheck.buffer import Buffer
from tiercheck.codec.encode.flatten import Layout
from tiercheck.codec.packed.delta import xor_bytes
from tiercheck.codec.packed.planes import (
    BLOCK_BYTES,
    join_planes,
    plane_sizes,
    split_planes,
    split_planes_torch,
)
from tiercheck.codec.resources import (
    U8,
    OutputArena,
    Scratch,
    ScratchPool,
    compressor,
    decompressor,
)
from tiercheck.errors import ChecksumMismatch, FormatError

__all__ = [
    "LOW",
    "RAW",
    "ZSTD",
    "Buffer",
    "DecodeSettings",
    "EncodeSettings",
    "Frame",
    "FrameOut",
    "Piece",
    "PlaneOut",
    "decode_frame",
    "encode_frame",
    "frame_entry_count",
    "hash_parts",
    "plan_frames",
]

RAW = 0
ZSTD = 1
#: The low half of every element kept interleaved, stored raw (only as a frame's first entry).
LOW = 2
#: One stored plane: its mode and the buffers whose concatenation is its stored bytes.
PlaneOut = tuple[int, list[Buffer]]
_SAMPLE_SLICES = 4


@dataclass(frozen=True, slots=True)
class Piece:
    """A run of one tensor's bytes inside a frame."""

    spec: int  # index in the layout
    start: int  # byte offset within the tensor
    nbytes: int
    frame_offset: int  # byte offset within the frame


@dataclass(frozen=True, slots=True)
class Frame:
    """One unit of parallel work: ``nbytes`` bytes of ``width``-byte elements."""

    width: int
    nbytes: int
    pieces: tuple[Piece, ...]


def plan_frames(layout: Layout, frame_bytes: int, planes: bool) -> list[Frame]:
    """The frames of ``layout`` (see the module docstring)."""
    capacity = frame_bytes // 16 * 16
    groups: dict[int, list[int]] = {}
    for i, spec in enumerate(layout.specs):
        if spec.nbytes:
            width = spec.dtype.itemsize if planes else 1
            groups.setdefault(width, []).append(i)
    frames: list[Frame] = []
    for width in sorted(groups):
        pieces: list[Piece] = []
        filled = 0
        for i in groups[width]:
            start, left = 0, layout.specs[i].nbytes
            while left:
                take = min(left, capacity - filled)
                pieces.append(Piece(i, start, take, filled))
                start, left, filled = start + take, left - take, filled + take
                if filled == capacity:
                    frames.append(Frame(width, filled, tuple(pieces)))
                    pieces, filled = [], 0
        if pieces:
            frames.append(Frame(width, filled, tuple(pieces)))
    return frames


# --- encode -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EncodeSettings:
    """What :func:`encode_frame` needs besides the frame (shared by all frames of a call)."""

    layout: Layout
    payload: torch.Tensor
    base_payload: torch.Tensor | None
    base_offsets: tuple[int, ...]  # per spec: offset of its match in the base payload, or -1
    level: int | None
    tuned: bool
    sample_bytes: int
    min_gain: float
    use_torch: bool  # device path: XOR and planes with torch ops on the payload's device


def hash_parts(parts: Iterable[Buffer]) -> int:
    """xxh3_64 of the concatenation of ``parts``."""
    hasher = xxhash.xxh3_64()
    for part in parts:
        hasher.update(part)
    return hasher.intdigest()


#: A frame's stored planes and the digest of their bytes.
FrameOut = tuple[list[PlaneOut], int]


class _Source:
    """The bytes of one frame on the host, XORed where the tensor has a base match.

    A single-piece frame is read block by block straight from the payloads (XORed into a small
    buffer); a multi-piece frame is gathered into scratch on first read -- and never, when the
    frame is stored raw and unsplit (its unchanged pieces then stay views of the payload).
    """

    def __init__(self, frame: Frame, s: EncodeSettings, scratch: Scratch) -> None:
        self.frame = frame
        self.scratch = scratch
        self.payload: U8 = s.payload.numpy()
        self.base_payload: U8 | None = None if s.base_payload is None else s.base_payload.numpy()
        specs = s.layout.specs
        self.ranges: list[tuple[int, int, int]] = []  # (payload offset, base offset or -1, n)
        for p in frame.pieces:
            b = s.base_offsets[p.spec]
            begin = specs[p.spec].offset + p.start
            self.ranges.append((begin, b + p.start if b >= 0 else -1, p.nbytes))
        self.single = len(self.ranges) == 1
        self.base: U8 | None = None
        if self.single:
            off, b, n = self.ranges[0]
            self.cur: U8 = self.payload[off : off + n]
            if b >= 0:
                assert self.base_payload is not None
                self.base = self.base_payload[b : b + n]
        self.gathered = False

    def _xor_into(self, off: int, b: int, n: int, out: U8) -> None:
        assert self.base_payload is not None
        np.bitwise_xor(self.payload[off : off + n], self.base_payload[b : b + n], out=out)

    def _gather(self) -> None:
        if self.single or self.gathered:
            return
        self.cur = self.scratch.data[: self.frame.nbytes]
        for p, (off, b, n) in zip(self.frame.pieces, self.ranges, strict=True):
            dst = self.cur[p.frame_offset : p.frame_offset + n]
            if b >= 0:
                self._xor_into(off, b, n, dst)
            else:
                np.copyto(dst, self.payload[off : off + n])
        self.gathered = True

    def read(self, start: int, end: int) -> U8:
        """Frame bytes ``[start, end)`` (at most one block when XORed: the result is reused)."""
        self._gather()
        if self.base is None:
            return self.cur[start:end]
        out = self.scratch.block[: end - start]
        np.bitwise_xor(self.cur[start:end], self.base[start:end], out=out)
        return out

    def whole(self) -> U8:
        """All frame bytes (valid until the scratch is reused)."""
        self._gather()
        if self.base is None:
            return self.cur
        out = self.scratch.data[: len(self.cur)]
        np.bitwise_xor(self.cur, self.base, out=out)
        return out

    def stored_copy(self, arena: OutputArena) -> list[Buffer]:
        """The frame bytes as parts that outlive the scratch (for raw, unsplit frames).

        Bytes that need no XOR are views of the payload (no copy); XORed bytes are fresh.
        """
        parts: list[Buffer] = []
        for p, (off, b, n) in zip(self.frame.pieces, self.ranges, strict=True):
            if b < 0:
                parts.append(self.payload[off : off + n].data)
                continue
            out = arena.take(n)
            if self.gathered:
                np.copyto(out, self.cur[p.frame_offset : p.frame_offset + n])
            else:
                self._xor_into(off, b, n, out)
            parts.append(out.data)
        return parts


def _sample(src: _Source, width: int, sample_bytes: int) -> list[U8]:
    """Per plane, ``sample_bytes`` bytes from 4 slices spread over the frame."""
    n = src.frame.nbytes // width
    take = sample_bytes // _SAMPLE_SLICES
    step = (n - take) / (_SAMPLE_SLICES - 1)
    windows = [
        src.read(round(i * step) * width, (round(i * step) + take) * width).copy()
        for i in range(_SAMPLE_SLICES)
    ]
    if width == 1:
        return [np.concatenate(windows)]
    return [np.concatenate([w.reshape(take, width)[:, j] for w in windows]) for j in range(width)]


def _pays(plane: U8, s: EncodeSettings) -> bytes | None:
    """The zstd frame of ``plane`` when it saves at least ``min_gain``, else None."""
    assert s.level
    packed = compressor(s.level, s.tuned).compress(plane.data)
    return packed if len(packed) <= len(plane) * (1.0 - s.min_gain) else None


def _compress(plane: U8, s: EncodeSettings, arena: OutputArena) -> PlaneOut | None:
    """``(ZSTD, [stored])`` when compressing pays, else None.

    The result is copied into ``arena``: python-zstandard returns ``bytes`` that keep their
    worst-case allocation (about the input size) however small the output, which would make a
    blob's memory the size of its raw input.
    """
    packed = _pays(plane, s)
    if packed is None:
        return None
    kept = arena.take(len(packed))
    kept[:] = np.frombuffer(packed, dtype=np.uint8)
    return ZSTD, [kept.data]


def encode_frame(
    frame: Frame, s: EncodeSettings, pool: ScratchPool, arena: OutputArena
) -> FrameOut:
    """Encode one frame: its stored planes and their digest.

    Raw planes of a frame that is stored unsplit and unchanged are views of the state's payload
    (zero copy); everything else is freshly allocated (raw planes from ``arena``).
    """
    scratch = pool.acquire()
    try:
        if s.use_torch:
            entries = _encode_on_device(frame, s, arena)
        else:
            entries = _encode_on_host(frame, s, scratch, arena)
    finally:
        pool.release(scratch)
    return entries, hash_parts(part for _, parts in entries for part in parts)


def _encode_on_host(
    frame: Frame, s: EncodeSettings, scratch: Scratch, arena: OutputArena
) -> list[PlaneOut]:
    width = frame.width
    n = frame.nbytes // width
    src = _Source(frame, s, scratch)
    if not s.level:
        if width == 1:
            return [(RAW, src.stored_copy(arena))]
        modes: list[int | None] = [RAW] * width
    elif n <= 2 * s.sample_bytes:
        modes = [None] * width  # small: compress whole, keep what pays
    else:
        samples = _sample(src, width, s.sample_bytes)
        modes = [ZSTD if _pays(sample, s) is not None else RAW for sample in samples]

    if width == 1:
        if modes[0] != RAW:
            entry = _compress(src.whole(), s, arena)
            if entry is not None:
                return [entry]
        return [(RAW, src.stored_copy(arena))]

    half = width // 2
    low = width in (4, 8, 16) and all(m == RAW for m in modes[:half])
    stored_modes: list[int | None] = [LOW, *modes[half:]] if low else modes
    dests: list[U8] = []
    used = 0
    for mode, size in zip(stored_modes, plane_sizes(width, n, low), strict=True):
        if mode in (RAW, LOW):
            dests.append(arena.take(size))
        else:
            dests.append(scratch.planes[used : used + size])
            used += size
    step = BLOCK_BYTES // width
    for e0 in range(0, n, step):
        e1 = min(n, e0 + step)
        block = src.read(e0 * width, e1 * width)
        if low:
            out = [dests[0][e0 * half : e1 * half]] + [d[e0:e1] for d in dests[1:]]
        else:
            out = [d[e0:e1] for d in dests]
        split_planes(block, width, out, scratch.split, low=low)
    result: list[PlaneOut] = []
    for mode, plane in zip(stored_modes, dests, strict=True):
        if mode in (LOW, RAW):
            result.append((mode, [plane.data]))
        else:
            entry = _compress(plane, s, arena)
            if entry is None:
                copy = arena.take(len(plane))
                np.copyto(copy, plane)
                entry = (RAW, [copy.data])
            result.append(entry)
    return result


def _encode_on_device(frame: Frame, s: EncodeSettings, arena: OutputArena) -> list[PlaneOut]:
    """XOR and split with torch on the payload's device; only the planes go to the host."""
    specs = s.layout.specs
    pieces = frame.pieces
    if len(pieces) == 1 and s.base_offsets[pieces[0].spec] < 0:
        begin = specs[pieces[0].spec].offset + pieces[0].start
        data = s.payload[begin : begin + frame.nbytes]
    else:
        data = torch.empty(frame.nbytes, dtype=torch.uint8, device=s.payload.device)
        for p in pieces:
            begin = specs[p.spec].offset + p.start
            src = s.payload[begin : begin + p.nbytes]
            dst = data[p.frame_offset : p.frame_offset + p.nbytes]
            base_offset = s.base_offsets[p.spec]
            if base_offset < 0:
                dst.copy_(src)
            else:
                assert s.base_payload is not None
                b = base_offset + p.start
                xor_bytes(src, s.base_payload[b : b + p.nbytes], dst)
    planes = split_planes_torch(data, frame.width).cpu().numpy()
    out: list[PlaneOut] = []
    for j in range(frame.width):
        plane = planes[j]
        entry = _compress(plane, s, arena) if s.level else None
        out.append(entry or (RAW, [plane.data]))
    return out


# --- decode -----------------------------------------------------------------------------------


def frame_entry_count(width: int, first_mode: int) -> int:
    """How many stored entries a frame has, given the mode of its first one."""
    return 1 + width - width // 2 if first_mode == LOW else width


@dataclass(frozen=True, slots=True)
class DecodeSettings:
    """What :func:`decode_frame` needs besides the frame (shared by all frames of a call).

    A whole decode writes into ``out`` at the layout's offsets and XORs with ``base_payload``
    at ``base_offsets``. A partial one (:mod:`.partial`) gives ``targets`` instead: per spec,
    the array that receives that tensor's bytes, or ``None`` for a tensor not wanted (its
    pieces are checked with their frame but not written); and, for a delta,
    ``base_targets``: per spec, the bytes of its base tensor (``None``: stored whole).
    """

    layout: Layout
    out: U8  # the raw payload being rebuilt (host memory)
    base_payload: U8 | None
    base_offsets: tuple[int, ...]
    targets: Sequence[U8 | None] | None = None
    base_targets: Sequence[U8 | None] | None = None

    def dest(self, p: Piece) -> U8 | None:
        """Where the bytes of piece ``p`` go (``None``: nowhere, not wanted)."""
        if self.targets is None:
            begin = self.layout.specs[p.spec].offset + p.start
            return self.out[begin : begin + p.nbytes]
        target = self.targets[p.spec]
        return None if target is None else target[p.start : p.start + p.nbytes]

    def base(self, p: Piece) -> U8 | None:
        """The base bytes piece ``p`` is XORed with (``None``: stored whole)."""
        if self.base_targets is not None:
            tensor = self.base_targets[p.spec]
            return None if tensor is None else tensor[p.start : p.start + p.nbytes]
        base_offset = self.base_offsets[p.spec]
        if base_offset < 0:
            return None
        assert self.base_payload is not None
        b = base_offset + p.start
        return self.base_payload[b : b + p.nbytes]


def _plane_bytes(mode: int, stored: memoryview, size: int) -> U8:
    if mode in (RAW, LOW):
        if len(stored) != size:
            raise FormatError(f"raw plane holds {len(stored)} bytes, expected {size}")
        return np.frombuffer(stored, dtype=np.uint8)
    if mode != ZSTD:
        raise FormatError(f"unknown plane mode {mode}")
    try:
        content = zstandard.frame_content_size(stored)
        if content != size:
            raise FormatError(f"zstd plane holds {content} bytes, expected {size}")
        return np.frombuffer(decompressor().decompress(stored), dtype=np.uint8)
    except zstandard.ZstdError as exc:
        raise FormatError(f"corrupt zstd plane: {exc}") from exc


def decode_frame(
    frame: Frame,
    stored: memoryview,
    entries: Sequence[tuple[int, int]],
    digest: int,
    *,
    s: DecodeSettings,
    pool: ScratchPool,
) -> None:
    """Check one frame's stored bytes against ``digest``, then rebuild them into ``s.out``.

    ``stored`` is the frame's bytes in the body; ``entries`` its ``(mode, size)`` pairs.
    """
    if xxhash.xxh3_64_intdigest(stored) != digest:
        raise ChecksumMismatch("a frame of the blob does not match its digest: the blob is corrupt")
    width = frame.width
    n = frame.nbytes // width
    low = entries[0][0] == LOW
    if low and width not in (4, 8, 16):
        raise FormatError(f"a frame of {width}-byte elements cannot have a low half")
    sizes = plane_sizes(width, n, low)
    if len(entries) != len(sizes) or any(m == LOW for m, _ in entries[1:]):
        raise FormatError(f"frame has {len(entries)} planes, expected {len(sizes)}")
    planes: list[U8] = []
    pos = 0
    for (mode, size), want in zip(entries, sizes, strict=True):
        planes.append(_plane_bytes(mode, stored[pos : pos + size], want))
        pos += size
    pieces = frame.pieces
    scratch = pool.acquire()
    try:
        if len(pieces) == 1:
            # Join block by block straight into the payload and XOR each block while it is hot.
            p = pieces[0]
            target = s.dest(p)
            if target is None:
                return
            base = s.base(p)
            if width == 1:
                if base is None:
                    np.copyto(target, planes[0])
                else:
                    np.bitwise_xor(planes[0], base, out=target)
                return
            half = width // 2
            step = BLOCK_BYTES // width
            for e0 in range(0, n, step):
                e1 = min(n, e0 + step)
                block = target[e0 * width : e1 * width]
                if low:
                    parts = [planes[0][e0 * half : e1 * half]] + [q[e0:e1] for q in planes[1:]]
                else:
                    parts = [q[e0:e1] for q in planes]
                join_planes(parts, width, block, scratch.split, low=low)
                if base is not None:
                    np.bitwise_xor(block, base[e0 * width : e1 * width], out=block)
            return
        gathered = scratch.data[: frame.nbytes]
        join_planes(planes, width, gathered, scratch.split, low=low)
        for p in pieces:
            dst = s.dest(p)
            if dst is None:
                continue
            src = gathered[p.frame_offset : p.frame_offset + p.nbytes]
            base = s.base(p)
            if base is not None:
                np.bitwise_xor(src, base, out=dst)
            else:
                np.copyto(dst, src)
    finally:
        pool.release(scratch)
