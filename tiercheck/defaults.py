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
  node's manifest, an LMDB environment: what happened to each version), ``identity.json``
  (which incarnation of the job the memory belongs to) and ``locks/`` (one ``r<rank>.lock``
  per writer);
* what a tier keeps and stores unless told, by its kind -- a *durable* tier (one that outlives
  the cluster) or a *memory* tier (:func:`default_keep`, :func:`default_encoding`);
* the **encodings** a tier may store blobs in, and what each decides (:class:`EncodingKind`);
* the **name grammar** of job ids and node names (:func:`check_job_id`,
  :func:`check_node_name`): each is always exactly one folder name and one URL path segment.

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
from typing import Final, Literal

from tiercheck.errors import ConfigError

__all__ = [
    "BLOBS_DIR",
    "DEFAULT_KEEP",
    "DEFAULT_PERSISTENT_DIR",
    "DURABLE_KEEP",
    "ENCODINGS",
    "ENCODING_KINDS",
    "IDENTITY_FILE",
    "LOCKS_DIR",
    "MANIFEST_DIR",
    "MAX_NAME_LENGTH",
    "MEMORY_DIR",
    "MEMORY_KEEP",
    "NAME_GRAMMAR",
    "REPLICAS_DIR",
    "SHM_DIR",
    "Encoding",
    "EncodingKind",
    "NodeRoot",
    "check_job_id",
    "check_node_name",
    "default_encoding",
    "default_keep",
    "default_persistent_url",
    "default_root",
    "encoding_kind",
    "memory_base",
    "persistent_job_url",
]

#: The durable folder (relative to the working directory) used when no ``persistent=`` is given.
DEFAULT_PERSISTENT_DIR: Final = "tiercheck-checkpoints"

#: Versions a memory tier keeps when ``keep`` does not say.
MEMORY_KEEP: Final = 2
#: Versions a durable tier (one that outlives the cluster) keeps when ``keep`` does not say.
DURABLE_KEEP: Final = 3

#: What the built-in tiers keep by default; it follows from their kind (:func:`default_keep`),
#: as every tier's does.
DEFAULT_KEEP: Final[Mapping[str, int]] = MappingProxyType(
    {"local": MEMORY_KEEP, "peer": MEMORY_KEEP, "persistent": DURABLE_KEEP}
)

#: Where shared memory is mounted on Linux.
SHM_DIR: Final = "/dev/shm"  # noqa: S108 -- the shared-memory mount itself, by design
#: The folder in shared memory (or the temporary folder) that holds ``<job_id>/<node>`` roots.
MEMORY_DIR: Final = "tiercheck"

#: A node root's folder of this node's own blobs (the local tier).
BLOBS_DIR: Final = "blobs"
#: A node root's folder of the replicas this node keeps for ranks on other nodes (peer tier).
REPLICAS_DIR: Final = "replicas"
#: A node root's manifest folder (its LMDB environment: tiercheck.consistency.manifest).
MANIFEST_DIR: Final = "manifest"
#: The node identity file, in a node root (not a tier key).
IDENTITY_FILE: Final = "identity.json"
#: The folder of per-rank writer locks, in a node root.
LOCKS_DIR: Final = "locks"

_LOCK_NAME = re.compile(r"^r(\d{5})\.lock$")
# A key under replicas/ (the peer tier's holder layout, tiercheck.tiers.peer): the job's
# namespace, the rank the replica belongs to, then that rank's own key.
_REPLICA_KEY = re.compile(r"^(?P<job>[^/]+)/r(?P<rank>\d{5})/(?P<key>.+)$")


#: How a tier stores a version's blob: ``"full"`` (the raw payload as is) or ``"packed"``
#: (XOR against a base, byte planes, zstd). The blob header's kind, the key suffix
#: (``r00000.full``) and a tier's ``encodings`` option name them; :data:`ENCODING_KINDS` says
#: what each one decides.
Encoding = Literal["full", "packed"]


@dataclass(frozen=True)
class EncodingKind:
    """What one encoding decides, in one place: every part that treats encodings differently
    asks this object, never the name, so that a new encoding is one entry here, its encoder
    (:func:`tiercheck.codec.encode`) and its decoder.
    """

    #: The name: the key suffix and the tier option's value.
    name: Encoding
    #: The blob header's kind byte (:mod:`tiercheck.codec.format.blobformat`).
    header_byte: int
    #: Whether the blob's body is the raw payload byte for byte. Such a blob needs no base, is
    #: encoded without work (its parts are views of the snapshot, which stays held until the
    #: lane has written them), can be staged in place in a tier's memory, and is read by byte
    #: ranges or scattered into place without decoding.
    as_is: bool
    #: Which encoding a restore reads when a rank has two blobs of one version in one tier
    #: (lowest first: the cheaper read).
    read_order: int


#: Every encoding, by name.
ENCODING_KINDS: Mapping[Encoding, EncodingKind] = MappingProxyType(
    {
        "full": EncodingKind("full", header_byte=1, as_is=True, read_order=0),
        "packed": EncodingKind("packed", header_byte=2, as_is=False, read_order=1),
    }
)
ENCODINGS: tuple[Encoding, ...] = tuple(ENCODING_KINDS)


def encoding_kind(name: str) -> EncodingKind:
    """The :class:`EncodingKind` named ``name``; :class:`ValueError` for a name that is none."""
    for kind in ENCODING_KINDS.values():
        if kind.name == name:
            return kind
    raise ValueError(f"{name!r} is not an encoding: expected one of {', '.join(ENCODINGS)}")


