"""Guards at opening: lock files that may be removed, failed openings of several ranks, and the
dead writers' files a node root holds (shown by the CLI, removed at opening or by ``gc``)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import assert_state_equal
from tiercheck import JobDeleted, JobLocked, StorageError, SyncCheckpointer
from tiercheck.cli import EXIT_OK, main
from tiercheck.consistency.identity import NodeIdentity
from tiercheck.guards import RankLock, forget_deleted
from tiercheck.testing import LocalGroup
from tiercheck.tiers import atomic


def _cli(*argv: object) -> tuple[int, Any]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main([*(str(a) for a in argv), "--json"])
    return code, json.loads(out.getvalue())


def test_a_lock_file_removed_by_its_holder_is_not_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process that opened a lock file just before its holder removed it gets the lock on a
    file no longer under the name; it must take a fresh one, or two writers would both hold
    "the" lock."""
    holder = RankLock(tmp_path, 0)
    holder.acquire()
    assert holder.created
    stale = os.open(holder.path, os.O_RDWR)  # opened before the removal...
    holder.release(remove=True)  # ...which takes the file off its name
    assert not holder.path.exists()
    real_open = os.open
    raced: list[str] = []

    def open_raced_first(path: Any, flags: int, *args: Any) -> int:
        if not raced and str(path) == str(holder.path):
            raced.append(str(path))
            return os.dup(stale)  # the open that happened before the removal
        return real_open(path, flags, *args)

    with monkeypatch.context() as mp:
        mp.setattr(os, "open", open_raced_first)
        taker = RankLock(tmp_path, 0)
        taker.acquire()
    os.close(stale)
    assert raced
    assert taker.held
    assert taker.path.exists()
    with pytest.raises(JobLocked):
        RankLock(tmp_path, 0).acquire()  # the file under the name is the one held
    taker.release()
    again = RankLock(tmp_path, 0)
    again.acquire()
    assert not again.created  # released without removal: the file stays
    again.release()


def test_a_failed_opening_of_several_ranks_on_one_node_leaves_nothing(tmp_path: Path) -> None:
    """Two ranks share a node root; the durable location cannot be used, so both fail. Whichever
    fails last finds no other lock held and removes the rest."""
    not_a_folder = tmp_path / "a-file"
    not_a_folder.write_bytes(b"")
    node = tmp_path / "shm" / "j" / "node0"
    group = LocalGroup(2)
    errors: list[BaseException | None] = [None, None]

    def rank(r: int) -> None:
        try:
            SyncCheckpointer(
                "j",
                rank=r,
                world_size=2,
                ranks_per_node=2,
                coordinator=group.coordinator(r),
                tiers=["local", "persistent"],
                local_root=node,
                persistent=not_a_folder.as_uri(),
            ).open()
        except BaseException as exc:
            errors[r] = exc

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
        assert not t.is_alive()
    assert all(isinstance(e, StorageError) for e in errors), errors
    assert not node.exists()


KILLER = r"""
import os, signal, sys
from tiercheck.tiers import atomic

fd, path = atomic.create_temp(sys.argv[1])
os.write(fd, b"x" * 4096)
print(path, flush=True)
if sys.argv[2] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
sys.stdin.read()  # held open until the test says so
"""


def _writer(folder: Path, mode: str) -> tuple[subprocess.Popen[str], Path]:
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLER, str(folder), mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    return proc, Path(proc.stdout.readline().strip())


def _end(proc: subprocess.Popen[str]) -> int:
    """Kill ``proc`` if it still runs, reap it, close its pipes; its exit code."""
    if proc.poll() is None:
        proc.kill()
    code = proc.wait(60)
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            pipe.close()
    return code


