"""Training throughput with a checkpoint after every step vs without checkpoints (CPU).

The model and data of ``codec.py``: a byte-level transformer (4 layers, d=256, about 3.3 M
parameters, AdamW: a 40 MB fp32 state) trained on the standard library's Python sources. One
model keeps training throughout; the run is cut into segments of ``--steps`` steps, and each
segment runs in one of four modes, in a new random order every repeat (drift on a noisy
machine hits all modes alike):

* ``none``: no checkpoints;
* ``copy``: after every step, a plain copy of the state into buffers allocated once and nothing
  else -- the floor for any checkpointer that snapshots every step (not a checkpoint at all);
* ``local``: ``ckpt.save(step, state)`` after every step, local tier only (``/dev/shm``);
* ``local overlap``: the same with ``overlap=True`` and ``tiercheck.fence_before_step`` on the
  optimizer: the copy runs during the next step's forward and backward;
* ``local+persistent``: the same with the persistent tier too (a folder on disk, fsynced),
  defaults ``persist="base"``, ``base_every=10``: every 10th step a packed base goes to disk.

A checkpointing segment ends with ``ckpt.wait()`` inside the timed span, so background work
left over at its end is counted. Overhead = 1 - (steps/s with) / (steps/s without), from the
medians over repeats (the per-repeat paired values give the spread). Each checkpointing mode is
also judged against the copy floor: its overhead minus the ``copy`` mode's, in percentage
points, paired per repeat (both measured in the same repeat), target at most 1 point -- on
this machine the bare copy of the state every step already costs several percent (memory
bandwidth), which no checkpointer that snapshots every step avoids.

All of it twice: training on every core (``torch.set_num_threads(cpu_count)``, the default;
tiercheck's background hashing and encoding then competes with training for the same cores)
and training on one thread (the other core left to the checkpointer, as on a GPU node where the
host CPU is mostly idle during a step). To see where the time goes, each segment also records
the time the loop spent inside checkpoint calls (``state_dict()`` + ``save()``), tiercheck's own
``stall_s``, and the process's CPU seconds (all threads).

Usage::

    python bench/overhead.py [--steps 10] [--repeats 10] [--threads 2 1]

Results: ``bench/results/overhead.json`` and the plot ``docs/img/overhead.png`` (shown in the
docs); a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment, load_snapshot, summary, tree_nbytes
from codec import BATCH, SEQ, ByteLM, corpus
from save import tensors

import tiercheck

RESULTS = Path(__file__).resolve().parent / "results"
#: The docs show the plot (docs/performance.md).
PLOTS = Path(__file__).resolve().parent.parent / "docs" / "img"
MODES = ("none", "copy", "local", "local overlap", "local+persistent")
TARGET_OVERHEAD = 0.03
#: What a checkpoint may cost above the copy floor's own overhead: 1 percentage point.
TARGET_ABOVE_FLOOR = 0.01


def cpu_seconds() -> float:
    """CPU time of this process, every thread."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


class Trainer:
    """One model, one optimizer, one stream of batches, for the whole run."""

    def __init__(self, batch: int) -> None:
        self.tokens, self.corpus = corpus()
        torch.manual_seed(0)
        self.model = ByteLM()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-4, weight_decay=0.1)
        self.gen = torch.Generator().manual_seed(1)
        self.batch = batch
        self.step_no = 0
        self.params = sum(p.numel() for p in self.model.parameters())
        self.loss = float("nan")

    def step(self) -> None:
        starts = torch.randint(0, len(self.tokens) - SEQ - 1, (self.batch,), generator=self.gen)
        x = torch.stack([self.tokens[i : i + SEQ] for i in starts])
        y = torch.stack([self.tokens[i + 1 : i + SEQ + 1] for i in starts])
        loss = nn.functional.cross_entropy(self.model(x).reshape(-1, 256), y.reshape(-1))
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.loss = loss.item()
        self.step_no += 1

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}


