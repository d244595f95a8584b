"""The ``tiercheck`` command line against real checkpoints: ls, inspect, verify, export, gc.

The checkpoints are written by :class:`tiercheck.SyncCheckpointer` (a node root and a
``file://`` persistent folder, deltas persisted too) once per module and copied for each test
that changes them. The CLI runs in-process through ``main(argv)`` -- its exit code returned,
its output captured -- and once as a real subprocess. Multi-rank layouts are written with the
codec directly, the way several ranks would leave them. The records the checkpointer keeps
beside the blobs (job record, writer generations, quarantined blobs, probes, a node's identity)
are added by hand with the record classes of :mod:`tiercheck.consistency.identity`.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import tiercheck
from tiercheck import SyncCheckpointer
from tiercheck import cli as cli_module
from tiercheck.catalog import (
    EXPORT_MODE,
    LOCAL_TIER,
    Location,
    LocationError,
    OpenLocation,
    apply_gc,
    find_locations,
    plan_gc,
    safetensors_payload,
)
from tiercheck.cli import EXIT_OK, EXIT_PIPE, EXIT_PROBLEMS, EXIT_USAGE, ExternalCommand, main
from tiercheck.cli.base import ProgressBar
from tiercheck.codec import encode_packed, snapshot
from tiercheck.codec import verify as verify_blob
from tiercheck.consistency import manifestd
from tiercheck.consistency.commit import CommitEntry, CommitRecord
from tiercheck.consistency.identity import (
    IDENTITY_FILE,
    JOB_KEY,
    LOCKS_DIR,
    TOMBSTONE_KEY,
    JobRecord,
    NodeIdentity,
    WriterRecord,
    parse_writer_key,
    probe_key,
    quarantine_key,
    writer_key,
)
from tiercheck.consistency.keys import blob_key, commit_key
from tiercheck.consistency.manifest import Manifest
from tiercheck.defaults import NodeRoot
from tiercheck.errors import TiercheckError
from tiercheck.tiers import LocalTier, PersistentTier

from .helpers import TinyTrainer, assert_state_equal, clone_state
from .tiers import conftest as tier_fixtures
from .tiers.conftest import S3Server

# The moto S3 server fixture of the tier tests, made visible here.
s3_server = tier_fixtures.s3_server

JOB = "job"
VERSIONS = 8
BASE_EVERY = 3  # bases 0, 3, 6; every other version a delta against the one before it


@dataclass(frozen=True)
class Stored:
    """Checkpoints on disk, and the states they hold."""

    root: Path  # holds both tiers
    node: Path  # the node root (blobs/ + manifest/)
    durable: Path  # the persistent URL's folder; the job folder is durable / JOB
    states: dict[int, Any]

    @property
    def job(self) -> Path:
        return self.durable / JOB

    def blob(self, version: int, tier: str = "persistent") -> Path:
        if tier == "persistent":
            return self.job / blob_key(version, 0, "packed")
        return self.node / "blobs" / blob_key(version, 0, "full")


def _write(root: Path) -> dict[int, Any]:
    trainer = TinyTrainer()
    states = {}
    with SyncCheckpointer(
        JOB,
        local_root=root / "shm" / JOB / "node0",
        persistent=(root / "durable").as_uri(),
        base_every=BASE_EVERY,
        persist="all",
        keep={"local": 3, "persistent": 100},
    ) as ckpt:
        for step in range(VERSIONS):
            trainer.step()
            ckpt.save(step, trainer.state())
            states[step] = clone_state(trainer.state())
            # Every version stored before the next: saves faster than a loaded machine writes
            # them would overflow the persistent tier's queue (tier_queue) and skip versions.
            ckpt.wait()
    return states


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Stored:
    root = tmp_path_factory.mktemp("pristine")
    states = _write(root)
    return Stored(root, root / "shm" / JOB / "node0", root / "durable", states)


@pytest.fixture
def stored(pristine: Stored, tmp_path: Path) -> Stored:
    """A private copy of the module's checkpoints, free to damage."""
    root = tmp_path / "store"
    shutil.copytree(pristine.root, root)
    return Stored(root, root / "shm" / JOB / "node0", root / "durable", pristine.states)


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


def _flip_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x04
    path.write_bytes(bytes(data))


def _assert_one_line_error(ran: Ran) -> None:
    assert ran.code == EXIT_USAGE
    assert ran.err.count("\n") == 1
    assert "Traceback" not in ran.err


# --- ls --------------------------------------------------------------------------------------


def test_ls_lists_versions_kinds_and_commits(stored: Stored, run: Any) -> None:
    ran = run("ls", stored.job, "--json")
    assert ran.code == EXIT_OK
    (loc,) = ran.json()["locations"]
    assert loc["tier"] == "persistent"
    assert loc["job"] == JOB
    assert loc["ranks"] == [0]
    versions = {v["version"]: v for v in loc["versions"]}
    assert sorted(versions) == list(range(VERSIONS))
    for v, entry in versions.items():
        base = v - v % BASE_EVERY
        assert entry["kind"] == ("base" if v == base else "delta")
        assert entry["base"] == (None if v == base else base)
        assert entry["committed"] is True
        assert entry["complete"] is True
        assert entry["size"] == stored.blob(v).stat().st_size


def test_ls_of_a_parent_folder_finds_the_node_root_and_the_job(stored: Stored, run: Any) -> None:
    ran = run("ls", stored.root, "--json")
    assert ran.code == EXIT_OK
    found = {(loc["tier"], loc["job"]) for loc in ran.json()["locations"]}
    assert found == {("local", JOB), ("persistent", JOB)}
    node = next(loc for loc in ran.json()["locations"] if loc["tier"] == "local")
    assert [v["version"] for v in node["versions"]] == [5, 6, 7]
    assert {v["kind"] for v in node["versions"]} == {"full"}
    assert all(v["committed"] for v in node["versions"])


def test_ls_human_output_and_url_forms(stored: Stored, run: Any) -> None:
    for target in (stored.job, stored.job.as_uri(), stored.durable, stored.node):
        ran = run("ls", target)
        assert ran.code == EXIT_OK
        assert "VERSION" in ran.out
    with_job = run("ls", stored.durable.as_uri(), "--job", JOB, "--json")
    assert with_job.code == EXIT_OK
    assert [loc["job"] for loc in with_job.json()["locations"]] == [JOB]


def test_ls_of_a_memory_url(run: Any, tmp_path: Path) -> None:
    import fsspec

    url = "memory://tiercheck-cli-test"
    try:
        with SyncCheckpointer(
            JOB, local_root=tmp_path / "shm", persistent=url, persist="all", base_every=2
        ) as ckpt:
            for step in range(3):
                ckpt.save(step, {"w": torch.full((4,), float(step))})
            ckpt.wait()
        ran = run("ls", url, "--json")
        assert ran.code == EXIT_OK
        (loc,) = ran.json()["locations"]
        assert (loc["job"], [v["kind"] for v in loc["versions"]]) == (
            JOB,
            ["base", "delta", "base"],
        )
        assert run("verify", f"{url}/{JOB}").code == EXIT_OK
    finally:
        fsspec.filesystem("memory").rm("/tiercheck-cli-test", recursive=True)


def test_options_go_before_or_after_the_command(stored: Stored, run: Any) -> None:
    before = run("--json", "ls", stored.job)
    after = run("ls", stored.job, "--json")
    assert before.code == after.code == EXIT_OK
    assert before.json() == after.json()


# --- inspect ---------------------------------------------------------------------------------


def test_inspect_shows_ratios_checksums_and_tensors(stored: Stored, run: Any) -> None:
    ran = run("inspect", stored.job, "--version", 4, "--tensors", "--json")
    assert ran.code == EXIT_OK
    doc = ran.json()
    (version,) = doc["versions"]
    (blob,) = version["blobs"]
    assert blob["kind"] == "delta"
    assert blob["base"] == 3
    assert blob["encoding"] == "packed"
    assert blob["size"] == stored.blob(4).stat().st_size
    assert blob["ratio"] == pytest.approx(blob["raw_size"] / blob["size"])
    assert any("xor" in stage for stage in blob["stages"])
    assert int(blob["checksum"], 16) > 0
    state = stored.states[4]
    expected = {
        "model": [(n, list(t.shape)) for n, t in state["model"].items()],
    }
    shapes = {t["path"]: t["shape"] for t in blob["tensors"]}
    for name, shape in expected["model"]:
        assert shapes[f"['model'][{name!r}]"] == shape
    assert blob["tensor_count"] == len(blob["tensors"])


