"""The codec's working resources: per-thread zstd contexts, reused buffers, bounded threads.

What encoding and decoding frames (:mod:`.frames`) run on, apart from the format itself:

* :func:`zstd_parameters` and one zstd compressor / decompressor per thread and setting
  (``zstandard`` contexts are not thread-safe);
* :class:`Scratch` / :class:`ScratchPool`: the working buffers of one in-flight frame, shared by
  the frames of one call;
* :class:`OutputArena`: fresh memory for stored raw planes, carved from large blocks;
* :func:`run_bounded`: a map over threads with at most ``workers`` calls in flight;
* :func:`paused_gc`: no cyclic garbage collection while a walk makes many small objects.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Executor, Future, ThreadPoolExecutor, wait
from typing import TypeVar

import numpy as np
import numpy.typing as npt
import zstandard

from tiercheck.codec.format.layout import align
from tiercheck.codec.packed.planes import BLOCK_BYTES, PlaneScratch

__all__ = [
    "U8",
    "OutputArena",
    "Scratch",
    "ScratchPool",
    "compressor",
    "decompressor",
    "paused_gc",
    "run_bounded",
    "zstd_parameters",
]

U8 = npt.NDArray[np.uint8]


# --- zstd -------------------------------------------------------------------------------------

_local = threading.local()


def zstd_parameters(level: int, tuned: bool) -> zstandard.ZstdCompressionParameters:
    """The zstd parameters used for ``level``.

    With ``tuned``, levels whose strategy is zstd's "fast" one (1, 2 and the negative levels)
    get a 256-entry hash table, a 128 KiB window and a minimum match of 7. Byte planes of
    training state are mostly literals: a small hash table finds fewer short, spurious matches,
    which are slower and compress worse than Huffman-coded literals. Measured on AdamW planes
    (bench/codec.py's model) against plain level 1: about +50% compression speed, +30%
    decompression speed and +4% ratio.
    """
    params = zstandard.ZstdCompressionParameters.from_level(level)
    if not tuned or params.strategy != zstandard.STRATEGY_FAST:
        return params
    return zstandard.ZstdCompressionParameters(
        window_log=min(params.window_log, 17),
        hash_log=min(params.hash_log, 8),
        chain_log=params.chain_log,
        search_log=params.search_log,
        min_match=7,
        target_length=params.target_length,
        strategy=zstandard.STRATEGY_FAST,
        write_content_size=1,
        write_checksum=0,
        write_dict_id=0,
    )


def compressor(level: int, tuned: bool) -> zstandard.ZstdCompressor:
    """This thread's zstd compressor for ``level`` and ``tuned``."""
    # ZstdCompressor objects are not thread-safe: one per thread and setting.
    cache: dict[tuple[int, bool], zstandard.ZstdCompressor] | None = getattr(_local, "cctx", None)
    if cache is None:
        cache = _local.cctx = {}
    cctx = cache.get((level, tuned))
    if cctx is None:
        cctx = cache[level, tuned] = zstandard.ZstdCompressor(
            compression_params=zstd_parameters(level, tuned)
        )
    return cctx


def decompressor() -> zstandard.ZstdDecompressor:
    """This thread's zstd decompressor."""
    dctx: zstandard.ZstdDecompressor | None = getattr(_local, "dctx", None)
    if dctx is None:
        dctx = _local.dctx = zstandard.ZstdDecompressor()
    return dctx


# --- per-call resources -----------------------------------------------------------------------


class Scratch:
    """Working buffers of one in-flight frame."""

    __slots__ = ("block", "data", "planes", "split")

    def __init__(self, frame_bytes: int) -> None:
        # np.empty reserves address space only; pages are touched (and faulted in) on first use.
        self.data: U8 = np.empty(frame_bytes, dtype=np.uint8)  # a gathered multi-piece frame
        self.planes: U8 = np.empty(frame_bytes, dtype=np.uint8)  # planes bound for zstd
        self.block: U8 = np.empty(BLOCK_BYTES, dtype=np.uint8)  # one XORed block
        self.split = PlaneScratch()


class ScratchPool:
    """Scratch buffers shared by the frames of one call: at most one per running frame.

    Reused across frames because fresh memory costs page faults on first touch (a few GB/s);
    dropped with the call, so nothing stays allocated between encodes.
    """

    def __init__(self, frame_bytes: int) -> None:
        self._frame_bytes = frame_bytes
        self._free: list[Scratch] = []
        self._lock = threading.Lock()

    def acquire(self) -> Scratch:
        """A free scratch, or a new one."""
        with self._lock:
            if self._free:
                return self._free.pop()
        return Scratch(self._frame_bytes)

    def release(self, scratch: Scratch) -> None:
        """Give ``scratch`` back for the next frame."""
        with self._lock:
            self._free.append(scratch)


T = TypeVar("T")
R = TypeVar("R")


def run_bounded(
    fn: Callable[[T], R], items: Sequence[T], *, workers: int, executor: Executor | None
) -> list[R]:
    """``[fn(x) for x in items]`` with at most ``workers`` calls in flight, results in order.

    Runs on ``executor`` when given (it must not be the executor running this call: waiting on
    one's own pool can deadlock), else on a pool of ``workers`` threads made for the call. The
    first exception is raised after every started call has finished; calls not yet started are
    skipped.
    """
    if workers <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    if executor is None:
        with ThreadPoolExecutor(
            min(workers, len(items)), thread_name_prefix="tiercheck-codec"
        ) as pool:
            return run_bounded(fn, items, workers=workers, executor=pool)
    results: list[R | None] = [None] * len(items)
    pending: dict[Future[R], int] = {}
    next_index = 0
    error: BaseException | None = None
    while pending or (next_index < len(items) and error is None):
        while error is None and next_index < len(items) and len(pending) < workers:
            pending[executor.submit(fn, items[next_index])] = next_index
            next_index += 1
        done, _ = wait(pending, return_when=FIRST_COMPLETED)
        for future in done:
            index = pending.pop(future)
            exc = future.exception()
            if exc is not None:
                error = error or exc
            else:
                results[index] = future.result()
    if error is not None:
        raise error
    return results  # type: ignore[return-value]


class OutputArena:
    """Fresh memory for stored raw planes, carved from large numpy blocks.

    numpy asks for transparent huge pages on large arrays, so first-touch page faults cost
    about a quarter of what one small allocation per plane costs (the dev VM faults 4 KiB
    pages at about 2 GB/s). A block lives as long as any plane carved from it.
    """

    def __init__(self, hint: int) -> None:
        self._chunk = min(8 << 20, max(1 << 20, hint))
        self._block: U8 | None = None
        self._pos = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> U8:
        """An uninitialized uint8 array of ``nbytes`` (``ALIGNMENT``-aligned within its block)."""
        if nbytes * 2 > self._chunk:
            return np.empty(nbytes, dtype=np.uint8)
        with self._lock:
            if self._block is None or self._pos + nbytes > len(self._block):
                self._block = np.empty(self._chunk, dtype=np.uint8)
                self._pos = 0
            out = self._block[self._pos : self._pos + nbytes]
            self._pos += align(nbytes)
        return out


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """No cyclic garbage collection inside the block (it is enabled again after, if it was).

    Matching a state of thousands of tensors, or rebuilding one, creates tens of thousands of
    short-lived objects; the allocations trigger the collector, and a full collection walks
    every object of the training process (measured: 150 ms every other save of a 12,000-tensor
    state, against 10 ms of work). The objects made here die by reference counting anyway.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
