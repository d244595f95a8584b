"""On SIGTERM, what only memory holds is made durable; then the process ends as it would have.

Real signals throughout. In this process (fast): a handler installed before the checkpointer
opened is called after the flush, one handler serves several checkpointers, and closing puts the
previous handler back; ``preemption=False`` leaves the handler alone; a checkpointer opened off
the main thread says why it cannot install one. In child processes (slow): ``os.kill`` with
SIGTERM, the node's memory wiped afterwards (a cluster loss), and a new checkpointer restores
from the durable tier alone the newest version committed in memory before the signal, bit for
bit -- or, where the flush could not or should not happen, the last base.
"""

from __future__ import annotations

import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import tiercheck
from tests.engine.close.sigterm_child import commits, state_of
from tiercheck.engine.close import sigterm

CHILD = Path(__file__).with_name("sigterm_child.py")


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    shm = Path("/dev/shm")
    folder = (
        shm / f"tiercheck-test-sigterm-{uuid.uuid4().hex[:12]}" if shm.is_dir() else tmp_path / "m"
    )
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


class Recorder:
    """A Python SIGTERM handler: records each call, with the versions that had a ``COMMIT``
    record in ``folder`` at that moment."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, list[int]]] = []
        self.folder: Path | None = None

    def __call__(self, signum: int, frame: Any) -> None:
        self.calls.append((signum, commits(self.folder) if self.folder else []))


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    """A :class:`Recorder` installed before any checkpointer opens; the handler that was there
    is put back afterwards, once the test checked that the wakeup fd is back as it was."""
    handler = Recorder()
    before = signal.signal(signal.SIGTERM, handler)
    wakeup = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(wakeup)
    yield handler
    signal.signal(signal.SIGTERM, before)
    # Every checkpointer is closed: the wakeup fd is what it was (a ``set_wakeup_fd`` answers
    # the one it replaces).
    assert signal.set_wakeup_fd(wakeup) == wakeup


def _ckpt(
    root: Path, durable: Path, job: str = "job", **options: Any
) -> tiercheck.SyncCheckpointer:
    return tiercheck.SyncCheckpointer(
        job,
        local_root=root / job,
        persistent=durable.as_uri(),
        base_every=5,
        rank=0,
        world_size=1,
        **options,
    )


def test_the_handler_before_is_called_after_the_flush_and_put_back_at_close(
    root: Path, tmp_path: Path, recorder: Recorder
) -> None:
    durable = tmp_path / "durable"
    recorder.folder = durable / "a"
    previous = signal.getsignal(signal.SIGTERM)
    a, b = _ckpt(root, durable, "a"), _ckpt(root, durable, "b", persist="all", keep=1)
    with a, b:
        assert sigterm.installed()
        for version in range(8):
            a.save(version, state_of(version))
            b.save(version + 100, state_of(version + 100))
        assert a.wait()["persistent"] == 5
        # Every version goes to b's durable tier (unless its queue was behind).
        b.wait()
        signal.raise_signal(signal.SIGTERM)
        # The handler before ran once, after the flush of both checkpointers.
        assert recorder.calls == [(signal.SIGTERM, [0, 5, 7])]
        assert commits(durable / "b")[-1] == 107
        assert a.versions()["persistent"] == [0, 5, 7]
        assert sigterm.installed()  # until the last one closes
    assert signal.getsignal(signal.SIGTERM) is previous
    # And the flushed version restores from the durable tier alone, bit for bit.
    with _ckpt(tmp_path / "elsewhere", durable, "a", preemption=False) as again:
        restored = again.restore()
        assert restored is not None
        assert restored.version == 7
        assert restored.source_tier == "persistent"
        assert torch.equal(restored.state["w"], state_of(7)["w"])


def test_opting_out_leaves_the_handler_alone(
    root: Path, tmp_path: Path, recorder: Recorder
) -> None:
    previous = signal.getsignal(signal.SIGTERM)
    with _ckpt(root, tmp_path / "durable", preemption=False) as ckpt:
        ckpt.save(0, state_of(0))
        assert signal.getsignal(signal.SIGTERM) is previous
        assert not sigterm.installed()
    assert signal.getsignal(signal.SIGTERM) is previous


def test_off_the_main_thread_no_handler_is_installed_and_it_says_so(
    root: Path, tmp_path: Path, recorder: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    previous = signal.getsignal(signal.SIGTERM)
    ckpt = _ckpt(root, tmp_path / "durable")
    # INFO the first time in a process, DEBUG after.
    with caplog.at_level(logging.DEBUG, logger="tiercheck"):
        opener = threading.Thread(target=ckpt.open)
        opener.start()
        opener.join(60)
    try:
        assert signal.getsignal(signal.SIGTERM) is previous
        assert any("off the main thread" in r.getMessage() for r in caplog.records)
    finally:
        ckpt.close()
    assert signal.getsignal(signal.SIGTERM) is previous


def test_a_handler_another_put_back_over_this_one_is_replaced_at_the_next_opening(
    root: Path, tmp_path: Path, recorder: Recorder
) -> None:
    with _ckpt(root, tmp_path / "durable", "a"):
        assert sigterm.installed()
        # A framework's teardown puts back what it found before it (here: SIG_IGN), dropping
        # tiercheck's handler without calling it.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN  # not tiercheck's to change
    durable = tmp_path / "durable"
    with _ckpt(root, durable, "b") as ckpt:
        assert sigterm.installed()
        for version in range(7):
            ckpt.save(version, state_of(version))
        ckpt.wait()
        signal.raise_signal(signal.SIGTERM)  # flushed, then ignored as before
        assert commits(durable / "b") == [0, 5, 6]
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    assert recorder.calls == []


def test_a_wakeup_fd_set_before_gets_every_signal_and_is_put_back(
    root: Path, tmp_path: Path, recorder: Recorder
) -> None:
    read, write = os.pipe()
    os.set_blocking(write, False)
    before = signal.set_wakeup_fd(write)
    try:
        with _ckpt(root, tmp_path / "durable") as ckpt:
            ckpt.save(0, state_of(0))
            signal.raise_signal(signal.SIGTERM)
            assert recorder.calls == [(signal.SIGTERM, [])]
            # Passed on by tiercheck's thread, as the interpreter would have written it.
            assert select.select([read], [], [], 10)[0]
            assert os.read(read, 16) == bytes([signal.SIGTERM])
        assert signal.set_wakeup_fd(before) == write
    finally:
        signal.set_wakeup_fd(before)
        os.close(read)
        os.close(write)


# --- real processes ------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One child: its ``--mode`` and ``--saves``, how it must end, the version the durable
    tier restores after the wipe (``None``: nothing), and a line its output must hold."""

    mode: str
    saves: int
    status: int
    restores: int | None
    says: str


