"""The manifest's records and the journal's on-disk format (frames).

A journal is a sequence of *frames*: a 16-byte header (magic ``TCMJ``, body length, xxh32 of the
body, xxh32 of the 12 header bytes before it) and a msgpack body. The first frame of a journal
is its format (``{"meta": {"format": 1, "compacted": n}}``); every other holds the records of one
:meth:`~tiercheck.consistency.manifest.Manifest.append` (``{"records": [...]}``). The header's
own checksum tells a damaged length (corruption) from a file that ends inside a frame (an append
cut short). :func:`pack_frame` writes one, :func:`parse_frames` reads them back.

The records (:class:`Begin`, :class:`Written`, :class:`Commit`, :class:`Evict`,
:class:`Abort`) are importable from :mod:`tiercheck.consistency.manifest` too, where they are
described.
"""

from __future__ import annotations

import dataclasses
import struct
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import msgpack
import xxhash

from tiercheck.errors import ManifestError

__all__ = [
    "FORMAT_VERSION",
    "HEADER",
    "MAGIC",
    "MAX_FRAME",
    "RECORDS_PER_FRAME",
    "Abort",
    "Begin",
    "Commit",
    "Evict",
    "Parsed",
    "Record",
    "Written",
    "pack_frame",
    "parse_frames",
    "parse_record",
    "record_fields",
]

FORMAT_VERSION = 1

# A frame: magic, body length, xxh32 of the body, xxh32 of the 12 bytes before; then the body.
# The header's own checksum tells a damaged length (corruption) from a file that ends inside a
# frame (an append cut short: ignored, then cut off by the next writer).
HEADER = struct.Struct(">4sIII")
MAGIC = b"TCMJ"
#: No frame is larger (a compaction writes the kept records in frames of at most this).
MAX_FRAME = 1 << 24
#: A compaction writes the records it keeps in frames of this many.
RECORDS_PER_FRAME = 10_000


@dataclass(frozen=True, slots=True)
class Begin:
    """A rank started saving ``version``."""

    op: ClassVar[str] = "begin"
    version: int
    rank: int
    kind: Literal["base", "delta"]
    base: int | None = None
    time: float = 0.0


@dataclass(frozen=True, slots=True)
class Written:
    """A rank's blob of ``version`` is written to ``tier`` (any tier; its op keeps the name
    ``"durable"`` it had before, so that manifests already on disk read the same)."""

    op: ClassVar[str] = "durable"
    version: int
    rank: int
    tier: str
    key: str
    size: int
    checksum: int
    raw_digest: int
    #: The base version this blob is a delta against, or ``None`` for a self-contained blob.
    base: int | None = None
    time: float = 0.0


@dataclass(frozen=True, slots=True)
class Commit:
    """``version`` is committed in ``tier``: whole for every rank, base included."""

    op: ClassVar[str] = "commit"
    version: int
    tier: str
    time: float = 0.0


@dataclass(frozen=True, slots=True)
class Evict:
    """A rank removed its blob of ``version`` from ``tier``."""

    op: ClassVar[str] = "evict"
    version: int
    rank: int
    tier: str
    reason: str = "retention"
    time: float = 0.0


@dataclass(frozen=True, slots=True)
class Abort:
    """A rank gave up ``version``: the whole save (skipped, or its staging or encoding failed)."""

    op: ClassVar[str] = "abort"
    version: int
    rank: int
    reason: str
    time: float = 0.0


Record = Begin | Written | Commit | Evict | Abort
_RECORD_TYPES: dict[str, type[Record]] = {
    cls.op: cls for cls in (Begin, Written, Commit, Evict, Abort)
}


_FIELDS: dict[type[Record], tuple[dataclasses.Field[Any], ...]] = {
    cls: dataclasses.fields(cls) for cls in _RECORD_TYPES.values()
}


def pack_frame(body: dict[str, Any]) -> bytes:
    """One frame of the journal holding ``body`` (:class:`ManifestError` when it is over
    :data:`MAX_FRAME`)."""
    data = msgpack.packb(body, use_bin_type=True)
    if len(data) > MAX_FRAME:
        raise ManifestError(f"a manifest append of {len(data)} bytes is over {MAX_FRAME}")
    head = HEADER.pack(MAGIC, len(data), xxhash.xxh32_intdigest(data), 0)[:12]
    return head + struct.pack(">I", xxhash.xxh32_intdigest(head)) + data


def record_fields(record: Record) -> dict[str, Any]:
    """``record`` as the plain fields a frame stores (its ``op`` first)."""
    # The records' fields are plain values: no deep copy (dataclasses.asdict) is needed.
    return {"op": record.op, **{f.name: getattr(record, f.name) for f in _FIELDS[type(record)]}}


def parse_record(fields: Any, where: str) -> Record:
    """The record a frame stored as ``fields`` (:class:`ManifestError`, naming ``where``, when
    they are not one)."""
    try:
        fields = dict(fields)
        cls = _RECORD_TYPES[fields.pop("op")]
        if cls is Abort:
            # Logs written before Abort lost its `tier` field (always "", the whole save)
            # still carry it.
            fields.pop("tier", None)
        return cls(**fields)
    except (ValueError, KeyError, TypeError) as exc:
        raise ManifestError(f"manifest record at {where} is not a valid record: {exc!r}") from exc


@dataclass
class Parsed:
    """Frames read from the journal: their bodies, where the last complete one ends, and that
    frame itself (where it starts and its bytes: what tells later whether the file was cut or
    rewritten under it)."""

    bodies: list[dict[str, Any]]
    end: int
    last: tuple[int, bytes] | None
    #: Where each frame starts (in the file).
    starts: list[int]


def parse_frames(data: bytes, start: int, path: str, *, tolerant: bool = False) -> Parsed:
    """The complete frames of ``data`` (the journal's bytes from offset ``start``).

    Bytes after the last complete frame that could be the start of one are left (an append cut
    short); anything else that is not a valid frame raises :class:`ManifestError` -- unless
    ``tolerant``, where the frames before it are what is read (see ``Manifest._cut_tail``).
    """
    bodies: list[dict[str, Any]] = []
    starts: list[int] = []
    pos, last = 0, None
    while len(data) - pos >= HEADER.size:
        magic, length, body_check, head_check = HEADER.unpack_from(data, pos)
        where = f"byte {start + pos} of {path}"
        damage = None
        if magic != MAGIC or xxhash.xxh32_intdigest(data[pos : pos + 12]) != head_check:
            damage = "not a record header"
        elif length > MAX_FRAME:
            damage = f"a frame of {length} B"
        elif len(data) - pos - HEADER.size < length:
            break  # an append cut short (a writer died, or the file was truncated)
        else:
            body = data[pos + HEADER.size : pos + HEADER.size + length]
            if xxhash.xxh32_intdigest(body) != body_check:
                damage = "a record fails its checksum"
        decoded: Any = None
        if damage is None:
            try:
                decoded = msgpack.unpackb(body, raw=False, strict_map_key=False)
            except (ValueError, msgpack.UnpackException) as exc:
                damage = repr(exc)
            else:
                if not isinstance(decoded, dict):
                    damage = "not a frame"
        if damage is not None:
            if tolerant:
                break
            raise ManifestError(
                f"the manifest journal is damaged at {where} ({damage}). Move the manifest "
                "folder aside: recovery proceeds from what the tiers prove."
            )
        bodies.append(decoded)
        starts.append(start + pos)
        end = pos + HEADER.size + length
        last = (start + pos, bytes(data[pos:end]))
        pos = end
    return Parsed(bodies, start + pos, last, starts)
