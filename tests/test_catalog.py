"""The catalog's view of the records beside the blobs: job record, writers, quarantine, probes.

The CLI tests (tests/test_cli.py) run these through the command line on checkpoints a real
checkpointer wrote; here the catalog API is driven directly, on folders laid out by hand where
only the key names matter (which folder is a job, what a plan may remove).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tiercheck.catalog import (
    GcPlan,
    Location,
    LocationError,
    OpenLocation,
    apply_gc,
    find_locations,
    verify,
)
from tiercheck.consistency.identity import (
    JOB_KEY,
    TOMBSTONE_KEY,
    JobRecord,
    Tombstone,
    WriterRecord,
    probe_key,
    quarantine_key,
    writer_key,
)
from tiercheck.consistency.keys import blob_key, commit_key
from tiercheck.errors import ConfigError


def _touch(path: Path, data: bytes = b"x") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


async def test_a_job_named_quarantine_is_still_a_job(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    # A job named "quarantine": it has COMMIT records, which no quarantine folder holds.
    _touch(root / "quarantine" / blob_key(1, 0, "packed"))
    _touch(root / "quarantine" / commit_key(1))
    _touch(root / "quarantine" / quarantine_key(blob_key(0, 0, "packed")))
    # A job whose only blob was set aside: its quarantine folder makes it a job folder.
    _touch(root / "other" / quarantine_key(blob_key(4, 2, "packed")))
    found = await find_locations(str(root))
    assert [(loc.kind, loc.job) for loc in found] == [
        ("persistent", "other"),
        ("persistent", "quarantine"),
    ]
    async with OpenLocation(found[1]) as opened:
        catalog = await opened.scan()
    assert sorted(catalog.versions) == [1]
    assert [(q.original, q.version, q.rank) for q in catalog.quarantined] == [
        (blob_key(0, 0, "packed"), 0, 0)
    ]
    assert catalog.foreign == []


async def test_a_lone_job_record_or_writer_is_not_a_job(tmp_path: Path) -> None:
    _touch(tmp_path / "a" / JOB_KEY)
    _touch(tmp_path / "b" / writer_key(1))
    with pytest.raises(LocationError, match="no tiercheck checkpoints"):
        await find_locations(str(tmp_path))
    _touch(tmp_path / "a" / writer_key(3))
    (loc,) = await find_locations(str(tmp_path))
    assert loc.job == "a"


async def test_scan_reads_the_records_and_keeps_them_out_of_versions(tmp_path: Path) -> None:
    job = tmp_path / "job"
    _touch(job / JOB_KEY, JobRecord("job", "t0k3n", 2).to_bytes())
    for generation in (1, 2, 3):
        _touch(job / writer_key(generation), WriterRecord(generation, f"s{generation}").to_bytes())
    _touch(job / "writers" / "notes.txt")  # not a generation: foreign, left alone
    _touch(job / probe_key("sess", 1))
    _touch(job / quarantine_key(commit_key(5)), b"{}")  # not a blob key: version unknown
    async with OpenLocation(Location("persistent", str(job), "job")) as opened:
        catalog = await opened.scan()
        report = await verify(opened, catalog)
    assert catalog.versions == {}
    assert catalog.job_record == JobRecord("job", "t0k3n", 2)
    assert catalog.writer_generations == [1, 2, 3]
    assert catalog.newest_writer == WriterRecord(3, "s3")
    assert catalog.probes == [probe_key("sess", 1)]
    assert catalog.foreign == ["writers/notes.txt"]
    (aside,) = catalog.quarantined
    assert (aside.original, aside.version, aside.rank, aside.size) == (commit_key(5), None, None, 2)
    codes = sorted((f.severity, f.code) for f in report.findings)
    assert codes == [("warning", "probe-leftover"), ("warning", "quarantined")]
    quarantined = next(f for f in report.findings if f.code == "quarantined")
    assert "nothing was restored from it" in quarantined.message


async def test_a_writer_record_under_another_generation_is_unreadable(tmp_path: Path) -> None:
    job = tmp_path / "job"
    _touch(job / writer_key(2), WriterRecord(7, "s").to_bytes())
    async with OpenLocation(Location("persistent", str(job), "job")) as opened:
        catalog = await opened.scan()
        report = await verify(opened, catalog)
    assert catalog.newest_writer is None
    assert catalog.writer_error == f"{writer_key(2)} describes generation 7"
    assert [(f.code, f.key) for f in report.problems] == [("record-unreadable", writer_key(2))]


async def test_records_in_a_node_roots_blobs_are_foreign(tmp_path: Path) -> None:
    node = tmp_path / "job" / "node0"
    (node / "manifest").mkdir(parents=True)
    _touch(node / "blobs" / JOB_KEY, JobRecord("job", "t", 1).to_bytes())
    _touch(node / "blobs" / probe_key("s", 0))
    async with OpenLocation(Location("node", str(node), "job", "node0")) as opened:
        catalog = await opened.scan()
    assert catalog.job_record is None
    assert catalog.probes == []
    assert catalog.foreign == [JOB_KEY, probe_key("s", 0)]


@pytest.mark.parametrize(
    ("field", "key"),
    [
        ("commit_keys", JOB_KEY),
        ("quarantine_keys", writer_key(1)),
        ("quarantine_keys", probe_key("s", 0)),
    ],
)
async def test_apply_gc_refuses_a_plan_naming_other_keys(
    tmp_path: Path, field: str, key: str
) -> None:
    job = tmp_path / "job"
    _touch(job / key)
    doomed = quarantine_key(blob_key(0, 0, "packed"))
    _touch(job / doomed)
    location = Location("persistent", str(job), "job")
    plan = GcPlan(location, 1, [], [], [], [], [], quarantine_keys=[doomed])
    getattr(plan, field).append(key)
    async with OpenLocation(location) as opened:
        with pytest.raises(ConfigError, match="nothing was removed"):
            await apply_gc(opened, plan)
    assert (job / key).is_file()
    assert (job / doomed).is_file()  # refused whole, before any removal


async def test_a_deleted_jobs_folder_is_still_a_location_and_says_so(tmp_path: Path) -> None:
    """rm-job leaves a tombstone: the folder is listed (as deleted), never forgotten, and one
    whose job record names a deleted incarnation is a problem (the deletion did not finish)."""
    job = tmp_path / "job"
    tomb = Tombstone("job").deleting(["t0k3n"], 4, when=1.0, host="h", pid=7)
    _touch(job / TOMBSTONE_KEY, tomb.to_bytes())
    (loc,) = await find_locations(str(tmp_path))
    assert (loc.kind, loc.job) == ("persistent", "job")
    async with OpenLocation(loc) as opened:
        catalog = await opened.scan()
        report = await verify(opened, catalog)
    assert catalog.tombstone == tomb
    assert catalog.foreign == []
    assert report.findings == []
    _touch(job / JOB_KEY, JobRecord("job", "t0k3n", 1).to_bytes())
    async with OpenLocation(loc) as opened:
        report = await verify(opened, await opened.scan())
    assert [(f.code, f.key) for f in report.problems] == [("deletion-unfinished", TOMBSTONE_KEY)]
    _touch(job / TOMBSTONE_KEY, b"not json")
    async with OpenLocation(loc) as opened:
        catalog = await opened.scan()
        report = await verify(opened, catalog)
    assert catalog.tombstone is None
    assert [(f.code, f.key) for f in report.problems] == [("record-unreadable", TOMBSTONE_KEY)]


def test_a_tombstone_remembers_every_deletion() -> None:
    first = Tombstone("job").deleting(["a", "b", "a"], 3, when=1.0, host="h", pid=1)
    assert (first.tokens, first.generation) == (("a", "b"), 3)
    second = first.deleting(["c", "b"], None, when=2.0, host="h", pid=2)
    assert (second.tokens, second.generation, second.time) == (("a", "b", "c"), 3, 2.0)
    assert Tombstone.from_bytes(second.to_bytes()) == second
    many = Tombstone("job").deleting([f"t{i}" for i in range(100)], 1, when=0, host="", pid=0)
    assert many.tokens[-1] == "t99"
    assert len(many.tokens) == 64