@pytest.mark.multiprocess
def test_dead_writers_files_in_a_node_root_are_shown_and_removed(tmp_path: Path) -> None:
    node = tmp_path / "shm" / "job" / "node0"
    state = {"w": torch.arange(1000, dtype=torch.float32)}
    with SyncCheckpointer("job", local_root=node, persistent=(tmp_path / "d").as_uri()) as ckpt:
        ckpt.save(0, state)
        ckpt.wait()
    # Killed while writing a blob, and while writing the node's identity; one still running.
    dead_blob_writer, dead_blob = _writer(node / "blobs" / "v000000000001", "kill")
    assert _end(dead_blob_writer) == -signal.SIGKILL
    dead_top_writer, dead_top = _writer(node, "kill")
    assert _end(dead_top_writer) == -signal.SIGKILL
    live_writer, live = _writer(node / "blobs" / "v000000000001", "hold")
    try:
        code, doc = _cli("ls", node)
        assert code == EXIT_OK
        (loc,) = doc["locations"]
        shown = {Path(i["name"]).name: i for i in loc["leftovers"]}
        assert {n: i["verdict"] for n, i in shown.items()} == {
            dead_blob.name: "dead",
            dead_top.name: "dead",
            live.name: "live",
        }
        assert shown[dead_blob.name]["size"] == 4096
        code, doc = _cli("verify", node)
        assert code == EXIT_OK
        assert {f["code"] for f in doc["reports"][0]["findings"]} >= {"leftover", "leftover-kept"}
        code, doc = _cli("gc", node, "--keep", 5, "--dry-run")
        assert sorted(Path(i["name"]).name for i in doc["leftovers"]) == sorted(
            [dead_blob.name, dead_top.name]
        )
        assert dead_blob.exists()
        # The job's next opening removes the dead writers' files, never the live one's.
        with SyncCheckpointer("job", local_root=node, persistent=(tmp_path / "d").as_uri()) as ckpt:
            assert not dead_top.exists()
            restored = ckpt.restore()
            assert restored is not None
            assert_state_equal(restored.state, state)
        assert not dead_blob.exists()
        assert live.exists()
        code, doc = _cli("gc", node, "--keep", 5)
        assert doc["leftovers_removed"] == []
        assert live.exists()
    finally:
        _end(live_writer)
    code, doc = _cli("gc", node, "--keep", 5)
    assert [Path(i["name"]).name for i in doc["leftovers_removed"]] == [live.name]
    assert atomic.find_temps(str(node)) == []


def test_which_memory_a_deletion_forgets() -> None:
    """The opening's rule (tiercheck.guards.node.forget_deleted), case by case."""
    here = "file:///d/job"

    def ident(token: str, where: str = here, job: str = "job") -> NodeIdentity:
        return NodeIdentity(job, token, 1, where)

    def forgotten(facts: dict[str, Any], **nodes: NodeIdentity | None) -> set[str]:
        identities = dict(enumerate(nodes.values()))
        names = dict(enumerate(nodes))
        gone = forget_deleted(identities, facts, "job", here)
        assert all(identities[i] is None for i in gone)
        return {names[i] for i in gone}

    absent = {"state": "absent"}
    tomb = {"deleted": ["old"], "tombstone": True}
    assert forgotten({"deleted": [], "tombstone": False, "job": absent}, a=ident("old")) == set()
    assert forgotten(
        {**tomb, "job": absent},
        deleted=ident("old"),
        tokenless=ident("unknown"),  # names this location: deleted with it
        elsewhere=ident("other", "file:///e/job"),
        other_job=ident("old", job="other"),
        empty=None,
    ) == {"deleted", "tokenless"}
    # A new incarnation started after the deletion: only the deleted tokens are forgotten.
    new = {"state": "found", "token": "new"}
    assert forgotten({**tomb, "job": new}, deleted=ident("old"), ours=ident("new")) == {"deleted"}
    with pytest.raises(JobDeleted, match="did not finish"):
        forgotten({**tomb, "job": {"state": "found", "token": "old"}}, a=ident("old"))
    with pytest.raises(JobDeleted, match="without a job record"):
        forgotten({**tomb, "job": {"state": "legacy", "world_size": 1}}, a=ident("old"))
