"""The save planning rules (tiercheck.engine.save.plan), and the schedule that feeds and keeps them.

Every rule of :func:`plan_save` has a row in a table; Hypothesis then checks that the plan, and
the schedule's transitions around it, decide exactly what the engine decided before planning
was pulled into one place (an oracle transcribed from that code: ``_OldSchedule``).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from types import SimpleNamespace
from typing import Any, Literal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiercheck.engine.options import ScheduleOptions, TierOptions, TierPolicy
from tiercheck.engine.save.plan import (
    Kept,
    SaveInputs,
    SavePlan,
    Waiting,
    base_unusable,
    catch_up,
    make_room,
    plan_save,
    queue_full,
    waits_for_slot,
)
from tiercheck.engine.save.schedule import Schedule

ALL_PACKED = TierPolicy(encoding="packed")
ALL_FULL = TierPolicy(encoding="full")
BASES_FULL = TierPolicy(encoding="full", versions="base")
BASES_PACKED = TierPolicy(encoding="packed", versions="base")
EVEN_FULL = TierPolicy(encoding="full", versions=lambda v: v % 2 == 0)

TWO = {"local": ALL_FULL, "persistent": ALL_PACKED}


def _in(**kw: Any) -> SaveInputs:
    """Inputs of a save of version 7, the second since opening, against base 6, by default."""
    base: dict[str, Any] = {"version": 7, "count": 1, "base_every": 3, "policies": TWO}
    base.update(planned_base=6, reservable=("local",))
    base.update(kw)
    return SaveInputs(**base)


DELTA_7 = SavePlan(7, "delta", 6, False, (("local", "full"), ("persistent", "packed")), "local")
BASE_7 = replace(DELTA_7, kind="base", base=None)

RULES: list[tuple[str, SaveInputs, SavePlan]] = [
    ("a save between bases is a delta on the planned base", _in(), DELTA_7),
    (
        "every base_every-th save is a base",
        _in(count=3),
        replace(BASE_7, scheduled_base=True),
    ),
    ("the first save is a base", _in(count=0), replace(BASE_7, scheduled_base=True)),
    ("base_every=1: every save is a base", _in(base_every=1), replace(BASE_7, scheduled_base=True)),
    ("no base planned yet: a base", _in(planned_base=None), BASE_7),
    ("a delta's base vanished: a base", _in(force_base=True), BASE_7),
    (
        "busy with on_busy=skip: skipped, same tiers, no staging tier",
        _in(busy=True, on_busy="skip"),
        replace(DELTA_7, kind="skipped", base=None, stage_in=None),
    ),
    (
        "a skip is planned before the base rule",
        _in(busy=True, on_busy="skip", force_base=True, count=3),
        replace(DELTA_7, kind="skipped", base=None, stage_in=None, scheduled_base=True),
    ),
    ("busy with on_busy=wait: planned as usual (after waiting)", _in(busy=True), DELTA_7),
    (
        "a tier taking bases only skips a delta",
        _in(policies={"local": BASES_FULL, "persistent": ALL_PACKED}),
        replace(DELTA_7, targets=(("persistent", "packed"),), stage_in=None),
    ),
    (
        "a tier taking bases only takes a scheduled base",
        _in(policies={"local": ALL_FULL, "persistent": BASES_PACKED}, count=6),
        replace(BASE_7, scheduled_base=True),
    ),
    (
        "a tier taking bases only skips a base that was not scheduled (forced)",
        _in(policies={"local": ALL_FULL, "persistent": BASES_PACKED}, force_base=True),
        replace(BASE_7, targets=(("local", "full"),)),
    ),
    (
        "a predicate selects versions",
        _in(policies={"local": EVEN_FULL, "persistent": ALL_PACKED}, version=8),
        replace(DELTA_7, version=8),
    ),
    (
        "a predicate's tier skips the versions it does not select",
        _in(policies={"local": EVEN_FULL, "persistent": ALL_PACKED}),
        replace(DELTA_7, targets=(("persistent", "packed"),), stage_in=None),
    ),
    (
        "a predicate's tier takes every scheduled base",
        _in(policies={"local": EVEN_FULL, "persistent": ALL_PACKED}, count=0),
        replace(BASE_7, scheduled_base=True),
    ),
    ("no tier selected: no targets", _in(policies={}), replace(DELTA_7, targets=(), stage_in=None)),
    (
        "targets keep tier order",
        _in(policies={"persistent": ALL_PACKED, "local": ALL_FULL}),
        replace(DELTA_7, targets=(("persistent", "packed"), ("local", "full"))),
    ),
    (
        "a reservable tier storing packed blobs takes no snapshot in place",
        _in(policies={"local": ALL_PACKED, "persistent": ALL_PACKED}),
        replace(DELTA_7, targets=(("local", "packed"), ("persistent", "packed")), stage_in=None),
    ),
    (
        "the first reservable tier storing full blobs takes it",
        _in(policies={"a": ALL_PACKED, "b": ALL_FULL, "c": ALL_FULL}, reservable=("a", "b", "c")),
        replace(DELTA_7, targets=(("a", "packed"), ("b", "full"), ("c", "full")), stage_in="b"),
    ),
    (
        "a full tier that cannot reserve takes no snapshot in place",
        _in(reservable=()),
        replace(DELTA_7, stage_in=None),
    ),
    (
        "a GPU state with a pinned pool goes to a staging buffer",
        _in(on_host=False, pinned=True),
        replace(DELTA_7, stage_in=None),
    ),
    (
        "a GPU state without a pinned pool is copied in place",
        _in(on_host=False, pinned=False),
        DELTA_7,
    ),
    ("a host state with a pinned pool is copied in place", _in(pinned=True), DELTA_7),
]


@pytest.mark.parametrize(("inputs", "expected"), [r[1:] for r in RULES], ids=[r[0] for r in RULES])
def test_plan_rules(inputs: SaveInputs, expected: SavePlan) -> None:
    assert plan_save(inputs) == expected


def test_plan_encodings_is_a_fresh_dict() -> None:
    plan = plan_save(_in())
    encodings = plan.encodings
    assert encodings == {"local": "full", "persistent": "packed"}
    encodings["other"] = "full"
    assert plan.encodings == {"local": "full", "persistent": "packed"}


@pytest.mark.parametrize(
    ("kind", "base", "held", "unusable"),
    [
        ("delta", 6, 6, False),  # its base is held: a delta
        ("delta", 6, None, True),  # no base held (it failed, or a restore dropped it)
        ("delta", 6, 9, True),  # another base is held
        ("base", None, None, False),
        ("base", None, 6, False),
        ("skipped", None, None, False),
    ],
)
def test_base_unusable(
    kind: Literal["base", "delta", "skipped"], base: int | None, held: int | None, unusable: bool
) -> None:
    assert base_unusable(kind, base, held) is unusable


@pytest.mark.parametrize(
    ("queued", "tier_queue", "full"), [(0, 1, False), (1, 1, True), (1, 2, False), (3, 2, True)]
)
def test_queue_full(queued: int, tier_queue: int, full: bool) -> None:
    assert queue_full(queued, tier_queue) is full


@pytest.mark.parametrize(
    ("busy", "on_busy", "waits"),
    [(False, "wait", False), (True, "wait", True), (True, "skip", False), (False, "skip", False)],
)
def test_waits_for_slot(busy: bool, on_busy: Literal["wait", "skip"], waits: bool) -> None:
    assert waits_for_slot(busy, on_busy) is waits


# --- the schedule, against the code it replaced ----------------------------------------------


class _Reserving:
    """A tier that can reserve memory (all the schedule asks of it)."""

    async def reserve(self, key: str, nbytes: int) -> Any:
        raise AssertionError("the schedule only plans; it never reserves")


def _schedule(
    policies: dict[str, TierPolicy],
    reservable: set[str],
    *,
    base_every: int,
    on_busy: Literal["wait", "skip"],
    max_pending: int = 1,
) -> Schedule:
    """A schedule over tiers named by ``policies`` (``reservable`` of them can reserve)."""
    options: Any = SimpleNamespace(
        tiers=TierOptions((), policies, None, 0, 2),
        schedule=ScheduleOptions(base_every, on_busy, max_pending, False),
        job=SimpleNamespace(topology=SimpleNamespace(world_size=1), job_id="job"),
    )
    stats: Any = SimpleNamespace(saves=0)
    claim: Any = SimpleNamespace()  # planning never asks the claim
    pipes: Any = {
        name: SimpleNamespace(tier=_Reserving() if name in reservable else object())
        for name in policies
    }
    return Schedule(options, stats, claim, pipes)


class _OldSchedule:
    """The decisions as the engine took them before :mod:`tiercheck.engine.save.plan` (transcribed
    from ``Schedule.targets``/``kind``, ``Stager.stage``, ``Engine._save`` and ``Encoder``)."""

    def __init__(self, policies: dict[str, TierPolicy], reservable: set[str], base_every: int):
        self.policies, self.reservable, self.base_every = policies, reservable, base_every
        self.count = 0
        self.planned_base: int | None = None
        self.force_base = False

    def save(self, version: int, busy_skip: bool, in_place: bool) -> tuple[Any, ...]:
        scheduled_base = self.count % self.base_every == 0
        targets = {
            n: p.encoding for n, p in self.policies.items() if p.targets(version, scheduled_base)
        }
        if busy_skip:
            self.count += 1
            return ("skipped", None, targets, None)
        if scheduled_base or self.planned_base is None or self.force_base:
            self.force_base = False
            kind = "base"
        else:
            kind = "delta"
        reserving = next(
            (n for n in self.policies if n in self.reservable and targets.get(n) == "full"), None
        )
        stage_in = reserving if in_place else None
        return (kind, None if kind == "base" else self.planned_base, targets, stage_in)

    def staged(self, version: int, kind: str) -> None:
        self.count += 1
        if kind == "base":
            self.planned_base = version

    def encoded(self, job: dict[str, Any], held: int | None) -> None:
        if job["kind"] == "delta" and not (held is not None and held == job["base"]):
            job["kind"] = "base"
        if job["kind"] == "base":
            self.planned_base = job["version"]

    def failed(self, job: dict[str, Any]) -> None:
        if job["kind"] == "base" and self.planned_base == job["version"]:
            self.planned_base = None

    def unconfirmed(self, job: dict[str, Any]) -> None:
        if job["kind"] == "base":
            if self.planned_base == job["version"]:
                self.planned_base = None
            self.force_base = True


_POLICY = st.sampled_from([ALL_FULL, ALL_PACKED, BASES_FULL, BASES_PACKED, EVEN_FULL])
_SAVE = st.tuples(st.just("save"), st.booleans(), st.booleans(), st.booleans())
_EVENT = st.one_of(
    _SAVE,
    _SAVE,  # saves twice as often as each outcome: most outcomes need a save before them
    st.tuples(st.just("encoded"), st.integers(0, 30)),
    st.tuples(st.just("failed"), st.integers(0, 30)),
    st.tuples(st.just("unconfirmed"), st.integers(0, 30)),
    st.tuples(st.just("lose_base")),
    st.tuples(st.just("restart")),
)


@settings(max_examples=300, deadline=None)
@given(
    policies=st.dictionaries(st.sampled_from(["a", "b", "c"]), _POLICY, max_size=3),
    reservable=st.sets(st.sampled_from(["a", "b", "c"])),
    base_every=st.integers(2, 4),  # 1: every save is a base (a row of the table)
    on_busy=st.sampled_from(["wait", "skip"]),
    pinned=st.booleans(),
    events=st.lists(_EVENT, max_size=30),
)
def test_schedule_decides_as_before(
    *,
    policies: dict[str, TierPolicy],
    reservable: set[str],
    base_every: int,
    on_busy: Literal["wait", "skip"],
    pinned: bool,
    events: list[tuple[Any, ...]],
) -> None:
    """Random saves (busy or not, on the host or not, staged or failing) and encoder outcomes
    (a base held, a failure, a snapshot found changed, a base lost, a restore): the new
    schedule plans what the old code chose, and keeps the same state."""

    async def run() -> None:
        new = _schedule(policies, reservable, base_every=base_every, on_busy=on_busy)
        old = _OldSchedule(policies, reservable, base_every)
        jobs: list[tuple[dict[str, Any], dict[str, Any]]] = []  # (old's job, new's job)
        held_old: int | None = None
        held_new: int | None = None
        version = 0
        for event in events:
            if event[0] == "save":
                _, busy, on_host, stage_fails = event
                version += 1
                new.pending = [object()] if busy and on_busy == "skip" else []  # type: ignore[list-item]
                plan = await new.plan(version, on_host=on_host, pinned=pinned)
                kind, base, targets, stage_in = old.save(
                    version, busy and on_busy == "skip", on_host or not pinned
                )
                assert (plan.kind, plan.base, plan.encodings, plan.stage_in) == (
                    kind,
                    base,
                    targets,
                    stage_in,
                )
                if plan.kind == "skipped":
                    new.consume(version)
                elif not stage_fails:
                    new.staged(plan)
                    old.staged(version, kind)
                    jobs.append(
                        (
                            {"version": version, "kind": kind, "base": base},
                            {"version": version, "kind": plan.kind, "base": plan.base},
                        )
                    )
            elif event[0] in ("encoded", "failed", "unconfirmed") and jobs:
                old_job, new_job = jobs[event[1] % len(jobs)]
                if event[0] == "encoded":
                    old.encoded(old_job, held_old)
                    if base_unusable(new_job["kind"], new_job["base"], held_new):
                        new_job["kind"] = "base"
                    if old_job["kind"] == "base":
                        held_old = old_job["version"]
                    if new_job["kind"] == "base":
                        new.base_in_memory(new_job["version"])
                        held_new = new_job["version"]
                elif event[0] == "failed":
                    old.failed(old_job)
                    if new_job["kind"] == "base":
                        new.base_failed(new_job["version"])
                elif new_job["kind"] == "base":
                    old.unconfirmed(old_job)
                    new.base_unconfirmed(new_job["version"])
            elif event[0] == "lose_base":
                old.force_base = True
                new.lose_base()
            elif event[0] == "restart":
                old.count, old.planned_base = 0, None
                new.restart_from(version)
                held_old = held_new = None
            assert (new.count, new.planned_base, new.force_base) == (
                old.count,
                old.planned_base,
                old.force_base,
            )

    asyncio.run(run())


@pytest.mark.parametrize("meanwhile", ["lose_base", "restart"])
def test_a_busy_save_is_planned_after_its_wait_from_the_tiers_chosen_before(
    meanwhile: str,
) -> None:
    """on_busy="wait": the tiers come from the schedule as the save was called; base or delta
    from the schedule once a slot is free (a base lost meanwhile makes it a base)."""

    async def run() -> tuple[SavePlan, Schedule]:
        schedule = _schedule(
            {"local": BASES_FULL, "persistent": ALL_PACKED},
            {"local"},
            base_every=2,
            on_busy="wait",
        )
        first = await schedule.plan(1, on_host=True, pinned=False)
        assert first.kind == "base"
        schedule.staged(first)
        schedule.base_in_memory(1)
        schedule.pending = [object()]  # type: ignore[list-item]
        waiting = asyncio.create_task(schedule.plan(2, on_host=True, pinned=False))
        await asyncio.sleep(0.01)
        assert not waiting.done()  # no slot: it waits
        if meanwhile == "lose_base":
            schedule.lose_base()  # called, it was a delta on 1
        else:
            schedule.restart_from(1)  # count back to 0, which would schedule a base
        await schedule.release(schedule.pending[0])  # type: ignore[arg-type]
        return await waiting, schedule

    plan, schedule = asyncio.run(run())
    # Scheduled as the save was called (count 1): not a base, so not for the bases-only tier.
    assert plan == SavePlan(2, "base", None, False, (("persistent", "packed"),), None)
    assert not schedule.force_base
    assert schedule.count == (1 if meanwhile == "lose_base" else 0)


def test_a_plan_for_a_base_clears_force_base_and_a_skip_keeps_it() -> None:
    async def run() -> None:
        schedule = _schedule({"local": ALL_FULL}, set(), base_every=5, on_busy="skip")
        schedule.staged(await schedule.plan(1, on_host=True, pinned=False))
        schedule.lose_base()
        schedule.pending = [object()]  # type: ignore[list-item]
        skipped = await schedule.plan(2, on_host=True, pinned=False)
        assert skipped.kind == "skipped"
        assert schedule.force_base
        schedule.pending = []
        forced = await schedule.plan(3, on_host=True, pinned=False)
        assert (forced.kind, forced.scheduled_base) == ("base", False)
        assert not schedule.force_base

    asyncio.run(run())


# --- a tier that fell behind: make_room and catch_up ---------------------------------------------

B = Waiting  # a self-contained blob: Waiting(version)


def D(version: int, base: int) -> Waiting:
    """A delta of ``version`` against ``base``."""
    return Waiting(version, base)


@pytest.mark.parametrize(
    ("waiting", "held", "room", "keep"),
    [
        # Self-contained versions: the newest that fit, the oldest passed over.
        ([B(1), B(2), B(3)], set(), 2, (2, 3)),
        ([B(1), B(2), B(3), B(4), B(5)], set(), 4, (2, 3, 4, 5)),
        # A delta stays with its base when that only waits; a base too old to fit goes, and
        # the deltas on it with it.
        ([B(0), D(1, 0), B(2), D(3, 2), B(4), D(5, 4)], set(), 4, (2, 3, 4, 5)),
        ([B(0), D(1, 0), B(2), D(3, 2), D(4, 2)], set(), 2, (2, 4)),
        # A delta on a base the tier holds (or writes now) is whole on its own.
        ([D(5, 4), D(6, 4), D(7, 4)], {4}, 2, (6, 7)),
        # A delta whose base is nowhere can never be whole: it goes, whatever room is left.
        ([B(1), D(3, 2), B(4)], set(), 3, (1, 4)),
        # Room for one: a delta whose base only waits does not fit with it; the base does.
        ([B(1), D(2, 1)], set(), 1, (1,)),
        # Nothing can be whole.
        ([D(2, 1), D(3, 1)], set(), 4, ()),
    ],
)
def test_make_room_keeps_the_newest_whole_versions_that_fit(
    waiting: list[Waiting], held: set[int], room: int, keep: tuple[int, ...]
) -> None:
    kept = make_room(waiting, held, room)
    assert kept.keep == keep
    assert kept.drop == tuple(w.version for w in waiting if w.version not in keep)


@pytest.mark.parametrize(
    ("waiting", "held", "room", "keep"),
    [
        # Only the newest whole version is sent: older ones waited while the tier was down.
        ([B(1), B(2), B(3)], set(), 4, (3,)),
        # ...with its base first where that only waits.
        ([B(3), D(4, 3), B(6), D(7, 6), D(8, 6)], set(), 4, (6, 8)),
        ([D(7, 6), D(8, 6)], {6}, 4, (8,)),
        # The newest delta cannot be whole (its base failed): the newest whole one before it.
        ([B(3), D(4, 3), D(7, 6), D(8, 6)], set(), 4, (3, 4)),
        # A base and its delta do not fit in a room of one: the base alone.
        ([B(6), D(7, 6)], set(), 1, (6,)),
        ([D(7, 6)], set(), 4, ()),
        ([], set(), 4, ()),
    ],
)
def test_catch_up_keeps_only_the_newest_whole_version(
    waiting: list[Waiting], held: set[int], room: int, keep: tuple[int, ...]
) -> None:
    assert catch_up(waiting, held, room).keep == keep


def test_a_version_waits_once_and_room_is_at_least_one() -> None:
    for rule in (make_room, catch_up):
        with pytest.raises(ValueError, match="twice"):
            rule([B(1), D(1, 0)], set(), 2)
        with pytest.raises(ValueError, match="room"):
            rule([B(1)], set(), 0)


@st.composite
def _waiting(draw: st.DrawFn) -> tuple[list[Waiting], set[int], int]:
    """Versions waiting (unordered), some deltas on bases that wait, are held, or are gone."""
    versions = sorted(draw(st.sets(st.integers(0, 40), max_size=12)))
    held = draw(st.sets(st.integers(0, 40), max_size=4))
    out = []
    for v in versions:
        if draw(st.booleans()):
            out.append(B(v))
        else:
            out.append(D(v, draw(st.integers(0, 40).filter(lambda b, v=v: b < v)) if v else 0))
    out = [w for w in out if w.base is None or w.base != w.version]
    return draw(st.permutations(out)), held, draw(st.integers(1, 6))


def _needs(w: Waiting, held: set[int], waiting: list[Waiting]) -> set[int] | None:
    """An oracle for what a version needs to be whole, written apart from the rule's own."""
    if w.base is None or w.base in held:
        return {w.version}
    if any(o.version == w.base and o.base is None for o in waiting):
        return {w.base, w.version}
    return None


