"""Running a training script in a subprocess, killing it, and checking what it left behind.

The single-process scripts (``lightning_train.py``, ``hf_train.py``) print ``start <step>`` when
training starts, ``committed <step>`` for each save committed in the local tier, and ``done``
after writing their final weights (safetensors); :class:`Run` reads them. The torchrun scripts
(``lightning_ddp_train.py``, ``hf_ddp_train.py``) write events per rank (``_events.py``);
:class:`Torchrun` reads them.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

#: Generous: a run is a few seconds, but CI machines can be slow to import torch.
TIMEOUT = 120.0


class Run:
    """One run of a training script, its output collected line by line as it comes."""

    def __init__(self, script: Path, args: list[str], log: Path) -> None:
        self.log = log
        self.starts: list[int] = []
        self.committed: list[int] = []
        self.done = False
        self._changed = threading.Condition()
        self._stderr = log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, str(script), *args],
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with self.proc.stdout:
            for line in self.proc.stdout:
                if not line.endswith("\n"):
                    break  # killed halfway through printing this line
                kind, _, value = line.strip().partition(" ")
                with self._changed:
                    if kind == "start":
                        self.starts.append(int(value))
                    elif kind == "committed":
                        self.committed.append(int(value))
                    elif kind == "done":
                        self.done = True
                    self._changed.notify_all()

    def wait_committed(self, count: int) -> None:
        """Block until ``count`` saves were committed locally (the run must still be going)."""
        deadline = time.monotonic() + TIMEOUT
        with self._changed:
            while len(self.committed) < count:
                assert not self.done, f"the run finished before {count} commits: {self.committed}"
                left = deadline - time.monotonic()
                assert left > 0, self.failure("no progress")
                assert self.proc.poll() is None, self.failure("exited")
                self._changed.wait(min(left, 0.5))

    def kill(self) -> None:
        """SIGKILL the run; it must not have finished."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(TIMEOUT)
        self._reader.join(TIMEOUT)
        self._stderr.close()
        assert self.proc.returncode == -signal.SIGKILL, self.failure("not killed")
        assert not self.done, "the run finished before it was killed"

    def finish(self) -> None:
        """Wait for the run to end normally."""
        try:
            self.proc.wait(TIMEOUT)
        finally:
            self._reader.join(TIMEOUT)
            self._stderr.close()
        assert self.proc.returncode == 0, self.failure("failed")
        assert self.done, self.failure("no 'done'")

    def failure(self, what: str) -> str:
        tail = self.log.read_text()[-3000:] if self.log.exists() else ""
        return f"{what} (rc={self.proc.returncode}); stderr tail:\n{tail}"


def torchrun_args(root: Path, job: str, delay: float = 0.0) -> list[str]:
    """The training scripts' arguments: job, memory root and durable folder under ``root``."""
    return [
        "--job",
        job,
        "--memory",
        str(root / "memory"),
        "--durable",
        (root / "durable").as_uri(),
        "--delay",
        str(delay),
    ]


def weights(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file."""
    return load_file(str(path))


def assert_bit_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Same names, dtypes, shapes and bytes."""
    assert set(a) == set(b)
    for name, x in a.items():
        y = b[name]
        assert (x.dtype, x.shape) == (y.dtype, y.shape), name
        assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), name


def version_blobs(root: Path, version: int) -> list[Path]:
    """Every stored blob file of ``version`` under ``root`` (a tier's folder), whatever tier."""
    return sorted(p for p in root.rglob(f"v{version:012d}/r*") if p.is_file())


