"""The one async interface every tier implements, and the optional abilities a tier may add.

A tier moves bytes under string keys. It never sees tensors or versions: the codec turns state
into blobs, the checkpointer decides which blob goes where, the manifest remembers what landed.

Lifecycle (who calls what, in order)
-----------------------------------
1. The checkpointer (or a test, or a plugin author's own code) constructs the tier; construction
   does no I/O that can block for long.
2. ``async with tier:`` (or plain use followed by :meth:`Tier.aclose`). Every method is a
   coroutine and may be called concurrently from one event loop; a tier never blocks the loop
   with file, network or hashing work (it uses threads or an async API).
3. ``put`` / ``get`` / ``exists`` / ``list`` / ``delete`` in any order, for any valid key.
4. ``aclose()`` releases resources. It is idempotent; any other call afterwards raises
   :class:`~tiercheck.errors.TierClosed`. What was stored stays stored: closing is not deleting.

The contract every implementation keeps
---------------------------------------
* **Atomic put.** A reader running concurrently with, or after, ``put(key, data)`` sees the whole
  previous blob, the whole new blob, or nothing -- never a mix, never a prefix. A put that fails
  leaves the previous blob (if any) in place.
* **Missing keys** make ``get`` raise :class:`~tiercheck.errors.BlobNotFound`
  (a :class:`FileNotFoundError`).
* **Delete is idempotent**: deleting a missing key is not an error.
* **List is by string prefix**: ``list("v0001/")`` yields every stored key that starts with that
  prefix, in no particular order, and never yields temporary or hidden files of the tier itself.
* **Keys** follow :func:`validate_key`; an invalid key raises
  :class:`~tiercheck.errors.InvalidKey` before any I/O.

Note for implementers: only ``put``, ``get``, ``delete``, ``exists`` and ``list`` are abstract.
``putv`` and ``get_size`` have defaults built on them; override them where the backend can do
better (``putv`` by default joins its parts, which costs one copy of the blob).
"""

from __future__ import annotations

import enum
import re
import types
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar, runtime_checkable

from tiercheck.buffer import Buffer
from tiercheck.errors import ConfigError, InvalidKey, TierClosed
from tiercheck.tiers.atomic import split_prefix

if TYPE_CHECKING:
    from tiercheck.topology import Topology

__all__ = [
    "MAX_KEY_LENGTH",
    "Buffer",
    "FailureScope",
    "Leftover",
    "Reservation",
    "SupportsCopy",
    "SupportsFileRead",
    "SupportsLeftovers",
    "SupportsPrepare",
    "SupportsRangedGet",
    "SupportsReserve",
    "SupportsStopServing",
    "Tier",
    "TierSetup",
    "WriterClaim",
    "check_range",
    "copy_blob",
    "validate_key",
]


MAX_KEY_LENGTH = 1024

# Characters a key segment may not contain: path and URL separators and the characters that
# fsspec, S3 or common filesystems give a meaning of their own (``::`` chains URLs, ``?`` and
# ``#`` start query strings and fragments, ``*[]`` are globs).
_FORBIDDEN = re.compile(r"[\\:*?\"<>|#\[\]{}\x00-\x1f\x7f]")


class FailureScope(enum.IntEnum):
    """The widest failure a tier's contents outlive. Ordered: ``PROCESS < NODE < CLUSTER``."""

    #: Survives the crash of the process that wrote it (host shared memory).
    PROCESS = 1
    #: Survives the loss of the node that wrote it (a copy on another node).
    NODE = 2
    #: Survives the loss of every node (durable storage).
    CLUSTER = 3


def validate_key(key: object) -> str:
    """Return ``key`` if it is a valid tier key, else raise :class:`InvalidKey`.

    A key is one or more ``/``-separated segments. Each segment is non-empty, is not ``.`` or
    ``..``, does not start or end with whitespace, and holds none of ``\\ : * ? " < > | # [ ] { }``
    nor control characters. Any other Unicode character is allowed (spaces inside a segment,
    ``=``, ``+``, ``@``, ``%``, ``~``, accented letters...). Keys are relative: no leading ``/``.
    At most :data:`MAX_KEY_LENGTH` characters.
    """
    if not isinstance(key, str):
        raise InvalidKey(f"a tier key must be a str, got {type(key).__name__}: {key!r}")
    if not key:
        raise InvalidKey("a tier key must not be empty")
    if len(key) > MAX_KEY_LENGTH:
        raise InvalidKey(f"a tier key may be at most {MAX_KEY_LENGTH} characters, got {len(key)}")
    if key.startswith("/"):
        raise InvalidKey(f"a tier key must be relative (no leading '/'): {key!r}")
    for segment in key.split("/"):
        if not segment:
            raise InvalidKey(
                f"a tier key must not contain empty segments ('//' or a trailing '/'): {key!r}"
            )
        if segment in (".", ".."):
            raise InvalidKey(f"a tier key must not contain '.' or '..' segments: {key!r}")
        if segment != segment.strip():
            raise InvalidKey(f"a key segment must not start or end with whitespace: {key!r}")
        bad = _FORBIDDEN.search(segment)
        if bad:
            raise InvalidKey(
                f"a tier key must not contain {bad.group()!r}: {key!r}; "
                "use letters, digits and characters such as - _ . = + @ % ~ and spaces"
            )
    return key


