"""One rank of two that exchange on a :class:`TorchCoordinator` while rank 1 stops for real.

Run as ``python coordinator_worker.py RANK PORT OUT [MODE]``. Both ranks exchange once on the
``local`` channel. In mode ``pause`` (the default) rank 1 then writes ``ready`` and sleeps, and
the test stops it with a real SIGSTOP for longer than the coordinator's timeout, then continues
it (SIGCONT). Rank 0's exchange times out meanwhile; then each rank calls again until an
exchange on ``local`` works (at most ``RECOVER_S``). In mode ``gone`` rank 1 dies there instead
(``os._exit``), and rank 0 makes ``QUEUED`` more calls on ``local``, as the commit rounds queued
behind it would. Every outcome goes to ``OUT/r<rank>.jsonl`` as one JSON line, with how long the
call took.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch.distributed as dist

from tiercheck.consistency.coordinator import TorchCoordinator
from tiercheck.errors import PeerUnavailable

TIMEOUT_S = 1.0
RECOVER_S = 30.0
QUEUED = 8


def main() -> None:
    rank, port, out = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    mode = sys.argv[4] if len(sys.argv) > 4 else "pause"
    events = (out / f"r{rank}.jsonl").open("a", encoding="utf-8")

    def say(event: str, **fields: object) -> None:
        events.write(json.dumps({"e": event, "t": time.time(), **fields}) + "\n")
        events.flush()

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    coordinator = TorchCoordinator(["control", "local"], timeout=TIMEOUT_S)

    def exchange(channel: str, payload: bytes) -> bool:
        began = time.monotonic()
        try:
            got = coordinator.all_gather(channel, payload)
        except PeerUnavailable as exc:
            took = time.monotonic() - began
            say("failed", channel=channel, error=str(exc), broken=coordinator.broken, took=took)
            return False
        took = time.monotonic() - began
        say(
            "ok",
            channel=channel,
            got=[g.decode() for g in got],
            broken=coordinator.broken,
            took=took,
        )
        return True

    exchange("local", f"first{rank}".encode())
    if mode == "gone":
        if rank == 1:
            os._exit(0)
        for i in range(QUEUED):
            exchange("local", f"queued{i}".encode())
        coordinator.close()
        say("done")
        return
    if rank == 1:
        say("ready")
        time.sleep(1.0)  # the test stops this rank here
        say("continued")
    exchange("local", f"second{rank}".encode())
    deadline = time.monotonic() + RECOVER_S
    while not exchange("local", f"again{rank}".encode()) and time.monotonic() < deadline:
        time.sleep(0.05)
    exchange("control", f"control{rank}".encode())
    coordinator.close()
    say("done")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
