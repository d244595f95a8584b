"""The save stall and the in-place restore at real tensor counts, and the overlapped snapshot.

A model-and-AdamW state of about ``--mb`` MB of fp32 (default 200) is built for each tensor
count (``--tensors``, default 16, 3,000, 12,000 and 100,000): ``n / 4`` parameters (``nn.Linear``
weights and biases), each bringing ``exp_avg``, ``exp_avg_sq`` and a 0-dim ``step`` once AdamW
has stepped. The state is what a training loop hands over at every save:
``{"model": model.state_dict(), "optim": opt.state_dict(), "step": step}`` (a new structure of
the same shape at each call). Every round runs every method once, in a new random order (drift
on a noisy machine hits all alike); the first ``--warmup`` rounds allocate memory and are not
counted. Measured, all in one process, ratios taken round by round:

* ``copy``: ``copy_`` of every tensor into buffers allocated once -- the floor of any snapshot,
  and the issue's baseline; ``copy_foreach``: the same with one ``torch._foreach_copy_``;
* ``tiercheck``: ``SyncCheckpointer.save`` (local tier, ``/dev/shm``): the wall time of the call
  (its stall); ``ckpt.wait()`` after it, untimed;
* ``overlap``: the same with ``overlap=True``; the loop then computes for ``--compute`` times the
  copy floor (a matmul on the training thread, standing for forward and backward) and passes the
  fence (``handle.staged()``). Blocked = the save call + the wait at the fence;
* ``torch_save``: ``torch.save`` to ``/dev/shm`` (blocking by design);
* ``dcp_async``: ``torch.distributed.checkpoint.async_save`` to ``/dev/shm`` with one
  ``DefaultStager`` reused (its best CPU setup): the time until the call returns;
* restore: ``copy_back`` (``copy_`` from the preallocated buffers into the state's tensors: the
  floor of an in-place restore) against ``SyncCheckpointer.restore(state)`` from the local tier
  by a checkpointer opened (and listed, so its worker threads exist) beforehand: it reads the
  blob, verifies its checksum, checks the state's structure, copies in place.

With ``--device cuda`` the state lives on the GPU: the floors copy into pinned host buffers
(``non_blocking``, then synchronize), and the compute between an overlapped save and its fence
runs on the GPU.

Usage::

    python bench/stall.py [--tensors 16 3000 12000 100000] [--mb 200] [--repeats 7]
        [--device cuda]

Results: ``bench/results/stall.json`` (medians, spread, raw values, environment, load) and
``bench/results/stall.png``; a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import shutil
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
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Clock, environment, load_snapshot, summary, tree_nbytes
from save import tensors

import tiercheck

RESULTS = Path(__file__).resolve().parent / "results"

#: Issue #32's targets (a mixture-of-experts state of up to 100,000 tensors).
TARGETS = {
    "stall_over_copy": 1.15,
    "restore_over_copy_back": 1.3,
    "overlap_blocked_over_copy": 0.25,
}
SAVE_METHODS = ("copy", "copy_foreach", "tiercheck", "overlap", "torch_save", "dcp_async")
RESTORE_METHODS = ("copy_back", "restore")
LABELS = {
    "copy": "copy_ into preallocated buffers (floor)",
    "copy_foreach": "torch._foreach_copy_ into preallocated buffers",
    "tiercheck": "tiercheck save: stall",
    "overlap": "tiercheck save, overlap=True: blocked (save + fence)",
    "overlap_call": "  of which the save call",
    "overlap_fence": "  of which the wait at the fence",
    "torch_save": "torch.save -> /dev/shm",
    "dcp_async": "dcp.async_save (reused stager): blocking part",
    "copy_back": "copy_ back into the state (floor)",
    "restore": "tiercheck restore(state) <- local, in place",
}


def quiet_dcp() -> None:
    """DCP warns on every call that it runs without a process group: that is intended here."""
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")


class Model(nn.Module):
    """``n_params`` parameters in ``nn.Linear`` layers (weight + bias), ~``mb`` MB with AdamW."""

    def __init__(self, n_params: int, mb: float) -> None:
        super().__init__()
        layers = max(1, n_params // 2)
        # 3 copies of the weights (parameter, exp_avg, exp_avg_sq): d*d + d floats per layer.
        floats = mb * 1e6 / 4 / 3 / layers
        d = max(1, int(floats**0.5))
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))


class Run:
    """Everything measured for one tensor count."""

    def __init__(
        self, n_tensors: int, mb: float, shm: Path, compute: float, device: str = "cpu"
    ) -> None:
        torch.manual_seed(0)
        self.device = torch.device(device)
        self.model = Model(n_tensors // 4, mb).to(self.device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        for p in self.model.parameters():
            p.grad = torch.randn_like(p)
        self.opt.step()  # AdamW's state exists from the first step on
        self.step = 0
        state = self.state()
        self.n_tensors = len(tensors(state))
        self.nbytes = tree_nbytes(state)
        self.src = tensors(state)
        # The floor's buffers are host memory, pinned for a GPU state (as tiercheck's are).
        pin = self.device.type == "cuda"
        self.dst = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for t in self.src]
        for d, s in zip(self.dst, self.src, strict=True):
            d.copy_(s)
        self.shm = shm / f"n{n_tensors}"
        self.shm.mkdir(parents=True)
        self.stager = DefaultStager(StagingOptions(False, False, False, False))
        self.dcp_failed = False
        self.compute_factor = compute
        self.copy_s = float("nan")
        self.ckpt = self.open("blocking", overlap=False)
        self.ckpt_overlap = self.open("overlap", overlap=True)
        self.matrix = torch.randn(256, 256, device=self.device)

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict(), "step": self.step}

    def open(self, name: str, *, overlap: bool) -> tiercheck.SyncCheckpointer:
        return tiercheck.SyncCheckpointer(
            f"bench-stall-{name}",
            tiers=["local"],
            local_root=self.shm / name,
            persistent=(self.shm / "unused").as_uri(),
            overlap=overlap,
        ).open()

    def perturb(self) -> None:
        """A training step's worth of change, so every save copies new values."""
        self.step += 1
        with torch.no_grad():
            for t in self.src:
                if t.is_floating_point() and t.dim():
                    t.add_(1e-4)

    # --- saves: each returns {metric: seconds} ---------------------------------------------

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def copy(self) -> dict[str, float]:
        self.sync()
        non_blocking = self.device.type == "cuda"
        with Clock() as c:
            for d, s in zip(self.dst, self.src, strict=True):
                d.copy_(s, non_blocking=non_blocking)
            self.sync()
        self.copy_s = c.s
        return {"block": c.s}

    def copy_foreach(self) -> dict[str, float]:
        self.sync()
        with Clock() as c:
            torch._foreach_copy_(self.dst, self.src, non_blocking=self.device.type == "cuda")
            self.sync()
        return {"block": c.s}

    def tiercheck(self) -> dict[str, float]:
        state = self.state()
        self.sync()
        with Clock() as c:
            handle = self.ckpt.save(self.step * 10 + 1, state)
        self.ckpt.wait()
        if handle.stats.tiers["local"].state != "committed":
            raise RuntimeError(f"not committed: {handle}")
        return {"block": c.s, "stall_s": handle.stats.stall_s}

    def busy(self, seconds: float) -> float:
        """Compute on this thread for about ``seconds`` (a stand-in for forward and backward)."""
        t0 = time.perf_counter()
        m = self.matrix
        while time.perf_counter() - t0 < seconds:
            m = torch.tanh(m @ self.matrix)
            self.sync()  # on a GPU, compute for that long, not just queue it
        return time.perf_counter() - t0

    def overlap(self) -> dict[str, float]:
        state = self.state()
        self.sync()
        with Clock() as call:
            handle = self.ckpt_overlap.save(self.step * 10 + 2, state)
        compute = self.busy(self.compute_factor * self.copy_s)
        with Clock() as fence:
            handle.staged()
        self.ckpt_overlap.wait()
        if handle.stats.tiers["local"].state != "committed":
            raise RuntimeError(f"not committed: {handle}")
        return {
            "block": call.s + fence.s,
            "call": call.s,
            "fence": fence.s,
            "compute": compute,
            "staged_s": handle.stats.staged_s or float("nan"),
        }

    def torch_save(self) -> dict[str, float]:
        path = self.shm / "torch.pt"
        self.sync()
        with Clock() as c:
            torch.save(self.state(), path)
        path.unlink()
        return {"block": c.s}

    def dcp_async(self) -> dict[str, float]:
        path = self.shm / "dcp"
        state = self.state()
        t0 = time.perf_counter()
        try:
            fut = dcp.async_save(state, checkpoint_id=path, async_stager=self.stager)
        except Exception as exc:  # e.g. torch 2.11's stager cannot deep-copy a CUDA AdamW state
            if not self.dcp_failed:
                print(f"dcp.async_save failed, reported as nan: {exc!r}", file=sys.stderr)
            self.dcp_failed = True
            shutil.rmtree(path, ignore_errors=True)
            return {"block": float("nan")}
        block = time.perf_counter() - t0
        upload = fut.upload_completion if hasattr(fut, "upload_completion") else fut
        upload.result()
        shutil.rmtree(path)
        return {"block": block}

    # --- restores ---------------------------------------------------------------------------

    def copy_back(self) -> dict[str, float]:
        self.sync()
        with Clock() as c, torch.no_grad():
            for d, s in zip(self.dst, self.src, strict=True):
                s.copy_(d, non_blocking=self.device.type == "cuda")
            self.sync()
        return {"restore": c.s}

    def restore(self) -> dict[str, float]:
        state = self.state()
        ckpt = self.open("blocking", overlap=False)
        ckpt.versions()  # its worker threads exist, as in a job that lists before restoring
        try:
            with Clock() as c:
                restored = ckpt.restore(state)
                self.sync()
        finally:
            ckpt.close()
        if restored is None or restored.source_tier != "local":
            raise RuntimeError(f"restore did not come from the local tier: {restored}")
        return {"restore": c.s, "seconds": restored.seconds}

    def close(self) -> None:
        for c in (self.ckpt, self.ckpt_overlap):
            c.close()
        self.stager.close()
        shutil.rmtree(self.shm, ignore_errors=True)