def test_inspect_human_output_of_a_node_root(stored: Stored, run: Any) -> None:
    ran = run("inspect", stored.node)
    assert ran.code == EXIT_OK
    assert "RATIO" in ran.out
    ran_json = run("inspect", stored.node, "--json")
    blobs = [b for v in ran_json.json()["versions"] for b in v["blobs"]]
    assert {b["encoding"] for b in blobs} == {"full"}
    assert ran_json.json()["manifest"]["committed"][LOCAL_TIER] == [5, 6, 7]


def test_tier_and_job_pick_one_location_of_several(stored: Stored, run: Any) -> None:
    _assert_one_line_error(run("inspect", stored.root))  # a node root and a job folder
    for tier in ("local", "persistent"):
        ran = run("inspect", stored.root, "--job", JOB, "--tier", tier, "--version", 6, "--json")
        assert ran.code == EXIT_OK
        assert ran.json()["tier"] == tier


def test_inspect_of_a_missing_version_is_a_usage_error(stored: Stored, run: Any) -> None:
    _assert_one_line_error(run("inspect", stored.job, "--version", 99))


# --- verify ----------------------------------------------------------------------------------


def test_verify_a_clean_store(stored: Stored, run: Any) -> None:
    for target in (stored.job, stored.node):
        ran = run("verify", target, "--json")
        assert ran.code == EXIT_OK, ran.out
        (report,) = ran.json()["reports"]
        assert report["problems"] == report["warnings"] == 0
        assert ran.json()["ok"] is True
    assert run("verify", stored.job, "--deep").code == EXIT_OK
    # A parent folder verifies every location it holds.
    assert len(run("verify", stored.root, "--json").json()["reports"]) == 2


def _stop_manifest_process(node: Path) -> None:
    """Wait until no manifest process serves ``node``'s manifest (the one the fixture's job
    started exits a few seconds after its last client; kill it rather than wait)."""
    folder = str(node / "manifest")
    if manifestd.served(folder):
        with Manifest(folder) as m:
            pid = m.server_pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while manifestd.served(folder):
        assert time.monotonic() < deadline
        time.sleep(0.01)


@pytest.mark.parametrize("damage", ["cut-short", "garbled-meta"])
def test_verify_reports_a_damaged_manifest_and_leaves_it_as_it_is(
    stored: Stored, run: Any, damage: str
) -> None:
    """A node's manifest damaged at rest: verify and ls say so (read with pread, never mapped),
    change nothing (the job's next opening is what sets it aside), and the versions the node's
    memory holds are listed and checked as before."""
    _stop_manifest_process(stored.node)
    data = stored.node / "manifest" / manifestd.DATA
    if damage == "cut-short":
        os.truncate(data, data.stat().st_size // 2)
    else:
        raw = bytearray(data.read_bytes())
        raw[16:20] = b"\0\0\0\0"  # the first meta page's magic
        raw[4096 + 16 : 4096 + 20] = b"\0\0\0\0"
        data.write_bytes(bytes(raw))
    before = {p.name: p.read_bytes() for p in (stored.node / "manifest").iterdir() if p.is_file()}
    ran = run("verify", stored.node, "--json")
    assert ran.code == EXIT_PROBLEMS
    (report,) = ran.json()["reports"]
    problems = [f for f in report["findings"] if f["severity"] == "problem"]
    assert [f["code"] for f in problems] == ["manifest"]
    assert "damaged" in problems[0]["message"]
    human = run("ls", stored.node)
    assert human.code == EXIT_OK
    assert "manifest unreadable" in human.out
    assert run("ls", stored.node, "--json").json()["locations"][0]["versions"]
    after = {p.name: p.read_bytes() for p in (stored.node / "manifest").iterdir() if p.is_file()}
    assert after == before  # nothing set aside, nothing rewritten
    assert not manifestd.served(str(stored.node / "manifest"))


def test_ls_says_how_many_versions_a_node_manifest_records(stored: Stored, run: Any) -> None:
    (loc,) = run("ls", stored.node, "--json").json()["locations"]
    assert loc["manifest_error"] is None
    with Manifest(stored.node / "manifest") as m:
        recorded = set(m.versions()) | set(m.committed(LOCAL_TIER))
    assert loc["manifest_versions"] == len(recorded) > 0
    assert f"manifest of {len(recorded)} versions" in run("ls", stored.node).out
    shutil.rmtree(stored.node / "manifest")
    (loc,) = run("ls", stored.node, "--json").json()["locations"]
    assert loc["manifest_versions"] is None
    assert "no manifest" in run("ls", stored.node).out


@pytest.mark.parametrize("tier", ["persistent", "local"])
def test_verify_names_a_blob_with_one_flipped_bit(stored: Stored, run: Any, tier: str) -> None:
    target = stored.job if tier == "persistent" else stored.node
    _flip_bit(stored.blob(6, tier))
    ran = run("verify", target, "--json")
    assert ran.code == EXIT_PROBLEMS
    problems = [f for f in ran.json()["reports"][0]["findings"] if f["severity"] == "problem"]
    assert [(f["code"], f["key"]) for f in problems] == [
        ("corrupt", blob_key(6, 0, "packed" if tier == "persistent" else "full"))
    ]
    human = run("verify", target)
    assert human.code == EXIT_PROBLEMS
    assert blob_key(6, 0, "packed" if tier == "persistent" else "full") in human.out


def test_verify_a_committed_version_that_lost_a_blob(stored: Stored, run: Any) -> None:
    stored.blob(5).unlink()
    ran = run("verify", stored.job, "--json")
    assert ran.code == EXIT_PROBLEMS
    codes = {(f["code"], f["version"]) for f in ran.json()["reports"][0]["findings"]}
    assert ("torn-committed", 5) in codes


def test_verify_a_delta_without_its_base(stored: Stored, run: Any) -> None:
    stored.blob(3).unlink()
    (stored.job / commit_key(3)).unlink()
    ran = run("verify", stored.job, "--json")
    assert ran.code == EXIT_PROBLEMS
    missing = {
        f["version"] for f in ran.json()["reports"][0]["findings"] if f["code"] == "missing-base"
    }
    assert missing == {4, 5}


def test_verify_a_commit_record_that_disagrees(stored: Stored, run: Any) -> None:
    path = stored.job / commit_key(2)
    record = json.loads(path.read_text())
    record["entries"][0]["checksum"] ^= 1
    path.write_text(json.dumps(record))
    ran = run("verify", stored.job, "--json")
    assert ran.code == EXIT_PROBLEMS
    codes = {(f["code"], f["version"]) for f in ran.json()["reports"][0]["findings"]}
    assert codes == {("commit-mismatch", 2)}


def test_verify_an_unreadable_commit_record(stored: Stored, run: Any) -> None:
    (stored.job / commit_key(1)).write_text("{not json")
    ran = run("verify", stored.job, "--json")
    assert ran.code == EXIT_PROBLEMS
    codes = {f["code"] for f in ran.json()["reports"][0]["findings"]}
    assert codes == {"commit-unreadable"}


def test_verify_a_version_without_commit_is_only_a_warning(stored: Stored, run: Any) -> None:
    (stored.job / commit_key(7)).unlink()
    ran = run("verify", stored.job, "--json")
    assert ran.code == EXIT_OK
    (finding,) = ran.json()["reports"][0]["findings"]
    assert (finding["severity"], finding["code"], finding["version"]) == (
        "warning",
        "uncommitted",
        7,
    )


# --- several ranks, written the way their ranks would leave them ---------------------------


def _two_rank_job(folder: Path, *, committed: set[int], torn: dict[int, int]) -> None:
    """Versions 0 (base) and 1, 2 (deltas on 0) of ranks 0 and 1, as packed blobs.

    ``torn`` maps a version to the one rank whose blob it has; ``committed`` versions get a
    ``COMMIT`` record listing what is present.
    """
    gen = torch.Generator().manual_seed(7)
    for rank in (0, 1):
        base = None
        for version in range(3):
            state = {"w": torch.randn(64, generator=gen), "rank": rank, "step": version}
            raw = snapshot(state, version=version)
            parts, meta = encode_packed(raw, rank=rank, base=base)
            if version == 0:
                base = raw
            if version in torn and torn[version] != rank:
                continue
            path = folder / blob_key(version, rank, "packed")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"".join(bytes(p) for p in parts))
            entries_path = folder / f".entries-{version}"
            entries = json.loads(entries_path.read_text()) if entries_path.exists() else []
            entries.append(
                {
                    "rank": rank,
                    "key": blob_key(version, rank, "packed"),
                    "size": meta.nbytes,
                    "checksum": meta.checksum,
                    "raw_digest": meta.raw_digest,
                    "base": None if meta.base is None else meta.base.version,
                }
            )
            entries_path.write_text(json.dumps(entries))
    for version in range(3):
        entries_path = folder / f".entries-{version}"
        entries = json.loads(entries_path.read_text())
        entries_path.unlink()
        if version in committed:
            record = CommitRecord(
                job_id=folder.name,
                version=version,
                world_size=2,
                entries=tuple(CommitEntry(**e) for e in entries),
            )
            (folder / commit_key(version)).write_bytes(record.to_bytes())


