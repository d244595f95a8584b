"""Running a training script in a subprocess, killing it, and checking what it left behind.

The scripts (``lightning_train.py``, ``hf_train.py``) print ``start <step>`` when training
starts, ``committed <step>`` for each save committed in the local tier, and ``done`` after
writing their final weights (safetensors).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

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
