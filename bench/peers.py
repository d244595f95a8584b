"""tiercheck side by side with its peers on one state, in one run: save to and restore from
memory (or ``/dev/shm``), each against the copy floors measured in the same rounds.

The state is a model-and-AdamW state (``--layers`` ``nn.Linear(--dim, --dim)`` after one
optimizer step: ``6 * layers`` tensors, ~``12 * layers * dim**2`` bytes), as a training loop
hands it over (``{"model": model.state_dict(), "optim": opt.state_dict()}``). Every round runs
every method once, in a new random order; the medians and the median of the per-round ratios
are printed. Measured:

* floors: ``copy_`` of every tensor into buffers allocated (and faulted in) once -- the floor of
  a snapshot -- and ``copy_`` back from them -- the floor of an in-place restore;
* **tiercheck** (``SyncCheckpointer``, local tier in ``/dev/shm``): the time ``save`` blocks
  (then ``wait()``, untimed), and ``restore(state)`` in place by a checkpointer opened before
  the round (it reads the blob, verifies every byte, checks the state, copies in);
* **DLRover** flash checkpoint (``dlrover`` 0.6.1, ``DdpCheckpointer``, ``StorageType.MEMORY``;
  only when importable: ``pip install 'dlrover[torch]==0.6.1' grpcio`` -- its ``[torch]`` extra
  does not declare ``grpcio``): the time ``save_checkpoint`` blocks, and ``load_checkpoint()``
  (views of its shared memory, nothing verified) plus the ``copy_`` of every tensor into the
  state. Built before the model: its checkpointer forks a saver process, which would make the
  model's memory copy-on-write (the first rewrite of 200 MiB after the fork took 99 ms instead
  of 7.6 ms here). A memory save while it persists to disk is skipped silently; only memory
  saves are made here;
* **DCP**: ``dcp.async_save`` to ``/dev/shm`` (with one ``DefaultStager`` reused, its best CPU
  setup): the time until it returns; ``dcp.load`` in place from that folder;
* **torch.save** to ``/dev/shm`` (blocking by design); ``torch.load`` and ``load_state_dict``
  of model and optimizer (no ``mmap=True``: the next save rewrites the file under the
  mapping).

The first save of each is not counted (``--warmup`` rounds). Usage::

    python bench/peers.py [--layers 4] [--dim 2048] [--repeats 7] [--threads 1]

Results: ``bench/results/peers.json`` and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import tiercheck

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed")


def dlrover_checkpointer(folder: Path) -> tuple[Any, Any] | None:
    """DLRover's checkpointer and its memory storage type, or ``None`` without ``dlrover``."""
    try:
        from dlrover.trainer.torch.flash_checkpoint.checkpointer import StorageType
        from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer
    except ImportError as exc:
        print(f"DLRover not measured: {exc}", file=sys.stderr)
        return None
    return DdpCheckpointer(str(folder)), StorageType.MEMORY


