"""``torch.distributed.checkpoint`` reads what tiercheck stores (tiercheck/dcp.py): DCP's own
``dcp.load`` through :class:`TiercheckStorageReader`, into a layout other than the one saved,
bit for bit, and nothing stored is touched by it."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.api import CheckpointException

from tests.engine.restore.test_elastic import COLS, ROWS, global_bias, global_weight, save_versions
from tiercheck import SyncCheckpointer
from tiercheck.catalog import LocationError
from tiercheck.dcp import TiercheckStorageReader
from tiercheck.errors import BlobNotFound, ChecksumMismatch

# dcp.load(..., no_dist=True) warns that it assumes one process: what these loads mean.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def files(root: Path) -> dict[str, str]:
    """Every file under ``root`` that holds stored data and the hash of its bytes.

    The manifest's ``lock.mdb`` is left out: it is LMDB's table of live readers, which LMDB
    rewrites whenever a process opens the environment (the manifest process a read starts
    when the one the saves used has gone idle); it holds no checkpoint or manifest data, and
    ``data.mdb`` beside it is compared."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != "lock.mdb"
    }


def blank() -> dict[str, Any]:
    """A one-process target for the sharded job's state: full tensors, other shapes than any
    rank's shard."""
    return {
        "w": torch.zeros(ROWS, COLS),
        "b": torch.zeros(5, dtype=torch.float64),
        "lr": torch.tensor(0.0),
        "step": -1,
    }


@pytest.mark.parametrize("where", ["durable", "node"])
def test_dcp_loads_a_job_sharded_over_4_ranks_into_one_process(tmp_path: Path, where: str) -> None:
    """4 ranks saved DTensors sharded by rows (3, 3, 3, 2 of 11), deltas between bases; DCP
    loads the newest version, or an older one, from the durable tier or the node's memory into
    plain full tensors of one process, bit for bit; the stored files are unchanged."""
    save_versions(tmp_path, 4, range(4))
    location = tmp_path / "durable" if where == "durable" else tmp_path / "node"
    before = files(tmp_path)
    older = 1 if where == "durable" else 2  # memory keeps the newest two
    for version in (None, older):
        reader = TiercheckStorageReader(location, "job", version=version)
        state = blank()
        dcp.load(state, storage_reader=reader, no_dist=True)
        expected = 3 if version is None else version
        assert reader.read_version == expected
        assert torch.equal(state["w"], global_weight(expected))
        assert torch.equal(state["b"], global_bias(expected))
        assert state["b"].dtype == torch.float64
        assert torch.equal(state["lr"], torch.tensor(0.5))
        assert state["step"] == expected
    assert files(tmp_path) == before


def test_dcp_loads_a_model_and_optimizer_the_way_a_training_script_would(tmp_path: Path) -> None:
    """A plain loop saved ``model.state_dict()`` and ``opt.state_dict()``; a fresh model and
    optimizer are loaded with DCP (state dicts in, ``load_state_dict`` out) and then train
    exactly like the originals."""

    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        return model, torch.optim.AdamW(model.parameters(), lr=0.01)

    def step(model: torch.nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
        g = torch.Generator().manual_seed(i)
        model(torch.randn(4, 6, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    torch.manual_seed(0)
    model, opt = build()
    with SyncCheckpointer(
        "loop",
        local_root=tmp_path / "node",
        persistent=(tmp_path / "durable").as_uri(),
        persist="all",
    ) as ckpt:
        for i in range(3):
            step(model, opt, i)
            ckpt.save(i, {"model": model.state_dict(), "optim": opt.state_dict()})
        ckpt.wait()

    torch.manual_seed(1)  # other initial weights, to be overwritten
    fresh, fresh_opt = build()
    step(fresh, fresh_opt, 99)  # an optimizer with state to load into
    state = {"model": fresh.state_dict(), "optim": fresh_opt.state_dict()}
    dcp.load(
        state,
        storage_reader=TiercheckStorageReader(tmp_path / "durable", "loop"),
        no_dist=True,
    )
    fresh.load_state_dict(state["model"])
    fresh_opt.load_state_dict(state["optim"])
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    step(model, opt, 3)
    step(fresh, fresh_opt, 3)
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)


def test_what_cannot_be_read_is_a_typed_error_and_nothing_is_touched(tmp_path: Path) -> None:
    save_versions(tmp_path, 2, range(2))
    before = files(tmp_path)
    with pytest.raises(BlobNotFound, match="version 7 is not stored whole and committed"):
        TiercheckStorageReader(tmp_path / "durable", "job", version=7).read_metadata()
    with pytest.raises(LocationError):
        TiercheckStorageReader(tmp_path / "durable", "nojob").read_metadata()
    with pytest.raises(LocationError):
        TiercheckStorageReader(tmp_path / "nothing-here").read_metadata()
    # Through dcp.load, DCP reports the reader's error inside its own exception, by rank.
    with pytest.raises(CheckpointException) as info:
        dcp.load(
            blank(),
            storage_reader=TiercheckStorageReader(tmp_path / "durable", "job", version=7),
            no_dist=True,
        )
    assert "version 7 is not stored whole" in str(info.value.failures[0])
    # A key the version does not hold is DCP's error, unless the planner allows partial loads.
    extra = {**blank(), "missing": torch.zeros(2)}
    with pytest.raises(CheckpointException) as info:
        dcp.load(extra, storage_reader=TiercheckStorageReader(tmp_path / "durable"), no_dist=True)
    assert "missing" in str(info.value.failures[0])
    dcp.load(
        extra,
        storage_reader=TiercheckStorageReader(tmp_path / "durable"),
        planner=DefaultLoadPlanner(allow_partial_load=True),
        no_dist=True,
    )
    assert torch.equal(extra["w"], global_weight(1))
    assert files(tmp_path) == before


def test_state_outside_dtensors_that_differs_between_ranks_is_rank_0s(tmp_path: Path) -> None:
    """Each rank stored its own ``position``: DCP can read one value per key, so it reads rank
    0's, and the reader's warnings name the key."""
    save_versions(tmp_path, 2, range(1), own=True)
    reader = TiercheckStorageReader(tmp_path / "durable", "job")
    state = {**blank(), "position": torch.zeros(1, dtype=torch.int64)}
    dcp.load(state, storage_reader=reader, no_dist=True)
    assert state["position"].tolist() == [0]  # rank 0's: rank * 100 + version
    assert torch.equal(state["w"], global_weight(0))
    assert [w for w in reader.warnings if "position" in w] == [
        "position: ranks 0 and 1 stored different values outside DTensors; rank 0's is read"
    ]


def test_a_damaged_blob_is_a_typed_error_never_data(tmp_path: Path) -> None:
    """A bit flipped in one rank's durable blob: the reader refuses the version with the
    checksum error and hands DCP nothing; the damaged file is left as it was."""
    save_versions(tmp_path, 2, range(1))
    blob = next(p for p in (tmp_path / "durable" / "job").glob("v*/r00001*") if p.is_file())
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0x10
    blob.write_bytes(bytes(data))
    before = files(tmp_path)
    with pytest.raises(ChecksumMismatch):
        TiercheckStorageReader(tmp_path / "durable", "job").read_metadata()
    assert files(tmp_path) == before
