"""The pure rules of abandoned sets (tiercheck/consistency/abandoned.py): keys, tags, the
``SET`` record, and what retention may remove."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tiercheck.consistency.abandoned import (
    AbandonedSet,
    SetInfo,
    abandoned_key,
    expired,
    kept_and_removable,
    parse_abandoned_key,
    parse_tag,
    set_record_key,
    set_tag,
)
from tiercheck.errors import FormatError, UnsupportedFormat


def test_keys_and_tags_round_trip() -> None:
    tag = set_tag(6, "3f2a9c1e77d0b4a5")
    assert tag == "from-v000000000006-3f2a9c1e77d0b4a5"
    assert parse_tag(tag) == (6, "3f2a9c1e77d0b4a5")
    key = abandoned_key(tag, "v000000000010/r00000.packed")
    assert parse_abandoned_key(key) == (tag, "v000000000010/r00000.packed")
    assert parse_abandoned_key(set_record_key(tag)) == (tag, "SET")
    for other in ("abandoned/", "abandoned/x/v1", "quarantine/from-v000000000006-a/SET", "JOB"):
        assert parse_abandoned_key(other) is None


def test_the_set_record_round_trips_and_refuses_what_it_is_not() -> None:
    record = AbandonedSet("job", 5, (6, 7), "abc", 12.5, "the run went back to version 5")
    assert AbandonedSet.from_bytes(record.to_bytes()) == record
    with pytest.raises(FormatError):
        AbandonedSet.from_bytes(b"{not json")
    with pytest.raises(FormatError):
        AbandonedSet.from_bytes(b'{"format": "tiercheck.job/1"}')
    with pytest.raises(UnsupportedFormat):
        AbandonedSet.from_bytes(b'{"format": "tiercheck.abandoned/2"}')


def test_a_set_expires_once_the_run_has_keep_versions_of_its_own_after_it() -> None:
    sets = {"a": 6}
    assert expired(sets, {4, 5, 6}, keep=2) == []
    assert expired(sets, {4, 5, 6, 7}, keep=2) == ["a"]


def test_a_set_another_kept_set_needs_a_base_from_stays() -> None:
    """Going back twice: the later set (from 3) holds version 4, the base of the earlier set's
    (from 5) delta 5. The later set expires first by the count, but it must stay while the
    earlier one does."""
    sets = {
        "earlier": SetInfo(first=5, versions=frozenset({5, 6}), needs=frozenset({4})),
        "later": SetInfo(first=3, versions=frozenset({3, 4}), needs=frozenset({2})),
    }
    protected, removable = kept_and_removable(sets, committed={2, 3, 4}, keep=3)
    assert removable == []  # "later" expired (3, 4 >= 3 ... 3 versions), but "earlier" needs 4
    assert protected == {2, 4}
    protected, removable = kept_and_removable(sets, committed={2, 3, 4, 5, 6, 7}, keep=3)
    assert removable == ["earlier", "later"]
    assert protected == frozenset()


@given(
    sets=st.dictionaries(
        st.text("abcdef", min_size=1, max_size=3),
        st.tuples(
            st.integers(0, 20),
            st.frozensets(st.integers(0, 30), max_size=5),
            st.frozensets(st.integers(0, 30), max_size=3),
        ),
        max_size=5,
    ),
    committed=st.frozensets(st.integers(0, 40), max_size=12),
    keep=st.integers(1, 5),
)
def test_no_kept_set_ever_loses_what_it_needs(
    sets: dict[str, tuple[int, frozenset[int], frozenset[int]]],
    committed: frozenset[int],
    keep: int,
) -> None:
    infos = {tag: SetInfo(first, versions, needs) for tag, (first, versions, needs) in sets.items()}
    protected, removable = kept_and_removable(infos, committed, keep)
    assert set(removable) <= set(expired({t: s.first for t, s in infos.items()}, committed, keep))
    kept = set(infos) - set(removable)
    for tag in kept:
        # Whatever a kept set needs is protected live, and no set holding it goes.
        assert infos[tag].needs <= protected
        for gone in removable:
            assert not infos[gone].versions & infos[tag].needs
