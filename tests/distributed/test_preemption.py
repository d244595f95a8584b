"""SIGTERM to a real two-rank job: what only memory held becomes durable
(tiercheck.engine.close.sigterm).

Two processes in one gloo group on loopback, as two nodes (local, peer and persistent tiers);
only version 0 is a base, so the durable tier holds nothing newer unless the flush puts it
there. Real signals: SIGTERM to both ranks while they train in lockstep and save every step;
both end with SIGTERM's status; the nodes' memory is then wiped (the cluster is lost) and a new
job restores, from the durable tier alone, a version at least as new as the newest either rank
saw committed in memory before the signal, bit for bit. And a rank that never answers (stopped)
makes the other give up within its grace -- though its main thread waits in a collective that
never returns -- so that it still ends, with SIGTERM's status, long before any SIGKILL.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.distributed._launch import free_port, memory_root

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

WORKER = Path(__file__).with_name("preempt_worker.py")


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    folder = memory_root(tmp_path, "preempt")
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def start(
    root: Path, durable: Path, out: Path, mode: str, *args: str
) -> list[subprocess.Popen[str]]:
    """Both ranks of the job, each a process of its own (as two nodes)."""
    out.mkdir(exist_ok=True)
    port = free_port()
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "TIERCHECK_RANKS_PER_NODE": "1",
            "OMP_NUM_THREADS": "1",
        }
        command = [
            sys.executable, str(WORKER), "--root", str(root), "--persistent", durable.as_uri(),
            "--out", str(out), "--mode", mode, *args,
        ]  # fmt: skip
        procs.append(
            subprocess.Popen(
                command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    return procs


def events(out: Path) -> list[dict[str, object]]:
    found = []
    for path in sorted(out.glob("events-r*.jsonl")):
        found += [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
    return found


def wait_for(
    out: Path, procs: list[subprocess.Popen[str]], ready: object
) -> list[dict[str, object]]:
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        seen = events(out)
        if ready(seen):  # type: ignore[operator]
            return seen
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        time.sleep(0.05)
    raise AssertionError(f"the job never got there: {events(out)}")


def ended(procs: list[subprocess.Popen[str]], timeout: float) -> list[tuple[int | None, str]]:
    outcome = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            outcome.append((None, out + err))
            continue
        outcome.append((proc.returncode, out + err))
    return outcome


def restore(root: Path, durable: Path, out: Path) -> list[str]:
    procs = start(root, durable, out / "restore", "restore")
    outcome = ended(procs, 120)
    assert [code for code, _ in outcome] == [0, 0], outcome
    return sorted(line for _, text in outcome for line in text.splitlines() if "restored" in line)


def test_sigterm_while_training_makes_the_newest_version_in_memory_durable(
    root: Path, tmp_path: Path
) -> None:
    durable, out = tmp_path / "durable", tmp_path / "out"
    procs = start(root, durable, out, "train")
    seen = wait_for(out, procs, lambda s: sum(e["e"] == "local" for e in s) >= 12)
    # Committed in memory on every rank (a commit is collective) before the signal.
    newest = max(int(e["v"]) for e in seen if e["e"] == "local")  # type: ignore[call-overload]
    for proc in procs:  # as torchrun's agent does: one rank after the other
        os.kill(proc.pid, signal.SIGTERM)
    outcome = ended(procs, 40)
    assert [code for code, _ in outcome] == [-signal.SIGTERM] * 2, outcome
    assert all("is now durable in ['persistent']" in text for _, text in outcome), outcome
    # The cluster is lost: every node's memory goes.
    shutil.rmtree(root)
    lines = restore(root, durable, out)
    assert len(lines) == 2
    assert len(set(lines)) == 1, lines  # the same version on both ranks
    version = int(lines[0].split()[1])
    assert lines[0] == f"restored {version} from persistent"
    assert version >= newest > 0


def test_a_rank_that_never_answers_makes_the_flush_give_up_within_its_grace(
    root: Path, tmp_path: Path
) -> None:
    durable, out = tmp_path / "durable", tmp_path / "out"
    procs = start(root, durable, out, "stall", "--grace", "3")
    wait_for(out, procs, lambda s: sum(e["e"] == "ready" for e in s) == 2)
    os.kill(procs[1].pid, signal.SIGSTOP)
    time.sleep(0.5)  # rank 0 now waits in an all-reduce that rank 1 never joins
    signaled = time.monotonic()
    os.kill(procs[0].pid, signal.SIGTERM)
    [(code, text)] = ended(procs[:1], 30)
    took = time.monotonic() - signaled
    os.kill(procs[1].pid, signal.SIGKILL)
    ended(procs[1:], 30)
    assert code == -signal.SIGTERM, text
    assert "the grace of 3 s ran out: not every rank answered step 'preempt-begin'" in text, text
    assert 3.0 <= took < 3.0 + 1.0 + 3.0, (took, text)
    # Nothing newer than the base reached the durable tier; it still restores, bit for bit.
    shutil.rmtree(root)
    assert restore(root, durable, out) == ["restored 0 from persistent"] * 2
