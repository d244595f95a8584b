"""Node identity: from the launcher's environment or explicit configuration."""

from __future__ import annotations

import pytest

from tiercheck import ConfigError
from tiercheck.topology import Topology


def test_torchrun_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TIERCHECK_RANKS_PER_NODE", raising=False)
    topo = Topology.detect()
    assert (topo.rank, topo.world_size, topo.ranks_per_node) == (5, 8, 4)
    assert (topo.node_index, topo.local_rank, topo.num_nodes) == (1, 1, 2)
    assert topo.node_name == "node1"
    assert topo.replica_targets() == [1]


def test_simulated_nodes_override_the_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("TIERCHECK_RANKS_PER_NODE", "1")
    topo = Topology.detect(rank=2, world_size=4)
    assert (topo.num_nodes, topo.node_index) == (4, 2)
    assert Topology.detect(rank=2, world_size=4, ranks_per_node=2).num_nodes == 2


def test_defaults_to_one_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "TIERCHECK_RANKS_PER_NODE"):
        monkeypatch.delenv(name, raising=False)
    topo = Topology.detect()
    assert (topo.rank, topo.world_size, topo.num_nodes) == (0, 1, 1)
    assert topo.replica_targets() == []


@pytest.mark.parametrize(
    ("rank", "world", "per_node"), [(4, 4, 1), (-1, 4, 1), (0, 4, 3), (0, 0, 1), (0, 4, 0)]
)
def test_inconsistent_placement_is_refused(rank: int, world: int, per_node: int) -> None:
    with pytest.raises(ConfigError):
        Topology(rank, world, per_node)


def test_a_non_integer_environment_is_a_typed_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "four")
    with pytest.raises(ConfigError):
        Topology.detect(rank=0)
