"""PersistentTier beyond the conformance suite: retries, errors, URLs, threads, local files."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import importlib.util
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem
from hypothesis import settings

from tiercheck.errors import BlobNotFound, ConfigError, StorageError
from tiercheck.testing import TierStateMachine
from tiercheck.tiers import PersistentTier, RetryPolicy, Tier, atomic, persistent
from tiercheck.tiers.base import WriterClaim
from tiercheck.tiers.persistent import is_transient

from .conftest import S3Server

FAST = RetryPolicy(attempts=4, initial_delay=0.001, max_delay=0.004)


class FlakyFileSystem(MemoryFileSystem):
    """An in-memory filesystem whose calls fail as planned, recording the calling thread."""

    protocol = "tiercheck-flaky"
    store: ClassVar[dict[str, Any]] = {}
    pseudo_dirs: ClassVar[list[str]] = [""]
    #: method name -> exceptions to raise, one per call, before calls succeed again.
    plan: ClassVar[dict[str, list[BaseException]]] = {}
    #: (method name, thread ident) of every call.
    calls: ClassVar[list[tuple[str, int]]] = []

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        if isinstance(path, str):
            path = path.removeprefix(f"{cls.protocol}://")
        return super()._strip_protocol(path)

    def _call(self, method: str) -> None:
        FlakyFileSystem.calls.append((method, threading.get_ident()))
        queue = FlakyFileSystem.plan.get(method)
        if queue:
            raise queue.pop(0)

    def pipe_file(self, path: str, value: Any, *args: Any, **kwargs: Any) -> Any:
        self._call("pipe_file")
        return super().pipe_file(path, value, *args, **kwargs)

    def cat_file(self, path: str, *args: Any, **kwargs: Any) -> Any:
        self._call("cat_file")
        return super().cat_file(path, *args, **kwargs)

    def info(self, path: str, **kwargs: Any) -> Any:
        self._call("info")
        return super().info(path, **kwargs)

    def rm_file(self, path: str) -> Any:
        self._call("rm_file")
        return super().rm_file(path)

    def find(self, path: str, *args: Any, **kwargs: Any) -> Any:
        self._call("find")
        return super().find(path, *args, **kwargs)


@pytest.fixture
def flaky() -> Iterator[type[FlakyFileSystem]]:
    """The flaky filesystem, registered under its protocol, with a clean plan and store."""
    fsspec.register_implementation(FlakyFileSystem.protocol, FlakyFileSystem, clobber=True)
    FlakyFileSystem.store.clear()
    FlakyFileSystem.plan.clear()
    FlakyFileSystem.calls.clear()
    yield FlakyFileSystem
    FlakyFileSystem.store.clear()
    FlakyFileSystem.plan.clear()
    FlakyFileSystem.calls.clear()


def flaky_tier(retry: RetryPolicy = FAST) -> PersistentTier:
    return PersistentTier(f"{FlakyFileSystem.protocol}://bucket/{uuid.uuid4().hex}", retry=retry)


def names_in(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def count(method: str) -> int:
    return sum(1 for name, _ in FlakyFileSystem.calls if name == method)


# --- retries -----------------------------------------------------------------------------------


async def test_transient_errors_are_retried_until_success(flaky: type[FlakyFileSystem]) -> None:
    """Connection, timeout and I/O errors are retried; the operation then succeeds."""
    tier = flaky_tier()
    flaky.plan["pipe_file"] = [ConnectionResetError(), TimeoutError(), OSError(errno.EIO, "io")]
    await tier.put("k", b"data")
    assert count("pipe_file") == 4
    flaky.plan["cat_file"] = [ConnectionError()]
    assert await tier.get("k") == b"data"
    flaky.plan["info"] = [TimeoutError(), TimeoutError()]
    assert await tier.exists("k")
    flaky.plan["find"] = [OSError(errno.EAGAIN, "again")]
    assert [key async for key in tier.list()] == ["k"]
    flaky.plan["rm_file"] = [ConnectionAbortedError()]
    await tier.delete("k")
    assert not await tier.exists("k")


async def test_retries_are_bounded(flaky: type[FlakyFileSystem]) -> None:
    """An error that persists through every attempt raises StorageError naming URL, key, cause."""
    tier = flaky_tier(RetryPolicy(attempts=3, initial_delay=0.001, max_delay=0.002))
    flaky.plan["pipe_file"] = [ConnectionError(f"down {i}") for i in range(10)]
    with pytest.raises(StorageError) as info:
        await tier.put("v1/rank0", b"data")
    assert count("pipe_file") == 3
    assert isinstance(info.value, OSError)
    assert isinstance(info.value.__cause__, ConnectionError)
    # The message is for people: it must say where and what.
    assert tier.url in str(info.value)
    assert "v1/rank0" in str(info.value)


@pytest.mark.parametrize(
    "error",
    [
        PermissionError(errno.EACCES, "denied"),
        OSError(errno.ENOSPC, "full"),
        OSError(errno.EROFS, "read-only"),
        ValueError("bad argument"),
        FileExistsError(),
    ],
    ids=["permission", "enospc", "erofs", "valueerror", "exists"],
)
async def test_permanent_errors_are_not_retried(
    flaky: type[FlakyFileSystem], error: BaseException
) -> None:
    """Errors that waiting cannot fix raise StorageError after one attempt, cause chained."""
    tier = flaky_tier()
    flaky.plan["pipe_file"] = [error]
    with pytest.raises(StorageError) as info:
        await tier.put("k", b"data")
    assert count("pipe_file") == 1
    assert info.value.__cause__ is error
    assert not await tier.exists("k")


async def test_missing_blob_is_not_retried(flaky: type[FlakyFileSystem]) -> None:
    """A missing blob raises BlobNotFound at once: one call, no retry."""
    tier = flaky_tier()
    with pytest.raises(BlobNotFound):
        await tier.get("missing")
    assert count("cat_file") == 1
    with pytest.raises(BlobNotFound):
        await tier.get_size("missing")
    assert count("info") == 1


async def test_waits_follow_the_policy(
    flaky: type[FlakyFileSystem], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between attempts the tier sleeps, with growing, bounded, jittered delays."""
    waits: list[float] = []
    real_sleep = asyncio.sleep

    async def fake_sleep(delay: float) -> None:
        waits.append(delay)
        await real_sleep(0)

    monkeypatch.setattr(persistent.asyncio, "sleep", fake_sleep)
    policy = RetryPolicy(attempts=6, initial_delay=1.0, max_delay=5.0, multiplier=2.0)
    tier = flaky_tier(policy)
    flaky.plan["pipe_file"] = [ConnectionError() for _ in range(5)]
    await tier.put("k", b"x")
    assert len(waits) == 5
    for retry, wait in enumerate(waits, start=1):
        bound = min(5.0, 2.0 ** (retry - 1))
        assert bound / 2 <= wait <= bound


