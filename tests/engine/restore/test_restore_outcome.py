"""A restore's outcome as a pure step (tiercheck/engine/restore/restore.py): what each tier adopts,
where the schedule restarts, what the timeline sets aside -- on inventories and tiers made up here,
without a checkpointer, tiers or ranks; and the one place that applies it (:meth:`Restorer.apply`),
on recording stand-ins of the objects that own the fields."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from types import SimpleNamespace
from typing import Any, cast

from tiercheck.consistency.manifest import Commit
from tiercheck.consistency.recovery import Inventory
from tiercheck.engine.commit.retain import Retention
from tiercheck.engine.health import CommitLag
from tiercheck.engine.restore.restore import (
    RestoreOutcome,
    Restorer,
    TierAdoption,
    TierView,
    fresh_outcome,
    restore_outcome,
)
from tiercheck.engine.restore.timeline import Continuation


def inv(rank: int, **by_tier: Collection[int]) -> Inventory:
    return Inventory(rank, {name: frozenset(vs) for name, vs in by_tier.items()})


def outcome(
    tiers: Sequence[TierView],
    everyone: Sequence[Inventory] = (),
    *,
    chosen: int = 5,
    requested: int | None = None,
    rejected: dict[int, list[str]] | None = None,
) -> RestoreOutcome:
    return restore_outcome(
        chosen=chosen,
        requested=requested,
        source="local",
        sources=["local", None, "persistent"],
        rejected=rejected or {},
        saved_by=3,
        tiers=tiers,
        everyone=everyone,
    )


def test_a_durable_tier_counts_every_commit_record_up_to_the_restored_version() -> None:
    listed = frozenset({1, 3, 5, 7, 9})  # 7 and 9 are after the restored version
    got = outcome(
        [
            TierView("persistent", True, False, frozenset({5}), frozenset({9}), listed),
            TierView("other", True, True, frozenset(), frozenset({9}), listed),
        ]
    )
    # Replaced, not merged: 9 (newer than the restored version) is no longer counted; a tier
    # this rank could not list keeps what it counts.
    assert got.tiers == (
        TierAdoption("persistent", frozenset({1, 3, 5}), ()),
        TierAdoption("other", None, ()),
    )


def test_a_memory_tier_adopts_what_every_rank_holds_up_to_the_restored_version() -> None:
    everyone = [inv(0, local={2, 4, 5, 6}), inv(1, local={2, 4, 5, 6, 8}), inv(2, local={4, 5, 6})]
    mine = TierView("local", False, False, frozenset({2, 4, 5, 6}), frozenset({4}))
    got = outcome([mine], everyone)
    # 2: not whole (rank 2 lacks it); 4: committed already; 6: after the restored version.
    assert got.tiers == (TierAdoption("local", None, (5,)),)
    # Only what this rank holds itself counts, and nothing when no rank lists the tier.
    bare = TierView("local", False, False, frozenset({5}), frozenset())
    assert outcome([bare], everyone).tiers == (TierAdoption("local", None, (5,)),)
    assert outcome([bare], [inv(0), inv(1)]).tiers == (TierAdoption("local", None, ()),)


def test_the_adopted_versions_come_in_order_and_the_tiers_in_pipeline_order() -> None:
    held = frozenset({9, 1, 5, 3})
    everyone = [inv(0, peer=held, local=held), inv(1, peer=held, local=held)]
    got = outcome(
        [
            TierView("local", False, False, held, frozenset()),
            TierView("persistent", True, False, held, frozenset(), frozenset({3})),
            TierView("peer", False, False, held, frozenset()),
        ],
        everyone,
        chosen=9,
    )
    assert [t.name for t in got.tiers] == ["local", "persistent", "peer"]
    assert got.tiers[0].adopted == got.tiers[2].adopted == (1, 3, 5, 9)
    assert got.tiers[1] == TierAdoption("persistent", frozenset({3}), ())


def test_the_schedule_restarts_and_the_timeline_goes_on_from_the_restored_version() -> None:
    got = outcome([], chosen=7)
    assert got.version == got.restart_from == 7
    assert got.continuation == Continuation(
        7, "the run went on from version 7, the newest every rank could restore"
    )
    back = outcome([], chosen=4, requested=4)
    assert back.continuation == Continuation(4, "the run went back to version 4")
    # Passed-over versions are named, newest or not, in order; a requested version wins.
    rejected = {9: ["rank 1: bad"], 8: ["rank 0: worse", "rank 2: bad"]}
    passed = outcome([], chosen=7, rejected=rejected)
    assert passed.continuation == Continuation(7, "versions [8, 9] could not be restored")
    assert outcome([], chosen=7, requested=7, rejected=rejected).continuation == Continuation(
        7, "the run went back to version 7"
    )
    assert passed.rejected == {9: ("rank 1: bad",), 8: ("rank 0: worse", "rank 2: bad")}
    rejected[9].append("changed afterwards")
    assert passed.rejected[9] == ("rank 1: bad",), "the outcome keeps its own copy"


def test_the_result_names_every_ranks_source_and_the_saving_world() -> None:
    got = outcome([], chosen=6)
    restored = got.restored({"w": 1}, 0.5)
    assert (restored.version, restored.state, restored.seconds) == (6, {"w": 1}, 0.5)
    assert restored.source_tier == "local"
    # A rank without a source (it failed) is named with "".
    assert restored.source_tiers == {0: "local", 1: "", 2: "persistent"}
    assert (restored.saved_by, restored.rejected) == (3, {})


def test_a_fresh_start_changes_no_tier_and_only_starts_the_session() -> None:
    for torn in (False, True):
        got = fresh_outcome(torn=torn)
        assert (got.version, got.restart_from, got.tiers) == (None, None, ())
    assert fresh_outcome(torn=False).continuation is None
    # Pieces of saves that never committed: the first save removes every version.
    assert fresh_outcome(torn=True).continuation == Continuation(
        -1, "pieces of saves that never committed, no whole version"
    )


class _Recorder:
    """Stands in for the objects a restore's outcome changes: records each call, in order."""

    def __init__(self, calls: list[tuple[Any, ...]], name: str) -> None:
        self.calls, self.name = calls, name
        self.session_started = False

    def adopt(self, *, committed: Collection[int] | None, adopted: Collection[int]) -> None:
        self.calls.append((self.name, "adopt", committed, tuple(adopted)))

    def restart_from(self, version: int) -> None:
        self.calls.append((self.name, "restart_from", version))

    def ready_after(self, version: int) -> None:
        self.calls.append((self.name, "ready_after", version))

    def begin_session(self) -> None:
        self.session_started = True

    def drop_base(self) -> None:
        self.calls.append((self.name, "drop_base"))

    def continue_from(self, continuation: Continuation) -> None:
        self.calls.append((self.name, "continue_from", continuation))


