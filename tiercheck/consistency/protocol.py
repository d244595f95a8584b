"""The commit protocol, top to bottom: what the ranks tell each other, and the rules they apply.

Pure data and pure functions, no I/O; the engine (:mod:`tiercheck.engine.commit`,
:mod:`tiercheck.engine.restore`) does the exchanging and the storing. Every message goes over a
side channel as plain msgpack-able data (:meth:`to_wire` / :meth:`from_wire`, never pickle).

Saving version ``v`` to tier ``T``, per rank, in order:

1. **write** -- the rank writes its blob of ``v`` to ``T`` (``T``'s lane).
2. **vote** -- the rank sends a :class:`Vote` on ``T``'s channel: the blob's record if it is
   written and, for a delta, its base is committed in ``T`` and still there; else a no.
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

Every collective of the engine is one named :class:`Step` with one message class
(:data:`STEP_MESSAGES`), exchanged through :func:`tiercheck.engine.collectives.step` only.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Literal, Protocol, Self, cast

from tiercheck.consistency.commit import CommitEntry, CommitRecord
from tiercheck.consistency.preempt import FlushVote, PreemptBegin, PreemptOffer
from tiercheck.consistency.recovery import Inventory

__all__ = [
    "STEP_MESSAGES",
    "AckReason",
    "ClaimOutcome",
    "CommitAck",
    "InventoryReport",
    "Message",
    "OpenFacts",
    "Outcome",
    "Reached",
    "Rejoined",
    "RestoreVerdict",
    "SavesDone",
    "ServingStopped",
    "SessionToken",
    "SetAsideCompletion",
    "SetAsideListing",
    "Step",
    "Vote",
    "commit_record",
    "committed_in_tier",
    "round_failures",
    "whole_in_tier",
]


class Step(Enum):
    """Every collective of the engine: one all-gather of one message class per rank.

    In the order a job meets them: opening (``SESSION``, ``OPEN_FACTS``, ``CLAIM``), restoring
    (``INVENTORY``, ``VERDICT``, ``WRITTEN`` when a rank reads straight into the state,
    ``LOADED``), a durable tier unreachable at opening, at the
    start of each save until it is claimed (``REACHED``, then ``REJOIN``), a changed world or
    timeline (``JOB_RECORD``, ``SET_ASIDE_*``), each commit round of each tier (``VOTE``,
    ``ACK``), closing (``CLOSE_SAVED``, ``CLOSE_STOPPED``); and, on SIGTERM, the flush of what
    only memory holds (``PREEMPT_*``, on a channel of their own:
    :mod:`tiercheck.consistency.preempt`). The value names the step in logs and errors.
    """

    SESSION = "session"
    OPEN_FACTS = "open-facts"
    CLAIM = "claim"
    INVENTORY = "inventory"
    VERDICT = "verdict"
    WRITTEN = "written"
    LOADED = "loaded"
    REACHED = "reached"
    REJOIN = "rejoin"
    JOB_RECORD = "job-record"
    SET_ASIDE_LIST = "set-aside-list"
    SET_ASIDE_COPY = "set-aside-copy"
    SET_ASIDE_COMPLETE = "set-aside-complete"
    SET_ASIDE_REMOVE = "set-aside-remove"
    VOTE = "vote"
    ACK = "ack"
    CLOSE_SAVED = "close-saved"
    CLOSE_STOPPED = "close-stopped"
    PREEMPT_BEGIN = "preempt-begin"
    PREEMPT_OFFER = "preempt-offer"
    PREEMPT_VOTE = "preempt-vote"
    PREEMPT_ACK = "preempt-ack"


class Message(Protocol):
    """What a step's message is: plain msgpack-able data both ways, never pickle."""

    def to_wire(self) -> dict[str, Any]:
        """Plain data for exchange between ranks."""
        ...

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> Self:
        """Inverse of :meth:`to_wire`."""
        ...


#: Why rank 0 could not write a ``COMMIT`` record ("" when it did).
AckReason = Literal["", "base-missing", "superseded", "error"]


