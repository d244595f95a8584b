"""Where an in-place restore's time goes, stage by stage, as tensors multiply.

The state is ``bench/stall.py``'s (a model + AdamW state of about ``--mb`` MB of fp32, split into
``--tensors`` tensors), saved once to the local tier (``/dev/shm``); then, ``--repeats`` times,
the tensors are copied back from buffers allocated once (the floor of any in-place restore) and
``SyncCheckpointer.restore(state)`` restores the same version into the state by a checkpointer
opened beforehand. Each stage of the restore is timed by wrapping the function that runs it
(this costs a few microseconds per call, none per tensor):

* ``header``: reading and checking the blob's header (``read_meta_ranged``: its layout of one
  entry per tensor);
* ``stand-in``: typed views of the layout on the ``meta`` device (``RawState.tensors``);
* ``unflatten``: the version's structure rebuilt around them;
* ``check``: the state checked against it (``check_into``);
* ``pair``: each target tensor paired with its bytes (``pair_into``);
* ``plan``: where each byte goes (``_plan``: the targets' addresses, the scatter);
* ``read``: the payload read chunk by chunk, verified and copied (``read_scattered``);
* ``other``: the rest of the call (the ranks' agreement, the tier's listing, thread hand-offs,
  the version counters).

Every stage is printed in milliseconds and as a share of the restore, beside the copy floor:
medians over the repeats after ``--warmup`` uncounted rounds, all in one process (this machine
is noisy).

Usage::

    python bench/restore_stages.py [--tensors 16 3000 12000 100000] [--mb 200] [--repeats 5]
        [--warmup 1]
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stall import Model

import tiercheck
from tiercheck.codec import RawState
from tiercheck.engine.restore import inplace

STAGES = ("header", "stand-in", "unflatten", "check", "pair", "plan", "read")


class Stages:
    """Wraps the functions that run each stage; collects their times per restore."""

    def __init__(self) -> None:
        self.now: dict[str, float] = {}
        self._undo: list[Callable[[], None]] = []

    def wrap(self, owner: Any, name: str, stage: str) -> None:
        original = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.now[stage] = self.now.get(stage, 0.0) + time.perf_counter() - started

        setattr(owner, name, timed)
        self._undo.append(lambda: setattr(owner, name, original))

    def __enter__(self) -> Stages:
        self.wrap(inplace, "read_meta_ranged", "header")
        self.wrap(RawState, "tensors", "stand-in")
        self.wrap(inplace, "unflatten", "unflatten")
        self.wrap(inplace, "check_into", "check")
        self.wrap(inplace, "pair_into", "pair")
        self.wrap(inplace, "_plan", "plan")
        self.wrap(inplace, "read_scattered", "read")
        return self

    def __exit__(self, *exc: object) -> None:
        for undo in reversed(self._undo):
            undo()


def measure(n_tensors: int, mb: float, repeats: int, warmup: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Model(n_tensors // 4, mb)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()

    def state() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": opt.state_dict(), "step": 1}

    live = [t for t in tiercheck.codec.flatten(state())[1] if isinstance(t, torch.Tensor)]
    saved = [t.clone() for t in live]
    shm = Path(tempfile.mkdtemp(prefix="restore-stages-", dir="/dev/shm"))
    floors: list[float] = []
    walls: list[float] = []
    stages: dict[str, list[float]] = {s: [] for s in STAGES}
    try:
        with tiercheck.SyncCheckpointer("stages", local_root=shm / "node", tiers=["local"]) as c:
            c.save(1, state())
            c.wait()
        for round_ in range(warmup + repeats):
            counted = round_ >= warmup  # the first rounds fault memory in
            gc.collect()
            with torch.no_grad():
                started = time.perf_counter()
                for dst, src in zip(live, saved, strict=True):
                    dst.copy_(src)
                floor = time.perf_counter() - started
            target = state()
            ckpt = tiercheck.SyncCheckpointer("stages", local_root=shm / "node", tiers=["local"])
            try:
                ckpt.versions()  # opened, its threads started, as a job that lists first
                with Stages() as timing:
                    started = time.perf_counter()
                    restored = ckpt.restore(target)
                    wall = time.perf_counter() - started
            finally:
                ckpt.close()
            if restored is None or restored.source_tier != "local":
                raise RuntimeError(f"the restore did not come from the local tier: {restored}")
            if not counted:
                continue
            floors.append(floor)
            walls.append(wall)
            for stage in STAGES:
                stages[stage].append(timing.now.get(stage, 0.0))
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    other = [w - sum(stages[s][i] for s in STAGES) for i, w in enumerate(walls)]
    return {
        "tensors": len(live),
        "floor": statistics.median(floors),
        "restore": statistics.median(walls),
        "stages": {s: statistics.median(v) for s, v in {**stages, "other": other}.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tensors", type=int, nargs="+", default=[16, 3000, 12000, 100000])
    parser.add_argument("--mb", type=float, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    rows = [measure(n, args.mb, args.repeats, args.warmup) for n in args.tensors]
    head = "| stage | " + " | ".join(f"{r['tensors']:,} tensors" for r in rows) + " |"
    print(head)
    print("| --- |" + " --: |" * len(rows))
    print(
        "| `copy_` back (floor) | " + " | ".join(f"{r['floor'] * 1e3:.1f} ms" for r in rows) + " |"
    )
    print(
        "| **restore** | "
        + " | ".join(
            f"**{r['restore'] * 1e3:.1f} ms ({r['restore'] / r['floor']:.2f}x)**" for r in rows
        )
        + " |"
    )
    for stage in (*STAGES, "other"):
        cells = []
        for r in rows:
            s = r["stages"][stage]
            cells.append(
                f"{s * 1e3:.1f} ms ({100 * s / r['restore']:.0f}%, "
                f"{1e6 * s / max(1, r['tensors']):.2f} µs/tensor)"
            )
        print(f"| {stage} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
