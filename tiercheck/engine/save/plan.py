"""Planning a save: every decision about what a save becomes, from plain inputs.

:func:`plan_save` is the one place that decides, for a save about to be taken: whether it is
skipped (back-pressure), a base or a delta (and against which base), which tiers it goes to
and in which encoding, and which tier's own memory the snapshot is copied into. The rest of
the engine executes the :class:`SavePlan`: the schedule (:mod:`tiercheck.engine.save.schedule`)
gathers the inputs and keeps what the plan changes, the stager copies where the plan says, the
encoder encodes for the plan's tiers, the lanes write.

Other decisions can only be made later, and are named here too: a delta whose base is not in
memory when it is encoded is encoded as a base instead (:func:`base_unusable`); a tier whose
lane is ``tier_queue`` versions behind (:func:`queue_full`) passes over the oldest versions
waiting, never the newest whole one (:func:`make_room`); and a durable tier that failed a write
(an outage) sends the newest whole version next, passing over every older one waiting
(:func:`catch_up`).

Which versions a lane passes over is a pure function of versions and their bases, so the
newest whole version offered is never passed over for an older one, on any rank. How many
waited when a rank's lane filled up, or when its write failed, depends on that rank's timing:
a version one rank passed over commits on no rank (its round fails everywhere), which costs a
wasted write, never a round out of step -- every rank holds a round for every version launched
(:mod:`tiercheck.engine.commit.commit`), whatever its lane did with it.

Nothing here does I/O, awaits, or touches an engine object: the rules are tested on their own
(tests/engine/save/test_plan.py).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from tiercheck.defaults import encoding_kind
from tiercheck.engine.options import BusyPolicy, TierEncoding, TierPolicy

__all__ = [
    "Kept",
    "SaveInputs",
    "SaveKind",
    "SavePlan",
    "Waiting",
    "base_unusable",
    "catch_up",
    "make_room",
    "plan_save",
    "queue_full",
    "staging_tier",
    "waits_for_slot",
]

#: What a save becomes.
SaveKind = Literal["base", "delta", "skipped"]


@dataclass(frozen=True, slots=True)
class SaveInputs:
    """Everything a save's plan depends on, as plain values.

    Attributes:
        version: the version being saved.
        count: saves scheduled since opening (or since the restore), this one excluded.
        base_every: every ``base_every``-th save is scheduled as a base.
        policies: each tier's policy, in tier order (fastest first).
        busy: whether ``max_pending`` saves were being encoded when this one was called.
        on_busy: what a busy save does: ``"wait"`` for a slot, or ``"skip"``.
        planned_base: the base the next delta would be encoded against (``None``: none yet).
        force_base: a delta's base vanished from a tier: this save must be a base.
        reservable: the tiers that can hand out their own memory for a snapshot, in tier order.
        on_host: whether every tensor of the state is in host memory.
        pinned: whether the staging pool lends pinned memory (for copies from a GPU).
    """

    version: int
    count: int
    base_every: int
    policies: Mapping[str, TierPolicy]
    busy: bool = False
    on_busy: BusyPolicy = "wait"
    planned_base: int | None = None
    force_base: bool = False
    reservable: Sequence[str] = ()
    on_host: bool = True
    pinned: bool = False


@dataclass(frozen=True, slots=True)
class SavePlan:
    """What one save becomes; see :func:`plan_save`.

    Attributes:
        version: the version being saved.
        kind: ``"base"``, ``"delta"``, or ``"skipped"`` (back-pressure: nothing is stored).
        base: the base a delta is encoded against; ``None`` for a base or a skip.
        scheduled_base: whether the schedule made this save a base (``base_every``); a
            tier that takes only bases takes exactly these.
        targets: the tiers the version goes to and the encoding each stores, in tier order.
        stage_in: the tier whose own memory the snapshot is copied into (stored there as is
            once published); ``None``: a staging buffer.
    """

    version: int
    kind: SaveKind
    base: int | None
    scheduled_base: bool
    targets: tuple[tuple[str, TierEncoding], ...]
    stage_in: str | None = None

    @property
    def encodings(self) -> dict[str, TierEncoding]:
        """:attr:`targets` as a dict: tier name to encoding (a new dict each time)."""
        return dict(self.targets)


def waits_for_slot(busy: bool, on_busy: BusyPolicy) -> bool:
    """Whether a save called while ``busy`` waits for a slot before it is planned."""
    return busy and on_busy == "wait"


def plan_save(inputs: SaveInputs) -> SavePlan:
    """The plan of one save.

    Rules, in order:

    - The save is scheduled as a base when it is the ``base_every``-th since opening or
      since a restore (``count % base_every == 0``).
    - A tier takes the version when its policy selects it (:meth:`TierPolicy.targets`:
      ``"all"``; ``"base"``: scheduled bases only; a predicate: scheduled bases and the
      versions it selects), in the encoding of its policy.
    - A busy save (``max_pending`` encoding) with ``on_busy="skip"`` is skipped: no base, no
      staging tier, same targets (each reports the skip).
    - Otherwise it is a base when scheduled as one, when no base is planned yet, or when a
      delta's base vanished (``force_base``); else a delta against ``planned_base``.
    - The snapshot is copied into the memory of the first reservable tier that stores the
      version as is (:attr:`~tiercheck.defaults.EncodingKind.as_is`: ``"full"``) -- provided
      the state is on the host, or the pool lends no pinned memory (a GPU state goes to a
      pinned buffer: a device copy into shared memory could not be asynchronous). Else into a
      staging buffer.
    """
    scheduled_base = inputs.count % inputs.base_every == 0
    targets = tuple(
        (name, policy.encoding)
        for name, policy in inputs.policies.items()
        if policy.targets(inputs.version, scheduled_base)
    )
    if inputs.busy and inputs.on_busy == "skip":
        return SavePlan(inputs.version, "skipped", None, scheduled_base, targets)
    base = scheduled_base or inputs.planned_base is None or inputs.force_base
    stage_in = staging_tier(
        inputs.reservable, dict(targets), on_host=inputs.on_host, pinned=inputs.pinned
    )
    return SavePlan(
        inputs.version,
        "base" if base else "delta",
        None if base else inputs.planned_base,
        scheduled_base,
        targets,
        stage_in,
    )


def staging_tier(
    reservable: Sequence[str], encodings: Mapping[str, TierEncoding], *, on_host: bool, pinned: bool
) -> str | None:
    """The tier whose memory a snapshot is copied into (see :func:`plan_save`): the first of
    ``reservable`` that ``encodings`` (the tiers the version goes to) stores as is, for a state
    on the host or without pinned staging; ``None``: a staging buffer."""
    if not on_host and pinned:
        return None
    return next(
        (n for n in reservable if n in encodings and encoding_kind(encodings[n]).as_is), None
    )


def base_unusable(kind: SaveKind, base: int | None, held: int | None) -> bool:
    """Whether a save planned as ``kind`` against ``base`` must be encoded as a base after
    all: it is a delta, and the base in memory (``held``; ``None``: none) is not its
    base (that base failed, or a restore let it go)."""
    return kind == "delta" and (held is None or held != base)


def queue_full(queued: int, tier_queue: int) -> bool:
    """Whether a tier whose lane holds ``queued`` versions drops the next one for itself
    (rather than hold training's memory for it)."""
    return queued >= tier_queue


@dataclass(frozen=True, slots=True)
class Waiting:
    """A version waiting in a tier's lane (or just offered to it), as :func:`make_room` and
    :func:`catch_up` see it.

    Attributes:
        version: the version.
        base: the version its blob is a delta against; ``None`` for a self-contained blob (a
            base, or a version stored as is).
    """

    version: int
    base: int | None = None


@dataclass(frozen=True, slots=True)
class Kept:
    """What a lane keeps of the versions waiting for its tier (:func:`make_room`,
    :func:`catch_up`).

    Attributes:
        keep: the versions that stay, oldest first (the order they are written in).
        drop: the versions passed over for this tier, oldest first.
    """

    keep: tuple[int, ...]
    drop: tuple[int, ...]


def _needs(w: Waiting, held: Collection[int], selfcontained: Collection[int]) -> set[int] | None:
    """What must stay for ``w`` to be whole: itself, and its base where that only waits too;
    ``None`` when it can never be whole (its base is neither held nor waiting)."""
    if w.base is None or w.base in held:
        return {w.version}
    if w.base in selfcontained and w.base < w.version:
        return {w.base, w.version}
    return None


def _ordered(waiting: Sequence[Waiting], room: int) -> list[Waiting]:
    if room < 1:
        raise ValueError(f"room must be >= 1, got {room}")
    ordered = sorted(waiting, key=lambda w: w.version)
    versions = [w.version for w in ordered]
    if len(set(versions)) != len(versions):
        raise ValueError(f"a version waits twice: {versions}")
    return ordered


def make_room(waiting: Sequence[Waiting], held: Collection[int], room: int) -> Kept:
    """A tier's lane is full: ``waiting`` (the versions queued for the tier and the one just
    offered) are more than its ``room`` (``tier_queue``). Which stay?

    The newest whole versions that fit, not the oldest: going from the newest down, a version
    stays when it is whole and fits with what stays already -- whole: its blob is
    self-contained, or a delta whose base is in ``held`` (what the tier holds or commits for
    this rank, the version being written included) or waits too, self-contained, and then
    stays with it. So the fewest versions are passed over, the oldest first, the newest whole
    one never; a delta that could never be whole (its base is nowhere) goes too.
    """
    ordered = _ordered(waiting, room)
    selfcontained = {w.version for w in ordered if w.base is None}
    kept: set[int] = set()
    for w in reversed(ordered):
        needs = _needs(w, held, selfcontained)
        if needs is not None and len(kept | needs) <= room:
            kept |= needs
    return Kept(
        tuple(w.version for w in ordered if w.version in kept),
        tuple(w.version for w in ordered if w.version not in kept),
    )


def catch_up(waiting: Sequence[Waiting], held: Collection[int], room: int) -> Kept:
    """A durable tier failed a write (it is down, or was): the versions that ``waiting`` for it
    meanwhile are stale. Which stay?

    Only the newest whole version (see :func:`make_room` for "whole"), with its base where that
    waits too and must be sent first, within ``room``: the tier sends the newest state it can
    once it works again, instead of catching up through every version that queued up while it
    did not. Nothing stays when no version can be whole.
    """
    ordered = _ordered(waiting, room)
    selfcontained = {w.version for w in ordered if w.base is None}
    kept: set[int] = set()
    for w in reversed(ordered):
        needs = _needs(w, held, selfcontained)
        if needs is not None and len(needs) <= room:
            kept = needs
            break
    return Kept(
        tuple(w.version for w in ordered if w.version in kept),
        tuple(w.version for w in ordered if w.version not in kept),
    )
