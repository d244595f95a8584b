"""Staging: copying the state to host memory -- the part of a save training waits for.

After a snapshot is *staged*, training may change its tensors at will: the checkpoint is a
private copy. The destination is either memory the local tier hands out (its shared-memory
file, so the local copy costs exactly one memcpy, see
:class:`~tiercheck.tiers.base.SupportsReserve`) or a buffer from a :class:`StagingPool`,
allocated once and reused save after save so the copy runs at memory speed instead of
page-fault speed. Where CUDA is present the pool's buffers are pinned, so device-to-host copies
are DMA transfers.

How a snapshot is copied (:class:`SnapshotCopy`):

* tensors in host memory: the :class:`~tiercheck.codec.encode.plan.CopyProgram` of the state's
  cached plan (a handful of grouped copies, padding zeroed in the same calls), else
  :func:`~tiercheck.codec.write_payload`;
* tensors on a GPU: into a pinned, reused buffer, through typed views of it computed once per
  buffer, one ``torch._foreach_copy_(..., non_blocking=True)`` per device on a side stream that
  first waits for the work the caller had queued on its current stream (an event recorded
  there, see :func:`caller_marks`); an event on the side stream is the fence, waited for on the
  host before the bytes are read.

A blocking save waits for the copy before returning. An *overlapped* save returns as soon as the
copy is started and the copy runs on a worker thread (and the device's copy engine) while
training computes; :meth:`SnapshotCopy.wait` is the fence.

Changing the state before the fence is the caller's error, and it must never leave a torn copy
stored. It is caught through torch's version counters (every in-place torch operation bumps
the counter of the tensor it writes, and of every view sharing its memory). Torch bumps a
counter *after* the in-place kernel ran (on the host) or was launched (on a GPU): the bump is
the last step of the operation's ``ADInplaceOrView`` kernel. So a check made on a worker thread
once its copy is done can read the old counter while the tensor is half written; only a check
made on the training side, at a point every earlier in-place call has returned from, sees every
change. Hence two steps:

* ``save`` reads the counters before anything is copied (and only then records the CUDA events
  the copy waits for, on the caller's stream: whatever the counters show already is in the
  copy; anything the copy may race with bumps a counter after this read);
* a *confirmation point* compares them again once the copy is done (:meth:`SnapshotCopy.
  confirm`): the fence (``handle.staged()``, ``ckpt.fence()``, the hooks below, and every
  optimizer step while a copy is pending, see :class:`~tiercheck.engine.save.stage.Stager`), the
  next ``save``, ``wait()``, ``restore()``, ``close()``, ``handle.result()`` and
  ``handle.result_async()``. Equal: the version is confirmed. Different: it fails with
  :class:`~tiercheck.errors.StateChanged`. Until then no tier makes it restorable (memory tiers do
  not receive its blob, no tier commits it); a close decides what is left (confirmed where
  the copy is done, abandoned where it is not).

Tensors whose changes no counter shows are copied privately while ``save`` runs instead:
inference tensors (they have no counter) and tensors made from numpy arrays (numpy writes their
memory without torch knowing). Not seen at all: writes through ``.data`` or through a numpy view
of a tensor (``t.numpy()``), kernels that write a tensor without bumping it (batch norm's
running statistics: its ``num_batches_tracked``, bumped first in the same forward, is seen
where it is saved), and writes by another thread made while the fence is passed.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import operator
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from tiercheck.codec.encode.plan import Flat
from tiercheck.errors import ConfigError, StateChanged

__all__ = [
    "SnapshotCopy",
    "StagingBuffer",
    "StagingPool",
    "caller_marks",
    "fence_before_forward",
    "fence_before_step",
]

_VERSION = operator.attrgetter("_version")

#: One side stream per CUDA device, for snapshot copies.
_STREAMS: dict[int, Any] = {}


def caller_marks() -> dict[int, Any] | None:
    """The calling thread's current CUDA stream, by device index (``None``: no CUDA).

    Called where ``save`` is called. The snapshot records an event on each of these streams
    once it has read the state's version counters, and its copies wait for those events: they
    see every operation the caller had queued (on any stream it made current), not only the
    default stream's. Cheap: nothing when CUDA was never initialized.
    """
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return None
    device = torch.cuda.current_device()
    return {device: torch.cuda.current_stream(device)}


def _versions(tensors: Sequence[torch.Tensor]) -> list[int]:
    """The tensors' version counters; -1 for a tensor that has none (an inference tensor)."""
    try:
        return list(map(_VERSION, tensors))
    except RuntimeError:
        return [-1 if t.is_inference() else t._version for t in tensors]


