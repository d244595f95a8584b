"""tiercheck against torch.save and torch.distributed.checkpoint, side by side, same state.

For each size a model-and-AdamW-shaped fp32 state is built (``make_state`` of ``save.py``) and
every method saves it in every repeat, in a shuffled order (drift on a noisy machine hits all
methods alike; each method's first ``--warmup`` rounds allocate memory and are reported apart):

* ``copy``: copy into buffers allocated once (the least any snapshot can cost; the baseline);
* ``clone``: ``clone()`` of every tensor (what a naive async checkpointer does);
* ``torch.save`` to ``/dev/shm`` and to disk (``--disk-dir``). ``torch.save`` does not fsync:
  the disk figure is measured without, and ``fsync`` of the file is timed after it, so
  "durable on disk" = save + fsync;
* ``dcp.save`` (blocking) to ``/dev/shm`` (``FileSystemWriter`` defaults: one file, fsync on);
* ``dcp.async_save`` to ``/dev/shm``, as documented (a fresh ``DefaultStager`` per call, which
  allocates its staging copy every time): blocking = until the call returns, end-to-end =
  until its future completes;
* ``dcp.async_save`` with one ``DefaultStager`` reused across saves (its cached staging storages
  make staging a copy into memory allocated once; DCP's best CPU setup, shown for fairness);
* ``tiercheck.SyncCheckpointer`` with the local tier (``/dev/shm``) and the persistent tier (a
  folder on disk, fsynced): blocking = wall time of ``save()`` as the caller sees it
  (``handle.stats.stall_s`` is recorded too), durable = ``handle.stats.tiers[t].seconds``
  (from the start of ``save`` until committed). ``base_every=1``: every measured version is a
  base and so goes to the persistent tier too (packed: byte planes + zstd). ``ckpt.wait()``
  after each save, as a training step would leave time for the background.

No process group is initialized: DCP saves and loads as a single process (``no_dist``).

Then restores, also interleaved: ``torch.load`` from ``/dev/shm`` and from disk (the file's
pages evicted from the page cache first), ``dcp.load`` (in place) from ``/dev/shm``, and
tiercheck's ``restore(state)`` (in place) by a new checkpointer, from the local tier and from
the persistent tier (an empty local root, as after the loss of the node; pages evicted).

Usage::

    python bench/compare.py [--sizes-mb 50 250 1024 2048] [--repeats 5]

Results: ``bench/results/compare.json`` (medians, spread, raw values, environment) and the plot
``docs/img/compare.png`` (shown in the docs); markdown tables on stdout.
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
import xxhash
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    Clock,
    environment,
    evict_from_page_cache,
    fsync_path,
    load_snapshot,
    summary,
    tree_nbytes,
)
from save import PlainCopy, make_state, perturb, tensors

import tiercheck

RESULTS = Path(__file__).resolve().parent / "results"
#: The docs show the plot (docs/performance.md).
PLOTS = Path(__file__).resolve().parent.parent / "docs" / "img"
HEADLINE_MB = 1024

# Targets of issue 7 (measured on the same state in the same run).
TARGETS = {
    "stall_over_copy": 1.25,
    "stall_over_dcp_async_blocking": 0.7,
    "local_durable_over_dcp_async_e2e": 0.35,
    "restore_local_over_torch_load_shm": 1.0,
}

SAVE_LABELS = {
    "copy": "copy into preallocated buffers",
    "clone": "clone()",
    "torch_save_shm": "torch.save -> /dev/shm",
    "torch_save_disk": "torch.save -> disk (no fsync)",
    "dcp_save": "dcp.save -> /dev/shm",
    "dcp_async": "dcp.async_save -> /dev/shm",
    "dcp_async_reused": "dcp.async_save, reused stager -> /dev/shm",
    "tiercheck": "tiercheck save (local + persistent)",
}
RESTORE_LABELS = {
    "torch_load_shm": "torch.load <- /dev/shm",
    "torch_load_disk": "torch.load <- disk (cold)",
    "dcp_load": "dcp.load <- /dev/shm (in place)",
    "tiercheck_local": "tiercheck restore <- local (in place)",
    "tiercheck_persistent": "tiercheck restore <- persistent (cold, in place)",
}


# One colour per method in every panel: tiercheck in red (local) and purple (persistent).
COLORS = {
    "copy": "black",
    "clone": "tab:gray",
    "torch_save_shm": "tab:blue",
    "torch_load_shm": "tab:blue",
    "torch_save_disk": "tab:cyan",
    "torch_load_disk": "tab:cyan",
    "dcp_save": "tab:green",
    "dcp_load": "tab:green",
    "dcp_async": "tab:brown",
    "dcp_async_reused": "tab:olive",
    "tiercheck": "tab:red",
    "tiercheck.durable_persistent": "tab:purple",
    "tiercheck_local": "tab:red",
    "tiercheck_persistent": "tab:purple",
}


def quiet_dcp() -> None:
    """DCP warns on every call that it runs without a process group: that is intended here."""
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")


class SizeRun:
    """Everything measured for one state size."""

    def __init__(self, mb: int, shm: Path, disk: Path) -> None:
        self.mb = mb
        self.shm = shm / f"{mb}MB"
        self.disk = disk / f"{mb}MB"
        self.shm.mkdir(parents=True)
        self.disk.mkdir(parents=True)
        self.state = make_state(mb)
        self.nbytes = tree_nbytes(self.state)
        self.plain = PlainCopy(self.state)
        self.stager = DefaultStager(StagingOptions(False, False, False, False))
        self.job = f"bench-compare-{mb}"
        self.local_root = self.shm / "tiercheck-node"
        self.persistent = (self.disk / "persistent").as_uri()
        self.ckpt: tiercheck.SyncCheckpointer | None = None
        self.version = 0

    def open_ckpt(self, local_root: Path | None = None) -> tiercheck.SyncCheckpointer:
        return tiercheck.SyncCheckpointer(
            self.job,
            local_root=local_root or self.local_root,
            persistent=self.persistent,
            base_every=1,
        )

    # --- saves: each returns {metric: seconds} --------------------------------------------

    def copy(self) -> dict[str, float]:
        return {"block": self.plain()}

    def clone(self) -> dict[str, float]:
        with Clock() as c:
            kept = [t.clone() for t in tensors(self.state)]
        del kept
        return {"block": c.s}

    def torch_save_shm(self) -> dict[str, float]:
        path = self.shm / "torch.pt"
        with Clock() as c:
            torch.save(self.state, path)
        path.unlink()
        return {"block": c.s, "durable": c.s}

    def torch_save_disk(self) -> dict[str, float]:
        path = self.disk / "torch.pt"
        with Clock() as c:
            torch.save(self.state, path)
        with Clock() as f:
            fsync_path(path)
        path.unlink()
        return {"block": c.s, "fsync": f.s, "durable": c.s + f.s}

    def dcp_save(self) -> dict[str, float]:
        path = self.shm / "dcp"
        with Clock() as c:
            dcp.save(self.state, checkpoint_id=path)
        shutil.rmtree(path)
        return {"block": c.s, "durable": c.s}

    def _dcp_async(self, path: Path, stager: DefaultStager | None) -> dict[str, float]:
        t0 = time.perf_counter()
        fut = dcp.async_save(self.state, checkpoint_id=path, async_stager=stager)
        block = time.perf_counter() - t0
        upload = fut.upload_completion if hasattr(fut, "upload_completion") else fut
        upload.result()
        e2e = time.perf_counter() - t0
        shutil.rmtree(path)
        return {"block": block, "durable": e2e}

    def dcp_async(self) -> dict[str, float]:
        return self._dcp_async(self.shm / "dcp-async", None)

    def dcp_async_reused(self) -> dict[str, float]:
        return self._dcp_async(self.shm / "dcp-async-reused", self.stager)

    def tiercheck(self) -> dict[str, float]:
        assert self.ckpt is not None
        version, self.version = self.version, self.version + 1
        t0 = time.perf_counter()
        handle = self.ckpt.save(version, self.state)
        block = time.perf_counter() - t0
        self.ckpt.wait()
        tiers = handle.stats.tiers
        for name in ("local", "persistent"):
            if tiers[name].state != "committed":
                raise RuntimeError(f"version {version} not committed in {name}: {tiers[name]}")
        return {
            "block": block,
            "stall_s": handle.stats.stall_s,
            "durable_local": tiers["local"].seconds or float("nan"),
            "durable_persistent": tiers["persistent"].seconds or float("nan"),
            "persistent_blob_ratio": self.nbytes / max(1, tiers["persistent"].bytes),
        }

    # --- restores ---------------------------------------------------------------------------

    def prepare_restores(self) -> None:
        """The files the other methods restore from: the state as tiercheck last saved it."""
        torch.save(self.state, self.shm / "torch.pt")
        torch.save(self.state, self.disk / "torch.pt")
        fsync_path(self.disk / "torch.pt")
        dcp.save(self.state, checkpoint_id=self.shm / "dcp")

    def torch_load_shm(self) -> dict[str, float]:
        with Clock() as c:
            loaded = torch.load(self.shm / "torch.pt", weights_only=True)
        del loaded
        return {"restore": c.s}

    def torch_load_disk(self) -> dict[str, float]:
        evict_from_page_cache([self.disk / "torch.pt"])
        with Clock() as c:
            loaded = torch.load(self.disk / "torch.pt", weights_only=True)
        del loaded
        return {"restore": c.s}

    def dcp_load(self) -> dict[str, float]:
        with Clock() as c:
            dcp.load(self.state, checkpoint_id=self.shm / "dcp")
        return {"restore": c.s}

    def _tiercheck_restore(self, local_root: Path, expect: str) -> dict[str, float]:
        with Clock() as opening:
            ckpt = self.open_ckpt(local_root).open()
        try:
            with Clock() as c:
                restored = ckpt.restore(self.state)
        finally:
            ckpt.close()
        assert restored is not None
        if restored.source_tier != expect:
            raise RuntimeError(f"restored from {restored.source_tier!r}, expected {expect!r}")
        return {"restore": c.s, "restore_stats_s": restored.seconds, "open_s": opening.s}

    def tiercheck_local(self) -> dict[str, float]:
        return self._tiercheck_restore(self.local_root, "local")

    def tiercheck_persistent(self) -> dict[str, float]:
        evict_from_page_cache([self.disk / "persistent"])
        empty = self.shm / "tiercheck-new-node"
        try:
            return self._tiercheck_restore(empty, "persistent")
        finally:
            shutil.rmtree(empty, ignore_errors=True)

    def digests(self) -> list[int]:
        return [
            xxhash.xxh3_64_intdigest(t.contiguous().reshape(-1).view(torch.uint8).numpy())
            for t in tensors(self.state)
        ]

    def check_bit_exact(self, method: Callable[[], dict[str, float]]) -> bool:
        """Zero the state, restore it with ``method``, compare with the saved state's digests."""
        expected = self.digests()
        with torch.no_grad():
            for t in tensors(self.state):
                t.zero_()
        method()
        return self.digests() == expected

    def close(self) -> None:
        if self.ckpt is not None:
            self.ckpt.close()
        self.stager.close()
        shutil.rmtree(self.shm, ignore_errors=True)
        shutil.rmtree(self.disk, ignore_errors=True)