def test_a_torn_uncommitted_version_is_a_warning(tmp_path: Path, run: Any) -> None:
    job = tmp_path / "ranks"
    _two_rank_job(job, committed={0, 1}, torn={2: 0})
    ls = run("ls", job, "--json").json()["locations"][0]
    newest = ls["versions"][-1]
    assert (newest["version"], newest["missing_ranks"], newest["committed"]) == (2, [1], False)
    ran = run("verify", job, "--json")
    assert ran.code == EXIT_OK
    (finding,) = ran.json()["reports"][0]["findings"]
    assert (finding["severity"], finding["code"], finding["version"]) == ("warning", "torn", 2)


def test_a_torn_committed_version_is_a_problem(tmp_path: Path, run: Any) -> None:
    job = tmp_path / "ranks"
    _two_rank_job(job, committed={0, 1, 2}, torn={})
    (job / blob_key(1, 1, "packed")).unlink()
    ran = run("verify", job, "--json")
    assert ran.code == EXIT_PROBLEMS
    findings = ran.json()["reports"][0]["findings"]
    assert [(f["code"], f["version"], f["rank"]) for f in findings] == [("torn-committed", 1, 1)]


def test_export_needs_a_rank_when_there_are_several(tmp_path: Path, run: Any) -> None:
    job = tmp_path / "ranks"
    _two_rank_job(job, committed={0, 1, 2}, torn={})
    _assert_one_line_error(run("export", job, tmp_path / "out"))
    ran = run("export", job, tmp_path / "out", "--rank", 1, "--format", "pt", "--json")
    assert ran.code == EXIT_OK
    state = torch.load(tmp_path / "out.pt", weights_only=True)
    assert (state["rank"], state["step"]) == (1, 2)


# --- export ----------------------------------------------------------------------------------


def test_export_full_puts_a_sharded_version_together(tmp_path: Path, run: Any) -> None:
    from tests.engine.restore.test_elastic import global_bias, global_weight, save_versions

    save_versions(tmp_path, 4, range(2))  # DTensors sharded over 4 ranks, plus plain leaves
    durable = tmp_path / "durable" / "job"
    ran = run("export", durable, tmp_path / "out", "--full", "--format", "pt", "--json")
    assert ran.code == EXIT_OK, ran.err
    assert (ran.json()["rank"], ran.json()["full"]) == (None, True)
    state = torch.load(tmp_path / "out.pt", weights_only=True)
    assert torch.equal(state["w"], global_weight(1))  # 11 rows from 4 ranks' 3 + 3 + 3 + 2
    assert torch.equal(state["b"], global_bias(1))
    assert state["step"] == 1
    _assert_one_line_error(run("export", durable, tmp_path / "x", "--full", "--rank", "0"))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_export_dcp_writes_a_folder_dcp_loads_anywhere(tmp_path: Path, run: Any) -> None:
    """``--format dcp`` of a version sharded over 4 ranks: a DCP folder that DCP alone loads into
    full tensors of one process, bit for bit; an existing folder is replaced only with
    --force."""
    import torch.distributed.checkpoint as dcp

    from tests.engine.restore.test_elastic import global_bias, global_weight, save_versions

    save_versions(tmp_path, 4, range(2))
    durable = tmp_path / "durable" / "job"
    out = tmp_path / "exported"
    ran = run("export", durable, out, "--full", "--format", "dcp", "--json")
    assert ran.code == EXIT_OK, ran.err
    assert [f["format"] for f in ran.json()["files"]] == ["dcp"]
    state = {"w": torch.zeros(11, 6), "b": torch.zeros(5, dtype=torch.float64), "step": -1}
    dcp.load(state, checkpoint_id=out, no_dist=True)
    assert torch.equal(state["w"], global_weight(1))
    assert torch.equal(state["b"], global_bias(1))
    assert state["step"] == 1
    _assert_one_line_error(run("export", durable, out, "--full", "--format", "dcp"))
    ran = run("export", durable, out, "--full", "--format", "dcp", "--version", "0", "--force")
    assert ran.code == EXIT_OK, ran.err
    dcp.load(state, checkpoint_id=out, no_dist=True)
    assert torch.equal(state["w"], global_weight(0))
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_export_hf_of_a_bare_state_dict_says_what_it_left_out(tmp_path: Path, run: Any) -> None:
    """A state that is a mapping of names to tensors is the model: one safetensors file when
    it fits, with no index; what is not a tensor, and the missing config, are named."""
    from safetensors.torch import load_file

    from tests.engine.restore.test_elastic import global_bias, global_weight, save_versions
    from tiercheck.catalog.hf import hf_model
    from tiercheck.errors import StateMismatch

    save_versions(tmp_path, 4, range(2))
    out = tmp_path / "hf"
    ran = run("export", tmp_path / "durable" / "job", out, "--full", "--format", "hf", "--json")
    assert ran.code == EXIT_OK, ran.err
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    tensors = load_file(out / "model.safetensors")
    assert torch.equal(tensors["w"], global_weight(1))
    assert torch.equal(tensors["b"], global_bias(1))
    warnings = " ".join(ran.json()["warnings"])
    assert "step: not a tensor (int); left out" in warnings
    assert "config.json" in warnings
    assert out.stat().st_mode & 0o777 == 0o700
    assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o600
    _assert_one_line_error(
        run("export", tmp_path / "durable" / "job", out, "--full", "--format", "hf")
    )
    _assert_one_line_error(
        run("export", tmp_path / "durable" / "job", tmp_path / "x", "--full", "--dtype", "bf16")
    )
    with pytest.raises(StateMismatch, match="holds no model"):
        hf_model({"step": 3, "note": "no tensors"})


def test_ls_counts_each_version_against_the_world_that_saved_it(tmp_path: Path, run: Any) -> None:
    from tests.engine.restore.test_elastic import go_on, save_versions

    save_versions(tmp_path, 4, range(2))
    go_on(tmp_path, 2, 2)  # restored on 2 ranks, version 2 saved by 2
    for where in (["--local-root", tmp_path / "node"], [tmp_path / "durable" / "job"]):
        ran = run("ls", *where, "--json")
        assert ran.code == EXIT_OK, ran.err
        (found,) = ran.json()["locations"]
        expected = {v["version"]: v["expected_ranks"] for v in found["versions"]}
        # The memory tier keeps 2 versions, the persistent tier 3.
        keep = 2 if where[0] == "--local-root" else 3
        assert expected == {v: [0, 1, 2, 3] if v < 2 else [0, 1] for v in range(3 - keep, 3)}
        assert all(v["complete"] for v in found["versions"])


@pytest.mark.parametrize("version", [3, 4])  # a base and a delta against it
def test_export_round_trips_bit_for_bit(
    stored: Stored, run: Any, tmp_path: Path, version: int
) -> None:
    from safetensors import safe_open

    out = tmp_path / "out" / "model"
    ran = run("export", stored.job, out, "--version", version, "--json")
    assert ran.code == EXIT_OK
    assert {f["format"] for f in ran.json()["files"]} == {"pt", "safetensors"}
    saved = stored.states[version]

    loaded = torch.load(out.with_suffix(".pt"), weights_only=True)
    assert_state_equal(loaded, saved)

    with safe_open(str(out.with_suffix(".safetensors")), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 -- not a dict
        metadata = f.metadata()
    for name, tensor in saved["model"].items():
        assert_state_equal(tensors[f"model.{name}"], tensor)
    for index, slot in saved["optim"]["state"].items():
        for name, tensor in slot.items():
            assert_state_equal(tensors[f"optim.state.{index}.{name}"], tensor)
    assert json.loads(metadata["steps"]) == saved["steps"]
    groups = json.loads(metadata["optim.param_groups"])
    assert groups[0]["lr"] == saved["optim"]["param_groups"][0]["lr"]
    assert json.loads(metadata["tiercheck"])["version"] == version


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o277])
def test_exported_files_are_private_whatever_the_umask(
    stored: Stored, run: Any, tmp_path: Path, umask: int
) -> None:
    previous = os.umask(umask)
    try:
        ran = run("export", stored.job, tmp_path / "out" / "model", "--json")
    finally:
        os.umask(previous)
    assert ran.code == EXIT_OK
    modes = {f["format"]: stat.S_IMODE(os.stat(f["path"]).st_mode) for f in ran.json()["files"]}
    assert modes == {"pt": EXPORT_MODE, "safetensors": EXPORT_MODE}
    assert EXPORT_MODE == 0o600  # owner only, as the local tier keeps its blobs
    # No temporary file left beside them.
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "model.pt",
        "model.safetensors",
    ]


