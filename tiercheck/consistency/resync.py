"""How the ranks of one tier's commit rounds get back into step: pure rules, no I/O.

Each tier's commit rounds run on a channel of their own, in version order, one or two exchanges
each (``vote``, then ``ack`` in a tier with ``COMMIT`` records), every exchange tagged with the
round's version (:func:`tiercheck.engine.collectives.step`). A rank that pauses for longer than
the timeout (swapping, a stop signal, a long collection) makes the others time out of a round
it has not entered yet; the channel then reconnects (:mod:`tiercheck.consistency.coordinator`),
and the ranks meet again -- but not necessarily at the same round: the others went on to later
versions while the paused rank still stands where it stopped.

The *position* of a rank is the round's version and its phase (``vote`` before ``ack``). When
the ranks of one exchange stand at different positions (:class:`~tiercheck.engine.collectives.
OutOfStep`), nobody's message is used, and :func:`resync` says what each does:

* a rank **behind** the furthest one fails its round, and every later round below the
  furthest one's version without exchanging at all (:attr:`Resync.floor`): the furthest rank
  is past those rounds, so none of them can be committed any more (a commit needs every rank's
  word in one exchange);
* a rank **at** the furthest position exchanges again with the same message: the others skip
  up to it.

So the ranks meet at the furthest version that every rank still has to decide, and a version is
committed only in an exchange where every rank stood at that version and said yes. An exchange
that failed on one rank may have completed on another (the last message got through one way);
such a round's outcome is *unsure* on the rank that failed it (:func:`unsure_kept`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

__all__ = ["PHASES", "Resync", "position_key", "resync", "unsure_kept"]

#: The steps of a commit round, in the order a round takes them.
PHASES: dict[str, int] = {"vote": 0, "ack": 1}


@dataclass(frozen=True, slots=True)
class Resync:
    """What a rank does after an exchange whose ranks were out of step."""

    #: This rank is behind the furthest one: its round fails.
    behind: bool
    #: Rounds of versions below this fail without an exchange (``-1``: none).
    floor: int
    #: The furthest position: its version and phase.
    furthest: tuple[int, int]


def position_key(position: tuple[str, int | None]) -> tuple[int, int]:
    """A position as ``(version, phase)``, in the order the rounds take them; anything that
    is no commit step sorts first."""
    step, tag = position
    if tag is None or step not in PHASES:
        return (-1, -1)
    return (tag, PHASES[step])


def resync(mine: tuple[str, int], positions: Sequence[tuple[str, int | None]]) -> Resync:
    """What this rank does when the ranks of an exchange stood at ``positions`` (by rank,
    each ``(step, version)``) and this rank at ``mine``.

    Behind the furthest position: fail this round and skip every round below the furthest
    version. At it: exchange again. (Ahead of it cannot be: ``mine`` is among ``positions``.)
    """
    furthest = max((position_key(p) for p in positions), default=(-1, -1))
    here = position_key(mine)
    if here < furthest:
        return Resync(True, furthest[0], furthest)
    return Resync(False, -1, furthest)


def unsure_kept(unsure: Collection[int], committed: Collection[int], keep: int) -> set[int]:
    """The versions of ``unsure`` that retention must still keep.

    A round that failed on this rank with a peer error after it voted yes may have been
    completed -- and the version committed -- by the others. Its blob stays until ``keep``
    committed versions newer than it exist: by then no rank keeps it, whatever it decided.
    """
    ordered = sorted(committed)
    if len(ordered) < keep:
        return set(unsure)
    # Below the oldest of the newest `keep` committed versions, `keep` newer ones exist.
    return {v for v in unsure if v >= ordered[-keep]}
