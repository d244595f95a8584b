"""Staging: the overlapped snapshot and its fence, the fence hooks, staging buffers.

An overlapped save (``overlap=True``) returns before its copy; these tests hold the copy back
with a gate, so what may or may not happen before the fence is decided by the test, not by
timing: the fence must not return while the copy is held, and every stored byte must be the
value the state had when ``save`` was called.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import tiercheck
from tests.helpers import TinyTrainer, assert_state_equal, clone_state
from tiercheck import Checkpointer, ConfigError, StateChanged, SyncCheckpointer, TierWriteFailed
from tiercheck.codec import decode, flatten, unflatten
from tiercheck.codec.encode.plan import Planner
from tiercheck.engine.save.staging import SnapshotCopy, StagingPool


class Gate:
    """Holds every snapshot copy until opened (``SnapshotCopy.run`` waits for it)."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.copies = 0

    def open(self) -> None:
        self.event.set()


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    g = Gate()
    original = SnapshotCopy.run

    def gated(self: SnapshotCopy) -> None:
        g.copies += 1
        # Bounded: a test that fails while a copy is held must not hang its teardown.
        g.event.wait(timeout=30)
        original(self)

    monkeypatch.setattr(SnapshotCopy, "run", gated)
    try:
        yield g
    finally:
        g.open()  # never leave a copy (and the checkpointer closing after it) hanging


def _ckpt(tmp_path: Path, **kw: Any) -> SyncCheckpointer:
    kw.setdefault("tiers", ["local"])
    kw.setdefault("local_root", tmp_path / "shm")
    kw.setdefault("persistent", (tmp_path / "durable").as_uri())
    kw.setdefault("keep", 100)
    return SyncCheckpointer("job", **kw)


def _stored(tmp_path: Path, version: int) -> Any:
    """The state stored in the local tier as ``version``, read from its file."""
    [path] = [p for p in (tmp_path / "shm").rglob(f"v{version:012d}/r*.full") if p.is_file()]
    raw = decode(bytearray(path.read_bytes()))
    return raw.state()


def _scribble(state: Any) -> None:
    """Change every tensor of ``state`` in place (as an optimizer step would)."""
    with torch.no_grad():
        for t in _tensors(state):
            if t.is_floating_point():
                t.add_(1.0)
            else:
                t.add_(1)


def _tensors(state: Any) -> list[torch.Tensor]:
    return flatten(state)[1]


def test_a_blocking_save_is_staged_when_it_returns(tmp_path: Path) -> None:
    t = TinyTrainer()
    t.step()
    with _ckpt(tmp_path) as ckpt:
        handle = ckpt.save(1, t.state())
        assert handle.is_staged
        handle.staged(timeout=0)
        ckpt.fence(timeout=0)
        assert handle.stats.staged_s == handle.stats.stall_s


def test_the_fence_waits_for_the_copy_and_the_bytes_are_the_saved_ones(
    tmp_path: Path, gate: Gate
) -> None:
    t = TinyTrainer()
    t.step()
    with _ckpt(tmp_path, overlap=True) as ckpt:
        before = clone_state(t.state())
        handle = ckpt.save(1, t.state())
        assert not handle.is_staged  # the copy is held: save returned before it
        with pytest.raises(TimeoutError):
            handle.staged(timeout=0.05)
        with pytest.raises(TimeoutError):
            ckpt.fence(timeout=0.05)
        gate.open()
        handle.staged()
        assert handle.is_staged
        # Right after the fence: change every tensor of the live state.
        _scribble(t.state())
        ckpt.wait()
        handle.result("local")
        assert handle.stats.staged_s is not None
        assert handle.stats.stall_s <= handle.stats.staged_s
    assert_state_equal(_stored(tmp_path, 1), before)
    with _ckpt(tmp_path) as again:
        restored = again.restore()
    assert restored is not None
    assert restored.version == 1
    assert_state_equal(restored.state, before)


async def test_the_async_fence_waits_without_blocking_the_loop(tmp_path: Path, gate: Gate) -> None:
    """``await ckpt.fence_async()`` is the fence for the asyncio face: the event loop runs on
    while the copy is held, and it returns once the copy is done."""
    t = TinyTrainer()
    t.step()
    async with Checkpointer(
        "job", tiers=["local"], local_root=tmp_path / "shm", overlap=True, keep=100
    ) as ckpt:
        before = clone_state(t.state())
        handle = await ckpt.save(1, t.state())
        fence = asyncio.ensure_future(ckpt.fence_async())
        ticks = 0
        while ticks < 5:  # the loop is free while the fence waits for the held copy
            await asyncio.sleep(0.01)
            ticks += 1
        assert not fence.done()
        assert not handle.is_staged
        gate.open()
        await asyncio.wait_for(fence, 30)
        assert handle.is_staged
        _scribble(t.state())
        await handle.result_async("local")
    assert_state_equal(_stored(tmp_path, 1), before)


