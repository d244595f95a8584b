"""How the persistent tier reaches its storage through fsspec: the retry policy, which errors
are worth retrying, opening a filesystem from a URL, and the blocking calls it runs in worker
threads (:class:`FsspecCalls`, which :class:`~tiercheck.tiers.PersistentTier` extends).

Every name here is importable from :mod:`tiercheck.tiers.persistent` too.
"""

from __future__ import annotations

import asyncio
import errno
import math
import os
import random
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeVar

import fsspec
from fsspec.core import split_protocol, url_to_fs

from tiercheck.errors import BlobNotFound, ConfigError, InvalidKey, StorageError, TiercheckError
from tiercheck.tiers import atomic
from tiercheck.tiers.base import validate_key

__all__ = [
    "DEFAULT_RETRY",
    "FsspecCalls",
    "RetryPolicy",
    "is_transient",
    "open_filesystem",
    "single_try_botocore",
]

_T = TypeVar("_T")

# What to install for a protocol whose fsspec backend is missing (fsspec's own hint otherwise).
_EXTRAS: Final = {"s3": "tiercheck[s3]", "s3a": "tiercheck[s3]"}

# OS errors that no amount of waiting fixes: retrying them only delays the report.
_PERMANENT_ERRNOS: Final = frozenset(
    {
        errno.EACCES,
        errno.EPERM,
        errno.EROFS,
        errno.ENOSPC,
        errno.EDQUOT,
        errno.ENAMETOOLONG,
        errno.EINVAL,
        errno.EFBIG,
        errno.ELOOP,
        errno.EEXIST,
        errno.EISDIR,
        errno.ENOTDIR,
        errno.ENOENT,
        errno.ENOTEMPTY,
        errno.EBADF,
    }
)
_MISSING: Final = (FileNotFoundError, IsADirectoryError, NotADirectoryError)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How often, and how patiently, the persistent tier retries a failed storage call.

    An operation is tried at most ``attempts`` times. Before retry number *n* (1 for the first
    retry) it waits a random time between half and all of
    ``min(max_delay, initial_delay * multiplier ** (n - 1))`` seconds: exponential backoff,
    bounded, with jitter so that many ranks failing together do not retry in lockstep.

    Only transient errors are retried (connection and timeout errors, I/O errors without a
    permanent cause, HTTP client errors of botocore and aiohttp). A missing blob, a permission
    error, a full or read-only filesystem are reported at once. ``RetryPolicy(attempts=1)``
    never retries.
    """

    #: Total tries, the first included (>= 1).
    attempts: int = 5
    #: Upper bound of the first wait, in seconds.
    initial_delay: float = 0.1
    #: Upper bound of any wait, in seconds.
    max_delay: float = 5.0
    #: Growth of the bound from one retry to the next (>= 1).
    multiplier: float = 2.0

    def __post_init__(self) -> None:
        if not isinstance(self.attempts, int) or isinstance(self.attempts, bool):
            raise ConfigError(f"RetryPolicy.attempts must be an int, got {self.attempts!r}")
        if self.attempts < 1:
            raise ConfigError(f"RetryPolicy.attempts must be >= 1, got {self.attempts}")
        if not (math.isfinite(self.initial_delay) and self.initial_delay >= 0):
            raise ConfigError(
                f"RetryPolicy.initial_delay must be a finite number >= 0, got {self.initial_delay}"
            )
        if not (math.isfinite(self.max_delay) and self.max_delay >= self.initial_delay):
            raise ConfigError(
                f"RetryPolicy.max_delay must be finite and >= initial_delay, got {self.max_delay}"
            )
        if not (math.isfinite(self.multiplier) and self.multiplier >= 1):
            raise ConfigError(f"RetryPolicy.multiplier must be >= 1, got {self.multiplier}")

    def bound(self, retry: int) -> float:
        """The longest wait before retry number ``retry`` (1 for the first retry)."""
        if retry < 1:
            raise ValueError(f"retry numbers start at 1, got {retry}")
        try:
            grown = self.initial_delay * self.multiplier ** (retry - 1)
        except OverflowError:
            grown = math.inf
        return min(self.max_delay, grown)

    def delay(self, retry: int) -> float:
        """A random wait before retry number ``retry``, in ``[bound / 2, bound]``."""
        bound = self.bound(retry)
        return bound / 2 + random.uniform(0, bound / 2)


#: The retry policy a :class:`PersistentTier` uses unless given another.
DEFAULT_RETRY: Final = RetryPolicy()


def is_transient(exc: BaseException) -> bool:
    """Whether a storage error is worth retrying (see :class:`RetryPolicy`)."""
    if isinstance(exc, (PermissionError, FileExistsError, *_MISSING)):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    if isinstance(exc, OSError):
        return exc.errno not in _PERMANENT_ERRNOS
    return isinstance(exc, _network_errors())


def _network_errors() -> tuple[type[BaseException], ...]:
    """HTTP client errors of the libraries an object-store backend may use, if loaded.

    Looked up in ``sys.modules`` so that checking an error never imports anything.
    """
    found: list[type[BaseException]] = []
    botocore_exceptions = sys.modules.get("botocore.exceptions")
    if botocore_exceptions is not None:
        for name in ("HTTPClientError", "ConnectionError"):
            cls = getattr(botocore_exceptions, name, None)
            if isinstance(cls, type) and issubclass(cls, BaseException):
                found.append(cls)
    aiohttp = sys.modules.get("aiohttp")
    cls = getattr(aiohttp, "ClientError", None) if aiohttp is not None else None
    if isinstance(cls, type) and issubclass(cls, BaseException):
        found.append(cls)
    return tuple(found)


class FsspecCalls:
    """The persistent tier's storage calls: each blocking one runs in a worker thread through
    :meth:`_call`, which retries transient failures per the tier's :class:`RetryPolicy`.

    :class:`~tiercheck.tiers.PersistentTier` sets the attributes below when it is made.
    """

    _url: str
    _fs: fsspec.AbstractFileSystem
    _local: bool
    _base: str
    _prefix: str
    _retry: RetryPolicy
    _fsync: bool
    _writer_tag: str | None

    def _path(self, key: str) -> str:
        return f"{self._prefix}{key}"

    # --- retries ------------------------------------------------------------------------------

    async def _call(self, op: str, key: str, fn: Callable[..., _T], *args: object) -> _T:
        """Run ``fn(*args)`` in a worker thread, retrying transient failures per the policy."""
        attempt = 1
        while True:
            try:
                return await asyncio.to_thread(fn, *args)
            except TiercheckError:
                raise
            except Exception as exc:
                if attempt >= self._retry.attempts or not is_transient(exc):
                    tries = f"after {attempt} attempts" if attempt > 1 else "(not retried)"
                    raise StorageError(
                        f"{op} of key {key!r} in the persistent tier at {self._url} failed "
                        f"{tries}: {type(exc).__name__}: {exc}"
                    ) from exc
            await asyncio.sleep(self._retry.delay(attempt))
            attempt += 1

    # --- blocking operations (run in worker threads) --------------------------------------------

    def _put_local(self, key: str, views: Sequence[memoryview]) -> None:
        atomic.atomic_write(self._path(key), views, fsync=self._fsync, tag=self._writer_tag)

    def _pipe(self, key: str, views: Sequence[memoryview]) -> None:
        whole = views[0].obj if len(views) == 1 else None
        body: bytes | bytearray
        if isinstance(whole, (bytes, bytearray)) and views[0].nbytes == len(whole):
            body = whole
        else:
            # Object stores take bytes or bytearray only. Joining happens here, in the worker:
            # bytes.join copies large buffers with the GIL released.
            body = b"".join(views)
        self._fs.pipe_file(self._path(key), body)

    def _copy_sync(self, src: str, dst: str) -> None:
        source, target = self._path(src), self._path(dst)
        if self._local:
            if not os.path.isfile(source):
                raise BlobNotFound(f"no blob {src!r} in the persistent tier at {self._url}")
            if atomic.link_over(source, target, fsync=self._fsync):
                return
            # No hard links here: copy through this process, published atomically.
            with open(source, "rb") as f:
                atomic.atomic_write(target, [memoryview(f.read())], fsync=self._fsync)
            return
        self._fs.invalidate_cache(source)
        try:
            self._fs.copy(source, target)
        except _MISSING:
            raise BlobNotFound(f"no blob {src!r} in the persistent tier at {self._url}") from None
        finally:
            self._fs.invalidate_cache(target)

    def _get_sync(self, key: str) -> bytes:
        path = self._path(key)
        self._fs.invalidate_cache(path)
        try:
            data = self._fs.cat_file(path)
        except _MISSING:
            raise BlobNotFound(f"no blob {key!r} in the persistent tier at {self._url}") from None
        return bytes(data)

    def _range_sync(self, key: str, start: int, end: int) -> bytes:
        if start == end:
            # Nothing to read, but a missing blob is still missing.
            if self._size_sync(key) is None:
                raise BlobNotFound(f"no blob {key!r} in the persistent tier at {self._url}")
            return b""
        path = self._path(key)
        self._fs.invalidate_cache(path)
        try:
            data = self._fs.cat_file(path, start=start, end=end)
        except _MISSING:
            raise BlobNotFound(f"no blob {key!r} in the persistent tier at {self._url}") from None
        except Exception:
            # Object stores refuse a range that starts past the end (S3: InvalidRange) where
            # files and memory return nothing; the contract is the slice's. The size says which.
            size = self._size_sync(key)
            if size is None:
                raise BlobNotFound(
                    f"no blob {key!r} in the persistent tier at {self._url}"
                ) from None
            if start >= size:
                return b""
            raise
        return bytes(data)

    def _size_sync(self, key: str) -> int | None:
        """Size of the blob, or ``None`` if there is none (a folder is not a blob)."""
        path = self._path(key)
        self._fs.invalidate_cache(path)
        try:
            info = self._fs.info(path)
        except _MISSING:
            return None
        if info.get("type") != "file":
            return None
        return int(info["size"])

    def _delete_sync(self, key: str) -> None:
        path = self._path(key)
        try:
            self._fs.rm_file(path)
        except _MISSING:
            # Already gone, or only a folder of other keys: there is no blob to delete.
            return
        finally:
            self._fs.invalidate_cache(path)
        if self._local:
            atomic.prune_empty_dirs(os.path.dirname(path), self._base or "/")

    def _list_sync(self, head: str, prefix: str) -> Sequence[str]:
        start = self._path(head) if head else (self._base or str(self._fs.root_marker))
        self._fs.invalidate_cache()
        found = self._fs.find(start)
        cut = len(self._prefix)
        keys = []
        for path in found:
            if not path.startswith(self._prefix):
                continue
            key = path[cut:]
            if key.startswith(prefix) and _valid_key(key):
                keys.append(key)
        return keys


def _valid_key(key: str) -> bool:
    # Temporary files hold '#', which no key may; stray files with odd names are skipped too.
    try:
        validate_key(key)
    except InvalidKey:
        return False
    return True


def single_try_botocore(protocol: str, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` for ``protocol``'s filesystem, with botocore's own retries turned off on S3
    unless ``options`` configure them (``config_kwargs={"retries": ...}``).

    The persistent tier retries every storage call itself (:class:`RetryPolicy`); botocore's
    default retries (5 tries, with waits of up to 1, 2, 4 and 8 s) ran *inside* each of those,
    so that an endpoint that refuses connections took ~8.6 s per try and ~44 s per call before
    it failed, and one that does not answer (s3fs's 5 s connect timeout) ~32 s per try and
    ~160 s per call. s3fs still retries throttling (``SlowDown``) and broken reads itself.
    """
    if protocol not in _EXTRAS:
        return options
    config = dict(options.get("config_kwargs") or {})
    if "retries" in config:
        return options
    config["retries"] = {"total_max_attempts": 1}
    return {**options, "config_kwargs": config}


