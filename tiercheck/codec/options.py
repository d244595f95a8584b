"""Options of the packed encoder."""

from __future__ import annotations

import os
from dataclasses import dataclass

from tiercheck.errors import ConfigError

__all__ = ["CodecOptions"]

# zstd accepts levels from -(1 << 17) ("fast" modes) up to 22.
_ZSTD_MIN_LEVEL = -(1 << 17)
_ZSTD_MAX_LEVEL = 22


@dataclass(frozen=True, slots=True)
class CodecOptions:
    """How :func:`~tiercheck.codec.encode_packed` encodes.

    * ``level`` -- zstd level (negative levels are zstd's fast modes); ``None`` or ``0`` turns the
      entropy stage off (every plane is stored raw).
    * ``threads`` -- frames encoded at once (``0`` = ``os.cpu_count()``).
    * ``frame_bytes`` -- raw bytes per frame, the unit of parallel work; with ``threads`` it
      bounds the working memory (see :func:`~tiercheck.codec.encode_packed`). A multiple of 64,
      at least 4096.
    * ``planes`` -- split elements into byte planes before zstd (only with zstd on: without
      an entropy stage, planes would just reorder the bytes).
    * ``sample_bytes`` -- bytes per plane and frame compressed to decide whether zstd pays for
      that plane (taken as 4 slices spread over the plane); planes up to twice this size are
      compressed whole and kept raw if that did not pay.
    * ``min_gain`` -- a plane is stored compressed only if zstd saves at least this fraction of
      its bytes (on the sample, then on the whole plane).
    * ``tuned`` -- for zstd's fast levels (1, 2, negative), use parameters tuned for byte planes
      (see :func:`~tiercheck.codec.resources.zstd_parameters`); ``False`` = zstd's own for
      ``level``.
    """

    level: int | None = 1
    threads: int = 0
    frame_bytes: int = 4 << 20
    planes: bool = True
    sample_bytes: int = 32 << 10
    min_gain: float = 0.05
    tuned: bool = True

    def __post_init__(self) -> None:
        if self.level is not None and (
            type(self.level) is not int or not _ZSTD_MIN_LEVEL <= self.level <= _ZSTD_MAX_LEVEL
        ):
            raise ConfigError(
                f"level must be None or a zstd level in [-131072, 22], got {self.level!r}"
            )
        if type(self.threads) is not int or self.threads < 0:
            raise ConfigError(f"threads must be an int >= 0, got {self.threads!r}")
        if type(self.frame_bytes) is not int or self.frame_bytes < 4096 or self.frame_bytes % 64:
            raise ConfigError(
                f"frame_bytes must be a multiple of 64 and at least 4096, got {self.frame_bytes!r}"
            )
        if type(self.sample_bytes) is not int or self.sample_bytes < 64:
            raise ConfigError(f"sample_bytes must be an int >= 64, got {self.sample_bytes!r}")
        if not 0.0 <= self.min_gain < 1.0:
            raise ConfigError(f"min_gain must be in [0, 1), got {self.min_gain!r}")

    @property
    def entropy(self) -> bool:
        """Whether the zstd stage runs."""
        return bool(self.level)

    @property
    def workers(self) -> int:
        """Frames encoded concurrently."""
        return self.threads or os.cpu_count() or 1
