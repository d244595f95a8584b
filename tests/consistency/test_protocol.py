"""The commit protocol's messages and rules (tiercheck.consistency.protocol)."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from tiercheck.consistency.commit import CommitRecord
from tiercheck.consistency.protocol import (
    CommitAck,
    RestoreVerdict,
    Vote,
    commit_record,
    committed_in_tier,
    round_failures,
    whole_in_tier,
)
from tiercheck.consistency.recovery import Inventory


def _over_the_wire(data: object) -> Any:
    return msgpack.unpackb(msgpack.packb(data, use_bin_type=True), raw=False)


def _yes(rank: int, base: int | None = None) -> Vote:
    return Vote(True, key=f"v1/r{rank}.full", size=10 + rank, checksum=7, raw_digest=9, base=base)


@pytest.mark.parametrize(
    "vote", [Vote(False), Vote(False, base_missing=True), _yes(0), _yes(3, base=0)]
)
def test_a_vote_survives_the_wire(vote: Vote) -> None:
    assert Vote.from_wire(_over_the_wire(vote.to_wire())) == vote


def test_a_vote_without_a_blob_sends_no_blob_fields() -> None:
    assert Vote(False, base_missing=True).to_wire() == {"ok": False, "base_missing": True}
    assert "key" in _yes(0).to_wire()


def test_acks_and_verdicts_survive_the_wire() -> None:
    for ack in (CommitAck(True), CommitAck(False, "superseded"), CommitAck(False, "base-missing")):
        assert CommitAck.from_wire(_over_the_wire(ack.to_wire())) == ack
    verdicts = [
        RestoreVerdict(True, "local"),
        RestoreVerdict(False, None, ("local: BlobNotFound: gone", "persistent: corrupt")),
        RestoreVerdict(False, "local", (), ("StateMismatch", "shapes differ at w")),
    ]
    for verdict in verdicts:
        wire = _over_the_wire(verdict.to_wire())
        assert RestoreVerdict.from_wire(wire) == verdict


def test_a_round_fails_for_every_rank_that_voted_no() -> None:
    assert round_failures([_yes(0), _yes(1)]) == []
    assert round_failures([_yes(0), Vote(False), _yes(2), Vote(False, True)]) == [1, 3]


def test_the_commit_record_lists_every_ranks_blob() -> None:
    record = commit_record("job", 1, [_yes(0), _yes(1, base=0)], 5.0)
    assert CommitRecord.from_bytes(record.to_bytes()) == record
    assert record.world_size == 2
    assert record.entry(1).key == "v1/r1.full"
    assert record.entry(1).base == 0
    with pytest.raises(ValueError, match="without a blob"):
        commit_record("job", 1, [_yes(0), Vote(True)], 5.0)


def test_committed_in_a_durable_tier_is_what_commit_records_prove() -> None:
    # A COMMIT record counts even where this rank holds no blob (another node wrote them).
    assert committed_in_tier(commit_records=True, recorded={1, 2}, held={2, 3}) == {1, 2}


def test_committed_in_a_memory_tier_needs_the_blob_still_there() -> None:
    assert committed_in_tier(commit_records=False, recorded={1, 2}, held={2, 3}) == {2}
    assert committed_in_tier(commit_records=False, recorded=set(), held={2, 3}) == set()


def test_whole_in_a_tier_is_what_every_rank_holds_there() -> None:
    everyone = [
        Inventory(0, {"local": frozenset({1, 2, 3}), "persistent": frozenset({1})}),
        Inventory(1, {"local": frozenset({2, 3}), "persistent": frozenset({1, 2})}),
    ]
    assert whole_in_tier("local", {1, 2, 3}, everyone) == {2, 3}
    assert whole_in_tier("persistent", {1, 2}, everyone) == {1}
    assert whole_in_tier("peer", {1}, everyone) == set()
