"""A deleted job stays deleted; a failed opening leaves nothing behind. Produced for real.

``tiercheck rm-job`` of a persistent location removes the job's memory on this node too (found
by its identity under ``/dev/shm/tiercheck``), and leaves a tombstone so that the memory of
nodes it cannot reach is discarded, never restored, when the job next opens; a run still
writing the deleted job stops writing there (``Superseded``); an ``rm-job`` killed half-way
makes the job refuse to open (``JobDeleted``) until it is run again. Openings that fail (a
durable location that cannot be used, memory of another run) leave no lock files, manifests or
empty folders behind, and what a killed opening leaves is listed and removed by the CLI.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tiercheck import JobDeleted, StaleMemory, StorageError, SyncCheckpointer, TierWriteFailed
from tiercheck.cli import EXIT_OK, EXIT_PROBLEMS, main
from tiercheck.consistency.identity import JOB_KEY, TOMBSTONE_KEY, Tombstone
from tiercheck.defaults import NodeRoot, default_root, memory_base

from .helpers import assert_state_equal


def state_of(version: int) -> dict[str, Any]:
    """The state saved as ``version``: a pure function of it."""
    g = torch.Generator().manual_seed(version)
    return {"w": torch.randn(4096, generator=g), "step": version}


def _cli(*argv: object) -> tuple[int, Any]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main([*(str(a) for a in argv), "--json"])
    return code, json.loads(out.getvalue())


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")} if root.exists() else set()


@pytest.fixture
def job_id() -> Iterator[str]:
    """A job id of its own, whose default memory (/dev/shm/tiercheck/<job>) is removed after."""
    job = f"deleted-{uuid.uuid4().hex[:12]}"
    yield job
    shutil.rmtree(memory_base() / job, ignore_errors=True)


def _save(job: str, durable: Path, versions: range, **kwargs: Any) -> None:
    with SyncCheckpointer(job, persistent=durable.as_uri(), base_every=2, **kwargs) as ckpt:
        restored = ckpt.restore()
        assert restored is None or restored.version < versions.start
        for v in versions:
            ckpt.save(v, state_of(v))
        ckpt.wait()


# --- finding 9: a deleted job stays deleted ---------------------------------------------------


KILLED_MID_PUT = r"""
import os, signal, sys
from tiercheck.tiers import atomic

fd, _ = atomic.create_temp(sys.argv[1], tag="sess")
os.write(fd, b"x" * 4096)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_rm_job_removes_the_memory_on_this_node_and_the_job_starts_afresh(
    tmp_path: Path, job_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    durable = tmp_path / "durable"
    elsewhere = tmp_path / "other-node"  # a node whose memory rm-job cannot find
    _save(job_id, durable, range(4))
    _save(job_id, durable, range(4, 6), local_root=elsewhere)
    here = default_root(job_id, "node0")
    assert NodeRoot(here).looks_like_one()
    # A writer killed mid-put left a temporary file: it goes with the job.
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_MID_PUT, str(durable / job_id / "v000000000005")],
        check=False,
        timeout=120,
    )
    assert killed.returncode == -signal.SIGKILL

    code, doc = _cli("rm-job", durable.as_uri(), "--job", job_id, "--yes")
    assert code == EXIT_OK
    plans = {p["url"]: p for p in doc["locations"]}
    assert plans[str(here.resolve())]["found_as"].startswith("this job's memory on this node")
    assert not here.exists()  # this node's memory went with the job
    assert NodeRoot(elsewhere).looks_like_one()  # that node's could not be reached
    assert _files(durable / job_id) == {TOMBSTONE_KEY}
    code, doc = _cli("ls", durable)
    assert code == EXIT_OK
    (loc,) = doc["locations"]
    assert loc["versions"] == []
    assert loc["tombstone"]["job_id"] == job_id

    # The job again, on the node rm-job could not reach: its memory of the deleted
    # incarnation is discarded (logged), not restored, and the job starts afresh.
    with (
        caplog.at_level(logging.WARNING, logger="tiercheck"),
        SyncCheckpointer(job_id, persistent=durable.as_uri(), local_root=elsewhere) as ckpt,
    ):
        assert ckpt.restore() is None
        ckpt.save(0, state_of(100))
        ckpt.wait()
    assert "`tiercheck rm-job` deleted" in caplog.text
    tombstone = Tombstone.from_bytes((durable / job_id / TOMBSTONE_KEY).read_bytes())
    (deleted,) = tombstone.tokens
    code, doc = _cli("ls", durable / job_id)
    (loc,) = doc["locations"]
    assert loc["job_record"]["token"] != deleted
    # Writer generations go on above the deleted ones: a writer of the deleted incarnation
    # that still ran would see itself superseded, not take the new one over.
    assert tombstone.generation == 1
    assert loc["writers"]["newest"]["generation"] == 2
    assert [v["version"] for v in loc["versions"]] == [0]
    with SyncCheckpointer(job_id, persistent=durable.as_uri(), local_root=tmp_path / "n3") as ckpt:
        restored = ckpt.restore()
        assert restored is not None
        assert restored.version == 0
        assert_state_equal(restored.state, state_of(100))


