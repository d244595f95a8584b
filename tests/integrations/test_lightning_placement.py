"""How restored shards are put back into a ``ModelParallelStrategy`` model: on the parameter's
own mesh, and only when they fit its layout (one process, a gloo group of one)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("lightning", reason="the Lightning integration needs the 'lightning' extra")

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from tests.helpers import one_rank_group
from tiercheck.errors import StateMismatch
from tiercheck.integrations._lightning_strategies import _placed


@pytest.fixture(scope="module")
def mesh() -> Iterator[DeviceMesh]:
    with one_rank_group():
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("data_parallel",))


def test_a_fitting_shard_goes_onto_the_parameters_mesh(mesh: DeviceMesh) -> None:
    param = DTensor.from_local(torch.zeros(4, 3), mesh, [Shard(0)])
    other_mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("data_parallel",))
    restored = DTensor.from_local(torch.arange(12.0).reshape(4, 3), other_mesh, [Shard(0)])
    for value in (restored, restored.to_local()):
        placed = _placed(param, value, "w")
        assert isinstance(placed, DTensor)
        assert placed.device_mesh is mesh
        assert placed.placements == param.placements
        assert torch.equal(placed.to_local(), restored.to_local())


def test_a_shard_of_another_layout_is_a_state_mismatch(mesh: DeviceMesh) -> None:
    param = DTensor.from_local(torch.zeros(4, 3), mesh, [Shard(0)])
    replicated = DTensor.from_local(torch.zeros(4, 3), mesh, [Replicate()])
    with pytest.raises(StateMismatch, match="placed"):
        _placed(param, replicated, "w")
    with pytest.raises(StateMismatch, match="local shard"):
        _placed(param, torch.zeros(3, 4), "w")