def test_export_defaults_to_the_newest_committed_version(
    stored: Stored, run: Any, tmp_path: Path
) -> None:
    ran = run("export", stored.node, tmp_path / "x.pt", "--format", "pt", "--json")
    assert ran.code == EXIT_OK
    assert ran.json()["version"] == VERSIONS - 1
    assert [f["path"] for f in ran.json()["files"]] == [str(tmp_path / "x.pt")]
    assert_state_equal(
        torch.load(tmp_path / "x.pt", weights_only=True), stored.states[VERSIONS - 1]
    )


def test_export_with_local_root(stored: Stored, run: Any, tmp_path: Path) -> None:
    ran = run(
        "export",
        "--local-root",
        stored.node,
        tmp_path / "y",
        "--version",
        6,
        "--format",
        "safetensors",
    )
    assert ran.code == EXIT_OK
    assert (tmp_path / "y.safetensors").is_file()
    assert not (tmp_path / "y.pt").exists()


def test_export_refuses_to_overwrite_and_unknown_versions(
    stored: Stored, run: Any, tmp_path: Path
) -> None:
    out = tmp_path / "z"
    assert run("export", stored.job, out, "--format", "pt").code == EXIT_OK
    _assert_one_line_error(run("export", stored.job, out, "--format", "pt"))
    assert run("export", stored.job, out, "--format", "pt", "--force").code == EXIT_OK
    _assert_one_line_error(run("export", stored.job, tmp_path / "w", "--version", 99))
    _assert_one_line_error(run("export", stored.job, tmp_path / "w", "--rank", 3))


def test_export_of_a_corrupt_blob_fails(stored: Stored, run: Any, tmp_path: Path) -> None:
    _flip_bit(stored.blob(3))  # the base of version 4
    ran = run("export", stored.job, tmp_path / "bad", "--version", 4)
    assert ran.code == EXIT_PROBLEMS
    assert "Traceback" not in ran.err
    assert not list(tmp_path.glob("bad*"))


def test_safetensors_layout_of_unusual_leaves() -> None:
    state = {
        "a.b": torch.ones(2),
        "a": {"b": torch.zeros(2)},  # the same dotted name: subscript keys for all
        "c128": torch.arange(3, dtype=torch.float64).to(torch.complex128),
        "np": np.arange(4, dtype=np.int32),
        "raw": b"bytes",
        "empty": {},
        "n": np.float64(1.5),
    }
    tensors, metadata, warnings = safetensors_payload(state, meta={"version": 1})
    info = json.loads(metadata["tiercheck"])
    assert info["keys"] == "subscript"
    assert set(tensors) == {"['a.b']", "['a']['b']", "['c128']", "['np']"}
    assert info["raw_dtypes"] == {"['c128']": ["complex128", [3]]}
    restored = tensors["['c128']"].view(torch.complex128).reshape(3)
    assert torch.equal(restored, state["c128"])
    assert torch.equal(tensors["['np']"], torch.arange(4, dtype=torch.int32))
    assert json.loads(metadata["empty"]) == {}
    assert json.loads(metadata["n"]) == 1.5
    assert "raw" not in metadata
    assert len(warnings) == 2  # the raw-bytes tensor and the bytes leaf


# --- gc --------------------------------------------------------------------------------------


def _versions_in(folder: Path) -> list[int]:
    return sorted(int(p.name[1:]) for p in folder.glob("v*") if any(p.iterdir()))


def test_gc_keeps_the_newest_and_the_bases_they_need(
    stored: Stored, run: Any, tmp_path: Path
) -> None:
    dry = run("gc", stored.job, "--keep", 3, "--dry-run", "--json")
    assert dry.code == EXIT_OK
    plan = dry.json()
    # 5, 6, 7 kept; 5 is a delta against 3, so 3 stays as well.
    assert (plan["kept"], plan["kept_as_base"]) == ([5, 6, 7], [3])
    assert plan["removed_versions"] == [0, 1, 2, 4]
    assert _versions_in(stored.job) == list(range(VERSIONS))  # a dry run removes nothing

    ran = run("gc", stored.job, "--keep", 3)
    assert ran.code == EXIT_OK
    assert _versions_in(stored.job) == [3, 5, 6, 7]
    assert sorted(p.parent.name for p in stored.job.glob("v*/COMMIT")) == [
        f"v{v:012d}" for v in (3, 5, 6, 7)
    ]
    assert run("verify", stored.job).code == EXIT_OK

    # A fresh node (no local blobs) restores the newest version from what gc left.
    with SyncCheckpointer(
        JOB, local_root=tmp_path / "fresh", persistent=stored.durable.as_uri()
    ) as ckpt:
        restored = ckpt.restore()
    assert restored is not None
    assert restored.version == VERSIONS - 1
    assert_state_equal(restored.state, stored.states[VERSIONS - 1])


def test_gc_of_a_node_root_logs_its_evictions(stored: Stored, run: Any, tmp_path: Path) -> None:
    ran = run("gc", stored.node, "--keep", 1, "--json")
    assert ran.code == EXIT_OK
    assert ran.json()["removed_versions"] == [5, 6]
    assert _versions_in(stored.node / "blobs") == [7]
    with Manifest(stored.node / "manifest") as manifest:
        assert [d.version for d in manifest.blobs(LOCAL_TIER)] == [7]
        assert manifest.committed(LOCAL_TIER) == [7]
    # The job's own durable location: memory is restored only as the run it belongs to.
    with SyncCheckpointer(JOB, local_root=stored.node, persistent=stored.durable.as_uri()) as ckpt:
        restored = ckpt.restore()
    assert restored is not None
    assert (restored.version, restored.source_tier) == (7, "local")
    assert_state_equal(restored.state, stored.states[7])


def test_gc_leaves_versions_newer_than_the_newest_committed(stored: Stored, run: Any) -> None:
    (stored.job / commit_key(7)).unlink()  # version 7 may still be in flight
    ran = run("gc", stored.job, "--keep", 1, "--json")
    assert ran.code == EXIT_OK
    assert (ran.json()["kept"], ran.json()["in_flight"]) == ([6], [7])
    assert _versions_in(stored.job) == [6, 7]


def test_gc_removes_commit_records_before_blobs(stored: Stored) -> None:
    order: list[str] = []

    async def go() -> None:
        location = Location("persistent", str(stored.job), JOB)
        async with OpenLocation(location) as opened:
            catalog = await opened.scan()
            plan = await plan_gc(opened, catalog, 2)
            delete = opened.tier.delete

            async def recording(key: str) -> None:
                order.append(key)
                await delete(key)

            opened.tier.delete = recording  # type: ignore[method-assign]
            await apply_gc(opened, plan)

    asyncio.run(go())
    commits = [i for i, k in enumerate(order) if k.endswith("COMMIT")]
    blobs = [i for i, k in enumerate(order) if not k.endswith("COMMIT")]
    assert commits
    assert blobs
    assert max(commits) < min(blobs)


def test_gc_removes_torn_versions_but_keeps_bases(tmp_path: Path, run: Any) -> None:
    job = tmp_path / "ranks"
    _two_rank_job(job, committed={0, 2}, torn={1: 0})  # 1 torn by a crash; 2 is a delta on 0
    ran = run("gc", job, "--keep", 1, "--json")
    assert ran.code == EXIT_OK
    assert (ran.json()["kept"], ran.json()["kept_as_base"]) == ([2], [0])
    assert ran.json()["blob_keys"] == [blob_key(1, 0, "packed")]
    assert _versions_in(job) == [0, 2]
    assert run("verify", job).code == EXIT_OK


def test_gc_needs_a_positive_keep(stored: Stored, run: Any) -> None:
    assert run("gc", stored.job, "--keep", 0).code == EXIT_USAGE
    assert run("gc", stored.job).code == EXIT_USAGE


# --- job record, writer generations, quarantine, probes --------------------------------------

INCARNATION = "5f3a9c0e1d2b4a6f8e7d6c5b4a3f2e1d"  # a job record's random token


@dataclass(frozen=True)
class Extras:
    """What :func:`_add_records` put into a job folder beside the checkpointer's own keys."""

    generations: list[int]  # every writer generation now stored, ascending
    quarantined: str  # the quarantine key
    original: str  # the key it was set aside from
    probe: str

    @property
    def newest(self) -> int:
        return self.generations[-1]


def _keys(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


def _corrupt_copy(source: Path, target: Path) -> None:
    """Set ``source`` aside at ``target`` as a restore would after it failed its checksum."""
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)
    _flip_bit(target)


def _why_corrupt(path: Path) -> str:
    """The name of the error the codec raises for the blob at ``path``."""
    with pytest.raises(TiercheckError) as failed:
        verify_blob(path.read_bytes())
    return type(failed.value).__name__


