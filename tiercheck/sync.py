"""The checkpointer for code without an event loop: same behaviour, blocking calls.

The pipeline runs on the checkpointer's private loop thread either way, so a synchronous
training loop gets the same background behaviour as an async one: ``save`` blocks only for the
snapshot copy. Each call here and its async twin are one implementation: the steps of
:class:`~tiercheck.engine.steps.CallSteps`, blocked on here, awaited there.
"""

from __future__ import annotations

from typing import Any

from tiercheck.engine.core import CheckpointerCore
from tiercheck.engine.results import Restored, SaveHandle

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
        self._drive(self._open_steps())
        return self

    def prepare(self, state: Any, *, version: int = 0) -> int:
        """Ready the memory the first save of ``state`` will be copied into, ahead of it, in
        the background; see :meth:`Checkpointer.prepare`."""
        return self._drive(self._prepare_steps(state, version))

    def save(self, version: int, state: Any) -> SaveHandle:
        """Snapshot ``state`` as ``version``; returns once training may modify it again
        (with ``overlap=True``: once the copy is started; see :meth:`SaveHandle.staged`)."""
        return self._drive(self._save_steps(version, state))

    def restore(
        self, state: Any = None, *, version: int | None = None, strict: bool = True
    ) -> Restored | None:
        """Restore the newest version every rank can rebuild; see :meth:`Checkpointer.restore`."""
        return self._drive(self._restore_steps(state, version, strict))

    def wait(self) -> dict[str, int | None]:
        """Block until every save so far is committed or failed in each of its tiers.

        Returns the newest version committed in each tier by then (``None`` where none is):
        ``ckpt.wait()["persistent"]`` is the newest durable version.
        """
        return self._drive(self._wait_steps())

    def versions(self) -> dict[str, list[int]]:
        """Versions committed in each tier, as known to this rank."""
        return self._drive(self._versions_steps())

    def close(self, *, flush: bool = True, failed: bool = False) -> None:
        """Finish the saves in flight, then release everything; see
        :meth:`Checkpointer.aclose` (collective; ``flush=False`` waits for nothing;
        ``failed=True`` for a rank leaving on an error: bounded, no agreement)."""
        self._drive(self._close_call_steps(flush, failed))

    def __enter__(self) -> SyncCheckpointer:
        return self.open()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        # On an exception the other ranks may be failing too: no agreement, a bounded flush.
        self._drive(self._close_steps("collective" if exc_type is None else "bounded"))