def rounds(
    run: Run,
    methods: tuple[str, ...],
    n: int,
    log: Callable[[str], None],
    before: Callable[[], None],
) -> list[dict[str, dict[str, float]]]:
    """``n`` rounds of every method, in a new random order each round (seeded)."""
    rng = random.Random(run.n_tensors * 7919 + len(methods))
    out = []
    for i in range(n):
        before()
        order = list(methods)
        rng.shuffle(order)
        if "overlap" in order and "copy" in order:
            # The overlapped save computes for a multiple of this round's copy floor.
            order.remove("copy")
            order.insert(0, "copy")
        got: dict[str, dict[str, float]] = {}
        for name in order:
            got[name] = getattr(run, name)()
            gc.collect()
        out.append(got)
        log(
            f"    round {i}: "
            + "  ".join(f"{k}={next(iter(v.values())):.4f}" for k, v in sorted(got.items()))
        )
    return out


def paired(
    rows: list[dict[str, dict[str, float]]], num: tuple[str, str], den: tuple[str, str]
) -> dict[str, Any]:
    """The ratio round by round (its median and spread) and the ratio of the medians."""
    ratios = [r[num[0]][num[1]] / r[den[0]][den[1]] for r in rows]
    med_num = summary([r[num[0]][num[1]] for r in rows])["median"]
    med_den = summary([r[den[0]][den[1]] for r in rows])["median"]
    ratio = None if med_num is None or med_den is None else med_num / med_den
    return {"ratio_of_medians": ratio, "per_round": summary(ratios)}


