"""The command line knows abandoned sets: the versions a run went back from.

One job is written once per module, for real: it saves versions 0..5, goes back to version 2
and saves on (so versions 3, 4, 5 are set aside, whole, as an abandoned set whose version 3 is a
delta on the live version 2), then a second process goes back to version 1 and is killed with
SIGKILL at the write of its set's ``SET`` record (leaving an unfinished set: copies only, of the
job's newest opening). Each test works on a copy of it and checks, after whatever it removed,
that the job still restores its newest version bit-exact.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tiercheck import SyncCheckpointer
from tiercheck.catalog import GcPlan, Location, OpenLocation, apply_gc, find_locations
from tiercheck.cli import EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE, main
from tiercheck.consistency.abandoned import AbandonedSet, abandoned_key, parse_tag, set_record_key
from tiercheck.consistency.identity import TOMBSTONE_KEY
from tiercheck.consistency.keys import blob_key, commit_key
from tiercheck.errors import ConfigError
from tiercheck.testing.faults import FaultPlan, FaultyTier
from tiercheck.tiers import LocalTier, PersistentTier

from .test_never_lose import state_of

JOB = "job"


def opened(root: Path, plan: FaultPlan | None = None) -> SyncCheckpointer:
    """The job, its tiers wrapped so that a test (or the killed child) can stop it at a write."""
    plan = plan or FaultPlan()
    return SyncCheckpointer(
        JOB,
        local_root=root / "node",
        tiers=[
            FaultyTier(LocalTier(root / "node" / "blobs"), plan),
            FaultyTier(PersistentTier((root / "durable" / JOB).as_uri()), plan),
        ],
        persist="all",
        base_every=2,  # bases 0, 2, 4: version 3 is a delta on 2, version 5 on 4
        keep={"local": 2, "persistent": 10},
        threads=1,
    )


# Goes back to version 1 and dies (SIGKILL) as it writes the SET record of its set: the copies
# of versions 2 and 3 are in place, the originals too.
KILLED_AT_SET = r"""
import os, signal, sys
from pathlib import Path
from tests.test_catalog_abandoned import opened
from tests.test_never_lose import state_of
from tiercheck.testing.faults import FaultPlan

plan = FaultPlan(
    die_on=lambda op, tier, key: op == "put" and key.endswith("/SET"),
    on_death=lambda: os.kill(os.getpid(), signal.SIGKILL),
)
ckpt = opened(Path(sys.argv[1]), plan)
assert ckpt.restore(version=1).version == 1
ckpt.save(2, state_of(202))
ckpt.wait()
"""


def new(version: int) -> dict[str, Any]:
    """What the run saves after going back (another timeline than ``state_of``)."""
    return state_of(100 + version)


@dataclass(frozen=True)
class Job:
    root: Path
    whole: str  # the tag of the finished set (versions 3, 4, 5)
    unfinished: str  # the tag of the killed opening's set (copies of 2 and 3)

    @property
    def folder(self) -> Path:
        return self.root / "durable" / JOB

    def set_folder(self, tag: str) -> Path:
        return self.folder / "abandoned" / tag

    def files(self) -> dict[str, bytes]:
        return {
            str(p.relative_to(self.folder)): p.read_bytes()
            for p in self.folder.rglob("*")
            if p.is_file()
        }


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Job:
    root = tmp_path_factory.mktemp("abandoned")
    with opened(root) as ckpt:
        for v in range(6):
            ckpt.save(v, state_of(v))
            ckpt.wait()  # each one durable: none dropped from a full queue
    with opened(root) as ckpt:
        got = ckpt.restore(version=2)
        assert got is not None
        assert got.version == 2
        ckpt.save(3, new(3))
        ckpt.wait()
    sets = root / "durable" / JOB / "abandoned"
    (whole,) = (p.name for p in sets.iterdir())
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_AT_SET, str(root)],
        check=False,
        capture_output=True,
        timeout=300,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()[-3000:]
    (unfinished,) = (p.name for p in sets.iterdir() if p.name != whole)
    assert not (sets / unfinished / "SET").exists()
    return Job(root, whole, unfinished)


@pytest.fixture
def job(pristine: Job, tmp_path: Path) -> Job:
    """A private copy of the module's job, free to damage."""
    shutil.copytree(pristine.root, tmp_path / "copy")
    return Job(tmp_path / "copy", pristine.whole, pristine.unfinished)


@dataclass(frozen=True)
class Ran:
    code: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)


