"""Retention policy: keep the newest committed versions and the bases they need."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tiercheck.consistency.retention import evictable


def test_keeps_newest_and_their_base() -> None:
    own = {0: None, 1: 0, 2: 0, 3: 0, 10: None, 11: 10}
    out = evictable(committed={0, 1, 2, 3, 10, 11}, own=own, keep=2, settled_upto=11)
    assert out == [0, 1, 2, 3]
    out = evictable(committed={0, 1, 2, 3}, own={0: None, 1: 0, 2: 0, 3: 0}, keep=2, settled_upto=3)
    assert out == [1]  # 0 is the base of the kept deltas 2 and 3


def test_nothing_committed_evicts_nothing() -> None:
    assert evictable(committed=set(), own={1: None, 2: None}, keep=1, settled_upto=2) == []


def test_unsettled_and_protected_versions_stay() -> None:
    own = {1: None, 2: None, 3: None, 4: None}
    assert evictable(committed={1, 2}, own=own, keep=1, settled_upto=2) == [1]
    assert evictable(committed={1, 2}, own=own, keep=1, settled_upto=4, protected={3}) == [1, 4]


def test_failed_versions_are_collected() -> None:
    own = {1: None, 2: None, 3: None}
    assert evictable(committed={1, 3}, own=own, keep=1, settled_upto=3) == [1, 2]


def test_keep_must_be_positive() -> None:
    with pytest.raises(ValueError, match="keep"):
        evictable(committed={1}, own={1: None}, keep=0, settled_upto=1)


@given(
    st.dictionaries(st.integers(0, 40), st.none() | st.integers(0, 40), max_size=30),
    st.sets(st.integers(0, 40)),
    st.integers(1, 5),
    st.integers(-1, 40),
)
def test_invariants(
    own: dict[int, int | None], committed: set[int], keep: int, settled: int
) -> None:
    out = set(evictable(committed=committed, own=own, keep=keep, settled_upto=settled))
    kept = set(sorted(committed)[-keep:])
    assert out <= set(own)
    assert not out & kept
    assert all(v <= settled for v in out)
    for v in kept:
        base = own.get(v)
        if base is not None:
            assert base not in out


def test_a_kept_blob_of_unknown_base_keeps_every_older_blob() -> None:
    from tiercheck.consistency.retention import UNKNOWN_BASE

    # After the node's manifest was lost, a packed blob's base is unknown: any older blob may
    # be it, so none of them goes while it is kept.
    own = {0: None, 1: UNKNOWN_BASE, 2: UNKNOWN_BASE, 3: None}
    assert evictable(committed={0, 1, 2, 3}, own=own, keep=2, settled_upto=3) == []
    # Once newer, known versions fill the window, the unknown ones and their bases go.
    own.update({4: None, 5: 4})
    assert evictable(committed={0, 1, 2, 3, 4, 5}, own=own, keep=2, settled_upto=5) == [0, 1, 2, 3]
