"""Partial reads: a blob's meta and some of its tensors, through ranged reads, checked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.codec._helpers import assert_same, join
from tiercheck.codec import (
    CodecOptions,
    RangedBlob,
    RawState,
    decode,
    encode_full,
    encode_packed,
    read_meta,
    read_meta_ranged,
    read_tensors,
    snapshot,
)
from tiercheck.codec.format.digest import DIGEST_CHUNK
from tiercheck.errors import BaseMismatch, ChecksumMismatch, FormatError

GOLDEN = Path(__file__).resolve().parents[2] / "golden"
MiB = 1 << 20


class Source:
    """A blob behind a fetch function that records what it was asked for (a ranged tier)."""

    def __init__(self, blob: bytes | bytearray) -> None:
        self.blob = blob
        self.reads: list[tuple[int, int]] = []

    def __call__(self, start: int, end: int) -> bytes:
        self.reads.append((start, end))
        return bytes(self.blob[start:end])  # clipped like a slice, copied like a tier's read

    @property
    def fetched(self) -> int:
        n = len(self.blob)
        return sum(min(e, n) - min(s, n) for s, e in self.reads)

    def touched(self, offset: int) -> bool:
        return any(s <= offset < e for s, e in self.reads)


def ranged(blob: bytes | bytearray) -> tuple[RangedBlob, Source]:
    source = Source(blob)
    return RangedBlob(read_meta_ranged(source), source), source


def full_blob(raw: RawState, *, chunks: bool = True) -> bytes:
    if not chunks:  # a state without its leaves encodes as a full blob had them before 1.1
        raw = RawState(raw.version, raw.layout, raw.payload, raw.raw_digest)
    return join(encode_full(raw, rank=0)[0])


def expected(raw: RawState, indices: list[int]) -> dict[int, torch.Tensor]:
    views = raw.tensors()
    return {i: views[i] for i in indices}


def assert_tensors(
    got: dict[int, torch.Tensor],
    want: dict[int, torch.Tensor],
    spans: dict[int, tuple[int, int]] | None = None,
) -> None:
    """``got`` holds ``want``'s tensors (with ``spans``: those bytes of them, C order)."""
    assert sorted(got) == sorted(want)
    for i, tensor in got.items():
        if spans and i in spans:
            lo, hi = spans[i]
            assert tensor.dtype == want[i].dtype
            assert tensor.shape == want[i].shape
            assert as_bytes(tensor)[lo:hi] == as_bytes(want[i])[lo:hi], i
        else:
            assert_same(tensor, want[i], f"tensor {i}")


def as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).unsqueeze(-1).view(torch.uint8).numpy().tobytes()


# --- Hypothesis: every kind of blob, any subset ----------------------------------------------

DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool, torch.float64]


@st.composite
def states(draw: st.DrawFn) -> dict[str, torch.Tensor]:
    count = draw(st.integers(1, 6))
    out: dict[str, torch.Tensor] = {}
    for k in range(count):
        dtype = draw(st.sampled_from(DTYPES))
        shape = tuple(draw(st.lists(st.integers(0, 40), max_size=2)))
        numel = 1
        for d in shape:
            numel *= d
        seed = draw(st.integers(0, 2**31 - 1))
        raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8,
                            generator=torch.Generator().manual_seed(seed))  # fmt: skip
        if dtype == torch.bool:
            raw &= 1
        out[f"t{k}"] = raw.view(dtype).reshape(shape)
    return out


