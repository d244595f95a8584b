"""One rank of a tiny FSDP2 (``fully_shard``) training job on CPU/gloo (see test_fsdp2.py).

Restores whatever is stored, trains to ``--steps`` saving every step, and writes its final local
shards (model parameters and optimizer state) to ``--out/rank{r}.pt``. Two ways to checkpoint:

* ``--mode plain``: a plain loop handing over ``model.state_dict()`` and ``opt.state_dict()``
  (DTensors) and the RNG state; resumes by restoring without a state and loading the result
  (``load_state_dict`` of the model and the fresh optimizer);
* ``--mode stateful``: ``{"app": ModelAndOptimizer(model, opt), "rng": RNGState()}`` restored
  in place, the optimizer fresh.

The test kills it from outside at moments of its choosing; ``--delay`` seconds of sleep after
each step make a run last long enough for that. Each step's batch is a function of the step
and the rank only, so a run resumed at any step replays the same data.

It prints, one line each (``A`` is torchrun's restart count):

* ``rank R attempt A pid P restored V from TIER`` -- training starts (``V`` is ``-1`` and
  ``TIER`` ``-`` on a fresh start);
* ``rank 0 attempt A committed V TIER`` -- version ``V`` is committed in ``TIER`` for every
  rank (rank 0 reports for all);
* ``rank R attempt A done`` -- the final shards are written.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import tiercheck
from tiercheck.adapters import ModelAndOptimizer, RNGState


class Say:
    """This rank's report lines."""

    def __init__(self, rank: int) -> None:
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.prefix = f"rank {rank} attempt {attempt}"
        self.pending: dict[tiercheck.SaveHandle, set[str]] = {}

    def __call__(self, line: str) -> None:
        # One write per line: with PYTHONUNBUFFERED, print writes the text and its newline apart,
        # and the two ranks' lines then interleave in the shared output.
        sys.stdout.write(f"{self.prefix} {line}\n")
        sys.stdout.flush()

    def commits(self, handle: tiercheck.SaveHandle | None = None) -> None:
        """Report each version committed in a tier since the last call (never blocks)."""
        if handle is not None:
            self.pending[handle] = set(handle.tiers)
        for h, tiers in list(self.pending.items()):
            for tier in sorted(tiers):
                if h.committed(tier):
                    self(f"committed {h.version} {tier}")
                    tiers.discard(tier)
            if not tiers:
                del self.pending[h]


def local(value: Any) -> Any:
    return value.to_local().clone() if isinstance(value, DTensor) else value


def shards(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    optim = opt.state_dict()
    return {
        "model": {k: local(v) for k, v in model.state_dict().items()},
        "placements": {k: repr(v.placements) for k, v in model.state_dict().items()},
        "optim": {i: {k: local(v) for k, v in s.items()} for i, s in optim["state"].items()},
        "groups": optim["param_groups"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--persistent", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--mode", choices=["plain", "stateful"], required=True)
    parser.add_argument("--delay", type=float, default=0.0)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    say = Say(rank)
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)
    stateful = {"app": ModelAndOptimizer(model, opt), "rng": RNGState()}
    ckpt = tiercheck.SyncCheckpointer(
        "fsdp2", local_root=args.root, persistent=args.persistent, base_every=2, peer_timeout=60
    )
    with ckpt:
        if args.mode == "plain":
            restored = ckpt.restore()
            if restored is not None:
                assert isinstance(restored.state["model"]["0.weight"], DTensor)
                model.load_state_dict(restored.state["model"])
                opt.load_state_dict(restored.state["optim"])
                torch.set_rng_state(restored.state["rng"])
        else:
            assert opt.state_dict()["state"] == {}
            restored = ckpt.restore(stateful)
        version = -1 if restored is None else restored.version
        source = "-" if restored is None else restored.source_tier
        say(f"pid {os.getpid()} restored {version} from {source}")
        for step in range(version + 1, args.steps):
            g = torch.Generator().manual_seed(step * 100 + rank)
            model(torch.randn(4, 8, generator=g)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            if args.mode == "plain":
                state = {
                    "model": model.state_dict(),
                    "optim": opt.state_dict(),
                    "rng": torch.get_rng_state(),
                }
                handle = ckpt.save(step, state)
            else:
                handle = ckpt.save(step, stateful)
            if rank == 0:
                say.commits(handle)
            time.sleep(args.delay)
        ckpt.wait()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.save(shards(model, opt), args.out / f"rank{rank}.pt")
    say("done")
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
