"""A small deterministic DDP job that checkpoints every step with tiercheck and fails on purpose.

Run under torchrun (see tests/distributed/test_torchrun.py). On the first attempt it injects
one failure at step ``--fail-at``; torchrun restarts the whole group, which restores through
tiercheck and trains to the end. Each rank writes what it restored (version, tier, seconds)
and a digest of its final model and optimizer bytes to ``--out``, so the test can compare the
run with an uninterrupted one, bit for bit.

Failures (simulated nodes: ``TIERCHECK_RANKS_PER_NODE`` ranks share a memory root):

* ``process`` -- rank 1 is SIGKILLed after the previous version committed locally;
* ``node`` -- node 1's ranks lose their memory root (checkpoints and the replicas they hold
  for others) and are SIGKILLed, once the previous version committed in the peer tier;
* ``cluster`` -- every node's memory root is lost and every rank SIGKILLed;
* ``midsave`` -- rank 1 is SIGKILLed inside a save, as it publishes the blob in its local tier.
"""

from __future__ import annotations

import argparse
import hashlib
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
from torch import nn

import tiercheck
from tiercheck.testing.faults import FaultPlan, FaultyTier
from tiercheck.tiers import LocalTier


def _die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _wait_for(paths: list[Path], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout}s for {paths}")
        time.sleep(0.02)


def digest(model: nn.Module, opt: torch.optim.Optimizer) -> str:
    """A hash of every byte of the model's and the optimizer's tensors."""
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    for state in opt.state_dict()["state"].values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                h.update(
                    value.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                )
    return h.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--persistent", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--fail", choices=["none", "process", "node", "cluster", "midsave"])
    parser.add_argument("--fail-at", type=int, default=12)
    parser.add_argument("--base-every", type=int, default=5)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    per_node = int(os.environ["TIERCHECK_RANKS_PER_NODE"])
    node = rank // per_node
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    node_root = args.root / f"node{node}"
    signals = args.root / f"signals-attempt{attempt}"
    signals.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    injecting = attempt == 0 and args.fail != "none"

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.LayerNorm(64), nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    tiers: list[Any] = ["local", "peer", "persistent"]
    if injecting and args.fail == "midsave" and rank == 1:
        plan = FaultPlan(
            die_on=lambda op, tier, key: (
                op == "commit" and key.startswith(f"v{args.fail_at:012d}/")
            ),
            on_death=_die,
        )
        tiers[0] = FaultyTier.wrap(LocalTier(node_root / "blobs"), plan)

    ckpt = tiercheck.SyncCheckpointer(
        "dist-job",
        local_root=node_root,
        persistent=args.persistent,
        tiers=tiers,
        base_every=args.base_every,
        peer_timeout=60,
    )
    with ckpt:
        target = {"model": model.state_dict(), "optim": opt.state_dict(), "step": -1}
        restored = ckpt.restore(target)
        start = 0
        if restored is not None:
            opt.load_state_dict(restored.state["optim"])
            start = restored.version + 1
            record = {
                "rank": rank,
                "attempt": attempt,
                "version": restored.version,
                "source": restored.source_tier,
                "sources": {str(k): v for k, v in restored.source_tiers.items()},
                "seconds": restored.seconds,
            }
            (args.out / f"restored-r{rank}-a{attempt}.json").write_text(json.dumps(record))
        handles: dict[int, Any] = {}
        for step in range(start, args.steps):
            g = torch.Generator().manual_seed(10_000 * step + rank)
            x, y = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
            loss = (model(x) - y).square().mean()
            opt.zero_grad()
            loss.backward()
            # Data parallel by hand, one all-reduce per parameter in a fixed order: DDP regroups
            # its gradient buckets after a process's first step, so a resumed process would sum
            # in another order and differ in the last bits from an uninterrupted run.
            for p in model.parameters():
                assert p.grad is not None
                dist.all_reduce(p.grad)
                p.grad /= world
            opt.step()
            if injecting and step == args.fail_at:
                inject(
                    args,
                    rank=rank,
                    per_node=per_node,
                    world=world,
                    handles=handles,
                    signals=signals,
                    ckpt=ckpt,
                )
            state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}
            handles[step] = ckpt.save(step, state)
        ckpt.wait()
    (args.out / f"final-r{rank}.json").write_text(
        json.dumps({"rank": rank, "digest": digest(model, opt), "attempt": attempt})
    )
    dist.destroy_process_group()


def inject(
    args: argparse.Namespace,
    *,
    rank: int,
    per_node: int,
    world: int,
    handles: dict[int, Any],
    signals: Path,
    ckpt: tiercheck.SyncCheckpointer,
) -> None:
    """The failure of the first attempt, right before saving step ``args.fail_at``."""
    previous = handles[args.fail_at - 1]
    if args.fail == "process" and rank == 1:
        previous.result("local", timeout=120)
        _die()
    elif args.fail == "node" and rank // per_node == 1:
        previous.result("peer", timeout=120)
        (signals / f"ready-{rank}").touch()
        node_ranks = range(per_node, 2 * per_node)
        if rank == per_node:
            _wait_for([signals / f"ready-{r}" for r in node_ranks])
            shutil.rmtree(args.root / "node1")
            (signals / "wiped").touch()
        _wait_for([signals / "wiped"])
        _die()
    elif args.fail == "cluster":
        ckpt.wait()  # the newest base is durable in the persistent tier
        (signals / f"ready-{rank}").touch()
        if rank == 0:
            _wait_for([signals / f"ready-{r}" for r in range(world)])
            for node_root in args.root.glob("node*"):
                shutil.rmtree(node_root)
            (signals / "wiped").touch()
        _wait_for([signals / "wiped"])
        _die()


if __name__ == "__main__":
    main()
