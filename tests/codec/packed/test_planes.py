"""Byte planes: split and join against a plain strided reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tiercheck.codec.packed import planes
from tiercheck.codec.packed.planes import (
    BLOCK_BYTES,
    join_planes,
    plane_sizes,
    split_planes,
    split_planes_torch,
)


def reference(src: np.ndarray, width: int, low: bool) -> list[np.ndarray]:
    """The expected planes, computed the slow obvious way."""
    matrix = src.reshape(-1, width)
    if not low:
        return [matrix[:, j].copy() for j in range(width)]
    half = width // 2
    return [matrix[:, :half].copy().reshape(-1)] + [matrix[:, j].copy() for j in range(half, width)]


CASES = [(w, False) for w in (1, 2, 4, 8, 16)] + [(w, True) for w in (4, 8, 16)]


@pytest.mark.parametrize(("width", "low"), CASES)
@pytest.mark.parametrize("little", [True, False], ids=["little-endian", "strided-fallback"])
def test_split_then_join_is_identity(
    width: int, low: bool, little: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(planes, "_LITTLE", little)
    rng = np.random.default_rng(width)
    step = BLOCK_BYTES // width
    for n in (0, 1, 7, step - 1, step, step + 1, 2 * step + 3):
        src = rng.integers(0, 256, size=n * width, dtype=np.uint8)
        dests = [np.empty(size, dtype=np.uint8) for size in plane_sizes(width, n, low)]
        split_planes(src, width, dests, low=low)
        for got, want in zip(dests, reference(src, width, low), strict=True):
            assert np.array_equal(got, want)
        back = np.empty_like(src)
        join_planes(dests, width, back, low=low)
        assert np.array_equal(back, src)


@pytest.mark.parametrize("width", [1, 2, 4, 8, 16])
def test_torch_split_matches_reference(width: int) -> None:
    src = torch.randint(0, 256, (1000 * width,), dtype=torch.uint8)
    got = split_planes_torch(src, width)
    assert got.shape == (width, 1000)
    for j, want in enumerate(reference(src.numpy(), width, False)):
        assert np.array_equal(got[j].numpy(), want)


def test_torch_split_of_nothing() -> None:
    assert split_planes_torch(torch.zeros(0, dtype=torch.uint8), 4).shape == (4, 0)


def test_plane_sizes() -> None:
    assert plane_sizes(4, 10, False) == [10, 10, 10, 10]
    assert plane_sizes(4, 10, True) == [20, 10, 10]
    assert plane_sizes(8, 3, True) == [12, 3, 3, 3, 3]


def test_wrong_sizes_raise() -> None:
    src = np.zeros(12, dtype=np.uint8)
    with pytest.raises(ValueError, match="cannot split"):
        split_planes(src, 4, [np.zeros(3, dtype=np.uint8)] * 3)
    with pytest.raises(ValueError, match="cannot split"):
        split_planes(np.zeros(10, dtype=np.uint8), 4, [np.zeros(2, dtype=np.uint8)] * 4)
    with pytest.raises(ValueError, match="low half"):
        split_planes(src, 2, [np.zeros(6, dtype=np.uint8)] * 2, low=True)
    with pytest.raises(ValueError, match="cannot join"):
        join_planes([np.zeros(3, dtype=np.uint8)] * 4, 4, np.zeros(16, dtype=np.uint8))
    with pytest.raises(ValueError, match="cannot split"):
        split_planes_torch(torch.zeros(10, dtype=torch.uint8), 4)
