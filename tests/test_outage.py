"""Durable storage that goes down and comes back, for real: a loopback S3 server stopped and
started again on the same port while a job runs, restarts, and saves.

Each test makes the outage happen (the server's socket closes: connections are refused) and
checks what the issue asked: a restart whose memory holds the job opens, restores from memory
bit-exact, warns once, and claims the durable tier back -- its ownership checked first -- once
the server is back, so that versions reach it again and restore from it bit-exact once memory
is gone; a job with nothing stored anywhere still fails fast; and a tier that fell behind sends
the newest version when it comes back, not the oldest queued ones.
"""

from __future__ import annotations

import logging
import random
import shutil
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from tests.test_never_lose import run_ranks
from tiercheck import StorageError, SyncCheckpointer, VersionError
from tiercheck.testing import LocalGroup

from .helpers import assert_state_equal
from .tiers import conftest as tier_fixtures
from .tiers.conftest import S3Server

s3_server = tier_fixtures.s3_server  # sets the dummy credentials; its server is not used here

T = TypeVar("T")

#: Background retries of a tier unreachable at opening: quick, for tests.
FAST_RETRY: dict[str, Any] = {"durable_retry_delay": 0.05, "durable_retry_max": 0.2}


def state_of(version: int, n: int = 4096) -> dict[str, Any]:
    """The state saved as ``version``: a pure function of it."""
    g = torch.Generator().manual_seed(version)
    return {"w": torch.randn(n, generator=g), "step": version}


class Endpoint:
    """A moto S3 server on 127.0.0.1 that the test stops (its socket closes: connections are
    refused) and starts again on the same port. Every endpoint of this process serves the same
    buckets (moto keeps them in the process), so what is stored lives on in between."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self._server_class = ThreadedMotoServer
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._server: Any = None
        self.start()

    def start(self) -> None:
        assert self._server is None
        self._server = self._server_class(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()

    def stop(self) -> None:
        assert self._server is not None
        self._server.stop()
        self._server = None

    @property
    def up(self) -> bool:
        return self._server is not None

    def options(self) -> dict[str, Any]:
        """``storage_options`` that reach the bucket through this endpoint."""
        return {
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"endpoint_url": self.endpoint, "region_name": "us-east-1"},
        }


class FlakyS3(Endpoint):
    """A bucket, and the endpoint the test stops and starts (see :class:`Endpoint`)."""

    def __init__(self) -> None:
        import boto3

        super().__init__()
        self.bucket = f"outage-{uuid.uuid4().hex[:12]}"
        client = boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",  # noqa: S106 -- a dummy for the local server
        )
        client.create_bucket(Bucket=self.bucket)
        client.close()
        self.storage_options = self.options()
        self.url = f"s3://{self.bucket}/ckpt"


@pytest.fixture
def flaky_s3(s3_server: S3Server) -> Iterator[FlakyS3]:
    """A loopback S3 server of the test's own, to stop and start again."""
    server = FlakyS3()
    try:
        yield server
    finally:
        if server.up:
            server.stop()


@pytest.fixture
def second_endpoint(s3_server: S3Server) -> Iterator[Endpoint]:
    """Another way in to the same buckets, to stop for some ranks only."""
    endpoint = Endpoint()
    try:
        yield endpoint
    finally:
        if endpoint.up:
            endpoint.stop()


def opened(s3: FlakyS3, root: Path, **kw: Any) -> SyncCheckpointer:
    options: dict[str, Any] = {"base_every": 2, **FAST_RETRY, **kw}
    return SyncCheckpointer(
        "job",
        local_root=root,
        persistent=s3.url,
        storage_options=s3.storage_options,
        **options,
    )


def save_until_claimed(ckpt: SyncCheckpointer, first: int, *, deadline: float = 30.0) -> int:
    """Save ``first``, ``first + 1``, ... until the durable tier is claimed again (a hang
    guard, not a measure of speed); returns the next version to save."""
    version = first
    until = time.monotonic() + deadline
    while ckpt.stats.unreachable:
        assert time.monotonic() < until, f"never claimed: {ckpt.stats.unreachable}"
        ckpt.save(version, state_of(version))
        version += 1
        time.sleep(0.05)
    return version


def persistent_versions(s3: FlakyS3) -> set[int]:
    """The versions with a COMMIT record in the bucket, read past tiercheck."""
    import s3fs

    from tiercheck.consistency.keys import parse_commit_key

    fs = s3fs.S3FileSystem(**s3.storage_options)
    prefix = f"{s3.bucket}/ckpt/job/"
    found = set()
    for path in fs.find(prefix):
        v = parse_commit_key(path[len(prefix) :])
        if v is not None:
            found.add(v)
    return found


