"""Exact comparison of states for the codec tests (independent of the code under test)."""

from __future__ import annotations

import collections
import struct
from typing import Any

import numpy as np
import torch


def byte_tensor(t: torch.Tensor) -> torch.Tensor:
    """A contiguous uint8 copy of ``t``'s bit pattern in row-major order."""
    t = t.detach().cpu()
    if t.dtype == torch.complex32:
        t = torch.view_as_real(t)  # allocating complex32 makes torch warn; float16 pairs do not
    return t.contiguous().reshape(-1).view(torch.uint8).clone()


def copy_tensor(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` (any dtype, without torch's complex32 warning)."""
    return byte_tensor(t).view(t.dtype).reshape(t.shape)


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The bit pattern of ``t`` in row-major order (never compares floats with ``==``)."""
    flat = byte_tensor(t)
    return flat.numpy().tobytes() if flat.numel() else b""


def float_bits(x: float) -> bytes:
    """The 8 bytes of a Python float (NaN payloads and the sign of zero included)."""
    return struct.pack("<d", x)


def assert_same(a: Any, b: Any, path: str = "state") -> None:
    """``a`` and ``b`` have the same structure, types and bit-identical values."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype, f"{path}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{path}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        assert tensor_bytes(a) == tensor_bytes(b), f"{path}: tensor bits differ"
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype, f"{path}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{path}: shape {a.shape} != {b.shape}"
        assert np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes(), path
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype, path
        assert a.tobytes() == b.tobytes(), path
    elif isinstance(a, float):
        assert float_bits(a) == float_bits(b), f"{path}: {a!r} != {b!r} (bits)"
    elif isinstance(a, complex):
        assert float_bits(a.real) == float_bits(b.real), path
        assert float_bits(a.imag) == float_bits(b.imag), path
    elif isinstance(a, dict):
        assert list(a) == list(b) or _same_keys(a, b), f"{path}: keys {list(a)} != {list(b)}"
        for (ka, va), (kb, vb) in zip(a.items(), b.items(), strict=True):
            assert_same(ka, kb, f"{path} key")
            assert_same(va, vb, f"{path}[{ka!r}]")
        if isinstance(a, collections.OrderedDict):
            assert_same(getattr(a, "_metadata", None), getattr(b, "_metadata", None), path)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def _same_keys(a: dict[Any, Any], b: dict[Any, Any]) -> bool:
    # NaN keys are never equal to themselves: compare such keys by their bits.
    def norm(k: Any) -> Any:
        return ("float", float_bits(k)) if isinstance(k, float) else (type(k).__name__, repr(k))

    return [norm(k) for k in a] == [norm(k) for k in b]


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A tensor of ``dtype`` whose bytes are random (every bit pattern, NaNs included)."""
    numel = 1
    for d in shape:
        numel *= d
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw &= 1
    return raw.view(dtype).reshape(shape)


def join(parts: list[Any]) -> bytes:
    """A blob from its parts."""
    return b"".join(bytes(p) for p in parts)
