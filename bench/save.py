"""How long a save blocks training, and how long until it is committed in each tier.

Baseline, in the same process on the same tensors: a plain torch copy into buffers allocated
once (the least any snapshot can cost) and ``clone()`` (what a naive async checkpointer does).
Figures are medians over the steady state (the first saves allocate memory and are reported
apart). Usage::

    python bench/save.py [--mb 100] [--saves 12] [--json bench/results/save.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import tiercheck


def make_state(total_mb: int) -> dict[str, Any]:
    """A model-and-AdamW-shaped state of about ``total_mb`` MB of fp32."""
    per = total_mb * (1 << 20) // 4 // 3
    rows = 1024
    g = torch.Generator().manual_seed(0)
    return {
        "model": {
            f"layer{i}.weight": torch.randn(rows, per // rows // 4, generator=g) for i in range(4)
        },
        "optim": {
            "state": {
                i: {
                    "exp_avg": torch.randn(rows, per // rows // 4, generator=g) * 1e-3,
                    "exp_avg_sq": torch.rand(rows, per // rows // 4, generator=g) * 1e-6,
                    "step": torch.tensor(float(i)),
                }
                for i in range(4)
            },
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0, 1, 2, 3]}],
        },
        "step": 0,
    }


def tensors(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in tensors(v)]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in tensors(v)]
    return []


def perturb(state: dict[str, Any], step: int) -> None:
    """A training step's worth of change (small, so deltas stay realistic)."""
    with torch.no_grad():
        for t in tensors(state):
            if t.is_floating_point() and t.numel() > 1:
                t.add_(1e-4 * (step % 3 - 1))
    state["step"] = step


class PlainCopy:
    """The baseline: copy every tensor into buffers allocated (and touched) once."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.src = tensors(state)
        self.dst = [torch.empty_like(t) for t in self.src]
        self()

    def __call__(self) -> float:
        t0 = time.perf_counter()
        for d, s in zip(self.dst, self.src, strict=True):
            d.copy_(s)
        return time.perf_counter() - t0


def clone_seconds(state: dict[str, Any]) -> float:
    t0 = time.perf_counter()
    kept = [t.clone() for t in tensors(state)]
    elapsed = time.perf_counter() - t0
    del kept
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=100)
    parser.add_argument("--saves", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", type=Path, default=Path("bench/results/save.json"))
    args = parser.parse_args()

    state = make_state(args.mb)
    raw_mb = sum(t.numel() * t.element_size() for t in tensors(state)) / 2**20
    plain = PlainCopy(state)

    with tempfile.TemporaryDirectory(prefix="tiercheck-bench-") as tmp:
        shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tmp)
        local_root = Path(tempfile.mkdtemp(prefix="tiercheck-bench-", dir=shm))
        try:
            ckpt = tiercheck.SyncCheckpointer(
                "bench-save",
                local_root=local_root,
                persistent=(Path(tmp) / "durable").as_uri(),
                base_every=4,
            )
            copies, clones, stalls, local_s, persistent_s = [], [], [], [], []
            with ckpt:
                for step in range(args.saves):
                    perturb(state, step)
                    # Baselines and save, interleaved: drift on a noisy machine hits all alike.
                    copies.append(plain())
                    clones.append(clone_seconds(state))
                    handle = ckpt.save(step, state)
                    # As a training step would, let the background finish before the next
                    # save, so each stall is measured on its own, not against the last save.
                    ckpt.wait()
                    tiers = handle.stats.tiers
                    if step >= args.warmup:
                        stalls.append(handle.stats.stall_s)
                        local_s.append(tiers["local"].seconds or float("nan"))
                        if "persistent" in tiers:
                            persistent_s.append(tiers["persistent"].seconds or float("nan"))
        finally:
            shutil.rmtree(local_root, ignore_errors=True)
    copy_s = statistics.median(copies[args.warmup :])
    clone_s = statistics.median(clones[args.warmup :])

    stall = statistics.median(stalls)
    result = {
        "state_mb": round(raw_mb, 1),
        "copy_s": copy_s,
        "clone_s": clone_s,
        "stall_s": stall,
        "stall_over_copy": stall / copy_s,
        "stall_over_clone": stall / clone_s,
        "local_commit_s": statistics.median(local_s),
        "persistent_commit_s": statistics.median(persistent_s) if persistent_s else None,
        "saves_measured": len(stalls),
        "target_stall_over_copy": 1.25,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(f"state: {raw_mb:.0f} MB fp32, {len(stalls)} saves measured after {args.warmup} warm-up")
    print("| measure | seconds | vs plain copy |")
    print("| --- | --: | --: |")
    print(f"| plain copy into preallocated buffers | {copy_s:.4f} | 1.00x |")
    print(f"| clone() | {clone_s:.4f} | {clone_s / copy_s:.2f}x |")
    print(f"| tiercheck save: stall | {stall:.4f} | **{stall / copy_s:.2f}x** (target <= 1.25x) |")
    local = result["local_commit_s"]
    print(f"| committed in local | {local:.4f} | {local / copy_s:.2f}x |")
    if persistent_s:
        p = result["persistent_commit_s"]
        print(f"| committed in persistent (bases, packed, on disk) | {p:.4f} | {p / copy_s:.2f}x |")


if __name__ == "__main__":
    main()
