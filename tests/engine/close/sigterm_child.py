"""A process that saves, says so, and waits for SIGTERM (see test_sigterm.py).

``--saves N`` saves versions 0..N-1 (each a pure function of its version) with
``base_every=5``: the durable tier takes the bases only (``persist="base"``, the default with a
memory tier), the local tier every version. Once every save is committed, it writes one line,
``ready``, and waits. ``--mode``:

- ``default``: nothing else (the previous SIGTERM handler is SIG_DFL);
- ``optout``: ``preemption=False``; prints the SIGTERM handler before and after opening;
- ``chain``: a handler installed before opening says which versions have a ``COMMIT`` record
  in the durable tier when it is called, then exits with code 7;
- ``ignore``: SIGTERM is ignored before opening: the process lives on after the flush and
  says so;
- ``framework``: once open, a handler is installed over tiercheck's that calls the one it found
  and goes on (as Lightning's does): the process lives on after the flush and says so;
- ``block``: the durable tier never finishes writing a version that is not a base
  (``preemption_grace=2``);
- ``slow``: the only tier is a durable one that takes 0.6 s per blob, and ``ready`` comes
  before its queue drained: what is in flight finishes before the process ends.

Each line is one ``os.write`` (a kill must not cut one in half, and print writes the text and
its newline apart).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

import tiercheck
from tiercheck.tiers import PersistentTier
from tiercheck.tiers.base import Buffer
from tiercheck.tiers.wrapper import DelegatingTier


def say(line: str) -> None:
    os.write(1, (line + "\n").encode())


def state_of(version: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(version)
    return {"w": torch.randn(4096, generator=g), "b": torch.randn(7, generator=g), "v": version}


def commits(folder: Path) -> list[int]:
    return sorted(int(p.parent.name[1:]) for p in folder.glob("v*/COMMIT"))


class SlowWrites(DelegatingTier):
    """Takes 0.6 s for every blob: saves queue up in front of it."""

    async def putv(self, key: str, parts: Sequence[Buffer]) -> None:
        await asyncio.sleep(0.6)
        await super().putv(key, parts)


class NeverWrites(DelegatingTier):
    """Writes bases (every 5th version) as the inner tier does; any other version never ends."""

    async def putv(self, key: str, parts: Sequence[Buffer]) -> None:
        version = int(key.split("/", maxsplit=1)[0][1:])
        if version % 5:
            await asyncio.Event().wait()
        await super().putv(key, parts)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--durable", type=Path, required=True)
    parser.add_argument("--saves", type=int, required=True)
    parser.add_argument("--mode", default="default")
    args = parser.parse_args()
    # The flush says what it did at INFO.
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    job = args.durable / "job"
    if args.mode == "chain":

        def previous(signum: int, frame: object) -> None:
            say(f"previous handler called; COMMIT records {commits(job)}")
            os._exit(7)

        signal.signal(signal.SIGTERM, previous)
    elif args.mode == "ignore":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    options: dict[str, object] = {}
    if args.mode == "optout":
        options["preemption"] = False
    if args.mode == "block":
        options["preemption_grace"] = 2.0
        options["tiers"] = ["local", NeverWrites(PersistentTier(job.as_uri()))]
    if args.mode == "slow":
        options["tiers"] = [SlowWrites(PersistentTier(job.as_uri()))]
        options["tier_queue"] = 16
    ckpt = tiercheck.SyncCheckpointer(
        "job",
        local_root=args.root,
        persistent=args.durable.as_uri(),
        base_every=5,
        rank=0,
        world_size=1,
        **options,  # type: ignore[arg-type]
    )
    say(f"handler before opening: {signal.getsignal(signal.SIGTERM)!r}")
    ckpt.open()
    say(f"handler once open: {signal.getsignal(signal.SIGTERM)!r}")
    if args.mode == "framework":
        found = signal.getsignal(signal.SIGTERM)

        def framework(signum: int, frame: object) -> None:
            say("framework handler called")
            assert callable(found)
            found(signum, frame)
            say(f"framework handler goes on; COMMIT records {commits(job)}")

        signal.signal(signal.SIGTERM, framework)
    for version in range(args.saves):
        ckpt.save(version, state_of(version))
    if args.mode != "slow":
        ckpt.wait()
    say(f"ready; COMMIT records {commits(job)}")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(0.02)
        if args.mode in ("ignore", "framework") and len(commits(job)) > 2:
            say(f"alive after SIGTERM; COMMIT records {commits(job)}")
            ckpt.close()
            return 0
    say("no SIGTERM came")
    return 1


if __name__ == "__main__":
    sys.exit(main())