def test_retry_policy_bounds() -> None:
    """Delays grow by the multiplier, never exceed max_delay, and jitter within [b/2, b]."""
    policy = RetryPolicy(attempts=50, initial_delay=0.5, max_delay=3.0, multiplier=3.0)
    assert [policy.bound(n) for n in (1, 2, 3, 4)] == [0.5, 1.5, 3.0, 3.0]
    assert policy.bound(10_000) == 3.0
    for n in range(1, 40):
        assert policy.bound(n) / 2 <= policy.delay(n) <= policy.bound(n)
    with pytest.raises(ValueError):  # noqa: PT011 -- the type is the contract
        policy.bound(0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"attempts": 0},
        {"attempts": 1.5},
        {"initial_delay": -1.0},
        {"initial_delay": float("nan")},
        {"initial_delay": 2.0, "max_delay": 1.0},
        {"max_delay": float("inf")},
        {"multiplier": 0.5},
    ],
)
def test_retry_policy_rejects_bad_values(kwargs: dict[str, Any]) -> None:
    """Impossible policies raise ConfigError at construction."""
    with pytest.raises(ConfigError):
        RetryPolicy(**kwargs)


def test_retry_policy_is_a_frozen_slotted_dataclass() -> None:
    """RetryPolicy values cannot be changed and carry no per-instance dict."""
    policy = RetryPolicy()
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.attempts = 3  # type: ignore[misc]
    assert not hasattr(policy, "__dict__")


