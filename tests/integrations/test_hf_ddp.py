"""Hugging Face Trainer with DDP under torchrun (2 CPU processes, gloo), killed and resumed
through tiercheck.

``hf_ddp_train.py`` trains a tiny GPT-2 with ``TiercheckTrainer``, accelerate sharding the data
between the ranks, each rank with its own dropout stream, every rank saving every 3 steps. The
final weights of an uninterrupted run are the reference. A run is SIGKILLed at random moments:
first one rank (torchrun restarts the group, which resumes from the local tier), then the whole
job, after which the node's memory is wiped (the relaunch resumes from the persistent tier). It
must end with the reference's weights, bit for bit, on both ranks, the data order replayed by
Trainer. Gradients are reduced one parameter per bucket, so that a DDP wrapper created at a
resume reduces its first step as the uninterrupted run did (see the script's docstring).
Another run is started again on one rank, resharded (elastic restore through the integration).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the Trainer integration needs the 'hf' extra")
pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate (the 'hf' extra)")
pytest.importorskip("safetensors", reason="the runs write their weights with safetensors")

from ._runs import Torchrun, assert_bit_equal, kill_rank_then_job, torchrun_args, weights

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

SCRIPT = Path(__file__).with_name("hf_ddp_train.py")
STEPS, EVERY = 30, 3  # as in hf_ddp_train.py


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The output folder of an uninterrupted run."""
    root = tmp_path_factory.mktemp("hf-ddp-reference")
    run = Torchrun(SCRIPT, torchrun_args(root, "ref"), root / "out", "ref")
    run.finish()
    resumed = run.resumed(0)
    assert sorted(resumed) == [0, 1]
    assert {r["version"] for r in resumed.values()} == {None}  # a fresh job starts fresh
    assert run.committed("local") == list(range(EVERY, STEPS + 1, EVERY))
    assert_bit_equal(
        weights(root / "out/final-r0.safetensors"), weights(root / "out/final-r1.safetensors")
    )
    return root / "out"


def test_one_rank_then_the_job_killed_resumes_bit_exact(tmp_path: Path, reference: Path) -> None:
    kill_rank_then_job(
        SCRIPT,
        torchrun_args(tmp_path, "run", delay=0.1),
        tmp_path / "out",
        tmp_path / "memory",
        seed=20261213,
        linger=0.3,
    )
    for rank in (0, 1):
        final = f"final-r{rank}.safetensors"
        assert_bit_equal(weights(tmp_path / "out" / final), weights(reference / final))


def test_a_two_rank_job_resumes_on_one_rank_and_trains_on(tmp_path: Path) -> None:
    """Elastic restore through the integration: the job trains 15 steps on 2 ranks, then is
    started again on 1 rank with ``elastic=True`` and ``per_rank="wrap"`` (each rank's RNG
    states differ). Its weights and optimizer are the 2-rank run's (DDP keeps them alike on
    both ranks), bit for bit, and it trains to step 30, saving as the new world."""
    args = torchrun_args(tmp_path, "run")
    first = Torchrun(SCRIPT, [*args, "--steps", "15"], tmp_path / "two", "two")
    first.finish()
    assert first.committed("local")[-1] == 15
    two = weights(tmp_path / "two/final-r0.safetensors")
    assert_bit_equal(two, weights(tmp_path / "two/final-r1.safetensors"))
    second = Torchrun(SCRIPT, [*args, "--elastic"], tmp_path / "one", "one", ranks=1)
    second.finish()
    resumed = second.resumed(0)
    assert list(resumed) == [0]
    assert (resumed[0]["version"], resumed[0]["step"], resumed[0]["saved_by"]) == (15, 15, 2)
    assert resumed[0]["source"] == "local"
    assert_bit_equal(weights(tmp_path / "one/resumed-r0.safetensors"), two)
    assert second.committed("local") == list(range(18, STEPS + 1, EVERY))
    final = weights(tmp_path / "one/final-r0.safetensors")
    assert any(not torch.equal(final[k], two[k]) for k in final)  # it trained on
