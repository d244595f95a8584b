"""LocalTier beyond the conformance suite: crashes, permissions, capacity, recycling, threads."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import fcntl
import gc
import json
import logging
import mmap
import os
import random
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis.stateful import invariant

from tiercheck import defaults
from tiercheck.errors import ConfigError, StorageError, TierClosed, TierFull
from tiercheck.testing import TierStateMachine
from tiercheck.tiers import LocalTier, SupportsPrepare, SupportsReserve, Tier
from tiercheck.tiers.local import memory

MiB = 1024 * 1024


def blob(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)


def files_under(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def folders_under(root: Path) -> list[Path]:
    """``root`` itself (if it exists) and every folder below it."""
    if not root.is_dir():
        return []
    return [root, *sorted(p for p in root.rglob("*") if p.is_dir())]


def temp_files_under(root: Path) -> list[Path]:
    """The tier's own files: names with '#', which no key can hold (see LocalTier's Layout)."""
    return [p for p in files_under(root) if "#" in str(p.relative_to(root))]


def _under(fd: int, root: Path) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith(f"{root}/")
    except OSError:
        return False


def os_writes_under(
    monkeypatch: pytest.MonkeyPatch,
    root: Path,
    fail: int | None = None,
    seen: list[tuple[str, object]] | None = None,
) -> None:
    """Watch (``seen``: the buffers written) or fail (errno ``fail``) the kernel writes made to
    files under ``root`` -- the filesystem's side of the tier, whatever code makes them."""
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc/self/fd to tell which file a write goes to")
    for name in ("write", "writev", "pwrite", "pwritev"):
        real = getattr(os, name, None)
        if real is None:
            continue

        def watched(fd: int, data: object, *rest: object, _real: object = real) -> object:
            if _under(fd, root):
                if fail is not None:
                    raise OSError(fail, os.strerror(fail))
                if seen is not None:
                    seen.append((fd, data))  # type: ignore[arg-type]
            return _real(fd, data, *rest)  # type: ignore[operator]

        monkeypatch.setattr(os, name, watched)


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(done.stdout)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "local"


@pytest.fixture
def shm_root() -> Iterator[Path]:
    """A fresh folder in /dev/shm (the real thing), removed afterwards."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("/dev/shm does not exist on this system")
    path = Path(f"/dev/shm/tiercheck-test-{uuid.uuid4().hex}")
    yield path
    shutil.rmtree(path, ignore_errors=True)


# --- crash survival ----------------------------------------------------------------------------

CHILD = r"""
import asyncio, random, sys
from tiercheck.tiers import LocalTier

def blob(size, seed):
    return random.Random(seed).randbytes(size)

async def main(root, big):
    tier = LocalTier(root)
    await tier.put("small", blob(1000, 1))
    await tier.put("big/put", blob(big, 2))
    reservation = await tier.reserve("big/reserved", big)
    reservation.buffer[:] = blob(big, 3)
    await reservation.commit()
    reservation.release()
    await tier.put("rewritten", blob(big, 4))
    await tier.put("recycled", b"x" * big)
    await tier.delete("recycled")
    new = blob(big, 5)
    print("committed", flush=True)
    i = 0
    while True:
        # Rewrite one key forever, alternating both write paths, until killed mid-write.
        if i % 2:
            await tier.put("rewritten", new)
        else:
            reservation = await tier.reserve("rewritten", big)
            reservation.buffer[:] = new
            await reservation.commit()
            reservation.release()
        await tier.put(f"fresh/{i}", new)
        i += 1

asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("delay", [0.0, 0.03, 0.15])
async def test_blobs_survive_sigkill_of_the_writer(shm_root: Path, delay: float) -> None:
    """A writer SIGKILLed mid-write leaves every committed blob whole and no visible debris.

    The child stores blobs by put and by reserve + commit, then rewrites a key in a loop; it is
    killed at some point of that loop. Another process (this one) then finds the committed blobs
    intact, the rewritten key holding the old or the new blob (never a mix), each ``fresh/*`` key
    whole, no temporary file listed, and the dead writer's temporary files and spares cleaned up.
    """
    big = 16 * MiB
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        CHILD,
        str(shm_root),
        str(big),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert child.stdout is not None
        line = await asyncio.wait_for(child.stdout.readline(), timeout=120)
        await asyncio.sleep(delay)
    finally:
        child.send_signal(signal.SIGKILL)
        _, errors = await child.communicate()
    assert line == b"committed\n", errors.decode()
    assert child.returncode == -signal.SIGKILL

    old, new = blob(big, 4), blob(big, 5)
    async with LocalTier(shm_root) as tier:
        assert await tier.get("small") == blob(1000, 1)
        assert await tier.get("big/put") == blob(big, 2)
        assert await tier.get("big/reserved") == blob(big, 3)
        assert await tier.get("rewritten") in (old, new)
        keys = [key async for key in tier.list()]
        assert set(keys) - {"small", "big/put", "big/reserved", "rewritten"} == {
            key for key in keys if key.startswith("fresh/")
        }
        for key in keys:
            if key.startswith("fresh/"):
                assert await tier.get(key) == new
        assert not await tier.exists("recycled")
        # Opening the root removed what the dead writer left half done.
        assert temp_files_under(shm_root) == []


# --- files that someone else cuts short ---------------------------------------------------------

