"""SIGTERM: flush what only memory holds, then let the process end as it would have.

Schedulers preempt a job with SIGTERM and a grace period before SIGKILL (30 s by default in
Kubernetes and Slurm; torchrun forwards the signal to its workers and waits 30 s, its
``--shutdown-timeout``). Versions committed only in a node's memory would be lost with the
cluster; on SIGTERM, every checkpointer of the process opened with ``preemption=True`` makes the
newest of them durable (:mod:`tiercheck.engine.close.preempt`) within its ``preemption_grace``, and
the signal then goes on to the handler that was in place before:

- a Python function (an application's, a framework's) is called with it, on the main thread;
- ``SIG_IGN``: nothing more happens (the process goes on);
- ``SIG_DFL``: the default action, so that the process ends with SIGTERM's status -- unless a
  handler installed over this one called it (Lightning's calls the one it found): that one
  decides how the process ends.

The flush starts from the signal itself, not from the Python handler: Python runs signal
handlers on the main thread between two bytecodes only, and a main thread can be inside a
long C++ call -- a collective waiting for a rank that is itself waiting in its handler, or for
a rank that is gone. So the handler also installs a *wakeup fd* (:func:`signal.set_wakeup_fd`:
the interpreter's own C handler writes the signal's number there at once, from whatever thread
the kernel interrupts), read by a thread of its own that starts the flush; a wakeup fd that was
set before keeps getting every byte. When the flush ends:

- if the Python handler is running (the main thread waits in it), it chains as above;
- else, where the default action is next and this handler is the one installed, the process
  ends now, with SIGTERM's status, as it would have without any handler (the main thread is in
  a call that may never return);
- else the Python handler chains whenever the main thread gets to it.

Lifecycle, in order:

1. :func:`watch` -- a checkpointer opened: the handler (and wakeup fd) is installed the first
   time, from the main thread (Python installs them there only; off it, an INFO line says that
   no flush happens until a checkpointer opens on the main thread). A handler installed from C
   (``signal.getsignal`` answers ``None``) is never replaced: a WARNING says so.
2. SIGTERM: one flush of every watched checkpointer, all at once, each within its own grace; a
   second SIGTERM during it starts nothing more. Nothing raises out of the handler but what the
   previous handler raises.
3. :func:`unwatch` -- a checkpointer closed: once the last one is closed, the previous handler
   and wakeup fd are put back -- from the main thread, and only while this handler is still the
   one installed (another installed over it may call it: with nothing watched, it only passes
   the signal on).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import logging
import os
import signal
import threading
import time
import weakref
from types import FrameType
from typing import Any, Literal, Protocol

__all__ = ["SLACK", "Watched", "installed", "unwatch", "watch"]

logger = logging.getLogger("tiercheck")

#: Seconds the handler waits beyond the longest grace before it gives up on the flush.
SLACK = 1.0


class Watched(Protocol):
    """What the handler needs of a checkpointer (:class:`~tiercheck.engine.steps.CallSteps`)."""

    @property
    def preemption_grace(self) -> float:
        """The longest its flush may take, in seconds."""
        ...

    def _flush_on_sigterm(self, deadline: float) -> concurrent.futures.Future[Any] | None:
        """Start its flush, to end by ``deadline`` (a :func:`time.monotonic` time); ``None``
        when it has nothing to flush."""
        ...


_lock = threading.Lock()
# The checkpointers watched, as a tuple of weak references the handler and the threads read
# without a lock (the main thread may hold it when the signal interrupts it).
_watched: tuple[weakref.ref[Any], ...] = ()
_handler: _Handler | None = None
_flusher: _Flusher | None = None
# What was said at INFO already (once per process; DEBUG afterwards).
_said = {"off-main": False}


def _members() -> list[Watched]:
    return [m for ref in _watched if (m := ref()) is not None]


class _Flusher:
    """The flush of one SIGTERM (an *episode*), its threads, and the wakeup fd. One per
    process, made with the first handler: starting a thread in a handler would take locks the
    interrupted main thread may hold."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.phase: Literal["idle", "flushing", "done"] = "idle"
        self.started = 0.0
        self.wait_s = 0.0
        self._asked = threading.Event()
        self._done = threading.Event()
        #: The wakeup fd's pipe; the fd that was set before ours (``-1``: none).
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.write_fd, False)
        self.forward_fd = -1
        for target, name in ((self._serve, "tiercheck-sigterm"), (self._read, "tiercheck-wakeup")):
            threading.Thread(target=target, name=name, daemon=True).start()

    def start(self) -> None:
        """Start this SIGTERM's flush, unless it started already (from either side)."""
        with self._lock:
            if self.phase != "idle":
                return
            members = _members()
            self.phase = "flushing"
            self.started = time.monotonic()
            self.wait_s = max((m.preemption_grace for m in members), default=0.0) + SLACK
            self._done.clear()
        if members:
            logger.info(
                "tiercheck: SIGTERM: making the newest version in memory durable (at most %.0f s)",
                self.wait_s - SLACK,
            )
        self._asked.set()

    def wait(self) -> None:
        """Wait for the flush, until its longest grace (plus :data:`SLACK`) has passed."""
        left = self.started + self.wait_s - time.monotonic()
        if not self._done.wait(max(0.0, left)):
            logger.warning(
                "tiercheck: SIGTERM: the flush did not end within its grace; the signal goes on"
            )

    def end_episode(self) -> None:
        """The handler passed the signal on: the next SIGTERM flushes anew."""
        with self._lock:
            if self.phase == "done":
                self.phase = "idle"

    def _serve(self) -> None:
        while True:
            self._asked.wait()
            self._asked.clear()
            try:
                _flush_all(self.started)
            except Exception:
                logger.exception("tiercheck: SIGTERM: the flush failed")
            with self._lock:
                self.phase = "done"
                self._done.set()
            handler = _handler
            if handler is not None:
                handler.after_flush()

    def _read(self) -> None:
        """The wakeup fd: start the flush the moment SIGTERM arrives; pass every byte on to
        the wakeup fd that was set before."""
        while True:
            try:
                data = os.read(self.read_fd, 512)
            except InterruptedError:
                continue
            if self.forward_fd >= 0:
                try:
                    os.write(self.forward_fd, data)
                except OSError as exc:
                    logger.debug("tiercheck: passing a signal on to the wakeup fd: %r", exc)
            if signal.SIGTERM in data and _members():
                self.start()


