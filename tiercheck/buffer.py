"""The one bytes-like type the tiers and the codec pass around.

A leaf module (it imports nothing of tiercheck), so that both the tiers and the codec, which may
not import each other, name the same type.
"""

from __future__ import annotations

__all__ = ["Buffer"]

#: Any contiguous bytes-like object: a whole blob, or one of the parts whose concatenation is
#: a blob. What tiers accept and return.
Buffer = bytes | bytearray | memoryview
