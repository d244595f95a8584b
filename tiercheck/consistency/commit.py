"""The persistent tier's ``COMMIT`` record: the self-describing proof that a version is whole.

After every rank's blob of a version is written to the persistent tier, one rank writes a small
JSON object listing each blob with its size and checksums. It is written last, so its presence
proves the version is whole; after a cluster-wide outage (every node's memory and manifest gone)
it alone is enough to restore. JSON rather than msgpack so an operator can read it with ``cat``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from tiercheck.errors import FormatError, UnsupportedFormat

__all__ = ["COMMIT_FORMAT", "CommitEntry", "CommitRecord"]

COMMIT_FORMAT = "tiercheck.commit/1"


@dataclass(frozen=True, slots=True)
class CommitEntry:
    """One rank's blob of a committed version."""

    rank: int
    key: str
    size: int
    checksum: int
    raw_digest: int
    #: The base version the blob is a delta against, or ``None`` when it is self-contained.
    base: int | None = None


@dataclass(frozen=True, slots=True)
class CommitRecord:
    """Everything needed to prove a version whole without any other metadata."""

    job_id: str
    version: int
    world_size: int
    entries: tuple[CommitEntry, ...]
    time: float = 0.0

    def __post_init__(self) -> None:
        ranks = sorted(e.rank for e in self.entries)
        if ranks != list(range(self.world_size)):
            raise FormatError(
                f"a COMMIT record of version {self.version} must list ranks "
                f"0..{self.world_size - 1} once each, got {ranks}"
            )

    def entry(self, rank: int) -> CommitEntry:
        """The entry of ``rank``."""
        for e in self.entries:
            if e.rank == rank:
                return e
        raise KeyError(rank)

    def to_bytes(self) -> bytes:
        """Serialize as UTF-8 JSON."""
        body = {
            "format": COMMIT_FORMAT,
            "job_id": self.job_id,
            "version": self.version,
            "world_size": self.world_size,
            "time": self.time,
            "entries": [asdict(e) for e in self.entries],
        }
        return json.dumps(body, indent=1, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> CommitRecord:
        """Parse a record written by :meth:`to_bytes`; refuse anything else with a typed error."""
        try:
            body = json.loads(bytes(data))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise FormatError(f"a COMMIT record is not valid JSON: {exc}") from exc
        if not isinstance(body, dict) or not isinstance(body.get("format"), str):
            raise FormatError("a COMMIT record must be a JSON object with a 'format' field")
        name, _, major = body["format"].partition("/")
        if name != "tiercheck.commit":
            raise FormatError(f"not a tiercheck COMMIT record: format {body['format']!r}")
        if major != "1":
            raise UnsupportedFormat(
                f"COMMIT record format {body['format']!r} is newer than this build reads "
                f"({COMMIT_FORMAT}); upgrade tiercheck"
            )
        try:
            entries: Sequence[dict[str, object]] = body["entries"]
            return cls(
                job_id=str(body["job_id"]),
                version=int(body["version"]),
                world_size=int(body["world_size"]),
                time=float(body.get("time", 0.0)),
                entries=tuple(CommitEntry(**e) for e in entries),  # type: ignore[arg-type]
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise FormatError(f"a COMMIT record is missing or mistypes a field: {exc}") from exc
