"""The distributed coordinator: exchanges, a channel that reconnects after a rank stopped for
longer than the timeout, and a close that never waits on a channel in flight."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from tests.consistency.coordinator_worker import QUEUED, TIMEOUT_S
from tests.distributed._launch import free_port
from tiercheck.consistency.coordinator import SoloCoordinator, TorchCoordinator


@pytest.fixture
def one_rank() -> Iterator[None]:
    """A gloo job of one rank, in this process (the coordinator needs an initialized group)."""
    if dist.is_initialized():
        pytest.skip("torch.distributed is already initialized in this process")
    store = dist.HashStore()  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_exchanges_work_and_nothing_is_broken(one_rank: None) -> None:
    coordinator = TorchCoordinator(["control", "local"])
    assert coordinator.all_gather("control", b"abc") == [b"abc"]
    assert coordinator.all_gather("local", b"") == [b""]
    assert coordinator.broken is None
    coordinator.close()


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_channel_reconnects_after_a_rank_stopped_past_the_timeout(tmp_path: Path) -> None:
    """Two real ranks; rank 1 is stopped (SIGSTOP) for longer than the timeout, then continued.
    gloo closes the channel's connections when rank 0's exchange times out, so that group can
    never exchange again: the channel connects anew, and both ranks exchange on it again,
    with each other's messages. The other channel, unused meanwhile, is unaffected."""
    port = free_port()
    worker = Path(__file__).with_name("coordinator_worker.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), str(rank), str(port), str(tmp_path)],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        deadline = time.monotonic() + 60
        while not any(e["e"] == "ready" for e in _events(tmp_path, 1)):
            assert time.monotonic() < deadline, "rank 1 never got ready"
            time.sleep(0.02)
        procs[1].send_signal(signal.SIGSTOP)
        time.sleep(3 * TIMEOUT_S)
        procs[1].send_signal(signal.SIGCONT)
        continued = time.time()
        errors = [p.communicate(timeout=60)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], errors
    ends = {rank: _events(tmp_path, rank) for rank in range(2)}
    for rank, events in ends.items():
        outcomes = [(e["e"], e.get("channel")) for e in events if e["e"] in ("ok", "failed")]
        # first exchange works; the one across the pause fails; the last two work
        assert outcomes[0] == ("ok", "local"), (rank, outcomes)
        assert outcomes[1] == ("failed", "local"), (rank, outcomes)
        assert outcomes[-2:] == [("ok", "local"), ("ok", "control")], (rank, outcomes)
        local = [e for e in events if e["e"] == "ok" and e["channel"] == "local"]
        assert local[-1]["got"] == ["again0", "again1"], (rank, local[-1])
        assert local[-1]["broken"] is None, "a channel that works again is not broken"
        failed = [e for e in events if e["e"] == "failed"]
        assert all(e["broken"] for e in failed), "a channel that failed says so"
        recovered = local[-1]["t"] - continued
        print(f"rank {rank} exchanged again {recovered:.1f}s after rank 1 continued")
        assert recovered < 10 * TIMEOUT_S


@pytest.mark.multiprocess
def test_calls_queued_behind_a_rank_that_is_gone_fail_within_one_timeout(tmp_path: Path) -> None:
    """Two real ranks; rank 1 dies after an exchange, and rank 0 makes QUEUED more calls on the
    channel, as the commit rounds queued behind it would. The first fails when gloo sees the
    rank gone; the others wait for a reconnection only until a timeout after the channel broke,
    so all of them together take about one timeout -- before, each waited a whole one (chaos
    soak seed 6104: a close held for a minute by twelve queued rounds)."""
    port = free_port()
    worker = Path(__file__).with_name("coordinator_worker.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), str(rank), str(port), str(tmp_path), "gone"],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        errors = [p.communicate(timeout=120)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert procs[0].returncode == 0, errors[0]
    events = _events(tmp_path, 0)
    assert events[-1]["e"] == "done", events
    calls = [e for e in events if e["e"] in ("ok", "failed")]
    assert calls[0]["e"] == "ok"
    queued = calls[1:]
    assert len(queued) == QUEUED
    assert all(e["e"] == "failed" and e["broken"] for e in queued), queued
    # The first one fails on the dead rank, the next waits for a reconnection that never comes,
    # the rest fail at once: well under the QUEUED timeouts the old waits added up to.
    after_first = sum(e["took"] for e in queued[1:])
    print(f"{QUEUED - 1} calls after the first failure took {after_first:.2f}s in all")
    assert after_first < (QUEUED - 1) * TIMEOUT_S / 2, [e["took"] for e in queued]
    assert any("has not reconnected it" in e["error"] for e in queued[1:]), queued


def _events(out: Path, rank: int) -> list[dict[str, Any]]:
    path = out / f"r{rank}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def test_close_leaves_a_group_whose_exchange_is_in_flight(one_rank: None) -> None:
    """Destroying a gloo group waits for its running collective; a channel still exchanging
    (a rank died mid-exchange) is left alone so that close never waits on it."""
    coordinator = TorchCoordinator(["control", "local"])
    busy = coordinator._locks["local"]
    busy.acquire()  # as an exchange in flight holds it
    try:
        done = threading.Event()
        closer = threading.Thread(target=lambda: (coordinator.close(), done.set()), daemon=True)
        closer.start()
        assert done.wait(60), "close waited on the busy channel"
        assert list(coordinator._groups) == ["local"]
    finally:
        busy.release()
    coordinator.close()
    assert coordinator._groups == {}


def test_the_solo_coordinator_is_never_broken() -> None:
    assert SoloCoordinator().broken is None
