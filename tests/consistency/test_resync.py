"""The resynchronization rule of the commit rounds (pure): who gives up, who waits, what stays."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tiercheck.consistency.resync import PHASES, Resync, resync, unsure_kept


def test_a_rank_behind_gives_up_the_rounds_below_the_furthest_version() -> None:
    # Rank 1 paused in the vote of 6; rank 0 went on to the vote of 29 meanwhile.
    positions: list[tuple[str, int | None]] = [("vote", 29), ("vote", 6)]
    assert resync(("vote", 6), positions) == Resync(True, 29, (29, 0))
    assert resync(("vote", 29), positions) == Resync(False, -1, (29, 0))


def test_the_ack_of_a_version_is_further_than_its_vote() -> None:
    positions: list[tuple[str, int | None]] = [("ack", 7), ("vote", 7), ("vote", 3)]
    assert resync(("vote", 7), positions).behind
    assert resync(("vote", 7), positions).floor == 7
    assert not resync(("ack", 7), positions).behind
    # The vote of a later version is further than the ack of an earlier one.
    assert resync(("ack", 7), [("ack", 7), ("vote", 8)]) == Resync(True, 8, (8, 0))


def test_a_message_that_is_no_commit_step_counts_as_furthest_behind() -> None:
    positions: list[tuple[str, int | None]] = [("vote", 4), ("close-saved", None), ("?", None)]
    assert not resync(("vote", 4), positions).behind


positions_st = st.lists(
    st.tuples(st.sampled_from(sorted(PHASES)), st.integers(0, 50)), min_size=1, max_size=6
)


@given(positions_st, st.data())
def test_exactly_the_ranks_at_the_furthest_position_wait(
    positions: list[tuple[str, int]], data: st.DataObject
) -> None:
    furthest = max((v, PHASES[s]) for s, v in positions)
    for mine in positions:
        decision = resync(mine, list(positions))
        at_furthest = (mine[1], PHASES[mine[0]]) == furthest
        assert decision.behind is not at_furthest
        assert decision.furthest == furthest
        if decision.behind:
            # It skips to the furthest version: never to one a waiting rank is past, never
            # below its own (versions only go up).
            assert decision.floor == furthest[0] >= mine[1]
    # Every rank behind skips to the version the waiting ranks stand at: after one exchange
    # they can all meet there (nobody skips past it, nobody stays below it).
    floors = {resync(m, list(positions)).floor for m in positions}
    assert floors <= {-1, furthest[0]}
    del data


def test_unsure_versions_stay_until_keep_newer_versions_are_committed() -> None:
    assert unsure_kept({5}, {1, 2, 3}, keep=2) == {5}
    assert unsure_kept({5}, {1, 6}, keep=2) == {5}  # one newer committed version: may be kept
    assert unsure_kept({5}, {6, 7}, keep=2) == set()  # two newer: no rank keeps 5
    assert unsure_kept({5, 9}, {4, 6, 7}, keep=2) == {9}
    assert unsure_kept({5}, set(), keep=1) == {5}


@given(st.sets(st.integers(0, 30)), st.sets(st.integers(0, 30)), st.integers(1, 4))
def test_an_unsure_version_is_released_only_below_the_keep_window(
    unsure: set[int], committed: set[int], keep: int
) -> None:
    kept = unsure_kept(unsure, committed, keep)
    assert kept <= unsure
    for version in unsure - kept:
        assert len([c for c in committed if c > version]) >= keep
    for version in kept:
        assert len([c for c in committed if c > version]) < keep