def rounds(
    run: SizeRun,
    methods: list[str],
    n: int,
    log: Callable[[str], None],
    before: Callable[[int], None],
) -> list[dict[str, dict[str, float]]]:
    """``n`` rounds of every method, in a new random order each round (seeded).

    Shuffled rather than rotated: a rotation keeps every method's neighbours, and on a small
    state what ran just before (its cache footprint, threads still winding down) shows.
    """
    rng = random.Random(n * 7919 + len(methods))
    out = []
    for i in range(n):
        before(i)
        order = list(methods)
        rng.shuffle(order)
        got: dict[str, dict[str, float]] = {}
        for name in order:
            got[name] = getattr(run, name)()
            gc.collect()
        out.append(got)
        log(
            f"    round {i}: "
            + "  ".join(f"{k}={next(iter(v.values())):.3f}" for k, v in got.items())
        )
    return out


def collect(rows: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, Any]]:
    """{method: {metric: summary over rows}}."""
    out: dict[str, dict[str, Any]] = {}
    for method in rows[0]:
        out[method] = {
            metric: summary([r[method][metric] for r in rows]) for metric in rows[0][method]
        }
    return out


def paired(
    rows: list[dict[str, dict[str, float]]], num: tuple[str, str], den: tuple[str, str]
) -> dict[str, Any]:
    """A ratio per repeat (same round), and the ratio of the medians."""
    ratios = [r[num[0]][num[1]] / r[den[0]][den[1]] for r in rows]
    med = (
        summary([r[num[0]][num[1]] for r in rows])["median"]
        / (summary([r[den[0]][den[1]] for r in rows])["median"])
    )
    s = summary(ratios)
    return {"ratio_of_medians": med, "per_repeat": s}


