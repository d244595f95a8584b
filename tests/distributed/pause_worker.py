"""One rank of a two-rank torchrun job whose rank 1 is stopped for real (see test_pause.py).

Each step all-reduces a tensor over gloo (training) and saves the step's version, a pure
function of the version and the rank. At ``--pause-at`` rank 1 writes a ``ready`` event and
sleeps between the training step and its save; the test stops it there with SIGSTOP for longer
than ``peer_timeout`` and continues it with SIGCONT. Every save's event carries
:meth:`~tiercheck.Checkpointer.health`; at the end, every version's outcome in each tier. The
``tiercheck`` log goes to ``<out>/log-r<rank>.txt``.

``--restore`` restores instead (with ``--tiers`` naming the tiers) and checks the bytes.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import tiercheck


def state_of(version: int, rank: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(version * 1000 + rank)
    return {"w": torch.randn(4096, generator=g), "step": version}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--persistent", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--pause-at", type=int, default=6)
    parser.add_argument("--peer-timeout", type=float, default=1.5)
    parser.add_argument("--behind-seconds", type=float, default=2.0)
    parser.add_argument("--restore", action="store_true")
    parser.add_argument("--tiers", default="local,persistent")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    log = logging.FileHandler(args.out / f"log-r{rank}.txt")
    log.setFormatter(logging.Formatter("%(relativeCreated)d %(levelname)s %(message)s"))
    logging.getLogger("tiercheck").addHandler(log)
    logging.getLogger("tiercheck").setLevel(
        logging.DEBUG if os.environ.get("PAUSE_DEBUG") else logging.INFO
    )
    events = (args.out / f"events-r{rank}.jsonl").open("a", encoding="utf-8")

    def say(event: str, **fields: Any) -> None:
        events.write(json.dumps({"e": event, "t": time.time(), "rank": rank, **fields}) + "\n")
        events.flush()

    node = rank // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    ckpt = tiercheck.SyncCheckpointer(
        "pause",
        local_root=args.root / f"node{node}",
        persistent=args.persistent,
        tiers=args.tiers.split(","),
        base_every=2,
        peer_timeout=args.peer_timeout,
        behind_seconds=args.behind_seconds,
        behind_saves=100,
    )
    with ckpt:
        if args.restore:
            restored = ckpt.restore()
            assert restored is not None, "nothing restored"
            exact = torch.equal(restored.state["w"], state_of(restored.version, rank)["w"])
            say("restored", version=restored.version, source=restored.source_tier, exact=exact)
        else:
            handles = []
            for version in range(args.steps):
                if version == args.pause_at:
                    # Every round before the pause ends first, so that only the version saved
                    # across it straddles it (on a loaded machine the durable rounds of the
                    # bases before it could still be running when rank 1 stops).
                    ckpt.wait()
                grad = torch.ones(1)
                dist.all_reduce(grad)  # training: every rank waits for the others here
                if rank == 1 and version == args.pause_at:
                    say("ready", pid=os.getpid())
                    time.sleep(1.0)  # the test stops this rank here
                began = time.monotonic()
                handles.append(ckpt.save(version, state_of(version, rank)))
                took = time.monotonic() - began
                health = {n: asdict(h) for n, h in ckpt.health().tiers.items()}
                say("saved", version=version, health=health, took=took)
                time.sleep(0.1)
            ckpt.wait()
            outcomes = {h.version: {n: s.state for n, s in h.stats.tiers.items()} for h in handles}
            health = {n: asdict(h) for n, h in ckpt.health().tiers.items()}
            say("end", outcomes=outcomes, health=health)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