def default_keep(durable: bool) -> int:
    """Versions a tier keeps when ``keep`` does not say: :data:`DURABLE_KEEP` for a durable
    tier, :data:`MEMORY_KEEP` for a memory tier, whatever the tier is named."""
    return DURABLE_KEEP if durable else MEMORY_KEEP


def default_encoding(durable: bool) -> Encoding:
    """How a tier stores blobs when ``encodings`` does not say, whatever it is named.

    A memory tier holds the raw payload (``"full"``): a restore from it is a memory read or the
    wire, never a decompression, which is slower than either, and a save that no durable tier
    takes is encoded once. A durable tier gets the smallest encoding (``"packed"``).
    """
    return "packed" if durable else "full"


def memory_base() -> Path:
    """The folder that holds every job's node roots: ``/dev/shm/tiercheck``.

    ``<tempdir>/tiercheck`` where ``/dev/shm`` does not exist or cannot be written.
    """
    shm_usable = os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)
    return Path(SHM_DIR if shm_usable else tempfile.gettempdir()) / MEMORY_DIR


#: The longest job id or node name. A job id is one folder name in every tier (at most 255
#: bytes on Linux filesystems) and appears twice in the longest path tiercheck builds --
#: ``/dev/shm/tiercheck/<job>/<node>/replicas/<job>/r<rank>/v<version>/<temporary name>``,
#: under 600 characters with a 64-character host name -- and once in the longest key of a
#: persistent job folder (``<prefix>/<job>/quarantine/v<version>/r<rank>.packed...``), well
#: inside S3's 1024-byte keys for any reasonable prefix.
MAX_NAME_LENGTH: Final = 128

#: What a job id or node name may hold, in words (error messages quote it).
NAME_GRAMMAR: Final = (
    f"1 to {MAX_NAME_LENGTH} ASCII letters, digits, '.', '_' and '-', not starting with '.' or '-'"
)

_NAME = re.compile(rf"[A-Za-z0-9_][A-Za-z0-9._-]{{0,{MAX_NAME_LENGTH - 1}}}")


def _check_name(what: str, value: object, example: str) -> str:
    if isinstance(value, str) and _NAME.fullmatch(value) is not None:
        return value
    shown = (
        repr(value) if not isinstance(value, str) or len(value) <= 80 else repr(value[:80]) + "..."
    )
    raise ConfigError(
        f"{what} must be {NAME_GRAMMAR} (for example {example!r}), got {shown}: it is one "
        "folder name in every tier"
    )


def check_job_id(job_id: object) -> str:
    """``job_id`` if it is a valid job id, else a :class:`~tiercheck.errors.ConfigError`.

    The one grammar of job ids (:data:`NAME_GRAMMAR`): 1 to :data:`MAX_NAME_LENGTH` ASCII
    letters, digits, ``.``, ``_`` and ``-``, not starting with ``.`` or ``-``. A job id is
    always exactly one folder name in a node's memory and one path segment of the persistent
    URL: no separator (``/``, ``\\``), no URL syntax (``::``, ``?``, ``#``, ``%``), no
    whitespace, no ``..``, and nothing a filesystem or object store could read otherwise.
    Every place a job id enters tiercheck (the checkpointers, :func:`default_root`,
    :func:`persistent_job_url`, the local tier, the command line's ``--job``, the trainer
    integrations) checks it here.
    """
    return _check_name("job_id", job_id, "run-1")


def check_node_name(node: object) -> str:
    """``node`` if it is a valid node name (the grammar of :func:`check_job_id`), else a
    :class:`~tiercheck.errors.ConfigError`; names one folder under the job's memory."""
    return _check_name("node", node, "node0")


def default_root(job_id: str = "default", node: str | None = None) -> Path:
    """The node root of ``job_id`` on ``node`` when none is given (``local_root=``).

    ``/dev/shm/tiercheck/<job_id>/<node>`` (see :func:`memory_base`); ``node`` defaults to the
    hostname. Raises :class:`~tiercheck.errors.ConfigError` when ``job_id`` or ``node`` breaks
    the name grammar (:func:`check_job_id`).
    """
    job_id = check_job_id(job_id)
    if node is None:
        host = socket.gethostname() or "localhost"
        try:
            node = check_node_name(host)
        except ConfigError:
            raise ConfigError(
                f"this host's name {host!r} cannot name a node's folder (a node name is "
                f"{NAME_GRAMMAR}); pass node=, for example node='node0'"
            ) from None
    return memory_base() / job_id / check_node_name(node)


def default_persistent_url() -> str:
    """The ``persistent=`` URL used when none is given: ``./tiercheck-checkpoints`` as a URL."""
    return Path(DEFAULT_PERSISTENT_DIR).resolve().as_uri()


def persistent_job_url(persistent_url: str, job_id: str) -> str:
    """The folder of job ``job_id`` under the ``persistent=`` URL: ``<url>/<job_id>``.

    ``job_id`` is checked (:func:`check_job_id`), so it is exactly one more path segment of
    the URL: it can name no other folder, bucket or protocol.
    """
    return persistent_url.rstrip("/") + "/" + check_job_id(job_id)


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

    def records(self) -> list[Path]:
        """What of a node root's own records the folder holds: ``manifest/``, ``identity.json``
        and writer lock files (an opening makes them before any blob; one that was killed, or
        an older release's that failed, may have left nothing else)."""
        found = [p for p in (self.manifest, self.identity) if p.exists()]
        if self.locks.is_dir():
            found += sorted(p for p in self.locks.iterdir() if self.lock_rank(p.name) is not None)
        return found

    def is_one(self) -> bool:
        """Whether the folder is a node root: it looks like one, or holds ``blobs/`` or any of
        its :meth:`records` (what a failed or killed opening leaves)."""
        return self.looks_like_one() or self.blobs.is_dir() or bool(self.records())
