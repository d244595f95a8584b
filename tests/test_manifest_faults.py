"""The node's manifest damaged or killed under a real job: history is lost, never a checkpoint.

The manifest is one LMDB environment per node, mapped by the node's manifest process only
(:mod:`tiercheck.consistency.manifestd`); the ranks are its clients. These tests put a real
:class:`~tiercheck.SyncCheckpointer` (local and persistent tiers) through what can happen to it:

* every damage at rest (``data.mdb`` cut to nothing, to half, by one page, garbled whole, its
  meta pages garbled, a leaf page garbled; ``lock.mdb`` garbled), then a restart of the job: it
  lives, restores the newest version bit-exact from the local tier, the damaged environment is
  set aside (``manifest.damaged-*``, counted once in ``stats.manifest_set_aside``) and the new
  manifest learns the restored version as committed (the restore's adoption);
* ``data.mdb`` cut short while a job trains, several times, and the manifest process
  ``SIGKILL``\\ ed while a job trains, several times: training is never killed, every save
  commits, the manifest records commits again afterwards (``stats.manifest_restarts``), and the
  job restores bit-exact.

Jobs that meet damage run in child processes: should anything in them map a file that was cut
short, its ``SIGBUS`` is a negative return code here, not a dead test run. The manifest's own
damage cases, handle by handle, are in ``tests/consistency/test_manifest.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.consistency.test_manifest import DAMAGE, damage, damaged_folders
from tests.helpers import assert_state_equal
from tiercheck import SyncCheckpointer
from tiercheck.consistency.manifest import Commit, Manifest
from tiercheck.consistency.manifestd import DATA
from tiercheck.testing.chaos.cluster import kill_manifest, manifest_processes

REPO = Path(__file__).resolve().parents[1]
#: Versions saved before the damage at rest (the newest is restored).
SAVES = 5


def state_of(version: int) -> dict[str, object]:
    """The state saved as ``version``: a pure function of it."""
    g = torch.Generator().manual_seed(version)
    return {
        "w": torch.randn(4096, generator=g),
        "h": torch.randn(64, generator=g).to(torch.bfloat16),
        "step": version,
    }


def job(root: Path) -> SyncCheckpointer:
    """One rank, one node: its local tier under ``root/shm``, its persistent one in
    ``root/durable``."""
    return SyncCheckpointer(
        "job",
        local_root=root / "shm",
        persistent=(root / "durable").as_uri(),
        tiers=["local", "persistent"],
        keep={"local": 2, "persistent": 2},
        base_every=3,
    )


def manifest_of(root: Path) -> Path:
    return root / "shm" / "manifest"


def sockets(pid: int) -> int:
    """How many sockets process ``pid`` holds open (0 once it is gone)."""
    count = 0
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                count += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
    except OSError:
        return 0
    return count


# --- damage at rest ------------------------------------------------------------------------------

RESTART = r"""
import json, sys
from pathlib import Path
import torch
sys.path.insert(0, sys.argv[1])
from tests.test_manifest_faults import job, manifest_of, state_of
from tiercheck.consistency.manifest import Manifest