def test_rm_job_refuses_while_the_job_runs_on_this_node(tmp_path: Path, job_id: str) -> None:
    durable = tmp_path / "durable"
    _save(job_id, durable, range(2))
    with SyncCheckpointer(job_id, persistent=durable.as_uri()):
        before = _files(durable)
        code, doc = _cli("rm-job", durable.as_uri(), "--job", job_id, "--yes")
        assert code == EXIT_PROBLEMS
        assert doc["error"]["type"] == "JobLocked"
        assert "nothing was deleted" in doc["error"]["message"]
        assert _files(durable) == before
        assert NodeRoot(default_root(job_id, "node0")).looks_like_one()
    # Closed: the job still restores bit-exact.
    with SyncCheckpointer(job_id, persistent=durable.as_uri()) as ckpt:
        restored = ckpt.restore()
        assert restored is not None
        assert restored.version == 1
        assert_state_equal(restored.state, state_of(1))


def test_a_run_still_writing_a_deleted_job_stops_writing_there(tmp_path: Path, job_id: str) -> None:
    """A writer rm-job cannot see (its memory is elsewhere, as on another host) keeps training,
    but its durable saves stop, and its memory is not restored afterwards."""
    durable = tmp_path / "durable"
    node = tmp_path / "node"
    with SyncCheckpointer(
        job_id, persistent=durable.as_uri(), local_root=node, persist="all"
    ) as ckpt:
        ckpt.save(0, state_of(0))
        ckpt.wait()
        code, _ = _cli("rm-job", durable.as_uri(), "--job", job_id, "--yes")
        assert code == EXIT_OK
        handle = ckpt.save(1, state_of(1))  # training goes on
        handle.result("local")
        assert handle.committed("local")
        with pytest.raises(TierWriteFailed, match="rm-job"):
            handle.result("persistent")
        assert ckpt.stats.superseded
    assert _files(durable / job_id) == {TOMBSTONE_KEY}
    with SyncCheckpointer(job_id, persistent=durable.as_uri(), local_root=node) as ckpt:
        assert ckpt.restore() is None


