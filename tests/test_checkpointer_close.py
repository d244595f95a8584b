"""How a checkpointer closes: flushed on a normal end, bounded on an exception, at once on
``flush=False`` -- with a tier that never finishes a write standing in for a dead peer or an
unreachable store."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tiercheck import (
    BlobNotFound,
    Checkpointer,
    ConfigError,
    SyncCheckpointer,
    TierNotTargeted,
    TierWriteFailed,
)
from tiercheck.tiers import FailureScope, LocalTier
from tiercheck.tiers.base import Buffer, Tier

#: A hang guard only: a close that waited on the stuck tier would never return.
GUARD_S = 120.0


class _StuckTier(Tier):
    """A tier whose writes never finish (a holder or store that stopped answering)."""

    name = "stuck"
    survives = FailureScope.CLUSTER

    def __init__(self) -> None:
        self.blobs: dict[str, bytes] = {}
        self.puts_started = 0
        self.puts_cancelled = 0
        self.entered = threading.Event()  # set once a write is hanging

    async def put(self, key: str, data: Buffer) -> None:
        if key.startswith("v") and "/r" in key:  # blobs hang; COMMIT records never come
            self.puts_started += 1
            self.entered.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.puts_cancelled += 1
                raise
        self.blobs[key] = bytes(data)

    async def get(self, key: str) -> Buffer:
        try:
            return self.blobs[key]
        except KeyError:
            raise BlobNotFound(key) from None

    async def delete(self, key: str) -> None:
        self.blobs.pop(key, None)

    async def exists(self, key: str) -> bool:
        return key in self.blobs

    async def list(self, prefix: str = "") -> AsyncIterator[str]:
        for key in [k for k in self.blobs if k.startswith(prefix)]:
            yield key


async def _started(tier: _StuckTier) -> None:
    """Until the stuck tier is inside a write (the pipeline gets there in the background)."""
    assert await asyncio.to_thread(tier.entered.wait, GUARD_S)


def _ckpt(tmp_path: Path, stuck: Tier, cls: Any = Checkpointer, **kw: Any) -> Any:
    return cls(
        "job",
        local_root=tmp_path / "shm",
        tiers=[LocalTier(tmp_path / "shm" / "blobs"), stuck],
        base_every=1,
        **kw,
    )


async def test_leaving_on_an_exception_flushes_memory_then_gives_up(tmp_path: Path) -> None:
    """On an exception the local save still in flight is finished, the stuck one is waited
    for at most ``close_timeout``, then abandoned; the exception is the caller's."""
    stuck = _StuckTier()
    ckpt = _ckpt(tmp_path, stuck, close_timeout=1.0)

    async def train() -> None:
        async with ckpt:
            await ckpt.save(0, {"w": torch.arange(64.0)})
            raise KeyError("the training step failed")

    with pytest.raises(KeyError, match="the training step failed"):
        await asyncio.wait_for(train(), GUARD_S)
    stats = ckpt.stats
    assert stats.committed.get("local") == 1, "the memory tier's pending save was flushed"
    assert stats.committed.get("stuck", 0) == 0
    assert stuck.puts_cancelled == stuck.puts_started, "a stuck write is abandoned, not awaited"
    # The flushed version restores (with the same durable tier: the memory is its job's).
    async with _ckpt(tmp_path, stuck) as again:
        restored = await again.restore()
    assert restored is not None
    assert restored.version == 0


async def test_close_without_flush_waits_for_nothing(tmp_path: Path) -> None:
    stuck = _StuckTier()
    ckpt = _ckpt(tmp_path, stuck, close_timeout=300.0)  # a wait would be for 300 s
    await ckpt.open()
    handle = await ckpt.save(0, {"w": torch.arange(64.0)})
    await handle.result_async("local")
    await _started(stuck)
    await asyncio.wait_for(ckpt.aclose(flush=False), GUARD_S)
    assert stuck.puts_cancelled == 1
    with pytest.raises(TierWriteFailed, match="abandoned"):
        await asyncio.wait_for(handle.result_async("stuck"), GUARD_S)  # resolved, not left hanging


async def test_done_answers_at_once_as_a_future_does(tmp_path: Path) -> None:
    """``handle.done(tier)`` is :meth:`concurrent.futures.Future.done`: a bool, at once --
    false while a write hangs, true once it committed or failed; ``await handle.done(tier)``
    (a coroutine until 0.1) still waits, with a DeprecationWarning."""
    stuck = _StuckTier()
    ckpt = _ckpt(tmp_path, stuck, close_timeout=300.0)
    await ckpt.open()
    handle = await ckpt.save(0, {"w": torch.arange(64.0)})
    with pytest.warns(DeprecationWarning, match="result_async"):
        await asyncio.wait_for(handle.done("local"), GUARD_S)
    await _started(stuck)
    assert handle.done("local")
    assert handle.done("local")
    assert not handle.done("stuck")
    assert not handle.done()
    with pytest.raises(TierNotTargeted):
        handle.done("nowhere")
    await asyncio.wait_for(ckpt.aclose(flush=False), GUARD_S)
    assert handle.done("stuck")
    assert handle.done()
    assert not handle.committed("stuck")