class _Handler:
    """The SIGTERM handler: flush, then give the signal to the handler in place before."""

    def __init__(self, previous: Any, flusher: _Flusher) -> None:
        #: The handler in place before: a callable, ``SIG_IGN`` or ``SIG_DFL``.
        self.previous = previous
        self.flusher = flusher
        #: Whether the main thread is in this handler now.
        self.running = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if self.running:
            return  # a second SIGTERM while the first one's flush runs
        self.running = True
        try:
            self.flusher.start()
            self.flusher.wait()
        finally:
            self.running = False
            self.flusher.end_episode()
            self._chain(signum, frame)

    def ends_process(self) -> bool:
        """Whether the signal goes on to the default action from here."""
        return self.previous == signal.SIG_DFL and installed()

    def after_flush(self) -> None:
        """On the flush's thread, once it ended: where the main thread is not in the handler
        and the default action is next, end the process now, as it would have ended."""
        if not self.running and self.ends_process():
            _die_by_sigterm()

    def _chain(self, signum: int, frame: FrameType | None) -> None:
        """Give the signal to the handler that was in place before."""
        previous = self.previous
        if callable(previous):
            previous(signum, frame)
        elif self.ends_process():
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.raise_signal(signal.SIGTERM)


def _flush_all(started: float) -> None:
    """Start every watched checkpointer's flush, then wait for each until its deadline."""
    running = []
    for member in _members():
        deadline = started + member.preemption_grace
        try:
            future = member._flush_on_sigterm(deadline)
        except Exception:
            logger.exception("tiercheck: SIGTERM: starting a checkpointer's flush failed")
            continue
        if future is not None:
            running.append((future, deadline))
    for future, deadline in running:
        try:
            future.result(max(0.0, deadline + SLACK - time.monotonic()))
        except concurrent.futures.TimeoutError:
            logger.warning("tiercheck: SIGTERM: a checkpointer's flush did not end in its grace")
        except Exception:
            logger.exception("tiercheck: SIGTERM: a checkpointer's flush failed")


