"""Where tiercheck keeps things unless told otherwise, and how a node's memory is laid out.

One home for the names every part agrees on, so that the checkpointer, the guards, the
integrations and the command line find the same places without re-deriving a path by hand:

* the **durable folder** -- ``./tiercheck-checkpoints`` (:data:`DEFAULT_PERSISTENT_DIR`) when no
  ``persistent=`` URL is given; a job lives in ``<persistent URL>/<job_id>/``
  (:func:`persistent_job_url`);
* the **node root** -- this node's memory for one job, ``/dev/shm/tiercheck/<job_id>/<node>``
  (:func:`default_root`; under the temporary folder where ``/dev/shm`` cannot be written),
  laid out as :class:`NodeRoot` says: ``blobs/`` (the local tier), ``replicas/<job_id>/r<rank>/``
  (what this node keeps for the peer tier's ranks on other nodes), ``manifest/`` (the
  journal of what happened to each version), ``identity.json`` (which incarnation of the job
  the memory belongs to) and ``locks/`` (one ``r<rank>.lock`` per writer);
* how many versions each tier keeps by default (:data:`DEFAULT_KEEP`).

A leaf like :mod:`tiercheck.errors`: it imports nothing else of tiercheck while loading, so every
layer (tiers, consistency, the checkpointer, the catalog) may use it without reaching up.
"""

from __future__ import annotations

import os
import re
import socket
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Final

from tiercheck.errors import ConfigError, InvalidKey

__all__ = [
    "BLOBS_DIR",
    "DEFAULT_KEEP",
    "DEFAULT_PERSISTENT_DIR",
    "IDENTITY_FILE",
    "LOCKS_DIR",
    "MANIFEST_DIR",
    "MEMORY_DIR",
    "REPLICAS_DIR",
    "SHM_DIR",
    "NodeRoot",
    "default_persistent_url",
    "default_root",
    "memory_base",
    "persistent_job_url",
]

#: The durable folder (relative to the working directory) used when no ``persistent=`` is given.
DEFAULT_PERSISTENT_DIR: Final = "tiercheck-checkpoints"

#: Versions each built-in tier keeps when ``keep`` does not say (other tiers keep 2).
DEFAULT_KEEP: Final[Mapping[str, int]] = MappingProxyType({"local": 2, "peer": 2, "persistent": 3})

#: Where shared memory is mounted on Linux.
SHM_DIR: Final = "/dev/shm"  # noqa: S108 -- the shared-memory mount itself, by design
#: The folder in shared memory (or the temporary folder) that holds ``<job_id>/<node>`` roots.
MEMORY_DIR: Final = "tiercheck"

#: A node root's folder of this node's own blobs (the local tier).
BLOBS_DIR: Final = "blobs"
#: A node root's folder of the replicas this node keeps for ranks on other nodes (peer tier).
REPLICAS_DIR: Final = "replicas"
#: A node root's manifest folder (its journal: tiercheck.consistency.manifest).
MANIFEST_DIR: Final = "manifest"
#: The node identity file, in a node root (not a tier key).
IDENTITY_FILE: Final = "identity.json"
#: The folder of per-rank writer locks, in a node root.
LOCKS_DIR: Final = "locks"

_LOCK_NAME = re.compile(r"^r(\d{5})\.lock$")
# A key under replicas/ (the peer tier's holder layout, tiercheck.tiers.peer): the job's
# namespace, the rank the replica belongs to, then that rank's own key.
_REPLICA_KEY = re.compile(r"^(?P<job>[^/]+)/r(?P<rank>\d{5})/(?P<key>.+)$")


def memory_base() -> Path:
    """The folder that holds every job's node roots: ``/dev/shm/tiercheck``.

    ``<tempdir>/tiercheck`` where ``/dev/shm`` does not exist or cannot be written.
    """
    shm_usable = os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)
    return Path(SHM_DIR if shm_usable else tempfile.gettempdir()) / MEMORY_DIR


def default_root(job_id: str = "default", node: str | None = None) -> Path:
    """The node root of ``job_id`` on ``node`` when none is given (``local_root=``).

    ``/dev/shm/tiercheck/<job_id>/<node>`` (see :func:`memory_base`); ``node`` defaults to the
    hostname. Raises :class:`~tiercheck.errors.ConfigError` when ``job_id`` or ``node`` is not
    a single folder name.
    """
    return memory_base() / _segment("job_id", job_id) / _segment("node", node)


def _segment(what: str, value: str | None) -> str:
    # Imported here: the tiers import this module, so it may not import them while loading.
    from tiercheck.tiers.base import validate_key

    if value is None:
        value = socket.gethostname() or "localhost"
    try:
        validate_key(value)
    except InvalidKey as exc:
        raise ConfigError(f"{what} must be usable as a folder name: {exc}") from None
    if "/" in value:
        raise ConfigError(f"{what} must be a single folder name without '/': {value!r}")
    return value


def default_persistent_url() -> str:
    """The ``persistent=`` URL used when none is given: ``./tiercheck-checkpoints`` as a URL."""
    return Path(DEFAULT_PERSISTENT_DIR).resolve().as_uri()


def persistent_job_url(persistent_url: str, job_id: str) -> str:
    """The folder of job ``job_id`` under the ``persistent=`` URL: ``<url>/<job_id>``."""
    return persistent_url.rstrip("/") + "/" + job_id


@dataclass(frozen=True, slots=True)
class NodeRoot:
    """The layout of one node root (a node's memory for one job); pure path arithmetic.

    Nothing is read or created here.
    """

    path: Path

    @property
    def blobs(self) -> Path:
        """This node's own blobs: the local tier's root."""
        return self.path / BLOBS_DIR

    @property
    def replicas(self) -> Path:
        """The replicas this node keeps for ranks on other nodes (every job namespace)."""
        return self.path / REPLICAS_DIR

    @property
    def manifest(self) -> Path:
        """The node's manifest folder (see :mod:`tiercheck.consistency.manifest`)."""
        return self.path / MANIFEST_DIR

    @property
    def identity(self) -> Path:
        """The node's identity file."""
        return self.path / IDENTITY_FILE

    @property
    def locks(self) -> Path:
        """The folder of the writers' locks."""
        return self.path / LOCKS_DIR

    @property
    def data_dirs(self) -> tuple[Path, Path]:
        """The folders that hold checkpoint data: the local tier's and the peers' replicas."""
        return (self.blobs, self.replicas)

    def lock(self, rank: int) -> Path:
        """The lock file of ``rank``'s writer."""
        return self.locks / f"r{rank:05d}.lock"

    @staticmethod
    def lock_rank(name: str) -> int | None:
        """The rank a lock file's name (``r00003.lock``) is for, or ``None`` for another name."""
        m = _LOCK_NAME.match(name)
        return None if m is None else int(m.group(1))

    @staticmethod
    def parse_replica_key(key: str) -> tuple[str, int, str] | None:
        """``(job, rank, key)`` of a path relative to :attr:`replicas`, else ``None``.

        The peer tier keeps rank ``r``'s blob ``v.../r....packed`` of job ``j`` on its holder
        as ``replicas/j/r<r, 5 digits>/v.../r....packed``.
        """
        m = _REPLICA_KEY.match(key)
        return None if m is None else (m.group("job"), int(m.group("rank")), m.group("key"))

    def looks_like_one(self) -> bool:
        """Whether the folder holds ``blobs/`` and ``manifest/``, as every node root does."""
        return self.blobs.is_dir() and self.manifest.is_dir()