@pytest.mark.parametrize(
    ("error", "transient"),
    [
        (ConnectionError(), True),
        (TimeoutError(), True),
        (OSError(errno.EIO, "io"), True),
        (OSError("no errno"), True),
        (FileNotFoundError(), False),
        (PermissionError(), False),
        (IsADirectoryError(), False),
        (OSError(errno.ENOSPC, "full"), False),
        (ValueError(), False),
        (RuntimeError(), False),
    ],
)
def test_transient_error_classification(error: BaseException, transient: bool) -> None:
    """Only errors that may pass with time count as transient."""
    assert is_transient(error) is transient


def test_botocore_http_errors_are_transient() -> None:
    """botocore's connection and HTTP client errors are retried (when botocore is in use)."""
    exceptions = pytest.importorskip("botocore.exceptions")
    assert is_transient(exceptions.EndpointConnectionError(endpoint_url="http://x"))
    assert is_transient(exceptions.ReadTimeoutError(endpoint_url="http://x"))
    assert not is_transient(exceptions.ParamValidationError(report="bad"))


# --- construction ------------------------------------------------------------------------------


def test_unknown_protocol_is_a_config_error() -> None:
    """A URL with an unknown protocol fails at construction with ConfigError (a ValueError)."""
    with pytest.raises(ConfigError) as info:
        PersistentTier("nosuchprotocol://bucket/prefix")
    assert isinstance(info.value, ValueError)


def test_missing_backend_is_a_config_error() -> None:
    """A known protocol whose backend is not installed fails at construction with ConfigError."""
    if importlib.util.find_spec("gcsfs") is not None:
        pytest.skip("gcsfs is installed here")
    with pytest.raises(ConfigError) as info:
        PersistentTier("gs://bucket/prefix")
    assert isinstance(info.value.__cause__, ImportError)


@pytest.mark.parametrize("bad", ["", 42, None])
def test_url_must_be_a_non_empty_path(bad: object) -> None:
    """The URL must be a non-empty str or path-like."""
    with pytest.raises(ConfigError):
        PersistentTier(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs", [{"retry": 3}, {"storage_options": 3}, {"storage_options": ["anon"]}, {"fsync": 1}]
)
def test_bad_options_are_config_errors(kwargs: dict[str, object]) -> None:
    """retry= takes a RetryPolicy, storage_options= a mapping, fsync= a bool."""
    with pytest.raises(ConfigError):
        PersistentTier("memory://x", **kwargs)  # type: ignore[arg-type]


# --- threads -----------------------------------------------------------------------------------


async def test_fsspec_calls_run_in_worker_threads(flaky: type[FlakyFileSystem]) -> None:
    """Every filesystem call happens off the event-loop thread."""
    tier = flaky_tier()
    await tier.put("a/b", b"1")
    await tier.putv("a/c", [b"1", b"2"])
    await tier.get("a/b")
    await tier.get_size("a/b")
    await tier.exists("a/c")
    assert [key async for key in tier.list("a/")]
    await tier.delete("a/b")
    methods = {name for name, _ in flaky.calls}
    assert methods == {"pipe_file", "cat_file", "info", "find", "rm_file"}
    assert threading.get_ident() not in {ident for _, ident in flaky.calls}


