"""Every collective is a named step with one typed message (tiercheck.engine.collectives).

Two in-process ranks (a :class:`~tiercheck.testing.LocalGroup`, each rank on its own thread with
its own event loop) exchange each step's message; a rank that never comes, a group that fails
and a coordinator that breaks make errors that name the step.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from typing import Any

import pytest

from tiercheck._threads import DaemonExecutor
from tiercheck.consistency.coordinator import Coordinator, SoloCoordinator
from tiercheck.consistency.preempt import FlushVote, PreemptBegin, PreemptOffer
from tiercheck.consistency.protocol import (
    STEP_MESSAGES,
    ClaimOutcome,
    CommitAck,
    InventoryReport,
    Message,
    OpenFacts,
    Outcome,
    Reached,
    Rejoined,
    RestoreVerdict,
    SavesDone,
    ServingStopped,
    SessionToken,
    SetAsideCompletion,
    SetAsideListing,
    Step,
    Vote,
)
from tiercheck.consistency.recovery import Inventory
from tiercheck.engine.collectives import OutOfStep, step
from tiercheck.errors import PeerUnavailable
from tiercheck.testing import LocalGroup


class FakeSide:
    """One rank's coordinator and its serial channel threads, as the engine's Channels have."""

    def __init__(self, coordinator: Coordinator, channels: tuple[str, ...]) -> None:
        self.coordinator = coordinator
        self.channels: Mapping[str, Executor] = {
            name: DaemonExecutor(1, f"test-steps-{name}") for name in channels
        }

    def close(self) -> None:
        for ex in self.channels.values():
            ex.shutdown(wait=False, cancel_futures=True)


def _on_ranks(world: int, body: Callable[[int], Any]) -> list[Any]:
    """``body(rank)`` on ``world`` threads at once; each rank's result or exception, by rank."""
    out: list[Any] = [None] * world

    def run(rank: int) -> None:
        try:
            out[rank] = body(rank)
        except BaseException as exc:
            out[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a rank never returned"
    return out


def _facts(rank: int) -> OpenFacts:
    if rank == 0:
        return OpenFacts(
            node=0,
            local_rank=0,
            probe={},
            job={"state": "found", "token": "ab" * 8, "world_size": 2, "committed": [1, 2]},
            deleted=["cd" * 8],
            tombstone=True,
            identity="{}",
            has_data=True,
            held=[1, 2],
            fresh_token="ef" * 8,
        )
    return OpenFacts(
        node=1,
        local_rank=0,
        lock="rank 1 holds the lock (test)",
        probe={"persistent": "refused (test)"},
        unreachable={"persistent": "connection refused (test)"},
        identity_error="cut short (test)",
        identity_damaged=True,
        has_data=False,
    )


#: Each step's message, by rank: different on each rank, so that the order is checked too.
SAMPLES: dict[Step, Callable[[int], Message]] = {
    Step.SESSION: lambda r: SessionToken(f"token-{r}"),
    Step.OPEN_FACTS: _facts,
    Step.CLAIM: lambda r: ClaimOutcome({"persistent": 3} if r == 0 else {}, "" if r else "x"),
    Step.INVENTORY: lambda r: InventoryReport(
        {"local": frozenset({r, 5}), "persistent": frozenset()}, {"peer": "down"} if r else {}
    ),
    Step.VERDICT: lambda r: RestoreVerdict(
        r == 0, "local" if r == 0 else None, ("a", "b") if r else (), ("StateMismatch", "x")
    ),
    Step.WRITTEN: lambda r: RestoreVerdict(r == 0, "local" if r == 0 else None, (), None, r == 1),
    Step.LOADED: lambda r: Outcome(None if r == 0 else "ValueError: no"),
    Step.REACHED: lambda r: Reached(("persistent",) if r == 0 else ()),
    Step.REJOIN: lambda r: (
        Rejoined({"persistent": 4}, {"other": "a newer opening"}, {"third": "timeout"})
        if r == 0
        else Rejoined()
    ),
    Step.JOB_RECORD: lambda r: Outcome("StorageError: refused" if r == 0 else None),
    Step.SET_ASIDE_LIST: lambda r: SetAsideListing([4, 5] if r == 0 else [], None),
    Step.SET_ASIDE_COPY: lambda r: Outcome(None),
    Step.SET_ASIDE_COMPLETE: lambda r: SetAsideCompletion(None, [3] if r == 0 else [], [4, 5]),
    Step.SET_ASIDE_REMOVE: lambda r: Outcome(None if r else "StorageError: list failed"),
    Step.VOTE: lambda r: (
        Vote(True, key=f"v1/r{r}", size=9, checksum=1, raw_digest=2, base=0)
        if r == 0
        else Vote(False, base_missing=True)
    ),
    Step.ACK: lambda r: CommitAck(r == 0, "" if r == 0 else "error"),
    Step.CLOSE_SAVED: lambda r: SavesDone(r == 0),
    Step.CLOSE_STOPPED: lambda r: ServingStopped(True),
    Step.PREEMPT_BEGIN: lambda r: PreemptBegin(7 + r, "" if r == 0 else "superseded"),
    Step.PREEMPT_OFFER: lambda r: PreemptOffer(
        [3, 4 + r], {"persistent": 0, "s3": -1}, {"s3": "blocked"} if r else {}
    ),
    Step.PREEMPT_VOTE: lambda r: (
        FlushVote(7, "persistent", key=f"v7/r{r}", size=9, checksum=1, raw_digest=2)
        if r == 0
        else FlushVote(7, "persistent", already=False, why="no room")
    ),
    Step.PREEMPT_ACK: lambda r: CommitAck(r == 1, "superseded" if r == 0 else ""),
}


def test_every_step_has_a_sample_of_its_one_message_class() -> None:
    assert set(SAMPLES) == set(Step) == set(STEP_MESSAGES)
    for which, make in SAMPLES.items():
        for rank in (0, 1):
            assert type(make(rank)) is STEP_MESSAGES[which], which


def test_every_step_round_trips_its_message_between_two_ranks() -> None:
    group = LocalGroup(2, timeout=20)
    steps = list(Step)

    def rank(r: int) -> list[list[Message]]:
        side = FakeSide(group.coordinator(r), ("control", "local", "preempt"))

        async def all_steps() -> list[list[Message]]:
            out = []
            for which in steps:
                # The commit round's steps go on the tier's channel, the flush on SIGTERM's on
                # its own, the others on control.
                channel = (
                    "local"
                    if which in (Step.VOTE, Step.ACK)
                    else "preempt"
                    if which.value.startswith("preempt")
                    else "control"
                )
                out.append(await step(side, which, SAMPLES[which](r), channel=channel))
            return out

        try:
            return asyncio.run(all_steps())
        finally:
            side.close()

    results = _on_ranks(2, rank)
    for r, got in enumerate(results):
        assert not isinstance(got, BaseException), (r, got)
        for which, everyone in zip(steps, got, strict=True):
            assert everyone == [SAMPLES[which](0), SAMPLES[which](1)], (r, which)
            assert all(type(m) is STEP_MESSAGES[which] for m in everyone)
    inventories = [m.inventory(r) for r, m in enumerate(results[1][steps.index(Step.INVENTORY)])]
    assert inventories[1] == Inventory(1, {"local": frozenset({1, 5}), "persistent": frozenset()})


def test_a_job_of_one_rank_gets_its_own_message_back() -> None:
    side = FakeSide(SoloCoordinator(), ())
    mine = Vote(True, key="k", size=1, checksum=2, raw_digest=3)
    assert asyncio.run(step(side, Step.VOTE, mine, channel="local")) == [mine]


def test_a_step_takes_only_its_own_message_class() -> None:
    side = FakeSide(SoloCoordinator(), ())
    with pytest.raises(TypeError, match="step 'vote' exchanges Vote, not Outcome"):
        asyncio.run(step(side, Step.VOTE, Outcome(None), channel="local"))


def test_a_rank_that_never_comes_times_out_naming_the_step() -> None:
    group = LocalGroup(2, timeout=0.3)
    side = FakeSide(group.coordinator(0), ("local",))
    try:
        with pytest.raises(PeerUnavailable, match=r"^step 'ack' on channel 'local': .*timed out"):
            asyncio.run(step(side, Step.ACK, CommitAck(True), channel="local"))
    finally:
        side.close()


def test_a_lost_peer_fails_the_step_in_flight_naming_it() -> None:
    group = LocalGroup(2, timeout=20)
    side = FakeSide(group.coordinator(1), ("control",))
    threading.Timer(0.2, group.fail).start()  # rank 0 dies while rank 1 waits for it
    try:
        with pytest.raises(PeerUnavailable, match=r"^step 'verdict' on channel 'control'") as info:
            asyncio.run(step(side, Step.VERDICT, RestoreVerdict(True, "local")))
    finally:
        side.close()
    assert isinstance(info.value.__cause__, PeerUnavailable)  # the coordinator's own words kept


class _Broken(Coordinator):
    rank, world_size = 0, 2

    def all_gather(self, channel: str, payload: bytes) -> list[bytes]:
        raise RuntimeError("the store went away (test)")


def test_any_other_failure_keeps_its_type_and_names_the_step_in_a_note() -> None:
    side = FakeSide(_Broken(), ("control",))
    try:
        with pytest.raises(RuntimeError, match="the store went away") as info:
            asyncio.run(step(side, Step.LOADED, Outcome(None)))
    finally:
        side.close()
    assert "tiercheck: in step 'loaded' on channel 'control'" in info.value.__notes__


def test_ranks_at_different_steps_or_tags_are_out_of_step_and_no_message_is_used() -> None:
    """After a channel failed and reconnected, one rank may meet the others at another round:
    its vote of one version must never count as a vote of another, nor a vote as an ack."""
    group = LocalGroup(2, timeout=20)
    meetings = [
        # (rank 0's step and tag, rank 1's): the second and third meet out of step
        ((Step.VOTE, 7), (Step.VOTE, 7)),
        ((Step.VOTE, 9), (Step.VOTE, 6)),
        ((Step.ACK, 6), (Step.VOTE, 6)),
    ]

    def rank(r: int) -> list[object]:
        side = FakeSide(group.coordinator(r), ("local",))

        async def meet() -> list[object]:
            out: list[object] = []
            for pair in meetings:
                which, tag = pair[r]
                try:
                    out.append(await step(side, which, SAMPLES[which](r), channel="local", tag=tag))
                except OutOfStep as exc:
                    out.append(exc.positions)
            return out

        try:
            return asyncio.run(meet())
        finally:
            side.close()

    for r, got in enumerate(_on_ranks(2, rank)):
        assert not isinstance(got, BaseException), (r, got)
        assert got[0] == [SAMPLES[Step.VOTE](0), SAMPLES[Step.VOTE](1)]
        assert got[1] == [("vote", 9), ("vote", 6)]
        assert got[2] == [("ack", 6), ("vote", 6)]
    assert issubclass(OutOfStep, PeerUnavailable)  # callers that know no better see a peer error


def test_the_wire_is_what_it_was_before_the_steps_were_named() -> None:
    """A rank's message is the same plain data as the dicts sent before (msgpack, no pickle)."""
    assert SessionToken("t").to_wire() == {"token": "t"}
    assert Outcome("e").to_wire() == {"error": "e"}
    assert ClaimOutcome({"p": 2}, "").to_wire() == {"generations": {"p": 2}, "failure": ""}
    report = InventoryReport.of(Inventory(0, {"local": frozenset({3, 1})}), {"p": "down"})
    assert report.to_wire() == {"inv": {"local": [1, 3]}, "errors": {"p": "down"}}
    assert SetAsideListing([1], None).to_wire() == {"committed": [1], "error": None}
    completion = SetAsideCompletion(None, [1], [2])
    assert completion.to_wire() == {"error": None, "needs": [1], "held": [2]}
    assert SavesDone(True).to_wire() == {"saved": True}
    assert ServingStopped(False).to_wire() == {"stopped": False}
    # Opening facts carry only what the rank has: no lock, job or held key where it has none.
    assert OpenFacts(node=1, local_rank=1, has_data=False).to_wire() == {
        "node": 1,
        "local_rank": 1,
        "probe": {},
        "identity": None,
        "has_data": False,
    }
    damaged = OpenFacts(node=0, local_rank=0, identity_error="x", identity_damaged=True)
    assert damaged.to_wire() == {
        "node": 0,
        "local_rank": 0,
        "probe": {},
        "identity_error": "x",
        "identity_damaged": True,
        "has_data": True,
    }
