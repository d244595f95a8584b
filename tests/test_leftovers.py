"""What killed writers leave in a tier, produced for real: shown, removed once their writer is gone.

A process writing a large base to a ``file://`` persistent tier is SIGKILLed half-way through
the file (a hook in the child writes half the blob, then kills its own process: the moment is
exact, the kill is real). Another process of the same job is held, alive, half-way through its
own write. Then ``tiercheck ls`` and ``verify`` show both temporary files (size, age, whose);
``gc --dry-run`` lists the dead one only; the job's restart removes the dead one at opening and
keeps the live one; ``gc`` removes the live one only once its process is gone; and the job
restores bit-exact throughout. The rule for writers this host cannot judge (another host on a
shared filesystem; S3 uploads) is tested with files and uploads another host would leave.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tiercheck import SyncCheckpointer
from tiercheck.cli import EXIT_OK, EXIT_PROBLEMS, main
from tiercheck.tiers import atomic

from .helpers import assert_state_equal

JOB = "leftovers"
N = 3 << 20  # 12 MiB of float32: a blob large enough that a write takes a while

WORKER = r"""
import os, signal, sys, time
from pathlib import Path

import torch

import tiercheck
from tiercheck.tiers import atomic

durable, local_root, mode, version, n, ready = sys.argv[1:7]
version, n = int(version), int(n)
job_folder = os.path.realpath(os.path.join(durable, sys.argv[7]))
real_write_all = atomic.write_all


def half_then_stop(fd, parts):
    # Only a blob's file in the persistent tier (v<version>/...): write about half of it, then
    # die (or hang) mid-write.
    folder = os.path.dirname(os.readlink(f"/proc/self/fd/{fd}"))
    if os.path.dirname(folder) != job_folder or not os.path.basename(folder).startswith("v"):
        return real_write_all(fd, parts)
    parts = list(parts)
    half = sum(p.nbytes for p in parts) // 2
    for part in parts:
        if half <= 0:
            break
        real_write_all(fd, [part[:half]])
        half -= part.nbytes
    os.fsync(fd)
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    Path(ready).write_text(os.readlink(f"/proc/self/fd/{fd}"))
    while True:
        time.sleep(60)


atomic.write_all = half_then_stop
g = torch.Generator().manual_seed(version)
state = {"w": torch.randn(n, generator=g), "step": version}
with tiercheck.SyncCheckpointer(
    sys.argv[7], local_root=local_root, persistent=Path(durable).as_uri(), persist="all",
    base_every=1,
) as ckpt:
    ckpt.restore()
    ckpt.save(version, state)
    ckpt.wait()
sys.exit(3)  # never reached: the hook kills or holds the process first
"""


def state_of(version: int) -> dict[str, Any]:
    """The state saved as ``version``: a pure function of it (as the worker computes it)."""
    g = torch.Generator().manual_seed(version)
    return {"w": torch.randn(N, generator=g), "step": version}


def _cli(*argv: object) -> tuple[int, Any]:
    """Run the CLI in-process with ``--json``; its exit code and document."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main([*(str(a) for a in argv), "--json"])
    return code, json.loads(out.getvalue())


def _temps(folder: Path) -> set[str]:
    return {p.name for p in folder.rglob("*") if atomic.parse_temp_owner(p.name) is not None}


def _start(tmp_path: Path, local_root: Path, mode: str, version: int) -> subprocess.Popen[bytes]:
    ready = tmp_path / f"ready-{mode}"
    with (tmp_path / f"{mode}.log").open("wb") as log:
        return subprocess.Popen(
            [
                sys.executable,
                "-c",
                WORKER,
                str(tmp_path / "durable"),
                str(local_root),
                mode,
                str(version),
                str(N),
                str(ready),
                JOB,
            ],
            stderr=log,
        )