@dataclass(frozen=True, slots=True)
class TierSetup:
    """What a checkpointer knows that a tier it builds by name may need (see
    :meth:`Tier.for_job`)."""

    job_id: str
    #: The incarnation of the job agreed by every rank when the checkpointer opened.
    session: str
    topology: Topology
    #: This node's shared-memory folder (see :class:`tiercheck.defaults.NodeRoot`).
    node_root: Path
    #: The job's folder under the ``persistent=`` URL.
    persistent_url: str
    storage_options: Mapping[str, Any]
    local_capacity: int | None
    peer_replicas: int
    peer_timeout: float


class Tier(ABC):
    """A place blobs live. See the module docstring for the contract and the call order.

    Subclasses set :attr:`name` and :attr:`survives` and implement the five abstract methods.
    They should call :meth:`_check_key` (or :meth:`_check_open`) at the start of each
    operation.
    """

    #: The tier's name, as used in configuration and in ``handle.result(name)``; a tier class is
    #: registered (entry point, ``register_tier``) under this name.
    name: str = "tier"
    #: The widest failure this tier's contents outlive. It alone decides the tier's kind:
    #: ``CLUSTER`` makes it a durable tier (``COMMIT`` records, the job record, a durable
    #: policy), anything narrower a memory tier, whatever the tier is named.
    survives: FailureScope = FailureScope.PROCESS

    _closed: bool = False

    @classmethod
    def for_job(cls, setup: TierSetup) -> Tier:
        """Build the tier for a checkpointer that names it in ``tiers=[...]``.

        Found through the registry (:func:`~tiercheck.tiers.registry.get_tier_class`). The
        default takes no arguments; a tier that needs the job's placement or folders overrides
        this, and one that needs arguments of its own is constructed by the caller and passed
        as an instance.
        """
        try:
            return cls()
        except TypeError as exc:
            raise ConfigError(
                f"the {cls.name!r} tier needs arguments; construct it yourself and pass the "
                f"instance in `tiers=[...]`: {exc}"
            ) from exc

    @abstractmethod
    async def put(self, key: str, data: Buffer) -> None:
        """Store ``data`` under ``key`` atomically, replacing any previous blob."""

    @abstractmethod
    async def get(self, key: str) -> Buffer:
        """Return the whole blob stored under ``key``; raise ``BlobNotFound`` if there is none."""

    @abstractmethod
    async def delete(self, key: str) -> None:
        """Remove the blob under ``key`` if present. Idempotent."""

    @abstractmethod
    async def exists(self, key: str) -> bool:
        """Whether a whole blob is stored under ``key``."""

    @abstractmethod
    def list(self, prefix: str = "") -> AsyncIterator[str]:
        """Yield every stored key that starts with ``prefix`` (string prefix, any order)."""

    async def putv(self, key: str, parts: Sequence[Buffer]) -> None:
        """Store the concatenation of ``parts`` under ``key``, atomically, like :meth:`put`.

        The default joins the parts (one copy); tiers that can write a sequence of buffers
        directly override it.
        """
        if len(parts) == 1:
            await self.put(key, parts[0])
        else:
            await self.put(key, b"".join(parts))

    async def get_size(self, key: str) -> int:
        """Size in bytes of the blob under ``key``. The default reads the blob; override it."""
        return len(memoryview(await self.get(key)))

    async def aclose(self) -> None:
        """Release resources. Idempotent; stored blobs stay stored."""
        self._closed = True

    @property
    def closed(self) -> bool:
        """Whether :meth:`aclose` has been called."""
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise TierClosed(
                f"the {self.name!r} tier {self!r} is closed; create a new one to use it"
            )

    def _check_key(self, key: str) -> str:
        """The checks every keyed operation starts with: the tier is open, the key is valid."""
        self._check_open()
        return validate_key(key)

    def _check_prefix(self, prefix: str) -> str:
        """The checks a listing starts with: the tier is open, ``prefix`` is a str whose complete
        segments (before its last ``/``) form a valid key. Returns those segments."""
        self._check_open()
        if not isinstance(prefix, str):
            raise InvalidKey(f"a prefix must be a str, got {type(prefix).__name__}")
        head, _partial = split_prefix(prefix)
        if head:
            validate_key(head)
        return head

    async def __aenter__(self) -> Tier:
        self._check_open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        await self.aclose()