@pytest.fixture
def run(capsys: pytest.CaptureFixture[str]) -> Any:
    def call(*argv: object) -> Ran:
        code = main([str(a) for a in argv])
        captured = capsys.readouterr()
        return Ran(code, captured.out, captured.err)

    return call


def assert_restores_newest(job: Job) -> None:
    """The job still restores its newest version (the new 3) bit-exact, as a fresh node."""
    (job.root / "node").rename(job.root / "node-before")  # durable tier only: no memory
    try:
        with opened(job.root) as ckpt:
            got = ckpt.restore()
        assert got is not None
        assert got.version == 3
        assert torch.equal(got.state["w"], new(3)["w"])
        assert torch.equal(got.state["h"], new(3)["h"])
    finally:
        shutil.rmtree(job.root / "node", ignore_errors=True)
        (job.root / "node-before").rename(job.root / "node")


# --- ls --------------------------------------------------------------------------------------


def test_ls_lists_the_sets_under_their_job_never_as_jobs(job: Job, run: Any) -> None:
    ran = run("ls", job.root / "durable", "--json")
    assert ran.code == EXIT_OK, ran.err
    (loc,) = ran.json()["locations"]  # a set's COMMIT copies do not make it a job
    assert loc["job"] == JOB
    assert [v["version"] for v in loc["versions"]] == [0, 1, 2, 3]
    sets = {s["tag"]: s for s in loc["abandoned"]}
    assert sorted(sets) == sorted([job.whole, job.unfinished])
    whole = sets[job.whole]
    assert (whole["whole"], whole["versions"], whole["restored"]) == (True, [3, 4, 5], 2)
    assert whole["reason"] == "the run went back to version 2"
    assert (whole["first"], whole["blobs"], whole["keys"]) == (3, 3, 7)  # + 3 COMMIT copies, SET
    on_disk = sum(p.stat().st_size for p in job.set_folder(job.whole).rglob("*") if p.is_file())
    assert whole["size"] == on_disk
    assert [h["kind"] for h in whole["held"]] == ["delta", "base", "delta"]
    unfinished = sets[job.unfinished]
    assert (unfinished["whole"], unfinished["has_record"]) == (False, False)
    assert unfinished["versions"] == [2, 3]  # the copies it holds
    assert unfinished["restored"] is None

    human = run("ls", job.folder)
    assert human.code == EXIT_OK
    assert "2 abandoned sets" in human.out
    (line,) = [ln for ln in human.out.splitlines() if job.whole in ln]
    assert line.strip().startswith("abandoned: versions [3, 4, 5]")
    assert "when the run went back to version 2; 3 blobs" in line
    assert "(1 so far), or `tiercheck gc --abandoned`" in line
    (line,) = [ln for ln in human.out.splitlines() if job.unfinished in ln]
    assert "an unfinished set-aside (copies; the originals stayed in place)" in line
    assert "kept: the job's newest opening" in line


def test_an_unreadable_set_record_is_shown_never_raised(job: Job, run: Any) -> None:
    (job.set_folder(job.whole) / "SET").write_bytes(b"{not json")
    listed = run("ls", job.folder, "--json")
    assert listed.code == EXIT_OK
    (whole,) = [s for s in listed.json()["locations"][0]["abandoned"] if s["tag"] == job.whole]
    assert (whole["has_record"], whole["whole"]) == (True, False)
    assert "FormatError" in whole["record_error"]
    assert whole["versions"] == [3, 4, 5]  # what it holds
    assert "its SET record cannot be read" in run("ls", job.folder).out
    checked = run("verify", job.folder, "--json")
    assert checked.code == EXIT_PROBLEMS
    (problem,) = [f for f in checked.json()["reports"][0]["findings"] if f["severity"] == "problem"]
    assert (problem["code"], problem["key"]) == ("record-unreadable", set_record_key(job.whole))
    assert problem["abandoned"] == job.whole
    assert run("gc", job.folder, "--keep", "10", "--abandoned").code == EXIT_OK
    assert not job.set_folder(job.whole).exists()
    assert_restores_newest(job)


# --- verify ----------------------------------------------------------------------------------


def test_verify_checks_the_sets_blobs_and_warns_of_the_unfinished_set(job: Job, run: Any) -> None:
    ran = run("verify", job.folder, "--deep", "--json")
    assert ran.code == EXIT_OK, ran.out
    (report,) = ran.json()["reports"]
    assert report["abandoned"] == [job.whole]
    assert report["blobs_checked"] == 4 + 3  # live 0..3, and the set's 3, 4, 5
    (warning,) = report["findings"]
    assert (warning["code"], warning["abandoned"]) == ("abandoned-unfinished", job.unfinished)
    assert "Kept: the job's newest opening" in warning["message"]
    assert "1 abandoned set, 7 blobs checked" in run("verify", job.folder).out


