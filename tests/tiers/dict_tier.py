"""A minimal third-party tier: blobs in a dict. Used as an entry-point plugin in the tests.

Deliberately self-contained (it imports only tiercheck's public names), because the registry
tests copy this file into a temporary folder and load it as another distribution's module.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from tiercheck.errors import BlobNotFound, InvalidKey
from tiercheck.tiers import Buffer, FailureScope, Tier, validate_key


class DictTier(Tier):
    """Blobs in a process-local dict; survives nothing beyond the process."""

    name = "dict"
    survives = FailureScope.PROCESS

    def __init__(self) -> None:
        self.blobs: dict[str, bytes] = {}

    async def put(self, key: str, data: Buffer) -> None:
        """Store a copy of ``data`` (replacing the dict entry is atomic)."""
        self._check_open()
        validate_key(key)
        self.blobs[key] = memoryview(data).tobytes()

    async def get(self, key: str) -> bytes:
        """Return the stored bytes."""
        self._check_open()
        validate_key(key)
        try:
            return self.blobs[key]
        except KeyError:
            raise BlobNotFound(f"no blob {key!r} in {self!r}") from None

    async def delete(self, key: str) -> None:
        """Drop the entry if present."""
        self._check_open()
        validate_key(key)
        self.blobs.pop(key, None)

    async def exists(self, key: str) -> bool:
        """Whether the entry is present."""
        self._check_open()
        validate_key(key)
        return key in self.blobs

    async def list(self, prefix: str = "") -> AsyncIterator[str]:
        """Keys starting with ``prefix``."""
        self._check_open()
        if not isinstance(prefix, str):
            raise InvalidKey(f"a prefix must be a str, got {type(prefix).__name__}")
        for key in [k for k in self.blobs if k.startswith(prefix)]:
            yield key


class NotATier:
    """Something a broken plugin might point its entry point at by mistake."""