@runtime_checkable
class Reservation(Protocol):
    """A writable buffer that becomes the blob under :attr:`key` when committed.

    Returned by :meth:`SupportsReserve.reserve`. The caller fills :attr:`buffer` (for example by
    copying tensors straight into it), then calls :meth:`commit`, which publishes the blob
    atomically, or :meth:`abort`, which discards it. Until commit, readers of ``key`` see the
    previous blob or nothing. After commit the buffer must not be written again; it stays
    readable until :meth:`release`, which the caller calls once it no longer reads it (the tier
    may then recycle the memory once the key is deleted).
    """

    @property
    def key(self) -> str: ...

    @property
    def buffer(self) -> memoryview: ...

    async def commit(self) -> None: ...

    async def abort(self) -> None: ...

    def release(self) -> None: ...


@runtime_checkable
class SupportsReserve(Protocol):
    """A tier that can hand out memory to be filled in place and stored from there.

    The local tier does: a snapshot is copied once, on the save's critical path, straight into
    the reservation's buffer (memory of this process, faulted in ahead by ``prepare`` and
    recycled from save to save); the commit stores it, off that path. The buffer is never a
    mapping of the stored file, which other processes may truncate.
    """

    async def reserve(self, key: str, nbytes: int) -> Reservation: ...


@runtime_checkable
class SupportsPrepare(Protocol):
    """A reserving tier that can ready memory ahead of the next ``reserve`` of a given size.

    Sizing storage and faulting memory in is most of what a reserve costs; a caller that knows
    the size of its next snapshot calls ``prepare`` in the background so that the reserve on
    its critical path costs next to nothing. Returns whether memory was prepared (``False``
    when it would not fit the tier's capacity).
    """

    async def prepare(self, nbytes: int) -> bool: ...


@runtime_checkable
class SupportsStopServing(Protocol):
    """A tier that answers other ranks' requests and can stop doing so before ``aclose``.

    The peer tier does. Stopping is the tier's last use of shared infrastructure (the job's
    key-value store); a closing job stops every rank's server, agrees that all have stopped,
    and only then lets ranks leave. Bounded by ``timeout`` seconds; returns whether the server
    stopped cleanly (a store or peer that is gone is logged, not raised).
    """

    async def stop_serving(self, timeout: float | None = None) -> bool: ...


@runtime_checkable
class SupportsRangedGet(Protocol):
    """A tier that can return part of a blob without reading the rest of it.

    ``get_range(key, start, end)`` returns bytes ``[start, end)`` of the blob under ``key``,
    *clipped to the blob's size* as a Python slice is: a range that runs past the end returns
    the bytes up to the end, one that starts at or past the end returns ``b""``. So the length
    of the result tells the caller where the blob ends, and a reader that does not know a
    blob's size can ask for more than it needs. ``0 <= start <= end`` must hold
    (:func:`check_range`, else :class:`ValueError` before any I/O). A missing key raises
    :class:`~tiercheck.errors.BlobNotFound`, like ``get``, even for an empty range. A range
    read is consistent with one stored blob: a concurrent ``put`` gives the bytes of the old
    blob or of the new one, never of both in one call (two calls may see different blobs; a
    reader that checks digests notices).

    The persistent tier reads ranges with fsspec's ``cat_file(path, start, end)`` (an HTTP
    range request on object stores); the local tier reads the slice of its file.
    """

    async def get_range(self, key: str, start: int, end: int) -> Buffer: ...


_T = TypeVar("_T")


@runtime_checkable
class SupportsFileRead(Protocol):
    """A tier whose blobs are files this process reads with ``pread``.

    ``read_file(key, fn)`` runs ``fn(fd, size)`` in a worker thread with the blob's file open
    (``fd``, read-only, ``size`` bytes) and returns what ``fn`` returns; the file stays the
    blob under ``key`` until ``fn`` returns (the local tier holds a shared lock on it: it can
    be neither rewritten nor recycled meanwhile). ``fn`` may run threads of its own on the
    descriptor and must be done with it when it returns; it must not close it. A missing key
    raises :class:`~tiercheck.errors.BlobNotFound`; an ``OSError`` of ``fn`` comes back typed
    as the tier types its own. What ``fn`` reads is not checked by the tier: a reader checks
    digests (:mod:`tiercheck.codec.decode.scatter` reads a blob's payload straight into a restored
    state's tensors this way, without a copy of the whole blob in between).
    """

    async def read_file(self, key: str, fn: Callable[[int, int], _T]) -> _T: ...