@dataclass(frozen=True, slots=True)
class Vote:
    """One rank's word in a commit round of one version in one tier.

    ``ok`` says the rank's blob is written to the tier (and, for a delta, its base is committed
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
    ``direct``: the rank read only the blob's header (:mod:`tiercheck.engine.restore.inplace`);
    if any rank has, all send a second verdict (step ``WRITTEN``) once the state is written.
    """

    ok: bool
    #: The tier the rank read from (``None`` when none could serve it).
    source: str | None
    reasons: tuple[str, ...] = ()
    refusal: tuple[str, str] | None = None
    direct: bool = False

    def to_wire(self) -> dict[str, Any]:
        """Plain data for exchange between ranks (msgpack-able, no pickle)."""
        return {
            "ok": self.ok,
            "source": self.source,
            "reasons": list(self.reasons),
            "refusal": None if self.refusal is None else list(self.refusal),
            "direct": self.direct,
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
            direct=bool(data.get("direct", False)),
        )


@dataclass(frozen=True, slots=True)
class SessionToken:
    """Step ``SESSION``: a token for this incarnation of the opening; rank 0's is everyone's."""

    token: str

    def to_wire(self) -> dict[str, Any]:
        """Plain data for exchange between ranks (msgpack-able, no pickle)."""
        return {"token": self.token}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> SessionToken:
        """Inverse of :meth:`to_wire`."""
        return cls(str(data["token"]))


@dataclass(frozen=True, slots=True)
class OpenFacts:
    """Step ``OPEN_FACTS``: what one rank sees before the job opens, for
    :meth:`tiercheck.engine.open.claim.Claim.judge`. A field left at its default is not sent."""

    node: int
    local_rank: int
    #: Why this rank's writer lock could not be taken.
    lock: str | None = None
    #: Why each durable tier failed its probe, by tier name.
    probe: Mapping[str, str] = field(default_factory=dict)
    #: The tiers of :attr:`probe` that failed for a cause that passes (a connection or a
    #: timeout error: the tier cannot be reached), not one that stays (a refusal), with that
    #: cause in a few words.
    unreachable: Mapping[str, str] = field(default_factory=dict)
    #: Rank 0: what the durable tiers say of the job's incarnation (see ``Claim``).
    job: Mapping[str, Any] | None = None
    #: Rank 0: why the job record (or the tombstone) cannot be read.
    job_error: str | None = None
    #: Rank 0: the incarnations ``tiercheck rm-job`` deleted, and whether a tombstone is there.
    deleted: Sequence[str] | None = None
    tombstone: bool | None = None
    #: The node's identity record (text), ``None`` when there is none or it cannot be read.
    identity: str | None = None
    identity_error: str | None = None
    identity_damaged: bool = False
    has_data: bool = True
    #: A node's first rank: the versions its memory holds.
    held: Sequence[int] | None = None
    #: Rank 0: a token for the job, should it start a new incarnation.
    fresh_token: str | None = None

    def to_wire(self) -> dict[str, Any]:
        """Plain data for exchange between ranks (msgpack-able, no pickle)."""
        wire: dict[str, Any] = {"node": self.node, "local_rank": self.local_rank}
        if self.lock is not None:
            wire["lock"] = self.lock
        wire["probe"] = dict(self.probe)
        if self.unreachable:
            wire["unreachable"] = dict(self.unreachable)
        for name in ("job", "job_error", "deleted", "tombstone"):
            if getattr(self, name) is not None:
                wire[name] = getattr(self, name)
        if self.identity_error is not None:
            wire["identity_error"] = self.identity_error
            wire["identity_damaged"] = self.identity_damaged
        else:
            wire["identity"] = self.identity
        wire["has_data"] = self.has_data
        for name in ("held", "fresh_token"):
            if getattr(self, name) is not None:
                wire[name] = getattr(self, name)
        return wire

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> OpenFacts:
        """Inverse of :meth:`to_wire`."""
        return cls(
            node=int(data["node"]),
            local_rank=int(data["local_rank"]),
            lock=data.get("lock"),
            probe={str(k): str(v) for k, v in data["probe"].items()},
            unreachable={str(k): str(v) for k, v in data.get("unreachable", {}).items()},
            job=data.get("job"),
            job_error=data.get("job_error"),
            deleted=data.get("deleted"),
            tombstone=data.get("tombstone"),
            identity=data.get("identity"),
            identity_error=data.get("identity_error"),
            identity_damaged=bool(data.get("identity_damaged", False)),
            has_data=bool(data["has_data"]),
            held=data.get("held"),
            fresh_token=data.get("fresh_token"),
        )