def flip_a_byte(path: Path) -> None:
    """Corrupt a stored file: one bit flipped in its middle."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def kill_twice_then_resume(
    script: Path,
    args: Callable[..., list[str]],
    folder: Path,
    *,
    seed: int,
    delay: str,
    commits: tuple[int, int],
    linger: float,
) -> tuple[int, int]:
    """Run ``script``, SIGKILL it at a random moment, resume and kill it again, then resume it
    to the end; returns (the newest step reported committed before the last kill, the step the
    final run started from).

    ``args(*extra)`` gives the script's arguments; each kill comes after a random number of
    commits in ``commits`` plus up to ``linger`` seconds (anywhere in a step, a save included).
    A resume must never start before a step reported committed by the run before it.
    """
    rng = random.Random(seed)
    newest_committed = -1
    for attempt in range(2):
        extra = ["--delay", delay] + (["--resume"] if attempt else [])
        run = Run(script, args(*extra), folder / f"killed{attempt}.log")
        run.wait_committed(rng.randint(*commits))
        time.sleep(rng.uniform(0.0, linger))
        run.kill()
        if attempt:
            assert run.starts[0] >= newest_committed
        newest_committed = max(run.committed)
    resumed = Run(script, args("--resume"), folder / "resumed.log")
    resumed.finish()
    start = resumed.starts[0]
    assert newest_committed <= start
    return newest_committed, start


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (a zombie counts: it runs no more code)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return stat.rpartition(")")[2].split()[0] == "Z"


class Torchrun:
    """A training script run by torchrun on ``ranks`` local processes (2 by default); its events
    read from the files the ranks write (``_events.py``), its workers killable one by one or all
    at once."""

    def __init__(
        self,
        script: Path,
        args: list[str],
        out: Path,
        launch: str,
        *,
        restarts: int = 0,
        ranks: int = 2,
    ) -> None:
        self.out, self.launch = out, launch
        self.log = out / f"{launch}.log"
        out.mkdir(parents=True, exist_ok=True)
        self._log = self.log.open("w")
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
            # A restarted group must not find the dead group's addresses in torchrun's shared
            # store (pytorch/pytorch#135712).
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        }
        command = [
            sys.executable, "-m", "torch.distributed.run",
            "--standalone", f"--nproc-per-node={ranks}", f"--max-restarts={restarts}",
            "--monitor-interval=0.1",
            str(script), *args, "--out", str(out), "--launch", launch,
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def events(self, kind: str | None = None, attempt: int | None = None) -> list[dict[str, Any]]:
        """This launch's events so far, in each rank's order (ranks one after the other)."""
        found = []
        for path in sorted(self.out.glob("events-r*.jsonl")):
            for line in path.read_text().splitlines():
                if not line.endswith("}"):
                    continue  # a rank killed mid-write leaves a partial last line
                event = json.loads(line)
                if event["launch"] != self.launch:
                    continue
                if (kind is None or event["e"] == kind) and (
                    attempt is None or event["attempt"] == attempt
                ):
                    found.append(event)
        return found

    def committed(self, tier: str, attempt: int | None = None) -> list[int]:
        """Versions reported committed in ``tier`` (by rank 0, which reports for every rank)."""
        return [
            e["version"]
            for e in self.events("committed", attempt)
            if e["rank"] == 0 and e["tier"] == tier
        ]

    def wait_committed(self, count: int, attempt: int) -> None:
        """Block until attempt ``attempt`` reported ``count`` local commits (still running)."""
        deadline = time.monotonic() + TIMEOUT
        while len(self.committed("local", attempt)) < count:
            assert not self.events("done"), f"finished before {count} commits"
            assert self.proc.poll() is None, self.failure("torchrun exited")
            assert time.monotonic() < deadline, self.failure("no progress")
            time.sleep(0.05)

    def pids(self, attempt: int) -> dict[int, int]:
        """The worker process of each rank in attempt ``attempt``."""
        return {e["rank"]: e["pid"] for e in self.events("start", attempt)}

    def kill_rank(self, rank: int, attempt: int) -> None:
        """SIGKILL one worker; torchrun sees it fail and restarts the group (if it may)."""
        pid = self.pids(attempt)[rank]
        os.kill(pid, signal.SIGKILL)
        self._wait_gone([pid])

    def kill_job(self, attempt: int) -> None:
        """SIGKILL torchrun and every worker at once, as a lost machine would end them."""
        pids = list(self.pids(attempt).values())
        for pid in [self.proc.pid, *pids]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(TIMEOUT)
        self._log.close()
        self._wait_gone(pids)
        assert not self.events("done", attempt), "the job finished before it was killed"

    def _wait_gone(self, pids: list[int]) -> None:
        deadline = time.monotonic() + TIMEOUT
        while not all(_gone(pid) for pid in pids):
            assert time.monotonic() < deadline, f"processes {pids} outlived SIGKILL"
            time.sleep(0.02)

    def finish(self) -> None:
        """Wait for the job to end well."""
        try:
            self.proc.wait(TIMEOUT * 2)
        finally:
            self._log.close()
        assert self.proc.returncode == 0, self.failure("failed")

    def failure(self, what: str) -> str:
        tail = self.log.read_text()[-4000:] if self.log.exists() else ""
        return f"{what} (rc={self.proc.returncode}); torchrun's output, tail:\n{tail}"

    def resumed(self, attempt: int) -> dict[int, dict[str, Any]]:
        """By rank: where attempt ``attempt`` started training from."""
        return {e["rank"]: e for e in self.events("resumed", attempt)}


def kill_rank_then_job(
    script: Path,
    args: list[str],
    out: Path,
    memory: Path,
    *,
    seed: int,
    linger: float,
) -> Torchrun:
    """Run ``script`` under torchrun; SIGKILL one rank at a random moment (torchrun restarts
    the group, which resumes from the local tier), then the whole job at another; wipe the
    node's memory (``memory``); launch again (it resumes from the persistent tier) and run to
    the end. Returns the last launch, finished.

    Checks on the way: every rank resumes from the same version, from the tier that survived,
    never older than what was reported committed there before the kill.
    """
    rng = random.Random(seed)
    first = Torchrun(script, args, out, "first", restarts=1)
    first.wait_committed(rng.randint(2, 3), attempt=0)
    time.sleep(rng.uniform(0.0, linger))
    committed = first.committed("local", 0)
    first.kill_rank(rng.randrange(2), attempt=0)

    deadline = time.monotonic() + TIMEOUT
    while len(first.resumed(1)) < 2:
        assert first.proc.poll() is None, first.failure("torchrun did not restart the group")
        assert time.monotonic() < deadline, first.failure("the restarted group did not resume")
        time.sleep(0.05)
    resumed = first.resumed(1)
    assert {r["source"] for r in resumed.values()} == {"local"}, resumed
    assert {r["sources"]["0"] for r in resumed.values()} == {"local"}
    (version,) = {r["version"] for r in resumed.values()}
    assert version >= max(committed), (version, committed)
    assert {r["step"] for r in resumed.values()} == {version}

    first.wait_committed(rng.randint(1, 2), attempt=1)
    time.sleep(rng.uniform(0.0, linger))
    durable = first.committed("persistent")
    first.kill_job(attempt=1)
    assert durable, "nothing was durable before the whole job was killed"
    shutil.rmtree(memory)  # the node's memory is gone with it

    second = Torchrun(script, args, out, "second")
    second.finish()
    resumed = second.resumed(0)
    assert sorted(resumed) == [0, 1]
    assert {r["source"] for r in resumed.values()} == {"persistent"}, resumed
    (version,) = {r["version"] for r in resumed.values()}
    assert version >= max(durable), (version, durable)
    assert {r["step"] for r in resumed.values()} == {version}
    return second