def test_changing_the_state_before_the_fence_fails_the_version(tmp_path: Path, gate: Gate) -> None:
    t = TinyTrainer()
    t.step()
    with _ckpt(tmp_path, overlap=True) as ckpt:
        handle = ckpt.save(1, t.state())
        _scribble(t.state())  # the caller's error: weights edited before the fence
        gate.open()
        handle.staged()  # the fence itself does not raise
        with pytest.raises(TierWriteFailed, match="not be staged") as info:
            handle.result("local")
        assert isinstance(info.value.__cause__, StateChanged)
        assert 1 not in ckpt.versions()["local"]
        assert ckpt.stats.committed.get("local", 0) == 0
        # The next save, fenced properly, is stored.
        before = clone_state(t.state())
        handle = ckpt.save(2, t.state())
        handle.staged()
        t.step()
        handle.result("local")
    assert_state_equal(_stored(tmp_path, 2), before)


def test_the_optimizer_hook_makes_a_plain_loop_safe(tmp_path: Path, gate: Gate) -> None:
    t = TinyTrainer()
    t.step()
    with _ckpt(tmp_path, overlap=True) as ckpt:
        hook = tiercheck.fence_before_step(ckpt, t.opt)
        saved = {}
        for version in range(1, 4):
            saved[version] = clone_state(t.state())
            ckpt.save(version, t.state())
            # The next step (forward, backward, optimizer step) runs in another thread: it
            # must stop at the optimizer step while the copy is held.
            stepper = threading.Thread(target=t.step)
            stepper.start()
            stepper.join(timeout=0.2)
            assert stepper.is_alive(), "optimizer.step() ran before the snapshot was staged"
            gate.event.set()
            stepper.join()
            gate.event.clear()
        gate.open()
        ckpt.wait()
        # Without the hook the step waits all the same: while a checkpointer with overlapped
        # saves is open, every optimizer step is a fence (fused optimizers write without
        # bumping version counters, so a step during the copy could not be caught).
        hook.remove()
        gate.event.clear()
        saved[10] = clone_state(t.state())
        ckpt.save(10, t.state())
        stepper = threading.Thread(target=t.step)
        stepper.start()
        stepper.join(timeout=0.2)
        assert stepper.is_alive(), "optimizer.step() ran before the snapshot was staged"
        gate.open()
        stepper.join()
        ckpt.wait()
    for version, state in saved.items():
        assert_state_equal(_stored(tmp_path, version), state)


def test_the_forward_hook_protects_batch_norm_statistics(tmp_path: Path, gate: Gate) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    model(torch.randn(8, 4))
    with _ckpt(tmp_path, overlap=True) as ckpt:
        tiercheck.fence_before_forward(ckpt, model)
        before = clone_state(model.state_dict())
        ckpt.save(1, model.state_dict())
        forward = threading.Thread(target=model, args=(torch.randn(8, 4),))
        forward.start()
        forward.join(timeout=0.2)
        assert forward.is_alive(), "the forward pass ran before the snapshot was staged"
        gate.open()
        forward.join()
        assert not torch.equal(model.state_dict()["1.running_mean"], before["1.running_mean"])
        ckpt.wait()
    assert_state_equal(_stored(tmp_path, 1), before)


def test_back_pressure_still_applies_to_overlapped_saves(tmp_path: Path, gate: Gate) -> None:
    t = TinyTrainer()
    t.step()
    with _ckpt(tmp_path, overlap=True, on_busy="skip") as ckpt:
        first = ckpt.save(1, t.state())
        second = ckpt.save(2, t.state())  # the first is still copying: skipped
        assert second.skipped
        assert second.is_staged  # nothing to wait for
        gate.open()
        first.staged()
        ckpt.wait()
        first.result("local")
        assert ckpt.stats.skipped == 1


