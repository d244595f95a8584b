"""Which of a rank's blobs a tier may drop: pure policy, no I/O.

Every rank applies the same rule to its own blobs. The rule is driven by the *committed*
versions, which are global, so all ranks keep the same versions.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

__all__ = ["UNKNOWN_BASE", "evictable"]

#: In ``own``: a blob whose base is not known (a packed blob found in a tier after the node's
#: manifest was lost). Retention then keeps every older version while that blob is kept.
UNKNOWN_BASE = -1


def evictable(
    *,
    committed: Collection[int],
    own: Mapping[int, int | None],
    keep: int,
    settled_upto: int,
    protected: Collection[int] = (),
) -> list[int]:
    """Versions of this rank's blobs that may be deleted from a tier, ascending.

    Args:
        committed: versions committed in the tier (whole for every rank).
        own: this rank's blobs in the tier: version -> the base version it needs (``None``
            when self-contained, :data:`UNKNOWN_BASE` when not known).
        keep: how many of the newest committed versions to keep (at least 1).
        settled_upto: the newest version whose commit decision is final; newer blobs are still
            in flight and never touched.
        protected: versions never to delete (for example the base the encoder is using).

    The newest ``keep`` committed versions stay, and so does the base of every one of them
    that is a delta: a base is never evicted while a retained delta needs it. Everything else
    up to ``settled_upto`` goes, including blobs of versions that never committed (failed or
    torn saves), which would otherwise leak. A kept blob whose base is unknown keeps every older
    blob: any of them may be its base.
    """
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    if not committed:
        return []
    kept = set(sorted(committed)[-keep:])
    needed = set(kept)
    for version in kept:
        base = own.get(version)
        if base == UNKNOWN_BASE:
            needed.update(v for v in own if v < version)
        elif base is not None:
            needed.add(base)
    shield = needed | set(protected)
    return sorted(v for v in own if v <= settled_upto and v not in shield)
