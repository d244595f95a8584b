"""A tier's commit lag: when it is behind, what the log says, what ``health()`` reports."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from tiercheck import SyncCheckpointer
from tiercheck.engine.health import CommitLag, Health, TierHealth


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr("tiercheck.engine.health.time.monotonic", clock)
    return clock


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_more_saves_than_the_limit_make_a_tier_behind_and_a_commit_ends_it(
    clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    lag = CommitLag("local", saves=3, seconds=600)
    lag.opened({1, 4})
    assert lag.snapshot() == TierHealth("local", 4, None, 0, 0.0, False, None)
    caplog.set_level(logging.WARNING, "tiercheck")
    for version in (5, 6, 7):
        lag.sent(version)
        clock.now += 1
        lag.failed(version, "step 'vote' on channel 'local' timed out")
    assert not lag.snapshot().behind  # three is the limit, not yet past it
    assert _warnings(caplog) == []
    lag.sent(8)
    health = lag.snapshot()
    assert health.behind
    assert (health.newest, health.saves_since, health.behind_s) == (4, 4, 3.0)
    assert health.last_error == "version 7: step 'vote' on channel 'local' timed out"
    [warning] = _warnings(caplog)
    assert warning.startswith(
        "tiercheck: the 'local' tier is behind: its newest committed version is 4, and the 4 "
        "saves sent to it since have not committed there (the oldest 3.0s ago; limits: "
        "behind_saves=3, behind_seconds=600); a restore from it now would go back to version 4."
    )
    assert "timed out" in warning
    for version in (9, 10):  # still behind: not logged again
        lag.sent(version)
    assert len(_warnings(caplog)) == 1
    clock.now += 2
    lag.committed(9)  # the rounds resumed
    health = lag.snapshot()
    assert (health.newest, health.newest_age_s, health.saves_since) == (9, 2.0, 1)
    assert not health.behind
    assert _warnings(caplog)[1] == (
        "tiercheck: the 'local' tier commits again: version 9 is committed there (for 5.0s "
        "before, none of the saves sent to it committed; up to 6 were waiting)"
    )


def test_an_old_uncommitted_save_makes_a_tier_behind(
    clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    lag = CommitLag("persistent", saves=100, seconds=30)
    caplog.set_level(logging.WARNING, "tiercheck")
    lag.sent(0)
    assert lag.snapshot() == TierHealth("persistent", None, None, 1, 0.0, False, None)
    clock.now += 31
    # The figures move with the clock; the warning waits for the next event on the loop.
    assert lag.snapshot().behind
    assert lag.snapshot().behind_s == 31.0
    lag.sent(1)
    [warning] = _warnings(caplog)
    assert warning.startswith(
        "tiercheck: the 'persistent' tier is behind: it has no committed version, and 2 saves "
        "sent to it have not committed there (the oldest 31.0s ago;"
    )
    assert "find nothing there" in warning
    lag.committed(0)
    assert lag.snapshot() == TierHealth("persistent", 0, 31.0, 1, 0.0, False, None)
    assert "commits again: version 0" in _warnings(caplog)[1]


def test_an_older_commit_changes_nothing(clock: Clock) -> None:
    lag = CommitLag("local", saves=1, seconds=600)
    lag.sent(3)
    lag.committed(3)
    lag.committed(2)  # adopted late (a COMMIT record found after a lost exchange)
    assert lag.snapshot().newest == 3


def test_health_lists_the_tiers_of_a_real_checkpointer(tmp_path: Path) -> None:
    ckpt = SyncCheckpointer(
        "health",
        local_root=tmp_path / "shm",
        persistent=(tmp_path / "durable").as_uri(),
        rank=0,
        world_size=1,
        base_every=2,
        behind_saves=1,
    )
    assert ckpt.health() == Health()  # not open yet
    with ckpt:
        for version in range(3):
            ckpt.save(version, {"w": torch.full((4,), float(version))})
        ckpt.wait()
        health = ckpt.health()
    assert list(health.tiers) == ["local", "persistent"]
    assert health.behind == []
    local, persistent = health.tiers["local"], health.tiers["persistent"]
    assert (local.newest, local.saves_since, local.behind, local.last_error) == (2, 0, False, None)
    assert local.newest_age_s is not None
    assert local.newest_age_s >= 0
    assert persistent.newest == 2  # bases only: 0 and 2
