"""Daemon worker threads for blocking calls that may wait on other ranks.

A call that waits on another process -- a gloo collective on a coordination channel, a peer
tier's key-value store wait or point-to-point transfer -- can block until its timeout (minutes)
when that process is gone. :class:`concurrent.futures.ThreadPoolExecutor` (and with it
``asyncio.to_thread``) joins its threads when the interpreter exits, so one such call would
keep a finished or failing training process alive for the whole timeout. The executor here
runs calls on *daemon* threads instead: at exit nothing waits for them.

Only calls that are safe to abandon belong here (the result is no longer wanted once the
process is leaving); local file and compression work stays on ordinary executors.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

__all__ = ["DaemonExecutor"]

T = TypeVar("T")

_Item = tuple[concurrent.futures.Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class DaemonExecutor(concurrent.futures.Executor):
    """An executor of at most ``max_workers`` daemon threads, started on demand.

    Works with ``loop.run_in_executor``. Calls run in submission order; with one worker they
    also finish in that order (a coordination channel relies on it). ``shutdown(wait=True)``
    waits for queued and running calls for at most ``timeout`` seconds (default: for ever, like
    the standard executors); calls still blocked then are left to finish -- or not -- on their
    own daemon threads.
    """

    def __init__(self, max_workers: int, name: str) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be at least 1, got {max_workers}")
        self._max_workers = max_workers
        self._name = name
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._pending = 0  # calls queued or running
        self._shutdown = False

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        """Schedule ``fn(*args, **kwargs)`` on a daemon thread."""
        future: Future[T] = Future()
        with self._lock:
            if self._shutdown:
                raise RuntimeError(f"cannot schedule new calls: {self._name} is shut down")
            self._queue.put((future, fn, args, kwargs))
            self._pending += 1
            if self._pending > len(self._threads) and len(self._threads) < self._max_workers:
                thread = threading.Thread(
                    target=self._work, name=f"{self._name}-{len(self._threads)}", daemon=True
                )
                self._threads.append(thread)
                thread.start()
        return future

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn, args, kwargs = item
            del item
            if future.set_running_or_notify_cancel():
                try:
                    result = fn(*args, **kwargs)
                except BaseException as exc:  # handed to whoever waits on the future
                    future.set_exception(exc)
                else:
                    future.set_result(result)
            del future, fn, args, kwargs  # do not pin the last call's arguments while idle
            with self._lock:
                self._pending -= 1

    def shutdown(
        self, wait: bool = True, *, cancel_futures: bool = False, timeout: float | None = None
    ) -> None:
        """Refuse new calls; optionally cancel queued ones and wait (bounded) for the rest."""
        with self._lock:
            if not self._shutdown:
                self._shutdown = True
                if cancel_futures:
                    self._cancel_queued()
                for _ in self._threads:
                    self._queue.put(None)
            threads = list(self._threads)
        if not wait:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in threads:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            thread.join(left)

    def _cancel_queued(self) -> None:
        kept: list[_Item | None] = []
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
            kept.append(item)  # a cancelled call is skipped by the worker that takes it
        for item in kept:
            self._queue.put(item)

    @property
    def busy(self) -> bool:
        """Whether a call is queued or running."""
        with self._lock:
            return self._pending > 0
