"""The peer tier passes the shipped conformance suite, against a real holder process.

The test process is rank 0 of a two-node gloo job on loopback; a subprocess is rank 1, the
holder of rank 0's replicas, serving until the module is done. Every test gets a namespace of
its own on the holder, so each starts from an empty tier.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
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

    async def reopen_tier(self, tier: Tier, tmp_path: Path) -> Tier:
        """A new requester over the same replicas: the holder kept them."""
        assert isinstance(tier, PeerTier)
        return PeerTier(
            topology=Topology(0, 2, 1),
            holder_root=tmp_path / "holder0",
            namespace=tier.namespace,
            session="conformance",
            group=self.job["group"],
            serve=False,
            chunk_bytes=8 << 20,
            timeout=60,
        )

    # The back door: the holder's files (rank 1 keeps rank 0's replicas under namespace/r00000).
    def _held(self, tier: Tier, key: str) -> Path:
        assert isinstance(tier, PeerTier)
        return Path(self.job["root"]) / "holder1" / tier.namespace / "r00000" / key

    async def raw_get(self, tier: Tier, key: str) -> bytes:
        return self._held(tier, key).read_bytes()

    async def raw_put(self, tier: Tier, key: str, data: bytes) -> None:
        path = self._held(tier, key)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


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


# --- a holder that is gone: fail fast, logged once --------------------------------------------


def _lonely_tier(tmp_path: Path, store: Any, **kw: Any) -> PeerTier:
    """Rank 0 of a two-node job whose holder (rank 1) never answers: nobody serves rank 1."""
    kw.setdefault("timeout", 0.3)
    return PeerTier(
        topology=Topology(0, 2, 1),
        holder_root=tmp_path / "holder0",
        store=store,
        group=object(),  # never reached: no request is ever answered
        serve=False,
        session="lonely",
        **kw,
    )


def _requests_to(store: Any, rank: int, session: str = "lonely") -> int:
    """How many requests were numbered for ``rank``'s server (``add(k, 0)`` reads a counter)."""
    return int(store.add(f"tiercheck/peer/{session}/seq/{rank}", 0))


async def _every_operation(tier: PeerTier) -> list[tuple[str, BaseException | None]]:
    """Run each Tier operation once; what each raised (None: it did not raise)."""

    async def listing() -> None:
        async for _ in tier.list("v"):
            pass

    calls: dict[str, Any] = {
        "put": lambda: tier.put("k", b"data"),
        "get": lambda: tier.get("k"),
        "delete": lambda: tier.delete("k"),
        "exists": lambda: tier.exists("k"),
        "size": lambda: tier.get_size("k"),
        "list": listing,
    }
    outcomes: list[tuple[str, BaseException | None]] = []
    for name, call in calls.items():
        try:
            await call()
        except Exception as exc:
            outcomes.append((name, exc))
        else:
            outcomes.append((name, None))
    return outcomes


async def test_after_one_failure_every_operation_towards_the_holder_fails_at_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """One unanswered request marks the holder down: put, get, delete, exists, size and list
    then raise PeerUnavailable without sending a request (so without waiting), and the dead
    holder is logged once, as one WARNING line without a traceback."""
    from tiercheck.errors import PeerUnavailable

    store = dist.HashStore()  # type: ignore[attr-defined]
    tier = _lonely_tier(tmp_path, store)
    caplog.set_level("WARNING", logger="tiercheck")
    with pytest.raises(PeerUnavailable):
        await tier.delete("k")  # the one that waits for `timeout`
    assert tier.is_down(1)
    sent = _requests_to(store, 1)
    outcomes = await _every_operation(tier)
    assert [(name, type(exc)) for name, exc in outcomes] == [
        (name, PeerUnavailable) for name in ("put", "get", "delete", "exists", "size", "list")
    ]
    assert _requests_to(store, 1) == sent, "a down holder is not asked again"
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "rank 1 is unreachable" in warnings[0].getMessage()
    assert warnings[0].exc_info is None
    await tier.aclose()


async def test_mark_down_makes_the_tier_fail_fast_at_once(tmp_path: Path) -> None:
    """The caller may mark a holder down on its own knowledge; nothing is then sent to it."""
    from tiercheck.errors import PeerUnavailable

    store = dist.HashStore()  # type: ignore[attr-defined]
    tier = _lonely_tier(tmp_path, store, timeout=300)  # a wait would be for 300 s
    assert not tier.is_down(1)
    tier.mark_down(1, "its node was lost")
    assert tier.is_down(1)
    outcomes = await _every_operation(tier)
    assert all(isinstance(exc, PeerUnavailable) for _, exc in outcomes), outcomes
    assert _requests_to(store, 1) == 0
    await tier.aclose()


async def test_a_down_holder_is_tried_again_after_retry_after(tmp_path: Path) -> None:
    """Down is for a while: after ``retry_after`` seconds the holder is asked again."""
    from tiercheck.errors import PeerUnavailable

    store = dist.HashStore()  # type: ignore[attr-defined]
    tier = _lonely_tier(tmp_path, store, retry_after=0.2)
    tier.mark_down(1)
    with pytest.raises(PeerUnavailable):
        await tier.exists("k")
    assert _requests_to(store, 1) == 0
    await asyncio.sleep(0.3)
    assert not tier.is_down(1)
    with pytest.raises(PeerUnavailable):
        await tier.exists("k")  # asked, and unanswered again
    assert _requests_to(store, 1) == 1
    assert tier.is_down(1)
    await tier.aclose()


