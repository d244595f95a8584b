"""torchtitan's real trainer (0.3.0, its llama3 debug model, FSDP over 2 ranks under torchrun,
CPU/gloo) checkpointing through
:class:`tiercheck.integrations.torchtitan.TiercheckCheckpointManager`.

torchtitan's dependencies clash with this environment's (``datasets`` wants an older fsspec than
s3fs here), so it runs in a virtual environment of its own, made once (``TIERCHECK_TORCHTITAN_VENV``
names one to use; default ``.venv-torchtitan`` in the repository), with only what the trainer
imports on this path; tiercheck comes from this checkout (``PYTHONPATH``). The harness
(``torchtitan_harness/``) patches what torchtitan 0.3.0 needs to run on a CPU build of torch
2.13 and records each step's loss as its exact float.

The job saves every step (overlapped: the trainer's ``maybe_wait_for_staging()`` is the fence);
rank 0 is SIGKILLed right after the save of a random step returns, torchrun takes the job down,
and the relaunch resumes from the newest whole version in node memory. The losses before the
kill and after the resume equal those of the same job run without any checkpointing, bit for
bit.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
HARNESS = Path(__file__).with_name("torchtitan_harness")
#: What the trainer imports on this path, and no more (torchtitan's declared dependencies pull
#: wandb, pillow, einops...; a bare torch requirement would pull a CUDA build).
WITH_DEPS = ["tyro==1.0.17", "datasets==4.7.0", "tokenizers==0.23.3"]
WITHOUT_DEPS = [
    "torchtitan==0.3.0",
    "spmd_types==0.2.3",
    "torchdata==0.11.0",
    "tensorboard==2.21.0",
    "protobuf==7.36.2",
    "absl-py==2.5.1",
]
#: tiercheck's own requirements (its source comes from this checkout).
TIERCHECK_DEPS = [
    "msgpack>=1.0",
    "lmdb>=3.0",
    "zstandard>=0.22",
    "xxhash>=3.4",
    "aiofiles>=23.2",
    "tqdm",
]
RECIPE = "\n".join([*WITH_DEPS, *WITHOUT_DEPS, *TIERCHECK_DEPS])
STEPS = 6
TIMEOUT = 300


def _pip(venv: Path, *args: str) -> None:
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", *args],
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    if done.returncode:
        pytest.fail(
            f"pip install {' '.join(args)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )


@pytest.fixture(scope="module")
def titan(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The torchtitan environment's python, and the folder of the test's assets."""
    venv = Path(os.environ.get("TIERCHECK_TORCHTITAN_VENV", REPO / ".venv-torchtitan"))
    stamp = venv / "tiercheck-recipe.txt"
    if not (stamp.is_file() and stamp.read_text() == RECIPE):
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        import torch

        constraints = venv / "constraints.txt"
        constraints.write_text(f"torch=={torch.__version__.split('+')[0]}\n")
        # The torch build this environment runs, never one pip would pick for a bare name.
        _pip(venv, f"torch=={torch.__version__.split('+')[0]}")
        _pip(venv, "-c", str(constraints), *WITH_DEPS, *TIERCHECK_DEPS)
        _pip(venv, "-c", str(constraints), "--no-deps", *WITHOUT_DEPS)
        stamp.write_text(RECIPE)
    python = venv / "bin" / "python"
    assets = tmp_path_factory.mktemp("titan-assets")
    subprocess.run([str(python), str(HARNESS / "make_assets.py"), str(assets)], check=True)
    return python, assets


