"""The shipped conformance suite, run against every built-in tier and storage backend."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import pytest

from tiercheck.testing import TierTests
from tiercheck.tiers import LocalTier, PersistentTier, Tier

from .conftest import S3Server

HAS_SHM = os.path.isdir("/dev/shm")


class TestLocalTier(TierTests):
    """The local tier on a disk folder (pytest's tmp_path)."""

    async def make_tier(self, tmp_path: Path) -> Tier:
        return LocalTier(tmp_path / "local")


@pytest.mark.skipif(not HAS_SHM, reason="/dev/shm does not exist on this system")
class TestLocalTierInSharedMemory(TierTests):
    """The local tier where it runs in production: a tmpfs folder under /dev/shm."""

    async def make_tier(self, tmp_path: Path) -> Tier:
        return LocalTier(f"/dev/shm/tiercheck-test-{uuid.uuid4().hex}")

    async def destroy_tier(self, tier: Tier) -> None:
        assert isinstance(tier, LocalTier)
        shutil.rmtree(tier.root, ignore_errors=True)


class TestLocalTierWithoutRecycling(TierTests):
    """The local tier with recycling off (every delete removes the file)."""

    async def make_tier(self, tmp_path: Path) -> Tier:
        return LocalTier(tmp_path / "local", spare_files=0, populate=False)


class TestPersistentTierOnFileURL(TierTests):
    """The persistent tier on a file:// URL (temporary file + fsync + rename)."""

    async def make_tier(self, tmp_path: Path) -> Tier:
        return PersistentTier(f"file://{tmp_path}/persistent")


class TestPersistentTierInMemory(TierTests):
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
class TestPersistentTierOnS3(TierTests):
    """The persistent tier on s3:// against a local S3 server (moto), one prefix per test."""

    @pytest.fixture(autouse=True)
    def _use_server(self, s3_server: S3Server) -> None:
        self.server = s3_server

    async def make_tier(self, tmp_path: Path) -> Tier:
        return PersistentTier(self.server.url(), storage_options=self.server.storage_options)

    async def destroy_tier(self, tier: Tier) -> None:
        assert isinstance(tier, PersistentTier)
        path = tier.url.removeprefix("s3://")
        tier.fs.invalidate_cache()
        if tier.fs.find(path):
            tier.fs.rm(path, recursive=True)
