"""The persistent tier: durable storage at any fsspec URL (a folder, ``s3://``, ``memory://``...).

See :class:`PersistentTier` and :class:`RetryPolicy`. How it reaches fsspec (retries, the blocking
calls in worker threads) is in :mod:`tiercheck.tiers.storage`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, Final, Literal

import fsspec
from fsspec.implementations.local import LocalFileSystem

from tiercheck.errors import BlobNotFound, ConfigError
from tiercheck.tiers import atomic
from tiercheck.tiers.base import (
    Buffer,
    FailureScope,
    Leftover,
    Tier,
    TierSetup,
    WriterClaim,
    check_range,
)
from tiercheck.tiers.storage import (
    DEFAULT_RETRY,
    FsspecCalls,
    RetryPolicy,
    is_transient,
    open_filesystem,
)

__all__ = [
    "CLOCK_SKEW",
    "DEFAULT_RETRY",
    "STALE_AFTER",
    "PersistentTier",
    "RetryPolicy",
    "is_transient",
]

#: Seconds a leftover whose writer cannot be judged from here (another host) must stay
#: unchanged, once a newer opening superseded its writer, before it counts as dead (see
#: :meth:`PersistentTier.leftovers`).
STALE_AFTER: Final = 3600.0
#: How far apart two hosts' clocks (and a storage server's) may be, for the comparisons of
#: :meth:`PersistentTier.leftovers` that mix them.
CLOCK_SKEW: Final = 300.0

_logger = logging.getLogger("tiercheck")

# Inside the class, "list" names the listing method.
_Leftovers = list[Leftover]


class _LeftoverJudging(FsspecCalls):
    """How :meth:`PersistentTier.leftovers` finds and judges what killed writers left (see
    there for the rule), and removes one once it is judged dead again."""

    _stale_after: float

    def _judge_temp(self, temp: atomic.TempFile, writer: WriterClaim | None) -> Leftover:
        verdict, why = atomic.process_verdict(temp.owner)
        age = max(0.0, time.time() - temp.mtime)
        if verdict == "unknown":
            tag = temp.owner.tag
            if writer is None:
                superseded, whose = True, "no writer of the job is known"
            elif tag is not None:
                superseded = tag != writer.session
                whose = "a newer opening superseded its writer"
            else:
                superseded = temp.mtime < writer.since - CLOCK_SKEW
                whose = "it was last written before the current writer opened the job"
            verdict, why = _stale_verdict(why, superseded, whose, age, self._stale_after)
        name = os.path.relpath(temp.path, self._base)
        return Leftover("temporary", name, temp.size, age, verdict, why, temp.path)

    def _temp_leftovers(self, writer: WriterClaim | None) -> _Leftovers:
        if not self._base:
            return []  # a tier over the whole filesystem: not walked
        return [self._judge_temp(t, writer) for t in atomic.find_temps(self._base)]

    def _remove_one(self, item: Leftover, writer: WriterClaim | None) -> Leftover | None:
        if item.kind == "upload":
            path, upload_id, started = _split_upload_handle(item.handle)
            fresh = self._judge_upload(path, upload_id, started, item.size, writer)
            if not fresh.removable:
                return None
            bucket, key, _ = self._fs.split_path(path)
            self._fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
            return fresh
        path = item.handle
        owner = atomic.parse_temp_owner(os.path.basename(path))
        if owner is None or not path.startswith(self._prefix):
            return None  # not one of ours: never removed
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return None  # renamed over its key by its writer, or removed by someone else
        judged = self._judge_temp(atomic.TempFile(path, owner, st.st_size, st.st_mtime), writer)
        if not judged.removable:
            return None
        atomic.discard(path)
        atomic.prune_empty_dirs(os.path.dirname(path), self._base)
        return judged

    def _upload_leftovers(self, writer: WriterClaim | None) -> _Leftovers:
        bucket, key_prefix, _ = self._fs.split_path(self._prefix)
        query: dict[str, Any] = {"Bucket": bucket, "Prefix": key_prefix}
        found: _Leftovers = []
        while True:
            page = self._fs.call_s3("list_multipart_uploads", **query)
            for upload in page.get("Uploads", []):
                key, upload_id = str(upload["Key"]), str(upload["UploadId"])
                started = float(upload["Initiated"].timestamp())
                size = self._upload_size(bucket, key, upload_id)
                found.append(
                    self._judge_upload(f"{bucket}/{key}", upload_id, started, size, writer)
                )
            if not page.get("IsTruncated"):
                return found
            query["KeyMarker"] = page.get("NextKeyMarker", "")
            query["UploadIdMarker"] = page.get("NextUploadIdMarker", "")

    def _upload_size(self, bucket: str, key: str, upload_id: str) -> int | None:
        query: dict[str, Any] = {"Bucket": bucket, "Key": key, "UploadId": upload_id}
        total = 0
        while True:
            try:
                page = self._fs.call_s3("list_parts", **query)
            except Exception as exc:  # sizes are for people; the upload is listed regardless
                _logger.debug("tiercheck: cannot list the parts of upload %s: %r", upload_id, exc)
                return None
            total += sum(int(part.get("Size", 0)) for part in page.get("Parts", []))
            if not page.get("IsTruncated"):
                return total
            query["PartNumberMarker"] = page.get("NextPartNumberMarker", 0)

    def _judge_upload(
        self,
        path: str,
        upload_id: str,
        started: float,
        size: int | None,
        writer: WriterClaim | None,
    ) -> Leftover:
        age = max(0.0, time.time() - started)
        why = f"an unfinished multipart upload (id {upload_id[:16]}) started {_ago(age)} ago"
        if writer is None:
            superseded, whose = True, "no writer of the job is known"
        else:
            superseded = started < writer.since - CLOCK_SKEW
            whose = "it was started before the current writer opened the job"
        verdict, why = _stale_verdict(why, superseded, whose, age, self._stale_after)
        name = path[len(self._prefix) :] if path.startswith(self._prefix) else path
        return Leftover("upload", name, size, age, verdict, why, f"{path}\n{upload_id}\n{started}")


class PersistentTier(_LeftoverJudging, Tier):
    """Blobs at an fsspec URL: a local or mounted folder, ``s3://bucket/prefix``, ``memory://``.

    ``PersistentTier(url, *, storage_options=None, retry=DEFAULT_RETRY, fsync=True,
    name="persistent")``

    ``storage_options`` go to the fsspec filesystem (for S3: ``key``, ``secret``,
    ``client_kwargs={"endpoint_url": ...}``...). An unknown protocol, or one whose backend is not
    installed, raises :class:`~tiercheck.errors.ConfigError` here, saying what to install.

    Atomic puts
        On a local filesystem (``file://`` or a plain path, NFS and Lustre mounts included) a
        blob is written to a hidden temporary file next to its final name, ``fsync``\\ ed (unless
        ``fsync=False``) and renamed over it, like the local tier (:mod:`tiercheck.tiers.atomic`);
        ``putv`` writes its parts in turn without joining them. Anywhere else the blob goes up in
        one whole-object put (``pipe_file``), which object stores publish atomically (S3 shows a
        multipart upload only once it completes). Object stores need ``bytes`` or ``bytearray``:
        other buffers, and ``putv``'s parts, are copied once into one.

    Failures
        Every fsspec call runs in a worker thread, never on the event loop. Transient failures
        are retried per ``retry``; what still fails raises :class:`~tiercheck.errors.StorageError`
        naming the URL, the key and the cause (chained). A missing blob raises
        :class:`~tiercheck.errors.BlobNotFound` at once, without retrying. On S3, botocore's
        own retries are off unless ``storage_options`` set them (``config_kwargs={"retries":
        ...}``): they multiplied these (see :func:`~tiercheck.tiers.storage.single_try_botocore`),
        so that with the defaults a call to an endpoint that refuses connections fails after
        ~1.5 s, and one to an endpoint that does not answer after five of s3fs's 5 s connect
        timeouts (``config_kwargs={"connect_timeout": ...}`` shortens them).

    Listing
        Recursive (``fs.find``), so nested keys are found on object stores too; temporary files
        never show. Listing caches of the filesystem are dropped before each look-up, so that
        blobs written by other processes are seen.

    Leftovers (:class:`~tiercheck.tiers.SupportsLeftovers`)
        A process killed mid-put leaves a temporary file (filesystems) or an unfinished
        multipart upload (S3: s3fs uploads blobs of 100 MiB and more in parts; the parts stay
        stored, unlisted and billed, until the upload is aborted). :meth:`leftovers` lists them
        and :meth:`remove_leftovers` removes those whose writer is gone; see :meth:`leftovers`
        for the rule. ``writer_tag`` (the checkpointer passes its session) is written into the
        names of this tier's temporary files so that the rule can tell whose they are.

    The fsspec filesystem instance may be shared with other users of the same URL and options
    (fsspec caches instances); :meth:`aclose` therefore leaves it open.
    """

    name = "persistent"
    survives = FailureScope.CLUSTER

    @classmethod
    def for_job(cls, setup: TierSetup) -> PersistentTier:
        """A checkpointer's persistent tier: the job's folder under the ``persistent=`` URL."""
        return cls(
            setup.persistent_url,
            storage_options=setup.storage_options,
            writer_tag=setup.session if atomic.valid_tag(setup.session) else None,
        )

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        storage_options: Mapping[str, Any] | None = None,
        retry: RetryPolicy = DEFAULT_RETRY,
        fsync: bool = True,
        name: str = "persistent",
        writer_tag: str | None = None,
        stale_after: float = STALE_AFTER,
    ) -> None:
        if not isinstance(retry, RetryPolicy):
            raise ConfigError(f"retry must be a RetryPolicy, got {type(retry).__name__}")
        if not isinstance(url, (str, os.PathLike)):
            raise ConfigError(f"the persistent tier needs a URL or path, got {url!r}")
        if storage_options is not None and not isinstance(storage_options, Mapping):
            raise ConfigError(
                f"storage_options must be a mapping of fsspec options, got {storage_options!r}"
            )
        if not isinstance(fsync, bool):
            raise ConfigError(f"fsync must be True or False, got {fsync!r}")
        if writer_tag is not None and not atomic.valid_tag(writer_tag):
            raise ConfigError(
                f"writer_tag must be 1 to 64 letters, digits, '-' or '_', got {writer_tag!r}"
            )
        if not (isinstance(stale_after, (int, float)) and stale_after >= 0):
            raise ConfigError(f"stale_after must be a number of seconds >= 0, got {stale_after!r}")
        self._writer_tag = writer_tag
        self._stale_after = float(stale_after)
        self._url = os.fspath(url)
        if not isinstance(self._url, str) or not self._url:
            raise ConfigError(f"the persistent tier needs a non-empty URL or path, got {url!r}")
        self._fs, root = open_filesystem(self._url, dict(storage_options or {}))
        self._local = isinstance(self._fs, LocalFileSystem)
        self._base = str(root).rstrip("/")
        self._prefix = f"{self._base}/" if self._base else str(self._fs.root_marker)
        self._retry = retry
        self._fsync = fsync
        self.name = name

    def __repr__(self) -> str:
        return f"PersistentTier({self._url!r})"

    @property
    def url(self) -> str:
        """The URL (or path) this tier was opened on."""
        return self._url

    @property
    def local_folder(self) -> str | None:
        """The folder the blobs live in, on a local (or mounted) filesystem; else ``None``."""
        return (self._base or "/") if self._local else None

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        """The fsspec filesystem the blobs live in."""
        return self._fs

    @property
    def retry(self) -> RetryPolicy:
        """The retry policy in force."""
        return self._retry

    # --- the Tier interface -------------------------------------------------------------------

    async def put(self, key: str, data: Buffer) -> None:
        """Store ``data`` under ``key`` atomically (rename on filesystems, one object put else)."""
        self._check_key(key)
        # Views are left to the garbage collector, not released: if this coroutine is
        # cancelled, the worker thread may still be reading them.
        view = atomic.as_byte_view(data)
        write = self._put_local if self._local else self._pipe
        await self._call("put", key, write, key, (view,))

    async def putv(self, key: str, parts: Sequence[Buffer]) -> None:
        """Store the concatenation of ``parts`` (written in turn, unjoined, on filesystems)."""
        self._check_key(key)
        views = [atomic.as_byte_view(part) for part in parts]
        write = self._put_local if self._local else self._pipe
        await self._call("put", key, write, key, views)

    async def get(self, key: str) -> bytes:
        """Return the blob under ``key``."""
        self._check_key(key)
        return await self._call("get", key, self._get_sync, key)

    async def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the blob under ``key``, clipped to its size.

        :class:`~tiercheck.tiers.SupportsRangedGet`: one ranged read (``cat_file(path, start,
        end)``; a range request on object stores), retried like ``get``.
        """
        self._check_key(key)
        check_range(start, end)
        return await self._call("get_range", key, self._range_sync, key, start, end)

    async def copy(self, src: str, dst: str) -> None:
        """Store the blob under ``src`` also under ``dst`` (:class:`~tiercheck.tiers.SupportsCopy`).

        On a local filesystem a hard link, published like a put (a temporary name, then a
        rename): blobs are never written in place, so the two names can share one file. Where
        links are refused (some network filesystems), and on object stores, the filesystem's own
        copy (server-side on S3). Retried like any call.
        """
        self._check_key(src)
        self._check_key(dst)
        await self._call("copy", dst, self._copy_sync, src, dst)

    async def get_size(self, key: str) -> int:
        """Size of the blob under ``key``, from the store's metadata (no read)."""
        self._check_key(key)
        size = await self._call("get_size", key, self._size_sync, key)
        if size is None:
            raise BlobNotFound(f"no blob {key!r} in the persistent tier at {self._url}")
        return size

    async def exists(self, key: str) -> bool:
        """Whether a blob is stored under ``key``."""
        self._check_key(key)
        return await self._call("exists", key, self._size_sync, key) is not None

    async def delete(self, key: str) -> None:
        """Remove the blob under ``key``; a missing blob is fine."""
        self._check_key(key)
        await self._call("delete", key, self._delete_sync, key)

    async def list(self, prefix: str = "") -> AsyncIterator[str]:
        """Yield every stored key that starts with ``prefix`` (recursive listing)."""
        head = self._check_prefix(prefix)
        keys = await self._call("list", prefix, self._list_sync, head, prefix)
        for key in keys:
            yield key

    # --- leftovers of killed writers -------------------------------------------------------------

    async def leftovers(self, writer: WriterClaim | None = None) -> _Leftovers:
        """What killed writers left here: temporary files, unfinished uploads; each judged.

        ``writer`` is the job's current writer (its newest writer generation), where known.
        The verdict of each (see :class:`~tiercheck.tiers.Leftover`):

        * a temporary file written on this host, in this boot and pid namespace: ``"live"``
          while its writer (pid *and* start time) runs, ``"dead"`` as soon as it does not;
        * anything else (a file another host wrote to a shared filesystem, an upload: a pid
          means nothing there) is ``"dead"`` only when both hold: **its writer was
          superseded** -- the file's name carries another session than ``writer``'s (names
          without one: it last changed before ``writer`` claimed the job; uploads: started
          before that), or no writer is known -- **and it has not changed for**
          ``stale_after`` seconds (default :data:`STALE_AFTER`, an hour). Otherwise it is
          ``"unknown"`` and kept.

        So the current writer's files are never removed while it may be writing them, and
        neither is a file any process changed within the last ``stale_after`` seconds. What
        the rule can remove of a live process is only the file of a writer that a newer opening
        superseded and that has been stuck for that long: its put then fails (counted, logged),
        which is what a superseded writer's put should do anyway (see
        :class:`~tiercheck.errors.Superseded`).
        """
        self._check_open()
        if self._local:
            return await asyncio.to_thread(self._temp_leftovers, writer)
        if _is_s3(self._fs):
            return await self._call("list uploads", "", self._upload_leftovers, writer)
        return []

    async def remove_leftovers(
        self, items: Sequence[Leftover], writer: WriterClaim | None = None
    ) -> _Leftovers:
        """Remove those of ``items`` still ``"dead"`` when judged again now; return them."""
        self._check_open()
        removed: _Leftovers = []
        for item in items:
            fresh = await self._call("remove leftover", item.name, self._remove_one, item, writer)
            if fresh is not None:
                removed.append(fresh)
        return removed


def _is_s3(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether ``fs`` is s3fs's (the one object store whose unfinished uploads are listed)."""
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return "s3" in protocols and hasattr(fs, "call_s3")


def _split_upload_handle(handle: str) -> tuple[str, str, float]:
    path, upload_id, started = handle.split("\n")
    return path, upload_id, float(started)


def _ago(seconds: float | None) -> str:
    if seconds is None:
        return "an unknown time"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _stale_verdict(
    why: str, superseded: bool, whose: str, age: float, stale_after: float
) -> tuple[Literal["dead", "unknown"], str]:
    """The verdict of a leftover whose writer cannot be judged by its process (see
    :meth:`PersistentTier.leftovers`)."""
    if superseded and age >= stale_after:
        return "dead", f"{why}; {whose}, and it has not changed for {_ago(age)}"
    if not superseded:
        return "unknown", f"{why}; kept: it may be the current writer's"
    return "unknown", (
        f"{why}; {whose}, but it changed {_ago(age)} ago: kept until it has not changed for "
        f"{_ago(stale_after)}"
    )
