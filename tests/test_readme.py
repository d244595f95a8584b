"""The README's examples run as written.

Each example marked ``<!-- readme-example: NAME -->`` is run in a fresh interpreter. Only the
places it stores to are changed (the durable URL and the job name), so that test runs do not
share storage with each other or with a user's own runs.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

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
