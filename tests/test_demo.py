"""``tiercheck demo``: the main job, run as a user runs it, its progress lines and its option
checks."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tiercheck.demo import EventFeed, ProgressLines, main
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


class _Events:
    """Event files as the demo's ranks write them, one JSON object a line."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.t = 0.0

    def __call__(self, writer: int, event: str, raw: bytes = b"", **fields: Any) -> None:
        """Append an event to rank ``writer``'s file (or ``raw`` bytes, as they are)."""
        self.t += 1.0
        line = json.dumps({"e": event, "t": self.t, **fields}).encode() + b"\n"
        with (self.out / f"events-r{writer}.jsonl").open("ab") as f:
            f.write(raw or line)


def test_progress_never_reports_work_a_failure_undid(tmp_path: Path) -> None:
    """A node lost at step 30: rank 0 trained step 30 but it never committed; the lines say
    so in order -- the failure, the restore, then the steps after it."""
    write, feed, progress = _Events(tmp_path), EventFeed(tmp_path), ProgressLines(steps=40)
    lines: list[str] = []
    for step in range(20, 31):  # attempt 1: rank 0 trains on, version 30 is never whole
        write(0, "step", rank=0, step=step, attempt=1, loss=1.0, stall=0.001)
        if step < 30:
            write(0, "commit", tier="local", version=step)
        lines += progress.lines(feed.new())
    write(2, "failure", kind="node", attempt=1, node=1)
    for rank in (0, 2):
        sources = {"0": "local", "2": "peer"}
        write(rank, "restored", rank=rank, attempt=2, version=29, sources=sources, seconds=0.1)
    lines += progress.lines(feed.new())
    write(0, "step", rank=0, step=30, attempt=2, loss=0.5, stall=0.002)
    write(0, "commit", tier="local", version=30)
    lines += progress.lines(feed.new())
    assert lines == [
        "    step   21/40  loss 1.000  save blocked 1.0 ms",
        "  ✗ node lost (attempt 2)",
        "  ↺ restored version 29 (tiers: local, peer) in 0.100 s",
        "    step   31/40  loss 0.500  save blocked 2.0 ms",
    ]


def test_the_event_feed_reads_each_whole_line_once(tmp_path: Path) -> None:
    write, feed = _Events(tmp_path), EventFeed(tmp_path)
    write(1, "start", rank=1)
    half = json.dumps({"e": "step", "t": 5.0, "rank": 1, "step": 0}).encode()
    write(1, "", raw=half[:10])  # being written
    assert [e["e"] for e in feed.new()] == ["start"]
    write(1, "", raw=half[10:] + b"\n")
    write(0, "start", rank=0)  # t=4.0: before the step (t=5.0), though written after it
    assert [(e["e"], e["t"]) for e in feed.new()] == [("start", 4.0), ("step", 5.0)]
    assert feed.new() == []


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_demo_fails_restores_and_ends_bit_exact(tmp_path: Path) -> None:
    """A short demo through the real command line: two failures, both restored bit-exact."""
    command = [
        sys.executable, "-m", "tiercheck", "demo",
        "--steps", "12", "--plan", "process@4,node@8", "--dim", "32", "--batch", "4",
        "--workdir", str(tmp_path / "work"), "--keep",
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

    # Progress: each failure is followed by its restore; steps are reported in order.
    lines = run.stdout.splitlines()
    failures = [i for i, line in enumerate(lines) if "✗" in line]
    assert len(failures) == 2
    assert all("↺ restored" in lines[i + 1] for i in failures)
    failing_run = lines[lines.index("run with failures:") :]
    steps = [int(m.group(1)) for line in failing_run if (m := re.match(r"\s+step\s+(\d+)/", line))]
    assert steps == sorted(set(steps))

    # --keep keeps the memory tiers too, as node roots the command line reads.
    memory = Path(re.search(r"memory tiers: (\S+)", run.stdout).group(1))  # type: ignore[union-attr]
    try:
        listed = subprocess.run(
            [sys.executable, "-m", "tiercheck", "ls", str(memory), "--json"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert listed.returncode == 0, listed.stderr
        found = json.loads(listed.stdout)["locations"]
        assert {(loc["tier"], loc["job"]) for loc in found} == {("local", "tiercheck-demo")}
        assert len(found) == 4  # two node roots in each of the two runs
    finally:
        shutil.rmtree(memory, ignore_errors=True)


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and entry.name != str(os.getpid()):
            try:
                if text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                continue  # gone while listing
    return found


@pytest.mark.slow
@pytest.mark.multiprocess
def test_ctrl_c_stops_the_job_and_cleans_up(tmp_path: Path) -> None:
    """SIGINT while the job trains: no traceback, exit 130, no process left, memory removed."""
    work = tmp_path / "work"
    command = [
        sys.executable, "-m", "tiercheck", "demo",
        "--steps", "400", "--dim", "16", "--batch", "2", "--workdir", str(work),
    ]  # fmt: skip
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:  # until the first step is reported: torchrun and ranks are up
        seen.append(line)
        if line.lstrip().startswith("step"):
            break
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=180)
    text = "".join(seen) + out
    assert proc.returncode == 130, text + err
    assert "Traceback" not in text + err
    assert "interrupted" in err
    memory = Path(re.search(r"memory tiers under (\S+),", text).group(1))  # type: ignore[union-attr]
    assert not memory.exists()
    deadline = time.monotonic() + 30
    while _processes_mentioning(str(work)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _processes_mentioning(str(work)) == []


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_closed_output_pipe_stops_the_job_quietly(tmp_path: Path) -> None:
    """``tiercheck demo | head``: once the reader has gone, the job is stopped, its memory
    removed, nothing is printed and the demo exits 141 (as a tool killed by SIGPIPE)."""
    work = tmp_path / "work"
    command = [
        sys.executable, "-m", "tiercheck", "demo",
        "--steps", "400", "--dim", "16", "--batch", "2", "--workdir", str(work),
    ]  # fmt: skip
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as proc:
        assert proc.stdout is not None
        assert proc.stderr is not None
        seen = []
        for line in proc.stdout:  # until the first step is reported: torchrun and ranks are up
            seen.append(line)
            if line.lstrip().startswith("step"):
                break
        proc.stdout.close()
        err = proc.stderr.read()
        proc.wait(timeout=180)
    assert proc.returncode == 141, "".join(seen) + err
    assert err == ""
    memory = Path(re.search(r"memory tiers under (\S+),", "".join(seen)).group(1))  # type: ignore[union-attr]
    assert not memory.exists()
    deadline = time.monotonic() + 30
    while _processes_mentioning(str(work)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _processes_mentioning(str(work)) == []
