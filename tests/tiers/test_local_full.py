"""LocalTier on a really full filesystem (small tmpfs mounts): TierFull, never SIGBUS.

A shared-memory file that the filesystem cannot back kills whoever writes into its mapping
with SIGBUS. The scenarios (``local_full_scenarios.py``) therefore run in a child process, all
in one (importing torch costs seconds), each on its own freshly mounted tmpfs; a regression
fails the tests below with the signal and the output instead of killing pytest.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import mount_tmpfs, unmount
from tests.tiers import local_full_scenarios as scenarios

# One child process that imports torch: seconds, not milliseconds.
pytestmark = pytest.mark.slow

SCRIPT = Path(scenarios.__file__)


@pytest.fixture(scope="module")
def full_fs_run(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[subprocess.CompletedProcess[str]]:
    """Every scenario, each on its own new tmpfs, run in one child process."""
    mounted: list[Path] = []
    try:
        args = []
        for name in scenarios.SCENARIOS:
            where = tmp_path_factory.mktemp(f"tmpfs-{name}")
            mount_tmpfs(where, scenarios.FS_SIZE)
            mounted.append(where)
            args.append(f"{name}={where}")
        yield subprocess.run(
            [sys.executable, str(SCRIPT), *args],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
    finally:
        for where in mounted:
            unmount(where)


def _explain(done: subprocess.CompletedProcess[str], name: str) -> str:
    if done.returncode < 0:
        how = f"the child died of {signal.Signals(-done.returncode).name}"
    else:
        how = f"the child exited with {done.returncode}"
    out = done.stdout
    start = out.find(f"START {name}")
    shown = out[start:] if start >= 0 else out
    return f"scenario {name!r} did not pass; {how}.\nstdout:\n{shown}\nstderr:\n{done.stderr}"


@pytest.mark.parametrize("name", list(scenarios.SCENARIOS))
def test_full_filesystem(name: str, full_fs_run: subprocess.CompletedProcess[str]) -> None:
    """Each scenario (see its docstring in local_full_scenarios.py) passes, without a signal."""
    lines = full_fs_run.stdout.splitlines()
    assert f"PASS {name}" in lines, _explain(full_fs_run, name)


def test_the_child_exits_cleanly(full_fs_run: subprocess.CompletedProcess[str]) -> None:
    """No signal and no error in the child, also after the scenarios (closing, exiting)."""
    assert full_fs_run.returncode == 0, _explain(full_fs_run, "(exit)")
    assert "Traceback" not in full_fs_run.stderr, full_fs_run.stderr
