"""One tier's commit rounds on their own (tiercheck/engine/commit/commit.py), on a world of two
ranks in one process: each rank runs its :class:`CommitRounds` on its own thread and event loop, and
the ranks vote through a real :class:`~tiercheck.testing.LocalGroup`. The lane's outcome of each
version on each rank is scripted (durable, or why not); the durable tier is one real in-memory
tier both ranks write to, each through a view that records what that rank wrote; each rank has
a real claim. The rest of the pipeline is a stand-in that records what the rounds told it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal, cast

import pytest

from tests.tiers.dict_tier import DictTier
from tiercheck.consistency.commit import CommitRecord
from tiercheck.consistency.coordinator import ChannelDown
from tiercheck.consistency.keys import blob_key, commit_key
from tiercheck.consistency.manifest import Written
from tiercheck.consistency.protocol import Step
from tiercheck.engine.collectives import Channels, OutOfStep, step
from tiercheck.engine.commit.commit import CommitRounds
from tiercheck.engine.jobs import InFlight, Job, OwnBlob
from tiercheck.engine.open.claim import Claim
from tiercheck.engine.results import CheckpointerStats, SaveHandle, SaveStats
from tiercheck.errors import CommitUncertain, PeerUnavailable, StateChanged, TierWriteFailed
from tiercheck.testing import LocalGroup
from tiercheck.tiers.wrapper import DelegatingTier
from tiercheck.topology import Topology

TIER = "dict"
WORLD = 2


class _Seen(DelegatingTier):
    """One rank's view of the shared tier: records the keys this rank wrote."""

    def __init__(self, inner: DictTier) -> None:
        super().__init__(inner)
        self.written: list[str] = []

    async def before(self, op: str, key: str) -> None:
        if op in ("put", "putv"):
            self.written.append(key)


@dataclass
class Outcome:
    """What one rank's lane made of one version: its blob (of a delta on ``base``), or why not."""

    version: int
    error: BaseException | None = None
    base: int | None = None
    #: An overlapped snapshot the caller found changed (the blob was written all the same).
    torn: bool = False


@dataclass
class _Pipe:
    """A rank's pipeline as its commit rounds see it; records what they told it."""

    rank: int
    tier: _Seen
    channels: Channels
    claim: Claim
    durable: bool
    job_id: str = "job"
    name: str = TIER
    stats: CheckpointerStats = field(default_factory=CheckpointerStats)
    inflight: InFlight = field(default_factory=InFlight)
    journal: Any = field(default_factory=lambda: SimpleNamespace(compact=lambda keep_after: 0))
    own: dict[int, OwnBlob] = field(default_factory=dict)
    committed: set[int] = field(default_factory=set)
    unsure: set[int] = field(default_factory=set)
    reserve_size: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    failed: dict[int, BaseException] = field(default_factory=dict)
    over: list[int] = field(default_factory=list)
    forgotten: set[int] = field(default_factory=set)
    bases_lost: int = 0
    retained: int = 0
    #: Run after each round's retention (a test changes the world between rounds there).
    after_round: Callable[[int], None] = lambda rounds: None

    def fail(self, job: Job, error: BaseException) -> None:
        self.failed[job.version] = error
        job.handle.resolve_tier(self.name, error)

    def commit(self, version: int) -> None:
        self.committed.add(version)

    def round_over(self, version: int) -> None:
        self.over.append(version)

    def forget_bases(self, bases: Collection[int]) -> None:
        self.forgotten.update(bases)
        self.committed.difference_update(bases)

    def peer_trouble(self, what: str, exc: BaseException) -> None:
        raise AssertionError(f"both ranks are alive: {what}: {exc!r}")

    def peers_back(self) -> None:
        pass

    async def retain(self) -> None:
        self.retained += 1
        self.after_round(self.retained)


def _job(rank: int, outcome: Outcome) -> Job:
    version = outcome.version
    kind: Literal["base", "delta"] = "base" if outcome.base is None else "delta"
    handle = SaveHandle(version, [TIER], SaveStats(version, kind))
    job = Job(version, kind, outcome.base, {TIER: "packed"}, handle, time.perf_counter())
    job.launch(None)
    if outcome.error is not None:
        job.lane_done(TIER, None, outcome.error)
    else:
        key = blob_key(version, rank, "packed")
        job.lane_done(TIER, Written(version, rank, TIER, key, 100 + rank, 7, 9, outcome.base))
    if outcome.torn:
        verdict: concurrent.futures.Future[None] = concurrent.futures.Future()
        verdict.set_exception(StateChanged("changed before the fence"))
        job.confirmed = verdict
    return job


