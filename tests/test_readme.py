"""The README's examples run as written.

Each example marked ``<!-- readme-example: NAME -->`` is run in a fresh interpreter. Only the
places it stores to are changed (the durable URL and the job name), so that test runs do not
share storage with each other or with a user's own runs.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parent.parent / "README.md"


def example(name: str) -> str:
    """The code block that follows the marker ``<!-- readme-example: name -->``."""
    text = README.read_text()
    m = re.search(
        rf"<!-- readme-example: {re.escape(name)} -->\n```python\n(.*?)\n```", text, re.DOTALL
    )
    assert m is not None, f"README has no example {name!r}"
    return m.group(1)


@pytest.mark.multiprocess
def test_the_use_example_runs_and_resumes(tmp_path: Path) -> None:
    code = example("use")
    job = f"readme-{uuid.uuid4().hex[:8]}"
    assert '"file:///tmp/tiercheck-ckpt"' in code
    assert '"run-1"' in code
    code = code.replace('"file:///tmp/tiercheck-ckpt"', repr((tmp_path / "ckpt").as_uri()))
    code = code.replace('"run-1"', repr(job))
    script = tmp_path / "train.py"
    script.write_text(code)
    try:
        outputs = []
        for _ in range(2):
            run = subprocess.run(
                [sys.executable, str(script)],
                capture_output=True,
                text=True,
                timeout=300,
                cwd=tmp_path,
                check=False,
            )
            assert run.returncode == 0, run.stderr[-4000:]
            outputs.append(run.stdout)
    finally:
        shutil.rmtree(Path("/dev/shm/tiercheck") / job, ignore_errors=True)
    assert "starting at step 0" in outputs[0]
    assert "starting at step 200" in outputs[1]  # the second run found the first one's work
    for out in outputs:
        assert "newest durable version: 190" in out  # bases every 10 steps are durable


def _script(tmp_path: Path, name: str, job: str) -> tuple[Path, str]:
    """The example ``name`` written to ``tmp_path``, storing under a fresh job name there."""
    code = example(name)
    assert '"file:///tmp/tiercheck-demo"' in code
    assert f'"{job}"' in code
    fresh = f"readme-{uuid.uuid4().hex[:8]}"
    code = code.replace('"file:///tmp/tiercheck-demo"', repr((tmp_path / "ckpt").as_uri()))
    code = code.replace(f'"{job}"', repr(fresh))
    script = tmp_path / "train.py"
    script.write_text(code)
    return script, fresh


def _run(command: list[str], cwd: Path, **extra_env: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **extra_env}
    run = subprocess.run(
        command, capture_output=True, text=True, timeout=300, cwd=cwd, env=env, check=False
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return run.stdout


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_lightning_ddp_example_resumes_under_either_launcher(tmp_path: Path) -> None:
    pytest.importorskip("lightning", reason="the example needs the 'lightning' extra")
    script, job = _script(tmp_path, "lightning-ddp", "lightning-ddp-demo")
    try:
        # Lightning starts the second process itself, then torchrun starts both.
        first = _run([sys.executable, str(script)], tmp_path)
        second = _run([*TORCHRUN, str(script)], tmp_path)
    finally:
        shutil.rmtree(Path("/dev/shm/tiercheck") / job, ignore_errors=True)
    assert "started from scratch" in first
    assert "started from step 200 (local tier)" in second  # the newest version, max_steps
    assert (tmp_path / "final.pt").is_file()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_hf_example_resumes_under_torchrun(tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="the example needs the 'hf' extra")
    pytest.importorskip("accelerate", reason="the example needs the 'hf' extra")
    script, job = _script(tmp_path, "hf", "gpt2-demo")
    try:
        first = _run([*TORCHRUN, str(script)], tmp_path)
        second = _run([*TORCHRUN, str(script)], tmp_path)
    finally:
        shutil.rmtree(Path("/dev/shm/tiercheck") / job, ignore_errors=True)
    assert "started from scratch" in first
    assert "started from step 60 (local tier)" in second
    assert (tmp_path / "out" / "final" / "model.safetensors").is_file()


# Appended to the FSDP2 example by its test: each rank's local shards of the model and the
# optimizer's state, written where the test reads them (the process group is gone by then;
# taking local shards needs none).
_FSDP2_EPILOGUE = """
import os as _os
from torch.distributed.tensor import DTensor as _DTensor


def _local(value):
    return value.to_local().clone() if isinstance(value, _DTensor) else value