def tensors_of(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors_of(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors_of(v)]
    return [obj] if isinstance(obj, torch.Tensor) else []


class Bench:
    """The state, the floors' buffers and every method's checkpointer."""

    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.work = work
        # Before the model exists: see the module docstring.
        self.dlrover = dlrover_checkpointer(work / "dlrover")
        torch.manual_seed(0)
        self.model = nn.Sequential(*[nn.Linear(args.dim, args.dim) for _ in range(args.layers)])
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.model(torch.randn(8, args.dim)).sum().backward()
        self.opt.step()
        self.live = tensors_of(self.state())
        self.nbytes = sum(t.nbytes for t in self.live)
        self.buffers = [torch.empty_like(t) for t in self.live]
        for b, t in zip(self.buffers, self.live, strict=True):
            b.copy_(t)  # faulted in
        self.step = 0
        self.ckpt = tiercheck.SyncCheckpointer(
            "peers", local_root=work / "tiercheck", tiers=["local"], keep=2
        ).open()
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.stager = DefaultStager(StagingOptions(False, False, False, False))

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}

    # --- saves: the seconds the call blocks --------------------------------------------------

    def save_copy(self) -> float:
        started = time.perf_counter()
        with torch.no_grad():
            for b, t in zip(self.buffers, self.live, strict=True):
                b.copy_(t)
        return time.perf_counter() - started

    def save_tiercheck(self) -> float:
        self.step += 1
        state = self.state()
        started = time.perf_counter()
        self.ckpt.save(self.step, state)
        blocked = time.perf_counter() - started
        self.ckpt.wait()
        return blocked

    def save_dlrover(self) -> float:
        assert self.dlrover is not None
        checkpointer, memory = self.dlrover
        self.step += 1
        state = self.state()
        started = time.perf_counter()
        checkpointer.save_checkpoint(self.step, state, storage_type=memory)
        return time.perf_counter() - started

    def save_dcp(self) -> float:
        path = self.work / "dcp"
        shutil.rmtree(path, ignore_errors=True)
        state = self.state()
        started = time.perf_counter()
        future = dcp.async_save(state, checkpoint_id=str(path), async_stager=self.stager)
        blocked = time.perf_counter() - started
        upload = getattr(future, "upload_completion", future)
        upload.result()
        return blocked

    def save_torch(self) -> float:
        state = self.state()
        started = time.perf_counter()
        torch.save(state, self.work / "torch.pt")
        return time.perf_counter() - started

    # --- restores: the seconds until the live state holds the version ------------------------

    def restore_copy(self) -> float:
        started = time.perf_counter()
        with torch.no_grad():
            for t, b in zip(self.live, self.buffers, strict=True):
                t.copy_(b)
        return time.perf_counter() - started

    def restore_tiercheck(self) -> float:
        state = self.state()
        started = time.perf_counter()
        restored = self.ckpt.restore(state)
        seconds = time.perf_counter() - started
        assert restored is not None
        assert restored.source_tier == "local", restored
        return seconds

    def restore_dlrover(self) -> float:
        assert self.dlrover is not None
        checkpointer, _ = self.dlrover
        started = time.perf_counter()
        loaded = checkpointer.load_checkpoint()
        with torch.no_grad():
            for t, src in zip(self.live, tensors_of(loaded), strict=True):
                t.copy_(src)
        return time.perf_counter() - started

    def restore_dcp(self) -> float:
        state = self.state()
        started = time.perf_counter()
        dcp.load(state, checkpoint_id=str(self.work / "dcp"))
        return time.perf_counter() - started

    def restore_torch(self) -> float:
        started = time.perf_counter()
        loaded = torch.load(self.work / "torch.pt", weights_only=True)
        self.model.load_state_dict(loaded["model"])
        self.opt.load_state_dict(loaded["optim"])
        seconds = time.perf_counter() - started
        # The optimizer now holds the file's tensors: take the live ones again.
        self.live = tensors_of(self.state())
        return seconds

    def close(self) -> None:
        self.ckpt.close()
        self.stager.close()


def rounds(
    methods: dict[str, Callable[[], float]], count: int, warmup: int
) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {name: [] for name in methods}
    for i in range(warmup + count):
        order = list(methods)
        random.shuffle(order)
        for name in order:
            seconds = methods[name]()
            if i >= warmup:
                out[name].append(seconds)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="tiercheck-bench-peers-", dir="/dev/shm"))
    bench = Bench(args, work)
    peers = ["tiercheck", *(["dlrover"] if bench.dlrover else []), "dcp", "torch"]
    try:
        saves = rounds(
            {"copy": bench.save_copy} | {p: getattr(bench, f"save_{p}") for p in peers},
            args.repeats,
            args.warmup,
        )
        restores = rounds(
            {"copy": bench.restore_copy} | {p: getattr(bench, f"restore_{p}") for p in peers},
            args.repeats,
            args.warmup,
        )
    finally:
        bench.close()
        shutil.rmtree(work, ignore_errors=True)
    results: dict[str, Any] = {
        "state": {"tensors": len(bench.live), "mib": round(bench.nbytes / 2**20, 1)},
        "threads": args.threads,
        "torch": torch.__version__,
        "versions": {},
        "save": {},
        "restore": {},
    }
    try:
        from importlib.metadata import version

        results["versions"]["dlrover"] = version("dlrover") if bench.dlrover else None
    except Exception as exc:  # the version is a label only
        results["versions"]["dlrover"] = f"unknown ({exc})"
    print(
        f"{len(bench.live)} tensors, {bench.nbytes / 2**20:.1f} MiB, {args.threads} thread(s), "
        f"median of {args.repeats}"
    )
    print("| method | save blocks | / copy | restore | / copy back |")
    print("| --- | --: | --: | --: | --: |")
    for name in ["copy", *peers]:
        s, r = saves[name], restores[name]
        s_ratio = statistics.median(a / b for a, b in zip(s, saves["copy"], strict=True))
        r_ratio = statistics.median(a / b for a, b in zip(r, restores["copy"], strict=True))
        results["save"][name] = {"median_s": statistics.median(s), "over_copy": s_ratio}
        results["restore"][name] = {"median_s": statistics.median(r), "over_copy": r_ratio}
        print(
            f"| {name} | {statistics.median(s) * 1e3:.1f} ms | {s_ratio:.2f}x | "
            f"{statistics.median(r) * 1e3:.1f} ms | {r_ratio:.2f}x |"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "peers.json").write_text(json.dumps(results, indent=1) + "\n")
    os.sync()


if __name__ == "__main__":
    sys.exit(main())
