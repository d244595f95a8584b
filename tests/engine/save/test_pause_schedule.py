"""Commit rounds that time out on one rank while another enters or completes them late.

The class of fault behind "one pause ends checkpointing for the rest of the run": a collective
round that times out on one rank but is entered -- or even completed, the last message having
got through one way -- late on another. Two in-process ranks (a :class:`LocalGroup`, whose
timed-out exchanges stay open for a late rank to complete, the worst case) save one version per
step, a barrier standing for training's all-reduce. A seeded random schedule delays rank 1
past the group's timeout, in three ways: its save comes late (a pause between the training step
and ``save``), its exchanges stall (its channel threads stop while training goes on), or both.

The oracle, checked as it happens and at the end:

* every version committed in a tier, on any rank, was written to that tier by every rank (no
  vote of one version ever counted for another);
* every ``COMMIT`` record names each rank's blob of its own version;
* after each delay ends, commits resume within :data:`RESUME_WITHIN` saves in every tier on
  every rank;
* at the end both ranks agree on the newest committed version, and a fresh opening restores it
  bit-exact (each rank's state is a pure function of the version and the rank).

A failing seed replays the same schedule: ``pytest -k "seed and <seed>"``.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch

from tiercheck import SyncCheckpointer
from tiercheck.consistency.commit import CommitRecord
from tiercheck.consistency.coordinator import Coordinator
from tiercheck.consistency.keys import parse_blob_key, parse_commit_key
from tiercheck.engine.commit.tier import TierPipeline
from tiercheck.testing import LocalGroup

pytestmark = pytest.mark.slow

#: The group's timeout: every delay below is longer.
TIMEOUT_S = 0.25
STEP_S = 0.05
#: Commits resume within this many saves after a delay ends.
RESUME_WITHIN = 4
TIERS = ("local", "persistent")


def state_of(version: int, rank: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(version * 1000 + rank)
    return {"w": torch.randn(256, generator=g), "step": version}


class Stalling(Coordinator):
    """Rank 1's coordinator: an exchange started before :attr:`until` waits until then first,
    as when the rank's threads are stopped."""

    def __init__(self, inner: Coordinator) -> None:
        self.inner = inner
        self.rank, self.world_size = inner.rank, inner.world_size
        self.until = 0.0

    def all_gather(self, channel: str, payload: bytes) -> list[bytes]:
        left = self.until - time.monotonic()
        if left > 0:
            time.sleep(left)
        return self.inner.all_gather(channel, payload)


@dataclass(frozen=True)
class Delay:
    step: int
    seconds: float
    #: "late" (the save waits), "stall" (the exchanges wait), "both".
    kind: str


def schedule(seed: int) -> tuple[list[Delay], int]:
    """Three delays, one of each kind in a random order, far enough apart to see commits
    resume after each; and the number of steps."""
    rng = random.Random(seed)
    kinds = ["late", "stall", "both"]
    rng.shuffle(kinds)
    delays, step = [], 3
    for kind in kinds:
        seconds = rng.uniform(2 * TIMEOUT_S, 4 * TIMEOUT_S)
        delays.append(Delay(step, seconds, kind))
        # A stall lets training go on: its steps pass during it.
        step += int(seconds / STEP_S) + RESUME_WITHIN + 4
    return delays, step + RESUME_WITHIN + 2


