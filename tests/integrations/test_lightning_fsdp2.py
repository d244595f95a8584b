"""Lightning ``ModelParallelStrategy`` (FSDP2) under torchrun (2 CPU processes, gloo), killed and
resumed through tiercheck.

``lightning_fsdp2_train.py`` trains a ``fully_shard``-ed MLP, each rank on its own data and its
own dropout stream, saving every 3 steps through ``TiercheckCheckpointIO`` + ``TiercheckCallback``
on every rank, each storing its own shards of the weights and of the optimizer's state. The
final weights of an uninterrupted run are the reference. A run is SIGKILLed at random moments:
first one rank (torchrun restarts the group, which resumes from the local tier), then the whole
job (torchrun and both workers), after which the node's memory is wiped (the relaunch resumes
from the persistent tier). It must end with the reference's weights, bit for bit, on both ranks.
Another run is started again on one rank, resharded (elastic restore through the integration).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning", reason="the Lightning integration needs the 'lightning' extra")
pytest.importorskip("safetensors", reason="the runs write their weights with safetensors")

from ._runs import Torchrun, assert_bit_equal, kill_rank_then_job, torchrun_args, weights

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

SCRIPT = Path(__file__).with_name("lightning_fsdp2_train.py")
STEPS, EVERY = 30, 3  # as in lightning_ddp_train.py (which the FSDP2 script runs)


def test_one_rank_then_the_job_killed_resumes_bit_exact(tmp_path: Path) -> None:
    ref_args = torchrun_args(tmp_path / "ref", "ref")
    reference = Torchrun(SCRIPT, ref_args, tmp_path / "ref-out", "ref")
    reference.finish()
    assert {r["version"] for r in reference.resumed(0).values()} == {None}  # started fresh
    assert reference.committed("local") == list(range(EVERY, STEPS + 1, EVERY))
    ref_final = {r: weights(tmp_path / f"ref-out/final-r{r}.safetensors") for r in (0, 1)}
    assert_bit_equal(ref_final[0], ref_final[1])

    kill_rank_then_job(
        SCRIPT,
        torchrun_args(tmp_path / "run", "run", delay=0.1),
        tmp_path / "out",
        tmp_path / "run" / "memory",
        seed=20261123,
        linger=0.3,
    )
    for rank in (0, 1):
        final = weights(tmp_path / f"out/final-r{rank}.safetensors")
        assert_bit_equal(final, ref_final[rank])


def test_a_two_rank_job_resumes_resharded_on_one_rank_and_trains_on(tmp_path: Path) -> None:
    """Elastic restore through the integration: the job trains 15 steps on 2 ranks, then is
    started again on 1 rank with ``elastic=True`` (and ``per_rank="wrap"``: each rank's own
    data position and RNG streams differ). The one rank starts from version 15 with both ranks'
    weight and AdamW shards put together -- its weights are the 2-rank run's, bit for bit --
    and trains to step 30, saving as the new world."""
    args = torchrun_args(tmp_path / "run", "run")
    first = Torchrun(SCRIPT, [*args, "--steps", "15"], tmp_path / "two", "two")
    first.finish()
    assert first.committed("local")[-1] == 15
    two = {r: weights(tmp_path / f"two/final-r{r}.safetensors") for r in (0, 1)}
    assert_bit_equal(two[0], two[1])
    second = Torchrun(SCRIPT, [*args, "--elastic"], tmp_path / "one", "one", ranks=1)
    second.finish()
    resumed = second.resumed(0)
    assert list(resumed) == [0]
    assert (resumed[0]["version"], resumed[0]["step"], resumed[0]["saved_by"]) == (15, 15, 2)
    assert resumed[0]["source"] == "local"  # one node's memory holds both old ranks' blobs
    assert_bit_equal(weights(tmp_path / "one/resumed-r0.safetensors"), two[0])
    assert second.committed("local") == list(range(18, STEPS + 1, EVERY))
    final = weights(tmp_path / "one/final-r0.safetensors")
    assert any(not torch.equal(final[k], two[0][k]) for k in final)  # it trained on
