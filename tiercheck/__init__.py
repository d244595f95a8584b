"""tiercheck: tiered checkpointing for large-model training.

Each save lands first in fast, fragile places (this node's shared memory, a peer node's memory)
and some travel on to durable storage (any fsspec URL). After a failure,
:meth:`Checkpointer.restore` brings back the newest version that every rank can rebuild, from
the fastest tier that survived.

The public names are few; everything else may move between releases.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

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
from tiercheck.engine.save.staging import fence_before_forward, fence_before_step
from tiercheck.engine.stateful import Replicated
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

#: Modules that lay loose at the package's root until the packages by phase: their old import
#: paths (``import tiercheck.stateful``, ``from tiercheck.guard import RankLock``) name the same
#: module objects at their new homes.
MOVED_MODULES = {
    "blobread": "tiercheck.codec.decode.blobread",
    "fence": "tiercheck.guards.durable",
    "guard": "tiercheck.guards",
    "staging": "tiercheck.engine.save.staging",
    "stateful": "tiercheck.engine.stateful",
    "statetree": "tiercheck.codec.decode.statetree",
}
for _old, _new in MOVED_MODULES.items():
    sys.modules.setdefault(f"tiercheck.{_old}", importlib.import_module(_new))
del _old, _new


def __getattr__(name: str) -> ModuleType:
    # ``tiercheck.guard`` as an attribute, as an ``import tiercheck.guard`` binds it.
    if name in MOVED_MODULES:
        return sys.modules[f"tiercheck.{name}"]
    raise AttributeError(f"module 'tiercheck' has no attribute {name!r}")