CUT_SHORT = r"""
import asyncio, json, os, random, sys
from pathlib import Path
from tiercheck.errors import StorageError
from tiercheck.tiers import LocalTier
from tiercheck.tiers.local import reservation as reservation_module

MiB = 1 << 20
root = Path(sys.argv[1])
data = lambda seed, n=4 * MiB: random.Random(seed).randbytes(n)
done = []

def hidden(where):
    return sorted(p for p in where.rglob("*") if p.is_file() and "#" in p.name)

async def main():
    async with LocalTier(root, spare_files=2) as tier:
        # A large read, then its file is cut short: the copy is private.
        await tier.put("read", data(1))
        view = await tier.get("read")
        os.truncate(root / "read", 100)
        assert bytes(view) == data(1)
        assert len(bytes(await tier.get("read"))) == 100  # what is left reads as it is
        done.append("read")
        # A reservation whose temporary file is cut to nothing before it is filled.
        r = await tier.reserve("reserved", 4 * MiB)
        (temp,) = hidden(root)
        os.truncate(temp, 0)
        r.buffer[:] = data(2)
        await r.commit()
        assert bytes(r.buffer) == data(2)
        r.release()
        assert bytes(await tier.get("reserved")) == data(2)
        done.append("reserved")
        # Prepared memory whose file is cut short before the reserve that takes it.
        assert await tier.prepare(4 * MiB)
        for path in hidden(root):
            os.truncate(path, 3)
        r = await tier.reserve("prepared", 4 * MiB)
        r.buffer[:] = data(3)
        await r.commit()
        r.release()
        assert bytes(await tier.get("prepared")) == data(3)
        done.append("prepared")
        # A spare cut short, then recycled by a put and by a reserve.
        for key in ("read", "reserved"):
            await tier.delete(key)
        assert tier.spare_count == 2
        for path in hidden(root):
            os.truncate(path, 1)
        await tier.put("recycled/put", data(4))
        r = await tier.reserve("recycled/reserve", 4 * MiB)
        r.buffer[:] = data(5)
        await r.commit()
        r.release()
        assert bytes(await tier.get("recycled/put")) == data(4)
        assert bytes(await tier.get("recycled/reserve")) == data(5)
        done.append("spares")
        # The temporary file cut short while the commit writes it: the commit fails, typed,
        # and the key keeps its previous blob.
        real = reservation_module.write_exactly
        def cut_halfway(fd, view, offset):
            real(fd, view[: view.nbytes // 2], offset)
            os.ftruncate(fd, 4096)  # what another process's truncate does to the file
            real(fd, view[view.nbytes // 2 :], offset + view.nbytes // 2)
        reservation_module.write_exactly = cut_halfway
        r = await tier.reserve("prepared", 4 * MiB)
        r.buffer[:] = data(6)
        try:
            await r.commit()
        except StorageError as exc:
            assert "hole" in str(exc), exc
        else:
            raise AssertionError("a commit over a file cut short succeeded")
        reservation_module.write_exactly = real
        await r.abort()
        r.release()
        assert bytes(await tier.get("prepared")) == data(3)
        done.append("commit")
    print(json.dumps(done))

asyncio.run(main())
"""


@pytest.mark.slow
@pytest.mark.multiprocess
def test_files_cut_short_by_someone_else_never_kill_the_process(shm_root: Path) -> None:
    """Blobs, temporary files of reservations, prepared memory and spares truncated by another
    process (here: by the same one, with ``truncate``, at the worst moments) are damage the tier
    reports or repairs, never a ``SIGBUS``. Run in a child process: a signal is a negative
    return code, not a dead test run."""
    run = subprocess.run(
        [sys.executable, "-c", CUT_SHORT, str(shm_root)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, f"rc={run.returncode}\n{run.stdout}\n{run.stderr[-3000:]}"
    assert json.loads(run.stdout.splitlines()[-1]) == [
        "read",
        "reserved",
        "prepared",
        "spares",
        "commit",
    ]


# --- layout and permissions --------------------------------------------------------------------


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o277])
async def test_folders_are_0700_and_files_0600_whatever_the_umask(root: Path, umask: int) -> None:
    """Every folder the tier creates is 0700 and every file 0600, under any umask."""
    previous = os.umask(umask)
    try:
        async with LocalTier(root) as tier:
            await tier.put("a/b/c", b"put")
            await tier.putv("a/v", [b"put", b"v"])
            reservation = await tier.reserve("r/s/t", 10)
            reservation.buffer[:] = b"0123456789"
            await reservation.commit()
            reservation.release()
            await tier.put("spare/me", b"12345")
            await tier.delete("spare/me")
            assert tier.spare_count == 1
            folders = folders_under(root)
            files = files_under(root)
            assert {p.name for p in folders} >= {"local", "a", "b", "r", "s", ".tiercheck#spares"}
            assert len(files) == 4
            for folder in folders:
                assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
            for file in files:
                assert stat.S_IMODE(file.stat().st_mode) == 0o600, file
    finally:
        os.umask(previous)


def test_default_root_is_in_shared_memory() -> None:
    """Without a root, blobs go to /dev/shm/tiercheck/<job_id>/<node>, node = the hostname."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("/dev/shm does not exist on this system")
    assert LocalTier(job_id="run-1", node="n7").root == Path("/dev/shm/tiercheck/run-1/n7")
    assert LocalTier(job_id="run-1").root == Path("/dev/shm/tiercheck/run-1", socket.gethostname())
    assert LocalTier().root == Path("/dev/shm/tiercheck/default", socket.gethostname())


def test_default_root_falls_back_to_the_temp_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where /dev/shm does not exist, the default root is <tempdir>/tiercheck/<job>/<node>."""
    monkeypatch.setattr(defaults, "SHM_DIR", str(tmp_path / "no-shm-here"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert LocalTier(job_id="j", node="n").root == tmp_path / "tiercheck" / "j" / "n"


@pytest.mark.parametrize("bad", ["", "a/b", "..", ".", "x:y", " pad"])
def test_job_id_and_node_must_be_folder_names(bad: str) -> None:
    """job_id and node that are not single valid folder names raise ConfigError."""
    with pytest.raises(ConfigError):
        LocalTier(job_id=bad, node="n")
    with pytest.raises(ConfigError):
        LocalTier(job_id="j", node=bad)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"capacity": -1},
        {"capacity": 1.5},
        {"spare_files": -1},
        {"spare_files": True},
        {"fsync": "no"},
        {"populate": 1},
    ],
)
def test_bad_options_raise_config_error(root: Path, kwargs: dict[str, object]) -> None:
    """Negative or non-integer capacity and spare_files are rejected at construction."""
    with pytest.raises(ConfigError):
        LocalTier(root, **kwargs)  # type: ignore[arg-type]


