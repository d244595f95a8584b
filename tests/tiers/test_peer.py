"""The peer tier passes the shipped conformance suite, against a real holder process.

The test process is rank 0 of a two-node gloo job on loopback; a subprocess is rank 1, the
holder of rank 0's replicas, serving until the module is done. Every test gets a namespace of
its own on the holder, so each starts from an empty tier.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from tiercheck.errors import ConfigError
from tiercheck.testing import TierTests
from tiercheck.tiers import Tier
from tiercheck.tiers.peer import PeerTier
from tiercheck.topology import Topology

pytestmark = pytest.mark.multiprocess

HOLDER = r"""
import asyncio, sys, time
from datetime import timedelta
from pathlib import Path
import torch.distributed as dist
from tiercheck.tiers.peer import PeerTier
from tiercheck.topology import Topology

port, root, stop = int(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
dist.init_process_group(
    "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2,
    timeout=timedelta(seconds=60),
)
group = dist.new_group(backend="gloo", timeout=timedelta(seconds=60))
tier = PeerTier(topology=Topology(1, 2, 1), holder_root=root, session="conformance", group=group)
print("serving", flush=True)
while not stop.exists():
    time.sleep(0.05)
asyncio.run(tier.aclose())
dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def peer_job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Rank 0 here, rank 1 (the holder) in a subprocess; torn down after the module."""
    root = tmp_path_factory.mktemp("peer")
    stop = root / "stop"
    port = _free_port()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(port), str(root / "holder1"), str(stop)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=0,
            world_size=2,
            timeout=timedelta(seconds=60),
        )
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=60))
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "serving"
        yield {"group": group, "root": root}
    finally:
        stop.touch()
        try:
            assert holder.wait(60) == 0
        finally:
            if holder.stdout is not None:
                holder.stdout.close()
            if dist.is_initialized():
                dist.destroy_process_group()


class TestPeerTier(TierTests):
    """The peer tier: rank 0's blobs kept in the memory of rank 1, on another "node"."""

    @pytest.fixture(autouse=True)
    def _job(self, peer_job: dict[str, Any]) -> None:
        self.job = peer_job

    async def make_tier(self, tmp_path: Path) -> Tier:
        return PeerTier(
            topology=Topology(0, 2, 1),
            holder_root=tmp_path / "holder0",
            namespace=f"t{uuid.uuid4().hex}",
            session="conformance",
            group=self.job["group"],
            serve=False,  # nobody asks rank 0 to hold anything here
            chunk_bytes=8 << 20,  # several chunks per large blob
            timeout=60,
        )


def test_the_peer_tier_refuses_a_single_node_job(tmp_path: Path) -> None:
    """A replica on the same node would die with it: one node is a configuration error."""
    with pytest.raises(ConfigError):
        PeerTier(topology=Topology(0, 4, 4), holder_root=tmp_path)


def test_a_placement_on_the_same_node_is_refused(tmp_path: Path) -> None:
    """A custom placement may choose any holders, except on the rank's own node."""
    with pytest.raises(ConfigError):
        PeerTier(
            topology=Topology(0, 4, 2),
            holder_root=tmp_path,
            placement=lambda topo: [1],  # rank 1 shares node 0 with rank 0
            store=dist.HashStore(),  # type: ignore[attr-defined]
            group=object(),
            serve=False,
        )


def test_replicas_go_to_the_next_nodes_never_the_same_one() -> None:
    """Ring placement: node i keeps its replicas on node i+1 (and i+2 with two replicas)."""
    topo = Topology(rank=1, world_size=8, ranks_per_node=2)  # node 0 of 4
    assert topo.replica_targets(1) == [3]
    assert topo.replica_targets(2) == [3, 5]
    assert topo.replica_targets(9) == [3, 5, 7]  # at most num_nodes - 1
    assert Topology(rank=7, world_size=8, ranks_per_node=2).replica_targets(1) == [1]
    assert topo.replica_sources(1) == [7]
    for rank in range(8):
        t = Topology(rank, 8, 2)
        assert all(t.node_of(r) != t.node_index for r in t.replica_targets(3))


def test_a_dead_holder_fails_fast_after_one_timeout(tmp_path: Path) -> None:
    """A holder that never answers costs one timeout, then the tier fails at once."""
    import asyncio

    from tiercheck.errors import PeerUnavailable

    store = dist.HashStore()  # type: ignore[attr-defined]
    tier = PeerTier(
        topology=Topology(0, 2, 1),
        holder_root=tmp_path,
        store=store,
        group=object(),  # never reached: the request itself goes unanswered
        serve=False,
        timeout=0.5,
    )

    async def scenario() -> float:
        with pytest.raises(PeerUnavailable):
            await tier.put("k", b"data")
        started = time.monotonic()
        with pytest.raises(PeerUnavailable):
            await tier.put("k", b"data")
        elapsed = time.monotonic() - started
        await tier.aclose()
        return elapsed

    assert asyncio.run(scenario()) < 0.2
    assert os.path.isdir(tmp_path)
