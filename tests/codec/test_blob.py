"""The blob format: full and packed blobs, metadata, verification, refusal of bad bytes."""

from __future__ import annotations

import struct
import tracemalloc
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgpack
import numpy as np
import pytest
import torch

from tiercheck.codec import (
    MAGIC,
    CodecOptions,
    RawState,
    decode,
    encode_full,
    encode_packed,
    finalize_full_blob,
    full_blob_size,
    raw_digest,
    read_meta,
    snapshot,
    verify,
    write_full_blob,
    write_payload,
)
from tiercheck.codec.encode.flatten import align, flatten
from tiercheck.codec.format import blobformat
from tiercheck.errors import ChecksumMismatch, ConfigError, FormatError, UnsupportedFormat

from ._helpers import assert_same, join, random_tensor


def sample_state(seed: int = 0, scale: int = 1) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "w": torch.randn(64 * scale, 48, generator=gen) * 0.02,
            "b": torch.randn(48, generator=gen).bfloat16(),
            "ids": torch.arange(100, dtype=torch.int64),
            "mask": torch.rand(10, generator=gen) > 0.5,
            "d": torch.randn(7, generator=gen, dtype=torch.float64),
            "c": random_tensor(torch.complex128, (3,), seed=seed),
        },
        "step": seed,
        "rng": torch.get_rng_state(),
    }


def nudged(state: dict[str, Any], seed: int) -> dict[str, Any]:
    out = {**state, "model": dict(state["model"]), "step": state["step"] + 1}
    gen = torch.Generator().manual_seed(seed)
    out["model"]["w"] = state["model"]["w"] * (
        1 + 1e-3 * torch.randn(state["model"]["w"].shape, generator=gen)
    )
    return out


# --- full blobs ---------------------------------------------------------------------------------


def test_full_blob_round_trip_and_meta() -> None:
    state = sample_state()
    raw = snapshot(state, version=7)
    parts, meta = encode_full(raw, rank=2)
    assert len(parts) == 2
    assert meta.kind == "full"
    assert meta.version == 7
    assert meta.rank == 2
    assert meta.base is None
    assert meta.stages == ("tiercheck.flatten/1",)
    assert meta.raw_digest == raw.raw_digest == raw_digest(raw.payload)
    data = join(parts)
    assert meta.nbytes == len(data)
    assert data.startswith(MAGIC)
    assert read_meta(data) == meta
    assert verify(data) == meta
    decoded = decode(data)
    assert decoded.version == 7
    assert decoded.layout == raw.layout
    assert torch.equal(decoded.payload, raw.payload)
    assert_same(decoded.state(), state)


def test_full_blob_written_in_place_equals_encode_full() -> None:
    raw = snapshot(sample_state(1), version=3)
    total, offset = full_blob_size(raw.layout, version=3, rank=1)
    assert offset % 64 == 0
    assert raw.chunk_digests is not None
    for digest, leaves in [
        (None, None),
        (raw.raw_digest, None),
        (None, raw.chunk_digests),
        (raw.raw_digest, raw.chunk_digests),
    ]:
        dest = bytearray(total)
        assert write_full_blob(memoryview(dest), raw.layout, version=3, rank=1) == offset
        with pytest.raises(ChecksumMismatch):
            verify(dest)  # not sealed yet: never mistaken for a good blob
        _, tensors = flatten(sample_state(1))
        payload = torch.frombuffer(dest, dtype=torch.uint8)[offset:]
        write_payload(raw.layout, tensors, payload)
        meta = finalize_full_blob(memoryview(dest), raw_digest=digest, chunk_digests=leaves)
        assert bytes(dest) == join(encode_full(raw, rank=1)[0])
        assert meta.raw_digest == raw.raw_digest
        assert meta.chunk_digests == raw.chunk_digests


def test_finalize_refuses_digests_that_are_not_the_payloads() -> None:
    """A raw digest or chunk digests that do not fit: refused, and the blob stays unsealed."""
    raw = snapshot(sample_state(1), version=3)
    assert raw.chunk_digests is not None
    total, offset = full_blob_size(raw.layout, version=3, rank=1)
    dest = bytearray(total)
    write_full_blob(dest, raw.layout, version=3, rank=1)
    dest[offset:] = raw.payload.numpy().tobytes()
    wrong = [x ^ 1 for x in raw.chunk_digests]
    for kwargs in [
        {"raw_digest": raw.raw_digest ^ 1},
        {"raw_digest": raw.raw_digest, "chunk_digests": wrong},
        {"chunk_digests": [*raw.chunk_digests, 5]},
    ]:
        with pytest.raises(ValueError, match="digest"):
            finalize_full_blob(dest, **kwargs)  # type: ignore[arg-type]
        with pytest.raises(ChecksumMismatch):
            verify(dest)
    with pytest.raises(FormatError, match="write_full_blob"):
        finalize_full_blob(bytearray(join(encode_packed(raw, rank=0)[0])))


