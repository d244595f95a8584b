"""The checkpointer for code without an event loop: same behaviour, blocking calls.

The pipeline runs on the checkpointer's private loop thread either way, so a synchronous
training loop gets the same background behaviour as an async one: ``save`` blocks only for the
snapshot copy.
"""

from __future__ import annotations

from typing import Any

from tiercheck import stateful
from tiercheck.engine.core import CheckpointerCore, drive, restore_steps
from tiercheck.engine.options import CloseMode
from tiercheck.engine.results import Restored, SaveHandle
from tiercheck.staging import caller_marks

__all__ = ["SyncCheckpointer"]


class SyncCheckpointer(CheckpointerCore):
    """A blocking :class:`~tiercheck.Checkpointer`; takes exactly the same arguments.

    Example::

        with tiercheck.SyncCheckpointer("run-1", persistent="file:///data/ckpt") as ckpt:
            restored = ckpt.restore(state)           # None on a fresh start
            for step in range(start, steps):
                train_step()
                handle = ckpt.save(step, state)      # returns after the snapshot copy
            handle.result("persistent")              # optionally wait for durability
    """

    def open(self) -> SyncCheckpointer:
        """Open tiers, manifest and coordination (done on first use if not called)."""
        loop, engine = self._start()
        if not engine.opened:
            try:
                loop.call(engine.open())
            except BaseException:
                self._close("now")
                raise
        return self

    def save(self, version: int, state: Any) -> SaveHandle:
        """Snapshot ``state`` as ``version``; returns once training may modify it again
        (with ``overlap=True``: once the copy is started; see :meth:`SaveHandle.staged`)."""
        self._check_save_args(version)
        self._settle(wait=False)  # a confirmation point for the saves before (never waits)
        marks = caller_marks()
        loop, engine = self.open()._start()
        held: list[tuple[Any, ...]] | None = [] if engine.leans else None
        state = stateful.for_save(state, engine.replica, held)  # Stateful -> state_dict()
        return loop.call(engine.save(version, state, marks, held))

    def restore(
        self, state: Any = None, *, version: int | None = None, strict: bool = True
    ) -> Restored | None:
        """Restore the newest version every rank can rebuild; see :meth:`Checkpointer.restore`."""
        self._check_restore_args(version, strict)
        loop, engine = self.open()._start()
        self._settle(wait=True)
        result: Restored | None = drive(restore_steps(engine, state, version, strict), loop.call)
        return result

    def wait(self) -> dict[str, int | None]:
        """Block until every save so far is committed or failed in each of its tiers.

        Returns the newest version committed in each tier by then (``None`` where none is):
        ``ckpt.wait()["persistent"]`` is the newest durable version.
        """
        loop, engine = self.open()._start()
        self._settle(wait=True)
        loop.call(engine.wait())
        return loop.call(engine.newest())

    def versions(self) -> dict[str, list[int]]:
        """Versions committed in each tier, as known to this rank."""
        loop, engine = self.open()._start()
        return loop.call(engine.versions())

    def close(self, *, flush: bool = True, failed: bool = False) -> None:
        """Finish the saves in flight, then release everything; see
        :meth:`Checkpointer.aclose` (collective; ``flush=False`` waits for nothing;
        ``failed=True`` for a rank leaving on an error: bounded, no agreement)."""
        self._check_close_args(flush, failed)
        self._close("now" if not flush else "bounded" if failed else "collective")

    def _close(self, how: CloseMode) -> None:
        self._closed = True
        if self._loop is None or self._engine is None:
            return
        loop, engine = self._loop, self._engine
        try:
            self._last_point(how)
            loop.call(engine.aclose(how))
        finally:
            loop.stop()
            self._loop = None

    def __enter__(self) -> SyncCheckpointer:
        return self.open()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        # On an exception the other ranks may be failing too: no agreement, a bounded flush.
        self._close("collective" if exc_type is None else "bounded")
