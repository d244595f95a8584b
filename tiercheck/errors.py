"""Every error tiercheck raises.

One root, :class:`TiercheckError`; each subclass also inherits the builtin exception a caller
would naturally catch (a missing blob is a :class:`FileNotFoundError`, a bad key a
:class:`ValueError`), so ``except FileNotFoundError`` keeps working for code that does not know
tiercheck. Messages say what was expected, what was found, and what to do about it.
"""

from __future__ import annotations

__all__ = [
    "BaseMismatch",
    "BlobNotFound",
    "ChecksumMismatch",
    "CommitUncertain",
    "ConfigError",
    "FormatError",
    "InvalidKey",
    "JobDeleted",
    "JobLocked",
    "ManifestError",
    "PeerUnavailable",
    "PluginImportError",
    "ReshardError",
    "RestoreError",
    "SaveSkipped",
    "ShardsInconsistent",
    "StaleMemory",
    "StateChanged",
    "StateMismatch",
    "StorageError",
    "Superseded",
    "TierClosed",
    "TierFull",
    "TierNotTargeted",
    "TierWriteFailed",
    "TiercheckError",
    "UnknownTier",
    "UnsupportedFormat",
    "UnsupportedObject",
    "VersionError",
    "WorldSizeMismatch",
]


class TiercheckError(Exception):
    """Root of every error raised by tiercheck."""


# --- tiers -----------------------------------------------------------------------------------


class BlobNotFound(TiercheckError, FileNotFoundError):
    """A blob that was asked for is not in the tier (or is there but unreadable as a whole)."""


class InvalidKey(TiercheckError, ValueError):
    """A key breaks the key grammar of :mod:`tiercheck.tiers.base` (empty, ``..``, absolute...)."""


class TierClosed(TiercheckError, RuntimeError):
    """A tier was used after :meth:`~tiercheck.tiers.Tier.aclose`."""


class TierFull(TiercheckError, OSError):
    """A put would exceed the tier's configured capacity; nothing was written."""


class StorageError(TiercheckError, OSError):
    """A storage operation failed for good (after any retries); names the location and key."""


class UnknownTier(TiercheckError, LookupError):
    """No tier is registered under the requested name."""


class PluginImportError(TiercheckError, ImportError):
    """A registered tier or codec plugin could not be imported."""


# --- codec -----------------------------------------------------------------------------------


class ChecksumMismatch(TiercheckError, ValueError):
    """The bytes read back do not match the checksum written with them."""


class FormatError(TiercheckError, ValueError):
    """Bytes that should be a tiercheck blob are not one (bad magic, truncated, bad header)."""


class UnsupportedFormat(FormatError):
    """A blob was written by a format or codec stage version this build cannot read."""


class BaseMismatch(TiercheckError, ValueError):
    """A delta was decoded against a base other than the one it was encoded against."""


class UnsupportedObject(TiercheckError, TypeError):
    """A state holds an object the no-pickle flattening cannot represent."""


# --- checkpointer ----------------------------------------------------------------------------


class StatefulError(TiercheckError, RuntimeError):
    """A ``Stateful`` object of the state refused its restored value (its
    ``load_state_dict`` raised; the cause is chained). The version was restored whole."""


class ConfigError(TiercheckError, ValueError):
    """An option given to a tiercheck object is invalid."""


class VersionError(TiercheckError, ValueError):
    """A save was asked for a version that is not newer than the previous one."""


class TierNotTargeted(TiercheckError, LookupError):
    """A save handle was asked about a tier that this version does not go to."""


class TierWriteFailed(TiercheckError, RuntimeError):
    """A version could not be committed in a tier (the cause is chained)."""


class CommitUncertain(TierWriteFailed):
    """This rank cannot tell whether a version is committed in a tier: it said yes, then lost
    the round's last exchange (another rank paused, died or was cut off). The others may have
    heard every yes and committed it; nothing this rank holds of it is deleted until retention
    would drop it anyway, and a restore uses it wherever every rank has its blobs. The handle's
    state is ``"uncertain"``; no rank's handle says ``"committed"`` for a version that is not.
    """


class StateChanged(TiercheckError, RuntimeError):
    """The state of an overlapped save changed between ``save`` and the fence (torch's version
    counters moved): the copy may be torn, so the version is stored nowhere."""


class SaveSkipped(TiercheckError, RuntimeError):
    """A save was skipped by the ``"skip"`` back-pressure policy; nothing was written."""


class ManifestError(TiercheckError, OSError):
    """The node's manifest cannot be opened, or its contents are corrupt."""


class RestoreError(TiercheckError, RuntimeError):
    """A restore could not complete (for example ranks could not agree on a version)."""


class StateMismatch(TiercheckError, ValueError):
    """An in-place restore found the caller's state shaped unlike the stored version.

    Raised before anything is written into the caller's state; the message lists the paths.
    """


class ReshardError(StateMismatch):
    """A version saved by N ranks cannot be restored on M: some of its state cannot be
    resharded (a layout other than Shard/Replicate on a 1-D mesh of the old ranks, old blobs
    that disagree, or per-rank state under ``per_rank="refuse"``). The message says what is
    supported and what to do; nothing was written and nothing stored is touched."""


class ShardsInconsistent(ReshardError):
    """The old ranks' blobs of a version do not fit together (shards that do not tile, layouts
    the ranks disagree on, a mesh larger than the number of ranks said to have saved it): that
    version cannot be rebuilt on any number of ranks, so a restore passes over it to an older
    one, as over a damaged version."""


class WorldSizeMismatch(ConfigError):
    """The job's stored data was saved by another number of ranks than this run has."""


class JobLocked(ConfigError):
    """Another live process already writes this job as this rank on this node."""


class JobDeleted(ConfigError):
    """The job's durable location says ``tiercheck rm-job`` deleted this incarnation, yet its
    job record is still there: the deletion did not finish (run it again)."""


class StaleMemory(ConfigError):
    """A node's shared memory holds data of another incarnation of the job (same name), or data
    whose incarnation cannot be told.

    :attr:`damaged` tells the second case apart: the nodes (by index) whose identity record
    (``identity.json``) is damaged -- cut short, garbled, not a record at all -- so that nobody
    can say whose checkpoints their memory holds. Empty when every node refused names another
    run.
    """

    def __init__(self, *args: object, damaged: tuple[int, ...] = ()) -> None:
        super().__init__(*args)
        #: Nodes whose identity record is damaged (not another run's: nobody's that can be told).
        self.damaged = damaged


class Superseded(TiercheckError, RuntimeError):
    """A newer opening of the same job took over its durable storage; this one stops writing."""


class PeerUnavailable(TiercheckError, ConnectionError):
    """A peer rank did not answer within the configured timeout."""
