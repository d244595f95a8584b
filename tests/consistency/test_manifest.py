"""The manifest: log + index appended together in one LMDB transaction, rebuildable, shared by
the processes of a node through its manifest process, and an environment anyone may truncate or
garble -- at rest or while in use -- never kills a process that uses it."""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing as mp
import os
import random
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lmdb
import msgpack
import pytest
import xxhash

from tests.helpers import mount_tmpfs, unmount
from tiercheck.consistency.manifest import (
    JOURNAL,
    Abort,
    Begin,
    Commit,
    Evict,
    Manifest,
    Written,
)
from tiercheck.consistency.manifestd import (
    DAMAGED_PREFIX,
    DATA,
    KILL_AT_VARIABLE,
    LOCK,
    check_at_rest,
)
from tiercheck.consistency.records import record_fields
from tiercheck.errors import ManifestError


def raw_frame(body: dict[str, Any]) -> bytes:
    """One frame of the journal, built from its specification (not from the code under test):
    magic, body length, xxh32 of the body, xxh32 of those 12 bytes; then the msgpack body."""
    data = msgpack.packb(body, use_bin_type=True)
    head = b"TCMJ" + struct.pack(">II", len(data), xxhash.xxh32_intdigest(data))
    return head + struct.pack(">I", xxhash.xxh32_intdigest(head)) + data


def journal(path: Path) -> Path:
    return path / JOURNAL


def _durable(v: int, rank: int = 0, tier: str = "local", base: int | None = None) -> Written:
    return Written(v, rank, tier, f"v{v:012d}/r{rank:05d}.full", 100 + v, 7 * v, 11 * v, base)


def test_append_updates_log_and_index_together(tmp_path: Path) -> None:
    with Manifest(tmp_path / "m") as m:
        m.append(Begin(1, 0, "base"), _durable(1), Commit(1, "local"))
        m.append(Begin(2, 0, "delta", 1), _durable(2, base=1))
        assert [r.op for r in m.log()] == ["begin", "durable", "commit", "begin", "durable"]
        assert [b.version for b in m.blobs("local")] == [1, 2]
        assert m.blobs("local", 2)[0].base == 1
        assert m.committed("local") == [1]
        assert m.is_committed("local", 1)
        assert not m.is_committed("local", 2)
        assert m.versions()[2] == {"begun": [0], "aborted": [], "kind": "delta", "base": 1}
        assert all(r.time > 0 for r in m.log())


def test_evict_removes_blob_and_commit_from_the_index_but_not_the_log(tmp_path: Path) -> None:
    with Manifest(tmp_path / "m") as m:
        m.append(_durable(1), _durable(1, rank=1), Commit(1, "local"))
        m.append(Evict(1, 1, "local"))
        assert [b.rank for b in m.blobs("local", 1)] == [0]
        assert m.committed("local") == []
        assert [r.op for r in m.log()][-1] == "evict"


def test_rebuilt_index_equals_the_incrementally_built_one(tmp_path: Path) -> None:
    with Manifest(tmp_path / "m") as m:
        for v in range(12):
            m.append(
                Begin(v, 0, "base" if v % 4 == 0 else "delta", None if v % 4 == 0 else v - v % 4)
            )
            for tier in ("local", "persistent"):
                for rank in (0, 1):
                    m.append(_durable(v, rank, tier, None if v % 4 == 0 else v - v % 4))
                m.append(Commit(v, tier))
            if v >= 3:
                m.append(Evict(v - 3, 0, "local"), Evict(v - 3, 1, "local"))
            if v == 7:
                m.append(Abort(v, 1, "skipped"))
        before = m.dump_index()
        m.rebuild_index()
        assert m.dump_index() == before
        assert before["commits"]  # the comparison is not between two empty indexes
        assert before["blobs"]


def test_several_processes_share_one_manifest(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from tiercheck.consistency.manifest import Manifest, Written\n"
        "rank = int(sys.argv[1])\n"
        "with Manifest(sys.argv[2]) as m:\n"
        "    for v in range(50):\n"
        "        m.append(Written(v, rank, 'local', f'k{v}-{rank}', 1, 2, 3))\n"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(rank), str(tmp_path / "m")])
        for rank in range(3)
    ]
    assert [p.wait(timeout=60) for p in procs] == [0, 0, 0]
    with Manifest(tmp_path / "m") as m:
        assert len(m.blobs("local")) == 150
        assert len(list(m.log())) == 150


