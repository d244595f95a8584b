"""Helpers of the multi-launcher tests: one real ``torchrun`` launcher per simulated node.

Each launcher runs ``closing_worker.py`` as node ``r`` of ``--nnodes`` with the static
rendezvous on loopback; node 0's launcher (its elastic agent) hosts the job's key-value store,
as on a real cluster. Nodes get memory roots of their own under ``/dev/shm`` where it exists.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WORKER = Path(__file__).with_name("closing_worker.py")
#: Generous: a launcher that has not exited by then is hung, not slow.
LAUNCHER_TIMEOUT = 120.0


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def memory_root(tmp: Path, name: str) -> Path:
    """A fresh folder for the simulated nodes' shared memory (removed by the caller)."""
    shm = Path("/dev/shm")
    unique = f"tiercheck-test-{name}-{uuid.uuid4().hex[:12]}"
    return shm / unique if shm.is_dir() else tmp / unique


@dataclass
class Launched:
    """How one launcher ended."""

    node: int
    returncode: int | None  # None: killed after LAUNCHER_TIMEOUT
    seconds: float
    stderr: str


def launch_nodes(
    *,
    nodes: int,
    root: Path,
    persistent: str,
    out: Path,
    worker_args: list[str],
    procs_per_node: int = 1,
    timeout: float = LAUNCHER_TIMEOUT,
) -> list[Launched]:
    """Start one launcher per node at once; wait for each (killing any still alive at the
    deadline); return how each ended, by node."""
    port = free_port()
    env = {
        **os.environ,
        "TIERCHECK_RANKS_PER_NODE": str(procs_per_node),
        "OMP_NUM_THREADS": "1",
    }
    started = time.monotonic()
    procs = []
    for node in range(nodes):
        command = [
            sys.executable, "-m", "torch.distributed.run",
            f"--nnodes={nodes}", f"--node-rank={node}", f"--nproc-per-node={procs_per_node}",
            "--rdzv-backend=static", "--master-addr=127.0.0.1", f"--master-port={port}",
            "--max-restarts=0", "--monitor-interval=0.1",
            str(WORKER),
            "--root", str(root), "--persistent", persistent, "--out", str(out),
            *worker_args,
        ]  # fmt: skip
        procs.append(
            subprocess.Popen(
                command,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,  # a hung launcher is killed with its workers
            )
        )
    results = []
    for node, proc in enumerate(procs):
        left = max(1.0, timeout - (time.monotonic() - started))
        try:
            _, stderr = proc.communicate(timeout=left)
            code: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            _, stderr = proc.communicate()
            code = None
        results.append(Launched(node, code, time.monotonic() - started, stderr))
    return results


def events(out: Path) -> dict[int, list[dict[str, Any]]]:
    """Every rank's events, in order, by rank (a partial last line, from a kill, is skipped)."""
    by_rank: dict[int, list[dict[str, Any]]] = {}
    for path in sorted(out.glob("events-r*.jsonl")):
        rank = int(path.stem.removeprefix("events-r"))
        by_rank[rank] = [
            json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")
        ]
    return by_rank


def first(events: list[dict[str, Any]], name: str) -> dict[str, Any] | None:
    """The first event called ``name``, if any."""
    return next((e for e in events if e["e"] == name), None)
