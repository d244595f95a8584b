"""Meshes of two dimensions under real torchrun (CPU/gloo): a job saved by tiercheck on 4 ranks
loads on 2, and one saved on 2 loads on 4, through DCP's own ``dcp.load`` and planner with
:class:`tiercheck.dcp.TiercheckStorageReader` -- FSDP2 + tensor parallel on a ``(dp, tp)`` mesh,
and HSDP on a ``(replicate, shard)`` mesh -- and through tiercheck's own in-place
``restore(state, elastic=True)``. The gathered model and optimizer state equal those the saving
job ended with, bit for bit."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import pytest
import torch

from tests.distributed.test_elastic import assert_same, torchrun
from tiercheck.cli import main

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

WORKER = Path(__file__).with_name("mesh2d_worker.py")


@pytest.mark.parametrize("layout", ["tp", "hsdp"])
def test_a_2d_mesh_job_loads_on_another_number_of_ranks_through_dcp(
    tmp_path: Path, layout: str
) -> None:
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    root = shm / f"tiercheck-test-mesh2d-{uuid.uuid4().hex[:12]}"
    try:
        for saved, loaded in ((4, 2), (2, 4)):
            durable, out = tmp_path / f"durable{saved}", tmp_path / f"out{saved}"
            for where, ranks, phase in (("save", saved, "save"), ("load", loaded, "load")):
                torchrun(
                    root / f"{where}{saved}", durable, out, ranks, phase,
                    worker=WORKER, extra=["--layout", layout],
                )  # fmt: skip
            expected = torch.load(out / "saved.pt", weights_only=True)
            assert expected["optim"], "the saving job's optimizer has state to compare"
            assert_same(torch.load(out / "loaded.pt", weights_only=True), expected)
            assert_same(torch.load(out / "restored.pt", weights_only=True), expected)
            # tiercheck export --full puts the same version together by region, in one process.
            assert (
                main(["export", str(durable), str(out / "whole"), "--full", "--format", "pt"]) == 0
            )
            whole = torch.load(out / "whole.pt", weights_only=True)["app"]
            assert_same(whole["model"], expected["model"])
            names = list(expected["model"])  # the parameters, in the optimizer's order
            assert_same(
                {i: whole["optim"]["state"][n] for i, n in enumerate(names)}, expected["optim"]
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
