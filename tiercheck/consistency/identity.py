"""Whose data is this: the job record, writer generations and node identity.

Three small JSON records keep one job's stored data from being mixed with, or destroyed by,
another run that uses the same name:

* the **job record** (key ``JOB`` in every tier that outlives the cluster) names the job's
  *incarnation*: a random token made when the job first stored anything at that location, and
  the number of ranks that saves it. A run with another world size is refused before it reads
  anything; memory left by another incarnation is never restored as this one's.
* **writer generations** (keys ``writers/g<12 digits>`` next to it): every opening of the job
  claims the next generation. A writer checks that the newest generation is still its own
  before it writes a blob or a ``COMMIT`` record there, so when two launches of one job run at
  once, the older one stops writing durable data instead of overwriting the newer one's.
* the **node identity** (``identity.json`` in a node's memory root) records which incarnation
  the node's shared memory (its local tier and the replicas it keeps for peers) belongs to.
* the **tombstone** (key ``DELETED`` beside the job record) is left by ``tiercheck rm-job``: it
  names the incarnations that were deleted and the newest writer generation they had. An opening
  discards memory of a deleted incarnation instead of restoring it (a deleted job stays
  deleted), and a writer of a deleted incarnation that still runs stops writing there.

Records are JSON, like ``COMMIT`` records, so an operator can read them with ``cat``. Each has a
``format`` field; an unknown major version is refused with
:class:`~tiercheck.errors.UnsupportedFormat`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, TypeVar

from tiercheck.consistency.worlds import Spans, parse_spans

# The node-root names live with the rest of the node layout; importable here too.
from tiercheck.defaults import IDENTITY_FILE, LOCKS_DIR
from tiercheck.errors import FormatError, UnsupportedFormat

__all__ = [
    "IDENTITY_FILE",
    "JOB_KEY",
    "LOCKS_DIR",
    "PROBE_PREFIX",
    "QUARANTINE_PREFIX",
    "TOMBSTONE_KEY",
    "WRITERS_PREFIX",
    "JobRecord",
    "NodeIdentity",
    "Tombstone",
    "WriterRecord",
    "parse_quarantine_key",
    "parse_writer_key",
    "probe_key",
    "quarantine_key",
    "writer_key",
]

#: The job record's key in a tier that outlives the cluster.
JOB_KEY = "JOB"
#: Where writer generations live in such a tier.
WRITERS_PREFIX = "writers/"
#: Where blobs that failed verification are set aside, under their original key.
QUARANTINE_PREFIX = "quarantine/"
#: Where the small objects that test a location at open are written (and deleted at once).
PROBE_PREFIX = "probe/"
#: The tombstone's key: left by ``tiercheck rm-job`` in place of the deleted job.
TOMBSTONE_KEY = "DELETED"
#: How many deleted incarnations a tombstone remembers (the newest ones).
TOMBSTONE_TOKENS = 64

_WRITER = re.compile(r"^writers/g(\d{12})$")

_R = TypeVar("_R", bound="_JsonRecord")


def writer_key(generation: int) -> str:
    """The key of writer generation ``generation``."""
    return f"{WRITERS_PREFIX}g{generation:012d}"


def parse_writer_key(key: str) -> int | None:
    """The generation a writer key names, or ``None`` when ``key`` is not one."""
    m = _WRITER.match(key)
    return None if m is None else int(m.group(1))


def quarantine_key(key: str) -> str:
    """Where the blob stored under ``key`` is set aside when it fails verification."""
    return QUARANTINE_PREFIX + key


def parse_quarantine_key(key: str) -> str | None:
    """The original key of a quarantined blob, or ``None`` when ``key`` is not one."""
    if key.startswith(QUARANTINE_PREFIX) and len(key) > len(QUARANTINE_PREFIX):
        return key[len(QUARANTINE_PREFIX) :]
    return None


def probe_key(session: str, rank: int) -> str:
    """The key one rank's probe of a location writes (and deletes) at open."""
    return f"{PROBE_PREFIX}{session}-r{rank:05d}"


class _JsonRecord:
    """Shared JSON (de)serialization of the records below."""

    FORMAT: ClassVar[str]

    def to_bytes(self) -> bytes:
        """Serialize as UTF-8 JSON with a ``format`` field."""
        body = {"format": self.FORMAT, **asdict(self)}  # type: ignore[call-overload]
        return json.dumps(body, indent=1, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls: type[_R], data: bytes | bytearray | memoryview) -> _R:
        """Parse what :meth:`to_bytes` wrote; anything else is a typed error."""
        what = cls.FORMAT.partition("/")[0]
        try:
            body = json.loads(bytes(data))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise FormatError(f"a {what} record is not valid JSON: {exc}") from exc
        if not isinstance(body, dict) or not isinstance(body.get("format"), str):
            raise FormatError(f"a {what} record must be a JSON object with a 'format' field")
        name, _, major = body.pop("format").partition("/")
        if name != what:
            raise FormatError(f"expected a {what} record, got format {name!r}")
        if major != cls.FORMAT.partition("/")[2]:
            raise UnsupportedFormat(
                f"{what} record format {name}/{major} is newer than this build reads "
                f"({cls.FORMAT}); upgrade tiercheck"
            )
        try:
            return cls(**_known_fields(cls, body))
        except (TypeError, ValueError) as exc:
            raise FormatError(f"a {what} record is missing or mistypes a field: {exc}") from exc