def bench_size(mb: int, repeats: int, warmup: int, shm: Path, disk: Path) -> dict[str, Any]:
    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    started = time.perf_counter()
    log(f"== {mb} MB: building the state")
    run = SizeRun(mb, shm, disk)
    try:
        run.ckpt = run.open_ckpt().open()
        save_methods = list(SAVE_LABELS)
        log(f"  saves: {warmup} warm-up + {repeats} measured rounds")
        save_rows = rounds(
            run, save_methods, warmup + repeats, log, lambda i: perturb(run.state, 1000 + i)
        )
        run.ckpt.close()
        run.ckpt = None
        run.stager.close()
        run.plain.dst.clear()  # memory for the restores (2 GiB states are tight in 24 GiB)
        gc.collect()
        log("  restores")
        run.prepare_restores()
        exact = {
            "tiercheck_local": run.check_bit_exact(run.tiercheck_local),
            "tiercheck_persistent": run.check_bit_exact(run.tiercheck_persistent),
        }
        restore_methods = list(RESTORE_LABELS)
        restore_rows = rounds(run, restore_methods, 1 + repeats, log, lambda i: None)
    finally:
        run.close()
        gc.collect()
    warm = save_rows[:warmup]
    measured = save_rows[warmup:]
    restores = restore_rows[1:]
    result: dict[str, Any] = {
        "state_MiB": mb,
        "repeats": repeats,
        "warmup_rounds": warmup,
        "save": collect(measured),
        "save_warmup": {m: [w[m] for w in warm] for m in save_methods},
        "restore": collect(restores),
        "restore_first_round": restore_rows[0],
        "bit_exact": exact,
        "ratios": {
            "stall_over_copy": paired(measured, ("tiercheck", "block"), ("copy", "block")),
            "stall_over_clone": paired(measured, ("tiercheck", "block"), ("clone", "block")),
            "stall_over_dcp_async_blocking": paired(
                measured, ("tiercheck", "block"), ("dcp_async", "block")
            ),
            "stall_over_dcp_async_reused_blocking": paired(
                measured, ("tiercheck", "block"), ("dcp_async_reused", "block")
            ),
            "local_durable_over_dcp_async_e2e": paired(
                measured, ("tiercheck", "durable_local"), ("dcp_async", "durable")
            ),
            "local_durable_over_dcp_async_reused_e2e": paired(
                measured, ("tiercheck", "durable_local"), ("dcp_async_reused", "durable")
            ),
            "local_durable_over_torch_save_shm": paired(
                measured, ("tiercheck", "durable_local"), ("torch_save_shm", "durable")
            ),
            "persistent_durable_over_torch_save_disk_fsync": paired(
                measured, ("tiercheck", "durable_persistent"), ("torch_save_disk", "durable")
            ),
            "restore_local_over_torch_load_shm": paired(
                restores, ("tiercheck_local", "restore"), ("torch_load_shm", "restore")
            ),
            "restore_local_over_dcp_load": paired(
                restores, ("tiercheck_local", "restore"), ("dcp_load", "restore")
            ),
            "restore_persistent_over_torch_load_disk": paired(
                restores, ("tiercheck_persistent", "restore"), ("torch_load_disk", "restore")
            ),
        },
        "seconds": round(time.perf_counter() - started, 1),
        "load_after": load_snapshot(),
    }
    return result