def _add_records(
    stored: Stored, *, world_size: int = 1, quarantine_version: int = 2, move: bool = False
) -> Extras:
    """A job record, two more writer generations, a quarantined blob and a leftover probe.

    The quarantined copy is ``quarantine_version``'s blob with a flipped bit; with ``move`` the
    original is removed, as when a restore set the only copy aside.
    """
    job = stored.job
    (job / JOB_KEY).write_bytes(
        JobRecord(job_id=JOB, token=INCARNATION, world_size=world_size, created=1.0e9).to_bytes()
    )
    # A checkpointer that writes its own generations may have left some: add two beyond them.
    own = [g for k in _keys(job) if (g := parse_writer_key(k)) is not None]
    first = max(own, default=0) + 1
    for generation in (first, first + 1):
        path = job / writer_key(generation)
        path.parent.mkdir(parents=True, exist_ok=True)
        record = WriterRecord(generation, f"session-{generation}", "host-a", 4242, 1.0e9)
        path.write_bytes(record.to_bytes())
    original = blob_key(quarantine_version, 0, "packed")
    quarantined = quarantine_key(original)
    _corrupt_copy(job / original, job / quarantined)
    if move:
        (job / original).unlink()
    probe = probe_key("crashed-session", 0)
    (job / probe).parent.mkdir(parents=True, exist_ok=True)
    (job / probe).write_bytes(b"probe")
    return Extras(sorted([*own, first, first + 1]), quarantined, original, probe)


def _findings(ran: Ran) -> list[dict[str, Any]]:
    (report,) = ran.json()["reports"]
    findings: list[dict[str, Any]] = report["findings"]
    return findings


def test_ls_shows_the_job_record_writers_and_quarantine(stored: Stored, run: Any) -> None:
    extras = _add_records(stored)
    ran = run("ls", stored.job, "--json")
    assert ran.code == EXIT_OK
    (loc,) = ran.json()["locations"]
    assert [v["version"] for v in loc["versions"]] == list(range(VERSIONS))
    assert loc["ranks"] == [0]
    record = loc["job_record"]
    assert (record["job_id"], record["token"], record["world_size"]) == (JOB, INCARNATION, 1)
    assert loc["job_record_error"] is None
    writers = loc["writers"]
    assert writers["count"] == len(extras.generations)
    assert writers["newest"]["generation"] == extras.newest
    assert writers["newest"]["session"] == f"session-{extras.newest}"
    assert writers["error"] is None
    (aside,) = loc["quarantined"]
    assert aside == {
        "key": extras.quarantined,
        "original": extras.original,
        "version": 2,
        "rank": 0,
        "size": (stored.job / extras.quarantined).stat().st_size,
    }
    assert loc["probes"] == [extras.probe]

    human = run("ls", stored.job)
    assert human.code == EXIT_OK
    header = human.out.splitlines()[0]
    assert f"world size 1, incarnation {INCARNATION[:8]}" in header
    assert INCARNATION not in header  # the short form only
    assert f"writer generation {extras.newest}" in header
    assert "1 quarantined blob" in header
    assert "1 leftover probe" in header


def test_ls_without_records_shows_none(stored: Stored, run: Any) -> None:
    for key in [k for k in _keys(stored.job) if k == JOB_KEY or k.startswith("writers/")]:
        (stored.job / key).unlink()  # a job written before job records existed
    (loc,) = run("ls", stored.job, "--json").json()["locations"]
    assert loc["job_record"] is None
    assert loc["writers"] == {"count": 0, "newest": None, "error": None}
    assert loc["quarantined"] == []
    human = run("ls", stored.job)
    assert "incarnation" not in human.out
    assert "quarantined" not in human.out


def test_quarantine_folders_are_not_taken_for_jobs(stored: Stored, run: Any) -> None:
    extras = _add_records(stored)
    node_original = stored.blob(6, "local")
    _corrupt_copy(node_original, stored.node / "blobs" / quarantine_key(blob_key(6, 0, "full")))
    for target in (stored.root, stored.durable, stored.durable.as_uri()):
        ran = run("ls", target, "--json")
        assert ran.code == EXIT_OK
        found = sorted((loc["tier"], loc["job"]) for loc in ran.json()["locations"])
        expected = [("persistent", JOB)] if "durable" in str(target) else None
        assert found == (expected or [("local", JOB), ("persistent", JOB)])
    by_tier = {loc["tier"]: loc for loc in run("ls", stored.root, "--json").json()["locations"]}
    assert [q["key"] for q in by_tier["persistent"]["quarantined"]] == [extras.quarantined]
    assert [q["original"] for q in by_tier["local"]["quarantined"]] == [blob_key(6, 0, "full")]


def test_verify_reports_quarantined_blobs_and_probes_as_warnings(stored: Stored, run: Any) -> None:
    extras = _add_records(stored)
    ran = run("verify", stored.job, "--json")
    assert ran.code == EXIT_OK, ran.out
    assert ran.json()["ok"] is True
    findings = _findings(ran)
    assert {f["severity"] for f in findings} == {"warning"}
    by_code = {f["code"]: f for f in findings}
    assert sorted(by_code) == ["probe-leftover", "quarantined"]
    aside = by_code["quarantined"]
    assert (aside["key"], aside["version"], aside["rank"]) == (extras.quarantined, 2, 0)
    why = _why_corrupt(stored.job / extras.quarantined)
    assert why in aside["message"]
    assert "version 2 was not restored from it" in aside["message"]
    assert f"{extras.original} holds a blob again" in aside["message"]
    assert "--purge-quarantine" in aside["message"]
    assert by_code["probe-leftover"]["key"] == extras.probe
    # --version narrows the quarantine findings to that version's.
    other = run("verify", stored.job, "--version", 3, "--json")
    assert other.code == EXIT_OK
    assert [f["code"] for f in _findings(other)] == ["probe-leftover"]

    human = run("verify", stored.job)
    assert human.code == EXIT_OK
    assert f"warning  quarantined         {extras.quarantined}:" in human.out
    assert "ok: 0 problems, 2 warnings" in human.out


def test_verify_a_blob_moved_to_quarantine(stored: Stored, run: Any) -> None:
    extras = _add_records(stored, quarantine_version=7, move=True)
    ran = run("verify", stored.job, "--json")
    assert ran.code == EXIT_PROBLEMS
    codes = {(f["severity"], f["code"], f["version"]) for f in _findings(ran)}
    assert codes == {
        ("problem", "torn-committed", 7),
        ("warning", "quarantined", 7),
        ("warning", "probe-leftover", None),
    }
    aside = next(f for f in _findings(ran) if f["code"] == "quarantined")
    assert aside["key"] == extras.quarantined
    assert "holds a blob again" not in aside["message"]
    torn = next(f for f in _findings(ran) if f["code"] == "torn-committed")
    assert f"a restore set it aside as {extras.quarantined}" in torn["message"]


def test_verify_a_job_record_that_disagrees_with_the_newest_commit(
    stored: Stored, run: Any
) -> None:
    _add_records(stored, world_size=2)
    ran = run("verify", stored.job, "--json")
    assert ran.code == EXIT_PROBLEMS
    problems = [f for f in _findings(ran) if f["severity"] == "problem"]
    assert [(f["code"], f["key"], f["version"]) for f in problems] == [
        ("job-record-mismatch", JOB_KEY, VERSIONS - 1)
    ]
    assert "world size 2 != 1" in problems[0]["message"]
    assert "job-record-mismatch" in run("verify", stored.job).out


@pytest.mark.parametrize("which", ["job", "writer"])
def test_verify_an_unreadable_record(stored: Stored, run: Any, which: str) -> None:
    extras = _add_records(stored)
    key = JOB_KEY if which == "job" else writer_key(extras.newest)
    (stored.job / key).write_text("{not json")
    ls = run("ls", stored.job, "--json")
    assert ls.code == EXIT_OK
    (loc,) = ls.json()["locations"]
    if which == "job":
        assert loc["job_record"] is None
        assert "FormatError" in loc["job_record_error"]
        assert "job record unreadable" in run("ls", stored.job).out
    else:
        assert loc["writers"]["newest"] is None
        assert loc["writers"]["count"] == len(extras.generations)
        assert "FormatError" in loc["writers"]["error"]
    ran = run("verify", stored.job, "--json")
    assert ran.code == EXIT_PROBLEMS
    problems = [f for f in _findings(ran) if f["severity"] == "problem"]
    assert [(f["code"], f["key"]) for f in problems] == [("record-unreadable", key)]


