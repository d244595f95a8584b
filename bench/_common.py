"""Helpers shared by the comparison benchmarks (``compare.py``, ``overhead.py``).

Statistics (medians and spread over repeats), the environment a result was measured in (with
how busy the machine was: the dev box is shared, so every result records its load), a timer,
and a way to evict one file's pages from the page cache so that a "disk" read really reads
the disk (``posix_fadvise(DONTNEED)`` on that file only; nothing global is dropped).
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "Clock",
    "cpu_pressure",
    "environment",
    "evict_from_page_cache",
    "fsync_path",
    "load_snapshot",
    "run_ranks",
    "summary",
    "tree_nbytes",
]


def summary(values: Sequence[float]) -> dict[str, Any]:
    """Median, min, max and the raw values of ``values`` (NaN-free)."""
    vals = [float(v) for v in values if not math.isnan(v)]
    if not vals:
        return {"median": None, "min": None, "max": None, "n": 0, "values": []}
    return {
        "median": statistics.median(vals),
        "min": min(vals),
        "max": max(vals),
        "n": len(vals),
        "values": [round(v, 6) for v in vals],
    }


def cpu_pressure() -> float | None:
    """Share of the last 10 s in which some runnable task waited for a CPU (PSI), in %."""
    try:
        line = Path("/proc/pressure/cpu").read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    fields = dict(f.split("=") for f in line.split()[1:])
    return float(fields["avg10"])


def load_snapshot() -> dict[str, Any]:
    """How busy the machine is right now (load averages and CPU pressure)."""
    one, five, _ = os.getloadavg()
    return {"loadavg_1m": round(one, 2), "loadavg_5m": round(five, 2), "cpu_psi10": cpu_pressure()}


def environment() -> dict[str, Any]:
    """What the figures were measured on."""
    mem = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, value = line.split(":", 1)
            if key in ("MemTotal", "MemAvailable"):
                mem[key] = value.strip()
    except OSError:
        pass
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory": mem,
        "time": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "load_at_start": load_snapshot(),
    }


class Clock:
    """``with Clock() as c: ...`` then ``c.s`` is the wall time of the block."""

    s: float = float("nan")

    def __enter__(self) -> Clock:
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.s = time.perf_counter() - self._t0


def fsync_path(path: Path) -> None:
    """``fsync`` one file (and nothing else)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def evict_from_page_cache(paths: Iterable[Path]) -> None:
    """Drop the cached pages of these files (or of every file under these folders).

    Only clean pages are dropped, so a file is synced first. Other processes' files are not
    touched. On a VM the host may still cache the disk: "cold" means cold in this kernel.
    """
    files: list[Path] = []
    for p in paths:
        if p.is_dir():
            files += [Path(root) / f for root, _, names in os.walk(p) for f in names]
        elif p.exists():
            files.append(p)
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def tree_nbytes(obj: Any) -> int:
    """Bytes of every tensor in a nested state."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tree_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tree_nbytes(v) for v in obj)
    return 0


def run_ranks(world: int, fn: Callable[[int], Any]) -> list[Any]:
    """``fn(rank)`` for every rank of ``world``, each on a thread (the ranks of a
    ``tiercheck.testing.LocalGroup``); the results in rank order, or the first error raised."""
    results: list[Any] = [None] * world
    errors: list[BaseException] = []

    def one(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results
