"""Four failures of a real torchrun job, each restored from the tier that survived it.

4 ranks on loopback, as 2 simulated nodes of 2 ranks (each node its own memory root), train a
small model with gloo all-reduce, checkpointing every step through local + peer + persistent
tiers. On the first attempt the job fails on purpose (see train.py); torchrun restarts the
group, every rank restores through tiercheck and trains to the end. For each failure:

* the final model and optimizer are equal, bit for bit, to those of an uninterrupted run;
* every rank restored the same version, the one expected for that failure;
* each rank read from the tier that matches the failure (local after a process crash, peer for
  the ranks of a lost node, persistent after the whole cluster's memory is gone).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

SCRIPT = Path(__file__).with_name("train.py")
STEPS, FAIL_AT, BASE_EVERY = 20, 12, 5
RANKS, PER_NODE = 4, 2


def torchrun(tmp: Path, name: str, fail: str) -> Path:
    """Run the training job under torchrun (one restart allowed); return its output folder."""
    out = tmp / name
    shm = Path("/dev/shm")
    root = shm / f"tiercheck-test-{tmp.name}-{name}" if shm.is_dir() else tmp / f"mem-{name}"
    env = {
        **os.environ,
        "TIERCHECK_RANKS_PER_NODE": str(PER_NODE),
        # torchrun shares its rendezvous store with the workers by default, and a restarted
        # group can then pick up the dead group's addresses (pytorch/pytorch#135712).
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "OMP_NUM_THREADS": "1",
    }
    command = [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone", f"--nproc-per-node={RANKS}", "--max-restarts=1",
        "--monitor-interval=0.1",
        str(SCRIPT),
        "--root", str(root),
        "--persistent", (tmp / f"durable-{name}").as_uri(),
        "--out", str(out),
        "--fail", fail,
        "--steps", str(STEPS),
        "--fail-at", str(FAIL_AT),
        "--base-every", str(BASE_EVERY),
    ]  # fmt: skip
    try:
        run = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=420, check=False
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)  # the simulated nodes' memory
    assert run.returncode == 0, f"torchrun failed ({run.returncode}):\n{run.stderr[-6000:]}"
    return out


def results(out: Path) -> tuple[set[str], dict[int, dict[str, Any]]]:
    digests = {json.loads(p.read_text())["digest"] for p in out.glob("final-r*.json")}
    restored = {}
    for p in out.glob("restored-r*-a1.json"):
        record = json.loads(p.read_text())
        restored[record["rank"]] = record
    return digests, restored


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The digest of the uninterrupted run (identical on every rank)."""
    out = torchrun(tmp_path_factory.mktemp("reference"), "reference", "none")
    digests, restored = results(out)
    assert len(list(out.glob("final-r*.json"))) == RANKS
    assert len(digests) == 1
    assert restored == {}
    return digests.pop()


EXPECTED = {
    # failure: (restored version, tier by rank)
    "process": (FAIL_AT - 1, {0: "local", 1: "local", 2: "local", 3: "local"}),
    "node": (FAIL_AT - 1, {0: "local", 1: "local", 2: "peer", 3: "peer"}),
    "cluster": (
        (FAIL_AT - 1) // BASE_EVERY * BASE_EVERY,  # the newest base: only bases persist
        {0: "persistent", 1: "persistent", 2: "persistent", 3: "persistent"},
    ),
    "midsave": (FAIL_AT - 1, {0: "local", 1: "local", 2: "local", 3: "local"}),
}


@pytest.mark.parametrize("failure", list(EXPECTED))
def test_failure_is_restored_from_the_right_tier_bit_exact(
    failure: str, reference: str, tmp_path: Path
) -> None:
    out = torchrun(tmp_path, failure, failure)
    digests, restored = results(out)
    version, tiers = EXPECTED[failure]
    assert sorted(restored) == list(range(RANKS)), "every rank restored after the restart"
    assert {r["version"] for r in restored.values()} == {version}
    assert {rank: r["source"] for rank, r in restored.items()} == tiers
    for r in restored.values():  # each rank was told where every rank read from
        assert {int(k): v for k, v in r["sources"].items()} == tiers
    assert digests == {reference}, "the resumed run ends bit-exact with the uninterrupted one"
