"""The opening's verdict as a pure function (tiercheck/engine/judgement.py): the rules on facts
made up here, without a checkpointer, tiers or ranks."""

from __future__ import annotations

from typing import Any

import pytest

from tiercheck.consistency.identity import NodeIdentity
from tiercheck.consistency.protocol import OpenFacts
from tiercheck.engine.judgement import judge_opening
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
