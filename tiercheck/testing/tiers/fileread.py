"""Conformance tests of file reads, for tiers that implement SupportsFileRead."""

from __future__ import annotations

import os

import pytest

from tiercheck.errors import BlobNotFound, InvalidKey
from tiercheck.testing.tiers.support import _blob, _MiB, _TierTestBase, assert_same_bytes
from tiercheck.tiers.base import SupportsFileRead, Tier


def _read_all(fd: int, size: int) -> bytes:
    out = bytearray()
    while len(out) < size:
        got = os.pread(fd, size - len(out), len(out))
        if not got:
            break
        out += got
    return bytes(out)


class _FileReadTests(_TierTestBase):
    """The ``test_read_file_*`` tests (skipped for tiers without file reads)."""

    def _files(self, tier: Tier) -> SupportsFileRead:
        if not isinstance(tier, SupportsFileRead):
            pytest.skip(f"{type(tier).__name__} does not implement SupportsFileRead")
        return tier

    async def test_read_file_gives_the_blob_and_its_size(self, tier: Tier) -> None:
        """``fn(fd, size)`` sees exactly the stored bytes; what it returns comes back."""
        files = self._files(tier)
        data = _blob(2 * _MiB + 77, 50)
        await tier.put("file/blob", data)
        got = await files.read_file("file/blob", lambda fd, size: (size, _read_all(fd, size)))
        assert got[0] == len(data)
        assert_same_bytes(got[1], data)
        await tier.put("file/empty", b"")
        assert await files.read_file("file/empty", lambda fd, size: size) == 0

    async def test_read_file_sees_an_overwrite(self, tier: Tier) -> None:
        """After a put replaces a blob, a file read gives the new one."""
        files = self._files(tier)
        await tier.put("file/over", _blob(64 * 1024, 51))
        new = _blob(10_000, 52)
        await tier.put("file/over", new)
        assert_same_bytes(await files.read_file("file/over", _read_all), new)

    async def test_read_file_of_a_missing_key(self, tier: Tier) -> None:
        """A missing or deleted key raises BlobNotFound and never calls ``fn``."""
        files = self._files(tier)
        called: list[int] = []

        def fn(fd: int, size: int) -> None:
            called.append(size)

        with pytest.raises(BlobNotFound):
            await files.read_file("file/missing", fn)
        await tier.put("file/gone", b"data")
        await tier.delete("file/gone")
        with pytest.raises(BlobNotFound):
            await files.read_file("file/gone", fn)
        with pytest.raises(InvalidKey):
            await files.read_file("a//b", fn)
        assert called == []

    async def test_read_file_passes_fn_errors_through(self, tier: Tier) -> None:
        """An error of ``fn`` reaches the caller; the blob stays as it was."""
        files = self._files(tier)
        data = _blob(4096, 53)
        await tier.put("file/err", data)

        def fail(fd: int, size: int) -> None:
            raise ValueError("the reader's own error")

        with pytest.raises(ValueError, match="the reader's own error"):
            await files.read_file("file/err", fail)
        assert_same_bytes(await tier.get("file/err"), data)
