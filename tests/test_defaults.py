"""The one home of tiercheck's default places and node-root layout matches what is written."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch

from tiercheck import SyncCheckpointer, defaults
from tiercheck.defaults import NodeRoot, default_persistent_url, persistent_job_url
from tiercheck.errors import ConfigError


def test_a_checkpointer_writes_where_the_layout_says(tmp_path: Path) -> None:
    root = tmp_path / "shm" / "job" / "node0"
    durable = (tmp_path / "durable").as_uri() + "/"
    with SyncCheckpointer("job", local_root=root, persistent=durable, persist="all") as ckpt:
        ckpt.save(0, {"w": torch.ones(3)})
        ckpt.wait()
        layout = NodeRoot(ckpt.node_root)
        assert layout.lock(0).is_file()  # held while open
        assert ckpt.persistent_job_url == (tmp_path / "durable" / "job").as_uri()
    assert layout.looks_like_one()
    assert sorted(p.name for p in layout.blobs.rglob("*") if p.is_file()) == ["r00000.full"]
    assert layout.identity.is_file()
    assert NodeRoot.lock_rank(layout.lock(0).name) == 0
    job_folder = Path(ckpt.persistent_job_url.removeprefix("file://"))
    assert (job_folder / "v000000000000" / "r00000.packed").is_file()


def test_the_default_places(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert default_persistent_url() == (tmp_path / defaults.DEFAULT_PERSISTENT_DIR).as_uri()
    ckpt = SyncCheckpointer("run-1", node="n0")
    assert ckpt.persistent_job_url == (tmp_path / "tiercheck-checkpoints" / "run-1").as_uri()
    assert ckpt.node_root == defaults.memory_base() / "run-1" / "n0"
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        assert defaults.memory_base() == Path("/dev/shm/tiercheck")
    assert defaults.default_root("j").name == socket.gethostname()
    assert persistent_job_url("s3://b/ckpt/", "j") == "s3://b/ckpt/j"


@pytest.mark.parametrize("bad", ["", "a/b", "..", "x:y"])
def test_a_node_root_needs_folder_names(bad: str) -> None:
    with pytest.raises(ConfigError):
        defaults.default_root(bad, "n")
    with pytest.raises(ConfigError):
        defaults.default_root("j", bad)


def test_replica_keys_name_job_and_rank() -> None:
    assert NodeRoot.parse_replica_key("run-1/r00003/v000000000007/r00003.packed") == (
        "run-1",
        3,
        "v000000000007/r00003.packed",
    )
    assert NodeRoot.parse_replica_key("run-1/v000000000007/r00003.packed") is None
    assert NodeRoot.lock_rank("notes.txt") is None