def test_a_repeating_state_reuses_its_plan_in_the_checkpointer(tmp_path: Path) -> None:
    t = TinyTrainer()
    t.step()
    with _ckpt(tmp_path) as ckpt:
        saved = {}
        for version in range(1, 5):
            saved[version] = clone_state(t.state())
            ckpt.save(version, t.state())
            t.step()
        ckpt.wait()
        assert ckpt.stats.layouts_planned == 1
        assert ckpt.stats.layouts_reused == 3
    for version, state in saved.items():
        assert_state_equal(_stored(tmp_path, version), state)


# --- SnapshotCopy and the pool ----------------------------------------------------------------


def test_a_snapshot_copy_reports_its_failure_without_raising() -> None:
    state = {"a": torch.ones(4)}
    flat = Planner().flatten(state)
    copy = SnapshotCopy(flat, torch.empty(3, dtype=torch.uint8))  # too small
    copy.run()
    copy.wait()
    assert isinstance(copy.done.exception(), ValueError)
    assert copy.flat is None  # the caller's tensors are not kept


def test_tensors_without_counters_are_copied_when_the_copy_is_made() -> None:
    """Inference tensors have no version counter and numpy writes behind torch's back: a
    watched copy takes them at once, so a change before it runs cannot reach it."""
    with torch.inference_mode():
        frozen = torch.ones(3)
    array = np.ones(3)
    state = {"frozen": frozen, "array": array, "live": torch.ones(3)}
    flat = Planner().flatten(state)
    assert flat.untracked == (1,)  # the array; the inference tensor is found by its counter
    dest = torch.empty(flat.layout.payload_nbytes, dtype=torch.uint8)
    copy = SnapshotCopy(flat, dest, watch=True)
    with torch.inference_mode():
        frozen.add_(1.0)
    array += 1.0
    copy.run()
    copy.confirm()
    assert copy.confirmed.exception() is None
    stored = unflatten(flat.layout, flat.layout.views(dest))
    assert torch.equal(stored["frozen"], torch.ones(3))
    np.testing.assert_array_equal(stored["array"], np.ones(3))


def _watched(w: torch.Tensor) -> SnapshotCopy:
    flat = Planner().flatten({"w": w})
    dest = torch.empty(flat.layout.payload_nbytes, dtype=torch.uint8)
    return SnapshotCopy(flat, dest, watch=True)


def test_only_the_callers_check_after_the_copy_confirms_it() -> None:
    copy = _watched(torch.zeros(1000))
    copy.confirm()  # not copied yet, and unchanged: nothing is decided
    assert not copy.confirmed.done()
    copy.run()
    # Done and unchanged, as far as the worker can tell: that proves nothing (the counter of
    # a tensor being written moves only when the kernel returns).
    assert copy.done.exception() is None
    assert not copy.confirmed.done()
    copy.confirm()
    assert copy.confirmed.result() is None
    assert copy.watched is None  # decided: the caller's tensors are let go


def test_a_change_seen_before_the_copy_ends_fails_it_at_once() -> None:
    w = torch.zeros(1000)
    copy = _watched(w)
    w.add_(1.0)
    copy.confirm()  # a moved counter is certain, copied or not
    assert isinstance(copy.confirmed.exception(), StateChanged)
    copy.run()  # the copy still runs (the fence waits for it); the verdict stays
    assert isinstance(copy.confirmed.exception(), StateChanged)
    again = _watched(w)
    again.run()
    w[::2].mul_(2.0)  # through a view: views share their base's counter
    again.confirm()
    assert isinstance(again.confirmed.exception(), StateChanged)


def test_a_blocking_copy_is_confirmed_by_its_end() -> None:
    flat = Planner().flatten({"w": torch.zeros(10)})
    copy = SnapshotCopy(flat, torch.empty(flat.layout.payload_nbytes, dtype=torch.uint8))
    copy.run()
    assert copy.confirmed.result() is None


def test_pool_caches_live_and_die_with_their_buffer() -> None:
    pool = StagingPool(pin=False, max_free=0)
    lent = pool.acquire(1000)
    lent.cache["views"] = "derived"
    pool.release(lent)  # max_free=0: the buffer is dropped, and its cache with it
    again = pool.acquire(1000)
    assert again.cache == {}
    pool.release(again)
    assert pool.allocated_bytes == 0


