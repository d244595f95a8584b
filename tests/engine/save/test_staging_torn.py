"""No torn snapshot is ever committed: the rule of overlapped saves, hammered and pinned down.

With ``overlap=True`` the snapshot copy runs after ``save`` returned. A version whose tensors
changed between ``save`` and the fence must fail in every tier (``StateChanged``); one changed
only after the fence must commit and restore the values ``save`` saw. Torch bumps a tensor's
version counter *after* an in-place kernel ran, so only a check on the training side, at the
fence, sees every change (see :mod:`tiercheck.engine.save.staging`).

* the hammer: hundreds of saves with a change right after ``save`` (in place, through views,
  optimizer steps, fused ones included), after the fence, or none; every committed version is
  read back from every tier and compared with the values at ``save``: no wrong commit allowed;
* the race pinned down: a copy that saw the tensor half written, whose counter moves only after
  the copy is done (as torch bumps it after the kernel), fails -- in one rank of two as well;
* tensors no counter watches (inference tensors, numpy arrays) are copied before ``save``
  returns; the closes (normal, ``flush=False``, on an error, killed) decide what is left.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import tiercheck
from tests.helpers import assert_state_equal, clone_state, run_ranks
from tiercheck import StateChanged, SyncCheckpointer, TierWriteFailed
from tiercheck.codec import decode
from tiercheck.consistency.manifest import Manifest
from tiercheck.defaults import NodeRoot
from tiercheck.engine.save.staging import SnapshotCopy
from tiercheck.testing import LocalGroup

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ],
    ),
]


def _ckpt(tmp_path: Path, **kw: Any) -> SyncCheckpointer:
    kw.setdefault("tiers", ["local", "persistent"])
    kw.setdefault("local_root", tmp_path / "shm")
    kw.setdefault("persistent", (tmp_path / "durable").as_uri())
    kw.setdefault("persist", "all")
    kw.setdefault("encodings", {"persistent": "full"})  # every blob readable on its own
    kw.setdefault("keep", 2)
    kw.setdefault("overlap", True)
    return SyncCheckpointer("job", **kw)


def _local(tmp_path: Path, version: int, rank: int = 0, node: str = "shm") -> Path:
    """Where the local tier keeps ``rank``'s blob of ``version`` once published."""
    return tmp_path / node / "blobs" / f"v{version:012d}" / f"r{rank:05d}.full"


def _durable(tmp_path: Path, version: int, name: str = "r00000.full") -> Path:
    """Where the persistent tier keeps a blob (or, ``name="COMMIT"``, the commit record)."""
    return tmp_path / "durable" / "job" / f"v{version:012d}" / name


def _read(path: Path) -> Any:
    return decode(bytearray(path.read_bytes())).state()


