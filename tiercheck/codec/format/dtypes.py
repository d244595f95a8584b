"""Which torch dtypes the codec stores, and their names in the blob header.

A dtype is recorded by its torch attribute name (``"float32"``, ``"bfloat16"``...), never by a
numeric code, so a blob stays readable when torch adds or reorders dtypes. Only dtypes with real
storage and a copy kernel are supported: the quantized types and the "shell" sub-byte types
(``int1``..``int7``, ``uint1``..``uint7``) cannot be copied into a payload by torch itself, so the
no-pickle path refuses them with :class:`~tiercheck.errors.UnsupportedObject`.
"""

from __future__ import annotations

import torch

__all__ = [
    "dtype_from_name",
    "dtype_name",
    "is_supported_dtype",
    "safetensors_dtypes",
    "supported_dtypes",
]

# Every name is looked up with getattr so that an older torch (without float8, uint16...) simply
# has fewer supported dtypes instead of failing at import. The second column: whether a
# safetensors file can hold the dtype (``tiercheck export`` stores the others as raw bytes).
_CANDIDATES: tuple[tuple[str, bool], ...] = (
    ("bool", True),
    ("uint8", True),
    ("int8", True),
    ("int16", True),
    ("int32", True),
    ("int64", True),
    ("uint16", True),
    ("uint32", True),
    ("uint64", True),
    ("float16", True),
    ("bfloat16", True),
    ("float32", True),
    ("float64", True),
    ("complex32", False),
    ("complex64", True),
    ("complex128", False),
    ("float8_e4m3fn", True),
    ("float8_e4m3fnuz", True),
    ("float8_e5m2", True),
    ("float8_e5m2fnuz", True),
    ("float8_e8m0fnu", False),
    ("float4_e2m1fn_x2", False),
    ("bits8", False),
    ("bits16", False),
    ("bits1x8", False),
    ("bits2x4", False),
    ("bits4x2", False),
)

_BY_NAME: dict[str, torch.dtype] = {
    name: dt for name, _ in _CANDIDATES if isinstance(dt := getattr(torch, name, None), torch.dtype)
}
_SAFETENSORS = frozenset(_BY_NAME[name] for name, held in _CANDIDATES if held and name in _BY_NAME)
_BY_DTYPE: dict[torch.dtype, str] = {dt: name for name, dt in _BY_NAME.items()}


def supported_dtypes() -> tuple[torch.dtype, ...]:
    """Every dtype this build of torch has and the codec can store, in a fixed order."""
    return tuple(_BY_NAME.values())


def is_supported_dtype(dtype: torch.dtype) -> bool:
    """Whether tensors of ``dtype`` can be flattened without pickle."""
    return dtype in _BY_DTYPE


def dtype_name(dtype: torch.dtype) -> str:
    """The header name of a supported dtype (``torch.float32`` -> ``"float32"``)."""
    return _BY_DTYPE[dtype]


def dtype_from_name(name: str) -> torch.dtype | None:
    """The dtype recorded as ``name``, or ``None`` when this build of torch does not have it."""
    return _BY_NAME.get(name)


def safetensors_dtypes() -> frozenset[torch.dtype]:
    """The supported dtypes a safetensors file can hold as they are."""
    return _SAFETENSORS