async def test_default_root_owned_by_someone_else_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A default root that belongs to another user is not written into (StorageError)."""
    monkeypatch.setattr(defaults, "SHM_DIR", str(tmp_path / "no-shm-here"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    tier = LocalTier(job_id="j", node="n")
    tier.root.mkdir(parents=True)
    real_uid = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: real_uid + 4242)
    with pytest.raises(StorageError):
        await tier.put("k", b"x")
    assert list(tier.root.iterdir()) == []


async def test_construction_does_no_io(tmp_path: Path) -> None:
    """Creating a tier touches nothing; the root appears on first use."""
    tier = LocalTier(tmp_path / "later")
    assert not (tmp_path / "later").exists()
    assert not await tier.exists("k")
    assert (tmp_path / "later").is_dir()


async def test_key_cannot_be_both_a_blob_and_a_folder(root: Path) -> None:
    """'a' and 'a/b' cannot both be blobs on a filesystem: StorageError, nothing changed."""
    async with LocalTier(root) as tier:
        await tier.put("a", b"blob a")
        with pytest.raises(StorageError):
            await tier.put("a/b", b"x")
        await tier.put("x/y", b"blob x/y")
        with pytest.raises(StorageError):
            await tier.put("x", b"x")
        with pytest.raises(StorageError):
            await tier.reserve("a/c", 1)
        assert await tier.get("a") == b"blob a"
        assert await tier.get("x/y") == b"blob x/y"
        assert sorted([k async for k in tier.list()]) == ["a", "x/y"]
        assert temp_files_under(root) == []


async def test_non_contiguous_buffer_is_a_type_error(root: Path) -> None:
    """A strided view cannot be written as one blob: TypeError before any I/O."""
    async with LocalTier(root) as tier:
        with pytest.raises(TypeError):
            await tier.put("k", memoryview(b"abcdef")[::2])
        assert files_under(root) == []


async def test_deleting_prunes_empty_folders(root: Path) -> None:
    """Deleting the last blob of a folder removes the folder (but never the root)."""
    async with LocalTier(root, spare_files=0) as tier:
        await tier.put("v1/r0/a", b"1")
        await tier.put("v1/r1/b", b"2")
        await tier.delete("v1/r0/a")
        assert folders_under(root) == [root, root / "v1", root / "v1" / "r1"]
        await tier.delete("v1/r1/b")
        assert folders_under(root) == [root]


# --- writes are zero-copy and off the event loop --------------------------------------------------


async def test_puts_write_the_callers_buffers_without_joining(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """put writes the caller's own buffer and putv each part in turn: no join, no copy.

    Seen from the kernel's side: every write into a file under the root comes straight from
    one of the caller's buffers, in order, and nothing else is written there.
    """
    seen: list[tuple[str, object]] = []
    os_writes_under(monkeypatch, root, seen=seen)
    data = bytearray(blob(3 * MiB, 1))
    parts = [bytes(blob(MiB, 2)), bytearray(blob(10, 3)), bytes(blob(2 * MiB, 4))]
    async with LocalTier(root, spare_files=0) as tier:
        await tier.put("one", data)
        await tier.putv("many", parts)
        assert await tier.get("many") == b"".join(parts)
    sources: list[object] = []
    for _fd, written in seen:
        source = written.obj if isinstance(written, memoryview) else written
        if not sources or sources[-1] is not source:  # a short write continues the same part
            sources.append(source)
    assert len(sources) == 4
    assert all(a is b for a, b in zip(sources, [data, *parts], strict=True))
    assert sum(memoryview(w).nbytes for _fd, w in seen) == len(data) + sum(map(len, parts))  # type: ignore[arg-type]


class _FileCalls:
    """The file-system calls this process makes (its audit events), and their threads."""

    #: Audit events of calls that touch files or folders (see Python's audit events table).
    EVENTS = frozenset(
        {
            "open",
            "os.rename",
            "os.remove",
            "os.rmdir",
            "os.mkdir",
            "os.scandir",
            "os.listdir",
            "os.truncate",
            "os.chmod",
            "mmap.__new__",
            "fcntl.flock",
        }
    )
    recording: dict[str, set[int]] | None = None
    installed = False

    @classmethod
    def hook(cls, event: str, args: tuple[object, ...]) -> None:
        record = cls.recording
        if record is not None and event in cls.EVENTS:
            record.setdefault(event, set()).add(threading.get_ident())

    @classmethod
    @contextlib.contextmanager
    def record(cls) -> Iterator[dict[str, set[int]]]:
        if not cls.installed:  # audit hooks cannot be removed: one for the process, idle after
            sys.addaudithook(cls.hook)
            cls.installed = True
        cls.recording = {}
        try:
            yield cls.recording
        finally:
            cls.recording = None


async def test_file_work_runs_in_worker_threads(root: Path) -> None:
    """Writes, reads, reservations, listing and deletes never run on the event-loop thread.

    Seen through the interpreter's audit events: every call that opens, maps, lists, renames,
    locks or removes a file happens on another thread than the loop's.
    """
    loop_thread = threading.get_ident()
    with _FileCalls.record() as calls:
        async with LocalTier(root) as tier:
            await tier.put("a/b", blob(MiB, 1))
            await tier.get("a/b")  # large: read into pooled memory
            await tier.put("a/s", b"small")
            await tier.get("a/s")  # small: read
            reservation = await tier.reserve("a/c", 100)
            reservation.buffer[:] = b"z" * 100
            await reservation.commit()
            reservation.release()
            assert [k async for k in tier.list("a/")]
            await tier.delete("a/b")
            await tier.delete("a/c")
            await tier.delete("a/s")
    assert {"open", "os.rename", "os.scandir", "mmap.__new__", "fcntl.flock"} <= set(calls)
    for event, idents in calls.items():
        assert loop_thread not in idents, event


@pytest.mark.slow
async def test_large_transfers_do_not_stall_the_event_loop(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With asyncio debug on, 256 MiB puts and gets cause no slow-callback warning."""
    data = bytes(256 * MiB)
    tail = data[:MiB]
    loop = asyncio.get_running_loop()
    loop.set_debug(True)
    loop.slow_callback_duration = 0.1
    try:
        with caplog.at_level(logging.WARNING, logger="asyncio"):
            async with LocalTier(root) as tier:
                await tier.put("big", data)
                got = await tier.get("big")
                await tier.putv("big2", [data, tail])
                await tier.delete("big")
    finally:
        loop.set_debug(False)
    assert len(got) == len(data)
    slow = [r.getMessage() for r in caplog.records if "Executing" in r.getMessage()]
    assert slow == []