def test_verify_names_damage_inside_a_set(job: Job, run: Any) -> None:
    folder = job.set_folder(job.whole)
    four = folder / blob_key(4, 0, "packed")
    data = bytearray(four.read_bytes())
    data[len(data) // 2] ^= 0x04
    four.write_bytes(bytes(data))
    (folder / blob_key(5, 0, "packed")).unlink()
    (folder / commit_key(3)).unlink()
    ran = run("verify", job.folder, "--json")
    assert ran.code == EXIT_PROBLEMS
    found = sorted(
        (f["code"], f["version"], f["abandoned"])
        for f in ran.json()["reports"][0]["findings"]
        if f["severity"] == "problem"
    )
    assert found == [
        ("abandoned-incomplete", 3, job.whole),  # the SET record lists 3; no COMMIT copy of it
        ("abandoned-incomplete", 5, job.whole),  # 5's COMMIT copy names a blob that is gone
        ("corrupt", 4, job.whole),
    ]
    # The live versions are fine, and still restore.
    assert_restores_newest(job)


def test_a_sets_delta_needs_its_base_where_the_job_kept_it(job: Job, run: Any) -> None:
    # The set's version 3 is a delta on version 2, which stayed live.
    (job.folder / blob_key(2, 0, "packed")).unlink()
    ran = run("verify", job.folder, "--json")
    assert ran.code == EXIT_PROBLEMS
    findings = ran.json()["reports"][0]["findings"]
    found = {(f["code"], f["version"], f["abandoned"]) for f in findings}
    assert ("missing-base", 3, job.whole) in found
    assert ("torn-committed", 2, None) in found


# --- export ----------------------------------------------------------------------------------


def test_export_gets_a_version_back_out_of_a_set(job: Job, run: Any, tmp_path: Path) -> None:
    for version in (3, 4, 5):  # 3 is a delta on the live 2; 5 on the set's own 4
        out = tmp_path / f"v{version}"
        ran = run(
            "export", job.folder, out, "--abandoned", job.whole, "--version", version, "--json"
        )
        assert ran.code == EXIT_OK, ran.err
        assert (ran.json()["abandoned"], ran.json()["version"]) == (job.whole, version)
        got = torch.load(out.with_name(out.name + ".pt"), weights_only=True)
        assert torch.equal(got["w"], state_of(version)["w"])  # the old timeline's
        assert torch.equal(got["h"], state_of(version)["h"])
    newest = run("export", job.folder, tmp_path / "newest", "--abandoned", job.whole)
    assert newest.code == EXIT_OK
    assert "exported version 5 rank 0" in newest.out
    assert f"from the abandoned set {job.whole}" in newest.out
    refused = run("export", job.folder, tmp_path / "x", "--abandoned", job.unfinished)
    assert refused.code == EXIT_USAGE
    assert "unfinished" in refused.err
    missing = run("export", job.folder, tmp_path / "y", "--abandoned", job.whole, "--version", 1)
    assert missing.code == EXIT_USAGE
    assert "it holds 3, 4, 5" in missing.err
    unknown = run("export", job.folder, tmp_path / "z", "--abandoned", "from-v000000000001-x")
    assert unknown.code == EXIT_USAGE
    assert job.whole in unknown.err


# --- gc --------------------------------------------------------------------------------------


def test_gc_keeps_sets_by_the_checkpointers_rule(job: Job, run: Any) -> None:
    before = job.files()
    dry = run("gc", job.folder, "--keep", "2", "--dry-run", "--json")
    assert dry.code == EXIT_OK
    doc = dry.json()
    assert [f["tag"] for f in doc["abandoned_kept"]] == sorted([job.whole, job.unfinished])
    assert doc["abandoned_removed"] == []
    assert doc["abandoned_keys"] == []
    why = {f["tag"]: f["why"] for f in doc["abandoned_kept"]}
    assert (
        "1 whole committed version of its own from version 3 on, fewer than --keep 2"
        in (why[job.whole])
    )
    assert "newest opening" in why[job.unfinished]
    human = run("gc", job.folder, "--keep", "2", "--dry-run").out
    assert f"keeping abandoned set {job.whole}: versions [3, 4, 5]" in human
    assert job.files() == before

    # With --keep 1 the run has enough versions of its own after the set: it goes.
    ran = run("gc", job.folder, "--keep", "1", "--json")
    assert ran.code == EXIT_OK
    assert [f["tag"] for f in ran.json()["abandoned_removed"]] == [job.whole]
    assert ran.json()["abandoned_keys"][0] == set_record_key(job.whole)  # SET first
    assert not job.set_folder(job.whole).exists()
    assert job.set_folder(job.unfinished).is_dir()  # the newest opening's: never removed
    assert_restores_newest(job)


def test_gc_abandoned_removes_every_set_but_a_live_openings_unfinished_one(
    job: Job, run: Any
) -> None:
    before = job.files()
    dry = run("gc", job.folder, "--keep", "10", "--abandoned", "--dry-run")
    assert dry.code == EXIT_OK
    assert f"would remove abandoned set {job.whole}: versions [3, 4, 5]" in dry.out
    assert f"    {set_record_key(job.whole)}" in dry.out
    assert f"keeping abandoned set {job.unfinished}: an unfinished set-aside" in dry.out
    assert job.files() == before

    ran = run("gc", job.folder, "--keep", "10", "--abandoned", "--json")
    assert ran.code == EXIT_OK
    assert [f["tag"] for f in ran.json()["abandoned_kept"]] == [job.unfinished]
    assert not job.set_folder(job.whole).exists()
    assert job.set_folder(job.unfinished).is_dir()
    # Nothing but the set went.
    assert {k: v for k, v in before.items() if not k.startswith(f"abandoned/{job.whole}/")} == (
        job.files()
    )

    # Once a later opening of the job has started, the killed one's set is debris: plain gc
    # removes it.
    with opened(job.root) as ckpt:
        assert ckpt.restore() is not None
    checked = run("verify", job.folder, "--json").json()["reports"][0]
    (warning,) = checked["findings"]
    assert "Removable" in warning["message"]
    ran = run("gc", job.folder, "--keep", "10", "--json")
    assert [f["tag"] for f in ran.json()["abandoned_removed"]] == [job.unfinished]
    assert not (job.folder / "abandoned").exists()
    assert run("verify", job.folder, "--json").json()["reports"][0]["findings"] == []
    assert_restores_newest(job)


def test_an_unreadable_newest_writer_keeps_every_unfinished_set(job: Job, run: Any) -> None:
    newest = max((job.folder / "writers").iterdir())
    newest.write_bytes(b"garbage")
    line = next(ln for ln in run("ls", job.folder).out.splitlines() if job.unfinished in ln)
    assert "kept: the job's newest writer generation cannot be read" in line
    ran = run("gc", job.folder, "--keep", "10", "--abandoned", "--json")
    assert ran.code == EXIT_OK
    assert [f["tag"] for f in ran.json()["abandoned_kept"]] == [job.unfinished]
    assert job.set_folder(job.unfinished).is_dir()
    assert not job.set_folder(job.whole).exists()


def test_gc_keeps_the_live_base_a_kept_set_needs(job: Job, run: Any, tmp_path: Path) -> None:
    # Version 2 loses its COMMIT record (a lifecycle rule, a hand): gc would remove its blob as
    # an uncommitted version, but the kept set's version 3 is a delta on it.
    (job.folder / commit_key(2)).unlink()
    ran = run("gc", job.folder, "--keep", "2", "--json")
    assert ran.code == EXIT_OK
    doc = ran.json()
    assert doc["kept_for_abandoned"] == [2]
    assert blob_key(2, 0, "packed") not in doc["blob_keys"]
    assert (job.folder / blob_key(2, 0, "packed")).exists()
    assert (
        "keeping versions 2 too: a kept abandoned set's"
        in run("gc", job.folder, "--keep", "2", "--dry-run").out
    )
    out = tmp_path / "three"
    got = run("export", job.folder, out, "--abandoned", job.whole, "--version", 3)
    assert got.code == EXIT_OK, got.err
    assert torch.equal(torch.load(f"{out}.pt", weights_only=True)["w"], state_of(3)["w"])


GC_KILLED = r"""
import os, signal, sys
from tiercheck.cli import main
from tiercheck.tiers import persistent

real = persistent.PersistentTier.delete

async def dies_after_the_set_records(self, key):
    if key.startswith("abandoned/") and not key.endswith("/SET"):
        os.kill(os.getpid(), signal.SIGKILL)
    await real(self, key)

persistent.PersistentTier.delete = dies_after_the_set_records
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.multiprocess
def test_a_gc_killed_half_way_leaves_unfinished_sets_never_a_whole_one(job: Job, run: Any) -> None:
    killed = subprocess.run(
        [sys.executable, "-c", GC_KILLED, "gc", str(job.folder), "--keep", "10", "--abandoned"],
        check=False,
        capture_output=True,
        timeout=300,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()[-3000:]
    # The SET record went first: what is left reads as unfinished, and nothing reads it.
    assert not (job.set_folder(job.whole) / "SET").exists()
    assert (job.set_folder(job.whole) / blob_key(4, 0, "packed")).exists()
    listed = run("ls", job.folder, "--json").json()["locations"][0]["abandoned"]
    assert {(s["tag"], s["has_record"]) for s in listed} == {
        (job.whole, False),
        (job.unfinished, False),
    }
    # Its session is not the newest opening's: plain gc finishes the removal.
    ran = run("gc", job.folder, "--keep", "10", "--json")
    assert [f["tag"] for f in ran.json()["abandoned_removed"]] == [job.whole]
    assert not job.set_folder(job.whole).exists()
    assert_restores_newest(job)


async def test_apply_gc_refuses_abandoned_keys_that_are_not_a_sets(tmp_path: Path) -> None:
    folder = tmp_path / "job"
    tag = "from-v000000000003-abc"
    for key in (abandoned_key(tag, "SET"), "abandoned/notes.txt"):
        (folder / key).parent.mkdir(parents=True, exist_ok=True)
        (folder / key).write_bytes(b"x")
    location = Location("persistent", str(folder), JOB)
    plan = GcPlan(location, 1, [], [], [], [], [])
    plan.abandoned_keys = [abandoned_key(tag, "SET"), "abandoned/notes.txt"]
    async with OpenLocation(location) as opened_location:
        with pytest.raises(ConfigError, match="nothing was removed"):
            await apply_gc(opened_location, plan)
    assert (folder / abandoned_key(tag, "SET")).exists()


# --- rm-job ----------------------------------------------------------------------------------


def test_rm_job_removes_the_sets_too(job: Job, run: Any) -> None:
    (job.folder / "abandoned" / "notes.txt").write_text("mine")  # not tiercheck's
    dry = run("rm-job", job.folder, "--job", JOB, "--dry-run", "--json")
    assert dry.code == EXIT_OK
    (plan,) = [p for p in dry.json()["locations"] if p["tier"] == "persistent"]
    assert sorted(s["tag"] for s in plan["abandoned"]) == sorted([job.whole, job.unfinished])
    assert plan["left_alone"] == ["abandoned/notes.txt"]
    human = run("rm-job", job.folder, "--job", JOB, "--dry-run").out
    assert f"abandoned set {job.whole}: versions [3, 4, 5] (3 blobs" in human
    assert f"unfinished set-aside (copies) {job.unfinished}: versions [2, 3]" in human
    ran = run("rm-job", job.folder, "--job", JOB, "--yes")
    assert ran.code == EXIT_OK, ran.err
    left = {str(p.relative_to(job.folder)) for p in job.folder.rglob("*") if p.is_file()}
    assert left == {TOMBSTONE_KEY, "abandoned/notes.txt"}
    (job.folder / "abandoned" / "notes.txt").unlink()
    assert run("rm-job", job.folder, "--job", JOB, "--yes").code == EXIT_OK  # again: nothing left
    assert {p.name for p in job.folder.rglob("*") if p.is_file()} == {TOMBSTONE_KEY}


# --- the catalog -----------------------------------------------------------------------------


async def test_the_view_of_a_set_takes_older_versions_as_they_were_when_it_was_made(
    job: Job,
) -> None:
    (loc,) = await find_locations(str(job.folder))
    async with OpenLocation(loc) as opened_location:
        catalog = await opened_location.scan()
    view = catalog.abandoned_view(job.whole)
    assert sorted(view.versions) == [0, 1, 2, 3, 4, 5]
    # Its 3..5 are the set's; the live 3 (the new timeline's) is not in it.
    assert view.versions[3].blobs[0].key == abandoned_key(job.whole, blob_key(3, 0, "packed"))
    assert view.versions[2] is catalog.versions[2]
    assert catalog.foreign == []
    record = catalog.abandoned_set(job.whole)
    assert record is not None
    assert record.record == AbandonedSet.from_bytes(
        (job.set_folder(job.whole) / "SET").read_bytes()
    )
    assert parse_tag(job.unfinished) is not None
    with pytest.raises(KeyError):
        catalog.abandoned_view("from-v000000000009-none")