@pytest.mark.slow
async def test_large_local_transfers_do_not_stall_the_event_loop(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With asyncio debug on, 256 MiB puts and gets on a folder cause no slow-callback warning."""
    data = bytes(256 * 1024 * 1024)
    tier = PersistentTier(tmp_path, fsync=False)
    loop = asyncio.get_running_loop()
    loop.set_debug(True)
    loop.slow_callback_duration = 0.1
    try:
        with caplog.at_level(logging.WARNING, logger="asyncio"):
            await tier.put("big", data)
            got = await tier.get("big")
            await tier.putv("big2", [data, b"tail"])
    finally:
        loop.set_debug(False)
    assert len(got) == len(data)
    assert [r.getMessage() for r in caplog.records if "Executing" in r.getMessage()] == []


# --- local filesystems ---------------------------------------------------------------------------


async def test_plain_path_and_file_url_are_the_same_store(tmp_path: Path) -> None:
    """A plain path and its file:// URL open the same folder."""
    by_url = PersistentTier(f"file://{tmp_path}/store")
    by_path = PersistentTier(tmp_path / "store")
    await by_url.put("v1/r0", b"blob")
    assert await by_path.get("v1/r0") == b"blob"
    assert (tmp_path / "store" / "v1" / "r0").read_bytes() == b"blob"


async def test_local_put_failure_leaves_the_old_blob_and_no_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write that fails for good leaves the old blob and no temporary file behind."""
    tier = PersistentTier(tmp_path, retry=FAST)
    await tier.put("k", b"old")
    calls = []

    def failing(fd: int, parts: object) -> int:
        calls.append(fd)
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(atomic, "write_all", failing)
    with pytest.raises(StorageError):
        await tier.put("k", b"new")
    assert len(calls) == FAST.attempts
    monkeypatch.undo()
    assert await tier.get("k") == b"old"
    assert names_in(tmp_path) == ["k"]


async def test_local_puts_sync_file_and_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With fsync (the default) the data and the rename are synced; fsync=False skips both."""
    synced: list[int] = []
    real_fsync = os.fsync

    def spy(fd: int) -> None:
        synced.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    await PersistentTier(tmp_path / "durable").put("a/b", b"x")
    assert len(synced) == 2
    synced.clear()
    await PersistentTier(tmp_path / "fast", fsync=False).put("a/b", b"x")
    assert synced == []


async def test_local_putv_writes_parts_without_joining(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """putv on a local filesystem hands each part to the writer as it is."""
    seen: list[list[object]] = []
    real = atomic.write_all

    def spy(fd: int, parts: list[memoryview]) -> int:
        seen.append([part.obj for part in parts])
        return real(fd, parts)

    monkeypatch.setattr(atomic, "write_all", spy)
    parts = [b"a" * 100, bytearray(b"b" * 200), b"c"]
    tier = PersistentTier(tmp_path)
    await tier.putv("v", parts)
    assert await tier.get("v") == b"".join(parts)
    assert len(seen[0]) == 3
    assert all(a is b for a, b in zip(seen[0], parts, strict=True))


async def test_local_delete_prunes_empty_folders(tmp_path: Path) -> None:
    """Deleting the last blob under a folder removes the folder, never the tier's root."""
    tier = PersistentTier(tmp_path / "root")
    await tier.put("v1/r0/blob", b"x")
    await tier.delete("v1/r0/blob")
    assert names_in(tmp_path / "root") == []


async def test_listing_skips_foreign_and_temporary_files(tmp_path: Path) -> None:
    """Files whose names are not valid keys (temporaries, strays) are never listed."""
    tier = PersistentTier(tmp_path)
    await tier.put("v1/blob", b"x")
    (tmp_path / "v1" / ".tiercheck#tmp#host#1#ab").write_bytes(b"partial")
    (tmp_path / "v1" / "stray:name").write_bytes(b"?")
    assert [key async for key in tier.list()] == ["v1/blob"]


# --- S3 ----------------------------------------------------------------------------------------


# See test_conformance.py for why this one aiohttp warning is ignored on S3.
@pytest.mark.filterwarnings(
    "ignore:Sending a large body directly with raw bytes might lock the event loop:ResourceWarning"
)
async def test_s3_listing_sees_writes_of_another_client(s3_server: S3Server) -> None:
    """A second client with its own listing cache still sees keys written after it listed."""
    url = s3_server.url()
    writer = PersistentTier(url, storage_options=s3_server.storage_options)
    reader = PersistentTier(
        url, storage_options={**s3_server.storage_options, "skip_instance_cache": True}
    )
    assert writer.fs is not reader.fs
    await writer.put("v1/a", b"1")
    assert [key async for key in reader.list("v1/")] == ["v1/a"]
    assert await reader.exists("v1/a")
    await writer.put("v1/b/c", b"2")
    await writer.delete("v1/a")
    assert [key async for key in reader.list("v1/")] == ["v1/b/c"]
    assert not await reader.exists("v1/a")
    await writer.delete("v1/b/c")


async def test_s3_missing_bucket_is_a_storage_error(s3_server: S3Server) -> None:
    """Writing into a bucket that does not exist fails for good with StorageError."""
    tier = PersistentTier(
        "s3://no-such-bucket-here/prefix",
        storage_options=s3_server.storage_options,
        retry=FAST,
    )
    with pytest.raises(StorageError):
        await tier.put("k", b"x")
    with pytest.raises(BlobNotFound):
        await tier.get("k")


# --- the shipped state machine: the persistent tier behaves like a dict, reopens included ------


class FileURLMachine(TierStateMachine):
    """The persistent tier on a file:// folder (temporary file, fsync, rename)."""

    async def make_tier(self, folder: Path) -> Tier:
        return PersistentTier((folder / "durable").as_uri())

    async def reopen_tier(self, tier: Tier, folder: Path) -> Tier:
        return PersistentTier((folder / "durable").as_uri())


class MemoryURLMachine(TierStateMachine):
    """The persistent tier on fsspec's memory:// (whole-object puts), one prefix per run."""

    async def make_tier(self, folder: Path) -> Tier:
        return PersistentTier(f"memory://tiercheck-machine/{uuid.uuid4().hex}")

    async def reopen_tier(self, tier: Tier, folder: Path) -> Tier:
        assert isinstance(tier, PersistentTier)
        return PersistentTier(tier.url)

    async def destroy_tier(self, tier: Tier) -> None:
        assert isinstance(tier, PersistentTier)
        path = tier.url.removeprefix("memory://")
        if tier.fs.exists(path):
            tier.fs.rm(path, recursive=True)


FileURLMachine.TestCase.settings = settings(stateful_step_count=25)
MemoryURLMachine.TestCase.settings = settings(stateful_step_count=25)
TestFileURLMachine = FileURLMachine.TestCase
TestMemoryURLMachine = MemoryURLMachine.TestCase


# --- leftovers of killed writers ----------------------------------------------------------------


def _temp_named(folder: Path, name: str, *, age: float, size: int = 64) -> Path:
    """A temporary file named ``name``, last changed ``age`` seconds ago (what a writer left)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_bytes(b"x" * size)
    then = time.time() - age
    os.utime(path, (then, then))
    return path


def _pid_of(done: subprocess.CompletedProcess[bytes]) -> int:
    """The pid a finished process had (gone now: nothing runs under it in this test's time)."""
    pid = int(done.stdout) if done.stdout else 0
    assert pid > 0
    return pid


def _name(host: str, pid: int, start: int, kernel: str, tag: str | None = None) -> str:
    name = f".tiercheck#tmp#{host}#{pid}-{start}-{kernel}#{uuid.uuid4().hex[:16]}"
    return name if tag is None else f"{name}#{tag}"


async def test_leftovers_of_writers_this_host_cannot_judge(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another host's files go only once their writer is superseded *and* they stopped changing
    an hour ago; the current writer's files and recently changed ones are always kept."""
    stale = persistent.STALE_AFTER
    folder = tmp_path / "job" / "v000000000003"
    other = "another-host"
    current = WriterClaim("cur", time.time() - 2 * stale)
    files = {
        # tag == the current writer's session: kept, however old.
        "current": _temp_named(folder, _name(other, 11, 5, "ab", "cur"), age=3 * stale),
        # a superseded writer's, unchanged for two hours: dead.
        "superseded-old": _temp_named(folder, _name(other, 12, 5, "ab", "old"), age=2 * stale),
        # a superseded writer's that changed ten minutes ago: kept (it may still be writing).
        "superseded-recent": _temp_named(folder, _name(other, 13, 5, "ab", "old"), age=600),
        # an untagged name of an earlier release, last written before the current writer came.
        "untagged-before": _temp_named(
            folder, f".tiercheck#tmp#{other}#14#{uuid.uuid4().hex[:16]}", age=3 * stale
        ),
        # one written after the current writer opened the job: it may be the current writer's.
        "untagged-after": _temp_named(
            folder, f".tiercheck#tmp#{other}#15#{uuid.uuid4().hex[:16]}", age=1.5 * stale
        ),
        # this host's name, another pid namespace or boot: a pid means nothing; by the rule.
        "other-kernel": _temp_named(
            folder, _name(socket.gethostname(), os.getpid(), 5, "ffffffff", "old"), age=2 * stale
        ),
    }
    tier = PersistentTier(tmp_path / "job")
    found = {Path(item.name).name: item for item in await tier.leftovers(current)}
    verdicts = {what: found[path.name].verdict for what, path in files.items()}
    assert verdicts == {
        "current": "unknown",
        "superseded-old": "dead",
        "superseded-recent": "unknown",
        "untagged-before": "dead",
        "untagged-after": "unknown",
        "other-kernel": "dead",
    }
    assert all(found[p.name].size == 64 for p in files.values())
    assert (
        found[files["superseded-old"].name].name == f"v000000000003/{files['superseded-old'].name}"
    )

    # Judged again at removal: a file that changed meanwhile stays.
    os.utime(files["untagged-before"])
    removed = await tier.remove_leftovers(list(found.values()), current)
    assert {Path(item.name).name for item in removed} == {
        files["superseded-old"].name,
        files["other-kernel"].name,
    }
    left = {p.name for p in folder.iterdir()}
    assert left == {
        p.name for what, p in files.items() if what not in ("superseded-old", "other-kernel")
    }

    # Without a known writer (no writer generation), age alone decides.
    orphans = {Path(i.name).name: i.verdict for i in await tier.leftovers(None)}
    assert orphans[files["current"].name] == "dead"
    assert orphans[files["superseded-recent"].name] == "unknown"
    await tier.aclose()


async def test_leftovers_of_this_hosts_writers_are_judged_by_their_process(tmp_path: Path) -> None:
    """A running process's file is never removed, however old and superseded; a dead one's
    goes at once; a reused pid (same pid, another start time) does not keep a file alive."""
    folder = tmp_path / "job" / "v000000000001"
    host = socket.gethostname()
    me = os.getpid()
    start = atomic.process_start(me)
    assert start is not None
    kernel = atomic.parse_temp_owner(atomic.temp_name()).kernel  # type: ignore[union-attr]
    assert kernel is not None
    gone = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
    )
    files = {
        "live": _temp_named(folder, _name(host, me, start, kernel, "old"), age=10**6),
        "dead": _temp_named(folder, _name(host, _pid_of(gone), 1, kernel, "cur"), age=0),
        "reused": _temp_named(folder, _name(host, me, start + 1, kernel, "cur"), age=0),
    }
    tier = PersistentTier(tmp_path / "job", stale_after=0)
    writer = WriterClaim("cur", time.time())
    found = {Path(i.name).name: i for i in await tier.leftovers(writer)}
    assert {w: found[p.name].verdict for w, p in files.items()} == {
        "live": "live",
        "dead": "dead",
        "reused": "dead",
    }
    assert f"pid {me}" in found[files["live"].name].why
    removed = await tier.remove_leftovers(list(found.values()), writer)
    assert len(removed) == 2
    assert [p.name for p in folder.iterdir()] == [files["live"].name]
    await tier.aclose()


async def test_puts_name_their_temporary_files_after_the_writer(tmp_path: Path) -> None:
    """A tier built with a writer tag writes it into its temporary names (and refuses a bad one)."""
    seen: list[str] = []
    real = atomic.create_temp

    def spy(directory: str, **kwargs: Any) -> tuple[int, str]:
        fd, path = real(directory, **kwargs)
        seen.append(os.path.basename(path))
        return fd, path

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(atomic, "create_temp", spy)
        async with PersistentTier(tmp_path, writer_tag="sess-1") as tier:
            await tier.put("v000000000000/r00000.packed", b"blob")
    (name,) = seen
    owner = atomic.parse_temp_owner(name)
    assert owner is not None
    assert (owner.tag, owner.pid) == ("sess-1", os.getpid())
    with pytest.raises(ConfigError):
        PersistentTier(tmp_path, writer_tag="not a tag!")


S3_KILLED = r"""
import os, signal, sys
import s3fs, torch
import tiercheck

url, local_root, options = sys.argv[1], sys.argv[2], eval(sys.argv[3])
real = s3fs.S3FileSystem._call_s3

async def dies_after_one_part(self, method, *args, **kwargs):
    out = await real(self, method, *args, **kwargs)
    if method == "upload_part":
        os.kill(os.getpid(), signal.SIGKILL)
    return out

s3fs.S3FileSystem._call_s3 = dies_after_one_part
g = torch.Generator().manual_seed(1)
state = {"b": torch.randint(0, 256, (101 << 20,), dtype=torch.uint8, generator=g)}
with tiercheck.SyncCheckpointer(
    "up", local_root=local_root, persistent=url, storage_options=options
) as ckpt:
    ckpt.restore()
    ckpt.save(1, state)
    ckpt.wait()
sys.exit(3)
"""


@pytest.mark.slow
@pytest.mark.multiprocess
async def test_s3_upload_killed_midway_is_listed_and_aborted_once_superseded(
    s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """s3fs uploads a blob of 100 MiB or more in parts; a process SIGKILLed between parts leaves
    an unfinished upload: unlisted, yet stored. The tier lists it, keeps it while its writer
    may be the current one, and aborts it once a newer opening superseded that writer."""
    boto3 = pytest.importorskip("boto3")
    url = s3_server.url()
    options = s3_server.storage_options
    from tiercheck import SyncCheckpointer

    with SyncCheckpointer(
        "up", local_root=tmp_path / "a", persistent=url, storage_options=options
    ) as c:
        c.save(0, {"b": torch.zeros(16)})
        c.wait()
    killed = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", S3_KILLED, url, str(tmp_path / "b"), repr(options)],
        check=False,
        capture_output=True,
        timeout=300,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()[-2000:]
    client = boto3.client("s3", endpoint_url=s3_server.endpoint, region_name="us-east-1")
    prefix = url.removeprefix(f"s3://{s3_server.bucket}/") + "/up/"
    (upload,) = client.list_multipart_uploads(Bucket=s3_server.bucket, Prefix=prefix)["Uploads"]
    assert upload["Key"] == f"{prefix}v000000000001/r00000.packed"

    tier = PersistentTier(f"{url}/up", storage_options=options, stale_after=0)
    monkeypatch.setattr(persistent, "CLOCK_SKEW", 0.0)
    # The writer that started it is (as far as anyone can tell) the current one: kept. (The
    # times are relative to the upload's start as the server states it; moto states a fixed
    # date.)
    started = upload["Initiated"].timestamp()
    (item,) = await tier.leftovers(WriterClaim("the-killed-one", started - 5))
    assert (item.kind, item.name, item.verdict) == (
        "upload",
        "v000000000001/r00000.packed",
        "unknown",
    )
    # Stored, yet listed nowhere: the parts uploaded before the kill (the smallest, the last
    # one, finishes first).
    assert item.size is not None
    assert 0 < item.size < 101 << 20
    assert await tier.remove_leftovers([item], WriterClaim("the-killed-one", started - 5)) == []
    # A newer opening claimed the job after it started: its writer is superseded.
    newer = WriterClaim("newer", started + 5)
    (item,) = await tier.leftovers(newer)
    assert item.verdict == "dead"
    assert len(await tier.remove_leftovers([item], newer)) == 1
    assert (
        client.list_multipart_uploads(Bucket=s3_server.bucket, Prefix=prefix).get("Uploads", [])
        == []
    )
    await tier.aclose()
    client.close()
    # The job restores its newest version whole.
    with SyncCheckpointer(
        "up", local_root=tmp_path / "c", persistent=url, storage_options=options
    ) as c:
        restored = c.restore()
        assert restored is not None
        assert restored.version == 0
