"""Stage tiercheck.xor/1: XOR against a base, matched by path, dtype and shape."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from tests.codec._helpers import assert_same, join, random_tensor, tensor_bytes
from tiercheck.codec import (
    CodecOptions,
    RawState,
    decode,
    encode_packed,
    flatten,
    match_base,
    read_meta,
    snapshot,
    supported_dtypes,
    xor_bits,
    xor_bytes,
)
from tiercheck.codec.encode import encoder
from tiercheck.errors import BaseMismatch


@pytest.mark.parametrize("dtype", supported_dtypes(), ids=str)
def test_xor_bits_round_trips_every_dtype(dtype: torch.dtype) -> None:
    a = random_tensor(dtype, (5, 3), seed=1)
    b = random_tensor(dtype, (5, 3), seed=2)
    delta = xor_bits(a, b)
    assert delta.dtype == torch.uint8
    assert delta.numel() == a.numel() * dtype.itemsize
    back = xor_bits(delta.view(dtype).reshape(a.shape), b)
    assert tensor_bytes(back) == tensor_bytes(a)


def test_xor_bits_needs_matching_tensors() -> None:
    with pytest.raises(ValueError, match="dtype and shape"):
        xor_bits(torch.zeros(3), torch.zeros(4))


@pytest.mark.parametrize("offset", range(9))
def test_xor_bytes_any_alignment_matches_numpy(offset: int) -> None:
    a = torch.randint(0, 256, (1000,), dtype=torch.uint8)
    b = torch.randint(0, 256, (1000,), dtype=torch.uint8)
    out = torch.empty(1000, dtype=torch.uint8)
    n = 1000 - 2 * offset
    xor_bytes(a[offset : offset + n], b[offset : offset + n], out[offset : offset + n])
    want = np.bitwise_xor(a.numpy(), b.numpy())[offset : offset + n]
    assert np.array_equal(out[offset : offset + n].numpy(), want)


def test_xor_bytes_checks_its_inputs() -> None:
    with pytest.raises(ValueError, match="uint8"):
        xor_bytes(torch.zeros(4), torch.zeros(4), torch.zeros(4))
    u = torch.zeros(4, dtype=torch.uint8)
    with pytest.raises(ValueError, match="one length"):
        xor_bytes(u, torch.zeros(5, dtype=torch.uint8), u)


def test_match_base_by_path_dtype_and_shape() -> None:
    base, _ = flatten({"a": torch.zeros(3), "b": torch.zeros(2), "c": torch.zeros(4)})
    cur, _ = flatten(
        {
            "new": torch.zeros(1),
            "a": torch.zeros(3),
            "b": torch.zeros(3),  # shape changed
            "c": torch.zeros(4, dtype=torch.float64),  # dtype changed
        }
    )
    assert match_base(cur, base) == [-1, 0, -1, -1]


def _adam_like(step: int, with_moments: bool) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(step)
    w = torch.randn(64, 32, generator=gen) * 0.02
    state: dict[str, Any] = {"model": {"w": w, "b": torch.zeros(32)}, "optim": {"state": {}}}
    if with_moments:
        state["optim"]["state"][0] = {
            "step": torch.tensor(float(step)),
            "exp_avg": torch.randn(64, 32, generator=gen) * 1e-3,
            "exp_avg_sq": torch.rand(64, 32, generator=gen) * 1e-6,
        }
    return state


def test_delta_round_trips_when_the_layout_changes() -> None:
    base = snapshot(_adam_like(0, with_moments=False), version=10)
    cur_state = _adam_like(0, with_moments=True)  # Adam's moments appear after step 1
    cur_state["model"]["w"] = cur_state["model"]["w"] + 1e-5
    cur = snapshot(cur_state, version=11)
    assert not cur.layout.compatible(base.layout)
    parts, meta = encode_packed(cur, rank=3, base=base)
    assert meta.base is not None
    assert meta.base.version == 10
    assert meta.stages[1] == "tiercheck.xor/1"
    decoded = decode(join(parts), base=base)
    assert torch.equal(decoded.payload, cur.payload)
    assert_same(decoded.state(), cur_state)


def test_delta_of_an_identical_state_is_tiny() -> None:
    state = _adam_like(1, with_moments=True)
    base = snapshot(state, version=1)
    cur = snapshot(state, version=2)
    parts, meta = encode_packed(cur, rank=0, base=base)
    assert meta.nbytes * 20 < cur.layout.payload_nbytes
    assert torch.equal(decode(join(parts), base=base).payload, cur.payload)


def _pair() -> tuple[RawState, RawState, bytes]:
    base = snapshot(_adam_like(1, with_moments=True), version=1)
    nxt = _adam_like(1, with_moments=True)
    nxt["model"]["w"] += 1e-4
    cur = snapshot(nxt, version=2)
    parts, _ = encode_packed(cur, rank=0, base=base)
    return base, cur, join(parts)


def test_missing_base_raises_base_mismatch() -> None:
    _, _, data = _pair()
    with pytest.raises(BaseMismatch):
        decode(data)


def test_wrong_base_raises_base_mismatch() -> None:
    base, cur, data = _pair()
    with pytest.raises(BaseMismatch):
        decode(data, base=cur)  # another version
    impostor = RawState(base.version, base.layout, base.payload.clone(), base.raw_digest ^ 1)
    with pytest.raises(BaseMismatch):
        decode(data, base=impostor)  # right version, other content


def test_delta_computed_on_the_device_path_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    # Force the torch (GPU) code path on CPU tensors: same decode result, bit for bit.
    base, cur, host_blob = _pair()
    monkeypatch.setattr(encoder, "_use_torch_path", lambda device: True)
    for options in (CodecOptions(), CodecOptions(level=None), CodecOptions(frame_bytes=4096)):
        parts, meta = encode_packed(cur, rank=0, base=base, options=options)
        assert torch.equal(decode(join(parts), base=base).payload, cur.payload)
        assert meta.raw_digest == read_meta(host_blob).raw_digest


def test_base_on_another_device_is_refused() -> None:
    base, cur, _ = _pair()
    other = RawState(base.version, base.layout, base.payload.to("meta"), base.raw_digest)
    with pytest.raises(ValueError, match="base payload"):
        encode_packed(cur, rank=0, base=other)
