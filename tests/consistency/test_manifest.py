"""The manifest: log + index appended together, rebuildable, shared, corruption typed, and a
journal anyone may truncate or garble never kills the process that reads it."""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import random
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
import xxhash

from tiercheck.consistency.manifest import (
    JOURNAL,
    Abort,
    Begin,
    Commit,
    Evict,
    Manifest,
    Record,
    Written,
)
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


def test_corrupt_value_is_a_typed_error(tmp_path: Path) -> None:
    with Manifest(tmp_path / "m") as m:
        m.append(_durable(1))
    data = bytearray(journal(tmp_path / "m").read_bytes())
    data[-1] ^= 0x01  # the last byte of the record's body
    journal(tmp_path / "m").write_bytes(bytes(data))
    with pytest.raises(ManifestError), Manifest(tmp_path / "m") as m:
        list(m.log())


def test_unopenable_manifest_is_a_typed_error(tmp_path: Path) -> None:
    target = tmp_path / "m"
    target.mkdir()
    journal(target).write_bytes(b"this is not a journal" * 100)
    with pytest.raises(ManifestError):
        Manifest(target)


def test_crash_inside_an_append_leaves_nothing_half_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with Manifest(tmp_path / "m") as m:
        m.append(_durable(1))
        calls = 0
        original = Manifest._apply

        def dying_apply(self: Manifest, record: Record, undo: Any = None) -> None:
            nonlocal calls
            calls += 1
            if calls == 2:
                raise RuntimeError("simulated crash between two records of one append")
            original(self, record, undo)

        monkeypatch.setattr(Manifest, "_apply", dying_apply)
        with pytest.raises(RuntimeError):
            m.append(_durable(2), Commit(2, "local"))
        monkeypatch.undo()
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
    assert os.path.exists(os.path.join(path, JOURNAL))


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


def test_a_compaction_killed_before_it_commits_leaves_the_whole_log(tmp_path: Path) -> None:
    path = str(tmp_path / "m")
    with Manifest(path) as m:
        _save_and_retain(m, range(10))
        records = list(m.log())
        index = m.dump_index()
    # The process dies with the compacted journal written in full but not yet renamed over the
    # old one: the latest moment a crash can interrupt it.
    code = (
        "import os, signal, sys\n"
        "from tiercheck.consistency.manifest import Manifest\n"
        "def dying(self, temp):\n"
        "    assert os.path.getsize(temp) > 0\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "Manifest._install = dying\n"
        "m = Manifest(sys.argv[1])\n"
        "m.compact_if_grown(10, min_records=5)\n"
    )
    killed = subprocess.run([sys.executable, "-c", code, path], check=False)
    assert killed.returncode == -9
    with Manifest(path) as m:
        assert list(m.log()) == records
        assert m.dump_index() == index
        m.rebuild_index()
        assert m.dump_index() == index
        assert os.listdir(path) == [JOURNAL]  # the dead compaction's file was removed
        # And the next compaction, not interrupted, does the work.
        assert m.compact_if_grown(10, min_records=5) > 0
        assert {r.version for r in m.log()} == {8, 9}


def test_abort_records_of_older_logs_still_parse(tmp_path: Path) -> None:
    # Abort records once carried a `tier` field (always "": the whole save).
    path = tmp_path / "m"
    with Manifest(path) as m:
        m.append(Begin(1, 0, "base"))
    legacy = {"op": "abort", "version": 1, "rank": 0, "reason": "skipped", "tier": "", "time": 1.0}
    with journal(path).open("ab") as f:
        f.write(raw_frame({"records": [legacy]}))
    with Manifest(path) as m:
        assert list(m.log())[-1] == Abort(1, 0, "skipped", time=1.0)
        m.rebuild_index()
        assert m.versions()[1]["aborted"] == [0]


# --- a journal someone else cuts short or garbles -----------------------------------------------

REOPEN = r"""
import json, sys
from tiercheck.consistency.manifest import Begin, Manifest
from tiercheck.errors import ManifestError
out = {}
for path in sys.argv[1:]:
    try:
        with Manifest(path) as m:
            before = [r.version for r in m.log()]
            m.append(Begin(999, 0, "base"))
            after = [r.version for r in m.log()]
            index = m.dump_index()
            m.rebuild_index()
            assert m.dump_index() == index
        with Manifest(path) as m:
            again = [r.version for r in m.log()]
        out[path] = {"before": before, "after": after, "again": again}
    except ManifestError as exc:
        out[path] = {"error": str(exc)}
print(json.dumps(out))
"""


def reopen(paths: list[Path]) -> dict[str, dict[str, Any]]:
    """Open each manifest in one child process, list it, append to it, reopen it.

    In a child: a SIGBUS (what a mapped database whose file was truncated gives) is a negative
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


def appended_one_by_one(path: Path, count: int) -> list[int]:
    """Append versions 0..count-1, one append each; return the journal's size after each."""
    ends = []
    with Manifest(path) as m:
        for v in range(count):
            m.append(Begin(v, 0, "base"))
            ends.append(journal(path).stat().st_size)
    return ends


