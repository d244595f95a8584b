"""A job restarted with another number of ranks is refused, harmlessly (real torchrun).

A 4-rank job (2 simulated nodes: local, peer and persistent tiers) saves; torchrun then starts it
again with 2 ranks, then with 6: every rank of those refuses with ``WorldSizeMismatch`` before
reading anything, nothing stored changes, and the original 4-rank job still restores its newest
version bit for bit.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

WORKER = Path(__file__).with_name("world_worker.py")


def torchrun(ranks: int, root: Path, durable: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "TIERCHECK_RANKS_PER_NODE": "2",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "OMP_NUM_THREADS": "1",
    }
    command = [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone", f"--nproc-per-node={ranks}", "--max-restarts=0",
        "--monitor-interval=0.1",
        str(WORKER), "--root", str(root), "--persistent", durable, *args,
    ]  # fmt: skip
    return subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=300, check=False
    )


def stored(*roots: Path) -> dict[str, bytes]:
    return {
        str(p): p.read_bytes()
        for root in roots
        for p in root.rglob("v*/*")
        if p.is_file() and not p.name.startswith(".")
    }


def test_another_number_of_ranks_is_refused_and_the_job_still_restores(tmp_path: Path) -> None:
    shm = Path("/dev/shm")
    root = shm / f"tiercheck-test-world-{tmp_path.name}" if shm.is_dir() else tmp_path / "mem"
    durable = (tmp_path / "durable").as_uri()
    try:
        first = torchrun(4, root, durable, "--save", "6")
        assert first.returncode == 0, first.stderr[-4000:]
        before = stored(root, tmp_path / "durable")
        assert before
        for ranks in (2, 6):
            other = torchrun(ranks, root, durable, "--restore")
            assert other.returncode != 0
            refusals = [line for line in other.stdout.splitlines() if "refused" in line]
            assert len(refusals) == ranks, other.stdout + other.stderr[-3000:]
            assert all(
                "WorldSizeMismatch" in line and "saved by 4 ranks" in line for line in refusals
            )
            assert stored(root, tmp_path / "durable") == before
        again = torchrun(4, root, durable, "--restore")
        assert again.returncode == 0, again.stderr[-4000:]
        restored = sorted(line for line in again.stdout.splitlines() if "restored" in line)
        assert restored == [f"rank {r} restored 5 from local" for r in range(4)]
    finally:
        shutil.rmtree(root, ignore_errors=True)
