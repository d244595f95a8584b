"""Regenerate the golden codec blobs in this folder (run by hand; tests only read them).

    .venv/bin/python -m tests.golden.make_golden

The states are built from SHAKE-256 byte streams and fixed numbers, never from a random number
generator, so :func:`golden_states` returns bit-identical states on every machine and torch
version; ``tests/codec/test_golden.py`` decodes the committed blobs and compares them with it.
Regenerate only on purpose -- a new format version -- and keep the old files readable: files
of an older format (:data:`OLD_FILES`) are never rewritten, they stay as the blobs written by
that format, for the tests that check they are still read.
"""

from __future__ import annotations

import collections
import hashlib
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tiercheck.codec import CodecOptions, RawState, encode_full, snapshot

HERE = Path(__file__).resolve().parent

BASE_VERSION = 100
DELTA_VERSION = 101

#: Files written by formats 1.0 and 1.1 (the 1.0 full blob has no chunk digests; no header
#: here says what its skeleton holds, which 1.2 adds). Kept as they are; :func:`main` does not
#: rewrite them.
OLD_FILES = {
    "base.full.tcb": "full blob of the base state, format 1.0: no chunk digests (rank 0)",
    "base.packed.tcb": "packed base: planes + zstd-1, 4 KiB frames (rank 1)",
    "delta.packed.tcb": "packed 1-step delta: xor + planes + zstd-1, 4 KiB frames (rank 1)",
    "delta.raw.tcb": "packed delta without compression: xor only (rank 0)",
    "base.full.v1_1.tcb": "full blob of the base state, format 1.1: chunk digests (rank 0)",
}

#: Files of the current format, written by :func:`main`.
NEW_FILES = {
    "base.full.v1_2.tcb": "full blob of the base state, format 1.2: chunk digests and what "
    "the skeleton holds (rank 0)",
}

#: file name -> (how it was encoded), for the test's messages.
FILES = {**OLD_FILES, **NEW_FILES}

#: How the packed files were encoded. Small frames and samples, so these few-KB states still
#: have several frames and sampled planes (and so raw low halves).
PACKED = CodecOptions(level=1, frame_bytes=4096, sample_bytes=64, threads=1)
UNCOMPRESSED = CodecOptions(level=None, frame_bytes=4096, threads=1)


def stream(label: str, nbytes: int) -> bytes:
    """``nbytes`` deterministic pseudo-random bytes named by ``label``."""
    return hashlib.shake_256(label.encode()).digest(nbytes)


def tensor(label: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor whose bytes come from :func:`stream` (every bit pattern, NaNs included)."""
    numel = 1
    for d in shape:
        numel *= d
    raw = bytearray(stream(label, numel * dtype.itemsize))
    if dtype == torch.bool:
        raw = bytearray(b & 1 for b in raw)
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape).clone()


def weights(label: str, shape: tuple[int, ...], scale: float) -> torch.Tensor:
    """Float32 values in [-scale, scale) (training-like, unlike raw random bits)."""
    ints = tensor(label, torch.int32, shape).to(torch.float64)
    return (ints / 2**31 * scale).to(torch.float32)


def nudge(t: torch.Tensor, label: str, bits: int) -> torch.Tensor:
    """``t`` with its low ``bits`` mantissa bits XORed with a stream: one training step."""
    ints = t.contiguous().view(torch.int32 if t.dtype == torch.float32 else torch.int16)
    noise = tensor(label, ints.dtype, tuple(ints.shape)) & ((1 << bits) - 1)
    return (ints ^ noise).view(t.dtype)


def _special_floats() -> list[float]:
    nan_payload = struct.unpack("<d", bytes.fromhex("0100000000f8ff7f"))[0]
    signaling = struct.unpack("<d", bytes.fromhex("0100000000f0ff7f"))[0]
    return [nan_payload, signaling, -0.0, float("inf"), float("-inf"), 5e-324]


def golden_states() -> tuple[dict[str, Any], dict[str, Any]]:
    """The base state (version 100) and the delta state (version 101)."""
    w = weights("w", (32, 16), 0.1)
    exp_avg = weights("exp_avg", (32, 16), 1e-3)
    model = collections.OrderedDict(
        [
            ("w", w),
            ("b", weights("b", (16,), 0.1).bfloat16()),
            ("e", tensor("e", torch.float16, (4, 4))),
            ("idx", torch.arange(5, dtype=torch.int64) * 1_000_003),
            ("mask", tensor("mask", torch.bool, (3, 3))),
            ("q", tensor("q", torch.uint8, (7,))),
            ("c", tensor("c", torch.complex64, (2, 3))),
            ("f8", tensor("f8", torch.float8_e4m3fn, (6,))),
            ("empty", torch.zeros(0, 3)),
        ]
    )
    model._metadata = collections.OrderedDict([("", {"version": 1})])  # type: ignore[attr-defined]
    base = {
        "model": model,
        "optim": {
            "state": {0: {"step": torch.tensor(3.0), "exp_avg": exp_avg}},
            "param_groups": [{"lr": 0.001, "betas": (0.9, 0.999), "params": [0], "foreach": None}],
        },
        "rng": {
            "python": (3, tuple(range(1000, 1625)), None),
            "numpy": ("MT19937", np.arange(624, dtype=np.uint32) * 7, 5, 0, 0.0),
            "torch": torch.frombuffer(bytearray(stream("torch-rng", 64)), dtype=torch.uint8),
        },
        "meta": {
            "step": BASE_VERSION,
            "name": "golden ✓",
            "floats": _special_floats(),
            "size": torch.Size([2, 3]),
            "blob": b"\x00\xff",
            "big": 1 << 100,
        },
    }
    delta_model = collections.OrderedDict(model)
    delta_model["w"] = nudge(w, "w+1", 12)
    delta_model["b"] = nudge(model["b"], "b+1", 3)
    delta_model["idx"] = torch.arange(6, dtype=torch.int64)  # new shape: stored whole
    delta_model._metadata = model._metadata  # type: ignore[attr-defined]
    delta = {
        "model": delta_model,
        "optim": {
            "state": {
                0: {
                    "step": torch.tensor(4.0),
                    "exp_avg": nudge(exp_avg, "exp_avg+1", 20),
                    "exp_avg_sq": weights("exp_avg_sq", (32, 16), 1e-6).abs(),  # new tensor
                }
            },
            "param_groups": base["optim"]["param_groups"],
        },
        "rng": base["rng"],
        "meta": {**base["meta"], "step": DELTA_VERSION},
    }
    return base, delta


def golden_raw_states() -> tuple[RawState, RawState]:
    """The two states as raw payloads (what the blobs decode to)."""
    base, delta = golden_states()
    return snapshot(base, version=BASE_VERSION), snapshot(delta, version=DELTA_VERSION)


def encode_all() -> dict[str, bytes]:
    """Every golden blob of the current format (:data:`NEW_FILES`), freshly encoded."""
    base, _delta = golden_raw_states()

    def join(parts: list[Any]) -> bytes:
        return b"".join(bytes(p) for p in parts)

    return {"base.full.v1_2.tcb": join(encode_full(base, rank=0)[0])}


def main() -> None:
    """Write the golden blobs of the current format next to this file."""
    for name, data in encode_all().items():
        (HERE / name).write_bytes(data)
        print(f"wrote {name}: {len(data)} bytes -- {FILES[name]}")


if __name__ == "__main__":
    main()
