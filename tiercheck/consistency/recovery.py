"""Agreeing on the version to restore: pure functions over inventories, no I/O.

Each rank inventories what it can reach and reports, per tier, the versions it can rebuild
from there. The ranks then agree on ``v*``: the newest version that *every* rank can rebuild
from some tier. Torn versions (some rank has no whole copy anywhere) are never candidates.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["Inventory", "agree", "candidates"]


@dataclass(frozen=True)
class Inventory:
    """What one rank can rebuild: tier name -> versions, in its tier order (fastest first)."""

    rank: int
    by_tier: Mapping[str, frozenset[int]] = field(default_factory=dict)

    def versions(self) -> frozenset[int]:
        """Every version this rank can rebuild from some tier."""
        out: frozenset[int] = frozenset()
        for versions in self.by_tier.values():
            out |= versions
        return out

    def sources(self, version: int) -> list[str]:
        """The tiers that can serve ``version``, fastest first."""
        return [tier for tier, versions in self.by_tier.items() if version in versions]

    def to_wire(self) -> dict[str, list[int]]:
        """Plain data for exchange between ranks (msgpack-able, no pickle)."""
        return {tier: sorted(vs) for tier, vs in self.by_tier.items()}

    @classmethod
    def from_wire(cls, rank: int, data: Mapping[str, Sequence[int]]) -> Inventory:
        """Inverse of :meth:`to_wire`."""
        return cls(rank, {tier: frozenset(vs) for tier, vs in data.items()})


def candidates(inventories: Sequence[Inventory], *, at_most: int | None = None) -> list[int]:
    """Versions every rank can rebuild, newest first (optionally only those <= ``at_most``)."""
    if not inventories:
        return []
    common = inventories[0].versions()
    for inv in inventories[1:]:
        common &= inv.versions()
    return sorted((v for v in common if at_most is None or v <= at_most), reverse=True)


def agree(
    inventories: Sequence[Inventory], *, excluded: frozenset[int] = frozenset()
) -> int | None:
    """``v*``: the newest version every rank can rebuild, not in ``excluded``; ``None`` if none."""
    for version in candidates(inventories):
        if version not in excluded:
            return version
    return None
