"""The peer tier against a raw gloo send, and restore time from each tier.

Two processes on loopback, each its own simulated node. In the same run:

1. a raw ``torch.distributed`` send of N bytes (gloo, chunked and posted at once, the fastest
   way to move them) against ``PeerTier.put`` of the same N bytes (committed in the holder's
   memory, acknowledged): the ratio is the peer tier's overhead (target <= 1.3x);
2. a checkpointer save of a model-shaped state to local + peer + persistent, then restores
   from each tier in turn (local; peer once the own copies are gone; persistent once the
   replicas are gone too).

Usage::

    python bench/peer.py [--mb 64 256] [--state-mb 100] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from save import make_state

import tiercheck
from tiercheck.tiers.peer import PeerTier
from tiercheck.topology import Topology

CHUNK = 64 << 20


def raw_send(data: torch.Tensor, rank: int, group: Any) -> float:
    """Seconds to move ``data`` from rank 0 to rank 1 (posted at once, then waited)."""
    dist.barrier(group=group)
    started = time.perf_counter()
    pieces = [data[a : a + CHUNK] for a in range(0, data.numel(), CHUNK)]
    if rank == 0:
        works = [dist.isend(p, 1, group=group, tag=i) for i, p in enumerate(pieces)]
    else:
        works = [dist.irecv(p, 0, group=group, tag=i) for i, p in enumerate(pieces)]
    for w in works:
        w.wait()
    elapsed = time.perf_counter() - started
    dist.barrier(group=group)
    return elapsed


def bench_transfer(rank: int, root: Path, sizes_mb: list[int], repeats: int) -> dict[str, Any]:
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=120))
    peer_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=120))
    tier = PeerTier(
        topology=Topology(rank, 2, 1),
        holder_root=root / f"holder{rank}",
        namespace="bench",
        session="bench-peer",
        group=peer_group,
    )
    out: dict[str, Any] = {}
    for mb in sizes_mb:
        data = torch.randint(0, 255, (mb << 20,), dtype=torch.uint8)
        sink = torch.zeros_like(data)  # warm pages on the receiver: a fair baseline
        raw, peer = [], []
        for i in range(repeats):
            raw.append(raw_send(data if rank == 0 else sink, rank, group))
            dist.barrier(group=group)
            if rank == 0:
                started = time.perf_counter()
                asyncio.run(tier.put(f"blob{i}", memoryview(data.numpy())))
                peer.append(time.perf_counter() - started)
                # Steady state, as retention runs it: the previous replica goes, and its
                # memory serves a later one.
                asyncio.run(tier.delete(f"blob{i}"))
            dist.barrier(group=group)
        if rank == 0:
            r, p = statistics.median(raw), statistics.median(peer)
            out[f"{mb}MB"] = {
                "raw_send_s": r,
                "peer_put_s": p,
                "ratio": p / r,
                "raw_GBps": (mb << 20) / r / 1e9,
                "peer_GBps": (mb << 20) / p / 1e9,
            }
    dist.barrier(group=group)
    asyncio.run(tier.aclose())
    return out


def bench_restore(rank: int, root: Path, state_mb: int, repeats: int) -> dict[str, Any]:
    """Save once, then restore as a restarted process would, after losing more each time."""
    node = root / f"node{rank}"
    state = make_state(state_mb)
    times: dict[str, list[float]] = {"local": [], "peer": [], "persistent": []}
    commit_peer = []
    for round_ in range(repeats):

        def open_ckpt(job: str = f"bench-restore-{round_}") -> tiercheck.SyncCheckpointer:
            return tiercheck.SyncCheckpointer(
                job,
                local_root=node,
                persistent=(root / "durable").as_uri(),
                tiers=["local", "peer", "persistent"],
                ranks_per_node=1,
                base_every=1,
            )

        with open_ckpt() as ckpt:
            handle = ckpt.save(0, state)
            ckpt.wait()
            commit_peer.append(handle.stats.tiers["peer"].seconds or float("nan"))
        for tier in ("local", "peer", "persistent"):
            dist.barrier()
            if tier == "peer":  # this node's own copies are gone; the replicas it holds stay
                shutil.rmtree(node / "blobs", ignore_errors=True)
            if tier == "persistent":  # the whole node's memory is gone
                shutil.rmtree(node, ignore_errors=True)
            dist.barrier()
            with open_ckpt() as ckpt:
                # Both ranks opened: the restore's first exchange does not wait out the other
                # rank's opening (which restored.seconds would count).
                dist.barrier()
                restored = ckpt.restore()
                assert restored is not None
                assert restored.source_tier == tier, (restored.source_tier, tier)
                times[tier].append(restored.seconds)
        shutil.rmtree(node, ignore_errors=True)
    raw = sum(t.numel() * t.element_size() for t in _tensors(state))
    return {
        "state_MB": raw / 2**20,
        "restore_s": {k: statistics.median(v) for k, v in times.items()},
        "save_to_peer_commit_s": statistics.median(commit_peer),
    }


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    return []


def worker(rank: int, port: int, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=300),
    )
    try:
        transfer = bench_transfer(rank, root, args.mb, args.repeats)
        restore = bench_restore(rank, root, args.state_mb, max(3, args.repeats // 2))
    finally:
        dist.destroy_process_group()
    return {"transfer": transfer, "restore": restore}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--state-mb", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=Path("bench/results/peer.json"))
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--root", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.rank == 1:  # the second process, started below
        worker(1, args.port, args, args.root)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    root = Path(tempfile.mkdtemp(prefix="tiercheck-bench-peer-", dir=shm))
    argv = [sys.executable, __file__, "--rank", "1", "--port", str(port), "--root", str(root),
            "--mb", *map(str, args.mb), "--state-mb", str(args.state_mb),
            "--repeats", str(args.repeats)]  # fmt: skip
    other = subprocess.Popen(argv, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        result = worker(0, port, args, root)
    finally:
        other.wait(600)
        shutil.rmtree(root, ignore_errors=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print("| blob | raw gloo send | peer tier put (committed) | ratio (target <= 1.3x) |")
    print("| --- | --: | --: | --: |")
    for size, r in result["transfer"].items():
        print(
            f"| {size} | {r['raw_send_s']:.3f} s ({r['raw_GBps']:.2f} GB/s) | "
            f"{r['peer_put_s']:.3f} s ({r['peer_GBps']:.2f} GB/s) | {r['ratio']:.2f}x |"
        )
    rs = result["restore"]
    print(f"\nrestore of a {rs['state_MB']:.0f} MB state per rank, 2 ranks on 2 nodes:")
    print("| from | seconds |")
    print("| --- | --: |")
    for tier, seconds in rs["restore_s"].items():
        print(f"| {tier} | {seconds:.3f} |")
    print(
        f"\nsave -> committed in peer (encode + send + ack, all ranks): "
        f"{rs['save_to_peer_commit_s']:.3f} s"
    )


if __name__ == "__main__":
    main()