class Oracle:
    """What each rank wrote and committed, checked at each commit."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.written: set[tuple[str, int, int]] = set()
        self.committed: dict[tuple[str, int], set[int]] = defaultdict(set)
        self.violations: list[str] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        record, commit = TierPipeline.record_written, TierPipeline.commit
        oracle = self

        def recorded(pipe: TierPipeline, job: Any, key: str, meta: Any) -> Any:
            with oracle.lock:
                oracle.written.add((pipe.name, pipe.rank, job.version))
            return record(pipe, job, key, meta)

        def committed(pipe: TierPipeline, version: int) -> None:
            with oracle.lock:
                missing = [r for r in range(2) if (pipe.name, r, version) not in oracle.written]
                if missing:
                    oracle.violations.append(
                        f"rank {pipe.rank} committed {version} in {pipe.name!r}, which "
                        f"ranks {missing} never wrote there"
                    )
                oracle.committed[(pipe.name, pipe.rank)].add(version)
            commit(pipe, version)

        monkeypatch.setattr(TierPipeline, "record_written", recorded)
        monkeypatch.setattr(TierPipeline, "commit", committed)


def _checkpointer(tmp: Path, job: str, rank: int, coordinator: Coordinator) -> SyncCheckpointer:
    return SyncCheckpointer(
        job,
        rank=rank,
        world_size=2,
        coordinator=coordinator,
        tiers=list(TIERS),
        local_root=tmp / f"node{rank}",
        persistent=(tmp / "durable").as_uri(),
        base_every=3,
        persist="all",
        behind_saves=2,
    )


def _run(tmp: Path, job: str, delays: list[Delay], steps: int) -> tuple[dict[int, float], list]:
    """The job: rank 0's save times by version, and when each delay ended."""
    group = LocalGroup(2, timeout=TIMEOUT_S)
    stalling = Stalling(group.coordinator(1))
    barrier = threading.Barrier(2, timeout=60)
    started: dict[int, float] = {}
    ended: list[float] = []
    errors: list[BaseException] = []
    by_step = {d.step: d for d in delays}

    def rank(r: int) -> None:
        try:
            coordinator = group.coordinator(0) if r == 0 else stalling
            with _checkpointer(tmp, job, r, coordinator) as ckpt:
                for version in range(steps):
                    barrier.wait()  # training's all-reduce
                    delay = by_step.get(version) if r == 1 else None
                    if delay is not None:
                        until = time.monotonic() + delay.seconds
                        if delay.kind in ("stall", "both"):
                            stalling.until = until
                        if delay.kind in ("late", "both"):
                            time.sleep(delay.seconds)
                        ended.append(until)
                    if r == 0:
                        started[version] = time.monotonic()
                    ckpt.save(version, state_of(version, r))
                    time.sleep(STEP_S)
                barrier.wait()
                ckpt.wait()
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    assert not errors, errors
    return started, ended


def _commit_records(durable: Path) -> list[tuple[int, CommitRecord]]:
    out = []
    for path in durable.rglob("COMMIT"):
        key = path.relative_to(path.parent.parent).as_posix()
        version = parse_commit_key(key)
        assert version is not None, key
        out.append((version, CommitRecord.from_bytes(path.read_bytes())))
    return out