def _die_by_sigterm() -> None:
    """End the process with SIGTERM's default action, from any thread (Python changes a
    signal's disposition from the main thread only; the C library does from any)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal.restype = ctypes.c_void_p
        libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
        libc.signal(signal.SIGTERM, None)  # SIG_DFL is the null handler
    except (OSError, AttributeError) as exc:
        # Then the main thread ends it when it gets to the Python handler.
        logger.warning("tiercheck: SIGTERM: cannot restore the default action here: %r", exc)
        return
    os.kill(os.getpid(), signal.SIGTERM)


def installed() -> bool:
    """Whether tiercheck's SIGTERM handler is the one installed now."""
    return _handler is not None and signal.getsignal(signal.SIGTERM) is _handler


def watch(member: Watched) -> None:
    """``member`` opened: flush it on SIGTERM (installing the handler where it can)."""
    global _watched, _handler, _flusher
    with _lock:
        alive = [ref for ref in _watched if ref() is not None and ref() is not member]
        _watched = (*alive, weakref.ref(member))
        if _handler is not None and callable(signal.getsignal(signal.SIGTERM)):
            # Installed, or maybe in the chain of a handler installed over it (one that put
            # SIG_DFL or SIG_IGN back has dropped it: it is installed anew below).
            return
        if threading.current_thread() is not threading.main_thread():
            (logger.debug if _said["off-main"] else logger.info)(
                "tiercheck: no SIGTERM handler yet: this checkpointer opened off the main "
                "thread, and Python installs signal handlers from the main thread only; what "
                "only memory holds is flushed on SIGTERM once a checkpointer opens there"
            )
            _said["off-main"] = True
            return
        previous = signal.getsignal(signal.SIGTERM)
        if previous is None:
            logger.warning(
                "tiercheck: SIGTERM has a handler installed outside Python; tiercheck leaves it "
                "in place and does not flush on SIGTERM"
            )
            return
        if _flusher is None:
            _flusher = _Flusher()
        handler = _Handler(previous, _flusher)
        signal.signal(signal.SIGTERM, handler)
        before = signal.set_wakeup_fd(_flusher.write_fd, warn_on_full_buffer=False)
        if before != _flusher.write_fd:  # (ours still, when a handler dropped ours was left)
            _flusher.forward_fd = before
        _handler = handler


def unwatch(member: Watched) -> None:
    """``member`` closed: once none is left, put the previous handler back where it can."""
    global _watched, _handler
    with _lock:
        _watched = tuple(ref for ref in _watched if ref() is not None and ref() is not member)
        handler, flusher = _handler, _flusher
        if _watched or handler is None or flusher is None:
            return
        if threading.current_thread() is not threading.main_thread():
            logger.debug(
                "tiercheck: the SIGTERM handler stays (the last close is off the main thread)"
            )
            return
        current = signal.set_wakeup_fd(flusher.forward_fd)
        if current != flusher.write_fd:
            signal.set_wakeup_fd(current)  # set by someone after us: theirs stays
        else:
            flusher.forward_fd = -1
        if installed():
            signal.signal(signal.SIGTERM, handler.previous)
            _handler = None
        # Else another handler was installed over this one and may call it: it stays, and with
        # nothing watched it only passes the signal on.
