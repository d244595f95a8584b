"""Staging: the one part of a save that blocks training -- copying the state to host memory.

After :func:`snapshot` returns, training may change its tensors at will: the checkpoint is a
private copy. The destination is either memory the local tier hands out (its shared-memory
file, so the local copy costs exactly one memcpy, see
:class:`~tiercheck.tiers.base.SupportsReserve`) or a buffer from a :class:`StagingPool`,
allocated once and reused save after save so the copy runs at memory speed instead of
page-fault speed. Where CUDA is present the pool's buffers are pinned, so device-to-host copies
are DMA transfers.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tiercheck.codec import Layout, write_payload

__all__ = ["StagingBuffer", "StagingPool", "snapshot"]


def snapshot(layout: Layout, tensors: Sequence[torch.Tensor], dest: torch.Tensor) -> None:
    """Copy ``tensors`` into the uint8 buffer ``dest`` laid out as ``layout`` and wait for it.

    Copies from CUDA tensors are issued asynchronously and then synchronized once, so a state
    spread over many tensors costs one wait, not one per tensor.
    """
    write_payload(layout, tensors, dest)
    devices = {t.device for t in tensors if t.device.type == "cuda"}
    for device in devices:
        torch.cuda.synchronize(device)


@dataclass(frozen=True, eq=False)
class StagingBuffer:
    """A buffer lent by a :class:`StagingPool`: ``data`` is exactly the size asked for."""

    data: torch.Tensor
    storage: torch.Tensor


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
        self._lock = threading.Lock()
        self.allocated_bytes = 0

    def acquire(self, nbytes: int) -> StagingBuffer:
        """A uint8 buffer of exactly ``nbytes`` (a view of a possibly larger pooled buffer)."""
        with self._lock:
            fits = [b for b in self._free if b.numel() >= nbytes]
            if fits:
                buf = min(fits, key=lambda b: b.numel())
                self._free.remove(buf)
                return StagingBuffer(buf[:nbytes], buf)
        # Headroom so a state that grows a little (optimizer state appearing) reuses the buffer.
        capacity = max(nbytes + nbytes // 8, 4096)
        buf = torch.empty(capacity, dtype=torch.uint8, pin_memory=self.pin)
        with self._lock:
            self.allocated_bytes += capacity
        return StagingBuffer(buf[:nbytes], buf)

    def release(self, lent: StagingBuffer) -> None:
        """Give a buffer returned by :meth:`acquire` back to the pool."""
        with self._lock:
            self._free.append(lent.storage)
            while len(self._free) > self.max_free:
                dropped = max(self._free, key=lambda b: b.numel())
                self._free.remove(dropped)
                self.allocated_bytes -= dropped.numel()

    def clear(self) -> None:
        """Drop every idle buffer."""
        with self._lock:
            for b in self._free:
                self.allocated_bytes -= b.numel()
            self._free.clear()