out = {}
for folder in sys.argv[2:]:
    root = Path(folder)
    with job(root) as ckpt:
        into = state_of(0)
        got = ckpt.restore(into)
        want = state_of(got.version)
        exact = all(torch.equal(into[k], want[k]) for k in ("w", "h"))
        stats = ckpt.stats
    with Manifest(manifest_of(root)) as m:
        committed = m.committed("local")
    out[folder] = {
        "version": got.version,
        "source": got.source_tier,
        "exact": exact and into["step"] == got.version,
        "set_aside": stats.manifest_set_aside,
        "errors": stats.manifest_errors,
        "committed": committed,
    }
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_manifest_damaged_at_rest_costs_history_never_a_restore(tmp_path: Path) -> None:
    """Each damage of ``tests/consistency/test_manifest.py`` done to a job's manifest at rest;
    the job restarted (all of them in one child process): it restores the newest version from
    the local tier, bit-exact; the damaged environment is set aside, once; and the new manifest
    records the restored version committed in the local tier."""
    rng = random.Random(30)
    roots = []
    for how in DAMAGE:
        root = tmp_path / how
        with job(root) as ckpt:
            for v in range(SAVES):
                ckpt.save(v, state_of(v))
                ckpt.wait()
            assert ckpt.stats.manifest_errors == 0
        folder = manifest_of(root)
        with Manifest(folder) as m:
            assert SAVES - 1 in m.committed("local")  # there was history to lose
        kill_manifest(folder)  # the job is over: nothing maps the environment while it is hit
        damage(folder, how, rng)
        roots.append(root)
    run = subprocess.run(
        [sys.executable, "-c", RESTART, str(REPO), *map(str, roots)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    # A signal (SIGBUS above all) is a negative return code.
    assert run.returncode == 0, f"rc={run.returncode}\n{run.stdout}\n{run.stderr[-4000:]}"
    got = json.loads(run.stdout.splitlines()[-1])
    for how, root in zip(DAMAGE, roots, strict=True):
        outcome = got[str(root)]
        assert outcome["version"] == SAVES - 1, (how, outcome)
        assert outcome["source"] == "local", (how, outcome)
        assert outcome["exact"], how
        assert outcome["set_aside"] == 1, (how, outcome)
        assert outcome["errors"] == 0, (how, outcome)
        # History lost, then learnt again: the restore adopted what the local tier holds whole.
        assert SAVES - 1 in outcome["committed"], (how, outcome)
        aside = damaged_folders(manifest_of(root))
        assert len(aside) == 1, (how, aside)
        assert (aside[0] / "why.txt").read_text().strip(), how


# --- damage while a job trains -------------------------------------------------------------------

TRAIN = r"""
import json, os, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from tests.test_manifest_faults import job, state_of

root, stop = Path(sys.argv[2]), Path(sys.argv[3])
with job(root) as ckpt:
    v = 0
    while True:
        last = stop.exists()  # looked at before the save: the save after it is the last
        handle = ckpt.save(v, state_of(v))
        for tier in handle.tiers:  # local always; persistent for a base
            handle.result(tier, timeout=60)  # raises unless committed
        # One write per line (a reader sees whole lines only).
        os.write(1, f"committed {v}\n".encode())
        if last:
            break
        v += 1
        time.sleep(0.01)
    ckpt.wait()
    stats = ckpt.stats
    os.write(1, (json.dumps({
        "restarts": stats.manifest_restarts,
        "set_aside": stats.manifest_set_aside,
        "errors": stats.manifest_errors,
        "failed": stats.failed,
        "skipped": stats.skipped,
    }) + "\n").encode())
"""


class Trainer:
    """A job in a child process that saves every step until told to stop (``finish``)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.stop = root / "stop"
        self.out = root / "train.out"
        self.err = root / "train.err"
        root.mkdir(parents=True, exist_ok=True)
        with self.out.open("w") as out, self.err.open("w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", TRAIN, str(REPO), str(root), str(self.stop)],
                stdout=out,
                stderr=err,
            )

    def committed(self) -> list[int]:
        lines = self.out.read_text().split("\n")[:-1]  # whole lines only
        return [int(line.split()[1]) for line in lines if line.startswith("committed ")]

    def newest(self) -> int:
        return max(self.committed(), default=-1)

    def until(self, done: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if self.proc.poll() is not None:
                raise AssertionError(f"the job ended while waiting for {what}: {self.story()}")
            if time.monotonic() > deadline:
                self.proc.kill()
                raise AssertionError(f"waited {timeout:.0f} s for {what}: {self.story()}")
            time.sleep(0.005)

    def saves(self, more: int) -> None:
        """Wait until the job committed ``more`` versions past its newest now."""
        target = self.newest() + more
        self.until(lambda: self.newest() >= target, f"version {target} to commit")

    def finish(self) -> dict[str, Any]:
        self.stop.touch()
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        # A signal (SIGBUS above all) is a negative return code: training was killed.
        assert self.proc.returncode == 0, self.story()
        stats: dict[str, Any] = json.loads(self.out.read_text().splitlines()[-1])
        return stats

    def story(self) -> str:
        out, err = self.out.read_text()[-2000:], self.err.read_text()[-4000:]
        return f"rc={self.proc.poll()}\n{out}\n{err}"


def check_after(trainer: Trainer, stats: dict[str, Any], last_fault: int) -> None:
    """What must hold once the job ended: every save committed, the manifest records commits
    again after the last fault, and the job restores its newest version bit-exact."""
    saved = trainer.committed()
    assert saved == list(range(len(saved))), "a save did not commit"
    newest = saved[-1]
    assert newest >= last_fault + 5
    assert not stats["failed"], stats
    assert stats["skipped"] == 0
    assert stats["restarts"] >= 1, stats  # the manifest process was found gone, and replaced
    with Manifest(manifest_of(trainer.root)) as m:
        # keep={"local": 2}: the index holds the two newest, both saved after the last fault.
        assert m.committed("local") == [newest - 1, newest]
        logged = {r.version for r in m.log() if isinstance(r, Commit) and r.tier == "local"}
        assert {newest - 1, newest} <= logged
    with job(trainer.root) as ckpt:
        into = state_of(0)
        restored = ckpt.restore(into)
    assert restored is not None
    assert restored.version == newest
    assert restored.source_tier == "local"
    assert_state_equal(into, state_of(newest))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_data_cut_short_while_a_job_trains_never_kills_it(tmp_path: Path) -> None:
    """``data.mdb`` cut to nothing, to half and to a random size (twice over) while the job
    saves every step: the manifest process dies of it (``SIGBUS``: it is the only process that
    maps the file) or finds the environment corrupt; training never notices."""
    trainer = Trainer(tmp_path / "job")
    folder = manifest_of(trainer.root)
    data = folder / DATA
    rng = random.Random(5)

    def in_use() -> bool:
        """A manifest process maps the environment, and it holds something to cut."""
        return bool(manifest_processes(folder, serving=True)) and data.stat().st_size > 0

    cuts = []  # (size before, after, the newest version committed then)
    for how in ("zero", "half", "random", "zero", "half", "random"):
        trainer.saves(3)
        trainer.until(in_use, "the manifest to be in use")
        size = data.stat().st_size
        new = {"zero": 0, "half": size // 2, "random": rng.randrange(size + 1)}[how]
        os.truncate(data, new)
        cuts.append((size, new, trainer.newest()))
    trainer.saves(5)
    stats = trainer.finish()
    check_after(trainer, stats, cuts[-1][2])
    assert damaged_folders(manifest_of(trainer.root))  # what was cut short was set aside


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_manifest_process_killed_while_a_job_trains_never_kills_it(tmp_path: Path) -> None:
    """The node's manifest process ``SIGKILL``\\ ed three times while the job saves every step:
    each time the job starts another and goes on; a kill is not damage (nothing set aside)."""
    trainer = Trainer(tmp_path / "job")
    folder = manifest_of(trainer.root)
    trainer.saves(3)
    kills: list[tuple[int, int]] = []  # (pid, the newest version committed then)

    def serving() -> int | None:
        """The manifest process serving the job now: a new one since the last kill (not a
        starter about to fork one), with the job connected to it."""
        found = set(manifest_processes(folder, serving=True)) - {p for p, _ in kills}
        return next((p for p in found if sockets(p) >= 2), None)  # listener + the job

    for _ in range(3):
        trainer.until(lambda: serving() is not None, "the job to reach a manifest process")
        trainer.saves(2)  # its appends go to that process
        pid = serving()
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        kills.append((pid, trainer.newest()))
    trainer.saves(5)
    stats = trainer.finish()
    check_after(trainer, stats, kills[-1][1])
    assert stats["restarts"] == len(kills), stats  # each kill noticed once, and replaced
    assert stats["set_aside"] == 0, stats
    assert not damaged_folders(folder)