async def test_fsync_option_syncs_data_and_renames(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fsync=True (for a root on disk) syncs each file and its folder, on put and on commit."""
    synced: list[int] = []
    real_fsync = os.fsync

    def spy(fd: int) -> None:
        synced.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    async with LocalTier(root) as tier:
        await tier.put("quick", b"x")
    assert synced == []
    async with LocalTier(root, fsync=True) as tier:
        await tier.put("a/b", b"x")
        assert len(synced) == 2
        reservation = await tier.reserve("a/c", 3)
        reservation.buffer[:] = b"abc"
        await reservation.commit()
        reservation.release()
        assert len(synced) == 4
        assert await tier.get("a/c") == b"abc"


# --- capacity ------------------------------------------------------------------------------------


async def test_put_over_capacity_raises_before_writing(root: Path) -> None:
    """A put that would exceed the capacity raises TierFull and writes nothing at all."""
    async with LocalTier(root, capacity=1000) as tier:
        await tier.put("a", b"1" * 600)
        assert tier.usage == 600
        before = files_under(root)
        with pytest.raises(TierFull) as info:
            await tier.put("b", b"2" * 401)
        assert isinstance(info.value, OSError)
        assert files_under(root) == before
        assert not await tier.exists("b")
        assert await tier.get("a") == b"1" * 600
        assert tier.usage == 600
        await tier.put("b", b"2" * 400)
        assert tier.usage == 1000


async def test_overwrite_counts_the_new_size_in_place_of_the_old(root: Path) -> None:
    """Overwriting a key needs room for the new size only; an oversized overwrite keeps the old."""
    async with LocalTier(root, capacity=1000) as tier:
        await tier.put("a", b"1" * 600)
        await tier.put("a", b"2" * 900)
        assert tier.usage == 900
        with pytest.raises(TierFull):
            await tier.put("a", b"3" * 1001)
        assert await tier.get("a") == b"2" * 900
        await tier.put("a", b"4" * 10)
        assert tier.usage == 10


async def test_usage_falls_after_delete(root: Path) -> None:
    """Deleting frees capacity: usage falls, and a put that did not fit now does."""
    async with LocalTier(root, capacity=1000) as tier:
        await tier.put("a", b"1" * 700)
        with pytest.raises(TierFull):
            await tier.put("b", b"2" * 700)
        await tier.delete("a")
        assert tier.usage == 0
        await tier.put("b", b"2" * 700)
        assert tier.usage == 700


async def test_reservations_count_against_capacity(root: Path) -> None:
    """An open reservation holds capacity; abort gives it back, commit turns it into a blob."""
    async with LocalTier(root, capacity=1000) as tier:
        first = await tier.reserve("r1", 800)
        assert tier.usage == 800
        with pytest.raises(TierFull):
            await tier.reserve("r2", 300)
        with pytest.raises(TierFull):
            await tier.put("p", b"x" * 300)
        await first.abort()
        first.release()
        assert tier.usage == 0
        second = await tier.reserve("r2", 300)
        second.buffer[:] = b"y" * 300
        await second.commit()
        second.release()
        assert tier.usage == 300
        assert not await tier.exists("r1")


async def test_spares_are_dropped_when_room_is_needed(root: Path) -> None:
    """Spares never cause TierFull: they are given up (and counted) to make room."""
    async with LocalTier(root, capacity=1000, spare_files=4) as tier:
        await tier.put("a", b"1" * 400)
        await tier.put("b", b"2" * 500)
        await tier.delete("a")
        await tier.delete("b")
        assert tier.usage == 0
        assert tier.spare_bytes == 900
        await tier.put("c", b"3" * 950)
        assert tier.usage + tier.spare_bytes <= 1000
        assert await tier.get("c") == b"3" * 950
        assert sum(p.stat().st_size for p in files_under(root)) <= 1000


async def test_usage_starts_from_what_the_root_holds(root: Path) -> None:
    """A new instance counts the blobs already in its root; refresh_usage rescans."""
    async with LocalTier(root) as first:
        await first.put("a", b"1" * 100)
        await first.put("b/c", b"2" * 50)
        async with LocalTier(root, capacity=200) as second:
            assert await second.exists("a")
            assert second.usage == 150
            with pytest.raises(TierFull):
                await second.put("d", b"3" * 51)
            await first.put("e", b"4" * 25)
            assert second.usage == 150
            assert await second.refresh_usage() == 175


async def test_filesystem_full_is_tier_full(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC from the filesystem raises TierFull; no temporary file is left behind.

    (A really full tmpfs: tests/tiers/test_local_full.py, slow. Here the kernel's writes into
    files under the root answer ENOSPC.)
    """
    async with LocalTier(root) as tier:
        await tier.put("k", b"old")
        os_writes_under(monkeypatch, root, fail=errno.ENOSPC)
        with pytest.raises(TierFull):
            await tier.put("k", b"new")
        assert await tier.get("k") == b"old"
        assert temp_files_under(root) == []
        assert tier.usage == 3


async def _reserve_filled(tier: LocalTier, key: str, data: bytes) -> None:
    reservation = await tier.reserve(key, len(data))
    reservation.buffer[:] = data
    await reservation.commit()
    reservation.release()


async def test_only_new_pages_are_backed_ahead_of_time(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """posix_fallocate backs the pages a reservation has not got yet: all of a fresh file's,
    the growth of a recycled one, prepared memory (ahead of time). A recycled file's own pages
    and a reserve that takes prepared memory (the save's critical path) cost no allocation."""
    real = getattr(os, "posix_fallocate", None)
    if real is None:
        pytest.skip("os.posix_fallocate does not exist on this platform")
    calls: list[tuple[int, int]] = []

    def recording(fd: int, offset: int, length: int) -> None:
        if _under(fd, root):
            calls.append((offset, length))
        real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", recording)
    async with LocalTier(root, spare_files=4) as tier:
        await _reserve_filled(tier, "a", blob(MiB, 1))
        assert calls == [(0, MiB)]
        await tier.delete("a")
        await _reserve_filled(tier, "b", blob(MiB, 2))  # refills a's file
        assert calls == [(0, MiB)]
        await tier.delete("b")
        await _reserve_filled(tier, "c", blob(2 * MiB, 3))  # grows it
        assert calls == [(0, MiB), (MiB, MiB)]
        await tier.delete("c")
        assert await tier.prepare(3 * MiB)  # grows it again, in the background
        assert calls[2:] == [(2 * MiB, MiB)]
        data = blob(3 * MiB, 4)
        await _reserve_filled(tier, "d", data)  # takes the prepared memory
        assert len(calls) == 3
        await tier.put("e", b"e" * 100)  # a fresh file, written: write reports ENOSPC itself
        assert len(calls) == 3
        assert bytes(await tier.get("d")) == data


@pytest.mark.parametrize("code", [errno.EOPNOTSUPP, errno.EINVAL])
async def test_a_filesystem_that_cannot_preallocate_is_used_without(
    root: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, code: int
) -> None:
    """Where posix_fallocate is unsupported, files are only sized (as before), the tier says
    so once, and stops asking that filesystem."""
    calls: list[int] = []

    def unsupported(fd: int, offset: int, length: int) -> None:
        calls.append(length)
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    caplog.set_level(logging.INFO, logger="tiercheck")
    async with LocalTier(root, spare_files=0) as tier:
        for seed, key in enumerate(["a", "b"]):
            await _reserve_filled(tier, key, blob(MiB, seed))
            assert bytes(await tier.get(key)) == blob(MiB, seed)
        assert await tier.prepare(MiB)
        await _reserve_filled(tier, "c", blob(MiB, 9))
        assert bytes(await tier.get("c")) == blob(MiB, 9)
    assert calls == [MiB]
    said = [r for r in caplog.records if "cannot preallocate" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.INFO]


async def test_other_os_errors_are_storage_errors(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An I/O error while writing raises StorageError (cause chained), the old blob intact."""
    async with LocalTier(root) as tier:
        await tier.put("k", b"old")
        os_writes_under(monkeypatch, root, fail=errno.EIO)
        with pytest.raises(StorageError) as info:
            await tier.put("k", b"new")
        assert isinstance(info.value.__cause__, OSError)
        assert await tier.get("k") == b"old"
        assert temp_files_under(root) == []


# --- reservations and recycling ------------------------------------------------------------------


async def test_local_tier_supports_reserve(root: Path) -> None:
    """LocalTier implements the SupportsReserve protocol."""
    assert isinstance(LocalTier(root), SupportsReserve)


async def test_reservation_state_errors(root: Path) -> None:
    """Commit twice, abort after commit, commit after abort are errors; abort/release repeat."""
    async with LocalTier(root) as tier:
        committed = await tier.reserve("c", 4)
        committed.buffer[:] = b"abcd"
        await committed.commit()
        assert committed.committed
        with pytest.raises(RuntimeError):
            await committed.commit()
        with pytest.raises(RuntimeError):
            await committed.abort()
        committed.release()
        committed.release()
        with pytest.raises(ValueError):  # noqa: PT011 -- the type is the contract
            _ = committed.buffer

        aborted = await tier.reserve("a", 4)
        await aborted.abort()
        await aborted.abort()
        with pytest.raises(RuntimeError):
            await aborted.commit()
        aborted.release()
        assert await tier.get("c") == b"abcd"
        assert not await tier.exists("a")


async def test_reserve_rejects_bad_sizes(root: Path) -> None:
    """nbytes must be a non-negative int."""
    async with LocalTier(root) as tier:
        with pytest.raises(ValueError):  # noqa: PT011 -- the type is the contract
            await tier.reserve("k", -1)
        with pytest.raises(TypeError):
            await tier.reserve("k", 1.0)  # type: ignore[arg-type]


async def test_aclose_aborts_open_reservations_and_frees_spares(root: Path) -> None:
    """Closing removes uncommitted reservations and spares; committed blobs stay."""
    tier = LocalTier(root)
    await tier.put("kept", b"kept")
    await tier.put("spare", b"s" * 100)
    await tier.delete("spare")
    assert tier.spare_count == 1
    pending = await tier.reserve("pending", 10)
    pending.buffer[:] = b"p" * 10
    await tier.aclose()
    with pytest.raises(TierClosed):
        await pending.commit()
    pending.release()
    assert [p.relative_to(root).as_posix() for p in files_under(root)] == ["kept"]
    async with LocalTier(root) as again:
        assert await again.get("kept") == b"kept"
        assert not await again.exists("pending")


async def test_deleted_blobs_are_recycled(root: Path) -> None:
    """A deleted blob's file becomes a spare, and the next put or reserve refills that file."""
    async with LocalTier(root, spare_files=2) as tier:
        await tier.put("a", b"1" * 4096)
        inode = (root / "a").stat().st_ino
        await tier.delete("a")
        assert tier.spare_count == 1
        assert tier.spare_bytes == 4096
        reservation = await tier.reserve("b", 4096)
        assert tier.spare_count == 0
        reservation.buffer[:] = b"2" * 4096
        await reservation.commit()
        reservation.release()
        assert (root / "b").stat().st_ino == inode
        assert await tier.get("b") == b"2" * 4096
        for key in ("c", "d", "e"):
            await tier.put(key, key.encode() * 100)
        for key in ("c", "d", "e"):
            await tier.delete(key)
        assert tier.spare_count == 2


async def test_a_held_buffer_keeps_its_bytes_while_its_file_is_recycled(root: Path) -> None:
    """A committed buffer is private memory, not the stored file: deleting its key lets the
    file be recycled at once, and the held buffer keeps showing its own bytes."""
    async with LocalTier(root) as tier:
        held = await tier.reserve("held", MiB)
        held.buffer[:] = blob(MiB, 1)
        await held.commit()
        inode = (root / "held").stat().st_ino
        await tier.delete("held")
        assert tier.spare_count == 1
        for i in range(3):
            await tier.put(f"other{i}", blob(MiB, 10 + i))  # refills that very file
            assert (root / f"other{i}").stat().st_ino == inode
            await tier.delete(f"other{i}")
        assert held.buffer == blob(MiB, 1)
        held.release()


def _address(view: memoryview) -> int:
    return torch.frombuffer(view, dtype=torch.uint8).data_ptr()


def idle_addresses() -> list[int]:
    """Where the idle buffers of the process's pool of local-tier memory start."""
    pool = memory.SHARED
    pool.trim()  # takes in what came back (keeping one)
    with pool._lock:
        return [ctypes.addressof(ctypes.c_char.from_buffer(m)) for m in pool._free]


@contextlib.contextmanager
def counted_allocations() -> Iterator[list[int]]:
    """The sizes of the buffers the local tiers allocate anew meanwhile."""
    sizes: list[int] = []
    real = memory.anonymous_memory

    def counting(size: int, *, populate: bool = False) -> mmap.mmap:
        sizes.append(size)
        return real(size, populate=populate)

    memory.anonymous_memory = counting  # type: ignore[assignment]
    try:
        yield sizes
    finally:
        memory.anonymous_memory = real


def _made_from(view: memoryview, holder: str) -> object:
    """Something made from ``view`` that keeps its memory reachable (only that)."""
    if holder == "tensor":
        return torch.frombuffer(view, dtype=torch.uint8)
    if holder == "tensor-slice":
        return torch.frombuffer(view, dtype=torch.uint8)[MiB:]
    if holder == "view-slice":
        return view[MiB:]
    if holder == "cast":
        return view.cast("I")
    return np.frombuffer(view, dtype="u1")[MiB:]


@pytest.mark.parametrize("holder", ["tensor", "tensor-slice", "view-slice", "cast", "numpy"])
async def test_memory_is_recycled_only_once_nothing_made_from_it_lives(
    root: Path, holder: str
) -> None:
    """Whatever keeps a reservation's memory reachable (a tensor, a slice of one, a slice or a
    cast of the view, a numpy array) keeps it from being handed to another reservation after
    release; once that is gone, the memory is recycled."""
    size = 4 * MiB  # pooled (small reservations get a bytearray each)
    async with LocalTier(root) as tier:
        first = await tier.reserve("a", size)
        address = _address(first.buffer)
        first.buffer[:] = b"\x07" * size
        kept = _made_from(first.buffer, holder)
        await first.commit()
        first.release()
        del first
        gc.collect()
        second = await tier.reserve("b", size)
        other = _address(second.buffer)
        assert other != address  # still reachable: not handed out again
        second.buffer[:] = b"\x09" * size
        await second.commit()
        second.release()
        del second
        assert np.asarray(kept).view(np.uint8)[:16].tobytes() == b"\x07" * 16
        assert address not in idle_addresses()
        del kept
        gc.collect()
        assert address in idle_addresses()  # back, once nothing reaches it
        with counted_allocations() as allocated:
            third = await tier.reserve("c", size)
        assert allocated == []  # recycled, not allocated anew
        await third.abort()
        third.release()


async def test_reads_reuse_memory_that_nothing_holds(root: Path) -> None:
    """A large get is read into the memory of an earlier get (or reservation) once nothing
    made from that is left, never while something is."""
    size = 4 * MiB
    async with LocalTier(root) as tier:
        await tier.put("a", blob(size, 1))
        await tier.put("b", blob(size, 2))
        first = await tier.get("a")
        address = _address(first)
        kept = torch.frombuffer(first, dtype=torch.uint8)[1:]
        del first
        gc.collect()
        second = await tier.get("b")
        other = _address(second)
        assert other != address  # the tensor still reaches the first read's memory
        assert bytes(kept[:15].numpy()) == blob(size, 1)[1:16]
        assert address not in idle_addresses()
        del kept, second
        gc.collect()
        assert {address, other} & set(idle_addresses())  # back, once nothing reaches them
        with counted_allocations() as allocated:
            third = await tier.get("a")
        assert bytes(third) == blob(size, 1)
        assert allocated == []  # recycled, not allocated anew


async def test_tensor_views_outlive_release(root: Path) -> None:
    """Tensors made from a buffer stay valid after release, whatever happens to the file."""
    async with LocalTier(root) as tier:
        reservation = await tier.reserve("t", MiB)
        tensor = torch.frombuffer(reservation.buffer, dtype=torch.uint8)
        tensor.fill_(7)
        await reservation.commit()
        reservation.release()
        await tier.delete("t")
        other = await tier.reserve("u", MiB)  # refills t's file
        torch.frombuffer(other.buffer, dtype=torch.uint8).fill_(9)
        await other.commit()
        other.release()
        assert int(tensor.min()) == 7
        assert int(tensor.max()) == 7


async def test_a_reader_in_another_process_blocks_recycling(root: Path) -> None:
    """A file someone holds a shared flock on (a get in progress) is removed, not recycled."""
    async with LocalTier(root) as tier:
        await tier.put("k", blob(MiB, 1))
        fd = os.open(root / "k", os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            await tier.delete("k")
            assert tier.spare_count == 0
            await tier.put("k2", blob(MiB, 2))
            assert os.pread(fd, MiB, 0) == blob(MiB, 1)
        finally:
            os.close(fd)


async def test_dead_writers_debris_is_cleaned_on_open(root: Path) -> None:
    """Temporary files and spares of a dead process on this host are removed on first use.

    Those of live processes, and of other hosts, are left alone; none of them is ever listed.
    """
    host = socket.gethostname()
    dead = dead_pid()
    (root / "v1").mkdir(parents=True)
    (root / ".tiercheck#spares").mkdir()
    dead_temp = root / "v1" / f".tiercheck#tmp#{host}#{dead}#aaaa"
    dead_spare = root / ".tiercheck#spares" / f".tiercheck#tmp#{host}#{dead}#bbbb"
    live_temp = root / "v1" / f".tiercheck#tmp#{host}#{os.getpid()}#cccc"
    foreign = root / "v1" / f".tiercheck#tmp#another-host#{dead}#dddd"
    for path in (dead_temp, dead_spare, live_temp, foreign):
        path.write_bytes(b"debris")
    (root / "v1" / "blob").write_bytes(b"real")
    async with LocalTier(root) as tier:
        assert [k async for k in tier.list()] == ["v1/blob"]
        assert tier.usage == 4
    assert not dead_temp.exists()
    assert not dead_spare.exists()
    assert live_temp.exists()
    assert foreign.exists()


# --- a model-based check of accounting and recycling --------------------------------------------


class LocalTierMachine(TierStateMachine):
    """The shipped state machine on the local tier, plus its accounting after every step.

    Any sequence of puts, reserves (committed, aborted, dropped or held), deletes and reopens
    leaves the tier equal to a dict: every key reads back its model value, the listing equals
    the model's keys (the shipped invariants); and here, usage equals the model's total size,
    spares stay within their limit. Some committed buffers are held (not released) across
    steps and must keep their bytes throughout.
    """

    keys = ("k0", "k1", "d/k2", "d/k3")

    async def make_tier(self, folder: Path) -> Tier:
        return LocalTier(folder / "root", spare_files=2)

    async def reopen_tier(self, tier: Tier, folder: Path) -> Tier:
        return LocalTier(folder / "root", spare_files=2)

    @invariant()
    def usage_and_spares_are_accounted(self) -> None:
        tier = self.tier
        assert isinstance(tier, LocalTier)
        self.run(tier.exists(self.keys[0]))  # a new instance counts its root on first use
        assert tier.usage == sum(len(v) for v in self.model.values())
        assert tier.spare_count <= 2


LocalTierMachine.TestCase.settings = settings(stateful_step_count=25)
TestLocalTierMachine = LocalTierMachine.TestCase


# --- prepare: memory made ready ahead of a reserve ------------------------------------------


async def test_prepared_memory_serves_the_next_reserve_of_that_size(tmp_path: Path) -> None:
    """A reserve of the prepared size takes the prepared memory; the blob is still atomic."""
    tier = LocalTier(tmp_path / "root")
    assert isinstance(tier, SupportsPrepare)
    await tier.put("warm", b"x")  # the tier has scanned its root
    assert await tier.prepare(1 << 20)
    reservation = await tier.reserve("a/b/blob", 1 << 20)
    assert not await tier.exists("a/b/blob")  # nothing visible before commit
    reservation.buffer[:] = bytes(range(256)) * 4096
    await reservation.commit()
    assert bytes(await tier.get("a/b/blob")) == bytes(range(256)) * 4096
    assert [k async for k in tier.list("a/")] == ["a/b/blob"]
    reservation.release()
    await tier.aclose()


async def test_a_reserve_of_another_size_ignores_prepared_memory(tmp_path: Path) -> None:
    """Prepared memory of the wrong size is not used, and closing frees it."""
    tier = LocalTier(tmp_path / "root")
    await tier.put("warm", b"x")
    assert await tier.prepare(4096)
    reservation = await tier.reserve("k", 100)
    reservation.buffer[:] = b"y" * 100
    await reservation.commit()
    reservation.release()
    assert bytes(await tier.get("k")) == b"y" * 100
    await tier.aclose()
    hidden = [p for p in (tmp_path / "root").rglob("*") if p.is_file() and "#" in p.name]
    assert hidden == []


def hidden_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and "#" in p.name]


async def test_prepare_respects_capacity(tmp_path: Path) -> None:
    """Preparing more than the capacity allows prepares nothing and writes nothing; prepared
    memory counts as in flight, and a write that does not fit even without it keeps it."""
    tier = LocalTier(tmp_path / "root", capacity=1000)
    await tier.put("k", b"z" * 600)
    assert not await tier.prepare(800)
    assert hidden_files(tmp_path / "root") == []
    assert tier.usage == 600
    assert await tier.prepare(300)
    assert tier.usage == 900  # the prepared 300 bytes count as in flight
    small = await tier.reserve("small", 50)  # fits beside them: nothing dropped
    assert tier.usage == 950
    with pytest.raises(TierFull):
        await tier.put("other", b"w" * 401)  # 600 + 50 + 401 > 1000 even without them
    with pytest.raises(TierFull):
        await tier.reserve("other", 401)
    assert tier.usage == 950  # so the prepared memory is still there
    await small.abort()
    await tier.aclose()


@pytest.mark.parametrize("write", ["reserve", "put"])
async def test_prepared_memory_gives_way_to_a_write_that_needs_its_room(
    tmp_path: Path, write: str
) -> None:
    """With a capacity, a write of another size that fits only without the prepared memory
    drops it instead of raising TierFull; the prepared file goes with it."""
    root = tmp_path / "root"
    tier = LocalTier(root, capacity=1000, spare_files=0)
    await tier.put("k", b"z" * 600)
    assert await tier.prepare(300)
    data = b"r" * 350  # 600 + 300 + 350 > 1000, 600 + 350 fits
    if write == "reserve":
        reservation = await tier.reserve("r", len(data))
        assert tier.usage == 950
        reservation.buffer[:] = data
        await reservation.commit()
        reservation.release()
    else:
        await tier.put("r", data)
    assert tier.usage == 950
    assert bytes(await tier.get("r")) == data
    assert bytes(await tier.get("k")) == b"z" * 600
    assert hidden_files(root) == []
    await tier.aclose()


async def test_aborting_a_prepared_reservation_leaves_nothing(tmp_path: Path) -> None:
    """An aborted reservation made from prepared memory stores nothing and leaks no file."""
    tier = LocalTier(tmp_path / "root")
    await tier.put("warm", b"x")
    await tier.prepare(8192)
    reservation = await tier.reserve("gone", 8192)
    await reservation.abort()
    assert not await tier.exists("gone")
    hidden = [p for p in (tmp_path / "root").rglob("*") if p.is_file() and "#" in p.name]
    assert hidden == []
    await tier.aclose()


async def test_large_reads_are_private_copies(tmp_path: Path) -> None:
    """A large get is a private copy: writing to it changes nothing stored, and its file may be
    deleted, recycled and refilled while the copy lives, which keeps its bytes."""
    tier = LocalTier(tmp_path / "root")
    original = blob(4 * MiB, 7)
    await tier.put("big", original)
    view = await tier.get("big")
    assert not memoryview(view).readonly
    memoryview(view)[:4] = b"XXXX"  # private: the stored blob is untouched
    assert bytes(await tier.get("big")) == original
    await tier.delete("big")  # nothing pins the file
    assert tier.spare_count == 1
    await tier.put("next", blob(4 * MiB, 8))  # refills big's file
    assert bytes(memoryview(view)[4:]) == original[4:]
    del view
    await tier.aclose()


async def test_capacity_counts_every_file_until_it_is_gone(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """#19 (found by the /dev/shm bound test): a file taken off its key, dropped as a spare or
    aborted is still on the filesystem until it is removed, and the capacity must count it
    until then -- else a write in that window lands on a filesystem fuller than the capacity
    says. Checked at every removal the tier makes, over a seeded random mix of operations:
    the bytes really under the root never exceed what the tier counts."""
    from tiercheck.tiers import atomic

    real_discard = atomic.discard
    checked = [0]

    for spare_files in (0, 2):
        tier = LocalTier(root / str(spare_files), capacity=4000, spare_files=spare_files)
        root_of_tier = root / str(spare_files)

        def discard(path: str, *, _tier: LocalTier = tier, _root: Path = root_of_tier) -> None:
            counted = _tier._stored + _tier._pending + _tier._spare_bytes + _tier._leaving
            present = sum(p.stat().st_size for p in _root.rglob("*") if p.is_file())
            assert present <= counted, f"{present} bytes on disk, {counted} counted"
            checked[0] += 1
            real_discard(path)

        monkeypatch.setattr(atomic, "discard", discard)
        rng = random.Random(19)
        keys: list[str] = []
        async with tier:
            for step in range(300):
                op = rng.choice(["put", "reserve", "abort", "delete", "delete", "prepare"])
                size = rng.choice([300, 500, 800])
                try:
                    if op == "put":
                        await tier.put(f"k{step}", b"x" * size)
                        keys.append(f"k{step}")
                    elif op in ("reserve", "abort"):
                        reservation = await tier.reserve(f"k{step}", size)
                        if op == "reserve":
                            reservation.buffer[:] = b"y" * size
                            await reservation.commit()
                            keys.append(f"k{step}")
                        else:
                            await reservation.abort()
                        reservation.release()
                    elif op == "prepare":
                        await tier.prepare(size)
                    elif keys:
                        await tier.delete(keys.pop(rng.randrange(len(keys))))
                except TierFull:
                    pass  # the capacity refusing is fine; exceeding it is not
                assert tier._leaving == 0
        monkeypatch.setattr(atomic, "discard", real_discard)
    assert checked[0] > 50
