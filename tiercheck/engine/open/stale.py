"""Why a node's memory is not taken as this run's, and what the user is told about it.

:meth:`tiercheck.engine.open.claim.Claim.judge` decides; this is what it says, in the
:class:`~tiercheck.errors.StaleMemory` it raises.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from tiercheck.consistency.protocol import OpenFacts

__all__ = ["Stale", "made_at", "stale_message"]


@dataclass(frozen=True, slots=True)
class Stale:
    """Why a node's memory is not taken as this run's.

    ``kind``: ``"damaged"`` (its identity record is cut short or garbled), ``"unreadable"``
    (it cannot be read: written by a newer build, or an I/O error), ``"predates"`` (checkpoints
    without an identity, and a durable location that holds nothing), ``"another-location"``
    (this job's memory of another durable location), ``"another-run"`` (another job, or
    another incarnation of this one at the same location).
    """

    kind: str
    text: str


def made_at(created: float) -> str:
    """When a node's memory was made (``created``: seconds since the epoch; 0 is unknown)."""
    if not created:
        return "at an unknown time"
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(created))


def stale_message(
    job_id: str,
    node_root: str,
    stale: Mapping[int, Stale],
    first: OpenFacts,
    nodes: Mapping[int, OpenFacts],
) -> str:
    """The :class:`~tiercheck.errors.StaleMemory` message: each node's case, what its memory
    holds and whether that is anywhere else, and what to do about each case."""
    job = first.job or {}
    durable = set(job.get("committed") or ())
    lines = []
    lost: list[int] = []
    for n, why in sorted(stale.items()):
        held = sorted(int(v) for v in nodes[n].held or ())
        only = [v for v in held if v not in durable]
        line = f"node {n}: {why.text}; it holds versions {held if held else 'none'}"
        if only and why.kind in ("damaged", "predates"):
            line += f" ({only} of them in no durable storage of this job: only there)"
            lost.extend(only)
        lines.append(line)
    kinds = {why.kind for why in stale.values()}
    advice = []
    if kinds & {"damaged", "predates"}:
        warn = f" -- and with it the only copy of versions {sorted(set(lost))}" if lost else ""
        advice.append(
            "If this run wrote that memory (its identity record was damaged or removed, by a "
            "cleanup script say), pass stale_memory='adopt' to use it as this run's; "
            f"stale_memory='discard' deletes it{warn}."
        )
    if "another-location" in kinds:
        advice.append(
            "To continue the run that memory belongs to, point persistent= at its durable "
            "location (named above). stale_memory='discard' deletes it; versions it holds "
            "that that location does not are then lost."
        )
    if "unreadable" in kinds:
        advice.append(
            "Read the identity record's error above: a newer tiercheck wrote it (upgrade), or the "
            "memory cannot be read; stale_memory='discard' deletes that memory."
        )
    if "another-run" in kinds:
        advice.append(
            "That memory is another run's and is never restored as this one's; "
            "stale_memory='discard' deletes it (a copy of that run's versions, unless they "
            "were only there)."
        )
    return (
        f"the shared memory of job {job_id!r} (for this rank: {node_root}) is not known to be "
        "this run's, so the job does not open:\n  "
        + "\n  ".join(lines)
        + "\n"
        + "\n".join(advice)
        + "\nOr use another job_id (or another local_root). Nothing was changed."
    )
