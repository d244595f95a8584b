"""Reading a full blob's payload from its file straight to scattered destinations.

The oracle is the payload itself: whatever destinations are asked for, each must end up with
exactly its bytes of the payload, and a damaged chunk must raise before any of *its* bytes
reach a destination.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tiercheck.codec import encode_full, read_meta, snapshot
from tiercheck.codec.decode.scatter import plan_scatter, read_scattered, spans_overlap
from tiercheck.codec.format.blobformat import PREAMBLE_NBYTES
from tiercheck.codec.format.digest import DIGEST_CHUNK
from tiercheck.errors import ChecksumMismatch, FormatError

POOL = ThreadPoolExecutor(3)


def blob_file(tmp_path: Path, nbytes: int, seed: int = 0) -> tuple[Path, torch.Tensor]:
    """A full blob of about ``nbytes`` of payload written to a file; and its raw payload."""
    g = torch.Generator().manual_seed(seed)
    state = {
        "a": torch.randn(nbytes // 8, generator=g),
        "b": torch.randint(0, 255, (nbytes // 2 + 3,), dtype=torch.uint8, generator=g),
        "c": torch.randn(7, generator=g).to(torch.bfloat16),
    }
    raw = snapshot(state, version=3)
    path = tmp_path / "blob.full"
    parts, _meta = encode_full(raw, rank=0)
    path.write_bytes(b"".join(bytes(memoryview(p).cast("B")) for p in parts))
    return path, raw.payload


def read(path: Path, destinations: np.ndarray, threads: int = 2, preamble: bytes | None = None):
    data = path.read_bytes()
    meta = read_meta(memoryview(data))
    scatter = plan_scatter(meta.layout.payload_nbytes, destinations)
    fd = os.open(path, os.O_RDONLY)
    try:
        read_scattered(
            fd,
            os.fstat(fd).st_size,
            meta,
            data[:PREAMBLE_NBYTES] if preamble is None else preamble,
            scatter,
            executor=POOL,
            threads=threads,
        )
    finally:
        os.close(fd)


@st.composite
def cuts(draw: st.DrawFn, n: int) -> list[tuple[int, int]]:
    """Disjoint byte ranges of a payload of ``n`` bytes, some empty, some spanning chunks."""
    points = sorted(draw(st.lists(st.integers(0, n), min_size=2, max_size=16)))
    pairs = list(zip(points[::2], points[1::2], strict=False))
    return [(a, b) for a, b in pairs if draw(st.booleans()) or a == b]


@settings(max_examples=25, deadline=None)
@given(data=st.data(), threads=st.integers(1, 3))
def test_every_destination_gets_exactly_its_bytes(
    tmp_path_factory: pytest.TempPathFactory, data: st.DataObject, threads: int
) -> None:
    tmp = tmp_path_factory.mktemp("scatter")
    path, payload = blob_file(tmp, 3 * DIGEST_CHUNK + 12345, seed=threads)
    n = payload.numel()
    ranges = data.draw(cuts(n))
    out = torch.full((n,), 0xAB, dtype=torch.uint8)  # destinations live at the same offsets
    rows = np.array([(a, b - a, out.data_ptr() + a) for a, b in ranges], dtype=np.int64).reshape(
        -1, 3
    )
    read(path, rows, threads)
    wanted = torch.zeros(n, dtype=torch.bool)
    for a, b in ranges:
        wanted[a:b] = True
    assert torch.equal(out[wanted], payload[wanted])
    assert bool((out[~wanted] == 0xAB).all())  # nothing written outside the destinations


def test_a_damaged_chunk_raises_and_none_of_its_bytes_are_written(tmp_path: Path) -> None:
    path, payload = blob_file(tmp_path, 3 * DIGEST_CHUNK + 100)
    meta = read_meta(memoryview(path.read_bytes()))
    n = payload.numel()
    bad_chunk = 1
    data = bytearray(path.read_bytes())
    data[meta.body_offset + bad_chunk * DIGEST_CHUNK + 4096] ^= 0x10
    path.write_bytes(bytes(data))
    out = torch.full((n,), 0xAB, dtype=torch.uint8)
    rows = np.array([(0, n, out.data_ptr())], dtype=np.int64)
    with pytest.raises(ChecksumMismatch, match="chunk 1"):
        read(path, rows, threads=1)  # one worker: chunks in order
    lo, hi = bad_chunk * DIGEST_CHUNK, (bad_chunk + 1) * DIGEST_CHUNK
    assert torch.equal(out[:lo], payload[:lo])  # checked before the damage: written
    assert bool((out[lo:] == 0xAB).all())  # the damaged chunk and after: untouched
    # With several workers, whatever was written is the payload's own bytes, never others.
    out.fill_(0xAB)
    with pytest.raises(ChecksumMismatch):
        read(path, rows, threads=3)
    assert bool((out[lo:hi] == 0xAB).all())
    written = out != 0xAB
    assert torch.equal(out[written], payload[written])


def test_a_file_that_is_not_the_blob_read_is_refused(tmp_path: Path) -> None:
    path, payload = blob_file(tmp_path, DIGEST_CHUNK)
    out = torch.zeros(payload.numel(), dtype=torch.uint8)
    rows = np.array([(0, payload.numel(), out.data_ptr())], dtype=np.int64)
    other = bytearray(path.read_bytes()[:PREAMBLE_NBYTES])
    other[56] ^= 1  # another blob's identity
    with pytest.raises(FormatError):
        read(path, rows, preamble=bytes(other))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])  # cut short after its header was read
    meta = read_meta(memoryview(data))
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(FormatError, match="holds"):
            read_scattered(
                fd,
                os.fstat(fd).st_size,
                meta,
                data[:PREAMBLE_NBYTES],
                plan_scatter(meta.layout.payload_nbytes, rows),
            )
        # A file that still claims the size but ends early (cut under the reader) is caught
        # by the read itself.
        with pytest.raises(FormatError, match="ended"):
            read_scattered(
                fd,
                meta.nbytes,
                meta,
                data[:PREAMBLE_NBYTES],
                plan_scatter(meta.layout.payload_nbytes, rows),
            )
    finally:
        os.close(fd)


def test_destinations_outside_the_payload_are_refused() -> None:
    with pytest.raises(ValueError, match="not within"):
        plan_scatter(100, [(90, 20, 0)])
    with pytest.raises(ValueError, match="not within"):
        plan_scatter(100, [(-1, 2, 0)])
    assert plan_scatter(100, []).pieces == ((),)


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 20)), max_size=12))
def test_spans_overlap_matches_pairwise_comparison(raw: list[tuple[int, int]]) -> None:
    spans = [(a, a + n) for a, n in raw]
    expected = [
        any(
            j != i and s[0] < t[1] and t[0] < s[1] and s[0] < s[1] and t[0] < t[1]
            for j, t in enumerate(spans)
        )
        for i, s in enumerate(spans)
    ]
    assert spans_overlap(spans) == expected