@given(_waiting())
@settings(max_examples=300, deadline=None)
def test_what_a_lane_keeps_is_whole_fits_and_never_loses_the_newest_whole_version(
    case: tuple[list[Waiting], set[int], int],
) -> None:
    waiting, held, room = case
    versions = sorted(w.version for w in waiting)
    whole = {w.version: n for w in waiting if (n := _needs(w, held, waiting)) is not None}
    # The newest version that is whole and fits on its own (with its base): never passed over.
    fitting = [v for v in versions if v in whole and len(whole[v]) <= room]
    for rule in (make_room, catch_up):
        kept: Kept = rule(waiting, held, room)
        assert sorted(kept.keep + kept.drop) == versions
        assert list(kept.keep) == sorted(kept.keep)
        assert list(kept.drop) == sorted(kept.drop)
        assert len(kept.keep) <= room
        # Whole: every kept delta's base is held or kept.
        for v in kept.keep:
            assert v in whole, (rule, v)
            assert whole[v] <= set(kept.keep), (rule, v)
        if fitting:
            assert fitting[-1] in kept.keep, rule
        else:
            assert kept.keep == ()
    # make_room passes over only what could not fit with what it keeps.
    kept = make_room(waiting, held, room)
    for v in kept.drop:
        assert v not in whole or len(set(kept.keep) | whole[v]) > room
    # catch_up keeps exactly the newest whole version and what it needs.
    if fitting:
        assert set(catch_up(waiting, held, room).keep) == whole[fitting[-1]]


