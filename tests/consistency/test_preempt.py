"""The rules of the flush on SIGTERM (tiercheck.consistency.preempt): pure functions."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tiercheck.consistency.commit import CommitRecord
from tiercheck.consistency.preempt import (
    FlushVote,
    PreemptBegin,
    PreemptOffer,
    choose_flush,
    flush_horizon,
    flush_outcome,
    flush_record,
)


def test_the_horizon_is_the_newest_version_every_rank_launched() -> None:
    # Rank 1 got the signal one save behind rank 0: version 10 waits for nothing from it.
    assert flush_horizon([PreemptBegin(10), PreemptBegin(9)]) == (9, "")
    horizon, why = flush_horizon([PreemptBegin(10), PreemptBegin(-1)])
    assert horizon is None
    assert "saved nothing" in why
    horizon, why = flush_horizon([PreemptBegin(10), PreemptBegin(10, "superseded")])
    assert horizon is None
    assert why.startswith("not every rank")
    assert "rank 1: superseded" in why


def test_the_newest_version_every_rank_holds_goes_where_nothing_as_new_is() -> None:
    offers = [
        PreemptOffer([5, 6, 7], {"persistent": 5, "s3": 7, "gcs": 0}),
        PreemptOffer([5, 6], {"persistent": 5, "s3": 7, "gcs": 0}, {"gcs": "blocked: outage"}),
    ]
    choice = choose_flush(offers)
    assert choice.version == 6
    assert choice.tiers == ("persistent",)
    assert "'s3' holds version 7 already" in choice.why
    assert "'gcs' cannot be written (rank 1: blocked: outage)" in choice.why
    assert choice.trouble  # a tier that should take it cannot


def test_nothing_to_flush_is_no_trouble() -> None:
    none_common = choose_flush([PreemptOffer([3], {"persistent": 0}), PreemptOffer([4], {})])
    assert none_common.version is None
    assert not none_common.trouble
    durable = choose_flush([PreemptOffer([5], {"persistent": 5})] * 2)
    assert durable.version == 5
    assert durable.tiers == ()
    assert not durable.trouble
    refused = choose_flush([PreemptOffer([5], {"persistent": 0}, refusal="closing")] * 2)
    assert refused.version is None
    assert refused.trouble


offers_st = st.lists(
    st.builds(
        PreemptOffer,
        memory=st.lists(st.integers(0, 12), max_size=5),
        durable=st.fixed_dictionaries({"p": st.integers(-1, 12), "q": st.integers(-1, 12)}),
        blocked=st.dictionaries(st.sampled_from(["p", "q"]), st.just("down"), max_size=1),
    ),
    min_size=1,
    max_size=4,
)


@given(offers_st)
def test_the_choice_against_a_plain_model(offers: list[PreemptOffer]) -> None:
    choice = choose_flush(offers)
    every = set.intersection(*(set(o.memory) for o in offers))
    assert choice.version == (max(every) if every else None)
    if choice.version is None:
        assert choice.tiers == ()
        return
    for name in ("p", "q"):
        wanted = all(o.durable[name] < choice.version and name not in o.blocked for o in offers)
        assert (name in choice.tiers) == wanted
    # Every message survives the wire.
    for offer in offers:
        assert PreemptOffer.from_wire(offer.to_wire()) == offer


def test_the_outcome_of_the_votes() -> None:
    yes = [FlushVote(7, "p", key=f"v7/r{r}", size=3, checksum=r, raw_digest=9) for r in range(3)]
    assert flush_outcome(yes, 7, "p") == (False, [])
    record = flush_record("job", yes, 1.0)
    assert isinstance(record, CommitRecord)
    assert [(e.rank, e.key, e.base) for e in record.entries] == [
        (r, f"v7/r{r}", None) for r in range(3)
    ]
    # The version's own save committed it meanwhile: its COMMIT record is there.
    assert flush_outcome([yes[0], FlushVote(7, "p", already=True), yes[2]], 7, "p") == (True, [])
    no = FlushVote(7, "p", why="disk full")
    assert flush_outcome([yes[0], no, yes[2]], 7, "p") == (False, [1])
    # Ranks out of step (another version, another tier) fail: never a mixed COMMIT record.
    assert flush_outcome([yes[0], FlushVote(6, "p", key="v6/r1"), yes[2]], 7, "p") == (False, [1])
    assert flush_outcome([FlushVote(7, "q", key="v7/r0"), *yes[1:]], 7, "p") == (False, [0])
    with pytest.raises(ValueError, match="rank 1 wrote no blob"):
        flush_record("job", [yes[0], no, yes[2]], 1.0)