def test_a_state_without_chunk_digests_makes_a_full_blob_without_them() -> None:
    raw = snapshot(sample_state(1), version=3)
    bare = RawState(raw.version, raw.layout, raw.payload, raw.raw_digest)
    meta = verify(join(encode_full(bare, rank=0)[0]))
    assert meta.chunk_digests is None
    assert verify(join(encode_full(raw, rank=0)[0])).chunk_digests == raw.chunk_digests
    with pytest.raises(ValueError, match="add up"):
        RawState(raw.version, raw.layout, raw.payload, raw.raw_digest ^ 1, raw.chunk_digests)


def test_write_full_blob_checks_dest() -> None:
    raw = snapshot(sample_state(), version=1)
    total, _ = full_blob_size(raw.layout, version=1, rank=0)
    with pytest.raises(ValueError, match="bytes"):
        write_full_blob(bytearray(total + 1), raw.layout, version=1, rank=0)
    with pytest.raises(ValueError, match="writable"):
        write_full_blob(memoryview(bytes(total)), raw.layout, version=1, rank=0)


def test_full_decode_is_zero_copy_for_writable_blobs() -> None:
    raw = snapshot(sample_state(), version=1)
    data = bytearray(join(encode_full(raw, rank=0)[0]))
    decoded = decode(data)
    start = np.frombuffer(data, dtype=np.uint8).ctypes.data
    assert start <= decoded.payload.data_ptr() < start + len(data)  # a view of the blob
    frozen = decode(bytes(data))  # read-only: copied once
    assert not (start <= frozen.payload.data_ptr() < start + len(data))
    out = torch.empty(raw.layout.payload_nbytes + 64, dtype=torch.uint8)
    into = decode(data, out=out)
    assert into.payload.data_ptr() == out.data_ptr()
    assert torch.equal(into.payload, raw.payload)


# --- packed blobs -------------------------------------------------------------------------------


OPTIONS = [
    CodecOptions(),
    CodecOptions(level=None),
    CodecOptions(level=0),
    CodecOptions(planes=False),
    CodecOptions(level=3, tuned=False),
    CodecOptions(level=-5),
    CodecOptions(frame_bytes=4096, sample_bytes=256, threads=3),
    CodecOptions(threads=1, min_gain=0.0),
]


@pytest.mark.parametrize("options", OPTIONS, ids=repr)
def test_packed_round_trip_base_and_delta(options: CodecOptions) -> None:
    state0 = sample_state(0, scale=8)
    state1 = nudged(state0, 1)
    base = snapshot(state0, version=1)
    cur = snapshot(state1, version=2)
    for state, raw, ref in ((state0, base, None), (state1, cur, base)):
        parts, meta = encode_packed(raw, rank=5, base=ref, options=options)
        data = join(parts)
        assert meta.kind == "packed"
        assert meta.nbytes == len(data)
        assert meta.rank == 5
        assert read_meta(data) == meta
        assert verify(data) == meta
        decoded = decode(data, base=ref)
        assert torch.equal(decoded.payload, raw.payload)
        assert_same(decoded.state(), state)
        if not options.entropy:
            assert "tiercheck.planes/1" not in meta.stages
            assert "tiercheck.zstd/1" not in meta.stages


def test_packed_stage_names() -> None:
    base = snapshot(sample_state(), version=1)
    _, meta = encode_packed(base, rank=0)
    assert meta.stages == ("tiercheck.flatten/1", "tiercheck.planes/1", "tiercheck.zstd/1")
    _, meta = encode_packed(base, rank=0, base=base, options=CodecOptions(planes=False))
    assert meta.stages == ("tiercheck.flatten/1", "tiercheck.xor/1", "tiercheck.zstd/1")
    assert meta.base is not None
    assert meta.base.raw_digest == base.raw_digest