# --- reporting -------------------------------------------------------------------------------


def _fmt(s: dict[str, Any] | None) -> str:
    if not s or s.get("median") is None:
        return "-"
    return f"{s['median']:.3f} ({s['min']:.3f}-{s['max']:.3f})"


def _ratio(r: dict[str, Any]) -> str:
    p = r["per_repeat"]
    return f"{r['ratio_of_medians']:.2f}x ({p['min']:.2f}-{p['max']:.2f})"


def markdown(results: dict[str, Any]) -> str:
    sizes = results["sizes"]
    keys = list(sizes)
    lines = ["Seconds: median over repeats (min-max in brackets).", ""]
    head = "| method | " + " | ".join(f"{k} MiB" for k in keys) + " |"
    sep = "| --- |" + " --: |" * len(keys)

    def row(label: str, get: Callable[[dict[str, Any]], Any]) -> str:
        return f"| {label} | " + " | ".join(_fmt(get(sizes[k])) for k in keys) + " |"

    lines += ["**Blocking time per save** (the training loop waits this long)", "", head, sep]
    for m, label in SAVE_LABELS.items():
        lines.append(row(label, lambda s, m=m: s["save"][m]["block"]))
    lines.append(row("tiercheck `stats.stall_s`", lambda s: s["save"]["tiercheck"]["stall_s"]))
    lines += ["", "**First save** (blocking time; allocates memory; not in the medians)", ""]
    lines += [head, sep]
    for m, label in SAVE_LABELS.items():
        lines.append(
            f"| {label} | "
            + " | ".join(f"{sizes[k]['save_warmup'][m][0]['block']:.3f}" for k in keys)
            + " |"
        )
    lines += ["", "**Time until durable** (from the start of the save)", "", head, sep]
    durable = [
        ("torch.save -> /dev/shm", "torch_save_shm", "durable"),
        ("torch.save -> disk + fsync", "torch_save_disk", "durable"),
        ("dcp.save -> /dev/shm", "dcp_save", "durable"),
        ("dcp.async_save -> /dev/shm (end to end)", "dcp_async", "durable"),
        ("dcp.async_save, reused stager (end to end)", "dcp_async_reused", "durable"),
        ("tiercheck: committed in local (/dev/shm)", "tiercheck", "durable_local"),
        ("tiercheck: committed in persistent (disk, fsync)", "tiercheck", "durable_persistent"),
    ]
    for label, m, metric in durable:
        lines.append(row(label, lambda s, m=m, metric=metric: s["save"][m][metric]))
    lines += ["", "**Restore time**", "", head, sep]
    for m, label in RESTORE_LABELS.items():
        lines.append(row(label, lambda s, m=m: s["restore"][m]["restore"]))
    lines += ["", "**Ratios** (of medians; per-repeat range in brackets)", ""]
    lines += ["| ratio | target | " + " | ".join(f"{k} MiB" for k in keys) + " |"]
    lines += ["| --- | --: |" + " --: |" * len(keys)]
    for name in sizes[keys[0]]["ratios"]:
        target = TARGETS.get(name)
        t = f"<= {target}" if target is not None else ""
        cells = " | ".join(_ratio(sizes[k]["ratios"][name]) for k in keys)
        lines.append(f"| {name} | {t} | {cells} |")
    headline = str(HEADLINE_MB) if str(HEADLINE_MB) in sizes else keys[-1]
    h = sizes[headline]
    lines += ["", f"**Targets at {headline} MiB**", ""]
    lines += ["| target | measured | met |", "| --- | --: | --- |"]
    for name, target in TARGETS.items():
        value = h["ratios"][name]["ratio_of_medians"]
        lines.append(
            f"| {name} <= {target} | {value:.2f}x | {'yes' if value <= target else 'NO'} |"
        )
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = results["sizes"]
    keys = list(sizes)
    xs = [sizes[k]["state_MiB"] for k in keys]
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.2))
    panels: list[tuple[str, list[tuple[str, str, str, str]]]] = [
        (
            "Blocking time per save",
            [
                ("copy into preallocated", "save", "copy", "block"),
                ("clone()", "save", "clone", "block"),
                ("torch.save -> /dev/shm", "save", "torch_save_shm", "block"),
                ("torch.save -> disk (no fsync)", "save", "torch_save_disk", "block"),
                ("dcp.save -> /dev/shm", "save", "dcp_save", "block"),
                ("dcp.async_save (blocking part)", "save", "dcp_async", "block"),
                ("dcp.async_save, reused stager", "save", "dcp_async_reused", "block"),
                ("tiercheck save", "save", "tiercheck", "block"),
            ],
        ),
        (
            "Time until durable",
            [
                ("torch.save -> /dev/shm", "save", "torch_save_shm", "durable"),
                ("torch.save -> disk + fsync", "save", "torch_save_disk", "durable"),
                ("dcp.save -> /dev/shm", "save", "dcp_save", "durable"),
                ("dcp.async_save (end to end)", "save", "dcp_async", "durable"),
                ("dcp.async_save, reused stager", "save", "dcp_async_reused", "durable"),
                ("tiercheck: local tier", "save", "tiercheck", "durable_local"),
                ("tiercheck: persistent tier", "save", "tiercheck", "durable_persistent"),
            ],
        ),
        (
            "Restore time",
            [
                ("torch.load <- /dev/shm", "restore", "torch_load_shm", "restore"),
                ("torch.load <- disk (cold)", "restore", "torch_load_disk", "restore"),
                ("dcp.load <- /dev/shm", "restore", "dcp_load", "restore"),
                ("tiercheck <- local", "restore", "tiercheck_local", "restore"),
                ("tiercheck <- persistent (cold)", "restore", "tiercheck_persistent", "restore"),
            ],
        ),
    ]
    for ax, (title, series) in zip(axes, panels, strict=True):
        for label, part, method, metric in series:
            stats = [sizes[k][part][method][metric] for k in keys]
            med = [s["median"] for s in stats]
            lo = [s["median"] - s["min"] for s in stats]
            hi = [s["max"] - s["median"] for s in stats]
            is_tc = method.startswith("tiercheck")
            color = COLORS.get(f"{method}.{metric}", COLORS.get(method))
            ax.errorbar(
                xs,
                med,
                yerr=[lo, hi],
                label=label,
                color=color,
                marker="o" if is_tc else ".",
                linewidth=2.4 if is_tc else 1.2,
                linestyle="-" if is_tc or method == "copy" else "--",
                capsize=2,
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(xs)
        ax.set_xticklabels([str(x) for x in xs])
        ax.set_xlabel("state size (MiB, fp32)")
        ax.set_ylabel("seconds (median; bars: min-max)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7.5, loc="upper left")
    env = results["environment"]
    fig.suptitle(
        f"tiercheck vs torch.save vs torch.distributed.checkpoint - {env['cpu_count']} CPUs, "
        f"torch {env['torch']}, no GPU; /dev/shm = tmpfs, disk = {results['disk_dir']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[50, 250, 1024, 2048])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--big-repeats", type=int, default=3, help="repeats for sizes above 1 GiB (default 3)"
    )
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--disk-dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--json", type=Path, default=RESULTS / "compare.json")
    parser.add_argument("--png", type=Path, default=PLOTS / "compare.png")
    args = parser.parse_args()
    quiet_dcp()

    results: dict[str, Any] = {
        "environment": environment(),
        "disk_dir": str(args.disk_dir),
        "method_labels": {**SAVE_LABELS, **RESTORE_LABELS},
        "notes": {
            "dcp": "single process, no process group (no_dist); FileSystemWriter defaults "
            "(one file per rank, sync_files=True, thread_count=1)",
            "torch_save_disk": "torch.save does not fsync; 'durable' adds an fsync of the file",
            "tiercheck": "SyncCheckpointer(local_root=/dev/shm/..., persistent=file://<disk>, "
            "base_every=1): every version is a base and goes to both tiers; ckpt.wait() "
            "after each save; blocking = wall time of save() seen by the caller",
            "restore": "torch.load allocates new tensors; dcp.load and tiercheck restore fill "
            "the existing state in place; 'cold' = the files' pages evicted from this "
            "kernel's page cache (posix_fadvise DONTNEED) before the read",
        },
        "sizes": {},
    }
    shm_base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    shm = Path(tempfile.mkdtemp(prefix="tiercheck-compare-", dir=shm_base))
    disk = Path(tempfile.mkdtemp(prefix="tiercheck-compare-", dir=args.disk_dir))
    try:
        for mb in args.sizes_mb:
            repeats = args.repeats if mb <= 1024 else min(args.repeats, args.big_repeats)
            results["sizes"][str(mb)] = bench_size(mb, repeats, args.warmup, shm, disk)
            # Write as we go: a later size that fails leaves the earlier ones.
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(results, indent=1) + "\n")
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    results["environment"]["load_at_end"] = load_snapshot()
    args.json.write_text(json.dumps(results, indent=1) + "\n")
    plot(results, args.png)
    print(markdown(results))
    print(f"\nresults: {args.json}, plot: {args.png}")


if __name__ == "__main__":
    main()
