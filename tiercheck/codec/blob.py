"""Blobs: one rank's state of one version as bytes -- the format, the encoders, the decoder.

Byte layout (format 1; every integer little-endian)::

    offset size  field
    0      8     magic  b"\\x89TCKPT\\r\\n"  (high byte, CR LF: catch 7-bit and text-mode damage)
    8      2     format major version (1) -- a reader refuses any other major
    10     2     format minor version (1) -- additions a 1.0 reader may ignore
    12     1     kind: 1 = full (raw payload as is), 2 = packed (xor/planes/zstd pipeline)
    13     3     reserved, zero
    16     8     header_nbytes: length of the msgpack header
    24     8     body_nbytes
    32     8     raw_digest: tree digest of the raw payload this blob decodes to
    40     8     body_digest: digest of the body (see below)
    48     8     header_digest: xxh3_64(bytes 0..32 ++ header region)
    56     8     checksum: xxh3_64(bytes 0..56) -- the blob's identity
    64     ...   header region: msgpack header, zero-padded to a multiple of 64
    ...    ...   body (starts at a multiple of 64): full -> the raw payload; packed -> the frames

The checksum is the root of a small hash tree over everything: bytes 0..32 directly, the header
region through ``header_digest``, the body through ``body_digest``. A reader recomputes all of
them, so any changed bit -- in the body, the header, a length field or the checksum field
itself -- is a :class:`~tiercheck.errors.ChecksumMismatch` (or a
:class:`~tiercheck.errors.FormatError` where the magic, version or lengths no longer parse).

``body_digest`` is :func:`~.digest.tree_root` over leaves: for a full blob the 8 MiB chunks of
the body, which *is* the raw payload -- so ``body_digest == raw_digest``, and sealing a full
blob costs one parallel hash pass over the payload, or none when its digest is known; for a
packed blob one xxh3_64 per frame (listed in the header), so every frame is hashed by the thread
that encodes or decodes it, and checked before it is decompressed.

Header (a msgpack map): ``version``, ``rank``, ``stages`` (``[name, params]`` pairs, see
:mod:`.stages`), ``layout`` (``[skeleton, [[path, dtype name, shape], ...]]``; offsets are
recomputed, so a layout read back is always canonical). Full blobs of format 1.1 add
``chunks``, the last key: the leaves of ``body_digest`` (one little-endian u64 per 8 MiB chunk
of the body), so that a reader of part of the body checks the chunks it reads alone
(:mod:`.partial`); a 1.0 reader ignores it, and a 1.0 full blob (or one encoded from a state
whose leaves were not kept) has none -- its parts can only be checked by hashing the whole body.
Being last, with a size fixed by the payload's, the field can be laid out before the payload is
written and filled in when the blob is sealed (:func:`write_full_blob`,
:func:`finalize_full_blob`). Packed blobs add ``frame_bytes`` (the
frame plan, :func:`~.frames.plan_frames`, is recomputed from it and the layout), ``table`` (one
little-endian u64 per stored plane, frame after frame: ``stored_nbytes << 2 | mode``, mode 0 =
raw, 1 = zstd, 2 = the raw low half of each element, first in its frame; the planes are stored
back to back in that order), ``digests`` (one little-endian u64 per frame) and, for deltas,
``delta`` (one little-endian i64 per tensor: the index of its base tensor, or -1 if stored
whole).
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Literal

import msgpack
import numpy as np
import numpy.typing as npt
import torch
import xxhash

from tiercheck.codec.delta import match_base
from tiercheck.codec.digest import DIGEST_CHUNK, chunk_count, chunk_digests, tree_root
from tiercheck.codec.dtypes import dtype_from_name
from tiercheck.codec.flatten import Layout, align, flatten, write_payload
from tiercheck.codec.frames import (
    Buffer,
    DecodeSettings,
    EncodeSettings,
    Frame,
    FrameOut,
    decode_frame,
    encode_frame,
    frame_entry_count,
    plan_frames,
)
from tiercheck.codec.options import CodecOptions
from tiercheck.codec.rebuild import unflatten
from tiercheck.codec.resources import OutputArena, ScratchPool, run_bounded
from tiercheck.codec.stages import (
    FlattenStage,
    PlanesStage,
    Stage,
    XorStage,
    ZstdStage,
    parse_stage,
)
from tiercheck.errors import BaseMismatch, ChecksumMismatch, FormatError, UnsupportedFormat

__all__ = [
    "FORMAT_MAJOR",
    "FORMAT_MINOR",
    "MAGIC",
    "BaseRef",
    "BlobMeta",
    "RawState",
    "decode",
    "encode_full",
    "encode_packed",
    "finalize_full_blob",
    "full_blob_size",
    "host_buffer",
    "read_meta",
    "snapshot",
    "verify",
    "write_full_blob",
]

MAGIC = b"\x89TCKPT\r\n"
FORMAT_MAJOR = 1
FORMAT_MINOR = 1
PREAMBLE_NBYTES = 64
_HEAD = struct.Struct("<8sHHB3xQQ")  # bytes 0..32
_DIGESTS = struct.Struct("<QQQQ")  # bytes 32..64
_KIND_FULL = 1
_KIND_PACKED = 2
_KINDS: dict[int, Literal["full", "packed"]] = {_KIND_FULL: "full", _KIND_PACKED: "packed"}
_MODE_BITS = 2


def host_buffer(nbytes: int) -> torch.Tensor:
    """A fresh uint8 host tensor of ``nbytes``, cheap to fault in.

    Allocated by numpy, which asks the kernel for transparent huge pages on large arrays:
    first-touch page faults then cost about 9 GB/s instead of about 2 GB/s for torch's own
    allocator (measured on the dev VM), which matters for every fresh decode.
    """
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.from_numpy(np.empty(nbytes, dtype=np.uint8))


def _byte_view(blob: Buffer) -> memoryview:
    view = memoryview(blob)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


@dataclass(frozen=True, slots=True)
class BaseRef:
    """The base a delta was encoded against: its version and the digest of its raw payload."""

    version: int
    raw_digest: int


@dataclass(frozen=True)
class _PackedInfo:
    frame_bytes: int
    planes: bool
    table: npt.NDArray[np.uint64]
    digests: npt.NDArray[np.uint64]
    delta: tuple[int, ...] | None


@dataclass(frozen=True)
class BlobMeta:
    """What a blob's preamble and header say; :func:`read_meta` reads it without the body.

    ``kind`` is ``"full"`` (the raw payload stored as is) or ``"packed"`` (delta / planes / zstd
    pipeline). ``base`` is set for deltas. ``raw_digest`` is the digest of the raw payload the
    blob decodes to (:func:`~tiercheck.codec.raw_digest`), ``checksum`` the blob's own identity
    (the root of its hash tree, see :mod:`.blob`), ``nbytes`` the blob's size. Beyond the
    contract: ``body_offset`` / ``body_digest`` locate and seal the body, ``stage_objects``
    holds the parsed stages with their parameters. ``chunk_digests``: for a full blob of format
    1.1, the digest of each 8 MiB chunk of its body (``None`` where the blob has none).
    """

    kind: Literal["full", "packed"]
    version: int
    rank: int
    base: BaseRef | None
    raw_digest: int
    checksum: int
    stages: tuple[str, ...]
    nbytes: int
    layout: Layout
    body_offset: int = 0
    body_digest: int = 0
    stage_objects: tuple[Stage, ...] = ()
    chunk_digests: tuple[int, ...] | None = field(default=None, repr=False, compare=False)
    _packed: _PackedInfo | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class RawState:
    """A state as its raw payload: what encoders read and :func:`decode` returns.

    ``payload`` is a contiguous uint8 1-D tensor of exactly ``layout.payload_nbytes`` bytes and
    ``raw_digest`` its :func:`~tiercheck.codec.raw_digest` -- build one with :func:`snapshot`, or
    compute the digest yourself: encoders trust it, and decoding checks it end to end.
    ``chunk_digests``, when known, are the leaves of that digest
    (:func:`~tiercheck.codec.digest.chunk_digests`): :func:`encode_full` then stores them, so
    that parts of the blob can be checked alone. They must add up to ``raw_digest`` (checked
    here, without reading the payload).

    The payload normally lives in host memory. :func:`encode_packed` also takes one on a GPU
    (its XOR and plane split then run there; the digest must come from a host copy, as
    :func:`~tiercheck.codec.raw_digest` reads host memory); :func:`decode` always returns a
    host payload.
    """

    version: int
    layout: Layout
    payload: torch.Tensor
    raw_digest: int
    chunk_digests: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        p = self.payload
        if p.dtype != torch.uint8 or p.dim() != 1 or not p.is_contiguous():
            raise ValueError(
                f"payload must be a contiguous 1-D uint8 tensor, got {p.dtype} {tuple(p.shape)}"
            )
        if p.numel() != self.layout.payload_nbytes:
            raise ValueError(
                f"payload holds {p.numel()} bytes; the layout has {self.layout.payload_nbytes}"
            )
        leaves = self.chunk_digests
        if leaves is not None and (
            len(leaves) != chunk_count(p.numel()) or tree_root(leaves, p.numel()) != self.raw_digest
        ):
            raise ValueError("chunk_digests do not add up to raw_digest")

    def tensors(self) -> list[torch.Tensor]:
        """Typed views of every tensor in the payload (no copy; they share its memory)."""
        return self.layout.views(self.payload)

    def state(self, *, allow_pickle: bool = False) -> Any:
        """The nested state, rebuilt around views of the payload (no copy).

        The state's tensors live in ``payload``: copy them (or
        :func:`~tiercheck.statetree.load_into` a live state) before the payload's memory is reused.
        """
        return unflatten(self.layout, self.tensors(), allow_pickle=allow_pickle)


def snapshot(
    state: Any,
    *,
    version: int,
    out: torch.Tensor | None = None,
    allow_pickle: bool = False,
    executor: Executor | None = None,
) -> RawState:
    """Flatten ``state``, copy it into a raw payload (``out`` or a new host buffer), digest it.

    A convenience for callers without their own staging buffers (tests, tools, benchmarks).
    """
    layout, tensors = flatten(state, allow_pickle=allow_pickle)
    n = layout.payload_nbytes
    dest = host_buffer(n) if out is None else out[:n]
    write_payload(layout, tensors, dest)
    leaves = chunk_digests(dest, executor=executor)
    return RawState(version, layout, dest, tree_root(leaves, n), tuple(leaves))


# --- header -----------------------------------------------------------------------------------


def _pack(obj: Any) -> bytes:
    data = msgpack.packb(obj, use_bin_type=True)
    assert isinstance(data, bytes)
    return data


_PACKER = msgpack.Packer(use_bin_type=True)
_ARRAY_OF_2 = _PACKER.pack_array_header(2)


def _layout_bytes(layout: Layout) -> bytes:
    """The msgpack encoding of ``[skeleton, [[path, dtype name, shape], ...]]``.

    Built from the layout's cached tensor table (:attr:`Layout.packed_entries`): the table of a
    state with thousands of tensors is encoded once, not at every save.
    """
    if not layout.is_canonical():
        raise ValueError("layout offsets are not the canonical ones (build layouts with flatten)")
    return _ARRAY_OF_2 + _pack(layout.skeleton) + layout.packed_entries


_INT_ONLY = {int}


def _layout_from_obj(obj: Any) -> Layout:
    if not isinstance(obj, list) or len(obj) != 2 or type(obj[0]) is not bytes:
        raise FormatError("malformed layout in blob header")
    skeleton, specs = obj
    if not isinstance(specs, list):
        raise FormatError("malformed layout in blob header")
    entries: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    dtypes: dict[str, torch.dtype] = {}
    for entry in specs:
        if (
            type(entry) is not list
            or len(entry) != 3
            or type(entry[0]) is not str
            or type(entry[1]) is not str
            or type(entry[2]) is not list
            # set(map(type, ...)): the element check without a Python-level loop
            or (entry[2] and (not _INT_ONLY.issuperset(map(type, entry[2])) or min(entry[2]) < 0))
        ):
            raise FormatError(f"malformed tensor entry {entry!r} in blob header")
        dtype = dtypes.get(entry[1])
        if dtype is None:
            dtype = dtype_from_name(entry[1])
            if dtype is None:
                raise UnsupportedFormat(
                    f"blob holds a tensor of dtype {entry[1]!r}, which this build of torch lacks"
                )
            dtypes[entry[1]] = dtype
        entries.append((entry[0], dtype, tuple(entry[2])))
    layout = Layout.build(skeleton, entries)
    if len(layout.index) != len(layout.specs):
        raise FormatError("blob header lists a tensor path twice")
    return layout


#: Stands for the layout among the fields of a header (see :func:`_pack_header`).
_LAYOUT = object()


def _pack_header(fields: dict[str, Any], layout: Layout) -> bytes:
    """``_pack(fields)`` where the value :data:`_LAYOUT` stands for the layout's encoding.

    A msgpack map is its header followed by each key and value encoded on their own, so the
    result is byte for byte what packing the whole dictionary gives.
    """
    out = [_PACKER.pack_map_header(len(fields))]
    for key, value in fields.items():
        out.append(_pack(key))
        out.append(_layout_bytes(layout) if value is _LAYOUT else _pack(value))
    return b"".join(out)


def _seal(head: bytes, header_region: Buffer, raw: int, body: int) -> bytes:
    """The 64-byte preamble for ``head`` (bytes 0..32), given the header region and digests."""
    hasher = xxhash.xxh3_64(head)
    hasher.update(header_region)
    header_digest = hasher.intdigest()
    first56 = head + struct.pack("<QQQ", raw, body, header_digest)
    return first56 + struct.pack("<Q", xxhash.xxh3_64_intdigest(first56))


def _header_region(header: bytes) -> bytes:
    pad = align(PREAMBLE_NBYTES + len(header)) - PREAMBLE_NBYTES - len(header)
    return header + bytes(pad)


def _full_header(layout: Layout, version: int, rank: int, chunks: bytes | None) -> bytes:
    """The header of a full blob; ``chunks``: its chunk digests' bytes (``None``: left out).

    ``chunks`` comes last, so its bytes are the header's last ``len(chunks)`` bytes.
    """
    stage = FlattenStage.for_layout(layout.has_dtensors, layout.has_refs)
    fields: dict[str, Any] = {
        "version": version,
        "rank": rank,
        "stages": [[stage.name, stage.params()]],
        "layout": _LAYOUT,
    }
    if chunks is not None:
        fields["chunks"] = chunks
    return _pack_header(fields, layout)


def _chunks_bytes(leaves: Sequence[int]) -> bytes:
    return np.asarray(leaves, dtype="<u8").tobytes()


def _chunks_key(nbytes: int) -> bytes:
    """What precedes ``nbytes`` bytes of chunk digests at the end of a full header."""
    # msgpack's bin 8 / bin 16 / bin 32 headers (the Packer has no call for a header alone).
    if nbytes < 1 << 8:
        head = struct.pack(">BB", 0xC4, nbytes)
    elif nbytes < 1 << 16:
        head = struct.pack(">BH", 0xC5, nbytes)
    else:
        head = struct.pack(">BI", 0xC6, nbytes)
    return _pack("chunks") + head


def _check_ints(version: int, rank: int) -> None:
    if type(version) is not int or not -(1 << 63) <= version < (1 << 63):
        raise ValueError(f"version must be a 64-bit int, got {version!r}")
    if type(rank) is not int or not 0 <= rank < (1 << 32):
        raise ValueError(f"rank must be an int in [0, 2**32), got {rank!r}")


# --- full blobs ------------------------------------------------------------------------------


def full_blob_size(layout: Layout, *, version: int, rank: int) -> tuple[int, int]:
    """``(total blob size, payload offset)`` of the full blob of ``layout``."""
    _check_ints(version, rank)
    region = _header_region(_full_header(layout, version, rank, _reserved_chunks(layout)))
    offset = PREAMBLE_NBYTES + len(region)
    return offset + layout.payload_nbytes, offset


def _reserved_chunks(layout: Layout) -> bytes:
    """Zeroed room for the chunk digests, filled in by :func:`finalize_full_blob`."""
    return bytes(8 * chunk_count(layout.payload_nbytes))


def write_full_blob(
    dest: memoryview | bytearray, layout: Layout, *, version: int, rank: int
) -> int:
    """Write the preamble and header of a full blob into ``dest``; return the payload offset.

    ``dest`` is writable and exactly :func:`full_blob_size` bytes. The caller then writes the
    raw payload into ``dest[offset:]`` (:func:`~.flatten.write_payload` over
    ``torch.frombuffer``) and seals the blob with :func:`finalize_full_blob`. Until then the
    digest and checksum fields are zero, so an unsealed blob never verifies. The header holds
    zeroed room for the chunk digests (format 1.1), filled in when the blob is sealed.
    """
    _check_ints(version, rank)
    view = _byte_view(dest)
    if view.readonly:
        raise ValueError("dest must be writable")
    header = _full_header(layout, version, rank, _reserved_chunks(layout))
    region = _header_region(header)
    offset = PREAMBLE_NBYTES + len(region)
    if len(view) != offset + layout.payload_nbytes:
        raise ValueError(
            f"dest holds {len(view)} bytes; this blob is {offset + layout.payload_nbytes}"
        )
    head = _HEAD.pack(
        MAGIC, FORMAT_MAJOR, FORMAT_MINOR, _KIND_FULL, len(header), layout.payload_nbytes
    )
    preamble = _seal(head, region, 0, 0)
    view[:PREAMBLE_NBYTES] = preamble[:48] + bytes(16)  # digests stay zero until finalized
    view[PREAMBLE_NBYTES:offset] = region
    return offset


def finalize_full_blob(
    dest: memoryview | bytearray,
    *,
    raw_digest: int | None = None,
    chunk_digests: Sequence[int] | None = None,
    executor: Executor | None = None,
    known: tuple[Layout, int, int] | None = None,
) -> BlobMeta:
    """Seal a full blob once its payload is written: chunk digests, digest fields, checksum.

    With ``chunk_digests`` -- the payload's leaves, as the caller computed them for its digest
    (:func:`~tiercheck.codec.digest.chunk_digests`) -- nothing is hashed but the header: the
    caller vouches for them (wrong ones make every later read fail); ``raw_digest``, if given
    too, must be their root. Without them the payload is hashed once (in parallel threads on
    ``executor``), and a ``raw_digest`` given alone must match the result
    (:class:`ValueError` otherwise: the payload is not what the caller hashed).
    """
    view = _byte_view(dest)
    if view.readonly:
        raise ValueError("dest must be writable")
    head, header_nbytes, body_nbytes, kind = _read_head(view)
    if kind != _KIND_FULL:
        raise FormatError("finalize_full_blob needs a full blob written by write_full_blob")
    offset = align(PREAMBLE_NBYTES + header_nbytes)
    if len(view) != offset + body_nbytes:
        raise FormatError(f"blob holds {len(view)} bytes; its header says {offset + body_nbytes}")
    count = chunk_count(body_nbytes)
    header_end = PREAMBLE_NBYTES + header_nbytes
    room = 8 * count
    key = _chunks_key(room)
    if header_nbytes < room + len(key) or (
        view[header_end - room - len(key) : header_end - room] != key
    ):
        raise FormatError("finalize_full_blob needs a full blob written by write_full_blob")
    if chunk_digests is None:
        leaves = _digest_chunks(view[offset:], executor)
        if raw_digest is not None and tree_root(leaves, body_nbytes) != raw_digest:
            raise ValueError(
                "raw_digest is not the digest of the payload written in the blob (was the "
                "payload changed after it was hashed?)"
            )
    else:
        leaves = list(chunk_digests)
        if len(leaves) != count:
            raise ValueError(f"{len(leaves)} chunk digests for a payload of {count} chunks")
        if raw_digest is not None and tree_root(leaves, body_nbytes) != raw_digest:
            raise ValueError("chunk_digests do not add up to raw_digest")
    digest = tree_root(leaves, body_nbytes)
    view[header_end - room : header_end] = _chunks_bytes(leaves)
    view[:PREAMBLE_NBYTES] = _seal(head, view[PREAMBLE_NBYTES:offset], digest, digest)
    # ``known``: (layout, version, rank) the blob was written with (write_full_blob), so the
    # header need not be decoded again to describe it.
    return _parse(view, len(view), known)


def encode_full(state: RawState, *, rank: int) -> tuple[list[Buffer], BlobMeta]:
    """The full blob of ``state`` as parts: ``[preamble + header, payload view]``.

    No payload byte is copied or hashed (``state.raw_digest`` and ``state.chunk_digests`` are
    trusted): the second part is a view of ``state.payload``, valid while it is unchanged. The
    blob stores the state's chunk digests when it has them (:func:`snapshot` and
    :func:`decode` keep them), and has none otherwise.
    """
    _check_ints(state.version, rank)
    if state.payload.device.type != "cpu":
        raise ValueError(f"encode_full needs a host payload, got one on {state.payload.device}")
    layout = state.layout
    leaves = state.chunk_digests
    header = _full_header(
        layout, state.version, rank, None if leaves is None else _chunks_bytes(leaves)
    )
    region = _header_region(header)
    head = _HEAD.pack(
        MAGIC, FORMAT_MAJOR, FORMAT_MINOR, _KIND_FULL, len(header), layout.payload_nbytes
    )
    prefix = _seal(head, region, state.raw_digest, state.raw_digest) + region
    body = state.payload.numpy().data if layout.payload_nbytes else memoryview(b"")
    parts: list[Buffer] = [prefix, body]
    total = len(prefix) + layout.payload_nbytes
    return parts, _parse(_byte_view(prefix), total, (layout, state.version, rank))


# --- packed blobs ----------------------------------------------------------------------------


def _use_torch_path(device: torch.device) -> bool:
    """Frames of payloads off the host run XOR and the plane split with torch on the device."""
    return device.type != "cpu"


def encode_packed(
    state: RawState,
    *,
    rank: int,
    base: RawState | None = None,
    options: CodecOptions = CodecOptions(),  # noqa: B008 -- frozen, so sharing it is safe
    executor: Executor | None = None,
) -> tuple[list[Buffer], BlobMeta]:
    """Encode ``state`` as a packed blob (a delta against ``base`` when given); returns its parts.

    Pipeline per frame (:mod:`.frames`), frames in parallel on ``executor`` (or a pool of
    ``options.workers`` threads), at most ``options.workers`` at a time: gather the frame's
    tensor bytes, XORed with the same tensor of ``base`` where one exists (same path, dtype and
    shape; others are stored whole), split into byte planes, zstd each plane where a sample
    says it pays. A payload on a GPU is XORed and split on the GPU; only planes cross to the
    host.

    Memory: besides the output, at most ``options.workers`` frames are in flight, each with
    scratch buffers of ``2 * frame_bytes + 3 MiB`` (frame bytes, planes bound for zstd, one
    XORed block, split temporaries), a compressed plane in transit (up to ``frame_bytes``) and
    zstd's context (about 1 MiB at level 1); the output is carved from 8 MiB blocks. In all,
    roughly ``workers * (3 * frame_bytes + 4 MiB) + 8 MiB`` on top of the output -- bounded by
    the frame size, not the state size (``tests/codec/test_blob.py`` checks it). The output
    holds the stored planes; a raw, unsplit frame of an unchanged tensor is a view of
    ``state.payload``, so keep the payload unchanged until the parts are consumed.

    ``executor`` must not be the pool running this call (waiting on one's own pool can
    deadlock).
    """
    _check_ints(state.version, rank)
    layout = state.layout
    _layout_bytes(layout)  # refuses a non-canonical layout before any work
    device = state.payload.device
    stages: list[Stage] = [FlattenStage.for_layout(layout.has_dtensors, layout.has_refs)]
    matches: list[int] | None = None
    base_offsets = (-1,) * len(layout.specs)
    if base is not None:
        if base.payload.device != device:
            raise ValueError(f"base payload is on {base.payload.device}, state on {device}")
        stages.append(XorStage(base.version, base.raw_digest))
        matches = match_base(layout, base.layout)
        base_offsets = tuple(base.layout.specs[j].offset if j >= 0 else -1 for j in matches)
    # Planes only help the entropy stage: without it they would just reorder bytes.
    planes = options.planes and options.entropy
    if planes:
        stages.append(PlanesStage())
    if options.level:
        stages.append(ZstdStage(options.level, options.tuned))

    frames = plan_frames(layout, options.frame_bytes, planes)
    settings = EncodeSettings(
        layout=layout,
        payload=state.payload,
        base_payload=None if base is None else base.payload,
        base_offsets=base_offsets,
        level=options.level or None,
        tuned=options.tuned,
        sample_bytes=options.sample_bytes,
        min_gain=options.min_gain,
        use_torch=_use_torch_path(device),
    )
    pool = ScratchPool(options.frame_bytes)
    arena = OutputArena(layout.payload_nbytes)

    def work(frame: Frame) -> FrameOut:
        return encode_frame(frame, settings, pool, arena)

    results = run_bounded(work, frames, workers=options.workers, executor=executor)
    parts: list[Buffer] = []
    table: list[int] = []
    leaves: list[int] = []
    for entries, leaf in results:
        leaves.append(leaf)
        for mode, stored in entries:
            parts.extend(stored)
            table.append(sum(len(x) for x in stored) << _MODE_BITS | mode)
    body_nbytes = sum(len(p) for p in parts)
    header_obj: dict[str, Any] = {
        "version": state.version,
        "rank": rank,
        "stages": [[s.name, s.params()] for s in stages],
        "layout": _LAYOUT,
        "frame_bytes": options.frame_bytes,
        "table": np.asarray(table, dtype="<u8").tobytes(),
        "digests": np.asarray(leaves, dtype="<u8").tobytes(),
    }
    if matches is not None:
        header_obj["delta"] = np.asarray(matches, dtype="<i8").tobytes()
    header = _pack_header(header_obj, layout)
    region = _header_region(header)
    body_digest = tree_root(leaves, body_nbytes)
    head = _HEAD.pack(MAGIC, FORMAT_MAJOR, FORMAT_MINOR, _KIND_PACKED, len(header), body_nbytes)
    prefix = _seal(head, region, state.raw_digest, body_digest) + region
    return [prefix, *parts], _parse(_byte_view(prefix), len(prefix) + body_nbytes)


# --- reading ---------------------------------------------------------------------------------


def _read_head(view: memoryview) -> tuple[bytes, int, int, int]:
    """Check magic and major version; return (bytes 0..32, header_nbytes, body_nbytes, kind)."""
    if len(view) < PREAMBLE_NBYTES:
        raise FormatError(f"blob of {len(view)} bytes is shorter than the 64-byte preamble")
    head = bytes(view[:32])
    magic, major, _minor, kind, header_nbytes, body_nbytes = _HEAD.unpack(head)
    if magic != MAGIC:
        raise FormatError(f"not a tiercheck blob (magic {magic!r}, expected {MAGIC!r})")
    if major != FORMAT_MAJOR:
        raise UnsupportedFormat(
            f"blob format {major}.x; this build of tiercheck reads format {FORMAT_MAJOR}.x"
        )
    return head, header_nbytes, body_nbytes, kind


def _parse(view: memoryview, total: int, known: tuple[Layout, int, int] | None = None) -> BlobMeta:
    """Parse and check preamble and header; ``total`` is the full blob size (body may be absent
    from ``view``).

    ``known`` is ``(layout, version, rank)`` of a full blob the caller has just written: when
    the header holds exactly the bytes :func:`_full_header` makes of them, it is not decoded
    again (a header of thousands of tensor entries, at every save). Every digest is checked
    all the same.
    """
    head, header_nbytes, body_nbytes, kind = _read_head(view)
    raw, body_digest, header_digest, checksum = _DIGESTS.unpack(bytes(view[32:64]))
    if xxhash.xxh3_64_intdigest(view[:56]) != checksum:
        raise ChecksumMismatch(
            "blob preamble does not match its checksum: the blob is corrupt; read another copy"
        )
    if kind not in _KINDS or bytes(view[13:16]) != b"\0\0\0":
        raise FormatError(f"bad blob kind {kind} or reserved bytes")
    offset = align(PREAMBLE_NBYTES + header_nbytes)
    if total != offset + body_nbytes:
        raise FormatError(
            f"blob holds {total} bytes; its preamble says {offset + body_nbytes} (truncated?)"
        )
    if len(view) < offset:
        raise FormatError("blob is shorter than its header")
    hasher = xxhash.xxh3_64(head)
    hasher.update(view[PREAMBLE_NBYTES:offset])
    if hasher.intdigest() != header_digest:
        raise ChecksumMismatch("blob header does not match its digest: the blob is corrupt")
    if known is not None and kind == _KIND_FULL:
        known_layout, known_version, known_rank = known
        header_end = PREAMBLE_NBYTES + header_nbytes
        room = 8 * chunk_count(body_nbytes)
        chunks = bytes(view[header_end - room : header_end]) if room <= header_nbytes else b""
        leaves = np.frombuffer(chunks, dtype="<u8").tolist() if len(chunks) == room else []
        if (
            len(chunks) == room
            and view[PREAMBLE_NBYTES:header_end]
            == _full_header(known_layout, known_version, known_rank, chunks)
            and raw == body_digest
            and body_nbytes == known_layout.payload_nbytes
            and tree_root(leaves, body_nbytes) == body_digest
        ):
            stage = FlattenStage.for_layout(known_layout.has_dtensors, known_layout.has_refs)
            return BlobMeta(
                kind="full",
                version=known_version,
                rank=known_rank,
                base=None,
                raw_digest=raw,
                checksum=checksum,
                stages=(stage.name,),
                nbytes=total,
                layout=known_layout,
                body_offset=offset,
                body_digest=body_digest,
                stage_objects=(stage,),
                chunk_digests=tuple(leaves),
            )
    try:
        header = msgpack.unpackb(view[PREAMBLE_NBYTES : PREAMBLE_NBYTES + header_nbytes], raw=False)
    except (msgpack.UnpackException, ValueError) as exc:
        raise FormatError(f"malformed blob header: {exc}") from exc
    if not isinstance(header, dict):
        raise FormatError("malformed blob header")
    stages_obj = header.get("stages")
    if not isinstance(stages_obj, list) or not all(
        isinstance(s, list) and len(s) == 2 for s in stages_obj
    ):
        raise FormatError("malformed stage list in blob header")
    # Unknown stages first: a newer writer's blob says so, rather than "malformed".
    stages = tuple(parse_stage(name, params) for name, params in stages_obj)
    version, rank = header.get("version"), header.get("rank")
    if type(version) is not int or type(rank) is not int:
        raise FormatError("blob header lacks version or rank")
    layout = _layout_from_obj(header.get("layout"))
    if stages and isinstance(stages[0], FlattenStage):
        # Only blobs naming flatten/3 hold replica references (the writer names /3 exactly
        # then): known without scanning the skeleton, which a restore would do once per blob.
        layout.__dict__["has_refs"] = stages[0].major == 3
    kinds = [type(s) for s in stages]
    base: BaseRef | None = None
    packed: _PackedInfo | None = None
    chunk_leaves: tuple[int, ...] | None = None
    if kind == _KIND_FULL:
        if kinds != [FlattenStage] or raw != body_digest or body_nbytes != layout.payload_nbytes:
            raise FormatError("inconsistent full blob header")
        stored = header.get("chunks")
        if stored is not None:
            if type(stored) is not bytes or len(stored) != 8 * chunk_count(body_nbytes):
                raise FormatError("bad chunk digests in blob header")
            chunk_leaves = tuple(np.frombuffer(stored, dtype="<u8").tolist())
            if tree_root(chunk_leaves, body_nbytes) != body_digest:
                raise FormatError("chunk digests in the header do not add up to the body digest")
    else:
        if kinds not in _PACKED_STAGE_ORDERS:
            raise FormatError(f"unexpected stage sequence {[s.name for s in stages]}")
        frame_bytes, table, delta, digests = (
            header.get(k) for k in ("frame_bytes", "table", "delta", "digests")
        )
        if type(frame_bytes) is not int or frame_bytes < 4096 or frame_bytes % 64:
            raise FormatError(f"bad frame size {frame_bytes!r} in blob header")
        if type(table) is not bytes or len(table) % 8:
            raise FormatError("bad frame table in blob header")
        if type(digests) is not bytes or len(digests) % 8:
            raise FormatError("bad frame digests in blob header")
        leaves = np.frombuffer(digests, dtype="<u8")
        if tree_root(leaves.tolist(), body_nbytes) != body_digest:
            raise FormatError("frame digests in the header do not add up to the body digest")
        matches: tuple[int, ...] | None = None
        xor = next((s for s in stages if isinstance(s, XorStage)), None)
        if xor is not None:
            if type(delta) is not bytes or len(delta) != 8 * len(layout.specs):
                raise FormatError("bad delta map in blob header")
            matches = tuple(np.frombuffer(delta, dtype="<i8").tolist())
            base = BaseRef(xor.base_version, xor.base_digest)
        packed = _PackedInfo(
            frame_bytes=frame_bytes,
            planes=PlanesStage in kinds,
            table=np.frombuffer(table, dtype="<u8"),
            digests=leaves,
            delta=matches,
        )
    return BlobMeta(
        kind=_KINDS[kind],
        version=version,
        rank=rank,
        base=base,
        raw_digest=raw,
        checksum=checksum,
        stages=tuple(s.name for s in stages),
        nbytes=total,
        layout=layout,
        body_offset=offset,
        body_digest=body_digest,
        stage_objects=stages,
        chunk_digests=chunk_leaves,
        _packed=packed,
    )


_PACKED_STAGE_ORDERS = [
    [FlattenStage, *xor, *planes, *zstd]
    for xor in ([], [XorStage])
    for planes in ([], [PlanesStage])
    for zstd in ([], [ZstdStage])
]


def read_meta(blob: Buffer) -> BlobMeta:
    """Read a blob's preamble and header (cheap: the body is not read).

    Raises :class:`~tiercheck.errors.FormatError` for bytes that are not a blob (bad magic,
    truncated, inconsistent sizes), :class:`~tiercheck.errors.UnsupportedFormat` for a format or
    stage version this build cannot read, and :class:`~tiercheck.errors.ChecksumMismatch` when
    the preamble or header fails its digest.
    """
    view = _byte_view(blob)
    return _parse(view, len(view))


def verify(blob: Buffer, *, executor: Executor | None = None) -> BlobMeta:
    """Check the whole blob against its checksum without decoding; return its meta.

    One parallel hash pass over the body. Raises what :func:`read_meta` raises, and
    :class:`~tiercheck.errors.ChecksumMismatch` when the body does not match.
    """
    view = _byte_view(blob)
    meta = _parse(view, len(view))
    body = view[meta.body_offset :]
    if meta._packed is None:
        if tree_root(_digest_chunks(body, executor), len(body)) != meta.body_digest:
            raise _corrupt(meta)
        return meta
    jobs = _frame_jobs(meta, meta._packed, body)

    def check(job: _FrameJob) -> bool:
        return xxhash.xxh3_64_intdigest(job.stored) == job.digest

    if not all(run_bounded(check, jobs, workers=os.cpu_count() or 1, executor=executor)):
        raise _corrupt(meta)
    return meta


def _digest_chunks(data: memoryview, executor: Executor | None) -> list[int]:
    # For functions whose parameter ``chunk_digests`` hides the function of that name.
    return chunk_digests(data, executor=executor)


def _corrupt(meta: BlobMeta) -> ChecksumMismatch:
    return ChecksumMismatch(
        f"blob of version {meta.version} rank {meta.rank} does not match its checksum "
        f"{meta.checksum:#018x}: the blob is corrupt; read another copy"
    )


@dataclass(frozen=True, slots=True)
class _FrameJob:
    frame: Frame
    stored: memoryview  # the frame's bytes in the body
    entries: list[tuple[int, int]]  # (mode, size) per stored plane
    digest: int


@dataclass(frozen=True, slots=True)
class FrameExtent:
    """Where one frame of a packed blob lies in its body, and what checks it."""

    frame: Frame
    start: int  # offset in the body
    nbytes: int
    entries: list[tuple[int, int]]  # (mode, size) per stored plane
    digest: int


def _frame_jobs(meta: BlobMeta, info: _PackedInfo, body: memoryview) -> list[_FrameJob]:
    """Where each frame of a packed blob lies in the body, from the frame table."""
    return [
        _FrameJob(e.frame, body[e.start : e.start + e.nbytes], e.entries, e.digest)
        for e in frame_extents(meta, info)
    ]


def frame_extents(meta: BlobMeta, info: _PackedInfo) -> list[FrameExtent]:
    """Where each frame of a packed blob lies in its body, from the frame table (no body read)."""
    body_nbytes = meta.nbytes - meta.body_offset
    frames = plan_frames(meta.layout, info.frame_bytes, info.planes)
    if len(info.digests) != len(frames):
        raise FormatError(f"blob has {len(info.digests)} frame digests for {len(frames)} frames")
    sizes = (info.table >> np.uint64(_MODE_BITS)).tolist()
    modes = (info.table & np.uint64((1 << _MODE_BITS) - 1)).tolist()
    digests = info.digests.tolist()
    jobs: list[FrameExtent] = []
    pos = k = 0
    for frame, digest in zip(frames, digests, strict=True):
        if k >= len(modes):
            raise FormatError("frame table is shorter than the frame plan")
        count = frame_entry_count(frame.width, modes[k])
        entries = list(zip(modes[k : k + count], sizes[k : k + count], strict=False))
        if len(entries) != count:
            raise FormatError("frame table is shorter than the frame plan")
        nbytes = sum(size for _, size in entries)
        jobs.append(FrameExtent(frame, pos, nbytes, entries, digest))
        pos += nbytes
        k += count
    if k != len(modes) or pos != body_nbytes:
        raise FormatError(
            f"frame table covers {k} planes and {pos} bytes; the blob has {len(modes)} and "
            f"{body_nbytes}"
        )
    return jobs


def _check_base(meta: BlobMeta, base: RawState | None) -> None:
    if meta.base is None:
        return
    want = meta.base
    if base is None:
        raise BaseMismatch(
            f"blob of version {meta.version} is a delta against version {want.version} "
            f"(raw digest {want.raw_digest:#018x}); decode it with that base"
        )
    if base.version != want.version or base.raw_digest != want.raw_digest:
        raise BaseMismatch(
            f"blob of version {meta.version} is a delta against version {want.version} "
            f"(raw digest {want.raw_digest:#018x}), but the base given is version "
            f"{base.version} (raw digest {base.raw_digest:#018x})"
        )
    if base.payload.device.type != "cpu":
        raise ValueError(f"decode needs the base payload in host memory, got {base.payload.device}")


def _out_buffer(out: torch.Tensor | None, n: int, base: RawState | None) -> torch.Tensor:
    if out is None:
        return host_buffer(n)
    if out.device.type != "cpu" or out.dtype != torch.uint8 or out.dim() != 1:
        raise ValueError("out must be a 1-D uint8 host tensor")
    if out.numel() < n or not out.is_contiguous() or out.storage_offset() % 16:
        raise ValueError(f"out must hold {n} contiguous bytes starting at a multiple of 16")
    dest = out[:n]
    if (
        base is not None
        and n
        and base.payload.numel()
        and np.may_share_memory(dest.numpy(), base.payload.numpy())
    ):
        raise ValueError("out must not overlap the base payload")
    return dest


def decode(
    blob: Buffer,
    *,
    base: RawState | None = None,
    executor: Executor | None = None,
    out: torch.Tensor | None = None,
    threads: int = 0,
    meta: BlobMeta | None = None,
) -> RawState:
    """Decode a blob into a :class:`RawState`, verified end to end.

    Checks, in order: the blob's format and header (:func:`read_meta`), the base (a delta needs
    exactly the base it was encoded against -- same version and raw digest -- else
    :class:`~tiercheck.errors.BaseMismatch`, also when ``base`` is missing), the body against its
    checksum (for a packed blob frame by frame, each before it is decompressed), and finally the
    rebuilt raw payload against ``meta.raw_digest``
    (:class:`~tiercheck.errors.ChecksumMismatch`). A decoded state is therefore bit-exact or an
    error, never silently different.

    The payload is written into ``out[:payload_nbytes]`` when given (a uint8 host tensor that
    must not overlap ``base.payload``). For a full blob without ``out``: a *writable* blob
    (``bytearray``, writable ``memoryview`` or mmap) is not copied at all -- the payload is a
    view of the blob's memory, valid while the blob is and changed if the blob is; a read-only
    blob (``bytes``) is copied once. Packed frames decode in parallel on ``executor`` (or a pool
    of ``threads`` threads, ``0`` = ``os.cpu_count()``). When decoding fails after the checks
    on the header, ``out`` may hold partly written bytes.

    ``meta``: what :func:`read_meta` returned for this very blob, if the caller has it (its
    header is then not parsed a second time -- thousands of tensor entries); the body is still
    verified here as always.
    """
    view = _byte_view(blob)
    if meta is None or meta.nbytes != len(view):
        meta = _parse(view, len(view))
    _check_base(meta, base)
    layout = meta.layout
    n = layout.payload_nbytes
    body = view[meta.body_offset :]
    if meta.kind == "full":
        if out is None and not view.readonly and n:
            payload = torch.frombuffer(body, dtype=torch.uint8)
        else:
            payload = _out_buffer(out, n, None)
            if n:
                np.copyto(payload.numpy(), np.frombuffer(body, dtype=np.uint8))
        # One pass: the body digest of a full blob is its raw digest.
        leaves = chunk_digests(payload, executor=executor)
        digest = tree_root(leaves, n)
        if digest != meta.raw_digest:
            raise _corrupt(meta)
        return RawState(meta.version, layout, payload, digest, tuple(leaves))

    info = meta._packed
    assert info is not None
    payload = _out_buffer(out, n, base)
    leaves = _decode_packed(
        body,
        meta=meta,
        info=info,
        base=base,
        payload=payload,
        executor=executor,
        workers=threads or os.cpu_count() or 1,
    )
    digest = tree_root(leaves, n)
    if digest != meta.raw_digest:
        raise ChecksumMismatch(
            f"decoded payload of version {meta.version} rank {meta.rank} does not match the "
            "digest recorded at encode time (a wrong base, or a bug): refusing it"
        )
    return RawState(meta.version, layout, payload, digest, tuple(leaves))


def _decode_packed(
    body: memoryview,
    *,
    meta: BlobMeta,
    info: _PackedInfo,
    base: RawState | None,
    payload: torch.Tensor,
    executor: Executor | None,
    workers: int,
) -> list[int]:
    """Rebuild the payload frame by frame; return the leaves of its raw digest.

    The digest is computed on the way: each 8 MiB chunk of the payload is hashed by the worker
    that finishes the last frame writing into it, while those bytes are still in cache, instead
    of in a separate pass over the whole payload afterwards.
    """
    layout = meta.layout
    jobs = _frame_jobs(meta, info, body)

    base_offsets = (-1,) * len(layout.specs)
    base_np = None
    if info.delta is not None:
        assert base is not None
        base_specs = base.layout.specs
        offsets = []
        for spec, j in zip(layout.specs, info.delta, strict=True):
            if j < 0:
                offsets.append(-1)
                continue
            if j >= len(base_specs) or (base_specs[j].dtype, base_specs[j].shape) != (
                spec.dtype,
                spec.shape,
            ):
                raise FormatError(f"delta map points {spec.path} at a different base tensor")
            offsets.append(base_specs[j].offset)
        base_offsets = tuple(offsets)
        base_np = base.payload.numpy()

    out_np = payload.numpy()
    for start, end in layout.gaps:
        out_np[start:end] = 0
    settings = DecodeSettings(layout, out_np, base_np, base_offsets)
    pool = ScratchPool(info.frame_bytes)

    n = layout.payload_nbytes
    chunk = DIGEST_CHUNK
    leaves = [0] * ((n + chunk - 1) // chunk)
    waiting = [0] * len(leaves)  # frames still to write into each chunk
    touched: list[list[int]] = []  # per frame: the chunks it writes into
    for job in jobs:
        chunks: set[int] = set()
        for p in job.frame.pieces:
            begin = layout.specs[p.spec].offset + p.start
            chunks.update(range(begin // chunk, (begin + p.nbytes - 1) // chunk + 1))
        for c in chunks:
            waiting[c] += 1
        touched.append(sorted(chunks))
    lock = threading.Lock()

    def hash_chunk(c: int) -> None:
        leaves[c] = xxhash.xxh3_64_intdigest(out_np[c * chunk : (c + 1) * chunk].data)

    for c, count in enumerate(waiting):
        if count == 0:  # padding only: final already
            hash_chunk(c)

    def work(index: int) -> None:
        job = jobs[index]
        decode_frame(job.frame, job.stored, job.entries, job.digest, s=settings, pool=pool)
        ready = []
        with lock:
            for c in touched[index]:
                waiting[c] -= 1
                if waiting[c] == 0:
                    ready.append(c)
        for c in ready:
            hash_chunk(c)

    run_bounded(work, range(len(jobs)), workers=workers, executor=executor)
    return leaves
