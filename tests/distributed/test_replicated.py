"""A torchrun DDP job whose model and optimizer are ``tiercheck.Replicated`` (real gloo).

4 ranks as 2 simulated nodes of 2: each node's first rank stores the model and optimizer in its
node's memory, the other a reference; in the persistent tier only rank 0 stores them, node 1's
first rank referring to rank 0's blob there (measured in each tier's files). Node 0's memory
is then lost: its ranks restore from the peer tier -- the second rank reading the first rank's
replica there -- and node 1's from shared memory; then every node's memory is lost and every
rank restores from the persistent tier; each time every rank bit for bit.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

WORKER = Path(__file__).with_name("replicated_worker.py")


def torchrun(root: Path, durable: str, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "TIERCHECK_RANKS_PER_NODE": "2",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "OMP_NUM_THREADS": "1",
    }
    command = [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone", "--nproc-per-node=4", "--max-restarts=0", "--monitor-interval=0.1",
        str(WORKER), "--root", str(root), "--persistent", durable, "--out", str(out), *args,
    ]  # fmt: skip
    return subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=300, check=False
    )


def sizes(folder: Path, version: str) -> dict[int, int]:
    return {
        int(p.name[1:6]): p.stat().st_size
        for p in folder.rglob(f"{version}/r*")
        if "quarantine" not in p.parts and not p.name.startswith(".")
    }


def test_a_ddp_job_stores_one_copy_per_node_and_restores_after_a_node_loss(
    tmp_path: Path,
) -> None:
    shm = Path("/dev/shm")
    root = shm / f"tiercheck-test-ddp-{tmp_path.name}" if shm.is_dir() else tmp_path / "mem"
    durable = tmp_path / "durable"
    out = tmp_path / "out"
    out.mkdir()
    try:
        first = torchrun(root, durable.as_uri(), out, "--save", "3")
        assert first.returncode == 0, first.stderr[-4000:]
        # The model and AdamW's two moments: 3 x (64*256 + 256 + 256*8 + 8) fp32 values.
        replicated = 3 * 4 * (64 * 256 + 256 + 256 * 8 + 8)
        newest = "v000000000002"
        for node, (first_rank, other) in enumerate([(0, 1), (2, 3)]):
            local = sizes(root / f"node{node}" / "blobs", newest)
            assert local[first_rank] >= replicated > local[other]
        persistent = sizes(durable, newest)
        assert sorted(persistent) == [0, 1, 2, 3]
        # Packed there (zstd): rank 0's copy shrinks a little; the others hold their own
        # numbers and references only.
        assert persistent[0] > replicated // 2
        assert all(persistent[r] < replicated // 8 for r in (1, 2, 3))
        shutil.rmtree(root / "node0")  # node 0 is lost, its memory with it
        again = torchrun(root, durable.as_uri(), out, "--restore")
        assert again.returncode == 0, again.stdout + again.stderr[-4000:]
        restored = sorted(line for line in again.stdout.splitlines() if "restored" in line)
        assert restored == [
            "rank 0 restored 2 from peer",
            "rank 1 restored 2 from peer",
            "rank 2 restored 2 from local",
            "rank 3 restored 2 from local",
        ]
        shutil.rmtree(root)  # every node's memory is lost
        last = torchrun(root, durable.as_uri(), out, "--restore")
        assert last.returncode == 0, last.stdout + last.stderr[-4000:]
        restored = sorted(line for line in last.stdout.splitlines() if "restored" in line)
        assert restored == [f"rank {r} restored 2 from persistent" for r in range(4)]
    finally:
        shutil.rmtree(root, ignore_errors=True)