def across(
    rows: list[dict[str, dict[str, float]]],
    num: tuple[str, str],
    others: list[dict[str, dict[str, float]]],
    den: tuple[str, str],
) -> dict[str, Any]:
    """Ratio of medians of two sets of rounds (not paired), spread over the numerator's."""
    med_den = summary([r[den[0]][den[1]] for r in others])["median"]
    values = [r[num[0]][num[1]] / med_den for r in rows]
    return {"ratio_of_medians": summary(values)["median"], "per_round": summary(values)}


def bench_count(
    n: int, args: argparse.Namespace, shm: Path, log: Callable[[str], None]
) -> dict[str, Any]:
    started = time.perf_counter()
    log(f"== {n} tensors: building the state")
    run = Run(n, args.mb, shm, args.compute, args.device)
    log(f"   {run.n_tensors} tensors, {run.nbytes / 1e6:.0f} MB")
    try:
        saves = rounds(run, SAVE_METHODS, args.warmup + args.repeats, log, run.perturb)
        # Restores open the job anew: its writer steps down first (one writer per job).
        run.ckpt.close()
        run.ckpt_overlap.close()
        restores = rounds(run, RESTORE_METHODS, args.warmup + args.repeats, log, lambda: None)
    finally:
        run.close()
        gc.collect()
    saves, restores = saves[args.warmup :], restores[args.warmup :]
    save_stats = {
        m: {k: summary([r[m][k] for r in saves]) for k in saves[0][m]} for m in SAVE_METHODS
    }
    restore_stats = {
        m: {k: summary([r[m][k] for r in restores]) for k in restores[0][m]}
        for m in RESTORE_METHODS
    }
    return {
        "tensors": run.n_tensors,
        "state_MB": run.nbytes / 1e6,
        "repeats": args.repeats,
        "save": save_stats,
        "restore": restore_stats,
        "ratios": {
            "stall_over_copy": paired(saves, ("tiercheck", "block"), ("copy", "block")),
            "stall_over_copy_foreach": paired(
                saves, ("tiercheck", "block"), ("copy_foreach", "block")
            ),
            "overlap_blocked_over_copy": paired(saves, ("overlap", "block"), ("copy", "block")),
            "overlap_call_over_copy": paired(saves, ("overlap", "call"), ("copy", "block")),
            "torch_save_over_copy": paired(saves, ("torch_save", "block"), ("copy", "block")),
            "dcp_async_over_copy": paired(saves, ("dcp_async", "block"), ("copy", "block")),
            "restore_over_copy_back": paired(
                restores, ("restore", "restore"), ("copy_back", "restore")
            ),
            # The same bytes copied the other way, in the save rounds: a steadier denominator
            # where the copy back has outliers (on a loaded machine it had, up to 100x).
            "restore_over_copy": across(restores, ("restore", "restore"), saves, ("copy", "block")),
        },
        "seconds": round(time.perf_counter() - started, 1),
        "load_after": load_snapshot(),
    }