def _restorer(calls: list[tuple[Any, ...]]) -> tuple[Restorer, _Recorder]:
    pipes = {n: _Recorder(calls, n) for n in ("local", "persistent")}
    schedule = _Recorder(calls, "schedule")
    options = SimpleNamespace(job=SimpleNamespace(topology=SimpleNamespace(rank=0), job_id="j"))
    restorer = Restorer(
        cast(Any, options),
        cast(Any, None),
        cast(Any, None),
        pipes=cast(Any, pipes),
        reader=cast(Any, None),
        elastic=cast(Any, None),
        schedule=cast(Any, schedule),
        encoder=cast(Any, _Recorder(calls, "encoder")),
        timeline=cast(Any, _Recorder(calls, "timeline")),
    )
    return restorer, schedule


def test_apply_hands_each_part_of_the_outcome_to_the_object_that_owns_it() -> None:
    calls: list[tuple[Any, ...]] = []
    restorer, schedule = _restorer(calls)
    everyone = [inv(0, local={3, 4}), inv(1, local={3, 4})]
    restorer.apply(
        outcome(
            [
                TierView("local", False, False, frozenset({3, 4}), frozenset()),
                TierView("persistent", True, False, frozenset(), frozenset(), frozenset({1, 4})),
            ],
            everyone,
            chosen=4,
        )
    )
    assert calls == [
        ("local", "adopt", None, (3, 4)),
        ("persistent", "adopt", frozenset({1, 4}), ()),
        ("local", "ready_after", 4),
        ("persistent", "ready_after", 4),
        ("schedule", "restart_from", 4),
        ("encoder", "drop_base"),
        (
            "timeline",
            "continue_from",
            Continuation(4, "the run went on from version 4, the newest every rank could restore"),
        ),
    ]
    assert not schedule.session_started  # restart_from starts it, in the schedule's own hands


def test_apply_of_a_fresh_start_starts_the_session_and_keeps_the_held_base() -> None:
    for torn in (False, True):
        calls: list[tuple[Any, ...]] = []
        restorer, schedule = _restorer(calls)
        restorer.apply(fresh_outcome(torn=torn))
        assert schedule.session_started
        expected = fresh_outcome(torn=True).continuation
        assert calls == ([("timeline", "continue_from", expected)] if torn else [])


class _Journal:
    def __init__(self) -> None:
        self.records: list[Any] = []

    def log(self, *records: Any) -> None:
        self.records.extend(records)


def test_a_tier_adopts_what_the_outcome_says_and_tells_the_manifest_of_what_it_adds() -> None:
    journal = _Journal()
    tier = Retention()
    tier.journal, tier.name, tier.committed = cast(Any, journal), "local", {1, 9}
    tier.lag = CommitLag("local", saves=10, seconds=600)
    tier.adopt(committed=None, adopted=(3, 5))
    assert tier.committed == {1, 3, 5, 9}
    assert journal.records == [Commit(3, "local"), Commit(5, "local")]
    assert tier.lag.snapshot().newest == 9  # what health() reports starts from there
    # Replaced (a durable tier's COMMIT records up to the restored version): nothing to tell.
    tier.adopt(committed=frozenset({1, 3}), adopted=())
    assert tier.committed == {1, 3}
    assert len(journal.records) == 2
    tier.forget_bases({1, 7})
    assert tier.committed == {3}
