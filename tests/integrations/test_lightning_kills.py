"""A real Lightning run, SIGKILLed mid-training and resumed through tiercheck, ends bit-exact.

``lightning_train.py`` trains a tiny model with dropout, AdamW and a per-step LR schedule over
several epochs, saving every 3 steps through ``TiercheckCheckpointIO`` + ``TiercheckCallback``.
The final weights of an uninterrupted run are the reference; a run killed at random moments
(twice: once on its first launch, once after a resume) and resumed with ``io.resume_path()``
must end with the same bytes, and a resume must never start before a step it had reported
committed in the local tier (which outlives a process crash). When the newest version is torn
(its local blob gone, its persistent copy corrupt), the resume starts from the one before and
still ends bit-exact.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("lightning", reason="the Lightning integration needs the 'lightning' extra")
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

SCRIPT = Path(__file__).with_name("lightning_train.py")
STEPS, EVERY = 40, 3  # as in lightning_train.py
DELAY = "0.05"  # seconds per step: the run lasts long enough to be killed mid-way


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
        *extra,
    ]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Final weights of an uninterrupted run."""
    root = tmp_path_factory.mktemp("lightning-reference")
    run = Run(SCRIPT, _args(root, "ref"), root / "ref.log")
    run.finish()
    assert run.starts == [0]
    assert run.committed == list(range(EVERY, STEPS, EVERY))
    return root / "ref.safetensors"


def test_killed_twice_and_resumed_ends_bit_exact(tmp_path: Path, reference: Path) -> None:
    _, start = kill_twice_then_resume(
        SCRIPT,
        lambda *extra: _args(tmp_path, "run", *extra),
        tmp_path,
        seed=20261201,
        delay=DELAY,
        commits=(2, 4),
        linger=0.2,
    )
    assert start < STEPS
    assert start % EVERY == 0
    assert_bit_equal(weights(tmp_path / "run.safetensors"), weights(reference))


def test_torn_newest_version_resumes_from_the_previous(tmp_path: Path, reference: Path) -> None:
    first = Run(SCRIPT, _args(tmp_path, "torn"), tmp_path / "first.log")
    first.finish()
    newest = STEPS - 1  # the last step saved (every 3 steps, 40 steps)
    local = version_blobs(tmp_path / "shm", newest)
    durable = version_blobs(tmp_path / "durable", newest)
    assert local
    assert durable  # base_every=4: the newest save is a base, so persistent holds it too
    for path in local:
        path.unlink()  # torn: the blob never made it
    for path in durable:
        flip_a_byte(path)  # corrupt: caught by its checksum

    again = Run(SCRIPT, _args(tmp_path, "torn", "--resume"), tmp_path / "again.log")
    again.finish()
    assert again.starts == [newest - EVERY]
    assert_bit_equal(weights(tmp_path / "torn.safetensors"), weights(reference))