# --- reporting -------------------------------------------------------------------------------


def _sec(s: dict[str, Any]) -> str:
    if s["median"] is None:
        return "n/a"
    return f"{s['median'] * 1e3:.1f} ({s['min'] * 1e3:.1f}-{s['max'] * 1e3:.1f})"


def _ratio(r: dict[str, Any]) -> str:
    p = r["per_round"]
    if r["ratio_of_medians"] is None:
        return "n/a"
    return f"{r['ratio_of_medians']:.2f}x ({p['min']:.2f}-{p['max']:.2f})"


def markdown(results: dict[str, Any]) -> str:
    counts = results["counts"]
    keys = list(counts)
    head = "| | " + " | ".join(f"{counts[k]['tensors']:,} tensors" for k in keys) + " |"
    sep = "| --- |" + " --: |" * len(keys)
    lines = [
        f"State: ~{results['setup']['mb']:.0f} MB fp32, model + AdamW. Milliseconds: median "
        "over rounds (min-max); ratios: of the medians (min-max of the round-by-round ratios).",
        "",
        head,
        sep,
    ]

    def row(label: str, get: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        lines.append(f"| {label} | " + " | ".join(_sec(get(counts[k])) for k in keys) + " |")

    for m in SAVE_METHODS:
        row(LABELS[m], lambda c, m=m: c["save"][m]["block"])
        if m == "overlap":
            row(LABELS["overlap_call"], lambda c: c["save"]["overlap"]["call"])
            row(LABELS["overlap_fence"], lambda c: c["save"]["overlap"]["fence"])
    for m in RESTORE_METHODS:
        row(LABELS[m], lambda c, m=m: c["restore"][m]["restore"])
    lines += ["", "| ratio | target | " + " | ".join(f"{counts[k]['tensors']:,}" for k in keys)]
    lines[-1] += " |"
    lines.append("| --- | --: |" + " --: |" * len(keys))
    for name in counts[keys[0]]["ratios"]:
        target = TARGETS.get(name)
        t = f"<= {target}" if target is not None else ""
        cells = []
        for k in keys:
            r = counts[k]["ratios"][name]
            met = ""
            if target is not None and r["ratio_of_medians"] is not None:
                met = " ok" if r["ratio_of_medians"] <= target else " NOT MET"
            cells.append(_ratio(r) + met)
        lines.append(f"| {name} | {t} | " + " | ".join(cells) + " |")
    env = results["environment"]
    lines += [
        "",
        f"{env['cpu_count']} CPUs, torch {env['torch']}, {env['torch_threads']} torch threads; "
        f"load at start {env['load_at_start']}, at end {env.get('load_at_end')}",
    ]
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = results["counts"]
    keys = list(counts)
    series = [
        ("stall_over_copy", "save stall", "tab:red"),
        ("overlap_blocked_over_copy", "overlapped: blocked", "tab:orange"),
        ("torch_save_over_copy", "torch.save", "tab:blue"),
        ("dcp_async_over_copy", "dcp.async_save (blocking)", "tab:brown"),
        ("restore_over_copy_back", "restore in place / copy back", "tab:purple"),
    ]
    fig, ax = plt.subplots(figsize=(9, 4.8))
    width = 0.8 / len(series)
    for j, (name, label, color) in enumerate(series):
        xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(keys))]
        meds = [counts[k]["ratios"][name]["ratio_of_medians"] for k in keys]
        if None in meds:  # a method that could not run here (see the log)
            continue
        spread = [counts[k]["ratios"][name]["per_round"] for k in keys]
        lo = [m - p["min"] for m, p in zip(meds, spread, strict=True)]
        hi = [p["max"] - m for m, p in zip(meds, spread, strict=True)]
        ax.bar(xs, meds, width, yerr=[lo, hi], capsize=2, label=label, color=color)
    for target, style in ((1.25, "--"), (2.0, ":"), (0.25, "-.")):
        ax.axhline(target, color="gray", linestyle=style, linewidth=1)
    ax.set_yscale("log")
    ax.set_xticks(range(len(keys)))
    ax.set_xticklabels([f"{counts[k]['tensors']:,} tensors" for k in keys])
    ax.set_ylabel("time / copy floor (same run; bars: min-max by round)")
    env = results["environment"]
    ax.set_title(
        f"~{results['setup']['mb']:.0f} MB model + AdamW state, {env['cpu_count']} CPUs, "
        "no GPU\n(targets: stall <= 1.25x, restore <= 2x, overlapped blocked <= 0.25x)",
        fontsize=9,
    )
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, nargs="+", default=[16, 3000, 12000, 100000])
    parser.add_argument("--mb", type=float, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--compute",
        type=float,
        default=3.0,
        help="compute between an overlapped save and its fence, in copy floors (default 3)",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument(
        "--device", default="cpu", help="where the state lives: cpu (default) or cuda"
    )
    parser.add_argument("--json", type=Path, default=RESULTS / "stall.json")
    parser.add_argument("--png", type=Path, default=RESULTS / "stall.png")
    args = parser.parse_args()
    quiet_dcp()
    if args.threads:
        torch.set_num_threads(args.threads)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    results: dict[str, Any] = {
        "environment": environment(),
        "setup": {
            "device": args.device,
            "mb": args.mb,
            "repeats": args.repeats,
            "warmup_rounds": args.warmup,
            "compute_factor": args.compute,
            "labels": LABELS,
        },
        "counts": {},
    }
    shm_base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    shm = Path(tempfile.mkdtemp(prefix="tiercheck-stall-", dir=shm_base))
    try:
        for n in args.tensors:
            results["counts"][str(n)] = bench_count(n, args, shm, log)
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(results, indent=1) + "\n")
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    results["environment"]["load_at_end"] = load_snapshot()
    args.json.write_text(json.dumps(results, indent=1) + "\n")
    try:
        plot(results, args.png)
    except ImportError as exc:  # matplotlib is optional: the table and the JSON are the result
        print(f"no plot ({exc}); install matplotlib for {args.png}", file=sys.stderr)
    print(markdown(results))
    print(f"\nresults: {args.json}, plot: {args.png}")


if __name__ == "__main__":
    main()
