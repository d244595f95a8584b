"""A rank stopped for longer than ``peer_timeout`` rejoins: commits resume in every tier.

A real two-rank ``torchrun`` job on loopback (gloo), one simulated node, local + persistent
tiers, ``peer_timeout`` 1.5 s. Between the training step and the save of version
:data:`PAUSE_AT` (a base, so both tiers have a round of it), the test stops rank 1 with SIGSTOP
for :data:`PAUSE_S` seconds and continues it with SIGCONT. Rank 0's rounds of that version time
out meanwhile, and gloo closes their channels' connections for good.

Before the fix no later version committed in any tier until the job ended. Now: both channels
reconnect, the version that straddled the pause fails alone (uncertain on rank 0, which said
yes and could not hear whether rank 1 did), and every later version commits
in every tier it goes to; rank 0 warned that the tiers fell behind (and that they recovered),
``health()`` said so at the next save and says all is well at the end; a fresh job restores the
newest version bit-exact, from memory and from durable storage alone.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.distributed._launch import free_port, memory_root

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

WORKER = Path(__file__).with_name("pause_worker.py")
STEPS, PAUSE_AT, PAUSE_S = 16, 6, 4.0
#: The worker's default: the pause is longer.
PEER_TIMEOUT_S = 1.5
#: The tiers commit again by this many saves after the version that straddled the pause.
RESUME_WITHIN = 2


def _launch(
    out: Path, root: Path, persistent: str, nodes: int, tiers: str, *extra: str
) -> list[subprocess.Popen[str]]:
    """The job: one launcher for one node of two ranks, or one launcher per node of one rank
    each (node 0's agent hosts the store, as on a cluster)."""
    out.mkdir(parents=True, exist_ok=True)
    per_node = 2 // nodes
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    procs = []
    for node in range(nodes):
        command = [
            sys.executable, "-m", "torch.distributed.run",
            f"--nnodes={nodes}", f"--node-rank={node}", f"--nproc-per-node={per_node}",
            "--rdzv-backend=static", "--master-addr=127.0.0.1", f"--master-port={port}",
            "--max-restarts=0", "--monitor-interval=0.1",
            str(WORKER), "--root", str(root), "--persistent", persistent, "--out", str(out),
            "--steps", str(STEPS), "--pause-at", str(PAUSE_AT), "--tiers", tiers, *extra,
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
    return procs


def _events(out: Path, rank: int) -> list[dict[str, Any]]:
    path = out / f"events-r{rank}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _finish(job: list[subprocess.Popen[str]], timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    for proc in job:
        try:
            _, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _kill(job)
            pytest.fail("the job hung")
        assert proc.returncode == 0, f"the job failed ({proc.returncode}):\n{stderr[-6000:]}"


def _kill(job: list[subprocess.Popen[str]]) -> None:
    for proc in job:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


@pytest.mark.parametrize("nodes", [1, 2], ids=["one-node", "two-nodes-with-peer-tier"])
def test_a_rank_stopped_past_peer_timeout_rejoins_and_commits_resume(
    tmp_path: Path, nodes: int
) -> None:
    root = memory_root(tmp_path, "pause")
    persistent = (tmp_path / "durable").as_uri()
    out = tmp_path / "job"
    tiers = ["local", "persistent"] if nodes == 1 else ["local", "peer", "persistent"]
    job = _launch(out, root, persistent, nodes, ",".join(tiers))
    try:
        deadline = time.monotonic() + 120
        while not (ready := [e for e in _events(out, 1) if e["e"] == "ready"]):
            assert all(p.poll() is None for p in job), "the job ended early"
            assert time.monotonic() < deadline, "rank 1 never reached the pause"
            time.sleep(0.02)
        rank1 = ready[0]["pid"]
        os.kill(rank1, signal.SIGSTOP)
        time.sleep(PAUSE_S)
        os.kill(rank1, signal.SIGCONT)
        _finish(job)

        for rank in range(2):
            events = _events(out, rank)
            [end] = [e for e in events if e["e"] == "end"]
            outcomes = {int(v): by_tier for v, by_tier in end["outcomes"].items()}
            local = sorted(v for v, t in outcomes.items() if t["local"] == "committed")
            durable = sorted(v for v, t in outcomes.items() if t.get("persistent") == "committed")
            bases = [v for v in range(STEPS) if v % 2 == 0]
            # Before the pause everything commits; the version that straddled it fails alone
            # (its round timed out on rank 0); every later one commits in every tier it goes to.
            after = range(PAUSE_AT + 1 + RESUME_WITHIN, STEPS)
            assert set(range(PAUSE_AT)) <= set(local), (rank, local)
            assert set(after) <= set(local), (rank, local)
            assert {v for v in bases if v < PAUSE_AT} <= set(durable), (rank, durable)
            assert {v for v in bases if v in after} <= set(durable), (rank, durable)
            # Rank 0 said yes and timed out waiting for rank 1: it cannot tell whether rank 1
            # heard it and committed (it did not: it never voted). Rank 1 says failed where it
            # met rank 0 past the round, uncertain where its vote went into the connection
            # rank 0 had closed. No rank says committed.
            expected = {"uncertain"} if rank == 0 else {"failed", "uncertain"}
            assert outcomes[PAUSE_AT]["local"] in expected, (rank, outcomes[PAUSE_AT])
            # Training never waited on the pause in save: no save took anywhere near the
            # peer_timeout that a save waiting on a dead exchange would.
            took = max(e["took"] for e in events if e["e"] == "saved")
            assert took < PEER_TIMEOUT_S / 2, (rank, took)
            # All is well at the end.
            assert all(not h["behind"] for h in end["health"].values()), json.dumps(
                {"health": end["health"], "outcomes": outcomes}
            )
            assert end["health"]["local"]["newest"] == STEPS - 1
            assert end["health"]["persistent"]["newest"] == max(bases)

        # Rank 0 waited out the pause in its next training step: at the save after it, the
        # version that straddled the pause was older than behind_seconds, uncommitted.
        saved = {e["version"]: e["health"] for e in _events(out, 0) if e["e"] == "saved"}
        assert saved[PAUSE_AT - 1]["local"]["behind"] is False
        assert saved[PAUSE_AT + 1]["local"]["behind"] is True, saved[PAUSE_AT + 1]
        assert saved[PAUSE_AT + 1]["local"]["newest"] == PAUSE_AT - 1
        assert saved[PAUSE_AT + 1]["local"]["last_error"] is not None
        assert saved[STEPS - 1]["local"]["behind"] is False
        log = (out / "log-r0.txt").read_text()
        print(log)
        for tier in tiers:
            assert f"WARNING tiercheck: the {tier!r} tier is behind: " in log, tier
            assert f"WARNING tiercheck: the {tier!r} tier commits again: " in log, tier
            # The local and persistent rounds of the version that straddled the pause meet the
            # stopped rank at once, so their channels break. The peer tier's round comes only
            # after its write to the stopped rank timed out (3 s of the 4 s pause): where the
            # rank is back by then the round meets it and the channel never breaks. Whichever
            # channel broke works again.
            if tier != "peer" or f"exchange on channel {tier!r} failed" in log:
                assert f"WARNING tiercheck: the coordination channel {tier!r} works again" in log

        # A fresh job restores the newest version bit-exact: from memory, and from durable
        # storage alone (bases only go there).
        bases = [v for v in range(STEPS) if v % 2 == 0]
        for only, version, source in (
            (",".join(tiers), STEPS - 1, "local"),
            ("persistent", max(bases), "persistent"),
        ):
            again = tmp_path / f"restore-{only.replace(',', '-')}"
            _finish(_launch(again, root, persistent, nodes, only, "--restore"))
            for rank in range(2):
                [restored] = [e for e in _events(again, rank) if e["e"] == "restored"]
                assert (restored["version"], restored["source"]) == (version, source)
                assert restored["exact"], restored
    finally:
        _kill(job)
        shutil.rmtree(root, ignore_errors=True)