RM_JOB_KILLED = r"""
import os, signal, sys
from tiercheck.tiers import persistent
from tiercheck.cli import main

real = persistent.PersistentTier.delete

async def dies_at_the_first_delete(self, key):
    os.kill(os.getpid(), signal.SIGKILL)

persistent.PersistentTier.delete = dies_at_the_first_delete
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.multiprocess
def test_an_rm_job_killed_half_way_makes_the_job_refuse_to_open(
    tmp_path: Path, job_id: str
) -> None:
    durable = tmp_path / "durable"
    node = tmp_path / "node"
    _save(job_id, durable, range(3), local_root=node)
    killed = subprocess.run(
        [sys.executable, "-c", RM_JOB_KILLED, "rm-job", str(durable), "--job", job_id, "--yes"],
        check=False,
        capture_output=True,
        timeout=120,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()[-2000:]
    assert (durable / job_id / TOMBSTONE_KEY).exists()
    assert (durable / job_id / JOB_KEY).exists()  # the deletion stopped before anything went
    kept = _files(node)
    with pytest.raises(JobDeleted, match="did not finish"):
        SyncCheckpointer(job_id, persistent=durable.as_uri(), local_root=node).open()
    assert _files(node) == kept  # refused before anything was changed
    code, doc = _cli("verify", durable / job_id)
    assert code == EXIT_PROBLEMS
    assert "deletion-unfinished" in {f["code"] for f in doc["reports"][0]["findings"]}

    code, _ = _cli("rm-job", durable, "--job", job_id, "--yes")
    assert code == EXIT_OK
    assert _files(durable / job_id) == {TOMBSTONE_KEY}
    with SyncCheckpointer(job_id, persistent=durable.as_uri(), local_root=node) as ckpt:
        assert ckpt.restore() is None  # the node's memory of it was discarded


# --- finding 10: failed openings leave nothing behind ------------------------------------------


def test_openings_that_fail_leave_nothing_they_made(tmp_path: Path) -> None:
    not_a_folder = tmp_path / "a-file"
    not_a_folder.write_bytes(b"")
    fresh = tmp_path / "shm" / "j" / "node0"
    with pytest.raises(StorageError):
        SyncCheckpointer("j", local_root=fresh, persistent=not_a_folder.as_uri()).open()
    assert not fresh.exists()  # no locks/, no manifest/, no identity

    # Refused over memory of another run: that memory stays exactly as it was.
    node = tmp_path / "shm" / "k" / "node0"
    _save("k", tmp_path / "a", range(2), local_root=node)
    (node / "locks" / "r00000.lock").unlink()
    kept = {p: p.read_bytes() for p in node.rglob("*") if p.is_file() and "manifest" not in p.parts}
    with pytest.raises(StaleMemory):
        SyncCheckpointer("k", local_root=node, persistent=(tmp_path / "b").as_uri()).open()
    assert {
        p: p.read_bytes() for p in node.rglob("*") if p.is_file() and "manifest" not in p.parts
    } == kept
    assert not (tmp_path / "b" / "k").exists()  # nor an empty durable job folder
    with SyncCheckpointer("k", local_root=node, persistent=(tmp_path / "a").as_uri()) as ckpt:
        restored = ckpt.restore()
        assert restored is not None
        assert_state_equal(restored.state, state_of(1))


KILLED_OPENING = r"""
import os, signal, sys
from tiercheck import SyncCheckpointer

async def dies(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

import tiercheck.engine.open.claim as claim
claim.probe = dies
SyncCheckpointer("killed", local_root=sys.argv[1], persistent=sys.argv[2]).open()
"""


@pytest.mark.multiprocess
def test_what_a_killed_opening_left_is_listed_and_removed(tmp_path: Path) -> None:
    node = tmp_path / "shm" / "killed" / "node0"
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_OPENING, str(node), (tmp_path / "d").as_uri()],
        check=False,
        capture_output=True,
        timeout=120,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()[-2000:]
    assert _files(node) == {"locks", "locks/r00000.lock"}
    code, doc = _cli("ls", tmp_path / "shm")
    assert code == EXIT_OK
    (loc,) = doc["locations"]
    assert (loc["tier"], loc["job"], loc["node_records"]) == (
        "local",
        "killed",
        ["locks/r00000.lock"],
    )
    code, doc = _cli("gc", node, "--keep", 1)
    assert code == EXIT_OK
    code, doc = _cli("rm-job", tmp_path / "shm", "--job", "killed", "--yes")
    assert code == EXIT_OK
    assert not node.exists()
    assert os.listdir(tmp_path / "shm" / "killed") == []