def test_two_handles_in_one_process_share_the_environment(tmp_path: Path) -> None:
    a = Manifest(tmp_path / "m")
    b = Manifest(tmp_path / "m")
    a.append(_durable(1))
    assert [r.version for r in b.blobs()] == [1]
    a.close()
    b.append(_durable(2))  # still open: a's close did not close b's environment
    b.close()
    with pytest.raises(ManifestError):
        b.append(_durable(3))


def test_a_foreign_environment_is_set_aside_not_read(tmp_path: Path) -> None:
    """An LMDB environment this build did not write (a log but no format) is set aside, said
    once, and a new one started: never an error, never read as records."""
    path = tmp_path / "m"
    path.mkdir()
    env = lmdb.open(str(path), max_dbs=4)
    with env.begin(write=True) as txn:
        txn.put(b"\0" * 8, b"not a record", db=env.open_db(b"log", txn=txn))
    env.close()
    with Manifest(path) as m:
        assert len(m.notes) == 1
        assert "not a manifest this build wrote" in m.notes[0]
        assert list(m.log()) == []
        m.append(_durable(1))
        assert [r.version for r in m.log()] == [1]
    assert len(damaged_folders(path)) == 1


def test_unopenable_manifest_is_a_typed_error(tmp_path: Path) -> None:
    target = tmp_path / "m"
    target.write_bytes(b"a file where the manifest folder should be")
    with pytest.raises(ManifestError):
        Manifest(target)


def test_a_manifest_process_that_cannot_start_says_so_at_once(tmp_path: Path) -> None:
    """On a full filesystem the manifest process cannot make its environment: the handle is
    told by the process it launched (not by waiting out START_TIMEOUT for an answer), and the
    folder's files are left as they were."""
    where = tmp_path / "mnt"
    where.mkdir()
    mount_tmpfs(where, 64 * 1024)
    try:
        (where / "m").mkdir()
        with (where / "fill").open("wb") as f, contextlib.suppress(OSError):
            f.write(b"x" * (1 << 20))  # until ENOSPC
        with pytest.raises(ManifestError, match=r"could not start \(exit 1"):
            Manifest(where / "m")
        assert not damaged_folders(where / "m")
    finally:
        unmount(where)


