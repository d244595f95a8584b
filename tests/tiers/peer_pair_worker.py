"""One rank of two for the peer tier's pair-epoch test (``tests/tiers/test_peer_pair.py``).

Run as ``python peer_pair_worker.py RANK PORT ROOT [MODE]``. Rank 1 holds rank 0's replicas
until ``ROOT/stop`` exists. Rank 0 stores a blob, then makes one transfer fail the way a pause in
the middle of it does -- the holder said "ready" and waits for data that never comes, until gloo
times out and closes the connection between the two ranks -- and then stores and reads blobs
again. It prints one JSON line: what each step gave.

``MODE`` ``late``: the two sides make a pair's group of one epoch far apart in time -- rank 0
first (it gives up), rank 1 once rank 0 has -- as a side paused or busy between answering
"ready" and the transfer does. Each prints how long its attempt took and how it ended; then
rank 0 stores a blob again.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

# Run as a script from this folder, which is first on the path then.
from two_ranks import peer_tier

from tiercheck.tiers.peer import PeerTier

TIMEOUT_S = 1.5


class _Nothing:
    """A transfer that never started (the sender paused before it)."""

    def wait(self) -> None:
        return None


async def requester(tier: PeerTier) -> dict[str, Any]:
    out: dict[str, Any] = {}
    await tier.put("a", b"first")
    out["epoch_before"] = tier._pair_epoch(1)
    real = tier._isend
    tier._isend = lambda *args: _Nothing()  # type: ignore[method-assign]
    try:
        await tier.put("lost", b"x" * 1000)
        out["lost"] = "stored"
    except Exception as exc:
        out["lost"] = type(exc).__name__
    tier._isend = real  # type: ignore[method-assign]
    out["epoch_after"] = tier._pair_epoch(1)
    # The next transfers work (after the holder counts as down for retry_after at most).
    deadline = time.monotonic() + 30
    errors = []
    while True:
        try:
            await tier.put("b", b"second")
            break
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}"[:200])
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.3)
    out["errors_before_b"] = errors
    out["a"] = bytes(await tier.get("a")).decode()
    out["b"] = bytes(await tier.get("b")).decode()
    out["exists_lost"] = await tier.exists("lost")
    return out


async def store_again(tier: PeerTier) -> str:
    """Store a blob, trying for up to 30 s; what the last try gave."""
    deadline = time.monotonic() + 30
    while True:
        try:
            await tier.put("c", b"third")
            return bytes(await tier.get("c")).decode()
        except Exception as exc:
            if time.monotonic() > deadline:
                return f"{type(exc).__name__}: {exc}"
            await asyncio.sleep(0.3)


def late(tier: PeerTier, rank: int, root: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    peer, epoch = 1 - rank, 5
    if rank == 1:
        while not (root / "go").exists():
            time.sleep(0.05)
    started = time.monotonic()
    try:
        tier._transfer_group(peer, epoch)
        out["made"] = "made"
    except Exception as exc:
        out["made"] = type(exc).__name__
    out["seconds"] = time.monotonic() - started
    (root / "go").touch()
    # The same epoch again: refused at once, never made a second time over the same keys.
    try:
        tier._transfer_group(peer, epoch)
        out["again"] = "made"
    except Exception as exc:
        out["again"] = type(exc).__name__
    return out


def main() -> None:
    rank, port, root = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    mode = sys.argv[4] if len(sys.argv) > 4 else "lost"
    tier = peer_tier(rank, port, root, session="pair", timeout=TIMEOUT_S, retry_after=0.2)
    if mode == "late":
        result = late(tier, rank, root)
        if rank == 1:
            (root / f"late{rank}.json").write_text(json.dumps(result))
            while not (root / "stop").exists():
                time.sleep(0.05)
        else:
            while not (root / "late1.json").exists():
                time.sleep(0.05)
            result["then"] = asyncio.run(store_again(tier))
            print(json.dumps({**result, "rank1": json.loads((root / "late1.json").read_text())}))
            (root / "stop").touch()
    elif rank == 0:
        result = asyncio.run(requester(tier))
        print(json.dumps(result), flush=True)
        (root / "stop").touch()
    else:
        while not (root / "stop").exists():
            time.sleep(0.05)
    asyncio.run(tier.aclose())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
