"""Elastic restore under real torchrun (CPU/gloo): an FSDP2 job comes back on another number of
ranks, bit for bit.

A 4-rank job saves and ends; it is restored with 2 ranks from the node's shared memory (with one
old rank's blob there damaged, so the new rank that needs it falls back to the persistent tier)
and with 3 ranks from the persistent tier (memory wiped). A 2-rank job is restored with 4 ranks
from memory. Each time the gathered (unsharded) model and optimizer state equal those the old
job saved, bit for bit; training then goes on on the new ranks, and a plain (not elastic)
restart restores the new world's version.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

WORKER = Path(__file__).with_name("elastic_worker.py")
STEPS = 3  # versions 0, 1, 2


def torchrun(  # noqa: PLR0917 -- the tests call it positionally, the rest by keyword
    root: Path,
    durable: Path,
    out: Path,
    ranks: int,
    phase: str,
    per_node: int | None = None,
    *,
    worker: Path = WORKER,
    extra: Sequence[str] = (),
) -> list[str]:
    """Run ``worker`` on ``ranks`` local processes under torchrun (``extra``: more arguments);
    the lines it printed that start with ``rank``, sorted."""
    env = {
        **os.environ,
        # One node by default: its memory holds every rank's blob.
        "TIERCHECK_RANKS_PER_NODE": str(per_node or ranks),
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "OMP_NUM_THREADS": "1",
    }
    command = [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone", f"--nproc-per-node={ranks}", "--max-restarts=0",
        "--monitor-interval=0.1", str(worker), "--root", str(root),
        "--persistent", durable.as_uri(), "--out", str(out), "--phase", phase,
        "--steps", str(STEPS), *extra,
    ]  # fmt: skip
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    return sorted(line for line in run.stdout.splitlines() if line.startswith("rank "))


def assert_same(a: Any, b: Any, path: str = "state") -> None:
    if isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor), path
        assert a.dtype == b.dtype, path
        assert torch.equal(a, b), path
    elif isinstance(b, dict):
        assert sorted(a) == sorted(b), path
        for key in b:
            assert_same(a[key], b[key], f"{path}[{key!r}]")
    else:
        assert a == b, path


@pytest.fixture
def shm() -> Iterator[Path]:
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    path = base / f"tiercheck-test-elastic-{uuid.uuid4().hex[:12]}"
    path.mkdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def saved_job(shm: Path, tmp_path: Path, ranks: int) -> tuple[Path, Path, Any]:
    root, durable, out = shm / f"saved{ranks}", tmp_path / f"durable{ranks}", tmp_path / "out"
    torchrun(root, durable, out / f"save{ranks}", ranks, "save")
    return root, durable, torch.load(out / f"save{ranks}" / "saved.pt", weights_only=True)


def copy(root: Path, durable: Path, to_root: Path, to_durable: Path) -> tuple[Path, Path]:
    shutil.copytree(root, to_root, symlinks=True)
    shutil.copytree(durable, to_durable, symlinks=True)
    return to_root, to_durable


def test_fsdp2_job_of_4_ranks_restores_on_2_and_3_and_one_of_2_on_4(
    shm: Path, tmp_path: Path
) -> None:
    last = STEPS - 1
    root4, durable4, saved4 = saved_job(shm, tmp_path, 4)
    # 18 rows over 4 ranks hold 5, 5, 5, 3 rows: a real reshard, not a copy.
    assert saved4["model"]["0.weight"].shape == (18, 10)

    # 4 -> 2 from memory. New rank 1 needs old ranks 2 and 3: one of them is damaged there.
    root, durable = copy(root4, durable4, shm / "to2", tmp_path / "to2")
    damaged = next(root.rglob(f"v{last:012d}/r00003.full"))
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x10
    damaged.write_bytes(bytes(data))
    lines = torchrun(root, durable, tmp_path / "out2", 2, "restore")
    assert lines == [
        f"rank 0 again {last + 1} saved_by 2 from local",
        f"rank 0 restored {last} saved_by 4 from local",
        f"rank 1 again {last + 1} saved_by 2 from local",
        f"rank 1 restored {last} saved_by 4 from persistent",
    ]
    assert_same(torch.load(tmp_path / "out2" / "restored.pt", weights_only=True), saved4)
    assert any(p.is_file() for p in root.rglob(f"quarantine/v{last:012d}/r00003.full"))

    # 4 -> 3 from the persistent tier: the node's memory is gone.
    root, durable = copy(root4, durable4, shm / "to3", tmp_path / "to3")
    shutil.rmtree(root)
    lines = torchrun(root, durable, tmp_path / "out3", 3, "restore")
    assert [line for line in lines if " restored " in line] == [
        f"rank {r} restored {last} saved_by 4 from persistent" for r in range(3)
    ]
    assert [line for line in lines if " again " in line] == [
        f"rank {r} again {last + 1} saved_by 3 from local" for r in range(3)
    ]
    assert_same(torch.load(tmp_path / "out3" / "restored.pt", weights_only=True), saved4)

    # 2 -> 4 from memory (two ranks' blobs serve four; old rank 1 has the last 2 of 5 rows).
    root2, durable2, saved2 = saved_job(shm, tmp_path, 2)
    lines = torchrun(root2, durable2, tmp_path / "out4", 4, "restore")
    assert [line for line in lines if " restored " in line] == [
        f"rank {r} restored {last} saved_by 2 from local" for r in range(4)
    ]
    assert_same(torch.load(tmp_path / "out4" / "restored.pt", weights_only=True), saved2)


def test_a_job_that_lost_a_node_restores_on_the_other_from_its_memory(
    shm: Path, tmp_path: Path
) -> None:
    """4 ranks on 2 nodes save (local, peer and persistent tiers: node 0 holds node 1's blobs
    as peer replicas); node 1 is lost and the job starts again on node 0 alone, 2 ranks. They
    reshard the newest version from node 0's memory -- its own blobs and the replicas it held
    -- bit for bit. The original job still restores on 4 ranks afterwards."""
    last = STEPS - 1
    root, durable, out = shm / "nodes", tmp_path / "durable", tmp_path / "out"
    torchrun(root, durable, out / "save", 4, "save", per_node=2)
    saved = torch.load(out / "save" / "saved.pt", weights_only=True)
    assert sorted(p.name for p in root.iterdir()) == ["node0", "node1"]
    held = root / "node0" / "replicas" / "elastic"
    assert sorted(p.name for p in held.iterdir()) == ["r00002", "r00003"]
    original = copy(root, durable, shm / "original", tmp_path / "original")
    shutil.rmtree(root / "node1")  # node 1 is lost
    lines = torchrun(root / "node0", durable, tmp_path / "out2", 2, "restore")
    assert [line for line in lines if " restored " in line] == [
        f"rank {r} restored {last} saved_by 4 from local" for r in range(2)
    ]
    assert_same(torch.load(tmp_path / "out2" / "restored.pt", weights_only=True), saved)
    assert sorted(p.name for p in held.iterdir()) == ["r00002", "r00003"]  # read, not moved
    # The original job, its node 1 lost, still restores on 4 ranks (node 1's from the peer tier).
    shutil.rmtree(original[0] / "node1")
    lines = torchrun(*original, tmp_path / "out3", 4, "restore", per_node=2)
    assert [line for line in lines if " restored " in line] == [
        f"rank {r} restored {last} saved_by 4 from {'local' if r < 2 else 'peer'}" for r in range(4)
    ]