def test_the_sync_checkpointer_leaves_an_exception_the_same_way(tmp_path: Path) -> None:
    stuck = _StuckTier()
    ckpt = _ckpt(tmp_path, stuck, cls=SyncCheckpointer, close_timeout=1.0)
    handles = []

    def train() -> None:
        with ckpt:
            handles.append(ckpt.save(0, {"w": torch.arange(64.0)}))
            raise KeyError("the training step failed")

    with pytest.raises(KeyError):
        train()
    (handle,) = handles
    assert handle.committed("local")
    assert not handle.committed("stuck")
    assert stuck.puts_cancelled == stuck.puts_started


def test_close_failed_is_the_bounded_close_of_an_error(tmp_path: Path) -> None:
    """What integrations call when the trainer failed (they have no ``with`` to leave)."""
    stuck = _StuckTier()
    ckpt = _ckpt(tmp_path, stuck, cls=SyncCheckpointer, close_timeout=1.0)
    handle = ckpt.save(0, {"w": torch.arange(64.0)})
    assert stuck.entered.wait(GUARD_S)
    ckpt.close(failed=True)  # a collective close would wait for the stuck write for ever
    assert handle.committed("local")
    assert not handle.committed("stuck")
    assert stuck.puts_cancelled == stuck.puts_started == 1


async def test_a_normal_end_waits_for_every_save(tmp_path: Path) -> None:
    """Without an exception nothing is abandoned: a slow (not stuck) tier is waited for."""

    class _Slow(_StuckTier):
        async def put(self, key: str, data: Buffer) -> None:
            await asyncio.sleep(0.2)
            self.blobs[key] = bytes(data)

    async with _ckpt(tmp_path, _Slow(), close_timeout=0.0) as ckpt:
        handles = [await ckpt.save(v, {"w": torch.full((64,), float(v))}) for v in range(3)]
    assert all(h.committed("stuck") and h.committed("local") for h in handles)


@pytest.mark.parametrize("bad", [-1, float("nan"), "10"])
def test_close_timeout_must_be_seconds(tmp_path: Path, bad: Any) -> None:
    with pytest.raises(ConfigError):
        Checkpointer("job", local_root=tmp_path, close_timeout=bad)


_EXIT_SCRIPT = """
import os, signal, sys, threading, torch, tiercheck
root, case, delay = sys.argv[1], sys.argv[2], float(sys.argv[3])
ckpt = tiercheck.SyncCheckpointer(
    "exit", persistent="file://" + root + "/durable", local_root=root + "/shm", persist="all"
)
state = {"w": torch.randn(4_000_000)}
if case == "never-closed":
    ckpt.save(0, state)
    try:
        ckpt.save(0, state)  # the caller's mistake: raises, and the script never closes
    except tiercheck.VersionError:
        print("refused", flush=True)
    sys.exit(0)
threading.Timer(delay, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
with ckpt:
    for v in range(10_000):
        state["w"].add_(1.0)
        ckpt.save(v, state)
"""


@pytest.mark.slow
def test_leaving_the_interpreter_is_quiet(tmp_path: Path) -> None:
    """#19: a checkpointer that was never closed (its save raised) and a SIGINT during saves at
    several moments end the process with the caller's own traceback at most: no asyncio
    warnings ("Task was destroyed but it is pending!"), no tiercheck traceback, and the job
    restores afterwards."""
    import subprocess
    import sys

    script = tmp_path / "exit.py"
    script.write_text(_EXIT_SCRIPT)
    noise = ("Task was destroyed", "Task exception was never retrieved", "Exception ignored")
    cases = [("never-closed", 0.0)] + [("sigint", d) for d in (0.05, 0.3, 0.7, 1.2)]
    for i, (case, delay) in enumerate(cases):
        root = tmp_path / f"run{i}"
        done = subprocess.run(
            [sys.executable, str(script), str(root), case, str(delay)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        for word in noise:
            assert word not in done.stderr, (case, delay, done.stderr)
        if case == "never-closed":
            assert done.returncode == 0, done.stderr
            assert "refused" in done.stdout
            assert "was never closed; closing it at exit" in done.stderr
            assert "Traceback" not in done.stderr, done.stderr
        else:
            assert done.returncode in (130, -2), (done.returncode, done.stderr)
            # The caller's KeyboardInterrupt, and nothing of tiercheck's.
            assert done.stderr.count("Traceback") <= 1, done.stderr
            assert "tiercheck" not in done.stderr.split("KeyboardInterrupt")[-1], done.stderr
        with SyncCheckpointer(
            "exit",
            persistent=(root / "durable").as_uri(),
            local_root=root / "shm",
            persist="all",
        ) as again:
            restored = again.restore()
        if restored is not None:
            assert restored.state["w"].numel() == 4_000_000
