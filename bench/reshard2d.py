"""A job on a 2-D mesh resharded: tiercheck's own in-place elastic restore against ``dcp.load``
through :class:`tiercheck.dcp.TiercheckStorageReader`, in the same run.

Four ranks (threads of this process, ``tiercheck.testing.LocalGroup``) save one version of a
state of ``--tensors`` DTensors placed ``(Shard(0), Shard(1))`` on a ``(2, 2)`` mesh (stored as
their records: no process group is needed), ``--mb`` MiB in all, to the node's shared memory
and the persistent tier. Then, alternating, ``--repeats`` times, for each tier (the node's
memory; the persistent tier once the memory is gone):

* **tiercheck**: one rank opens the job with ``elastic=True`` and restores in place into
  DTensors on a ``(1, 1)`` mesh (whole tensors): the region reshard of ``codec/reshard/boxes.py``;
* **DCP**: ``dcp.load`` into the same DTensors with DCP's own planner (``no_dist=True``),
  through the reader.

Both read and verify every stored byte and copy it into place once; each is timed from opening
the store to the state filled. Printed: the median seconds and the ratio DCP / tiercheck.

Usage::

    python bench/reshard2d.py [--mb 256] [--tensors 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from tiercheck.codec.format.dtensor import DTensorShard
from tiercheck.dcp import TiercheckStorageReader
from tiercheck.testing import LocalGroup

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import run_ranks
from elastic import checkpointer

MESH = (2, 2)
PLACEMENTS = (("shard", 0), ("shard", 1))


def shard_of(full: torch.Tensor, coord: tuple[int, int], mesh: tuple[int, int]) -> DTensorShard:
    """The shard at ``coord`` of ``full`` placed (Shard(0), Shard(1)) on ``mesh``."""
    rows, cols = full.shape
    r, c = -(-rows // mesh[0]), -(-cols // mesh[1])
    r0, c0 = min(coord[0] * r, rows), min(coord[1] * c, cols)
    local = full[r0 : min(r0 + r, rows), c0 : min(c0 + c, cols)]
    return DTensorShard(
        local=local.clone(),
        shape=tuple(full.shape),
        stride=tuple(full.stride()),
        placements=PLACEMENTS,
        mesh=mesh,
        names=("dp", "tp"),
        device="cpu",
        coord=coord,
        offset=(r0, c0),
    )


def state_of(weights: list[torch.Tensor], coord: tuple[int, int], mesh: tuple[int, int]) -> Any:
    return {
        "model": {f"layer{i}.weight": shard_of(w, coord, mesh) for i, w in enumerate(weights)},
        "step": 7,
    }


def target(weights: list[torch.Tensor]) -> dict[str, Any]:
    """Real DTensors on a (1, 1) mesh of this process, placed as saved, to be filled."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    return {
        "model": {
            f"layer{i}.weight": DTensor.from_local(torch.empty_like(w), mesh, [Shard(0), Shard(1)])
            for i, w in enumerate(weights)
        },
        "step": 0,
    }


def ours(root: Path, weights: list[torch.Tensor]) -> tuple[float, str]:
    state = target(weights)
    started = time.perf_counter()
    with checkpointer(root, 0, 1, LocalGroup(1), elastic=True) as ckpt:
        got = ckpt.restore(state)
    seconds = time.perf_counter() - started
    assert got is not None
    assert got.saved_by == 4
    for w, got_w in zip(weights, state["model"].values(), strict=True):
        assert torch.equal(got_w.to_local(), w)
    return seconds, got.source_tier


def theirs(root: Path, tier: str, weights: list[torch.Tensor]) -> float:
    url = str(root / "node") if tier == "local" else (root / "durable").as_uri()
    state = {"model": target(weights)["model"]}
    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that no_dist loads without a process group
        dcp.load(state, storage_reader=TiercheckStorageReader(url, "bench"), no_dist=True)
    seconds = time.perf_counter() - started
    for w, got in zip(weights, state["model"].values(), strict=True):
        assert torch.equal(got.to_local(), w)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    cols = 1024
    rows = max(2, (args.mb << 20) // (4 * cols * args.tensors))
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(rows, cols, generator=g) for _ in range(args.tensors)]
    # One process group of this one process: the DTensors restored into need a mesh.
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    work = Path(tempfile.mkdtemp(prefix="tiercheck-bench-reshard2d-", dir="/dev/shm"))
    results: dict[str, Any] = {"mb": args.mb, "tensors": args.tensors, "rows": {}}
    try:
        saved = work / "saved"
        group = LocalGroup(4)

        def save(rank: int) -> None:
            coord = (rank // MESH[1], rank % MESH[1])
            with checkpointer(saved, rank, 4, group) as ckpt:
                ckpt.save(0, state_of(weights, coord, MESH))
                ckpt.wait()

        run_ranks(4, save)
        for tier in ("local", "persistent"):
            mine: list[float] = []
            dcps: list[float] = []
            for _ in range(args.repeats):
                for which in ("tiercheck", "dcp"):
                    run = work / "run"
                    shutil.rmtree(run, ignore_errors=True)
                    shutil.copytree(saved, run, symlinks=True)
                    if tier == "persistent":
                        shutil.rmtree(run / "node")
                    if which == "tiercheck":
                        seconds, source = ours(run, weights)
                        assert source == tier, source
                        mine.append(seconds)
                    else:
                        dcps.append(theirs(run, tier, weights))
            a, b = statistics.median(mine), statistics.median(dcps)
            row = {
                "tiercheck_s": round(a, 4),
                "dcp_s": round(b, 4),
                "dcp_over_tiercheck": round(b / a, 2),
            }
            results["rows"][f"{tier} 4->1"] = row
            print(
                f"{tier:<10} (2,2) 4 ranks -> 1   tiercheck {a:7.3f} s   dcp.load {b:7.3f} s   "
                f"DCP / tiercheck {b / a:5.2f}x",
                flush=True,
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "reshard2d.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
