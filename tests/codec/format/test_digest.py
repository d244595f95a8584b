"""Digests: the tree definition, computed independently, and thread independence."""

from __future__ import annotations

import struct
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import xxhash

from tiercheck.codec import raw_digest
from tiercheck.codec.format.digest import DIGEST_CHUNK, tree_root


def by_definition(data: bytes) -> int:
    leaves = [
        xxhash.xxh3_64_intdigest(data[i : i + DIGEST_CHUNK])
        for i in range(0, len(data), DIGEST_CHUNK)
    ]
    return xxhash.xxh3_64_intdigest(struct.pack(f"<{len(leaves) + 1}Q", *leaves, len(data)))


@pytest.mark.parametrize("size", [0, 1, 1000, DIGEST_CHUNK, DIGEST_CHUNK + 1, 2 * DIGEST_CHUNK + 5])
def test_raw_digest_matches_the_definition(size: int) -> None:
    data = torch.randint(0, 256, (size,), dtype=torch.uint8)
    want = by_definition(data.numpy().tobytes())
    assert raw_digest(data) == want
    assert raw_digest(memoryview(data.numpy().tobytes())) == want
    with ThreadPoolExecutor(3) as pool:
        assert raw_digest(data, executor=pool) == want


def test_tree_root_of_nothing() -> None:
    assert tree_root([], 0) == xxhash.xxh3_64_intdigest(bytes(8))


def test_one_bit_changes_the_digest() -> None:
    data = torch.zeros(DIGEST_CHUNK + 10, dtype=torch.uint8)
    before = raw_digest(data)
    data[DIGEST_CHUNK + 3] = 1
    assert raw_digest(data) != before


def test_raw_digest_refuses_non_bytes_tensors() -> None:
    with pytest.raises(ValueError, match="uint8"):
        raw_digest(torch.zeros(4))
    with pytest.raises(ValueError, match="host"):
        raw_digest(torch.zeros(4, dtype=torch.uint8, device="meta"))