def test_crash_inside_an_append_leaves_nothing_half_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The manifest process killed inside the write transaction of an append of two records,
    after the first was applied: neither is there, and the index agrees with the log."""
    path = tmp_path / "m"
    # Every manifest process started while this is set dies at its second record.
    monkeypatch.setenv(KILL_AT_VARIABLE, "append:2")
    with Manifest(path) as m:
        m.append(_durable(1))
        first = m.server_pid
        with pytest.raises(ManifestError):
            m.append(_durable(2), Commit(2, "local"))
        assert m.restarts == 2  # killed, started again, killed again: then it gives up
        assert first is not None
        assert not pid_alive(first)
        monkeypatch.delenv(KILL_AT_VARIABLE)
        assert [r.version for r in m.log()] == [1]
        assert [b.version for b in m.blobs()] == [1]
        before = m.dump_index()
        m.rebuild_index()
        assert m.dump_index() == before


def test_compact_drops_only_versions_gone_from_every_index(tmp_path: Path) -> None:
    with Manifest(tmp_path / "m") as m:
        for v in range(6):
            m.append(Begin(v, 0, "base"), _durable(v), Commit(v, "local"))
        for v in range(4):
            m.append(Evict(v, 0, "local"))
        m.append(_durable(1, tier="persistent"))  # version 1 still lives in another tier
        before = m.dump_index()
        removed = m.compact(keep_after=4)
        assert removed > 0
        versions_in_log = {r.version for r in m.log()}
        assert versions_in_log == {1, 4, 5}
        m.rebuild_index()
        after = m.dump_index()
        assert after["blobs"] == before["blobs"]
        assert after["commits"] == before["commits"]


def _append_many(path: str, rank: int) -> None:
    with Manifest(path) as m:
        for v in range(20):
            m.append(Begin(v, rank, "base"))


def test_manifest_survives_a_killed_writer(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    path = str(tmp_path / "m")
    proc = ctx.Process(target=_append_many, args=(path, 0))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    # A writer killed outright: the kernel drops its flock, the next opener carries on.
    code = (
        "import os, signal, sys\n"
        "from tiercheck.consistency.manifest import Manifest, Begin\n"
        "m = Manifest(sys.argv[1])\n"
        "m.append(Begin(100, 1, 'base'))\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    killed = subprocess.run([sys.executable, "-c", code, path], check=False)
    assert killed.returncode == -9
    with Manifest(path) as m:
        m.append(Begin(101, 2, "base"))
        assert {100, 101} <= set(m.versions())
    assert os.path.exists(os.path.join(path, DATA))


def _save_and_retain(m: Manifest, versions: range, keep: int = 2) -> None:
    """What one rank with one tier logs per save: begin, durable, commit, then retention."""
    for v in versions:
        m.append(Begin(v, 0, "base"), _durable(v), Commit(v, "local"))
        if v >= keep:
            m.append(Evict(v - keep, 0, "local"))


def test_compact_if_grown_waits_for_the_log_to_grow_then_keeps_what_lives(
    tmp_path: Path,
) -> None:
    with Manifest(tmp_path / "m") as m:
        _save_and_retain(m, range(3))  # 3 * 3 + 1 records
        assert m.compact_if_grown(3, min_records=20, growth=4) == 0  # not due yet
        assert m.log_size() == 10
        _save_and_retain(m, range(3, 8))
        grown = m.log_size()
        assert grown > 20
        before = m.dump_index()
        removed = m.compact_if_grown(8, min_records=20, growth=4)
        assert removed > 0
        assert m.log_size() == grown - removed
        # Only the versions still held (6 and 7) keep their records.
        assert {r.version for r in m.log()} == {6, 7}
        m.rebuild_index()
        after = m.dump_index()
        assert after["blobs"] == before["blobs"]
        assert after["commits"] == before["commits"]
        assert set(after["versions"]) == {6, 7}
        # What the compaction left sets the next bar: 4 x 6 records, not min_records again.
        _save_and_retain(m, range(8, 12))
        assert 20 < m.log_size() <= 24
        assert m.compact_if_grown(12, min_records=20, growth=4) == 0
        _save_and_retain(m, range(12, 13))
        assert m.compact_if_grown(13, min_records=20, growth=4) > 0
        assert {r.version for r in m.log()} == {11, 12}


def test_compaction_keeps_versions_in_flight(tmp_path: Path) -> None:
    with Manifest(tmp_path / "m") as m:
        _save_and_retain(m, range(4))
        m.append(Begin(4, 0, "base"))  # begun, nothing durable yet
        m.append(Begin(5, 0, "base"), Abort(5, 0, "skipped"))
        m.compact(keep_after=4)
        assert {r.version for r in m.log()} == {2, 3, 4, 5}
        assert set(m.versions()) == {2, 3, 4, 5}
        m.compact(keep_after=6)  # 5 was given up: nothing of it is held anywhere
        assert {r.version for r in m.log()} == {2, 3}


def test_a_compaction_killed_before_it_commits_leaves_the_whole_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(tmp_path / "m")
    with Manifest(path) as m:
        _save_and_retain(m, range(10))
        records = list(m.log())
        index = m.dump_index()
        pid = m.server_pid
    os.kill(pid, signal.SIGKILL)
    wait_gone(pid)
    # The manifest process dies inside the prune's transaction, every delete made, before it
    # commits: the latest moment a crash can interrupt it.
    monkeypatch.setenv(KILL_AT_VARIABLE, "prune")
    with Manifest(path) as m, pytest.raises(ManifestError):
        m.compact_if_grown(10, min_records=5)
    monkeypatch.delenv(KILL_AT_VARIABLE)
    with Manifest(path) as m:
        assert list(m.log()) == records
        assert m.dump_index() == index
        m.rebuild_index()
        assert m.dump_index() == index
        assert not damaged_folders(Path(path))  # a crash is not damage
        # And the next compaction, not interrupted, does the work.
        assert m.compact_if_grown(10, min_records=5) > 0
        assert {r.version for r in m.log()} == {8, 9}


def test_abort_records_of_older_logs_still_parse(tmp_path: Path) -> None:
    # Abort records once carried a `tier` field (always "": the whole save); a journal of
    # tiercheck 0.1 holding one is carried over.
    path = tmp_path / "m"
    path.mkdir()
    legacy = {"op": "abort", "version": 1, "rank": 0, "reason": "skipped", "tier": "", "time": 1.0}
    begin = {"op": "begin", "version": 1, "rank": 0, "kind": "base", "base": None, "time": 0.5}
    journal(path).write_bytes(
        raw_frame({"meta": {"format": 1, "compacted": 0}})
        + raw_frame({"records": [begin]})
        + raw_frame({"records": [legacy]})
    )
    with Manifest(path) as m:
        assert list(m.log())[-1] == Abort(1, 0, "skipped", time=1.0)
        m.rebuild_index()
        assert m.versions()[1]["aborted"] == [0]


# --- a journal of tiercheck 0.1 -----------------------------------------------------------------


def old_journal(path: Path, count: int) -> list[int]:
    """A journal of tiercheck 0.1 (built from its specification) of ``count`` appends, one
    version each; returns its size after each append."""
    path.mkdir(parents=True, exist_ok=True)
    data = raw_frame({"meta": {"format": 1, "compacted": 0}})
    ends = []
    for v in range(count):
        fields = record_fields(Begin(v, 0, "base", time=1.0 + v))
        data += raw_frame({"records": [fields, record_fields(_durable(v))]})
        ends.append(len(data))
    journal(path).write_bytes(data)
    return ends


def test_a_journal_is_carried_over_once(tmp_path: Path) -> None:
    path = tmp_path / "m"
    old_journal(path, 5)
    with Manifest(path) as m:
        assert [r.version for r in m.log()] == [v for v in range(5) for _ in range(2)]
        assert [b.version for b in m.blobs("local")] == list(range(5))
        assert m.versions()[3]["begun"] == [0]
    assert not journal(path).exists()
    assert (path / f"{JOURNAL}.carried-over").exists()
    with Manifest(path) as m:  # read once: not carried again
        assert m.log_size() == 10


KILLED_CARRYING = r"""
import os, signal, sys
from tiercheck.consistency.manifest import Manifest