class _World:
    """Two ranks sharing one tier; :meth:`run` plays each rank's scripted outcomes."""

    def __init__(self, tmp_path: Path, *, durable: bool = True) -> None:
        self.tmp_path = tmp_path
        self.durable = durable
        self.store = DictTier()
        self.group = LocalGroup(WORLD, timeout=10)
        self.claims = [self._claim(r) for r in range(WORLD)]
        #: Set up a rank's pipe before its rounds run (``own``, ``committed``, hooks).
        self.setup: Callable[[_Pipe], None] = lambda pipe: None

    def _claim(self, rank: int) -> Claim:
        options: Any = SimpleNamespace(
            job=SimpleNamespace(
                topology=Topology(rank, WORLD, 1),
                job_id="job",
                node_root=self.tmp_path / f"node{rank}",
            )
        )
        return Claim(options, CheckpointerStats(), Channels())

    def run(self, outcomes: list[list[Outcome]]) -> tuple[list[_Pipe], list[list[Job]]]:
        """Each rank's commit rounds of its outcomes (in order), on its own thread; every
        rank's pipe and jobs once all rounds are over."""
        out: list[Any] = [None] * WORLD

        def main(rank: int) -> None:
            try:
                out[rank] = asyncio.run(self._rank(rank, outcomes[rank]))
            except BaseException as exc:
                out[rank] = exc

        threads = [threading.Thread(target=main, args=(r,)) for r in range(WORLD)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        for result in out:
            if isinstance(result, BaseException):
                raise result
        return [o[0] for o in out], [o[1] for o in out]

    async def _rank(self, rank: int, outcomes: list[Outcome]) -> tuple[_Pipe, list[Job]]:
        channels = Channels()
        await channels.connect(
            self.group.coordinator(rank), world_size=WORLD, names=["control", TIER], timeout=10
        )
        channels.add(TIER)
        pipe = _Pipe(rank, _Seen(self.store), channels, self.claims[rank], self.durable)
        self.setup(pipe)

        def lost() -> None:
            pipe.bases_lost += 1

        rounds = CommitRounds(cast(Any, pipe), lost)
        jobs = [_job(rank, o) for o in outcomes]
        for job in jobs:
            pipe.inflight.add(job)
            rounds.queue.put_nowait(job)
        rounds.queue.put_nowait(None)
        try:
            await asyncio.wait_for(rounds.run(), 20)
        finally:
            channels.close()
        return pipe, jobs

    def records(self) -> dict[int, CommitRecord]:
        """The COMMIT records in the tier, by version."""
        return {
            int(key[1:].split("/")[0]): CommitRecord.from_bytes(blob)
            for key, blob in self.store.blobs.items()
            if key.endswith("COMMIT")
        }


def _ok(*versions: int) -> list[Outcome]:
    return [Outcome(v) for v in versions]


def test_a_version_every_rank_made_durable_commits_on_every_rank(tmp_path: Path) -> None:
    world = _World(tmp_path)
    pipes, jobs = world.run([_ok(1, 2), _ok(1, 2)])
    for rank, (pipe, mine) in enumerate(zip(pipes, jobs, strict=True)):
        assert pipe.committed == {1, 2}
        assert pipe.failed == {}
        assert pipe.over == [1, 2]
        assert pipe.retained == 2
        assert pipe.stats.committed == {TIER: 2}
        assert pipe.stats.last_committed == {TIER: 2}
        for job in mine:
            assert job.handle.committed(TIER)
            assert job.handle.stats.tiers[TIER].state == "committed"
        assert len(pipe.inflight) == 0, f"rank {rank}: a job whose rounds are over leaves"
    # Rank 0 alone writes the COMMIT records, listing every rank's blob.
    assert pipes[0].tier.written == [commit_key(1), commit_key(2)]
    assert pipes[1].tier.written == []
    records = world.records()
    assert sorted(records) == [1, 2]
    assert [(e.rank, e.key, e.size) for e in records[2].entries] == [
        (0, blob_key(2, 0, "packed"), 100),
        (1, blob_key(2, 1, "packed"), 101),
    ]


@pytest.mark.parametrize("durable", [True, False], ids=["durable-tier", "memory-tier"])
@pytest.mark.parametrize("why", ["write-failed", "snapshot-torn"])
def test_one_ranks_failure_fails_the_version_on_every_rank_and_later_ones_commit(
    tmp_path: Path, durable: bool, why: str
) -> None:
    world = _World(tmp_path, durable=durable)
    lane_error = TierWriteFailed("version 2 could not be written: disk full")
    no = Outcome(2, lane_error) if why == "write-failed" else Outcome(2, torn=True)
    pipes, jobs = world.run([_ok(1, 2, 3), [Outcome(1), no, Outcome(3)]])
    for pipe, mine in zip(pipes, jobs, strict=True):
        assert pipe.committed == {1, 3}
        assert list(pipe.failed) == [2]
        assert pipe.over == [1, 2, 3]
        failed = mine[1]
        assert not failed.handle.committed(TIER)
        with pytest.raises(TierWriteFailed):
            failed.handle.result(TIER, timeout=1)
    # Rank 0 names the rank that could not; rank 1 says why itself.
    assert "is not whole in the 'dict' tier: ranks [1] could not write it" in str(
        pipes[0].failed[2]
    )
    own = pipes[1].failed[2]
    if why == "write-failed":
        assert own is lane_error
    else:
        assert isinstance(own, TierWriteFailed)
        assert isinstance(own.__cause__, StateChanged)
    # Only the versions every rank made durable have COMMIT records (memory tiers have none).
    assert sorted(world.records()) == ([1, 3] if durable else [])
    assert pipes[0].tier.written == ([commit_key(1), commit_key(3)] if durable else [])
    assert pipes[1].tier.written == []


def test_a_superseded_claim_stops_durable_commits_on_every_rank(tmp_path: Path) -> None:
    world = _World(tmp_path)

    def setup(pipe: _Pipe) -> None:
        if pipe.rank == 0:
            # After the first round, a newer opening of the job takes the tier over (rank 0's
            # claim learns it, as its fence would tell it).
            pipe.after_round = lambda rounds: pipe.claim.mark_superseded() if rounds == 1 else None

    world.setup = setup
    pipes, _ = world.run([_ok(1, 2, 3), _ok(1, 2, 3)])
    assert sorted(world.records()) == [1]
    for pipe in pipes:
        assert pipe.committed == {1}
        assert sorted(pipe.failed) == [2, 3]
        assert "a newer opening of this job took it over" in str(pipe.failed[2])
        # Rank 1's claim learnt it from rank 0's word: it stops writing there too.
        assert pipe.claim.superseded
        assert pipe.claim.stats.superseded
    assert pipes[0].tier.written == [commit_key(1)]


def test_a_delta_whose_base_vanished_on_one_rank_fails_everywhere_and_the_next_save_is_a_base(
    tmp_path: Path,
) -> None:
    world = _World(tmp_path)

    def setup(pipe: _Pipe) -> None:
        key = blob_key(1, pipe.rank, "packed")
        pipe.own[1] = OwnBlob(key, None)
        pipe.committed.add(1)
        if pipe.rank == 0:  # rank 1's copy of the base is gone (a deleted folder, say)
            world.store.blobs[key] = b"base"

    world.setup = setup
    world.store.blobs[commit_key(1)] = b"{}"
    pipes, _ = world.run([[Outcome(2, base=1)], [Outcome(2, base=1)]])
    for pipe in pipes:
        assert list(pipe.failed) == [2]
        assert "is a delta whose base vanished from the 'dict' tier" in str(pipe.failed[2])
        assert pipe.bases_lost == 1
        assert pipe.forgotten == {1}
        assert 1 not in pipe.committed
        assert 2 not in pipe.committed
    assert pipes[0].tier.written == []


@pytest.mark.parametrize(
    ("durable", "lost_at", "loser"),
    [
        (False, Step.VOTE, 0),
        (False, Step.VOTE, 1),
        (True, Step.VOTE, 0),
        (True, Step.ACK, 1),
        (True, Step.ACK, 0),
    ],
    ids=["memory-vote-r0", "memory-vote-r1", "durable-vote-r0", "durable-ack-r1", "durable-ack-r0"],
)
def test_a_rank_that_loses_the_last_exchange_is_uncertain_never_contradicting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, durable: bool, lost_at: Step, loser: int
) -> None:
    """The exchange of version 2 completes everywhere but its answer never reaches ``loser``
    (the other rank paused, or the connection broke after the last message got through one
    way): the others decide on every word; ``loser`` cannot know, so its handle says
    "uncertain" and its blob is kept -- except rank 0 after the ACK, which knows whether the
    COMMIT record it wrote landed. No handle says committed for a version that is not, or
    failed for one that is."""
    world = _World(tmp_path, durable=durable)
    ranks: dict[int, int] = {}  # id(channels) -> rank
    troubles: list[tuple[int, str]] = []

    def setup(pipe: _Pipe) -> None:
        ranks[id(pipe.channels)] = pipe.rank

        def trouble(what: str, exc: BaseException) -> None:
            troubles.append((pipe.rank, what))

        pipe.peer_trouble = trouble  # type: ignore[method-assign]

    world.setup = setup

    async def lossy(channels: Channels, which: Step, message: Any, **kw: Any) -> Any:
        got = await step(channels, which, message, **kw)
        if which is lost_at and kw["tag"] == 2 and ranks[id(channels)] == loser:
            raise PeerUnavailable("the answer of the exchange was lost")
        return got

    monkeypatch.setattr("tiercheck.engine.commit.commit.step", lossy)
    pipes, jobs = world.run([_ok(1, 2, 3), _ok(1, 2, 3)])
    # Rank 0 knows whether its COMMIT record landed; after rank 0 lost the vote's answer,
    # rank 1 finds rank 0 past the round at the ACK and reads the tier: no record.
    rank0_knows = durable and lost_at is Step.ACK and loser == 0
    rank1_reads = durable and lost_at is Step.VOTE and loser == 0
    for pipe, mine in zip(pipes, jobs, strict=True):
        assert {1, 3} <= pipe.committed
        state = mine[1].handle.stats.tiers[TIER].state
        if pipe.rank == loser and not rank0_knows:
            # (The pipeline makes the handle's state "uncertain" of this error.)
            assert isinstance(pipe.failed[2], CommitUncertain)
            assert "may or may not be committed" in str(pipe.failed[2])
            assert 2 not in pipe.committed
            assert 2 in pipe.unsure, "its blob must stay: the others may have committed it"
            with pytest.raises(TierWriteFailed):
                mine[1].handle.result(TIER, timeout=1)
        elif rank1_reads:
            assert "its COMMIT record was not written" in str(pipe.failed[2])
            assert not isinstance(pipe.failed[2], CommitUncertain)
            assert 2 not in pipe.committed
            assert 2 not in pipe.unsure
        else:
            assert state == "committed", (pipe.rank, pipe.failed)
            assert 2 in pipe.committed
            assert 2 not in pipe.unsure
    if rank0_knows:
        assert troubles == [(0, "telling the others whether version 2 committed")]
    elif rank1_reads:
        assert troubles == [
            (0, "committing version 2"),
            (1, "learning whether version 2 committed"),
        ]
    else:
        assert troubles == [(loser, "committing version 2")]
    assert sorted(world.records()) == ([1, 3] if rank1_reads else [1, 2, 3] if durable else [])


