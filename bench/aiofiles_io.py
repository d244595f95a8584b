"""The node identity record read through ``aiofiles``, against ``asyncio.to_thread``, one process.

tiercheck reads a node's identity record (``identity.json``, a few hundred bytes) from async
code through ``aiofiles`` (:func:`tiercheck.smallfile.read_small`: once when a checkpointer
opens, once when the command line scans a node root), and checks that it is still there the same
way (``aiofiles.os.path.exists``, after a commit). This measures what that costs against the
plain alternative, in the same process, on the same file (written by
:func:`tiercheck.guards.node.write_identity` into a folder under ``/dev/shm``, where node roots
live):

* ``read``: ``read_small(path)`` (``aiofiles.open``, ``read``, close: three hops to the
  loop's default executor) against ``asyncio.to_thread(path.read_bytes)`` (one hop);
* ``read_x16``: 16 such reads at once (``asyncio.gather``), per read;
* ``exists``: ``aiofiles.os.path.exists(path)`` against ``asyncio.to_thread(path.exists)``.

Each repeat makes ``--calls`` calls of each variant (16 reads count as 16), in turns of 10
calls, alternating (A B, then B A) so that a drift of the machine's load hits both; figures
are the medians over ``--repeats``, and the ratio (aiofiles / to_thread) is the median of the
repeats' own ratios. The machine is shared: the load at the start and end is recorded beside
the figures.

Usage::

    python bench/aiofiles_io.py [--calls 2000] [--repeats 7] [--json PATH]

Prints microseconds per call and the ratios; writes ``bench/results/aiofiles_io.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiofiles.os

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment, load_snapshot, summary

from tiercheck.consistency.identity import NodeIdentity
from tiercheck.defaults import NodeRoot
from tiercheck.guards import write_identity
from tiercheck.smallfile import read_small

RESULTS = Path(__file__).resolve().parent / "results"
CONCURRENT = 16
#: Calls of one variant in a turn; the variants take turns.
CHUNK = 10

Op = Callable[[], Awaitable[object]]


def variants(path: Path) -> dict[str, tuple[Op, Op]]:
    """Each measured operation: (through aiofiles, through ``asyncio.to_thread``)."""

    async def read_aio() -> object:
        return await read_small(path)

    async def read_thread() -> object:
        return await asyncio.to_thread(path.read_bytes)

    async def many_aio() -> object:
        return await asyncio.gather(*(read_small(path) for _ in range(CONCURRENT)))

    async def many_thread() -> object:
        return await asyncio.gather(
            *(asyncio.to_thread(path.read_bytes) for _ in range(CONCURRENT))
        )

    async def exists_aio() -> object:
        return await aiofiles.os.path.exists(path)

    async def exists_thread() -> object:
        return await asyncio.to_thread(path.exists)

    return {
        "read": (read_aio, read_thread),
        "read_x16": (many_aio, many_thread),
        "exists": (exists_aio, exists_thread),
    }


async def timed(op: Op, calls: int) -> float:
    """Seconds that ``calls`` calls of ``op`` take, one after another."""
    t0 = time.perf_counter()
    for _ in range(calls):
        await op()
    return time.perf_counter() - t0


async def measure(path: Path, whole: bytes, calls: int, repeats: int) -> dict[str, Any]:
    ops = variants(path)
    for aio, thread in ops.values():  # warm both paths (threads started, file cached)
        await timed(aio, 50)
        await timed(thread, 50)
    if await read_small(path) != whole:  # the same bytes both ways
        raise AssertionError("read_small read other bytes than Path.read_bytes")
    runs: dict[str, dict[str, list[float]]] = {
        name: {"aiofiles_us": [], "to_thread_us": [], "ratio": []} for name in ops
    }
    for _ in range(repeats):
        for name, (aio, thread) in ops.items():
            per = CONCURRENT if name == "read_x16" else 1
            rounds = max(1, calls // per // CHUNK)
            spent = {aio: 0.0, thread: 0.0}
            for i in range(rounds):  # short turns, A B then B A: both see the same load
                for op in (aio, thread) if i % 2 == 0 else (thread, aio):
                    spent[op] += await timed(op, CHUNK)
            a, t = (spent[op] / (rounds * CHUNK * per) * 1e6 for op in (aio, thread))
            runs[name]["aiofiles_us"].append(a)
            runs[name]["to_thread_us"].append(t)
            runs[name]["ratio"].append(a / t)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="calls of each variant a repeat")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", type=Path, default=RESULTS / "aiofiles_io.json")
    args = parser.parse_args()
    shm = Path("/dev/shm")
    base = Path(
        tempfile.mkdtemp(prefix="tiercheck-bench-aiofiles-", dir=shm if shm.is_dir() else None)
    )
    try:
        identity = NodeIdentity("job", "t0k3n" * 4, 64, "s3://bucket/ckpt/job", time.time())
        write_identity(base, identity)
        path = NodeRoot(base).identity
        load_before = load_snapshot()
        runs = asyncio.run(measure(path, path.read_bytes(), args.calls, args.repeats))
        load_after = load_snapshot()
        size = path.stat().st_size
    finally:
        shutil.rmtree(base, ignore_errors=True)
    medians = {
        name: {key: statistics.median(values) for key, values in got.items()}
        for name, got in runs.items()
    }
    print(f"identity.json: {size} bytes; {args.repeats} repeats of {args.calls} calls; medians")
    print(f"{'op':10s} {'aiofiles us':>12s} {'to_thread us':>13s} {'ratio':>7s}")
    for name, got in medians.items():
        print(
            f"{name:10s} {got['aiofiles_us']:12.1f} {got['to_thread_us']:13.1f} "
            f"{got['ratio']:6.2f}x"
        )
    out = {
        "environment": environment(),
        "load_before": load_before,
        "load_after": load_after,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "file_bytes": size,
        "medians": medians,
        "runs": {name: {k: summary(v) for k, v in got.items()} for name, got in runs.items()},
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
