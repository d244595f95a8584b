"""One rank of a tiny FSDP2 job on CPU/gloo that changes its number of ranks (test_elastic.py).

``--phase save``: trains ``--steps`` steps saving every one (``ModelAndOptimizer`` and the RNG
states, every version also to the persistent tier), then rank 0 writes the gathered (full,
unsharded) model and optimizer state to ``--out/saved.pt``.

``--phase restore``: a fresh model and optimizer on this run's number of ranks, opened with
``elastic=True``, restore in place; rank 0 writes the gathered state to ``--out/restored.pt``
and every rank prints ``rank R restored V saved_by N from TIER``. Training then goes on for one
step and saves it; a second opening (not elastic) restores that version and prints
``rank R again V saved_by N from TIER``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import tiercheck
from tiercheck.adapters import ModelAndOptimizer, RNGState


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")  # one write: ranks share the pipe
    sys.stdout.flush()


def full(value: Any) -> Any:
    return value.full_tensor() if isinstance(value, DTensor) else value


def gathered(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The unsharded model and optimizer state (a collective: every rank calls it)."""
    optim = opt.state_dict()["state"]
    return {
        "model": {k: full(v) for k, v in model.state_dict().items()},
        "optim": {i: {k: full(v) for k, v in s.items()} for i, s in sorted(optim.items())},
    }


def build(world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    # 18 and 5 output rows do not divide evenly over 4 ranks (5, 5, 5, 3 and 2, 2, 1, 0).
    model = torch.nn.Sequential(torch.nn.Linear(10, 18), torch.nn.Tanh(), torch.nn.Linear(18, 5))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, rank: int) -> None:
    g = torch.Generator().manual_seed(step * 100 + rank)
    model(torch.randn(4, 10, generator=g)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--persistent", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--phase", choices=["save", "restore"], required=True)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = build(world)
    state = {"app": ModelAndOptimizer(model, opt), "rng": RNGState()}
    # Each simulated node its own memory (one node by default: the root itself).
    per_node = int(os.environ.get("TIERCHECK_RANKS_PER_NODE", str(world)))
    options: dict[str, Any] = {
        "local_root": args.root if per_node >= world else args.root / f"node{rank // per_node}",
        "persistent": args.persistent,
        "persist": "all",
        "peer_timeout": 60,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    if args.phase == "save":
        with tiercheck.SyncCheckpointer("elastic", **options) as ckpt:
            for step in range(args.steps):
                train_step(model, opt, step, rank)
                ckpt.save(step, state)
            ckpt.wait()
        full_state = gathered(model, opt)
        if rank == 0:
            torch.save(full_state, args.out / "saved.pt")
    else:
        # Python's and numpy's RNG states differ between ranks (seeded by the OS): each new
        # rank takes an old rank's ("wrap"); the model and optimizer are resharded.
        with tiercheck.SyncCheckpointer(
            "elastic", elastic=True, per_rank="wrap", **options
        ) as ckpt:
            restored = ckpt.restore(state)
            assert restored is not None
            _say(
                f"rank {rank} restored {restored.version} saved_by {restored.saved_by} "
                f"from {restored.source_tier}"
            )
            full_state = gathered(model, opt)
            if rank == 0:
                torch.save(full_state, args.out / "restored.pt")
            step = restored.version + 1
            train_step(model, opt, step, rank)
            ckpt.save(step, state)
            ckpt.wait()
        model, opt = build(world)
        state = {"app": ModelAndOptimizer(model, opt), "rng": RNGState()}
        with tiercheck.SyncCheckpointer("elastic", **options) as ckpt:
            again = ckpt.restore(state)
            assert again is not None
            _say(
                f"rank {rank} again {again.version} saved_by {again.saved_by} "
                f"from {again.source_tier}"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Everything is written and the process group destroyed. Leave without the interpreter's
    # teardown: torch's C++ objects destroyed there abort the process now and then on CPUs
    # ("terminate called without an active exception", about 1 launch in 10 here, with no
    # Python thread left), failing a run that went well.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