@pytest.mark.parametrize("how", ["out-of-step", "channel-down"])
def test_a_vote_nobody_used_fails_the_round_for_certain(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """An exchange whose ranks stood apart was used by nobody, and a vote on a channel that did
    not reconnect in time was never sent: the round fails outright, and its blob need not be
    kept for the others."""
    world = _World(tmp_path, durable=False)

    def setup(pipe: _Pipe) -> None:
        pipe.peer_trouble = lambda what, exc: None  # type: ignore[method-assign]

    world.setup = setup

    async def apart(channels: Channels, which: Step, message: Any, **kw: Any) -> Any:
        if kw["tag"] == 2 and how == "channel-down":
            raise ChannelDown("channel 'dict' is broken")
        got = await step(channels, which, message, **kw)
        if kw["tag"] == 2:
            raise OutOfStep("apart", [("vote", 2), ("vote", 3)])
        return got

    monkeypatch.setattr("tiercheck.engine.commit.commit.step", apart)
    pipes, _ = world.run([_ok(1, 2, 3), _ok(1, 2, 3)])
    for pipe in pipes:
        assert pipe.committed == {1, 3}
        assert isinstance(pipe.failed[2], TierWriteFailed)
        assert not isinstance(pipe.failed[2], CommitUncertain)
        assert 2 not in pipe.unsure