torch.save(
    {
        "model": {k: _local(v) for k, v in model.state_dict().items()},
        "optim": {
            i: {k: _local(v) for k, v in s.items()} for i, s in opt.state_dict()["state"].items()
        },
    },
    _os.path.join(OUT, f"rank{_os.environ['RANK']}-run{_os.environ['RUN']}.pt"),
)
"""


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_fsdp2_example_resumes_every_shard_under_torchrun(tmp_path: Path) -> None:
    code = example("fsdp2")
    job = f"readme-{uuid.uuid4().hex[:8]}"
    assert '"file:///tmp/tiercheck-ckpt"' in code
    assert '"fsdp2-run"' in code
    code = code.replace('"file:///tmp/tiercheck-ckpt"', repr((tmp_path / "ckpt").as_uri()))
    code = code.replace('"fsdp2-run"', repr(job))
    script = tmp_path / "train.py"
    script.write_text(code + f"\nOUT = {str(tmp_path)!r}\n" + _FSDP2_EPILOGUE)
    outputs = []
    try:
        for run in range(2):
            outputs.append(_run([*TORCHRUN, str(script)], tmp_path, RUN=str(run)))
        # Once more on one rank: the example opens with elastic=True, so the 2-rank version
        # comes back resharded onto it.
        one_rank = [*TORCHRUN[:-1], "--nproc-per-node=1"]
        outputs.append(_run([*one_rank, str(script)], tmp_path, RUN="2"))
    finally:
        shutil.rmtree(Path("/dev/shm/tiercheck") / job, ignore_errors=True)
    # Searched, not split into lines: two ranks' prints may interleave in the shared pipe.
    starts = [sorted(re.findall(r"rank (\d) starting at step (\d+)", out)) for out in outputs]
    assert starts[0] == [("0", "0"), ("1", "0")]
    # The second run found the first one's newest version on both ranks: nothing left to train.
    assert starts[1] == [("0", "20"), ("1", "20")]
    assert starts[2] == [("0", "20")]
    for rank in (0, 1):
        saved = torch.load(tmp_path / f"rank{rank}-run0.pt", weights_only=True)
        restored = torch.load(tmp_path / f"rank{rank}-run1.pt", weights_only=True)
        assert saved["model"]["0.weight"].shape == (32, 64)  # half the rows: a shard
        assert sorted(restored["model"]) == sorted(saved["model"])
        for key, value in saved["model"].items():
            assert torch.equal(restored["model"][key], value), (rank, key)
        # The second run's optimizer was fresh (no state) until restore filled it.
        assert sorted(restored["optim"]) == sorted(saved["optim"]) == [0, 1, 2, 3]
        for index, entry in saved["optim"].items():
            assert sorted(restored["optim"][index]) == ["exp_avg", "exp_avg_sq", "step"]
            for key, value in entry.items():
                assert torch.equal(restored["optim"][index][key], value), (rank, index, key)
    # The one rank holds both ranks' shards put together, optimizer state included.
    shards = [torch.load(tmp_path / f"rank{r}-run0.pt", weights_only=True) for r in (0, 1)]
    whole = torch.load(tmp_path / "rank0-run2.pt", weights_only=True)
    for key in shards[0]["model"]:
        joined = torch.cat([shards[0]["model"][key], shards[1]["model"][key]])
        assert torch.equal(whole["model"][key], joined), key
    for index, entry in shards[0]["optim"].items():
        for key, value in entry.items():
            joined = value if key == "step" else torch.cat([value, shards[1]["optim"][index][key]])
            assert torch.equal(whole["optim"][index][key], joined), (index, key)


@pytest.mark.multiprocess
def test_the_overlap_example_runs(tmp_path: Path) -> None:
    code = example("overlap")
    job = f"readme-{uuid.uuid4().hex[:8]}"
    assert '"file:///tmp/tiercheck-ckpt"' in code
    assert '"run-2"' in code
    code = code.replace('"file:///tmp/tiercheck-ckpt"', repr((tmp_path / "ckpt").as_uri()))
    code = code.replace('"run-2"', repr(job))
    script = tmp_path / "train.py"
    script.write_text(code)
    try:
        run = subprocess.run(
            [sys.executable, str(script)],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tmp_path,
            check=False,
        )
    finally:
        shutil.rmtree(Path("/dev/shm/tiercheck") / job, ignore_errors=True)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "newest durable version: 90" in run.stdout
    assert "StateChanged" not in run.stderr  # the fence kept every snapshot whole