CUTS = ["zero", "few-bytes", "half", "inside-a-record", "at-a-record"]
GARBLES = ["format-header", "first-record-header", "middle-record-body", "last-byte"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_journal_cut_short_or_garbled_at_rest_never_kills_its_reader(tmp_path: Path) -> None:
    """Truncated at rest (to nothing, a few bytes, half, inside or at the end of an append),
    the journal opens: the appends wholly before the cut are read, the rest is lost history,
    and the next append goes after what is left. Bytes changed inside it (a header, a record)
    raise ManifestError at opening, here and in a fresh process, and the file is left as it
    was for inspection. Never a signal."""
    expected: dict[str, dict[str, Any]] = {}
    garbled: dict[str, bytes] = {}
    for cut in CUTS:
        path = tmp_path / cut
        ends = appended_one_by_one(path, 20)
        size = {
            "zero": 0,
            "few-bytes": 5,
            "half": ends[-1] // 2,
            "inside-a-record": ends[12] - 3,
            "at-a-record": ends[12],
        }[cut]
        os.truncate(journal(path), size)
        kept = [v for v, end in enumerate(ends) if end <= size]
        expected[str(path)] = {"before": kept, "after": [*kept, 999], "again": [*kept, 999]}
    assert expected[str(tmp_path / "at-a-record")]["before"] == list(range(13))
    for where in GARBLES:
        path = tmp_path / where
        ends = appended_one_by_one(path, 10)
        offset = {
            "format-header": 2,  # inside the magic of the first frame (the format)
            "first-record-header": ends[0] + 6,  # a byte of the second frame's length
            "middle-record-body": ends[5] - 2,
            "last-byte": ends[-1] - 1,
        }[where]
        data = bytearray(journal(path).read_bytes())
        data[offset] ^= 0x5A
        journal(path).write_bytes(bytes(data))
        garbled[str(path)] = bytes(data)
        with pytest.raises(ManifestError):
            Manifest(path)
    got = reopen([tmp_path / name for name in CUTS + GARBLES])
    for path, want in expected.items():
        assert got[path] == want, path
    for path, data in garbled.items():
        assert "error" in got[path], path
        assert (Path(path) / JOURNAL).read_bytes() == data


def test_an_old_lmdb_manifest_is_never_opened(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A manifest folder left by a tiercheck that used LMDB (data.mdb, here cut short as in the
    fault that made us drop it) is not read, and says so once."""
    path = tmp_path / "m"
    path.mkdir()
    (path / "data.mdb").write_bytes(b"\0" * 40960)
    os.truncate(path / "data.mdb", 20480)
    caplog.set_level(logging.INFO, logger="tiercheck")
    with Manifest(path) as m:
        m.append(Begin(1, 0, "base"))
        assert [r.version for r in m.log()] == [1]
    assert any("LMDB" in r.getMessage() for r in caplog.records)


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
        time.sleep(0.001)
    m.append(Begin(10**6 + rank, rank, "base"))  # after the storm: must be there
print(errors)
"""


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_journal_cut_short_while_in_use(tmp_path: Path) -> None:
    """Two processes append and read while this one truncates the journal at random moments to
    random sizes: neither dies nor gets an error (a cut is lost history, repaired by the next
    append), and afterwards the journal opens whole, its index equal to a replay of its log."""
    path = tmp_path / "m"
    stop = tmp_path / "stop"
    Manifest(path).close()
    # Their output goes to files: a pipe nobody reads while the storm lasts fills up, and a
    # writer blocked on it (logging what it repairs, the lock held) would stall the other.
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
    rng = random.Random(7)
    cuts = 0
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        time.sleep(rng.uniform(0, 0.02))
        size = journal(path).stat().st_size
        os.truncate(journal(path), rng.choice([0, rng.randrange(size + 1), size // 2, 3]))
        cuts += 1
    stop.touch()
    for w, (out_file, err_file) in zip(writers, logs, strict=True):
        w.wait(timeout=60)
        out, err = out_file.read_text(), err_file.read_text()
        assert w.returncode == 0, f"rc={w.returncode}\n{out}\n{err[-3000:]}"
        assert out.split() == ["0"], err[-3000:]  # no call failed
    assert cuts > 50
    with Manifest(path) as m:
        versions = {r.version for r in m.log()}
        assert {10**6, 10**6 + 1} <= versions
        index = m.dump_index()
        m.rebuild_index()
        assert m.dump_index() == index


@pytest.mark.parametrize("cut", ["inside-a-record", "to-nothing"])
def test_a_cut_between_reading_the_end_and_appending_is_repaired(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cut: str
) -> None:
    """The worst moment for a truncation: after the writer read where the journal ends, before
    its write lands (at the new, shorter end, after a record cut in two). The writer notices,
    takes its write back, drops the cut record and appends again: the journal stays readable."""
    path = tmp_path / "m"
    ends = appended_one_by_one(path, 10)
    size = ends[6] - 3 if cut == "inside-a-record" else 0
    real_write = Manifest._write
    cuts = []

    def cut_then_write(self: Manifest, data: bytes) -> int:
        if not cuts:
            os.truncate(journal(path), size)  # someone else's truncate, at the worst moment
            cuts.append(size)
        return real_write(self, data)

    with Manifest(path) as m:
        assert [r.version for r in m.log()] == list(range(10))
        monkeypatch.setattr(Manifest, "_write", cut_then_write)
        m.append(Begin(50, 0, "base"))
        monkeypatch.undo()
        kept = [v for v, end in enumerate(ends) if end <= size]
        assert [r.version for r in m.log()] == [*kept, 50]
        assert set(m.versions()) == {*kept, 50}
    assert cuts == [size]
    with Manifest(path) as m:
        assert [r.version for r in m.log()] == [*kept, 50]
        index = m.dump_index()
        m.rebuild_index()
        assert m.dump_index() == index