class _Lane:
    """A lane as the engine runs one (tiercheck/engine/commit/lane.py), on versions alone: offers
    queue up, :func:`make_room` when full; the writer takes the oldest; a failed write makes
    :func:`catch_up` keep only the newest whole version of what waits."""

    def __init__(self, room: int) -> None:
        self.room = room
        self.queue: list[Waiting] = []
        self.writing: Waiting | None = None
        self.written: set[int] = set()
        self.failed: set[int] = set()

    def held(self) -> set[int]:
        return self.written | ({self.writing.version} if self.writing else set())

    def offer(self, w: Waiting) -> None:
        self.queue.append(w)
        if len(self.queue) > self.room:
            kept = make_room(self.queue, self.held(), self.room).keep
            self.queue = [q for q in self.queue if q.version in kept]

    def take(self) -> None:
        if self.writing is None and self.queue:
            self.writing = self.queue.pop(0)

    def end_write(self, ok: bool) -> None:
        if self.writing is None:
            return
        done, self.writing = self.writing, None
        if ok:
            self.written.add(done.version)
            return
        self.failed.add(done.version)
        if self.queue:
            kept = catch_up(self.queue, self.held(), self.room).keep
            self.queue = [q for q in self.queue if q.version in kept]


@given(
    bases=st.integers(1, 4),
    offers=st.integers(1, 30),
    timings=st.lists(
        st.lists(st.sampled_from(["offer", "take", "ok", "fail"]), max_size=80),
        min_size=2,
        max_size=3,
    ),
    room=st.integers(2, 5),
)
@settings(max_examples=300, deadline=None)
def test_every_rank_writes_the_newest_version_whatever_its_timing(
    bases: int, offers: int, timings: list[list[str]], room: int
) -> None:
    """The same versions offered in the same order on every rank (every ``bases``-th a base,
    the others deltas on the newest base), each rank's writer taking, writing and failing at
    its own pace (an outage is a run of failures): once the offers stop and the tier works,
    every rank that did not itself fail to write the newest version or its base has written
    both -- so the newest version commits wherever no rank's write of it failed, whatever
    each rank passed over on the way. (With ``tier_queue=1`` a delta never waits with its
    base, so ``room >= 2`` here.)"""
    offered = [B(v) if v % bases == 0 else D(v, v - v % bases) for v in range(offers)]
    newest = offered[-1]
    needed = {newest.version} | ({newest.base} if newest.base is not None else set())
    lanes = []
    for timing in timings:
        lane, left = _Lane(room), list(offered)
        for action in timing:
            if action == "offer" and left:
                lane.offer(left.pop(0))
            elif action == "take":
                lane.take()
            elif action in ("ok", "fail"):
                lane.end_write(action == "ok")
        for w in left:  # the rest of the offers, then the tier works again
            lane.offer(w)
        lane.end_write(True)
        while lane.queue:
            lane.take()
            lane.end_write(True)
        lanes.append(lane)
    for lane in lanes:
        assert lane.written <= {w.version for w in offered}
        if not lane.failed & needed:
            assert needed <= lane.written, (lane.written, lane.failed)
    if not any(lane.failed & needed for lane in lanes):
        assert all(needed <= lane.written for lane in lanes)