def test_a_job_opened_without_saving_is_listed(tmp_path: Path, run: Any) -> None:
    job = tmp_path / "ckpt" / "fresh"
    (job / "writers").mkdir(parents=True)
    (job / JOB_KEY).write_bytes(JobRecord("fresh", INCARNATION, 4).to_bytes())
    (job / writer_key(1)).write_bytes(WriterRecord(1, "s").to_bytes())
    ran = run("ls", tmp_path / "ckpt", "--json")
    assert ran.code == EXIT_OK
    (loc,) = ran.json()["locations"]
    assert (loc["job"], loc["versions"], loc["job_record"]["world_size"]) == ("fresh", [], 4)
    assert "(no versions)" in run("ls", job).out
    # A lone file named JOB is nobody's job folder.
    (job / writer_key(1)).unlink()
    _assert_one_line_error(run("ls", tmp_path / "ckpt"))


def test_inspect_and_export_ignore_the_new_keys(stored: Stored, run: Any, tmp_path: Path) -> None:
    _add_records(stored, quarantine_version=VERSIONS - 1)
    ran = run("inspect", stored.job, "--json")
    assert ran.code == EXIT_OK
    doc = ran.json()
    assert [v["version"] for v in doc["versions"]] == list(range(VERSIONS))
    keys = [b["key"] for v in doc["versions"] for b in v["blobs"]]
    assert keys == [blob_key(v, 0, "packed") for v in range(VERSIONS)]
    assert doc["errors"] == {}
    assert run("inspect", stored.job).code == EXIT_OK
    out = run("export", stored.job, tmp_path / "m", "--format", "pt", "--json")
    assert out.code == EXIT_OK
    assert out.json()["version"] == VERSIONS - 1  # the intact original, not the quarantined copy
    assert_state_equal(
        torch.load(tmp_path / "m.pt", weights_only=True), stored.states[VERSIONS - 1]
    )


def test_gc_keeps_records_and_quarantine_unless_purged(stored: Stored, run: Any) -> None:
    extras = _add_records(stored, quarantine_version=1)
    records = {JOB_KEY, extras.probe, *(writer_key(g) for g in extras.generations)}

    dry = run("gc", stored.job, "--keep", 3, "--dry-run", "--json")
    assert dry.code == EXIT_OK
    plan = dry.json()
    assert (plan["quarantine_kept"], plan["quarantine_keys"]) == ([extras.quarantined], [])
    assert plan["purge_quarantine"] is False
    dry_text = run("gc", stored.job, "--keep", 3, "--dry-run")
    assert "keeping 1 quarantined blob" in dry_text.out
    assert f"    {extras.quarantined}" in dry_text.out
    before = _keys(stored.job)
    assert run("gc", stored.job, "--keep", 3, "--purge-quarantine", "--dry-run").code == EXIT_OK
    assert _keys(stored.job) == before  # dry runs remove nothing

    ran = run("gc", stored.job, "--keep", 3)
    assert ran.code == EXIT_OK
    assert _versions_in(stored.job) == [3, 5, 6, 7]
    left = _keys(stored.job)
    assert records | {extras.quarantined} <= left

    purge_dry = run("gc", stored.job, "--keep", 3, "--purge-quarantine", "--dry-run", "--json")
    assert purge_dry.json()["quarantine_keys"] == [extras.quarantined]
    assert purge_dry.json()["quarantine_kept"] == []
    purge_text = run("gc", stored.job, "--keep", 3, "--purge-quarantine", "--dry-run")
    assert "would remove 1 quarantined blob" in purge_text.out
    assert f"    {extras.quarantined}" in purge_text.out
    assert _keys(stored.job) == left

    purged = run("gc", stored.job, "--keep", 3, "--purge-quarantine")
    assert purged.code == EXIT_OK
    assert "removed 1 quarantined blob" in purged.out
    assert _keys(stored.job) == left - {extras.quarantined}
    assert records <= _keys(stored.job)
    verified = run("verify", stored.job, "--json")
    assert verified.code == EXIT_OK
    assert [f["code"] for f in _findings(verified)] == ["probe-leftover"]


def test_a_node_root_with_identity_locks_and_quarantine(stored: Stored, run: Any) -> None:
    identity = NodeIdentity(JOB, INCARNATION, 1, persistent=stored.durable.as_uri(), created=1.0e9)
    (stored.node / IDENTITY_FILE).write_bytes(identity.to_bytes())
    (stored.node / LOCKS_DIR).mkdir(exist_ok=True)
    (stored.node / LOCKS_DIR / "r00000.lock").write_text("4242")
    original = blob_key(5, 0, "full")
    aside = quarantine_key(original)
    _corrupt_copy(stored.node / "blobs" / original, stored.node / "blobs" / aside)

    ls = run("ls", stored.node, "--json")
    assert ls.code == EXIT_OK
    (loc,) = ls.json()["locations"]
    assert [v["version"] for v in loc["versions"]] == [5, 6, 7]
    assert (loc["identity"]["token"], loc["identity"]["world_size"]) == (INCARNATION, 1)
    assert [q["key"] for q in loc["quarantined"]] == [aside]
    assert f"incarnation {INCARNATION[:8]}" in run("ls", stored.node).out

    ran = run("verify", stored.node, "--json")
    assert ran.code == EXIT_OK
    (finding,) = _findings(ran)
    assert (finding["code"], finding["key"], finding["version"]) == ("quarantined", aside, 5)
    assert _why_corrupt(stored.node / "blobs" / aside) in finding["message"]

    assert run("gc", stored.node, "--keep", 1).code == EXIT_OK
    assert _versions_in(stored.node / "blobs") == [7]
    assert (stored.node / "blobs" / aside).is_file()
    assert run("gc", stored.node, "--keep", 1, "--purge-quarantine").code == EXIT_OK
    assert not (stored.node / "blobs" / aside).exists()
    assert NodeIdentity.from_bytes((stored.node / IDENTITY_FILE).read_bytes()) == identity
    assert (stored.node / LOCKS_DIR / "r00000.lock").read_text() == "4242"

    (stored.node / IDENTITY_FILE).write_text("[]")
    broken = run("verify", stored.node, "--json")
    assert broken.code == EXIT_PROBLEMS
    assert [(f["code"], f["key"]) for f in _findings(broken)] == [
        ("record-unreadable", IDENTITY_FILE)
    ]


# --- replicas a node keeps for its peers -----------------------------------------------------


def _hold_replicas(stored: Stored, rank: int, versions: list[int]) -> int:
    """Lay out in the node root what the peer tier keeps there for ``rank`` of another node:
    ``replicas/<job>/r<rank>/<that rank's key>``; returns the bytes written."""
    size = 0
    for v in versions:
        data = stored.blob(v).read_bytes()  # a real blob; only the key names matter here
        target = NodeRoot(stored.node).replicas / JOB / f"r{rank:05d}" / blob_key(v, rank, "packed")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        size += len(data)
    return size


def test_peer_replicas_are_listed_with_their_node_root_never_as_jobs(
    stored: Stored, run: Any
) -> None:
    size = _hold_replicas(stored, rank=1, versions=[5, 6, 7])
    ls = run("ls", stored.root, "--json")
    assert ls.code == EXIT_OK
    locations = ls.json()["locations"]
    assert {(loc["tier"], loc["job"]) for loc in locations} == {
        ("local", JOB),
        ("persistent", JOB),
    }
    node = next(loc for loc in locations if loc["tier"] == "local")
    assert node["replicas"] == [
        {"job": JOB, "rank": 1, "versions": [5, 6, 7], "blobs": 3, "size": size}
    ]
    assert [v["version"] for v in node["versions"]] == [5, 6, 7]  # its own blobs only
    human = run("ls", stored.node).out
    assert "peer replicas held for rank 1 of job 'job': versions 5, 6, 7" in human

    verified = run("verify", stored.root, "--json")
    assert verified.code == EXIT_OK
    assert [r["job"] for r in verified.json()["reports"]] == [JOB, JOB]
    assert all(not r["findings"] for r in verified.json()["reports"])


def test_replicas_outside_a_node_root_are_named_as_such(tmp_path: Path) -> None:
    folder = tmp_path / "copied" / "replicas" / JOB / "r00002"
    (folder / blob_key(3, 2, "packed")).parent.mkdir(parents=True)
    (folder / blob_key(3, 2, "packed")).write_bytes(b"x")
    with pytest.raises(LocationError, match="peer replicas"):
        asyncio.run(find_locations(str(tmp_path / "copied")))