def test_a_restart_with_durable_storage_down_opens_on_memory_and_claims_it_back(
    flaky_s3: FlakyS3, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    node = tmp_path / "node"
    with opened(flaky_s3, node) as ckpt:
        for v in range(6):
            ckpt.save(v, state_of(v))
        assert ckpt.wait() == {"local": 5, "persistent": 4}
    flaky_s3.stop()

    # The restart, the endpoint refusing connections: it opens, on its memory.
    with caplog.at_level(logging.WARNING, logger="tiercheck"):
        ckpt = opened(flaky_s3, node)
        ckpt.open()
    try:
        said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(said) == 1, said
        assert "the durable 'persistent' tier of job 'job' cannot be reached" in said[0]
        assert "Could not connect to the endpoint URL" in said[0]
        assert set(ckpt.stats.unreachable) == {"persistent"}
        # Saving before restoring would not know what the unreachable tier holds.
        with pytest.raises(VersionError, match="restore"):
            ckpt.save(6, state_of(6))
        restored = ckpt.restore()
        assert restored is not None
        assert (restored.version, restored.source_tier) == (5, "local")
        assert_state_equal(restored.state, state_of(5))
        # Saves go on, to memory; nothing reaches the bucket while it is down.
        for v in range(6, 9):
            ckpt.save(v, state_of(v))
        assert ckpt.wait() == {"local": 8, "persistent": None}
        assert set(ckpt.stats.unreachable) == {"persistent"}
        assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1

        flaky_s3.start()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="tiercheck"):
            nxt = save_until_claimed(ckpt, 9)
        assert "checked it and claimed it" in caplog.text
        # The versions after the claim reach it: the next base, and the deltas on it.
        last = nxt + 3 if nxt % 2 else nxt + 2
        for v in range(nxt, last + 1):
            ckpt.save(v, state_of(v))
        newest = ckpt.wait()
        assert newest["local"] == last
        assert newest["persistent"] == last - last % 2
        assert not ckpt.stats.superseded
    finally:
        ckpt.close()
    assert max(persistent_versions(flaky_s3)) == last - last % 2

    # The node's memory is gone: the bucket alone restores the newest version it committed.
    shutil.rmtree(node)
    with opened(flaky_s3, tmp_path / "new-node") as again:
        back = again.restore()
    assert back is not None
    assert (back.version, back.source_tier) == (last - last % 2, "persistent")
    assert_state_equal(back.state, state_of(back.version))