def killed(self, *records):
    os.kill(os.getpid(), signal.SIGKILL)  # killed in the middle of the carry-over

Manifest.append = killed
Manifest(sys.argv[1])
"""


def test_a_carry_over_killed_midway_is_taken_back_by_the_next_opening(tmp_path: Path) -> None:
    """A process SIGKILLed while it carries the journal over leaves it as
    ``journal.carrying-<pid>``; the next opening (its process gone) takes it back and carries
    it. One of a process still alive is left to it."""
    path = tmp_path / "m"
    old_journal(path, 10)
    data = journal(path).read_bytes()
    killed = subprocess.run([sys.executable, "-c", KILLED_CARRYING, str(path)], check=False)
    assert killed.returncode == -signal.SIGKILL
    [left] = [p for p in path.iterdir() if p.name.startswith(f"{JOURNAL}.carrying-")]
    assert left.read_bytes() == data
    with Manifest(path) as m:
        assert sorted({r.version for r in m.log()}) == list(range(10))
    assert not left.exists()
    assert (path / f"{JOURNAL}.carried-over").read_bytes() == data
    # A carry-over of a live process (here: this one) is not taken from it.
    alive = tmp_path / "alive"
    old_journal(alive, 3)
    journal(alive).rename(alive / f"{JOURNAL}.carrying-{os.getpid()}")
    with Manifest(alive) as m:
        assert list(m.log()) == []
    assert (alive / f"{JOURNAL}.carrying-{os.getpid()}").exists()


def test_a_carry_over_the_manifest_process_fails_keeps_the_journal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Every manifest process dies inside the carry-over's first append (for real, at the crash
    point): the journal goes back under its name, nothing is set aside as damaged, and the
    next opening carries it."""
    path = tmp_path / "m"
    old_journal(path, 4)
    data = journal(path).read_bytes()
    monkeypatch.setenv(KILL_AT_VARIABLE, "append:1")
    with caplog.at_level(logging.WARNING, logger="tiercheck"), Manifest(path):
        pass
    monkeypatch.delenv(KILL_AT_VARIABLE)
    assert "carried at the next opening" in caplog.text
    assert journal(path).read_bytes() == data
    assert [p.name for p in path.iterdir() if ".damaged-" in p.name or ".carrying-" in p.name] == []
    with Manifest(path) as m:
        assert sorted({r.version for r in m.log()}) == list(range(4))
    assert not journal(path).exists()