def _record(streams: dict[int, Any] | None) -> dict[int, Any] | None:
    """An event on each of the caller's streams, recorded now (from this thread)."""
    if not streams:
        return None
    events = {}
    for index, stream in streams.items():
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(stream)
        events[index] = event
    return events


def _private_copies(flat: Flat, indexes: Sequence[int], streams: dict[int, Any] | None) -> Flat:
    """``flat`` with the tensors at ``indexes`` replaced by copies of them, made now.

    A copy of a tensor on a GPU is queued on the caller's stream (where it has one), so it is
    ordered after what the caller queued before ``save`` and before what it queues after.
    """
    tensors = list(flat.tensors)
    with torch.no_grad():
        for i in indexes:
            t = tensors[i]
            stream = None
            if t.device.type == "cuda":
                stream = (streams or {}).get(
                    t.device.index if t.device.index is not None else torch.cuda.current_device()
                )
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                tensors[i] = t.clone()
    return dataclasses.replace(flat, tensors=tensors)


def _side_stream(index: int) -> Any:
    stream = _STREAMS.get(index)
    if stream is None:
        stream = _STREAMS[index] = torch.cuda.Stream(device=index)  # type: ignore[no-untyped-call]
    return stream


def _running() -> concurrent.futures.Future[None]:
    """A future nobody can cancel (an asyncio wrapper of it being cancelled must not)."""
    fut: concurrent.futures.Future[None] = concurrent.futures.Future()
    fut.set_running_or_notify_cancel()
    return fut