# --- rm-job ----------------------------------------------------------------------------------


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def test_rm_job_lists_everything_and_deletes_nothing_unconfirmed(stored: Stored, run: Any) -> None:
    before = _files(stored.root)
    dry = run("rm-job", stored.root, "--job", JOB, "--dry-run", "--json")
    assert dry.code == EXIT_OK
    doc = dry.json()
    assert (doc["job"], doc["dry_run"], doc["deleted"]) == (JOB, True, False)
    plans = {p["tier"]: p for p in doc["locations"]}
    assert sorted(plans) == ["local", "persistent"]
    assert plans["persistent"]["versions"] == list(range(VERSIONS))
    assert plans["persistent"]["commit_records"] == VERSIONS
    assert JOB_KEY in plans["persistent"]["records"]
    assert plans["persistent"]["liveness"] == "unknown"
    assert plans["local"]["versions"] == [5, 6, 7]
    assert plans["local"]["liveness"] == "checked"
    human = run("rm-job", stored.root, "--job", JOB, "--dry-run")
    assert human.code == EXIT_OK
    assert "cannot tell whether a run is writing there" in human.out
    assert "no writer holds the job's lock on this node now" in human.out

    unconfirmed = run("rm-job", stored.root, "--job", JOB)  # no terminal to ask on
    assert unconfirmed.code == EXIT_USAGE
    assert "--yes" in unconfirmed.err
    assert run("rm-job", stored.root, "--job", JOB, "--json").code == EXIT_USAGE
    assert _files(stored.root) == before


def test_rm_job_deletes_the_job_everywhere_and_nothing_else(stored: Stored, run: Any) -> None:
    shutil.copytree(stored.job, stored.durable / "other")
    (stored.job / "notes.txt").write_text("mine")  # not tiercheck's: left alone
    _hold_replicas(stored, rank=1, versions=[6, 7])
    others = _files(stored.durable / "other")
    ran = run("rm-job", stored.root, "--job", JOB, "--yes", "--json")
    assert ran.code == EXIT_OK
    assert ran.json()["deleted"] is True
    assert not stored.node.exists()
    # The tombstone stays: memory of the deleted incarnation is never restored.
    assert _files(stored.job) == {"notes.txt", TOMBSTONE_KEY}
    assert _files(stored.durable / "other") == others
    left = run("ls", stored.root, "--json")
    listed = {(loc["tier"], loc["job"]): loc for loc in left.json()["locations"]}
    assert sorted(listed) == [("persistent", "job"), ("persistent", "other")]
    deleted = listed[("persistent", "job")]
    assert deleted["versions"] == []
    assert deleted["job_record"] is None
    assert deleted["tombstone"]["tokens"] == [plans_token(ran)]
    assert "deleted by `tiercheck rm-job`" in run("ls", stored.job).out


def plans_token(ran: Ran) -> str:
    """The incarnation an rm-job run deleted (from its persistent plan)."""
    (plan,) = [p for p in ran.json()["locations"] if p["tier"] == "persistent"]
    (token,) = plan["incarnations"]
    return str(token)


def test_rm_job_refuses_while_a_writer_holds_the_lock(stored: Stored, run: Any) -> None:
    with SyncCheckpointer(
        JOB, local_root=stored.node, persistent=stored.durable.as_uri(), base_every=BASE_EVERY
    ):
        before = _files(stored.root)
        ran = run("rm-job", stored.root, "--job", JOB, "--yes", "--json")
        assert ran.code == EXIT_PROBLEMS
        assert ran.json()["error"]["type"] == "JobLocked"
        assert "nothing was deleted" in ran.json()["error"]["message"]
        assert _files(stored.root) == before  # neither the node root nor the persistent job
    assert run("rm-job", stored.root, "--job", JOB, "--yes").code == EXIT_OK
    assert not stored.node.exists()
    assert _files(stored.job) == {TOMBSTONE_KEY}


def test_rm_job_asks_on_a_terminal(stored: Stored) -> None:
    def answer(text: str) -> subprocess.CompletedProcess[str]:
        primary, secondary = os.openpty()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tiercheck", "rm-job", str(stored.job), "--job", JOB],
                stdin=secondary,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            os.write(primary, text.encode() + b"\n")
            out, err = proc.communicate(timeout=120)
        finally:
            os.close(secondary)
            os.close(primary)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    kept = answer("yes")  # not the job's name
    assert kept.returncode == EXIT_PROBLEMS, kept.stderr
    assert "type the job's name" in kept.stderr
    assert "nothing was deleted" in kept.stdout
    assert stored.job.is_dir()
    deleted = answer(JOB)
    assert deleted.returncode == EXIT_OK, deleted.stderr
    assert _files(stored.job) == {TOMBSTONE_KEY}
    assert stored.node.is_dir()  # the location named was the job folder only


def test_rm_job_needs_the_job_and_the_location_named(stored: Stored, run: Any) -> None:
    before = _files(stored.root)
    _assert_one_line_error(run("rm-job", stored.root, "--yes"))  # no --job
    _assert_one_line_error(run("rm-job", "--job", JOB, "--yes"))  # no location
    wrong = run("rm-job", "--local-root", stored.node, "--job", "other", "--yes")
    _assert_one_line_error(wrong)
    assert "belongs to job 'job'" in wrong.err
    _assert_one_line_error(run("rm-job", stored.durable, "--job", "no-such-job", "--yes"))
    assert _files(stored.root) == before


def test_rm_job_of_a_remote_location(run: Any, tmp_path: Path) -> None:
    import fsspec

    url = "memory://tiercheck-rm-job-test"
    try:
        with SyncCheckpointer(JOB, local_root=tmp_path / "shm", persistent=url) as ckpt:
            ckpt.save(0, {"w": torch.ones(4)})
            ckpt.wait()
        ran = run("rm-job", url, "--job", JOB, "--yes")
        assert ran.code == EXIT_OK, ran.err
        assert "cannot tell whether a run is writing there" in ran.out
        left = fsspec.filesystem("memory").find(f"/tiercheck-rm-job-test/{JOB}")
        assert left == [f"/tiercheck-rm-job-test/{JOB}/{TOMBSTONE_KEY}"]
    finally:
        memory = fsspec.filesystem("memory")
        if memory.exists("/tiercheck-rm-job-test"):
            memory.rm("/tiercheck-rm-job-test", recursive=True)


# --- errors, json, hooks ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["ls", "{tmp}/missing"],
        ["ls", "nope-protocol://bucket/x"],
        ["ls", "{tmp}/empty"],
        ["ls", "{tmp}/a-file"],
        ["verify", "{store}/durable", "--job", "no-such-job"],
        ["inspect", "{store}"],  # two locations: pick one
        ["inspect", "--local-root", "{tmp}/empty"],
        ["verify", "{store}/durable", "--storage-options", "not json"],
        ["export", "{store}/durable/job"],
        ["verify"],
    ],
)
def test_wrong_locations_are_one_line_usage_errors(
    stored: Stored, run: Any, tmp_path: Path, argv: list[str]
) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "a-file").write_text("x")
    args = [a.format(tmp=tmp_path, store=stored.root) for a in argv]
    _assert_one_line_error(run(*args))
    as_json = run(*args, "--json")
    assert as_json.code == EXIT_USAGE
    assert as_json.json()["error"]["exit_code"] == EXIT_USAGE


@pytest.mark.parametrize(
    "argv",
    [
        ["ls", "{job}"],
        ["inspect", "{job}", "--version", "1"],
        ["verify", "{job}"],
        ["export", "{job}", "{tmp}/out", "--format", "pt"],
        ["gc", "{job}", "--keep", "2", "--dry-run"],
    ],
)
def test_every_command_speaks_json(
    stored: Stored, run: Any, tmp_path: Path, argv: list[str]
) -> None:
    args = [a.format(job=stored.job, tmp=tmp_path) for a in argv]
    ran = run(*args, "--json")
    assert ran.code == EXIT_OK
    assert ran.json()["command"] == argv[0]


@pytest.mark.parametrize(
    "argv",
    [
        ["gc", "{job}", "--keep", "0"],  # a value the option refuses
        ["gc", "{job}"],  # a required option missing
        ["ls", "--no-such-option"],
        ["frobnicate"],  # no such command
        [],  # no command at all
    ],
)
def test_usage_errors_under_json_are_json(stored: Stored, run: Any, argv: list[str]) -> None:
    args = [a.format(job=stored.job) for a in argv]
    ran = run("--json", *args)
    assert ran.code == EXIT_USAGE
    error = ran.json()["error"]
    assert (error["type"], error["exit_code"]) == ("UsageError", EXIT_USAGE)
    assert error["message"]
    assert ran.err.count("\n") == 1  # the same message, one line, for people
    assert error["message"] in ran.err
    human = run(*args)
    assert human.code == EXIT_USAGE
    assert human.out == ""
    assert "usage: tiercheck" in human.err


