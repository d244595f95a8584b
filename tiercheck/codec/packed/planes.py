"""Byte planes: ``k``-byte elements <-> ``k`` planes, plane ``j`` holding byte ``j`` of each.

The obvious implementation, a strided copy of an ``(n, k)`` byte matrix into ``(k, n)``, runs at
0.26 GB/s with torch and about 3 GB/s with numpy on the 2-core dev box: a strided byte loop
cannot use SIMD. Instead the host path works on whole integers, which numpy vectorizes: for
``k = 4`` the 32-bit words are narrowed into two 16-bit halves (a truncating cast and a shift),
and each half into two byte planes the same way. Every step is one vectorized ufunc, run on
1 MiB blocks so the temporaries stay in L2. Measured: split 6-7 GB/s, join 4.3 GB/s per core
(numbers in ``bench/codec.py`` output), against 13 GB/s for a plain large memcpy.

The device path (:func:`split_planes_torch`) uses the same integer trick with torch ops, so on a
GPU the split runs there and only the planes travel to the host.

Plane ``j`` is byte ``j`` in *memory* order. The integer trick equals memory order on
little-endian hosts; elsewhere the strided copy is used.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

__all__ = ["PlaneScratch", "join_planes", "plane_sizes", "split_planes", "split_planes_torch"]

U8 = npt.NDArray[np.uint8]
_LITTLE = sys.byteorder == "little"
#: Interleaved bytes handled per step (the temporaries of one step stay in L2).
BLOCK_BYTES = 1 << 20


class PlaneScratch:
    """Temporaries for :func:`split_planes` / :func:`join_planes` (reuse one per thread)."""

    __slots__ = ("h16", "h32", "l16", "l32")

    def __init__(self) -> None:
        # Sized for the worst case: 2-byte halves of 4-byte words (k=4) and 4-byte halves of
        # 8-byte words (k=8) of one block.
        self.l16: npt.NDArray[np.uint16] = np.empty(BLOCK_BYTES // 4, dtype=np.uint16)
        self.h16: npt.NDArray[np.uint16] = np.empty(BLOCK_BYTES // 4, dtype=np.uint16)
        self.l32: npt.NDArray[np.uint32] = np.empty(BLOCK_BYTES // 8, dtype=np.uint32)
        self.h32: npt.NDArray[np.uint32] = np.empty(BLOCK_BYTES // 8, dtype=np.uint32)


def _split16(words: npt.NDArray[Any], lo: U8, hi: U8) -> None:
    np.copyto(lo, words, casting="unsafe")  # truncating cast keeps the low byte
    np.right_shift(words, 8, out=hi, casting="unsafe")


def _split32(words: npt.NDArray[Any], dests: Sequence[U8], s: PlaneScratch) -> None:
    n = len(words)
    lo, hi = s.l16[:n], s.h16[:n]
    np.copyto(lo, words, casting="unsafe")
    np.right_shift(words, 16, out=hi, casting="unsafe")
    _split16(lo, dests[0], dests[1])
    _split16(hi, dests[2], dests[3])


def _join16(lo: U8, hi: U8, out: npt.NDArray[np.uint16]) -> None:
    np.left_shift(hi, 8, out=out, dtype=np.uint16)
    np.bitwise_or(out, lo, out=out)


def _join32(planes: Sequence[U8], out: npt.NDArray[np.uint32], s: PlaneScratch) -> None:
    n = len(out)
    lo, hi = s.l16[:n], s.h16[:n]
    _join16(planes[0], planes[1], lo)
    _join16(planes[2], planes[3], hi)
    np.left_shift(hi, 16, out=out, dtype=np.uint32)
    np.bitwise_or(out, lo, out=out)


def _split_block(block: U8, width: int, low: bool, out: Sequence[U8], s: PlaneScratch) -> None:
    n = len(block) // width
    half = width // 2
    if not _LITTLE or width not in (2, 4, 8):
        matrix = block.reshape(n, width)
        first = 0
        if low:
            np.copyto(out[0].reshape(n, half), matrix[:, :half])
            first = half
        for j in range(first, width):
            np.copyto(out[j - first + (1 if low else 0)], matrix[:, j])
    elif width == 2:
        _split16(block.view(np.uint16), out[0], out[1])
    elif width == 4:
        words = block.view(np.uint32)
        if low:
            hi = s.h16[:n]
            np.copyto(out[0].view(np.uint16), words, casting="unsafe")
            np.right_shift(words, 16, out=hi, casting="unsafe")
            _split16(hi, out[1], out[2])
        else:
            _split32(words, out, s)
    else:
        words = block.view(np.uint64)
        hi32 = s.h32[:n]
        np.right_shift(words, 32, out=hi32, casting="unsafe")
        if low:
            np.copyto(out[0].view(np.uint32), words, casting="unsafe")
            _split32(hi32, out[1:], s)
        else:
            lo32 = s.l32[:n]
            np.copyto(lo32, words, casting="unsafe")
            _split32(lo32, out[:4], s)
            _split32(hi32, out[4:], s)


def _join_block(parts: Sequence[U8], width: int, low: bool, block: U8, s: PlaneScratch) -> None:
    n = len(block) // width
    half = width // 2
    if not _LITTLE or width not in (2, 4, 8):
        matrix = block.reshape(n, width)
        first = 0
        if low:
            matrix[:, :half] = parts[0].reshape(n, half)
            first = half
        for j in range(first, width):
            matrix[:, j] = parts[j - first + (1 if low else 0)]
    elif width == 2:
        _join16(parts[0], parts[1], block.view(np.uint16))
    elif width == 4:
        words = block.view(np.uint32)
        if low:
            hi = s.h16[:n]
            _join16(parts[1], parts[2], hi)
            np.left_shift(hi, 16, out=words, dtype=np.uint32)
            np.bitwise_or(words, parts[0].view(np.uint16), out=words)
        else:
            _join32(parts, words, s)
    else:
        words64 = block.view(np.uint64)
        hi32 = s.h32[:n]
        if low:
            _join32(parts[1:], hi32, s)
            np.left_shift(hi32, 32, out=words64, dtype=np.uint64)
            np.bitwise_or(words64, parts[0].view(np.uint32), out=words64)
        else:
            lo32 = s.l32[:n]
            _join32(parts[:4], lo32, s)
            _join32(parts[4:], hi32, s)
            np.left_shift(hi32, 32, out=words64, dtype=np.uint64)
            np.bitwise_or(words64, lo32, out=words64)


def plane_sizes(width: int, n: int, low: bool) -> list[int]:
    """Byte sizes of the stored planes of ``n`` elements: with ``low``, the low half first."""
    if low:
        return [n * (width // 2)] + [n] * (width - width // 2)
    return [n] * width


def _check(width: int, nbytes: int, arrays: Sequence[U8], low: bool, what: str) -> int:
    if low and width not in (4, 8, 16):
        raise ValueError(f"a low half needs 4-, 8- or 16-byte elements, not {width}")
    n = nbytes // width
    if nbytes % width or [len(a) for a in arrays] != plane_sizes(width, n, low):
        raise ValueError(
            f"cannot {what} {nbytes} bytes of {width}-byte elements with planes "
            f"of {[len(a) for a in arrays]} bytes"
        )
    return n


def split_planes(
    src: U8,
    width: int,
    dests: Sequence[U8],
    scratch: PlaneScratch | None = None,
    *,
    low: bool = False,
) -> None:
    """Write the byte planes of ``src`` (``width``-byte elements) into ``dests``.

    ``src`` is a contiguous uint8 array of ``n * width`` bytes. Without ``low``, ``dests`` are
    ``width`` arrays of ``n`` bytes, ``dests[j]`` receiving byte ``j`` of every element. With
    ``low`` (``width`` 4, 8 or 16), the low half of every element is kept whole:
    ``dests[0]`` (``n * width / 2`` bytes) receives bytes ``0 .. width/2 - 1`` of each element,
    interleaved as they were, and ``dests[1:]`` the planes of the upper bytes. That is for
    frames whose low planes are stored raw anyway (the low mantissa bytes of floats): splitting
    them would be work for nothing, and the split costs 4 passes instead of 6 for fp32.
    """
    n = _check(width, len(src), dests, low, "split")
    if width == 1:
        np.copyto(dests[0], src)
        return
    s = scratch or PlaneScratch()
    half = width // 2 if low else 0
    step = BLOCK_BYTES // width
    for e0 in range(0, n, step):
        e1 = min(n, e0 + step)
        out = [dests[0][e0 * half : e1 * half]] if low else []
        out += [d[e0:e1] for d in dests[1 if low else 0 :]]
        _split_block(src[e0 * width : e1 * width], width, low, out, s)


def join_planes(
    planes: Sequence[U8],
    width: int,
    dest: U8,
    scratch: PlaneScratch | None = None,
    *,
    low: bool = False,
) -> None:
    """Interleave ``planes`` (as :func:`split_planes` wrote them) into ``dest``."""
    n = _check(width, len(dest), planes, low, "join")
    if width == 1:
        np.copyto(dest, planes[0])
        return
    s = scratch or PlaneScratch()
    half = width // 2 if low else 0
    step = BLOCK_BYTES // width
    for e0 in range(0, n, step):
        e1 = min(n, e0 + step)
        parts = [planes[0][e0 * half : e1 * half]] if low else []
        parts += [p[e0:e1] for p in planes[1 if low else 0 :]]
        _join_block(parts, width, low, dest[e0 * width : e1 * width], s)


_INT_OF_WIDTH = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def split_planes_torch(src: torch.Tensor, width: int) -> torch.Tensor:
    """Byte planes of ``src`` (uint8 1-D) as a ``(width, n)`` uint8 tensor on ``src``'s device.

    Shifts and truncating casts on integer views (an arithmetic shift leaves the wanted low byte
    intact), so it runs as a few elementwise kernels on a GPU.
    """
    if src.dtype != torch.uint8 or src.dim() != 1 or src.numel() % width:
        raise ValueError(f"cannot split {src.dtype} {tuple(src.shape)} into planes of {width}")
    n = src.numel() // width
    out = torch.empty((width, n), dtype=torch.uint8, device=src.device)
    if width == 1:
        out[0].copy_(src)
        return out
    lane = min(width, 8)
    if not _LITTLE or lane not in _INT_OF_WIDTH or width % lane or n == 0:
        out.copy_(src.view(n, width).t())
        return out
    words = src.view(_INT_OF_WIDTH[lane]).view(n, width // lane)
    for w in range(width // lane):
        column = words[:, w]
        for b in range(lane):
            out[w * lane + b].copy_(column if b == 0 else torch.bitwise_right_shift(column, 8 * b))
    return out
