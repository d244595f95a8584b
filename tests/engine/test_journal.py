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
from tiercheck import SyncCheckpointer
from tiercheck.consistency.manifest import Manifest
from tests.engine.test_journal import _ckpt, _state

tiercheck.engine.journal.COMPACT_MIN_RECORDS = 30
when = sys.argv[3]
original = Manifest._install

def dying(self, temp):
    # The compaction's commit is the rename of its new journal over the old one: the process
    # dies just before it (the new file written whole) or just after it.
    if when == "after":
        original(self, temp)
    # One write to its own stream: a print from this thread could land inside the main
    # thread's "committed" line.
    os.write(2, b"dying\n")
    os.kill(os.getpid(), signal.SIGKILL)

Manifest._install = dying
from pathlib import Path
with _ckpt(Path(sys.argv[1])) as ckpt:
    for v in range(200):
        handle = ckpt.save(v, _state(v))
        handle.result("local", timeout=60)
        # One write per line: the kill comes from another thread at any moment, and print
        # (under PYTHONUNBUFFERED, as CI may run) writes "committed", the number and the newline
        # apart, so a line could end after its first word.
        os.write(1, f"committed {v}\n".encode())
"""


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_crash_in_the_middle_of_a_compaction_loses_nothing(tmp_path: Path, when: str) -> None:
    """Killed at the first compaction, just before or just after its rename: the journal is the
    old one or the compacted one, readable, its index the one its log gives, and the job
    restores at least the newest version the dead process saw committed."""
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-c", SAVER, str(tmp_path), str(repo), when],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == -9, proc.stderr
    assert "dying\n" in proc.stderr
    # Only whole lines count: the last one may have been cut by the kill.
    lines = proc.stdout.split("\n")[:-1]
    committed = [int(line.split()[1]) for line in lines if line.startswith("committed ")]
    assert committed
    root = tmp_path / "shm" / "manifest"
    unfinished = [p.name for p in root.iterdir() if p.name.startswith("journal#compacting#")]
    assert bool(unfinished) is (when == "before")  # the new journal, written, not renamed
    with Manifest(root) as m:
        index = m.dump_index()
        m.rebuild_index()
        assert m.dump_index() == index  # readable, and the index agrees with the log
        logged = {r.version for r in m.log()}
        if when == "before":
            # Nothing was ever compacted: the log still tells the first save.
            assert 0 in logged
        # The dead compaction's unfinished journal is gone once a manifest opened again.
        assert not [p.name for p in root.iterdir() if p.name.startswith("journal#compacting#")]
    with _ckpt(tmp_path) as again:
        into = _state(0)
        restored = again.restore(into)
        assert restored is not None
        assert restored.version >= committed[-1]
        assert_state_equal(into, _state(restored.version))
