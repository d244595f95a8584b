"""A real Hugging Face Trainer run, SIGKILLed mid-training and resumed through tiercheck, ends
bit-exact.

``hf_train.py`` trains a 2-layer GPT-2 (built from a config, nothing downloaded) with dropout,
AdamW and a warmup/decay schedule over shuffled epochs, saving every 3 steps through
``TiercheckTrainer``. The final weights of an uninterrupted run are the reference; a run killed
at random moments (twice: on its first launch and after a resume) and resumed with
``train(resume_from_checkpoint=True)`` must end with the same bytes, and a resume must never
start before a step it had reported committed in the local tier. When the newest version is
corrupt, the resume starts from the one before and still ends bit-exact.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the Trainer integration needs the 'hf' extra")
pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate (the 'hf' extra)")
pytest.importorskip("safetensors", reason="the runs write their weights with safetensors")

from ._runs import (
    Run,
    assert_bit_equal,
    flip_a_byte,
    kill_twice_then_resume,
    version_blobs,
    weights,
)

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

SCRIPT = Path(__file__).with_name("hf_train.py")
STEPS, SAVE_STEPS = 30, 3  # as in hf_train.py
DELAY = "0.08"  # seconds per step: the run lasts long enough to be killed mid-way


def _args(root: Path, job: str, *extra: str) -> list[str]:
    return [
        "--job",
        job,
        "--local",
        str(root / "shm"),
        "--durable",
        (root / "durable").as_uri(),
        "--out",
        str(root / f"{job}.safetensors"),
        "--workdir",
        str(root / "output"),
        *extra,
    ]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Final weights of an uninterrupted run."""
    root = tmp_path_factory.mktemp("hf-reference")
    run = Run(SCRIPT, _args(root, "ref"), root / "ref.log")
    run.finish()
    assert run.starts == [0]
    assert run.committed == list(range(SAVE_STEPS, STEPS + 1, SAVE_STEPS))
    # Checkpoints live in tiercheck only: Trainer wrote no checkpoint-<step> folder.
    assert not list((root / "output").glob("checkpoint-*"))
    return root / "ref.safetensors"


def test_killed_twice_and_resumed_ends_bit_exact(tmp_path: Path, reference: Path) -> None:
    _, start = kill_twice_then_resume(
        SCRIPT,
        lambda *extra: _args(tmp_path, "run", *extra),
        tmp_path,
        seed=20261202,
        delay=DELAY,
        commits=(2, 3),
        linger=0.3,
    )
    assert start < STEPS
    assert start % SAVE_STEPS == 0
    assert_bit_equal(weights(tmp_path / "run.safetensors"), weights(reference))


def test_corrupt_newest_version_resumes_from_the_previous(tmp_path: Path, reference: Path) -> None:
    first = Run(SCRIPT, _args(tmp_path, "torn"), tmp_path / "first.log")
    first.finish()
    newest = STEPS  # Trainer saves at the last step too
    # A delta (base_every=4): only the local tier holds it.
    assert not version_blobs(tmp_path / "durable", newest)
    blobs = version_blobs(tmp_path / "shm", newest)
    assert blobs
    for path in blobs:
        flip_a_byte(path)

    again = Run(SCRIPT, _args(tmp_path, "torn", "--resume"), tmp_path / "again.log")
    again.finish()
    assert again.starts == [newest - SAVE_STEPS]
    assert_bit_equal(weights(tmp_path / "torn.safetensors"), weights(reference))