def _check_worlds(record: Any, world_size: int) -> None:
    try:
        spans = parse_spans(record.worlds, world_size)
    except FormatError as exc:
        raise ValueError(str(exc)) from exc
    object.__setattr__(record, "worlds", spans)


def _check_revision(revision: object) -> None:
    if isinstance(revision, bool) or not isinstance(revision, int) or revision < 0:
        raise ValueError(f"revision must be an int >= 0, got {revision!r}")


def _known_fields(cls: type[Any], body: dict[str, Any]) -> dict[str, Any]:
    names = cls.__dataclass_fields__
    return {k: v for k, v in body.items() if k in names}


@dataclass(frozen=True, slots=True)
class JobRecord(_JsonRecord):
    """The incarnation of a job at one durable location (key :data:`JOB_KEY`)."""

    FORMAT: ClassVar[str] = "tiercheck.job/1"

    job_id: str
    #: Random, made when the job first stored data here; memory tiers record it too.
    token: str
    #: The number of ranks that saves this job.
    world_size: int
    #: Seconds since the epoch when the record was made.
    created: float = 0.0
    #: The world-size history (:mod:`tiercheck.consistency.worlds`); empty when the job never
    #: changed its number of ranks.
    worlds: Spans = ()
    #: How many times the history was changed: where the job record and a node's identity
    #: disagree (one of them could not be written), the higher revision is the newer truth.
    revision: int = 0
    #: Written by ``tiercheck repair-job`` in place of a damaged record: the token is new and
    #: the history read off the ``COMMIT`` records; the next opening takes the token (and
    #: history) the nodes' memory of this location names, where they agree, and rewrites it.
    repaired: bool = False

    def __post_init__(self) -> None:
        _check_revision(self.revision)
        if not isinstance(self.repaired, bool):
            raise ValueError(f"repaired must be true or false, got {self.repaired!r}")
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {self.world_size!r}")
        if not isinstance(self.token, str) or not self.token:
            raise ValueError("token must be a non-empty string")
        _check_worlds(self, self.world_size)


@dataclass(frozen=True, slots=True)
class WriterRecord(_JsonRecord):
    """One opening of a job as its writer (key :func:`writer_key`)."""

    FORMAT: ClassVar[str] = "tiercheck.writer/1"

    generation: int
    #: The session token of the opening (shared by all its ranks).
    session: str
    host: str = ""
    pid: int = 0
    time: float = 0.0
    #: The writer process's start time and kernel instance (see
    #: :func:`tiercheck.tiers.atomic.process_verdict`): with ``host`` and ``pid``, they tell
    #: whether the writer still runs, on its host. ``0`` and ``""``: not recorded.
    start: int = 0
    kernel: str = ""


@dataclass(frozen=True, slots=True)
class NodeIdentity(_JsonRecord):
    """Which incarnation a node's memory belongs to (file :data:`IDENTITY_FILE`)."""

    FORMAT: ClassVar[str] = "tiercheck.node/1"

    job_id: str
    token: str
    world_size: int
    #: The durable location the incarnation's job record lives at (``None`` when none).
    persistent: str | None = None
    created: float = 0.0
    #: The world-size history, as in :class:`JobRecord`.
    worlds: Spans = ()
    #: As in :class:`JobRecord`.
    revision: int = 0

    def __post_init__(self) -> None:
        _check_revision(self.revision)
        _check_worlds(self, self.world_size)


@dataclass(frozen=True, slots=True)
class Tombstone(_JsonRecord):
    """What ``tiercheck rm-job`` deleted at a durable location (key :data:`TOMBSTONE_KEY`).

    It stays after the deletion, and after a new incarnation of the job starts there: memory
    that names a deleted incarnation is discarded by the next opening of any node that holds it.
    """

    FORMAT: ClassVar[str] = "tiercheck.deleted/1"

    job_id: str
    #: The tokens of the deleted incarnations (their job records'), oldest first.
    tokens: tuple[str, ...] = ()
    #: The newest writer generation of the deleted incarnations (``-1``: none); a later
    #: opening claims a generation above it, so that a writer of a deleted incarnation that
    #: still runs sees itself superseded.
    generation: int = -1
    #: When (seconds since the epoch), and who deleted it, for people.
    time: float = 0.0
    host: str = ""
    pid: int = 0

    def __post_init__(self) -> None:
        tokens = tuple(self.tokens)
        if not all(isinstance(t, str) and t for t in tokens):
            raise ValueError("tokens must be non-empty strings")
        if not isinstance(self.generation, int) or self.generation < -1:
            raise ValueError(f"generation must be an int >= -1, got {self.generation!r}")
        object.__setattr__(self, "tokens", tokens)

    def deleting(
        self,
        tokens: Iterable[str],
        generation: int | None,
        *,
        when: float,
        host: str,
        pid: int,
    ) -> Tombstone:
        """This tombstone, extended by one more deletion: of the incarnations ``tokens``, whose
        newest writer generation was ``generation`` (``None``: none known)."""
        known = list(self.tokens)
        known += [t for t in dict.fromkeys(tokens) if t and t not in known]
        newest = max(self.generation, -1 if generation is None else generation)
        return Tombstone(self.job_id, tuple(known[-TOMBSTONE_TOKENS:]), newest, when, host, pid)
