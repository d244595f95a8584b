"""One rank of a tiny job on a 2-D mesh (CPU/gloo) that DCP loads on another number of ranks
through :class:`tiercheck.dcp.TiercheckStorageReader` (test_mesh2d.py).

``--layout tp``: FSDP2 + tensor parallel, mesh ``(dp, tp)`` with ``tp`` = 2 -- the layers
parallelized column- then row-wise on ``tp``, ``fully_shard`` on ``dp``. ``--layout hsdp``:
``fully_shard`` on a 2-D ``(replicate, shard)`` mesh with ``shard`` = 2. Either mesh is
``(1, 2)`` on 2 ranks, ``(2, 2)`` on 4.

``--phase save``: trains ``--steps`` steps, saving each (``ModelAndOptimizer``) to the local and
persistent tiers, then rank 0 writes the gathered (full) model and optimizer state to
``--out/saved.pt``. ``--phase load``: a fresh model and optimizer on this run's mesh, loaded
the way a DCP user loads (``get_state_dict``, ``dcp.load`` through the reader from the
persistent tier, ``set_state_dict``); rank 0 writes the gathered state to ``--out/loaded.pt``.
Then another fresh model and optimizer are restored in place by tiercheck itself
(``restore(state, elastic=True)``, resharded by region into this mesh), gathered to
``--out/restored.pt``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from elastic_worker import gathered  # run as a script: its folder is on the path
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

import tiercheck
from tiercheck.adapters import ModelAndOptimizer
from tiercheck.dcp import TiercheckStorageReader


def build(layout: str, world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    # 18 hidden units: 9 per tp rank, then 5 and 4 rows per dp rank -- uneven on purpose.
    model = torch.nn.Sequential(torch.nn.Linear(8, 18), torch.nn.Tanh(), torch.nn.Linear(18, 6))
    mesh: DeviceMesh
    if layout == "tp":
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    else:
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    # The same batch on every rank: under tensor parallelism the tp ranks must see one batch.
    g = torch.Generator().manual_seed(step)
    model(torch.randn(4, 8, generator=g)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--persistent", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layout", choices=["tp", "hsdp"], required=True)
    parser.add_argument("--phase", choices=["save", "load"], required=True)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = build(args.layout, world)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.phase == "save":
        state = {"app": ModelAndOptimizer(model, opt)}
        with tiercheck.SyncCheckpointer(
            "mesh2d", local_root=args.root, persistent=args.persistent, persist="all"
        ) as ckpt:
            for step in range(args.steps):
                train_step(model, opt, step)
                ckpt.save(step, state)
            ckpt.wait()
        result = gathered(model, opt)
        if rank == 0:
            torch.save(result, args.out / "saved.pt")
    else:
        # The way a DCP user loads: torch's own state dicts of the model and optimizer (the
        # optimizer's initialized to be filled), loaded, then set.
        model_state, optim_state = get_state_dict(model, opt)
        target = {"app": {"model": model_state, "optim": optim_state}}
        dcp.load(target, storage_reader=TiercheckStorageReader(args.persistent, "mesh2d"))
        set_state_dict(
            model,
            opt,
            model_state_dict=target["app"]["model"],
            optim_state_dict=target["app"]["optim"],
        )
        result = gathered(model, opt)
        if rank == 0:
            torch.save(result, args.out / "loaded.pt")
        # tiercheck's own in-place restore, into a fresh model and optimizer on this mesh.
        model, opt = build(args.layout, world)
        with tiercheck.SyncCheckpointer(
            "mesh2d", local_root=args.root, persistent=args.persistent, elastic=True
        ) as ckpt:
            restored = ckpt.restore({"app": ModelAndOptimizer(model, opt)})
        assert restored is not None
        assert restored.saved_by != world, restored
        result = gathered(model, opt)
        if rank == 0:
            torch.save(result, args.out / "restored.pt")
    dist.destroy_process_group()
    # Everything is written and closed. Under load, a 2-rank FSDP2 + tensor parallel process on
    # gloo has aborted in the interpreter's teardown after this point ("terminate called
    # without an active exception", no Python frame; about 1 launch in 10 under pytest, none
    # in 34 launches outside it): what this test checks is done, so leave without the teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
