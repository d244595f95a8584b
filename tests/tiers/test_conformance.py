"""The shipped conformance suite, run against every built-in tier and storage backend.

Each class also wires the suite's optional hooks: ``reopen_tier`` (the blobs outlive the tier
instance: local files, fsspec objects) and the back door ``raw_get``/``raw_put``, which reads
and writes the backing storage without the tier (the files under the local tier's root, the
objects in the persistent tier's fsspec filesystem).
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import fsspec
import pytest

from tiercheck.testing import TierTests
from tiercheck.tiers import LocalTier, PersistentTier, Tier

from .conftest import S3Server

HAS_SHM = os.path.isdir("/dev/shm")


class _LocalFiles(TierTests):
    """The local tier's back door: the files under its root."""

    async def raw_get(self, tier: Tier, key: str) -> bytes:
        assert isinstance(tier, LocalTier)
        return (tier.root / key).read_bytes()

    async def raw_put(self, tier: Tier, key: str, data: bytes) -> None:
        assert isinstance(tier, LocalTier)
        path = tier.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


class TestLocalTier(_LocalFiles):
    """The local tier on a disk folder (pytest's tmp_path)."""

    async def make_tier(self, tmp_path: Path) -> Tier:
        return LocalTier(tmp_path / "local")

    async def reopen_tier(self, tier: Tier, tmp_path: Path) -> Tier:
        return LocalTier(tmp_path / "local")


@pytest.mark.skipif(not HAS_SHM, reason="/dev/shm does not exist on this system")
class TestLocalTierInSharedMemory(_LocalFiles):
    """The local tier where it runs in production: a tmpfs folder under /dev/shm."""

    async def make_tier(self, tmp_path: Path) -> Tier:
        return LocalTier(f"/dev/shm/tiercheck-test-{uuid.uuid4().hex}")

    async def reopen_tier(self, tier: Tier, tmp_path: Path) -> Tier:
        assert isinstance(tier, LocalTier)
        return LocalTier(tier.root)

    async def destroy_tier(self, tier: Tier) -> None:
        assert isinstance(tier, LocalTier)
        shutil.rmtree(tier.root, ignore_errors=True)


class TestLocalTierWithoutRecycling(_LocalFiles):
    """The local tier with recycling off (every delete removes the file)."""

    async def make_tier(self, tmp_path: Path) -> Tier:
        return LocalTier(tmp_path / "local", spare_files=0, populate=False)

    async def reopen_tier(self, tier: Tier, tmp_path: Path) -> Tier:
        return LocalTier(tmp_path / "local", spare_files=0, populate=False)


class _FsspecObjects(TierTests):
    """The persistent tier's back door: its URL's objects, through fsspec."""

    storage_options: dict[str, object] = {}  # noqa: RUF012 -- read only

    def _where(self, tier: Tier, key: str) -> tuple[fsspec.AbstractFileSystem, str]:
        assert isinstance(tier, PersistentTier)
        fs, root = fsspec.core.url_to_fs(tier.url, **self.storage_options)
        return fs, f"{str(root).rstrip('/')}/{key}"

    async def raw_get(self, tier: Tier, key: str) -> bytes:
        fs, path = self._where(tier, key)
        return bytes(fs.cat_file(path))

    async def raw_put(self, tier: Tier, key: str, data: bytes) -> None:
        fs, path = self._where(tier, key)
        fs.pipe_file(path, data)

    async def reopen_tier(self, tier: Tier, tmp_path: Path) -> Tier:
        assert isinstance(tier, PersistentTier)
        return PersistentTier(tier.url, storage_options=self.storage_options)


class TestPersistentTierOnFileURL(TierTests):
    """The persistent tier on a file:// URL (temporary file + fsync + rename)."""

    async def make_tier(self, tmp_path: Path) -> Tier:
        return PersistentTier(f"file://{tmp_path}/persistent")

    async def reopen_tier(self, tier: Tier, tmp_path: Path) -> Tier:
        return PersistentTier(f"file://{tmp_path}/persistent")

    # The back door is the folder itself, not fsspec: what any other program would see.
    async def raw_get(self, tier: Tier, key: str) -> bytes:
        assert isinstance(tier, PersistentTier)
        return (Path(tier.url.removeprefix("file://")) / key).read_bytes()

    async def raw_put(self, tier: Tier, key: str, data: bytes) -> None:
        assert isinstance(tier, PersistentTier)
        path = Path(tier.url.removeprefix("file://")) / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


class TestPersistentTierInMemory(_FsspecObjects):
    """The persistent tier on fsspec's memory:// (whole-object puts), one prefix per test."""

    async def make_tier(self, tmp_path: Path) -> Tier:
        return PersistentTier(f"memory://tiercheck-tests/{uuid.uuid4().hex}")

    async def destroy_tier(self, tier: Tier) -> None:
        assert isinstance(tier, PersistentTier)
        path = tier.url.removeprefix("memory://")
        if tier.fs.exists(path):
            tier.fs.rm(path, recursive=True)


# aiohttp warns (ResourceWarning) when it sends a body over 1 MiB given as bytes, because that
# could hold up *its* event loop; s3fs always passes bytes. That loop is fsspec's private I/O
# thread, not the training loop, so the warning does not apply to us; it is ignored for the S3
# tests only, by its exact message.
@pytest.mark.filterwarnings(
    "ignore:Sending a large body directly with raw bytes might lock the event loop:ResourceWarning"
)
class TestPersistentTierOnS3(_FsspecObjects):
    """The persistent tier on s3:// against a local S3 server (moto), one prefix per test."""

    @pytest.fixture(autouse=True)
    def _use_server(self, s3_server: S3Server) -> None:
        self.server = s3_server
        self.storage_options = s3_server.storage_options

    async def make_tier(self, tmp_path: Path) -> Tier:
        return PersistentTier(self.server.url(), storage_options=self.storage_options)

    async def destroy_tier(self, tier: Tier) -> None:
        assert isinstance(tier, PersistentTier)
        path = tier.url.removeprefix("s3://")
        tier.fs.invalidate_cache()
        if tier.fs.find(path):
            tier.fs.rm(path, recursive=True)
