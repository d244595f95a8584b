"""``tiercheck demo``: the main job, run as a user runs it, and its option checks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tiercheck.demo import main
from tiercheck.demo.worker import parse_plan


def test_plans_parse_and_bad_ones_are_refused() -> None:
    assert parse_plan("process@3, node@7,") == [("process", 3), ("node", 7)]
    for bad in ("explode@3", "process", "process@x"):
        with pytest.raises(ValueError, match="KIND@STEP"):
            parse_plan(bad)


@pytest.mark.parametrize(
    "argv",
    [
        ["--plan", "explode@3"],
        ["--nodes", "1"],
        ["--ranks", "3", "--nodes", "2"],
        ["--steps", "10", "--plan", "process@12"],
        ["--plan", "node@8,process@4"],
    ],
)
def test_bad_options_exit_2_before_starting_anything(argv: list[str], tmp_path: Path) -> None:
    assert main([*argv, "--workdir", str(tmp_path / "w")]) == 2
    assert not (tmp_path / "w").exists()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_demo_fails_restores_and_ends_bit_exact(tmp_path: Path) -> None:
    """A short demo through the real command line: two failures, both restored bit-exact."""
    command = [
        sys.executable, "-m", "tiercheck", "demo",
        "--steps", "12", "--plan", "process@4,node@8", "--dim", "32", "--batch", "4",
        "--workdir", str(tmp_path / "work"),
    ]  # fmt: skip
    run = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = [
        line.split()
        for line in run.stdout.splitlines()
        if line.strip().startswith(("process", "node"))
    ]
    assert rows[0][:2] == ["process", "crash"]
    assert rows[0][-1] == "yes"
    assert rows[1][:2] == ["node", "lost"]
    assert "peer" in " ".join(rows[1])
    assert rows[1][-1] == "yes"
    assert "vs the uninterrupted run: bit-exact" in run.stdout
