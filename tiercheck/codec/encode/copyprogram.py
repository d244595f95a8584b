"""Write a payload in few calls: the copy program of a layout whose tensors are on the host.

:func:`~.flatten.write_payload` copies tensor by tensor; with thousands of tensors (a model with
AdamW brings ``exp_avg``, ``exp_avg_sq`` and a 0-dim ``step`` per parameter) that Python work
costs more than copying the bytes. A :class:`CopyProgram` writes a payload with one
``torch._chunk_cat`` per run of same-dtype tensors: the tensors of a run, with zero tensors for
the alignment padding between them, are concatenated straight into their typed region of the
destination. One call copies thousands of tensors and zeroes every padding byte, so the payload
is a pure function of the state, padding included, whatever the destination held before
(recycled shared memory holds old bytes). Dtypes that kernel cannot copy fall back to a copy per
tensor. :class:`~.plan.Planner` builds one per layout and reuses it while the layout repeats,
and hands it out in a :class:`Flat` with the layout and the tensors.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tiercheck.codec.encode.flatten import write_payload
from tiercheck.codec.format.layout import Layout, check_payload

__all__ = ["CopyProgram", "Flat", "groupable"]


@functools.cache
def groupable(dtype: torch.dtype) -> bool:
    """Whether ``torch._chunk_cat`` copies ``dtype`` on the host bit for bit (probed once)."""
    chunk_cat = getattr(torch, "_chunk_cat", None)
    if chunk_cat is None:
        return False
    size = dtype.itemsize
    raw = torch.arange(1, 1 + 6 * size, dtype=torch.uint8)
    if dtype == torch.bool:
        raw &= 1
    try:
        src = raw.view(dtype).view(2, 3)
        zeros = torch.zeros(2 * size, dtype=torch.uint8).view(dtype)
        out = torch.full((8 * size,), 0xAB, dtype=torch.uint8)
        with torch.no_grad():
            chunk_cat([src, zeros], 0, 1, out=out.view(dtype).view(1, -1))
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return bytes(out.numpy()) == bytes(raw.numpy()) + bytes(2 * size)


#: Zero tensors standing for padding: one per (dtype, element count), shared by all programs.
_ZEROS: dict[tuple[torch.dtype, int], torch.Tensor] = {}


def _zeros(dtype: torch.dtype, count: int) -> torch.Tensor:
    zeros = _ZEROS.get((dtype, count))
    if zeros is None:
        zeros = torch.zeros(count * dtype.itemsize, dtype=torch.uint8).view(dtype)
        _ZEROS[(dtype, count)] = zeros
    return zeros


@dataclass(frozen=True, slots=True)
class _Run:
    """Consecutive specs of one dtype and the payload bytes they cover (padding included)."""

    dtype: torch.dtype
    start: int  # byte range of the payload this run writes
    end: int
    first: int  # spec range
    stop: int
    # For the grouped copy: the padding tensors, and how to interleave them with the run's
    # tensors (indexes into tensors + their 0-dim ones made 1-dim + padding; empty tensors are
    # left out).
    padding: tuple[torch.Tensor, ...]
    pick: Callable[[Sequence[torch.Tensor]], Any] | None
    single: bool  # pick returns one tensor, not a tuple
    # The 0-dim tensors of the run (the kernel needs at least one dimension), or None.
    zero_dim: Callable[[Sequence[torch.Tensor]], Any] | None
    grouped: bool


class CopyProgram:
    """Writes the tensors of ``layout`` (all in host memory) into a payload in few calls.

    One ``torch._chunk_cat`` per run of consecutive same-dtype tensors (a model and its AdamW
    state in float32 are a single run), padding included; see the module docstring. The result
    is byte for byte :func:`~.flatten.write_payload`'s.
    """

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.runs: list[_Run] = []
        specs = layout.specs
        i = 0
        while i < len(specs):
            dtype = specs[i].dtype
            j = i
            while j < len(specs) and specs[j].dtype == dtype:
                j += 1
            self.runs.append(self._run(layout, i, j))
            i = j

    @staticmethod
    def _run(layout: Layout, first: int, stop: int) -> _Run:
        specs = layout.specs
        dtype = specs[first].dtype
        start = specs[first].offset
        end = specs[stop].offset if stop < len(specs) else layout.payload_nbytes
        padding: list[torch.Tensor] = []
        order: list[int] = []
        n = stop - first
        scalars = [k - first for k in range(first, stop) if not specs[k].shape]
        lifted = {k: n + i for i, k in enumerate(scalars)}
        for k in range(first, stop):
            spec = specs[k]
            following = specs[k + 1].offset if k + 1 < stop else end
            gap = following - spec.offset - spec.nbytes
            if spec.nbytes:
                order.append(lifted.get(k - first, k - first))
            if gap:
                order.append(n + len(scalars) + len(padding))
                padding.append(_zeros(dtype, gap // dtype.itemsize))
        grouped = groupable(dtype)
        pick = operator.itemgetter(*order) if order and grouped else None
        return _Run(
            dtype=dtype,
            start=start,
            end=end,
            first=first,
            stop=stop,
            padding=tuple(padding),
            pick=pick,
            single=len(order) == 1,
            zero_dim=operator.itemgetter(*scalars) if scalars else None,
            grouped=grouped,
        )

    def write(self, tensors: Sequence[torch.Tensor], dest: torch.Tensor) -> None:
        """Copy ``tensors`` (matched to the layout: same dtypes and shapes, on the host) into
        ``dest[:payload_nbytes]``, every padding byte zeroed; bytes past that are left alone."""
        layout = self.layout
        check_payload(dest, layout.payload_nbytes, "dest")
        if dest.device.type != "cpu":
            raise ValueError(f"dest must be in host memory, got {dest.device}")
        if len(tensors) != len(layout.specs):
            raise ValueError(f"got {len(tensors)} tensors for a layout of {len(layout.specs)}")
        with torch.no_grad():
            for run in self.runs:
                if run.pick is None:
                    if not run.grouped:
                        self._write_each(run, tensors, dest)
                    continue  # an empty run: nothing to write
                own = tuple(tensors[run.first : run.stop])
                if run.zero_dim is not None:
                    lifted = torch.atleast_1d(run.zero_dim(own))  # type: ignore[no-untyped-call]
                    own += (lifted,) if isinstance(lifted, torch.Tensor) else tuple(lifted)
                items = run.pick(own + run.padding)
                if run.single:
                    items = (items,)
                region = dest[run.start : run.end].view(run.dtype).view(1, -1)
                torch._chunk_cat(items, 0, 1, out=region)

    def _write_each(self, run: _Run, tensors: Sequence[torch.Tensor], dest: torch.Tensor) -> None:
        """A run of a dtype the grouped kernel cannot copy: one ``copy_`` per tensor."""
        specs = self.layout.specs
        cursor = run.start
        for k in range(run.first, run.stop):
            spec = specs[k]
            if spec.offset > cursor:
                dest[cursor : spec.offset].zero_()
            if spec.nbytes:
                dest[spec.offset : spec.offset + spec.nbytes].view(spec.dtype).view(
                    spec.shape
                ).copy_(tensors[k])
            cursor = spec.offset + spec.nbytes
        if run.end > cursor:
            dest[cursor : run.end].zero_()


@dataclass(frozen=True, slots=True)
class Flat:
    """A flattened state ready to be copied: what :meth:`~.plan.Planner.flatten` returns."""

    layout: Layout
    tensors: list[torch.Tensor]
    #: Writes the tensors into a payload in few calls; ``None``: use
    #: :func:`~.flatten.write_payload`.
    program: CopyProgram | None
    #: Whether the layout came from the cached plan (no full walk).
    reused: bool
    #: Whether every tensor is in host memory.
    on_host: bool
    #: Indexes of tensors whose changes no version counter shows: those made from numpy
    #: arrays (they share the array's memory, which numpy writes without torch knowing). An
    #: overlapped snapshot copies them before ``save`` returns (see
    #: :class:`tiercheck.engine.save.staging.SnapshotCopy`).
    untracked: tuple[int, ...] = ()

    def write(self, dest: torch.Tensor) -> None:
        """Write the payload into ``dest`` (see :func:`~.flatten.write_payload`)."""
        if self.program is not None:
            self.program.write(self.tensors, dest)
        else:
            write_payload(self.layout, self.tensors, dest)
