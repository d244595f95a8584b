"""The commit protocol, top to bottom: what the ranks tell each other, and the rules they apply.

Pure data and pure functions, no I/O; the engine (:mod:`tiercheck.engine.commit`,
:mod:`tiercheck.engine.restore`) does the exchanging and the storing. Every message goes over a
side channel as plain msgpack-able data (:meth:`to_wire` / :meth:`from_wire`, never pickle).

Saving version ``v`` to tier ``T``, per rank, in order:

1. **write** -- the rank writes its blob of ``v`` to ``T`` (``T``'s lane).
2. **vote** -- the rank sends a :class:`Vote` on ``T``'s channel: the blob's record if it is
   durable and, for a delta, its base is committed in ``T`` and still there; else a no.
3. **decide** -- every rank sees every vote: :func:`round_failures` lists the ranks that said no.
   With none, in a tier that outlives the cluster, rank 0 writes the ``COMMIT`` record
   (:func:`commit_record`) and tells everyone whether it landed (a :class:`CommitAck`).
4. **committed** -- ``v`` is committed in ``T``: in the round's outcome, and from then on by
   :func:`committed_in_tier` (``COMMIT`` records in a durable tier; the node's manifest and the
   blobs this rank holds in a memory tier; what every rank holds, adopted by a restore,
   :func:`whole_in_tier`).

Restoring: every rank sends its :class:`~tiercheck.consistency.recovery.Inventory`; all agree on
the newest version every rank can rebuild (:func:`~tiercheck.consistency.recovery.agree`); each
reads it and sends a :class:`RestoreVerdict`; a version that failed on any rank is passed over.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

from tiercheck.consistency.commit import CommitEntry, CommitRecord
from tiercheck.consistency.recovery import Inventory

__all__ = [
    "AckReason",
    "CommitAck",
    "RestoreVerdict",
    "Vote",
    "commit_record",
    "committed_in_tier",
    "round_failures",
    "whole_in_tier",
]

#: Why rank 0 could not write a ``COMMIT`` record ("" when it did).
AckReason = Literal["", "base-missing", "superseded", "error"]


@dataclass(frozen=True, slots=True)
class Vote:
    """One rank's word in a commit round of one version in one tier.

    ``ok`` says the rank's blob is durable in the tier (and, for a delta, its base is committed
    there and still present). The blob's record travels with the vote whenever the rank has
    one, yes or no: rank 0 lists it in the ``COMMIT`` record, and a vanished base is named.
    """

    ok: bool
    #: The rank found the delta's base gone from the tier.
    base_missing: bool = False
    key: str | None = None
    size: int = 0
    checksum: int = 0
    raw_digest: int = 0
    #: The version the blob is a delta on (``None``: self-contained).
    base: int | None = None

    def to_wire(self) -> dict[str, Any]:
        """Plain data for exchange between ranks (msgpack-able, no pickle)."""
        wire: dict[str, Any] = {"ok": self.ok, "base_missing": self.base_missing}
        if self.key is not None:
            wire.update(
                key=self.key,
                size=self.size,
                checksum=self.checksum,
                raw_digest=self.raw_digest,
                base=self.base,
            )
        return wire

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> Vote:
        """Inverse of :meth:`to_wire`."""
        if "key" not in data:
            return cls(bool(data["ok"]), bool(data.get("base_missing", False)))
        return cls(
            ok=bool(data["ok"]),
            base_missing=bool(data.get("base_missing", False)),
            key=str(data["key"]),
            size=int(data["size"]),
            checksum=int(data["checksum"]),
            raw_digest=int(data["raw_digest"]),
            base=None if data["base"] is None else int(data["base"]),
        )

    def entry(self, rank: int) -> CommitEntry:
        """The line of the ``COMMIT`` record for this vote's blob."""
        if self.key is None:
            raise ValueError(f"rank {rank} voted without a blob; it has no COMMIT entry")
        return CommitEntry(
            rank=rank,
            key=self.key,
            size=self.size,
            checksum=self.checksum,
            raw_digest=self.raw_digest,
            base=self.base,
        )


