"""The opening's verdict as a pure function (tiercheck/engine/open/judgement.py): the rules on facts
made up here, without a checkpointer, tiers or ranks."""

from __future__ import annotations

from typing import Any

import pytest

from tiercheck.consistency.identity import NodeIdentity
from tiercheck.consistency.protocol import OpenFacts
from tiercheck.engine.open.judgement import judge_opening, judge_rejoin
from tiercheck.errors import JobLocked, StaleMemory, StorageError, WorldSizeMismatch

HERE = "file:///durable/job"
TOKEN = "t" + "0"  # an incarnation token, made up


def judge(everyone: list[OpenFacts], **kw: Any) -> Any:
    options: dict[str, Any] = {
        "job_id": "job",
        "here": HERE,
        "ranks": len(everyone),
        "elastic": False,
        "stale_policy": "refuse",
        "node_root": "/dev/shm/tiercheck/job",
    }
    options.update(kw)
    return judge_opening(everyone, **options)


def identity(token: str, *, world: int = 2, job_id: str = "job", where: str = HERE) -> str:
    record = NodeIdentity(job_id=job_id, token=token, world_size=world, persistent=where)
    return record.to_bytes().decode()


def found(token: str, world: int = 2) -> dict[str, Any]:
    return {"state": "found", "token": token, "world_size": world}


def test_a_new_job_takes_rank_0s_fresh_token_and_this_world() -> None:
    verdict = judge(
        [
            OpenFacts(0, 0, job={"state": "absent"}, fresh_token=TOKEN, has_data=False),
            OpenFacts(1, 0, has_data=False),
        ]
    )
    assert (verdict.job_token, verdict.stored_world, verdict.discard) == (TOKEN, 2, {})
    assert not verdict.record_behind
    assert verdict.adopted == ()


def test_the_job_records_incarnation_and_history_win() -> None:
    verdict = judge(
        [
            OpenFacts(0, 0, job=found("tok"), identity=identity("tok")),
            OpenFacts(1, 0, identity=identity("tok")),
        ]
    )
    assert (verdict.job_token, verdict.stored_world, verdict.discard) == ("tok", 2, {})


def test_a_locked_rank_or_a_failed_probe_refuses_the_opening() -> None:
    with pytest.raises(JobLocked, match="held by pid 7"):
        judge([OpenFacts(0, 0, lock="held by pid 7"), OpenFacts(1, 0)])
    with pytest.raises(StorageError, match="rank 1: read-only"):
        judge([OpenFacts(0, 0), OpenFacts(1, 0, probe={"persistent": "read-only"})])
    with pytest.raises(StorageError, match="repair-job"):
        judge([OpenFacts(0, 0, job_error="bad checksum"), OpenFacts(1, 0)])


def test_another_world_size_needs_elastic() -> None:
    facts = [OpenFacts(0, 0, job=found("tok", world=4), identity=identity("tok", world=4))]
    with pytest.raises(WorldSizeMismatch, match="saved by 4 ranks; this run has 1"):
        judge(facts)
    assert judge(facts, elastic=True).stored_world == 4


def test_memory_of_another_run_is_refused_discarded_or_never_adopted() -> None:
    facts = [
        OpenFacts(0, 0, job=found("tok"), identity=identity("tok")),
        OpenFacts(1, 0, identity=identity("old")),
    ]
    with pytest.raises(StaleMemory, match="another run"):
        judge(facts)
    discarded = judge(facts, stale_policy="discard")
    assert list(discarded.discard) == [1]
    assert "another run" in discarded.discard[1]
    # "adopt" takes only memory whose owner cannot be told, never another run's.
    with pytest.raises(StaleMemory):
        judge(facts, stale_policy="adopt")


def test_a_damaged_identity_is_adopted_only_when_asked() -> None:
    facts = [
        OpenFacts(0, 0, job=found("tok"), identity=identity("tok")),
        OpenFacts(1, 0, identity_error="bad json", identity_damaged=True),
    ]
    with pytest.raises(StaleMemory) as refused:
        judge(facts)
    assert refused.value.damaged == (1,)
    adopted = judge(facts, stale_policy="adopt")
    assert (adopted.adopted, adopted.discard) == ((1,), {})


# --- a durable tier that cannot be reached at opening ------------------------------------------

DOWN = "the 'persistent' tier cannot be used: EndpointConnectionError (test)"


def down(node: int, *, held: list[int] | None = None, **kw: Any) -> OpenFacts:
    """What a node's first rank sees when the durable tier cannot be reached: no job facts."""
    return OpenFacts(
        node,
        0,
        probe={"persistent": DOWN},
        unreachable={"persistent": DOWN},
        held=held,
        **kw,
    )


def test_memory_of_this_run_stands_in_for_an_unreachable_durable_tier() -> None:
    verdict = judge(
        [
            down(0, held=[4, 5], identity=identity("tok")),
            down(1, held=[4, 5], identity=identity("tok")),
        ]
    )
    assert verdict.unreachable == {"persistent": DOWN}
    assert (verdict.job_token, verdict.stored_world, verdict.discard) == ("tok", 2, {})
    # A node that holds nothing yet (a replacement) does not stand in the way.
    verdict = judge([down(0, held=[5], identity=identity("tok")), down(1, has_data=False)])
    assert verdict.unreachable == {"persistent": DOWN}
    # Nor does a rank that could reach it: rank 0 read the job record, which names the run.
    verdict = judge(
        [
            OpenFacts(0, 0, job=found("tok"), identity=identity("tok"), held=[5]),
            down(1, held=[5], identity=identity("tok")),
        ]
    )
    assert (verdict.unreachable, verdict.job_token) == ({"persistent": DOWN}, "tok")


