"""A minimal third-party durable tier: one file per key under a folder, declared to outlive the
cluster. Used in-process by the engine's tests and installed as a real plugin package.

Deliberately self-contained (it imports only tiercheck's public names), because the
installed-plugin test copies this file into a package of its own. Its files are laid out as
the persistent tier lays out a job folder (the key is the path), so tiercheck's commands read
it through a ``file://`` URL.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

from tiercheck.errors import BlobNotFound, ConfigError
from tiercheck.tiers import Buffer, FailureScope, Tier
from tiercheck.tiers.base import TierSetup

#: The environment variable that names the folder the vault tier stores jobs under.
ROOT_VARIABLE = "TIERCHECK_TEST_VAULT"


class VaultTier(Tier):
    """Blobs as files under ``root``, one per key; its contents outlive the cluster."""

    name = "vault"
    survives = FailureScope.CLUSTER

    @classmethod
    def for_job(cls, setup: TierSetup) -> VaultTier:
        """The job's folder under the folder ``$TIERCHECK_TEST_VAULT`` names."""
        root = os.environ.get(ROOT_VARIABLE)
        if not root:
            raise ConfigError(f"the vault tier stores under ${ROOT_VARIABLE}; set it")
        return cls(Path(root) / setup.job_id)

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    async def put(self, key: str, data: Buffer) -> None:
        """Write a temporary file beside the key's, then rename it over it (atomic)."""
        path = self.root / self._check_key(key)
        await asyncio.to_thread(_write, path, data)

    async def get(self, key: str) -> Buffer:
        """The file's bytes."""
        path = self.root / self._check_key(key)
        try:
            return await asyncio.to_thread(path.read_bytes)
        except FileNotFoundError:
            raise BlobNotFound(f"no blob {key!r} in {self.root}") from None

    async def delete(self, key: str) -> None:
        """Remove the file if present."""
        path = self.root / self._check_key(key)
        await asyncio.to_thread(path.unlink, missing_ok=True)

    async def exists(self, key: str) -> bool:
        """Whether the file is there."""
        path = self.root / self._check_key(key)
        return await asyncio.to_thread(path.is_file)

    async def list(self, prefix: str = "") -> AsyncIterator[str]:
        """Every key starting with ``prefix``; temporary files (hidden) are never keys."""
        self._check_prefix(prefix)
        for key in await asyncio.to_thread(_keys, self.root):
            if key.startswith(prefix):
                yield key


def _write(path: Path, data: Buffer) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(temporary, "wb") as f:
            f.write(data)
        os.replace(temporary, path)
    finally:
        # Gone already after a rename; left only where the write or the rename failed.
        temporary.unlink(missing_ok=True)


def _keys(root: Path) -> list[str]:
    keys = []
    for folder, _dirs, files in os.walk(root):
        for file in files:
            if not file.startswith("."):
                keys.append((Path(folder) / file).relative_to(root).as_posix())
    return keys
