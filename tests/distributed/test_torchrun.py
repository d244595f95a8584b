"""Four failures of a real torchrun job, each restored from the tier that survived it.

4 ranks on loopback, as 2 simulated nodes of 2 ranks (each node its own memory root), train the
demo's tiny transformer with gloo all-reduce, checkpointing every step through local + peer +
persistent tiers. On the first attempt the job fails on purpose (tiercheck.demo.worker);
torchrun restarts the group, every rank restores through tiercheck and trains to the end. For
each failure:

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
        "-m", "tiercheck.demo.worker",
        "--root", str(root),
        "--persistent", (tmp / f"durable-{name}").as_uri(),
        "--out", str(out),
        "--plan", "" if fail == "none" else f"{fail}@{FAIL_AT}",
        "--steps", str(STEPS),
        "--base-every", str(BASE_EVERY),
        "--dim", "32", "--batch", "4",
    ]  # fmt: skip
    try:
        run = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=420, check=False
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)  # the simulated nodes' memory
    assert run.returncode == 0, f"torchrun failed ({run.returncode}):\n{run.stderr[-6000:]}"
    return out


def results(out: Path) -> tuple[dict[int, str], dict[int, dict[str, Any]]]:
    """By rank: the final digest (model, optimizer, RNG) and what it restored after restarting."""
    digests: dict[int, str] = {}
    restored: dict[int, dict[str, Any]] = {}
    for path in out.glob("events-r*.jsonl"):
        for line in path.read_text().splitlines():
            if not line.endswith("}"):
                continue  # a rank killed mid-write leaves a partial last line
            event = json.loads(line)
            if event["e"] == "final":
                digests[event["rank"]] = event["digest"]
            elif event["e"] == "restored" and event["attempt"] == 1:
                restored[event["rank"]] = event
    return digests, restored


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    """The final digests of the uninterrupted run, by rank (each rank has its own RNG)."""
    out = torchrun(tmp_path_factory.mktemp("reference"), "reference", "none")
    digests, restored = results(out)
    assert sorted(digests) == list(range(RANKS))
    assert restored == {}
    return digests


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
    failure: str, reference: dict[int, str], tmp_path: Path
) -> None:
    out = torchrun(tmp_path, failure, failure)
    digests, restored = results(out)
    version, tiers = EXPECTED[failure]
    assert sorted(restored) == list(range(RANKS)), "every rank restored after the restart"
    assert {r["version"] for r in restored.values()} == {version}
    assert {rank: r["source"] for rank, r in restored.items()} == tiers
    for r in restored.values():  # each rank was told where every rank read from
        assert {int(k): v for k, v in r["sources"].items()} == tiers
    assert digests == reference, "the resumed run ends bit-exact with the uninterrupted one"