def _wait_for(path: Path, proc: subprocess.Popen[bytes], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, (path.parent / "hold.log").read_text()
        assert time.monotonic() < deadline, "the worker never reached its write"
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_writer_killed_mid_put_leaves_a_temporary_that_is_shown_then_removed(
    tmp_path: Path,
) -> None:
    durable = tmp_path / "durable"
    job = durable / JOB
    node_a, node_b = tmp_path / "shm-a", tmp_path / "shm-b"
    with SyncCheckpointer(
        JOB, local_root=node_a, persistent=durable.as_uri(), persist="all", base_every=1
    ) as ckpt:
        for v in (0, 1):
            ckpt.save(v, state_of(v))
        ckpt.wait()

    # A second launch of the job, alive, half-way through writing version 2.
    holder = _start(tmp_path, node_b, "hold", 2)
    try:
        _wait_for(tmp_path / "ready-hold", holder)
        live = Path((tmp_path / "ready-hold").read_text()).name
        # The job again, killed half-way through writing version 2. Its opening superseded the
        # holder, and still left the holder's file alone: its process runs.
        killed = _start(tmp_path, node_a, "kill", 2)
        assert killed.wait(timeout=120) == -signal.SIGKILL
        assert live in _temps(job)
        (dead,) = _temps(job) - {live}
        size = next(p for p in job.rglob(dead)).stat().st_size
        assert size > N * 4 // 3  # half of a 12 MiB blob, at least

        code, doc = _cli("ls", job)
        assert code == EXIT_OK
        (loc,) = doc["locations"]
        shown = {Path(item["name"]).name: item for item in loc["leftovers"]}
        assert set(shown) == {dead, live}
        assert shown[dead]["verdict"] == "dead"
        assert shown[dead]["size"] == size
        assert 0 <= shown[dead]["age"] < 600
        assert shown[live]["verdict"] == "live"
        assert f"pid {holder.pid}" in shown[live]["why"]

        code, doc = _cli("verify", job)
        assert code == EXIT_OK  # warnings, not problems: the versions are all there
        codes = {f["code"]: f for f in doc["reports"][0]["findings"]}
        assert dead in codes["leftover"]["message"]
        assert live in codes["leftover-kept"]["message"]

        code, doc = _cli("gc", job, "--keep", 10, "--dry-run")
        assert code == EXIT_OK
        assert [Path(i["name"]).name for i in doc["leftovers"]] == [dead]
        assert [Path(i["name"]).name for i in doc["leftovers_kept"]] == [live]
        assert _temps(job) == {dead, live}  # a dry run removes nothing

        # The job restarts: its opening removes the dead writer's file, not the live one's,
        # and it restores bit-exact.
        with SyncCheckpointer(
            JOB, local_root=node_a, persistent=durable.as_uri(), persist="all", base_every=1
        ) as ckpt:
            assert _temps(job) == {live}
            restored = ckpt.restore()
            assert restored is not None
            assert restored.version >= 1
            assert_state_equal(restored.state, state_of(restored.version))

        code, doc = _cli("gc", job, "--keep", 10)
        assert code == EXIT_OK
        assert doc["leftovers_removed"] == []
        assert _temps(job) == {live}  # its writer still runs
        # A process of this host writing the job right now: rm-job refuses, deleting nothing.
        before = sorted(p.name for p in job.rglob("*"))
        code, doc = _cli("rm-job", job, "--job", JOB, "--yes")
        assert code == EXIT_PROBLEMS
        assert doc["error"]["type"] == "JobLocked"
        assert sorted(p.name for p in job.rglob("*")) == before
    finally:
        holder.kill()
        holder.wait(timeout=60)

    code, doc = _cli("gc", job, "--keep", 10)
    assert code == EXIT_OK
    assert [Path(i["name"]).name for i in doc["leftovers_removed"]] == [live]
    assert _temps(job) == set()
    code, doc = _cli("verify", job)
    assert code == EXIT_OK
    assert not [f for f in doc["reports"][0]["findings"] if f["code"].startswith("leftover")]

    # From durable storage alone, the job still restores its newest durable version bit-exact.
    with SyncCheckpointer(JOB, local_root=tmp_path / "shm-c", persistent=durable.as_uri()) as ckpt:
        restored = ckpt.restore()
        assert restored is not None
        assert restored.version == 1
        assert_state_equal(restored.state, state_of(1))
