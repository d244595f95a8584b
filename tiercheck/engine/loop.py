"""A private event loop on its own thread, where the checkpointer's background pipeline runs.

Training code is either synchronous (most of it) or has an event loop that only turns between
training steps. Either way, a pipeline that ran on the caller's loop would stall whenever the
caller computes. On a loop of its own it advances all the time; callers reach it through
thread-safe futures.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["LoopThread"]

T = TypeVar("T")

# Rounds of cancelling what is left on a stopping loop (each round's clean-up may start tasks).
_CANCEL_ROUNDS = 20


class LoopThread:
    """An asyncio loop running forever on a daemon thread until :meth:`stop`."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()
        self._ready.wait()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._ready.set)
        try:
            self.loop.run_forever()
        finally:
            # Cancelling a task may start others (a cancelled save's clean-up): cancel until
            # none is left, so that none runs into the executors closed below, and none is
            # destroyed pending (asyncio's "Task was destroyed but it is pending!").
            for _ in range(_CANCEL_ROUNDS):
                pending = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
                if not pending:
                    break
                for task in pending:
                    task.cancel()
                self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.run_until_complete(self.loop.shutdown_default_executor())
            self.loop.close()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop; the returned future is safe to wait on from any thread."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and block the calling thread for its result."""
        if threading.current_thread() is self.thread:
            coro.close()
            raise RuntimeError("LoopThread.call from its own thread would deadlock")
        return self.submit(coro).result(timeout)

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and await its result from another event loop."""
        return await asyncio.wrap_future(self.submit(coro))

    def stop(self) -> None:
        """Stop the loop (cancelling what is left on it) and join the thread."""
        if self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join()
