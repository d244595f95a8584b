"""The one reading rule of restore and the CLI: a blob, its base, verified."""

from __future__ import annotations

import pytest
import torch

from tiercheck.buffer import Buffer
from tiercheck.codec import encode_packed, snapshot
from tiercheck.codec.decode.blobread import read_blob
from tiercheck.errors import BlobNotFound, ChecksumMismatch, FormatError


def _state(version: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(version)
    return {"w": torch.randn(512, generator=g), "step": version}


def _store() -> dict[str, bytes]:
    """Version 0 a base, 1 a delta on it, 2 a delta on 1 (which no base may be), rank 3."""
    raws = {v: snapshot(_state(v), version=v) for v in range(3)}
    store = {}
    for v, base in ((0, None), (1, 0), (2, 1)):
        parts, _ = encode_packed(raws[v], rank=3, base=None if base is None else raws[base])
        store[f"b{v}"] = b"".join(bytes(p) for p in parts)
    return store


class _Reads:
    def __init__(self, store: dict[str, bytes]) -> None:
        self.store = store
        self.damaged: list[tuple[str, type[Exception]]] = []

    async def get(self, key: str) -> Buffer:
        return self.store[key]

    async def find_base(self, version: int, rank: int) -> str:
        assert rank == 3
        if f"b{version}" not in self.store:
            raise BlobNotFound(f"no blob of version {version}")
        return f"b{version}"

    async def on_damaged(self, key: str, blob: Buffer, exc: Exception) -> None:
        assert bytes(blob) == self.store[key]
        self.damaged.append((key, type(exc)))


async def test_a_delta_comes_back_bit_exact_through_its_base() -> None:
    reads = _Reads(_store())
    raw = await read_blob(reads.get, "b1", find_base=reads.find_base, expect=(1, 3))
    got = raw.state()
    assert torch.equal(got["w"], _state(1)["w"])
    assert got["step"] == 1
    assert reads.damaged == []


async def test_a_blob_holding_another_version_or_rank_is_damaged() -> None:
    reads = _Reads(_store())
    with pytest.raises(FormatError, match="holds version 1 of rank 3"):
        await read_blob(
            reads.get, "b1", find_base=reads.find_base, expect=(1, 0), on_damaged=reads.on_damaged
        )
    assert reads.damaged == [("b1", FormatError)]
    # Without an expectation (the CLI reads what the catalog says is there) it reads.
    await read_blob(reads.get, "b1", find_base=reads.find_base)


async def test_a_base_must_be_self_contained_and_present() -> None:
    store = _store()
    reads = _Reads(store)
    with pytest.raises(FormatError, match="a base must be self-contained"):
        await read_blob(reads.get, "b2", find_base=reads.find_base)
    del store["b0"]
    with pytest.raises(BlobNotFound):
        await read_blob(reads.get, "b1", find_base=reads.find_base)


async def test_a_corrupt_blob_is_shown_to_on_damaged_then_raised() -> None:
    store = _store()
    flipped = bytearray(store["b0"])
    flipped[-1] ^= 0x01
    store["b0"] = bytes(flipped)
    reads = _Reads(store)
    with pytest.raises(ChecksumMismatch):
        await read_blob(
            reads.get, "b1", find_base=reads.find_base, expect=(1, 3), on_damaged=reads.on_damaged
        )
    assert reads.damaged == [("b0", ChecksumMismatch)]
