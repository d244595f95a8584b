"""Reading a full blob's payload from a file straight to where its tensors go, verified first.

A restore into a live state needs each tensor's bytes in the caller's own tensor; reading the
whole blob into fresh memory first, then copying, pays for that memory twice (its pages are
faulted in, several times the copy itself, and the state is held twice). Here the payload is
read chunk by chunk (the 8 MiB chunks of the body digest, :mod:`.digest`) into a small buffer of
each worker thread's own, each chunk is checked against its digest in the header *while it is
still in cache*, and only then are its bytes copied to their destinations. So:

* no byte that failed its check is ever written anywhere: a damaged chunk raises
  :class:`~tiercheck.errors.ChecksumMismatch` and its bytes go nowhere (the chunks checked before
  it have been copied; see the caller's contract, :mod:`tiercheck.engine.restore.inplace`);
* every byte of the body is read and checked, the padding and the tensors nobody asked for too;
* the threads read, hash and copy in parallel (``preadv``, xxh3 and ``memmove`` all run without
  the GIL).

What goes where is a :class:`Scatter`: per chunk, ``(offset in the chunk, address, nbytes)``
pieces, built by :func:`plan_scatter` from ``(payload offset, nbytes, address)`` destinations.
An address is host memory the caller owns and keeps alive until :func:`read_scattered` returns
(a tensor's ``data_ptr()``); destinations must not overlap each other.

Only full blobs with chunk digests (format 1.1) are read this way; anything else is read whole
(:func:`~tiercheck.codec.decode.blobread.read_blob`).
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import xxhash

from tiercheck.codec.format.blobformat import PREAMBLE_NBYTES, BlobMeta, read_head
from tiercheck.codec.format.digest import DIGEST_CHUNK
from tiercheck.codec.resources import U8
from tiercheck.errors import ChecksumMismatch, FormatError

__all__ = ["Scatter", "plan_scatter", "read_scattered", "scatterable", "spans_overlap"]

#: One piece of a chunk: its offset in the chunk, the address it goes to, its length (a list of
#: three ints: 100,000 tensors make as many pieces, and a list is what numpy hands out).
Piece = Sequence[int]


@dataclass(frozen=True)
class Scatter:
    """Where each chunk of a payload goes: ``pieces[c]`` for chunk ``c`` (see the module)."""

    payload_nbytes: int
    pieces: tuple[Sequence[Piece], ...]

    @property
    def chunks(self) -> int:
        """How many chunks the payload has."""
        return len(self.pieces)


def plan_scatter(
    payload_nbytes: int, destinations: npt.NDArray[np.int64] | Sequence[tuple[int, int, int]]
) -> Scatter:
    """The :class:`Scatter` of ``destinations``: ``(payload offset, nbytes, address)`` rows,
    within the payload (``ValueError`` otherwise); a destination that spans chunks is split."""
    count = (payload_nbytes + DIGEST_CHUNK - 1) // DIGEST_CHUNK
    table = np.asarray(destinations, dtype=np.int64).reshape(-1, 3)
    offset, nbytes = table[:, 0], table[:, 1]
    end = offset + nbytes
    bad = (offset < 0) | (nbytes < 0) | (end > payload_nbytes)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(
            f"bytes [{offset[i]}, {end[i]}) are not within a payload of {payload_nbytes} bytes"
        )
    table = table[nbytes > 0]
    if not len(table):
        return Scatter(payload_nbytes, tuple(() for _ in range(count)))
    offset, nbytes, address = table[:, 0], table[:, 1], table[:, 2]
    end = offset + nbytes
    # One piece per chunk a destination touches, in one pass of array arithmetic (a state of
    # thousands of tensors would spend milliseconds on a Python loop here).
    first = offset // DIGEST_CHUNK
    spans = (end - 1) // DIGEST_CHUNK - first + 1
    owner = np.repeat(np.arange(len(table)), spans)
    step = np.arange(len(owner)) - np.repeat(np.cumsum(spans) - spans, spans)
    chunk = first[owner] + step
    lo = np.maximum(offset[owner], chunk * DIGEST_CHUNK)
    hi = np.minimum(end[owner], (chunk + 1) * DIGEST_CHUNK)
    rows = np.stack((lo - chunk * DIGEST_CHUNK, address[owner] + (lo - offset[owner]), hi - lo), 1)
    order = np.argsort(chunk, kind="stable")
    rows, chunk = rows[order], chunk[order]
    bounds = np.searchsorted(chunk, np.arange(count + 1)).tolist()
    listed = rows.tolist()
    pieces = tuple(listed[bounds[c] : bounds[c + 1]] for c in range(count))
    return Scatter(payload_nbytes, pieces)


def scatterable(meta: BlobMeta) -> bool:
    """Whether ``meta``'s blob can be read by :func:`read_scattered`: a full blob with chunk
    digests, self-contained."""
    return meta.encoding.as_is and meta.chunk_digests is not None and meta.base is None


def _describe(meta: BlobMeta) -> str:
    return f"blob of version {meta.version} rank {meta.rank} (checksum {meta.checksum:#018x})"


class _Scratch(threading.local):
    """Each thread's chunk buffer, kept for the thread's life: a buffer in cache (and its pages
    faulted in once) is what makes the read, hash and copy of a chunk cheap."""

    buffer: U8 | None = None

    def get(self) -> U8:
        if self.buffer is None:
            self.buffer = np.empty(DIGEST_CHUNK, dtype=np.uint8)
        return self.buffer


_SCRATCH = _Scratch()


#: Pieces smaller than this are copied without releasing the GIL: for them, handing the GIL
#: over between the reading threads costs more than the copy (thousands of small tensors).
_SMALL = 64 << 10


def _gil_holding_memmove() -> Callable[[int, int, int], object]:
    """The C library's ``memmove`` called without releasing the GIL (``ctypes.memmove``
    releases it); ``ctypes.memmove`` itself where the C library cannot be loaded that way."""
    try:
        fn = ctypes.PyDLL(None).memmove
    except (OSError, TypeError, AttributeError):  # no dlopen(NULL) here (Windows)
        return ctypes.memmove
    fn.restype = None
    fn.argtypes = (ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t)
    return fn


_memmove_holding_gil = _gil_holding_memmove()


def _read_into(fd: int, view: memoryview, offset: int, what: str) -> None:
    done, size = 0, len(view)
    while done < size:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise FormatError(
                f"{what}: the file ended {size - done} bytes early: the blob is shorter than "
                "its header says (truncated?)"
            )
        done += got


def read_scattered(
    fd: int,
    size: int,
    meta: BlobMeta,
    preamble: bytes,
    scatter: Scatter,
    *,
    executor: Executor | None = None,
    threads: int = 1,
) -> None:
    """Read the body of ``meta``'s blob from ``fd`` (a file of ``size`` bytes) and copy each
    chunk, once it matches its digest, to the addresses ``scatter`` names.

    ``preamble`` is the blob's first 64 bytes as ``meta`` was parsed from: the file must still
    begin with them and be ``meta.nbytes`` long (else :class:`~tiercheck.errors.FormatError`:
    it is not the blob whose header was read). ``threads`` workers read chunks in turn: this
    thread and ``threads - 1`` on ``executor``. A chunk that does not match raises
    :class:`~tiercheck.errors.ChecksumMismatch` (no worker starts another chunk after that);
    a file cut short, :class:`~tiercheck.errors.FormatError`.
    """
    if not scatterable(meta):
        raise ValueError("only a self-contained full blob with chunk digests can be scattered")
    leaves = meta.chunk_digests
    assert leaves is not None
    n = meta.layout.payload_nbytes
    if scatter.payload_nbytes != n or len(leaves) != scatter.chunks:
        raise ValueError("the scatter was planned for another payload")
    what = f"reading {_describe(meta)}"
    head = bytearray(PREAMBLE_NBYTES)
    if size != meta.nbytes:
        raise FormatError(f"{what}: the file holds {size} bytes, the blob {meta.nbytes}")
    _read_into(fd, memoryview(head), 0, what)
    if bytes(head) != preamble:
        read_head(memoryview(bytes(head)))  # a damaged preamble says how
        raise FormatError(f"{what}: the file no longer holds the blob whose header was read")
    chunks = iter(range(scatter.chunks))
    lock = threading.Lock()
    failed: list[BaseException] = []

    def work() -> None:
        buffer = _SCRATCH.get()
        base = buffer.ctypes.data
        view = memoryview(buffer.data)
        memmove = ctypes.memmove
        small = _memmove_holding_gil
        while not failed:
            with lock:
                c = next(chunks, None)
            if c is None:
                return
            lo = c * DIGEST_CHUNK
            hi = min(lo + DIGEST_CHUNK, n)
            part = view[: hi - lo]
            try:
                _read_into(fd, part, meta.body_offset + lo, what)
                if xxhash.xxh3_64_intdigest(part) != leaves[c]:
                    raise ChecksumMismatch(
                        f"chunk {c} (payload bytes [{lo}, {hi})) of {_describe(meta)} does not "
                        "match its digest: the blob is corrupt; read another copy"
                    )
            except BaseException as exc:
                failed.append(exc)
                raise
            for within, address, nbytes in scatter.pieces[c]:
                if nbytes < _SMALL:
                    small(address, base + within, nbytes)
                else:
                    memmove(address, base + within, nbytes)

    # No more workers than chunks: each keeps an 8 MiB buffer for its thread's life.
    workers = max(1, min(threads, scatter.chunks))
    helpers = [executor.submit(work) for _ in range(workers - 1)] if executor is not None else []
    errors: list[BaseException] = []
    try:
        work()
    except BaseException as exc:
        errors.append(exc)
    for helper in helpers:
        try:
            helper.result()
        except BaseException as exc:
            errors.append(exc)
    if errors:
        raise errors[0]


def spans_overlap(spans: Sequence[tuple[int, int]]) -> list[bool]:
    """For each ``(start, end)`` span, whether it overlaps another (empty spans never do)."""
    order = sorted(range(len(spans)), key=lambda i: spans[i][0])
    out = [False] * len(spans)
    reach = -1
    holder = -1
    for i in order:
        start, end = spans[i]
        if start == end:
            continue
        if start < reach:
            out[i] = True
            out[holder] = True
        if end > reach:
            reach, holder = end, i
    return out