def test_packed_compresses_training_like_state() -> None:
    base = snapshot(sample_state(0, scale=16), version=1)
    cur = snapshot(nudged(sample_state(0, scale=16), 1), version=2)
    _, full_meta = encode_packed(base, rank=0)
    _, delta_meta = encode_packed(cur, rank=0, base=base)
    assert full_meta.nbytes < base.layout.payload_nbytes
    assert delta_meta.nbytes < full_meta.nbytes


def test_packed_with_a_callers_executor() -> None:
    base = snapshot(sample_state(0, scale=8), version=1)
    with ThreadPoolExecutor(2) as pool:
        parts, _ = encode_packed(
            base, rank=0, options=CodecOptions(frame_bytes=8192), executor=pool
        )
        data = join(parts)
        assert verify(data, executor=pool).version == 1
        assert torch.equal(decode(data, executor=pool).payload, base.payload)


def test_decode_into_out() -> None:
    base = snapshot(sample_state(), version=1)
    cur = snapshot(nudged(sample_state(), 1), version=2)
    data = join(encode_packed(cur, rank=0, base=base)[0])
    out = torch.full((cur.layout.payload_nbytes + 100,), 0xEE, dtype=torch.uint8)
    decoded = decode(data, base=base, out=out)
    assert decoded.payload.data_ptr() == out.data_ptr()
    assert torch.equal(decoded.payload, cur.payload)  # padding bytes were zeroed too
    with pytest.raises(ValueError, match="overlap"):
        decode(data, base=base, out=base.payload)
    with pytest.raises(ValueError, match="uint8"):
        decode(data, base=base, out=torch.zeros(10))
    with pytest.raises(ValueError, match="hold"):
        decode(data, base=base, out=torch.zeros(10, dtype=torch.uint8))


def test_state_without_tensor_bytes() -> None:
    for state in ({"step": 1}, {"empty": torch.zeros(0, 5), "x": torch.zeros(0)}):
        raw = snapshot(state, version=1)
        for parts, _ in (encode_full(raw, rank=0), encode_packed(raw, rank=0, base=raw)):
            decoded = decode(join(parts), base=raw)
            assert_same(decoded.state(), state)


def test_wrong_raw_digest_is_caught_end_to_end() -> None:
    raw = snapshot(sample_state(), version=1)
    lying = RawState(raw.version, raw.layout, raw.payload, raw.raw_digest ^ 0xFF)
    with pytest.raises(ChecksumMismatch):
        decode(join(encode_packed(lying, rank=0)[0]))
    with pytest.raises(ChecksumMismatch):
        decode(join(encode_full(lying, rank=0)[0]))


def test_raw_state_checks_its_payload() -> None:
    raw = snapshot(sample_state(), version=1)
    with pytest.raises(ValueError, match="bytes"):
        RawState(1, raw.layout, raw.payload[:-64], raw.raw_digest)
    with pytest.raises(ValueError, match="uint8"):
        RawState(1, raw.layout, raw.payload.view(torch.int32), raw.raw_digest)


def test_codec_options_are_validated() -> None:
    for bad in (
        {"level": 23},
        {"level": 1.5},
        {"threads": -1},
        {"frame_bytes": 1000},
        {"frame_bytes": 4100},
        {"sample_bytes": 10},
        {"min_gain": 1.0},
    ):
        with pytest.raises(ConfigError):
            CodecOptions(**bad)


def test_encoding_memory_is_bounded_by_frames_not_state() -> None:
    # 64 MiB of changing fp32 state, 512 KiB frames, 2 threads: the working memory beyond the
    # output stays near threads * a few frames, whatever the state size.
    n = 16 << 20
    gen = torch.Generator().manual_seed(0)
    base = snapshot({"w": torch.randn(n, generator=gen)}, version=1)
    cur = snapshot({"w": base.tensors()[0] * 1.0001}, version=2)
    frame = 512 << 10
    options = CodecOptions(frame_bytes=frame, threads=2)
    tracemalloc.start()
    try:
        parts, _ = encode_packed(cur, rank=0, base=base, options=options)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    retained = sum(len(p) for p in parts)
    extra = peak - retained
    # encode_packed's documented bound: workers * (3 * frame_bytes + 3 MiB) + an 8 MiB arena
    # block (+1 MiB for small Python objects).
    bound = 2 * (3 * frame + (3 << 20)) + (8 << 20) + (1 << 20)
    assert extra < bound, f"extra {extra >> 20} MiB > {bound >> 20} MiB"
    assert extra < cur.layout.payload_nbytes // 4


