"""The node's manifest as the engine keeps it: compacted after retention, never trusted."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tiercheck.engine.journal
from tests.helpers import assert_state_equal
from tiercheck import SyncCheckpointer
from tiercheck.consistency.manifest import Manifest
from tiercheck.consistency.manifestd import KILL_AT_VARIABLE


def _state(version: int) -> dict[str, object]:
    """The state saved as ``version``: a pure function of it."""
    g = torch.Generator().manual_seed(version)
    return {"w": torch.randn(256, generator=g), "step": version}


def _ckpt(root: Path) -> SyncCheckpointer:
    return SyncCheckpointer(
        "job",
        local_root=root / "shm",
        persistent=(root / "durable").as_uri(),
        keep={"local": 2, "persistent": 2},
        base_every=3,
    )


def test_the_log_is_compacted_after_many_saves_and_the_job_restores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Compact whenever the log has grown at all past 30 records, so that what it holds at the
    # end does not depend on when the last compaction fell (growth is tested on the manifest).
    monkeypatch.setattr(tiercheck.engine.journal, "COMPACT_MIN_RECORDS", 30)
    monkeypatch.setattr(tiercheck.engine.journal, "COMPACT_GROWTH", 1)
    saves = 40
    with _ckpt(tmp_path) as ckpt:
        for v in range(saves):
            ckpt.save(v, _state(v))
        ckpt.wait()
        assert ckpt.stats.manifest_errors == 0
    with Manifest(tmp_path / "shm" / "manifest") as m:
        # Every save logs at least a begin, a durable and a commit in each tier it goes to.
        assert m.log_size() < 3 * saves
        logged = {r.version for r in m.log()}
        held = {b.version for b in m.blobs()}
        assert held <= logged  # what is held stays told
        assert not logged & set(range(10))  # the first versions, long evicted, are forgotten
    with _ckpt(tmp_path) as again:
        into = _state(0)
        restored = again.restore(into)
        assert restored is not None
        assert restored.version == saves - 1
        assert_state_equal(into, _state(saves - 1))


SAVER = r"""
import os, signal, sys
import torch
sys.path.insert(0, sys.argv[2])
import tiercheck.engine.journal
from tests.engine.test_journal import _ckpt, _state

tiercheck.engine.journal.COMPACT_MIN_RECORDS = 30
from pathlib import Path
with _ckpt(Path(sys.argv[1])) as ckpt:
    for v in range(60):
        handle = ckpt.save(v, _state(v))
        handle.result("local", timeout=60)
        # One write per line: print (under PYTHONUNBUFFERED, as CI may run) writes
        # "committed", the number and the newline apart.
        os.write(1, f"committed {v}\n".encode())
    ckpt.wait()  # the manifest's appends run behind the saves: let them land (and fail)
    os.write(1, f"restarts {ckpt.stats.manifest_restarts}\n".encode())
    # The training process itself dies too, mid-job: the next opening finds what it left.
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("kill_at", ["prune", "append:15"])
def test_a_crash_in_the_middle_of_a_compaction_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kill_at: str
) -> None:
    """Every manifest process of a training job is killed inside its first compaction's
    transaction (or inside its 15th record's append): training goes on without an error, each
    time with a new manifest process; afterwards the manifest is readable, its index the one
    its log gives, and the job restores the newest version the dead process saw committed."""
    repo = Path(__file__).resolve().parents[2]
    monkeypatch.setenv(KILL_AT_VARIABLE, kill_at)
    proc = subprocess.run(
        [sys.executable, "-c", SAVER, str(tmp_path), str(repo)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == -9, proc.stderr
    monkeypatch.delenv(KILL_AT_VARIABLE)
    lines = proc.stdout.split("\n")[:-1]
    committed = [int(line.split()[1]) for line in lines if line.startswith("committed ")]
    assert committed == list(range(60))
    restarts = int(lines[-1].removeprefix("restarts "))
    assert restarts >= 2  # the kills happened, more than once, and training went on
    root = tmp_path / "shm" / "manifest"
    with Manifest(root) as m:
        index = m.dump_index()
        m.rebuild_index()
        assert m.dump_index() == index  # readable, and the index agrees with the log
        assert m.log_size() > 0
        assert not m.notes  # a crash inside a transaction is not damage
    with _ckpt(tmp_path) as again:
        into = _state(0)
        restored = again.restore(into)
        assert restored is not None
        assert restored.version == committed[-1]
        assert_state_equal(into, _state(restored.version))
