"""Each public call of a checkpointer, written once, as steps both faces drive.

A call (open, save, restore, wait, versions, close) is a generator: it does the caller's side
of the work itself and *yields* what must wait -- an engine coroutine, to run on the
checkpointer's private loop, or a :class:`Settle`, the wait for the overlapped snapshot copies
on the caller's side -- and gets each one's result (or exception) sent back in. The generator's
return value is the call's. :class:`~tiercheck.SyncCheckpointer` drives the steps with
:func:`drive` (blocking on each), :class:`~tiercheck.Checkpointer` with :func:`drive_async`
(awaiting each): one implementation, two faces, and no hop that a direct call would not make
(an engine coroutine is handed to the loop thread exactly once either way).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Generator
from dataclasses import dataclass
from typing import Any, TypeAlias, TypeVar

from tiercheck.consistency.keys import check_version
from tiercheck.engine import stateful
from tiercheck.engine.close import sigterm
from tiercheck.engine.engine import Engine
from tiercheck.engine.loop import LoopThread
from tiercheck.engine.options import CloseMode, Options
from tiercheck.engine.results import Restored, SaveHandle
from tiercheck.engine.save.stage import Stager
from tiercheck.engine.save.staging import caller_marks
from tiercheck.errors import ConfigError, StatefulError, TierClosed

__all__ = ["CallSteps", "Settle", "Step", "Steps", "drive", "drive_async", "restore_steps"]

logger = logging.getLogger("tiercheck")

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Settle:
    """A step on the caller's side: wait for the overlapped snapshot copies in flight and
    confirm them (a confirmation point, see :mod:`tiercheck.engine.save.staging`).

    :func:`drive` blocks in :meth:`Stager.settle` (a :class:`TimeoutError`, thrown into the
    steps, when ``timeout`` passes first); :func:`drive_async` awaits :meth:`Stager.asettle`
    (the copies not done by then stay pending), so an async caller's loop never blocks.
    """

    stager: Stager
    timeout: float | None = None


#: What a call's steps yield: an engine coroutine (run on the checkpointer's loop) or a
#: :class:`Settle` (on the caller's side).
Step: TypeAlias = Coroutine[Any, Any, Any] | Settle
#: A public call as steps, returning ``T`` (see the module docstring).
Steps: TypeAlias = Generator[Step, Any, T]


def drive(steps: Steps[T], call: Callable[[Coroutine[Any, Any, Any]], Any]) -> T:
    """Run ``steps`` to the end, blocking: each coroutine through ``call`` (the loop's
    :meth:`~tiercheck.engine.loop.LoopThread.call`), each :class:`Settle` on this thread;
    returns what they return. An exception of a step is thrown into the generator at that
    step."""
    result: Any = None
    error: BaseException | None = None
    while True:
        try:
            step = steps.send(result) if error is None else steps.throw(error)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        error = None
        try:
            if isinstance(step, Settle):
                step.stager.settle(wait=True, timeout=step.timeout)
                result = None
            else:
                result = call(step)
        except BaseException as exc:
            error = exc


async def drive_async(
    steps: Steps[T], run: Callable[[Coroutine[Any, Any, Any]], Awaitable[Any]]
) -> T:
    """:func:`drive` for an async caller: each coroutine is awaited through ``run`` (the loop's
    :meth:`~tiercheck.engine.loop.LoopThread.run`), each :class:`Settle` without blocking its
    loop."""
    result: Any = None
    error: BaseException | None = None
    while True:
        try:
            step = steps.send(result) if error is None else steps.throw(error)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        error = None
        try:
            if isinstance(step, Settle):
                await step.stager.asettle(step.timeout)
                result = None
            else:
                result = await run(step)
        except BaseException as exc:
            error = exc


def restore_steps(
    engine: Engine, state: Any, version: int | None, strict: bool
) -> Steps[Restored | None]:
    """The steps of :meth:`tiercheck.Checkpointer.restore` once open (collective, every rank
    alike).

    The caller's ``state`` is looked into (each ``Stateful`` object's ``state_dict()``) only
    once the ranks know that some version can be restored: on a fresh start nothing of the
    caller's runs, so a run with tiercheck computes exactly what it would without it (an
    optimizer whose ``state_dict`` initialises its moments is left untouched).
    """
    started = time.perf_counter()
    agreement = yield engine.restore_agree(version)
    if agreement is None:
        return None
    prepared = None
    try:
        prepared = None if state is None else stateful.for_restore(state)
    except Exception as exc:
        # Collective: the other ranks are about to read; they must refuse too, not wait.
        yield engine.restore_read(agreement, None, strict, started, failed=exc)
        raise  # restore_read raised already on every rank; this is only for the type checker
    target = None if prepared is None else prepared.target
    restored: Restored = yield engine.restore_read(agreement, target, strict, started)
    try:
        result: Restored | None = stateful.finish_restore(state, prepared, restored)
    except StatefulError as exc:
        # Collective: the other ranks must not go on training either.
        yield engine.loaded(str(exc))
        raise
    yield engine.loaded(None)
    return result


# Checkpointers whose loop runs: those still open at interpreter exit are closed then.
_LIVE: weakref.WeakSet[CallSteps] = weakref.WeakSet()
_exit_hook_installed = False


def _close_live_at_exit() -> None:
    """At interpreter exit, close every checkpointer its owner never closed (bounded: the
    saves in flight get ``close_timeout`` seconds, memory tiers first; no other rank is waited
    for). Without it, the interpreter would stop the pipeline mid-step, with asyncio warnings
    and tracebacks of work cut short."""
    for ckpt in list(_LIVE):
        ckpt._close_at_exit()


def _install_exit_hook() -> None:
    global _exit_hook_installed
    if _exit_hook_installed:
        return
    _exit_hook_installed = True
    # Before the thread pools refuse new work at exit (concurrent.futures registers its own
    # hook the same way, earlier, so this one runs first); atexit hooks run after that.
    register = getattr(threading, "_register_atexit", None)
    try:
        if register is not None:
            register(_close_live_at_exit)
            return
    except RuntimeError:  # the interpreter is already shutting down
        return
    import atexit

    atexit.register(_close_live_at_exit)


_ABANDONED = (
    "the checkpointer closed before the snapshot was copied and confirmed unchanged since save"
)


class CallSteps:
    """The steps of every public call, and the private loop they run on (started on first
    use); :class:`~tiercheck.engine.core.CheckpointerCore` adds the configuration.

    A face's method does nothing of its own (the async ``open``'s one check aside): it drives
    the steps, with :meth:`_drive` (blocking) or :meth:`_adrive` (awaiting). Each call's
    arguments are checked in its steps, before anything is opened or exchanged."""

    _config: Options
    _loop: LoopThread | None
    _engine: Engine | None
    _closed: bool

    # --- the two ways to drive them -----------------------------------------------------------

    def _call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        assert self._loop is not None  # a step yields a coroutine only once the loop runs
        return self._loop.call(coro)

    async def _run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        assert self._loop is not None
        return await self._loop.run(coro)

    def _drive(self, steps: Steps[T]) -> T:
        """Run ``steps`` blocking (the sync face)."""
        return drive(steps, self._call)

    async def _adrive(self, steps: Steps[T]) -> T:
        """Run ``steps`` awaiting each (the async face)."""
        return await drive_async(steps, self._run)

    # --- arguments, refused on this rank before anything is opened or exchanged ----------------

    @staticmethod
    def _check_save_args(version: object) -> None:
        """A bad version is refused before anything is opened, walked or exchanged."""
        check_version(version)

    @staticmethod
    def _check_restore_args(version: object, strict: object) -> None:
        """Refuse bad ``restore`` arguments on this rank before anything is opened or
        exchanged with the other ranks (which would otherwise wait on it)."""
        if version is not None:
            check_version(version)
        if not isinstance(strict, bool):
            raise ConfigError(f"strict must be True or False, got {strict!r}")

    @staticmethod
    def _check_close_args(flush: object, failed: object) -> None:
        """``close(flush="no")`` must not read as ``flush=True``."""
        for name, value in (("flush", flush), ("failed", failed)):
            if not isinstance(value, bool):
                raise ConfigError(f"{name} must be True or False, got {value!r}")

    # --- the public calls ----------------------------------------------------------------------

    def _open_steps(self) -> Steps[Engine]:
        """Open (on first use): tiers, manifest, coordination. A failed opening closes at once
        and re-raises; a closed checkpointer is :class:`TierClosed`."""
        _, engine = self._start()
        if not engine.opened:
            try:
                yield engine.open()
            except BaseException:
                yield from self._close_steps("now")
                raise
            if self._config.preemption.enabled:
                sigterm.watch(self)
        return engine

    def _save_steps(self, version: int, state: Any) -> Steps[SaveHandle]:
        """``save``: the caller's side (a confirmation point, the version counters, the state
        walked), then one hand-off of the engine's save to the loop."""
        self._check_save_args(version)
        self._settle()  # a confirmation point for the saves before (never waits)
        marks = caller_marks()
        engine = yield from self._open_steps()
        replicated_paths: list[tuple[Any, ...]] | None = [] if engine.leans else None
        state = stateful.for_save(
            state, engine.replica, replicated_paths
        )  # Stateful -> state_dict()
        handle: SaveHandle = yield engine.save(version, state, marks, replicated_paths)
        return handle

    def _prepare_steps(self, state: Any, version: int) -> Steps[int]:
        """``prepare``: the state walked as a save walks it, then the stager readies the room
        for its blob (:meth:`~tiercheck.engine.save.stage.Stager.prepare`, on the loop: the
        save's planner is the loop's)."""
        self._check_save_args(version)
        engine = yield from self._open_steps()
        replicated_paths: list[tuple[Any, ...]] | None = [] if engine.leans else None
        state = stateful.for_save(state, engine.replica, replicated_paths)
        readied: int = yield engine.stager.prepare(engine.planner, state, version)
        return readied

    def _restore_steps(
        self, state: Any, version: int | None, strict: bool
    ) -> Steps[Restored | None]:
        """``restore``: the copies in flight confirmed, then :func:`restore_steps`."""
        self._check_restore_args(version, strict)
        engine = yield from self._open_steps()
        yield Settle(engine.stager)
        return (yield from restore_steps(engine, state, version, strict))

    def _wait_steps(self) -> Steps[dict[str, int | None]]:
        """``wait``: the copies in flight confirmed, every save finished, the newest versions."""
        engine = yield from self._open_steps()
        yield Settle(engine.stager)
        yield engine.wait()
        newest: dict[str, int | None] = yield engine.newest()
        return newest

    def _versions_steps(self) -> Steps[dict[str, list[int]]]:
        """``versions``: what each tier holds, as known to this rank."""
        engine = yield from self._open_steps()
        versions: dict[str, list[int]] = yield engine.versions()
        return versions

    def _close_call_steps(self, flush: bool, failed: bool) -> Steps[None]:
        """``close``/``aclose``: the arguments checked, then :meth:`_close_steps`."""
        self._check_close_args(flush, failed)
        yield from self._close_steps("now" if not flush else "bounded" if failed else "collective")

    def _close_steps(self, how: CloseMode) -> Steps[None]:
        """Close (``how``: see :data:`~tiercheck.engine.options.CloseMode`); the loop thread
        stops whatever happens, and the checkpointer stays closed."""
        self._closed = True
        if self._loop is None or self._engine is None:
            return
        loop, engine = self._loop, self._engine
        try:
            yield from self._last_point(engine, how)
            yield engine.aclose(how)
        finally:
            sigterm.unwatch(self)
            loop.stop()
            self._loop = None

    # --- confirmation points (see tiercheck.engine.save.staging)
    # ------------------------------------------

    def _settle(self) -> None:
        """Confirm the overlapped copies that are done, waiting for none."""
        engine = self._engine
        if engine is not None:
            engine.stager.settle(wait=False)

    def _last_point(self, engine: Engine, how: CloseMode) -> Steps[None]:
        """Before closing: confirm what can be (the normal close waits for every copy; a close
        on an error waits ``close_timeout`` at most); every other overlapped save is abandoned."""
        try:
            if how != "now":
                bound = None if how == "collective" else self._config.coordination.close_timeout
                yield Settle(engine.stager, bound)
        except TimeoutError as exc:
            logger.warning("tiercheck: closing; snapshots still copying are abandoned: %s", exc)
        finally:
            engine.stager.abandon(_ABANDONED)

    # --- SIGTERM (see tiercheck.engine.close.sigterm)
    # -------------------------------------------------

    @property
    def preemption_grace(self) -> float:
        """The longest the flush on SIGTERM may take, in seconds (``preemption_grace``)."""
        return self._config.preemption.grace

    def _flush_on_sigterm(self, deadline: float) -> concurrent.futures.Future[Any] | None:
        """Start the flush on SIGTERM on the loop, to end by ``deadline`` (from the handler's
        thread, while training may still run: overlapped copies are confirmed only on the
        caller's side, so a version not confirmed yet is not flushed)."""
        engine, loop = self._engine, self._loop
        if self._closed or engine is None or loop is None or not engine.opened:
            return None
        return loop.submit(engine.preemption.flush(deadline))

    # --- lifecycle ----------------------------------------------------------------------------

    def _start(self) -> tuple[LoopThread, Engine]:
        job = self._config.job
        if self._closed:
            raise TierClosed(f"the checkpointer of job {job.job_id!r} is closed")
        if self._engine is None or self._loop is None:
            self._loop = LoopThread(f"tiercheck-{job.job_id}-r{job.topology.rank}")
            self._engine = Engine(self._config)
            _LIVE.add(self)
            _install_exit_hook()
        return self._loop, self._engine

    def _close_at_exit(self) -> None:
        """The interpreter is exiting and this checkpointer was never closed: close it,
        bounded (see :func:`_close_live_at_exit`)."""
        if self._closed or self._loop is None or self._engine is None:
            return
        logger.warning(
            "tiercheck: the checkpointer of job %r was never closed; closing it at exit "
            "(saves in flight get close_timeout=%s s)",
            self._config.job.job_id,
            self._config.coordination.close_timeout,
        )
        try:
            self._drive(self._close_steps("bounded"))
        except Exception:
            logger.exception(
                "tiercheck: closing the checkpointer of job %r at exit failed",
                self._config.job.job_id,
            )
