"""Never lose a checkpoint: operator mistakes and storage faults, produced for real.

Each test makes one fault happen (a job restarted with another number of ranks, bits flipped in
every stored blob, a second writer, a full or capacity-limited memory tier, memory left by
another run, a durable folder deleted or read-only, a state that does not fit) and then checks:
training was never killed by it, the user got a typed error or a logged, counted skip, and --
the point of it all -- the original job still restores its newest committed version bit-exact.

Several ranks of one job run here as threads of this process, connected by
:class:`tiercheck.testing.LocalGroup` (the real torchrun versions live in tests/distributed/).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from tiercheck import (
    ConfigError,
    JobLocked,
    RestoreError,
    StaleMemory,
    StateMismatch,
    StorageError,
    Superseded,
    SyncCheckpointer,
    TierWriteFailed,
    WorldSizeMismatch,
)
from tiercheck.consistency.identity import JOB_KEY, QUARANTINE_PREFIX, JobRecord
from tiercheck.testing import LocalGroup

from .helpers import (
    TinyTrainer,
    assert_state_equal,
    clone_state,
    mount_tmpfs,
    run_ranks,
    unmount,
)
from .tiers import conftest as tier_fixtures
from .tiers.conftest import S3Server

s3_server = tier_fixtures.s3_server  # a real S3-protocol server (moto) on loopback

T = TypeVar("T")


def state_of(version: int, rank: int = 0, n: int = 2048) -> dict[str, Any]:
    """The state rank ``rank`` saves as ``version``: a pure function of both."""
    g = torch.Generator().manual_seed(version * 1000 + rank)
    return {
        "w": torch.randn(n, generator=g),
        "h": torch.randn(64, generator=g).to(torch.bfloat16),
        "step": version,
    }


def job(
    root: Path,
    rank: int,
    world: int,
    group: LocalGroup | None,
    *,
    node: str | None = None,
    durable: str = "durable",
    **kw: Any,
) -> SyncCheckpointer:
    """Rank ``rank`` of job "job": its own node (memory root) unless ``node`` says otherwise."""
    kw.setdefault("base_every", 2)
    kw.setdefault("tiers", ["local", "persistent"])  # the peer tier needs torch.distributed
    return SyncCheckpointer(
        "job",
        rank=rank,
        world_size=world,
        ranks_per_node=1,
        coordinator=None if group is None else group.coordinator(rank),
        local_root=root / (node or f"node{rank}"),
        persistent=(root / durable).as_uri(),
        **kw,
    )


def save_versions(root: Path, world: int, versions: Sequence[int], **kw: Any) -> None:
    """A ``world``-rank job saves ``versions`` and closes, everything committed."""
    group = LocalGroup(world)

    def rank(r: int) -> None:
        with job(root, r, world, group, **kw) as ckpt:
            for v in versions:
                ckpt.save(v, state_of(v, r))
                # Each one written before the next: saves faster than a loaded machine writes
                # them would overflow a tier's queue (tier_queue) and skip versions there.
                ckpt.wait()

    run_ranks(world, rank)


def restore_all(root: Path, world: int, **kw: Any) -> list[Any]:
    """Every rank of a ``world``-rank job restores; returns what each got."""
    group = LocalGroup(world)

    def rank(r: int) -> Any:
        with job(root, r, world, group, **kw) as ckpt:
            return ckpt.restore()

    return run_ranks(world, rank)


def restore_then_save(
    root: Path, world: int, version: int, make: Callable[[int, int], Any] | None = None, **kw: Any
) -> list[Any]:
    """Every rank restores, then the run goes on and saves ``version`` (``make(version,
    rank)``, default :func:`state_of`); returns what each restore got."""
    group = LocalGroup(world)
    make = make or state_of

    def rank(r: int) -> Any:
        with job(root, r, world, group, **kw) as ckpt:
            got = ckpt.restore()
            ckpt.save(version, make(version, r))
            ckpt.wait()
            return got

    return run_ranks(world, rank)


def assert_restores(root: Path, world: int, version: int, **kw: Any) -> None:
    """The original job restores ``version`` bit-exact on every rank."""
    restored = restore_all(root, world, **kw)
    for r, got in enumerate(restored):
        assert got is not None, f"rank {r} restored nothing"
        assert got.version == version, f"rank {r} restored {got.version}, expected {version}"
        assert_state_equal(got.state, state_of(version, r))


def stored_files(root: Path) -> dict[str, bytes]:
    """Every checkpoint file under ``root`` (blobs and records), by relative path."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in root.rglob("*")
        if p.is_file() and "/v0" in f"/{p.relative_to(root)}" and not p.name.startswith(".")
    }


