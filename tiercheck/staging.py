"""Staging: copying the state to host memory -- the part of a save training waits for.

After a snapshot is *staged*, training may change its tensors at will: the checkpoint is a
private copy. The destination is either memory the local tier hands out (its shared-memory
file, so the local copy costs exactly one memcpy, see
:class:`~tiercheck.tiers.base.SupportsReserve`) or a buffer from a :class:`StagingPool`,
allocated once and reused save after save so the copy runs at memory speed instead of
page-fault speed. Where CUDA is present the pool's buffers are pinned, so device-to-host copies
are DMA transfers.

How a snapshot is copied (:class:`SnapshotCopy`):

* tensors in host memory: the :class:`~tiercheck.codec.plan.CopyProgram` of the state's cached
  plan (a handful of grouped copies, padding zeroed in the same calls), else
  :func:`~tiercheck.codec.write_payload`;
* tensors on a GPU: into a pinned, reused buffer, through typed views of it computed once per
  buffer, one ``torch._foreach_copy_(..., non_blocking=True)`` per device on a side stream that
  first waits for the work the caller had queued when it called ``save`` (an event recorded on
  the caller's current stream, see :func:`caller_marks`); an event on the side stream is the
  fence, waited for on the host before the bytes are read.

A blocking save waits for the copy before returning. An *overlapped* save returns as soon as the
copy is started and the copy runs on a worker thread (and the device's copy engine) while
training computes; :meth:`SnapshotCopy.wait` is the fence. Changing the state before the fence
is the caller's error; it is detected where torch's version counters show it (every in-place
torch operation bumps the counter of the tensor it writes, optimizer steps included): the
counters taken when ``save`` was called are compared with those once the copy is done, and a
difference makes the copy fail with :class:`~tiercheck.errors.StateChanged` -- the version is
then stored nowhere. Writes the counters do not see (through ``.data``, a numpy view, inside
some native kernels such as batch norm's running statistics) are not detected.
"""

from __future__ import annotations

import concurrent.futures
import operator
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from tiercheck.codec.plan import Flat
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
    """Events on the calling thread's current CUDA stream, by device index (``None``: no CUDA).

    Called where ``save`` is called: the snapshot's copies wait for them, so they see every
    operation the caller had queued (on any stream it made current), not only the default
    stream's. Cheap: one event record; nothing when CUDA was never initialized.
    """
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return None
    device = torch.cuda.current_device()
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(torch.cuda.current_stream(device))
    return {device: event}


def _versions(tensors: Sequence[torch.Tensor]) -> list[int]:
    try:
        return list(map(_VERSION, tensors))
    except RuntimeError:
        # Inference tensors have no version counter: they cannot be watched.
        return [-1 if t.is_inference() else t._version for t in tensors]


def _side_stream(index: int) -> Any:
    stream = _STREAMS.get(index)
    if stream is None:
        stream = _STREAMS[index] = torch.cuda.Stream(device=index)  # type: ignore[no-untyped-call]
    return stream


class SnapshotCopy:
    """One snapshot copy of a flattened state into ``dest`` (a host uint8 tensor).

    :meth:`run` does the copy in the calling thread, and resolves :attr:`done` (with the error,
    if it failed); :meth:`wait` blocks until then. ``cache`` is the :attr:`StagingBuffer.cache`
    of a reused destination buffer, where typed views of it are kept; ``watch`` takes the
    tensors' version counters now, to detect changes made before the copy is done.
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
        self.flat: Flat | None = flat
        self.dest = dest
        self.cache = cache
        self.marks = marks
        self.versions = _versions(flat.tensors) if watch else None
        #: Resolved once the bytes are in ``dest`` (or the copy failed).
        self.done: concurrent.futures.Future[None] = concurrent.futures.Future()

    def run(self) -> None:
        """Copy, wait for device copies to land, check the version counters; never raises
        (the outcome is in :attr:`done`)."""
        flat = self.flat
        assert flat is not None
        try:
            if flat.program is not None:
                flat.program.write(flat.tensors, self.dest)
            elif any(t.device.type != "cpu" for t in flat.tensors):
                self._device_copy(flat)
            else:
                flat.write(self.dest)
            if self.versions is not None and _versions(flat.tensors) != self.versions:
                changed = [
                    spec.path
                    for spec, before, now in zip(
                        flat.layout.specs, self.versions, _versions(flat.tensors), strict=True
                    )
                    if before != now
                ]
                raise StateChanged(
                    f"{len(changed)} tensor(s) of the state were modified before the snapshot "
                    f"was staged (e.g. {', '.join(changed[:3])}); the version is not stored. "
                    "Wait for the fence (handle.staged(), or fence_before_step / "
                    "fence_before_forward) before changing the state."
                )
        except BaseException as exc:
            self.done.set_exception(exc)
        else:
            self.done.set_result(None)
        finally:
            # The tensors are the caller's: do not keep them (or their memory) alive.
            self.flat = None
            self.marks = None

    def wait(self, timeout: float | None = None) -> None:
        """Block until the copy is done (the fence); never raises the copy's error."""
        concurrent.futures.wait([self.done], timeout)
        if not self.done.done():
            raise TimeoutError(f"the snapshot was not staged within {timeout} s")

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
                mark = (self.marks or {}).get(index)
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
