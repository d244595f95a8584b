"""Planning a save: every decision about what a save becomes, from plain inputs.

:func:`plan_save` is the one place that decides, for a save about to be taken: whether it is
skipped (back-pressure), a base or a delta (and against which base), which tiers it goes to
and in which encoding, and which tier's own memory the snapshot is copied into. The rest of
the engine executes the :class:`SavePlan`: the schedule (:mod:`tiercheck.engine.schedule`)
gathers the inputs and keeps what the plan changes, the stager copies where the plan says, the
encoder encodes for the plan's tiers, the lanes write.

Two decisions can only be made later, and are named here too: a delta whose base is not in memory
in memory when it is encoded is encoded as a base instead (:func:`base_unusable`), and a tier
whose lane is ``tier_queue`` versions behind drops the version (:func:`queue_full`).

Nothing here does I/O, awaits, or touches an engine object: the rules are tested on their own
(tests/engine/test_plan.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from tiercheck.engine.options import BusyPolicy, TierEncoding, TierPolicy

__all__ = [
    "SaveInputs",
    "SaveKind",
    "SavePlan",
    "base_unusable",
    "plan_save",
    "queue_full",
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
      version as is (``"full"``) -- provided the state is on the host, or the pool lends no
      pinned memory (a GPU state goes to a pinned buffer: a device copy into shared memory
      could not be asynchronous). Else into a staging buffer.
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
    encodings = dict(targets)
    stage_in = None
    if inputs.on_host or not inputs.pinned:
        stage_in = next((n for n in inputs.reservable if encodings.get(n) == "full"), None)
    return SavePlan(
        inputs.version,
        "base" if base else "delta",
        None if base else inputs.planned_base,
        scheduled_base,
        targets,
        stage_in,
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
