"""Which number of ranks saved which version: the world-size history of a job.

A job restored onto another number of ranks (``elastic=True``) goes on saving with the new
number. Its stored versions then come from two worlds, and a version's blobs must be read the way
its world wrote them: rank ``r``'s blob of a version saved by 4 ranks is not rank ``r``'s state
in a world of 2. The history is a tuple of spans ``(first_version, world_size)`` in version order:
every version from ``first_version`` up to the next span's first version was saved by
``world_size`` ranks. The empty history means a job that never changed its world size. It is
kept in the job record (durable tiers) and in each node's identity (memory tiers), next to the
current ``world_size``, which is always the last span's.
"""

from __future__ import annotations

from collections.abc import Sequence

from tiercheck.errors import FormatError

__all__ = ["Spans", "parse_spans", "span_after", "spans_of", "world_of"]

#: ``(first_version, world_size)`` pairs, first versions strictly increasing.
Spans = tuple[tuple[int, int], ...]


def parse_spans(data: object, world_size: int) -> Spans:
    """Check a stored history (JSON lists or tuples) against the current ``world_size``."""
    if data is None or data in ((), []):
        return ()
    if not isinstance(data, Sequence) or isinstance(data, (str, bytes)):
        raise FormatError(f"a world-size history must be a list of pairs, got {data!r}")
    spans: list[tuple[int, int]] = []
    for item in data:
        if (
            not isinstance(item, Sequence)
            or len(item) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in item)
            or item[0] < 0
            or item[1] < 1
        ):
            raise FormatError(
                f"a world-size history entry must be [first_version >= 0, world_size >= 1], "
                f"got {item!r}"
            )
        if spans and item[0] <= spans[-1][0]:
            raise FormatError(f"world-size history entries must increase in version: {data!r}")
        spans.append((int(item[0]), int(item[1])))
    if spans[-1][1] != world_size:
        raise FormatError(
            f"the world-size history {data!r} ends with {spans[-1][1]} ranks, the record says "
            f"{world_size}"
        )
    return tuple(spans)


def world_of(version: int, spans: Spans, world_size: int) -> int:
    """The number of ranks that saved ``version`` (``world_size`` for a job without history)."""
    found = spans[0][1] if spans else world_size
    for first, size in spans:
        if first > version:
            break
        found = size
    return found


def span_after(spans: Spans, old_world: int, first_version: int, new_world: int) -> Spans:
    """The history once versions from ``first_version`` on are saved by ``new_world`` ranks.

    Spans starting at or after ``first_version`` are dropped (those versions were abandoned by
    the restore that changed the world size).
    """
    kept = [s for s in (spans or ((0, old_world),)) if s[0] < first_version]
    if not kept:
        return ((0, new_world),)
    if kept[-1][1] == new_world:
        return tuple(kept)
    return (*kept, (first_version, new_world))


def spans_of(saved_by: Sequence[tuple[int, int]]) -> Spans:
    """The history that ``(version, world_size)`` pairs (each version with the number of ranks
    that saved it, as ``COMMIT`` records say) follow; the first span starts at version 0.
    The empty history when one world saved them all (or there are none)."""
    ordered = sorted(saved_by)
    if not ordered or len({w for _, w in ordered}) == 1:
        return ()
    spans: list[tuple[int, int]] = [(0, ordered[0][1])]
    for version, world in ordered[1:]:
        if world != spans[-1][1]:
            spans.append((version, world))
    return tuple(spans)