class SnapshotCopy:
    """One snapshot copy of a flattened state into ``dest`` (a host uint8 tensor).

    :meth:`run` does the copy in the calling thread, and resolves :attr:`done` (with the error,
    if it failed); :meth:`wait` blocks until then. ``cache`` is the :attr:`StagingBuffer.cache`
    of a reused destination buffer, where typed views of it are kept; ``marks`` are the
    caller's CUDA streams (:func:`caller_marks`). ``watch`` (an overlapped save) reads the
    tensors' version counters now, copies the tensors no counter watches now (see the module
    docstring), and keeps the state's tensors until :meth:`confirm` compares the counters again;
    :attr:`confirmed` is resolved then. Without ``watch`` (a blocking save, whose caller waits
    for the copy) it is resolved with :attr:`done`.
    """

    def __init__(
        self,
        flat: Flat,
        dest: torch.Tensor,
        *,
        cache: dict[str, Any] | None = None,
        marks: dict[int, Any] | None = None,
        watch: bool = False,
    ) -> None:
        self.dest = dest
        self.cache = cache
        self.specs = flat.layout.specs
        #: The state's tensors and their counters when ``save`` was called (until confirmed).
        self.watched: list[torch.Tensor] | None = None
        self.versions: list[int] | None = None
        if watch:
            versions = _versions(flat.tensors)
            private = sorted({i for i, v in enumerate(versions) if v < 0}.union(flat.untracked))
            if private:
                flat = _private_copies(flat, private, marks)
                for i in private:  # nothing else holds the copies: their counters stay put
                    versions[i] = flat.tensors[i]._version
            self.watched = list(flat.tensors)
            self.versions = versions
        self.flat: Flat | None = flat
        # After the counters were read: see the module docstring.
        self.events = _record(marks)
        #: Resolved once the bytes are in ``dest`` (or the copy failed): the fence.
        self.done = _running()
        #: Resolved once the caller confirmed the state unchanged since ``save`` (or with why
        #: not: :class:`StateChanged`, the copy's own error, an abandoned save).
        self.confirmed = _running()
        self._lock = threading.Lock()

    def run(self) -> None:
        """Copy, wait for device copies to land, check the version counters; never raises
        (the outcome is in :attr:`done`, and for a blocking copy in :attr:`confirmed`)."""
        flat = self.flat
        assert flat is not None
        try:
            if flat.program is not None:
                flat.program.write(flat.tensors, self.dest)
            elif any(t.device.type != "cpu" for t in flat.tensors):
                self._device_copy(flat)
            else:
                flat.write(self.dest)
            # A change the counters show already is certain (an unchanged reading is not:
            # only a confirmation point can tell, see confirm).
            changed = self._changed()
            if changed:
                raise self._state_changed(changed)
        except BaseException as exc:
            self.done.set_exception(exc)
            self._settle(exc)
        else:
            self.done.set_result(None)
            if self.versions is None:
                self._settle(None)  # a blocking copy: its caller waited for it
        finally:
            # The tensors are the caller's: do not keep them (or their memory) alive here;
            # ``watched`` keeps them until the confirmation only.
            self.flat = None
            self.events = None

    def confirm(self) -> None:
        """A confirmation point: compare the counters with those read at ``save``.

        Call it only where every in-place change the caller made to the state before has
        returned (on the training thread, or a thread that waited for it): see the module
        docstring. Once the copy is done, equal counters confirm the version and different ones
        fail it; while the copy runs, different counters fail it and equal ones decide nothing.
        Never raises.
        """
        if self.confirmed.done():
            return
        copied = self.done.done()  # read before the counters: a copy done after is not trusted
        changed = self._changed()
        if changed:
            self._settle(self._state_changed(changed))
        elif copied:
            self._settle(None)

    def abandon(self, why: BaseException) -> None:
        """Fail the version with ``why`` unless it is confirmed already."""
        self._settle(why)

    def wait(self, timeout: float | None = None) -> None:
        """Block until the copy is done (the fence); never raises the copy's error."""
        concurrent.futures.wait([self.done], timeout)
        if not self.done.done():
            raise TimeoutError(f"the snapshot was not staged within {timeout} s")

    def _changed(self) -> list[str]:
        """Paths of the watched tensors whose counters moved since ``save``."""
        with self._lock:
            watched, versions = self.watched, self.versions
        if watched is None or versions is None:
            return []
        now = _versions(watched)
        if now == versions:
            return []
        return [
            spec.path
            for spec, before, after in zip(self.specs, versions, now, strict=True)
            if before != after
        ]

    def _state_changed(self, paths: list[str]) -> StateChanged:
        return StateChanged(
            f"{len(paths)} tensor(s) of the state were modified between save and the fence "
            f"(e.g. {', '.join(paths[:3])}); the version is not stored. Pass the fence "
            "(handle.staged(), ckpt.fence(), or install fence_before_step / "
            "fence_before_forward) before changing the state."
        )

    def _settle(self, error: BaseException | None) -> None:
        with self._lock:
            if self.confirmed.done():
                return
            # Decided: the caller's tensors are no longer needed.
            self.watched = None
            self.versions = None
            if error is None:
                self.confirmed.set_result(None)
            else:
                self.confirmed.set_exception(error)

    def _views(self, flat: Flat) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        layout = flat.layout
        cached = None if self.cache is None else self.cache.get("views")
        if cached is not None and cached[0] is layout.specs:
            return cached[1], cached[2]
        views = layout.views(self.dest)
        gaps = [self.dest[a:b] for a, b in layout.gaps]
        if self.cache is not None:
            self.cache["views"] = (layout.specs, views, gaps)
        return views, gaps

    def _device_copy(self, flat: Flat) -> None:
        """Tensors on a GPU (and maybe some on the host) into a (pinned) host buffer."""
        views, gaps = self._views(flat)
        with torch.no_grad():
            if gaps:
                torch._foreach_zero_(gaps)
            groups: dict[torch.device, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
            for view, src, spec in zip(views, flat.tensors, flat.layout.specs, strict=True):
                if src.dtype != spec.dtype or tuple(src.shape) != spec.shape:
                    raise ValueError(
                        f"tensor at {spec.path} is {src.dtype}{tuple(src.shape)}; the layout "
                        f"expects {spec.dtype}{spec.shape}"
                    )
                if spec.nbytes:
                    dst_list, src_list = groups.setdefault(src.device, ([], []))
                    dst_list.append(view)
                    src_list.append(src)
            events = []
            for device, (dst_list, src_list) in groups.items():
                if device.type != "cuda":
                    torch._foreach_copy_(dst_list, src_list)
                    continue
                index = device.index if device.index is not None else torch.cuda.current_device()
                stream = _side_stream(index)
                mark = (self.events or {}).get(index)
                with torch.cuda.device(index), torch.cuda.stream(stream):
                    if mark is not None:
                        stream.wait_event(mark)
                    else:
                        stream.wait_stream(torch.cuda.default_stream(index))
                    torch._foreach_copy_(dst_list, src_list, non_blocking=True)
                    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                    event.record(stream)
                events.append(event)
            for event in events:
                event.synchronize()


# --- fences for a plain training loop ------------------------------------------------------------


class _Fenceable(Protocol):
    """What the fence helpers need from a checkpointer (both kinds have it)."""

    def fence(self, timeout: float | None = None) -> None: ...


def fence_before_step(ckpt: _Fenceable, optimizer: torch.optim.Optimizer) -> Any:
    """Make ``optimizer.step()`` wait until every snapshot ``ckpt`` is copying is staged.

    Registers an optimizer step pre-hook (``Optimizer.register_step_pre_hook``); returns its
    handle (``.remove()`` undoes it). With overlapped saves this is the only change a plain
    loop needs, provided nothing else writes the saved tensors in place between ``save`` and
    ``optimizer.step()``: see :func:`fence_before_forward` for models whose forward does
    (batch norm's running statistics), and call ``ckpt.fence()`` yourself before any other
    in-place change (an EMA update, a gradient scaler's state, weights edited by hand).

    An open checkpointer with ``overlap=True`` also fences every optimizer's step by itself
    while one of its copies is pending (a global step pre-hook: fused optimizers write without
    bumping version counters, so no check could see their step); this hook says so for
    ``optimizer`` explicitly.
    """

    _check_fence_args(ckpt, optimizer, "register_step_pre_hook", "a torch.optim.Optimizer")

    def hook(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
        ckpt.fence()

    return optimizer.register_step_pre_hook(hook)


def fence_before_forward(ckpt: _Fenceable, module: torch.nn.Module) -> Any:
    """Make every ``module(...)`` call wait until every snapshot ``ckpt`` is copying is staged.

    A forward pre-hook (``Module.register_forward_pre_hook``); returns its handle. For models
    whose forward changes saved tensors in place (``BatchNorm``'s running mean and variance,
    ``num_batches_tracked``): the snapshot then overlaps only what runs between ``save`` and
    the next forward (data loading, logging, evaluation), not the backward pass.
    """

    _check_fence_args(ckpt, module, "register_forward_pre_hook", "a torch.nn.Module")

    def hook(_module: Any, _args: Any) -> None:
        ckpt.fence()

    return module.register_forward_pre_hook(hook)


def _check_fence_args(ckpt: object, target: object, method: str, what: str) -> None:
    """A wrong argument is refused when the hook is installed, not at the next step."""
    if not callable(getattr(ckpt, "fence", None)):
        raise ConfigError(f"expected a checkpointer (with a fence() method), got {ckpt!r}")
    if not callable(getattr(target, method, None)):
        raise ConfigError(f"expected {what} (with {method}), got {target!r}")


# --- buffers -------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class StagingBuffer:
    """A buffer lent by a :class:`StagingPool`: ``data`` is exactly the size asked for.

    ``cache`` lives as long as the pooled buffer does: what is derived from the buffer and
    worth keeping across saves (typed views of it) goes there, and goes with it.
    """

    data: torch.Tensor
    storage: torch.Tensor
    cache: dict[str, Any]


class StagingPool:
    """Host buffers allocated once and reused; pinned where CUDA is present.

    ``acquire`` returns the smallest free buffer large enough (growing the pool only when none
    is), ``release`` gives it back. At most ``max_free`` idle buffers are kept, so memory stays
    bounded by the number of buffers in use plus ``max_free``.
    """

    def __init__(self, *, pin: bool | None = None, max_free: int = 2) -> None:
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.max_free = max_free
        self._free: list[torch.Tensor] = []
        self._caches: dict[int, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self.allocated_bytes = 0

    def acquire(self, nbytes: int) -> StagingBuffer:
        """A uint8 buffer of exactly ``nbytes`` (a view of a possibly larger pooled buffer)."""
        with self._lock:
            fits = [b for b in self._free if b.numel() >= nbytes]
            if fits:
                buf = min(fits, key=lambda b: b.numel())
                self._take(buf)
                return StagingBuffer(buf[:nbytes], buf, self._caches[id(buf)])
        # Headroom so a state that grows a little (optimizer state appearing) reuses the buffer.
        capacity = max(nbytes + nbytes // 8, 4096)
        buf = torch.empty(capacity, dtype=torch.uint8, pin_memory=self.pin)
        with self._lock:
            self.allocated_bytes += capacity
            cache = self._caches[id(buf)] = {}
        return StagingBuffer(buf[:nbytes], buf, cache)

    def release(self, lent: StagingBuffer) -> None:
        """Give a buffer returned by :meth:`acquire` back to the pool."""
        with self._lock:
            self._free.append(lent.storage)
            while len(self._free) > self.max_free:
                dropped = max(self._free, key=lambda b: b.numel())
                self._take(dropped)
                self._caches.pop(id(dropped), None)
                self.allocated_bytes -= dropped.numel()

    def _take(self, buf: torch.Tensor) -> None:
        """Under the lock: remove ``buf`` itself from the free list.

        By identity: ``list.remove`` compares with ``==``, which for tensors compares elements
        (and raises when the sizes differ, or when it cannot make one bool of the result).
        """
        index = next(i for i, b in enumerate(self._free) if b is buf)
        del self._free[index]

    def clear(self) -> None:
        """Drop every idle buffer."""
        with self._lock:
            for b in self._free:
                self.allocated_bytes -= b.numel()
                self._caches.pop(id(b), None)
            self._free.clear()
