"""The flush on SIGTERM, top to bottom: what the ranks tell each other, and the rules they apply.

When a job is preempted, its ranks get SIGTERM and a grace period before SIGKILL. Versions
committed only in memory (the deltas a ``persist="base"`` policy keeps out of durable tiers, or
versions a slow durable tier had not taken yet) would be lost with the cluster; the flush makes
the newest of them durable, as a new base, through four named steps on a channel of their own
(``"preempt"``, so that a flush that gives up never leaves a tier's own channel out of step):

1. **begin** -- each rank sends a :class:`PreemptBegin`: the newest version it launched, or why
   it cannot take part. Ranks get the signal between different steps of training, so one may
   have saved a version another never will: :func:`flush_horizon` is the newest version every
   rank launched, and only versions up to it are waited for and considered.
2. **offer** -- after the saves in flight up to that version settled in the memory tiers, each
   rank sends a :class:`PreemptOffer`: the versions committed in a memory tier whose blob of
   this rank is there, and the newest version committed in each durable tier.
   :func:`choose_flush` picks the newest version every rank offers and the durable tiers where
   nothing as new is committed yet.
3. **vote** -- per chosen tier, in order: each rank reads its blob of the version back from
   memory (verified), encodes it as a base, writes it to the tier and sends a :class:`FlushVote`
   (its blob's record, that the version is committed there already, or why not).
   :func:`flush_outcome` decides.
4. **ack** -- with every rank's blob written, rank 0 writes the version's ``COMMIT`` record and
   every rank learns whether it landed (a :class:`~tiercheck.consistency.protocol.CommitAck`).

Pure data and pure functions, no I/O: :mod:`tiercheck.engine.close.preempt` exchanges and stores.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tiercheck.consistency.commit import CommitEntry, CommitRecord

__all__ = [
    "FlushChoice",
    "FlushVote",
    "PreemptBegin",
    "PreemptOffer",
    "choose_flush",
    "flush_horizon",
    "flush_outcome",
    "flush_record",
]


@dataclass(frozen=True, slots=True)
class PreemptBegin:
    """Step ``PREEMPT_BEGIN``: the newest version this rank launched (``-1``: none), or why it
    cannot take part in the flush (``refusal``; ``""`` when it can)."""

    last: int
    refusal: str = ""

    def to_wire(self) -> dict[str, Any]:
        """Plain data for exchange between ranks (msgpack-able, no pickle)."""
        return {"last": self.last, "refusal": self.refusal}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> PreemptBegin:
        """Inverse of :meth:`to_wire`."""
        return cls(int(data["last"]), str(data["refusal"]))


@dataclass(frozen=True, slots=True)
class PreemptOffer:
    """Step ``PREEMPT_OFFER``: what this rank can make durable, and what is durable already.

    ``memory``: versions committed in a memory tier whose blob of this rank is there (up to the
    horizon). ``durable``: each durable tier's newest committed version (``-1``: none), in tier
    order. ``blocked``: durable tiers this rank cannot write now, with why.
    """

    memory: Sequence[int]
    durable: Mapping[str, int]
    blocked: Mapping[str, str] = field(default_factory=dict)
    refusal: str = ""

    def to_wire(self) -> dict[str, Any]:
        """Plain data for exchange between ranks (msgpack-able, no pickle)."""
        return {
            "memory": list(self.memory),
            "durable": list(self.durable.items()),
            "blocked": dict(self.blocked),
            "refusal": self.refusal,
        }

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> PreemptOffer:
        """Inverse of :meth:`to_wire`."""
        return cls(
            memory=[int(v) for v in data["memory"]],
            # Pairs, not a map: the tier order is part of the message.
            durable={str(name): int(v) for name, v in data["durable"]},
            blocked={str(k): str(v) for k, v in data["blocked"].items()},
            refusal=str(data["refusal"]),
        )


@dataclass(frozen=True, slots=True)
class FlushVote:
    """Step ``PREEMPT_VOTE``: one rank's word on making ``version`` durable in ``tier``.

    Either the rank wrote its blob (``key`` and the blob's record), or the version is committed
    there already (``already``: its own save's round committed it meanwhile), or ``why`` not.
    """

    version: int
    tier: str
    already: bool = False
    key: str | None = None
    size: int = 0
    checksum: int = 0
    raw_digest: int = 0
    why: str = ""

    @property
    def ok(self) -> bool:
        """Whether this rank's part is done (written, or committed already)."""
        return self.already or self.key is not None

    def to_wire(self) -> dict[str, Any]:
        """Plain data for exchange between ranks (msgpack-able, no pickle)."""
        wire: dict[str, Any] = {
            "version": self.version,
            "tier": self.tier,
            "already": self.already,
            "why": self.why,
        }
        if self.key is not None:
            wire.update(
                key=self.key, size=self.size, checksum=self.checksum, raw_digest=self.raw_digest
            )
        return wire

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> FlushVote:
        """Inverse of :meth:`to_wire`."""
        key = data.get("key")
        return cls(
            version=int(data["version"]),
            tier=str(data["tier"]),
            already=bool(data["already"]),
            key=None if key is None else str(key),
            size=int(data.get("size", 0)),
            checksum=int(data.get("checksum", 0)),
            raw_digest=int(data.get("raw_digest", 0)),
            why=str(data["why"]),
        )


@dataclass(frozen=True, slots=True)
class FlushChoice:
    """What :func:`choose_flush` decided: ``version`` to make durable in ``tiers`` (in order),
    or nothing (``version`` ``None`` or no tiers), and ``why`` in words; ``trouble`` says that
    a version is left out that should not be (a rank refused, a tier cannot be written)."""

    version: int | None
    tiers: tuple[str, ...]
    why: str
    trouble: bool = False


def _refusals(refusals: Sequence[str]) -> str:
    return "; ".join(f"rank {r}: {why}" for r, why in enumerate(refusals) if why)


def flush_horizon(begins: Sequence[PreemptBegin]) -> tuple[int | None, str]:
    """The newest version every rank launched (``None``: no flush), and why not when ``None``
    (a refusal's why starts with ``"not every rank"``).

    A rank that refuses stops the flush on every rank: the ``COMMIT`` record needs them all.
    """
    refused = _refusals([b.refusal for b in begins])
    if refused:
        return None, f"not every rank can take part ({refused})"
    horizon = min(b.last for b in begins)
    if horizon < 0:
        return None, "a rank saved nothing in this run"
    return horizon, ""


def choose_flush(offers: Sequence[PreemptOffer]) -> FlushChoice:
    """The version to make durable, and where.

    The newest version every rank offers from memory; it goes to each durable tier (in rank
    0's order) that every rank has, that no rank finds blocked, and whose newest committed
    version (as any rank sees it) is older. Nothing when a rank refuses or no version is
    offered by all.
    """
    refused = _refusals([o.refusal for o in offers])
    if refused:
        return FlushChoice(None, (), f"not every rank can take part ({refused})", trouble=True)
    common = set(offers[0].memory)
    for offer in offers[1:]:
        common &= set(offer.memory)
    if not common:
        return FlushChoice(None, (), "no version is committed in memory on every rank")
    version = max(common)
    tiers: list[str] = []
    why: list[str] = []
    trouble = False
    for name in offers[0].durable:
        newest = max(o.durable.get(name, -1) for o in offers)
        blocked = [
            f"rank {r}: {o.blocked[name]}" for r, o in enumerate(offers) if name in o.blocked
        ]
        if newest >= version:
            why.append(f"{name!r} holds version {newest} already")
        elif any(name not in o.durable for o in offers):
            why.append(f"{name!r} is not a tier of every rank")
            trouble = True
        elif blocked:
            why.append(f"{name!r} cannot be written ({'; '.join(blocked)})")
            trouble = True
        else:
            tiers.append(name)
    if not offers[0].durable:
        why.append("the job has no durable tier")
    return FlushChoice(version, tuple(tiers), "; ".join(why), trouble)


def flush_outcome(votes: Sequence[FlushVote], version: int, tier: str) -> tuple[bool, list[int]]:
    """``(already, failed)``: whether ``version`` is committed in ``tier`` already (its own
    save's round committed it: a ``COMMIT`` record is there), else the ranks whose part failed
    (none: every blob is written, rank 0 writes the ``COMMIT`` record). A vote on another version
    or tier fails its rank: the ranks are out of step."""
    astray = [r for r, v in enumerate(votes) if (v.version, v.tier) != (version, tier)]
    if astray:
        return False, astray
    if any(v.already for v in votes):
        return True, []
    return False, [r for r, v in enumerate(votes) if not v.ok]


def flush_record(job_id: str, votes: Sequence[FlushVote], when: float) -> CommitRecord:
    """The ``COMMIT`` record of a flushed version: every rank's blob, each a base."""
    entries = []
    for rank, vote in enumerate(votes):
        if vote.key is None:
            raise ValueError(f"rank {rank} wrote no blob of version {vote.version}")
        entries.append(CommitEntry(rank, vote.key, vote.size, vote.checksum, vote.raw_digest))
    return CommitRecord(
        job_id=job_id,
        version=votes[0].version,
        world_size=len(votes),
        time=when,
        entries=tuple(entries),
    )