@dataclass(frozen=True, slots=True)
class ClaimOutcome:
    """Step ``CLAIM``: rank 0's writer generation in each durable tier, or why it could not
    claim them (``failure``; "" when it did). Also a barrier (see ``Claim.guard``)."""

    generations: Mapping[str, int]
    failure: str = ""

    def to_wire(self) -> dict[str, Any]:
        """Plain data for exchange between ranks (msgpack-able, no pickle)."""
        return {"generations": dict(self.generations), "failure": self.failure}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> ClaimOutcome:
        """Inverse of :meth:`to_wire`."""
        generations = {str(k): int(v) for k, v in data["generations"].items()}
        return cls(generations, str(data["failure"]))


@dataclass(frozen=True, slots=True)
class Reached:
    """Step ``REACHED``: the durable tiers, of those unreachable when the job opened, that
    this rank's background probe has reached since."""

    tiers: Sequence[str]

    def to_wire(self) -> dict[str, Any]:
        """Plain data for exchange between ranks (msgpack-able, no pickle)."""
        return {"tiers": list(self.tiers)}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> Reached:
        """Inverse of :meth:`to_wire`."""
        return cls(tuple(str(t) for t in data["tiers"]))


@dataclass(frozen=True, slots=True)
class Rejoined:
    """Step ``REJOIN``: rank 0's word on the durable tiers every rank reached again (others
    send an empty one): the writer generation it claimed in each (``generations``), the tiers
    this run must never write (``refused``: why -- the location is another run's now, a newer
    opening holds it, the job was deleted), and those whose claim failed for now (``failed``:
    tried again later)."""

    generations: Mapping[str, int] = field(default_factory=dict)
    refused: Mapping[str, str] = field(default_factory=dict)
    failed: Mapping[str, str] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        """Plain data for exchange between ranks (msgpack-able, no pickle)."""
        return {
            "generations": dict(self.generations),
            "refused": dict(self.refused),
            "failed": dict(self.failed),
        }

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> Rejoined:
        """Inverse of :meth:`to_wire`."""
        return cls(
            {str(k): int(v) for k, v in data["generations"].items()},
            {str(k): str(v) for k, v in data["refused"].items()},
            {str(k): str(v) for k, v in data["failed"].items()},
        )


@dataclass(frozen=True, slots=True)
class Outcome:
    """Steps ``JOB_RECORD``, ``LOADED``, ``SET_ASIDE_COPY``, ``SET_ASIDE_REMOVE``: whether this
    rank's part of the step failed, and why (``None``: it did not)."""

    error: str | None

    def to_wire(self) -> dict[str, Any]:
        """Plain data for exchange between ranks (msgpack-able, no pickle)."""
        return {"error": self.error}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> Outcome:
        """Inverse of :meth:`to_wire`."""
        error = data["error"]
        return cls(None if error is None else str(error))


@dataclass(frozen=True, slots=True)
class InventoryReport:
    """Step ``INVENTORY``: the versions a rank can rebuild, by tier (fastest first), and why
    it could not list some tiers (tier name -> message)."""

    by_tier: Mapping[str, frozenset[int]]
    errors: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, inventory: Inventory, errors: Mapping[str, str]) -> InventoryReport:
        """The report of ``inventory``."""
        return cls(inventory.by_tier, errors)

    def inventory(self, rank: int) -> Inventory:
        """The :class:`~tiercheck.consistency.recovery.Inventory` of ``rank``, who sent this."""
        return Inventory(rank, self.by_tier)

    def to_wire(self) -> dict[str, Any]:
        """Plain data for exchange between ranks (msgpack-able, no pickle)."""
        return {"inv": Inventory(-1, self.by_tier).to_wire(), "errors": dict(self.errors)}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> InventoryReport:
        """Inverse of :meth:`to_wire`."""
        inventory = Inventory.from_wire(-1, data["inv"])
        return cls(inventory.by_tier, {str(k): str(v) for k, v in data["errors"].items()})