@pytest.mark.parametrize("seed", [11, 23, 37])
def test_commits_resume_after_each_delay_and_never_mix_versions(
    seed: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    delays, steps = schedule(seed)
    print(f"seed {seed}: {delays}, {steps} steps")
    oracle = Oracle()
    oracle.install(monkeypatch)
    job = f"pause-{seed}"
    started, ended = _run(tmp_path, job, delays, steps)

    assert oracle.violations == []
    for version, record in _commit_records(tmp_path / "durable"):
        assert record.version == version
        assert [e.rank for e in record.entries] == [0, 1]
        for entry in record.entries:
            parsed = parse_blob_key(entry.key)
            assert parsed is not None
            assert (parsed.version, parsed.rank) == (version, entry.rank), record

    for delay, end in zip(delays, ended, strict=True):
        # Rounds in flight when the delay ended may still time out: count from the first save
        # after that.
        first = min(v for v, t in started.items() if t > end + TIMEOUT_S)
        window = set(range(first, first + RESUME_WITHIN + 1))
        for tier in TIERS:
            both = oracle.committed[(tier, 0)] & oracle.committed[(tier, 1)]
            assert both & window, (
                f"seed {seed}: after {delay} no version of {sorted(window)} was committed in "
                f"{tier!r} on both ranks (rank 0: {sorted(oracle.committed[(tier, 0)])}, "
                f"rank 1: {sorted(oracle.committed[(tier, 1)])})"
            )
    for tier in TIERS:
        newest = {r: max(oracle.committed[(tier, r)]) for r in range(2)}
        assert newest[0] == newest[1] == steps - 1, (tier, newest)

    # A fresh opening restores the newest version, bit-exact, on both ranks.
    group = LocalGroup(2, timeout=60)
    restored: dict[int, Any] = {}

    def reopen(r: int) -> None:
        with _checkpointer(tmp_path, job, r, group.coordinator(r)) as ckpt:
            restored[r] = ckpt.restore()

    threads = [threading.Thread(target=reopen, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for r in range(2):
        got = restored[r]
        assert got is not None
        assert got.version == steps - 1
        assert torch.equal(got.state["w"], state_of(steps - 1, r)["w"])


class LateAck(Coordinator):
    """A rank's coordinator whose ``ack`` of one version in one tier comes late -- after the
    other rank's has timed out, which the group still completes for this rank (the last
    message got through one way)."""

    def __init__(self, inner: Coordinator, channel: str, version: int, seconds: float) -> None:
        self.inner = inner
        self.rank, self.world_size = inner.rank, inner.world_size
        self.late = (channel, version)
        self.seconds = seconds

    def all_gather(self, channel: str, payload: bytes) -> list[bytes]:
        envelope = msgpack.unpackb(payload, raw=False)
        if (channel, envelope["t"]) == self.late and envelope["s"] == "ack":
            time.sleep(self.seconds)
        return self.inner.all_gather(channel, payload)


@pytest.mark.parametrize("late", [1, 0], ids=["rank-0-loses-the-ack", "rank-1-loses-the-ack"])
def test_a_commit_whose_last_exchange_one_rank_lost_is_adopted_from_its_record(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, late: int
) -> None:
    """Rank 0 writes version 3's COMMIT record; then one rank loses the round's last exchange
    (the other's ack comes after the timeout) while the late rank completes it and counts 3
    committed. The version is whole -- every rank said yes -- and its record is there.

    Rank 0 losing it still counts 3 committed: the record decides, and rank 0 knows it landed.
    Rank 1 losing it cannot know: its handle says "uncertain" (never "failed" against rank 0's
    "committed"), it keeps its blob meanwhile and, at its next retention, finds the record and
    counts 3 committed too."""
    caplog.set_level(logging.INFO, "tiercheck")
    group = LocalGroup(2, timeout=TIMEOUT_S)
    coordinators: list[Coordinator] = [group.coordinator(0), group.coordinator(1)]
    coordinators[late] = LateAck(coordinators[late], "persistent", 3, 3 * TIMEOUT_S)
    barrier = threading.Barrier(2, timeout=60)
    outcomes: dict[int, dict[int, str]] = {}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            with _checkpointer(tmp_path, "late-ack", r, coordinators[r]) as ckpt:
                handles = []
                for version in range(8):
                    barrier.wait()
                    handles.append(ckpt.save(version, state_of(version, r)))
                    time.sleep(STEP_S)
                barrier.wait()
                ckpt.wait()
                outcomes[r] = {h.version: h.stats.tiers["persistent"].state for h in handles}
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    loser = 1 - late
    assert outcomes[late][3] == "committed"  # the late rank completed the exchange
    assert outcomes[loser][3] == ("committed" if loser == 0 else "uncertain")
    adopted = [
        r.getMessage()
        for r in caplog.records
        if "version 3 is committed in the 'persistent' tier after all" in r.getMessage()
    ]
    assert len(adopted) == (0 if loser == 0 else 1), [r.getMessage() for r in caplog.records]
    assert outcomes[0][7] == outcomes[1][7] == "committed"
