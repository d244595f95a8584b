"""The blob encoders: full blobs (the payload as is) and packed ones (xor, planes, zstd).

The format they write is :mod:`.blobformat`'s; :mod:`.decoder` reads it back.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from types import MappingProxyType
from typing import Any

import numpy as np
import torch

from tiercheck.codec.format.blobformat import (
    FORMAT_MAJOR,
    FORMAT_MINOR,
    HEAD,
    KIND_FULL,
    KIND_PACKED,
    LAYOUT_FIELD,
    MAGIC,
    MODE_BITS,
    PREAMBLE_NBYTES,
    BlobMeta,
    byte_view,
    check_ints,
    chunks_bytes,
    chunks_key,
    full_header,
    header_region,
    holds,
    layout_bytes,
    pack_header,
    parse,
    read_head,
    seal,
)
from tiercheck.codec.format.digest import chunk_count, chunk_digests, tree_root
from tiercheck.codec.format.layout import Layout, align
from tiercheck.codec.format.stages import FlattenStage, PlanesStage, Stage, XorStage, ZstdStage
from tiercheck.codec.options import CodecOptions
from tiercheck.codec.packed.delta import match_base
from tiercheck.codec.packed.frames import (
    Buffer,
    EncodeSettings,
    Frame,
    FrameOut,
    encode_frame,
    plan_frames,
)
from tiercheck.codec.rawstate import RawState
from tiercheck.codec.resources import OutputArena, ScratchPool, run_bounded
from tiercheck.defaults import Encoding, encoding_kind
from tiercheck.errors import FormatError

__all__ = [
    "encode",
    "encode_full",
    "encode_packed",
    "finalize_full_blob",
    "full_blob_size",
    "write_full_blob",
]


# --- full blobs ------------------------------------------------------------------------------


def full_blob_size(layout: Layout, *, version: int, rank: int) -> tuple[int, int]:
    """``(total blob size, payload offset)`` of the full blob of ``layout``."""
    check_ints(version, rank)
    region = header_region(full_header(layout, version, rank, _reserved_chunks(layout)))
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
    check_ints(version, rank)
    view = byte_view(dest)
    if view.readonly:
        raise ValueError("dest must be writable")
    header = full_header(layout, version, rank, _reserved_chunks(layout))
    region = header_region(header)
    offset = PREAMBLE_NBYTES + len(region)
    if len(view) != offset + layout.payload_nbytes:
        raise ValueError(
            f"dest holds {len(view)} bytes; this blob is {offset + layout.payload_nbytes}"
        )
    head = HEAD.pack(
        MAGIC, FORMAT_MAJOR, FORMAT_MINOR, KIND_FULL, len(header), layout.payload_nbytes
    )
    preamble = seal(head, region, 0, 0)
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
    (:func:`~tiercheck.codec.format.digest.chunk_digests`) -- nothing is hashed but the header: the
    caller vouches for them (wrong ones make every later read fail); ``raw_digest``, if given
    too, must be their root. Without them the payload is hashed once (in parallel threads on
    ``executor``), and a ``raw_digest`` given alone must match the result
    (:class:`ValueError` otherwise: the payload is not what the caller hashed).
    """
    view = byte_view(dest)
    if view.readonly:
        raise ValueError("dest must be writable")
    head, header_nbytes, body_nbytes, kind = read_head(view)
    if kind != KIND_FULL:
        raise FormatError("finalize_full_blob needs a full blob written by write_full_blob")
    offset = align(PREAMBLE_NBYTES + header_nbytes)
    if len(view) != offset + body_nbytes:
        raise FormatError(f"blob holds {len(view)} bytes; its header says {offset + body_nbytes}")
    count = chunk_count(body_nbytes)
    header_end = PREAMBLE_NBYTES + header_nbytes
    room = 8 * count
    key = chunks_key(room)
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
    view[header_end - room : header_end] = chunks_bytes(leaves)
    view[:PREAMBLE_NBYTES] = seal(head, view[PREAMBLE_NBYTES:offset], digest, digest)
    # ``known``: (layout, version, rank) the blob was written with (write_full_blob), so the
    # header need not be decoded again to describe it.
    return parse(view, len(view), known)


