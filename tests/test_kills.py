"""Real kills: a saving loop in a subprocess is SIGKILLed at random moments, over and over.

Each time, a fresh process restores, and the test checks that what comes back is a whole,
correct version (the state is a pure function of the version, so it is recomputed here, not
read from anything the code under test wrote) and is no older than the newest version the
dead process had reported committed in the local tier (which outlives a process crash).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tiercheck import SyncCheckpointer

from .helpers import assert_state_equal

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

KILLS = 24

SAVER = r"""
import sys, torch
sys.path.insert(0, sys.argv[3])
from kill_state import state_of
from tiercheck import SyncCheckpointer

ckpt = SyncCheckpointer("killed", local_root=sys.argv[1], persistent=sys.argv[2], base_every=3)
restored = ckpt.restore()
version = 0 if restored is None else restored.version + 1
print("start", version, flush=True)
handles = []
while True:
    state = state_of(version)
    handles.append(ckpt.save(version, state))
    state["w"].fill_(float("nan"))  # training moves on: the checkpoint must not see this
    for h in list(handles):
        if h.committed("local"):
            print("committed", h.version, flush=True)
            handles.remove(h)
    version += 1
"""

STATE = '''
import torch

def state_of(version):
    """The state saved as `version`: a pure function of it."""
    g = torch.Generator().manual_seed(version)
    return {
        "w": torch.randn(1 << 20, generator=g),
        "h": torch.randn(4096, generator=g).to(torch.bfloat16),
        "step": version,
        "opt": {"lr": 0.1 / (version + 1), "betas": (0.9, 0.999)},
    }
'''


def _reader(proc: subprocess.Popen[str], seen: list[int], started: threading.Event) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        if not line.endswith("\n"):
            break  # the process was killed halfway through printing this line
        kind, _, value = line.strip().partition(" ")
        if kind == "start":
            started.set()
        elif kind == "committed":
            seen.append(int(value))


def test_sigkill_at_random_moments_never_loses_a_committed_version(tmp_path: Path) -> None:
    (tmp_path / "kill_state.py").write_text(STATE)
    sys.path.insert(0, str(tmp_path))
    try:
        from kill_state import state_of  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(tmp_path))
    local = tmp_path / "shm"
    durable = (tmp_path / "durable").as_uri()
    rng = random.Random(20261122)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    restored_versions = []
    mid_save_kills = 0
    for _ in range(KILLS):
        seen: list[int] = []
        started = threading.Event()
        with subprocess.Popen(
            [sys.executable, "-c", SAVER, str(local), durable, str(tmp_path)],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        ) as proc:
            reader = threading.Thread(target=_reader, args=(proc, seen, started), daemon=True)
            reader.start()
            assert started.wait(120), "the saver did not start"
            time.sleep(rng.uniform(0.05, 1.2))
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
            reader.join(30)
        assert proc.returncode == -signal.SIGKILL
        newest_committed = max(seen, default=-1)
        # Unfinished work on disk (a reservation being filled, a temporary file, a version
        # newer than any reported committed) means the kill landed in the middle of a save.
        if local.exists() and any(
            "#" in p.name or (p.name.startswith("v") and int(p.name[1:]) > newest_committed)
            for p in (local / "blobs").iterdir()
        ):
            mid_save_kills += 1

        with SyncCheckpointer("killed", local_root=local, persistent=durable, base_every=3) as ckpt:
            restored = ckpt.restore()
        if newest_committed >= 0:
            assert restored is not None, f"version {newest_committed} was committed, none restored"
        if restored is not None:
            assert restored.version >= newest_committed
            assert_state_equal(restored.state, state_of(restored.version))
            restored_versions.append(restored.version)
    assert mid_save_kills >= KILLS // 2, f"only {mid_save_kills} kills landed mid-save"
    assert len(restored_versions) >= KILLS - 2
    assert restored_versions == sorted(restored_versions)  # progress is never undone
    assert restored_versions[-1] > restored_versions[0]