@runtime_checkable
class SupportsCopy(Protocol):
    """A tier that can store a copy of one of its blobs under another key without the bytes
    passing through the caller.

    ``copy(src, dst)`` publishes ``dst`` atomically with exactly the bytes of ``src`` (as a
    ``put`` of them would), overwriting a blob already there; ``src`` is left as it is. A
    missing ``src`` raises :class:`~tiercheck.errors.BlobNotFound`. Both keys follow
    :func:`validate_key`. The persistent tier hard-links on a local filesystem (blobs are never
    written in place, so a link is a copy) and copies server-side on object stores. Callers
    fall back to ``get`` then ``put`` for a tier without it (:func:`copy_blob`).
    """

    async def copy(self, src: str, dst: str) -> None: ...


async def copy_blob(tier: Tier, src: str, dst: str) -> None:
    """Store the blob under ``src`` also under ``dst``: the tier's own :class:`SupportsCopy`
    where it has it, else a ``get`` and a ``put`` through this process."""
    if isinstance(tier, SupportsCopy):
        await tier.copy(src, dst)
        return
    await tier.put(dst, await tier.get(src))


@dataclass(frozen=True, slots=True)
class Leftover:
    """Something a writer left in a tier beside the blobs: a temporary file, an unfinished upload.

    A process killed while it writes a blob leaves one. It is never read as data (listings never
    show it as a key); :class:`SupportsLeftovers` lists it so that people see it (``tiercheck ls``
    and ``verify``) and removes it once its writer is known to be gone.
    """

    #: ``"temporary"`` (a file being written, to be renamed over its key) or ``"upload"`` (an
    #: object store's multipart upload that was started and never completed).
    kind: Literal["temporary", "upload"]
    #: Where: a temporary file's path relative to the tier's root; an upload's key.
    name: str
    #: Bytes it holds, where known.
    size: int | None
    #: Seconds since it last changed (a file) or was started (an upload), when it was listed.
    age: float | None
    #: ``"dead"``: its writer is gone, so it is removable; ``"live"``: its writer runs on this
    #: host (never removed); ``"unknown"``: its writer cannot be judged from here yet (kept).
    verdict: Literal["live", "dead", "unknown"]
    #: Why, in words: who wrote it and what decided the verdict.
    why: str
    #: What the tier needs to remove it (a full path, an upload id); not for people.
    handle: str = field(default="", compare=False)

    @property
    def removable(self) -> bool:
        """Whether its writer is known to be gone."""
        return self.verdict == "dead"

    def to_json(self) -> dict[str, Any]:
        """Plain data for ``--json`` output."""
        return {
            "kind": self.kind,
            "name": self.name,
            "size": self.size,
            "age": None if self.age is None else round(self.age, 1),
            "verdict": self.verdict,
            "why": self.why,
        }


@dataclass(frozen=True, slots=True)
class WriterClaim:
    """The job's current writer at a location, as its newest writer generation names it.

    ``session`` is the session that claimed it; ``since`` when (seconds since the epoch, by the
    claiming host's clock). A tier uses it to tell the current writer's leftovers (kept while it
    may be writing them) from those of writers a newer opening superseded.
    """

    session: str
    since: float


@runtime_checkable
class SupportsLeftovers(Protocol):
    """A tier that can list and remove what killed writers left in it (:class:`Leftover`).

    ``leftovers(writer)`` lists them, each judged; ``remove_leftovers(items, writer)`` judges
    each again right before removing it and removes only those still ``"dead"``, returning
    them. ``writer`` is the location's current writer, where known (see :class:`WriterClaim`).
    Neither ever removes the file of a writer that runs on this host.
    """

    async def leftovers(self, writer: WriterClaim | None = None) -> list[Leftover]: ...

    async def remove_leftovers(
        self, items: Sequence[Leftover], writer: WriterClaim | None = None
    ) -> list[Leftover]: ...


def check_range(start: object, end: object) -> tuple[int, int]:
    """``(start, end)`` if they are ints with ``0 <= start <= end``, else :class:`ValueError`."""
    if type(start) is not int or type(end) is not int:
        raise ValueError(f"a byte range needs int bounds, got {start!r} and {end!r}")
    if not 0 <= start <= end:
        raise ValueError(f"a byte range needs 0 <= start <= end, got [{start}, {end})")
    return start, end