class CopyOnly:
    """The floor of any snapshot: copy the state into buffers allocated once, nothing else."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.dst = [torch.empty_like(t) for t in tensors(state)]

    def save(self, state: dict[str, Any]) -> None:
        for d, s in zip(self.dst, tensors(state), strict=True):
            d.copy_(s)


def segment(
    trainer: Trainer, steps: int, ckpt: tiercheck.SyncCheckpointer | CopyOnly | None
) -> dict[str, float]:
    """Train ``steps`` steps, checkpointing after each when ``ckpt`` is given."""
    in_calls = stall = 0.0
    cpu0 = cpu_seconds()
    t0 = time.perf_counter()
    for _ in range(steps):
        trainer.step()
        if isinstance(ckpt, CopyOnly):
            c0 = time.perf_counter()
            ckpt.save(trainer.state())
            in_calls += time.perf_counter() - c0
        elif ckpt is not None:
            c0 = time.perf_counter()
            handle = ckpt.save(trainer.step_no, trainer.state())
            in_calls += time.perf_counter() - c0
            stall += handle.stats.stall_s
    if isinstance(ckpt, tiercheck.SyncCheckpointer):
        ckpt.wait()
    seconds = time.perf_counter() - t0
    return {
        "seconds": seconds,
        "steps_per_s": steps / seconds,
        "ckpt_call_s_per_step": in_calls / steps,
        "stall_s_per_step": stall / steps,
        "cpu_s_per_step": (cpu_seconds() - cpu0) / steps,
    }


def run_threads(
    threads: int, args: argparse.Namespace, shm: Path, disk: Path, log: Any
) -> dict[str, Any]:
    torch.set_num_threads(threads)
    trainer = Trainer(args.batch)
    for _ in range(args.warmup_steps):  # first steps allocate and are slow
        trainer.step()
    ckpts = {
        "local": tiercheck.SyncCheckpointer(
            f"overhead-local-t{threads}",
            tiers=["local"],
            local_root=shm / f"t{threads}-local",
            persistent=(disk / "unused").as_uri(),
        ),
        "local overlap": tiercheck.SyncCheckpointer(
            f"overhead-overlap-t{threads}",
            tiers=["local"],
            local_root=shm / f"t{threads}-overlap",
            persistent=(disk / "unused-overlap").as_uri(),
            overlap=True,
        ),
        "local+persistent": tiercheck.SyncCheckpointer(
            f"overhead-lp-t{threads}",
            local_root=shm / f"t{threads}-lp",
            persistent=(disk / "persistent").as_uri(),
            persist="base",
            base_every=10,
        ),
    }
    # Free when nothing is in flight (the other modes): only the overlapped saves ever wait.
    hook = tiercheck.fence_before_step(ckpts["local overlap"], trainer.opt)
    copier = CopyOnly(trainer.state())
    rng = random.Random(threads)
    rows: list[dict[str, dict[str, float]]] = []
    try:
        for c in ckpts.values():
            c.open()
            # Warm the checkpointer (its first saves allocate memory), outside the timing.
            for _ in range(3):
                trainer.step()
                c.save(trainer.step_no, trainer.state())
            c.wait()
        for r in range(args.repeats):
            order = list(MODES)
            rng.shuffle(order)
            row = {
                m: segment(trainer, args.steps, copier if m == "copy" else ckpts.get(m))
                for m in order
            }
            rows.append(row)
            log(
                f"  threads={threads} repeat {r}: "
                + "  ".join(f"{m}={row[m]['steps_per_s']:.3f}/s" for m in MODES)
                + f"  loss {trainer.loss:.3f}"
            )
        stats = {m: dict(c.stats.committed) for m, c in ckpts.items()}
    finally:
        hook.remove()
        for c in ckpts.values():
            c.close()
    state_bytes = tree_nbytes(trainer.state())
    out: dict[str, Any] = {
        "torch_threads": threads,
        "state_MB": state_bytes / 1e6,
        "params": trainer.params,
        "modes": {m: {k: summary([row[m][k] for row in rows]) for k in rows[0][m]} for m in MODES},
        "committed": stats,
        "overhead": {},
    }
    base = out["modes"]["none"]
    for m in MODES[1:]:
        med = 1 - out["modes"][m]["steps_per_s"]["median"] / base["steps_per_s"]["median"]
        per = [1 - row[m]["steps_per_s"] / row["none"]["steps_per_s"] for row in rows]
        # The overhead above the copy floor's, paired per repeat: each repeat ran every mode
        # once, in a random order, so the drift of a noisy machine cancels in the difference.
        above = [
            row["copy"]["steps_per_s"] / row["none"]["steps_per_s"]
            - row[m]["steps_per_s"] / row["none"]["steps_per_s"]
            for row in rows
        ]
        cpu_extra = out["modes"][m]["cpu_s_per_step"]["median"] - base["cpu_s_per_step"]["median"]
        step_s = 1 / base["steps_per_s"]["median"]
        out["overhead"][m] = {
            "overhead": med,
            "paired": summary(per),
            "above_floor": summary(above),
            "met": med <= TARGET_OVERHEAD,
            "met_above_floor": statistics.median(above) <= TARGET_ABOVE_FLOOR,
            "step_s_without": step_s,
            "ckpt_call_share": out["modes"][m]["ckpt_call_s_per_step"]["median"] / step_s,
            "stall_share": out["modes"][m]["stall_s_per_step"]["median"] / step_s,
            "extra_cpu_s_per_step": cpu_extra,
        }
    return out


def markdown(results: dict[str, Any]) -> str:
    lines = [
        "| training threads | mode | steps/s (median, min-max) | overhead (target <= 3%) | "
        "paired per repeat | above the copy floor, paired (target <= 1 point) | "
        "in checkpoint calls | tiercheck stall | extra CPU per step |",
        "| --- | --- | --: | --: | --: | --: | --: | --: | --: |",
    ]
    for key, res in results["runs"].items():
        for m in MODES:
            s = res["modes"][m]["steps_per_s"]
            cell = f"{s['median']:.3f} ({s['min']:.3f}-{s['max']:.3f})"
            if m == "none":
                lines.append(f"| {key} | {m} | {cell} | - | - | - | - | - | - |")
                continue
            o = res["overhead"][m]
            p = o["paired"]
            call_ms = res["modes"][m]["ckpt_call_s_per_step"]["median"] * 1e3
            stall_ms = res["modes"][m]["stall_s_per_step"]["median"] * 1e3
            verdict = "floor, not a checkpoint" if m == "copy" else "met" if o["met"] else "not met"
            stall_cell = (
                "-" if m == "copy" else f"{stall_ms:.1f} ms ({o['stall_share'] * 100:.1f}%)"
            )
            a = o["above_floor"]
            above_cell = (
                "-"
                if m == "copy"
                else f"**{a['median'] * 100:+.1f}** ({a['min'] * 100:+.1f} to "
                f"{a['max'] * 100:+.1f}) ({'met' if o['met_above_floor'] else 'not met'})"
            )
            lines.append(
                f"| {key} | {m} | {cell} | **{o['overhead'] * 100:.1f}%** ({verdict}) | "
                f"{p['median'] * 100:.1f}% ({p['min'] * 100:.1f}-{p['max'] * 100:.1f}) | "
                f"{above_cell} | "
                f"{call_ms:.1f} ms ({o['ckpt_call_share'] * 100:.1f}%) | "
                f"{stall_cell} | "
                f"{o['extra_cpu_s_per_step'] * 1e3:.0f} ms |"
            )
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    width = 0.8 / len(MODES)
    for j, m in enumerate(MODES):
        xs = [i + (j - (len(MODES) - 1) / 2) * width for i in range(len(runs))]
        meds = [r["modes"][m]["steps_per_s"]["median"] for r in runs.values()]
        lo = [r["modes"][m]["steps_per_s"]["median"] - r["modes"][m]["steps_per_s"]["min"]
              for r in runs.values()]  # fmt: skip
        hi = [r["modes"][m]["steps_per_s"]["max"] - r["modes"][m]["steps_per_s"]["median"]
              for r in runs.values()]  # fmt: skip
        bars = ax.bar(xs, meds, width, yerr=[lo, hi], capsize=3, label=m)
        if m != "none":
            for bar, r in zip(bars, runs.values(), strict=True):
                o = r["overhead"][m]["overhead"] * 100
                ax.annotate(
                    f"{o:+.1f}%",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center",
                    va="bottom",
                    fontsize=8,
                    xytext=(0, 6),
                    textcoords="offset points",
                )
    ax.set_xticks(range(len(runs)))
    ax.set_xticklabels(list(runs))
    ax.set_ylabel("training steps/s (median; bars: min-max)")
    any_run = next(iter(runs.values()))
    ax.set_title(
        f"Checkpoint every step: {any_run['params'] / 1e6:.1f} M-param transformer, "
        f"{any_run['state_MB']:.0f} MB state, CPU\n(annotations: overhead vs no checkpoints; "
        f"target <= 3%)",
        fontsize=9,
    )
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="steps per timed segment")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, nargs="+", default=[os.cpu_count() or 1, 1])
    parser.add_argument("--batch", type=int, default=BATCH)
    parser.add_argument("--warmup-steps", type=int, default=5)
    parser.add_argument("--json", type=Path, default=RESULTS / "overhead.json")
    parser.add_argument("--png", type=Path, default=PLOTS / "overhead.png")
    args = parser.parse_args()

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    results: dict[str, Any] = {
        "environment": environment(),
        "setup": {
            "model": "codec.py ByteLM: byte-level transformer, 4 layers, d=256, 4 heads, "
            f"seq {SEQ}, batch {args.batch}, AdamW",
            "steps_per_segment": args.steps,
            "repeats": args.repeats,
            "modes": {
                "none": "no checkpoints",
                "copy": "copy of the state into preallocated buffers every step (the floor)",
                "local": "SyncCheckpointer(tiers=['local']), save every step",
                "local overlap": "the same with overlap=True and fence_before_step",
                "local+persistent": "SyncCheckpointer(local + persistent on disk, "
                "persist='base', base_every=10), save every step",
            },
            "timing": "segment wall time includes ckpt.wait() at its end",
        },
        "runs": {},
    }
    shm_base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    shm = Path(tempfile.mkdtemp(prefix="tiercheck-overhead-", dir=shm_base))
    disk = Path(tempfile.mkdtemp(prefix="tiercheck-overhead-"))
    started = time.perf_counter()
    try:
        for threads in args.threads:
            log(f"== training on {threads} thread(s)")
            results["runs"][f"{threads} thread{'s' if threads > 1 else ''}"] = run_threads(
                threads, args, shm, disk, log
            )
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    results["environment"]["load_at_end"] = load_snapshot()
    results["seconds"] = round(time.perf_counter() - started, 1)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1) + "\n")
    try:
        plot(results, args.png)
    except ImportError as exc:  # matplotlib is optional: the table and the JSON are the result
        print(f"no plot ({exc}); install matplotlib for {args.png}", file=sys.stderr)
    print(markdown(results))
    worst = max(
        o["overhead"]
        for r in results["runs"].values()
        for m, o in r["overhead"].items()
        if m != "copy"
    )
    print(f"\nworst overhead {worst * 100:.1f}% (target <= {TARGET_OVERHEAD * 100:.0f}%)")
    for key, r in results["runs"].items():
        print(f"{key}: step without checkpoints {r['overhead']['local']['step_s_without']:.3f} s")
    print(f"results: {args.json}, plot: {args.png}")


if __name__ == "__main__":
    main()
