"""Blobs: one rank's state of one version as bytes -- the format, the encoders, the decoder.

The names gathered here live in :mod:`.blobformat` (the byte layout, :class:`BlobMeta`,
:func:`read_meta`), :mod:`.rawstate` (:class:`RawState`, :func:`snapshot`), :mod:`.encoder`
(:func:`encode` by name, :func:`encode_full`, :func:`encode_packed`, the in-place full
blob) and :mod:`.decoder` (:func:`decode`, :func:`verify`); importing them from here keeps
working.
"""

from __future__ import annotations

from tiercheck.codec.decode.decoder import decode, verify
from tiercheck.codec.encode.encoder import (
    encode,
    encode_full,
    encode_packed,
    finalize_full_blob,
    full_blob_size,
    write_full_blob,
)
from tiercheck.codec.format.blobformat import (
    FORMAT_MAJOR,
    FORMAT_MINOR,
    MAGIC,
    PREAMBLE_NBYTES,
    BaseRef,
    BlobMeta,
    FrameExtent,
    frame_extents,
    read_meta,
)
from tiercheck.codec.rawstate import RawState, host_buffer, snapshot

__all__ = [
    "FORMAT_MAJOR",
    "FORMAT_MINOR",
    "MAGIC",
    "PREAMBLE_NBYTES",
    "BaseRef",
    "BlobMeta",
    "FrameExtent",
    "RawState",
    "decode",
    "encode",
    "encode_full",
    "encode_packed",
    "finalize_full_blob",
    "frame_extents",
    "full_blob_size",
    "host_buffer",
    "read_meta",
    "snapshot",
    "verify",
    "write_full_blob",
]
