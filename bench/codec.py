"""Benchmark of ``tiercheck.codec`` on real training states -- nothing is downloaded.

1. Trains a byte-level transformer (4 layers, d=256, about 3.3 M parameters) with AdamW on real
   text found on this machine: the Python standard library's own ``.py`` sources (the first
   8 MiB of them, sorted by name). It keeps the state at steps ``s``, ``s+1`` and ``s+10``.
2. Encodes three views of each state -- fp32 weights, bf16 weights (the fp32 master weights
   cast, as a mixed-precision run would hold them) and the whole fp32 state (weights + Adam
   moments + optimizer/bookkeeping) -- as a base (step ``s``), a 1-step delta (``s+1`` vs
   ``s``) and a 10-step delta (``s+10`` vs ``s``), with the default :class:`CodecOptions`.
3. Compares, in the same run, with plain zstd level 1 on the raw payload bytes (one call; and
   zstd's own multi-threaded mode for encoding -- its decoder has no threads).

Figures: ratio = raw payload bytes / blob bytes; GB/s = raw payload bytes (1e9) per second, the
best of ``--repeat`` runs (the machine is shared, the best run is the least disturbed one).
Decode is measured into fresh memory (``out=None``) and into a reused buffer (``out=``).

Run: ``.venv/bin/python bench/codec.py`` (about 2-3 minutes on 2 cores; ``--steps 20`` for a
quick check). Trained states are cached in ``bench/results/codec-states.tmp`` (ignored by git);
results go to ``bench/results/codec.json`` and a markdown table to stdout.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zstandard
from torch import nn

from tiercheck.codec import (
    CodecOptions,
    RawState,
    decode,
    encode_full,
    encode_packed,
    flatten,
    raw_digest,
    snapshot,
    write_payload,
)
from tiercheck.codec.packed.planes import join_planes, split_planes

RESULTS = Path(__file__).resolve().parent / "results"
CORPUS_BYTES = 8 << 20
SEQ, BATCH, WIDTH, LAYERS, HEADS = 128, 8, 256, 4, 4


# --- training ---------------------------------------------------------------------------------


def corpus() -> tuple[torch.Tensor, str]:
    """Real text available offline: the standard library's Python sources."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    data = b"".join(p.read_bytes() for p in files)[:CORPUS_BYTES]
    where = f"{len(data) / 2**20:.1f} MiB of {root}/*.py ({len(files)} files)"
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long(), where


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, HEADS, batch_first=True)
        self.ln2 = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(
            nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH)
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class ByteLM(nn.Module):
    """A small byte-level language model."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(256, WIDTH)
        self.pos = nn.Parameter(torch.zeros(SEQ, WIDTH))
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, 256)
        self.register_buffer("mask", torch.triu(torch.full((SEQ, SEQ), float("-inf")), 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x) + self.pos
        for block in self.blocks:
            h = block(h, self.mask)
        return self.head(self.ln(h))


def train(steps: int, log: Callable[[str], None]) -> tuple[dict[int, Any], dict[str, Any]]:
    """Train for ``steps + 10`` steps; return the states at ``steps``, ``+1``, ``+10``."""
    tokens, where = corpus()
    torch.manual_seed(0)
    model = ByteLM()
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)
    keep = {steps, steps + 1, steps + 10}
    states: dict[int, Any] = {}
    started = time.perf_counter()
    loss = torch.tensor(0.0)
    for step in range(steps + 11):
        starts = torch.randint(0, len(tokens) - SEQ - 1, (BATCH,), generator=gen)
        x = torch.stack([tokens[i : i + SEQ] for i in starts])
        y = torch.stack([tokens[i + 1 : i + SEQ + 1] for i in starts])
        for group in opt.param_groups:
            group["lr"] = 1e-3 * min(1.0, (step + 1) / 50)  # linear warm-up
        loss = nn.functional.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step in keep:
            states[step] = copy.deepcopy({"model": model.state_dict(), "optim": opt.state_dict()})
        if step % 50 == 0:
            log(f"  step {step:4d}  loss {loss.item():.3f}  {time.perf_counter() - started:5.1f} s")
    info = {
        "corpus": where,
        "params": params,
        "steps": steps,
        "final_loss": round(loss.item(), 4),
        "train_seconds": round(time.perf_counter() - started, 1),
        "model": f"byte-level transformer, {LAYERS} layers, d={WIDTH}, {HEADS} heads, seq {SEQ}",
        "optimizer": "AdamW lr 1e-3 (50-step warm-up), weight decay 0.1, batch 8",
    }
    return states, info


def load_or_train(
    steps: int, cache: Path, log: Callable[[str], None]
) -> tuple[dict[int, Any], dict[str, Any]]:
    """Trained states from ``cache`` when it matches ``steps``, else train and cache them."""
    if cache.exists():
        blob = torch.load(cache, weights_only=True)
        if blob["info"]["steps"] == steps:
            log(f"using cached states from {cache}")
            return blob["states"], blob["info"]
    log(f"training {steps + 10} steps (cached afterwards in {cache})")
    states, info = train(steps, log)
    cache.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"states": states, "info": info}, cache)
    return states, info


# --- measuring --------------------------------------------------------------------------------


def best_of(repeat: int, fn: Callable[[], Any]) -> tuple[float, Any]:
    """Best wall time of ``repeat`` runs after one warm-up, and the last result."""
    result = fn()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t)
    return best, result


def views(state: dict[str, Any]) -> dict[str, Any]:
    """The three states the benchmark encodes."""
    model = state["model"]
    return {
        "fp32 weights": {"model": model},
        "bf16 weights": {
            "model": {k: v.bfloat16() if v.is_floating_point() else v for k, v in model.items()}
        },
        "whole state (fp32)": state,
    }


def join_parts(parts: list[Any]) -> bytearray:
    """A blob as one writable buffer (what a tier hands back)."""
    out = bytearray(sum(len(p) for p in parts))
    pos = 0
    for p in parts:
        out[pos : pos + len(p)] = p
        pos += len(p)
    return out


def measure_case(
    cur: RawState, base: RawState | None, options: CodecOptions, repeat: int
) -> dict[str, float]:
    """Ratio and speeds of tiercheck and of plain zstd-1 for one state."""
    n = cur.layout.payload_nbytes
    t_enc, (parts, meta) = best_of(
        repeat, lambda: encode_packed(cur, rank=0, base=base, options=options)
    )
    blob = join_parts(parts)
    threads = options.threads
    t_dec, decoded = best_of(repeat, lambda: decode(blob, base=base, threads=threads))
    assert torch.equal(decoded.payload, cur.payload), "decode is not bit-exact"
    out = torch.empty(n, dtype=torch.uint8)
    t_dec_out, _ = best_of(repeat, lambda: decode(blob, base=base, out=out, threads=threads))
    raw = cur.payload.numpy().data
    cctx = zstandard.ZstdCompressor(level=1)
    t_zenc, packed = best_of(max(2, repeat // 2), lambda: cctx.compress(raw))
    dctx = zstandard.ZstdDecompressor()
    t_zdec, _ = best_of(max(2, repeat // 2), lambda: dctx.decompress(packed))
    # zstd's own multi-threaded mode, for a fair encode comparison (its decoder is one thread).
    mt = zstandard.ZstdCompressor(level=1, threads=-1)
    t_zmt, _ = best_of(max(2, repeat // 2), lambda: mt.compress(raw))
    return {
        "raw_bytes": n,
        "blob_bytes": meta.nbytes,
        "ratio": n / meta.nbytes,
        "encode_gbps": n / t_enc / 1e9,
        "decode_gbps": n / t_dec / 1e9,
        "decode_into_gbps": n / t_dec_out / 1e9,
        "zstd1_ratio": n / len(packed),
        "zstd1_encode_gbps": n / t_zenc / 1e9,
        "zstd1_decode_gbps": n / t_zdec / 1e9,
        "zstd1_mt_encode_gbps": n / t_zmt / 1e9,
    }


def measure_primitives(state: Any, repeat: int) -> dict[str, float]:
    """Speeds of the building blocks on the whole state (GB/s of raw payload)."""
    layout, tensors = flatten(state)
    n = layout.payload_nbytes
    dest = torch.empty(n, dtype=torch.uint8)
    write_payload(layout, tensors, dest)
    t_copy, _ = best_of(repeat, lambda: write_payload(layout, tensors, dest))
    t_digest, digest = best_of(repeat, lambda: raw_digest(dest))
    raw = RawState(0, layout, dest, digest)
    t_full, _ = best_of(repeat, lambda: encode_full(raw, rank=0))
    t_nocomp, _ = best_of(
        repeat, lambda: encode_packed(raw, rank=0, options=CodecOptions(level=None))
    )

    block = dest.numpy()[: (16 << 20)]
    m = len(block) // 4
    planes = [np.empty(m, dtype=np.uint8) for _ in range(4)]
    t_split, _ = best_of(repeat, lambda: split_planes(block, 4, planes))
    back = np.empty_like(block)
    t_join, _ = best_of(repeat, lambda: join_planes(planes, 4, back))
    assert np.array_equal(back, block)
    as_tensor = torch.from_numpy(block)
    t_naive, _ = best_of(2, lambda: as_tensor.view(m, 4).t().contiguous())
    k = len(block)
    return {
        "payload_bytes": n,
        "write_payload_gbps": n / t_copy / 1e9,
        "raw_digest_gbps": n / t_digest / 1e9,
        "encode_full_gbps": n / t_full / 1e9,
        "encode_packed_no_compression_gbps": n / t_nocomp / 1e9,
        "plane_split_fp32_1thread_gbps": k / t_split / 1e9,
        "plane_join_fp32_1thread_gbps": k / t_join / 1e9,
        "naive_torch_transpose_gbps": k / t_naive / 1e9,
    }


# --- report -----------------------------------------------------------------------------------

TARGETS = [
    ("whole state (fp32)", "1-step delta", "ratio", 1.45),
    ("whole state (fp32)", "1-step delta", "encode_gbps", 1.0),
    ("whole state (fp32)", "1-step delta", "decode_gbps", 2.0),
    ("bf16 weights", "1-step delta", "ratio", 2.5),
]


def markdown(results: dict[str, Any]) -> str:
    """The results as markdown tables."""
    lines = [
        "| state | case | tiercheck ratio | encode GB/s | decode GB/s | decode into GB/s "
        "| zstd-1 ratio | zstd-1 encode GB/s | zstd-1 MT encode GB/s | zstd-1 decode GB/s |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for view, cases in results["cases"].items():
        for case, r in cases.items():
            lines.append(
                f"| {view} | {case} | {r['ratio']:.2f} | {r['encode_gbps']:.2f} "
                f"| {r['decode_gbps']:.2f} | {r['decode_into_gbps']:.2f} | {r['zstd1_ratio']:.2f} "
                f"| {r['zstd1_encode_gbps']:.2f} | {r['zstd1_mt_encode_gbps']:.2f} "
                f"| {r['zstd1_decode_gbps']:.2f} |"
            )
    one = results["one_thread"]
    lines.append(
        f"| whole state (fp32), 1 thread | 1-step delta | {one['ratio']:.2f} "
        f"| {one['encode_gbps']:.2f} | {one['decode_gbps']:.2f} | {one['decode_into_gbps']:.2f} "
        f"| {one['zstd1_ratio']:.2f} | {one['zstd1_encode_gbps']:.2f} "
        f"| {one['zstd1_mt_encode_gbps']:.2f} | {one['zstd1_decode_gbps']:.2f} |"
    )
    p = results["primitives"]
    lines += [
        "",
        "| primitive (whole state) | GB/s |",
        "| --- | ---: |",
        f"| write_payload (snapshot copy) | {p['write_payload_gbps']:.2f} |",
        f"| raw_digest (xxh3 tree, threads) | {p['raw_digest_gbps']:.2f} |",
        f"| encode_full (zero copy, digest known) | {p['encode_full_gbps']:.1f} |",
        f"| encode_packed, compression off (base) | {p['encode_packed_no_compression_gbps']:.2f} |",
        f"| byte-plane split, fp32, 1 thread | {p['plane_split_fp32_1thread_gbps']:.2f} |",
        f"| byte-plane join, fp32, 1 thread | {p['plane_join_fp32_1thread_gbps']:.2f} |",
        f"| naive torch transpose split, 1 thread | {p['naive_torch_transpose_gbps']:.2f} |",
        "",
        "| target | measured | met |",
        "| --- | ---: | :---: |",
    ]
    for view, case, key, want in TARGETS:
        got = results["cases"][view][case][key]
        lines.append(
            f"| {view}, {case}: {key} >= {want} | {got:.2f} | {'yes' if got >= want else 'no'} |"
        )
    got = p["encode_packed_no_compression_gbps"]
    lines.append(
        f"| base, compression off: encode GB/s >= 3 | {got:.2f} | {'yes' if got >= 3 else 'no'} |"
    )
    return "\n".join(lines)


def main() -> None:
    """Run the benchmark and report."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--steps", type=int, default=200, help="step s of the base state")
    parser.add_argument("--repeat", type=int, default=15, help="timed runs per figure (best)")
    parser.add_argument("--cache", type=Path, default=RESULTS / "codec-states.tmp")
    parser.add_argument("--out", type=Path, default=RESULTS / "codec.json")
    args = parser.parse_args()
    started = time.perf_counter()

    def log(msg: str) -> None:
        print(msg, flush=True)

    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    load_at_start = os.getloadavg()
    states, info = load_or_train(args.steps, args.cache, log)
    s = args.steps
    options = CodecOptions()
    results: dict[str, Any] = {"training": info, "cases": {}}
    log("encoding")
    snaps = {step: views(states[step]) for step in (s, s + 1, s + 10)}
    for view in snaps[s]:
        base = snapshot(snaps[s][view], version=s)
        cases = {
            "base": measure_case(base, None, options, args.repeat),
            "1-step delta": measure_case(
                snapshot(snaps[s + 1][view], version=s + 1), base, options, args.repeat
            ),
            "10-step delta": measure_case(
                snapshot(snaps[s + 10][view], version=s + 10), base, options, args.repeat
            ),
        }
        results["cases"][view] = cases
        log(f"  {view}: done")
    whole = snaps[s]["whole state (fp32)"]
    one = CodecOptions(threads=1)
    results["one_thread"] = measure_case(
        snapshot(snaps[s + 1]["whole state (fp32)"], version=s + 1),
        snapshot(whole, version=s),
        one,
        args.repeat,
    )
    results["primitives"] = measure_primitives(states[s], args.repeat)
    results["machine"] = {
        "cpu": platform.processor() or platform.machine(),
        "cores": threads,
        "load_average_at_start": load_at_start,
        "load_average_at_end": os.getloadavg(),
        "torch": torch.__version__,
        "zstandard": zstandard.__version__,
        "options": repr(options),
    }
    results["seconds"] = round(time.perf_counter() - started, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    log("")
    log(
        f"Model: {info['model']}, {info['params'] / 1e6:.2f} M params, {info['optimizer']}; "
        f"{info['steps']} + 10 steps on {info['corpus']} (final loss {info['final_loss']}). "
        f"Base = step {s}, deltas against it. {threads} cores, best of {args.repeat}; "
        f"load average {load_at_start[0]:.2f} at start (other work on the machine skews "
        "the speeds)."
    )
    log("")
    log(markdown(results))
    log("")
    log(f"wrote {args.out}; total {results['seconds']} s")


if __name__ == "__main__":
    main()