# --- refusing bad bytes -------------------------------------------------------------------------


def _packed_blob() -> tuple[RawState, bytes]:
    base = snapshot(sample_state(), version=1)
    cur = snapshot(nudged(sample_state(), 1), version=2)
    return base, join(
        encode_packed(cur, rank=0, base=base, options=CodecOptions(frame_bytes=4096))[0]
    )


def test_truncated_or_padded_blob_is_a_format_error() -> None:
    base, data = _packed_blob()
    for cut in (0, 10, 63, 64, 100, len(data) // 2, len(data) - 1):
        with pytest.raises(FormatError):
            decode(data[:cut], base=base)
    with pytest.raises(FormatError):
        decode(data + b"\0", base=base)


def test_unknown_magic_is_a_format_error() -> None:
    _, data = _packed_blob()
    with pytest.raises(FormatError):
        read_meta(b"PK\x03\x04" + data[4:])
    with pytest.raises(FormatError):
        read_meta(b"\0" * 200)


def test_unknown_format_major_is_unsupported() -> None:
    _, data = _packed_blob()
    newer = data[:8] + struct.pack("<H", 2) + data[10:]
    with pytest.raises(UnsupportedFormat):
        read_meta(newer)


def reseal(data: bytes, edit: Any) -> bytes:
    """``data`` with its header changed by ``edit`` and every digest recomputed (a forgery that
    passes the checksums, to test what the reader does with a well-formed but unknown header)."""
    view = memoryview(data)
    _head, header_nbytes, body_nbytes, kind = blobformat.read_head(view)
    raw, body_digest = struct.unpack("<QQ", data[32:48])
    header = msgpack.unpackb(data[64 : 64 + header_nbytes], raw=False)
    edit(header)
    packed = msgpack.packb(header, use_bin_type=True)
    region = blobformat.header_region(packed)
    old_offset = align(64 + header_nbytes)
    (minor,) = struct.unpack("<H", data[10:12])
    new_head = blobformat.HEAD.pack(MAGIC, 1, minor, kind, len(packed), body_nbytes)
    return blobformat.seal(new_head, region, raw, body_digest) + region + data[old_offset:]


def test_reseal_helper_is_faithful() -> None:
    base, data = _packed_blob()
    same = reseal(data, lambda h: None)
    assert same == data
    assert torch.equal(decode(same, base=base).payload, decode(data, base=base).payload)


@pytest.mark.parametrize(
    "stage",
    ["tiercheck.zstd/2", "tiercheck.brotli/1", "acme.magic/1"],
)
def test_unknown_stage_or_stage_version_is_unsupported(stage: str) -> None:
    _, data = _packed_blob()

    def edit(header: dict[str, Any]) -> None:
        header["stages"][-1][0] = stage

    with pytest.raises(UnsupportedFormat):
        read_meta(reseal(data, edit))


def test_newer_stage_minor_version_is_accepted() -> None:
    base, data = _packed_blob()

    def edit(header: dict[str, Any]) -> None:
        header["stages"][-1][0] = "tiercheck.zstd/1.7"

    assert torch.equal(
        decode(reseal(data, edit), base=base).payload, decode(data, base=base).payload
    )


def _set_first_mode(table: bytes, mode: int) -> bytes:
    first = int.from_bytes(table[:8], "little")
    return ((first & ~3) | mode).to_bytes(8, "little") + table[8:]


@pytest.mark.parametrize(
    "edit",
    [
        lambda h: h.pop("layout"),
        lambda h: h.update(stages="nope"),
        lambda h: h.update(stages=[["tiercheck.zstd/1", {"level": 1}]]),
        lambda h: h.update(frame_bytes=100),
        lambda h: h.update(table=h["table"][:-8]),
        lambda h: h.update(delta=b"\x00"),
        lambda h: h["layout"][1][0].__setitem__(1, "float64"),
        lambda h: h["layout"][1][0].__setitem__(1, "no_such_dtype"),
        lambda h: h["layout"][1].append(["['x']", "float32", [2]]),
        lambda h: h.update(version="7"),
        lambda h: h.update(table=_set_first_mode(h["table"], 3)),
        lambda h: h.update(table=_set_first_mode(h["table"], 2)),
        lambda h: h.update(digests=bytes(len(h["digests"]))),
    ],
)
def test_inconsistent_headers_are_format_errors(edit: Any) -> None:
    base, data = _packed_blob()
    with pytest.raises(FormatError):
        decode(reseal(data, edit), base=base)


def test_corrupt_body_byte_is_a_checksum_mismatch() -> None:
    base, data = _packed_blob()
    meta = read_meta(data)
    for pos in (meta.body_offset, (meta.body_offset + len(data)) // 2, len(data) - 1):
        bad = bytearray(data)
        bad[pos] ^= 0x40
        with pytest.raises(ChecksumMismatch):
            verify(bad)
        with pytest.raises(ChecksumMismatch):
            decode(bad, base=base)


def test_large_payload_spanning_digest_chunks_round_trips() -> None:
    # Frames of 3 MiB over a 20 MiB payload cross 8 MiB digest chunks in every way; a tiny
    # tensor between the big ones makes chunks shared by frames of different widths.
    gen = torch.Generator().manual_seed(3)
    state = {
        "a": torch.randn(3 << 20, generator=gen),
        "small": torch.arange(3, dtype=torch.int16),
        "b": torch.randn(2 << 20, generator=gen).double(),
    }
    base = snapshot(state, version=1)
    state2 = {**state, "a": state["a"] * 1.001}
    cur = snapshot(state2, version=2)
    options = CodecOptions(frame_bytes=3 << 20)
    for raw, ref in ((base, None), (cur, base)):
        data = join(encode_packed(raw, rank=0, base=ref, options=options)[0])
        decoded = decode(data, base=ref)
        assert decoded.raw_digest == raw.raw_digest
        assert torch.equal(decoded.payload, raw.payload)


def test_decode_reuses_a_meta_read_before_and_still_verifies_the_body() -> None:
    raw = snapshot(sample_state(1), version=3)
    blob = bytearray(join(encode_full(raw, rank=0)[0]))
    meta = read_meta(blob)
    again = decode(blob, meta=meta)
    assert again.layout == raw.layout
    assert again.payload.numpy().tobytes() == raw.payload.numpy().tobytes()
    blob[-1] ^= 0x01  # a body byte: the meta read before cannot vouch for it
    with pytest.raises(ChecksumMismatch):
        decode(blob, meta=meta)


@pytest.mark.parametrize("chunks", [None, b"", bytes(range(8)), bytes(300), bytes(70000)])
def test_blob_header_is_byte_for_byte_a_packed_dict(chunks: bytes | None) -> None:
    """Headers are spliced from cached parts; they must equal packing the whole mapping, and
    the chunk digests (when present) are its last bytes, after the key finalize looks for."""
    layout, _ = flatten(sample_state(2))
    header = blobformat.full_header(layout, 7, 1, chunks)
    fields: dict[str, Any] = {
        "version": 7,
        "rank": 1,
        "stages": [["tiercheck.flatten/1", {}]],
        "layout": [
            layout.skeleton,
            [[s.path, str(s.dtype)[6:], list(s.shape)] for s in layout.specs],
        ],
        "holds": [],  # format 1.2: no array, DTensor or replica reference in the skeleton
    }
    if chunks is not None:
        fields["chunks"] = chunks
        assert header.endswith(blobformat.chunks_key(len(chunks)) + chunks)
    expected = msgpack.packb(fields, use_bin_type=True)
    assert header == expected


def test_a_known_header_is_not_decoded_again_and_describes_the_blob_the_same() -> None:
    raw = snapshot(sample_state(3), version=9)
    parts, meta = encode_full(raw, rank=2)  # described from what it was built of
    blob = bytearray(join(parts))
    assert meta == read_meta(blob)  # decoded from the bytes
    # finalize_full_blob with the layout it was written with, and with a wrong one.
    size, offset = full_blob_size(raw.layout, version=9, rank=2)
    dest = bytearray(size)
    write_full_blob(dest, raw.layout, version=9, rank=2)
    dest[offset:] = raw.payload.numpy().tobytes()
    sealed = finalize_full_blob(dest, raw_digest=raw.raw_digest, known=(raw.layout, 9, 2))
    assert sealed == read_meta(dest)
    assert sealed.chunk_digests == read_meta(dest).chunk_digests == raw.chunk_digests
    assert meta.chunk_digests == raw.chunk_digests
    other, _ = flatten(sample_state(4, scale=2))
    assert finalize_full_blob(dest, known=(other, 9, 2)) == read_meta(dest)
    assert finalize_full_blob(dest, known=(raw.layout, 10, 2)).version == 9