def test_every_rank_opens_on_memory_and_claims_the_tier_back_at_the_same_save(
    flaky_s3: FlakyS3, second_endpoint: Endpoint, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two ranks on two nodes; rank 1 reaches the bucket through an endpoint of its own, which
    goes down: rank 0 still reaches it (and reads the job record, which the memory must match),
    rank 1 does not. Both open on their memory, and claim the tier back at the same save once
    rank 1 reaches it again -- not before, however early rank 0 does."""
    world = 2

    def rank_job(rank: int, group: LocalGroup, root: Path) -> SyncCheckpointer:
        return SyncCheckpointer(
            "job",
            rank=rank,
            world_size=world,
            ranks_per_node=1,
            coordinator=group.coordinator(rank),
            tiers=["local", "persistent"],
            local_root=root / f"node{rank}",
            persistent=flaky_s3.url,
            storage_options=flaky_s3.options() if rank == 0 else second_endpoint.options(),
            base_every=2,
            **FAST_RETRY,
        )

    def mine(version: int, rank: int) -> dict[str, Any]:
        return state_of(10 * version + rank)

    group = LocalGroup(world)

    def first_run(rank: int) -> dict[str, int | None]:
        with rank_job(rank, group, tmp_path) as ckpt:
            for v in range(6):
                ckpt.save(v, mine(v, rank))
            return ckpt.wait()

    assert run_ranks(world, first_run) == [{"local": 5, "persistent": 4}] * world
    second_endpoint.stop()
    group = LocalGroup(world)

    def restarted(rank: int) -> tuple[int, int, dict[str, int | None]]:
        ckpt = rank_job(rank, group, tmp_path)
        try:
            restored = ckpt.restore()
            assert restored is not None
            assert (restored.version, restored.source_tier) == (5, "local")
            assert_state_equal(restored.state, mine(5, rank))
            for v in range(6, 9):  # rank 0 reaches the tier; rank 1 does not
                ckpt.save(v, mine(v, rank))
                assert set(ckpt.stats.unreachable) == {"persistent"}
            time.sleep(0.5)  # rank 0's probe has long succeeded
            ckpt.save(9, mine(9, rank))
            assert set(ckpt.stats.unreachable) == {"persistent"}
            if rank == 1:
                second_endpoint.start()
            version, until = 10, time.monotonic() + 30
            while ckpt.stats.unreachable:  # every rank saves the same versions
                assert time.monotonic() < until, "never claimed"
                ckpt.save(version, mine(version, rank))
                version += 1
                time.sleep(0.05)
            last = version + 2 + version % 2  # a base, after a delta or two
            for v in range(version, last + 1):
                ckpt.save(v, mine(v, rank))
            return version, last, ckpt.wait()
        finally:
            ckpt.close()

    with caplog.at_level(logging.WARNING, logger="tiercheck"):
        outcomes = run_ranks(world, restarted)
    warned = [r for r in caplog.records if "cannot be reached" in r.getMessage()]
    assert len(warned) == world  # one per rank
    # The same save on every rank, and the same outcome.
    assert outcomes[0] == outcomes[1]
    _, last, newest = outcomes[0]
    assert newest == {"local": last, "persistent": last}

    for rank in range(world):
        shutil.rmtree(tmp_path / f"node{rank}")
    group = LocalGroup(world)

    def from_bucket(rank: int) -> None:
        with rank_job(rank, group, tmp_path) as ckpt:
            back = ckpt.restore()
        assert back is not None
        assert (back.version, back.source_tier) == (last, "persistent")
        assert_state_equal(back.state, mine(last, rank))

    run_ranks(world, from_bucket)


def test_the_versions_a_restore_in_memory_left_behind_are_set_aside_before_anything_is_written(
    flaky_s3: FlakyS3, tmp_path: Path
) -> None:
    """Going back to an older version while the tier is down: the tier's newer versions are
    set aside (abandoned/, whole) once it is claimed, before the run's own versions of the same
    numbers get there."""
    node = tmp_path / "node"
    kw: dict[str, Any] = {"persist": "all", "keep": {"local": 4, "persistent": 10}}
    with opened(flaky_s3, node, **kw) as ckpt:
        for v in range(6):
            ckpt.save(v, state_of(v))
        assert ckpt.wait() == {"local": 5, "persistent": 5}
    flaky_s3.stop()
    with opened(flaky_s3, node, **kw) as ckpt:
        restored = ckpt.restore(version=3)
        assert restored is not None
        assert restored.source_tier == "local"
        assert_state_equal(restored.state, state_of(3))
        ckpt.save(4, state_of(104))  # the run goes on from 3, differently
        flaky_s3.start()
        nxt = save_until_claimed(ckpt, 5)  # saves 5, 6, ... of the new timeline
        for v in range(nxt, nxt + 2):
            ckpt.save(v, state_of(v))
        ckpt.wait()
    import s3fs

    fs = s3fs.S3FileSystem(**flaky_s3.storage_options)
    kept = [p for p in fs.find(f"{flaky_s3.bucket}/ckpt/job/abandoned/") if p.endswith("/SET")]
    assert len(kept) == 1, kept
    shutil.rmtree(node)
    with opened(flaky_s3, tmp_path / "new-node", **kw) as again:
        back = again.restore()
    assert back is not None
    assert back.source_tier == "persistent"
    assert back.version == nxt + 1
    assert_state_equal(back.state, state_of(back.version))


def test_a_newer_opening_made_while_the_tier_was_down_keeps_it(
    flaky_s3: FlakyS3, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """This run opened on its memory; while the tier was down for it, the job was opened again
    elsewhere. Once back, this run checks before it writes: the newer opening keeps the job, and
    nothing of this run gets there."""
    node = tmp_path / "node"
    with opened(flaky_s3, node) as ckpt:
        for v in range(4):
            ckpt.save(v, state_of(v))
        ckpt.wait()
    flaky_s3.stop()
    ckpt = opened(flaky_s3, node)
    try:
        assert ckpt.restore() is not None
        flaky_s3.start()
        # The job is opened elsewhere (another node, nothing in its memory) and goes on.
        with opened(flaky_s3, tmp_path / "elsewhere") as other:
            assert other.restore() is not None
            other.save(10, state_of(1010))
            assert other.wait()["persistent"] == 10
        before = persistent_versions(flaky_s3)
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="tiercheck"):
            version = 4
            until = time.monotonic() + 30
            while not ckpt.stats.superseded:
                assert time.monotonic() < until, "the tier was never judged"
                ckpt.save(version, state_of(version))
                version += 1
                time.sleep(0.05)
        assert "never writes there" in caplog.text
        assert "another opening of job 'job'" in caplog.text
        for v in range(version, version + 3):
            ckpt.save(v, state_of(v))
        assert ckpt.wait()["persistent"] is None
    finally:
        ckpt.close()
    assert persistent_versions(flaky_s3) == before
    with opened(flaky_s3, tmp_path / "third") as last:
        back = last.restore()
    assert back is not None
    assert back.version == 10
    assert_state_equal(back.state, state_of(1010))


def test_a_new_job_against_a_dead_endpoint_still_fails_fast(
    flaky_s3: FlakyS3, tmp_path: Path
) -> None:
    flaky_s3.stop()
    started = time.monotonic()
    with pytest.raises(StorageError, match="cannot be used, so the job does not start") as raised:
        opened(flaky_s3, tmp_path / "node").open()
    took = time.monotonic() - started
    assert "holds no versions of job 'job'" in str(raised.value)
    # A hang guard, not a measure: botocore's retries inside tiercheck's used to take ~44 s.
    assert took < 15, took
    # Memory of this job saved to another location does not stand in either.
    flaky_s3.start()
    with opened(flaky_s3, tmp_path / "node") as ckpt:
        ckpt.save(0, state_of(0))
    flaky_s3.stop()
    with pytest.raises(StorageError, match="saved to"):
        SyncCheckpointer(
            "job",
            local_root=tmp_path / "node",
            persistent=f"s3://{flaky_s3.bucket}/elsewhere",
            storage_options=flaky_s3.storage_options,
        ).open()


@pytest.mark.slow
def test_after_an_outage_the_tier_catches_up_with_the_newest_version(
    flaky_s3: FlakyS3, tmp_path: Path
) -> None:
    """A seeded schedule of outages while the job saves: each time the server comes back, the
    durable tier's newest committed version is the newest saved (a base), not one of those that
    queued up first; and the bucket alone restores it bit-exact."""
    rng = random.Random(2105)
    version = 0
    expected: list[tuple[int, int]] = []
    with opened(flaky_s3, tmp_path / "node", base_every=3, persist="all") as ckpt:
        for _outage in range(3):
            for _ in range(rng.randint(1, 4)):
                ckpt.save(version, state_of(version))
                version += 1
            ckpt.wait()
            flaky_s3.stop()
            # More saves than the tier's queue holds, the last a base.
            last = version + rng.randint(8, 14)
            last += (3 - last % 3) % 3
            for v in range(version, last + 1):
                ckpt.save(v, state_of(v))
            version = last + 1
            flaky_s3.start()
            newest = ckpt.wait()
            expected.append((last, newest["persistent"] or -1))
    assert [got for _, got in expected] == [last for last, _ in expected]
    with opened(flaky_s3, tmp_path / "fresh", base_every=3, persist="all") as again:
        back = again.restore()
    assert back is not None
    assert (back.version, back.source_tier) == (expected[-1][0], "persistent")
    assert_state_equal(back.state, state_of(back.version))


def test_memory_removed_under_the_live_job_is_trusted_again_by_a_restart_during_an_outage(
    flaky_s3: FlakyS3, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An operator (or a cleanup job) removes the node's memory folder while the job trains:
    the job writes on and commits resume -- and its identity record, which only an opening
    wrote, was gone with the folder. A restart while durable storage is down then could not
    tell the node's memory is this run's, and refused to start (found by the chaos soak,
    seed 3101). The job writes the record again; the restart opens on memory and restores the
    newest version the job committed there after the removal."""
    node = tmp_path / "node"
    with opened(flaky_s3, node) as ckpt:
        for v in range(4):
            ckpt.save(v, state_of(v))
        ckpt.wait()
        shutil.rmtree(node)  # the whole node folder: blobs, manifest, locks, identity
        with caplog.at_level(logging.WARNING, logger="tiercheck"):
            for v in range(4, 10):
                ckpt.save(v, state_of(v))
                ckpt.wait()
        assert ckpt.wait()["local"] == 9
    assert "identity record" in caplog.text
    assert "writing it again" in caplog.text
    flaky_s3.stop()
    ckpt = opened(flaky_s3, node)
    try:
        ckpt.open()
        assert set(ckpt.stats.unreachable) == {"persistent"}
        restored = ckpt.restore()
        assert restored is not None
        assert (restored.version, restored.source_tier) == (9, "local")
        assert_state_equal(restored.state, state_of(9))
    finally:
        ckpt.close()
