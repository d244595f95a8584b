"""The codec: one rank's training state <-> blobs, bit-exact. It knows nothing about tiers.

Pipeline (each stage a versioned name in the blob header, see :mod:`.stages`)::

    state --flatten--> Layout + tensors --write_payload--> raw payload (RawState)
          --encode_full--> full blob (payload as is)
          --encode_packed--> packed blob: xor vs base -> byte planes -> zstd where it pays
          (encode(state, name) picks one by the encoding's name)
    blob  --decode(base=...)--> RawState (verified end to end) --state()--> state
    blob  --read_meta_ranged / read_tensors--> some tensors, reading only their byte ranges

Putting a decoded state into live objects in place is :mod:`tiercheck.codec.decode.statetree`'s job,
above the codec (``check_into``, ``load_into`` and ``own_copy``).

Modules: :mod:`.flatten` (a live state -> skeleton and tensors; the payload), :mod:`.skeleton`
(the skeleton format's one home: its tags and the one walk over a stored skeleton),
:mod:`.layout` (where each tensor sits in the payload) and :mod:`.rebuild` (the skeleton read
back: ``unflatten``), :mod:`.delta` (XOR), :mod:`.planes` (byte planes), :mod:`.frames` (the
packed body; :mod:`.resources`, the zstd contexts, buffers and threads it runs on), the blob:
:mod:`.blobformat` (byte layout, header, parse), :mod:`.rawstate` (``RawState``),
:mod:`.encoder`, :mod:`.decoder` (decode, verify), gathered by :mod:`.blob`; :mod:`.partial`
(reading part of a blob), :mod:`.digest` (checksums), :mod:`.stages`, :mod:`.options`,
:mod:`.dtypes`, :mod:`.dtensor` (DTensor records), :mod:`.plan` (the cached layout of a
repeating state) and :mod:`.copyprogram` (its payload copy in few calls); for restoring on
another world :mod:`.replica` (references between ranks' blobs), :mod:`.reshard` (the plan),
:mod:`.shards` (old shards per DTensor) and :mod:`.assembled`.
"""

from __future__ import annotations

from tiercheck.codec.blob import (
    FORMAT_MAJOR,
    FORMAT_MINOR,
    MAGIC,
    BaseRef,
    BlobMeta,
    RawState,
    decode,
    encode,
    encode_full,
    encode_packed,
    finalize_full_blob,
    full_blob_size,
    read_meta,
    snapshot,
    verify,
    write_full_blob,
)
from tiercheck.codec.decode.partial import RangedBlob, read_meta_ranged, read_tensors
from tiercheck.codec.decode.rebuild import unflatten
from tiercheck.codec.encode.flatten import (
    ALIGNMENT,
    Layout,
    TensorSpec,
    flatten,
    write_payload,
)
from tiercheck.codec.format.digest import raw_digest
from tiercheck.codec.format.dtensor import DTensorShard
from tiercheck.codec.format.dtypes import supported_dtypes
from tiercheck.codec.format.stages import FlattenStage, PlanesStage, Stage, XorStage, ZstdStage
from tiercheck.codec.options import CodecOptions
from tiercheck.codec.packed.delta import match_base, xor_bits, xor_bytes

__all__ = [
    "ALIGNMENT",
    "FORMAT_MAJOR",
    "FORMAT_MINOR",
    "MAGIC",
    "BaseRef",
    "BlobMeta",
    "CodecOptions",
    "DTensorShard",
    "FlattenStage",
    "Layout",
    "PlanesStage",
    "RangedBlob",
    "RawState",
    "Stage",
    "TensorSpec",
    "XorStage",
    "ZstdStage",
    "decode",
    "encode",
    "encode_full",
    "encode_packed",
    "finalize_full_blob",
    "flatten",
    "full_blob_size",
    "match_base",
    "raw_digest",
    "read_meta",
    "read_meta_ranged",
    "read_tensors",
    "snapshot",
    "supported_dtypes",
    "unflatten",
    "verify",
    "write_full_blob",
    "write_payload",
    "xor_bits",
    "xor_bytes",
]
