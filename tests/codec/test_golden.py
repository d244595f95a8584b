"""Golden blobs: committed files decoded on every run, so format drift fails loudly.

The files are made by ``tests/golden/make_golden.py``; this test only reads them.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.golden.make_golden import (
    BASE_VERSION,
    DELTA_VERSION,
    FILES,
    PACKED,
    golden_raw_states,
    golden_states,
)
from tiercheck.codec import decode, encode_full, encode_packed, read_meta, verify
from tiercheck.codec.packed.frames import LOW, ZSTD

from ._helpers import assert_same, join

GOLDEN = Path(__file__).resolve().parent.parent / "golden"


def read(name: str) -> bytes:
    return (GOLDEN / name).read_bytes()


def test_every_golden_file_is_present_and_small() -> None:
    for name in FILES:
        assert (GOLDEN / name).stat().st_size < 64 << 10, name


@pytest.mark.parametrize(
    "name", ["base.full.tcb", "base.full.v1_1.tcb", "base.full.v1_2.tcb", "base.packed.tcb"]
)
def test_golden_base_decodes_bit_exact(name: str) -> None:
    base_state, _ = golden_states()
    base_raw, _ = golden_raw_states()
    data = read(name)
    meta = verify(data)
    assert meta.version == BASE_VERSION
    assert meta.base is None
    decoded = decode(data)
    assert torch.equal(decoded.payload, base_raw.payload)
    assert decoded.raw_digest == base_raw.raw_digest
    assert_same(decoded.state(), base_state)


@pytest.mark.parametrize("name", ["delta.packed.tcb", "delta.raw.tcb"])
def test_golden_delta_decodes_bit_exact(name: str) -> None:
    _, delta_state = golden_states()
    base_raw, delta_raw = golden_raw_states()
    data = read(name)
    meta = verify(data)
    assert meta.version == DELTA_VERSION
    assert meta.base is not None
    assert meta.base.version == BASE_VERSION
    assert meta.base.raw_digest == base_raw.raw_digest
    base_from_file = decode(read("base.full.tcb"))
    decoded = decode(data, base=base_from_file)
    assert torch.equal(decoded.payload, delta_raw.payload)
    assert_same(decoded.state(), delta_state)


def test_golden_stage_lists() -> None:
    assert read_meta(read("base.full.tcb")).stages == ("tiercheck.flatten/1",)
    assert read_meta(read("base.packed.tcb")).stages == (
        "tiercheck.flatten/1",
        "tiercheck.planes/1",
        "tiercheck.zstd/1",
    )
    assert read_meta(read("delta.packed.tcb")).stages == (
        "tiercheck.flatten/1",
        "tiercheck.xor/1",
        "tiercheck.planes/1",
        "tiercheck.zstd/1",
    )
    assert read_meta(read("delta.raw.tcb")).stages == ("tiercheck.flatten/1", "tiercheck.xor/1")


def test_golden_files_exercise_every_plane_mode() -> None:
    meta = read_meta(read("delta.packed.tcb"))
    assert meta.packed is not None
    modes = set((meta.packed.table & np.uint64(3)).tolist())
    assert {LOW, ZSTD} <= modes


def test_full_blob_encoding_has_not_drifted() -> None:
    # A full blob has no compressor in it, so today's encoder must write the very same bytes.
    base_raw, _ = golden_raw_states()
    assert join(encode_full(base_raw, rank=0)[0]) == read("base.full.v1_2.tcb")


def test_golden_format_versions_and_chunk_digests() -> None:
    """The 1.0 full blob has no chunk digests; the 1.1 one has those of the payload; the 1.2
    one also says what its skeleton holds."""
    base_raw, _ = golden_raw_states()
    old, v11, new = read("base.full.tcb"), read("base.full.v1_1.tcb"), read("base.full.v1_2.tcb")
    assert struct.unpack("<HH", old[8:12]) == (1, 0)
    assert struct.unpack("<HH", v11[8:12]) == (1, 1)
    assert struct.unpack("<HH", new[8:12]) == (1, 2)
    assert read_meta(old).chunk_digests is None
    assert read_meta(v11).chunk_digests == read_meta(new).chunk_digests == base_raw.chunk_digests
    # The same payload every way: the digests and the body agree.
    assert read_meta(old).raw_digest == read_meta(new).raw_digest == base_raw.raw_digest


HOLDS = ("has_arrays", "has_dtensors", "has_refs")


@pytest.mark.parametrize("name", ["base.full.tcb", "base.full.v1_1.tcb", "base.full.v1_2.tcb"])
def test_what_a_skeleton_holds_is_read_from_a_1_2_header_and_found_in_an_older_one(
    name: str,
) -> None:
    layout = read_meta(read(name)).layout
    said = {h: layout.__dict__[h] for h in HOLDS if h in layout.__dict__}
    # Found by walking the skeleton (what a reader of a 1.0 or 1.1 blob does):
    walked = {h: getattr(type(layout), h).func(layout) for h in HOLDS}
    assert walked == {"has_arrays": True, "has_dtensors": False, "has_refs": False}
    if name.endswith("v1_2.tcb"):
        assert said == walked  # said by the header: no walk
    else:
        assert "has_arrays" not in said  # nothing says: walked when asked
        assert layout.has_arrays is True
        assert said.items() <= walked.items()


def test_a_packed_blob_of_today_says_what_its_skeleton_holds() -> None:
    base_raw, delta_raw = golden_raw_states()
    for raw, base in ((base_raw, None), (delta_raw, base_raw)):
        layout = read_meta(join(encode_packed(raw, rank=1, base=base, options=PACKED)[0])).layout
        said = {h: layout.__dict__.get(h) for h in HOLDS}
        assert said == {"has_arrays": True, "has_dtensors": False, "has_refs": False}
