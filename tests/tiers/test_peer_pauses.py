"""A seeded hunt: two real ranks store replicas with each other while one of them is paused
(SIGSTOP, then SIGCONT) at random moments, for random lengths up to three times the tier's
timeout -- in the middle of a request, of a transfer, of making a pair's group. The oracle:
after every pause, each rank stores a replica again before the next pause.

A hunt, not a replay: where a pause lands depends on timing. Before bounded pair groups
(``tiercheck/tiers/peer/link.py`` ``_transfer_group``), a pause caught while the two sides
made a pair's group left both ranks failing every put for ten seconds and more (in the chaos
soak, for the rest of the run: seed 4101); schedules like this one caught that in about one run
of five (``tests/tiers/test_peer_pair.py`` produces the case itself, every time).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.distributed._launch import free_port

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

WORKER = Path(__file__).with_name("peer_pause_worker.py")
TIMEOUT_S = 1.0


def test_puts_work_again_after_every_pause_of_a_rank(tmp_path: Path) -> None:
    seed = 2  # the schedule that caught the bug; any other seed must pass as well
    rng = random.Random(seed)
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    logs = [(tmp_path / f"stderr{rank}.txt").open("w") for rank in (0, 1)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(rank), str(port), str(tmp_path), str(TIMEOUT_S)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=logs[rank],
        )
        for rank in (0, 1)
    ]
    pauses: list[tuple[int, float, float]] = []
    try:
        time.sleep(4)  # both ranks up and storing
        end = time.time() + 35
        while time.time() < end:
            time.sleep(rng.uniform(2 * TIMEOUT_S, 6 * TIMEOUT_S))
            who = rng.randrange(2)
            length = rng.uniform(0.3, 3.0) * TIMEOUT_S
            began = time.time()
            procs[who].send_signal(signal.SIGSTOP)
            time.sleep(length)
            procs[who].send_signal(signal.SIGCONT)
            pauses.append((who, began, time.time()))
        time.sleep(8 * TIMEOUT_S)
    finally:
        (tmp_path / "stop").touch()
        for p in procs:
            p.send_signal(signal.SIGCONT)
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    errors = [(tmp_path / f"stderr{r}.txt").read_text()[-3000:] for r in (0, 1)]
    assert [p.returncode for p in procs] == [0, 0], errors
    puts = {
        r: [json.loads(line) for line in (tmp_path / f"r{r}.jsonl").read_text().splitlines()]
        for r in (0, 1)
    }
    stuck = []
    for k, (who, began, ended) in enumerate(pauses):
        upto = pauses[k + 1][1] if k + 1 < len(pauses) else float("inf")
        for r in (0, 1):
            if not any(p["ok"] and ended < p["t"] and p["e"] < upto for p in puts[r]):
                last = [p["err"] for p in puts[r] if p["t"] > ended][:3]
                stuck.append(f"pause {k} (rank {who}, {ended - began:.1f} s): rank {r}: {last}")
    assert len(pauses) >= 6
    assert not stuck, "\n".join(stuck)
