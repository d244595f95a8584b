"""A normal end of a two-node job: both launchers exit 0, promptly, with nothing to report.

Two real ``torchrun`` launchers (``--nnodes 2``, static rendezvous on loopback, one process
each) run ``closing_worker.py``: restore, train, save every step, leave ``async with ckpt:``,
``dist.destroy_process_group()``. Node 0's launcher hosts the job's key-value store and may
leave as soon as its own worker is done, so nothing in tiercheck's close may talk to the store
after the ranks agreed that they are done with it.

The whole two-launcher job runs ``TIERCHECK_TWO_LAUNCHER_RUNS`` times (3 by default; more for a
soak), on the same job: each run restores the version the previous one ended with, bit-exact.
``TIERCHECK_TWO_LAUNCHER_PROCS`` sets the processes per launcher (1 by default).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

from tests.distributed._launch import events, first, launch_nodes, memory_root

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

STEPS_PER_RUN = 6
TROUBLE = re.compile(r"lost the store|could not reach the store|Traceback")
# The launchers' own log lines (torch.distributed.elastic, glog-style headers). Their exit
# barrier has a race of its own once every worker is done: the store's host passes the
# barrier and leaves while the other agent still waits on it, which the other agent logs as
# an error with a traceback and then exits 0 anyway. That is torch's, not tiercheck's, and
# happens after every worker has ended; it is counted and shown, not failed.
# The header names the file by its path from the working directory: ``torch/...`` or, with a
# virtual environment inside it (CI's), ``.venv/lib/python3.11/site-packages/torch/...``.
AGENT_LINE = re.compile(r"^[EWI]\d{4} [\d:.]+ +\d+ (\S*/)?torch/distributed/elastic/")


def trouble(stderr: str) -> tuple[str | None, bool]:
    """The first sign of trouble in a launcher's stderr outside the launcher's own log lines,
    and whether the launcher logged its exit barrier's race."""
    agent = [line for line in stderr.splitlines() if AGENT_LINE.match(line)]
    others = "\n".join(line for line in stderr.splitlines() if not AGENT_LINE.match(line))
    found = TROUBLE.search(others)
    return (found.group(0) if found else None), any("exit barrier" in line for line in agent)


def test_two_launchers_end_cleanly_every_time(tmp_path: Path) -> None:
    runs = int(os.environ.get("TIERCHECK_TWO_LAUNCHER_RUNS", "3"))
    procs = int(os.environ.get("TIERCHECK_TWO_LAUNCHER_PROCS", "1"))
    ranks = range(2 * procs)
    root = memory_root(tmp_path, "two")
    persistent = (tmp_path / "durable").as_uri()
    failures: list[str] = []
    previous_final: dict[int, str] = {}
    try:
        for run in range(runs):
            out = tmp_path / f"run{run}"
            steps = STEPS_PER_RUN * (run + 1)
            ended = launch_nodes(
                nodes=2,
                root=root,
                persistent=persistent,
                out=out,
                worker_args=["--steps", str(steps), "--dim", "16", "--peer-timeout", "60"],
                procs_per_node=procs,
            )
            seen = events(out)
            problems = [
                f"node {e.node}: exit {e.returncode} after {e.seconds:.1f}s"
                for e in ended
                if e.returncode != 0
            ]
            barrier_races = 0
            for e in ended:
                found, barrier_race = trouble(e.stderr)
                barrier_races += barrier_race
                if found is not None:
                    problems.append(f"node {e.node} stderr: {found!r}")
            for rank in ranks:
                mine = seen.get(rank, [])
                final = first(mine, "final")
                restored = first(mine, "restored")
                if final is None:
                    problems.append(f"rank {rank} did not finish")
                if run > 0 and (restored is None or restored["digest"] != previous_final.get(rank)):
                    problems.append(f"rank {rank} did not restore the previous run's end")
                if final is not None:
                    previous_final[rank] = final["digest"]
            times = ", ".join(f"node {e.node} {e.seconds:.1f}s" for e in ended)
            note = " (a launcher logged torch's exit-barrier race)" if barrier_races else ""
            print(f"run {run}: {times}; {problems or 'ok'}{note}")
            if problems:
                stderr = "\n".join(f"--- node {e.node}\n{e.stderr[-3000:]}" for e in ended)
                failures.append(f"run {run}: {problems}\n{stderr}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert not failures, f"{len(failures)} of {runs} runs failed:\n" + "\n".join(failures)
