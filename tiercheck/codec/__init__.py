"""The codec: one rank's training state <-> blobs, bit-exact. It knows nothing about tiers.

Pipeline (each stage a versioned name in the blob header, see :mod:`.stages`)::

    state --flatten--> Layout + tensors --write_payload--> raw payload (RawState)
          --encode_full--> full blob (payload as is)
          --encode_packed--> packed blob: xor vs base -> byte planes -> zstd where it pays
    blob  --decode(base=...)--> RawState (verified end to end) --state()--> state

Putting a decoded state into live objects in place is :mod:`tiercheck.statetree`'s job, above the
codec (``check_into``, ``load_into`` and ``own_copy`` stay importable from here).

Modules: :mod:`.flatten` (skeleton, layout, payload), :mod:`.delta` (XOR),
:mod:`.planes` (byte planes), :mod:`.frames` (the packed body; :mod:`.resources`, the zstd
contexts, buffers and threads it runs on), :mod:`.blob` (format, encoders,
decoder), :mod:`.digest` (checksums), :mod:`.stages`, :mod:`.options`, :mod:`.dtypes`,
:mod:`.dtensor` (DTensor records), :mod:`.plan` (the cached layout of a repeating state) and
:mod:`.copyprogram` (its payload copy in few calls).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tiercheck.codec.blob import (
    FORMAT_MAJOR,
    FORMAT_MINOR,
    MAGIC,
    BaseRef,
    BlobMeta,
    RawState,
    decode,
    encode_full,
    encode_packed,
    finalize_full_blob,
    full_blob_size,
    read_meta,
    snapshot,
    verify,
    write_full_blob,
)
from tiercheck.codec.delta import match_base, xor_bits, xor_bytes
from tiercheck.codec.digest import raw_digest
from tiercheck.codec.dtensor import DTensorShard
from tiercheck.codec.dtypes import supported_dtypes
from tiercheck.codec.flatten import (
    ALIGNMENT,
    Layout,
    TensorSpec,
    flatten,
    unflatten,
    write_payload,
)
from tiercheck.codec.options import CodecOptions
from tiercheck.codec.stages import FlattenStage, PlanesStage, Stage, XorStage, ZstdStage

if TYPE_CHECKING:
    from tiercheck.statetree import check_into, load_into, own_copy

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
    "RawState",
    "Stage",
    "TensorSpec",
    "XorStage",
    "ZstdStage",
    "check_into",
    "decode",
    "encode_full",
    "encode_packed",
    "finalize_full_blob",
    "flatten",
    "full_blob_size",
    "load_into",
    "match_base",
    "own_copy",
    "raw_digest",
    "read_meta",
    "snapshot",
    "supported_dtypes",
    "unflatten",
    "verify",
    "write_full_blob",
    "write_payload",
    "xor_bits",
    "xor_bytes",
]

# The state-tree functions moved to :mod:`tiercheck.statetree`, which sits above the codec and
# imports it; they stay reachable here for code written against this package. Resolved on first
# use, so that importing the codec never imports a module that imports the codec.
_MOVED_TO_STATETREE = frozenset({"check_into", "load_into", "own_copy"})


def __getattr__(name: str) -> Any:
    if name in _MOVED_TO_STATETREE:
        import tiercheck.statetree

        return getattr(tiercheck.statetree, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
