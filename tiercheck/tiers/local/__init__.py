"""The local tier: this node's host memory, as files in shared memory (``/dev/shm``).

A training process that crashes leaves its checkpoints behind here for its restarted self: the
blobs are ordinary files in a memory-backed filesystem, owned by the kernel, not by the process.
See :class:`LocalTier`.

The tier is split by job: :mod:`~tiercheck.tiers.local.tier` (the class, its options and public
operations), :mod:`~tiercheck.tiers.local.blobs` (reading and writing blob files),
:mod:`~tiercheck.tiers.local.reservation` (memory handed out to be committed as a blob),
:mod:`~tiercheck.tiers.local.memory` (the private memory reservations and reads use, recycled),
:mod:`~tiercheck.tiers.local.space` (capacity, spares, prepared memory, preallocation) and
:mod:`~tiercheck.tiers.local.files` (stateless file helpers; why no file is ever mapped).
"""

# default_root lives with the rest of the node layout in tiercheck.defaults; importable here too.
from tiercheck.defaults import default_root
from tiercheck.tiers.local.reservation import LocalReservation
from tiercheck.tiers.local.tier import LocalTier

__all__ = ["LocalReservation", "LocalTier", "default_root"]
