"""Versions a run went back from: where a durable tier keeps them, and when they may go.

A restore of an older version (``restore(version=v)``, or a newest version no rank can use)
changes nothing stored. When the run then saves again it continues from ``v``, and the versions
after ``v`` are no longer on its timeline; a later save of the same number must not be mixed
with them. In a tier that outlives the cluster they are not deleted but *set aside*, whole, as
an **abandoned set** under ``abandoned/<tag>/``: each blob and ``COMMIT`` record under its own
key below that folder, and a ``SET`` record (JSON) written once every copy is in place::

    abandoned/from-v000000000006-3f2a9c1e77d0b4a5/v000000000010/r00000.packed
    abandoned/from-v000000000006-3f2a9c1e77d0b4a5/v000000000010/COMMIT
    abandoned/from-v000000000006-3f2a9c1e77d0b4a5/SET

The tag names the first version set aside and the opening (session) that did it. A set without
its ``SET`` record is the unfinished work of an opening that died while setting it aside; the
originals were still in place then (they are removed only after ``SET`` is written), so such a
set holds only copies. Retention removes a set once the run holds ``keep`` committed versions of
its own from the set's first version on (:func:`expired`); ``tiercheck gc --abandoned`` removes
them at once; ``tiercheck ls`` lists them.

Pure layout and rules: no I/O here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

from tiercheck.errors import FormatError, UnsupportedFormat

__all__ = [
    "ABANDONED_FORMAT",
    "ABANDONED_PREFIX",
    "SET_NAME",
    "AbandonedSet",
    "SetInfo",
    "abandoned_key",
    "expired",
    "kept_and_removable",
    "parse_abandoned_key",
    "parse_tag",
    "set_record_key",
    "set_tag",
    "tags_in",
]

#: Where a durable tier keeps abandoned sets.
ABANDONED_PREFIX = "abandoned/"
#: The record that makes a set whole.
SET_NAME = "SET"
ABANDONED_FORMAT = "tiercheck.abandoned/1"

_TAG = re.compile(r"^from-v(\d{12})-([0-9a-zA-Z]{1,64})$")


def set_tag(first: int, session: str) -> str:
    """The tag of the set of versions from ``first`` on, set aside by opening ``session``."""
    return f"from-v{max(first, 0):012d}-{session}"


def parse_tag(tag: str) -> tuple[int, str] | None:
    """``(first version, session)`` of a set's tag, or ``None`` when ``tag`` is not one."""
    m = _TAG.match(tag)
    return None if m is None else (int(m.group(1)), m.group(2))


def abandoned_key(tag: str, key: str) -> str:
    """Where the blob or record stored under ``key`` lives in the set ``tag``."""
    return f"{ABANDONED_PREFIX}{tag}/{key}"


def set_record_key(tag: str) -> str:
    """The key of the ``SET`` record of set ``tag``."""
    return abandoned_key(tag, SET_NAME)


def parse_abandoned_key(key: str) -> tuple[str, str] | None:
    """``(tag, original key)`` of a key inside an abandoned set (``SET`` included), or
    ``None`` when ``key`` is not one."""
    if not key.startswith(ABANDONED_PREFIX):
        return None
    tag, sep, rest = key[len(ABANDONED_PREFIX) :].partition("/")
    if not sep or not rest or parse_tag(tag) is None:
        return None
    return tag, rest


@dataclass(frozen=True, slots=True)
class AbandonedSet:
    """The ``SET`` record: what was set aside, when, and why."""

    job_id: str
    #: The version the run continued from (``-1``: none, it started over).
    restored: int
    #: The committed versions set aside, ascending.
    versions: tuple[int, ...]
    session: str
    time: float
    reason: str

    def to_bytes(self) -> bytes:
        """Serialize as UTF-8 JSON (an operator reads it with ``cat``)."""
        body = {
            "format": ABANDONED_FORMAT,
            "job_id": self.job_id,
            "restored": self.restored,
            "versions": list(self.versions),
            "session": self.session,
            "time": self.time,
            "reason": self.reason,
        }
        return json.dumps(body, indent=1, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> AbandonedSet:
        """Parse a record written by :meth:`to_bytes`; anything else is a typed error."""
        try:
            body = json.loads(bytes(data))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise FormatError(f"a SET record is not valid JSON: {exc}") from exc
        if not isinstance(body, dict) or not isinstance(body.get("format"), str):
            raise FormatError("a SET record must be a JSON object with a 'format' field")
        if body["format"].split("/")[0] != ABANDONED_FORMAT.split("/", maxsplit=1)[0]:
            raise FormatError(f"not a SET record: format {body['format']!r}")
        if body["format"] != ABANDONED_FORMAT:
            raise UnsupportedFormat(
                f"SET record format {body['format']!r} is newer than this tiercheck reads "
                f"({ABANDONED_FORMAT}); upgrade tiercheck"
            )
        try:
            versions = tuple(int(v) for v in body["versions"])
            return cls(
                job_id=str(body["job_id"]),
                restored=int(body["restored"]),
                versions=versions,
                session=str(body["session"]),
                time=float(body["time"]),
                reason=str(body["reason"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise FormatError(f"a SET record is missing or mistypes a field: {exc}") from exc


def expired(sets: Mapping[str, int], committed: Collection[int], keep: int) -> list[str]:
    """The tags of whole sets retention may remove: those from whose first version on the tier
    holds at least ``keep`` committed versions of the run's own (``sets``: tag -> first
    version; only sets with their ``SET`` record belong here)."""
    out = []
    for tag, first in sorted(sets.items()):
        if sum(1 for v in committed if v >= first) >= keep:
            out.append(tag)
    return out


@dataclass(frozen=True, slots=True)
class SetInfo:
    """What retention needs to know of one whole set."""

    #: The first version set aside (the tag's).
    first: int
    #: The versions the set holds.
    versions: frozenset[int]
    #: Versions outside the set that a delta in it is encoded against (its ``COMMIT`` copies
    #: say): the set can be decoded only while they are there, live or in another set.
    needs: frozenset[int]


def kept_and_removable(
    sets: Mapping[str, SetInfo], committed: Collection[int], keep: int
) -> tuple[frozenset[int], list[str]]:
    """Retention over abandoned sets: the live versions no one may evict (bases a kept set's
    deltas need) and the tags that may be removed (:func:`expired`, unless a kept set needs a
    version one of them holds). Pure; every rank computes the same."""
    removable = set(expired({tag: s.first for tag, s in sets.items()}, committed, keep))
    changed = True
    while changed:
        changed = False
        for tag in sorted(removable):
            holds = sets[tag].versions
            if any(holds & sets[other].needs for other in sets if other not in removable):
                removable.discard(tag)
                changed = True
    protected: set[int] = set()
    for tag, info in sets.items():
        if tag not in removable:
            protected |= info.needs
    return frozenset(protected), sorted(removable)


def tags_in(keys: Iterable[str]) -> dict[str, set[str]]:
    """Group keys below ``abandoned/`` by set: tag -> the original keys it holds."""
    out: dict[str, set[str]] = {}
    for key in keys:
        parsed = parse_abandoned_key(key)
        if parsed is not None:
            out.setdefault(parsed[0], set()).add(parsed[1])
    return out