def flip_a_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x04
    path.write_bytes(bytes(data))


# --- restore never deletes what it could not use ------------------------------------------------


def test_another_world_size_is_refused_before_any_read_and_deletes_nothing(tmp_path: Path) -> None:
    save_versions(tmp_path, 2, range(5))
    before = stored_files(tmp_path)
    for world in (1, 4):
        with pytest.raises(WorldSizeMismatch, match="saved by 2 ranks; this run has"):
            restore_all(tmp_path, world)
    assert stored_files(tmp_path) == before
    assert_restores(tmp_path, 2, 4)


def test_bits_flipped_in_every_blob_raise_and_keep_everything(tmp_path: Path) -> None:
    save_versions(tmp_path, 2, range(4), persist="all", keep=4)
    blobs = [p for p in tmp_path.rglob("r0000*.*") if p.is_file()]
    assert len(blobs) >= 8  # both tiers, both ranks, several versions
    pristine = {p: p.read_bytes() for p in blobs}
    for p in blobs:
        flip_a_bit(p)
    with pytest.raises(RestoreError) as caught:
        restore_all(tmp_path, 2)
    report = str(caught.value)
    assert "nothing was deleted" in report
    for v in range(4):
        assert f"version {v}:" in report
    assert "ChecksumMismatch" in report
    # Nothing was removed; every damaged blob was also set aside for inspection.
    assert all(p.exists() for p in blobs)
    quarantined = [p for p in tmp_path.rglob("*") if QUARANTINE_PREFIX.rstrip("/") in p.parts]
    assert any(p.is_file() for p in quarantined)
    # Repair the damage (an operator restoring from a backup): the original job restores.
    for p, data in pristine.items():
        p.write_bytes(data)
    assert_restores(tmp_path, 2, 3)


def test_a_corrupt_newest_version_gives_way_and_is_quarantined(tmp_path: Path) -> None:
    save_versions(tmp_path, 1, range(3), keep=3, tiers=["local"])
    newest = next(tmp_path.rglob("v000000000002/r00000.full"))
    flip_a_bit(newest)
    damaged = newest.read_bytes()
    (restored,) = restore_all(tmp_path, 1, tiers=["local"])
    assert restored.version == 1
    assert_state_equal(restored.state, state_of(1))
    assert 2 in restored.rejected
    assert any("ChecksumMismatch" in line for line in restored.rejected[2])
    copy = next(tmp_path.rglob("quarantine/v000000000002/r00000.full"))
    assert copy.read_bytes() == damaged
    # A restore changes nothing stored: the damaged blob is where it was...
    assert newest.read_bytes() == damaged
    # ... until the run goes on from 1 and saves 2 anew; the damaged bytes stay set aside.
    (again,) = restore_then_save(tmp_path, 1, 2, tiers=["local"])
    assert again.version == 1
    assert newest.read_bytes() != damaged
    assert copy.read_bytes() == damaged
    assert_restores(tmp_path, 1, 2, tiers=["local"])


def test_a_tier_that_cannot_be_listed_refuses_the_restore(tmp_path: Path) -> None:
    save_versions(tmp_path, 1, range(3), tiers=["persistent"], base_every=1)
    durable = tmp_path / "durable" / "job"
    before = stored_files(tmp_path)
    # The folder becomes a file: listing it fails for real (NotADirectoryError), as an
    # unreachable bucket would; the probe at open (writing under it) fails first.
    moved = tmp_path / "moved"
    durable.rename(moved)
    durable.write_bytes(b"not a folder")
    with pytest.raises(StorageError):
        restore_all(tmp_path, 1, tiers=["persistent"])
    durable.unlink()
    moved.rename(durable)
    assert stored_files(tmp_path) == before
    assert_restores(tmp_path, 1, 2, tiers=["persistent"])


def test_only_torn_saves_restore_nothing_and_are_cleared(tmp_path: Path) -> None:
    save_versions(tmp_path, 2, [0], tiers=["local"])
    # Rank 1's blob is gone (its save never happened, say): version 0 was never whole.
    next((tmp_path / "node1").rglob("v000000000000/r00001.full")).unlink()
    before = stored_files(tmp_path)
    restored = restore_all(tmp_path, 2, tiers=["local"])
    assert restored == [None, None]
    assert stored_files(tmp_path) == before  # a restore changes nothing stored
    # The first save removes the torn pieces before writing, so it cannot mix with them.
    fresh = restore_then_save(tmp_path, 2, 0, lambda v, r: state_of(v + 100, r), tiers=["local"])
    assert fresh == [None, None]
    for r, got in enumerate(restore_all(tmp_path, 2, tiers=["local"])):
        assert got is not None
        assert got.version == 0
        assert_state_equal(got.state, state_of(100, r))