@dataclass(frozen=True, slots=True)
class CommitAck:
    """Rank 0's word, after a unanimous vote in a durable tier: did the ``COMMIT`` record land?"""

    ok: bool
    why: AckReason = ""

    def to_wire(self) -> dict[str, Any]:
        """Plain data for exchange between ranks (msgpack-able, no pickle)."""
        return {"ok": self.ok, "why": self.why}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> CommitAck:
        """Inverse of :meth:`to_wire`."""
        return cls(bool(data["ok"]), cast(AckReason, str(data["why"])))


@dataclass(frozen=True, slots=True)
class RestoreVerdict:
    """One rank's word on the version chosen for a restore.

    ``ok``: the rank read its blob and it fits the caller's state. ``reasons`` say why each
    tier could not serve it; ``refusal`` (``(kind, message)``) says the caller's state cannot
    take the version at all (``kind`` is ``"StateMismatch"`` or ``"UnsupportedObject"``).
    """

    ok: bool
    #: The tier the rank read from (``None`` when none could serve it).
    source: str | None
    reasons: tuple[str, ...] = ()
    refusal: tuple[str, str] | None = None

    def to_wire(self) -> dict[str, Any]:
        """Plain data for exchange between ranks (msgpack-able, no pickle)."""
        return {
            "ok": self.ok,
            "source": self.source,
            "reasons": list(self.reasons),
            "refusal": None if self.refusal is None else list(self.refusal),
        }

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> RestoreVerdict:
        """Inverse of :meth:`to_wire`."""
        refusal = data["refusal"]
        return cls(
            ok=bool(data["ok"]),
            source=None if data["source"] is None else str(data["source"]),
            reasons=tuple(str(r) for r in data["reasons"]),
            refusal=None if not refusal else (str(refusal[0]), str(refusal[1])),
        )


def round_failures(votes: Sequence[Vote]) -> list[int]:
    """The ranks that voted no; the version is committed only when there are none."""
    return [rank for rank, vote in enumerate(votes) if not vote.ok]


def commit_record(job_id: str, version: int, votes: Sequence[Vote], when: float) -> CommitRecord:
    """The ``COMMIT`` record of a unanimous round: every rank's blob, by rank."""
    return CommitRecord(
        job_id=job_id,
        version=version,
        world_size=len(votes),
        time=when,
        entries=tuple(vote.entry(rank) for rank, vote in enumerate(votes)),
    )


def committed_in_tier(
    *, commit_records: bool, recorded: Collection[int], held: Collection[int]
) -> set[int]:
    """The versions committed in one tier: the one definition of "committed".

    Args:
        commit_records: whether the tier outlives the cluster, so that its commits are proven
            by ``COMMIT`` records stored in it.
        recorded: the versions with a ``COMMIT`` record in the tier (``commit_records``), or
            else the versions the node's manifest saw committed there.
        held: the versions whose blobs are in the tier (this rank's, or any rank's).

    In a durable tier a ``COMMIT`` record is the proof, written only once every rank's blob was
    durable. In a memory tier the manifest remembers the commit, but only a version whose blob
    is still there counts (memory is lost with its node). A version whole in a memory tier that
    the manifest missed (a crash between the commit and its record) becomes committed when a
    restore adopts it: see :func:`whole_in_tier`.
    """
    if commit_records:
        return set(recorded)
    held = set(held)
    return {v for v in recorded if v in held}


def whole_in_tier(tier: str, held: Collection[int], inventories: Sequence[Inventory]) -> set[int]:
    """Versions of ``held`` (this rank's blobs in ``tier``) that every rank holds there too,
    as the inventories exchanged for a restore show: whole, hence committed."""
    whole = set(held)
    for inventory in inventories:
        whole &= inventory.by_tier.get(tier, frozenset())
    return whole
