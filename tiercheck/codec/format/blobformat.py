"""The blob format: the preamble and header of one rank's state of one version, and their parse.

Byte layout (format 1; every integer little-endian)::

    offset size  field
    0      8     magic  b"\\x89TCKPT\\r\\n"  (high byte, CR LF: catch 7-bit and text-mode damage)
    8      2     format major version (1) -- a reader refuses any other major
    10     2     format minor version (2) -- additions a 1.0 reader may ignore
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
recomputed, so a layout read back is always canonical). Format 1.2 adds ``holds``: which of
``"arrays"``, ``"dtensors"`` and ``"refs"`` the skeleton holds (numpy arrays, DTensor records,
replica references), so that a reader knows how a blob can be restored without walking a
skeleton of thousands of entries first; a reader of an older blob walks it. Full blobs of format
1.1 add
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

This module holds the format -- the constants, :class:`BlobMeta`, building a header and
sealing a preamble, and :func:`parse` (what :func:`read_meta` and every reader run first); the
encoders are in :mod:`.encoder`, decoding and verification in :mod:`.decoder`, and
:mod:`.blob` gathers their public names.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import numpy.typing as npt
import xxhash

from tiercheck.codec.format.digest import chunk_count, tree_root
from tiercheck.codec.format.layout import Layout, align, layout_from_header
from tiercheck.codec.format.stages import (
    FlattenStage,
    PlanesStage,
    Stage,
    XorStage,
    ZstdStage,
    parse_stage,
)
from tiercheck.codec.packed.frames import Buffer, Frame, frame_entry_count, plan_frames
from tiercheck.defaults import ENCODING_KINDS, Encoding, EncodingKind, encoding_kind
from tiercheck.errors import ChecksumMismatch, FormatError, UnsupportedFormat

__all__ = [
    "DIGESTS",
    "FORMAT_MAJOR",
    "FORMAT_MINOR",
    "HEAD",
    "HOLDS",
    "KINDS",
    "KIND_FULL",
    "KIND_PACKED",
    "LAYOUT_FIELD",
    "MAGIC",
    "MODE_BITS",
    "PREAMBLE_NBYTES",
    "BaseRef",
    "BlobMeta",
    "FrameExtent",
    "PackedInfo",
    "byte_view",
    "check_ints",
    "chunks_bytes",
    "chunks_key",
    "frame_extents",
    "full_header",
    "header_region",
    "holds",
    "layout_bytes",
    "pack_header",
    "parse",
    "read_head",
    "read_meta",
    "seal",
]

#: The first 8 bytes of every blob.
MAGIC = b"\x89TCKPT\r\n"
#: The format version written; a reader refuses another major.
FORMAT_MAJOR = 1
FORMAT_MINOR = 2
#: The fixed part before the header: magic, versions, kind, lengths, digests, checksum.
PREAMBLE_NBYTES = 64
#: Bytes 0..32 of the preamble: magic, major, minor, kind, header_nbytes, body_nbytes.
HEAD = struct.Struct("<8sHHB3xQQ")
#: Bytes 32..64: raw_digest, body_digest, header_digest, checksum.
DIGESTS = struct.Struct("<QQQQ")
#: The kinds by their byte, as :attr:`BlobMeta.kind` names them
#: (:data:`tiercheck.defaults.ENCODING_KINDS` gives each its byte).
KINDS: dict[int, Encoding] = {k.header_byte: k.name for k in ENCODING_KINDS.values()}
#: The kind byte of a full blob (the raw payload as is) and of a packed one.
KIND_FULL = ENCODING_KINDS["full"].header_byte
KIND_PACKED = ENCODING_KINDS["packed"].header_byte
#: Low bits of a frame table entry that hold the plane's mode (the rest: its stored size).
MODE_BITS = 2


def byte_view(blob: Buffer) -> memoryview:
    """``blob`` as a flat memoryview of bytes (no copy)."""
    view = memoryview(blob)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


@dataclass(frozen=True, slots=True)
class BaseRef:
    """The base a delta was encoded against: its version and the digest of its raw payload."""

    version: int
    raw_digest: int


@dataclass(frozen=True)
class PackedInfo:
    """What the header of a packed blob says about its body: frame size, whether planes are
    split, the frame table (one u64 per stored plane), the frame digests and the delta map."""

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

    kind: Encoding
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
    _packed: PackedInfo | None = field(default=None, repr=False, compare=False)

    @property
    def packed(self) -> PackedInfo | None:
        """The body's frame table and digests for a packed blob (``None`` for a full one)."""
        return self._packed

    @property
    def encoding(self) -> EncodingKind:
        """What the blob's encoding decides (:class:`~tiercheck.defaults.EncodingKind`)."""
        return encoding_kind(self.kind)