def open_filesystem(url: str, options: dict[str, Any]) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem of ``url`` and the root path in it; a
    :class:`~tiercheck.errors.ConfigError` that says what to install or fix when it cannot be
    opened. On S3, botocore's own retries are off unless ``options`` set them
    (:func:`single_try_botocore`)."""
    protocol = split_protocol(url)[0] or "file"
    options = single_try_botocore(protocol, options)
    try:
        fs, root = url_to_fs(url, **options)
    except ImportError as exc:
        hint = _EXTRAS.get(protocol)
        what = f"pip install '{hint}'" if hint else str(exc)
        raise ConfigError(
            f"the persistent tier cannot open {url!r}: the {protocol}:// backend is not "
            f"installed ({what})"
        ) from exc
    except ValueError as exc:
        if protocol in fsspec.available_protocols():
            raise ConfigError(f"the persistent tier cannot open {url!r}: {exc}") from exc
        known = ", ".join(f"{p}://" for p in fsspec.available_protocols())
        raise ConfigError(
            f"the persistent tier cannot open {url!r}: unknown protocol {protocol!r}. "
            f"Known protocols: {known} (some need an extra: 'tiercheck[s3]' for s3://), "
            "or give a plain path."
        ) from exc
    except Exception as exc:
        raise ConfigError(
            f"the persistent tier cannot open {url!r} with storage options "
            f"{sorted(options)}: {type(exc).__name__}: {exc}"
        ) from exc
    return fs, str(root)