def _cpu(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return state.detach().cpu()
    if isinstance(state, dict):
        return {k: _cpu(v) for k, v in state.items()}
    return state


# --- the hammer --------------------------------------------------------------------------------


class Hammer:
    """One training process saving with overlap, changing its state at the worst moments."""

    def __init__(self, device: str, seed: int) -> None:
        self.rng = random.Random(seed)
        gen = torch.Generator().manual_seed(seed)
        n = 1 << 20  # 4 MB of fp32: a copy long enough for a change to land in its middle
        self.w = torch.randn(n, generator=gen).to(device)
        self.b = torch.randn(64, generator=gen).to(device)
        self.p = torch.nn.Parameter(torch.randn(n // 2, generator=gen).to(device))
        self.p.grad = torch.randn(n // 2, generator=gen).to(device)
        self.fused = torch.optim.AdamW([self.p], lr=1e-2, fused=True)
        self.foreach = torch.optim.AdamW([self.p], lr=1e-2, foreach=True)
        for opt in (self.fused, self.foreach):
            opt.step()  # optimizer state exists from here on

    def state(self, kind: str) -> dict[str, Any]:
        if kind == "one":
            return {"w": self.w}
        if kind == "view":  # a view of a live tensor is saved; its base is what changes
            return {"tail": self.w[1:], "b": self.b}
        if kind == "fused":  # the model alone: a fused step bumps none of its counters
            return {"model": {"p": self.p.detach()}}
        if kind == "foreach":
            return {"model": {"p": self.p.detach()}, "optim": self.foreach.state_dict()}
        return {"w": self.w, "b": self.b, "step": 3}

    def change(self, kind: str) -> None:
        with torch.no_grad():
            if kind == "fused":
                self.fused.step()  # no bump of p or its moments: the step must wait
            elif kind == "foreach":
                self.foreach.step()
            else:
                how = self.rng.choice(["add", "view", "slow"])
                if how == "add":
                    self.w.add_(0.5)
                elif how == "view":  # through a view of a saved tensor
                    self.w[:: self.rng.choice([2, 3, 7])].mul_(1.5)
                else:  # slower than the copy: the copy ends while it is half done
                    self.w.sin_()


def _hammer(tmp_path: Path, device: str, trials: int, seed: int, **kw: Any) -> dict[str, int]:
    h = Hammer(device, seed)
    counts = {"committed": 0, "failed": 0, "wrong": 0, "after_fence": 0}
    wrong: list[str] = []
    with _ckpt(tmp_path, **kw) as ckpt:
        for version in range(trials):
            kind = h.rng.choice(["one", "many", "view", "fused", "foreach"])
            when = h.rng.choices(["before", "after", "never"], weights=[6, 3, 1])[0]
            state = h.state(kind)
            before = clone_state(_cpu(state))
            handle = ckpt.save(version, state)
            if when == "before":
                h.change(kind)  # right after save: no fence passed
            handle.staged()
            if when == "after":
                h.change(kind)
            try:
                handle.result()
            except TierWriteFailed as exc:
                failure: TierWriteFailed | None = exc
            else:
                failure = None
            if failure is not None:
                counts["failed"] += 1
                assert isinstance(failure.__cause__, StateChanged), repr(failure)
                # A change after the fence (or none) must never fail the version.
                assert when == "before", repr(failure)
                continue
            counts["committed"] += 1
            counts["after_fence"] += when == "after"
            assert _durable(tmp_path, version, "COMMIT").is_file()
            for path in (_local(tmp_path, version), _durable(tmp_path, version)):
                try:
                    assert_state_equal(_read(path), before)
                except AssertionError as exc:
                    counts["wrong"] += 1
                    wrong.append(f"v{version} {kind}/{when} in {path}: {exc}")
        newest = ckpt.wait()
    # The job restores its newest version, bit-exact, from a new process's point of view.
    with _ckpt(tmp_path) as again:
        restored = again.restore()
    assert restored is not None
    assert restored.version == newest["local"]
    assert counts["wrong"] == 0, f"{counts}: torn versions committed:\n" + "\n".join(wrong)
    return counts


@pytest.mark.parametrize("device", DEVICES)
def test_no_torn_version_is_ever_committed(tmp_path: Path, device: str) -> None:
    counts = _hammer(tmp_path, device, trials=240, seed=19)
    # Not vacuous: versions fenced properly (or changed after their fence) did commit.
    assert counts["committed"] >= 60, counts
    assert counts["after_fence"] >= 30, counts


@pytest.mark.parametrize("device", DEVICES)
def test_no_torn_version_with_saves_in_flight_or_skipped(tmp_path: Path, device: str) -> None:
    counts = _hammer(
        tmp_path, device, trials=80, seed=7, max_pending=2, on_busy="skip", base_every=3
    )
    assert counts["committed"] >= 15, counts


# --- the rule, step by step -------------------------------------------------------------------


class Gate:
    """Holds every snapshot copy until opened (``SnapshotCopy.run`` waits for it)."""

    def __init__(self) -> None:
        self.event = threading.Event()

    def open(self) -> None:
        self.event.set()


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    g = Gate()
    original = SnapshotCopy.run

    def gated(self: SnapshotCopy) -> None:
        g.event.wait(timeout=30)  # bounded: a failing test must not hang its teardown
        original(self)

    monkeypatch.setattr(SnapshotCopy, "run", gated)
    try:
        yield g
    finally:
        g.open()


def _staged(handle: Any) -> None:
    """Wait until the copy is done without passing the fence (no confirmation point)."""
    deadline = time.monotonic() + 30
    while not handle.is_staged:
        assert time.monotonic() < deadline, "the copy never finished"
        time.sleep(0.001)


def _manifest_commits(tmp_path: Path, tier: str, node: str = "shm") -> list[int]:
    manifest = Manifest(NodeRoot(tmp_path / node).manifest)
    try:
        return manifest.committed(tier)
    finally:
        manifest.close()


def _assert_not_stored(tmp_path: Path, handle: Any, *, cause: type[BaseException]) -> None:
    """The version fails in every tier, caused by ``cause``, and no tier can restore it."""
    for tier in handle.tiers:
        with pytest.raises(TierWriteFailed, match="could not be staged") as info:
            handle.result(tier)
        assert isinstance(info.value.__cause__, cause), repr(info.value.__cause__)
    assert not _local(tmp_path, handle.version).exists()
    assert not _durable(tmp_path, handle.version, "COMMIT").exists()


def test_a_change_before_the_fence_fails_everywhere_one_after_it_commits(
    tmp_path: Path, gate: Gate
) -> None:
    w = torch.arange(1 << 16, dtype=torch.float32)
    with _ckpt(tmp_path, keep=5) as ckpt:
        first = ckpt.save(1, {"w": w})
        w.add_(1.0)  # before the fence
        gate.open()
        first.staged()
        _assert_not_stored(tmp_path, first, cause=StateChanged)
        gate.event.clear()
        before = w.clone()
        second = ckpt.save(2, {"w": w})
        with pytest.raises(TimeoutError):
            second.staged(timeout=0.05)  # the copy is held: the fence holds too
        gate.open()
        second.staged()
        w.add_(1.0)  # after the fence: the version is what save saw
        second.result()
        assert ckpt.versions() == {"local": [2], "persistent": [2]}
    assert _manifest_commits(tmp_path, "local") == [2]
    for path in (_local(tmp_path, 2), _durable(tmp_path, 2)):
        assert_state_equal(_read(path), {"w": before})
    # From the durable tier alone (a new node), bit-exact.
    shutil.rmtree(tmp_path / "shm")
    with _ckpt(tmp_path) as again:
        restored = again.restore()
    assert restored is not None
    assert restored.version == 2
    assert restored.source_tier == "persistent"
    assert_state_equal(restored.state, {"w": before})


def _half_written(w: torch.Tensor) -> None:
    """What a copy racing an in-place kernel sees: half the tensor written, its counter not
    bumped yet (torch bumps it when the kernel returns; ``.data`` has a counter of its own)."""
    version = w._version
    w.data[: w.numel() // 2].fill_(7.0)
    assert w._version == version


def test_a_copy_that_saw_a_half_written_tensor_fails_though_its_counter_moved_late(
    tmp_path: Path, gate: Gate
) -> None:
    """The race of issue #19, pinned down: the copy ends while the kernel writing the tensor
    runs, so the counter still reads as at ``save`` when the copy is done; it moves when the
    kernel returns, before the training thread reaches the fence. Nothing may store it."""
    w = torch.zeros(1 << 16)
    with _ckpt(tmp_path, keep=5) as ckpt:
        good = clone_state({"w": w})
        gate.open()
        ckpt.save(1, {"w": w}).result()
        gate.event.clear()
        handle = ckpt.save(2, {"w": w})
        _half_written(w)
        gate.open()
        _staged(handle)  # the copy is done and saw the torn tensor
        time.sleep(0.05)  # room for anything that would publish it
        assert not _local(tmp_path, 2).exists()
        torch.autograd.graph.increment_version(w)  # the kernel returns
        handle.staged()
        _assert_not_stored(tmp_path, handle, cause=StateChanged)
        assert ckpt.versions()["local"] == [1]
    with _ckpt(tmp_path) as again:
        restored = again.restore()
    assert restored is not None
    assert restored.version == 1
    assert_state_equal(restored.state, good)


def test_a_torn_copy_on_one_rank_fails_the_version_on_every_rank(
    tmp_path: Path, gate: Gate
) -> None:
    group = LocalGroup(2)
    barrier = threading.Barrier(2, timeout=60)
    saved: dict[int, Any] = {}

    def rank(r: int) -> None:
        w = torch.full((1 << 15,), float(r))
        with _ckpt(
            tmp_path,
            rank=r,
            world_size=2,
            ranks_per_node=1,
            coordinator=group.coordinator(r),
            local_root=tmp_path / f"node{r}",
        ) as ckpt:
            handle = ckpt.save(1, {"w": w})
            barrier.wait()
            if r == 1:
                _half_written(w)
            barrier.wait()
            if r == 0:
                gate.open()
            _staged(handle)
            barrier.wait()
            if r == 1:
                torch.autograd.graph.increment_version(w)
            handle.staged()
            for tier in handle.tiers:
                with pytest.raises(TierWriteFailed) as info:
                    handle.result(tier)
                if r == 1:  # the torn rank says why; the other that a rank could not
                    assert isinstance(info.value.__cause__, StateChanged)
            assert not _durable(tmp_path, 1, "COMMIT").exists()
            saved[r] = clone_state({"w": w})
            ckpt.save(2, {"w": w}).result()

    run_ranks(2, rank)
    assert not _local(tmp_path, 1, 1, node="node1").exists()  # never published on rank 1
    for r in range(2):
        assert 1 not in _manifest_commits(tmp_path, "local", node=f"node{r}")
    group = LocalGroup(2)

    def restore(r: int) -> Any:
        with _ckpt(
            tmp_path,
            rank=r,
            world_size=2,
            ranks_per_node=1,
            coordinator=group.coordinator(r),
            local_root=tmp_path / f"node{r}",
        ) as ckpt:
            return ckpt.restore()

    for r, got in enumerate(run_ranks(2, restore)):
        assert got is not None
        assert got.version == 2
        assert_state_equal(got.state, saved[r])


# --- optimizer loops --------------------------------------------------------------------------


class Trainer:
    """A small MLP and an optimizer (``fused`` or not), stepping on generated batches."""

    def __init__(self, *, fused: bool) -> None:
        gen = torch.Generator().manual_seed(3)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)
        )
        with torch.no_grad():
            for p in self.model.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        kind = {"fused": True} if fused else {"foreach": True}
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2, **kind)
        self.steps = 0

    def step(self) -> None:
        gen = torch.Generator().manual_seed(100 + self.steps)
        loss = self.model(torch.randn(16, 64, generator=gen)).square().mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.steps += 1


@pytest.mark.parametrize("fused", [False, True])
def test_a_loop_fenced_before_each_step_stores_every_version_whole(
    tmp_path: Path, fused: bool
) -> None:
    t = Trainer(fused=fused)
    t.step()
    saved = {}
    # A queue deep enough that no version is dropped for a slow durable tier (not the point).
    with _ckpt(tmp_path, keep=100, tier_queue=16) as ckpt:
        tiercheck.fence_before_step(ckpt, t.opt)
        for version in range(8):
            state = {"model": t.model.state_dict(), "optim": t.opt.state_dict()}
            saved[version] = clone_state(state)
            handles = ckpt.save(version, state)
            t.step()  # forward and backward overlap the copy; the step waits for it
        ckpt.wait()
        handles.result()
        assert ckpt.versions()["local"] == list(range(8))
    for version, state in saved.items():
        for path in (_local(tmp_path, version), _durable(tmp_path, version)):
            assert_state_equal(_read(path), state)


def test_every_optimizer_step_is_a_fence_fused_ones_too(tmp_path: Path, gate: Gate) -> None:
    """A fused optimizer bumps no version counter of the parameters it writes: no check could
    see its step. While overlapped copies are in flight every optimizer step waits for them,
    with or without ``fence_before_step``."""
    t = Trainer(fused=True)
    t.step()
    with _ckpt(tmp_path) as ckpt:
        state = {"model": t.model.state_dict()}  # the model alone: no counter moves at all
        before = clone_state(state)
        versions = [p._version for p in t.model.parameters()]
        handle = ckpt.save(1, state)
        stepper = threading.Thread(target=t.step)
        stepper.start()
        stepper.join(timeout=0.3)
        assert stepper.is_alive(), "a fused optimizer step ran during the snapshot copy"
        gate.open()
        stepper.join()
        assert [p._version for p in t.model.parameters()] == versions  # indeed not bumped
        assert not torch.equal(t.model.state_dict()["0.weight"], before["model"]["0.weight"])
        handle.result()
    for path in (_local(tmp_path, 1), _durable(tmp_path, 1)):
        assert_state_equal(_read(path), before)


# --- tensors no counter watches -------------------------------------------------------------


def test_tensors_no_counter_watches_are_copied_before_save_returns(
    tmp_path: Path, gate: Gate
) -> None:
    """Inference tensors have no version counter, and numpy writes an array's memory behind
    torch's back: an overlapped save copies those while it runs, so a change right after it
    cannot reach the stored version (nor go unnoticed into it)."""
    with torch.inference_mode():
        frozen = torch.arange(1000, dtype=torch.float32)
    array = np.arange(1000, dtype=np.float64)
    live = torch.ones(1000)
    state = {"frozen": frozen, "array": array, "live": live}
    before = {"frozen": frozen.clone(), "array": array.copy(), "live": live.clone()}
    with _ckpt(tmp_path) as ckpt:
        handle = ckpt.save(1, state)
        with torch.inference_mode():
            frozen.add_(1.0)
        array += 1.0
        gate.open()
        handle.staged()
        handle.result()
    for path in (_local(tmp_path, 1), _durable(tmp_path, 1)):
        got = _read(path)
        assert_state_equal(got["frozen"], before["frozen"])
        assert_state_equal(got["live"], before["live"])
        np.testing.assert_array_equal(got["array"], before["array"])


# --- closing ----------------------------------------------------------------------------------


def test_closing_decides_what_no_fence_confirmed(tmp_path: Path) -> None:
    w = torch.arange(1 << 16, dtype=torch.float32)
    before = w.clone()
    # No fence at all, nothing changed: the close confirms it.
    with _ckpt(tmp_path, keep=10) as ckpt:
        handle = ckpt.save(1, {"w": w})
    handle.result()
    assert_state_equal(_read(_local(tmp_path, 1)), {"w": before})

    # Changed with no fence, leaving on an error: the bounded close fails it.
    def failing(version: int, *, change: bool) -> Any:
        with _ckpt(tmp_path, keep=10) as ckpt:
            ckpt.restore()
            handle = ckpt.save(version, {"w": w})
            if change:
                w.add_(1.0)
            raise RuntimeError(handle)

    with pytest.raises(RuntimeError) as info:
        failing(2, change=True)
    _assert_not_stored(tmp_path, info.value.args[0], cause=StateChanged)
    # Unchanged, leaving on an error: the bounded close still confirms it.
    kept = w.clone()
    with pytest.raises(RuntimeError) as info:
        failing(3, change=False)
    info.value.args[0].result()
    assert_state_equal(_read(_local(tmp_path, 3)), {"w": kept})
    # Closing without flushing decides nothing: the version is abandoned, stored nowhere.
    ckpt = _ckpt(tmp_path, keep=10)
    ckpt.restore()
    handle = ckpt.save(4, {"w": w})
    _staged(handle)
    ckpt.close(flush=False)
    for tier in handle.tiers:
        with pytest.raises(TierWriteFailed):
            handle.result(tier)
    assert not _local(tmp_path, 4).exists()
    assert not _durable(tmp_path, 4, "COMMIT").exists()
    with _ckpt(tmp_path) as again:
        restored = again.restore()
    assert restored is not None
    assert restored.version == 3
    assert_state_equal(restored.state, {"w": kept})


def test_the_async_checkpointer_confirms_where_its_caller_awaits(tmp_path: Path) -> None:
    async def main() -> Any:
        w = torch.arange(1 << 16, dtype=torch.float32)
        async with tiercheck.Checkpointer(
            "job",
            tiers=["local", "persistent"],
            local_root=tmp_path / "shm",
            persistent=(tmp_path / "durable").as_uri(),
            persist="all",
            overlap=True,
        ) as ckpt:
            handle = await ckpt.save(1, {"w": w})
            w.add_(1.0)
            await handle.staged_async()
            with pytest.raises(TierWriteFailed) as info:
                await handle.result_async()
            assert isinstance(info.value.__cause__, StateChanged)
            before = w.clone()
            handle = await ckpt.save(2, {"w": w})
            await handle.staged_async()
            w.add_(1.0)
            await handle.result_async()
            return before

    before = asyncio.run(main())
    assert_state_equal(_read(_local(tmp_path, 2)), {"w": before})
    assert not _local(tmp_path, 1).exists()


# --- real signals -----------------------------------------------------------------------------

CHILD = r"""
import os, signal, sys, time, torch
from tiercheck import SyncCheckpointer

root, url, mode = sys.argv[1:4]
w = torch.arange(1 << 16, dtype=torch.float32)
with SyncCheckpointer("job", tiers=["local", "persistent"], local_root=root, persistent=url,
                      persist="all", encodings={"persistent": "full"}, overlap=True) as ckpt:
    ckpt.save(1, {"w": w}).result()
    handle = ckpt.save(2, {"w": w})
    if mode != "int-clean":
        # An in-place kernel halfway through its writes: its counter moves when it returns.
        w.data[: w.numel() // 2].fill_(7.0)
    deadline = time.monotonic() + 30
    while not handle.is_staged and time.monotonic() < deadline:
        time.sleep(0.001)
    time.sleep(0.3)  # time enough for the pipeline to store the copy, if it would
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "int-torn":
        torch.autograd.graph.increment_version(w)  # the kernel returns
    print("interrupting", flush=True)
    os.kill(os.getpid(), signal.SIGINT)  # KeyboardInterrupt: `with` closes on the error
    time.sleep(30)
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize(("mode", "version"), [("kill", 1), ("int-torn", 1), ("int-clean", 2)])
def test_a_process_killed_or_interrupted_before_the_fence_stores_no_torn_version(
    tmp_path: Path, mode: str, version: int
) -> None:
    """SIGKILL while a torn copy waits for its fence: nothing of it was stored. SIGINT: the
    close on the way out is the last confirmation point -- torn, the version fails; untouched,
    it commits. Either way a new process restores a whole version, bit-exact."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    url = (tmp_path / "durable").as_uri()
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "shm"), url, mode],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    if mode == "kill":
        assert proc.returncode == -signal.SIGKILL, proc.stderr
    else:
        assert "interrupting" in proc.stdout, proc.stderr
        assert "KeyboardInterrupt" in proc.stderr, proc.stderr
    assert (version == 2) == _local(tmp_path, 2).exists()
    assert (version == 2) == _durable(tmp_path, 2, "COMMIT").exists()
    with _ckpt(tmp_path) as again:
        restored = again.restore()
    assert restored is not None
    assert restored.version == version
    assert_state_equal(restored.state, {"w": torch.arange(1 << 16, dtype=torch.float32)})