# --- header -----------------------------------------------------------------------------------


def _pack(obj: Any) -> bytes:
    data = msgpack.packb(obj, use_bin_type=True)
    assert isinstance(data, bytes)
    return data


_PACKER = msgpack.Packer(use_bin_type=True)
_ARRAY_OF_2 = _PACKER.pack_array_header(2)


def layout_bytes(layout: Layout) -> bytes:
    """The msgpack encoding of ``[skeleton, [[path, dtype name, shape], ...]]``.

    Built from the layout's cached tensor table (:attr:`Layout.packed_entries`): the table of a
    state with thousands of tensors is encoded once, not at every save.
    """
    if not layout.is_canonical():
        raise ValueError("layout offsets are not the canonical ones (build layouts with flatten)")
    return _ARRAY_OF_2 + _pack(layout.skeleton) + layout.packed_entries


#: Stands for the layout among the fields of a header (see :func:`pack_header`).
LAYOUT_FIELD = object()


def pack_header(fields: dict[str, Any], layout: Layout) -> bytes:
    """``_pack(fields)`` where the value :data:`LAYOUT_FIELD` stands for the layout's encoding.

    A msgpack map is its header followed by each key and value encoded on their own, so the
    result is byte for byte what packing the whole dictionary gives.
    """
    out = [_PACKER.pack_map_header(len(fields))]
    for key, value in fields.items():
        out.append(_pack(key))
        out.append(layout_bytes(layout) if value is LAYOUT_FIELD else _pack(value))
    return b"".join(out)


def seal(head: bytes, header_region: Buffer, raw: int, body: int) -> bytes:
    """The 64-byte preamble for ``head`` (bytes 0..32), given the header region and digests."""
    hasher = xxhash.xxh3_64(head)
    hasher.update(header_region)
    header_digest = hasher.intdigest()
    first56 = head + struct.pack("<QQQ", raw, body, header_digest)
    return first56 + struct.pack("<Q", xxhash.xxh3_64_intdigest(first56))


def header_region(header: bytes) -> bytes:
    """``header`` zero-padded so that the body after it starts at a multiple of 64."""
    pad = align(PREAMBLE_NBYTES + len(header)) - PREAMBLE_NBYTES - len(header)
    return header + bytes(pad)


def full_header(layout: Layout, version: int, rank: int, chunks: bytes | None) -> bytes:
    """The header of a full blob; ``chunks``: its chunk digests' bytes (``None``: left out).

    ``chunks`` comes last, so its bytes are the header's last ``len(chunks)`` bytes.
    """
    stage = FlattenStage.for_layout(layout.has_dtensors, layout.has_refs)
    fields: dict[str, Any] = {
        "version": version,
        "rank": rank,
        "stages": [[stage.name, stage.params()]],
        "layout": LAYOUT_FIELD,
        "holds": holds(layout),
    }
    if chunks is not None:
        fields["chunks"] = chunks
    return pack_header(fields, layout)


#: What a skeleton may hold that decides how its blob is restored, as ``holds`` names it.
HOLDS = ("arrays", "dtensors", "refs")


def holds(layout: Layout) -> list[str]:
    """The header's ``holds`` field of ``layout``: the :data:`HOLDS` its skeleton holds (known
    for layouts :func:`~tiercheck.codec.encode.flatten.flatten` made; else the skeleton is walked
    once)."""
    return [name for name in HOLDS if getattr(layout, f"has_{name}")]


def _learn_holds(layout: Layout, stage: Stage | None, field: Any) -> None:
    """Tell ``layout`` what its skeleton holds, from its header's ``holds`` field (format 1.2)
    or, for an older blob, from its flatten stage as far as that says."""
    known = layout.__dict__
    if type(field) is list and all(type(name) is str for name in field):
        for name in HOLDS:
            known[f"has_{name}"] = name in field
    if isinstance(stage, FlattenStage):
        # The stage has the last word where it speaks (the decoder goes by it): only blobs
        # naming flatten/3 hold replica references (the writer names /3 exactly then), and /1
        # names a blob without DTensors or references.
        known["has_refs"] = stage.major == 3
        if stage.major == 1:
            known["has_dtensors"] = False


def chunks_bytes(leaves: Sequence[int]) -> bytes:
    """The chunk digests ``leaves`` as a full header stores them (little-endian u64s)."""
    return np.asarray(leaves, dtype="<u8").tobytes()


