"""The first save of a job: what it blocks training for, fresh and after a restore.

The first save of a process finds no shared memory ready: the local tier sizes and backs a file
and faults in the memory the snapshot is copied into, inside the training step. After a restore
the tier prepares that memory in the background, sized as the restored blob
(``TierPipeline.ready_after``), so the first save of a restarted job costs what a steady one
does. Measured in one process, a new job (``job_id``) per round, on a state of ``--mb`` MB:

* ``copy``: ``copy_`` of every tensor into buffers allocated once (the floor);
* ``fresh``: the first save of a new job (nothing restored);
* ``prepared``: the first save of a new job that called ``ckpt.prepare(state)`` first, then
  paused 2 s (its model built, its first step);
* ``after_restore``: a job that saved, closed and reopened restores, pauses 2 s (a restarted
  job's first step), then saves: that save's stall;
* ``steady``: the save after that.

Usage::

    python bench/first_save.py [--mb 1024] [--repeats 3]

Prints the medians and ratios to the copy floor; writes ``bench/results/first_save.json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment

import tiercheck

RESULTS = Path(__file__).resolve().parent / "results"
#: Between the restore and the first save (see one_round).
PAUSE_S = 2.0


def make_state(mb: int) -> dict[str, Any]:
    n = mb * (1 << 20) // 4 // 8
    g = torch.Generator().manual_seed(0)
    return {f"t{i}": torch.randn(n, generator=g) for i in range(8)} | {"step": 0}


def open_job(root: Path, job: str) -> tiercheck.SyncCheckpointer:
    return tiercheck.SyncCheckpointer(
        job,
        tiers=["local"],
        local_root=root / job,
        persistent=(root / "unused").as_uri(),
    ).open()


def one_round(root: Path, state: dict[str, Any], i: int) -> dict[str, float]:
    out: dict[str, float] = {}
    dst = [torch.empty_like(t) for t in state.values() if isinstance(t, torch.Tensor)]
    src = [t for t in state.values() if isinstance(t, torch.Tensor)]
    for d, s in zip(dst, src, strict=True):
        d.copy_(s)
    t0 = time.perf_counter()
    for d, s in zip(dst, src, strict=True):
        d.copy_(s)
    out["copy"] = time.perf_counter() - t0
    job = f"first-{i}"
    ckpt = open_job(root, job)
    t0 = time.perf_counter()
    ckpt.save(1, state)
    out["fresh"] = time.perf_counter() - t0
    ckpt.wait()
    ckpt.close()
    ready = open_job(root, f"{job}-prepared")
    if not ready.prepare(state, version=1):
        raise RuntimeError("prepare readied nothing")
    time.sleep(PAUSE_S)
    t0 = time.perf_counter()
    ready.save(1, state)
    out["prepared"] = time.perf_counter() - t0
    ready.wait()
    ready.close()
    shutil.rmtree(root / f"{job}-prepared")
    ckpt = open_job(root, job)
    t0 = time.perf_counter()
    restored = ckpt.restore(state)
    out["restore"] = time.perf_counter() - t0
    assert restored is not None
    assert restored.source_tier == "local"
    # A restarted job spends seconds before its first save (its first step at least): the
    # memory is prepared meanwhile. Here: a fixed pause, well beyond the preparation.
    time.sleep(PAUSE_S)
    t0 = time.perf_counter()
    ckpt.save(2, state)
    out["after_restore"] = time.perf_counter() - t0
    ckpt.wait()
    t0 = time.perf_counter()
    ckpt.save(3, state)
    out["steady"] = time.perf_counter() - t0
    ckpt.wait()
    ckpt.close()
    shutil.rmtree(root / job)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    state = make_state(args.mb)
    root = Path(tempfile.mkdtemp(prefix="tiercheck-first-", dir="/dev/shm"))
    try:
        rows = [one_round(root, state, i) for i in range(args.repeats)]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    print(f"state {args.mb} MB, 8 tensors; medians of {args.repeats} rounds (seconds):")
    for k, v in med.items():
        print(f"  {k:18s} {v:8.3f}")
    for k in ("fresh", "prepared", "after_restore", "steady"):
        print(f"  {k:18s} / copy floor: {med[k] / med['copy']:.2f}x")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "first_save.json").write_text(
        json.dumps(
            {"mb": args.mb, "rounds": rows, "median": med, "environment": environment()},
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
