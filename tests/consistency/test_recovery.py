"""Agreement on v*: the newest version every rank can rebuild."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tiercheck.consistency.recovery import Inventory, agree, candidates


def test_newest_common_version() -> None:
    a = Inventory(0, {"local": frozenset({5, 6, 7}), "persistent": frozenset({0, 5})})
    b = Inventory(
        1, {"local": frozenset(), "peer": frozenset({6}), "persistent": frozenset({0, 5})}
    )
    assert agree([a, b]) == 6
    assert candidates([a, b]) == [6, 5, 0]
    assert a.sources(5) == ["local", "persistent"]
    assert agree([a, b], excluded=frozenset({6})) == 5


def test_nothing_common() -> None:
    assert (
        agree([Inventory(0, {"local": frozenset({1})}), Inventory(1, {"local": frozenset({2})})])
        is None
    )
    assert agree([]) is None


def test_wire_round_trip() -> None:
    inv = Inventory(3, {"local": frozenset({1, 2}), "persistent": frozenset()})
    assert Inventory.from_wire(3, inv.to_wire()) == inv


@given(
    st.lists(
        st.dictionaries(
            st.sampled_from(["local", "peer", "persistent"]), st.frozensets(st.integers(0, 30))
        ),
        min_size=1,
        max_size=5,
    )
)
def test_agreed_version_is_rebuildable_by_all_and_newest(
    raw: list[dict[str, frozenset[int]]],
) -> None:
    invs = [Inventory(r, d) for r, d in enumerate(raw)]
    chosen = agree(invs)
    everyone = set.intersection(*[set(i.versions()) for i in invs])
    if chosen is None:
        assert not everyone
    else:
        assert all(i.sources(chosen) for i in invs)
        assert chosen == max(everyone)