def encode_full(state: RawState, *, rank: int) -> tuple[list[Buffer], BlobMeta]:
    """The full blob of ``state`` as parts: ``[preamble + header, payload view]``.

    No payload byte is copied or hashed (``state.raw_digest`` and ``state.chunk_digests`` are
    trusted): the second part is a view of ``state.payload``, valid while it is unchanged. The
    blob stores the state's chunk digests when it has them (:func:`snapshot` and
    :func:`decode` keep them), and has none otherwise.
    """
    check_ints(state.version, rank)
    if state.payload.device.type != "cpu":
        raise ValueError(f"encode_full needs a host payload, got one on {state.payload.device}")
    layout = state.layout
    leaves = state.chunk_digests
    header = full_header(
        layout, state.version, rank, None if leaves is None else chunks_bytes(leaves)
    )
    region = header_region(header)
    head = HEAD.pack(
        MAGIC, FORMAT_MAJOR, FORMAT_MINOR, KIND_FULL, len(header), layout.payload_nbytes
    )
    prefix = seal(head, region, state.raw_digest, state.raw_digest) + region
    body = state.payload.numpy().data if layout.payload_nbytes else memoryview(b"")
    parts: list[Buffer] = [prefix, body]
    total = len(prefix) + layout.payload_nbytes
    return parts, parse(byte_view(prefix), total, (layout, state.version, rank))


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
    check_ints(state.version, rank)
    layout = state.layout
    layout_bytes(layout)  # refuses a non-canonical layout before any work
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
            table.append(sum(len(x) for x in stored) << MODE_BITS | mode)
    body_nbytes = sum(len(p) for p in parts)
    header_obj: dict[str, Any] = {
        "version": state.version,
        "rank": rank,
        "stages": [[s.name, s.params()] for s in stages],
        "layout": LAYOUT_FIELD,
        "holds": holds(layout),
        "frame_bytes": options.frame_bytes,
        "table": np.asarray(table, dtype="<u8").tobytes(),
        "digests": np.asarray(leaves, dtype="<u8").tobytes(),
    }
    if matches is not None:
        header_obj["delta"] = np.asarray(matches, dtype="<i8").tobytes()
    header = pack_header(header_obj, layout)
    region = header_region(header)
    body_digest = tree_root(leaves, body_nbytes)
    head = HEAD.pack(MAGIC, FORMAT_MAJOR, FORMAT_MINOR, KIND_PACKED, len(header), body_nbytes)
    prefix = seal(head, region, state.raw_digest, body_digest) + region
    return [prefix, *parts], parse(byte_view(prefix), len(prefix) + body_nbytes)


def _digest_chunks(data: memoryview, executor: Executor | None) -> list[int]:
    # For functions whose parameter ``chunk_digests`` hides the function of that name.
    return chunk_digests(data, executor=executor)


# --- by name ---------------------------------------------------------------------------------

#: An encoder: ``(state, rank, base, options, executor) -> (parts, meta)``.
Encoder = Callable[
    [RawState, int, RawState | None, CodecOptions, Executor | None],
    tuple[list[Buffer], BlobMeta],
]


def _full(
    state: RawState,
    rank: int,
    base: RawState | None,
    options: CodecOptions,
    executor: Executor | None,
) -> tuple[list[Buffer], BlobMeta]:
    # Stored as is: no base, nothing to tune, no work for the executor.
    return encode_full(state, rank=rank)


def _packed(
    state: RawState,
    rank: int,
    base: RawState | None,
    options: CodecOptions,
    executor: Executor | None,
) -> tuple[list[Buffer], BlobMeta]:
    return encode_packed(state, rank=rank, base=base, options=options, executor=executor)


#: Each encoding's encoder (:data:`tiercheck.defaults.ENCODING_KINDS` names them all).
ENCODERS: Mapping[Encoding, Encoder] = MappingProxyType({"full": _full, "packed": _packed})


def encode(
    state: RawState,
    encoding: str,
    *,
    rank: int,
    base: RawState | None = None,
    options: CodecOptions = CodecOptions(),  # noqa: B008 -- frozen, so sharing it is safe
    executor: Executor | None = None,
) -> tuple[list[Buffer], BlobMeta]:
    """``state`` as a blob in ``encoding`` (a name of :data:`~tiercheck.defaults.ENCODINGS`),
    as parts: :func:`encode_full` or :func:`encode_packed` (a delta against ``base`` where the
    encoding takes one). :class:`ValueError` for a name that is no encoding.

    An encoding stored as is (:attr:`~tiercheck.defaults.EncodingKind.as_is`) does no work
    worth a thread; the others do, and release the GIL while they do it.
    """
    return ENCODERS[encoding_kind(encoding).name](state, rank, base, options, executor)