@dataclass(frozen=True, slots=True)
class SetAsideListing:
    """Step ``SET_ASIDE_LIST``: rank 0's list of the committed versions to set aside (others
    send none), and whether listing or this rank's own state forbids it (``error``)."""

    committed: Sequence[int]
    error: str | None = None

    def to_wire(self) -> dict[str, Any]:
        """Plain data for exchange between ranks (msgpack-able, no pickle)."""
        return {"committed": list(self.committed), "error": self.error}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> SetAsideListing:
        """Inverse of :meth:`to_wire`."""
        error = data["error"]
        return cls([int(v) for v in data["committed"]], None if error is None else str(error))


@dataclass(frozen=True, slots=True)
class SetAsideCompletion:
    """Step ``SET_ASIDE_COMPLETE``: rank 0 completed the abandoned set (``held``: the versions
    it holds whole, ``needs``: those still missing a rank's blob) or why not (``error``)."""

    error: str | None
    needs: Sequence[int] = ()
    held: Sequence[int] = ()

    def to_wire(self) -> dict[str, Any]:
        """Plain data for exchange between ranks (msgpack-able, no pickle)."""
        return {"error": self.error, "needs": list(self.needs), "held": list(self.held)}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> SetAsideCompletion:
        """Inverse of :meth:`to_wire`."""
        error = data["error"]
        return cls(
            None if error is None else str(error),
            [int(v) for v in data["needs"]],
            [int(v) for v in data["held"]],
        )


@dataclass(frozen=True, slots=True)
class SavesDone:
    """Step ``CLOSE_SAVED``: this rank finished every save before closing."""

    saved: bool

    @property
    def ok(self) -> bool:
        """Whether this rank's part of the close went well."""
        return self.saved

    def to_wire(self) -> dict[str, Any]:
        """Plain data for exchange between ranks (msgpack-able, no pickle)."""
        return {"saved": self.saved}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> SavesDone:
        """Inverse of :meth:`to_wire`."""
        return cls(bool(data["saved"]))


@dataclass(frozen=True, slots=True)
class ServingStopped:
    """Step ``CLOSE_STOPPED``: this rank's tiers stopped serving the other ranks."""

    stopped: bool

    @property
    def ok(self) -> bool:
        """Whether this rank's part of the close went well."""
        return self.stopped

    def to_wire(self) -> dict[str, Any]:
        """Plain data for exchange between ranks (msgpack-able, no pickle)."""
        return {"stopped": self.stopped}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> ServingStopped:
        """Inverse of :meth:`to_wire`."""
        return cls(bool(data["stopped"]))


#: The one message class of each step (a step exchanges nothing else).
STEP_MESSAGES: Mapping[Step, type[Message]] = {
    Step.SESSION: SessionToken,
    Step.OPEN_FACTS: OpenFacts,
    Step.CLAIM: ClaimOutcome,
    Step.INVENTORY: InventoryReport,
    Step.VERDICT: RestoreVerdict,
    Step.WRITTEN: RestoreVerdict,
    Step.LOADED: Outcome,
    Step.REACHED: Reached,
    Step.REJOIN: Rejoined,
    Step.JOB_RECORD: Outcome,
    Step.SET_ASIDE_LIST: SetAsideListing,
    Step.SET_ASIDE_COPY: Outcome,
    Step.SET_ASIDE_COMPLETE: SetAsideCompletion,
    Step.SET_ASIDE_REMOVE: Outcome,
    Step.VOTE: Vote,
    Step.ACK: CommitAck,
    Step.CLOSE_SAVED: SavesDone,
    Step.CLOSE_STOPPED: ServingStopped,
    Step.PREEMPT_BEGIN: PreemptBegin,
    Step.PREEMPT_OFFER: PreemptOffer,
    Step.PREEMPT_VOTE: FlushVote,
    Step.PREEMPT_ACK: CommitAck,
}


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
    written. In a memory tier the manifest remembers the commit, but only a version whose blob
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
