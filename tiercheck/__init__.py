"""tiercheck: tiered checkpointing for large-model training.

Each save lands first in fast, fragile places (this node's shared memory, a peer node's memory)
and some travel on to durable storage (any fsspec URL). After a failure,
:meth:`Checkpointer.restore` brings back the newest version that every rank can rebuild, from
the fastest tier that survived.

The public names are few; everything else may move between releases.
"""

from __future__ import annotations

from tiercheck.checkpointer import (
    Checkpointer,
    CheckpointerStats,
    Restored,
    SaveHandle,
    SaveStats,
    TierPolicy,
)
from tiercheck.codec import CodecOptions, DTensorShard
from tiercheck.engine.health import Health, TierHealth
from tiercheck.errors import (
    BaseMismatch,
    BlobNotFound,
    ChecksumMismatch,
    CommitUncertain,
    ConfigError,
    FormatError,
    InvalidKey,
    JobDeleted,
    JobLocked,
    ManifestError,
    PeerUnavailable,
    PluginImportError,
    ReshardError,
    RestoreError,
    SaveSkipped,
    StaleMemory,
    StateChanged,
    StatefulError,
    StateMismatch,
    StorageError,
    Superseded,
    TiercheckError,
    TierClosed,
    TierFull,
    TierNotTargeted,
    TierWriteFailed,
    UnknownTier,
    UnsupportedFormat,
    UnsupportedObject,
    VersionError,
    WorldSizeMismatch,
)
from tiercheck.staging import fence_before_forward, fence_before_step
from tiercheck.stateful import Replicated
from tiercheck.sync import SyncCheckpointer
from tiercheck.tiers import LocalTier, PersistentTier
from tiercheck.tiers.atomic import atomic_write_file
from tiercheck.tiers.base import FailureScope, Tier

__version__ = "0.1.0"

__all__ = [
    "BaseMismatch",
    "BlobNotFound",
    "Checkpointer",
    "CheckpointerStats",
    "ChecksumMismatch",
    "CodecOptions",
    "CommitUncertain",
    "ConfigError",
    "DTensorShard",
    "FailureScope",
    "FormatError",
    "Health",
    "InvalidKey",
    "JobDeleted",
    "JobLocked",
    "LocalTier",
    "ManifestError",
    "PeerUnavailable",
    "PersistentTier",
    "PluginImportError",
    "Replicated",
    "ReshardError",
    "RestoreError",
    "Restored",
    "SaveHandle",
    "SaveSkipped",
    "SaveStats",
    "StaleMemory",
    "StateChanged",
    "StateMismatch",
    "StatefulError",
    "StorageError",
    "Superseded",
    "SyncCheckpointer",
    "Tier",
    "TierClosed",
    "TierFull",
    "TierHealth",
    "TierNotTargeted",
    "TierPolicy",
    "TierWriteFailed",
    "TiercheckError",
    "UnknownTier",
    "UnsupportedFormat",
    "UnsupportedObject",
    "VersionError",
    "WorldSizeMismatch",
    "__version__",
    "atomic_write_file",
    "fence_before_forward",
    "fence_before_step",
]
