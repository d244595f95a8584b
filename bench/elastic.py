"""Elastic restore: a job saved by N ranks restored on M ranks, against restoring it on N.

The ranks run as threads of this process (``tiercheck.testing.LocalGroup``), on one node, so
both restores share the machine the same way. The state is FSDP2-shaped: ``--tensors``
DTensors sharded on dim 0 over the old ranks (stored as their records, so no process group is
needed) plus a few plain leaves, ``--mb`` MiB in all. For each tier (the node's shared memory,
then the persistent tier once the memory is gone) it times, in the same run and alternating:

* N -> N: the N old ranks restore their own blobs (the baseline);
* N -> M: M ranks restore the same version resharded.

and prints the median seconds and the ratio N->M / N->N per tier.

Usage::

    python bench/elastic.py [--old 4] [--new 2 3] [--mb 256] [--tensors 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

import tiercheck
from tiercheck.codec.format.dtensor import DTensorShard
from tiercheck.testing import LocalGroup

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import run_ranks


def shard_of(full: torch.Tensor, rank: int, world: int) -> DTensorShard:
    rows = full.shape[0]
    chunk = math.ceil(rows / world)
    start = min(rank * chunk, rows)
    stop = min(start + chunk, rows)
    return DTensorShard(
        local=full[start:stop].clone(),
        shape=tuple(full.shape),
        stride=tuple(full.stride()),
        placements=(("shard", 0),),
        mesh=(world,),
        names=None,
        device="cpu",
        coord=(rank,),
        offset=(start, 0),
    )


def state_of(weights: list[torch.Tensor], rank: int, world: int) -> dict[str, Any]:
    return {
        "model": {f"layer{i}.weight": shard_of(w, rank, world) for i, w in enumerate(weights)},
        "lr": torch.tensor(1e-3),
        "step": 7,
    }


def checkpointer(root: Path, rank: int, world: int, group: LocalGroup, **kw: Any) -> Any:
    return tiercheck.SyncCheckpointer(
        "bench",
        rank=rank,
        world_size=world,
        ranks_per_node=world,
        coordinator=group.coordinator(rank),
        local_root=root / "node",
        persistent=(root / "durable").as_uri(),
        tiers=["local", "persistent"],
        persist="all",
        **kw,
    )


def restore_seconds(root: Path, world: int, elastic: bool) -> tuple[float, set[str]]:
    group = LocalGroup(world)

    def one(rank: int) -> tuple[float, str]:
        with checkpointer(root, rank, world, group, elastic=elastic) as ckpt:
            got = ckpt.restore()
            assert got is not None
            return got.seconds, got.source_tier

    out = run_ranks(world, one)
    return max(s for s, _ in out), {t for _, t in out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", type=int, default=4)
    parser.add_argument("--new", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    cols = 1024
    rows = max(1, (args.mb << 20) // (4 * cols * args.tensors))
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(rows, cols, generator=g) for _ in range(args.tensors)]
    work = Path(tempfile.mkdtemp(prefix="tiercheck-bench-elastic-", dir="/dev/shm"))
    results: dict[str, Any] = {
        "old_ranks": args.old,
        "mb": args.mb,
        "tensors": args.tensors,
        "rows": {},
    }
    try:
        saved = work / "saved"
        group = LocalGroup(args.old)

        def save(rank: int) -> None:
            with checkpointer(saved, rank, args.old, group) as ckpt:
                ckpt.save(0, state_of(weights, rank, args.old))
                ckpt.wait()

        run_ranks(args.old, save)
        for tier in ("local", "persistent"):
            for new in args.new:
                same: list[float] = []
                other: list[float] = []
                for _ in range(args.repeats):
                    for world, bucket in ((args.old, same), (new, other)):
                        run = work / "run"
                        shutil.rmtree(run, ignore_errors=True)
                        shutil.copytree(saved, run, symlinks=True)
                        if tier == "persistent":
                            shutil.rmtree(run / "node")
                        seconds, sources = restore_seconds(run, world, elastic=world != args.old)
                        assert sources == {tier}, sources
                        bucket.append(seconds)
                a, b = statistics.median(same), statistics.median(other)
                row = {"n_to_n_s": round(a, 4), "n_to_m_s": round(b, 4), "ratio": round(b / a, 2)}
                results["rows"][f"{tier} {args.old}->{new}"] = row
                print(
                    f"{tier:<10} {args.old}->{args.old} {a:7.3f} s   {args.old}->{new} "
                    f"{b:7.3f} s   ratio {b / a:5.2f}x",
                    flush=True,
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "elastic.json").write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    sys.exit(main())
