"""One rank of a small DDP job that marks its model and optimizer ``tiercheck.Replicated``.

``--save N`` trains N steps (gloo all-reduce), saving every step, and writes the final model
and optimizer state to ``--out`` (``torch.save``, for the test to compare with); ``--restore``
builds a fresh model and optimizer, restores into them and checks them bit for bit against
that file, printing ``rank R restored V from TIER``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import tiercheck
from tiercheck.adapters import ModelAndOptimizer


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")  # one write per line: the ranks share the pipe
    sys.stdout.flush()


def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    model = DistributedDataParallel(net)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, per in opt.state_dict()["state"].items():
        for k, v in per.items():
            out[f"opt.{i}.{k}"] = torch.as_tensor(v).clone()
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--persistent", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--save", type=int, default=0)
    parser.add_argument("--restore", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    node = rank // int(os.environ.get("TIERCHECK_RANKS_PER_NODE", "1"))
    model, opt = build(0 if args.save else 1 + rank)  # a restore starts from other weights
    own = torch.full((4,), float(rank))
    state = {"model": tiercheck.Replicated(ModelAndOptimizer(model, opt)), "own": own}
    ckpt = tiercheck.SyncCheckpointer(
        "ddp", local_root=args.root / f"node{node}", persistent=args.persistent, base_every=2
    )
    with ckpt:
        if args.restore:
            restored = ckpt.restore(state)
            assert restored is not None, "nothing restored"
            saved = torch.load(args.out / f"saved-r{rank}.pt", weights_only=True)
            now = snapshot(model, opt)
            assert sorted(now) == sorted(saved), "another state"
            assert all(torch.equal(now[k], saved[k]) for k in saved), "bytes differ"
            assert torch.equal(own, torch.full((4,), float(rank))), "own state differs"
            _say(f"rank {rank} restored {restored.version} from {restored.source_tier}")
        g = torch.Generator().manual_seed(rank)
        for step in range(args.save):
            model(torch.randn(16, 64, generator=g)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            ckpt.save(step, state)
        ckpt.wait()
    if args.save:
        torch.save(snapshot(model, opt), args.out / f"saved-r{rank}.pt")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
