"""Lightning ``ModelParallelStrategy`` (FSDP2) under torchrun (2 CPU processes, gloo), the whole
job killed and resumed through tiercheck.

``lightning_fsdp2_train.py`` trains a ``fully_shard``-ed MLP, each rank on its own data and its
own dropout stream, saving every 3 steps through ``TiercheckCheckpointIO`` + ``TiercheckCallback``
on every rank, each storing its own shards of the weights and of the optimizer's state. The
final weights of an uninterrupted run are the reference. A run is SIGKILLed as a whole job
(torchrun and both workers) at a random moment, launched again on the same node (its memory
intact, so it resumes from the local tier) and must end with the reference's weights, bit for
bit, on both ranks.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

pytest.importorskip("lightning", reason="the Lightning integration needs the 'lightning' extra")
pytest.importorskip("safetensors", reason="the runs write their weights with safetensors")

from ._runs import Torchrun, assert_bit_equal, torchrun_args, weights

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

SCRIPT = Path(__file__).with_name("lightning_fsdp2_train.py")
STEPS, EVERY = 30, 3  # as in lightning_ddp_train.py (which the FSDP2 script runs)


def test_whole_job_killed_resumes_from_local_tier_bit_exact(tmp_path: Path) -> None:
    ref_args = torchrun_args(tmp_path / "ref", "ref")
    reference = Torchrun(SCRIPT, ref_args, tmp_path / "ref-out", "ref")
    reference.finish()
    assert {r["version"] for r in reference.resumed(0).values()} == {None}  # started fresh
    assert reference.committed("local") == list(range(EVERY, STEPS + 1, EVERY))
    ref_final = {r: weights(tmp_path / f"ref-out/final-r{r}.safetensors") for r in (0, 1)}
    assert_bit_equal(ref_final[0], ref_final[1])

    rng = random.Random(20261123)
    args = torchrun_args(tmp_path / "run", "run", delay=0.1)
    first = Torchrun(SCRIPT, args, tmp_path / "out", "first")
    first.wait_committed(rng.randint(2, 4), attempt=0)
    time.sleep(rng.uniform(0.0, 0.3))
    committed = first.committed("local", 0)
    first.kill_job(attempt=0)

    second = Torchrun(SCRIPT, args, tmp_path / "out", "second")
    second.finish()
    resumed = second.resumed(0)
    assert sorted(resumed) == [0, 1]
    assert {r["source"] for r in resumed.values()} == {"local"}, resumed
    (version,) = {r["version"] for r in resumed.values()}
    assert max(committed) <= version < STEPS, (version, committed)
    assert {r["step"] for r in resumed.values()} == {version}
    for rank in (0, 1):
        final = weights(tmp_path / f"out/final-r{rank}.safetensors")
        assert_bit_equal(final, ref_final[rank])
