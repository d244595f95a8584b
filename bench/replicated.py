"""Replicated state (``tiercheck.Replicated``): bytes each tier holds, and the restore it costs.

A DDP-shaped job: ``--ranks`` ranks as threads of this process, ``--per-node`` to a simulated
node, each saving the same fp32 model of ``--mb`` MiB (normal values: they compress a little,
as real weights do) and 64 KiB of its own. Saved once plainly and once with the model marked
``Replicated``, it prints:

* the bytes of each node's shared memory and of the persistent tier (one base version), and
  the ratio marked / plain -- with the mark, each node's memory holds one copy and the
  persistent tier one in all (each node's first rank but rank 0 refers to rank 0's blob there);
* the median seconds of a restore from the persistent tier (memory wiped), marked / plain, in
  the same run and alternating: every rank then reads rank 0's blob (and its node's first
  rank's) instead of its own whole one.

Usage::

    python bench/replicated.py [--ranks 8] [--per-node 4] [--mb 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import tiercheck
from tiercheck.testing import LocalGroup

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import run_ranks


def checkpointer(
    root: Path, rank: int, args: argparse.Namespace, group: LocalGroup
) -> tiercheck.SyncCheckpointer:
    return tiercheck.SyncCheckpointer(
        "bench",
        rank=rank,
        world_size=args.ranks,
        ranks_per_node=args.per_node,
        coordinator=group.coordinator(rank),
        local_root=root / f"node{rank // args.per_node}",
        persistent=(root / "durable").as_uri(),
        tiers=["local", "persistent"],
        persist="all",
    )


def state(model: dict[str, torch.Tensor], rank: int, marked: bool) -> dict[str, Any]:
    own = torch.full((16384,), float(rank))
    return {"model": tiercheck.Replicated(model) if marked else model, "own": own}


def folder_bytes(folder: Path) -> int:
    return sum(
        p.stat().st_size
        for p in folder.rglob("v*/r*")
        if p.is_file() and "quarantine" not in p.parts
    )


def save(
    root: Path, model: dict[str, torch.Tensor], args: argparse.Namespace, marked: bool
) -> None:
    group = LocalGroup(args.ranks)

    def one(rank: int) -> None:
        with checkpointer(root, rank, args, group) as ckpt:
            ckpt.save(0, state(model, rank, marked))
            ckpt.wait()

    run_ranks(args.ranks, one)


def restore_seconds(
    root: Path, model: dict[str, torch.Tensor], args: argparse.Namespace, marked: bool
) -> float:
    """The slowest rank's restore from the persistent tier, bit-exactness checked."""
    group = LocalGroup(args.ranks)

    def one(rank: int) -> float:
        target = state({k: torch.empty_like(v) for k, v in model.items()}, rank, marked)
        with checkpointer(root, rank, args, group) as ckpt:
            started = time.perf_counter()
            restored = ckpt.restore(target)
            took = time.perf_counter() - started
        if restored is None or restored.source_tier != "persistent":
            raise RuntimeError(f"rank {rank} did not restore from the persistent tier")
        got = target["model"].value if marked else target["model"]
        if not all(torch.equal(got[k], v) for k, v in model.items()):
            raise RuntimeError(f"rank {rank} restored other bytes")
        return took

    return max(run_ranks(args.ranks, one))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--per-node", type=int, default=4)
    parser.add_argument("--mb", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("results"))
    args = parser.parse_args()
    nodes = args.ranks // args.per_node
    g = torch.Generator().manual_seed(0)
    per = args.mb * 2**20 // 4 // 4  # four fp32 tensors
    model = {f"w{i}": torch.randn(per, generator=g) for i in range(4)}
    work = Path(tempfile.mkdtemp(prefix="tiercheck-bench-replicated-", dir="/dev/shm"))
    results: dict[str, Any] = {
        "ranks": args.ranks,
        "per_node": args.per_node,
        "model_bytes": sum(t.nbytes for t in model.values()),
    }
    try:
        roots = {}
        for marked in (False, True):
            root = roots[marked] = work / ("marked" if marked else "plain")
            save(root, model, args, marked)
            results["marked" if marked else "plain"] = {
                "memory_per_node": [folder_bytes(root / f"node{n}") for n in range(nodes)],
                "persistent": folder_bytes(root / "durable"),
            }
            for n in range(nodes):
                shutil.rmtree(root / f"node{n}")
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.repeats):
            for marked in (False, True):
                times[marked].append(restore_seconds(roots[marked], model, args, marked))
        plain, marked_ = results["plain"], results["marked"]
        results["ratio_memory_per_node"] = [
            round(m / p, 4)
            for m, p in zip(marked_["memory_per_node"], plain["memory_per_node"], strict=True)
        ]
        results["ratio_persistent"] = round(marked_["persistent"] / plain["persistent"], 4)
        results["restore_persistent_s"] = {
            "plain": statistics.median(times[False]),
            "marked": statistics.median(times[True]),
        }
        results["ratio_restore_persistent"] = round(
            statistics.median(times[True]) / statistics.median(times[False]), 3
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "replicated.json").write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