CASES = {
    "flushes": Case("default", 8, -signal.SIGTERM, 7, "version 7 is now durable in ['persistent']"),
    "opted-out": Case("optout", 8, -signal.SIGTERM, 5, "handler once open: <Handlers.SIG_DFL: 0>"),
    "chains": Case("chain", 8, 7, 7, "previous handler called; COMMIT records [0, 5, 7]"),
    "ignored": Case("ignore", 8, 0, 7, "alive after SIGTERM; COMMIT records [0, 5, 7]"),
    "under-a-framework": Case(
        "framework", 8, 0, 7, "framework handler goes on; COMMIT records [0, 5, 7]"
    ),
    "in-flight-finishes": Case(
        "slow", 8, -signal.SIGTERM, 7, "no version is committed in memory on every rank"
    ),
    "tier-blocks": Case("block", 8, -signal.SIGTERM, 5, "the grace of 2 s ran out"),
    "base-newest": Case("default", 6, -signal.SIGTERM, 5, "'persistent' holds version 5 already"),
    "nothing-saved": Case("default", 0, -signal.SIGTERM, None, "a rank saved nothing in this run"),
}


def _run_until_ready(command: list[str]) -> tuple[subprocess.Popen[bytes], bytes]:
    child = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert child.stdout is not None
    out = b""
    deadline = time.monotonic() + 60
    while b"ready" not in out:
        left = deadline - time.monotonic()
        assert child.poll() is None, out + child.stderr.read()  # type: ignore[union-attr]
        assert left > 0, out
        if select.select([child.stdout], [], [], left)[0]:
            out += os.read(child.stdout.fileno(), 65536)
    return child, out


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_sigterm_to_a_real_process_then_the_cluster_is_lost(
    root: Path, tmp_path: Path, case: Case
) -> None:
    mode, restores = case.mode, case.restores
    durable = tmp_path / "durable"
    command = [sys.executable, str(CHILD), "--root", str(root), "--durable", str(durable)]
    child, out = _run_until_ready([*command, "--saves", str(case.saves), "--mode", mode])
    before = commits(durable / "job")
    signaled = time.monotonic()
    os.kill(child.pid, signal.SIGTERM)
    rest, err = child.communicate(timeout=60)
    took = time.monotonic() - signaled
    text = (out + rest + err).decode(errors="replace")
    assert child.returncode == case.status, text
    assert case.says in text, text
    # Within its grace (and then some), never the scheduler's SIGKILL.
    assert took < (2.0 + sigterm.SLACK + 3.0 if mode == "block" else 10.0), (took, text)
    if mode == "slow":
        assert 7 not in before, before  # still in flight when the signal came
    if mode == "optout":
        assert "handler before opening: <Handlers.SIG_DFL: 0>" in text
        assert "SIGTERM:" not in text
    # The cluster is lost: the node's memory goes; only the durable tier is left.
    shutil.rmtree(root)
    after = commits(durable / "job")
    assert set(before) <= set(after)
    ckpt = tiercheck.SyncCheckpointer(
        "job",
        local_root=root,
        persistent=durable.as_uri(),
        rank=0,
        world_size=1,
        preemption=False,
    )
    with ckpt:
        restored = ckpt.restore()
        if restores is None:
            assert restored is None
            return
        assert restored is not None, text
        assert (restored.version, restored.source_tier) == (restores, "persistent"), text
        expected = state_of(restores)
        assert torch.equal(restored.state["w"], expected["w"])
        assert torch.equal(restored.state["b"], expected["b"])
        assert restored.state["v"] == restores
