"""Daemon worker threads: calls that may wait on a dead rank never hold the process at exit."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading

import pytest

from tiercheck._threads import DaemonExecutor


def test_calls_run_in_order_on_daemon_threads() -> None:
    ex = DaemonExecutor(1, "t")
    seen: list[int] = []
    futures = [ex.submit(seen.append, i) for i in range(20)]
    threads = ex.submit(threading.current_thread).result(timeout=30)
    for f in futures:
        f.result(timeout=30)
    assert seen == list(range(20))
    assert threads.daemon
    ex.shutdown()


def test_errors_reach_the_caller() -> None:
    ex = DaemonExecutor(2, "t")
    with pytest.raises(ZeroDivisionError):
        ex.submit(lambda: 1 / 0).result(timeout=30)
    ex.shutdown()


def test_a_blocked_call_does_not_starve_the_next_while_workers_are_left() -> None:
    ex = DaemonExecutor(2, "t")
    release = threading.Event()
    blocked = ex.submit(release.wait)
    assert ex.submit(lambda: "done").result(timeout=30) == "done"
    assert not blocked.done()
    assert ex.busy
    release.set()
    assert blocked.result(timeout=30) is True
    ex.shutdown()
    assert not ex.busy


def test_shutdown_waits_at_most_its_timeout_and_refuses_new_calls() -> None:
    ex = DaemonExecutor(1, "t")
    release = threading.Event()
    blocked = ex.submit(release.wait)
    queued = ex.submit(lambda: "never")
    ex.shutdown(wait=True, cancel_futures=True, timeout=0.2)  # returns although blocked
    assert queued.cancelled()
    assert not blocked.done()
    with pytest.raises(RuntimeError):
        ex.submit(lambda: None)
    release.set()
    assert blocked.result(timeout=30) is True


async def test_it_serves_run_in_executor() -> None:
    ex = DaemonExecutor(1, "t")
    assert await asyncio.get_running_loop().run_in_executor(ex, sum, [1, 2, 3]) == 6
    ex.shutdown()


EXITS = r"""
import threading, sys
from tiercheck._threads import DaemonExecutor
ex = DaemonExecutor(1, "stuck")
ex.submit(threading.Event().wait)  # waits for ever, like a store wait on a dead host
print("leaving", flush=True)
"""

STAYS = r"""
import threading, sys
from concurrent.futures import ThreadPoolExecutor
ex = ThreadPoolExecutor(1)
ex.submit(threading.Event().wait)
print("leaving", flush=True)
"""


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_process_with_a_blocked_call_still_exits() -> None:
    """The reason for the class: a standard executor's blocked worker holds the process at exit
    (shown by the control case, which is still running when the bound passes)."""
    done = subprocess.run(
        [sys.executable, "-c", EXITS], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "leaving"
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run([sys.executable, "-c", STAYS], capture_output=True, timeout=5, check=False)
