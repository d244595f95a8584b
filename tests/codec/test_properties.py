"""Property tests: random states round-trip bit-exact; any flipped bit is always detected."""

from __future__ import annotations

import collections
import struct
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tiercheck.codec import (
    CodecOptions,
    decode,
    encode_full,
    encode_packed,
    read_meta,
    snapshot,
    supported_dtypes,
    verify,
)
from tiercheck.errors import ChecksumMismatch, FormatError

from ._helpers import assert_same, byte_tensor, copy_tensor, join

DTYPES = supported_dtypes()


@st.composite
def tensors(draw: st.DrawFn, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A tensor of any dtype, shape (0-dim and empty included) and bit pattern; sometimes a
    non-contiguous view."""
    dtype = dtype or draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 6), max_size=3)))
    numel = 1
    for d in shape:
        numel *= d
    raw = bytearray(
        draw(st.binary(min_size=numel * dtype.itemsize, max_size=numel * dtype.itemsize))
    )
    if dtype == torch.bool:
        raw = bytearray(b & 1 for b in raw)
    flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.zeros(0, dtype=torch.uint8)
    t = flat.clone().view(dtype).reshape(shape)
    if t.dim() >= 2 and draw(st.booleans()):
        t = t.transpose(0, 1)
    return t


def _float_from_bits(bits: int) -> float:
    return float(struct.unpack("<d", bits.to_bytes(8, "little"))[0])


leaves = st.one_of(
    tensors(),
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(0, 2**64 - 1).map(_float_from_bits),  # every float bit pattern
    st.complex_numbers(allow_nan=True),
    st.text(max_size=8),
    st.binary(max_size=8),
)
keys = st.one_of(st.text(max_size=6), st.integers(-(2**65), 2**65))


def containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(keys, children, max_size=4),
        st.dictionaries(keys, children, max_size=3).map(collections.OrderedDict),
    )


states = st.dictionaries(
    st.text(max_size=6), st.recursive(leaves, containers, max_leaves=10), max_size=5
)

options = st.builds(
    CodecOptions,
    level=st.sampled_from([None, 1, 3, -1]),
    frame_bytes=st.sampled_from([4096, 1 << 20]),
    planes=st.booleans(),
    sample_bytes=st.sampled_from([64, 32 << 10]),
    threads=st.sampled_from([1, 2]),
)


@given(states)
def test_random_states_round_trip_through_full_blobs(state: dict[str, Any]) -> None:
    raw = snapshot(state, version=1)
    decoded = decode(join(encode_full(raw, rank=0)[0]))
    assert_same(decoded.state(), state)


@given(states, options)
def test_random_states_round_trip_through_packed_blobs(
    state: dict[str, Any], opts: CodecOptions
) -> None:
    raw = snapshot(state, version=1)
    decoded = decode(join(encode_packed(raw, rank=0, options=opts)[0]))
    assert_same(decoded.state(), state)


@st.composite
def state_pairs(draw: st.DrawFn) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A base of tensors, and a next version where each tensor kept, changed a few bits,
    changed dtype or shape, or vanished -- plus new tensors."""
    base = draw(st.dictionaries(st.text(max_size=4), tensors(), max_size=6))
    cur: dict[str, Any] = {}
    for key, t in base.items():
        action = draw(st.sampled_from(["same", "bits", "dtype", "shape", "drop"]))
        if action == "same":
            cur[key] = copy_tensor(t)
        elif action == "bits":
            flat = byte_tensor(t)
            for pos in draw(st.lists(st.integers(0, max(0, flat.numel() - 1)), max_size=4)):
                if flat.numel():
                    flat[pos] ^= 1 << draw(st.integers(0, 7 if t.dtype != torch.bool else 0))
            cur[key] = flat.view(t.dtype).reshape(t.shape)
        elif action in ("dtype", "shape"):
            cur[key] = draw(tensors())
    for key, t in draw(
        st.dictionaries(st.text(min_size=5, max_size=6), tensors(), max_size=3)
    ).items():
        cur[key] = t
    cur["meta"] = {"step": draw(st.integers(0, 10**6))}
    return base, cur


@given(state_pairs(), options)
def test_random_deltas_round_trip(
    pair: tuple[dict[str, Any], dict[str, Any]], opts: CodecOptions
) -> None:
    base_state, cur_state = pair
    base = snapshot(base_state, version=1)
    cur = snapshot(cur_state, version=2)
    parts, meta = encode_packed(cur, rank=0, base=base, options=opts)
    assert meta.base is not None
    decoded = decode(join(parts), base=base)
    assert torch.equal(decoded.payload, cur.payload)
    assert_same(decoded.state(), cur_state)


def _detected(data: bytes | bytearray, base: Any) -> bool:
    """Whether every reader refuses ``data`` with a typed error."""
    for read in (lambda: verify(data), lambda: decode(data, base=base)):
        try:
            read()
        except (ChecksumMismatch, FormatError):
            continue
        return False
    return True


@st.composite
def blobs(draw: st.DrawFn) -> tuple[bytes, Any]:
    """A full blob, a packed base or a packed delta of a random state (with its base)."""
    base_state, cur_state = draw(state_pairs())
    base = snapshot(base_state, version=1)
    cur = snapshot(cur_state, version=2)
    kind = draw(st.sampled_from(["full", "packed", "delta"]))
    opts = draw(options)
    if kind == "full":
        return join(encode_full(cur, rank=0)[0]), None
    if kind == "packed":
        return join(encode_packed(cur, rank=0, options=opts)[0]), None
    return join(encode_packed(cur, rank=0, base=base, options=opts)[0]), base


@given(blobs(), st.data())
def test_any_flipped_bit_is_detected(blob_and_base: tuple[bytes, Any], data: st.DataObject) -> None:
    blob, base = blob_and_base
    bit = data.draw(st.integers(0, len(blob) * 8 - 1))
    bad = bytearray(blob)
    bad[bit // 8] ^= 1 << (bit % 8)
    assert _detected(bad, base), f"flipped bit {bit} of {len(blob)} bytes went unnoticed"


@pytest.mark.parametrize("kind", ["full", "delta"])
def test_every_single_bit_flip_is_detected_exhaustively(kind: str) -> None:
    """Flip each bit of the preamble and header, and one bit of every body byte."""
    base = snapshot({"w": torch.arange(64.0), "i": torch.arange(5)}, version=1)
    cur = snapshot({"w": torch.arange(64.0) + 0.5, "i": torch.arange(5), "step": 2}, version=2)
    if kind == "full":
        blob, ref = join(encode_full(cur, rank=0)[0]), None
    else:
        blob, ref = join(encode_packed(cur, rank=0, base=base)[0]), base
    body = read_meta(blob).body_offset
    bits = list(range(body * 8)) + [8 * i + i % 8 for i in range(body, len(blob))]
    for bit in bits:
        bad = bytearray(blob)
        bad[bit // 8] ^= 1 << (bit % 8)
        assert _detected(bad, ref), f"flipped bit {bit} of {len(blob)} bytes went unnoticed"