def test_a_journal_cut_or_garbled_carries_what_is_whole(tmp_path: Path) -> None:
    """Cut inside its 7th append: the six before come over. Garbled in its first frame:
    nothing can be read, it is set aside, and the manifest starts empty. Never an error."""
    cut, garbled = tmp_path / "cut", tmp_path / "garbled"
    ends = old_journal(cut, 10)
    os.truncate(journal(cut), ends[6] - 3)
    old_journal(garbled, 10)
    data = bytearray(journal(garbled).read_bytes())
    data[2] ^= 0x5A
    journal(garbled).write_bytes(bytes(data))
    with Manifest(cut) as m:
        assert sorted({r.version for r in m.log()}) == list(range(6))
    with Manifest(garbled) as m:
        assert list(m.log()) == []
        m.append(_durable(1))
    aside = [p.name for p in garbled.iterdir() if p.name.startswith(f"{JOURNAL}.damaged-")]
    assert len(aside) == 1
    assert (garbled / aside[0]).read_bytes() == bytes(data)  # kept as it was, for inspection


# --- an environment someone else cuts short or garbles ------------------------------------------

REOPEN = r"""
import json, sys
from tiercheck.consistency.manifest import Begin, Manifest
from tiercheck.errors import ManifestError
out = {}
for path in sys.argv[1:]:
    try:
        with Manifest(path) as m:
            notes = len(m.notes)
            before = sorted({r.version for r in m.log()})
            m.append(Begin(999, 0, "base"))
            after = sorted({r.version for r in m.log()})
            index = m.dump_index()
            m.rebuild_index()
            assert m.dump_index() == index
        with Manifest(path) as m:
            again = sorted({r.version for r in m.log()})
        out[path] = {"before": before, "after": after, "again": again, "notes": notes}
    except ManifestError as exc:
        out[path] = {"error": str(exc)}
print(json.dumps(out))
"""


def reopen(paths: list[Path]) -> dict[str, dict[str, Any]]:
    """Open each manifest in one child process, list it, append to it, reopen it.

    In a child: should anything in it map a file that was cut short, its SIGBUS is a negative
    return code here, not a dead test run.
    """
    run = subprocess.run(
        [sys.executable, "-c", REOPEN, *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, f"rc={run.returncode}\n{run.stdout}\n{run.stderr[-3000:]}"
    result: dict[str, dict[str, Any]] = json.loads(run.stdout.splitlines()[-1])
    return result


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie nobody reaped yet does not: the manifest process is
    detached, and what adopts it here may reap late)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pid: int) -> None:
    deadline = time.monotonic() + 30
    while pid_alive(pid):
        assert time.monotonic() < deadline, f"process {pid} still alive"
        time.sleep(0.01)


def damaged_folders(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.name.startswith(DAMAGED_PREFIX))


def filled_at_rest(path: Path, count: int) -> None:
    """Versions 0..count-1 appended, then the manifest process stopped (as after a job)."""
    with Manifest(path) as m:
        for v in range(count):
            m.append(Begin(v, 0, "base"), _durable(v), Commit(v, "local"))
        pid = m.server_pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    wait_gone(pid)