def test_buffers_of_different_sizes_come_and_go_in_any_order() -> None:
    """Taking a buffer that is not the first free one, and dropping the largest one when more
    than max_free are idle, work whatever the sizes (free buffers are told apart by identity,
    never by comparing their elements)."""
    pool = StagingPool(pin=False, max_free=2)
    lent = [pool.acquire(n) for n in (10_000, 20_000, 30_000)]
    storages = [b.storage for b in lent]
    assert pool.allocated_bytes == sum(s.numel() for s in storages)
    for buffer in lent:  # the third release drops the largest idle buffer: not the first one
        pool.release(buffer)
    assert pool.allocated_bytes == storages[0].numel() + storages[1].numel()
    again = pool.acquire(15_000)  # fits the second free buffer only
    assert again.storage is storages[1]
    assert again.data.numel() == 15_000
    same = pool.acquire(5_000)
    assert same.storage is storages[0]
    pool.release(again)
    pool.release(same)
    equal = [pool.acquire(4096) for _ in range(2)]  # buffers of one size, equal contents
    for buffer in equal:
        buffer.data.zero_()
    for buffer in equal:
        pool.release(buffer)
    assert pool.allocated_bytes == storages[0].numel() + storages[1].numel()


# --- CUDA -------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("overlap", [False, True])
def test_cuda_snapshot_is_the_state_at_save_time(tmp_path: Path, overlap: bool) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64).cuda()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 64, device="cuda")).sum().backward()
    opt.step()
    with _ckpt(tmp_path, overlap=overlap) as ckpt:
        tiercheck.fence_before_step(ckpt, opt)
        saved = {}
        for version in range(1, 4):
            state = {"model": model.state_dict(), "optim": opt.state_dict()}
            saved[version] = clone_state(state)
            ckpt.save(version, state)
            model(torch.randn(8, 64, device="cuda")).sum().backward()
            opt.step()  # waits for the copy (the hook)
        ckpt.wait()
    for version, state in saved.items():
        stored = _stored(tmp_path, version)
        assert_state_equal(stored, clone_state(_to_cpu(state)))


@pytest.mark.cuda
@cuda
def test_cuda_snapshot_waits_for_work_queued_on_the_callers_stream(tmp_path: Path) -> None:
    x = torch.zeros(1 << 22, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # x is made on the default stream
    with _ckpt(tmp_path, overlap=True) as ckpt:
        with torch.cuda.stream(side):
            x.fill_(3.0)  # queued on the caller's (non-default) stream
            handle = ckpt.save(1, {"x": x})
        handle.staged()
        torch.cuda.synchronize()
        x.fill_(5.0)
        ckpt.wait()
    assert torch.equal(_stored(tmp_path, 1)["x"], torch.full((1 << 22,), 3.0))


def _to_cpu(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return state.detach().cpu()
    if isinstance(state, dict):
        return {k: _to_cpu(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_to_cpu(v) for v in state)
    return state


def test_a_fence_hook_refuses_what_cannot_carry_it(tmp_path: Path) -> None:
    """Wrong arguments fail when the hook is installed, not at the next optimizer step."""
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = tiercheck.SyncCheckpointer(
        "job", local_root=tmp_path / "shm", persistent=(tmp_path / "d").as_uri()
    )
    for call in (
        lambda: tiercheck.fence_before_step(ckpt, model),  # a module is no optimizer
        lambda: tiercheck.fence_before_step(opt, opt),  # an optimizer is no checkpointer
        lambda: tiercheck.fence_before_forward(ckpt, opt),
        lambda: tiercheck.fence_before_forward(ckpt, 3),
    ):
        with pytest.raises(ConfigError, match="expected"):
            call()  # type: ignore[no-untyped-call]
    tiercheck.fence_before_step(ckpt, opt).remove()


def test_an_overlapped_snapshot_goes_with_its_save_without_the_garbage_collector(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A snapshot kept alive by a reference cycle holds the buffer it copied into until the
    # collector runs: every save then maps and faults a fresh buffer (found profiling #23).
    made: list[weakref.ref[SnapshotCopy]] = []
    original = SnapshotCopy.__init__

    def tracked(self: SnapshotCopy, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        made.append(weakref.ref(self))

    monkeypatch.setattr(SnapshotCopy, "__init__", tracked)
    t = TinyTrainer()
    t.step()
    gc.collect()
    gc.disable()
    try:
        with _ckpt(tmp_path, overlap=True) as ckpt:
            for version in range(6):
                ckpt.save(version, t.state())
                ckpt.fence()
                t.step()
            ckpt.wait()
            alive = [r for r in made if r() is not None]
    finally:
        gc.enable()
    assert len(made) == 6
    assert alive == [], f"{len(alive)} of 6 snapshots outlived their saves"