@pytest.mark.parametrize("job", ["victim::x", "a/b", " ", "..\\escape", "x" * 129])
def test_a_job_outside_the_id_grammar_is_a_usage_error(stored: Stored, run: Any, job: str) -> None:
    for json_flag in ([], ["--json"]):
        ran = run("rm-job", stored.durable, "--job", job, "--yes", *json_flag)
        assert ran.code == EXIT_USAGE
        message = ran.json()["error"]["message"] if json_flag else ran.err
        assert "job_id must be 1 to 128 ASCII letters" in message
    assert (stored.job / JOB_KEY).is_file()  # nothing was deleted


def test_version(run: Any) -> None:
    ran = run("--version")
    assert ran.code == EXIT_OK
    assert ran.out.split() == ["tiercheck", tiercheck.__version__]


def test_the_console_script_runs_as_a_process(stored: Stored, tmp_path: Path) -> None:
    ok = subprocess.run(
        [sys.executable, "-m", "tiercheck.cli", "verify", str(stored.job), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert ok.returncode == EXIT_OK, ok.stderr
    assert json.loads(ok.stdout)["ok"] is True
    missing = subprocess.run(
        [sys.executable, "-m", "tiercheck.cli", "ls", str(tmp_path / "nothing-here")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert missing.returncode == EXIT_USAGE
    assert "Traceback" not in missing.stderr
    assert missing.stdout == ""


# --- a reader that goes away -------------------------------------------------------------------


@pytest.fixture(scope="module")
def many_jobs(pristine: Stored, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A persistent folder of 200 real job folders (copies of the module's job): ``ls`` prints
    far more than a pipe holds (64 KiB) plus Python's own buffer (8 KiB)."""
    root = tmp_path_factory.mktemp("many") / "durable"
    for i in range(200):
        shutil.copytree(pristine.job, root / f"job-{i:03d}")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["ls", str(root)]) == EXIT_OK
    # More than the pipe (64 KiB), the reader's buffer and the writer's (8 KiB each) hold: some
    # write must come after the reader has gone (--json prints more than this).
    assert len(out.getvalue()) > 65536 + 2 * 8192
    return root


@pytest.mark.parametrize("json_flag", [[], ["--json"]], ids=["text", "json"])
def test_a_closed_output_pipe_ends_the_command_quietly_with_141(
    many_jobs: Path, json_flag: list[str]
) -> None:
    """``tiercheck ls ROOT | head -1``: once the reader has gone, the command stops with no
    message and no traceback, and exits 141, as a coreutils tool killed by SIGPIPE."""
    with subprocess.Popen(
        [sys.executable, "-m", "tiercheck", "ls", str(many_jobs), *json_flag],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    ) as proc:
        assert proc.stdout is not None
        assert proc.stderr is not None
        first = proc.stdout.readline()
        proc.stdout.close()  # what head does after its line
        err = proc.stderr.read().decode()
        proc.wait(timeout=120)
    assert first.startswith(b"{" if json_flag else b"persistent job 'job-000'")
    assert err == ""
    assert proc.returncode == EXIT_PIPE


class _ClosingStream(io.StringIO):
    """stdout whose reader goes away after ``limit`` characters: that write and every write
    or flush after it fail, as on a pipe."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit
        self.broken = False

    def write(self, text: str) -> int:
        if self.broken or self.tell() + len(text) > self.limit:
            self.broken = True
            raise BrokenPipeError(32, "Broken pipe")
        return super().write(text)

    def flush(self) -> None:
        if self.broken:
            raise BrokenPipeError(32, "Broken pipe")


@pytest.mark.parametrize(
    "argv",
    [
        ["ls", "{root}"],
        ["ls", "{root}", "--json"],
        ["inspect", "{job}"],
        ["inspect", "{job}", "--json"],
        ["verify", "{job}"],
        ["verify", "{job}", "--json"],
        ["gc", "{job}", "--keep", "1", "--dry-run"],
        ["ls", "{nothing}", "--json"],  # the error itself goes to the closed stream
        ["--help"],
    ],
    ids=" ".join,
)
def test_every_command_ends_quietly_when_stdout_closes(
    stored: Stored, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, argv: list[str]
) -> None:
    names = {"root": stored.root, "job": stored.job, "nothing": tmp_path / "nothing"}
    args = [a.format(**names) for a in argv]
    out, err = _ClosingStream(40), io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    assert main(args) == EXIT_PIPE
    assert err.getvalue() == ""


def _fake_demo(argv: list[str]) -> int:
    print("demo", *argv)
    return 3


def test_an_external_command_gets_its_arguments(monkeypatch: pytest.MonkeyPatch, run: Any) -> None:
    demo = ExternalCommand("demo", "the showcase", f"{__name__}:_fake_demo")
    others = [c for c in cli_module.COMMANDS if getattr(c, "name", None) != "demo"]
    monkeypatch.setattr(cli_module, "COMMANDS", [*others, demo])  # stands in for the real one
    ran = run("demo", "--steps", "5")
    assert ran.code == 3
    assert ran.out.split() == ["demo", "--steps", "5"]
    assert "demo" in run("--help").out


def test_progress_bars_draw_on_their_stream() -> None:
    pytest.importorskip("tqdm")
    stream = io.StringIO()
    bar = ProgressBar(True, stream)
    bar.start(3, "testing")
    bar.advance(3)
    bar.finish()
    assert "testing" in stream.getvalue()


# --- object storage --------------------------------------------------------------------------


def test_ls_and_verify_on_s3(s3_server: S3Server, run: Any, tmp_path: Path) -> None:
    url = s3_server.url()
    options = s3_server.storage_options
    trainer = TinyTrainer()
    with SyncCheckpointer(
        JOB,
        tiers=[
            LocalTier(tmp_path / "shm" / "blobs"),
            PersistentTier(f"{url}/{JOB}", storage_options=options),
        ],
        local_root=tmp_path / "shm",
        base_every=2,
        persist="all",
    ) as ckpt:
        for step in range(3):
            trainer.step()
            ckpt.save(step, trainer.state())
        ckpt.wait()
    opts = json.dumps(options)
    ls = run("ls", url, "--storage-options", opts, "--json")
    assert ls.code == EXIT_OK
    (loc,) = ls.json()["locations"]
    assert (loc["job"], [v["kind"] for v in loc["versions"]]) == (JOB, ["base", "delta", "base"])
    assert run("verify", url, "--storage-options", opts).code == EXIT_OK

    key = blob_key(1, 0, "packed")

    async def damage() -> None:
        async with PersistentTier(f"{url}/{JOB}", storage_options=options) as tier:
            data = bytearray(await tier.get(key))
            data[len(data) // 2] ^= 0x01
            await tier.put(key, bytes(data))

    asyncio.run(damage())
    bad = run("verify", url, "--storage-options", opts, "--json")
    assert bad.code == EXIT_PROBLEMS
    keys = [f["key"] for f in bad.json()["reports"][0]["findings"]]
    assert keys == [key]


@pytest.mark.parametrize("per_node", [4, 2])  # 2: rank 2's durable blob refers on to rank 0
def test_export_and_inspect_of_a_rank_that_stored_references(
    tmp_path: Path, run: Any, per_node: int
) -> None:
    from tests.engine.test_replicated import WORLD, model_of, own_of, save

    save(tmp_path, range(2), per_node=per_node)  # each node's first rank stores the model
    durable = tmp_path / "durable" / "job"
    ran = run("inspect", durable, "--version", 1, "--json")
    assert ran.code == EXIT_OK, ran.err
    blobs = {b["rank"]: b for b in ran.json()["versions"][0]["blobs"]}
    assert blobs[0]["replicas_from"] == []
    assert blobs[0]["tensor_count"] == len(model_of(1)) + 1
    for rank in range(1, WORLD):
        # Honest about what the blob holds: its own tensor only, and where the rest is (in
        # the durable tier a node's first rank refers to rank 0, the others to their first).
        leader = rank // per_node * per_node
        refers_to = 0 if rank == leader else leader
        assert (blobs[rank]["tensor_count"], blobs[rank]["replicas_from"]) == (1, [refers_to])
        assert blobs[rank]["stages"][0] == "tiercheck.flatten/3"
    for where in (durable, tmp_path / f"node{WORLD // per_node - 1}"):
        out = tmp_path / f"r3-{where.name}"
        ran = run("export", where, out, "--rank", 3, "--format", "pt", "--json")
        assert ran.code == EXIT_OK, ran.err
        state = torch.load(out.with_name(out.name + ".pt"), weights_only=True)
        assert set(state) == {"model", "own"}
        for key, expected in model_of(1).items():
            assert torch.equal(state["model"][key], expected)
        assert torch.equal(state["own"], own_of(1, 3))
    ran = run("export", durable, tmp_path / "full", "--full", "--format", "pt", "--json")
    assert ran.code == EXIT_OK, ran.err
    state = torch.load(tmp_path / "full.pt", weights_only=True)
    for key, expected in model_of(1).items():
        assert torch.equal(state["model"][key], expected)