def _launch(
    python: Path, assets: Path, where: Path, config: str, env: dict[str, str]
) -> tuple[int, list[str], str]:
    """One torchrun of the job on 2 ranks: its exit status, what it recorded, its output."""
    record = where / f"record-{uuid.uuid4().hex[:8]}.txt"
    full_env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), str(HARNESS)]),
        "TT_ASSETS": str(assets),
        "TT_DUMP": str(where / f"dump-{uuid.uuid4().hex[:8]}"),
        "TT_RECORD": str(record),
        "OMP_NUM_THREADS": "1",
        **env,
    }
    command = [str(python), "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", str(HARNESS / "launch.py")]
    command += ["--module", "titan_config", "--config", config]
    command += ["--training.steps", str(STEPS), "--lr-scheduler.total-steps", str(STEPS)]
    done = subprocess.run(
        command,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    lines = record.read_text().splitlines() if record.exists() else []
    return done.returncode, lines, done.stdout[-4000:] + done.stderr[-8000:]


def _losses(lines: list[str]) -> dict[int, str]:
    return {int(p[1]): p[2] for p in (line.split() for line in lines) if p[0] == "loss"}


def test_a_killed_torchtitan_job_resumes_bit_exact_from_node_memory(
    titan: tuple[Path, Path], tmp_path: Path
) -> None:
    python, assets = titan
    rc, lines, output = _launch(python, assets, tmp_path, "llama3_cpu", {})
    assert rc == 0, output
    reference = _losses(lines)
    assert sorted(reference) == list(range(1, STEPS + 1)), output

    kill = random.Random().randint(2, STEPS - 1)
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    job = {
        "TT_TIERCHECK": "1",
        "TT_JOB": "titan",
        "TT_PERSISTENT": str(tmp_path / "durable"),
        "TT_LOCAL_ROOT": str(shm / f"tiercheck-test-titan-{uuid.uuid4().hex[:12]}"),
    }
    try:
        rc, first, output = _launch(
            python,
            assets,
            tmp_path,
            "llama3_cpu_tiercheck",
            {**job, "TT_KILL_AFTER_SAVE": str(kill)},
        )
        assert rc != 0, f"rank 0 was to be killed after the save of step {kill}:\n{output}"
        assert first[0] == "fresh", first
        before = _losses(first)
        assert sorted(before) == list(range(1, kill + 1)), (kill, first)
        # Checkpointing every step changes nothing training computes.
        assert before == {s: reference[s] for s in before}, (kill, before, reference)

        rc, second, output = _launch(python, assets, tmp_path, "llama3_cpu_tiercheck", job)
        assert rc == 0, output
        kind, version, tier = second[0].split()
        assert kind == "restored", second
        # The save of the killed step may not have been whole: the newest whole one before it.
        assert 1 <= int(version) <= kill, (kill, second)
        assert tier == "local", f"a crashed process restores from its node's memory: {second}"
        after = _losses(second)
        assert sorted(after) == list(range(int(version) + 1, STEPS + 1)), (kill, second)
        assert after == {s: reference[s] for s in after}, (kill, version, after, reference)
    finally:
        shutil.rmtree(job["TT_LOCAL_ROOT"], ignore_errors=True)


def test_options_it_does_not_cover_are_refused_when_the_manager_is_built(
    titan: tuple[Path, Path],
) -> None:
    python, _ = titan
    script = """
import sys
from tiercheck.errors import ConfigError
from tiercheck.integrations.torchtitan import TiercheckCheckpointManager as M

def build(**fields):
    config = M.Config(**fields)
    try:
        M(config, dataloader=None, model_parts=[], optimizers=None, lr_schedulers=None, states={})
    except ConfigError as exc:
        return str(exc)
    return None

print(build(enable=True, job_id="j", initial_load_path="/abs/seed"))
print(build(enable=True, job_id="j", last_save_in_hf=True, last_save_model_only=True))
print(build(enable=True))
print(build(enable=False, initial_load_path="/abs/seed"))
"""
    done = subprocess.run(
        [str(python), "-c", script],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    seed, hf, no_job, disabled = done.stdout.strip().splitlines()[-4:]
    assert "checkpoint.initial_load_path" in seed
    assert "tiercheck export" in seed
    assert "checkpoint.last_save_in_hf" in hf
    assert "checkpoint.job_id" in no_job
    assert disabled == "None", "a disabled manager checks nothing and builds nothing"