def chunks_key(nbytes: int) -> bytes:
    """What precedes ``nbytes`` bytes of chunk digests at the end of a full header."""
    # msgpack's bin 8 / bin 16 / bin 32 headers (the Packer has no call for a header alone).
    if nbytes < 1 << 8:
        head = struct.pack(">BB", 0xC4, nbytes)
    elif nbytes < 1 << 16:
        head = struct.pack(">BH", 0xC5, nbytes)
    else:
        head = struct.pack(">BI", 0xC6, nbytes)
    return _pack("chunks") + head


def check_ints(version: int, rank: int) -> None:
    """Refuse (``ValueError``) a version or rank the header cannot hold."""
    if type(version) is not int or not -(1 << 63) <= version < (1 << 63):
        raise ValueError(f"version must be a 64-bit int, got {version!r}")
    if type(rank) is not int or not 0 <= rank < (1 << 32):
        raise ValueError(f"rank must be an int in [0, 2**32), got {rank!r}")


# --- reading ---------------------------------------------------------------------------------


def read_head(view: memoryview) -> tuple[bytes, int, int, int]:
    """Check magic and major version; return (bytes 0..32, header_nbytes, body_nbytes, kind)."""
    if len(view) < PREAMBLE_NBYTES:
        raise FormatError(f"blob of {len(view)} bytes is shorter than the 64-byte preamble")
    head = bytes(view[:32])
    magic, major, _minor, kind, header_nbytes, body_nbytes = HEAD.unpack(head)
    if magic != MAGIC:
        raise FormatError(f"not a tiercheck blob (magic {magic!r}, expected {MAGIC!r})")
    if major != FORMAT_MAJOR:
        raise UnsupportedFormat(
            f"blob format {major}.x; this build of tiercheck reads format {FORMAT_MAJOR}.x"
        )
    return head, header_nbytes, body_nbytes, kind


def parse(view: memoryview, total: int, known: tuple[Layout, int, int] | None = None) -> BlobMeta:
    """Parse and check preamble and header; ``total`` is the full blob size (body may be absent
    from ``view``).

    ``known`` is ``(layout, version, rank)`` of a full blob the caller has just written: when
    the header holds exactly the bytes :func:`full_header` makes of them, it is not decoded
    again (a header of thousands of tensor entries, at every save). Every digest is checked
    all the same.
    """
    head, header_nbytes, body_nbytes, kind = read_head(view)
    raw, body_digest, header_digest, checksum = DIGESTS.unpack(bytes(view[32:64]))
    if xxhash.xxh3_64_intdigest(view[:56]) != checksum:
        raise ChecksumMismatch(
            "blob preamble does not match its checksum: the blob is corrupt; read another copy"
        )
    if kind not in KINDS or bytes(view[13:16]) != b"\0\0\0":
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
    if known is not None and kind == KIND_FULL:
        known_layout, known_version, known_rank = known
        header_end = PREAMBLE_NBYTES + header_nbytes
        room = 8 * chunk_count(body_nbytes)
        chunks = bytes(view[header_end - room : header_end]) if room <= header_nbytes else b""
        leaves = np.frombuffer(chunks, dtype="<u8").tolist() if len(chunks) == room else []
        if (
            len(chunks) == room
            and view[PREAMBLE_NBYTES:header_end]
            == full_header(known_layout, known_version, known_rank, chunks)
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
    layout = layout_from_header(header.get("layout"))
    _learn_holds(layout, stages[0] if stages else None, header.get("holds"))
    kinds = [type(s) for s in stages]
    base: BaseRef | None = None
    packed: PackedInfo | None = None
    chunk_leaves: tuple[int, ...] | None = None
    if kind == KIND_FULL:
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
        packed = PackedInfo(
            frame_bytes=frame_bytes,
            planes=PlanesStage in kinds,
            table=np.frombuffer(table, dtype="<u8"),
            digests=leaves,
            delta=matches,
        )
    return BlobMeta(
        kind=KINDS[kind],
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
    view = byte_view(blob)
    return parse(view, len(view))


@dataclass(frozen=True, slots=True)
class FrameExtent:
    """Where one frame of a packed blob lies in its body, and what checks it."""

    frame: Frame
    start: int  # offset in the body
    nbytes: int
    entries: list[tuple[int, int]]  # (mode, size) per stored plane
    digest: int


def frame_extents(meta: BlobMeta, info: PackedInfo) -> list[FrameExtent]:
    """Where each frame of a packed blob lies in its body, from the frame table (no body read)."""
    body_nbytes = meta.nbytes - meta.body_offset
    frames = plan_frames(meta.layout, info.frame_bytes, info.planes)
    if len(info.digests) != len(frames):
        raise FormatError(f"blob has {len(info.digests)} frame digests for {len(frames)} frames")
    sizes = (info.table >> np.uint64(MODE_BITS)).tolist()
    modes = (info.table & np.uint64((1 << MODE_BITS) - 1)).tolist()
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