# --- one writer per job --------------------------------------------------------------------------


def test_a_second_writer_on_the_node_is_refused_at_open(tmp_path: Path) -> None:
    with job(tmp_path, 0, 1, None) as first:
        first.save(0, state_of(0))
        second = job(tmp_path, 0, 1, None)
        with pytest.raises(JobLocked, match="already being written on this node"):
            second.open()
        first.save(1, state_of(1))
        first.wait()
    assert_restores(tmp_path, 1, 1)


SECOND_WRITER = r"""
import sys, time, torch
from tiercheck import SyncCheckpointer, JobLocked
root, durable = sys.argv[1], sys.argv[2]
try:
    SyncCheckpointer("job", local_root=root, persistent=durable).open()
except JobLocked as exc:
    print("refused:", exc)
    sys.exit(3)
print("opened")
"""


@pytest.mark.multiprocess
def test_a_second_process_on_the_job_is_refused_while_the_first_runs(tmp_path: Path) -> None:
    with job(tmp_path, 0, 1, None) as first:
        first.save(0, state_of(0))
        run = subprocess.run(
            [
                sys.executable,
                "-c",
                SECOND_WRITER,
                str(tmp_path / "node0"),
                (tmp_path / "durable").as_uri(),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert run.returncode == 3, run.stdout + run.stderr
        assert "refused: rank 0 of this job is already being written" in run.stdout
        first.save(1, state_of(1))
        first.wait()
    assert_restores(tmp_path, 1, 1)


def test_a_newer_opening_elsewhere_takes_the_durable_tier_over(tmp_path: Path) -> None:
    # Two launches of one job on different nodes (memory roots) sharing durable storage.
    old = job(tmp_path, 0, 1, None, node="cluster-a", base_every=1)
    new = job(tmp_path, 0, 1, None, node="cluster-b", base_every=1)
    try:
        old.save(0, state_of(0))
        assert old.wait()["persistent"] == 0
        assert new.restore() is not None  # the newer opening restores what the old one stored
        new.save(1, state_of(1))
        new.wait()
        handle = old.save(2, state_of(2, rank=9))  # the old run goes on: durable writes stop
        with pytest.raises(TierWriteFailed) as caught:
            handle.result("persistent", timeout=60)
        assert isinstance(caught.value.__cause__, Superseded) or "newer opening" in str(
            caught.value
        )
        handle.result("local", timeout=60)  # its memory tier still works
        assert old.stats.superseded
        new.save(3, state_of(3))
        assert new.wait()["persistent"] == 3
    finally:
        old.close()
        new.close()
    assert_restores(tmp_path, 1, 3, node="cluster-c")


# --- memory faults never kill training -----------------------------------------------------------


def test_a_capacity_limited_local_tier_skips_versions_it_cannot_take(tmp_path: Path) -> None:
    big = {"w": torch.randn(1 << 16)}  # 256 KiB per version
    with job(tmp_path, 0, 1, None, local_capacity=100_000, base_every=1) as ckpt:
        handle = ckpt.save(0, big)  # no TierFull into training
        handle.result("persistent", timeout=60)
        with pytest.raises(TierWriteFailed, match="not stored in the 'local' tier"):
            handle.result("local", timeout=60)
        assert handle.stats.tiers["local"].state == "skipped"
        ckpt.save(1, big)
        assert ckpt.stats.tier_skips == {"local": 2}
        ckpt.wait()
    (restored,) = restore_all(tmp_path, 1)
    assert restored.version == 1
    assert restored.source_tier == "persistent"
    assert torch.equal(restored.state["w"], big["w"])


def test_retention_makes_room_in_a_local_tier_sized_for_keep_plus_one(tmp_path: Path) -> None:
    # keep=2 committed versions plus the one being saved: 3 slots of ~64 KiB (+headers).
    size = 64 * 1024
    with job(
        tmp_path, 0, 1, None, local_capacity=3 * size + 3 * 8192, keep={"local": 2}, base_every=1
    ) as ckpt:
        for v in range(8):
            ckpt.save(v, {"w": torch.full((size // 4,), float(v))})
            ckpt.wait()
        assert ckpt.stats.tier_skips.get("local", 0) == 0
        assert ckpt.versions()["local"] == [6, 7]


FULL_SHM = r"""
import sys, torch
from tiercheck import SyncCheckpointer
mem, durable = sys.argv[1], sys.argv[2]
ckpt = SyncCheckpointer("job", local_root=mem, persistent=durable, base_every=1)
state = {"w": torch.arange(6 << 20, dtype=torch.float32)}  # 24 MiB, on an 8 MiB tmpfs
h = ckpt.save(0, state)
h.result("persistent", timeout=120)
print("skips", ckpt.stats.tier_skips, "state", h.stats.tiers["local"].state, flush=True)
ckpt.close()
"""


@pytest.mark.multiprocess
def test_a_full_shared_memory_filesystem_never_kills_training(tmp_path: Path) -> None:
    mem = tmp_path / "tmpfs"
    mem.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mem)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.strip()}")
    try:
        run = subprocess.run(
            [sys.executable, "-c", FULL_SHM, str(mem), (tmp_path / "durable").as_uri()],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        # A regression is a SIGBUS: a negative return code.
        assert run.returncode == 0, f"rc={run.returncode}\n{run.stdout}\n{run.stderr[-3000:]}"
        assert "skips {'local': 1} state skipped" in run.stdout
    finally:
        subprocess.run(["umount", "-l", str(mem)], check=False)
    with job(tmp_path, 0, 1, None, node="elsewhere") as again:
        restored = again.restore()
    assert restored is not None
    assert torch.equal(restored.state["w"], torch.arange(6 << 20, dtype=torch.float32))


# --- identity of stored data ---------------------------------------------------------------------


def test_memory_of_another_run_is_not_restored(tmp_path: Path) -> None:
    save_versions(tmp_path, 1, range(3), durable="experiment-1")
    # A new experiment reuses the job id and the memory root with a brand-new durable folder.
    with (
        pytest.raises(
            StaleMemory,
            match=r"(?s)another durable location.*experiment-1.*holds versions \[1, 2\]",
        ) as refused,
        job(tmp_path, 0, 1, None, durable="experiment-2") as new,
    ):
        new.restore()
    assert refused.value.damaged == ()  # another run's memory, not a damaged record
    # Nothing was touched: the first run restores from its memory.
    (restored,) = restore_all(tmp_path, 1, durable="experiment-1")
    assert restored.version == 2
    assert restored.source_tier == "local"
    # The new experiment may discard that memory explicitly.
    with job(tmp_path, 0, 1, None, durable="experiment-2", stale_memory="discard") as new:
        assert new.restore() is None
        new.save(0, state_of(100))
        new.wait()
    # And the first run still restores, now from its durable folder (its memory is gone).
    (restored,) = restore_all(tmp_path, 1, durable="experiment-1", node="node9")
    assert restored.version == 2
    assert_state_equal(restored.state, state_of(2))


def test_a_damaged_job_record_names_the_repair_and_the_repair_loses_no_version(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """#19 finding 10: a JOB record that is not JSON refuses the opening with a StorageError
    naming ``tiercheck repair-job``; that command sets the record aside and nothing else, and
    the job then restores its newest version bit-exact -- from its memory (whose token the new
    record takes over) and, after a cluster loss, from durable storage."""
    from tiercheck.cli import main as cli

    save_versions(tmp_path, 2, range(5), persist="all")
    record = tmp_path / "durable" / "job" / JOB_KEY
    token = JobRecord.from_bytes(record.read_bytes()).token
    record.write_bytes(b'{"format": "tiercheck.job/1", "job_id": "job", "tok')  # a torn write
    before = stored_files(tmp_path)
    with pytest.raises(StorageError, match=r"tiercheck repair-job .* --job job"):
        restore_all(tmp_path, 2)
    assert stored_files(tmp_path) == before
    assert cli(["repair-job", (tmp_path / "durable").as_uri(), "--job", "job"]) == 0
    assert "set aside as quarantine/JOB." in capsys.readouterr().out
    repaired = JobRecord.from_bytes(record.read_bytes())
    assert repaired.repaired
    assert (repaired.world_size, repaired.worlds) == (2, ())
    assert stored_files(tmp_path) == before  # no version, no COMMIT record touched
    (kept,) = list((tmp_path / "durable" / "job" / "quarantine").glob("JOB.*"))
    assert kept.read_bytes().endswith(b'"tok')
    # The next opening writes the record anew, with the token the nodes' memory names.
    assert_restores(tmp_path, 2, 4)
    rewritten = JobRecord.from_bytes(record.read_bytes())
    assert rewritten.token == token
    assert not rewritten.repaired
    assert cli(["repair-job", (tmp_path / "durable").as_uri(), "--job", "job"]) == 0
    assert "is fine" in capsys.readouterr().out
    # Damaged again, and this time the cluster's memory is gone too.
    record.write_bytes(b"\x00garbage")
    for node in ("node0", "node1"):
        shutil.rmtree(tmp_path / node)
    assert cli(["repair-job", (tmp_path / "durable").as_uri(), "--job", "job"]) == 0
    assert_restores(tmp_path, 2, 4)


def test_stale_memory_says_which_case_and_what_discarding_loses(tmp_path: Path) -> None:
    """#19 finding 11: another incarnation at the same location, a damaged identity, and
    memory without an identity are told apart; the damaged case may be adopted, and the
    message names the versions that exist only in memory before it offers to discard them."""
    from tiercheck.consistency.identity import IDENTITY_FILE

    save_versions(tmp_path, 1, range(4), base_every=2)  # versions 0 and 2 are durable bases
    identity = tmp_path / "node0" / IDENTITY_FILE
    good = identity.read_bytes()
    identity.write_bytes(good[: len(good) // 2])  # truncated: damaged, not another run's
    before = stored_files(tmp_path)
    with pytest.raises(StaleMemory) as caught:
        restore_all(tmp_path, 1)
    text = str(caught.value)
    assert "identity record is damaged" in text
    assert "another run" not in text
    assert "holds versions [2, 3]" in text
    assert "[3] of them in no durable storage of this job: only there" in text
    assert "stale_memory='adopt'" in text
    assert "the only copy of versions [3]" in text
    assert stored_files(tmp_path) == before
    # The operator knows the memory is this run's: adopted, the newest version comes back
    # from memory and the identity is written anew.
    (restored,) = restore_all(tmp_path, 1, stale_memory="adopt")
    assert (restored.version, restored.source_tier) == (3, "local")
    assert_state_equal(restored.state, state_of(3))
    assert identity.read_bytes() != good[: len(good) // 2]
    # Another incarnation at the same location (the job was deleted and begun anew there):
    # "adopt" does not apply, and the message says whose memory it is.
    other = tmp_path / "other"
    save_versions(other, 1, range(2))
    shutil.rmtree(tmp_path / "durable")
    shutil.copytree(other / "durable", tmp_path / "durable")
    for policy in ("error", "adopt"):
        with pytest.raises(StaleMemory, match=r"another run of 'job' at the same durable location"):
            restore_all(tmp_path, 1, stale_memory=policy)
    (restored,) = restore_all(other, 1)
    assert restored.version == 1


def test_a_restart_after_the_durable_folder_vanished_uses_its_memory(tmp_path: Path) -> None:
    save_versions(tmp_path, 1, range(3))
    shutil.rmtree(tmp_path / "durable")
    (restored,) = restore_all(tmp_path, 1)
    assert restored.version == 2
    assert restored.source_tier == "local"
    assert (tmp_path / "durable" / "job" / JOB_KEY).exists()  # the job record is back


def _every_file(root: Path) -> dict[str, bytes]:
    """Every file under ``root``, records and temporaries included, by relative path."""
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_a_job_id_that_would_alias_another_job_is_refused_and_touches_nothing(
    tmp_path: Path,
) -> None:
    """``victim::x`` used to open job ``victim``'s durable folder (fsspec reads ``::`` as URL
    chaining), restore its data and write its own versions there. Every id that could name
    another folder is refused at construction, and ``victim`` restores its own newest version."""
    durable = (tmp_path / "durable").as_uri()
    with SyncCheckpointer(
        "victim", persistent=durable, local_root=tmp_path / "victim-node", base_every=2
    ) as victim:
        for v in range(4):
            victim.save(v, state_of(v))
        assert victim.wait() == {"local": 3, "persistent": 2}
    before = _every_file(tmp_path / "durable")
    memory = _every_file(tmp_path / "victim-node")
    for alias in ("victim::x", "victim::", "victim/.", "victim?x", "victim#x", "victim%2Fx",
                  "../durable/victim", "victim ", " victim", "victim\\x"):  # fmt: skip
        with pytest.raises(ConfigError, match="job_id must be"):
            SyncCheckpointer(alias, persistent=durable, local_root=tmp_path / "alias-node")
    assert not (tmp_path / "alias-node").exists()
    assert _every_file(tmp_path / "durable") == before
    assert _every_file(tmp_path / "victim-node") == memory
    # Its own memory, and -- the node lost -- its own durable folder: its own data, bit-exact.
    for node, version, tier in (("victim-node", 3, "local"), ("fresh-node", 2, "persistent")):
        with SyncCheckpointer(
            "victim", persistent=durable, local_root=tmp_path / node, base_every=2
        ) as again:
            restored = again.restore()
        assert restored is not None
        assert (restored.version, restored.source_tier) == (version, tier)
        assert_state_equal(restored.state, state_of(version))


KILLED_WRITER = """
import sys, torch, tiercheck
root, durable = sys.argv[1], sys.argv[2]
def state_of(v):
    g = torch.Generator().manual_seed(v * 1000)
    w, h = torch.randn(2048, generator=g), torch.randn(64, generator=g)
    return {"w": w, "h": h.to(torch.bfloat16), "step": v}
ckpt = tiercheck.SyncCheckpointer(
    "job", tiers=["persistent"], local_root=root, persistent=durable, base_every=10
).open()
for v in range(13):
    handle = ckpt.save(v, state_of(v))
    handle.result("persistent")  # TierNotTargeted if the version went nowhere
    print(v, handle.tiers, flush=True)
sys.stdin.read()  # wait to be killed
"""


@pytest.mark.multiprocess
def test_a_job_with_durable_tiers_only_stores_every_save_there(tmp_path: Path) -> None:
    """``tiers=["persistent"]`` once stored only every 10th save (the others had ``tiers={}``).
    Every save now goes to the durable tier: killed after saving version 12 (a delta), the job
    restores version 12, bit-exact."""
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_WRITER, str(tmp_path / "node"), (tmp_path / "d").as_uri()],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    try:
        lines = [proc.stdout.readline() for _ in range(13)]
    finally:
        proc.kill()  # SIGKILL: nothing of the writer runs after its last save returned
        _, err = proc.communicate(timeout=60)
    assert lines == [f"{v} ('persistent',)\n" for v in range(13)], err
    assert proc.returncode == -signal.SIGKILL
    with SyncCheckpointer(
        "job",
        tiers=["persistent"],
        local_root=tmp_path / "node",
        persistent=(tmp_path / "d").as_uri(),
    ) as again:
        restored = again.restore()
    assert restored is not None
    assert (restored.version, restored.source_tier) == (12, "persistent")
    assert_state_equal(restored.state, state_of(12))


# --- durable tier health and retention -----------------------------------------------------------


def test_retention_after_a_cluster_loss_keeps_keep_versions(tmp_path: Path) -> None:
    save_versions(tmp_path, 1, range(5), base_every=1, keep={"local": 2, "persistent": 3})
    shutil.rmtree(tmp_path / "node0")  # the cluster's memory is gone
    with job(tmp_path, 0, 1, None, base_every=1, keep={"local": 2, "persistent": 3}) as ckpt:
        restored = ckpt.restore()
        assert restored is not None
        assert (restored.version, restored.source_tier) == (4, "persistent")
        for v in (5, 6):
            ckpt.save(v, state_of(v))
        ckpt.wait()
        assert ckpt.versions()["persistent"] == [4, 5, 6]
    durable = tmp_path / "durable" / "job"
    assert sorted(p.name for p in durable.glob("v*")) == [f"v{v:012d}" for v in (4, 5, 6)]


def test_a_durable_folder_deleted_mid_run_is_noticed(tmp_path: Path) -> None:
    with job(tmp_path, 0, 1, None, base_every=10, persist="all", keep=5) as ckpt:
        for v in range(3):
            ckpt.save(v, state_of(v))
        assert ckpt.wait()["persistent"] == 2
        shutil.rmtree(tmp_path / "durable" / "job")  # a lifecycle rule, an operator
        delta = ckpt.save(3, state_of(3))
        with pytest.raises(TierWriteFailed, match="base vanished"):
            delta.result("persistent", timeout=60)
        rebased = ckpt.save(4, state_of(4))
        assert rebased.stats.kind == "base"
        rebased.result("persistent", timeout=60)
        assert ckpt.versions()["persistent"] == [4]
        assert (tmp_path / "durable" / "job" / JOB_KEY).exists()  # the job record is back
    shutil.rmtree(tmp_path / "node0")
    assert_restores(tmp_path, 1, 4)


def test_a_read_only_durable_location_fails_at_open(tmp_path: Path) -> None:
    save_versions(tmp_path, 1, range(2), base_every=1)
    ro = tmp_path / "ro"
    ro.mkdir()
    bound = subprocess.run(
        ["mount", "--bind", "-o", "ro", str(tmp_path / "durable"), str(ro)],
        capture_output=True,
        text=True,
        check=False,
    )
    if bound.returncode != 0:
        pytest.skip(f"cannot make a read-only bind mount here: {bound.stderr.strip()}")
    try:
        if os.access(ro, os.W_OK) and _writable(ro):
            pytest.skip("the bind mount is not read-only on this machine")
        with (
            pytest.raises(StorageError, match="cannot be used"),
            job(tmp_path, 0, 1, None, durable="ro", node="other"),
        ):
            pass
    finally:
        subprocess.run(["umount", "-l", str(ro)], check=False)
    assert_restores(tmp_path, 1, 1, node="fresh")


def _writable(folder: Path) -> bool:
    try:
        (folder / ".probe").write_bytes(b"x")
    except OSError:
        return False
    (folder / ".probe").unlink()
    return True


# --- strict in-place restore ---------------------------------------------------------------------


def test_restoring_into_a_state_that_does_not_fit_changes_nothing(tmp_path: Path) -> None:
    trainer = TinyTrainer(width=4)
    with job(tmp_path, 0, 1, None) as ckpt:
        trainer.step()
        ckpt.save(0, trainer.state())
        ckpt.wait()
    other = TinyTrainer(width=8)
    other.step()
    before = clone_state(other.state())
    with job(tmp_path, 0, 1, None) as again:
        with pytest.raises(StateMismatch, match=r"\['model'\]\['0.weight'\]"):
            again.restore(other.state())
        assert_state_equal(other.state(), before)
        fits = TinyTrainer(width=4, seed=5)
        fits.step()
        restored = again.restore(fits.state())
    assert restored is not None
    assert_state_equal(fits.model.state_dict(), trainer.model.state_dict())


def test_a_fresh_optimizer_is_restored_with_strict_false(tmp_path: Path) -> None:
    trainer = TinyTrainer()
    with job(tmp_path, 0, 1, None) as ckpt:
        for _ in range(3):
            trainer.step()
        ckpt.save(0, trainer.state())
        ckpt.wait()
    fresh = TinyTrainer(seed=3)
    with job(tmp_path, 0, 1, None) as again:
        with pytest.raises(StateMismatch, match="lacks"):
            again.restore(fresh.state())
        restored = again.restore(fresh.state(), strict=False)
    assert restored is not None
    fresh.opt.load_state_dict(restored.state["optim"])
    assert_state_equal(fresh.opt.state_dict()["state"], trainer.opt.state_dict()["state"])
    assert_state_equal(fresh.model.state_dict(), trainer.model.state_dict())


# --- S3-compatible storage through storage_options ----------------------------------------------


def test_s3_through_storage_options_and_a_wrong_endpoint_fails_at_open(
    s3_server: S3Server, tmp_path: Path
) -> None:
    url = s3_server.url()  # a real S3-protocol server (moto) on 127.0.0.1
    options = s3_server.storage_options  # key, secret, client_kwargs={"endpoint_url": ...}
    ckpt = SyncCheckpointer(
        "job",
        local_root=tmp_path / "s3-node",
        persistent=url,
        storage_options=options,
        base_every=1,
    )
    with ckpt:
        for v in range(3):
            ckpt.save(v, state_of(v))
        assert ckpt.wait()["persistent"] == 2
    # Nothing of the node survives; the bucket does.
    with SyncCheckpointer(
        "job", local_root=tmp_path / "s3-other", persistent=url, storage_options=options
    ) as again:
        restored = again.restore()
    assert restored is not None
    assert (restored.version, restored.source_tier) == (2, "persistent")
    assert_state_equal(restored.state, state_of(2))
    # An endpoint nothing listens on: refused when the job opens, not days later.
    wrong = {
        **options,
        "client_kwargs": {"endpoint_url": "http://127.0.0.1:9", "region_name": "us-east-1"},
    }
    with pytest.raises(StorageError, match="cannot be used"):
        SyncCheckpointer(
            "job",
            local_root=tmp_path / "s3-third",
            persistent=url,
            storage_options={**wrong, "config_kwargs": {"retries": {"max_attempts": 1}}},
        ).open()


_SHM_SCRIPT = """
import os, signal, sys, threading, time, torch, tiercheck
mount, durable, peak_file = sys.argv[1:4]
keep, pending, kill, capacity = map(int, sys.argv[4:8])
torch.manual_seed(0)
state = {"w": torch.randn(2_000_000)}  # 8 MB: each blob a little more
done = threading.Event()

def used():
    # The filesystem's own count: one consistent figure (a walk of the folder is not, while
    # files move between names), and what a full /dev/shm would really be short of.
    st = os.statvfs(mount)
    return (st.f_blocks - st.f_bfree) * st.f_frsize

def sample():
    peak = 0
    while not done.is_set():
        now = used()
        if now > peak:
            peak = now
            with open(peak_file, "w") as f:
                f.write(str(peak))
        time.sleep(0.0005)

threading.Thread(target=sample, daemon=True).start()
ckpt = tiercheck.SyncCheckpointer(
    "shm", persistent=durable, local_root=os.path.join(mount, "node"), tiers=["local"],
    keep=keep, max_pending=pending, local_capacity=capacity or None,
)
for v in range(30):
    state["w"].add_(1.0)
    ckpt.save(v, state)
ckpt.wait()
time.sleep(0.05)  # a last sample
if kill:
    os.kill(os.getpid(), signal.SIGKILL)
ckpt.close()
done.set()
"""

# The small records beside the blobs (manifest journal, identity, locks): a few KiB.
_SHM_RECORDS = 1 << 20


def _shm_used(mount: Path) -> int:
    """Bytes in use on the test's own tmpfs."""
    st = os.statvfs(mount)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def _shm_state(version: int) -> dict[str, torch.Tensor]:
    """What the script's state holds after saving ``version``."""
    torch.manual_seed(0)
    w = torch.randn(2_000_000)
    for _ in range(version + 1):
        w.add_(1.0)
    return {"w": w}


@pytest.mark.slow
def test_shared_memory_stays_within_its_stated_bound(tmp_path: Path) -> None:
    """#19: the documented account of /dev/shm (docs/use.md, "Memory"), on a tmpfs of its
    own. Saves that come faster than the local tier commits them hold more blobs than ``keep``
    for a while (no fixed number: measured, not promised); ``local_capacity`` is the hard
    bound, kept at every sampled instant of saving and after a SIGKILL, with every version
    still committed; a closed job leaves its kept versions and a spare, and the next opening
    after a crash removes the dead writer's temporary files and spares."""
    keep = 2
    script = tmp_path / "shm.py"
    script.write_text(_SHM_SCRIPT)
    durable = (tmp_path / "durable").as_uri()
    mounts: list[Path] = []

    def run(name: str, *, pending: int, kill: int, capacity: int) -> tuple[Path, int]:
        mount, peak = tmp_path / name, tmp_path / f"{name}.peak"
        mount.mkdir()
        mount_tmpfs(mount, 256 << 20)
        mounts.append(mount)
        args = (mount, f"{durable}-{name}", peak, keep, pending, kill, capacity)
        done = subprocess.run(
            [sys.executable, str(script), *map(str, args)],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert done.returncode == (-signal.SIGKILL if kill else 0), done.stderr
        return mount, int(peak.read_text())

    try:
        # Uncapped, closed normally: the kept versions and at most one spare stay.
        mount, _ = run("free", pending=1, kill=0, capacity=0)
        blobs = sorted((mount / "node").rglob("r*.full"))
        assert [p.parent.name for p in blobs] == ["v000000000028", "v000000000029"]
        blob = blobs[0].stat().st_blocks * 512
        assert _shm_used(mount) <= (keep + 1) * blob + _SHM_RECORDS

        # Capped at two blobs more than kept, with two saves encoding at once: the cap holds
        # at every instant, and the job commits every version in its memory all the same.
        capacity = (keep + 2) * blob
        mount, peak = run("capped", pending=2, kill=1, capacity=capacity)
        assert 0 < peak <= capacity + _SHM_RECORDS
        assert _shm_used(mount) <= capacity + _SHM_RECORDS  # what a crash leaves
        with SyncCheckpointer(
            "shm",
            persistent=f"{durable}-capped",
            local_root=mount / "node",
            tiers=["local"],
            keep=keep,
        ) as again:
            # The opening removed the dead writer's temporary files and spares.
            assert _shm_used(mount) <= keep * blob + _SHM_RECORDS
            restored = again.restore()
            assert restored is not None
            assert (restored.version, restored.source_tier) == (29, "local")
            assert_state_equal(restored.state, _shm_state(29))
            # After the restore, at most one blob more: the next save's memory, readied in
            # the background (TierPipeline.ready_after), as a running job holds it.
            assert _shm_used(mount) <= (keep + 1) * blob + _SHM_RECORDS
    finally:
        for mount in mounts:
            unmount(mount)
