"""One rank of a two-rank gloo job on loopback, as two simulated nodes (see test_preemption.py).

Tiers: local, peer and persistent; a ``tiercheck.Replicated`` value, stored once in the durable
tier (rank 1's blob refers to rank 0's) -- except by the flush, which writes each rank's blob
whole from its memory; ``base_every=1000``, so that version 0 is the only base and
the durable tier holds nothing else unless a flush on SIGTERM puts it there. Every version is a
pure function of version and rank. ``--mode``:

- ``train``: steps in lockstep (one all-reduce per step, as DDP's gradients), saving every step,
  until a signal ends it; each version this rank sees committed in the local tier is an event
  ``{"e": "local", "v": ...}``;
- ``stall``: saves versions 0..4, then all-reduces in a loop (the parent stops the other rank:
  this one's main thread then waits in a collective that never returns);
- ``restore``: restores (the node's memory is gone: from the durable tier), checks the bytes,
  and prints ``restored <version> from <tier>``.

Events go to ``events-r<rank>.jsonl`` under ``--out``, one ``os.write`` each (a kill must never
cut a line in half).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import tiercheck


def state_of(version: int, rank: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(version * 1000 + rank)
    # The same on every rank, saved once: rank 1 (node 1's first rank) refers to rank 0's copy
    # in the durable tier, and keeps its own in memory.
    shared = torch.Generator().manual_seed(version)
    return {
        "w": torch.randn(8192, generator=g),
        "model": tiercheck.Replicated(torch.randn(4096, generator=shared)),
        "step": version,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--persistent", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--mode", required=True)
    parser.add_argument("--grace", type=float, default=20.0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s rank %(process)d %(message)s")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    events = os.open(args.out / f"events-r{rank}.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND)

    def event(**fields: object) -> None:
        os.write(events, (json.dumps(fields) + "\n").encode())

    ckpt = tiercheck.SyncCheckpointer(
        "job",
        local_root=args.root / f"node{rank}",
        persistent=args.persistent,
        base_every=1000,
        peer_timeout=60,
        preemption_grace=args.grace,
    )
    ckpt.open()
    one = torch.ones(1)
    if args.mode == "restore":
        restored = ckpt.restore()
        assert restored is not None, "nothing restored"
        expected = state_of(restored.version, rank)
        assert torch.equal(restored.state["w"], expected["w"])
        assert torch.equal(restored.state["model"], expected["model"].value)  # type: ignore[attr-defined]
        assert restored.state["step"] == restored.version
        sys.stdout.write(f"restored {restored.version} from {restored.source_tier}\n")
        ckpt.close()
        dist.destroy_process_group()
        return 0
    handles = {}
    deadline = time.monotonic() + 120
    version = 0
    while time.monotonic() < deadline:
        dist.all_reduce(one)
        if args.mode == "train" or version < 5:
            handles[version] = ckpt.save(version, state_of(version, rank))
            for v, handle in list(handles.items()):
                if handle.committed("local"):
                    event(e="local", v=v)
                    del handles[v]
                elif v < version - 8:
                    del handles[v]
            version += 1
        elif version == 5:
            ckpt.wait()
            event(e="ready")
            version += 1
        time.sleep(0.02)
    event(e="no signal came")
    return 1


if __name__ == "__main__":
    sys.exit(main())
