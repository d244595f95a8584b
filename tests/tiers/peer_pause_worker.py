"""One rank of two for the peer tier's pause hunt (``tests/tiers/test_peer_pauses.py``).

Run as ``python peer_pause_worker.py RANK PORT ROOT TIMEOUT``. Until ``ROOT/stop`` exists the
rank stores a blob with the other rank (a put), while it also removes an older one and reads
a recent one back -- the traffic of a save, retention and a restore at once -- and appends one
JSON line per put to ``ROOT/r<RANK>.jsonl``: when it started and ended, and whether it worked.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from pathlib import Path

# Run as a script from this folder, which is first on the path then.
from two_ranks import peer_tier

from tiercheck.tiers.peer import PeerTier


async def traffic(tier: PeerTier, rank: int, root: Path) -> None:
    payload = bytes(200_000)
    with (root / f"r{rank}.jsonl").open("a") as out:
        i = 0
        while not (root / "stop").exists():
            i += 1

            async def put(i: int = i) -> tuple[bool, str]:
                try:
                    await tier.put(f"v{i:06d}", payload)
                except Exception as exc:
                    return False, f"{type(exc).__name__}: {exc}"[:300]
                return True, ""

            async def aside(i: int = i) -> None:
                # Outcomes do not matter here: the puts are what the hunt watches.
                with contextlib.suppress(Exception):
                    if i > 3:
                        await tier.delete(f"v{i - 3:06d}")
                    if i > 2 and i % 3 == 0:
                        await tier.get(f"v{i - 1:06d}")

            started = time.time()
            (ok, error), _ = await asyncio.gather(put(), aside())
            line = {"t": started, "e": time.time(), "ok": ok, "err": error}
            out.write(json.dumps(line) + "\n")
            out.flush()
            await asyncio.sleep(0.05)


def main() -> None:
    rank, port, root = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    timeout = float(sys.argv[4])
    tier = peer_tier(rank, port, root, session="hunt", timeout=timeout, retry_after=None)
    asyncio.run(traffic(tier, rank, root))
    sys.stdout.flush()
    # The other rank may be gone already: leave without the collective teardown.
    os._exit(0)


if __name__ == "__main__":
    main()