async def test_a_store_error_marks_the_holder_down_too(tmp_path: Path) -> None:
    """Not only a timeout: a store that fails (its host is gone) marks the holder down, and
    closing then neither raises nor waits on the store."""
    from tiercheck.errors import PeerUnavailable

    host = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30))  # type: ignore[attr-defined]
    # A short store timeout: reconnecting to a store that is gone retries for that long.
    client = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", host.port, 1, False, timeout=timedelta(seconds=2)
    )
    tier = _lonely_tier(tmp_path, client, timeout=30)
    del host  # the store's host leaves
    with pytest.raises(PeerUnavailable):
        await tier.put("k", b"data")
    assert tier.is_down(1)
    await tier.aclose()


# --- stopping the server ----------------------------------------------------------------------


def _serving_tier(tmp_path: Path, store: Any) -> PeerTier:
    return PeerTier(
        topology=Topology(0, 2, 1),
        holder_root=tmp_path / "holder0",
        store=store,
        group=object(),
        serve=True,
        session="serving",
        timeout=30,
    )


async def test_stop_serving_is_the_last_store_traffic(tmp_path: Path) -> None:
    """``stop_serving`` stops the server thread; ``aclose`` afterwards does not use the store."""
    store = dist.HashStore()  # type: ignore[attr-defined]
    tier = _serving_tier(tmp_path, store)
    assert await tier.stop_serving(timeout=20)
    assert tier._server is not None
    assert not tier._server.is_alive()
    numbered = _requests_to(store, 0, "serving")
    assert await tier.stop_serving(timeout=20)  # idempotent
    await tier.aclose()
    assert _requests_to(store, 0, "serving") == numbered


async def test_stop_serving_skips_the_request_of_a_requester_that_died(tmp_path: Path) -> None:
    """A requester that died between numbering its request and sending it leaves a hole the
    server would wait on for its whole idle wait (60 s); stopping fills the hole and returns
    promptly, with the server stopped."""
    store = dist.HashStore()  # type: ignore[attr-defined]
    tier = _serving_tier(tmp_path, store)
    store.add("tiercheck/peer/serving/seq/0", 1)  # numbered, never sent: the sender died
    assert await tier.stop_serving(timeout=20)
    assert tier._server is not None
    assert not tier._server.is_alive()
    await tier.aclose()


async def test_stop_serving_with_the_store_gone_reports_and_never_raises(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The store's host may leave first: stopping returns False, logs one WARNING line, and
    ``aclose`` neither raises nor touches the store again."""
    host = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30))  # type: ignore[attr-defined]
    # A short store timeout: reconnecting to a store that is gone retries for that long.
    client = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", host.port, 1, False, timeout=timedelta(seconds=2)
    )
    tier = _serving_tier(tmp_path, client)
    caplog.set_level("WARNING", logger="tiercheck")
    del host
    assert not await tier.stop_serving(timeout=20)
    await tier.aclose()
    ours = [r for r in caplog.records if r.name == "tiercheck" and r.levelname == "WARNING"]
    assert len(ours) == 1, [r.getMessage() for r in ours]
    assert "not stopped cleanly" in ours[0].getMessage()
    assert ours[0].exc_info is None


@pytest.mark.parametrize("op", ["put", "get"])
async def test_a_transfer_its_sender_gave_up_is_skipped_and_the_pair_keeps_working(
    peer_job: dict[str, Any], tmp_path: Path, op: str
) -> None:
    """A holder back from a pause finds requests waiting whose senders gave up long ago.
    Serving one would start a gloo transfer nobody takes part in: it waits out the timeout
    and gloo closes the pair for good, so no transfer between the two ranks would ever work
    again. The sender gives its request up in the store, once, before the holder can take
    it; the holder skips it, and the next transfers work at once."""
    import msgpack

    from tiercheck.tiers.peer.wire import claim_key

    tier = await TestPeerTier().make_tier.__func__(  # type: ignore[attr-defined]
        SimpleNamespace(job=peer_job), tmp_path
    )
    assert isinstance(tier, PeerTier)
    await tier.put("before", b"kept")
    # A request of rank 0 that rank 0 gave up before the holder took it (as _reply does on
    # a timeout): numbered, given up, then found by the holder.
    store = tier._store_here()
    seq = int(store.add("seq/1", 1))
    given_up = store.compare_set(claim_key(0, 1, seq), "", "cancelled")
    assert given_up == b"cancelled"
    message: dict[str, Any] = {"op": op, "key": "stale", "chunk": 1 << 20}
    if op == "put":
        message["sizes"] = [4]
    message.update(src=0, seq=seq, ns=tier.namespace)
    store.set(f"req/1/{seq}", msgpack.packb(message, use_bin_type=True))
    await tier.put("after", b"new")
    assert await tier.get("after") == b"new"
    assert await tier.get("before") == b"kept"
    assert not await tier.exists("stale")
    # Had the holder served it, its transfer would have held the holder for the group's
    # 60 s timeout: the put above would have had no answer within the tier's and failed.
    assert not tier.is_down(1)
    await tier.aclose()
