"""How versions, ranks and commit records are named inside a tier.

Keys sort by version as plain strings (fixed-width decimal), so a listing reads in order::

    v000000000042/r00003.full     rank 3's blob of version 42, stored whole (raw payload)
    v000000000042/r00003.packed   the same, through the delta/planes/zstd pipeline
    v000000000042/COMMIT          the persistent tier's proof that version 42 is whole
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tiercheck.defaults import ENCODINGS, Encoding, encoding_kind
from tiercheck.errors import VersionError

__all__ = [
    "BlobKey",
    "blob_key",
    "check_version",
    "commit_key",
    "parse_blob_key",
    "parse_commit_key",
    "parse_version_folder",
    "version_prefix",
]

BlobKind = Encoding
_BLOB = re.compile(rf"^v(\d{{12}})/r(\d{{5}})\.({'|'.join(ENCODINGS)})$")
_COMMIT = re.compile(r"^v(\d{12})/COMMIT$")
_FOLDER = re.compile(r"^v(\d{12})$")
MAX_VERSION = 10**12 - 1
MAX_RANK = 10**5 - 1


def check_version(version: object) -> int:
    """``version`` if it can name a version, else a :class:`~tiercheck.errors.VersionError`.

    A version is the training step: an ``int`` (not a ``bool``, not a string or a float, not
    a numpy integer) in ``[0, MAX_VERSION]``, the range its fixed-width key holds. Every
    place a version enters (``save``, ``restore(version=...)``, the trainer integrations'
    ``tiercheck:<step>`` names) checks it here, before anything is read or exchanged.
    """
    if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version <= MAX_VERSION:
        raise VersionError(
            f"a version must be an int in [0, {MAX_VERSION}] (the training step), got "
            f"{version!r} of type {type(version).__name__}; for example save(12, state) or "
            "restore(version=12)"
        )
    return version


@dataclass(frozen=True, slots=True)
class BlobKey:
    """The parts of a blob key."""

    version: int
    rank: int
    kind: BlobKind

    @property
    def read_order(self) -> tuple[int, str]:
        """Sorts a rank's blobs of one version so that the cheaper read comes first
        (:attr:`~tiercheck.defaults.EncodingKind.read_order`), whatever their names."""
        return encoding_kind(self.kind).read_order, str(self)

    def __str__(self) -> str:
        return blob_key(self.version, self.rank, self.kind)


def version_prefix(version: int) -> str:
    """The key prefix shared by everything stored for ``version``."""
    return f"v{version:012d}/"


def blob_key(version: int, rank: int, kind: BlobKind) -> str:
    """The key of ``rank``'s blob of ``version``."""
    return f"{version_prefix(version)}r{rank:05d}.{kind}"


def commit_key(version: int) -> str:
    """The key of the persistent ``COMMIT`` record of ``version``."""
    return f"{version_prefix(version)}COMMIT"


def parse_blob_key(key: str) -> BlobKey | None:
    """The parts of a blob key, or ``None`` when ``key`` is not one."""
    m = _BLOB.match(key)
    if m is None:
        return None
    return BlobKey(int(m.group(1)), int(m.group(2)), encoding_kind(m.group(3)).name)


def parse_commit_key(key: str) -> int | None:
    """The version a ``COMMIT`` key belongs to, or ``None`` when ``key`` is not one."""
    m = _COMMIT.match(key)
    return None if m is None else int(m.group(1))


def parse_version_folder(name: str) -> int | None:
    """The version a folder name (``v000000000042``, a version prefix without its ``/``)
    names, or ``None`` when ``name`` is not one."""
    m = _FOLDER.match(name)
    return None if m is None else int(m.group(1))
