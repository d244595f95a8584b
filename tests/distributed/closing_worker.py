"""One rank of a small multi-node job that checks how tiercheck's close ends a job.

Started by ``torchrun`` (see ``test_two_launchers.py``), one process per simulated node. It
trains a tiny model data-parallel over gloo (all-reduce of the gradients), saves every step
through the async :class:`~tiercheck.Checkpointer` (local + peer + persistent tiers), restores
on the way in, leaves ``async with ckpt:`` and calls ``dist.destroy_process_group()``.

With ``--kill-at K``, the last rank waits until version ``K - 1`` is committed in the peer tier,
wipes its node's memory root (its node is lost) and SIGKILLs itself after step ``K``'s
all-reduce, before saving ``K``. The other ranks save ``K`` (their peer put waits on the dead
holder), then their next all-reduce fails and they leave the checkpointer on that exception.

Each rank appends JSON events to ``<out>/events-r<rank>.jsonl``: ``restored`` (version, source
tiers, digest), ``step`` (digest of the state saved as that version), ``kill``, ``left`` (the
checkpointer is closed; the error that ended training, if any), ``final`` and ``exit`` (written
at interpreter exit, after every non-daemon thread was joined). Every event has a wall-clock
time ``t``.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import datetime
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import tiercheck
from tiercheck.demo.model import digest


class Events:
    """Appends one JSON object per line to this rank's event file."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("a", encoding="utf-8")

    def __call__(self, event: str, **fields: Any) -> None:
        self.file.write(json.dumps({"e": event, "t": time.time(), **fields}) + "\n")
        self.file.flush()


async def train(args: argparse.Namespace, events: Events) -> None:
    """Restore, train and save every step, close (on success or on a failed all-reduce)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    per_node = int(os.environ.get("TIERCHECK_RANKS_PER_NODE", "1"))
    node = rank // per_node
    node_root = args.root / f"node{node}"
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(args.dim, args.dim), torch.nn.Tanh(), torch.nn.Linear(args.dim, 1)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def state(step: int) -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}

    ckpt = tiercheck.Checkpointer(
        args.job,
        local_root=node_root,
        persistent=args.persistent,
        tiers=["local", "peer", "persistent"],
        base_every=3,
        peer_timeout=args.peer_timeout,
    )
    try:
        async with ckpt:
            # strict=False: a fresh optimizer has no moments yet; the version's are added.
            restored = await ckpt.restore(state(-1), strict=False)
            start = 0
            if restored is not None:
                opt.load_state_dict(restored.state["optim"])
                start = restored.version + 1
                events(
                    "restored",
                    rank=rank,
                    version=restored.version,
                    source=restored.source_tier,
                    sources={str(k): v for k, v in restored.source_tiers.items()},
                    digest=digest(state(restored.version)),
                )
            handles: dict[int, Any] = {}
            for step in range(start, args.steps):
                gen = torch.Generator().manual_seed(step * world + rank)
                x = torch.randn(8, args.dim, generator=gen)
                loss = model(x).square().mean()
                opt.zero_grad()
                loss.backward()  # type: ignore[no-untyped-call]
                for p in model.parameters():
                    assert p.grad is not None
                    dist.all_reduce(p.grad)
                    p.grad /= world
                opt.step()
                if step == args.kill_at and rank == world - 1:
                    # After this step's all-reduce: the other ranks save this version (their
                    # peer put then waits on a holder that is gone) before their next
                    # all-reduce fails.
                    await handles[step - 1].result_async("peer")
                    # The node is lost, its memory too: at once, by a rename, as this rank's
                    # own retention may still be deleting in it (rmtree would then race).
                    lost = node_root.with_name(f"lost-{node_root.name}-{os.getpid()}")
                    node_root.rename(lost)
                    shutil.rmtree(lost, ignore_errors=True)  # whatever is left dies with us
                    events("kill", rank=rank, step=step)
                    os.kill(os.getpid(), signal.SIGKILL)
                handles[step] = await ckpt.save(step, state(step))
                events("step", rank=rank, step=step, digest=digest(state(step)))
    except Exception as exc:
        events("left", rank=rank, error=f"{type(exc).__name__}: {exc}"[:500])
        raise
    events("left", rank=rank, error=None)
    events("final", rank=rank, digest=digest(state(args.steps - 1)))


def main() -> None:
    """Parse the arguments, run one rank, record its exit."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", type=Path, required=True, help="parent of the node roots")
    parser.add_argument("--persistent", required=True, help="fsspec URL of durable storage")
    parser.add_argument("--out", type=Path, required=True, help="folder for the event files")
    parser.add_argument("--job", default="closing")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--peer-timeout", type=float, default=60.0)
    args = parser.parse_args()

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.peer_timeout))
    rank = dist.get_rank()
    args.out.mkdir(parents=True, exist_ok=True)
    events = Events(args.out / f"events-r{rank}.jsonl")
    events("start", rank=rank, world=dist.get_world_size())
    # Runs after the interpreter joined its non-daemon threads: the process is about to end.
    atexit.register(lambda: events("exit", rank=rank))
    asyncio.run(train(args, events))
    dist.destroy_process_group()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
