"""What both integrations share: optional imports, checkpoint names, RNG states, sessions."""

from __future__ import annotations

import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tiercheck import ConfigError, VersionError
from tiercheck.integrations import LATEST, RESUME, parse_name, version_name
from tiercheck.integrations._common import Session, capture_rng, restore_rng

FRAMEWORKS = ("lightning", "pytorch_lightning", "transformers", "accelerate")


@pytest.mark.multiprocess
@pytest.mark.parametrize("module", ["tiercheck", "tiercheck.integrations"])
def test_importing_tiercheck_imports_no_framework(module: str) -> None:
    code = (
        f"import sys, {module}\n"
        f"loaded = [m for m in {FRAMEWORKS!r} if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_names() -> None:
    assert parse_name(LATEST) == "latest"
    assert parse_name(version_name(42)) == 42
    assert parse_name("tiercheck:0") == 0
    assert parse_name(Path("tiercheck:7")) == 7
    assert parse_name("checkpoints/epoch=0-step=4.ckpt") is None
    assert parse_name(None) is None


@pytest.mark.parametrize(
    "name",
    [
        "tiercheck:",
        "tiercheck:last",
        "tiercheck:-1",
        "tiercheck:1.5",
        "tiercheck:\u0661\u0662",  # Arabic-Indic digits: int() reads them, a step is ASCII
        "tiercheck:12\n",
        "tiercheck: 12",
        "tiercheck:" + "9" * 13,  # beyond any version's key
    ],
)
def test_malformed_tiercheck_names_are_refused(name: str) -> None:
    with pytest.raises(ConfigError):
        parse_name(name)


@pytest.mark.parametrize("version", [-1, True, 1.0, "3", 10**12])
def test_version_name_refuses_non_versions(version: object) -> None:
    with pytest.raises(ConfigError):
        version_name(version)  # type: ignore[arg-type]


def _draws() -> tuple[float, float, list[float]]:
    return random.random(), float(np.random.random()), torch.rand(3).tolist()


def test_rng_states_survive_a_checkpoint(tmp_path: Path) -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    _draws()  # move away from the seeded states
    session = Session("rng", {"local_root": tmp_path / "shm", "persistent": tmp_path.as_uri()})
    # Padding first: restored tensors are views at non-zero offsets of one payload.
    handle = session.save(5, lambda: {"pad": torch.zeros(3), "rng": capture_rng()})
    assert handle is not None
    expected = _draws()
    handle.result()
    session.close()

    again = Session("rng", {"local_root": tmp_path / "shm", "persistent": tmp_path.as_uri()})
    restored = again.restore("latest")
    assert restored is not None
    _draws()
    restore_rng(restored.state["rng"])
    assert _draws() == expected
    again.close()


def test_a_version_saved_twice_is_stored_once(tmp_path: Path) -> None:
    session = Session("twice", {"local_root": tmp_path / "shm", "persistent": tmp_path.as_uri()})
    first = session.save(3, lambda: {"w": torch.ones(2)})
    assert first is not None
    assert session.save(3, lambda: pytest.fail("a stored version's state is built")) is None
    assert session.last_save is first
    with pytest.raises(VersionError):
        session.save(2, lambda: {"w": torch.ones(2)})
    session.close()


def test_restoring_an_older_version_drops_nothing_until_the_run_saves(tmp_path: Path) -> None:
    options = {"local_root": tmp_path / "shm", "persistent": tmp_path.as_uri(), "persist": "all"}
    session = Session("newest", options)
    for version in (1, 2, 3):
        session.save(version, lambda v=version: {"w": torch.full((2,), float(v))})
    session.close()

    # Evaluating an older version (a load without a save after it) leaves every version.
    look = Session("newest", options)
    older = look.restore(2)
    assert older is not None
    assert older.state["w"].tolist() == [2.0, 2.0]
    look.close()
    again = Session("newest", options)
    newest = again.restore("latest")
    assert newest is not None
    assert newest.version == 3
    # Resuming from the older version and saving continues from there.
    older = again.restore(2)
    assert older is not None
    again.save(3, lambda: {"w": torch.full((2,), 33.0)})
    again.close()
    last = Session("newest", options)
    restored = last.restore("latest")
    assert restored is not None
    assert restored.state["w"].tolist() == [33.0, 33.0]
    last.close()


@pytest.mark.parametrize("job_id", ["", "victim::x", "a/b", " ", "..\\escape", "x" * 129, 3])
def test_session_needs_a_job_id_in_the_grammar(job_id: object) -> None:
    """Both integrations (Lightning's plugin, HF's tiercheck_job) build a Session when they
    are configured: a bad id fails there, not at the first checkpoint."""
    with pytest.raises(ConfigError, match="job_id must be"):
        Session(job_id, {})  # type: ignore[arg-type]


def test_resume_name() -> None:
    assert parse_name(RESUME) == "resume"
    assert RESUME not in (LATEST, version_name(0))


def _options(tmp_path: Path, **more: object) -> dict[str, object]:
    return {"local_root": tmp_path / "shm", "persistent": (tmp_path / "durable").as_uri(), **more}


def test_holds_anything_looks_without_opening(tmp_path: Path) -> None:
    session = Session("peek", _options(tmp_path))
    assert session.holds_anything() is False
    # Looking created nothing: no job record, no lock, no folder.
    assert not (tmp_path / "durable").exists()
    assert not (tmp_path / "shm").exists()

    # Opening writes the job record, before any save.
    assert session.checkpointer.job_id == "peek"
    session.close()
    assert Session("peek", _options(tmp_path)).holds_anything() is True
    assert Session("other", _options(tmp_path)).holds_anything() is False


def test_holds_anything_sees_the_nodes_memory(tmp_path: Path) -> None:
    session = Session("mem", _options(tmp_path))
    handle = session.save(1, lambda: {"w": torch.ones(2)})
    assert handle is not None
    session.close()
    # The durable folder was emptied (an operator's mistake); the node's memory still has it.
    shutil.rmtree(tmp_path / "durable")
    assert Session("mem", _options(tmp_path)).holds_anything() is True


def test_holds_anything_cannot_tell_without_the_persistent_tier(tmp_path: Path) -> None:
    # Nothing is stored, but only the persistent tier can tell every rank so alike.
    assert Session("solo", _options(tmp_path, tiers=["local"])).holds_anything() is True