@pytest.mark.parametrize(
    ("facts", "why"),
    [
        # A new job: nothing stored anywhere.
        ([down(0, has_data=False), down(1, has_data=False)], "holds no versions of job 'job'"),
        # Memory of this job, but saved to another durable location.
        (
            [down(0, held=[5], identity=identity("tok", where="s3://elsewhere/job"))],
            "holds no versions of job 'job' saved to",
        ),
        # Memory of another job.
        ([down(0, held=[5], identity=identity("tok", job_id="other"))], "holds no versions"),
        # Memory of two runs: which one is this job's cannot be told without the job record.
        (
            [down(0, held=[5], identity=identity("a")), down(1, held=[5], identity=identity("b"))],
            "different runs",
        ),
        # A node whose memory cannot be told: no identity, or a damaged one.
        (
            [down(0, held=[5], identity=identity("tok")), down(1, held=[5])],
            "node 1: it holds checkpoints but no identity record",
        ),
        (
            [
                down(0, held=[5], identity=identity("tok")),
                down(1, held=[5], identity_error="bad json", identity_damaged=True),
            ],
            "node 1: its identity record is damaged",
        ),
        # Identities of this run, but no version in memory.
        ([down(0, held=[], identity=identity("tok", world=1))], "holds no versions of job 'job'"),
        # Rank 0 read the job record: it names another run than the memory does.
        (
            [
                OpenFacts(0, 0, job=found("new"), identity=identity("tok"), held=[5]),
                down(1, held=[5], identity=identity("tok")),
            ],
            "another run",
        ),
    ],
)
def test_memory_that_cannot_be_verified_without_the_durable_tier_does_not_stand_in(
    facts: list[OpenFacts], why: str
) -> None:
    with pytest.raises(StorageError, match="cannot be used, so the job does not start") as raised:
        judge(facts, ranks=len(facts), stale_policy="discard")
    assert why in str(raised.value)
    assert "the nodes' memory cannot stand in for it" in str(raised.value)


def test_a_durable_tier_that_refuses_is_not_unreachable() -> None:
    # A permission error or a missing bucket does not pass: refused as ever, memory or not.
    refused = OpenFacts(
        0, 0, probe={"persistent": "AccessDenied"}, held=[5], identity=identity("t")
    )
    with pytest.raises(StorageError, match="AccessDenied") as raised:
        judge([refused], ranks=1)
    assert "stand in" not in str(raised.value)


def test_an_unreachable_tier_keeps_the_world_size_check() -> None:
    facts = [down(0, held=[5], identity=identity("tok", world=4))]
    with pytest.raises(WorldSizeMismatch, match="saved by 4 ranks"):
        judge(facts, ranks=1)
    assert judge(facts, ranks=1, elastic=True).unreachable == {"persistent": DOWN}


def rejoin(job: dict[str, Any], deleted: dict[str, Any] | None = None, **kw: Any) -> Any:
    options: dict[str, Any] = {
        "job_id": "job",
        "here": HERE,
        "token": "tok",
        "revision": 0,
        "worlds": (),
        "stored_world": 2,
        "opened_at": 1000.0,
        "newest_writer": (900.0, "an-earlier-session"),
    }
    options.update(kw)
    return judge_rejoin(job, deleted or {}, **options)


def test_a_tier_back_from_an_outage_is_claimed_when_it_is_this_runs() -> None:
    ok = rejoin({**found("tok"), "revision": 0})
    assert (ok.refused, ok.write_record, ok.note) == (None, False, None)
    # This run changed the history while it could not reach it: the record is written anew.
    assert rejoin({**found("tok"), "revision": 1}, revision=2).write_record
    # Written by `tiercheck repair-job` (a new token): the memory's incarnation wins.
    assert rejoin({**found("new"), "repaired": True}).write_record
    # Emptied meanwhile: the record is written again, and the user told.
    emptied = rejoin({"state": "absent", "committed": []})
    assert emptied.refused is None
    assert emptied.write_record
    assert "emptied" in emptied.note
    # Versions without a job record, of this run's number of ranks.
    legacy = {"state": "legacy", "world_size": 2, "worlds": [], "committed": [3, 4]}
    assert rejoin(legacy).write_record
    # No writer generation at all (a location emptied): nothing newer than this run.
    assert rejoin(found("tok"), newest_writer=None).refused is None


@pytest.mark.parametrize(
    ("job", "deleted", "kw", "why"),
    [
        (found("new"), {}, {}, "holds another run of job 'job'"),
        (found("tok"), {}, {"newest_writer": (1001.0, "s2")}, "another opening of job 'job'"),
        (found("tok"), {"tombstone": True, "deleted": ["tok"]}, {}, "tiercheck rm-job"),
        ({"state": "absent"}, {"tombstone": True, "deleted": []}, {}, "tiercheck rm-job"),
        (
            {"state": "legacy", "world_size": 4, "worlds": [], "committed": [7]},
            {},
            {},
            "saved by 4 ranks where this run's history says 2",
        ),
    ],
)
def test_a_tier_back_from_an_outage_that_is_not_this_runs_any_more_is_refused(
    job: dict[str, Any], deleted: dict[str, Any], kw: dict[str, Any], why: str
) -> None:
    verdict = rejoin(job, deleted, **kw)
    assert verdict.refused is not None
    assert why in verdict.refused
