"""Where blobs live: the :class:`Tier` interface, the built-in tiers, and the tier registry.

* :class:`LocalTier` -- this node's shared memory (survives a process crash).
* ``PeerTier`` -- a copy in another node's memory (survives the loss of a node).
* :class:`PersistentTier` -- any fsspec URL (survives the loss of every node).
* :class:`DelegatingTier` -- forwards everything to another tier; the base of tiers that add
  behaviour around one (fault injection, latency, metrics).

Third-party tiers are found by name through :func:`get_tier_class` (entry-point group
``tiercheck.tiers``); :mod:`tiercheck.testing` ships the conformance suite every tier runs.
"""

from __future__ import annotations

import importlib
from typing import Any

from tiercheck.tiers.base import (
    Buffer,
    FailureScope,
    Reservation,
    SupportsCopy,
    SupportsFileRead,
    SupportsPrepare,
    SupportsRangedGet,
    SupportsReserve,
    Tier,
    validate_key,
)
from tiercheck.tiers.local import LocalTier
from tiercheck.tiers.persistent import PersistentTier, RetryPolicy
from tiercheck.tiers.registry import available_tiers, get_tier_class
from tiercheck.tiers.wrapper import DelegatingTier

__all__ = [
    "Buffer",
    "DelegatingTier",
    "FailureScope",
    "LocalTier",
    "PersistentTier",
    "Reservation",
    "RetryPolicy",
    "SupportsCopy",
    "SupportsFileRead",
    "SupportsPrepare",
    "SupportsRangedGet",
    "SupportsReserve",
    "Tier",
    "available_tiers",
    "get_tier_class",
    "validate_key",
]

# Imported on first access: the peer tier pulls in torch.distributed, which plain users of the
# local and persistent tiers should not pay for.
_LAZY = {"PeerTier": "tiercheck.tiers.peer"}


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        raise AttributeError(
            f"module {__name__!r} has no attribute {name!r}: {module_name} is not available "
            "in this build"
        ) from exc
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