def changed(state: dict[str, torch.Tensor], which: list[bool]) -> dict[str, torch.Tensor]:
    """The next version: some tensors changed in a few bits, others kept."""
    out = {}
    for (name, old), change in zip(state.items(), which, strict=False):
        t = old.clone()
        if change and t.numel():
            flat = t.reshape(-1).view(torch.uint8)
            flat[:: max(1, flat.numel() // 3)] ^= 1
            if t.dtype == torch.bool:
                flat &= 1
        out[name] = t
    return out


KINDS = ["full", "full-1.0", "packed", "packed-raw", "delta", "delta-of-packed-base"]
SMALL_FRAMES = CodecOptions(level=1, frame_bytes=4096, sample_bytes=64, threads=1)
RAW_FRAMES = CodecOptions(level=None, frame_bytes=4096, threads=1)


@given(
    state=states(),
    kind=st.sampled_from(KINDS),
    picks=st.lists(st.booleans(), min_size=6, max_size=6),
    which=st.lists(st.booleans(), min_size=6, max_size=6),
    cuts=st.lists(st.tuples(st.floats(0, 1), st.floats(0, 1)) | st.none(), min_size=6, max_size=6),
)
def test_any_subset_of_any_blob_reads_as_decode_does(
    state: dict[str, torch.Tensor],
    kind: str,
    picks: list[bool],
    which: list[bool],
    cuts: list[tuple[float, float] | None],
) -> None:
    base_raw = snapshot(state, version=1)
    base: RangedBlob | RawState | None = None
    if kind == "full":
        raw, blob = base_raw, full_blob(base_raw)
    elif kind == "full-1.0":
        raw, blob = base_raw, full_blob(base_raw, chunks=False)
    elif kind in ("packed", "packed-raw"):
        options = SMALL_FRAMES if kind == "packed" else RAW_FRAMES
        raw, blob = base_raw, join(encode_packed(base_raw, rank=0, options=options)[0])
    else:
        raw = snapshot(changed(state, which), version=2)
        blob = join(encode_packed(raw, rank=0, base=base_raw, options=SMALL_FRAMES)[0])
        if kind == "delta":
            base = base_raw
        else:
            packed_base = join(encode_packed(base_raw, rank=0, options=RAW_FRAMES)[0])
            base = ranged(packed_base)[0]
    wanted = [i for i, pick in zip(range(len(raw.layout.specs)), picks, strict=False) if pick]
    source = Source(bytearray(blob))
    meta = read_meta_ranged(source)
    assert meta == read_meta(blob)
    assert meta.chunk_digests == read_meta(blob).chunk_digests
    got = read_tensors(meta, source, wanted, base=base)
    assert_tensors(got, expected(raw, wanted))
    # Part of some tensors: at least those bytes come back right.
    spans = {}
    for i in wanted:
        cut, n = cuts[i], raw.layout.specs[i].nbytes
        if cut is not None:
            lo, hi = sorted(round(c * n) for c in cut)
            spans[i] = (lo, hi)
    partly = read_tensors(meta, Source(blob), wanted, base=base, spans=spans)
    assert_tensors(partly, expected(raw, wanted), spans)
    # The tensors are the caller's own: changing the source afterwards changes none of them.
    assert isinstance(source.blob, bytearray)
    source.blob[:] = bytes(len(source.blob))
    assert_tensors(got, expected(raw, wanted))
    # Decoding the whole blob still gives the same (decode/verify are unchanged).
    whole = decode(blob, base=base_raw if kind.startswith("delta") else None)
    assert torch.equal(whole.payload, raw.payload)


# --- the meta ---------------------------------------------------------------------------------


def small_state(n: int = 3) -> dict[str, Any]:
    g = torch.Generator().manual_seed(n)
    return {f"w{i}": torch.randn(100 + i, generator=g) for i in range(n)} | {"step": 7}


def test_meta_takes_one_read_or_two_for_a_long_header() -> None:
    raw = snapshot({f"layer{i}.weight": torch.zeros(3) for i in range(2000)}, version=4)
    blob = full_blob(raw)
    want = read_meta(blob)
    assert want.body_offset > 64 << 10  # a header longer than the first read
    source = Source(blob)
    meta = read_meta_ranged(source)
    assert (meta, meta.chunk_digests) == (want, want.chunk_digests)
    assert len(source.reads) == 2
    assert source.fetched == want.body_offset
    small = Source(full_blob(snapshot(small_state(), version=5)))
    assert read_meta_ranged(small) == read_meta(small.blob)
    assert len(small.reads) == 1
    tiny = Source(small.blob)
    assert read_meta_ranged(tiny, first_read=64) == read_meta(small.blob)
    assert len(tiny.reads) == 2


def test_meta_checks_what_read_meta_checks() -> None:
    blob = full_blob(snapshot(small_state(), version=5))
    meta = read_meta(blob)
    with pytest.raises(FormatError, match="truncated"):
        read_meta_ranged(Source(blob), size=len(blob) - 1)
    assert read_meta_ranged(Source(blob), size=len(blob)) == meta
    with pytest.raises(FormatError):
        read_meta_ranged(Source(blob[: meta.body_offset - 8]), first_read=64)
    with pytest.raises(FormatError):
        read_meta_ranged(Source(b"not a blob" * 10))
    for offset in (3, 40, 70, meta.body_offset - 1):
        bad = bytearray(blob)
        bad[offset] ^= 0x10
        with pytest.raises((ChecksumMismatch, FormatError)):
            read_meta_ranged(Source(bad))


# --- full blobs: chunks --------------------------------------------------------------------


def eight_tensors() -> RawState:
    """8 tensors of 16 MiB: 16 chunks of payload, each tensor on two chunks of its own."""
    g = torch.Generator().manual_seed(0)
    state = {f"t{i}": torch.randint(0, 1 << 30, (4 * MiB,), generator=g) for i in range(8)}
    return snapshot({k: v.to(torch.int32) for k, v in state.items()}, version=3)


@pytest.fixture(scope="module")
def eight() -> RawState:
    return eight_tensors()


def test_one_of_eight_tensors_costs_its_chunks_only(eight: RawState) -> None:
    blob = full_blob(eight)
    meta, source = ranged(blob)
    got = meta.read([5])
    assert_tensors(got, expected(eight, [5]))
    assert source.fetched < len(blob) // 4
    spec = eight.layout.specs[5]
    assert source.fetched <= meta.meta.body_offset + spec.nbytes + 2 * DIGEST_CHUNK
    # Packed blobs likewise: the frames of that tensor.
    packed = join(encode_packed(eight, rank=0, options=CodecOptions(level=1, threads=1))[0])
    pmeta, psource = ranged(packed)
    assert_tensors(pmeta.read([2], threads=2), expected(eight, [2]))
    assert psource.fetched < len(packed) // 4


def test_part_of_a_tensor_costs_the_chunks_or_frames_of_that_part(eight: RawState) -> None:
    """Tensor 5 spans two 8 MiB chunks (four 4 MiB frames): its first quarter costs one chunk
    (one frame), its middle two chunks (two frames); a delta's base is read likewise."""
    spec = eight.layout.specs[5]
    quarter = {5: (0, spec.nbytes // 4)}
    middle = {5: (spec.nbytes // 2 - 8, spec.nbytes // 2 + 8)}
    blob = full_blob(eight)
    for spans, chunks in ((quarter, 1), (middle, 2)):
        meta, source = ranged(blob)
        before = source.fetched  # the header
        assert_tensors(meta.read([5], spans=spans), expected(eight, [5]), spans)
        assert source.fetched - before == chunks * DIGEST_CHUNK
    options = CodecOptions(level=1, threads=1)
    packed = join(encode_packed(eight, rank=0, options=options)[0])
    frame = options.frame_bytes
    for spans, frames in ((quarter, 1), (middle, 2)):
        meta, source = ranged(packed)
        before = source.fetched
        assert_tensors(meta.read([5], spans=spans), expected(eight, [5]), spans)
        # Compressed frames of random ints are at most about their raw size.
        assert frames * frame // 2 < source.fetched - before <= frames * (frame + 4096)
    changed_ = {f"t{i}": t.clone() for i, t in enumerate(eight.tensors())}
    changed_["t5"][:16] ^= 1
    later = snapshot(changed_, version=4)
    delta = join(encode_packed(later, rank=0, base=eight, options=options)[0])
    base_meta, base_source = ranged(packed)
    meta, source = ranged(delta)
    whole_base = RangedBlob(base_meta.meta, base_source)
    before = base_source.fetched
    got = read_tensors(meta.meta, source, [5], base=whole_base, spans=quarter)
    assert_tensors(got, expected(later, [5]), quarter)
    assert frame // 2 < base_source.fetched - before <= frame + 4096
    with pytest.raises(ValueError, match="not within"):
        read_tensors(meta.meta, source, [5], base=whole_base, spans={5: (0, spec.nbytes + 1)})
    with pytest.raises(ValueError, match="not wanted"):
        read_tensors(meta.meta, source, [5], base=whole_base, spans={4: (0, 8)})


def test_a_flipped_bit_in_a_wanted_chunk_is_caught_and_one_outside_is_not_read(
    eight: RawState,
) -> None:
    blob = bytearray(full_blob(eight))
    meta = read_meta(blob)
    spec = eight.layout.specs[3]
    inside = meta.body_offset + spec.offset + spec.nbytes // 2
    blob[inside] ^= 0x04
    with pytest.raises(ChecksumMismatch, match=r"chunk \d+ .* version 3 rank 0"):
        read_tensors(meta, Source(blob), [3])
    other = eight.layout.specs[6]
    outside = meta.body_offset + other.offset + 100
    blob[inside] ^= 0x04
    blob[outside] ^= 0x04
    source = Source(blob)
    assert_tensors(read_tensors(meta, source, [3]), expected(eight, [3]))
    assert not source.touched(outside)


def test_a_tensor_across_a_chunk_boundary_reads_both_chunks() -> None:
    # 5 MiB + 5 MiB + 7 MiB: the second tensor spans the first boundary (8 MiB).
    state = {
        "a": torch.ones(5 * MiB, dtype=torch.uint8),
        "b": torch.arange(5 * MiB // 4, dtype=torch.int32),
        "c": torch.full((7 * MiB // 8,), 2.5, dtype=torch.float64),
    }
    raw = snapshot(state, version=9)
    blob = bytearray(full_blob(raw))
    meta, source = ranged(blob)
    assert len(meta.meta.chunk_digests or ()) == 3
    assert_tensors(meta.read([1], max_read=DIGEST_CHUNK), expected(raw, [1]))
    body = meta.meta.body_offset
    assert source.touched(body + DIGEST_CHUNK - 1)
    assert source.touched(body + DIGEST_CHUNK)
    assert not source.touched(body + 2 * DIGEST_CHUNK)
    # A bit flipped in the second chunk, where "b" ends: caught when reading b or c (which
    # shares that chunk), not a (in the first chunk only).
    blob[body + DIGEST_CHUNK + 1000] ^= 1
    with pytest.raises(ChecksumMismatch, match="chunk 1"):
        read_tensors(meta.meta, Source(blob), [1])
    with pytest.raises(ChecksumMismatch, match="chunk 1"):
        read_tensors(meta.meta, Source(blob), [2])
    assert_tensors(read_tensors(meta.meta, Source(blob), [0]), expected(raw, [0]))


def test_an_old_full_blob_is_read_whole_and_checked_whole(eight: RawState) -> None:
    blob = bytearray(full_blob(eight, chunks=False))
    meta, source = ranged(blob)
    assert meta.meta.chunk_digests is None
    assert_tensors(meta.read([5], max_read=3 * DIGEST_CHUNK), expected(eight, [5]))
    body = source.reads[1:]  # after the meta's one read
    assert sum(e - s for s, e in body) == len(blob) - meta.meta.body_offset
    assert all(e - s <= 3 * DIGEST_CHUNK for s, e in body)
    # Without chunk digests any flipped bit fails the read, wanted or not.
    blob[meta.meta.body_offset + eight.layout.specs[1].offset] ^= 0x80
    with pytest.raises(ChecksumMismatch, match=r"format 1\.0"):
        read_tensors(meta.meta, Source(blob), [5])


def test_the_golden_format_1_0_full_blob_reads_by_parts() -> None:
    from tests.golden.make_golden import golden_raw_states

    base_raw, _ = golden_raw_states()
    indices = list(range(len(base_raw.layout.specs)))
    for name, chunked in (("base.full.tcb", False), ("base.full.v1_1.tcb", True)):
        meta, _source = ranged((GOLDEN / name).read_bytes())
        assert (meta.meta.chunk_digests is not None) is chunked
        assert_tensors(meta.read(indices), expected(base_raw, indices))


def test_a_truncated_body_is_a_format_error(eight: RawState) -> None:
    blob = full_blob(eight)
    meta = read_meta(blob)
    short = Source(blob[: len(blob) - 100])
    with pytest.raises(FormatError, match="truncated"):
        read_tensors(meta, short, [7])
    assert_tensors(read_tensors(meta, short, [0]), expected(eight, [0]))


# --- packed blobs: frames --------------------------------------------------------------------


def frames_state() -> RawState:
    g = torch.Generator().manual_seed(1)
    return snapshot(
        {
            "big": torch.randn(64 * 1024, generator=g),  # 256 KiB: many 4 KiB frames
            "small": [torch.randn(10, generator=g) for _ in range(5)],  # sharing a frame
            "ints": torch.arange(30000, dtype=torch.int64),
        },
        version=11,
    )


def test_a_flipped_bit_in_a_wanted_frame_is_caught_and_one_outside_is_not_read() -> None:
    raw = frames_state()
    blob = bytearray(join(encode_packed(raw, rank=2, options=SMALL_FRAMES)[0]))
    meta = read_meta(blob)
    ints = len(raw.layout.specs) - 1
    source = Source(blob)
    assert_tensors(read_tensors(meta, source, [ints]), expected(raw, [ints]))
    untouched = [o for o in range(meta.body_offset, len(blob), 997) if not source.touched(o)]
    assert untouched, "reading one tensor should leave most of the body unread"
    for offset in untouched[:: max(1, len(untouched) // 5)]:
        blob[offset] ^= 0x20
        assert_tensors(read_tensors(meta, Source(blob), [ints]), expected(raw, [ints]))
        blob[offset] ^= 0x20
    inside = source.reads[-1][0] + 5
    blob[inside] ^= 0x20
    with pytest.raises(ChecksumMismatch, match=r"frame \d+ .* version 11 rank 2"):
        read_tensors(meta, Source(blob), [ints])


def test_deltas_need_their_base_and_read_it_by_ranges() -> None:
    base_raw = frames_state()
    state = base_raw.state()
    state["ints"] = state["ints"] + 1
    cur = snapshot(state, version=12)
    blob = join(encode_packed(cur, rank=0, base=base_raw, options=SMALL_FRAMES)[0])
    meta = read_meta(blob)
    everything = list(range(len(cur.layout.specs)))
    with pytest.raises(BaseMismatch, match="delta against version 11"):
        read_tensors(meta, Source(blob), [0])
    other = snapshot(state, version=11)  # same version, other digest
    with pytest.raises(BaseMismatch, match="raw digest"):
        read_tensors(meta, Source(blob), [0], base=other)
    for base_blob in (full_blob(base_raw), join(encode_packed(base_raw, rank=0)[0])):
        base, base_source = ranged(base_blob)
        got = read_tensors(meta, Source(blob), [len(everything) - 1], base=base)
        assert_tensors(got, expected(cur, [len(everything) - 1]))
        assert len(base_source.reads) >= 2, "the base is read by ranges: its meta, then a part"
        assert_tensors(read_tensors(meta, Source(blob), everything, base=base),
                       expected(cur, everything))  # fmt: skip
    # A corrupt base chunk under a wanted tensor is caught too.
    bad = bytearray(full_blob(base_raw))
    bad_meta = read_meta(bad)
    bad[bad_meta.body_offset + base_raw.layout.specs[-1].offset + 8] ^= 1
    with pytest.raises(ChecksumMismatch, match="version 11"):
        read_tensors(meta, Source(blob), [len(everything) - 1], base=ranged(bad)[0])


def test_wanted_indices_are_checked() -> None:
    raw = snapshot(small_state(), version=1)
    meta, _ = ranged(full_blob(raw))
    with pytest.raises(ValueError, match="tensor index"):
        meta.read([len(raw.layout.specs)])
    with pytest.raises(ValueError, match="tensor index"):
        meta.read([-1])
    with pytest.raises(ValueError, match="tensor index"):
        meta.read([1.0])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="tensor index"):
        meta.read([True])
    assert_tensors(meta.read([np.int64(2)]), expected(raw, [2]))  # type: ignore[list-item]
    with pytest.raises(ValueError, match="max_read"):
        meta.read([0], max_read=0)
    assert meta.read([]) == {}
    assert_tensors(meta.read([1, 1, 0]), expected(raw, [0, 1]))