def damage(path: Path, how: str, rng: random.Random) -> None:
    data = path / DATA
    size = data.stat().st_size
    page = 4096
    if how == "cut-to-zero":
        os.truncate(data, 0)
    elif how == "cut-to-half":
        os.truncate(data, size // 2)
    elif how == "cut-by-one-page":
        os.truncate(data, size - page)
    elif how == "garbled-whole":
        data.write_bytes(rng.randbytes(size))
    elif how == "meta-pages-garbled":
        with data.open("r+b") as f:
            for meta in (0, 1):
                f.seek(meta * page + 16)
                f.write(rng.randbytes(64))
    elif how == "leaf-page-garbled":
        # The main tree's root (a leaf: it holds the five named tables), as the newer meta
        # page names it (LMDB 0.9's layout: a 16-byte page header, then the meta record).
        with data.open("r+b") as f:
            metas = []
            for meta in (0, 1):
                f.seek(meta * page + 16 + 24 + 96)
                _last, txnid = struct.unpack("=QQ", f.read(16))
                f.seek(meta * page + 16 + 24 + 48 + 40)  # the main table's md_root
                (root,) = struct.unpack("=Q", f.read(8))
                metas.append((txnid, root))
            root = max(metas)[1]
            f.seek(root * page + 10)
            assert int.from_bytes(f.read(2), "little") & 0x02  # P_LEAF
            f.seek(root * page + 16)
            f.write(rng.randbytes(page - 16))
    elif how == "lock-garbled":
        (path / LOCK).write_bytes(rng.randbytes(8192))
    else:
        raise AssertionError(how)


DAMAGE = [
    "cut-to-zero",
    "cut-to-half",
    "cut-by-one-page",
    "garbled-whole",
    "meta-pages-garbled",
    "leaf-page-garbled",
    "lock-garbled",
]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_pages_damaged_under_a_live_server_are_set_aside_not_served(tmp_path: Path) -> None:
    """Pages changed under a running manifest process (the file keeps its size: nothing faults)
    read back as whatever LMDB makes of them -- a corrupt page, a page not found, a transaction
    it failed inside. Each kind: the process sets the environment aside and stops (the request
    is refused as damaged, or the process dies and is started again), and the next request is
    served by a new manifest -- never a damaged one kept in service, failing every read."""
    rng = random.Random(32)
    for how in ("all-zeroed", "one-page-zeroed", "one-page-garbled", "all-garbled"):
        path = tmp_path / how
        with Manifest(path) as m:
            for v in range(300):
                m.append(Begin(v, 0, "base"), _durable(v), Commit(v, "local"))
            assert len(list(m.log())) == 900
            data = path / DATA
            pages = data.stat().st_size // 4096
            chosen = range(2, pages) if how.startswith("all") else [2 + (pages - 2) // 2]
            with data.open("r+b") as f:
                for page in chosen:  # never the two meta pages
                    f.seek(page * 4096)
                    f.write(bytes(4096) if how.endswith("zeroed") else rng.randbytes(4096))
            refusals: list[str] = []
            for _ in range(3):  # the damaged page may be met by the first read or a later one
                try:
                    list(m.log())
                    m.append(Begin(10**6, 0, "base"))
                except ManifestError as exc:
                    refusals.append(str(exc))
            records = list(m.log())
            assert [r.version for r in records][-1:] == [10**6], how
        aside = damaged_folders(path)
        assert len(aside) == 1, how
        assert (aside[0] / DATA).exists()  # set aside, not deleted
        assert len(refusals) <= 1, (how, refusals)
        assert all("damaged" in why for why in refusals), (how, refusals)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_an_environment_damaged_at_rest_is_set_aside_and_never_kills(tmp_path: Path) -> None:
    """Every damage at rest: found before anything maps it (check_at_rest, or LMDB's verifier
    reading with pread), set aside as manifest.damaged-<UTC time>, said once (notes), and a new
    manifest started that takes appends -- in a fresh process, which never dies of it."""
    rng = random.Random(30)
    paths = []
    for how in DAMAGE:
        path = tmp_path / how
        filled_at_rest(path, 200)
        before = (path / DATA).read_bytes()
        damage(path, how, rng)
        damaged = (path / DATA).read_bytes() if (path / DATA).exists() else b""
        assert damaged != before or how == "lock-garbled"
        paths.append(path)
    got = reopen(paths)
    for path in paths:
        result = got[str(path)]
        assert result == {"before": [], "after": [999], "again": [999], "notes": 1}, path
        aside = damaged_folders(path)
        assert len(aside) == 1, path
        assert (aside[0] / "why.txt").read_text().strip()
        assert (aside[0] / DATA).exists()  # set aside, not deleted
    # The damage check reads without mapping: the same verdicts from a process of its own.
    for how, path in zip(DAMAGE, paths, strict=True):
        aside = damaged_folders(path)[0]
        found = check_at_rest(str(aside))
        if how in ("leaf-page-garbled",):
            assert found is None  # inside the tree: LMDB's verifier is what finds it
        else:
            assert found, how


WRITER = r"""
import os, sys, time
from tiercheck.consistency.manifest import Begin, Written, Manifest
from tiercheck.errors import ManifestError
path, rank, stop = sys.argv[1], int(sys.argv[2]), sys.argv[3]
errors = 0
with Manifest(path) as m:
    v = 0
    while not os.path.exists(stop):
        try:
            m.append(Begin(v, rank, "base"), Written(v, rank, "local", f"k{v}", 1, 2, 3))
            m.blobs("local", rank=rank)
        except ManifestError as exc:
            errors += 1
            print("error:", exc, file=sys.stderr)
        v += 1
        if v == 1:
            open(f"{stop}.ready{rank}", "w").close()
        time.sleep(0.001)
    # After the storm: must be there. A handle whose start of a manifest process failed (a cut
    # fell on the new environment) waits RETRY_AFTER before it tries again: give it longer.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            m.append(Begin(10**6 + rank, rank, "base"))
            break
        except ManifestError:
            time.sleep(0.1)
    print(errors, m.restarts)
"""


@pytest.mark.slow
@pytest.mark.multiprocess
def test_an_environment_cut_short_while_in_use(tmp_path: Path) -> None:
    """Two processes append and read while this one truncates data.mdb at random moments to
    random sizes: neither dies (the manifest process may: it is the only one mapping the file,
    and is started again), and afterwards the manifest opens whole, its index equal to a replay
    of its log, with the writers' last records (appended once a process started after the storm
    has verified the environment) in it."""
    path = tmp_path / "m"
    stop = tmp_path / "stop"
    Manifest(path).close()
    logs = [(tmp_path / f"out{rank}", tmp_path / f"err{rank}") for rank in (0, 1)]
    writers = []
    for rank, (out_file, err_file) in enumerate(logs):
        with out_file.open("w") as out, err_file.open("w") as err:
            writers.append(
                subprocess.Popen(
                    [sys.executable, "-c", WRITER, str(path), str(rank), str(stop)],
                    stdout=out,
                    stderr=err,
                )
            )
    # The storm starts once both writers appended (a loaded machine takes seconds to start
    # them), so that it falls on manifest processes in use.
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"stop.ready{rank}").exists() for rank in (0, 1)):
        assert time.monotonic() < deadline, "the writers never started"
        assert all(w.poll() is None for w in writers)
        time.sleep(0.01)
    rng = random.Random(7)
    cuts = 0
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        time.sleep(rng.uniform(0, 0.05))
        with contextlib.suppress(FileNotFoundError):
            size = (path / DATA).stat().st_size
            os.truncate(path / DATA, rng.choice([0, rng.randrange(size + 1), size // 2, 3]))
            cuts += 1
    # The storm is over, but the process serving now may map pages it cut that no request has
    # read yet (met later, they set the environment aside, and what was appended since with
    # it). A new process verifies every page before it serves: the writers' last records go
    # to one started after the storm, and must be kept.
    with Manifest(path) as probe:
        with contextlib.suppress(ManifestError):
            probe.blobs("local", rank=0)  # reaches the process serving now
        pid = probe.server_pid
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        wait_gone(pid)
    stop.touch()
    restarts = 0
    for w, (out_file, err_file) in zip(writers, logs, strict=True):
        w.wait(timeout=120)
        out, err = out_file.read_text(), err_file.read_text()
        assert w.returncode == 0, f"rc={w.returncode}\n{out}\n{err[-3000:]}"
        restarts += int(out.split()[1])
    assert cuts > 20
    assert restarts > 0  # the cuts did kill manifest processes: the writers lived on
    with Manifest(path) as m:
        versions = {r.version for r in m.log()}
        assert {10**6, 10**6 + 1} <= versions
        index = m.dump_index()
        m.rebuild_index()
        assert m.dump_index() == index
